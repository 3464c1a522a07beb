//! The benchmark against a REAL Abada engine: the harness deploys a one-node
//! process (start → service task `benchAgent` → end) to an engine already running on loopback,
//! starts `--tasks` instances (the backlog), then runs `--workers` release worker processes of
//! `--slots` slots each against it, with the devkit's scripted model (one final answer after
//! `--model-latency-ms`) and, with `--store-admin-url`, a run store in a database of its own
//! per run. Nothing of the engine is here: start it yourself (docs/REAL_ENGINE.md, BENCHMARKS.md).
//!
//! ```text
//! cargo build --release --bin abada-agent-worker --example engine_bench
//! ./target/release/examples/engine_bench --engine-url http://127.0.0.1:5711/api \
//!     --engine-pid "$(cat engine.pid)" --workers 2 --slots 8 --tasks 300 --model-latency-ms 100 \
//!     [--store-admin-url postgres://USER:PASSWORD@127.0.0.1:PORT/postgres?sslmode=disable] [--runs 3]
//! ```
//!
//! What it prints per run, and how it is measured (no engine call log exists here, so the
//! worker's own records are the source):
//! - each task's start and end from the worker's `task ended` log line (its timestamp and
//!   `duration_ms`: start of the task's handling after the fetch, to the end of its report);
//! - **slot use** over the deep-backlog window (the first task's start to the last task's start:
//!   while the queue still held tasks), busy slot time / (slots x window), for all workers and
//!   for each worker (from its own first start to the window's end);
//! - **tasks/s** over the whole run (first start to last end) against the slots x latency
//!   ceiling, and the best wall time possible for the backlog (`ceil(tasks / slots)` model
//!   latencies);
//! - engine requests and store transactions per task from the workers' `/metrics`;
//! - the engine's and the workers' CPU per task (`/proc/<pid>/stat`, from just before the
//!   workers start to the last task's end; the engine's idle CPU rate, measured just before, is
//!   printed too), each worker process's CPU in all and before its first fetch (start-up), and
//!   its peak RSS (`VmHWM`) at the end.
//!
//! **The peer** (`--peer camunda`): instead of our worker, the Camunda 7 external task client
//! (`bench/camunda-peer`, built with `mvn -q package` there) does the same one-turn tasks on the
//! same engine and the same scripted model: one chat-completions call, then complete with the
//! answer. It speaks Camunda 7's REST API, so it reaches the engine through
//! `examples/camunda_bridge.rs`, a separate process whose CPU and memory are printed apart
//! (`bridge_*`), charged to neither side. `--camunda-mode sequential` is one client with
//! `maxTasks` = `--slots` (its handlers run one after the other, as the client documents);
//! `clients` is `--slots` clients of `maxTasks` 1 in one JVM (the maintainers' way to work in
//! parallel). The wall time runs from the bridge's first fetch answer with tasks to its last
//! completion, the counterpart of the worker's first task start to last task end; the client's
//! CPU is the JVM's (`/proc/<pid>/stat`) from its start to the last completion, start-up (before
//! its first fetch) printed apart; its peak RSS is the JVM's `VmHWM`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use abada_agent_worker::devkit::loadtest::{Histogram, clock_ticks, cpu_seconds, status_mb};
use abada_agent_worker::devkit::model::{Script, ScriptedModel, Turn};
use serde_json::{Value, json};

