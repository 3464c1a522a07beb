//! Span export over OTLP/HTTP (protobuf), configured by the standard `OTEL_*` variables: whether
//! it is on, the tracer provider with its bounded batch queue, the HTTP client it sends with
//! (ours), and its bounded shutdown.
//!
//! Export is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set
//! (and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`). The SDK itself reads
//! the rest from the process environment: endpoint, `OTEL_EXPORTER_OTLP_HEADERS`/`_TIMEOUT`,
//! `OTEL_SERVICE_NAME` (defaulted here to `abada-agent-worker`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER`/`_ARG` (default parent-based always-on) and `OTEL_BSP_*`.
//!
//! The headers (`OTEL_EXPORTER_OTLP_TRACES_HEADERS`, `OTEL_EXPORTER_OTLP_HEADERS`) and a user
//! part of the endpoint are credentials (a collector's API key): they follow the rule of every
//! credential ([`crate::channel`]), https or loopback, or `ABADA_AGENT_ALLOW_INSECURE_HTTP=true`;
//! otherwise the worker does not start, naming the variable (never its value).
//!
//! The task path never waits on export: a finished span goes into the batch processor's bounded
//! queue (`try_send`, dropped when full) and one SDK thread sends batches. A collector that is
//! down costs the dropped spans and one warning a minute, nothing else.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithHttpConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, Tracer};

use crate::env::EnvSource;

/// The `service.name` when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names one.
pub(crate) const DEFAULT_SERVICE_NAME: &str = "abada-agent-worker";

/// The largest collector answer read (an `ExportTraceServiceResponse` is a few bytes; a partial
/// success message a few hundred).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// The default bound of one export request, as the OTLP specification's
/// `OTEL_EXPORTER_OTLP_TIMEOUT` default.
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// At most one "cannot export" warning per this long: a collector that is down must not flood
/// the logs.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Whether message content (prompts, answers, tool arguments and results) goes on spans:
/// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`. Process-wide like the subscriber; only
/// ever true while spans are exported.
static CAPTURE_CONTENT: AtomicBool = AtomicBool::new(false);

/// True when spans carry message content (opt-in, see [`ExportSettings::capture_content`]).
pub(crate) fn capture_content() -> bool {
    CAPTURE_CONTENT.load(Ordering::Relaxed)
}

/// An `OTEL_*` setting this worker cannot honour.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OtelConfigError {
    #[error(
        "{var}={value:?} is not supported: this worker exports spans over OTLP/HTTP with protobuf \
         only; set it to \"http/protobuf\" (the collector's HTTP port, usually 4318) or unset it"
    )]
    UnsupportedProtocol { var: &'static str, value: String },
    #[error("{var}={value:?} is not a number of milliseconds; set a whole number, e.g. 10000")]
    BadTimeout { var: &'static str, value: String },
    #[error("{var}: {source}")]
    InsecureHeaders {
        var: &'static str,
        source: crate::channel::InsecureChannel,
    },
    #[error("cannot set up span export: {0}")]
    Setup(String),
}

/// What the worker reads itself of the `OTEL_*` variables (the SDK reads the rest).
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSettings {
    /// Bounds one export request (`OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, `_TIMEOUT`; default 10 s).
    /// The SDK applies it to its retry loop only; the client we hand it needs its own.
    pub timeout: Duration,
    /// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`: `true`, `SPAN_ONLY` or
    /// `SPAN_AND_EVENT` (the OpenTelemetry GenAI instrumentations' spellings, any case) turn
    /// content capture on; anything else, and unset, leave it off.
    pub(crate) capture_content: bool,
    /// What travels in clear because `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allowed it (the
    /// headers to an http:// collector that is not loopback), for the start-up warning.
    pub in_clear: Option<String>,
}

impl ExportSettings {
    /// `Ok(None)` when span export is off. `allow_insecure` is
    /// `ABADA_AGENT_ALLOW_INSECURE_HTTP`: whether the headers may go to an http:// collector
    /// that is not loopback.
    pub fn from_env(
        env: &dyn EnvSource,
        allow_insecure: bool,
    ) -> Result<Option<ExportSettings>, OtelConfigError> {
        let var = |k: &str| env.get(k).filter(|v| !v.trim().is_empty());
        let disabled =
            var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let no_exporter =
            var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
        let endpoint = [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .into_iter()
        .find_map(|name| var(name).map(|url| (name, url)));
        let Some((endpoint_var, endpoint)) = endpoint.filter(|_| !disabled && !no_exporter) else {
            return Ok(None);
        };
        let in_clear = check_credentials(&var, endpoint_var, &endpoint, allow_insecure)?;
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(value) = var(name) {
                if value.trim() != "http/protobuf" {
                    return Err(OtelConfigError::UnsupportedProtocol { var: name, value });
                }
                break;
            }
        }
        let mut timeout = DEFAULT_EXPORT_TIMEOUT;
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ] {
            if let Some(value) = var(name) {
                let ms: u64 = value
                    .trim()
                    .parse()
                    .map_err(|_| OtelConfigError::BadTimeout { var: name, value })?;
                timeout = Duration::from_millis(ms.max(1));
                break;
            }
        }
        let capture_content = var("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")
            .is_some_and(|v| {
                let v = v.trim();
                ["true", "span_only", "span_and_event"]
                    .iter()
                    .any(|on| v.eq_ignore_ascii_case(on))
            });
        Ok(Some(ExportSettings {
            timeout,
            capture_content,
            in_clear,
        }))
    }
}

