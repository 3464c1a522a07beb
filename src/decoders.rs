//! Every decoder of data from outside the process, behind one entry point each, for the property
//! tests (`tests/it/fuzz_props.rs`) and the cargo-fuzz targets (`fuzz/`). The worker itself calls
//! the functions these wrap; nothing here is a second implementation. Each takes raw input and
//! returns a value or an error: none may panic, whatever the input.

use std::time::{Duration, SystemTime};

use serde_json::{Map, Value};

use crate::agent::definition::{self, AgentDefinition, AgentsFile};
use crate::agent::journal::{ReplayError, Replayed};
use crate::config::{Config, ConfigError};
use crate::conversation::{ToolResult, ToolSpec};
use crate::engine::{EngineError, Journal, JournalStep, Task, TraceParent};
use crate::provider::ModelResponse;
use crate::provider::tool_names::ToolNames;

/// A process definition's BPMN XML as the engine serves it: each `camunda:topic` service task
/// with `abada.agent.*` properties, by id, with its definition or the error naming what is wrong.
pub fn bpmn_agents(xml: &str) -> Result<Vec<crate::agent::bpmn::BpmnAgent>, String> {
    crate::agent::bpmn::agents_of_xml("fuzz", Some(1), xml)
}

/// A `GET /v1/processes/{id}` answer (JSON): the definition's id, version and XML size.
pub fn engine_process_definition(body: &[u8]) -> Result<(String, Option<i64>, usize), String> {
    crate::engine::wire::decode_process_definition(body)
        .map(|d| (d.id, d.version, d.bpmn_xml.len()))
}

/// A `GET /v1/processes/instances/{id}` answer (JSON): the definition the instance runs.
pub fn engine_process_instance(body: &[u8]) -> Result<String, String> {
    crate::engine::wire::decode_process_instance(body).map(|i| i.process_definition_id)
}

/// What a history page read to: its entries, its page count, and the approver it names.
type JudgedPage = (usize, Option<u32>, Result<String, String>);

/// A page of `GET /v1/process-instances/{id}/history` (JSON) with its `X-Total-Pages` header,
/// and who the engine says completed a user task in it: the events read, the page count, and
/// the approver judged from the page as a whole history (or why not).
pub fn engine_history_page(body: &[u8], total_pages: Option<&str>) -> Result<JudgedPage, String> {
    let page = crate::engine::wire::decode_history_page(body, total_pages)?;
    let approvers = crate::tools::server_scope::Approvers {
        users: vec!["alice".into()],
    };
    let judged = crate::agent::approver::judge(
        "fuzz",
        &page.events,
        &crate::agent::approver::Witness {
            server: "orders",
            approvers: &approvers,
            asking_task: "t1",
            answering_task: "t2",
            agent_activity: Some("agent"),
            decision_variable: "agentApproval",
        },
    )
    .map_err(|e| e.to_string());
    Ok((page.events.len(), page.total_pages, judged))
}

/// A fetch-and-lock response body: the tasks read, and one problem per element skipped.
pub fn engine_fetch_response(body: &[u8]) -> Result<(Vec<Task>, Vec<String>), String> {
    crate::engine::wire::decode_locked_tasks(body)
}

/// What a limited fetch read: the tasks taken, the problems, the (id, attempt) of a task too large.
type LimitedFetch = (Vec<Task>, Vec<String>, Vec<(String, Option<u32>)>);

/// A fetch-and-lock response read task by task with a per-task byte limit, as the engine
/// client reads it: the tasks taken, the problems, and the (id, attempt) of a task too large.
pub fn engine_fetch_response_limited(
    body: &[u8],
    task_limit: usize,
) -> Result<LimitedFetch, String> {
    let read = crate::engine::wire::decode_locked_tasks_from(&mut &body[..], task_limit)?;
    let oversized = read
        .oversized
        .into_iter()
        .map(|o| (o.id, o.attempt))
        .collect();
    Ok((read.tasks, read.rejected, oversized))
}

/// One tool of a `tools/list` answer (JSON), as offered to the model: `None` when its input
/// schema is over the limit (description cut, schema bounded: `body::TOOL_*`).
pub fn tool_listing_entry(json: &[u8]) -> Result<Option<ToolSpec>, String> {
    crate::tools::decode_tool_spec("fuzz", json)
}

/// Text cut to a byte limit at a character boundary (tool error messages, descriptions).
pub fn truncate_text(text: &str, limit: usize) -> String {
    crate::body::truncate_text(text, limit)
}

/// A non-success engine answer (status, headers, body) as the typed error the worker acts on.
/// Statuses outside 100..=999 are not HTTP and come back as `None`.
pub fn engine_error(
    op: &'static str,
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: &[u8],
) -> Option<EngineError> {
    let status = reqwest::StatusCode::from_u16(status).ok()?;
    Some(crate::engine::client::classify_answer(
        op,
        Some("t-fuzz"),
        status,
        headers,
        body.to_vec(),
    ))
}

/// A journal read answer (`{"attempt", "steps"}`).
pub fn engine_journal(body: &[u8]) -> Result<Journal, String> {
    crate::engine::wire::decode_journal(body)
}

