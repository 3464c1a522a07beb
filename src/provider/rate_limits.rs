//! What a provider states about its limits, and the bounds on what it can make the worker
//! believe: the headers read into [`RateLimits`] (OpenAI's `x-ratelimit-*`, Anthropic's
//! `anthropic-ratelimit-*`, a reset in plain seconds from Azure-style gateways), the
//! [`CapacityPolicy`] every figure and hold is bounded by, and [`Capacity`], how many calls may
//! start now. The pacer ([`super::pacer`]) and each model's capacity ([`super::capacity`]) both
//! read them; neither owns them.
//!
//! Everything here is outside input: a value that does not parse is ignored and numbers
//! saturate.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use tokio::time::Instant;

/// The bounds of what a provider can make the worker believe, and the pacer's constants.
#[derive(Clone, Debug)]
pub struct CapacityPolicy {
    /// A 503 without `Retry-After` holds the model this long.
    pub(crate) throttle_default: Duration,
    /// The longest any figure, hold, pace increment or `Retry-After` holds a model: the model
    /// wait (`ABADA_AGENT_MODEL_WAIT_MAX_MS`).
    pub(crate) max_wait: Duration,
    /// How long a figure whose reset is absent or unreadable lasts after it was seen.
    pub(crate) figure_ttl: Duration,
    /// How long the other calls wait for a probe's answer at most.
    pub(crate) probe_timeout: Duration,
    /// The factor a 429 multiplies the pace by (AIMD's multiplicative decrease).
    pub(crate) decrease: f64,
    /// How long the additive increase takes to win back one decrease.
    pub(crate) recovery: Duration,
    /// How long a learned rate lasts after the 429 that last lowered it.
    pub(crate) learned_ttl: Duration,
    /// The share of a stated rate the pacer uses: a provider's clock and ours, the network
    /// between and the scheduling of a busy host put a call some milliseconds early or late.
    /// Against a provider enforcing a second's worth per second window, 3 % spare absorbs about
    /// 30 ms of such jitter between two calls (measured at 15 to 40 ms on a loaded 2-core host,
    /// BENCHMARKS.md).
    pub(crate) margin: f64,
    /// Models tracked at most; past that a new model is not tracked (no bound known).
    pub(crate) max_models: usize,
    /// Calls remembered per model, and claims at most.
    pub(crate) max_starts: usize,
    /// How long a claimed task counts against its topic's models before its first call joins a
    /// queue; a task that never calls stops counting after this.
    pub(crate) claim_ttl: Duration,
}

impl Default for CapacityPolicy {
    fn default() -> Self {
        CapacityPolicy {
            throttle_default: Duration::from_secs(1),
            max_wait: Duration::from_secs(60),
            figure_ttl: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(10),
            decrease: 0.7,
            recovery: Duration::from_secs(10),
            learned_ttl: Duration::from_secs(60),
            margin: 0.97,
            max_models: 1024,
            max_starts: 4096,
            claim_ttl: Duration::from_secs(5),
        }
    }
}

impl CapacityPolicy {
    /// The policy whose every wait ends within `max_wait` (`ABADA_AGENT_MODEL_WAIT_MAX_MS`).
    pub fn with_max_wait(max_wait: Duration) -> Self {
        let d = CapacityPolicy::default();
        CapacityPolicy {
            max_wait,
            figure_ttl: d.figure_ttl.min(max_wait),
            probe_timeout: d.probe_timeout.min(max_wait),
            ..d
        }
    }

    /// The longest any figure, hold, pace increment or `Retry-After` holds a model.
    pub fn max_wait(&self) -> Duration {
        self.max_wait
    }
}

/// One budget as a provider states it on an answer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Budget {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    /// Until the budget is full again, from the answer; `None` when absent or unreadable.
    pub reset: Option<Duration>,
}

impl Budget {
    fn is_empty(&self) -> bool {
        self.limit.is_none() && self.remaining.is_none() && self.reset.is_none()
    }
}

/// What one answer's headers state about the model's budgets. (A `retry-after` is not a
/// figure: it is read only on the 429 or 503 it came with, see [`ModelCapacities::throttled`].)
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateLimits {
    pub requests: Budget,
    /// Tokens of any kind (OpenAI; Anthropic's combined budget).
    pub tokens: Budget,
    /// Anthropic's input-tokens budget.
    pub input_tokens: Budget,
    /// Anthropic's output-tokens budget.
    pub output_tokens: Budget,
}

/// The largest count believed (a `remaining` of 10^30 is a hostile or broken provider).
const MAX_COUNT: u64 = 1 << 40;

impl RateLimits {
    /// Reads the headers of an answer received at `now` (wall clock, for RFC 3339 instants).
    /// Values that do not parse are ignored; none of them can panic; resets are capped at
    /// `max_wait`.
    pub fn parse(headers: &HeaderMap, now: SystemTime, max_wait: Duration) -> RateLimits {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let count = |name: &str| text(name).and_then(parse_count);
        let reset = |name: &str| {
            text(name)
                .and_then(|v| parse_reset(v, now))
                .map(|d| d.min(max_wait))
        };
        let openai = |kind: &str| Budget {
            limit: count(&format!("x-ratelimit-limit-{kind}")),
            remaining: count(&format!("x-ratelimit-remaining-{kind}")),
            reset: reset(&format!("x-ratelimit-reset-{kind}")),
        };
        let anthropic = |kind: &str| Budget {
            limit: count(&format!("anthropic-ratelimit-{kind}-limit")),
            remaining: count(&format!("anthropic-ratelimit-{kind}-remaining")),
            reset: reset(&format!("anthropic-ratelimit-{kind}-reset")),
        };
        let pick = |a: Budget, b: Budget| if a.is_empty() { b } else { a };
        RateLimits {
            requests: pick(openai("requests"), anthropic("requests")),
            tokens: pick(openai("tokens"), anthropic("tokens")),
            input_tokens: anthropic("input-tokens"),
            output_tokens: anthropic("output-tokens"),
        }
    }

