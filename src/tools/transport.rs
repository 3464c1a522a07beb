//! The HTTP client under one session's rmcp streamable HTTP transport: the tools' reqwest
//! client, plus two facts rmcp keeps from its caller: that a response's SSE event went past
//! the transport's size cap, and the session a failed handshake left on the server.
//!
//! rmcp ends such a stream with a private error and tells the pending request only that its
//! stream closed (`ServiceError::TransportClosed`), which reads as a broken connection and would
//! be retried. [`McpHttp`] watches the response streams of the session's POSTs; the session asks
//! it after a failure whether an oversized event caused it, and classifies the failure as
//! too large (never retried) when one did.
//!
//! rmcp deletes a session only when its transport got past the handshake: when the
//! `initialize` answer created a session but the handshake then failed (the `initialized`
//! notification refused because the credential died with the lease, the opening timed out),
//! the session id dies inside rmcp and the session stays open on the server. [`McpHttp`] keeps
//! the id of the session the opening POST created until a DELETE of it is sent, so the opener
//! can close it ([`McpHttp::close_unclaimed`]).

use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::ClientJsonRpcMessage;
use rmcp::transport::common::client_side_sse::BoxedSseResponse;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};

/// The text of rmcp's private `BoundedSseStreamError::EventTooLarge` (rmcp 3.11,
/// `transport/common/client_side_sse.rs`). The type is private and reaches us only boxed inside
/// `SseError::Body`, so its message is the one thing to match; the rmcp tests of this crate's
/// tool layer (`tests/it/tools.rs`) fail if an rmcp upgrade changes it.
const SSE_EVENT_TOO_LARGE: &str = "SSE event exceeded the maximum size";

/// The tools' reqwest client for one session's transport (clones share the watch).
///
/// A session's requests are sequential (`McpSessions` takes `&mut self` for every call), so an
/// oversized event seen on a POST's response stream belongs to the request that failed next.
#[derive(Clone, Debug)]
pub(crate) struct McpHttp {
    http: reqwest::Client,
    /// The cap an oversized response event went past, 0 when none did since the last
    /// [`McpHttp::take_oversized_event`].
    oversized_event: Arc<AtomicUsize>,
    /// The session the opening POST (the one sent without a session id) created on the server,
    /// until a DELETE of it is sent: what a failed handshake would otherwise leave open.
    unclosed: Arc<Mutex<Option<Arc<str>>>>,
}

impl McpHttp {
    pub(crate) fn new(http: reqwest::Client) -> McpHttp {
        McpHttp {
            http,
            oversized_event: Arc::new(AtomicUsize::new(0)),
            unclosed: Arc::new(Mutex::new(None)),
        }
    }

    fn unclosed(&self) -> std::sync::MutexGuard<'_, Option<Arc<str>>> {
        // Only ever holds an id; a panic elsewhere cannot leave it half-written.
        self.unclosed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the session the opening created: its transport now owns it (and deletes it when
    /// it closes).
    pub(crate) fn claim_session(&self) {
        self.unclosed().take();
    }

    /// Deletes the session a failed opening left on the server, if it created one that no
    /// DELETE has been sent for: with the opening's credential, bounded by `timeout`.
    /// `server` names the server in the log lines (never its URL).
    pub(crate) async fn close_unclaimed(
        &self,
        uri: &str,
        server: &str,
        auth_header: Option<String>,
        timeout: Duration,
    ) {
        let Some(session_id) = self.unclosed().take() else {
            return;
        };
        let deleted = tokio::time::timeout(
            timeout,
            self.http
                .delete_session(uri.into(), session_id, auth_header, HashMap::new()),
        )
        .await;
        match deleted {
            Ok(Ok(())) => {
                tracing::debug!(
                    server,
                    "closed the session a failed opening left on the tool server"
                )
            }
            Ok(Err(e)) => {
                let error = crate::redact::text_without_urls(&crate::body::truncate_text(
                    &crate::errors::chain(&e),
                    crate::body::TOOL_ERROR_MESSAGE_MAX_BYTES,
                ));
                tracing::warn!(server, error = %error, "could not close the session a failed opening left on the tool server; the server expires it")
            }
            Err(_) => {
                tracing::warn!(
                    server,
                    timeout_ms = timeout.as_millis() as u64,
                    "closing the session a failed opening left on the tool server timed out; the server expires it"
                )
            }
        }
    }

    /// Notes the session an opening POST's answer created (the `unclosed` field).
    fn note_opened(
        &self,
        sent_with: &Option<Arc<str>>,
        response: &Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>>,
    ) {
        if sent_with.is_some() {
            return;
        }
        if let Ok(
            StreamableHttpPostResponse::Json(_, Some(id))
            | StreamableHttpPostResponse::Sse(_, Some(id)),
        ) = response
        {
            *self.unclosed() = Some(id.as_str().into());
        }
    }

    /// The SSE event cap a response went past since the last call, if one did.
    pub(crate) fn take_oversized_event(&self) -> Option<usize> {
        match self.oversized_event.swap(0, Ordering::SeqCst) {
            0 => None,
            max => Some(max),
        }
    }

    /// Passes a POST's answer on, watching its SSE stream, if it is one, for an oversized event.
    fn watch(
        &self,
        response: Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>>,
        max_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        match response {
            Ok(StreamableHttpPostResponse::Sse(stream, session_id)) => {
                let seen = self.oversized_event.clone();
                let stream = stream
                    .inspect(move |event| {
                        if let Err(error) = event
                            && is_event_too_large(error)
                        {
                            seen.store(max_event_size.max(1), Ordering::SeqCst);
                        }
                    })
                    .boxed();
                Ok(StreamableHttpPostResponse::Sse(stream, session_id))
            }
            other => other,
        }
    }
}

/// True when `error` is rmcp's "event too large" (see [`SSE_EVENT_TOO_LARGE`]).
pub(crate) fn is_event_too_large(error: &SseError) -> bool {
    let mut current: Option<&(dyn StdError + 'static)> = Some(error);
    if let SseError::Body(inner) = error {
        current = Some(inner.as_ref());
    }
    while let Some(e) = current {
        if e.to_string().starts_with(SSE_EVENT_TOO_LARGE) {
            return true;
        }
        current = e.source();
    }
    false
}

impl StreamableHttpClient for McpHttp {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let response = self
            .http
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id.clone(),
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await;
        self.note_opened(&session_id, &response);
        self.watch(response, max_sse_event_size)
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let response = self
            .http
            .post_message_with_response_limits(
                uri,
                message,
                session_id.clone(),
                auth_header,
                custom_headers,
                limits,
            )
            .await;
        self.note_opened(&session_id, &response);
        self.watch(response, limits.max_sse_event_size)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        {
            let mut unclosed = self.unclosed();
            if unclosed.as_deref() == Some(&*session_id) {
                unclosed.take();
            }
        }
        self.http
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxedSseResponse, StreamableHttpError<Self::Error>> {
        self.http
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxedSseResponse, StreamableHttpError<Self::Error>> {
        self.http
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
    }
}
