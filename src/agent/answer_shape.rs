//! The shape of a model's answer, examined before anything of it is limited, journaled, judged
//! or performed: the malformed shapes real models produce (docs/REAL_MODEL.md), each turned into
//! a tolerant parse, a repair turn with a clear message, or a named incident. Never stored as the
//! task's result, never looping.
//!
//! - **A tool call written as text.** A final answer that is really a call of an offered tool
//!   (`{"name": <tool>, "arguments": {...}}`, or `"parameters"`, or OpenAI's `{"type":
//!   "function", "function": {...}}`, alone or in a list; bare, in a Markdown fence, inside tags
//!   such as `<tool_call>` or `<response>`, or among other text), and any `<tool_call>` markup in
//!   the content. What it becomes is the operator's choice per provider
//!   ([`TextToolCalls`], `ABADA_AGENT_PROVIDER_<NAME>_TOOL_CALLS_IN_TEXT`): a repair turn (the
//!   default: the model reads how to call tools, nothing is performed), or a tolerant parse (the
//!   calls become the answer's tool calls, named `text_call_{seq}_{i}`, and from there obey every
//!   rule a tool call obeys: arguments, keyed writes, approval, limits, the journal). A call of a
//!   name nobody offered, in markup or in the exact shape of a call (the real model writes its
//!   decision so: `{"name": "refunded", "arguments": {...}}`), is sent back under either, naming
//!   the tools there are. With or without an `outputSchema`: the answer is examined before it is
//!   judged.
//! - **An empty final answer**: a repair turn.
//! - **A write repeated after its result**: a write identical (server, tool, canonical
//!   arguments, or the same with fields of its result folded in, as a small model writes it) to
//!   one that already succeeded in this run, in an earlier answer. It is not
//!   performed again: the model reads that it was done, and its earlier result. This is what
//!   keeps a model that loops from issuing a refund twice. (Two identical writes in one answer
//!   are both performed, as before; a repeated read is performed again, bounded by the limits:
//!   a tool that polls a status is called the same way until it changes.)
//! - **A tool named in another case or without its server** (`Issue_Refund`, `issue_refund` for
//!   `orders__issue_refund`), and **arguments with trailing text** (`{"orderId": "o-9"}}` or a
//!   closing tag after the object, or the object encoded twice): a tolerant parse under `parse`
//!   (the one offered tool the name fits; the leading object when what follows it cannot carry
//!   an argument); under `repair` the tool call is answered with an error result that names the
//!   tools as offered (`agent::tool_call`).
//!
//! Each repair turn (a call written as text, an empty answer, a repeated call) is journaled on
//! the answer's model step ([`JOURNAL_FIELD`], with the message the model reads next), so a
//! resumed run replays it exactly; the definition's `answerRepairTurns` (default
//! [`DEFAULT_REPAIR_TURNS`], at most [`MAX_REPAIR_TURNS`]) bound them, then the task is an
//! incident naming the shape. Every repair turn is also a model turn (`maxTurns`), and a tolerant
//! parse is journaled as what the model wrote ([`PARSED_FIELD`]).
//!
//! The anchors, read in their source: vLLM's tool parsers are chosen per model by the operator
//! (`--tool-call-parser hermes|llama3_json|...`): `hermes` and `qwen2` take only what is inside
//! `<tool_call>` tags; `llama3_json` takes the first JSON object(s) anywhere in the text with
//! `"name"` and `"arguments"` or `"parameters"`, without checking the name against the tools
//! offered. Ollama derives the opening of a call from the model's template (`<tool_call>` for
//! Qwen 2.5, `{` when it has none) and accepts a call only when it names a tool of the request
//! and its arguments hold one of that tool's parameters (`tools/tools.go`). llama.cpp's
//! `llama-server --jinja` derives a parser from the chat template (`common/chat.cpp` and its
//! auto-parser, docs/autoparser.md): for Qwen 2.5 it takes a call only inside `<tool_call>`;
//! anything else is content, so a model that writes the call bare reaches the client as text.
//! The worker's tolerant parse is stricter than `llama3_json` (offered tools only, no extra
//! keys) and wider than `hermes` (the shapes above), and it is never on by default.
//!
//! The scan is bounded: the first [`MAX_SCANNED_BYTES`] of an answer, at most
//! [`MAX_CANDIDATES`] places where a JSON value may start, and only after a cheap check that the
//! text names a key `"name"` or holds `<tool_call>` markup.

use serde_json::{Map, Value, json};

use super::canonical::canonical;
use crate::conversation::{AssistantMessage, Message, ToolCall, ToolResult, ToolSpec};
use crate::provider::TextToolCalls;
use crate::provider::tool_names::ToolNames;

/// How many repair turns a definition gets when it sets none (`answerRepairTurns`).
pub(crate) const DEFAULT_REPAIR_TURNS: u32 = 2;
/// The most `answerRepairTurns` may ask: every repair is one more paid model call.
pub(crate) const MAX_REPAIR_TURNS: u32 = 5;
/// The model step's field recording a repair turn (`{"reason", "message"}`): a field the engine
/// keeps and ignores (protocol.md B.2), so the step keeps its kind.
pub(crate) const JOURNAL_FIELD: &str = "answerRepair";
/// The model step's field recording a tolerant parse: what was tolerated, and the text the
/// model wrote when calls were taken from it.
pub(crate) const PARSED_FIELD: &str = "toleratedAnswer";
/// How much of an answer is searched for calls written as text.
const MAX_SCANNED_BYTES: usize = 64 * 1024;
/// How many places where a JSON value may start are tried.
const MAX_CANDIDATES: usize = 64;
/// How many characters of the model's own text a message or an incident quotes.
const MAX_QUOTED_CHARS: usize = 300;
/// How much of the model's text a tolerant parse keeps in the journal beside the calls.
const MAX_KEPT_TEXT_CHARS: usize = 4096;
/// Keys of an object that wraps one call (`{"tool_call": {...}}`).
const WRAPPER_KEYS: &[&str] = &[
    "tool_call",
    "tool_calls",
    "function_call",
    "function",
    "call",
];
/// Keys a call object may hold besides its name and arguments.
const CALL_EXTRA_KEYS: &[&str] = &["type", "id", "index"];

