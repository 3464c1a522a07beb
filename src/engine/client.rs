//! The HTTP engine client: protocol.md Part A to the letter (paths, bodies, headers, error codes)
//! plus the agent/1 calls of Part B, with the idempotency rules of A.3, bounded concurrency and a
//! timeout on every call.
//!
//! Retry rules live here and nowhere else for engine calls:
//! - commands (complete, failure, bpmn-error, journal append, tool credential) are retried on
//!   transient errors with backoff and jitter, reusing their one idempotency key; while the
//!   engine does not answer at all they keep trying for `outage_patience` (the lock duration),
//!   fenced by the task's lease, so an outage is ridden out as long as the lease can last;
//! - a completion refused with 409 CONCURRENT_MODIFICATION is retried once with the same key;
//! - a fetch whose response was lost is retried once with the same key (the engine replays the
//!   tasks it locked instead of stranding them);
//! - a heartbeat is sent once with a fresh key; its scheduler decides when to try again;
//! - a 401 triggers one forced token refresh and one retry.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::{Map, Value};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

use super::error::{EngineError, LeaseLostReason};
use super::headers::EngineHeaders;
use super::wire::{self, PROTOCOL_HEADER, PROTOCOL_VERSION};
use super::{
    AnonymousAccess, AppendOutcome, BpmnErrorReport, Engine, FailureReport, FetchRequest,
    HISTORY_PAGE_SIZE, HistoryPage, Journal, JournalStep, OP_PROCESS_DEFINITION,
    OP_PROCESS_HISTORY, OP_PROCESS_INSTANCE, ProbeOutcome, ProcessDefinition, ProcessInstance,
    Task, TaskRef, ToolCredential, TraceParent,
};
use crate::auth::TokenProvider;
use crate::backoff::Backoff;
use crate::base_url::BaseUrl;
use crate::body::{self, ReadError};
use crate::metrics::Metrics;
use crate::random::Random;
use crate::secret::Secret;
use crate::telemetry::spans;

/// Settings of the engine client.
#[derive(Clone, Debug)]
pub struct EngineClientSettings {
    /// Engine API root, e.g. `http://abada-engine:5601/api`.
    pub engine_url: String,
    pub worker_id: String,
    /// Timeout of one HTTP exchange.
    pub request_timeout: Duration,
    /// Most engine requests in flight at once (the connection pool's real bound).
    pub(crate) max_in_flight: usize,
    /// How often a command is tried in all before its error is returned.
    pub command_attempts: u32,
    pub command_backoff: Backoff,
    /// How long a command keeps retrying while the engine does not answer at all (connection
    /// refused or reset, timeout), beyond `command_attempts`: an engine outage is ridden out
    /// for as long as the task's lease can last. Calls about a task run fenced by its lease
    /// ([`crate::handler::TaskContext::fenced`]), so they stop the moment the lease is lost;
    /// this bound is for callers without a lease. Set it to the lock duration.
    pub outage_patience: Duration,
    /// The worker's randomness: idempotency keys, the span ids of the trace context sent on,
    /// the jitter of the command backoff.
    pub random: Random,
}

impl EngineClientSettings {
    pub fn new(engine_url: impl Into<String>, worker_id: impl Into<String>) -> Self {
        EngineClientSettings {
            engine_url: engine_url.into(),
            worker_id: worker_id.into(),
            request_timeout: Duration::from_secs(10),
            max_in_flight: 64,
            command_attempts: 6,
            command_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
            outage_patience: Duration::from_secs(120),
            random: Random::os(),
        }
    }
}

/// Below the API root: the worker protocol's calls.
const EXTERNAL_TASKS: &str = "/v1/external-tasks";
/// Below the API root: the process API's reads (agents defined in the BPMN).
const PROCESSES: &str = "/v1/processes";
/// Below the API root: the operations API (an instance's activity history).
const PROCESS_INSTANCES: &str = "/v1/process-instances";

/// The engine over HTTP.
pub struct HttpEngine {
    http: reqwest::Client,
    /// The API root, parsed once; every call's URL is its path appended to it. An error when
    /// `engine_url` is not a usable root (the configuration refuses such a URL first): then
    /// every call fails, saying so.
    root: Result<BaseUrl, String>,
    /// The engine's host, for the spans of engine calls (`server.address`).
    host: String,
    worker_id: String,
    tokens: Option<Arc<dyn TokenProvider>>,
    in_flight: Semaphore,
    settings: EngineClientSettings,
    metrics: Arc<Metrics>,
    /// `ABADA_AGENT_ENGINE_HEADERS_FILE`: sent with every request (values are secrets).
    headers: Option<Arc<EngineHeaders>>,
}

/// One HTTP exchange to make (possibly several times, with the same key).
struct Call<'a> {
    op: &'static str,
    /// POST for the worker protocol, GET for the process API's reads (no body then).
    method: Method,
    task_id: Option<&'a str>,
    /// Below the engine's API root, e.g. `/v1/external-tasks/{id}/complete` (segments encoded).
    path: String,
    /// Shared, so a retry sends the same bytes without copying them.
    body: Bytes,
    idempotency_key: Option<String>,
    /// The task's trace context (a fresh root for a fetch); the header sent is a child of it,
    /// or of the call's own span when spans are exported.
    traceparent: Option<TraceParent>,
    /// How a success answer's body is read.
    read: Reading,
}

