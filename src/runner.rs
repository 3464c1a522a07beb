//! The runner: slots, the poll loop, one future per task, reporting, and staged shutdown.
//!
//! It is a pure policy plus a loop. [`policy::FetchPolicy`] decides when to fetch, probe or
//! wait (the poll interval, a full batch, the backoff by error class, outage probing, which
//! errors are worth a warning); its module docs state the rules and its unit tests check them.
//! The loop here does what it decides, and owns everything else:
//!
//! - A semaphore of `MAX_TASKS` slots. Each fetch asks for exactly the free slots, and none when
//!   none is free: the worker never holds work it cannot start. Nor more than the handler's
//!   admission allows (per topic: the pace of the models its tasks use): a topic allowed none
//!   is left out of the fetch, and with none allowed at all no fetch until one returns or a
//!   task ends. Tasks an answer holds beyond
//!   that are released at once, as at shutdown, rather than left locked until they expire.
//! - Each task runs as its own spawned future owning its slot permit, in the loop's `JoinSet`
//!   beside the lease it runs under. A slot is the task's work: its conversation, its tool
//!   calls, its cleanup. When that work is done the task takes a report permit (a second
//!   semaphore of `MAX_TASKS`), gives its slot back and tells the loop, and only then sends its
//!   one report (complete, failure, bpmn-error) and runs what follows it. So the engine's
//!   answer to a report does not hold a slot: the next task's fetch goes out while the
//!   complete is still in flight, and a slot's cycle is the work plus one fetch, not the work
//!   plus a complete plus a fetch (on the real engine the two round trips were
//!   100-190 ms each beside a 100 ms model call). Reports in flight on a permit are bounded by
//!   the second semaphore: with all of them out, a finished task reports at once keeping its
//!   slot (it never waits for another report, which may never return), so an engine slower
//!   than the work holds the fetches back. A worker therefore holds at most `MAX_TASKS` tasks
//!   at work or reporting on their slot, and `MAX_TASKS` more reporting on a permit.
//! - The loop hears of every freed slot and tells the policy, which fetches at once (unless
//!   backing off from a failed fetch): with every slot busy, during the idle wait after an
//!   empty answer, or while a fetch was out. So a freed slot is refilled after one round trip,
//!   and a partial answer (others fetching at the same moment) is followed by a fetch for the
//!   rest at once. An empty answer right after tasks, or the first (another worker's fetch
//!   may have held the rows), is fetched again after a short jittered pause, backing off to
//!   the poll interval (the policy's rule).
//! - One attempt of a task at a time: the engine handing out a task that still runs here
//!   starts the newer attempt only once the older one has ended. An older attempt still at
//!   work is stopped (its lease is superseded); one already reporting is left to read its
//!   answer, because the engine may have applied that report already (a failure whose retry
//!   timeout ran out is offered again while its answer is on the way), and a retry of it
//!   carries the same idempotency key, so the engine answers it from storage without applying
//!   it again. A lease lost at any point stops its task at its next await; nothing is
//!   reported for it.
//! - A task's end is a [`TaskEnd`]: the one engine call its [`Outcome`] asks for (complete,
//!   failure, bpmn-error), or none when the lease was lost.
//! - The loop proves liveness ([`WorkerStatus`]) at least every few seconds while it waits, and
//!   never cancels a fetch in flight (the engine may have locked tasks for us).
//! - On shutdown: stop fetching, let tasks finish within the grace period, then ask the rest to
//!   stop at their next step boundary and release them (`failure`, retries unchanged,
//!   `retryTimeout` 0) so another replica resumes them at once.

pub mod policy;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff::Backoff;
use crate::engine::{Engine, EngineError, FailureReport, FetchRequest, LeaseLostReason, Task};
use crate::handler::{
    FailureKind, Outcome, TaskContext, TaskEnd, TaskError, TaskHandler, retries_consumed,
    retries_unchanged,
};
use crate::heartbeat::{self, HeartbeatEvent, HeartbeatHandle, HeartbeatSettings};
use crate::lease::Lease;
use crate::metrics::{Metrics, OutcomeLabel, ReasonLabel, ResultLabel};
use crate::provider::capacity::Capacity;
use crate::random::Random;
use policy::{Action, Admit, FetchPolicy, LogLevel};