/// Why an answer gets a repair turn: a closed set (the metrics' `reason` label, the journal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A tool call written as text, or `<tool_call>` markup in the content.
    ToolCallAsText,
    /// No text and no tool call.
    EmptyAnswer,
    /// A write identical to one that already succeeded in this run.
    RepeatedCall,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ToolCallAsText => "tool_call_as_text",
            Reason::EmptyAnswer => "empty_answer",
            Reason::RepeatedCall => "repeated_call",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            Reason::ToolCallAsText,
            Reason::EmptyAnswer,
            Reason::RepeatedCall,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// Where a call written as text sat in the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The answer is the JSON of the call(s) and nothing else.
    BareJson,
    /// Inside a Markdown code fence.
    FencedJson,
    /// Inside tags (`<tool_call>`, `<response>`, ...).
    Tagged,
    /// Among other text (a call and a final answer in one message).
    WithText,
}

impl Shape {
    pub fn as_str(self) -> &'static str {
        match self {
            Shape::BareJson => "bare_json",
            Shape::FencedJson => "fenced_json",
            Shape::Tagged => "tagged",
            Shape::WithText => "with_text",
        }
    }

    fn described(self) -> &'static str {
        match self {
            Shape::BareJson => "as bare JSON",
            Shape::FencedJson => "in a Markdown code fence",
            Shape::Tagged => "inside tags",
            Shape::WithText => "among other text",
        }
    }
}

/// What a tolerant parse accepted (the metric's `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tolerated {
    /// Tool calls taken from the answer's text.
    CallInText(Shape),
    /// A tool name in another case, or without its server.
    ToolName,
    /// Arguments with text after the object (or the object encoded twice).
    ArgumentsText,
}

impl Tolerated {
    pub fn as_str(self) -> &'static str {
        match self {
            Tolerated::CallInText(shape) => shape.as_str(),
            Tolerated::ToolName => "tool_name",
            Tolerated::ArgumentsText => "arguments_text",
        }
    }
}

/// A malformed answer: why, what exactly (for the incident), and the message the model reads
/// next (none for a repeated call: the call's own tool result tells it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed {
    pub reason: Reason,
    pub detail: String,
    pub(crate) message: Option<String>,
}

impl Malformed {
    fn empty() -> Self {
        Malformed {
            reason: Reason::EmptyAnswer,
            detail: "no text and no tool call".into(),
            message: Some(
                "Your answer was empty. Call a tool if you need one, or give your final answer."
                    .into(),
            ),
        }
    }

    fn call_as_text(found: &InText, offered: &Offered) -> Self {
        // SIM-BUG (feature `sim-bugs`, selected at run time): one call past the last.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::TextCallPanics) {
            let past = found.calls.len();
            let _ = found
                .calls
                .get(past)
                .expect("index out of bounds: one call past the last");
        }
        let names: Vec<String> = found
            .calls
            .iter()
            .map(|c| match offered.resolve(&c.name) {
                Some(spec) => offered.function_name(spec),
                None => c.name.clone(),
            })
            .collect();
        let called = names.join(", ");
        // A name nobody offered: the model is told which tools there are.
        let unknown: Vec<&str> = found
            .calls
            .iter()
            .filter(|c| offered.resolve(&c.name).is_none())
            .map(|c| c.name.as_str())
            .collect();
        let tools = if unknown.is_empty() {
            String::new()
        } else {
            format!(
                " There is no tool {}: the tools offered are {}.",
                unknown.join(", "),
                offered.list()
            )
        };
        Malformed {
            reason: Reason::ToolCallAsText,
            detail: format!(
                "a call of {called} written as text ({})",
                found.shape.described()
            ),
            message: Some(format!(
                "Your answer is not a final answer: it holds a call of the tool {called} written as text ({}). A tool call written as text is not run.{tools} To call a tool, make a tool call (function calling) with its arguments as a JSON object, and write nothing else; to finish, answer without any tool call in your text.",
                found.shape.described()
            )),
        }
    }

    fn unreadable(text: &str) -> Self {
        Malformed {
            reason: Reason::ToolCallAsText,
            detail: format!(
                "a tool call written as text that cannot be read: {}",
                quote(text)
            ),
            message: Some(
                "Your answer holds a tool call written as text that cannot be read, and it is not a final answer. A tool call written as text is not run. To call a tool, make a tool call (function calling) naming one of the tools offered, with its arguments as a JSON object; to finish, answer without any tool call in your text."
                    .into(),
            ),
        }
    }

    fn repeated(calls: &[String]) -> Self {
        Malformed {
            reason: Reason::RepeatedCall,
            detail: format!(
                "{} with the same arguments as a call that already succeeded in this run",
                calls.join(", ")
            ),
            message: None,
        }
    }

    /// The incident's details once no repair turn is left.
    pub(crate) fn incident_details(&self, agent: &str, repairs: u32) -> String {
        let after = match repairs {
            0 => "with no repair turn allowed (answerRepairTurns = 0)".to_string(),
            n => format!("after {n} repair turn(s) (answerRepairTurns)"),
        };
        match self.reason {
            Reason::ToolCallAsText => format!(
                "agent {agent:?}: the model answered with {} {after}; nothing of it was performed or stored. Use a model that calls tools through its API's tool calls, or set ABADA_AGENT_PROVIDER_<NAME>_TOOL_CALLS_IN_TEXT=parse for its provider to take such calls as tool calls",
                self.detail
            ),
            Reason::EmptyAnswer => format!(
                "agent {agent:?}: the model's answer was empty ({}) {after}; nothing was stored",
                self.detail
            ),
            Reason::RepeatedCall => format!(
                "agent {agent:?}: the model called {} {after}; the repeated calls were not performed",
                self.detail
            ),
        }
    }
}

/// What the examination of one answer found.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Examined {
    /// The answer to limit, journal and act on: the model's, or with what a tolerant parse took.
    pub message: AssistantMessage,
    /// What a tolerant parse accepted (none under `repair`).
    pub tolerated: Vec<Tolerated>,
    /// The model's text, when calls were taken from it (the journaled message keeps only the
    /// text around them).
    pub written: Option<String>,
    /// Why the answer gets a repair turn, if it does.
    pub malformed: Option<Malformed>,
}

