//! The one invariant checker on runs on the wire (`abada_sim::observed`, through
//! `support::invariants`) and the crash tests' audit (`support::chaos`): each must catch what it
//! exists to catch. Each test plays a worker's calls by hand against the engine emulator (and,
//! where an invariant reads them, what a tool server received and what a worker showed),
//! breaking one rule, and expects the checker to name the violation; a control beside it keeps
//! to the rule and must pass. Every promise the fault suite relies on is shown firing here, on
//! a trace written from the emulator's log; `tests/it/sim.rs` shows the same checker firing on
//! hand-played simulator traces.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{self, EmulatorOptions, Fault, TaskSpec};
use abada_agent_worker::devkit::tools::CallRecord as ToolCallRecord;
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::runner::RunnerEvent;
use serde_json::{Value, json};

use crate::support::chaos::audit_stale_writes;
use crate::support::invariants::{
    Expect, Report, Stamped, ToolObservation, WorkerObservation, check_invariants, check_observed,
};
use abada_sim::invariants::{
    AFTER_LOSS, ALL_ENDED, ENDS_AGREE, HEALTHY_LEASES, KEYS_RESENT, MEMORY_BOUNDED,
    NOTHING_PANICKED, ONE_COMPLETION, SLOTS,
};

/// The lease every hand-played fetch asks for.
const LOCK_MS: u64 = 10_000;

async fn post(emu: &engine::EngineEmulator, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/external-tasks/{path}", emu.base_url()))
        .header("X-Abada-Worker-Protocol-Version", "1")
        .json(&body)
        .send()
        .await
        .expect("the emulator answers");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn task() -> TaskSpec {
    TaskSpec {
        agent: Some(json!({"model": "openai/m", "input": "x"})),
        retries: Some(3),
        ..TaskSpec::default()
    }
}

async fn emulator() -> engine::EngineEmulator {
    engine::start(EmulatorOptions::default()).await.unwrap()
}

/// Fetches up to `n` tasks for `worker`; returns their ids.
async fn fetch(emu: &engine::EngineEmulator, worker: &str, n: u32) -> Vec<String> {
    let (status, locked) = post(
        emu,
        "fetch-and-lock",
        json!({"workerId": worker, "topics": ["abada:agent"], "lockDuration": LOCK_MS, "maxTasks": n}),
    )
    .await;
    assert_eq!(status, 200, "{locked}");
    locked
        .as_array()
        .expect("a list of tasks")
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_string())
        .collect()
}

async fn complete(emu: &engine::EngineEmulator, id: &str, worker: &str, attempt: u32) -> u16 {
    post(
        emu,
        &format!("{id}/complete"),
        json!({"workerId": worker, "attempt": attempt, "variables": {}}),
    )
    .await
    .0
}

async fn heartbeat(
    emu: &engine::EngineEmulator,
    id: &str,
    worker: &str,
    attempt: u32,
) -> (u16, Value) {
    post(
        emu,
        &format!("{id}/heartbeat"),
        json!({"workerId": worker, "attempt": attempt, "lockDuration": LOCK_MS}),
    )
    .await
}

