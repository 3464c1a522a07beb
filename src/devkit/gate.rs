//! The one engine decorator of the devkit: [`GatedEngine`] puts every call a worker makes to
//! the engine (the HTTP client against a devkit stack, or the simulator's in-process world
//! engine) through a [`Gate`]:
//!
//! - [`before`](Gate::before) sees the operation and the task, and may record the call or hold
//!   it (await) for as long as it likes: a process frozen by the OS, a test stopping a worker at
//!   an exact step;
//! - [`verdict`](Gate::verdict) may answer the call itself instead of the engine, with the error
//!   the client would return (a refusal, an outage: the engine never sees the call);
//! - [`fetch_request`](Gate::fetch_request) may ask the engine for another number of tasks than
//!   the worker asked for (an engine that answers more, or fewer);
//! - [`after`](Gate::after) sees the engine's answer, and may hold it (a slow answer to a call
//!   already applied).
//!
//! The takeover demo's freeze ([`super::freeze`]), the tests' controlled engines and
//! [`FaultGate`] (the paused-clock tests' engine faults, each a knob, and the log of every call)
//! are gates.
//!
//! It needs the worker's [`Engine`] trait, so it lives on the worker's devkit side; production
//! has no use for it (the composition root takes any engine decorator through
//! [`crate::app::Seams::decorate_engine`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::app::EngineWrapper;
use crate::engine::{
    AnonymousAccess, AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport,
    FetchRequest, HistoryPage, Journal, JournalStep, LeaseLostReason, OP_PROCESS_DEFINITION,
    OP_PROCESS_HISTORY, OP_PROCESS_INSTANCE, ProbeOutcome, ProcessDefinition, ProcessInstance,
    Task, TaskRef, ToolCredential,
};

/// One engine call as a gate sees it, with what a gate may decide on.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    FetchAndLock(&'a FetchRequest),
    Heartbeat,
    Complete,
    Failure(&'a FailureReport),
    BpmnError,
    JournalRead,
    JournalAppend(&'a JournalStep),
    ToolCredentials {
        server: &'a str,
    },
    /// The reachability probe of the poll loop's backoff ([`Engine::probe`]).
    Probe,
    /// A read of the process API for an agent defined in the BPMN: the instance
    /// ([`Engine::process_instance`]) or the definition ([`Engine::process_definition`]); or
    /// of an instance's activity history ([`Engine::process_history`], and its
    /// [`Engine::anonymous_history_read`]), `id` the instance.
    ProcessRead {
        op: &'static str,
        id: &'a str,
    },
}

impl Op<'_> {
    /// The operation's name, as in the engine metrics: `fetch-and-lock`, `journal-append`, ...
    pub fn name(&self) -> &'static str {
        match self {
            Op::FetchAndLock(_) => "fetch-and-lock",
            Op::Heartbeat => "heartbeat",
            Op::Complete => "complete",
            Op::Failure(_) => "failure",
            Op::BpmnError => "bpmn-error",
            Op::JournalRead => "journal-read",
            Op::JournalAppend(_) => "journal-append",
            Op::ToolCredentials { .. } => "tool-credentials",
            Op::Probe => "probe",
            Op::ProcessRead { op, .. } => op,
        }
    }

    /// The journal step an append carries.
    pub fn step(&self) -> Option<&JournalStep> {
        match self {
            Op::JournalAppend(step) => Some(step),
            _ => None,
        }
    }
}

/// Whether a call goes on to the engine ([`Gate::verdict`]).
#[derive(Debug)]
pub enum Verdict {
    /// Send it to the engine.
    Forward,
    /// Answer it with this error instead, as the client would return it: the engine never sees
    /// the call. A probe so answered finds the engine unreachable.
    Fail(EngineError),
    /// A probe only (forwarded otherwise): this outcome instead of the engine's.
    Probe(ProbeOutcome),
    /// A fetch only (forwarded otherwise): an empty answer, the engine never sees the call, as
    /// a fetch answers that found every waiting row locked by another worker's fetch (the real
    /// engine on H2; devkit `engine/contention.rs`).
    Empty,
}

