//! The estimate of a model call's tokens from its bytes, before (or without) the provider's own
//! count: a request's input ([`estimate_request_tokens`]) and an answer's output
//! ([`estimate_answer_tokens`]). The task's token budget (`agent::limits`) checks the request
//! about to go out against it and counts an answer whose provider reported no usage; the retry
//! loop (`fallback`) charges a stated tokens budget with it when the call goes out; the context
//! window (`agent::window`) counts the same bytes ([`message_bytes`], [`tool_bytes`]) at its own,
//! higher rate.

use crate::conversation::{AssistantMessage, Message, ToolSpec};

use super::ModelRequest;

/// Bytes per token of the request estimate: the usual rule of thumb for English text and JSON
/// with BPE tokenizers (OpenAI, Anthropic); an estimate, never a count.
pub(crate) const BYTES_PER_TOKEN: u64 = 4;
/// Tokens every message costs besides its text (role, separators), as the providers document.
const TOKENS_PER_MESSAGE: u64 = 4;

fn tokens_of_bytes(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

/// An estimate of the input tokens of `req`: its text and JSON bytes over [`BYTES_PER_TOKEN`],
/// plus a few tokens per message. Meant to stop a request that cannot fit the budget before it
/// is sent, not to bill.
pub(crate) fn estimate_request_tokens(req: &ModelRequest) -> u64 {
    let mut bytes = req.system.len();
    let mut messages: u64 = 1;
    for m in &req.messages {
        messages += 1;
        bytes = bytes.saturating_add(message_bytes(m));
    }
    for t in &req.tools {
        bytes = bytes.saturating_add(tool_bytes(t));
    }
    // The output schema travels as `response_format`, in the system prompt, or both.
    if let Some(o) = &req.output {
        bytes = bytes
            .saturating_add(o.instruction.len())
            .saturating_add(o.schema.to_string().len());
    }
    tokens_of_bytes(bytes).saturating_add(messages.saturating_mul(TOKENS_PER_MESSAGE))
}

/// The bytes of one message a model reads: its text, a call's id, tool and arguments, a
/// result's text. Shared by the budget's estimate and the context window's.
pub(crate) fn message_bytes(m: &Message) -> usize {
    match m {
        Message::User { text } => text.len(),
        Message::Assistant(a) => assistant_bytes(a),
        Message::ToolResult { call, result } => call
            .call_id
            .len()
            .saturating_add(result.to_model_text().len()),
    }
}

/// The bytes of one tool offered to the model: its names, description and argument schema.
pub(crate) fn tool_bytes(t: &ToolSpec) -> usize {
    (t.server.len() + t.tool.len() + t.description.len())
        .saturating_add(t.input_schema.to_string().len())
}

/// An estimate of the output tokens of an answer (when the provider reported none).
pub(crate) fn estimate_answer_tokens(answer: &AssistantMessage) -> u64 {
    tokens_of_bytes(assistant_bytes(answer)).max(1)
}

fn assistant_bytes(a: &AssistantMessage) -> usize {
    a.text.as_ref().map_or(0, String::len).saturating_add(
        a.tool_calls
            .iter()
            .map(|c| c.tool.len() + c.call_id.len() + c.arguments.to_string().len())
            .fold(0usize, usize::saturating_add),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_estimate_grows_with_the_conversation() {
        let mut req = ModelRequest {
            system: "x".repeat(400),
            ..Default::default()
        };
        let small = estimate_request_tokens(&req);
        assert!(small >= 100, "{small}");
        req.messages.push(Message::User {
            text: "y".repeat(4000),
        });
        assert!(estimate_request_tokens(&req) >= small + 1000);
        let before = estimate_request_tokens(&req);
        req.output = Some(crate::provider::OutputFormat {
            name: "a".into(),
            schema: serde_json::json!({"description": "z".repeat(4000)}),
            strict: false,
            instruction: "w".repeat(4000),
        });
        assert!(estimate_request_tokens(&req) >= before + 2000);
        assert_eq!(estimate_answer_tokens(&AssistantMessage::default()), 1);
    }
}
