//! A run on the wire, in the simulator's vocabulary: what the fault suite observed (the engine
//! emulator's call log and task views, what its tool servers received, what each worker showed)
//! written as a [`Trace`], so that one checker ([`crate::invariants::check`]) judges the
//! simulator's seeds and the fault suite's scenarios alike.
//!
//! The times are the emulator's clock in milliseconds from the run's first record: a call is
//! stamped when the emulator received it (the log's order is the order the engine decided in,
//! kept even where injected latency made stamps go backwards), a worker's event when the
//! suite's recorder took it. What such a trace cannot show (the worker's own send times and
//! clock) is said to the checks by [`Scenario`], and each says how it judges without it.

use std::collections::{BTreeMap, BTreeSet};

use abada_agent_worker::runner::RunnerEvent;
use abada_devkit::engine::{CallRecord, Disposition, Operation, TaskStatus, TaskView};
use abada_devkit::tools::CallRecord as ToolCallRecord;
use chrono::{DateTime, Utc};

use crate::invariants::{self, Facts, Scenario, Violation};
use crate::schedule::Schedule;
use crate::world::trace::{Answer, Event, Trace};

/// What one tool server received.
#[derive(Clone, Debug, Default)]
pub struct ToolsSeen {
    pub server: String,
    /// Every `tools/call` the server received, in order.
    pub calls: Vec<ToolCallRecord>,
    /// Refunds the server applied without an idempotency key.
    pub writes_unkeyed: u64,
}

/// What one worker showed.
#[derive(Clone, Debug, Default)]
pub struct WorkerSeen {
    pub worker_id: String,
    pub slots: u32,
    /// Its runner's events, stamped with the emulator's clock when they were taken.
    pub events: Vec<(DateTime<Utc>, RunnerEvent)>,
    /// Its slots-in-use gauge, sampled at its events (the last one after the run).
    pub slot_samples: Vec<i64>,
    /// Output lines (a real binary's).
    pub output: Vec<String>,
    /// Peak resident memory in KiB and the bound it must stay under (a real binary's).
    pub memory: Option<(u64, u64)>,
    /// Stopped, its last event taken: every task it started has ended.
    pub stopped: bool,
}

/// Everything a run on the wire observed.
pub struct Run<'a> {
    pub calls: &'a [CallRecord],
    pub views: &'a [TaskView],
    /// The emulator's clock when the run ended.
    pub now: DateTime<Utc>,
    pub tools: &'a [ToolsSeen],
    pub workers: &'a [WorkerSeen],
    /// Tasks the scenario's faults target the lease of on purpose.
    pub lease_loss: BTreeSet<String>,
    /// Sends of one keyed write an attempt may make (at least 1).
    pub tool_tries: u32,
}

/// The operation's name in the trace (the simulator's names; a plain engine's `extend-lock` is
/// the lease's extension as a heartbeat is).
fn op_name(op: Operation) -> &'static str {
    match op {
        Operation::FetchAndLock => "fetch-and-lock",
        Operation::Heartbeat | Operation::ExtendLock => "heartbeat",
        Operation::Complete => "complete",
        Operation::BpmnError => "bpmn-error",
        Operation::Failure => "failure",
        Operation::JournalRead => "journal-read",
        Operation::JournalAppend => "journal-append",
        Operation::ToolCredentials => "tool-credentials",
        Operation::ProcessInstanceRead => "process-instance",
        Operation::ProcessDefinitionRead => "process-definition",
        Operation::ProcessHistoryRead => "process-history",
        Operation::Unknown => "unknown",
    }
}

/// How the engine answered, in the trace's terms.
fn answer_of(c: &CallRecord) -> Answer {
    let ran = c.disposition == Disposition::Executed;
    match c.disposition {
        _ if ran && c.response_dropped => Answer::Fault("answer-lost"),
        // A journal step already there is answered 200 and adds nothing.
        Disposition::Executed if c.operation == Operation::JournalAppend && c.status == 200 => {
            Answer::Replayed
        }
        Disposition::Executed => Answer::Ok,
        Disposition::Replayed => Answer::Replayed,
        Disposition::Refused | Disposition::Injected if c.error_code.is_some() => Answer::Refused {
            status: c.status,
            code: c.error_code.clone().unwrap_or_default(),
            message: c.error_message.clone().unwrap_or_default(),
        },
        Disposition::Refused | Disposition::Injected if c.response_dropped => {
            Answer::Fault("outage")
        }
        Disposition::Refused | Disposition::Injected if c.status >= 500 => Answer::Fault("5xx"),
        Disposition::Refused | Disposition::Injected => Answer::Fault("refused-by-fault"),
    }
}

