//! The emulated engine's state and its commands: tasks, the acquisition indexes, idempotency
//! records, tool credentials and the call log. Everything here is synchronous and takes "now"
//! as an argument; the HTTP layer holds the one mutex around it for a short critical section.
//!
//! Ownership check order (the engine's `requireOwnedActiveLock`, then agent/1's fencing):
//! 1. task exists, else 400 `ENGINE_COMMAND_REJECTED` "External task not found: {id}";
//! 2. status `LOCKED` with a lease, else 400 `ENGINE_COMMAND_REJECTED` "External task is not locked: {id}";
//! 3. lease not expired (`expiry < now`), else 409 `WORKER_LOCK_EXPIRED`;
//! 4. caller's `workerId` is the holder, else 403 `WORKER_LOCK_NOT_OWNED` (v1 commands skip
//!    this when the body has no `workerId`, as the engine does; journal and credentials never);
//! 5. agent/1 only: `attempt`, when sent (always required on journal and credentials), is the
//!    current one, else 409 `STALE_ATTEMPT`.
//!
//! Then each command's own rules, as the real engine 0.11 applies them (observed, see
//! docs/REAL_ENGINE.md): `complete` needs an active process instance (400 "Process instance is
//! suspended: {id}" / "... already in a terminal state: {STATUS}"); a top-level JSON `null` in
//! the variables of `complete` or `bpmn-error` is a 500 `INTERNAL_ERROR` (the engine's
//! `Map.copyOf` throws) with nothing stored; a heartbeat without `workerId` is a 500 (the engine
//! throws building its history entry); `failure` does not look at the instance; `bpmn-error`
//! fails the instance unless it already ended (also when it is suspended). A fetch does not look
//! at the instance either: tasks of suspended, cancelled and failed instances are handed out.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use axum::http::StatusCode;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::ProtocolLevel;
use super::contention::{FetchContention, FetchLocks, RowLocks};
use super::history::{Event, History, HistoryPage};
use super::process::{self, Caller, InstanceStatus, ProcessModel, Processes, Wait};
use super::wire::{self, ApiError, Command};

/// Idempotency records live this long, as in the engine.
const IDEMPOTENCY_TTL_MS: i64 = 24 * 60 * 60 * 1000;
const MAX_LOCK_DURATION_MS: i64 = 3_600_000;
const MAX_TASKS: i64 = 50;
/// The topic of agent tasks, the default for created tasks.
pub const AGENT_TOPIC: &str = "abada:agent";

/// An operation of the worker protocol, as named in the call log and in faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Operation {
    FetchAndLock,
    Heartbeat,
    ExtendLock,
    Complete,
    BpmnError,
    Failure,
    JournalRead,
    JournalAppend,
    ToolCredentials,
    /// `GET /api/v1/processes/instances/{id}` (the process API, read by a worker for agents
    /// defined in the BPMN).
    ProcessInstanceRead,
    /// `GET /api/v1/processes/{id}`: a process definition with its BPMN XML.
    ProcessDefinitionRead,
    /// `GET /api/v1/process-instances/{id}/history`: an instance's activity history.
    ProcessHistoryRead,
    /// A request to a path the API does not have.
    Unknown,
}

impl Operation {
    /// The operation name the engine stores with an idempotency key; `None` for reads.
    fn idempotency_name(self) -> Option<&'static str> {
        Some(match self {
            Operation::FetchAndLock => "external-task.fetch-and-lock",
            Operation::Heartbeat => "external-task.heartbeat",
            Operation::ExtendLock => "external-task.extend-lock",
            Operation::Complete => "external-task.complete",
            Operation::BpmnError => "external-task.bpmn-error",
            Operation::Failure => "external-task.failure",
            Operation::JournalAppend => "external-task.journal",
            Operation::ToolCredentials => "external-task.tool-credentials",
            Operation::JournalRead
            | Operation::ProcessInstanceRead
            | Operation::ProcessDefinitionRead
            | Operation::ProcessHistoryRead
            | Operation::Unknown => return None,
        })
    }
}

/// The lifecycle of an external task, named as the engine's table names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskStatus {
    Open,
    Locked,
    Completed,
    /// An incident: `failure` with `retries: 0`.
    Failed,
    BpmnError,
}

/// A process instance, for the admin API. Instances exist as soon as a task names them; the
/// emulator has no process model, so a `complete` does not end its instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceView {
    pub status: InstanceStatus,
    pub suspended: bool,
}

/// What an operator does to a process instance (the engine's instance API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum InstanceAction {
    /// `PUT /v1/process-instances/{id}/suspension {"suspended": true}`.
    Suspend,
    /// `{"suspended": false}`.
    Resume,
    /// `DELETE /v1/process-instances/{id}`: 400 when it already ended.
    Cancel,
    /// `POST /v1/processes/instance/{id}/fail`: nothing when it already ended.
    Fail,
}

/// A task to create through the admin API. Every field has a default.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TaskSpec {
    /// Default `abada:agent`.
    pub topic: Option<String>,
    pub variables: Map<String, Value>,
    /// The agent/1 definition sent as `agent`; `None` sends none.
    pub agent: Option<Value>,
    pub retries: Option<i32>,
    /// Default `agentTask`.
    pub activity_id: Option<String>,
    /// Default `p-<task number>`.
    pub process_instance_id: Option<String>,
    pub trace_parent: Option<String>,
}

/// How often each command really executed on a task (replays and refusals not counted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskCounters {
    pub acquisitions: u32,
    pub heartbeats: u32,
    pub completes: u32,
    pub failures: u32,
    pub bpmn_errors: u32,
    pub journal_appends: u32,
    pub credentials_issued: u32,
}

/// The full state of one task, for the admin API.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskView {
    pub id: String,
    pub topic: String,
    pub status: TaskStatus,
    pub worker_id: Option<String>,
    pub attempt: u32,
    pub retries: Option<i32>,
    /// The lease, or for a task hidden by `retryTimeout`, when it becomes visible again.
    #[serde(serialize_with = "wire::serialize_opt_time")]
    pub lock_expiration_time: Option<chrono::DateTime<chrono::Utc>>,
    /// True when the task is `LOCKED` without a worker: hidden by a failure's `retryTimeout`
    /// (the engine keeps such a task `LOCKED` until its timeout expires).
    pub hidden: bool,
    pub variables: Map<String, Value>,
    pub process_instance_id: String,
    pub activity_id: String,
    pub trace_parent: Option<String>,
    pub agent: Option<Value>,
    /// Variables sent by `complete` or `bpmn-error`.
    pub result_variables: Option<Map<String, Value>>,
    pub error_message: Option<String>,
    pub error_details: Option<String>,
    pub bpmn_error_code: Option<String>,
    pub bpmn_error_message: Option<String>,
    pub journal: Vec<Value>,
    pub counters: TaskCounters,
}

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disposition {
    /// The command ran (and committed).
    Executed,
    /// Answered from the idempotency store without running.
    Replayed,
    /// Refused by the engine's rules (an error response).
    Refused,
    /// Answered by an injected fault without running.
    Injected,
}

