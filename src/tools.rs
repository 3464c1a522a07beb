//! Per-task MCP tool sessions (protocol.md B.2, B.3 and Part C).
//!
//! The seam: [`ToolConnector`] opens a task's [`ToolSessions`] (list the tools, call one, close
//! them all); the agent runtime knows nothing else of tool servers. [`McpConnector`] and
//! [`McpSessions`] are the rmcp implementation; a stand-in (the simulator's tool servers)
//! implements the same two traits without a socket.
//!
//! A task builds one [`McpSessions`] over the tool servers its agent names. A server's session is
//! opened on first use with a credential asked for at that moment (B.3), sent as
//! `Authorization: Bearer`; every call carries the task's trace context and, for keyed writes, the
//! idempotency key in `params._meta`. Every session is closed when the task ends: by
//! [`McpSessions::close`], or, if the value is dropped without it (panic, cancellation), by a
//! closing task spawned from `Drop` on the current runtime.
//!
//! Calls take `&mut self`, so calls within one task are sequential by construction, which keeps the
//! journal's order strict (B.2).

pub mod address;
pub mod alias;
pub mod approval_policy;
pub mod registry;
pub mod server_scope;
mod session;
mod transport;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;

use async_trait::async_trait;
use serde_json::Value;

use crate::conversation::{ToolResult, ToolSpec};
use crate::secret::Secret;

use session::{Session, SessionFailure};
pub(crate) use session::{cap_result, decode_tool_result, decode_tool_spec};

/// The `_meta` key carrying the idempotency key of a keyed write (protocol.md B.2).
pub const IDEMPOTENCY_KEY_META: &str = "io.abada/idempotency-key";
/// The `_meta` key carrying the task's W3C trace context.
pub(crate) const TRACEPARENT_META: &str = "traceparent";

/// One tool server an agent may use, as the agent definition names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolServerRef {
    /// The name the agent definition and the journal use for the server.
    pub name: String,
    /// The streamable HTTP endpoint, e.g. `http://orders-mcp:8080/mcp`.
    pub url: String,
}

/// Why a tool credential could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// The engine refused: the lease is lost (403/409) or the task is no longer ours. The task
    /// must stop and report nothing.
    #[error("the engine refused a credential for tool server {server}: the lease is lost")]
    LeaseLost { server: String },
    /// The engine could not be asked now (connection error, 5xx, timeout); worth retrying.
    #[error("could not get a credential for tool server {server}: {reason}")]
    Transient { server: String, reason: String },
}

/// Where a task gets the credential for one tool server: the operator's registry
/// ([`registry::TaskCredentials`]) or the engine's `tool-credentials` call for the task's lease
/// (protocol.md B.3). Asked for each session a task opens to that server, and only for it.
#[async_trait]
pub trait CredentialSource: Send + Sync {
    /// The credential to send as `Authorization: Bearer`, or `None` to send none.
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError>;

    /// The server answered 401 to `refused`: a different credential to try once (a refreshed
    /// token, a rotated file), or `None` when there is none and the refusal stands.
    async fn rejected(
        &self,
        _server: &str,
        _refused: &Secret,
    ) -> Result<Option<Secret>, CredentialError> {
        Ok(None)
    }
}

