//! Logging and span export. Logs: one JSON object per line (default) or human-readable `pretty`
//! lines, level from `RUST_LOG` (default `info`). Spans: over OTLP when the `OTEL_*` variables
//! say so ([`otel`]), the span tree of a task being [`spans`].
//!
//! The JSON layer flattens the fields of every enclosing span into the line, so a line about a
//! task carries `task_id`, `process_instance_id`, `activity_id`, `attempt` and `trace_id`, and
//! every line carries `worker_id`. Values are formatted with their `Debug`/`Display`, so secret
//! types print their mask.
//!
//! Each layer has its own filter: `RUST_LOG` governs the log lines only; the exporter takes the
//! exported spans ([`spans::SPAN_TARGET`]) and nothing else, no log event in particular; the log
//! layers never see those spans, so no span field reaches a log line.

pub mod otel;
pub mod spans;

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Event, Id, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Where JSON lines go: stdout, or a buffer in tests.
pub type SharedWriter = Arc<Mutex<dyn Write + Send>>;

/// Installs the global subscriber: the log layer in `format`, and the span exporter's layer
/// when `tracer` is given. Safe to call more than once (later calls do nothing).
pub fn init(format: LogFormat, worker_id: &str, tracer: Option<opentelemetry_sdk::trace::Tracer>) {
    // Static filters (Targets, EnvFilter): their verdict is cached per callsite, so a disabled
    // span or event costs one branch, as before export existed (a filter_fn would be asked at
    // every call).
    let logs = || {
        EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new("info"))
            .and(
                Targets::new()
                    .with_default(LevelFilter::TRACE)
                    .with_target(spans::SPAN_TARGET, LevelFilter::OFF),
            )
    };
    let export = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_target(false)
            .with_threads(false)
            .with_level(false)
            .with_tracked_inactivity(false)
            // Only the exported spans; no log event is ever emitted with their target.
            .with_filter(Targets::new().with_target(spans::SPAN_TARGET, LevelFilter::INFO))
    });
    let result = match format {
        LogFormat::Json => tracing_subscriber::registry()
            .with(export)
            .with(
                JsonLayer::new(Arc::new(Mutex::new(std::io::stdout())), worker_id)
                    .with_filter(logs()),
            )
            .try_init(),
        LogFormat::Pretty => tracing_subscriber::registry()
            .with(export)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_target(false)
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_writer(std::io::stderr)
                    .with_filter(logs()),
            )
            .try_init(),
    };
    let _ = result;
}

/// A layer writing one flattened JSON object per event.
pub struct JsonLayer {
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
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0
            .insert(field.name().into(), Value::from(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::from(format!("{value:?}")));
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
}
