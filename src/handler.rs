//! The task handler seam: what the runner asks of whoever runs a task (the agent runtime, or a
//! test double), the context a running task gets, and the outcomes it can end in.
//!
//! The runner owns reporting: a handler returns an [`Outcome`], and the runner turns it into
//! exactly one engine call, unless the lease was lost, in which case nothing is reported. How
//! the task ended is a [`TaskEnd`], the one vocabulary of the runner's events, logs and metrics.
//!
//! Every engine call a task makes about itself goes through [`TaskContext::fenced`] and fails
//! with a [`TaskError`]: the lease is lost (stop, report nothing), or the engine failed the call.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;

use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::engine::{
    AnonymousAccess, AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport,
    HistoryPage, Journal, JournalStep, LeaseLostReason, ProcessDefinition, ProcessInstance, Task,
    TaskRef, ToolCredential,
};
use crate::lease::Lease;
use crate::provider::capacity::Capacity;
use crate::store::{ErrorClass, StoreError};

/// Why a task ends in `failure`, which decides its `retries` and `retryTimeout`
/// (protocol.md B.5) and its [`TaskEnd`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// A technical error: one retry consumed, exponential retry timeout.
    Technical,
    /// Every model unavailable: retries unchanged, retry timeout from Retry-After.
    Deferred,
    /// maxTurns or token budget reached, or a bad definition: retries 0, an incident.
    Incident,
    /// The worker is shutting down: retries unchanged, retry timeout 0.
    Released,
}

impl FailureKind {
    pub fn end(self) -> TaskEnd {
        match self {
            FailureKind::Technical => TaskEnd::Failed,
            FailureKind::Deferred => TaskEnd::Deferred,
            FailureKind::Incident => TaskEnd::Incident,
            FailureKind::Released => TaskEnd::Released,
        }
    }
}

pub use crate::task_end::TaskEnd;

/// How a task ended, as the handler saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Complete {
        variables: Map<String, Value>,
    },
    BpmnError(BpmnErrorReport),
    Failure {
        kind: FailureKind,
        report: FailureReport,
    },
    /// The handler found the lease lost: report nothing.
    Abandoned,
}

impl Outcome {
    /// How the task ends once this outcome is reported.
    pub fn end(&self) -> TaskEnd {
        match self {
            Outcome::Complete { .. } => TaskEnd::Completed,
            Outcome::BpmnError(_) => TaskEnd::BpmnError,
            Outcome::Failure { kind, .. } => kind.end(),
            Outcome::Abandoned => TaskEnd::LeaseLost,
        }
    }

