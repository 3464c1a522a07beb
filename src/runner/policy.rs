//! The poll loop's fetch policy: told what happened (a fetch got `n` of `m` tasks, a fetch
//! failed, a probe answered) and when, it decides what the loop does next: fetch, probe the
//! engine, or wait until a given instant. It owns the error streak, the backoff class, the
//! outage probing and whether an error is worth a warning. It does no I/O and reads no clock
//! (instants come in), and its randomness is injected, so every rule is unit-tested below.
//!
//! The rules (design.md, Level 1; docs/OPERATIONS.md):
//! - An empty answer means "nothing to do" unless it comes right after a full or partial one,
//!   or is the worker's first: it waits the poll interval, stretched at random by up to
//!   `poll_jitter` (2 %) and never shortened: an idle worker asks at most once per interval.
//! - An empty answer right after a full or partial one (or after a run of such empties) is
//!   contention, not an empty queue: another worker's fetch held the rows when ours ran. So is
//!   the worker's first answer, empty: a replica that starts beside busy ones on a backlog
//!   meets their locks first, and waiting a poll interval per collision leaves it idle for
//!   seconds (on the real engine one worker of four once got no task of a run). The real
//!   engine 0.11 on H2 (its dev profile) locks every row its acquisition query matches, not
//!   only the one it returns, until its fetch's transaction commits, so a fetch that starts
//!   meanwhile answers empty on a deep backlog (the engine's fetch is one transaction, and H2
//!   2.3's `Select` locks every row it reads for `FOR UPDATE` before it sorts and limits; the
//!   devkit emulator's `engine/contention.rs` cites the sources and models it). Waiting the
//!   poll interval then idles the free slots while tasks wait. So it fetches again after a
//!   short pause instead: [`CONTENTION_PAUSE`] (25 ms), doubling with each empty answer in a
//!   row, drawn at random between half and all of it (`contention_backoff`, equal jitter, so
//!   workers that collided do not collide again; the simulator turns the jitter off), for as
//!   long as the nominal pauses together fit in one poll interval (with the default 1 s: 25,
//!   50, 100, 200, 400 ms); the next empty answer waits the poll interval as above, and the run
//!   of empties is over. So a queue that really emptied, and a worker's start on an empty
//!   queue, cost at most a few more fetches (log2 of the poll interval over 25 ms), all within
//!   one poll interval; an idle queue is otherwise asked once per interval.
//! - Any other answer fetches again at once, for the slots still free (none free: once a task
//!   ends). A full batch, of course; and a partial one too, because on a shared queue it means
//!   others are fetching at the same moment (the engine's `FOR UPDATE SKIP LOCKED` skips the
//!   rows their fetches hold), or the engine caps its answers, not that the queue is empty.
//!   This cannot spin: every non-empty answer fills at least one free slot, so a run of
//!   immediate fetches ends within the free slots, with the slots full (the next fetch waits
//!   for a task's end) or an empty answer (a contention pause, then the poll interval). No
//!   pause is needed, and a pause would only leave slots idle while tasks wait.
//! - A task that ends frees its slot and fetches at once, whatever the loop was waiting for:
//!   also during the idle wait after an empty answer (its completion may well have made the
//!   next task of its process, and the slot is free now). So an idle worker asks at most once
//!   per poll interval plus once per task that ends. Not while backing off from a failed fetch:
//!   the engine's trouble does not end because a task did; the backoff and the probes decide.
//! - A failed fetch backs off by class; the streak counts consecutive failures and a success
//!   resets it.
//!   - The engine asked to slow down with Retry-After: that long, capped at the throttle
//!     backoff's maximum.
//!   - The engine asked to slow down without it, or refused us (authentication, access): the
//!     throttle backoff. Such an engine answers, so its backoff is served in full.
//!   - Any other error (the engine does not answer, times out, fails with 5xx, or answers
//!     nonsense): the error backoff, never shorter than nominal (jitter only lengthens it), so
//!     a 60 s outage sees at most 12 fetches with the default 1 s..6 s.
//! - After a transient error the engine is probed once per poll interval while the backoff
//!   lasts; the first probe that gets an answer ends the backoff, so fetching resumes within one
//!   poll interval of the engine's return. An engine that cannot be probed is waited out.
//! - An error is logged at warn the first time, at debug while it repeats word for word; the
//!   first success after a warning says so.
//! - Admission (in the spirit of Temporal's slot suppliers): the task handler says, per topic,
//!   how many tasks could start soon (the pace of the models the topic's tasks use, less the
//!   tasks claimed that have not called yet; no bound for a topic whose models are not known).
//!   A fetch asks for the free slots, no more than the topics it asks for can start, and leaves
//!   out a topic that can start none, so a model held stops its own topics, not the others.
//!   No topic can: a wait until the earliest returns (or a task ends), never shorter than
//!   [`ADMISSION_RECHECK`], so a capacity due "now" again and again cannot make the loop spin;
//!   but once per poll interval a fetch of one task of every topic still goes out: what a
//!   topic's tasks use is learned from the tasks seen, and the next one may name a model not
//!   seen yet (a task of the held model claimed so waits inside its task, within the model
//!   wait). A task claimed that cannot start would only wait for the provider or be deferred,
//!   a failure the engine records.

use std::time::Duration;

