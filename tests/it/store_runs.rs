//! Agent runs on a plain v1 engine (the emulator's 0.11 mode: no `attempt`, no agent/1) kept
//! durable by the run store, against a real PostgreSQL: a crashed run resumes without paying the
//! model again, a frozen worker whose run was claimed by another is refused by the store and
//! goes silent, a store outage is waited out within the lease, and a keyed write started by a
//! worker killed before it journaled the result is re-sent under its original key, read back
//! from the store's journal.
//!
//! A plain engine issues no tool credential (protocol.md Part D): agents that call tools get
//! their servers and tokens from the tool-server registry (`ABADA_AGENT_TOOLS_FILE`).
//! The chaos test of this mode is `store_chaos.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::config;

use abada_agent_worker::devkit::engine::{Operation, ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::gate::{self, GatedEngine};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::{
    ORDERS_SERVER, Stack, StackWorkers, WorkerHandle, WorkerOptions,
};
use abada_agent_worker::devkit::tools::{StaticTokens, ToolServer, ToolServerOptions};
use abada_agent_worker::engine::TaskRef;
use async_trait::async_trait;
use tokio::sync::watch;

use crate::agent::{spec, wait_all_ended};
use crate::store::{TestDb, lock_waits_of, sessions_of};
use crate::support::process::{WorkerProcess, stack_env};
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
pub(crate) fn one_turn(latency: Duration) -> Script {
    Script::new(vec![Turn::text(r#"{"decision": "refunded"}"#)])
        .with_usage(100, 20)
        .with_latency(latency)
}

/// What a worker on the plain engine reads from files, since the engine sends no definition and
/// issues no tool credential: an agents file with a refund agent on `model` and, when a tool
/// server is given, a tools file naming it `orders` with a bearer token file (the
/// registry). Written under a directory of their own in Cargo's scratch directory for
/// integration tests (`target/tmp`, gone with `cargo clean`), left in place for the test's
/// whole run (a worker reads the token file again for every session).
pub(crate) struct PlainFiles {
    pub(crate) agents: PathBuf,
    pub(crate) tools: Option<PathBuf>,
}

impl PlainFiles {
    /// `orders`: the tool server's URL and the token it accepts.
    pub(crate) fn write(model: &str, orders: Option<(&str, &str)>) -> PlainFiles {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("abada-store-runs-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let servers = if orders.is_some() {
            "toolServers = [\"orders\"]\n"
        } else {
            ""
        };
        let agents = dir.join("agents.toml");
        std::fs::write(
            &agents,
            format!(
                "[agents.\"abada:agent\"]\nmodel = \"{model}\"\ninstructions = \"You handle refund requests.\"\n\
                 input = \"${{orderId}}\"\nresultVariable = \"refundDecision\"\nmaxTurns = 8\n{servers}"
            ),
        )
        .unwrap();
        let tools = orders.map(|(url, token)| {
            let token_file = dir.join("orders-token");
            std::fs::write(&token_file, token).unwrap();
            let tools = dir.join("tools.toml");
            std::fs::write(
                &tools,
                format!(
                    "[servers.orders]\nurl = \"{url}\"\nauth = \"bearer\"\ntokenFile = \"{}\"\n",
                    token_file.display()
                ),
            )
            .unwrap();
            tools
        });
        PlainFiles { agents, tools }
    }

    /// The variables that point a worker at these files.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![(
            config::ENV_AGENTS_FILE.to_string(),
            self.agents.display().to_string(),
        )];
        if let Some(tools) = &self.tools {
            env.push((
                config::ENV_TOOLS_FILE.to_string(),
                tools.display().to_string(),
            ));
        }
        env
    }
}

pub(crate) fn opts(id: &str, store_url: &str, model: &str, lock: Duration) -> WorkerOptions {
    let mut o = WorkerOptions::new(id, 2);
    o.lock_duration = lock;
    o.poll_interval = Duration::from_millis(50);
    o.env = vec![("ABADA_AGENT_STORE_URL".into(), store_url.into())];
    o.env.extend(PlainFiles::write(model, None).env());
    o
}

/// The first worker of a takeover, held inside its attempt: one slot, which the held attempt
/// fills, so once its lease runs out it cannot fetch the task again before the second worker
/// starts (its poll is much quicker than that start).
fn held_first_worker(store_url: &str, model: &str, lock: Duration) -> WorkerOptions {
    WorkerOptions {
        slots: 1,
        ..opts("w1", store_url, model, lock)
    }
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
        held_first_worker(&url, "openai/one-turn", lock),
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
    // The input step carries the run's start, so maxDurationMs counts from it on every attempt
    // (journal::started_input_step; the limit itself is tested with the engine's journal).
    let started = db
        .count(
            "SELECT count(*) FROM abada_agent_steps
              WHERE seq = 1 AND (body->>'startedAtMs')::bigint > 0",
        )
        .await;
    assert_eq!(started, 1, "the input step is stamped with the run's start");

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
    // w1's model call is answered only once w2 is done (held, not timed): the refusal below is
    // the store's whatever the machine's load. The lease and the provider timeout are long
    // enough that w1 neither gives up its call nor sees its own lease run out meanwhile.
    stack
        .model
        .set_script("frozen-turn", one_turn(Duration::ZERO));
    stack.model.hold("frozen-turn");
    stack.set_provider_request_timeout(Duration::from_secs(300));
    stack.model.set_script("one-turn", one_turn(Duration::ZERO));
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/one-turn", &[]), "o-seed"));
    let lock = Duration::from_secs(180);
    let w1 = stack.spawn_worker_with(
        held_first_worker(&url, "openai/frozen-turn", lock),
        Stack::fast_agent_settings(),
        GatedEngine::wrapper(Arc::new(HoldHeartbeats)),
    );
    eventually(
        Duration::from_secs(30),
        "w1 to be in its model call",
        async || stack.model.calls("frozen-turn") >= 1,
    )
    .await;
    stack.engine.advance(lock + Duration::from_secs(1));
    // w2 resumes the run on the definition it journaled (w1's agents file: the held model, not
    // w2's own `one-turn`): its claim fences w1 before either call is answered.
    let w2 = stack.spawn_worker(
        opts("w2", &url, "openai/one-turn", lock),
        Stack::fast_agent_settings(),
    );
    eventually(
        Duration::from_secs(30),
        "w2 to have claimed the run and be in its own model call",
        async || stack.model.calls("frozen-turn") >= 2,
    )
    .await;
    stack.model.release("frozen-turn");
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(90)).await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    assert_eq!(
        stack.model.calls("one-turn"),
        0,
        "the run kept its definition"
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
    assert_eq!(
        stack.model.calls("frozen-turn"),
        2,
        "w1 asked the model once, w2 once"
    );
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
    // The model call is held until the store is down (not timed): its answer is what the
    // worker must journal while the store is away, whatever the machine's load.
    stack
        .model
        .set_script("steady-turn", one_turn(Duration::ZERO));
    stack.model.hold("steady-turn");
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
    stack.model.release("steady-turn");
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

/// The devkit tool server as the registry names it, accepting `token` only.
pub(crate) async fn orders_server(token: &str) -> ToolServer {
    ToolServer::start(ToolServerOptions::new(
        ORDERS_SERVER,
        Arc::new(StaticTokens::new([token])),
    ))
    .await
    .unwrap()
}

/// A step of the store's journal as the test reads it: seq, kind, state, key, tool.
type StoredStep = (i64, String, String, Option<String>, Option<String>);

/// Worker 1 (the real binary) sends its keyed write (`issue_refund`); while the tool server
/// holds the write, the store goes away, so the result cannot be journaled; the write is applied
/// and answered, the worker's append of the result fails, and the worker is SIGKILLed. The
/// store's journal ends in the write's `tool/started` step with its key. Worker 2 claims the run,
/// reads that key back from the store's journal and sends the write again under it: the tool
/// server applies it once and answers the re-send from its ledger. No model turn is paid twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_keyed_write_is_resent_with_its_original_key_from_the_store() {
    const TOKEN: &str = "resend-orders-token";
    const LIMIT: Duration = Duration::from_secs(30);
    let Some(db) = TestDb::create().await else {
        return;
    };
    let proxy = TcpProxy::start(db.url.addr()).await;
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let orders = orders_server(TOKEN).await;
    let files = PlainFiles::write("openai/refund", Some((&orders.url(), TOKEN)));
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/refund", &[]), "o-resend"));
    // The write is applied and its answer held until the store is away (not timed): the worker
    // has journaled the write's start and cannot journal its result, whatever the load.
    orders.hold_next_write();
    let lock = Duration::from_secs(10);
    let mut env = stack_env(&stack, "w-killed");
    env.extend([
        (
            config::ENV_LOCK_DURATION_MS.into(),
            lock.as_millis().to_string(),
        ),
        (
            config::ENV_STORE_URL.into(),
            db.url.clone().at(proxy.addr).render(),
        ),
    ]);
    env.extend(files.env());
    let mut first = WorkerProcess::spawn(&env).await;
    let reached = tokio::time::timeout(LIMIT, orders.holding()).await;
    assert!(
        reached.is_ok(),
        "the keyed write was not applied and held within {LIMIT:?}; tool calls {:?}, model calls {}, task {:?}; worker 1 said:\n{}\n{}",
        orders.calls(),
        stack.model.total_calls(),
        stack.engine.task(&id),
        first.stdout().join("\n"),
        first.stderr().join("\n")
    );
    proxy.set(Mode::Down);
    assert_eq!(
        orders.counters().await.writes_applied,
        1,
        "the write is applied"
    );
    orders.release_held();
    eventually(
        LIMIT,
        "the worker to fail journaling the result",
        async || {
            let (_, metrics) = first.admin_get("/metrics").await;
            metrics.lines().any(|l| {
                l.starts_with("abada_agent_store_errors_total{operation=\"append\"")
                    && !l.ends_with(" 0")
            })
        },
    )
    .await;
    first.signal("KILL");
    first.wait(Duration::from_secs(10)).await;

    let sent = orders.keys_sent("issue_refund");
    assert_eq!(sent.len(), 1, "sent once by worker 1");
    let key = sent[0].clone().expect("a keyed write");
    let steps: Vec<StoredStep> = db
        .sql()
        .await
        .query(
            "SELECT seq, kind, state, key, body->>'tool' FROM abada_agent_steps
              WHERE run_key = $1 ORDER BY seq",
            &[&id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let last = steps.last().expect("worker 1 journaled steps").clone();
    assert_eq!(
        last,
        (
            last.0,
            "tool".to_string(),
            "started".to_string(),
            Some(key.clone()),
            Some("issue_refund".to_string())
        ),
        "the journal ends in the write's start, without its result: {steps:?}"
    );
    assert_eq!(
        key,
        format!("abada:{id}:{}", last.0),
        "the store path's key"
    );
    assert_eq!(stack.model.calls("refund"), 2, "worker 1 paid two turns");

    // Worker 1 is gone as far as the engine knows: its lease runs out, worker 2 takes the task.
    proxy.set(Mode::Forward);
    stack.engine.advance(lock + Duration::from_secs(1));
    let mut opts = WorkerOptions::new("w-second", 2);
    opts.lock_duration = lock;
    opts.poll_interval = Duration::from_millis(50);
    opts.env = vec![(config::ENV_STORE_URL.into(), db.url.render())];
    opts.env.extend(files.env());
    let second = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), LIMIT).await;
    second.stop().await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    assert_eq!(view.counters.acquisitions, 2);
    let keys = orders.keys_sent("issue_refund");
    assert_eq!(
        keys,
        vec![Some(key.clone()); 2],
        "re-sent under its original key"
    );
    let c = orders.counters().await;
    assert_eq!(
        (c.writes_applied, c.duplicates, c.unauthorized),
        (1, 1, 0),
        "applied once, the re-send answered from the ledger: {c:?}"
    );
    let answer = &view.result_variables.as_ref().unwrap()["refundDecision"];
    assert_eq!(
        answer["refund"]["refundId"], "rf-1",
        "the model saw the first application's result: {answer}"
    );
    assert_eq!(
        stack.model.calls("refund"),
        3,
        "worker 2 paid only the last turn"
    );
    orders.shutdown().await;
    db.drop().await;
}

/// The value of the unlabelled or labelled sample `series` (exact, e.g. `name{a="b"}`), 0 when
/// the worker has not exported it.
fn sample(worker: &WorkerHandle, series: &str) -> f64 {
    worker
        .metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Every `abada_agent_store_errors_total` sample that is not 0: `(labels, value)`.
fn store_errors(worker: &WorkerHandle) -> Vec<(String, f64)> {
    worker
        .metrics
        .encode()
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("abada_agent_store_errors_total")?;
            let (labels, value) = rest.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            (value != 0.0).then(|| (labels.to_string(), value))
        })
        .collect()
}

