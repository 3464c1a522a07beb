//! Chaos on a plain v1 engine kept durable by the run store: the crash test of
//! `durable.rs` (three real worker processes, SIGSTOP past the lease and SIGKILL, at least 200
//! refund tasks, each a model and tool conversation with a keyed write) on the emulator's 0.11
//! mode with `ABADA_AGENT_STORE_URL` set, against a real PostgreSQL.
//!
//! The engine knows no attempt here: the store's claims and fenced appends are what keep a woken
//! worker quiet, so the checks read the database itself. Before the workers start, the test
//! installs triggers beside the store's tables that record, in the inserting transaction, every
//! step with the run's attempt at that moment, and every claim. A step whose attempt is not the
//! run's is an append of a stale attempt that the store accepted; the test first proves that the
//! audit catches one.

use std::collections::HashMap;
use std::time::Duration;

use abada_agent_worker::config;
use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::{REFUND_MODEL, Stack, refund_script};
use tokio_postgres::Client;

use crate::agent::spec;
use crate::store::TestDb;
use crate::store_runs::{PlainFiles, orders_server};
use crate::support::chaos;
use crate::support::process::{WorkerProcess, stack_env};
use crate::support::wait::eventually;

/// The audit: two tables and two triggers of the test's own, beside the store's tables. Each
/// trigger runs inside the worker's transaction, so what it records committed exactly when the
/// step or the claim did. `run_attempt` is read after the statement that inserted the step, in
/// its transaction: the append's compare-and-set holds the run row's lock, so no claim can move
/// the attempt in between.
const AUDIT: &str = r#"
CREATE TABLE chaos_steps (
    id           bigserial PRIMARY KEY,
    run_key      text   NOT NULL,
    seq          bigint NOT NULL,
    step_attempt bigint NOT NULL,
    run_attempt  bigint,
    kind         text   NOT NULL,
    state        text   NOT NULL,
    key          text,
    tool         text
);
CREATE TABLE chaos_claims (
    id       bigserial PRIMARY KEY,
    run_key  text   NOT NULL,
    attempt  bigint NOT NULL,
    owner    text   NOT NULL
);
CREATE FUNCTION chaos_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_steps (run_key, seq, step_attempt, run_attempt, kind, state, key, tool)
    VALUES (NEW.run_key, NEW.seq, NEW.attempt,
            (SELECT attempt FROM abada_agent_runs WHERE run_key = NEW.run_key),
            NEW.kind, NEW.state, NEW.key, NEW.body->>'tool');
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_step AFTER INSERT ON abada_agent_steps
    FOR EACH ROW EXECUTE FUNCTION chaos_step();
CREATE FUNCTION chaos_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.attempt IS DISTINCT FROM OLD.attempt THEN
        INSERT INTO chaos_claims (run_key, attempt, owner)
        VALUES (NEW.run_key, NEW.attempt, NEW.owner);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_claim AFTER INSERT OR UPDATE ON abada_agent_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_claim();
"#;

/// Steps written by an attempt that was not the run's current one when the step committed.
const STALE_STEPS: &str =
    "SELECT count(*) FROM chaos_steps WHERE run_attempt IS DISTINCT FROM step_attempt";

/// Steps of an attempt `a` at a `seq` past a step of a newer attempt `b > a` of the same run:
/// an older attempt that went on writing after a newer one had.
const OVERTAKEN_STEPS: &str = "
    SELECT count(*) FROM chaos_steps s
     WHERE EXISTS (SELECT 1 FROM chaos_steps t
                    WHERE t.run_key = s.run_key AND t.step_attempt > s.step_attempt
                      AND t.seq < s.seq)";

async fn count(sql: &Client, query: &str) -> i64 {
    sql.query_one(query, &[]).await.unwrap().get(0)
}

