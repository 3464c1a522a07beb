//! An exhaustive check of the attempt protocol: the lease, the attempt, the report and the fence,
//! modelled at small bounds (two workers, one or two tasks, a crash, a pause, a lost answer or
//! the engine's clock running ahead at any step) and explored state by state by the
//! [`stateright`] model checker. The simulator draws schedules at random and can miss an
//! interleaving that needs several things to line up (the supersession race took a failure whose
//! retry timeout ran out, a fetch while its answer was out, and the same worker winning the
//! fetch); here every interleaving within the bounds is visited.
//!
//! # What is modelled, and the code each transition mirrors
//!
//! The engine (`devkit/src/engine/state.rs`, the emulator's state machine, itself held to the
//! real engine): tasks `Open`, `Locked { worker, until }`, `Completed` or `Incident`; a fetch
//! locks the first acquirable task (`promote_expired`: a lock whose `until <= now` is acquirable
//! again) and counts an acquisition, the agent/1 `attempt`; every call about a task goes through
//! `check_lock` (not locked, expired when `until < now`, another worker's, and on agent/1 a stale
//! attempt); `complete` on a completed task answers 200 and does nothing; a report retried under
//! its `Idempotency-Key` is answered from storage (protocol.md A.3); a failure with retries left
//! and no retry timeout opens the task again at once, one with none left is an incident.
//!
//! The run store (`src/store/runs.rs`, `src/devkit/world/store.rs`): a claim takes a fencing
//! token from a sequence that never repeats and makes it the run's; an append under another
//! token is refused as fenced.
//!
//! The tool server (`devkit/src/tools.rs`): a keyed write is applied once per idempotency key;
//! the key is `abada:{task}:{seq}`, the journal's sequence, stable across attempts
//! (`agent/journal.rs::write_key`).
//!
//! A worker (`src/runner.rs`, `Runner` and `run_task`):
//! - [`Action::Fetch`]: the poll loop fetches only for free slots (one slot, one report permit,
//!   as `MAX_TASKS = 1`; a fetch in flight holds the slots it asked for), one fetch at a time;
//!   the request reaches the engine at once and its answer travels back on its own
//!   ([`Action::FetchArrives`], or lost: the tasks stay locked to the worker until they expire).
//! - [`Action::FetchArrives`]: `start_task` registers the lease, its local expiry at the fetch's
//!   send time plus the lock less the safety margin (`HeartbeatHandle::register`), and
//!   `RunningTasks::start` applies the same-task rule ([`SameTaskRule`]).
//! - [`Action::Heartbeat`]: the heartbeat scheduler (`src/heartbeat.rs`) extends a lease that is
//!   not yet reporting, at most once a tick; an accepted extension moves the local expiry to its
//!   send time plus the lock less the margin, a refusal marks the lease lost.
//! - [`Action::Step`]: one step of the attempt (`src/agent/run.rs` through
//!   `src/agent/run_journal.rs` and `src/agent/tool_call.rs`): open the journal (the engine's
//!   read on agent/1, the store's claim without an attempt), journal `tool/started`, ask the
//!   engine for the tool credential (agent/1), send the keyed write, journal `tool/finished`,
//!   then return an outcome ([`Action::Decide`]). A resumed attempt replays the journal: a write
//!   journaled as started and not finished is sent again under its key. Every engine and store
//!   call goes through `TaskContext::fenced` (`src/handler.rs`): none once the lease is lost or
//!   its local expiry has passed (`Lease::expired_locally`), and a refusal (the engine's
//!   lease-lost answers, the store's `Fenced`) marks the lease lost. A lost or locally expired
//!   lease stops the attempt at its next step (`run_task`'s `select!` on
//!   `Lease::lost_or_expired`): it ends `lease_lost` and reports nothing.
//! - Then `run_task` sets the attempt's `reporting` flag, takes a report permit (giving its slot
//!   back) or reports on its slot, releases the lease from the heartbeat scheduler, and
//!   `report` sends the one report, fenced like every call (so a report whose answer has not come
//!   by the local expiry ends `lease_lost`). Its answer travels back on its own
//!   ([`Action::ReportAnswer`]); a lost answer is retried under the same key
//!   ([`Action::RetryReport`]) or ends the attempt `report_failed`.
//!
//! Requests reach their peer within the tick they are sent in (the safety margin's premise: a
//! call sent before the local expiry reaches the engine before the engine's own expiry);
//! answers may take any number of ticks, and may be lost. A request and its answer are one
//! step for the calls whose answer's delay changes nothing the properties look at (journal
//! reads and appends, claims, credentials, heartbeats, tool writes): a crash discards the
//! answer either way, and a pause only delays what the worker does with it. The one exception
//! to the premise is [`Faults::clock_jumps`]: the engine's clock runs ahead of the workers' by
//! more than the margin (what `EngineEmulator::advance` does in the wire tests), so an engine
//! hands a task to another worker while its holder still believes its lease.
//!
//! # The properties
//!
//! Each is a [`Property::always`] over a state, most of them read from ghost fields that the
//! transitions set when the thing they name happens ([`Ghost`]):
//! - [`ONE_COMPLETION`]: at most one attempt's completion accepted per task, the engine's no-op
//!   acceptance of a complete on a completed task included;
//! - [`SILENT_AFTER_LOSS`]: no report, journal append, claim or credential request sent by an
//!   attempt after it learned its lease was lost (a refusal, a supersession, its local expiry);
//! - [`NO_STALE_ACCEPTED`]: no append, credential or report accepted from an attempt that is no
//!   longer the task's latest acquisition (holds under the margin's premise only);
//! - [`ONE_ATTEMPT_AT_A_TIME`]: in each worker, at most one attempt of a task at work or
//!   reporting (a newer one may be waiting);
//! - [`ACCEPTED_REPORT_KEPT`]: no attempt whose report the engine accepted is ended `lease_lost`
//!   by a newer attempt of the same task (the supersession race);
//! - [`WRITE_ONCE`]: each logical keyed write applied at most once by the tool server;
//! - [`EVERY_TASK_ENDS`]: in a state from which nothing can happen any more, every task is
//!   completed or an incident (no task left locked, waiting or forgotten).
//!
//! Two [`Property::sometimes`] keep the model honest: the checker must reach a task offered
//! again to the worker whose older attempt's report still awaits its answer
//! ([`REOFFERED_WHILE_REPORTING`]), and, when the engine's clock may run ahead, a holder
//! refused by the engine or the store ([`HOLDER_REFUSED`]); a model that could not reach them
//! would prove nothing about them. (Within the margin no refusal is reachable: a holder's own
//! clock stops it first. The refusals are the fence for when that premise breaks.)
//!
//! # Why a model checker
//!
//! `stateright` explores breadth first with every state stored once (by fingerprint), so a
//! bound of a few million states is covered in seconds, and a violation comes back as the
//! shortest path of named actions that reaches it. A hand-written search would need the same
//! deduplication, path reconstruction, property bookkeeping and thread pool, each a place for a
//! bug that makes a check pass vacuously.

