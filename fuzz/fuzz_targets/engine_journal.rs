//! A journal read answer, then the replay of its steps; also raw step arrays replayed directly.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::engine_journal(data));
