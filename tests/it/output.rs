//! Structured output end to end (issue 26, part 3), on both wire formats against the scripted
//! model on loopback: an off-schema answer is repaired in one turn, one still off-schema after
//! it is an incident naming the schema path, a cut answer is never stored, the native
//! `response_format` is strict only when the schema qualifies, the repair turn is journaled so
//! a resumed run sends the same conversation, and hostile answers and schemas stay bounded.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{Fault, FaultTimes, Script, Turn};
use abada_agent_worker::devkit::stack::{DeclaredLabelNames, Stack, StackWorkers, WorkerOptions};
use serde_json::{Value, json};

use crate::agent::{spec, step_kinds, wait_all_ended};
use crate::support::wait::eventually;

/// A worker whose agents file declares the agent name `router` (only the operator's names label
/// metrics: `metrics::labels`).
fn router_worker(
    s: &Stack,
    slots: u32,
) -> (
    abada_agent_worker::devkit::stack::WorkerHandle,
    DeclaredLabelNames,
) {
    let names = DeclaredLabelNames::write("router", &["openai/fixer"], &[]).unwrap();
    let mut opts = WorkerOptions::new("w", slots);
    opts.env.push(names.env());
    (s.spawn_worker(opts, Stack::fast_agent_settings()), names)
}

/// A routing schema that is not strict-eligible (`orderId` is optional).
fn routing_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "decision": {"type": "string", "enum": ["refund", "reject", "escalate"]},
            "orderId": {"type": "string"}
        },
        "required": ["decision"],
        "additionalProperties": false
    })
}

/// The same, strict-eligible: every property required, every object closed.
fn strict_schema() -> Value {
    let mut s = routing_schema();
    s["required"] = json!(["decision", "orderId"]);
    s
}

/// An agent on `model` (no tools) answering under `schema`.
fn agent(model: &str, schema: Option<Value>) -> Value {
    let mut a = json!({
        "name": "router",
        "model": model,
        "instructions": "You route refund requests.",
        "input": "Order ${orderId}",
        "maxTurns": 6,
        "resultVariable": "route",
    });
    if let Some(s) = schema {
        a["outputSchema"] = s;
    }
    a
}

const FORMATS: [&str; 2] = ["openai", "anthropic"];

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
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn metric(w: &abada_agent_worker::devkit::stack::WorkerHandle, line: &str) -> bool {
    w.metrics.encode().lines().any(|l| l == line)
}

fn incident(view: &TaskView) -> String {
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.retries, Some(0), "an incident: {view:?}");
    view.error_message.clone().unwrap_or_default()
}

