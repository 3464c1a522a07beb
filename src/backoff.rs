//! Exponential backoff with full jitter, one policy type for every retry loop of the worker
//! (engine calls, the poll loop, heartbeat retries). Jitter can be switched off for tests; its
//! draws come from the worker's [`Random`].

use std::time::Duration;

use crate::random::Random;

/// How a retry loop waits: `base * 2^n`, capped at `max`, then jittered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    /// Fraction of the delay that is randomised (0.0 = none, 1.0 = full jitter).
    pub jitter: f64,
}

impl Backoff {
    pub const fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            jitter: 0.5,
        }
    }

    pub const fn without_jitter(mut self) -> Self {
        self.jitter = 0.0;
        self
    }

    /// The delay before retry number `attempt` (0-based), its jitter drawn from `random` (no
    /// draw without jitter).
    pub fn delay(&self, attempt: u32, random: &Random) -> Duration {
        let unit = if self.jitter > 0.0 {
            random.unit()
        } else {
            0.0
        };
        self.delay_with(attempt, unit)
    }

    /// [`Backoff::delay`] with the random draw given (`unit` in `0.0..1.0`), for callers whose
    /// randomness is injected.
    pub(crate) fn delay_with(&self, attempt: u32, unit: f64) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32.checked_shl(attempt.min(30)).unwrap_or(u32::MAX));
        let capped = exp.min(self.max);
        if self.jitter <= 0.0 {
            return capped;
        }
        let jitter = self.jitter.min(1.0);
        let keep = capped.mul_f64(1.0 - jitter);
        let random = capped.mul_f64(jitter * unit.clamp(0.0, 1.0));
        keep + random
    }
}

/// Stretches a periodic wait by up to `fraction` (never shortens it): replicas drift apart,
/// yet no wait is shorter than `period`, so an idle worker asks at most once per period.
pub(crate) fn stretched(period: Duration, fraction: f64, random: &Random) -> Duration {
    stretched_with(period, fraction, random.unit())
}

/// [`stretched`] with the random draw given (`unit` in `0.0..1.0`).
pub(crate) fn stretched_with(period: Duration, fraction: f64, unit: f64) -> Duration {
    if fraction <= 0.0 || period.is_zero() {
        return period;
    }
    period.mul_f64(1.0 + fraction.min(1.0) * unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_and_caps() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).without_jitter();
        assert_eq!(b.delay(0, &Random::os()), Duration::from_millis(100));
        assert_eq!(b.delay(1, &Random::os()), Duration::from_millis(200));
        assert_eq!(b.delay(3, &Random::os()), Duration::from_millis(800));
        assert_eq!(b.delay(10, &Random::os()), Duration::from_secs(2));
        assert_eq!(b.delay(u32::MAX, &Random::os()), Duration::from_secs(2));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        for n in 0..8 {
            let d = b.delay(n, &Random::os());
            let cap = Duration::from_millis(100 * (1 << n)).min(Duration::from_secs(2));
            assert!(d <= cap && d >= cap / 2, "{d:?} vs {cap:?}");
        }
        for _ in 0..100 {
            let d = stretched(Duration::from_secs(1), 0.02, &Random::os());
            assert!(d >= Duration::from_secs(1) && d <= Duration::from_millis(1020));
        }
    }
}