/// The engine's answer to a call, as [`Gate::after`] sees it.
#[derive(Clone, Copy, Debug)]
pub enum Answered<'a> {
    /// A fetch's tasks.
    Tasks(&'a [Task]),
    /// Any other call, accepted.
    Done,
    /// The call failed (the engine's refusal, or a transport error).
    Failed(&'a EngineError),
}

/// Decides about each engine call before it is sent, and may hold its answer.
#[async_trait]
pub trait Gate: Send + Sync + 'static {
    /// Runs before `op` is sent about `task` (`None` for a fetch or a probe); the call waits
    /// until it returns.
    async fn before(&self, _op: Op<'_>, _task: Option<&TaskRef>) {}

    /// Runs after [`Gate::before`]: whether the call goes on to the engine, or is answered here.
    async fn verdict(&self, _op: Op<'_>, _task: Option<&TaskRef>) -> Verdict {
        Verdict::Forward
    }

    /// What a fetch the worker asked as `asked` asks of the engine (by default the same).
    fn fetch_request(&self, asked: &FetchRequest) -> FetchRequest {
        asked.clone()
    }

    /// Runs once the engine answered `op` (not for a call the verdict answered); the worker
    /// sees the answer when it returns.
    async fn after(&self, _op: Op<'_>, _task: Option<&TaskRef>, _answered: Answered<'_>) {}
}

/// An engine whose every call passes a [`Gate`] first.
pub struct GatedEngine<G: ?Sized> {
    inner: Arc<dyn Engine>,
    gate: Arc<G>,
}

impl<G: Gate + ?Sized> GatedEngine<G> {
    pub(crate) fn wrap(inner: Arc<dyn Engine>, gate: Arc<G>) -> Arc<dyn Engine> {
        Arc::new(GatedEngine { inner, gate })
    }

    /// The wrapper that puts a worker's engine client behind `gate`, for
    /// [`crate::app::Seams::engine`].
    pub fn wrapper(gate: Arc<G>) -> EngineWrapper {
        Box::new(move |inner| GatedEngine::wrap(inner, gate))
    }
}

impl<G: Gate + ?Sized> GatedEngine<G> {
    /// `op` through the gate: before, the verdict, the engine (`call`), after.
    async fn pass<T>(
        &self,
        op: Op<'_>,
        task: Option<&TaskRef>,
        call: impl Future<Output = Result<T, EngineError>>,
        answered: impl FnOnce(&T) -> Answered<'_>,
        empty: impl FnOnce() -> Option<T>,
    ) -> Result<T, EngineError> {
        self.gate.before(op, task).await;
        let result = match self.gate.verdict(op, task).await {
            Verdict::Fail(e) => return Err(e),
            Verdict::Empty => match empty() {
                Some(answer) => Ok(answer),
                None => call.await,
            },
            Verdict::Forward | Verdict::Probe(_) => call.await,
        };
        let seen = match &result {
            Ok(value) => answered(value),
            Err(e) => Answered::Failed(e),
        };
        self.gate.after(op, task, seen).await;
        result
    }
}

fn done<T>(_: &T) -> Answered<'_> {
    Answered::Done
}

