//! The project's one invariant checker: the promises checked after every seed, on the world's
//! trace and the engine's final state, and after every fault-suite scenario on a run on the
//! wire written in the same vocabulary (`crate::observed`, with its [`Scenario`]). Each check
//! is a function of [`Facts`] only, so a test can hand-play a violation (a trace written by
//! hand) and see it fire. Every message names the task and the step.
//!
//! - [`one_completion`]: at most one holder's completion (or BPMN error) accepted per task, an
//!   engine "no-op" acceptance of a stale holder's complete included, and one ending call
//!   executed per attempt;
//! - [`no_stale_append`]: no journal append accepted from an attempt other than the task's
//!   latest acquisition;
//! - [`no_stale_store_append`]: the same for the run store (a third of the seeds keep their
//!   journals there), on the store's side (no append accepted from a fence other than the run's
//!   latest claim) and on the engine's (none from a worker the engine had replaced before the
//!   append was sent);
//! - [`no_call_after_local_expiry`]: no call about an attempt (to the engine, or a claim or
//!   append to the run store) started after its worker's own clock said the lease had expired
//!   (last accepted extension sent + lock - margin);
//! - [`no_call_after_refusal`]: no call about an attempt after the engine said the lease is no
//!   longer ours, or the run store that another attempt holds the run (`fenced`): no report
//!   after loss;
//! - [`slots`]: running tasks (at work, or reporting on their slot) never above the slots, no
//!   fetch above the free slots, reports in flight on a permit (slots given back, reports not
//!   yet answered) never above the slots either;
//! - [`all_ended`]: every task ended within [`super::END_BOUND`] of the faults stopping;
//! - [`model_repaid`]: at most one model answer paid again per interruption;
//! - [`keyed_write_once`]: every logical write applied at most once by the tool server,
//!   whatever was lost, killed or retried;
//! - [`gated_call_decided`]: no keyed write of a gated shape performed unless a person approved
//!   exactly the request it waited on (its requestId, callId and, when given, callDigest)
//!   before; the approver's record of what it saw and wrote is the world's truth;
//! - [`structured_result`]: a completed task's stored result matches the output schema (every
//!   good final answer of the world's model does, so a result that does not is an off-schema,
//!   cut or text-call answer stored);
//! - [`repairs_bounded`]: the model is asked again after a rejected final answer at most as
//!   often as the definition's repair turns allow (`outputRepairTurns` for off-schema and cut
//!   answers, `answerRepairTurns` for a tool call written as text), and a script that
//!   rejected more than that ends as an incident, never completed;
//! - [`window_bound`]: no request to a model of the small context window exceeds it (its bytes
//!   at 3 a token, as the worker's estimate assumes, plus the room asked for the answer);
//! - [`keyed_results_kept`]: no request carries a keyed write's result elided (its result is
//!   the model's only record that the write was performed);
//! - [`no_secret_leaked`]: no secret the world handed out in any log line, span field or
//!   metric the workers emitted (`super::secrets`).
//!
//! - [`nothing_panicked`]: no line logged or printed, and no failure reported, says a thread
//!   panicked;
//! - [`memory_bounded`]: a worker process's peak resident memory under its bound (runs on the
//!   wire).
//!
//! The fleet's promises about its provider and its engine are in [`fleet`]: no deferral while
//! the provider answers, the provider limit's 429s bounded, no replica idle while the backlog
//! is deep. Those only a run with a [`Scenario`] can judge are in [`scenario`].

pub mod fleet;
pub mod scenario;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use super::schedule::{Schedule, Shape};
use crate::world::trace::{Answer, Event, Trace};
use abada_devkit::engine::{TaskStatus, TaskView};

/// A broken promise: which, about which task, at which step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.invariant, self.message)
    }
}

/// The names of the invariants, each the `invariant` of its violations.
pub const ONE_COMPLETION: &str = "one accepted completion per task";
pub const STALE_APPEND: &str = "no engine journal append by a stale attempt accepted";
pub const STALE_STORE_APPEND: &str = "no run-store append by a stale attempt accepted";
pub const LOCAL_EXPIRY: &str = "no engine call after the local lease expired";
pub const AFTER_LOSS: &str = "no call after the engine or the run store said the lease is lost";
pub const ENDS_AGREE: &str = "a worker's end agrees with what the engine accepted";
pub const SLOTS: &str = "running tasks, fetches and reports within the slots";
pub const ALL_ENDED: &str = "every task ends once faults stop";
pub const MODEL_REPAID: &str = "at most one model call re-paid per interruption";
pub const KEYED_WRITE_ONCE: &str = "every keyed write applied at most once";
pub const GATED_CALL_DECIDED: &str = "no gated call performed without the matching decision";
pub const NO_SECRET: &str = "no secret in any log line, span or metric";
pub const APPROVED_PERFORMED: &str =
    "an approved call is performed or an incident is raised, never dropped";
pub const NO_LOOP: &str = "the instance does not loop back to a person for an approved call";
pub const STRUCTURED_RESULT: &str =
    "a completed task's stored result matches its schema, never an off-schema or cut answer";
pub const WINDOW_BOUND: &str = "no model request exceeds its context window";
pub const KEYED_RESULTS_KEPT: &str = "a keyed write's result is never elided from a request";
pub const REPAIRS_BOUNDED: &str =
    "repair turns within the definition's bounds, an exhausted one an incident";
pub const NO_DEFERRAL_WHILE_ANSWERING: &str = "no task deferred while its provider answers";
pub const LIMIT_REFUSALS_BOUNDED: &str = "the provider limit's 429s stay bounded";
pub const NO_IDLE_REPLICA: &str = "no replica idles while the backlog is deep";
pub const FETCHING_CONTINUES: &str =
    "the worker never stops fetching for longer than its capacity lets it";

pub const UPGRADE_RESUMED: &str = "a run left by the previous release resumes, never begins again";
pub const KEYS_RESENT: &str = "keyed writes re-sent only after an interruption";
pub const HEALTHY_LEASES: &str = "no lease of a healthy task expired";
pub const NOTHING_PANICKED: &str = "nothing panicked";
pub const MEMORY_BOUNDED: &str = "memory bounded";

/// Every invariant [`check`] judges, in its order.
pub const INVARIANTS: &[&str] = &[
    ONE_COMPLETION,
    STALE_APPEND,
    STALE_STORE_APPEND,
    LOCAL_EXPIRY,
    AFTER_LOSS,
    ENDS_AGREE,
    SLOTS,
    ALL_ENDED,
    MODEL_REPAID,
    KEYED_WRITE_ONCE,
    GATED_CALL_DECIDED,
    APPROVED_PERFORMED,
    NO_LOOP,
    STRUCTURED_RESULT,
    REPAIRS_BOUNDED,
    WINDOW_BOUND,
    KEYED_RESULTS_KEPT,
    NO_SECRET,
    NO_DEFERRAL_WHILE_ANSWERING,
    LIMIT_REFUSALS_BOUNDED,
    NO_IDLE_REPLICA,
    FETCHING_CONTINUES,
    UPGRADE_RESUMED,
    KEYS_RESENT,
    HEALTHY_LEASES,
    NOTHING_PANICKED,
    MEMORY_BOUNDED,
];

/// The invariants only a run on the wire judges ([`Scenario`]): the simulator's faults hit
/// leases and tool servers at random (its "every keyed write applied at most once" and lease
/// invariants judge those), and its workers run in one process whose memory is not theirs.
pub const WIRE_ONLY: &[&str] = &[KEYS_RESENT, HEALTHY_LEASES, MEMORY_BOUNDED];

/// What the checks read.
pub struct Facts<'a> {
    pub trace: &'a Trace,
    pub views: &'a [TaskView],
    /// The simulation's task names (`k3`, its script) to the engine tasks that ran it: one, or
    /// the tasks of a visit's approval round trip.
    pub keys: &'a BTreeMap<String, Vec<String>>,
    pub schedule: &'a Schedule,
    pub safety_margin: Duration,
    /// Every secret the world handed out (`World::secrets`), with what it is.
    pub secrets: &'a [(String, String)],
    /// A run on the wire (`crate::observed`): what its scenario makes legitimate. `None` for
    /// the simulator's seeds.
    pub scenario: Option<&'a Scenario>,
}

