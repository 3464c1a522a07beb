//! The load harness: drives the real worker binary (a child process) against the devkit engine
//! emulator and scripted model on loopback, and prints figures. See `BENCHMARKS.md`.
//!
//! ```text
//! cargo build --release && cargo run --release --example loadtest -- --scenario backlog \
//!     --slots 50 --tasks 2000 --model-latency-ms 100 --floor --runs 5
//! ```
//!
//! Partial fetch answers: an engine answering at most 2 tasks per fetch, as
//! concurrent fetches under `SKIP LOCKED` do; one worker of 8 slots, then two on one engine:
//!
//! ```text
//! cargo run --release --example loadtest -- --scenario partial
//! ```
//!
//! Fetch contention: an engine whose fetch transactions hold every candidate row for 15 ms,
//! as the real engine on H2 does (a fetch meanwhile answers empty); 4 workers of 8 slots, 800
//! tasks of 500 ms; prints each worker's tasks and slot use, their spread around the mean, the
//! share of the ceiling and the fetches answered empty:
//!
//! ```text
//! cargo run --release --example loadtest -- --scenario contention
//! ```
//!
//! A provider rate limit: the scripted model states 120 requests a minute on every answer
//! (`x-ratelimit-*`, as OpenAI does) and enforces it quantized, a second's worth (2) in each
//! second, answering 429 with `retry-after-ms` beyond; one worker of 8 slots, 30 one-call tasks,
//! or several workers sharing the quota; prints the share of the limit used, 429s, tasks
//! deferred and claims given back:
//!
//! ```text
//! cargo run --release --example loadtest -- --scenario ratelimit --rpm 120 --tasks 30 --slots 8
//! cargo run --release --example loadtest -- --scenario ratelimit --workers 4 --tasks 100
//! ```
//!
//! The same program is the floor client when started with `--floor-client` (the harness does
//! that itself for `--floor`).

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{FetchContention, FetchLocks};
use abada_agent_worker::devkit::loadtest::{
    self, ChildProgram, Figures, FloorOptions, LoadOptions, Scenario,
};
use abada_agent_worker::devkit::model::{Quantization, RateLimit};

