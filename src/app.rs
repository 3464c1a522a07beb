//! The composition root: from a parsed [`Config`] and its [`Seams`] to a running worker (engine
//! client, agent runtime, runner with its heartbeat scheduler, admin endpoints), and the staged
//! shutdown around it.
//!
//! Every worker is wired here, by [`Worker::build`]: the production daemon
//! ([`Worker::from_config`]), the devkit's in-process workers, the simulator's workers and the
//! paused-clock tests' alike, so they all run the production wiring, every setting read from one
//! [`Config`]. What they change goes through the seams, never around them: a seam replaces a
//! whole part (the engine, the models, the tool connector, the run store, the randomness), and
//! the production part is then not built at all.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::agent::definition::AgentsFile;
use crate::agent::{AgentRuntime, AgentSettings};
use crate::auth::{OidcTokenProvider, TokenProvider};
use crate::backoff::Backoff;
use crate::config::Config;
use crate::engine::Engine;
use crate::engine::client::{EngineClientSettings, HttpEngine};
use crate::handler::TaskHandler;
use crate::metrics::Metrics;
use crate::provider::capacity::ModelCapacities;
use crate::provider::{ProviderKind, ProviderRegistry, ProviderSettings};
use crate::random::Random;
use crate::runner::{Runner, RunnerEvent, RunnerSettings};
use crate::store::{RunStore, StoreHandle, connect_backoff};
use crate::tools::registry::{
    ServerResolutionError, ToolRegistry, ToolsFile, ToolsFileError, UnregisteredPolicy,
};
use crate::tools::{McpConnector, ToolConnector};

/// Why the worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminBindError),
    #[error("cannot build the HTTP client: {0}")]
    Http(String),
    #[error("{0}")]
    Setup(String),
}

/// Puts the worker's engine behind a decorator (e.g. the devkit's gated engine).
pub(crate) type EngineWrapper = Box<dyn FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine> + Send>;

/// What a worker is built from besides its [`Config`]: the parts an operator never sets, which
/// the devkit, the simulator and the tests replace. `Seams::default()` is the production worker.
#[derive(Default)]
pub struct Seams {
    /// The engine. `None`: the HTTP client of `ABADA_AGENT_ENGINE_URL` (with the OIDC token and
    /// the extra headers when configured). A stand-in replaces it: no client is built.
    pub engine: Option<Arc<dyn Engine>>,
    /// Puts the engine (the client or the stand-in) behind a decorator before the runner and
    /// the handler see it.
    pub decorate_engine: Option<EngineWrapper>,
    /// Runs each task. `None`: the agent runtime the config describes (providers, agents file).
    pub handler: Option<Arc<dyn TaskHandler>>,
    /// The agent runtime's retry and backoff knobs; the devkit shortens them.
    pub agent: AgentSettings,
    /// The engine client's and the poll loop's timing; the devkit shortens it.
    pub tuning: Tuning,
    /// Receives the runner's events (the tests, the demo's timeline).
    pub events: Option<mpsc::UnboundedSender<RunnerEvent>>,
    /// The agent runtime's model providers. `None`: the adapters `ABADA_AGENT_PROVIDER_*`
    /// configure. A stand-in registry replaces the adapters (none is built, nor their HTTP
    /// client); what the configuration says of each provider still applies (its context window,
    /// its allowed models).
    pub providers: Option<ProviderRegistry>,
    /// Opens each task's tool sessions. `None`: MCP over HTTP to the servers the definitions
    /// and the registry name.
    pub tools: Option<Arc<dyn ToolConnector>>,
    /// The run store. `None`: the PostgreSQL store of `ABADA_AGENT_STORE_URL`, if set; a store
    /// given here replaces it (nothing is connected, `/readyz` does not report it).
    pub store: Option<Arc<dyn RunStore>>,
    /// Where the worker's randomness comes from (jitter, request ids, idempotency keys): the
    /// operating system by default; the simulator gives a generator seeded from its seed.
    pub random: Random,
}

