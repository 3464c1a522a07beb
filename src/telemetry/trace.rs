//! W3C trace context: parsing a task's `traceParent` and continuing it on outgoing calls.

use std::fmt;

use crate::random::Random;

/// A parsed `traceparent` (version 00): trace id, parent span id and flags.
#[derive(Clone, PartialEq, Eq)]
pub struct TraceParent {
    trace_id: String,
    span_id: String,
    flags: String,
}

impl TraceParent {
    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`; anything else (or all-zero ids) is `None`.
    pub fn parse(raw: &str) -> Option<Self> {
        let mut parts = raw.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex(version, 2)
            || version == "ff"
            || !hex(trace_id, 32)
            || !hex(span_id, 16)
            || !hex(flags, 2)
        {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if trace_id.bytes().all(|b| b == b'0') || span_id.bytes().all(|b| b == b'0') {
            return None;
        }
        Some(TraceParent {
            trace_id: trace_id.to_ascii_lowercase(),
            span_id: span_id.to_ascii_lowercase(),
            flags: flags.to_ascii_lowercase(),
        })
    }

    /// A new root context (for calls that belong to no task), its ids drawn from `random`.
    pub(crate) fn new_root(random: &Random) -> Self {
        TraceParent {
            trace_id: random_id::<16>(random),
            span_id: random_id::<8>(random),
            flags: "01".into(),
        }
    }

    pub fn trace_id(&self) -> &str {
        &self.trace_id
    }

    /// The parent span id (16 lowercase hex digits).
    pub(crate) fn span_id(&self) -> &str {
        &self.span_id
    }

    /// The trace flags (2 lowercase hex digits; `01` = sampled).
    pub fn flags(&self) -> &str {
        &self.flags
    }

    /// The header value for an outgoing call: same trace, a fresh span id (drawn from
    /// `random`), same flags.
    pub fn child_header(&self, random: &Random) -> String {
        format!(
            "00-{}-{}-{}",
            self.trace_id,
            random_id::<8>(random),
            self.flags
        )
    }

    /// The context exactly as received.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{}", self.trace_id, self.span_id, self.flags)
    }
}

/// `N` random bytes in lowercase hex, never all zero (an invalid id in W3C trace context).
fn random_id<const N: usize>(random: &Random) -> String {
    let id = loop {
        let id = random.bytes::<N>();
        if id != [0; N] {
            break id;
        }
    };
    id.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.header())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_continues_the_trace() {
        let tp =
            TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").unwrap();
        assert_eq!(tp.trace_id(), "0af7651916cd43dd8448eb211c80319c");
        let child = tp.child_header(&Random::os());
        assert!(child.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert!(child.ends_with("-01"));
        assert_ne!(child, tp.header());
        assert!(TraceParent::parse(&child).is_some());
    }

    #[test]
    fn rejects_bad_values() {
        for bad in [
            "",
            "garbage",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
    }
}