/// How the body of a success answer is read; every other answer is read as a prefix of
/// `body::ERROR_BODY_MAX_BYTES` (enough to classify it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reading {
    /// Whole, within `body::ENGINE_ANSWER_MAX_BYTES`.
    Buffered,
    /// A fetch response, decoded task by task as it arrives (`wire::decode_locked_tasks_from`).
    Tasks,
    /// A journal, decoded as it arrives within `body::JOURNAL_MAX_BYTES`.
    Journal,
    /// A process definition with its BPMN XML, whole within
    /// `body::PROCESS_DEFINITION_MAX_BYTES`.
    Definition,
    /// A page of activity history, whole within `body::HISTORY_PAGE_MAX_BYTES`.
    History,
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    /// The body of a buffered or non-success answer (empty when it was decoded as it arrived).
    body: Vec<u8>,
    /// What a streamed success answer decoded to.
    decoded: Option<Decoded>,
}

enum Decoded {
    Tasks(Result<wire::LockedTasks, String>),
    Journal(Result<Journal, wire::JournalDecodeError>),
}

impl HttpEngine {
    pub fn new(
        http: reqwest::Client,
        settings: EngineClientSettings,
        tokens: Option<Arc<dyn TokenProvider>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let root = BaseUrl::parse(&settings.engine_url);
        HttpEngine {
            http,
            host: root
                .as_ref()
                .map(|r| r.host().to_string())
                .unwrap_or_default(),
            root,
            worker_id: settings.worker_id.clone(),
            tokens,
            in_flight: Semaphore::new(settings.max_in_flight.max(1)),
            settings,
            metrics,
            headers: None,
        }
    }

    /// Sends `headers` (the operator's headers file) with every engine request.
    pub fn with_headers(mut self, headers: Option<Arc<EngineHeaders>>) -> Self {
        self.headers = headers;
        self
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn task_path(&self, task_id: &str, action: &str) -> String {
        format!("{EXTERNAL_TASKS}/{}/{action}", encode_path_segment(task_id))
    }

    /// The call's URL, written out (for messages).
    fn url_of(&self, call: &Call<'_>) -> String {
        match &self.root {
            Ok(root) => call_url(root, &call.path).to_string(),
            Err(_) => format!("{}{}", self.settings.engine_url, call.path),
        }
    }

    fn new_key(&self) -> String {
        self.settings.random.uuid_v7().to_string()
    }

    /// One exchange, with one forced token refresh and one retry on 401.
    async fn exchange(&self, call: &Call<'_>) -> Result<Answer, EngineError> {
        let mut token = match &self.tokens {
            Some(t) => Some(t.token().await.map_err(|e| EngineError::Auth {
                configuration: e.is_configuration_error(),
                message: e.to_string(),
            })?),
            None => None,
        };
        let mut refreshed = false;
        loop {
            let answer = self.send(call, token.as_ref()).await?;
            if answer.status == StatusCode::UNAUTHORIZED
                && !refreshed
                && let (Some(tokens), Some(sent)) = (&self.tokens, &token)
            {
                refreshed = true;
                token = Some(tokens.refresh_after_rejection(sent).await.map_err(|e| {
                    EngineError::Auth {
                        configuration: e.is_configuration_error(),
                        message: e.to_string(),
                    }
                })?);
                continue;
            }
            if answer.status == StatusCode::FORBIDDEN
                && let (Some(tokens), Some(sent)) = (&self.tokens, &token)
                && serde_json::from_slice::<wire::ErrorBody>(&answer.body)
                    .is_ok_and(|b| b.code.as_deref() == Some("ACCESS_DENIED"))
            {
                // The token lacks a grant: the next call fetches a fresh one, carrying the
                // issuer's current grants, instead of reusing this one until it expires.
                tokens.discard(sent);
            }
            return Ok(answer);
        }
    }

    /// One HTTP exchange; a call about a task (not its heartbeats, which belong to no attempt)
    /// is an exported `engine {op}` span.
    async fn send(&self, call: &Call<'_>, token: Option<&Secret>) -> Result<Answer, EngineError> {
        let span = if call.task_id.is_some() && call.op != "heartbeat" {
            spans::client_call("engine", call.op, &self.host, call.traceparent.as_ref())
        } else {
            tracing::Span::none()
        };
        let traceparent = spans::traceparent_of(&span).or_else(|| {
            call.traceparent
                .as_ref()
                .map(|t| t.child_header(&self.settings.random))
        });
        let result = self
            .send_once(call, token, traceparent)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(answer) => {
                let status = answer.status.as_u16();
                let error = (!answer.status.is_success()).then(|| answer.status.as_str());
                spans::record_client_answer(&span, Some(status), error);
            }
            Err(e) => spans::record_client_answer(&span, None, Some(exchange_error_type(e))),
        }
        result
    }

