//! The emulator's wire edge: request bodies as the engine reads them, the refusal type with the
//! engine's status codes, error codes and messages, and the error envelope.
//!
//! Request structs mirror the engine's DTOs: every field optional (Jackson reads a missing field
//! as null, or 0 for a primitive `long`), unknown fields ignored.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The protocol header every worker-protocol response carries.
pub(crate) const PROTOCOL_HEADER: &str = "x-abada-worker-protocol-version";

/// Stable error codes of API v1 plus the agent/1 additions.
pub(crate) mod code {
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
    pub const ENGINE_COMMAND_REJECTED: &str = "ENGINE_COMMAND_REJECTED";
    pub const RESOURCE_NOT_FOUND: &str = "RESOURCE_NOT_FOUND";
    pub const CONCURRENT_MODIFICATION: &str = "CONCURRENT_MODIFICATION";
    pub const AUTHENTICATION_REQUIRED: &str = "AUTHENTICATION_REQUIRED";
    pub const ACCESS_DENIED: &str = "ACCESS_DENIED";
    pub const IDEMPOTENCY_CONFLICT: &str = "IDEMPOTENCY_CONFLICT";
    pub const WORKER_LOCK_NOT_OWNED: &str = "WORKER_LOCK_NOT_OWNED";
    pub const WORKER_LOCK_EXPIRED: &str = "WORKER_LOCK_EXPIRED";
    pub const INTERNAL_ERROR: &str = "INTERNAL_ERROR";
    pub const STALE_ATTEMPT: &str = "STALE_ATTEMPT";
    pub const JOURNAL_CONFLICT: &str = "JOURNAL_CONFLICT";
}

