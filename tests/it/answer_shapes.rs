//! The malformed answers real models give (`agent::answer_shape`, docs/REAL_MODEL.md), replayed
//! on the wire through the devkit's scripted model: a tool call written as text (bare, fenced,
//! tagged, among other text), tool-call markup, an empty answer, a write repeated after its
//! result. Under the default (`repair`) none is performed or stored and the model is told how to
//! call tools; under `_TOOL_CALLS_IN_TEXT=parse` the call is performed as a tool call under every
//! rule; either way the repair turns are bounded, journaled and replayed on resume.
//!
//! The `real_*` tests replay the exact bytes Qwen2.5-Coder-0.5B-Instruct answered through
//! llama.cpp's `llama-server` (`tests/data/real_model/`, captured by `scripts/interop-llm`'s
//! recorder; only ids and timestamps are redacted).

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{Fault, FaultTimes, Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Value, json};

use crate::agent::{spec, step_kinds, wait_all_ended};
use crate::support::wait::eventually;

const FORMATS: [&str; 2] = ["openai", "anthropic"];

/// The refund agent on `model`, with the decision schema when `schema`.
fn agent(stack: &Stack, model: &str, schema: bool) -> Value {
    let mut a = stack.refund_agent(model, &[]);
    if schema {
        a["outputSchema"] = json!({
            "type": "object",
            "properties": {
                "decision": {"type": "string", "enum": ["refunded", "rejected"]},
                "orderId": {"type": "string"}
            },
            "required": ["decision", "orderId"],
            "additionalProperties": false
        });
    }
    a
}

