//! The world's provider capacity and the fleet's conditions around it: the per-minute rate limit
//! of each of the world's models, one quota per provider name that every worker's calls to it
//! count against (replicas sharing one provider key), and the fleet's shared pace in memory
//! ([`WorldPace`]) for the seeds whose replicas pace as one queue.
//!
//! **One quota per model.** OpenAI sets a project's limits per model (its admin API,
//! `GET /v1/organization/projects/{project_id}/rate_limits`, "returns the rate limits per
//! model for a project", each entry naming its `model`), and the world's two providers serve
//! two models (the small-window one is another model, with another context window), so each
//! has a quota of its own, under the same plan. (Two provider names configured with one key
//! and base URL reach one quota, and the worker paces them as one, `provider::quota_names`;
//! the world's providers are stand-ins plugged in by name, configured with neither.)
//!
//! **The limit** is the scripted HTTP model's own state machine
//! ([`abada_devkit::model::LimitCore`]), so the simulated provider and the one the load harness
//! measures cannot disagree. It is modelled on what OpenAI and Anthropic document
//! (<https://platform.openai.com/docs/guides/rate-limits>,
//! <https://docs.anthropic.com/en/api/rate-limits>): stated per minute on every answer
//! (`x-ratelimit-{limit,remaining,reset}-requests`), enforced quantized (a second's worth per
//! second window of the provider's clock, or a bucket of a second's worth refilled evenly), and
//! refused beyond with 429 and `retry-after-ms`; or, a provider stating nothing (vLLM, Ollama,
//! llama.cpp), refused with a bare 429. A request counts when it arrives and is let through; a
//! refused one costs nothing. The headers of each answer are read by the production parser
//! ([`RateLimits::parse`]) and handed to the worker's capacities, as the adapters do
//! (`provider::http`).
//!
//! **The shared pace** ([`WorldPace`]) is the rule of the run store's statement
//! (`store::pace`): one `next_at` per model; a reservation takes `max(next_at, now)` if that
//! comes within the wait the call has left, and moves `next_at` on by the call's spacing. Like
//! every run-store call of the world, it is held while its worker is frozen and refused during a
//! store outage (the replica then paces alone for a while, as in production).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

pub use abada_devkit::model::Quantization;
use abada_devkit::model::{LimitCore, RateLimit};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use super::World;
use abada_agent_worker::provider::capacity::{RateLimits, SharedPace, SharedTurn};

/// The answer the trace records for a call the provider's limit refused (an injected 429 fault
/// is `429`).
pub const LIMIT_REFUSED: &str = "limit-429";

/// A seed's provider limit: how many requests a minute the world's model allows, how it
/// enforces them over each second, whether its answers state the figures, and whether the
/// workers pace as one queue (the fleet's shared pace, as with a run store shared by replicas).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProviderLimitPlan {
    pub requests_per_minute: u32,
    pub quantization: Quantization,
    pub stated: bool,
    pub shared_pacing: bool,
    /// A gateway in front of it adds hostile figures to every answer it lets through: the
    /// requests budget at `0` with a reset nobody can read (`NaN`, a negative duration, a
    /// word, nothing), the header that once held a model for good while health checks stayed
    /// green.
    pub hostile: bool,
}

/// The unreadable resets a hostile gateway states, one after the other.
const HOSTILE_RESETS: [&str; 4] = ["NaN", "-3s", "soon", ""];

/// What the provider did with a request that arrived.
pub(crate) enum Arrival {
    /// No limit in this world.
    Unlimited,
    /// Let through; the answer states these figures (empty when the provider states none).
    Admitted(RateLimits),
    /// Let through by a hostile gateway: the answer states these figures, a budget at zero
    /// without a readable reset among them.
    Hostile(RateLimits),
    /// Over the limit: 429, stating these figures, asking for this wait (none when the
    /// provider states nothing).
    Refused {
        limits: RateLimits,
        retry_after: Option<Duration>,
    },
}

/// The world's provider capacity: the quotas every worker shares (one per provider name), and
/// the shared pace.
pub(crate) struct ProviderCapacity {
    plan: Option<ProviderLimitPlan>,
    /// When the world's clock started: every quota's second windows start there.
    start: Instant,
    limits: Mutex<BTreeMap<String, LimitCore>>,
    /// The shared pace's `next_at`, per model.
    pace: Mutex<BTreeMap<String, Instant>>,
    /// Answers a hostile gateway stated figures on, for [`HOSTILE_RESETS`]' turn.
    hostile_answers: Mutex<usize>,
}

impl ProviderCapacity {
    /// The capacity of a world whose clock starts now.
    pub(crate) fn new(plan: Option<ProviderLimitPlan>) -> Self {
        ProviderCapacity {
            plan,
            start: Instant::now(),
            limits: Mutex::new(BTreeMap::new()),
            pace: Mutex::new(BTreeMap::new()),
            hostile_answers: Mutex::new(0),
        }
    }

    pub(crate) fn plan(&self) -> Option<ProviderLimitPlan> {
        self.plan
    }