    async fn send_once(
        &self,
        call: &Call<'_>,
        token: Option<&Secret>,
        traceparent: Option<String>,
    ) -> Result<Answer, EngineError> {
        let _permit = tokio::time::timeout(self.settings.request_timeout, self.in_flight.acquire())
            .await
            .map_err(|_| EngineError::Transient {
                op: call.op,
                request_sent: false,
                message: format!(
                    "no free engine connection within {} ms",
                    self.settings.request_timeout.as_millis()
                ),
            })?
            .expect("engine semaphore is never closed");
        let url = match &self.root {
            Ok(root) => call_url(root, &call.path),
            Err(why) => {
                return Err(EngineError::Transient {
                    op: call.op,
                    request_sent: false,
                    message: format!(
                        "the engine URL {:?} cannot be used ({why}); set ABADA_AGENT_ENGINE_URL to the engine's API root, e.g. http://abada-engine:5601/api",
                        crate::redact::url(&self.settings.engine_url)
                    ),
                });
            }
        };
        let started = Instant::now();
        let mut req = self
            .http
            .request(call.method.clone(), url)
            .timeout(self.settings.request_timeout)
            .header(reqwest::header::ACCEPT, "application/json")
            .header(PROTOCOL_HEADER, PROTOCOL_VERSION);
        if call.method != Method::GET {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(call.body.clone());
        }
        if let Some(headers) = &self.headers {
            for (name, value) in headers.current().iter() {
                req = req.header(name.clone(), value.clone());
            }
        }
        if let Some(key) = &call.idempotency_key {
            req = req.header("Idempotency-Key", key);
        }
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        if let Some(token) = token {
            let mut value =
                HeaderValue::from_str(&format!("Bearer {}", token.expose())).map_err(|_| {
                    EngineError::Auth {
                        configuration: true,
                        message: "the access token holds characters not allowed in a header".into(),
                    }
                })?;
            value.set_sensitive(true);
            req = req.header(reqwest::header::AUTHORIZATION, value);
        }
        let result = match req.send().await {
            Ok(resp) => Self::read_answer(call, resp).await,
            Err(e) => Err(ReadError::Http(e)),
        };
        let took = started.elapsed();
        match result {
            Ok(answer) => {
                self.metrics.observe_engine_request(
                    call.op,
                    answer.status.as_u16().to_string(),
                    took,
                );
                Ok(answer)
            }
            Err(ReadError::TooLarge(too_large)) => {
                self.metrics
                    .observe_engine_request(call.op, "too_large".into(), took);
                Err(EngineError::TooLarge {
                    op: call.op,
                    too_large,
                })
            }
            Err(ReadError::Http(e)) => {
                let kind = if e.is_timeout() { "timeout" } else { "error" };
                self.metrics
                    .observe_engine_request(call.op, kind.into(), took);
                Err(EngineError::Transient {
                    op: call.op,
                    request_sent: !e.is_connect(),
                    message: describe_transport_error(&e, &self.url_of(call)),
                })
            }
        }
    }

    /// Reads an answer's body the way the call asks, never past its limit.
    async fn read_answer(
        call: &Call<'_>,
        mut resp: reqwest::Response,
    ) -> Result<Answer, ReadError> {
        let status = resp.status();
        // Taken, not copied: the body is read from here on, and its length comes from the body.
        let headers = std::mem::take(resp.headers_mut());
        let mut answer = Answer {
            status,
            headers,
            body: Vec::new(),
            decoded: None,
        };
        let subject = call
            .task_id
            .map(|id| format!(" of task {id}"))
            .unwrap_or_default();
        match call.read {
            _ if !status.is_success() => {
                answer.body = body::read_prefix(resp, body::ERROR_BODY_MAX_BYTES).await;
            }
            Reading::Buffered => {
                let what = format!("the {} answer{subject}", call.op);
                answer.body = body::read_capped(resp, body::ENGINE_ANSWER_MAX_BYTES, &what).await?;
            }
            Reading::Definition => {
                let what = format!("the {} answer{subject}", call.op);
                answer.body =
                    body::read_capped(resp, body::PROCESS_DEFINITION_MAX_BYTES, &what).await?;
            }
            Reading::History => {
                let what = format!("the {} answer{subject}", call.op);
                answer.body = body::read_capped(resp, body::HISTORY_PAGE_MAX_BYTES, &what).await?;
            }
            Reading::Tasks => {
                let decoded = body::decode_streamed(
                    resp,
                    body::FETCH_STREAM_MAX_BYTES,
                    "the fetch response",
                    |r| wire::decode_locked_tasks_from(r, body::TASK_MAX_BYTES),
                )
                .await?;
                answer.decoded = Some(Decoded::Tasks(decoded));
            }
            Reading::Journal => {
                let what = format!("the journal{subject}");
                let decoded = body::decode_streamed(resp, body::JOURNAL_MAX_BYTES, &what, |r| {
                    wire::decode_journal_from(r)
                })
                .await?;
                answer.decoded = Some(Decoded::Journal(decoded));
            }
        }
        Ok(answer)
    }

