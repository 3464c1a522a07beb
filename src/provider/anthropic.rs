//! The Anthropic Messages adapter (`POST {base}/v1/messages`, `x-api-key`, `anthropic-version`).
//!
//! Tool results travel as `tool_result` blocks in user messages; consecutive user-side content
//! (several results, or results followed by text) is merged into one message so roles
//! alternate. Input tokens include cache reads and writes, which are billed as input.

use async_trait::async_trait;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{Value, json};

use super::http::HttpCore;
use super::tool_names::ToolNames;
use super::{ModelProvider, ModelRequest, ModelResponse, ProviderError, ProviderSettings};
use crate::conversation::{AssistantMessage, Message, Usage};

/// The API version this adapter speaks.
pub(crate) const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` is required by the API; this is sent when the agent sets no cap.
pub(crate) const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A provider speaking Anthropic Messages.
pub(crate) struct AnthropicProvider {
    core: HttpCore,
}

impl AnthropicProvider {
    pub fn new(settings: ProviderSettings, http: reqwest::Client) -> Self {
        AnthropicProvider {
            core: HttpCore::new(settings, http),
        }
    }

    /// The adapter reporting every answer's rate-limit headers to `capacities`.
    pub(crate) fn with_capacities(
        mut self,
        capacities: std::sync::Arc<super::capacity::ModelCapacities>,
    ) -> Self {
        self.core = self.core.with_capacities(capacities);
        self
    }
}

fn push(messages: &mut Vec<Value>, role: &str, blocks: Vec<Value>) {
    if blocks.is_empty() {
        return;
    }
    if let Some(last) = messages.last_mut()
        && last["role"] == role
        && let Some(content) = last["content"].as_array_mut()
    {
        content.extend(blocks);
        return;
    }
    messages.push(json!({"role": role, "content": blocks}));
}

/// The request body for `req`, with tools named by `names`.
pub(crate) fn request_body(req: &ModelRequest, names: &ToolNames) -> Value {
    let mut messages: Vec<Value> = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        match m {
            Message::User { text } => {
                push(
                    &mut messages,
                    "user",
                    vec![json!({"type": "text", "text": text})],
                );
            }
            Message::Assistant(a) => {
                let mut blocks = Vec::new();
                if let Some(text) = a.text.as_deref().filter(|t| !t.is_empty()) {
                    blocks.push(json!({"type": "text", "text": text}));
                }
                for c in &a.tool_calls {
                    // Arguments that were not a JSON object (kept raw from another provider)
                    // cannot be a tool_use input; the error result that followed explains them.
                    let input = if c.arguments.is_object() {
                        c.arguments.clone()
                    } else {
                        json!({})
                    };
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": c.call_id,
                        "name": names.function_name(&c.server, &c.tool),
                        "input": input,
                    }));
                }
                if blocks.is_empty() {
                    blocks.push(json!({"type": "text", "text": "(no answer)"}));
                }
                push(&mut messages, "assistant", blocks);
            }
            Message::ToolResult { call, result } => {
                let mut block = json!({
                    "type": "tool_result",
                    "tool_use_id": call.call_id,
                    "content": result.to_model_text(),
                });
                if result.is_error {
                    block["is_error"] = Value::Bool(true);
                }
                push(&mut messages, "user", vec![block]);
            }
        }
    }
    let mut body = json!({
        "model": req.model,
        "max_tokens": req.max_output_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        "messages": messages,
    });
    // Messages (2023-06-01, no beta) has no structured output: the schema is asked for in the
    // system prompt, and `agent::output` validates the answer.
    let system = req.system_with_output_instruction();
    if !system.is_empty() {
        body["system"] = Value::String(system);
    }
    if !req.tools.is_empty() {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(|t| {
                json!({
                    "name": names.function_name(&t.server, &t.tool),
                    "description": t.description,
                    "input_schema": t.input_schema,
                })
            })
            .collect();
        body["tools"] = Value::Array(tools);
    }
    body
}

#[derive(Deserialize)]
struct WireResponse {
    content: Vec<WireBlock>,
    #[serde(default)]
    stop_reason: Option<String>,
    usage: WireUsage,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct WireUsage {
    input_tokens: u64,
    output_tokens: u64,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

/// Parses a 2xx body; `Err` carries what is wrong with it.
pub(crate) fn parse_response(body: &[u8], names: &ToolNames) -> Result<ModelResponse, String> {
    let wire: WireResponse =
        serde_json::from_slice(body).map_err(|e| format!("not a Messages response: {e}"))?;
    let mut texts: Vec<String> = Vec::new();
    let mut tool_calls = Vec::new();
    for block in wire.content {
        match block {
            WireBlock::Text { text } => texts.push(text),
            WireBlock::ToolUse { id, name, input } => {
                let arguments = if input.is_null() { json!({}) } else { input };
                tool_calls.push(names.tool_call(id, &name, arguments));
            }
            WireBlock::Other => {}
        }
    }
    let text = Some(texts.join("\n")).filter(|t| !t.is_empty());
    let u = wire.usage;
    Ok(ModelResponse {
        message: AssistantMessage { text, tool_calls },
        usage: Some(Usage {
            input_tokens: u
                .input_tokens
                .saturating_add(u.cache_creation_input_tokens.unwrap_or(0))
                .saturating_add(u.cache_read_input_tokens.unwrap_or(0)),
            output_tokens: u.output_tokens,
        }),
        stop_reason: wire.stop_reason.unwrap_or_default(),
        response_model: wire.model.filter(|m| !m.is_empty()),
        cache_read_tokens: u.cache_read_input_tokens,
        cache_creation_tokens: u.cache_creation_input_tokens,
    })
}

#[async_trait]
impl ModelProvider for AnthropicProvider {
    fn semconv_name(&self) -> Option<&'static str> {
        Some("anthropic")
    }

    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let names = ToolNames::new(&req.tools);
        let body = request_body(req, &names);
        let key = self.core.key(&req.model)?;
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
        if let Some(k) = &key {
            headers.insert(
                HeaderName::from_static("x-api-key"),
                self.core.secret_header(&req.model, "", k)?,
            );
        }
        let answer = self
            .core
            .post_json(
                "/v1/messages",
                &req.model,
                headers,
                req.traceparent.as_deref(),
                key.as_ref(),
                &body,
            )
            .await?;
        parse_response(&answer, &names).map_err(|m| self.core.malformed(&req.model, m))
    }
}
