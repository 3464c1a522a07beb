//! Every field of a log line is capped at [`MAX_FIELD_BYTES`], in both log formats: a value
//! longer than that is cut at a character boundary and says so (`…[cut: N bytes]`, `N` being the
//! value's whole length). A peer that controls a logged value (a tool server's `instructions`, a
//! model's error text, an engine's answer) therefore cannot write a line longer than a few
//! kilobytes per field, whatever it sends.
//!
//! [`CappedValue`] is the bounded buffer a value is formatted into (the JSON layer's visitor
//! uses it); [`CappedFields`] is the field formatter of the `pretty` format.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

/// The most bytes of one field's value a log line carries.
pub(crate) const MAX_FIELD_BYTES: usize = 8 * 1024;

/// A value formatted into at most [`MAX_FIELD_BYTES`] bytes: what does not fit is counted, not
/// kept, so formatting a huge value costs its time but never its size in memory.
#[derive(Default)]
pub(crate) struct CappedValue {
    kept: String,
    total: usize,
    /// Set once anything was left out: later, smaller pieces are left out too, so the value
    /// kept is always a prefix.
    full: bool,
}

impl fmt::Write for CappedValue {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.total = self.total.saturating_add(s.len());
        if self.full {
            return Ok(());
        }
        let room = MAX_FIELD_BYTES - self.kept.len();
        if s.len() <= room {
            self.kept.push_str(s);
        } else {
            let mut end = room;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.kept.push_str(&s[..end]);
            self.full = true;
        }
        Ok(())
    }
}

impl CappedValue {
    /// `value`'s `Debug` text, capped.
    pub(crate) fn debug(value: &dyn fmt::Debug) -> String {
        let mut out = CappedValue::default();
        let _ = write!(out, "{value:?}");
        out.finish()
    }

    /// `value`'s `Display` text, capped.
    pub(crate) fn display(value: &dyn fmt::Display) -> String {
        let mut out = CappedValue::default();
        let _ = write!(out, "{value}");
        out.finish()
    }

    /// `value`, capped.
    pub(crate) fn str(value: &str) -> String {
        let mut out = CappedValue::default();
        let _ = out.write_str(value);
        out.finish()
    }

    /// The text kept, and the cut said when there was one.
    pub(crate) fn finish(self) -> String {
        let mut kept = self.kept;
        if self.full {
            let _ = write!(kept, "…[cut: {} bytes]", self.total);
        }
        kept
    }
}

/// The `pretty` format's field formatter: `message` first as it is, then `name=value` pairs
/// separated by spaces (strings quoted), as tracing-subscriber's default, each value capped.
pub(crate) struct CappedFields;

impl<'writer> FormatFields<'writer> for CappedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = PrettyVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PrettyVisitor<'writer> {
    writer: Writer<'writer>,
    first: bool,
    result: fmt::Result,
}

impl PrettyVisitor<'_> {
    fn write(&mut self, field: &Field, value: &str) {
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let separator = if self.first { "" } else { " " };
        self.first = false;
        self.result = if field.name() == "message" {
            write!(self.writer, "{separator}{value}")
        } else {
            write!(self.writer, "{separator}{}={value}", field.name())
        };
    }
}

impl Visit for PrettyVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(field, &CappedValue::str(value));
        } else {
            // Quoted as the default formatter quotes strings; the cut is said after the quote.
            let mut capped = CappedValue::default();
            let _ = capped.write_str(value);
            let cut = capped.full;
            let total = capped.total;
            let mut text = format!("{:?}", capped.kept);
            if cut {
                let _ = write!(text, "…[cut: {total} bytes]");
            }
            self.write(field, &text);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.write(field, &CappedValue::display(value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, &CappedValue::debug(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_value_is_kept_whole_and_a_long_one_cut_at_a_character_boundary() {
        assert_eq!(CappedValue::str("short"), "short");
        let exact = "a".repeat(MAX_FIELD_BYTES);
        assert_eq!(CappedValue::str(&exact), exact);
        // A 2-byte character straddles the cap: it is left out whole.
        let long = format!("{}é{}", "a".repeat(MAX_FIELD_BYTES - 1), "b".repeat(10));
        let cut = CappedValue::str(&long);
        assert_eq!(
            cut,
            format!(
                "{}…[cut: {} bytes]",
                "a".repeat(MAX_FIELD_BYTES - 1),
                long.len()
            )
        );
    }

    #[test]
    fn a_value_written_in_pieces_keeps_a_prefix_only() {
        let mut v = CappedValue::default();
        v.write_str(&"x".repeat(MAX_FIELD_BYTES - 1)).unwrap();
        v.write_str("éé").unwrap();
        v.write_str("y").unwrap();
        let text = v.finish();
        assert_eq!(
            text,
            format!(
                "{}…[cut: {} bytes]",
                "x".repeat(MAX_FIELD_BYTES - 1),
                MAX_FIELD_BYTES - 1 + 5
            ),
            "a later piece slipped in after the cut"
        );
    }
}
