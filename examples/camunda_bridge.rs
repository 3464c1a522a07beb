//! A thin front that lets the Camunda 7 external task client (Java) work against the real Abada
//! engine, for the peer comparison only (BENCHMARKS.md, docs/REAL_ENGINE.md). The engine speaks
//! Abada's external-worker protocol v1 (`/v1/external-tasks/...`), the client speaks Camunda 7's
//! REST API (`/external-task/...`); each Camunda call becomes the matching v1 call, and nothing
//! else is done:
//!
//! | Camunda 7 (docs.camunda.org/rest/camunda-bpm-platform/7.23) | Abada v1 (protocol Part A) |
//! | --- | --- |
//! | `POST /external-task/fetchAndLock` | `POST /v1/external-tasks/fetch-and-lock` |
//! | `POST /external-task/{id}/complete` | `POST /v1/external-tasks/{id}/complete` |
//! | `POST /external-task/{id}/failure` | `POST /v1/external-tasks/{id}/failure` |
//! | `POST /external-task/{id}/bpmnError` | `POST /v1/external-tasks/{id}/bpmn-error` |
//! | `POST /external-task/{id}/extendLock` | `POST /v1/external-tasks/{id}/extend-lock` |
//!
//! Variables: Camunda's typed form `{"x": {"value": .., "type": "String", "valueInfo": {}}}`
//! becomes plain JSON (`Json` values, a JSON text in Camunda, are parsed), and back: a string is
//! `String`, a boolean `Boolean`, an integer `Integer` or `Long`, a fraction `Double`, `null`
//! `Null`, an object or array `Json` (its text). `lockExpirationTime` is written as Camunda's REST
//! API writes dates (`yyyy-MM-dd'T'HH:mm:ss.SSSZ`). v1 takes one `lockDuration` per fetch, so the
//! largest of the topics' is sent.
//!
//! Long polling: Camunda's `asyncResponseTimeout` holds an empty fetch open until a task appears;
//! the Abada engine has no long poll. When the client asks for one and the engine answers `[]`,
//! the bridge asks the engine again every `--long-poll-interval-ms` (default 1000, the poll
//! interval the worker runs with in `engine_bench`) until a task comes or the timeout passes. A
//! fetch that finds tasks is answered at once, as Camunda does.
//!
//! The bridge sends no `Idempotency-Key` (the Camunda client has no such notion). It listens on
//! loopback only and prints one JSON line with its URLs; `GET /bridge/stats` says what passed
//! through (the harness reads the end of the backlog there).
//!
//! ```text
//! target/release/examples/camunda_bridge --engine-url http://127.0.0.1:5741/api [--listen 127.0.0.1:0]
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};

/// What a Camunda call can fail with; each becomes a Camunda-format error answer.
#[derive(Debug, thiserror::Error)]
enum BridgeError {
    #[error("the request body is not what Camunda's REST API takes: {0}")]
    BadRequest(String),
    #[error(
        "variable {name:?} has type {kind:?}, which the Abada engine cannot store; send String, Boolean, Integer, Long, Short, Double, Null or Json"
    )]
    UnsupportedType { name: String, kind: String },
    #[error("variable {name:?} of type Json holds no JSON text: {reason}")]
    BadJson { name: String, reason: String },
    #[error("the engine at {url} cannot be reached: {reason}; is it running?")]
    EngineUnreachable { url: String, reason: String },
    #[error("the engine answered {status}: {body}")]
    Engine { status: StatusCode, body: String },
    #[error("the engine's fetch answer is not a list of locked tasks: {0}")]
    EngineAnswer(String),
}

impl IntoResponse for BridgeError {
    fn into_response(self) -> Response {
        // Camunda's REST error body: {"type": <exception class>, "message": ...}.
        let (status, kind) = match &self {
            Self::BadRequest(_) | Self::UnsupportedType { .. } | Self::BadJson { .. } => {
                (StatusCode::BAD_REQUEST, "InvalidRequestException")
            }
            Self::Engine { status, .. } => (*status, "RestException"),
            Self::EngineUnreachable { .. } | Self::EngineAnswer(_) => {
                (StatusCode::BAD_GATEWAY, "BridgeException")
            }
        };
        let body = json!({"type": kind, "message": self.to_string()});
        (status, Json(body)).into_response()
    }
}

