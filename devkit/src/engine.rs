//! The engine emulator: an in-process HTTP server that speaks the Abada external-worker protocol
//! v1 exactly as the real engine does (`protocol.md` Part A: status codes, error bodies and
//! messages, idempotency replay, lease expiry and takeover) plus the agent/1 extension (Part B:
//! attempts as fencing tokens, the journal, tool credentials). It is the reference the worker is
//! tested against, and what `dev-engine` and the demo run.
//!
//! Clients use `http://127.0.0.1:<port>/api` as the engine URL ([`EngineEmulator::base_url`]).
//! Time is the emulator's own clock: real time plus an offset that [`EngineEmulator::advance`]
//! moves forward, so a test can expire leases without sleeping. Leases are evaluated lazily
//! against it.
//!
//! # Admin API
//!
//! Everything below is also a method on [`EngineEmulator`]. It is served on the same port, is
//! never subject to the [`Authorizer`], and answers admin mistakes with `400 {"error": ".."}`.
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `POST /admin/tasks` | a [`TaskSpec`] or an array of them | 201 `{"ids": [..]}` |
//! | `GET /admin/tasks` | | array of [`TaskView`] (status, worker, attempt, retries, lease, results, journal, counters) |
//! | `GET /admin/tasks/{id}` | | one [`TaskView`], or 404 |
//! | `POST /admin/tasks/{id}/retries` | `{"retries": 3}` | 204: an operator resolves an incident, the task is `OPEN` again |
//! | `GET /admin/calls` | | array of [`CallRecord`], oldest first |
//! | `DELETE /admin/calls` | | 204, call log emptied |
//! | `GET /admin/clock` | | `{"now": "..", "offsetMs": n}` |
//! | `POST /admin/clock/advance` | `{"ms": 120000}` | the new clock |
//! | `POST /admin/faults` | a [`Fault`] | 204 |
//! | `DELETE /admin/faults` | | 204, every fault and the outage cleared |
//! | `POST /admin/outage` | `{"enabled": true}` | 204 |
//! | `POST /admin/fetch-answer-cap` | `{"maxTasks": 2}` (`null`: no cap) | 204: every fetch answers at most that many tasks, as concurrent fetches under `SKIP LOCKED` do |
//! | `POST /admin/fetch-contention` | `{"transactionMs": 15, "locks": "everyCandidate"}` (`locks` optional, or `"returnedRows"`; `{"transactionMs": null}`: off) | 204: each fetch's transaction lasts that long and holds its row locks meanwhile, as on the real engine (module `contention`) |
//! | `GET /admin/instances/{id}` | | `{"status": "RUNNING", "suspended": false}` ([`InstanceView`]), or 404 |
//! | `POST /admin/instances/{id}` | `{"action": "suspend"}` (`resume`, `cancel`, `fail`) | 204, or 400 with the engine's message (cancelling an ended instance) |
//! | `POST /admin/tool-credentials/verify` | `{"server": "orders", "token": ".."}` | `{"valid": true, "taskId": "t-000001", "attempt": 1}` or `{"valid": false}` |
//!
//! ```text
//! curl -s -XPOST localhost:5601/admin/tasks -H 'content-type: application/json' \
//!      -d '{"variables": {"customerId": "c-17"}, "retries": 3}'
//! curl -s localhost:5601/admin/tasks/t-000001
//! curl -s -XPOST localhost:5601/admin/clock/advance -d '{"ms": 130000}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "dropResponse", "operation": "complete", "count": 1}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "latency", "operation": "heartbeat", "delayMs": 2000}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "serverError", "operation": "fetch-and-lock", "count": 3}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "omitProtocolHeader", "count": 1}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "refuseHeartbeats", "taskId": "t-000001"}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "concurrentModification", "operation": "complete", "count": 1}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "throttle", "operation": "fetch-and-lock", "count": 2, "retryAfterSecs": 1}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "badBody", "operation": "journal-read", "count": 1, "body": "wrongJson"}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "resetConnection", "operation": "heartbeat", "count": 1}'
//! curl -s -XPOST localhost:5601/admin/faults -d '{"kind": "reject", "operation": "complete", "taskId": "t-000001", "count": 1, "message": "No matching condition and no default flow for gateway agentOutcome"}'
//! curl -s -XPOST localhost:5601/admin/instances/p-000001 -d '{"action": "suspend"}'
//! curl -s -XPOST localhost:5601/admin/outage -d '{"enabled": true}'
//! curl -s -XPOST localhost:5601/admin/fetch-answer-cap -d '{"maxTasks": 2}'
//! curl -s -XPOST localhost:5601/admin/fetch-contention -d '{"transactionMs": 15}'
//! curl -s -XDELETE localhost:5601/admin/faults
//! ```
//!
//! Processes: [`EngineEmulator::deploy`] a [`ProcessModel`] (service tasks, user tasks, script
//! tasks, exclusive gateways), start it (`POST /api/v1/processes/start?processId=`), and its
//! external tasks appear, loop back and end as on the real engine; user tasks are served on the engine's
//! `/api/v1/tasks` paths (module `process_api`, rules in `process`), and every instance's
//! activity history, with who did what as the security mode establishes it, on
//! `/api/v1/process-instances/{id}/history` (module `history`).
//!
//! Outage: while on, every `/api` request has its connection closed without an HTTP response
//! (clients see a connection error, as with an engine pod that is gone); `/admin` still answers.
//!
//! Fidelity notes (checked against the real engine 0.11, docs/REAL_ENGINE.md): the
//! `X-Abada-Worker-Protocol-Version` header is sent on fetch-and-lock answers only, never on
//! errors or other operations. Only successful commands are stored for idempotency (a refusal
//! rolls the engine's reservation back), so a refused command retried with the same key runs
//! again. Process instances are a status and a suspension flag, changed by the admin API and
//! by `bpmn-error` (see `state` for the rules the worker meets); there is no process model, so
//! a gateway that routes nowhere is emulated with [`Fault::Reject`]. Lease expiries carry nine
//! fractional digits, and 400 and 500 answers close the connection (`Connection: close`), as
//! Tomcat does under the real engine.
//!
//! Contention (off unless set, [`EngineEmulator::set_fetch_contention`]): by default each fetch
//! runs alone at one instant, so fetches of several workers never overlap and each gets its
//! own tasks, as on the real engine on PostgreSQL. The real engine on H2 (its `dev` profile,
//! which every real-engine run here used) locks every row its acquisition query matches until
//! its fetch's transaction commits, so a fetch that starts meanwhile answers empty on a deep
//! backlog; [`FetchContention`] makes the emulator do so (the rule, and the engine's source
//! files it comes from, are in the `contention` module).

