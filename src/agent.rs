//! The agent runtime: the [`TaskHandler`] that turns a claimed `abada:agent` task into an agent
//! run (a conversation with a model that calls MCP tools), durable through the task's journal,
//! ending in exactly one outcome of protocol.md B.5.
//!
//! - `approval`: which tool calls wait for a person's approval, and the decision variables;
//! - `bpmn`: agent definitions written on the BPMN service task (`abada.agent.*` properties);
//! - `definition`: agent definitions, the agents file, `${name}` templates;
//! - `journal`: the journal's step shapes and the replay that resumes a run;
//! - `limits`: what a model can make the worker do (tool calls, writes, turns, time, tokens);
//! - `run`: the conversation loop of one attempt;
//! - `run_key`: the key of a run that waits for approval across the tasks of one node visit.
//!
//! Shared by all tasks: the provider registry (keys cached), the HTTP clients, what the engine is
//! known to offer ([`EngineCapabilities`]). Private to each task: its conversation, its MCP
//! sessions and their credentials, its journal state and budget. Where a task's journal lives is
//! decided in one place, [`AgentRuntime::journal_home`].

pub mod approval;
pub mod bpmn;
mod canonical;
pub mod definition;
pub mod journal;
pub mod limits;
mod run;
pub mod run_key;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::engine::Task;
use crate::engine::capabilities::{EngineCapabilities, JournalSupport, NoJournalEvidence};
use crate::handler::{Outcome, TaskContext, TaskEnd, TaskHandler};
use crate::lease::{Lease, LeaseId};
use crate::metrics::Metrics;
use crate::provider::fallback::RetryPolicy;
use crate::provider::{ProviderKind, ProviderRegistry, ProviderSettings};
use crate::store::{Fence, RunEnd, RunStore};
use crate::tools::registry::{
    ServerResolutionError, ToolRegistry, ToolsFile, ToolsFileError, UnregisteredPolicy,
};
use crate::tools::{McpConnector, ToolConnector, ToolSessionOptions};
use definition::AgentsFile;
use limits::Ceilings;

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
    /// Runs that ended in an outcome that commits them once the engine accepts it, by lease:
    /// [`TaskHandler::ended`] finishes them in the store.
    finishing: Mutex<HashMap<LeaseId, FinishingRun>>,
    /// Deferrals of one run in the run store before it ends as an incident
    /// (`ABADA_AGENT_MAX_DEFERRALS_PER_RUN`).
    max_deferrals_per_run: u32,
}

/// A run to finish in the store once the engine accepts its end.
type FinishingRun = (Arc<dyn RunStore>, Fence, RunEnd);

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

