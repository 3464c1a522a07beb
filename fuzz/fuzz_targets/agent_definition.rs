//! An agent definition as an engine sends it on a task, and its input template rendered with
//! the definition's own JSON as the process variables.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::agent_definition(data));