impl Examined {
    /// The journal's record of a tolerant parse, if there was one.
    pub(crate) fn tolerated_record(&self) -> Option<Value> {
        if self.tolerated.is_empty() {
            return None;
        }
        let mut record = json!({
            "tolerated": self.tolerated.iter().map(|t| t.as_str()).collect::<Vec<_>>(),
        });
        if let Some(text) = &self.written {
            record["text"] = Value::String(cut(text, MAX_KEPT_TEXT_CHARS));
        }
        Some(record)
    }
}

/// What becomes of a malformed answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Accepted,
    /// Journaled with its repair, and the model is asked again.
    Repair(Malformed),
    /// Journaled with its repair (a retry of the incident resumes there), then the incident.
    Exhausted(Malformed),
}

impl Verdict {
    /// `spent` of `allowed` repair turns were used before this answer.
    pub(crate) fn of(malformed: Option<Malformed>, spent: u32, allowed: u32) -> Self {
        match malformed {
            None => Verdict::Accepted,
            Some(m) if spent < allowed => Verdict::Repair(m),
            Some(m) => Verdict::Exhausted(m),
        }
    }

    pub fn malformed(&self) -> Option<&Malformed> {
        match self {
            Verdict::Accepted => None,
            Verdict::Repair(m) | Verdict::Exhausted(m) => Some(m),
        }
    }
}

/// The journal's record of a repair turn, on the answer's model step.
pub(crate) fn journal_record(m: &Malformed) -> Value {
    let mut record = json!({"reason": m.reason.as_str()});
    if let Some(message) = &m.message {
        record["message"] = Value::String(message.clone());
    }
    record
}

/// A repair turn read back from a model step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JournaledRepair {
    pub reason: Option<Reason>,
    /// What the model read next, as the user's word (none: tool results told it).
    pub message: Option<String>,
}

/// The repair turn recorded on a model step's data, if any.
pub(crate) fn journaled_repair(data: &Value) -> Result<Option<JournaledRepair>, String> {
    let Some(record) = data.get(JOURNAL_FIELD) else {
        return Ok(None);
    };
    let reason = record
        .get("reason")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{JOURNAL_FIELD} has no reason"))?;
    let message = match record.get("message") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(format!("{JOURNAL_FIELD}.message is not text")),
    };
    Ok(Some(JournaledRepair {
        reason: Reason::parse(reason),
        message,
    }))
}

/// Examines one answer of a model of a provider whose calls written as text are treated as
/// `policy` says. `specs` are the tools offered, `history` the conversation before the answer,
/// `seq` the journal seq the answer's step will get (it names calls taken from text).
pub(crate) fn examine(
    answer: AssistantMessage,
    stop_reason: &str,
    specs: &[ToolSpec],
    history: &[Message],
    policy: TextToolCalls,
    seq: u64,
) -> Examined {
    let offered = Offered::new(specs);
    let mut ex = Examined {
        message: answer,
        tolerated: Vec::new(),
        written: None,
        malformed: None,
    };
    if !ex.message.tool_calls.is_empty() {
        if policy == TextToolCalls::Parse {
            for call in &mut ex.message.tool_calls {
                tolerate(call, &offered, &mut ex.tolerated);
            }
        }
        ex.malformed = repeated_calls(&ex.message.tool_calls, history, &offered);
        return ex;
    }
    // A cut answer is the output's to judge (never stored); a partial call in it is no call.
    if matches!(stop_reason, "length" | "max_tokens") {
        return ex;
    }
    let text = ex.message.text.clone().unwrap_or_default();
    if text.trim().is_empty() {
        ex.malformed = Some(Malformed::empty());
        return ex;
    }
    if specs.is_empty() {
        return ex;
    }
    match calls_in_text(&text, &offered) {
        TextCalls::None => {}
        TextCalls::Unreadable => ex.malformed = Some(Malformed::unreadable(&text)),
        // Under `parse` only calls of offered tools are taken: a call of a name nobody offered
        // (the decision written as a call, `{"name": "refunded", ...}`) cannot be performed, and
        // is sent back naming the tools there are.
        TextCalls::Found(found)
            if policy == TextToolCalls::Repair
                || found
                    .calls
                    .iter()
                    .any(|c| offered.resolve(&c.name).is_none()) =>
        {
            ex.malformed = Some(Malformed::call_as_text(&found, &offered));
        }
        TextCalls::Found(found) => {
            let calls: Vec<ToolCall> = found
                .calls
                .iter()
                .enumerate()
                .filter_map(|(i, c)| {
                    let spec = offered.resolve(&c.name)?;
                    Some(ToolCall {
                        call_id: format!("text_call_{seq}_{i}"),
                        server: spec.server.clone(),
                        tool: spec.tool.clone(),
                        arguments: c.arguments.clone(),
                    })
                })
                .collect();
            ex.tolerated.push(Tolerated::CallInText(found.shape));
            ex.written = Some(text);
            ex.message = AssistantMessage {
                text: Some(found.rest).filter(|t| !t.is_empty()),
                tool_calls: calls,
            };
            ex.malformed = repeated_calls(&ex.message.tool_calls, history, &offered);
        }
    }
    ex
}

/// The earlier result of a write identical to `call` (server, tool, canonical arguments) that
/// succeeded in `history`. None for a read (repeating one is harmless, and a tool that polls a
/// status is called the same way until it changes: the limits bound it), a call of no offered
/// tool, or arguments that are no object.
pub(crate) fn repeat_of<'h>(
    history: &'h [Message],
    call: &ToolCall,
    specs: &[ToolSpec],
) -> Option<&'h ToolResult> {
    let spec = specs
        .iter()
        .find(|s| s.server == call.server && s.tool == call.tool)?;
    if !spec.is_write() || !call.arguments.is_object() {
        return None;
    }
    history.iter().rev().find_map(|m| match m {
        Message::ToolResult {
            call: earlier,
            result,
        } if !result.is_error
            && earlier.server == call.server
            && earlier.tool == call.tool
            && same_write(&earlier.arguments, result, &call.arguments) =>
        {
            Some(result)
        }
        _ => None,
    })
}

