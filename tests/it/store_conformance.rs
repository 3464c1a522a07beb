//! One conformance suite for every [`RunStore`]: each case below runs against the PostgreSQL
//! store on real PostgreSQL (`pg::`) and against the in-memory store the simulator uses
//! (`memory::`, on a paused clock), so the stand-in cannot drift from the real thing.
//! The cases hold the promises of the trait's doc, observed through the trait itself (claims
//! read the journal back), plus the two controls every store has: time passing for one run
//! (`backdate`) and the sweeper.
//!
//! `flaws::` shows the suite can fail: each deliberately broken rule of the memory store
//! ([`Flaw`]) makes the cases named for it fail.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::engine::{AppendOutcome, JournalStep};
use abada_agent_worker::store::{
    ClaimRefusal, Claimant, ErrorClass, Fence, FenceReason, PgRunStore, Phase, RunEnd, RunKey,
    RunLookup, RunStore, StoreError, SweepReport,
};
use abada_sim::world::store::{Flaw, MemoryRunStore, MemoryStoreSettings};
use serde_json::json;

use crate::support::steps::{answer, asks_refund, input};

use crate::store::{TestDb, config, connect};

/// A store under test, with its controls.
#[async_trait::async_trait]
trait Subject: Send + Sync {
    fn store(&self) -> Arc<dyn RunStore>;
    /// The run's latest change (and its finish) as if it had happened `by` earlier.
    async fn backdate(&self, run_key: &RunKey, by: Duration);
    /// One pass of the sweeper.
    async fn sweep(&self) -> SweepReport;
}

struct Pg {
    db: TestDb,
    store: PgRunStore,
}

#[async_trait::async_trait]
impl Subject for Pg {
    fn store(&self) -> Arc<dyn RunStore> {
        Arc::new(self.store.clone())
    }

    async fn backdate(&self, run_key: &RunKey, by: Duration) {
        let ms = by.as_millis() as i64;
        self.db
            .sql()
            .await
            .execute(
                "UPDATE abada_agent_runs
                    SET updated_at = updated_at - $2::bigint * interval '1 millisecond',
                        finished_at = finished_at - $2::bigint * interval '1 millisecond'
                  WHERE run_key = $1",
                &[&run_key.as_str(), &ms],
            )
            .await
            .unwrap();
    }

    async fn sweep(&self) -> SweepReport {
        self.store.sweep().await.unwrap()
    }
}

struct Memory(Arc<MemoryRunStore>);

#[async_trait::async_trait]
impl Subject for Memory {
    fn store(&self) -> Arc<dyn RunStore> {
        self.0.clone()
    }

    async fn backdate(&self, run_key: &RunKey, by: Duration) {
        self.0.backdate(run_key, by);
    }

    async fn sweep(&self) -> SweepReport {
        self.0.sweep()
    }
}

fn memory(retention: Duration, flaw: Option<Flaw>) -> Arc<dyn Subject> {
    let store = MemoryRunStore::new(MemoryStoreSettings {
        retention,
        ..MemoryStoreSettings::default()
    });
    let store = match flaw {
        Some(flaw) => store.with_flaw(flaw),
        None => store,
    };
    Arc::new(Memory(Arc::new(store)))
}

/// Keeps finished runs (marked, swept later) or deletes them in the finish.
const KEEP: Duration = Duration::from_secs(3600);
const DELETE: Duration = Duration::ZERO;