use tokio::time::Instant;

use super::RunnerSettings;
use crate::backoff::{self, Backoff};
use crate::engine::{EngineError, ProbeOutcome};
use crate::provider::capacity::Capacity;

/// A source of uniform random numbers in `0.0..1.0` (jitter); tests pass a constant.
pub(crate) type Random = Box<dyn FnMut() -> f64 + Send>;

/// What the poll loop does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Fetch now (if a slot is free; else once one is).
    Fetch,
    /// Probe the engine now.
    Probe,
    /// Nothing to do before this instant.
    WaitUntil(Instant),
}

/// The level a failed fetch is logged at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogLevel {
    /// A new error: the operator should see it.
    Warn,
    /// The error logged last, again: an outage is one clear line, not one per retry.
    Debug,
}

/// What the loop reports about a failed fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchFailed {
    /// The backoff before the next fetch.
    pub wait: Duration,
    /// Consecutive failed fetches, this one included.
    pub failures: u32,
    pub(crate) log_at: LogLevel,
}

/// What a fetch may ask for, by admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Ask for this many tasks (at least 1) of these topics (at least one); `probe`: every
    /// topic was held, and this is the one task a poll interval (the next is due a poll
    /// interval later).
    Fetch {
        max: u32,
        topics: Vec<String>,
        probe: bool,
    },
    /// No task of any topic could start before this instant: do not fetch until then (or a
    /// task's end).
    WaitUntil(Instant),
}

/// Admission: with `free` slots (at least 1) and the handler's capacity for each topic at
/// `now`, which topics a fetch asks for and how many tasks (see the module docs). `probe_at`:
/// when a fetch of one task is due even with every topic held.
pub(crate) fn admit(
    free: u32,
    topics: &[(String, Capacity)],
    now: Instant,
    probe_at: Instant,
) -> Admit {
    let mut open = Vec::new();
    let mut max: Option<u64> = Some(0);
    let mut earliest: Option<Instant> = None;
    for (topic, capacity) in topics {
        match capacity {
            Capacity::Unbounded => {
                open.push(topic.clone());
                max = None;
            }
            Capacity::Now(n) if *n > 0 => {
                open.push(topic.clone());
                max = max.map(|m| m + u64::from(*n));
            }
            // A capacity due now (or `Now(0)`, which the handler should not say) is checked
            // again a moment later rather than fetched for: no claim above what can start.
            Capacity::Now(_) => earliest = Some(earliest.map_or(now, |e| e.min(now))),
            Capacity::Until(at) => earliest = Some(earliest.map_or(*at, |e| e.min(*at))),
        }
    }
    // SIM-BUG (feature `sim-bugs`, selected at run time): with every topic held, no fetch at
    // all for an hour, whatever returns (the wedge: nothing fetched for any topic or provider
    // while a held model's figure lasts, and it lasted for good).
    #[cfg(feature = "sim-bugs")]
    if open.is_empty() && crate::sim_bugs::active(crate::sim_bugs::Bug::CapacityWedge) {
        return Admit::WaitUntil(now + Duration::from_secs(3600));
    }
    if open.is_empty() {
        if probe_at <= now && !topics.is_empty() {
            return Admit::Fetch {
                max: 1,
                topics: topics.iter().map(|(t, _)| t.clone()).collect(),
                probe: true,
            };
        }
        let at = earliest
            .unwrap_or(now)
            .min(probe_at)
            .max(now + ADMISSION_RECHECK);
        return Admit::WaitUntil(at);
    }
    let max = max.map_or(free, |m| u64::from(free).min(m) as u32);
    Admit::Fetch {
        max,
        topics: open,
        probe: false,
    }
}

/// The shortest wait for capacity: a capacity said to return "now", again and again (a
/// provider stating a limit of 0, a figure due this instant), cannot make the loop spin.
pub(crate) const ADMISSION_RECHECK: Duration = Duration::from_millis(25);

/// The first pause after an empty answer that may be contention (see the module docs):
/// about a fetch's transaction on the real engine under load (9-35 ms measured per fetch in
/// docs/benchmarks-history.md), so the fetch that held the rows has likely committed when ours runs again.
pub(crate) const CONTENTION_PAUSE: Duration = Duration::from_millis(25);

/// A run of empty answers that began right after an answer with tasks, or at the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Contention {
    /// Empty answers in the run so far.
    empties: u32,
    /// The nominal pauses taken so far; the run ends before they exceed the poll interval.
    paused: Duration,
}

/// The fetch policy of one poll loop (see the module docs).
pub(crate) struct FetchPolicy {
    poll_interval: Duration,
    poll_jitter: f64,
    error_backoff: Backoff,
    throttle_backoff: Backoff,
    contention_backoff: Backoff,
    random: Random,
    /// Consecutive failed fetches; 0 after a success.
    failures: u32,
    /// The last error logged at warn, until a fetch succeeds.
    last_warned: Option<String>,
    fetch_at: Instant,
    /// When to probe the engine next; `None` unless backing off from a transient error.
    probe_at: Option<Instant>,
    /// Set at the start and by an answer with tasks: an empty answer then is contention, not an
    /// empty queue. `None` once such a run of empties has fallen back to the poll interval, or
    /// after an error.
    contention: Option<Contention>,
}

