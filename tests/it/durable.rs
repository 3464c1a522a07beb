//! Durability end to end: resuming from journals written by earlier attempts, the
//! journal's refusals (JOURNAL_CONFLICT, STALE_ATTEMPT, WORKER_LOCK_NOT_OWNED) stopping a run
//! silently, an older attempt superseded in the same worker, engines without a journal, the
//! frozen-worker story step by step, and a crash test of the real binary under SIGKILL and
//! SIGSTOP/SIGCONT.
//!
//! Earlier attempts are played by a fake worker: the real HTTP engine client under another
//! worker id, which fetches the task, appends hand-written steps and lets its lease expire
//! through the emulator's clock (`advance`). Workers that must stop at an exact point run over
//! [`Freezable`], an engine gate that holds chosen calls until the test lets them go.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::agent::journal::{
    input_step, model_step, tool_finished_step, tool_started_step, write_key,
};
use abada_agent_worker::conversation::{AssistantMessage, ToolCall, ToolResult, Usage};
use abada_agent_worker::devkit::engine::{
    AGENT_TOPIC, CallRecord, Disposition, Fault, Operation, ProtocolLevel, TaskStatus,
};
use abada_agent_worker::devkit::gate::{self, GatedEngine};
use abada_agent_worker::devkit::model::Script;
use abada_agent_worker::devkit::model::Turn;
use abada_agent_worker::devkit::stack::{
    ORDERS_SERVER, REFUND_MODEL, Stack, StackWorkers, WorkerHandle, WorkerOptions, refund_script,
};
use abada_agent_worker::engine::client::{EngineClientSettings, HttpEngine};
use abada_agent_worker::engine::{
    AppendOutcome, Engine, FetchRequest, JournalStep, LeaseLostReason, Task, TaskRef,
};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::runner::RunnerEvent;
use abada_agent_worker::secret::Secret;
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, McpSessions, ToolServerRef, ToolSessionOptions,
};
use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use crate::agent::{FULL_REFUND_RUN, spec, step_kinds, wait_all_ended};

// ---- a freezable engine gate --------------------------------------------------------------

/// An engine operation, as the gate sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    Fetch,
    Heartbeat,
    Complete,
    Failure,
    BpmnError,
    JournalRead,
    JournalAppend,
    Credential,
    Probe,
    ProcessRead,
}

impl Op {
    fn of(op: gate::Op<'_>) -> Op {
        match op {
            gate::Op::FetchAndLock(_) => Op::Fetch,
            gate::Op::Heartbeat => Op::Heartbeat,
            gate::Op::Complete => Op::Complete,
            gate::Op::Failure(_) => Op::Failure,
            gate::Op::BpmnError => Op::BpmnError,
            gate::Op::JournalRead => Op::JournalRead,
            gate::Op::JournalAppend(_) => Op::JournalAppend,
            gate::Op::ToolCredentials { .. } => Op::Credential,
            gate::Op::Probe => Op::Probe,
            gate::Op::ProcessRead { .. } => Op::ProcessRead,
        }
    }
}

/// What the trigger decides about one call.
enum Hold {
    Pass,
    /// Hold this call only.
    ThisCall,
    /// Hold this call and every later one (the process is frozen).
    Everything,
}

type Trigger = dyn Fn(Op, Option<&TaskRef>, Option<&JournalStep>) -> Hold + Send + Sync;

#[derive(Default)]
struct GateState {
    /// The trigger fires once.
    armed: bool,
    frozen: bool,
    open_all: bool,
    open: HashSet<Op>,
    /// Calls held so far (including ones since let go), in arrival order.
    held: Vec<Op>,
}

/// Holds the calls its trigger picks (or everything once it says so) until the test opens
/// their operation or thaws the whole thing.
struct Freezable {
    gate: watch::Sender<GateState>,
    trigger: Box<Trigger>,
}

impl Freezable {
    fn new(
        trigger: impl Fn(Op, Option<&TaskRef>, Option<&JournalStep>) -> Hold + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Freezable {
            gate: watch::Sender::new(GateState {
                armed: true,
                ..GateState::default()
            }),
            trigger: Box::new(trigger),
        })
    }

    async fn pass(&self, op: Op, task: Option<&TaskRef>, step: Option<&JournalStep>) {
        let mut hold = false;
        self.gate.send_modify(|g| {
            if g.open_all || g.open.contains(&op) {
                return;
            }
            if g.frozen {
                hold = true;
            } else if g.armed {
                match (self.trigger)(op, task, step) {
                    Hold::Pass => {}
                    Hold::ThisCall => {
                        g.armed = false;
                        hold = true;
                    }
                    Hold::Everything => {
                        g.armed = false;
                        g.frozen = true;
                        hold = true;
                    }
                }
            }
            if hold {
                g.held.push(op);
            }
        });
        if hold {
            let mut rx = self.gate.subscribe();
            let _ = rx.wait_for(|g| g.open_all || g.open.contains(&op)).await;
        }
    }

    /// Waits until a call of `op` is held.
    async fn wait_held(&self, op: Op, limit: Duration) {
        let mut rx = self.gate.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|g| g.held.contains(&op)))
            .await
            .unwrap_or_else(|_| panic!("no {op:?} call was held within {limit:?}"))
            .expect("the gate lives as long as the decorator");
    }

    /// Lets held and future calls of `op` through.
    fn open(&self, op: Op) {
        self.gate.send_modify(|g| {
            g.open.insert(op);
        });
    }

    /// Lets everything through from now on.
    fn thaw(&self) {
        self.gate.send_modify(|g| {
            g.open_all = true;
            g.frozen = false;
        });
    }
}

#[async_trait]
impl gate::Gate for Freezable {
    async fn before(&self, op: gate::Op<'_>, task: Option<&TaskRef>) {
        self.pass(Op::of(op), task, op.step()).await;
    }
}

// ---- helpers ------------------------------------------------------------------------------

fn engine_client(stack: &Stack, worker_id: &str) -> Arc<HttpEngine> {
    let mut settings = EngineClientSettings::new(stack.engine.base_url(), worker_id);
    settings.request_timeout = Duration::from_secs(5);
    Arc::new(HttpEngine::new(
        reqwest::Client::new(),
        settings,
        None,
        Arc::new(Metrics::new()),
    ))
}

