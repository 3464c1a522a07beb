//! Logging and span export. Logs: one JSON object per line (default) or human-readable `pretty`
//! lines, level from `RUST_LOG` (default `info`). Spans: over OTLP when the `OTEL_*` variables
//! say so ([`otel`]), the span tree of a task being [`spans`].
//!
//! Two libraries log what a peer controls or what is secret at their lower levels: rmcp logs a
//! tool server's `instructions` and every notification at INFO, tokio-postgres logs statement
//! parameters (prompts, tool arguments and results) at DEBUG. [`log_filter`] holds them at
//! [`HELD_TARGETS`]' levels whatever `RUST_LOG` says, unless `RUST_LOG` names them
//! (`RUST_LOG=debug,rmcp=debug`). Every field of a line is capped ([`cap`]). A library's line
//! that names a URL is dropped at every level ([`library_urls`]): rmcp prints a failed request's
//! URL whole, query and user information included, and the worker reports the same failure
//! naming the server instead.
//!
//! The JSON layer flattens the fields of every enclosing span into the line, so a line about a
//! task carries `task_id`, `process_instance_id`, `activity_id`, `attempt` and `trace_id`, and
//! every line carries `worker_id`. Values are formatted with their `Debug`/`Display`, so secret
//! types print their mask.
//!
//! Each layer has its own filter: `RUST_LOG` governs the log lines only; the exporter takes the
//! exported spans ([`spans::SPAN_TARGET`]) and nothing else, no log event in particular; the log
//! layers never see those spans, so no span field reaches a log line.

pub mod cap;
mod library_urls;
pub mod otel;
pub mod spans;
pub mod trace;

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Event, Id, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::{LookupSpan, Registry};
use tracing_subscriber::util::SubscriberInitExt;

use cap::CappedValue;

/// How log lines are written (`ABADA_AGENT_LOG_FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Pretty,
}

/// Where JSON lines go: stdout, or a buffer in tests.
type SharedWriter = Arc<Mutex<dyn Write + Send>>;

/// A layer of the subscriber stack, every one behind its own filter.
pub(crate) type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// Installs the global subscriber: the log layer in `format`, and the span exporter's layer
/// when `tracer` is given. Safe to call more than once (later calls do nothing).
pub fn init(format: LogFormat, worker_id: &str, tracer: Option<opentelemetry_sdk::trace::Tracer>) {
    let rust_log = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let log_layer: BoxedLayer = match format {
        LogFormat::Json => {
            JsonLayer::new(Arc::new(Mutex::new(std::io::stdout())), worker_id).boxed()
        }
        LogFormat::Pretty => pretty_layer(
            std::io::stderr,
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
        )
        .boxed(),
    };
    let _ = subscriber(log_layer, rust_log.as_deref(), tracer).try_init();
}

/// The subscriber [`init`] installs: `log_layer` behind the log filter (`rust_log`, see
/// [`log_filter`]; never the exported spans), and the exporter's layer behind its own filter
/// (the exported spans only) when `tracer` is given.
///
/// Static filters (Targets, EnvFilter): their verdict is cached per callsite, so a disabled
/// span or event costs one branch (a filter_fn would be asked at every call). With export off
/// the stack holds the log layer alone, not an empty `Option` layer: between the registry and
/// the per-layer filters, an empty layer turns every callsite the log filter refuses (each
/// exported span's) from "never" into "sometimes", and such a span is then weighed by every
/// filter each time it is made instead of costing one branch.
pub(crate) fn subscriber(
    log_layer: BoxedLayer,
    rust_log: Option<&str>,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) -> impl Subscriber + Send + Sync + for<'a> LookupSpan<'a> {
    let logs = log_filter(rust_log)
        .and(
            Targets::new()
                .with_default(LevelFilter::TRACE)
                .with_target(spans::SPAN_TARGET, LevelFilter::OFF),
        )
        .and(library_urls::DropsLibraryUrls);
    let mut layers: Vec<BoxedLayer> = Vec::with_capacity(2);
    if let Some(tracer) = tracer {
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_location(false)
                .with_target(false)
                .with_threads(false)
                .with_level(false)
                .with_tracked_inactivity(false)
                // Only the exported spans; no log event is ever emitted with their target.
                .with_filter(Targets::new().with_target(spans::SPAN_TARGET, LevelFilter::INFO))
                .boxed(),
        );
    }
    layers.push(log_layer.with_filter(logs).boxed());
    tracing_subscriber::registry().with(layers)
}

/// The `pretty` format's layer writing to `writer`, every field capped ([`cap::CappedFields`]).
pub(crate) fn pretty_layer<S, W>(writer: W, ansi: bool) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(cap::CappedFields)
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(writer)
}

