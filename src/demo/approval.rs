//! Scenario `approval` (issue 14): the worked example's process (`examples/refund-approval.bpmn`,
//! run by the emulator as `ProcessModel::refund_approval`) with a refund agent whose writes wait
//! for a person, its conversation kept in the PostgreSQL run store that `ABADA_AGENT_STORE_URL`
//! names. One refund is approved by a named person in the user task "Approve refund" and applied
//! once, with no model call before the stop paid again; one is refused, and the model explains
//! the refusal to the customer; the write is never performed.

use std::time::Duration;

use serde_json::{Map, Value, json};

use super::timeline::{Output, Timeline};
use super::{Check, Crew, DemoError, DemoReport, DemoStore, pump};
use crate::devkit::engine::{InstanceStatus, ProcessInstanceView, ProcessModel, ProtocolLevel};
use crate::devkit::model::{Script, Turn};
use crate::devkit::stack::{REFUND_MODEL, Stack, StackWorkers, WorkerOptions};

const SCENARIO: &str = "approval";
const LIMIT: Duration = Duration::from_secs(30);
/// The user task's candidate group in the worked example.
const APPROVERS: &str = "refund-approvers";

/// Look the order up, ask for the refund saying why (the request's `summary`), then answer the
/// customer with what the last tool said: the refund, or who refused it and why.
fn approval_script() -> Script {
    Script::new(vec![
        Turn::call("lookup_order", json!({"orderId": "${input}"})),
        Turn::say_and_call(
            "Order ${input} arrived damaged: I will refund 1500 cents to the customer.",
            "issue_refund",
            json!({"orderId": "${input}", "amountCents": 1500, "reason": "damaged"}),
        ),
        Turn::text("Dear customer, about your order ${input}: ${last_tool_result}"),
    ])
    .with_usage(120, 30)
    .with_latency(Duration::from_millis(100))
}

pub(super) async fn run(output: Output, store: &DemoStore) -> Result<DemoReport, DemoError> {
    let stack = Stack::start(ProtocolLevel::AgentV1).await?;
    stack.model.set_script(REFUND_MODEL, approval_script());
    let result = scenario(&stack, store, output).await;
    stack.shutdown().await;
    result
}

/// One refund's story: what the demo saw of it.
struct Path {
    instance: String,
    order: String,
    request: Value,
    done: ProcessInstanceView,
}