/// Plays what a broken compare-and-set would let through (a step of attempt 1 written while
/// the run is at attempt 2) in a transaction that is rolled back, and returns what the audit
/// saw of it: the check can fail.
async fn audit_sees_a_stale_append(sql: &mut Client) -> i64 {
    let tx = sql.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO abada_agent_runs (run_key, attempt, owner, version, next_seq, status)
              VALUES ('audit-probe', 2, 'probe', 3, 3, 'running');
         INSERT INTO abada_agent_steps (run_key, seq, attempt, run_version, kind, state, body)
              VALUES ('audit-probe', 2, 1, 3, 'model', 'finished', '{}');",
    )
    .await
    .unwrap();
    let seen = tx
        .query_one(&format!("{STALE_STEPS} AND run_key = 'audit-probe'"), &[])
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    seen
}

/// What other sessions hold in the test's database.
#[derive(Debug, Default, PartialEq, Eq)]
struct Held {
    idle_in_transaction: i64,
    advisory_locks: i64,
    table_locks: i64,
    /// A row of the store's tables locked by another session (`FOR UPDATE NOWAIT` refused).
    rows_locked: bool,
}

async fn held(sql: &mut Client) -> Held {
    let idle_in_transaction = count(
        sql,
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()
            AND state LIKE 'idle in transaction%'",
    )
    .await;
    let advisory_locks = count(
        sql,
        "SELECT count(*) FROM pg_locks
          WHERE locktype = 'advisory'
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await;
    let table_locks = count(
        sql,
        "SELECT count(*) FROM pg_locks
          WHERE pid <> pg_backend_pid()
            AND relation IN ('abada_agent_runs'::regclass, 'abada_agent_steps'::regclass)",
    )
    .await;
    let tx = sql.transaction().await.unwrap();
    let rows_locked = tx
        .batch_execute(
            "SELECT 1 FROM abada_agent_runs FOR UPDATE NOWAIT;
             SELECT 1 FROM abada_agent_steps FOR UPDATE NOWAIT;",
        )
        .await
        .is_err();
    tx.rollback().await.unwrap();
    Held {
        idle_in_transaction,
        advisory_locks,
        table_locks,
        rows_locked,
    }
}

/// Per run: a count from the audit, grouped by `run_key`.
async fn per_run(sql: &Client, query: &str) -> HashMap<String, i64> {
    sql.query(query, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// What the worker processes logged, summed: leases lost by reason, and the other warnings and
/// errors by message (with the first 160 characters of their details).
struct WorkerLogs {
    lost_by_reason: HashMap<String, usize>,
    warnings: HashMap<String, usize>,
}

impl WorkerLogs {
    fn read<'a>(processes: impl Iterator<Item = &'a WorkerProcess>) -> WorkerLogs {
        let mut logs = WorkerLogs {
            lost_by_reason: HashMap::new(),
            warnings: HashMap::new(),
        };
        for line in processes.flat_map(|p| p.stdout()) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let field = |k: &str| v.get(k).and_then(|m| m.as_str()).unwrap_or_default();
            if line.contains("lease lost") {
                *logs
                    .lost_by_reason
                    .entry(field("reason").to_string())
                    .or_default() += 1;
            } else if matches!(field("level"), "WARN" | "ERROR") {
                let detail: String = [field("details"), field("error")]
                    .concat()
                    .chars()
                    .take(160)
                    .collect();
                *logs
                    .warnings
                    .entry(format!("{}: {detail}", field("message")))
                    .or_default() += 1;
            }
        }
        logs
    }
}

impl std::fmt::Display for WorkerLogs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sorted = |m: &HashMap<String, usize>| {
            let mut v: Vec<(String, usize)> = m.iter().map(|(k, n)| (k.clone(), *n)).collect();
            v.sort();
            v
        };
        write!(
            f,
            "leases lost by reason (all workers' logs): {:?}; other warnings and errors: {:?}",
            sorted(&self.lost_by_reason),
            sorted(&self.warnings)
        )
    }
}