/// A worker whose providers treat calls written as text as `policy` says.
fn worker_options(id: &str, policy: &str) -> WorkerOptions {
    let mut o = WorkerOptions::new(id, 2);
    o.env = vec![
        (
            "ABADA_AGENT_PROVIDER_OPENAI_TOOL_CALLS_IN_TEXT".into(),
            policy.into(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_TOOL_CALLS_IN_TEXT".into(),
            policy.into(),
        ),
    ];
    o
}

fn requests_of(s: &Stack, model: &str) -> Vec<Value> {
    s.model
        .requests()
        .into_iter()
        .filter(|r| r.model == model)
        .map(|r| r.body)
        .collect()
}

/// The text of the last user message of a recorded request, in either wire format.
fn last_user_text(body: &Value) -> String {
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .cloned()
        .unwrap_or_default();
    match &last["content"] {
        Value::String(t) => t.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str().or_else(|| b["content"].as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn incident(view: &TaskView) -> String {
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.retries, Some(0), "an incident: {view:?}");
    view.error_message.clone().unwrap_or_default()
}

fn decision(view: &TaskView) -> Value {
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    view.result_variables.as_ref().unwrap()["refundDecision"].clone()
}

fn model_steps(view: &TaskView) -> Vec<&Value> {
    view.journal
        .iter()
        .filter(|s| s["kind"] == "model")
        .collect()
}

fn metric(w: &abada_agent_worker::devkit::stack::WorkerHandle, line: &str) -> bool {
    w.metrics.encode().lines().any(|l| l == line)
}

const TEXT_CALL: &str =
    r#"{"name": "issue_refund", "arguments": {"orderId": "${input}", "amountCents": 2500}}"#;
const FINAL: &str = r#"{"decision": "refunded", "orderId": "${input}"}"#;

/// What the real model did first (docs/REAL_MODEL.md): the refund written as text, stored as the
/// decision. Now, in the default mode, with or without a schema: the model reads how to call
/// tools, calls them, and only its real answer is stored; nothing written as text is performed.
#[tokio::test]
async fn a_call_written_as_text_is_never_stored_and_the_model_is_told_how_to_call_tools() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "texter",
        Script::new(vec![
            Turn::text(TEXT_CALL),
            Turn::call(
                "issue_refund",
                json!({"orderId": "${input}", "amountCents": 2500}),
            ),
            Turn::text(FINAL),
        ]),
    );
    let mut specs = Vec::new();
    for f in FORMATS {
        for schema in [false, true] {
            specs.push(spec(
                agent(&s, &format!("{f}/texter"), schema),
                &format!("o-{f}-{schema}"),
            ));
        }
    }
    let ids = s.engine.create_tasks(specs);
    let w = s.spawn_worker(worker_options("w", "repair"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    for v in &views {
        let order = v.variables["orderId"].as_str().unwrap();
        assert_eq!(
            decision(v),
            json!({"decision": "refunded", "orderId": order}),
            "the real answer, never the call"
        );
        let steps = model_steps(v);
        assert_eq!(
            steps[0]["data"]["answerRepair"]["reason"],
            "tool_call_as_text"
        );
        assert!(steps[1]["data"].get("answerRepair").is_none());
        // An answer under an `outputSchema` is judged after it is journaled.
        let mut kinds = vec![
            "input/finished",
            "model/finished",
            "model/finished",
            "tool/started",
            "tool/finished",
            "model/finished",
        ];
        if order.ends_with("-true") {
            kinds.push("output/accepted");
        }
        assert_eq!(step_kinds(v), kinds);
    }
    // One refund per task: the real call, not the one written as text.
    let c = s.tools.counters().await;
    assert_eq!(c.writes_applied, 4);
    // The model read what was wrong, as the next user message, once per task.
    let told = requests_of(&s, "texter")
        .iter()
        .filter(|b| b["messages"].as_array().unwrap().last().unwrap()["role"] == "user")
        .map(last_user_text)
        .filter(|said| said.contains("written as text") && said.contains("orders__issue_refund"))
        .count();
    assert_eq!(told, 4);
    assert!(metric(
        &w,
        r#"abada_agent_answer_repairs_total{agent="refund-agent",reason="tool_call_as_text"} 4"#
    ));
    w.stop().await;
    s.shutdown().await;
}

/// A model that never calls a tool any other way: bounded by `answerRepairTurns`, then an
/// incident that names the shape and the fix; nothing performed, nothing stored.
#[tokio::test]
async fn a_model_that_only_writes_calls_as_text_is_an_incident_after_its_repair_turns() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "stubborn",
        Script::new(vec![Turn::text(format!("```json\n{TEXT_CALL}\n```"))]),
    );
    let mut one = agent(&s, "anthropic/stubborn", false);
    one["answerRepairTurns"] = json!(1);
    let ids = s.engine.create_tasks([
        spec(agent(&s, "openai/stubborn", false), "o-1"),
        spec(one, "o-2"),
    ]);
    let w = s.spawn_worker(worker_options("w", "repair"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    for (v, repairs) in views.iter().zip([2, 1]) {
        let msg = incident(v);
        assert!(
            msg.starts_with("the agent's answer is malformed")
                && msg.contains(
                    "a call of orders__issue_refund written as text (in a Markdown code fence)"
                )
                && msg.contains(&format!(
                    "after {repairs} repair turn(s) (answerRepairTurns)"
                ))
                && msg.contains("TOOL_CALLS_IN_TEXT=parse"),
            "{msg}"
        );
        assert_eq!(model_steps(v).len(), repairs + 1, "never more");
        assert!(v.result_variables.is_none());
    }
    assert_eq!(s.tools.counters().await.writes_applied, 0);
    assert!(metric(
        &w,
        r#"abada_agent_answer_failures_total{agent="refund-agent",reason="tool_call_as_text"} 2"#
    ));
    w.stop().await;
    s.shutdown().await;
}

/// Under `parse`, the call written as text is the model's tool call: performed through MCP,
/// keyed and journaled `tool/started` first like any write, its result read by the model; what
/// the model wrote is kept beside it in the journal.
#[tokio::test]
async fn under_parse_a_call_written_as_text_is_a_keyed_tool_call() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "parsed",
        Script::new(vec![
            Turn::text(format!("<tool_call>\n{TEXT_CALL}\n</tool_call>")),
            Turn::text(
                r#"{"decision": "refunded", "orderId": "${input}", "refund": ${last_tool_result}}"#,
            ),
        ]),
    );
    let ids = s.engine.create_tasks(
        FORMATS.map(|f| spec(agent(&s, &format!("{f}/parsed"), false), &format!("o-{f}"))),
    );
    let w = s.spawn_worker(worker_options("w", "parse"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    for v in &views {
        let answer = decision(v);
        assert_eq!(
            answer["refund"]["status"], "issued",
            "the model read the refund's result: {answer}"
        );
        assert_eq!(
            step_kinds(v),
            [
                "input/finished",
                "model/finished",
                "tool/started",
                "tool/finished",
                "model/finished"
            ]
        );
        let first = model_steps(v)[0];
        assert_eq!(
            first["data"]["toleratedAnswer"]["tolerated"],
            json!(["tagged"])
        );
        assert!(
            first["data"]["toleratedAnswer"]["text"]
                .as_str()
                .unwrap()
                .starts_with("<tool_call>")
        );
        let call = &first["data"]["message"]["toolCalls"][0];
        assert_eq!(call["callId"], "text_call_2_0");
        assert_eq!(
            (&call["server"], &call["tool"]),
            (&json!("orders"), &json!("issue_refund"))
        );
        assert_eq!(first["data"]["message"]["text"], Value::Null);
        assert_eq!(v.journal[2]["key"], format!("abada:{}:3", v.id));
    }
    let c = s.tools.counters().await;
    assert_eq!((c.writes_applied, c.writes_unkeyed), (2, 0));
    assert!(metric(
        &w,
        r#"abada_agent_tolerated_answers_total{agent="refund-agent",reason="tagged"} 2"#
    ));
    w.stop().await;
    s.shutdown().await;
}

/// A parsed call obeys the limits like any call: two refunds written as text in an answer
/// allowed one call is refused whole, nothing performed; and a call of a name nobody offered is
/// never taken: the model is told which tools there are.
#[tokio::test]
async fn under_parse_calls_written_as_text_obey_the_limits_and_the_offered_tools() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "greedy",
        Script::new(vec![Turn::text(format!("[{TEXT_CALL}, {TEXT_CALL}]"))]),
    );
    s.model.set_script(
        "inventive",
        Script::new(vec![
            Turn::text(r#"<tool_call>{"name": "drop_tables", "arguments": {}}</tool_call>"#),
            Turn::text(FINAL),
        ]),
    );
    let mut greedy = agent(&s, "openai/greedy", false);
    greedy["maxToolCallsPerAnswer"] = json!(1);
    let ids = s.engine.create_tasks([
        spec(greedy, "o-1"),
        spec(agent(&s, "anthropic/inventive", false), "o-2"),
    ]);
    let w = s.spawn_worker(worker_options("w", "parse"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    let msg = incident(&views[0]);
    assert!(msg.contains("maxToolCallsPerAnswer = 1"), "{msg}");
    assert!(
        model_steps(&views[0]).is_empty(),
        "nothing of the answer journaled"
    );
    assert_eq!(decision(&views[1])["decision"], "refunded");
    assert_eq!(
        step_kinds(&views[1]),
        ["input/finished", "model/finished", "model/finished"]
    );
    let told = last_user_text(requests_of(&s, "inventive").last().unwrap());
    assert!(
        told.contains("There is no tool drop_tables")
            && told.contains("orders__lookup_order, orders__issue_refund"),
        "{told}"
    );
    let c = s.tools.counters().await;
    assert_eq!(c.writes_applied, 0);
    assert!(!c.calls_per_tool.contains_key("drop_tables"), "never sent");
    w.stop().await;
    s.shutdown().await;
}

/// A model that loops on its write after reading the result: the write is performed once; the
/// repeat is answered with the earlier result and counted; past the repair turns, an incident.
#[tokio::test]
async fn a_write_repeated_after_its_result_is_performed_once() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let refund = || {
        Turn::call(
            "issue_refund",
            json!({"orderId": "${input}", "amountCents": 2500, "reason": "damaged"}),
        )
    };
    s.model.set_script(
        "twice",
        Script::new(vec![refund(), refund(), Turn::text(FINAL)]),
    );
    s.model.set_script("forever", Script::new(vec![refund()]));
    // One keyed write allowed, as a refund agent would set it: the repeat is no second write
    // (it is never sent), so it is a repair turn, not the limit.
    let mut twice = agent(&s, "openai/twice", true);
    twice["maxKeyedWrites"] = json!(1);
    let ids = s.engine.create_tasks([
        spec(twice, "o-1"),
        spec(agent(&s, "anthropic/forever", true), "o-2"),
    ]);
    let w = s.spawn_worker(worker_options("w", "repair"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    assert_eq!(decision(&views[0])["decision"], "refunded");
    let repeat = &views[0].journal[5];
    assert_eq!(
        (&repeat["kind"], &repeat["state"]),
        (&json!("tool"), &json!("finished"))
    );
    assert!(repeat["key"].is_null(), "nothing sent: no key");
    let said = repeat["data"]["result"]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(
        said.contains("already called orders__issue_refund")
            && said.contains("\"status\":\"issued\""),
        "{said}"
    );
    assert_eq!(
        model_steps(&views[0])[1]["data"]["answerRepair"]["reason"],
        "repeated_call"
    );
    let msg = incident(&views[1]);
    assert!(
        msg.contains("the model called orders__issue_refund with the same arguments")
            && msg.contains("after 2 repair turn(s)"),
        "{msg}"
    );
    let c = s.tools.counters().await;
    assert_eq!((c.writes_applied, c.duplicates), (2, 0), "once per task");
    assert_eq!(
        c.calls_per_tool.get("issue_refund"),
        Some(&2),
        "no repeat sent"
    );
    w.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn an_empty_answer_gets_a_repair_turn_and_is_never_stored() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "mute",
        Script::new(vec![Turn::text(""), Turn::text("Refunded.")]),
    );
    s.model
        .set_script("silent", Script::new(vec![Turn::text("  ")]));
    let ids = s.engine.create_tasks([
        spec(agent(&s, "openai/mute", false), "o-1"),
        spec(agent(&s, "anthropic/silent", false), "o-2"),
    ]);
    let w = s.spawn_worker(worker_options("w", "repair"), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    assert_eq!(decision(&views[0]), json!("Refunded."));
    assert_eq!(
        model_steps(&views[0])[0]["data"]["answerRepair"]["reason"],
        "empty_answer"
    );
    let msg = incident(&views[1]);
    assert!(msg.contains("the model's answer was empty"), "{msg}");
    assert_eq!(model_steps(&views[1]).len(), 3);
    w.stop().await;
    s.shutdown().await;
}

/// The repair turn is journaled with its message: a worker that stops in the repair call is
/// followed by one that sends the very same conversation.
#[tokio::test]
async fn a_resumed_run_sends_the_journaled_repair_turn_again() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "resumed",
        Script::new(vec![Turn::text(TEXT_CALL), Turn::text(FINAL)]),
    );
    let id = s
        .engine
        .create_task(spec(agent(&s, "anthropic/resumed", true), "o-1"));
    s.model.inject_request_fault(
        "resumed",
        "written as text",
        Fault::Hang(Duration::from_secs(30)),
        FaultTimes::Next(1),
    );
    let w1 = s.spawn_worker(worker_options("w1", "repair"), Stack::fast_agent_settings());
    eventually(Duration::from_secs(20), "the repair call", async || {
        s.model.calls("resumed") >= 2
    })
    .await;
    w1.stop().await;
    let w2 = s.spawn_worker(worker_options("w2", "repair"), Stack::fast_agent_settings());
    let view = &wait_all_ended(&s, &[id], Duration::from_secs(20)).await[0];
    assert_eq!(decision(view)["decision"], "refunded");
    let requests = requests_of(&s, "resumed");
    let (first, resumed) = (&requests[1], &requests[requests.len() - 1]);
    assert_eq!(first["messages"], resumed["messages"]);
    assert!(last_user_text(resumed).contains("written as text"));
    assert_eq!(
        step_kinds(view),
        [
            "input/finished",
            "model/finished",
            "model/finished",
            "output/accepted"
        ]
    );
    w2.stop().await;
    s.shutdown().await;
}

/// `_STRUCTURED_OUTPUT=instructed`: no `response_format` (llama.cpp makes it a grammar of the
/// whole answer, so no tool could be called), the schema asked in the system prompt, the
/// answer validated as ever.
#[tokio::test]
async fn instructed_structured_output_sends_no_response_format() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model
        .set_script("plain", Script::new(vec![Turn::text(FINAL)]));
    let ids = s
        .engine
        .create_tasks([spec(agent(&s, "openai/plain", true), "o-1")]);
    let mut opts = worker_options("w", "repair");
    opts.env.push((
        "ABADA_AGENT_PROVIDER_OPENAI_STRUCTURED_OUTPUT".into(),
        "instructed".into(),
    ));
    let w = s.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    assert_eq!(decision(&views[0])["decision"], "refunded");
    let body = &requests_of(&s, "plain")[0];
    assert!(body.get("response_format").is_none(), "{body}");
    let system = body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("JSON Schema") && system.contains("\"refunded\""),
        "{system}"
    );
    w.stop().await;
    s.shutdown().await;
}

// ---- what the real model sent -------------------------------------------------------------

/// A captured answer of the real model: its wire format and the exact response body.
fn capture(name: &str) -> (String, Turn) {
    let path = format!(
        "{}/tests/data/real_model/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap();
    (
        v["format"].as_str().unwrap().to_string(),
        Turn::Raw(v["body"].as_str().unwrap().to_string()),
    )
}

/// What the worker made of a captured answer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Became {
    /// A repair turn for a malformed answer (`answerRepair`).
    AnswerRepair(&'static str),
    /// A repair turn of the output rules (`outputRepair`): a cut answer.
    OutputRepair(&'static str),
    /// The refund it wrote, performed once.
    Refund,
}

/// Each captured answer as the first answer of a refund task, then the model's real answer; in
/// its own wire format, the provider set to `policy`. Whatever the capture held, the stored
/// result is the real answer, and what the worker made of the capture is `became`.
async fn replay_first_answers(policy: &str, cases: &[(&str, Became)]) {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let mut specs = Vec::new();
    for (name, _) in cases {
        let (format, turn) = capture(name);
        let model = format!("real-{name}");
        s.model
            .set_script(&model, Script::new(vec![turn, Turn::text(FINAL)]));
        specs.push(spec(
            agent(&s, &format!("{format}/{model}"), true),
            &format!("o-{name}"),
        ));
    }
    let ids = s.engine.create_tasks(specs);
    let w = s.spawn_worker(worker_options("w", policy), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(60)).await;
    let mut refunds = 0;
    for (v, (name, became)) in views.iter().zip(cases) {
        assert_eq!(
            decision(v),
            json!({"decision": "refunded", "orderId": format!("o-{name}")}),
            "{name}: only the real answer is stored"
        );
        let first = model_steps(v)[0];
        let results: Vec<&Value> = v
            .journal
            .iter()
            .filter(|s| s["kind"] == "tool" && s["state"] == "finished")
            .collect();
        match became {
            Became::AnswerRepair(reason) => {
                assert_eq!(first["data"]["answerRepair"]["reason"], *reason, "{name}");
                assert!(results.is_empty(), "{name}: nothing performed");
            }
            Became::OutputRepair(reason) => {
                assert_eq!(first["data"]["outputRepair"]["reason"], *reason, "{name}");
                assert!(results.is_empty(), "{name}: nothing performed");
            }
            Became::Refund => {
                refunds += 1;
                assert!(first["data"]["toleratedAnswer"].is_object(), "{name}");
                assert_eq!(results.len(), 1, "{name}");
                assert_eq!(results[0]["data"]["tool"], "issue_refund", "{name}");
                assert!(results[0]["key"].is_string(), "{name}: keyed");
                assert_eq!(results[0]["data"]["result"]["isError"], false, "{name}");
            }
        }
    }
    let c = s.tools.counters().await;
    assert_eq!(c.writes_applied, refunds, "{policy}");
    assert_eq!(c.calls_per_tool.values().sum::<u64>(), refunds, "{policy}");
    w.stop().await;
    s.shutdown().await;
}

const REAL_SHAPES: [&str; 12] = [
    "openai_fenced_call",
    "openai_bare_call",
    "anthropic_bare_call",
    "anthropic_fenced_call",
    "openai_unknown_name",
    "openai_unclosed_call",
    "anthropic_call_with_comments",
    "anthropic_stray_bracket",
    "openai_calls_cut",
    "anthropic_calls_cut",
    "anthropic_empty_answer",
    "openai_call_with_text",
];

/// The default: every call the real model wrote as text is sent back, none performed; the cut
/// answers go to the output rules (never stored).
#[tokio::test]
async fn real_answers_written_as_calls_are_repaired_by_default_and_never_stored() {
    let became = |name: &str| match name {
        n if n.ends_with("_cut") => Became::OutputRepair("truncated"),
        "anthropic_empty_answer" => Became::AnswerRepair("empty_answer"),
        _ => Became::AnswerRepair("tool_call_as_text"),
    };
    let cases: Vec<(&str, Became)> = REAL_SHAPES.iter().map(|n| (*n, became(n))).collect();
    replay_first_answers("repair", &cases).await;
}

/// `parse`: the refunds written as text are performed (keyed, once); the decision written as a
/// call of a tool nobody offered, and what cannot be read, are sent back.
#[tokio::test]
async fn real_answers_written_as_calls_under_parse_become_calls_under_every_rule() {
    let became = |name: &str| match name {
        "openai_fenced_call"
        | "openai_bare_call"
        | "anthropic_bare_call"
        | "anthropic_fenced_call"
        | "openai_call_with_text" => Became::Refund,
        "openai_unknown_name" => Became::AnswerRepair("tool_call_as_text"),
        "anthropic_empty_answer" => Became::AnswerRepair("empty_answer"),
        n if n.ends_with("_cut") => Became::OutputRepair("truncated"),
        _ => Became::AnswerRepair("tool_call_as_text"),
    };
    let cases: Vec<(&str, Became)> = REAL_SHAPES.iter().map(|n| (*n, became(n))).collect();
    replay_first_answers("parse", &cases).await;
}

/// The real model's refund, then the same refund again after its result (OpenAI format), and the
/// same with the result's fields folded into its arguments (Anthropic format): each refund is
/// performed once; the repeat is answered with the earlier result, and the model answers.
#[tokio::test]
async fn real_repeated_refunds_are_performed_once() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let (_, bare) = capture("openai_bare_call");
    let (_, repeated) = capture("openai_repeated_call");
    s.model.set_script(
        "real-repeat",
        Script::new(vec![bare, repeated, Turn::text(FINAL)]),
    );
    let (_, fenced) = capture("anthropic_fenced_call");
    let (_, folded) = capture("anthropic_folded_result_call");
    s.model.set_script(
        "real-folded",
        Script::new(vec![fenced, folded, Turn::text(FINAL)]),
    );
    let w = s.spawn_worker(worker_options("w", "parse"), Stack::fast_agent_settings());
    // One after the other: the folded answer names refund rf-2, the server's second refund.
    let mut views = Vec::new();
    for (model, order) in [
        ("openai/real-repeat", "o-1"),
        ("anthropic/real-folded", "o-2"),
    ] {
        let mut a = agent(&s, model, true);
        a["maxKeyedWrites"] = json!(1);
        let id = s.engine.create_task(spec(a, order));
        views.extend(wait_all_ended(&s, &[id], Duration::from_secs(60)).await);
    }
    for v in &views {
        assert_eq!(decision(v)["decision"], "refunded");
        assert_eq!(
            model_steps(v)[1]["data"]["answerRepair"]["reason"],
            "repeated_call",
            "{v:?}"
        );
        let repeat = v
            .journal
            .iter()
            .rfind(|s| s["kind"] == "tool" && s["state"] == "finished")
            .unwrap();
        assert!(repeat["key"].is_null(), "not sent");
        assert!(
            repeat["data"]["result"]["content"][0]["text"]
                .as_str()
                .unwrap()
                .contains("already called orders__issue_refund")
        );
    }
    let c = s.tools.counters().await;
    assert_eq!(
        (c.writes_applied, c.duplicates),
        (2, 0),
        "one refund per task"
    );
    w.stop().await;
    s.shutdown().await;
}

/// Tool calls of the wire format that real models get slightly wrong: a name in another case
/// (`Lookup_Order`), arguments with a closing brace after the object. Under `parse` each is the
/// call the model meant, performed; under `repair` each is answered with an error naming the
/// tools as offered, nothing performed.
#[tokio::test]
async fn wire_calls_with_a_name_in_another_case_or_trailing_text_are_tolerated_only_under_parse() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "sloppy",
        Script::new(vec![
            Turn::call("Lookup_Order", json!({"orderId": "${input}"})),
            Turn::call(
                "issue_refund",
                json!("{\"orderId\": \"${input}\", \"amountCents\": 2500}}"),
            ),
            Turn::text(FINAL),
        ]),
    );
    let mut ids = Vec::new();
    for (policy, f) in [("parse", "openai"), ("repair", "anthropic")] {
        let id = s.engine.create_task(spec(
            agent(&s, &format!("{f}/sloppy"), true),
            &format!("o-{policy}"),
        ));
        ids.push(id);
    }
    // One worker per policy, each claiming its own format's task: the policies are per provider.
    let mut opts = worker_options("w", "parse");
    opts.env[1].1 = "repair".into();
    let w = s.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    let results = |v: &TaskView| -> Vec<Value> {
        v.journal
            .iter()
            .filter(|s| s["kind"] == "tool" && s["state"] == "finished")
            .map(|s| s["data"]["result"].clone())
            .collect()
    };
    // parse (OpenAI): both performed.
    let parsed = &views[0];
    assert_eq!(decision(parsed)["decision"], "refunded");
    assert!(
        results(parsed).iter().all(|r| r["isError"] == false),
        "{:?}",
        results(parsed)
    );
    assert_eq!(
        model_steps(parsed)[0]["data"]["toleratedAnswer"]["tolerated"],
        json!(["tool_name"])
    );
    assert_eq!(
        model_steps(parsed)[1]["data"]["toleratedAnswer"]["tolerated"],
        json!(["arguments_text"])
    );
    // repair (Anthropic): both answered as errors, naming what the model can call.
    let repaired = &views[1];
    assert_eq!(decision(repaired)["decision"], "refunded");
    let r = results(repaired);
    assert!(r.iter().all(|r| r["isError"] == true), "{r:?}");
    let said = r[0]["content"][0]["text"].as_str().unwrap();
    assert!(
        said.contains("There is no tool \"Lookup_Order\"") && said.contains("orders__lookup_order"),
        "{said}"
    );
    let c = s.tools.counters().await;
    assert_eq!(c.writes_applied, 1, "the parsed refund only");
    w.stop().await;
    s.shutdown().await;
}
