//! A non-success engine answer: status from the first two bytes, a `Retry-After` header from the
//! next length-prefixed bytes, the rest is the body. Classified, never a panic.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;
use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let status = 400 + u16::from_be_bytes([data[0], data[1]]) % 200;
    let n = (data[2] as usize).min(data.len() - 3);
    let (header, body) = data[3..].split_at(n);
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(header) {
        headers.insert(RETRY_AFTER, value);
    }
    for op in ["complete", "fetch-and-lock", "heartbeat"] {
        if let Some(error) = decoders::engine_error(op, status, headers.clone(), body) {
            let _ = error.to_string();
            let _ = error.lease_lost();
            let _ = error.is_retryable();
        }
    }
});