/// An in-process worker (real runner and agent runtime) whose engine client is behind a gate.
struct WrappedWorker(WorkerHandle);

impl WrappedWorker {
    /// Starts a worker on `stack` whose engine client is behind `gate`.
    fn spawn(stack: &Stack, opts: WorkerOptions, gate: Arc<Freezable>) -> WrappedWorker {
        WrappedWorker(stack.spawn_worker_with(
            opts,
            Stack::fast_agent_settings(),
            GatedEngine::wrapper(gate),
        ))
    }

    async fn stop(self) -> Vec<RunnerEvent> {
        tokio::time::timeout(Duration::from_secs(10), self.0.stop_collecting())
            .await
            .unwrap_or_default()
    }
}

/// Starts a one-slot worker and waits until the append of its first model step is held by its
/// engine gate: the moment a test changes the engine's state under the worker.
async fn worker_held_at_model_append(
    stack: &Stack,
    worker_id: &str,
    lock: Duration,
) -> (WrappedWorker, Arc<Freezable>) {
    let gate = Freezable::new(|op, _, step| match (op, step) {
        (Op::JournalAppend, Some(s)) if s.kind == "model" => Hold::ThisCall,
        _ => Hold::Pass,
    });
    let worker = WrappedWorker::spawn(stack, opts(worker_id, 1, lock), gate.clone());
    gate.wait_held(Op::JournalAppend, Duration::from_secs(20))
        .await;
    (worker, gate)
}

/// Lets the held append go and returns the engine's refusal of it.
async fn release_held_append(stack: &Stack, gate: &Freezable) -> CallRecord {
    gate.open(Op::JournalAppend);
    tokio::time::timeout(
        Duration::from_secs(10),
        stack.engine.wait_for(|e| {
            e.calls()
                .into_iter()
                .find(|c| c.operation == Operation::JournalAppend && c.status >= 400)
        }),
    )
    .await
    .expect("the worker's append reaches the engine")
}

fn opts(id: &str, slots: u32, lock: Duration) -> WorkerOptions {
    let mut o = WorkerOptions::new(id, slots);
    o.lock_duration = lock;
    o.poll_interval = Duration::from_millis(50);
    o
}

/// Fetches one task as a fake earlier worker.
async fn acquire(client: &HttpEngine, lock: Duration) -> Task {
    let mut tasks = client
        .fetch_and_lock(&FetchRequest {
            topics: vec![AGENT_TOPIC.into()],
            lock_duration: lock,
            max_tasks: 1,
        })
        .await
        .expect("the fake earlier worker fetches");
    assert_eq!(tasks.len(), 1, "one task to acquire");
    tasks.remove(0)
}

async fn append_all(client: &HttpEngine, task: &TaskRef, steps: &[JournalStep]) {
    for step in steps {
        let outcome = client
            .append_journal(task, step)
            .await
            .unwrap_or_else(|e| panic!("appending step {}: {e}", step.seq));
        assert_eq!(outcome, AppendOutcome::Created);
    }
}

fn call(id: &str, tool: &str, arguments: Value) -> ToolCall {
    ToolCall {
        call_id: id.into(),
        server: ORDERS_SERVER.into(),
        tool: tool.into(),
        arguments,
    }
}

fn lookup(order: &str) -> ToolCall {
    call("call_1", "lookup_order", json!({"orderId": order}))
}

fn refund(order: &str) -> ToolCall {
    call(
        "call_2",
        "issue_refund",
        json!({"orderId": order, "amountCents": 1500, "reason": "damaged"}),
    )
}

fn asks(calls: Vec<ToolCall>) -> AssistantMessage {
    AssistantMessage {
        text: None,
        tool_calls: calls,
    }
}

const USAGE: Usage = Usage {
    input_tokens: 120,
    output_tokens: 30,
};

fn text_result(value: Value) -> ToolResult {
    ToolResult {
        content: vec![json!({"type": "text", "text": value.to_string()})],
        structured_content: Some(value),
        is_error: false,
    }
}

const INSTRUCTIONS: &str =
    "You handle refund requests. Look the order up, refund it, answer with JSON.";

/// Steps 1-4 of the refund agent: input, lookup asked, lookup answered, refund asked.
fn first_four_steps(order: &str) -> Vec<JournalStep> {
    vec![
        input_step(1, INSTRUCTIONS, order),
        model_step(
            2,
            "openai/refund",
            &asks(vec![lookup(order)]),
            USAGE,
            "tool_calls",
        ),
        tool_finished_step(
            3,
            None,
            &lookup(order),
            &text_result(json!({"orderId": order, "status": "delivered"})),
        ),
        model_step(
            4,
            "openai/refund",
            &asks(vec![refund(order)]),
            USAGE,
            "tool_calls",
        ),
    ]
}

/// Calls of `op` about `task` in the emulator's log.
fn calls_of(calls: &[CallRecord], task: &str, op: Operation) -> Vec<CallRecord> {
    calls
        .iter()
        .filter(|c| c.operation == op && c.task_id.as_deref() == Some(task))
        .cloned()
        .collect()
}

fn reports_from(calls: &[CallRecord], worker: &str) -> usize {
    calls
        .iter()
        .filter(|c| {
            matches!(
                c.operation,
                Operation::Complete | Operation::Failure | Operation::BpmnError
            ) && c.worker_id.as_deref() == Some(worker)
        })
        .count()
}

/// Keys the tool server received for `issue_refund`, in order.
fn refund_keys(stack: &Stack) -> Vec<Option<String>> {
    stack.tools.keys_sent("issue_refund")
}

/// A credential source for the fake earlier worker.
struct ClientCredentials {
    client: Arc<HttpEngine>,
    task: TaskRef,
}

#[async_trait]
impl CredentialSource for ClientCredentials {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        self.client
            .tool_credential(&self.task, server)
            .await
            .map(|c| Some(c.token))
            .map_err(|e| CredentialError::Transient {
                server: server.into(),
                reason: e.to_string(),
            })
    }
}

// ---- resume ---------------------------------------------------------------------------------

