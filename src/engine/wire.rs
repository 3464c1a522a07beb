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
struct LockedTaskWire {
    pub id: String,
    #[serde(default)]
    pub(crate) topic_name: Option<String>,
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
    pub(crate) protocol_version: Option<String>,
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

/// A fetch response as read: the tasks, one problem per element skipped, and the tasks too large
/// to take (their id and attempt, read before the limit was reached).
#[derive(Debug, Default)]
pub(crate) struct LockedTasks {
    pub tasks: Vec<Task>,
    pub rejected: Vec<String>,
    pub oversized: Vec<OversizedTask>,
}

/// A locked task larger than the worker takes (`body::TASK_MAX_BYTES`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OversizedTask {
    pub id: String,
    pub attempt: Option<u32>,
    /// Bytes of the task read when its limit was reached.
    pub seen: u64,
    pub limit: usize,
}

/// Decodes a fetch response element by element: a malformed element is reported and skipped
/// without losing the well-formed ones (their leases are live).
pub(crate) fn decode_locked_tasks(body: &[u8]) -> Result<(Vec<Task>, Vec<String>), String> {
    let read = decode_locked_tasks_from(&mut &body[..], crate::body::TASK_MAX_BYTES)?;
    let mut rejected = read.rejected;
    rejected.extend(read.oversized.iter().map(|o| {
        format!(
            "task {:?}: larger than the limit of {} bytes",
            o.id, o.limit
        )
    }));
    Ok((read.tasks, rejected))
}

/// Decodes a fetch response as it is read, holding at most one element (up to `task_limit`
/// bytes of it) at a time. An element that passes `task_limit` ends the read: it is reported
/// in `oversized` when its `id` came before the limit (the engine writes `id` first), the tasks
/// before it are kept, and the rest of the response is not read (those tasks wait out their
/// lease and are fetched again).
pub(crate) fn decode_locked_tasks_from(
    reader: &mut dyn std::io::Read,
    task_limit: usize,
) -> Result<LockedTasks, String> {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    let read = Rc::new(Cell::new(0u64));
    let element_start: Rc<Cell<Option<u64>>> = Rc::new(Cell::new(None));
    let over = Rc::new(Cell::new(false));
    let counting = CountingReader {
        inner: reader,
        read: read.clone(),
        element_start: element_start.clone(),
        limit: task_limit as u64,
        over: over.clone(),
    };
    let current: RefCell<(Option<String>, Option<u32>)> = RefCell::new((None, None));
    let out = RefCell::new(LockedTasks::default());
    let visitor = TasksVisitor {
        element_start: &element_start,
        read: &read,
        current: &current,
        out: &out,
    };
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(
        8 * 1024,
        counting,
    ));
    let result = serde::Deserializer::deserialize_seq(&mut de, visitor).and_then(|()| de.end());
    let mut out = out.into_inner();
    match result {
        Ok(()) => Ok(out),
        Err(_) if over.get() => {
            let (id, attempt) = current.into_inner();
            let seen = element_start
                .get()
                .map_or(0, |start| read.get().saturating_sub(start));
            match id {
                Some(id) => {
                    out.oversized.push(OversizedTask {
                        id,
                        attempt,
                        seen,
                        limit: task_limit,
                    });
                    Ok(out)
                }
                None => Err(format!(
                    "a task larger than the limit of {task_limit} bytes, with no id before the limit"
                )),
            }
        }
        Err(e) if out.tasks.is_empty() && out.rejected.is_empty() => {
            Err(format!("not a JSON array of tasks: {e}"))
        }
        Err(e) => Err(format!("the array of tasks broke off: {e}")),
    }
}

/// Counts what is read and fails once the current element passes its limit.
struct CountingReader<'r> {
    inner: &'r mut dyn std::io::Read,
    read: std::rc::Rc<std::cell::Cell<u64>>,
    element_start: std::rc::Rc<std::cell::Cell<Option<u64>>>,
    limit: u64,
    over: std::rc::Rc<std::cell::Cell<bool>>,
}

impl std::io::Read for CountingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(start) = self.element_start.get()
            && self.read.get().saturating_sub(start) > self.limit
        {
            self.over.set(true);
            return Err(std::io::Error::other("a task exceeds its limit"));
        }
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