use std::fmt;

use stateright::{Model, Property};

/// Where the attempts journal, which decides what fences a stale holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Journaling {
    /// An agent/1 task: the engine's journal, every call carrying the attempt (the fencing
    /// token), so the engine refuses a stale attempt (`Journal::Engine`).
    Engine,
    /// A task without `attempt` (plain v1): the engine checks only the worker id, and the
    /// journal lives in the run store, whose claim is the fencing token (`Journal::Store`).
    Store,
}

/// What a worker does when the engine hands it a task an older attempt of which still runs
/// there (`RunningTasks::start` in src/runner.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SameTaskRule {
    /// The rule the runner keeps: one attempt of a task at a time. An older attempt still at
    /// work is superseded (its lease marked lost); one already reporting reads its answer; the
    /// newer starts only once every older one has ended.
    OneAtATime,
    /// The runner before the rule: every older attempt superseded, the newer started at once.
    SupersedeAtOnce,
    /// No rule: the newer starts at once beside the older, which goes on.
    Unguarded,
}

/// Which faults the checker may inject, and how many in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Faults {
    /// Most faults in one run (a resume does not count; the pause did).
    pub budget: u8,
    /// A worker process dies and starts again at once under the same worker id.
    pub crashes: bool,
    /// A worker process is frozen (SIGSTOP, a stalled VM) and later resumes; time goes on.
    pub pauses: bool,
    /// The answer to a fetch or a report is lost on its way back.
    pub lost_answers: bool,
    /// The engine's clock jumps ahead by more than a lock duration: every lease expires at the
    /// engine while its holder's own clock says it is valid.
    pub clock_jumps: bool,
}