/// The run as a trace, in time order.
pub fn trace(run: &Run<'_>) -> Trace {
    let origin = run
        .calls
        .iter()
        .map(|c| c.at)
        .chain(
            run.workers
                .iter()
                .flat_map(|w| w.events.iter().map(|(at, _)| *at)),
        )
        .min()
        .unwrap_or(run.now);
    let ms = |at: DateTime<Utc>| (at - origin).num_milliseconds().max(0) as u64;
    let end = ms(run.now);
    // (time, order within the time: workers' starts, then the engine's log, then the workers'
    // events, then what the run read at its end; then the index within each source)
    let mut events: Vec<((u64, u8, usize), Event)> = Vec::new();
    for (i, w) in run.workers.iter().enumerate() {
        events.push((
            (0, 0, i),
            Event::WorkerStarted {
                worker: w.worker_id.clone(),
                slots: w.slots,
            },
        ));
    }
    // The engine's log, in the order it decided; each fetched task's attempt is its
    // acquisition's number, as the engine counts them.
    let mut acquisitions: BTreeMap<&str, u32> = BTreeMap::new();
    let mut fetched_by_key: BTreeMap<&str, Vec<(String, u32)>> = BTreeMap::new();
    let mut clock = 0u64;
    for (i, c) in run.calls.iter().enumerate() {
        clock = clock.max(ms(c.at));
        let worker = c.worker_id.clone().unwrap_or_default();
        let op = op_name(c.operation);
        let attempt = c.attempt.and_then(|a| u32::try_from(a).ok());
        let answer = answer_of(c);
        events.push((
            (clock, 1, 3 * i),
            Event::EngineCall {
                worker: worker.clone(),
                op,
                task: c.task_id.clone(),
                attempt,
            },
        ));
        let heard = answer == Answer::Ok;
        events.push((
            (clock, 1, 3 * i + 1),
            Event::EngineAnswer {
                worker: worker.clone(),
                op,
                task: c.task_id.clone(),
                attempt,
                answer,
            },
        ));
        if c.operation == Operation::FetchAndLock {
            let tasks: Vec<(String, u32)> = match c.disposition {
                Disposition::Executed => {
                    let tasks: Vec<(String, u32)> = c
                        .task_ids
                        .iter()
                        .map(|id| {
                            let n = acquisitions.entry(id.as_str()).or_default();
                            *n += 1;
                            (id.clone(), *n)
                        })
                        .collect();
                    if let Some(key) = &c.idempotency_key {
                        fetched_by_key.insert(key.as_str(), tasks.clone());
                    }
                    tasks
                }
                // A repeat of a fetch whose answer was lost hands out what that one locked.
                Disposition::Replayed => c
                    .idempotency_key
                    .as_deref()
                    .and_then(|key| fetched_by_key.get(key))
                    .cloned()
                    .unwrap_or_default(),
                Disposition::Refused | Disposition::Injected => Vec::new(),
            };
            // A fetch whose answer was lost locked its tasks to nobody who knows (yet).
            let heard = heard || c.disposition == Disposition::Replayed;
            if heard {
                events.push((
                    (clock, 1, 3 * i + 2),
                    Event::Fetched {
                        worker,
                        asked: tasks.len() as u32,
                        tasks,
                    },
                ));
            }
        }
    }
    for (i, w) in run.workers.iter().enumerate() {
        let worker = w.worker_id.clone();
        let base = i * 1_000_000;
        for (j, (at, e)) in w.events.iter().enumerate() {
            let t = ms(*at);
            let order = (t, 2, base + 2 * j);
            match e {
                RunnerEvent::Fetched { requested, got } => events.push((
                    order,
                    Event::RunnerFetched {
                        worker: worker.clone(),
                        requested: *requested,
                        got: *got,
                    },
                )),
                RunnerEvent::TaskStarted { task_id, attempt } => events.push((
                    order,
                    Event::TaskStarted {
                        worker: worker.clone(),
                        task: task_id.clone(),
                        attempt: *attempt,
                    },
                )),
                RunnerEvent::SlotFreed { task_id, attempt } => events.push((
                    order,
                    Event::SlotFreed {
                        worker: worker.clone(),
                        task: task_id.clone(),
                        attempt: *attempt,
                    },
                )),
                RunnerEvent::TaskEnded {
                    task_id,
                    attempt,
                    outcome,
                } => events.push((
                    order,
                    Event::TaskEnded {
                        worker: worker.clone(),
                        task: task_id.clone(),
                        attempt: *attempt,
                        outcome: outcome.as_str().to_string(),
                    },
                )),
                RunnerEvent::FetchFailed { .. } | RunnerEvent::Heartbeat(_) => {}
            }
            // The gauge was sampled as the event was taken.
            if let Some(in_use) = w.slot_samples.get(j) {
                events.push((
                    (t, 2, base + 2 * j + 1),
                    Event::SlotsInUse {
                        worker: worker.clone(),
                        in_use: *in_use,
                    },
                ));
            }
        }
        // Read at the end: the samples taken without an event (the last one after the run),
        // the output, the memory.
        for (k, in_use) in w.slot_samples.iter().enumerate().skip(w.events.len()) {
            events.push((
                (end, 3, base + k),
                Event::SlotsInUse {
                    worker: worker.clone(),
                    in_use: *in_use,
                },
            ));
        }
        let after_samples = base + w.slot_samples.len();
        for (k, line) in w.output.iter().enumerate() {
            events.push((
                (end, 3, after_samples + k),
                Event::Log {
                    line: format!("{worker}: {line}"),
                },
            ));
        }
        if let Some((kib, bound_kib)) = w.memory {
            events.push((
                (end, 3, base + 999_990),
                Event::PeakMemory {
                    worker: worker.clone(),
                    kib,
                    bound_kib,
                },
            ));
        }
        if w.stopped {
            events.push(((end, 3, base + 999_999), Event::WorkerStopped { worker }));
        }
    }
    // What the tool servers received, after everything else (a server does not say when): the
    // checks that read it count sends, not times.
    for (i, server) in run.tools.iter().enumerate() {
        let base = (run.workers.len() + i) * 1_000_000;
        let mut writes: BTreeMap<(String, String), u64> = BTreeMap::new();
        for (j, call) in server.calls.iter().enumerate() {
            let Some(key) = &call.idempotency_key else {
                continue;
            };
            let task = key.split(':').nth(1).unwrap_or_default().to_string();
            // A refund's logical identity is its order.
            let write = call
                .arguments
                .get("orderId")
                .and_then(|o| o.as_str())
                .map(|order| {
                    let n = writes.len() as u64;
                    *writes.entry((task.clone(), order.to_string())).or_insert(n)
                });
            events.push((
                (end, 4, base + j),
                Event::ToolCall {
                    worker: server.server.clone(),
                    task,
                    write,
                    key: Some(key.clone()),
                    answer: "received",
                },
            ));
        }
        for k in 0..server.writes_unkeyed {
            events.push((
                (end, 4, base + server.calls.len() + k as usize),
                Event::ToolCall {
                    worker: server.server.clone(),
                    task: String::new(),
                    write: None,
                    key: None,
                    answer: invariants::scenario::UNKEYED_WRITE,
                },
            ));
        }
    }
    events.sort_by_key(|(order, _)| *order);
    let mut trace = Trace::default();
    for ((t, _, _), e) in events {
        trace.push(t, e);
    }
    trace
}