mod admin;
mod contention;
mod core;
mod faults;
mod history;
mod http;
mod process;
mod process_api;
mod proxy;
mod state;
mod wire;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use axum::http::HeaderMap;
pub use contention::{FetchContention, FetchLocks};
pub use core::{CoreRefusal, CoreReply, EngineCore};
pub use faults::{BadBody, Fault};
pub use history::HistoryEntry;
pub use process::{
    ConditionalFlow, InstanceStatus, NodeKind, ProcessInstanceView, ProcessModel, ProcessNode,
    UserTaskStatus, UserTaskView,
};
pub use proxy::ProxyAuthorizer;
pub use state::{
    AGENT_TOPIC, CallRecord, Disposition, InstanceAction, InstanceView, Operation, TaskCounters,
    TaskSpec, TaskStatus, TaskView,
};

/// How much of Part B the emulated engine speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ProtocolLevel {
    /// Part A plus agent/1: `attempt` and `agent` on tasks, journal, tool credentials, fencing.
    #[default]
    AgentV1,
    /// agent/1 without a journal: both journal endpoints answer 404 `RESOURCE_NOT_FOUND`.
    AgentV1WithoutJournal,
    /// Plain engine 0.11: no `attempt`/`agent` on tasks, every agent/1 endpoint answers 404,
    /// and an `attempt` in a body is ignored.
    PlainV1,
}

