//! The worker's configuration from environment variables: each input line `NAME=value`, with
//! short names expanded to `ABADA_AGENT_<NAME>` so the fuzzer reaches every variable.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::config(data));