type Case = fn(Arc<dyn Subject>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// Every case: its name, the retention it runs with, and the case.
const CASES: [(&str, Duration, Case); 10] = [
    ("never_repeating_attempts", DELETE, |s| {
        Box::pin(never_repeating_attempts(s))
    }),
    ("stale_attempt_fenced", KEEP, |s| {
        Box::pin(stale_attempt_fenced(s))
    }),
    ("stale_copy_and_gap", KEEP, |s| {
        Box::pin(stale_copy_and_gap(s))
    }),
    ("retried_append", KEEP, |s| Box::pin(retried_append(s))),
    ("finish_kept", KEEP, |s| {
        Box::pin(finish_fenced_idempotent(s, false))
    }),
    ("finish_deleting", DELETE, |s| {
        Box::pin(finish_fenced_idempotent(s, true))
    }),
    ("admission", KEEP, |s| Box::pin(admission(s))),
    ("racing_claims", KEEP, |s| Box::pin(racing_claims(s))),
    ("locate", KEEP, |s| Box::pin(locate(s))),
    ("judged_answers", KEEP, |s| Box::pin(judged_answers(s))),
];

/// Runs case `name` against PostgreSQL (a database of its own).
async fn on_pg(name: &str) {
    let (_, retention, case) = CASES.iter().find(|(n, ..)| *n == name).unwrap();
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut cfg = config(&db.url);
    cfg.retention = *retention;
    let (store, _) = connect(&cfg).await;
    let subject = Arc::new(Pg { db, store });
    case(subject.clone()).await;
    let Ok(Pg { db, store }) = Arc::try_unwrap(subject) else {
        panic!("the case kept its subject")
    };
    drop(store);
    db.drop().await;
}

async fn on_memory(name: &str) {
    let (_, retention, case) = CASES.iter().find(|(n, ..)| *n == name).unwrap();
    case(memory(*retention, None)).await;
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod pg {
            $(#[tokio::test]
            async fn $name() {
                super::on_pg(stringify!($name)).await;
            })*
        }
        mod memory {
            $(#[tokio::test(start_paused = true)]
            async fn $name() {
                super::on_memory(stringify!($name)).await;
            })*
        }
    };
}

both!(
    never_repeating_attempts,
    stale_attempt_fenced,
    stale_copy_and_gap,
    retried_append,
    finish_kept,
    finish_deleting,
    admission,
    racing_claims,
    locate,
    judged_answers,
);

// ---- steps and claimants --------------------------------------------------------------------

fn approval_requested(seq: u64) -> JournalStep {
    JournalStep {
        seq,
        kind: "approval".into(),
        state: "requested".into(),
        key: None,
        data: json!({"callId": "call_0"}),
    }
}

/// Task `task` on worker `worker`, holding a visit's run for 30 s after its latest write.
fn by(worker: &'static str, task: &'static str) -> Claimant<'static> {
    Claimant {
        worker_id: worker,
        task_id: task,
        hold: Duration::from_secs(30),
    }
}

fn task_run(name: &str) -> RunKey {
    RunKey::for_task(name).unwrap()
}

fn visit() -> RunKey {
    RunKey::for_visit("process/pi-1/refundAgent").unwrap()
}

fn assert_fenced(e: &StoreError, stale: &Fence, want: &FenceReason) {
    let matches = match (e, want) {
        (
            StoreError::Fenced {
                attempt,
                reason: FenceReason::StaleAttempt { current },
                ..
            },
            FenceReason::StaleAttempt { current: want },
        ) => *attempt == stale.attempt() && current == want,
        (
            StoreError::Fenced {
                attempt, reason, ..
            },
            want,
        ) => *attempt == stale.attempt() && reason == want,
        _ => false,
    };
    assert!(
        matches,
        "expected fenced ({want:?}) for attempt {}: {e:?}",
        stale.attempt()
    );
}

/// The journal as a fresh claim of a task's run reads it (the claim takes a new attempt).
async fn journal(store: &dyn RunStore, run: &RunKey) -> Vec<JournalStep> {
    store
        .claim(run, &by("reader", "task"), None)
        .await
        .unwrap()
        .steps
}

// ---- the cases ------------------------------------------------------------------------------