/// One request the emulator received.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CallRecord {
    #[serde(serialize_with = "wire::serialize_time")]
    pub at: chrono::DateTime<chrono::Utc>,
    pub operation: Operation,
    pub task_id: Option<String>,
    pub worker_id: Option<String>,
    pub attempt: Option<i64>,
    pub idempotency_key: Option<String>,
    /// The request's W3C `traceparent` header, as received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    pub status: u16,
    pub error_code: Option<String>,
    /// The error body's `message` (e.g. which `ENGINE_COMMAND_REJECTED` it was).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    pub disposition: Disposition,
    /// The connection was closed instead of sending the response (fault or outage).
    pub response_dropped: bool,
    /// Fetch only: the ids returned.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub task_ids: Vec<String>,
}

/// A successful answer: status and optional JSON body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    pub status: StatusCode,
    pub body: Option<Value>,
}

impl Reply {
    fn empty(status: StatusCode) -> Self {
        Reply { status, body: None }
    }
}

struct Task {
    id: String,
    topic: String,
    variables: Map<String, Value>,
    process_instance_id: String,
    activity_id: String,
    retries: Option<i32>,
    status: TaskStatus,
    worker_id: Option<String>,
    /// Milliseconds since the epoch, emulator clock.
    lock_expiration: Option<i64>,
    attempt: u32,
    trace_parent: Option<String>,
    agent: Option<Value>,
    result_variables: Option<Map<String, Value>>,
    error_message: Option<String>,
    error_details: Option<String>,
    bpmn_error_code: Option<String>,
    bpmn_error_message: Option<String>,
    journal: Vec<Value>,
    counters: TaskCounters,
}

struct IdempotencyRecord {
    operation: &'static str,
    hash: [u8; 32],
    expires_at: i64,
    reply: Reply,
}

struct Credential {
    server: String,
    task: u64,
    attempt: u32,
    worker_id: String,
    expires_at: i64,
}

/// The whole emulated engine.
pub(crate) struct EngineState {
    protocol: ProtocolLevel,
    credential_ttl_ms: i64,
    call_log_capacity: usize,
    next_task: u64,
    tasks: BTreeMap<u64, Task>,
    /// Per topic, the tasks a fetch may take: `OPEN`, or `LOCKED` with a lease known to have
    /// expired. Ordered by id, like the engine's `order by id`.
    acquirable: HashMap<String, BTreeSet<u64>>,
    /// Every `LOCKED` task by lease expiry; a fetch first moves the expired ones to `acquirable`.
    leases: BTreeSet<(i64, u64)>,
    idempotency: HashMap<String, IdempotencyRecord>,
    /// Keys in insertion order with their expiry, to drop expired records cheaply.
    idempotency_expiry: VecDeque<(i64, String)>,
    credentials: HashMap<String, Credential>,
    /// Deployed process models, every process instance (one record each, whether started from
    /// a model or created running when a task first names it) and the user tasks (`process`).
    processes: Processes,
    calls: VecDeque<CallRecord>,
    /// The most tasks one fetch answers, whatever it asks for; `None`: as many as asked. The
    /// partial answers a worker meets on the real engine when fetches of several workers run at
    /// the same moment and `FOR UPDATE SKIP LOCKED` skips the rows the others hold. Here every
    /// fetch runs alone under the state's lock (so concurrent fetches always get disjoint
    /// tasks), and this cap is how a test or a benchmark makes the answers partial.
    answer_cap: Option<usize>,
    /// Every instance's activity history (`history`).
    history: History,
    /// Who the request being run is, as the engine's security mode establishes it: the
    /// `actor` of the history entries it writes.
    actor: String,
    /// The latest emulator time a command ran at (history entries of calls without a clock).
    now_ms: i64,
    /// How fetches contend (`contention` module): `None`, each fetch runs alone at its instant.
    fetch_contention: Option<FetchContention>,
    /// The rows the fetch transactions still open have locked.
    row_locks: RowLocks,
}

/// The task id format: sortable, e.g. `t-000017`.
fn task_id(number: u64) -> String {
    format!("t-{number:06}")
}

fn parse_task_id(id: &str) -> Option<u64> {
    let number: u64 = id.strip_prefix("t-")?.parse().ok()?;
    (task_id(number) == id).then_some(number)
}

fn is_blank(value: Option<&str>) -> bool {
    value.is_none_or(|v| v.trim().is_empty())
}

impl EngineState {
    pub fn new(protocol: ProtocolLevel, credential_ttl_ms: i64, call_log_capacity: usize) -> Self {
        EngineState {
            protocol,
            credential_ttl_ms,
            call_log_capacity,
            next_task: 1,
            tasks: BTreeMap::new(),
            acquirable: HashMap::new(),
            leases: BTreeSet::new(),
            idempotency: HashMap::new(),
            idempotency_expiry: VecDeque::new(),
            credentials: HashMap::new(),
            processes: Processes::default(),
            calls: VecDeque::new(),
            answer_cap: None,
            history: History::default(),
            actor: "system".to_string(),
            now_ms: 0,
            fetch_contention: None,
            row_locks: RowLocks::default(),
        }
    }

    /// Runs what follows as `actor` at `now` (the history's actor and time).
    fn acting(&mut self, actor: &str, now: i64) {
        self.actor = actor.to_string();
        self.now_ms = self.now_ms.max(now);
    }

    /// Records a history entry of `instance` by the current actor: only for an instance started
    /// from a deployed model (a task created through the admin API names an instance of its
    /// own, and the load harness creates hundreds of thousands: their history would be memory
    /// nobody reads).
    fn record(&mut self, instance: &str, event_type: &str, activity: Option<&str>, details: Value) {
        let Some(definition) = self
            .processes
            .instances
            .get(instance)
            .and_then(|i| i.token.as_ref())
            .map(|t| t.model.clone())
        else {
            return;
        };
        let definition = Some(definition);
        let actor = self.actor.clone();
        self.history.record(
            Event {
                instance,
                definition: definition.as_deref(),
                event_type,
                activity,
                actor: &actor,
                details,
            },
            self.now_ms,
        );
    }

    /// `GET /api/v1/process-instances/{id}/history`: `None` for an unknown instance.
    pub fn history_page(&self, instance: &str, page: usize, size: usize) -> Option<HistoryPage> {
        self.processes
            .instances
            .contains_key(instance)
            .then(|| self.history.page(instance, page, size))
    }

    /// Every history entry of `instance`.
    pub fn history(&self, instance: &str) -> Vec<super::history::HistoryEntry> {
        self.history.of(instance)
    }

    /// Caps every fetch answer at `cap` tasks (`None`: no cap), see [`EngineState::answer_cap`].
    pub fn set_answer_cap(&mut self, cap: Option<std::num::NonZeroU32>) {
        self.answer_cap = cap.map(|c| c.get() as usize);
    }

    /// Makes fetches contend as the real engine's do (`None` or a zero transaction: they never
    /// overlap); see the `contention` module. Locks of fetches already answered stay as they
    /// were taken.
    pub fn set_fetch_contention(&mut self, contention: Option<FetchContention>) {
        self.fetch_contention = contention.filter(|c| !c.transaction.is_zero());
    }

