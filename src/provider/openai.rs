//! The OpenAI-compatible Chat Completions adapter (`POST {base}/chat/completions`, bearer key):
//! OpenAI, Azure-style gateways, vLLM, Ollama, llama.cpp, LiteLLM.
//!
//! The output cap goes out as `max_completion_tokens` (OpenAI's current name; reasoning models
//! refuse the older `max_tokens`). Some compatible servers leave `usage` out: the response then
//! carries none, and the agent counts an estimate against the budget.

use async_trait::async_trait;
use reqwest::header::{AUTHORIZATION, HeaderMap};
use serde::Deserialize;
use serde_json::{Value, json};

use super::http::HttpCore;
use super::tool_names::ToolNames;
use super::{
    ModelProvider, ModelRequest, ModelResponse, ProviderError, ProviderSettings, StructuredOutput,
};
use crate::conversation::{AssistantMessage, Message, Usage};

/// A provider speaking Chat Completions.
pub(crate) struct OpenAiProvider {
    core: HttpCore,
}

impl OpenAiProvider {
    pub fn new(settings: ProviderSettings, http: reqwest::Client) -> Self {
        OpenAiProvider {
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

/// The request body for `req`, with tools named by `names`, the output schema asked as
/// `structured` says.
pub(crate) fn request_body(
    req: &ModelRequest,
    names: &ToolNames,
    structured: StructuredOutput,
) -> Value {
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    let native = structured == StructuredOutput::Native;
    // Structured output (`agent::output`): a strict schema is enforced by the provider; any
    // other is sent too, and also asked for in the system prompt. `instructed`: asked for in the
    // system prompt only (a server that makes `response_format` a grammar of the whole answer
    // leaves no way to call a tool).
    let system = match &req.output {
        Some(o) if o.strict && native => req.system.clone(),
        _ => req.system_with_output_instruction(),
    };
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    for m in &req.messages {
        match m {
            Message::User { text } => messages.push(json!({"role": "user", "content": text})),
            Message::Assistant(a) => {
                let mut msg = json!({"role": "assistant", "content": a.text});
                if !a.tool_calls.is_empty() {
                    let calls: Vec<Value> = a
                        .tool_calls
                        .iter()
                        .map(|c| {
                            let arguments = match &c.arguments {
                                Value::String(raw) => raw.clone(),
                                other => other.to_string(),
                            };
                            json!({
                                "id": c.call_id,
                                "type": "function",
                                "function": {
                                    "name": names.function_name(&c.server, &c.tool),
                                    "arguments": arguments,
                                },
                            })
                        })
                        .collect();
                    msg["tool_calls"] = Value::Array(calls);
                }
                messages.push(msg);
            }
            Message::ToolResult { call, result } => messages.push(json!({
                "role": "tool",
                "tool_call_id": call.call_id,
                "content": result.to_model_text(),
            })),
        }
    }
    let mut body = json!({"model": req.model, "messages": messages});
    if !req.tools.is_empty() {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": names.function_name(&t.server, &t.tool),
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                })
            })
            .collect();
        body["tools"] = Value::Array(tools);
    }
    if let Some(cap) = req.max_output_tokens {
        body["max_completion_tokens"] = json!(cap);
    }
    if let Some(o) = req.output.as_ref().filter(|_| native) {
        body["response_format"] = json!({
            "type": "json_schema",
            "json_schema": {"name": o.name, "schema": o.schema, "strict": o.strict},
        });
    }
    body
}

#[derive(Deserialize)]
struct WireResponse {
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
}

#[derive(Deserialize)]
struct WireToolCall {
    /// Some compatible servers (Ollama, a few vLLM parsers) leave the id out.
    #[serde(default)]
    id: Option<String>,
    function: WireFunction,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    /// A JSON string per the API; some compatible servers send the object itself.
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<WirePromptDetails>,
}

#[derive(Deserialize)]
struct WirePromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Parses a 2xx body; `Err` carries what is wrong with it.
pub(crate) fn parse_response(body: &[u8], names: &ToolNames) -> Result<ModelResponse, String> {
    let wire: WireResponse = serde_json::from_slice(body)
        .map_err(|e| format!("not a Chat Completions response: {e}"))?;
    let choice = wire
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| "the response has no choices".to_string())?;
    let text = match choice.message.content {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        // Some servers send content parts; keep their text.
        Some(Value::Array(parts)) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        ),
        Some(other) => return Err(format!("unexpected message content {other}")),
    }
    .filter(|t| !t.is_empty());
    let tool_calls = choice
        .message
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            let arguments = match c.function.arguments {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(raw)) if raw.trim().is_empty() => json!({}),
                Some(Value::String(raw)) => {
                    serde_json::from_str(&raw).unwrap_or(Value::String(raw))
                }
                Some(other) => other,
            };
            let id =
                c.id.filter(|id| !id.is_empty())
                    .unwrap_or_else(|| format!("call_{}", uuid::Uuid::new_v4().simple()));
            names.tool_call(id, &c.function.name, arguments)
        })
        .collect();
    let cache_read_tokens = wire
        .usage
        .as_ref()
        .and_then(|u| u.prompt_tokens_details.as_ref())
        .and_then(|d| d.cached_tokens);
    let usage = wire.usage.map(|u| Usage {
        input_tokens: u.prompt_tokens,
        output_tokens: u.completion_tokens,
    });
    Ok(ModelResponse {
        message: AssistantMessage { text, tool_calls },
        usage,
        stop_reason: choice.finish_reason.unwrap_or_default(),
        response_model: wire.model.filter(|m| !m.is_empty()),
        cache_read_tokens,
        cache_creation_tokens: None,
    })
}

#[async_trait]
impl ModelProvider for OpenAiProvider {
    fn semconv_name(&self) -> Option<&'static str> {
        Some("openai")
    }

    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let names = ToolNames::new(&req.tools);
        let body = request_body(req, &names, self.core.settings.structured_output);
        let key = self.core.key(&req.model)?;
        let mut headers = HeaderMap::new();
        if let Some(k) = &key {
            headers.insert(
                AUTHORIZATION,
                self.core.secret_header(&req.model, "Bearer ", k)?,
            );
        }
        let answer = self
            .core
            .post_json(
                "/chat/completions",
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
