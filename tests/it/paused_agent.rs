//! Agent-task logic on tokio's paused clock: the production runner, heartbeat actor and agent
//! runtime against the simulator's in-memory world (`devkit::world`: the emulator's engine state
//! machine, scripted models, the tool server), with no socket and no wall clock. Each test here
//! replaces a devkit-stack test of `agent.rs` whose verdict depended on a real-time margin (a
//! lease of a few real seconds racing a slow model call, or the emulator's real clock read
//! after the fact); tests/README.md maps each old test to its new place.
//!
//! What a test needs beyond the world goes through small decorators written here: an engine that
//! refuses one attempt's heartbeats and logs every call, models that answer "unavailable" on
//! demand or take a while, and a tool connector that counts the session sets opened and
//! released.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::agent::limits::Ceilings;
use abada_agent_worker::agent::{AgentRuntime, AgentSettings};
use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::conversation::{ToolResult, ToolSpec};
use abada_agent_worker::devkit::engine::{TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::world::{
    FaultPlan, ModelScript, World, WorldEngine, WorldModel, WorldOptions, WorldTools,
};
use abada_agent_worker::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, Journal,
    JournalStep, LeaseLostReason, ProbeOutcome, Task, TaskRef, ToolCredential,
};
use abada_agent_worker::handler::{TaskEnd, TaskHandler};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::provider::fallback::RetryPolicy;
use abada_agent_worker::provider::{
    ModelProvider, ModelRequest, ModelResponse, ProviderError, ProviderRegistry,
};
use abada_agent_worker::runner::{Runner, RunnerEvent, RunnerSettings};
use abada_agent_worker::tools::{TaskTools, ToolConnector, ToolError, ToolSessions};
use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

// ---- the engine: the world's, with one attempt's heartbeats refused, every call logged ------

/// One engine call as the test saw it go out.
#[derive(Clone, Debug)]
struct Sent {
    at: Instant,
    op: &'static str,
    task: Option<String>,
    attempt: Option<u32>,
    refused: bool,
}

struct LoggingEngine {
    inner: WorldEngine,
    /// Heartbeats of this (task, attempt) are refused with 403 `WORKER_LOCK_NOT_OWNED`, as the
    /// emulator's `Fault::RefuseHeartbeats` does: the engine's state is left as it is.
    refuse_heartbeats_of: Mutex<Option<(String, u32)>>,
    log: Mutex<Vec<Sent>>,
}

impl LoggingEngine {
    fn note(&self, op: &'static str, task: Option<&TaskRef>, refused: bool) {
        self.log.lock().unwrap().push(Sent {
            at: Instant::now(),
            op,
            task: task.map(|t| t.task_id.clone()),
            attempt: task.and_then(|t| t.attempt),
            refused,
        });
    }

    fn sent(&self) -> Vec<Sent> {
        self.log.lock().unwrap().clone()
    }
}

#[async_trait]
impl Engine for LoggingEngine {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        self.note("fetch-and-lock", None, false);
        self.inner.fetch_and_lock(request).await
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        let refused = self.refuse_heartbeats_of.lock().unwrap().as_ref()
            == Some(&(task.task_id.clone(), task.attempt.unwrap_or(0)));
        self.note("heartbeat", Some(task), refused);
        if refused {
            return Err(EngineError::LeaseLost {
                op: "heartbeat",
                task_id: task.task_id.clone(),
                reason: LeaseLostReason::NotOwned,
            });
        }
        self.inner.heartbeat(task, lock_duration).await
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        self.note("complete", Some(task), false);
        self.inner.complete(task, variables).await
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        self.note("failure", Some(task), false);
        self.inner.failure(task, report).await
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        self.note("bpmn-error", Some(task), false);
        self.inner.bpmn_error(task, report).await
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        self.note("journal-read", Some(task), false);
        self.inner.read_journal(task).await
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        self.note("journal-append", Some(task), false);
        self.inner.append_journal(task, step).await
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        self.note("tool-credentials", Some(task), false);
        self.inner.tool_credential(task, server).await
    }

    async fn probe(&self) -> ProbeOutcome {
        self.inner.probe().await
    }
}

// ---- the models: the world's scripts, made unavailable or slow on demand --------------------

/// The world's scripted model under another provider name, with an optional "every model
/// unavailable" fault (429 with a `Retry-After`) for `times` calls, and a latency per call.
struct Model {
    inner: WorldModel,
    name: &'static str,
    unavailable: Mutex<Option<(Duration, u32)>>,
    latency: Duration,
    calls: AtomicU32,
}

