//! The spans a task exports, named and attributed by the OpenTelemetry GenAI semantic
//! conventions (v1.41.0): `invoke_agent {agent}` per attempt under the engine's `traceParent`,
//! `chat {model}` per model call, `execute_tool {tool}` per tool call, and a client span per
//! engine call about the task. Every constructor and recorder of those spans is here, so the
//! code that does the work only says what happened.
//!
//! The spans have the target [`SPAN_TARGET`]: only they reach the exporter, and the log layers
//! leave them out (their fields, message content among them, never land in a log line). With
//! export off no layer wants them, so they cost a disabled span each.
//!
//! Message content (prompts, answers, tool arguments and results) is recorded only when
//! [`super::otel::capture_content`] says so. Nothing here ever records a key, a token or a
//! header: the values recorded are names, counts, classifications and, on opt-in, the
//! conversation itself.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use serde_json::{Value as JsonValue, json};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::conversation::{AssistantMessage, Message, Usage};
use crate::telemetry::trace::TraceParent;

/// The `tracing` target of every exported span.
pub(crate) const SPAN_TARGET: &str = "abada_agent_worker::otel";

/// The OpenTelemetry context of a W3C traceparent received from elsewhere (the engine, a
/// journal step): a remote span context.
fn remote_context(tp: &TraceParent) -> Option<SpanContext> {
    let trace_id = TraceId::from_hex(tp.trace_id()).ok()?;
    let span_id = SpanId::from_hex(tp.span_id()).ok()?;
    let flags = u8::from_str_radix(tp.flags(), 16).ok()?;
    let cx = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    cx.is_valid().then_some(cx)
}

/// Makes `span` a child of the engine's span. Must run before the span is first entered; does
/// nothing when export is off.
fn set_remote_parent(span: &Span, tp: Option<&TraceParent>) {
    if let Some(cx) = tp.and_then(remote_context) {
        // Err only when export is off (no layer) or the span already started: nothing to do.
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(cx));
    }
}

/// The traceparent of `span` for an outgoing request, so the peer's spans hang under it;
/// `None` when the span is not exported (then callers send the task's own context on).
pub(crate) fn traceparent_of(span: &Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// True when the current task has an exported span open here (so a new span is its child).
fn inside_exported_span() -> bool {
    opentelemetry::Context::current()
        .span()
        .span_context()
        .is_valid()
}

/// An integer attribute as the GenAI conventions type it (OTLP `intValue`): recorded as an
/// `i64`, since tracing-opentelemetry 0.34 has no `record_u64` and exports every unsigned
/// integer through `Debug`, as a string (backends that sum tokens ignore strings). Saturates
/// at `i64::MAX`.
fn int<T: TryInto<i64>>(n: T) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// Records `error.type` and the ERROR status.
fn set_error(span: &Span, error_type: &str) {
    span.record("error.type", error_type);
    span.record("otel.status_code", "ERROR");
}

/// What the attempt span is about.
pub struct AgentSpan<'a> {
    pub agent: &'a str,
    /// The first model of the definition: provider (as the conventions name it) and model.
    pub provider: Option<&'a str>,
    pub model: Option<&'a str>,
    pub task_id: &'a str,
    pub process_instance_id: Option<&'a str>,
    pub attempt: Option<u32>,
    /// The engine's context for the task: the span's parent.
    pub parent: Option<&'a TraceParent>,
}

/// `invoke_agent {agent}`: one attempt of an agent run (INTERNAL, the agent runs in-process).
pub fn invoke_agent(a: &AgentSpan<'_>) -> Span {
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "invoke_agent",
        otel.name = %format_args!("invoke_agent {}", a.agent),
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = a.agent,
        gen_ai.provider.name = a.provider,
        gen_ai.request.model = a.model,
        gen_ai.conversation.id = a.task_id,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
        abada.task.id = a.task_id,
        abada.process_instance.id = a.process_instance_id,
        abada.attempt = a.attempt.map(int),
        abada.task.end = Empty,
        abada.resumed_steps = Empty,
    );
    set_remote_parent(&span, a.parent);
    span
}

