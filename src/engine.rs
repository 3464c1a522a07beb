//! The engine boundary: the one narrow trait through which the worker talks to the Abada engine,
//! the domain types it speaks in, and the typed errors callers act on (protocol.md Part A and B).
//!
//! `client` is the HTTP implementation; tests and the devkit may plug in others.

pub mod capabilities;
pub mod client;
pub mod error;
pub mod headers;
pub mod wire;

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};

/// W3C trace context lives with the telemetry (`telemetry::trace`); the engine carries it.
pub use crate::telemetry::trace::{self, TraceParent};
pub use error::{EngineError, LeaseLostReason};

/// A task the engine locked for this worker, mapped from the wire at the edge.
#[derive(Clone, Debug)]
pub struct Task {
    pub id: String,
    pub topic: String,
    pub variables: Map<String, Value>,
    pub process_instance_id: Option<String>,
    pub activity_id: Option<String>,
    /// Retries left as the engine counts them; `None` when the engine sent null.
    pub retries: Option<i32>,
    pub lock_expiration_time: Option<String>,
    pub trace_parent: Option<TraceParent>,
    /// agent/1 fencing token; `None` on a plain v1 engine.
    pub attempt: Option<u32>,
    /// The agent definition as the engine sent it (parsed by the agent module).
    pub agent: Option<Value>,
}

impl Task {
    /// The identity every call about this task carries.
    pub fn task_ref(&self) -> TaskRef {
        TaskRef {
            task_id: self.id.clone(),
            attempt: self.attempt,
            trace_parent: self.trace_parent.clone(),
        }
    }
}

/// Which task (and which attempt of it) a call is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRef {
    pub task_id: String,
    pub attempt: Option<u32>,
    pub trace_parent: Option<TraceParent>,
}

/// A fetch-and-lock request.
#[derive(Clone, Debug)]
pub struct FetchRequest {
    pub topics: Vec<String>,
    pub lock_duration: Duration,
    pub max_tasks: u32,
}

/// A technical failure report (`/failure`).
#[derive(Clone, Debug, PartialEq)]
pub struct FailureReport {
    pub error_message: String,
    pub error_details: String,
    pub retries: i32,
    pub retry_timeout: Duration,
}

/// A business error report (`/bpmn-error`).
#[derive(Clone, Debug, PartialEq)]
pub struct BpmnErrorReport {
    pub error_code: String,
    pub error_message: String,
    pub variables: Map<String, Value>,
}

/// A journal step (protocol.md B.2), kept close to the wire because the journal is a contract
/// read by other programs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JournalStep {
    pub seq: u64,
    pub kind: String,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default)]
    pub data: Value,
}

/// The journal as read at the start of an attempt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Journal {
    pub attempt: Option<u32>,
    pub steps: Vec<JournalStep>,
}

/// Whether an append wrote a new step or found the identical one already there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendOutcome {
    Created,
    AlreadyPresent,
}

/// A short-lived tool-server secret (protocol.md B.3).
#[derive(Clone, Debug)]
pub struct ToolCredential {
    pub token: crate::secret::Secret,
    pub expires_at: Option<String>,
}

/// The operation names of the process API's two reads (metrics, spans, errors).
pub(crate) const OP_PROCESS_INSTANCE: &str = "process-instance";
pub(crate) const OP_PROCESS_DEFINITION: &str = "process-definition";

/// A process instance, as far as the worker reads it (`GET /v1/processes/instances/{id}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInstance {
    pub id: String,
    /// The definition the instance runs: on Abada 0.11 the process key (`refundProcess`), not a
    /// versioned id (protocol.md Part D, "Process definitions").
    pub process_definition_id: String,
}

/// A deployed process definition (`GET /v1/processes/{id}`): the latest version of the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessDefinition {
    pub id: String,
    /// The deployment's version of the key; `None` when the engine sent none.
    pub version: Option<i64>,
    /// The BPMN 2.0 XML as deployed, extension elements kept.
    pub bpmn_xml: String,
}

/// The operation name of the activity-history read (metrics, spans, errors).
pub(crate) const OP_PROCESS_HISTORY: &str = "process-history";
/// Entries per page of an activity-history read: the engine's largest page
/// (`Pagination.MAX_PAGE_SIZE`).
pub(crate) const HISTORY_PAGE_SIZE: u32 = 100;

