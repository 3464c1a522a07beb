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
//! | `GET /api/v1/process-instances/{id}/history?page=&size=` | | 200 a page of [`HistoryEntry`]s with `X-Page`, `X-Page-Size`, `X-Total-Count`, `X-Total-Pages`; 400 "size must be between 1 and 100"; 404 "Process instance not found: X" |
//!
//! The caller is who the security mode says ([`super::Authorizer::identity`]): without an
//! authorizer (the engine's `disabled` mode) `X-User` (else `anonymous`, who sees nothing) with
//! the groups of `X-Groups` (comma-separated); behind the `proxy` mode's authorizer the proxy's
//! identity headers, and then the user-task routes need `task:read` / `task:write` or a
//! task-user group, and the history `operations:read` or an operator group (the engine's
//! `SecurityConfig`). These routes are not worker protocol: no faults. The two reads a worker
//! makes for agents defined in the BPMN (an instance, a definition) and its history reads are
//! in the call log ([`Operation::ProcessInstanceRead`], [`Operation::ProcessDefinitionRead`],
//! [`Operation::ProcessHistoryRead`]), so tests count them.

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
use super::history::{DEFAULT_PAGE_SIZE, HistoryEntry, MAX_PAGE_SIZE};
use super::process::UserTaskStatus;
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
        .route("/api/v1/process-instances/{id}/history", get(history))
}

type Params = Query<HashMap<String, String>>;

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

async fn start(
    State(shared): State<Arc<Shared>>,
    params: Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    const PATH: &str = "/api/v1/processes/start";
    let actor = shared.caller(&headers).user;
    let now = shared.clock.now_ms();
    let result = required(&params, "processId").and_then(|process_id| {
        let variables = variables(&body)?;
        shared
            .state()
            .start_process(process_id, variables, &actor, now)
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

/// The user-task API's rule in a secured mode ([`super::Authorizer::authorize_user_tasks`]).
fn tasks_denied(shared: &Shared, headers: &HeaderMap, write: bool, path: &str) -> Option<Response> {
    let rejection = shared
        .authorizer
        .as_ref()?
        .authorize_user_tasks(headers, write)
        .err()?;
    Some(error(shared, super::auth_error(rejection), path))
}

async fn list(State(shared): State<Arc<Shared>>, params: Params, headers: HeaderMap) -> Response {
    if let Some(denied) = tasks_denied(&shared, &headers, false, "/api/v1/tasks") {
        return denied;
    }
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
    axum::Json(shared.state().user_tasks(&shared.caller(&headers), status)).into_response()
}

async fn one(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = tasks_denied(&shared, &headers, false, "/api/v1/tasks") {
        return denied;
    }
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
    if let Some(denied) = tasks_denied(&shared, &headers, true, PATH) {
        return denied;
    }
    let now = shared.clock.now_ms();
    let result = required(&params, "taskId").and_then(|id| {
        shared
            .state()
            .claim_user_task(id, &shared.caller(&headers), now)
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
    if let Some(denied) = tasks_denied(&shared, &headers, true, PATH) {
        return denied;
    }
    let now = shared.clock.now_ms();
    let result = required(&params, "taskId").and_then(|id| {
        let variables = variables(&body)?;
        shared
            .state()
            .complete_user_task(id, &shared.caller(&headers), variables, now)
            .map(|()| id.to_string())
            .map_err(ApiError::rejected)
    });
    shared.changed.notify_waiters();
    match result {
        Ok(id) => axum::Json(json!({"status": "Completed", "taskId": id})).into_response(),
        Err(e) => error(&shared, e, PATH),
    }
}

/// `GET /api/v1/process-instances/{id}/history` (`CockpitController.getHistory`): the
/// authorizer's operations rule, the engine's paging checks (`Pagination.request`: `page` at
/// least 0, `size` 1..=100, else 400 with its message), 404 for an unknown instance.
async fn history(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    params: Params,
    headers: HeaderMap,
) -> Response {
    let path = format!("/api/v1/process-instances/{id}/history");
    let refused = |e: ApiError| {
        record_read(&shared, Operation::ProcessHistoryRead, &headers, Some(&e));
        error(&shared, e, &path)
    };
    if let Some(Err(rejection)) = shared
        .authorizer
        .as_ref()
        .map(|a| a.authorize_operations_read(&headers))
    {
        return refused(super::auth_error(rejection));
    }
    let number = |name: &str, default: usize| -> Result<i64, ApiError> {
        match params.get(name) {
            None => Ok(default as i64),
            Some(raw) => raw.trim().parse::<i64>().map_err(|_| ApiError::malformed()),
        }
    };
    let (page, size) = match (number("page", 0), number("size", DEFAULT_PAGE_SIZE)) {
        (Ok(page), Ok(size)) => (page, size),
        (Err(e), _) | (_, Err(e)) => return refused(e),
    };
    if page < 0 {
        return refused(ApiError::rejected(
            "page must be greater than or equal to 0",
        ));
    }
    if !(1..=MAX_PAGE_SIZE as i64).contains(&size) {
        return refused(ApiError::rejected(format!(
            "size must be between 1 and {MAX_PAGE_SIZE}"
        )));
    }
    let found = shared
        .state()
        .history_page(&id, page as usize, size as usize);
    let Some(found) = found else {
        return refused(ApiError::new(
            StatusCode::NOT_FOUND,
            wire::code::RESOURCE_NOT_FOUND,
            format!("Process instance not found: {id}"),
        ));
    };
    record_read(&shared, Operation::ProcessHistoryRead, &headers, None);
    let entries: Vec<HistoryEntry> = found.entries;
    let mut response = axum::Json(entries).into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        ("x-page", page.to_string()),
        ("x-page-size", size.to_string()),
        ("x-total-count", found.total_count.to_string()),
        ("x-total-pages", found.total_pages.to_string()),
    ] {
        if let Ok(value) = axum::http::HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    response
}
