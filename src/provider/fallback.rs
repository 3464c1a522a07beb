//! THE retry loop for model calls: the agent's model, then its `fallbackModels`, with a
//! bounded backoff on transient failures (protocol.md Part C). No adapter retries beneath it.
//! Every call feeds the model's circuit ([`super::circuit`]), shared by the tasks of the
//! worker; a model whose circuit is open is not called.
//!
//! Before each call the call waits for its turn in its model's pacer
//! ([`super::capacity::ModelCapacities::wait_turn`], [`super::pacer`]): one at a time, at the
//! pace the provider states and the 429s taught, up to [`RetryPolicy::capacity_wait_max`] in
//! all for one model call, instead of being sent to a 429. A model the provider holds (a
//! `retry-after`, a 503, a stated budget at zero) beyond what the call has left of that wait
//! (or that a later model of the chain could take the call before) is skipped like an open
//! circuit. The worker's own pace and queue never skip it: a call they would keep past its
//! wait waits it out and then goes alone, and the provider's answer decides.
//!
//! | failure | what happens |
//! | --- | --- |
//! | a 429 | the pace drops and its `retry-after` holds the model; the same call waits for its turn again while that hold fits the wait it has left, keeping its place in the queue; never the circuit (a busy limit is no outage) |
//! | a 429 whose hold does not fit, or answered when the wait is spent | next model at once; the model counts as unavailable (a deferral when every model is, for what the provider said) |
//! | `Unavailable` (503, 529, overloaded, no concurrency slot) | next model at once; the circuit opens for its Retry-After (a 503 also holds the model in its pacer) |
//! | `Transient`, `Malformed` | same model again after a backoff, `transient_retries` times (unless its circuit opened meanwhile), then next model |
//! | `ContextTooLong`, `Setup` | next model |
//! | `Rejected` | stop: a hard error of the task |
//!
//! When no model answered, in this order (a deferral is for an outage, or for a rate limit
//! whose wait exceeds what the call may wait, never for one request; protocol.md B.5):
//! 1. a technical failure (malformed answers after retries, an unreadable key):
//!    [`ModelCallError::Technical`];
//! 2. a model said the conversation is too long for it: [`ModelCallError::ContextTooLong`],
//!    an end with that reason, never a deferral;
//! 3. every model of the chain is unavailable for everyone (its circuit is open, or its
//!    provider holds it beyond what the call may wait, or still refused it when the wait was
//!    spent): [`ModelCallError::AllUnavailable`], until the earliest may take a call by what the
//!    providers said (never the worker's own pace: that would hide the task from replicas that
//!    can run it now);
//! 4. else a model failed this request while it serves others (or no other task has shown
//!    otherwise yet): [`ModelCallError::Technical`], the task's own failure (a retry consumed).

use std::time::Duration;

use crate::random::Random;
use tracing::Instrument;

use super::capacity::{CallCost, Capacity, ModelCapacities, Release};
use super::circuit::{Change, Signal};
use super::{CallAttempt, ModelRef, ModelRequest, ModelResponse, ProviderError, ProviderRegistry};
use crate::telemetry::spans;

/// How hard to retry one model.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Retries of the same model after a transient or malformed failure, before the next model.
    pub transient_retries: u32,
    /// The first backoff; doubled on every further retry.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// The fraction (0..=1) of each backoff that is randomly taken off, so that workers hit by
    /// the same outage do not retry in step. Tests set 0.
    pub jitter: f64,
    /// The deferral when every model was unavailable and none said for how long.
    pub unavailable_default: Duration,
    /// How long one model call may wait for its turn in its model's pacer (the provider's rate
    /// limit, [`super::pacer`]) in all, 429s waited out included, before the model counts as
    /// unavailable (`ABADA_AGENT_MODEL_WAIT_MAX_MS`). The task's lease is kept by heartbeats
    /// meanwhile.
    pub capacity_wait_max: Duration,
}

