//! One open MCP session with one tool server: opening it (rmcp client over streamable HTTP with
//! the task's credential), its tool listing, calls, closing it, and the mapping of rmcp's errors
//! to what a caller acts on.
//!
//! A session is named by its server's name in every line and error; what rmcp and reqwest say
//! reaches a caller without the URLs in it (`crate::redact::text_without_urls`).

use std::error::Error as StdError;
use tokio_util::task::TaskTracker;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, Implementation,
    MetaObject, PaginatedRequestParams, ProtocolVersion, RequestMetaObject, Tool,
};
use rmcp::service::{Peer, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient, ServiceError};
use serde_json::Value;

use super::transport::McpHttp;
use super::{ToolError, ToolProtocol, ToolServerRef, ToolSessionOptions};
use crate::body;
use crate::conversation::{ToolResult, ToolSpec};
use crate::secret::Secret;

/// What went wrong with a session, before it is named with server and tool.
#[derive(Debug)]
pub(crate) enum SessionFailure {
    /// The server no longer knows the session (HTTP 404 on its session id).
    Expired,
    /// The server answered 401/403 to our credential.
    Unauthorized,
    /// Worth retrying later: connection, 5xx, 429, timeout, closed stream.
    Unavailable(String),
    /// The response was larger than the transport's byte cap and was not read.
    TooLarge(usize),
    /// The tool listing went past a limit (pages, tools): what went past it.
    ListingTooLarge(String),
    /// A protocol violation or a JSON-RPC error.
    Protocol(String),
    /// The host resolved to a link-local or metadata address; no connection was made.
    Forbidden(String),
    /// `server/discover` answered, but the server supports only versions with `initialize`.
    LegacyOnly,
}

impl SessionFailure {
    /// The tool error of `server`. The server's words are bounded before they reach a log, the
    /// model or the engine, and lose every URL in them (rmcp and reqwest write the whole URL,
    /// query included, into their messages): the error names the server, never its URL.
    pub(crate) fn into_tool_error(self, server: &str, tool: Option<&str>) -> ToolError {
        let shown = |reason: String| {
            crate::redact::text_without_urls(&body::truncate_text(
                &reason,
                body::TOOL_ERROR_MESSAGE_MAX_BYTES,
            ))
        };
        let server = server.to_owned();
        match self {
            SessionFailure::Unauthorized => ToolError::Unauthorized { server },
            SessionFailure::Forbidden(reason) => ToolError::ForbiddenAddress {
                server,
                reason: shown(reason),
            },
            SessionFailure::Unavailable(reason) => ToolError::Unavailable {
                server,
                reason: shown(reason),
            },
            SessionFailure::Expired => ToolError::Unavailable {
                server,
                reason: "the server expired the session again right after it was re-opened".into(),
            },
            SessionFailure::TooLarge(max) => ToolError::TooLarge {
                server,
                what: format!("a response larger than the limit of {max} bytes (not read)"),
            },
            SessionFailure::ListingTooLarge(what) => ToolError::TooLarge { server, what },
            SessionFailure::LegacyOnly => ToolError::Protocol {
                server,
                tool: tool.map(str::to_owned),
                reason: "the server supports no protocol version this client speaks".into(),
            },
            SessionFailure::Protocol(reason) => ToolError::Protocol {
                server,
                tool: tool.map(str::to_owned),
                reason: shown(reason),
            },
        }
    }
}

/// An open session and the tools it lists.
pub(crate) struct Session {
    /// The server's name (the registry's, or the definition's for a server it does not list):
    /// what every line about the session says, never its URL.
    server: String,
    /// The credential the session was opened with (sent on each of its requests).
    credential: Option<Secret>,
    client: RunningService<RoleClient, ClientConfig>,
    /// The transport's HTTP client: tells a response cut for an oversized SSE event from a
    /// broken one.
    http: McpHttp,
    tools: Vec<ToolSpec>,
    options: ToolSessionOptions,
}