struct TasksVisitor<'a> {
    element_start: &'a std::cell::Cell<Option<u64>>,
    read: &'a std::cell::Cell<u64>,
    current: &'a std::cell::RefCell<(Option<String>, Option<u32>)>,
    out: &'a std::cell::RefCell<LockedTasks>,
}

impl<'de> serde::de::Visitor<'de> for TasksVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array of tasks")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        loop {
            // The buffered reader may have read ahead of the element: the limit is about size,
            // not exact bytes.
            self.element_start.set(Some(self.read.get()));
            *self.current.borrow_mut() = (None, None);
            let Some(item) = seq.next_element_seed(ElementSeed {
                current: self.current,
            })?
            else {
                self.element_start.set(None);
                return Ok(());
            };
            let hint = item
                .get("id")
                .map(|v| v.to_string())
                .unwrap_or_else(|| "<no id>".to_string());
            let mut out = self.out.borrow_mut();
            match serde_json::from_value::<LockedTaskWire>(item) {
                Ok(w) if !w.id.trim().is_empty() => out.tasks.push(Task::from(w)),
                Ok(_) => out.rejected.push("a task with a blank id".to_string()),
                Err(e) => out.rejected.push(format!("task {hint}: {e}")),
            }
        }
    }
}

/// One element as a JSON value, noting its `id` and `attempt` as soon as they are read.
struct ElementSeed<'a> {
    current: &'a std::cell::RefCell<(Option<String>, Option<u32>)>,
}

impl<'de> serde::de::DeserializeSeed<'de> for ElementSeed<'_> {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ElementSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a task")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut fields = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value: Value = map.next_value()?;
            match (key.as_str(), &value) {
                ("id", Value::String(id)) => self.current.borrow_mut().0 = Some(id.clone()),
                ("attempt", Value::Number(n)) => {
                    self.current.borrow_mut().1 = n.as_u64().and_then(|n| u32::try_from(n).ok())
                }
                _ => {}
            }
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element::<Value>()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
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
    pub steps: BoundedSteps,
}

/// A journal's steps, refused past `body::JOURNAL_MAX_STEPS` as they are read.
pub(crate) struct BoundedSteps(Vec<JournalStep>);

/// The text a journal with too many steps fails with, recognised by [`decode_journal_from`].
const TOO_MANY_STEPS: &str = "the journal has more steps than the limit of";

impl<'de> Deserialize<'de> for BoundedSteps {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Steps;
        impl<'de> serde::de::Visitor<'de> for Steps {
            type Value = BoundedSteps;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of journal steps")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<BoundedSteps, A::Error> {
                let mut steps = Vec::new();
                while let Some(step) = seq.next_element::<JournalStep>()? {
                    if steps.len() == crate::body::JOURNAL_MAX_STEPS {
                        return Err(serde::de::Error::custom(format!(
                            "{TOO_MANY_STEPS} {}",
                            crate::body::JOURNAL_MAX_STEPS
                        )));
                    }
                    steps.push(step);
                }
                Ok(BoundedSteps(steps))
            }
        }
        d.deserialize_seq(Steps)
    }
}

/// Why a journal read answer could not be used.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum JournalDecodeError {
    /// More steps than `body::JOURNAL_MAX_STEPS`: retrying cannot help.
    TooManySteps,
    Malformed(String),
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
    decode_journal_from(&mut &body[..]).map_err(|e| match e {
        JournalDecodeError::TooManySteps => {
            format!("{TOO_MANY_STEPS} {}", crate::body::JOURNAL_MAX_STEPS)
        }
        JournalDecodeError::Malformed(m) => m,
    })
}

