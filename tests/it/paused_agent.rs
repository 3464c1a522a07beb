//! Agent-task logic on tokio's paused clock: production workers, built by the composition root
//! (`Worker::build`, through `abada_sim::world::workers::start_in_world`) from a configuration
//! parsed the production way, against the simulator's in-memory world (`abada_sim::world`: the
//! emulator's engine state machine, scripted models, the tool server), with no socket and no
//! wall clock. Each test here
//! replaces, or times exactly, a devkit-stack test of `agent.rs`, `faults.rs` or
//! `hostile_model.rs` whose verdict depended on a real-time margin (a lease of a few real
//! seconds racing a slow model call, an outage ended "once a heartbeat met it", a call timeout
//! a prompt call had to beat, the emulator's real clock read after the fact); tests/README.md
//! maps each old test to its new place.
//!
//! What a test needs beyond the world goes through decorators: the engine's through the devkit's
//! one engine decorator, a `FaultGate` (heartbeats refused, an outage as the HTTP client meets
//! it, latency per operation, every call logged); the models' and the tools' through small ones
//! written here: models that answer "unavailable" on demand or take a while, per task, and a
//! tool connector that counts the session sets opened and released and can answer keyed writes
//! after the call timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::agent::AgentSettings;
use abada_agent_worker::app::{Seams, Tuning};
use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::conversation::{Message, ToolResult, ToolSpec};
use abada_agent_worker::devkit::engine::{TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::gate::{Call, FaultGate, GatedEngine};
use abada_agent_worker::devkit::workers::{WorkerHandle, WorkerOptions};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::provider::fallback::RetryPolicy;
use abada_agent_worker::provider::{
    ModelProvider, ModelRequest, ModelResponse, ProviderError, ProviderRegistry,
};
use abada_agent_worker::runner::RunnerEvent;
use abada_agent_worker::tools::{TaskTools, ToolConnector, ToolError, ToolSessions};
use abada_sim::world::workers::start_in_world;
use abada_sim::world::{
    Event, FaultPlan, ModelScript, World, WorldModel, WorldOptions, WorldTools,
};
use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

// ---- the models: the world's scripts, made unavailable or slow on demand --------------------

/// The world's scripted model under another provider name, with an optional "every model
/// unavailable" fault (429 with a `Retry-After`) for `times` calls, and a latency per call.
struct Model {
    inner: WorldModel,
    name: &'static str,
    unavailable: Mutex<Option<(u16, Duration, u32)>>,
    latency: Duration,
    /// A latency of its own for the tasks whose script (`ModelScript::task`) is named here.
    latency_of: Mutex<HashMap<String, Duration>>,
    calls: AtomicU32,
}

impl Model {
    fn new(world: &Arc<World>, name: &'static str, latency: Duration) -> Arc<Model> {
        Arc::new(Model {
            inner: WorldModel::new(world.clone(), "w"),
            name,
            unavailable: Mutex::new(None),
            latency,
            latency_of: Mutex::new(HashMap::new()),
            calls: AtomicU32::new(0),
        })
    }

    /// Every call of the task whose script is named `task` takes `latency`.
    fn slow_for(&self, task: &str, latency: Duration) {
        self.latency_of
            .lock()
            .unwrap()
            .insert(task.to_string(), latency);
    }

    /// The next `times` calls answer 429 with `Retry-After: retry_after`.
    fn rate_limit(&self, retry_after: Duration, times: u32) {
        *self.unavailable.lock().unwrap() = Some((429, retry_after, times));
    }

    /// The next `times` calls answer 503 with `Retry-After: retry_after`: an outage.
    fn go_down(&self, retry_after: Duration, times: u32) {
        *self.unavailable.lock().unwrap() = Some((503, retry_after, times));
    }

    fn recover(&self) {
        *self.unavailable.lock().unwrap() = None;
    }
}

#[async_trait]
impl ModelProvider for Model {
    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let own = req
            .messages
            .iter()
            .find_map(|m| match m {
                Message::User { text } => ModelScript::parse(text),
                _ => None,
            })
            .and_then(|script| self.latency_of.lock().unwrap().get(&script.task).copied());
        tokio::time::sleep(own.unwrap_or(self.latency)).await;
        let limited = {
            let mut fault = self.unavailable.lock().unwrap();
            match fault.as_mut() {
                Some((status, after, times)) if *times > 0 => {
                    *times -= 1;
                    Some((*status, *after))
                }
                _ => None,
            }
        };
        if let Some((status, retry_after)) = limited {
            return Err(ProviderError::Unavailable {
                provider: self.name.into(),
                model: req.model.clone(),
                status: Some(status),
                message: "refused by the test".into(),
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
    /// While set, a keyed write (`sim_write`) is applied by the server but its answer comes
    /// after the call timeout: the session answers "unavailable" as `McpSessions` does when
    /// its `call_timeout` cuts a call (the timeout itself is rmcp's, on the wire in `tools.rs`).
    late_writes: Arc<std::sync::atomic::AtomicBool>,
}

/// The call timeout the late writes are cut at.
const TOOL_CALL_TIMEOUT: Duration = Duration::from_millis(500);

impl ToolConnector for CountingTools {
    fn sessions(&self, task: TaskTools) -> Box<dyn ToolSessions> {
        self.count.opened.fetch_add(1, Ordering::SeqCst);
        Box::new(CountedSessions {
            inner: self.inner.sessions(task),
            count: self.count.clone(),
            late_writes: self.late_writes.clone(),
            released: false,
        })
    }
}

/// A task's sessions, counted as released once closed or dropped.
struct CountedSessions {
    inner: Box<dyn ToolSessions>,
    count: Arc<SessionCount>,
    late_writes: Arc<std::sync::atomic::AtomicBool>,
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
        let late = tool == "sim_write" && self.late_writes.load(Ordering::SeqCst);
        let answer = self
            .inner
            .call(server, tool, arguments, idempotency_key)
            .await;
        if late {
            tokio::time::sleep(TOOL_CALL_TIMEOUT).await;
            return Err(ToolError::Unavailable {
                server: server.into(),
                reason: format!("timed out after {} ms", TOOL_CALL_TIMEOUT.as_millis()),
            });
        }
        answer
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
    /// The engine's faults and the log of every call the worker sent.
    gate: Arc<FaultGate>,
    primary: Arc<Model>,
    fallback: Arc<Model>,
    sessions: Arc<SessionCount>,
    late_writes: Arc<std::sync::atomic::AtomicBool>,
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
            gate: FaultGate::new(),
            primary: Model::new(&world, PRIMARY, latency),
            fallback: Model::new(&world, FALLBACK, latency),
            sessions: Arc::new(SessionCount::default()),
            late_writes: Arc::default(),
            world,
            lock,
        }
    }

    /// A task whose model looks an order up (`steps`: the world model's script) and answers.
    fn create_task(&self, key: &str, steps: &str) -> String {
        self.create_task_turns(key, steps, 8)
    }

    /// [`Self::create_task`] with its own `maxTurns`.
    fn create_task_turns(&self, key: &str, steps: &str, max_turns: u32) -> String {
        self.create_task_limited(key, steps, json!({"maxTurns": max_turns}))
    }

    /// [`Self::create_task`] with the fields of `limits` (an object) set in its definition.
    fn create_task_limited(&self, key: &str, steps: &str, limits: Value) -> String {
        let script = ModelScript {
            task: key.into(),
            steps: steps.into(),
            hostile: false,
            finals: String::new(),
        };
        let mut variables = Map::new();
        variables.insert("simInput".into(), script.input().into());
        let mut agent = json!({
                "name": "paused-agent",
                "model": format!("{PRIMARY}/m1"),
                "fallbackModels": [format!("{FALLBACK}/m1")],
                "instructions": "Play the script your input names.",
                "input": "${simInput}",
                "toolServers": [{
                    "name": abada_sim::world::tools::SERVER,
                    "url": abada_sim::world::tools::URL,
                }],
                "maxTurns": 8,
                "resultVariable": "simResult"
        });
        if let (Some(agent), Some(limits)) = (agent.as_object_mut(), limits.as_object()) {
            agent.extend(limits.clone());
        }
        self.world.core().create_task(TaskSpec {
            variables,
            agent: Some(agent),
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
    fn start(&self) -> WorkerHandle {
        self.start_with(|_| {})
    }

    /// [`Self::start`] with the worker's options changed by `tune` first.
    fn start_with(&self, tune: impl FnOnce(&mut WorkerOptions)) -> WorkerHandle {
        let mut providers = ProviderRegistry::default();
        providers.insert(PRIMARY, self.primary.clone());
        providers.insert(FALLBACK, self.fallback.clone());
        let agent = AgentSettings {
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
        let defaults = Tuning::default();
        let mut opts = WorkerOptions {
            lock_duration: self.lock,
            tuning: Tuning {
                error_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(2))
                    .without_jitter(),
                heartbeat_retry: defaults.heartbeat_retry.without_jitter(),
                poll_jitter: 0.0,
                ..defaults
            },
            ..WorkerOptions::new("w", 2)
        };
        tune(&mut opts);
        start_in_world(
            &self.world,
            opts,
            &[PRIMARY, FALLBACK],
            Seams {
                decorate_engine: Some(GatedEngine::wrapper(self.gate.clone())),
                providers: Some(providers),
                tools: Some(Arc::new(CountingTools {
                    inner: WorldTools::new(self.world.clone(), "w"),
                    count: self.sessions.clone(),
                    late_writes: self.late_writes.clone(),
                })),
                agent,
                ..Seams::default()
            },
        )
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
    s.gate.state().refuse_heartbeats_of.insert((id.clone(), 1));
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
    let sent = s.gate.calls();
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

    let sent = s.gate.calls();
    let late: Vec<&Call> = sent
        .iter()
        .filter(|c| {
            c.task_id.as_deref() == Some(id.as_str()) && c.attempt == Some(1) && c.at > refusal.at
        })
        .collect();
    assert!(
        late.is_empty(),
        "no call about attempt 1 after its lease was refused: {late:#?}"
    );
    let endings_of_1: Vec<&Call> = sent
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
/// the primary's 7 s. And a busy limit is no outage: every model answering 429 with a wait
/// that fits the model wait, the task waits inside and completes, never deferred; only every
/// model down (503) defers it.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_primary_falls_back_a_busy_limit_is_waited_out_and_an_outage_defers() {
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

    // Every model rate-limited, each a few times: waited out inside the task, never deferred.
    s.primary.rate_limit(Duration::from_secs(7), 3);
    s.fallback.rate_limit(Duration::from_secs(4), 3);
    let busy = s.create_task("o-busy", "r");
    s.wait_task(&busy, Duration::from_secs(120), |v| {
        v.status == TaskStatus::Completed
    })
    .await;
    let v = s.task(&busy);
    assert_eq!(v.counters.failures, 0, "a busy limit never defers: {v:#?}");
    assert_eq!(v.counters.acquisitions, 1);

    // Then every model down (an outage): deferred, retries unchanged, timeout from Retry-After.
    s.primary.go_down(Duration::from_secs(7), u32::MAX);
    s.fallback.go_down(Duration::from_secs(4), u32::MAX);
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

/// Was the logic half of `agent::no_mcp_session_outlives_a_mixed_run` (devkit stack: a 3 s real
/// lease and 1.5 s model calls, so that a task met a refused heartbeat mid call and another was
/// still running at the stop, on a margin a loaded machine could outrun; the outcomes were not
/// asserted). One worker of 16 slots, lease 3 s, every kind of ending at once: six tasks
/// complete (a lookup and a keyed write each), one ends at its `maxTurns` (an incident), three
/// lose their lease at their first heartbeat (1 s) while their model call hangs, three are cut
/// by the shutdown while theirs hangs. Every ending is the expected one, exactly once, each
/// task opened one session set, and every set opened is released (closed or dropped); none is
/// kept alive by any way a task can end. The rmcp close on the wire stays in `agent.rs`.
#[tokio::test(start_paused = true)]
async fn no_tool_session_outlives_a_mixed_run() {
    const HANG: Duration = Duration::from_secs(120);
    let s = Setup::new(Duration::from_secs(3), Duration::ZERO);
    let ok: Vec<String> = (0..6)
        .map(|i| s.create_task(&format!("ok-{i}"), "rw"))
        .collect();
    let capped = s.create_task_turns("capped", "rrrr", 2);
    let mut lost = Vec::new();
    let mut cut = Vec::new();
    for i in 0..3 {
        for (kind, ids) in [("lost", &mut lost), ("cut", &mut cut)] {
            let key = format!("{kind}-{i}");
            s.primary.slow_for(&key, HANG);
            ids.push(s.create_task(&key, "r"));
        }
    }
    for id in &lost {
        s.gate.state().refuse_heartbeats_of.insert((id.clone(), 1));
    }
    let mut w = s.start_with(|opts| {
        opts.slots = 16;
        opts.shutdown_grace = Duration::from_millis(100);
    });

    let mut ended: HashMap<String, Vec<(Option<u32>, TaskEnd)>> = HashMap::new();
    let note = |ended: &mut HashMap<String, Vec<(Option<u32>, TaskEnd)>>, event: RunnerEvent| {
        if let RunnerEvent::TaskEnded {
            task_id,
            attempt,
            outcome,
        } = event
        {
            ended.entry(task_id).or_default().push((attempt, outcome));
        }
    };
    // Everything but the cut tasks ends on its own, well within the engine's lease of the lost
    // ones (3 s): no attempt 2 of them is fetched before the stop.
    let all_but_cut = ok.len() + 1 + lost.len();
    while ended.len() < all_but_cut {
        let event = tokio::time::timeout(Duration::from_secs(60), w.events.recv())
            .await
            .expect("every task but the cut ones ends within a minute of virtual time")
            .expect("the runner is running");
        note(&mut ended, event);
    }
    let stopped_at = Instant::now();
    assert!(
        stopped_at.elapsed() < Duration::from_secs(3),
        "before the lost leases ran out at the engine"
    );
    for event in w.stop_collecting().await {
        note(&mut ended, event);
    }

    let expect = |ids: &[String], end: TaskEnd| {
        for id in ids {
            assert_eq!(
                ended.get(id).map(Vec::as_slice),
                Some(&[(Some(1), end)][..]),
                "task {id}: {ended:#?}"
            );
        }
    };
    expect(&ok, TaskEnd::Completed);
    expect(std::slice::from_ref(&capped), TaskEnd::Incident);
    expect(&lost, TaskEnd::LeaseLost);
    expect(&cut, TaskEnd::Released);
    assert_eq!(ended.len(), 13, "{ended:#?}");
    assert!(
        s.task(&capped)
            .error_message
            .is_some_and(|m| m.contains("maxTurns = 2")),
        "the incident names its limit"
    );
    // The lost attempts reported nothing; the cut ones were given back with their retries.
    for id in &lost {
        let v = s.task(id);
        assert_eq!(
            (v.counters.completes, v.counters.failures),
            (0, 0),
            "{v:#?}"
        );
    }
    for id in &cut {
        let v = s.task(id);
        assert_eq!((v.retries, v.counters.failures), (Some(3), 1), "{v:#?}");
    }
    assert_eq!(
        s.sessions.opened.load(Ordering::SeqCst),
        13,
        "one session set per task"
    );
    assert_eq!(
        s.sessions.released.load(Ordering::SeqCst),
        13,
        "every session set closed or dropped by the time the worker stopped: completed, \
         incident, lease lost and cut alike"
    );
}

/// `maxDurationMs` ends the task at its deadline, not later (the devkit-stack
/// test `hostile_model::a_hostile_model_ends_every_task_in_a_named_bounded_outcome` reads the
/// deadline off real instants, between 700 ms and the slow model's 5 s). Two tasks with
/// `maxDurationMs = 700`: one whose model call never answers in time (5 s), one busy with
/// model calls of 300 ms and lookups, in the middle of one at 700 ms. Each is an incident whose
/// report goes out 700 ms after its attempt started (when its journal was read: the deadline
/// counts from there), within the world's 1 ms per engine answer, not at the model's answer nor
/// at the next step boundary; the message names the limit and the 700 ms run.
#[tokio::test(start_paused = true)]
async fn max_duration_ends_the_task_at_its_deadline_not_at_the_next_answer() {
    let s = Setup::new(Duration::from_secs(30), Duration::ZERO);
    s.primary.slow_for("hung", Duration::from_secs(5));
    s.primary.slow_for("busy", Duration::from_millis(300));
    let hung = s.create_task_limited("hung", "r", json!({"maxDurationMs": 700}));
    let busy = s.create_task_limited("busy", "rrrrrrrr", json!({"maxDurationMs": 700}));
    let w = s.start();
    for id in [&hung, &busy] {
        s.wait_task(id, Duration::from_secs(30), |v| {
            v.status == TaskStatus::Failed
        })
        .await;
    }
    w.stop().await;

    let sent = s.gate.calls();
    for id in [&hung, &busy] {
        let v = s.task(id);
        assert_eq!(v.retries, Some(0), "an incident: {v:#?}");
        let message = v.error_message.clone().unwrap_or_default();
        assert!(
            message.contains("limit maxDurationMs = 700 reached: the task has run 700 ms"),
            "{message}"
        );
        let of_task = |op: &str| {
            sent.iter()
                .filter(|c| c.op == op && c.task_id.as_deref() == Some(id.as_str()))
                .map(|c| c.at)
                .collect::<Vec<_>>()
        };
        let (opened, reported) = (of_task("journal-read"), of_task("failure"));
        assert_eq!((opened.len(), reported.len()), (1, 1), "{sent:#?}");
        let ran = reported[0] - opened[0];
        assert!(
            ran >= Duration::from_millis(701) && ran <= Duration::from_millis(703),
            "task {id}: reported {ran:?} after its journal was read (the answer's 1 ms, then \
             the 700 ms deadline)"
        );
    }
    // The hung call was still in flight at the deadline: the model never answered it.
    assert!(
        s.world
            .trace()
            .events
            .iter()
            .all(|(_, e)| !matches!(e, Event::ModelCall { task, .. } if task == "hung")),
        "the hung model call was dropped at the deadline"
    );
}

/// The runner's `TaskEnded` events until `done` holds of those seen, each with the instant it
/// was received (the runner's own instant: nothing else runs meanwhile on the paused clock).
/// Every task ended `Completed` on its first attempt, and the engine acquired and completed
/// each once: no lease was lost on the way.
fn completed_once_each(
    s: &Setup,
    ids: &[String],
    seen: &[(Instant, String, Option<u32>, TaskEnd)],
    context: &str,
) {
    for (_, id, attempt, end) in seen {
        assert_eq!(
            (attempt, end),
            (&Some(1), &TaskEnd::Completed),
            "{context}: {id}: {seen:#?}"
        );
    }
    for id in ids {
        let v = s.task(id);
        assert_eq!(
            (v.status, v.counters.acquisitions, v.counters.completes),
            (TaskStatus::Completed, 1, 1),
            "{context}: {v:#?}"
        );
    }
}

async fn ended_until(
    events: &mut mpsc::UnboundedReceiver<RunnerEvent>,
    seen: &mut Vec<(Instant, String, Option<u32>, TaskEnd)>,
    done: impl Fn(&[(Instant, String, Option<u32>, TaskEnd)]) -> bool,
) {
    while !done(seen) {
        let event = tokio::time::timeout(Duration::from_secs(120), events.recv())
            .await
            .expect("within two minutes of virtual time")
            .expect("the runner is running");
        if let RunnerEvent::TaskEnded {
            task_id,
            attempt,
            outcome,
        } = event
        {
            seen.push((Instant::now(), task_id, attempt, outcome));
        }
    }
}

/// Was the first part of `faults::an_engine_outage_keeps_leases_while_it_can_fences_when_it_cannot_and_resumes`
/// (devkit stack: an outage ended "as soon as a heartbeat has met it and the worker has
/// noticed", on real time). Lease 3 s (heartbeats every second, the lease lost locally 2.7 s
/// after the last accepted extension was sent), model calls of 2 s: the engine is away from
/// 0.9 s to 2.2 s, so the heartbeat of 1 s and its retries meet the outage, and one goes
/// through before the local expiry. Both tasks complete on their first attempt, with no lease
/// lost and no second acquisition.
#[tokio::test(start_paused = true)]
async fn a_short_engine_outage_is_ridden_out_and_every_lease_is_kept() {
    let s = Setup::new(Duration::from_secs(3), Duration::from_secs(2));
    let ids = [s.create_task("short-0", "r"), s.create_task("short-1", "r")];
    let started = Instant::now();
    s.gate.state().outage_from(
        started + Duration::from_millis(900),
        Duration::from_millis(1300),
    );
    let mut w = s.start();
    let mut seen = Vec::new();
    ended_until(&mut w.events, &mut seen, |seen| seen.len() == 2).await;
    w.stop().await;
    completed_once_each(&s, &ids, &seen, "a short outage");
    let log = s.gate.calls();
    let heartbeats_down = log.iter().filter(|c| c.op == "heartbeat" && c.down).count();
    assert!(
        heartbeats_down >= 2,
        "the heartbeats met the outage: {log:#?}"
    );
}

/// Was the second part of the same test (devkit stack: an outage of "longer than the lease",
/// fencing asserted as "within 12 s"). Lease 3 s, model calls of 2 s; the engine is away from
/// 1.5 s (after the first heartbeat was accepted) for 10 s. The task ends `LeaseLost` at its
/// local expiry exactly: 2.7 s after the last accepted heartbeat was sent (lock less a tenth),
/// not earlier, not later; from then on nothing about attempt 1 is sent, not even once the
/// engine is back; once the engine's lease ran out and the engine answers again, attempt 2
/// takes the task and completes it.
#[tokio::test(start_paused = true)]
async fn a_long_engine_outage_fences_the_task_at_its_local_expiry_and_it_resumes() {
    let s = Setup::new(Duration::from_secs(3), Duration::from_secs(2));
    let id = s.create_task("long", "r");
    let started = Instant::now();
    let back = started + Duration::from_millis(11_500);
    s.gate.state().outage_from(
        started + Duration::from_millis(1500),
        Duration::from_secs(10),
    );
    let mut w = s.start();
    let mut seen = Vec::new();
    ended_until(&mut w.events, &mut seen, |seen| !seen.is_empty()).await;
    let (lost_at, _, attempt, end) = seen[0].clone();
    assert_eq!((attempt, end), (Some(1), TaskEnd::LeaseLost), "{seen:#?}");
    let log = s.gate.calls();
    let last_accepted = log
        .iter()
        .filter(|c| c.op == "heartbeat" && c.attempt == Some(1) && !c.down)
        .map(|c| c.at)
        .max()
        .expect("a heartbeat accepted before the outage");
    assert!(last_accepted < started + Duration::from_millis(1500));
    let expiry = last_accepted + Duration::from_millis(2700);
    assert!(
        lost_at >= expiry && lost_at <= expiry + Duration::from_millis(5),
        "lost {:?} after the last accepted heartbeat, the local expiry is 2.7 s",
        lost_at - last_accepted
    );
    assert!(lost_at < back, "fenced during the outage");

    // The engine comes back; the model is quick now: attempt 2 completes.
    s.primary.slow_for("long", Duration::ZERO);
    ended_until(&mut w.events, &mut seen, |seen| seen.len() == 2).await;
    assert_eq!(
        (seen[1].2, seen[1].3),
        (Some(2), TaskEnd::Completed),
        "{seen:#?}"
    );
    assert!(seen[1].0 >= back);
    w.stop().await;
    let log = s.gate.calls();
    let late: Vec<&Call> = log
        .iter()
        .filter(|c| c.attempt == Some(1) && c.at > lost_at)
        .collect();
    assert!(late.is_empty(), "calls about the fenced attempt: {late:#?}");
    assert!(
        !log.iter()
            .any(|c| c.attempt == Some(1) && matches!(c.op, "complete" | "failure" | "bpmn-error")),
        "the fenced attempt reported nothing"
    );
    let v = s.task(&id);
    assert_eq!(
        (v.status, v.attempt, v.counters.completes),
        (TaskStatus::Completed, 2, 1),
        "{v:#?}"
    );
}

/// Was the logic of the "tslow" half of
/// `faults::a_tool_server_down_or_slow_past_its_timeout_fails_technically_then_resumes`
/// (devkit stack: the refund answered 1.5 s after a 500 ms call timeout, with the lookup before
/// it expected to stay under that timeout on a loaded machine). A keyed write the server
/// applies but answers after the call timeout: the attempt sends it `tool_attempts` times in
/// all under one key, then fails technically (one retry consumed, nothing completed); the
/// resume (attempt 2) sends it once more under the same key, answered from the server's ledger.
/// The write is applied exactly once, every other send deduplicated.
#[tokio::test(start_paused = true)]
async fn a_keyed_write_answered_after_its_timeout_is_resent_under_its_key_then_resumed() {
    let tries = AgentSettings::default().tool_attempts;
    let s = Setup::new(Duration::from_secs(30), Duration::ZERO);
    s.late_writes.store(true, Ordering::SeqCst);
    let id = s.create_task("tslow", "rw");
    let w = s.start();
    s.wait_task(&id, Duration::from_secs(60), |v| v.counters.failures >= 1)
        .await;
    let v = s.task(&id);
    assert_eq!(
        (v.retries, v.counters.completes, v.attempt),
        (Some(2), 0, 1),
        "a technical failure consumed one retry: {v:#?}"
    );
    s.late_writes.store(false, Ordering::SeqCst);
    s.wait_task(&id, Duration::from_secs(60), |v| {
        v.status == TaskStatus::Completed
    })
    .await;
    w.stop().await;
    assert_eq!(s.task(&id).attempt, 2);

    let writes: Vec<(Option<String>, &'static str)> = s
        .world
        .trace()
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::ToolCall {
                task,
                write: Some(_),
                key,
                answer,
                ..
            } if task == "tslow" => Some((key.clone(), *answer)),
            _ => None,
        })
        .collect();
    assert_eq!(
        writes.len() as u32,
        tries + 1,
        "{tries} sends in attempt 1, one after the resume: {writes:?}"
    );
    assert!(
        writes[0]
            .0
            .as_deref()
            .is_some_and(|k| k.starts_with(&format!("abada:{id}:"))),
        "{writes:?}"
    );
    assert!(
        writes.iter().all(|(k, _)| *k == writes[0].0),
        "every send under the same key: {writes:?}"
    );
    let applied = writes.iter().filter(|(_, a)| *a == "applied").count();
    let deduplicated = writes.iter().filter(|(_, a)| *a == "deduplicated").count();
    assert_eq!(
        (applied, deduplicated),
        (1, tries as usize),
        "applied once, every re-send answered from the ledger: {writes:?}"
    );
}

/// Was the logic of `faults::engine_latency_spikes_keep_every_lease_and_complete_every_task`
/// (devkit stack: heartbeats answered 600 ms late under a 5 s lease, on real time, where a
/// loaded machine adds its own delays). Lease 5 s; each heartbeat takes 600 ms, each fetch
/// 300 ms, each journal append 100 ms, each `complete` 400 ms; model calls of 300 ms. Every
/// task completes on its first attempt: no lease lost, one acquisition and one `complete` each.
/// And a slow heartbeat still counts from when it was sent: with every heartbeat taking 1.5 s
/// (just under the period, a third of the lease: each answer comes before the next is due) and
/// model calls of 2 s, a task four times longer than its heartbeat period keeps its lease.
/// (A steady latency above the period is another matter: each answer then comes after the
/// next point of the grid, the next extension goes out a period late, and the lease expires
/// locally while it is in flight: 2 s here loses every lease.)
#[tokio::test(start_paused = true)]
async fn engine_latency_spikes_keep_every_lease_and_complete_every_task() {
    for (heartbeat, model) in [(600, 300), (1500, 2000)] {
        let s = Setup::new(Duration::from_secs(5), Duration::from_millis(model));
        s.gate.state().latency.extend([
            ("heartbeat", Duration::from_millis(heartbeat)),
            ("fetch-and-lock", Duration::from_millis(300)),
            ("journal-append", Duration::from_millis(100)),
            ("complete", Duration::from_millis(400)),
        ]);
        let ids: Vec<String> = (0..4)
            .map(|i| s.create_task(&format!("lat-{i}"), "rw"))
            .collect();
        let mut w = s.start();
        let mut seen = Vec::new();
        ended_until(&mut w.events, &mut seen, |seen| seen.len() == 4).await;
        w.stop().await;
        completed_once_each(&s, &ids, &seen, &format!("heartbeats of {heartbeat} ms"));
        let heartbeats = s
            .gate
            .calls()
            .iter()
            .filter(|c| c.op == "heartbeat")
            .count();
        assert!(
            heartbeats >= 4,
            "the heartbeats were slow, and sent: {heartbeats}"
        );
    }
}
