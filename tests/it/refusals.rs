//! No task loops forever: every report the engine refuses for good ends its
//! task once, with the engine's message, instead of being left to expire and run again. The
//! engine emulator refuses as the real engine 0.11 does (docs/REAL_ENGINE.md): a top-level
//! `null` variable is a 500, a completion on a suspended or ended instance a 400 that is not a
//! lost lease, a gateway that routes nowhere a 400. Each scenario ends with the invariant
//! checker of the fault suite. docs/OPERATIONS.md "How a task ends" states the rules.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{
    Disposition, Fault, InstanceAction, Operation, ProtocolLevel, TaskSpec, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use abada_agent_worker::engine::{BpmnErrorReport, Task};
use abada_agent_worker::handler::{Outcome, TaskContext, TaskEnd, TaskHandler};
use abada_agent_worker::runner::RunnerEvent;
use async_trait::async_trait;
use serde_json::{Map, Value, json};

use crate::support::emulator_worker::{self, spawn_worker};
use crate::support::invariants::{Expect, Recorder, check_invariants};

/// A hang guard for each wait (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(30);

/// The workers' lock duration. Nothing here waits for a lease to run out (the emulator's clock
/// is moved instead), so it is long: a heartbeat delayed on a loaded machine must not lose a
/// lease, which every scenario checks never happens.
const LOCK: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    crate::support::emulator_worker::within_for(LIMIT, what, fut).await
}

fn task(stack: &Stack, model: &str, instance: &str) -> TaskSpec {
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(format!("o-{instance}")));
    TaskSpec {
        variables,
        agent: Some(stack.refund_agent(model, &[])),
        retries: Some(3),
        process_instance_id: Some(instance.into()),
        ..TaskSpec::default()
    }
}

async fn wait_status(stack: &Stack, id: &str, status: TaskStatus) -> TaskView {
    within(&format!("task {id} to be {status:?}"), async {
        stack
            .engine
            .wait_for(|e| e.task(id).filter(|t| t.status == status))
            .await
    })
    .await
}

/// The calls of `op` about `id`.
fn calls(
    stack: &Stack,
    op: Operation,
    id: &str,
) -> Vec<abada_agent_worker::devkit::engine::CallRecord> {
    stack
        .engine
        .calls()
        .into_iter()
        .filter(|c| c.operation == op && c.task_id.as_deref() == Some(id))
        .collect()
}

/// After the leases the worker held would have expired, the worker fetches again and gets
/// nothing: the ended tasks are not run again.
async fn nothing_runs_again(stack: &Stack, recorder: &Recorder) {
    stack.engine.advance(Duration::from_secs(600));
    let seen = recorder.events().len();
    within(
        "two more fetches",
        recorder.wait_until(|ev| {
            ev[seen.min(ev.len())..]
                .iter()
                .filter(|e| matches!(e, RunnerEvent::Fetched { .. }))
                .count()
                >= 2
        }),
    )
    .await;
}