/// What the checks read of a run on the wire, owned.
struct Judged {
    trace: Trace,
    scenario: Scenario,
    schedule: Schedule,
    keys: BTreeMap<String, Vec<String>>,
}

impl Judged {
    fn of(run: &Run<'_>) -> Self {
        let scenario = Scenario {
            lease_loss: run.lease_loss.clone(),
            tool_tries: run.tool_tries,
            leased_live: run
                .views
                .iter()
                .filter(|v| {
                    v.status == TaskStatus::Locked
                        && !v.hidden
                        && v.lock_expiration_time.is_some_and(|exp| exp > run.now)
                })
                .map(|v| v.id.clone())
                .collect(),
        };
        // A run on the wire has no schedule: no scripted tasks, no faults the world drew (its
        // own are the scenario's), the lock and poll interval only the checks it does not
        // judge read. Its tasks are the emulator's views, each its own script.
        let mut schedule = Schedule::generate(0, Some(1));
        schedule.tasks.clear();
        schedule.upgraded.clear();
        schedule.faults = Default::default();
        let keys = run
            .views
            .iter()
            .map(|v| (v.id.clone(), vec![v.id.clone()]))
            .collect();
        Judged {
            trace: trace(run),
            scenario,
            schedule,
            keys,
        }
    }

    fn facts<'a>(&'a self, run: &'a Run<'_>) -> Facts<'a> {
        Facts {
            trace: &self.trace,
            views: run.views,
            keys: &self.keys,
            schedule: &self.schedule,
            safety_margin: self.schedule.lock_duration / 10,
            secrets: &[],
            scenario: Some(&self.scenario),
        }
    }
}

/// Every invariant of [`invariants::check`] on the run, with what its scenario makes
/// legitimate, and how many events (or tasks) each had to judge.
pub fn check(run: &Run<'_>) -> (Vec<Violation>, BTreeMap<&'static str, usize>) {
    let judged = Judged::of(run);
    let facts = judged.facts(run);
    (invariants::check(&facts), invariants::judged(&facts))
}
