//! Which invariant of the simulator catches each bug the worker's `sim_bugs` reintroduces
//! (feature `sim-bugs`): the one a `--every-bug` run waits for, and the test of every bug
//! checks, rather than any violation.

use abada_agent_worker::sim_bugs::Bug;

use crate::invariants as i;

/// The invariant that must catch `bug` (one of [`crate::invariants`]' names).
pub fn caught_by(bug: Bug) -> &'static str {
    match bug {
        Bug::FenceRemoved => i::AFTER_LOSS,
        Bug::HeartbeatAfterExpiry => i::LOCAL_EXPIRY,
        Bug::KeyedWriteWithoutKey => i::KEYED_WRITE_ONCE,
        Bug::StoreFinishBeforeComplete => i::MODEL_REPAID,
        Bug::ApprovalByCallId => i::GATED_CALL_DECIDED,
        Bug::SupersedeReporting => i::ENDS_AGREE,
        Bug::StoreFenceIgnored => i::AFTER_LOSS,
        Bug::ReportRetriedPastLease => i::ONE_COMPLETION,
        Bug::ReportPermitIgnored => i::SLOTS,
        Bug::SlotLeakedOnReportFailure => i::ALL_ENDED,
        Bug::CredentialLogged => i::NO_SECRET,
        Bug::EngineAcceptsStaleAppend => i::STALE_APPEND,
        Bug::StoreUnfenced => i::STALE_STORE_APPEND,
        Bug::RunHomeFromLatest => i::APPROVED_PERFORMED,
        Bug::RedeployHole => i::NO_LOOP,
        Bug::OffSchemaStored => i::STRUCTURED_RESULT,
        Bug::CutAnswerStored => i::STRUCTURED_RESULT,
        Bug::RepairsUnbounded => i::REPAIRS_BOUNDED,
        Bug::KeyedResultElided => i::KEYED_RESULTS_KEPT,
        Bug::WindowIgnored => i::WINDOW_BOUND,
        Bug::RateLimitDefers => i::NO_DEFERRAL_WHILE_ANSWERING,
        Bug::PacerHerd => i::LIMIT_REFUSALS_BOUNDED,
        Bug::ContentionAsEmptyQueue => i::NO_IDLE_REPLICA,
        Bug::AgentsFileLatest => i::GATED_CALL_DECIDED,
        Bug::OldJournalFromInput => i::UPGRADE_RESUMED,
        Bug::CapacityWedge => i::FETCHING_CONTINUES,
        Bug::TextCallPanics => i::NOTHING_PANICKED,
    }
}
