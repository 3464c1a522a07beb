//! What every part of one attempt reads (the runtime, the task, its context), and the outcomes
//! an attempt ends with: an incident, a technical failure, a release at shutdown, a limit.

use std::time::Duration;

use super::AgentRuntime;
use super::definition::AgentDefinition;
use super::limits::LimitExceeded;
use crate::engine::{FailureReport, Task};
use crate::handler::{FailureKind, Outcome, TaskContext, TaskError, retries_consumed};

/// Internally every step of an attempt returns `Result<_, Outcome>`: `Err` carries the outcome
/// that ends the attempt, so `?` ends it from anywhere.
pub(super) type Step<T = ()> = Result<T, Outcome>;

/// The runtime, the task and its context: what each part of an attempt reads, borrowed.
#[derive(Clone, Copy)]
pub(super) struct Scope<'a> {
    pub(super) rt: &'a AgentRuntime,
    pub(super) task: &'a Task,
    pub(super) ctx: &'a TaskContext,
}

impl Scope<'_> {
    /// The outcome of a call about the task that failed and cannot be done without: nothing to
    /// report when the lease is lost, else a technical failure saying `what` went wrong.
    pub(super) fn call_failed(&self, e: TaskError, what: &str) -> Outcome {
        e.into_outcome(|e| self.technical(format!("{what}: {e}")))
    }

    /// A technical failure: one retry consumed, an exponential `retryTimeout` by attempt.
    pub(super) fn technical(&self, details: String) -> Outcome {
        let retry_timeout = self
            .rt
            .settings
            .technical_retry
            .delay(earlier_failures(self.task), &self.rt.random);
        tracing::warn!(details = %details, retry_in_ms = retry_timeout.as_millis() as u64, "technical failure: one retry consumed");
        Outcome::Failure {
            kind: FailureKind::Technical,
            report: FailureReport {
                error_message: details.clone(),
                error_details: details,
                retries: retries_consumed(self.task),
                retry_timeout,
            },
        }
    }

    /// The task given back at shutdown (retries unchanged), to be resumed from its journal.
    pub(super) fn released(&self) -> Outcome {
        Outcome::released(
            self.task,
            "the worker shut down before the agent finished; another worker resumes it from the journal",
        )
    }

    /// A step boundary: stop here when the lease is gone or the worker is shutting down.
    pub(super) fn boundary(&self) -> Step {
        if self.ctx.lease().is_lost() {
            return Err(Outcome::Abandoned);
        }
        if self.ctx.stop_requested() {
            return Err(self.released());
        }
        Ok(())
    }
}

/// A limit ends the task as an incident naming the limit and its value.
pub(super) fn limit_reached(def: &AgentDefinition, e: LimitExceeded) -> Outcome {
    tracing::warn!(agent = %def.name, limit = e.name(), "an agent limit was reached");
    incident(
        &format!("agent {:?} reached a limit", def.name),
        e.to_string(),
    )
}

/// An incident: `failure` with `retries: 0`, for an operator to see, fix and retry.
pub(super) fn incident(message: &str, details: String) -> Outcome {
    tracing::error!(details = %details, "{message}: the task becomes an incident");
    Outcome::Failure {
        kind: FailureKind::Incident,
        report: FailureReport {
            error_message: format!("{message}: {details}"),
            error_details: details,
            retries: 0,
            retry_timeout: Duration::ZERO,
        },
    }
}

/// How many technical failures came before this one, for the backoff: an agent/1 task counts
/// its attempts; a plain v1 task only the retries it has left, which each technical failure
/// lowers by one from [`crate::handler::DEFAULT_RETRIES`] (the engine's own starting value may
/// differ: the backoff then starts at its first step, never past its cap).
fn earlier_failures(task: &Task) -> u32 {
    match task.attempt {
        Some(attempt) => attempt.saturating_sub(1),
        None => u32::try_from(crate::handler::DEFAULT_RETRIES - crate::handler::task_retries(task))
            .unwrap_or(0),
    }
}

/// The most a completion may store in process variables, in bytes of JSON: a quarter of what
/// the worker accepts as one task (`body::TASK_MAX_BYTES`). The engine hands every variable of
/// the instance to its next external task, so a completion that stored more would make the
/// instance's next agent task larger than any worker takes.
pub(crate) const MAX_STORED_VARIABLES_BYTES: usize = crate::body::TASK_MAX_BYTES / 4;

/// A completion whose variables are over [`MAX_STORED_VARIABLES_BYTES`] becomes an incident
/// naming the largest one, with nothing stored; any other outcome passes unchanged.
pub(super) fn stored_variables_fit(outcome: Outcome) -> Outcome {
    let Outcome::Complete { variables } = &outcome else {
        return outcome;
    };
    let sizes: Vec<(&String, usize)> = variables
        .iter()
        .map(|(name, value)| {
            (
                name,
                serde_json::to_vec(value).map_or(usize::MAX, |v| v.len()),
            )
        })
        .collect();
    let total = sizes.iter().fold(0usize, |sum, (name, size)| {
        sum.saturating_add(name.len()).saturating_add(*size)
    });
    if total <= MAX_STORED_VARIABLES_BYTES {
        return outcome;
    }
    let (largest, bytes) = sizes
        .iter()
        .max_by_key(|(_, size)| *size)
        .map_or(("", 0), |(name, size)| (name.as_str(), *size));
    incident(
        "the agent's result is too large to store in process variables",
        format!(
            "the variables this completion would store hold {total} bytes ({largest:?}: {bytes} bytes), over the worker's cap of {MAX_STORED_VARIABLES_BYTES} bytes: the engine hands every variable of the instance to its next task, and a worker takes a task of at most {} bytes. Nothing was stored. Ask the agent for a shorter answer (an outputSchema with maxLength, a lower maxOutputTokens) or let a tool keep the large data and return a reference",
            crate::body::TASK_MAX_BYTES
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain v1 task backs off longer as its retries run down, like an agent/1 task as its
    /// attempts grow (a request that fails on its own consumes a retry with backoff).
    #[test]
    fn technical_failures_back_off_by_attempt_or_by_the_retries_used() {
        let task = |attempt: Option<u32>, retries: Option<i32>| Task {
            id: "t-1".into(),
            topic: "abada:agent".into(),
            variables: Default::default(),
            process_instance_id: None,
            activity_id: None,
            retries,
            lock_expiration_time: None,
            trace_parent: None,
            attempt,
            agent: None,
        };
        assert_eq!(earlier_failures(&task(Some(1), Some(3))), 0);
        assert_eq!(earlier_failures(&task(Some(4), Some(3))), 3);
        assert_eq!(earlier_failures(&task(None, None)), 0);
        assert_eq!(earlier_failures(&task(None, Some(3))), 0);
        assert_eq!(earlier_failures(&task(None, Some(1))), 2);
        assert_eq!(earlier_failures(&task(None, Some(0))), 3);
        assert_eq!(earlier_failures(&task(None, Some(50))), 0);
        assert_eq!(earlier_failures(&task(None, Some(i32::MIN))), 3);
    }
}