/// How the runner behaves (from [`crate::config::Config`]).
#[derive(Clone, Debug)]
pub struct RunnerSettings {
    pub worker_id: String,
    pub topics: Vec<String>,
    pub max_tasks: u32,
    pub poll_interval: Duration,
    /// Fraction by which an idle wait is stretched at random, so replicas do not line up. Only
    /// ever longer than the poll interval (an idle worker asks at most once per interval), and
    /// small (a task created during a wait is picked up within the interval plus this).
    pub poll_jitter: f64,
    pub lock_duration: Duration,
    pub shutdown_grace: Duration,
    /// After the grace period: how long a task has to reach its next step boundary before it is
    /// dropped and released anyway.
    pub stop_wait: Duration,
    /// Backoff after transient engine errors (5xx, timeouts, connection errors).
    pub error_backoff: Backoff,
    /// Backoff after the engine asked to slow down (429/503 without Retry-After) or refused us
    /// (authentication, access).
    pub throttle_backoff: Backoff,
    /// The pauses after an empty answer that may be contention (right after tasks, or the
    /// first): `base` doubling, jittered; the poll interval bounds the run, not `max`.
    pub contention_backoff: Backoff,
    pub heartbeat: HeartbeatSettings,
}

impl RunnerSettings {
    pub fn new(worker_id: impl Into<String>, lock_duration: Duration) -> Self {
        RunnerSettings {
            worker_id: worker_id.into(),
            topics: vec!["abada:agent".into()],
            max_tasks: 4,
            poll_interval: Duration::from_millis(1000),
            poll_jitter: 0.02,
            lock_duration,
            shutdown_grace: Duration::from_secs(25),
            stop_wait: Duration::from_millis(500),
            error_backoff: Backoff::new(Duration::from_millis(1000), Duration::from_secs(6)),
            throttle_backoff: Backoff::new(Duration::from_secs(2), Duration::from_secs(30)),
            contention_backoff: Backoff::new(policy::CONTENTION_PAUSE, Duration::from_secs(3600)),
            heartbeat: HeartbeatSettings::new(lock_duration),
        }
    }
}

/// Something that happened, for tests, the demo's timeline and benchmarks.
#[derive(Clone, Debug, PartialEq)]
pub enum RunnerEvent {
    /// A fetch asked for `requested` tasks (the free slots) and got `got`.
    Fetched {
        requested: u32,
        got: usize,
    },
    FetchFailed {
        error: String,
    },
    TaskStarted {
        task_id: String,
        attempt: Option<u32>,
    },
    /// The task's work is done and its slot free; its report is about to be sent.
    SlotFreed {
        task_id: String,
        attempt: Option<u32>,
    },
    TaskEnded {
        task_id: String,
        attempt: Option<u32>,
        outcome: TaskEnd,
    },
    Heartbeat(HeartbeatEvent),
}

/// What liveness and readiness are computed from; shared with the admin endpoints.
pub struct WorkerStatus {
    started: Instant,
    last_tick_ms: AtomicU64,
    engine_ok: AtomicBool,
    draining: AtomicBool,
    problem: Mutex<Option<String>>,
}

impl Default for WorkerStatus {
    fn default() -> Self {
        WorkerStatus {
            started: Instant::now(),
            last_tick_ms: AtomicU64::new(0),
            engine_ok: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            problem: Mutex::new(Some("no fetch has succeeded yet".into())),
        }
    }
}

/// Why the engine makes the worker not ready, in a few words for `/readyz`: never the
/// engine's own text (a body may hold anything) nor a URL; the log line has the detail.
fn readiness_reason(e: &EngineError) -> &'static str {
    match e {
        EngineError::Transient { .. } => "the engine does not answer",
        EngineError::Unauthenticated { .. } => {
            "the engine does not accept the worker's credentials"
        }
        EngineError::Auth { .. } => "the worker cannot obtain its token from the OIDC issuer",
        EngineError::AccessDenied { .. } => "the engine denies the worker access",
        EngineError::Throttled { .. } => "the engine asks the worker to slow down",
        EngineError::UnsupportedProtocolVersion { .. } => "the engine does not speak protocol v1",
        EngineError::MalformedResponse { .. } | EngineError::TooLarge { .. } => {
            "the engine's answers cannot be read"
        }
        _ => "the engine refuses to fetch",
    }
}

impl WorkerStatus {
    fn tick(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.last_tick_ms.store(ms, Ordering::Relaxed);
    }

    /// Time since the poll loop last went round.
    pub(crate) fn since_last_tick(&self) -> Duration {
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_tick_ms.load(Ordering::Relaxed)))
    }

    fn engine_ok(&self) {
        if !self.engine_ok.swap(true, Ordering::Relaxed) {
            tracing::info!("engine reachable: the worker is ready");
        }
        *self.problem.lock().expect("status lock") = None;
    }

    fn engine_failed(&self, problem: String) {
        self.engine_ok.store(false, Ordering::Relaxed);
        *self.problem.lock().expect("status lock") = Some(problem);
    }

    /// Engine reachable and authenticated, and not draining.
    pub fn is_ready(&self) -> bool {
        self.engine_ok.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Why the worker is not ready, if it is not.
    pub fn problem(&self) -> Option<String> {
        if self.is_draining() {
            return Some("shutting down".into());
        }
        self.problem.lock().expect("status lock").clone()
    }
}

