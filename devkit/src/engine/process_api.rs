//! The engine's process and user-task API, as far as the approval flow uses it (the real engine
//! 0.11's paths and answers, /work/notes/real-engine.md §3 and §8):
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `POST /api/v1/processes/start?processId=` | the variables (optional) | 200 `{"processInstanceId"}`; 400 "Unknown process ID: X" |
//! | `GET /api/v1/processes/instances/{id}` | | 200 [`ProcessInstanceView`]; 404 "Process instance not found: X" |
//! | `GET /api/v1/processes/{id}` | | 200 [`ProcessDefinitionView`] (the latest version, its `bpmnXml`); 404 "Process definition not found: X" |
//! | `GET /api/v1/tasks[?status=AVAILABLE\|CLAIMED\|COMPLETED]` | | 200 the caller's [`UserTaskView`]s |
//! | `GET /api/v1/tasks/{id}` | | 200 one [`UserTaskView`]; 404 |
//! | `POST /api/v1/tasks/claim?taskId=` | | 200 `{"status":"Claimed","taskId"}`; 400 "User bob is not eligible to claim task X" |
//! | `POST /api/v1/tasks/complete?taskId=` | the variables | 200 `{"status":"Completed","taskId"}`; 400 "Task is already completed." |
//!
//! The caller is `X-User` (else `anonymous`, who sees nothing) with the groups of `X-Groups`
//! (comma-separated), as in the engine's `disabled` security mode. These routes are not worker
//! protocol: no faults, and the authorizer only on the two reads below. The two reads a worker makes for agents defined in the
//! BPMN (an instance, a definition) are in the call log ([`Operation::ProcessInstanceRead`],
//! [`Operation::ProcessDefinitionRead`]), so tests count them.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};

use super::Shared;
use super::process::{Caller, UserTaskStatus};
use super::state::{CallRecord, Disposition, Operation};
use super::wire::{self, ApiError};

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/api/v1/processes/start", post(start))
        .route("/api/v1/processes/instances/{id}", get(instance))
        .route("/api/v1/processes/{id}", get(definition))
        .route("/api/v1/tasks", get(list))
        .route("/api/v1/tasks/claim", post(claim))
        .route("/api/v1/tasks/complete", post(complete))
        .route("/api/v1/tasks/{id}", get(one))
}

type Params = Query<HashMap<String, String>>;

fn caller(headers: &HeaderMap) -> Caller {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    Caller {
        user: header("x-user").unwrap_or("anonymous").to_string(),
        groups: header("x-groups")
            .map(|g| {
                g.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn error(shared: &Shared, error: ApiError, path: &str) -> Response {
    let body = error.body(
        &wire::format_time(shared.clock.now_ms()),
        path,
        &wire::trace_id(None),
    );
    (error.status, axum::Json(body)).into_response()
}

/// The body as a variables map: empty when there is none, 400 when it is not an object.
fn variables(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(ApiError::malformed()),
    }
}

fn required<'a>(params: &'a Params, name: &str) -> Result<&'a str, ApiError> {
    params
        .get(name)
        .map(String::as_str)
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| ApiError::invalid(format!("Required parameter '{name}' is not present.")))
}

async fn start(State(shared): State<Arc<Shared>>, params: Params, body: Bytes) -> Response {
    const PATH: &str = "/api/v1/processes/start";
    let result = required(&params, "processId").and_then(|process_id| {
        let variables = variables(&body)?;
        shared
            .state()
            .start_process(process_id, variables)
            .map_err(ApiError::rejected)
    });
    shared.changed.notify_waiters();
    match result {
        Ok(id) => axum::Json(json!({"processInstanceId": id})).into_response(),
        Err(e) => error(&shared, e, PATH),
    }
}

/// Records a read of the process API in the call log.
fn record_read(
    shared: &Shared,
    operation: Operation,
    headers: &HeaderMap,
    error: Option<&ApiError>,
) {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    shared.record_call(CallRecord {
        at: shared.clock.now(),
        operation,
        task_id: None,
        worker_id: None,
        attempt: None,
        idempotency_key: header("idempotency-key"),
        traceparent: header("traceparent"),
        status: error.map_or(200, |e| e.status.as_u16()),
        error_code: error.map(|e| e.code.to_string()),
        error_message: error.map(|e| e.message.clone()),
        disposition: if error.is_some() {
            Disposition::Refused
        } else {
            Disposition::Executed
        },
        response_dropped: false,
        task_ids: Vec::new(),
    });
}

