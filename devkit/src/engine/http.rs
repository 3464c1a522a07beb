//! The emulator's HTTP side: the listener (TCP_NODELAY, and a per-connection kill switch so a
//! response can be dropped after its command committed), the `/api` worker-protocol routes with
//! the request pipeline.
//!
//! Pipeline of an `/api` request: outage (connection closed) → injected early answers (reset
//! connection, 429 with Retry-After, a 200 with a bad body; none runs the command) → authorizer (401/403) → injected
//! latency → injected 5xx / 409 → refused heartbeats → protocol level (agent/1 endpoints may be
//! 404) → body parsing (415/400) → idempotency + command under the state mutex → injected
//! response drop → response with the protocol header → call log → with fetch contention on, a
//! fetch's answer waits for its transaction's end.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, FromRequest, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use super::faults::EarlyAnswer;
use super::state::{CallRecord, Disposition, EngineState, Operation, Reply};
use super::wire::{self, ApiError, Command, PROTOCOL_HEADER};
use super::{ProtocolLevel, Shared};

// ---- listener with a kill switch ------------------------------------------------------------

/// A handle on one accepted connection, given to handlers as connect info.
#[derive(Clone, Debug)]
pub(crate) struct ConnHandle {
    killed: Arc<AtomicBool>,
}

impl ConnHandle {
    /// Makes every further read and write on the connection fail, so hyper closes it without
    /// writing the response it is about to send.
    fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }
}

/// A TCP stream that fails once its connection, or the whole server, has been killed.
pub(crate) struct KillableIo {
    inner: TcpStream,
    killed: Arc<AtomicBool>,
    server_closed: Arc<AtomicBool>,
}

impl KillableIo {
    fn dead(&self) -> bool {
        self.killed.load(Ordering::SeqCst) || self.server_closed.load(Ordering::SeqCst)
    }
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection dropped by the engine emulator",
    )
}

impl AsyncRead for KillableIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.dead() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.dead() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.dead() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

pub(crate) struct EmulatorListener {
    pub inner: TcpListener,
    /// Set by `shutdown()`: every connection fails on its next read or write.
    pub server_closed: Arc<AtomicBool>,
}

impl axum::serve::Listener for EmulatorListener {
    type Io = KillableIo;
    type Addr = ConnHandle;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, _peer)) => {
                    // Without it, small request/response pairs wait on Nagle + delayed ACK.
                    let _ = stream.set_nodelay(true);
                    let killed = Arc::new(AtomicBool::new(false));
                    let io = KillableIo {
                        inner: stream,
                        killed: killed.clone(),
                        server_closed: self.server_closed.clone(),
                    };
                    return (io, ConnHandle { killed });
                }
                // Out of file descriptors and the like: wait a little instead of spinning.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()?;
        Ok(ConnHandle {
            killed: Arc::new(AtomicBool::new(false)),
        })
    }
}

impl Connected<axum::serve::IncomingStream<'_, EmulatorListener>> for ConnHandle {
    fn connect_info(stream: axum::serve::IncomingStream<'_, EmulatorListener>) -> Self {
        stream.remote_addr().clone()
    }
}

// ---- router ---------------------------------------------------------------------------------