/// Why a tool listing or call failed. Messages name the server by the name the definition and
/// the registry give it, and the tool; never a URL (its path or query may be a secret: a key
/// in a path, `?api_key=`), never a credential. What a library said is shown without the URLs
/// in it ([`crate::redact::text_without_urls`]).
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// Connection refused, 5xx, 429, timeout, dropped connection, or a credential that could not be
    /// fetched for a transient reason. The caller retries a bounded number of times, then fails
    /// the task technically.
    #[error("tool server {server} is unavailable: {reason}; retry later")]
    Unavailable { server: String, reason: String },
    /// The engine refused the credential: the lease is lost. Stop the task silently.
    #[error("the credential for tool server {server} was refused by the engine: the lease is lost")]
    CredentialRefused { server: String },
    /// The tool server answered 401/403 to the credential sent to it (after one refreshed
    /// credential, when its source had one).
    #[error(
        "tool server {server} rejected the credential sent to it; check the server's entry in ABADA_AGENT_TOOLS_FILE, or, for the engine's credential, that the engine and the server agree on credentials"
    )]
    Unauthorized { server: String },
    /// The server's host name resolved to a link-local or cloud-metadata address, or, for a
    /// server the registry does not list, to a registered server's address and port
    /// ([`alias`]): nothing was sent. Retrying cannot help.
    #[error("tool server {server} is refused: {reason}")]
    ForbiddenAddress { server: String, reason: String },
    /// The agent named a server its definition does not list.
    #[error("unknown tool server {server}; the agent definition lists: {known}")]
    UnknownServer { server: String, known: String },
    /// The server does not offer that tool.
    #[error("tool server {server} has no tool named {tool}")]
    UnknownTool { server: String, tool: String },
    /// The server sent more than the worker reads (a response past its byte limit, a listing
    /// past its page or tool limit). Retrying cannot help: the task becomes an incident.
    #[error("tool server {server} sent {what}; retrying cannot help")]
    TooLarge { server: String, what: String },
    /// The credential for this server would travel in clear (`crate::channel`): not asked for.
    #[error(
        "the credential for tool server {server} would travel in clear (its URL is http:// to a host that is not loopback); use https://, or set ABADA_AGENT_ALLOW_INSECURE_HTTP=true to allow it"
    )]
    InsecureChannel { server: String },
    /// The server broke the protocol or answered with a JSON-RPC error.
    #[error("tool server {server} failed{}: {reason}", tool.as_deref().map(|t| format!(" calling {t}")).unwrap_or_default())]
    Protocol {
        server: String,
        tool: Option<String>,
        reason: String,
    },
}

impl ToolError {
    /// True when retrying the same call later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ToolError::Unavailable { .. })
    }

    /// True when the task has lost its lease and must stop without reporting.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, ToolError::CredentialRefused { .. })
    }
}

/// Limits of a task's tool sessions.
#[derive(Clone, Debug)]
pub struct ToolSessionOptions {
    /// Time allowed to open a session (credential excluded): connect, discover or initialize.
    pub open_timeout: Duration,
    /// Time allowed for one `tools/list` page sequence or one `tools/call`.
    pub call_timeout: Duration,
    /// Cap on a tool result kept for the model and the journal, in bytes of its JSON content and
    /// structured content. A larger result is cut to this size and a text block saying so is
    /// appended (see [`DEFAULT_MAX_RESULT_BYTES`]).
    pub max_result_bytes: usize,
    /// Hard cap on one HTTP response or SSE event from a tool server, bounding memory per call.
    /// A larger JSON response or SSE event is not read: a call answers with an error result
    /// saying so (the model is told, nothing is retried); opening a session or listing its
    /// tools fails as [`ToolError::TooLarge`] (an incident).
    pub max_response_bytes: usize,
    /// Time allowed to close one session when the task ends. Longer than rmcp's own bound on
    /// the DELETE that closes it ([`RMCP_SESSION_DELETE_TIMEOUT`]), so that a close the worker
    /// stops waiting for is one rmcp has given up too, not a DELETE still on its way after the
    /// task's lease (and the credential it carries) is given back.
    pub close_timeout: Duration,
    /// How sessions are opened.
    pub protocol: ToolProtocol,
    /// Tool credentials may go to http:// servers that are not loopback
    /// (`ABADA_AGENT_ALLOW_INSECURE_HTTP`); otherwise such a server is refused before a
    /// credential is asked for (`crate::channel`).
    pub allow_insecure_http: bool,
    /// What each server turned out to speak, shared by every task of the process (clones of the
    /// options share it): with [`ToolProtocol::Auto`], only the first session to a server probes
    /// for MCP 2026-07-28; later ones open directly the way that worked. This saves a round trip
    /// per session and avoids probe sessions that stateful servers would keep open.
    pub learned: Arc<ProtocolMemo>,
}

