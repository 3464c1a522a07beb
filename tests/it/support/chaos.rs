//! The chaos of the crash tests (`durable.rs` on agent/1, `store_chaos.rs` on a plain engine
//! with the run store): a seeded schedule that SIGSTOPs one worker process past its lease while
//! another is SIGKILLed and restarted, and the counting both tests share: model calls per task
//! from the scripted model's log, keys received per task by the tool server, and writes the
//! engine accepted from a holder that was no longer current.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{
    CallRecord, Disposition, EngineEmulator, Operation, TaskStatus,
};
use abada_agent_worker::devkit::model::RecordedRequest;
use abada_agent_worker::devkit::tools::CallRecord as ToolCallRecord;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use super::process::WorkerProcess;

/// The chaos schedule's random source, from `ABADA_CHAOS_SEED` when set (a replay) or the clock.
/// The guard prints how to replay the schedule when the test fails (it is dropped while the
/// failure unwinds); the processes' own timing is not replayed.
pub fn seeded(test: &'static str) -> (StdRng, ReplayHint) {
    let seed: u64 = match std::env::var("ABADA_CHAOS_SEED") {
        Ok(value) => value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("ABADA_CHAOS_SEED={value:?} is not a whole number")),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(7),
    };
    println!("{test}: chaos seed {seed}");
    (StdRng::seed_from_u64(seed), ReplayHint { test, seed })
}

pub struct ReplayHint {
    test: &'static str,
    seed: u64,
}

impl Drop for ReplayHint {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "{0} failed with chaos seed {1}; replay its schedule with ABADA_CHAOS_SEED={1}",
                self.test, self.seed
            );
        }
    }
}

/// How long the chaos may go on.
pub struct Plan {
    /// The workers' lock duration: a frozen worker is woken 300 to 900 ms after it passed.
    pub lock: Duration,
    pub max_rounds: u32,
    /// No round starts after this long.
    pub limit: Duration,
}

/// What the chaos did.
pub struct Chaos {
    pub rounds: u32,
    pub kills: u32,
    pub freezes: u32,
    pub took: Duration,
    /// The killed processes, kept for their output (their logs up to the kill).
    pub killed: Vec<WorkerProcess>,
}

/// Rounds of chaos until `done` holds or the plan's bounds are reached: each round SIGSTOPs one
/// worker, SIGKILLs another after 100 to 600 ms and starts it again (`respawn(index)`), wakes
/// the frozen one (SIGCONT) 300 to 900 ms after its lease ran out, then lets the workers run for
/// 200 to 800 ms.
pub async fn run<F, Fut>(
    workers: &mut [WorkerProcess],
    mut respawn: F,
    plan: &Plan,
    rng: &mut StdRng,
    done: impl Fn() -> bool,
) -> Chaos
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = WorkerProcess>,
{
    let n = workers.len();
    assert!(
        n >= 2,
        "chaos needs one worker to freeze and another to kill"
    );
    let started = tokio::time::Instant::now();
    let mut chaos = Chaos {
        rounds: 0,
        kills: 0,
        freezes: 0,
        took: Duration::ZERO,
        killed: Vec::new(),
    };
    while chaos.rounds < plan.max_rounds && started.elapsed() < plan.limit && !done() {
        chaos.rounds += 1;
        // Freeze one worker past its lease ...
        let frozen = rng.random_range(0..n);
        workers[frozen].signal("STOP");
        chaos.freezes += 1;
        let frozen_at = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
        // ... and meanwhile kill another one and start it again.
        let killed = (frozen + rng.random_range(1..n)) % n;
        workers[killed].signal("KILL");
        workers[killed].wait(Duration::from_secs(10)).await;
        chaos.kills += 1;
        let fresh = respawn(killed).await;
        chaos
            .killed
            .push(std::mem::replace(&mut workers[killed], fresh));
        let thaw_at = frozen_at + plan.lock + Duration::from_millis(rng.random_range(300..900));
        tokio::time::sleep_until(thaw_at).await;
        workers[frozen].signal("CONT");
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
    }
    chaos.took = started.elapsed();
    chaos
}

/// Both crash tests' start: `count` worker processes named `{prefix}-{k}` with the environment
/// `env(name)`, then [`run`] on them (a killed worker comes back with its own name) until every
/// task the emulator holds has completed or failed. The replay hint is handed back so that it
/// lives, and prints its seed, until the test ends.
pub async fn start_and_run(
    engine: &EngineEmulator,
    count: usize,
    prefix: &str,
    env: impl Fn(&str) -> Vec<(String, String)>,
    plan: &Plan,
    test: &'static str,
) -> (Vec<WorkerProcess>, Chaos, ReplayHint) {
    let name = |k: usize| format!("{prefix}-{k}");
    let mut workers = Vec::with_capacity(count);
    for k in 0..count {
        workers.push(WorkerProcess::spawn(&env(&name(k))).await);
    }
    let all_ended = || {
        engine
            .tasks()
            .iter()
            .all(|t| matches!(t.status, TaskStatus::Completed | TaskStatus::Failed))
    };
    let (mut rng, replay_hint) = seeded(test);
    let respawn = |k: usize| {
        let env = env(&name(k));
        async move { WorkerProcess::spawn(&env).await }
    };
    let chaos = run(&mut workers, respawn, plan, &mut rng, all_ended).await;
    (workers, chaos, replay_hint)
}

/// The order id a recorded model request is about: its first user message.
pub fn request_order(body: &Value) -> Option<String> {
    let messages = body.get("messages")?.as_array()?;
    let first = messages
        .iter()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))?;
    match first.get("content")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .find_map(|b| b.get("text").and_then(Value::as_str))
            .map(str::to_string),
        _ => None,
    }
}