impl Session {
    /// Opens a session (discover or initialize) and lists its tools, all pages.
    ///
    /// The opening runs in its own spawned task: when the caller is dropped half-way (its task
    /// was cancelled, its lease lost), the server may already hold a session, so the opening
    /// finishes anyway and closes what it opened instead of leaving it on the server. That task
    /// is tracked by `cleanup`, so whoever gives the task's lease back can wait for it first
    /// (a session's credential may die with the lease, and with it the DELETE that closes it).
    /// Once the caller is gone the opening does no more than it must: it stops waiting for
    /// another opening's protocol negotiation (nothing is open yet), and a session already
    /// open is closed at once instead of listed.
    pub(crate) async fn open(
        http: &reqwest::Client,
        server: &ToolServerRef,
        credential: Option<Secret>,
        options: &ToolSessionOptions,
        cleanup: &TaskTracker,
    ) -> Result<Session, SessionFailure> {
        let (mut tx, rx) = tokio::sync::oneshot::channel();
        let (http, server, options) = (http.clone(), server.clone(), options.clone());
        cleanup.spawn(async move {
            let opened = Session::open_here(&http, &server, credential, &options, &mut tx).await;
            if let Err(Ok(orphan)) = tx.send(opened) {
                orphan.close().await;
            }
        });
        rx.await.unwrap_or_else(|_| {
            Err(SessionFailure::Unavailable(
                "the session opening task ended without an answer".into(),
            ))
        })
    }

    /// The opening itself; `caller` is where its answer goes, watched only to stop early once
    /// nobody waits for it.
    async fn open_here(
        http: &reqwest::Client,
        server: &ToolServerRef,
        credential: Option<Secret>,
        options: &ToolSessionOptions,
        caller: &mut tokio::sync::oneshot::Sender<Result<Session, SessionFailure>>,
    ) -> Result<Session, SessionFailure> {
        let abandoned =
            || SessionFailure::Unavailable("nobody waits for the session any more".into());
        let http = &McpHttp::new(http.clone());
        let client = if options.protocol == ToolProtocol::Auto {
            let slot = options.learned.slot(&server.url);
            // Biased, a caller gone first (here and below): nothing is opened, and nothing
            // kept open, for nobody.
            let mut learned = tokio::select! {
                biased;
                () = caller.closed() => return Err(abandoned()),
                learned = slot.lock() => learned,
            };
            match *learned {
                Some(protocol) => {
                    drop(learned);
                    connect(http, server, &credential, options, protocol).await?
                }
                None => {
                    // The first session to this server negotiates while later ones wait.
                    let (client, protocol) =
                        match connect(http, server, &credential, options, ToolProtocol::Auto).await
                        {
                            // A server that answers `server/discover` but supports only
                            // versions with the `initialize` handshake: the older way.
                            Err(SessionFailure::LegacyOnly) => (
                                connect(
                                    http,
                                    server,
                                    &credential,
                                    options,
                                    ToolProtocol::Initialize,
                                )
                                .await?,
                                ToolProtocol::Initialize,
                            ),
                            other => (other?, ToolProtocol::Auto),
                        };
                    *learned = Some(protocol);
                    client
                }
            }
        } else {
            connect(http, server, &credential, options, options.protocol).await?
        };
        let mut session = Session {
            server: server.name.clone(),
            credential,
            client,
            http: http.clone(),
            tools: Vec::new(),
            options: options.clone(),
        };
        let listing = tokio::time::timeout(
            options.call_timeout,
            list_bounded(session.client.peer(), &session.http),
        );
        let listed = tokio::select! {
            biased;
            // The session is open: close it now rather than list tools nobody will read.
            () = caller.closed() => Err(abandoned()),
            listed = listing => match listed {
                Err(_) => Err(SessionFailure::Unavailable(format!(
                    "tools/list had no answer within {:?}",
                    options.call_timeout
                ))),
                Ok(listed) => listed,
            },
        };
        let tools = match listed {
            Ok(tools) => tools,
            Err(failure) => {
                session.close().await;
                return Err(failure);
            }
        };
        session.tools = tools
            .into_iter()
            .filter_map(|tool| to_spec(&server.name, tool))
            .collect();
        Ok(session)
    }

    pub(crate) fn credential(&self) -> Option<&Secret> {
        self.credential.as_ref()
    }

