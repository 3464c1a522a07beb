//! Approval of tool calls by a person (issue 14), the pure part (the stop and the resume are
//! `run::Attempt::approval_gate`, the journal steps `journal::approval_*_step`): which calls need approval
//! ([`ApprovalPolicy`], [`ApprovalRules`]), the process variables that carry the question and
//! the answer ([`ApprovalVariables`]), the request the worker completes with
//! ([`approval_request`]), the decision it resumes with ([`read_decision`]), and the tool result
//! a refusal becomes ([`refusal_result`]).
//!
//! The flow around it: when the model asks for a call that needs approval and no decision
//! exists, the worker performs nothing, journals the pending call and completes the task with
//! `agentStatus = "approval-required"` and the request; the process routes it to a user task; the
//! person's decision comes back on a new task of the same node, whose run is found by its run
//! key (`run_key`). Approved: the call is performed like any keyed write. Refused: the model
//! reads a tool result saying who refused and why.

use serde_json::{Map, Value, json};

use crate::conversation::{ToolCall, ToolResult, ToolSpec};

/// The definition's default variable names.
pub const DEFAULT_STATUS_VARIABLE: &str = "agentStatus";
pub const DEFAULT_REQUEST_VARIABLE: &str = "agentApprovalRequest";
pub const DEFAULT_DECISION_VARIABLE: &str = "agentApproval";
/// `agentStatus` of a task that stops for a person's decision.
pub const STATUS_APPROVAL_REQUIRED: &str = "approval-required";
/// `agentStatus` of a task that ended with a final answer.
pub const STATUS_DONE: &str = "done";

/// Bounds on what a person typed: a decision is read from process variables anyone with the
/// task list can write, so it is bounded like every outside input.
const MAX_COMMENT_CHARS: usize = 4096;
const MAX_NAME_CHARS: usize = 256;
const MAX_CALL_ID_CHARS: usize = 256;

/// Which calls need a person's approval: `"never"`, `"writes"`, `"always"`, or a list of tool
/// names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ApprovalPolicy {
    #[default]
    Never,
    /// Every tool not annotated `readOnlyHint: true`, and every tool annotated
    /// `destructiveHint: true` (even one that also claims to be read-only: the stricter hint wins).
    Writes,
    Always,
    /// These tool names, on any server of the definition.
    Tools(Vec<String>),
}

impl ApprovalPolicy {
    /// Parses `"never" | "writes" | "always" | ["tool", ...]`; the error says what is allowed.
    pub fn from_value(value: &Value) -> Result<Self, String> {
        match value {
            Value::String(s) => match s.as_str() {
                "never" => Ok(ApprovalPolicy::Never),
                "writes" => Ok(ApprovalPolicy::Writes),
                "always" => Ok(ApprovalPolicy::Always),
                other => Err(format!(
                    "approval {other:?} is not one of \"never\", \"writes\", \"always\" or a list of tool names"
                )),
            },
            Value::Array(items) => {
                let mut tools = Vec::with_capacity(items.len());
                for item in items {
                    match item.as_str().map(str::trim) {
                        Some(name) if !name.is_empty() => tools.push(name.to_string()),
                        _ => {
                            return Err(format!(
                                "approval lists {item}, which is not a tool name (a non-empty string)"
                            ));
                        }
                    }
                }
                Ok(ApprovalPolicy::Tools(tools))
            }
            other => Err(format!(
                "approval is {other}; use \"never\", \"writes\", \"always\" or a list of tool names"
            )),
        }
    }

    /// Whether a call of `spec` needs approval under this policy alone.
    pub fn covers(&self, spec: &ToolSpec) -> bool {
        match self {
            ApprovalPolicy::Never => false,
            ApprovalPolicy::Always => true,
            ApprovalPolicy::Writes => !spec.read_only || spec.destructive,
            ApprovalPolicy::Tools(names) => names.contains(&spec.tool),
        }
    }
}

/// The policies that apply to one agent: its definition's, and each tool server's in the
/// operator's registry. A call needs approval when either says so: the operator can require
/// approval for a server whatever a definition (possibly sent by the engine) asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApprovalRules {
    pub definition: ApprovalPolicy,
    /// By server name. Filled from the tool-server registry (`ABADA_AGENT_TOOLS_FILE`, per
    /// server `approval = ...`) once it exists; empty until then.
    pub servers: Vec<(String, ApprovalPolicy)>,
}