    /// The outcome as the engine can take it. The engine cannot store a top-level JSON `null`
    /// variable (Abada 0.11 answers 500 and keeps the task locked, so a worker that sent it
    /// again and again would run the task forever): a completion or BPMN error carrying one
    /// becomes an incident naming the variables, reported once. Nested nulls are stored as
    /// they are. (An agent whose final answer is `null` ends here; see docs/OPERATIONS.md "How a
    /// task ends".)
    pub(crate) fn storable(self) -> Outcome {
        let variables = match &self {
            Outcome::Complete { variables } => variables,
            Outcome::BpmnError(r) => &r.variables,
            _ => return self,
        };
        let nulls: Vec<&str> = variables
            .iter()
            .filter(|(_, v)| v.is_null())
            .map(|(k, _)| k.as_str())
            .collect();
        if nulls.is_empty() {
            return self;
        }
        let what = match &self {
            Outcome::Complete { .. } => "complete",
            _ => "bpmn-error",
        };
        let details = format!(
            "the {what} would set {} to JSON null, which the engine cannot store as a process variable (it answers 500 and keeps the task locked); a final answer of `null` ends here: the agent must answer with JSON other than null, or text",
            nulls
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        tracing::error!(details = %details, "the task's result cannot be stored: the task becomes an incident");
        Outcome::Failure {
            kind: FailureKind::Incident,
            report: FailureReport {
                error_message: format!("the task's result cannot be stored: {details}"),
                error_details: details,
                retries: 0,
                retry_timeout: Duration::ZERO,
            },
        }
    }

    /// What to report instead when the engine refused `self` (a completion or BPMN error) for
    /// a reason retrying cannot change that is not a lost lease (`refusal`, e.g. 400 "Process
    /// instance is suspended"): a failure with `retries: 0` carrying the engine's message, so
    /// the task ends once as an incident instead of expiring and running again forever.
    /// `None` for any other outcome.
    pub(crate) fn refused_instead(&self, refusal: &EngineError) -> Option<FailureReport> {
        let what = match self {
            Outcome::Complete { .. } => "completion",
            Outcome::BpmnError(_) => "BPMN error",
            _ => return None,
        };
        Some(FailureReport {
            error_message: format!("the engine refused the task's {what}: {refusal}"),
            error_details: format!(
                "{refusal}. The task was not completed; retrying the same {what} cannot succeed, so the worker reports it once as an incident (resolve the cause, then set the task's retries to run it again)"
            ),
            retries: 0,
            retry_timeout: Duration::ZERO,
        })
    }

    /// A failure that keeps the task's retries and makes it available again at once.
    pub fn released(task: &Task, message: impl Into<String>) -> Outcome {
        Outcome::Failure {
            kind: FailureKind::Released,
            report: FailureReport {
                error_message: message.into(),
                error_details: String::new(),
                retries: retries_unchanged(task),
                retry_timeout: Duration::ZERO,
            },
        }
    }
}

/// The task's own `retries`, for failures that must not consume one (a release, a deferral):
/// the engine's value exactly as it sent it, odd ones included. Clamped, an engine's `-1` would
/// go back as `0`, and `retries: 0` makes an incident of a task nobody failed (protocol.md A:
/// "failure sets retries to the value sent"). Nothing is computed from it. 3 when the engine
/// sent null (protocol.md B.5).
pub(crate) fn retries_unchanged(task: &Task) -> i32 {
    task.retries.unwrap_or(DEFAULT_RETRIES)
}

/// `retries - 1`, for a technical failure (protocol.md B.5: 3 when the engine sent null).
pub fn retries_consumed(task: &Task) -> i32 {
    task_retries(task).saturating_sub(1).max(0)
}

pub(crate) const DEFAULT_RETRIES: i32 = 3;

/// The most retries a failure that consumes one reports. The engine's `retries` is outside
/// input: a negative value (`i32::MIN` once wrapped to endless retries) counts as none left, and
/// a huge one is brought down to this, so no arithmetic on it can overflow and no task retries
/// without end. (A failure that keeps the retries sends the engine's value back as it came:
/// [`retries_unchanged`].)
pub(crate) const MAX_RETRIES: i32 = 100;

/// The task's `retries` as the worker counts with it: [`DEFAULT_RETRIES`] when the engine sent
/// none, else clamped to `0..=MAX_RETRIES` before any arithmetic.
pub(crate) fn task_retries(task: &Task) -> i32 {
    task.retries
        .unwrap_or(DEFAULT_RETRIES)
        .clamp(0, MAX_RETRIES)
}

/// Runs one task. Implementations must return promptly once `ctx.lease().is_lost()` or
/// `ctx.stop_requested()`; the runner also drops them at their next await when the lease is lost.
#[async_trait]
pub trait TaskHandler: Send + Sync + 'static {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome;

    /// How many tasks of `topic` could start their work at `now`, the free slots aside: for the
    /// agent runtime, the calls the models its tasks of that topic use can start soon
    /// (`provider::capacity`). The runner claims no more, and leaves a topic with none out of
    /// its fetch. No bound by default, nor for a topic whose models are not known.
    fn admission(&self, _topic: &str, _now: tokio::time::Instant) -> Capacity {
        Capacity::Unbounded
    }

    /// The runner claimed `tasks` at `now`: they count against [`TaskHandler::admission`]
    /// until their work starts.
    fn claimed(&self, _tasks: &[Task], _now: tokio::time::Instant) {}
}

/// What a task leaves to do once the runner has reported how it ended (or found it could not):
/// record an end that is now committed (the run store finishes the task's run on `Completed`).
/// Given to [`TaskContext::after_report`]; run once, after `handle`, even one dropped midway.
#[async_trait]
pub(crate) trait AfterReport: Send {
    async fn reported(self: Box<Self>, end: TaskEnd);
}

/// The slot a task's [`AfterReport`] waits in: one per task, shared by the clones of its
/// context and read by the runner after the report.
#[derive(Clone, Default)]
pub(crate) struct AfterReportSlot(Arc<std::sync::Mutex<Option<Box<dyn AfterReport>>>>);

