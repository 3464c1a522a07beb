//! The per-model circuit, shared by every task of the worker: whether a model is unavailable
//! for everyone now, as opposed to failing one request.
//!
//! The circuit is for outages. A 429 is a rate limit, not an outage: it never opens the
//! circuit; the model's pacer ([`super::pacer`]) slows down and holds the model instead, and a
//! task waits its turn within its wait.
//!
//! What opens a model's circuit, from the calls of any task:
//! - the provider says it is overloaded (503, 529, "overloaded", no free concurrency slot):
//!   open for its `Retry-After` (at least [`CircuitPolicy::min_open`], at most
//!   [`CircuitPolicy::max_open`]), or for `open_for` when it gave none (the retry policy's
//!   `unavailable_default`, given with each record);
//! - the provider cannot be reached (the connection failed): open for `open_for`;
//! - failed calls (other 5xx, timeouts) from [`CircuitPolicy::failing_requesters`] distinct
//!   requesters (tasks) in a row, with no answer between: open for `open_for`. One request that
//!   fails every time, however often, is one requester: it never opens the circuit alone.
//!
//! What closes it: an answer to any task. A refusal of a request (a 4xx, a context overflow)
//! proves the model is serving: it ends the streak of failures, but not a wait the provider
//! asked for. Once its open period is over, calls go through again and their outcome decides
//! (a failure with the streak still unbroken, or another busy answer, opens it again at once).
//!
//! A deferral (a `failure` that keeps the task's retries) is for a model open here, never for
//! one request's failure: `fallback` asks [`ModelCircuits::open_until`].
//!
//! The state machine is pure: every operation takes the instant (`tokio::time::Instant`, so the
//! paused clock drives the tests). Memory is bounded: a model with nothing against it has no
//! entry, the requesters of a streak are kept as at most `failing_requesters` hashes, and at most
//! [`CircuitPolicy::max_models`] models are tracked (past that a new model is not tracked:
//! treated as closed, the safe side for a deferral that keeps retries).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::{ModelRef, ProviderError};

/// When a model's circuit opens and for how long.
#[derive(Clone, Debug)]
pub struct CircuitPolicy {
    /// Distinct requesters whose calls failed in a row (no answer to anyone between) that open
    /// the circuit.
    pub(crate) failing_requesters: usize,
    /// The shortest open period (a `Retry-After: 0` still holds the model this long).
    pub(crate) min_open: Duration,
    /// The longest: a provider's `Retry-After` is outside input, and cannot hold a model open
    /// (and its tasks deferred) for longer.
    pub(crate) max_open: Duration,
    /// Models tracked at most.
    pub(crate) max_models: usize,
}

impl Default for CircuitPolicy {
    fn default() -> Self {
        CircuitPolicy {
            failing_requesters: 3,
            min_open: Duration::from_secs(1),
            max_open: Duration::from_secs(600),
            max_models: 1024,
        }
    }
}

/// What one call says about its model's availability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// The model answered.
    Answered,
    /// The model refused this request (a 4xx, the context too long): it is serving.
    Refused,
    /// The provider is overloaded (503, 529, overloaded, no concurrency slot), for
    /// `retry_after` if it said.
    Busy { retry_after: Option<Duration> },
    /// The provider could not be reached (the connection failed).
    Unreachable,
    /// The call failed otherwise (another 5xx, a timeout): one requester's failure.
    Failed,
    /// Says nothing about the model's availability (a 429, a malformed or oversized answer, a
    /// local setup error).
    Neutral,
}

impl Signal {
    /// What a call's failure says.
    pub fn of(error: &ProviderError) -> Signal {
        match error {
            // A rate limit: the pacer's, never an outage.
            ProviderError::Unavailable {
                status: Some(429), ..
            } => Signal::Neutral,
            ProviderError::Unavailable { retry_after, .. } => Signal::Busy {
                retry_after: *retry_after,
            },
            ProviderError::Transient { connect: true, .. } => Signal::Unreachable,
            ProviderError::Transient { .. } => Signal::Failed,
            ProviderError::Rejected { .. } | ProviderError::ContextTooLong { .. } => {
                Signal::Refused
            }
            ProviderError::Malformed { .. }
            | ProviderError::TooLarge { .. }
            | ProviderError::Setup { .. } => Signal::Neutral,
        }
    }
}

/// How a recorded call changed the model's circuit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    None,
    /// Now open until this instant (it was closed, or its open period was over).
    Opened {
        until: Instant,
    },
    /// An answer closed a circuit that had something against it.
    Closed,
}

/// One model's circuit. No entry at all is a closed circuit with nothing against it.
#[derive(Clone, Debug, Default)]
struct ModelState {
    open_until: Option<Instant>,
    /// Hashes of the distinct requesters whose calls failed since the last answer.
    failing: Vec<u64>,
}

