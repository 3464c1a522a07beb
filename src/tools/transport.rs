//! The HTTP client under one session's rmcp streamable HTTP transport: the tools' reqwest
//! client, plus the one fact rmcp keeps from its caller, that a response's SSE event went past
//! the transport's size cap.
//!
//! rmcp ends such a stream with a private error and tells the pending request only that its
//! stream closed (`ServiceError::TransportClosed`), which reads as a broken connection and would
//! be retried. [`McpHttp`] watches the response streams of the session's POSTs; the session asks
//! it after a failure whether an oversized event caused it, and classifies the failure as
//! too large (never retried) when one did.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
/// A session's requests are sequential (`ToolSessions` takes `&mut self` for every call), so an
/// oversized event seen on a POST's response stream belongs to the request that failed next.
#[derive(Clone, Debug)]
pub(crate) struct McpHttp {
    http: reqwest::Client,
    /// The cap an oversized response event went past, 0 when none did since the last
    /// [`McpHttp::take_oversized_event`].
    oversized_event: Arc<AtomicUsize>,
}

impl McpHttp {
    pub(crate) fn new(http: reqwest::Client) -> McpHttp {
        McpHttp {
            http,
            oversized_event: Arc::new(AtomicUsize::new(0)),
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
                session_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await;
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
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await;
        self.watch(response, limits.max_sse_event_size)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
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
