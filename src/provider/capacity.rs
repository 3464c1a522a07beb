//! Each model's capacity as its provider states it: how many calls may start now, and when the
//! next one may. The runner claims no more tasks than this allows (admission), and a call that
//! would exceed it waits inside its task, within a bound, instead of being sent to a 429.
//!
//! What it learns from (every answer, success or not, parsed by [`RateLimits::parse`]):
//! - OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset as a duration
//!   (`1s`, `6m0s`, `20ms`, `1h2m3.5s`);
//! - Anthropic: `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, the reset as an
//!   RFC 3339 instant;
//! - `retry-after-ms`, `retry-after` (seconds or an HTTP date) on a 429;
//! - for a provider that sends none of these: the 429s themselves ([`ModelCapacities::throttled`]).
//!
//! The requests budget is a token bucket, as both vendors describe theirs: `remaining` calls at
//! the instant the answer came, refilled evenly up to `limit` by the reset. Calls this worker
//! started after the call that carried the figure are not in it yet and are counted against it
//! (the provider counts a request when it arrives). Without a `limit` the figure holds until its
//! reset, then nothing is known. A tokens budget at zero holds every call until it refills.
//!
//! Everything here is outside input: a value that does not parse is ignored, numbers saturate,
//! and no wait the provider asks for is longer than [`CapacityPolicy::max_wait`]. The state is
//! pure (every operation takes the instant, `tokio::time::Instant` so the paused clock drives
//! the tests) and bounded: at most [`CapacityPolicy::max_models`] models, and per model at most
//! [`CapacityPolicy::max_starts`] call starts remembered.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use tokio::time::Instant;

use super::ModelRef;

/// The bounds of what a provider can make the worker believe.
#[derive(Clone, Debug)]
pub struct CapacityPolicy {
    /// A 429 without `Retry-After` holds the model this long, doubled for each further 429 in a
    /// row (up to `max_wait`).
    pub(crate) throttle_default: Duration,
    /// The longest a reset, a `Retry-After` or a throttle holds a model.
    pub(crate) max_wait: Duration,
    /// Models tracked at most; past that a new model is not tracked (no bound known).
    pub(crate) max_models: usize,
    /// Call starts remembered per model (those after the freshest figure).
    pub(crate) max_starts: usize,
    /// How long a claimed task counts against the capacity before its first call starts
    /// ([`ModelCapacities::claimed`]); a task that never calls stops counting after this.
    pub(crate) claim_ttl: Duration,
}

impl Default for CapacityPolicy {
    fn default() -> Self {
        CapacityPolicy {
            throttle_default: Duration::from_secs(1),
            max_wait: Duration::from_secs(600),
            max_models: 1024,
            max_starts: 4096,
            claim_ttl: Duration::from_secs(5),
        }
    }
}

/// One budget as a provider states it on an answer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Budget {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    /// Until the budget is full again, from the answer.
    pub reset: Option<Duration>,
}

impl Budget {
    fn is_empty(&self) -> bool {
        self.limit.is_none() && self.remaining.is_none() && self.reset.is_none()
    }
}

/// What one answer's headers say about the model's limits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateLimits {
    pub requests: Budget,
    pub tokens: Budget,
    /// `retry-after-ms` or `Retry-After`.
    pub retry_after: Option<Duration>,
}

/// How often a call waiting for the first answer of a model looks again.
const PROBE_POLL: Duration = Duration::from_millis(20);

/// The largest count believed (a `remaining` of 10^30 is a hostile or broken provider).
const MAX_COUNT: u64 = 1 << 40;