/// The protocol each tool server URL was found to speak (see [`ToolSessionOptions::learned`]).
#[derive(Debug, Default)]
pub struct ProtocolMemo {
    slots: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<ToolProtocol>>>>>,
}

impl ProtocolMemo {
    /// The slot of one URL; its async lock is held while the first session to it negotiates.
    pub(crate) fn slot(&self, url: &str) -> Arc<tokio::sync::Mutex<Option<ToolProtocol>>> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(url.to_owned())
            .or_default()
            .clone()
    }
}

/// How a session is opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolProtocol {
    /// MCP 2026-07-28 (`server/discover`, no session) when the server speaks it, else the
    /// `initialize` handshake of 2025-11-25 with a server-side session.
    #[default]
    Auto,
    /// Always the `initialize` handshake (2025-11-25).
    Initialize,
}

/// How long rmcp (3.11, `SESSION_CLEANUP_TIMEOUT` in its streamable HTTP client) lets the
/// DELETE of a closing session run; the worker waits longer than that for a close.
pub(crate) const RMCP_SESSION_DELETE_TIMEOUT: Duration = Duration::from_secs(5);

/// Default cap on a tool result kept for the model: 64 KiB.
pub(crate) const DEFAULT_MAX_RESULT_BYTES: usize = 64 * 1024;
/// Default cap on one response read from a tool server (`body::TOOL_RESPONSE_MAX_BYTES`).
pub(crate) const DEFAULT_MAX_RESPONSE_BYTES: usize = crate::body::TOOL_RESPONSE_MAX_BYTES;

impl Default for ToolSessionOptions {
    fn default() -> Self {
        ToolSessionOptions {
            open_timeout: Duration::from_secs(15),
            call_timeout: Duration::from_secs(60),
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            close_timeout: RMCP_SESSION_DELETE_TIMEOUT + Duration::from_secs(2),
            protocol: ToolProtocol::Auto,
            allow_insecure_http: false,
            learned: Arc::new(ProtocolMemo::default()),
        }
    }
}

/// The tool servers' HTTP client, from `builder` (which carries the trust roots): it follows
/// no redirect, so a credential never reaches another origin through one, and resolves host
/// names through [`address::GuardedResolver`], so no connection goes to a link-local or
/// cloud-metadata address.
pub fn http_client(builder: reqwest::ClientBuilder) -> Result<reqwest::Client, reqwest::Error> {
    builder
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        .dns_resolver(address::GuardedResolver::system())
        .build()
}

/// A tool servers' client like [`http_client`] whose connections to `host` go to `addresses`
/// only (the addresses [`alias::AliasGuard`] checked), never to a new resolution of the name.
pub(crate) fn pinned_http_client(
    builder: reqwest::ClientBuilder,
    host: &str,
    addresses: &[std::net::SocketAddr],
) -> Result<reqwest::Client, reqwest::Error> {
    http_client(builder.resolve_to_addrs(host, addresses))
}

/// What the agent runtime asks of a task's tool servers. Calls take `&mut self`: the calls of
/// one task are sequential, which keeps the journal's order strict (B.2).
#[async_trait]
pub trait ToolSessions: Send + Sync {
    /// Every tool of every server of the task (see [`McpSessions::tools`]).
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, ToolError>;

