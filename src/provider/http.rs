//! What both adapters share at the HTTP edge: the concurrency limit, the request timeout, the
//! key, sending a JSON body, and turning a non-2xx answer into a classified [`ProviderError`].

use std::sync::Arc;
use std::time::SystemTime;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use tokio::sync::Semaphore;

use super::capacity::{ModelCapacities, RateLimits};
use super::{ModelRef, ProviderError, ProviderSettings, parse_retry_after};
use crate::base_url::BaseUrl;
use crate::secret::Secret;

/// Longest provider error text kept in an error message.
const MAX_MESSAGE_LEN: usize = 500;

pub(crate) struct HttpCore {
    pub(crate) settings: ProviderSettings,
    /// `settings.base_url`, parsed once; an error when it is not a usable base (the
    /// configuration refuses such a URL first): then every call fails, saying so.
    base: Result<BaseUrl, String>,
    http: reqwest::Client,
    /// Present when `max_concurrency` is set.
    permits: Option<Arc<Semaphore>>,
    /// Told what every answer's rate-limit headers say (the registry's, shared by all tasks).
    capacities: Option<Arc<ModelCapacities>>,
}

impl HttpCore {
    pub(crate) fn new(settings: ProviderSettings, http: reqwest::Client) -> Self {
        let permits = settings
            .max_concurrency
            .map(|n| Arc::new(Semaphore::new(n.max(1))));
        HttpCore {
            base: BaseUrl::parse(&settings.base_url),
            settings,
            http,
            permits,
            capacities: None,
        }
    }

    pub(crate) fn with_capacities(mut self, capacities: Arc<ModelCapacities>) -> Self {
        self.capacities = Some(capacities);
        self
    }

    /// Tells the capacities what an answer's headers say about `model`'s limits.
    fn observe_limits(&self, model: &str, sent: tokio::time::Instant, headers: &HeaderMap) {
        let Some(capacities) = &self.capacities else {
            return;
        };
        let limits = RateLimits::parse(headers, SystemTime::now(), capacities.policy().max_wait);
        if limits.is_empty() {
            return;
        }
        let model = ModelRef {
            provider: self.settings.name.clone(),
            model: model.to_string(),
        };
        capacities.observe(&model, sent, tokio::time::Instant::now(), &limits);
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{}", self.settings.base_url.trim_end_matches('/'), path)
    }

    /// The key as it is now (a file is re-read when it changed); None when none is configured.
    pub(crate) fn key(&self, model: &str) -> Result<Option<Secret>, ProviderError> {
        match &self.settings.api_key {
            None => Ok(None),
            Some(source) => source
                .load()
                .map(Some)
                .map_err(|e| self.setup(model, format!("cannot read the API key: {e}"))),
        }
    }

    /// A header value for a secret, marked sensitive so no Debug print shows it.
    pub(crate) fn secret_header(
        &self,
        model: &str,
        prefix: &str,
        key: &Secret,
    ) -> Result<HeaderValue, ProviderError> {
        let mut value =
            HeaderValue::from_str(&format!("{prefix}{}", key.expose())).map_err(|_| {
                self.setup(
                    model,
                    "the API key contains characters not allowed in an HTTP header; check the key"
                        .to_string(),
                )
            })?;
        value.set_sensitive(true);
        Ok(value)
    }

    fn setup(&self, model: &str, message: String) -> ProviderError {
        ProviderError::Setup {
            provider: self.settings.name.clone(),
            model: model.to_string(),
            message,
        }
    }

    pub(crate) fn malformed(&self, model: &str, message: impl Into<String>) -> ProviderError {
        ProviderError::Malformed {
            provider: self.settings.name.clone(),
            model: model.to_string(),
            message: message.into(),
        }
    }