const USAGE: &str = "\
usage: engine_bench --engine-url URL --engine-pid PID [FLAGS]

  --engine-url URL        the engine's API base, e.g. http://127.0.0.1:5711/api (security mode disabled)
  --engine-pid PID        the engine's process, for its CPU
  --workers N             worker processes, default 2
  --slots N               slots per worker (ABADA_AGENT_MAX_TASKS), default 8
  --tasks N               instances started before the workers (the backlog), default 300
  --model-latency-ms N    scripted model latency, default 100
  --poll-ms N             default 1000
  --lock-ms N             default 60000
  --runs N                repeat, default 1
  --store-admin-url URL   run store: a database of its own per run is created (and dropped) there
  --worker-bin PATH       default: target/release/abada-agent-worker beside this example
  --keep-logs DIR         keep each worker's log in DIR
  --peer worker|camunda   who does the tasks, default worker (ours); camunda: the Camunda 7 client
  --camunda-dir DIR       the built bench/camunda-peer (target/*.jar and target/lib), default bench/camunda-peer
  --camunda-mode MODE     sequential (one client, maxTasks = --slots) or clients (--slots clients of maxTasks 1)
  --java PATH             the java launcher for the peer, default java
  --bridge-bin PATH       default: camunda_bridge beside this example";

const ACTIVITY: &str = "benchAgent";
const MODEL: &str = "bench";

#[derive(Clone)]
struct Args {
    engine_url: String,
    engine_pid: u32,
    workers: u32,
    slots: u32,
    tasks: u32,
    model_latency: Duration,
    poll_ms: u64,
    lock_ms: u64,
    runs: u32,
    store_admin_url: Option<String>,
    worker_bin: PathBuf,
    keep_logs: Option<PathBuf>,
    peer: Peer,
    camunda_dir: PathBuf,
    camunda_mode: String,
    java: PathBuf,
    bridge_bin: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Peer {
    Worker,
    Camunda,
}

fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut flags = BTreeMap::new();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        flags.insert(flag.clone(), value.clone());
    }
    let num = |flag: &str, default: u64| -> Result<u64, String> {
        flags.get(flag).map_or(Ok(default), |v| {
            v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
        })
    };
    let exe = std::env::current_exe().ok();
    let default_bin = exe
        .as_ref()
        .and_then(|p| Some(p.parent()?.parent()?.join("abada-agent-worker")))
        .unwrap_or_else(|| PathBuf::from("target/release/abada-agent-worker"));
    let default_bridge = exe
        .as_ref()
        .and_then(|p| Some(p.parent()?.join("camunda_bridge")))
        .unwrap_or_else(|| PathBuf::from("target/release/examples/camunda_bridge"));
    let peer = match flags.get("--peer").map(String::as_str) {
        None | Some("worker") => Peer::Worker,
        Some("camunda") => Peer::Camunda,
        Some(other) => return Err(format!("--peer is worker or camunda, not {other:?}")),
    };
    let args = Args {
        engine_url: flags
            .get("--engine-url")
            .ok_or("--engine-url is required")?
            .trim_end_matches('/')
            .to_string(),
        engine_pid: num("--engine-pid", 0)? as u32,
        workers: num("--workers", 2)? as u32,
        slots: num("--slots", 8)? as u32,
        tasks: num("--tasks", 300)? as u32,
        model_latency: Duration::from_millis(num("--model-latency-ms", 100)?),
        poll_ms: num("--poll-ms", 1000)?,
        lock_ms: num("--lock-ms", 60_000)?,
        runs: num("--runs", 1)? as u32,
        store_admin_url: flags.get("--store-admin-url").cloned(),
        worker_bin: flags.get("--worker-bin").map_or(default_bin, PathBuf::from),
        keep_logs: flags.get("--keep-logs").map(PathBuf::from),
        peer,
        camunda_dir: flags
            .get("--camunda-dir")
            .map_or_else(|| PathBuf::from("bench/camunda-peer"), PathBuf::from),
        camunda_mode: flags
            .get("--camunda-mode")
            .cloned()
            .unwrap_or_else(|| "sequential".into()),
        java: flags
            .get("--java")
            .map_or_else(|| PathBuf::from("java"), PathBuf::from),
        bridge_bin: flags
            .get("--bridge-bin")
            .map_or(default_bridge, PathBuf::from),
    };
    if !["sequential", "clients"].contains(&args.camunda_mode.as_str()) {
        return Err("--camunda-mode is sequential or clients".into());
    }
    if args.engine_pid == 0 {
        return Err("--engine-pid is required".into());
    }
    if !(1..=16).contains(&args.workers) || args.slots == 0 || args.tasks == 0 {
        return Err("--workers 1..=16, --slots and --tasks at least 1".into());
    }
    Ok(args)
}

fn bench_bpmn(process: &str, topic: &str) -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<bpmn:definitions xmlns:bpmn="http://www.omg.org/spec/BPMN/20100524/MODEL"
                  xmlns:camunda="http://camunda.org/schema/1.0/bpmn"
                  id="Definitions_{process}" targetNamespace="http://abada.dev/bench">
  <bpmn:process id="{process}" name="Engine benchmark" isExecutable="true">
    <bpmn:startEvent id="start"/>
    <bpmn:serviceTask id="{ACTIVITY}" name="Bench agent" camunda:topic="{topic}"/>
    <bpmn:endEvent id="end"/>
    <bpmn:sequenceFlow id="f1" sourceRef="start" targetRef="{ACTIVITY}"/>
    <bpmn:sequenceFlow id="f2" sourceRef="{ACTIVITY}" targetRef="end"/>
  </bpmn:process>
</bpmn:definitions>
"#
    )
}

async fn deploy(http: &reqwest::Client, args: &Args, xml: &str) -> Result<(), String> {
    let boundary = "abada-bench-boundary-7f3c";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"bench.bpmn\"\r\n\
         Content-Type: application/xml\r\n\r\n{xml}\r\n--{boundary}--\r\n"
    );
    let answer = http
        .post(format!("{}/v1/processes/deploy", args.engine_url))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await
        .map_err(|e| format!("deploy: {e}"))?;
    let status = answer.status();
    if !status.is_success() {
        let text = answer.text().await.unwrap_or_default();
        return Err(format!("deploy answered {status}: {text}"));
    }
    Ok(())
}

/// Starts the backlog, 8 requests at a time.
async fn start_instances(http: &reqwest::Client, args: &Args, process: &str) -> Result<(), String> {
    let url = format!("{}/v1/processes/start?processId={process}", args.engine_url);
    let mut next = 0u32;
    while next < args.tasks {
        let batch: Vec<_> = (next..(next + 8).min(args.tasks))
            .map(|i| {
                let url = url.clone();
                async move {
                    let answer = http
                        .post(&url)
                        .json(&json!({"orderId": format!("o-{i}")}))
                        .send()
                        .await
                        .map_err(|e| format!("start: {e}"))?;
                    if answer.status().is_success() {
                        Ok(())
                    } else {
                        Err(format!("start answered {}", answer.status()))
                    }
                }
            })
            .collect();
        for r in futures::future::join_all(batch).await {
            r?;
        }
        next = (next + 8).min(args.tasks);
    }
    Ok(())
}

struct Worker {
    id: String,
    child: Child,
    log: PathBuf,
    admin: Option<String>,
}

/// Stops a child process as an operator would: SIGTERM, then SIGKILL if it has not exited
/// within 10 s.
fn stop_child(child: &mut Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_if_running(child);
}

/// Kills a child process still running and reaps it: no process outlives the benchmark.
fn kill_if_running(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Worker {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn stop(&mut self) {
        stop_child(&mut self.child);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        kill_if_running(&mut self.child);
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker(
    args: &Args,
    dir: &Path,
    id: &str,
    topic: &str,
    model_url: &str,
    agents: &Path,
    store_url: Option<&str>,
) -> Result<Worker, String> {
    let log = dir.join(format!("{id}.log"));
    let out = std::fs::File::create(&log).map_err(|e| format!("log file: {e}"))?;
    let err = out.try_clone().map_err(|e| format!("log file: {e}"))?;
    let mut cmd = Command::new(&args.worker_bin);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ABADA_AGENT_ENGINE_URL", &args.engine_url)
        .env("ABADA_AGENT_WORKER_ID", id)
        .env("ABADA_AGENT_TOPICS", topic)
        .env("ABADA_AGENT_PROVIDERS", "openai")
        .env("ABADA_AGENT_PROVIDER_OPENAI_BASE_URL", model_url)
        .env("ABADA_AGENT_AGENTS_FILE", agents)
        .env("ABADA_AGENT_MAX_TASKS", args.slots.to_string())
        .env("ABADA_AGENT_POLL_INTERVAL_MS", args.poll_ms.to_string())
        .env("ABADA_AGENT_LOCK_DURATION_MS", args.lock_ms.to_string())
        .env("ABADA_AGENT_HTTP_ADDR", "127.0.0.1:0")
        .env("ABADA_AGENT_LOG_FORMAT", "json")
        .env(
            "RUST_LOG",
            "warn,abada_agent_worker::app=info,abada_agent_worker::runner=info",
        );
    if let Some(url) = store_url {
        cmd.env("ABADA_AGENT_STORE_URL", url);
    }
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", args.worker_bin.display()))?;
    Ok(Worker {
        id: id.to_string(),
        child,
        log,
        admin: None,
    })
}

/// A task as the worker logged its end: start and end in Unix microseconds.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: i64,
    end: i64,
}

fn task_spans(log: &str) -> (Vec<Span>, BTreeMap<String, u32>) {
    let mut spans = Vec::new();
    let mut outcomes = BTreeMap::new();
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v["message"] != "task ended" {
            continue;
        }
        let outcome = v["outcome"].as_str().unwrap_or("?").to_string();
        *outcomes.entry(outcome).or_default() += 1;
        let Some(end) = v["timestamp"]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        else {
            continue;
        };
        let end = end.timestamp_micros();
        let took = v["duration_ms"].as_i64().unwrap_or(0) * 1000;
        spans.push(Span {
            start: end - took,
            end,
        });
    }
    (spans, outcomes)
}

/// Busy time of `spans` inside [from, to].
fn busy_within(spans: &[Span], from: i64, to: i64) -> f64 {
    spans
        .iter()
        .map(|s| (s.end.min(to) - s.start.max(from)).max(0) as f64)
        .sum()
}

async fn metrics(http: &reqwest::Client, admin: &str) -> Result<String, String> {
    http.get(format!("http://{admin}/metrics"))
        .send()
        .await
        .map_err(|e| format!("metrics: {e}"))?
        .text()
        .await
        .map_err(|e| format!("metrics: {e}"))
}

/// The sum of a family's samples whose label set contains `labels`.
fn sum_of(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn pg(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("store admin connection: {e}"))?;
    tokio::spawn(connection);
    Ok(client)
}

fn with_database(url: &str, db: &str) -> Result<String, String> {
    let mut u = reqwest::Url::parse(url).map_err(|e| format!("--store-admin-url: {e}"))?;
    u.set_path(&format!("/{db}"));
    Ok(u.to_string())
}

async fn run_once(
    http: &reqwest::Client,
    args: &Args,
    model: &ScriptedModel,
    n: u32,
) -> Result<BTreeMap<&'static str, f64>, String> {
    let tag = format!("{}-{n}", std::process::id());
    let process = format!("engineBench_{}", tag.replace('-', "_"));
    let topic = format!("abada:bench-{tag}");
    let dir = std::env::temp_dir().join(format!("abada-engine-bench-{tag}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let agents = dir.join("agents.toml");
    std::fs::write(
        &agents,
        format!(
            "[agents.{ACTIVITY}]\nname = \"bench-agent\"\nmodel = \"openai/{MODEL}\"\n\
             instructions = \"You answer benchmark requests with JSON.\"\ninput = \"${{orderId}}\"\n\
             maxTurns = 2\nresultVariable = \"agentResult\"\n"
        ),
    )
    .map_err(|e| format!("agents file: {e}"))?;

    deploy(http, args, &bench_bpmn(&process, &topic)).await?;
    let created = Instant::now();
    start_instances(http, args, &process).await?;
    eprintln!(
        "run {n}: {} instances started in {:.1} s",
        args.tasks,
        created.elapsed().as_secs_f64()
    );

    let database = format!("abada_bench_{}", tag.replace('-', "_"));
    let store_url = match &args.store_admin_url {
        Some(admin) => {
            pg(admin)
                .await?
                .batch_execute(&format!("CREATE DATABASE {database}"))
                .await
                .map_err(|e| format!("create database: {e}"))?;
            Some(with_database(admin, &database)?)
        }
        None => None,
    };

    let ticks = clock_ticks();
    let idle_from = (Instant::now(), cpu_seconds(args.engine_pid, ticks));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let engine_idle_rate = match (idle_from.1, cpu_seconds(args.engine_pid, ticks)) {
        (Some(a), Some(b)) => (b - a) / idle_from.0.elapsed().as_secs_f64(),
        _ => f64::NAN,
    };
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let engine_cpu_before = cpu_seconds(args.engine_pid, ticks).ok_or("engine pid unreadable")?;
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..args.workers {
        workers.push(spawn_worker(
            args,
            &dir,
            &format!("bench-w{}", w + 1),
            &topic,
            &model.base_url_openai(),
            &agents,
            store_url.as_deref(),
        )?);
    }
    // Each worker's admin address, then the end of the backlog.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut worker_cpu = vec![0.0; workers.len()];
    let mut worker_startup_cpu = vec![f64::NAN; workers.len()];
    let mut worker_peak_rss = vec![f64::NAN; workers.len()];
    let mut last_texts = vec![String::new(); workers.len()];
    loop {
        if Instant::now() > deadline {
            return Err("the backlog did not end within 600 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut ended = 0.0;
        for (i, w) in workers.iter_mut().enumerate() {
            if let Ok(Some(status)) = w.child.try_wait() {
                return Err(format!(
                    "worker {} exited with {status}: {}",
                    w.id,
                    w.log_text()
                ));
            }
            if w.admin.is_none() {
                w.admin = w.log_text().lines().find_map(|l| {
                    let rest = l.split_once("\"admin_addr\":\"")?.1;
                    Some(rest.split_once('"')?.0.to_string())
                });
                // Logged as the worker starts serving, just before its first fetch.
                if w.admin.is_some() {
                    worker_startup_cpu[i] = cpu_seconds(w.child.id(), ticks).unwrap_or(f64::NAN);
                }
            }
            if let Some(admin) = &w.admin {
                let text = metrics(http, admin).await?;
                ended += sum_of(&text, "abada_agent_tasks_ended_total", "");
                worker_cpu[i] = cpu_seconds(w.child.id(), ticks).unwrap_or(f64::NAN);
                last_texts[i] = text;
            }
        }
        if ended >= f64::from(args.tasks) {
            break;
        }
    }
    let engine_cpu =
        cpu_seconds(args.engine_pid, ticks).ok_or("engine pid unreadable")? - engine_cpu_before;
    let wall_to_done = started.elapsed().as_secs_f64();
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    for (i, w) in workers.iter_mut().enumerate() {
        worker_peak_rss[i] = status_mb(w.child.id(), "VmHWM").unwrap_or(f64::NAN);
        w.stop();
    }

    let mut f = BTreeMap::new();
    let tasks = f64::from(args.tasks);
    let mut all = Vec::new();
    let mut per_worker = Vec::new();
    let mut outcomes: BTreeMap<String, u32> = BTreeMap::new();
    for w in &workers {
        let (spans, o) = task_spans(&w.log_text());
        for (k, v) in o {
            *outcomes.entry(k).or_default() += v;
        }
        all.extend_from_slice(&spans);
        per_worker.push(spans);
        if let Some(keep) = &args.keep_logs {
            let _ = std::fs::create_dir_all(keep);
            let _ = std::fs::copy(&w.log, keep.join(format!("{tag}-{}.log", w.id)));
        }
    }
    let first_start = all.iter().map(|s| s.start).min().unwrap_or(0);
    let last_start = all.iter().map(|s| s.start).max().unwrap_or(0);
    let last_end = all.iter().map(|s| s.end).max().unwrap_or(0);
    let slots_total = f64::from(args.slots * args.workers);
    let window = (last_start - first_start).max(1) as f64;
    let latency = args.model_latency.as_secs_f64();
    let ceiling = slots_total / latency;
    let wall = (last_end - first_start) as f64 / 1e6;
    f.insert(
        "tasks_completed",
        f64::from(*outcomes.get("completed").unwrap_or(&0)),
    );
    f.insert(
        "tasks_other_outcomes",
        tasks - f64::from(*outcomes.get("completed").unwrap_or(&0)),
    );
    f.insert("wall_s", wall);
    f.insert("tasks_per_s", tasks / wall);
    f.insert("ceiling_tasks_per_s", ceiling);
    f.insert("pct_of_ceiling", 100.0 * tasks / wall / ceiling);
    let best_wall = (tasks / slots_total).ceil() * latency;
    f.insert("best_wall_s", best_wall);
    f.insert("pct_of_best_wall", 100.0 * best_wall / wall);
    f.insert(
        "slot_use_pct",
        100.0 * busy_within(&all, first_start, last_start) / (slots_total * window),
    );
    let mut uses = Vec::new();
    for (i, spans) in per_worker.iter().enumerate() {
        let from = spans.iter().map(|s| s.start).min().unwrap_or(first_start);
        let cap = f64::from(args.slots) * (last_start - from).max(1) as f64;
        let share = 100.0 * busy_within(spans, from, last_start) / cap;
        uses.push(share);
        let key: &'static str = Box::leak(format!("w{}_slot_use_pct", i + 1).into_boxed_str());
        f.insert(key, share);
        let key: &'static str = Box::leak(format!("w{}_tasks", i + 1).into_boxed_str());
        f.insert(key, spans.len() as f64);
    }
    let mean = uses.iter().sum::<f64>() / uses.len() as f64;
    f.insert(
        "slot_use_max_dev_from_mean_pct",
        uses.iter()
            .map(|u| 100.0 * (u - mean).abs() / mean)
            .fold(0.0, f64::max),
    );
    let mean_duration: f64 =
        all.iter().map(|s| (s.end - s.start) as f64).sum::<f64>() / all.len().max(1) as f64;
    f.insert("task_handling_mean_ms", mean_duration / 1000.0);

    // Per operation, over every status: the count and the sum of the request histogram.
    let per_op = |op: &str, part: &str| -> f64 {
        let name = format!("abada_agent_engine_request_duration_seconds_{part}");
        last_texts
            .iter()
            .map(|t| sum_of(t, &name, &format!("operation=\"{op}\"")))
            .sum()
    };
    let mut engine_requests = 0.0;
    for (op, key, ms_key) in [
        ("fetch-and-lock", "fetches_per_task", "fetch_mean_ms"),
        ("complete", "completes_per_task", "complete_mean_ms"),
        ("heartbeat", "heartbeats_per_task", "heartbeat_mean_ms"),
        ("failure", "failures_per_task", "failure_mean_ms"),
    ] {
        let n = per_op(op, "count");
        engine_requests += n;
        f.insert(key, n / tasks);
        let sum = per_op(op, "sum");
        f.insert(ms_key, if n > 0.0 { 1000.0 * sum / n } else { f64::NAN });
    }
    // Every engine request, whatever its operation (and status), counted once.
    let all_requests: f64 = last_texts
        .iter()
        .map(|t| sum_of(t, "abada_agent_engine_request_duration_seconds_count", ""))
        .sum();
    f.insert("engine_requests_per_task", all_requests / tasks);
    f.insert("engine_requests_other", all_requests - engine_requests);
    let fetch_results = |r: &str| -> f64 {
        last_texts
            .iter()
            .map(|t| sum_of(t, "abada_agent_fetches_total", &format!("result=\"{r}\"")))
            .sum()
    };
    f.insert("fetches_with_tasks", fetch_results("tasks"));
    f.insert("fetches_empty", fetch_results("empty"));
    f.insert("fetches_error", fetch_results("error"));
    if store_url.is_some() {
        let mut tx = 0.0;
        for (op, key) in [
            ("claim", "store_claims_per_task"),
            ("append", "store_appends_per_task"),
            ("finish", "store_finishes_per_task"),
            ("sweep", "store_sweeps"),
        ] {
            let n: f64 = last_texts
                .iter()
                .map(|t| {
                    Histogram::parse(
                        t,
                        "abada_agent_store_transaction_duration_seconds",
                        &format!("operation=\"{op}\""),
                    )
                    .count
                })
                .sum();
            if op == "sweep" {
                f.insert(key, n);
            } else {
                tx += n;
                f.insert(key, n / tasks);
            }
        }
        f.insert("store_tx_per_task", tx / tasks);
        let errors: f64 = last_texts
            .iter()
            .map(|t| sum_of(t, "abada_agent_store_errors_total", ""))
            .sum();
        f.insert("store_errors", errors);
    }
    f.insert("engine_cpu_ms_per_task", 1000.0 * engine_cpu / tasks);
    f.insert(
        "engine_cpu_ms_per_task_less_idle",
        1000.0 * (engine_cpu - engine_idle_rate * wall_to_done) / tasks,
    );
    f.insert("engine_idle_cpu_pct", 100.0 * engine_idle_rate);
    f.insert(
        "workers_cpu_ms_per_task",
        1000.0 * worker_cpu.iter().sum::<f64>() / tasks,
    );
    f.insert("client_cpu_s", worker_cpu.iter().sum::<f64>());
    f.insert(
        "client_startup_cpu_s",
        worker_startup_cpu.iter().sum::<f64>(),
    );
    f.insert(
        "client_peak_rss_mb",
        worker_peak_rss.iter().copied().fold(f64::NAN, f64::max),
    );
    let load = |s: &str| {
        s.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    f.insert("load1_before", load(&load_before));
    f.insert("load1_after", load(&load_after));

    if let Some(admin) = &args.store_admin_url {
        pg(admin)
            .await?
            .batch_execute(&format!("DROP DATABASE {database} WITH (FORCE)"))
            .await
            .map_err(|e| format!("drop database: {e}"))?;
    }
    if args.keep_logs.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let odd: Vec<String> = workers
        .iter()
        .flat_map(|w| {
            w.log_text()
                .lines()
                .filter(|l| l.contains("\"WARN\"") || l.contains("\"ERROR\""))
                .take(3)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    if !odd.is_empty() {
        eprintln!("run {n}: warnings of the workers (first 3 each): {odd:#?}");
    }
    Ok(f)
}

/// A child process of the peer side (the bridge, the JVM), stopped by SIGTERM, killed if it
/// lingers or when dropped.
struct PeerChild {
    name: &'static str,
    child: Child,
}

impl PeerChild {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stop(&mut self) {
        stop_child(&mut self.child);
    }
}

impl Drop for PeerChild {
    fn drop(&mut self) {
        kill_if_running(&mut self.child);
    }
}

/// Starts the bridge and reads the JSON line it prints: its Camunda base URL and stats URL.
fn spawn_bridge(args: &Args, dir: &Path) -> Result<(PeerChild, String, String), String> {
    use std::io::BufRead;
    let log = std::fs::File::create(dir.join("bridge.log")).map_err(|e| format!("log: {e}"))?;
    let mut child = Command::new(&args.bridge_bin)
        .args(["--engine-url", &args.engine_url])
        .args(["--long-poll-interval-ms", &args.poll_ms.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", args.bridge_bin.display()))?;
    let stdout = child.stdout.take().ok_or("the bridge's stdout")?;
    let bridge = PeerChild {
        name: "bridge",
        child,
    };
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("the bridge's first line: {e}"))?;
    let v: Value = serde_json::from_str(&line)
        .map_err(|e| format!("the bridge printed {line:?}, not its URLs: {e}"))?;
    let base = v["camundaBaseUrl"].as_str().ok_or("no camundaBaseUrl")?;
    let stats = v["statsUrl"].as_str().ok_or("no statsUrl")?;
    Ok((bridge, base.to_string(), stats.to_string()))
}

fn spawn_camunda_peer(
    args: &Args,
    dir: &Path,
    base_url: &str,
    model_url: &str,
    topic: &str,
) -> Result<PeerChild, String> {
    let target = args.camunda_dir.join("target");
    let jar = std::fs::read_dir(&target)
        .map_err(|e| {
            format!(
                "{}: {e}; build the peer first (cd bench/camunda-peer && mvn -q package)",
                target.display()
            )
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "jar"))
        .ok_or_else(|| format!("no jar in {}", target.display()))?;
    let classpath = format!("{}:{}/lib/*", jar.display(), target.display());
    let log = std::fs::File::create(dir.join("camunda-peer.log")).map_err(|e| format!("{e}"))?;
    let err = log.try_clone().map_err(|e| format!("{e}"))?;
    let child = Command::new(&args.java)
        .args(["-cp", &classpath, "dev.abada.bench.CamundaPeer"])
        .args([base_url, model_url, topic, &args.camunda_mode])
        .arg(args.slots.to_string())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", args.java.display()))?;
    Ok(PeerChild {
        name: "camunda-peer",
        child,
    })
}

/// The same backlog done by the Camunda 7 client through the bridge.
async fn run_camunda_once(
    http: &reqwest::Client,
    args: &Args,
    model: &ScriptedModel,
    n: u32,
) -> Result<BTreeMap<&'static str, f64>, String> {
    let tag = format!("{}-{n}", std::process::id());
    let process = format!("engineBench_{}", tag.replace('-', "_"));
    let topic = format!("abada:bench-{tag}");
    let dir = std::env::temp_dir().join(format!("abada-engine-bench-{tag}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    deploy(http, args, &bench_bpmn(&process, &topic)).await?;
    let created = Instant::now();
    start_instances(http, args, &process).await?;
    eprintln!(
        "run {n}: {} instances started in {:.1} s",
        args.tasks,
        created.elapsed().as_secs_f64()
    );
    let ticks = clock_ticks();
    let (mut bridge, base_url, stats_url) = spawn_bridge(args, &dir)?;
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let engine_cpu_before = cpu_seconds(args.engine_pid, ticks).ok_or("engine pid unreadable")?;
    let bridge_cpu_before = cpu_seconds(bridge.pid(), ticks).unwrap_or(f64::NAN);
    let started = Instant::now();
    let mut peer = spawn_camunda_peer(args, &dir, &base_url, &model.base_url_openai(), &topic)?;
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut startup_cpu = f64::NAN;
    let mut first_fetch_after = f64::NAN;
    let stats = loop {
        if Instant::now() > deadline {
            return Err("the backlog did not end within 900 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for c in [&mut bridge, &mut peer] {
            if let Ok(Some(status)) = c.child.try_wait() {
                return Err(format!(
                    "{} exited with {status}; its log is in {}",
                    c.name,
                    dir.display()
                ));
            }
        }
        let cpu = cpu_seconds(peer.pid(), ticks).unwrap_or(f64::NAN);
        let stats: Value = http
            .get(&stats_url)
            .send()
            .await
            .map_err(|e| format!("bridge stats: {e}"))?
            .json()
            .await
            .map_err(|e| format!("bridge stats: {e}"))?;
        if first_fetch_after.is_nan() && stats["fetches"].as_u64().unwrap_or(0) > 0 {
            // The JVM's CPU before its first fetch reached the bridge: its start-up.
            startup_cpu = cpu;
            first_fetch_after = started.elapsed().as_secs_f64();
        }
        if stats["completed"].as_u64().unwrap_or(0) + stats["refused"].as_u64().unwrap_or(0)
            >= u64::from(args.tasks)
        {
            break stats;
        }
    };
    let peer_cpu = cpu_seconds(peer.pid(), ticks).unwrap_or(f64::NAN);
    let engine_cpu =
        cpu_seconds(args.engine_pid, ticks).ok_or("engine pid unreadable")? - engine_cpu_before;
    let bridge_cpu = cpu_seconds(bridge.pid(), ticks).unwrap_or(f64::NAN) - bridge_cpu_before;
    let peer_rss = status_mb(peer.pid(), "VmHWM").unwrap_or(f64::NAN);
    let bridge_rss = status_mb(bridge.pid(), "VmHWM").unwrap_or(f64::NAN);
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    peer.stop();
    bridge.stop();
    if let Some(keep) = &args.keep_logs {
        let _ = std::fs::create_dir_all(keep);
        for name in ["camunda-peer.log", "bridge.log"] {
            let _ = std::fs::copy(dir.join(name), keep.join(format!("{tag}-{name}")));
        }
    }
    let peer_log = std::fs::read_to_string(dir.join("camunda-peer.log")).unwrap_or_default();
    let warnings: Vec<&str> = peer_log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("Exception"))
        .take(5)
        .collect();
    if !warnings.is_empty() {
        eprintln!("run {n}: the Camunda client's log (first 5 warnings): {warnings:#?}");
    }
    if args.keep_logs.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let us = |k: &str| stats[k].as_f64().unwrap_or(f64::NAN);
    let tasks = f64::from(args.tasks);
    let wall = (us("lastCompletedUs") - us("firstLockedUs")) / 1e6;
    let latency = args.model_latency.as_secs_f64();
    let slots = f64::from(args.slots);
    let best_wall = (tasks / slots).ceil() * latency;
    let load = |s: &str| {
        s.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let mut f = BTreeMap::new();
    f.insert("tasks_completed", us("completed"));
    f.insert("tasks_other_outcomes", us("refused"));
    f.insert("wall_s", wall);
    f.insert("tasks_per_s", tasks / wall);
    f.insert("ceiling_tasks_per_s", slots / latency);
    f.insert("pct_of_ceiling", 100.0 * tasks / wall / (slots / latency));
    f.insert("best_wall_s", best_wall);
    f.insert("pct_of_best_wall", 100.0 * best_wall / wall);
    f.insert("client_cpu_s", peer_cpu);
    f.insert("client_startup_cpu_s", startup_cpu);
    f.insert("client_start_to_first_fetch_s", first_fetch_after);
    f.insert("client_cpu_ms_per_task", 1000.0 * peer_cpu / tasks);
    f.insert("client_peak_rss_mb", peer_rss);
    f.insert("bridge_cpu_s", bridge_cpu);
    f.insert("bridge_peak_rss_mb", bridge_rss);
    f.insert("fetches_per_task", us("fetches") / tasks);
    f.insert("engine_fetches_per_task", us("engineFetches") / tasks);
    f.insert("engine_cpu_ms_per_task", 1000.0 * engine_cpu / tasks);
    f.insert("load1_before", load(&load_before));
    f.insert("load1_after", load(&load_after));
    Ok(f)
}

fn fmt(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("{e}\n");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let model = match ScriptedModel::start().await {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cannot start the scripted model: {e}");
            return ExitCode::FAILURE;
        }
    };
    model.set_script(
        MODEL,
        Script::new(vec![Turn::text(
            r#"{"decision": "done", "input": "${input}"}"#,
        )])
        .with_latency(args.model_latency)
        .with_usage(120, 30),
    );
    let http = reqwest::Client::new();
    let mut runs = Vec::new();
    for n in 1..=args.runs {
        let run = match args.peer {
            Peer::Worker => run_once(&http, &args, &model, n).await,
            Peer::Camunda => run_camunda_once(&http, &args, &model, n).await,
        };
        match run {
            Ok(f) => {
                match args.peer {
                    Peer::Worker => println!(
                        "run {n}: workers {} x {} slots, {} tasks, model {} ms, store {}",
                        args.workers,
                        args.slots,
                        args.tasks,
                        args.model_latency.as_millis(),
                        if args.store_admin_url.is_some() {
                            "on"
                        } else {
                            "off"
                        }
                    ),
                    Peer::Camunda => println!(
                        "run {n}: Camunda 7 client ({}), {} slots, {} tasks, model {} ms",
                        args.camunda_mode,
                        args.slots,
                        args.tasks,
                        args.model_latency.as_millis(),
                    ),
                }
                for (k, v) in &f {
                    println!("  {k} = {}", fmt(*v));
                }
                runs.push(f);
            }
            Err(e) => {
                eprintln!("run {n} failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if runs.len() > 1 {
        println!("medians of {} runs:", runs.len());
        for k in runs[0].keys() {
            let mut v: Vec<f64> = runs.iter().filter_map(|r| r.get(k).copied()).collect();
            v.sort_by(f64::total_cmp);
            let m = if v.len() % 2 == 1 {
                v[v.len() / 2]
            } else {
                (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
            };
            println!("  {k} = {}", fmt(m));
        }
    }
    ExitCode::SUCCESS
}