    /// How fetches contend now.
    pub fn fetch_contention(&self) -> Option<FetchContention> {
        self.fetch_contention
    }

    // ---- indexes -------------------------------------------------------------------------

    fn unindex(&mut self, number: u64) {
        let Some(task) = self.tasks.get(&number) else {
            return;
        };
        if let Some(expiry) = task.lock_expiration {
            self.leases.remove(&(expiry, number));
        }
        if let Some(set) = self.acquirable.get_mut(&task.topic) {
            set.remove(&number);
        }
    }

    fn index(&mut self, number: u64) {
        let Some(task) = self.tasks.get(&number) else {
            return;
        };
        match (task.status, task.lock_expiration) {
            (TaskStatus::Open, _) => {
                self.acquirable
                    .entry(task.topic.clone())
                    .or_default()
                    .insert(number);
            }
            (TaskStatus::Locked, Some(expiry)) => {
                self.leases.insert((expiry, number));
            }
            _ => {}
        }
    }

    /// Moves leases that expired by `now` into the acquirable sets (the engine's
    /// `lock_expiration_time <= :now`).
    fn promote_expired(&mut self, now: i64) {
        while let Some(&(expiry, number)) = self.leases.first() {
            if expiry > now {
                break;
            }
            self.leases.pop_first();
            if let Some(task) = self.tasks.get(&number) {
                self.acquirable
                    .entry(task.topic.clone())
                    .or_default()
                    .insert(number);
            }
        }
    }

    // ---- admin ---------------------------------------------------------------------------

    pub fn create_task(&mut self, spec: TaskSpec) -> String {
        let number = self.next_task;
        self.next_task += 1;
        let id = task_id(number);
        let task = Task {
            id: id.clone(),
            topic: spec.topic.unwrap_or_else(|| AGENT_TOPIC.to_string()),
            variables: spec.variables,
            process_instance_id: spec
                .process_instance_id
                .unwrap_or_else(|| format!("p-{number:06}")),
            activity_id: spec.activity_id.unwrap_or_else(|| "agentTask".to_string()),
            retries: spec.retries,
            status: TaskStatus::Open,
            worker_id: None,
            lock_expiration: None,
            attempt: 0,
            trace_parent: spec.trace_parent,
            agent: spec.agent,
            result_variables: None,
            error_message: None,
            error_details: None,
            bpmn_error_code: None,
            bpmn_error_message: None,
            journal: Vec::new(),
            counters: TaskCounters::default(),
        };
        self.processes
            .instances
            .entry(task.process_instance_id.clone())
            .or_insert_with(process::Instance::named_by_task);
        self.tasks.insert(number, task);
        self.index(number);
        id
    }

    pub fn instance_view(&self, id: &str) -> Option<InstanceView> {
        self.processes.instances.get(id).map(|i| InstanceView {
            status: i.status,
            suspended: i.suspended,
        })
    }

    /// An operator's action on a process instance, refused with the engine's message where the
    /// engine refuses it. Its external tasks are not touched (as in the engine): they stay
    /// `OPEN`/`LOCKED` and are still handed out.
    pub fn instance_action(&mut self, id: &str, action: InstanceAction) -> Result<(), String> {
        let Some(instance) = self.processes.instances.get_mut(id) else {
            return Err(format!("Process instance not found: {id}"));
        };
        let event = match action {
            InstanceAction::Suspend => {
                instance.suspended = true;
                Some("PROCESS_SUSPENDED")
            }
            InstanceAction::Resume => {
                instance.suspended = false;
                Some("PROCESS_RESUMED")
            }
            InstanceAction::Cancel if instance.status.terminal() => {
                return Err(format!(
                    "Process instance is already in a terminal state: {}",
                    instance.status.as_str()
                ));
            }
            InstanceAction::Cancel => {
                instance.status = InstanceStatus::Cancelled;
                Some("PROCESS_CANCELLED")
            }
            InstanceAction::Fail if instance.status.terminal() => None,
            InstanceAction::Fail => {
                instance.status = InstanceStatus::Failed;
                Some("PROCESS_FAILED")
            }
        };
        // The admin API is an operator's call without an identity here.
        if let Some(event) = event {
            self.actor = "system".into();
            self.record(id, event, None, serde_json::json!({}));
        }
        Ok(())
    }

    /// The engine's `requireActive`: a suspended or ended instance refuses to move on.
    fn require_active(&self, instance_id: &str) -> Result<(), ApiError> {
        let Some(instance) = self.processes.instances.get(instance_id) else {
            return Ok(());
        };
        if instance.suspended {
            return Err(ApiError::rejected(format!(
                "Process instance is suspended: {instance_id}"
            )));
        }
        if instance.status.terminal() {
            return Err(ApiError::rejected(format!(
                "Process instance is already in a terminal state: {}",
                instance.status.as_str()
            )));
        }
        Ok(())
    }

    /// The engine's "set retries" (an operator resolving an incident): the task is `OPEN` again.
    pub fn set_retries(&mut self, id: &str, retries: i32) -> bool {
        let Some(number) = parse_task_id(id).filter(|n| self.tasks.contains_key(n)) else {
            return false;
        };
        self.unindex(number);
        if let Some(task) = self.tasks.get_mut(&number) {
            task.retries = Some(retries);
            task.status = TaskStatus::Open;
            task.worker_id = None;
            task.lock_expiration = None;
        }
        self.index(number);
        let (instance, activity) = self.task_place(number);
        self.actor = "system".into();
        self.record(
            &instance,
            "EXTERNAL_TASK_RETRIES_SET",
            Some(&activity),
            serde_json::json!({"externalTaskId": id, "retries": retries}),
        );
        true
    }

    /// Replaces the journal of task `id` with `steps`, as if earlier attempts had written them
    /// (a hostile or corrupt engine's journal, a resume from a long one). False when there is no
    /// such task.
    pub fn seed_journal(&mut self, id: &str, steps: Vec<Value>) -> bool {
        let Some(task) = parse_task_id(id).and_then(|n| self.tasks.get_mut(&n)) else {
            return false;
        };
        task.journal = steps;
        true
    }

    pub fn task_view(&self, id: &str) -> Option<TaskView> {
        let number = parse_task_id(id)?;
        self.tasks.get(&number).map(view)
    }

    pub fn task_views(&self) -> Vec<TaskView> {
        self.tasks.values().map(view).collect()
    }

    pub fn record_call(&mut self, record: CallRecord) {
        if self.call_log_capacity == 0 {
            return;
        }
        while self.calls.len() >= self.call_log_capacity {
            self.calls.pop_front();
        }
        self.calls.push_back(record);
    }

    pub fn calls(&self) -> Vec<CallRecord> {
        self.calls.iter().cloned().collect()
    }

    pub fn clear_calls(&mut self) {
        self.calls.clear();
    }