async fn append(emu: &engine::EngineEmulator, id: &str, worker: &str, attempt: u32, step: Value) {
    let (status, body) = post(
        emu,
        &format!("{id}/journal"),
        json!({"workerId": worker, "attempt": attempt, "step": step}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
}

/// Moves the emulator's clock past every lease.
fn expire_leases(emu: &engine::EngineEmulator) {
    emu.advance(Duration::from_millis(LOCK_MS + 1_000));
}

/// Asserts that invariant `name` names each of `names` (one violation each at least) and
/// nothing that names one of `clean`.
fn assert_fires(report: &Report, name: &str, names: &[&str], clean: &[&str]) {
    let v = report.violations(name);
    for expected in names {
        assert!(
            v.iter().any(|line| line.contains(expected)),
            "{name:?} does not name {expected}: {v:?}"
        );
    }
    for kept in clean {
        assert!(
            !v.iter().any(|line| line.contains(kept)),
            "{name:?} names {kept}, which kept the rule: {v:?}"
        );
    }
    assert!(!report.passed());
}

fn worker(id: &str) -> WorkerObservation {
    WorkerObservation {
        worker_id: id.into(),
        max_tasks: 2,
        slot_samples: vec![0],
        ..WorkerObservation::default()
    }
}

fn ended(emu: &engine::EngineEmulator, id: &str, attempt: u32, outcome: TaskEnd) -> Stamped {
    Stamped {
        at: emu.now(),
        event: RunnerEvent::TaskEnded {
            task_id: id.into(),
            attempt: Some(attempt),
            outcome,
        },
    }
}

fn refund_call(key: Option<&str>, order: &str) -> ToolCallRecord {
    ToolCallRecord {
        tool: "issue_refund".into(),
        arguments: json!({"orderId": order, "amountCents": 1500}),
        idempotency_key: key.map(str::to_string),
        traceparent: None,
        token: None,
        session_id: None,
    }
}

fn tool_started(seq: u64, key: &str) -> Value {
    json!({"seq": seq, "kind": "tool", "state": "started", "key": key,
        "data": {"callId": "c1", "server": "orders", "tool": "issue_refund", "arguments": {}}})
}

fn tool_finished(seq: u64, key: &str) -> Value {
    json!({"seq": seq, "kind": "tool", "state": "finished", "key": key,
        "data": {"callId": "c1", "server": "orders", "tool": "issue_refund", "result": {}}})
}

/// One completion: a second `complete` of a completed task (the engine answers 200 and does
/// nothing) is a second completion sent.
#[tokio::test]
async fn one_completion_fires_on_a_task_completed_twice_by_its_holder() {
    let emu = emulator().await;
    let twice = emu.create_task(task());
    let once = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 2).await.len(), 2);
    for id in [&twice, &once, &twice] {
        assert_eq!(complete(&emu, id, "w1", 1).await, 200);
    }
    let report = check_invariants(&emu, &[], &[], &Expect::default()).await;
    assert_fires(&report, ONE_COMPLETION, &[&twice], &[&once]);
    emu.shutdown().await;
}

/// Keyed writes re-sent only after an interruption: a key sent twice with no interruption between its `tool/started` and
/// `finished` steps, a key a journaled task never journaled, a content key re-sent without a
/// re-delivery, and an unkeyed write all fire; a key re-sent once after the one interruption its
/// journal shows does not.
#[tokio::test]
async fn keys_resent_fires_on_a_keyed_write_re_sent_without_an_interruption() {
    let emu = emulator().await;
    let same_attempt = emu.create_task(task());
    let interrupted = emu.create_task(task());
    let unjournaled = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 3).await.len(), 3);
    let key_a = format!("abada:{same_attempt}:1");
    let key_b = format!("abada:{interrupted}:1");
    let key_c = format!("abada:{unjournaled}:h:00ff:1");
    let stray = format!("abada:{interrupted}:7");
    // Started and finished in attempt 1: no interruption.
    append(&emu, &same_attempt, "w1", 1, tool_started(1, &key_a)).await;
    append(&emu, &same_attempt, "w1", 1, tool_finished(2, &key_a)).await;
    assert_eq!(complete(&emu, &same_attempt, "w1", 1).await, 200);
    // Started in attempt 1, the lease lost, finished in attempt 2: one interruption.
    append(&emu, &interrupted, "w1", 1, tool_started(1, &key_b)).await;
    expire_leases(&emu);
    assert_eq!(fetch(&emu, "w2", 1).await, vec![interrupted.clone()]);
    append(&emu, &interrupted, "w2", 2, tool_finished(2, &key_b)).await;

    let orders = ToolObservation {
        server: "orders".into(),
        calls: vec![
            refund_call(Some(&key_a), "o-a"),
            refund_call(Some(&key_a), "o-a"),
            refund_call(Some(&key_b), "o-b"),
            refund_call(Some(&key_b), "o-b"),
            refund_call(Some(&key_b), "o-b"),
            refund_call(Some(&key_c), "o-c"),
            refund_call(Some(&key_c), "o-c"),
            refund_call(Some(&stray), "o-s"),
        ],
        writes_unkeyed: 1,
    };
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        std::slice::from_ref(&orders),
        &[],
        &Expect::default(),
    );
    assert_fires(
        &report,
        KEYS_RESENT,
        &[
            &format!("key {key_a} sent 2 times, 1 allowed"),
            &format!("key {key_b} sent 3 times, 2 allowed"),
            &format!("key {key_c} sent 2 times, 1 allowed"),
            &format!("key {stray} sent, but its journal"),
            "1 writes without an idempotency key",
        ],
        &[],
    );

    // The control: only the interrupted key re-sent, once.
    let clean = ToolObservation {
        server: "orders".into(),
        calls: vec![
            refund_call(Some(&key_a), "o-a"),
            refund_call(Some(&key_b), "o-b"),
            refund_call(Some(&key_b), "o-b"),
        ],
        writes_unkeyed: 0,
    };
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[clean],
        &[],
        &Expect::default(),
    );
    assert_eq!(report.violations(KEYS_RESENT), Vec::<String>::new());
    // A third send of the interrupted key is one more than its one interruption allows.
    let thrice = ToolObservation {
        server: "orders".into(),
        calls: vec![refund_call(Some(&key_b), "o-b"); 3],
        writes_unkeyed: 0,
    };
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[thrice],
        &[],
        &Expect::default(),
    );
    assert_fires(
        &report,
        KEYS_RESENT,
        &[&format!("key {key_b} sent 3 times, 2 allowed")],
        &[],
    );
    emu.shutdown().await;
}