impl Model {
    fn new(world: &Arc<World>, name: &'static str, latency: Duration) -> Arc<Model> {
        Arc::new(Model {
            inner: WorldModel::new(world.clone(), "w"),
            name,
            unavailable: Mutex::new(None),
            latency,
            calls: AtomicU32::new(0),
        })
    }

    /// The next `times` calls answer 429 with `Retry-After: retry_after`.
    fn rate_limit(&self, retry_after: Duration, times: u32) {
        *self.unavailable.lock().unwrap() = Some((retry_after, times));
    }

    fn recover(&self) {
        *self.unavailable.lock().unwrap() = None;
    }
}

#[async_trait]
impl ModelProvider for Model {
    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.latency).await;
        let limited = {
            let mut fault = self.unavailable.lock().unwrap();
            match fault.as_mut() {
                Some((after, times)) if *times > 0 => {
                    *times -= 1;
                    Some(*after)
                }
                _ => None,
            }
        };
        if let Some(retry_after) = limited {
            return Err(ProviderError::Unavailable {
                provider: self.name.into(),
                model: req.model.clone(),
                status: Some(429),
                message: "rate limited by the test".into(),
                retry_after: Some(retry_after),
            });
        }
        self.inner.complete(req).await
    }
}

// ---- the tools: the world's server, its sessions counted ------------------------------------

#[derive(Default)]
struct SessionCount {
    opened: AtomicUsize,
    /// Closed by the agent (`close`), or dropped: the production session set (`McpSessions`)
    /// closes its sessions on drop, on the task's cleanup tracker; that close over rmcp is a
    /// wire matter (`agent::no_mcp_session_outlives_a_mixed_run`). Here: none is kept alive.
    released: AtomicUsize,
}

struct CountingTools {
    inner: WorldTools,
    count: Arc<SessionCount>,
}

impl ToolConnector for CountingTools {
    fn sessions(&self, task: TaskTools) -> Box<dyn ToolSessions> {
        self.count.opened.fetch_add(1, Ordering::SeqCst);
        Box::new(CountedSessions {
            inner: self.inner.sessions(task),
            count: self.count.clone(),
            released: false,
        })
    }
}

/// A task's sessions, counted as released once closed or dropped.
struct CountedSessions {
    inner: Box<dyn ToolSessions>,
    count: Arc<SessionCount>,
    released: bool,
}