    /// Sends `body` as JSON and returns a 2xx body, read completely, or the classified failure.
    pub(crate) async fn post_json(
        &self,
        path: &str,
        model: &str,
        mut headers: HeaderMap,
        traceparent: Option<&str>,
        key: Option<&Secret>,
        body: &Value,
    ) -> Result<Vec<u8>, ProviderError> {
        let timeout = self.settings.request_timeout;
        let _permit = match &self.permits {
            None => None,
            Some(sem) => match tokio::time::timeout(timeout, sem.clone().acquire_owned()).await {
                Ok(Ok(p)) => Some(p),
                Ok(Err(_closed)) => None,
                Err(_) => {
                    return Err(ProviderError::Unavailable {
                        provider: self.settings.name.clone(),
                        model: model.to_string(),
                        status: None,
                        message: format!(
                            "no free slot under this provider's concurrency limit of {} within {:?}",
                            self.settings.max_concurrency.unwrap_or(0),
                            timeout
                        ),
                        retry_after: None,
                    });
                }
            },
        };
        if let Some(tp) = traceparent
            && let Ok(v) = HeaderValue::from_str(tp)
        {
            headers.insert(HeaderName::from_static("traceparent"), v);
        }
        let payload = serde_json::to_vec(body)
            .map_err(|e| self.setup(model, format!("cannot encode the request: {e}")))?;
        let endpoint = match &self.base {
            Ok(base) => base.join(path),
            Err(why) => {
                return Err(self.setup(model, format!("its base URL cannot be used: {why}")));
            }
        };
        let url = self.url(path);
        let transient = |what: &str, e: reqwest::Error| ProviderError::Transient {
            provider: self.settings.name.clone(),
            model: model.to_string(),
            message: format!("{what} {url}: {}", describe(&e)),
            connect: e.is_connect(),
        };
        let sent = tokio::time::Instant::now();
        let response = self
            .http
            .post(endpoint)
            .headers(headers)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "application/json")
            .timeout(timeout)
            .body(payload)
            .send()
            .await
            .map_err(|e| transient("request to", e))?;
        let status = response.status();
        self.observe_limits(model, sent, response.headers());
        if !status.is_success() {
            let response_headers = response.headers().clone();
            let bytes = crate::body::read_prefix(response, crate::body::ERROR_BODY_MAX_BYTES).await;
            return Err(self.classify(model, status.as_u16(), &response_headers, &bytes, key));
        }
        let what = format!("the answer of {url}");
        match crate::body::read_capped(response, crate::body::MODEL_RESPONSE_MAX_BYTES, &what).await
        {
            Ok(bytes) => Ok(bytes),
            Err(crate::body::ReadError::TooLarge(too_large)) => Err(ProviderError::TooLarge {
                provider: self.settings.name.clone(),
                model: model.to_string(),
                too_large,
            }),
            Err(crate::body::ReadError::Http(e)) if e.is_timeout() => {
                Err(transient("reading the answer of", e))
            }
            Err(crate::body::ReadError::Http(e)) => Err(self.malformed(
                model,
                format!("the answer of {url} was cut short: {}", describe(&e)),
            )),
        }
    }

    /// Classifies a non-2xx answer (protocol.md Part C).
    fn classify(
        &self,
        model: &str,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
        key: Option<&Secret>,
    ) -> ProviderError {
        let (error_type, code, raw_message) = error_fields(body);
        let mut message = raw_message.unwrap_or_else(|| {
            let text = String::from_utf8_lossy(body).trim().to_string();
            if text.is_empty() {
                format!("HTTP {status} with an empty body")
            } else {
                text
            }
        });
        if let Some(k) = key
            && !k.expose().is_empty()
        {
            message = message.replace(k.expose(), crate::secret::MASK);
        }
        if message.len() > MAX_MESSAGE_LEN {
            let mut cut = MAX_MESSAGE_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        let lower = message.to_ascii_lowercase();
        let overloaded = error_type.as_deref() == Some("overloaded_error")
            || code.as_deref() == Some("overloaded")
            || lower.contains("overloaded");
        let provider = self.settings.name.clone();
        let model = model.to_string();
        if matches!(status, 429 | 503 | 529) || overloaded {
            return ProviderError::Unavailable {
                provider,
                model,
                status: Some(status),
                message,
                retry_after: parse_retry_after(headers, SystemTime::now()),
            };
        }
        // llama.cpp answers a conversation longer than its context with a 500
        // ("Context size has been exceeded."), newer versions with `exceed_context_size_error`.
        // It is the request's fault, not the server's: retrying or deferring it cannot help.
        if status == 413
            || (status == 400
                && context_overflow_4xx(error_type.as_deref(), code.as_deref(), &lower))
            || (status >= 500 && context_overflow_5xx(error_type.as_deref(), &lower))
        {
            return ProviderError::ContextTooLong {
                provider,
                model,
                message,
            };
        }
        if status == 408 || status >= 500 {
            return ProviderError::Transient {
                provider,
                model,
                message: format!("HTTP {status}: {message}"),
                connect: false,
            };
        }
        if (400..500).contains(&status) {
            return ProviderError::Rejected {
                provider,
                model,
                status,
                message,
            };
        }
        ProviderError::Malformed {
            provider,
            model,
            message: format!("unexpected HTTP {status}: {message}"),
        }
    }
}

