//! Templates rendered the two ways the worker renders them (issue 17): the input (values as they
//! are) and instructions with `renderInstructions` (values fenced as data), under a cap. The
//! first bytes choose the cap; the rest is `template\0variables-as-JSON`.
#![no_main]

use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cap, rest)) = data.split_first() else {
        return;
    };
    let cap = usize::from(cap) * 64;
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let (template, vars) = text.split_once('\0').unwrap_or((text, "{}"));
    let variables = serde_json::from_str::<serde_json::Value>(vars)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    let _ = decoders::render_template(template, &variables);
    if let Ok(out) = decoders::render_fenced(template, &variables, cap) {
        assert!(out.len() <= cap, "a fenced template over its cap");
    }
});