/// Libraries held at a level (their target, and the most they log) unless `RUST_LOG` names them.
pub(crate) const HELD_TARGETS: &[(&str, LevelFilter)] = &[
    // A tool server's `instructions` and notifications, at INFO: a hostile server's megabytes.
    ("rmcp", LevelFilter::WARN),
    // Statement parameters at DEBUG (`tokio_postgres::query`): prompts, arguments, results.
    ("tokio_postgres", LevelFilter::INFO),
];

/// The log lines' filter: `rust_log` (`RUST_LOG`; `info` when unset or invalid), with each of
/// [`HELD_TARGETS`] held at its level unless a directive of `rust_log` names that target. A
/// bare `RUST_LOG=debug` thus leaves rmcp at `warn` and tokio-postgres at `info`;
/// `RUST_LOG=debug,rmcp=debug` lowers rmcp, `tokio_postgres::query=debug` that module only.
pub(crate) fn log_filter(rust_log: Option<&str>) -> EnvFilter {
    let spec = rust_log.map(str::trim).filter(|s| !s.is_empty());
    let mut filter = spec
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let spec = spec.filter(|s| EnvFilter::try_new(s).is_ok()).unwrap_or("");
    for (target, level) in HELD_TARGETS {
        if !names_target(spec, target) {
            let directive = format!("{target}={level}")
                .parse()
                .expect("a target and a level are a valid directive");
            filter = filter.add_directive(directive);
        }
    }
    filter
}

/// Whether a directive of `spec` (`RUST_LOG` syntax) names `target` itself.
fn names_target(spec: &str, target: &str) -> bool {
    spec.split(',').any(|directive| {
        let name = directive
            .split(['[', '='])
            .next()
            .unwrap_or_default()
            .trim();
        // A module named alone (`rmcp::service=debug`) is more specific than the held
        // crate's directive and wins over it for that module; the rest of the crate stays held.
        name == target
    })
}

/// A layer writing one flattened JSON object per event.
struct JsonLayer {
    out: SharedWriter,
    worker_id: String,
}

impl JsonLayer {
    pub fn new(out: SharedWriter, worker_id: &str) -> Self {
        JsonLayer {
            out,
            worker_id: worker_id.to_string(),
        }
    }
}

/// Fields recorded on a span, kept in its extensions.
struct SpanFields(Map<String, Value>);

struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().into(), Value::from(CappedValue::str(value)));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(
            field.name().into(),
            Value::from(CappedValue::display(value)),
        );
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::from(CappedValue::debug(value)));
    }
}