impl ModelState {
    fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|until| until > now)
    }

    fn is_empty(&self, now: Instant) -> bool {
        !self.is_open(now) && self.failing.is_empty()
    }

    fn open(&mut self, now: Instant, period: Duration) -> Change {
        let was_open = self.is_open(now);
        let until = now + period;
        // A longer wait already asked for stands.
        let until = self.open_until.filter(|u| *u > until).unwrap_or(until);
        self.open_until = Some(until);
        if was_open {
            Change::None
        } else {
            Change::Opened { until }
        }
    }

    /// The pure transition: `signal` from a call of `requester` at `now`.
    fn record(
        &mut self,
        policy: &CircuitPolicy,
        requester: u64,
        signal: Signal,
        now: Instant,
        open_for: Duration,
    ) -> Change {
        match signal {
            Signal::Answered => {
                let had_something = !self.is_empty(now);
                *self = ModelState::default();
                if had_something {
                    Change::Closed
                } else {
                    Change::None
                }
            }
            Signal::Refused => {
                self.failing.clear();
                Change::None
            }
            Signal::Busy { retry_after } => {
                let period = retry_after
                    .unwrap_or(open_for)
                    .clamp(policy.min_open, policy.max_open.max(policy.min_open));
                self.open(now, period)
            }
            Signal::Unreachable => self.open(now, open_for.max(policy.min_open)),
            Signal::Failed => {
                if !self.failing.contains(&requester) {
                    if self.failing.len() >= policy.failing_requesters.max(1) {
                        self.failing.remove(0);
                    }
                    self.failing.push(requester);
                }
                if self.failing.len() >= policy.failing_requesters.max(1) {
                    self.open(now, open_for.max(policy.min_open))
                } else {
                    Change::None
                }
            }
            Signal::Neutral => Change::None,
        }
    }
}

/// Every model's circuit, shared by the tasks of the worker (held by the provider registry).
#[derive(Debug, Default)]
pub struct ModelCircuits {
    policy: CircuitPolicy,
    models: Mutex<HashMap<ModelRef, ModelState>>,
}

impl ModelCircuits {
    pub fn new(policy: CircuitPolicy) -> Self {
        ModelCircuits {
            policy,
            models: Mutex::new(HashMap::new()),
        }
    }