/// The runner of one worker process.
pub struct Runner {
    engine: Arc<dyn Engine>,
    handler: Arc<dyn TaskHandler>,
    settings: RunnerSettings,
    metrics: Arc<Metrics>,
    status: Arc<WorkerStatus>,
    events: Option<mpsc::UnboundedSender<RunnerEvent>>,
    /// The worker's randomness: the poll loop's and the heartbeat retries' jitter.
    random: Random,
}

/// What the running tasks share with the poll loop.
struct Shared {
    engine: Arc<dyn Engine>,
    handler: Arc<dyn TaskHandler>,
    heartbeat: HeartbeatHandle,
    metrics: Arc<Metrics>,
    slots: Arc<Semaphore>,
    /// Reports in flight (`MAX_TASKS`): a task takes one before it gives its slot back.
    reports: Arc<Semaphore>,
    /// One message per slot given back, to the poll loop ([`RunningTasks::slot_freed`]).
    slot_freed: mpsc::UnboundedSender<()>,
    max_tasks: u32,
    stop: CancellationToken,
    stop_wait: Duration,
    worker_span: tracing::Span,
    events: Option<mpsc::UnboundedSender<RunnerEvent>>,
}

impl Shared {
    fn emit(&self, event: RunnerEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    fn update_slot_gauge(&self) {
        let in_use = self.max_tasks as i64 - self.slots.available_permits() as i64;
        self.metrics.slots_in_use.set(in_use);
    }
}

/// What [`RunningTasks::next_change`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    SlotFreed,
    Joined,
}

/// The tasks running here, owned by the poll loop: their futures, and what the loop needs to
/// know of each when the engine hands the same task out again. The loop learns of a task's
/// end by joining it, so no second record has to be kept in step by hand.
struct RunningTasks {
    set: JoinSet<()>,
    /// Every attempt not joined yet, by its future's id.
    attempts: HashMap<tokio::task::Id, RunningAttempt>,
    /// A message per slot a task gave back (its work done, its report not yet sent).
    freed: mpsc::UnboundedReceiver<()>,
}

/// One attempt running here, as the poll loop sees it.
struct RunningAttempt {
    lease: Lease,
    /// Set by the attempt once its work is done and its report may be on the wire.
    reporting: Arc<AtomicBool>,
    /// Cancelled when the attempt's future ends, or is dropped.
    ended: CancellationToken,
}

impl RunningTasks {
    fn new(freed: mpsc::UnboundedReceiver<()>) -> Self {
        RunningTasks {
            set: JoinSet::new(),
            attempts: HashMap::new(),
            freed,
        }
    }

    /// Waits until a task gives its slot back ([`Change::SlotFreed`]) or a task's future ends
    /// and is forgotten ([`Change::Joined`]; its slot was given back before). Cancel-safe, so
    /// it can race the loop's waits in `select!`.
    async fn next_change(&mut self) -> Option<Change> {
        // Biased, a freed slot first: a task gives its slot back before its future ends, so
        // the two are seen in that order.
        tokio::select! {
            biased;
            Some(()) = self.freed.recv() => Some(Change::SlotFreed),
            Some(joined) = self.set.join_next_with_id() => {
                self.forget(joined);
                Some(Change::Joined)
            }
            else => None,
        }
    }

    /// Forgets the slots given back so far: a fetch about to ask for every free slot covers
    /// them. (A slot is given back before its message is sent, so a message always comes after
    /// its slot is counted free: none is lost, at worst one brings a fetch of no new slot.)
    fn forget_freed(&mut self) {
        while self.freed.try_recv().is_ok() {}
    }

    /// Spawns `run`, the attempt holding `lease`, which sets `reporting` once its work is
    /// done. When an older attempt of the same task still runs here (the engine gave us the
    /// task again), `run` starts only once that one has ended; the older attempt is stopped
    /// (superseded) unless it is already reporting, in which case it reads its answer first.
    /// (An attempt that starts reporting just as it is superseded ends `lease_lost` without
    /// sending: safe, only a report lost.)
    fn start(
        &mut self,
        lease: Lease,
        reporting: Arc<AtomicBool>,
        run: impl Future<Output = ()> + Send + 'static,
    ) {
        let older: Vec<CancellationToken> = self
            .attempts
            .values()
            .filter(|a| a.lease.task().task_id == lease.task().task_id)
            .map(|a| {
                if !a.reporting.load(Ordering::SeqCst) {
                    a.lease.mark_lost(LeaseLostReason::Superseded);
                }
                a.ended.clone()
            })
            .collect();
        // SIM-BUG (feature `sim-bugs`, selected at run time): every older attempt superseded,
        // reporting or not, and the newer started at once.
        #[cfg(feature = "sim-bugs")]
        let older = if crate::sim_bugs::active(crate::sim_bugs::Bug::SupersedeReporting) {
            for a in self
                .attempts
                .values()
                .filter(|a| a.lease.task().task_id == lease.task().task_id)
            {
                a.lease.mark_lost(LeaseLostReason::Superseded);
            }
            Vec::new()
        } else {
            older
        };
        let ended = CancellationToken::new();
        let on_end = ended.clone().drop_guard();
        let handle = self.set.spawn(async move {
            let _on_end = on_end;
            for older in older {
                older.cancelled().await;
            }
            run.await
        });
        self.attempts.insert(
            handle.id(),
            RunningAttempt {
                lease,
                reporting,
                ended,
            },
        );
    }