/// Why an [`Authorizer`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthRejection {
    /// 401 `AUTHENTICATION_REQUIRED` with this message.
    Unauthenticated(String),
    /// 403 `ACCESS_DENIED` with this message.
    AccessDenied(String),
}

/// The engine's answer to a request its authorizer refused: 401 or 403 with the engine's codes.
pub(crate) fn auth_error(rejection: AuthRejection) -> wire::ApiError {
    match rejection {
        AuthRejection::Unauthenticated(m) => wire::ApiError::new(
            axum::http::StatusCode::UNAUTHORIZED,
            wire::code::AUTHENTICATION_REQUIRED,
            m,
        ),
        AuthRejection::AccessDenied(m) => wire::ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            wire::code::ACCESS_DENIED,
            m,
        ),
    }
}

/// Decides whether an `/api` request may proceed (the engine's secured modes). Not applied to
/// `/admin`. With an authorizer set the emulator also behaves as a secured engine for
/// completion bodies (`workerId` required, no legacy body).
pub trait Authorizer: Send + Sync {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection>;

    /// Whether the caller may read the process API (`GET /api/v1/processes/...`), which the
    /// engine guards with `process:read` rather than `worker:execute`. The default applies the
    /// same rule as [`Authorizer::authorize`].
    fn authorize_process_read(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        self.authorize(headers)
    }

    /// Whether the caller may read the operations API (`GET /api/v1/process-instances/**`, an
    /// instance's activity history), which the engine guards with `operations:read` (or the
    /// operator and admin roles). The default applies [`Authorizer::authorize`].
    fn authorize_operations_read(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        self.authorize(headers)
    }

    /// Whether the caller may use the user-task API (`/api/v1/tasks/**`: `task:read` to list,
    /// `task:write` to claim and complete, or the task-user and admin roles). The default lets
    /// every caller through, as the emulator did before it emulated this rule.
    fn authorize_user_tasks(&self, headers: &HeaderMap, write: bool) -> Result<(), AuthRejection> {
        let _ = (headers, write);
        Ok(())
    }

    /// Who the caller is, as the engine's `IdentityContextInterceptor` establishes it in this
    /// security mode: the user and groups the user-task API checks, and the `actor` of the
    /// history entries the request writes. `None`: the `disabled` mode's rule (`X-User`, else
    /// `anonymous`; groups from `X-Groups`).
    fn identity(&self, headers: &HeaderMap) -> Option<(String, Vec<String>)> {
        let _ = headers;
        None
    }
}

/// How to start the emulator.
#[derive(Clone)]
pub struct EmulatorOptions {
    /// Default `127.0.0.1:0` (a free loopback port).
    pub bind: SocketAddr,
    pub protocol: ProtocolLevel,
    pub authorizer: Option<Arc<dyn Authorizer>>,
    /// Lifetime of an issued tool credential. Default 10 minutes.
    pub credential_ttl: Duration,
    /// The call log keeps the most recent this many calls. Default 100 000.
    pub call_log_capacity: usize,
}

impl Default for EmulatorOptions {
    fn default() -> Self {
        EmulatorOptions {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            protocol: ProtocolLevel::default(),
            authorizer: None,
            credential_ttl: Duration::from_secs(600),
            call_log_capacity: 100_000,
        }
    }
}

impl std::fmt::Debug for EmulatorOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatorOptions")
            .field("bind", &self.bind)
            .field("protocol", &self.protocol)
            .field("authorizer", &self.authorizer.as_ref().map(|_| "<set>"))
            .field("credential_ttl", &self.credential_ttl)
            .field("call_log_capacity", &self.call_log_capacity)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    #[error("engine emulator cannot listen on {addr}: {source}; choose a free address or port 0")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The emulator's clock: wall time at start, plus monotonic time elapsed since, plus an offset
