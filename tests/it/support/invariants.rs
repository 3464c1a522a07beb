//! The one invariant checker of the fault-injection suite: after every scenario,
//! [`check_invariants`] reads the engine emulator's call log and task views, the tool server's
//! counters and calls, and what each worker showed (runner events stamped with the emulator's
//! clock, slot gauge samples, and for the real binary its output and peak memory), and checks:
//!
//! 1. no task completed twice (one executed `complete` per task at most);
//! 2. keyed writes re-sent only after an interruption: counted at the tool server, a key is
//!    sent once, plus once per interruption its journal shows (the `tool/started` step of the
//!    key appended by one attempt and its `finished` step by a later one, or never); a journaled
//!    task sends no key its journal does not hold; no unkeyed write; each order refunded under one
//!    key at most;
//! 3. no leaked slot: the in-use gauge stayed within 0..=MAX_TASKS and is back to 0, and every
//!    started task ended;
//! 4. no lease of a healthy task expired (every new attempt follows an ending call of the one
//!    before, and nothing ended `lease_lost`, except for tasks the scenario names);
//! 5. no call about a task after its lease was lost (after its `lease_lost` end, and no ending
//!    call after a lease-lost refusal, unless the attempt's own committed ending came first);
//! 6. every task ended in exactly one outcome of protocol.md B.5, or is still leased live;
//! 7. nothing panicked (no handler panic turned into a failure, no "panicked" in the output);
//! 8. memory stayed bounded (the real binary's VmHWM under a bound).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use abada_agent_worker::devkit::engine::{
    CallRecord, Disposition, EngineEmulator, Operation, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::stack::WorkerHandle;
use abada_agent_worker::devkit::tools::{CallRecord as ToolCallRecord, ToolServer};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::runner::{RunnerEvent, WorkerStatus};
use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::sync::mpsc;

/// A runner event with the emulator's time at which it was seen.
#[derive(Clone, Debug)]
pub struct Stamped {
    pub at: DateTime<Utc>,
    pub event: RunnerEvent,
}

/// What one worker showed during a scenario.
#[derive(Clone, Debug, Default)]
pub struct WorkerObservation {
    pub worker_id: String,
    pub max_tasks: u32,
    pub events: Vec<Stamped>,
    /// `abada_agent_slots_in_use` samples taken during the run, the last one after it.
    pub slot_samples: Vec<i64>,
    /// Output lines (the real binary only).
    pub output: Vec<String>,
    /// Peak resident memory in KiB (the real binary only) and the bound it must stay under.
    pub memory: Option<(u64, u64)>,
}

/// Collects a worker's events (stamped with the emulator's clock) and slot gauge samples while
/// a scenario runs.
pub struct Recorder {
    worker_id: String,
    max_tasks: u32,
    events: Arc<Mutex<Vec<Stamped>>>,
    samples: Arc<Mutex<Vec<i64>>>,
    metrics: Arc<Metrics>,
    pub status: Arc<WorkerStatus>,
    collector: tokio::task::JoinHandle<()>,
}