/// A deliberate flaw of the worker, for the tests to show a property catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flaw {
    /// The run store's `Fenced` refusal does not mark the lease lost (`impl Refusal for
    /// StoreError` answering `None`): the attempt fails technically and reports that failure.
    StoreRefusalIgnored,
    /// A keyed write's key is derived from the attempt instead of the journal's sequence.
    WriteKeyPerAttempt,
    /// `TaskContext::fenced` without the clock: a lease is lost only when someone says so,
    /// never at its local expiry (the simulator's `HeartbeatAfterExpiry` bug, on the report).
    NoLocalExpiry,
}

/// The model: its bounds and the variant of the worker under check.
#[derive(Clone, Debug)]
pub struct Protocol {
    pub workers: u8,
    pub tasks: u8,
    pub journaling: Journaling,
    pub rule: SameTaskRule,
    pub faults: Faults,
    /// Faults happen only while the clock is at or before this tick, so that every run has the
    /// time to recover (a lock to expire, the task to be fetched again) before `max_time`.
    pub fault_horizon: u8,
    /// The clock stops here.
    pub max_time: u8,
    /// The lock duration, in ticks.
    pub lock: u8,
    /// The safety margin: a lease expires locally this much before the engine's lock would.
    pub margin: u8,
    /// Each task's retries when created: a technical failure consumes one; at none left, the
    /// failure is an incident.
    pub retries: u8,
    pub flaw: Option<Flaw>,
}

impl Protocol {
    /// The bounds the tests check: two workers, one slot each, a lock of 2 ticks with a margin
    /// of 1, two retries, faults up to tick 1 and the clock stopping at tick 4 (time for a
    /// lock taken at the horizon to expire at the engine and its task to be fetched again).
    pub fn new(tasks: u8, journaling: Journaling, rule: SameTaskRule, faults: Faults) -> Self {
        Protocol {
            workers: 2,
            tasks,
            journaling,
            rule,
            faults,
            fault_horizon: 1,
            max_time: 5,
            lock: 2,
            margin: 1,
            retries: 2,
            flaw: None,
        }
    }

    pub fn with_flaw(mut self, flaw: Flaw) -> Self {
        self.flaw = Some(flaw);
        self
    }
}

/// A task at the engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EngineTask {
    pub status: TaskStatus,
    /// Acquisitions so far: the agent/1 attempt of the latest.
    pub acquisitions: u8,
    pub retries: u8,
    /// Steps in the engine's journal (agent/1).
    pub journal: u8,
    /// The acquisitions whose report the engine applied (its idempotency records), a bit each.
    pub reports: u16,
    /// The acquisitions whose `complete` the engine accepted, applied or answered as a no-op.
    pub completions: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskStatus {
    Open,
    Locked { worker: u8, until: u8 },
    Completed,
    Incident,
}

impl TaskStatus {
    fn ended(self) -> bool {
        matches!(self, TaskStatus::Completed | TaskStatus::Incident)
    }
}

/// A task's run in the run store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Run {
    /// The latest claim's fencing token (0: never claimed).
    pub fence: u8,
    pub steps: u8,
}

/// One worker process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Worker {
    pub paused: bool,
    /// A fetch whose answer is on its way back.
    pub fetch: Option<FetchAnswer>,
    pub attempts: Vec<Attempt>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FetchAnswer {
    /// When the request was sent: the leases' acquisition instant.
    pub sent: u8,
    /// The tasks locked by it: (task, acquisition, retries).
    pub tasks: Vec<(u8, u8, u8)>,
    pub lost: bool,
}

/// One attempt of a task running in a worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attempt {
    pub task: u8,
    /// Its acquisition (the agent/1 attempt).
    pub acquisition: u8,
    /// The task's retries as fetched.
    pub retries: u8,
    /// The local expiry: the lease is lost at or after this tick by the worker's own clock.
    pub valid_until: u8,
    /// The tick of the latest extension sent (or the acquisition).
    pub heartbeat_at: u8,
    /// The lease's latch (`Lease::mark_lost`).
    pub lost: Option<Loss>,
    /// Ghost: the attempt has been told its lease is lost, whatever its latch says.
    pub knows_lost: bool,
    pub phase: Phase,
    /// Its claim's fencing token in the run store.
    pub fence: u8,
    /// Reporting on a report permit (its slot given back) rather than on its slot.
    pub on_permit: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loss {
    Superseded,
    LocalExpiry,
    Refused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Started behind an older attempt of the same task; holds its slot.
    Waiting,
    /// At work: the next step to take.
    Ready(Op),
    /// The handler returned this outcome; the `reporting` flag is not set yet.
    Done(Kind),
    /// Reporting: the flag is set, the lease released from the heartbeat scheduler, the report
    /// not sent yet.
    Reporting(Kind),
    /// The report was sent; its answer is on its way back.
    Sent(Kind, Reply),
}

