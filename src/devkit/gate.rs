//! The one engine decorator of the devkit: [`GatedEngine`] runs a [`Gate`]'s
//! [`before`](Gate::before) hook ahead of every call a worker makes to the engine, then forwards
//! the call unchanged. The hook sees the operation and the task, and may record the call or hold
//! it (await) for as long as it likes: a process frozen by the OS, a test stopping a worker at an
//! exact step. The takeover demo's freeze ([`super::freeze`]) and the tests' controlled engines
//! are gates.
//!
//! It needs the worker's [`Engine`] trait, so it lives on the worker's devkit side; production
//! has no use for it (the composition root takes any engine wrapper through
//! [`crate::app::Seams::engine`]).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};

use crate::app::EngineWrapper;
use crate::engine::{
    AnonymousAccess, AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport,
    FetchRequest, HistoryPage, Journal, JournalStep, OP_PROCESS_DEFINITION, OP_PROCESS_HISTORY,
    OP_PROCESS_INSTANCE, ProbeOutcome, ProcessDefinition, ProcessInstance, Task, TaskRef,
    ToolCredential,
};

/// One engine call as a gate sees it, with what a gate may decide on.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    FetchAndLock(&'a FetchRequest),
    Heartbeat,
    Complete,
    Failure,
    BpmnError,
    JournalRead,
    JournalAppend(&'a JournalStep),
    ToolCredentials {
        server: &'a str,
    },
    /// The reachability probe of the poll loop's backoff ([`Engine::probe`]).
    Probe,
    /// A read of the process API for an agent defined in the BPMN: the instance
    /// ([`Engine::process_instance`]) or the definition ([`Engine::process_definition`]); or
    /// of an instance's activity history ([`Engine::process_history`], and its
    /// [`Engine::anonymous_history_read`]), `id` the instance.
    ProcessRead {
        op: &'static str,
        id: &'a str,
    },
}

impl Op<'_> {
    /// The operation's name, as in the engine metrics: `fetch-and-lock`, `journal-append`, ...
    pub fn name(&self) -> &'static str {
        match self {
            Op::FetchAndLock(_) => "fetch-and-lock",
            Op::Heartbeat => "heartbeat",
            Op::Complete => "complete",
            Op::Failure => "failure",
            Op::BpmnError => "bpmn-error",
            Op::JournalRead => "journal-read",
            Op::JournalAppend(_) => "journal-append",
            Op::ToolCredentials { .. } => "tool-credentials",
            Op::Probe => "probe",
            Op::ProcessRead { op, .. } => op,
        }
    }

    /// The journal step an append carries.
    pub fn step(&self) -> Option<&JournalStep> {
        match self {
            Op::JournalAppend(step) => Some(step),
            _ => None,
        }
    }
}

/// Decides about each engine call before it is sent.
#[async_trait]
pub trait Gate: Send + Sync + 'static {
    /// Runs before `op` is sent about `task` (`None` for a fetch or a probe); the call waits
    /// until it returns.
    async fn before(&self, op: Op<'_>, task: Option<&TaskRef>);
}

/// An engine whose every call passes a [`Gate`] first.
pub struct GatedEngine<G: ?Sized> {
    inner: Arc<dyn Engine>,
    gate: Arc<G>,
}

impl<G: Gate + ?Sized> GatedEngine<G> {
    pub(crate) fn wrap(inner: Arc<dyn Engine>, gate: Arc<G>) -> Arc<dyn Engine> {
        Arc::new(GatedEngine { inner, gate })
    }

    /// The wrapper that puts a worker's engine client behind `gate`, for
    /// [`crate::app::Seams::engine`].
    pub fn wrapper(gate: Arc<G>) -> EngineWrapper {
        Box::new(move |inner| GatedEngine::wrap(inner, gate))
    }
}

#[async_trait]
impl<G: Gate + ?Sized> Engine for GatedEngine<G> {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        self.gate.before(Op::FetchAndLock(request), None).await;
        self.inner.fetch_and_lock(request).await
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        self.gate.before(Op::Heartbeat, Some(task)).await;
        self.inner.heartbeat(task, lock_duration).await
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        self.gate.before(Op::Complete, Some(task)).await;
        self.inner.complete(task, variables).await
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        self.gate.before(Op::Failure, Some(task)).await;
        self.inner.failure(task, report).await
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        self.gate.before(Op::BpmnError, Some(task)).await;
        self.inner.bpmn_error(task, report).await
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        self.gate.before(Op::JournalRead, Some(task)).await;
        self.inner.read_journal(task).await
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        self.gate.before(Op::JournalAppend(step), Some(task)).await;
        self.inner.append_journal(task, step).await
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        self.gate
            .before(Op::ToolCredentials { server }, Some(task))
            .await;
        self.inner.tool_credential(task, server).await
    }

    async fn process_instance(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<ProcessInstance, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_INSTANCE,
            id: instance_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.process_instance(task, instance_id).await
    }

    async fn process_definition(
        &self,
        task: &TaskRef,
        definition_id: &str,
    ) -> Result<ProcessDefinition, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_DEFINITION,
            id: definition_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.process_definition(task, definition_id).await
    }

    async fn process_history(
        &self,
        task: &TaskRef,
        instance_id: &str,
        page: u32,
    ) -> Result<HistoryPage, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_HISTORY,
            id: instance_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.process_history(task, instance_id, page).await
    }

    async fn anonymous_history_read(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<AnonymousAccess, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_HISTORY,
            id: instance_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.anonymous_history_read(task, instance_id).await
    }

    async fn probe(&self) -> ProbeOutcome {
        self.gate.before(Op::Probe, None).await;
        self.inner.probe().await
    }
}
