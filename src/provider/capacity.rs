//! Each model's capacity, shared by every task of the worker: what its provider states
//! ([`RateLimits::parse`]), the pacer that decides when its next call may start
//! ([`super::pacer`]), and what the runner may claim for it (admission).
//!
//! What it learns from:
//! - every answer's headers, success or not: OpenAI `x-ratelimit-{limit,remaining,reset}-
//!   {requests,tokens}`, the reset a Go duration (`1s`, `6m0s`, `20ms`); Anthropic
//!   `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`,
//!   the reset an RFC 3339 instant; a reset in plain seconds (`6`, as Azure-style gateways send)
//!   is read as seconds. These are figures: they pace calls, never hold a model;
//! - 429s and 503s ([`ModelCapacities::throttled`]), with their `retry-after-ms`/`retry-after`:
//!   the only answers that hold a model.
//!
//! A call waits for its turn inside its task ([`ModelCapacities::wait_turn`]), at most the
//! wait it has left; the pacer releases the waiting calls of a model one at a time.
//!
//! **Admission.** The runner asks, per topic it fetches, how many tasks could start now
//! ([`ModelCapacities::admission`]). A topic is gated only by the models its tasks were seen to
//! use ([`ModelCapacities::attribute`], learned from each task's definition, forgotten after
//! [`ATTRIBUTION_TTL`]): a topic whose models are not known is never gated, so a model held
//! stops the fetches of its own topics and of no other. Tasks claimed whose first call has not
//! joined its model's queue count against their topic's models until it does (or
//! [`CapacityPolicy::claim_ttl`] passes).
//!
//! **Many replicas, one quota.** With a [`SharedPace`] (the run store's PostgreSQL), a call the
//! pacer releases also reserves its start in the fleet's one queue of the model, spaced by the
//! pacer's increment, and waits for it (within the wait it has left): the replicas' calls are
//! then spaced as one worker's. A shared pace that fails or is slow is left alone for
//! [`SHARED_PAUSE`], the replica pacing from its own view meanwhile. A replica pacing from its
//! own view cannot tell its share of a quota enforced quantized (see [`super::pacer`],
//! "Replicas pacing alone"): the shared pace is how a fleet meets one quota.
//!
//! Everything here is outside input: a value that does not parse is ignored, numbers saturate,
//! every figure and hold expires within [`CapacityPolicy::max_wait`] (see [`super::pacer`]).
//! Memory is bounded: at most [`CapacityPolicy::max_models`] models, [`MAX_TOPICS`] topics of
//! [`MAX_MODELS_PER_TOPIC`] models each, and [`CapacityPolicy::max_starts`] claims.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::ModelRef;
pub use super::pacer::{CallCost, Held, HoldReason, Release};
use super::pacer::{Pacer, Turn, WaitReason};
pub use super::rate_limits::{Budget, Capacity, CapacityPolicy, RateLimits};

/// Topics remembered for admission, at most.
pub(crate) const MAX_TOPICS: usize = 256;
/// Models remembered per topic; a topic whose tasks use more is not gated at all.
pub(crate) const MAX_MODELS_PER_TOPIC: usize = 16;
/// How long a topic stays attributed to a model after a task of it last named the model.
pub(crate) const ATTRIBUTION_TTL: Duration = Duration::from_secs(600);

/// The models the tasks of one topic were seen to use.
#[derive(Debug, Default)]
struct TopicModels {
    /// Each model with when a task of the topic last named it.
    models: Vec<(ModelRef, Instant)>,
    /// More models than remembered were named: the topic cannot be attributed until then.
    overflow_until: Option<Instant>,
}

/// A task claimed whose first call has not joined its model's queue yet.
#[derive(Debug)]
struct Claim {
    topic: String,
    expires: Instant,
}

/// The start a call got in the fleet's shared pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedTurn {
    /// Reserved: start after this wait.
    In(Duration),
    /// Nothing reserved: the next start is this far off, later than the call may wait.
    Beyond(Duration),
}

/// What the replicas of a fleet share to pace the calls of a model as one queue: in production
/// the run store ([`crate::store::StoreHandle`], `store::pace`).
#[async_trait::async_trait]
pub trait SharedPace: Send + Sync {
    /// Reserves the next start of a call of `model` (`provider/model`), `spacing` after the
    /// one reserved before it by any replica, if it comes within `within`.
    async fn reserve(
        &self,
        model: &str,
        spacing: Duration,
        within: Duration,
    ) -> Result<SharedTurn, String>;
}

/// The longest a reservation in the shared pace may take; slower, the replica paces alone.
pub(crate) const SHARED_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a replica paces alone after the shared pace failed.
pub(crate) const SHARED_PAUSE: Duration = Duration::from_secs(10);
/// The spacing a probe asks of the shared pace when no pace is known yet (a model's first call
/// in each replica): replicas starting together probe one after another, not in a crowd.
pub(crate) const SHARED_PROBE_SPACING: Duration = Duration::from_secs(1);

/// Every model's capacity, shared by the tasks of the worker (held by the provider registry).
#[derive(Default)]
pub struct ModelCapacities {
    policy: CapacityPolicy,
    state: Mutex<State>,
    /// Woken whenever a pacer may let another call go (a release, an end, a call giving up).
    changed: Notify,
    /// The fleet's shared pace, when the replicas share one (set once, at start-up).
    shared: OnceLock<Arc<dyn SharedPace>>,
    /// When the shared pace last failed: left alone for [`SHARED_PAUSE`] after.
    shared_failed: Mutex<Option<Instant>>,
    /// Provider names that reach another's quota (the same kind, base URL and key): each
    /// paced as the name it maps to, so one quota has one pacer ([`ModelCapacities::quota`]).
    quota_names: HashMap<String, String>,
}

