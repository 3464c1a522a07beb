//! Start-up wiring: from a parsed [`Config`] to a running worker (engine client, heartbeat
//! scheduler, runner, admin endpoints), and the staged shutdown around it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::agent::AgentRuntime;
use crate::auth::{OidcTokenProvider, TokenProvider};
use crate::config::Config;
use crate::engine::Engine;
use crate::engine::client::{EngineClientSettings, HttpEngine};
use crate::handler::TaskHandler;
use crate::metrics::Metrics;
use crate::runner::{Runner, RunnerSettings};

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

/// The runner settings a config implies.
pub fn runner_settings(config: &Config) -> RunnerSettings {
    let mut s = RunnerSettings::new(config.worker_id.clone(), config.lock_duration);
    s.topics = config.topics.clone();
    s.max_tasks = config.max_tasks;
    s.poll_interval = config.poll_interval;
    s.shutdown_grace = config.shutdown_grace;
    s
}

/// A client builder trusting the platform roots plus `ABADA_AGENT_CA_FILE`.
fn client_builder(config: &Config) -> Result<reqwest::ClientBuilder, StartError> {
    crate::tls::http_client_builder(config.ca_file.as_deref())
        .map_err(|e| StartError::Setup(e.to_string()))
}

/// The shared HTTP client for the engine (one connection pool).
pub fn engine_http_client(config: &Config) -> Result<reqwest::Client, StartError> {
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
pub fn outbound_http_client(config: &Config) -> Result<reqwest::Client, StartError> {
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

/// A worker that is wired but not yet running.
pub struct Worker {
    pub runner: Runner,
    pub metrics: Arc<Metrics>,
    pub engine: Arc<dyn Engine>,
}

impl Worker {
    /// The production worker: the engine client (with OIDC when configured) and the agent
    /// runtime with the configured providers and agents file.
    pub fn from_config(config: &Config) -> Result<Worker, StartError> {
        let metrics = Arc::new(Metrics::new());
        let runtime =
            AgentRuntime::from_config(config, outbound_http_client(config)?, metrics.clone())
                .map_err(|e| StartError::Setup(e.to_string()))?;
        Worker::build(config, metrics, Arc::new(runtime))
    }

    /// Builds the engine client and the runner around `handler`.
    pub fn build(
        config: &Config,
        metrics: Arc<Metrics>,
        handler: Arc<dyn TaskHandler>,
    ) -> Result<Worker, StartError> {
        let mut engine_settings =
            EngineClientSettings::new(config.engine_url.clone(), config.worker_id.clone());
        engine_settings.request_timeout = config.engine_timeout;
        engine_settings.outage_patience = config.lock_duration;
        let engine: Arc<dyn Engine> = Arc::new(HttpEngine::new(
            engine_http_client(config)?,
            engine_settings,
            token_provider(config)?,
            metrics.clone(),
        ));
        let runner = Runner::new(
            engine.clone(),
            handler,
            runner_settings(config),
            metrics.clone(),
        );
        Ok(Worker {
            runner,
            metrics,
            engine,
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
            metrics: self.metrics.clone(),
            stall_limit: (poll_interval * 3).max(Duration::from_secs(30)) + Duration::from_secs(30),
        };
        let local = crate::admin::serve(addr, state, admin_stop.clone()).await?;
        tracing::info!(admin_addr = %local, "admin endpoints listening (/healthz, /readyz, /metrics)");
        if let Some(tx) = bound {
            let _ = tx.send(local);
        }
        self.runner.run(shutdown).await;
        admin_stop.cancel();
        Ok(())
    }
}
