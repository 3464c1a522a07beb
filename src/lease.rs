//! A lease: the engine-provable fact that this worker owns one attempt of one task, and the
//! latch that fires, once, when that ownership is lost.
//!
//! Anyone may find out first that a lease is lost: the heartbeat scheduler (a refused extension
//! or local expiry), the task itself (a refused journal append or credential request), or the
//! runner (a newer attempt of the same task was fetched). Whoever does calls
//! [`Lease::mark_lost`]; from then on the task makes no further call about the task.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::{LeaseLostReason, TaskRef};

/// A process-unique lease id (a task id is not enough: an older attempt of the same task may
/// still be winding down here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(u64);

impl LeaseId {
    fn next() -> LeaseId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        LeaseId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A cheap, cloneable view of one lease.
#[derive(Clone, Debug)]
pub struct Lease {
    id: LeaseId,
    task: Arc<TaskRef>,
    lost: CancellationToken,
    reason: Arc<OnceLock<LeaseLostReason>>,
    /// The local expiry the heartbeat scheduler last computed (None until it registers the
    /// lease). Read by the task before each call, so that a process paused past it (SIGSTOP, a
    /// stalled VM) makes no call on waking even if the scheduler has not run yet, and watched
    /// by [`Lease::lost_or_expired`] (a lease released from the scheduler still expires).
    valid_until: Arc<ValidUntil>,
}

/// The local expiry and the waiters for its moves. Not a `tokio::sync::watch`: a watch wakes
/// its receivers in a random order (each waits on one of eight notifiers picked by tokio's
/// unseeded generator), and the task and the runner both wait here, so which of them saw the
/// expiry first would differ from run to run. A `Notify` wakes its waiters in the order they
/// began to wait.
#[derive(Debug, Default)]
struct ValidUntil {
    at: Mutex<Option<Instant>>,
    moved: Notify,
}

impl ValidUntil {
    fn get(&self) -> Option<Instant> {
        *self.at.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Lease {
    pub fn new(task: TaskRef) -> Lease {
        Lease {
            id: LeaseId::next(),
            task: Arc::new(task),
            lost: CancellationToken::new(),
            reason: Arc::new(OnceLock::new()),
            valid_until: Arc::new(ValidUntil::default()),
        }
    }

    /// Records the lease's local expiry (the heartbeat scheduler's, on registration and on each
    /// accepted extension).
    pub(crate) fn set_valid_until(&self, at: Instant) {
        *self
            .valid_until
            .at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(at);
        self.valid_until.moved.notify_waiters();
    }

    /// True once the worker's own clock is past the lease's local expiry, whether or not the
    /// scheduler has noticed yet.
    pub fn expired_locally(&self) -> bool {
        self.valid_until
            .get()
            .is_some_and(|at| Instant::now() >= at)
    }

    pub fn id(&self) -> LeaseId {
        self.id
    }

    pub fn task(&self) -> &TaskRef {
        &self.task
    }

    /// Marks the lease lost; returns true for the call that did it first.
    pub(crate) fn mark_lost(&self, reason: LeaseLostReason) -> bool {
        let first = self.reason.set(reason).is_ok();
        self.lost.cancel();
        if first {
            tracing::warn!(
                task_id = %self.task.task_id,
                attempt = self.task.attempt,
                reason = %reason,
                "lease lost: the task stops and reports nothing"
            );
        }
        first
    }

    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    pub fn lost_reason(&self) -> Option<LeaseLostReason> {
        self.reason.get().copied()
    }

    /// Resolves when the lease is lost.
    pub async fn lost(&self) {
        self.lost.cancelled().await
    }

    /// Resolves when the lease is lost, or when the worker's own clock reaches its local expiry,
    /// which marks it lost ([`LeaseLostReason::LocalExpiry`]); whichever comes first. Unlike
    /// [`Lease::lost`], it does not wait for the heartbeat scheduler to notice: a lease the
    /// scheduler no longer extends (its task is reporting its outcome) still expires here, so
    /// a report the engine never answers ends at the expiry, and nothing about the task is sent
    /// afterwards. An extension accepted meanwhile moves the expiry later.
    pub(crate) async fn lost_or_expired(&self) {
        // SIM-BUG (feature `sim-bugs`, selected at run time): no local expiry.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::HeartbeatAfterExpiry) {
            return self.lost().await;
        }
        loop {
            // Waiting for a move before the expiry is read: a move in between is not missed.
            let moved = self.valid_until.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            let until = self.valid_until.get();
            if until.is_some_and(|at| Instant::now() >= at) {
                self.mark_lost(LeaseLostReason::LocalExpiry);
                return;
            }
            let at_expiry = async {
                match until {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = self.lost() => return,
                // Moved (an extension) or set (the registration): look again.
                _ = moved => {}
                _ = at_expiry => {}
            }
        }
    }
}