    /// The tool server side of B.3: `Some((task id, attempt))` while the token is valid for
    /// `server`, unexpired, and its task is still `LOCKED` by the same worker on the same attempt.
    pub fn verify_tool_credential(
        &self,
        server: &str,
        token: &str,
        now: i64,
    ) -> Option<(String, u32)> {
        let credential = self.credentials.get(token)?;
        if credential.server != server || credential.expires_at <= now {
            return None;
        }
        let task = self.tasks.get(&credential.task)?;
        let live = task.status == TaskStatus::Locked
            && task.lock_expiration.is_some_and(|e| e >= now)
            && task.worker_id.as_deref() == Some(credential.worker_id.as_str())
            && task.attempt == credential.attempt;
        live.then(|| (task.id.clone(), task.attempt))
    }

    // ---- commands ------------------------------------------------------------------------

    /// Runs one command under the idempotency rules of A.3: with a key, a stored answer for the
    /// same operation and body is replayed, another body is `IDEMPOTENCY_CONFLICT`, and only a
    /// successful command is stored (a refusal rolls the reservation back, as in the engine).
    pub fn run(
        &mut self,
        operation: Operation,
        task: Option<&str>,
        key: Option<&str>,
        command: &Command,
        now: i64,
        actor: &str,
    ) -> Result<(Reply, Disposition), ApiError> {
        self.acting(actor, now);
        let key = key.filter(|k| !k.trim().is_empty());
        let (Some(key), Some(op_name)) = (key, operation.idempotency_name()) else {
            return self
                .execute(task, command, now)
                .map(|r| (r, Disposition::Executed));
        };
        self.drop_expired_idempotency(now);
        let hash: [u8; 32] = Sha256::digest(command.canonical(task).to_string().as_bytes()).into();
        if let Some(record) = self.idempotency.get(key) {
            if record.operation != op_name || record.hash != hash {
                return Err(ApiError::idempotency_conflict());
            }
            return Ok((record.reply.clone(), Disposition::Replayed));
        }
        let reply = self.execute(task, command, now)?;
        let expires_at = now.saturating_add(IDEMPOTENCY_TTL_MS);
        self.idempotency.insert(
            key.to_string(),
            IdempotencyRecord {
                operation: op_name,
                hash,
                expires_at,
                reply: reply.clone(),
            },
        );
        self.idempotency_expiry
            .push_back((expires_at, key.to_string()));
        Ok((reply, Disposition::Executed))
    }

    fn drop_expired_idempotency(&mut self, now: i64) {
        while let Some((expires_at, _)) = self.idempotency_expiry.front() {
            if *expires_at > now {
                break;
            }
            if let Some((expires_at, key)) = self.idempotency_expiry.pop_front()
                && self
                    .idempotency
                    .get(&key)
                    .is_some_and(|r| r.expires_at == expires_at)
            {
                self.idempotency.remove(&key);
            }
        }
    }

    fn execute(
        &mut self,
        task: Option<&str>,
        command: &Command,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let id = task.unwrap_or_default();
        match command {
            Command::FetchAndLock(r) => self.fetch_and_lock(r, now),
            Command::ExtendLock(r) => self.extend_lock(id, r, now),
            Command::Complete(r) => self.complete(id, r, now),
            Command::Failure(r) => self.failure(id, r, now),
            Command::BpmnError(r) => self.bpmn_error(id, r, now),
            Command::JournalRead(r) => self.journal_read(id, r, now),
            Command::JournalAppend(r) => self.journal_append(id, r, now),
            Command::ToolCredentials(r) => self.tool_credentials(id, r, now),
        }
    }