impl Recorder {
    /// Takes over `worker.events` (leaving an empty receiver in its place).
    pub fn attach(engine: &EngineEmulator, worker: &mut WorkerHandle, max_tasks: u32) -> Self {
        let (_tx, empty) = mpsc::unbounded_channel();
        let mut rx = std::mem::replace(&mut worker.events, empty);
        let events = Arc::new(Mutex::new(Vec::new()));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let metrics = worker.metrics.clone();
        let collector = {
            let events = events.clone();
            let samples = samples.clone();
            let engine = engine.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                while let Some(event) = rx.recv().await {
                    let at = engine.now();
                    // Sampled on every event: fetches and task ends are when the gauge moves.
                    samples.lock().unwrap().push(metrics.slots_in_use.get());
                    events.lock().unwrap().push(Stamped { at, event });
                }
            })
        };
        Recorder {
            worker_id: worker.worker_id.clone(),
            max_tasks,
            events,
            samples,
            metrics,
            status: worker.status.clone(),
            collector,
        }
    }

    pub fn events(&self) -> Vec<RunnerEvent> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.event.clone())
            .collect()
    }

    /// Waits (bounded by the caller) until `pred` holds for the events seen so far.
    pub async fn wait_until(&self, mut pred: impl FnMut(&[RunnerEvent]) -> bool) {
        loop {
            if pred(&self.events()) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Waits until the collector has taken the worker's last event: once the worker has
    /// stopped, its event channel closes when the last of the runner's parts is gone. Bounded;
    /// an event channel left open means something of the stopped worker still runs.
    pub async fn drained(&mut self) {
        let limit = std::time::Duration::from_secs(10);
        if tokio::time::timeout(limit, &mut self.collector)
            .await
            .is_err()
        {
            panic!(
                "{}: the event channel stayed open {limit:?} after the worker stopped",
                self.worker_id
            );
        }
    }

    /// The observation, with a last gauge sample taken now.
    pub fn observation(&self) -> WorkerObservation {
        let mut slot_samples = self.samples.lock().unwrap().clone();
        slot_samples.push(self.metrics.slots_in_use.get());
        WorkerObservation {
            worker_id: self.worker_id.clone(),
            max_tasks: self.max_tasks,
            events: self.events.lock().unwrap().clone(),
            slot_samples,
            output: Vec::new(),
            memory: None,
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.collector.abort();
    }
}

/// What one tool server received during a scenario.
#[derive(Clone, Debug, Default)]
pub struct ToolObservation {
    pub server: String,
    /// Every `tools/call` the server received, in order.
    pub calls: Vec<ToolCallRecord>,
    /// Refunds the server applied without an idempotency key.
    pub writes_unkeyed: u64,
}

impl ToolObservation {
    pub async fn of(server: &ToolServer) -> Self {
        ToolObservation {
            server: server.name().to_string(),
            calls: server.calls(),
            writes_unkeyed: server.counters().await.writes_unkeyed,
        }
    }
}

/// What the scenario's faults make legitimate.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    /// Tasks the scenario expects to lose a lease (its fault targets their lease on purpose).
    pub lease_loss: HashSet<String>,
    /// Sends of one keyed write an attempt may make: the worker's `tool_attempts` where the
    /// scenario makes a tool server fail transiently (a timeout: the answer is lost, so the
    /// write is re-sent under its key), else 1 (0 counts as 1): without a fault, no re-send.
    pub tool_tries: u32,
}

impl Expect {
    pub fn lease_loss(ids: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Expect {
            lease_loss: ids.into_iter().map(Into::into).collect(),
            ..Expect::default()
        }
    }

    /// Allows `tries` sends of a keyed write per attempt (see [`Expect::tool_tries`]).
    pub fn tool_tries(mut self, tries: u32) -> Self {
        self.tool_tries = tries;
        self
    }
}

/// One checked invariant.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: &'static str,
    pub violations: Vec<String>,
}

/// The result of [`check_invariants`].
#[derive(Clone, Debug)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.violations.is_empty())
    }

    /// Fails the test with every violation, by invariant.
    pub fn assert_ok(&self, scenario: &str) {
        if self.passed() {
            return;
        }
        let mut text = format!("invariants violated in scenario {scenario}:\n");
        for c in self.checks.iter().filter(|c| !c.violations.is_empty()) {
            text.push_str(&format!("- {}:\n", c.name));
            for v in &c.violations {
                text.push_str(&format!("    {v}\n"));
            }
        }
        panic!("{text}");
    }
}

/// The names of the invariants, in the order of the module docs (for the docs' table).
pub const INVARIANTS: [&str; 8] = [
    "no task completed twice",
    "keyed writes re-sent only after an interruption",
    "no leaked slot",
    "no lease of a healthy task expired",
    "no call about a task after its lease was lost",
    "exactly one B.5 outcome per task, or still leased",
    "nothing panicked",
    "memory bounded",
];