const USAGE: &str = "\
usage: loadtest [FLAGS]

  --scenario S          backlog (default) | pickup | idle | scaling | partial | contention | ratelimit
                        partial: a backlog on an engine answering at most --fetch-cap tasks per
                        fetch, run with 1 worker, then 2 sharing the engine (or --workers N);
                        its defaults: --slots 8 --tasks 160 --model-latency-ms 200 --fetch-cap 2
                        contention: a backlog shared by --workers on an engine whose fetch
                        transactions last --fetch-transaction-ms, locking --fetch-locks; its
                        defaults: --workers 4 --slots 8 --tasks 800 --model-latency-ms 500
                        --fetch-transaction-ms 15 --fetch-locks every-candidate
                        ratelimit: a backlog against a model allowing --rpm requests a minute,
                        stated in x-ratelimit-* headers, enforced a second's worth per second,
                        429 beyond; its defaults: --slots 8 --tasks 30 --model-latency-ms 100
                        --rpm 120 (with --workers N, N workers share the quota)
  --rpm N               ratelimit: requests per minute the model allows, default 120
  --tpm N               ratelimit: tokens per minute it allows too, default: none binding
  --quantization Q      ratelimit: window (a second's worth per second window, default) |
                        bucket (a bucket of a second's worth, refilled evenly)
  --stated yes|no       ratelimit: whether answers state the limit (no: like vLLM), default yes
  --store-url URL       backlog, ratelimit: the workers keep their journals in this run store
                        (a plain v1 engine, an agents file) and pace model calls together in it
                        (ABADA_AGENT_STORE_SHARED_PACING), e.g. $ABADA_TEST_DATABASE_URL
  --no-shared-pacing    with --store-url: each worker paces alone (ABADA_AGENT_STORE_SHARED_PACING=false)
  --slots N             worker slots (MAX_TASKS), default 50
  --tasks N             tasks per run (backlog size, or tasks created one by one for pickup), default 1000
  --model-latency-ms N  scripted model latency per call, default 100
  --tool-calls N        tool-call turns per task before the final answer, default 0
  --payload-bytes N     text size of each tool call and result, default 200
  --engine-latency-ms N latency added to every engine request, default 0
  --lock-ms N           lock duration, default 60000
  --poll-ms N           poll interval, default 1000
  --idle-secs N         idle scenario length, default 20
  --runs N              repeat each measurement N times and print medians, default 1
  --fetch-cap N         the engine answers at most N tasks per fetch, default: as asked
  --fetch-transaction-ms N  each fetch's transaction lasts N ms, holding its row locks and
                        answering at its end (the real engine's contention), default 0: none
  --fetch-locks L       what a fetch's transaction locks: every-candidate (the engine on H2, a
                        fetch meanwhile answers empty; default) | returned-rows (on PostgreSQL)
  --workers N           backlog: N worker processes share the engine (1..=4), default 1
  --backlog-first       with --workers: the backlog waits before the workers start together,
                        instead of appearing once each has fetched from the empty queue
  --floor               backlog: also run the floor client with the same knobs, in the same run
  --scaling-slots LIST  scaling: slot counts, default 1,4,16,50
  --scaling-tasks LIST  scaling: backlog sizes, default 100,1000,10000
  --worker-bin PATH     default: target/release/abada-agent-worker beside this example
  --floor-bin PATH      the floor client's program, started with --floor-client and its flags
                        (e.g. a script running this example under valgrind), default: this example";

struct Args {
    scenario: String,
    /// `--workers`, when given.
    workers: Option<u32>,
    opts: LoadOptions,
    runs: u32,
    floor: bool,
    idle: Duration,
    scaling_slots: Vec<u32>,
    scaling_tasks: Vec<u32>,
    worker_bin: Option<PathBuf>,
    /// `--floor-bin`, when given.
    floor_bin: Option<PathBuf>,
}

fn parse_list(v: &str) -> Result<Vec<u32>, String> {
    v.split(',')
        .map(|x| x.trim().parse().map_err(|e| format!("{x:?}: {e}")))
        .collect()
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    // The partial scenario's own defaults, which flags may still change.
    let partial = args
        .windows(2)
        .any(|w| w[0] == "--scenario" && w[1] == "partial");
    let ratelimit = args
        .windows(2)
        .any(|w| w[0] == "--scenario" && w[1] == "ratelimit");
    let contention = args
        .windows(2)
        .any(|w| w[0] == "--scenario" && w[1] == "contention");
    let opts = if contention {
        LoadOptions {
            slots: 8,
            tasks: 800,
            model_latency: Duration::from_millis(500),
            fetch_contention: Some(FetchContention::h2(Duration::from_millis(15))),
            workers: 4,
            ..LoadOptions::default()
        }
    } else if ratelimit {
        LoadOptions {
            slots: 8,
            tasks: 30,
            model_latency: Duration::from_millis(100),
            rate_limit: Some(RateLimit::per_minute(120)),
            ..LoadOptions::default()
        }
    } else if partial {
        LoadOptions {
            slots: 8,
            tasks: 160,
            model_latency: Duration::from_millis(200),
            fetch_answer_cap: NonZeroU32::new(2),
            ..LoadOptions::default()
        }
    } else {
        LoadOptions::default()
    };
    let mut a = Args {
        scenario: "backlog".into(),
        workers: None,
        opts,
        runs: 1,
        floor: false,
        idle: Duration::from_secs(20),
        scaling_slots: vec![1, 4, 16, 50],
        scaling_tasks: vec![100, 1000, 10_000],
        worker_bin: None,
        floor_bin: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--floor" {
            a.floor = true;
            continue;
        }
        if flag == "--backlog-first" {
            a.opts.backlog_first = true;
            continue;
        }
        if flag == "--no-shared-pacing" {
            continue;
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .as_str();
        let num = || -> Result<u64, String> {
            value.parse().map_err(|e| format!("{flag} {value:?}: {e}"))
        };
        match flag.as_str() {
            "--scenario" => a.scenario = value.to_string(),
            "--slots" => a.opts.slots = num()? as u32,
            "--tasks" => a.opts.tasks = num()? as u32,
            "--model-latency-ms" => a.opts.model_latency = Duration::from_millis(num()?),
            "--tool-calls" => a.opts.tool_calls = num()? as u32,
            "--payload-bytes" => a.opts.payload_bytes = num()? as usize,
            "--engine-latency-ms" => a.opts.engine_latency = Duration::from_millis(num()?),
            "--lock-ms" => a.opts.lock_duration = Duration::from_millis(num()?),
            "--poll-ms" => a.opts.poll_interval = Duration::from_millis(num()?),
            "--idle-secs" => a.idle = Duration::from_secs(num()?),
            "--runs" => a.runs = (num()? as u32).max(1),
            "--fetch-cap" => {
                a.opts.fetch_answer_cap = Some(
                    NonZeroU32::new(num()? as u32)
                        .ok_or_else(|| format!("{flag} must be at least 1"))?,
                )
            }
            "--workers" => a.workers = Some(num()? as u32),
            "--fetch-transaction-ms" => {
                let locks = a
                    .opts
                    .fetch_contention
                    .map_or_else(FetchLocks::default, |c| c.locks);
                a.opts.fetch_contention = Some(FetchContention {
                    locks,
                    transaction: Duration::from_millis(num()?),
                })
                .filter(|c| !c.transaction.is_zero());
            }
            "--fetch-locks" => {
                let locks = match value {
                    "every-candidate" => FetchLocks::EveryCandidate,
                    "returned-rows" => FetchLocks::ReturnedRows,
                    other => {
                        return Err(format!(
                            "{flag} {other:?}: every-candidate or returned-rows"
                        ));
                    }
                };
                let transaction = a
                    .opts
                    .fetch_contention
                    .map_or(Duration::from_millis(15), |c| c.transaction);
                a.opts.fetch_contention = Some(FetchContention { locks, transaction });
            }
            "--store-url" => {
                a.opts.store = Some(loadtest::StoreTarget {
                    url: value.to_string(),
                    pool_size: None,
                    shared_pacing: !args.iter().any(|x| x == "--no-shared-pacing"),
                })
            }
            "--rpm" | "--tpm" | "--quantization" | "--stated" => {
                let limit = a.opts.rate_limit.get_or_insert(RateLimit::per_minute(120));
                match flag.as_str() {
                    "--rpm" => {
                        limit.requests_per_minute = u32::try_from(num()?)
                            .ok()
                            .filter(|n| *n > 0)
                            .ok_or_else(|| format!("{flag} must be 1 or more"))?
                    }
                    "--tpm" => limit.tokens_per_minute = Some(num()?.max(1)),
                    "--quantization" => {
                        limit.quantization = match value {
                            "window" => Quantization::SecondWindow,
                            "bucket" => Quantization::SecondBucket,
                            other => return Err(format!("{flag} {other:?}: window or bucket")),
                        }
                    }
                    _ => {
                        limit.stated = match value {
                            "yes" => true,
                            "no" => false,
                            other => return Err(format!("{flag} {other:?}: yes or no")),
                        }
                    }
                }
            }
            "--scaling-slots" => a.scaling_slots = parse_list(value)?,
            "--scaling-tasks" => a.scaling_tasks = parse_list(value)?,
            "--worker-bin" => a.worker_bin = Some(PathBuf::from(value)),
            "--floor-bin" => a.floor_bin = Some(PathBuf::from(value)),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn floor_args(args: &[String]) -> Result<FloorOptions, String> {
    let mut o = FloorOptions {
        engine_url: String::new(),
        model_url: String::new(),
        slots: 1,
        poll_interval: Duration::from_secs(1),
        lock_duration: Duration::from_secs(60),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || -> Result<u64, String> { value.parse().map_err(|e| format!("{flag}: {e}")) };
        match flag.as_str() {
            "--engine-url" => o.engine_url = value.clone(),
            "--model-url" => o.model_url = value.clone(),
            "--slots" => o.slots = num()? as u32,
            "--poll-ms" => o.poll_interval = Duration::from_millis(num()?),
            "--lock-ms" => o.lock_duration = Duration::from_millis(num()?),
            other => return Err(format!("unknown floor flag {other:?}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--floor-client") {
        let opts = match floor_args(&args[1..]) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("loadtest --floor-client: {e}");
                return ExitCode::from(2);
            }
        };
        // The same runtime the worker builds: multi-threaded, one thread per core.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(loadtest::run_floor_client(opts));
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let a = match parse_args(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("loadtest: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(a)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadtest: {e}");
            ExitCode::FAILURE
        }
    }
}

fn default_worker_bin() -> PathBuf {
    // target/<profile>/examples/loadtest -> target/<profile>/abada-agent-worker
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent().map(|d| d.join("abada-agent-worker")))
        .unwrap_or_else(|| PathBuf::from("target/release/abada-agent-worker"))
}

async fn run(a: Args) -> Result<(), loadtest::LoadError> {
    let worker = ChildProgram::Worker(a.worker_bin.clone().unwrap_or_else(default_worker_bin));
    let floor = ChildProgram::Floor {
        program: a.floor_bin.clone().unwrap_or_else(|| {
            std::env::current_exe().unwrap_or_else(|_| PathBuf::from("loadtest"))
        }),
        args: Vec::new(),
    };
    let mut opts = a.opts.clone();
    if let Some(workers) = a.workers {
        opts.workers = workers;
    }
    println!("knobs: {opts:?}, runs {}", a.runs);
    match a.scenario.as_str() {
        "partial" | "contention" => {
            opts.scenario = Scenario::Backlog;
            let default_workers = if a.scenario == "partial" {
                vec![1, 2]
            } else {
                vec![opts.workers]
            };
            for workers in a.workers.map_or(default_workers, |w| vec![w]) {
                let o = LoadOptions {
                    workers,
                    ..opts.clone()
                };
                let mut runs = Vec::new();
                for i in 0..a.runs {
                    let f = loadtest::run(&worker, &o).await?;
                    println!("\n{workers} worker(s), run {}:\n{}", i + 1, f.table());
                    runs.push(f);
                }
                println!(
                    "\n{workers} worker(s), medians over {} runs:\n{}",
                    a.runs,
                    Figures::median(&runs).table()
                );
            }
        }
        "backlog" => {
            opts.scenario = Scenario::Backlog;
            let mut runs = Vec::new();
            for i in 0..a.runs {
                let mut f = loadtest::run(&worker, &opts).await?;
                if a.floor {
                    let fl = loadtest::run(&floor, &opts).await?;
                    let w = f.get("cpu_per_task").unwrap_or(f64::NAN);
                    let c = fl.get("cpu_per_task").unwrap_or(f64::NAN);
                    for (from, to) in [
                        ("cpu_per_task", "floor_cpu_per_task"),
                        ("requests_per_task", "floor_requests_per_task"),
                        ("tasks_per_s", "floor_tasks_per_s"),
                        ("slot_utilisation", "floor_slot_utilisation"),
                        ("refill_p50", "floor_refill_p50"),
                        ("refill_p99", "floor_refill_p99"),
                        ("rss_peak", "floor_rss_peak"),
                    ] {
                        if let Some(g) = fl.0.iter().find(|g| g.name == from) {
                            f.0.push(loadtest::Figure {
                                name: to,
                                unit: g.unit,
                                value: g.value,
                            });
                        }
                    }
                    f.0.push(loadtest::Figure {
                        name: "cpu_ratio_vs_floor",
                        unit: "x",
                        value: w / c,
                    });
                }
                println!("\nrun {}:\n{}", i + 1, f.table());
                runs.push(f);
            }
            println!(
                "\nmedians over {} runs:\n{}",
                a.runs,
                Figures::median(&runs).table()
            );
        }
        "ratelimit" => {
            opts.scenario = Scenario::Backlog;
            let mut runs = Vec::new();
            for i in 0..a.runs {
                let f = loadtest::run(&worker, &opts).await?;
                println!("\nrun {}:\n{}", i + 1, f.table());
                runs.push(f);
            }
            println!(
                "\nmedians over {} runs:\n{}",
                a.runs,
                Figures::median(&runs).table()
            );
        }
        "pickup" | "idle" => {
            opts.scenario = if a.scenario == "pickup" {
                Scenario::Pickup
            } else {
                Scenario::Idle { duration: a.idle }
            };
            let mut runs = Vec::new();
            for i in 0..a.runs {
                let f = loadtest::run(&worker, &opts).await?;
                println!("\nrun {}:\n{}", i + 1, f.table());
                runs.push(f);
            }
            println!(
                "\nmedians over {} runs:\n{}",
                a.runs,
                Figures::median(&runs).table()
            );
        }
        "scaling" => {
            opts.scenario = Scenario::Backlog;
            let mut rows = Vec::new();
            for &slots in &a.scaling_slots {
                for &tasks in &a.scaling_tasks {
                    let mut runs = Vec::new();
                    for _ in 0..a.runs {
                        let o = LoadOptions {
                            slots,
                            tasks,
                            ..opts.clone()
                        };
                        runs.push(loadtest::run(&worker, &o).await?);
                    }
                    let m = Figures::median(&runs);
                    let cell = (
                        slots,
                        tasks,
                        m.get("tasks_per_s").unwrap_or(f64::NAN),
                        m.get("cpu_per_task").unwrap_or(f64::NAN),
                        m.get("cpu_total").unwrap_or(f64::NAN),
                        m.get("rss_peak").unwrap_or(f64::NAN),
                    );
                    println!(
                        "slots {:>2} tasks {:>5}: {:>7.1} tasks/s, {:.3} ms CPU/task, {:.2} s CPU, {:.1} MB peak RSS",
                        cell.0, cell.1, cell.2, cell.3, cell.4, cell.5
                    );
                    rows.push(cell);
                }
            }
            println!(
                "\n| slots | backlog | tasks/s | worker CPU per task (ms) | worker CPU total (s) | peak RSS (MB) |\n| ---: | ---: | ---: | ---: | ---: | ---: |"
            );
            for r in rows {
                println!(
                    "| {} | {} | {:.1} | {:.3} | {:.2} | {:.1} |",
                    r.0, r.1, r.2, r.3, r.4, r.5
                );
            }
        }
        other => {
            eprintln!("loadtest: unknown scenario {other:?}\n\n{USAGE}");
        }
    }
    Ok(())
}