    fn fetch_and_lock(
        &mut self,
        r: &wire::FetchAndLockRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let worker = r.worker_id.as_deref().unwrap_or_default();
        if is_blank(r.worker_id.as_deref()) {
            return Err(ApiError::rejected("workerId is required"));
        }
        let topics = r.topics.as_deref().unwrap_or_default();
        if topics.is_empty() || topics.iter().any(|t| t.trim().is_empty()) {
            return Err(ApiError::rejected(
                "At least one non-blank topic is required",
            ));
        }
        let lock_duration = r.lock_duration.unwrap_or(0);
        if !(1..=MAX_LOCK_DURATION_MS).contains(&lock_duration) {
            return Err(ApiError::rejected(
                "lockDuration must be between 1 and 3600000 milliseconds",
            ));
        }
        let max_tasks = r.max_tasks.unwrap_or(1);
        if !(1..=MAX_TASKS).contains(&max_tasks) {
            return Err(ApiError::rejected("maxTasks must be between 1 and 50"));
        }
        let max_tasks = (max_tasks as usize).min(self.answer_cap.unwrap_or(usize::MAX));

        self.promote_expired(now);
        let contention = self.fetch_contention;
        if contention.is_some() {
            self.row_locks.release_ended(now);
        }
        // With contention: the rows this fetch's transaction locks (`contention` module), and
        // the topics its selects have scanned so far (on H2 a topic's first select locks every
        // candidate of the topic; its later ones lock the same rows again).
        let mut ours: Vec<u64> = Vec::new();
        let mut scanned: Vec<&str> = Vec::new();
        let mut locked = Vec::new();
        // The engine's loop: one task per topic per round, in the order the topics were sent.
        'rounds: while locked.len() < max_tasks {
            let mut acquired = false;
            for topic in topics {
                let candidates = self.acquirable.get(topic.as_str());
                let number = match contention {
                    None => candidates.and_then(|s| s.first().copied()),
                    Some(c) => {
                        let row_locks = &self.row_locks;
                        if c.locks == FetchLocks::EveryCandidate
                            && !scanned.contains(&topic.as_str())
                        {
                            scanned.push(topic);
                            ours.extend(
                                candidates
                                    .into_iter()
                                    .flatten()
                                    .filter(|n| !row_locks.is_held(**n)),
                            );
                        }
                        // `order by id limit 1 ... skip locked`: the first row no other open
                        // fetch holds.
                        candidates.and_then(|s| s.iter().find(|n| !row_locks.is_held(**n)).copied())
                    }
                };
                let Some(number) = number else {
                    continue;
                };
                if contention.is_some_and(|c| c.locks == FetchLocks::ReturnedRows) {
                    ours.push(number);
                }
                self.unindex(number);
                let Some(task) = self.tasks.get_mut(&number) else {
                    continue;
                };
                task.status = TaskStatus::Locked;
                task.worker_id = Some(worker.to_string());
                task.lock_expiration = Some(now.saturating_add(lock_duration));
                task.attempt = task.attempt.saturating_add(1);
                task.counters.acquisitions += 1;
                let id = task.id.clone();
                locked.push(self.locked_task_json(number));
                self.index(number);
                let (instance, activity) = self.task_place(number);
                self.record(
                    &instance,
                    "EXTERNAL_TASK_LOCKED",
                    Some(&activity),
                    serde_json::json!({"externalTaskId": id, "workerId": worker, "topic": topic}),
                );
                acquired = true;
                if locked.len() >= max_tasks {
                    break 'rounds;
                }
            }
            if !acquired {
                break;
            }
        }
        if let Some(c) = contention {
            self.row_locks
                .hold(ours, now.saturating_add(c.transaction_ms()));
        }
        Ok(Reply {
            status: StatusCode::OK,
            body: Some(Value::Array(locked)),
        })
    }

    /// The instance and activity of task `number` (empty when there is no such task).
    fn task_place(&self, number: u64) -> (String, String) {
        self.tasks
            .get(&number)
            .map(|t| (t.process_instance_id.clone(), t.activity_id.clone()))
            .unwrap_or_default()
    }

    fn locked_task_json(&self, number: u64) -> Value {
        let Some(task) = self.tasks.get(&number) else {
            return Value::Null;
        };
        let mut json = serde_json::json!({
            "id": task.id,
            "topicName": task.topic,
            "variables": task.variables,
            "processInstanceId": task.process_instance_id,
            "activityId": task.activity_id,
            "retries": task.retries,
            "lockExpirationTime": task.lock_expiration.map(wire::format_lease_time),
            "traceParent": task.trace_parent,
            "protocolVersion": "1",
        });
        if self.protocol != ProtocolLevel::PlainV1
            && let Value::Object(map) = &mut json
        {
            map.insert("attempt".into(), task.attempt.into());
            if let Some(agent) = &task.agent {
                map.insert("agent".into(), agent.clone());
            }
        }
        json
    }

    /// The ownership checks, in the order documented at the top of this module.
    fn owned(
        &self,
        id: &str,
        worker: Option<&str>,
        attempt: Option<i64>,
        agent_call: bool,
        now: i64,
    ) -> Result<u64, ApiError> {
        let number = parse_task_id(id)
            .filter(|n| self.tasks.contains_key(n))
            .ok_or_else(|| ApiError::task_not_found(id))?;
        let task = &self.tasks[&number];
        self.check_lock(task, worker, attempt, agent_call, now)?;
        Ok(number)
    }

    fn check_lock(
        &self,
        task: &Task,
        worker: Option<&str>,
        attempt: Option<i64>,
        agent_call: bool,
        now: i64,
    ) -> Result<(), ApiError> {
        let Some(expiry) = task
            .lock_expiration
            .filter(|_| task.status == TaskStatus::Locked)
        else {
            return Err(ApiError::not_locked(&task.id));
        };
        if expiry < now {
            return Err(ApiError::lock_expired(&task.id));
        }
        let worker_mismatch = match worker {
            Some(w) => task.worker_id.as_deref() != Some(w),
            None => agent_call,
        };
        if worker_mismatch {
            return Err(ApiError::not_owned(&task.id));
        }
        if self.protocol != ProtocolLevel::PlainV1
            && (attempt.is_some() || agent_call)
            && attempt != Some(i64::from(task.attempt))
        {
            return Err(ApiError::stale_attempt(task.attempt));
        }
        Ok(())
    }

    fn extend_lock(
        &mut self,
        id: &str,
        r: &wire::ExtendLockRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, false, now)?;
        let lock_duration = r.lock_duration.unwrap_or(0);
        if !(1..=MAX_LOCK_DURATION_MS).contains(&lock_duration) {
            return Err(ApiError::rejected(
                "lockDuration must be between 1 and 3600000 milliseconds",
            ));
        }
        if r.worker_id.is_none() {
            // The engine's history entry takes `workerId` into an immutable map: it throws.
            return Err(ApiError::internal(StatusCode::INTERNAL_SERVER_ERROR));
        }
        self.unindex(number);
        if let Some(task) = self.tasks.get_mut(&number) {
            task.lock_expiration = Some(now.saturating_add(lock_duration));
            task.counters.heartbeats += 1;
        }
        self.index(number);
        let (instance, activity) = self.task_place(number);
        self.record(
            &instance,
            "EXTERNAL_TASK_LOCK_EXTENDED",
            Some(&activity),
            serde_json::json!({"externalTaskId": id, "workerId": r.worker_id}),
        );
        Ok(Reply::empty(StatusCode::NO_CONTENT))
    }

    fn complete(
        &mut self,
        id: &str,
        r: &wire::CompleteRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let number = parse_task_id(id)
            .filter(|n| self.tasks.contains_key(n))
            .ok_or_else(|| ApiError::task_not_found(id))?;
        if self.tasks[&number].status == TaskStatus::Completed {
            return Ok(Reply::empty(StatusCode::OK));
        }
        self.check_lock(
            &self.tasks[&number],
            r.worker_id.as_deref(),
            r.attempt,
            false,
            now,
        )?;
        self.require_active(&self.tasks[&number].process_instance_id)?;
        refuse_top_level_null(r.variables.as_ref())?;
        let task = &self.tasks[&number];
        let advance = self
            .route(
                &task.process_instance_id,
                &task.activity_id,
                r.variables.as_ref(),
            )
            .map_err(ApiError::rejected)?;
        self.unindex(number);
        let worker = self.tasks[&number].worker_id.clone().unwrap_or_default();
        if let Some(task) = self.tasks.get_mut(&number) {
            task.status = TaskStatus::Completed;
            task.lock_expiration = None;
            task.result_variables = Some(r.variables.clone().unwrap_or_default());
            task.counters.completes += 1;
        }
        // The engine's order: `resumeFromEvent` (EVENT_CORRELATED, the user tasks reached),
        // then EXTERNAL_TASK_COMPLETED.
        let (instance, activity) = self.task_place(number);
        self.record(
            &instance,
            "EVENT_CORRELATED",
            Some(&activity),
            serde_json::json!({}),
        );
        if let Some(advance) = advance {
            self.advance(advance);
        }
        self.record(
            &instance,
            "EXTERNAL_TASK_COMPLETED",
            Some(&activity),
            serde_json::json!({"externalTaskId": id, "workerId": worker}),
        );
        Ok(Reply::empty(StatusCode::OK))
    }

    fn failure(&mut self, id: &str, r: &wire::FailureRequest, now: i64) -> Result<Reply, ApiError> {
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, false, now)?;
        self.unindex(number);
        if let Some(task) = self.tasks.get_mut(&number) {
            task.error_message = r.error_message.clone();
            task.error_details = r.error_details.clone();
            task.retries = r.retries;
            if r.retries == Some(0) {
                task.status = TaskStatus::Failed;
                task.lock_expiration = None;
            } else {
                match r.retry_timeout.filter(|t| *t > 0) {
                    // The engine hides a task by keeping it LOCKED, without a worker, until then.
                    Some(timeout) => {
                        task.status = TaskStatus::Locked;
                        task.lock_expiration = Some(now.saturating_add(timeout));
                    }
                    None => {
                        task.status = TaskStatus::Open;
                        task.lock_expiration = None;
                    }
                }
            }
            task.worker_id = None;
            task.counters.failures += 1;
        }
        self.index(number);
        let (instance, activity) = self.task_place(number);
        self.record(
            &instance,
            "EXTERNAL_TASK_FAILED",
            Some(&activity),
            serde_json::json!({"externalTaskId": id, "retries": r.retries.unwrap_or(-1)}),
        );
        Ok(Reply::empty(StatusCode::OK))
    }

    fn bpmn_error(
        &mut self,
        id: &str,
        r: &wire::BpmnErrorRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        if is_blank(r.error_code.as_deref()) {
            return Err(ApiError::rejected("BPMN errorCode is required"));
        }
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, false, now)?;
        refuse_top_level_null(r.variables.as_ref())?;
        self.unindex(number);
        let (place, activity) = self.task_place(number);
        if let Some(variables) = r.variables.as_ref().filter(|v| !v.is_empty()) {
            let names: Vec<&String> = variables.keys().collect();
            self.record(
                &place,
                "VARIABLES_UPDATED",
                None,
                serde_json::json!({"variableNames": names}),
            );
        }
        let mut failed = false;
        if let Some(instance) = self
            .tasks
            .get(&number)
            .and_then(|t| self.processes.instances.get_mut(&t.process_instance_id))
            && !instance.status.terminal()
        {
            // The engine's `failProcess`: the whole instance fails, suspended or not.
            instance.status = InstanceStatus::Failed;
            failed = true;
        }
        if failed {
            self.record(&place, "PROCESS_FAILED", None, serde_json::json!({}));
        }
        self.record(
            &place,
            "EXTERNAL_TASK_BPMN_ERROR",
            Some(&activity),
            serde_json::json!({"externalTaskId": id, "errorCode": r.error_code,
                               "errorMessage": r.error_message.clone().unwrap_or_default()}),
        );
        if let Some(task) = self.tasks.get_mut(&number) {
            task.status = TaskStatus::BpmnError;
            task.bpmn_error_code = r.error_code.clone();
            task.bpmn_error_message = r.error_message.clone();
            task.worker_id = None;
            task.lock_expiration = None;
            task.result_variables = Some(r.variables.clone().unwrap_or_default());
            task.counters.bpmn_errors += 1;
        }
        Ok(Reply::empty(StatusCode::NO_CONTENT))
    }

    fn journal_read(
        &mut self,
        id: &str,
        r: &wire::JournalReadRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, true, now)?;
        let task = &self.tasks[&number];
        Ok(Reply {
            status: StatusCode::OK,
            body: Some(serde_json::json!({"attempt": task.attempt, "steps": task.journal})),
        })
    }

    fn journal_append(
        &mut self,
        id: &str,
        r: &wire::JournalAppendRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, true, now)?;
        // The HTTP layer checked that the step is an object with an integer seq >= 1.
        let step = r.step.clone().unwrap_or_default();
        let seq = step.get("seq").and_then(Value::as_u64).unwrap_or(0);
        let Some(task) = self.tasks.get_mut(&number) else {
            return Err(ApiError::task_not_found(id));
        };
        let next = task.journal.len() as u64 + 1;
        if seq < next {
            let stored = &task.journal[(seq - 1) as usize];
            if *stored == step {
                return Ok(Reply::empty(StatusCode::OK));
            }
            return Err(journal_conflict(format!(
                "Journal step {seq} of external task {id} holds a different step"
            )));
        }
        if seq > next {
            return Err(journal_conflict(format!(
                "Journal step {seq} of external task {id} leaves a gap: the next step is {next}"
            )));
        }
        task.journal.push(step);
        task.counters.journal_appends += 1;
        Ok(Reply::empty(StatusCode::CREATED))
    }

    fn tool_credentials(
        &mut self,
        id: &str,
        r: &wire::ToolCredentialsRequest,
        now: i64,
    ) -> Result<Reply, ApiError> {
        let number = self.owned(id, r.worker_id.as_deref(), r.attempt, true, now)?;
        let server = r.server.clone().unwrap_or_default();
        let mut bytes = [0u8; 24];
        rand::rng().fill_bytes(&mut bytes);
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let expires_at = now.saturating_add(self.credential_ttl_ms);
        if self.credentials.len() >= 1024 {
            self.credentials.retain(|_, c| c.expires_at > now);
        }
        let Some(task) = self.tasks.get_mut(&number) else {
            return Err(ApiError::task_not_found(id));
        };
        task.counters.credentials_issued += 1;
        self.credentials.insert(
            token.clone(),
            Credential {
                server,
                task: number,
                attempt: task.attempt,
                worker_id: task.worker_id.clone().unwrap_or_default(),
                expires_at,
            },
        );
        Ok(Reply {
            status: StatusCode::OK,
            body: Some(serde_json::json!({
                "token": token,
                "expiresAt": wire::format_time(expires_at),
            })),
        })
    }
}