    /// Calls one tool, sending `idempotency_key` with a keyed write (see [`McpSessions::call`]).
    async fn call(
        &mut self,
        server: &str,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<ToolResult, ToolError>;

    /// Closes every open session; nothing is called after it.
    async fn close(&mut self);
}

/// What a task's tool sessions are opened with: the servers the registry resolved for it, the
/// credentials of its lease, its trace context, and the tracker that outlives it.
pub struct TaskTools {
    pub servers: Vec<ToolServerRef>,
    pub credentials: Arc<dyn CredentialSource>,
    pub traceparent: Option<String>,
    /// The task's cleanup tracker ([`TaskContext::cleanup`](crate::handler::TaskContext::cleanup)):
    /// the runner waits for it before it gives the lease back.
    pub cleanup: TaskTracker,
    /// Servers the registry does not list (`ABADA_AGENT_TOOLS_UNREGISTERED=allow`).
    pub unregistered: Option<UnregisteredServers>,
}

/// Opens the tool sessions of each task: the seam the agent runtime holds.
pub trait ToolConnector: Send + Sync {
    /// The sessions of one task; nothing is opened until they are used.
    fn sessions(&self, task: TaskTools) -> Box<dyn ToolSessions>;
}

/// The production [`ToolConnector`]: MCP over streamable HTTP (rmcp), on the tool servers'
/// client ([`http_client`]: no redirects, guarded resolver).
pub(crate) struct McpConnector {
    http: reqwest::Client,
    options: ToolSessionOptions,
}

impl McpConnector {
    pub fn new(http: reqwest::Client, options: ToolSessionOptions) -> Self {
        McpConnector { http, options }
    }
}

impl ToolConnector for McpConnector {
    fn sessions(&self, task: TaskTools) -> Box<dyn ToolSessions> {
        Box::new(
            McpSessions::new(
                self.http.clone(),
                task.servers,
                task.credentials,
                task.traceparent,
                self.options.clone(),
            )
            .with_cleanup(task.cleanup)
            .with_unregistered(task.unregistered),
        )
    }
}

#[async_trait]
impl ToolSessions for McpSessions {
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, ToolError> {
        McpSessions::tools(self).await
    }

    async fn call(
        &mut self,
        server: &str,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<ToolResult, ToolError> {
        McpSessions::call(self, server, tool, arguments, idempotency_key).await
    }

    async fn close(&mut self) {
        let sessions: Vec<Session> = self.open.drain().map(|(_, s)| s).collect();
        self.close_tracked(sessions).await;
    }
}

/// The servers of a task that the registry does not list, and the guard their sessions open
/// through (`ABADA_AGENT_TOOLS_UNREGISTERED=allow`).
#[derive(Clone)]
pub struct UnregisteredServers {
    pub names: std::collections::HashSet<String>,
    pub guard: Arc<alias::AliasGuard>,
}

/// The MCP sessions of one task: at most one per tool server, opened on first use.
pub struct McpSessions {
    http: reqwest::Client,
    servers: Vec<ToolServerRef>,
    credentials: Arc<dyn CredentialSource>,
    traceparent: Option<String>,
    options: ToolSessionOptions,
    /// Open sessions by server name.
    open: HashMap<String, Session>,
    /// Tracks the closes (and the openings) that outlive a dropped `McpSessions`, so the
    /// runner can wait for them before it gives the lease back: the credential a session
    /// was opened with may be refused once the lease is gone, and the close with it.
    cleanup: TaskTracker,
    /// Servers the registry does not list: each session opens only once the guard has told it
    /// from every registered server, on a client pinned to the addresses checked.
    unregistered: Option<UnregisteredServers>,
}

impl McpSessions {
    /// Sessions for one task. Nothing is opened until [`tools`](Self::tools) or
    /// [`call`](Self::call) needs a server.
    pub fn new(
        http: reqwest::Client,
        servers: Vec<ToolServerRef>,
        credentials: Arc<dyn CredentialSource>,
        traceparent: Option<String>,
        options: ToolSessionOptions,
    ) -> Self {
        McpSessions {
            http,
            servers,
            credentials,
            traceparent,
            options,
            open: HashMap::new(),
            cleanup: TaskTracker::new(),
            unregistered: None,
        }
    }

    /// Opens the sessions of `unregistered` servers through its guard
    /// ([`alias::AliasGuard::client_for`]).
    pub fn with_unregistered(mut self, unregistered: Option<UnregisteredServers>) -> Self {
        self.unregistered = unregistered;
        self
    }

    /// Tracks the work that outlives these sessions when they are dropped (their closes, an
    /// opening under way) with `cleanup`, the task's own tracker (see
    /// [`TaskContext::cleanup`](crate::handler::TaskContext::cleanup)).
    pub fn with_cleanup(mut self, cleanup: TaskTracker) -> Self {
        self.cleanup = cleanup;
        self
    }

