//! Two store transactions per one-turn task, against a real PostgreSQL: the
//! final step is appended at once, fenced (a stale holder is stopped before it reports); the
//! finish, once the engine accepted the task's end, is queued and rides with the next claim's
//! transaction, fenced by its attempt, or is flushed by an idle worker or by the drain. With a
//! retention of zero and above: a queued finish of a replaced attempt leaves the newer attempt's
//! run alone, a claim of a run whose finish is queued sees it finished (as it did when the
//! finish had a transaction of its own), and a crash that loses queued finishes leaves runs the
//! sweeper deletes and a redelivered task would resume, final answer included.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::store::{
    Claimant, Fence, FenceReason, MAX_PENDING_FINISHES, RunEnd, RunKey, StoreConfig, StoreError,
};
use tokio_util::sync::CancellationToken;

use crate::agent::{spec, wait_all_ended};
use crate::store::{TestDb, by, config, connect};
use crate::store_runs::{one_turn, opts};
use crate::support::steps::{answer, input};
use crate::support::wait::eventually;

fn key(name: &str) -> RunKey {
    RunKey::for_task(name).unwrap()
}

/// A claimant of its own task (a task's run is claimed only by its task).
fn task(worker: &'static str, task_id: &'static str) -> Claimant<'static> {
    Claimant {
        worker_id: worker,
        task_id,
        hold: Duration::from_secs(30),
    }
}

/// `abada_agent_store_transaction_duration_seconds_count{operation="..."}`, 0 when absent.
fn transactions(metrics: &Metrics, operation: &str) -> u64 {
    let needle = format!(
        "abada_agent_store_transaction_duration_seconds_count{{operation=\"{operation}\"}} "
    );
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&needle).map(|n| n.trim().parse().unwrap()))
        .unwrap_or(0)
}

/// `[claim, append, finish]` transactions so far.
fn budget(metrics: &Metrics) -> [u64; 3] {
    ["claim", "append", "finish"].map(|op| transactions(metrics, op))
}

/// The two retentions: zero (runs deleted as they finish) and an hour (runs marked and kept).
fn retentions(db: &TestDb) -> [(StoreConfig, bool); 2] {
    let deleted = config(&db.url);
    let mut kept = config(&db.url);
    kept.retention = Duration::from_secs(3600);
    [(deleted, true), (kept, false)]
}

/// `(attempt, status, steps)` of run `name`, if it exists.
async fn run_of(db: &TestDb, name: &str) -> Option<(u64, String, i64)> {
    db.sql()
        .await
        .query_opt(
            "SELECT attempt, status, (SELECT count(*) FROM abada_agent_steps s WHERE s.run_key = r.run_key)
               FROM abada_agent_runs r WHERE run_key = $1",
            &[&name],
        )
        .await
        .unwrap()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1), r.get(2)))
}

async fn wipe(db: &TestDb) {
    db.sql()
        .await
        .batch_execute("DELETE FROM abada_agent_runs")
        .await
        .unwrap();
}

/// A one-turn task: the claim with its input, the final answer appended at once (two
/// transactions); its finish queued, costing none, and carried by the next task's claim. The
/// last finish is written by the flush (the drain's). Retention 0 deletes the runs, retention
/// above marks them.
#[tokio::test]
async fn a_one_turn_task_costs_two_transactions_its_finish_riding_with_the_next_claim() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    for (cfg, deletes) in retentions(&db) {
        let (store, metrics) = connect(&cfg).await;
        let mut a = store
            .claim(&key("a"), &task("w", "a"), Some(&input("o-1")))
            .await
            .unwrap()
            .fence;
        store.append(&mut a, &answer(2, "done")).await.unwrap();
        store.finish_later(&a, RunEnd::Completed).await.unwrap();
        assert_eq!(
            budget(&metrics),
            [1, 1, 0],
            "the finish took no transaction"
        );
        assert_eq!(
            run_of(&db, "a").await,
            Some((a.attempt(), "running".into(), 2)),
            "queued, not yet written"
        );

        let mut b = store
            .claim(&key("b"), &task("w", "b"), Some(&input("o-2")))
            .await
            .unwrap()
            .fence;
        assert_eq!(budget(&metrics), [2, 1, 0]);
        let a_now = run_of(&db, "a").await;
        if deletes {
            assert_eq!(a_now, None, "the next claim deleted the run");
        } else {
            assert_eq!(a_now, Some((a.attempt(), "completed".into(), 2)));
        }
        store.append(&mut b, &answer(2, "done")).await.unwrap();
        store.finish_later(&b, RunEnd::Failed).await.unwrap();
        assert_eq!(store.flush().await.unwrap(), 1);
        assert_eq!(store.flush().await.unwrap(), 0, "nothing left");
        assert_eq!(budget(&metrics), [2, 2, 1], "two per task, one flush");
        let b_now = run_of(&db, "b").await;
        if deletes {
            assert_eq!(b_now, None);
            assert_eq!(db.count("SELECT count(*) FROM abada_agent_steps").await, 0);
        } else {
            assert_eq!(b_now, Some((b.attempt(), "failed".into(), 2)));
        }
        drop(store);
        wipe(&db).await;
    }
    db.drop().await;
}