/// The engine copies the variables with `Map.copyOf`, which throws on a null value: a top-level
/// JSON `null` is a 500 and nothing is stored (nested nulls are fine).
fn refuse_top_level_null(variables: Option<&Map<String, Value>>) -> Result<(), ApiError> {
    if variables.is_some_and(|v| v.values().any(Value::is_null)) {
        return Err(ApiError::internal(StatusCode::INTERNAL_SERVER_ERROR));
    }
    Ok(())
}

/// A token about to move: the instance, its variables after the merge, where it comes to rest.
struct Advance {
    instance: String,
    variables: Map<String, Value>,
    wait: Wait,
}

/// Process instances (see `process`): starting them, and moving their token when one of their
/// tasks completes.
impl EngineState {
    /// Deploys `model` as the next version of its key, with `bpmn_xml` as the XML the process
    /// API serves (else a minimal XML of its service tasks). Instances keep running on the
    /// model they are routed by, as the engine's instances do; the process API shows only the
    /// latest version.
    pub fn deploy(&mut self, model: ProcessModel, bpmn_xml: Option<String>) {
        let version = self
            .processes
            .deployments
            .get(&model.id)
            .map_or(1, |d| d.version + 1);
        let bpmn_xml = bpmn_xml.unwrap_or_else(|| process::minimal_bpmn(&model));
        self.processes.deployments.insert(
            model.id.clone(),
            process::Deployment {
                version,
                bpmn_xml,
                created_at_ms: chrono::Utc::now().timestamp_millis(),
            },
        );
        self.processes
            .versions
            .insert((model.id.clone(), version), model.clone());
        self.processes.models.insert(model.id.clone(), model);
    }

    pub fn deny_process_reads(&mut self, denied: bool) {
        self.processes.reads_denied = denied;
    }

    pub fn process_reads_denied(&self) -> bool {
        self.processes.reads_denied
    }

    /// `GET /api/v1/processes/{id}`: the latest deployed version.
    pub fn process_definition(&self, id: &str) -> Option<process::ProcessDefinitionView> {
        self.processes.definition_view(id)
    }