impl RateLimits {
    /// Reads the headers of an answer received at `now` (wall clock, for RFC 3339 and HTTP
    /// dates). Values that do not parse are ignored; none of them can panic.
    pub fn parse(headers: &HeaderMap, now: SystemTime, max_wait: Duration) -> RateLimits {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let count = |name: &str| text(name).and_then(parse_count);
        let openai = |kind: &str| Budget {
            limit: count(&format!("x-ratelimit-limit-{kind}")),
            remaining: count(&format!("x-ratelimit-remaining-{kind}")),
            reset: text(&format!("x-ratelimit-reset-{kind}"))
                .and_then(parse_go_duration)
                .map(|d| d.min(max_wait)),
        };
        let anthropic = |kind: &str| Budget {
            limit: count(&format!("anthropic-ratelimit-{kind}-limit")),
            remaining: count(&format!("anthropic-ratelimit-{kind}-remaining")),
            reset: text(&format!("anthropic-ratelimit-{kind}-reset"))
                .and_then(|v| parse_rfc3339_from(v, now))
                .map(|d| d.min(max_wait)),
        };
        let pick = |a: Budget, b: Budget| if a.is_empty() { b } else { a };
        RateLimits {
            requests: pick(openai("requests"), anthropic("requests")),
            tokens: pick(openai("tokens"), anthropic("tokens")),
            retry_after: super::parse_retry_after(headers, now).map(|d| d.min(max_wait)),
        }
    }

    /// Whether the headers said anything at all.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty() && self.tokens.is_empty() && self.retry_after.is_none()
    }
}

fn parse_count(v: &str) -> Option<u64> {
    // Only plain digits: no sign, no fraction, no exponent. Saturated, not refused, when huge.
    if v.is_empty() || v.len() > 64 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(v.parse::<u64>().unwrap_or(u64::MAX).min(MAX_COUNT))
}

/// A Go `time.Duration` string as OpenAI sends it: `1s`, `6m0s`, `20ms`, `1h2m3.5s`, `0.5s`.
/// None for anything else (a sign, a missing unit, garbage); saturates far beyond any wait.
fn parse_go_duration(v: &str) -> Option<Duration> {
    if v.is_empty() || v.len() > 64 {
        return None;
    }
    let mut rest = v;
    let mut total = 0f64;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * seconds;
    }
    if !total.is_finite() || total < 0.0 {
        return None;
    }
    // Far beyond any wait, and within what `Duration::from_secs_f64` accepts.
    Some(Duration::from_secs_f64(total.min(1e9)))
}

/// The time from `now` until an RFC 3339 instant (zero when it has passed).
fn parse_rfc3339_from(v: &str, now: SystemTime) -> Option<Duration> {
    let at = chrono::DateTime::parse_from_rfc3339(v).ok()?;
    let at = SystemTime::from(at.with_timezone(&chrono::Utc));
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// How many calls of a model (or of a set of models) may start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// Nothing known bounds it.
    Unbounded,
    /// This many (at least 1).
    Now(u32),
    /// None before this instant.
    Until(Instant),
}

/// The freshest requests budget of a model.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// When the call that carried the figure was sent: calls started after it are not in it.
    sent: Instant,
    /// When the figure held (the send: see [`ModelCapacities::observe`]).
    at: Instant,
    remaining: f64,
    limit: Option<f64>,
    /// Calls per second regained (0 without a limit or a reset).
    refill: f64,
    /// When it is full again.
    full_at: Option<Instant>,
}

impl Bucket {
    fn new(sent: Instant, at: Instant, b: &Budget) -> Option<Bucket> {
        let remaining = b.remaining? as f64;
        let limit = b.limit.map(|l| (l as f64).max(remaining));
        let full_at = b.reset.map(|r| at + r);
        let refill = match (limit, b.reset) {
            (Some(l), Some(r)) if r > Duration::ZERO && l > remaining => {
                (l - remaining) / r.as_secs_f64()
            }
            _ => 0.0,
        };
        Some(Bucket {
            sent,
            at,
            remaining,
            limit,
            refill,
            full_at,
        })
    }