/// The engine's answer to a caller the secured mode refuses (the authorizer's
/// [`super::Authorizer::authorize_process_read`]), or to every caller when the emulator is told
/// to deny process reads ([`super::EngineEmulator::deny_process_reads`]).
fn denied(shared: &Shared, headers: &HeaderMap, operation: Operation) -> Option<Response> {
    let e = if shared.state().process_reads_denied() {
        ApiError::new(
            StatusCode::FORBIDDEN,
            wire::code::ACCESS_DENIED,
            "Access Denied",
        )
    } else {
        match shared
            .authorizer
            .as_ref()
            .map(|a| a.authorize_process_read(headers))
        {
            Some(Err(rejection)) => super::auth_error(rejection),
            _ => return None,
        }
    };
    record_read(shared, operation, headers, Some(&e));
    Some(error(shared, e, "/api/v1/processes"))
}

async fn instance(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = denied(&shared, &headers, Operation::ProcessInstanceRead) {
        return denied;
    }
    let found = shared.state().process_instance(&id);
    match found {
        Some(view) => {
            record_read(&shared, Operation::ProcessInstanceRead, &headers, None);
            axum::Json(view).into_response()
        }
        None => {
            let e = ApiError::new(
                StatusCode::NOT_FOUND,
                wire::code::RESOURCE_NOT_FOUND,
                format!("Process instance not found: {id}"),
            );
            record_read(&shared, Operation::ProcessInstanceRead, &headers, Some(&e));
            error(&shared, e, &format!("/api/v1/processes/instances/{id}"))
        }
    }
}

async fn definition(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = denied(&shared, &headers, Operation::ProcessDefinitionRead) {
        return denied;
    }
    let found = shared.state().process_definition(&id);
    match found {
        Some(view) => {
            record_read(&shared, Operation::ProcessDefinitionRead, &headers, None);
            axum::Json(view).into_response()
        }
        None => {
            let e = ApiError::new(
                StatusCode::NOT_FOUND,
                wire::code::RESOURCE_NOT_FOUND,
                format!("Process definition not found: {id}"),
            );
            record_read(
                &shared,
                Operation::ProcessDefinitionRead,
                &headers,
                Some(&e),
            );
            error(&shared, e, &format!("/api/v1/processes/{id}"))
        }
    }
}

async fn list(State(shared): State<Arc<Shared>>, params: Params, headers: HeaderMap) -> Response {
    let status = match params.get("status").map(String::as_str) {
        None => None,
        Some("AVAILABLE") => Some(UserTaskStatus::Available),
        Some("CLAIMED") => Some(UserTaskStatus::Claimed),
        Some("COMPLETED") => Some(UserTaskStatus::Completed),
        Some(other) => {
            return error(
                &shared,
                ApiError::invalid(format!("Unknown task status: {other}")),
                "/api/v1/tasks",
            );
        }
    };
    axum::Json(shared.state().user_tasks(&caller(&headers), status)).into_response()
}

async fn one(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    match shared.state().user_task(&id) {
        Some(view) => axum::Json(view).into_response(),
        None => error(
            &shared,
            ApiError::new(
                StatusCode::NOT_FOUND,
                wire::code::RESOURCE_NOT_FOUND,
                format!("Task not found: {id}"),
            ),
            &format!("/api/v1/tasks/{id}"),
        ),
    }
}

async fn claim(State(shared): State<Arc<Shared>>, params: Params, headers: HeaderMap) -> Response {
    const PATH: &str = "/api/v1/tasks/claim";
    let result = required(&params, "taskId").and_then(|id| {
        shared
            .state()
            .claim_user_task(id, &caller(&headers))
            .map(|()| id.to_string())
            .map_err(ApiError::rejected)
    });
    shared.changed.notify_waiters();
    match result {
        Ok(id) => axum::Json(json!({"status": "Claimed", "taskId": id})).into_response(),
        Err(e) => error(&shared, e, PATH),
    }
}

async fn complete(
    State(shared): State<Arc<Shared>>,
    params: Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    const PATH: &str = "/api/v1/tasks/complete";
    let result = required(&params, "taskId").and_then(|id| {
        let variables = variables(&body)?;
        shared
            .state()
            .complete_user_task(id, &caller(&headers), variables)
            .map(|()| id.to_string())
            .map_err(ApiError::rejected)
    });
    shared.changed.notify_waiters();
    match result {
        Ok(id) => axum::Json(json!({"status": "Completed", "taskId": id})).into_response(),
        Err(e) => error(&shared, e, PATH),
    }
}