impl FetchPolicy {
    /// A policy that fetches at `now` first.
    pub fn new(settings: &RunnerSettings, now: Instant, random: Random) -> Self {
        FetchPolicy {
            poll_interval: settings.poll_interval,
            poll_jitter: settings.poll_jitter,
            error_backoff: settings.error_backoff,
            throttle_backoff: settings.throttle_backoff,
            contention_backoff: settings.contention_backoff,
            random,
            failures: 0,
            last_warned: None,
            fetch_at: now,
            probe_at: None,
            // The first answer may meet other workers' locks too (see the module docs).
            contention: Some(Contention::default()),
        }
    }

    /// What to do at `now`. A probe that is due goes first: it may end the backoff.
    pub fn next(&self, now: Instant) -> Action {
        if self.probe_at.is_some_and(|at| now >= at) {
            return Action::Probe;
        }
        if now >= self.fetch_at {
            return Action::Fetch;
        }
        Action::WaitUntil(
            self.probe_at
                .map_or(self.fetch_at, |p| p.min(self.fetch_at)),
        )
    }

    /// A fetch got `got` tasks (of however many it asked for). Returns whether it ends a run of
    /// failures that was logged (say that fetching works again).
    ///
    /// A full or partial answer fetches again at once (see the module docs for why a partial
    /// answer cannot make the loop spin); an empty one right after it (or the first) fetches
    /// again after a short pause, backing off; any other empty answer waits the poll interval.
    pub fn fetched(&mut self, now: Instant, got: usize) -> bool {
        self.failures = 0;
        self.probe_at = None;
        self.fetch_at = if got == 0 {
            now + self.after_empty()
        } else {
            self.contention = Some(Contention::default());
            now
        };
        self.last_warned.take().is_some()
    }