/// that only moves forward, so "now" never goes back.
pub(crate) struct Clock {
    start_wall_ms: i64,
    start: std::time::Instant,
    offset_ms: AtomicI64,
}

impl Clock {
    fn new() -> Self {
        Clock {
            start_wall_ms: chrono::Utc::now().timestamp_millis(),
            start: std::time::Instant::now(),
            offset_ms: AtomicI64::new(0),
        }
    }

    /// Milliseconds since the Unix epoch, emulator time.
    pub(crate) fn now_ms(&self) -> i64 {
        let elapsed = i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX / 4);
        self.start_wall_ms
            .saturating_add(elapsed)
            .saturating_add(self.offset_ms.load(Ordering::SeqCst))
    }

    pub(crate) fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp_millis(self.now_ms()).unwrap_or_default()
    }

    pub(crate) fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::SeqCst)
    }

    pub(crate) fn advance(&self, by: Duration) {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX / 4);
        let _ = self
            .offset_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |offset| {
                Some(offset.saturating_add(by))
            });
    }
}

/// What the HTTP handlers and the handle share.
pub(crate) struct Shared {
    /// Never held across an await: every command is one short critical section.
    state: Mutex<state::EngineState>,
    faults: Mutex<faults::Faults>,
    clock: Clock,
    protocol: ProtocolLevel,
    authorizer: Option<Arc<dyn Authorizer>>,
    /// Woken after every request and admin change, for [`EngineEmulator::wait_for`].
    changed: tokio::sync::Notify,
}

impl Shared {
    /// The state, even if a panicking thread poisoned the lock (the state is still consistent:
    /// every command validates before it mutates).
    fn state(&self) -> MutexGuard<'_, state::EngineState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn faults(&self) -> MutexGuard<'_, faults::Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn create_tasks(&self, specs: Vec<TaskSpec>) -> Vec<String> {
        let ids = {
            let mut state = self.state();
            specs.into_iter().map(|s| state.create_task(s)).collect()
        };
        self.changed.notify_waiters();
        ids
    }

    fn record_call(&self, record: CallRecord) {
        self.state().record_call(record);
        self.changed.notify_waiters();
    }