/// (a) A `tool/started` without its `finished` is re-sent with its original key, whether or
/// not the earlier worker got to send it; the tool server applies it once.
#[tokio::test]
async fn a_started_write_without_result_is_resent_with_its_original_key() {
    for earlier_applied_it in [false, true] {
        let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
        let id = stack
            .engine
            .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-1"));
        let earlier = engine_client(&stack, "earlier");
        let task = acquire(&earlier, Duration::from_secs(30)).await;
        let key = write_key(&id, 5);
        let mut steps = first_four_steps("o-1");
        steps.push(tool_started_step(5, &key, &refund("o-1")));
        append_all(&earlier, &task.task_ref(), &steps).await;
        if earlier_applied_it {
            let mut sessions = McpSessions::new(
                reqwest::Client::new(),
                vec![ToolServerRef {
                    name: ORDERS_SERVER.into(),
                    url: stack.tools.url(),
                }],
                Arc::new(ClientCredentials {
                    client: earlier.clone(),
                    task: task.task_ref(),
                }),
                None,
                ToolSessionOptions::default(),
            );
            let args = refund("o-1").arguments.as_object().cloned().unwrap();
            let r = sessions
                .call(ORDERS_SERVER, "issue_refund", args, Some(&key))
                .await
                .expect("the earlier worker's write goes through");
            assert!(!r.is_error);
            sessions.close().await;
        }
        stack.engine.advance(Duration::from_secs(31));

        let worker = stack.spawn_worker(
            opts("w-resume", 2, Duration::from_secs(10)),
            Stack::fast_agent_settings(),
        );
        let views =
            wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
        let view = &views[0];
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        assert_eq!(view.attempt, 2);
        assert_eq!(
            step_kinds(view)[4..],
            ["tool/started", "tool/finished", "model/finished"]
        );
        assert_eq!(
            view.journal[5]["key"],
            key.as_str(),
            "finished under the same key"
        );
        let sent = refund_keys(&stack);
        let expected = if earlier_applied_it { 2 } else { 1 };
        assert_eq!(sent.len(), expected, "{sent:?}");
        assert!(
            sent.iter().all(|k| k.as_deref() == Some(key.as_str())),
            "{sent:?}"
        );
        let counters = stack.tools.counters().await;
        assert_eq!(counters.writes_applied, 1, "applied once");
        assert_eq!(counters.duplicates, u64::from(earlier_applied_it));
        // Only the third turn is asked for: nothing journaled is redone.
        assert_eq!(stack.model.total_calls(), 1);
        let result = view.result_variables.as_ref().unwrap();
        assert_eq!(result["agentUsage"]["turns"], 3);
        assert_eq!(
            result["agentUsage"]["inputTokens"], 360,
            "usage across attempts"
        );
        worker.stop().await;
        stack.shutdown().await;
    }
}