impl<S> Layer<S> for JsonLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Map::new();
        attrs.record(&mut JsonVisitor(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<SpanFields>()
        {
            values.record(&mut JsonVisitor(&mut fields.0));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            Value::from(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
        );
        line.insert(
            "level".into(),
            Value::from(event.metadata().level().as_str()),
        );
        line.insert("worker_id".into(), Value::from(self.worker_id.clone()));
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<SpanFields>() {
                    for (k, v) in &fields.0 {
                        line.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        let mut fields = Map::new();
        event.record(&mut JsonVisitor(&mut fields));
        for (k, v) in fields {
            line.insert(k, v);
        }
        line.insert("target".into(), Value::from(event.metadata().target()));
        let mut bytes = serde_json::to_vec(&Value::Object(line)).unwrap_or_default();
        bytes.push(b'\n');
        if let Ok(mut out) = self.out.lock() {
            let _ = out.write_all(&bytes);
            let _ = out.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_carry_worker_and_task_fields() {
        let buf: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(JsonLayer::new(buf.clone(), "w-1"));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("task", task_id = "t-9", attempt = 2);
            let _g = span.enter();
            let secret = crate::secret::Secret::new("sk-marker");
            tracing::info!(key = ?secret, "hello");
        });
        let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        let v: Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["worker_id"], "w-1");
        assert_eq!(v["task_id"], "t-9");
        assert_eq!(v["attempt"], 2);
        assert_eq!(v["message"], "hello");
        assert!(!text.contains("sk-marker"));
    }

    /// The lines a JSON layer behind `filter` writes for `emit`.
    fn json_lines(filter: EnvFilter, emit: impl FnOnce()) -> Vec<String> {
        let buf: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry()
            .with(JsonLayer::new(buf.clone(), "w-1").with_filter(filter));
        tracing::subscriber::with_default(subscriber, emit);
        let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    fn emit_from_every_held_library() {
        tracing::info!(target: "rmcp::service", instructions = "HOSTILE", "received instructions");
        tracing::warn!(target: "rmcp::service", "rmcp warning");
        tracing::debug!(target: "tokio_postgres::query", "executing statement with parameters: [\"PROMPT\"]");
        tracing::info!(target: "tokio_postgres::connection", "server notice");
        tracing::debug!(target: "abada_agent_worker::runner", "our own debug line");
    }

    #[test]
    fn a_bare_debug_leaves_rmcp_at_warn_and_tokio_postgres_at_info() {
        for rust_log in [
            None,
            Some("debug"),
            Some("trace"),
            Some("debug,abada_agent_worker=trace"),
        ] {
            let lines = json_lines(log_filter(rust_log), emit_from_every_held_library);
            let text = lines.join("\n");
            assert!(!text.contains("HOSTILE"), "{rust_log:?}: {text}");
            assert!(!text.contains("PROMPT"), "{rust_log:?}: {text}");
            assert!(text.contains("rmcp warning"), "{rust_log:?}: {text}");
            assert!(text.contains("server notice"), "{rust_log:?}: {text}");
            assert_eq!(
                text.contains("our own debug line"),
                rust_log.is_some(),
                "{rust_log:?}: {text}"
            );
        }
    }

    #[test]
    fn a_held_library_goes_lower_only_when_named() {
        let text = json_lines(
            log_filter(Some("debug,rmcp=debug")),
            emit_from_every_held_library,
        )
        .join("\n");
        assert!(text.contains("HOSTILE"), "{text}");
        assert!(!text.contains("PROMPT"), "{text}");
        let text = json_lines(
            log_filter(Some("info,tokio_postgres::query=debug")),
            emit_from_every_held_library,
        )
        .join("\n");
        assert!(text.contains("PROMPT"), "{text}");
        assert!(!text.contains("HOSTILE"), "{text}");
        // An invalid RUST_LOG is `info`, and the held libraries stay held.
        let text =
            json_lines(log_filter(Some("debug,=[")), emit_from_every_held_library).join("\n");
        assert!(
            !text.contains("HOSTILE") && !text.contains("our own debug line"),
            "{text}"
        );
    }

    /// The lines the worker's own subscriber stack ([`subscriber`], JSON) writes for `emit`.
    fn worker_lines(rust_log: Option<&str>, emit: impl FnOnce()) -> String {
        let buf: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
        let stack = subscriber(JsonLayer::new(buf.clone(), "w-1").boxed(), rust_log, None);
        tracing::subscriber::with_default(stack, emit);
        String::from_utf8(buf.lock().unwrap().clone()).unwrap()
    }

    /// rmcp 3.11's own error lines (`transport/worker.rs`, `streamable_http_client.rs`) carry a
    /// failed request's reqwest error, whose text holds the whole URL: dropped at every level,
    /// even with rmcp named in `RUST_LOG`. A library line without a URL and the worker's own
    /// lines (URLs redacted) are kept.
    #[test]
    fn a_librarys_line_naming_a_url_is_dropped_whatever_rust_log_says() {
        let reqwest_text = "error sending request for url (http://svc:PASSMARK@127.0.0.1:9/mcp/PATHMARK?api_key=KEYMARK)";
        let parsed = reqwest::Url::parse("http://h/x?api_key=KEYMARK").unwrap();
        let emit = || {
            tracing::error!(target: "rmcp::transport::worker", "worker quit with fatal: Client error: {reqwest_text}, when send initialize request");
            tracing::error!(target: "rmcp::transport::streamable_http_client", session_id = "s-1", "fail to delete session: {reqwest_text}");
            tracing::warn!(target: "rmcp::transport::streamable_http_client", error = reqwest_text, "sse stream error");
            tracing::warn!(target: "rmcp::service", uri = ?parsed, "a parsed URL's Debug form");
            tracing::warn!(target: "log", "from a log record: {reqwest_text}");
            tracing::warn!(target: "rmcp::service", "rmcp line without a url");
            tracing::warn!(url = %crate::redact::url("http://svc:PASSMARK@127.0.0.1:9/mcp?api_key=KEYMARK"), "our own line");
        };
        for rust_log in [
            None,
            Some("trace"),
            Some("info,rmcp=trace"),
            Some("warn,rmcp=debug,log=trace"),
        ] {
            let text = worker_lines(rust_log, emit);
            for secret in ["PASSMARK", "KEYMARK", "PATHMARK"] {
                assert!(!text.contains(secret), "{rust_log:?}: {secret} in {text}");
            }
            assert!(
                text.contains("rmcp line without a url"),
                "{rust_log:?}: {text}"
            );
            assert!(text.contains("our own line"), "{rust_log:?}: {text}");
            assert_eq!(text.lines().count(), 2, "{rust_log:?}: {text}");
        }
    }

    /// The metadata of the callsite at which `make` makes its span, taken under a bare
    /// registry (which wants every span).
    fn callsite_of(make: impl FnOnce() -> tracing::Span) -> &'static tracing::Metadata<'static> {
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            make()
                .metadata()
                .expect("a bare registry builds every span")
        })
    }

    /// Every kind of exported span a task makes on its hot path.
    fn exported_callsites() -> Vec<&'static tracing::Metadata<'static>> {
        vec![
            callsite_of(|| spans::client_call("engine", "complete", "engine.test", None)),
            callsite_of(|| {
                spans::invoke_agent(&spans::AgentSpan {
                    agent: "a",
                    provider: None,
                    model: None,
                    task_id: "t-1",
                    process_instance_id: None,
                    attempt: None,
                    parent: None,
                })
            }),
            callsite_of(|| spans::invoke_unknown_agent("t-1", None)),
            callsite_of(|| {
                spans::chat(&spans::ChatSpan {
                    provider: "openai",
                    configured_provider: "openai",
                    model: "m",
                    fallback_index: 0,
                    retry: 0,
                    max_tokens: None,
                })
            }),
            callsite_of(|| {
                spans::execute_tool(&spans::ToolSpan {
                    server: "s",
                    tool: "t",
                    call_id: "c",
                })
            }),
        ]
    }

    #[test]
    fn with_export_off_an_exported_span_is_never_wanted_and_costs_one_branch() {
        let sink: SharedWriter = Arc::new(Mutex::new(Vec::<u8>::new()));
        let off = subscriber(JsonLayer::new(sink.clone(), "w-1").boxed(), None, None);
        for meta in exported_callsites() {
            // "never" is cached at the callsite: the span macro stops at one branch. Nothing
            // else stops it: on "sometimes" the registry builds the span unless 64 per-layer
            // filters refuse it (`Registry::enabled`), and the span is then made, entered and
            // closed for no layer at all.
            assert!(
                off.register_callsite(meta).is_never(),
                "{}: wanted with export off",
                meta.name()
            );
        }
        // The log lines' own spans keep their cached "always".
        let task = callsite_of(|| tracing::info_span!("task", task_id = "t-1"));
        assert!(off.register_callsite(task).is_always());

        // With export on, the exporter still gets every one of them.
        use opentelemetry::trace::TracerProvider;
        let tracer = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .build()
            .tracer("test");
        let on = subscriber(JsonLayer::new(sink, "w-1").boxed(), None, Some(tracer));
        for meta in exported_callsites() {
            assert!(
                !on.register_callsite(meta).is_never(),
                "{}: not exported with export on",
                meta.name()
            );
        }
    }

    const HUGE: usize = 1_000_000;

    /// A hostile peer's megabyte in every kind of field an event and its span can carry.
    fn emit_huge_fields() {
        let huge = "i".repeat(HUGE);
        let span = tracing::info_span!("tool_server", instructions = huge.as_str());
        let _g = span.enter();
        let error = std::io::Error::other("e".repeat(HUGE));
        tracing::warn!(
            notification = huge.as_str(),
            debug = ?vec![7u8; HUGE / 3],
            error = &error as &(dyn std::error::Error + 'static),
            "{huge}"
        );
    }

    #[test]
    fn every_field_of_a_json_line_is_capped_and_says_it_was_cut() {
        let lines = json_lines(EnvFilter::new("info"), emit_huge_fields);
        assert_eq!(lines.len(), 1);
        let line = &lines[0];
        // Five capped fields and the fixed ones.
        assert!(
            line.len() < 6 * cap::MAX_FIELD_BYTES,
            "a line of {} bytes",
            line.len()
        );
        let v: Value = serde_json::from_str(line).unwrap();
        for field in ["instructions", "notification", "message", "error", "debug"] {
            let text = v[field].as_str().unwrap();
            assert!(
                text.len() < cap::MAX_FIELD_BYTES + 40,
                "{field}: {} bytes",
                text.len()
            );
            assert!(text.contains("…[cut: "), "{field} does not say it was cut");
        }
        assert!(
            v["instructions"]
                .as_str()
                .unwrap()
                .ends_with(&format!("…[cut: {HUGE} bytes]"))
        );
    }

    #[test]
    fn every_field_of_a_pretty_line_is_capped_and_says_it_was_cut() {
        #[derive(Clone)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf(Arc::new(Mutex::new(Vec::new())));
        let out = buf.clone();
        let subscriber =
            tracing_subscriber::registry().with(pretty_layer(move || out.clone(), false));
        tracing::subscriber::with_default(subscriber, emit_huge_fields);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{}", &text[..200.min(text.len())]);
        assert!(
            text.len() < 6 * cap::MAX_FIELD_BYTES,
            "a line of {} bytes",
            text.len()
        );
        assert_eq!(
            text.matches("…[cut: ").count(),
            5,
            "every huge field says it was cut"
        );
        assert!(text.contains(&format!("…[cut: {HUGE} bytes]")));
        assert!(text.contains("instructions=\"iii"));
    }
}