/// The credentials span export sends (the headers the SDK reads, a user part of the endpoint)
/// checked against [`crate::channel::check`]: an error naming the variable when they would
/// travel in clear unallowed; what travels in clear when allowed.
fn check_credentials(
    var: &dyn Fn(&str) -> Option<String>,
    endpoint_var: &'static str,
    endpoint: &str,
    allow_insecure: bool,
) -> Result<Option<String>, OtelConfigError> {
    // The SDK sends the traces variable's headers when it is set, else the general one's.
    let headers = [
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_HEADERS",
    ]
    .into_iter()
    .find(|name| var(name).is_some());
    let user_part = reqwest::Url::parse(endpoint.trim())
        .is_ok_and(|u| !u.username().is_empty() || u.password().is_some());
    let credential = match (headers, user_part) {
        (Some(name), _) => Some((name, format!("the OTLP headers ({name})"))),
        (None, true) => Some((endpoint_var, format!("the user part of {endpoint_var}"))),
        (None, false) => None,
    };
    let Some((name, what)) = credential else {
        return Ok(None);
    };
    match crate::channel::check(endpoint, &what, allow_insecure) {
        Ok(crate::channel::Channel::Protected) => Ok(None),
        Ok(crate::channel::Channel::Clear) => {
            Ok(Some(format!("{what} to {}", crate::redact::url(endpoint))))
        }
        Err(source) => Err(OtelConfigError::InsecureHeaders { var: name, source }),
    }
}

/// The running span export: the tracer provider and its batch thread.
pub struct SpanExport {
    provider: SdkTracerProvider,
    in_clear: Option<String>,
}

impl SpanExport {
    /// Starts the export. `http` is a client builder with the worker's trust roots
    /// (`ABADA_AGENT_CA_FILE`); `runtime` drives its requests, since the batch processor's own
    /// thread has no tokio reactor.
    pub fn start(
        settings: &ExportSettings,
        http: reqwest::ClientBuilder,
        runtime: tokio::runtime::Handle,
    ) -> Result<SpanExport, OtelConfigError> {
        let client = http
            .timeout(settings.timeout)
            .connect_timeout(settings.timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| OtelConfigError::Setup(crate::errors::chain(&e)))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(OtlpHttp {
                client,
                runtime,
                last_warning: std::sync::Arc::new(AtomicU64::new(0)),
            })
            .build()
            .map_err(|e| OtelConfigError::Setup(crate::errors::chain(&e)))?;
        // `BatchConfigBuilder::default()` reads OTEL_BSP_*; nothing is set over it, so the
        // specification's defaults hold: a queue of 2048 spans, batches of 512, every 5 s.
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(BatchConfigBuilder::default().build())
            .build();
        // No `with_sampler`: the SDK then reads OTEL_TRACES_SAMPLER and defaults to parent-based
        // always-on, so the engine's sampling decision (the traceparent's flags) holds.
        let provider = SdkTracerProvider::builder()
            .with_resource(resource())
            .with_span_processor(batch)
            .build();
        CAPTURE_CONTENT.store(settings.capture_content, Ordering::Relaxed);
        Ok(SpanExport {
            provider,
            in_clear: settings.in_clear.clone(),
        })
    }