/// (b) The tool calls of the last model answer that have no result are run, in order.
#[tokio::test]
async fn tool_calls_of_the_last_answer_without_results_run_in_order() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack.model.set_script(
        "final-only",
        Script::new(vec![Turn::text(r#"{"done": true}"#)]).with_usage(10, 5),
    );
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/final-only", &[]), "o-2"));
    let earlier = engine_client(&stack, "earlier");
    let task = acquire(&earlier, Duration::from_secs(30)).await;
    append_all(
        &earlier,
        &task.task_ref(),
        &[
            input_step(1, INSTRUCTIONS, "o-2"),
            model_step(
                2,
                "openai/final-only",
                &asks(vec![lookup("o-2"), refund("o-2")]),
                USAGE,
                "tool_calls",
            ),
        ],
    )
    .await;
    stack.engine.advance(Duration::from_secs(31));

    let worker = stack.spawn_worker(
        opts("w-resume", 2, Duration::from_secs(10)),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(
        step_kinds(view),
        [
            "input/finished",
            "model/finished",
            "tool/finished",
            "tool/started",
            "tool/finished",
            "model/finished"
        ]
    );
    assert_eq!(view.journal[2]["data"]["callId"], "call_1");
    assert_eq!(view.journal[3]["data"]["callId"], "call_2");
    assert_eq!(view.journal[3]["key"], write_key(&id, 4).as_str());
    let tools: Vec<String> = stack.tools.calls().into_iter().map(|c| c.tool).collect();
    assert_eq!(
        tools,
        ["lookup_order", "issue_refund"],
        "in the answer's order"
    );
    assert_eq!(refund_keys(&stack), [Some(write_key(&id, 4))]);
    assert_eq!(stack.model.total_calls(), 1);
    assert_eq!(
        view.result_variables.as_ref().unwrap()["refundDecision"],
        json!({"done": true})
    );
    worker.stop().await;
    stack.shutdown().await;
}

/// (c) A journal that ends in a final answer completes at once, without a model or tool call.
#[tokio::test]
async fn a_journal_ending_in_a_final_answer_completes_without_a_model_call() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-3"));
    let earlier = engine_client(&stack, "earlier");
    let task = acquire(&earlier, Duration::from_secs(30)).await;
    let mut steps = first_four_steps("o-3");
    let key = write_key(&id, 5);
    let refunded = text_result(json!({"refundId": "rf-9", "status": "issued"}));
    steps.push(tool_started_step(5, &key, &refund("o-3")));
    steps.push(tool_finished_step(6, Some(&key), &refund("o-3"), &refunded));
    steps.push(model_step(
        7,
        "openai/refund",
        &AssistantMessage {
            text: Some(r#"{"decision": "refunded", "orderId": "o-3"}"#.into()),
            tool_calls: vec![],
        },
        USAGE,
        "stop",
    ));
    append_all(&earlier, &task.task_ref(), &steps).await;
    stack.engine.advance(Duration::from_secs(31));

    let worker = stack.spawn_worker(
        opts("w-resume", 2, Duration::from_secs(10)),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.journal.len(), 7, "nothing appended");
    assert_eq!(stack.model.total_calls(), 0);
    assert!(stack.tools.calls().is_empty());
    let result = view.result_variables.as_ref().unwrap();
    assert_eq!(
        result["refundDecision"],
        json!({"decision": "refunded", "orderId": "o-3"})
    );
    assert_eq!(result["agentUsage"]["turns"], 3);
    assert_eq!(result["agentUsage"]["outputTokens"], 90);
    let credentials = calls_of(&stack.engine.calls(), &id, Operation::ToolCredentials);
    assert!(
        credentials
            .iter()
            .all(|c| c.worker_id.as_deref() != Some("w-resume")),
        "no tool session opened"
    );
    worker.stop().await;
    stack.shutdown().await;
}

/// (d) Turns and tokens spent in earlier attempts count: a limit already reached makes an
/// incident at once, without a model call.
#[tokio::test]
async fn turns_and_tokens_of_earlier_attempts_count_against_the_limits() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let mut by_turns = stack.refund_agent("openai/refund", &[]);
    by_turns["maxTurns"] = json!(2);
    let mut by_tokens = stack.refund_agent("openai/refund", &[]);
    by_tokens["tokenBudget"] = json!(300);
    let ids = stack
        .engine
        .create_tasks([spec(by_turns, "o-4"), spec(by_tokens, "o-5")]);
    // Two earlier attempts by two workers: steps 1-3 in attempt 1, steps 4-6 in attempt 2.
    let lock = Duration::from_secs(30);
    for (attempt, worker) in [(1u32, "earlier-a"), (2, "earlier-b")] {
        let client = engine_client(&stack, worker);
        for (i, order) in ["o-4", "o-5"].into_iter().enumerate() {
            let task = acquire(&client, lock).await;
            assert_eq!(task.id, ids[i]);
            assert_eq!(task.attempt, Some(attempt));
            let key = write_key(&task.id, 5);
            let mut all = first_four_steps(order);
            all.push(tool_started_step(5, &key, &refund(order)));
            all.push(tool_finished_step(
                6,
                Some(&key),
                &refund(order),
                &text_result(json!({"refundId": "rf-1"})),
            ));
            let part = if attempt == 1 { &all[..3] } else { &all[3..] };
            append_all(&client, &task.task_ref(), part).await;
        }
        stack.engine.advance(lock + Duration::from_secs(1));
    }

    let worker = stack.spawn_worker(
        opts("w-resume", 2, Duration::from_secs(10)),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(20)).await;
    for view in &views {
        assert_eq!(view.status, TaskStatus::Failed, "an incident: {view:?}");
        assert_eq!(view.retries, Some(0));
        assert_eq!(view.attempt, 3);
        assert_eq!(view.journal.len(), 6, "nothing appended");
    }
    let turns_msg = views[0].error_message.as_deref().unwrap_or_default();
    assert!(turns_msg.contains("maxTurns = 2 reached"), "{turns_msg}");
    let tokens_msg = views[1].error_message.as_deref().unwrap_or_default();
    assert!(
        tokens_msg.contains("tokenBudget = 300 would be exceeded: 300 tokens spent"),
        "{tokens_msg}"
    );
    assert_eq!(stack.model.total_calls(), 0, "no model call");
    assert!(stack.tools.calls().is_empty());
    worker.stop().await;
    stack.shutdown().await;
}

/// (e) A journal conflict during a run (another writer took the step's `seq`) stops the run:
/// no completion, no failure, the lease left alone.
#[tokio::test]
async fn a_journal_conflict_during_a_run_stops_it_silently() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-6"));
    let (worker, gate) =
        worker_held_at_model_append(&stack, "w-split", Duration::from_secs(30)).await;
    // A second writer under the same identity (a raw request with its own idempotency key)
    // takes seq 2 first.
    let view = stack.engine.task(&id).unwrap();
    let other = model_step(
        2,
        "openai/other",
        &AssistantMessage {
            text: Some("someone else's answer".into()),
            tool_calls: vec![],
        },
        USAGE,
        "stop",
    );
    let answer = reqwest::Client::new()
        .post(format!(
            "{}/v1/external-tasks/{id}/journal",
            stack.engine.base_url()
        ))
        .header("X-Abada-Worker-Protocol-Version", "1")
        .header("Idempotency-Key", "impostor-1")
        .json(&json!({"workerId": "w-split", "attempt": view.attempt, "step": other}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    stack.engine.clear_calls();
    let refused = release_held_append(&stack, &gate).await;
    assert_eq!(refused.error_code.as_deref(), Some("JOURNAL_CONFLICT"));
    let events = worker.stop().await;
    assert!(
        events.iter().any(|e| matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::LeaseLost, .. } if *task_id == id)),
        "{events:?}"
    );
    let calls = stack.engine.calls();
    assert_eq!(reports_from(&calls, "w-split"), 0, "it reports nothing");
    let view = stack.engine.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::Locked, "the lease is left alone");
    assert_eq!(view.counters.completes + view.counters.failures, 0);
    assert_eq!(view.journal.len(), 2);
    stack.shutdown().await;
}

/// (e) A stale attempt during a run (the engine gave the task to a newer attempt of the same
/// worker id) stops the run silently, with 409 STALE_ATTEMPT.
#[tokio::test]
async fn a_stale_attempt_during_a_run_stops_it_silently() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-7"));
    // One slot: the worker cannot fetch its own task again while the first attempt runs.
    let lock = Duration::from_secs(30);
    let (worker, gate) = worker_held_at_model_append(&stack, "w-same", lock).await;
    stack.engine.advance(lock + Duration::from_secs(1));
    let thief = engine_client(&stack, "w-same");
    let newer = acquire(&thief, lock).await;
    assert_eq!(newer.attempt, Some(2));
    stack.engine.clear_calls();
    let refused = release_held_append(&stack, &gate).await;
    assert_eq!(refused.status, 409);
    assert_eq!(refused.error_code.as_deref(), Some("STALE_ATTEMPT"));
    assert_eq!(refused.attempt, Some(1));
    let events = worker.stop().await;
    assert!(
        events.iter().any(|e| matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::LeaseLost, .. } if *task_id == id)),
        "{events:?}"
    );
    let calls = stack.engine.calls();
    assert_eq!(reports_from(&calls, "w-same"), 0, "it reports nothing");
    let view = stack.engine.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::Locked);
    assert_eq!(view.attempt, 2);
    assert_eq!(view.journal.len(), 1, "only the input step of attempt 1");
    stack.shutdown().await;
}