/// Counts and times of what passed through, for the harness.
#[derive(Default)]
struct Stats {
    fetches: u64,
    engine_fetches: u64,
    tasks_locked: u64,
    completed: u64,
    refused: u64,
    /// Microseconds since the bridge started.
    first_locked_us: Option<u64>,
    last_completed_us: Option<u64>,
}

#[derive(Clone)]
struct Bridge {
    http: reqwest::Client,
    engine: Arc<str>,
    long_poll_interval: Duration,
    started: Instant,
    stats: Arc<Mutex<Stats>>,
}

impl Bridge {
    fn now_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One v1 call; the engine's body on success (empty for most operations).
    async fn engine_post(&self, path: &str, body: &Value) -> Result<String, BridgeError> {
        let url = format!("{}/v1/external-tasks/{path}", self.engine);
        let answer = self
            .http
            .post(&url)
            .header("x-abada-worker-protocol-version", "1")
            .json(body)
            .send()
            .await
            .map_err(|e| BridgeError::EngineUnreachable {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        let status = answer.status();
        let text = answer
            .text()
            .await
            .map_err(|e| BridgeError::EngineUnreachable {
                url,
                reason: e.to_string(),
            })?;
        if status.is_success() {
            Ok(text)
        } else {
            Err(BridgeError::Engine {
                status,
                body: text.chars().take(2000).collect(),
            })
        }
    }
}

fn field<'a>(body: &'a Value, name: &str) -> Result<&'a Value, BridgeError> {
    body.get(name)
        .ok_or_else(|| BridgeError::BadRequest(format!("{name:?} is missing")))
}

/// Camunda's typed variables to plain JSON.
fn plain_variables(typed: Option<&Value>) -> Result<Map<String, Value>, BridgeError> {
    let mut out = Map::new();
    let Some(typed) = typed.filter(|v| !v.is_null()) else {
        return Ok(out);
    };
    let typed = typed
        .as_object()
        .ok_or_else(|| BridgeError::BadRequest("\"variables\" is not an object".into()))?;
    for (name, v) in typed {
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let value = v.get("value").cloned().unwrap_or(Value::Null);
        let plain = match kind.to_ascii_lowercase().as_str() {
            "string" | "boolean" | "integer" | "long" | "short" | "double" | "null" | "date" => {
                value
            }
            "json" => match &value {
                Value::String(text) => {
                    serde_json::from_str(text).map_err(|e| BridgeError::BadJson {
                        name: name.clone(),
                        reason: e.to_string(),
                    })?
                }
                other => other.clone(),
            },
            // An untyped value: Camunda's REST API guesses from the JSON.
            "" => value,
            _ => {
                return Err(BridgeError::UnsupportedType {
                    name: name.clone(),
                    kind: kind.to_string(),
                });
            }
        };
        out.insert(name.clone(), plain);
    }
    Ok(out)
}

/// Plain JSON to Camunda's typed form, as Camunda's REST API writes it.
fn typed_variables(plain: Option<&Value>) -> Value {
    let mut out = Map::new();
    if let Some(Value::Object(vars)) = plain {
        for (name, v) in vars {
            let (kind, value) = match v {
                Value::String(_) => ("String", v.clone()),
                Value::Bool(_) => ("Boolean", v.clone()),
                Value::Number(n) if n.as_i64().is_some_and(|i| i32::try_from(i).is_ok()) => {
                    ("Integer", v.clone())
                }
                Value::Number(n) if n.is_i64() || n.is_u64() => ("Long", v.clone()),
                Value::Number(_) => ("Double", v.clone()),
                Value::Null => ("Null", Value::Null),
                Value::Object(_) | Value::Array(_) => ("Json", Value::String(v.to_string())),
            };
            out.insert(
                name.clone(),
                json!({"type": kind, "value": value, "valueInfo": {}}),
            );
        }
    }
    Value::Object(out)
}

/// `2026-11-30T21:53:17.215741611Z` (v1) as `2026-11-30T21:53:17.215+0000` (Camunda REST).
fn camunda_date(v1: Option<&Value>) -> Value {
    v1.and_then(Value::as_str)
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map_or(Value::Null, |d| {
            Value::String(
                d.with_timezone(&chrono::Utc)
                    .format("%Y-%m-%dT%H:%M:%S%.3f%z")
                    .to_string(),
            )
        })
}

