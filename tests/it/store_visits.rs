//! The run store's fencing token and visit rule against real PostgreSQL, played as an attacker
//! would: a holder frozen past its lease whose run was deleted
//! (finished with a retention of 0, or swept as abandoned) and created again under the same key
//! by a new visit, then woken; a second live token at the same node; a next visit that races the
//! previous visit's finish; a task whose input is not the waiting conversation's.
//!
//! The rule itself is `src/store/admission.rs` (unit-tested there); these tests hold the SQL
//! that feeds it and the claims that follow.

use std::time::Duration;

use abada_agent_worker::engine::{AppendOutcome, JournalStep};
use abada_agent_worker::store::{
    ClaimRefusal, Claimant, ErrorClass, Fence, FenceReason, InputDigest, PgRunStore, RunEnd,
    RunKey, StoreError,
};
use serde_json::json;

use crate::support::steps::{INSTRUCTIONS, answer, asks_refund, input};

use crate::store::{FIRST_ATTEMPT, TestDb, config, connect};

const VISIT: &str = "process/pi-1/refundAgent";

fn visit() -> RunKey {
    RunKey::for_visit(VISIT).unwrap()
}

/// Task `task` on worker `worker`, holding a visit's run for 30 s after its latest write.
fn task(worker: &'static str, task: &'static str) -> Claimant<'static> {
    Claimant {
        worker_id: worker,
        task_id: task,
        hold: Duration::from_secs(30),
    }
}

/// The fence of a claim of the visit's run that must succeed: task `task_id` on `worker`,
/// offering the input step of `text`.
async fn first_claim(
    store: &PgRunStore,
    worker: &'static str,
    task_id: &'static str,
    text: &str,
) -> Fence {
    store
        .claim(&visit(), &task(worker, task_id), Some(&input(text)))
        .await
        .unwrap()
        .fence
}

fn approval_requested(seq: u64, task_id: &str) -> JournalStep {
    JournalStep {
        seq,
        kind: "approval".into(),
        state: "requested".into(),
        key: None,
        data: json!({"callId": "call_0", "taskId": task_id}),
    }
}

/// The steps of the visit's run as the store holds them: (seq, attempt, body).
async fn rows(db: &TestDb) -> Vec<(i64, i64, serde_json::Value)> {
    db.sql()
        .await
        .query(
            "SELECT seq, attempt, body::text FROM abada_agent_steps WHERE run_key = $1 ORDER BY seq",
            &[&VISIT],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            let body: String = r.get(2);
            (r.get(0), r.get(1), serde_json::from_str(&body).unwrap())
        })
        .collect()
}