/// (e) A lease that ran out with nobody taking the task: the append is refused with 409
/// WORKER_LOCK_EXPIRED and attempt 1 stops silently; the task is offered again and the next
/// attempt finishes it.
#[tokio::test]
async fn an_expired_lease_during_a_run_stops_it_silently() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-9"));
    let lock = Duration::from_secs(30);
    let (worker, gate) = worker_held_at_model_append(&stack, "w-late", lock).await;
    stack.engine.advance(lock + Duration::from_secs(1));
    let refused = release_held_append(&stack, &gate).await;
    assert_eq!(refused.status, 409);
    assert_eq!(refused.error_code.as_deref(), Some("WORKER_LOCK_EXPIRED"));
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let events = worker.stop().await;
    assert_eq!(views[0].status, TaskStatus::Completed);
    assert_eq!(views[0].attempt, 2);
    let calls = stack.engine.calls();
    let reports_of_first = calls
        .iter()
        .filter(|c| {
            matches!(c.operation, Operation::Complete | Operation::Failure) && c.attempt == Some(1)
        })
        .count();
    assert_eq!(reports_of_first, 0, "attempt 1 reports nothing");
    assert!(
        events.iter().any(|e| matches!(
            e,
            RunnerEvent::TaskEnded {
                attempt: Some(1),
                outcome: TaskEnd::LeaseLost,
                ..
            }
        )),
        "{events:?}"
    );
    stack.shutdown().await;
}

/// Appends carry the attempt, and an append whose answer was lost is retried under the same
/// idempotency key: the journal holds each step once.
#[tokio::test]
async fn a_retried_append_is_idempotent() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack.engine.inject(Fault::DropResponse {
        operation: Operation::JournalAppend,
        count: 3,
    });
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-10"));
    let worker = stack.spawn_worker(
        opts("w-retry", 1, Duration::from_secs(10)),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    worker.stop().await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.journal.len(), 7);
    assert_eq!(view.counters.journal_appends, 7, "each step written once");
    let appends = calls_of(&stack.engine.calls(), &id, Operation::JournalAppend);
    assert!(appends.iter().all(|c| c.attempt == Some(1)), "{appends:?}");
    assert_eq!(appends.iter().filter(|c| c.response_dropped).count(), 3);
    assert_eq!(
        appends
            .iter()
            .filter(|c| c.disposition == Disposition::Replayed)
            .count(),
        3,
        "each lost answer replayed from the idempotency store"
    );
    let keys: HashSet<Option<String>> = appends.iter().map(|c| c.idempotency_key.clone()).collect();
    assert_eq!(keys.len(), 7, "one key per step, reused by its retry");
    stack.shutdown().await;
}

/// Fencing: a worker that fetches its own expired task again stops the older attempt it still
/// runs; the older attempt makes no further engine call; the newer one resumes and completes.
#[tokio::test]
async fn a_worker_stops_an_older_attempt_when_it_fetches_the_task_again() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-8"));
    let lock = Duration::from_secs(30);
    let gate = Freezable::new(|op, task, step| match (op, task, step) {
        (Op::JournalAppend, Some(t), Some(s)) if s.kind == "model" && t.attempt == Some(1) => {
            Hold::ThisCall
        }
        _ => Hold::Pass,
    });
    let worker = WrappedWorker::spawn(&stack, opts("w-twice", 2, lock), gate.clone());
    gate.wait_held(Op::JournalAppend, Duration::from_secs(20))
        .await;
    stack.engine.advance(lock + Duration::from_secs(1));
    // The worker's own poller (one free slot) takes attempt 2.
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.attempt, 2);
    assert_eq!(view.counters.completes, 1);
    // Attempt 1's held append is let go now: it was dropped with its attempt, so nothing
    // from attempt 1 reaches the engine any more.
    gate.thaw();
    let events = worker.stop().await;
    let calls = stack.engine.calls();
    let from_first: Vec<&CallRecord> = calls
        .iter()
        .filter(|c| c.task_id.as_deref() == Some(id.as_str()) && c.attempt == Some(1))
        .collect();
    assert!(
        from_first.iter().all(|c| matches!(
            c.operation,
            Operation::JournalRead | Operation::JournalAppend | Operation::ToolCredentials
        )),
        "{from_first:?}"
    );
    assert_eq!(
        from_first
            .iter()
            .filter(|c| c.operation == Operation::JournalAppend)
            .count(),
        1,
        "attempt 1 journaled only its input"
    );
    assert_eq!(step_kinds(view), FULL_REFUND_RUN);
    assert_eq!(stack.model.total_calls(), 4, "turn 1 paid twice, no more");
    assert_eq!(stack.tools.counters().await.writes_applied, 1);
    let ended: Vec<(Option<u32>, TaskEnd)> = events
        .iter()
        .filter_map(|e| match e {
            RunnerEvent::TaskEnded {
                attempt, outcome, ..
            } => Some((*attempt, *outcome)),
            _ => None,
        })
        .collect();
    assert!(ended.contains(&(Some(1), TaskEnd::LeaseLost)), "{ended:?}");
    assert!(ended.contains(&(Some(2), TaskEnd::Completed)), "{ended:?}");
    stack.shutdown().await;
}

// ---- engines without a journal ----------------------------------------------------------------