fn camunda_task(task: &Value, worker_id: &Value) -> Value {
    json!({
        "activityId": task.get("activityId"),
        "activityInstanceId": null,
        "errorMessage": null,
        "errorDetails": null,
        "executionId": null,
        "id": task.get("id"),
        "lockExpirationTime": camunda_date(task.get("lockExpirationTime")),
        "createTime": null,
        "processDefinitionId": null,
        "processDefinitionKey": null,
        "processDefinitionVersionTag": null,
        "processInstanceId": task.get("processInstanceId"),
        "retries": task.get("retries"),
        "suspended": false,
        "workerId": worker_id,
        "topicName": task.get("topicName"),
        "tenantId": null,
        "variables": typed_variables(task.get("variables")),
        "priority": 0,
        "businessKey": null,
        "extensionProperties": {},
    })
}

async fn fetch_and_lock(
    State(bridge): State<Bridge>,
    Json(body): Json<Value>,
) -> Result<Json<Value>, BridgeError> {
    let worker_id = field(&body, "workerId")?.clone();
    let max_tasks = field(&body, "maxTasks")?
        .as_u64()
        .ok_or_else(|| BridgeError::BadRequest("\"maxTasks\" is not a count".into()))?;
    let topics = field(&body, "topics")?
        .as_array()
        .ok_or_else(|| BridgeError::BadRequest("\"topics\" is not a list".into()))?;
    let names: Vec<&str> = topics
        .iter()
        .filter_map(|t| t.get("topicName")?.as_str())
        .collect();
    let lock = topics
        .iter()
        .filter_map(|t| t.get("lockDuration")?.as_u64())
        .max()
        .ok_or_else(|| BridgeError::BadRequest("no topic has a \"lockDuration\"".into()))?;
    let long_poll = body
        .get("asyncResponseTimeout")
        .and_then(Value::as_u64)
        .map(Duration::from_millis);
    let request = json!({
        "workerId": worker_id, "topics": names, "lockDuration": lock, "maxTasks": max_tasks,
    });
    let deadline = long_poll.map(|t| Instant::now() + t);
    bridge.stats().fetches += 1;
    loop {
        bridge.stats().engine_fetches += 1;
        let answer = bridge.engine_post("fetch-and-lock", &request).await?;
        let tasks: Vec<Value> =
            serde_json::from_str(&answer).map_err(|e| BridgeError::EngineAnswer(e.to_string()))?;
        let wait_more = deadline.is_some_and(|d| Instant::now() + bridge.long_poll_interval < d);
        if !tasks.is_empty() || !wait_more {
            if !tasks.is_empty() {
                let now = bridge.now_us();
                let mut s = bridge.stats();
                s.tasks_locked += tasks.len() as u64;
                s.first_locked_us.get_or_insert(now);
            }
            let out: Vec<Value> = tasks.iter().map(|t| camunda_task(t, &worker_id)).collect();
            return Ok(Json(Value::Array(out)));
        }
        tokio::time::sleep(bridge.long_poll_interval).await;
    }
}

