//! Interop: McpSessions (rmcp client) against MCP servers nobody here wrote: the official
//! reference server `@modelcontextprotocol/server-everything` (Node) and a server built with the
//! Python `mcp` SDK (tests/interop/python_server.py).
//!
//! The peers are installed by `scripts/install-interop-peers` into `target/interop/`. When they
//! are missing these tests fail and say so, unless `ABADA_SKIP_INTEROP=1`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::secret::Secret;
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, McpSessions, ToolServerRef, ToolSessionOptions,
};
use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::support::peers::installed;
use crate::support::wait::announcement;
use crate::tools::args;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// `<server>-credential` for every server.
struct NamedCredentials;

#[async_trait]
impl CredentialSource for NamedCredentials {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        Ok(Some(Secret::new(format!("{server}-credential"))))
    }
}

pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Starts a peer that binds port 0 and announces the port it got on stdout as
/// `{"event":"listening","port":N}` (the Python server itself, the Node server through
/// tests/interop/force-loopback.js); returns it with that port.
pub(crate) async fn spawn_announcing(command: &mut Command, what: &str) -> (Child, u16) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let port = announcement(
        child.stdout.take().unwrap(),
        Duration::from_secs(30),
        what,
        |line| {
            let event: Value = serde_json::from_str(line).ok()?;
            if event["event"] != "listening" {
                return None;
            }
            u16::try_from(event["port"].as_u64()?).ok()
        },
    )
    .await;
    (child, port)
}

fn sessions(name: &str, port: u16) -> McpSessions {
    McpSessions::new(
        reqwest::Client::new(),
        vec![ToolServerRef {
            name: name.into(),
            url: format!("http://127.0.0.1:{port}/mcp"),
        }],
        Arc::new(NamedCredentials),
        Some(TRACEPARENT.into()),
        ToolSessionOptions {
            open_timeout: Duration::from_secs(20),
            call_timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
}

#[tokio::test]
async fn reference_server_everything() {
    let Some(bin) = installed(
        "node/node_modules/.bin/mcp-server-everything",
        "scripts/install-interop-peers",
    ) else {
        return;
    };
    let preload: &Path = &repo().join("tests/interop/force-loopback.js");
    let (mut child, port) = spawn_announcing(
        Command::new("node")
            .arg("-r")
            .arg(preload)
            .arg(&bin)
            .arg("streamableHttp")
            .env("PORT", "0"),
        "mcp-server-everything",
    )
    .await;

    let mut sessions = sessions("everything", port);
    let tools = sessions.tools().await.unwrap();
    let read_only = |name: &str| {
        tools
            .iter()
            .find(|t| t.tool == name)
            .unwrap_or_else(|| panic!("no tool {name} in {tools:?}"))
            .read_only
    };
    assert!(read_only("echo"));
    assert!(read_only("get-sum"));
    assert!(!read_only("toggle-simulated-logging"));
    assert!(tools.iter().all(|t| t.server == "everything"));

    let echo = sessions
        .call("everything", "echo", args(json!({"message": "hi"})), None)
        .await
        .unwrap();
    assert!(!echo.is_error, "isError absent means false: {echo:?}");
    assert_eq!(echo.to_model_text(), "Echo: hi");

    let sum = sessions
        .call(
            "everything",
            "get-sum",
            args(json!({"a": 2, "b": 3})),
            Some("abada:t-1:2"),
        )
        .await
        .unwrap();
    assert!(sum.to_model_text().contains("is 5"), "{sum:?}");
    sessions.close().await;
    child.kill().await.unwrap();
}

#[tokio::test]
async fn python_sdk_server_receives_key_traceparent_and_credential() {
    let Some(python) = installed("venv/bin/python", "scripts/install-interop-peers") else {
        return;
    };
    let (mut child, port) = spawn_announcing(
        Command::new(python).arg(repo().join("tests/interop/python_server.py")),
        "python_server.py",
    )
    .await;

    let mut sessions = sessions("pyorders", port);
    let tools = sessions.tools().await.unwrap();
    let spec = |name: &str| tools.iter().find(|t| t.tool == name).unwrap().clone();
    assert!(spec("shout").read_only);
    assert!(!spec("record_key").read_only);
    assert_eq!(
        spec("record_key").input_schema["properties"]["note"]["type"],
        "string"
    );

    let shout = sessions
        .call("pyorders", "shout", args(json!({"text": "hey"})), None)
        .await
        .unwrap();
    assert!(shout.to_model_text().contains("HEY"), "{shout:?}");

    let result = sessions
        .call(
            "pyorders",
            "record_key",
            args(json!({"note": "refund"})),
            Some("abada:c0a8-task:4"),
        )
        .await
        .unwrap();
    assert!(!result.is_error, "{result:?}");
    let seen = match &result.structured_content {
        Some(Value::Object(map)) if map.contains_key("idempotencyKey") => {
            Value::Object(map.clone())
        }
        Some(Value::Object(map)) if map.contains_key("result") => map["result"].clone(),
        _ => serde_json::from_str(&result.to_model_text()).unwrap(),
    };
    assert_eq!(seen["idempotencyKey"], "abada:c0a8-task:4", "{result:?}");
    assert_eq!(seen["traceparent"], TRACEPARENT);
    assert_eq!(seen["authorization"], "Bearer pyorders-credential");
    assert_eq!(seen["note"], "refund");
    sessions.close().await;
    child.kill().await.unwrap();
}
