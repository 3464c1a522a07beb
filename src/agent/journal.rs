//! The journal of an agent task (protocol.md B.2): the exact step shapes written to the engine,
//! and the replay that rebuilds a run from them on every acquisition.
//!
//! Each step stores only what is new (one model answer, one tool result), so the journal grows
//! linearly with the work. Tool calls are journaled by MCP server and tool name, never by the
//! name a provider adapter showed the model, so a journal written through one provider resumes
//! on another.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::approval::{Decision, PendingRequest};
use super::definition::AgentDefinition;
use super::limits::Spent;
use crate::conversation::{AssistantMessage, Message, ToolCall, ToolResult, Usage};
use crate::engine::JournalStep;

pub(crate) const KIND_INPUT: &str = "input";
pub(crate) const KIND_MODEL: &str = "model";
pub(crate) const KIND_TOOL: &str = "tool";
pub(crate) const STATE_STARTED: &str = "started";
pub(crate) const STATE_FINISHED: &str = "finished";
/// A run-store-only kind: a call put to a person (`requested`) and their answer
/// (`decided`). Never written to the engine's journal, whose kinds protocol.md B.2 fixes.
pub(crate) const KIND_APPROVAL: &str = "approval";
pub(crate) const STATE_REQUESTED: &str = "requested";
pub(crate) const STATE_DECIDED: &str = "decided";
/// A run-store-only kind: the run was deferred (every model unavailable for
/// everyone), counted so a run is deferred at most `ABADA_AGENT_MAX_DEFERRALS_PER_RUN` times.
/// Never written to the engine's journal, whose kinds protocol.md B.2 fixes.
pub(crate) const KIND_DEFERRAL: &str = "deferral";
pub(crate) const STATE_RECORDED: &str = "recorded";
/// The judging of a final answer against the agent's `outputSchema` (`agent::judging`), in
/// every journal home: the answer's model step is journaled first, then its verdict
/// (`accepted`, or `rejected` with the repair message the model reads next); an attempt that
/// finds the answer unjudged journals `judging` before it tries again, so a judging that never
/// ends (the worker killed while validating) is counted across attempts and ends as an
/// incident instead of a crash loop. Each names its answer's step (`answerSeq`).
pub(crate) const KIND_OUTPUT: &str = "output";
pub(crate) const STATE_JUDGING: &str = "judging";
pub(crate) const STATE_ACCEPTED: &str = "accepted";
pub(crate) const STATE_REJECTED: &str = "rejected";
/// The judging gave up (passes that never finished, or a validation past its deadline): an
/// incident was raised, and the count of passes begins again for a retry.
pub(crate) const STATE_UNFINISHED: &str = "unfinished";

/// The idempotency key of a keyed write: `abada:{taskId}:{seq of its started step}`, stable
/// across attempts.
pub fn write_key(task_id: &str, started_seq: u64) -> String {
    format!("abada:{task_id}:{started_seq}")
}

/// The idempotency key of a keyed write when no journal exists (neither the engine's nor a run
/// store): `abada:{taskId}:h:{hash}:{n}`, where `hash` is the first 128 bits of SHA-256 over the
/// call's canonical content (server, tool, arguments with sorted keys, compact) in hex, and `n`
/// counts identical calls within the attempt from 1. A run that starts over after a crash and
/// sends the same write again sends it under the same key, so the tool server deduplicates
/// it; a different write (other arguments, tool or server) never shares a key. Two identical
/// writes in one run are told apart by `n` (both applied), and a rerun that makes the same
/// calls in the same order gets the same keys.
pub(crate) fn content_key(
    task_id: &str,
    server: &str,
    tool: &str,
    arguments: &Value,
    n: u32,
) -> String {
    use sha2::{Digest, Sha256};
    let content = canonical(&json!({"server": server, "tool": tool, "arguments": arguments}));
    let digest = Sha256::digest(content.as_bytes());
    let hash: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("abada:{task_id}:h:{hash}:{n}")
}

pub(crate) use super::canonical::canonical;

pub fn input_step(seq: u64, instructions: &str, input: &str) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_INPUT.into(),
        state: STATE_FINISHED.into(),
        key: None,
        data: json!({"instructions": instructions, "input": input}),
    }
}

/// The input step of a run's first attempt, stamped with when the run started (`startedAtMs`,
/// Unix milliseconds): the wall-clock deadline (`maxDurationMs`) counts from it on every attempt.
pub fn started_input_step(
    seq: u64,
    instructions: &str,
    input: &str,
    started_at: std::time::SystemTime,
) -> JournalStep {
    let mut step = input_step(seq, instructions, input);
    let ms = started_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    step.data["startedAtMs"] = json!(ms);
    step
}

/// The input step with the definition the run starts with, when it was read from the BPMN: the
/// engine serves only a process's latest version, so the journal is where a run finds its own.
pub(crate) fn with_definition(mut step: JournalStep, def: &AgentDefinition) -> JournalStep {
    if let Some(snapshot) = super::bpmn::journal_snapshot(def) {
        step.data["definition"] = snapshot;
    }
    step
}

pub fn model_step(
    seq: u64,
    model: &str,
    message: &AssistantMessage,
    usage: Usage,
    stop_reason: &str,
) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_MODEL.into(),
        state: STATE_FINISHED.into(),
        key: None,
        data: json!({
            "model": model,
            "message": message,
            "usage": usage,
            "stopReason": stop_reason,
        }),
    }
}