/// Three worker processes (the real binary) on the plain engine with the run store; 200 refund
/// tasks; rounds of SIGSTOP past the lease and SIGKILL + restart. Then: every task completed
/// exactly once; every keyed write applied once, under the key its `tool/started` step holds in
/// the store; at most one model call re-paid per interruption (the scripted model's log against
/// the model steps journaled); no step of a stale attempt accepted by the store, nor a write of a
/// stale holder by the engine; nothing left locked or in a transaction, and no session left once
/// the workers exit. Prints the figures (`--nocapture` shows them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_a_plain_engine_with_the_run_store() {
    const TASKS: usize = 200;
    const WORKERS: usize = 3;
    const SLOTS: &str = "4";
    const LOCK: Duration = Duration::from_millis(2000);
    const MAX_ROUNDS: u32 = 16;
    const CHAOS_LIMIT: Duration = Duration::from_secs(45);
    const STALL_LIMIT: Duration = Duration::from_secs(30);
    const TOKEN: &str = "chaos-orders-token";

    let Some(db) = TestDb::create().await else {
        return;
    };
    // Migrated as a worker does, then audited.
    let (store, _) = crate::store::connect(&crate::store::config(&db.url)).await;
    drop(store);
    let mut sql = db.sql().await;
    sql.batch_execute(AUDIT).await.unwrap();
    assert_eq!(
        audit_sees_a_stale_append(&mut sql).await,
        1,
        "the audit catches a stale append"
    );

    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script(
        REFUND_MODEL,
        refund_script().with_latency(Duration::from_millis(50)),
    );
    let orders = orders_server(TOKEN).await;
    let files = PlainFiles::write("openai/refund", Some((&orders.url(), TOKEN)));
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
    let store_url = db.url.render();
    let env = |id: &str| {
        let mut env = stack_env(&stack, id);
        env.extend([
            (
                config::ENV_LOCK_DURATION_MS.to_string(),
                LOCK.as_millis().to_string(),
            ),
            (config::ENV_MAX_TASKS.to_string(), SLOTS.to_string()),
            (config::ENV_POLL_INTERVAL_MS.to_string(), "100".to_string()),
            (config::ENV_STORE_URL.to_string(), store_url.clone()),
        ]);
        env.extend(files.env());
        env
    };
    let started = tokio::time::Instant::now();
    let plan = chaos::Plan {
        lock: LOCK,
        max_rounds: MAX_ROUNDS,
        limit: CHAOS_LIMIT,
    };
    let (mut workers, chaos, _replay_hint) =
        chaos::start_and_run(&stack.engine, WORKERS, "chaos", env, &plan, "store chaos").await;

    // The tasks left finish at the pace of a loaded machine: the wait fails only when no task
    // ends for a whole STALL_LIMIT.
    let mut seen = 0;
    while seen < TASKS {
        let progress = tokio::time::timeout(
            STALL_LIMIT,
            stack.engine.wait_for(|e| {
                let now = e
                    .tasks()
                    .iter()
                    .filter(|t| matches!(t.status, TaskStatus::Completed | TaskStatus::Failed))
                    .count();
                (now > seen).then_some(now)
            }),
        )
        .await;
        match progress {
            Ok(now) => seen = now,
            Err(_) => {
                let mut by_status: HashMap<String, usize> = HashMap::new();
                for v in stack.engine.tasks() {
                    *by_status.entry(format!("{:?}", v.status)).or_default() += 1;
                }
                panic!(
                    "no task ended for {STALL_LIMIT:?} after the chaos: {by_status:?}\n  {}",
                    WorkerLogs::read(chaos.killed.iter().chain(&workers))
                );
            }
        }
    }
    let views = stack.engine.tasks();

    // Nothing held while the workers still run: a transaction in flight is not a leak, so this
    // waits for a quiet moment (the workers are idle now) and fails only if none comes.
    let mut last = Held::default();
    let quiet = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            last = held(&mut sql).await;
            if last == Held::default() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(quiet.is_ok(), "still held after the tasks ended: {last:?}");
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        w.wait(Duration::from_secs(15)).await;
    }
    let total = started.elapsed();
    eventually(
        Duration::from_secs(15),
        "every worker session to end",
        async || {
            count(
                &sql,
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .await
                == 0
        },
    )
    .await;

    // Tasks: completed exactly once.
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
    let failures_reported: u32 = views.iter().map(|v| v.counters.failures).sum();
    let acquisitions: u32 = views.iter().map(|v| v.counters.acquisitions).sum();

    // The store: claims, stale and overtaken steps, model steps journaled.
    let claims = per_run(
        &sql,
        "SELECT run_key, count(*) FROM chaos_claims GROUP BY run_key",
    )
    .await;
    let model_steps = per_run(
        &sql,
        "SELECT run_key, count(*) FROM chaos_steps WHERE kind = 'model' GROUP BY run_key",
    )
    .await;
    let stale_steps = count(&sql, STALE_STEPS).await;
    let overtaken_steps = count(&sql, OVERTAKEN_STEPS).await;
    let started_keys: HashMap<String, Vec<String>> = sql
        .query(
            "SELECT run_key, key FROM chaos_steps
              WHERE kind = 'tool' AND state = 'started' AND tool = 'issue_refund'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .fold(HashMap::new(), |mut m, r| {
            m.entry(r.get(0)).or_default().push(r.get(1));
            m
        });
    let runs_left = count(&sql, "SELECT count(*) FROM abada_agent_runs").await;
    let runs_left_running = count(
        &sql,
        "SELECT count(*) FROM abada_agent_runs WHERE status = 'running'",
    )
    .await;

    // Keyed writes: applied once per task, under the key its started step holds in the store.
    let counters = orders.counters().await;
    let (keys_per_task, refund_calls) = chaos::refund_keys_per_task(&orders.calls());
    let mut key_mismatches = Vec::new();
    for id in &ids {
        let sent: Vec<&String> = keys_per_task
            .get(id)
            .map(|k| k.iter().collect())
            .unwrap_or_default();
        let journaled = started_keys.get(id).cloned().unwrap_or_default();
        if sent.len() != 1 || journaled.len() != 1 || sent[0] != &journaled[0] {
            key_mismatches.push(format!("{id}: sent {sent:?}, journaled {journaled:?}"));
        }
    }

    // Model calls: re-paid at most once per interruption (a claim after the first).
    let (model_calls, unattributed) =
        chaos::model_calls_per_task(&stack.model.requests(), &order_of);
    let (mut repaid_total, mut repaid_tasks, mut repaid_twice) = (0i64, 0usize, 0usize);
    let mut over_budget = Vec::new();
    for id in &ids {
        let calls = i64::from(model_calls.get(id).copied().unwrap_or(0));
        let journaled = model_steps.get(id).copied().unwrap_or(0);
        let interruptions = claims.get(id).copied().unwrap_or(0) - 1;
        let repaid = calls - journaled;
        repaid_total += repaid;
        repaid_tasks += usize::from(repaid > 0);
        repaid_twice += usize::from(repaid > 1);
        if journaled != 3 || repaid < 0 || repaid > interruptions {
            over_budget.push(format!(
                "{id}: {calls} model calls, {journaled} journaled, {interruptions} interruptions"
            ));
        }
    }
    let interrupted_tasks = claims.values().filter(|n| **n > 1).count();
    let interruption_total: i64 = claims.values().map(|n| n - 1).sum();

    // What the workers said: appends the store refused (the lease's first loss signal), every
    // lease lost by reason, and the other warnings.
    let said = WorkerLogs::read(chaos.killed.iter().chain(&workers));
    let fenced = said
        .lost_by_reason
        .get("RUN_STORE_FENCED")
        .copied()
        .unwrap_or(0);

    // The engine: writes of a holder that was no longer current (worker ids only: no attempts).
    let audit = chaos::audit_stale_writes(&stack.engine.calls(), false);

    println!(
        "store chaos: {TASKS} tasks, {WORKERS} workers x {SLOTS} slots, lease {LOCK:?}, plain v1 engine + run store; chaos {} rounds in {:.1?} ({} SIGKILL + restart, {} SIGSTOP past the lease + SIGCONT); all done after {total:.1?}",
        chaos.rounds, chaos.took, chaos.kills, chaos.freezes
    );
    println!(
        "  tasks completed exactly once: {}/{TASKS}; failures reported: {failures_reported}; engine acquisitions: {acquisitions}",
        TASKS - not_once.len()
    );
    println!(
        "  interrupted tasks (claimed more than once in the store): {interrupted_tasks}, interruptions in all: {interruption_total}"
    );
    println!(
        "  keyed writes applied: {} for {TASKS} tasks (unkeyed {}); refund calls received {refund_calls}, re-sends deduplicated {} on {} keys; tasks whose one key is the one journaled: {}",
        counters.writes_applied,
        counters.writes_unkeyed,
        counters.duplicates,
        counters.duplicates_per_key.len(),
        TASKS - key_mismatches.len()
    );
    println!(
        "  model calls: {} in all ({} journaled), re-paid {repaid_total} on {repaid_tasks} tasks ({repaid_twice} tasks re-paid more than one, allowed: one per interruption); unattributed {unattributed}",
        model_calls.values().sum::<u32>(),
        model_steps.values().sum::<i64>()
    );
    println!(
        "  store: appends refused as fenced (RUN_STORE_FENCED): {fenced}; stale-attempt steps accepted: {stale_steps}; steps written after a newer attempt's: {overtaken_steps}; runs left (killed between complete and finish): {runs_left} ({runs_left_running} running)"
    );
    println!("  {said}");
    println!(
        "  engine: writes accepted from a stale holder: {}; no-op completes: {}; refusals: {:?}",
        audit.accepted.len(),
        audit.noop_completes,
        audit.refusals_sorted()
    );
    println!("  locks at the end: {last:?}; worker sessions left after exit: 0");

    assert!(
        not_once.is_empty(),
        "not completed exactly once: {not_once:?}"
    );
    assert_eq!(
        counters.writes_applied, TASKS as u64,
        "every keyed write applied once"
    );
    assert_eq!(counters.writes_unkeyed, 0);
    assert!(
        key_mismatches.is_empty(),
        "keys sent versus journaled: {key_mismatches:?}"
    );
    assert!(
        over_budget.is_empty(),
        "model calls re-paid too often: {over_budget:?}"
    );
    assert_eq!(unattributed, 0);
    assert_eq!(stale_steps, 0, "steps of a stale attempt accepted");
    assert_eq!(overtaken_steps, 0, "steps written after a newer attempt's");
    assert!(
        audit.accepted.is_empty(),
        "stale writes accepted by the engine: {:?}",
        audit.accepted
    );
    // A holder re-sends its complete only under the same key (replayed, nothing run): no
    // complete of a completed task executes again, even as a no-op.
    assert_eq!(
        audit.noop_completes, 0,
        "completes executed on completed tasks by their completer"
    );
    assert!(
        chaos.kills >= 2 && chaos.freezes >= 2,
        "the chaos ran: {} kills, {} freezes",
        chaos.kills,
        chaos.freezes
    );
    assert!(interrupted_tasks > 0, "the chaos interrupted tasks");
    // Every freeze past the lease of a worker holding runs loses those leases. Which signal
    // wins is a race: on waking, the worker's own clock (LOCAL_EXPIRY) usually stops its tasks
    // before any of them reaches the store (one run: 54 LOCAL_EXPIRY, 0 RUN_STORE_FENCED), so
    // the store's refusal is not inevitable here; `store_runs::a_frozen_worker_is_refused_by_
    // the_store_and_goes_silent` freezes a worker inside a model call, where only the store can
    // stop it, and requires RUN_STORE_FENCED.
    let lost: usize = said.lost_by_reason.values().sum();
    assert!(
        lost >= 1,
        "no lease lost after {} freezes past the lease: {said}",
        chaos.freezes
    );
    drop(sql);
    orders.shutdown().await;
    stack.shutdown().await;
    db.drop().await;
}