impl Phase {
    fn reporting(self) -> bool {
        matches!(self, Phase::Reporting(_) | Phase::Sent(..))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Open,
    AppendStarted,
    Credential,
    Write,
    AppendFinished,
    Decide,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Complete,
    /// A technical failure: one retry consumed, no retry timeout left.
    Failure,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Accepted,
    Refused,
    Lost,
}

/// What happened that a property judges, recorded by the transitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// A call sent by an attempt that had learned its lease was lost.
    pub call_after_loss: bool,
    /// An append, credential or report accepted from an attempt other than the task's latest
    /// acquisition.
    pub stale_accepted: bool,
    /// An attempt whose report the engine accepted was ended `lease_lost` by a newer attempt.
    pub accepted_report_disowned: bool,
    /// A task was handed again to a worker while an older attempt's report awaited its answer.
    pub reoffered_while_reporting: bool,
    /// An engine or store refusal told a holder its lease was lost.
    pub holder_refused: bool,
}

/// The whole system at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The workers' clock (real time).
    pub now: u8,
    /// How far the engine's clock is ahead of the workers'.
    pub skew: u8,
    pub faults: u8,
    pub engine: Vec<EngineTask>,
    pub runs: Vec<Run>,
    /// The run store's sequence of fencing tokens.
    pub next_fence: u8,
    /// The tool server's ledger: (task, key) of every write applied.
    pub writes: Vec<(u8, u8)>,
    pub workers: Vec<Worker>,
    pub ghost: Ghost,
}

impl State {
    fn engine_now(&self) -> u8 {
        self.now + self.skew
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Fetch(u8),
    FetchArrives(u8),
    /// Worker, attempt index.
    Step(u8, u8),
    Decide(u8, u8, Kind),
    Heartbeat(u8, u8),
    ReportAnswer(u8, u8),
    RetryReport(u8, u8),
    Tick,
    Crash(u8),
    Pause(u8),
    Resume(u8),
    LoseFetchAnswer(u8),
    LoseReportAnswer(u8, u8),
    ClockJump,
}

pub const ONE_COMPLETION: &str = "one accepted completion per task";
pub const SILENT_AFTER_LOSS: &str =
    "no report, journal append, claim or credential request after the lease is known lost";
pub const NO_STALE_ACCEPTED: &str = "no call of a holder that is no longer the latest accepted";
pub const ONE_ATTEMPT_AT_A_TIME: &str = "one attempt of a task at a time per worker";
pub const ACCEPTED_REPORT_KEPT: &str = "no accepted report ended lease_lost by a newer attempt";
pub const WRITE_ONCE: &str = "a keyed write applied at most once";
pub const EVERY_TASK_ENDS: &str = "every task ends";
pub const REOFFERED_WHILE_REPORTING: &str =
    "a task is offered again while an older attempt's report awaits its answer";
pub const HOLDER_REFUSED: &str = "a holder is refused by the engine or the run store";

/// An engine call's verdict on the lease (`check_lock`).
fn check_lock(
    task: &EngineTask,
    worker: u8,
    acquisition: u8,
    journaling: Journaling,
    engine_now: u8,
) -> bool {
    match task.status {
        TaskStatus::Locked { worker: w, until } => {
            until >= engine_now
                && w == worker
                && (journaling == Journaling::Store || acquisition == task.acquisitions)
        }
        _ => false,
    }
}

impl Protocol {
    fn acquirable(&self, s: &State) -> Option<u8> {
        let now = s.engine_now();
        s.engine
            .iter()
            .position(|t| match t.status {
                TaskStatus::Open => true,
                TaskStatus::Locked { until, .. } => until <= now,
                _ => false,
            })
            .map(|i| i as u8)
    }

    /// Slots held: attempts at work or waiting, attempts reporting on their slot, and the
    /// tasks of a fetch on its way back.
    fn slots_held(&self, w: &Worker) -> usize {
        let held = w
            .attempts
            .iter()
            .filter(|a| !a.phase.reporting() || !a.on_permit)
            .count();
        held + w.fetch.as_ref().map_or(0, |f| f.tasks.len())
    }

    fn can_fault(&self, s: &State) -> bool {
        s.faults < self.faults.budget && s.now <= self.fault_horizon
    }