/// The default of [`RetryPolicy::capacity_wait_max`].
pub(crate) const DEFAULT_CAPACITY_WAIT_MAX: Duration = Duration::from_secs(60);

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            transient_retries: 2,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(16),
            jitter: 0.5,
            unavailable_default: Duration::from_secs(30),
            capacity_wait_max: DEFAULT_CAPACITY_WAIT_MAX,
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (0-based), its jitter drawn from `random`.
    pub fn backoff(&self, retry: u32, random: &Random) -> Duration {
        let factor = 2u32.saturating_pow(retry.min(31));
        let full = self
            .initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff);
        let jitter = self.jitter.clamp(0.0, 1.0);
        if jitter == 0.0 {
            return full;
        }
        full.mul_f64(1.0 - jitter * random.unit())
    }
}

/// Why no model answered.
#[derive(Debug, thiserror::Error)]
pub enum ModelCallError {
    /// The agent definition names no model.
    #[error("the agent names no model to call; set its \"model\"")]
    NoModels,
    /// A model names a provider that is not configured: an error of the definition.
    #[error(
        "model {model} names provider {:?}, which is not configured (configured: {known}); \
         fix the agent definition or set ABADA_AGENT_PROVIDERS",
        model.provider
    )]
    UnknownProvider { model: ModelRef, known: String },
    /// A model refused the request outright: a hard error of the task, no fallback.
    #[error("model call failed for good: {source}")]
    Task {
        model: ModelRef,
        #[source]
        source: Box<ProviderError>,
    },
    /// Every model of the chain is unavailable for everyone (its circuit is open): defer the
    /// task for `retry_after` (until the earliest circuit may close), without consuming a retry.
    #[error("every model is unavailable now; try again in {retry_after:?} (last: {last})")]
    AllUnavailable {
        retry_after: Duration,
        last: Box<ProviderError>,
    },
    /// Models failed technically (transient or malformed after retries, unreadable key) while
    /// not every one is unavailable for everyone: the task's failure, a retry consumed.
    #[error("no model answered after retries: {last}")]
    Technical { last: Box<ProviderError> },
    /// A model said the conversation is longer than its context window, and no other answered:
    /// the task ends with that reason (retrying or deferring the same conversation cannot help).
    #[error("the conversation is too long for the model's context: {last}")]
    ContextTooLong { last: Box<ProviderError> },
}

/// Calls the models in order until one answers; see the module docs for the rules.
/// `request.model` is ignored and set from each [`ModelRef`].
pub async fn call_with_fallback(
    registry: &ProviderRegistry,
    models: &[ModelRef],
    request: &ModelRequest,
    policy: &RetryPolicy,
) -> Result<(ModelRef, ModelResponse), ModelCallError> {
    call_with_fallback_observed(registry, models, request, policy, &mut |_| {}).await
}

/// [`call_with_fallback`], reporting every single call to `observe` as it ends. The calls are
/// made for one anonymous requester (see [`call_models`]).
pub async fn call_with_fallback_observed(
    registry: &ProviderRegistry,
    models: &[ModelRef],
    request: &ModelRequest,
    policy: &RetryPolicy,
    observe: &mut (dyn FnMut(&CallAttempt) + Send),
) -> Result<(ModelRef, ModelResponse), ModelCallError> {
    call_models(registry, models, request, policy, "", observe).await
}