    /// Waits until a task ends and forgets it; `None` at once when none runs. Cancel-safe, so
    /// it can race the loop's waits in `select!`.
    async fn join_next(&mut self) -> Option<()> {
        let joined = self.set.join_next_with_id().await?;
        self.forget(joined);
        Some(())
    }

    /// Forgets every task that has ended, without waiting; returns how many.
    fn reap(&mut self) -> usize {
        let mut ended = 0;
        while let Some(joined) = self.set.try_join_next_with_id() {
            self.forget(joined);
            ended += 1;
        }
        ended
    }

    fn forget(&mut self, joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let id = match joined {
            Ok((id, ())) => id,
            Err(e) => {
                // `run_task` catches the handler's panics; this would be a bug of the runner.
                if e.is_panic() {
                    tracing::error!(error = %e, "a task's runner future panicked");
                }
                e.id()
            }
        };
        self.attempts.remove(&id);
    }

    fn len(&self) -> usize {
        self.set.len()
    }
}

impl Runner {
    /// The runner of a worker, built by the composition root alone (`app::Worker::build`).
    pub(crate) fn new(
        engine: Arc<dyn Engine>,
        handler: Arc<dyn TaskHandler>,
        settings: RunnerSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Runner {
            engine,
            handler,
            settings,
            metrics,
            status: Arc::new(WorkerStatus::default()),
            events: None,
            random: Random::os(),
        }
    }

    /// Draws the jitter of the poll loop and of the heartbeat retries from `random`.
    pub(crate) fn with_random(mut self, random: Random) -> Self {
        self.random = random;
        self
    }

    /// Sends every [`RunnerEvent`] to `events`.
    pub fn with_events(mut self, events: mpsc::UnboundedSender<RunnerEvent>) -> Self {
        self.events = Some(events);
        self
    }

    pub fn status(&self) -> Arc<WorkerStatus> {
        self.status.clone()
    }