#[async_trait]
impl<G: Gate + ?Sized> Engine for GatedEngine<G> {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        let sent = self.gate.fetch_request(request);
        let call = self.inner.fetch_and_lock(&sent);
        self.pass(
            Op::FetchAndLock(request),
            None,
            call,
            |tasks| Answered::Tasks(tasks.as_slice()),
            || Some(Vec::new()),
        )
        .await
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        let call = self.inner.heartbeat(task, lock_duration);
        self.pass(Op::Heartbeat, Some(task), call, done, || None)
            .await
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        let call = self.inner.complete(task, variables);
        self.pass(Op::Complete, Some(task), call, done, || None)
            .await
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        let call = self.inner.failure(task, report);
        self.pass(Op::Failure(report), Some(task), call, done, || None)
            .await
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        let call = self.inner.bpmn_error(task, report);
        self.pass(Op::BpmnError, Some(task), call, done, || None)
            .await
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        let call = self.inner.read_journal(task);
        self.pass(Op::JournalRead, Some(task), call, done, || None)
            .await
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        let call = self.inner.append_journal(task, step);
        self.pass(Op::JournalAppend(step), Some(task), call, done, || None)
            .await
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        let call = self.inner.tool_credential(task, server);
        self.pass(
            Op::ToolCredentials { server },
            Some(task),
            call,
            done,
            || None,
        )
        .await
    }

    async fn process_instance(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<ProcessInstance, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_INSTANCE,
            id: instance_id,
        };
        let call = self.inner.process_instance(task, instance_id);
        self.pass(op, Some(task), call, done, || None).await
    }

    async fn process_definition(
        &self,
        task: &TaskRef,
        definition_id: &str,
    ) -> Result<ProcessDefinition, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_DEFINITION,
            id: definition_id,
        };
        let call = self.inner.process_definition(task, definition_id);
        self.pass(op, Some(task), call, done, || None).await
    }

    async fn process_history(
        &self,
        task: &TaskRef,
        instance_id: &str,
        page: u32,
    ) -> Result<HistoryPage, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_HISTORY,
            id: instance_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.process_history(task, instance_id, page).await
    }

    async fn anonymous_history_read(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<AnonymousAccess, EngineError> {
        let op = Op::ProcessRead {
            op: OP_PROCESS_HISTORY,
            id: instance_id,
        };
        self.gate.before(op, Some(task)).await;
        self.inner.anonymous_history_read(task, instance_id).await
    }

    async fn probe(&self) -> ProbeOutcome {
        self.gate.before(Op::Probe, None).await;
        match self.gate.verdict(Op::Probe, None).await {
            Verdict::Fail(_) => ProbeOutcome::Unreachable,
            Verdict::Probe(outcome) => outcome,
            Verdict::Forward | Verdict::Empty => {
                let outcome = self.inner.probe().await;
                self.gate.after(Op::Probe, None, Answered::Done).await;
                outcome
            }
        }
    }
}

// ---- the paused-clock tests' engine faults -------------------------------------------------

/// One engine call as a [`FaultGate`] saw it go out.
#[derive(Clone, Debug)]
pub struct Call {
    /// When it went out (tokio's clock: the paused clock in tests).
    pub at: Instant,
    /// The operation, as [`Op::name`] says it.
    pub op: &'static str,
    pub task_id: Option<String>,
    pub attempt: Option<u32>,
    /// A fetch: the `maxTasks` the worker asked for; 0 for any other call.
    pub max_tasks: u32,
    /// The tasks handed out through this gate and not reported yet, when the call went out.
    pub outstanding: usize,
    /// A heartbeat the knobs refuse ([`FaultState::refuse_heartbeat`]).
    pub refused: bool,
    /// Sent during [`FaultState::outage`].
    pub down: bool,
}

