//! Journal steps the run-store tests write: the input step, a final answer, and a model step that
//! asks for the keyed refund write. One definition for every store module, so their steps agree.

use abada_agent_worker::engine::JournalStep;
use serde_json::json;

/// The instructions of every input step here.
pub const INSTRUCTIONS: &str = "You handle refunds.";

/// The run's input step (seq 1).
pub fn input(text: &str) -> JournalStep {
    JournalStep {
        seq: 1,
        kind: "input".into(),
        state: "finished".into(),
        key: None,
        data: json!({"instructions": INSTRUCTIONS, "input": text}),
    }
}

/// A finished model step of `openai/refund` saying `message`, stopped for `stop_reason`.
fn model(seq: u64, message: serde_json::Value, stop_reason: &str) -> JournalStep {
    JournalStep {
        seq,
        kind: "model".into(),
        state: "finished".into(),
        key: None,
        data: json!({
            "model": "openai/refund",
            "message": message,
            "usage": {"inputTokens": 10, "outputTokens": 2},
            "stopReason": stop_reason
        }),
    }
}

/// A final answer (a model step without tool calls).
pub fn answer(seq: u64, text: &str) -> JournalStep {
    model(seq, json!({"text": text, "toolCalls": []}), "stop")
}

/// A model step asking for `orders/issue_refund` (call `call_0`).
pub fn asks_refund(seq: u64) -> JournalStep {
    model(
        seq,
        json!({"text": "I will refund.", "toolCalls": [{
            "callId": "call_0", "server": "orders", "tool": "issue_refund",
            "arguments": {"orderId": "o-1", "amountCents": 4200}
        }]}),
        "tool_calls",
    )
}