    /// Runs until `shutdown` fires, then drains (see the module docs) and returns.
    pub async fn run(self, shutdown: CancellationToken) {
        let s = &self.settings;
        let heartbeat_events = self.events.clone().map(|runner_events| {
            let (tx, mut rx) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                while let Some(e) = rx.recv().await {
                    if runner_events.send(RunnerEvent::Heartbeat(e)).is_err() {
                        break;
                    }
                }
            });
            tx
        });
        let heartbeat = heartbeat::spawn(
            self.engine.clone(),
            s.heartbeat.clone(),
            self.metrics.clone(),
            heartbeat_events,
            self.random.clone(),
        );
        let (slot_freed, freed) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            engine: self.engine.clone(),
            handler: self.handler.clone(),
            heartbeat,
            metrics: self.metrics.clone(),
            slots: Arc::new(Semaphore::new(s.max_tasks as usize)),
            reports: Arc::new(Semaphore::new(s.max_tasks as usize)),
            slot_freed,
            max_tasks: s.max_tasks,
            stop: CancellationToken::new(),
            stop_wait: s.stop_wait,
            worker_span: tracing::info_span!("worker", worker_id = %s.worker_id),
            events: self.events.clone(),
        });
        self.metrics.slots_total.set(s.max_tasks as i64);
        let mut tasks = RunningTasks::new(freed);

        self.poll_loop(&shared, &mut tasks, &shutdown)
            .instrument(shared.worker_span.clone())
            .await;

        // Drain: stop fetching (done), let tasks finish within the grace period.
        self.status.draining.store(true, Ordering::Relaxed);
        tasks.reap();
        let running = tasks.len();
        if running > 0 {
            tracing::info!(parent: &shared.worker_span, running, grace_ms = s.shutdown_grace.as_millis() as u64, "shutting down: waiting for running tasks");
        }
        if !self.wait_ticking(&mut tasks, Some(s.shutdown_grace)).await {
            tracing::warn!(parent: &shared.worker_span, still_running = tasks.len(), "grace period over: stopping the remaining tasks at their next step and releasing them");
            shared.stop.cancel();
            self.wait_ticking(&mut tasks, None).await;
        }
        tracing::info!(parent: &shared.worker_span, "worker stopped");
    }

    /// Waits for every task to end (at most `limit`), proving liveness meanwhile so a long drain
    /// does not fail `/healthz`. Returns whether they all ended.
    async fn wait_ticking(&self, tasks: &mut RunningTasks, limit: Option<Duration>) -> bool {
        let deadline = limit.map(|l| Instant::now() + l);
        loop {
            self.status.tick();
            let step = Instant::now() + LIVENESS_TICK;
            let until = deadline.map_or(step, |d| d.min(step));
            // Biased, an ended task first: one that ends at the deadline counts as ended.
            tokio::select! {
                biased;
                joined = tasks.join_next() => {
                    if joined.is_none() {
                        return true;
                    }
                }
                _ = tokio::time::sleep_until(until) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return false;
                    }
                }
            }
        }
    }

    /// Fetches, starts tasks, probes and waits as the [`FetchPolicy`] says, until `shutdown`.
    /// The I/O, metrics, logs and liveness are here; the decisions are the policy's.
    async fn poll_loop(
        &self,
        shared: &Arc<Shared>,
        tasks: &mut RunningTasks,
        shutdown: &CancellationToken,
    ) {
        let random = self.random.clone();
        let mut policy = FetchPolicy::new(
            &self.settings,
            Instant::now(),
            Box::new(move || random.unit()),
        );
        // When a fetch of one task is due even with every topic's models held (admission).
        let mut admission_probe_at = Instant::now();
        loop {
            self.status.tick();
            if shutdown.is_cancelled() {
                return;
            }
            let now = Instant::now();
            match policy.next(now) {
                Action::WaitUntil(until) => {
                    // A task ending meanwhile frees its slot: the policy fetches at once after
                    // an empty answer, and keeps a backoff.
                    // Biased in every wait of the loop: the shutdown first (no fetch once it is
                    // asked for), then a task's end, then the timer.
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        Some(change) = tasks.next_change() => if change == Change::SlotFreed {
                            policy.task_ended(Instant::now())
                        },
                        _ = tokio::time::sleep_until(until.min(now + LIVENESS_TICK)) => {}
                    }
                }
                Action::Probe => {
                    let outcome = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        outcome = shared.engine.probe() => outcome,
                    };
                    if policy.probed(Instant::now(), outcome) {
                        tracing::info!("the engine answers again: fetching now");
                    }
                }
                Action::Fetch => {
                    let free = shared.slots.available_permits() as u32;
                    if free == 0 {
                        // A task's end frees its slot: refill it after one round trip.
                        tokio::select! {
                            biased;
                            _ = shutdown.cancelled() => return,
                            Some(change) = tasks.next_change() => if change == Change::SlotFreed {
                                policy.task_ended(Instant::now())
                            },
                            _ = tokio::time::sleep(LIVENESS_TICK) => {}
                        }
                        continue;
                    }
                    // No more tasks than the models behind them can start soon, and no topic
                    // whose models can start none.
                    let now = Instant::now();
                    let topics: Vec<(String, Capacity)> = self
                        .settings
                        .topics
                        .iter()
                        .map(|t| (t.clone(), shared.handler.admission(t, now)))
                        .collect();
                    match policy::admit(free, &topics, now, admission_probe_at) {
                        Admit::Fetch { max, topics, probe } => {
                            if probe {
                                admission_probe_at = now + self.settings.poll_interval;
                            }
                            self.fetch(shared, tasks, &mut policy, max, topics).await
                        }
                        Admit::WaitUntil(until) => {
                            tokio::select! {
                                biased;
                                _ = shutdown.cancelled() => return,
                                Some(change) = tasks.next_change() => if change == Change::SlotFreed {
                                    policy.task_ended(Instant::now())
                                },
                                _ = tokio::time::sleep_until(until.min(now + LIVENESS_TICK)) => {}
                            }
                        }
                    }
                }
            }
        }
    }

    /// One fetch of the `free` slots, and the start of every task it locked.
    async fn fetch(
        &self,
        shared: &Arc<Shared>,
        tasks: &mut RunningTasks,
        policy: &mut FetchPolicy,
        free: u32,
        topics: Vec<String>,
    ) {
        let s = &self.settings;
        tasks.forget_freed();
        let batch = shared
            .slots
            .clone()
            .try_acquire_many_owned(free)
            .expect("only the poll loop takes permits, so the free ones are there");
        let acquired_at = Instant::now();
        let request = FetchRequest {
            topics,
            lock_duration: s.lock_duration,
            max_tasks: free,
        };
        // An in-flight fetch is not cancelled on shutdown: the engine may have locked tasks for
        // us; they are started (and drained or released) rather than stranded.
        match shared.engine.fetch_and_lock(&request).await {
            Ok(locked) => {
                let got = locked.len();
                if policy.fetched(Instant::now(), got) {
                    tracing::info!("fetch-and-lock works again");
                }
                self.metrics.backoff_seconds.set(0.0);
                self.status.engine_ok();
                self.metrics
                    .fetches
                    .get_or_create(&ResultLabel {
                        result: if got == 0 { "empty" } else { "tasks" },
                    })
                    .inc();
                shared.emit(RunnerEvent::Fetched {
                    requested: free,
                    got,
                });
                // Attempts that ended are no longer running: only a live one is superseded.
                // A slot given back while the fetch was out is still in `slot_freed`: it
                // brings the next fetch.
                tasks.reap();
                let mut locked = locked;
                let surplus = locked.split_off(locked.len().min(free as usize));
                if !locked.is_empty() {
                    shared.handler.claimed(&locked, Instant::now());
                }
                let mut batch = batch;
                for task in locked {
                    let permit = batch
                        .split(1)
                        .expect("at most `free` tasks, one permit each");
                    self.start_task(shared, tasks, task, permit, acquired_at);
                }
                drop(batch);
                shared.update_slot_gauge();
                if !surplus.is_empty() {
                    release_surplus(shared, surplus, free).await;
                }
            }
            Err(e) => {
                drop(batch);
                let text = e.to_string();
                let failed = policy.fetch_failed(Instant::now(), &e);
                self.metrics
                    .fetches
                    .get_or_create(&ResultLabel { result: "error" })
                    .inc();
                shared.emit(RunnerEvent::FetchFailed {
                    error: text.clone(),
                });
                self.metrics.backoff_seconds.set(failed.wait.as_secs_f64());
                if e.is_engine_down() {
                    self.status.engine_failed(readiness_reason(&e).to_string());
                }
                let retry_in_ms = failed.wait.as_millis() as u64;
                match failed.log_at {
                    LogLevel::Debug => {
                        tracing::debug!(error = %text, retry_in_ms, failures = failed.failures, "fetch-and-lock failed again")
                    }
                    LogLevel::Warn => {
                        tracing::warn!(error = %text, retry_in_ms, failures = failed.failures, "fetch-and-lock failed")
                    }
                }
            }
        }
    }

    fn start_task(
        &self,
        shared: &Arc<Shared>,
        tasks: &mut RunningTasks,
        task: Task,
        permit: OwnedSemaphorePermit,
        acquired_at: Instant,
    ) {
        let lease = Lease::new(task.task_ref());
        let reporting = Arc::new(AtomicBool::new(false));
        shared.heartbeat.register(lease.clone(), acquired_at);
        self.metrics.tasks_claimed.inc();
        shared.emit(RunnerEvent::TaskStarted {
            task_id: task.id.clone(),
            attempt: task.attempt,
        });
        tasks.start(
            lease.clone(),
            reporting.clone(),
            run_task(
                shared.clone(),
                Arc::new(task),
                lease,
                reporting,
                permit,
                acquired_at,
            ),
        );
    }
}