/// The run row's (attempt, owner, holder task).
async fn run_row(db: &TestDb) -> (i64, String, Option<String>) {
    let row = db
        .sql()
        .await
        .query_one(
            "SELECT attempt, owner, holder_task FROM abada_agent_runs WHERE run_key = $1",
            &[&VISIT],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

fn assert_stale(e: &StoreError, stale: u64) {
    assert_eq!(e.class(), ErrorClass::Fenced, "{e:?}");
    assert!(
        matches!(e, StoreError::Fenced { attempt, reason: FenceReason::StaleAttempt { current }, .. }
            if *attempt == stale && *current > stale),
        "{e:?}"
    );
}

/// The frozen holder wakes after its run was deleted and created again under the same key by a
/// new visit, which reached the very version and seq the holder expects. On main the new row
/// started again at attempt 1, version 1: the holder's compare-and-set matched and its step went
/// into the new visit's conversation.
#[tokio::test]
async fn a_frozen_holder_is_fenced_from_a_run_recreated_after_finishing_deleted_it() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let cfg = config(&db.url);
    assert!(cfg.retention.is_zero(), "the default retention deletes");
    let (store, _) = connect(&cfg).await;

    // t-1's run: the frozen holder's copy of the fence is taken right after its claim; the
    // worker's other copy (its redelivery, say) answers and finishes, which deletes the run.
    let mut holder = first_claim(&store, "w-a", "t-1", "refund o-1").await;
    let frozen = holder.clone();
    assert!(frozen.attempt() >= FIRST_ATTEMPT);
    store
        .append(&mut holder, &answer(2, "refunded o-1"))
        .await
        .unwrap();
    store.finish(&holder, RunEnd::Completed).await.unwrap();
    assert!(rows(&db).await.is_empty(), "retention 0 deleted the run");

    let mut frozen_copy = frozen.clone();
    let new = store
        .claim(&visit(), &task("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(new.created);
    assert_eq!(
        (new.fence.version(), new.fence.next_seq()),
        (frozen.version(), frozen.next_seq())
    );
    let e = store
        .append(&mut frozen_copy, &answer(2, "late: refund o-1"))
        .await
        .unwrap_err();
    assert_stale(&e, frozen.attempt());
    let steps = rows(&db).await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].2["input"], "refund o-2");
    assert_eq!(steps[0].1 as u64, new.fence.attempt());
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn a_frozen_holder_is_fenced_from_a_run_recreated_after_the_sweep_deleted_it() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    // Held by t-1, then silent for 31 days: swept as abandoned.
    let held = store
        .claim(&visit(), &task("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap();
    db.sql()
        .await
        .execute(
            "UPDATE abada_agent_runs SET updated_at = now() - interval '31 days'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(store.sweep().await.unwrap().abandoned, 1);
    assert!(rows(&db).await.is_empty(), "swept as abandoned");

    let frozen = held.fence;
    let mut frozen_copy = frozen.clone();
    let new = store
        .claim(&visit(), &task("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(new.created);
    assert!(new.fence.attempt() > frozen.attempt());
    assert_eq!(
        (new.fence.version(), new.fence.next_seq()),
        (frozen.version(), frozen.next_seq()),
        "only the attempt tells the new run from the deleted one"
    );
    let e = store
        .append(&mut frozen_copy, &answer(2, "late: refund o-1"))
        .await
        .unwrap_err();
    assert_stale(&e, frozen.attempt());
    let e = store.finish(&frozen, RunEnd::Completed).await.unwrap_err();
    assert_stale(&e, frozen.attempt());
    let steps = rows(&db).await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].2["input"], "refund o-2");
    let mut fence = new.fence;
    assert_eq!(
        store
            .append(&mut fence, &answer(2, "refunded o-2"))
            .await
            .unwrap(),
        AppendOutcome::Created
    );
    drop(store);
    db.drop().await;
}

/// Two tokens at one node (parallel branches) share a visit's key: the second task is refused
/// while the first is live, and the first goes on undisturbed. On main the second claim took the
/// run (fencing the first) and resumed the first token's conversation as its own.
#[tokio::test]
async fn a_second_live_token_at_the_node_is_refused_and_the_holder_goes_on() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, metrics) = connect(&config(&db.url)).await;
    let mut first = first_claim(&store, "w-a", "t-1", "refund o-1").await;
    store.append(&mut first, &asks_refund(2)).await.unwrap();
    let before = run_row(&db).await;

    for input_text in ["refund o-1", "refund o-2"] {
        let e = store
            .claim(&visit(), &task("w-b", "t-2"), Some(&input(input_text)))
            .await
            .unwrap_err();
        assert_eq!(e.class(), ErrorClass::Refused, "{e:?}");
        assert!(
            matches!(&e, StoreError::Refused { task_id, reason, .. }
                if task_id == "t-2"
                    && matches!(reason.as_ref(), ClaimRefusal::HeldByAnotherTask { holder, .. } if holder == "t-1")),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "run {VISIT}: task t-2 may not take the run: task t-1 holds the run and claimed or wrote it within the last 30000 ms"
            )
        );
    }
    assert_eq!(run_row(&db).await, before, "a refusal changes nothing");
    assert_eq!(
        metrics
            .store_errors
            .get_or_create(&abada_agent_worker::metrics::StoreErrorLabels {
                operation: "claim",
                class: "refused",
            })
            .get(),
        2
    );
    // The holder is not fenced: its next step is written.
    assert_eq!(
        store
            .append(
                &mut first,
                &JournalStep {
                    seq: 3,
                    kind: "tool".into(),
                    state: "started".into(),
                    key: Some("abada:t-1:3".into()),
                    data: json!({"callId": "call_0", "server": "orders", "tool": "issue_refund",
                                 "arguments": {"orderId": "o-1", "amountCents": 4200}}),
                }
            )
            .await
            .unwrap(),
        AppendOutcome::Created
    );

    // Silent for longer than the hold (a lock duration): the other task begins the run afresh,
    // and the silent holder, if it wakes, is fenced.
    db.sql()
        .await
        .execute(
            "UPDATE abada_agent_runs SET updated_at = now() - interval '31 seconds'",
            &[],
        )
        .await
        .unwrap();
    let taken = store
        .claim(&visit(), &task("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(
        taken.created,
        "begun again: t-1's conversation is not t-2's"
    );
    assert_eq!(taken.steps, vec![input("refund o-2")]);
    let e = store
        .append(&mut first, &answer(4, "late"))
        .await
        .unwrap_err();
    assert_stale(&e, first.attempt());
    assert_eq!(run_row(&db).await.2.as_deref(), Some("t-2"));
    drop(store);
    db.drop().await;
}

/// Many tokens reach the node at the same instant, none of them seeing a run: exactly one
/// begins it, every other is refused, none fails otherwise (the insert race is settled by the
/// rule, not by an error).
#[tokio::test]
async fn tokens_claiming_a_new_visit_at_once_leave_exactly_one_holder() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    const TASKS: [&str; 8] = ["t-0", "t-1", "t-2", "t-3", "t-4", "t-5", "t-6", "t-7"];
    let step = input("refund o-1");
    let claims = TASKS.map(|t| {
        let store = store.clone();
        let step = step.clone();
        tokio::spawn(async move {
            store
                .claim(&visit(), &task("w", t), Some(&step))
                .await
                .map(|c| (t, c.created))
        })
    });
    let mut holders = Vec::new();
    for claim in claims {
        match claim.await.unwrap() {
            Ok((t, created)) => {
                assert!(created);
                holders.push(t);
            }
            Err(e) => assert_eq!(e.class(), ErrorClass::Refused, "{e:?}"),
        }
    }
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(run_row(&db).await.2.as_deref(), Some(holders[0]));
    assert_eq!(rows(&db).await.len(), 1);
    drop(store);
    db.drop().await;
}

/// The previous visit's final answer is journaled but its finish failed (or has not run yet:
/// the engine created the next visit's task first). The next task starts over with a fresh
/// attempt: on main it replayed the old answer and completed at once, without a model call.
/// The task that wrote the answer, claiming again (its completion was lost), still finds it.
#[tokio::test]
async fn an_answered_visit_is_never_replayed_into_the_next_task() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut first = first_claim(&store, "w-a", "t-1", "refund o-1").await;
    store
        .append(&mut first, &answer(2, "refunded o-1"))
        .await
        .unwrap();

    let again = store
        .claim(&visit(), &task("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(
        again.steps.len(),
        2,
        "its own answer, for its own redelivery"
    );

    // The same input, even: a loop back to the node without a loop counter.
    let next = store
        .claim(&visit(), &task("w-b", "t-2"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(next.created);
    assert_eq!(next.steps, vec![input("refund o-1")]);
    assert!(next.fence.attempt() > again.fence.attempt());
    // The late finish of the previous visit is refused and leaves the new run alone.
    let e = store
        .finish(&again.fence, RunEnd::Completed)
        .await
        .unwrap_err();
    assert_stale(&e, again.fence.attempt());
    assert_eq!(rows(&db).await.len(), 1);
    drop(store);
    db.drop().await;
}

/// A conversation waiting for a person's decision is resumed by the next task of the visit only
/// when that task's rendered input is the journaled one; otherwise the claim is refused naming
/// both SHA-256 digests, and the waiting run is left exactly as it was. On main any task under
/// the key resumed it.
#[tokio::test]
async fn a_waiting_visit_resumes_only_for_the_same_input_and_names_both_digests() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut first = first_claim(&store, "w-a", "t-1", "refund o-1").await;
    store.append(&mut first, &asks_refund(2)).await.unwrap();
    store
        .append(&mut first, &approval_requested(3, "t-1"))
        .await
        .unwrap();
    let waiting = run_row(&db).await;

    let e = store
        .claim(
            &visit(),
            &task("w-b", "t-2"),
            Some(&input("refund o-2 instead")),
        )
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Refused);
    let journaled = InputDigest::of(INSTRUCTIONS, "refund o-1");
    let offered = InputDigest::of(INSTRUCTIONS, "refund o-2 instead");
    assert_eq!(
        e.to_string(),
        format!(
            "run {VISIT}: task t-2 may not take the run: the run was started with input {journaled}, this task renders {offered} (SHA-256 of the rendered instructions and input)"
        )
    );
    assert_eq!(run_row(&db).await, waiting, "the waiting run is untouched");
    assert_eq!(rows(&db).await.len(), 3);

    let decision = store
        .claim(&visit(), &task("w-b", "t-3"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(!decision.created);
    assert_eq!(
        decision.steps.len(),
        3,
        "the decision task resumes the waiting run"
    );
    assert_eq!(run_row(&db).await.2.as_deref(), Some("t-3"));
    drop(store);
    db.drop().await;
}

/// End to end on the worked example's process: the person's user task also rewrites the variable
/// the agent's input reads (`orderId`), as any task between two visits of the node may. The task
/// carrying the decision renders another input than the waiting conversation's: it becomes an
/// incident naming both digests, with no model call and nothing performed. On main it resumed
/// the conversation about o-1 while its process now said o-2.
#[tokio::test]
async fn a_decision_task_whose_input_changed_is_an_incident_naming_both_digests() {
    use abada_agent_worker::devkit::engine::{ProcessModel, ProtocolLevel, TaskStatus};
    use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};

    let Some(db) = TestDb::create().await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let mut agent = stack.refund_agent("openai/refund", &[]);
    agent["approval"] = json!("writes");
    let instructions = agent["instructions"].as_str().unwrap().to_string();
    stack
        .engine
        .deploy(ProcessModel::refund_approval(Some(agent)));
    let mut variables = serde_json::Map::new();
    variables.insert("orderId".into(), json!("o-1"));
    let instance = stack
        .engine
        .start_process("refundApproval", variables)
        .unwrap();
    let mut options = WorkerOptions::new("w1", 2);
    options.lock_duration = Duration::from_secs(10);
    options.poll_interval = Duration::from_millis(50);
    options.shutdown_grace = Duration::from_millis(200);
    options.env = vec![("ABADA_AGENT_STORE_URL".into(), db.url.render())];
    let worker = stack.spawn_worker(options, Stack::fast_agent_settings());
    let waiting = tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            e.process_instance(&instance)
                .filter(|v| v.current_activity_id == "approveRefund")
        }),
    )
    .await
    .expect("the agent stops for approval");
    let request = &waiting.variables["agentApprovalRequest"];
    let model_calls = stack.model.total_calls();

    // The approver's completion: a decision, and another order id.
    let http = reqwest::Client::new();
    let api = stack.engine.base_url();
    let tasks: Vec<serde_json::Value> = http
        .get(format!("{api}/v1/tasks?status=AVAILABLE"))
        .header("X-User", "dana")
        .header("X-Groups", "refund-approvers")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let user_task = tasks
        .iter()
        .find(|t| t["processInstanceId"] == instance.as_str())
        .expect("the user task is listed for an approver");
    let completion = json!({
        "agentApproval": {"callId": request["callId"], "requestId": request["requestId"],
                          "approved": true, "comment": "ok", "decidedBy": "dana"},
        "orderId": "o-2",
    });
    let r = http
        .post(format!(
            "{api}/v1/tasks/complete?taskId={}",
            user_task["id"].as_str().unwrap()
        ))
        .header("X-User", "dana")
        .header("X-Groups", "refund-approvers")
        .json(&completion)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let failed = tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            e.tasks()
                .into_iter()
                .find(|t| t.process_instance_id == instance && t.status == TaskStatus::Failed)
        }),
    )
    .await
    .expect("the decision's task becomes an incident");
    assert_eq!(failed.retries, Some(0), "an incident");
    let message = failed.error_message.clone().unwrap_or_default();
    let details = failed.error_details.clone().unwrap_or_default();
    assert!(message.contains("input differs"), "{message}");
    let journaled = InputDigest::of(&instructions, "o-1");
    let offered = InputDigest::of(&instructions, "o-2");
    assert!(
        details.contains(&journaled.to_string()) && details.contains(&offered.to_string()),
        "{details}"
    );
    assert_eq!(stack.model.total_calls(), model_calls, "no model call");
    assert_eq!(stack.tools.counters().await.writes_applied, 0);
    worker.stop().await;
    stack.shutdown().await;
    db.drop().await;
}

