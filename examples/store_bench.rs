//! The run store's own figures (BENCHMARKS.md), against the PostgreSQL that
//! `ABADA_TEST_DATABASE_URL` names. Two measurements:
//!
//! - direct (the default): one-turn tasks straight against the store as the worker runs them
//!   (claim with its input step, the model step, the finish queued to ride with a later claim,
//!   the queue flushed at the end as the worker's drain does): the latency of an append (p50,
//!   p99) and the transactions a one-turn task costs. `store_bench -- 400 8 0` (one-turn tasks,
//!   concurrent tasks, retention in seconds: 0 deletes runs as they finish, above keeps them);
//!   a fourth argument `own` gives each finish a transaction of its own, as before finishes rode with the next claim.
//! - `seed`: the seed's own check. The real worker binary (a child process, the load harness of
//!   `devkit::loadtest`) on a plain v1 engine with its journal in the store runs the same backlog
//!   at base model and tool latency and then with both ten times slower; prints, side by side,
//!   the store transaction durations per operation (claim, append, finish) from the worker's
//!   `/metrics`, transactions and engine requests per task. Once for one-turn tasks, once for
//!   tasks with tool calls. `store_bench -- seed --help` lists the knobs.
//!
//! ```text
//! eval "$(scripts/test-postgres start)"
//! cargo build --release --bin abada-agent-worker --example store_bench
//! target/release/examples/store_bench seed
//! scripts/test-postgres stop "$ABADA_TEST_POSTGRES_DIR"
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use abada_agent_worker::agent::journal::{input_step, model_step};
use abada_agent_worker::config::StoreConfig;
use abada_agent_worker::conversation::{AssistantMessage, Usage};
use abada_agent_worker::devkit::loadtest::{
    self, ChildProgram, Figures, LoadOptions, Scenario, StoreTarget,
};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::secret::SecretSource;
use abada_agent_worker::store::{Claimant, PgRunStore, RunEnd, RunKey};

const SEED_USAGE: &str = "\
usage: store_bench seed [FLAGS]

  --tasks N             tasks per run, default 200
  --slots N             worker slots (MAX_TASKS), default 16
  --pool N              ABADA_AGENT_STORE_POOL_SIZE, default: the worker's (8)
  --model-latency-ms N  base latency of a model call, default 100
  --tool-latency-ms N   base latency of a tool call, default 50
  --tool-calls N        tool-call turns per task in the second workload, default 1
  --factor N            how much slower the slow runs are, default 10
  --runs N              runs per cell (medians printed), default 1
  --worker-bin PATH     default: abada-agent-worker beside this example's directory";

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = std::env::var("ABADA_TEST_DATABASE_URL")
        .expect("ABADA_TEST_DATABASE_URL names the PostgreSQL to measure against");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if args.first().map(String::as_str) == Some("seed") {
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!("{SEED_USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        return match parse_seed(&args[1..]) {
            Ok(seed) => match rt.block_on(seed_check(seed, url)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("store_bench seed: {e}");
                    std::process::ExitCode::FAILURE
                }
            },
            Err(e) => {
                eprintln!("store_bench seed: {e}\n\n{SEED_USAGE}");
                std::process::ExitCode::from(2)
            }
        };
    }
    let mut args = args.into_iter();
    let tasks: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(400);
    let concurrency: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let retention: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    let own_finish = args.next().as_deref() == Some("own");
    rt.block_on(direct(
        tasks,
        concurrency,
        Duration::from_secs(retention),
        own_finish,
        url,
    ));
    std::process::ExitCode::SUCCESS
}

/// The knobs of the seed check.
struct Seed {
    tasks: u32,
    slots: u32,
    pool: Option<u32>,
    model_latency: Duration,
    tool_latency: Duration,
    tool_calls: u32,
    factor: u32,
    runs: u32,
    worker_bin: Option<PathBuf>,
}