/// Whether `arguments` ask for the write `earlier` asked for, which answered `result`: the
/// same arguments (canonically), or the same with fields of the result folded in (what a small
/// model does: `{"orderId": ..., "amountCents": ..., "refundId": "rf-1", "status": "issued"}`
/// after the refund answered `refundId` and `status`).
fn same_write(earlier: &Value, result: &ToolResult, arguments: &Value) -> bool {
    if canonical(earlier) == canonical(arguments) {
        return true;
    }
    let (Value::Object(before), Value::Object(now)) = (earlier, arguments) else {
        return false;
    };
    let answered = result.structured_content.clone().or_else(|| {
        serde_json::from_str::<Value>(&result.to_model_text())
            .ok()
            .filter(Value::is_object)
    });
    let Some(Value::Object(answered)) = answered else {
        return false;
    };
    before
        .iter()
        .all(|(k, v)| now.get(k).is_some_and(|n| canonical(n) == canonical(v)))
        && now.iter().all(|(k, v)| {
            before.contains_key(k)
                || answered
                    .get(k)
                    .is_some_and(|a| canonical(a) == canonical(v))
        })
}

/// The conversation before the last model answer: what a pending call of that answer is
/// compared with ([`repeat_of`]), so two identical calls of one answer are both performed.
pub(crate) fn before_last_answer(messages: &[Message]) -> &[Message] {
    let end = messages
        .iter()
        .rposition(|m| matches!(m, Message::Assistant(_)))
        .unwrap_or(0);
    &messages[..end]
}

/// The tool result that answers a repeated write instead of performing it.
pub(crate) fn repeated_result(
    call: &ToolCall,
    earlier: &ToolResult,
    specs: &[ToolSpec],
) -> ToolResult {
    let name = ToolNames::new(specs).function_name(&call.server, &call.tool);
    ToolResult::error_text(format!(
        "You already called {name} with these same arguments and it was performed; it was not performed again. Its result was: {} Use that result: call another tool, or give your final answer.",
        cut(&earlier.to_model_text(), 500)
    ))
}

/// Tools offered to the model, with the names it sees.
struct Offered<'a> {
    specs: &'a [ToolSpec],
    names: ToolNames,
}

impl<'a> Offered<'a> {
    fn new(specs: &'a [ToolSpec]) -> Self {
        Offered {
            specs,
            names: ToolNames::new(specs),
        }
    }

    fn function_name(&self, spec: &ToolSpec) -> String {
        self.names.function_name(&spec.server, &spec.tool)
    }

    /// The tools by the names the model sees, comma-separated.
    fn list(&self) -> String {
        self.specs
            .iter()
            .map(|s| self.function_name(s))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The offered tool `name` means: its function name exactly, else the one tool whose
    /// function name or MCP tool name it is in another case.
    fn resolve(&self, name: &str) -> Option<&'a ToolSpec> {
        let name = name.trim();
        if let Some(spec) = self.specs.iter().find(|s| self.function_name(s) == name) {
            return Some(spec);
        }
        let mut fits = self.specs.iter().filter(|s| {
            self.function_name(s).eq_ignore_ascii_case(name) || s.tool.eq_ignore_ascii_case(name)
        });
        match (fits.next(), fits.next()) {
            (Some(spec), None) => Some(spec),
            _ => None,
        }
    }
}

/// Under `parse`: a tool call whose name fits one offered tool in another case gets that tool;
/// arguments given as text that starts with an object get the object.
fn tolerate(call: &mut ToolCall, offered: &Offered, tolerated: &mut Vec<Tolerated>) {
    let known = offered
        .specs
        .iter()
        .any(|s| s.server == call.server && s.tool == call.tool);
    if !known && let Some(spec) = offered.resolve(&call.tool) {
        call.server = spec.server.clone();
        call.tool = spec.tool.clone();
        push_once(tolerated, Tolerated::ToolName);
    }
    if let Value::String(raw) = &call.arguments
        && let Some(object) = leading_object(raw)
    {
        call.arguments = object;
        push_once(tolerated, Tolerated::ArgumentsText);
    }
}

fn push_once(tolerated: &mut Vec<Tolerated>, t: Tolerated) {
    if !tolerated.contains(&t) {
        tolerated.push(t);
    }
}

/// The JSON object `raw` starts with, when what follows it can carry no argument: blanks,
/// closing brackets, closing tags (`</tool_call>`) or special tokens (`<|im_end|>`). Also the
/// object inside a JSON string that holds one (arguments encoded twice).
fn leading_object(raw: &str) -> Option<Value> {
    let trimmed = raw.trim_start();
    if let Ok(Value::String(inner)) = serde_json::from_str::<Value>(trimmed) {
        return serde_json::from_str::<Value>(&inner)
            .ok()
            .filter(Value::is_object);
    }
    let mut stream = serde_json::Deserializer::from_str(trimmed).into_iter::<Value>();
    let value = match stream.next() {
        Some(Ok(v @ Value::Object(_))) => v,
        _ => return None,
    };
    let rest = &trimmed[stream.byte_offset()..];
    closing_only(rest).then_some(value)
}

/// Whether `rest` holds only blanks, closing brackets, closing tags and special tokens.
fn closing_only(rest: &str) -> bool {
    let mut s = rest.trim_start();
    while !s.is_empty() {
        if let Some(after) = s.strip_prefix(['}', ']']) {
            s = after.trim_start();
            continue;
        }
        let tag = s
            .strip_prefix("</")
            .or_else(|| s.strip_prefix("<|"))
            .and_then(|t| t.find('>').map(|end| (t, end)));
        match tag {
            Some((t, end)) if end <= 32 => s = t[end + 1..].trim_start(),
            _ => return false,
        }
    }
    true
}

/// One call written as text.
#[derive(Clone, Debug, PartialEq)]
struct WrittenCall {
    name: String,
    arguments: Value,
}

/// Calls written as text, where they sat, and the text around them.
#[derive(Clone, Debug, PartialEq)]
struct InText {
    calls: Vec<WrittenCall>,
    shape: Shape,
    /// The text with the calls and their fences or tags taken out, trimmed.
    rest: String,
}

#[derive(Clone, Debug, PartialEq)]
enum TextCalls {
    None,
    /// `<tool_call>` markup, or the start of a call object (`{"name": "...", "arguments"`),
    /// with no call in it the worker can read (not JSON: a brace missing, say).
    Unreadable,
    Found(InText),
}

