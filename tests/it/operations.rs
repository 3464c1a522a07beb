//! Kubernetes operations: staged shutdown of the real binary on SIGTERM/SIGINT, the
//! second signal, `/readyz` and `/healthz`, `/metrics` checked against what the emulator, the
//! scripted model and the tool server recorded, W3C trace context on every outgoing call, and the
//! pretty log format.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use abada_agent_worker::admin::{self, AdminState};
use abada_agent_worker::devkit::engine::{
    CallRecord, Disposition, EngineEmulator, Fault, Operation, ProtocolLevel, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::model::{Fault as ModelFault, FaultTimes};
use abada_agent_worker::devkit::stack::{
    DeclaredLabelNames, Stack, StackWorkers, WorkerOptions, refund_script,
};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::runner::RunnerEvent;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::agent::{FULL_REFUND_RUN, spec, step_kinds, wait_all_ended};
use crate::support::process::{WorkerProcess, stack_env};
use crate::support::wait::eventually;

/// Waits until `check` holds on the emulator (re-checked on every request it answers).
async fn wait_until<T>(
    stack: &Stack,
    what: &str,
    check: impl FnMut(&EngineEmulator) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(60), stack.engine.wait_for(check))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// Polls an admin endpoint of `worker` until `accept` holds; returns the last answer.
async fn poll_admin(
    worker: &WorkerProcess,
    path: &str,
    accept: impl Fn(u16, &str) -> bool,
) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = worker.admin_get(path).await;
        if accept(status, &body) {
            return (status, body);
        }
        assert!(
            Instant::now() < deadline,
            "{path} stayed at {status} {body:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The lines `read` returns once one contains `needle` (the pipe readers may still be draining
/// the output of a process that has just exited).
async fn lines_until(read: impl Fn() -> Vec<String>, needle: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = read();
        if lines.iter().any(|l| l.contains(needle)) {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "no line with {needle:?}: {lines:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn env(stack: &Stack, worker_id: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut env = stack_env(stack, worker_id);
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

fn has_model_step(view: &TaskView) -> bool {
    step_kinds(view).iter().any(|k| k == "model/finished")
}

fn running_on(view: &TaskView, worker: &str) -> bool {
    view.status == TaskStatus::Locked
        && view.worker_id.as_deref() == Some(worker)
        && !view.journal.is_empty()
}

/// One task whose model turn takes `turn` (longer than the test), running on a new worker
/// process with `ABADA_AGENT_SHUTDOWN_GRACE_MS=grace_ms`; returned once the task runs there.
async fn one_stuck_task(
    stack: &Stack,
    worker_id: &str,
    turn: Duration,
    grace_ms: &str,
) -> (String, WorkerProcess) {
    stack
        .model
        .set_script("stuck", refund_script().with_latency(turn));
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/stuck", &[]), "o-1"));
    let worker = WorkerProcess::spawn(&env(
        stack,
        worker_id,
        &[("ABADA_AGENT_SHUTDOWN_GRACE_MS", grace_ms)],
    ))
    .await;
    wait_until(stack, "the task to start", |e| {
        e.task(&id).filter(|t| running_on(t, worker_id))
    })
    .await;
    (id, worker)
}

/// The task was released: `failure` with its retries unchanged and `retryTimeout` 0, so it is
/// `OPEN` and visible at once.
fn assert_released(view: &TaskView, retries: i32) {
    assert_eq!(view.status, TaskStatus::Open, "{view:?}");
    assert_eq!(view.retries, Some(retries), "retries unchanged: {view:?}");
    assert!(!view.hidden, "retryTimeout 0: {view:?}");
    assert_eq!(view.lock_expiration_time, None, "{view:?}");
    assert_eq!(view.counters.failures, 1, "{view:?}");
    assert!(
        view.error_message
            .as_deref()
            .is_some_and(|m| m.contains("shut down")),
        "{view:?}"
    );
}

fn no_task_locked_to(stack: &Stack, worker: &str) {
    for t in stack.engine.tasks() {
        assert!(
            !(t.status == TaskStatus::Locked && t.worker_id.as_deref() == Some(worker)),
            "{} is still locked to {worker}: {t:?}",
            t.id
        );
    }
}

fn calls_of<'a>(
    calls: &'a [CallRecord],
    op: Operation,
    worker: &'a str,
) -> impl Iterator<Item = &'a CallRecord> + 'a {
    calls
        .iter()
        .filter(move |c| c.operation == op && c.worker_id.as_deref() == Some(worker))
}

#[tokio::test]
async fn sigterm_drains_finishes_short_tasks_releases_long_ones_and_a_second_worker_resumes_them() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // Long tasks: every model turn takes far longer than the grace period. The lock leaves a
    // heartbeat 3.4 s of lateness before a lease is given up, and its 2 s period still puts a
    // heartbeat inside the 3 s drain.
    stack
        .model
        .set_script("slow", refund_script().with_latency(Duration::from_secs(7)));
    stack.model.set_script(
        "quick",
        refund_script().with_latency(Duration::from_millis(100)),
    );
    let grace = Duration::from_millis(3000);
    let worker_id = "proc-term";
    let slow = stack.engine.create_tasks(
        (0..2).map(|i| spec(stack.refund_agent("openai/slow", &[]), &format!("s-{i}"))),
    );
    let mut worker = WorkerProcess::spawn(&env(
        &stack,
        worker_id,
        &[
            ("ABADA_AGENT_MAX_TASKS", "8"),
            ("ABADA_AGENT_LOCK_DURATION_MS", "6000"),
            ("ABADA_AGENT_SHUTDOWN_GRACE_MS", "3000"),
        ],
    ))
    .await;
    // The long tasks have journaled their first model turn and are in their second one.
    wait_until(&stack, "the long tasks' first model turn", |e| {
        slow.iter()
            .all(|id| e.task(id).is_some_and(|t| has_model_step(&t)))
            .then_some(())
    })
    .await;
    let quick = stack.engine.create_tasks(
        (0..2).map(|i| spec(stack.refund_agent("openai/quick", &[]), &format!("q-{i}"))),
    );
    wait_until(&stack, "the short tasks to start", |e| {
        quick
            .iter()
            .all(|id| e.task(id).is_some_and(|t| running_on(&t, worker_id)))
            .then_some(())
    })
    .await;

    let signal_at = chrono::Utc::now();
    let signalled = Instant::now();
    worker.signal("TERM");
    // Delivered by now (`kill` has returned); forking it can take a while on a loaded machine.
    let delivered_at = chrono::Utc::now();
    let exit = worker.wait(Duration::from_secs(20)).await;
    let took = signalled.elapsed();
    println!("SIGTERM with 2 long + 2 short tasks: exit after {took:?} (grace {grace:?})");
    assert!(exit.success(), "exit code 0: {exit}");
    assert!(
        took < grace + Duration::from_secs(2),
        "exit within grace + 1 s (+1 s slack): {took:?}"
    );

    let calls = stack.engine.calls();
    assert!(
        calls_of(&calls, Operation::FetchAndLock, worker_id)
            .any(|c| c.at <= signal_at && c.at > signal_at - chrono::Duration::seconds(1)),
        "the worker was fetching until the signal"
    );
    // No fetch after the signal (one already in flight at the signal may land just after it).
    let late: Vec<_> = calls_of(&calls, Operation::FetchAndLock, worker_id)
        .filter(|c| c.at > signal_at)
        .collect();
    assert!(late.len() <= 1, "fetches after the signal: {late:?}");
    assert!(
        late.iter()
            .all(|c| c.at <= delivered_at + chrono::Duration::milliseconds(100)),
        "a fetch started more than 100 ms after the signal: {late:?}"
    );
    // Short tasks completed normally during the drain.
    for id in &quick {
        let v = stack.engine.task(id).unwrap();
        assert_eq!(v.status, TaskStatus::Completed, "{v:?}");
        assert_eq!(v.worker_id.as_deref(), Some(worker_id));
    }
    // Long tasks were heartbeated during the drain, then released.
    for id in &slow {
        let during_drain = calls_of(&calls, Operation::Heartbeat, worker_id)
            .filter(|c| c.task_id.as_deref() == Some(id.as_str()) && c.at > signal_at)
            .filter(|c| c.disposition == Disposition::Executed)
            .count();
        assert!(during_drain >= 1, "{id} heartbeated while draining");
        assert_released(&stack.engine.task(id).unwrap(), 3);
        let failures: Vec<_> = calls_of(&calls, Operation::Failure, worker_id)
            .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
            .collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].disposition, Disposition::Executed);
        assert!(failures[0].at > signal_at);
    }
    no_task_locked_to(&stack, worker_id);
    assert_eq!(
        stack.tools.counters().await.sessions_open,
        0,
        "MCP sessions closed"
    );
    let logs = lines_until(|| worker.stdout(), "worker stopped").await;
    assert!(
        logs.iter().any(|l| l.contains("grace period over")),
        "the release is logged"
    );
    assert!(
        logs.last().is_some_and(|l| l.contains("worker stopped")),
        "logs flushed to the last line: {:?}",
        logs.last()
    );
    let started: Vec<Value> = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "task started")
        .collect();
    for id in slow.iter().chain(&quick) {
        let line = started
            .iter()
            .find(|v| v["task_id"] == id.as_str())
            .unwrap_or_else(|| panic!("no 'task started' line for {id}"));
        assert_eq!(line["attempt"], 1, "the task span carries its ids: {line}");
        assert!(line["process_instance_id"].is_string(), "{line}");
        // The engine's count, as a number: not Rust's `Some(3)`, which a log query cannot
        // compare (seen in the release worker's log against the real engine).
        assert_eq!(line["retries"], 3, "{line}");
    }
    // Each long task's call in flight was cut short by the release, after one answered turn,
    // or two for the task whose first call went out alone (a model's first call waits for
    // nothing else: the other task's first turn started after its answer).
    let slow_calls = stack.model.calls("slow");
    assert!(
        (4..=5).contains(&slow_calls),
        "model calls of the long tasks: {slow_calls}"
    );
    let before: HashMap<String, Vec<Value>> = slow
        .iter()
        .map(|id| (id.clone(), stack.engine.task(id).unwrap().journal))
        .collect();

    // A second worker resumes the long tasks from their journals.
    stack.model.set_script("slow", refund_script());
    let second = stack.spawn_worker(WorkerOptions::new("w-2", 4), Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &slow, Duration::from_secs(30)).await;
    for v in &views {
        assert_eq!(v.status, TaskStatus::Completed, "{v:?}");
        assert_eq!(v.worker_id.as_deref(), Some("w-2"));
        assert_eq!(v.attempt, 2);
        let old = &before[&v.id];
        assert!(!old.is_empty());
        assert_eq!(&v.journal[..old.len()], &old[..], "the journal continues");
        assert_eq!(step_kinds(v), FULL_REFUND_RUN, "no finished step redone");
    }
    // Turns 2 and 3 per task on the second worker; turn 1 was not asked again.
    assert_eq!(stack.model.calls("slow"), 8);
    assert_eq!(stack.tools.counters().await.writes_applied, 4);
    second.stop().await;
    stack.shutdown().await;
}