fn parse_seed(args: &[String]) -> Result<Seed, String> {
    let mut s = Seed {
        tasks: 200,
        slots: 16,
        pool: None,
        model_latency: Duration::from_millis(100),
        tool_latency: Duration::from_millis(50),
        tool_calls: 1,
        factor: 10,
        runs: 1,
        worker_bin: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || -> Result<u64, String> {
            value.parse().map_err(|e| format!("{flag} {value:?}: {e}"))
        };
        match flag.as_str() {
            "--tasks" => s.tasks = num()? as u32,
            "--slots" => s.slots = num()? as u32,
            "--pool" => s.pool = Some(num()? as u32),
            "--model-latency-ms" => s.model_latency = Duration::from_millis(num()?),
            "--tool-latency-ms" => s.tool_latency = Duration::from_millis(num()?),
            "--tool-calls" => s.tool_calls = num()? as u32,
            "--factor" => s.factor = (num()? as u32).max(1),
            "--runs" => s.runs = (num()? as u32).max(1),
            "--worker-bin" => s.worker_bin = Some(PathBuf::from(value)),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(s)
}

fn default_worker_bin() -> PathBuf {
    // target/<profile>/examples/store_bench -> target/<profile>/abada-agent-worker
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent().map(|d| d.join("abada-agent-worker")))
        .unwrap_or_else(|| PathBuf::from("target/release/abada-agent-worker"))
}

/// Each workload (one-turn, then with tool calls) at base latency and `factor` times slower.
async fn seed_check(seed: Seed, url: String) -> Result<(), loadtest::LoadError> {
    let worker = ChildProgram::Worker(seed.worker_bin.clone().unwrap_or_else(default_worker_bin));
    println!(
        "seed check: {} tasks, {} slots, store pool {}, model {} ms, tool {} ms, x{}, {} run(s) per cell",
        seed.tasks,
        seed.slots,
        seed.pool.map_or("default".into(), |p| p.to_string()),
        seed.model_latency.as_millis(),
        seed.tool_latency.as_millis(),
        seed.factor,
        seed.runs
    );
    for tool_calls in [0, seed.tool_calls] {
        let mut cells = Vec::new();
        for factor in [1, seed.factor] {
            let opts = LoadOptions {
                scenario: Scenario::Backlog,
                slots: seed.slots,
                tasks: seed.tasks,
                model_latency: seed.model_latency * factor,
                tool_latency: seed.tool_latency * factor,
                tool_calls,
                poll_interval: Duration::from_millis(100),
                store: Some(StoreTarget {
                    url: url.clone(),
                    pool_size: seed.pool,
                    shared_pacing: true,
                }),
                ..LoadOptions::default()
            };
            let mut runs = Vec::new();
            for _ in 0..seed.runs {
                runs.push(loadtest::run(&worker, &opts).await?);
            }
            cells.push((factor, Figures::median(&runs)));
        }
        print_side_by_side(&seed, tool_calls, &cells);
        if tool_calls == seed.tool_calls {
            break;
        }
    }
    Ok(())
}

fn print_side_by_side(seed: &Seed, tool_calls: u32, cells: &[(u32, Figures)]) {
    let what = if tool_calls == 0 {
        "one-turn tasks (one model call)".to_string()
    } else {
        format!(
            "tasks with {tool_calls} tool call(s) ({} model calls)",
            tool_calls + 1
        )
    };
    println!("\n{what}:\n");
    let mut header = String::from("| figure |");
    let mut rule = String::from("| --- |");
    for (factor, _) in cells {
        let model = seed.model_latency * *factor;
        let tool = seed.tool_latency * *factor;
        if tool_calls == 0 {
            header.push_str(&format!(" x{factor} (model {} ms) |", model.as_millis()));
        } else {
            header.push_str(&format!(
                " x{factor} (model {} ms, tool {} ms) |",
                model.as_millis(),
                tool.as_millis()
            ));
        }
        rule.push_str(" ---: |");
    }
    println!("{header}\n{rule}");
    let rows: [(&str, &str); 20] = [
        ("store_claim_p50", "claim p50 (ms)"),
        ("store_claim_p99", "claim p99 (ms)"),
        ("store_claim_mean", "claim mean (ms)"),
        ("store_append_p50", "append p50 (ms)"),
        ("store_append_p99", "append p99 (ms)"),
        ("store_append_mean", "append mean (ms)"),
        ("store_finish_p50", "finish p50 (ms)"),
        ("store_finish_p99", "finish p99 (ms)"),
        ("store_finish_mean", "finish mean (ms)"),
        ("store_claim_count", "claims"),
        ("store_append_count", "appends"),
        ("store_finish_count", "finishes"),
        ("store_tx_per_task", "store transactions per task"),
        (
            "requests_per_task",
            "engine requests per task (fetches aside)",
        ),
        ("fetches_per_task", "fetches per task"),
        ("store_pool_wait_p50", "pool wait p50 (ms)"),
        ("store_pool_wait_p99", "pool wait p99 (ms)"),
        ("store_errors", "store errors"),
        ("tasks_per_s", "tasks/s"),
        ("child_warn_error_lines", "worker warn/error lines"),
    ];
    for (name, label) in rows {
        let mut line = format!("| {label} |");
        for (_, f) in cells {
            let v = f.get(name).unwrap_or(f64::NAN);
            if v.is_finite() {
                line.push_str(&format!(" {v:.2} |"));
            } else {
                line.push_str(" - |");
            }
        }
        println!("{line}");
    }
}

/// One-turn tasks straight against the store, `concurrency` at a time.
async fn direct(
    tasks: usize,
    concurrency: usize,
    retention: Duration,
    own_finish: bool,
    url: String,
) {
    let mut config = StoreConfig::new(Arc::new(SecretSource::value(url)));
    config.pool_size = concurrency;
    config.retention = retention;
    let metrics = Arc::new(Metrics::new());
    let store = PgRunStore::connect(&config, metrics.clone())
        .await
        .expect("the store connects");
    let run = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let mut joins = Vec::new();
    for lane in 0..concurrency {
        let store = store.clone();
        let run = run.clone();
        joins.push(tokio::spawn(async move {
            let mut appends = Vec::new();
            for i in (lane..tasks).step_by(concurrency) {
                let key = RunKey::new(format!("bench-{run}-{i}")).unwrap();
                let input = input_step(1, "You handle refund requests.", "o-1");
                let claimant = Claimant {
                    worker_id: "bench",
                    task_id: key.as_str(),
                    hold: Duration::from_secs(30),
                };
                let mut claim = store.claim(&key, &claimant, Some(&input)).await.unwrap();
                let answer = AssistantMessage {
                    text: Some(r#"{"decision": "refunded"}"#.into()),
                    tool_calls: vec![],
                };
                let step = model_step(2, "openai/refund", &answer, Usage::default(), "stop");
                let t = Instant::now();
                store.append(&mut claim.fence, &step).await.unwrap();
                appends.push(t.elapsed());
                if own_finish {
                    store.finish(&claim.fence, RunEnd::Completed).await.unwrap();
                } else {
                    store
                        .finish_later(&claim.fence, RunEnd::Completed)
                        .await
                        .unwrap();
                }
            }
            appends
        }));
    }
    let mut appends: Vec<Duration> = Vec::new();
    for j in joins {
        appends.extend(j.await.unwrap());
    }
    // The worker's drain: the finishes no later claim carried.
    let flushed = store.flush().await.unwrap();
    let took = started.elapsed();
    appends.sort();
    let pct = |p: f64| appends[((appends.len() as f64 * p) as usize).min(appends.len() - 1)];
    let text = metrics.encode();
    let count = |op: &str| -> u64 {
        let prefix =
            format!("abada_agent_store_transaction_duration_seconds_count{{operation=\"{op}\"}}");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let seconds = |op: &str| -> f64 {
        let prefix =
            format!("abada_agent_store_transaction_duration_seconds_sum{{operation=\"{op}\"}}");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let transactions = count("claim") + count("append") + count("finish");
    println!(
        "one-turn tasks: {tasks}, concurrency {concurrency}, {:.0} tasks/s",
        tasks as f64 / took.as_secs_f64()
    );
    println!(
        "store transactions per one-turn task: {:.2} (claim {}, append {}, finish {}; retention {} s; {} finishes flushed at the end)",
        transactions as f64 / tasks as f64,
        count("claim"),
        count("append"),
        count("finish"),
        retention.as_secs(),
        flushed
    );
    println!(
        "claim transaction mean: {:.2} ms (the lock, the rule, the claim, the input step)",
        seconds("claim") / count("claim") as f64 * 1e3
    );
    println!(
        "append latency: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        appends.last().unwrap().as_secs_f64() * 1e3
    );
}
