//! The agent runtime: the [`TaskHandler`] that turns a claimed `abada:agent` task into an agent
//! run (a conversation with a model that calls MCP tools), durable through the task's journal,
//! ending in exactly one outcome of protocol.md B.5.
//!
//! - `approval`: which tool calls wait for a person's approval, and the decision variables;
//! - `bpmn`: agent definitions written on the BPMN service task (`abada.agent.*` properties);
//! - `definition`: agent definitions, the agents file, `${name}` templates;
//! - `journal`: the journal's step shapes and the replay that resumes a run;
//! - `limits`: what a model can make the worker do (tool calls, writes, turns, time, tokens);
//! - `output`: structured output: the compiled `outputSchema`, the verdict on a final answer,
//!   its repair turns;
//! - `run`: the conversation loop of one attempt;
//! - `run_journal`: the journal of one attempt wherever it lives (engine, run store, nowhere):
//!   open, append, keys of keyed writes, and the commit of the run's end;
//! - `tool_call`: one tool call of an attempt (keyed, journaled, retried) and its sessions;
//! - `approval_gate`: the stop for a person's decision and the resume with it;
//! - `attempt`: one attempt's state, grouped by concern, that the parts above add methods to;
//! - `scope`: what every part of an attempt reads, and the outcomes an attempt ends with;
//! - `run_key`: the key of a run that waits for approval across the tasks of one node visit.
//!
//! Shared by all tasks: the provider registry (keys cached), the HTTP clients, what the engine is
//! known to offer ([`EngineCapabilities`]). Private to each task: its conversation, its MCP
//! sessions and their credentials, its journal state and budget. Where a task's journal lives is
//! decided in one place, `run_journal::Journal::open`.

pub mod approval;
mod approval_gate;
mod attempt;
pub mod bpmn;
mod canonical;
pub mod definition;
pub mod journal;
pub mod limits;
pub mod output;
mod run;
mod run_journal;
pub mod run_key;
mod scope;
mod tool_call;
mod window;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::backoff::Backoff;
use crate::engine::Task;
use crate::engine::capabilities::EngineCapabilities;
use crate::handler::{Outcome, TaskContext, TaskHandler};
use crate::metrics::Metrics;
use crate::provider::ProviderRegistry;
use crate::provider::capacity::Capacity;
use crate::provider::fallback::RetryPolicy;
use crate::store::RunStore;
use crate::tools::registry::ToolRegistry;
use crate::tools::{McpConnector, ToolConnector, ToolSessionOptions};
use definition::AgentsFile;
use limits::Ceilings;

/// Deferrals of one run in the run store before it ends as an incident
/// (`ABADA_AGENT_MAX_DEFERRALS_PER_RUN`'s default).
pub(crate) const DEFAULT_MAX_DEFERRALS_PER_RUN: u32 = 20;

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
    /// Between tries of a run-store call that failed transiently (an outage, a full pool).
    pub store_backoff: Backoff,
    /// The caches of agents defined in the BPMN (how long a latest version is trusted).
    pub bpmn: bpmn::BpmnSettings,
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
            store_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
            bpmn: bpmn::BpmnSettings::default(),
        }
    }
}

/// The agent runtime, shared by every task of the process.
pub struct AgentRuntime {
    providers: ProviderRegistry,
    agents_file: Option<AgentsFile>,
    /// Agents defined on the BPMN service task, read from the engine and cached.
    bpmn: bpmn::BpmnDefinitions,
    /// The operator's tool servers (`ABADA_AGENT_TOOLS_FILE`), when set.
    tool_registry: Option<Arc<ToolRegistry>>,
    /// Opens each task's tool sessions: in production MCP over the tool servers' client (no
    /// redirects, no link-local or metadata address).
    tools: Arc<dyn ToolConnector>,
    settings: AgentSettings,
    metrics: Arc<Metrics>,
    /// What no definition gets more of.
    ceilings: Ceilings,
    /// Whether the engine keeps a journal, learned from the first tasks and held, so an engine
    /// without one is not asked on every task.
    capabilities: EngineCapabilities,
    /// The run store, home of the journals the engine does not keep (`ABADA_AGENT_STORE_URL`).
    store: Option<RunStoreHome>,
    /// Deferrals of one run in the run store before it ends as an incident
    /// (`ABADA_AGENT_MAX_DEFERRALS_PER_RUN`).
    max_deferrals_per_run: u32,
}

