//! The devkit MCP tool server: a small, faithful order service built with rmcp's streamable HTTP
//! server, mounted in axum on a loopback port, with counters and fault injection for tests and
//! the demo.
//!
//! Tools: `lookup_order` (read-only: `readOnlyHint: true`), `issue_refund` (a write that honours
//! `_meta["io.abada/idempotency-key"]`: a repeated key returns the first result and applies
//! nothing), and `echo` (read-only, returns its arguments).
//!
//! Sessions: MCP 2026-07-28 has no sessions, so a server that speaks it gives a client nothing to
//! close and "zero open sessions after a run" would be a vacuous check. This server therefore
//! advertises only the protocol versions that have the `initialize` handshake (up to
//! 2025-11-25) and runs rmcp in stateful mode: each client gets an `Mcp-Session-Id`, and a
//! session is open from its `initialize` until the client's HTTP DELETE (or an injected expiry).
//! [`ToolServerCounters::sessions_open`] is the number of sessions rmcp's session manager holds.
//!
//! Every request must carry `Authorization: Bearer <token>` that the configured
//! [`CredentialValidator`] accepts for this server's name (or none at all on a server started
//! [`ToolServerOptions::anonymous`]); anything else gets HTTP 401 with a
//! `WWW-Authenticate: Bearer` challenge.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeRequestParams, InitializeResult, JsonObject, ListToolsResult, PaginatedRequestParams,
    ProtocolVersion, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The `_meta` key of an idempotency key (protocol.md B.2).
const IDEMPOTENCY_KEY_META: &str = "io.abada/idempotency-key";

/// Decides whether a bearer token is a valid credential for a tool server.
pub trait CredentialValidator: Send + Sync {
    fn validate(&self, server: &str, token: &str) -> bool;
}

/// Accepts any non-empty token.
#[derive(Clone, Copy, Debug, Default)]
pub struct AcceptAny;

impl CredentialValidator for AcceptAny {
    fn validate(&self, _server: &str, token: &str) -> bool {
        !token.is_empty()
    }
}

/// Accepts a fixed set of tokens, whatever the server name.
#[derive(Clone, Debug, Default)]
pub struct StaticTokens(HashSet<String>);

impl StaticTokens {
    pub fn new(tokens: impl IntoIterator<Item = impl Into<String>>) -> Self {
        StaticTokens(tokens.into_iter().map(Into::into).collect())
    }
}

impl CredentialValidator for StaticTokens {
    fn validate(&self, _server: &str, token: &str) -> bool {
        self.0.contains(token)
    }
}

/// How to start a [`ToolServer`].
#[derive(Clone)]
pub struct ToolServerOptions {
    /// The server's name as agents and the engine know it (passed to the validator).
    pub name: String,
    pub validator: Arc<dyn CredentialValidator>,
    /// Requests without `Authorization` are served too (a server registered with
    /// `auth = "none"`); a bearer token, when one is sent, must still pass the validator.
    pub anonymous: bool,
}

impl ToolServerOptions {
    pub fn new(name: impl Into<String>, validator: Arc<dyn CredentialValidator>) -> Self {
        ToolServerOptions {
            name: name.into(),
            validator,
            anonymous: false,
        }
    }

    /// The same server, serving requests without a credential too.
    pub fn anonymous(mut self) -> Self {
        self.anonymous = true;
        self
    }
}

/// Why the tool server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ToolServerError {
    #[error("cannot bind the devkit tool server on 127.0.0.1:0: {0}")]
    Bind(#[source] std::io::Error),
}

/// What the server received about one `tools/call`.
#[derive(Clone, Debug, PartialEq)]
pub struct CallRecord {
    pub tool: String,
    pub arguments: Value,
    /// `_meta["io.abada/idempotency-key"]`, as received.
    pub idempotency_key: Option<String>,
    /// `_meta.traceparent`, as received.
    pub traceparent: Option<String>,
    /// The bearer token of the HTTP request. A test credential, so kept in clear for assertions.
    pub token: Option<String>,
    /// The `Mcp-Session-Id` the call came in on.
    pub session_id: Option<String>,
}

