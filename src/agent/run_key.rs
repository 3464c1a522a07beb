//! The run key of an agent node that may stop for approval: which conversation a task belongs
//! to, stable across the tasks of one visit of the node. On the real engine a loop back to the
//! node is a NEW external task (new id) of the same process instance and activity, with no loop
//! counter (/work/notes/real-engine.md §8), so the key is built from those two, plus the value
//! of a loop-counter variable when the definition names one (a node the process re-enters for a
//! new piece of work, not only for a decision, must count its visits itself).
//!
//! Shape: `process/{processInstanceId}/{activityId}` or `.../loop/{n}`, each part
//! percent-escaped (`%`, `/` and control characters), so two different triples never give the
//! same key and a key never holds a control character. At most [`MAX_RUN_KEY_BYTES`] bytes, the
//! run store's bound. The `process/` prefix keeps these keys apart from task-id keys.
//!
//! The key cannot be the task id: the decision arrives on the NEXT task of the same visit, which
//! must find the conversation. So the key alone does not tell two tokens at the node at once
//! apart, nor a visit from the one before it when no loop counter is named. The run store's
//! admission rule (`store/admission.rs`) does, at every claim, from the claiming task, the run's
//! holder task and its liveness, the conversation's phase (waiting for a decision, answered) and
//! the digest of the rendered input: another task resumes a conversation only when it was
//! handed over and its input is the same; a live holder's conversation is refused to it (an
//! incident); an answered one is begun afresh, never replayed.

use serde_json::{Map, Value};

use crate::engine::Task;

/// The run store's bound on a key.
pub(crate) const MAX_RUN_KEY_BYTES: usize = 512;

/// Why a task has no run key: the task becomes an incident naming what is missing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RunKeyError {
    #[error(
        "task {task_id} has no {field}, so an approval cannot find its conversation again; approval needs an engine that sends processInstanceId and activityId"
    )]
    MissingId {
        task_id: String,
        field: &'static str,
    },
    #[error(
        "the loop-counter variable {variable:?} is missing; set it before the agent node, or remove loopCounterVariable from the definition"
    )]
    MissingCounter { variable: String },
    #[error(
        "the loop-counter variable {variable:?} is {found}, not a whole number from 0 up; fix the variable or the definition's loopCounterVariable"
    )]
    BadCounter {
        variable: String,
        found: &'static str,
    },
    #[error(
        "the run key of task {task_id} would be {bytes} bytes, over the run store's {MAX_RUN_KEY_BYTES}; shorten the process instance or activity id"
    )]
    TooLong { task_id: String, bytes: usize },
}

/// The run key of `task`, with the loop counter read from `loop_counter` when one is named.
pub fn run_key(task: &Task, loop_counter: Option<&str>) -> Result<String, RunKeyError> {
    let instance = required_id(
        task,
        task.process_instance_id.as_deref(),
        "processInstanceId",
    )?;
    let activity = required_id(task, task.activity_id.as_deref(), "activityId")?;
    let mut key = format!("process/{}/{}", escape(instance), escape(activity));
    if let Some(variable) = loop_counter {
        key.push_str(&format!("/loop/{}", counter(&task.variables, variable)?));
    }
    if key.len() > MAX_RUN_KEY_BYTES {
        return Err(RunKeyError::TooLong {
            task_id: task.id.clone(),
            bytes: key.len(),
        });
    }
    Ok(key)
}

fn required_id<'a>(
    task: &Task,
    value: Option<&'a str>,
    field: &'static str,
) -> Result<&'a str, RunKeyError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or(RunKeyError::MissingId {
            task_id: task.id.clone(),
            field,
        })
}

fn counter(variables: &Map<String, Value>, variable: &str) -> Result<u64, RunKeyError> {
    let bad = |found| RunKeyError::BadCounter {
        variable: variable.to_string(),
        found,
    };
    match variables.get(variable) {
        None | Some(Value::Null) => Err(RunKeyError::MissingCounter {
            variable: variable.to_string(),
        }),
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| bad("a negative or fractional number")),
        Some(Value::String(_)) => Err(bad("a string")),
        Some(Value::Bool(_)) => Err(bad("a boolean")),
        Some(Value::Array(_)) => Err(bad("an array")),
        Some(Value::Object(_)) => Err(bad("an object")),
    }
}

fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for c in part.chars() {
        if c == '%' || c == '/' || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn task(id: &str, instance: Option<&str>, activity: Option<&str>, vars: Value) -> Task {
        Task {
            id: id.into(),
            topic: "abada:agent".into(),
            variables: serde_json::from_value(vars).unwrap(),
            process_instance_id: instance.map(Into::into),
            activity_id: activity.map(Into::into),
            retries: Some(3),
            lock_expiration_time: None,
            trace_parent: None,
            attempt: None,
            agent: None,
        }
    }

    #[test]
    fn the_two_tasks_of_one_visit_share_the_key_and_other_visits_do_not() {
        let first = task("t-1", Some("pi-1"), Some("refundAgent"), json!({}));
        let second = task(
            "t-2",
            Some("pi-1"),
            Some("refundAgent"),
            json!({"agentApproval": {"callId": "c"}}),
        );
        assert_eq!(run_key(&first, None).unwrap(), "process/pi-1/refundAgent");
        assert_eq!(run_key(&first, None), run_key(&second, None));
        let other_instance = task("t-3", Some("pi-2"), Some("refundAgent"), json!({}));
        let other_node = task("t-4", Some("pi-1"), Some("otherAgent"), json!({}));
        assert_ne!(run_key(&first, None), run_key(&other_instance, None));
        assert_ne!(run_key(&first, None), run_key(&other_node, None));
    }

    #[test]
    fn a_loop_counter_separates_visits() {
        let visit = |n: Value| task("t", Some("pi-1"), Some("a"), json!({ "round": n }));
        assert_eq!(
            run_key(&visit(json!(2)), Some("round")).unwrap(),
            "process/pi-1/a/loop/2"
        );
        assert_ne!(
            run_key(&visit(json!(2)), Some("round")),
            run_key(&visit(json!(3)), Some("round"))
        );
        let missing = run_key(&task("t", Some("p"), Some("a"), json!({})), Some("round"));
        assert!(missing.unwrap_err().to_string().contains("\"round\""));
        for (value, found) in [
            (json!(-1), "negative"),
            (json!(1.5), "fractional"),
            (json!("2"), "a string"),
            (json!(true), "a boolean"),
        ] {
            let e = run_key(&visit(value), Some("round"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("\"round\"") && e.contains(found), "{e}");
        }
    }

    #[test]
    fn parts_are_escaped_so_keys_never_collide_or_hold_control_characters() {
        let a = run_key(&task("t", Some("p/q"), Some("r"), json!({})), None).unwrap();
        let b = run_key(&task("t", Some("p"), Some("q/r"), json!({})), None).unwrap();
        assert_ne!(a, b);
        assert_eq!(a, "process/p%2Fq/r");
        let c = run_key(&task("t", Some("p%2Fq"), Some("r"), json!({})), None).unwrap();
        assert_ne!(a, c);
        let d = run_key(&task("t", Some("p\nx"), Some("r"), json!({})), None).unwrap();
        assert!(!d.chars().any(char::is_control) && d.contains("%0A"));
    }

    #[test]
    fn tasks_without_ids_or_with_huge_ids_have_no_key() {
        for (instance, activity, field) in [
            (None, Some("a"), "processInstanceId"),
            (Some("p"), None, "activityId"),
            (Some(""), Some("a"), "processInstanceId"),
        ] {
            let e = run_key(&task("t-9", instance, activity, json!({})), None).unwrap_err();
            assert!(e.to_string().contains(field) && e.to_string().contains("t-9"));
        }
        let long = "x".repeat(600);
        let e = run_key(&task("t", Some(&long), Some("a"), json!({})), None).unwrap_err();
        assert!(matches!(e, RunKeyError::TooLong { .. }));
    }
}
