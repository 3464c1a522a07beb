//! The provider-neutral conversation model: what an agent and a model say to each other.
//!
//! Every provider adapter translates to and from these types, and the journal (protocol.md B.2)
//! stores them, so a conversation started on one provider can resume on another. Tool calls are
//! named by MCP server and tool, never by the name an adapter showed the model.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One tool call a model asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    /// The provider's id for the call, echoed back with its result.
    pub call_id: String,
    /// The MCP server the tool lives on (empty when the model named a tool nobody offered).
    pub server: String,
    /// The MCP tool name on that server (the raw name the model used when unknown).
    pub tool: String,
    /// The arguments. An object when the model sent valid JSON; otherwise the raw text as a
    /// string, which the agent answers with an error result instead of calling the tool.
    pub arguments: Value,
}

/// What a model answered: text, tool calls, or both.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssistantMessage {
    pub text: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
}

/// The result of one tool call, as MCP returned it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolResult {
    /// MCP content blocks, kept as the server sent them.
    #[serde(default)]
    pub content: Vec<Value>,
    #[serde(default)]
    pub structured_content: Option<Value>,
    #[serde(default)]
    pub is_error: bool,
}

impl ToolResult {
    /// An error result written by the worker itself (bad arguments, unknown tool, ...).
    pub fn error_text(message: impl Into<String>) -> Self {
        ToolResult {
            content: vec![serde_json::json!({"type": "text", "text": message.into()})],
            structured_content: None,
            is_error: true,
        }
    }

    /// The result as text for a model: text blocks joined; other blocks and structured
    /// content as JSON.
    pub fn to_model_text(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        for block in &self.content {
            match (block.get("type").and_then(Value::as_str), block.get("text")) {
                (Some("text"), Some(Value::String(t))) => parts.push(t.clone()),
                _ => parts.push(block.to_string()),
            }
        }
        if parts.is_empty()
            && let Some(s) = &self.structured_content
        {
            parts.push(s.to_string());
        }
        parts.join("\n")
    }
}

/// One message of the conversation after the system instructions.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    User { text: String },
    Assistant(AssistantMessage),
    ToolResult { call: ToolCall, result: ToolResult },
}

/// Tokens a model call consumed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// Saturates: a provider (or a journal) reporting absurd counts cannot wrap the budget.
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// Saturates, like [`Usage::total`].
impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
    }
}

/// A tool the model may call, built from an MCP tool listing.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub server: String,
    pub tool: String,
    pub description: String,
    /// JSON Schema of the arguments (an object schema).
    pub input_schema: Value,
    /// True only when the server annotated the tool `readOnlyHint: true`.
    pub read_only: bool,
    /// True only when the server annotated the tool `destructiveHint: true`. MCP's default for a
    /// tool that is not read-only is "may be destructive"; only an explicit `true` is kept, and
    /// it counts as a write for approval even beside `readOnlyHint: true`.
    pub destructive: bool,
}

impl ToolSpec {
    /// Whether a call of this tool may change something: not annotated read-only, or annotated
    /// destructive (the stricter hint wins). Such a call is a keyed, journaled write, and what
    /// the `"writes"` approval policy asks about.
    pub(crate) fn is_write(&self) -> bool {
        !self.read_only || self.destructive
    }
}