/// One entry of a process instance's activity history (`GET
/// /v1/process-instances/{id}/history`, the engine's `ActivityHistoryDto`), as far as the
/// worker reads it. The engine writes one per event it records (`ActivityHistoryService`):
/// the `actor` is the caller's identity as its security mode establishes it (`system` when
/// there is no request, `anonymous` when a request names nobody).
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryEvent {
    /// `TASK_COMPLETED`, `EXTERNAL_TASK_COMPLETED`, `VARIABLES_UPDATED`, ...
    pub event_type: String,
    pub actor: String,
    pub activity_id: Option<String>,
    pub details: Map<String, Value>,
}

/// One page of an instance's activity history, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryPage {
    pub events: Vec<HistoryEvent>,
    /// The engine's `X-Total-Pages`; `None` when it sent none.
    pub total_pages: Option<u32>,
}

/// Whether the engine answered a read of an instance's history made with no identity at all
/// (see [`Engine::anonymous_history_read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnonymousAccess {
    /// 401 or 403: the engine checks who calls; the actors it records are its own word.
    Refused,
    /// It answered (the history, or 404 about the instance): its security is off, and every
    /// actor it records is whatever a caller claimed (`X-User`).
    Answered,
}

/// What a cheap reachability probe of the engine found (see [`Engine::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The engine answered (any HTTP status): fetching is worth trying again.
    Reachable,
    /// No answer (connection refused, reset, timed out).
    Unreachable,
    /// This engine cannot be probed; the caller falls back to its plain backoff.
    NotSupported,
}

/// Everything the worker asks of the engine. Implementations carry the worker id, the
/// authentication and the retry rules of protocol.md A.2/A.3; callers see typed errors.
#[async_trait]
pub trait Engine: Send + Sync + 'static {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError>;
    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError>;
    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError>;
    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError>;
    async fn bpmn_error(&self, task: &TaskRef, report: &BpmnErrorReport)
    -> Result<(), EngineError>;
    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError>;
    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError>;
    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError>;

    /// `GET /v1/processes/instances/{id}` (needs `process:read`): which definition an instance
    /// runs. The default is an engine without a process API (404).
    async fn process_instance(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<ProcessInstance, EngineError> {
        let _ = (task, instance_id);
        Err(EngineError::NotFound {
            op: OP_PROCESS_INSTANCE,
            code: String::new(),
            message: "this engine serves no process API".into(),
        })
    }

    /// `GET /v1/processes/{id}` (needs `process:read`): the latest deployed version of a
    /// definition, with its BPMN XML. `task` is the task the read is for (trace context only).
    async fn process_definition(
        &self,
        task: &TaskRef,
        definition_id: &str,
    ) -> Result<ProcessDefinition, EngineError> {
        let _ = (task, definition_id);
        Err(EngineError::NotFound {
            op: OP_PROCESS_DEFINITION,
            code: String::new(),
            message: "this engine serves no process API".into(),
        })
    }

    /// `GET /v1/process-instances/{id}/history?page=&size=` (needs `operations:read`): one
    /// page of the instance's activity history, oldest first, [`HISTORY_PAGE_SIZE`] entries.
    /// The default is an engine without it (404).
    async fn process_history(
        &self,
        task: &TaskRef,
        instance_id: &str,
        page: u32,
    ) -> Result<HistoryPage, EngineError> {
        let _ = (task, instance_id, page);
        Err(EngineError::NotFound {
            op: OP_PROCESS_HISTORY,
            code: String::new(),
            message: "this engine serves no activity history".into(),
        })
    }

    /// The same read of one entry sent with no credential and none of the operator's headers:
    /// whether the engine's security is on, so that the actors it records are its own word and
    /// not a caller's claim. The default is an engine without it (404).
    async fn anonymous_history_read(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<AnonymousAccess, EngineError> {
        let _ = (task, instance_id);
        Err(EngineError::NotFound {
            op: OP_PROCESS_HISTORY,
            code: String::new(),
            message: "this engine serves no activity history".into(),
        })
    }

    /// A cheap check that the engine answers at all, without fetching or locking anything.
    /// The poll loop probes once per poll interval while it backs off after the engine went
    /// away, so it fetches again within one poll interval of the engine's return while keeping
    /// its fetch attempts during an outage few. The default cannot probe.
    async fn probe(&self) -> ProbeOutcome {
        ProbeOutcome::NotSupported
    }
}
