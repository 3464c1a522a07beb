//! An agent definition as an engine sends it on a task, and its input template rendered with
//! the definition's own JSON as the process variables.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        if let Ok(text) = std::str::from_utf8(data) {
            let _ = decoders::render_template(text, &serde_json::Map::new());
        }
        return;
    };
    let _ = decoders::agent_definition(&value);
    if let Some(object) = value.as_object() {
        for template in object.values().filter_map(|v| v.as_str()) {
            let _ = decoders::render_template(template, object);
        }
    }
});
