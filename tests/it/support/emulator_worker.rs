//! Real workers against the engine emulator, for real-HTTP integration tests: [`spawn_worker`]
//! builds a worker through the composition root (`app::Worker::build`) from a config naming an
//! [`EngineEmulator`] on 127.0.0.1, with a test handler and its engine client behind a
//! [`ControlledEngine`] gate that can freeze the worker's engine calls and records what the runner
//! asked for; [`CompletingHandler`] is a small task handler that sleeps a little real time and
//! completes; [`check_lease_discipline`] checks the emulator's call log for two live leases on
//! one task.
//!
//! ```ignore
//! let emu = emulator::start(EmulatorOptions::default()).await?;
//! let w = spawn_worker(&emu, WorkerOptions::new("w1", Duration::from_secs(3)));
//! let ended = w.wait_event(|e| matches!(e, RunnerEvent::TaskEnded { .. })).await;
//! w.stop().await;
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::app::{Seams, Tuning, Worker};
use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::config::{self, Config};
use abada_agent_worker::devkit::engine::{
    CallRecord, Disposition, EngineEmulator, Operation, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::gate::{Gate, GatedEngine, Op};
use abada_agent_worker::engine::{Task, TaskRef};
use abada_agent_worker::handler::{Outcome, TaskContext, TaskEnd, TaskHandler};
use abada_agent_worker::runner::RunnerEvent;
use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;

/// How long any single wait of these helpers may take before the test fails (a hang guard, not
/// a timing assertion).
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// Awaits `fut`, failing the test with `what` if it hangs past [`WAIT_LIMIT`].
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    within_for(WAIT_LIMIT, what, fut).await
}

/// [`within`] with a hang guard of the caller's: for suites whose waits are long by nature
/// (megabytes in a debug build, many handshakes, hundreds of transactions).
pub async fn within_for<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("gave up after {limit:?} waiting for {what}"),
    }
}

