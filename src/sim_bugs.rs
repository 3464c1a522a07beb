//! Feature `sim-bugs` (test builds only, never production): bugs this worker once had or
//! could have, each reintroduced only when selected at run time, so the deterministic simulator
//! (the `abada-sim` crate) can show that its invariants catch it, each by the invariant the
//! simulator names for it (`abada_sim::bugs::caught_by`). Each call site is marked `SIM-BUG`.
//!
//! Two invariants judge the peers' fencing, not the worker's: an engine that accepts a journal
//! append of a stale attempt, a run store that accepts one of a stale claim. No worker can make
//! a correct peer do that, so their bugs are flaws of the world's engine and store
//! ([`Bug::EngineAcceptsStaleAppend`], [`Bug::StoreUnfenced`]), as the conformance suites'
//! flaws are.

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
    /// The runner, handed a task that still runs here, supersedes every older attempt at
    /// once, one already waiting for its report's answer included, and starts the newer one
    /// without waiting: an accepted report ends `lease_lost`.
    SupersedeReporting,
    /// The run store's `Fenced` refusal is not taken as a lost lease: the fenced holder goes
    /// on, and reports for a task whose run another attempt holds.
    StoreFenceIgnored,
    /// A report that failed transiently (a `complete` the engine did not answer) is sent again
    /// every half second, unfenced, until the engine takes it: past the lease, after another
    /// holder completed the task (the engine answers the stale `complete` 200, a no-op).
    ReportRetriedPastLease,
    /// A finished task gives its slot back as its report goes out even when every report
    /// permit is taken: slow reports pile up above the slots.
    ReportPermitIgnored,
    /// The slot of a task whose report failed is never given back: the worker fetches for
    /// fewer slots, then none.
    SlotLeakedOnReportFailure,
    /// The engine's tool credential is logged (debug) as it is received.
    CredentialLogged,
    /// A flaw of the world's engine: a journal append is accepted from any attempt (as if the
    /// task's holder sent it).
    EngineAcceptsStaleAppend,
    /// A flaw of the world's run store: an append's compare-and-set checks neither the attempt
    /// nor the version (only the next `seq`), as if the run's holder sent it.
    StoreUnfenced,
    /// The task's run is not looked up before its definition is read, and a task carrying a
    /// decision for a conversation it cannot find begins a new one: the latest definition
    /// decides where the run lives, so after a redeployment that dropped approval the task
    /// carrying a person's decision begins a new conversation on the new definition, and the
    /// approved call is dropped (the redeployment hole found on the real engine 0.11, without
    /// its loop).
    RunHomeFromLatest,
    /// The same, and `agentStatus` is rewritten only by a definition that may stop: the stale
    /// `approval-required` sends the token back to the person (the hole whole).
    RedeployHole,
    /// An answer that is JSON is stored without being validated against the output schema.
    OffSchemaStored,
    /// The stop reason is not read: an answer cut by the output limit is judged as whole (with
    /// no schema, stored as its text).
    CutAnswerStored,
    /// A rejected final answer always gets another repair turn: `outputRepairTurns` is never
    /// exhausted, the model is asked until it answers well.
    RepairsUnbounded,
    /// The context window elides a keyed write's result like any other old result: the model
    /// loses its only record that the write was performed.
    KeyedResultElided,
    /// The request is not fitted to the model's context window: it goes out whole.
    WindowIgnored,
    /// A 429 is taken as an outage: the call does not wait its turn again, and the task is
    /// deferred while its provider answers (the worker before the pacing work).
    RateLimitDefers,
    /// A model's pacer releases every waiting call at once whenever nothing holds the model: no
    /// one call at a time, no pace, no probe alone after a hold (a herd at every wait's end).
    PacerHerd,
    /// An empty fetch answer always waits the poll interval, also right after an answer with
    /// tasks (contention read as an empty queue: the worker before the contention work).
    ContentionAsEmptyQueue,
    /// A resumed run whose definition came from the agents file runs the file's latest entry
    /// (read by a restarted worker) instead of the definition it journaled: after the operator
    /// dropped a node's approval, the run's next write is performed without a person.
    AgentsFileLatest,
    /// A journal written by the previous release (its input step carries no definition) is
    /// replayed from its input step alone: the run begins again, the model is asked for the
    /// turns that release paid, and its writes go out again.
    OldJournalFromInput,
    /// With every topic held, admission fetches nothing for an hour, whatever returns: one
    /// hostile header stops every fetch of the worker (the wedge found with an Azure-style
    /// unitless reset, where the held model's figure also never expired).
    CapacityWedge,
    /// Reading a tool call the model wrote as text looks one call past the last: the task's
    /// handler panics on the model's output (the runner fails the task technically and says so).
    TextCallPanics,
}

