//! Typed engine errors: one variant per row of protocol.md A.2 (and B.2), so callers act on the
//! variant, never on a status code or a raw transport error.

use std::time::Duration;

/// Why the engine says a lease is no longer ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseLostReason {
    /// 403 `WORKER_LOCK_NOT_OWNED`: another worker holds the lease now.
    NotOwned,
    /// 409 `WORKER_LOCK_EXPIRED`: our lease ran out.
    Expired,
    /// 409 `STALE_ATTEMPT`: a newer attempt of the task exists.
    StaleAttempt,
    /// 400 `ENGINE_COMMAND_REJECTED` "External task is not locked" / "not found".
    NotLocked,
    /// 409 `JOURNAL_CONFLICT`: the journal moved on without us.
    JournalConflict,
    /// No extension accepted for a whole lock duration by our own clock.
    LocalExpiry,
    /// The same task was fetched again with a newer attempt while this one still ran here.
    Superseded,
    /// The run store refused an append: another attempt claimed the task's run (the store's
    /// `STALE_ATTEMPT`, for engines without agent/1).
    RunStoreFenced,
}

impl LeaseLostReason {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseLostReason::NotOwned => "WORKER_LOCK_NOT_OWNED",
            LeaseLostReason::Expired => "WORKER_LOCK_EXPIRED",
            LeaseLostReason::StaleAttempt => "STALE_ATTEMPT",
            LeaseLostReason::NotLocked => "NOT_LOCKED",
            LeaseLostReason::JournalConflict => "JOURNAL_CONFLICT",
            LeaseLostReason::LocalExpiry => "LOCAL_EXPIRY",
            LeaseLostReason::Superseded => "SUPERSEDED",
            LeaseLostReason::RunStoreFenced => "RUN_STORE_FENCED",
        }
    }
}

impl std::fmt::Display for LeaseLostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine call that did not succeed. `op` is the operation name (`fetch-and-lock`,
/// `heartbeat`, ...).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "engine refused {op} for task {task_id}: the lease is no longer ours ({reason}); the task stops and reports nothing"
    )]
    LeaseLost {
        op: &'static str,
        task_id: String,
        reason: LeaseLostReason,
    },
    #[error(
        "engine answered {op} with 409 CONCURRENT_MODIFICATION: the task changed during the command"
    )]
    ConcurrentModification { op: &'static str },
    #[error(
        "engine answered {op} with 400 IDEMPOTENCY_CONFLICT for key {key}: the key was reused for a different body (a worker bug)"
    )]
    IdempotencyConflict { op: &'static str, key: String },
    #[error(
        "engine answered {op} with 401 AUTHENTICATION_REQUIRED: {message}; check the OIDC settings (ABADA_AGENT_OIDC_*)"
    )]
    Unauthenticated { op: &'static str, message: String },
    #[error(
        "engine answered {op} with 403 ACCESS_DENIED: {message}; the worker's identity needs the {} scope (OIDC), or that permission from the authenticating proxy",
        required_scope(op)
    )]
    AccessDenied { op: &'static str, message: String },
    #[error("engine answered {op} with 400 INVALID_REQUEST: {message} (a worker bug)")]
    InvalidRequest { op: &'static str, message: String },
    #[error("engine has no {op} endpoint (404 {code}): {message}")]
    NotFound {
        op: &'static str,
        code: String,
        message: String,
    },
    #[error("engine asked to slow down on {op} ({status}){}", retry_after.map(|d| format!(", retry after {} ms", d.as_millis())).unwrap_or_default())]
    Throttled {
        op: &'static str,
        status: u16,
        retry_after: Option<Duration>,
    },
    #[error("engine call {op} failed transiently: {message}; it is retried with backoff")]
    Transient {
        op: &'static str,
        message: String,
        /// False when the request never reached the engine (connection refused): retrying it
        /// cannot recover a lost response.
        request_sent: bool,
    },
    #[error(
        "engine answered {op} without the header X-Abada-Worker-Protocol-Version: 1 (got {got:?}); the response is not processed: point ABADA_AGENT_ENGINE_URL at an Abada engine speaking protocol v1"
    )]
    UnsupportedProtocolVersion {
        op: &'static str,
        got: Option<String>,
    },
    /// An answer larger than the worker reads (`body.rs` limits): not read past the limit.
    /// Retrying cannot shrink it: the task it is about becomes an incident.
    #[error("engine answered {op}: {too_large}")]
    TooLarge {
        op: &'static str,
        too_large: crate::body::TooLarge,
    },
    #[error("engine answered {op} with a body the worker cannot read: {detail}")]
    MalformedResponse { op: &'static str, detail: String },
    #[error("engine rejected {op} with {status} {code}: {message}")]
    Rejected {
        op: &'static str,
        status: u16,
        code: String,
        message: String,
    },
    #[error("cannot obtain an access token for the engine: {message}")]
    Auth {
        message: String,
        configuration: bool,
    },
}

/// The scope (or, behind a proxy, the permission) the engine asks of the worker for `op`: the
/// external-task API needs `worker:execute`, the process API that serves BPMN definitions
/// `process:read`.
pub(crate) fn required_scope(op: &str) -> &'static str {
    match op {
        super::OP_PROCESS_INSTANCE | super::OP_PROCESS_DEFINITION => "process:read",
        _ => "worker:execute",
    }
}

impl EngineError {
    /// The lease is gone: stop the task and report nothing.
    pub fn lease_lost(&self) -> Option<LeaseLostReason> {
        match self {
            EngineError::LeaseLost { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// Worth retrying the same command with the same idempotency key.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            EngineError::Transient { .. } | EngineError::Throttled { .. }
        ) || matches!(
            self,
            EngineError::Auth {
                configuration: false,
                ..
            }
        )
    }

    /// The engine answered and refused the command for good: a rule of the process or the
    /// instance (400 `ENGINE_COMMAND_REJECTED` other than a lost lease, e.g. "Process instance
    /// is suspended"), a request it cannot read, or a key conflict. Sending the same command
    /// again cannot succeed; a lost lease, throttling, 5xx and transport errors are not this.
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(
            self,
            EngineError::Rejected { .. }
                | EngineError::InvalidRequest { .. }
                | EngineError::IdempotencyConflict { .. }
        )
    }

    /// Says the engine is unreachable or refuses us as a whole (for readiness).
    pub(crate) fn is_engine_down(&self) -> bool {
        matches!(
            self,
            EngineError::Transient { .. }
                | EngineError::Throttled { .. }
                | EngineError::Unauthenticated { .. }
                | EngineError::AccessDenied { .. }
                | EngineError::Auth { .. }
                | EngineError::UnsupportedProtocolVersion { .. }
        )
    }
}
