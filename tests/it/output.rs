//! Structured output end to end, on both wire formats against the scripted
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
        // Each answer journaled before it was judged, then its verdict.
        assert_eq!(
            step_kinds(view),
            [
                "input/finished",
                "model/finished",
                "output/rejected",
                "model/finished",
                "output/accepted"
            ]
        );
        let repair = &view.journal[2]["data"];
        assert_eq!(repair["answerSeq"], 2, "{repair}");
        assert_eq!(repair["reason"], "schema", "{repair}");
        assert!(
            repair["message"].as_str().unwrap().contains("at /decision"),
            "{repair}"
        );
        assert_eq!(view.journal[4]["data"], json!({"answerSeq": 4}));
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
        // Both answers journaled, each with its verdict and repair message: a retry resumes
        // there.
        assert_eq!(
            step_kinds(view),
            [
                "input/finished",
                "model/finished",
                "output/rejected",
                "model/finished",
                "output/rejected"
            ]
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
        [
            "input/finished",
            "model/finished",
            "output/rejected",
            "model/finished",
            "output/accepted"
        ]
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

// ---- schemas the worker cannot bound, from every source --------------------------------------

/// The keywords the 1.8 KB chain was found to hide under: `dependencies` (the walker did not
/// know it: the schema was compiled, and reporting one error cost 3.1 GB at 20 levels), and
/// the other places a subschema may sit.
pub(crate) const HIDING_PLACES: [&str; 10] = [
    "dependencies",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "contains",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
];

/// The schema that crashed every replica in turn: a chain of `anyOf`s of two `$ref`s to the
/// next level, 24 levels deep (about 1.5 KB), used under `keyword` (`then` and `else` beside
/// an `if`, `additionalItems` beside an `items` array).
pub(crate) fn chain_under(keyword: &str) -> Value {
    let levels = 24;
    let mut defs = serde_json::Map::new();
    for i in 0..levels {
        let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
        defs.insert(format!("l{i}"), json!({"anyOf": [next.clone(), next]}));
    }
    defs.insert(format!("l{levels}"), json!({"type": "integer"}));
    let head = json!({"$ref": "#/$defs/l0"});
    let mut schema = match keyword {
        "dependencies" => json!({"type": "object", keyword: {"a": head}}),
        "then" | "else" => json!({"if": {"type": "object"}, keyword: head}),
        "additionalItems" => json!({"items": [{}], "additionalItems": head}),
        _ => json!({keyword: head}),
    };
    schema["$defs"] = Value::Object(defs);
    schema
}

/// Whether a refusal names where the chain hides: the keyword and its place (`/keyword`), or
/// the keyword refused outright.
pub(crate) fn names_the_place(message: &str, keyword: &str) -> bool {
    message.contains("outputSchema")
        && (message.contains(&format!("at /{keyword}"))
            || message.contains(&format!("uses {keyword:?}")))
}

/// From an agent/1 engine's `agent` field: every hiding place is refused when the definition is
/// read, an incident naming it, and no model is called. (Before: the `dependencies` chain was
/// accepted, and the model's answer validated: `{}` passes, so here it completed; an answer
/// that did not cost gigabytes.)
#[tokio::test]
async fn a_schema_hiding_an_any_of_chain_from_the_engine_is_refused_naming_where() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model
        .set_script("chained", Script::new(vec![Turn::text("{}")]));
    let ids = s.engine.create_tasks(
        HIDING_PLACES.map(|k| spec(agent("openai/chained", Some(chain_under(k))), "o-1")),
    );
    let w = s.spawn_worker(WorkerOptions::new("w", 4), Stack::fast_agent_settings());
    let views = wait_all_ended(&s, &ids, Duration::from_secs(30)).await;
    for (view, keyword) in views.iter().zip(HIDING_PLACES) {
        let msg = incident(view);
        assert!(names_the_place(&msg, keyword), "{keyword}: {msg}");
        assert!(msg.contains("\"router\""), "{msg}");
    }
    assert_eq!(s.model.calls("chained"), 0);
    w.stop().await;
    s.shutdown().await;
}