/// How many surplus tasks are released at once (one engine call each).
const SURPLUS_RELEASES_AT_ONCE: usize = 8;

/// The longest the poll loop spends releasing one answer's surplus: an engine that answers
/// thousands of tasks and then stalls on each release must not stall the loop (and its
/// liveness) with it. What is not released by then is left to its lock's expiry.
const SURPLUS_RELEASE_LIMIT: Duration = Duration::from_secs(10);

/// Gives back at once the tasks a fetch answer held beyond the `asked` maxTasks: no slot is
/// free for them, and left alone they would stay locked to this worker until their lock
/// expires. Each is released as at shutdown (`failure`, retries unchanged, `retryTimeout` 0),
/// so the next fetch, here or at another worker, takes it at once. The call is not fenced by a
/// lease: none was taken, the task never started here.
async fn release_surplus(shared: &Shared, surplus: Vec<Task>, asked: u32) {
    use futures::StreamExt;
    tracing::warn!(
        asked,
        surplus = surplus.len(),
        "the engine answered a fetch with more tasks than maxTasks asked for; releasing the surplus at once (retries unchanged)"
    );
    let release = futures::stream::iter(surplus).for_each_concurrent(
        SURPLUS_RELEASES_AT_ONCE,
        |task| async move {
            let report = FailureReport {
                error_message: "released at once: the engine handed this worker more tasks than it asked for (maxTasks)".into(),
                error_details: String::new(),
                retries: retries_unchanged(&task),
                retry_timeout: Duration::ZERO,
            };
            if let Err(e) = shared.engine.failure(&task.task_ref(), &report).await {
                tracing::warn!(task_id = %task.id, error = %e, "could not release a surplus task; its lock will expire and the engine will offer it again");
            }
        },
    );
    if tokio::time::timeout(SURPLUS_RELEASE_LIMIT, release)
        .await
        .is_err()
    {
        tracing::warn!(
            limit_ms = SURPLUS_RELEASE_LIMIT.as_millis() as u64,
            "releasing the surplus took too long; the tasks not released yet are left to their locks' expiry"
        );
    }
}

/// How often the poll loop proves it is alive while it waits.
const LIVENESS_TICK: Duration = Duration::from_secs(5);