    pub(crate) fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    pub(crate) fn has_tool(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t.tool == tool)
    }

    /// One `tools/call` with `meta` as `params._meta`.
    pub(crate) async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
        meta: serde_json::Map<String, Value>,
    ) -> Result<ToolResult, SessionFailure> {
        let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        // What an earlier request's stream left behind is not this call's.
        self.http.take_oversized_event();
        if !meta.is_empty() {
            params.meta = Some(RequestMetaObject(MetaObject(meta)));
        }
        match tokio::time::timeout(
            self.options.call_timeout,
            self.client.peer().call_tool(params),
        )
        .await
        {
            Err(_) => Err(SessionFailure::Unavailable(format!(
                "no answer within {:?}",
                self.options.call_timeout
            ))),
            Ok(Ok(result)) => Ok(cap_result(
                convert_result(result),
                self.options.max_result_bytes,
            )),
            Ok(Err(e)) => match classify_service(&e, &self.http) {
                SessionFailure::TooLarge(max) => Ok(ToolResult::error_text(format!(
                    "the tool result was larger than {max} bytes and was discarded"
                ))),
                other => Err(other),
            },
        }
    }

    /// Closes the session (a DELETE of the session id for stateful servers), bounded in time.
    pub(crate) async fn close(mut self) {
        match self
            .client
            .close_with_timeout(self.options.close_timeout)
            .await
        {
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::warn!(server = %self.server, "closing a tool session timed out")
            }
            Err(e) => {
                tracing::warn!(server = %self.server, error = %crate::redact::text_without_urls(&body::truncate_text(&e.to_string(), body::TOOL_ERROR_MESSAGE_MAX_BYTES)), "closing a tool session failed")
            }
        }
    }
}

/// Every page of `tools/list` within the listing limits: a server that keeps sending a next-page
/// cursor, or lists more tools than the worker offers a model, fails the listing by name.
async fn list_bounded(
    peer: &Peer<RoleClient>,
    http: &McpHttp,
) -> Result<Vec<Tool>, SessionFailure> {
    let mut tools = Vec::new();
    let mut cursor = None;
    for _ in 0..body::TOOL_LIST_MAX_PAGES {
        let page = peer
            .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
            .await
            .map_err(|e| classify_service(&e, http))?;
        tools.extend(page.tools);
        if tools.len() > body::TOOL_LIST_MAX_TOOLS {
            return Err(SessionFailure::ListingTooLarge(format!(
                "a tool listing of more than the limit of {} tools",
                body::TOOL_LIST_MAX_TOOLS
            )));
        }
        cursor = page.next_cursor;
        if cursor.is_none() {
            return Ok(tools);
        }
    }
    Err(SessionFailure::ListingTooLarge(format!(
        "a tool listing still going after the limit of {} pages",
        body::TOOL_LIST_MAX_PAGES
    )))
}

/// One listed tool from its JSON form, as offered to the model (for the decoders).
pub(crate) fn decode_tool_spec(server: &str, json: &[u8]) -> Result<Option<ToolSpec>, String> {
    let tool: Tool = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    Ok(to_spec(server, tool))
}

/// A listed tool as offered to the model: its description cut to
/// `body::TOOL_DESCRIPTION_MAX_BYTES`; a tool whose input schema is larger than
/// `body::TOOL_SCHEMA_MAX_BYTES` is not offered (a cut schema would be wrong).
fn to_spec(server: &str, tool: Tool) -> Option<ToolSpec> {
    let input_schema = Value::Object((*tool.input_schema).clone());
    let schema_size = serde_json::to_string(&input_schema).map_or(usize::MAX, |s| s.len());
    if schema_size > body::TOOL_SCHEMA_MAX_BYTES {
        tracing::warn!(
            server,
            tool = %body::truncate_text(&tool.name, 128),
            schema_bytes = schema_size,
            limit_bytes = body::TOOL_SCHEMA_MAX_BYTES,
            "a tool's input schema is larger than the limit; the tool is not offered to the model"
        );
        return None;
    }
    Some(ToolSpec {
        server: server.to_owned(),
        tool: tool.name.to_string(),
        description: body::truncate_text(
            tool.description.as_deref().unwrap_or_default(),
            body::TOOL_DESCRIPTION_MAX_BYTES,
        ),
        input_schema,
        read_only: tool
            .annotations
            .as_ref()
            .and_then(|a| a.read_only_hint)
            .unwrap_or(false),
        destructive: tool
            .annotations
            .as_ref()
            .and_then(|a| a.destructive_hint)
            .unwrap_or(false),
    })
}

