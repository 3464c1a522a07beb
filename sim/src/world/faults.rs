//! The faults the simulator injects into the world: what a seeded schedule decided up front
//! (engine outage and hang windows, run-store outage windows, freeze windows) and the odds of
//! the per-call faults drawn from the world's seeded source (slowness, 5xx, 409, refusals,
//! answers lost, model 429 and 5xx, run-store slowness and lost answers). Every fault
//! stops at [`FaultPlan::quiet_at`], so the check that every task ends has a start.

use std::collections::BTreeMap;
use std::time::Duration;

/// A span of the world's time, in milliseconds since it began: `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start: u64,
    pub end: u64,
}

impl Window {
    pub fn contains(&self, at: u64) -> bool {
        (self.start..self.end).contains(&at)
    }
}

/// What a seed's schedule injects.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// No per-call fault is drawn from this time on (windows end before it).
    pub(crate) quiet_at: u64,
    /// The engine answers nothing (connection refused) during these.
    pub(crate) engine_outages: Vec<Window>,
    /// The engine accepts calls and answers none during these, as when its request threads are
    /// stuck: a call made in one is held to the window's end and then fails as a request sent
    /// without an answer (the HTTP client's timeouts and retries outlasted); nothing it asked
    /// is done. A worker must lose its leases at their local expiry meanwhile, reporting ones
    /// included, and fetch again after.
    pub(crate) engine_hangs: Vec<Window>,
    /// Odds per engine call of: a delay of up to `engine_slow_max`, a 5xx without executing,
    /// a 409 `CONCURRENT_MODIFICATION`, an executed call whose answer is lost.
    pub(crate) engine_slow: f64,
    pub(crate) engine_slow_max: Duration,
    pub(crate) engine_5xx: f64,
    pub(crate) engine_409: f64,
    pub(crate) engine_answer_lost: f64,
    /// Odds per engine call of an answer that comes late: executed at once, its answer held up
    /// to `engine_late_max` on the way back (a report accepted while the worker still waits,
    /// and meanwhile the task offered again after its retry timeout).
    pub(crate) engine_answer_late: f64,
    pub(crate) engine_late_max: Duration,
    /// Odds per heartbeat, journal call or completion of a refusal the engine's state does not
    /// back (403 `WORKER_LOCK_NOT_OWNED`, 409 `STALE_ATTEMPT`): the worker must stop, the task
    /// expires and is fetched again.
    pub refused: f64,
    /// The engine's clock steps forward by `.1` ms at `.0` (an NTP step on the engine's host):
    /// leases expire there before the workers' own clocks say so, past their safety margin.
    pub engine_clock_jump: Option<(u64, u64)>,
    /// Odds per model call of a 429, a 5xx, a delay of up to `model_slow_max`.
    pub model_429: f64,
    pub(crate) model_5xx: f64,
    pub(crate) model_slow: f64,
    pub(crate) model_slow_max: Duration,
    /// Odds per model call of a long generation: one to two lock durations (the task's
    /// heartbeats keep its lease meanwhile; a visit's run it holds goes silent past the hold).
    pub(crate) model_stall: f64,
    /// Odds per tool call of a 5xx, a delay of up to `tool_slow_max`, and (writes) of the write
    /// applied with its answer lost.
    pub(crate) tool_5xx: f64,
    pub(crate) tool_slow: f64,
    pub(crate) tool_slow_max: Duration,
    pub(crate) tool_answer_lost: f64,
    /// The run store answers nothing (connection refused) during these.
    pub(crate) store_outages: Vec<Window>,
    /// Odds per run-store call of a delay of up to `store_slow_max`, and of a call executed
    /// (committed) whose answer is lost.
    pub(crate) store_slow: f64,
    pub(crate) store_slow_max: Duration,
    pub(crate) store_answer_lost: f64,
    /// The world's model answers under this provider limit, one quota for every worker
    /// (`provider_limit`); `None`: no limit.
    pub provider_limit: Option<super::provider_limit::ProviderLimitPlan>,
    /// Each fetch's transaction at the engine lasts this long, locking every candidate row, so
    /// that a fetch meanwhile answers empty (the real engine on H2:
    /// `abada_devkit::engine::contention`); `None`: fetches never overlap.
    pub fetch_contention: Option<Duration>,
    /// Per worker id: when its calls (engine and model) are held, as in a process paused by
    /// the OS or a long GC; a call sent before the window arrives after it.
    pub freezes: BTreeMap<String, Vec<Window>>,
}

/// Every kind of fault the world injects, as the report counts them: the fifty-seed test
/// requires each to have been drawn.
pub const KINDS: &[&str] = &[
    "engine outage",
    "engine hang",
    "engine slow",
    "engine 5xx",
    "engine 409",
    "engine answer lost",
    "engine answer late",
    "engine clock step",
    "refused",
    "model 429",
    "model limit 429",
    "model hostile header",
    "model 5xx",
    "model slow",
    "model stall",
    "model long generation",
    "model off-schema answer",
    "model cut answer",
    "model text tool call",
    "tool 5xx",
    "tool slow",
    "tool write answer lost",
    "store outage",
    "store slow",
    "store answer lost",
    "worker freeze",
    "worker kill",
    "redeploy",
    "agents file or registry changed",
    "run left by the previous release",
];

/// The live fault state: the plan, and counts of what was injected (for the report).
#[derive(Debug)]
pub struct Faults {
    pub plan: FaultPlan,
    /// Workers the schedule killed: their calls never return (a dead process sends nothing).
    pub killed: std::collections::BTreeSet<String>,
    pub injected: BTreeMap<&'static str, u64>,
}

impl Faults {
    pub fn new(plan: FaultPlan) -> Self {
        Faults {
            plan,
            killed: Default::default(),
            injected: BTreeMap::new(),
        }
    }

    /// Counts one injected fault of kind `what` (one of [`KINDS`]).
    pub fn count(&mut self, what: &'static str) {
        debug_assert!(KINDS.contains(&what), "fault kind {what:?} is not in KINDS");
        *self.injected.entry(what).or_default() += 1;
    }

    /// Whether faults may still be drawn at `at`.
    pub fn active(&self, at: u64) -> bool {
        at < self.plan.quiet_at
    }

    /// The end of the freeze of `worker` that holds `at`, if any.
    pub(crate) fn frozen_until(&self, worker: &str, at: u64) -> Option<u64> {
        self.plan
            .freezes
            .get(worker)?
            .iter()
            .find(|w| w.contains(at))
            .map(|w| w.end)
    }

    pub(crate) fn engine_down(&self, at: u64) -> bool {
        self.plan.engine_outages.iter().any(|w| w.contains(at))
    }

    /// The end of the engine hang that holds `at`, if any.
    pub(crate) fn engine_hung_until(&self, at: u64) -> Option<u64> {
        self.plan
            .engine_hangs
            .iter()
            .find(|w| w.contains(at))
            .map(|w| w.end)
    }

    pub(crate) fn store_down(&self, at: u64) -> bool {
        self.plan.store_outages.iter().any(|w| w.contains(at))
    }
}