impl CountedSessions {
    fn release(&mut self) {
        if !self.released {
            self.released = true;
            self.count.released.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Drop for CountedSessions {
    fn drop(&mut self) {
        self.release();
    }
}

#[async_trait]
impl ToolSessions for CountedSessions {
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, ToolError> {
        self.inner.tools().await
    }

    async fn call(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<ToolResult, ToolError> {
        self.inner
            .call(server, tool, arguments, idempotency_key)
            .await
    }

    async fn close(&mut self) {
        self.inner.close().await;
        self.release();
    }
}

// ---- one worker against the world -------------------------------------------------------------

const PRIMARY: &str = "primary";
const FALLBACK: &str = "fallback";

struct Setup {
    world: Arc<World>,
    engine: Arc<LoggingEngine>,
    primary: Arc<Model>,
    fallback: Arc<Model>,
    sessions: Arc<SessionCount>,
    lock: Duration,
}

impl Setup {
    /// A world whose models take `latency` per call, and no fault of its own.
    fn new(lock: Duration, latency: Duration) -> Setup {
        let world = World::new(WorldOptions {
            seed: 1,
            lock_duration: lock,
            faults: FaultPlan::default(),
            store_journal: false,
        });
        Setup {
            engine: Arc::new(LoggingEngine {
                inner: WorldEngine::new(world.clone(), "w"),
                refuse_heartbeats_of: Mutex::new(None),
                log: Mutex::new(Vec::new()),
            }),
            primary: Model::new(&world, PRIMARY, latency),
            fallback: Model::new(&world, FALLBACK, latency),
            sessions: Arc::new(SessionCount::default()),
            world,
            lock,
        }
    }

    /// A task whose model looks an order up (`steps`: the world model's script) and answers.
    fn create_task(&self, key: &str, steps: &str) -> String {
        let script = ModelScript {
            task: key.into(),
            steps: steps.into(),
            hostile: false,
        };
        let mut variables = Map::new();
        variables.insert("simInput".into(), script.input().into());
        self.world.core().create_task(TaskSpec {
            variables,
            agent: Some(json!({
                "name": "paused-agent",
                "model": format!("{PRIMARY}/m1"),
                "fallbackModels": [format!("{FALLBACK}/m1")],
                "instructions": "Play the script your input names.",
                "input": "${simInput}",
                "toolServers": [{
                    "name": abada_agent_worker::devkit::world::tools::SERVER,
                    "url": abada_agent_worker::devkit::world::tools::URL,
                }],
                "maxTurns": 8,
                "resultVariable": "simResult"
            })),
            retries: Some(3),
            ..TaskSpec::default()
        })
    }

    fn task(&self, id: &str) -> TaskView {
        self.world.core().task(id).expect("the task exists")
    }

    /// The engine's clock, as the emulator's `now()` gives it.
    fn engine_now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp_millis(self.world.now_ms()).unwrap()
    }

    /// Starts the worker (two slots, the fast backoffs of the stack tests, no jitter).
    fn start(&self) -> Running {
        let mut providers = ProviderRegistry::default();
        providers.insert(PRIMARY, self.primary.clone());
        providers.insert(FALLBACK, self.fallback.clone());
        let metrics = Arc::new(Metrics::new());
        let settings = AgentSettings {
            model_retry: RetryPolicy {
                initial_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_millis(200),
                jitter: 0.0,
                unavailable_default: Duration::from_secs(1),
                ..RetryPolicy::default()
            },
            tool_backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(200))
                .without_jitter(),
            technical_retry: Backoff::new(Duration::from_secs(1), Duration::from_secs(4))
                .without_jitter(),
            ..AgentSettings::default()
        };
        let handler: Arc<dyn TaskHandler> = Arc::new(
            AgentRuntime::new(
                providers,
                None,
                reqwest::Client::new(),
                settings,
                metrics.clone(),
                Ceilings::default(),
            )
            .with_tool_connector(Arc::new(CountingTools {
                inner: WorldTools::new(self.world.clone(), "w"),
                count: self.sessions.clone(),
            })),
        );
        let mut rs = RunnerSettings::new("w", self.lock);
        rs.max_tasks = 2;
        rs.poll_interval = Duration::from_millis(200);
        rs.poll_jitter = 0.0;
        rs.error_backoff =
            Backoff::new(Duration::from_millis(200), Duration::from_secs(2)).without_jitter();
        rs.heartbeat.retry_backoff = rs.heartbeat.retry_backoff.without_jitter();
        let (tx, events) = mpsc::unbounded_channel();
        let engine: Arc<dyn Engine> = self.engine.clone();
        let runner = Runner::new(engine, handler, rs, metrics).with_events(tx);
        let shutdown = CancellationToken::new();
        let join = tokio::spawn(runner.run(shutdown.clone()));
        Running {
            shutdown,
            join,
            events,
        }
    }

    /// Waits (virtual time, checked every 10 ms) until `done` holds of the task, at most
    /// `limit` of virtual time: a bound that only a bug can reach.
    async fn wait_task(&self, id: &str, limit: Duration, done: impl Fn(&TaskView) -> bool) {
        let end = Instant::now() + limit;
        loop {
            let view = self.task(id);
            if done(&view) {
                return;
            }
            assert!(Instant::now() < end, "task {id} after {limit:?}: {view:#?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

struct Running {
    shutdown: CancellationToken,
    join: tokio::task::JoinHandle<()>,
    events: mpsc::UnboundedReceiver<RunnerEvent>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        self.join.await.expect("the runner ends cleanly");
    }
}

// ---- the tests ------------------------------------------------------------------------------

/// Was `agent::a_lost_lease_stops_the_task_reports_nothing_and_closes_its_sessions` (devkit
/// stack, a 3 s real lease racing 2 s model calls). Lease 3 s, heartbeats every second, model
/// calls of 2 s: the first heartbeat (1 s) of attempt 1 is refused in the middle of the first
/// model call. The task ends `LeaseLost`; from the refusal on, nothing about attempt 1 is sent
/// (the whole rest of the worker's life is checked, not a guessed while), attempt 1 reports no
/// ending, and its tool sessions are released (closed or dropped: see [`SessionCount`]). Stronger than before: the refusal is placed at the
/// first heartbeat, during the first model call, and no later call of attempt 1 is excused by a
/// guessed while.
#[tokio::test(start_paused = true)]
async fn a_lost_lease_stops_the_agent_task_reports_nothing_and_closes_its_sessions() {
    let s = Setup::new(Duration::from_secs(3), Duration::from_secs(2));
    let id = s.create_task("lost", "r");
    *s.engine.refuse_heartbeats_of.lock().unwrap() = Some((id.clone(), 1));
    let mut w = s.start();
    let started = Instant::now();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), w.events.recv())
            .await
            .expect("the task ends within a minute of virtual time")
            .expect("the runner is running");
        if let RunnerEvent::TaskEnded {
            task_id,
            attempt,
            outcome,
        } = event
        {
            assert_eq!((task_id.as_str(), attempt), (id.as_str(), Some(1)));
            assert_eq!(outcome, TaskEnd::LeaseLost);
            break;
        }
    }
    // The refusal came at the first heartbeat, a third of the lease in, during the model call.
    let sent = s.engine.sent();
    let refusal = sent
        .iter()
        .find(|c| c.refused)
        .expect("a refused heartbeat")
        .clone();
    let into_lease = refusal.at - started;
    assert!(
        into_lease >= Duration::from_secs(1) && into_lease < Duration::from_millis(1100),
        "the first heartbeat, a third of the lease in: {into_lease:?} {sent:#?}"
    );
    assert_eq!(s.primary.calls.load(Ordering::SeqCst), 1, "mid first call");

    // The rest of the worker's life, past the engine's lease (3 s), then its stop.
    tokio::time::sleep(Duration::from_secs(5)).await;
    w.stop().await;

    let sent = s.engine.sent();
    let late: Vec<&Sent> = sent
        .iter()
        .filter(|c| {
            c.task.as_deref() == Some(id.as_str()) && c.attempt == Some(1) && c.at > refusal.at
        })
        .collect();
    assert!(
        late.is_empty(),
        "no call about attempt 1 after its lease was refused: {late:#?}"
    );
    let endings_of_1: Vec<&Sent> = sent
        .iter()
        .filter(|c| c.attempt == Some(1) && matches!(c.op, "complete" | "failure" | "bpmn-error"))
        .collect();
    assert!(endings_of_1.is_empty(), "{endings_of_1:#?}");
    // The engine's lease ran out at 3 s: the task is offered again and a later attempt may
    // finish it (the freed slot fetches it back); attempt 1 reported nothing (above).
    let v = s.task(&id);
    assert_eq!(v.counters.failures, 0, "{v:#?}");
    assert!(
        v.counters.completes == 0 || v.attempt >= 2,
        "only a later attempt completes: {v:#?}"
    );
    let opened = s.sessions.opened.load(Ordering::SeqCst);
    assert!(opened >= 1, "the task opened its tool sessions");
    assert_eq!(
        s.sessions.released.load(Ordering::SeqCst),
        opened,
        "every session set closed or dropped, none kept alive by the lost attempt"
    );
}

/// Was `agent::a_rate_limited_primary_falls_back_and_every_model_unavailable_defers` (devkit
/// stack: the deferral's `retryTimeout` was read against the emulator's real clock some time
/// after the report, so only `1 s < hidden <= 4 s` could be asserted). On the paused clock the
/// report and the read are at the same instant, so the bound is tight: the task is hidden for
/// the earliest `Retry-After` (4 s) minus the moments the calls took, never the 1 s default nor
/// the primary's 7 s.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_primary_falls_back_and_every_model_unavailable_defers() {
    let s = Setup::new(Duration::from_secs(30), Duration::ZERO);
    // First: the primary is rate-limited once, the fallback finishes the task.
    s.primary.rate_limit(Duration::from_secs(5), 1);
    let first = s.create_task("o-1", "r");
    let w = s.start();
    s.wait_task(&first, Duration::from_secs(20), |v| {
        v.status == TaskStatus::Completed
    })
    .await;
    let v = s.task(&first);
    assert_eq!(
        v.journal[1]["data"]["model"],
        format!("{FALLBACK}/m1"),
        "{:#?}",
        v.journal
    );

    // Then every model unavailable: deferred, retries unchanged, timeout from Retry-After.
    s.primary.rate_limit(Duration::from_secs(7), u32::MAX);
    s.fallback.rate_limit(Duration::from_secs(4), u32::MAX);
    let id = s.create_task("o-2", "r");
    s.wait_task(&id, Duration::from_secs(20), |v| {
        v.hidden && v.counters.failures == 1
    })
    .await;
    let deferred = s.task(&id);
    assert_eq!(deferred.retries, Some(3), "the attempt was not consumed");
    let hidden_for = deferred.lock_expiration_time.unwrap() - s.engine_now();
    assert!(
        hidden_for > chrono::Duration::milliseconds(3900)
            && hidden_for <= chrono::Duration::seconds(4),
        "retryTimeout follows the earliest Retry-After (4 s): {hidden_for}"
    );
    // Still hidden just before its retry timeout: nobody fetched it again.
    tokio::time::sleep(Duration::from_millis(3800)).await;
    let v = s.task(&id);
    assert!(v.hidden && v.counters.acquisitions == 1, "{v:#?}");

    // The provider recovers: the task completes after its retry timeout.
    s.primary.recover();
    s.fallback.recover();
    s.wait_task(&id, Duration::from_secs(20), |v| {
        v.status == TaskStatus::Completed
    })
    .await;
    assert_eq!(s.task(&id).counters.acquisitions, 2);
    w.stop().await;
}