/// Opens the transport and runs the lifecycle start (discover, or initialize).
async fn connect(
    http: &McpHttp,
    server: &ToolServerRef,
    credential: &Option<Secret>,
    options: &ToolSessionOptions,
    protocol: ToolProtocol,
) -> Result<RunningService<RoleClient, ClientConfig>, SessionFailure> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(server.url.as_str());
    if let Some(credential) = credential {
        config = config.auth_header(credential.expose());
    }
    let config = config
        // We re-open expired sessions ourselves, with a fresh credential.
        .reinit_on_expired_session(false)
        .max_json_response_size(options.max_response_bytes)
        .max_sse_event_size(options.max_response_bytes)
        .max_error_response_size(body::TOOL_ERROR_BODY_MAX_BYTES);
    let transport = StreamableHttpClientTransport::with_client(http.clone(), config);
    let info = ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("abada-agent-worker", env!("CARGO_PKG_VERSION")),
    );
    let (info, lifecycle) = match protocol {
        ToolProtocol::Auto => (
            info,
            ClientLifecycleMode::Auto {
                preferred_versions: vec![ProtocolVersion::LATEST],
                legacy_version: Some(ProtocolVersion::LATEST_WITH_INITIALIZE),
            },
        ),
        ToolProtocol::Initialize => (
            info.with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE),
            ClientLifecycleMode::Initialize,
        ),
    };
    let connected = match tokio::time::timeout(
        options.open_timeout,
        info.serve_with_lifecycle(transport, lifecycle),
    )
    .await
    {
        Err(_) => Err(SessionFailure::Unavailable(format!(
            "no session within {:?}",
            options.open_timeout
        ))),
        Ok(Err(e)) => Err(match http.take_oversized_event() {
            Some(max) => SessionFailure::TooLarge(max),
            None => classify_init(&e),
        }),
        Ok(Ok(client)) => Ok(client),
    };
    match &connected {
        Ok(_) => http.claim_session(),
        // The server may hold a session the failed handshake cannot close (see
        // `McpHttp::close_unclaimed`).
        Err(_) => {
            let auth = credential.as_ref().map(|c| c.expose().to_owned());
            http.close_unclaimed(&server.url, &server.name, auth, options.close_timeout)
                .await
        }
    }
    connected
}

/// Reads an MCP `CallToolResult` from its JSON form, as a tool server sent it.
pub(crate) fn decode_tool_result(json: &[u8]) -> Result<ToolResult, String> {
    let result: CallToolResult = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    Ok(convert_result(result))
}

fn convert_result(result: CallToolResult) -> ToolResult {
    ToolResult {
        content: result
            .content
            .iter()
            .filter_map(|block| serde_json::to_value(block).ok())
            .collect(),
        structured_content: result.structured_content,
        is_error: result.is_error.unwrap_or(false),
    }
}

/// Cuts a result to about `cap` bytes of JSON: blocks are kept in order while they fit, the
/// first text block that does not fit is cut at a character boundary, other blocks that do not fit
/// are dropped, structured content is kept only if it fits, and a text block saying what was cut
/// is appended.
pub(crate) fn cap_result(result: ToolResult, cap: usize) -> ToolResult {
    let size_of = |v: &Value| {
        serde_json::to_string(v)
            .map(|s| s.len())
            .unwrap_or(usize::MAX)
    };
    let total: usize = result.content.iter().map(size_of).sum::<usize>()
        + result.structured_content.as_ref().map(size_of).unwrap_or(0);
    if total <= cap {
        return result;
    }
    let mut budget = cap;
    let mut content = Vec::new();
    for block in result.content {
        let size = size_of(&block);
        if size <= budget {
            budget -= size;
            content.push(block);
            continue;
        }
        if let (Some("text"), Some(Value::String(text))) =
            (block.get("type").and_then(Value::as_str), block.get("text"))
        {
            // JSON escaping may make the kept text slightly larger than the budget; the cap
            // is about size, not exact bytes.
            let overhead = 32;
            if budget > overhead {
                let mut end = (budget - overhead).min(text.len());
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                content.push(serde_json::json!({"type": "text", "text": &text[..end]}));
            }
        }
        budget = 0;
    }
    let structured_content = result.structured_content.filter(|s| size_of(s) <= budget);
    content.push(serde_json::json!({
        "type": "text",
        "text": format!("[the tool result was {total} bytes; only the first {cap} bytes were kept]"),
    }));
    ToolResult {
        content,
        structured_content,
        is_error: result.is_error,
    }
}

fn classify_init(error: &rmcp::service::ClientInitializeError) -> SessionFailure {
    use rmcp::service::ClientInitializeError as E;
    match error {
        E::TransportError { error, .. } => classify_chain(error.error.as_ref()),
        E::LegacyFallbackFailed { fallback, .. } => classify_init(fallback),
        E::ConnectionClosed(reason) => {
            SessionFailure::Unavailable(format!("the connection closed: {reason}"))
        }
        E::Cancelled => SessionFailure::Unavailable("opening the session was cancelled".into()),
        E::NoCompatibleProtocolVersion {
            server_supported, ..
        } if !server_supported.is_empty()
            && server_supported.iter().all(ProtocolVersion::has_initialize) =>
        {
            SessionFailure::LegacyOnly
        }
        other => SessionFailure::Protocol(other.to_string()),
    }
}