/// The engine's `retries` go back unchanged when a shutdown releases a task, odd values
/// included: a task the engine hands out with `retries: -1` is released with `-1`, `OPEN` and
/// offered again. Clamped to `0`, the release made it an incident (`FAILED`) nobody failed.
#[tokio::test]
async fn a_shutdown_release_gives_the_engines_odd_retries_back_unchanged() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let worker_id = "proc-odd-retries";
    stack.model.set_script(
        "stuck",
        refund_script().with_latency(Duration::from_secs(30)),
    );
    let mut task = spec(stack.refund_agent("openai/stuck", &[]), "o-1");
    task.retries = Some(-1);
    let id = stack.engine.create_task(task);
    let mut worker = WorkerProcess::spawn(&env(
        &stack,
        worker_id,
        &[("ABADA_AGENT_SHUTDOWN_GRACE_MS", "200")],
    ))
    .await;
    wait_until(&stack, "the task to start", |e| {
        e.task(&id).filter(|t| running_on(t, worker_id))
    })
    .await;
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(20)).await;
    assert!(exit.success(), "exit code 0: {exit}");
    assert_released(&stack.engine.task(&id).unwrap(), -1);
    stack.shutdown().await;
}

#[tokio::test]
async fn sigint_is_a_staged_shutdown_like_sigterm() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let worker_id = "proc-int";
    let (id, mut worker) = one_stuck_task(&stack, worker_id, Duration::from_secs(30), "1000").await;
    // The model call is under way (its tool session is open).
    eventually(Duration::from_secs(30), "the model call", async || {
        stack.model.calls("stuck") > 0
    })
    .await;
    let signalled = Instant::now();
    worker.signal("INT");
    let exit = worker.wait(Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    println!("SIGINT with 1 long task: exit after {took:?} (grace 1 s)");
    assert!(exit.success(), "exit code 0: {exit}");
    // Grace 1 s, then the release and the exit; the task itself would run 30 s. The slack is
    // for a loaded machine (forking `kill`, a debug build).
    assert!(took < Duration::from_secs(4), "{took:?}");
    assert_released(&stack.engine.task(&id).unwrap(), 3);
    no_task_locked_to(&stack, worker_id);
    assert_eq!(stack.tools.counters().await.sessions_open, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn readyz_flips_on_drain_and_a_second_signal_exits_at_once() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let worker_id = "proc-twice";
    let (_id, mut worker) =
        one_stuck_task(&stack, worker_id, Duration::from_secs(60), "30000").await;
    poll_admin(&worker, "/readyz", |s, _| s == 200).await;

    worker.signal("TERM");
    // The long task holds the drain open: not ready, still alive.
    let (_, body) = poll_admin(&worker, "/readyz", |s, _| s == 503).await;
    assert!(body.contains("shutting down"), "{body}");
    assert_eq!(worker.admin_get("/healthz").await.0, 200);

    let signalled = Instant::now();
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    println!("second SIGTERM: exit after {took:?} with {exit}");
    assert!(!exit.success(), "a forced exit is not a clean one: {exit}");
    // At once: the task would run 30 s (the slack is for a loaded machine).
    assert!(took < Duration::from_secs(3), "exits at once: {took:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn readyz_follows_the_engine_going_away_and_coming_back() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack.engine.set_outage(true);
    let mut worker = WorkerProcess::spawn(&env(&stack, "proc-ready", &[])).await;
    let (status, body) = worker.admin_get("/readyz").await;
    assert_eq!(status, 503, "not ready before a fetch succeeded: {body}");
    let (_, body) = poll_admin(&worker, "/readyz", |s, b| {
        s == 503 && !b.contains("no fetch has succeeded yet")
    })
    .await;
    assert!(body.starts_with("not ready: "), "{body}");
    println!("readyz during the outage: {body:?}");
    assert_eq!(worker.admin_get("/healthz").await.0, 200);
    let m = scrape(&worker).await;
    assert!(m.sum("abada_agent_fetches_total", &[("result", "error")]) >= 1.0);
    assert!(
        m.sum("abada_agent_backoff_seconds", &[]) > 0.0,
        "backing off"
    );
    assert!(
        m.sum(
            "abada_agent_engine_request_duration_seconds_count",
            &[("operation", "fetch-and-lock"), ("status", "error")]
        ) >= 1.0
    );

    stack.engine.set_outage(false);
    let back = Instant::now();
    poll_admin(&worker, "/readyz", |s, _| s == 200).await;
    println!(
        "ready again {:?} after the engine came back",
        back.elapsed()
    );
    assert_eq!(
        scrape(&worker)
            .await
            .sum("abada_agent_backoff_seconds", &[]),
        0.0
    );

    stack.engine.set_outage(true);
    let (_, body) = poll_admin(&worker, "/readyz", |s, _| s == 503).await;
    assert!(!body.contains("shutting down"), "{body}");
    stack.engine.set_outage(false);
    let back = Instant::now();
    poll_admin(&worker, "/readyz", |s, _| s == 200).await;
    println!("ready again {:?} after the second outage", back.elapsed());
    assert_eq!(worker.admin_get("/healthz").await.0, 200);

    worker.signal("TERM");
    assert!(worker.wait(Duration::from_secs(10)).await.success());
    stack.shutdown().await;
}

#[tokio::test]
async fn pretty_log_format_writes_human_lines_to_stderr() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let mut worker = WorkerProcess::spawn_raw(
        &[],
        &env(
            &stack,
            "proc-pretty",
            &[("ABADA_AGENT_LOG_FORMAT", "pretty")],
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let line = loop {
        if let Some(l) = worker
            .stderr()
            .into_iter()
            .find(|l| l.contains("admin endpoints listening"))
        {
            break l;
        }
        assert!(Instant::now() < deadline, "{:?}", worker.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(serde_json::from_str::<Value>(&line).is_err(), "{line}");
    assert!(line.contains("INFO"), "{line}");
    assert!(
        !line.contains('\u{1b}'),
        "no colours when stderr is no terminal: {line}"
    );
    worker.signal("TERM");
    assert!(worker.wait(Duration::from_secs(10)).await.success());
    lines_until(|| worker.stderr(), "worker stopped").await;
    assert!(worker.stdout().is_empty(), "{:?}", worker.stdout());
    stack.shutdown().await;
}

/// Headers that are credentials (the engine headers file's values, the OTLP export's headers)
/// bound for an `http://` host that is not loopback: the binary does not start (exit code 2, one
/// line naming the variable, never the value), before any network call; with
/// `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` it starts and says once what travels in clear.
#[tokio::test]
async fn headers_bound_for_plain_http_elsewhere_stop_the_start_naming_the_variable() {
    const MARKER: &str = "hdr-marker-5e1d-never-print";
    let dir = std::env::temp_dir().join(format!("abada-ops-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let headers_file = dir.join("engine-headers");
    std::fs::write(&headers_file, format!("X-Auth-Request-User: {MARKER}\n")).unwrap();
    let headers_file = headers_file.to_str().unwrap().to_string();
    let otlp_headers = format!("api-key={MARKER}");
    let cases: [(&str, Vec<(&str, &str)>); 2] = [
        (
            "ABADA_AGENT_ENGINE_HEADERS_FILE",
            vec![
                ("ABADA_AGENT_ENGINE_URL", "http://engine.invalid:5601/api"),
                ("ABADA_AGENT_ENGINE_HEADERS_FILE", headers_file.as_str()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_HEADERS",
            vec![
                ("ABADA_AGENT_ENGINE_URL", "http://127.0.0.1:9/api"),
                (
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "http://collector.invalid:4318",
                ),
                ("OTEL_EXPORTER_OTLP_HEADERS", otlp_headers.as_str()),
            ],
        ),
    ];
    for (var, vars) in &cases {
        let env: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut worker = WorkerProcess::spawn_raw(&[], &env);
        let exit = worker.wait(Duration::from_secs(15)).await;
        let stderr = lines_until(|| worker.stderr(), "configuration error").await;
        assert_eq!(exit.code(), Some(2), "{var}: {exit} {stderr:?}");
        assert_eq!(stderr.len(), 1, "{var}: one line: {stderr:?}");
        assert!(stderr[0].contains(var), "{var} named: {}", stderr[0]);
        assert!(
            stderr[0].contains("ABADA_AGENT_ALLOW_INSECURE_HTTP=true"),
            "{}",
            stderr[0]
        );
        let all = [worker.stdout(), stderr].concat().join("\n");
        assert!(
            !all.contains(MARKER),
            "{var}: a header value was printed: {all}"
        );
    }
    // Allowed: the worker starts, and its one warning names what travels in clear, not a value.
    let (_, vars) = &cases[1];
    let mut env: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("ABADA_AGENT_ALLOW_INSECURE_HTTP".into(), "true".into()));
    let mut worker = WorkerProcess::spawn(&env).await;
    let warning = lines_until(|| worker.stdout(), "credentials travel in clear").await;
    let warning = warning
        .iter()
        .find(|l| l.contains("credentials travel in clear"))
        .unwrap();
    assert!(warning.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{warning}");
    worker.signal("TERM");
    let _ = worker.wait(Duration::from_secs(10)).await;
    let all = [worker.stdout(), worker.stderr()].concat().join("\n");
    assert!(!all.contains(MARKER), "a header value was printed: {all}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One sample of the text exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the exposition: `# TYPE` lines into family -> type, and every sample.
fn parse_exposition(text: &str) -> (HashMap<String, String>, Vec<Sample>) {
    let mut types = HashMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (head, value) = line.rsplit_once(' ').expect("name value");
        let (name, labels) = match head.split_once('{') {
            None => (head.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                let labels = body
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .map(|p| {
                        let (k, v) = p.split_once("=\"").expect("k=\"v\"");
                        (k.to_string(), v.trim_end_matches('"').to_string())
                    })
                    .collect();
                (name.to_string(), labels)
            }
        };
        samples.push(Sample {
            name,
            labels,
            value: value.parse().expect("a number"),
        });
    }
    (types, samples)
}

struct Scrape {
    types: HashMap<String, String>,
    samples: Vec<Sample>,
}

impl Scrape {
    /// Sum of the samples called `name` whose labels include every pair of `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                with.iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }

    /// The family exists with this type, and its samples carry exactly these labels.
    fn check_family(&self, family: &str, kind: &str, labels: &[&str]) {
        assert_eq!(
            self.types.get(family).map(String::as_str),
            Some(kind),
            "{family} is a {kind}"
        );
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        let mut seen = false;
        for s in &self.samples {
            let Some(suffix) = s.name.strip_prefix(family) else {
                continue;
            };
            if !suffixes.contains(&suffix) {
                continue;
            }
            seen = true;
            let mut names: Vec<&str> = s
                .labels
                .keys()
                .map(String::as_str)
                .filter(|k| *k != "le")
                .collect();
            names.sort_unstable();
            let mut want = labels.to_vec();
            want.sort_unstable();
            assert_eq!(names, want, "labels of {}", s.name);
        }
        assert!(seen, "{family} has samples");
    }
}

/// `/metrics` of a worker process, parsed.
async fn scrape(worker: &WorkerProcess) -> Scrape {
    let (status, text) = worker.admin_get("/metrics").await;
    assert_eq!(status, 200, "{text}");
    let (types, samples) = parse_exposition(&text);
    Scrape { types, samples }
}

#[tokio::test]
async fn metrics_match_what_the_emulator_model_and_tool_server_recorded() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let lock = Duration::from_secs(6);
    // "steady" runs longer than a third of the lock: it gets heartbeats.
    stack.model.set_script(
        "steady",
        refund_script().with_latency(Duration::from_millis(1000)),
    );
    stack.model.set_script("limited", refund_script());
    // Down (503 with a long Retry-After): an outage, deferred at once. (A 429 would be waited
    // out inside the task.)
    stack.model.inject_fault(
        "limited",
        ModelFault::Outage {
            retry_after: Duration::from_secs(600),
        },
        FaultTimes::Always,
    );
    stack.model.set_script(
        "slow",
        refund_script().with_latency(Duration::from_secs(60)),
    );
    let mut opts = WorkerOptions::new("w-metrics", 8);
    opts.lock_duration = lock;
    // The definitions are the engine's: the operator declares the names the metrics carry.
    let declared = DeclaredLabelNames::write(
        "refund-agent",
        &[
            "openai/refund",
            "openai/steady",
            "openai/limited",
            "openai/slow",
        ],
        &[("orders", &stack.tools.url())],
    )
    .unwrap();
    opts.env.push(declared.env());
    let mut worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let admin_stop = CancellationToken::new();
    let admin_addr: SocketAddr = admin::serve(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        AdminState {
            store: None,
            models: None,
            status: worker.status.clone(),
            metrics: worker.metrics.clone(),
            stall_limit: Duration::from_secs(60),
        },
        admin_stop.clone(),
    )
    .await
    .unwrap();

    let mut ended: HashMap<String, TaskEnd> = HashMap::new();
    async fn until_ended(
        events: &mut tokio::sync::mpsc::UnboundedReceiver<RunnerEvent>,
        ended: &mut HashMap<String, TaskEnd>,
        ids: &[String],
    ) {
        tokio::time::timeout(Duration::from_secs(60), async {
            while !ids.iter().all(|id| ended.contains_key(id)) {
                if let Some(RunnerEvent::TaskEnded {
                    task_id, outcome, ..
                }) = events.recv().await
                {
                    ended.insert(task_id, outcome);
                }
            }
        })
        .await
        .expect("tasks ended in time");
    }

    // Phase 1: three quick completions, one with heartbeats, one deferred by a 429.
    let mut phase1 = stack.engine.create_tasks(
        (0..3).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    phase1.push(
        stack
            .engine
            .create_task(spec(stack.refund_agent("openai/steady", &[]), "o-steady")),
    );
    let deferred = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/limited", &[]), "o-limited"));
    phase1.push(deferred.clone());
    until_ended(&mut worker.events, &mut ended, &phase1).await;
    // Phase 2: a task whose heartbeats the engine refuses: its lease is lost. The worker is
    // stopped at once, long before the lease expires and the task could be offered again.
    let lost = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/slow", &[]), "o-lost"));
    stack.engine.inject(Fault::RefuseHeartbeats {
        task_id: lost.clone(),
    });
    until_ended(&mut worker.events, &mut ended, std::slice::from_ref(&lost)).await;
    let status = worker.status.clone();
    worker.stop().await;
    assert!(status.is_draining());

    let expected_outcomes: HashMap<String, TaskEnd> = phase1
        .iter()
        .map(|id| {
            (
                id.clone(),
                if *id == deferred {
                    TaskEnd::Deferred
                } else {
                    TaskEnd::Completed
                },
            )
        })
        .chain([(lost.clone(), TaskEnd::LeaseLost)])
        .collect();
    assert_eq!(
        ended
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect::<HashMap<_, _>>(),
        expected_outcomes
    );

    let text = reqwest::get(format!("http://{admin_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    admin_stop.cancel();
    println!("{text}");
    let (types, samples) = parse_exposition(&text);
    let m = Scrape { types, samples };

    // Every family of the issue, with its type and labels.
    for (family, kind, labels) in [
        ("abada_agent_slots_in_use", "gauge", &[][..]),
        ("abada_agent_slots", "gauge", &[]),
        ("abada_agent_fetches", "counter", &["result"]),
        ("abada_agent_fetch_duration_seconds", "histogram", &[]),
        ("abada_agent_tasks_claimed", "counter", &[]),
        ("abada_agent_tasks_ended", "counter", &["outcome"]),
        (
            "abada_agent_task_duration_seconds",
            "histogram",
            &["outcome"],
        ),
        ("abada_agent_pickup_latency_seconds", "histogram", &[]),
        ("abada_agent_leases_extended", "counter", &[]),
        ("abada_agent_leases_lost", "counter", &["reason"]),
        (
            "abada_agent_engine_request_duration_seconds",
            "histogram",
            &["operation", "status"],
        ),
        (
            "abada_agent_model_calls",
            "counter",
            &["provider", "model", "outcome"],
        ),
        (
            "abada_agent_model_call_duration_seconds",
            "histogram",
            &["provider", "model", "outcome"],
        ),
        (
            "abada_agent_model_tokens",
            "counter",
            &["agent", "provider", "model", "direction"],
        ),
        (
            "gen_ai_client_token_usage",
            "histogram",
            &[
                "gen_ai_operation_name",
                "gen_ai_provider_name",
                "gen_ai_request_model",
                "gen_ai_token_type",
            ],
        ),
        (
            "gen_ai_client_operation_duration_seconds",
            "histogram",
            &[
                "gen_ai_operation_name",
                "gen_ai_provider_name",
                "gen_ai_request_model",
                "error_type",
            ],
        ),
        (
            "abada_agent_tool_calls",
            "counter",
            &["server", "tool", "outcome"],
        ),
        ("abada_agent_backoff_seconds", "gauge", &[]),
    ] {
        m.check_family(family, kind, labels);
    }

    let calls = stack.engine.calls();
    let views = stack.engine.tasks();
    let count = |op: Operation, ok: &dyn Fn(&CallRecord) -> bool| {
        calls.iter().filter(|c| c.operation == op && ok(c)).count() as f64
    };
    // Slots.
    assert_eq!(m.sum("abada_agent_slots", &[]), 8.0);
    assert_eq!(m.sum("abada_agent_slots_in_use", &[]), 0.0);
    assert_eq!(m.sum("abada_agent_backoff_seconds", &[]), 0.0);
    // Fetches.
    let fetches = count(Operation::FetchAndLock, &|_| true);
    assert!(fetches >= 2.0);
    assert_eq!(m.sum("abada_agent_fetches_total", &[]), fetches);
    assert_eq!(
        m.sum("abada_agent_fetches_total", &[("result", "tasks")]),
        count(Operation::FetchAndLock, &|c| !c.task_ids.is_empty())
    );
    assert_eq!(
        m.sum("abada_agent_fetches_total", &[("result", "empty")]),
        count(Operation::FetchAndLock, &|c| c.status == 200
            && c.task_ids.is_empty())
    );
    assert_eq!(
        m.sum("abada_agent_fetches_total", &[("result", "error")]),
        0.0
    );
    assert_eq!(
        m.sum("abada_agent_fetch_duration_seconds_count", &[]),
        fetches
    );
    // Claims: every task id a fetch handed out, and the engine's acquisitions.
    let claimed: usize = calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
        .map(|c| c.task_ids.len())
        .sum();
    let acquisitions: u32 = views.iter().map(|v| v.counters.acquisitions).sum();
    assert_eq!(claimed, 6);
    assert_eq!(acquisitions, 6);
    assert_eq!(m.sum("abada_agent_tasks_claimed_total", &[]), 6.0);
    assert_eq!(m.sum("abada_agent_pickup_latency_seconds_count", &[]), 6.0);
    // Ends by outcome, against the engine's executed commands.
    let executed = |op| count(op, &|c| c.disposition == Disposition::Executed);
    for (outcome, n) in [
        ("completed", executed(Operation::Complete)),
        ("deferred", executed(Operation::Failure)),
        ("lease_lost", 1.0),
    ] {
        assert_eq!(
            m.sum("abada_agent_tasks_ended_total", &[("outcome", outcome)]),
            n,
            "{outcome}"
        );
        assert_eq!(
            m.sum(
                "abada_agent_task_duration_seconds_count",
                &[("outcome", outcome)]
            ),
            n,
            "{outcome}"
        );
    }
    assert_eq!(executed(Operation::Complete), 4.0);
    assert_eq!(m.sum("abada_agent_tasks_ended_total", &[]), 6.0);
    let deferred_view = stack.engine.task(&deferred).unwrap();
    assert_eq!(
        deferred_view.retries,
        Some(3),
        "a deferral keeps the retries"
    );
    assert!(deferred_view.hidden, "{deferred_view:?}");
    // Leases. An extension still on its way when its task ended is aborted with the lease
    // (src/heartbeat.rs): the engine may have run it, the worker never saw its answer, so it is
    // neither counted as extended nor observed as a request. At most one per task.
    let extended = executed(Operation::Heartbeat);
    assert!(extended >= 1.0, "the steady task was heartbeated");
    let counted = m.sum("abada_agent_leases_extended_total", &[]);
    let aborted = extended - counted;
    assert!(
        (0.0..=6.0).contains(&aborted),
        "{counted} extensions counted, {extended} run by the engine"
    );
    assert_eq!(m.sum("abada_agent_leases_lost_total", &[]), 1.0);
    assert!(
        count(Operation::Heartbeat, &|c| c.status == 403
            && c.task_id.as_deref() == Some(lost.as_str()))
            >= 1.0
    );
    // Engine requests: one observation per request the emulator answered, by operation and
    // status.
    let mut by_op_status: HashMap<(String, String), f64> = HashMap::new();
    for c in &calls {
        let op = serde_json::to_value(c.operation).unwrap();
        *by_op_status
            .entry((op.as_str().unwrap().to_string(), c.status.to_string()))
            .or_default() += 1.0;
    }
    let mut observed: HashMap<(String, String), f64> = HashMap::new();
    for s in m
        .samples
        .iter()
        .filter(|s| s.name == "abada_agent_engine_request_duration_seconds_count")
    {
        observed.insert(
            (s.labels["operation"].clone(), s.labels["status"].clone()),
            s.value,
        );
    }
    if aborted > 0.0 {
        *by_op_status
            .get_mut(&("heartbeat".to_string(), "204".to_string()))
            .unwrap() -= aborted;
    }
    assert_eq!(observed, by_op_status);
    for op in [
        "fetch-and-lock",
        "heartbeat",
        "complete",
        "failure",
        "journal-read",
        "journal-append",
        "tool-credentials",
    ] {
        assert!(
            observed.keys().any(|(o, _)| o == op),
            "{op} observed: {observed:?}"
        );
    }
    // Model calls and tokens, against the scripted model's counters.
    for (model, outcome) in [
        ("refund", "ok"),
        ("steady", "ok"),
        ("limited", "unavailable"),
    ] {
        let calls = stack.model.calls(model) as f64;
        let labels = [
            ("provider", "openai"),
            ("model", model),
            ("outcome", outcome),
        ];
        assert_eq!(
            m.sum("abada_agent_model_calls_total", &labels),
            calls,
            "{model}"
        );
        assert_eq!(
            m.sum("abada_agent_model_calls_total", &[("model", model)]),
            calls,
            "{model}: no other outcome"
        );
        assert_eq!(
            m.sum("abada_agent_model_call_duration_seconds_count", &labels),
            calls,
            "{model}"
        );
        let (input, output) = if outcome == "ok" { (120, 30) } else { (0, 0) };
        for (direction, per_call) in [("input", input), ("output", output)] {
            assert_eq!(
                m.sum(
                    "abada_agent_model_tokens_total",
                    &[("model", model), ("direction", direction)]
                ),
                calls * per_call as f64,
                "{model} {direction}"
            );
            assert_eq!(
                m.sum(
                    "abada_agent_model_tokens_total",
                    &[
                        ("agent", "refund-agent"),
                        ("model", model),
                        ("direction", direction)
                    ]
                ),
                calls * per_call as f64,
                "{model} {direction}: by agent"
            );
            if outcome == "ok" {
                // The conventions' histogram: one observation per answered call and direction.
                let labels = [
                    ("gen_ai_request_model", model),
                    ("gen_ai_token_type", direction),
                ];
                assert_eq!(
                    m.sum("gen_ai_client_token_usage_sum", &labels),
                    calls * per_call as f64
                );
                assert_eq!(m.sum("gen_ai_client_token_usage_count", &labels), calls);
            }
        }
        let error_type = if outcome == "ok" { "" } else { outcome };
        assert_eq!(
            m.sum(
                "gen_ai_client_operation_duration_seconds_count",
                &[("gen_ai_request_model", model), ("error_type", error_type)]
            ),
            calls,
            "{model}: gen_ai duration"
        );
    }
    assert_eq!(stack.model.calls("refund"), 9);
    assert_eq!(stack.model.calls("steady"), 3);
    // The lost task's call was cut short by the lost lease: received, never answered.
    assert_eq!(stack.model.calls("slow"), 1);
    assert_eq!(
        m.sum("abada_agent_model_calls_total", &[("model", "slow")]),
        0.0
    );
    // Tool calls, against the tool server.
    let tools = stack.tools.counters().await;
    for tool in ["lookup_order", "issue_refund"] {
        assert_eq!(
            m.sum(
                "abada_agent_tool_calls_total",
                &[("server", "orders"), ("tool", tool), ("outcome", "ok")]
            ),
            tools.calls_per_tool[tool] as f64,
            "{tool}"
        );
        assert_eq!(tools.calls_per_tool[tool], 4);
    }
    assert_eq!(m.sum("abada_agent_tool_calls_total", &[]), 8.0);
    stack.shutdown().await;
}

/// A process author names what they like: 60 engine-sent definitions, each with an agent, a
/// model and a fallback of its own, made 60 new values of each label (5,808 series). Only the
/// operator's files declare label values now, each label capped: the 60 names add no value and
/// the series do not grow with them; the one agent and model the agents file declares keep
/// their names.
#[tokio::test]
async fn sixty_engine_sent_agent_and_model_names_add_no_label_values() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let declared = DeclaredLabelNames::write("refund-agent", &["openai/refund"], &[]).unwrap();
    let mut opts = WorkerOptions::new("w-labels", 8);
    opts.env.push(declared.env());
    stack.model.set_script("refund", refund_script());
    let mut specs = vec![spec(stack.refund_agent("openai/refund", &[]), "o-declared")];
    for i in 0..60 {
        let (model, fallback) = (format!("author-model-{i}"), format!("author-fallback-{i}"));
        stack.model.set_script(&model, refund_script());
        let mut agent = stack.refund_agent(
            &format!("openai/{model}"),
            &[&format!("anthropic/{fallback}")],
        );
        agent["name"] = format!("author-agent-{i}").into();
        specs.push(spec(agent, &format!("o-{i}")));
    }
    let ids = stack.engine.create_tasks(specs);
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(120)).await;
    assert!(
        views.iter().all(|v| v.status == TaskStatus::Completed),
        "{views:?}"
    );
    let text = worker.metrics.encode();
    worker.stop().await;
    assert!(
        !text.contains("author-"),
        "an author's name became a label value"
    );
    let (_, samples) = parse_exposition(&text);
    let mut values: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for s in &samples {
        for label in ["agent", "model", "gen_ai_request_model", "server", "tool"] {
            if let Some(v) = s.labels.get(label) {
                values.entry(label).or_default().insert(v);
            }
        }
    }
    assert_eq!(values["agent"], ["other", "refund-agent"].into());
    assert_eq!(values["model"], ["other", "refund"].into());
    assert_eq!(values["gen_ai_request_model"], ["other", "refund"].into());
    // The 60 authors' names collapse into one set of series, as many as the one declared
    // model has: they do not grow with the tasks.
    let series_of = |value: &str| {
        samples
            .iter()
            .filter(|s| {
                s.labels.get("model").map(String::as_str) == Some(value)
                    || s.labels.get("gen_ai_request_model").map(String::as_str) == Some(value)
            })
            .count()
    };
    println!(
        "61 tasks, 60 of them with an author's own agent and models: {} series in all; {} with model other, {} with the declared model",
        samples.len(),
        series_of("other"),
        series_of("refund")
    );
    assert_eq!(series_of("other"), series_of("refund"));
    stack.shutdown().await;
}

#[tokio::test]
async fn the_tasks_trace_context_reaches_every_engine_model_and_tool_call() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let mut task = spec(stack.refund_agent("openai/refund", &[]), "o-1");
    task.trace_parent = Some(parent.clone());
    let id = stack.engine.create_task(task);
    let worker = stack.spawn_worker(
        WorkerOptions::new("w-trace", 2),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    assert_eq!(views[0].status, TaskStatus::Completed);
    worker.stop().await;

    let continues = |header: Option<&str>| {
        let h = header.unwrap_or_else(|| panic!("no traceparent"));
        let parts: Vec<&str> = h.split('-').collect();
        parts.len() == 4
            && parts[0] == "00"
            && parts[1] == trace_id
            && parts[2].len() == 16
            && parts[2] != "00f067aa0ba902b7"
            && parts[3] == "01"
    };
    let task_calls: Vec<CallRecord> = stack
        .engine
        .calls()
        .into_iter()
        .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
        .collect();
    for op in [
        Operation::JournalRead,
        Operation::JournalAppend,
        Operation::ToolCredentials,
        Operation::Complete,
    ] {
        assert!(
            task_calls.iter().any(|c| c.operation == op),
            "{op:?} was called"
        );
    }
    for c in &task_calls {
        assert!(
            continues(c.traceparent.as_deref()),
            "{:?} carries the task's trace: {:?}",
            c.operation,
            c.traceparent
        );
    }
    let model_requests = stack.model.requests();
    assert_eq!(model_requests.len(), 3);
    for r in &model_requests {
        let tp = r
            .headers
            .iter()
            .find(|(k, _)| k == "traceparent")
            .map(|(_, v)| v.as_str());
        assert!(continues(tp), "model call carries the trace: {tp:?}");
    }
    let tool_calls = stack.tools.calls();
    assert_eq!(tool_calls.len(), 2);
    for c in &tool_calls {
        assert!(
            continues(c.traceparent.as_deref()),
            "tool call carries the trace: {:?}",
            c.traceparent
        );
    }
    stack.shutdown().await;
}

/// A SIGTERM while a validation runs: the task gives the validation up at its stop (released,
/// `agent::judging`) and the worker winds down, but the process exit used to drop the runtime,
/// which waits without a limit for every blocking thread, so one long validation held the exit
/// past the grace period. The daemon now ends through `app::run_to_exit` (as `main` does): here
/// a blocking job the daemon abandoned is still running, blocked for two minutes, and the
/// runtime is gone within `EXIT_WAIT` all the same. (On the old exit this waits two minutes and
/// fails at the one-minute bound.)
#[test]
fn the_exit_does_not_wait_for_a_validation_left_running() {
    use abada_agent_worker::app;
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (exited, exit) = std::sync::mpsc::channel();
    let daemon = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let started = Instant::now();
        app::run_to_exit(runtime, async move {
            let (running, is_running) = tokio::sync::oneshot::channel();
            // A validation whose task stopped waiting for it: its future is dropped, its thread
            // runs on.
            let job = tokio::task::spawn_blocking(move || {
                let _ = running.send(());
                let _ = held.recv_timeout(Duration::from_secs(120));
            });
            is_running.await.unwrap();
            drop(job);
        });
        let _ = exited.send(started.elapsed());
    });
    let took = exit
        .recv_timeout(Duration::from_secs(60))
        .expect("the exit waited for the blocking thread");
    println!("exit with a blocking job still running: {took:?}");
    assert!(took >= app::EXIT_WAIT, "{took:?}");
    release.send(()).ok();
    daemon.join().unwrap();
}