    /// A command: retried with its one idempotency key while the error is transient.
    async fn command(&self, call: Call<'_>) -> Result<Answer, EngineError> {
        let mut attempt = 0u32;
        let mut concurrent_retry_used = false;
        let started = Instant::now();
        loop {
            attempt += 1;
            let (err, answered) = match self.exchange(&call).await {
                Ok(answer) if answer.status.is_success() => return Ok(answer),
                Ok(answer) => (classify(&call, &answer), true),
                Err(e) => (e, false),
            };
            // No answer at all: the engine is away. Keep trying (same key) within the patience.
            let riding_out_outage = !answered
                && matches!(err, EngineError::Transient { .. })
                && started.elapsed() < self.settings.outage_patience;
            if matches!(err, EngineError::ConcurrentModification { .. })
                && call.op == "complete"
                && !concurrent_retry_used
            {
                concurrent_retry_used = true;
                tracing::info!(
                    op = call.op,
                    "engine reported a concurrent modification; retrying the completion once with the same idempotency key"
                );
                continue;
            }
            if let EngineError::IdempotencyConflict { key, .. } = &err {
                tracing::error!(op = call.op, idempotency_key = %key, "idempotency key reused for a different body: this is a worker bug");
            }
            if !err.is_retryable()
                || (attempt >= self.settings.command_attempts && !riding_out_outage)
            {
                return Err(err);
            }
            let wait = match &err {
                EngineError::Throttled {
                    retry_after: Some(d),
                    ..
                } => (*d).min(self.settings.command_backoff.max),
                _ => self
                    .settings
                    .command_backoff
                    .delay(attempt - 1, &self.settings.random),
            };
            let wait = if riding_out_outage {
                // Never past the patience.
                wait.min(
                    self.settings
                        .outage_patience
                        .saturating_sub(started.elapsed()),
                )
            } else {
                wait
            };
            tracing::debug!(op = call.op, attempt, wait_ms = wait.as_millis() as u64, error = %err, "retrying engine command");
            tokio::time::sleep(wait).await;
        }
    }

    /// A locked task larger than the worker takes becomes an incident at once (`failure` with
    /// `retries: 0`, sent once): retrying cannot shrink it, and left locked it would come back
    /// with every fetch after its lease expired. When the report fails, the lease expires and
    /// the next fetch tries again.
    async fn refuse_oversized(&self, task: &wire::OversizedTask) {
        let message = format!(
            "the task is larger than the worker takes: at least {} bytes of variables and agent definition, over the limit of {} bytes; make its variables smaller",
            task.seen, task.limit
        );
        tracing::error!(task_id = %task.id, attempt = task.attempt, seen_bytes = task.seen, limit_bytes = task.limit, "a fetched task is too large to take; reporting it as an incident");
        let call = Call {
            op: "failure",
            method: Method::POST,
            task_id: Some(&task.id),
            path: self.task_path(&task.id, "failure"),
            body: Self::json(&wire::FailureBody {
                worker_id: &self.worker_id,
                error_message: &message,
                error_details: &message,
                retries: 0,
                retry_timeout: 0,
                attempt: task.attempt,
            }),
            idempotency_key: Some(self.new_key()),
            traceparent: None,
            read: Reading::Buffered,
        };
        match self.exchange(&call).await {
            Ok(answer) if answer.status.is_success() => {}
            Ok(answer) => {
                let e = classify(&call, &answer);
                tracing::warn!(task_id = %task.id, error = %e, "the incident for a too large task was not recorded; it comes back after its lease");
            }
            Err(e) => {
                tracing::warn!(task_id = %task.id, error = %e, "the incident for a too large task was not recorded; it comes back after its lease");
            }
        }
    }

    fn json<T: serde::Serialize>(body: &T) -> Bytes {
        Bytes::from(serde_json::to_vec(body).expect("request bodies always serialise"))
    }

    fn trace(task: &TaskRef) -> Option<TraceParent> {
        task.trace_parent.clone()
    }
}

/// The `error.type` of an exchange that got no answer to classify.
/// The root with the call's path set and, after a `?` in it, its query (a path of ours: its
/// segments encoded, its query built from numbers).
fn call_url(root: &BaseUrl, path: &str) -> reqwest::Url {
    match path.split_once('?') {
        Some((path, query)) => {
            let mut url = root.join(path);
            url.set_query(Some(query));
            url
        }
        None => root.join(path),
    }
}

fn exchange_error_type(e: &EngineError) -> &'static str {
    match e {
        EngineError::Transient { .. } => "transport",
        EngineError::MalformedResponse { .. } => "malformed_response",
        EngineError::Auth { .. } => "auth",
        _ => "_OTHER",
    }
}

/// Maps a non-success answer to its typed error (protocol.md A.2, B.2).
fn classify(call: &Call<'_>, answer: &Answer) -> EngineError {
    let op = call.op;
    let body: wire::ErrorBody = serde_json::from_slice(&answer.body).unwrap_or_default();
    let code = body.code.unwrap_or_default();
    let message = body.message.unwrap_or_else(|| {
        String::from_utf8_lossy(&answer.body)
            .chars()
            .take(300)
            .collect()
    });
    let status = answer.status.as_u16();
    let lost = |reason| EngineError::LeaseLost {
        op,
        task_id: call.task_id.unwrap_or_default().to_string(),
        reason,
    };
    match (status, code.as_str()) {
        (403, "WORKER_LOCK_NOT_OWNED") => lost(LeaseLostReason::NotOwned),
        (409, "WORKER_LOCK_EXPIRED") => lost(LeaseLostReason::Expired),
        (409, "STALE_ATTEMPT") => lost(LeaseLostReason::StaleAttempt),
        (409, "JOURNAL_CONFLICT") => lost(LeaseLostReason::JournalConflict),
        (400, "ENGINE_COMMAND_REJECTED")
            if message.starts_with("External task is not locked")
                || message.starts_with("External task not found") =>
        {
            lost(LeaseLostReason::NotLocked)
        }
        (409, "CONCURRENT_MODIFICATION") => EngineError::ConcurrentModification { op },
        (400, "IDEMPOTENCY_CONFLICT") => EngineError::IdempotencyConflict {
            op,
            key: call.idempotency_key.clone().unwrap_or_default(),
        },
        (401, _) => EngineError::Unauthenticated { op, message },
        (403, "ACCESS_DENIED") => EngineError::AccessDenied { op, message },
        (400, "INVALID_REQUEST") => EngineError::InvalidRequest { op, message },
        (404, _) => EngineError::NotFound { op, code, message },
        (429, _) | (503, _) => EngineError::Throttled {
            op,
            status,
            retry_after: retry_after(&answer.headers),
        },
        (500..=599, _) => EngineError::Transient {
            op,
            request_sent: true,
            message: format!("HTTP {status} {code}: {message}"),
        },
        _ => EngineError::Rejected {
            op,
            status,
            code,
            message,
        },
    }
}

