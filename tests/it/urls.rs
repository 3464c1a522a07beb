//! URLs are never printed: the attacks of the URL findings, through the real binary over
//! loopback, with every log line (at trace level), every exported span (an OTLP sink on
//! 127.0.0.1) and what the engine recorded searched for the parts of a URL that carry
//! secrets: user information, a path, a query.
//!
//! - A registry URL with `user:password@` or `?api_key=` stops the start naming the server and
//!   the field, repeating none of the URL (`ABADA_AGENT_TOOLS_FILE`).
//! - A tool server is named by its registry name in every report, line and span: a registry
//!   server that is down (its path a key), a definition naming it at another URL, servers the
//!   registry does not list at URLs with user information and a query (allowed by
//!   `ABADA_AGENT_TOOLS_UNREGISTERED=allow`) that are down or refuse the credential. rmcp's own
//!   error lines, which print such a URL whole, are not written.
//! - An engine URL with a query or user information stops the start without repeating them.
//!
//! The OIDC token endpoint's case is `oidc::a_failed_token_request_never_shows_the_token_endpoints_secrets`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::Stack;
use abada_agent_worker::devkit::tools::{CredentialValidator, ToolServer, ToolServerOptions};
use axum::body::Bytes;
use serde_json::json;

use crate::agent::{spec, wait_all_ended};
use crate::support::net::refusing_address;
use crate::support::process::{WorkerProcess, stack_env};
use crate::support::scratch::ScratchDir;

/// A tool server that refuses every credential (401).
struct RefuseAll;

impl CredentialValidator for RefuseAll {
    fn validate(&self, _server: &str, _token: &str) -> bool {
        false
    }
}