impl ApprovalRules {
    pub fn needs_approval(&self, spec: &ToolSpec) -> bool {
        self.definition.covers(spec)
            || self
                .servers
                .iter()
                .any(|(server, policy)| *server == spec.server && policy.covers(spec))
    }

    /// Whether any call could ever need approval (a definition that cannot stop needs no run
    /// store to wait in).
    pub fn may_stop(&self) -> bool {
        self.definition != ApprovalPolicy::Never
            || self
                .servers
                .iter()
                .any(|(_, p)| *p != ApprovalPolicy::Never)
    }
}

/// The process variables of the approval flow, named per definition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApprovalVariables {
    /// `"approval-required"` or `"done"`; the gateway routes on it. Always written, because the
    /// engine keeps a stale value from the last completion.
    pub status: String,
    /// The question for the person: `{callId, server, tool, arguments, summary, runKey}`.
    pub request: String,
    /// The person's answer: `{callId, approved, comment, decidedBy}`.
    pub decision: String,
}

impl Default for ApprovalVariables {
    fn default() -> Self {
        ApprovalVariables {
            status: DEFAULT_STATUS_VARIABLE.into(),
            request: DEFAULT_REQUEST_VARIABLE.into(),
            decision: DEFAULT_DECISION_VARIABLE.into(),
        }
    }
}

/// A definition that may stop for approval on a worker where the conversation has nowhere to
/// wait. The conversation must outlive the task (the decision arrives on a new task, maybe on
/// another replica, maybe days later), and the only place meant for that is the run store,
/// keyed by the run key; the engine's journal is per task, and carrying the conversation in
/// process variables would put it in every listing of the user task. Without a store such a
/// definition is refused before anything is performed: an incident an operator sees at once,
/// not a write done without approval.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "agent {agent:?} asks for approval of tool calls, but a conversation can only wait for a person's decision in the run store, and this worker runs agents without one; nothing was performed. Set approval = \"never\" for this agent, or run it on a worker that keeps agent runs in the run store (ABADA_AGENT_STORE_URL)"
)]
pub struct NoWaitingPlace {
    pub agent: String,
}

/// The value of the request variable: what a person needs to decide. `summary` is the model's
/// own text of the turn that asked for the call.
pub fn approval_request(call: &ToolCall, summary: Option<&str>, run_key: &str) -> Value {
    json!({
        "callId": call.call_id,
        "server": call.server,
        "tool": call.tool,
        "arguments": call.arguments,
        "summary": summary.unwrap_or_default(),
        "runKey": run_key,
    })
}

/// A person's decision on one pending call (also its journal step's data).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    pub call_id: String,
    pub approved: bool,
    #[serde(default)]
    pub comment: Option<String>,
    pub decided_by: String,
}

/// A decision that cannot be used: the task becomes an incident naming the variable, so an
/// operator can fix the variable and retry.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecisionError {
    #[error(
        "call {call_id} waits for approval, but the process variable {variable:?} is missing; the user task must set {variable} = {{callId, approved, comment, decidedBy}}"
    )]
    Missing { variable: String, call_id: String },
    #[error(
        "the process variable {variable:?} is malformed: {reason}; expected {{\"callId\": string, \"approved\": true|false, \"comment\": string or null, \"decidedBy\": string}}"
    )]
    Malformed { variable: String, reason: String },
    #[error(
        "the process variable {variable:?} decides call {found:?}, but the call waiting for approval is {expected:?}; nothing was performed"
    )]
    OtherCall {
        variable: String,
        expected: String,
        found: String,
    },
}