/// On an engine without a journal (404), agents still run to completion; the real binary says
/// so once in its log. The absence is learned from the first answers and held: tasks that start
/// after it was learned never ask for the journal, and no attempt ever appends.
#[tokio::test]
async fn without_a_journal_agents_run_and_the_worker_warns_once() {
    use crate::support::process::{WorkerProcess, stack_env};
    let stack = Stack::start(ProtocolLevel::AgentV1WithoutJournal)
        .await
        .unwrap();
    let first = stack.engine.create_tasks(
        (0..3).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    let mut worker = WorkerProcess::spawn(&stack_env(&stack, "nojournal-1")).await;
    let mut views = wait_all_ended(&stack, &first, Duration::from_secs(30)).await;
    // Created after the first ones ended: the worker knows by now.
    let later = stack.engine.create_tasks(
        (3..6).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    views.extend(wait_all_ended(&stack, &later, Duration::from_secs(30)).await);
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit}");
    let calls = stack.engine.calls();
    for view in &views {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        assert!(view.journal.is_empty());
        let result = view.result_variables.as_ref().unwrap();
        assert_eq!(result["refundDecision"]["decision"], "refunded");
        let reads = calls_of(&calls, &view.id, Operation::JournalRead);
        assert!(
            reads.len() as u32 <= view.counters.acquisitions,
            "at most once per attempt: {reads:?}"
        );
        assert!(reads.iter().all(|c| c.status == 404));
        assert!(calls_of(&calls, &view.id, Operation::JournalAppend).is_empty());
    }
    let asked = |ids: &[String]| {
        ids.iter()
            .map(|id| calls_of(&calls, id, Operation::JournalRead).len())
            .sum::<usize>()
    };
    assert!(asked(&first) >= 1, "the first tasks asked");
    assert_eq!(asked(&later), 0, "held: never asked again");
    // Keyed writes are still keyed.
    let keys = refund_keys(&stack);
    assert_eq!(keys.len(), 6);
    assert!(
        keys.iter()
            .all(|k| k.as_deref().is_some_and(|k| k.starts_with("abada:t-")))
    );
    let warnings: Vec<String> = worker
        .stdout()
        .into_iter()
        .filter(|l| l.contains("no journal endpoint"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let line: Value = serde_json::from_str(&warnings[0]).unwrap();
    assert_eq!(line["level"], "WARN", "{line}");
    stack.shutdown().await;
}

/// A plain v1 engine (tasks without `attempt`, no agent/1 endpoints, Part D) is never asked for
/// a journal: a task without `attempt` is not an agent/1 task. The definition comes from the
/// agents file; the worker says once that agents run without durability.
#[tokio::test]
async fn a_plain_v1_engine_is_never_asked_for_a_journal() {
    use crate::support::process::{WorkerProcess, stack_env};
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script(
        "final-only",
        Script::new(vec![Turn::text(r#"{"done": true}"#)]).with_usage(10, 5),
    );
    let dir = std::env::temp_dir().join(format!("abada-plain-v1-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let agents = dir.join("agents.toml");
    std::fs::write(
        &agents,
        "[agents.\"abada:agent\"]\nmodel = \"openai/final-only\"\ninput = \"${orderId}\"\n",
    )
    .unwrap();
    let ids = stack.engine.create_tasks((0..3).map(|i| {
        spec(
            stack.refund_agent("openai/final-only", &[]),
            &format!("o-{i}"),
        )
    }));
    let mut env = stack_env(&stack, "plain-1");
    env.push((
        "ABADA_AGENT_AGENTS_FILE".into(),
        agents.display().to_string(),
    ));
    let mut worker = WorkerProcess::spawn(&env).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit}");
    let calls = stack.engine.calls();
    for view in &views {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        assert_eq!(
            view.result_variables.as_ref().unwrap()["agentResult"],
            json!({"done": true})
        );
        assert!(calls_of(&calls, &view.id, Operation::JournalRead).is_empty());
        assert!(calls_of(&calls, &view.id, Operation::JournalAppend).is_empty());
    }
    let warnings: Vec<String> = worker
        .stdout()
        .into_iter()
        .filter(|l| l.contains("keeps no journal"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let _ = std::fs::remove_dir_all(&dir);
    stack.shutdown().await;
}

// ---- the seed story -------------------------------------------------------------------------

/// Worker 1 freezes mid-task (its keyed write applied, its result not journaled yet) for longer
/// than its lease; the lease expires (emulator clock) and worker 2 takes the task, resumes from
/// the journal and re-sends the write under its original key. Worker 1 wakes while worker 2
/// still holds the task: its journal append and its heartbeat are refused, it abandons the task
/// without reporting anything, and the credential and completion it would send are refused.
/// Worker 2 completes; the write was applied once.
#[tokio::test]
async fn the_seed_story_a_frozen_worker_wakes_to_find_its_task_taken() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-seed"));
    // Worker 1 freezes at the journal append of its keyed write's result and stays frozen.
    // Lock 15 s: a heartbeat falls due (and is held) within 5 s, and its own clock would give
    // the lease up only after 13.5 s, long after this story is told.
    let lock = Duration::from_secs(15);
    let gate1 = Freezable::new(|op, _, step| match (op, step) {
        (Op::JournalAppend, Some(s))
            if s.kind == "tool" && s.state == "finished" && s.key.is_some() =>
        {
            Hold::Everything
        }
        _ => Hold::Pass,
    });
    let w1 = WrappedWorker::spawn(&stack, opts("w1", 2, lock), gate1.clone());
    gate1
        .wait_held(Op::JournalAppend, Duration::from_secs(20))
        .await;
    assert_eq!(stack.tools.counters().await.writes_applied, 1, "w1 wrote");
    gate1.wait_held(Op::Heartbeat, lock).await;
    let first = stack.engine.task(&id).unwrap();
    assert_eq!((first.attempt, first.worker_id.as_deref()), (1, Some("w1")));
    assert_eq!(step_kinds(&first).last().unwrap(), "tool/started");

    // The lease runs out on the engine's clock; worker 2 takes the task and gets as far as
    // its completion, which it is made to hold.
    stack.engine.advance(lock + Duration::from_secs(1));
    let gate2 = Freezable::new(|op, _, _| match op {
        Op::Complete => Hold::ThisCall,
        _ => Hold::Pass,
    });
    let w2 = WrappedWorker::spawn(&stack, opts("w2", 2, lock), gate2.clone());
    gate2.wait_held(Op::Complete, Duration::from_secs(20)).await;
    let resumed = stack.engine.task(&id).unwrap();
    assert_eq!(
        (resumed.attempt, resumed.worker_id.as_deref()),
        (2, Some("w2"))
    );
    assert_eq!(resumed.journal.len(), 7, "w2 finished the run");
    assert_eq!(resumed.journal[5]["key"], write_key(&id, 5).as_str());

    // Worker 1 wakes: its journal append goes out and is refused. That ends its task as a lost
    // lease, and ending the lease drops the heartbeat still held on its way: nothing more about
    // the task leaves worker 1.
    let refusal = |op: Operation| {
        let id = id.clone();
        move |e: &abada_agent_worker::devkit::engine::EngineEmulator| {
            e.calls().into_iter().find(|c| {
                c.operation == op
                    && c.task_id.as_deref() == Some(id.as_str())
                    && c.worker_id.as_deref() == Some("w1")
                    && c.disposition == Disposition::Refused
            })
        }
    };
    let mut w1 = w1;
    gate1.open(Op::JournalAppend);
    let append = tokio::time::timeout(
        Duration::from_secs(10),
        stack.engine.wait_for(refusal(Operation::JournalAppend)),
    )
    .await
    .expect("w1's append reaches the engine");
    assert!(
        matches!(
            append.error_code.as_deref(),
            Some("WORKER_LOCK_NOT_OWNED" | "STALE_ATTEMPT")
        ),
        "{append:?}"
    );
    assert_eq!(append.attempt, Some(1));
    let lost = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = w1.0.events.recv().await {
            if matches!(&e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::LeaseLost, .. } if *task_id == id)
            {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(lost, Ok(true), "w1 ended the task as a lost lease");
    let after_refusal = stack.engine.calls().len();
    gate1.thaw();
    // The worker's own engine client (its gate is thawed: calls go straight through).
    let w1_client = w1.0.engine.clone();
    w1.stop().await;
    let calls = stack.engine.calls();
    let late: Vec<_> = calls[after_refusal..]
        .iter()
        .filter(|c| {
            c.worker_id.as_deref() == Some("w1")
                && c.task_id.as_deref() == Some(id.as_str())
                && c.operation != Operation::FetchAndLock
        })
        .collect();
    assert!(late.is_empty(), "w1 sent more about the task: {late:?}");
    assert_eq!(reports_from(&calls, "w1"), 0, "w1 abandons silently");

    // What w1 would have sent next (it sends nothing once a call is refused): the engine
    // refuses its credential request and its completion, typed as a lost lease.
    let stale = TaskRef {
        task_id: id.clone(),
        attempt: Some(1),
        trace_parent: None,
    };
    let credential = credential_refusal(w1_client.as_ref(), &stale).await;
    assert_eq!(credential, Some(LeaseLostReason::NotOwned));
    let completion = w1_client
        .complete(&stale, &Map::new())
        .await
        .expect_err("a completion from attempt 1 is refused");
    assert_eq!(completion.lease_lost(), Some(LeaseLostReason::NotOwned));

    // Worker 2 completes.
    gate2.thaw();
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let done = &views[0];
    assert_eq!(done.status, TaskStatus::Completed, "{done:?}");
    assert_eq!(done.counters.completes, 1);
    assert_eq!(done.counters.acquisitions, 2);
    let result = done.result_variables.as_ref().unwrap();
    assert_eq!(result["refundDecision"]["decision"], "refunded");
    assert_eq!(result["agentUsage"]["turns"], 3);
    w2.stop().await;

    let key = write_key(&id, 5);
    assert_eq!(refund_keys(&stack), [Some(key.clone()), Some(key.clone())]);
    let counters = stack.tools.counters().await;
    assert_eq!(
        counters.writes_applied, 1,
        "the keyed write was applied once"
    );
    assert_eq!(counters.duplicates, 1);
    assert_eq!(counters.duplicates_per_key.get(&key), Some(&1));
    assert_eq!(stack.model.total_calls(), 3, "no model call paid twice");
    // Nothing w1 sent about the task after w2 acquired it was accepted.
    let calls = stack.engine.calls();
    let taken = calls
        .iter()
        .position(|c| c.operation == Operation::FetchAndLock && c.task_ids.contains(&id))
        .map(|first| {
            first
                + 1
                + calls[first + 1..]
                    .iter()
                    .position(|c| {
                        c.operation == Operation::FetchAndLock && c.task_ids.contains(&id)
                    })
                    .expect("w2's fetch is logged")
        })
        .expect("w1's fetch is logged");
    let accepted_from_w1: Vec<&CallRecord> = calls[taken..]
        .iter()
        .filter(|c| {
            c.worker_id.as_deref() == Some("w1")
                && c.task_id.as_deref() == Some(id.as_str())
                && c.disposition != Disposition::Refused
        })
        .collect();
    assert!(accepted_from_w1.is_empty(), "{accepted_from_w1:?}");
    stack.shutdown().await;
}

async fn credential_refusal(client: &dyn Engine, task: &TaskRef) -> Option<LeaseLostReason> {
    match client.tool_credential(task, ORDERS_SERVER).await {
        Ok(_) => None,
        Err(e) => e.lease_lost(),
    }
}

// ---- the crash test -------------------------------------------------------------------------

/// The real binary under chaos: 3 worker processes against the emulator, the scripted model and
/// the tool server; 240 refund tasks (3 model turns, one keyed write each); one worker after
/// another is SIGKILLed and restarted while another is SIGSTOPped past its lease and resumed.
/// Then every task must be completed exactly once, every keyed write applied exactly once, no
/// model call re-paid more than once per interruption, and no write accepted from a stale
/// attempt. Prints the figures (`--nocapture` shows them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_test_the_real_binary_under_sigkill_and_sigstop() {
    use crate::support::chaos;
    use crate::support::process::stack_env;

    const TASKS: usize = 240;
    const WORKERS: usize = 3;
    const SLOTS: &str = "2";
    const LOCK: Duration = Duration::from_millis(2000);
    const MAX_ROUNDS: u32 = 25;
    const CHAOS_LIMIT: Duration = Duration::from_secs(75);
    const FINISH_LIMIT: Duration = Duration::from_secs(60);

    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack.model.set_script(
        REFUND_MODEL,
        refund_script().with_latency(Duration::from_millis(50)),
    );
    let ids = stack.engine.create_tasks((0..TASKS).map(|i| {
        spec(
            stack.refund_agent("openai/refund", &[]),
            &format!("ord-{i:04}"),
        )
    }));
    let order_of: HashMap<String, String> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (format!("ord-{i:04}"), id.clone()))
        .collect();
    let env = |id: &str| {
        let mut env = stack_env(&stack, id);
        env.push((
            "ABADA_AGENT_LOCK_DURATION_MS".into(),
            LOCK.as_millis().to_string(),
        ));
        env.push(("ABADA_AGENT_MAX_TASKS".into(), SLOTS.into()));
        env.push(("ABADA_AGENT_POLL_INTERVAL_MS".into(), "100".into()));
        env
    };
    let started = tokio::time::Instant::now();
    let plan = chaos::Plan {
        lock: LOCK,
        max_rounds: MAX_ROUNDS,
        limit: CHAOS_LIMIT,
    };
    let (
        mut workers,
        chaos::Chaos {
            rounds,
            kills,
            freezes,
            took: chaos_took,
            ..
        },
        _replay_hint,
    ) = chaos::start_and_run(&stack.engine, WORKERS, "crash", env, &plan, "crash test").await;

    let finished = tokio::time::timeout(
        FINISH_LIMIT,
        stack.engine.wait_for(|e| {
            e.tasks()
                .iter()
                .all(|t| matches!(t.status, TaskStatus::Completed | TaskStatus::Failed))
                .then_some(())
        }),
    )
    .await;
    let views = stack.engine.tasks();
    if finished.is_err() {
        let mut by_status: HashMap<String, usize> = HashMap::new();
        for v in &views {
            *by_status.entry(format!("{:?}", v.status)).or_default() += 1;
        }
        panic!("tasks not all ended {FINISH_LIMIT:?} after the chaos: {by_status:?}");
    }
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        w.wait(Duration::from_secs(15)).await;
    }
    let total = started.elapsed();

    // Tasks: completed exactly once.
    let completed_once = views
        .iter()
        .filter(|v| v.status == TaskStatus::Completed && v.counters.completes == 1)
        .count();
    let not_once: Vec<String> = views
        .iter()
        .filter(|v| !(v.status == TaskStatus::Completed && v.counters.completes == 1))
        .map(|v| {
            format!(
                "{} {:?} completes={} failures={} error={:?}",
                v.id, v.status, v.counters.completes, v.counters.failures, v.error_message
            )
        })
        .collect();
    let interruptions: HashMap<&str, u32> = views
        .iter()
        .map(|v| (v.id.as_str(), v.counters.acquisitions.saturating_sub(1)))
        .collect();
    let interrupted_tasks = interruptions.values().filter(|n| **n > 0).count();
    let interruption_total: u32 = interruptions.values().sum();
    let failures_reported: u32 = views.iter().map(|v| v.counters.failures).sum();

    // Keyed writes: applied exactly once per task.
    let counters = stack.tools.counters().await;
    let (keys_per_task, refund_calls) = chaos::refund_keys_per_task(&stack.tools.calls());
    let one_key_each = ids
        .iter()
        .filter(|id| keys_per_task.get(*id).is_some_and(|k| k.len() == 1))
        .count();

    // Model calls: re-paid at most once per interruption of the task.
    let (model_calls, unattributed) =
        chaos::model_calls_per_task(&stack.model.requests(), &order_of);
    let mut repaid_total = 0u32;
    let mut repaid_tasks = 0usize;
    let mut over_budget = Vec::new();
    for id in &ids {
        let calls = model_calls.get(id).copied().unwrap_or(0);
        let repaid = calls.saturating_sub(3);
        repaid_total += repaid;
        if repaid > 0 {
            repaid_tasks += 1;
        }
        let allowed = interruptions[id.as_str()];
        if calls < 3 || repaid > allowed {
            over_budget.push(format!(
                "{id}: {calls} model calls, {allowed} interruptions"
            ));
        }
    }

    // Writes accepted from stale attempts.
    let calls = stack.engine.calls();
    let audit = chaos::audit_stale_writes(&calls, true);
    let refusals = audit.refusals_sorted();

    println!(
        "crash test: {TASKS} tasks, {WORKERS} workers x {SLOTS} slots, lease {LOCK:?}; chaos {rounds} rounds in {chaos_took:.1?} ({kills} SIGKILL + restart, {freezes} SIGSTOP past the lease + SIGCONT); all done after {total:.1?}"
    );
    println!(
        "  tasks completed exactly once: {completed_once}/{TASKS}; failures reported: {failures_reported}"
    );
    println!(
        "  interrupted tasks (acquired more than once): {interrupted_tasks}, interruptions in all: {interruption_total}"
    );
    println!(
        "  keyed writes applied: {} for {TASKS} tasks (unkeyed {}); refund calls received {refund_calls}, duplicates received and deduplicated {} on {} keys; tasks with exactly one key: {one_key_each}; tool calls refused 401: {}",
        counters.writes_applied,
        counters.writes_unkeyed,
        counters.duplicates,
        counters.duplicates_per_key.len(),
        counters.unauthorized
    );
    println!(
        "  model calls: {} in all ({} expected without interruptions), re-paid {repaid_total} on {repaid_tasks} tasks (allowed: at most one per interruption); unattributed {unattributed}",
        model_calls.values().sum::<u32>(),
        3 * TASKS
    );
    println!(
        "  writes accepted from a stale attempt: {}; completions of completed tasks answered 200 as no-ops: {}",
        audit.accepted.len(),
        audit.noop_completes
    );
    println!("  refusals by the engine: {refusals:?}");

    assert!(
        not_once.is_empty(),
        "not completed exactly once: {not_once:?}"
    );
    assert_eq!(
        counters.writes_applied, TASKS as u64,
        "every keyed write applied once"
    );
    assert_eq!(counters.writes_unkeyed, 0);
    assert_eq!(one_key_each, TASKS, "one key per task");
    assert!(
        over_budget.is_empty(),
        "model calls re-paid too often: {over_budget:?}"
    );
    assert_eq!(unattributed, 0);
    assert!(
        audit.accepted.is_empty(),
        "stale writes accepted: {:?}",
        audit.accepted
    );
    // A holder re-sends its complete only under the same key (the engine replays it and runs
    // nothing), so no complete of a completed task is executed again, even as a no-op; one from
    // another holder is in `accepted` above.
    assert_eq!(
        audit.noop_completes, 0,
        "completes executed on completed tasks by their completer"
    );
    assert!(
        kills >= 2 && freezes >= 2,
        "the chaos ran: {kills} kills, {freezes} freezes"
    );
    assert!(interrupted_tasks > 0, "the chaos interrupted tasks");
    stack.shutdown().await;
}
