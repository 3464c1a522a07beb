//! Small header decoders: a provider's `Retry-After` / `retry-after-ms` and a W3C `traceparent`.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::headers(data));