impl std::fmt::Debug for ModelCapacities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelCapacities")
            .field("policy", &self.policy)
            .field("shared", &self.shared.get().is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct State {
    models: HashMap<ModelRef, Pacer>,
    next_ticket: u64,
    /// By requester (the task).
    claims: HashMap<String, Claim>,
    topics: HashMap<String, TopicModels>,
}

/// A call released but waiting for its start in the shared pace; dropped before (its task
/// dropped) it ends the call in its pacer, so a probe cannot outlive it.
struct Starting<'a> {
    capacities: &'a ModelCapacities,
    model: &'a ModelRef,
    release: Release,
    armed: bool,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.capacities.ended(self.model, &self.release);
        }
    }
}

/// A call waiting in a model's queue; dropped before its turn (its task dropped, its wait
/// given up) it leaves the queue.
struct Waiting<'a> {
    capacities: &'a ModelCapacities,
    model: &'a ModelRef,
    ticket: u64,
    done: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.done {
            let left = self
                .capacities
                .lock()
                .models
                .get_mut(self.model)
                .is_some_and(|p| p.leave(self.ticket));
            if left {
                self.capacities.changed.notify_waiters();
            }
        }
    }
}

impl ModelCapacities {
    pub fn new(policy: CapacityPolicy) -> Self {
        ModelCapacities {
            policy,
            ..ModelCapacities::default()
        }
    }

    /// The capacities with the models of each provider name in `names` paced as the provider
    /// it maps to: names configured with the same kind, base URL and key reach one quota.
    pub fn with_quota_names(mut self, names: HashMap<String, String>) -> Self {
        self.quota_names = names;
        self
    }