/// What a run on the wire (the fault suite: real HTTP to the engine emulator, real processes,
/// the emulator's clock) tells the checks that its trace cannot. Its times are when the
/// emulator received each call, not when the worker sent it, and a test may move the
/// emulator's clock by hand: the checks that need a worker's own send times (the local lease
/// expiry, a lease's end by the worker's clock, a heartbeat in flight while a refusal was on its
/// way) judge such a trace by what it can show, as each says.
#[derive(Clone, Debug, Default)]
pub struct Scenario {
    /// Tasks whose lease the scenario's faults target on purpose: they may lose it.
    pub lease_loss: BTreeSet<String>,
    /// Sends of one keyed write an attempt may make: the worker's tool attempts where the
    /// scenario makes a tool server fail transiently (the answer lost, the write re-sent under
    /// its key), else 1.
    pub tool_tries: u32,
    /// Tasks the emulator still leased, live, when the run ended: no outcome yet is no breach.
    pub leased_live: BTreeSet<String>,
}

/// Every check, in order.
pub fn check(facts: &Facts<'_>) -> Vec<Violation> {
    let mut v = Vec::new();
    v.extend(one_completion(facts));
    v.extend(no_stale_append(facts));
    v.extend(no_stale_store_append(facts));
    v.extend(no_call_after_local_expiry(facts));
    v.extend(no_call_after_refusal(facts));
    v.extend(ends_agree(facts));
    v.extend(slots(facts));
    v.extend(all_ended(facts));
    v.extend(model_repaid(facts));
    v.extend(keyed_write_once(facts));
    v.extend(gated_call_decided(facts));
    v.extend(approved_performed(facts));
    v.extend(no_loop(facts));
    v.extend(structured_result(facts));
    v.extend(repairs_bounded(facts));
    v.extend(window_bound(facts));
    v.extend(keyed_results_kept(facts));
    v.extend(no_secret_leaked(facts));
    // The fleet's (`fleet`).
    v.extend(fleet::no_deferral_while_answering(facts));
    v.extend(fleet::limit_refusals_bounded(facts));
    v.extend(fleet::no_idle_replica(facts));
    v.extend(fleet::fetching_continues(facts));
    v.extend(upgrade_resumed(facts));
    // What a run on the wire shows (`scenario`), and what any run may.
    v.extend(scenario::keys_resent(facts));
    v.extend(scenario::healthy_leases(facts));
    v.extend(nothing_panicked(facts));
    v.extend(memory_bounded(facts));
    v
}

/// A run the previous release left mid-run (`world::upgrade`) paid the model's turn 0 and
/// its write: this release resumes it from its journal (the write re-sent under its key, the
/// model asked from turn 1), or ends it as an incident, never asks the model for turn 0 again
/// (a run begun again, whose writes go out under new keys).
pub fn upgrade_resumed(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for u in &facts.schedule.upgraded {
        for (t, e) in &facts.trace.events {
            if let Event::ModelCall {
                worker,
                task,
                turn: 0,
                ..
            } = e
                && *task == u.key
            {
                let id = facts
                    .keys
                    .get(task.as_str())
                    .map_or(task.clone(), |ids| ids.join(", "));
                out.push(violation(
                    UPGRADE_RESUMED,
                    format!(
                        "task {id} (script {task}): {worker} asked the model for turn 0 at {}, which the previous release had paid: the run began again instead of resuming its journal",
                        at(*t)
                    ),
                ));
                break;
            }
        }
    }
    out
}

/// Per invariant, how many events (or tasks) it had to judge: an invariant that judged
/// nothing over many seeds checks nothing.
pub fn judged(facts: &Facts<'_>) -> BTreeMap<&'static str, usize> {
    let gated = gated_scripts(facts.schedule);
    let mut n: BTreeMap<&'static str, usize> = INVARIANTS.iter().map(|i| (*i, 0)).collect();
    let mut add = |i: &'static str| *n.entry(i).or_default() += 1;
    for (_, e) in &facts.trace.events {
        match e {
            Event::EngineAnswer {
                op, answer, task, ..
            } => {
                match (*op, answer) {
                    ("complete" | "bpmn-error", Answer::Ok | Answer::Replayed) => {
                        add(ONE_COMPLETION)
                    }
                    ("journal-append", Answer::Ok | Answer::Replayed) => add(STALE_APPEND),
                    ("failure", Answer::Ok | Answer::Replayed) => add(NO_DEFERRAL_WHILE_ANSWERING),
                    _ => {}
                }
                if task.is_some() && lease_lost(answer) {
                    add(AFTER_LOSS);
                }
            }
            Event::StoreAnswer {
                op: "append",
                answer,
                ..
            } if store_accepted(answer) => add(STALE_STORE_APPEND),
            Event::StoreAnswer {
                answer: "fenced", ..
            } => add(AFTER_LOSS),
            Event::EngineCall {
                attempt: Some(_), ..
            } => add(LOCAL_EXPIRY),
            Event::StoreCall { op, .. } if *op != "finish" => add(LOCAL_EXPIRY),
            Event::TaskEnded { .. } => add(ENDS_AGREE),
            Event::RunnerFetched { .. } | Event::TaskStarted { .. } | Event::SlotFreed { .. } => {
                add(SLOTS)
            }
            Event::ModelCall { answer, .. }
                if *answer == crate::world::provider_limit::LIMIT_REFUSED =>
            {
                add(LIMIT_REFUSALS_BOUNDED)
            }
            Event::FetchBacklog {
                got: 0, waiting, ..
            } if *waiting > 0 => add(NO_IDLE_REPLICA),
            Event::FetchBacklog { .. } if facts.schedule.faults.provider_limit.is_some() => {
                add(FETCHING_CONTINUES)
            }
            Event::ModelCall { answer, .. } if paid_answer(answer) => {
                add(MODEL_REPAID);
                if rejected_final(answer).is_some() {
                    add(REPAIRS_BOUNDED);
                }
            }
            Event::ToolCall {
                write: Some(_),
                answer,
                task,
                ..
            } if answer.starts_with("applied") => {
                add(KEYED_WRITE_ONCE);
                if gated.contains(task.as_str()) {
                    add(GATED_CALL_DECIDED);
                }
            }
            Event::WindowRequest { elided, .. } => {
                add(WINDOW_BOUND);
                if *elided > 0 {
                    add(KEYED_RESULTS_KEPT);
                }
            }
            Event::Log { .. } => {
                add(NOTHING_PANICKED);
                if !facts.secrets.is_empty() {
                    add(NO_SECRET);
                }
            }
            Event::PeakMemory { .. } => add(MEMORY_BOUNDED),
            Event::SlotsInUse { .. } | Event::WorkerStopped { .. } => add(SLOTS),
            Event::ToolCall { key: Some(_), .. } if facts.scenario.is_some() => add(KEYS_RESENT),
            Event::Decision { .. } => add(NO_LOOP),
            _ => {}
        }
    }
    *n.entry(ALL_ENDED).or_default() += facts.views.len();
    *n.entry(STRUCTURED_RESULT).or_default() += facts
        .views
        .iter()
        .filter(|v| stored_result(v).is_some())
        .count();
    *n.entry(APPROVED_PERFORMED).or_default() += genuine_approvals(facts).len();
    *n.entry(UPGRADE_RESUMED).or_default() += facts.schedule.upgraded.len();
    if let Some(scenario) = facts.scenario {
        *n.entry(HEALTHY_LEASES).or_default() += facts
            .views
            .iter()
            .filter(|v| !scenario.lease_loss.contains(&v.id))
            .count();
    }
    n
}

fn at(ms: u64) -> String {
    format!("{}.{:03} s", ms / 1000, ms % 1000)
}

fn violation(invariant: &'static str, message: String) -> Violation {
    Violation { invariant, message }
}

/// Who holds each task: its latest acquisition (worker, attempt), as the trace goes.
fn holder_updates(e: &Event, holders: &mut BTreeMap<String, (String, u32)>) {
    if let Event::Fetched { worker, tasks, .. } = e {
        for (task, attempt) in tasks {
            holders.insert(task.clone(), (worker.clone(), *attempt));
        }
    }
}

/// The attempt a worker's task end is of, taken off the attempts of the task it runs
/// (`running`, in the order of their acquisitions): the one it names, or, a plain v1 engine
/// numbering none, the oldest (a worker runs one attempt of a task at a time, so its ends come
/// in the order of its acquisitions).
fn attempt_ended(
    running: &mut std::collections::VecDeque<u32>,
    attempt: Option<u32>,
) -> Option<u32> {
    match attempt {
        Some(a) => {
            running.retain(|r| *r != a);
            Some(a)
        }
        None => running.pop_front(),
    }
}

/// One accepted completion per task. A `complete` (or `bpmn-error`) the engine accepted after
/// another holder's accepted one is a stale holder reporting, unless it could not have known:
/// - it was sent before that completion was executed, and delayed in transit (the engine
///   answers it as a no-op, as the real engine 0.11 does for a completed task:
///   `ExternalTaskCommandService.complete` returns when the task is `COMPLETED`);
/// - or that completion was itself in transit when this attempt was handed out: an earlier
///   attempt's report the worker gave up at its lease's expiry, executed late by an engine
///   that fences by worker id only (plain v1). The later attempt resumes the same journal and
///   reports the same outcome, which the engine answers as a no-op.
pub fn one_completion(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = one_ending_per_attempt(facts);
    // Per task: the first accepted completion (worker, attempt, op, executed at, sent at).
    let mut done: BTreeMap<String, (String, Option<u32>, &'static str, u64, u64)> = BTreeMap::new();
    // When each (worker, op, task, attempt) call was last sent.
    let mut sent: BTreeMap<(&str, &str, &str, Option<u32>), u64> = BTreeMap::new();
    // When each (task, attempt) was handed out.
    let mut handed_out: BTreeMap<(&str, u32), u64> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        if let Event::Fetched { tasks, .. } = e {
            for (task, attempt) in tasks {
                handed_out.entry((task.as_str(), *attempt)).or_insert(*t);
            }
        }
        if let Event::EngineCall {
            worker,
            op,
            task: Some(task),
            attempt,
        } = e
        {
            sent.insert((worker, op, task, *attempt), *t);
        }
        let Event::EngineAnswer {
            worker,
            op,
            task: Some(task),
            attempt,
            answer: Answer::Ok | Answer::Replayed,
        } = e
        else {
            continue;
        };
        if !matches!(*op, "complete" | "bpmn-error") {
            continue;
        }
        let sent_at = sent
            .get(&(worker.as_str(), *op, task.as_str(), *attempt))
            .copied()
            .unwrap_or(*t);
        match done.get(task) {
            None => {
                done.insert(task.clone(), (worker.clone(), *attempt, op, *t, sent_at));
            }
            Some((w, a, first_op, first_at, first_sent)) if (w, a) != (worker, attempt) => {
                let first_in_transit_at_hand_out = attempt
                    .and_then(|n| handed_out.get(&(task.as_str(), n)))
                    .is_some_and(|handed| {
                        // Executed in the same millisecond as the hand-out counts: a task
                        // completed is never handed out, so the hand-out came first (seed
                        // 3300022212).
                        first_sent < handed
                            && first_at >= handed
                            && a.is_some_and(|f| Some(f) < *attempt)
                    });
                if sent_at >= *first_at && !first_in_transit_at_hand_out {
                    out.push(violation(
                        ONE_COMPLETION,
                        format!(
                            "task {task}: {op} by {worker} attempt {attempt:?} sent at {} and accepted at {}, after {first_op} by {w} attempt {a:?} was accepted at {}",
                            at(sent_at),
                            at(*t),
                            at(*first_at)
                        ),
                    ));
                }
            }
            Some(_) => {}
        }
    }
    out
}

/// Whether the engine ran the call this answer is of: answered, or answered and the answer
/// lost on its way back. A repeat it answered without running ([`Answer::Replayed`]) is not.
fn executed(answer: &Answer) -> bool {
    matches!(answer, Answer::Ok | Answer::Fault("answer-lost"))
}

/// One ending per attempt: a worker's ending calls (`complete`, `failure`, `bpmn-error`) of one
/// attempt of a task executed at most once. A re-send after a lost answer carries the first's
/// idempotency key and is answered as a repeat; a second one executed is a second outcome
/// sent (a `complete` of a completed task is executed as a no-op, and still sent twice).
fn one_ending_per_attempt(facts: &Facts<'_>) -> Vec<Violation> {
    // Per (worker, task, attempt): each executed ending's op and time.
    type Ending<'a> = (&'a str, u64);
    let mut endings: BTreeMap<(&str, &str, Option<u32>), Vec<Ending<'_>>> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        if let Event::EngineAnswer {
            worker,
            op,
            task: Some(task),
            attempt,
            answer,
        } = e
            && is_report(op)
            && executed(answer)
        {
            endings
                .entry((worker, task, *attempt))
                .or_default()
                .push((op, *t));
        }
    }
    endings
        .into_iter()
        .filter(|(_, ends)| ends.len() > 1)
        .map(|((worker, task, attempt), ends)| {
            let list: Vec<String> = ends
                .iter()
                .map(|(op, t)| format!("{op} at {}", at(*t)))
                .collect();
            violation(
                ONE_COMPLETION,
                format!(
                    "task {task}: {worker} attempt {attempt:?}: {} ending calls executed ({})",
                    ends.len(),
                    list.join(", ")
                ),
            )
        })
        .collect()
}