/// Timing no variable sets. The defaults are production's; a test that injects faults shortens
/// them so that a retry takes milliseconds, not seconds.
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Tries of one engine command (complete, failure, journal append, ...) before its error
    /// is returned, and the backoff between them.
    pub command_attempts: u32,
    pub command_backoff: Backoff,
    /// The poll loop's backoff after transient engine errors.
    pub error_backoff: Backoff,
    /// The poll loop's backoff after the engine asked to slow down or refused the worker.
    pub throttle_backoff: Backoff,
    /// The heartbeat scheduler's backoff between retries of a failed extension.
    pub heartbeat_retry: Backoff,
    /// The poll loop's pauses after an empty answer that may be contention (right after tasks,
    /// or a worker's first): short, doubling, jittered, within one poll interval.
    pub contention_backoff: Backoff,
    /// Fraction by which an idle wait is stretched at random (0 in tests that count fetches).
    pub poll_jitter: f64,
    /// How long a queued run finish waits for a claim to carry it before an idle worker flushes
    /// it on its own ([`crate::store::IDLE_FLUSH_AFTER`]).
    pub store_idle_flush: Duration,
}

impl Default for Tuning {
    /// The engine client's and the runner's own defaults, so each lives in one place.
    fn default() -> Self {
        let client = EngineClientSettings::new(String::new(), String::new());
        let runner = RunnerSettings::new(String::new(), Duration::ZERO);
        Tuning {
            command_attempts: client.command_attempts,
            command_backoff: client.command_backoff,
            error_backoff: runner.error_backoff,
            throttle_backoff: runner.throttle_backoff,
            heartbeat_retry: runner.heartbeat.retry_backoff,
            contention_backoff: runner.contention_backoff,
            poll_jitter: runner.poll_jitter,
            store_idle_flush: crate::store::IDLE_FLUSH_AFTER,
        }
    }
}

/// The runner settings a config and its tuning imply.
pub(crate) fn runner_settings(config: &Config, tuning: &Tuning) -> RunnerSettings {
    let mut s = RunnerSettings::new(config.worker_id.clone(), config.lock_duration);
    s.topics = config.topics.clone();
    s.max_tasks = config.max_tasks;
    s.poll_interval = config.poll_interval;
    s.shutdown_grace = config.shutdown_grace;
    s.poll_jitter = tuning.poll_jitter;
    s.error_backoff = tuning.error_backoff;
    s.throttle_backoff = tuning.throttle_backoff;
    s.heartbeat.retry_backoff = tuning.heartbeat_retry;
    s.contention_backoff = tuning.contention_backoff;
    s
}

/// The engine client settings a config, its tuning and the worker's randomness imply.
fn engine_client_settings(
    config: &Config,
    tuning: &Tuning,
    random: &Random,
) -> EngineClientSettings {
    let mut s = EngineClientSettings::new(config.engine_url.clone(), config.worker_id.clone());
    s.request_timeout = config.engine_timeout;
    s.outage_patience = config.lock_duration;
    s.command_attempts = tuning.command_attempts;
    s.command_backoff = tuning.command_backoff;
    s.random = random.clone();
    s
}

/// A client builder trusting the platform roots plus `ABADA_AGENT_CA_FILE`.
fn client_builder(config: &Config) -> Result<reqwest::ClientBuilder, StartError> {
    crate::tls::http_client_builder(config.ca_file.as_deref())
        .map_err(|e| StartError::Setup(e.to_string()))
}

/// The shared HTTP client for the engine (one connection pool).
pub(crate) fn engine_http_client(config: &Config) -> Result<reqwest::Client, StartError> {
    client_builder(config)?
        .connect_timeout(Duration::from_secs(5))
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(64)
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| {
            StartError::Http(format!(
                "{} (engine {})",
                crate::redact::error_text(&e),
                crate::redact::url(&config.engine_url)
            ))
        })
}

/// The shared HTTP client for model providers and tool servers.
pub(crate) fn outbound_http_client(config: &Config) -> Result<reqwest::Client, StartError> {
    client_builder(config)?
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| StartError::Http(e.to_string()))
}

/// The OIDC token provider, when `ABADA_AGENT_OIDC_*` is set.
fn token_provider(config: &Config) -> Result<Option<Arc<dyn TokenProvider>>, StartError> {
    let Some(oidc) = &config.oidc else {
        return Ok(None);
    };
    let provider = OidcTokenProvider::new(oidc.clone(), client_builder(config)?)
        .map_err(|e| StartError::Setup(e.to_string()))?;
    Ok(Some(Arc::new(provider)))
}

