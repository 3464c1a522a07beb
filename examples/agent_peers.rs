//! The refund agent's peers, standalone on loopback, for running a release worker against an
//! engine that is not the emulator (docs/REAL_ENGINE.md): the devkit's scripted model (OpenAI and
//! Anthropic wire formats) and two MCP tool servers with the keyed-write ledger, `orders` and
//! `billing` (the same tools; a second server for a redeployed version of a process to move its
//! agent to), each accepting exactly one bearer token, read from a file. A read-only `/stats`
//! endpoint reports what they received, so a run can be checked from outside: calls per model,
//! with each request's instructions and the tools it offered; per tool server, writes applied,
//! duplicates, and whether every tool call carried the expected token (the token itself is never
//! printed).
//!
//! `cargo run --release --example agent_peers -- --token-file /tmp/orders-token [--slow-ms 6000]`
//!
//! It prints one JSON line with its URLs, then serves until Ctrl-C or SIGTERM. Models (the name
//! after `openai/` or `anthropic/` in an agent definition):
//! - `refund`: look the order up, issue a keyed refund, answer with a JSON object;
//! - `refund-slow`: the same, each answer after `--slow-ms` (default 6000), to kill a worker
//!   between the refund and the final answer;
//! - `refund-approval`: the approval example's refund (`demo --scenario approval`): the input is
//!   JSON with `orderId` and `amountCents`; look the order up, refund that amount with a word of
//!   why, then tell the customer what the last tool said (the refund, or who refused it);
//! - `refund-repair`: the `refund` script whose first final answer is prose, off any JSON schema
//!   ("Refunded order o-1."), and whose next answer (the worker's repair turn, when the agent has
//!   an `outputSchema`) is the JSON object;
//! - `null-answer`: a final answer that is the JSON `null`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::devkit::model::{Script, ScriptedModel, Turn};
use abada_agent_worker::devkit::stack::{ORDERS_SERVER, refund_amount_script, refund_script};
use abada_agent_worker::devkit::tools::{StaticTokens, ToolServer, ToolServerOptions};
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};

const MODELS: [&str; 5] = [
    "refund",
    "refund-slow",
    "refund-approval",
    "refund-repair",
    "null-answer",
];