/// A definition that could not be resolved still gets its attempt span, without an agent name.
pub(crate) fn invoke_unknown_agent(task_id: &str, parent: Option<&TraceParent>) -> Span {
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "invoke_agent",
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.conversation.id = task_id,
        error.type = Empty,
        abada.task.id = task_id,
        abada.task.end = Empty,
    );
    set_remote_parent(&span, parent);
    span
}

/// Links the attempt span to the attempt it resumes (whose context a journal step recorded).
pub(crate) fn link_resumed_attempt(span: &Span, previous: &TraceParent) {
    if let Some(cx) = remote_context(previous) {
        span.add_link_with_attributes(
            cx,
            vec![KeyValue::new("abada.link.reason", "resumed_attempt")],
        );
    }
}

/// How the attempt ended: the task end (`completed`, `deferred`, `incident`, ...), the tokens
/// this attempt used (not those of the attempts it resumes), the journal steps it resumed from,
/// and the error class when it failed.
pub(crate) fn record_attempt_end(
    span: &Span,
    end: &str,
    error_type: Option<&str>,
    input_tokens: u64,
    output_tokens: u64,
    resumed_steps: u64,
) {
    span.record("abada.task.end", end);
    span.record("gen_ai.usage.input_tokens", int(input_tokens));
    span.record("gen_ai.usage.output_tokens", int(output_tokens));
    if resumed_steps > 0 {
        span.record("abada.resumed_steps", int(resumed_steps));
    }
    if let Some(t) = error_type {
        set_error(span, t);
    }
}

/// What a model call is.
pub struct ChatSpan<'a> {
    /// `gen_ai.provider.name`: `openai`, `anthropic`, or the configured name of another.
    pub provider: &'a str,
    /// The configured provider name (`ABADA_AGENT_PROVIDERS`), when it differs.
    pub(crate) configured_provider: &'a str,
    pub model: &'a str,
    /// 0 for the agent's model, 1.. for its `fallbackModels`.
    pub(crate) fallback_index: usize,
    /// 0 for the first call to this model, 1.. for its retries.
    pub retry: u32,
    pub max_tokens: Option<u32>,
}

/// `chat {model}`: one model call (CLIENT).
pub fn chat(c: &ChatSpan<'_>) -> Span {
    tracing::info_span!(
        target: SPAN_TARGET,
        "chat",
        otel.name = %format_args!("chat {}", c.model),
        otel.kind = "client",
        otel.status_code = Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = c.provider,
        gen_ai.request.model = c.model,
        gen_ai.request.max_tokens = c.max_tokens.map(int),
        gen_ai.response.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.usage.cache_read.input_tokens = Empty,
        gen_ai.usage.cache_creation.input_tokens = Empty,
        gen_ai.input.messages = Empty,
        gen_ai.system_instructions = Empty,
        gen_ai.output.messages = Empty,
        error.type = Empty,
        abada.provider = c.configured_provider,
        abada.fallback.index = int(c.fallback_index),
        abada.fallback = c.fallback_index > 0,
        abada.retry = int(c.retry),
    )
}

/// Records the request's content on the chat span (only with content capture on), in the
/// conventions' message shape (`role` and `parts`).
pub(crate) fn record_chat_request(span: &Span, system: &str, messages: &[Message]) {
    if !super::otel::capture_content() || span.is_disabled() {
        return;
    }
    let system = json!([{"type": "text", "content": system}]);
    span.record("gen_ai.system_instructions", system.to_string().as_str());
    let messages: Vec<JsonValue> = messages.iter().map(semconv_message).collect();
    span.record(
        "gen_ai.input.messages",
        JsonValue::Array(messages).to_string().as_str(),
    );
}

/// One message as the conventions' JSON schema for `gen_ai.input.messages` has it.
fn semconv_message(m: &Message) -> JsonValue {
    match m {
        Message::User { text } => json!({
            "role": "user",
            "parts": [{"type": "text", "content": text}],
        }),
        Message::Assistant(a) => json!({"role": "assistant", "parts": assistant_parts(a)}),
        Message::ToolResult { call, result } => json!({
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": call.call_id, "response": result}],
        }),
    }
}

