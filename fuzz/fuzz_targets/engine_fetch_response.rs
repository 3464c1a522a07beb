//! A fetch-and-lock response body from the engine: any bytes decode or fail, never panic.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::engine_fetch_response(data));