    pub fn policy(&self) -> &CircuitPolicy {
        &self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ModelRef, ModelState>> {
        // Every transition leaves the map consistent: a panic elsewhere cannot poison it badly.
        self.models.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Until when `model` is unavailable for everyone; `None` when its circuit is closed.
    pub fn open_until(&self, model: &ModelRef, now: Instant) -> Option<Instant> {
        self.lock()
            .get(model)
            .and_then(|s| s.open_until.filter(|until| *until > now))
    }

    /// Records what a call of `requester` (the task it was made for) said about `model`; a
    /// circuit that opens without a `Retry-After` to go by stays open for `open_for`.
    pub fn record(
        &self,
        model: &ModelRef,
        requester: &str,
        signal: Signal,
        now: Instant,
        open_for: Duration,
    ) -> Change {
        let requester = requester_hash(requester);
        let mut models = self.lock();
        if let Some(state) = models.get_mut(model) {
            let change = state.record(&self.policy, requester, signal, now, open_for);
            if state.is_empty(now) {
                models.remove(model);
            }
            return change;
        }
        let mut state = ModelState::default();
        let change = state.record(&self.policy, requester, signal, now, open_for);
        if state.is_empty(now) {
            return change;
        }
        if models.len() >= self.policy.max_models {
            models.retain(|_, s| s.is_open(now));
        }
        if models.len() >= self.policy.max_models {
            tracing::debug!(model = %model, "too many models with failures to track; this one is treated as available");
            return Change::None;
        }
        models.insert(model.clone(), state);
        change
    }

    /// How many models have something against them (tests and the circuit gauge).
    pub fn tracked(&self) -> usize {
        self.lock().len()
    }
}

fn requester_hash(requester: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    requester.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> ModelRef {
        ModelRef::parse(&format!("p/{name}")).unwrap()
    }

    fn policy() -> CircuitPolicy {
        CircuitPolicy {
            failing_requesters: 3,
            min_open: Duration::from_secs(1),
            max_open: Duration::from_secs(600),
            max_models: 4,
        }
    }

    const S: fn(u64) -> Duration = Duration::from_secs;
    /// The retry policy's `unavailable_default` in these tests.
    const OPEN: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn one_request_failing_again_and_again_never_opens_the_circuit() {
        let c = ModelCircuits::new(policy());
        let m = model("a");
        for _ in 0..50 {
            let change = c.record(&m, "poison", Signal::Failed, Instant::now(), OPEN);
            assert_eq!(change, Change::None);
            assert_eq!(c.open_until(&m, Instant::now()), None);
            tokio::time::advance(S(1)).await;
        }
        // Another task's failure makes two requesters: still short of three.
        c.record(&m, "other", Signal::Failed, Instant::now(), OPEN);
        assert_eq!(c.open_until(&m, Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_of_distinct_tasks_in_a_row_open_it_and_an_answer_closes_it() {
        let c = ModelCircuits::new(policy());
        let m = model("a");
        let now = Instant::now();
        c.record(&m, "t1", Signal::Failed, now, OPEN);
        c.record(&m, "t2", Signal::Failed, now, OPEN);
        assert_eq!(
            c.record(&m, "t3", Signal::Failed, now, OPEN),
            Change::Opened { until: now + S(30) }
        );
        assert_eq!(c.open_until(&m, now + S(29)), Some(now + S(30)));
        assert_eq!(
            c.open_until(&m, now + S(30)),
            None,
            "open for open_for only"
        );
        // Past its period, a failure with the streak unbroken opens it again at once.
        let later = now + S(31);
        assert_eq!(
            c.record(&m, "t1", Signal::Failed, later, OPEN),
            Change::Opened {
                until: later + S(30)
            }
        );
        // An answer to any task closes it and forgets the streak.
        assert_eq!(
            c.record(&m, "t9", Signal::Answered, later, OPEN),
            Change::Closed
        );
        assert_eq!(c.open_until(&m, later), None);
        assert_eq!(c.tracked(), 0);
        c.record(&m, "t1", Signal::Failed, later, OPEN);
        c.record(&m, "t2", Signal::Failed, later, OPEN);
        assert_eq!(
            c.open_until(&m, later),
            None,
            "a new streak starts from zero"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_between_failures_breaks_the_streak() {
        let c = ModelCircuits::new(policy());
        let m = model("a");
        let now = Instant::now();
        for round in 0..10 {
            c.record(
                &m,
                &format!("poison{}", round % 2),
                Signal::Failed,
                now,
                OPEN,
            );
            c.record(&m, "healthy", Signal::Answered, now, OPEN);
            c.record(&m, "poison2", Signal::Failed, now, OPEN);
            c.record(&m, "healthy", Signal::Refused, now, OPEN);
        }
        assert_eq!(c.open_until(&m, now), None);
    }

    #[tokio::test(start_paused = true)]
    async fn busy_opens_for_the_retry_after_within_bounds_and_keeps_the_longer_wait() {
        let c = ModelCircuits::new(policy());
        let m = model("a");
        let now = Instant::now();
        let busy = |s: u64| Signal::Busy {
            retry_after: Some(S(s)),
        };
        assert_eq!(
            c.record(&m, "t", busy(5), now, OPEN),
            Change::Opened { until: now + S(5) }
        );
        // A shorter wait does not cut the longer one short.
        assert_eq!(c.record(&m, "u", busy(2), now, OPEN), Change::None);
        assert_eq!(c.open_until(&m, now), Some(now + S(5)));
        // A refusal proves it serves, but the wait the provider asked for stands.
        c.record(&m, "u", Signal::Refused, now, OPEN);
        assert_eq!(c.open_until(&m, now), Some(now + S(5)));
        // A hostile Retry-After holds a model for max_open at most; 0 for min_open at least.
        let n = model("b");
        c.record(&n, "t", busy(1_000_000_000), now, OPEN);
        assert_eq!(c.open_until(&n, now), Some(now + S(600)));
        let z = model("c");
        c.record(&z, "t", busy(0), now, OPEN);
        assert_eq!(c.open_until(&z, now), Some(now + S(1)));
        // Without a Retry-After: open_for.
        let d = model("d");
        c.record(&d, "t", Signal::Busy { retry_after: None }, now, OPEN);
        assert_eq!(c.open_until(&d, now), Some(now + S(30)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_provider_opens_at_once_and_neutral_signals_change_nothing() {
        let c = ModelCircuits::new(policy());
        let m = model("a");
        let now = Instant::now();
        assert_eq!(c.record(&m, "t", Signal::Neutral, now, OPEN), Change::None);
        assert_eq!(c.tracked(), 0, "nothing against it: no entry");
        assert_eq!(
            c.record(&m, "t", Signal::Unreachable, now, OPEN),
            Change::Opened { until: now + S(30) }
        );
        // Other models are not touched.
        assert_eq!(c.open_until(&model("b"), now), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_number_of_models_tracked_is_bounded() {
        let c = ModelCircuits::new(policy());
        let now = Instant::now();
        for i in 0..100 {
            c.record(
                &model(&format!("m{i}")),
                "t",
                Signal::Unreachable,
                now,
                OPEN,
            );
        }
        assert_eq!(c.tracked(), 4);
        // Untracked: treated as available.
        assert_eq!(c.open_until(&model("m99"), now), None);
        // Once the tracked ones are past their period, new ones take their place.
        let later = now + S(31);
        c.record(&model("fresh"), "t", Signal::Unreachable, later, OPEN);
        assert_eq!(c.open_until(&model("fresh"), later), Some(later + S(30)));
        assert!(c.tracked() <= 4);
    }
}