/// A worker of `slots` slots on a pool of one connection (`application_name` = `app`).
fn pool_of_one(
    stack: &Stack,
    db: &TestDb,
    app: &str,
    slots: u32,
    acquire_timeout_ms: u64,
) -> WorkerHandle {
    let url = db.url.clone().with("application_name", app).render();
    let mut o = opts(app, &url, "openai/one-turn", Duration::from_secs(60));
    o.slots = slots;
    o.env.extend([
        ("ABADA_AGENT_STORE_POOL_SIZE".into(), "1".into()),
        (
            "ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS".into(),
            acquire_timeout_ms.to_string(),
        ),
        // The lock this test holds must not outlast a transaction: the waits are the pool's.
        (
            "ABADA_AGENT_STORE_TRANSACTION_TIMEOUT_MS".into(),
            "60000".into(),
        ),
    ]);
    stack.spawn_worker(o, Stack::fast_agent_settings())
}

/// Runs one task through `w`, so that its store is connected and migrated before the test
/// locks the runs table (the migrations would wait on that lock too).
async fn warm_up(stack: &Stack, w: &WorkerHandle, order: &str) {
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/one-turn", &[]), order));
    let views = wait_all_ended(stack, &[id], Duration::from_secs(60)).await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    eventually(
        Duration::from_secs(30),
        "the warm-up run to be finished in the store",
        async || {
            sample(
                w,
                "abada_agent_store_transaction_duration_seconds_count{operation=\"finish\"}",
            ) == 1.0
                && sample(w, "abada_agent_store_pool_connections_in_use") == 0.0
        },
    )
    .await;
}