    /// Calls the provider allows at `now`, before this worker's own starts are counted;
    /// `None` once a bucket without a limit has reset (nothing known).
    fn level(&self, now: Instant) -> Option<f64> {
        let past = now.saturating_duration_since(self.at);
        match self.limit {
            Some(limit) if self.full_at.is_some_and(|f| now >= f) => Some(limit),
            Some(limit) => Some((self.remaining + self.refill * past.as_secs_f64()).min(limit)),
            None if self.full_at.is_some_and(|f| now >= f) => None,
            None => Some(self.remaining),
        }
    }

    /// When the level reaches `needed` (not before `now`).
    fn reaches(&self, needed: f64, now: Instant, max_wait: Duration) -> Instant {
        if self.refill > 0.0 {
            let secs = ((needed - self.remaining) / self.refill).max(0.0);
            let at = self.at + Duration::from_secs_f64(secs.min(max_wait.as_secs_f64()));
            return at.max(now).min(self.full_at.unwrap_or(at).max(now));
        }
        self.full_at.unwrap_or(now + max_wait).max(now)
    }
}

/// One model's capacity.
#[derive(Debug, Default)]
struct ModelState {
    requests: Option<Bucket>,
    /// The tokens budget is spent: held until then.
    tokens_until: Option<Instant>,
    /// A `Retry-After` or a 429: held until then.
    held_until: Option<Instant>,
    /// 429s in a row without a `Retry-After`.
    throttles: u32,
    /// A call of this model has ended (answered or not) since it was tracked: until then its
    /// first call goes alone, so a worker does not open on a provider with a burst of calls
    /// its limit refuses before the first answer tells it the limit.
    known: bool,
    /// Call starts not yet in the freshest figure, oldest first.
    starts: VecDeque<Instant>,
    last_used: Option<Instant>,
}

impl ModelState {
    fn capacity(&self, now: Instant, policy: &CapacityPolicy) -> Capacity {
        let held = [self.held_until, self.tokens_until]
            .into_iter()
            .flatten()
            .filter(|u| *u > now)
            .max();
        if let Some(until) = held {
            return Capacity::Until(until);
        }
        if !self.known && !self.starts.is_empty() {
            return Capacity::Until(now + PROBE_POLL);
        }
        let Some(bucket) = &self.requests else {
            return Capacity::Unbounded;
        };
        let Some(level) = bucket.level(now) else {
            return Capacity::Unbounded;
        };
        let used = self.starts.iter().filter(|s| **s > bucket.sent).count() as f64;
        let free = (level - used).floor();
        if free >= 1.0 {
            Capacity::Now(free.min(u32::MAX as f64) as u32)
        } else {
            Capacity::Until(bucket.reaches(used + 1.0, now, policy.max_wait))
        }
    }

    fn prune(&mut self, max_starts: usize) {
        if let Some(b) = &self.requests {
            while self.starts.front().is_some_and(|s| *s <= b.sent) {
                self.starts.pop_front();
            }
        }
        while self.starts.len() > max_starts {
            self.starts.pop_front();
        }
    }
}

/// Every model's capacity, shared by the tasks of the worker (held by the provider registry).
#[derive(Debug, Default)]
pub struct ModelCapacities {
    policy: CapacityPolicy,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    models: HashMap<ModelRef, ModelState>,
    /// Tasks claimed whose first call has not started, each until it expires.
    claims: VecDeque<Instant>,
}

impl ModelCapacities {
    pub fn new(policy: CapacityPolicy) -> Self {
        ModelCapacities {
            policy,
            state: Mutex::new(State::default()),
        }
    }