fn task_span(parent: &tracing::Span, task: &Task) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!(
        parent: parent,
        "task",
        task_id = %task.id,
        process_instance_id = Empty,
        activity_id = Empty,
        attempt = Empty,
        trace_id = Empty,
    );
    // Fields the engine did not send stay off the log lines rather than showing as blanks.
    if let Some(p) = &task.process_instance_id {
        span.record("process_instance_id", p.as_str());
    }
    if let Some(a) = &task.activity_id {
        span.record("activity_id", a.as_str());
    }
    if let Some(a) = task.attempt {
        span.record("attempt", a);
    }
    if let Some(t) = &task.trace_parent {
        span.record("trace_id", t.trace_id());
    }
    span
}

async fn run_task(
    shared: Arc<Shared>,
    task: Arc<Task>,
    lease: Lease,
    reporting: Arc<AtomicBool>,
    permit: OwnedSemaphorePermit,
    acquired_at: Instant,
) {
    let started = Instant::now();
    shared
        .metrics
        .pickup_latency
        .observe(started.saturating_duration_since(acquired_at).as_secs_f64());
    let span = task_span(&shared.worker_span, &task);
    async {
        tracing::info!(topic = %task.topic, retries = task.retries, "task started");
        let ctx = TaskContext::new(shared.engine.clone(), lease.clone(), shared.stop.clone());
        let cleanup = ctx.cleanup().clone();
        let after_report = ctx.after_report_slot().clone();
        let handler = shared.handler.clone();
        let mut handle = tokio::spawn(
            {
                let task = task.clone();
                async move { handler.handle(task, ctx).await }
            }
            .in_current_span(),
        );
        let stop_deadline = async {
            shared.stop.cancelled().await;
            tokio::time::sleep(shared.stop_wait).await;
        };
        let (outcome, aborted) = tokio::select! {
            biased;
            // The local expiry too, not only the scheduler's verdict: the slot is freed at the
            // expiry whatever the scheduler is doing.
            _ = lease.lost_or_expired() => {
                handle.abort();
                (Outcome::Abandoned, true)
            }
            joined = &mut handle => (match joined {
                Ok(outcome) => outcome,
                Err(e) if e.is_panic() => {
                    tracing::error!("the task handler panicked; the task is failed technically so it can be retried");
                    Outcome::Failure {
                        kind: FailureKind::Technical,
                        report: FailureReport {
                            error_message: "the worker's task handler panicked".into(),
                            error_details: panic_message(e),
                            retries: retries_consumed(&task),
                            retry_timeout: Duration::from_secs(10),
                        },
                    }
                }
                Err(_) => Outcome::Abandoned,
            }, false),
            _ = stop_deadline => {
                handle.abort();
                (Outcome::released(&task, "the worker shut down before the task finished; another worker resumes it"), true)
            }
        };
        // An aborted handler is dropped at its next await, and what it held (open MCP
        // sessions, a close or an opening under way) goes on in tasks of the cleanup tracker:
        // wait for the drop, then for those, before the lease is given back (a session's
        // credential may die with it). Each is bounded (`ToolSessionOptions`' timeouts).
        if aborted {
            let _ = handle.await;
        }
        cleanup.close();
        cleanup.wait().await;
        // From here a newer attempt of this task waits for this one's answer instead of
        // superseding it (`RunningTasks::start`).
        reporting.store(true, Ordering::SeqCst);
        // The work is done: with a report permit free, the slot goes back and the loop fetches
        // for it while this report is out. With every report permit taken (reports slower than
        // the work, or one that never returns), the task reports at once keeping its slot, as
        // if there were no permits: a report never waits for another's, and no fetch comes
        // while slots are held by reports.
        let report_permit = shared.reports.clone().try_acquire_owned();
        // SIM-BUG (feature `sim-bugs`, selected at run time): the slot goes back whatever the
        // report permits say.
        #[cfg(feature = "sim-bugs")]
        let report_permit = report_permit.or_else(|e| {
            if crate::sim_bugs::active(crate::sim_bugs::Bug::ReportPermitIgnored) {
                Arc::new(Semaphore::new(1)).try_acquire_owned()
            } else {
                Err(e)
            }
        });
        let (slot, on_slot) = match report_permit {
            Ok(report_permit) => {
                drop(permit);
                shared.update_slot_gauge();
                shared.emit(RunnerEvent::SlotFreed {
                    task_id: task.id.clone(),
                    attempt: task.attempt,
                });
                let _ = shared.slot_freed.send(());
                (report_permit, false)
            }
            Err(_) => (permit, true),
        };
        // Stop extending before reporting: an extension still in flight could otherwise reach
        // the engine after the completion, be refused as "not locked" and make a completed task
        // look lost. The report is fenced by the lease's local expiry (`TaskContext::fenced`
        // watches the clock, not the scheduler): an engine that does not answer it holds the
        // report permit until then at most, and nothing about the task is sent after it.
        shared.heartbeat.release(lease.id());
        let end = report(&shared, &task, &lease, outcome).await;
        after_report.run(end).await;
        if end == TaskEnd::LeaseLost {
            let reason = lease.lost_reason().unwrap_or(LeaseLostReason::NotOwned);
            shared
                .metrics
                .leases_lost
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .inc();
        }
        let took = started.elapsed().as_secs_f64();
        shared
            .metrics
            .tasks_ended
            .get_or_create(&OutcomeLabel { outcome: end })
            .inc();
        shared
            .metrics
            .task_duration
            .get_or_create(&OutcomeLabel { outcome: end })
            .observe(took);
        tracing::info!(outcome = end.as_str(), duration_ms = (took * 1000.0) as u64, "task ended");
        shared.emit(RunnerEvent::TaskEnded {
            task_id: task.id.clone(),
            attempt: task.attempt,
            outcome: end,
        });
        // SIM-BUG (feature `sim-bugs`, selected at run time): the slot of a failed report is
        // never given back.
        #[cfg(feature = "sim-bugs")]
        if end == TaskEnd::ReportFailed
            && crate::sim_bugs::active(crate::sim_bugs::Bug::SlotLeakedOnReportFailure)
        {
            std::mem::forget(slot);
            return;
        }
        // The report permit, or the slot of a task that reported holding it.
        drop(slot);
        if on_slot {
            shared.update_slot_gauge();
            let _ = shared.slot_freed.send(());
        }
    }
    .instrument(span)
    .await;
}