fn assistant_parts(a: &AssistantMessage) -> Vec<JsonValue> {
    let mut parts: Vec<JsonValue> = a
        .text
        .iter()
        .map(|t| json!({"type": "text", "content": t}))
        .collect();
    parts.extend(a.tool_calls.iter().map(
        |c| json!({"type": "tool_call", "id": c.call_id, "name": c.tool, "arguments": c.arguments}),
    ));
    parts
}

/// What a model answered, for its chat span.
pub(crate) struct ChatAnswer<'a> {
    pub response_model: Option<&'a str>,
    /// What the provider reported; none when it sent no usage (nothing is recorded then, the
    /// worker's own estimate is no provider figure).
    pub usage: Option<Usage>,
    pub cache_read_tokens: Option<u64>,
    pub cache_creation_tokens: Option<u64>,
    pub finish_reason: &'a str,
}

/// Records a successful answer; `output` is the answer's content, recorded only with content
/// capture on.
pub(crate) fn record_chat_answer(span: &Span, a: &ChatAnswer<'_>, output: &AssistantMessage) {
    if span.is_disabled() {
        return;
    }
    if let Some(m) = a.response_model {
        span.record("gen_ai.response.model", m);
    }
    if let Some(u) = a.usage {
        span.record("gen_ai.usage.input_tokens", int(u.input_tokens));
        span.record("gen_ai.usage.output_tokens", int(u.output_tokens));
    }
    if let Some(n) = a.cache_read_tokens {
        span.record("gen_ai.usage.cache_read.input_tokens", int(n));
    }
    if let Some(n) = a.cache_creation_tokens {
        span.record("gen_ai.usage.cache_creation.input_tokens", int(n));
    }
    if !a.finish_reason.is_empty() {
        span.set_attribute(
            "gen_ai.response.finish_reasons",
            Value::Array(Array::String(vec![StringValue::from(
                a.finish_reason.to_string(),
            )])),
        );
    }
    if super::otel::capture_content() {
        let output = json!([{
            "role": "assistant",
            "parts": assistant_parts(output),
            "finish_reason": a.finish_reason,
        }]);
        span.record("gen_ai.output.messages", output.to_string().as_str());
    }
}

/// Records a failed model call: its class (`unavailable`, `transient`, `rejected`, ...).
pub(crate) fn record_chat_error(span: &Span, error_type: &str) {
    set_error(span, error_type);
}

/// What a tool call is.
pub struct ToolSpan<'a> {
    pub server: &'a str,
    pub tool: &'a str,
    pub call_id: &'a str,
}

/// `execute_tool {tool}`: one tool call the model asked for, its retries and journal writes
/// included (INTERNAL).
pub fn execute_tool(t: &ToolSpan<'_>) -> Span {
    tracing::info_span!(
        target: SPAN_TARGET,
        "execute_tool",
        otel.name = %format_args!("execute_tool {}", t.tool),
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = t.tool,
        gen_ai.tool.call.id = t.call_id,
        gen_ai.tool.type = "extension",
        gen_ai.tool.call.arguments = Empty,
        gen_ai.tool.call.result = Empty,
        mcp.method.name = "tools/call",
        error.type = Empty,
        abada.tool.server = t.server,
        abada.idempotency_key = Empty,
        abada.idempotency_key.kind = Empty,
        abada.tool.outcome = Empty,
        abada.tool.tries = Empty,
    )
}

