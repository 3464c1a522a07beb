//! An MCP tool result as a tool server sent it, then capped to a size from the first two bytes.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::tool_result(data));
