//! What the deterministic simulator (the `abada-sim` crate) and the tests that drive workers
//! against its world reuse of the worker's internals, so that the world's in-process engine and
//! the invariants read and name things exactly as the worker's own code does:
//!
//! - the engine client's rules ([`engine_client`]): how an answer of the engine is decoded, how
//!   a refusal becomes the typed error the worker acts on, the idempotency key of a journal
//!   append and what its refusal means. The world's engine answers through them, so the
//!   worker's core sees the errors it would see over the wire;
//! - the agent's vocabulary ([`agent`]): the `agentStatus` value and the default variable names
//!   of the approval flow the world's process routes on, and the default repair turns the
//!   invariants bound.
//!
//! Wrappers and aliases only: nothing here is a second implementation, and the production build
//! (`--no-default-features`) has none of it.

/// The engine HTTP client's own reading of the wire.
pub mod engine_client {
    use reqwest::StatusCode;
    use reqwest::header::HeaderMap;

    use crate::engine::{EngineError, Journal, JournalStep, Task, TaskRef, ToolCredential};

    /// The operation name of a process instance read (metrics, spans, errors).
    pub const OP_PROCESS_INSTANCE: &str = crate::engine::OP_PROCESS_INSTANCE;
    /// The operation name of a process definition read.
    pub const OP_PROCESS_DEFINITION: &str = crate::engine::OP_PROCESS_DEFINITION;

    /// The typed error the HTTP client makes of a non-success answer of `op` about `task_id`.
    pub fn classify_answer(
        op: &'static str,
        task_id: Option<&str>,
        status: StatusCode,
        headers: HeaderMap,
        body: Vec<u8>,
    ) -> EngineError {
        crate::engine::client::classify_answer(op, task_id, status, headers, body)
    }

    /// The idempotency key the HTTP client sends with a journal append.
    pub fn journal_append_key(task: &TaskRef, step: &JournalStep) -> String {
        crate::engine::client::journal_append_key(task, step)
    }

    /// What the HTTP client makes of a refused journal append.
    pub fn journal_append_refusal(task: &TaskRef, error: EngineError) -> EngineError {
        crate::engine::client::journal_append_refusal(task, error)
    }

    /// A fetch-and-lock answer: the tasks read, and one problem per element skipped.
    pub fn decode_locked_tasks(body: &[u8]) -> Result<(Vec<Task>, Vec<String>), String> {
        crate::engine::wire::decode_locked_tasks(body)
    }

    /// A journal read answer.
    pub fn decode_journal(body: &[u8]) -> Result<Journal, String> {
        crate::engine::wire::decode_journal(body)
    }

    /// A tool credential answer.
    pub fn decode_tool_credential(body: &[u8]) -> Option<ToolCredential> {
        crate::engine::wire::decode_tool_credential(body)
    }
}

/// The agent's names and defaults a process model and its checks rely on.
pub mod agent {
    /// `agentStatus` of a task that stopped for a person's decision.
    pub const STATUS_APPROVAL_REQUIRED: &str = crate::agent::approval::STATUS_APPROVAL_REQUIRED;
    /// The variable the worker asks its question in, unless the definition names another.
    pub const DEFAULT_REQUEST_VARIABLE: &str = crate::agent::approval::DEFAULT_REQUEST_VARIABLE;
    /// The variable the person's decision is read from, unless the definition names another.
    pub const DEFAULT_DECISION_VARIABLE: &str = crate::agent::approval::DEFAULT_DECISION_VARIABLE;
    /// `answerRepairTurns` of a definition that sets none.
    pub const DEFAULT_ANSWER_REPAIR_TURNS: u32 = crate::agent::answer_shape::DEFAULT_REPAIR_TURNS;
    /// `outputRepairTurns` of a definition that sets none.
    pub const DEFAULT_OUTPUT_REPAIR_TURNS: u32 = crate::agent::output::DEFAULT_REPAIR_TURNS;
}