async fn scenario(
    stack: &Stack,
    store: &DemoStore,
    output: Output,
) -> Result<DemoReport, DemoError> {
    let mut tl = Timeline::new(output);
    let mut agent = stack.refund_agent(&format!("openai/{REFUND_MODEL}"), &[]);
    agent["approval"] = json!("writes");
    stack
        .engine
        .deploy(ProcessModel::refund_approval(Some(agent)));
    tl.emit(
        "engine",
        "deployed",
        "deploys refundApproval (examples/refund-approval.bpmn): agent node -> gateway on \
         agentStatus -> user task \"Approve refund\" (refund-approvers) -> back to the agent",
        json!({"process": "refundApproval"}),
    );
    tl.emit(
        "demo",
        "agent",
        "refund-agent: approval = \"writes\" (issue_refund waits for a person, lookup_order is read-only)",
        json!({"approval": "writes"}),
    );
    let mut opts = WorkerOptions::new("W1", 2);
    opts.env = vec![("ABADA_AGENT_STORE_URL".into(), store.url.clone())];
    let mut crew = Crew::new();
    crew.add(stack.spawn_worker(opts, Stack::fast_agent_settings()));
    tl.emit(
        "demo",
        "worker_started",
        format!("W1 starts (2 slots, run store {})", store.redacted()),
        json!({"worker": "W1"}),
    );

    let approved = decided_path(
        stack,
        &mut tl,
        &mut crew,
        "o-2001",
        "dana",
        true,
        "fine, a damaged parcel",
    )
    .await?;
    let refused = decided_path(
        stack,
        &mut tl,
        &mut crew,
        "o-2002",
        "erin",
        false,
        "the customer was already refunded for this order",
    )
    .await?;
    let workers = crew.stop().await;

    let mut checks = Vec::new();
    let model_calls = |order: &str| model_calls_for(stack, order);
    let writes = |order: &str| {
        stack
            .tools
            .calls()
            .into_iter()
            .filter(|c| c.tool == "issue_refund" && c.arguments["orderId"] == order)
            .collect::<Vec<_>>()
    };
    // Approved.
    let a = &approved;
    checks.push(Check::new(
        "approved: the agent stopped with approval-required and a request with the model's summary",
        a.request["tool"] == "issue_refund"
            && a.request["summary"]
                .as_str()
                .is_some_and(|s| s.contains("1500 cents"))
            && a.request["runKey"] == format!("process/{}/refundAgent", a.instance).as_str(),
        format!("request {}", a.request),
    ));
    let a_writes = writes(&a.order);
    checks.push(Check::new(
        "approved: the write was performed exactly once, keyed",
        a_writes.len() == 1 && a_writes[0].idempotency_key.is_some(),
        format!("issue_refund calls for {}: {}", a.order, a_writes.len()),
    ));
    let a_calls = model_calls(&a.order);
    checks.push(Check::new(
        "approved: no model call before the approval was paid again",
        a_calls == 3,
        format!("{a_calls} model calls: lookup, the refund asked for, the answer after the write"),
    ));
    checks.push(Check::new(
        "approved: the process ended with agentStatus done",
        a.done.variables["agentStatus"] == "done"
            && a.done.variables["agentApproval"]["decidedBy"] == "dana",
        format!(
            "agentStatus {}, decided by {}",
            a.done.variables["agentStatus"], a.done.variables["agentApproval"]["decidedBy"]
        ),
    ));
    // Refused.
    let r = &refused;
    let r_writes = writes(&r.order);
    checks.push(Check::new(
        "refused: the write was never performed",
        r_writes.is_empty(),
        format!("issue_refund calls for {}: {}", r.order, r_writes.len()),
    ));
    let answer = r.done.variables["refundDecision"].to_string();
    checks.push(Check::new(
        "refused: the model told the customer who refused and why",
        answer.contains("erin refused it") && answer.contains("already refunded"),
        format!("answer {answer}"),
    ));
    let r_calls = model_calls(&r.order);
    checks.push(Check::new(
        "refused: the process ended with agentStatus done, no model call paid again",
        r.done.variables["agentStatus"] == "done" && r_calls == 3,
        format!(
            "agentStatus {}, {r_calls} model calls",
            r.done.variables["agentStatus"]
        ),
    ));
    let counters = stack.tools.counters().await;
    checks.push(Check::new(
        "the tool server applied one refund in all",
        counters.writes_applied == 1 && counters.duplicates == 0,
        format!(
            "{} applied, {} duplicates",
            counters.writes_applied, counters.duplicates
        ),
    ));
    let facts = json!({
        "approved": {"instance": a.instance, "request": a.request, "modelCalls": a_calls,
                     "writes": a_writes.len(), "result": a.done.variables["refundDecision"]},
        "refused": {"instance": r.instance, "request": r.request, "modelCalls": r_calls,
                    "writes": r_writes.len(), "result": r.done.variables["refundDecision"]},
        "store": store.redacted(),
        "writesApplied": counters.writes_applied,
    });
    let wall_seconds = (tl.seconds() * 10.0).round() / 10.0;
    Ok(DemoReport {
        scenario: SCENARIO,
        events: tl.into_events(),
        workers: workers.into_iter().map(|w| w.stats).collect(),
        checks,
        facts,
        wall_seconds,
    })
}

/// Model calls whose conversation is about `order` (its input).
fn model_calls_for(stack: &Stack, order: &str) -> usize {
    stack
        .model
        .requests()
        .iter()
        .filter(|r| {
            r.body["messages"].as_array().is_some_and(|m| {
                m.iter()
                    .any(|m| m["role"] == "user" && m["content"] == order)
            })
        })
        .count()
}

