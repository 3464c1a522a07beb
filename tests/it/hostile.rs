//! Hostile peers: a tool server, a model and an engine that send what no well-behaved
//! peer sends (endless list pages, 10 MB results, an SSE event past the cap, giant error
//! messages, bodies dripped a byte at a time, a 48 MiB answer, tens of MiB of variables, journals
//! of 100,000 steps). Each scenario runs four tasks through the
//! real binary with four slots over loopback HTTP, expects a bounded, named outcome, runs the
//! invariant checker, and prints the process's peak resident memory (VmHWM).
//!
//! With `ABADA_AGENT_WORKER_BIN=target/release/abada-agent-worker` the release binary runs and
//! the memory bound is the issue's 64 MB; the debug binary is held to the suite's 256 MiB.
//! The figures are in `docs/FAULTS.md`.

use std::convert::Infallible;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::Stack;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::support::invariants::{Expect, WorkerObservation, check_invariants, peak_memory_kib};
use crate::support::process::{WorkerProcess, stack_env};

/// A hang guard for each wait (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(60);

/// The peak memory allowed: the issue's 64 MB for the release binary, the fault suite's
/// 256 MiB for the debug one.
fn memory_bound_kib() -> u64 {
    if std::env::var_os("ABADA_AGENT_WORKER_BIN").is_some() {
        64_000
    } else {
        256 * 1024
    }
}

/// How the hostile tool server misbehaves.
#[derive(Clone, Copy, Debug)]
enum Mcp {
    /// `tools/list` always has a next page.
    EndlessPages,
    /// `tools/call` answers 10 MB of text.
    HugeResult,
    /// `tools/call` answers a JSON-RPC error whose message is 900 KB.
    GiantError,
    /// Every answer is sent one byte at a time.
    Drip,
    /// `initialize` answers with 1 MB of `instructions` (rmcp logs them at INFO).
    LoudInstructions,
}

/// A minimal MCP server (2025-11-25, JSON answers) misbehaving as `mode` says, on 127.0.0.1.
async fn hostile_mcp(mode: Mcp) -> String {
    let app = axum::Router::new()
        .route(
            "/mcp",
            axum::routing::post(mcp).delete(|| async { StatusCode::OK }),
        )
        .with_state(mode);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/mcp")
}