    /// The caller's identity ([`Authorizer::identity`], else the `disabled` mode's headers).
    fn caller(&self, headers: &HeaderMap) -> process::Caller {
        if let Some((user, groups)) = self.authorizer.as_ref().and_then(|a| a.identity(headers)) {
            return process::Caller { user, groups };
        }
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
        };
        process::Caller {
            user: header("x-user").unwrap_or("anonymous").to_string(),
            groups: header("x-groups")
                .map(|g| {
                    g.split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

/// A cloneable handle on a running emulator. Dropping handles does not stop the server;
/// [`EngineEmulator::shutdown`] does.
#[derive(Clone)]
pub struct EngineEmulator {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: CancellationToken,
    server_closed: Arc<AtomicBool>,
    server: Arc<Mutex<Option<JoinHandle<()>>>>,
}

/// Starts the emulator on `opts.bind` and returns once it accepts connections.
pub async fn start(opts: EmulatorOptions) -> Result<EngineEmulator, EmulatorError> {
    let listener = tokio::net::TcpListener::bind(opts.bind)
        .await
        .map_err(|source| EmulatorError::Bind {
            addr: opts.bind,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| EmulatorError::Bind {
            addr: opts.bind,
            source,
        })?;
    let shared = Arc::new(Shared {
        state: Mutex::new(state::EngineState::new(
            opts.protocol,
            i64::try_from(opts.credential_ttl.as_millis()).unwrap_or(i64::MAX / 4),
            opts.call_log_capacity,
        )),
        faults: Mutex::new(faults::Faults::default()),
        clock: Clock::new(),
        protocol: opts.protocol,
        authorizer: opts.authorizer,
        changed: tokio::sync::Notify::new(),
    });
    let server_closed = Arc::new(AtomicBool::new(false));
    let listener = http::EmulatorListener {
        inner: listener,
        server_closed: server_closed.clone(),
    };
    let app =
        http::router(shared.clone()).into_make_service_with_connect_info::<http::ConnHandle>();
    let stop = CancellationToken::new();
    let serve = axum::serve(listener, app).with_graceful_shutdown(stop.clone().cancelled_owned());
    let server = tokio::spawn(async move {
        // The listener retries failed accepts itself, so serve only ends at shutdown.
        let _ = serve.await;
    });
    Ok(EngineEmulator {
        shared,
        addr,
        stop,
        server_closed,
        server: Arc::new(Mutex::new(Some(server))),
    })
}

impl EngineEmulator {
    /// The engine URL for clients: `http://127.0.0.1:<port>/api`.
    pub fn base_url(&self) -> String {
        format!("http://{}/api", self.addr)
    }

    /// The root URL, for the admin API: `http://127.0.0.1:<port>`.
    pub fn root_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn protocol(&self) -> ProtocolLevel {
        self.shared.protocol
    }

    /// Creates one task; returns its id.
    pub fn create_task(&self, spec: TaskSpec) -> String {
        let mut ids = self.shared.create_tasks(vec![spec]);
        ids.pop().unwrap_or_default()
    }

    /// Creates several tasks at once, in order; returns their ids.
    pub fn create_tasks(&self, specs: impl IntoIterator<Item = TaskSpec>) -> Vec<String> {
        self.shared.create_tasks(specs.into_iter().collect())
    }

    pub fn task(&self, id: &str) -> Option<TaskView> {
        self.shared.state().task_view(id)
    }

    /// Every task, in id order.
    pub fn tasks(&self) -> Vec<TaskView> {
        self.shared.state().task_views()
    }

    /// The engine's "set retries": the task is `OPEN` again. False when there is no such task.
    pub fn set_retries(&self, id: &str, retries: i32) -> bool {
        let found = self.shared.state().set_retries(id, retries);
        self.shared.changed.notify_waiters();
        found
    }

    /// The process instance `id` (known once a task names it).
    pub fn instance(&self, id: &str) -> Option<InstanceView> {
        self.shared.state().instance_view(id)
    }

    /// Seeds task `id`'s agent/1 journal with `steps` (replacing what it holds), so the next
    /// journal read returns them: a task that earlier attempts journaled, or an engine that
    /// answers a journal of any size. Steps are stored as given (no `seq` check). False when
    /// there is no such task.
    pub fn seed_journal(&self, id: &str, steps: Vec<serde_json::Value>) -> bool {
        let found = self.shared.state().seed_journal(id, steps);
        self.shared.changed.notify_waiters();
        found
    }

    /// An operator's action on process instance `id`: `Err` with the engine's message when the
    /// engine refuses it (or the instance is unknown). Its tasks stay as they are.
    pub fn instance_action(&self, id: &str, action: InstanceAction) -> Result<(), String> {
        let result = self.shared.state().instance_action(id, action);
        self.shared.changed.notify_waiters();
        result
    }

    /// Deploys a process model (replacing one with the same id), for [`EngineEmulator::start_process`]
    /// and `POST /api/v1/processes/start`.
    pub fn deploy(&self, model: ProcessModel) {
        self.shared.state().deploy(model, None);
    }

    /// Deploys `model` with the BPMN XML the process API serves for it
    /// (`GET /api/v1/processes/{id}`), as the next version of its key: what a worker reads for
    /// agents defined in the BPMN. The emulator routes by `model`; it does not parse the XML.
    pub fn deploy_bpmn(&self, model: ProcessModel, bpmn_xml: impl Into<String>) {
        self.shared.state().deploy(model, Some(bpmn_xml.into()));
    }

    /// Makes the process API's reads (`GET /api/v1/processes/...`) answer 403 ACCESS_DENIED
    /// (`denied`), as the engine answers an identity without `process:read`.
    pub fn deny_process_reads(&self, denied: bool) {
        self.shared.state().deny_process_reads(denied);
    }

    /// Starts an instance of a deployed process; `Err` with the engine's message.
    pub fn start_process(
        &self,
        process_id: &str,
        variables: serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let now = self.shared.clock.now_ms();
        let result = self
            .shared
            .state()
            .start_process(process_id, variables, "anonymous", now);
        self.shared.changed.notify_waiters();
        result
    }

    /// The activity history of process instance `id`, oldest first, as the engine's
    /// `GET /v1/process-instances/{id}/history` pages it.
    pub fn history(&self, id: &str) -> Vec<HistoryEntry> {
        self.shared.state().history(id)
    }

    /// A process instance started from a deployed model, as the engine's API shows it.
    pub fn process_instance(&self, id: &str) -> Option<ProcessInstanceView> {
        self.shared.state().process_instance(id)
    }

    /// Waits until `check` returns `Some`, re-checking after every request the emulator
    /// answers and every admin change (no polling interval, no sleep). Wrap it in a timeout.
    ///
    /// ```text
    /// let done = emu.wait_for(|e| e.task(&id).filter(|t| t.status == TaskStatus::Completed)).await;
    /// ```
    pub async fn wait_for<T>(&self, mut check: impl FnMut(&EngineEmulator) -> Option<T>) -> T {
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a change between check and await is not lost.
            notified.as_mut().enable();
            if let Some(value) = check(self) {
                return value;
            }
            notified.await;
        }
    }

    /// Every request received (up to the capacity), oldest first.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.shared.state().calls()
    }

    pub fn clear_calls(&self) {
        self.shared.state().clear_calls();
    }

    /// The emulator's "now".
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.shared.clock.now()
    }

    /// Moves the emulator's clock forward (leases expire, hidden tasks reappear).
    pub fn advance(&self, by: Duration) {
        self.shared.clock.advance(by);
        self.shared.changed.notify_waiters();
    }

    pub fn inject(&self, fault: Fault) {
        self.shared.faults().add(fault);
    }

    /// Removes every fault and ends an outage.
    pub fn clear_faults(&self) {
        *self.shared.faults() = Default::default();
    }

    /// Turns the outage on or off (see the module docs).
    pub fn set_outage(&self, enabled: bool) {
        self.shared.faults().outage = enabled;
    }

    /// Makes every fetch answer at most `cap` tasks, whatever it asks for (`None`: as many as
    /// asked): the partial answers of the real engine when concurrent fetches skip each other's
    /// locked rows (`FOR UPDATE SKIP LOCKED`). Fetches here run one at a time under the state's
    /// lock, so concurrent fetches always get disjoint tasks; this cap makes them partial.
    pub fn set_fetch_answer_cap(&self, cap: Option<std::num::NonZeroU32>) {
        self.shared.state().set_answer_cap(cap);
    }

    /// Makes fetches contend as on the real engine (see the module docs and [`FetchContention`]):
    /// each fetch's transaction lasts `transaction`, its answer comes when it ends, and the rows
    /// it locked meanwhile are skipped by other fetches. `None`: each fetch runs alone.
    pub fn set_fetch_contention(&self, contention: Option<FetchContention>) {
        self.shared.state().set_fetch_contention(contention);
    }

    /// For tool servers: `Some((task id, attempt))` when `token` was issued for `server`, has
    /// not expired, and its task is still `LOCKED` by the same worker on the same attempt.
    pub fn verify_tool_credential(&self, server: &str, token: &str) -> Option<(String, u32)> {
        self.shared
            .state()
            .verify_tool_credential(server, token, self.shared.clock.now_ms())
    }

    /// Stops the server: no new connections, open connections are closed. Idempotent.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.server_closed.store(true, Ordering::SeqCst);
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut server) = server
            && tokio::time::timeout(Duration::from_secs(5), &mut server)
                .await
                .is_err()
        {
            server.abort();
        }
    }
}

impl std::fmt::Debug for EngineEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineEmulator")
            .field("addr", &self.addr)
            .field("protocol", &self.shared.protocol)
            .finish()
    }
}
