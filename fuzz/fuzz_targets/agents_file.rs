//! The text of a local agents file (TOML).
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = decoders::agents_file(text);
    }
});