/// A model whose final answer is JSON `null`: the engine cannot store it (500, task left
/// locked), so the worker sends no completion at all and ends the task once as an incident that
/// names the variable. A final answer with nested nulls is stored as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_final_answer_ends_its_task_once_as_an_incident() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    s.model.set_script(
        "null-answer",
        Script::new(vec![Turn::text("null")]).with_usage(10, 2),
    );
    s.model.set_script(
        "nested-null",
        Script::new(vec![Turn::text(
            r#"{"decision": "refunded", "note": null}"#,
        )])
        .with_usage(10, 2),
    );
    let null = s
        .engine
        .create_task(task(&s, "openai/null-answer", "p-null"));
    let nested = s
        .engine
        .create_task(task(&s, "openai/nested-null", "p-nested"));
    let mut opts = WorkerOptions::new("w-null", 2);
    opts.lock_duration = LOCK;
    opts.poll_interval = Duration::from_millis(100);
    let mut handle = s.spawn_worker(opts, Stack::fast_agent_settings());
    let recorder = Recorder::attach(&s.engine, &mut handle, 2);

    let view = wait_status(&s, &null, TaskStatus::Failed).await;
    assert_eq!(view.retries, Some(0), "an incident");
    let message = view.error_message.unwrap();
    assert!(
        message.contains("`refundDecision`") && message.contains("JSON null"),
        "{message}"
    );
    let done = wait_status(&s, &nested, TaskStatus::Completed).await;
    assert_eq!(
        done.result_variables.unwrap()["refundDecision"],
        json!({"decision": "refunded", "note": null})
    );
    nothing_runs_again(&s, &recorder).await;
    let view = s.engine.task(&null).unwrap();
    assert_eq!(view.status, TaskStatus::Failed);
    assert_eq!(view.counters.acquisitions, 1, "never run again");
    assert!(
        calls(&s, Operation::Complete, &null).is_empty(),
        "no completion sent"
    );
    assert_eq!(calls(&s, Operation::Failure, &null).len(), 1, "one report");
    assert_eq!(s.model.calls("null-answer"), 1, "the model paid once");
    let ended: Vec<TaskEnd> = recorder
        .events()
        .into_iter()
        .filter_map(|e| match e {
            RunnerEvent::TaskEnded {
                task_id, outcome, ..
            } if task_id == null => Some(outcome),
            _ => None,
        })
        .collect();
    assert_eq!(ended, [TaskEnd::Incident]);
    handle.stop().await;
    let mut recorder = recorder;
    recorder.drained().await;
    let report = check_invariants(
        &s.engine,
        &[&s.tools],
        &[recorder.observation()],
        &Expect::default(),
    )
    .await;
    report.assert_ok("null final answer");
    s.shutdown().await;
}

/// A completion the engine refuses with a 400 that is not a lost lease (the instance is
/// suspended, cancelled or failed; the gateway after the task routes nowhere) is reported once
/// as a failure with `retries: 0` and the engine's message: one refused `complete`, one
/// `failure`, one acquisition. The lease is kept meanwhile (heartbeats on a suspended instance
/// are accepted). Once the operator resumes the instance and sets retries, the task completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_for_good_is_reported_once_as_an_incident() {
    let s = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let cases = [
        (
            "p-suspended",
            Some(InstanceAction::Suspend),
            "Process instance is suspended: p-suspended",
        ),
        (
            "p-cancelled",
            Some(InstanceAction::Cancel),
            "Process instance is already in a terminal state: CANCELLED",
        ),
        (
            "p-failed",
            Some(InstanceAction::Fail),
            "Process instance is already in a terminal state: FAILED",
        ),
        (
            "p-gateway",
            None,
            "No matching condition and no default flow for gateway agentOutcome",
        ),
    ];
    let mut ids = Vec::new();
    for (instance, action, message) in cases {
        let id = s.engine.create_task(task(&s, "openai/refund", instance));
        match action {
            Some(action) => s.engine.instance_action(instance, action).unwrap(),
            None => s.engine.inject(Fault::Reject {
                operation: Operation::Complete,
                task_id: id.clone(),
                count: 1,
                message: message.into(),
            }),
        }
        ids.push(id);
    }
    let mut opts = WorkerOptions::new("w-refused", 4);
    opts.lock_duration = LOCK;
    opts.poll_interval = Duration::from_millis(100);
    let mut handle = s.spawn_worker(opts, Stack::fast_agent_settings());
    let recorder = Recorder::attach(&s.engine, &mut handle, 4);
    for (id, (_, _, message)) in ids.iter().zip(cases) {
        let view = wait_status(&s, id, TaskStatus::Failed).await;
        assert_eq!(view.retries, Some(0), "{id}: an incident");
        let got = view.error_message.unwrap();
        assert!(got.contains(message), "{id}: {got}");
        assert!(got.contains("refused the task's completion"), "{got}");
        let completes = calls(&s, Operation::Complete, id);
        assert_eq!(completes.len(), 1, "{id}: refused once, not retried");
        assert_eq!(completes[0].status, 400);
        assert_ne!(completes[0].disposition, Disposition::Executed);
        assert_eq!(calls(&s, Operation::Failure, id).len(), 1, "{id}");
    }
    nothing_runs_again(&s, &recorder).await;
    for id in &ids {
        assert_eq!(s.engine.task(id).unwrap().counters.acquisitions, 1, "{id}");
    }
    let incidents = recorder
        .events()
        .iter()
        .filter(|e| {
            matches!(
                e,
                RunnerEvent::TaskEnded {
                    outcome: TaskEnd::Incident,
                    ..
                }
            )
        })
        .count();
    assert_eq!(incidents, 4);
    // The operator resumes the suspended instance and sets retries: the task completes, its
    // refund written once (the journal kept the write's key).
    s.engine
        .instance_action("p-suspended", InstanceAction::Resume)
        .unwrap();
    assert!(s.engine.set_retries(&ids[0], 1));
    wait_status(&s, &ids[0], TaskStatus::Completed).await;
    handle.stop().await;
    let mut recorder = recorder;
    recorder.drained().await;
    let report = check_invariants(
        &s.engine,
        &[&s.tools],
        &[recorder.observation()],
        &Expect::default(),
    )
    .await;
    report.assert_ok("refused completions");
    s.shutdown().await;
}