async fn complete(
    State(bridge): State<Bridge>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Result<StatusCode, BridgeError> {
    let mut variables = plain_variables(body.get("variables"))?;
    // v1 has no local variables: the task's scope ends with its completion anyway.
    variables.extend(plain_variables(body.get("localVariables"))?);
    let request = json!({"workerId": field(&body, "workerId")?, "variables": variables});
    match bridge
        .engine_post(&format!("{id}/complete"), &request)
        .await
    {
        Ok(_) => {
            let now = bridge.now_us();
            let mut s = bridge.stats();
            s.completed += 1;
            s.last_completed_us = Some(now);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(e) => {
            bridge.stats().refused += 1;
            Err(e)
        }
    }
}

async fn failure(
    State(bridge): State<Bridge>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Result<StatusCode, BridgeError> {
    let request = json!({
        "workerId": field(&body, "workerId")?,
        "errorMessage": body.get("errorMessage"),
        "errorDetails": body.get("errorDetails"),
        "retries": body.get("retries"),
        "retryTimeout": body.get("retryTimeout"),
    });
    bridge
        .engine_post(&format!("{id}/failure"), &request)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn bpmn_error(
    State(bridge): State<Bridge>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Result<StatusCode, BridgeError> {
    let request = json!({
        "workerId": field(&body, "workerId")?,
        "errorCode": field(&body, "errorCode")?,
        "errorMessage": body.get("errorMessage"),
        "variables": plain_variables(body.get("variables"))?,
    });
    bridge
        .engine_post(&format!("{id}/bpmn-error"), &request)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn extend_lock(
    State(bridge): State<Bridge>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Result<StatusCode, BridgeError> {
    let request = json!({
        "workerId": field(&body, "workerId")?,
        "lockDuration": field(&body, "newDuration")?,
    });
    bridge
        .engine_post(&format!("{id}/extend-lock"), &request)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn stats(State(bridge): State<Bridge>) -> Json<Value> {
    let s = bridge.stats();
    Json(json!({
        "fetches": s.fetches,
        "engineFetches": s.engine_fetches,
        "tasksLocked": s.tasks_locked,
        "completed": s.completed,
        "refused": s.refused,
        "firstLockedUs": s.first_locked_us,
        "lastCompletedUs": s.last_completed_us,
    }))
}

struct Args {
    engine_url: String,
    listen: SocketAddr,
    long_poll_interval: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut engine_url = None;
    let mut listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut interval = Duration::from_millis(1000);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let value = it.next().ok_or_else(|| format!("{arg} needs a value"))?;
        match arg.as_str() {
            "--engine-url" => engine_url = Some(value.trim_end_matches('/').to_string()),
            "--listen" => {
                listen = value
                    .parse()
                    .map_err(|e| format!("--listen {value:?}: {e}"))?;
                if !listen.ip().is_loopback() {
                    return Err(format!("--listen {value:?}: loopback addresses only"));
                }
            }
            "--long-poll-interval-ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|e| format!("--long-poll-interval-ms {value:?}: {e}"))?;
                interval = Duration::from_millis(ms.max(1));
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Args {
        engine_url: engine_url.ok_or("--engine-url URL is required (the engine's API base)")?,
        listen,
        long_poll_interval: interval,
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("camunda_bridge: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("camunda_bridge: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let bridge = Bridge {
        http: reqwest::Client::new(),
        engine: args.engine_url.into(),
        long_poll_interval: args.long_poll_interval,
        started: Instant::now(),
        stats: Arc::default(),
    };
    let app = axum::Router::new()
        .route(
            "/engine-rest/external-task/fetchAndLock",
            post(fetch_and_lock),
        )
        .route("/engine-rest/external-task/{id}/complete", post(complete))
        .route("/engine-rest/external-task/{id}/failure", post(failure))
        .route(
            "/engine-rest/external-task/{id}/bpmnError",
            post(bpmn_error),
        )
        .route(
            "/engine-rest/external-task/{id}/extendLock",
            post(extend_lock),
        )
        .route("/bridge/stats", get(stats))
        .with_state(bridge);
    println!(
        "{}",
        json!({
            "camundaBaseUrl": format!("http://{addr}/engine-rest"),
            "statsUrl": format!("http://{addr}/bridge/stats"),
        })
    );
    match axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("camunda_bridge: serving stopped: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_round_trip_between_camunda_and_plain_json() {
        let plain = json!({"s": "o-1", "n": 7, "big": 5_000_000_000_i64, "f": 1.5, "b": true,
                           "o": {"a": [1, 2]}, "z": null});
        let typed = typed_variables(Some(&plain));
        assert_eq!(typed["s"]["type"], "String");
        assert_eq!(typed["n"]["type"], "Integer");
        assert_eq!(typed["big"]["type"], "Long");
        assert_eq!(typed["f"]["type"], "Double");
        assert_eq!(typed["o"]["type"], "Json");
        assert_eq!(typed["z"]["type"], "Null");
        let back = plain_variables(Some(&typed)).expect("typed variables map back");
        assert_eq!(Value::Object(back), plain);
    }

    #[test]
    fn a_type_the_engine_cannot_store_is_refused_by_name() {
        let typed = json!({"blob": {"type": "Bytes", "value": "AAEC"}});
        let err = plain_variables(Some(&typed)).expect_err("bytes refused");
        assert!(err.to_string().contains("\"blob\""), "{err}");
        let typed = json!({"j": {"type": "Json", "value": "{not json"}});
        assert!(matches!(
            plain_variables(Some(&typed)),
            Err(BridgeError::BadJson { .. })
        ));
    }

    #[test]
    fn lock_expiry_is_written_as_camunda_writes_dates() {
        let v = camunda_date(Some(&json!("2026-11-30T21:53:17.215741611Z")));
        assert_eq!(v, "2026-11-30T21:53:17.215+0000");
    }
}