/// [`call_with_fallback_observed`] for `requester` (the task the calls are made for): the
/// circuit counts failed calls by distinct requester, so one request that fails every time
/// never makes its model unavailable for the others.
pub async fn call_models(
    registry: &ProviderRegistry,
    models: &[ModelRef],
    request: &ModelRequest,
    policy: &RetryPolicy,
    requester: &str,
    observe: &mut (dyn FnMut(&CallAttempt) + Send),
) -> Result<(ModelRef, ModelResponse), ModelCallError> {
    if models.is_empty() {
        return Err(ModelCallError::NoModels);
    }
    let mut providers = Vec::with_capacity(models.len());
    for m in models {
        match registry.get(&m.provider) {
            Some(p) => providers.push(p),
            None => {
                return Err(ModelCallError::UnknownProvider {
                    model: m.clone(),
                    known: registry.names().join(", "),
                });
            }
        }
    }
    let circuits = registry.circuits();
    let capacities = registry.capacities();
    let mut wait_left = policy.capacity_wait_max;
    let mut req = request.clone();
    // What the call spends of a stated tokens budget, as providers count it at arrival: the
    // request's input and its output cap.
    let cost = CallCost {
        input_tokens: super::token_estimate::estimate_request_tokens(request),
        output_tokens: u64::from(request.max_output_tokens.unwrap_or(0)),
    };
    let mut technical = 0usize;
    let mut too_long = 0usize;
    // Models found unavailable for everyone on this call (circuit open, held by their rate
    // limit, busy): when that is all of them, a deferral, even if a hold ended meanwhile.
    let mut unavailable = 0usize;
    let mut last: Option<ProviderError> = None;
    for (fallback_index, (model, provider)) in models.iter().zip(providers).enumerate() {
        let now = tokio::time::Instant::now();
        if let Some(until) = circuits.open_until(model, now) {
            tracing::debug!(model = %model, open_for_ms = duration_ms(until - now), "the model is unavailable for every task now (its circuit is open): not called");
            last.get_or_insert_with(|| ProviderError::Unavailable {
                provider: model.provider.clone(),
                model: model.model.clone(),
                status: None,
                message: "unavailable for every task of this worker (its circuit is open)".into(),
                retry_after: Some(until - now),
            });
            unavailable += 1;
            continue;
        }
        req.model = model.model.clone();
        let mut retries = 0u32;
        // The call's place in the model's queue, kept across its 429s.
        let mut ticket: Option<u64> = None;
        let provider_name = provider.semconv_name().unwrap_or(&model.provider);
        loop {
            // A later model of the chain that can take the call now is not made to wait.
            // (Not while the model's first call is out: the wait is for its answer, short.)
            let later_ready = !capacities.probing(model)
                && models[fallback_index + 1..].iter().any(|m| {
                    let now = tokio::time::Instant::now();
                    circuits.open_until(m, now).is_none()
                        && !matches!(capacities.capacity(m, now), Capacity::Until(_))
                });
            let wait_left_here = if later_ready {
                Duration::ZERO
            } else {
                wait_left
            };
            let mut left = wait_left_here;
            let waiting_since = tokio::time::Instant::now();
            let turn = capacities
                .wait_turn(model, requester, &cost, &mut left, ticket, !later_ready)
                .await;
            wait_left = wait_left.saturating_sub(wait_left_here - left);
            let waited = waiting_since.elapsed();
            let release = match turn {
                Ok(release) => release,
                Err(until) => {
                    let now = tokio::time::Instant::now();
                    tracing::debug!(model = %model, free_in_ms = duration_ms(until.saturating_duration_since(now)), "the model's rate limit allows no call within the capacity wait: not called");
                    last = Some(ProviderError::Unavailable {
                        provider: model.provider.clone(),
                        model: model.model.clone(),
                        status: None,
                        message: format!(
                            "its rate limit allows no call for {} ms (a call waits at most ABADA_AGENT_MODEL_WAIT_MAX_MS in all, and not while a later model of the chain can take it)",
                            duration_ms(until.saturating_duration_since(now))
                        ),
                        retry_after: Some(until.saturating_duration_since(now)),
                    });
                    unavailable += 1;
                    break;
                }
            };
            let span = spans::chat(&spans::ChatSpan {
                provider: provider_name,
                configured_provider: &model.provider,
                model: &model.model,
                fallback_index,
                retry: retries,
                max_tokens: req.max_output_tokens,
            });
            spans::record_chat_request(&span, &req.system, &req.messages);
            // The model provider sees this call's span as its parent; without export, the
            // task's own context goes on.
            req.traceparent = spans::traceparent_of(&span).or_else(|| request.traceparent.clone());
            let started = tokio::time::Instant::now();
            ticket = Some(release.ticket);
            let in_flight = CallInFlight {
                capacities,
                model,
                release,
                answered: false,
            };
            let result = provider.complete(&req).instrument(span.clone()).await;
            in_flight.returned();
            match &result {
                Ok(r) => spans::record_chat_answer(
                    &span,
                    &spans::ChatAnswer {
                        response_model: r.response_model.as_deref(),
                        usage: r.usage,
                        cache_read_tokens: r.cache_read_tokens,
                        cache_creation_tokens: r.cache_creation_tokens,
                        finish_reason: &r.stop_reason,
                    },
                    &r.message,
                ),
                Err(e) => spans::record_chat_error(&span, e.outcome()),
            }
            drop(span);
            let duration = started.elapsed();
            let now = tokio::time::Instant::now();
            // A 429 is the rate limit speaking: the pace drops and the model is held for what it
            // asked; this call waits for its turn again when that fits, without opening the
            // circuit (the circuit is for outages). A 503 holds the model and is an outage too.
            let wait_again = match &result {
                Ok(_) => {
                    capacities.answered(model, &release, now);
                    false
                }
                Err(ProviderError::Unavailable {
                    status: Some(status @ (429 | 503)),
                    retry_after,
                    ..
                }) => {
                    capacities.throttled(model, &release, *status, *retry_after, now);
                    // Waited out while the provider's hold fits the wait left; the lowered
                    // pace is this worker's estimate and yields when the wait is spent
                    // (`wait_turn`), so it never makes the call give up. A call whose wait is
                    // spent stops here: its next 429 would come at once.
                    let waits = *status == 429
                        && !wait_left.is_zero()
                        && capacities
                            .provider_hold(model, now)
                            .is_none_or(|until| until.saturating_duration_since(now) <= wait_left);
                    // SIM-BUG (feature `sim-bugs`, selected at run time): a 429 taken as an
                    // outage, never waited out.
                    #[cfg(feature = "sim-bugs")]
                    let waits =
                        waits && !crate::sim_bugs::active(crate::sim_bugs::Bug::RateLimitDefers);
                    waits
                }
                Err(_) => {
                    capacities.ended(model, &release);
                    false
                }
            };
            let signal = match &result {
                Ok(_) => Signal::Answered,
                Err(_) if wait_again => Signal::Neutral,
                Err(e) => Signal::of(e),
            };
            let change = circuits.record(model, requester, signal, now, policy.unavailable_default);
            observe(&CallAttempt {
                duration,
                model: model.clone(),
                provider_name: provider_name.to_string(),
                fallback_index,
                outcome: match &result {
                    Ok(_) => "ok",
                    Err(e) => e.outcome(),
                },
                usage: result.as_ref().ok().and_then(|r| r.usage),
                circuit_opened: matches!(change, Change::Opened { .. }),
                capacity_wait: waited,
                capacity: match capacities.capacity(model, now) {
                    Capacity::Unbounded => None,
                    Capacity::Now(n) => Some(u64::from(n)),
                    Capacity::Until(_) => Some(0),
                },
            });
            match change {
                Change::Opened { until } => {
                    tracing::warn!(model = %model, open_for_ms = duration_ms(until - now), "the model is unavailable for every task: its circuit opens");
                }
                Change::Closed => {
                    tracing::info!(model = %model, "the model answers again: its circuit closes")
                }
                Change::None => {}
            }
            let error = match result {
                Ok(response) => return Ok((model.clone(), response)),
                Err(e) => e,
            };
            if wait_again {
                tracing::debug!(model = %model, error = %error, "rate-limited: waiting for the model's capacity");
                continue;
            }
            let open = circuits.open_until(model, now).is_some();
            match &error {
                ProviderError::Unavailable { .. } => unavailable += 1,
                ProviderError::Transient { .. } | ProviderError::Malformed { .. }
                    if retries < policy.transient_retries && !open =>
                {
                    tracing::warn!(model = %model, error = %error, retry = retries + 1, "model call failed, retrying");
                    tokio::time::sleep(policy.backoff(retries, registry.random())).await;
                    retries += 1;
                    continue;
                }
                // A model still failing after its retries is this request's
                // failure unless its circuit says it is down for everyone (decided below).
                ProviderError::Transient { .. } => {}
                ProviderError::Malformed { .. } | ProviderError::Setup { .. } => technical += 1,
                ProviderError::ContextTooLong { .. } => too_long += 1,
                ProviderError::Rejected { .. } | ProviderError::TooLarge { .. } => {
                    return Err(ModelCallError::Task {
                        model: model.clone(),
                        source: Box::new(error),
                    });
                }
            }
            tracing::warn!(model = %model, error = %error, "model failed, trying the next one");
            last = Some(error);
            break;
        }
    }
    let last = Box::new(last.expect("at least one model was tried or skipped"));
    if technical > 0 {
        return Err(ModelCallError::Technical { last });
    }
    if too_long > 0 {
        return Err(ModelCallError::ContextTooLong { last });
    }
    // A deferral only while every model of the chain is unavailable for everyone: its circuit
    // open, or the provider holding it (a 429's or 503's wait, a stated figure at zero), and
    // for as long as that says. Never for this worker's own pace or queue: they say nothing
    // of the provider, and a retryTimeout from them hides the task from replicas that could
    // run it now.
    let now = tokio::time::Instant::now();
    let held: Vec<Option<tokio::time::Instant>> = models
        .iter()
        .map(|m| {
            circuits
                .open_until(m, now)
                .or(capacities.provider_hold(m, now))
        })
        .collect();
    let reopens = held
        .iter()
        .copied()
        .collect::<Option<Vec<_>>>()
        .and_then(|untils| untils.into_iter().min());
    // The earliest of the holds still in force, for a chain whose other holds ended meanwhile.
    let still_held = held.iter().flatten().min().copied();
    Err(match reopens {
        Some(until) => ModelCallError::AllUnavailable {
            retry_after: until - now,
            last,
        },
        // Every model was unavailable for everyone when tried, and a hold ended while this
        // call waited for another: still an outage, not this request's failure.
        None if unavailable >= models.len() => ModelCallError::AllUnavailable {
            retry_after: still_held
                .map_or(circuits.policy().min_open, |until| until - now)
                .max(circuits.policy().min_open),
            last,
        },
        None => ModelCallError::Technical { last },
    })
}

/// A model call between its start and its answer. Dropped before the answer (the task's
/// future dropped there: its lease lost, its deadline passed, the worker killing it at
/// shutdown), it still ends the call in the model's capacity: a model's first call that never
/// came back would otherwise leave the model probing forever, and the runner would never
/// claim another task (found by the simulator).
struct CallInFlight<'a> {
    capacities: &'a ModelCapacities,
    model: &'a ModelRef,
    release: Release,
    answered: bool,
}

impl CallInFlight<'_> {
    /// The provider answered: the caller records how.
    fn returned(mut self) {
        self.answered = true;
    }
}

impl Drop for CallInFlight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.capacities.ended(self.model, &self.release);
        }
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_jitter_only_shortens() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(p.backoff(0, &Random::os()), Duration::from_millis(100));
        assert_eq!(p.backoff(1, &Random::os()), Duration::from_millis(200));
        assert_eq!(p.backoff(2, &Random::os()), Duration::from_millis(350));
        assert_eq!(p.backoff(40, &Random::os()), Duration::from_millis(350));
        let j = RetryPolicy { jitter: 1.0, ..p };
        for _ in 0..20 {
            assert!(j.backoff(1, &Random::os()) <= Duration::from_millis(200));
        }
    }
}