/// Starts a refund for `order`, waits for the user task, completes it as `user` with
/// `approved` and `comment` through the engine's user-task API, and waits for the end.
async fn decided_path(
    stack: &Stack,
    tl: &mut Timeline,
    crew: &mut Crew,
    order: &str,
    user: &str,
    approved: bool,
    comment: &str,
) -> Result<Path, DemoError> {
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    let instance = stack
        .engine
        .start_process("refundApproval", variables)
        .map_err(|e| DemoError::Setup(format!("cannot start refundApproval: {e:?}")))?;
    tl.emit(
        "engine",
        "instance_started",
        format!("starts {instance}: refund order {order}"),
        json!({"instance": instance, "order": order}),
    );
    let engine = stack.engine.clone();
    let id = instance.clone();
    let waiting = pump(
        tl,
        crew,
        engine.wait_for(move |e| {
            e.process_instance(&id)
                .filter(|v| v.current_activity_id == "approveRefund")
        }),
        SCENARIO,
        "the user task \"Approve refund\"",
        LIMIT,
    )
    .await?;
    let request = waiting.variables["agentApprovalRequest"].clone();
    tl.emit(
        "W1",
        "approval_required",
        format!(
            "completes with agentStatus={}: {} {} waits; summary: {}",
            waiting.variables["agentStatus"],
            request["tool"],
            request["arguments"],
            request["summary"]
        ),
        json!({"instance": instance, "request": request}),
    );
    tl.emit(
        "engine",
        "user_task",
        format!("{instance} waits in the user task \"Approve refund\" (group {APPROVERS})"),
        json!({"instance": instance}),
    );
    complete_user_task(stack, &instance, user, approved, comment).await?;
    tl.emit(
        "demo",
        "decided",
        format!(
            "{user} {} it in the user task{}",
            if approved { "approves" } else { "refuses" },
            format_args!(": \"{comment}\"")
        ),
        json!({"instance": instance, "decidedBy": user, "approved": approved}),
    );
    let id = instance.clone();
    let done = pump(
        tl,
        crew,
        engine.wait_for(move |e| {
            e.process_instance(&id)
                .filter(|v| v.status == InstanceStatus::Completed)
        }),
        SCENARIO,
        "the process to end",
        LIMIT,
    )
    .await?;
    tl.emit(
        "engine",
        "instance_done",
        format!(
            "{instance} ended: agentStatus={}, refundDecision {}",
            done.variables["agentStatus"], done.variables["refundDecision"]
        ),
        json!({"instance": instance}),
    );
    Ok(Path {
        instance,
        order: order.to_string(),
        request,
        done,
    })
}

/// The person's decision, as a task list would send it: list the tasks of the approvers'
/// group, take the instance's, complete it with `agentApproval`.
async fn complete_user_task(
    stack: &Stack,
    instance: &str,
    user: &str,
    approved: bool,
    comment: &str,
) -> Result<(), DemoError> {
    let http = reqwest::Client::new();
    let api = stack.engine.base_url();
    let fail = |what: &str, e: String| DemoError::Setup(format!("the user task API: {what}: {e}"));
    let tasks: Vec<Value> = http
        .get(format!("{api}/v1/tasks?status=AVAILABLE"))
        .header("X-User", user)
        .header("X-Groups", APPROVERS)
        .send()
        .await
        .map_err(|e| fail("listing the tasks", e.to_string()))?
        .json()
        .await
        .map_err(|e| fail("listing the tasks", e.to_string()))?;
    let task = tasks
        .iter()
        .find(|t| t["processInstanceId"] == instance)
        .ok_or_else(|| {
            fail(
                "listing the tasks",
                format!("no task of {instance} for {user}"),
            )
        })?;
    let decision = json!({"agentApproval": {
        "callId": task["variables"]["agentApprovalRequest"]["callId"],
        "approved": approved, "comment": comment, "decidedBy": user}});
    let response = http
        .post(format!(
            "{api}/v1/tasks/complete?taskId={}",
            task["id"].as_str().unwrap_or_default()
        ))
        .header("X-User", user)
        .header("X-Groups", APPROVERS)
        .json(&decision)
        .send()
        .await
        .map_err(|e| fail("completing the task", e.to_string()))?;
    if !response.status().is_success() {
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        return Err(fail("completing the task", format!("{status}: {body}")));
    }
    Ok(())
}