    /// The engine's start: the instance's token runs to its first waiting node.
    pub fn start_process(
        &mut self,
        process_id: &str,
        variables: Map<String, Value>,
        actor: &str,
        now: i64,
    ) -> Result<String, String> {
        let model = self
            .processes
            .models
            .get(process_id)
            .ok_or_else(|| format!("Unknown process ID: {process_id}"))?;
        let mut variables = variables;
        let wait = process::walk(model, &model.start, &mut variables, None)?;
        let start = model.start.clone();
        let version = self
            .processes
            .deployments
            .get(process_id)
            .map_or(1, |d| d.version);
        let instance = self.processes.new_instance_id();
        self.processes.instances.insert(
            instance.clone(),
            process::Instance::started(process::Token {
                model: process_id.to_string(),
                version,
                variables: Map::new(),
                current: start,
            }),
        );
        // The engine records the start (at its start event: `start` in the worked example)
        // before the user tasks it reached.
        self.acting(actor, now);
        self.record(
            &instance,
            "PROCESS_STARTED",
            Some("start"),
            serde_json::json!({}),
        );
        self.advance(Advance {
            instance: instance.clone(),
            variables,
            wait,
        });
        Ok(instance)
    }

    /// Where the token of `instance` goes when its task at `activity_id` completes with
    /// `variables`, without changing anything: `None` for a task outside any running process
    /// instance (created through the admin API), `Err` with the engine's refusal.
    fn route(
        &self,
        instance: &str,
        activity_id: &str,
        variables: Option<&Map<String, Value>>,
    ) -> Result<Option<Advance>, String> {
        let Some(state) = self
            .processes
            .instances
            .get(instance)
            .filter(|i| i.status == InstanceStatus::Running)
            .and_then(|i| i.token.as_ref())
        else {
            return Ok(None);
        };
        let Some(model) = self.processes.model_of(state) else {
            return Ok(None);
        };
        let mut merged = state.variables.clone();
        if let Some(variables) = variables {
            merged.extend(variables.clone());
        }
        let next = process::next_of(model, activity_id)
            .ok_or_else(|| format!("Process {} has no task {activity_id}", model.id))?;
        let wait = process::walk(model, &next, &mut merged, Some(activity_id))?;
        Ok(Some(Advance {
            instance: instance.to_string(),
            variables: merged,
            wait,
        }))
    }

    /// Moves the token: a new external task, a new user task, or the end.
    fn advance(&mut self, advance: Advance) {
        let Advance {
            instance,
            variables,
            wait,
        } = advance;
        let user_task = self.processes.new_user_task(&instance, &wait);
        if let Wait::User { activity_id, .. } = &wait {
            self.record(
                &instance,
                "TASK_CREATED",
                Some(activity_id),
                serde_json::json!({"assignee": "", "assignmentStrategy": "CLAIM"}),
            );
        }
        let Some(record) = self.processes.instances.get_mut(&instance) else {
            return;
        };
        if matches!(wait, Wait::End { .. }) {
            record.status = InstanceStatus::Completed;
        }
        let Some(state) = record.token.as_mut() else {
            return;
        };
        state.variables = variables;
        match wait {
            Wait::External {
                activity_id,
                topic,
                agent,
            } => {
                state.current = activity_id.clone();
                let spec = TaskSpec {
                    topic: Some(topic),
                    variables: state.variables.clone(),
                    agent,
                    // A new external task starts with the engine's default of 3.
                    retries: Some(3),
                    activity_id: Some(activity_id),
                    process_instance_id: Some(instance),
                    trace_parent: None,
                };
                self.create_task(spec);
            }
            Wait::User { activity_id, .. } => {
                debug_assert!(user_task.is_some());
                state.current = activity_id;
            }
            Wait::End { activity_id } => state.current = activity_id,
        }
    }

    pub fn process_instance(&self, id: &str) -> Option<process::ProcessInstanceView> {
        self.processes.instance_view(id)
    }

    pub fn user_tasks(
        &self,
        caller: &Caller,
        status: Option<process::UserTaskStatus>,
    ) -> Vec<process::UserTaskView> {
        self.processes.visible_user_tasks(caller, status)
    }

    pub fn user_task(&self, id: &str) -> Option<process::UserTaskView> {
        let task = self.processes.user_tasks.get(id)?;
        Some(self.processes.user_task_view(task))
    }

    pub fn claim_user_task(&mut self, id: &str, caller: &Caller, now: i64) -> Result<(), String> {
        self.processes.claim(id, caller)?;
        if let Some(task) = self.processes.user_tasks.get(id) {
            let (instance, activity) = (task.instance.clone(), task.activity_id.clone());
            self.acting(&caller.user, now);
            self.record(
                &instance,
                "TASK_CLAIMED",
                Some(&activity),
                serde_json::json!({"assignee": caller.user}),
            );
        }
        Ok(())
    }

    /// The engine's user-task completion: the variables are merged and the token moves on (or
    /// nothing changes when the engine refuses).
    pub fn complete_user_task(
        &mut self,
        id: &str,
        caller: &Caller,
        variables: Map<String, Value>,
        now: i64,
    ) -> Result<(), String> {
        let (instance, activity_id) = self.processes.check_completion(id, caller)?;
        self.require_active(&instance).map_err(|e| e.message)?;
        let advance = self
            .route(&instance, &activity_id, Some(&variables))?
            .ok_or_else(|| format!("Process instance is not running: {instance}"))?;
        if let Some(task) = self.processes.user_tasks.get_mut(id) {
            task.status = process::UserTaskStatus::Completed;
            task.assignee.get_or_insert_with(|| caller.user.clone());
        }
        // The engine's `completeTask`: TASK_COMPLETED by the completer (nothing of the
        // variables), then the user tasks reached.
        self.acting(&caller.user, now);
        self.record(
            &instance,
            "TASK_COMPLETED",
            Some(&activity_id),
            serde_json::json!({}),
        );
        self.advance(advance);
        Ok(())
    }
}

fn journal_conflict(message: String) -> ApiError {
    ApiError::new(StatusCode::CONFLICT, wire::code::JOURNAL_CONFLICT, message)
}