/// Where a task's journal lives (protocol.md Part B and D).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalHome {
    /// The engine's journal endpoints: an agent/1 task on an engine that has them.
    Engine,
    /// The run store: a task without `attempt` (an engine without agent/1, Part D) when
    /// `ABADA_AGENT_STORE_URL` is set. The store's claim gives the fencing token.
    Store,
    /// Nowhere: the agent runs without durability and starts over on its next attempt.
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
    #[error(transparent)]
    ToolsFile(#[from] ToolsFileError),
    #[error("the agents file {path}, agent {agent:?}: {source}")]
    ToolServer {
        path: std::path::PathBuf,
        agent: String,
        #[source]
        source: Box<ServerResolutionError>,
    },
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
            finishing: Mutex::new(HashMap::new()),
            max_deferrals_per_run: crate::config::DEFAULT_MAX_DEFERRALS_PER_RUN,
        }
    }

    /// The runtime with at most `max` deferrals per run in the run store.
    pub fn with_max_deferrals_per_run(mut self, max: u32) -> Self {
        self.max_deferrals_per_run = max;
        self
    }

    /// Keeps the journals of tasks without `attempt` in `store`, claimed as `worker_id`; a
    /// task waits up to `patience` for a store that fails transiently.
    pub fn with_store(
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
    pub fn with_providers(mut self, providers: ProviderRegistry) -> Self {
        self.providers = providers;
        self
    }

    /// The runtime with its tool sessions opened by `tools` instead of MCP (a stand-in).
    pub fn with_tool_connector(mut self, tools: Arc<dyn ToolConnector>) -> Self {
        self.tools = tools;
        self
    }

    /// The runtime with the operator's tool-server registry.
    pub fn with_tool_registry(mut self, registry: Arc<ToolRegistry>) -> Self {
        self.tool_registry = Some(registry);
        self
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
        let tls = || {
            crate::tls::http_client_builder(config.ca_file.as_deref())
                .map_err(|e| AgentSetupError::Http(e.to_string()))
        };
        let tool_registry = match &config.tools_file {
            None => None,
            Some(path) => {
                let file = ToolsFile::load(path)?;
                file.check_channels(path, config.allow_insecure_http)?;
                let mut registry = ToolRegistry::start(file, tls()?)
                    .map_err(|e| AgentSetupError::Http(e.to_string()))?;
                if config.tools_unregistered == UnregisteredPolicy::Allow {
                    // Each session to an unregistered server gets a client of its own, pinned
                    // to the addresses checked: with the same trust roots as every client.
                    let certs = config
                        .ca_file
                        .as_deref()
                        .map(crate::tls::load_ca_bundle)
                        .transpose()
                        .map_err(|e| AgentSetupError::Http(e.to_string()))?;
                    let clients = Arc::new(move || match &certs {
                        Some(certs) => reqwest::Client::builder().tls_certs_merge(certs.clone()),
                        None => reqwest::Client::builder(),
                    });
                    registry = registry.allow_unregistered(clients, None);
                }
                tracing::info!(servers = registry.len(), "tool-server registry loaded");
                Some(Arc::new(registry))
            }
        };
        // A local definition naming a server the registry lacks, or at another URL, is the
        // operator's own mistake: said at start-up, not at the first task.
        if let (Some(file), Some(path)) = (&agents_file, &config.agents_file) {
            for (key, def) in file.definitions() {
                ToolRegistry::resolve(tool_registry.as_deref(), &def.tool_servers, true).map_err(
                    |source| AgentSetupError::ToolServer {
                        path: path.clone(),
                        agent: key.to_string(),
                        source: Box::new(source),
                    },
                )?;
            }
        }
        let tool_http =
            crate::tools::http_client(tls()?).map_err(|e| AgentSetupError::Http(e.to_string()))?;
        let mut agent_settings = agent_settings;
        agent_settings.tool_sessions.allow_insecure_http = config.allow_insecure_http;
        let runtime = AgentRuntime::new(
            ProviderRegistry::new(settings, http),
            agents_file,
            tool_http,
            agent_settings,
            metrics,
            config.ceilings,
        )
        .with_max_deferrals_per_run(config.max_deferrals_per_run);
        Ok(match tool_registry {
            Some(registry) => runtime.with_tool_registry(registry),
            None => runtime,
        })
    }

    /// Where `task`'s journal lives: the one place that choice is made. A run that may wait for
    /// a person's approval (`waits_across_tasks`) outlives its task, so it lives in the run store
    /// under its process run key (`run_key`); [`run`] refuses such a definition before this
    /// when no store is configured. Otherwise a task without `attempt` is not an agent/1 task
    /// (protocol.md Part B), and shows the engine speaks plain v1: its journal is in the run
    /// store when one is configured, else nowhere. An agent/1 task journals to the engine
    /// (authoritative there: its attempt is the engine's fencing token) unless the engine is
    /// known to have no journal.
    pub fn journal_home(&self, task: &Task, waits_across_tasks: bool) -> JournalHome {
        if waits_across_tasks && self.store.is_some() {
            return JournalHome::Store;
        }
        if task.attempt.is_none() {
            if self.store.is_some() {
                return JournalHome::Store;
            }
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

    /// A run whose completion (or BPMN error) the engine accepted is finished in the store: it
    /// will not be resumed. Any other end keeps it for the next attempt.
    async fn ended(&self, _task: &Task, lease: &Lease, end: TaskEnd) {
        let finishing = self
            .finishing
            .lock()
            .expect("finishing lock poisoned")
            .remove(&lease.id());
        let Some((store, fence, run_end)) = finishing else {
            return;
        };
        if !matches!(end, TaskEnd::Completed | TaskEnd::BpmnError) {
            return;
        }
        run::finish_in_store(self, store.as_ref(), &fence, run_end).await;
    }
}
