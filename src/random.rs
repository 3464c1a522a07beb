//! Where a worker's randomness comes from: the jitter of every backoff and of the poll loop's
//! idle wait, approval request ids, the span ids of the trace context sent on, the engine
//! client's idempotency keys. One [`Random`] per worker, given by the composition root
//! (`app::Seams::random`): the operating system's generator in production, a generator seeded
//! from the seed in the simulator, so that a seed's run draws the same numbers in every process
//! and its trace replays exactly.
//!
//! Nothing in the worker's core draws randomness any other way: `tests/it/determinism.rs` reads
//! the sources and fails on a draw that bypasses this type.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// A worker's source of random numbers (cheap to clone: clones share the source).
#[derive(Clone, Default)]
pub struct Random(Source);

#[derive(Clone, Default)]
enum Source {
    /// The thread's CSPRNG, seeded from the operating system (`rand::rng`).
    #[default]
    Os,
    /// A generator seeded by the caller: the same seed draws the same numbers, in order.
    Seeded(Arc<Mutex<StdRng>>),
}

impl Random {
    /// The operating system's randomness: production's.
    pub fn os() -> Random {
        Random(Source::Os)
    }

    /// A generator seeded from `seed`: the same seed gives the same draws, in every process.
    /// Not for secrets an attacker could guess (approval request ids are drawn from it): only
    /// the simulator and tests use it.
    pub fn seeded(seed: u64) -> Random {
        Random(Source::Seeded(Arc::new(Mutex::new(StdRng::seed_from_u64(
            seed,
        )))))
    }

    /// A uniform draw in `0.0..1.0`.
    pub fn unit(&self) -> f64 {
        match &self.0 {
            Source::Os => rand::random::<f64>(),
            Source::Seeded(rng) => rng
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .random::<f64>(),
        }
    }

    /// Fills `bytes` with random bytes.
    pub fn fill(&self, bytes: &mut [u8]) {
        match &self.0 {
            Source::Os => rand::fill(bytes),
            Source::Seeded(rng) => rng
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .fill_bytes(bytes),
        }
    }

    /// `N` random bytes.
    pub fn bytes<const N: usize>(&self) -> [u8; N] {
        let mut bytes = [0u8; N];
        self.fill(&mut bytes);
        bytes
    }

    /// A version 7 UUID: the wall clock's milliseconds, then 74 random bits.
    pub fn uuid_v7(&self) -> uuid::Uuid {
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        uuid::Builder::from_unix_timestamp_millis(millis, &self.bytes()).into_uuid()
    }
}

impl std::fmt::Debug for Random {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Source::Os => "Random(os)",
            Source::Seeded(_) => "Random(seeded)",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_draws_the_same_numbers_and_another_seed_others() {
        let draws = |r: &Random| (r.unit(), r.bytes::<16>(), r.unit());
        let (a, b) = (Random::seeded(7), Random::seeded(7));
        assert_eq!(draws(&a), draws(&b));
        assert_ne!(draws(&Random::seeded(7)), draws(&Random::seeded(8)));
        // Clones share the source: the second draw is not the first again.
        let c = a.clone();
        assert_ne!(a.bytes::<16>(), c.bytes::<16>());
    }

    #[test]
    fn draws_stay_in_range_and_uuids_are_version_7() {
        for r in [Random::os(), Random::seeded(1)] {
            for _ in 0..1000 {
                let u = r.unit();
                assert!((0.0..1.0).contains(&u), "{u}");
            }
            let id = r.uuid_v7();
            assert_eq!(id.get_version_num(), 7);
            assert_ne!(id, r.uuid_v7());
        }
    }
}