/// The typed error for a non-success answer of `op` about `task_id` (for the property tests and
/// fuzz targets through [`crate::decoders`]).
pub(crate) fn classify_answer(
    op: &'static str,
    task_id: Option<&str>,
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
) -> EngineError {
    let call = Call {
        op,
        method: Method::POST,
        task_id,
        path: String::new(),
        body: Bytes::new(),
        idempotency_key: Some("decoder-key".into()),
        traceparent: None,
        read: Reading::Buffered,
    };
    classify(
        &call,
        &Answer {
            status,
            headers,
            body,
            decoded: None,
        },
    )
}

/// `Retry-After` in seconds or as an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let raw = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = raw.parse::<u64>() {
        return Some(Duration::from_secs(secs.min(24 * 3600)));
    }
    let when = httpdate::parse_http_date(raw).ok()?;
    Some(
        when.duration_since(std::time::SystemTime::now())
            .unwrap_or_default()
            .min(Duration::from_secs(24 * 3600)),
    )
}

fn describe_transport_error(e: &reqwest::Error, url: &str) -> String {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_body() || e.is_decode() {
        "lost the response body"
    } else {
        "failed"
    };
    // The top error repeats the URL; its sources say what went wrong.
    let detail = std::error::Error::source(e)
        .map(crate::redact::error_text)
        .unwrap_or_default();
    format!("POST {} {what}: {detail}", crate::redact::url(url))
}

