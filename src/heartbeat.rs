//! The heartbeat scheduler: one actor that keeps every lease of the process alive.
//!
//! Each registered lease is extended every third of the lock duration, on a grid counted from
//! its acquisition, so lateness never accumulates. Extensions for many leases run concurrently
//! (bounded). A transient failure is retried with backoff before the lease could expire; a
//! refusal marks the lease lost. A lease with no accepted extension for a whole lock duration
//! (minus a safety margin) by the worker's own monotonic clock is lost too, even when the engine
//! cannot be reached: another worker may own the task by then.
//!
//! Only this actor touches the schedule; the runner talks to it through a cloneable
//! [`HeartbeatHandle`] (`register` / `release`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::engine::{Engine, EngineError, LeaseLostReason};
use crate::lease::{Lease, LeaseId};
use crate::metrics::Metrics;
use crate::random::Random;

/// How the scheduler behaves.
#[derive(Clone, Debug)]
pub struct HeartbeatSettings {
    /// The lease length requested on every extension.
    pub lock_duration: Duration,
    /// Most extension requests in flight at once.
    pub(crate) max_concurrent: usize,
    /// Backoff between retries of a failed extension (capped so a retry happens before expiry).
    pub retry_backoff: Backoff,
}

impl HeartbeatSettings {
    pub fn new(lock_duration: Duration) -> Self {
        HeartbeatSettings {
            lock_duration,
            max_concurrent: 16,
            retry_backoff: Backoff::new(Duration::from_millis(250), Duration::from_secs(10)),
        }
    }

    /// Time between extensions: a third of the lock duration.
    pub fn period(&self) -> Duration {
        (self.lock_duration / 3).max(Duration::from_millis(1))
    }

    /// How long before `last_ok + L` the worker already treats the lease as lost: clock drift
    /// between worker and engine, and time for the task to stop.
    pub(crate) fn safety_margin(&self) -> Duration {
        self.lock_duration / 10
    }
}

/// An observation about one extension, for tests and benchmarks.
#[derive(Clone, Debug, PartialEq)]
pub enum HeartbeatEvent {
    /// An extension was sent `lateness` after it was due.
    Sent {
        lease: LeaseId,
        lateness: Duration,
    },
    Extended {
        lease: LeaseId,
    },
    Failed {
        lease: LeaseId,
        error: String,
    },
    Lost {
        lease: LeaseId,
        reason: LeaseLostReason,
    },
}

enum Command {
    Register { lease: Lease, acquired_at: Instant },
    Release { lease: LeaseId },
}

/// A cloneable handle to the scheduler actor.
#[derive(Clone)]
pub struct HeartbeatHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// The lock duration less the safety margin: a lease's local expiry after its acquisition.
    expires_after: Duration,
}

impl HeartbeatHandle {
    /// Starts extending `lease`, acquired (fetch request sent) at `acquired_at`. Its local
    /// expiry is set here, before the actor runs: the lease expires even if the actor never
    /// gets to it (`Lease::lost_or_expired`).
    pub fn register(&self, lease: Lease, acquired_at: Instant) {
        lease.set_valid_until(acquired_at + self.expires_after);
        // If the actor is gone the process is shutting down; nothing to extend then.
        let _ = self.tx.send(Command::Register { lease, acquired_at });
    }

    /// Stops extending a lease (its task ended).
    pub fn release(&self, lease: LeaseId) {
        let _ = self.tx.send(Command::Release { lease });
    }
}

struct Entry {
    lease: Lease,
    acquired_at: Instant,
    /// Extensions sent so far on the grid (the next one is due at acquired_at + (k+1) * period).
    grid_index: u32,
    /// When the next extension is due.
    due: Instant,
    /// Send time of the last accepted extension (or the acquisition).
    last_ok: Instant,
    /// The extension request on its way, if any: aborted when the lease ends (released or lost)
    /// so that no extension of a lease the worker has given up can reach the engine afterwards.
    in_flight: Option<AbortHandle>,
    failures: u32,
    /// The instant under which this entry sits in the timer set.
    timer: Instant,
}

