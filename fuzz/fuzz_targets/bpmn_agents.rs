//! BPMN XML as the engine serves it: any text, through the depth scan, the XML parser
//! (no DTD, node limit) and the `abada.agent.*` property mapping into the one definition parser.
//! None may panic or overflow the stack.
//! The property lives in `fuzz/props.rs`, shared with the replay under `cargo test`.
#![no_main]

#[path = "../props.rs"]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::bpmn_agents(data));
