//! What the workers of a seed say, for the check that no secret is in it: a `tracing` layer
//! ([`Capture`]) that writes down every event (every level, every field) and every span's
//! fields, as created and as recorded later, while the seed runs; the simulator adds each
//! worker's metrics text. The invariant (`invariants::no_secret_leaked`) looks for every secret
//! the world handed out (the tool credentials the engine issued) in all of it.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// The lines written down, with the paused clock's instant of each.
#[derive(Clone, Default)]
pub struct Capture {
    lines: Arc<Mutex<Vec<(tokio::time::Instant, String)>>>,
}

impl Capture {
    /// Everything written down so far, emptied.
    pub fn take(&self) -> Vec<(tokio::time::Instant, String)> {
        std::mem::take(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn push(&self, line: String) {
        // Outside a runtime (a span dropped after the seed) there is no paused clock to read.
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let now = tokio::time::Instant::now();
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((now, line));
    }
}

/// Every field as `name=value`, values with `Debug` (a `%` field's `Display`).
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut fields = Fields(format!("{} {}:", meta.level(), meta.target()));
        event.record(&mut fields);
        self.push(fields.0);
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut fields = Fields(format!("span {}:", attrs.metadata().name()));
        attrs.record(&mut fields);
        self.push(fields.0);
    }

    fn on_record(&self, _id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields("span record:".to_string());
        values.record(&mut fields);
        self.push(fields.0);
    }
}