impl AfterReportSlot {
    fn set(&self, hook: Box<dyn AfterReport>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// Runs what the task left, if anything (the runner, once the task's end is reported).
    pub(crate) async fn run(&self, end: TaskEnd) {
        let hook = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(hook) = hook {
            hook.reported(end).await;
        }
    }
}

/// What a running task may use: its lease, the stop signal, and engine calls about itself that
/// are fenced by the lease (never made once it is lost, and a refusal marks it lost).
#[derive(Clone)]
pub struct TaskContext {
    engine: Arc<dyn Engine>,
    lease: Lease,
    stop: CancellationToken,
    /// Work the task leaves behind that must end before its lease is given back: closing its
    /// MCP sessions when the task was dropped (aborted at shutdown or on a lost lease). The
    /// runner waits for it; a session's credential may not outlive the lease.
    cleanup: TaskTracker,
    /// What to do once the task's end is reported (see [`AfterReport`]).
    after_report: AfterReportSlot,
}

impl TaskContext {
    pub fn new(engine: Arc<dyn Engine>, lease: Lease, stop: CancellationToken) -> Self {
        TaskContext {
            engine,
            lease,
            stop,
            cleanup: TaskTracker::new(),
            after_report: AfterReportSlot::default(),
        }
    }

    /// Leaves `hook` to run once the runner has reported the task's end (replacing any left
    /// before by this task).
    pub(crate) fn after_report(&self, hook: Box<dyn AfterReport>) {
        self.after_report.set(hook);
    }

    /// The slot the runner reads after the report (every clone of this context shares it).
    pub(crate) fn after_report_slot(&self) -> &AfterReportSlot {
        &self.after_report
    }

    /// The task's cleanup tracker (see the field): every clone of this context shares it.
    pub fn cleanup(&self) -> &TaskTracker {
        &self.cleanup
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    pub fn task_ref(&self) -> &TaskRef {
        self.lease.task()
    }

    /// The shutdown grace period is over: wrap up at the next step boundary and return
    /// [`Outcome::released`].
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.is_cancelled()
    }

    pub async fn stopped(&self) {
        self.stop.cancelled().await
    }

    /// Runs a call about this task (to the engine, or to the run store): not at all when the
    /// lease is lost, abandoned when it is lost meanwhile, and a refusal marks it lost. The one
    /// place that enforces silence after loss, and the one place a refusal becomes
    /// [`TaskError::LeaseLost`].
    pub async fn fenced<T, E, F>(&self, call: F) -> Result<T, TaskError<E>>
    where
        E: Refusal,
        F: Future<Output = Result<T, E>>,
    {
        // A lease lost without a recorded reason cannot happen (the reason is set before the
        // latch fires); "superseded" is the harmless guess.
        let lost = || {
            TaskError::LeaseLost(
                self.lease
                    .lost_reason()
                    .unwrap_or(LeaseLostReason::Superseded),
            )
        };
        // SIM-BUG (feature `sim-bugs`, selected at run time): the fence removed.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::FenceRemoved) {
            return call.await.map_err(|e| TaskError::Engine(e));
        }
        // The clock first: a process paused past the local expiry runs this before the
        // scheduler's timer can mark the lease lost.
        if self.lease.expired_locally() {
            self.lease.mark_lost(LeaseLostReason::LocalExpiry);
        }
        if self.lease.is_lost() {
            return Err(lost());
        }
        // Bounded by the lease's local expiry even when the heartbeat scheduler no longer
        // extends it (a task reporting its outcome): an engine that never answers cannot hold
        // the call, nor its retries, past the moment another worker may own the task.
        let result = tokio::select! {
            biased;
            _ = self.lease.lost_or_expired() => return Err(lost()),
            r = call => r,
        };
        result.map_err(|e| match e.lease_lost() {
            Some(reason) => {
                self.lease.mark_lost(reason);
                TaskError::LeaseLost(reason)
            }
            None => TaskError::Engine(e),
        })
    }

    pub async fn read_journal(&self) -> Result<Journal, TaskError> {
        self.fenced(self.engine.read_journal(self.lease.task()))
            .await
    }