/// The pool at its limit: many tasks at once on a pool of one connection. Another
/// session holds a lock on the runs table, so the one pooled connection is stuck in a claim
/// while the other tasks' store calls queue for it: their claims, or, for a task that reaches
/// the store only once the stuck claim holds the connection, the lookup of its run that comes
/// before the claim (`locate`, which the lock alone would not stop). Which of the two a task
/// queues in is the scheduler's choice, so the test counts both.
///
/// With a patient pool the tasks wait and then proceed: every task completes once, each model
/// turn is paid once, two transactions per task (the finishes ride with claims), not one store error, never more than one
/// connection, and the pool-wait histogram shows the queue. With an acquire timeout shorter
/// than the lock, the waiting is bounded: the queued calls give up (transient errors of the
/// claim or the lookup, nothing else) while the connection is still held, at most once per
/// task per acquire timeout (no error storm), retry, and complete once it frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_pool_at_its_limit_tasks_wait_then_proceed_without_an_error_storm() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    // Migrate first, so that the lock below has a table to hold.
    let (migrated, _) = crate::store::connect(&crate::store::config(&db.url)).await;
    drop(migrated);
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack
        .model
        .set_script("one-turn", one_turn(Duration::from_millis(20)));
    let locker = db.sql().await;
    let lock_runs = "BEGIN; LOCK TABLE abada_agent_runs IN SHARE ROW EXCLUSIVE MODE";

    // A patient pool: 12 slots, 24 tasks, one connection.
    let w = pool_of_one(&stack, &db, "pool-limit-a", 12, 60_000);
    warm_up(&stack, &w, "o-warm-a").await;
    locker.batch_execute(lock_runs).await.unwrap();
    let ids: Vec<String> = (0..24)
        .map(|i| {
            stack.engine.create_task(spec(
                stack.refund_agent("openai/one-turn", &[]),
                &format!("o-a{i}"),
            ))
        })
        .collect();
    eventually(
        Duration::from_secs(30),
        "12 tasks started, one claim on the lock, the rest queued for the connection",
        async || {
            sample(&w, "abada_agent_slots_in_use") == 12.0
                && db.count(&lock_waits_of("pool-limit-a")).await == 1
        },
    )
    .await;
    assert_eq!(sample(&w, "abada_agent_store_pool_connections_in_use"), 1.0);
    assert_eq!(sample(&w, "abada_agent_store_pool_connections_open"), 1.0);
    assert_eq!(stack.model.total_calls(), 1, "no task got past its claim");
    locker.batch_execute("COMMIT").await.unwrap();
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(120)).await;
    for v in &views {
        assert_eq!(v.status, TaskStatus::Completed, "{v:?}");
        assert_eq!(v.counters.completes, 1, "{v:?}");
        assert_eq!(v.counters.acquisitions, 1, "{v:?}");
    }
    assert_eq!(stack.model.total_calls(), 25, "each turn paid once");
    assert_eq!(store_errors(&w), [], "not one store error");
    let transactions = |op: &str| {
        sample(
            &w,
            &format!("abada_agent_store_transaction_duration_seconds_count{{operation=\"{op}\"}}"),
        )
    };
    // A run is finished in the store once its completion was accepted: its finish rides with a
    // later claim, or the idle flush writes it a moment later (retention 0: deleted).
    eventually(
        Duration::from_secs(30),
        "every run to be finished in the store",
        async || db.count("SELECT count(*) FROM abada_agent_runs").await == 0,
    )
    .await;
    assert_eq!(transactions("claim"), 25.0, "one claim per task");
    assert_eq!(transactions("append"), 25.0, "one append per task");
    // Every transaction waited for the one connection; the 11 claims queued behind the stuck
    // one waited at least as long as it took this test to see them queued.
    assert!(sample(&w, "abada_agent_store_pool_wait_seconds_count") >= 50.0);
    let quick = sample(
        &w,
        "abada_agent_store_pool_wait_seconds_bucket{le=\"0.0001\"}",
    );
    let all = sample(
        &w,
        "abada_agent_store_pool_wait_seconds_bucket{le=\"+Inf\"}",
    );
    assert!(
        all - quick >= 11.0,
        "the queued claims are in the pool-wait histogram: {quick} of {all} under 0.1 ms"
    );
    assert!(db.count(&sessions_of("pool-limit-a")).await <= 1);
    w.stop().await;

    // An impatient pool: the queued calls give up after 2 s while the connection is held. Not
    // shorter: once the lock is gone, six tasks' claims, appends and finishes queue for the one
    // connection, and on a loaded machine a 200 ms wait there could give up an append.
    let (slots, acquire_timeout) = (6, Duration::from_secs(2));
    let w = pool_of_one(
        &stack,
        &db,
        "pool-limit-b",
        slots,
        acquire_timeout.as_millis() as u64,
    );
    warm_up(&stack, &w, "o-warm-b").await;
    locker.batch_execute(lock_runs).await.unwrap();
    let locked_at = std::time::Instant::now();
    // All six in one go, so one fetch takes them all and their lookups usually queue before the
    // first claim takes the connection (created one by one, a fetch between two creations let
    // the first task's claim take it before the others reached the store at all). Either way
    // each of the five other tasks is queued for the connection, in its claim or its lookup.
    let ids = stack.engine.create_tasks((0..slots).map(|i| {
        spec(
            stack.refund_agent("openai/one-turn", &[]),
            &format!("o-b{i}"),
        )
    }));
    let gave_up = |w: &WorkerHandle| {
        ["claim", "locate"]
            .iter()
            .map(|op| {
                sample(
                    w,
                    &format!(
                        "abada_agent_store_errors_total{{operation=\"{op}\",class=\"transient\"}}"
                    ),
                )
            })
            .sum::<f64>()
    };
    eventually(
        Duration::from_secs(30),
        "the queued claims and lookups to give up while the connection is held",
        async || gave_up(&w) >= 5.0,
    )
    .await;
    assert_eq!(
        db.count(&lock_waits_of("pool-limit-b")).await,
        1,
        "the connection was still held when they gave up: the wait was the acquire timeout"
    );
    // No error storm: a queued call gives up only after waiting the whole acquire timeout, so
    // each task fails at most once per timeout while the connection is held.
    let (failed, held) = (gave_up(&w), locked_at.elapsed());
    let bound = f64::from(slots) * (held.as_secs_f64() / acquire_timeout.as_secs_f64()).floor();
    assert!(
        failed <= bound,
        "{failed} claims and lookups gave up within {held:?}: more than one per task per {acquire_timeout:?}"
    );
    assert_eq!(stack.model.total_calls(), 26);
    locker.batch_execute("COMMIT").await.unwrap();
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(120)).await;
    for v in &views {
        assert_eq!(v.status, TaskStatus::Completed, "{v:?}");
        assert_eq!(v.counters.completes, 1, "{v:?}");
        assert_eq!(
            v.counters.acquisitions, 1,
            "the same attempt went on: {v:?}"
        );
    }
    assert_eq!(stack.model.total_calls(), 32, "each turn paid once");
    // Only what the test provoked: the pool's timeouts (transient), on the claims and lookups
    // queued behind the lock and on the sweeper or an idle flush of finishes if one came by
    // meanwhile; nothing fenced, conflicting or internal.
    for (labels, n) in store_errors(&w) {
        assert!(
            labels.contains("class=\"transient\"")
                && (labels.contains("operation=\"claim\"")
                    || labels.contains("operation=\"locate\"")
                    || labels.contains("operation=\"sweep\"")
                    || labels.contains("operation=\"finish\"")),
            "unexpected store errors {labels}: {n}"
        );
    }
    assert!(db.count(&sessions_of("pool-limit-b")).await <= 1);
    w.stop().await;
    stack.shutdown().await;
    db.drop().await;
}

