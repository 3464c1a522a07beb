//! Small header decoders: a provider's `Retry-After` / `retry-after-ms` and a W3C `traceparent`.
#![no_main]

use std::time::{Duration, SystemTime};

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

fuzz_target!(|data: &[u8]| {
    let half = data.len() / 2;
    let (a, b) = data.split_at(half);
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(a) {
        headers.insert(reqwest::header::RETRY_AFTER, v);
    }
    if let Ok(v) = HeaderValue::from_bytes(b) {
        headers.insert(HeaderName::from_static("retry-after-ms"), v);
    }
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let _ = decoders::provider_retry_after(&headers, now);
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some(tp) = decoders::trace_parent(text) {
            let _ = tp.header();
            let _ = tp.child_header();
            let _ = tp.trace_id();
        }
    }
});