    pub async fn append_journal(&self, step: &JournalStep) -> Result<AppendOutcome, TaskError> {
        self.fenced(self.engine.append_journal(self.lease.task(), step))
            .await
    }

    pub async fn tool_credential(&self, server: &str) -> Result<ToolCredential, TaskError> {
        self.fenced(self.engine.tool_credential(self.lease.task(), server))
            .await
    }

    /// Which definition a process instance runs (for an agent defined in the BPMN).
    pub async fn process_instance(&self, instance_id: &str) -> Result<ProcessInstance, TaskError> {
        self.fenced(self.engine.process_instance(self.lease.task(), instance_id))
            .await
    }

    /// One page of a process instance's activity history (who did what, as the engine says).
    pub async fn process_history(
        &self,
        instance_id: &str,
        page: u32,
    ) -> Result<HistoryPage, TaskError> {
        self.fenced(
            self.engine
                .process_history(self.lease.task(), instance_id, page),
        )
        .await
    }

    /// Whether the engine answers a history read made with no identity (its security off).
    pub async fn anonymous_history_read(
        &self,
        instance_id: &str,
    ) -> Result<AnonymousAccess, TaskError> {
        self.fenced(
            self.engine
                .anonymous_history_read(self.lease.task(), instance_id),
        )
        .await
    }

    /// The latest deployed version of a process definition, with its XML.
    pub async fn process_definition(
        &self,
        definition_id: &str,
    ) -> Result<ProcessDefinition, TaskError> {
        self.fenced(
            self.engine
                .process_definition(self.lease.task(), definition_id),
        )
        .await
    }
}

/// An error that may say the lease is no longer ours: the engine's refusals, and the run
/// store's (another attempt claimed the run).
pub trait Refusal {
    fn lease_lost(&self) -> Option<LeaseLostReason>;
}

impl Refusal for EngineError {
    fn lease_lost(&self) -> Option<LeaseLostReason> {
        EngineError::lease_lost(self)
    }
}

impl Refusal for StoreError {
    fn lease_lost(&self) -> Option<LeaseLostReason> {
        // SIM-BUG (feature `sim-bugs`, selected at run time): the store's fence not a loss.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::StoreFenceIgnored) {
            return None;
        }
        (self.class() == ErrorClass::Fenced).then_some(LeaseLostReason::RunStoreFenced)
    }
}

/// Why a call about a running task failed: an engine call (`TaskError`), or a run-store call
/// (`TaskError<StoreError>`). Only [`TaskContext::fenced`] makes one, so `Engine` never holds a
/// refusal: that is always `LeaseLost`.
#[derive(Debug, thiserror::Error)]
pub enum TaskError<E = EngineError> {
    /// The lease is gone (refused, expired by our clock, or superseded): stop, report nothing.
    #[error("the lease is lost ({0}): the task stops and reports nothing")]
    LeaseLost(LeaseLostReason),
    /// The peer (the engine, or the run store) failed the call otherwise (unreachable,
    /// throttling, a bad answer, no such endpoint); the caller decides whether to go on, retry
    /// or end the task.
    #[error(transparent)]
    Engine(E),
}