    /// What the export sends in clear, allowed by `ABADA_AGENT_ALLOW_INSECURE_HTTP=true`.
    pub fn credentials_in_clear(&self) -> Option<&str> {
        self.in_clear.as_deref()
    }

    /// The tracer the `tracing` bridge layer records into.
    pub fn tracer(&self) -> Tracer {
        self.provider.tracer("abada-agent-worker")
    }

    /// Flushes what is queued and stops the batch thread, within `limit` (a collector that is
    /// down or never answers does not hold the worker's exit longer). Call it while the runtime
    /// still runs: the last export is sent on it.
    pub async fn shutdown(self, limit: Duration) {
        let provider = self.provider;
        let result =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(limit)).await;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "span export did not shut down cleanly; spans still queued are lost")
            }
            Err(e) => tracing::warn!(error = %e, "span export shutdown failed"),
        }
        CAPTURE_CONTENT.store(false, Ordering::Relaxed);
    }
}

/// The resource: what the SDK's detectors found (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`), our service name when they named none, and our version.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let unnamed = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_none_or(|v| v.as_str().starts_with("unknown_service"));
    let mut builder = Resource::builder();
    if unnamed {
        builder = builder.with_service_name(DEFAULT_SERVICE_NAME);
    }
    builder
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build()
}

/// The exporter's HTTP client: our reqwest client, each request spawned onto the worker's
/// runtime and awaited through its `JoinHandle` (which the SDK's executor-less thread can poll).
#[derive(Debug, Clone)]
struct OtlpHttp {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
    /// Seconds since the epoch of the last "cannot export" warning.
    last_warning: std::sync::Arc<AtomicU64>,
}

/// Why one export request failed.
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("the collector's answer is larger than {MAX_RESPONSE_BYTES} bytes")]
    TooLarge,
    #[error("the collector answered HTTP {0}")]
    Status(u16),
}

impl OtlpHttp {
    /// Logs a failed export, at most once per [`WARN_EVERY`]. The message names neither the URL
    /// (it may hold credentials) nor the headers (`OTEL_EXPORTER_OTLP_HEADERS` often does).
    fn warn(&self, what: &str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let last = self.last_warning.load(Ordering::Relaxed);
        if now.saturating_sub(last) < WARN_EVERY.as_secs()
            || self
                .last_warning
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        tracing::warn!(
            error = what,
            "cannot export spans to the OpenTelemetry collector (OTEL_EXPORTER_OTLP_ENDPOINT); \
             spans are dropped while it lasts, tasks are not affected (next warning in a minute at the earliest)"
        );
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for OtlpHttp {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<
        opentelemetry_http::Response<opentelemetry_http::Bytes>,
        opentelemetry_http::HttpError,
    > {
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let request = reqwest::Request::try_from(request)?;
            let mut response = client.execute(request).await?;
            let status = response.status();
            let headers = response.headers().clone();
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await? {
                if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                    return Err(ExportError::TooLarge.into());
                }
                body.extend_from_slice(&chunk);
            }
            let mut out = opentelemetry_http::Response::new(opentelemetry_http::Bytes::from(body));
            *out.status_mut() = status;
            *out.headers_mut() = headers;
            Ok::<_, opentelemetry_http::HttpError>(out)
        });
        let result = match sent.await {
            Ok(r) => r,
            Err(e) => Err(e.into()),
        };
        match &result {
            Ok(r) if !r.status().is_success() => {
                self.warn(&ExportError::Status(r.status().as_u16()).to_string())
            }
            Ok(_) => {}
            Err(e) => self.warn(&describe(e.as_ref())),
        }
        result
    }
}

