//! The promises only a run whose scenario says what it made legitimate can judge
//! ([`super::Scenario`]: the fault suite's runs on the wire). The simulator's faults hit leases
//! and tool servers at random, so for its seeds these judge nothing; their wider kin there are
//! "every keyed write applied at most once" and the lease invariants of [`super`].
//!
//! - [`keys_resent`]: a keyed write sent once, plus once per interruption its journal shows (the
//!   `tool/started` step of the key appended by one attempt and its `finished` step by a later
//!   one, or never), times the tries the scenario allows; a journaled task sends no key its
//!   journal does not hold; no write without a key; one logical write under one key.
//! - [`healthy_leases`]: no lease of a task the scenario did not target ran out (every new
//!   attempt follows an ending of the one before, no call refused `WORKER_LOCK_EXPIRED`, no
//!   `lease_lost` end).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Facts, Violation, executed, is_report, violation};
use crate::world::trace::{Answer, Event};
use abada_devkit::engine::TaskView;

/// The answer a tool server's record of a write without an idempotency key is written with.
pub const UNKEYED_WRITE: &str = "unkeyed-write";

/// The attempt that appended each step of `task`'s journal (`None` where the trace cannot say):
/// the engine adds a step exactly when it runs an append that is not a repeat, so the executed
/// appends of the task, in order, are its journal's steps in order.
fn journal_appenders(facts: &Facts<'_>, task: &str, steps: usize) -> Vec<Option<u32>> {
    let mut appenders: Vec<Option<u32>> = facts
        .trace
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::EngineAnswer {
                op: "journal-append",
                task: Some(k),
                attempt,
                answer,
                ..
            } if k == task && executed(answer) => Some(*attempt),
            _ => None,
        })
        .collect();
    appenders.resize(steps, None);
    appenders
}

/// How many attempts may have sent keyed write `key` of task `t`: one, plus one per
/// interruption between the key's `tool/started` step and its `finished` step (the attempts
/// after the one that journaled the start, up to the one that journaled the finish, or the
/// task's current attempt). `Err` when a journaled task sent a key its journal lacks. A task
/// without a journal (content keys) may re-send on every re-delivery.
fn attempts_sending(facts: &Facts<'_>, t: &TaskView, key: &str) -> Result<(u64, String), String> {
    let step_of = |state: &str| {
        t.journal.iter().position(|s| {
            s.get("kind").and_then(Value::as_str) == Some("tool")
                && s.get("state").and_then(Value::as_str) == Some(state)
                && s.get("key").and_then(Value::as_str) == Some(key)
        })
    };
    let current = t.attempt;
    let redeliveries = u64::from(current.saturating_sub(1));
    let Some(started) = step_of("started") else {
        if t.journal.is_empty() {
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
    let appenders = journal_appenders(facts, &t.id, t.journal.len());
    let finished = step_of("finished");
    let from = appenders[started];
    let to = match finished {
        Some(i) => appenders[i],
        None => Some(current),
    };
    let (Some(from), Some(to)) = (from, to) else {
        return Ok((
            1 + redeliveries,
            format!("appenders unknown, {redeliveries} re-deliveries"),
        ));
    };
    let interruptions = u64::from(to.saturating_sub(from));
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

pub fn keys_resent(facts: &Facts<'_>) -> Vec<Violation> {
    let Some(scenario) = facts.scenario else {
        return Vec::new();
    };
    let tries = u64::from(scenario.tool_tries.max(1));
    let mut out = Vec::new();
    // Per server: sends per key, and the keys of each logical write (task, n).
    let mut sends: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut keys_of_write: BTreeMap<(&str, &str, u64), BTreeSet<&str>> = BTreeMap::new();
    let mut unkeyed: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, e) in &facts.trace.events {
        let Event::ToolCall {
            worker: server,
            task,
            write,
            key,
            answer,
        } = e
        else {
            continue;
        };
        match key {
            None if *answer == UNKEYED_WRITE => *unkeyed.entry(server).or_default() += 1,
            None => {}
            Some(key) => {
                *sends.entry((server, key)).or_default() += 1;
                if let Some(n) = write {
                    keys_of_write
                        .entry((server, task, *n))
                        .or_default()
                        .insert(key);
                }
            }
        }
    }
    for (server, n) in unkeyed {
        out.push(violation(
            super::KEYS_RESENT,
            format!("{server}: {n} writes without an idempotency key"),
        ));
    }
    for ((server, key), n) in sends {
        // Keys are `abada:{taskId}:...` (src/agent/journal.rs).
        let task_id = key.split(':').nth(1).unwrap_or_default();
        let Some(t) = facts.views.iter().find(|t| t.id == task_id) else {
            out.push(violation(
                super::KEYS_RESENT,
                format!("{server}: key {key} sent {n} time(s) names no task the engine knows"),
            ));
            continue;
        };
        match attempts_sending(facts, t, key) {
            Err(why) => out.push(violation(super::KEYS_RESENT, format!("{server}: {why}"))),
            Ok((attempts, why)) if n > attempts * tries => out.push(violation(
                super::KEYS_RESENT,
                format!(
                    "{server}: task {task_id}: key {key} sent {n} times, {} allowed ({why}; {tries} per attempt)",
                    attempts * tries
                ),
            )),
            Ok(_) => {}
        }
    }
    for ((server, task, n), keys) in keys_of_write {
        if keys.len() > 1 {
            out.push(violation(
                super::KEYS_RESENT,
                format!(
                    "{server}: task {task}: write {n} sent under {} keys: {keys:?}",
                    keys.len()
                ),
            ));
        }
    }
    out
}

pub fn healthy_leases(facts: &Facts<'_>) -> Vec<Violation> {
    let Some(scenario) = facts.scenario else {
        return Vec::new();
    };
    let healthy = |id: &str| !scenario.lease_loss.contains(id);
    let mut out = Vec::new();
    for t in facts.views.iter().filter(|t| healthy(&t.id)) {
        for attempt in 1..t.attempt {
            let ended = facts.trace.events.iter().any(|(_, e)| {
                matches!(e, Event::EngineAnswer { op, task: Some(k), attempt: Some(a), answer, .. }
                    if is_report(op) && *k == t.id && *a == attempt
                        && (executed(answer) || *answer == Answer::Replayed))
            });
            if !ended {
                out.push(violation(
                    super::HEALTHY_LEASES,
                    format!(
                        "task {}: attempt {attempt} was followed by attempt {} without ending (its lease expired)",
                        t.id,
                        attempt + 1
                    ),
                ));
            }
        }
    }
    for (_, e) in &facts.trace.events {
        match e {
            Event::EngineAnswer {
                op,
                task: Some(task),
                answer: Answer::Refused { code, .. },
                ..
            } if code == "WORKER_LOCK_EXPIRED" && healthy(task) => {
                out.push(violation(
                    super::HEALTHY_LEASES,
                    format!("task {task}: {op} refused WORKER_LOCK_EXPIRED"),
                ));
            }
            Event::TaskEnded {
                worker,
                task,
                outcome,
                ..
            } if outcome == "lease_lost" && healthy(task) => {
                out.push(violation(
                    super::HEALTHY_LEASES,
                    format!("{worker}: task {task} ended lease_lost"),
                ));
            }
            _ => {}
        }
    }
    out
}