/// A claim that waits for another claim's lock on the run decides on the run as that claim left
/// it, never on the journal as it was before: here the other claim (played by the test's own
/// transaction) gave a waiting conversation to task t-9, begun afresh, while t-2's claim waited.
/// t-2 must be refused (t-9 is live), not resume as if the run still waited for a decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_for_another_decides_on_the_run_as_it_was_left() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut first = first_claim(&store, "w-a", "t-1", "refund o-1").await;
    store.append(&mut first, &asks_refund(2)).await.unwrap();
    store
        .append(&mut first, &approval_requested(3, "t-1"))
        .await
        .unwrap();

    let mut other = db.sql().await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM abada_agent_runs WHERE run_key = $1 FOR UPDATE",
        &[&VISIT],
    )
    .await
    .unwrap();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .claim(&visit(), &task("w-b", "t-2"), Some(&input("refund o-1")))
                .await
        })
    };
    let watcher = db.sql().await;
    crate::support::emulator_worker::within("t-2's claim to wait for the lock", async {
        loop {
            let n: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if n == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tx.batch_execute(&format!(
        "DELETE FROM abada_agent_steps WHERE run_key = '{VISIT}';
         UPDATE abada_agent_runs SET holder_task = 't-9', attempt = nextval('abada_agent_run_attempts'),
                version = version + 1, next_seq = 2, journal_bytes = 2, updated_at = now()
          WHERE run_key = '{VISIT}';
         INSERT INTO abada_agent_steps (run_key, seq, attempt, run_version, kind, state, body)
              SELECT run_key, 1, attempt, version, 'input', 'finished',
                     '{{\"instructions\": \"{INSTRUCTIONS}\", \"input\": \"refund o-1\"}}'
                FROM abada_agent_runs WHERE run_key = '{VISIT}';"
    ))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let e = waiting.await.unwrap().unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused { reason, .. }
            if matches!(reason.as_ref(), ClaimRefusal::HeldByAnotherTask { holder, .. } if holder == "t-9")),
        "{e:?}"
    );
    assert_eq!(run_row(&db).await.2.as_deref(), Some("t-9"));
    drop(store);
    db.drop().await;
}
