//! serde types of the engine's wire format (protocol.md A.1, B.1-B.3), private to the engine
//! client. They map to and from the domain types of `engine` at the edge.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{JournalStep, Task, TraceParent};

pub(crate) const PROTOCOL_HEADER: &str = "X-Abada-Worker-Protocol-Version";
pub(crate) const PROTOCOL_VERSION: &str = "1";

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FetchAndLockBody<'a> {
    pub worker_id: &'a str,
    pub topics: &'a [String],
    pub lock_duration: u64,
    pub max_tasks: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HeartbeatBody<'a> {
    pub worker_id: &'a str,
    pub lock_duration: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CompleteBody<'a> {
    pub worker_id: &'a str,
    pub variables: &'a Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BpmnErrorBody<'a> {
    pub worker_id: &'a str,
    pub error_code: &'a str,
    pub error_message: &'a str,
    pub variables: &'a Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FailureBody<'a> {
    pub worker_id: &'a str,
    pub error_message: &'a str,
    pub error_details: &'a str,
    pub retries: i32,
    pub retry_timeout: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JournalReadBody<'a> {
    pub worker_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JournalAppendBody<'a> {
    pub worker_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    pub step: &'a JournalStep,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ToolCredentialBody<'a> {
    pub worker_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    pub server: &'a str,
}

/// One element of a fetch response. Unknown fields are ignored.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub struct LockedTaskWire {
    pub id: String,
    #[serde(default)]
    pub topic_name: Option<String>,
    #[serde(default)]
    pub variables: Option<Map<String, Value>>,
    #[serde(default)]
    pub process_instance_id: Option<String>,
    #[serde(default)]
    pub activity_id: Option<String>,
    #[serde(default)]
    pub retries: Option<i32>,
    #[serde(default)]
    pub lock_expiration_time: Option<String>,
    #[serde(default)]
    pub trace_parent: Option<String>,
    #[serde(default)]
    pub protocol_version: Option<String>,
    #[serde(default)]
    pub attempt: Option<u32>,
    #[serde(default)]
    pub agent: Option<Value>,
}

impl From<LockedTaskWire> for Task {
    fn from(w: LockedTaskWire) -> Task {
        Task {
            id: w.id,
            topic: w.topic_name.unwrap_or_default(),
            variables: w.variables.unwrap_or_default(),
            process_instance_id: w.process_instance_id,
            activity_id: w.activity_id,
            retries: w.retries,
            lock_expiration_time: w.lock_expiration_time,
            trace_parent: w.trace_parent.as_deref().and_then(TraceParent::parse),
            attempt: w.attempt,
            agent: w.agent.filter(|a| !a.is_null()),
        }
    }
}

/// Decodes a fetch response element by element: a malformed element is reported and skipped
/// without losing the well-formed ones (their leases are live).
pub(crate) fn decode_locked_tasks(body: &[u8]) -> Result<(Vec<Task>, Vec<String>), String> {
    let items: Vec<Value> =
        serde_json::from_slice(body).map_err(|e| format!("not a JSON array of tasks: {e}"))?;
    let mut tasks = Vec::with_capacity(items.len());
    let mut rejected = Vec::new();
    for item in items {
        let hint = item
            .get("id")
            .map(|v| v.to_string())
            .unwrap_or_else(|| "<no id>".to_string());
        match serde_json::from_value::<LockedTaskWire>(item) {
            Ok(w) if !w.id.trim().is_empty() => tasks.push(Task::from(w)),
            Ok(_) => rejected.push("a task with a blank id".to_string()),
            Err(e) => rejected.push(format!("task {hint}: {e}")),
        }
    }
    Ok((tasks, rejected))
}

/// The engine's error body. Every field is optional on read: a proxy may answer with anything.
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ErrorBody {
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JournalWire {
    #[serde(default)]
    pub attempt: Option<u32>,
    /// Required: a body without `steps` is not a journal, and reading it as an empty one would
    /// start the task over on top of the steps the engine holds.
    pub steps: Vec<JournalStep>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ToolCredentialWire {
    pub token: String,
    #[serde(default)]
    pub expires_at: Option<String>,
}

/// Decodes a journal read answer (`{"attempt", "steps"}`); `steps` is required.
pub(crate) fn decode_journal(body: &[u8]) -> Result<super::Journal, String> {
    let wire: JournalWire = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    Ok(super::Journal {
        attempt: wire.attempt,
        steps: wire.steps,
    })
}

/// Decodes a tool credential answer; `None` when it is not `{"token", "expiresAt"}` (the body is
/// never echoed: it may hold a token).
pub(crate) fn decode_tool_credential(body: &[u8]) -> Option<super::ToolCredential> {
    let wire: ToolCredentialWire = serde_json::from_slice(body).ok()?;
    Some(super::ToolCredential {
        token: crate::secret::Secret::new(wire.token),
        expires_at: wire.expires_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_documented_task_and_ignores_unknown_fields() {
        let body = br#"[{
          "id": "c0a8", "topicName": "abada:agent",
          "variables": {"customerId": "c-17", "message": "hi"},
          "processInstanceId": "p-42", "activityId": "refundAgent",
          "retries": 3, "lockExpirationTime": "2026-07-19T12:02:00Z",
          "traceParent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
          "protocolVersion": "1", "attempt": 2, "agent": {"name": "a"}, "somethingNew": true
        }]"#;
        let (tasks, rejected) = decode_locked_tasks(body).unwrap();
        assert!(rejected.is_empty());
        let t = &tasks[0];
        assert_eq!(t.id, "c0a8");
        assert_eq!(t.attempt, Some(2));
        assert_eq!(t.retries, Some(3));
        assert_eq!(
            t.trace_parent.as_ref().unwrap().trace_id(),
            "0af7651916cd43dd8448eb211c80319c"
        );
    }

    #[test]
    fn null_retries_and_trace_are_accepted_and_a_bad_element_does_not_lose_the_rest() {
        let body = br#"[{"id":"a","retries":null,"traceParent":null},{"id":5},{"noid":1},{"id":"b","attempt":-1}]"#;
        let (tasks, rejected) = decode_locked_tasks(body).unwrap();
        assert_eq!(tasks.len(), 1);
        assert_eq!(tasks[0].id, "a");
        assert_eq!(rejected.len(), 3);
        assert!(decode_locked_tasks(b"{}").is_err());
    }
}
