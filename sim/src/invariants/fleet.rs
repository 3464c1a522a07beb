//! The fleet's promises about its provider and its engine, checked on the trace like the
//! others (`super`): a busy provider never defers a task, its 429s stay bounded, and no replica
//! idles while the backlog is deep. They read the world's provider limit and engine contention
//! (`world::provider_limit`, the schedule's `FaultPlan::provider_limit` and
//! `FaultPlan::fetch_contention`).
//!
//! - [`no_deferral_while_answering`]: a task is deferred (a `failure` keeping its retries) only
//!   after an outage: a model call of its worker answered 5xx, or a run-store call refused or
//!   its answer lost (the store's patience ran out), within [`OUTAGE_LOOKBACK`] before; or once
//!   a model call of the attempt waited its whole model wait ([`MODEL_WAIT`], less
//!   [`PROVIDER_HOLD_MAX`]).
//!   A 429, from the provider's limit or injected, is the provider answering: within that
//!   wait it never defers.
//! - [`limit_refusals_bounded`]: the provider limit's 429s stay under a bound per worker, from
//!   what the pacer guarantees (see [`REFUSALS_PER_WORKER_SECOND`]).
//! - [`no_idle_replica`]: a worker whose fetch was answered empty while tasks waited unlocked
//!   (another fetch's transaction held them: contention), right after an answer with tasks or
//!   as its first (a failed fetch between ends that run), fetches again within a quarter of
//!   the poll interval.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Facts, Violation, at, violation};
use crate::world::provider_limit::LIMIT_REFUSED;
use crate::world::trace::{Answer, Event};

/// How far back an outage explains a deferral: the model's circuit opens for a second or so in
/// the simulation (no `Retry-After` on a 5xx), a task's own transient retries back off up to a
/// second each, and the run store's patience is a lock duration (at most 8 s): 30 s covers all
/// of them with room.
pub(crate) const OUTAGE_LOOKBACK: u64 = 30_000;

/// The wait one model call may spend on a busy limit, in all, before the model counts as
/// unavailable: the worker's `ABADA_AGENT_MODEL_WAIT_MAX_MS`, whose default the simulated
/// workers keep (`provider::fallback::DEFAULT_CAPACITY_WAIT_MAX`).
///
/// Why a deferral after it is no broken promise: protocol.md B.5 defers "a rate limit whose
/// wait exceeds the task's wait budget", and no worker whose waits are bounded can promise
/// less to replicas pacing alone. Their own view does not show their share of a quota they
/// share (BENCHMARKS.md, "Replicas pacing alone"), so nothing bounds how long one replica's
/// calls may find the provider's windows taken by the others'. What the worker does promise,
/// and this checks: it waits that whole wait first. Its own lowered pace never makes a call
/// give up before (`Pacer::poll_due`), and only the provider's word (a hold beyond the wait
/// left) may end the wait early, by at most [`PROVIDER_HOLD_MAX`] here.
pub(crate) const MODEL_WAIT: u64 = 60_000;

/// The longest wait the world's provider asks for: its limit's `retry-after-ms` runs to the
/// end of the current second (window) or to a second's refill (bucket), an injected 429 asks
/// for 200 ms, and a hostile figure holds for the pacer's `figure_ttl`, 1 s.
pub(crate) const PROVIDER_HOLD_MAX: u64 = 1_000;

/// The bound on a worker's 429s from one provider's limit (each provider name its own quota
/// and its own pacer): at most this many per second of the time its model calls were
/// contested, plus [`REFUSALS_PER_WORKER_START`].
///
/// Why: the pacer releases one call at a time; a 429 with a `retry-after` (a stated limit)
/// holds the model until then and lets one probe go alone, answered before the next call goes;
/// a bare 429 (a limit stating nothing) lowers the pace at once and makes the next call wait
/// an increment. A replica pacing alone beside others meets their calls at random phases, and
/// AIMD lowers its pace at most once a second. So a worker draws at most about one refusal per
/// second while its provider is contested, not one per waiting call: a herd (every waiting call
/// at a hold's end) draws one per call. `REFUSALS_PER_WORKER_START` covers the first burst of a
/// provider stating nothing (no pace known yet: the slots' calls go together, all but the
/// second's worth refused) and the replicas' first probes meeting in one window.
pub(crate) const REFUSALS_PER_WORKER_SECOND: f64 = 1.0;
pub(crate) const REFUSALS_PER_WORKER_START: u64 = 3;