/// Why the agent runtime cannot start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AgentSetupError {
    #[error(transparent)]
    AgentsFile(#[from] crate::agent::definition::AgentsFileError),
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
    #[error("the agents file {path}, agent {agent:?}: {source}")]
    ModelNotAllowed {
        path: std::path::PathBuf,
        agent: String,
        #[source]
        source: Box<crate::agent::limits::ModelNotAllowed>,
    },
    #[error(
        "tool servers {servers:?} list approvers in ABADA_AGENT_TOOLS_FILE, but the worker sends the engine no identity of its own (neither ABADA_AGENT_OIDC_ISSUER_URL nor ABADA_AGENT_ENGINE_HEADERS_FILE is set): an engine that serves it so is one whose security is off, where anyone names themselves as the approver. Give the worker an engine identity (with the operations:read scope, for the engine's activity history), or remove approvers"
    )]
    ApproversWithoutEngineIdentity { servers: Vec<String> },
}

/// The parts of the agent runtime a seam replaces ([`Seams::providers`], [`Seams::tools`]):
/// `None` builds production's.
#[derive(Default)]
pub(crate) struct AgentStandIns {
    pub providers: Option<ProviderRegistry>,
    pub tools: Option<Arc<dyn ToolConnector>>,
}

/// The agent runtime a [`Config`] describes (its providers, agents file and tool registry),
/// with `agent_settings`, its model adapters and tool connector replaced by `stand_ins`, its
/// randomness drawn from `random`. Everything an operator's mistake can break here fails at
/// start-up, stand-ins or not.
pub(crate) fn agent_runtime(
    config: &Config,
    agent_settings: AgentSettings,
    metrics: Arc<Metrics>,
    stand_ins: AgentStandIns,
    random: &Random,
) -> Result<AgentRuntime, AgentSetupError> {
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
            structured_output: p.structured_output,
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
            // Approvers are checked against the engine's record of who completed the approval
            // task: meaningless unless the engine checks identities, which it only can for a
            // worker that has one.
            let checked = registry.servers_with_approvers();
            if !checked.is_empty() && config.oidc.is_none() && config.engine_headers.is_none() {
                return Err(AgentSetupError::ApproversWithoutEngineIdentity { servers: checked });
            }
            let lowerable = registry.approvals_without_approvers();
            if !lowerable.is_empty() {
                tracing::warn!(
                    servers = ?lowerable,
                    "these tool servers have an approval in ABADA_AGENT_TOOLS_FILE but no approvers: a decision on their calls is whatever the process writes into its decision variable, so a process author can approve them (a script task copying the requestId). List approvers = {{ users = [...] }} for each, and scope them with processes = [...] to the processes you trust"
                );
            }
            Some(Arc::new(registry))
        }
    };
    let allowed_models = crate::agent::limits::ModelAllowList::new(
        config
            .providers
            .iter()
            .map(|p| (p.name.clone(), p.models.clone())),
    );
    // A local definition naming a server the registry lacks, or at another URL, or a model the
    // operator does not allow, is the operator's own mistake: said at start-up, not at the
    // first task.
    if let (Some(file), Some(path)) = (&agents_file, &config.agents_file) {
        for (key, def) in file.definitions() {
            allowed_models.check(&def.models).map_err(|source| {
                AgentSetupError::ModelNotAllowed {
                    path: path.clone(),
                    agent: key.to_string(),
                    source: Box::new(source),
                }
            })?;
            ToolRegistry::resolve(tool_registry.as_deref(), &def.tool_servers, true).map_err(
                |source| AgentSetupError::ToolServer {
                    path: path.clone(),
                    agent: key.to_string(),
                    source: Box::new(source),
                },
            )?;
        }
    }
    let mut agent_settings = agent_settings;
    agent_settings.tool_sessions.allow_insecure_http = config.allow_insecure_http;
    agent_settings.model_retry.capacity_wait_max = config.model_wait_max;
    let tools: Arc<dyn ToolConnector> = match stand_ins.tools {
        Some(tools) => tools,
        None => Arc::new(McpConnector::new(
            crate::tools::http_client(tls()?).map_err(|e| AgentSetupError::Http(e.to_string()))?,
            agent_settings.tool_sessions.clone(),
        )),
    };
    let mut providers = match stand_ins.providers {
        Some(providers) => providers,
        // A stand-in registry (the simulator's, a test's) comes with its own capacity policy.
        None => ProviderRegistry::with_capacity_policy(
            settings,
            outbound_http_client(config).map_err(|e| AgentSetupError::Http(e.to_string()))?,
            crate::provider::capacity::CapacityPolicy::with_max_wait(config.model_wait_max),
        ),
    };
    for p in &config.providers {
        if let Some(tokens) = p.context_window {
            providers = providers.with_context_window(p.name.clone(), tokens);
        }
        providers = providers.with_text_tool_calls(p.name.clone(), p.tool_calls_in_text);
    }
    let runtime = AgentRuntime::new(
        providers,
        agents_file,
        tools,
        agent_settings,
        metrics,
        config.ceilings,
    )
    .with_max_deferrals_per_run(config.max_deferrals_per_run)
    .with_allowed_models(allowed_models)
    .with_random(random.clone());
    let runtime = match tool_registry {
        Some(registry) => runtime.with_tool_registry(registry),
        None => runtime,
    };
    for (label, past) in runtime.label_overflow() {
        tracing::warn!(
            label,
            names = past,
            cap = crate::metrics::labels::MAX_DISTINCT_VALUES,
            "the agents and tools files name more values of a metric label than it takes; the names past the cap are labelled \"other\""
        );
    }
    Ok(runtime)
}

