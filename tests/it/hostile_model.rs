//! The fault suite's hostile model: a scripted model that answers with hundreds of
//! tool calls, never stops calling tools, writes without end, invents a tool name each turn,
//! reports no usage or absurd usage, or is slower than the task's deadline. Every task ends in a
//! bounded, named outcome (an incident naming the limit and its value, or a completion), nothing
//! of an over-limit answer is performed, no new metric series appears, and the invariant checker
//! holds. The table is in `docs/FAULTS.md` ("Limits").

use std::time::Duration;

use abada_agent_worker::agent::AgentSettings;
use abada_agent_worker::devkit::engine::{Disposition, Operation, TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{Script, ScriptedCall, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Map, Value, json};

use crate::faults::{finish, stack, wait_tasks, worker};
use crate::support::invariants::{Expect, Recorder};

/// One task on `model` with its order `order`, the refund agent's definition changed by `edit`.
fn task(s: &Stack, order: &str, model: &str, edit: Value) -> String {
    let mut agent = s.refund_agent(model, &[]);
    if let (Some(a), Some(e)) = (agent.as_object_mut(), edit.as_object()) {
        for (k, v) in e {
            a.insert(k.clone(), v.clone());
        }
    }
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    s.engine
        .create_tasks([TaskSpec {
            variables,
            agent: Some(agent),
            retries: Some(3),
            ..TaskSpec::default()
        }])
        .remove(0)
}

/// The fault suite's fast retries with the default tool timeouts: no case here has a slow tool,
/// and the exact call counts must not depend on how fast a loaded machine answers one.
fn settings() -> AgentSettings {
    Stack::fast_agent_settings()
}

/// Leases long enough that no heartbeat is ever late enough to lose one, on a starved process.
const LOCK: Duration = Duration::from_secs(30);

/// How long the `slow` model takes to answer: far past the 700 ms deadline of the task that
/// uses it, so a task ended at its deadline is told from one ended by the model's answer.
const SLOW_MODEL: Duration = Duration::from_secs(5);

fn refund(order: &str) -> Value {
    json!({"orderId": order, "amountCents": 100, "reason": "hostile"})
}

/// Tool calls the server received for an order starting with `order`.
fn calls_for(s: &Stack, order: &str) -> usize {
    s.tools
        .calls()
        .iter()
        .filter(|c| {
            c.arguments
                .get("orderId")
                .and_then(Value::as_str)
                .is_some_and(|o| o.starts_with(order))
        })
        .count()
}

fn incident_message(t: &TaskView) -> String {
    assert_eq!(t.status, TaskStatus::Failed, "task {} is an incident", t.id);
    assert_eq!(
        t.retries,
        Some(0),
        "task {}: an incident keeps no retry",
        t.id
    );
    t.error_message.clone().unwrap_or_default()
}

fn model_steps(t: &TaskView) -> Vec<&Value> {
    t.journal.iter().filter(|s| s["kind"] == "model").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_model_ends_every_task_in_a_named_bounded_outcome() {
    let s = stack().await;
    let m = &s.model;
    let endless =
        |tool: &str, args: Value| Script::new(vec![Turn::call(tool, args)]).with_usage(100, 10);
    m.set_script(
        "flood",
        Script::new(vec![Turn::ToolCalls(
            (0..300)
                .map(|_| ScriptedCall {
                    tool: "issue_refund".into(),
                    arguments: refund("flood-1"),
                })
                .collect(),
        )])
        .with_usage(100, 10),
    );
    m.set_script(
        "endless",
        endless("lookup_order", json!({"orderId": "${input}"})),
    );
    m.set_script(
        "busy",
        endless("lookup_order", json!({"orderId": "${input}"})),
    );
    // A new order each call: the checker's "one key per order" holds, the count is the point.
    m.set_script(
        "writer",
        endless("issue_refund", refund("writer-${call_index}")),
    );
    let mut inventions: Vec<Turn> = (1..=6)
        .map(|i| Turn::call(format!("invented_tool_{i}"), json!({"orderId": "${input}"})))
        .collect();
    inventions.push(Turn::text(r#"{"decision": "none"}"#));
    m.set_script("inventor", Script::new(inventions).with_usage(100, 10));
    m.set_script(
        "nousage",
        Script::new(vec![Turn::call(
            "lookup_order",
            json!({"orderId": "${input}"}),
        )])
        .without_usage(),
    );
    m.set_script(
        "overflow",
        endless("lookup_order", json!({"orderId": "${input}"})).with_usage(u64::MAX, u64::MAX),
    );
    m.set_script(
        "overflow-nobudget",
        Script::new(vec![
            Turn::call("lookup_order", json!({"orderId": "${input}"})),
            Turn::text(r#"{"decision": "none"}"#),
        ])
        .with_usage(u64::MAX, u64::MAX),
    );
    m.set_script(
        "slow",
        endless("lookup_order", json!({"orderId": "${input}"})).with_latency(SLOW_MODEL),
    );
    m.set_script("capped", abada_agent_worker::devkit::stack::refund_script());

    let flood = task(&s, "flood-1", "openai/flood", json!({}));
    let endless_id = task(&s, "endless-1", "openai/endless", json!({"maxTurns": 8}));
    let busy = task(
        &s,
        "busy-1",
        "openai/busy",
        json!({"maxTurns": 50, "maxToolCalls": 5}),
    );
    let writer = task(
        &s,
        "writer-1",
        "openai/writer",
        json!({"maxTurns": 50, "maxKeyedWrites": 3}),
    );
    let inventor = task(&s, "inventor-1", "openai/inventor", json!({}));
    let nousage = task(
        &s,
        "nousage-1",
        "openai/nousage",
        json!({"maxTurns": 100, "maxToolCalls": 100, "tokenBudget": 6000}),
    );
    let overflow = task(
        &s,
        "overflow-1",
        "anthropic/overflow",
        json!({"tokenBudget": 40000}),
    );
    let overflow_free = task(&s, "overflow-2", "openai/overflow-nobudget", json!({}));
    let slow = task(&s, "slow-1", "openai/slow", json!({"maxDurationMs": 700}));
    let capped = task(
        &s,
        "capped-1",
        "openai/capped",
        json!({"tokenBudget": 40000}),
    );
    let capped_a = task(
        &s,
        "capped-2",
        "anthropic/capped",
        json!({"tokenBudget": 40000, "maxOutputTokens": 1000}),
    );
    let all = vec![
        flood.clone(),
        endless_id.clone(),
        busy.clone(),
        writer.clone(),
        inventor.clone(),
        nousage.clone(),
        overflow.clone(),
        overflow_free.clone(),
        slow.clone(),
        capped.clone(),
        capped_a.clone(),
    ];
    let w = worker(&s, "w-hostile", 4, LOCK, settings());
    let metrics = w.0.metrics.clone();
    let views = wait_tasks(&s, &all, "every hostile task to end", |t| {
        matches!(t.status, TaskStatus::Completed | TaskStatus::Failed)
    })
    .await;
    let view = |id: &str| views.iter().find(|v| v.id == id).expect("a view per task");

    // 300 tool calls in one answer: none performed, the answer not even journaled.
    let msg = incident_message(view(&flood));
    assert!(msg.contains("maxToolCallsPerAnswer = 16"), "{msg}");
    assert!(msg.contains("300 tool calls"), "{msg}");
    assert_eq!(calls_for(&s, "flood-1"), 0, "nothing of the answer ran");
    assert!(model_steps(view(&flood)).is_empty());

    // Endless turns: maxTurns, after exactly that many model answers.
    let msg = incident_message(view(&endless_id));
    assert!(msg.contains("maxTurns = 8"), "{msg}");
    assert_eq!(model_steps(view(&endless_id)).len(), 8);
    assert_eq!(calls_for(&s, "endless-1"), 8);

    // Tool calls per task: five performed, the sixth answer refused whole.
    let msg = incident_message(view(&busy));
    assert!(msg.contains("maxToolCalls = 5"), "{msg}");
    assert_eq!(calls_for(&s, "busy-1"), 5);

    // Keyed writes per task.
    let msg = incident_message(view(&writer));
    assert!(msg.contains("maxKeyedWrites = 3"), "{msg}");
    assert_eq!(calls_for(&s, "writer-"), 3);

    // Invented tool names: answered as errors, completed, and no new series.
    assert_eq!(view(&inventor).status, TaskStatus::Completed);
    let text = metrics.encode();
    assert!(
        !text.contains("invented"),
        "no series for invented tools:\n{text}"
    );
    assert!(
        text.contains(
            r#"abada_agent_tool_calls_total{server="other",tool="other",outcome="unknown_tool"} 6"#
        ),
        "{text}"
    );

    // No usage reported: estimates are journaled and spend the budget.
    let t = view(&nousage);
    let msg = incident_message(t);
    assert!(msg.contains("tokenBudget = 6000"), "{msg}");
    let steps = model_steps(t);
    assert!(!steps.is_empty());
    for step in &steps {
        assert_eq!(step["data"]["usageEstimated"], true, "{step}");
        assert!(step["data"]["usage"]["inputTokens"].as_u64().unwrap() > 0);
        assert!(step["data"]["usage"]["outputTokens"].as_u64().unwrap() > 0);
    }

    // Absurd usage: saturates, the budget stops the next call; without a budget it completes.
    let msg = incident_message(view(&overflow));
    assert!(msg.contains("tokenBudget = 40000"), "{msg}");
    assert_eq!(model_steps(view(&overflow)).len(), 1);
    let done = view(&overflow_free);
    assert_eq!(done.status, TaskStatus::Completed);
    let usage = &done.result_variables.as_ref().unwrap()["agentUsage"];
    assert_eq!(
        usage["inputTokens"],
        json!(u64::MAX),
        "saturated, not wrapped"
    );

    // Slower than the deadline: maxDurationMs ends it while the model call is in flight. Timed
    // on the emulator's clock from the fetch that handed the task out to its failure report:
    // not before the 700 ms, and before the model's first answer (SLOW_MODEL) could come (a
    // hang guard: the exact instant, 700 ms after the attempt started to the millisecond, is
    // held on the paused clock by
    // `paused_agent::max_duration_ends_the_task_at_its_deadline_not_at_the_next_answer`).
    let msg = incident_message(view(&slow));
    assert!(msg.contains("maxDurationMs = 700"), "{msg}");
    let calls = s.engine.calls();
    let fetched = calls
        .iter()
        .find(|c| c.operation == Operation::FetchAndLock && c.task_ids.contains(&slow))
        .expect("the slow task was fetched")
        .at;
    let failed = calls
        .iter()
        .find(|c| {
            c.operation == Operation::Failure
                && c.task_id.as_deref() == Some(slow.as_str())
                && c.disposition == Disposition::Executed
        })
        .expect("the slow task's failure")
        .at;
    let ran = (failed - fetched).to_std().unwrap_or_default();
    assert!(
        ran >= Duration::from_millis(700) && ran < SLOW_MODEL,
        "the task with maxDurationMs = 700 ended {ran:?} after it was fetched (its model answers after {SLOW_MODEL:?})"
    );

    // The output cap is maxOutputTokens, not the budget (40000).
    assert_eq!(view(&capped).status, TaskStatus::Completed);
    assert_eq!(view(&capped_a).status, TaskStatus::Completed);
    let requests = s.model.requests();
    let caps: Vec<(String, Value)> = requests
        .iter()
        .filter(|r| r.model == "capped")
        .map(|r| {
            let cap = r
                .body
                .get("max_completion_tokens")
                .or_else(|| r.body.get("max_tokens"))
                .cloned()
                .unwrap_or(Value::Null);
            (format!("{:?}", r.format), cap)
        })
        .collect();
    assert!(caps.len() >= 6, "{caps:?}");
    for (format, cap) in &caps {
        let expected = if format == "OpenAi" { 4096 } else { 1000 };
        assert_eq!(cap, &json!(expected), "{format}: {caps:?}");
    }

    finish(&s, vec![w], Expect::default(), "hostile model").await;
}

/// Limits count the journal: an attempt that resumes a task gets what is left, not a fresh
/// allowance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_task_gets_no_fresh_allowance() {
    let s = stack().await;
    s.model.set_script(
        "again",
        Script::new(vec![Turn::call(
            "lookup_order",
            json!({"orderId": "${input}"}),
        )])
        .with_usage(100, 10)
        .with_latency(Duration::from_millis(300)),
    );
    let id = task(
        &s,
        "again-1",
        "openai/again",
        json!({"maxTurns": 50, "maxToolCalls": 4}),
    );
    // The first worker shuts down while the task runs (after its second model answer), with no
    // grace: the task is released at its next step. The second resumes it from the journal and
    // may make only what is left of the four calls.
    let mut opts = WorkerOptions::new("w-first", 1);
    opts.lock_duration = LOCK;
    opts.poll_interval = Duration::from_millis(100);
    opts.shutdown_grace = Duration::ZERO;
    let mut handle = s.spawn_worker(opts, settings());
    let recorder = Recorder::attach(&s.engine, &mut handle, 1);
    let first = (handle, recorder);
    crate::support::wait::eventually(
        Duration::from_secs(30),
        "two model answers journaled",
        async || {
            s.engine
                .task(&id)
                .is_some_and(|t| model_steps(&t).len() >= 2)
        },
    )
    .await;
    first.0.shutdown.cancel();
    let second = worker(&s, "w-second", 1, LOCK, settings());
    let views = wait_tasks(&s, std::slice::from_ref(&id), "the task to end", |t| {
        t.status == TaskStatus::Failed
    })
    .await;
    let msg = incident_message(&views[0]);
    assert!(views[0].attempt >= 2, "the second worker resumed it");
    assert!(msg.contains("maxToolCalls = 4"), "{msg}");
    // Four calls asked for and journaled across both attempts, the fifth answer refused. The
    // server may have seen one more: a read-only call in flight at the release has no result in
    // the journal and is made again (unkeyed reads are safe to repeat).
    let t = &views[0];
    assert_eq!(model_steps(t).len(), 4);
    let results = t
        .journal
        .iter()
        .filter(|s| s["kind"] == "tool" && s["state"] == "finished")
        .count();
    assert_eq!(results, 4, "across both attempts");
    assert!((4..=5).contains(&calls_for(&s, "again-1")));
    let released = s.engine.calls().iter().any(|c| {
        c.operation == abada_agent_worker::devkit::engine::Operation::Failure
            && c.worker_id.as_deref() == Some("w-first")
    });
    assert!(released, "the first worker released the task");
    finish(&s, vec![first, second], Expect::default(), "resumed limits").await;
}