    /// Whether the headers stated anything at all.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
            && self.tokens.is_empty()
            && self.input_tokens.is_empty()
            && self.output_tokens.is_empty()
    }
}

fn parse_count(v: &str) -> Option<u64> {
    // Only plain digits: no sign (Azure's `-1` is no count), no fraction, no exponent.
    // Saturated, not refused, when huge.
    if v.is_empty() || v.len() > 64 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(v.parse::<u64>().unwrap_or(u64::MAX).min(MAX_COUNT))
}

/// A reset as providers send it: a Go duration (OpenAI), plain seconds (Azure-style gateways),
/// or an RFC 3339 instant (Anthropic). None for anything else.
fn parse_reset(v: &str, now: SystemTime) -> Option<Duration> {
    parse_go_duration(v)
        .or_else(|| parse_seconds(v))
        .or_else(|| parse_rfc3339_from(v, now))
}

/// Plain non-negative seconds, `6` or `0.5`: no sign, no exponent, nothing after.
fn parse_seconds(v: &str) -> Option<Duration> {
    if v.is_empty()
        || v.len() > 32
        || !v.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        || !v.bytes().any(|b| b.is_ascii_digit())
    {
        return None;
    }
    let secs: f64 = v.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(1e9)))
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

/// How many calls of a model (or tasks of a topic) may start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// Nothing known bounds it.
    Unbounded,
    /// This many (at least 1).
    Now(u32),
    /// None before this instant.
    Until(Instant),
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use reqwest::header::{HeaderName, HeaderValue};

    /// A header map of `pairs` (the capacities' tests read answers through it too).
    pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    const MAX: Duration = Duration::from_secs(60);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

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
        let l = RateLimits::parse(&h, epoch(), Duration::from_secs(600));
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
            ("20ms", ms(20)),
            ("1h2m3.5s", ms(3_723_500)),
            ("0.5s", ms(500)),
            ("7m12s", Duration::from_secs(432)),
            ("0s", Duration::ZERO),
            ("1500us", Duration::from_micros(1500)),
        ] {
            assert_eq!(parse_go_duration(text), Some(d), "{text}");
        }
    }

    #[test]
    fn anthropic_headers_are_read_with_rfc3339_resets_for_each_budget() {
        let reset = chrono::DateTime::<chrono::Utc>::from(epoch() + Duration::from_secs(3))
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", &reset),
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "2000-01-01T00:00:00Z"),
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            ("anthropic-ratelimit-input-tokens-reset", &reset),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("anthropic-ratelimit-output-tokens-remaining", "7900"),
            ("anthropic-ratelimit-output-tokens-reset", &reset),
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
        assert_eq!(l.input_tokens.remaining, Some(39_000));
        assert_eq!(l.output_tokens.limit, Some(8_000));
        assert_eq!(l.output_tokens.reset, Some(Duration::from_secs(3)));
    }

    /// The headers are outside input: no value panics or is believed past its bounds; a
    /// reset in plain seconds is read as Azure-style gateways mean it; Azure's `-1` is no
    /// count.
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
            "6",
            "0",
            ".",
        ];
        let names = [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            "anthropic-ratelimit-output-tokens-reset",
        ];
        for v in hostile {
            for n in names {
                let Ok(value) = HeaderValue::from_str(v) else {
                    continue;
                };
                let mut h = HeaderMap::new();
                h.insert(HeaderName::from_bytes(n.as_bytes()).unwrap(), value);
                let l = RateLimits::parse(&h, epoch(), MAX);
                for b in [l.requests, l.tokens, l.input_tokens, l.output_tokens] {
                    assert!(b.reset.is_none_or(|d| d <= MAX), "{n}: {v}");
                    for x in [b.limit, b.remaining].into_iter().flatten() {
                        assert!(x <= MAX_COUNT, "{n}: {v} -> {x}");
                    }
                }
            }
        }
        assert_eq!(parse_count("99999999999999999999999"), Some(MAX_COUNT));
        assert_eq!(parse_count("-1"), None, "Azure's -1 is no count");
        assert_eq!(parse_count("1.5"), None);
        assert_eq!(parse_go_duration("-5s"), None);
        assert_eq!(
            parse_reset("6", epoch()),
            Some(Duration::from_secs(6)),
            "Azure seconds"
        );
        assert_eq!(parse_reset("0.25", epoch()), Some(ms(250)));
        for bad in ["NaN", "inf", "-6", "1e3", ".", "6 s"] {
            assert_eq!(parse_reset(bad, epoch()), None, "{bad}");
        }
        assert_eq!(
            parse_go_duration("999999999999999999999h"),
            Some(Duration::from_secs_f64(1e9))
        );
        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        );
        assert!(RateLimits::parse(&h, epoch(), MAX).is_empty());
    }
}