/// Slots: the slot gauge above the slots, a slot still in use at the end, and a task
/// started that never ended.
#[test]
fn slots_fire_on_a_leaked_slot() {
    let mut leaky = worker("w-leaky");
    leaky.slot_samples = vec![0, 3, 1];
    leaky.events.push(Stamped {
        at: chrono::Utc::now(),
        event: RunnerEvent::TaskStarted {
            task_id: "t-1".into(),
            attempt: Some(1),
        },
    });
    let report = check_observed(
        &[],
        &[],
        chrono::Utc::now(),
        &[],
        &[leaky, worker("w-fine")],
        &Expect::default(),
    );
    assert_fires(
        &report,
        SLOTS,
        &[
            "w-leaky: slots in use 3 outside 0..=2",
            "w-leaky: 1 slots still in use",
            "w-leaky: 1 tasks started, 0 ended",
        ],
        &["w-fine"],
    );
}

/// Healthy leases: a lease that ran out under a healthy task (a new attempt without an ending of
/// the one before, a heartbeat refused WORKER_LOCK_EXPIRED) and a `lease_lost` end the scenario
/// did not expect. The same calls pass when the scenario names the task.
#[tokio::test]
async fn healthy_leases_fire_on_the_lease_of_a_healthy_task_running_out() {
    let emu = emulator().await;
    let id = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 1).await, vec![id.clone()]);
    expire_leases(&emu);
    let (status, body) = heartbeat(&emu, &id, "w1", 1).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("WORKER_LOCK_EXPIRED"))
    );
    let mut w1 = worker("w1");
    w1.events.push(ended(&emu, &id, 1, TaskEnd::LeaseLost));
    assert_eq!(fetch(&emu, "w2", 1).await, vec![id.clone()]);
    assert_eq!(complete(&emu, &id, "w2", 2).await, 200);

    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[],
        &[w1.clone()],
        &Expect::default(),
    );
    assert_fires(
        &report,
        HEALTHY_LEASES,
        &[
            &format!("task {id}: attempt 1 was followed by attempt 2 without ending"),
            &format!("task {id}: heartbeat refused WORKER_LOCK_EXPIRED"),
            &format!("w1: task {id} ended lease_lost"),
        ],
        &[],
    );
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[],
        &[w1],
        &Expect::lease_loss([id.as_str()]),
    );
    assert_eq!(report.violations(HEALTHY_LEASES), Vec::<String>::new());
    emu.shutdown().await;
}