/// A stale holder (its run claimed again by another attempt) is refused by the store when it
/// appends its final answer, before it can report: nothing written.
#[tokio::test]
async fn a_stale_holders_final_answer_is_refused_and_nothing_is_written() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut frozen = store
        .claim(&key("r"), &by("w1"), Some(&input("o-1")))
        .await
        .unwrap()
        .fence;
    let newer = store
        .claim(&key("r"), &by("w2"), Some(&input("o-1")))
        .await
        .unwrap()
        .fence;
    let e = store
        .append(&mut frozen, &answer(2, "stale"))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Fenced { reason: FenceReason::StaleAttempt { current }, .. } if *current == newer.attempt()),
        "{e:?}"
    );
    assert_eq!(
        run_of(&db, "r").await,
        Some((newer.attempt(), "running".into(), 1)),
        "the stale answer was not written"
    );
    drop(store);
    db.drop().await;
}

/// The fence of the queued finish: a worker frozen after the engine accepted its completion
/// queues its finish; meanwhile another attempt claimed the run (the task redelivered). The
/// stale finish, carried by a claim or flushed, leaves the newer attempt's run running with
/// its journal, with either retention; the newer attempt's own finish then ends it.
#[tokio::test]
async fn a_queued_finish_of_a_replaced_attempt_leaves_the_newer_attempts_run_alone() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    for (cfg, deletes) in retentions(&db) {
        let (frozen_store, _) = connect(&cfg).await;
        let (other_store, _) = connect(&cfg).await;
        let mut frozen = frozen_store
            .claim(&key("r"), &by("w1"), Some(&input("o-1")))
            .await
            .unwrap()
            .fence;
        frozen_store
            .append(&mut frozen, &answer(2, "done"))
            .await
            .unwrap();
        let newer = other_store
            .claim(&key("r"), &by("w2"), Some(&input("o-1")))
            .await
            .unwrap();
        assert!(!newer.created);
        assert_eq!(newer.steps.len(), 2, "the final answer is found");
        let newer = newer.fence;
        // The frozen worker's finish, queued, then carried by its next claim.
        frozen_store
            .finish_later(&frozen, RunEnd::Completed)
            .await
            .unwrap();
        frozen_store
            .claim(&key("next"), &task("w1", "next"), Some(&input("o-2")))
            .await
            .unwrap();
        assert_eq!(frozen_store.finishes_queued(), 0, "carried by the claim");
        assert_eq!(
            run_of(&db, "r").await,
            Some((newer.attempt(), "running".into(), 2)),
            "the stale finish changed nothing"
        );
        // Again, flushed on its own this time.
        frozen_store
            .finish_later(&frozen, RunEnd::Completed)
            .await
            .unwrap();
        assert_eq!(frozen_store.flush().await.unwrap(), 1);
        assert_eq!(
            run_of(&db, "r").await,
            Some((newer.attempt(), "running".into(), 2)),
            "the stale finish changed nothing"
        );
        other_store
            .finish_later(&newer, RunEnd::Completed)
            .await
            .unwrap();
        other_store.flush().await.unwrap();
        let ended = run_of(&db, "r").await;
        if deletes {
            assert_eq!(ended, None);
        } else {
            assert_eq!(ended, Some((newer.attempt(), "completed".into(), 2)));
        }
        drop((frozen_store, other_store));
        wipe(&db).await;
    }
    db.drop().await;
}