const TASKS: &str = "/api/v1/external-tasks";

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let api = |op: Operation| move |call: ApiCall| handle(call, op);
    Router::new()
        .route(
            &format!("{TASKS}/fetch-and-lock"),
            post(api(Operation::FetchAndLock)),
        )
        .route(
            &format!("{TASKS}/{{id}}/heartbeat"),
            post(api(Operation::Heartbeat)),
        )
        .route(
            &format!("{TASKS}/{{id}}/extend-lock"),
            post(api(Operation::ExtendLock)),
        )
        .route(
            &format!("{TASKS}/{{id}}/complete"),
            post(api(Operation::Complete)),
        )
        .route(
            &format!("{TASKS}/{{id}}/bpmn-error"),
            post(api(Operation::BpmnError)),
        )
        .route(
            &format!("{TASKS}/{{id}}/failure"),
            post(api(Operation::Failure)),
        )
        .route(
            &format!("{TASKS}/{{id}}/journal/read"),
            post(api(Operation::JournalRead)),
        )
        .route(
            &format!("{TASKS}/{{id}}/journal"),
            post(api(Operation::JournalAppend)),
        )
        .route(
            &format!("{TASKS}/{{id}}/tool-credentials"),
            post(api(Operation::ToolCredentials)),
        )
        .merge(super::admin::routes())
        .merge(super::process_api::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

/// Everything an `/api` handler needs from the request.
struct ApiCall {
    shared: Arc<Shared>,
    conn: Option<ConnHandle>,
    path: String,
    task_id: Option<String>,
    headers: HeaderMap,
    body: Bytes,
}

impl FromRequest<Arc<Shared>> for ApiCall {
    type Rejection = Infallible;

    async fn from_request(req: Request, state: &Arc<Shared>) -> Result<Self, Infallible> {
        let (mut parts, body) = req.into_parts();
        let conn = parts
            .extensions
            .get::<ConnectInfo<ConnHandle>>()
            .map(|c| c.0.clone());
        let task_id = <Path<String> as axum::extract::FromRequestParts<_>>::from_request_parts(
            &mut parts, state,
        )
        .await
        .ok()
        .map(|p| p.0);
        // A body that cannot be read (too large, broken) parses as malformed below.
        let body = axum::body::to_bytes(body, 16 * 1024 * 1024)
            .await
            .unwrap_or_default();
        Ok(ApiCall {
            shared: state.clone(),
            conn,
            path: parts.uri.path().to_string(),
            task_id,
            headers: parts.headers,
            body,
        })
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// What the pipeline produced: an answer (or refusal), plus bookkeeping for the call log.
struct Outcome<'a> {
    result: Result<Reply, ApiError>,
    disposition: Disposition,
    /// The state, still locked after the command ran, so the call is recorded under the same
    /// lock: nobody (a test waiting for a task's status, then reading the call log) can see a
    /// command's effect without its call.
    state: Option<MutexGuard<'a, EngineState>>,
    /// When the answer goes out, in the emulator's clock: a fetch's transaction end with
    /// contention on; `None`, at once.
    answer_at: Option<i64>,
}

async fn handle(call: ApiCall, op: Operation) -> Response {
    let shared = call.shared.clone();
    let (response, answer_at) = answer(call, op).await;
    // Recorded (and its effects visible) when it ran; answered when its transaction ends.
    if let Some(at) = answer_at {
        until_clock(&shared, at).await;
    }
    response
}

/// Runs an `/api` request and records it; returns its response and when to send it (`None`:
/// at once).
async fn answer(call: ApiCall, op: Operation) -> (Response, Option<i64>) {
    let shared = call.shared.clone();
    let parsed_body: Option<Value> = serde_json::from_slice(&call.body).ok();
    let mut record = CallRecord {
        at: shared.clock.now(),
        operation: op,
        task_id: call.task_id.clone(),
        worker_id: parsed_body
            .as_ref()
            .and_then(|b| b.get("workerId"))
            .and_then(Value::as_str)
            .map(str::to_string),
        attempt: parsed_body
            .as_ref()
            .and_then(|b| b.get("attempt"))
            .and_then(Value::as_i64),
        idempotency_key: header_str(&call.headers, "idempotency-key").map(str::to_string),
        traceparent: header_str(&call.headers, "traceparent").map(str::to_string),
        status: 0,
        error_code: None,
        error_message: None,
        disposition: Disposition::Injected,
        response_dropped: false,
        task_ids: Vec::new(),
    };

    let outage = shared.faults().outage;
    if outage {
        if let Some(conn) = &call.conn {
            conn.kill();
        }
        record.status = StatusCode::SERVICE_UNAVAILABLE.as_u16();
        record.response_dropped = true;
        shared.record_call(record);
        return (StatusCode::SERVICE_UNAVAILABLE.into_response(), None);
    }

    let early = shared.faults().take_early_answer(op);
    if let Some(early) = early {
        return (early_answer(&shared, &call, early, record), None);
    }

    let mut outcome = pipeline(&call, op, parsed_body).await;

    let mut drop_response = false;
    let mut omit_header = false;
    // Injected answers never executed, so they neither drop nor strip anything.
    if outcome.disposition != Disposition::Injected {
        let mut faults = shared.faults();
        drop_response = faults.take_drop(op);
        omit_header =
            op == Operation::FetchAndLock && outcome.result.is_ok() && faults.take_omit_header();
    }

    let path = call.path.as_str();
    let response = match &outcome.result {
        Ok(reply) => {
            if op == Operation::FetchAndLock
                && let Some(Value::Array(tasks)) = &reply.body
            {
                record.task_ids = tasks
                    .iter()
                    .filter_map(|t| t.get("id").and_then(Value::as_str))
                    .map(str::to_string)
                    .collect();
            }
            let mut response = match &reply.body {
                Some(body) => (reply.status, axum::Json(body.clone())).into_response(),
                None => reply.status.into_response(),
            };
            // The engine sends the header on fetch-and-lock answers only (200s and their
            // replays), never on other operations or on errors.
            if op == Operation::FetchAndLock && !omit_header {
                response
                    .headers_mut()
                    .insert(PROTOCOL_HEADER, HeaderValue::from_static("1"));
            }
            record.status = reply.status.as_u16();
            response
        }
        Err(error) => {
            record.status = error.status.as_u16();
            record.error_code = Some(error.code.to_string());
            record.error_message = Some(error.message.clone());
            error_response(&shared, error, path, &call.headers)
        }
    };
    record.disposition = outcome.disposition;
    if drop_response && let Some(conn) = &call.conn {
        conn.kill();
        record.response_dropped = true;
    }
    match outcome.state.take() {
        Some(mut state) => {
            state.record_call(record);
            drop(state);
            shared.changed.notify_waiters();
        }
        None => shared.record_call(record),
    }
    (response, outcome.answer_at)
}

/// An injected answer that never runs the command: a reset connection, a 429, a bad body.
fn early_answer(
    shared: &Shared,
    call: &ApiCall,
    early: EarlyAnswer,
    mut record: CallRecord,
) -> Response {
    record.disposition = Disposition::Injected;
    let response = match early {
        EarlyAnswer::Reset => {
            if let Some(conn) = &call.conn {
                conn.kill();
            }
            record.response_dropped = true;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        EarlyAnswer::Throttle { retry_after_secs } => {
            let error = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "TOO_MANY_REQUESTS",
                "Too many requests: slow down",
            );
            record.error_code = Some(error.code.to_string());
            let mut response = error_response(shared, &error, &call.path, &call.headers);
            if let Some(secs) = retry_after_secs
                && let Ok(value) = HeaderValue::from_str(&secs.to_string())
            {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            response
        }
        EarlyAnswer::BadBody(body) => {
            let (content_type, text) = body.content();
            let mut response = (StatusCode::OK, text).into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            response
                .headers_mut()
                .insert(PROTOCOL_HEADER, HeaderValue::from_static("1"));
            response
        }
    };
    record.status = response.status().as_u16();
    shared.record_call(record);
    response
}

fn error_response(shared: &Shared, error: &ApiError, path: &str, headers: &HeaderMap) -> Response {
    let body = error.body(
        &wire::format_time(shared.clock.now_ms()),
        path,
        &wire::trace_id(header_str(headers, "traceparent")),
    );
    let mut response = (error.status, axum::Json(body)).into_response();
    if drops_connection(error.status) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The engine runs in Tomcat, which closes the connection after an answer with one of these
/// statuses (its `statusDropsConnection`): seen on the real engine 0.11 for its 400s and 500s
/// (`Connection: close`), never for 401, 403, 404, 405 or 409 (docs/REAL_ENGINE.md). A client's
/// pooled connection is gone after such an answer, so the emulator closes it too.
fn drops_connection(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        400 | 408 | 411 | 413 | 414 | 500 | 501 | 503
    )
}

fn refused(error: ApiError, disposition: Disposition) -> Outcome<'static> {
    Outcome {
        result: Err(error),
        disposition,
        state: None,
        answer_at: None,
    }
}

async fn pipeline(call: &ApiCall, op: Operation, parsed_body: Option<Value>) -> Outcome<'_> {
    let shared = &call.shared;
    if let Some(authorizer) = &shared.authorizer
        && let Err(rejection) = authorizer.authorize(&call.headers)
    {
        return refused(super::auth_error(rejection), Disposition::Refused);
    }

    let delay = shared.faults().latency(op);
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    {
        let mut faults = shared.faults();
        if let Some(status) = faults.take_server_error(op) {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return refused(ApiError::internal(status), Disposition::Injected);
        }
        if faults.take_conflict(op) {
            return refused(ApiError::concurrent_modification(), Disposition::Injected);
        }
        if let Some(id) = &call.task_id
            && let Some(message) = faults.take_rejection(op, id)
        {
            return refused(ApiError::rejected(message), Disposition::Injected);
        }
        if matches!(op, Operation::Heartbeat | Operation::ExtendLock)
            && let Some(id) = &call.task_id
            && faults.refuses_heartbeat(id)
        {
            return refused(ApiError::not_owned(id), Disposition::Injected);
        }
    }

    let protocol = shared.protocol;
    let available = match op {
        Operation::JournalRead | Operation::JournalAppend => protocol == ProtocolLevel::AgentV1,
        Operation::ToolCredentials => protocol != ProtocolLevel::PlainV1,
        _ => true,
    };
    if !available {
        return refused(ApiError::not_found_resource(), Disposition::Refused);
    }

    let command = match parse_command(op, &call.headers, parsed_body, shared.authorizer.is_some()) {
        Ok(command) => command,
        Err(error) => return refused(error, Disposition::Refused),
    };
    let key = header_str(&call.headers, "idempotency-key");
    let now = shared.clock.now_ms();
    let actor = shared.caller(&call.headers).user;
    let mut state = shared.state();
    let (result, disposition) =
        match state.run(op, call.task_id.as_deref(), key, &command, now, &actor) {
            Ok((reply, disposition)) => (Ok(reply), disposition),
            Err(error) => (Err(error), Disposition::Refused),
        };
    // With contention on, a fetch that ran answers when its transaction ends (module
    // `contention`), as the real engine answers after its commit.
    let answer_at = state
        .fetch_contention()
        .filter(|_| {
            op == Operation::FetchAndLock && disposition == Disposition::Executed && result.is_ok()
        })
        .map(|c| now.saturating_add(c.transaction_ms()));
    Outcome {
        result,
        disposition,
        state: Some(state),
        answer_at,
    }
}

/// Waits until the emulator's clock reaches `at_ms`: real time, cut short when the clock is
/// moved forward ([`super::EngineEmulator::advance`] wakes every waiter).
async fn until_clock(shared: &Shared, at_ms: i64) {
    loop {
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let left = at_ms.saturating_sub(shared.clock.now_ms());
        if left <= 0 {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(left.unsigned_abs())) => {}
            _ = notified => {}
        }
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    header_str(headers, header::CONTENT_TYPE.as_str()).is_some_and(|ct| {
        let mime = ct
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
    })
}

fn parse<T: serde::de::DeserializeOwned>(body: Value) -> Result<T, ApiError> {
    serde_json::from_value(body).map_err(|_| ApiError::malformed())
}

/// Reads a request body the way the engine's controllers do.
fn parse_command(
    op: Operation,
    headers: &HeaderMap,
    body: Option<Value>,
    secured: bool,
) -> Result<Command, ApiError> {
    if !is_json(headers) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            wire::code::INVALID_REQUEST,
            "Unsupported Media Type",
        ));
    }
    parse_command_body(op, body, secured)
}