/// The knobs of a [`FaultGate`] and what it saw. Each knob is one behaviour of an engine a test
/// needs; the engine behind the gate (the simulator's world engine in the paused tests) plays
/// everything else by the real engine's rules.
#[derive(Default)]
pub struct FaultState {
    /// Every call, in the order they went out.
    pub calls: Vec<Call>,
    /// The tasks handed out through the gate (added as a fetch's answer arrives) and not
    /// reported yet (removed as a complete, a failure or a BPMN error leaves for the engine,
    /// after the latency the knobs give it).
    pub outstanding: HashSet<String>,
    /// Completions the engine accepted, by task.
    pub completed: HashMap<String, u32>,
    /// Failures sent to the engine, with their reports, in order.
    pub failures: Vec<(String, FailureReport)>,
    /// Heartbeats of these tasks (any attempt) are refused with 403 `WORKER_LOCK_NOT_OWNED`, as
    /// the emulator's `Fault::RefuseHeartbeats` does: the engine's state is left as it is.
    pub refuse_heartbeat: HashSet<String>,
    /// The same for these (task, attempt) pairs only.
    pub refuse_heartbeats_of: HashSet<(String, u32)>,
    /// Every heartbeat fails as a refused connection does.
    pub heartbeat_transient: bool,
    /// Every fetch fails as a refused connection does (1 ms in), and a probe finds the engine
    /// unreachable.
    pub fetch_transient: bool,
    /// An engine without the probe endpoint: a probe answers `NotSupported`.
    pub cannot_probe: bool,
    /// A misbehaving engine: each fetch asks the engine for this many tasks beyond `maxTasks`,
    /// so its answer may hold more than the worker asked for.
    pub surplus: usize,
    /// An engine whose concurrent fetches skip each other's locked rows: a fetch asks the
    /// engine for at most this many tasks, whatever the worker asked for.
    pub answer_cap: Option<usize>,
    /// The next this many fetches answer empty whatever the queue holds: fetches that found
    /// every waiting row locked by another worker's fetch (the real engine on H2, devkit
    /// `engine/contention.rs`). Each takes 1 ms, as an answer does.
    pub empty_answers: usize,
    /// A stalled engine: a failure is sent only an hour after it was called.
    pub stall_failures: bool,
    /// A silent engine: while set, every call (recorded when sent) waits unanswered, with no
    /// client timeout to end it, until this is cleared; then it goes on as usual. An engine that
    /// accepts connections and never replies, seen through the worst client.
    pub hung: bool,
    /// A slow engine: a complete is sent this long after it was called (recorded when called).
    pub complete_latency: Duration,
    /// A failure's answer comes this long after the engine applied it.
    pub failure_latency: Duration,
    /// How long the engine takes over each call of an operation (by [`Op::name`]), on the way
    /// there: the call executes after it, as the emulator's `Fault::Latency` does.
    pub latency: HashMap<&'static str, Duration>,
    /// An engine outage from the first instant to the second, as the HTTP client meets it: a
    /// heartbeat or a fetch (one exchange each) fails as a refused connection does (5 ms in), a
    /// probe finds the engine unreachable, and every other call is a command, which the client
    /// rides out with the same key (its `outage_patience` is above these outages): it is held
    /// until the engine is back (or dropped by the worker first).
    pub outage: Option<(Instant, Instant)>,
}

impl FaultState {
    /// An outage from `from` for `length`.
    pub fn outage_from(&mut self, from: Instant, length: Duration) {
        self.outage = Some((from, from + length));
    }

    /// Whether a heartbeat of `task` is refused.
    fn refuses_heartbeat_of(&self, task: Option<&TaskRef>) -> bool {
        task.is_some_and(|t| {
            self.refuse_heartbeat.contains(&t.task_id)
                || self
                    .refuse_heartbeats_of
                    .contains(&(t.task_id.clone(), t.attempt.unwrap_or(0)))
        })
    }

    /// The end of the outage under way at `now`, if any.
    fn down_until(&self, now: Instant) -> Option<Instant> {
        self.outage
            .filter(|(from, to)| *from <= now && now < *to)
            .map(|(_, to)| to)
    }
}

/// A gate whose faults are knobs a test turns ([`FaultState`]), and which logs every call: put a
/// worker's engine behind it with [`GatedEngine::wrapper`]. One gate may stand before several
/// workers' engines (their calls share the knobs and the log).
#[derive(Default)]
pub struct FaultGate {
    pub state: Mutex<FaultState>,
}

impl FaultGate {
    pub fn new() -> Arc<FaultGate> {
        Arc::new(FaultGate::default())
    }