/// A tool credential answer: whether it decoded (the token itself is never returned here).
pub fn engine_tool_credential(body: &[u8]) -> bool {
    crate::engine::wire::decode_tool_credential(body).is_some()
}

/// A W3C `traceparent` header.
pub fn trace_parent(raw: &str) -> Option<TraceParent> {
    TraceParent::parse(raw)
}

/// An OpenAI Chat Completions response body, with `tools` offered to the model.
pub fn openai_response(body: &[u8], tools: &[ToolSpec]) -> Result<ModelResponse, String> {
    crate::provider::openai::parse_response(body, &ToolNames::new(tools))
}

/// An Anthropic Messages response body, with `tools` offered to the model.
pub fn anthropic_response(body: &[u8], tools: &[ToolSpec]) -> Result<ModelResponse, String> {
    crate::provider::anthropic::parse_response(body, &ToolNames::new(tools))
}

/// A provider's `Retry-After` / `retry-after-ms` headers.
pub fn provider_retry_after(
    headers: &reqwest::header::HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    crate::provider::parse_retry_after(headers, now)
}

/// An MCP `CallToolResult` as JSON, as a tool server sent it.
pub fn tool_result(json: &[u8]) -> Result<ToolResult, String> {
    crate::tools::decode_tool_result(json)
}

/// A tool result cut to about `cap` bytes, as the worker keeps it.
pub fn cap_tool_result(result: ToolResult, cap: usize) -> ToolResult {
    crate::tools::cap_result(result, cap)
}

/// Journal steps as the engine returned them (JSON array), replayed into a run.
pub fn journal_replay(steps: &[JournalStep]) -> Result<Replayed, ReplayError> {
    Replayed::from_steps(steps)
}

/// Journal steps from raw JSON (an array of steps), then replayed.
pub fn journal_replay_json(json: &[u8]) -> Result<Replayed, String> {
    let steps: Vec<JournalStep> = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    Replayed::from_steps(&steps).map_err(|e| e.to_string())
}

/// The worker's configuration from a map of variables.
pub fn config(vars: &std::collections::HashMap<String, String>) -> Result<Config, ConfigError> {
    Config::from_env(vars)
}

/// An agent definition as an engine sends it on a task.
pub fn agent_definition(value: &Value) -> Result<AgentDefinition, String> {
    AgentDefinition::from_value(value, "fuzz").map_err(|e| e.to_string())
}

/// An `outputSchema` (from a definition, outside input), compiled under its bounds, and a model's
/// final answer judged against it: the value stored, or why not.
pub fn output_answer(schema: &Value, answer: &str, stop_reason: &str) -> Result<Value, String> {
    let schema = crate::agent::output::OutputSchema::compile(schema).map_err(|e| e.to_string())?;
    crate::agent::output::judge(Some(&schema), answer, stop_reason, Some(100))
        .map_err(|r| r.repair_message())
}

/// A model's final answer examined for the shapes of `agent::answer_shape` (a tool call written
/// as text, markup, an empty answer), two tools offered (`orders__lookup_order`, read-only, and
/// `orders__issue_refund`, a write), under `parse` or `repair`: the tool calls the answer now
/// holds, why it is sent back (if it is), and its text.
pub fn answer_shape(
    text: &str,
    parse: bool,
) -> (
    Vec<crate::conversation::ToolCall>,
    Option<&'static str>,
    Option<String>,
) {
    let spec = |tool: &str, read_only: bool| crate::conversation::ToolSpec {
        server: "orders".into(),
        tool: tool.into(),
        description: String::new(),
        input_schema: serde_json::json!({"type": "object"}),
        read_only,
        destructive: false,
    };
    let specs = [spec("lookup_order", true), spec("issue_refund", false)];
    let policy = if parse {
        crate::provider::TextToolCalls::Parse
    } else {
        crate::provider::TextToolCalls::Repair
    };
    let answer = crate::conversation::AssistantMessage {
        text: Some(text.to_string()),
        tool_calls: Vec::new(),
    };
    let ex = crate::agent::answer_shape::examine(answer, "stop", &specs, &[], policy, 2);
    (
        ex.message.tool_calls,
        ex.malformed.map(|m| m.reason.as_str()),
        ex.message.text,
    )
}

/// A `${name}` template rendered with process variables.
pub fn render_template(template: &str, variables: &Map<String, Value>) -> Result<String, String> {
    definition::render_template(template, variables)
}

/// A `${name}` template rendered as the instructions are with `renderInstructions`: every value
/// fenced as data, the result capped at `cap` bytes.
pub fn render_fenced(
    template: &str,
    variables: &Map<String, Value>,
    cap: usize,
) -> Result<String, String> {
    definition::render_capped(template, variables, definition::Fence::Data, cap).map_err(
        |e| match e {
            definition::RenderError::Missing(name) => format!("no variable {name:?}"),
            definition::RenderError::TooLarge { limit } => format!("over {limit} bytes"),
        },
    )
}

/// The text of an agents file (TOML).
pub fn agents_file(text: &str) -> Result<AgentsFile, String> {
    AgentsFile::parse_str(text)
}
