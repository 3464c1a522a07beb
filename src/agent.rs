//! The agent runtime: the [`TaskHandler`] that turns a claimed `abada:agent` task into an agent
//! run (a conversation with a model that calls MCP tools), durable through the task's journal,
//! ending in exactly one outcome of protocol.md B.5.
//!
//! - `answer_shape`: a model's answer examined before it is acted on: a tool call written as
//!   text (repaired or parsed, per provider), an empty answer, a call repeated after its result;
//! - `examining`: what an attempt does with that examination: the repair turn journaled and
//!   counted, the incident once the repairs are spent, a repeated write answered, not performed;
//! - `approval`: which tool calls wait for a person's approval, and the decision variables;
//! - `bpmn`: agent definitions written on the BPMN service task (`abada.agent.*` properties);
//! - `definition`: agent definitions, the agents file, `${name}` templates;
//! - `journal`: the journal's step shapes and the replay that resumes a run;
//! - `limits`: what a model can make the worker do (tool calls, writes, turns, time, tokens);
//! - `output`: structured output: the compiled `outputSchema`, the verdict on a final answer,
//!   its repair turns;
//! - `judging`: the verdict on a final answer that needs the validator, journaled first so a
//!   validation that never ends is an incident, not a crash loop;
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

pub(crate) mod answer_shape;
pub mod approval;
mod approval_gate;
pub(crate) mod approver;
mod attempt;
pub mod bpmn;
mod canonical;
pub mod definition;
mod examining;
pub mod journal;
mod judging;
pub mod limits;
pub mod output;
mod run;
mod run_home;
mod run_journal;
pub mod run_key;
mod scope;
mod tool_call;
mod tool_scope;
mod window;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::backoff::Backoff;
use crate::engine::Task;
use crate::engine::capabilities::EngineCapabilities;
use crate::handler::{Outcome, TaskContext, TaskHandler};
use crate::metrics::Metrics;
use crate::metrics::labels::{OperatorNames, Vocabulary};
use crate::provider::ProviderRegistry;
use crate::provider::capacity::Capacity;
use crate::provider::fallback::RetryPolicy;
use crate::random::Random;
use crate::store::RunStore;
use crate::tools::registry::ToolRegistry;
use crate::tools::{ToolConnector, ToolSessionOptions};
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
    /// Validate a final answer against its schema on the task's own thread, not on a blocking
    /// thread (`agent::output::judge_off_runtime`): for the deterministic simulator only, whose
    /// one thread's order a blocking thread's wake-up would race (the paused clock does not
    /// move meanwhile, but what else runs at that instant does). Production keeps `false`.
    pub validate_inline: bool,
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
            validate_inline: false,
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
    /// The operator's per-provider model allow-list: every definition a task runs is checked.
    allowed_models: limits::ModelAllowList,
    /// The names the operator's files declare, which alone label metrics
    /// ([`crate::metrics::labels`]).
    operator_names: OperatorNames,
    labels: Arc<Vocabulary>,
    /// The worker's randomness: backoffs' jitter, approval request ids, span ids sent on.
    random: Random,
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
    /// The runtime every task of a worker shares, built by the composition root alone
    /// (`app::agent_runtime`): its models, definitions, tool connector, knobs and ceilings.
    pub(crate) fn new(
        providers: ProviderRegistry,
        agents_file: Option<AgentsFile>,
        tools: Arc<dyn ToolConnector>,
        settings: AgentSettings,
        metrics: Arc<Metrics>,
        ceilings: Ceilings,
    ) -> Self {
        let mut operator_names = OperatorNames::default();
        for (_, def) in agents_file.iter().flat_map(|f| f.definitions()) {
            operator_names.agents.insert(def.name.clone());
            operator_names.models.extend(
                def.models
                    .iter()
                    .map(|m| (m.provider.clone(), m.model.clone())),
            );
            operator_names
                .servers
                .extend(def.tool_servers.iter().map(|s| s.name.clone()));
        }
        AgentRuntime {
            labels: Arc::new(Vocabulary::new(&operator_names)),
            operator_names,
            providers,
            agents_file,
            bpmn: bpmn::BpmnDefinitions::new(settings.bpmn),
            tool_registry: None,
            tools,
            settings,
            metrics,
            ceilings,
            capabilities: EngineCapabilities::default(),
            store: None,
            max_deferrals_per_run: DEFAULT_MAX_DEFERRALS_PER_RUN,
            allowed_models: limits::ModelAllowList::default(),
            random: Random::os(),
        }
    }

    /// The runtime drawing its randomness from `random` (the worker's; its providers' too).
    pub(crate) fn with_random(mut self, random: Random) -> Self {
        self.providers = self.providers.with_random(random.clone());
        self.random = random;
        self
    }

    /// The runtime with the operator's per-provider model allow-list; its models are the
    /// operator's names too, so they label metrics.
    pub(crate) fn with_allowed_models(mut self, allowed: limits::ModelAllowList) -> Self {
        self.operator_names.models.extend(
            allowed
                .models()
                .map(|(provider, model)| (provider.to_string(), model.to_string())),
        );
        self.labels = Arc::new(Vocabulary::new(&self.operator_names));
        self.allowed_models = allowed;
        self
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

    /// The models' pacers, shared by every task (`/readyz` and the metrics read which are held).
    pub(crate) fn capacities(&self) -> &Arc<crate::provider::capacity::ModelCapacities> {
        self.providers.capacities()
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
        self.operator_names
            .servers
            .extend(registry.names().map(str::to_string));
        self.labels = Arc::new(Vocabulary::new(&self.operator_names));
        self.tool_registry = Some(registry);
        self
    }

    /// The operator's names past a metric label's cap, by label: they label as `other`.
    pub(crate) fn label_overflow(&self) -> Vec<(&'static str, usize)> {
        Vocabulary::overflow(&self.operator_names)
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