impl<E> TaskError<E> {
    /// The one rule for a task whose call about itself failed and cannot go on: a lost lease
    /// ends it silently ([`Outcome::Abandoned`]); any other error ends it as `on_engine_error`
    /// says.
    pub(crate) fn into_outcome(self, on_engine_error: impl FnOnce(E) -> Outcome) -> Outcome {
        match self {
            TaskError::LeaseLost(_) => Outcome::Abandoned,
            TaskError::Engine(e) => on_engine_error(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a task leaves for after the report runs once, with the end the runner reported,
    /// and never again (a second report of the same context finds nothing).
    #[tokio::test(start_paused = true)]
    async fn what_a_task_leaves_for_after_the_report_runs_once_with_the_end() {
        struct Record(Arc<std::sync::Mutex<Vec<TaskEnd>>>);
        #[async_trait]
        impl AfterReport for Record {
            async fn reported(self: Box<Self>, end: TaskEnd) {
                self.0.lock().unwrap().push(end);
            }
        }
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let slot = AfterReportSlot::default();
        let clone = slot.clone();
        clone.set(Box::new(Record(seen.clone())));
        slot.run(TaskEnd::Completed).await;
        slot.run(TaskEnd::LeaseLost).await;
        assert_eq!(*seen.lock().unwrap(), vec![TaskEnd::Completed]);
    }

    /// The spellings are a public contract: docs/OPERATIONS.md lists them for dashboards and
    /// alerts.
    #[test]
    fn every_task_end_is_spelled_as_the_operations_manual_documents() {
        let operations = include_str!("../docs/OPERATIONS.md");
        let row = operations
            .lines()
            .find(|l| l.starts_with("| `abada_agent_tasks_ended_total`"))
            .expect("docs/OPERATIONS.md documents abada_agent_tasks_ended_total");
        let documented: Vec<&str> = row
            .split('`')
            .skip(5) // up to and past the metric name and the `outcome` label name
            .step_by(2)
            .collect();
        let ours: Vec<&str> = TaskEnd::ALL.iter().map(|e| e.as_str()).collect();
        assert_eq!(documented, ours);
    }

    fn task_with_retries(retries: Option<i32>) -> Task {
        Task {
            id: "t-1".into(),
            topic: "abada:agent".into(),
            variables: Map::new(),
            process_instance_id: None,
            activity_id: None,
            retries,
            lock_expiration_time: None,
            trace_parent: None,
            attempt: None,
            agent: None,
        }
    }

    /// `retries` is the engine's, so outside input: `i32::MIN - 1` wrapped to `i32::MAX`
    /// (endless retries) in a release build and panicked in a debug one, so a consumed retry is
    /// computed from a clamped value. A release or deferral computes nothing and sends the
    /// engine's value back as it came: clamped, `-1` went back as `0`, an incident.
    #[test]
    fn retries_from_the_engine_are_clamped_before_any_arithmetic() {
        let cases = [
            (None, 3, 2),
            (Some(3), 3, 2),
            (Some(1), 1, 0),
            (Some(0), 0, 0),
            (Some(-1), -1, 0),
            (Some(i32::MIN), i32::MIN, 0),
            (Some(i32::MIN + 1), i32::MIN + 1, 0),
            (Some(MAX_RETRIES), MAX_RETRIES, MAX_RETRIES - 1),
            (Some(MAX_RETRIES + 1), MAX_RETRIES + 1, MAX_RETRIES - 1),
            (Some(i32::MAX), i32::MAX, MAX_RETRIES - 1),
        ];
        for (retries, unchanged, consumed) in cases {
            let task = task_with_retries(retries);
            assert_eq!(retries_unchanged(&task), unchanged, "{retries:?}");
            assert_eq!(retries_consumed(&task), consumed, "{retries:?}");
            assert_eq!(
                Outcome::released(&task, "stop"),
                Outcome::Failure {
                    kind: FailureKind::Released,
                    report: FailureReport {
                        error_message: "stop".into(),
                        error_details: String::new(),
                        retries: unchanged,
                        retry_timeout: Duration::ZERO,
                    },
                },
                "{retries:?}"
            );
        }
    }

    #[test]
    fn only_reported_endings_count_as_reported() {
        let silent: Vec<TaskEnd> = TaskEnd::ALL.into_iter().filter(|e| !e.reported()).collect();
        assert_eq!(silent, [TaskEnd::LeaseLost, TaskEnd::ReportFailed]);
        assert_eq!(Outcome::Abandoned.end(), TaskEnd::LeaseLost);
        assert_eq!(FailureKind::Technical.end(), TaskEnd::Failed);
    }

    #[test]
    fn a_lost_lease_ends_the_task_silently_and_other_errors_as_the_caller_says() {
        let lost: TaskError = TaskError::LeaseLost(LeaseLostReason::StaleAttempt);
        assert_eq!(
            lost.into_outcome(|_| unreachable!("a lost lease is not an engine error")),
            Outcome::Abandoned
        );
        let down = TaskError::Engine(EngineError::Transient {
            op: "journal-append",
            message: "connection refused".into(),
            request_sent: false,
        });
        let ended = down.into_outcome(|e| Outcome::Failure {
            kind: FailureKind::Technical,
            report: FailureReport {
                error_message: e.to_string(),
                error_details: String::new(),
                retries: 2,
                retry_timeout: Duration::from_secs(10),
            },
        });
        assert_eq!(ended.end(), TaskEnd::Failed);
    }
}
