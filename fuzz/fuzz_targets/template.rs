//! Templates rendered the two ways the worker renders them: the input (values as they
//! are) and instructions with `renderInstructions` (values fenced as data), under a cap. The
//! first bytes choose the cap; the rest is `template\0variables-as-JSON`.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::template(data));