    /// A request to `provider`'s model arrives at `now`, the world's engine clock at `wall_ms`.
    pub(crate) fn arrive(
        &self,
        provider: &str,
        now: Instant,
        wall_ms: i64,
        max_wait: Duration,
    ) -> Arrival {
        let Some(plan) = self.plan else {
            return Arrival::Unlimited;
        };
        let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        let limit = limits.entry(provider.to_string()).or_insert_with(|| {
            LimitCore::new(
                RateLimit {
                    requests_per_minute: plan.requests_per_minute,
                    tokens_per_minute: None,
                    quantization: plan.quantization,
                    stated: plan.stated,
                },
                self.start,
            )
        });
        // The tokens budget never binds here (none is set): the call's tokens do not matter.
        let (headers, retry_after) = limit.take(0, now);
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            if let Ok(v) = HeaderValue::from_str(&value) {
                map.insert(HeaderName::from_static(name), v);
            }
        }
        let hostile = retry_after.is_none() && self.plan.is_some_and(|p| p.hostile);
        if hostile {
            let mut n = self
                .hostile_answers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let reset = HOSTILE_RESETS[*n % HOSTILE_RESETS.len()];
            *n += 1;
            map.insert(
                HeaderName::from_static("x-ratelimit-remaining-requests"),
                HeaderValue::from_static("0"),
            );
            map.insert(
                HeaderName::from_static("x-ratelimit-reset-requests"),
                HeaderValue::from_static(reset),
            );
        }
        let wall = UNIX_EPOCH + Duration::from_millis(u64::try_from(wall_ms).unwrap_or(0));
        let limits = RateLimits::parse(&map, wall, max_wait);
        match retry_after {
            None if hostile => Arrival::Hostile(limits),
            None => Arrival::Admitted(limits),
            Some(wait) => Arrival::Refused {
                limits,
                // A provider stating nothing answers a bare 429 (as the scripted model does).
                retry_after: self.plan.is_some_and(|p| p.stated).then_some(wait),
            },
        }
    }

    /// The shared pace's rule (`store::pace`): reserves the next start of `model`.
    fn reserve(&self, model: &str, spacing: Duration, within: Duration) -> SharedTurn {
        let now = Instant::now();
        let mut pace = self.pace.lock().unwrap_or_else(|e| e.into_inner());
        let next = pace.entry(model.to_string()).or_insert(now);
        let slot = (*next).max(now);
        if slot <= now + within {
            *next = slot + spacing;
            SharedTurn::In(slot - now)
        } else {
            SharedTurn::Beyond(slot - now)
        }
    }
}

/// One worker's door to the fleet's shared pace in the world (see the module docs).
pub struct WorldPace {
    world: Arc<World>,
    worker_id: String,
}

impl WorldPace {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldPace {
            world,
            worker_id: worker_id.into(),
        }
    }
}

#[async_trait::async_trait]
impl SharedPace for WorldPace {
    async fn reserve(
        &self,
        model: &str,
        spacing: Duration,
        within: Duration,
    ) -> Result<SharedTurn, String> {
        self.world.hold(&self.worker_id).await;
        if self.world.faults().store_down(self.world.elapsed_ms()) {
            // A refused connection takes a moment, as the world's store's do.
            tokio::time::sleep(Duration::from_millis(5)).await;
            return Err("the run store refused the connection (simulated outage)".into());
        }
        Ok(self.world.provider.reserve(model, spacing, within))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each provider name is a quota of its own: a second's worth of one does not take the
    /// other's (the two pacers of a worker then cannot meet in one quota).
    #[tokio::test(start_paused = true)]
    async fn each_provider_name_has_a_quota_of_its_own() {
        let capacity = ProviderCapacity::new(Some(ProviderLimitPlan {
            requests_per_minute: 120,
            quantization: Quantization::SecondWindow,
            stated: true,
            shared_pacing: false,
            hostile: false,
        }));
        let wait = Duration::from_secs(60);
        let admitted = |a: Arrival| matches!(a, Arrival::Admitted(_));
        let now = Instant::now();
        assert!(admitted(capacity.arrive("sim", now, 0, wait)));
        assert!(admitted(capacity.arrive("sim", now, 0, wait)));
        assert!(
            matches!(
                capacity.arrive("sim", now, 0, wait),
                Arrival::Refused {
                    retry_after: Some(_),
                    ..
                }
            ),
            "a second's worth of 120 a minute is 2"
        );
        assert!(admitted(capacity.arrive("simsmall", now, 0, wait)));
        assert!(admitted(capacity.arrive("simsmall", now, 0, wait)));
        assert!(!admitted(capacity.arrive("simsmall", now, 0, wait)));
        // The next window lets each through again.
        tokio::time::advance(Duration::from_secs(1)).await;
        let now = Instant::now();
        assert!(admitted(capacity.arrive("sim", now, 1_000, wait)));
        assert!(admitted(capacity.arrive("simsmall", now, 1_000, wait)));
    }
}
