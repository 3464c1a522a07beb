//! Where a task's run lives, found before any agent definition is read (design.md "Definitions
//! from the process model": a run's definition is the one it started with, and it alone decides
//! everything after its first step, where the journal lives included).
//!
//! The latest definition cannot say where an existing run is: a redeployment (or a change of
//! the agents file or the registry across a restart) may change whether the agent's calls wait
//! for a person, which decides whether its run is kept under its task or under its process
//! visit, and the loop-counter variable, part of a visit's key. So before the definition is
//! resolved, the task asks the run store for the open runs that may be its own, by keys that
//! come from the task alone ([`lookup`]):
//! - its own key (the task id): a run that never waits, redelivered;
//! - its node's visit key `process/{instance}/{activity}` ([`run_key::run_key`] without a
//!   counter), and any visit key of the node a variable names (`runKey` of an approval request
//!   the worker wrote when it stopped: the visit with a loop counter the decision is for);
//! - every run the task holds under its node's visit key (a visit with a loop counter,
//!   redelivered, whatever the counter's name now).
//!
//! Then [`place`] picks, purely: a run the task holds (a redelivery: the newest); else a run
//! of the node that waits for a decision and whose own journaled definition puts this task at
//! its key (its loop counter read from this task's variables); else none, and the latest
//! definition decides the home of a new run. The run picked comes with its journaled
//! definition, which the attempt then runs. The store's admission rule still decides, under
//! the claim's lock, whether the task may take it. What the pick leaves that is this task's
//! (a second run it holds, a waiting run a variable names that this task cannot take) is an
//! orphan: reported, never silently dropped.

use serde_json::Value;

use super::run_key;
use crate::engine::Task;
use crate::store::{OpenRun, Phase};

/// The most visit keys taken from a task's variables: a process keeps one request per agent
/// node.
pub(crate) const MAX_NAMED_KEYS: usize = 8;

/// The keys a task's lookup asks for, from the task alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// The task id, the node's visit key, the visit keys of the node its variables name.
    pub keys: Vec<String>,
    /// The node's visit key (`process/{instance}/{activity}`), when the task has both ids.
    pub prefix: Option<String>,
}

/// What the task's run store should be asked ([`crate::store::RunLookup`]).
pub(crate) fn lookup(task: &Task) -> Lookup {
    let mut keys = vec![task.id.clone()];
    let prefix = run_key::run_key(task, None).ok();
    if let Some(prefix) = &prefix {
        keys.push(prefix.clone());
        for named in named_keys(task, prefix) {
            if !keys.contains(&named) {
                keys.push(named);
            }
        }
    }
    Lookup { keys, prefix }
}

/// The visit keys of the node `prefix` that the task's variables name: the `runKey` of an
/// object among them (the approval request the worker wrote when it stopped), whatever the
/// variable is called. Only keys of this very node count: a variable is process data, and
/// must not reach another node's or instance's run.
fn named_keys(task: &Task, prefix: &str) -> Vec<String> {
    let mut named = Vec::new();
    for value in task.variables.values() {
        let Some(key) = value.get("runKey").and_then(Value::as_str) else {
            continue;
        };
        if of_node(key, prefix) && !named.iter().any(|k| k == key) {
            named.push(key.to_string());
            if named.len() == MAX_NAMED_KEYS {
                break;
            }
        }
    }
    named
}

/// `key` is the visit key `prefix` or one of its loop visits (`{prefix}/loop/{n}`).
fn of_node(key: &str, prefix: &str) -> bool {
    key == prefix
        || key
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix("/loop/"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Why an open run of the task was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Orphaned {
    /// The task holds another, newer run: this one would never be resumed.
    SecondRunOfTask,
    /// A variable of the task names it as the run waiting for a decision, but its own
    /// definition puts this task at another key (its loop counter changed since it stopped).
    NamedButElsewhere,
}

impl Orphaned {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Orphaned::SecondRunOfTask => "the task holds a newer run, which it resumes instead",
            Orphaned::NamedButElsewhere => {
                "a variable of the task names it as the run waiting for a decision, but the run's own definition places this task at another key (its loop counter changed)"
            }
        }
    }
}

/// What [`place`] decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Placed {
    /// The run the task resumes, with its journaled definition; `None`: a new run, where the
    /// latest definition says.
    pub run: Option<OpenRun>,
    /// Runs of this task left behind, with why.
    pub orphans: Vec<(OpenRun, Orphaned)>,
}

/// Picks the task's run among `open` (its lookup's answer, newest first): see the module docs.
pub(crate) fn place(task: &Task, open: Vec<OpenRun>) -> Placed {
    let lookup = lookup(task);
    let named: Vec<&String> = lookup.keys.iter().skip(2).collect();
    let (held, others): (Vec<OpenRun>, Vec<OpenRun>) = open
        .into_iter()
        .partition(|r| r.holder.as_deref() == Some(task.id.as_str()));
    let mut placed = Placed::default();
    let mut held = held.into_iter();
    if let Some(newest) = held.next() {
        placed.run = Some(newest);
        placed.orphans = held.map(|r| (r, Orphaned::SecondRunOfTask)).collect();
        return placed;
    }
    for run in others {
        if run.phase != Phase::AwaitsDecision {
            // Another task's live run (another token at the node), or a visit that ended.
            continue;
        }
        let here = run_key::run_key(task, pinned_loop_counter(run.definition.as_ref())).ok();
        if placed.run.is_none() && here.as_deref() == Some(run.run_key.as_str()) {
            placed.run = Some(run);
        } else if named.iter().any(|k| **k == run.run_key) {
            placed.orphans.push((run, Orphaned::NamedButElsewhere));
        }
    }
    placed
}