    fn next_after(&self, op: Op) -> Op {
        match (op, self.journaling) {
            (Op::AppendStarted, Journaling::Engine) => Op::Credential,
            (Op::AppendStarted, Journaling::Store) => Op::Write,
            (Op::Credential, _) => Op::Write,
            (Op::Write, _) => Op::AppendFinished,
            (Op::AppendFinished, _) | (Op::Decide, _) => Op::Decide,
            (Op::Open, _) => Op::AppendStarted,
        }
    }

    /// The step after opening a journal holding `steps` (the replay).
    fn resume_at(&self, steps: u8) -> Op {
        match steps {
            0 => Op::AppendStarted,
            1 => self.next_after(Op::AppendStarted),
            _ => Op::Decide,
        }
    }

    fn lost_or_expired(&self, a: &Attempt, now: u8) -> bool {
        a.lost.is_some() || (now >= a.valid_until && self.flaw != Some(Flaw::NoLocalExpiry))
    }

    fn is_terminal(&self, s: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(s, &mut actions);
        actions.is_empty()
    }

    /// Ends attempt `i` of worker `w` (removed: the poll loop joined it).
    fn end(s: &mut State, w: usize, i: usize) {
        s.workers[w].attempts.remove(i);
    }

    /// An engine or store call of attempt `i` is about to be sent: a ghost check. Known lost:
    /// told so, or its worker's own clock past its local expiry.
    fn sending(s: &mut State, w: usize, i: usize) {
        let a = &s.workers[w].attempts[i];
        if a.knows_lost || s.now >= a.valid_until {
            s.ghost.call_after_loss = true;
        }
    }

    fn refused(s: &mut State, w: usize, i: usize) {
        let a = &mut s.workers[w].attempts[i];
        a.knows_lost = true;
        if a.lost.is_none() {
            a.lost = Some(Loss::Refused);
        }
        s.ghost.holder_refused = true;
    }

    /// Whether attempt `a` is the task's latest acquisition, for the ghost.
    fn stale(s: &State, a: &Attempt) -> bool {
        a.acquisition != s.engine[a.task as usize].acquisitions
    }

    /// Sends one step of work (a request and its answer) for attempt `i`.
    fn work(&self, s: &mut State, w: usize, i: usize, op: Op) {
        let a = s.workers[w].attempts[i].clone();
        let t = a.task as usize;
        let engine_now = s.engine_now();
        let owned = check_lock(
            &s.engine[t],
            w as u8,
            a.acquisition,
            self.journaling,
            engine_now,
        );
        match (op, self.journaling) {
            (Op::Open, Journaling::Engine) => {
                Self::sending(s, w, i);
                if owned {
                    let steps = s.engine[t].journal;
                    s.workers[w].attempts[i].phase = Phase::Ready(self.resume_at(steps));
                } else {
                    Self::refused(s, w, i);
                }
            }
            (Op::Open, Journaling::Store) => {
                Self::sending(s, w, i);
                s.next_fence += 1;
                s.runs[t].fence = s.next_fence;
                let steps = s.runs[t].steps;
                let a = &mut s.workers[w].attempts[i];
                a.fence = s.next_fence;
                a.phase = Phase::Ready(self.resume_at(steps));
            }
            (Op::AppendStarted | Op::AppendFinished, journaling) => {
                Self::sending(s, w, i);
                let seq = if op == Op::AppendStarted { 1 } else { 2 };
                let accepted = match journaling {
                    Journaling::Engine => owned,
                    Journaling::Store => s.runs[t].fence == a.fence,
                };
                if !accepted {
                    if journaling == Journaling::Store
                        && self.flaw == Some(Flaw::StoreRefusalIgnored)
                    {
                        // Not a loss to the worker: a store error the attempt gives up on, a
                        // technical failure that it reports.
                        let a = &mut s.workers[w].attempts[i];
                        a.knows_lost = true;
                        a.phase = Phase::Done(Kind::Failure);
                        s.ghost.holder_refused = true;
                    } else {
                        Self::refused(s, w, i);
                    }
                    return;
                }
                let steps = match journaling {
                    Journaling::Engine => &mut s.engine[t].journal,
                    Journaling::Store => &mut s.runs[t].steps,
                };
                if *steps + 1 == seq {
                    *steps = seq;
                    if Self::stale(s, &a) {
                        s.ghost.stale_accepted = true;
                    }
                }
                s.workers[w].attempts[i].phase = Phase::Ready(self.next_after(op));
            }
            (Op::Credential, _) => {
                Self::sending(s, w, i);
                if owned {
                    if Self::stale(s, &a) {
                        s.ghost.stale_accepted = true;
                    }
                    s.workers[w].attempts[i].phase = Phase::Ready(self.next_after(op));
                } else {
                    Self::refused(s, w, i);
                }
            }
            (Op::Write, _) => {
                let key = match self.flaw {
                    Some(Flaw::WriteKeyPerAttempt) => 10 + a.acquisition,
                    _ => 1,
                };
                if !s.writes.contains(&(a.task, key)) {
                    s.writes.push((a.task, key));
                    s.writes.sort_unstable();
                }
                s.workers[w].attempts[i].phase = Phase::Ready(self.next_after(op));
            }
            (Op::Decide, _) => unreachable!("a decision is an action of its own"),
        }
    }