/// Decodes a journal read answer as it is read, refusing more than `body::JOURNAL_MAX_STEPS`.
pub(crate) fn decode_journal_from(
    reader: &mut dyn std::io::Read,
) -> Result<super::Journal, JournalDecodeError> {
    let wire: JournalWire =
        serde_json::from_reader(std::io::BufReader::with_capacity(8 * 1024, reader)).map_err(
            |e| {
                if e.to_string().starts_with(TOO_MANY_STEPS) {
                    JournalDecodeError::TooManySteps
                } else {
                    JournalDecodeError::Malformed(e.to_string())
                }
            },
        )?;
    Ok(super::Journal {
        attempt: wire.attempt,
        steps: wire.steps.0,
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

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProcessInstanceWire {
    id: String,
    process_definition_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProcessDefinitionWire {
    id: String,
    #[serde(default)]
    version: Option<i64>,
    bpmn_xml: String,
}

/// Decodes `GET /v1/processes/instances/{id}`: only `id` and `processDefinitionId` are read.
pub(crate) fn decode_process_instance(body: &[u8]) -> Result<super::ProcessInstance, String> {
    let wire: ProcessInstanceWire = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    if wire.process_definition_id.trim().is_empty() {
        return Err("processDefinitionId is blank".into());
    }
    Ok(super::ProcessInstance {
        id: wire.id,
        process_definition_id: wire.process_definition_id,
    })
}

/// Decodes `GET /v1/processes/{id}`: `id`, `version` and `bpmnXml` are read.
pub(crate) fn decode_process_definition(body: &[u8]) -> Result<super::ProcessDefinition, String> {
    let wire: ProcessDefinitionWire = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    Ok(super::ProcessDefinition {
        id: wire.id,
        version: wire.version,
        bpmn_xml: wire.bpmn_xml,
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HistoryEventWire {
    event_type: String,
    #[serde(default)]
    actor: Option<String>,
    #[serde(default)]
    activity_id: Option<String>,
    #[serde(default)]
    details: Option<Map<String, Value>>,
}

/// Decodes one page of `GET /v1/process-instances/{id}/history`: an array of entries, each
/// with `eventType` (required), `actor`, `activityId` and `details` read; `total_pages` is the
/// engine's `X-Total-Pages` header. An entry that is not of this shape fails the whole page:
/// what the history says is the proof of a decision, and a page half read proves nothing.
pub(crate) fn decode_history_page(
    body: &[u8],
    total_pages: Option<&str>,
) -> Result<super::HistoryPage, String> {
    let wire: Vec<HistoryEventWire> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let total_pages = match total_pages {
        None => None,
        Some(raw) => Some(
            raw.trim()
                .parse::<u32>()
                .map_err(|_| format!("X-Total-Pages {raw:?} is not a page count"))?,
        ),
    };
    Ok(super::HistoryPage {
        events: wire
            .into_iter()
            .map(|e| super::HistoryEvent {
                event_type: e.event_type,
                actor: e.actor.unwrap_or_default(),
                activity_id: e.activity_id,
                details: e.details.unwrap_or_default(),
            })
            .collect(),
        total_pages,
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

    #[test]
    fn a_task_past_its_limit_is_named_and_the_tasks_before_it_kept() {
        let big = "x".repeat(100_000);
        let body = format!(
            r#"[{{"id":"a","variables":{{"v":1}}}},{{"id":"big","attempt":3,"variables":{{"v":"{big}"}}}},{{"id":"c"}}]"#
        );
        let read = decode_locked_tasks_from(&mut body.as_bytes(), 10_000).unwrap();
        assert_eq!(read.tasks.len(), 1);
        assert_eq!(read.tasks[0].id, "a");
        assert_eq!(read.oversized.len(), 1);
        let o = &read.oversized[0];
        assert_eq!(
            (o.id.as_str(), o.attempt, o.limit),
            ("big", Some(3), 10_000)
        );
        assert!(o.seen > 10_000, "{o:?}");
        // Without an id before the limit, nothing can be named.
        let body = format!(r#"[{{"variables":{{"v":"{big}"}},"id":"late"}}]"#);
        assert!(decode_locked_tasks_from(&mut body.as_bytes(), 10_000).is_err());
        // Under the limit, the same task is taken.
        let read = decode_locked_tasks_from(&mut body.as_bytes(), 200_000).unwrap();
        assert_eq!(read.tasks[0].id, "late");
    }

    #[test]
    fn a_journal_with_too_many_steps_is_refused_as_such() {
        let step = r#"{"seq":1,"kind":"input","state":"done","data":{}}"#;
        let steps = vec![step; crate::body::JOURNAL_MAX_STEPS + 1].join(",");
        let body = format!(r#"{{"attempt":1,"steps":[{steps}]}}"#);
        assert_eq!(
            decode_journal_from(&mut body.as_bytes()).unwrap_err(),
            JournalDecodeError::TooManySteps
        );
        let steps = [step; 3].join(",");
        let body = format!(r#"{{"attempt":1,"steps":[{steps}]}}"#);
        assert_eq!(
            decode_journal_from(&mut body.as_bytes())
                .unwrap()
                .steps
                .len(),
            3
        );
    }
}