/// A snapshot of the server's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolServerCounters {
    /// Refunds really applied (keyed and unkeyed).
    pub writes_applied: u64,
    /// Refunds applied without an idempotency key.
    pub writes_unkeyed: u64,
    /// Refund calls whose key had been seen: answered from storage, nothing applied.
    pub duplicates: u64,
    /// Duplicates per key.
    pub duplicates_per_key: HashMap<String, u64>,
    /// `tools/call` requests per tool name (unknown names included).
    pub calls_per_tool: HashMap<String, u64>,
    /// Sessions created by an `initialize` handshake.
    pub sessions_opened: u64,
    /// Sessions a client closed with HTTP DELETE.
    pub sessions_closed: u64,
    /// Sessions dropped by [`ToolServer::expire_sessions`].
    pub sessions_expired: u64,
    /// Sessions the session manager holds now.
    pub sessions_open: u64,
    /// Requests refused with 401.
    pub unauthorized: u64,
}

#[derive(Default)]
struct Records {
    counters: ToolServerCounters,
    /// First result per idempotency key.
    refunds: HashMap<String, CallToolResult>,
    calls: Vec<CallRecord>,
}

#[derive(Default)]
struct Faults {
    down: AtomicBool,
    error_results: AtomicBool,
    latency: Mutex<Duration>,
    /// Per tool: the call takes effect at once and its answer comes this much later.
    answer_latency: Mutex<HashMap<String, Duration>>,
    /// Delay before a DELETE (a session close) is looked at: its credential is checked, and
    /// the session dropped, only after it.
    close_latency: Mutex<Duration>,
    oversized: Mutex<Option<usize>>,
    /// Armed by [`ToolServer::hold_next_write`]: the next refund that is applied keeps its answer.
    hold_armed: AtomicBool,
    /// True while an applied refund's answer is held (until [`ToolServer::release_held`]).
    holding: tokio::sync::watch::Sender<bool>,
    /// While true, a request opening a session (a POST without a session id) waits.
    hold_openings: tokio::sync::watch::Sender<bool>,
    /// Requests opening a session that have arrived (held or not).
    openings: tokio::sync::watch::Sender<u64>,
}

