//! Agent runs on a plain v1 engine (the emulator's 0.11 mode: no `attempt`, no agent/1) kept
//! durable by the run store, against a real PostgreSQL: a crashed run resumes without paying the
//! model again, a frozen worker whose run was claimed by another is refused by the store and
//! goes silent, and a store outage is waited out within the lease.
//!
//! The agents here call no tool: a plain engine issues no tool credential (protocol.md Part D),
//! and credentials from elsewhere are issue 13's tool-server registry. Keyed writes take their
//! key from the replayed journal whatever its home (`agent::run`), as `durable.rs` tests on
//! agent/1.

use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{Operation, ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::gate::{self, GatedEngine};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerHandle, WorkerOptions};
use abada_agent_worker::engine::TaskRef;
use async_trait::async_trait;
use tokio::sync::watch;

use crate::agent::{spec, wait_all_ended};
use crate::store::TestDb;
use crate::support::tcp_proxy::{Mode, TcpProxy};
use crate::support::wait::eventually;

/// Holds every `complete` of the worker behind it until `open` (the worker "crashes" there:
/// everything journaled, nothing reported).
#[derive(Default)]
struct HoldCompletes {
    open: watch::Sender<bool>,
    held: watch::Sender<u32>,
}

#[async_trait]
impl gate::Gate for HoldCompletes {
    async fn before(&self, op: gate::Op<'_>, _task: Option<&TaskRef>) {
        if matches!(op, gate::Op::Complete) && !*self.open.borrow() {
            self.held.send_modify(|n| *n += 1);
            let mut rx = self.open.subscribe();
            let _ = rx.wait_for(|open| *open).await;
        }
    }
}

/// Holds every heartbeat (the engine never hears from the worker again).
#[derive(Default)]
struct HoldHeartbeats;

#[async_trait]
impl gate::Gate for HoldHeartbeats {
    async fn before(&self, op: gate::Op<'_>, _task: Option<&TaskRef>) {
        if matches!(op, gate::Op::Heartbeat) {
            std::future::pending::<()>().await;
        }
    }
}