/// Model requests per task (`order_of` maps an order id to its task id), and how many requests
/// could not be attributed to a task.
pub fn model_calls_per_task(
    requests: &[RecordedRequest],
    order_of: &HashMap<String, String>,
) -> (HashMap<String, u32>, usize) {
    let mut calls: HashMap<String, u32> = HashMap::new();
    let mut unattributed = 0;
    for r in requests {
        match request_order(&r.body).and_then(|o| order_of.get(&o)) {
            Some(id) => *calls.entry(id.clone()).or_default() += 1,
            None => unattributed += 1,
        }
    }
    (calls, unattributed)
}

/// The idempotency keys of the `issue_refund` calls the tool server received, per task (the
/// task id is the key's second part, `abada:{taskId}:...`), and how many such calls there were.
pub fn refund_keys_per_task(calls: &[ToolCallRecord]) -> (HashMap<String, HashSet<String>>, usize) {
    let mut keys: HashMap<String, HashSet<String>> = HashMap::new();
    let mut received = 0;
    for c in calls.iter().filter(|c| c.tool == "issue_refund") {
        received += 1;
        if let Some(key) = &c.idempotency_key {
            let task = key.split(':').nth(1).unwrap_or_default().to_string();
            keys.entry(task).or_default().insert(key.clone());
        }
    }
    (keys, received)
}

/// What the engine's call log says about writes from holders that were no longer current.
#[derive(Debug, Default)]
pub struct StaleAudit {
    /// Executed writes whose attempt or worker was not the task's holder at that point.
    pub accepted: Vec<String>,
    /// `complete` on an already completed task by the holder that completed it (a re-send whose
    /// first answer was lost): 200 and nothing done (protocol.md A.2). The same call from any
    /// other holder is in `accepted`: the engine did nothing, but a stale holder reported.
    pub noop_completes: usize,
    /// Refusals by (operation, code).
    pub refusals: HashMap<String, usize>,
}

impl StaleAudit {
    /// The refusals, sorted, for printing.
    pub fn refusals_sorted(&self) -> Vec<(&String, &usize)> {
        let mut refusals: Vec<(&String, &usize)> = self.refusals.iter().collect();
        refusals.sort();
        refusals
    }
}

/// Replays the emulator's call log in order. Each executed fetch-and-lock hands its tasks a new
/// attempt (the emulator increments `attempt` on every acquisition) held by the fetching worker;
/// an executed complete, failure or bpmn-error ends the holding. Every other executed write
/// about a task (heartbeat, journal append, tool credential, complete, failure, bpmn-error) must
/// then carry exactly the holder's worker id and, when `attempts` is set (agent/1), its attempt;
/// one that does not is a write accepted from a stale holder. A `complete` on a task already
/// completed is a no-op only when it comes from the holder that completed it; from anyone else
/// it is a stale holder's report. A plain v1 engine knows no attempt: there only the worker id
/// is checked (the run store fences the rest). Replays (`Replayed`) wrote nothing and are
/// skipped.
///
/// The log is ordered by when each request finished, not by when it took the emulator's lock;
/// two requests finishing within the same microsecond could swap. A swap could only show up
/// here as a false positive, never hide a stale write.
pub fn audit_stale_writes(calls: &[CallRecord], attempts: bool) -> StaleAudit {
    let mut audit = StaleAudit::default();
    let mut holder: HashMap<String, (u32, Option<String>)> = HashMap::new();
    // The holder (worker id, attempt) whose complete ended each completed task.
    let mut completed: HashMap<String, (Option<String>, Option<i64>)> = HashMap::new();
    for c in calls {
        if c.disposition == Disposition::Refused {
            *audit
                .refusals
                .entry(format!(
                    "{:?} {}",
                    c.operation,
                    c.error_code.as_deref().unwrap_or("?")
                ))
                .or_default() += 1;
            continue;
        }
        if c.disposition != Disposition::Executed {
            continue;
        }
        if c.operation == Operation::FetchAndLock {
            for t in &c.task_ids {
                let h = holder.entry(t.clone()).or_insert((0, None));
                h.0 += 1;
                h.1 = c.worker_id.clone();
            }
            continue;
        }
        let writes = matches!(
            c.operation,
            Operation::Heartbeat
                | Operation::ExtendLock
                | Operation::Complete
                | Operation::Failure
                | Operation::BpmnError
                | Operation::JournalAppend
                | Operation::ToolCredentials
        );
        let Some(task) = c.task_id.clone().filter(|_| writes) else {
            continue;
        };
        if c.operation == Operation::Complete
            && let Some((worker, attempt)) = completed.get(&task)
        {
            if c.worker_id == *worker && (!attempts || c.attempt == *attempt) {
                audit.noop_completes += 1;
            } else {
                audit.accepted.push(format!(
                    "Complete on {task} by {:?} attempt {:?} after {worker:?} attempt {attempt:?} completed it",
                    c.worker_id, c.attempt
                ));
            }
            continue;
        }
        let (attempt, worker) = holder.get(&task).cloned().unwrap_or((0, None));
        let current = worker.is_some()
            && c.worker_id == worker
            && (!attempts || c.attempt == Some(i64::from(attempt)));
        if !current {
            audit.accepted.push(format!(
                "{:?} on {task} by {:?} attempt {:?} while the holder was {worker:?} attempt {attempt}",
                c.operation, c.worker_id, c.attempt
            ));
        }
        if matches!(
            c.operation,
            Operation::Complete | Operation::Failure | Operation::BpmnError
        ) {
            if let Some(h) = holder.get_mut(&task) {
                h.1 = None;
            }
            if c.operation == Operation::Complete {
                completed.insert(task, (c.worker_id.clone(), c.attempt));
            }
        }
    }
    audit
}
