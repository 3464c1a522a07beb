//! The in-memory world the deterministic simulator runs workers against: the engine (the
//! devkit emulator's state machine in-process, [`engine`]), the run store ([`store`], reached
//! through [`store_view`]), scripted models ([`model`]), the
//! faults a seeded schedule injects into them ([`faults`]) and the trace of everything that
//! happened ([`trace`]), on tokio's clock so that a paused current-thread runtime drives it. The
//! paused-clock tests start workers against it too ([`workers`]).
//!
//! No socket, no thread, no wall clock and no unseeded randomness: given the same seed and the
//! same calls in the same order, the world answers the same way.

pub mod engine;
pub mod faults;
pub mod model;
pub mod provider_limit;
pub mod store;
pub mod store_view;
pub mod tools;
pub mod trace;
pub mod upgrade;
pub mod workers;
// simapproval: the process shapes, the approver, and the run store the round trips wait in.
pub mod approver;
pub mod process;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use abada_devkit::engine::{EngineCore, ProtocolLevel};

pub use engine::WorldEngine;
pub use faults::{FaultPlan, Faults};
pub use model::{ModelScript, WorldModel};
pub use store::{MemoryRunStore, MemoryStoreSettings};
pub(crate) use store_view::WorldStore;
pub use tools::WorldTools;
pub use trace::{Event, Trace};

/// The engine's wall clock at the world's start (2026-01-01T00:00:00Z): fixed, so traces and
/// lease times are the same on every run.
const EPOCH_MS: i64 = 1_767_225_600_000;

/// Everything shared by the world's parts: the engine's state, the faults, the random source
/// of fault draws, the trace. One short critical section per call; never held across an await.
pub struct World {
    core: Mutex<EngineCore>,
    faults: Mutex<Faults>,
    rng: Mutex<StdRng>,
    trace: Mutex<Trace>,
    ledger: Mutex<tools::Ledger>,
    /// The run store every worker's [`WorldStore`] reaches.
    pub store: MemoryRunStore,
    /// The tasks' journals live in the run store: the engine speaks plain v1 (no `attempt`, no
    /// journal, no `agent`), and the workers keep their runs in [`World::store`].
    pub store_journal: bool,
    /// Every secret handed out (the tool credentials the engine issued), with what it is.
    secrets: Mutex<Vec<(String, String)>>,
    /// The world's provider limit, one quota for every worker, and the fleet's shared pace.
    pub(crate) provider: provider_limit::ProviderCapacity,
    origin: Instant,
    /// The lock duration every worker of the world asks for, and the local safety margin it
    /// keeps (for the check that no call is made after a local expiry).
    pub lock_duration: Duration,
    pub safety_margin: Duration,
}

/// How a world is set up.
#[derive(Clone, Debug)]
pub struct WorldOptions {
    pub seed: u64,
    pub lock_duration: Duration,
    pub faults: FaultPlan,
    /// See [`World::store_journal`].
    pub store_journal: bool,
}

impl World {
    /// A world whose clock starts now (call it on the paused runtime that runs the workers).
    pub fn new(options: WorldOptions) -> Arc<World> {
        let mut core = EngineCore::new(
            if options.store_journal {
                ProtocolLevel::PlainV1
            } else {
                ProtocolLevel::AgentV1
            },
            60_000,
        );
        // Fetches contend as on the real engine on H2 (`abada_devkit::engine::contention`).
        core.set_fetch_contention(
            options
                .faults
                .fetch_contention
                .map(abada_devkit::engine::FetchContention::h2),
        );
        let provider = provider_limit::ProviderCapacity::new(options.faults.provider_limit);
        Arc::new(World {
            core: Mutex::new(core),
            faults: Mutex::new(Faults::new(options.faults)),
            rng: Mutex::new(StdRng::seed_from_u64(options.seed ^ 0x5eed_f00d)),
            trace: Mutex::new(Trace::default()),
            ledger: Mutex::new(tools::Ledger::default()),
            store: MemoryRunStore::new(MemoryStoreSettings::default()),
            store_journal: options.store_journal,
            secrets: Mutex::new(Vec::new()),
            provider,
            origin: Instant::now(),
            lock_duration: options.lock_duration,
            safety_margin: options.lock_duration / 10,
        })
    }

    /// The engine's clock in milliseconds since the epoch.
    pub fn now_ms(&self) -> i64 {
        let elapsed = self.elapsed_ms();
        let jump = match self.faults().plan.engine_clock_jump {
            Some((at, by)) if elapsed >= at => by,
            _ => 0,
        };
        EPOCH_MS + (elapsed + jump) as i64
    }

    /// Milliseconds since the world began (the trace's time).
    pub(crate) fn elapsed_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub fn core(&self) -> MutexGuard<'_, EngineCore> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn trace(&self) -> MutexGuard<'_, Trace> {
        self.trace.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn ledger(&self) -> MutexGuard<'_, tools::Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a secret handed out to a worker, and what it is (for the check that none leaks).
    pub(crate) fn secret_issued(&self, secret: String, what: String) {
        self.secrets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((secret, what));
    }

    /// Whether `secret` was handed out.
    pub fn issued(&self, secret: &str) -> bool {
        self.secrets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(s, _)| s == secret)
    }

    /// Every secret handed out so far, with what it is.
    pub fn secrets(&self) -> Vec<(String, String)> {
        self.secrets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Holds a call of `worker` while it is frozen; forever once it is killed (a dead process
    /// sends nothing).
    pub async fn hold(&self, worker: &str) {
        loop {
            if self.faults().killed.contains(worker) {
                std::future::pending::<()>().await;
            }
            let now = self.elapsed_ms();
            let Some(until) = self.faults().frozen_until(worker, now) else {
                return;
            };
            self.faults().count("worker freeze");
            tokio::time::sleep(std::time::Duration::from_millis(
                until.saturating_sub(now).max(1),
            ))
            .await;
        }
    }

    /// A draw in `0.0..1.0` from the world's seeded source.
    pub(crate) fn draw(&self) -> f64 {
        use rand::Rng;
        self.rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .random::<f64>()
    }

    /// Appends an event stamped with the world's time.
    pub fn record(&self, event: Event) {
        let at = self.elapsed_ms();
        self.trace().push(at, event);
    }
}