    /// The wait after an empty answer: a contention pause while a run of empties that began
    /// right after tasks (or at the start) lasts (see the module docs), else the poll interval.
    fn after_empty(&mut self) -> Duration {
        // SIM-BUG (feature `sim-bugs`, selected at run time): every empty answer an empty queue.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::ContentionAsEmptyQueue) {
            self.contention = None;
        }
        if let Some(run) = self.contention.take() {
            let nominal = self.contention_backoff.delay_with(run.empties, 1.0);
            let paused = run.paused.saturating_add(nominal);
            if paused <= self.poll_interval {
                self.contention = Some(Contention {
                    empties: run.empties + 1,
                    paused,
                });
                // With the default jitter (0.5): between half and all of the nominal pause.
                return self
                    .contention_backoff
                    .delay_with(run.empties, (self.random)());
            }
        }
        backoff::stretched_with(self.poll_interval, self.poll_jitter, (self.random)())
    }

    /// A task ended at `now` and freed its slot: fetch at once, cutting short the idle wait
    /// after an empty answer. A backoff after a failed fetch is kept (a task's end says nothing
    /// about the engine's trouble); so are the probes.
    pub fn task_ended(&mut self, now: Instant) {
        if self.failures == 0 {
            self.fetch_at = self.fetch_at.min(now);
        }
    }

    /// A fetch failed with `error`.
    pub(crate) fn fetch_failed(&mut self, now: Instant, error: &EngineError) -> FetchFailed {
        self.failures = self.failures.saturating_add(1);
        // The next empty answer no longer follows one with tasks.
        self.contention = None;
        let wait = self.backoff(error);
        self.fetch_at = now + wait;
        // Probing is for an engine that may not answer at all; a throttling or refusing engine
        // answers, so its backoff is served in full.
        self.probe_at =
            matches!(error, EngineError::Transient { .. }).then(|| now + self.poll_interval);
        let text = error.to_string();
        let log_at = if self.last_warned.as_deref() == Some(text.as_str()) {
            LogLevel::Debug
        } else {
            self.last_warned = Some(text);
            LogLevel::Warn
        };
        FetchFailed {
            wait,
            failures: self.failures,
            log_at,
        }
    }

    /// A probe found `outcome`. Returns whether the engine answers again (fetch at once).
    pub fn probed(&mut self, now: Instant, outcome: ProbeOutcome) -> bool {
        match outcome {
            ProbeOutcome::Reachable => {
                self.probe_at = None;
                self.fetch_at = now;
                true
            }
            ProbeOutcome::Unreachable => {
                self.probe_at = Some(now + self.poll_interval);
                false
            }
            ProbeOutcome::NotSupported => {
                self.probe_at = None;
                false
            }
        }
    }

    /// The backoff after the current streak of failures, ending with `error`.
    fn backoff(&mut self, error: &EngineError) -> Duration {
        let retry = self.failures - 1;
        match error {
            EngineError::Throttled {
                retry_after: Some(d),
                ..
            } => (*d).min(self.throttle_backoff.max),
            EngineError::Throttled { .. }
            | EngineError::Unauthenticated { .. }
            | EngineError::AccessDenied { .. }
            | EngineError::Auth { .. } => self.throttle_backoff.delay_with(retry, (self.random)()),
            // Jitter only lengthens the nominal delay here, so the number of fetches during an
            // outage is bounded (probes, not early fetches, detect the engine's return).
            _ => {
                let nominal = self.error_backoff.without_jitter().delay_with(retry, 0.0);
                let spread = 0.5
                    * self.error_backoff.jitter.clamp(0.0, 1.0)
                    * (self.random)().clamp(0.0, 1.0);
                nominal + nominal.mul_f64(spread)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn settings() -> RunnerSettings {
        RunnerSettings::new("w-policy", Duration::from_secs(120))
    }

    fn policy(random: f64) -> (FetchPolicy, Instant) {
        let t0 = Instant::now();
        (
            FetchPolicy::new(&settings(), t0, Box::new(move || random)),
            t0,
        )
    }

    /// A policy past its start: its empty answers are an idle queue's, not contention.
    fn idle(random: f64) -> (FetchPolicy, Instant) {
        let (mut p, t0) = policy(random);
        p.contention = None;
        (p, t0)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn down() -> EngineError {
        EngineError::Transient {
            op: "fetch-and-lock",
            message: "connection refused".into(),
            request_sent: false,
        }
    }

    fn throttled(retry_after: Option<Duration>) -> EngineError {
        EngineError::Throttled {
            op: "fetch-and-lock",
            status: 429,
            retry_after,
        }
    }

    fn one(capacity: Capacity) -> Vec<(String, Capacity)> {
        vec![("t".to_string(), capacity)]
    }

    fn fetch(max: u32, topics: &[&str]) -> Admit {
        Admit::Fetch {
            max,
            topics: topics.iter().map(|t| t.to_string()).collect(),
            probe: false,
        }
    }

    /// No probe fetch due for a minute.
    fn no_probe(now: Instant) -> Instant {
        now + ms(60_000)
    }

    /// Admission never asks for more tasks than the models can start, nor more than the free
    /// slots, and waits for capacity rather than fetching for none.
    #[test]
    fn admission_asks_for_the_free_slots_within_the_capacity() {
        let now = Instant::now();
        assert_eq!(
            admit(8, &one(Capacity::Unbounded), now, no_probe(now)),
            fetch(8, &["t"])
        );
        assert_eq!(
            admit(8, &one(Capacity::Now(3)), now, no_probe(now)),
            fetch(3, &["t"])
        );
        assert_eq!(
            admit(2, &one(Capacity::Now(30)), now, no_probe(now)),
            fetch(2, &["t"])
        );
        let later = now + ms(400);
        assert_eq!(
            admit(8, &one(Capacity::Until(later)), now, no_probe(now)),
            Admit::WaitUntil(later)
        );
        for free in 1..=50 {
            for cap in 1..=50 {
                let Admit::Fetch { max, .. } =
                    admit(free, &one(Capacity::Now(cap)), now, no_probe(now))
                else {
                    panic!("{free} {cap}");
                };
                assert!(
                    max >= 1 && max <= free && max <= cap,
                    "{free} {cap} -> {max}"
                );
            }
        }
    }

    /// A capacity said to return now, or `Now(0)`, again and again (a provider stating a limit
    /// of 0 did this with a 1 ms recheck: the poll loop spun): never a wait shorter than the
    /// recheck, so at most 40 looks a second.
    #[test]
    fn admission_never_waits_less_than_the_recheck() {
        let now = Instant::now();
        for capacity in [
            Capacity::Until(now),
            Capacity::Now(0),
            Capacity::Until(now + ms(1)),
        ] {
            assert_eq!(
                admit(8, &one(capacity), now, no_probe(now)),
                Admit::WaitUntil(now + ADMISSION_RECHECK),
                "{capacity:?}"
            );
        }
        assert!(ADMISSION_RECHECK >= ms(25));
    }

    /// A topic whose models are held is left out of the fetch; the others are fetched, for no
    /// more than they can start (an unbounded topic: the free slots).
    #[test]
    fn a_topic_that_can_start_nothing_is_left_out_and_the_others_fetched() {
        let now = Instant::now();
        let held = ("held".to_string(), Capacity::Until(now + ms(60_000)));
        let paced = ("paced".to_string(), Capacity::Now(2));
        let free = ("free".to_string(), Capacity::Unbounded);
        assert_eq!(
            admit(8, &[held.clone(), paced.clone()], now, no_probe(now)),
            fetch(2, &["paced"])
        );
        assert_eq!(
            admit(8, &[held.clone(), paced, free], now, no_probe(now)),
            fetch(8, &["paced", "free"])
        );
        let sooner = ("sooner".to_string(), Capacity::Until(now + ms(300)));
        assert_eq!(
            admit(8, &[held.clone(), sooner.clone()], now, no_probe(now)),
            Admit::WaitUntil(now + ms(300)),
            "the earliest topic back"
        );
        // Every topic held: once a poll interval, one task of any of them is fetched, so a
        // task naming a model not seen yet is found; never more often.
        assert_eq!(
            admit(8, &[held.clone(), sooner.clone()], now, now),
            Admit::Fetch {
                max: 1,
                topics: vec!["held".into(), "sooner".into()],
                probe: true
            }
        );
        assert_eq!(
            admit(8, std::slice::from_ref(&held), now, now + ms(100)),
            Admit::WaitUntil(now + ms(100)),
            "waits for the next probe when it comes before the capacity"
        );
    }

    #[test]
    fn the_first_fetch_is_at_once() {
        let (p, t0) = policy(0.5);
        assert_eq!(p.next(t0), Action::Fetch);
    }

    #[test]
    fn a_full_batch_fetches_again_at_once() {
        let (mut p, t0) = policy(0.5);
        let now = t0 + ms(3);
        p.fetched(now, 4);
        assert_eq!(p.next(now), Action::Fetch);
    }

    #[test]
    fn an_empty_fetch_waits_the_poll_interval_stretched_by_at_most_two_percent() {
        for (random, wait) in [(0.0, ms(1000)), (0.5, ms(1010)), (1.0, ms(1020))] {
            let (mut p, t0) = idle(random);
            p.fetched(t0, 0);
            assert_eq!(p.next(t0), Action::WaitUntil(t0 + wait), "{random}");
            assert_eq!(p.next(t0 + wait - ms(1)), Action::WaitUntil(t0 + wait));
            assert_eq!(p.next(t0 + wait), Action::Fetch);
        }
    }

    /// A partial answer is others fetching too, not an empty queue.
    #[test]
    fn a_partial_fetch_fetches_the_rest_at_once() {
        for random in [0.0, 0.5, 1.0] {
            // 2 of 8, 7 of 8, 1 of 2, 1 of 50: all fetch again at once.
            for got in [1, 2, 7] {
                let (mut p, t0) = policy(random);
                let now = t0 + ms(3);
                p.fetched(now, got);
                assert_eq!(p.next(now), Action::Fetch, "{got}");
            }
        }
    }

    /// Drives the policy like the loop does, with `slots` slots and tasks that never end,
    /// against an engine that holds `queue` tasks and answers at most `cap` per fetch. Returns
    /// the fetches made (asked, got) before the policy first waits, and that wait.
    fn fill(slots: u32, queue: usize, cap: usize) -> (Vec<(u32, usize)>, Action) {
        let (mut p, t0) = policy(0.0);
        let (mut free, mut left, mut fetches) = (slots, queue, Vec::new());
        loop {
            match p.next(t0) {
                Action::Fetch if free > 0 => {
                    let got = left.min(cap).min(free as usize);
                    fetches.push((free, got));
                    p.fetched(t0, got);
                    free -= got as u32;
                    left -= got;
                }
                // No free slot: the loop waits for a task's end, which never comes here.
                Action::Fetch => return (fetches, Action::Fetch),
                wait => return (fetches, wait),
            }
            assert!(fetches.len() <= 1000, "the policy spins: {fetches:?}");
        }
    }

    #[test]
    fn a_run_of_partial_answers_ends_within_the_free_slots() {
        // The queue has work, the engine answers 2 at a time: 4 fetches fill 8 slots, then
        // the loop waits for a task's end (no fetch with no free slot).
        let (fetches, after) = fill(8, 160, 2);
        assert_eq!(fetches, vec![(8, 2), (6, 2), (4, 2), (2, 2)]);
        assert_eq!(
            after,
            Action::Fetch,
            "waits for a free slot, not a poll interval"
        );
        // A queue that really has fewer tasks than slots: 2, then 1, then an empty answer,
        // which may be contention right after tasks: a short pause (the draw here is 0.0,
        // half of the 25 ms), not a fetch at once. No hot loop (the pauses that follow back
        // off to the poll interval: `repeated_empty_answers_back_off_to_the_poll_interval`).
        let (fetches, after) = fill(8, 3, 2);
        assert_eq!(fetches, vec![(8, 2), (6, 1), (5, 0)]);
        let t0 = Instant::now();
        assert!(
            matches!(after, Action::WaitUntil(at) if at >= t0 + ms(12)),
            "{after:?}"
        );
        // Whatever the queue and the cap: at most one fetch per free slot, plus the empty one.
        for slots in [1, 4, 8, 50] {
            for queue in [0, 1, 3, 7, 100] {
                for cap in [1, 2, 5, 50] {
                    let (fetches, _) = fill(slots, queue, cap);
                    assert!(
                        fetches.len() as u32 <= slots + 1,
                        "{slots} {queue} {cap}: {fetches:?}"
                    );
                }
            }
        }
    }

    /// Drives the policy through `answers` (tasks got per fetch), each fetch sent when the
    /// policy says (it takes no time here); returns the waits it chose after each answer.
    fn waits_after(random: f64, poll: Duration, answers: &[usize]) -> Vec<Duration> {
        let mut s = settings();
        s.poll_interval = poll;
        let t0 = Instant::now();
        let mut p = FetchPolicy::new(&s, t0, Box::new(move || random));
        let mut now = t0;
        let mut waits = Vec::new();
        for &got in answers {
            assert_eq!(p.next(now), Action::Fetch, "{answers:?}");
            p.fetched(now, got);
            match p.next(now) {
                Action::WaitUntil(at) => {
                    waits.push(at - now);
                    now = at;
                }
                Action::Fetch => waits.push(Duration::ZERO),
                Action::Probe => panic!("a probe without an error"),
            }
        }
        waits
    }

    /// An empty answer right after a full or partial one is contention (another worker's fetch
    /// held the rows), not an empty queue: fetch again after a short pause, jittered between
    /// half and all of 25 ms, not after the poll interval.
    #[test]
    fn an_empty_answer_right_after_tasks_fetches_again_after_a_short_jittered_pause() {
        for (random, pause) in [(0.0, 12_500), (0.5, 18_750), (1.0, 25_000)] {
            // After a full answer (8 of 8) and after a partial one (3 of 8).
            for got in [8, 3] {
                let waits = waits_after(random, SECOND, &[got, 0]);
                assert_eq!(
                    waits,
                    vec![Duration::ZERO, Duration::from_micros(pause)],
                    "{random} {got}"
                );
            }
        }
        // The worker's first answer, empty, may be contention too: a replica starting beside
        // busy ones meets their locks first.
        assert_eq!(waits_after(0.0, SECOND, &[0]), vec![ms(12) + ms(1) / 2]);
    }

    /// Empty answers in a row back off: each pause doubles, for as long as the pauses together
    /// fit in one poll interval; then the poll interval, and the run is over.
    #[test]
    fn repeated_empty_answers_back_off_to_the_poll_interval() {
        let empties = [4, 0, 0, 0, 0, 0, 0, 0, 0];
        // The draw at 1.0: the whole nominal pause; the poll interval stretched by 2 %.
        assert_eq!(
            waits_after(1.0, SECOND, &empties),
            [0, 25, 50, 100, 200, 400, 1020, 1020, 1020].map(ms)
        );
        // The draw at 0.0: half of each pause; the poll interval as it is.
        assert_eq!(
            waits_after(0.0, SECOND, &empties),
            [
                0, 12_500, 25_000, 50_000, 100_000, 200_000, 1_000_000, 1_000_000, 1_000_000
            ]
            .map(Duration::from_micros)
        );
        // A longer poll interval allows more pauses, still within one interval (25..3200 ms
        // make 6375 ms of 10 s); a shorter one fewer (25 + 50 of 100 ms), and none when the
        // first pause does not fit.
        let long = waits_after(
            1.0,
            Duration::from_secs(10),
            &[[1].as_slice(), &[0; 10]].concat(),
        );
        assert_eq!(
            long[1..],
            [25, 50, 100, 200, 400, 800, 1600, 3200, 10_200, 10_200].map(ms)
        );
        assert_eq!(
            waits_after(1.0, ms(100), &[1, 0, 0, 0, 0]),
            [0, 25, 50, 102, 102].map(ms)
        );
        assert_eq!(
            waits_after(1.0, ms(20), &[1, 0, 0]),
            [0, 20_400, 20_400].map(Duration::from_micros)
        );
        // Tasks again start a new run from 25 ms.
        assert_eq!(
            waits_after(1.0, SECOND, &[2, 0, 0, 1, 0]),
            [0, 25, 50, 0, 25].map(ms)
        );
        // So do the worker's first empty answers.
        assert_eq!(
            waits_after(1.0, SECOND, &[0; 7]),
            [25, 50, 100, 200, 400, 1020, 1020].map(ms)
        );
    }

    /// An idle queue is asked at most once per poll interval, as before, but for a few quick
    /// fetches when the worker starts; a queue that empties costs a few more fetches too, all
    /// within one poll interval of the last answer with tasks.
    #[test]
    fn an_idle_queue_is_still_asked_about_once_per_poll_interval() {
        for random in [0.0, 0.5, 1.0] {
            // Never a task, and a queue that empties after an answer with tasks: the fetches
            // in the minute after the start (or that answer) are the minute's 60 plus at most
            // the 5 contention retries, and those 5 come within one poll interval of it.
            for answers in [vec![0; 100], [[8].as_slice(), &[0; 100]].concat()] {
                let waits = waits_after(random, SECOND, &answers);
                let mut at = Duration::ZERO;
                let mut fetches = vec![at];
                for w in &waits {
                    at += *w;
                    fetches.push(at);
                }
                let in_minute = fetches
                    .iter()
                    .filter(|t| **t <= Duration::from_secs(60))
                    .count();
                assert!(in_minute <= 60 + 5 + 1, "{random}: {in_minute}");
                let soon = fetches.iter().filter(|t| **t < SECOND).count();
                assert!(soon <= 7, "{random}: {fetches:?}");
                assert!(
                    fetches.windows(2).skip(7).all(|w| w[1] - w[0] >= SECOND),
                    "{random}: {fetches:?}"
                );
            }
        }
    }

    /// A task's end during a contention pause fetches at once, as during the idle wait; the
    /// run of empties goes on (the next pause is the doubled one). A failed fetch ends it.
    #[test]
    fn a_task_end_cuts_a_contention_pause_short_and_an_error_ends_the_run() {
        let (mut p, t0) = policy(1.0);
        p.fetched(t0, 8);
        p.fetched(t0, 0);
        assert_eq!(p.next(t0), Action::WaitUntil(t0 + ms(25)));
        p.task_ended(t0 + ms(5));
        assert_eq!(p.next(t0 + ms(5)), Action::Fetch);
        p.fetched(t0 + ms(6), 0);
        assert_eq!(p.next(t0 + ms(6)), Action::WaitUntil(t0 + ms(56)));
        // An error: backoff; the next empty answer is no longer right after tasks.
        p.fetch_failed(t0 + ms(60), &down());
        p.fetched(t0 + ms(2000), 0);
        assert_eq!(
            p.next(t0 + ms(2000)),
            Action::WaitUntil(t0 + ms(2000) + ms(1020))
        );
    }

    #[test]
    fn a_task_ending_during_the_idle_wait_fetches_at_once() {
        let (mut p, t0) = idle(0.5);
        p.fetched(t0, 0);
        let ended = t0 + ms(300);
        assert!(matches!(p.next(ended), Action::WaitUntil(_)));
        p.task_ended(ended);
        assert_eq!(p.next(ended), Action::Fetch);
        // And that fetch, empty again, waits a whole interval from its own answer.
        p.fetched(ended + ms(1), 0);
        assert_eq!(
            p.next(ended + ms(1)),
            Action::WaitUntil(ended + ms(1) + ms(1010))
        );
    }

    #[test]
    fn a_task_ending_during_a_backoff_keeps_the_backoff_and_the_probes() {
        for error in [down(), throttled(None), throttled(Some(ms(4000)))] {
            let (mut p, t0) = policy(1.0);
            let failed = p.fetch_failed(t0, &error);
            let before = p.next(t0 + ms(10));
            p.task_ended(t0 + ms(10));
            assert_eq!(p.next(t0 + ms(10)), before, "{error}");
            assert!(matches!(before, Action::WaitUntil(_)), "{error}");
            // Due when the backoff ends (a transient error's probe is due then too).
            assert!(
                !matches!(p.next(t0 + failed.wait), Action::WaitUntil(_)),
                "{error}"
            );
        }
        // The probes go on as before: a transient error is probed after one poll interval.
        let (mut p, t0) = policy(0.0);
        p.fetch_failed(t0, &down());
        p.fetch_failed(t0, &down());
        p.task_ended(t0 + ms(5));
        assert_eq!(p.next(t0 + ms(5)), Action::WaitUntil(t0 + SECOND));
        assert_eq!(p.next(t0 + SECOND), Action::Probe);
    }

    #[test]
    fn transient_errors_back_off_exponentially_never_shorter_than_nominal() {
        // Default error backoff: 1 s doubling, capped at 6 s, jitter 0.5 (up to +25 %).
        let nominal = [1000, 2000, 4000, 6000, 6000, 6000];
        for (random, stretch) in [(0.0, 1.0), (1.0, 1.25)] {
            let (mut p, t0) = policy(random);
            for (i, n) in nominal.iter().enumerate() {
                let failed = p.fetch_failed(t0, &down());
                assert_eq!(failed.failures, i as u32 + 1);
                assert_eq!(failed.wait, ms(*n).mul_f64(stretch), "failure {}", i + 1);
            }
        }
    }

    #[test]
    fn a_success_resets_the_streak() {
        let (mut p, t0) = policy(0.0);
        for _ in 0..4 {
            p.fetch_failed(t0, &down());
        }
        p.fetched(t0, 0);
        let failed = p.fetch_failed(t0, &down());
        assert_eq!(failed.failures, 1);
        assert_eq!(failed.wait, SECOND);
    }

    #[test]
    fn retry_after_is_honoured_and_capped_at_the_throttle_maximum() {
        let (mut p, t0) = policy(0.5);
        assert_eq!(
            p.fetch_failed(t0, &throttled(Some(ms(4500)))).wait,
            ms(4500)
        );
        assert_eq!(
            p.fetch_failed(t0, &throttled(Some(Duration::from_secs(3600))))
                .wait,
            Duration::from_secs(30),
            "capped at the throttle backoff's maximum"
        );
        assert_eq!(
            p.fetch_failed(t0, &throttled(Some(Duration::ZERO))).wait,
            Duration::ZERO
        );
    }

    #[test]
    fn throttling_and_refusals_use_the_throttle_backoff_and_are_not_probed() {
        let refusals = [
            throttled(None),
            EngineError::Unauthenticated {
                op: "fetch-and-lock",
                message: "token expired".into(),
            },
            EngineError::AccessDenied {
                op: "fetch-and-lock",
                message: "no worker:execute".into(),
            },
            EngineError::Auth {
                message: "issuer unreachable".into(),
                configuration: false,
            },
        ];
        for error in refusals {
            // Default throttle backoff: 2 s doubling, capped at 30 s; full jitter 0.5 with the
            // draw at 1.0 keeps the nominal delay.
            let (mut p, t0) = policy(1.0);
            let waits: Vec<Duration> = (0..6).map(|_| p.fetch_failed(t0, &error).wait).collect();
            let secs = |s: &[u64]| {
                s.iter()
                    .map(|&n| Duration::from_secs(n))
                    .collect::<Vec<_>>()
            };
            assert_eq!(waits, secs(&[2, 4, 8, 16, 30, 30]), "{error}");
            assert_eq!(
                p.next(t0 + SECOND),
                Action::WaitUntil(t0 + Duration::from_secs(30))
            );
            // Jitter may shorten a throttle backoff to half, never more.
            let (mut p, t0) = policy(0.0);
            assert_eq!(p.fetch_failed(t0, &error).wait, SECOND, "{error}");
        }
    }

    #[test]
    fn after_a_transient_error_the_engine_is_probed_once_per_poll_interval() {
        let (mut p, t0) = policy(0.0);
        for _ in 0..3 {
            p.fetch_failed(t0, &down());
        }
        // Backing off 4 s; probes every second meanwhile, the probe first when both are due.
        assert_eq!(p.next(t0), Action::WaitUntil(t0 + SECOND));
        let mut now = t0 + SECOND;
        for _ in 0..3 {
            assert_eq!(p.next(now), Action::Probe);
            assert!(!p.probed(now, ProbeOutcome::Unreachable));
            now += SECOND;
        }
        assert_eq!(p.next(now), Action::Probe, "due together: the probe first");
        assert!(!p.probed(now, ProbeOutcome::Unreachable));
        assert_eq!(p.next(now), Action::Fetch);
    }

    #[test]
    fn a_probe_that_gets_an_answer_ends_the_backoff() {
        let (mut p, t0) = policy(0.0);
        for _ in 0..5 {
            p.fetch_failed(t0, &down());
        }
        let now = t0 + SECOND;
        assert_eq!(p.next(now), Action::Probe);
        assert!(p.probed(now, ProbeOutcome::Reachable));
        assert_eq!(p.next(now), Action::Fetch);
    }

    #[test]
    fn an_engine_that_cannot_be_probed_is_waited_out() {
        let (mut p, t0) = policy(0.0);
        p.fetch_failed(t0, &down());
        p.fetch_failed(t0, &down());
        assert_eq!(p.next(t0 + SECOND), Action::Probe);
        assert!(!p.probed(t0 + SECOND, ProbeOutcome::NotSupported));
        assert_eq!(
            p.next(t0 + SECOND),
            Action::WaitUntil(t0 + Duration::from_secs(2))
        );
    }

    #[test]
    fn a_repeated_error_is_logged_at_debug_and_recovery_is_said_once() {
        let (mut p, t0) = policy(0.0);
        assert!(!p.fetched(t0, 0), "nothing to recover from");
        assert_eq!(p.fetch_failed(t0, &down()).log_at, LogLevel::Warn);
        assert_eq!(p.fetch_failed(t0, &down()).log_at, LogLevel::Debug);
        assert_eq!(p.fetch_failed(t0, &throttled(None)).log_at, LogLevel::Warn);
        assert_eq!(p.fetch_failed(t0, &down()).log_at, LogLevel::Warn);
        assert!(p.fetched(t0, 0), "works again");
        assert!(!p.fetched(t0, 0), "said once");
        assert_eq!(
            p.fetch_failed(t0, &down()).log_at,
            LogLevel::Warn,
            "a new outage is news"
        );
    }

    /// Drives the policy like the loop does through an outage from `t0` until the engine
    /// returns at `back` (a fetch started before then fails after `LATENCY`); returns the
    /// instants at which fetches started, and whether each succeeded.
    fn outage(random: f64, probes: bool, back: Duration, until: Duration) -> Vec<(Duration, bool)> {
        let (mut p, t0) = policy(random);
        let mut now = t0;
        let mut fetches = Vec::new();
        while now < t0 + until {
            match p.next(now) {
                Action::WaitUntil(at) => now = at,
                Action::Probe => {
                    let outcome = match (probes, now >= t0 + back) {
                        (false, _) => ProbeOutcome::NotSupported,
                        (true, false) => ProbeOutcome::Unreachable,
                        (true, true) => ProbeOutcome::Reachable,
                    };
                    p.probed(now, outcome);
                }
                Action::Fetch => {
                    let ok = now >= t0 + back;
                    fetches.push((now - t0, ok));
                    now += LATENCY;
                    if ok {
                        p.fetched(now, 0);
                    } else {
                        p.fetch_failed(now, &down());
                    }
                }
            }
        }
        fetches
    }

    /// How long a fetch takes in [`outage`].
    const LATENCY: Duration = Duration::from_millis(1);

    #[test]
    fn a_sixty_second_outage_sees_at_most_twelve_fetches_with_the_default_backoff() {
        let minute = Duration::from_secs(60);
        for random in [0.0, 0.5, 1.0] {
            for probes in [true, false] {
                let fetches = outage(random, probes, minute, minute).len();
                assert!(
                    fetches <= 12,
                    "{fetches} fetches (random {random}, probes {probes})"
                );
                assert!(fetches >= 9, "still trying: {fetches}");
            }
        }
    }

    #[test]
    fn fetching_resumes_within_one_poll_interval_of_the_engines_return() {
        let poll = settings().poll_interval;
        for back_ms in [1, 999, 1_000, 5_500, 37_300, 59_999] {
            let back = ms(back_ms);
            for random in [0.0, 0.5, 1.0] {
                let fetches = outage(random, true, back, Duration::from_secs(90));
                let (first, _) = fetches.iter().find(|(_, ok)| *ok).expect("fetching again");
                // The probe period restarts when a failed fetch returns, hence its latency.
                assert!(
                    *first <= back + poll + LATENCY,
                    "engine back at {back:?}, first fetch at {first:?} (random {random})"
                );
            }
        }
    }

    #[test]
    fn without_probes_the_backoff_is_served_in_full() {
        // Back at 4.5 s: failed fetches at 0, 1, 3 s (plus latency); the next is at about 7 s.
        let fetches = outage(0.0, false, ms(4_500), Duration::from_secs(10));
        let first = fetches.iter().find(|(_, ok)| *ok).unwrap().0;
        assert!(first >= Duration::from_secs(7), "{fetches:?}");
    }
}
