//! The whole embedded system on loopback: the engine emulator, the scripted model provider and
//! the `orders` MCP tool server (which accepts exactly the credentials the emulator issued for
//! it). The demo, the integration tests and the benchmarks all start it the same way; the
//! worker's devkit side starts in-process workers against it
//! (`abada_agent_worker::devkit::stack::StackWorkers`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::engine::{self, Authorizer, EmulatorOptions, EngineEmulator, ProtocolLevel};
use super::model::{Script, ScriptedModel, Turn};
use super::tools::{CredentialValidator, ToolServer, ToolServerOptions};

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

/// The approval example's refund (`demo --scenario approval`, and `agent_peers`' model
/// `refund-approval`): the input is JSON with `orderId` and `amountCents`. Look the order up, ask
/// for the refund of that amount saying why (an approval request's `summary`), then answer the
/// customer with what the last tool said: the refund, or who refused it and why.
pub fn refund_amount_script() -> Script {
    Script::new(vec![
        Turn::call("lookup_order", json!({"orderId": "${input.orderId}"})),
        Turn::say_and_call(
            "Order ${input.orderId} arrived damaged: I will refund ${input.amountCents} cents to the customer.",
            "issue_refund",
            json!({"orderId": "${input.orderId}", "amountCents": "${input.amountCents}", "reason": "damaged"}),
        ),
        Turn::text("Dear customer, about your order ${input.orderId}: ${last_tool_result}"),
    ])
    .with_usage(120, 30)
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
