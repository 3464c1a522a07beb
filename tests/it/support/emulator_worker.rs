//! Real workers against the engine emulator, for real-HTTP integration tests: [`spawn_worker`]
//! starts an [`HttpEngine`] + [`Runner`] pair talking to an [`EngineEmulator`] on 127.0.0.1,
//! behind a [`ControlledEngine`] decorator that can freeze the worker's engine calls and records
//! what the runner asked for; [`CompletingHandler`] is a small task handler that sleeps a little
//! real time and completes; [`check_lease_discipline`] checks the emulator's call log for two
//! live leases on one task.
//!
//! ```ignore
//! let emu = emulator::start(EmulatorOptions::default()).await?;
//! let w = spawn_worker(&emu, WorkerOptions::new("w1", Duration::from_secs(3)));
//! let ended = w.wait_event(|e| matches!(e, RunnerEvent::TaskEnded { .. })).await;
//! w.stop().await;
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::devkit::engine::{
    CallRecord, Disposition, EngineEmulator, Operation, TaskStatus, TaskView,
};
use abada_agent_worker::engine::client::{EngineClientSettings, HttpEngine};
use abada_agent_worker::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, Journal,
    JournalStep, Task, TaskRef, ToolCredential,
};
use abada_agent_worker::handler::{Outcome, TaskContext, TaskEnd, TaskHandler};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::runner::{Runner, RunnerEvent, RunnerSettings};
use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;

/// How long any single wait of these helpers may take before the test fails (a hang guard, not
/// a timing assertion).
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// Awaits `fut`, failing the test with `what` if it hangs past [`WAIT_LIMIT`].
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT_LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("gave up after {WAIT_LIMIT:?} waiting for {what}"),
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
// The engine decorator

/// Wraps a worker's [`Engine`]: while frozen, every call blocks (before reaching the engine)
/// until [`ControlledEngine::thaw`], as with a process stopped by the OS or a long GC pause.
/// It also records the `maxTasks` of every fetch the runner asks for.
pub struct ControlledEngine {
    inner: Arc<dyn Engine>,
    frozen: watch::Sender<bool>,
    /// Operation names of the calls that found the engine frozen, in order.
    blocked: watch::Sender<Vec<&'static str>>,
    fetch_max_tasks: Mutex<Vec<u32>>,
}

impl ControlledEngine {
    pub fn new(inner: Arc<dyn Engine>) -> Self {
        ControlledEngine {
            inner,
            frozen: watch::Sender::new(false),
            blocked: watch::Sender::new(Vec::new()),
            fetch_max_tasks: Mutex::new(Vec::new()),
        }
    }

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

    /// The operations that were blocked by a freeze, in order.
    pub fn blocked_ops(&self) -> Vec<&'static str> {
        self.blocked.borrow().clone()
    }

    /// The `maxTasks` of every fetch the runner sent, in order.
    pub fn fetch_max_tasks(&self) -> Vec<u32> {
        self.fetch_max_tasks.lock().unwrap().clone()
    }

    async fn gate(&self, op: &'static str) {
        if !*self.frozen.borrow() {
            return;
        }
        self.blocked.send_modify(|ops| ops.push(op));
        let mut rx = self.frozen.subscribe();
        let _ = rx.wait_for(|frozen| !*frozen).await;
    }
}

#[async_trait]
impl Engine for ControlledEngine {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        self.gate("fetch-and-lock").await;
        self.fetch_max_tasks.lock().unwrap().push(request.max_tasks);
        self.inner.fetch_and_lock(request).await
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        self.gate("heartbeat").await;
        self.inner.heartbeat(task, lock_duration).await
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        self.gate("complete").await;
        self.inner.complete(task, variables).await
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        self.gate("failure").await;
        self.inner.failure(task, report).await
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        self.gate("bpmn-error").await;
        self.inner.bpmn_error(task, report).await
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        self.gate("journal-read").await;
        self.inner.read_journal(task).await
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        self.gate("journal-append").await;
        self.inner.append_journal(task, step).await
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        self.gate("tool-credentials").await;
        self.inner.tool_credential(task, server).await
    }
}

// ---------------------------------------------------------------------------------------------
// The worker

/// How to start a worker against the emulator. Defaults suit fast tests: 4 slots, a 50 ms poll
/// interval without jitter, short error backoffs, 5 s HTTP timeout, command retries 20..200 ms.
pub struct WorkerOptions {
    pub worker_id: String,
    pub handler: Arc<dyn TaskHandler>,
    pub runner: RunnerSettings,
    pub client: ClientOptions,
}

/// The engine client's knobs a test may want to change.
pub struct ClientOptions {
    pub request_timeout: Duration,
    pub command_attempts: u32,
    pub command_backoff: Backoff,
}

impl WorkerOptions {
    /// A worker `worker_id` with `lock` leases whose tasks sleep 10 ms and complete.
    pub fn new(worker_id: &str, lock: Duration) -> Self {
        let mut runner = RunnerSettings::new(worker_id, lock);
        runner.max_tasks = 4;
        runner.poll_interval = Duration::from_millis(50);
        runner.poll_jitter = 0.0;
        runner.error_backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(200));
        runner.throttle_backoff =
            Backoff::new(Duration::from_millis(50), Duration::from_millis(200));
        runner.shutdown_grace = Duration::from_secs(5);
        WorkerOptions {
            worker_id: worker_id.to_string(),
            handler: Arc::new(CompletingHandler::new(worker_id, Duration::from_millis(10))),
            runner,
            client: ClientOptions {
                request_timeout: Duration::from_secs(5),
                command_attempts: 6,
                command_backoff: Backoff::new(
                    Duration::from_millis(20),
                    Duration::from_millis(200),
                ),
            },
        }
    }

    pub fn max_tasks(mut self, n: u32) -> Self {
        self.runner.max_tasks = n;
        self
    }

    pub fn handler(mut self, handler: impl TaskHandler) -> Self {
        self.handler = Arc::new(handler);
        self
    }
}

/// A running worker: its engine decorator, the events its runner emitted, and a way to stop it.
pub struct SpawnedWorker {
    pub worker_id: String,
    pub engine: Arc<ControlledEngine>,
    events: watch::Receiver<Vec<RunnerEvent>>,
    shutdown: CancellationToken,
    join: tokio::task::JoinHandle<()>,
    collector: tokio::task::JoinHandle<()>,
}

/// Starts a worker against `emu` (an [`HttpEngine`] on the emulator's base URL, wrapped in a
/// [`ControlledEngine`], driven by a [`Runner`]).
pub fn spawn_worker(emu: &EngineEmulator, opts: WorkerOptions) -> SpawnedWorker {
    let metrics = Arc::new(Metrics::new());
    let mut settings = EngineClientSettings::new(emu.base_url(), opts.worker_id.clone());
    settings.request_timeout = opts.client.request_timeout;
    settings.command_attempts = opts.client.command_attempts;
    settings.command_backoff = opts.client.command_backoff;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .build()
        .expect("a plain HTTP client builds");
    let http_engine: Arc<dyn Engine> =
        Arc::new(HttpEngine::new(http, settings, None, metrics.clone()));
    let engine = Arc::new(ControlledEngine::new(http_engine));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (events_tx, events) = watch::channel(Vec::new());
    let collector = tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            events_tx.send_modify(|all| all.push(e));
        }
    });
    let runner = Runner::new(
        engine.clone() as Arc<dyn Engine>,
        opts.handler,
        opts.runner,
        metrics,
    )
    .with_events(tx);
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(runner.run(shutdown.clone()));
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