/// The decision on `pending_call_id` in `variables[name]`, validated.
pub fn read_decision(
    variables: &Map<String, Value>,
    name: &str,
    pending_call_id: &str,
) -> Result<Decision, DecisionError> {
    let malformed = |reason: String| DecisionError::Malformed {
        variable: name.to_string(),
        reason,
    };
    let value = match variables.get(name) {
        None | Some(Value::Null) => {
            return Err(DecisionError::Missing {
                variable: name.to_string(),
                call_id: pending_call_id.to_string(),
            });
        }
        Some(v) => v,
    };
    let object = value
        .as_object()
        .ok_or_else(|| malformed(format!("it is {}, not an object", kind(value))))?;
    let text = |field: &str, max: usize, required: bool| -> Result<Option<String>, DecisionError> {
        match object.get(field) {
            None | Some(Value::Null) if !required => Ok(None),
            Some(Value::String(s)) if !s.trim().is_empty() || !required => {
                if s.chars().count() > max {
                    return Err(malformed(format!(
                        "{field} is longer than {max} characters"
                    )));
                }
                Ok(Some(s.clone()))
            }
            None | Some(Value::Null) => Err(malformed(format!("{field} is missing"))),
            Some(v) => Err(malformed(format!(
                "{field} is {}, not a non-empty string",
                kind(v)
            ))),
        }
    };
    let call_id = text("callId", MAX_CALL_ID_CHARS, true)?.unwrap_or_default();
    let approved = match object.get("approved") {
        Some(Value::Bool(b)) => *b,
        None | Some(Value::Null) => return Err(malformed("approved is missing".into())),
        Some(v) => {
            return Err(malformed(format!(
                "approved is {}, not true or false",
                kind(v)
            )));
        }
    };
    let comment = text("comment", MAX_COMMENT_CHARS, false)?;
    let decided_by = text("decidedBy", MAX_NAME_CHARS, true)?.unwrap_or_default();
    if call_id != pending_call_id {
        return Err(DecisionError::OtherCall {
            variable: name.to_string(),
            expected: pending_call_id.to_string(),
            found: call_id,
        });
    }
    Ok(Decision {
        call_id,
        approved,
        comment: comment.filter(|c| !c.trim().is_empty()),
        decided_by,
    })
}