    /// The engine receives attempt `i`'s report (first sent, or retried under its key).
    fn deliver_report(&self, s: &mut State, w: usize, i: usize, kind: Kind) {
        let a = s.workers[w].attempts[i].clone();
        let t = a.task as usize;
        let bit = 1u16 << a.acquisition;
        let engine_now = s.engine_now();
        let task = &mut s.engine[t];
        let reply = if task.reports & bit != 0 {
            // The same key again: answered from the engine's idempotency records.
            Reply::Accepted
        } else if kind == Kind::Complete && task.status == TaskStatus::Completed {
            task.completions |= bit;
            Reply::Accepted
        } else if check_lock(task, w as u8, a.acquisition, self.journaling, engine_now) {
            let stale = a.acquisition != task.acquisitions;
            task.reports |= bit;
            match kind {
                Kind::Complete => {
                    task.status = TaskStatus::Completed;
                    task.completions |= bit;
                }
                Kind::Failure => {
                    task.retries = a.retries.saturating_sub(1);
                    task.status = if task.retries == 0 {
                        TaskStatus::Incident
                    } else {
                        TaskStatus::Open
                    };
                }
            }
            if stale {
                s.ghost.stale_accepted = true;
            }
            Reply::Accepted
        } else {
            Reply::Refused
        };
        s.workers[w].attempts[i].phase = Phase::Sent(kind, reply);
    }

