//! One `tools/list` entry as offered to the model (description and schema limits), and
//! text cut at a limit from the first byte.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::tool_listing(data));