/// The run store as the agent runtime uses it.
struct RunStoreHome {
    /// The store itself: in production the worker's [`crate::store::StoreHandle`].
    store: Arc<dyn RunStore>,
    /// Recorded as the owner of each run this worker claims.
    worker_id: String,
    /// How long a task waits for a store that fails transiently before it is given back:
    /// the lock duration, as for an engine outage.
    patience: Duration,
}

impl AgentRuntime {
    pub fn new(
        providers: ProviderRegistry,
        agents_file: Option<AgentsFile>,
        tool_http: reqwest::Client,
        settings: AgentSettings,
        metrics: Arc<Metrics>,
        ceilings: Ceilings,
    ) -> Self {
        AgentRuntime {
            providers,
            agents_file,
            bpmn: bpmn::BpmnDefinitions::new(settings.bpmn),
            tool_registry: None,
            tools: Arc::new(McpConnector::new(tool_http, settings.tool_sessions.clone())),
            settings,
            metrics,
            ceilings,
            capabilities: EngineCapabilities::default(),
            store: None,
            max_deferrals_per_run: DEFAULT_MAX_DEFERRALS_PER_RUN,
        }
    }

    /// The runtime with at most `max` deferrals per run in the run store.
    pub(crate) fn with_max_deferrals_per_run(mut self, max: u32) -> Self {
        self.max_deferrals_per_run = max;
        self
    }

    /// Keeps the journals of tasks without `attempt` in `store`, claimed as `worker_id`; a
    /// task waits up to `patience` for a store that fails transiently.
    pub(crate) fn with_store(
        mut self,
        store: Arc<dyn RunStore>,
        worker_id: &str,
        patience: Duration,
    ) -> Self {
        self.store = Some(RunStoreHome {
            store,
            worker_id: worker_id.to_string(),
            patience,
        });
        self
    }

    /// The runtime with `providers` instead of the ones it was built with (stand-ins).
    pub(crate) fn with_providers(mut self, providers: ProviderRegistry) -> Self {
        self.providers = providers;
        self
    }

    /// The models' pacers, shared by every task (`/readyz` and the metrics read which are held).
    pub(crate) fn capacities(&self) -> &Arc<crate::provider::capacity::ModelCapacities> {
        self.providers.capacities()
    }

    /// The runtime with its tool sessions opened by `tools` instead of MCP (a stand-in).
    pub fn with_tool_connector(mut self, tools: Arc<dyn ToolConnector>) -> Self {
        self.tools = tools;
        self
    }

    /// The runtime with the operator's tool-server registry.
    /// What the operator's tool-server registry sends in clear (its `oauth2` token endpoints
    /// allowed over `http://`), for the start-up warning; nothing without a registry.
    pub(crate) fn tool_credentials_in_clear(&self) -> Vec<String> {
        self.tool_registry
            .as_deref()
            .map(|r| r.credentials_in_clear().to_vec())
            .unwrap_or_default()
    }

    pub(crate) fn with_tool_registry(mut self, registry: Arc<ToolRegistry>) -> Self {
        self.tool_registry = Some(registry);
        self
    }
}

#[async_trait]
impl TaskHandler for AgentRuntime {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
        run::run(self, &task, &ctx).await
    }

    /// What the models the tasks of `topic` were seen to use can start soon, summed; no bound
    /// for a topic whose models are not known (a definition in the BPMN or sent by the engine
    /// names its own, learned from each task: `ModelCapacities::attribute`), nor while one of
    /// them has no bound.
    fn admission(&self, topic: &str, now: tokio::time::Instant) -> Capacity {
        self.providers.capacities().admission(topic, now)
    }

    fn claimed(&self, tasks: &[Task], now: tokio::time::Instant) {
        self.providers
            .capacities()
            .claimed(tasks.iter().map(|t| (t.id.as_str(), t.topic.as_str())), now);
    }
}