/// A 400 that says the conversation does not fit the model's context: OpenAI's
/// `context_length_exceeded` code, Anthropic's "prompt is too long", llama.cpp's
/// `exceed_context_size_error` ("... exceeds the available context size ..."), and the wording
/// of OpenAI-compatible servers that send no code ("maximum context length", "context window").
fn context_overflow_4xx(error_type: Option<&str>, code: Option<&str>, lower: &str) -> bool {
    code == Some("context_length_exceeded")
        || error_type == Some("exceed_context_size_error")
        || lower.contains("prompt is too long")
        || lower.contains("context length")
        || lower.contains("context window")
        || lower.contains("context_length_exceeded")
        || lower.contains("exceeds the available context size")
}

/// A 5xx that is in truth a context overflow, named exactly: llama.cpp's older
/// "Context size has been exceeded." (a 500 `server_error`) and its `exceed_context_size_error`
/// type. Nothing vaguer: any other 5xx stays a failure worth retrying.
fn context_overflow_5xx(error_type: Option<&str>, lower: &str) -> bool {
    error_type == Some("exceed_context_size_error")
        || lower.contains("context size has been exceeded")
        || lower.contains("exceeds the available context size")
}

/// `error.type`, `error.code` and `error.message` of an OpenAI (`{"error": {..}}`) or Anthropic
/// (`{"type": "error", "error": {..}}`) error body; a bare string `error` counts as the message.
fn error_fields(body: &[u8]) -> (Option<String>, Option<String>, Option<String>) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return (None, None, None);
    };
    let text = |v: Option<&Value>| match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    match v.get("error") {
        Some(Value::String(s)) => (None, None, Some(s.clone())),
        Some(e) => (
            text(e.get("type")),
            text(e.get("code")),
            text(e.get("message")),
        ),
        None => (None, None, text(v.get("message"))),
    }
}

/// A reqwest error by its kind and its sources (the top error only repeats the URL).
fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "failed"
    };
    let cause = std::error::Error::source(e)
        .map(crate::errors::chain)
        .unwrap_or_default();
    if cause.is_empty() {
        kind.to_string()
    } else {
        format!("{kind} ({cause})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ProviderKind;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn the_wait_for_a_concurrency_permit_is_bounded_by_the_request_timeout() {
        let core = HttpCore::new(
            ProviderSettings {
                name: "local".into(),
                kind: ProviderKind::OpenAi,
                // Never contacted: the only permit is taken below.
                base_url: "http://127.0.0.1:9".into(),
                api_key: None,
                max_concurrency: Some(1),
                request_timeout: Duration::from_secs(5),
                structured_output: Default::default(),
            },
            reqwest::Client::new(),
        );
        let held = core.permits.clone().unwrap().acquire_owned().await.unwrap();
        let start = tokio::time::Instant::now();
        let err = core
            .post_json(
                "/chat/completions",
                "m",
                HeaderMap::new(),
                None,
                None,
                &Value::Null,
            )
            .await
            .unwrap_err();
        assert_eq!(err.outcome(), "unavailable", "{err}");
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        drop(held);
    }
}