impl Faults {
    fn get(delay: &Mutex<Duration>) -> Duration {
        // A delay is one plain value: a panic elsewhere cannot leave it half-written.
        *delay.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(delay: &Mutex<Duration>, value: Duration) {
        *delay.lock().unwrap_or_else(|p| p.into_inner()) = value;
    }
}

struct Shared {
    name: String,
    validator: Arc<dyn CredentialValidator>,
    anonymous: bool,
    /// The credential each session was opened with: its owner may always close it (DELETE),
    /// even after the credential died with the task's lease.
    session_tokens: Mutex<HashMap<String, String>>,
    records: Mutex<Records>,
    faults: Faults,
    sessions: Arc<LocalSessionManager>,
    /// The tools offered ([`ToolServer::offer_only`]); all of them when `None`.
    offered: Mutex<Option<HashSet<String>>>,
}

impl Shared {
    /// The tools listed now.
    fn tools(&self) -> Vec<Tool> {
        let offered = self.offered.lock().unwrap_or_else(|p| p.into_inner());
        tool_list()
            .into_iter()
            .filter(|t| offered.as_ref().is_none_or(|o| o.contains(t.name.as_ref())))
            .collect()
    }
}

impl Shared {
    fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        // A panic while holding this lock can only come from a bug in this file; the data is
        // counters, still usable.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running devkit tool server; clones share it.
#[derive(Clone)]
pub struct ToolServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: CancellationToken,
    task: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl ToolServer {
    /// Binds 127.0.0.1:0 and serves MCP on `/mcp`.
    pub async fn start(options: ToolServerOptions) -> Result<ToolServer, ToolServerError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(ToolServerError::Bind)?;
        let addr = listener.local_addr().map_err(ToolServerError::Bind)?;
        let shared = Arc::new(Shared {
            name: options.name,
            validator: options.validator,
            anonymous: options.anonymous,
            session_tokens: Mutex::new(HashMap::new()),
            records: Mutex::new(Records::default()),
            faults: Faults::default(),
            sessions: Arc::new(LocalSessionManager::default()),
            offered: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        let handler = OrderTools {
            shared: shared.clone(),
        };
        let mcp = StreamableHttpService::new(
            move || Ok(handler.clone()),
            shared.sessions.clone(),
            StreamableHttpServerConfig::default()
                .with_allowed_hosts(["127.0.0.1", "localhost"])
                .with_sse_keep_alive(None)
                .with_cancellation_token(stop.child_token()),
        );
        let app = axum::Router::new()
            .nest_service("/mcp", mcp)
            .layer(middleware::from_fn_with_state(shared.clone(), gate));
        let listener = GatedListener {
            inner: listener,
            shared: shared.clone(),
        };
        let shutdown = stop.clone();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled_owned().await })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "devkit tool server stopped with an error");
            }
        });
        Ok(ToolServer {
            shared,
            addr,
            stop,
            task: Arc::new(Mutex::new(Some(task))),
        })
    }

    /// The MCP endpoint, `http://127.0.0.1:<port>/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A snapshot of the counters, with the number of sessions open now.
    pub async fn counters(&self) -> ToolServerCounters {
        let open = self.shared.sessions.sessions.read().await.len() as u64;
        let mut counters = self.shared.records().counters.clone();
        counters.sessions_open = open;
        counters
    }

    /// Every `tools/call` received, in order.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.shared.records().calls.clone()
    }

    /// The idempotency key of every call of `tool` received, in order (None: sent unkeyed).
    pub fn keys_sent(&self, tool: &str) -> Vec<Option<String>> {
        self.shared
            .records()
            .calls
            .iter()
            .filter(|c| c.tool == tool)
            .map(|c| c.idempotency_key.clone())
            .collect()
    }

    /// Down: new connections are accepted and dropped at once, and requests on connections
    /// already open get 503. Up again with `false`.
    pub fn set_down(&self, down: bool) {
        self.shared.faults.down.store(down, Ordering::SeqCst);
    }

    /// Offers only `tools` from now on (listed and callable; a call of another is answered as
    /// an unknown tool), as a server exposing fewer tools would: an agent that should see a
    /// lookup and a write, and nothing else.
    pub fn offer_only(&self, tools: &[&str]) {
        *self
            .shared
            .offered
            .lock()
            .unwrap_or_else(|p| p.into_inner()) =
            Some(tools.iter().map(|t| t.to_string()).collect());
    }

    /// Delay before answering every `tools/call`.
    pub fn set_latency(&self, latency: Duration) {
        Faults::set(&self.shared.faults.latency, latency);
    }

    /// A slow `tool`: each call of it takes effect at once (a refund is applied) and its answer
    /// comes `latency` later, so a client that gives up first has a write applied whose answer it
    /// never saw. `Duration::ZERO` makes it prompt again.
    pub fn set_answer_latency(&self, tool: &str, latency: Duration) {
        let mut per_tool = self
            .shared
            .faults
            .answer_latency
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if latency.is_zero() {
            per_tool.remove(tool);
        } else {
            per_tool.insert(tool.to_string(), latency);
        }
    }

    /// Delay before every DELETE (session close) is checked and served: a close still in
    /// flight when a test looks shows as a session still open.
    pub fn set_close_latency(&self, latency: Duration) {
        Faults::set(&self.shared.faults.close_latency, latency);
    }

    /// The next `issue_refund` that is applied (a new key, or none) keeps its answer until
    /// [`ToolServer::release_held`]: the write is done, its caller does not know it yet. A
    /// worker waiting there is a worker frozen between its keyed write and journaling its result.
    pub fn hold_next_write(&self) {
        self.shared.faults.hold_armed.store(true, Ordering::SeqCst);
    }

    /// Waits until an answer is held.
    pub async fn holding(&self) {
        let mut rx = self.shared.faults.holding.subscribe();
        let _ = rx.wait_for(|held| *held).await;
    }

    /// Lets a held answer go.
    pub fn release_held(&self) {
        self.shared.faults.holding.send_replace(false);
    }

    /// While on, every request that opens a session (a POST without a session id: `initialize`
    /// or `server/discover`) waits, unanswered, until it is turned off: an opening stuck in the
    /// middle of its negotiation.
    pub fn hold_openings(&self, on: bool) {
        self.shared.faults.hold_openings.send_replace(on);
    }

    /// Waits until at least `n` requests opening a session have arrived.
    pub async fn openings_arrived(&self, n: u64) {
        let mut rx = self.shared.faults.openings.subscribe();
        let _ = rx.wait_for(|seen| *seen >= n).await;
    }

    /// Requests opening a session that have arrived so far.
    pub fn openings(&self) -> u64 {
        *self.shared.faults.openings.borrow()
    }

    /// When on, every `tools/call` answers a result with `isError: true` and applies nothing.
    pub fn set_error_results(&self, on: bool) {
        self.shared.faults.error_results.store(on, Ordering::SeqCst);
    }

    /// When set, every `tools/call` result gets an extra text block of this many bytes.
    pub fn set_oversized_results(&self, bytes: Option<usize>) {
        *self
            .shared
            .faults
            .oversized
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = bytes;
    }

    /// Forgets every session now: the next request on one gets HTTP 404.
    pub async fn expire_sessions(&self) {
        let mut sessions = self.shared.sessions.sessions.write().await;
        let n = sessions.len() as u64;
        sessions.clear();
        drop(sessions);
        self.shared.records().counters.sessions_expired += n;
    }

    /// Stops the server and waits (at most 5 s) for it to finish.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// Accepts connections with TCP_NODELAY set (a pooled client otherwise waits on Nagle plus