/// The same task redelivered (say, the engine lost the completion it had accepted) while its
/// finish is still queued: the claim performs the finish first, in its own transaction, so it
/// sees exactly what it saw when the finish had a transaction of its own: with retention 0 the
/// run is begun afresh; with runs kept it is reopened with its final answer (no model call).
/// Another worker's claim meanwhile resumes the run with its answer, and the queued finish,
/// now stale, leaves it alone.
#[tokio::test]
async fn a_claim_of_a_run_whose_finish_is_queued_sees_it_finished() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    for (cfg, deletes) in retentions(&db) {
        let (store, metrics) = connect(&cfg).await;
        let mut first = store
            .claim(&key("r"), &by("w1"), Some(&input("o-1")))
            .await
            .unwrap()
            .fence;
        store.append(&mut first, &answer(2, "done")).await.unwrap();
        store.finish_later(&first, RunEnd::Completed).await.unwrap();
        let again = store
            .claim(&key("r"), &by("w1"), Some(&input("o-1")))
            .await
            .unwrap();
        assert_eq!(store.finishes_queued(), 0);
        assert_eq!(budget(&metrics), [2, 1, 0]);
        if deletes {
            assert!(again.created, "retention 0: the finish deleted it first");
            assert_eq!(again.steps.len(), 1);
        } else {
            assert!(!again.created, "kept: reopened with its journal");
            assert_eq!(again.steps.len(), 2, "the final answer, no model call");
        }
        assert_eq!(
            run_of(&db, "r").await.map(|(a, s, _)| (a, s)),
            Some((again.fence.attempt(), "running".into()))
        );
        drop(store);
        wipe(&db).await;

        // Another worker's claim while the finish is queued on the first.
        let (w1, _) = connect(&cfg).await;
        let (w2, _) = connect(&cfg).await;
        let mut first = w1
            .claim(&key("r"), &by("w1"), Some(&input("o-1")))
            .await
            .unwrap()
            .fence;
        w1.append(&mut first, &answer(2, "done")).await.unwrap();
        w1.finish_later(&first, RunEnd::Completed).await.unwrap();
        let resumed = w2
            .claim(&key("r"), &by("w2"), Some(&input("o-1")))
            .await
            .unwrap();
        assert!(!resumed.created);
        assert_eq!(resumed.steps.len(), 2, "the final answer, no model call");
        assert_eq!(w1.flush().await.unwrap(), 1);
        assert_eq!(
            run_of(&db, "r").await,
            Some((resumed.fence.attempt(), "running".into(), 2)),
            "the stale finish left the newer attempt's run alone"
        );
        drop((w1, w2));
        wipe(&db).await;
    }
    db.drop().await;
}

/// The queue is bounded: the finish that finds it full is written by its caller at once, with
/// every finish queued, in one transaction (finishes of runs long gone match nothing).
#[tokio::test]
async fn a_full_queue_is_written_by_the_finishing_caller() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, metrics) = connect(&config(&db.url)).await;
    let mut fence = store
        .claim(&key("r"), &by("w"), Some(&input("o-1")))
        .await
        .unwrap()
        .fence;
    store.append(&mut fence, &answer(2, "done")).await.unwrap();
    for i in 0..MAX_PENDING_FINISHES as u64 {
        let gone = Fence::issue(key(&format!("gone-{i}")), 7 + i, 3, 3, 10);
        store.finish_later(&gone, RunEnd::Completed).await.unwrap();
    }
    assert_eq!(store.finishes_queued(), MAX_PENDING_FINISHES);
    assert_eq!(budget(&metrics), [1, 1, 0], "queued, no transaction");
    store.finish_later(&fence, RunEnd::Completed).await.unwrap();
    assert_eq!(budget(&metrics), [1, 1, 1], "one transaction for them all");
    assert_eq!(store.finishes_queued(), 0);
    assert_eq!(run_of(&db, "r").await, None, "retention 0: deleted");
    drop(store);
    db.drop().await;
}