/// A one-turn answer, `latency` late.
fn one_turn(latency: Duration) -> Script {
    Script::new(vec![Turn::text(r#"{"decision": "refunded"}"#)])
        .with_usage(100, 20)
        .with_latency(latency)
}

/// An agents file for the plain engine (which sends no definition): a refund agent on `model`.
fn agents_file(model: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("abada-store-runs-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("agents.toml");
    std::fs::write(
        &path,
        format!(
            "[agents.\"abada:agent\"]\nmodel = \"{model}\"\ninstructions = \"You handle refund requests.\"\n\
             input = \"${{orderId}}\"\nresultVariable = \"refundDecision\"\nmaxTurns = 8\n"
        ),
    )
    .unwrap();
    path
}

fn opts(id: &str, store_url: &str, model: &str, lock: Duration) -> WorkerOptions {
    let mut o = WorkerOptions::new(id, 2);
    o.lock_duration = lock;
    o.poll_interval = Duration::from_millis(50);
    o.env = vec![
        ("ABADA_AGENT_STORE_URL".into(), store_url.into()),
        (
            "ABADA_AGENT_AGENTS_FILE".into(),
            agents_file(model).display().to_string(),
        ),
    ];
    o
}

fn metric_line(worker: &WorkerHandle, prefix: &str) -> Option<String> {
    worker
        .metrics
        .encode()
        .lines()
        .find(|l| l.starts_with(prefix))
        .map(str::to_string)
}

/// A worker that journaled the whole run in the store and then crashed before its completion
/// reached the engine: the next worker completes from the store's journal, paying no model
/// call, in two store transactions (claim, finish); the run is then deleted (retention 0).
#[tokio::test]
async fn a_crashed_run_resumes_from_the_store_without_paying_the_model_again() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url.render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("one-turn", one_turn(Duration::ZERO));
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/one-turn", &[]), "o-crash"));
    let lock = Duration::from_secs(30);
    let hold = Arc::new(HoldCompletes::default());
    let w1 = stack.spawn_worker_with(
        opts("w1", &url, "openai/one-turn", lock),
        Stack::fast_agent_settings(),
        GatedEngine::wrapper(hold.clone()),
    );
    let mut held = hold.held.subscribe();
    tokio::time::timeout(Duration::from_secs(30), held.wait_for(|n| *n >= 1))
        .await
        .expect("w1 reaches its completion")
        .unwrap();
    assert_eq!(stack.model.total_calls(), 1, "w1 paid the turn");
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_steps").await,
        2,
        "the input and the model's answer"
    );

    // w1 is gone as far as the engine knows: its lease runs out, w2 takes the task.
    stack.engine.advance(lock + Duration::from_secs(1));
    let w2 = stack.spawn_worker(
        opts("w2", &url, "openai/one-turn", lock),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(30)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.counters.acquisitions, 2);
    let result = view.result_variables.as_ref().unwrap();
    assert_eq!(result["refundDecision"]["decision"], "refunded");
    assert_eq!(result["agentUsage"]["turns"], 1);
    assert_eq!(stack.model.total_calls(), 1, "no model call paid again");
    // The run is finished once the completion is accepted; retention 0 deletes it.
    eventually(
        Duration::from_secs(20),
        "the finished run to be deleted",
        async || db.count("SELECT count(*) FROM abada_agent_runs").await == 0,
    )
    .await;
    let tx = |op: &str| {
        metric_line(
            &w2,
            &format!("abada_agent_store_transaction_duration_seconds_count{{operation=\"{op}\"}}"),
        )
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
    };
    assert_eq!(tx("claim").as_deref(), Some("1"));
    assert_eq!(tx("finish").as_deref(), Some("1"));
    assert_eq!(tx("append"), None, "nothing left to journal");

    // w1 wakes: its completion is refused by the engine, nothing of it accepted.
    hold.open.send_replace(true);
    w1.stop().await;
    w2.stop().await;
    assert_eq!(view.counters.completes, 1, "completed once");
    stack.shutdown().await;
    db.drop().await;
}

/// The seed story on the store: w1 is frozen inside its first model call (its heartbeats never
/// reach the engine); its lease runs out and w2 takes the task, claiming the run in the store.
/// When w1 wakes with the model's answer, the store refuses its append: its lease is marked
/// lost (RUN_STORE_FENCED) and it sends nothing more (no tool call, no model call, no report).
#[tokio::test]
async fn a_frozen_worker_is_refused_by_the_store_and_goes_silent() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url.render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack
        .model
        .set_script("slow-turn", one_turn(Duration::from_secs(15)));
    // w1's model call must outlast w2's whole run, not time out.
    stack.set_provider_request_timeout(Duration::from_secs(120));
    stack.model.set_script("one-turn", one_turn(Duration::ZERO));
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/one-turn", &[]), "o-seed"));
    let lock = Duration::from_secs(60);
    let w1 = stack.spawn_worker_with(
        opts("w1", &url, "openai/slow-turn", lock),
        Stack::fast_agent_settings(),
        GatedEngine::wrapper(Arc::new(HoldHeartbeats)),
    );
    eventually(
        Duration::from_secs(30),
        "w1 to be in its model call",
        async || stack.model.calls("slow-turn") >= 1,
    )
    .await;
    stack.engine.advance(lock + Duration::from_secs(1));
    let w2 = stack.spawn_worker(
        opts("w2", &url, "openai/one-turn", lock),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(30)).await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    assert_eq!(
        stack.model.calls("slow-turn"),
        1,
        "w1 is still in its model call (15 s) when w2 is done: the refusal below is the store's"
    );
    eventually(
        Duration::from_secs(30),
        "the store to refuse w1",
        async || {
            metric_line(
                &w1,
                "abada_agent_leases_lost_total{reason=\"RUN_STORE_FENCED\"}",
            )
            .is_some_and(|l| l.ends_with(" 1"))
        },
    )
    .await;
    // Its heartbeats are held for good: stop it without waiting for them.
    let _ = tokio::time::timeout(Duration::from_secs(10), w1.stop()).await;
    w2.stop().await;
    assert_eq!(stack.model.calls("slow-turn"), 1, "w1 asked the model once");
    let from_w1: Vec<_> = stack
        .engine
        .calls()
        .into_iter()
        .filter(|c| {
            c.worker_id.as_deref() == Some("w1")
                && matches!(
                    c.operation,
                    Operation::Complete | Operation::Failure | Operation::BpmnError
                )
        })
        .collect();
    assert!(from_w1.is_empty(), "w1 reported nothing: {from_w1:?}");
    assert_eq!(
        views[0].result_variables.as_ref().unwrap()["agentUsage"]["modelCalls"],
        1,
        "w2 paid its own turn only"
    );
    stack.shutdown().await;
    db.drop().await;
}

/// The store goes away mid-run (its connections cut, new ones refused) and comes back within
/// the lease: the task waits at its next append and then goes on, in the same attempt, paying
/// each model turn once.
#[tokio::test]
async fn a_store_outage_within_the_lease_is_waited_out() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let proxy = TcpProxy::start(db.url.addr()).await;
    let url = db.url.clone().at(proxy.addr).render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack
        .model
        .set_script("steady-turn", one_turn(Duration::from_millis(500)));
    let id = stack.engine.create_task(spec(
        stack.refund_agent("openai/steady-turn", &[]),
        "o-outage",
    ));
    let w = stack.spawn_worker(
        opts(
            "w-outage",
            &url,
            "openai/steady-turn",
            Duration::from_secs(60),
        ),
        Stack::fast_agent_settings(),
    );
    eventually(
        Duration::from_secs(30),
        "the first model call",
        async || stack.model.calls("steady-turn") >= 1,
    )
    .await;
    proxy.set(Mode::Down);
    eventually(
        Duration::from_secs(30),
        "appends to fail while the store is down",
        async || {
            metric_line(
                &w,
                "abada_agent_store_errors_total{operation=\"append\",class=\"transient\"}",
            )
            .is_some_and(|l| !l.ends_with(" 0"))
        },
    )
    .await;
    proxy.set(Mode::Forward);
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(60)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.counters.acquisitions, 1, "the same attempt went on");
    assert_eq!(
        stack.model.calls("steady-turn"),
        1,
        "the turn was paid once"
    );
    w.stop().await;
    stack.shutdown().await;
    db.drop().await;
}