/// delayed ACK, about 40 ms per call), and drops them at once while the server is down.
struct GatedListener {
    inner: TcpListener,
    shared: Arc<Shared>,
}

impl axum::serve::Listener for GatedListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    if self.shared.faults.down.load(Ordering::SeqCst) {
                        drop(stream);
                        continue;
                    }
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                    }
                    return (stream, addr);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "devkit tool server accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// Faults and authentication in front of rmcp; counts session closes (DELETE answered 2xx).
async fn gate(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if shared.faults.down.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "the tool server is down").into_response();
    }
    let is_delete = request.method() == Method::DELETE;
    if is_delete {
        let delay = Faults::get(&shared.faults.close_latency);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
    let session_id = request
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if request.method() == Method::POST && session_id.is_none() {
        shared.faults.openings.send_modify(|n| *n += 1);
        let mut held = shared.faults.hold_openings.subscribe();
        let _ = held.wait_for(|on| !*on).await;
    }
    let token = bearer(request.headers()).map(str::to_owned);
    let owner_closes = is_delete
        && match (&session_id, &token) {
            (Some(id), Some(token)) => shared
                .session_tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(id)
                .is_some_and(|owner| owner == token),
            _ => false,
        };
    let authorized = owner_closes
        || match token.as_deref() {
            Some(token) => shared.validator.validate(&shared.name, token),
            None => shared.anonymous,
        };
    if !authorized {
        shared.records().counters.unauthorized += 1;
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer error=\"invalid_token\"")],
            "a valid bearer credential for this tool server is required",
        )
            .into_response();
    }
    let request = match parse_error(request).await {
        Ok(request) => request,
        Err(refusal) => return refusal,
    };
    let response = next.run(request).await;
    if is_delete && response.status().is_success() {
        shared.records().counters.sessions_closed += 1;
    }
    if let (Some(opened), Some(token)) = (
        response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok()),
        token,
    ) {
        shared
            .session_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(opened.to_owned())
            .or_insert(token);
    }
    response
}