/// A worker with no claim to make writes its queued finish on its own, once it has waited the
/// idle delay.
#[tokio::test]
async fn an_idle_worker_flushes_its_queued_finishes() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, metrics) = connect(&config(&db.url)).await;
    let stop = CancellationToken::new();
    let finisher = store.spawn_finisher(Duration::from_millis(100), stop.clone());
    let mut fence = store
        .claim(&key("r"), &by("w"), Some(&input("o-1")))
        .await
        .unwrap()
        .fence;
    store.append(&mut fence, &answer(2, "done")).await.unwrap();
    store.finish_later(&fence, RunEnd::Completed).await.unwrap();
    eventually(
        Duration::from_secs(20),
        "the idle flush to delete the run",
        async || db.count("SELECT count(*) FROM abada_agent_runs").await == 0,
    )
    .await;
    assert_eq!(budget(&metrics), [1, 1, 1]);
    assert_eq!(store.finishes_queued(), 0);
    stop.cancel();
    finisher.await.unwrap();
    drop(store);
    db.drop().await;
}

/// A crash loses the queued finishes: their runs stay `running`, final answer journaled. Nothing
/// is unrecoverable and nothing is run again: a redelivered task (the engine completed it, so
/// it would be a fault of the engine's) resumes with its final answer and calls no model, and
/// the sweeper deletes what is left once it is idle for ABADA_AGENT_STORE_ABANDONED_AFTER.
#[tokio::test]
async fn a_crash_with_queued_finishes_leaves_runs_the_sweeper_deletes_and_a_claim_resumes() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    for (cfg, _) in retentions(&db) {
        let (crashed, _) = connect(&cfg).await;
        let mut fences = Vec::new();
        for name in ["a", "b"] {
            let claim = crashed
                .claim(&key(name), &task("w1", name), Some(&input("o-1")))
                .await
                .unwrap();
            fences.push(claim.fence);
        }
        for fence in &mut fences {
            crashed.append(fence, &answer(2, "done")).await.unwrap();
            crashed
                .finish_later(fence, RunEnd::Completed)
                .await
                .unwrap();
        }
        assert_eq!(crashed.finishes_queued(), 2);
        drop(crashed); // the crash: no flush
        assert_eq!(
            db.count("SELECT count(*) FROM abada_agent_runs WHERE status = 'running'")
                .await,
            2
        );

        let (next, _) = connect(&cfg).await;
        let resumed = next
            .claim(&key("a"), &task("w2", "a"), Some(&input("o-1")))
            .await
            .unwrap();
        assert!(!resumed.created);
        assert_eq!(
            resumed.steps.len(),
            2,
            "the final answer: nothing run again"
        );
        assert_eq!(resumed.steps[1].data["message"]["text"], "done");

        // Idle past the abandonment limit (30 days by default): the sweeper deletes them.
        db.sql()
            .await
            .batch_execute("UPDATE abada_agent_runs SET updated_at = now() - interval '31 days'")
            .await
            .unwrap();
        let swept = next.sweep().await.unwrap();
        assert_eq!(swept.abandoned, 2);
        assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 0);
        assert_eq!(db.count("SELECT count(*) FROM abada_agent_steps").await, 0);
        drop(next);
    }
    db.drop().await;
}

/// Through the worker: one-turn tasks cost two store transactions each (claim, final answer);
/// their finishes ride with the next claims, and the drain writes the ones left before the
/// worker stops (the idle flush is set out of reach here, so only the drain can).
#[tokio::test]
async fn the_drain_writes_the_finishes_left_and_each_task_costs_two_transactions() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url.render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("one-turn", one_turn(Duration::ZERO));
    let ids: Vec<String> = (0..6)
        .map(|i| {
            stack.engine.create_task(spec(
                stack.refund_agent("openai/one-turn", &[]),
                &format!("o-{i}"),
            ))
        })
        .collect();
    let mut o = opts("w1", &url, "openai/one-turn", Duration::from_secs(30));
    o.tuning.store_idle_flush = Duration::from_secs(3600);
    let worker = stack.spawn_worker(o, Stack::fast_agent_settings());
    let metrics = worker.metrics.clone();
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(60)).await;
    assert!(
        views.iter().all(|v| v.status == TaskStatus::Completed),
        "{views:?}"
    );
    // The last task's finish waits: no claim came after it.
    let queued = db
        .count("SELECT count(*) FROM abada_agent_runs WHERE status = 'running'")
        .await;
    assert!(queued >= 1, "the last finish is still queued");
    assert_eq!(transactions(&metrics, "finish"), 0);
    worker.stop().await;
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_runs").await,
        0,
        "the drain wrote every finish (retention 0: deleted)"
    );
    assert_eq!(
        budget(&metrics),
        [6, 6, 1],
        "two per task, one at the drain"
    );
    stack.shutdown().await;
    db.drop().await;
}