    pub fn policy(&self) -> &CapacityPolicy {
        &self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every operation leaves the state consistent: a panic elsewhere cannot poison it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn entry<'a>(
        &self,
        state: &'a mut State,
        model: &ModelRef,
        now: Instant,
    ) -> Option<&'a mut ModelState> {
        if !state.models.contains_key(model) {
            if state.models.len() >= self.policy.max_models {
                // Forget the model unused longest.
                let oldest = state
                    .models
                    .iter()
                    .min_by_key(|(_, s)| s.last_used)
                    .map(|(m, _)| m.clone());
                if let Some(m) = oldest {
                    state.models.remove(&m);
                }
            }
            if state.models.len() >= self.policy.max_models {
                return None;
            }
            state.models.insert(model.clone(), ModelState::default());
        }
        let s = state.models.get_mut(model)?;
        s.last_used = Some(now);
        Some(s)
    }

    /// How many calls of `model` may start at `now`.
    pub fn capacity(&self, model: &ModelRef, now: Instant) -> Capacity {
        self.lock()
            .models
            .get(model)
            .map_or(Capacity::Unbounded, |s| s.capacity(now, &self.policy))
    }

    /// Takes one call of `model` at `now`, or says when one may start.
    pub(crate) fn try_start(&self, model: &ModelRef, now: Instant) -> Result<(), Instant> {
        let mut state = self.lock();
        let policy = &self.policy;
        if let Some(s) = self.entry(&mut state, model, now) {
            if let Capacity::Until(at) = s.capacity(now, policy) {
                return Err(at);
            }
            s.starts.push_back(now);
            s.prune(policy.max_starts);
        }
        // A claimed task's first call: no longer only claimed.
        state.claims.pop_front();
        Ok(())
    }

    /// What an answer of `model` said, for a call sent at `sent` and answered at `now`. A
    /// figure older than the one held (an earlier send answered later) is not taken.
    pub fn observe(&self, model: &ModelRef, sent: Instant, now: Instant, limits: &RateLimits) {
        if limits.is_empty() {
            return;
        }
        let mut state = self.lock();
        let Some(s) = self.entry(&mut state, model, now) else {
            return;
        };
        s.known = true;
        // The provider counts a request, and states its figure, when the request arrives: the
        // figure holds as of the send (a provider that answers it later is only seen as
        // fuller than it was a moment ago, and the starts since are counted either way).
        if let Some(b) = Bucket::new(sent, sent, &limits.requests)
            && s.requests.is_none_or(|old| old.sent <= sent)
        {
            s.requests = Some(b);
        }
        if limits.tokens.remaining == Some(0)
            && let Some(reset) = limits.tokens.reset
        {
            let until = now + reset.max(Duration::from_millis(1));
            s.tokens_until = Some(s.tokens_until.map_or(until, |u| u.max(until)));
        }
        if let Some(ra) = limits.retry_after {
            let until = now + ra;
            s.held_until = Some(s.held_until.map_or(until, |u| u.max(until)));
        }
        s.prune(self.policy.max_starts);
    }

    /// `model` answered a call with a 429 at `now`, with `retry_after` if it said: held for
    /// that long, or (a provider that says nothing) for `throttle_default` doubled per 429 in a
    /// row. Returns until when.
    pub fn throttled(
        &self,
        model: &ModelRef,
        retry_after: Option<Duration>,
        now: Instant,
    ) -> Instant {
        let policy = &self.policy;
        let mut state = self.lock();
        let Some(s) = self.entry(&mut state, model, now) else {
            return now;
        };
        s.known = true;
        let wait = match retry_after {
            Some(d) => {
                s.throttles = 0;
                d
            }
            None => {
                s.throttles = s.throttles.saturating_add(1);
                policy
                    .throttle_default
                    .saturating_mul(2u32.saturating_pow((s.throttles - 1).min(20)))
            }
        }
        .min(policy.max_wait);
        let until = now + wait;
        let until = s.held_until.map_or(until, |u| u.max(until));
        s.held_until = Some(until);
        until
    }

    /// A call of `model` ended, `answered` or not: its first call is over (see `known`), and
    /// an answer ends a run of 429s without `Retry-After`.
    pub fn ended(&self, model: &ModelRef, answered: bool) {
        if let Some(s) = self.lock().models.get_mut(model) {
            s.known = true;
            if answered {
                s.throttles = 0;
            }
        }
    }

    /// Whether `model`'s first call is still out, the others waiting for what it tells.
    pub fn probing(&self, model: &ModelRef) -> bool {
        self.lock()
            .models
            .get(model)
            .is_some_and(|s| !s.known && !s.starts.is_empty())
    }

    /// The runner claimed `n` tasks at `now`: they count against the capacity until their first
    /// call starts (or `claim_ttl` passes), so the next fetch does not claim the same calls.
    pub fn claimed(&self, n: u32, now: Instant) {
        let mut state = self.lock();
        let until = now + self.policy.claim_ttl;
        for _ in 0..n.min(self.policy.max_starts as u32) {
            state.claims.push_back(until);
        }
        while state.claims.len() > self.policy.max_starts {
            state.claims.pop_front();
        }
    }

    /// How many tasks whose calls go to `models` may be claimed at `now`: the sum of what each
    /// may start, less the tasks claimed that have not called yet. `Unbounded` when a model's
    /// capacity is not known (a task may use any of them).
    pub fn admission(&self, models: &[ModelRef], now: Instant) -> Capacity {
        let mut state = self.lock();
        while state.claims.front().is_some_and(|until| *until <= now) {
            state.claims.pop_front();
        }
        let pending = state.claims.len() as u64;
        let mut free = 0u64;
        let mut next: Option<Instant> = state.claims.front().copied();
        for m in models {
            let capacity = state
                .models
                .get(m)
                .map_or(Capacity::Unbounded, |s| s.capacity(now, &self.policy));
            match capacity {
                Capacity::Unbounded => return Capacity::Unbounded,
                Capacity::Now(n) => {
                    free += u64::from(n);
                    // One more call of this model needs its next refill.
                    if let Some(s) = state.models.get(m)
                        && let Some(b) = &s.requests
                    {
                        let used = s.starts.iter().filter(|t| **t > b.sent).count() as f64;
                        let at = b.reaches(used + f64::from(n) + 1.0, now, self.policy.max_wait);
                        next = Some(next.map_or(at, |x| x.min(at)));
                    }
                }
                Capacity::Until(at) => next = Some(next.map_or(at, |x| x.min(at))),
            }
        }
        if models.is_empty() {
            return Capacity::Unbounded;
        }
        match free.saturating_sub(pending) {
            0 => Capacity::Until(next.unwrap_or(now + self.policy.claim_ttl).max(now)),
            n => Capacity::Now(n.min(u64::from(u32::MAX)) as u32),
        }
    }

    /// The models tracked, with what each may start at `now` (the capacity gauge).
    pub fn snapshot(&self, now: Instant) -> Vec<(ModelRef, Capacity)> {
        self.lock()
            .models
            .iter()
            .map(|(m, s)| (m.clone(), s.capacity(now, &self.policy)))
            .collect()
    }

    /// The models tracked: every model called lately.
    pub(crate) fn tracked_models(&self) -> Vec<ModelRef> {
        self.lock().models.keys().cloned().collect()
    }

    /// How many models are tracked (tests).
    pub fn tracked(&self) -> usize {
        self.lock().models.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn model(name: &str) -> ModelRef {
        ModelRef::parse(&format!("p/{name}")).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                reqwest::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    const MAX: Duration = Duration::from_secs(600);
    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn epoch() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    #[test]
    fn openai_headers_are_read_with_go_durations() {
        let h = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let l = RateLimits::parse(&h, epoch(), MAX);
        assert_eq!(
            l.requests,
            Budget {
                limit: Some(60),
                remaining: Some(59),
                reset: Some(Duration::from_secs(1))
            }
        );
        assert_eq!(l.tokens.reset, Some(Duration::from_secs(360)));
        for (text, d) in [
            ("20ms", MS(20)),
            ("1h2m3.5s", Duration::from_millis(3_723_500)),
            ("0.5s", MS(500)),
            ("7m12s", Duration::from_secs(432)),
            ("0s", Duration::ZERO),
            ("1500us", Duration::from_micros(1500)),
        ] {
            assert_eq!(parse_go_duration(text), Some(d), "{text}");
        }
    }

    #[test]
    fn anthropic_headers_are_read_with_rfc3339_resets() {
        let reset = chrono::DateTime::<chrono::Utc>::from(epoch() + Duration::from_secs(3))
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", &reset),
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "2000-01-01T00:00:00Z"),
            ("retry-after", "4"),
        ]);
        let l = RateLimits::parse(&h, epoch(), MAX);
        assert_eq!(
            l.requests,
            Budget {
                limit: Some(50),
                remaining: Some(49),
                reset: Some(Duration::from_secs(3))
            }
        );
        assert_eq!(l.tokens.reset, Some(Duration::ZERO), "a past reset is now");
        assert_eq!(l.retry_after, Some(Duration::from_secs(4)));
    }

    /// The headers are outside input; no value panics or is believed past its bounds.
    #[test]
    fn hostile_header_values_are_ignored_or_bounded_without_panic() {
        let hostile = [
            "-1",
            "-5s",
            "1e300",
            "99999999999999999999999999999999999999",
            "NaN",
            "inf",
            "",
            " ",
            "1.2.3s",
            "..s",
            "5x",
            "s",
            "1h-2m",
            "999999999999999999999h",
            "0x10",
            "+3",
            "1_000",
            "९",
            "2024-13-45T99:99:99Z",
            "9999-12-31T23:59:59Z",
            "Tue, 01 Dec 2026 19:00:00 GMT",
        ];
        let names = [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            "retry-after",
            "retry-after-ms",
        ];
        let now = Instant::now();
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        for v in hostile {
            for n in names {
                let Ok(value) = HeaderValue::from_str(v) else {
                    continue;
                };
                let mut h = HeaderMap::new();
                h.insert(
                    reqwest::header::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    value,
                );
                let l = RateLimits::parse(&h, epoch(), MAX);
                for d in [l.requests.reset, l.tokens.reset, l.retry_after]
                    .into_iter()
                    .flatten()
                {
                    assert!(d <= MAX, "{n}: {v} -> {d:?}");
                }
                for x in [l.requests.limit, l.requests.remaining, l.tokens.remaining]
                    .into_iter()
                    .flatten()
                {
                    assert!(x <= MAX_COUNT, "{n}: {v} -> {x}");
                }
                c.observe(&m, now, now, &l);
                if let Capacity::Until(at) = c.capacity(&m, now) {
                    assert!(at <= now + MAX, "{n}: {v}");
                }
            }
        }
        // Huge counts saturate; signs and garbage are no counts.
        assert_eq!(parse_count("99999999999999999999999"), Some(MAX_COUNT));
        assert_eq!(parse_count("-1"), None);
        assert_eq!(parse_count("1.5"), None);
        assert_eq!(parse_go_duration("-5s"), None);
        assert_eq!(parse_go_duration("5"), None);
        assert_eq!(
            parse_go_duration("999999999999999999999h"),
            Some(Duration::from_secs_f64(1e9))
        );
        // Bytes that are no UTF-8 are no value.
        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        );
        assert!(RateLimits::parse(&h, epoch(), MAX).is_empty());
    }

    fn limits(limit: u64, remaining: u64, reset: Duration) -> RateLimits {
        RateLimits {
            requests: Budget {
                limit: Some(limit),
                remaining: Some(remaining),
                reset: Some(reset),
            },
            ..RateLimits::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_model_without_figures_is_unbounded() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        assert_eq!(c.capacity(&m, Instant::now()), Capacity::Unbounded);
        // Its first call goes alone: the others wait for what its answer tells.
        assert_eq!(c.try_start(&m, Instant::now()), Ok(()));
        assert!(c.probing(&m));
        assert_eq!(
            c.try_start(&m, Instant::now()),
            Err(Instant::now() + PROBE_POLL)
        );
        // An answer that states nothing: no bound.
        c.ended(&m, true);
        assert!(!c.probing(&m));
        for _ in 0..100 {
            assert_eq!(c.try_start(&m, Instant::now()), Ok(()));
        }
        c.observe(&m, Instant::now(), Instant::now(), &RateLimits::default());
        assert_eq!(c.capacity(&m, Instant::now()), Capacity::Unbounded);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_started_after_the_figure_count_against_it_and_the_bucket_refills() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        let t0 = Instant::now();
        // 2 per second: 1 left, full again in 500 ms (one call regained every 500 ms).
        c.observe(&m, t0, t0, &limits(2, 1, MS(500)));
        assert_eq!(c.capacity(&m, t0), Capacity::Now(1));
        tokio::time::advance(MS(1)).await;
        let t1 = Instant::now();
        assert_eq!(c.try_start(&m, t1), Ok(()));
        // Spent: the next call may start once one call is regained, at 500 ms.
        assert_eq!(c.capacity(&m, t1), Capacity::Until(t0 + MS(500)));
        assert_eq!(c.try_start(&m, t1), Err(t0 + MS(500)));
        assert_eq!(c.capacity(&m, t0 + MS(500)), Capacity::Now(1));
        // A figure from a call sent before t1 does not count the t1 call yet: still counted.
        c.observe(&m, t0, t0 + MS(2), &limits(2, 1, MS(500)));
        assert!(matches!(c.capacity(&m, t1 + MS(1)), Capacity::Until(_)));
        // The answer to the t1 call: 0 left as of its send, and the t1 start is in it now.
        c.observe(&m, t1, t1 + MS(10), &limits(2, 0, MS(1000)));
        assert_eq!(c.capacity(&m, t1 + MS(10)), Capacity::Until(t1 + MS(500)));
        assert_eq!(c.capacity(&m, t1 + MS(1000)), Capacity::Now(2));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_limit_the_figure_holds_until_its_reset() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("a");
        let t0 = Instant::now();
        let l = RateLimits {
            requests: Budget {
                limit: None,
                remaining: Some(0),
                reset: Some(Duration::from_secs(2)),
            },
            ..RateLimits::default()
        };
        c.observe(&m, t0, t0, &l);
        assert_eq!(
            c.capacity(&m, t0 + MS(1999)),
            Capacity::Until(t0 + Duration::from_secs(2))
        );
        assert_eq!(
            c.capacity(&m, t0 + Duration::from_secs(2)),
            Capacity::Unbounded
        );
    }

    /// A provider that sends nothing is throttled by the 429s it answers.
    #[tokio::test(start_paused = true)]
    async fn a_provider_that_sends_nothing_is_throttled_by_its_429s() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let m = model("quiet");
        let t0 = Instant::now();
        assert_eq!(c.try_start(&m, t0), Ok(()));
        assert_eq!(c.throttled(&m, None, t0), t0 + Duration::from_secs(1));
        assert_eq!(
            c.try_start(&m, t0 + MS(999)),
            Err(t0 + Duration::from_secs(1))
        );
        assert_eq!(
            c.admission(std::slice::from_ref(&m), t0 + MS(10)),
            Capacity::Until(t0 + Duration::from_secs(1))
        );
        // Another 429 in a row: twice as long; an answer ends the run.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(c.try_start(&m, t1), Ok(()));
        assert_eq!(c.throttled(&m, None, t1), t1 + Duration::from_secs(2));
        c.ended(&m, true);
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(c.throttled(&m, None, t2), t2 + Duration::from_secs(1));
        // A Retry-After is taken as said, bounded.
        let t3 = t2 + Duration::from_secs(5);
        assert_eq!(c.throttled(&m, Some(MS(250)), t3), t3 + MS(250));
        assert_eq!(
            c.throttled(&m, Some(Duration::from_secs(1 << 40)), t3),
            t3 + MAX
        );
    }

    /// Admission never claims more than the models can start, counting the tasks
    /// claimed that have not called yet.
    #[tokio::test(start_paused = true)]
    async fn admission_never_exceeds_capacity_and_counts_claims_not_yet_started() {
        let c = ModelCapacities::new(CapacityPolicy::default());
        let (a, b) = (model("a"), model("b"));
        let both = [a.clone(), b.clone()];
        let t0 = Instant::now();
        let sent = t0 - MS(1);
        assert_eq!(c.admission(&both, t0), Capacity::Unbounded);
        c.observe(&a, sent, t0, &limits(10, 3, Duration::from_secs(7)));
        assert_eq!(c.admission(&both, t0), Capacity::Unbounded, "b unknown");
        c.observe(&b, sent, t0, &limits(10, 2, Duration::from_secs(8)));
        assert_eq!(c.admission(&both, t0), Capacity::Now(5));
        c.claimed(4, t0);
        assert_eq!(c.admission(&both, t0), Capacity::Now(1));
        c.claimed(1, t0);
        // Full: the next is when one more call is regained (a: 1 per second).
        assert_eq!(
            c.admission(&both, t0),
            Capacity::Until(sent + Duration::from_secs(1))
        );
        // The claimed tasks start their calls: the claims turn into starts, no double count.
        for _ in 0..3 {
            assert_eq!(c.try_start(&a, t0), Ok(()));
        }
        for _ in 0..2 {
            assert_eq!(c.try_start(&b, t0), Ok(()));
        }
        assert!(matches!(c.admission(&both, t0), Capacity::Until(_)));
        assert!(c.try_start(&a, t0).is_err());
        // A claim that never calls stops counting after its TTL.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(c.admission(&both, t1), Capacity::Now(2));
        c.claimed(2, t1);
        assert!(matches!(c.admission(&both, t1), Capacity::Until(_)));
        let t2 = t1 + Duration::from_secs(5);
        assert!(matches!(c.admission(&both, t2), Capacity::Now(n) if n >= 1));
        // Driven like the runner does, admission never lets more calls start than allowed:
        // 3 + 2 at once, then one per second of each.
        let c = ModelCapacities::new(CapacityPolicy::default());
        let t0 = Instant::now();
        let sent = t0 - MS(1);
        c.observe(&a, sent, t0, &limits(10, 3, Duration::from_secs(7)));
        c.observe(&b, sent, t0, &limits(10, 2, Duration::from_secs(8)));
        let mut started = 0u32;
        let mut now = t0;
        while now < sent + Duration::from_secs(5) {
            match c.admission(&both, now) {
                Capacity::Now(n) => {
                    c.claimed(n, now);
                    for _ in 0..n {
                        let ok = c.try_start(&a, now).or_else(|_| c.try_start(&b, now));
                        assert!(ok.is_ok(), "admitted a task that cannot start at {now:?}");
                        started += 1;
                    }
                }
                Capacity::Until(at) => {
                    assert!(at > now);
                    now = at;
                }
                Capacity::Unbounded => panic!("known models"),
            }
        }
        // a: 3, then 4 regained before 5 s (at 1, 2, 3, 4 s); b: 2, then 4 the same.
        assert_eq!(
            started,
            3 + 4 + 2 + 4,
            "every regained call used, none more"
        );
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
            c.observe(&m, now, now, &limits(10, 5, Duration::from_secs(1)));
            for _ in 0..50 {
                let _ = c.try_start(&m, now);
            }
            c.claimed(1000, now);
        }
        assert_eq!(c.tracked(), 4);
        let state = c.lock();
        assert!(state.models.values().all(|s| s.starts.len() <= 8));
        assert!(state.claims.len() <= 8);
    }
}