/// How soon a worker fetches again after an empty answer that was contention: a quarter of
/// the poll interval (the first pause is at most 25 ms; waiting the poll interval is idling).
fn idle_bound(poll: Duration) -> u64 {
    (poll.as_millis() as u64) / 4
}

/// A 429 answered to a worker's model call: the limit's or an injected one.
fn refused(answer: &str) -> bool {
    answer == LIMIT_REFUSED || answer == "429"
}

pub fn no_deferral_while_answering(facts: &Facts<'_>) -> Vec<Violation> {
    // A run on the wire (`crate::observed`) writes no model calls into its trace: nothing
    // explains or condemns its deferrals here.
    if facts.scenario.is_some() {
        return Vec::new();
    }
    // When each worker last saw an outage: a model 5xx, a run-store call refused or its
    // answer lost (the worker saw the call fail, and waits the store out).
    let mut outages: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    // When each attempt began on its worker.
    let mut started: BTreeMap<(&str, &str, Option<u32>), u64> = BTreeMap::new();
    let mut out = Vec::new();
    for (t, e) in &facts.trace.events {
        match e {
            Event::TaskStarted {
                worker,
                task,
                attempt,
            } => {
                started.insert((worker, task, *attempt), *t);
            }
            Event::ModelCall { worker, answer, .. } if *answer == "5xx" => {
                outages.entry(worker).or_default().push(*t);
            }
            Event::StoreAnswer { worker, answer, .. }
                if *answer == "outage" || *answer == "answer-lost" =>
            {
                outages.entry(worker).or_default().push(*t);
            }
            Event::TaskEnded {
                worker,
                task,
                attempt,
                outcome,
            } if outcome == "deferred" => {
                let after_outage = outages
                    .get(worker.as_str())
                    .is_some_and(|o| o.iter().any(|o| *o + OUTAGE_LOOKBACK >= *t));
                let after_the_wait = started
                    .get(&(worker.as_str(), task.as_str(), *attempt))
                    .is_some_and(|s| *s + MODEL_WAIT - PROVIDER_HOLD_MAX <= *t);
                if !after_outage && !after_the_wait {
                    let busy = facts
                        .trace
                        .events
                        .iter()
                        .filter(|(u, e)| {
                            *u <= *t
                                && *u + OUTAGE_LOOKBACK >= *t
                                && matches!(e, Event::ModelCall { worker: w, answer, .. } if w == worker && refused(answer))
                        })
                        .count();
                    out.push(violation(
                        super::NO_DEFERRAL_WHILE_ANSWERING,
                        format!(
                            "task {task} (attempt {attempt:?}): deferred by {worker} at {}, {} into the attempt (its model wait of {} s not spent), with no outage (model 5xx, run store refused or its answer lost) in the {} s before; its model answered 429 {busy} times then",
                            at(*t),
                            started
                                .get(&(worker.as_str(), task.as_str(), *attempt))
                                .map_or_else(|| "?".to_string(), |s| at(*t - *s)),
                            MODEL_WAIT / 1000,
                            OUTAGE_LOOKBACK / 1000
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

pub fn limit_refusals_bounded(facts: &Facts<'_>) -> Vec<Violation> {
    if facts.schedule.faults.provider_limit.is_none() {
        return Vec::new();
    }
    // Per worker and provider (each its own quota and its own pacer): the limit's 429s, the
    // calls let through, and the span from the first 429 to the last call (the time the
    // provider was contested).
    #[derive(Default)]
    struct Seen {
        refused: u64,
        admitted: u64,
        first_refused: Option<u64>,
        last_call: u64,
    }
    let mut seen: BTreeMap<(&str, &str), Seen> = BTreeMap::new();
    for (t, e) in &facts.trace.events {
        if let Event::ModelCall {
            worker,
            provider,
            answer,
            ..
        } = e
        {
            let s = seen.entry((worker, provider)).or_default();
            s.last_call = *t;
            if *answer == LIMIT_REFUSED {
                s.refused += 1;
                s.first_refused.get_or_insert(*t);
            } else {
                s.admitted += 1;
            }
        }
    }
    let mut out = Vec::new();
    for ((worker, provider), s) in seen {
        let Some(first) = s.first_refused else {
            continue;
        };
        let contested = s.last_call.saturating_sub(first) as f64 / 1000.0;
        let bound =
            REFUSALS_PER_WORKER_START + (REFUSALS_PER_WORKER_SECOND * contested).floor() as u64;
        if s.refused > bound {
            out.push(violation(
                super::LIMIT_REFUSALS_BOUNDED,
                format!(
                    "worker {worker}, provider {provider}: {} calls answered 429 by the provider's limit ({} let through) over {contested:.1} s from its first 429, above {bound} ({REFUSALS_PER_WORKER_START} + {REFUSALS_PER_WORKER_SECOND} a second)",
                    s.refused, s.admitted
                ),
            ));
        }
    }
    out
}

pub fn no_idle_replica(facts: &Facts<'_>) -> Vec<Violation> {
    // A provider limit paces the worker's fetches by design (admission: no more claims than
    // its model can start soon), so the check is for the seeds without one.
    if facts.schedule.faults.provider_limit.is_some() {
        return Vec::new();
    }
    let bound = idle_bound(facts.schedule.poll_interval);
    let contention_ms = facts
        .schedule
        .faults
        .fetch_contention
        .map_or(0, |d| d.as_millis() as u64);
    let events = &facts.trace.events;
    let end = events.last().map_or(0, |(t, _)| *t);
    // Per worker: whether its last answer had tasks (or none came yet), its tasks running,
    // whether it made a model call whose answer is out (its first: a probe that gates
    // admission), its last 429.
    #[derive(Default)]
    struct State {
        answers: u32,
        last_had_tasks: bool,
        running: u32,
        started_any: bool,
        answered_any: bool,
    }
    let mut state: BTreeMap<&str, State> = BTreeMap::new();
    let mut out = Vec::new();
    for (i, (t, e)) in events.iter().enumerate() {
        match e {
            Event::TaskStarted { worker, .. } => {
                let s = state.entry(worker).or_default();
                s.running += 1;
                s.started_any = true;
            }
            Event::TaskEnded { worker, .. } => {
                let s = state.entry(worker).or_default();
                s.running = s.running.saturating_sub(1);
            }
            Event::ModelCall { worker, .. } => {
                state.entry(worker).or_default().answered_any = true;
            }
            // A failed fetch ends a run that began with tasks (or at the start): the empty
            // answer after it is not taken for contention.
            Event::EngineAnswer {
                worker, op, answer, ..
            } if *op == "fetch-and-lock" && *answer != Answer::Ok => {
                let s = state.entry(worker).or_default();
                s.answers += 1;
                s.last_had_tasks = false;
            }
            Event::FetchBacklog {
                worker,
                asked,
                got,
                waiting,
            } => {
                let s = state.entry(worker).or_default();
                let first = s.answers == 0;
                let after_tasks = s.last_had_tasks;
                s.answers += 1;
                s.last_had_tasks = *got > 0;
                // The first model call of a worker is a probe: admission holds fetches until it
                // is answered.
                let probing = s.started_any && !s.answered_any;
                if *got > 0 || *asked == 0 || *waiting == 0 || !(first || after_tasks) || probing {
                    continue;
                }
                // A late answer reaches the worker when it is delivered (or never): the bound
                // runs from then.
                let late = events[..i].iter().rev().take_while(|(u, _)| u == t).any(|(_, e)| {
                    matches!(e, Event::Late { worker: w, op, .. } if w == worker && *op == "fetch-and-lock")
                });
                let received = if late {
                    let delivered = events[i + 1..].iter().find(|(_, e)| {
                        matches!(e, Event::Delivered { worker: w, op, executed, .. } if w == worker && *op == "fetch-and-lock" && executed == t)
                    });
                    match delivered {
                        Some((u, _)) => *u,
                        None => continue,
                    }
                } else {
                    *t
                };
                // With fetch contention, the answer reaches the worker when the fetch's
                // transaction commits, after the engine picked its tasks (seed 4000010262 of
                // a random window: an empty first answer received 100 ms after it was made).
                let received = received + contention_ms;
                let deadline = received + bound;
                if deadline > end {
                    continue;
                }
                let mut excused = false;
                let mut fetched = None;
                for (u, later) in &events[i + 1..] {
                    if *u > deadline {
                        break;
                    }
                    match later {
                        Event::EngineCall { worker: w, op, .. }
                            if w == worker && *op == "fetch-and-lock" =>
                        {
                            fetched = Some(*u);
                            break;
                        }
                        Event::WorkerKilled { worker: w } if w == worker => excused = true,
                        _ => {}
                    }
                }
                // A 429 lately: the model is held or paced, and admission may hold fetches.
                let limited = events.iter().any(|(u, e)| {
                    *u + 60_000 >= *t
                        && *u <= deadline
                        && matches!(e, Event::ModelCall { worker: w, answer, .. } if w == worker && refused(answer))
                });
                if fetched.is_none() && !excused && !limited {
                    out.push(violation(
                        super::NO_IDLE_REPLICA,
                        format!(
                            "worker {worker}: its fetch of {asked} at {} was answered empty while {waiting} tasks waited unlocked ({}), and it sent no fetch within {bound} ms",
                            at(*t),
                            if first {
                                "its first answer"
                            } else {
                                "right after an answer with tasks"
                            }
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

/// The gap allowed between a worker's fetch answer and its next fetch while it has a free slot:
/// admission may hold every topic, but a fetch of one task still goes out once a poll interval
/// (`runner::policy::admit`), after at most the contention pauses (within one poll interval);
/// twice the poll interval and a quarter second of slack for the world's small delays.
fn fetch_gap_bound(poll: Duration) -> u64 {
    2 * poll.as_millis() as u64 + 250
}

/// The worker never stops fetching for longer than its capacity lets it (the seeds with a
/// provider limit, honest or hostile): from a fetch answer it received, or from when a slot
/// became free after it, its next fetch comes within [`fetch_gap_bound`]. Not judged across a
/// failed fetch (its backoff is the outage's), a kill or a freeze of the worker, or an engine
/// outage or hang.
pub fn fetching_continues(facts: &Facts<'_>) -> Vec<Violation> {
    if facts.schedule.faults.provider_limit.is_none() {
        return Vec::new();
    }
    let bound = fetch_gap_bound(facts.schedule.poll_interval);
    let events = &facts.trace.events;
    // The world's last event (the logs the workers print once the seed is over excepted).
    let end = events
        .iter()
        .rev()
        .find(|(_, e)| !matches!(e, Event::Log { .. }))
        .map_or(0, |(t, _)| *t);
    let frozen = |worker: &str, from: u64, to: u64| {
        facts
            .schedule
            .faults
            .freezes
            .get(worker)
            .is_some_and(|ws| ws.iter().any(|w| w.start < to && w.end > from))
    };
    // An engine that answers nothing holds the fetch sent meanwhile (its answer, or its
    // failure, comes at the window's end).
    let engine_silent = |from: u64, to: u64| {
        let f = &facts.schedule.faults;
        f.engine_hangs
            .iter()
            .chain(&f.engine_outages)
            .any(|w| w.start < to && w.end > from)
    };
    #[derive(Default)]
    struct Worker<'a> {
        slots: usize,
        /// Per task, its attempts on this worker in the order they started, and whether each
        /// is at work (its slot not given back): a task's next attempt may start on a freed
        /// slot while the one before still winds down, and the earlier one's end frees nothing
        /// of it (seed 4000002522 of a random window). A plain engine's attempts carry no
        /// number: a slot given back is the oldest at work's, an end the oldest's (seed
        /// 4000030372).
        attempts: BTreeMap<&'a str, std::collections::VecDeque<(Option<u32>, bool)>>,
        /// The fetch answer the gap is measured from (none across a failed or late one).
        answered: Option<u64>,
        /// Since when a slot has been free (none while every slot is taken).
        free_from: Option<u64>,
    }
    impl<'a> Worker<'a> {
        fn running(&self) -> usize {
            self.attempts
                .values()
                .flatten()
                .filter(|(_, at_work)| *at_work)
                .count()
        }

        fn slot_freed(&mut self, task: &'a str, attempt: Option<u32>) {
            let list = self.attempts.entry(task).or_default();
            if let Some(entry) = list
                .iter_mut()
                .find(|(a, at_work)| *at_work && (attempt.is_none() || *a == attempt))
            {
                entry.1 = false;
            }
        }

        fn ended(&mut self, task: &'a str, attempt: Option<u32>) {
            let list = self.attempts.entry(task).or_default();
            let position = match attempt {
                Some(_) => list.iter().position(|(a, _)| *a == attempt),
                None => (!list.is_empty()).then_some(0),
            };
            if let Some(i) = position {
                list.remove(i);
            }
        }

        fn started(&mut self, at: u64) {
            if self.running() >= self.slots {
                self.free_from = None;
            } else if self.free_from.is_none() {
                self.free_from = Some(at);
            }
        }
    }
    let mut workers: BTreeMap<&str, Worker> = BTreeMap::new();
    let mut out = Vec::new();
    let mut check = |worker: &str, w: &Worker, to: u64| {
        let (Some(answered), Some(free)) = (w.answered, w.free_from) else {
            return;
        };
        let from = answered.max(free);
        if to > from + bound && !frozen(worker, from, to) && !engine_silent(from, to) {
            out.push(violation(
                super::FETCHING_CONTINUES,
                format!(
                    "worker {worker}: a slot free and no fetch from {} to {} ({} ms, bound {bound} ms)",
                    at(from),
                    at(to),
                    to - from
                ),
            ));
        }
    };
    for (t, e) in events {
        match e {
            Event::WorkerStarted { worker, slots } => {
                let w = Worker {
                    slots: *slots as usize,
                    ..Worker::default()
                };
                workers.insert(worker, w);
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.started(*t);
                }
            }
            Event::WorkerKilled { worker } => {
                workers.remove(worker.as_str());
            }
            Event::TaskStarted {
                worker,
                task,
                attempt,
            } => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.attempts
                        .entry(task)
                        .or_default()
                        .push_back((*attempt, true));
                    w.started(*t);
                }
            }
            Event::SlotFreed {
                worker,
                task,
                attempt,
            } => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.slot_freed(task, *attempt);
                    w.started(*t);
                }
            }
            Event::TaskEnded {
                worker,
                task,
                attempt,
                ..
            } => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.ended(task, *attempt);
                    w.started(*t);
                }
            }
            Event::EngineCall { worker, op, .. } if *op == "fetch-and-lock" => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    check(worker, w, *t);
                    w.answered = None;
                }
            }
            Event::EngineAnswer {
                worker, op, answer, ..
            } if *op == "fetch-and-lock" => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.answered = (*answer == Answer::Ok).then_some(*t);
                }
            }
            // A late answer is measured from when it reached the worker.
            Event::Late { worker, op, .. } if *op == "fetch-and-lock" => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.answered = None;
                }
            }
            Event::Delivered { worker, op, .. } if *op == "fetch-and-lock" => {
                if let Some(w) = workers.get_mut(worker.as_str()) {
                    w.answered = Some(*t);
                }
            }
            _ => {}
        }
    }
    // At the seed's end, only when tasks were left open (a worker that stopped fetching for
    // good leaves them so); otherwise the seed simply ended with a fetch on its way.
    if facts.views.iter().any(|v| !super::super::ended(v)) {
        for (worker, w) in &workers {
            check(worker, w, end);
        }
    }
    out
}