/// Reads a JSON request body the way the engine's controllers do, once its media type passed
/// (the in-process engine, [`super::core`], calls this directly).
pub(crate) fn parse_command_body(
    op: Operation,
    body: Option<Value>,
    secured: bool,
) -> Result<Command, ApiError> {
    let body = body.ok_or_else(ApiError::malformed)?;
    Ok(match op {
        Operation::FetchAndLock => Command::FetchAndLock(parse(body)?),
        Operation::Heartbeat | Operation::ExtendLock => Command::ExtendLock(parse(body)?),
        Operation::Complete => Command::Complete(parse_complete(body, secured)?),
        Operation::Failure => Command::Failure(parse(body)?),
        Operation::BpmnError => Command::BpmnError(parse(body)?),
        Operation::JournalRead => Command::JournalRead(parse(body)?),
        Operation::JournalAppend => {
            let request: wire::JournalAppendRequest = parse(body)?;
            let seq_ok = request
                .step
                .as_ref()
                .filter(|s| s.is_object())
                .and_then(|s| s.get("seq"))
                .and_then(Value::as_u64)
                .is_some_and(|seq| seq >= 1);
            if !seq_ok {
                return Err(ApiError::invalid(
                    "step must be a JSON object with an integer seq >= 1",
                ));
            }
            Command::JournalAppend(request)
        }
        Operation::ToolCredentials => {
            let request: wire::ToolCredentialsRequest = parse(body)?;
            if request
                .server
                .as_deref()
                .is_none_or(|s| s.trim().is_empty())
            {
                return Err(ApiError::invalid(
                    "server is required: name the tool server",
                ));
            }
            Command::ToolCredentials(request)
        }
        Operation::ProcessInstanceRead
        | Operation::ProcessDefinitionRead
        | Operation::ProcessHistoryRead
        | Operation::Unknown => {
            return Err(ApiError::not_found_resource());
        }
    })
}

