//! Keys when no journal exists: on an engine without a journal (and no run
//! store), a run that dies after its keyed write starts over on the next worker; the write it
//! sends again carries the same content-derived key, so the tool server deduplicates it, while
//! a write whose content differs gets another key and is applied. The real binary is killed
//! with SIGKILL mid-task; a second worker finishes.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskSpec, TaskStatus};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Map, json};

use crate::support::process::{WorkerProcess, stack_env};

const LIMIT: Duration = Duration::from_secs(30);

/// Look up, refund (its `reason` as `reason` says), then answer.
fn script(reason: &str) -> Script {
    Script::new(vec![
        Turn::call("lookup_order", json!({"orderId": "${input}"})),
        Turn::call(
            "issue_refund",
            json!({"orderId": "${input}", "amountCents": 1500, "reason": reason}),
        ),
        Turn::text(r#"{"decision": "refunded", "orderId": "${input}"}"#),
    ])
    .with_usage(10, 5)
}

async fn killed_after_its_write_then_finished_by_another(model: &str, order: &str) -> Stack {
    let s = Stack::start(ProtocolLevel::AgentV1WithoutJournal)
        .await
        .unwrap();
    s.model.set_script(
        model,
        script(if model == "same" {
            "damaged"
        } else {
            "damaged, call ${call_index}"
        }),
    );
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    let id = s.engine.create_task(TaskSpec {
        variables,
        agent: Some(s.refund_agent(&format!("openai/{model}"), &[])),
        retries: Some(3),
        ..TaskSpec::default()
    });
    let mut env = stack_env(&s, "w-killed");
    env.push(("ABADA_AGENT_LOCK_DURATION_MS".into(), "5000".into()));
    // The first write is applied and its answer held: the worker is killed between its write
    // and anything after it.
    s.tools.hold_next_write();
    let mut first = WorkerProcess::spawn(&env).await;
    tokio::time::timeout(LIMIT, s.tools.holding())
        .await
        .expect("the first write applied and held");
    assert_eq!(s.tools.counters().await.writes_applied, 1);
    first.signal("KILL");
    first.wait(Duration::from_secs(10)).await;
    s.tools.release_held();
    assert_eq!(
        s.engine.task(&id).unwrap().status,
        TaskStatus::Locked,
        "killed before completing"
    );
    s.engine.advance(Duration::from_secs(6));
    let mut opts = WorkerOptions::new("w-second", 2);
    opts.poll_interval = Duration::from_millis(100);
    let second = s.spawn_worker(opts, Stack::fast_agent_settings());
    tokio::time::timeout(LIMIT, async {
        s.engine
            .wait_for(|e| e.task(&id).filter(|t| t.status == TaskStatus::Completed))
            .await
    })
    .await
    .expect("the second worker completes the task");
    let view = s.engine.task(&id).unwrap();
    assert_eq!(view.attempt, 2);
    assert!(view.journal.is_empty(), "no journal on this engine");
    second.stop().await;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identical_write_resent_after_a_crash_is_deduplicated() {
    let s = killed_after_its_write_then_finished_by_another("same", "o-ck-1").await;
    let keys: Vec<String> = s
        .tools
        .calls()
        .into_iter()
        .filter(|c| c.tool == "issue_refund")
        .map(|c| c.idempotency_key.expect("a keyed write"))
        .collect();
    assert_eq!(keys.len(), 2, "sent by both runs");
    assert_eq!(keys[0], keys[1], "the same key");
    assert!(
        keys[0].contains(":h:") && keys[0].ends_with(":1"),
        "{}",
        keys[0]
    );
    let c = s.tools.counters().await;
    assert_eq!((c.writes_applied, c.duplicates), (1, 1));
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_write_after_a_crash_is_not_deduplicated() {
    let s = killed_after_its_write_then_finished_by_another("varying", "o-ck-2").await;
    let keys: Vec<String> = s
        .tools
        .calls()
        .into_iter()
        .filter(|c| c.tool == "issue_refund")
        .map(|c| c.idempotency_key.expect("a keyed write"))
        .collect();
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1], "other content, other key");
    let c = s.tools.counters().await;
    assert_eq!((c.writes_applied, c.duplicates), (2, 0));
    s.shutdown().await;
}