impl Entry {
    fn expiry_deadline(&self, settings: &HeartbeatSettings) -> Instant {
        self.last_ok
            + settings
                .lock_duration
                .saturating_sub(settings.safety_margin())
    }
}

struct Actor {
    engine: Arc<dyn Engine>,
    settings: HeartbeatSettings,
    metrics: Arc<Metrics>,
    events: Option<mpsc::UnboundedSender<HeartbeatEvent>>,
    entries: HashMap<LeaseId, Entry>,
    timers: BTreeSet<(Instant, LeaseId)>,
    in_flight: JoinSet<(LeaseId, Instant, Result<(), EngineError>)>,
    permits: Arc<Semaphore>,
    /// The worker's randomness: the jitter of the retries' backoff.
    random: Random,
}

/// Starts the scheduler actor; it stops when every handle is dropped. Its retries' jitter is
/// drawn from `random` (the worker's).
pub fn spawn(
    engine: Arc<dyn Engine>,
    settings: HeartbeatSettings,
    metrics: Arc<Metrics>,
    events: Option<mpsc::UnboundedSender<HeartbeatEvent>>,
    random: Random,
) -> HeartbeatHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let expires_after = settings
        .lock_duration
        .saturating_sub(settings.safety_margin());
    let actor = Actor {
        engine,
        permits: Arc::new(Semaphore::new(settings.max_concurrent.max(1))),
        settings,
        metrics,
        events,
        entries: HashMap::new(),
        timers: BTreeSet::new(),
        in_flight: JoinSet::new(),
        random,
    };
    tokio::spawn(actor.run(rx));
    HeartbeatHandle { tx, expires_after }
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            let next_timer = self.timers.first().map(|(at, _)| *at);
            // Biased: a release sent before an extension's answer arrives is seen first, so the
            // answer of a released lease is ignored rather than marking it lost.
            tokio::select! {
                biased;
                cmd = rx.recv() => match cmd {
                    Some(Command::Register { lease, acquired_at }) => self.register(lease, acquired_at),
                    Some(Command::Release { lease }) => self.remove(lease),
                    None => break,
                },
                _ = sleep_until_opt(next_timer) => self.fire_due(),
                Some(done) = self.in_flight.join_next(), if !self.in_flight.is_empty() => {
                    match done {
                        Ok((lease, sent_at, result)) => self.on_result(lease, sent_at, result),
                        // Aborted because its lease ended: nothing to learn from it.
                        Err(e) if e.is_cancelled() => {}
                        Err(e) => tracing::error!(error = %e, "heartbeat request task failed"),
                    }
                }
            }
        }
        self.in_flight.abort_all();
    }

    fn emit(&self, event: HeartbeatEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    fn register(&mut self, lease: Lease, acquired_at: Instant) {
        let id = lease.id();
        let due = acquired_at + self.settings.period();
        let entry = Entry {
            lease,
            acquired_at,
            grid_index: 1,
            due,
            last_ok: acquired_at,
            in_flight: None,
            failures: 0,
            timer: due,
        };
        entry
            .lease
            .set_valid_until(entry.expiry_deadline(&self.settings));
        self.timers.insert((due, id));
        self.entries.insert(id, entry);
    }

    fn remove(&mut self, id: LeaseId) {
        if let Some(entry) = self.entries.remove(&id) {
            self.timers.remove(&(entry.timer, id));
            if let Some(extension) = entry.in_flight {
                extension.abort();
            }
        }
    }

    fn reschedule(&mut self, id: LeaseId) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let deadline = entry.expiry_deadline(&self.settings);
        // SIM-BUG (feature `sim-bugs`, selected at run time): no local expiry to wake up for
        // (a lock from now at the earliest: a wake-up in the past would spin `fire_due`).
        #[cfg(feature = "sim-bugs")]
        let deadline = if crate::sim_bugs::active(crate::sim_bugs::Bug::HeartbeatAfterExpiry) {
            deadline.max(entry.due).max(Instant::now()) + self.settings.lock_duration
        } else {
            deadline
        };
        let at = if entry.in_flight.is_some() {
            deadline
        } else {
            entry.due.min(deadline)
        };
        self.timers.remove(&(entry.timer, id));
        entry.timer = at;
        self.timers.insert((at, id));
    }

    fn fire_due(&mut self) {
        let now = Instant::now();
        while let Some(&(at, id)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, id));
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            // SIM-BUG (feature `sim-bugs`, selected at run time): no local expiry.
            #[cfg(feature = "sim-bugs")]
            let expired = now >= entry.expiry_deadline(&self.settings)
                && !crate::sim_bugs::active(crate::sim_bugs::Bug::HeartbeatAfterExpiry);
            #[cfg(not(feature = "sim-bugs"))]
            let expired = now >= entry.expiry_deadline(&self.settings);
            if expired {
                self.lose(id, LeaseLostReason::LocalExpiry);
                continue;
            }
            if entry.lease.is_lost() {
                // Lost elsewhere (the task saw a refusal): nothing left to extend.
                self.remove(id);
                continue;
            }
            if entry.in_flight.is_none() && now >= entry.due {
                let lateness = now.saturating_duration_since(entry.due);
                let engine = self.engine.clone();
                let task = entry.lease.task().clone();
                let lock = self.settings.lock_duration;
                let permits = self.permits.clone();
                entry.in_flight = Some(self.in_flight.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    let sent_at = Instant::now();
                    let result = engine.heartbeat(&task, lock).await;
                    (id, sent_at, result)
                }));
                self.emit(HeartbeatEvent::Sent {
                    lease: id,
                    lateness,
                });
            }
            self.reschedule(id);
        }
    }

    fn on_result(&mut self, id: LeaseId, sent_at: Instant, result: Result<(), EngineError>) {
        let period = self.settings.period();
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        entry.in_flight = None;
        match result {
            Ok(()) => {
                self.metrics.leases_extended.inc();
                entry.failures = 0;
                if sent_at > entry.last_ok {
                    entry.last_ok = sent_at;
                }
                entry
                    .lease
                    .set_valid_until(entry.expiry_deadline(&self.settings));
                // Next point on the acquisition grid that is still ahead.
                let now = Instant::now();
                loop {
                    entry.grid_index += 1;
                    entry.due = entry.acquired_at + period * entry.grid_index;
                    if entry.due > now {
                        break;
                    }
                }
                self.emit(HeartbeatEvent::Extended { lease: id });
                self.reschedule(id);
            }
            Err(e) => {
                if let Some(reason) = e.lease_lost() {
                    self.lose(id, reason);
                    return;
                }
                entry.failures += 1;
                let now = Instant::now();
                let deadline = entry.expiry_deadline(&self.settings);
                // Retry soon enough to have several tries before the deadline.
                let room = deadline.saturating_duration_since(now) / 4;
                let wait = self
                    .settings
                    .retry_backoff
                    .delay(entry.failures - 1, &self.random)
                    .min(room.max(Duration::from_millis(1)));
                entry.due = now + wait;
                tracing::warn!(
                    task_id = %entry.lease.task().task_id,
                    failures = entry.failures,
                    retry_in_ms = wait.as_millis() as u64,
                    error = %e,
                    "lease extension failed; retrying before the lease could expire"
                );
                self.emit(HeartbeatEvent::Failed {
                    lease: id,
                    error: e.to_string(),
                });
                self.reschedule(id);
            }
        }
    }

    fn lose(&mut self, id: LeaseId, reason: LeaseLostReason) {
        if let Some(entry) = self.entries.get(&id) {
            // Counted by the runner when the task ends, whoever found the loss.
            entry.lease.mark_lost(reason);
            self.emit(HeartbeatEvent::Lost { lease: id, reason });
        }
        self.remove(id);
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
