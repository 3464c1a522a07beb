//! The task handler seam: what the runner asks of whoever runs a task (the agent runtime, or a
//! test double), the context a running task gets, and the outcomes it can end in.
//!
//! The runner owns reporting: a handler returns an [`Outcome`], and the runner turns it into
//! exactly one engine call, unless the lease was lost, in which case nothing is reported.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, Journal, JournalStep, Task,
    TaskRef, ToolCredential,
};
use crate::lease::Lease;

/// Why a task ends in `failure`, which decides its `retries` and `retryTimeout`
/// (protocol.md B.5) and its metric label.
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
    pub fn label(self) -> &'static str {
        match self {
            FailureKind::Technical => "failed",
            FailureKind::Deferred => "deferred",
            FailureKind::Incident => "incident",
            FailureKind::Released => "released",
        }
    }
}

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
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Complete { .. } => "completed",
            Outcome::BpmnError(_) => "bpmn_error",
            Outcome::Failure { kind, .. } => kind.label(),
            Outcome::Abandoned => "lease_lost",
        }
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

/// The task's own `retries`, for failures that must not consume one (3 when the engine sent null).
pub fn retries_unchanged(task: &Task) -> i32 {
    task.retries.unwrap_or(DEFAULT_RETRIES).max(0)
}

/// `retries - 1`, for a technical failure (protocol.md B.5: 3 when the engine sent null).
pub fn retries_consumed(task: &Task) -> i32 {
    (task.retries.unwrap_or(DEFAULT_RETRIES) - 1).max(0)
}

pub const DEFAULT_RETRIES: i32 = 3;

/// Runs one task. Implementations must return promptly once `ctx.lease().is_lost()` or
/// `ctx.stop_requested()`; the runner also drops them at their next await when the lease is lost.
#[async_trait]
pub trait TaskHandler: Send + Sync + 'static {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome;
}

/// What a running task may use: its lease, the stop signal, and engine calls about itself that
/// are fenced by the lease (never made once it is lost, and a refusal marks it lost).
#[derive(Clone)]
pub struct TaskContext {
    engine: Arc<dyn Engine>,
    lease: Lease,
    stop: CancellationToken,
}

impl TaskContext {
    pub fn new(engine: Arc<dyn Engine>, lease: Lease, stop: CancellationToken) -> Self {
        TaskContext {
            engine,
            lease,
            stop,
        }
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    pub fn task_ref(&self) -> &TaskRef {
        self.lease.task()
    }

    /// The shutdown grace period is over: wrap up at the next step boundary and return
    /// [`Outcome::released`].
    pub fn stop_requested(&self) -> bool {
        self.stop.is_cancelled()
    }

    pub async fn stopped(&self) {
        self.stop.cancelled().await
    }

    /// Runs an engine call about this task: not at all when the lease is lost, abandoned when it
    /// is lost meanwhile, and a refusal marks the lease lost.
    pub async fn fenced<T, F>(&self, call: F) -> Result<T, EngineError>
    where
        F: Future<Output = Result<T, EngineError>>,
    {
        let lost = || EngineError::LeaseLost {
            op: "fenced",
            task_id: self.lease.task().task_id.clone(),
            reason: self
                .lease
                .lost_reason()
                .unwrap_or(crate::engine::LeaseLostReason::Superseded),
        };
        if self.lease.is_lost() {
            return Err(lost());
        }
        let result = tokio::select! {
            biased;
            _ = self.lease.lost() => return Err(lost()),
            r = call => r,
        };
        if let Err(e) = &result
            && let Some(reason) = e.lease_lost()
        {
            self.lease.mark_lost(reason);
        }
        result
    }

    pub async fn read_journal(&self) -> Result<Journal, EngineError> {
        self.fenced(self.engine.read_journal(self.lease.task()))
            .await
    }

    pub async fn append_journal(&self, step: &JournalStep) -> Result<AppendOutcome, EngineError> {
        self.fenced(self.engine.append_journal(self.lease.task(), step))
            .await
    }

    pub async fn tool_credential(&self, server: &str) -> Result<ToolCredential, EngineError> {
        self.fenced(self.engine.tool_credential(self.lease.task(), server))
            .await
    }
}
