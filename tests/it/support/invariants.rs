//! The fault suite's side of the one invariant checker: after every scenario,
//! [`check_invariants`] hands what was observed (the engine emulator's call log and task views,
//! what the tool servers received, what each worker showed: runner events stamped with the
//! emulator's clock, slot gauge samples, and for the real binary its output and peak memory) to
//! `abada_sim::observed`, which writes it in the simulator's vocabulary and runs the
//! simulator's checker on it (`abada_sim::invariants`, docs/SIMULATION.md). The promises are
//! the same in both: one completion (and one ending per attempt), keyed writes re-sent only
//! after an interruption, slots, healthy leases, no call after a loss, an end that agrees with
//! the engine, every task ended or leased, nothing panicked, memory bounded; the checks that
//! need the worker's own clock say how they judge a trace stamped at the emulator.
//!
//! This module keeps the collection: [`Recorder`] takes a worker's events as they come.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use abada_agent_worker::devkit::engine::{CallRecord, EngineEmulator, TaskView};
use abada_agent_worker::devkit::stack::WorkerHandle;
use abada_agent_worker::devkit::tools::{CallRecord as ToolCallRecord, ToolServer};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::runner::{RunnerEvent, WorkerStatus};
use abada_sim::observed::{self, ToolsSeen, WorkerSeen};
use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

/// A runner event with the emulator's time at which it was seen.
#[derive(Clone, Debug)]
pub struct Stamped {
    pub at: DateTime<Utc>,
    pub event: RunnerEvent,
}

/// What one worker showed during a scenario, observed after it stopped (every task it started
/// has ended by then).
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

/// The result of [`check_invariants`]: every invariant of the one checker, with its violations.
#[derive(Clone, Debug)]
pub struct Report {
    pub checks: Vec<Check>,
    /// Per invariant, how many events (or tasks) it had to judge.
    pub judged: BTreeMap<&'static str, usize>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.violations.is_empty())
    }

    /// The violations of invariant `name` (one of `abada_sim::invariants::INVARIANTS`).
    pub fn violations(&self, name: &str) -> Vec<String> {
        self.checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("invariant {name:?} is checked"))
            .violations
            .clone()
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

/// Checks every invariant. `tools` may be empty when no tool server ran.
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
    let tools: Vec<ToolsSeen> = tools
        .iter()
        .map(|t| ToolsSeen {
            server: t.server.clone(),
            calls: t.calls.clone(),
            writes_unkeyed: t.writes_unkeyed,
        })
        .collect();
    let workers: Vec<WorkerSeen> = workers
        .iter()
        .map(|w| WorkerSeen {
            worker_id: w.worker_id.clone(),
            slots: w.max_tasks,
            events: w.events.iter().map(|s| (s.at, s.event.clone())).collect(),
            slot_samples: w.slot_samples.clone(),
            output: w.output.clone(),
            memory: w.memory,
            stopped: true,
        })
        .collect();
    let (violations, judged) = observed::check(&observed::Run {
        calls,
        views: tasks,
        now,
        tools: &tools,
        workers: &workers,
        lease_loss: expect.lease_loss.iter().cloned().collect(),
        tool_tries: expect.tool_tries,
    });
    Report {
        checks: abada_sim::invariants::INVARIANTS
            .iter()
            .map(|name| Check {
                name,
                violations: violations
                    .iter()
                    .filter(|v| v.invariant == *name)
                    .map(|v| v.message.clone())
                    .collect(),
            })
            .collect(),
        judged,
    }
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