    /// The knobs and the log.
    pub fn state(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this fetch meets another's locks (`empty_answers`), counting it down.
    fn take_empty_answer(&self) -> bool {
        let mut s = self.state();
        let take = s.empty_answers > 0;
        s.empty_answers = s.empty_answers.saturating_sub(1);
        take
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// Every call about `task_id` so far.
    pub fn calls_for(&self, task_id: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.task_id.as_deref() == Some(task_id))
            .collect()
    }

    /// How long the call waits before it may go out: while [`FaultState::hung`].
    async fn silent(&self) {
        while self.state().hung {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn transient(op: &'static str, message: &str) -> EngineError {
    EngineError::Transient {
        op,
        message: message.to_string(),
        request_sent: false,
    }
}

#[async_trait]
impl Gate for FaultGate {
    async fn before(&self, op: Op<'_>, task: Option<&TaskRef>) {
        let (latency, down) = {
            let mut s = self.state();
            let task_id = task.map(|t| t.task_id.clone());
            let attempt = task.and_then(|t| t.attempt);
            let refused = matches!(op, Op::Heartbeat) && s.refuses_heartbeat_of(task);
            let now = Instant::now();
            let down = s.down_until(now);
            let outstanding = s.outstanding.len();
            s.calls.push(Call {
                at: now,
                op: op.name(),
                task_id,
                attempt,
                max_tasks: match op {
                    Op::FetchAndLock(request) => request.max_tasks,
                    _ => 0,
                },
                outstanding,
                refused,
                down: down.is_some(),
            });
            (s.latency.get(op.name()).copied(), down)
        };
        if matches!(op, Op::Probe) {
            return;
        }
        self.silent().await;
        if let Some(latency) = latency {
            tokio::time::sleep(latency).await;
        }
        match op {
            Op::Complete => {
                let latency = self.state().complete_latency;
                if !latency.is_zero() {
                    tokio::time::sleep(latency).await;
                }
            }
            Op::Failure(report) => {
                if self.state().stall_failures {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                if let Some(task) = task {
                    self.state()
                        .failures
                        .push((task.task_id.clone(), report.clone()));
                }
            }
            _ => {}
        }
        // A command during the outage is ridden out by the client: it goes when the engine is
        // back. (A heartbeat or a fetch fails instead: the verdict.)
        if let Some(back) = down
            && !matches!(op, Op::Heartbeat | Op::FetchAndLock(_))
        {
            tokio::time::sleep_until(back).await;
        }
        // A report leaves for the engine now: its task is no longer outstanding.
        if let (Op::Complete | Op::Failure(_) | Op::BpmnError, Some(task)) = (op, task) {
            self.state().outstanding.remove(&task.task_id);
        }
    }

    async fn verdict(&self, op: Op<'_>, task: Option<&TaskRef>) -> Verdict {
        let name = op.name();
        // As the call reaches the engine (after the latency the knobs give it, if any).
        let (down, refused, heartbeat_transient, fetch_transient, cannot_probe) = {
            let s = self.state();
            (
                s.down_until(Instant::now()).is_some(),
                s.refuses_heartbeat_of(task),
                s.heartbeat_transient,
                s.fetch_transient,
                s.cannot_probe,
            )
        };
        match op {
            Op::Probe if down || fetch_transient => Verdict::Probe(ProbeOutcome::Unreachable),
            Op::Probe if cannot_probe => Verdict::Probe(ProbeOutcome::NotSupported),
            Op::Heartbeat if refused => Verdict::Fail(EngineError::LeaseLost {
                op: name,
                task_id: task.map(|t| t.task_id.clone()).unwrap_or_default(),
                reason: LeaseLostReason::NotOwned,
            }),
            Op::Heartbeat | Op::FetchAndLock(_) if down => {
                // A refused connection takes a moment, not nothing.
                tokio::time::sleep(Duration::from_millis(5)).await;
                Verdict::Fail(transient(name, "connection refused (the test's outage)"))
            }
            Op::Heartbeat if heartbeat_transient => Verdict::Fail(transient(name, "down")),
            Op::FetchAndLock(_) if fetch_transient => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Verdict::Fail(transient(name, "down"))
            }
            Op::FetchAndLock(_) if self.take_empty_answer() => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Verdict::Empty
            }
            _ => Verdict::Forward,
        }
    }

    fn fetch_request(&self, asked: &FetchRequest) -> FetchRequest {
        let s = self.state();
        let most = (asked.max_tasks as usize + s.surplus).min(s.answer_cap.unwrap_or(usize::MAX));
        FetchRequest {
            max_tasks: u32::try_from(most).unwrap_or(u32::MAX),
            ..asked.clone()
        }
    }

    async fn after(&self, op: Op<'_>, task: Option<&TaskRef>, answered: Answered<'_>) {
        let latency = {
            let mut s = self.state();
            match (op, answered, task) {
                (Op::FetchAndLock(_), Answered::Tasks(tasks), _) => {
                    s.outstanding.extend(tasks.iter().map(|t| t.id.clone()));
                }
                (Op::Complete, Answered::Done, Some(task)) => {
                    *s.completed.entry(task.task_id.clone()).or_default() += 1;
                }
                _ => {}
            }
            matches!(op, Op::Failure(_)).then_some(s.failure_latency)
        };
        if let Some(latency) = latency.filter(|l| !l.is_zero()) {
            tokio::time::sleep(latency).await;
        }
    }
}