/// From the agents file: the worker does not start (exit code 2, before any call to the
/// engine), and says which agent, which keyword, where.
#[tokio::test]
async fn a_schema_hiding_an_any_of_chain_in_the_agents_file_stops_the_start_naming_where() {
    use crate::support::process::{WorkerProcess, stack_env};
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = crate::support::scratch::ScratchDir::new("schema-chains");
    for keyword in HIDING_PLACES {
        let mut router = agent("openai/chained", Some(chain_under(keyword)));
        router.as_object_mut().unwrap().remove("name");
        let text = toml::to_string(&json!({"agents": {"router": router}})).unwrap();
        let file = dir.write(&format!("{keyword}.toml"), &text);
        let mut env = stack_env(&s, "w-file");
        env.push((
            abada_agent_worker::config::ENV_AGENTS_FILE.into(),
            file.display().to_string(),
        ));
        let mut worker = WorkerProcess::spawn_raw(&[], &env);
        let exit = worker.wait(Duration::from_secs(20)).await;
        // The reader of the pipe may lag the exit a little.
        let mut stderr = String::new();
        for _ in 0..500 {
            stderr = worker.stderr().join("\n");
            if stderr.contains("configuration error") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(exit.code(), Some(2), "{keyword}: {exit} {stderr}");
        assert!(
            stderr.contains("configuration error")
                && stderr.contains("router")
                && names_the_place(&stderr, keyword),
            "{keyword}: {stderr}"
        );
    }
    assert!(s.engine.calls().is_empty(), "nothing was fetched");
    s.shutdown().await;
}

// ---- judging journaled: no crash loop ----------------------------------------------------------

/// A journal step as JSON, for the emulator's `seed_journal`.
fn step(seq: u64, kind: &str, state: &str, data: Value) -> Value {
    json!({"seq": seq, "kind": kind, "state": state, "data": data})
}

/// Steps 1 and 2 of a run whose model answered `answer` as its final answer: journaled by an
/// earlier attempt before it was judged.
fn answered(answer: &str) -> Vec<Value> {
    vec![
        step(
            1,
            "input",
            "finished",
            json!({"instructions": "You route refund requests.", "input": "Order o-1"}),
        ),
        step(
            2,
            "model",
            "finished",
            json!({"model": "openai/judged", "message": {"text": answer, "toolCalls": []},
                   "usage": {"inputTokens": 10, "outputTokens": 5}, "stopReason": "stop"}),
        ),
    ]
}

/// An attempt that died while validating left the answer journaled without a verdict: the next
/// attempt does not pay the model again. It journals that it judges once more, then the
/// verdict, then completes with the answer. (Before, the answer was journaled only after it was
/// judged: a crash while validating lost it, and every attempt paid the model again.)
#[tokio::test]
async fn an_answer_journaled_before_its_verdict_is_judged_again_without_a_model_call() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = s
        .engine
        .create_task(spec(agent("openai/judged", Some(routing_schema())), "o-1"));
    s.engine
        .seed_journal(&id, answered(r#"{"decision": "refund"}"#));
    let w = s.spawn_worker(WorkerOptions::new("w", 1), Stack::fast_agent_settings());
    let view = &wait_all_ended(&s, std::slice::from_ref(&id), Duration::from_secs(20)).await[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(
        view.result_variables.as_ref().unwrap()["route"],
        json!({"decision": "refund"})
    );
    assert_eq!(
        step_kinds(view),
        [
            "input/finished",
            "model/finished",
            "output/judging",
            "output/accepted"
        ]
    );
    assert_eq!(view.journal[2]["data"], json!({"answerSeq": 2, "pass": 2}));
    assert_eq!(s.model.calls("judged"), 0);
    w.stop().await;
    s.shutdown().await;
}

/// The crash loop, made: two attempts began judging the answer and neither finished (the
/// answer's own step, then an `output/judging`). The third does not validate a third time: an
/// incident (retries 0) naming the agent and the schema, `output/unfinished` journaled, no
/// model call. A retry of the incident gets its passes again: here the answer is fine, and the
/// task completes. (Before, the journal's new steps did not exist: every attempt validated
/// again, and crashed again.)
#[tokio::test]
async fn an_answer_whose_judging_never_finished_twice_is_an_incident_not_a_third_crash() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = s
        .engine
        .create_task(spec(agent("openai/judged", Some(routing_schema())), "o-1"));
    let mut steps = answered(r#"{"decision": "refund"}"#);
    steps.push(step(
        3,
        "output",
        "judging",
        json!({"answerSeq": 2, "pass": 2}),
    ));
    s.engine.seed_journal(&id, steps);
    let w = s.spawn_worker(WorkerOptions::new("w", 1), Stack::fast_agent_settings());
    let view = &wait_all_ended(&s, std::slice::from_ref(&id), Duration::from_secs(20)).await[0];
    let msg = incident(view);
    assert!(
        msg.contains("agent \"router\"")
            && msg.contains("outputSchema of agent \"router\"")
            && msg.contains("sha256")
            && msg.contains("began 2 times and never finished"),
        "{msg}"
    );
    assert_eq!(
        step_kinds(view).last().map(String::as_str),
        Some("output/unfinished")
    );
    assert_eq!(s.model.calls("judged"), 0);

    // An operator retries it: two passes again; this one finishes.
    assert!(s.engine.set_retries(&id, 1));
    let view = &wait_all_ended(&s, std::slice::from_ref(&id), Duration::from_secs(20)).await[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(
        &step_kinds(view)[3..],
        ["output/unfinished", "output/judging", "output/accepted"]
    );
    assert_eq!(s.model.calls("judged"), 0);
    w.stop().await;
    s.shutdown().await;
}