async fn mcp(State(mode): State<Mcp>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let method = request["method"].as_str().unwrap_or_default();
    let Some(id) = request.get("id").cloned() else {
        return StatusCode::ACCEPTED.into_response();
    };
    let lookup = json!({"name": "lookup", "description": "Looks an order up.",
        "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true}});
    let answer = match (method, mode) {
        ("server/discover", _) => return (StatusCode::BAD_REQUEST, "unsupported").into_response(),
        ("initialize", Mcp::LoudInstructions) => json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
            "serverInfo": {"name": "hostile", "version": "1"},
            "instructions": "i".repeat(1_000_000)}}),
        ("initialize", _) => json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
            "serverInfo": {"name": "hostile", "version": "1"}}}),
        ("tools/list", Mcp::EndlessPages) => {
            let page: u64 = request["params"]["cursor"]
                .as_str()
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            json!({"jsonrpc": "2.0", "id": id, "result": {
                "tools": [{"name": format!("t{page}"), "inputSchema": {"type": "object"}}],
                "nextCursor": (page + 1).to_string()}})
        }
        ("tools/list", _) => json!({"jsonrpc": "2.0", "id": id, "result": {"tools": [lookup]}}),
        ("tools/call", Mcp::HugeResult) => {
            // Built from shared chunks, not serialized per call: the test process's two
            // threads also run the engine emulator, whose heartbeats must not starve.
            static TEXT: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
            let text = TEXT
                .get_or_init(|| Bytes::from(vec![b'r'; 10_000_000]))
                .clone();
            let head = format!(
                r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":""#
            );
            let parts = [Bytes::from(head), text, Bytes::from_static(br#""}]}}"#)];
            let stream = futures::stream::iter(parts.map(Ok::<_, Infallible>));
            return (
                [(header::CONTENT_TYPE, "application/json")],
                Body::from_stream(stream),
            )
                .into_response();
        }
        ("tools/call", Mcp::GiantError) => json!({"jsonrpc": "2.0", "id": id,
            "error": {"code": -32000, "message": "e".repeat(900_000)}}),
        ("tools/call", _) => json!({"jsonrpc": "2.0", "id": id, "result": {
            "content": [{"type": "text", "text": "{\"status\": \"shipped\"}"}]}}),
        _ => json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "no"}}),
    };
    let bytes = serde_json::to_vec(&answer).unwrap();
    let body = match mode {
        Mcp::Drip => Body::from_stream(futures::stream::unfold(0usize, move |i| {
            let bytes = bytes.clone();
            async move {
                if i >= bytes.len() {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                Some((
                    Ok::<_, Infallible>(Bytes::copy_from_slice(&bytes[i..i + 1])),
                    i + 1,
                ))
            }
        })),
        _ => Body::from(bytes),
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A Chat Completions server whose every answer is `mib` MiB of content, streamed in 1 MiB
/// chunks without a length.
async fn hostile_model(mib: usize) -> String {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || async move {
            let head = Bytes::from_static(
                br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":""#,
            );
            let chunk = Bytes::from(vec![b'a'; 1024 * 1024]);
            let tail = Bytes::from_static(br#""}}]}"#);
            let parts = std::iter::once(head)
                .chain(std::iter::repeat_n(chunk, mib))
                .chain(std::iter::once(tail))
                .map(Ok::<_, Infallible>);
            (
                [(header::CONTENT_TYPE, "application/json")],
                Body::from_stream(futures::stream::iter(parts)),
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/v1")
}

/// One tool call then a JSON answer.
fn lookup_script() -> Script {
    Script::new(vec![
        Turn::call("lookup", json!({"orderId": "${input}"})),
        Turn::text(r#"{"decision": "done"}"#),
    ])
    .with_usage(100, 20)
}

fn agent(model: &str, tool_url: &str) -> Value {
    agent_on(model, "hostile", tool_url)
}

fn agent_on(model: &str, server: &str, tool_url: &str) -> Value {
    json!({
        "name": "hostile-agent",
        "model": model,
        "instructions": "Look the order up and answer with JSON.",
        "input": "${orderId}",
        "toolServers": [{"name": server, "url": tool_url}],
        "maxTurns": 4,
        "resultVariable": "decision"
    })
}

fn tasks(stack: &Stack, prefix: &str, n: usize, agent: &Value) -> Vec<String> {
    stack.engine.create_tasks((0..n).map(|i| {
        let mut variables = Map::new();
        variables.insert("orderId".into(), json!(format!("{prefix}-{i}")));
        TaskSpec {
            variables,
            agent: Some(agent.clone()),
            retries: Some(3),
            ..TaskSpec::default()
        }
    }))
}

/// Waits until every task has ended (completed, or failed as an incident).
async fn wait_ended(stack: &Stack, ids: &[String], p: &WorkerProcess) -> Vec<TaskView> {
    let ended = tokio::time::timeout(
        LIMIT,
        stack.engine.wait_for(|e| {
            let views: Vec<TaskView> = ids.iter().filter_map(|id| e.task(id)).collect();
            (views.len() == ids.len()
                && views
                    .iter()
                    .all(|t| matches!(t.status, TaskStatus::Completed | TaskStatus::Failed)))
            .then_some(views)
        }),
    )
    .await;
    match ended {
        Ok(views) => views,
        Err(_) => {
            let mut output = p.stdout();
            output.extend(p.stderr());
            let tail = output[output.len().saturating_sub(40)..].join("\n");
            let states: Vec<String> = stack
                .engine
                .tasks()
                .iter()
                .map(|t| {
                    format!(
                        "{} {:?} attempt {} {:?}",
                        t.id, t.status, t.attempt, t.error_message
                    )
                })
                .collect();
            panic!(
                "gave up after {LIMIT:?} waiting for {ids:?} to end: {states:#?}\nworker output:\n{tail}"
            )
        }
    }
}

/// Runs the real binary (four slots) until `ids` ended, stops it, checks the invariants and
/// returns the views and the peak resident memory in KiB.
async fn run_binary(
    stack: &Stack,
    scenario: &str,
    ids: &[String],
    extra: &[(&str, String)],
) -> (Vec<TaskView>, u64) {
    let worker_id = format!("hostile-{scenario}");
    let mut env = stack_env(stack, &worker_id);
    env.push(("ABADA_AGENT_MAX_TASKS".into(), "4".into()));
    // Nothing here waits for a lease to run out, and megabytes of hostile input in a debug
    // build on a loaded machine must not starve a heartbeat.
    env.push(("ABADA_AGENT_LOCK_DURATION_MS".into(), "30000".into()));
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let mut p = WorkerProcess::spawn(&env).await;
    let views = wait_ended(stack, ids, &p).await;
    let peak = peak_memory_kib(p.pid).expect("VmHWM readable on Linux");
    p.signal("TERM");
    let status = p.wait(Duration::from_secs(20)).await;
    assert!(status.success(), "{scenario}: exit {status}");
    let mut output = p.stdout();
    output.extend(p.stderr());
    let observation = WorkerObservation {
        worker_id,
        max_tasks: 4,
        events: Vec::new(),
        slot_samples: Vec::new(),
        output,
        memory: Some((peak, memory_bound_kib())),
    };
    eprintln!(
        "hostile {scenario}: peak resident memory {peak} KiB ({:.1} MB) with {} ({})",
        peak as f64 * 1024.0 / 1e6,
        if std::env::var_os("ABADA_AGENT_WORKER_BIN").is_some() {
            "release binary"
        } else {
            "debug binary"
        },
        crate::support::process::bin()
    );
    let report = check_invariants(
        &stack.engine,
        &[&stack.tools],
        &[observation],
        &Expect::default(),
    )
    .await;
    report.assert_ok(scenario);
    (views, peak)
}

fn incident_message(t: &TaskView) -> String {
    assert_eq!(t.status, TaskStatus::Failed, "{t:?}");
    assert_eq!(t.retries, Some(0), "an incident: {t:?}");
    t.error_message.clone().unwrap_or_default()
}

async fn stack() -> Stack {
    Stack::start(ProtocolLevel::AgentV1)
        .await
        .expect("the devkit stack starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_server_with_endless_list_pages_ends_each_task_as_a_named_incident() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let url = hostile_mcp(Mcp::EndlessPages).await;
    let ids = tasks(&s, "pages", 4, &agent("openai/tooly", &url));
    let (views, _) = run_binary(&s, "endless-pages", &ids, &[]).await;
    for t in &views {
        let m = incident_message(t);
        assert!(m.contains("limit of 16 pages"), "{m}");
    }
    s.shutdown().await;
}

/// A tool server answering `initialize` with 1 MB of `instructions` (a hostile server wrote a
/// 1,000,851-byte log line this way): under the default filter, a bare `RUST_LOG=debug` and
/// even `rmcp=debug` named by the operator, no line the worker writes is longer than a few
/// capped fields; when rmcp is let through, its line says it was cut. (The `pretty` format's
/// cap is held by `telemetry::tests::every_field_of_a_pretty_line_is_capped_and_says_it_was_cut`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_servers_megabyte_of_instructions_never_makes_a_long_log_line() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let url = hostile_mcp(Mcp::LoudInstructions).await;
    for (run, rust_log) in [
        ("default", None),
        ("debug", Some("debug")),
        ("named", Some("info,rmcp=debug")),
    ] {
        let ids = tasks(&s, &format!("loud-{run}"), 1, &agent("openai/tooly", &url));
        let mut env = stack_env(&s, &format!("hostile-loud-{run}"));
        env.retain(|(k, _)| k != "RUST_LOG");
        if let Some(filter) = rust_log {
            env.push(("RUST_LOG".into(), filter.into()));
        }
        let mut p = WorkerProcess::spawn(&env).await;
        let views = wait_ended(&s, &ids, &p).await;
        assert_eq!(views[0].status, TaskStatus::Completed, "{run}: {views:?}");
        p.signal("TERM");
        let status = p.wait(Duration::from_secs(20)).await;
        assert!(status.success(), "{run}: exit {status}");
        let mut output = p.stdout();
        output.extend(p.stderr());
        let longest = output.iter().map(String::len).max().unwrap_or_default();
        eprintln!("{run}: {} lines, the longest {longest} bytes", output.len());
        assert!(
            longest < 64 * 1024,
            "{run}: a log line of {longest} bytes: {}",
            output
                .iter()
                .find(|l| l.len() == longest)
                .map(|l| &l[..300.min(l.len())])
                .unwrap_or_default()
        );
        let instructions_logged = output.iter().any(|l| l.contains("iiiiiiii"));
        if run == "named" {
            assert!(
                output
                    .iter()
                    .any(|l| l.contains("iiiiiiii") && l.contains("…[cut: ")),
                "{run}: rmcp, named, logs the instructions cut"
            );
        } else {
            assert!(!instructions_logged, "{run}: rmcp logged the instructions");
        }
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_tool_results_are_not_read_and_the_model_is_told() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let url = hostile_mcp(Mcp::HugeResult).await;
    let ids = tasks(&s, "huge", 4, &agent("openai/tooly", &url));
    let (views, _) = run_binary(&s, "10mb-results", &ids, &[]).await;
    for t in &views {
        assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
        let told = t.journal.iter().any(|step| {
            step.to_string()
                .contains("larger than 4194304 bytes and was discarded")
        });
        assert!(told, "the model was told the result was discarded: {t:?}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_tool_error_message_is_cut_before_the_model_and_the_journal() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let url = hostile_mcp(Mcp::GiantError).await;
    let ids = tasks(&s, "gianterr", 4, &agent("openai/tooly", &url));
    let (views, _) = run_binary(&s, "giant-errors", &ids, &[]).await;
    for t in &views {
        assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
        let largest = t
            .journal
            .iter()
            .map(|s| s.to_string().len())
            .max()
            .unwrap_or(0);
        assert!(
            largest < 16 * 1024,
            "task {}: a journal step of {largest} bytes",
            t.id
        );
        assert!(
            t.journal
                .iter()
                .any(|s| s.to_string().contains("bytes shown")),
            "the cut is said: {t:?}"
        );
    }
    let requests = s.model.requests();
    let largest = requests
        .iter()
        .map(|r| r.body.to_string().len())
        .max()
        .unwrap_or(0);
    assert!(largest < 32 * 1024, "a model request of {largest} bytes");
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_server_dripping_one_byte_at_a_time_is_waited_for_within_the_call_bound() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let url = hostile_mcp(Mcp::Drip).await;
    let ids = tasks(&s, "drip", 4, &agent("openai/tooly", &url));
    let (views, _) = run_binary(&s, "drip", &ids, &[]).await;
    for t in &views {
        assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_answering_48_mib_ends_each_task_as_a_named_incident() {
    let s = stack().await;
    let model = hostile_model(48).await;
    let ids = tasks(
        &s,
        "bigmodel",
        4,
        &agent_on("openai/giant", s.tools.name(), &s.tools.url()),
    );
    let (views, _) = run_binary(
        &s,
        "48mib-answer",
        &ids,
        &[("ABADA_AGENT_PROVIDER_OPENAI_BASE_URL", model)],
    )
    .await;
    for t in &views {
        let m = incident_message(t);
        assert!(m.contains("the model's answer is too large"), "{m}");
        assert!(m.contains("limit of 2097152 bytes"), "{m}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_sending_tens_of_mib_of_variables_makes_that_task_an_incident() {
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let mut ids = tasks(&s, "small", 3, &s.refund_agent("openai/refund", &[]));
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!("big-0"));
    variables.insert("blob".into(), json!("v".repeat(30 * 1024 * 1024)));
    let big = s.engine.create_task(TaskSpec {
        variables,
        agent: Some(s.refund_agent("openai/refund", &[])),
        retries: Some(3),
        ..TaskSpec::default()
    });
    ids.push(big.clone());
    // The emulator (a debug build sharing the test's two threads) takes seconds to send 30 MiB;
    // the engine timeout and the lease leave it that time.
    let (views, _) = run_binary(
        &s,
        "30mib-variables",
        &ids,
        &[
            ("ABADA_AGENT_ENGINE_TIMEOUT_MS", "60000".into()),
            ("ABADA_AGENT_LOCK_DURATION_MS", "60000".into()),
        ],
    )
    .await;
    for t in &views {
        if t.id == big {
            let m = incident_message(t);
            assert!(m.contains("over the limit of 1048576 bytes"), "{m}");
        } else {
            assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
        }
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_sse_event_is_not_read_or_retried_and_the_model_is_told() {
    // The devkit tool server answers over SSE (rmcp, stateful): a 5 MiB result is one event past
    // the transport's 4 MiB cap. rmcp reports it to its caller only as a closed stream; the
    // worker tells it apart (`tools::transport`) and treats it as the JSON case: not read, not
    // retried, the model is told.
    let s = stack().await;
    s.model.set_script(
        "sse",
        Script::new(vec![
            Turn::call("lookup_order", json!({"orderId": "${input}"})),
            Turn::text(r#"{"decision": "done"}"#),
        ])
        .with_usage(100, 20),
    );
    s.tools.set_oversized_results(Some(5 * 1024 * 1024));
    let ids = tasks(
        &s,
        "sse",
        4,
        &agent_on("openai/sse", s.tools.name(), &s.tools.url()),
    );
    let (views, _) = run_binary(&s, "oversized-sse-event", &ids, &[]).await;
    for t in &views {
        assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
        assert_eq!(t.attempt, 1, "not retried as a failure: {t:?}");
        let told = t.journal.iter().any(|step| {
            step.to_string()
                .contains("larger than 4194304 bytes and was discarded")
        });
        assert!(told, "the model was told the result was discarded: {t:?}");
    }
    let calls = s.tools.counters().await.calls_per_tool;
    assert_eq!(
        calls.get("lookup_order"),
        Some(&4),
        "one call per task, none retried: {calls:?}"
    );
    s.tools.set_oversized_results(None);
    s.shutdown().await;
}

/// A journal of `n` small steps, numbered from 1, as earlier attempts would have left it.
fn journal_of(n: usize, data_bytes: usize) -> Vec<Value> {
    let text = "j".repeat(data_bytes);
    (1..=n)
        .map(|seq| json!({"seq": seq, "kind": "input", "state": "done", "data": {"text": text}}))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answering_journals_of_100k_steps_makes_each_task_a_named_incident() {
    // A journal of 100,000 small steps and one a step past the limit (4,097: the step limit,
    // 4096, comes first in both), and one whose 2,000 steps of 5 KiB are 10 MB (the byte limit,
    // 8 MiB, comes first).
    let s = stack().await;
    s.model.set_script("tooly", lookup_script());
    let ids = tasks(
        &s,
        "journal",
        3,
        &agent_on("openai/tooly", s.tools.name(), &s.tools.url()),
    );
    let seeded = [100_000, 4_097, 2_000];
    for (id, steps) in ids.iter().zip(seeded) {
        let journal = if steps == 2_000 {
            journal_of(steps, 5 * 1024)
        } else {
            journal_of(steps, 0)
        };
        assert!(s.engine.seed_journal(id, journal));
    }
    // The emulator (a debug build on the test's two threads) takes a while to serialize
    // 100,000 steps; the engine timeout and the lease leave it that time.
    let (views, _) = run_binary(
        &s,
        "100k-step-journals",
        &ids,
        &[
            ("ABADA_AGENT_ENGINE_TIMEOUT_MS", "60000".into()),
            ("ABADA_AGENT_LOCK_DURATION_MS", "60000".into()),
        ],
    )
    .await;
    for (t, seeded) in views.iter().zip(seeded) {
        let m = incident_message(t);
        assert!(m.contains("the task's journal is too large"), "{m}");
        if seeded == 2_000 {
            assert!(m.contains("limit of 8388608 bytes"), "{m}");
        } else {
            assert!(m.contains("limit of 4096 steps"), "{m}");
        }
        assert_eq!(
            t.journal.len(),
            seeded,
            "the journal is left as it was, nothing appended on top"
        );
    }
    assert!(
        s.model.requests().is_empty(),
        "no model call for a task whose journal was not read"
    );
    s.shutdown().await;
}