/// Waits until the emulator says task `id` is completed, and returns its view.
pub async fn wait_completed(emu: &EngineEmulator, id: &str) -> TaskView {
    within(&format!("task {id} to be completed"), async {
        emu.wait_for(|e| e.task(id).filter(|t| t.status == TaskStatus::Completed))
            .await
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The handler

/// Sleeps real time (the task variable `sleepMs`, else its default), then completes with
/// `{"doneBy": <label>, "attempt": <attempt>}`. With a gate, it also waits for one gate permit
/// before completing (so a test decides when it may finish). Returns
/// [`Outcome::released`] if the runner asks it to stop.
pub struct CompletingHandler {
    label: String,
    default_sleep: Duration,
    gate: Option<Arc<Semaphore>>,
}

impl CompletingHandler {
    pub fn new(label: impl Into<String>, default_sleep: Duration) -> Self {
        CompletingHandler {
            label: label.into(),
            default_sleep,
            gate: None,
        }
    }

    /// Each task waits for one permit of `gate` before completing (`gate.add_permits(n)`).
    pub fn gated(mut self, gate: Arc<Semaphore>) -> Self {
        self.gate = Some(gate);
        self
    }
}

#[async_trait]
impl TaskHandler for CompletingHandler {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
        let sleep = task
            .variables
            .get("sleepMs")
            .and_then(Value::as_u64)
            .map(Duration::from_millis)
            .unwrap_or(self.default_sleep);
        let work = async {
            tokio::time::sleep(sleep).await;
            if let Some(gate) = &self.gate {
                gate.acquire().await.expect("gate never closed").forget();
            }
        };
        tokio::select! {
            _ = work => {}
            _ = ctx.stopped() => return Outcome::released(&task, "worker shutting down"),
        }
        let mut variables = Map::new();
        variables.insert("doneBy".into(), self.label.clone().into());
        variables.insert("attempt".into(), task.attempt.into());
        Outcome::Complete { variables }
    }
}

// ---------------------------------------------------------------------------------------------
// The engine gate

/// A gate in front of a worker's engine client: while frozen, every call blocks (before reaching
/// the engine) until [`ControlledEngine::thaw`], as with a process stopped by the OS or a long
/// GC pause. It also records the `maxTasks` of every fetch the runner asks for.
pub struct ControlledEngine {
    frozen: watch::Sender<bool>,
    /// Operation names of the calls that found the engine frozen, in order.
    blocked: watch::Sender<Vec<&'static str>>,
    /// Operation names of the calls held by the freeze right now: a call leaves when it is let
    /// through or when its caller drops it (an aborted request).
    held: Arc<watch::Sender<Vec<&'static str>>>,
    fetch_max_tasks: Mutex<Vec<u32>>,
}

impl Default for ControlledEngine {
    fn default() -> Self {
        ControlledEngine {
            frozen: watch::Sender::new(false),
            blocked: watch::Sender::new(Vec::new()),
            held: Arc::new(watch::Sender::new(Vec::new())),
            fetch_max_tasks: Mutex::new(Vec::new()),
        }
    }
}

impl ControlledEngine {
    /// From now on every call blocks until [`ControlledEngine::thaw`].
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Lets the blocked calls (and later ones) through.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// Waits until a call of `op` (`"complete"`, `"heartbeat"`, `"fetch-and-lock"`, ...) is
    /// blocked by the freeze.
    pub async fn wait_blocked(&self, op: &'static str) {
        let mut rx = self.blocked.subscribe();
        within(
            &format!("a frozen {op} call"),
            rx.wait_for(|ops| ops.contains(&op)),
        )
        .await
        .expect("sender alive");
    }

    /// Waits until no call of `op` is held by the freeze any more, although the engine is still
    /// frozen: the worker dropped the call it had on its way.
    pub async fn wait_dropped(&self, op: &'static str) {
        let mut rx = self.held.subscribe();
        within(
            &format!("the held {op} call dropped by the worker"),
            rx.wait_for(|ops| !ops.contains(&op)),
        )
        .await
        .expect("sender alive");
    }

    /// The operations that were blocked by a freeze, in order.
    pub fn blocked_ops(&self) -> Vec<&'static str> {
        self.blocked.borrow().clone()
    }

    /// The `maxTasks` of every fetch the runner sent, in order.
    pub fn fetch_max_tasks(&self) -> Vec<u32> {
        self.fetch_max_tasks.lock().unwrap().clone()
    }
}

#[async_trait]
impl Gate for ControlledEngine {
    async fn before(&self, op: Op<'_>, _task: Option<&TaskRef>) {
        if *self.frozen.borrow() {
            let name = op.name();
            self.blocked.send_modify(|ops| ops.push(name));
            let _held = Held::enter(self.held.clone(), name);
            let mut rx = self.frozen.subscribe();
            let _ = rx.wait_for(|frozen| !*frozen).await;
        }
        if let Op::FetchAndLock(request) = op {
            self.fetch_max_tasks.lock().unwrap().push(request.max_tasks);
        }
    }
}

/// A call held by the freeze, listed in [`ControlledEngine::held`] until it is let through or
/// dropped.
struct Held {
    list: Arc<watch::Sender<Vec<&'static str>>>,
    op: &'static str,
}

impl Held {
    fn enter(list: Arc<watch::Sender<Vec<&'static str>>>, op: &'static str) -> Held {
        list.send_modify(|ops| ops.push(op));
        Held { list, op }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.list.send_modify(|ops| {
            if let Some(i) = ops.iter().position(|o| *o == self.op) {
                ops.remove(i);
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// The worker

/// How to start a worker against the emulator. Defaults suit fast tests: 4 slots, a 50 ms poll
/// interval without jitter, short error backoffs, 5 s HTTP timeout, command retries 20..200 ms.
pub struct WorkerOptions {
    pub worker_id: String,
    pub handler: Arc<dyn TaskHandler>,
    pub max_tasks: u32,
    pub lock_duration: Duration,
    pub poll_interval: Duration,
    pub shutdown_grace: Duration,
    pub request_timeout: Duration,
    pub tuning: Tuning,
    /// The engine URL, when not the emulator's own (a proxy in front of it).
    pub engine_url: Option<String>,
}

impl WorkerOptions {
    /// A worker `worker_id` with `lock` leases whose tasks sleep 10 ms and complete.
    pub fn new(worker_id: &str, lock: Duration) -> Self {
        WorkerOptions {
            worker_id: worker_id.to_string(),
            handler: Arc::new(CompletingHandler::new(worker_id, Duration::from_millis(10))),
            max_tasks: 4,
            lock_duration: lock,
            poll_interval: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            tuning: Tuning {
                command_attempts: 6,
                command_backoff: Backoff::new(
                    Duration::from_millis(20),
                    Duration::from_millis(200),
                ),
                error_backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(200)),
                throttle_backoff: Backoff::new(
                    Duration::from_millis(50),
                    Duration::from_millis(200),
                ),
                poll_jitter: 0.0,
                ..Tuning::default()
            },
            engine_url: None,
        }
    }

    pub fn max_tasks(mut self, n: u32) -> Self {
        self.max_tasks = n;
        self
    }

    pub fn handler(mut self, handler: impl TaskHandler) -> Self {
        self.handler = Arc::new(handler);
        self
    }

    /// The worker's configuration: what its `ABADA_AGENT_*` variables would say.
    fn config(&self, emu: &EngineEmulator) -> Config {
        let ms = |d: Duration| d.as_millis().to_string();
        let env = HashMap::from([
            (
                config::ENV_ENGINE_URL.to_string(),
                self.engine_url.clone().unwrap_or_else(|| emu.base_url()),
            ),
            (config::ENV_WORKER_ID.to_string(), self.worker_id.clone()),
            (
                config::ENV_MAX_TASKS.to_string(),
                self.max_tasks.to_string(),
            ),
            (
                config::ENV_POLL_INTERVAL_MS.to_string(),
                ms(self.poll_interval),
            ),
            (
                config::ENV_LOCK_DURATION_MS.to_string(),
                ms(self.lock_duration),
            ),
            (
                config::ENV_SHUTDOWN_GRACE_MS.to_string(),
                ms(self.shutdown_grace),
            ),
            (
                config::ENV_ENGINE_TIMEOUT_MS.to_string(),
                ms(self.request_timeout),
            ),
            (config::ENV_HTTP_ADDR.to_string(), "127.0.0.1:0".to_string()),
        ]);
        Config::from_env(&env).expect("the test's worker options are a valid configuration")
    }
}

/// A running worker: its engine gate, the events its runner emitted, and a way to stop it.
pub struct SpawnedWorker {
    pub worker_id: String,
    pub engine: Arc<ControlledEngine>,
    events: watch::Receiver<Vec<RunnerEvent>>,
    shutdown: CancellationToken,
    join: tokio::task::JoinHandle<()>,
    collector: tokio::task::JoinHandle<()>,
}

/// Starts a worker against `emu`: built by the composition root from its options, its engine
/// client behind a [`ControlledEngine`], its tasks run by the options' handler.
pub fn spawn_worker(emu: &EngineEmulator, opts: WorkerOptions) -> SpawnedWorker {
    let config = opts.config(emu);
    let engine = Arc::new(ControlledEngine::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (events_tx, events) = watch::channel(Vec::new());
    let collector = tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            events_tx.send_modify(|all| all.push(e));
        }
    });
    let worker = Worker::build(
        &config,
        Seams {
            decorate_engine: Some(GatedEngine::wrapper(engine.clone())),
            handler: Some(opts.handler),
            tuning: opts.tuning,
            events: Some(tx),
            ..Seams::default()
        },
    )
    .expect("a worker against the emulator builds");
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(worker.runner.run(shutdown.clone()));
    SpawnedWorker {
        worker_id: opts.worker_id,
        engine,
        events,
        shutdown,
        join,
        collector,
    }
}

impl SpawnedWorker {
    /// Every event so far, in order.
    pub fn events(&self) -> Vec<RunnerEvent> {
        self.events.borrow().clone()
    }

    /// Waits for the first event (already emitted or to come) matching `pred`.
    pub async fn wait_event(&self, mut pred: impl FnMut(&RunnerEvent) -> bool) -> RunnerEvent {
        let mut rx = self.events.clone();
        let all = within(
            &format!("an event of worker {}", self.worker_id),
            rx.wait_for(|all| all.iter().any(&mut pred)),
        )
        .await
        .expect("event collector alive")
        .clone();
        all.into_iter().find(pred).expect("found above")
    }

    /// The `TaskEnded` outcome of `task_id` at `attempt`, once it ended.
    pub async fn wait_ended(&self, task_id: &str, attempt: u32) -> TaskEnd {
        match self
            .wait_event(|e| {
                matches!(e, RunnerEvent::TaskEnded { task_id: t, attempt: a, .. }
                    if t == task_id && *a == Some(attempt))
            })
            .await
        {
            RunnerEvent::TaskEnded { outcome, .. } => outcome,
            _ => unreachable!("matched TaskEnded"),
        }
    }

    /// Shuts the runner down (staged), waits for it, and returns every event it emitted.
    pub async fn stop(self) -> Vec<RunnerEvent> {
        self.shutdown.cancel();
        within(&format!("worker {} to stop", self.worker_id), self.join)
            .await
            .expect("runner task did not panic");
        // Every sender is gone once the runner and its heartbeat actor are: all events are in.
        within(
            &format!("the events of worker {}", self.worker_id),
            self.collector,
        )
        .await
        .expect("collector did not panic");
        self.events.borrow().clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Call log checks

/// True when the emulator accepted the call (a 2xx, executed or replayed).
pub fn accepted(c: &CallRecord) -> bool {
    (200..300).contains(&c.status)
        && matches!(c.disposition, Disposition::Executed | Disposition::Replayed)
        && !c.response_dropped
}

/// Checks, over the whole call log, that every accepted call about a task came from the worker
/// holding its current acquisition, with that acquisition's attempt: replaying the executed
/// fetches gives each task's holder and attempt at every point of the log. Panics with the
/// offending call otherwise.
pub fn check_lease_discipline(calls: &[CallRecord]) {
    use std::collections::HashMap;
    // task id -> (holder, attempt)
    let mut holder: HashMap<&str, (&str, i64)> = HashMap::new();
    for c in calls {
        if c.operation == Operation::FetchAndLock {
            if c.disposition == Disposition::Executed {
                let worker = c.worker_id.as_deref().unwrap_or("");
                for id in &c.task_ids {
                    let attempt = holder.get(id.as_str()).map_or(0, |(_, a)| *a) + 1;
                    holder.insert(id, (worker, attempt));
                }
            }
            continue;
        }
        if !(accepted(c) || (c.disposition == Disposition::Executed && c.response_dropped)) {
            continue;
        }
        let Some(task) = c.task_id.as_deref() else {
            continue;
        };
        let Some((worker, attempt)) = holder.get(task) else {
            panic!("accepted call about task {task} before any worker acquired it: {c:?}");
        };
        assert_eq!(
            c.worker_id.as_deref(),
            Some(*worker),
            "accepted call from a worker that does not hold task {task}: {c:?}"
        );
        assert_eq!(
            c.attempt,
            Some(*attempt),
            "accepted call about task {task} with another attempt than the current one: {c:?}"
        );
    }
}

/// The calls about task `id` of `operation`, in order.
pub fn calls_of<'a>(
    calls: &'a [CallRecord],
    id: &str,
    operation: Operation,
) -> Vec<&'a CallRecord> {
    calls
        .iter()
        .filter(|c| c.operation == operation && c.task_id.as_deref() == Some(id))
        .collect()
}