fn view(task: &Task) -> TaskView {
    TaskView {
        id: task.id.clone(),
        topic: task.topic.clone(),
        status: task.status,
        worker_id: task.worker_id.clone(),
        attempt: task.attempt,
        retries: task.retries,
        lock_expiration_time: task
            .lock_expiration
            .and_then(chrono::DateTime::from_timestamp_millis),
        hidden: task.status == TaskStatus::Locked && task.worker_id.is_none(),
        variables: task.variables.clone(),
        process_instance_id: task.process_instance_id.clone(),
        activity_id: task.activity_id.clone(),
        trace_parent: task.trace_parent.clone(),
        agent: task.agent.clone(),
        result_variables: task.result_variables.clone(),
        error_message: task.error_message.clone(),
        error_details: task.error_details.clone(),
        bpmn_error_code: task.bpmn_error_code.clone(),
        bpmn_error_message: task.bpmn_error_message.clone(),
        journal: task.journal.clone(),
        counters: task.counters.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_ids_round_trip_and_reject_other_spellings() {
        assert_eq!(task_id(17), "t-000017");
        assert_eq!(parse_task_id("t-000017"), Some(17));
        assert_eq!(parse_task_id("t-17"), None);
        assert_eq!(parse_task_id("x"), None);
    }

    #[test]
    fn acquisition_round_robins_topics_in_id_order() {
        let mut state = EngineState::new(ProtocolLevel::AgentV1, 60_000, 10);
        for topic in ["a", "a", "b"] {
            state.create_task(TaskSpec {
                topic: Some(topic.into()),
                ..Default::default()
            });
        }
        let fetch = Command::FetchAndLock(wire::FetchAndLockRequest {
            worker_id: Some("w".into()),
            topics: Some(vec!["a".into(), "b".into()]),
            lock_duration: Some(1000),
            max_tasks: Some(3),
        });
        let (reply, _) = state
            .run(Operation::FetchAndLock, None, None, &fetch, 0, "w")
            .unwrap();
        let ids: Vec<_> = reply
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids, ["t-000001", "t-000003", "t-000002"]);
    }

    fn fetch(state: &mut EngineState, worker: &str, max_tasks: i64) -> Vec<String> {
        let fetch = Command::FetchAndLock(wire::FetchAndLockRequest {
            worker_id: Some(worker.into()),
            topics: Some(vec![AGENT_TOPIC.into()]),
            lock_duration: Some(60_000),
            max_tasks: Some(max_tasks),
        });
        let (reply, _) = state
            .run(Operation::FetchAndLock, None, None, &fetch, 0, "w")
            .unwrap();
        reply
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn a_capped_engine_answers_partially_and_each_fetch_gets_its_own_tasks() {
        let mut state = EngineState::new(ProtocolLevel::AgentV1, 60_000, 10);
        for _ in 0..5 {
            state.create_task(TaskSpec::default());
        }
        state.set_answer_cap(std::num::NonZeroU32::new(2));
        assert_eq!(fetch(&mut state, "a", 8), ["t-000001", "t-000002"]);
        assert_eq!(fetch(&mut state, "b", 8), ["t-000003", "t-000004"]);
        assert_eq!(
            fetch(&mut state, "a", 1),
            ["t-000005"],
            "below the cap: as asked"
        );
        assert!(fetch(&mut state, "b", 8).is_empty());
        state.set_answer_cap(None);
        for _ in 0..5 {
            state.create_task(TaskSpec::default());
        }
        assert_eq!(fetch(&mut state, "a", 8).len(), 5, "uncapped again");
    }

    fn complete(state: &mut EngineState, id: &str, worker: &str, variables: Value, now: i64) {
        let command = Command::Complete(wire::CompleteRequest {
            worker_id: Some(worker.into()),
            variables: serde_json::from_value(variables).unwrap(),
            attempt: None,
        });
        state
            .run(Operation::Complete, Some(id), None, &command, now, worker)
            .unwrap();
    }

    /// One approval round trip writes the entries the real engine writes, in its order, each by
    /// who made the call (`ActivityHistoryService`, `ExternalTaskCommandService.complete`,
    /// `AbadaEngine.completeTask`); a script task between writes variables and no entry.
    #[test]
    fn an_approval_round_trip_leaves_the_engines_history_and_a_script_leaves_none() {
        let mut state = EngineState::new(ProtocolLevel::PlainV1, 60_000, 10);
        state.deploy(ProcessModel::refund_approval(None), None);
        let instance = state
            .start_process("refundApproval", Map::new(), "starter", 5)
            .unwrap();
        let first = fetch(&mut state, "w", 1);
        complete(
            &mut state,
            &first[0],
            "w",
            serde_json::json!({"agentStatus": "approval-required"}),
            10,
        );
        let user_task = state.processes.user_tasks.keys().next().unwrap().clone();
        let alice = Caller {
            user: "alice".into(),
            groups: vec!["refund-approvers".into()],
        };
        state
            .complete_user_task(&user_task, &alice, Map::new(), 20)
            .unwrap();
        let second = fetch(&mut state, "w", 1);
        let entries = state.history(&instance);
        let seen: Vec<(&str, &str, Option<&str>)> = entries
            .iter()
            .map(|e| {
                (
                    e.event_type.as_str(),
                    e.actor.as_str(),
                    e.details.get("externalTaskId").and_then(Value::as_str),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("PROCESS_STARTED", "starter", None),
                ("EXTERNAL_TASK_LOCKED", "w", Some(first[0].as_str())),
                ("EVENT_CORRELATED", "w", None),
                ("TASK_CREATED", "w", None),
                ("EXTERNAL_TASK_COMPLETED", "w", Some(first[0].as_str())),
                ("TASK_COMPLETED", "alice", None),
                ("EXTERNAL_TASK_LOCKED", "w", Some(second[0].as_str())),
            ]
        );
        assert!(
            entries
                .iter()
                .all(|e| e.process_definition_id.as_deref() == Some("refundApproval"))
        );
        let page = state.history_page(&instance, 1, 3).unwrap();
        assert_eq!((page.total_count, page.total_pages), (7, 3));
        assert_eq!(page.entries[0].event_type, "TASK_CREATED");
        assert!(state.history_page("pi-nope", 0, 50).is_none());

        // A script task between the user task and the agent: it copies the requestId into an
        // approval, and the history shows no more than the user task's completion.
        let mut model = ProcessModel::refund_approval(None);
        let approve = model
            .nodes
            .iter_mut()
            .find(|n| n.id == "approveRefund")
            .unwrap();
        if let process::NodeKind::UserTask { next, .. } = &mut approve.kind {
            *next = "forge".into();
        }
        let writes = serde_json::json!({"agentApproval": {
            "requestId": "${agentApprovalRequest.requestId}",
            "callId": "${agentApprovalRequest.callId}",
            "approved": true, "decidedBy": "alice"}});
        model.nodes.push(process::ProcessNode {
            id: "forge".into(),
            kind: process::NodeKind::ScriptTask {
                script: "variables.put('agentApproval', ...)".into(),
                writes: serde_json::from_value(writes).unwrap(),
                next: "refundAgent".into(),
            },
        });
        let mut state = EngineState::new(ProtocolLevel::PlainV1, 60_000, 10);
        state.deploy(model, None);
        let instance = state
            .start_process("refundApproval", Map::new(), "starter", 5)
            .unwrap();
        let first = fetch(&mut state, "w", 1);
        let request = serde_json::json!({"requestId": "r-1", "callId": "call_0"});
        complete(
            &mut state,
            &first[0],
            "w",
            serde_json::json!({"agentStatus": "approval-required", "agentApprovalRequest": request}),
            10,
        );
        let user_task = state.processes.user_tasks.keys().next().unwrap().clone();
        let mallory = Caller {
            user: "mallory".into(),
            groups: vec!["refund-approvers".into()],
        };
        state
            .complete_user_task(&user_task, &mallory, Map::new(), 20)
            .unwrap();
        let variables = state.process_instance(&instance).unwrap().variables;
        assert_eq!(
            variables["agentApproval"],
            serde_json::json!({"requestId": "r-1", "callId": "call_0", "approved": true, "decidedBy": "alice"})
        );
        let kinds: Vec<String> = state
            .history(&instance)
            .into_iter()
            .map(|e| e.event_type)
            .collect();
        assert_eq!(kinds.iter().filter(|k| *k == "TASK_COMPLETED").count(), 1);
        assert_eq!(kinds.len(), 6, "{kinds:?}");
    }
}
