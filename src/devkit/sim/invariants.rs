//! The promises checked after every seed, on the world's trace and the engine's final state.
//! Each check is a function of [`Facts`] only, so a test can hand-play a violation (a trace
//! written by hand) and see it fire. Every message names the task and the step.
//!
//! - [`one_completion`]: at most one holder's completion (or BPMN error) accepted per task, an
//!   engine "no-op" acceptance of a stale holder's complete included;
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
//! - [`no_secret_leaked`]: no secret the world handed out in any log line, span field or
//!   metric the workers emitted (`super::secrets`).
//!
//! The fleet's promises about its provider and its engine are in [`fleet`]: no deferral while
//! the provider answers, the provider limit's 429s bounded, no replica idle while the backlog
//! is deep.

pub mod fleet;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use super::schedule::{Schedule, Shape};
use crate::devkit::engine::TaskView;
use crate::devkit::world::trace::{Answer, Event, Trace};

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
}

/// Every check, in order.
pub fn check(facts: &Facts<'_>) -> Vec<Violation> {
    let mut v = Vec::new();
    v.extend(one_completion(facts));
    v.extend(no_stale_append(facts));
    v.extend(no_stale_store_append(facts));
    v.extend(no_call_after_local_expiry(facts));
    v.extend(no_call_after_refusal(facts));
    v.extend(slots(facts));
    v.extend(all_ended(facts));
    v.extend(model_repaid(facts));
    v.extend(keyed_write_once(facts));
    v.extend(gated_call_decided(facts));
    v.extend(no_secret_leaked(facts));
    // The fleet's (`fleet`).
    v.extend(fleet::no_deferral_while_answering(facts));
    v.extend(fleet::limit_refusals_bounded(facts));
    v.extend(fleet::no_idle_replica(facts));
    v
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

pub fn one_completion(facts: &Facts<'_>) -> Vec<Violation> {
    let mut done: BTreeMap<String, (String, Option<u32>, &'static str, u64)> = BTreeMap::new();
    // When each (worker, op, task, attempt) call was last sent.
    let mut sent: BTreeMap<(&str, &str, &str, Option<u32>), u64> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
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
            answer: Answer::Ok,
        } = e
        else {
            continue;
        };
        if !matches!(*op, "complete" | "bpmn-error") {
            continue;
        }
        match done.get(task) {
            None => {
                done.insert(task.clone(), (worker.clone(), *attempt, op, *t));
            }
            Some((w, a, first_op, first_at)) if (w, a) != (worker, attempt) => {
                // A request sent before the other holder's completion and delayed in transit is
                // answered as a no-op by the engine; nothing a worker can prevent. One sent
                // after it is a stale holder reporting.
                let sent_at = sent
                    .get(&(worker.as_str(), *op, task.as_str(), *attempt))
                    .copied()
                    .unwrap_or(*t);
                if sent_at >= *first_at {
                    out.push(violation(
                        "one accepted completion per task",
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
            answer: Answer::Ok,
        } = e
        {
            let latest = holders.get(task);
            if latest != Some(&(worker.clone(), *attempt)) {
                out.push(violation(
                    "no append by a stale attempt accepted",
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
    // append about a run (the simulator keys runs by task id).
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
                run,
                seq: Some(seq),
                ..
            } => {
                sent.insert((worker, run, *seq), *t);
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
                attempt: Some(attempt),
                seq: Some(seq),
                answer,
            } if store_accepted(answer) => {
                let latest = claimed.get(run.as_str()).copied();
                if latest != Some(*attempt) {
                    out.push(violation(
                        "no append by a stale attempt accepted",
                        format!(
                            "task {run}: step {seq} appended to the run store by {worker} with run attempt {attempt} accepted ({answer}) at {} while the run's latest claim is attempt {latest:?}",
                            at(*t)
                        ),
                    ));
                }
                let sent_at = sent.get(&(worker.as_str(), run.as_str(), *seq)).copied();
                if let (Some((holder, since)), Some(sent_at)) = (holders.get(run.as_str()), sent_at)
                    && holder != worker
                    && sent_at > *since
                {
                    out.push(violation(
                        "no append by a stale attempt accepted",
                        format!(
                            "task {run}: step {seq} appended to the run store by {worker} (sent at {}) accepted at {}, after the engine gave the task to {holder} at {}",
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
                worker, op, run, ..
            } if *op != "finish" => {
                let Some(&attempt) = acquired.get(&(worker.as_str(), run.as_str())) else {
                    continue;
                };
                if let Some(&deadline) = expiry.get(&(worker.as_str(), run.as_str(), attempt))
                    && *t > deadline
                {
                    out.push(violation(
                        "no engine call after the local lease expired",
                        format!(
                            "task {run}: run-store {op} by {worker} (acquisition {attempt}) sent at {}, after its lease expired by the worker's own clock at {}",
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
                        "no engine call after the local lease expired",
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
                answer: Answer::Ok,
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
        Answer::Refused { status, code } => matches!(
            (*status, code.as_str()),
            (403, "WORKER_LOCK_NOT_OWNED")
                | (
                    409,
                    "WORKER_LOCK_EXPIRED" | "STALE_ATTEMPT" | "JOURNAL_CONFLICT"
                )
                | (400, "ENGINE_COMMAND_REJECTED")
        ),
        Answer::Fault(kind) => *kind == "refused",
        _ => false,
    }
}

pub fn no_call_after_refusal(facts: &Facts<'_>) -> Vec<Violation> {
    let mut lost: BTreeMap<(&str, &str, u32), (&str, u64)> = BTreeMap::new();
    // Each worker's engine attempt of each task, by its latest acquisition: a run-store fence
    // names the store's attempt, and the engine calls it stops are those of this one.
    let mut held: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::Fetched { worker, tasks, .. } => {
                for (task, attempt) in tasks {
                    held.insert((worker, task), *attempt);
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
                run,
                answer: "fenced",
                ..
            } => {
                if let Some(attempt) = held.get(&(worker.as_str(), run.as_str())) {
                    let op = match *op {
                        "claim" => "run-store claim",
                        "append" => "run-store append",
                        "finish" => "run-store finish",
                        _ => "run-store call",
                    };
                    lost.entry((worker, run, *attempt)).or_insert((op, *t));
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
                    out.push(violation(
                        "no call after the engine or the run store said the lease is lost",
                        format!(
                            "task {task}: {op} by {worker} attempt {attempt} sent at {} after {refused_op} was refused as not ours at {}",
                            at(*t),
                            at(*refused_at)
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
    let mut slots_of: BTreeMap<&str, u32> = BTreeMap::new();
    // At work: started, slot not given back yet. Reporting: slot given back, not ended yet.
    let mut running: BTreeMap<&str, BTreeSet<(&str, Option<u32>)>> = BTreeMap::new();
    let mut reporting: BTreeMap<&str, BTreeSet<(&str, Option<u32>)>> = BTreeMap::new();
    let mut out = Vec::new();
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
                        "no fetch above the free slots",
                        format!(
                            "worker {worker} asked for {requested} tasks at {} with {busy} of {slots} slots busy",
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
                        "running tasks never above the slots",
                        format!(
                            "task {task}: started by {worker} at {} with {} tasks running on {slots} slots",
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
                        "reports in flight never above the slots",
                        format!(
                            "task {task}: {worker} gave its slot back at {} with {} reports in flight on {slots} slots",
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

pub fn all_ended(facts: &Facts<'_>) -> Vec<Violation> {
    facts
        .views
        .iter()
        .filter(|v| !super::ended(v))
        .map(|v| {
            violation(
                "every task ends once faults stop",
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

pub fn model_repaid(facts: &Facts<'_>) -> Vec<Violation> {
    let mut paid: BTreeMap<&str, BTreeMap<usize, u32>> = BTreeMap::new();
    let mut acquisitions: BTreeMap<&str, u32> = BTreeMap::new();
    for (_, e) in &facts.trace.events {
        match e {
            Event::ModelCall {
                task, turn, answer, ..
            } if matches!(*answer, "tool" | "final") => {
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
                "at most one model call re-paid per interruption",
                format!(
                    "task {id}: {repaid} model answers paid again (most at turn {worst:?}) over {interruptions} interruptions"
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
            "every keyed write applied at most once",
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
                    "no gated call performed without the matching decision",
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
                "no secret in any log line, span or metric",
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