/// The lookup a task makes before any definition is read: the running runs of its exact keys,
/// and those it holds under its node's visit prefix (followed by `/`), newest first, each with
/// its phase and the definition journaled with its input. Nothing else: another task's loop
/// visit, a sibling node sharing the prefix's text, a finished run.
async fn locate(s: Arc<dyn Subject>) {
    let store = s.store();
    let pinned = json!({"source": "agentsFile", "entry": "refundAgent", "definition": {"model": "p/m", "input": "hi"}});
    let mut first = input("hi");
    first.data["definition"] = pinned.clone();
    let claim = async |key: &str, task: &'static str| {
        let run = if key.starts_with("process/") {
            RunKey::for_visit(key).unwrap()
        } else {
            task_run(key)
        };
        store
            .claim(&run, &by("w", task), Some(&first))
            .await
            .unwrap()
            .fence
    };
    claim("t-1", "t-1").await;
    let mut waiting = claim("process/pi-1/refundAgent", "t-0").await;
    store.append(&mut waiting, &asks_refund(2)).await.unwrap();
    store
        .append(&mut waiting, &approval_requested(3))
        .await
        .unwrap();
    claim("process/pi-1/refundAgent/loop/4", "t-1").await;
    claim("process/pi-1/refundAgent/loop/5", "t-9").await;
    claim("process/pi-1/refundAgentX/loop/1", "t-1").await;
    let done = claim("process/pi-1/refundAgent/loop/6", "t-1").await;
    store.finish(&done, RunEnd::Completed).await.unwrap();
    // Ages apart: the newest first.
    for (key, secs) in [
        ("t-1", 3),
        ("process/pi-1/refundAgent/loop/4", 2),
        ("process/pi-1/refundAgent", 1),
    ] {
        let run = RunKey::new(key).unwrap();
        s.backdate(&run, Duration::from_secs(secs)).await;
    }
    let keys = ["t-1".to_string(), "process/pi-1/refundAgent".to_string()];
    let lookup = RunLookup {
        keys: &keys,
        task_id: "t-1",
        prefix: Some("process/pi-1/refundAgent"),
    };
    let found = store.locate(&lookup).await.unwrap();
    let seen: Vec<(&str, Option<&str>, Phase)> = found
        .iter()
        .map(|r| (r.run_key.as_str(), r.holder.as_deref(), r.phase))
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                "process/pi-1/refundAgent",
                Some("t-0"),
                Phase::AwaitsDecision
            ),
            (
                "process/pi-1/refundAgent/loop/4",
                Some("t-1"),
                Phase::Working
            ),
            ("t-1", Some("t-1"), Phase::Working),
        ]
    );
    assert!(found.iter().all(|r| r.definition.as_ref() == Some(&pinned)));
    // A task with no node: its own key only; nothing at all for an unknown one.
    let own = ["t-1".to_string()];
    let found = store
        .locate(&RunLookup {
            keys: &own,
            task_id: "t-1",
            prefix: None,
        })
        .await
        .unwrap();
    assert_eq!(found.len(), 1);
    let none = ["t-404".to_string()];
    let found = store
        .locate(&RunLookup {
            keys: &none,
            task_id: "t-404",
            prefix: Some("process/pi-9/a"),
        })
        .await
        .unwrap();
    assert!(found.is_empty());
}