/// Whether `text` starts with the start of a call object, `{"name": "<name>", "arguments"` (or
/// `"parameters"`), whatever follows.
fn starts_like_a_call(text: &str) -> bool {
    text.strip_prefix('{')
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix("\"name\""))
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix(':'))
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix('"'))
        .and_then(|s| s.find('"').map(|end| &s[end + 1..]))
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix(','))
        .map(str::trim_start)
        .is_some_and(|s| s.starts_with("\"arguments\"") || s.starts_with("\"parameters\""))
}

/// The calls of offered tools written in `text` (and any call inside `<tool_call>` tags).
fn calls_in_text(text: &str, offered: &Offered) -> TextCalls {
    let mut end = text.len().min(MAX_SCANNED_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let scanned = &text[..end];
    // ASCII lower case keeps every byte where it was.
    let lower = scanned.to_ascii_lowercase();
    let markup = lower.contains("<tool_call>") || lower.contains("</tool_call>");
    if !markup && !scanned.contains("\"name\"") {
        return TextCalls::None;
    }
    let mut calls = Vec::new();
    let mut spans: Vec<(usize, usize)> = Vec::new();
    // The start of a call object that is no JSON (a brace missing, say).
    let mut broken = false;
    let mut at = 0;
    let mut tried = 0;
    while tried < MAX_CANDIDATES {
        let Some(offset) = scanned[at..].find(['{', '[']) else {
            break;
        };
        let start = at + offset;
        tried += 1;
        let mut stream = serde_json::Deserializer::from_str(&scanned[start..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(value)) => {
                let end = start + stream.byte_offset();
                let in_markup = inside_tool_call_tag(&lower, start);
                if let Some(found) = as_calls(&value, offered, in_markup) {
                    calls.extend(found);
                    spans.push((start, end));
                }
                // A JSON value that is no call is data: what is inside it is no call either.
                at = end;
            }
            _ => {
                broken |= starts_like_a_call(&scanned[start..]);
                at = start + 1;
            }
        }
    }
    if calls.is_empty() {
        return if markup || broken {
            TextCalls::Unreadable
        } else {
            TextCalls::None
        };
    }
    let mut outside = String::new();
    let mut from = 0;
    for (start, end) in &spans {
        outside.push_str(&scanned[from..*start]);
        outside.push(' ');
        from = *end;
    }
    outside.push_str(&text[from..]);
    let (rest, fenced, tagged) = strip_wrappers(&outside);
    let shape = match (rest.is_empty(), tagged, fenced) {
        (false, _, _) => Shape::WithText,
        (true, true, _) => Shape::Tagged,
        (true, false, true) => Shape::FencedJson,
        (true, false, false) => Shape::BareJson,
    };
    TextCalls::Found(InText { calls, shape, rest })
}

/// Whether byte `at` of the (lower-cased) text is inside an open `<tool_call>` tag.
fn inside_tool_call_tag(lower: &str, at: usize) -> bool {
    let before = &lower[..at];
    match (before.rfind("<tool_call>"), before.rfind("</tool_call>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// The calls a JSON value holds: a call object, a list of them, or an object wrapping them.
/// Inside `<tool_call>` tags a call of any name counts (it is markup, never an answer); else
/// only a call naming an offered tool.
fn as_calls(value: &Value, offered: &Offered, in_markup: bool) -> Option<Vec<WrittenCall>> {
    match value {
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| match item {
                Value::Object(map) => call_of(map, offered, in_markup),
                _ => None,
            })
            .collect(),
        Value::Object(map) => {
            if let Some(call) = call_of(map, offered, in_markup) {
                return Some(vec![call]);
            }
            match map.iter().next() {
                Some((key, inner)) if map.len() == 1 && WRAPPER_KEYS.contains(&key.as_str()) => {
                    as_calls(inner, offered, in_markup)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// One call object: `{"name", "arguments"|"parameters"}` (with at most `type`, `id`, `index`
/// beside them), or OpenAI's `{"type": "function", "function": {...}}`.
fn call_of(map: &Map<String, Value>, offered: &Offered, in_markup: bool) -> Option<WrittenCall> {
    if let Some(Value::Object(function)) = map.get("function")
        && map
            .keys()
            .all(|k| k == "function" || CALL_EXTRA_KEYS.contains(&k.as_str()))
    {
        return call_of(function, offered, in_markup);
    }
    let name = map.get("name")?.as_str()?;
    let mut args_keys = map
        .keys()
        .filter(|k| *k == "arguments" || *k == "parameters");
    let args_key = args_keys.next();
    if args_keys.next().is_some()
        || !map.keys().all(|k| {
            k == "name"
                || k == "arguments"
                || k == "parameters"
                || CALL_EXTRA_KEYS.contains(&k.as_str())
        })
    {
        return None;
    }
    // Outside markup, a name nobody offered is a call only in the exact shape of one (name and
    // arguments, nothing else): `{"name": "Bob"}` is data, `{"name": "hello", "arguments": {}}`
    // is a model imitating a call (sent back naming the tools there are).
    if !in_markup && args_key.is_none() && offered.resolve(name).is_none() {
        return None;
    }
    let arguments = match args_key.and_then(|k| map.get(k)) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(raw)) => {
            leading_object(raw).unwrap_or_else(|| Value::String(raw.clone()))
        }
        Some(other) => other.clone(),
    };
    Some(WrittenCall {
        name: name.trim().to_string(),
        arguments,
    })
}

/// `text` without Markdown fences and tags, whitespace collapsed at its ends; and whether it had
/// a fence, and a tag.
fn strip_wrappers(text: &str) -> (String, bool, bool) {
    let mut out = String::with_capacity(text.len());
    let (mut fenced, mut tagged) = (false, false);
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("```") {
            fenced = true;
            let lang = after
                .find(|c: char| !c.is_ascii_alphanumeric())
                .unwrap_or(after.len());
            rest = &after[lang..];
            continue;
        }
        if rest.starts_with('<')
            && let Some(len) = tag_len(rest)
        {
            tagged = true;
            rest = &rest[len..];
            continue;
        }
        if let Some(after) = rest.strip_prefix("[TOOL_CALLS]") {
            tagged = true;
            rest = after;
            continue;
        }
        let c = rest.chars().next().unwrap_or(' ');
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    (out.trim().to_string(), fenced, tagged)
}

/// The length of a tag at the start of `s`: `<name>`, `</name>` or `<|name|>`, a name of ASCII
/// letters, digits, `_` and `-`, at most 32 of them.
fn tag_len(s: &str) -> Option<usize> {
    let inner = s.strip_prefix('<')?;
    let inner_start = usize::from(inner.starts_with('/') || inner.starts_with('|'));
    let body = &inner[inner_start..];
    let end = body.find('>')?;
    let name = body[..end].trim_end_matches('|');
    let valid = !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    valid.then_some(1 + inner_start + end + 1)
}

/// The names of the calls in `calls` that repeat a call that already succeeded in `history`,
/// as a repair (the calls' own results tell the model).
fn repeated_calls(calls: &[ToolCall], history: &[Message], offered: &Offered) -> Option<Malformed> {
    let repeated: Vec<String> = calls
        .iter()
        .filter(|c| repeat_of(history, c, offered.specs).is_some())
        .map(|c| offered.names.function_name(&c.server, &c.tool))
        .collect();
    (!repeated.is_empty()).then(|| Malformed::repeated(&repeated))
}

fn quote(text: &str) -> String {
    format!("{:?}", cut(text.trim(), MAX_QUOTED_CHARS))
}

/// `text` cut to `max` characters, saying so.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((at, _)) => format!("{}… (cut)", &text[..at]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tool: &str, read_only: bool) -> ToolSpec {
        ToolSpec {
            server: "orders".into(),
            tool: tool.into(),
            description: String::new(),
            input_schema: json!({"type": "object"}),
            read_only,
            destructive: false,
        }
    }

    fn specs() -> Vec<ToolSpec> {
        vec![spec("lookup_order", true), spec("issue_refund", false)]
    }

    fn text(t: &str) -> AssistantMessage {
        AssistantMessage {
            text: Some(t.into()),
            tool_calls: Vec::new(),
        }
    }

    fn call(id: &str, server: &str, tool: &str, arguments: Value) -> ToolCall {
        ToolCall {
            call_id: id.into(),
            server: server.into(),
            tool: tool.into(),
            arguments,
        }
    }

    fn ok(t: &str) -> ToolResult {
        ToolResult {
            content: vec![json!({"type": "text", "text": t})],
            structured_content: None,
            is_error: false,
        }
    }

    fn examine_text(t: &str, policy: TextToolCalls) -> Examined {
        examine(text(t), "stop", &specs(), &[], policy, 7)
    }

    /// What the real model wrote (docs/REAL_MODEL.md), and the shapes around it: never a final
    /// answer; under `repair` a repair turn naming the shape, under `parse` the call.
    #[test]
    fn a_call_written_as_text_is_repaired_or_parsed_whatever_its_wrapping() {
        let cases = [
            (
                r#"{"name": "issue_refund", "arguments": {"amount": 25, "order_id": "o-9"}}"#,
                Shape::BareJson,
            ),
            (
                "```json\n{\"name\": \"orders__lookup_order\", \"arguments\": {\"order_id\": \"o-9\"}}\n```",
                Shape::FencedJson,
            ),
            (
                "<response>\n{\"name\": \"lookup_order\", \"arguments\": {\"order_id\": \"o-9\"}}\n</response>",
                Shape::Tagged,
            ),
            (
                "<tool_call>\n{\"name\": \"orders__lookup_order\", \"arguments\": {\"order_id\": \"o-9\"}}\n</tool_call>",
                Shape::Tagged,
            ),
            (
                "I will look it up.\n{\"name\": \"Lookup_Order\", \"parameters\": {\"order_id\": \"o-9\"}}\nThe order was refunded.",
                Shape::WithText,
            ),
            (
                r#"[{"type": "function", "function": {"name": "lookup_order", "arguments": "{\"order_id\": \"o-9\"}"}}]"#,
                Shape::BareJson,
            ),
            (
                r#"{"tool_call": {"name": "lookup_order", "arguments": {"order_id": "o-9"}}}"#,
                Shape::BareJson,
            ),
        ];
        for (written, shape) in cases {
            let repaired = examine_text(written, TextToolCalls::Repair);
            let m = repaired.malformed.expect(written);
            assert_eq!(m.reason, Reason::ToolCallAsText, "{written}");
            assert!(m.detail.contains(shape.described()), "{written}: {m:?}");
            assert!(m.message.unwrap().contains("tool call"), "{written}");
            assert!(repaired.message.tool_calls.is_empty(), "nothing performed");
            assert!(repaired.tolerated.is_empty());

            let parsed = examine_text(written, TextToolCalls::Parse);
            assert_eq!(parsed.malformed, None, "{written}");
            assert_eq!(parsed.tolerated, vec![Tolerated::CallInText(shape)]);
            let calls = &parsed.message.tool_calls;
            assert_eq!(calls.len(), 1, "{written}");
            assert_eq!(calls[0].server, "orders", "{written}");
            assert!(
                ["lookup_order", "issue_refund"].contains(&calls[0].tool.as_str()),
                "{written}"
            );
            assert_eq!(calls[0].call_id, "text_call_7_0");
            assert_eq!(calls[0].arguments["order_id"], "o-9", "{written}");
            assert_eq!(parsed.written.as_deref(), Some(written));
            if shape == Shape::WithText {
                assert_eq!(
                    parsed.message.text.as_deref(),
                    Some("I will look it up.\n \nThe order was refunded.")
                );
            } else {
                assert_eq!(parsed.message.text, None, "{written}");
            }
        }
    }

    #[test]
    fn json_that_is_no_call_of_an_offered_tool_stays_a_final_answer() {
        for answer in [
            r#"{"decision": "refund", "name": "Bob"}"#,
            r#"{"name": "lookup_order", "arguments": {"order_id": "o-9"}, "reason": "extra key: data"}"#,
            "The order o-9 was refunded.",
            r#"["lookup_order", "issue_refund"]"#,
            r#"{"items": [{"name": "lookup_order"}], "note": "a list of names"}"#,
        ] {
            for policy in [TextToolCalls::Repair, TextToolCalls::Parse] {
                let ex = examine_text(answer, policy);
                assert_eq!(ex.malformed, None, "{answer}");
                assert_eq!(ex.message, text(answer), "{answer}");
                assert!(ex.tolerated.is_empty());
            }
        }
        // No tools offered: JSON of any name is the answer.
        let ex = examine(
            text(r#"{"name": "lookup_order", "arguments": {}}"#),
            "stop",
            &[],
            &[],
            TextToolCalls::Repair,
            1,
        );
        assert_eq!(ex.malformed, None);
    }

    #[test]
    fn tool_call_markup_or_a_call_without_a_readable_body_is_sent_back_under_either_policy() {
        for answer in [
            "<tool_call>\nlookup_order(order_id=\"o-9\")\n</tool_call>",
            "Done.</tool_call>",
            // What the real model wrote, its last brace missing.
            "{\"name\": \"hello\", \"arguments\": {\"message\": \"Hello\"}",
            "Sure: { \"name\" : \"issue_refund\" , \"parameters\": {\"orderId\": ",
        ] {
            for policy in [TextToolCalls::Repair, TextToolCalls::Parse] {
                let ex = examine_text(answer, policy);
                assert_eq!(
                    ex.malformed.as_ref().map(|m| m.reason),
                    Some(Reason::ToolCallAsText),
                    "{answer}"
                );
                assert!(ex.message.tool_calls.is_empty());
            }
        }
        // A call of a tool nobody offered, in markup or in the exact shape of a call (what the
        // real model answered to "Say hello.", and its decision written as a call): never the
        // answer, never performed; sent back under either policy, naming the tools there are.
        for answer in [
            "<tool_call>{\"name\": \"drop_tables\", \"arguments\": {}}</tool_call>",
            "{\"arguments\":{\"message\":\"Hello!\"},\"name\":\"drop_tables\"}",
            "{\"name\": \"refunded\", \"arguments\": {\"orderId\": \"o-9\"}}",
        ] {
            for policy in [TextToolCalls::Repair, TextToolCalls::Parse] {
                let ex = examine_text(answer, policy);
                assert!(ex.message.tool_calls.is_empty(), "{answer}");
                let m = ex.malformed.unwrap();
                assert_eq!(m.reason, Reason::ToolCallAsText);
                let said = m.message.unwrap();
                assert!(
                    said.contains("There is no tool")
                        && said.contains("orders__lookup_order, orders__issue_refund"),
                    "{said}"
                );
            }
        }
    }

    #[test]
    fn an_empty_answer_is_sent_back_and_a_cut_one_is_left_to_the_output_verdict() {
        for empty in [None, Some(""), Some("  \n")] {
            let answer = AssistantMessage {
                text: empty.map(str::to_string),
                tool_calls: Vec::new(),
            };
            let ex = examine(answer, "stop", &specs(), &[], TextToolCalls::Repair, 1);
            assert_eq!(ex.malformed.unwrap().reason, Reason::EmptyAnswer);
        }
        let cut = examine(
            text(r#"{"name": "lookup_order", "argu"#),
            "length",
            &specs(),
            &[],
            TextToolCalls::Parse,
            1,
        );
        assert_eq!(cut.malformed, None);
        assert!(cut.message.tool_calls.is_empty());
    }

    #[test]
    fn under_parse_a_name_in_another_case_and_arguments_with_trailing_text_are_tolerated() {
        let answer = AssistantMessage {
            text: None,
            tool_calls: vec![
                call(
                    "c1",
                    "",
                    "Orders__Lookup_Order",
                    json!("{\"order_id\": \"o-9\"}}"),
                ),
                call(
                    "c2",
                    "",
                    "ISSUE_REFUND",
                    json!("{\"amount\": 25} </tool_call>"),
                ),
                call(
                    "c3",
                    "",
                    "lookup_order",
                    json!("\"{\\\"order_id\\\": \\\"o-1\\\"}\""),
                ),
            ],
        };
        let parsed = examine(
            answer.clone(),
            "tool_calls",
            &specs(),
            &[],
            TextToolCalls::Parse,
            1,
        );
        let calls = &parsed.message.tool_calls;
        assert_eq!(
            (calls[0].server.as_str(), calls[0].tool.as_str()),
            ("orders", "lookup_order")
        );
        assert_eq!(calls[0].arguments, json!({"order_id": "o-9"}));
        assert_eq!(calls[1].tool, "issue_refund");
        assert_eq!(calls[1].arguments, json!({"amount": 25}));
        assert_eq!(
            calls[2].arguments,
            json!({"order_id": "o-1"}),
            "encoded twice"
        );
        assert_eq!(
            parsed.tolerated,
            vec![Tolerated::ToolName, Tolerated::ArgumentsText]
        );
        // Under repair nothing changes: the tool call answers them as errors.
        let repaired = examine(
            answer.clone(),
            "tool_calls",
            &specs(),
            &[],
            TextToolCalls::Repair,
            1,
        );
        assert_eq!(repaired.message, answer);
        assert_eq!(repaired.malformed, None);
        // Text after the object that could carry an argument is not dropped.
        for raw in [
            "{\"amount\": 25} {\"amount\": 2500}",
            "{\"amount\": 25}, \"amount\": 2500",
            "{\"amount\": 25} and 2500 more",
            "{\"amount\": ",
        ] {
            assert_eq!(leading_object(raw), None, "{raw}");
        }
        assert_eq!(
            leading_object("{\"a\": 1}\n}] <|im_end|>"),
            Some(json!({"a": 1}))
        );
        // A name two tools fit is not guessed.
        let mut two = specs();
        two.push(ToolSpec {
            server: "billing".into(),
            ..spec("lookup_order", true)
        });
        let guessed = examine(
            AssistantMessage {
                text: None,
                tool_calls: vec![call("c1", "", "LOOKUP_ORDER", json!({}))],
            },
            "tool_calls",
            &two,
            &[],
            TextToolCalls::Parse,
            1,
        );
        assert_eq!(guessed.message.tool_calls[0].server, "");
    }

    #[test]
    fn a_write_repeated_after_its_result_is_a_repair_and_is_answered_without_performing_it() {
        let lookup = call("c1", "orders", "lookup_order", json!({"order_id": "o-9"}));
        let refund = call(
            "c2",
            "orders",
            "issue_refund",
            json!({"order_id": "o-9", "amount": 25}),
        );
        let history = vec![
            Message::User { text: "o-9".into() },
            Message::Assistant(AssistantMessage {
                text: None,
                tool_calls: vec![lookup.clone(), refund.clone()],
            }),
            Message::ToolResult {
                call: lookup.clone(),
                result: ok("order o-9: 25 EUR, damaged"),
            },
            Message::ToolResult {
                call: refund.clone(),
                result: ok("refund rf-1 issued"),
            },
        ];
        // The refund again, keys in another order, two answers later: a repeat.
        let again = call(
            "c3",
            "orders",
            "issue_refund",
            json!({"amount": 25, "order_id": "o-9"}),
        );
        let answer = AssistantMessage {
            text: None,
            tool_calls: vec![again.clone()],
        };
        let ex = examine(
            answer,
            "tool_calls",
            &specs(),
            &history,
            TextToolCalls::Repair,
            4,
        );
        let m = ex.malformed.unwrap();
        assert_eq!(m.reason, Reason::RepeatedCall);
        assert!(m.detail.contains("orders__issue_refund"), "{m:?}");
        assert_eq!(m.message, None, "its tool result tells the model");
        let earlier = repeat_of(&history, &again, &specs()).unwrap();
        let answered = repeated_result(&again, earlier, &specs());
        assert!(answered.is_error);
        assert!(answered.to_model_text().contains("refund rf-1 issued"));
        assert!(answered.to_model_text().contains("orders__issue_refund"));
        // The same refund with the result's fields folded in (what the real model wrote after
        // its refund): a repeat.
        let folded = call(
            "c6",
            "orders",
            "issue_refund",
            json!({"order_id": "o-9", "amount": 25, "refundId": "rf-1", "status": "issued"}),
        );
        let structured = vec![Message::ToolResult {
            call: refund.clone(),
            result: ToolResult {
                structured_content: Some(json!({"refundId": "rf-1", "status": "issued"})),
                ..ok("refund rf-1 issued")
            },
        }];
        assert!(repeat_of(&structured, &folded, &specs()).is_some());
        // A field the result did not hold, or holds otherwise, makes another write.
        let other_field = call(
            "c7",
            "orders",
            "issue_refund",
            json!({"order_id": "o-9", "amount": 25, "refundId": "rf-2"}),
        );
        assert!(repeat_of(&structured, &other_field, &specs()).is_none());
        let dropped = call("c8", "orders", "issue_refund", json!({"order_id": "o-9"}));
        assert!(repeat_of(&structured, &dropped, &specs()).is_none());
        // Another refund is no repeat; nor is a read repeated (a poll is performed again).
        let other = call(
            "c4",
            "orders",
            "issue_refund",
            json!({"order_id": "o-9", "amount": 5}),
        );
        assert!(repeat_of(&history, &other, &specs()).is_none());
        let lookup_again = call("c5", "orders", "lookup_order", json!({"order_id": "o-9"}));
        assert!(repeat_of(&history, &lookup_again, &specs()).is_none());
        // A write that failed may be tried again.
        let failed = vec![Message::ToolResult {
            call: refund.clone(),
            result: ToolResult::error_text("amount too large"),
        }];
        assert!(repeat_of(&failed, &again, &specs()).is_none());
        // Two identical writes of one answer are both performed: each compares with the
        // conversation before that answer.
        let mut same_answer = vec![Message::User { text: "o-9".into() }];
        same_answer.push(Message::Assistant(AssistantMessage {
            text: None,
            tool_calls: vec![refund.clone(), again.clone()],
        }));
        same_answer.push(Message::ToolResult {
            call: refund.clone(),
            result: ok("refunded"),
        });
        assert!(repeat_of(before_last_answer(&same_answer), &again, &specs()).is_none());
    }

    #[test]
    fn repairs_round_trip_through_the_journal_and_are_bounded() {
        let m = examine_text(
            r#"{"name": "lookup_order", "arguments": {"order_id": "o-9"}}"#,
            TextToolCalls::Repair,
        )
        .malformed
        .unwrap();
        let data = json!({ JOURNAL_FIELD: journal_record(&m) });
        let back = journaled_repair(&data).unwrap().unwrap();
        assert_eq!(back.reason, Some(Reason::ToolCallAsText));
        assert_eq!(back.message, m.message);
        assert_eq!(journaled_repair(&json!({})), Ok(None));
        assert!(journaled_repair(&json!({ JOURNAL_FIELD: {} })).is_err());
        assert!(matches!(
            Verdict::of(Some(m.clone()), 1, 2),
            Verdict::Repair(_)
        ));
        assert!(matches!(
            Verdict::of(Some(m.clone()), 2, 2),
            Verdict::Exhausted(_)
        ));
        let details = m.incident_details("refunds", 2);
        assert!(
            details.contains("after 2 repair turn(s) (answerRepairTurns)"),
            "{details}"
        );
        assert!(details.contains("TOOL_CALLS_IN_TEXT=parse"), "{details}");
    }

    /// The scan is bounded: a hostile answer of nested openings or of many candidates costs
    /// a bounded number of parse attempts, each at most the scanned prefix.
    #[test]
    fn a_hostile_answer_costs_a_bounded_scan() {
        let nested = format!("\"name\" {}", "{\"a\":".repeat(200_000));
        let many = format!("\"name\" {}", "{\"x\": 1} ".repeat(100_000));
        for answer in [nested, many] {
            let started = std::time::Instant::now();
            let ex = examine_text(&answer, TextToolCalls::Parse);
            assert_eq!(ex.malformed, None);
            assert!(ex.message.tool_calls.is_empty());
            assert!(started.elapsed() < std::time::Duration::from_secs(5));
        }
        // A call past the scanned prefix is not seen (and is then the answer's text).
        let late = format!(
            "{} {{\"name\": \"lookup_order\", \"arguments\": {{}}}}",
            "x".repeat(MAX_SCANNED_BYTES)
        );
        assert_eq!(examine_text(&late, TextToolCalls::Parse).malformed, None);
    }
}
