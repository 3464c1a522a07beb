//! The agent runtime: the [`TaskHandler`] that turns a claimed `abada:agent` task into an agent
//! run (a conversation with a model that calls MCP tools), durable through the task's journal,
//! ending in exactly one outcome of protocol.md B.5.
//!
//! - `approval`: which tool calls wait for a person's approval, and the decision variables;
//! - `definition`: agent definitions, the agents file, `${name}` templates;
//! - `journal`: the journal's step shapes and the replay that resumes a run;
//! - `run`: the conversation loop of one attempt;
//! - `run_key`: the key of a run that waits for approval across the tasks of one node visit.
//!
//! Shared by all tasks: the provider registry (keys cached), the HTTP clients, what the engine is
//! known to offer ([`EngineCapabilities`]). Private to each task: its conversation, its MCP
//! sessions and their credentials, its journal state and budget. Where a task's journal lives is
//! decided in one place, [`AgentRuntime::journal_home`].

pub mod approval;
pub mod definition;
pub mod journal;
mod run;
pub mod run_key;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::engine::Task;
use crate::engine::capabilities::{EngineCapabilities, JournalSupport, NoJournalEvidence};
use crate::handler::{Outcome, TaskContext, TaskHandler};
use crate::metrics::Metrics;
use crate::provider::fallback::RetryPolicy;
use crate::provider::{ProviderKind, ProviderRegistry, ProviderSettings};
use crate::tools::ToolSessionOptions;
use definition::AgentsFile;

/// Knobs of the agent runtime (defaults suit production; tests shorten them).
#[derive(Clone, Debug)]
pub struct AgentSettings {
    /// The one retry loop for model calls (protocol.md Part C).
    pub model_retry: RetryPolicy,
    pub tool_sessions: ToolSessionOptions,
    /// Tries of a tool call (or listing) whose server is unavailable, before a technical failure.
    pub tool_attempts: u32,
    pub tool_backoff: Backoff,
    /// `retryTimeout` of a technical failure: this doubled per attempt already made, capped.
    pub technical_retry: Backoff,
}

impl Default for AgentSettings {
    fn default() -> Self {
        AgentSettings {
            model_retry: RetryPolicy::default(),
            tool_sessions: ToolSessionOptions::default(),
            tool_attempts: 3,
            tool_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(8)),
            technical_retry: Backoff::new(Duration::from_secs(10), Duration::from_secs(600))
                .without_jitter(),
        }
    }
}

/// The agent runtime, shared by every task of the process.
pub struct AgentRuntime {
    providers: ProviderRegistry,
    agents_file: Option<AgentsFile>,
    tool_http: reqwest::Client,
    settings: AgentSettings,
    metrics: Arc<Metrics>,
    /// Whether the engine keeps a journal, learned from the first tasks and held, so an engine
    /// without one is not asked on every task.
    capabilities: EngineCapabilities,
}

/// Where a task's journal lives (protocol.md Part B and D).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalHome {
    /// The engine's journal endpoints: an agent/1 task on an engine that has them.
    Engine,
    /// Nowhere: the agent runs without durability and starts over on its next attempt. (Part D's
    /// run store will be the home of tasks without `attempt` when one is configured.)
    Nowhere,
}

/// Why the agent runtime cannot start.
#[derive(Debug, thiserror::Error)]
pub enum AgentSetupError {
    #[error(transparent)]
    AgentsFile(#[from] definition::AgentsFileError),
    #[error("ABADA_AGENT_PROVIDER_{name}_KIND: {reason}")]
    Provider { name: String, reason: String },
    #[error("cannot build the HTTP client for models and tools: {0}")]
    Http(String),
}

impl AgentRuntime {
    pub fn new(
        providers: ProviderRegistry,
        agents_file: Option<AgentsFile>,
        tool_http: reqwest::Client,
        settings: AgentSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        AgentRuntime {
            providers,
            agents_file,
            tool_http,
            settings,
            metrics,
            capabilities: EngineCapabilities::default(),
        }
    }

    /// The runtime a [`Config`] describes (its providers and agents file), with `agent_settings`.
    pub fn from_config(
        config: &Config,
        http: reqwest::Client,
        agent_settings: AgentSettings,
        metrics: Arc<Metrics>,
    ) -> Result<Self, AgentSetupError> {
        let mut settings = Vec::new();
        for p in &config.providers {
            let kind = ProviderKind::parse(&p.kind).map_err(|e| AgentSetupError::Provider {
                name: p.name.to_ascii_uppercase(),
                reason: e.to_string(),
            })?;
            settings.push(ProviderSettings {
                name: p.name.clone(),
                kind,
                base_url: p
                    .base_url
                    .clone()
                    .unwrap_or_else(|| kind.default_base_url().to_string()),
                api_key: p.api_key.clone(),
                max_concurrency: p.max_concurrency,
                request_timeout: p.request_timeout,
            });
        }
        let agents_file = config
            .agents_file
            .as_deref()
            .map(AgentsFile::load)
            .transpose()?;
        if let Some(f) = &agents_file {
            tracing::info!(agents = f.len(), "agents file loaded");
        }
        Ok(AgentRuntime::new(
            ProviderRegistry::new(settings, http.clone()),
            agents_file,
            http,
            agent_settings,
            metrics,
        ))
    }

    /// Where `task`'s journal lives: the one place that choice is made. A task without
    /// `attempt` is not an agent/1 task (protocol.md Part B), and shows the engine speaks plain
    /// v1; an agent/1 task journals to the engine unless it is known to have no journal.
    pub fn journal_home(&self, task: &Task) -> JournalHome {
        if task.attempt.is_none() {
            self.capabilities
                .journal_missing(NoJournalEvidence::PlainTask);
            return JournalHome::Nowhere;
        }
        match self.capabilities.journal() {
            JournalSupport::Unknown | JournalSupport::Present => JournalHome::Engine,
            JournalSupport::Absent => JournalHome::Nowhere,
        }
    }
}

#[async_trait]
impl TaskHandler for AgentRuntime {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
        run::run(self, &task, &ctx).await
    }
}