    /// The model whose pacer paces `model`: itself, or the same model under the provider name
    /// that owns its quota.
    pub fn quota<'m>(&self, model: &'m ModelRef) -> Cow<'m, ModelRef> {
        match self.quota_names.get(&model.provider) {
            Some(owner) => Cow::Owned(ModelRef {
                provider: owner.clone(),
                model: model.model.clone(),
            }),
            None => Cow::Borrowed(model),
        }
    }

    /// Paces every model with the other replicas through `shared` from now on (once; a second
    /// call is ignored).
    pub fn share_pace(&self, shared: Arc<dyn SharedPace>) {
        let _ = self.shared.set(shared);
    }

    pub fn policy(&self) -> &CapacityPolicy {
        &self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every operation leaves the state consistent: a panic elsewhere cannot poison it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pacer of `model`, created (and the idle one unused longest forgotten when the table
    /// is full); `None` when every tracked model is busy and the table is full.
    fn entry<'a>(
        &self,
        state: &'a mut State,
        model: &ModelRef,
        now: Instant,
    ) -> Option<&'a mut Pacer> {
        if !state.models.contains_key(model) {
            if state.models.len() >= self.policy.max_models {
                let oldest = state
                    .models
                    .iter()
                    .filter(|(_, p)| p.idle(now))
                    .min_by_key(|(_, p)| p.last_used)
                    .map(|(m, _)| m.clone());
                if let Some(m) = oldest {
                    state.models.remove(&m);
                }
            }
            if state.models.len() >= self.policy.max_models {
                return None;
            }
            state.models.insert(model.clone(), Pacer::new(now));
        }
        let p = state.models.get_mut(model)?;
        p.last_used = now;
        Some(p)
    }

    /// What an answer of `model` stated, for a call sent at `sent` and answered at `now`.
    pub fn observe(&self, model: &ModelRef, sent: Instant, now: Instant, limits: &RateLimits) {
        if limits.is_empty() {
            return;
        }
        let model = &*self.quota(model);
        let mut state = self.lock();
        if let Some(p) = self.entry(&mut state, model, now) {
            p.observe(limits, sent, now, &self.policy);
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Waits for the turn of a call of `model` made for `requester`, expected to spend `cost`,
    /// at most `wait_left` (less what it waited, on return). `ticket`: the call's place from an
    /// earlier turn (a call retried after a 429 keeps it). Returns the release to give back when
    /// the call ends, or, when the provider's word (a hold, a stated figure without room) puts
    /// its turn after the wait it has left, or a probe's answer does not come within it, when
    /// it would.
    ///
    /// The worker's own estimates (the pace, the queue) never make a call give up: a call they
    /// put beyond its wait waits the wait out, and then goes alone ([`Pacer::poll_due`]).
    /// `yield_when_spent` false (the call may not wait here at all: a later model of the chain
    /// can take it now) keeps the stricter rule for the pace and the queue too: a wait beyond
    /// what is left is not begun.
    pub(crate) async fn wait_turn(
        &self,
        model: &ModelRef,
        requester: &str,
        cost: &CallCost,
        wait_left: &mut Duration,
        ticket: Option<u64>,
        yield_when_spent: bool,
    ) -> Result<Release, Instant> {
        let model = &*self.quota(model);
        let now = Instant::now();
        let ticket = {
            let mut state = self.lock();
            state.claims.remove(requester);
            let ticket = ticket.unwrap_or_else(|| {
                state.next_ticket += 1;
                state.next_ticket
            });
            match self.entry(&mut state, model, now) {
                Some(p) => p.enqueue(ticket),
                // Not tracked (the table is full of busy models): nothing bounds it.
                None => {
                    return Ok(Release {
                        at: now,
                        probe: false,
                        ticket,
                        spacing: Duration::ZERO,
                    });
                }
            }
            ticket
        };
        let mut waiting = Waiting {
            capacities: self,
            model,
            ticket,
            done: false,
        };
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let spent = wait_left.is_zero() && yield_when_spent;
            let turn = self.lock().models.get_mut(model).map(|p| {
                match p.poll(ticket, cost, now, &self.policy) {
                    // The pace or the queue alone keeps a call whose wait is spent: they yield.
                    Turn::Wait {
                        why: WaitReason::Pace | WaitReason::Queue,
                        ..
                    } if spent => p.poll_due(ticket, cost, now, &self.policy),
                    turn => turn,
                }
            });
            let (until, why) = match turn {
                None => {
                    waiting.done = true;
                    return Ok(Release {
                        at: now,
                        probe: false,
                        ticket,
                        spacing: Duration::ZERO,
                    });
                }
                Some(Turn::Go(release)) => {
                    waiting.done = true;
                    // The next in line computes its own turn now.
                    self.changed.notify_waiters();
                    return self.shared_start(model, release, wait_left).await;
                }
                Some(Turn::Wait { until, why }) => (until, why),
            };
            // Strictly: a wait the provider asks for (a hold, a stated figure without room)
            // longer than what is left is not begun; a probe's answer may come any moment, and
            // the pace and the queue yield when the wait is spent, so those are waited for
            // until it is.
            let wait = until.saturating_duration_since(now);
            let providers_word = matches!(why, WaitReason::Held(_) | WaitReason::Stated);
            let own_estimate = matches!(why, WaitReason::Pace | WaitReason::Queue);
            if wait_left.is_zero()
                || (providers_word && wait > *wait_left)
                || (!yield_when_spent && own_estimate && wait > *wait_left)
            {
                return Err(until);
            }
            let deadline = now + wait.min(*wait_left);
            // Biased: either branch only ends the wait (the turn is computed again), so the
            // order is for replayable runs, not for the outcome.
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
            *wait_left = wait_left.saturating_sub(Instant::now().saturating_duration_since(now));
        }
    }

    /// The start of a call the pacer released, in the fleet's shared pace when there is one
    /// (and the model has a pace): reserved and waited for, within `wait_left`.
    async fn shared_start(
        &self,
        model: &ModelRef,
        mut release: Release,
        wait_left: &mut Duration,
    ) -> Result<Release, Instant> {
        let Some(shared) = self.shared.get() else {
            return Ok(release);
        };
        let since = Instant::now();
        let paused = self
            .shared_failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at + SHARED_PAUSE > since);
        // A model with no pace is not paced together either, but its probes are.
        let spacing = match (release.spacing, release.probe) {
            (s, true) => s.max(SHARED_PROBE_SPACING),
            (s, false) => s,
        };
        if spacing.is_zero() || paused {
            return Ok(release);
        }
        let mut starting = Starting {
            capacities: self,
            model,
            release,
            armed: true,
        };
        let reserved = tokio::time::timeout(
            SHARED_TIMEOUT.min(*wait_left).max(Duration::from_millis(1)),
            shared.reserve(&model.to_string(), spacing, *wait_left),
        )
        .await;
        *wait_left = wait_left.saturating_sub(since.elapsed());
        match reserved {
            Ok(Ok(SharedTurn::In(wait))) => {
                let wait = wait.min(*wait_left);
                tokio::time::sleep(wait).await;
                *wait_left = wait_left.saturating_sub(wait);
                starting.armed = false;
                release.at = Instant::now();
                Ok(release)
            }
            Ok(Ok(SharedTurn::Beyond(wait))) => Err(Instant::now() + wait),
            failed => {
                let why = match failed {
                    Ok(Err(why)) => why,
                    _ => format!("no answer within {} ms", SHARED_TIMEOUT.as_millis()),
                };
                let first = self
                    .shared_failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .replace(Instant::now())
                    .is_none_or(|at| at + SHARED_PAUSE * 2 < Instant::now());
                if first {
                    tracing::warn!(model = %model, error = %why, pause_ms = SHARED_PAUSE.as_millis() as u64, "the fleet's shared pace of model calls failed; this replica paces alone meanwhile");
                } else {
                    tracing::debug!(model = %model, error = %why, "the fleet's shared pace failed again");
                }
                starting.armed = false;
                Ok(release)
            }
        }
    }

    /// The call of `release` was answered at `now`.
    pub(crate) fn answered(&self, model: &ModelRef, release: &Release, now: Instant) {
        if let Some(p) = self.lock().models.get_mut(&*self.quota(model)) {
            p.answered(release, now, &self.policy);
        }
        self.changed.notify_waiters();
    }

    /// The call of `release` was refused with `status` (429 or 503) at `now`, asking for
    /// `retry_after`: the pace drops, and a wait asked for holds the model (at most the model
    /// wait). Returns when the next call may start.
    pub(crate) fn throttled(
        &self,
        model: &ModelRef,
        release: &Release,
        status: u16,
        retry_after: Option<Duration>,
        now: Instant,
    ) -> Instant {
        let until = self
            .lock()
            .models
            .get_mut(&*self.quota(model))
            .map_or(now, |p| {
                p.throttled(release, status, retry_after, now, &self.policy)
            });
        self.changed.notify_waiters();
        until
    }

    /// The call of `release` ended otherwise: failed, or dropped before its answer.
    pub(crate) fn ended(&self, model: &ModelRef, release: &Release) {
        if let Some(p) = self.lock().models.get_mut(&*self.quota(model)) {
            p.ended(release);
        }
        self.changed.notify_waiters();
    }

    /// How many calls of `model` could start soon (within the admission horizon), beyond those
    /// waiting already.
    pub fn capacity(&self, model: &ModelRef, now: Instant) -> Capacity {
        self.lock()
            .models
            .get(&*self.quota(model))
            .map_or(Capacity::Unbounded, |p| p.capacity(0, now, &self.policy))
    }

    /// Until when the provider's word holds `model` ([`Pacer::provider_hold`]): what a
    /// deferral may say, never this worker's pace or queue.
    pub(crate) fn provider_hold(&self, model: &ModelRef, now: Instant) -> Option<Instant> {
        self.lock()
            .models
            .get(&*self.quota(model))
            .and_then(|p| p.provider_hold(now))
    }

    /// Whether `model`'s probe call is out, the others waiting for what it tells.
    pub fn probing(&self, model: &ModelRef) -> bool {
        let now = Instant::now();
        self.lock()
            .models
            .get(&*self.quota(model))
            .is_some_and(|p| p.probing(now, &self.policy))
    }

    /// A task of `topic` runs a definition naming `models`: the topic's fetches are gated by
    /// them (and by every other model its tasks named lately).
    pub fn attribute(&self, topic: &str, models: &[ModelRef], now: Instant) {
        let mut state = self.lock();
        if !state.topics.contains_key(topic) && state.topics.len() >= MAX_TOPICS {
            return;
        }
        let entry = state.topics.entry(topic.to_string()).or_default();
        entry
            .models
            .retain(|(_, seen)| *seen + ATTRIBUTION_TTL > now);
        for m in models {
            let m = &*self.quota(m);
            if let Some((_, seen)) = entry.models.iter_mut().find(|(known, _)| known == m) {
                *seen = now;
            } else if entry.models.len() < MAX_MODELS_PER_TOPIC {
                entry.models.push((m.clone(), now));
            } else {
                entry.overflow_until = Some(now + ATTRIBUTION_TTL);
            }
        }
    }

    /// The models a task of `topic` may use, if they are known: none known, or more than
    /// remembered, and the topic cannot be gated.
    fn topic_models(state: &State, topic: &str, now: Instant) -> Option<Vec<ModelRef>> {
        let entry = state.topics.get(topic)?;
        if entry.overflow_until.is_some_and(|u| u > now) {
            return None;
        }
        let models: Vec<ModelRef> = entry
            .models
            .iter()
            .filter(|(_, seen)| *seen + ATTRIBUTION_TTL > now)
            .map(|(m, _)| m.clone())
            .collect();
        (!models.is_empty()).then_some(models)
    }

    /// The runner claimed tasks (requester, topic) at `now`: each counts against its topic's
    /// models until its first call joins a queue (or `claim_ttl` passes), so the next fetch
    /// does not claim the same calls.
    pub fn claimed<'a>(&self, tasks: impl IntoIterator<Item = (&'a str, &'a str)>, now: Instant) {
        let mut state = self.lock();
        let expires = now + self.policy.claim_ttl;
        state.claims.retain(|_, c| c.expires > now);
        for (requester, topic) in tasks {
            if state.claims.len() >= self.policy.max_starts {
                break;
            }
            state.claims.insert(
                requester.to_string(),
                Claim {
                    topic: topic.to_string(),
                    expires,
                },
            );
        }
    }

    /// How many tasks of `topic` may be claimed at `now`: the sum of what its models can start
    /// soon, less the tasks claimed for them that have not called yet. `Unbounded` when the
    /// topic's models are not known, or one of them is not bounded.
    pub fn admission(&self, topic: &str, now: Instant) -> Capacity {
        let mut state = self.lock();
        state.claims.retain(|_, c| c.expires > now);
        let Some(models) = Self::topic_models(&state, topic, now) else {
            return Capacity::Unbounded;
        };
        let mut free = 0u64;
        let mut next: Option<Instant> = None;
        for m in &models {
            let Some(pacer) = state.models.get(m) else {
                return Capacity::Unbounded;
            };
            // Claims of every topic whose tasks may call this model.
            let pending = state
                .claims
                .values()
                .filter(|c| {
                    c.topic == topic
                        || Self::topic_models(&state, &c.topic, now)
                            .is_some_and(|ms| ms.contains(m))
                })
                .count() as u32;
            match pacer.capacity(pending, now, &self.policy) {
                Capacity::Unbounded => return Capacity::Unbounded,
                Capacity::Now(n) => free += u64::from(n),
                Capacity::Until(at) => next = Some(next.map_or(at, |x| x.min(at))),
            }
        }
        match free {
            0 => Capacity::Until(
                next.unwrap_or(now + self.policy.claim_ttl)
                    .max(now + Duration::from_millis(1)),
            ),
            n => Capacity::Now(n.min(u64::from(u32::MAX)) as u32),
        }
    }

    /// The models held at `now`, and why (`/readyz`, `abada_agent_models_held`).
    pub fn held(&self, now: Instant) -> Vec<(ModelRef, Held)> {
        let mut held: Vec<(ModelRef, Held)> = self
            .lock()
            .models
            .iter()
            .filter_map(|(m, p)| p.held(now, &self.policy).map(|h| (m.clone(), h)))
            .collect();
        held.sort_by_key(|a| a.0.to_string());
        held
    }

    /// How many models are tracked (tests).
    pub fn tracked(&self) -> usize {
        self.lock().models.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::rate_limits::tests::headers;
    use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
    use std::time::SystemTime;

    fn model(name: &str) -> ModelRef {
        ModelRef::parse(&format!("p/{name}")).unwrap()
    }

    const MAX: Duration = Duration::from_secs(60);
    const COST: CallCost = CallCost {
        input_tokens: 10,
        output_tokens: 10,
    };

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// OpenAI's figures for 120 requests a minute, one of them just taken: two a second.
    fn two_a_second() -> RateLimits {
        RateLimits {
            requests: Budget {
                limit: Some(120),
                remaining: Some(119),
                reset: Some(ms(500)),
            },
            ..RateLimits::default()
        }
    }

    /// Takes a turn with the whole model wait, as a call does.
    async fn turn(c: &ModelCapacities, m: &ModelRef, who: &str) -> Result<Release, Instant> {
        let mut left = c.policy().max_wait;
        c.wait_turn(m, who, &COST, &mut left, None, true).await
    }

    /// Each hostile figure, stated on a 200 (Azure's `-1` with a reset of `0`, unitless,
    /// huge, negative, NaN, absent, a limit of 0, `retry-after` on a 200): the next call of the
    /// model starts within the model wait, and one after it too; nothing holds it for ever.
    #[tokio::test(start_paused = true)]
    async fn each_hostile_figure_on_a_200_ends_within_the_model_wait() {
        let cases: &[&[(&str, &str)]] = &[
            &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "6"),
            ],
            &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "NaN"),
            ],
            &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "-3s"),
            ],
            &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "99999999h"),
            ],
            &[("x-ratelimit-remaining-requests", "0")],
            &[
                ("x-ratelimit-limit-requests", "-1"),
                ("x-ratelimit-remaining-requests", "-1"),
                ("x-ratelimit-reset-requests", "0"),
            ],
            &[
                ("x-ratelimit-limit-requests", "0"),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "1s"),
            ],
            &[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ],
            &[
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "9999-12-31T23:59:59Z"),
            ],
            &[
                ("anthropic-ratelimit-output-tokens-limit", "0"),
                ("anthropic-ratelimit-output-tokens-remaining", "0"),
            ],
            &[("retry-after", "86400"), ("retry-after-ms", "86400000")],
        ];
        let max_wait = Duration::from_secs(10);
        for case in cases {
            let c = ModelCapacities::new(CapacityPolicy::with_max_wait(max_wait));
            let m = model("a");
            let first = turn(&c, &m, "t0").await.expect("the first call goes");
            let now = Instant::now();
            let limits = RateLimits::parse(&headers(case), SystemTime::now(), max_wait);
            c.observe(&m, first.at, now, &limits);
            c.answered(&m, &first, now);
            let start = Instant::now();
            for who in ["t1", "t2"] {
                let r = turn(&c, &m, who).await.unwrap_or_else(|until| {
                    panic!("{case:?}: held until {:?} from now", until - Instant::now())
                });
                c.answered(&m, &r, Instant::now());
            }
            assert!(
                start.elapsed() <= max_wait * 2,
                "{case:?}: two calls took {:?}",
                start.elapsed()
            );
            assert!(
                !matches!(c.capacity(&m, Instant::now() + max_wait), Capacity::Until(at) if at > Instant::now() + max_wait * 2),
                "{case:?}"
            );
        }
    }

    /// Waits compare strictly and end when the budget is spent: a turn that comes later than
    /// the wait left is not waited for at all, one that comes within it is.
    #[tokio::test(start_paused = true)]
    async fn a_wait_longer_than_the_budget_is_not_begun() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        let first = turn(&c, &m, "t0").await.unwrap();
        let now = Instant::now();
        c.throttled(&m, &first, 429, Some(Duration::from_secs(5)), now);
        let mut left = Duration::from_secs(4);
        let start = Instant::now();
        let err = c.wait_turn(&m, "t1", &COST, &mut left, None, true).await;
        assert_eq!(err, Err(now + Duration::from_secs(5)));
        assert_eq!(start.elapsed(), Duration::ZERO, "nothing waited");
        assert_eq!(left, Duration::from_secs(4));
        let mut left = Duration::from_secs(5);
        let r = c
            .wait_turn(&m, "t1", &COST, &mut left, None, true)
            .await
            .unwrap();
        assert!(r.probe, "the first call after a hold goes alone");
        assert_eq!(left, Duration::ZERO);
        // A probe out: the next waits for its answer while its budget lasts, then gives up.
        let mut left = ms(300);
        let start = Instant::now();
        assert!(
            c.wait_turn(&m, "t2", &COST, &mut left, None, true)
                .await
                .is_err()
        );
        assert_eq!(start.elapsed(), ms(300));
        assert_eq!(left, Duration::ZERO);
    }

    /// The pace is this worker's own estimate: a replica refused by chance lowers it to one
    /// call every half minute or slower, which says nothing of when the provider answers. A
    /// call it puts beyond the wait left waits the wait out and then goes alone, never giving
    /// up on the estimate; a hold the provider asked for beyond the wait is still not begun.
    #[tokio::test(start_paused = true)]
    async fn a_lowered_pace_yields_to_a_spent_wait_and_a_providers_hold_does_not() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        // Refused on every call, no wait asked: each round lowers the pace.
        for _ in 0..12 {
            let r = turn(&c, &m, "t0").await.unwrap();
            c.throttled(&m, &r, 429, None, Instant::now());
        }
        let Capacity::Until(free) = c.capacity(&m, Instant::now()) else {
            panic!("the pace is lowered")
        };
        assert!(
            free > Instant::now() + Duration::from_secs(20),
            "the pace: one call in {:?}",
            free - Instant::now()
        );
        assert_eq!(
            c.provider_hold(&m, Instant::now()),
            None,
            "nothing the provider said"
        );
        let mut left = Duration::from_secs(10);
        let start = Instant::now();
        let r = c
            .wait_turn(&m, "t1", &COST, &mut left, None, true)
            .await
            .expect("the pace yields when the wait is spent");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(10),
            "the wait waited out"
        );
        assert_eq!(left, Duration::ZERO);
        assert!(r.probe, "it goes alone");
        // Another call whose wait is spent meanwhile waits for that one's answer, not beside it.
        let mut left = Duration::ZERO;
        assert!(
            c.wait_turn(&m, "t2", &COST, &mut left, None, true)
                .await
                .is_err()
        );
        c.answered(&m, &r, Instant::now());
        // The provider asks for 30 s: a call with 10 s left does not begin to wait.
        let mut left = Duration::ZERO;
        let r = c
            .wait_turn(&m, "t3", &COST, &mut left, None, true)
            .await
            .unwrap();
        let now = Instant::now();
        c.throttled(&m, &r, 429, Some(Duration::from_secs(30)), now);
        assert_eq!(
            c.provider_hold(&m, now),
            Some(now + Duration::from_secs(30))
        );
        let mut left = Duration::from_secs(10);
        let start = Instant::now();
        assert_eq!(
            c.wait_turn(&m, "t4", &COST, &mut left, None, true).await,
            Err(now + Duration::from_secs(30))
        );
        assert_eq!(start.elapsed(), Duration::ZERO, "nothing waited");
    }

    /// Calls waiting in one model's queue go one at a time, in the order they came, at the
    /// stated pace; a call dropped while waiting leaves the queue.
    #[tokio::test(start_paused = true)]
    async fn waiting_calls_go_one_at_a_time_in_arrival_order() {
        let c = std::sync::Arc::new(ModelCapacities::new(CapacityPolicy::default()));
        let m = model("a");
        let first = turn(&c, &m, "t0").await.unwrap();
        let t0 = Instant::now();
        c.observe(&m, t0, t0, &two_a_second());
        let order = std::sync::Arc::new(Mutex::new(Vec::new()));
        let mut joins = Vec::new();
        for i in 0..6u32 {
            let (c, m, order) = (c.clone(), m.clone(), order.clone());
            joins.push(tokio::spawn(async move {
                let r = turn(&c, &m, &format!("t{i}")).await.unwrap();
                order.lock().unwrap().push((i, r.at));
                c.answered(&m, &r, Instant::now());
            }));
            // They join the queue in this order.
            tokio::task::yield_now().await;
        }
        // One more joins and is dropped while waiting.
        let dropped = {
            let (c, m) = (c.clone(), m.clone());
            tokio::spawn(async move { turn(&c, &m, "gone").await })
        };
        tokio::task::yield_now().await;
        dropped.abort();
        c.answered(&m, &first, t0);
        for j in joins {
            j.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(
            order.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 5]
        );
        let inc = Duration::from_secs_f64(0.5 / c.policy().margin);
        for w in order.windows(2) {
            assert!(w[1].1 - w[0].1 >= inc - ms(1), "{:?}", w[1].1 - w[0].1);
        }
        assert!(
            c.lock().models[&m].idle(Instant::now()),
            "nobody left in the queue"
        );
    }

    /// Two provider names for one quota (one key) are paced as one: a 429's hold seen under one
    /// name holds the other, and their calls wait in one queue, released one at a time, rather
    /// than two pacers' calls meeting in the quota.
    #[tokio::test(start_paused = true)]
    async fn two_names_for_one_quota_share_one_pacer() {
        let c = std::sync::Arc::new(
            ModelCapacities::new(CapacityPolicy::default())
                .with_quota_names(HashMap::from([("p2".to_string(), "p".to_string())])),
        );
        let (one, two) = (model("m"), ModelRef::parse("p2/m").unwrap());
        assert_eq!(*c.quota(&two), one);
        assert_eq!(*c.quota(&one), one, "the owner paces as itself");
        let other = ModelRef::parse("p2/other").unwrap();
        assert_eq!(c.quota(&other).provider, "p", "every model of the name");
        // A hold seen under one name holds the other.
        let r = turn(&c, &two, "t0").await.unwrap();
        let now = Instant::now();
        c.throttled(&two, &r, 429, Some(ms(800)), now);
        assert_eq!(c.provider_hold(&one, now), Some(now + ms(800)));
        assert_eq!(c.provider_hold(&one, now), c.provider_hold(&two, now));
        assert_eq!(c.lock().models.len(), 1, "one pacer for both names");
        // Calls under both names, one queue: the probe after the hold goes alone, then the
        // others one at a time at the stated pace, whichever name they came under.
        tokio::time::advance(ms(800)).await;
        let t0 = Instant::now();
        c.observe(&one, t0, t0, &two_a_second());
        let starts = std::sync::Arc::new(Mutex::new(Vec::new()));
        let mut joins = Vec::new();
        for i in 0..4u32 {
            let m = if i % 2 == 0 { one.clone() } else { two.clone() };
            let (c, starts) = (c.clone(), starts.clone());
            joins.push(tokio::spawn(async move {
                let r = turn(&c, &m, &format!("t{}", i + 1)).await.unwrap();
                starts.lock().unwrap().push(r.at);
                c.answered(&m, &r, Instant::now());
            }));
            tokio::task::yield_now().await;
        }
        for j in joins {
            j.await.unwrap();
        }
        let starts = starts.lock().unwrap().clone();
        assert_eq!(starts.len(), 4);
        let inc = Duration::from_secs_f64(0.5 / c.policy().margin);
        for w in starts.windows(2) {
            assert!(w[1] - w[0] >= inc - ms(1), "{:?}", w[1] - w[0]);
        }
    }

    /// Admission gates a topic only by the models its tasks use: a model held stops its own
    /// topic, not another topic's, nor a topic whose models are not known.
    #[tokio::test(start_paused = true)]
    async fn admission_gates_only_the_topics_of_a_held_model() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let (a, b) = (model("a"), model("b"));
        let now = Instant::now();
        c.attribute("refunds", std::slice::from_ref(&a), now);
        c.attribute("triage", std::slice::from_ref(&b), now);
        let r = turn(&c, &a, "t0").await.unwrap();
        let until = c.throttled(&a, &r, 429, Some(Duration::from_secs(30)), now);
        assert_eq!(c.admission("refunds", now), Capacity::Until(until));
        assert_eq!(
            c.admission("triage", now),
            Capacity::Unbounded,
            "b never called"
        );
        assert_eq!(c.admission("unknown", now), Capacity::Unbounded);
        let held = c.held(now);
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].0, a);
        assert_eq!(held[0].1.reason, HoldReason::RateLimited);
        assert_eq!(held[0].1.until, until);
        // A topic whose tasks also use b is not gated by a alone.
        c.attribute("refunds", std::slice::from_ref(&b), now);
        assert_eq!(c.admission("refunds", now), Capacity::Unbounded);
        // Attributions fade.
        let later = now + ATTRIBUTION_TTL + Duration::from_secs(1);
        assert_eq!(c.admission("refunds", later), Capacity::Unbounded);
    }

    /// Tasks claimed count against their topic's models until their first call joins a queue.
    #[tokio::test(start_paused = true)]
    async fn claims_count_until_the_first_call_joins_the_queue() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let a = model("a");
        let now = Instant::now();
        c.attribute("t", std::slice::from_ref(&a), now);
        let first = turn(&c, &a, "t0").await.unwrap();
        let stated = RateLimits {
            requests: Budget {
                limit: Some(600),
                remaining: Some(599),
                reset: Some(ms(100)),
            },
            ..RateLimits::default()
        };
        c.observe(&a, first.at, now, &stated);
        c.answered(&a, &first, now);
        // 10 a second (with the margin, a little less): about 10 within the horizon.
        let Capacity::Now(n) = c.admission("t", now) else {
            panic!("{:?}", c.admission("t", now));
        };
        assert!((9..=11).contains(&n), "{n}");
        let ids: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        c.claimed(ids.iter().map(|id| (id.as_str(), "t")), now);
        assert!(matches!(c.admission("t", now), Capacity::Until(_)));
        // Their calls join the queue: claims become waiters, no double count.
        let c = std::sync::Arc::new(c);
        let waiting = {
            let (c, a) = (c.clone(), a.clone());
            tokio::spawn(async move { turn(&c, &a, "k1").await })
        };
        tokio::task::yield_now().await;
        assert_eq!(c.lock().claims.len() as u32, n - 1);
        assert!(matches!(c.admission("t", now), Capacity::Until(_)));
        waiting.abort();
        // Claims that never call stop counting.
        assert!(matches!(
            c.admission("t", now + c.policy().claim_ttl + Duration::from_secs(1)),
            Capacity::Now(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn the_state_is_bounded() {
        let policy = CapacityPolicy {
            max_models: 4,
            max_starts: 8,
            ..CapacityPolicy::default()
        };
        let c = ModelCapacities::new(policy);
        let now = Instant::now();
        for i in 0..100 {
            let m = model(&format!("m{i}"));
            let r = turn(&c, &m, "t").await.unwrap();
            c.answered(&m, &r, now);
            c.claimed((0..50).map(|_| ("x", "topic")), now);
            let ids: Vec<String> = (0..50).map(|k| format!("{i}-{k}")).collect();
            c.claimed(ids.iter().map(|id| (id.as_str(), "topic")), now);
            let many: Vec<ModelRef> = (0..40).map(|k| model(&format!("x{k}"))).collect();
            c.attribute(&format!("topic{i}"), &many, now);
        }
        assert_eq!(c.tracked(), 4);
        let state = c.lock();
        assert!(state.claims.len() <= 8);
        assert!(state.topics.len() <= MAX_TOPICS);
        assert!(
            state
                .topics
                .values()
                .all(|t| t.models.len() <= MAX_MODELS_PER_TOPIC)
        );
        drop(state);
        assert_eq!(
            c.admission("topic3", now),
            Capacity::Unbounded,
            "too many models"
        );
    }

    /// A fleet's shared pace stand-in: answers from a script, records what it was asked.
    struct Script {
        answers: Mutex<Vec<Result<SharedTurn, String>>>,
        asked: Mutex<Vec<(String, Duration, Duration)>>,
    }

    #[async_trait::async_trait]
    impl SharedPace for Script {
        async fn reserve(
            &self,
            model: &str,
            spacing: Duration,
            within: Duration,
        ) -> Result<SharedTurn, String> {
            self.asked
                .lock()
                .unwrap()
                .push((model.to_string(), spacing, within));
            let mut answers = self.answers.lock().unwrap();
            if answers.is_empty() {
                Ok(SharedTurn::In(Duration::ZERO))
            } else {
                answers.remove(0)
            }
        }
    }

    /// With a shared pace, a released call reserves its start there and waits for it; a start
    /// beyond its wait is not waited for (and its probe does not hold the model); a shared pace
    /// that fails is left alone for a while, the replica pacing alone meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_shared_pace_spaces_the_calls_with_the_other_replicas() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let script = Arc::new(Script {
            answers: Mutex::new(vec![
                Ok(SharedTurn::In(ms(700))),
                Ok(SharedTurn::Beyond(Duration::from_secs(90))),
                Err("the store is down".into()),
            ]),
            asked: Mutex::new(Vec::new()),
        });
        c.share_pace(script.clone());
        let m = model("a");
        // The first call (a probe, no pace known) asks the fleet for a probe's spacing.
        let start = Instant::now();
        let first = turn(&c, &m, "t0").await.unwrap();
        assert_eq!(start.elapsed(), ms(700), "waited for the reserved start");
        assert_eq!(first.at, Instant::now(), "released when it starts");
        assert_eq!(script.asked.lock().unwrap()[0].1, SHARED_PROBE_SPACING);
        c.observe(&m, first.at, first.at, &two_a_second());
        c.answered(&m, &first, Instant::now());
        // The next start is 90 s off: not waited for, and nothing of this call holds the model.
        let err = turn(&c, &m, "t1").await.unwrap_err();
        assert_eq!(err, Instant::now() + Duration::from_secs(90));
        let (_, spacing, within) = script.asked.lock().unwrap()[1].clone();
        assert_eq!(spacing, Duration::from_secs_f64(0.5 / c.policy().margin));
        assert!(within <= c.policy().max_wait);
        assert!(!c.probing(&m));
        // The shared pace fails: this call goes on the local pace, and the next calls do not
        // ask the shared pace until the pause is over.
        assert!(turn(&c, &m, "t2").await.is_ok());
        let asked = script.asked.lock().unwrap().len();
        assert!(turn(&c, &m, "t3").await.is_ok());
        assert_eq!(script.asked.lock().unwrap().len(), asked, "paused");
        tokio::time::advance(SHARED_PAUSE).await;
        assert!(turn(&c, &m, "t4").await.is_ok());
        assert_eq!(script.asked.lock().unwrap().len(), asked + 1, "asked again");
    }

    /// What a fleet of replicas did against one quantized quota ([`fleet_against_one_quota`]).
    #[cfg(feature = "devkit")]
    #[derive(Debug, Default)]
    struct FleetUse {
        admitted: u64,
        refused: u64,
        /// Calls whose turn came later than their wait: the task would be deferred.
        deferred: u64,
        first: Option<Instant>,
        last: Option<Instant>,
        /// The most calls that arrived within one window of the provider's clock.
        most_in_a_window: u32,
    }

    #[cfg(feature = "devkit")]
    impl FleetUse {
        /// The rate calls were let through at over the limit's, from the first let through to
        /// the last (as the load harness measures it).
        fn share_used(&self, per_second: f64) -> f64 {
            match (self.first, self.last) {
                (Some(a), Some(b)) if b > a => {
                    self.admitted.saturating_sub(1) as f64 / (per_second * (b - a).as_secs_f64())
                }
                _ => 0.0,
            }
        }

        fn refused_share(&self) -> f64 {
            self.refused as f64 / (self.admitted + self.refused).max(1) as f64
        }
    }

    /// `replicas` workers of `slots` slots, each pacing alone (its own capacities, no shared
    /// pace), share one provider quota of `rpm` requests a minute enforced a second's worth
    /// per second window: the devkit's provider limit (`abada_devkit::model::LimitCore`, the
    /// very state the load harness's scripted model and the simulator's world enforce), whose
    /// answers state the quota's figures, shared by every replica, as OpenAI's and Anthropic's
    /// are their organisation's. `tasks` one-call tasks; each call is answered 100 ms after it
    /// arrives, its headers read by the production parser. A call the provider holds beyond
    /// its wait (or refuses when its wait is spent) is counted deferred and tried again then,
    /// with a fresh wait (as a task deferred and claimed again would). Every replica's slots
    /// stay busy until the tasks run out.
    #[cfg(feature = "devkit")]
    async fn fleet_against_one_quota(
        replicas: usize,
        slots: usize,
        tasks: usize,
        rpm: u32,
    ) -> FleetUse {
        use abada_devkit::model::{LimitCore, RateLimit};
        use std::sync::atomic::{AtomicUsize, Ordering};
        let start = Instant::now();
        let limit = Arc::new(Mutex::new(LimitCore::new(
            RateLimit::per_minute(rpm),
            start,
        )));
        let next = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new((FleetUse::default(), Vec::<u32>::new())));
        let m = model("shared");
        let mut joins = Vec::new();
        for r in 0..replicas {
            let c = Arc::new(ModelCapacities::new(CapacityPolicy::default()));
            for slot in 0..slots {
                let (c, m, limit, next, seen) = (
                    c.clone(),
                    m.clone(),
                    limit.clone(),
                    next.clone(),
                    seen.clone(),
                );
                joins.push(tokio::spawn(async move {
                    let who = format!("r{r}s{slot}");
                    while next.fetch_add(1, Ordering::SeqCst) < tasks {
                        let mut left = c.policy().max_wait;
                        let mut ticket = None;
                        loop {
                            let release =
                                match c.wait_turn(&m, &who, &COST, &mut left, ticket, true).await {
                                    Ok(release) => release,
                                    Err(until) => {
                                        seen.lock().unwrap().0.deferred += 1;
                                        tokio::time::sleep_until(until).await;
                                        left = c.policy().max_wait;
                                        ticket = None;
                                        continue;
                                    }
                                };
                            ticket = Some(release.ticket);
                            let arrived = Instant::now();
                            let (stated, retry_after) = limit.lock().unwrap().take(0, arrived);
                            {
                                let mut s = seen.lock().unwrap();
                                let window = (arrived - start).as_secs() as usize;
                                if s.1.len() <= window {
                                    s.1.resize(window + 1, 0);
                                }
                                s.1[window] += 1;
                                s.0.most_in_a_window = s.0.most_in_a_window.max(s.1[window]);
                            }
                            tokio::time::sleep(ms(100)).await;
                            let now = Instant::now();
                            let mut h = HeaderMap::new();
                            for (k, v) in stated {
                                h.insert(
                                    HeaderName::from_static(k),
                                    HeaderValue::from_str(&v).unwrap(),
                                );
                            }
                            let limits = RateLimits::parse(&h, SystemTime::now(), MAX);
                            c.observe(&m, release.at, now, &limits);
                            match retry_after {
                                None => {
                                    c.answered(&m, &release, now);
                                    let mut s = seen.lock().unwrap();
                                    s.0.admitted += 1;
                                    s.0.first.get_or_insert(arrived);
                                    s.0.last = Some(arrived);
                                    break;
                                }
                                Some(wait) => {
                                    seen.lock().unwrap().0.refused += 1;
                                    c.throttled(&m, &release, 429, Some(wait), now);
                                    // As `fallback`: waited out while the provider's hold
                                    // fits the wait left; deferred for that hold (at least a
                                    // second, the circuit's least) when not.
                                    let hold = c.provider_hold(&m, now);
                                    if left.is_zero()
                                        || hold.is_some_and(|u| {
                                            u.saturating_duration_since(now) > left
                                        })
                                    {
                                        seen.lock().unwrap().0.deferred += 1;
                                        let until =
                                            hold.unwrap_or(now).max(now + Duration::from_secs(1));
                                        tokio::time::sleep_until(until).await;
                                        left = c.policy().max_wait;
                                        ticket = None;
                                    }
                                }
                            }
                        }
                    }
                }));
            }
        }
        for j in joins {
            j.await.unwrap();
        }
        let (fleet, _) = Arc::try_unwrap(seen).unwrap().into_inner().unwrap();
        assert_eq!(
            fleet.admitted, tasks as u64,
            "every task's call got through"
        );
        fleet
    }

    /// Replicas pacing alone against one quantized quota (120 a minute, 2 a second enforced
    /// per second window), on the paused clock: a report of what the quota's use, the 429s and
    /// the deferrals come to (`--nocapture`), the paused-clock counterpart of the load
    /// harness's `--scenario ratelimit` without a store (BENCHMARKS.md). It checks the one
    /// worker's targets (at least 95 % of the limit, no 429, no deferral); the replicas' are
    /// reported, not met (see the pacer's module docs, "Replicas pacing alone").
    #[cfg(feature = "devkit")]
    #[tokio::test(start_paused = true)]
    async fn replicas_pacing_alone_against_one_quantized_quota() {
        for (replicas, tasks) in [(1usize, 30usize), (4, 100), (4, 300), (8, 200)] {
            let u = fleet_against_one_quota(replicas, 8, tasks, 120).await;
            println!(
                "{replicas} x 8 slots, {tasks} tasks: {:.1} % of the limit used, {} of {} answered 429 ({:.1} %), {} deferred, at most {} in a window",
                u.share_used(2.0) * 100.0,
                u.refused,
                u.admitted + u.refused,
                u.refused_share() * 100.0,
                u.deferred,
                u.most_in_a_window
            );
            if replicas == 1 {
                assert!(u.share_used(2.0) >= 0.95, "{u:?}");
                assert_eq!((u.refused, u.deferred), (0, 0), "{u:?}");
                assert!(u.most_in_a_window <= 2, "{u:?}");
            }
        }
    }
}