/// No call after a loss: a `complete` after the engine refused the attempt's heartbeat (injected, as a
/// refused heartbeat of a lease taken over), and any call after the worker's own `lease_lost`
/// end. The refusal used to be exempt whenever the attempt had a committed ending, so
/// the very `complete` that broke the rule hid it. A heartbeat refused because the attempt's own
/// `complete` ended the task first stays exempt.
#[tokio::test]
async fn after_loss_fires_on_an_ending_sent_after_a_refused_heartbeat() {
    let emu = emulator().await;
    let refused = emu.create_task(task());
    let own_ending = emu.create_task(task());
    let after_loss = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 3).await.len(), 3);
    emu.inject(Fault::RefuseHeartbeats {
        task_id: refused.clone(),
    });
    let (status, body) = heartbeat(&emu, &refused, "w1", 1).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("WORKER_LOCK_NOT_OWNED"))
    );
    emu.advance(Duration::from_millis(5));
    assert_eq!(
        complete(&emu, &refused, "w1", 1).await,
        200,
        "the emulator's fault refuses heartbeats only"
    );

    assert_eq!(complete(&emu, &own_ending, "w1", 1).await, 200);
    let (status, _) = heartbeat(&emu, &own_ending, "w1", 1).await;
    assert!(status >= 400, "a heartbeat on a completed task is refused");

    let mut w1 = worker("w1");
    w1.events
        .push(ended(&emu, &after_loss, 1, TaskEnd::LeaseLost));
    emu.advance(Duration::from_millis(5));
    let (status, _) = heartbeat(&emu, &after_loss, "w1", 1).await;
    assert!(matches!(status, 200 | 204), "{status}");

    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[],
        &[w1],
        &Expect::lease_loss([after_loss.as_str()]),
    );
    assert_fires(
        &report,
        AFTER_LOSS,
        &[
            &format!("complete about task {refused} by w1 attempt Some(1)"),
            "after heartbeat was refused WORKER_LOCK_NOT_OWNED",
            &format!(
                "w1: heartbeat about task {after_loss} attempt Some(1) after its lease was lost"
            ),
        ],
        &[&own_ending],
    );
    emu.shutdown().await;
}

/// A hole the checker once had: refusals of an attempt with a committed ending were all exempt, so
/// a `complete` sent after the journal refused a step (`JOURNAL_CONFLICT`) passed.
#[tokio::test]
async fn a_complete_after_a_journal_conflict_is_a_violation_even_though_it_committed() {
    let emu = emulator().await;
    let conflicted = emu.create_task(task());
    let clean = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 2).await.len(), 2);
    for id in [&conflicted, &clean] {
        let step = json!({"seq": 1, "kind": "input", "state": "finished", "data": {"instructions": "", "input": "x"}});
        append(&emu, id, "w1", 1, step).await;
    }
    let different = json!({"workerId": "w1", "attempt": 1, "step":
        {"seq": 1, "kind": "model", "state": "finished", "data": {}}});
    let (status, body) = post(&emu, &format!("{conflicted}/journal"), different).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("JOURNAL_CONFLICT"))
    );
    for id in [&conflicted, &clean] {
        assert_eq!(complete(&emu, id, "w1", 1).await, 200);
    }
    let report = check_invariants(&emu, &[], &[], &Expect::default()).await;
    let v = report.violations(AFTER_LOSS);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(
        v[0].contains(&conflicted) && v[0].contains("JOURNAL_CONFLICT"),
        "{v:?}"
    );
    assert!(!report.passed());
    emu.shutdown().await;
}

/// Every task ended or leased, and an end that agrees with the engine: a task left locked past its lease with no outcome, a worker that says it
/// completed a task the engine never heard of, and one that says `lease_lost` after reporting.
#[tokio::test]
async fn all_ended_and_ends_agree_fire_on_a_task_without_exactly_one_outcome() {
    let emu = emulator().await;
    let abandoned = emu.create_task(task());
    let reported = emu.create_task(task());
    let fine = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 3).await.len(), 3);
    assert_eq!(complete(&emu, &reported, "w1", 1).await, 200);
    assert_eq!(complete(&emu, &fine, "w1", 1).await, 200);
    let mut w1 = worker("w1");
    w1.events
        .push(ended(&emu, &abandoned, 1, TaskEnd::Completed));
    w1.events
        .push(ended(&emu, &reported, 1, TaskEnd::LeaseLost));
    expire_leases(&emu);
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[],
        &[w1],
        &Expect::lease_loss([reported.as_str()]),
    );
    assert_fires(
        &report,
        ALL_ENDED,
        &[&format!("task {abandoned} is Locked (attempt 1")],
        &[&fine],
    );
    assert_fires(
        &report,
        ENDS_AGREE,
        &[
            &format!("task {abandoned}: w1 attempt 1 ended completed at"),
            &format!("task {reported}: w1 attempt 1 ended lease_lost at"),
        ],
        &[&fine],
    );
    emu.shutdown().await;
}