/// Runs the tasks until `shutdown` fires and the drain is over, then writes the run finishes
/// the store still has queued (every task has ended, its finish queued): the production worker
/// and the devkit's in-process workers alike.
pub async fn run_tasks(runner: Runner, store: Option<StoreHandle>, shutdown: CancellationToken) {
    runner.run(shutdown).await;
    if let Some(store) = store {
        store.flush().await;
    }
}

/// A worker that is wired but not yet running.
pub struct Worker {
    pub runner: Runner,
    pub metrics: Arc<Metrics>,
    pub engine: Arc<dyn Engine>,
    /// The run store (`ABADA_AGENT_STORE_URL`), connecting in the background from `build` on.
    pub store: Option<StoreHandle>,
    /// Stops the store's connector and sweeper when the worker stops.
    store_stop: CancellationToken,
    /// What travels in clear because `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allowed it (the
    /// configuration's URLs and the tools file's token endpoints, URLs redacted), for the one
    /// warning at start-up.
    pub credentials_in_clear: Vec<String>,
    /// The models' pacers (the agent runtime's): which are held, and why, for `/readyz` and
    /// the metrics.
    pub models: Option<Arc<ModelCapacities>>,
}

impl Worker {
    /// The production worker: the engine client (with OIDC when configured) and the agent
    /// runtime with the configured providers and agents file.
    pub fn from_config(config: &Config) -> Result<Worker, StartError> {
        Worker::build(config, Seams::default())
    }