/// A refusal that tells the worker the task is no longer its own (protocol.md A.2). An
/// `ENGINE_COMMAND_REJECTED` is one only when its message says the task is not locked or not
/// found; another (a suspended instance, a gateway with no way out) refuses the command, not the
/// lease, and the worker reports that outcome once as an incident.
fn is_lease_lost_refusal(c: &CallRecord) -> bool {
    matches!(
        (c.status, c.error_code.as_deref()),
        (403, Some("WORKER_LOCK_NOT_OWNED"))
            | (409, Some("WORKER_LOCK_EXPIRED"))
            | (409, Some("STALE_ATTEMPT"))
            | (409, Some("JOURNAL_CONFLICT"))
    ) || (c.status == 400
        && c.error_code.as_deref() == Some("ENGINE_COMMAND_REJECTED")
        && c.error_message.as_deref().is_some_and(|m| {
            m.starts_with("External task is not locked") || m.starts_with("External task not found")
        }))
}

/// A lease-lost refusal the attempt's own ending can cause: a heartbeat, append or second ending
/// that finds the task already ended. A `JOURNAL_CONFLICT` never is (the journal refused a step
/// that differs from the one it holds, whatever became of the task), so an ending after one is
/// always a violation.
fn may_follow_own_ending(c: &CallRecord) -> bool {
    is_lease_lost_refusal(c) && c.error_code.as_deref() != Some("JOURNAL_CONFLICT")
}

fn is_ending(op: Operation) -> bool {
    matches!(
        op,
        Operation::Complete | Operation::Failure | Operation::BpmnError
    )
}

fn committed(c: &CallRecord) -> bool {
    matches!(c.disposition, Disposition::Executed)
}

/// The attempt that appended each step of `task`'s journal (`None` where the call log cannot
/// say, e.g. when it was capped): the emulator pushes a step exactly when it answers an append
/// 201, and logs each call under the state lock that ran it, so the executed 201 appends of the
/// task, in log order, are its journal's steps in order.
fn journal_appenders(calls: &[CallRecord], task: &str, steps: usize) -> Vec<Option<i64>> {
    let mut appenders: Vec<Option<i64>> = calls
        .iter()
        .filter(|c| {
            c.operation == Operation::JournalAppend
                && c.task_id.as_deref() == Some(task)
                && committed(c)
                && c.status == 201
        })
        .map(|c| c.attempt)
        .collect();
    appenders.resize(steps, None);
    appenders
}

/// How many attempts may have sent keyed write `key` of task `t`: one, plus one per interruption
/// between the key's `tool/started` step and its `finished` step (the attempts after the one
/// that journaled the start, up to the one that journaled the finish, or the task's current
/// attempt). `Err` when a journaled task sent a key its journal lacks. A task without a journal
/// (content keys) may re-send on every re-delivery.
fn attempts_sending(
    calls: &[CallRecord],
    t: &TaskView,
    key: &str,
) -> Result<(u64, String), String> {
    let step_of = |state: &str| {
        t.journal.iter().position(|s| {
            s.get("kind").and_then(Value::as_str) == Some("tool")
                && s.get("state").and_then(Value::as_str) == Some(state)
                && s.get("key").and_then(Value::as_str) == Some(key)
        })
    };
    let current = i64::from(t.attempt);
    let Some(started) = step_of("started") else {
        if t.journal.is_empty() {
            let redeliveries = (current - 1).max(0) as u64;
            return Ok((
                1 + redeliveries,
                format!("no journal, {redeliveries} re-deliveries"),
            ));
        }
        return Err(format!(
            "task {}: key {key} sent, but its journal ({} steps) holds no tool/started step with it",
            t.id,
            t.journal.len()
        ));
    };
    let appenders = journal_appenders(calls, &t.id, t.journal.len());
    let finished = step_of("finished");
    let from = appenders[started];
    let to = match finished {
        Some(i) => appenders[i],
        None => Some(current),
    };
    let (Some(from), Some(to)) = (from, to) else {
        // The log cannot say which attempts wrote the steps: every re-delivery may re-send.
        let redeliveries = (current - 1).max(0) as u64;
        return Ok((
            1 + redeliveries,
            format!("appenders unknown, {redeliveries} re-deliveries"),
        ));
    };
    let interruptions = (to - from).max(0) as u64;
    Ok((
        1 + interruptions,
        format!(
            "tool/started in attempt {from}, {} in attempt {to}: {interruptions} interruption(s)",
            if finished.is_some() {
                "finished"
            } else {
                "not finished, now"
            }
        ),
    ))
}

