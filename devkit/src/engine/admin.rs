//! The `/admin` routes: create and inspect tasks, read the call log, move the clock, inject
//! faults, verify tool credentials. The table of routes is in the `engine` module docs. Never
//! behind the authorizer; mistakes answer `400 {"error": ".."}`.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::Value;

use super::Shared;
use super::contention::{FetchContention, FetchLocks};
use super::faults::Fault;
use super::state::{InstanceAction, TaskSpec};
use super::wire;

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/admin/tasks", post(create_tasks).get(list_tasks))
        .route("/admin/tasks/{id}", get(get_task))
        .route("/admin/tasks/{id}/retries", post(set_retries))
        .route("/admin/calls", get(calls).delete(clear_calls))
        .route("/admin/clock", get(clock))
        .route("/admin/clock/advance", post(advance))
        .route("/admin/faults", post(add_fault).delete(clear_faults))
        .route("/admin/outage", post(outage))
        .route("/admin/fetch-answer-cap", post(fetch_answer_cap))
        .route("/admin/fetch-contention", post(fetch_contention))
        .route("/admin/tool-credentials/verify", post(verify_credential))
        .route(
            "/admin/instances/{id}",
            get(get_instance).post(act_on_instance),
        )
}

fn admin_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"error": message.into()})),
    )
        .into_response()
}

async fn create_tasks(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let specs: Vec<TaskSpec> = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Array(items)) => match serde_json::from_value(Value::Array(items)) {
            Ok(specs) => specs,
            Err(e) => {
                return admin_error(StatusCode::BAD_REQUEST, format!("invalid task list: {e}"));
            }
        },
        Ok(item) => match serde_json::from_value(item) {
            Ok(spec) => vec![spec],
            Err(e) => return admin_error(StatusCode::BAD_REQUEST, format!("invalid task: {e}")),
        },
        Err(e) => {
            return admin_error(
                StatusCode::BAD_REQUEST,
                format!("body must be a task object or an array of them: {e}"),
            );
        }
    };
    let ids = shared.create_tasks(specs);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"ids": ids})),
    )
        .into_response()
}

async fn list_tasks(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(shared.state().task_views()).into_response()
}

async fn get_task(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    match shared.state().task_view(&id) {
        Some(view) => axum::Json(view).into_response(),
        None => admin_error(StatusCode::NOT_FOUND, format!("no task {id}")),
    }
}

#[derive(Deserialize)]
struct RetriesBody {
    retries: i32,
}

async fn set_retries(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(RetriesBody { retries }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"retries\": <integer>}",
        );
    };
    if shared.state().set_retries(&id, retries) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        admin_error(StatusCode::NOT_FOUND, format!("no task {id}"))
    }
}

async fn calls(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(shared.state().calls()).into_response()
}

async fn clear_calls(State(shared): State<Arc<Shared>>) -> Response {
    shared.state().clear_calls();
    StatusCode::NO_CONTENT.into_response()
}

fn clock_json(shared: &Shared) -> Response {
    axum::Json(serde_json::json!({
        "now": wire::format_time(shared.clock.now_ms()),
        "offsetMs": shared.clock.offset_ms(),
    }))
    .into_response()
}

async fn clock(State(shared): State<Arc<Shared>>) -> Response {
    clock_json(&shared)
}

#[derive(Deserialize)]
struct AdvanceBody {
    ms: u64,
}

async fn advance(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(AdvanceBody { ms }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"ms\": <milliseconds>}",
        );
    };
    shared.clock.advance(std::time::Duration::from_millis(ms));
    clock_json(&shared)
}

async fn add_fault(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Fault>(&body) {
        Ok(fault) => {
            shared.faults().add(fault);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => admin_error(StatusCode::BAD_REQUEST, format!("invalid fault: {e}")),
    }
}

async fn clear_faults(State(shared): State<Arc<Shared>>) -> Response {
    *shared.faults() = Default::default();
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Deserialize)]
struct OutageBody {
    enabled: bool,
}

async fn outage(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(OutageBody { enabled }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"enabled\": true|false}",
        );
    };
    shared.faults().outage = enabled;
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AnswerCapBody {
    max_tasks: Option<std::num::NonZeroU32>,
}

async fn fetch_answer_cap(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(AnswerCapBody { max_tasks }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"maxTasks\": n} with n >= 1, or {\"maxTasks\": null} for no cap",
        );
    };
    shared.state().set_answer_cap(max_tasks);
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ContentionBody {
    transaction_ms: Option<u64>,
    #[serde(default)]
    locks: FetchLocks,
}

async fn fetch_contention(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(ContentionBody {
        transaction_ms,
        locks,
    }) = serde_json::from_slice(&body)
    else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"transactionMs\": n} (n in ms, at most 60000), optionally with \
             \"locks\": \"everyCandidate\" or \"returnedRows\"; {\"transactionMs\": null} for none",
        );
    };
    let contention = match transaction_ms {
        None => None,
        Some(ms) if ms <= MAX_FETCH_TRANSACTION_MS => Some(FetchContention {
            locks,
            transaction: std::time::Duration::from_millis(ms),
        }),
        Some(ms) => {
            return admin_error(
                StatusCode::BAD_REQUEST,
                format!(
                    "transactionMs {ms} is over {MAX_FETCH_TRANSACTION_MS}: every fetch would answer that late"
                ),
            );
        }
    };
    shared.state().set_fetch_contention(contention);
    StatusCode::NO_CONTENT.into_response()
}

/// The longest fetch transaction the admin API sets: a minute already stalls every worker.
const MAX_FETCH_TRANSACTION_MS: u64 = 60_000;

#[derive(Deserialize)]
struct VerifyBody {
    server: String,
    token: String,
}

async fn verify_credential(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(VerifyBody { server, token }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"server\": .., \"token\": ..}",
        );
    };
    let verdict = shared
        .state()
        .verify_tool_credential(&server, &token, shared.clock.now_ms());
    let body = match verdict {
        Some((task_id, attempt)) => {
            serde_json::json!({"valid": true, "taskId": task_id, "attempt": attempt})
        }
        None => serde_json::json!({"valid": false}),
    };
    axum::Json(body).into_response()
}

async fn get_instance(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    match shared.state().instance_view(&id) {
        Some(view) => axum::Json(view).into_response(),
        None => admin_error(StatusCode::NOT_FOUND, format!("no process instance {id}")),
    }
}

#[derive(Deserialize)]
struct InstanceBody {
    action: InstanceAction,
}

async fn act_on_instance(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(InstanceBody { action }) = serde_json::from_slice(&body) else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "body must be {\"action\": \"suspend\"|\"resume\"|\"cancel\"|\"fail\"}",
        );
    };
    let result = shared.state().instance_action(&id, action);
    shared.changed.notify_waiters();
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(message) => admin_error(StatusCode::BAD_REQUEST, message),
    }
}