    /// Wires a worker: the engine (the client unless the seam gives one, behind the seam's
    /// decorator), the run store when one is configured (connected and swept in the
    /// background: an outage at start-up is waited out like any other), the task handler (the
    /// agent runtime unless the seam gives one), and the runner around them. Must be called on
    /// a tokio runtime.
    pub fn build(config: &Config, seams: Seams) -> Result<Worker, StartError> {
        let metrics = Arc::new(Metrics::new());
        let store_stop = CancellationToken::new();
        let stand_in_store = seams.store;
        let configured_store = config.store.clone().filter(|_| stand_in_store.is_none());
        let store = configured_store.map(|store| {
            StoreHandle::connect_in_background(
                store,
                metrics.clone(),
                connect_backoff(),
                seams.tuning.store_idle_flush,
                store_stop.clone(),
                seams.random.clone(),
            )
        });
        let engine: Arc<dyn Engine> = match seams.engine {
            Some(engine) => engine,
            None => {
                if let Some(headers) = &config.engine_headers {
                    tracing::info!(names = ?headers.names(), "extra engine request headers from ABADA_AGENT_ENGINE_HEADERS_FILE (values not shown)");
                }
                Arc::new(
                    HttpEngine::new(
                        engine_http_client(config)?,
                        engine_client_settings(config, &seams.tuning, &seams.random),
                        token_provider(config)?,
                        metrics.clone(),
                    )
                    .with_headers(config.engine_headers.clone()),
                )
            }
        };
        let engine = match seams.decorate_engine {
            Some(wrap) => wrap(engine),
            None => engine,
        };
        let mut credentials_in_clear = config.credentials_in_clear();
        let mut models = None;
        let handler: Arc<dyn TaskHandler> = match seams.handler {
            Some(handler) => handler,
            None => {
                let mut runtime = agent_runtime(
                    config,
                    seams.agent,
                    metrics.clone(),
                    AgentStandIns {
                        providers: seams.providers,
                        tools: seams.tools,
                    },
                    &seams.random,
                )
                .map_err(|e| StartError::Setup(e.to_string()))?;
                credentials_in_clear.extend(runtime.tool_credentials_in_clear());
                let run_store = match stand_in_store {
                    Some(store) => Some(store),
                    None => store
                        .clone()
                        .map(|handle| Arc::new(handle) as Arc<dyn RunStore>),
                };
                if let Some(run_store) = run_store {
                    // A store outage is waited out for a lock duration, as an engine outage is.
                    runtime =
                        runtime.with_store(run_store, &config.worker_id, config.lock_duration);
                }
                let capacities = runtime.capacities().clone();
                // Replicas sharing a store pace their model calls as one queue in it.
                if let Some(handle) = store
                    .as_ref()
                    .filter(|_| config.store.as_ref().is_some_and(|s| s.shared_pacing))
                {
                    capacities.share_pace(Arc::new(handle.clone()));
                }
                models = Some(capacities);
                Arc::new(runtime)
            }
        };
        let mut runner = Runner::new(
            engine.clone(),
            handler,
            runner_settings(config, &seams.tuning),
            metrics.clone(),
        )
        .with_random(seams.random);
        if let Some(events) = seams.events {
            runner = runner.with_events(events);
        }
        Ok(Worker {
            runner,
            metrics,
            engine,
            store,
            store_stop,
            credentials_in_clear,
            models,
        })
    }

    /// Serves the admin endpoints on `addr` and runs until `shutdown` fires and the drain is
    /// over. Returns the admin address once bound through `bound`.
    pub async fn run(
        self,
        addr: SocketAddr,
        poll_interval: Duration,
        shutdown: CancellationToken,
        bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
    ) -> Result<(), StartError> {
        let admin_stop = CancellationToken::new();
        let state = crate::admin::AdminState {
            status: self.runner.status(),
            store: self.store.clone(),
            models: self.models.clone(),
            metrics: self.metrics.clone(),
            stall_limit: (poll_interval * 3).max(Duration::from_secs(30)) + Duration::from_secs(30),
        };
        let local = crate::admin::serve(addr, state, admin_stop.clone()).await?;
        tracing::info!(admin_addr = %local, "admin endpoints listening (/healthz, /readyz, /metrics)");
        if let Some(tx) = bound {
            let _ = tx.send(local);
        }
        run_tasks(self.runner, self.store.clone(), shutdown).await;
        self.store_stop.cancel();
        admin_stop.cancel();
        Ok(())
    }
}

/// How long the exit waits, once the worker has stopped, for work left on the runtime's blocking
/// threads: a validation abandoned at shutdown (`agent::output`) runs to its own end, bounded,
/// but nobody waits for its verdict. Dropping a runtime waits for every blocking thread without
/// a limit, which let one validation hold the exit past the grace period.
pub const EXIT_WAIT: Duration = Duration::from_secs(1);

/// Runs the daemon's future to its end on `runtime`, then shuts the runtime down waiting at most
/// [`EXIT_WAIT`] for its blocking threads: the process exits within its grace period whatever
/// still runs there.
pub fn run_to_exit<T>(runtime: tokio::runtime::Runtime, daemon: impl Future<Output = T>) -> T {
    let out = runtime.block_on(daemon);
    runtime.shutdown_timeout(EXIT_WAIT);
    out
}