/// What a failed request means. An SSE event past the transport's cap reaches rmcp's caller only
/// as a closed stream, so `http` is asked first whether one ended this request (see
/// `tools::transport`): such a failure is too large, not unavailable, and never retried.
fn classify_service(error: &ServiceError, http: &McpHttp) -> SessionFailure {
    if let Some(max) = http.take_oversized_event() {
        return SessionFailure::TooLarge(max);
    }
    match error {
        ServiceError::TransportSend(e) => classify_chain(e.error.as_ref()),
        ServiceError::McpError(e) => SessionFailure::Protocol(format!(
            "JSON-RPC error {}: {}",
            e.code.0,
            body::truncate_text(&e.message, body::TOOL_ERROR_MESSAGE_MAX_BYTES)
        )),
        ServiceError::TransportClosed => {
            SessionFailure::Unavailable("the connection to the server closed".into())
        }
        ServiceError::Timeout { timeout } => {
            SessionFailure::Unavailable(format!("no answer within {timeout:?}"))
        }
        other => SessionFailure::Protocol(other.to_string()),
    }
}

fn classify_chain(top: &(dyn StdError + Send + Sync + 'static)) -> SessionFailure {
    if let Some(forbidden) = super::address::find_forbidden(top) {
        return SessionFailure::Forbidden(forbidden.to_string());
    }
    let mut current: Option<&(dyn StdError + 'static)> = Some(top);
    while let Some(error) = current {
        if let Some(http) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
            return classify_http(http);
        }
        if let Some(e) = error.downcast_ref::<reqwest::Error>() {
            return SessionFailure::Unavailable(describe_reqwest(e));
        }
        current = error.source();
    }
    SessionFailure::Unavailable(top.to_string())
}

fn classify_http(error: &StreamableHttpError<reqwest::Error>) -> SessionFailure {
    use StreamableHttpError as H;
    match error {
        H::SessionExpired => SessionFailure::Expired,
        H::AuthRequired(_) | H::InsufficientScope(_) => SessionFailure::Unauthorized,
        H::ResponseBodyTooLarge { max_size } => SessionFailure::TooLarge(*max_size),
        H::HttpStatus(status) => SessionFailure::Unavailable(format!("HTTP {}", status.status)),
        // rmcp does not give the client error as a source: look inside it here.
        H::Client(e) => match super::address::find_forbidden(e) {
            Some(forbidden) => SessionFailure::Forbidden(forbidden.to_string()),
            None => SessionFailure::Unavailable(describe_reqwest(e)),
        },
        H::Io(_)
        | H::Sse(_)
        | H::UnexpectedEndOfStream
        | H::TransportChannelClosed
        | H::TokioJoinError(_)
        | H::ControlRequestTimeout
        | H::SessionRecoveryTimeout => SessionFailure::Unavailable(error.to_string()),
        other => SessionFailure::Protocol(other.to_string()),
    }
}

/// A reqwest error by its kind and its sources: the top error only repeats the URL, which a
/// tool error never shows (the caller names the server).
fn describe_reqwest(e: &reqwest::Error) -> String {
    let kind = if e.is_connect() {
        "cannot connect"
    } else if e.is_timeout() {
        "timed out"
    } else {
        "HTTP error"
    };
    match StdError::source(e) {
        Some(cause) => format!("{kind}: {}", crate::redact::error_text(cause)),
        None => kind.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn small_results_are_kept_whole() {
        let r = ToolResult {
            content: vec![json!({"type": "text", "text": "hello"})],
            structured_content: Some(json!({"a": 1})),
            is_error: false,
        };
        assert_eq!(cap_result(r.clone(), 1024), r);
    }

    #[test]
    fn large_results_are_cut_with_a_note() {
        let big = "é".repeat(10_000);
        let r = ToolResult {
            content: vec![
                json!({"type": "text", "text": "first"}),
                json!({"type": "text", "text": big}),
                json!({"type": "image", "data": "x".repeat(5000), "mimeType": "image/png"}),
            ],
            structured_content: Some(json!({"big": "y".repeat(5000)})),
            is_error: true,
        };
        let capped = cap_result(r, 1000);
        let size: usize = capped.content.iter().map(|b| b.to_string().len()).sum();
        assert!(size < 1200, "{size}");
        assert!(capped.is_error);
        assert!(capped.structured_content.is_none());
        assert_eq!(capped.content[0]["text"], "first");
        let note = capped.content.last().unwrap()["text"].as_str().unwrap();
        assert!(note.contains("only the first 1000 bytes"), "{note}");
    }
}