pub fn tool_started_step(seq: u64, key: &str, call: &ToolCall) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_TOOL.into(),
        state: STATE_STARTED.into(),
        key: Some(key.to_string()),
        data: json!({
            "callId": call.call_id,
            "server": call.server,
            "tool": call.tool,
            "arguments": call.arguments,
        }),
    }
}

pub fn tool_finished_step(
    seq: u64,
    key: Option<&str>,
    call: &ToolCall,
    result: &ToolResult,
) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_TOOL.into(),
        state: STATE_FINISHED.into(),
        key: key.map(str::to_string),
        data: json!({
            "callId": call.call_id,
            "server": call.server,
            "tool": call.tool,
            "result": result,
        }),
    }
}

/// The call waits for a person's decision under `request` (its random `requestId` and the
/// digest binding server, tool and arguments); `request.task_id` is the task that stopped for it
/// (a redelivery of that same task only repeats the request, any other task must carry the
/// decision).
pub(crate) fn approval_requested_step(seq: u64, request: &PendingRequest) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_APPROVAL.into(),
        state: STATE_REQUESTED.into(),
        key: None,
        data: json!({
            "callId": request.call_id,
            "taskId": request.task_id,
            "requestId": request.request_id,
            "callDigest": request.call_digest,
        }),
    }
}

/// A person's decision on the waiting call, journaled before it is acted on, so a crash between
/// the decision and the write performs the write (keyed) or the refusal on the next attempt. Its
/// `requestId` is consumed: no later decision naming it performs anything.
pub(crate) fn approval_decided_step(seq: u64, decision: &Decision) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_APPROVAL.into(),
        state: STATE_DECIDED.into(),
        key: None,
        data: serde_json::to_value(decision).unwrap_or_default(),
    }
}

/// The run is deferred now, for the `deferral`-th time: every model was unavailable for
/// everyone (`retryAfterMs` is what the engine was asked to wait).
pub(crate) fn deferral_step(
    seq: u64,
    deferral: u32,
    retry_after: std::time::Duration,
) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_DEFERRAL.into(),
        state: STATE_RECORDED.into(),
        key: None,
        data: json!({
            "deferral": deferral,
            "retryAfterMs": u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        }),
    }
}

/// Another pass at judging the final answer of step `answer_seq` begins (the last one did not
/// finish).
pub(crate) fn output_judging_step(seq: u64, answer_seq: u64, pass: u32) -> JournalStep {
    output_step(
        seq,
        STATE_JUDGING,
        json!({"answerSeq": answer_seq, "pass": pass}),
    )
}

/// The final answer of step `answer_seq` matches the schema: it is what the task stores.
pub(crate) fn output_accepted_step(seq: u64, answer_seq: u64) -> JournalStep {
    output_step(seq, STATE_ACCEPTED, json!({"answerSeq": answer_seq}))
}

/// The final answer of step `answer_seq` does not match: `repair` (`{"reason", "message"}`,
/// `agent::output::journal_record`) is what the model reads next.
pub(crate) fn output_rejected_step(seq: u64, answer_seq: u64, repair: Value) -> JournalStep {
    let mut data = json!({"answerSeq": answer_seq});
    if let (Value::Object(d), Value::Object(r)) = (&mut data, repair) {
        d.extend(r);
    }
    output_step(seq, STATE_REJECTED, data)
}

/// The judging of the final answer of step `answer_seq` gave up after `passes` passes begun
/// (an incident follows).
pub(crate) fn output_unfinished_step(seq: u64, answer_seq: u64, passes: u32) -> JournalStep {
    output_step(
        seq,
        STATE_UNFINISHED,
        json!({"answerSeq": answer_seq, "passes": passes}),
    )
}

fn output_step(seq: u64, state: &str, data: Value) -> JournalStep {
    JournalStep {
        seq,
        kind: KIND_OUTPUT.into(),
        state: state.into(),
        key: None,
        data,
    }
}

/// Where the judging of the final answer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Judging {
    /// The `seq` of the answer's model step.
    pub(crate) answer_seq: u64,
    /// Passes at judging it begun and not finished: one by the attempt that journaled it, one
    /// more per `output/judging` step; none again after an `output/unfinished` (an incident
    /// was raised, and a retry begins anew).
    pub(crate) passes_begun: u32,
    /// An `output/accepted` step says it matches.
    pub(crate) accepted: bool,
}

/// Where the first pending call stands with a person.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApprovalState {
    /// Put to a person; no decision yet. A request journaled by a worker before requestIds
    /// has none: it is put to a person again under a new one.
    Requested(PendingRequest),
    /// Decided on `request`.
    Decided {
        request: PendingRequest,
        decision: Decision,
    },
}

impl ApprovalState {
    pub fn call_id(&self) -> &str {
        match self {
            ApprovalState::Requested(r) => &r.call_id,
            ApprovalState::Decided { request, .. } => &request.call_id,
        }
    }
}

/// A journal that cannot be replayed: written by something that broke the contract.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "the journal cannot be replayed at step {seq}: {reason}; inspect the task's journal in the engine"
)]
pub struct ReplayError {
    pub seq: u64,
    pub reason: String,
}

