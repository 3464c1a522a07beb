//! A model provider's response body, in both wire formats, with two tools offered.
#![no_main]

use abada_agent_worker::conversation::ToolSpec;
use abada_agent_worker::decoders;
use libfuzzer_sys::fuzz_target;

fn tools() -> Vec<ToolSpec> {
    ["lookup_order", "issue_refund"]
        .into_iter()
        .map(|tool| ToolSpec {
            server: "orders".into(),
            tool: tool.into(),
            description: String::new(),
            input_schema: serde_json::json!({"type": "object"}),
            read_only: tool == "lookup_order",
            destructive: false,
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let tools = tools();
    let _ = decoders::openai_response(data, &tools);
    let _ = decoders::anthropic_response(data, &tools);
});
