//! How a task ended in this worker (`TaskEnd`): one small vocabulary that the runner, its
//! events, the `task ended` log line and the metrics all speak. It sits below both the handler
//! seam and the metrics, so neither has to import the other to name an ending.

/// How a task ended in this worker: the outcome the engine was told, or why it was told
/// nothing. Runner events, the `task ended` log line and the `outcome` label of the task
/// metrics all speak it; [`TaskEnd::as_str`] is its one spelling (docs/OPERATIONS.md lists
/// these values, and dashboards select on them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskEnd {
    /// `complete` was accepted.
    Completed,
    /// `bpmn-error` was accepted.
    BpmnError,
    /// A technical `failure` was accepted: one retry used.
    Failed,
    /// Every model was unavailable: `failure` with retries kept and a retry timeout.
    Deferred,
    /// `failure` with `retries: 0`: an operator must look at it.
    Incident,
    /// Shutdown: `failure` with retries kept, offered again at once.
    Released,
    /// The lease was lost: another worker owns the task, nothing was reported.
    LeaseLost,
    /// The outcome could not be reported; the lease will expire and the task be offered again.
    ReportFailed,
}

impl TaskEnd {
    /// Every ending, in the order docs/OPERATIONS.md lists them.
    pub const ALL: [TaskEnd; 8] = [
        TaskEnd::Completed,
        TaskEnd::BpmnError,
        TaskEnd::Failed,
        TaskEnd::Deferred,
        TaskEnd::Incident,
        TaskEnd::Released,
        TaskEnd::LeaseLost,
        TaskEnd::ReportFailed,
    ];

    /// The spelling in log lines and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskEnd::Completed => "completed",
            TaskEnd::BpmnError => "bpmn_error",
            TaskEnd::Failed => "failed",
            TaskEnd::Deferred => "deferred",
            TaskEnd::Incident => "incident",
            TaskEnd::Released => "released",
            TaskEnd::LeaseLost => "lease_lost",
            TaskEnd::ReportFailed => "report_failed",
        }
    }

    /// Whether the engine was told how the task ended (an ending call was accepted).
    pub fn reported(self) -> bool {
        !matches!(self, TaskEnd::LeaseLost | TaskEnd::ReportFailed)
    }
}

impl std::fmt::Display for TaskEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
