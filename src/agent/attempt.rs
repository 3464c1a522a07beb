//! One attempt of a task as its parts see it: the [`Attempt`] the conversation loop (`run`),
//! the tool calls (`tool_call`) and the approval gate (`approval_gate`) each add methods to,
//! its state grouped by concern (the journal, the tools, the trace, the deadline).

use std::time::Duration;

use tracing::Span;

use super::approval::ApprovalRules;
use super::definition::AgentDefinition;
use super::journal::Replayed;
use super::limits::Limits;
use super::run_journal::Journal;
use super::scope::Scope;
use crate::conversation::ToolSpec;
use crate::metrics::labels::DeclaredNames;
use crate::tools::ToolSessions;

/// When the task must be over, on this process's clock.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadline {
    pub(super) at: tokio::time::Instant,
    /// When this attempt started, and how long the task had run before it (by the wall clock
    /// of the journal's `startedAtMs`).
    pub(super) started: tokio::time::Instant,
    pub(super) elapsed_before: Duration,
    /// When this attempt started by the wall clock (the run's start when it journals its input
    /// step).
    pub(super) started_at: std::time::SystemTime,
}

impl Deadline {
    pub(super) fn new(
        limit: Duration,
        started_at_ms: Option<u64>,
        now: std::time::SystemTime,
    ) -> Self {
        // A clock that went back (or a journal without the stamp) counts as no time spent.
        let elapsed_before = started_at_ms.map_or(Duration::ZERO, |ms| {
            now.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .saturating_sub(Duration::from_millis(ms))
        });
        let started = tokio::time::Instant::now();
        Deadline {
            at: started + limit.saturating_sub(elapsed_before),
            started,
            elapsed_before,
            started_at: now,
        }
    }
}

/// This attempt's trace: its `invoke_agent` span, whose context is journaled with every step
/// (so the attempt that resumes this run can link to it), and the context sent to models and
/// tools.
pub(super) struct Trace {
    pub(super) span: Span,
    pub(super) traceparent: Option<String>,
}

/// One attempt of a task, from its opened journal to its outcome.
pub(super) struct Attempt<'a> {
    pub(super) scope: Scope<'a>,
    pub(super) def: AgentDefinition,
    /// The definition's limits under the worker's ceilings.
    pub(super) limits: Limits,
    pub(super) deadline: Deadline,
    /// The run so far, replayed from the journal and advanced by every step journaled.
    pub(super) state: Replayed,
    /// Where this attempt journals its steps, and what it holds there.
    pub(super) journal: Journal,
    pub(super) tools: Toolbox,
    pub(super) trace: Trace,
    /// Which calls wait for a person's decision (the definition's and its servers' policies).
    pub(super) approval: ApprovalRules,
    /// Model requests of this attempt that produced no journaled answer (failed, retried).
    pub(super) unanswered_model_calls: u32,
}

/// The task's tool sessions and what the attempt learned of them.
pub(super) struct Toolbox {
    pub(super) sessions: Box<dyn ToolSessions>,
    /// The tools listed, once listed (one listing per attempt).
    pub(super) specs: Option<Vec<ToolSpec>>,
    /// The model and tool names this task may label metrics with.
    pub(super) names: DeclaredNames,
    /// How the tool call running now was last counted, for its span's end.
    pub(super) last_outcome: Option<&'static str>,
}
