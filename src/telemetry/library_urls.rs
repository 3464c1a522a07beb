//! A library's log line that names a URL is dropped, at every level and whatever `RUST_LOG` says.
//!
//! The worker shows every URL through [`crate::redact`], and names a tool server by its name,
//! never its URL. The libraries under it do not: rmcp 3.11 logs a failed request's error whole
//! (`transport/worker.rs`: "worker quit with fatal: {error}, when {context}";
//! `transport/streamable_http_client.rs`: "fail to get common stream: {error}", "fail to delete
//! session: {e}"), and reqwest writes the URL, user information and query included, into that
//! error's message. A tool server down with a key in its URL thus printed the key three times.
//! Every such failure also reaches the worker as the error of the call that failed, which it
//! reports and logs naming the server, so the library's own line adds nothing but the URL.
//!
//! [`DropsLibraryUrls`] is a per-layer filter of the log layers: an event whose target is not
//! the worker's own and one of whose fields names a URL (`://`, or the `Debug` form of a parsed
//! URL, which holds `cannot_be_a_base`) is not written. The field is judged as the log line would
//! carry it, capped at [`super::cap::MAX_FIELD_BYTES`]: what the cap cuts is never printed.
//! Callsites of the worker's own code keep their cached "always"; a library's callsites are
//! asked per event, which costs only when that library logs at an enabled level.

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata};
use tracing_subscriber::layer::{Context, Filter};

use super::cap::CappedValue;

/// The targets of the worker's own events (its crate, and the devkit's stand-ins in tests).
const OWN_TARGETS: &[&str] = &["abada_agent_worker", "abada_devkit"];

/// What marks a field as naming a URL: a scheme's separator, or a parsed URL's `Debug` form.
const URL_MARKS: &[&str] = &["://", "cannot_be_a_base"];

/// The log layers' filter that drops a library's line naming a URL (see the module's header).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DropsLibraryUrls;

fn is_own(target: &str) -> bool {
    OWN_TARGETS.iter().any(|own| {
        target
            .strip_prefix(own)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

impl<S> Filter<S> for DropsLibraryUrls {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.is_event() && !is_own(meta.target()) {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }

    fn event_enabled(&self, event: &Event<'_>, _cx: &Context<'_, S>) -> bool {
        if is_own(event.metadata().target()) {
            return true;
        }
        let mut finder = NamesUrl(false);
        event.record(&mut finder);
        !finder.0
    }
}

/// Set once a field names a URL.
struct NamesUrl(bool);

impl NamesUrl {
    fn judge(&mut self, shown: &str) {
        self.0 |= URL_MARKS.iter().any(|mark| shown.contains(mark));
    }
}

impl Visit for NamesUrl {
    fn record_str(&mut self, _field: &Field, value: &str) {
        self.judge(&CappedValue::str(value));
    }

    fn record_error(&mut self, _field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.judge(&CappedValue::display(value));
    }

    fn record_debug(&mut self, _field: &Field, value: &dyn std::fmt::Debug) {
        if !self.0 {
            self.judge(&CappedValue::debug(value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_targets_are_the_crates_and_their_modules_only() {
        for own in [
            "abada_agent_worker",
            "abada_agent_worker::tools::session",
            "abada_devkit::tools",
        ] {
            assert!(is_own(own), "{own}");
        }
        for library in [
            "rmcp::transport::worker",
            "abada_agent_workerx",
            "reqwest",
            "log",
        ] {
            assert!(!is_own(library), "{library}");
        }
    }
}