/// Checks every invariant of the module docs. `tools` may be empty when no tool server ran.
pub async fn check_invariants(
    engine: &EngineEmulator,
    tools: &[&ToolServer],
    workers: &[WorkerObservation],
    expect: &Expect,
) -> Report {
    let mut observed = Vec::with_capacity(tools.len());
    for server in tools {
        observed.push(ToolObservation::of(server).await);
    }
    check_observed(
        &engine.calls(),
        &engine.tasks(),
        engine.now(),
        &observed,
        workers,
        expect,
    )
}

/// [`check_invariants`] on what was observed: the engine's call log, its task views and its
/// clock, what the tool servers received and what the workers showed. The hand-played
/// violations of `tests/it/checker.rs` come in here.
pub fn check_observed(
    calls: &[CallRecord],
    tasks: &[TaskView],
    now: DateTime<Utc>,
    tools: &[ToolObservation],
    workers: &[WorkerObservation],
    expect: &Expect,
) -> Report {
    let mut checks = Vec::new();

    // 1. No task completed twice.
    let mut v = Vec::new();
    let mut completes: HashMap<&str, usize> = HashMap::new();
    for c in calls
        .iter()
        .filter(|c| c.operation == Operation::Complete && committed(c))
    {
        *completes
            .entry(c.task_id.as_deref().unwrap_or(""))
            .or_default() += 1;
    }
    for (id, n) in &completes {
        if *n > 1 {
            v.push(format!("task {id}: complete executed {n} times"));
        }
    }
    for t in tasks {
        if t.counters.completes > 1 {
            v.push(format!(
                "task {}: {} completes counted",
                t.id, t.counters.completes
            ));
        }
    }
    checks.push(Check {
        name: INVARIANTS[0],
        violations: v,
    });

    // 2. Keyed writes re-sent only after an interruption.
    let mut v = Vec::new();
    for server in tools {
        if server.writes_unkeyed > 0 {
            v.push(format!(
                "{}: {} writes without an idempotency key",
                server.server, server.writes_unkeyed
            ));
        }
        let mut sends: BTreeMap<&str, u64> = BTreeMap::new();
        let mut keys_per_order: BTreeMap<String, HashSet<String>> = BTreeMap::new();
        for call in &server.calls {
            let Some(key) = &call.idempotency_key else {
                continue;
            };
            *sends.entry(key.as_str()).or_default() += 1;
            if call.tool == "issue_refund"
                && let Some(order) = call.arguments.get("orderId").and_then(|o| o.as_str())
            {
                keys_per_order
                    .entry(order.to_string())
                    .or_default()
                    .insert(key.clone());
            }
        }
        for (key, n) in sends {
            // Keys are `abada:{taskId}:...` (src/agent/journal.rs).
            let task_id = key.split(':').nth(1).unwrap_or_default();
            let Some(t) = tasks.iter().find(|t| t.id == task_id) else {
                v.push(format!(
                    "{}: key {key} sent {n} time(s) names no task the engine knows",
                    server.server
                ));
                continue;
            };
            let tries = u64::from(expect.tool_tries.max(1));
            match attempts_sending(calls, t, key) {
                Err(why) => v.push(format!("{}: {why}", server.server)),
                Ok((attempts, why)) if n > attempts * tries => v.push(format!(
                    "{}: task {task_id}: key {key} sent {n} times, {} allowed ({why}; {tries} per attempt)",
                    server.server,
                    attempts * tries
                )),
                Ok(_) => {}
            }
        }
        for (order, keys) in keys_per_order {
            if keys.len() > 1 {
                v.push(format!(
                    "order {order} refunded under {} keys: {keys:?}",
                    keys.len()
                ));
            }
        }
    }
    checks.push(Check {
        name: INVARIANTS[1],
        violations: v,
    });

    // 3. No leaked slot.
    let mut v = Vec::new();
    for w in workers {
        if let Some(bad) = w
            .slot_samples
            .iter()
            .find(|s| **s < 0 || **s > i64::from(w.max_tasks))
        {
            v.push(format!(
                "{}: slots in use {bad} outside 0..={}",
                w.worker_id, w.max_tasks
            ));
        }
        if w.slot_samples.last().is_some_and(|s| *s != 0) {
            v.push(format!(
                "{}: {} slots still in use at the end",
                w.worker_id,
                w.slot_samples.last().unwrap()
            ));
        }
        let started = w
            .events
            .iter()
            .filter(|e| matches!(e.event, RunnerEvent::TaskStarted { .. }))
            .count();
        let ended = w
            .events
            .iter()
            .filter(|e| matches!(e.event, RunnerEvent::TaskEnded { .. }))
            .count();
        if started != ended {
            v.push(format!(
                "{}: {started} tasks started, {ended} ended",
                w.worker_id
            ));
        }
    }
    checks.push(Check {
        name: INVARIANTS[2],
        violations: v,
    });

    // 4. No lease of a healthy task expired.
    let mut v = Vec::new();
    for t in tasks.iter().filter(|t| !expect.lease_loss.contains(&t.id)) {
        let mine: Vec<&CallRecord> = calls
            .iter()
            .filter(|c| c.task_id.as_deref() == Some(t.id.as_str()))
            .collect();
        for attempt in 1..t.attempt {
            let ended = mine.iter().any(|c| {
                is_ending(c.operation)
                    && c.attempt == Some(i64::from(attempt))
                    && (committed(c) || c.disposition == Disposition::Replayed)
            });
            if !ended {
                v.push(format!(
                    "task {}: attempt {attempt} was followed by attempt {} without ending (its lease expired)",
                    t.id,
                    attempt + 1
                ));
            }
        }
        if let Some(c) = mine
            .iter()
            .find(|c| c.error_code.as_deref() == Some("WORKER_LOCK_EXPIRED"))
        {
            v.push(format!(
                "task {}: {:?} refused WORKER_LOCK_EXPIRED",
                t.id, c.operation
            ));
        }
    }
    for w in workers {
        for e in &w.events {
            if let RunnerEvent::TaskEnded {
                task_id,
                outcome: TaskEnd::LeaseLost,
                ..
            } = &e.event
                && !expect.lease_loss.contains(task_id)
            {
                v.push(format!("{}: task {task_id} ended lease_lost", w.worker_id));
            }
        }
    }
    checks.push(Check {
        name: INVARIANTS[3],
        violations: v,
    });

    // 5. No call about a task after its lease was lost.
    let mut v = Vec::new();
    for w in workers {
        for e in &w.events {
            if let RunnerEvent::TaskEnded {
                task_id,
                attempt,
                outcome: TaskEnd::LeaseLost,
            } = &e.event
            {
                for c in calls.iter().filter(|c| {
                    c.task_id.as_deref() == Some(task_id.as_str())
                        && c.worker_id.as_deref() == Some(w.worker_id.as_str())
                        && c.attempt == attempt.map(i64::from)
                        && c.at > e.at
                }) {
                    v.push(format!(
                        "{}: {:?} about task {task_id} attempt {attempt:?} after its lease was lost",
                        w.worker_id, c.operation
                    ));
                }
            }
        }
    }
    // A refusal caused by the attempt's own ending call (a heartbeat that finds the task
    // completed) is no loss: such a refusal is skipped when a committed ending of the same task
    // and attempt comes before it in the log. The log is written under the state lock that ran
    // each command, so its order is decision order (arrival stamps are not: injected latency
    // comes between). An ending that commits after the refusal never exempts it, whatever it
    // is. A JOURNAL_CONFLICT is never such a refusal (see `may_follow_own_ending`).
    for (index, refusal) in calls.iter().enumerate().filter(|(index, c)| {
        is_lease_lost_refusal(c)
            && !(may_follow_own_ending(c)
                && calls[..*index].iter().any(|e| {
                    is_ending(e.operation)
                        && committed(e)
                        && e.task_id == c.task_id
                        && e.attempt == c.attempt
                }))
    }) {
        // A replay of a command already sent (same key) executes nothing; it may have been in
        // flight when the refusal came. An ending that arrived before the refusal was sent
        // before the worker could know of it.
        for c in calls[index + 1..].iter().filter(|c| {
            is_ending(c.operation)
                && c.disposition != Disposition::Replayed
                && c.task_id == refusal.task_id
                && c.worker_id == refusal.worker_id
                && c.attempt == refusal.attempt
                && c.at > refusal.at
        }) {
            v.push(format!(
                "{:?} about task {:?} after {:?} was refused {:?}",
                c.operation, c.task_id, refusal.operation, refusal.error_code
            ));
        }
    }
    checks.push(Check {
        name: INVARIANTS[4],
        violations: v,
    });

    // 6. Exactly one B.5 outcome per task (per attempt), or still leased.
    let mut v = Vec::new();
    let mut endings: HashMap<(String, i64), usize> = HashMap::new();
    for c in calls
        .iter()
        .filter(|c| is_ending(c.operation) && committed(c))
    {
        *endings
            .entry((
                c.task_id.clone().unwrap_or_default(),
                c.attempt.unwrap_or(0),
            ))
            .or_default() += 1;
    }
    for ((id, attempt), n) in &endings {
        if *n > 1 {
            v.push(format!(
                "task {id} attempt {attempt}: {n} ending calls executed"
            ));
        }
    }
    for t in tasks {
        let fine = match t.status {
            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError => true,
            // Deferred, failed with retries left, or released: back to the engine, reported.
            TaskStatus::Open => endings.keys().any(|(id, _)| id == &t.id) || t.attempt == 0,
            TaskStatus::Locked if t.hidden => true,
            TaskStatus::Locked => t.lock_expiration_time.is_some_and(|exp| exp > now),
        };
        if !fine {
            v.push(format!(
                "task {} is {:?} (attempt {}, lease until {:?}) without an outcome",
                t.id, t.status, t.attempt, t.lock_expiration_time
            ));
        }
    }
    for w in workers {
        for e in &w.events {
            if let RunnerEvent::TaskEnded {
                task_id,
                attempt,
                outcome,
            } = &e.event
            {
                let executed = endings
                    .get(&(task_id.clone(), attempt.map(i64::from).unwrap_or(0)))
                    .copied()
                    .unwrap_or(0);
                if outcome.reported()
                    && executed == 0
                    && !calls.iter().any(|c| {
                        is_ending(c.operation)
                            && c.task_id.as_deref() == Some(task_id.as_str())
                            && c.disposition == Disposition::Replayed
                    })
                {
                    v.push(format!(
                        "task {task_id} attempt {attempt:?} ended {outcome} but the engine has no such call"
                    ));
                }
                if *outcome == TaskEnd::LeaseLost && executed > 0 {
                    v.push(format!(
                        "task {task_id} attempt {attempt:?} ended lease_lost but reported {executed} time(s)"
                    ));
                }
            }
        }
    }
    checks.push(Check {
        name: INVARIANTS[5],
        violations: v,
    });

    // 7. Nothing panicked.
    let mut v = Vec::new();
    for t in tasks {
        for text in [&t.error_message, &t.error_details].into_iter().flatten() {
            if text.contains("panicked") {
                v.push(format!("task {}: {text}", t.id));
            }
        }
    }
    for w in workers {
        if let Some(line) = w.output.iter().find(|l| l.contains("panicked")) {
            v.push(format!("{}: {line}", w.worker_id));
        }
    }
    checks.push(Check {
        name: INVARIANTS[6],
        violations: v,
    });

    // 8. Memory bounded.
    let mut v = Vec::new();
    for w in workers {
        if let Some((peak, bound)) = w.memory
            && peak > bound
        {
            v.push(format!(
                "{}: peak resident memory {peak} KiB over the bound {bound} KiB",
                w.worker_id
            ));
        }
    }
    checks.push(Check {
        name: INVARIANTS[7],
        violations: v,
    });

    Report { checks }
}

/// Peak resident memory (VmHWM) of a process, in KiB.
pub fn peak_memory_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
