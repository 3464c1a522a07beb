//! The whole embedded system on loopback: the engine emulator, the scripted model provider and
//! the `orders` MCP tool server (which accepts exactly the credentials the emulator issued for
//! it), plus in-process workers running the real runner and agent runtime over real HTTP, built
//! by the composition root ([`Worker::build`]) from a [`Config`] that names the stand-ins.
//! The demo, the integration tests and the benchmarks all start it the same way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::{self, Authorizer, EmulatorOptions, EngineEmulator, ProtocolLevel};
use super::model::{Script, ScriptedModel, Turn};
use super::tools::{CredentialValidator, ToolServer, ToolServerOptions};
use crate::agent::AgentSettings;
use crate::app::{EngineWrapper, Seams, Tuning, Worker};
use crate::backoff::Backoff;
use crate::config::{self, Config};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::provider::fallback::RetryPolicy;
use crate::runner::{RunnerEvent, WorkerStatus};

/// The name of the devkit tool server.
pub const ORDERS_SERVER: &str = "orders";
/// The scripted model of the refund agent: a read-only lookup, a keyed write, a JSON answer.
pub const REFUND_MODEL: &str = "refund";

/// Why the stack could not start.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("engine emulator: {0}")]
    Engine(#[from] engine::EmulatorError),
    #[error("scripted model: {0}")]
    Model(std::io::Error),
    #[error("tool server: {0}")]
    Tools(#[from] super::tools::ToolServerError),
}

/// Accepts a bearer token when the emulator issued it for this server to a live lease.
struct EmulatorCredentials(EngineEmulator);

impl CredentialValidator for EmulatorCredentials {
    fn validate(&self, server: &str, token: &str) -> bool {
        self.0.verify_tool_credential(server, token).is_some()
    }
}

/// How to start the stack.
#[derive(Clone, Default)]
pub struct StackOptions {
    pub protocol: ProtocolLevel,
    /// Makes the emulator a secured engine: every `/api` request must pass it (e.g. a
    /// [`JwtValidator`](super::jwt::JwtValidator) loaded from the issuer the workers use).
    pub authorizer: Option<Arc<dyn Authorizer>>,
}

impl std::fmt::Debug for StackOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackOptions")
            .field("protocol", &self.protocol)
            .field("authorizer", &self.authorizer.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// The running stand-ins.
pub struct Stack {
    pub engine: EngineEmulator,
    pub model: ScriptedModel,
    pub tools: ToolServer,
    /// The per-request timeout workers started against this stack give their model providers
    /// (default 10 s); fault tests shorten it.
    provider_request_timeout: std::sync::Mutex<Duration>,
}

/// How an in-process worker is set up.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub worker_id: String,
    pub slots: u32,
    pub lock_duration: Duration,
    pub poll_interval: Duration,
    pub shutdown_grace: Duration,
}

impl WorkerOptions {
    pub fn new(worker_id: impl Into<String>, slots: u32) -> Self {
        WorkerOptions {
            worker_id: worker_id.into(),
            slots,
            lock_duration: Duration::from_secs(10),
            poll_interval: Duration::from_millis(200),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// A worker running in this process.
pub struct WorkerHandle {
    pub worker_id: String,
    pub shutdown: CancellationToken,
    pub events: mpsc::UnboundedReceiver<RunnerEvent>,
    pub metrics: Arc<Metrics>,
    pub status: Arc<WorkerStatus>,
    /// The worker's engine client, behind its decorator if it was given one.
    pub engine: Arc<dyn Engine>,
    join: tokio::task::JoinHandle<()>,
}

impl WorkerHandle {
    /// Staged shutdown, waiting for the drain to end.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
    }

    /// [`WorkerHandle::stop`], then the events not received yet, in order.
    pub async fn stop_collecting(mut self) -> Vec<RunnerEvent> {
        self.shutdown.cancel();
        let _ = (&mut self.join).await;
        let mut rest = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            rest.push(e);
        }
        rest
    }

    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

impl Stack {
    /// An open (unsecured) engine speaking `protocol`, the model and the `orders` tool server.
    pub async fn start(protocol: ProtocolLevel) -> Result<Stack, StackError> {
        Stack::start_with(StackOptions {
            protocol,
            authorizer: None,
        })
        .await
    }

    /// The stack as `options` say (e.g. a secured engine).
    pub async fn start_with(options: StackOptions) -> Result<Stack, StackError> {
        let engine = engine::start(EmulatorOptions {
            protocol: options.protocol,
            authorizer: options.authorizer,
            ..EmulatorOptions::default()
        })
        .await?;
        let model = ScriptedModel::start().await.map_err(StackError::Model)?;
        let tools = start_tool_server(&engine, ORDERS_SERVER).await?;
        model.set_script(REFUND_MODEL, refund_script());
        Ok(Stack {
            engine,
            model,
            tools,
            provider_request_timeout: std::sync::Mutex::new(Duration::from_secs(10)),
        })
    }

    /// Another devkit tool server named `name`, accepting exactly the credentials this stack's
    /// emulator issued for `name` to a live lease. The caller shuts it down.
    pub async fn start_tool_server(&self, name: &str) -> Result<ToolServer, StackError> {
        start_tool_server(&self.engine, name).await
    }

    /// Sets the providers' per-request timeout for workers spawned from now on.
    pub fn set_provider_request_timeout(&self, timeout: Duration) {
        *self
            .provider_request_timeout
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = timeout;
    }

    /// The per-request timeout for the model providers of workers started from now on.
    pub fn provider_request_timeout(&self) -> Duration {
        *self
            .provider_request_timeout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The refund agent's definition, on `provider/model` with optional fallbacks.
    pub fn refund_agent(&self, model: &str, fallbacks: &[&str]) -> Value {
        json!({
            "name": "refund-agent",
            "model": model,
            "fallbackModels": fallbacks,
            "instructions": "You handle refund requests. Look the order up, refund it, answer with JSON.",
            "input": "${orderId}",
            "toolServers": [{"name": ORDERS_SERVER, "url": self.tools.url()}],
            "maxTurns": 8,
            "resultVariable": "refundDecision"
        })
    }

    /// Agent settings with short backoffs, for tests and the demo.
    pub fn fast_agent_settings() -> AgentSettings {
        AgentSettings {
            model_retry: RetryPolicy {
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(200),
                unavailable_default: Duration::from_secs(1),
                ..RetryPolicy::default()
            },
            tool_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
            technical_retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(2))
                .without_jitter(),
            ..AgentSettings::default()
        }
    }

    /// Starts a worker with the real runner and agent runtime against the stack.
    pub fn spawn_worker(&self, opts: WorkerOptions, agent: AgentSettings) -> WorkerHandle {
        self.spawn(opts, agent, None)
    }

    /// [`Stack::spawn_worker`] with the worker's engine client wrapped by `wrap` (e.g.
    /// [`GatedEngine::wrapper`](super::gate::GatedEngine::wrapper)).
    pub fn spawn_worker_with(
        &self,
        opts: WorkerOptions,
        agent: AgentSettings,
        wrap: impl FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine> + Send + 'static,
    ) -> WorkerHandle {
        self.spawn(opts, agent, Some(Box::new(wrap)))
    }

    fn spawn(
        &self,
        opts: WorkerOptions,
        agent: AgentSettings,
        engine: Option<EngineWrapper>,
    ) -> WorkerHandle {
        let config = match Config::from_env(&worker_env(self, &opts)) {
            Ok(c) => c,
            Err(e) => panic!("in-process worker {}: {e}", opts.worker_id),
        };
        start(
            &config,
            Seams {
                engine,
                agent,
                tuning: fast_tuning(),
                ..Seams::default()
            },
        )
    }

    pub async fn shutdown(&self) {
        self.tools.shutdown().await;
        self.model.shutdown().await;
        self.engine.shutdown().await;
    }
}

/// The engine client's and the poll loop's backoffs shortened to milliseconds, so that a fault
/// is retried within a test's patience.
pub fn fast_tuning() -> Tuning {
    Tuning {
        command_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(500)),
        error_backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
        ..Tuning::default()
    }
}

/// The whole `ABADA_AGENT_*` environment of a worker against `stack`: its engine emulator, the
/// providers `openai` and `anthropic` (both served by the scripted model), and `opts`.
pub fn worker_env(stack: &Stack, opts: &WorkerOptions) -> HashMap<String, String> {
    let ms = |d: Duration| d.as_millis().to_string();
    let provider_timeout = ms(stack.provider_request_timeout());
    HashMap::from([
        (config::ENV_ENGINE_URL.into(), stack.engine.base_url()),
        (config::ENV_WORKER_ID.into(), opts.worker_id.clone()),
        (config::ENV_MAX_TASKS.into(), opts.slots.to_string()),
        (config::ENV_POLL_INTERVAL_MS.into(), ms(opts.poll_interval)),
        (config::ENV_LOCK_DURATION_MS.into(), ms(opts.lock_duration)),
        (
            config::ENV_SHUTDOWN_GRACE_MS.into(),
            ms(opts.shutdown_grace),
        ),
        (config::ENV_ENGINE_TIMEOUT_MS.into(), "5000".into()),
        // Never bound: in-process workers serve no admin endpoints.
        (config::ENV_HTTP_ADDR.into(), "127.0.0.1:0".into()),
        (config::ENV_PROVIDERS.into(), "openai,anthropic".into()),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL".into(),
            stack.model.base_url_openai(),
        ),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_TIMEOUT_MS".into(),
            provider_timeout.clone(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_BASE_URL".into(),
            stack.model.base_url_anthropic(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_TIMEOUT_MS".into(),
            provider_timeout,
        ),
    ])
}

/// Builds a worker from `config` and `seams` through the composition root and runs it on the
/// current runtime until its handle stops it.
///
/// # Panics
/// When the worker cannot be built: the configuration is the caller's, so that is a bug.
pub fn start(config: &Config, mut seams: Seams) -> WorkerHandle {
    let (tx, events) = mpsc::unbounded_channel();
    seams.events = Some(tx);
    let worker = match Worker::build(config, seams) {
        Ok(w) => w,
        Err(e) => panic!("in-process worker {}: {e}", config.worker_id),
    };
    let status = worker.runner.status();
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(worker.runner.run(shutdown.clone()));
    WorkerHandle {
        worker_id: config.worker_id.clone(),
        shutdown,
        events,
        metrics: worker.metrics,
        status,
        engine: worker.engine,
        join,
    }
}

async fn start_tool_server(engine: &EngineEmulator, name: &str) -> Result<ToolServer, StackError> {
    Ok(ToolServer::start(ToolServerOptions::new(
        name,
        Arc::new(EmulatorCredentials(engine.clone())),
    ))
    .await?)
}

/// Look the order up (read-only), refund it (a keyed write), answer with JSON.
pub fn refund_script() -> Script {
    Script::new(vec![
        Turn::call("lookup_order", json!({"orderId": "${input}"})),
        Turn::call(
            "issue_refund",
            json!({"orderId": "${input}", "amountCents": 1500, "reason": "damaged"}),
        ),
        Turn::text(
            r#"{"decision": "refunded", "orderId": "${input}", "refund": ${last_tool_result}}"#,
        ),
    ])
    .with_usage(120, 30)
}