/// Percent-encodes a task id as one path segment.
fn encode_path_segment(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for b in raw.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The longest id the process API's reads put in a path.
const MAX_PATH_ID_BYTES: usize = 512;

/// An id the engine sent (an instance's, a definition's) as one path segment, or an error: empty,
/// `.` and `..` would make another path of the URL (a dot segment is resolved, even escaped), so
/// they are refused, as is an id over [`MAX_PATH_ID_BYTES`].
fn usable_id(op: &'static str, field: &str, id: &str) -> Result<String, EngineError> {
    if id.is_empty() || id == "." || id == ".." || id.len() > MAX_PATH_ID_BYTES {
        let shown: String = id.chars().take(64).collect();
        return Err(EngineError::MalformedResponse {
            op,
            detail: format!(
                "the engine's {field} {shown:?} cannot name a resource in a URL (empty, a dot segment or over {MAX_PATH_ID_BYTES} bytes)"
            ),
        });
    }
    Ok(encode_path_segment(id))
}

/// What a refused journal append means. The step's key is (task, attempt, seq): an idempotency
/// conflict means another writer with our worker id and attempt took this seq with a different
/// step, so the journal moved on without us, as with 409 JOURNAL_CONFLICT.
pub(crate) fn journal_append_refusal(task: &TaskRef, error: EngineError) -> EngineError {
    match error {
        EngineError::IdempotencyConflict { .. } => EngineError::LeaseLost {
            op: "journal-append",
            task_id: task.task_id.clone(),
            reason: LeaseLostReason::JournalConflict,
        },
        other => other,
    }
}

/// The idempotency key of a journal append: stable per step, so a retried append is recognised
/// by (task, attempt, seq) and answered as the first one was. The simulator's engine sends the
/// same key, so both see a retried append alike.
pub(crate) fn journal_append_key(task: &TaskRef, step: &JournalStep) -> String {
    format!(
        "abada-journal:{}:{}:{}",
        task.task_id,
        task.attempt.unwrap_or(0),
        step.seq
    )
}

#[async_trait]
impl Engine for HttpEngine {
    /// `GET {ENGINE_URL}`: any HTTP answer, whatever its status (the API root usually answers
    /// 404 or 401), proves the engine is there; only a transport error or a timeout does not.
    /// Unauthenticated and outside the connection bound: it locks nothing and carries no body.
    async fn probe(&self) -> ProbeOutcome {
        let url = self.settings.engine_url.trim_end_matches('/');
        let sent = self
            .http
            .get(url)
            .timeout(self.settings.request_timeout)
            .header(PROTOCOL_HEADER, PROTOCOL_VERSION)
            .send()
            .await;
        match sent {
            Ok(_) => ProbeOutcome::Reachable,
            Err(_) => ProbeOutcome::Unreachable,
        }
    }

    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        let op = "fetch-and-lock";
        let call = Call {
            op,
            method: Method::POST,
            task_id: None,
            path: format!("{EXTERNAL_TASKS}/fetch-and-lock"),
            body: Self::json(&wire::FetchAndLockBody {
                worker_id: &self.worker_id,
                topics: &request.topics,
                lock_duration: request.lock_duration.as_millis() as u64,
                max_tasks: request.max_tasks,
            }),
            idempotency_key: Some(self.new_key()),
            traceparent: Some(TraceParent::new_root(&self.settings.random)),
            read: Reading::Tasks,
        };
        let started = Instant::now();
        // A lost response is retried once with the same key: the engine replays what it locked.
        let mut answer = self.exchange(&call).await;
        let retry = match &answer {
            Err(EngineError::Transient { request_sent, .. }) => *request_sent,
            Ok(a) => a.status.is_server_error() && a.status != StatusCode::SERVICE_UNAVAILABLE,
            Err(_) => false,
        };
        if retry {
            tracing::debug!(
                "fetch-and-lock response lost; retrying once with the same idempotency key"
            );
            answer = self.exchange(&call).await;
        }
        self.metrics
            .fetch_duration
            .observe(started.elapsed().as_secs_f64());
        let answer = answer?;
        if !answer.status.is_success() {
            return Err(classify(&call, &answer));
        }
        let version = answer
            .headers
            .get(PROTOCOL_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        if version != Some(PROTOCOL_VERSION) {
            return Err(EngineError::UnsupportedProtocolVersion {
                op,
                got: version.map(str::to_string),
            });
        }
        let read = match answer.decoded {
            Some(Decoded::Tasks(read)) => read,
            _ => Err("the answer was not read as tasks (a worker bug)".to_string()),
        }
        .map_err(|detail| EngineError::MalformedResponse { op, detail })?;
        for problem in read.rejected {
            tracing::error!(problem = %problem, "engine sent a locked task the worker cannot read; it is left to expire and be retried");
        }
        for oversized in read.oversized {
            self.refuse_oversized(&oversized).await;
        }
        Ok(read.tasks)
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        let call = Call {
            op: "heartbeat",
            method: Method::POST,
            task_id: Some(&task.task_id),
            path: self.task_path(&task.task_id, "heartbeat"),
            body: Self::json(&wire::HeartbeatBody {
                worker_id: &self.worker_id,
                lock_duration: lock_duration.as_millis() as u64,
                attempt: task.attempt,
            }),
            // Fresh per heartbeat: a reused key would be answered from storage and extend nothing.
            idempotency_key: Some(self.new_key()),
            traceparent: Self::trace(task),
            read: Reading::Buffered,
        };
        let answer = self.exchange(&call).await?;
        if answer.status.is_success() {
            Ok(())
        } else {
            Err(classify(&call, &answer))
        }
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        self.command(Call {
            op: "complete",
            method: Method::POST,
            task_id: Some(&task.task_id),
            path: self.task_path(&task.task_id, "complete"),
            body: Self::json(&wire::CompleteBody {
                worker_id: &self.worker_id,
                variables,
                attempt: task.attempt,
            }),
            idempotency_key: Some(self.new_key()),
            traceparent: Self::trace(task),
            read: Reading::Buffered,
        })
        .await
        .map(|_| ())
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        self.command(Call {
            op: "failure",
            method: Method::POST,
            task_id: Some(&task.task_id),
            path: self.task_path(&task.task_id, "failure"),
            body: Self::json(&wire::FailureBody {
                worker_id: &self.worker_id,
                error_message: &report.error_message,
                error_details: &report.error_details,
                retries: report.retries,
                retry_timeout: report.retry_timeout.as_millis() as u64,
                attempt: task.attempt,
            }),
            idempotency_key: Some(self.new_key()),
            traceparent: Self::trace(task),
            read: Reading::Buffered,
        })
        .await
        .map(|_| ())
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        self.command(Call {
            op: "bpmn-error",
            method: Method::POST,
            task_id: Some(&task.task_id),
            path: self.task_path(&task.task_id, "bpmn-error"),
            body: Self::json(&wire::BpmnErrorBody {
                worker_id: &self.worker_id,
                error_code: &report.error_code,
                error_message: &report.error_message,
                variables: &report.variables,
                attempt: task.attempt,
            }),
            idempotency_key: Some(self.new_key()),
            traceparent: Self::trace(task),
            read: Reading::Buffered,
        })
        .await
        .map(|_| ())
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        let op = "journal-read";
        let answer = self
            .command(Call {
                op,
                method: Method::POST,
                task_id: Some(&task.task_id),
                path: self.task_path(&task.task_id, "journal/read"),
                body: Self::json(&wire::JournalReadBody {
                    worker_id: &self.worker_id,
                    attempt: task.attempt,
                }),
                idempotency_key: None,
                traceparent: Self::trace(task),
                read: Reading::Journal,
            })
            .await?;
        match answer.decoded {
            Some(Decoded::Journal(Ok(journal))) => Ok(journal),
            Some(Decoded::Journal(Err(wire::JournalDecodeError::TooManySteps))) => {
                Err(EngineError::TooLarge {
                    op,
                    too_large: body::TooLarge {
                        what: format!("the journal of task {}", task.task_id),
                        limit: body::JOURNAL_MAX_STEPS,
                        seen: body::JOURNAL_MAX_STEPS as u64 + 1,
                        unit: body::STEPS,
                    },
                })
            }
            Some(Decoded::Journal(Err(wire::JournalDecodeError::Malformed(e)))) => {
                Err(EngineError::MalformedResponse {
                    op,
                    detail: format!("journal of task {}: {e}", task.task_id),
                })
            }
            _ => Err(EngineError::MalformedResponse {
                op,
                detail: "the answer was not read as a journal (a worker bug)".into(),
            }),
        }
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        let answer = self
            .command(Call {
                op: "journal-append",
                method: Method::POST,
                task_id: Some(&task.task_id),
                path: self.task_path(&task.task_id, "journal"),
                body: Self::json(&wire::JournalAppendBody {
                    worker_id: &self.worker_id,
                    attempt: task.attempt,
                    step,
                }),
                idempotency_key: Some(journal_append_key(task, step)),
                traceparent: Self::trace(task),
                read: Reading::Buffered,
            })
            .await
            .map_err(|e| journal_append_refusal(task, e))?;
        Ok(if answer.status == StatusCode::CREATED {
            AppendOutcome::Created
        } else {
            AppendOutcome::AlreadyPresent
        })
    }

    /// A read: retried like a command on transient errors (it changes nothing), no key.
    async fn process_instance(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<ProcessInstance, EngineError> {
        let op = OP_PROCESS_INSTANCE;
        let id = usable_id(op, "processInstanceId", instance_id)?;
        let answer = self
            .command(Call {
                op,
                method: Method::GET,
                task_id: Some(&task.task_id),
                path: format!("{PROCESSES}/instances/{id}"),
                body: Bytes::new(),
                idempotency_key: None,
                traceparent: Self::trace(task),
                read: Reading::Buffered,
            })
            .await?;
        wire::decode_process_instance(&answer.body).map_err(|detail| {
            EngineError::MalformedResponse {
                op,
                detail: format!("process instance {instance_id:?}: {detail}"),
            }
        })
    }

    async fn process_definition(
        &self,
        task: &TaskRef,
        definition_id: &str,
    ) -> Result<ProcessDefinition, EngineError> {
        let op = OP_PROCESS_DEFINITION;
        let id = usable_id(op, "processDefinitionId", definition_id)?;
        let answer = self
            .command(Call {
                op,
                method: Method::GET,
                task_id: Some(&task.task_id),
                path: format!("{PROCESSES}/{id}"),
                body: Bytes::new(),
                idempotency_key: None,
                traceparent: Self::trace(task),
                read: Reading::Definition,
            })
            .await?;
        wire::decode_process_definition(&answer.body).map_err(|detail| {
            EngineError::MalformedResponse {
                op,
                detail: format!("process definition {definition_id:?}: {detail}"),
            }
        })
    }

    /// A read: retried like a command on transient errors, no key.
    async fn process_history(
        &self,
        task: &TaskRef,
        instance_id: &str,
        page: u32,
    ) -> Result<HistoryPage, EngineError> {
        let op = OP_PROCESS_HISTORY;
        let id = usable_id(op, "processInstanceId", instance_id)?;
        let answer = self
            .command(Call {
                op,
                method: Method::GET,
                task_id: Some(&task.task_id),
                path: format!(
                    "{PROCESS_INSTANCES}/{id}/history?page={page}&size={HISTORY_PAGE_SIZE}"
                ),
                body: Bytes::new(),
                idempotency_key: None,
                traceparent: Self::trace(task),
                read: Reading::History,
            })
            .await?;
        let total_pages = answer
            .headers
            .get("x-total-pages")
            .map(|v| v.to_str().unwrap_or("(not text)"));
        wire::decode_history_page(&answer.body, total_pages).map_err(|detail| {
            EngineError::MalformedResponse {
                op,
                detail: format!("activity history of process instance {instance_id:?}: {detail}"),
            }
        })
    }

    /// Sent on the bare client: no token and none of the operator's headers, so the engine sees
    /// a caller with no identity. Once, not retried: a transport error is the caller's to retry.
    async fn anonymous_history_read(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<AnonymousAccess, EngineError> {
        let op = OP_PROCESS_HISTORY;
        let id = usable_id(op, "processInstanceId", instance_id)?;
        let root = self.root.as_ref().map_err(|why| EngineError::Transient {
            op,
            request_sent: false,
            message: format!("the engine URL cannot be used ({why})"),
        })?;
        let url = call_url(
            root,
            &format!("{PROCESS_INSTANCES}/{id}/history?page=0&size=1"),
        );
        let shown = url.to_string();
        let sent = self
            .http
            .get(url)
            .timeout(self.settings.request_timeout)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await;
        let status = match sent {
            Ok(resp) => resp.status(),
            Err(e) => {
                return Err(EngineError::Transient {
                    op,
                    request_sent: !e.is_connect(),
                    message: format!(
                        "an unauthenticated read of the activity history for task {}: {}",
                        task.task_id,
                        describe_transport_error(&e, &shown)
                    ),
                });
            }
        };
        match status.as_u16() {
            401 | 403 => Ok(AnonymousAccess::Refused),
            200..=299 | 404 => Ok(AnonymousAccess::Answered),
            other => Err(EngineError::Transient {
                op,
                request_sent: true,
                message: format!(
                    "an unauthenticated read of the activity history answered HTTP {other}"
                ),
            }),
        }
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        let op = "tool-credentials";
        let answer = self
            .command(Call {
                op,
                method: Method::POST,
                task_id: Some(&task.task_id),
                path: self.task_path(&task.task_id, "tool-credentials"),
                body: Self::json(&wire::ToolCredentialBody {
                    worker_id: &self.worker_id,
                    attempt: task.attempt,
                    server,
                }),
                idempotency_key: Some(self.new_key()),
                traceparent: Self::trace(task),
                read: Reading::Buffered,
            })
            .await?;
        wire::decode_tool_credential(&answer.body).ok_or_else(|| EngineError::MalformedResponse {
            op,
            // Never echo the body: it may hold a token.
            detail: format!(
                "tool credential for server {server:?} of task {} is not {{\"token\", \"expiresAt\"}}",
                task.task_id
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_process_read_names_the_scope_it_needs() {
        let mut c = call();
        c.op = OP_PROCESS_DEFINITION;
        let e = classify(
            &c,
            &answer(403, r#"{"code":"ACCESS_DENIED","message":"Access denied"}"#),
        );
        assert!(matches!(e, EngineError::AccessDenied { .. }));
        assert!(
            e.to_string().contains("needs the process:read scope"),
            "{e}"
        );
        let e = classify(&call(), &answer(403, r#"{"code":"ACCESS_DENIED"}"#));
        assert!(
            e.to_string().contains("needs the worker:execute scope"),
            "{e}"
        );
    }

    #[test]
    fn a_process_id_never_makes_another_path() {
        assert_eq!(usable_id("p", "f", "a/../b").unwrap(), "a%2F..%2Fb");
        assert_eq!(usable_id("p", "f", "%2e%2e").unwrap(), "%252e%252e");
        for bad in ["", ".", ".."] {
            let e = usable_id("p", "processDefinitionId", bad).unwrap_err();
            assert!(e.to_string().contains("dot segment"), "{e}");
        }
        assert!(usable_id("p", "f", &"x".repeat(MAX_PATH_ID_BYTES + 1)).is_err());
        // What the URL parser makes of what is sent: still one segment under /v1/processes/.
        for id in ["a/../b", "..%2f", "%2e%2e", "?x=1#y", "a b"] {
            let url = reqwest::Url::parse(&format!(
                "http://e/api/v1/processes/{}",
                usable_id("p", "f", id).unwrap()
            ))
            .unwrap();
            let segments: Vec<&str> = url.path_segments().unwrap().collect();
            assert_eq!(segments.len(), 4, "{id:?} -> {url}");
            assert_eq!(&segments[..3], ["api", "v1", "processes"]);
            assert!(url.query().is_none() && url.fragment().is_none());
        }
    }

    #[test]
    fn task_ids_are_encoded_as_one_segment() {
        assert_eq!(encode_path_segment("c0a8-1"), "c0a8-1");
        assert_eq!(encode_path_segment("a/b c?"), "a%2Fb%20c%3F");
        assert_eq!(encode_path_segment("é"), "%C3%A9");
    }

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: HeaderMap::new(),
            body: body.as_bytes().to_vec(),
            decoded: None,
        }
    }

    fn call() -> Call<'static> {
        Call {
            op: "complete",
            method: Method::POST,
            task_id: Some("t1"),
            path: String::new(),
            body: Bytes::new(),
            idempotency_key: Some("k1".into()),
            traceparent: None,
            read: Reading::Buffered,
        }
    }

    #[test]
    fn every_row_of_the_refusal_table_is_typed() {
        let c = call();
        let lost = |s, b: &str| classify(&c, &answer(s, b)).lease_lost();
        assert_eq!(
            lost(403, r#"{"code":"WORKER_LOCK_NOT_OWNED"}"#),
            Some(LeaseLostReason::NotOwned)
        );
        assert_eq!(
            lost(409, r#"{"code":"WORKER_LOCK_EXPIRED"}"#),
            Some(LeaseLostReason::Expired)
        );
        assert_eq!(
            lost(409, r#"{"code":"STALE_ATTEMPT"}"#),
            Some(LeaseLostReason::StaleAttempt)
        );
        assert_eq!(
            lost(409, r#"{"code":"JOURNAL_CONFLICT"}"#),
            Some(LeaseLostReason::JournalConflict)
        );
        assert_eq!(
            lost(
                400,
                r#"{"code":"ENGINE_COMMAND_REJECTED","message":"External task is not locked: t1"}"#
            ),
            Some(LeaseLostReason::NotLocked)
        );
        assert_eq!(
            lost(
                400,
                r#"{"code":"ENGINE_COMMAND_REJECTED","message":"External task not found: t1"}"#
            ),
            Some(LeaseLostReason::NotLocked)
        );
        assert!(matches!(
            classify(
                &c,
                &answer(
                    400,
                    r#"{"code":"ENGINE_COMMAND_REJECTED","message":"other"}"#
                )
            ),
            EngineError::Rejected { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(409, r#"{"code":"CONCURRENT_MODIFICATION"}"#)),
            EngineError::ConcurrentModification { .. }
        ));
        assert!(
            matches!(classify(&c, &answer(400, r#"{"code":"IDEMPOTENCY_CONFLICT"}"#)), EngineError::IdempotencyConflict { ref key, .. } if key == "k1")
        );
        assert!(matches!(
            classify(&c, &answer(401, r#"{"code":"AUTHENTICATION_REQUIRED"}"#)),
            EngineError::Unauthenticated { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(403, r#"{"code":"ACCESS_DENIED"}"#)),
            EngineError::AccessDenied { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(400, r#"{"code":"INVALID_REQUEST"}"#)),
            EngineError::InvalidRequest { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(404, r#"{"code":"RESOURCE_NOT_FOUND"}"#)),
            EngineError::NotFound { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(502, "<html>bad gateway</html>")),
            EngineError::Transient { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(503, "")),
            EngineError::Throttled { .. }
        ));
        assert!(matches!(
            classify(&c, &answer(429, "not json")),
            EngineError::Throttled { .. }
        ));
    }
}