/// Ends every task with the BPMN error its variable `case` names.
struct BpmnErrorHandler;

#[async_trait]
impl TaskHandler for BpmnErrorHandler {
    async fn handle(&self, task: std::sync::Arc<Task>, _ctx: TaskContext) -> Outcome {
        let mut variables = Map::new();
        let code = match task.variables.get("case").and_then(Value::as_str) {
            // A worker bug the engine refuses for good: 400 "BPMN errorCode is required".
            Some("no-code") => String::new(),
            Some("null") => {
                variables.insert("denial".into(), Value::Null);
                "REFUND_DENIED".into()
            }
            _ => "REFUND_DENIED".into(),
        };
        Outcome::BpmnError(BpmnErrorReport {
            error_code: code,
            error_message: "denied".into(),
            variables,
        })
    }
}

/// The same for the other ending that carries variables: a BPMN error with a top-level null
/// becomes an incident without being sent; one the engine refuses for good is reported once as
/// an incident with the engine's message; a plain one on a suspended instance is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bpmn_error_refused_or_unstorable_ends_once_as_an_incident() {
    let emu = abada_agent_worker::devkit::engine::start(Default::default())
        .await
        .unwrap();
    let spec = |case: &str| TaskSpec {
        variables: serde_json::from_value(json!({"case": case})).unwrap(),
        retries: Some(3),
        process_instance_id: Some(format!("p-{case}")),
        ..TaskSpec::default()
    };
    let no_code = emu.create_task(spec("no-code"));
    let null = emu.create_task(spec("null"));
    let suspended = emu.create_task(spec("suspended"));
    emu.instance_action("p-suspended", InstanceAction::Suspend)
        .unwrap();
    let w = spawn_worker(
        &emu,
        emulator_worker::WorkerOptions::new("w-bpmn", LOCK).handler(BpmnErrorHandler),
    );
    for id in [&no_code, &null] {
        let view = within("the incident", async {
            emu.wait_for(|e| e.task(id).filter(|t| t.status == TaskStatus::Failed))
                .await
        })
        .await;
        assert_eq!(view.retries, Some(0));
    }
    within("the BPMN error", async {
        emu.wait_for(|e| {
            e.task(&suspended)
                .filter(|t| t.status == TaskStatus::BpmnError)
        })
        .await
    })
    .await;
    let message = emu.task(&no_code).unwrap().error_message.unwrap();
    assert!(
        message.contains("refused the task's BPMN error")
            && message.contains("BPMN errorCode is required"),
        "{message}"
    );
    let message = emu.task(&null).unwrap().error_message.unwrap();
    assert!(message.contains("`denial`"), "{message}");
    let calls = emu.calls();
    let of = |id: &str, op| {
        calls
            .iter()
            .filter(|c| c.task_id.as_deref() == Some(id) && c.operation == op)
            .count()
    };
    assert_eq!(of(&no_code, Operation::BpmnError), 1);
    assert_eq!(
        of(&null, Operation::BpmnError),
        0,
        "nothing unstorable sent"
    );
    assert_eq!(of(&no_code, Operation::Failure), 1);
    assert_eq!(of(&null, Operation::Failure), 1);
    assert_eq!(
        emu.instance("p-suspended").unwrap().status,
        abada_agent_worker::devkit::engine::InstanceStatus::Failed
    );
    w.stop().await;
    emu.shutdown().await;
}
