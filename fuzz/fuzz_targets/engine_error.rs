//! A non-success engine answer: status from the first two bytes, a `Retry-After` header from the
//! next length-prefixed bytes, the rest is the body. Classified, never a panic.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::engine_error(data));