/// An export error on one line, without the URL a reqwest error would carry.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    match e.downcast_ref::<reqwest::Error>() {
        Some(re) => {
            let kind = if re.is_timeout() {
                "timed out"
            } else if re.is_connect() {
                "connection failed"
            } else {
                "request failed"
            };
            let mut text = kind.to_string();
            let mut source = std::error::Error::source(re);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
        None => crate::errors::chain(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Env(HashMap<&'static str, &'static str>);
    impl EnvSource for Env {
        fn get(&self, key: &str) -> Option<String> {
            self.0.get(key).map(|v| v.to_string())
        }
    }
    fn env(pairs: &[(&'static str, &'static str)]) -> Env {
        Env(pairs.iter().copied().collect())
    }
    fn from_env(env: &Env) -> Result<Option<ExportSettings>, OtelConfigError> {
        ExportSettings::from_env(env, false)
    }

    #[test]
    fn otlp_headers_go_over_https_or_to_loopback_only() {
        let headers = ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=otlp-marker-9");
        let far = (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://collector.internal:4318",
        );
        let e = from_env(&env(&[far, headers])).unwrap_err();
        assert!(
            matches!(
                e,
                OtelConfigError::InsecureHeaders {
                    var: "OTEL_EXPORTER_OTLP_HEADERS",
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.starts_with("OTEL_EXPORTER_OTLP_HEADERS: "), "{text}");
        assert!(
            text.contains("ABADA_AGENT_ALLOW_INSECURE_HTTP=true"),
            "{text}"
        );
        assert!(!text.contains("otlp-marker-9"), "{text}");
        // The traces variable, and a password in the endpoint, are credentials too.
        let e = from_env(&env(&[
            far,
            (
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                "authorization=Bearer otlp-marker-9",
            ),
        ]))
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("OTEL_EXPORTER_OTLP_TRACES_HEADERS: "),
            "{e}"
        );
        let e = from_env(&env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://u:otlp-marker-9@collector.internal:4318/v1/traces",
        )]))
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: "),
            "{e}"
        );
        assert!(!e.to_string().contains("otlp-marker-9"), "{e}");
        // https, loopback, no credential at all, or the operator's allow.
        for ok in [
            vec![
                (
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "https://collector.internal:4318",
                ),
                headers,
            ],
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                headers,
            ],
            vec![far],
        ] {
            let s = from_env(&env(&ok)).unwrap().unwrap();
            assert_eq!(s.in_clear, None, "{ok:?}");
        }
        let allowed = ExportSettings::from_env(&env(&[far, headers]), true)
            .unwrap()
            .unwrap();
        let clear = allowed.in_clear.unwrap();
        assert!(clear.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{clear}");
        assert!(!clear.contains("otlp-marker-9"), "{clear}");
    }

    #[test]
    fn export_is_on_only_with_an_endpoint() {
        assert_eq!(from_env(&env(&[])), Ok(None));
        assert_eq!(
            from_env(&env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])),
            Ok(None)
        );
        let on = from_env(&env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://127.0.0.1:4318/v1/traces",
        )]))
        .unwrap()
        .unwrap();
        assert_eq!(on.timeout, DEFAULT_EXPORT_TIMEOUT);
        assert!(!on.capture_content);
        for off in [
            ("OTEL_SDK_DISABLED", "TRUE"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(
                from_env(&env(&[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                    off
                ])),
                Ok(None),
                "{off:?}"
            );
        }
    }

    #[test]
    fn only_http_protobuf_is_accepted_and_the_traces_variable_wins() {
        let base = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        assert!(matches!(
            from_env(&env(&[base, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])),
            Err(OtelConfigError::UnsupportedProtocol {
                var: "OTEL_EXPORTER_OTLP_PROTOCOL",
                ..
            })
        ));
        assert!(
            from_env(&env(&[
                base,
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ]))
            .unwrap()
            .is_some()
        );
        let e = from_env(&env(&[base, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")])).unwrap_err();
        assert!(e.to_string().contains("http/protobuf"), "{e}");
    }

    #[test]
    fn timeout_and_content_capture_are_read() {
        let base = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        let s = from_env(&env(&[
            base,
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert!(s.capture_content);
        for v in ["SPAN_ONLY", "span_and_event"] {
            let s = from_env(&env(&[
                base,
                ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", v),
            ]))
            .unwrap()
            .unwrap();
            assert!(s.capture_content, "{v}");
        }
        for v in ["false", "NO_CONTENT", "EVENT_ONLY", "1"] {
            let s = from_env(&env(&[
                base,
                ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", v),
            ]))
            .unwrap()
            .unwrap();
            assert!(!s.capture_content, "{v}");
        }
        assert!(matches!(
            from_env(&env(&[base, ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s")])),
            Err(OtelConfigError::BadTimeout { .. })
        ));
    }
}