impl Bug {
    pub const ALL: [Bug; 27] = [
        Bug::FenceRemoved,
        Bug::HeartbeatAfterExpiry,
        Bug::KeyedWriteWithoutKey,
        Bug::StoreFinishBeforeComplete,
        Bug::ApprovalByCallId,
        Bug::SupersedeReporting,
        Bug::StoreFenceIgnored,
        Bug::ReportRetriedPastLease,
        Bug::ReportPermitIgnored,
        Bug::SlotLeakedOnReportFailure,
        Bug::CredentialLogged,
        Bug::EngineAcceptsStaleAppend,
        Bug::StoreUnfenced,
        Bug::RunHomeFromLatest,
        Bug::RedeployHole,
        Bug::OffSchemaStored,
        Bug::CutAnswerStored,
        Bug::RepairsUnbounded,
        Bug::KeyedResultElided,
        Bug::WindowIgnored,
        Bug::RateLimitDefers,
        Bug::PacerHerd,
        Bug::ContentionAsEmptyQueue,
        Bug::AgentsFileLatest,
        Bug::OldJournalFromInput,
        Bug::CapacityWedge,
        Bug::TextCallPanics,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Bug::FenceRemoved => "fence-removed",
            Bug::HeartbeatAfterExpiry => "heartbeat-after-expiry",
            Bug::KeyedWriteWithoutKey => "keyed-write-without-key",
            Bug::StoreFinishBeforeComplete => "store-finish-before-complete",
            Bug::ApprovalByCallId => "approval-by-call-id",
            Bug::SupersedeReporting => "supersede-reporting",
            Bug::StoreFenceIgnored => "store-fence-ignored",
            Bug::ReportRetriedPastLease => "report-retried-past-lease",
            Bug::ReportPermitIgnored => "report-permit-ignored",
            Bug::SlotLeakedOnReportFailure => "slot-leaked-on-report-failure",
            Bug::CredentialLogged => "credential-logged",
            Bug::EngineAcceptsStaleAppend => "engine-accepts-stale-append",
            Bug::StoreUnfenced => "store-unfenced",
            Bug::RunHomeFromLatest => "run-home-from-latest",
            Bug::RedeployHole => "redeploy-hole",
            Bug::OffSchemaStored => "off-schema-stored",
            Bug::CutAnswerStored => "cut-answer-stored",
            Bug::RepairsUnbounded => "repairs-unbounded",
            Bug::KeyedResultElided => "keyed-result-elided",
            Bug::WindowIgnored => "window-ignored",
            Bug::RateLimitDefers => "rate-limit-defers",
            Bug::PacerHerd => "pacer-herd",
            Bug::ContentionAsEmptyQueue => "contention-as-empty-queue",
            Bug::AgentsFileLatest => "agents-file-latest",
            Bug::OldJournalFromInput => "old-journal-from-input",
            Bug::CapacityWedge => "capacity-wedge",
            Bug::TextCallPanics => "text-call-panics",
        }
    }

    pub fn parse(name: &str) -> Option<Bug> {
        Bug::ALL.into_iter().find(|b| b.name() == name)
    }
}

static SELECTED: AtomicU8 = AtomicU8::new(0);

/// Selects the bug of the runs that follow (`None`: the worker as it is).
pub fn select(bug: Option<Bug>) {
    let code = bug.map_or(0, |b| b.code());
    SELECTED.store(code, Ordering::SeqCst);
}

/// Whether `bug` is selected now.
pub fn active(bug: Bug) -> bool {
    SELECTED.load(Ordering::SeqCst) == bug.code()
}

impl Bug {
    /// Its code in [`SELECTED`]: its place in [`Bug::ALL`], from 1 (0: none).
    fn code(self) -> u8 {
        Bug::ALL
            .iter()
            .position(|b| *b == self)
            .map_or(0, |i| i as u8 + 1)
    }
}