/// With the run store, a run is deferred at most
/// `ABADA_AGENT_MAX_DEFERRALS_PER_RUN` times, each journaled (a `deferral/recorded` step, so
/// the count survives every worker); past that it ends as an incident naming the count, even
/// while the model stays down for everyone. Without the cap it would be deferred for ever.
#[tokio::test]
async fn a_run_deferred_past_the_cap_ends_as_an_incident_naming_the_count() {
    use abada_agent_worker::devkit::model::{Fault, FaultTimes};
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url.render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("down", one_turn(Duration::ZERO));
    stack
        .model
        .inject_fault("down", Fault::ServiceUnavailable, FaultTimes::Always);
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/down", &[]), "o-down"));
    let mut o = opts("w-defer", &url, "openai/down", Duration::from_secs(30));
    o.env.push((
        config::ENV_MAX_DEFERRALS_PER_RUN.to_string(),
        "2".to_string(),
    ));
    let w = stack.spawn_worker(o, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(60)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.retries, Some(0), "an incident");
    assert_eq!(
        view.counters.failures, 3,
        "two deferrals, then the incident"
    );
    let message = view.error_message.as_deref().unwrap_or_default();
    assert!(
        message.contains("deferred 2 times")
            && message.contains("ABADA_AGENT_MAX_DEFERRALS_PER_RUN"),
        "{message}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_steps WHERE kind = 'deferral'")
            .await,
        2,
        "each deferral journaled"
    );
    w.stop().await;
    stack.shutdown().await;
    db.drop().await;
}

