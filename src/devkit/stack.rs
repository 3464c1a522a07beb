//! The whole embedded system on loopback: the engine emulator, the scripted model provider and
//! the `orders` MCP tool server (which accepts exactly the credentials the emulator issued for
//! it), plus in-process workers running the real runner and agent runtime over real HTTP.
//! The demo, the integration tests and the benchmarks all start it the same way.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::{self, Authorizer, EmulatorOptions, EngineEmulator, ProtocolLevel};
use super::model::{Script, ScriptedModel, Turn};
use super::tools::{CredentialValidator, ToolServer, ToolServerOptions};
use crate::agent::{AgentRuntime, AgentSettings};
use crate::backoff::Backoff;
use crate::engine::Engine;
use crate::engine::client::{EngineClientSettings, HttpEngine};
use crate::metrics::Metrics;
use crate::provider::fallback::RetryPolicy;
use crate::provider::{ProviderKind, ProviderRegistry, ProviderSettings};
use crate::runner::{Runner, RunnerEvent, RunnerSettings, WorkerStatus};

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
    http: reqwest::Client,
    /// The providers' per-request timeout (default 10 s); fault tests shorten it.
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
    join: tokio::task::JoinHandle<()>,
}

impl WorkerHandle {
    /// Staged shutdown, waiting for the drain to end.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
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
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .build()
            .expect("a plain loopback HTTP client always builds");
        Ok(Stack {
            engine,
            model,
            tools,
            http,
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

    /// Providers `openai` and `anthropic`, both served by the scripted model.
    pub fn providers(&self) -> ProviderRegistry {
        let request_timeout = *self
            .provider_request_timeout
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let setting = |name: &str, kind: ProviderKind, base_url: String| ProviderSettings {
            name: name.into(),
            kind,
            base_url,
            api_key: None,
            max_concurrency: None,
            request_timeout,
        };
        ProviderRegistry::new(
            vec![
                setting("openai", ProviderKind::OpenAi, self.model.base_url_openai()),
                setting(
                    "anthropic",
                    ProviderKind::Anthropic,
                    self.model.base_url_anthropic(),
                ),
            ],
            self.http.clone(),
        )
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

    /// Starts a worker with the real runner and agent runtime against the emulator.
    pub fn spawn_worker(&self, opts: WorkerOptions, agent: AgentSettings) -> WorkerHandle {
        self.spawn_worker_with(opts, agent, |engine| engine)
    }

    /// [`Stack::spawn_worker`] with the worker's engine client wrapped by `wrap` (e.g. a
    /// [`super::freeze::FreezeEngine`]).
    pub fn spawn_worker_with(
        &self,
        opts: WorkerOptions,
        agent: AgentSettings,
        wrap: impl FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine>,
    ) -> WorkerHandle {
        let metrics = Arc::new(Metrics::new());
        let mut engine_settings =
            EngineClientSettings::new(self.engine.base_url(), opts.worker_id.clone());
        engine_settings.request_timeout = Duration::from_secs(5);
        engine_settings.command_backoff =
            Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        engine_settings.outage_patience = opts.lock_duration;
        let engine: Arc<dyn Engine> = Arc::new(HttpEngine::new(
            self.http.clone(),
            engine_settings,
            None,
            metrics.clone(),
        ));
        let engine = wrap(engine);
        let runtime = AgentRuntime::new(
            self.providers(),
            None,
            self.http.clone(),
            agent,
            metrics.clone(),
        );
        let mut settings = RunnerSettings::new(opts.worker_id.clone(), opts.lock_duration);
        settings.max_tasks = opts.slots;
        settings.poll_interval = opts.poll_interval;
        settings.shutdown_grace = opts.shutdown_grace;
        settings.error_backoff =
            Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
        let (tx, events) = mpsc::unbounded_channel();
        let runner =
            Runner::new(engine, Arc::new(runtime), settings, metrics.clone()).with_events(tx);
        let status = runner.status();
        let shutdown = CancellationToken::new();
        let join = tokio::spawn(runner.run(shutdown.clone()));
        WorkerHandle {
            worker_id: opts.worker_id,
            shutdown,
            events,
            metrics,
            status,
            join,
        }
    }

    pub async fn shutdown(&self) {
        self.tools.shutdown().await;
        self.model.shutdown().await;
        self.engine.shutdown().await;
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