/// A tool call of the last model answer that has no result yet.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingCall {
    pub call: ToolCall,
    /// Set when a `tool/started` was journaled: the write must be re-sent with this key.
    pub started_key: Option<String>,
}

/// Everything an attempt needs to continue where the last one stopped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replayed {
    /// The rendered system prompt and first user message, once journaled.
    pub input: Option<(String, String)>,
    /// The conversation after the system prompt.
    pub messages: Vec<Message>,
    /// Model answers so far (turns), across every attempt.
    pub turns: u32,
    pub usage: Usage,
    /// The `seq` the next step gets.
    pub next_seq: u64,
    /// Tool calls of the last answer still to run, in order.
    pub pending: Vec<PendingCall>,
    /// The last model answer had no tool call: this is the final answer.
    pub final_answer: Option<String>,
    /// Tool calls and keyed writes so far, across every attempt (the limits count them).
    pub spent: Spent,
    /// When the run's first attempt started (Unix ms), if its input step says so.
    pub(crate) started_at_ms: Option<u64>,
    /// The first pending call's approval, once it was put to a person.
    pub approval: Option<ApprovalState>,
    /// The definition the run started with, when it was read from the BPMN
    /// (`agent::bpmn::journal_snapshot`): a resumed run keeps it across redeployments.
    pub definition: Option<Value>,
    /// The `requestId` of every decision journaled in this run, in order: each answered its
    /// request once, and a decision naming one again performs nothing.
    pub(crate) consumed_requests: Vec<String>,
    /// How many times the run was deferred (`deferral` steps; run store only).
    pub deferrals: u32,
    /// The calls finished without a person's decision on them, in order: an approval bound
    /// holds for their total with the next call of the same tool (`agent::approval`).
    pub(crate) performed_without_approval: Vec<ToolCall>,
    /// Final answers sent back to the model as off-schema or cut (`outputRepair` on their
    /// model steps, or `output/rejected` steps): the repair turns spent (`agent::output`).
    pub(crate) output_repairs: u32,
    /// The call ids of every keyed write finished (a write, or a call a person approved) and
    /// of every call a person decided: the context window never elides their results
    /// (`agent::window`).
    pub(crate) keyed_results: std::collections::HashSet<String>,
    /// The judging of [`Self::final_answer`], when there is one.
    pub(crate) judging: Option<Judging>,
    /// Answers sent back to the model as malformed (`answerRepair` on their model steps: a tool
    /// call written as text, an empty answer, a repeated call): the repair turns spent
    /// (`agent::answer_shape`).
    pub(crate) answer_repairs: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InputData {
    #[serde(default)]
    instructions: String,
    input: String,
    #[serde(default)]
    started_at_ms: Option<u64>,
    #[serde(default)]
    definition: Option<Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModelData {
    message: AssistantMessage,
    #[serde(default)]
    usage: Usage,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolData {
    call_id: String,
    #[serde(default)]
    server: String,
    tool: String,
    #[serde(default)]
    arguments: Option<Value>,
    #[serde(default)]
    result: Option<ToolResult>,
}

impl Replayed {
    /// A run with nothing journaled yet.
    pub fn empty() -> Self {
        Replayed {
            next_seq: 1,
            ..Default::default()
        }
    }

    /// Rebuilds the run from the steps (in any order; sorted by `seq` here).
    pub(crate) fn from_steps(steps: &[JournalStep]) -> Result<Self, ReplayError> {
        let mut sorted: Vec<&JournalStep> = steps.iter().collect();
        sorted.sort_by_key(|s| s.seq);
        let mut r = Replayed::empty();
        for step in sorted {
            r.apply(step)?;
        }
        Ok(r)
    }

    /// Adds one step: a step read back from the engine, or one this attempt just journaled.
    /// On error the state is unchanged.
    pub fn apply(&mut self, step: &JournalStep) -> Result<(), ReplayError> {
        let err = |reason: String| ReplayError {
            seq: step.seq,
            reason,
        };
        if step.seq != self.next_seq {
            return Err(err(format!(
                "expected seq {}, found {}",
                self.next_seq, step.seq
            )));
        }
        match (step.kind.as_str(), step.state.as_str()) {
            (KIND_INPUT, STATE_FINISHED) => {
                if self.input.is_some() {
                    return Err(err("a second input step".into()));
                }
                let d: InputData = serde_json::from_value(step.data.clone())
                    .map_err(|e| err(format!("input data: {e}")))?;
                self.messages.push(Message::User {
                    text: d.input.clone(),
                });
                self.input = Some((d.instructions, d.input));
                self.started_at_ms = d.started_at_ms;
                self.definition = d.definition;
            }
            (KIND_MODEL, STATE_FINISHED) => {
                if self.input.is_none() {
                    return Err(err("a model step before the input step".into()));
                }
                if let Some(p) = self.pending.first() {
                    return Err(err(format!(
                        "a model step while tool call {} has no result",
                        p.call.call_id
                    )));
                }
                let d: ModelData = serde_json::from_value(step.data.clone())
                    .map_err(|e| err(format!("model data: {e}")))?;
                // A final answer the worker rejected (off-schema, cut) is no final answer: the
                // model read what was wrong next, as the user's word.
                let repair = super::output::journaled_repair(&step.data).map_err(err)?;
                if repair.is_some() && !d.message.tool_calls.is_empty() {
                    return Err(err("an output repair on an answer with tool calls".into()));
                }
                // [answer shape] An answer sent back as malformed (a tool call written as text,
                // an empty answer, a repeated call) is no final answer either; the model read its
                // repair message next, or its calls' results told it.
                let shape_repair =
                    super::answer_shape::journaled_repair(&step.data).map_err(err)?;
                self.turns = self.turns.saturating_add(1);
                self.usage += d.usage;
                let calls = u32::try_from(d.message.tool_calls.len()).unwrap_or(u32::MAX);
                self.spent.tool_calls = self.spent.tool_calls.saturating_add(calls);
                self.pending = d
                    .message
                    .tool_calls
                    .iter()
                    .map(|c| PendingCall {
                        call: c.clone(),
                        started_key: None,
                    })
                    .collect();
                let final_answer = d.message.tool_calls.is_empty();
                self.final_answer = if final_answer && repair.is_none() && shape_repair.is_none() {
                    Some(d.message.text.clone().unwrap_or_default())
                } else {
                    None
                };
                self.judging = self.final_answer.as_ref().map(|_| Judging {
                    answer_seq: step.seq,
                    passes_begun: 1,
                    accepted: false,
                });
                self.messages.push(Message::Assistant(d.message));
                if let Some(shape) = shape_repair {
                    self.answer_repairs = self.answer_repairs.saturating_add(1);
                    if let Some(text) = shape.message.filter(|_| final_answer) {
                        self.messages.push(Message::User { text });
                    }
                }
                if let Some(repair) = repair {
                    self.output_repairs = self.output_repairs.saturating_add(1);
                    self.messages.push(Message::User {
                        text: repair.message,
                    });
                }
            }
            (KIND_TOOL, state @ (STATE_STARTED | STATE_FINISHED)) => {
                let d: ToolData = serde_json::from_value(step.data.clone())
                    .map_err(|e| err(format!("tool data: {e}")))?;
                // Calls run in order: the step is about the first pending call.
                let Some(first) = self.pending.first() else {
                    return Err(err(format!(
                        "tool call {} answers no model step",
                        d.call_id
                    )));
                };
                if first.call.call_id != d.call_id {
                    return Err(err(format!(
                        "tool call {} is not the next pending call ({})",
                        d.call_id, first.call.call_id
                    )));
                }
                if state == STATE_STARTED {
                    let key = step
                        .key
                        .clone()
                        .ok_or_else(|| err("a started tool step without a key".into()))?;
                    self.pending[0].started_key = Some(key);
                    self.spent.keyed_writes = self.spent.keyed_writes.saturating_add(1);
                } else {
                    let result = d
                        .result
                        .ok_or_else(|| err("a finished tool step without a result".into()))?;
                    let done = self.pending.remove(0);
                    // A refusal is kept too: its stub would say the call was performed.
                    if done.started_key.is_some()
                        || matches!(self.approval, Some(ApprovalState::Decided { .. }))
                    {
                        self.keyed_results.insert(done.call.call_id.clone());
                    }
                    if self.approval.is_none() {
                        self.performed_without_approval.push(done.call.clone());
                    }
                    self.approval = None;
                    self.messages.push(Message::ToolResult {
                        call: done.call,
                        result,
                    });
                }
            }
            (KIND_APPROVAL, state @ (STATE_REQUESTED | STATE_DECIDED)) => {
                let next = self.approval_step(state, &step.data).map_err(err)?;
                if let ApprovalState::Decided { decision, .. } = &next
                    && !decision.request_id.is_empty()
                {
                    self.consumed_requests.push(decision.request_id.clone());
                }
                self.approval = Some(next);
            }
            (
                KIND_OUTPUT,
                state @ (STATE_JUDGING | STATE_ACCEPTED | STATE_REJECTED | STATE_UNFINISHED),
            ) => {
                self.output_step(state, &step.data).map_err(err)?;
            }
            (KIND_DEFERRAL, STATE_RECORDED) => {
                if self.input.is_none() {
                    return Err(err("a deferral before the input step".into()));
                }
                self.deferrals = self.deferrals.saturating_add(1);
            }
            (kind, state) => {
                return Err(err(format!("unknown step kind/state {kind}/{state}")));
            }
        }
        self.next_seq += 1;
        Ok(())
    }

    /// An `output` step about the final answer: it names the answer's step, and comes while
    /// the answer is unjudged.
    fn output_step(&mut self, state: &str, data: &Value) -> Result<(), String> {
        let named = data.get("answerSeq").and_then(Value::as_u64);
        let judging = match &mut self.judging {
            Some(j) if Some(j.answer_seq) == named && !j.accepted => j,
            _ => {
                return Err(format!(
                    "an output/{state} step about step {named:?}, which is no final answer awaiting its verdict"
                ));
            }
        };
        match state {
            STATE_JUDGING => judging.passes_begun = judging.passes_begun.saturating_add(1),
            STATE_ACCEPTED => judging.accepted = true,
            STATE_UNFINISHED => judging.passes_begun = 0,
            _ => {
                let message = data
                    .get("message")
                    .and_then(Value::as_str)
                    .ok_or("an output/rejected step without a message")?;
                // The answer is no final answer: the model read what was wrong next.
                self.final_answer = None;
                self.judging = None;
                self.output_repairs = self.output_repairs.saturating_add(1);
                self.messages.push(Message::User {
                    text: message.to_string(),
                });
            }
        }
        Ok(())
    }

    /// The approval state after an `approval` step about the first pending call: a request
    /// comes first and once, a decision once after it.
    fn approval_step(&self, state: &str, data: &Value) -> Result<ApprovalState, String> {
        let call_id = data
            .get("callId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let Some(first) = self.pending.first() else {
            return Err(format!("approval of call {call_id} answers no model step"));
        };
        if first.call.call_id != call_id {
            return Err(format!(
                "approval of call {call_id} is not about the next pending call ({})",
                first.call.call_id
            ));
        }
        // A request without a requestId (journaled by an older worker) is superseded by one
        // with it: the decision must answer a request nobody could have guessed.
        let may_request = match &self.approval {
            None => true,
            Some(ApprovalState::Requested(r)) => r.request_id.is_none(),
            Some(ApprovalState::Decided { .. }) => false,
        };
        match (state, &self.approval) {
            (STATE_REQUESTED, _) if may_request => {
                let text = |field: &str| {
                    data.get(field)
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                };
                Ok(ApprovalState::Requested(PendingRequest {
                    call_id: call_id.to_string(),
                    task_id: text("taskId").unwrap_or_default(),
                    request_id: text("requestId"),
                    call_digest: text("callDigest"),
                }))
            }
            (STATE_DECIDED, Some(ApprovalState::Requested(request))) => {
                let decision: Decision = serde_json::from_value(data.clone())
                    .map_err(|e| format!("approval decision data: {e}"))?;
                if let Some(asked) = &request.request_id
                    && *asked != decision.request_id
                {
                    return Err(format!(
                        "the decision on call {call_id} answers another request than the one journaled"
                    ));
                }
                Ok(ApprovalState::Decided {
                    request: request.clone(),
                    decision,
                })
            }
            (state, _) => Err(format!(
                "an approval step {state} out of order for call {call_id}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_keys_are_told_from_journal_keys_by_the_span_recorder() {
        let args = json!({"orderId": "o-1", "amountCents": 1500});
        for task in ["t1", "a:b", "x:h:0"] {
            let key = content_key(task, "orders", "refund", &args, 2);
            assert!(crate::telemetry::spans::is_content_key(&key), "{key}");
            assert!(!crate::telemetry::spans::is_content_key(&write_key(
                task, 5
            )));
        }
        assert!(!crate::telemetry::spans::is_content_key("abada:t1:h:abc:1"));
        assert!(!crate::telemetry::spans::is_content_key(
            "abada:t1:h:00112233445566778899aabbccddeeff:"
        ));
    }

    fn call(id: &str, tool: &str) -> ToolCall {
        ToolCall {
            call_id: id.into(),
            server: "orders".into(),
            tool: tool.into(),
            arguments: json!({"orderId": "o-1"}),
        }
    }

    fn answer(calls: Vec<ToolCall>, text: Option<&str>) -> AssistantMessage {
        AssistantMessage {
            text: text.map(str::to_string),
            tool_calls: calls,
        }
    }

    fn ok_result(text: &str) -> ToolResult {
        ToolResult {
            content: vec![json!({"type": "text", "text": text})],
            structured_content: None,
            is_error: false,
        }
    }

    /// A final answer journaled before it is judged: its passes are counted across attempts
    /// (`output/judging`), a verdict settles it (`accepted`: the answer stands; `rejected`: the
    /// repair message is the next user turn), an `unfinished` one begins the count again, and
    /// an output step about anything but the awaited answer breaks the contract.
    #[test]
    fn output_steps_count_the_passes_and_settle_the_final_answer() {
        let base = |text: &str| {
            vec![
                input_step(1, "i", "x"),
                model_step(
                    2,
                    "p/m",
                    &answer(vec![], Some(text)),
                    Usage::default(),
                    "stop",
                ),
            ]
        };
        let r = Replayed::from_steps(&base("{}")).unwrap();
        assert_eq!(r.final_answer.as_deref(), Some("{}"));
        let fresh = Judging {
            answer_seq: 2,
            passes_begun: 1,
            accepted: false,
        };
        assert_eq!(r.judging, Some(fresh.clone()));

        let mut again = base("{}");
        again.push(output_judging_step(3, 2, 2));
        let r = Replayed::from_steps(&again).unwrap();
        assert_eq!(r.judging.as_ref().unwrap().passes_begun, 2);
        again.push(output_unfinished_step(4, 2, 2));
        let r = Replayed::from_steps(&again).unwrap();
        assert_eq!(r.judging.as_ref().unwrap().passes_begun, 0);
        assert_eq!(r.final_answer.as_deref(), Some("{}"), "still the answer");

        let mut accepted = base("{}");
        accepted.push(output_accepted_step(3, 2));
        let r = Replayed::from_steps(&accepted).unwrap();
        assert!(r.judging.unwrap().accepted);
        assert_eq!(r.final_answer.as_deref(), Some("{}"));
        assert_eq!(r.next_seq, 4);

        let mut rejected = base("nope");
        rejected.push(output_rejected_step(
            3,
            2,
            json!({"reason": "schema", "message": "fix it"}),
        ));
        let r = Replayed::from_steps(&rejected).unwrap();
        assert_eq!(r.final_answer, None);
        assert_eq!(r.judging, None);
        assert_eq!(r.output_repairs, 1);
        assert_eq!(
            r.messages.last(),
            Some(&Message::User {
                text: "fix it".into()
            })
        );

        // Out of order: about another step, after the verdict, or with no final answer.
        for steps in [
            [base("{}"), vec![output_accepted_step(3, 1)]].concat(),
            [accepted.clone(), vec![output_judging_step(4, 2, 2)]].concat(),
            vec![input_step(1, "i", "x"), output_judging_step(2, 1, 2)],
        ] {
            let e = Replayed::from_steps(&steps).unwrap_err();
            assert!(e.reason.contains("no final answer awaiting"), "{e}");
        }
        let e = Replayed::from_steps(
            &[
                base("x"),
                vec![output_step(3, STATE_REJECTED, json!({"answerSeq": 2}))],
            ]
            .concat(),
        )
        .unwrap_err();
        assert!(e.reason.contains("without a message"), "{e}");
    }

    #[test]
    fn steps_have_the_documented_shapes() {
        let s = model_step(
            2,
            "openai/gpt",
            &answer(vec![call("c1", "lookup")], None),
            Usage {
                input_tokens: 10,
                output_tokens: 3,
            },
            "tool_calls",
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["kind"], "model");
        assert_eq!(v["state"], "finished");
        assert!(v.get("key").is_none());
        assert_eq!(v["data"]["model"], "openai/gpt");
        assert_eq!(v["data"]["message"]["toolCalls"][0]["callId"], "c1");
        assert_eq!(v["data"]["message"]["toolCalls"][0]["server"], "orders");
        assert_eq!(v["data"]["message"]["text"], Value::Null);
        assert_eq!(v["data"]["usage"]["inputTokens"], 10);
        assert_eq!(v["data"]["stopReason"], "tool_calls");
        let st = tool_started_step(3, "abada:t1:3", &call("c1", "refund"));
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(v["key"], "abada:t1:3");
        assert_eq!(v["data"]["arguments"]["orderId"], "o-1");
        let fin = tool_finished_step(
            4,
            Some("abada:t1:3"),
            &call("c1", "refund"),
            &ok_result("done"),
        );
        let v = serde_json::to_value(&fin).unwrap();
        assert_eq!(v["data"]["result"]["isError"], false);
        assert_eq!(v["data"]["result"]["content"][0]["text"], "done");
        assert_eq!(v["data"]["result"]["structuredContent"], Value::Null);
        assert_eq!(write_key("t1", 3), "abada:t1:3");
    }

    #[test]
    fn content_keys_follow_the_content_not_its_spelling() {
        let a = json!({"orderId": "o-1", "amountCents": 1500, "lines": [{"b": 1, "a": 2}]});
        let same: Value =
            serde_json::from_str(r#"{"lines":[{"a":2,"b":1}],"amountCents":1500,"orderId":"o-1"}"#)
                .unwrap();
        let key = content_key("t1", "orders", "issue_refund", &a, 1);
        assert!(
            key.starts_with("abada:t1:h:") && key.ends_with(":1"),
            "{key}"
        );
        assert_eq!(key.len(), "abada:t1:h:".len() + 32 + 2);
        assert_eq!(key, content_key("t1", "orders", "issue_refund", &same, 1));
        let other_amount =
            json!({"orderId": "o-1", "amountCents": 1501, "lines": [{"b": 1, "a": 2}]});
        for other in [
            content_key("t1", "orders", "issue_refund", &other_amount, 1),
            content_key("t1", "orders", "issue_credit", &a, 1),
            content_key("t1", "billing", "issue_refund", &a, 1),
            content_key("t2", "orders", "issue_refund", &a, 1),
            content_key("t1", "orders", "issue_refund", &a, 2),
        ] {
            assert_ne!(key, other);
        }
        // Fixed: a rerun by another build of the worker must find the same key.
        assert_eq!(
            content_key("t1", "s", "t", &json!({}), 1),
            content_key("t1", "s", "t", &json!({}), 1)
        );
        assert_eq!(
            canonical(&json!({"b": [1, {"d": null, "c": "x"}], "a": 1.5})),
            r#"{"a":1.5,"b":[1,{"c":"x","d":null}]}"#
        );
    }

    #[test]
    fn replay_rebuilds_conversation_turns_usage_and_what_is_left_to_do() {
        let u = Usage {
            input_tokens: 100,
            output_tokens: 20,
        };
        let steps = vec![
            input_step(1, "sys", "hello"),
            model_step(
                2,
                "p/m",
                &answer(vec![call("c1", "lookup"), call("c2", "refund")], None),
                u,
                "tool_calls",
            ),
            tool_finished_step(3, None, &call("c1", "lookup"), &ok_result("order o-1")),
            tool_started_step(4, "abada:t:4", &call("c2", "refund")),
        ];
        let r = Replayed::from_steps(&steps).unwrap();
        assert_eq!(r.turns, 1);
        assert_eq!(r.usage, u);
        assert_eq!(r.next_seq, 5);
        assert_eq!(r.messages.len(), 3);
        assert_eq!(r.pending.len(), 1);
        assert_eq!(r.pending[0].call.call_id, "c2");
        assert_eq!(r.pending[0].started_key.as_deref(), Some("abada:t:4"));
        assert!(r.final_answer.is_none());
        assert_eq!(
            r.spent,
            Spent {
                tool_calls: 2,
                keyed_writes: 1
            }
        );
        assert_eq!(r.started_at_ms, None);
        let stamped = started_input_step(
            1,
            "s",
            "i",
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(1234),
        );
        let r = Replayed::from_steps(&[stamped]).unwrap();
        assert_eq!(r.started_at_ms, Some(1234));

        let mut steps = steps;
        steps.push(tool_finished_step(
            5,
            Some("abada:t:4"),
            &call("c2", "refund"),
            &ok_result("refunded"),
        ));
        steps.push(model_step(
            6,
            "q/n",
            &answer(vec![], Some("{\"ok\":true}")),
            u,
            "stop",
        ));
        let r = Replayed::from_steps(&steps).unwrap();
        assert_eq!(r.turns, 2);
        assert_eq!(r.usage.total(), 240);
        assert!(r.pending.is_empty());
        assert_eq!(r.final_answer.as_deref(), Some("{\"ok\":true}"));
    }

    #[test]
    fn deferral_steps_are_counted_across_the_run_and_change_nothing_else() {
        let d = deferral_step(2, 1, std::time::Duration::from_millis(1500));
        assert_eq!(
            (d.kind.as_str(), d.state.as_str()),
            ("deferral", "recorded")
        );
        assert_eq!(d.data, json!({"deferral": 1, "retryAfterMs": 1500}));
        let steps = vec![
            input_step(1, "s", "i"),
            deferral_step(2, 1, std::time::Duration::from_secs(1)),
            deferral_step(3, 2, std::time::Duration::from_secs(1)),
            model_step(
                4,
                "q/n",
                &answer(vec![], Some("done")),
                Usage::default(),
                "stop",
            ),
        ];
        let r = Replayed::from_steps(&steps).unwrap();
        assert_eq!(r.deferrals, 2);
        assert_eq!(r.turns, 1);
        assert_eq!(r.next_seq, 5);
        assert_eq!(r.final_answer.as_deref(), Some("done"));
        // Before the input step, a deferral is a journal that broke the contract.
        let err = Replayed::from_steps(&[deferral_step(1, 1, Default::default())]).unwrap_err();
        assert!(err.reason.contains("before the input step"), "{err}");
    }

    #[test]
    fn approval_steps_replay_in_order_and_out_of_order_ones_are_refused() {
        let refund = call("c2", "issue_refund");
        let request = PendingRequest::new(&refund, "t-1", &crate::random::Random::os());
        let steps = vec![
            input_step(1, "sys", "o-1"),
            model_step(
                2,
                "p/m",
                &answer(vec![refund.clone()], Some("Refund?")),
                Usage::default(),
                "tool_use",
            ),
            approval_requested_step(3, &request),
        ];
        let v = serde_json::to_value(&steps[2]).unwrap();
        assert_eq!(v["data"]["requestId"], json!(request.request_id));
        assert_eq!(
            v["data"]["callDigest"],
            json!(crate::agent::approval::call_digest(&refund))
        );
        let r = Replayed::from_steps(&steps).unwrap();
        assert_eq!(r.approval, Some(ApprovalState::Requested(request.clone())));
        assert!(r.consumed_requests.is_empty());
        let decision = Decision {
            request_id: request.request_id.clone().unwrap(),
            call_id: "c2".into(),
            approved: false,
            comment: Some("no".into()),
            decided_by: "dana".into(),
            engine_actor: Some("dana".into()),
        };
        let mut decided = steps.clone();
        decided.push(approval_decided_step(4, &decision));
        let v = serde_json::to_value(&decided[3]).unwrap();
        assert_eq!(
            v["data"]["requestId"],
            json!(request.request_id),
            "the consumption is journaled"
        );
        let r = Replayed::from_steps(&decided).unwrap();
        assert_eq!(
            r.approval,
            Some(ApprovalState::Decided {
                request: request.clone(),
                decision: decision.clone()
            })
        );
        assert_eq!(r.consumed_requests, vec![decision.request_id.clone()]);
        assert_eq!(r.pending.len(), 1, "the call still waits for its result");
        // Its result ends the approval, not the consumption; a decision without a request, or
        // twice, is refused.
        decided.push(tool_finished_step(5, None, &refund, &ok_result("refused")));
        let r = Replayed::from_steps(&decided).unwrap();
        assert_eq!((r.approval, r.pending.len()), (None, 0));
        assert_eq!(r.consumed_requests, vec![decision.request_id.clone()]);
        let mut early = steps[..2].to_vec();
        early.push(approval_decided_step(3, &decision));
        assert!(Replayed::from_steps(&early).is_err());
        let mut twice = steps.clone();
        twice.push(approval_requested_step(4, &request));
        assert!(Replayed::from_steps(&twice).is_err());
        let mut other = steps[..2].to_vec();
        other.push(approval_requested_step(
            3,
            &PendingRequest::new(
                &call("c9", "issue_refund"),
                "t-1",
                &crate::random::Random::os(),
            ),
        ));
        assert!(Replayed::from_steps(&other).is_err());
        // A decided step answering another request than the journaled one is refused.
        let mut foreign = steps.clone();
        foreign.push(approval_decided_step(
            4,
            &Decision {
                request_id: "another".into(),
                ..decision.clone()
            },
        ));
        let e = Replayed::from_steps(&foreign).unwrap_err();
        assert!(e.reason.contains("another request"), "{e}");
    }

    /// A run waiting at the upgrade: its request (journaled by a worker before requestIds) has
    /// no id and no digest; a new request with them supersedes it, and only that one can be
    /// decided.
    #[test]
    fn a_request_without_a_request_id_is_superseded_by_one_with_it() {
        let refund = call("c2", "issue_refund");
        let mut legacy = approval_requested_step(
            3,
            &PendingRequest::new(&refund, "t-1", &crate::random::Random::os()),
        );
        legacy.data = json!({"callId": "c2", "taskId": "t-1"});
        let steps = vec![
            input_step(1, "sys", "o-1"),
            model_step(
                2,
                "p/m",
                &answer(vec![refund.clone()], None),
                Usage::default(),
                "tool_use",
            ),
            legacy,
        ];
        let r = Replayed::from_steps(&steps).unwrap();
        assert!(
            matches!(&r.approval, Some(ApprovalState::Requested(p)) if p.request_id.is_none() && p.call_digest.is_none())
        );
        let fresh = PendingRequest::new(&refund, "t-2", &crate::random::Random::os());
        let mut again = steps.clone();
        again.push(approval_requested_step(4, &fresh));
        let r = Replayed::from_steps(&again).unwrap();
        assert_eq!(r.approval, Some(ApprovalState::Requested(fresh.clone())));
        // A decision journaled by an older worker (no requestId) still replays.
        let mut old_decision = steps.clone();
        old_decision.push(JournalStep {
            seq: 4,
            kind: KIND_APPROVAL.into(),
            state: STATE_DECIDED.into(),
            key: None,
            data: json!({"callId": "c2", "approved": true, "decidedBy": "dana"}),
        });
        let r = Replayed::from_steps(&old_decision).unwrap();
        assert!(matches!(r.approval, Some(ApprovalState::Decided { .. })));
        assert!(r.consumed_requests.is_empty());
    }

    #[test]
    fn a_rejected_final_answer_replays_as_a_repair_turn_not_a_final_answer() {
        use crate::agent::output::{self, RejectReason, Rejection};
        let rejection = Rejection {
            reason: RejectReason::Schema,
            location: Some("instance /decision, schema /properties/decision/enum".into()),
            detail: "at /decision: \"maybe\" is not one of [\"refund\"]".into(),
        };
        let mut rejected = model_step(
            2,
            "p/m",
            &answer(vec![], Some("{\"decision\": \"maybe\"}")),
            Usage::default(),
            "stop",
        );
        rejected.data[output::JOURNAL_FIELD] = output::journal_record(&rejection);
        let steps = vec![input_step(1, "sys", "o-1"), rejected.clone()];
        let r = Replayed::from_steps(&steps).unwrap();
        assert_eq!(r.final_answer, None, "a rejected answer is never final");
        assert_eq!(r.output_repairs, 1);
        assert_eq!(r.turns, 1);
        assert_eq!(
            r.messages.last(),
            Some(&Message::User {
                text: rejection.repair_message()
            })
        );
        let mut done = steps.clone();
        done.push(model_step(
            3,
            "p/m",
            &answer(vec![], Some("{\"decision\": \"refund\"}")),
            Usage::default(),
            "stop",
        ));
        let r = Replayed::from_steps(&done).unwrap();
        assert_eq!(
            r.final_answer.as_deref(),
            Some("{\"decision\": \"refund\"}")
        );
        assert_eq!(r.output_repairs, 1);
        // A repair on an answer with tool calls, or without its message, breaks the contract;
        // the state is unchanged on the refusal.
        let mut with_calls = rejected.clone();
        with_calls.data["message"]["toolCalls"] = json!([call("c1", "lookup")]);
        let mut state = Replayed::from_steps(&steps[..1]).unwrap();
        let before = state.clone();
        assert!(
            state
                .apply(&with_calls)
                .unwrap_err()
                .reason
                .contains("tool calls")
        );
        assert_eq!(state, before);
        let mut no_message = rejected;
        no_message.data[output::JOURNAL_FIELD] = json!({"reason": "schema"});
        assert!(state.apply(&no_message).is_err());
        assert_eq!(state, before);
    }

    #[test]
    fn broken_journals_are_refused_with_the_step() {
        let bad = |steps: Vec<JournalStep>| Replayed::from_steps(&steps).unwrap_err();
        assert_eq!(bad(vec![input_step(2, "s", "i")]).seq, 2);
        assert!(
            bad(vec![model_step(
                1,
                "p/m",
                &answer(vec![], Some("x")),
                Usage::default(),
                "stop"
            )])
            .reason
            .contains("before the input")
        );
        let e = bad(vec![
            input_step(1, "s", "i"),
            model_step(
                2,
                "p/m",
                &answer(vec![call("c1", "a")], None),
                Usage::default(),
                "tool_calls",
            ),
            tool_finished_step(3, None, &call("zz", "a"), &ok_result("x")),
        ]);
        assert!(e.reason.contains("not the next pending call"));
        let mut odd = input_step(1, "s", "i");
        odd.kind = "mystery".into();
        assert!(bad(vec![odd]).reason.contains("unknown step"));
        let mut garbled = input_step(1, "s", "i");
        garbled.data = json!(42);
        assert!(bad(vec![garbled]).reason.contains("input data"));
    }
}