/// The crash loop on a plain engine, where the run store keeps the journal: two earlier
/// attempts journaled the final answer and began judging it (its model step, then an
/// `output/judging`), and neither finished (the worker died while validating). The next
/// attempt, reading the store, does not validate a third time: an incident (retries 0) naming
/// the schema, `output/unfinished` journaled in the store, no model call.
#[tokio::test]
async fn a_run_whose_judging_never_finished_twice_in_the_store_is_an_incident() {
    use crate::support::steps::{answer, input};
    use abada_agent_worker::engine::JournalStep;
    use abada_agent_worker::store::{Claimant, RunKey};
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url.render();
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let id = stack
        .engine
        .create_task(spec(stack.refund_agent("openai/judged", &[]), "o-1"));
    let dir = crate::support::scratch::ScratchDir::new("judged-store");
    let agents = dir.write(
        "agents.toml",
        "[agents.\"abada:agent\"]\nmodel = \"openai/judged\"\ninstructions = \"You handle refunds.\"\n\
         input = \"${orderId}\"\nresultVariable = \"refundDecision\"\n\
         [agents.\"abada:agent\".outputSchema]\ntype = \"object\"\nrequired = [\"decision\"]\n",
    );
    let (store, _) = crate::store::connect(&crate::store::config(&db.url)).await;
    let run = RunKey::for_task(&id).unwrap();
    let earlier = Claimant {
        worker_id: "earlier",
        task_id: &id,
        hold: Duration::from_secs(30),
    };
    let mut fence = store
        .claim(&run, &earlier, Some(&input("o-1")))
        .await
        .unwrap()
        .fence;
    store
        .append(&mut fence, &answer(2, r#"{"decision": "refunded"}"#))
        .await
        .unwrap();
    let judging = JournalStep {
        seq: 3,
        kind: "output".into(),
        state: "judging".into(),
        key: None,
        data: serde_json::json!({"answerSeq": 2, "pass": 2}),
    };
    store.append(&mut fence, &judging).await.unwrap();
    drop(store);

    let mut o = WorkerOptions::new("w", 1);
    o.poll_interval = Duration::from_millis(50);
    o.env = vec![
        ("ABADA_AGENT_STORE_URL".into(), url),
        (config::ENV_AGENTS_FILE.into(), agents.display().to_string()),
    ];
    let w = stack.spawn_worker(o, Stack::fast_agent_settings());
    let view = &wait_all_ended(&stack, std::slice::from_ref(&id), Duration::from_secs(30)).await[0];
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.retries, Some(0), "an incident");
    let message = view.error_message.clone().unwrap_or_default();
    assert!(
        message.contains("began 2 times and never finished") && message.contains("sha256"),
        "{message}"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM abada_agent_steps WHERE kind = 'output' AND state = 'unfinished'"
        )
        .await,
        1
    );
    assert_eq!(stack.model.total_calls(), 0);
    w.stop().await;
    stack.shutdown().await;
    db.drop().await;
}