pub fn no_stale_append(facts: &Facts<'_>) -> Vec<Violation> {
    let mut holders = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        holder_updates(e, &mut holders);
        if let Event::EngineAnswer {
            worker,
            op: "journal-append",
            task: Some(task),
            attempt: Some(attempt),
            answer: Answer::Ok | Answer::Replayed,
        } = e
        {
            let latest = holders.get(task);
            if latest != Some(&(worker.clone(), *attempt)) {
                out.push(violation(
                    STALE_APPEND,
                    format!(
                        "task {task}: journal append by {worker} attempt {attempt} accepted at {} while the latest acquisition is {latest:?}",
                        at(*t)
                    ),
                ));
            }
        }
    }
    out
}

/// Whether a run-store answer says the store executed an append.
fn store_accepted(answer: &str) -> bool {
    matches!(answer, "created" | "already-present")
}

pub fn no_stale_store_append(facts: &Facts<'_>) -> Vec<Violation> {
    // The store's side: the attempt of each run's latest claim, as executed.
    let mut claimed: BTreeMap<&str, u64> = BTreeMap::new();
    // The engine's side: who acquired each task last, and when; when each worker last sent an
    // append about a task's run.
    let mut holders: BTreeMap<&str, (&str, u64)> = BTreeMap::new();
    let mut sent: BTreeMap<(&str, &str, u64), u64> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::Fetched { worker, tasks, .. } => {
                for (task, _) in tasks {
                    holders.insert(task, (worker, *t));
                }
            }
            Event::StoreCall {
                worker,
                op: "append",
                task,
                seq: Some(seq),
                ..
            } => {
                sent.insert((worker, task, *seq), *t);
            }
            Event::StoreAnswer {
                op: "claim",
                run,
                attempt: Some(attempt),
                answer: "claimed",
                ..
            } => {
                claimed.insert(run, *attempt);
            }
            Event::StoreAnswer {
                worker,
                op: "append",
                run,
                task,
                attempt: Some(attempt),
                seq: Some(seq),
                answer,
            } if store_accepted(answer) => {
                let latest = claimed.get(run.as_str()).copied();
                if latest != Some(*attempt) {
                    out.push(violation(
                        STALE_STORE_APPEND,
                        format!(
                            "task {task}: step {seq} appended to run {run} by {worker} with run attempt {attempt} accepted ({answer}) at {} while the run's latest claim is attempt {latest:?}",
                            at(*t)
                        ),
                    ));
                }
                let sent_at = sent.get(&(worker.as_str(), task.as_str(), *seq)).copied();
                if let (Some((holder, since)), Some(sent_at)) =
                    (holders.get(task.as_str()), sent_at)
                    && holder != worker
                    && sent_at > *since
                {
                    out.push(violation(
                        STALE_STORE_APPEND,
                        format!(
                            "task {task}: step {seq} appended to run {run} by {worker} (sent at {}) accepted at {}, after the engine gave the task to {holder} at {}",
                            at(sent_at),
                            at(*t),
                            at(*since)
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

pub fn no_call_after_local_expiry(facts: &Facts<'_>) -> Vec<Violation> {
    // A run on the wire stamps each call when the emulator received it, and its tests move the
    // emulator's clock by hand: the worker's own clock is not in its trace.
    if facts.scenario.is_some() {
        return Vec::new();
    }
    let lock = facts.schedule.lock_duration.as_millis() as u64;
    let margin = facts.safety_margin.as_millis() as u64;
    // The latest start of a fetch per worker (the runner takes its acquisition instant before
    // the fetch is sent), and of a heartbeat in flight per (worker, task, attempt).
    let mut fetch_started: BTreeMap<&str, u64> = BTreeMap::new();
    let mut beat_started: BTreeMap<(&str, &str, u32), u64> = BTreeMap::new();
    // The latest local expiry the worker can believe in, per (worker, task, attempt).
    let mut expiry: BTreeMap<(&str, &str, u32), u64> = BTreeMap::new();
    // Each worker's latest acquisition of each task: what its run-store calls are about (they
    // carry the run's attempt, not the engine's).
    let mut acquired: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::EngineCall {
                worker,
                op: "fetch-and-lock",
                ..
            } => {
                fetch_started.insert(worker, *t);
            }
            Event::Fetched { worker, tasks, .. } => {
                let sent = fetch_started.get(worker.as_str()).copied().unwrap_or(*t);
                for (task, attempt) in tasks {
                    expiry.insert((worker, task, *attempt), sent + lock - margin);
                    acquired.insert((worker, task), *attempt);
                }
            }
            // A finish runs after the engine accepted the task's end, fenced by the run's
            // attempt alone: no lease is left to expire.
            Event::StoreCall {
                worker, op, task, ..
            } if *op != "finish" => {
                let Some(&attempt) = acquired.get(&(worker.as_str(), task.as_str())) else {
                    continue;
                };
                if let Some(&deadline) = expiry.get(&(worker.as_str(), task.as_str(), attempt))
                    && *t > deadline
                {
                    out.push(violation(
                        LOCAL_EXPIRY,
                        format!(
                            "task {task}: run-store {op} by {worker} (acquisition {attempt}) sent at {}, after its lease expired by the worker's own clock at {}",
                            at(*t),
                            at(deadline)
                        ),
                    ));
                }
            }
            Event::EngineCall {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
            } => {
                let key = (worker.as_str(), task.as_str(), *attempt);
                if let Some(&deadline) = expiry.get(&key)
                    && *t > deadline
                {
                    out.push(violation(
                        LOCAL_EXPIRY,
                        format!(
                            "task {task}: {op} by {worker} attempt {attempt} sent at {}, after its lease expired by the worker's own clock at {}",
                            at(*t),
                            at(deadline)
                        ),
                    ));
                }
                if *op == "heartbeat" {
                    beat_started.insert(key, *t);
                }
            }
            Event::EngineAnswer {
                worker,
                op: "heartbeat",
                task: Some(task),
                attempt: Some(attempt),
                answer: Answer::Ok | Answer::Replayed,
            } => {
                let key = (worker.as_str(), task.as_str(), *attempt);
                if let Some(&sent) = beat_started.get(&key) {
                    let e = expiry.entry(key).or_default();
                    *e = (*e).max(sent + lock - margin);
                }
            }
            _ => {}
        }
    }
    out
}

/// Whether an answer says the lease of that attempt is no longer ours.
fn lease_lost(answer: &Answer) -> bool {
    match answer {
        Answer::Refused {
            status,
            code,
            message,
        } => {
            matches!(
                (*status, code.as_str()),
                (403, "WORKER_LOCK_NOT_OWNED")
                    | (
                        409,
                        "WORKER_LOCK_EXPIRED" | "STALE_ATTEMPT" | "JOURNAL_CONFLICT"
                    )
            ) || (*status == 400
                && code == "ENGINE_COMMAND_REJECTED"
                // Only these say the task is not ours (protocol.md A.2); another rejection (a
                // suspended instance, one already ended) refuses the command, and the worker
                // reports that outcome once as an incident.
                && (message.starts_with("External task is not locked")
                    || message.starts_with("External task not found")))
        }
        Answer::Fault(kind) => *kind == "refused",
        _ => false,
    }
}

pub fn no_call_after_refusal(facts: &Facts<'_>) -> Vec<Violation> {
    if facts.scenario.is_some() {
        return no_ending_after_refusal_on_the_wire(facts);
    }
    let mut lost: BTreeMap<(&str, &str, u32), (&str, u64)> = BTreeMap::new();
    // Each worker's engine attempt of each task, by its latest acquisition: a run-store fence
    // names the store's attempt, and the engine calls it stops are those of this one.
    let mut held: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    // The engine attempt each run-store fence was granted to: a refusal answered late, to a
    // call of an earlier attempt's fence, says nothing of the attempt the worker holds now.
    let mut fences: BTreeMap<(&str, &str, u64), u32> = BTreeMap::new();
    // Each worker's attempts of each task not ended yet, in the order it acquired them.
    let mut unended: BTreeMap<(&str, &str), std::collections::VecDeque<u32>> = BTreeMap::new();
    let mut out = Vec::new();
    let events = &facts.trace.events;
    for (i, (t, e)) in events.iter().enumerate() {
        match e {
            Event::Fetched { worker, tasks, .. } => {
                for (task, attempt) in tasks {
                    held.insert((worker, task), *attempt);
                    unended
                        .entry((worker, task))
                        .or_default()
                        .push_back(*attempt);
                }
            }
            Event::StoreAnswer {
                worker,
                op: "claim",
                task,
                attempt: Some(fence),
                answer: "claimed",
                ..
            } => {
                if let Some(attempt) = held.get(&(worker.as_str(), task.as_str())) {
                    fences.insert((worker, task, *fence), *attempt);
                }
            }
            Event::EngineAnswer {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
                answer,
            } if lease_lost(answer) => {
                lost.entry((worker, task, *attempt)).or_insert((op, *t));
            }
            Event::StoreAnswer {
                worker,
                op,
                task,
                attempt: fence,
                answer: "fenced",
                seq,
                ..
            } if !answer_lost_after(events, i, worker, op, task, *seq) => {
                let granted = fence.and_then(|f| fences.get(&(worker.as_str(), task.as_str(), f)));
                if let Some(attempt) =
                    granted.or_else(|| held.get(&(worker.as_str(), task.as_str())))
                {
                    let op = match *op {
                        "claim" => "run-store claim",
                        "append" => "run-store append",
                        "finish" => "run-store finish",
                        _ => "run-store call",
                    };
                    lost.entry((worker, task, *attempt)).or_insert((op, *t));
                }
            }
            // The worker's own end: it said the lease is lost, so it sends nothing after. A
            // plain engine numbers no attempt: a worker's ends come in the order of its
            // acquisitions (seed 1500002205 of a random window: the end of attempt 2 is not
            // attempt 3's, which runs on).
            Event::TaskEnded {
                worker,
                task,
                attempt,
                outcome,
            } => {
                let attempt = attempt_ended(unended.entry((worker, task)).or_default(), *attempt);
                if let Some(attempt) = attempt
                    && outcome == "lease_lost"
                {
                    lost.entry((worker, task, attempt))
                        .or_insert((OWN_LEASE_LOST_END, *t));
                }
            }
            Event::EngineCall {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
            } => {
                // At the refusal's own instant the answer is still on its way back (the world
                // answers in 1 ms). The part that made the refused call learns of it then and
                // must send nothing after; the worker's other part (the heartbeat actor, or the
                // task when the actor was refused) learns through the lease in that same
                // instant, so only a call after it is a breach.
                let learned = |refused_op: &str, refused_at: u64| {
                    let same_part = (*op == "heartbeat") == (refused_op == "heartbeat");
                    if same_part {
                        refused_at
                    } else {
                        refused_at + 1
                    }
                };
                if let Some((refused_op, refused_at)) =
                    lost.get(&(worker.as_str(), task.as_str(), *attempt))
                    && *t > learned(refused_op, *refused_at)
                {
                    let cause = if *refused_op == OWN_LEASE_LOST_END {
                        format!("its own lease_lost end at {}", at(*refused_at))
                    } else {
                        format!(
                            "{refused_op} was refused as not ours at {}",
                            at(*refused_at)
                        )
                    };
                    out.push(violation(
                        AFTER_LOSS,
                        format!(
                            "task {task}: {op} by {worker} attempt {attempt} sent at {} after {cause}",
                            at(*t),
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

/// [`no_call_after_refusal`] on a run on the wire, whose times are arrivals at the emulator:
/// a heartbeat the worker sent before it heard a refusal may arrive after it, so only an ending
/// call (`complete`, `failure`, `bpmn-error`) that ran after the refusal counts, as any call
/// after the worker's own `lease_lost` end does (it sent it after deciding). A refusal the
/// attempt's own ending caused (a heartbeat finding the task ended) is no loss, unless it is a
/// `JOURNAL_CONFLICT`: the journal refused a step unlike the one it holds, whatever became of
/// the task.
fn no_ending_after_refusal_on_the_wire(facts: &Facts<'_>) -> Vec<Violation> {
    let events = &facts.trace.events;
    let answer_of = |i: usize| match events.get(i + 1) {
        Some((_, Event::EngineAnswer { answer, .. })) => Some(answer),
        _ => None,
    };
    let mut out = Vec::new();
    for (i, (t, e)) in events.iter().enumerate() {
        match e {
            Event::TaskEnded {
                worker,
                task,
                attempt,
                outcome,
            } if outcome == "lease_lost" => {
                for (u, later) in &events[i + 1..] {
                    if let Event::EngineCall {
                        worker: w,
                        op,
                        task: Some(k),
                        attempt: a,
                    } = later
                        && w == worker
                        && k == task
                        && *a == *attempt
                        && *u > *t
                    {
                        out.push(violation(
                            AFTER_LOSS,
                            format!(
                                "{worker}: {op} about task {task} attempt {attempt:?} after its lease was lost (its own lease_lost end at {})",
                                at(*t)
                            ),
                        ));
                    }
                }
            }
            Event::EngineAnswer {
                worker,
                op: refused_op,
                task: Some(task),
                attempt,
                answer,
            } if lease_lost(answer) => {
                let own_ending_first = !matches!(answer, Answer::Refused { code, .. } if code == "JOURNAL_CONFLICT")
                    && events[..i].iter().any(|(_, before)| {
                        matches!(before, Event::EngineAnswer { op, task: Some(k), attempt: a, answer, .. }
                            if is_report(op) && k == task && a == attempt && executed(answer))
                    });
                if own_ending_first {
                    continue;
                }
                let code = match answer {
                    Answer::Refused { code, .. } => code.as_str(),
                    _ => "refused",
                };
                for (j, (u, later)) in events.iter().enumerate().skip(i + 1) {
                    if let Event::EngineCall {
                        worker: w,
                        op,
                        task: Some(k),
                        attempt: a,
                    } = later
                        && is_report(op)
                        && w == worker
                        && k == task
                        && a == attempt
                        && *u > *t
                        && answer_of(j) != Some(&Answer::Replayed)
                    {
                        out.push(violation(
                            AFTER_LOSS,
                            format!(
                                "{op} about task {task} by {worker} attempt {attempt:?} at {} after {refused_op} was refused {code} at {}",
                                at(*u),
                                at(*t)
                            ),
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The cause [`no_call_after_refusal`] records for a worker's own `lease_lost` end.
const OWN_LEASE_LOST_END: &str = "its own lease_lost end";

/// Whether the store answer at `i` never reached its worker: the store records what it
/// executed, then `answer-lost` for the same call when the connection drops on the way back
/// (nothing runs between the two), so the worker heard a transient error, not the fence.
fn answer_lost_after(
    events: &[(u64, Event)],
    i: usize,
    worker: &str,
    op: &str,
    task: &str,
    seq: Option<u64>,
) -> bool {
    matches!(
        events.get(i + 1),
        Some((_, Event::StoreAnswer { worker: w, op: o, task: k, seq: s, answer: "answer-lost", .. }))
            if w == worker && *o == op && k == task && *s == seq
    )
}

/// The ops that report a task's end.
fn is_report(op: &str) -> bool {
    matches!(op, "complete" | "failure" | "bpmn-error")
}

/// One attempt of one worker: (worker, task, attempt).
type AttemptKey<'a> = (&'a str, &'a str, u32);

pub fn ends_agree(facts: &Facts<'_>) -> Vec<Violation> {
    let lock = facts.schedule.lock_duration.as_millis() as u64;
    let margin = facts.safety_margin.as_millis() as u64;
    // When each late answer reached its worker (`u64::MAX`: never), by (worker, op, task,
    // attempt, executed at).
    let mut delivered: BTreeMap<(&str, &str, &str, u32, u64), u64> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::Late {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
            } => {
                delivered
                    .entry((worker, op, task, *attempt, *t))
                    .or_insert(u64::MAX);
            }
            Event::Delivered {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
                executed,
            } => {
                delivered.insert((worker, op, task, *attempt, *executed), *t);
            }
            _ => {}
        }
    }
    let mut fetch_started: BTreeMap<&str, u64> = BTreeMap::new();
    let mut beat_sent: BTreeMap<AttemptKey<'_>, u64> = BTreeMap::new();
    // Per attempt: its expiry at acquisition, and each extension as (reached the worker at,
    // new expiry), in the order they reached it.
    let mut expiries: BTreeMap<AttemptKey<'_>, (u64, Vec<(u64, u64)>)> = BTreeMap::new();
    let mut accepted: BTreeMap<AttemptKey<'_>, (&str, u64)> = BTreeMap::new();
    let mut lost: BTreeMap<AttemptKey<'_>, u64> = BTreeMap::new();
    let mut held: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    let mut unended: BTreeMap<(&str, &str), std::collections::VecDeque<u32>> = BTreeMap::new();
    // Per attempt: when the heartbeats stopped, at the latest. The worker stops extending when
    // its work ends (after the attempt's last answer about its work, a journal append's or a
    // credential's), before its report goes out; an extension answered in that same millisecond
    // or later may reach the heartbeat actor after the release and is then not applied.
    let mut reporting: BTreeMap<AttemptKey<'_>, u64> = BTreeMap::new();
    let mut work_answered: BTreeMap<AttemptKey<'_>, u64> = BTreeMap::new();
    let mut out = Vec::new();
    let events = &facts.trace.events;
    for (i, (t, e)) in events.iter().enumerate() {
        match e {
            Event::EngineCall {
                worker,
                op: "fetch-and-lock",
                ..
            } => {
                fetch_started.insert(worker, *t);
            }
            Event::Fetched { worker, tasks, .. } => {
                let sent = fetch_started.get(worker.as_str()).copied().unwrap_or(*t);
                for (task, attempt) in tasks {
                    expiries.insert((worker, task, *attempt), (sent + lock - margin, Vec::new()));
                    held.insert((worker, task), *attempt);
                    unended
                        .entry((worker, task))
                        .or_default()
                        .push_back(*attempt);
                }
            }
            Event::EngineCall {
                worker,
                op: "heartbeat",
                task: Some(task),
                attempt: Some(attempt),
            } => {
                beat_sent.insert((worker, task, *attempt), *t);
            }
            Event::EngineCall {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
            } if is_report(op) => {
                // The heartbeats stopped by the time the report goes out, and no earlier than
                // the work's last answer (see `work_answered`).
                let key = (worker.as_str(), task.as_str(), *attempt);
                let stopped = work_answered.get(&key).map_or(*t, |w| (*w).min(*t));
                reporting.entry(key).or_insert(stopped);
            }
            Event::EngineAnswer {
                worker,
                op,
                task: Some(task),
                attempt: Some(attempt),
                answer,
            } => {
                let key = (worker.as_str(), task.as_str(), *attempt);
                let reached = delivered
                    .get(&(worker.as_str(), *op, task.as_str(), *attempt, *t))
                    .copied()
                    .unwrap_or(*t + 1);
                if *op != "heartbeat" && !is_report(op) {
                    work_answered.insert(key, reached);
                }
                match answer {
                    Answer::Ok | Answer::Replayed if *op == "heartbeat" => {
                        if let (Some(sent), Some((_, ext))) =
                            (beat_sent.get(&key), expiries.get_mut(&key))
                        {
                            ext.push((reached, sent + lock - margin));
                        }
                    }
                    Answer::Ok | Answer::Replayed if is_report(op) => {
                        accepted.entry(key).or_insert((op, *t));
                    }
                    a if lease_lost(a) => {
                        lost.entry(key).or_insert(*t);
                    }
                    _ => {}
                }
            }
            Event::StoreAnswer {
                worker,
                op,
                task,
                seq,
                answer,
                ..
            } => {
                if let Some(attempt) = held.get(&(worker.as_str(), task.as_str())) {
                    if *answer == "fenced" && !answer_lost_after(events, i, worker, op, task, *seq)
                    {
                        lost.entry((worker, task, *attempt)).or_insert(*t);
                    }
                    work_answered.insert((worker, task, *attempt), *t);
                }
            }
            Event::TaskEnded {
                worker,
                task,
                attempt,
                outcome,
            } => {
                // A plain v1 engine sends no attempt: the trace counts its acquisitions.
                let Some(attempt) =
                    attempt_ended(unended.entry((worker, task)).or_default(), *attempt)
                else {
                    continue;
                };
                let attempt = &attempt;
                let key = (worker.as_str(), task.as_str(), *attempt);
                let report = accepted.get(&key).copied();
                if outcome != "lease_lost" && outcome != "report_failed" {
                    if report.is_none() {
                        out.push(violation(
                            ENDS_AGREE,
                            format!(
                                "task {task}: {worker} attempt {attempt} ended {outcome} at {}, but the engine accepted no report of it",
                                at(*t)
                            ),
                        ));
                    }
                    continue;
                }
                let Some((op, accepted_at)) = report else {
                    continue;
                };
                if outcome != "lease_lost" || lost.get(&key).is_some_and(|l| *l <= *t) {
                    continue;
                }
                // The expiry the worker's own clock kept at the end: its extensions that reached
                // it in time, in order. A run on the wire does not show the worker's clock (its
                // tests move the emulator's by hand): a report accepted there, and nothing
                // refused, leaves no lease to lose.
                let Some((mut expiry, extensions)) = expiries.get(&key).cloned() else {
                    continue;
                };
                if facts.scenario.is_some() {
                    expiry = u64::MAX;
                }
                let released = reporting.get(&key).copied().unwrap_or(u64::MAX);
                for (reached, until) in extensions {
                    if reached <= *t && reached <= expiry && reached < released {
                        expiry = expiry.max(until);
                    }
                }
                // A millisecond of slack: the trace's times are whole milliseconds.
                if expiry == u64::MAX {
                    out.push(violation(
                        ENDS_AGREE,
                        format!(
                            "task {task}: {worker} attempt {attempt} ended lease_lost at {}, though the engine accepted its {op} at {} and nothing said the lease was lost",
                            at(*t),
                            at(accepted_at)
                        ),
                    ));
                } else if *t + 1 < expiry {
                    out.push(violation(
                        ENDS_AGREE,
                        format!(
                            "task {task}: {worker} attempt {attempt} ended lease_lost at {}, though the engine accepted its {op} at {} and its lease ran until {} by its own clock, and nothing said it was lost",
                            at(*t),
                            at(accepted_at),
                            at(expiry)
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

pub fn slots(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = slots_gauge(facts);
    let mut slots_of: BTreeMap<&str, u32> = BTreeMap::new();
    // At work: started, slot not given back yet. Reporting: slot given back, not ended yet.
    let mut running: BTreeMap<&str, BTreeSet<(&str, Option<u32>)>> = BTreeMap::new();
    let mut reporting: BTreeMap<&str, BTreeSet<(&str, Option<u32>)>> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::WorkerStarted { worker, slots } => {
                slots_of.insert(worker, *slots);
            }
            Event::RunnerFetched {
                worker, requested, ..
            } => {
                let slots = slots_of.get(worker.as_str()).copied().unwrap_or(0);
                let busy = running.get(worker.as_str()).map_or(0, BTreeSet::len) as u32;
                if *requested + busy > slots {
                    out.push(violation(
                        SLOTS,
                        format!(
                            "no fetch above the free slots: worker {worker} asked for {requested} tasks at {} with {busy} of {slots} slots busy",
                            at(*t)
                        ),
                    ));
                }
            }
            Event::TaskStarted {
                worker,
                task,
                attempt,
            } => {
                let set = running.entry(worker).or_default();
                set.insert((task, *attempt));
                let slots = slots_of.get(worker.as_str()).copied().unwrap_or(0);
                if set.len() as u32 > slots {
                    out.push(violation(
                        SLOTS,
                        format!(
                            "running tasks above the slots: task {task} started by {worker} at {} with {} tasks running on {slots} slots",
                            at(*t),
                            set.len()
                        ),
                    ));
                }
            }
            Event::SlotFreed {
                worker,
                task,
                attempt,
            } => {
                if let Some(set) = running.get_mut(worker.as_str()) {
                    set.remove(&(task.as_str(), *attempt));
                }
                let set = reporting.entry(worker).or_default();
                set.insert((task, *attempt));
                let slots = slots_of.get(worker.as_str()).copied().unwrap_or(0);
                if set.len() as u32 > slots {
                    out.push(violation(
                        SLOTS,
                        format!(
                            "reports in flight above the slots: task {task}: {worker} gave its slot back at {} with {} reports in flight on {slots} slots",
                            at(*t),
                            set.len()
                        ),
                    ));
                }
            }
            Event::TaskEnded {
                worker,
                task,
                attempt,
                ..
            } => {
                // A task that found every report permit taken reported on its slot.
                let key = (task.as_str(), *attempt);
                if let Some(set) = running.get_mut(worker.as_str()) {
                    set.remove(&key);
                }
                if let Some(set) = reporting.get_mut(worker.as_str()) {
                    set.remove(&key);
                }
            }
            _ => {}
        }
    }
    out
}

/// The slots as a worker's metrics show them, and its tasks once it stopped: every sample of
/// its slots-in-use gauge within `0..=slots`, the last one taken after it stopped at 0, and
/// every task it started ended by then.
fn slots_gauge(facts: &Facts<'_>) -> Vec<Violation> {
    let mut slots_of: BTreeMap<&str, u32> = BTreeMap::new();
    let mut last_sample: BTreeMap<&str, i64> = BTreeMap::new();
    let mut started: BTreeMap<&str, usize> = BTreeMap::new();
    let mut ended: BTreeMap<&str, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::WorkerStarted { worker, slots } => {
                slots_of.insert(worker, *slots);
            }
            Event::TaskStarted { worker, .. } => *started.entry(worker).or_default() += 1,
            Event::TaskEnded { worker, .. } => *ended.entry(worker).or_default() += 1,
            Event::SlotsInUse { worker, in_use } => {
                let slots = slots_of.get(worker.as_str()).copied().unwrap_or(0);
                if *in_use < 0 || *in_use > i64::from(slots) {
                    out.push(violation(
                        SLOTS,
                        format!(
                            "{worker}: slots in use {in_use} outside 0..={slots} at {}",
                            at(*t)
                        ),
                    ));
                }
                last_sample.insert(worker, *in_use);
            }
            Event::WorkerStopped { worker } => {
                let w = worker.as_str();
                if let Some(n) = last_sample.get(w).filter(|n| **n != 0) {
                    out.push(violation(
                        SLOTS,
                        format!("{worker}: {n} slots still in use after it stopped"),
                    ));
                }
                let (s, e) = (
                    started.get(w).copied().unwrap_or(0),
                    ended.get(w).copied().unwrap_or(0),
                );
                if s != e {
                    out.push(violation(
                        SLOTS,
                        format!("{worker}: {s} tasks started, {e} ended when it stopped"),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

pub fn all_ended(facts: &Facts<'_>) -> Vec<Violation> {
    if let Some(scenario) = facts.scenario {
        return ended_or_leased(facts, scenario);
    }
    facts
        .views
        .iter()
        .filter(|v| !super::ended(v))
        .map(|v| {
            violation(
                ALL_ENDED,
                format!(
                    "task {}: still {:?} (attempt {}, {} journal steps) {} s after the faults stopped at {}",
                    v.id,
                    v.status,
                    v.attempt,
                    v.journal.len(),
                    super::END_BOUND.as_secs(),
                    at(facts.schedule.faults.quiet_at)
                ),
            )
        })
        .collect()
}

/// [`all_ended`] on a run on the wire, which stops when its scenario is done, faults or not:
/// every task ended, or back at the engine after a report (deferred, failed with retries left,
/// released), hidden by a failure's `retryTimeout`, never fetched, or still leased, live.
fn ended_or_leased(facts: &Facts<'_>, scenario: &Scenario) -> Vec<Violation> {
    let reported = |id: &str| {
        facts.trace.events.iter().any(|(_, e)| {
            matches!(e, Event::EngineAnswer { op, task: Some(k), answer, .. }
                if is_report(op) && k == id && executed(answer))
        })
    };
    facts
        .views
        .iter()
        .filter(|v| {
            let fine = match v.status {
                TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError => true,
                TaskStatus::Open => v.attempt == 0 || reported(&v.id),
                TaskStatus::Locked => v.hidden || scenario.leased_live.contains(&v.id),
            };
            !fine
        })
        .map(|v| {
            violation(
                ALL_ENDED,
                format!(
                    "task {} is {:?} (attempt {}, lease until {:?}) without an outcome",
                    v.id, v.status, v.attempt, v.lock_expiration_time
                ),
            )
        })
        .collect()
}

/// Nothing panicked: no line the workers logged or printed says a thread panicked, and no
/// task's failure reported to the engine does (the runner turns a handler's panic into a
/// failure that says so).
pub fn nothing_panicked(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for v in facts.views {
        for text in [&v.error_message, &v.error_details].into_iter().flatten() {
            if text.contains("panicked") {
                out.push(violation(
                    NOTHING_PANICKED,
                    format!("task {}: {text}", v.id),
                ));
            }
        }
    }
    for (t, e) in &facts.trace.events {
        if let Event::Log { line } = e
            && line.contains("panicked")
        {
            out.push(violation(
                NOTHING_PANICKED,
                format!("at {}: {line}", at(*t)),
            ));
        }
    }
    out
}

/// Memory bounded: a worker process's peak resident memory under its bound.
pub fn memory_bounded(facts: &Facts<'_>) -> Vec<Violation> {
    facts
        .trace
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::PeakMemory {
                worker,
                kib,
                bound_kib,
            } if kib > bound_kib => Some(violation(
                MEMORY_BOUNDED,
                format!("{worker}: peak resident memory {kib} KiB over the bound {bound_kib} KiB"),
            )),
            _ => None,
        })
        .collect()
}

pub fn model_repaid(facts: &Facts<'_>) -> Vec<Violation> {
    let mut paid: BTreeMap<&str, BTreeMap<usize, u32>> = BTreeMap::new();
    let mut acquisitions: BTreeMap<&str, u32> = BTreeMap::new();
    // Tasks whose run another task's claim took over (a second token at the node, its holder
    // silent past the hold): their conversation begins again, paid again, as documented.
    // Seen by the holder's next store call answered `fenced`, or, when the holder made none
    // (its lease ran out first), by the other task's claim of the run it held.
    let mut taken_over: BTreeSet<&str> = BTreeSet::new();
    // Each run's holder: the task whose claim took it last, until the run is finished.
    let mut holders: BTreeMap<&str, &str> = BTreeMap::new();
    for (_, e) in &facts.trace.events {
        match e {
            Event::StoreAnswer {
                task,
                answer: "fenced",
                op,
                ..
            } if *op != "finish" => {
                taken_over.insert(task);
            }
            Event::StoreAnswer {
                task,
                run,
                op: "claim",
                answer: "claimed",
                ..
            } => {
                if let Some(holder) = holders.insert(run, task)
                    && holder != task.as_str()
                {
                    taken_over.insert(holder);
                }
            }
            Event::StoreAnswer {
                run,
                op: "finish",
                answer: "finished",
                ..
            } => {
                holders.remove(run.as_str());
            }
            Event::ModelCall {
                task, turn, answer, ..
            } if paid_answer(answer) => {
                *paid.entry(task).or_default().entry(*turn).or_default() += 1;
            }
            Event::Fetched { tasks, .. } => {
                for (task, _) in tasks {
                    *acquisitions.entry(task).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (key, turns) in paid {
        let Some(ids) = facts.keys.get(key) else {
            continue;
        };
        if ids.iter().any(|id| taken_over.contains(id.as_str())) {
            continue;
        }
        // A task of a round trip that resumes the conversation is no interruption; each
        // acquisition of a task past its first is.
        let interruptions: u32 = ids
            .iter()
            .map(|id| {
                acquisitions
                    .get(id.as_str())
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(1)
            })
            .sum();
        let id = ids.join(", ");
        let repaid: u32 = turns.values().map(|n| n.saturating_sub(1)).sum();
        if repaid > interruptions {
            let worst = turns.iter().max_by_key(|(_, n)| **n).map(|(t, _)| *t);
            out.push(violation(
                MODEL_REPAID,
                format!(
                    "task {id}: {repaid} model answers paid again (most at turn {worst:?}) over {interruptions} interruptions"
                ),
            ));
        }
    }
    out
}

/// A model answer that was paid for (not an injected fault).
fn paid_answer(answer: &str) -> bool {
    matches!(answer, "tool" | "final") || rejected_final(answer).is_some()
}

/// Which repair bound a final answer the world's model played off its good one counts
/// against: `true` the output's (`outputRepairTurns`), `false` the answer shape's
/// (`answerRepairTurns`); `None`: not such an answer.
fn rejected_final(answer: &str) -> Option<bool> {
    use crate::world::model::{CUT, OFF_SCHEMA, TEXT_CALL};
    match answer {
        OFF_SCHEMA | CUT => Some(true),
        TEXT_CALL => Some(false),
        _ => None,
    }
}

/// The result a completed task stored in the simulated agents' result variable.
fn stored_result(view: &TaskView) -> Option<&Value> {
    if view.status != TaskStatus::Completed {
        return None;
    }
    view.result_variables.as_ref()?.get("simResult")
}

pub fn structured_result(facts: &Facts<'_>) -> Vec<Violation> {
    facts
        .views
        .iter()
        .filter_map(|v| Some((v, stored_result(v)?)))
        .filter(|(_, result)| !crate::world::process::matches_output_schema(result))
        .map(|(v, result)| {
            let shown: String = result.to_string().chars().take(200).collect();
            violation(
                STRUCTURED_RESULT,
                format!(
                    "task {}: completed (attempt {}) with a result that does not match the output schema: {shown}",
                    v.id, v.attempt
                ),
            )
        })
        .collect()
}

pub fn repairs_bounded(facts: &Facts<'_>) -> Vec<Violation> {
    use crate::world::process::SCHEMA_REPAIR_TURNS;
    // Per script, the distinct turns the model answered off its good answer, per bound.
    let mut rejected: BTreeMap<&str, [BTreeSet<usize>; 2]> = BTreeMap::new();
    let mut acquisitions: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, e) in &facts.trace.events {
        match e {
            Event::ModelCall {
                task, turn, answer, ..
            } => {
                if let Some(output) = rejected_final(answer) {
                    rejected.entry(task).or_default()[usize::from(output)].insert(*turn);
                }
            }
            Event::Fetched { tasks, .. } => {
                for (task, _) in tasks {
                    *acquisitions.entry(task).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for t in &facts.schedule.tasks {
        if t.finals.is_empty() {
            continue;
        }
        let output_turns = if t.schema {
            SCHEMA_REPAIR_TURNS
        } else {
            abada_agent_worker::devkit::sim_view::agent::DEFAULT_OUTPUT_REPAIR_TURNS
        };
        let bounds = [
            (
                "answerRepairTurns",
                abada_agent_worker::devkit::sim_view::agent::DEFAULT_ANSWER_REPAIR_TURNS,
            ),
            ("outputRepairTurns", output_turns),
        ];
        let played = rejected.get(t.key.as_str());
        let engine_tasks = facts.keys.get(&t.key).cloned().unwrap_or_default();
        let ids = engine_tasks.join(", ");
        // An attempt that finds the run exhausted and its incident unreported (the report
        // lost, the lease run out) resumes as a retry of the incident does: one more repair
        // turn (`agent::output::Verdict::Exhausted`). Each acquisition past the first allows
        // one.
        let interruptions: usize = engine_tasks
            .iter()
            .map(|id| {
                acquisitions
                    .get(id.as_str())
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(1)
            })
            .sum();
        let mut exhausted = false;
        for (output, (name, allowed)) in bounds.into_iter().enumerate() {
            let scripted = t
                .finals
                .chars()
                .filter(|c| (*c != 't') == (output == 1))
                .count();
            exhausted |= scripted > allowed as usize;
            let asked = played.map_or(0, |p| p[output].len());
            if asked > allowed as usize + 1 + interruptions {
                out.push(violation(
                    REPAIRS_BOUNDED,
                    format!(
                        "task {} ({ids}): the model answered {asked} rejected final answers counted by {name}, which allows {allowed} repair turns ({interruptions} interruptions)",
                        t.key
                    ),
                ));
            }
        }
        // Completed with an answer: not asking for a person (an agents file that added approval
        // across a restart makes a write wait before any final answer was played).
        let completed = facts.views.iter().any(|v| {
            facts.keys.get(&t.key).is_some_and(|k| k.contains(&v.id))
                && v.status == TaskStatus::Completed
                && v.result_variables
                    .as_ref()
                    .and_then(|r| r.get("agentStatus"))
                    .and_then(Value::as_str)
                    != Some(abada_agent_worker::devkit::sim_view::agent::STATUS_APPROVAL_REQUIRED)
        });
        if exhausted && completed && interruptions == 0 {
            out.push(violation(
                REPAIRS_BOUNDED,
                format!(
                    "task {} ({ids}): completed although its model's rejected answers ({}) exhaust its repair turns: an incident was due",
                    t.key, t.finals
                ),
            ));
        }
    }
    out
}

pub fn window_bound(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        if let Event::WindowRequest {
            worker,
            task,
            turn,
            tokens,
            window,
            ..
        } = e
            && tokens > window
        {
            out.push(violation(
                WINDOW_BOUND,
                format!(
                    "task {task}: {worker}'s request for turn {turn} at {} holds {tokens} tokens with the room for its answer, over the model's context window of {window}",
                    at(*t)
                ),
            ));
        }
    }
    out
}

pub fn keyed_results_kept(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        if let Event::WindowRequest {
            worker,
            task,
            turn,
            elided_writes,
            ..
        } = e
            && *elided_writes > 0
        {
            out.push(violation(
                KEYED_RESULTS_KEPT,
                format!(
                    "task {task}: {worker}'s request for turn {turn} at {} carries {elided_writes} keyed write results elided",
                    at(*t)
                ),
            ));
        }
    }
    out
}

/// One application of a write: when, by which worker, with which key.
type Application<'a> = (u64, &'a str, Option<&'a str>);

pub fn keyed_write_once(facts: &Facts<'_>) -> Vec<Violation> {
    let mut applied: BTreeMap<(&str, u64), Vec<Application<'_>>> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        if let Event::ToolCall {
            worker,
            task,
            write: Some(n),
            key,
            answer,
        } = e
            && answer.starts_with("applied")
        {
            applied
                .entry((task, *n))
                .or_default()
                .push((*t, worker, key.as_deref()));
        }
    }
    let mut out = Vec::new();
    for ((key, n), times) in applied {
        if times.len() < 2 {
            continue;
        }
        let id = facts
            .keys
            .get(key)
            .map_or(key.to_string(), |ids| ids.join(", "));
        let shown: Vec<String> = times
            .iter()
            .map(|(t, w, k)| format!("{} by {w} with key {k:?}", at(*t)))
            .collect();
        out.push(violation(
            KEYED_WRITE_ONCE,
            format!(
                "task {id}: write {n} applied {} times: {}",
                times.len(),
                shown.join(", ")
            ),
        ));
    }
    out
}

/// The scripts whose keyed writes wait for a person's decision: those of every gated shape
/// (its revisits and its twin included).
fn gated_scripts(schedule: &Schedule) -> BTreeSet<String> {
    let mut gated = BTreeSet::new();
    for t in &schedule.tasks {
        match &t.shape {
            Shape::Task => {}
            Shape::Approval { revisits, .. } => {
                gated.insert(t.key.clone());
                for i in 0..revisits.len() {
                    gated.insert(format!("{}v{}", t.key, i + 2));
                }
            }
            Shape::Parallel { .. } => {
                gated.insert(t.key.clone());
                gated.insert(format!("{}t", t.key));
            }
        }
    }
    gated
}

/// Whether `written` approves exactly the request the worker put: its requestId, its callId,
/// and its callDigest when the decision carries one.
fn genuine_approval(
    written: &Value,
    request_id: Option<&str>,
    call_id: Option<&str>,
    digest: Option<&str>,
) -> bool {
    let field = |name: &str| written.get(name).and_then(Value::as_str);
    written.get("approved") == Some(&Value::Bool(true))
        && request_id.is_some()
        && field("requestId") == request_id
        && call_id.is_some()
        && field("callId") == call_id
        && match written.get("callDigest") {
            None | Some(Value::Null) => true,
            Some(d) => d.as_str().is_some() && d.as_str() == digest,
        }
}

pub fn gated_call_decided(facts: &Facts<'_>) -> Vec<Violation> {
    let gated = gated_scripts(facts.schedule);
    let mut approved: BTreeSet<(&str, u64)> = BTreeSet::new();
    let mut decisions: BTreeMap<(&str, u64), Vec<String>> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::Decision {
                task,
                write: Some(n),
                request_id,
                call_id,
                call_digest,
                written,
                manner,
                ..
            } => {
                let genuine = written.as_ref().is_some_and(|d| {
                    genuine_approval(
                        d,
                        request_id.as_deref(),
                        call_id.as_deref(),
                        call_digest.as_deref(),
                    )
                });
                decisions
                    .entry((task.as_str(), *n))
                    .or_default()
                    .push(format!("{manner} at {}", at(*t)));
                if genuine {
                    approved.insert((task.as_str(), *n));
                }
            }
            Event::ToolCall {
                worker,
                task,
                write: Some(n),
                answer,
                ..
            } if answer.starts_with("applied")
                && gated.contains(task.as_str())
                && !approved.contains(&(task.as_str(), *n)) =>
            {
                let id = facts
                    .keys
                    .get(task.as_str())
                    .map_or(task.clone(), |ids| ids.join(", "));
                let decided = decisions
                    .get(&(task.as_str(), *n))
                    .map_or("none".to_string(), |d| d.join(", "));
                out.push(violation(
                    GATED_CALL_DECIDED,
                    format!(
                        "task {id} (script {task}): write {n}, the call of turn {n}, performed at {} by {worker} without an approval of the request it waited on (decisions on it: {decided})",
                        at(*t)
                    ),
                ));
            }
            _ => {}
        }
    }
    out
}

/// The genuine approvals of the trace, in order: (when, script, write, the person).
fn genuine_approvals<'a>(facts: &'a Facts<'_>) -> Vec<(u64, &'a str, u64)> {
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        if let Event::Decision {
            task,
            write: Some(n),
            request_id,
            call_id,
            call_digest,
            written: Some(written),
            ..
        } = e
            && genuine_approval(
                written,
                request_id.as_deref(),
                call_id.as_deref(),
                call_digest.as_deref(),
            )
        {
            out.push((*t, task.as_str(), *n));
        }
    }
    out
}

pub fn approved_performed(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for (approved_at, script, n) in genuine_approvals(facts) {
        let ids = facts.keys.get(script).cloned().unwrap_or_default();
        // Judged once the script's tasks have all ended (one still open is another breach).
        let ended = ids.iter().all(|id| {
            facts
                .views
                .iter()
                .find(|v| &v.id == id)
                .is_none_or(super::ended)
        });
        if !ended {
            continue;
        }
        let performed = facts.trace.events.iter().any(|(t, e)| {
            *t >= approved_at
                && matches!(e, Event::ToolCall { task, write: Some(w), answer, .. }
                    if task == script && *w == n
                        && (answer.starts_with("applied") || *answer == "deduplicated"))
        });
        let incident = facts.trace.events.iter().any(|(t, e)| {
            *t >= approved_at
                && matches!(e, Event::TaskEnded { task, outcome, .. }
                    if outcome == "incident" && ids.contains(task))
        }) || engine_incident_since(facts, &ids, approved_at);
        if !performed && !incident {
            out.push(violation(
                APPROVED_PERFORMED,
                format!(
                    "task {} (script {script}): write {n}, approved by a person at {}, was never performed, and no incident says so",
                    ids.join(", "),
                    at(approved_at)
                ),
            ));
        }
    }
    out
}

/// Whether the engine holds an incident raised on one of `ids` by a failure sent at or after
/// `since`: the worker's own end may say `report_failed` when the failure's answer was lost on
/// its way back, though the engine executed it (seed 4000001651 of a random window).
fn engine_incident_since(facts: &Facts<'_>, ids: &[String], since: u64) -> bool {
    let failed = |id: &String| {
        facts
            .views
            .iter()
            .any(|v| &v.id == id && v.status == TaskStatus::Failed)
    };
    facts.trace.events.iter().any(|(t, e)| {
        *t >= since
            && matches!(e, Event::EngineCall { op: "failure", task: Some(task), .. }
                if ids.contains(task) && failed(task))
    })
}

pub fn no_loop(facts: &Facts<'_>) -> Vec<Violation> {
    let approvals = genuine_approvals(facts);
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        let Event::Decision {
            task,
            write: Some(n),
            instance,
            manner,
            ..
        } = e
        else {
            continue;
        };
        if let Some((approved_at, _, _)) = approvals
            .iter()
            .find(|(a, script, w)| *a < *t && *script == task.as_str() && *w == *n)
        {
            out.push(violation(
                NO_LOOP,
                format!(
                    "instance {instance} (script {task}): write {n} was approved at {} and the instance came back to the person for it at {} ({manner})",
                    at(*approved_at),
                    at(*t)
                ),
            ));
        }
    }
    out
}

pub fn no_secret_leaked(facts: &Facts<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        let Event::Log { line } = e else {
            continue;
        };
        for (secret, what) in facts.secrets {
            if secret.is_empty() || !line.contains(secret.as_str()) {
                continue;
            }
            // The message names the secret and shows the line with it masked: a report of
            // a leak is no second leak.
            out.push(violation(
                NO_SECRET,
                format!(
                    "{what}: in what the workers emitted at {}: {}",
                    at(*t),
                    line.replace(secret.as_str(), "[SECRET]")
                ),
            ));
        }
    }
    out
}
