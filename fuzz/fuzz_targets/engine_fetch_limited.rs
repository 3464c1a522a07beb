//! A fetch-and-lock response read task by task under a per-task limit from the first two bytes:
//! never a panic; a task taken is never far over the limit.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::engine_fetch_limited(data));