struct Args {
    token_file: PathBuf,
    slow: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut token_file = None;
    let mut slow = Duration::from_millis(6000);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--token-file" => token_file = it.next().map(PathBuf::from),
            "--slow-ms" => {
                let value = it.next().unwrap_or_default();
                let ms: u64 = value
                    .parse()
                    .map_err(|_| format!("--slow-ms wants milliseconds, got {value:?}"))?;
                slow = Duration::from_millis(ms);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let token_file = token_file.ok_or("--token-file FILE is required (the orders token)")?;
    Ok(Args { token_file, slow })
}

/// The name of the second tool server.
const BILLING_SERVER: &str = "billing";

#[derive(Clone)]
struct Peers {
    model: ScriptedModel,
    orders: ToolServer,
    billing: ToolServer,
    token: Arc<str>,
}

/// What one tool server received.
async fn server_stats(server: &ToolServer, token: &str) -> Value {
    let c = server.counters().await;
    let calls: Vec<Value> = server
        .calls()
        .into_iter()
        .map(|call| {
            json!({
                "tool": call.tool,
                "arguments": call.arguments,
                "idempotencyKey": call.idempotency_key,
                "traceparent": call.traceparent,
                "expectedToken": call.token.as_deref() == Some(token),
            })
        })
        .collect();
    json!({
        "writesApplied": c.writes_applied,
        "writesUnkeyed": c.writes_unkeyed,
        "duplicates": c.duplicates,
        "duplicatesPerKey": c.duplicates_per_key,
        "callsPerTool": c.calls_per_tool,
        "sessionsOpened": c.sessions_opened,
        "sessionsClosed": c.sessions_closed,
        "sessionsOpen": c.sessions_open,
        "unauthorized": c.unauthorized,
        "calls": calls,
    })
}

async fn stats(State(peers): State<Peers>) -> axum::Json<Value> {
    let per_model: serde_json::Map<String, Value> = MODELS
        .iter()
        .map(|m| (m.to_string(), json!(peers.model.calls(m))))
        .collect();
    // What each model request carried that tells which definition sent it: its instructions
    // (OpenAI's `system` messages, Anthropic's `system`) and the names of the tools offered.
    let requests: Vec<Value> = peers
        .model
        .requests()
        .into_iter()
        .map(|r| {
            let system: Vec<Value> = match r.body.get("system") {
                Some(system) => vec![system.clone()],
                None => r.body["messages"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|m| m["role"] == "system" || m["role"] == "developer")
                    .map(|m| m["content"].clone())
                    .collect(),
            };
            let tools: Vec<Value> = r.body["tools"]
                .as_array()
                .into_iter()
                .flatten()
                // OpenAI nests the name under `function`; Anthropic does not.
                .map(|t| t.get("function").unwrap_or(t)["name"].clone())
                .collect();
            json!({"model": r.model, "system": system, "tools": tools})
        })
        .collect();
    axum::Json(json!({
        "model": {"calls": per_model, "total": peers.model.total_calls(), "requests": requests},
        "orders": server_stats(&peers.orders, &peers.token).await,
        "billing": server_stats(&peers.billing, &peers.token).await,
    }))
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("agent_peers: {e}");
            return ExitCode::from(2);
        }
    };
    let token = match std::fs::read_to_string(&args.token_file) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        Ok(_) => {
            eprintln!("agent_peers: {} is empty", args.token_file.display());
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!(
                "agent_peers: cannot read {}: {e}",
                args.token_file.display()
            );
            return ExitCode::from(2);
        }
    };
    let model = match ScriptedModel::start().await {
        Ok(m) => m,
        Err(e) => {
            eprintln!("agent_peers: the scripted model cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    model.set_script("refund", refund_script());
    model.set_script("refund-slow", refund_script().with_latency(args.slow));
    model.set_script("refund-approval", refund_amount_script());
    model.set_script("refund-repair", refund_repair_script());
    model.set_script("null-answer", Script::new(vec![Turn::text("null")]));
    let mut servers = Vec::new();
    for name in [ORDERS_SERVER, BILLING_SERVER] {
        match ToolServer::start(ToolServerOptions::new(
            name,
            Arc::new(StaticTokens::new([token.clone()])),
        ))
        .await
        {
            Ok(t) => servers.push(t),
            Err(e) => {
                eprintln!("agent_peers: the tool server {name} cannot start: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let (Some(billing), Some(orders)) = (servers.pop(), servers.pop()) else {
        return ExitCode::FAILURE;
    };
    let listener = match tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await
    {
        Ok(l) => l,
        Err(e) => {
            eprintln!("agent_peers: the stats endpoint cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stats_addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let peers = Peers {
        model: model.clone(),
        orders: orders.clone(),
        billing: billing.clone(),
        token: token.into(),
    };
    println!(
        "{}",
        json!({
            "openaiBaseUrl": model.base_url_openai(),
            "anthropicBaseUrl": model.base_url_anthropic(),
            "ordersUrl": orders.url(),
            "billingUrl": billing.url(),
            "statsUrl": format!("http://{stats_addr}/stats"),
            "models": MODELS,
        })
    );
    let app = axum::Router::new()
        .route("/stats", get(stats))
        .with_state(peers);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    orders.shutdown().await;
    billing.shutdown().await;
    model.shutdown().await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent_peers: the stats endpoint stopped: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `refund` with an off-schema first final answer: prose where the schema wants an object, then
/// the object on the repair turn.
fn refund_repair_script() -> Script {
    Script::new(vec![
        Turn::call("lookup_order", json!({"orderId": "${input}"})),
        Turn::call(
            "issue_refund",
            json!({"orderId": "${input}", "amountCents": 1500, "reason": "damaged"}),
        ),
        Turn::text("Refunded order ${input}."),
        Turn::text(
            r#"{"decision": "refunded", "orderId": "${input}", "refund": ${last_tool_result}}"#,
        ),
    ])
    .with_usage(120, 30)
}