/// An OTLP/HTTP receiver on 127.0.0.1 that keeps every export's body (protobuf, in which
/// strings travel as they are) and answers with an empty `ExportTraceServiceResponse`.
async fn otlp_sink() -> (String, Arc<Mutex<Vec<Bytes>>>) {
    use axum::routing::post;
    let bodies: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let kept = bodies.clone();
    let router = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| async move {
            kept.lock().unwrap().push(body);
            ([("content-type", "application/x-protobuf")], Bytes::new())
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (endpoint, bodies)
}

/// Everything an exited worker wrote, once its pipes are read to the end (the readers may lag
/// behind the exit): at the latest when a line holds `expected`, or after a hang guard.
async fn output_of(worker: &WorkerProcess, expected: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let output = [worker.stdout(), worker.stderr()].concat().join("\n");
        if output.contains(expected) || tokio::time::Instant::now() > deadline {
            return output;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each marker must appear nowhere in `haystack` (named `what`).
fn assert_absent(markers: &[&str], what: &str, haystack: &str) {
    for marker in markers {
        if let Some(at) = haystack.find(marker) {
            let from = haystack[..at]
                .char_indices()
                .rev()
                .nth(200)
                .map_or(0, |(i, _)| i);
            let to = (at + 200).min(haystack.len());
            let to = (to..=haystack.len())
                .find(|i| haystack.is_char_boundary(*i))
                .unwrap_or(haystack.len());
            panic!("{marker} in {what}: …{}…", &haystack[from..to]);
        }
    }
}

/// A registry whose server URL holds a password or a key stops the start: the error names the
/// file, the server and the field, and repeats none of the URL. Before, the registry loaded, and
/// the URL reached the engine and the logs whole at the first failure.
#[tokio::test]
async fn a_registry_url_with_a_password_or_a_key_stops_the_start_repeating_none_of_it() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = ScratchDir::new("urls");
    for url in [
        "http://svc-user:PASSMARK@127.0.0.1:1/mcp",
        "http://127.0.0.1:1/mcp/PATHOK?api_key=KEYMARK",
        "https://svc-user:PASSMARK@orders.example/mcp?api_key=KEYMARK",
    ] {
        let tools = dir.write(
            "tools.toml",
            &format!("[servers.orders]\nurl = \"{url}\"\nauth = \"none\"\n"),
        );
        let mut env = stack_env(&stack, "w-bad-registry");
        env.push(("ABADA_AGENT_TOOLS_FILE".into(), tools.display().to_string()));
        let mut worker = WorkerProcess::spawn_raw(&[], &env);
        let exit = worker.wait(Duration::from_secs(20)).await;
        assert!(!exit.success(), "{url}: the worker started");
        let output = output_of(&worker, "field url").await;
        assert!(
            output.contains("server \"orders\", field url"),
            "{url}: {output}"
        );
        assert_absent(
            &[
                "PASSMARK",
                "KEYMARK",
                "PATHOK",
                "svc-user",
                "127.0.0.1:1",
                "orders.example",
            ],
            "the start-up error",
            &output,
        );
    }
    stack.shutdown().await;
}

/// Tool servers down, at another URL, and refusing, through the emulator on an agent/1 engine:
/// every failure reaches the engine naming the server, and no log line (at trace, rmcp's
/// included), span or report holds any part of a URL that can carry a secret.
#[tokio::test]
async fn a_tool_servers_url_is_in_no_report_line_or_span_whatever_fails() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = ScratchDir::new("urls");
    let (_held_registry, registry_down) = refusing_address();
    let (_held_other, other_down) = refusing_address();
    let refuser = ToolServer::start(ToolServerOptions::new("refuser", Arc::new(RefuseAll)))
        .await
        .unwrap();
    // The registry's server: down, a key in its path (a path may be a secret too).
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.orders]\nurl = \"http://{registry_down}/mcp/REGPATHMARK\"\nauth = \"none\"\n"
        ),
    );
    let definition_url = |addr: &str, n: u32| {
        format!("http://svc-user{n}:DEFPASSMARK{n}@{addr}/mcp/DEFPATHMARK{n}?api_key=DEFKEYMARK{n}")
    };
    let with_servers = |servers: serde_json::Value| {
        let mut agent = stack.refund_agent("openai/refund", &[]);
        agent["toolServers"] = servers;
        let mut s = spec(agent, "o-1");
        // One technical failure is the end: an incident with the error the engine keeps.
        s.retries = Some(1);
        s
    };
    let ids = stack.engine.create_tasks([
        // Down: rmcp fails to connect, three times (the worker's tries).
        with_servers(json!(["orders"])),
        // The registry's server named at another URL: refused before anything is sent.
        with_servers(
            json!([{"name": "orders", "url": definition_url(&other_down.to_string(), 1)}]),
        ),
        // A server the registry does not list, down.
        with_servers(
            json!([{"name": "payments", "url": definition_url(&other_down.to_string(), 2)}]),
        ),
        // A server the registry does not list, refusing the credential.
        with_servers(
            json!([{"name": "refuser", "url": definition_url(&refuser.addr().to_string(), 3)}]),
        ),
    ]);
    let (otlp, exported) = otlp_sink().await;
    let mut env = stack_env(&stack, "w-urls");
    for (k, v) in [
        ("ABADA_AGENT_TOOLS_FILE", tools.display().to_string()),
        ("ABADA_AGENT_TOOLS_UNREGISTERED", "allow".to_string()),
        ("RUST_LOG", "trace".to_string()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    let mut worker = WorkerProcess::spawn(&env).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(90)).await;
    let (_, metrics) = worker.admin_get("/metrics").await;
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(30)).await;
    assert!(exit.success(), "{exit}");

    // Each failed, naming its server.
    for (view, server) in views
        .iter()
        .zip(["orders", "orders", "payments", "refuser"])
    {
        assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
        let message = view.error_message.clone().unwrap_or_default();
        assert!(
            message.contains(&format!("tool server {server}"))
                || message.contains(&format!("tool server \"{server}\"")),
            "{server}: {message}"
        );
    }
    assert!(
        refuser.counters().await.unauthorized >= 1,
        "the refusing server was reached"
    );
    let output = [worker.stdout(), worker.stderr()].concat();
    assert!(
        output.iter().any(|l| l.contains("\"level\":\"TRACE\"")),
        "the worker logged at trace level"
    );
    let spans: Vec<u8> = exported.lock().unwrap().iter().flatten().copied().collect();
    let spans = String::from_utf8_lossy(&spans);
    assert!(spans.contains("invoke_agent"), "spans were exported");
    let recorded = serde_json::to_string(&stack.engine.tasks()).unwrap();
    let mut markers = vec!["REGPATHMARK".to_string()];
    for n in 1..=3 {
        for part in ["svc-user", "DEFPASSMARK", "DEFPATHMARK", "DEFKEYMARK"] {
            markers.push(format!("{part}{n}"));
        }
    }
    let markers: Vec<&str> = markers.iter().map(String::as_str).collect();
    // What the engine keeps of each task, the agent definitions it was sent aside.
    for view in &views {
        let reported = format!("{:?} {:?}", view.error_message, view.error_details);
        assert_absent(&markers, "the report to the engine", &reported);
    }
    assert!(
        recorded.contains("DEFKEYMARK1"),
        "the emulator holds the definitions"
    );
    assert_absent(&markers, "the log lines", &output.join("\n"));
    assert_absent(&markers, "the exported spans", &spans);
    assert_absent(&markers, "the metrics", &metrics);
    refuser.shutdown().await;
    stack.shutdown().await;
}

/// The engine URL is checked at start-up; a query or user information in it stops the start,
/// and the message shows the URL without them. Before, a query was echoed whole (a value
/// without `@` was repeated as it was).
#[tokio::test]
async fn an_engine_url_with_a_query_or_a_password_stops_the_start_repeating_neither() {
    for url in [
        "http://127.0.0.1:1/api?token=KEYMARK",
        "http://svc-user:PASSMARK@127.0.0.1:1/api",
        "http://127.0.0.1:1/api#FRAGMARK",
    ] {
        let env = vec![
            ("ABADA_AGENT_ENGINE_URL".to_string(), url.to_string()),
            (
                "ABADA_AGENT_WORKER_ID".to_string(),
                "w-bad-engine".to_string(),
            ),
        ];
        let mut worker = WorkerProcess::spawn_raw(&[], &env);
        let exit = worker.wait(Duration::from_secs(20)).await;
        assert!(!exit.success(), "{url}: the worker started");
        let output = output_of(&worker, "ABADA_AGENT_ENGINE_URL").await;
        assert!(output.contains("ABADA_AGENT_ENGINE_URL"), "{url}: {output}");
        assert!(output.contains("127.0.0.1:1/api"), "{url}: {output}");
        assert_absent(
            &["KEYMARK", "PASSMARK", "FRAGMARK", "svc-user"],
            "the start-up error",
            &output,
        );
    }
}