/// Turns an outcome into its one engine call; nothing when the lease is lost. An outcome the
/// engine cannot store, or a completion or BPMN error it refuses for good, ends the task once
/// as an incident instead: never is a task left to expire and run again on a refusal that
/// will repeat (docs/OPERATIONS.md "How a task ends").
async fn report(shared: &Shared, task: &Task, lease: &Lease, outcome: Outcome) -> TaskEnd {
    let outcome = outcome.storable();
    let end = outcome.end();
    if lease.is_lost() || matches!(outcome, Outcome::Abandoned) {
        return TaskEnd::LeaseLost;
    }
    let ctx = TaskContext::new(
        shared.engine.clone(),
        lease.clone(),
        CancellationToken::new(),
    );
    let task_ref = lease.task();
    let result = match &outcome {
        Outcome::Complete { variables } => {
            ctx.fenced(shared.engine.complete(task_ref, variables))
                .await
        }
        Outcome::BpmnError(r) => ctx.fenced(shared.engine.bpmn_error(task_ref, r)).await,
        Outcome::Failure { report, .. } => {
            ctx.fenced(shared.engine.failure(task_ref, report)).await
        }
        Outcome::Abandoned => unreachable!("handled above"),
    };
    let result = match result {
        Err(TaskError::Engine(e)) if e.is_refusal() => match outcome.refused_instead(&e) {
            Some(instead) => {
                tracing::error!(task_id = %task.id, error = %e, outcome = end.as_str(), "the engine refused the task's outcome for good; reporting it once as an incident");
                return match ctx.fenced(shared.engine.failure(task_ref, &instead)).await {
                    Ok(()) => TaskEnd::Incident,
                    Err(TaskError::LeaseLost(_)) => TaskEnd::LeaseLost,
                    Err(TaskError::Engine(e)) => {
                        tracing::error!(task_id = %task.id, error = %e, "could not report the refused outcome as an incident either; its lease will expire and the engine will offer it again");
                        TaskEnd::ReportFailed
                    }
                };
            }
            None => Err(TaskError::Engine(e)),
        },
        other => other,
    };
    // SIM-BUG (feature `sim-bugs`, selected at run time): a failed complete sent again,
    // unfenced, until the engine takes it.
    #[cfg(feature = "sim-bugs")]
    let result = match (result, &outcome) {
        (Err(TaskError::Engine(_)), Outcome::Complete { variables })
            if crate::sim_bugs::active(crate::sim_bugs::Bug::ReportRetriedPastLease) =>
        {
            let mut again = Err(TaskError::LeaseLost(LeaseLostReason::NotOwned));
            for _ in 0..120 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if shared.engine.complete(task_ref, variables).await.is_ok() {
                    again = Ok(());
                    break;
                }
            }
            again
        }
        (result, _) => result,
    };
    match result {
        Ok(()) => end,
        Err(TaskError::LeaseLost(_)) => TaskEnd::LeaseLost,
        Err(TaskError::Engine(e)) => {
            tracing::error!(task_id = %task.id, error = %e, outcome = end.as_str(), "could not report the task's outcome; its lease will expire and the engine will offer it again");
            TaskEnd::ReportFailed
        }
    }
}

fn panic_message(e: tokio::task::JoinError) -> String {
    let payload = e.into_panic();
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