#[tokio::test]
async fn an_off_schema_answer_is_repaired_in_one_turn_on_both_wire_formats() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "fixer",
        Script::new(vec![
            Turn::text(r#"{"decision": "maybe"}"#),
            Turn::text(r#"{"decision": "refund", "orderId": "${input}"}"#),
        ]),
    );
    let ids = s.engine.create_tasks(FORMATS.map(|f| {
        spec(
            agent(&format!("{f}/fixer"), Some(routing_schema())),
            &format!("o-{f}"),
        )
    }));
    let (w, _declared) = router_worker(&s, 2);
    let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
    for (view, f) in views.iter().zip(FORMATS) {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        // The validated value, not a string holding it.
        let route = &view.result_variables.as_ref().unwrap()["route"];
        assert_eq!(
            route,
            &json!({"decision": "refund", "orderId": format!("Order o-{f}")})
        );
        assert_eq!(
            step_kinds(view),
            ["input/finished", "model/finished", "model/finished"]
        );
        let repair = &view.journal[1]["data"]["outputRepair"];
        assert_eq!(repair["reason"], "schema", "{repair}");
        assert!(
            repair["message"].as_str().unwrap().contains("at /decision"),
            "{repair}"
        );
        assert!(view.journal[2]["data"].get("outputRepair").is_none());
    }
    // The model read what was wrong, as the last user message of the second call.
    let requests = requests_of(&s, "fixer");
    assert_eq!(requests.len(), 4);
    for r in requests
        .iter()
        .filter(|r| r["messages"].as_array().unwrap().len() > 2)
    {
        let said = last_user_text(r);
        assert!(
            said.contains("does not match the output schema") && said.contains("/decision"),
            "{said}"
        );
    }
    assert!(metric(
        &w,
        r#"abada_agent_output_repairs_total{agent="router",reason="schema"} 2"#
    ));
    w.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn an_answer_still_off_schema_after_its_repair_is_an_incident_naming_the_path() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // The last turn repeats: off-schema every time.
    s.model.set_script(
        "stubborn",
        Script::new(vec![Turn::text(r#"{"decision": "maybe"}"#)]),
    );
    let ids = s.engine.create_tasks(FORMATS.map(|f| {
        spec(
            agent(&format!("{f}/stubborn"), Some(routing_schema())),
            &format!("o-{f}"),
        )
    }));
    let (w, _declared) = router_worker(&s, 2);
    let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
    for view in &views {
        let msg = incident(view);
        assert!(
            msg.contains("does not match its outputSchema at instance /decision, schema /properties/decision/enum")
                && msg.contains("after 1 repair turn"),
            "{msg}"
        );
        assert!(view.result_variables.is_none(), "nothing was stored");
        // Both answers journaled, each with its repair message: a retry resumes there.
        assert_eq!(
            step_kinds(view),
            ["input/finished", "model/finished", "model/finished"]
        );
    }
    assert_eq!(
        s.model.calls("stubborn"),
        4,
        "one answer and one repair each"
    );
    assert!(metric(
        &w,
        r#"abada_agent_output_failures_total{agent="router",reason="schema"} 2"#
    ));
    w.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn a_cut_answer_is_never_stored_repaired_or_an_incident() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "cut-once",
        Script::new(vec![
            Turn::Cut(r#"{"decision": "refund", "orderId": "o-1", "note": "h-h-h-h-h"#.into()),
            Turn::text(r#"{"decision": "refund"}"#),
        ]),
    );
    s.model.set_script(
        "cut-always",
        Script::new(vec![Turn::Cut("h-h-h-h-h-h-h-h".into())]),
    );
    let mut specs = Vec::new();
    for f in FORMATS {
        // With a schema, and without one: a cut answer is never stored either way.
        specs.push(spec(
            agent(&format!("{f}/cut-once"), Some(routing_schema())),
            "o-1",
        ));
        specs.push(spec(agent(&format!("{f}/cut-always"), None), "o-2"));
    }
    let ids = s.engine.create_tasks(specs);
    let (w, _declared) = router_worker(&s, 4);
    let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
    for pair in views.chunks(2) {
        let (repaired, failed) = (&pair[0], &pair[1]);
        assert_eq!(repaired.status, TaskStatus::Completed, "{repaired:?}");
        assert_eq!(
            repaired.result_variables.as_ref().unwrap()["route"],
            json!({"decision": "refund"})
        );
        assert_eq!(
            repaired.journal[1]["data"]["outputRepair"]["reason"],
            "truncated"
        );
        let msg = incident(failed);
        assert!(msg.contains("cut by the output limit"), "{msg}");
        assert!(failed.result_variables.is_none());
    }
    for body in requests_of(&s, "cut-once")
        .iter()
        .filter(|b| b["messages"].as_array().unwrap().len() > 2)
    {
        let said = last_user_text(body);
        assert!(
            said.contains("cut off") && said.contains("shorter"),
            "{said}"
        );
    }
    assert!(metric(
        &w,
        r#"abada_agent_output_repairs_total{agent="router",reason="truncated"} 4"#
    ));
    assert!(metric(
        &w,
        r#"abada_agent_output_failures_total{agent="router",reason="truncated"} 2"#
    ));
    w.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn the_native_response_format_is_strict_only_when_the_schema_qualifies() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "*",
        Script::new(vec![Turn::text(
            r#"{"decision": "refund", "orderId": "o-1"}"#,
        )]),
    );
    let ids = s.engine.create_tasks([
        spec(agent("openai/strict", Some(strict_schema())), "o-1"),
        spec(agent("openai/loose", Some(routing_schema())), "o-1"),
        spec(agent("anthropic/claude", Some(strict_schema())), "o-1"),
    ]);
    let w = s.spawn_worker(WorkerOptions::new("w", 3), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
    assert!(views.iter().all(|v| v.status == TaskStatus::Completed));
    let system_of = |body: &Value| -> String {
        match body.get("system") {
            Some(Value::String(s)) => s.clone(),
            _ => body["messages"][0]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        }
    };
    let strict = &requests_of(&s, "strict")[0];
    assert_eq!(
        strict["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "router", "schema": strict_schema(), "strict": true}})
    );
    assert!(
        !system_of(strict).contains("JSON Schema"),
        "the provider enforces a strict schema: no instruction"
    );
    let loose = &requests_of(&s, "loose")[0];
    assert_eq!(loose["response_format"]["json_schema"]["strict"], false);
    assert_eq!(
        loose["response_format"]["json_schema"]["schema"],
        routing_schema()
    );
    assert!(
        system_of(loose).starts_with("You route refund requests.")
            && system_of(loose).contains(&routing_schema().to_string()),
        "{}",
        system_of(loose)
    );
    // Anthropic's Messages API (2023-06-01) has none: instructed, validated.
    let claude = &requests_of(&s, "claude")[0];
    assert!(claude.get("response_format").is_none() && claude.get("output_format").is_none());
    assert!(
        system_of(claude).contains(&strict_schema().to_string()),
        "{claude}"
    );
    // Without a schema nothing changes.
    w.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn a_resumed_run_sends_the_journaled_repair_turn_again() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "resumed",
        Script::new(vec![
            Turn::text("not json at all"),
            Turn::text(r#"{"decision": "escalate"}"#),
        ]),
    );
    let id = s.engine.create_task(spec(
        agent("anthropic/resumed", Some(routing_schema())),
        "o-1",
    ));
    // The repair call hangs once: the first worker stops inside it, after journaling the repair.
    s.model.inject_request_fault(
        "resumed",
        "not valid JSON",
        Fault::Hang(Duration::from_secs(30)),
        FaultTimes::Next(1),
    );
    let w1 = s.spawn_worker(WorkerOptions::new("w1", 1), Stack::fast_agent_settings());
    eventually(Duration::from_secs(20), "the repair call", async || {
        s.model.calls("resumed") >= 2
    })
    .await;
    w1.stop().await;
    let w2 = s.spawn_worker(WorkerOptions::new("w2", 1), Stack::fast_agent_settings());
    let view = &wait_all_ended(&s, &[id], Duration::from_secs(20)).await[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(
        view.result_variables.as_ref().unwrap()["route"],
        json!({"decision": "escalate"})
    );
    let requests = requests_of(&s, "resumed");
    assert!(requests.len() >= 3, "{}", requests.len());
    // The repair conversation the second worker sent is the one the first worker sent.
    let (first, resumed) = (&requests[1], &requests[requests.len() - 1]);
    assert_eq!(first["messages"], resumed["messages"]);
    assert!(last_user_text(resumed).contains("not valid JSON"));
    assert_eq!(
        step_kinds(view),
        ["input/finished", "model/finished", "model/finished"]
    );
    w2.stop().await;
    s.shutdown().await;
}

#[tokio::test]
async fn hostile_answers_and_schemas_stay_bounded() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // A huge answer (a 140 KB JSON string, over the 64 KiB cap), then non-JSON: both rejected, the second an incident.
    let huge = format!("\"{}\"", "h-".repeat(70_000));
    s.model.set_script(
        "huge",
        Script::new(vec![Turn::text(huge), Turn::text("h-h-h-h")]).with_usage(10, 10),
    );
    // A schema bomb: each level refers twice to the next (2^30 subschemas inlined).
    let mut defs = serde_json::Map::new();
    for i in 0..30 {
        let next = format!("#/$defs/l{}", i + 1);
        defs.insert(
            format!("l{i}"),
            json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
        );
    }
    defs.insert("l30".into(), json!({"type": "string"}));
    let bomb = json!({"$ref": "#/$defs/l0", "$defs": defs});
    let ids = s.engine.create_tasks([
        spec(agent("openai/huge", Some(routing_schema())), "o-1"),
        spec(agent("anthropic/bomb", Some(bomb)), "o-2"),
        spec(
            agent(
                "openai/remote",
                Some(json!({"$ref": "http://169.254.169.254/latest/schema.json"})),
            ),
            "o-3",
        ),
    ]);
    let w = s.spawn_worker(WorkerOptions::new("w", 3), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
    let msg = incident(&views[0]);
    assert!(msg.contains("not JSON"), "{msg}");
    let repair = views[0].journal[1]["data"]["outputRepair"].clone();
    assert_eq!(repair["reason"], "too_large");
    assert!(repair["message"].as_str().unwrap().len() < 512, "{repair}");
    let msg = incident(&views[1]);
    assert!(
        msg.contains("outputSchema has more than 500 subschemas"),
        "{msg}"
    );
    let msg = incident(&views[2]);
    assert!(
        msg.contains("outputSchema has $ref") && msg.contains("nothing is fetched"),
        "{msg}"
    );
    assert_eq!(s.model.calls("bomb") + s.model.calls("remote"), 0);
    w.stop().await;
    s.shutdown().await;
}