    /// The poll loop starts the tasks of a fetch's answer (`Runner::start_task`).
    fn start(&self, s: &mut State, w: usize, answer: FetchAnswer) {
        for (task, acquisition, retries) in answer.tasks {
            let mut older = false;
            for a in s.workers[w].attempts.iter_mut().filter(|a| a.task == task) {
                older = true;
                if matches!(a.phase, Phase::Sent(..)) {
                    s.ghost.reoffered_while_reporting = true;
                }
                let supersede = match self.rule {
                    SameTaskRule::OneAtATime => !a.phase.reporting(),
                    SameTaskRule::SupersedeAtOnce => true,
                    SameTaskRule::Unguarded => false,
                };
                if supersede {
                    if matches!(a.phase, Phase::Sent(_, Reply::Accepted)) {
                        s.ghost.accepted_report_disowned = true;
                    }
                    a.knows_lost = true;
                    if a.lost.is_none() {
                        a.lost = Some(Loss::Superseded);
                    }
                }
            }
            let phase = if older && self.rule == SameTaskRule::OneAtATime {
                Phase::Waiting
            } else {
                Phase::Ready(Op::Open)
            };
            s.workers[w].attempts.push(Attempt {
                task,
                acquisition,
                retries,
                valid_until: answer.sent + self.lock - self.margin,
                heartbeat_at: answer.sent,
                lost: None,
                knows_lost: false,
                phase,
                fence: 0,
                on_permit: false,
            });
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            skew: 0,
            faults: 0,
            engine: (0..self.tasks)
                .map(|_| EngineTask {
                    status: TaskStatus::Open,
                    acquisitions: 0,
                    retries: self.retries,
                    journal: 0,
                    reports: 0,
                    completions: 0,
                })
                .collect(),
            runs: vec![Run::default(); self.tasks as usize],
            next_fence: 0,
            writes: Vec::new(),
            workers: vec![Worker::default(); self.workers as usize],
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let now = s.now;
        for (wi, w) in s.workers.iter().enumerate() {
            let wn = wi as u8;
            if self.can_fault(s) {
                if self.faults.crashes {
                    actions.push(Action::Crash(wn));
                }
                if self.faults.pauses && !w.paused {
                    actions.push(Action::Pause(wn));
                }
            }
            if w.paused {
                actions.push(Action::Resume(wn));
                continue;
            }
            match &w.fetch {
                None => {
                    if self.slots_held(w) == 0 && self.acquirable(s).is_some() {
                        actions.push(Action::Fetch(wn));
                    }
                }
                Some(f) => {
                    actions.push(Action::FetchArrives(wn));
                    if !f.lost && self.faults.lost_answers && self.can_fault(s) {
                        actions.push(Action::LoseFetchAnswer(wn));
                    }
                }
            }
            for (ai, a) in w.attempts.iter().enumerate() {
                let an = ai as u8;
                let gone = self.lost_or_expired(a, now);
                match a.phase {
                    Phase::Waiting => {
                        let older = w
                            .attempts
                            .iter()
                            .any(|o| o.task == a.task && o.acquisition < a.acquisition);
                        if !older {
                            actions.push(Action::Step(wn, an));
                        }
                    }
                    Phase::Ready(Op::Decide) if !gone => {
                        actions.push(Action::Decide(wn, an, Kind::Complete));
                        if a.retries > 0 {
                            actions.push(Action::Decide(wn, an, Kind::Failure));
                        }
                    }
                    Phase::Sent(_, reply) if !gone => {
                        actions.push(Action::ReportAnswer(wn, an));
                        if reply == Reply::Lost {
                            actions.push(Action::RetryReport(wn, an));
                        } else if self.faults.lost_answers && self.can_fault(s) {
                            actions.push(Action::LoseReportAnswer(wn, an));
                        }
                    }
                    _ => actions.push(Action::Step(wn, an)),
                }
                if matches!(a.phase, Phase::Waiting | Phase::Ready(_) | Phase::Done(_))
                    && !gone
                    && a.heartbeat_at < now
                {
                    actions.push(Action::Heartbeat(wn, an));
                }
            }
        }
        if self.faults.clock_jumps && self.can_fault(s) {
            actions.push(Action::ClockJump);
        }
        // Time goes on freely until the fault horizon; after it, the system is timely: time
        // passes only when no worker has anything left to do (waiting for a lock to expire),
        // as the simulator's end bound counts from the faults stopping. Without it, a run
        // could idle until the clock stops and "prove" that a task never ends.
        let waiting_only = actions.is_empty();
        if now < self.max_time
            && s.engine.iter().any(|t| !t.status.ended())
            && (now <= self.fault_horizon || waiting_only)
        {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let now = s.now;
        match action {
            Action::Fetch(w) => {
                let task = self.acquirable(&s)?;
                let engine_now = s.engine_now();
                let t = &mut s.engine[task as usize];
                t.acquisitions += 1;
                t.status = TaskStatus::Locked {
                    worker: w,
                    until: engine_now + self.lock,
                };
                s.workers[w as usize].fetch = Some(FetchAnswer {
                    sent: now,
                    tasks: vec![(task, t.acquisitions, t.retries)],
                    lost: false,
                });
            }
            Action::FetchArrives(w) => {
                let answer = s.workers[w as usize].fetch.take()?;
                if !answer.lost {
                    self.start(&mut s, w as usize, answer);
                }
            }
            Action::LoseFetchAnswer(w) => {
                s.faults += 1;
                s.workers[w as usize].fetch.as_mut()?.lost = true;
            }
            Action::Step(w, i) => {
                let (w, i) = (w as usize, i as usize);
                let a = s.workers[w].attempts[i].clone();
                if a.phase != Phase::Waiting && self.lost_or_expired(&a, now) {
                    // `run_task`: the lease lost or locally expired stops the attempt; a
                    // report waiting for its answer is abandoned (`TaskContext::fenced`).
                    if matches!(a.phase, Phase::Sent(_, Reply::Accepted))
                        && a.lost == Some(Loss::Superseded)
                    {
                        s.ghost.accepted_report_disowned = true;
                    }
                    Self::end(&mut s, w, i);
                    return Some(s);
                }
                match a.phase {
                    Phase::Waiting => s.workers[w].attempts[i].phase = Phase::Ready(Op::Open),
                    Phase::Ready(op) => self.work(&mut s, w, i, op),
                    Phase::Done(kind) => {
                        let permits = s.workers[w]
                            .attempts
                            .iter()
                            .filter(|a| a.phase.reporting() && a.on_permit)
                            .count();
                        let a = &mut s.workers[w].attempts[i];
                        a.on_permit = permits == 0;
                        a.phase = Phase::Reporting(kind);
                    }
                    Phase::Reporting(kind) => {
                        Self::sending(&mut s, w, i);
                        self.deliver_report(&mut s, w, i, kind);
                    }
                    Phase::Sent(..) => return None,
                }
            }
            Action::Decide(w, i, kind) => {
                s.workers[w as usize].attempts[i as usize].phase = Phase::Done(kind);
            }
            Action::Heartbeat(w, i) => {
                let (w, i) = (w as usize, i as usize);
                let a = s.workers[w].attempts[i].clone();
                let engine_now = s.engine_now();
                let t = a.task as usize;
                if check_lock(
                    &s.engine[t],
                    w as u8,
                    a.acquisition,
                    self.journaling,
                    engine_now,
                ) {
                    if let TaskStatus::Locked { until, .. } = &mut s.engine[t].status {
                        *until = engine_now + self.lock;
                    }
                    let a = &mut s.workers[w].attempts[i];
                    a.heartbeat_at = now;
                    a.valid_until = now + self.lock - self.margin;
                } else {
                    s.workers[w].attempts[i].heartbeat_at = now;
                    Self::refused(&mut s, w, i);
                }
            }
            Action::ReportAnswer(w, i) => {
                let (w, i) = (w as usize, i as usize);
                let Phase::Sent(_, reply) = s.workers[w].attempts[i].phase else {
                    return None;
                };
                if reply == Reply::Refused {
                    Self::refused(&mut s, w, i);
                }
                Self::end(&mut s, w, i);
            }
            Action::RetryReport(w, i) => {
                let (w, i) = (w as usize, i as usize);
                let Phase::Sent(kind, Reply::Lost) = s.workers[w].attempts[i].phase else {
                    return None;
                };
                Self::sending(&mut s, w, i);
                self.deliver_report(&mut s, w, i, kind);
            }
            Action::LoseReportAnswer(w, i) => {
                s.faults += 1;
                let a = &mut s.workers[w as usize].attempts[i as usize];
                let Phase::Sent(kind, _) = a.phase else {
                    return None;
                };
                a.phase = Phase::Sent(kind, Reply::Lost);
            }
            Action::Tick => s.now += 1,
            Action::Crash(w) => {
                s.faults += 1;
                s.workers[w as usize] = Worker::default();
            }
            Action::Pause(w) => {
                s.faults += 1;
                s.workers[w as usize].paused = true;
            }
            Action::Resume(w) => s.workers[w as usize].paused = false,
            Action::ClockJump => {
                s.faults += 1;
                s.skew += self.lock + 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(ONE_COMPLETION, |_: &Protocol, s: &State| {
                s.engine.iter().all(|t| t.completions.count_ones() <= 1)
            }),
            Property::always(SILENT_AFTER_LOSS, |_: &Protocol, s: &State| {
                !s.ghost.call_after_loss
            }),
            Property::always(NO_STALE_ACCEPTED, |_: &Protocol, s: &State| {
                !s.ghost.stale_accepted
            }),
            Property::always(ONE_ATTEMPT_AT_A_TIME, |_: &Protocol, s: &State| {
                s.workers.iter().all(|w| {
                    w.attempts.iter().all(|a| {
                        w.attempts
                            .iter()
                            .filter(|b| b.task == a.task && b.phase != Phase::Waiting)
                            .count()
                            <= 1
                    })
                })
            }),
            Property::always(ACCEPTED_REPORT_KEPT, |_: &Protocol, s: &State| {
                !s.ghost.accepted_report_disowned
            }),
            Property::always(WRITE_ONCE, |m: &Protocol, s: &State| {
                (0..m.tasks).all(|t| s.writes.iter().filter(|(task, _)| *task == t).count() <= 1)
            }),
            Property::always(EVERY_TASK_ENDS, |m: &Protocol, s: &State| {
                s.engine.iter().all(|t| t.status.ended()) || !m.is_terminal(s)
            }),
            Property::sometimes(REOFFERED_WHILE_REPORTING, |_: &Protocol, s: &State| {
                s.ghost.reoffered_while_reporting
            }),
        ];
        // Within the margin a holder's own clock stops it before the engine could refuse it:
        // refusals are reachable only when the engine's clock runs ahead.
        if self.faults.clock_jumps {
            properties.push(Property::sometimes(
                HOLDER_REFUSED,
                |_: &Protocol, s: &State| s.ghost.holder_refused,
            ));
        }
        properties
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} worker(s), {} task(s), journal in the {:?}, {:?}, faults {:?}, flaw {:?}",
            self.workers, self.tasks, self.journaling, self.rule, self.faults, self.flaw
        )
    }
}
