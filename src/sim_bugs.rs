//! Feature `sim-bugs` (test builds only, never production): bugs this worker once had or
//! could have, each reintroduced only when selected at run time, so the deterministic simulator
//! (`devkit::sim`) can show that its invariants catch it. Each call site is marked `SIM-BUG`.

use std::sync::atomic::{AtomicU8, Ordering};

/// A reintroduced bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// `TaskContext::fenced` neither refuses a call once the lease is lost, nor abandons one
    /// when it is lost meanwhile, nor marks the lease lost on a refusal.
    FenceRemoved,
    /// The heartbeat actor keeps extending a lease past its local expiry.
    HeartbeatAfterExpiry,
    /// A keyed write journaled `tool/started` is re-sent on resume without its key.
    KeyedWriteWithoutKey,
    /// A run in the run store is finished as soon as the attempt has its outcome, before the
    /// engine accepted it: a completion the engine never got finds no run next time.
    StoreFinishBeforeComplete,
    /// A person's decision is matched to the waiting call by its `callId` only: its
    /// `requestId` (missing, forged, stale or consumed) and its `callDigest` are not checked.
    ApprovalByCallId,
    /// A 429 is taken as an outage: the call does not wait its turn again, and the task is
    /// deferred while its provider answers (the worker before the pacing work).
    RateLimitDefers,
    /// A model's pacer releases every waiting call at once whenever nothing holds the model: no
    /// one call at a time, no pace, no probe alone after a hold (a herd at every wait's end).
    PacerHerd,
    /// An empty fetch answer always waits the poll interval, also right after an answer with
    /// tasks (contention read as an empty queue: the worker before the contention work).
    ContentionAsEmptyQueue,
}

impl Bug {
    pub const ALL: [Bug; 8] = [
        Bug::FenceRemoved,
        Bug::HeartbeatAfterExpiry,
        Bug::KeyedWriteWithoutKey,
        Bug::StoreFinishBeforeComplete,
        Bug::ApprovalByCallId,
        Bug::RateLimitDefers,
        Bug::PacerHerd,
        Bug::ContentionAsEmptyQueue,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Bug::FenceRemoved => "fence-removed",
            Bug::HeartbeatAfterExpiry => "heartbeat-after-expiry",
            Bug::KeyedWriteWithoutKey => "keyed-write-without-key",
            Bug::StoreFinishBeforeComplete => "store-finish-before-complete",
            Bug::ApprovalByCallId => "approval-by-call-id",
            Bug::RateLimitDefers => "rate-limit-defers",
            Bug::PacerHerd => "pacer-herd",
            Bug::ContentionAsEmptyQueue => "contention-as-empty-queue",
        }
    }

    pub fn parse(name: &str) -> Option<Bug> {
        Bug::ALL.into_iter().find(|b| b.name() == name)
    }
}

static SELECTED: AtomicU8 = AtomicU8::new(0);

/// Selects the bug of the runs that follow (`None`: the worker as it is).
pub fn select(bug: Option<Bug>) {
    let code = match bug {
        None => 0,
        Some(Bug::FenceRemoved) => 1,
        Some(Bug::HeartbeatAfterExpiry) => 2,
        Some(Bug::KeyedWriteWithoutKey) => 3,
        Some(Bug::StoreFinishBeforeComplete) => 4,
        Some(Bug::ApprovalByCallId) => 5,
        Some(Bug::RateLimitDefers) => 6,
        Some(Bug::PacerHerd) => 7,
        Some(Bug::ContentionAsEmptyQueue) => 8,
    };
    SELECTED.store(code, Ordering::SeqCst);
}

/// Whether `bug` is selected now.
pub fn active(bug: Bug) -> bool {
    let code = SELECTED.load(Ordering::SeqCst);
    matches!(
        (code, bug),
        (1, Bug::FenceRemoved)
            | (2, Bug::HeartbeatAfterExpiry)
            | (3, Bug::KeyedWriteWithoutKey)
            | (4, Bug::StoreFinishBeforeComplete)
            | (5, Bug::ApprovalByCallId)
            | (6, Bug::RateLimitDefers)
            | (7, Bug::PacerHerd)
            | (8, Bug::ContentionAsEmptyQueue)
    )
}
