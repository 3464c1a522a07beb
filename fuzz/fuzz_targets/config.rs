//! The worker's configuration from environment variables: each input line `NAME=value`, with
//! short names expanded to `ABADA_AGENT_<NAME>` so the fuzzer reaches every variable.
#![no_main]

use std::collections::HashMap;

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut vars = HashMap::new();
    vars.insert(
        "ABADA_AGENT_ENGINE_URL".to_string(),
        "http://127.0.0.1:5601/api".to_string(),
    );
    for line in text.lines() {
        if let Some((name, value)) = line.split_once('=') {
            let name = if name.starts_with("ABADA_AGENT_") {
                name.to_string()
            } else {
                format!("ABADA_AGENT_{name}")
            };
            vars.insert(name, value.to_string());
        }
    }
    let _ = decoders::config(&vars);
});
