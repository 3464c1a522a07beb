//! The composition root: from a parsed [`Config`] and its [`Seams`] to a running worker (engine
//! client, agent runtime, runner with its heartbeat scheduler, admin endpoints), and the staged
//! shutdown around it.
//!
//! Every worker is wired here, by [`Worker::build`]: the production daemon
//! ([`Worker::from_config`]), the devkit's in-process workers and the tests' alike, so the tests
//! run the production wiring. What they change goes through the seams, never around them.

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
use crate::runner::{Runner, RunnerEvent, RunnerSettings};
use crate::store::{RunStore, StoreHandle, connect_backoff};
use crate::tools::ToolConnector;
use crate::tools::registry::{
    ServerResolutionError, ToolRegistry, ToolsFile, ToolsFileError, UnregisteredPolicy,
};

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

/// Puts the engine client behind a decorator (e.g. the devkit's gated engine).
pub(crate) type EngineWrapper = Box<dyn FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine> + Send>;

/// What a worker is built from besides its [`Config`]: the parts an operator never sets, which
/// the devkit and the tests replace. `Seams::default()` is the production worker.
#[derive(Default)]
pub struct Seams {
    /// Wraps the engine client before the runner and the handler see it.
    pub engine: Option<EngineWrapper>,
    /// Runs each task. `None`: the agent runtime the config describes (providers, agents file).
    pub handler: Option<Arc<dyn TaskHandler>>,
    /// The agent runtime's retry and backoff knobs; the devkit shortens them.
    pub agent: AgentSettings,
    /// The engine client's and the poll loop's timing; the devkit shortens it.
    pub tuning: Tuning,
    /// Receives the runner's events (the tests, the demo's timeline).
    pub events: Option<mpsc::UnboundedSender<RunnerEvent>>,
    /// The agent runtime's model providers. `None`: the ones `ABADA_AGENT_PROVIDER_*` configure.
    pub providers: Option<ProviderRegistry>,
    /// Opens each task's tool sessions. `None`: MCP over HTTP to the servers the definitions
    /// and the registry name.
    pub tools: Option<Arc<dyn ToolConnector>>,
    /// The run store. `None`: the PostgreSQL store of `ABADA_AGENT_STORE_URL`, if set; a store
    /// given here replaces it (nothing is connected, `/readyz` does not report it).
    pub store: Option<Arc<dyn RunStore>>,
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
    s
}

/// The engine client settings a config and its tuning imply.
fn engine_client_settings(config: &Config, tuning: &Tuning) -> EngineClientSettings {
    let mut s = EngineClientSettings::new(config.engine_url.clone(), config.worker_id.clone());
    s.request_timeout = config.engine_timeout;
    s.outage_patience = config.lock_duration;
    s.command_attempts = tuning.command_attempts;
    s.command_backoff = tuning.command_backoff;
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
        .map_err(|e| StartError::Http(format!("{e} (engine {})", config.engine_url)))
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
}

/// The agent runtime a [`Config`] describes (its providers, agents file and tool registry),
/// with `agent_settings`. Everything an operator's mistake can break here fails at start-up.
pub(crate) fn agent_runtime(
    config: &Config,
    http: reqwest::Client,
    agent_settings: AgentSettings,
    metrics: Arc<Metrics>,
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
    agent_settings.model_retry.capacity_wait_max = config.model_wait_max;
    let mut providers = ProviderRegistry::with_capacity_policy(
        settings,
        http,
        crate::provider::capacity::CapacityPolicy::with_max_wait(config.model_wait_max),
    );
    for p in &config.providers {
        if let Some(tokens) = p.context_window {
            providers = providers.with_context_window(p.name.clone(), tokens);
        }
    }
    let runtime = AgentRuntime::new(
        providers,
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

/// Runs the tasks until `shutdown` fires and the drain is over, then writes the run finishes
/// the store still has queued (every task has ended, its finish queued): the production worker
/// and the devkit's in-process workers alike.
pub(crate) async fn run_tasks(
    runner: Runner,
    store: Option<StoreHandle>,
    shutdown: CancellationToken,
) {
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

    /// Wires a worker: the engine client (behind the engine seam), the run store when one is
    /// configured (connected and swept in the background: an outage at start-up is waited out
    /// like any other), the task handler (the agent runtime unless the seam gives one), and the
    /// runner around them. Must be called on a tokio runtime.
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
            )
        });
        if let Some(headers) = &config.engine_headers {
            tracing::info!(names = ?headers.names(), "extra engine request headers from ABADA_AGENT_ENGINE_HEADERS_FILE (values not shown)");
        }
        let client: Arc<dyn Engine> = Arc::new(
            HttpEngine::new(
                engine_http_client(config)?,
                engine_client_settings(config, &seams.tuning),
                token_provider(config)?,
                metrics.clone(),
            )
            .with_headers(config.engine_headers.clone()),
        );
        let engine = match seams.engine {
            Some(wrap) => wrap(client),
            None => client,
        };
        let mut credentials_in_clear = config.credentials_in_clear();
        let mut models = None;
        let handler: Arc<dyn TaskHandler> = match seams.handler {
            Some(handler) => handler,
            None => {
                let mut runtime = agent_runtime(
                    config,
                    outbound_http_client(config)?,
                    seams.agent,
                    metrics.clone(),
                )
                .map_err(|e| StartError::Setup(e.to_string()))?;
                credentials_in_clear.extend(runtime.tool_credentials_in_clear());
                if let Some(providers) = seams.providers {
                    runtime = runtime.with_providers(providers);
                }
                if let Some(tools) = seams.tools {
                    runtime = runtime.with_tool_connector(tools);
                }
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
        );
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