/// Every claim hands out an attempt no claim of any run had before, also once a run was
/// deleted (finished with a retention of 0, or swept as abandoned) and created again under its
/// key, reaching the very version and seq a frozen holder expects: only the attempt tells them
/// apart, and the frozen holder's append and finish are fenced.
async fn never_repeating_attempts(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = visit();
    let first = store
        .claim(&run, &by("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(first.created);
    let mut seen = vec![first.fence.attempt()];
    let frozen = first.fence.clone();
    // The holder's redelivery resumes, answers and finishes: retention 0 deletes the run.
    let again = store
        .claim(&run, &by("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(!again.created);
    assert!(again.fence.attempt() > first.fence.attempt());
    seen.push(again.fence.attempt());
    let mut holder = again.fence;
    store
        .append(&mut holder, &answer(2, "refunded o-1"))
        .await
        .unwrap();
    store.finish(&holder, RunEnd::Completed).await.unwrap();

    // The next visit creates the run again under the same key, at the frozen fence's version
    // and next seq.
    let new = store
        .claim(&run, &by("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(new.created);
    assert_eq!(
        (new.fence.version(), new.fence.next_seq()),
        (frozen.version(), frozen.next_seq()),
        "only the attempt tells the new run from the deleted one"
    );
    assert!(
        !seen.contains(&new.fence.attempt()),
        "{seen:?} {:?}",
        new.fence
    );
    seen.push(new.fence.attempt());
    let mut late = frozen.clone();
    let e = store
        .append(&mut late, &answer(2, "late: refund o-1"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced, "{e:?}");
    assert_fenced(
        &e,
        &frozen,
        &FenceReason::StaleAttempt {
            current: new.fence.attempt(),
        },
    );
    assert_eq!(late, frozen, "a refused append leaves the fence alone");
    let e = store.finish(&frozen, RunEnd::Completed).await.unwrap_err();
    assert_fenced(
        &e,
        &frozen,
        &FenceReason::StaleAttempt {
            current: new.fence.attempt(),
        },
    );

    // Swept as abandoned, then created again: the same.
    s.backdate(&run, Duration::from_secs(31 * 86_400)).await;
    assert_eq!(s.sweep().await.abandoned, 1);
    let newest = store
        .claim(&run, &by("w-c", "t-3"), Some(&input("refund o-3")))
        .await
        .unwrap();
    assert!(newest.created);
    assert!(
        !seen.contains(&newest.fence.attempt()),
        "{seen:?} {:?}",
        newest.fence
    );
    let mut late = new.fence.clone();
    let e = store
        .append(&mut late, &answer(2, "late: refund o-2"))
        .await
        .unwrap_err();
    assert_fenced(
        &e,
        &new.fence,
        &FenceReason::StaleAttempt {
            current: newest.fence.attempt(),
        },
    );
    let mut fence = newest.fence;
    assert_eq!(
        store
            .append(&mut fence, &answer(2, "refunded o-3"))
            .await
            .unwrap(),
        AppendOutcome::Created
    );
    let steps = store
        .claim(&run, &by("w-c", "t-3"), Some(&input("refund o-3")))
        .await
        .unwrap()
        .steps;
    assert_eq!(steps, vec![input("refund o-3"), answer(2, "refunded o-3")]);
}

/// A newer claim fences the older attempt: its append is refused naming both attempts, nothing
/// of it is written, and the newer attempt writes on.
async fn stale_attempt_fenced(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = task_run("task-fence");
    let mut a = store
        .claim(&run, &by("w-a", "task"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    store.append(&mut a, &answer(2, "from a")).await.unwrap();
    // a freezes past its lease; b claims the run and gets the journal so far.
    let b_claim = store.claim(&run, &by("w-b", "task"), None).await.unwrap();
    assert!(!b_claim.created);
    assert_eq!(b_claim.steps, vec![input("hi"), answer(2, "from a")]);
    let mut b = b_claim.fence;
    assert!(b.attempt() > a.attempt());

    let before = a.clone();
    let e = store
        .append(&mut a, &answer(3, "late from a"))
        .await
        .unwrap_err();
    assert_fenced(
        &e,
        &before,
        &FenceReason::StaleAttempt {
            current: b.attempt(),
        },
    );
    assert_eq!(
        e.to_string(),
        format!(
            "run task-fence: attempt {} no longer owns the run (attempt {} has claimed the run since); it must stop and report nothing",
            before.attempt(),
            b.attempt()
        )
    );
    assert_eq!(a, before);
    let e = store.finish(&a, RunEnd::Completed).await.unwrap_err();
    assert_fenced(
        &e,
        &before,
        &FenceReason::StaleAttempt {
            current: b.attempt(),
        },
    );

    assert_eq!(
        store.append(&mut b, &answer(3, "from b")).await.unwrap(),
        AppendOutcome::Created
    );
    assert_eq!(
        journal(store.as_ref(), &run).await,
        vec![input("hi"), answer(2, "from a"), answer(3, "from b")]
    );
}

/// A stale copy of a fence (same attempt, older version) is fenced, also for the very step it
/// would have written; a different step at a taken seq is a conflict, and so is a gap.
async fn stale_copy_and_gap(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = task_run("t");
    let mut fence = store
        .claim(&run, &by("w", "task"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    let mut stale = fence.clone();
    store.append(&mut fence, &answer(2, "two")).await.unwrap();
    store.append(&mut fence, &answer(3, "three")).await.unwrap();
    let copy = stale.clone();
    let stale_version = FenceReason::StaleVersion {
        expected: copy.version(),
        current: fence.version(),
    };
    let e = store
        .append(&mut stale, &answer(3, "three"))
        .await
        .unwrap_err();
    assert_fenced(&e, &copy, &stale_version);
    let e = store
        .append(&mut stale, &answer(2, "two"))
        .await
        .unwrap_err();
    assert_fenced(&e, &copy, &stale_version);
    let e = store
        .append(&mut stale, &answer(2, "other"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Conflict, "{e:?}");
    assert_eq!(stale, copy);
    let e = store
        .append(&mut fence, &answer(5, "five"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Conflict, "{e:?}");
    assert!(
        e.to_string().contains("the next step of the run is seq 4"),
        "{e}"
    );
    assert_eq!(
        store.append(&mut fence, &answer(4, "four")).await.unwrap(),
        AppendOutcome::Created
    );
    assert_eq!(journal(store.as_ref(), &run).await.len(), 4);
}

/// A retried append of the very step written (its acknowledgement lost) is `AlreadyPresent`
/// and advances the fence exactly as the first try did; another step at that seq is a
/// conflict; the journal holds the step once, NUL characters stored as U+FFFD.
async fn retried_append(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = task_run("t");
    let mut fence = store
        .claim(&run, &by("w", "task"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    let mut retry = fence.clone();
    let mut other = fence.clone();
    let step = answer(2, "answer with a NUL \u{0} inside");
    assert_eq!(
        store.append(&mut fence, &step).await.unwrap(),
        AppendOutcome::Created
    );
    assert_eq!(
        store.append(&mut retry, &step).await.unwrap(),
        AppendOutcome::AlreadyPresent
    );
    assert_eq!(
        retry, fence,
        "the retry's fence advanced exactly as the first try's"
    );
    let e = store
        .append(&mut other, &answer(2, "something else"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Conflict, "{e:?}");
    assert_eq!(
        store.append(&mut retry, &answer(3, "next")).await.unwrap(),
        AppendOutcome::Created
    );
    let steps = journal(store.as_ref(), &run).await;
    assert_eq!(steps.len(), 3);
    assert_eq!(
        steps[1].data["message"]["text"],
        "answer with a NUL \u{FFFD} inside"
    );
}

/// A finish is idempotent for its attempt (a retry after a lost acknowledgement succeeds),
/// ends the run for appends, and is fenced: a stale attempt's finish leaves a newer attempt's
/// run running. With a retention of 0 it deletes the run; otherwise the run is kept until the
/// sweeper finds it past the retention, and the same task claiming it again reopens it.
async fn finish_fenced_idempotent(s: Arc<dyn Subject>, deleting: bool) {
    let store = s.store();
    let run = task_run("t-finish");
    let mut fence = store
        .claim(&run, &by("w-a", "task"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    store.append(&mut fence, &answer(2, "done")).await.unwrap();
    store.finish(&fence, RunEnd::Completed).await.unwrap();
    store.finish(&fence, RunEnd::Completed).await.unwrap();
    let mut after = fence.clone();
    let e = store
        .append(&mut after, &answer(3, "after the end"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced, "{e:?}");

    let reopened = store.claim(&run, &by("w-b", "task"), None).await.unwrap();
    if deleting {
        // Retention 0: the finish deleted the run, steps and all.
        assert_fenced(&e, &fence, &FenceReason::Gone);
        assert!(reopened.created);
        assert!(reopened.steps.is_empty());
    } else {
        assert_fenced(&e, &fence, &FenceReason::Finished);
        assert!(!reopened.created);
        assert_eq!(reopened.steps, vec![input("hi"), answer(2, "done")]);
    }
    // The first attempt's late finish (and its retries) leave the reopened run alone.
    let e = store.finish(&fence, RunEnd::Completed).await.unwrap_err();
    assert_fenced(
        &e,
        &fence,
        &FenceReason::StaleAttempt {
            current: reopened.fence.attempt(),
        },
    );
    let mut newer = reopened.fence.clone();
    let next = if deleting {
        input("hi")
    } else {
        answer(3, "again")
    };
    assert_eq!(
        store.append(&mut newer, &next).await.unwrap(),
        AppendOutcome::Created
    );
    store.finish(&newer, RunEnd::Failed).await.unwrap();

    // Kept runs go once past the retention, not before.
    let late = task_run("t-kept");
    let mut f = store
        .claim(&late, &by("w", "task"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    store.append(&mut f, &answer(2, "done")).await.unwrap();
    store.finish(&f, RunEnd::Completed).await.unwrap();
    s.backdate(&late, Duration::from_secs(1800)).await;
    if !deleting {
        assert_eq!(s.sweep().await.finished, 0, "within the retention");
    }
    s.backdate(&late, Duration::from_secs(3600)).await;
    let swept = s.sweep().await.finished;
    assert_eq!(swept, if deleting { 0 } else { 1 }, "past the retention");
    let again = store.claim(&late, &by("w", "task"), None).await.unwrap();
    assert!(again.created, "gone from the store");
}

/// The admission rule on a visit's run: a second live token is refused and changes nothing;
/// a holder silent past the hold loses the run to a fresh begin; an answered visit is never
/// replayed into the next task; a waiting visit resumes only for the same input; a finished
/// visit begins again.
async fn admission(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = visit();
    let mut first = store
        .claim(&run, &by("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap()
        .fence;
    store.append(&mut first, &asks_refund(2)).await.unwrap();
    for text in ["refund o-1", "refund o-2"] {
        let e = store
            .claim(&run, &by("w-b", "t-2"), Some(&input(text)))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::Refused { task_id, reason, .. }
                if task_id == "t-2"
                    && matches!(reason.as_ref(), ClaimRefusal::HeldByAnotherTask { holder, .. } if holder == "t-1")),
            "{e:?}"
        );
    }
    // A refusal changed nothing: the holder writes on.
    let tool = JournalStep {
        seq: 3,
        kind: "tool".into(),
        state: "started".into(),
        key: Some("abada:t-1:3".into()),
        data: json!({"callId": "call_0", "server": "orders", "tool": "issue_refund",
                     "arguments": {"orderId": "o-1", "amountCents": 4200}}),
    };
    assert_eq!(
        store.append(&mut first, &tool).await.unwrap(),
        AppendOutcome::Created
    );

    // Silent past the hold: begun afresh by the other task; the silent holder is fenced.
    s.backdate(&run, Duration::from_secs(31)).await;
    let taken = store
        .claim(&run, &by("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(taken.created, "t-1's conversation is not t-2's");
    assert_eq!(taken.steps, vec![input("refund o-2")]);
    let stale = first.clone();
    let e = store
        .append(&mut first, &answer(4, "late"))
        .await
        .unwrap_err();
    assert_fenced(
        &e,
        &stale,
        &FenceReason::StaleAttempt {
            current: taken.fence.attempt(),
        },
    );

    // t-2 answers; the next task begins afresh, even with the same input; t-2's own
    // redelivery would have found its answer.
    let mut t2 = taken.fence;
    store
        .append(&mut t2, &answer(2, "refunded o-2"))
        .await
        .unwrap();
    let own = store
        .claim(&run, &by("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(!own.created);
    assert_eq!(own.steps.len(), 2);
    let next = store
        .claim(&run, &by("w-c", "t-3"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(next.created, "an answered visit is never replayed");
    assert_eq!(next.steps, vec![input("refund o-2")]);

    // t-3 stops for a decision: only a task with the same input resumes it.
    let mut t3 = next.fence;
    store.append(&mut t3, &asks_refund(2)).await.unwrap();
    store.append(&mut t3, &approval_requested(3)).await.unwrap();
    let e = store
        .claim(&run, &by("w-d", "t-4"), Some(&input("refund o-9 instead")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused { reason, .. }
            if matches!(reason.as_ref(), ClaimRefusal::InputDiffers { .. })),
        "{e:?}"
    );
    let decision = store
        .claim(&run, &by("w-d", "t-4"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(!decision.created);
    assert_eq!(
        decision.steps.len(),
        3,
        "the decision's task resumes the waiting run"
    );

    // Finished: the next visit begins again and no old fence matches.
    let mut t4 = decision.fence;
    store.append(&mut t4, &answer(4, "done")).await.unwrap();
    store.finish(&t4, RunEnd::Completed).await.unwrap();
    let again = store
        .claim(&run, &by("w-e", "t-5"), Some(&input("refund o-5")))
        .await
        .unwrap();
    assert!(again.created);
    assert_eq!(again.steps, vec![input("refund o-5")]);
    let mut old = t4.clone();
    let e = store
        .append(&mut old, &answer(5, "late"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced, "{e:?}");
}

/// An `output` step (`agent::judging`: a final answer judged after it was journaled).
fn output(seq: u64, state: &str, data: serde_json::Value) -> JournalStep {
    JournalStep {
        seq,
        kind: "output".into(),
        state: state.into(),
        key: None,
        data,
    }
}

/// A final answer journaled before its verdict: the store keeps the `output` steps like any
/// step and hands them back to the task's next claim (so an attempt that died while judging
/// is counted), and a visit's conversation is over only once its answer is judged a match:
/// while it is being judged another task is held off, as by any working run; once accepted,
/// the next task begins afresh.
async fn judged_answers(s: Arc<dyn Subject>) {
    let store = s.store();
    let run = visit();
    let mut t1 = store
        .claim(&run, &by("w-a", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap()
        .fence;
    store.append(&mut t1, &answer(2, "{}")).await.unwrap();
    let judging = output(3, "judging", json!({"answerSeq": 2, "pass": 2}));
    store.append(&mut t1, &judging).await.unwrap();
    let e = store
        .claim(&run, &by("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused { reason, .. }
            if matches!(reason.as_ref(), ClaimRefusal::HeldByAnotherTask { holder, .. } if holder == "t-1")),
        "{e:?}"
    );
    let own = store
        .claim(&run, &by("w-c", "t-1"), Some(&input("refund o-1")))
        .await
        .unwrap();
    assert!(!own.created);
    assert_eq!(own.steps.len(), 3);
    assert_eq!(own.steps[2], judging);
    let mut t1 = own.fence;
    store
        .append(&mut t1, &output(4, "accepted", json!({"answerSeq": 2})))
        .await
        .unwrap();
    let next = store
        .claim(&run, &by("w-b", "t-2"), Some(&input("refund o-2")))
        .await
        .unwrap();
    assert!(
        next.created,
        "an accepted answer ends the visit's conversation"
    );
    assert_eq!(next.steps, vec![input("refund o-2")]);
}

/// Claims racing: eight tokens claiming a new visit at once leave exactly one holder, the rest
/// refused; two claimants of one task's run both get the run in turn, with distinct attempts,
/// and only the later one writes.
async fn racing_claims(s: Arc<dyn Subject>) {
    let store = s.store();
    const TASKS: [&str; 8] = ["t-0", "t-1", "t-2", "t-3", "t-4", "t-5", "t-6", "t-7"];
    let claims = TASKS.map(|t| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .claim(&visit(), &by("w", t), Some(&input("refund o-1")))
                .await
                .map(|c| (t, c.created, c.fence))
        })
    });
    let mut holders = Vec::new();
    for claim in claims {
        match claim.await.unwrap() {
            Ok((t, created, fence)) => {
                assert!(created);
                holders.push((t, fence));
            }
            Err(e) => assert_eq!(e.class(), ErrorClass::Refused, "{e:?}"),
        }
    }
    assert_eq!(holders.len(), 1, "{holders:?}");
    let (_, mut holder) = holders.pop().unwrap();
    assert_eq!(
        store.append(&mut holder, &asks_refund(2)).await.unwrap(),
        AppendOutcome::Created
    );

    let run = task_run("t-raced");
    store
        .claim(&run, &by("w-0", "task"), Some(&input("hi")))
        .await
        .unwrap();
    let racing = ["w-a", "w-b"].map(|w| {
        let store = store.clone();
        let run = run.clone();
        tokio::spawn(async move {
            store
                .claim(&run, &by(w, "task"), Some(&input("hi")))
                .await
                .unwrap()
                .fence
        })
    });
    let mut fences = Vec::new();
    for r in racing {
        fences.push(r.await.unwrap());
    }
    fences.sort_by_key(Fence::attempt);
    assert_ne!(fences[0].attempt(), fences[1].attempt());
    let [mut older, mut newer] = [fences[0].clone(), fences[1].clone()];
    let e = store
        .append(&mut older, &answer(2, "older"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced, "{e:?}");
    assert_eq!(
        store.append(&mut newer, &answer(2, "newer")).await.unwrap(),
        AppendOutcome::Created
    );
    assert_eq!(
        journal(store.as_ref(), &run).await,
        vec![input("hi"), answer(2, "newer")]
    );
}

// ---- the suite can fail ---------------------------------------------------------------------

/// Which cases fail against the memory store with `flaw`.
async fn failing_with(flaw: Flaw) -> Vec<&'static str> {
    let mut failed = Vec::new();
    for (name, retention, case) in CASES {
        let subject = memory(retention, Some(flaw));
        if tokio::spawn(case(subject)).await.is_err() {
            failed.push(name);
        }
    }
    failed
}

/// Each broken rule of the memory store is caught by the cases written for it (and the sound
/// store passes them all, `memory::`).
#[tokio::test(start_paused = true)]
async fn every_broken_rule_of_the_memory_store_fails_its_cases() {
    let expected: [(Flaw, &[&str]); 8] = [
        (
            Flaw::AttemptPerRun,
            &["never_repeating_attempts", "finish_deleting"],
        ),
        (
            Flaw::NoAttemptCheck,
            &[
                "never_repeating_attempts",
                "stale_attempt_fenced",
                "admission",
            ],
        ),
        (Flaw::NoSeqCheck, &["stale_copy_and_gap"]),
        (Flaw::NoLostCommit, &["retried_append"]),
        (
            Flaw::FinishUnfenced,
            &["stale_attempt_fenced", "finish_kept", "finish_deleting"],
        ),
        (Flaw::FinishOnce, &["finish_kept"]),
        (Flaw::NoAdmission, &["admission", "racing_claims"]),
        (Flaw::TornClaim, &["racing_claims"]),
    ];
    let mut report = Vec::new();
    for (flaw, cases) in expected {
        let failed = failing_with(flaw).await;
        for case in cases {
            assert!(
                failed.contains(case),
                "{flaw:?}: {case} passed; failed: {failed:?}"
            );
        }
        report.push(format!("{flaw:?}: {failed:?}"));
    }
    eprintln!("{}", report.join("\n"));
}