/// Nothing panicked: a panic reported to the engine as a failure, and one in a worker's output.
#[tokio::test]
async fn nothing_panicked_fires_on_a_panic() {
    let emu = emulator().await;
    let id = emu.create_task(task());
    assert_eq!(fetch(&emu, "w1", 1).await, vec![id.clone()]);
    let (status, body) = post(
        &emu,
        &format!("{id}/failure"),
        json!({"workerId": "w1", "attempt": 1, "retries": 0,
            "errorMessage": "the handler failed: thread 'tokio-runtime-worker' panicked at src/x.rs:1:1"}),
    )
    .await;
    assert!(matches!(status, 200 | 204), "{status} {body}");
    let mut binary = worker("w-binary");
    binary.output = vec![
        "INFO started".into(),
        "thread 'main' panicked at src/main.rs:9:9".into(),
    ];
    let report = check_observed(
        &emu.calls(),
        &emu.tasks(),
        emu.now(),
        &[],
        &[binary, worker("w-fine")],
        &Expect::default(),
    );
    assert_fires(
        &report,
        NOTHING_PANICKED,
        &[&format!("task {id}: "), "w-binary: thread 'main' panicked"],
        &["w-fine"],
    );
    emu.shutdown().await;
}

/// Memory bounded: a peak resident memory over its bound.
#[test]
fn memory_bounded_fires_on_memory_over_its_bound() {
    let mut fat = worker("w-fat");
    fat.memory = Some((300_000, 200_000));
    let mut lean = worker("w-lean");
    lean.memory = Some((100_000, 200_000));
    let report = check_observed(
        &[],
        &[],
        chrono::Utc::now(),
        &[],
        &[fat, lean],
        &Expect::default(),
    );
    assert_fires(
        &report,
        MEMORY_BOUNDED,
        &["w-fat: peak resident memory 300000 KiB over the bound 200000 KiB"],
        &["w-lean"],
    );
}

/// The crash tests' audit: a holder whose lease ran out, woken after another worker completed
/// the task, sends `complete`; the engine answers 200 and does nothing (protocol.md A.2), yet
/// the stale holder reported. Once counted as a no-op; now a stale write. The
/// completer's own re-send stays a no-op.
#[tokio::test]
async fn the_audit_counts_a_stale_holders_complete_of_a_completed_task_as_a_stale_write() {
    let emu = emulator().await;
    let id = emu.create_task(task());
    assert_eq!(fetch(&emu, "w-frozen", 1).await, vec![id.clone()]);
    expire_leases(&emu);
    assert_eq!(fetch(&emu, "w-current", 1).await, vec![id.clone()]);
    assert_eq!(complete(&emu, &id, "w-current", 2).await, 200);
    assert_eq!(
        complete(&emu, &id, "w-current", 2).await,
        200,
        "the completer's re-send"
    );
    let audit = audit_stale_writes(&emu.calls(), true);
    assert_eq!(
        (audit.noop_completes, audit.accepted.len()),
        (1, 0),
        "{:?}",
        audit.accepted
    );

    assert_eq!(
        complete(&emu, &id, "w-frozen", 1).await,
        200,
        "the stale holder wakes"
    );
    let audit = audit_stale_writes(&emu.calls(), true);
    assert_eq!(audit.noop_completes, 1);
    assert_eq!(audit.accepted.len(), 1, "{:?}", audit.accepted);
    assert!(
        audit.accepted[0].contains("w-frozen"),
        "{:?}",
        audit.accepted
    );
    // On a plain v1 engine (worker ids only) the same log says the same.
    let audit = audit_stale_writes(&emu.calls(), false);
    assert_eq!((audit.noop_completes, audit.accepted.len()), (1, 1));
    emu.shutdown().await;
}
