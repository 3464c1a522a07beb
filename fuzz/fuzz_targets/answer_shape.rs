//! A model's final answer examined for a tool call written as text (bare, fenced, tagged, among
//! other text, or unreadable), under `repair` or `parse` (the first byte chooses): the scan is
//! bounded, and nothing but an offered tool's call comes of it.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::answer_shape(data));
