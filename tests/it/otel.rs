//! Spans against a real OpenTelemetry Collector: the collector built by
//! `scripts/build-otelcol` (OTLP/HTTP receiver, file exporter) runs on 127.0.0.1, the real
//! worker binary exports to it while it runs refund agents on the devkit stack, and the test
//! reads the collector's own output file back.
//!
//! The collector binds port 0 itself (tests/otelcol/config.yaml) and logs the address it got;
//! the test reads it from that line, so no port is ever freed and handed out.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::Stack;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::agent::{spec, wait_all_ended};
use crate::support::peers;
use crate::support::process::{WorkerProcess, stack_env};

/// The collector as a child process; killed when dropped.
struct Collector {
    child: Child,
    pid: u32,
    endpoint: String,
    spans_file: PathBuf,
    _dir: TempDir,
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Collector {
    /// Starts the collector and waits until it is ready; `None` when it is not built and
    /// `ABADA_SKIP_INTEROP=1`.
    async fn start() -> Option<Collector> {
        let bin = peers::installed("otelcol/otelcol-abada", "scripts/build-otelcol")?;
        let dir = std::env::temp_dir().join(format!("abada-otelcol-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let spans_file = dir.join("spans.jsonl");
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/otelcol/config.yaml");
        let mut child = Command::new(bin)
            .arg(format!("--config=file:{}", config.display()))
            .env_clear()
            .env("SPANS_FILE", &spans_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the collector starts");
        let pid = child.id().unwrap();
        let log = Arc::new(Mutex::new(Vec::<String>::new()));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let endpoint = loop {
            {
                let lines = log.lock().unwrap();
                let bound = lines
                    .iter()
                    .find(|l| l.contains("Starting HTTP server"))
                    .and_then(|l| l.split("\"endpoint\": \"").nth(1))
                    .and_then(|rest| rest.split('"').next())
                    .map(str::to_string);
                if let Some(addr) = bound
                    && lines.iter().any(|l| l.contains("Everything is ready"))
                {
                    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
                    break format!("http://{addr}");
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the collector did not get ready:\n{}",
                log.lock().unwrap().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Some(Collector {
            child,
            pid,
            endpoint,
            spans_file,
            _dir: TempDir(dir),
        })
    }

    /// Every span in the lines the file exporter has finished writing, with its resource's
    /// attributes. A last line without its newline is still being written: it is left for the
    /// next read.
    fn spans(&self) -> Vec<(Value, Value)> {
        let text = std::fs::read_to_string(&self.spans_file).unwrap_or_default();
        let written = text.rfind('\n').map_or("", |end| &text[..end]);
        let mut out = Vec::new();
        for line in written.lines().filter(|l| !l.trim().is_empty()) {
            let batch: Value = serde_json::from_str(line).expect("the file exporter writes JSON");
            for rs in batch["resourceSpans"].as_array().into_iter().flatten() {
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for span in ss["spans"].as_array().into_iter().flatten() {
                        out.push((rs["resource"].clone(), span.clone()));
                    }
                }
            }
        }
        out
    }

    /// The raw output, for the "no secret anywhere" check.
    fn raw(&self) -> String {
        std::fs::read_to_string(&self.spans_file).unwrap_or_default()
    }

    async fn stop(mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// An attribute's value as text: strings as they are, booleans, arrays as their string items
/// joined by `,`. An integer (`intValue`) reads as `None` here: integers are read with
/// [`int_attr`], so a count exported as a `stringValue` of digits cannot pass for one.
fn attr(span: &Value, key: &str) -> Option<String> {
    let kv = span["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)?;
    let v = &kv["value"];
    if let Some(s) = v["stringValue"].as_str() {
        return Some(s.to_string());
    }
    if v.get("intValue").is_some() {
        return None;
    }
    if let Some(b) = v["boolValue"].as_bool() {
        return Some(b.to_string());
    }
    if let Some(values) = v["arrayValue"]["values"].as_array() {
        return Some(
            values
                .iter()
                .filter_map(|x| x["stringValue"].as_str())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    Some(v.to_string())
}

/// An attribute exported as an OTLP `intValue` (the GenAI conventions' type for token counts
/// and every other integer); `None` when absent or of another type (a string in particular).
fn int_attr(span: &Value, key: &str) -> Option<i64> {
    let kv = span["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)?;
    // OTLP/JSON writes an int64 as a string of digits, under `intValue`.
    kv["value"]["intValue"].as_str()?.parse().ok()
}

/// Asserts that each of `keys` on `span` is exported as an OTLP `intValue`.
fn assert_ints(span: &Value, keys: &[&str]) {
    for k in keys {
        assert!(
            int_attr(span, k).is_some(),
            "{k} is not an intValue on {}: {:?}",
            name(span),
            span["attributes"]
                .as_array()
                .and_then(|a| a.iter().find(|kv| kv["key"] == *k))
        );
    }
}

/// The readers themselves: an integer passes only as an `intValue`; a `stringValue` of digits is
/// refused by [`int_attr`] and [`assert_ints`], and [`attr`] does not read integers.
#[test]
fn integers_are_read_only_from_int_values() {
    let span = serde_json::json!({"name": "s", "attributes": [
        {"key": "as_int", "value": {"intValue": "360"}},
        {"key": "as_string", "value": {"stringValue": "360"}},
    ]});
    assert_eq!(int_attr(&span, "as_int"), Some(360));
    assert_eq!(int_attr(&span, "as_string"), None);
    assert_eq!(attr(&span, "as_int"), None);
    assert_eq!(attr(&span, "as_string").as_deref(), Some("360"));
    assert_ints(&span, &["as_int"]);
    let refused = std::panic::catch_unwind(|| assert_ints(&span, &["as_string"]));
    assert!(refused.is_err(), "a stringValue passed as an integer");
}

fn name(span: &Value) -> &str {
    span["name"].as_str().unwrap_or_default()
}

const API_KEY: &str = "sk-otel-test-key-must-never-be-exported";

#[tokio::test]
async fn a_refund_task_is_one_trace_under_the_engines_trace_id() {
    let Some(collector) = Collector::start().await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // Two sampled tasks (both wire formats) and one the engine sampled out (flags 00).
    let parents = [
        ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01"),
        ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "01"),
        ("5c1e2f0a9b8d7c6e5f4a3b2c1d0e9f8a", "1122334455667788", "00"),
    ];
    let models = ["openai/refund", "anthropic/refund", "openai/refund"];
    let ids = stack
        .engine
        .create_tasks(parents.iter().zip(models).enumerate().map(|(i, (p, m))| {
            let mut s = spec(stack.refund_agent(m, &[]), &format!("o-{i}"));
            s.trace_parent = Some(format!("00-{}-{}-{}", p.0, p.1, p.2));
            s
        }));
    let mut env = stack_env(&stack, "otel-1");
    for (k, v) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=it"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        // The strictest case for "no secret in any span": the conversation itself is exported.
        ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true"),
        ("ABADA_AGENT_PROVIDER_OPENAI_API_KEY", API_KEY),
        ("ABADA_AGENT_PROVIDER_ANTHROPIC_API_KEY", API_KEY),
    ] {
        env.push((k.to_string(), v.to_string()));
    }
    let mut worker = WorkerProcess::spawn(&env).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    assert!(
        views.iter().all(|v| v.status == TaskStatus::Completed),
        "{views:?}"
    );
    // The exit flushes the batch queue to the collector.
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(15)).await;
    assert!(exit.success(), "{exit}\n{}", worker.stdout().join("\n"));
    // The file exporter writes every 100 ms: wait until the last span (the completion of the
    // last task) is there and the file has stopped growing over a few of its writes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seen = None;
    let spans = loop {
        let spans = collector.spans();
        let completes = spans
            .iter()
            .filter(|(_, s)| name(s) == "engine complete")
            .count();
        let settled = seen.replace(spans.len()) == Some(spans.len());
        if (completes >= 2 && settled) || tokio::time::Instant::now() > deadline {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(!spans.is_empty(), "the collector received no span");

    // The resource: our service name (defaulted), version, and the operator's attributes.
    let (resource, _) = &spans[0];
    assert_eq!(
        attr(resource, "service.name").as_deref(),
        Some("abada-agent-worker")
    );
    assert_eq!(
        attr(resource, "deployment.environment.name").as_deref(),
        Some("it")
    );
    assert!(attr(resource, "service.version").is_some());

    let tool_calls = stack.tools.calls();
    for ((trace_id, engine_span, flags), (view, provider)) in parents
        .iter()
        .zip(views.iter().zip(["openai", "anthropic", "openai"]))
    {
        let trace: Vec<&Value> = spans
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s["traceId"] == *trace_id)
            .collect();
        if *flags == "00" {
            assert!(
                trace.is_empty(),
                "a task the engine sampled out exports nothing: {trace:?}"
            );
            continue;
        }
        let ids: HashSet<&str> = trace.iter().filter_map(|s| s["spanId"].as_str()).collect();
        // One trace: every span's parent is in it, or is the engine's span.
        for s in &trace {
            let parent = s["parentSpanId"].as_str().unwrap_or_default();
            assert!(
                parent == *engine_span || ids.contains(parent),
                "span {} has a parent outside the trace: {s}",
                name(s)
            );
        }
        let invoke: Vec<&&Value> = trace
            .iter()
            .filter(|s| name(s) == "invoke_agent refund-agent")
            .collect();
        assert_eq!(invoke.len(), 1, "one invoke_agent per attempt: {trace:?}");
        let invoke = invoke[0];
        assert_eq!(invoke["parentSpanId"], *engine_span);
        assert_eq!(invoke["kind"], 1, "INTERNAL");
        for (k, v) in [
            ("gen_ai.operation.name", "invoke_agent"),
            ("gen_ai.agent.name", "refund-agent"),
            ("gen_ai.provider.name", provider),
            ("gen_ai.request.model", "refund"),
            ("abada.task.id", view.id.as_str()),
            ("abada.task.end", "completed"),
        ] {
            assert_eq!(attr(invoke, k).as_deref(), Some(v), "{k} on {invoke}");
        }
        assert_ints(
            invoke,
            &[
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.output_tokens",
                "abada.attempt",
            ],
        );
        assert_eq!(int_attr(invoke, "gen_ai.usage.input_tokens"), Some(360));
        let invoke_id = invoke["spanId"].as_str().unwrap();

        let chats: Vec<&&Value> = trace.iter().filter(|s| name(s) == "chat refund").collect();
        assert_eq!(chats.len(), 3, "a chat span per model call");
        for c in &chats {
            assert_eq!(c["parentSpanId"], invoke_id);
            assert_eq!(c["kind"], 3, "CLIENT");
            for (k, v) in [
                ("gen_ai.operation.name", "chat"),
                ("gen_ai.provider.name", provider),
                ("gen_ai.request.model", "refund"),
                ("abada.fallback", "false"),
            ] {
                assert_eq!(attr(c, k).as_deref(), Some(v), "{k} on {c}");
            }
            for k in [
                "gen_ai.response.finish_reasons",
                "gen_ai.input.messages",
                "gen_ai.output.messages",
            ] {
                assert!(attr(c, k).is_some(), "{k} missing on {c}");
            }
            assert!(attr(c, "error.type").is_none());
            assert_ints(
                c,
                &[
                    "gen_ai.usage.input_tokens",
                    "gen_ai.usage.output_tokens",
                    "gen_ai.request.max_tokens",
                    "abada.fallback.index",
                    "abada.retry",
                ],
            );
        }
        let input_tokens: i64 = chats
            .iter()
            .map(|c| int_attr(c, "gen_ai.usage.input_tokens").unwrap())
            .sum();
        assert_eq!(input_tokens, 360);

        let tools: Vec<&&Value> = trace
            .iter()
            .filter(|s| name(s).starts_with("execute_tool "))
            .collect();
        let tool_names: Vec<String> = tools
            .iter()
            .map(|t| attr(t, "gen_ai.tool.name").unwrap())
            .collect();
        assert_eq!(
            tools.len(),
            2,
            "an execute_tool per tool call: {tool_names:?}"
        );
        for t in &tools {
            assert_eq!(t["parentSpanId"], invoke_id);
            assert_eq!(
                attr(t, "gen_ai.operation.name").as_deref(),
                Some("execute_tool")
            );
            assert_eq!(attr(t, "abada.tool.server").as_deref(), Some("orders"));
            assert_eq!(attr(t, "abada.tool.outcome").as_deref(), Some("ok"));
            assert!(attr(t, "gen_ai.tool.call.id").is_some());
            assert_ints(t, &["abada.tool.tries"]);
        }
        let refund = tools
            .iter()
            .find(|t| attr(t, "gen_ai.tool.name").as_deref() == Some("issue_refund"))
            .expect("the refund's span");
        assert_eq!(
            attr(refund, "abada.idempotency_key"),
            Some(format!("abada:{}:5", view.id))
        );
        assert_eq!(
            attr(refund, "abada.idempotency_key.kind").as_deref(),
            Some("journal")
        );
        assert!(
            tools
                .iter()
                .any(|t| attr(t, "abada.idempotency_key").is_none()),
            "the read-only lookup has no key"
        );

        // Engine calls about the task are client spans: the journal's under the attempt (or
        // its tool call), the completion under the engine's span, after the attempt.
        let engine: Vec<&&Value> = trace
            .iter()
            .filter(|s| name(s).starts_with("engine "))
            .collect();
        assert!(engine.iter().all(|s| s["kind"] == 3));
        let appends = engine
            .iter()
            .filter(|s| name(s) == "engine journal-append")
            .count();
        assert_eq!(appends, view.journal.len(), "a span per journal append");
        let complete: Vec<&&&Value> = engine
            .iter()
            .filter(|s| name(s) == "engine complete")
            .collect();
        assert_eq!(complete.len(), 1);
        assert_eq!(complete[0]["parentSpanId"], *engine_span);
        let status = int_attr(complete[0], "http.response.status_code").unwrap_or_default();
        assert!((200..300).contains(&status), "complete answered {status}");
        // Every journaled step names the attempt that wrote it, for a resuming attempt's link.
        for step in &view.journal {
            let tp = step["data"]["traceparent"].as_str().unwrap_or_default();
            assert_eq!(tp, format!("00-{trace_id}-{invoke_id}-01"), "step {step}");
        }
    }

    // No secret anywhere in what was exported: not the provider key, not a tool credential.
    let raw = collector.raw();
    assert!(!raw.contains(API_KEY), "the provider key reached a span");
    let tokens: HashSet<String> = tool_calls.iter().filter_map(|c| c.token.clone()).collect();
    assert!(!tokens.is_empty(), "the tool server saw credentials");
    for t in &tokens {
        assert!(
            !raw.contains(t.as_str()),
            "a tool credential reached a span"
        );
    }
    collector.stop().await;
    stack.shutdown().await;
}

/// Without a journal, a keyed write's key is derived from its content
/// (`abada:{taskId}:h:{hash}:{n}`, the hash a SHA-256 of the arguments). The tool server gets
/// it unchanged; no exported span carries the hash (small arguments could be recovered from it
/// by guessing), only the key's kind.
#[tokio::test]
async fn a_content_derived_key_reaches_the_tool_server_but_no_span() {
    let Some(collector) = Collector::start().await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1WithoutJournal)
        .await
        .unwrap();
    let ids = stack
        .engine
        .create_tasks([spec(stack.refund_agent("openai/refund", &[]), "o-content")]);
    let mut env = stack_env(&stack, "otel-content");
    for (k, v) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        // Content capture off: the hash must not be the one way the arguments leave.
        ("ABADA_AGENT_PROVIDER_OPENAI_API_KEY", API_KEY),
    ] {
        env.push((k.to_string(), v.to_string()));
    }
    let mut worker = WorkerProcess::spawn(&env).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{views:?}");
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(15)).await;
    assert!(exit.success(), "{exit}");

    // The key the tool server received: content-derived, unchanged.
    let keys: Vec<String> = stack
        .tools
        .calls()
        .into_iter()
        .filter_map(|c| c.idempotency_key)
        .collect();
    let prefix = format!("abada:{}:h:", ids[0]);
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].starts_with(&prefix), "{keys:?}");
    let hash = keys[0][prefix.len()..]
        .split(':')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(hash.len(), 32, "{keys:?}");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let refund = loop {
        let found = collector
            .spans()
            .into_iter()
            .map(|(_, s)| s)
            .find(|s| name(s) == "execute_tool issue_refund");
        if let Some(s) = found {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the refund's span never reached the collector"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Nowhere in anything exported: neither the hash nor the key.
    let raw = collector.raw();
    assert!(!raw.contains(&hash), "the content hash reached a span");
    assert!(!raw.contains(&keys[0]), "the content key reached a span");
    assert_eq!(attr(&refund, "abada.idempotency_key"), None);
    assert_eq!(
        attr(&refund, "abada.idempotency_key.kind").as_deref(),
        Some("content")
    );
    collector.stop().await;
    stack.shutdown().await;
}