    /// Every tool of every server of the task, opening sessions as needed. The listing of a
    /// session is fetched once (all pages) and reused.
    pub async fn tools(&mut self) -> Result<Vec<ToolSpec>, ToolError> {
        let names: Vec<String> = self.servers.iter().map(|s| s.name.clone()).collect();
        let mut specs = Vec::new();
        for name in names {
            let session = self.session(&name).await?;
            specs.extend(session.tools().iter().cloned());
        }
        Ok(specs)
    }

    /// Calls one tool. `idempotency_key` is sent in `params._meta["io.abada/idempotency-key"]`
    /// and the task's traceparent in `params._meta.traceparent`. A session the server expired
    /// is opened again once, with a fresh credential, and the call re-sent with the same key.
    pub async fn call(
        &mut self,
        server: &str,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<ToolResult, ToolError> {
        let mut meta = serde_json::Map::new();
        if let Some(key) = idempotency_key {
            meta.insert(IDEMPOTENCY_KEY_META.into(), Value::String(key.into()));
        }
        if let Some(tp) = &self.traceparent {
            meta.insert(TRACEPARENT_META.into(), Value::String(tp.clone()));
        }
        let mut reopened = false;
        let mut refreshed = false;
        loop {
            let session = self.session(server).await?;
            if !session.has_tool(tool) {
                return Err(ToolError::UnknownTool {
                    server: server.into(),
                    tool: tool.into(),
                });
            }
            let refused = session.credential().cloned();
            match session.call(tool, arguments.clone(), meta.clone()).await {
                Ok(result) => return Ok(result),
                Err(SessionFailure::Expired) if !reopened => {
                    reopened = true;
                    tracing::info!(server, tool, "tool session expired; opening a new one");
                    self.close_removed(server).await;
                }
                // Refused before the server did anything: one new session with a refreshed
                // credential, and the call re-sent (with the same key).
                Err(SessionFailure::Unauthorized) if !refreshed && refused.is_some() => {
                    refreshed = true;
                    self.close_removed(server).await;
                    let next = match &refused {
                        Some(refused) => self.rejected(server, refused).await?,
                        None => None,
                    };
                    if next.is_none() {
                        return Err(ToolError::Unauthorized {
                            server: server.into(),
                        });
                    }
                    tracing::info!(
                        server,
                        tool,
                        "tool server refused the credential; retrying once with a new one"
                    );
                }
                Err(failure) => {
                    let error = failure.into_tool_error(server, Some(tool));
                    if matches!(
                        error,
                        ToolError::Unavailable { .. } | ToolError::Unauthorized { .. }
                    ) {
                        // The session may be dead: the caller's retry opens a new one.
                        self.close_removed(server).await;
                    }
                    return Err(error);
                }
            }
        }
    }

    /// Closes every open session (HTTP DELETE of the session for stateful servers).
    pub async fn close(mut self) {
        ToolSessions::close(&mut self).await;
    }

    /// Closes the session with `server`, if one is open, and forgets it.
    async fn close_removed(&mut self, server: &str) {
        if let Some(old) = self.open.remove(server) {
            self.close_tracked(vec![old]).await;
        }
    }

    /// Closes `sessions` in a task of the cleanup tracker and waits for it: when the caller is
    /// dropped half-way (its task aborted), the closes go on where the runner waits for them
    /// before it gives the lease back, instead of being cut or left to run unseen.
    async fn close_tracked(&self, sessions: Vec<Session>) {
        if let Some(closing) = self.spawn_closes(sessions) {
            let _ = closing.await;
        }
    }

    /// Starts closing `sessions` in a task of the cleanup tracker (each close is bounded by
    /// `close_timeout`). Without a runtime (it is going down) the sessions are dropped: dropping
    /// each client cancels its transport, which closes the connection, and the server expires
    /// the session on its own.
    fn spawn_closes(&self, sessions: Vec<Session>) -> Option<tokio::task::JoinHandle<()>> {
        if sessions.is_empty() {
            return None;
        }
        let handle = tokio::runtime::Handle::try_current().ok()?;
        Some(self.cleanup.spawn_on(
            async move {
                futures::future::join_all(sessions.into_iter().map(Session::close)).await;
            },
            &handle,
        ))
    }

    async fn session(&mut self, server: &str) -> Result<&mut Session, ToolError> {
        if !self.open.contains_key(server) {
            let Some(server_ref) = self.servers.iter().find(|s| s.name == server).cloned() else {
                return Err(ToolError::UnknownServer {
                    server: server.into(),
                    known: self
                        .servers
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            };
            // A server the registry does not list may not be a registered one by address.
            let http = match &self.unregistered {
                Some(u) if u.names.contains(server) => u
                    .guard
                    .client_for(&server_ref.url, &self.http)
                    .await
                    .map_err(|refusal| alias_error(refusal, server))?,
                _ => self.http.clone(),
            };
            let mut credential = self
                .credentials
                .credential(server)
                .await
                .map_err(credential_error)?;
            // A credential travels over TLS (or to loopback) only.
            if credential.is_some() {
                crate::channel::check(
                    &server_ref.url,
                    &format!("the credential for tool server {server}"),
                    self.options.allow_insecure_http,
                )
                .map_err(|_| ToolError::InsecureChannel {
                    server: server.into(),
                })?;
            }
            let mut refreshed = false;
            let session = loop {
                let opened = Session::open(
                    &http,
                    &server_ref,
                    credential.clone(),
                    &self.options,
                    &self.cleanup,
                )
                .await;
                match (opened, &credential) {
                    (Ok(session), _) => break session,
                    (Err(SessionFailure::Unauthorized), Some(refused)) if !refreshed => {
                        refreshed = true;
                        match self.rejected(server, refused).await? {
                            Some(next) => credential = Some(next),
                            None => {
                                return Err(ToolError::Unauthorized {
                                    server: server.into(),
                                });
                            }
                        }
                    }
                    (Err(failure), _) => {
                        return Err(failure.into_tool_error(server, None));
                    }
                }
            };
            self.open.insert(server.to_owned(), session);
        }
        Ok(self.open.get_mut(server).expect("inserted above"))
    }
}

impl McpSessions {
    /// Asks the credential source for a credential other than `refused`.
    async fn rejected(&self, server: &str, refused: &Secret) -> Result<Option<Secret>, ToolError> {
        self.credentials
            .rejected(server, refused)
            .await
            .map_err(credential_error)
    }
}

/// A session the alias guard did not open, as the tool error a task acts on: an incident
/// unless a resolver or client may do better later.
fn alias_error(refusal: alias::AliasRefusal, server: &str) -> ToolError {
    let (server, reason) = (
        server.to_owned(),
        crate::redact::text_without_urls(&refusal.to_string()),
    );
    if refusal.is_transient() {
        ToolError::Unavailable { server, reason }
    } else {
        ToolError::ForbiddenAddress { server, reason }
    }
}

/// A credential that could not be had, as the tool error a task acts on. The reason is the
/// credential source's (an issuer's error may name its token URL): shown without URLs.
fn credential_error(e: CredentialError) -> ToolError {
    match e {
        CredentialError::LeaseLost { server } => ToolError::CredentialRefused { server },
        CredentialError::Transient { server, reason } => ToolError::Unavailable {
            server,
            reason: format!(
                "no credential: {}",
                crate::redact::text_without_urls(&reason)
            ),
        },
    }
}

impl Drop for McpSessions {
    fn drop(&mut self) {
        let sessions: Vec<Session> = self.open.drain().map(|(_, s)| s).collect();
        // Nobody awaits these closes; the runner waits for the tracker.
        drop(self.spawn_closes(sessions));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    /// The agent spawns each task: the session set and its futures must be `Send`.
    #[allow(dead_code, clippy::diverging_sub_expression)]
    fn futures_are_send(mut sessions: McpSessions) {
        assert_send(&sessions.tools());
        assert_send(&sessions.call("s", "t", serde_json::Map::new(), None));
        assert_send(&sessions.close());
    }
}