/// A refusal: what the engine answers instead of executing a command.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Omitted from the body when `None` (the engine drops empty fields).
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: None,
        }
    }

    /// A business rule the engine rejects (its `ProcessEngineException` without a special phrase).
    pub fn rejected(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            code::ENGINE_COMMAND_REJECTED,
            message,
        )
    }

    /// A body the engine cannot read (malformed JSON, wrong types).
    pub fn malformed() -> Self {
        ApiError {
            details: Some(serde_json::json!({"reason": "Malformed or invalid request body"})),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                code::INVALID_REQUEST,
                "Request validation failed",
            )
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST, message)
    }

    pub fn not_found_resource() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            code::RESOURCE_NOT_FOUND,
            "API resource not found",
        )
    }

    pub fn task_not_found(id: &str) -> Self {
        Self::rejected(format!("External task not found: {id}"))
    }

    pub fn not_locked(id: &str) -> Self {
        Self::rejected(format!("External task is not locked: {id}"))
    }

    pub fn lock_expired(id: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            code::WORKER_LOCK_EXPIRED,
            format!("External task lock has expired: {id}"),
        )
    }

    pub fn not_owned(id: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            code::WORKER_LOCK_NOT_OWNED,
            format!("Worker does not own external task lock: {id}"),
        )
    }

    pub fn stale_attempt(current: u32) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            code::STALE_ATTEMPT,
            format!("The task is on attempt {current}"),
        )
    }

    pub fn idempotency_conflict() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            code::IDEMPOTENCY_CONFLICT,
            "Idempotency-Key was already used for a different request",
        )
    }

    pub fn concurrent_modification() -> Self {
        Self::new(
            StatusCode::CONFLICT,
            code::CONCURRENT_MODIFICATION,
            "Runtime state changed concurrently; reload it before retrying",
        )
    }

    pub fn internal(status: StatusCode) -> Self {
        Self::new(
            status,
            code::INTERNAL_ERROR,
            "The engine could not complete the request",
        )
    }

    /// The error envelope `{"timestamp","status","code","message","path","traceId","details"}`.
    pub fn body(&self, timestamp: &str, path: &str, trace_id: &str) -> Value {
        let mut body = serde_json::json!({
            "timestamp": timestamp,
            "status": self.status.as_u16(),
            "code": self.code,
            "message": self.message,
            "path": path,
            "traceId": trace_id,
        });
        if let (Some(details), Value::Object(map)) = (&self.details, &mut body) {
            map.insert("details".into(), details.clone());
        }
        body
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FetchAndLockRequest {
    pub worker_id: Option<String>,
    pub topics: Option<Vec<String>>,
    /// A primitive `long` in the engine: missing or null reads as 0.
    pub lock_duration: Option<i64>,
    /// Missing means 1.
    pub max_tasks: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExtendLockRequest {
    pub worker_id: Option<String>,
    pub lock_duration: Option<i64>,
    pub attempt: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CompleteRequest {
    pub worker_id: Option<String>,
    pub variables: Option<Map<String, Value>>,
    pub attempt: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FailureRequest {
    pub worker_id: Option<String>,
    pub error_message: Option<String>,
    pub error_details: Option<String>,
    pub retries: Option<i32>,
    pub retry_timeout: Option<i64>,
    pub attempt: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BpmnErrorRequest {
    pub worker_id: Option<String>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub variables: Option<Map<String, Value>>,
    pub attempt: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JournalReadRequest {
    pub worker_id: Option<String>,
    pub attempt: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JournalAppendRequest {
    pub worker_id: Option<String>,
    pub attempt: Option<i64>,
    pub step: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ToolCredentialsRequest {
    pub worker_id: Option<String>,
    pub attempt: Option<i64>,
    pub server: Option<String>,
}

/// One parsed request of the worker protocol.
#[derive(Debug, Clone)]
pub(crate) enum Command {
    FetchAndLock(FetchAndLockRequest),
    /// Heartbeat and extend-lock share one command; the operation tells them apart.
    ExtendLock(ExtendLockRequest),
    Complete(CompleteRequest),
    Failure(FailureRequest),
    BpmnError(BpmnErrorRequest),
    JournalRead(JournalReadRequest),
    JournalAppend(JournalAppendRequest),
    ToolCredentials(ToolCredentialsRequest),
}

impl Command {
    /// The request as the engine hashes it for idempotency: the task id and the parsed body,
    /// serialized with sorted keys (serde_json's `Map` is ordered by key), so unknown fields
    /// and field order do not change the hash.
    pub fn canonical(&self, task_id: Option<&str>) -> Value {
        let request = match self {
            Command::FetchAndLock(r) => serde_json::to_value(r),
            Command::ExtendLock(r) => serde_json::to_value(r),
            Command::Complete(r) => serde_json::to_value(r),
            Command::Failure(r) => serde_json::to_value(r),
            Command::BpmnError(r) => serde_json::to_value(r),
            Command::JournalRead(r) => serde_json::to_value(r),
            Command::JournalAppend(r) => serde_json::to_value(r),
            Command::ToolCredentials(r) => serde_json::to_value(r),
        }
        .unwrap_or(Value::Null);
        serde_json::json!({"id": task_id, "request": request})
    }
}

/// Formats emulator time (milliseconds since the Unix epoch) as the engine prints an `Instant`.
pub(crate) fn format_time(millis: i64) -> String {
    chrono::DateTime::from_timestamp_millis(millis)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Formats a lease expiry as the engine's fetch-and-lock prints `lockExpirationTime`: nine
/// fractional digits (the engine's `Instant` has nanoseconds; seen on the real engine 0.11,
/// docs/REAL_ENGINE.md), so clients meet the precision they will meet in production. The
/// emulator's clock counts milliseconds: the last six digits are zeros.
pub(crate) fn format_lease_time(millis: i64) -> String {
    chrono::DateTime::from_timestamp_millis(millis)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

/// Serializes a time as the engine prints it (kept independent of chrono's `serde` feature).
pub(crate) fn serialize_time<S: serde::Serializer>(
    time: &chrono::DateTime<chrono::Utc>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format_time(time.timestamp_millis()))
}

pub(crate) fn serialize_opt_time<S: serde::Serializer>(
    time: &Option<chrono::DateTime<chrono::Utc>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match time {
        Some(time) => serialize_time(time, serializer),
        None => serializer.serialize_none(),
    }
}

/// The trace id for an error body: the incoming `traceparent`'s, else a fresh one (the engine's
/// server span always exists, so its trace id is always present).
pub(crate) fn trace_id(traceparent: Option<&str>) -> String {
    traceparent
        .and_then(|tp| {
            let mut parts = tp.split('-');
            let _version = parts.next()?;
            let id = parts.next()?;
            (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_string())
        })
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}