/// JSON's name for a value's type, for messages (never the value: it may be long or private).
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What the model reads instead of a result when a person refused the call.
pub fn refusal_result(call: &ToolCall, decision: &Decision) -> ToolResult {
    let reason = match &decision.comment {
        Some(comment) => format!(" Their reason: {comment}"),
        None => " They gave no reason.".to_string(),
    };
    ToolResult::error_text(format!(
        "The call {}/{} was not performed: {} refused it.{reason}",
        call.server, call.tool, decision.decided_by
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tool: &str, read_only: bool, destructive: bool) -> ToolSpec {
        ToolSpec {
            server: "orders".into(),
            tool: tool.into(),
            description: String::new(),
            input_schema: json!({"type": "object"}),
            read_only,
            destructive,
        }
    }

    fn vars(v: Value) -> Map<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn policies_parse_and_bad_ones_say_what_is_allowed() {
        for (text, policy) in [
            ("never", ApprovalPolicy::Never),
            ("writes", ApprovalPolicy::Writes),
            ("always", ApprovalPolicy::Always),
        ] {
            assert_eq!(ApprovalPolicy::from_value(&json!(text)), Ok(policy));
        }
        assert_eq!(
            ApprovalPolicy::from_value(&json!(["refund", " cancel "])),
            Ok(ApprovalPolicy::Tools(vec![
                "refund".into(),
                "cancel".into()
            ]))
        );
        for bad in [
            json!("sometimes"),
            json!(3),
            json!([""]),
            json!([1]),
            json!({}),
        ] {
            let e = ApprovalPolicy::from_value(&bad).unwrap_err();
            assert!(e.contains("\"never\"") || e.contains("tool name"), "{e}");
        }
    }

    #[test]
    fn writes_means_not_read_only_and_destructive_always_counts() {
        let lookup = spec("lookup_order", true, false);
        let refund = spec("refund", false, false);
        let lying = spec("purge", true, true);
        let p = ApprovalPolicy::Writes;
        assert!(!p.covers(&lookup));
        assert!(p.covers(&refund));
        assert!(p.covers(&lying), "destructiveHint wins over readOnlyHint");
        assert!(!ApprovalPolicy::Never.covers(&lying));
        assert!(ApprovalPolicy::Always.covers(&lookup));
        let listed = ApprovalPolicy::Tools(vec!["refund".into()]);
        assert!(listed.covers(&refund) && !listed.covers(&lookup) && !listed.covers(&lying));
    }

    #[test]
    fn a_server_policy_adds_to_the_definition_never_removes() {
        let refund = spec("refund", false, false);
        let mut rules = ApprovalRules::default();
        assert!(!rules.needs_approval(&refund) && !rules.may_stop());
        rules
            .servers
            .push(("billing".into(), ApprovalPolicy::Always));
        assert!(!rules.needs_approval(&refund), "another server's policy");
        assert!(rules.may_stop());
        rules
            .servers
            .push(("orders".into(), ApprovalPolicy::Writes));
        assert!(rules.needs_approval(&refund));
        let rules = ApprovalRules {
            definition: ApprovalPolicy::Always,
            servers: vec![("orders".into(), ApprovalPolicy::Never)],
        };
        assert!(rules.needs_approval(&refund), "the server cannot loosen it");
    }

    #[test]
    fn a_valid_decision_is_read() {
        let v = vars(
            json!({"agentApproval": {"callId": "call_1", "approved": false, "comment": "over the limit", "decidedBy": "alice"}}),
        );
        assert_eq!(
            read_decision(&v, "agentApproval", "call_1"),
            Ok(Decision {
                call_id: "call_1".into(),
                approved: false,
                comment: Some("over the limit".into()),
                decided_by: "alice".into(),
            })
        );
        let v = vars(
            json!({"ok": {"callId": "c", "approved": true, "comment": null, "decidedBy": "bob"}}),
        );
        let d = read_decision(&v, "ok", "c").unwrap();
        assert!(d.approved && d.comment.is_none());
    }

    #[test]
    fn missing_malformed_and_foreign_decisions_name_the_variable() {
        let missing = read_decision(&Map::new(), "agentApproval", "call_1").unwrap_err();
        assert!(matches!(missing, DecisionError::Missing { .. }));
        assert!(missing.to_string().contains("\"agentApproval\""));
        let null = read_decision(&vars(json!({"agentApproval": null})), "agentApproval", "c");
        assert!(matches!(null, Err(DecisionError::Missing { .. })));

        let cases = [
            (json!("yes"), "it is a string"),
            (
                json!({"approved": true, "decidedBy": "a"}),
                "callId is missing",
            ),
            (
                json!({"callId": "c", "decidedBy": "a"}),
                "approved is missing",
            ),
            (
                json!({"callId": "c", "approved": "true", "decidedBy": "a"}),
                "approved is a string",
            ),
            (
                json!({"callId": "c", "approved": true}),
                "decidedBy is missing",
            ),
            (
                json!({"callId": "c", "approved": true, "decidedBy": " "}),
                "decidedBy is a string",
            ),
            (
                json!({"callId": "c", "approved": true, "decidedBy": "a", "comment": 7}),
                "comment is a number",
            ),
            (
                json!({"callId": "c", "approved": true, "decidedBy": "a", "comment": "x".repeat(5000)}),
                "comment is longer than 4096",
            ),
        ];
        for (value, reason) in cases {
            let e = read_decision(&vars(json!({"d": value})), "d", "c").unwrap_err();
            assert!(matches!(e, DecisionError::Malformed { .. }), "{e}");
            let text = e.to_string();
            assert!(text.contains("\"d\"") && text.contains(reason), "{text}");
            assert!(!text.contains("xxxxxxxx"), "the value is never echoed");
        }

        let other = read_decision(
            &vars(json!({"d": {"callId": "call_0", "approved": true, "decidedBy": "a"}})),
            "d",
            "call_1",
        )
        .unwrap_err();
        assert_eq!(
            other,
            DecisionError::OtherCall {
                variable: "d".into(),
                expected: "call_1".into(),
                found: "call_0".into()
            }
        );
    }

    #[test]
    fn the_request_and_the_refusal_say_what_a_person_and_the_model_need() {
        let call = ToolCall {
            call_id: "call_1".into(),
            server: "orders".into(),
            tool: "refund".into(),
            arguments: json!({"orderId": "o-77", "amount": 900}),
        };
        assert_eq!(
            approval_request(
                &call,
                Some("Refunding 900 EUR needs approval."),
                "pi-1/refundAgent"
            ),
            json!({"callId": "call_1", "server": "orders", "tool": "refund",
                   "arguments": {"orderId": "o-77", "amount": 900},
                   "summary": "Refunding 900 EUR needs approval.", "runKey": "pi-1/refundAgent"})
        );
        let refused = refusal_result(
            &call,
            &Decision {
                call_id: "call_1".into(),
                approved: false,
                comment: Some("order older than 90 days".into()),
                decided_by: "alice".into(),
            },
        );
        assert!(refused.is_error);
        assert_eq!(
            refused.to_model_text(),
            "The call orders/refund was not performed: alice refused it. Their reason: order older than 90 days"
        );
    }
}