/// The engine's completion body: `{workerId, variables}`, or (unsecured engines only) the legacy
/// body that is the variables map itself.
fn parse_complete(body: Value, secured: bool) -> Result<wire::CompleteRequest, ApiError> {
    let v1 = body
        .as_object()
        .is_some_and(|o| o.contains_key("workerId") || o.contains_key("variables"));
    if v1 {
        let request: wire::CompleteRequest = parse(body)?;
        if secured
            && request
                .worker_id
                .as_deref()
                .is_none_or(|w| w.trim().is_empty())
        {
            return Err(ApiError::invalid(
                "workerId is required for external-task completion",
            ));
        }
        return Ok(request);
    }
    if secured {
        return Err(ApiError::invalid(
            "Use the worker protocol v1 completion body with workerId and variables",
        ));
    }
    let variables = match body {
        Value::Null => serde_json::Map::new(),
        Value::Object(map) => map,
        _ => return Err(ApiError::malformed()),
    };
    Ok(wire::CompleteRequest {
        worker_id: None,
        variables: Some(variables),
        attempt: None,
    })
}

/// 404 `RESOURCE_NOT_FOUND` (after the authorizer, for `/api`); `/api` misses are logged as
/// [`Operation::Unknown`].
async fn not_found(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let api = path == "/api" || path.starts_with("/api/");
    if api && shared.faults().outage {
        // The engine is gone for every `/api` path, its root (a worker's probe) included.
        if let Some(conn) = req.extensions().get::<ConnectInfo<ConnHandle>>() {
            conn.0.kill();
        }
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if !path.starts_with("/api/") {
        return error_response(
            &shared,
            &ApiError::not_found_resource(),
            &path,
            req.headers(),
        );
    }
    let error = match shared
        .authorizer
        .as_ref()
        .map(|a| a.authorize(req.headers()))
    {
        Some(Err(rejection)) => super::auth_error(rejection),
        _ => ApiError::not_found_resource(),
    };
    shared.record_call(CallRecord {
        at: shared.clock.now(),
        operation: Operation::Unknown,
        task_id: None,
        worker_id: None,
        attempt: None,
        idempotency_key: header_str(req.headers(), "idempotency-key").map(str::to_string),
        traceparent: header_str(req.headers(), "traceparent").map(str::to_string),
        status: error.status.as_u16(),
        error_code: Some(error.code.to_string()),
        error_message: Some(error.message.clone()),
        disposition: Disposition::Refused,
        response_dropped: false,
        task_ids: Vec::new(),
    });
    error_response(&shared, &error, &path, req.headers())
}

async fn method_not_allowed(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let error = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        wire::code::INVALID_REQUEST,
        "Method Not Allowed",
    );
    error_response(&shared, &error, req.uri().path(), req.headers())
}