/// Records what is sent: the keyed write's idempotency key (none for a read-only call), and
/// the arguments (only with content capture on).
///
/// A key derived from the call's content (`abada:{taskId}:h:{hash}:{n}`, when no journal
/// exists) is not exported, only its kind (`abada.idempotency_key.kind` = `content`): its hash
/// is a SHA-256 of the arguments, and small arguments (an amount, an order id) are recovered
/// from it by guessing, content capture off or not. An HMAC under a worker secret would only
/// correlate spans of one worker, which their trace already does, and could no longer be
/// matched against the tool server's logs either. A journal key (`abada:{taskId}:{seq}`)
/// names a step, nothing of the content: it is exported (`journal`).
pub(crate) fn record_tool_call(span: &Span, key: Option<&str>, arguments: &impl serde::Serialize) {
    if span.is_disabled() {
        return;
    }
    if let Some(k) = key {
        if is_content_key(k) {
            span.record("abada.idempotency_key.kind", "content");
        } else {
            span.record("abada.idempotency_key", k);
            span.record("abada.idempotency_key.kind", "journal");
        }
    }
    if super::otel::capture_content()
        && let Ok(text) = serde_json::to_string(arguments)
    {
        span.record("gen_ai.tool.call.arguments", text.as_str());
    }
}

/// Whether `key` has the shape of a content-derived key: `…:h:{32 hex digits}:{n}`. A journal
/// key ends in `:{seq}` right after the task id, so it has this shape only for a task id that
/// itself ends in `:h:{32 hex digits}`, and is then left off the span too: the safe side.
pub(crate) fn is_content_key(key: &str) -> bool {
    let mut parts = key.rsplit(':');
    let (Some(n), Some(hash), Some(h)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    h == "h"
        && hash.len() == 32
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
}

/// Records how many tries the call took.
pub(crate) fn record_tool_tries(span: &Span, tries: u32) {
    span.record("abada.tool.tries", int(tries));
}

/// Records a tool call's outcome as it is counted: `ok`, or the class of failure (a failed try
/// followed by a good one ends as `ok`).
pub(crate) fn record_tool_outcome(span: &Span, outcome: &str) {
    span.record("abada.tool.outcome", outcome);
}

/// Ends a tool call's span: `error.type` and the ERROR status when its last outcome was a
/// failure, or when the attempt ended during the call (`attempt_ended`: lease lost, shutdown,
/// a journal write that failed).
pub(crate) fn record_tool_end(span: &Span, last_outcome: Option<&str>, attempt_ended: bool) {
    match last_outcome {
        Some(o) if o != "ok" => set_error(span, o),
        _ if attempt_ended => set_error(span, "attempt_ended"),
        _ => {}
    }
}

/// Records the result (only with content capture on).
pub(crate) fn record_tool_result(span: &Span, result: &impl serde::Serialize) {
    if super::otel::capture_content()
        && !span.is_disabled()
        && let Ok(text) = serde_json::to_string(result)
    {
        span.record("gen_ai.tool.call.result", text.as_str());
    }
}

/// A call to one of the worker's peers about a task (CLIENT): `engine {operation}` today; the
/// run store's calls (`store {operation}`) use the same span when the store lands. Under the
/// attempt span when one is open here (journal, credentials), else directly under the engine's
/// span (the report of the outcome, made by the runner after the attempt ended).
pub(crate) fn client_call(
    peer: &'static str,
    operation: &'static str,
    server: &str,
    task_parent: Option<&TraceParent>,
) -> Span {
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "client_call",
        otel.name = %format_args!("{peer} {operation}"),
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = "POST",
        server.address = server,
        http.response.status_code = Empty,
        error.type = Empty,
        abada.peer = peer,
        abada.operation = operation,
    );
    if !inside_exported_span() {
        set_remote_parent(&span, task_parent);
    }
    span
}

/// Records the peer's answer: its HTTP status, an error class for a failure (`timeout`,
/// `error`, or the status).
pub(crate) fn record_client_answer(span: &Span, status: Option<u16>, error_type: Option<&str>) {
    if let Some(s) = status {
        span.record("http.response.status_code", int(s));
    }
    if let Some(t) = error_type {
        set_error(span, t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsigned_integers_become_i64_and_saturate() {
        assert_eq!(int(7u16), 7i64);
        assert_eq!(int(u32::MAX), i64::from(u32::MAX));
        assert_eq!(int(u64::MAX), i64::MAX);
        assert_eq!(int(3usize), 3);
    }
}