/// The largest request body the server reads (rmcp's own default cap is larger; no test sends
/// more than a few KiB).
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// A POST whose body is not JSON is refused as the real MCP servers refuse it: 400 with the
/// JSON-RPC parse error `-32700` and a null id (the Node reference server and the Python SDK's,
/// tests/it/tool_conformance.rs; JSON-RPC 2.0, section 5.1). rmcp's server answers it 415, which
/// no real server does. Anything else goes on, its body as it came.
async fn parse_error(request: Request) -> Result<Request, Response> {
    if request.method() != Method::POST {
        return Ok(request);
    }
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_REQUEST_BYTES).await else {
        return Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is too large",
        )
            .into_response());
    };
    if serde_json::from_slice::<Value>(&bytes).is_err() {
        let body = json!({"jsonrpc": "2.0", "id": null,
                          "error": {"code": -32700, "message": "Parse error"}});
        return Err((
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response());
    }
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

#[derive(Clone)]
struct OrderTools {
    shared: Arc<Shared>,
}

fn schema(value: Value) -> Arc<JsonObject> {
    match value {
        Value::Object(map) => Arc::new(map),
        _ => Arc::new(JsonObject::new()),
    }
}

fn tool_list() -> Vec<Tool> {
    vec![
        Tool::new(
            "lookup_order",
            "Looks up an order by id: status, amount, customer.",
            schema(json!({
                "type": "object",
                "properties": {"orderId": {"type": "string"}},
                "required": ["orderId"]
            })),
        )
        .annotate(ToolAnnotations::new().read_only(true)),
        Tool::new(
            "issue_refund",
            "Issues a refund for an order. Applied once per idempotency key.",
            schema(json!({
                "type": "object",
                "properties": {
                    "orderId": {"type": "string"},
                    "amountCents": {"type": "integer"},
                    "reason": {"type": "string"}
                },
                "required": ["orderId", "amountCents"]
            })),
        )
        .annotate(
            ToolAnnotations::new()
                .read_only(false)
                .destructive(false)
                .idempotent(false),
        ),
        Tool::new(
            "read_document",
            "Reads a document: its text, as long as asked (bytes, at most 256 KiB).",
            schema(json!({
                "type": "object",
                "properties": {
                    "documentId": {"type": "string"},
                    "bytes": {"type": "integer", "minimum": 0, "maximum": READ_DOCUMENT_MAX_BYTES}
                },
                "required": ["documentId", "bytes"]
            })),
        )
        .annotate(ToolAnnotations::new().read_only(true)),
        Tool::new(
            "echo",
            "Returns its arguments.",
            schema(json!({"type": "object", "additionalProperties": true})),
        )
        .annotate(ToolAnnotations::new().read_only(true)),
    ]
}

/// The longest document `read_document` returns.
pub const READ_DOCUMENT_MAX_BYTES: u64 = 256 * 1024;

/// `read_document`: `bytes` bytes of deterministic text naming the document, so a conversation
/// can be made as long as a test needs.
fn read_document(arguments: &JsonObject) -> CallToolResult {
    let (Some(id), Some(bytes)) = (
        arguments.get("documentId").and_then(Value::as_str),
        arguments.get("bytes").and_then(Value::as_u64),
    ) else {
        return CallToolResult::error(vec![ContentBlock::text(
            "documentId (a string) and bytes (an integer) are required",
        )]);
    };
    let Ok(bytes) = usize::try_from(bytes.min(READ_DOCUMENT_MAX_BYTES)) else {
        return CallToolResult::error(vec![ContentBlock::text("bytes is too large")]);
    };
    let line = format!("Document {id}: the quick brown fox jumps over the lazy dog. ");
    let text: String = line.chars().cycle().take(bytes).collect();
    CallToolResult::success(vec![ContentBlock::text(text)])
}

/// Deterministic order details from an order id.
fn order_details(order_id: &str) -> Value {
    let hash = order_id
        .bytes()
        .fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    let statuses = ["delivered", "shipped", "processing"];
    json!({
        "orderId": order_id,
        "status": statuses[(hash % 3) as usize],
        "amountCents": 1000 + (hash % 9000),
        "currency": "EUR",
        "customerId": format!("c-{}", hash % 100),
    })
}

fn json_result(value: Value) -> CallToolResult {
    let mut result = CallToolResult::success(vec![ContentBlock::text(value.to_string())]);
    result.structured_content = Some(value);
    result
}

fn meta_string(
    request: &CallToolRequestParams,
    ctx: &RequestContext<RoleServer>,
    key: &str,
) -> Option<String> {
    request
        .meta
        .as_ref()
        .and_then(|m| m.0.0.get(key))
        .or_else(|| ctx.meta.0.0.get(key))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

impl OrderTools {
    fn issue_refund(&self, arguments: &JsonObject, key: Option<&str>) -> CallToolResult {
        let Some(order_id) = arguments.get("orderId").and_then(Value::as_str) else {
            return CallToolResult::error(vec![ContentBlock::text(
                "orderId (a string) is required",
            )]);
        };
        let Some(amount) = arguments.get("amountCents").and_then(Value::as_i64) else {
            return CallToolResult::error(vec![ContentBlock::text(
                "amountCents (an integer) is required",
            )]);
        };
        let mut records = self.shared.records();
        if let Some(key) = key
            && let Some(first) = records.refunds.get(key).cloned()
        {
            records.counters.duplicates += 1;
            *records
                .counters
                .duplicates_per_key
                .entry(key.to_owned())
                .or_default() += 1;
            return first;
        }
        records.counters.writes_applied += 1;
        if key.is_none() {
            records.counters.writes_unkeyed += 1;
        }
        let refund_id = format!("rf-{}", records.counters.writes_applied);
        let result = json_result(json!({
            "refundId": refund_id,
            "orderId": order_id,
            "amountCents": amount,
            "status": "issued",
        }));
        if let Some(key) = key {
            records.refunds.insert(key.to_owned(), result.clone());
        }
        result
    }
}

impl ServerHandler for OrderTools {
    fn get_info(&self) -> ServerConfig {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                format!("abada-devkit-{}", self.shared.name),
                env!("CARGO_PKG_VERSION"),
            ))
    }

    /// Only versions with the `initialize` handshake, so every client gets a session (see the
    /// module docs).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(
            &ProtocolVersion::LATEST_WITH_INITIALIZE,
        ))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        self.shared.records().counters.sessions_opened += 1;
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.shared.tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.shared.tools().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let key = meta_string(&request, &context, IDEMPOTENCY_KEY_META);
        let traceparent = meta_string(&request, &context, "traceparent");
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let token = parts.and_then(|p| bearer(&p.headers)).map(str::to_owned);
        let session_id = parts
            .and_then(|p| p.headers.get("mcp-session-id"))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let arguments = request.arguments.clone().unwrap_or_default();
        {
            let mut records = self.shared.records();
            *records
                .counters
                .calls_per_tool
                .entry(request.name.to_string())
                .or_default() += 1;
            records.calls.push(CallRecord {
                tool: request.name.to_string(),
                arguments: Value::Object(arguments.clone()),
                idempotency_key: key.clone(),
                traceparent,
                token,
                session_id,
            });
        }
        let latency = Faults::get(&self.shared.faults.latency);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if self.shared.faults.error_results.load(Ordering::SeqCst) {
            return Ok(CallToolResult::error(vec![ContentBlock::text(
                "injected failure: the order service is unavailable",
            )])
            .into());
        }
        if !self.shared.tools().iter().any(|t| t.name == request.name) {
            return Err(ErrorData::invalid_params(
                format!("unknown tool {}", request.name),
                None,
            ));
        }
        let mut result = match request.name.as_ref() {
            "lookup_order" => match arguments.get("orderId").and_then(Value::as_str) {
                Some(order_id) => json_result(order_details(order_id)),
                None => CallToolResult::error(vec![ContentBlock::text(
                    "orderId (a string) is required",
                )]),
            },
            "issue_refund" => {
                let fresh = key
                    .as_deref()
                    .is_none_or(|k| !self.shared.records().refunds.contains_key(k));
                let result = self.issue_refund(&arguments, key.as_deref());
                if fresh && self.shared.faults.hold_armed.swap(false, Ordering::SeqCst) {
                    let faults = &self.shared.faults;
                    let mut released = faults.holding.subscribe();
                    faults.holding.send_replace(true);
                    let _ = released.wait_for(|held| !*held).await;
                }
                result
            }
            "echo" => json_result(Value::Object(arguments)),
            "read_document" => read_document(&arguments),
            other => {
                return Err(ErrorData::invalid_params(
                    format!("unknown tool {other}"),
                    None,
                ));
            }
        };
        let oversized = *self
            .shared
            .faults
            .oversized
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(bytes) = oversized {
            result.content.push(ContentBlock::text("x".repeat(bytes)));
        }
        let answer_latency = self
            .shared
            .faults
            .answer_latency
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(request.name.as_ref())
            .copied();
        if let Some(latency) = answer_latency {
            tokio::time::sleep(latency).await;
        }
        Ok(result.into())
    }
}