/// The loop-counter variable of a journaled definition (`agent::bpmn::journal_snapshot`).
fn pinned_loop_counter(snapshot: Option<&Value>) -> Option<&str> {
    let raw = snapshot?.get("definition")?;
    raw.get("loopCounterVariable")
        .or_else(|| raw.get("loop_counter_variable"))
        .and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn task(id: &str, vars: Value) -> Task {
        Task {
            id: id.into(),
            topic: "abada:agent".into(),
            variables: serde_json::from_value(vars).unwrap(),
            process_instance_id: Some("pi-1".into()),
            activity_id: Some("refundAgent".into()),
            retries: Some(3),
            lock_expiration_time: None,
            trace_parent: None,
            attempt: None,
            agent: None,
        }
    }

    fn run(key: &str, holder: &str, phase: Phase, loop_var: Option<&str>) -> OpenRun {
        let mut raw = json!({"model": "p/m", "input": "hi"});
        if let Some(v) = loop_var {
            raw["loopCounterVariable"] = json!(v);
        }
        OpenRun {
            run_key: key.into(),
            holder: Some(holder.into()),
            phase,
            definition: Some(json!({"source": "agentsFile", "entry": "a", "definition": raw})),
        }
    }

    #[test]
    fn the_lookup_comes_from_the_task_alone_and_only_names_keys_of_its_node() {
        let t = task(
            "t-2",
            json!({
                "agentApprovalRequest": {"runKey": "process/pi-1/refundAgent/loop/3"},
                "renamedRequest": {"runKey": "process/pi-1/refundAgent"},
                "otherNode": {"runKey": "process/pi-1/otherAgent"},
                "otherInstance": {"runKey": "process/pi-2/refundAgent"},
                "notALoop": {"runKey": "process/pi-1/refundAgent/loop/x"},
                "taskKey": {"runKey": "t-1"},
            }),
        );
        let l = lookup(&t);
        assert_eq!(l.prefix.as_deref(), Some("process/pi-1/refundAgent"));
        assert_eq!(
            l.keys,
            vec![
                "t-2".to_string(),
                "process/pi-1/refundAgent".to_string(),
                "process/pi-1/refundAgent/loop/3".to_string(),
            ]
        );
        let mut bare = t.clone();
        bare.process_instance_id = None;
        assert_eq!(lookup(&bare).keys, vec!["t-2".to_string()]);
        assert_eq!(lookup(&bare).prefix, None);
    }

    /// The redeploy: a run waits for a decision under the visit key; the decision
    /// arrives on a new task. Whatever the latest definition says, the waiting run is taken,
    /// with its own definition.
    #[test]
    fn a_waiting_run_of_the_node_is_taken_by_the_task_carrying_the_decision() {
        let t = task("t-2", json!({}));
        let waiting = run(
            "process/pi-1/refundAgent",
            "t-1",
            Phase::AwaitsDecision,
            None,
        );
        let placed = place(&t, vec![waiting.clone()]);
        assert_eq!(placed.run, Some(waiting));
        assert!(placed.orphans.is_empty());
        // Another token's live run, or a visit whose answer is journaled: not this task's.
        for phase in [Phase::Working, Phase::Answered] {
            let other = run("process/pi-1/refundAgent", "t-1", phase, None);
            assert_eq!(place(&t, vec![other]), Placed::default());
        }
    }

    /// A loop visit's key comes from the run's own loop counter, read from this task.
    #[test]
    fn a_loop_visit_is_taken_by_its_own_counter_and_a_named_mismatch_is_an_orphan() {
        let key = "process/pi-1/refundAgent/loop/3";
        let t = task(
            "t-2",
            json!({"round": 3, "agentApprovalRequest": {"runKey": key}}),
        );
        let waiting = run(key, "t-1", Phase::AwaitsDecision, Some("round"));
        assert_eq!(place(&t, vec![waiting.clone()]).run, Some(waiting.clone()));
        let moved = task(
            "t-2",
            json!({"round": 4, "agentApprovalRequest": {"runKey": key}}),
        );
        let placed = place(&moved, vec![waiting.clone()]);
        assert_eq!(placed.run, None);
        assert_eq!(placed.orphans, vec![(waiting, Orphaned::NamedButElsewhere)]);
    }

    /// A redelivery resumes the run it holds, under any key, newest first; an older one it also
    /// holds is an orphan, reported.
    #[test]
    fn a_redelivered_task_resumes_the_run_it_holds_and_reports_a_second_one() {
        let t = task("t-1", json!({}));
        let newest = run(
            "process/pi-1/refundAgent/loop/7",
            "t-1",
            Phase::Working,
            Some("gone"),
        );
        let older = run("t-1", "t-1", Phase::Working, None);
        let placed = place(&t, vec![newest.clone(), older.clone()]);
        assert_eq!(placed.run, Some(newest));
        assert_eq!(placed.orphans, vec![(older, Orphaned::SecondRunOfTask)]);
    }
}
