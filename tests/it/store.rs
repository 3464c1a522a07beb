//! The run store against real PostgreSQL: migrations under concurrent start-up,
//! claims and fencing, appends whose acknowledgement was lost, a full pool, an outage and its
//! recovery, retention and abandoned runs, TLS per `sslmode`, and the password kept out of
//! every error, log line and `Debug` print.
//!
//! `scripts/test` starts a throwaway cluster and sets `ABADA_TEST_DATABASE_URL` (a superuser
//! URL) and `ABADA_TEST_DATABASE_CA_FILE`; each test creates a database of its own, so tests run
//! in parallel. Without the URL these tests fail and say how to get one, unless
//! `ABADA_SKIP_INTEROP=1` (the convention of the other real-peer tests), which skips them.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::config::StoreConfig;
use abada_agent_worker::engine::AppendOutcome;
use abada_agent_worker::metrics::{Metrics, ReasonLabel, StoreErrorLabels};
use abada_agent_worker::secret::SecretSource;
use abada_agent_worker::store::{
    Claimant, ErrorClass, FenceReason, PgRunStore, RunEnd, RunKey, StoreError, SweepReport,
};
use tokio::time::Instant;

use crate::support::emulator_worker::{within, within_for};
use crate::support::steps::{answer, input};
use crate::support::tcp_proxy::{Mode, TcpProxy};

// ---------------------------------------------------------------------------------------------
// Test databases

/// The server `scripts/test` started (or the one the developer named).
pub(crate) fn admin_url() -> Option<String> {
    match std::env::var("ABADA_TEST_DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var("ABADA_SKIP_INTEROP").as_deref() == Ok("1") => {
            eprintln!("skipping: ABADA_TEST_DATABASE_URL is not set (ABADA_SKIP_INTEROP=1)");
            None
        }
        _ => panic!(
            "ABADA_TEST_DATABASE_URL is not set: run scripts/test (it starts a throwaway PostgreSQL), \
             or eval \"$(scripts/test-postgres start)\" before cargo test, or set ABADA_SKIP_INTEROP=1 to skip these tests"
        ),
    }
}

/// The parts of a `postgres://user:password@host:port/db?params` URL, to build variants.
#[derive(Clone, Debug)]
pub(crate) struct PgUrl {
    user: String,
    pub(crate) password: String,
    host: String,
    port: u16,
    dbname: String,
    params: Vec<(String, String)>,
}

impl PgUrl {
    fn parse(url: &str) -> PgUrl {
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .expect("ABADA_TEST_DATABASE_URL is a postgres:// URL");
        let (userinfo, rest) = rest.rsplit_once('@').expect("the URL has user:password@");
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        let (hostport, rest) = rest.split_once('/').expect("the URL names a database");
        let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5432"));
        let (dbname, query) = rest.split_once('?').unwrap_or((rest, ""));
        let params = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (k.to_string(), v.to_string())
            })
            .collect();
        PgUrl {
            user: user.into(),
            password: password.into(),
            host: host.into(),
            port: port.parse().expect("a numeric port"),
            dbname: dbname.into(),
            params,
        }
    }

    pub(crate) fn with(mut self, key: &str, value: &str) -> PgUrl {
        self.params.retain(|(k, _)| k != key);
        self.params.push((key.into(), value.into()));
        self
    }

    pub(crate) fn at(mut self, addr: SocketAddr) -> PgUrl {
        self.host = addr.ip().to_string();
        self.port = addr.port();
        self
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        format!("{}:{}", self.host, self.port)
            .parse()
            .expect("the test server is addressed by IP")
    }

    pub(crate) fn render(&self) -> String {
        let query: Vec<String> = self
            .params
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "postgres://{}:{}@{}:{}/{}?{}",
            self.user,
            self.password,
            self.host,
            self.port,
            self.dbname,
            query.join("&")
        )
    }
}

/// A database of its own for one test, dropped at the end of a test that passed.
pub(crate) struct TestDb {
    pub(crate) url: PgUrl,
    admin: PgUrl,
}

impl TestDb {
    pub(crate) async fn create() -> Option<TestDb> {
        let admin = PgUrl::parse(&admin_url()?);
        let name = format!(
            "abada_it_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let client = connect_plain(&admin.render()).await;
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let mut url = admin.clone();
        url.dbname = name;
        Some(TestDb { url, admin })
    }

    /// A client of the test's own, for arranging and checking rows.
    pub(crate) async fn sql(&self) -> tokio_postgres::Client {
        connect_plain(&self.url.render()).await
    }

    pub(crate) async fn count(&self, query: &str) -> i64 {
        self.sql().await.query_one(query, &[]).await.unwrap().get(0)
    }

    /// Migrates the database (as its owner), then creates a login role with data rights only on
    /// the store's tables; returns the role's name. Roles are per cluster: see `drop_role`.
    async fn data_role(&self, password: &str) -> String {
        let (owner, _) = connect(&config(&self.url)).await;
        drop(owner);
        let role = format!(
            "abada_r_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        self.sql()
            .await
            .batch_execute(&format!(
                "CREATE ROLE {role} LOGIN PASSWORD '{password}';
                 REVOKE CREATE ON SCHEMA public FROM PUBLIC;
                 GRANT SELECT, INSERT, UPDATE, DELETE
                    ON abada_agent_runs, abada_agent_steps, abada_agent_model_pace,
                       abada_agent_store_migrations TO {role};
                 GRANT USAGE ON SEQUENCE abada_agent_run_attempts TO {role};"
            ))
            .await
            .unwrap();
        role
    }

    /// Drops the test database and then `role`, which owned nothing in it.
    async fn drop_with_role(self, role: &str) {
        let admin = self.admin.render();
        self.drop().await;
        connect_plain(&admin)
            .await
            .batch_execute(&format!("DROP ROLE {role}"))
            .await
            .unwrap();
    }

    pub(crate) async fn drop(self) {
        let client = connect_plain(&self.admin.render()).await;
        client
            .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.url.dbname))
            .await
            .unwrap();
    }
}

async fn connect_plain(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("the test server accepts the test URL");
    tokio::spawn(connection);
    client
}

/// Generous bounds: these tests run beside others on a busy machine, in a debug build (whose
/// SCRAM handshake is slow); the tests about timeouts set their own.
pub(crate) fn config(url: &PgUrl) -> StoreConfig {
    let mut config = StoreConfig::new(Arc::new(SecretSource::value(url.render())));
    config.pool_size = 4;
    config.acquire_timeout = Duration::from_secs(20);
    config.transaction_timeout = Duration::from_secs(20);
    config
}

pub(crate) async fn connect(config: &StoreConfig) -> (PgRunStore, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let store = within(
        "the store to connect",
        PgRunStore::connect(config, metrics.clone()),
    )
    .await
    .expect("the test store connects");
    (store, metrics)
}

/// The first attempt the sequence hands out (migration 0002): above every per-run count before.
pub(crate) const FIRST_ATTEMPT: u64 = 1 << 32;

/// A claimant for tests where the holder does not matter (a task's run: only that task claims
/// it): worker `worker`, task "task", a hold of 30 s.
pub(crate) fn by(worker: &'static str) -> Claimant<'static> {
    Claimant {
        worker_id: worker,
        task_id: "task",
        hold: Duration::from_secs(30),
    }
}

fn key(name: &str) -> RunKey {
    RunKey::for_task(name).unwrap()
}

/// Claims a fresh run `name` with its input step, for worker "w", and returns its fence.
async fn started(store: &PgRunStore, name: impl AsRef<str>) -> abada_agent_worker::store::Fence {
    store
        .claim(&key(name.as_ref()), &by("w"), Some(&input("hi")))
        .await
        .unwrap()
        .fence
}

fn transient_errors(metrics: &Metrics, operation: &'static str) -> u64 {
    metrics
        .store_errors
        .get_or_create(&StoreErrorLabels {
            operation,
            class: "transient",
        })
        .get()
}

/// `abada_agent_store_transaction_duration_seconds_count{operation="..."}`.
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

/// Log lines of the current thread (a current-thread runtime keeps the store's tasks on it).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

/// A capture in progress: the thread's subscriber and a second, idle one kept alive beside it.
/// With a single registered subscriber tracing decides a new callsite's interest from the
/// registering thread's default, so a callsite first hit on another test's thread would be
/// "never" for this one too; with two it asks each thread's subscriber at every event.
struct Capture {
    _guard: tracing::subscriber::DefaultGuard,
    _second: tracing::Dispatch,
}

impl Logs {
    fn capture(&self) -> Capture {
        let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
        let subscriber = tracing_subscriber::fmt()
            .with_writer(self.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .finish();
        Capture {
            _guard: tracing::subscriber::set_default(subscriber),
            _second: second,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn count(&self, needle: &str) -> usize {
        self.text().lines().filter(|l| l.contains(needle)).count()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

/// Retries a set-up step whose timing is not under test until it succeeds.
async fn until_ok<T, F, Fut>(what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    within(what, async {
        loop {
            match attempt().await {
                Ok(value) => return value,
                Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("{what}: {e}"),
            }
        }
    })
    .await
}

/// Counts the sessions of this test's database whose `application_name` is `app` (the view is
/// cluster-wide: another test's pool under the same name is not counted).
pub(crate) fn sessions_of(app: &str) -> String {
    format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = '{app}'"
    )
}

/// [`sessions_of`] that wait on a lock.
pub(crate) fn lock_waits_of(app: &str) -> String {
    format!("{} AND wait_event_type = 'Lock'", sessions_of(app))
}

/// Waits until `query` (a count) reaches `n`: PostgreSQL's own view of sessions and locks.
async fn wait_count(db: &TestDb, what: &str, query: &str, n: i64) {
    let client = db.sql().await;
    within(what, async {
        loop {
            let got: i64 = client.query_one(query, &[]).await.unwrap().get(0);
            if got == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Schema

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_replicas_starting_at_once_migrate_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut config = config(&db.url);
    // Twenty password handshakes at once on a busy 2-core machine in a debug build: room to
    // open the connections, which is not what this test is about.
    config.transaction_timeout = Duration::from_secs(60);
    let starts = (0..20).map(|_| {
        let config = config.clone();
        tokio::spawn(async move { PgRunStore::connect(&config, Arc::new(Metrics::new())).await })
    });
    // The guard is longer than the connect timeout above, so a slow start fails as the
    // store's own error, not as this guard.
    let stores: Vec<PgRunStore> = within_for(
        Duration::from_secs(90),
        "20 stores to connect",
        futures::future::join_all(starts),
    )
    .await
    .into_iter()
    .map(|joined| joined.unwrap().expect("every replica starts"))
    .collect();
    let applied: Vec<&str> = stores
        .iter()
        .flat_map(|s| s.migrations_applied().iter().copied())
        .collect();
    assert_eq!(
        applied,
        [
            "0001_run_store",
            "0002_run_attempts",
            "0003_open_runs",
            "0004_model_pace"
        ],
        "exactly one replica migrated"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_store_migrations")
            .await,
        4
    );
    // Every replica works on the schema it found.
    for (i, store) in stores.iter().enumerate() {
        let claim = store
            .claim(&key(&format!("t-{i}")), &by("w"), Some(&input("hi")))
            .await
            .unwrap();
        assert!(claim.fence.attempt() >= FIRST_ATTEMPT);
    }
    // A later start finds nothing to do.
    let (late, _) = connect(&config).await;
    assert!(late.migrations_applied().is_empty());
    drop((stores, late));
    db.drop().await;
}

/// After the first start the role needs no right to create anything.
#[tokio::test]
async fn a_role_with_data_rights_only_works_once_the_schema_exists() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let secret = uuid::Uuid::new_v4().simple().to_string();
    let role = db.data_role(&secret).await;
    let mut url = db.url.clone();
    url.user = role.clone();
    url.password = secret;
    let (store, _) = connect(&config(&url)).await;
    assert!(store.migrations_applied().is_empty());
    let mut fence = started(&store, "t").await;
    store.append(&mut fence, &answer(2, "ok")).await.unwrap();
    store.finish(&fence, RunEnd::Completed).await.unwrap();
    drop(store);
    db.drop_with_role(&role).await;
}

// ---------------------------------------------------------------------------------------------
// Claims, appends, fencing

fn assert_stale_version(e: &StoreError) {
    assert!(
        matches!(
            e,
            StoreError::Fenced {
                reason: FenceReason::StaleVersion { .. },
                ..
            }
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_claim_creates_the_run_then_increments_its_attempt_and_writes_the_input_step_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let run = key("task-1");

    let first = store
        .claim(&run, &by("worker-a"), Some(&input("refund me")))
        .await
        .unwrap();
    assert!(first.created);
    assert!(first.fence.attempt() >= FIRST_ATTEMPT);
    assert_eq!(first.fence.next_seq(), 2);
    assert_eq!(first.steps, vec![input("refund me")]);

    // A second claim (another worker) takes a newer attempt and keeps the journal. Its input
    // must be the journaled one (`store_visits` has the refusal of another).
    let second = store
        .claim(&run, &by("worker-b"), Some(&input("refund me")))
        .await
        .unwrap();
    assert!(!second.created);
    assert!(second.fence.attempt() > first.fence.attempt());
    assert_eq!(second.steps, vec![input("refund me")]);
    let owner: String = db
        .sql()
        .await
        .query_one(
            "SELECT owner FROM abada_agent_runs WHERE run_key = 'task-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner, "worker-b");

    // Without a first step a fresh run has no step; the next append is seq 1.
    let bare = store
        .claim(&key("task-2"), &by("worker-a"), None)
        .await
        .unwrap();
    assert!(bare.steps.is_empty());
    assert_eq!(bare.fence.next_seq(), 1);
    // A first step must be seq 1.
    let e = store
        .claim(&key("task-3"), &by("worker-a"), Some(&answer(2, "x")))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Invalid);
    drop(store);
    db.drop().await;
}

/// A process visit's run (approval) that finished is started over by the next claim: the
/// process came back to the node for new work, and replaying the finished conversation would
/// complete the new task with the old answer. Its attempt comes from the sequence, so the
/// finished conversation's fence matches nothing. A task's run is still reopened with its
/// journal.
#[tokio::test]
async fn a_visits_finished_run_claimed_again_starts_over_and_no_old_fence_matches() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut cfg = config(&db.url);
    cfg.retention = Duration::from_secs(3600);
    let (store, _) = connect(&cfg).await;

    let visit = RunKey::for_visit("process/p-1/refundAgent").unwrap();
    let mut old = store
        .claim(&visit, &by("worker-a"), Some(&input("first visit")))
        .await
        .unwrap()
        .fence;
    store
        .append(&mut old, &answer(2, "answer one"))
        .await
        .unwrap();
    store.finish(&old, RunEnd::Completed).await.unwrap();
    let again = store
        .claim(&visit, &by("worker-b"), Some(&input("second visit")))
        .await
        .unwrap();
    assert!(again.created, "the claim began the journal again");
    assert_eq!(again.steps, vec![input("second visit")]);
    assert!(again.fence.attempt() > old.attempt());
    let e = store
        .append(&mut old, &answer(2, "late from the first visit"))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Fenced { .. }), "{e:?}");
    let steps = db
        .count("SELECT count(*) FROM abada_agent_steps WHERE run_key = 'process/p-1/refundAgent'")
        .await;
    assert_eq!(steps, 1, "only the new visit's input step");

    // A running visit claimed again by its task (a redelivery) is resumed, not started over.
    let resumed = store
        .claim(&visit, &by("worker-c"), Some(&input("second visit")))
        .await
        .unwrap();
    assert!(!resumed.created);
    assert_eq!(resumed.steps, vec![input("second visit")]);

    // A task's finished run claimed again (the same task came back) keeps its journal.
    let task = key("task-again");
    let mut t = store
        .claim(&task, &by("worker-a"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    store.append(&mut t, &answer(2, "done")).await.unwrap();
    store.finish(&t, RunEnd::Completed).await.unwrap();
    let reopened = store.claim(&task, &by("worker-b"), None).await.unwrap();
    assert!(!reopened.created);
    assert_eq!(reopened.steps.len(), 2);
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn a_newer_claim_fences_the_older_attempt_and_only_the_new_owner_writes() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, metrics) = connect(&config(&db.url)).await;
    let run = key("task-fence");

    let mut a = store
        .claim(&run, &by("worker-a"), Some(&input("hi")))
        .await
        .unwrap()
        .fence;
    assert_eq!(
        store.append(&mut a, &answer(2, "from a")).await.unwrap(),
        AppendOutcome::Created
    );
    // Worker a freezes past its lease; worker b claims the run.
    let b_claim = store.claim(&run, &by("worker-b"), None).await.unwrap();
    assert_eq!(b_claim.steps, vec![input("hi"), answer(2, "from a")]);
    let mut b = b_claim.fence;
    assert!(b.attempt() > a.attempt());
    let (old, new) = (a.attempt(), b.attempt());

    // a wakes up: refused, distinctly.
    let e = store
        .append(&mut a, &answer(3, "late from a"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced);
    assert!(
        matches!(
            &e,
            StoreError::Fenced {
                attempt,
                reason: FenceReason::StaleAttempt { current },
                ..
            } if *attempt == old && *current == new
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "run task-fence: attempt {old} no longer owns the run (attempt {new} has claimed the run since); it must stop and report nothing"
        )
    );
    let e = store.finish(&a, RunEnd::Completed).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Fenced);

    assert_eq!(
        store.append(&mut b, &answer(3, "from b")).await.unwrap(),
        AppendOutcome::Created
    );
    let c = store.claim(&run, &by("worker-c"), None).await.unwrap();
    assert_eq!(
        c.steps,
        vec![input("hi"), answer(2, "from a"), answer(3, "from b")]
    );
    let attempts: Vec<u64> = db
        .sql()
        .await
        .query("SELECT attempt FROM abada_agent_steps ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) as u64)
        .collect();
    assert_eq!(attempts, [old, old, new]);
    let fenced = metrics
        .store_errors
        .get_or_create(&StoreErrorLabels {
            operation: "append",
            class: "fenced",
        })
        .get();
    assert_eq!(fenced, 1);
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn a_stale_copy_of_a_fence_and_a_gap_are_refused() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut fence = started(&store, "t").await;
    let mut stale = fence.clone();
    store.append(&mut fence, &answer(2, "two")).await.unwrap();
    store.append(&mut fence, &answer(3, "three")).await.unwrap();

    // The copy still expects the version before step 2.
    let e = store
        .append(&mut stale, &answer(3, "three"))
        .await
        .unwrap_err();
    assert_stale_version(&e);
    // The identical step 2, but the run moved on since: not this copy's lost commit.
    let e = store
        .append(&mut stale, &answer(2, "two"))
        .await
        .unwrap_err();
    assert_stale_version(&e);
    // A different step at a taken seq is a conflict, whoever asks.
    let e = store
        .append(&mut stale, &answer(2, "other"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Conflict, "{e:?}");
    // A gap.
    let e = store
        .append(&mut fence, &answer(5, "five"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Conflict, "{e:?}");
    assert!(
        e.to_string().contains("the next step of the run is seq 4"),
        "{e}"
    );
    assert_eq!(fence.next_seq(), 4);
    assert_eq!(
        store.append(&mut fence, &answer(4, "four")).await.unwrap(),
        AppendOutcome::Created
    );
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn a_retried_append_recognises_its_own_step_and_a_different_one_is_a_conflict() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, _) = connect(&config(&db.url)).await;
    let mut fence = started(&store, "t").await;
    // The fence as the caller holds it when the first try's acknowledgement is lost.
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

    // Both go on from there; the journal holds the step once (NUL stored as U+FFFD).
    store.append(&mut retry, &answer(3, "next")).await.unwrap();
    let steps = store.claim(&key("t"), &by("w2"), None).await.unwrap().steps;
    assert_eq!(steps.len(), 3);
    assert_eq!(
        steps[1].data["message"]["text"],
        "answer with a NUL \u{FFFD} inside"
    );
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn a_commit_whose_acknowledgement_is_lost_on_the_wire_is_already_present_on_retry() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let proxy = TcpProxy::start(db.url.addr()).await;
    let mut cfg = config(&db.url.clone().at(proxy.addr));
    cfg.pool_size = 1;
    let (store, metrics) = connect(&cfg).await;
    let mut fence = started(&store, "t").await;
    let before = fence.clone();

    // The statement reaches PostgreSQL and commits; its answer never comes back.
    proxy.set(Mode::SwallowReplies);
    let step = answer(2, "paid for");
    let e = store.append(&mut fence, &step).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Transient, "{e:?}");
    assert_eq!(fence, before, "a failed append leaves the fence alone");
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_steps WHERE seq = 2")
            .await,
        1,
        "the commit happened"
    );

    proxy.set(Mode::Forward);
    assert_eq!(
        store.append(&mut fence, &step).await.unwrap(),
        AppendOutcome::AlreadyPresent
    );
    assert_eq!(
        store.append(&mut fence, &answer(3, "next")).await.unwrap(),
        AppendOutcome::Created
    );
    let steps = store.claim(&key("t"), &by("w2"), None).await.unwrap().steps;
    assert_eq!(steps, vec![input("hi"), step, answer(3, "next")]);
    assert_eq!(transient_errors(&metrics, "append"), 1);
    drop(store);
    db.drop().await;
}

/// The budget of a one-turn task (input step and one model answer): three transactions.
#[tokio::test]
async fn a_one_turn_task_costs_three_transactions() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (store, metrics) = connect(&config(&db.url)).await;
    let mut fence = started(&store, "one-turn").await;
    store.append(&mut fence, &answer(2, "done")).await.unwrap();
    store.finish(&fence, RunEnd::Completed).await.unwrap();
    let counts = [
        transactions(&metrics, "claim"),
        transactions(&metrics, "append"),
        transactions(&metrics, "finish"),
        transactions(&metrics, "sweep"),
    ];
    assert_eq!(counts, [1, 1, 1, 0]);
    // With the default retention (0) finishing deleted the run and its steps.
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_steps").await, 0);
    // A retried finish (lost acknowledgement) succeeds.
    store.finish(&fence, RunEnd::Completed).await.unwrap();
    drop(store);
    db.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Pool, outage

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_makes_callers_wait_then_proceed_and_time_out_when_it_never_frees() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut cfg = config(&db.url.clone().with("application_name", "pool-a"));
    cfg.pool_size = 2;
    cfg.acquire_timeout = Duration::from_secs(20);
    cfg.transaction_timeout = Duration::from_secs(20);
    let (store, metrics) = connect(&cfg).await;
    let mut fences = Vec::new();
    for name in ["x1", "x2", "y"] {
        fences.push(
            store
                .claim(&key(name), &by("w"), Some(&input("hi")))
                .await
                .unwrap()
                .fence,
        );
    }
    let mut y = fences.pop().unwrap();

    // Another session locks x1 and x2: an append to each holds a pooled connection while it
    // waits for the row lock, and the pool of two is full.
    let locker = db.sql().await;
    locker
        .batch_execute(
            "BEGIN; SELECT 1 FROM abada_agent_runs WHERE run_key IN ('x1', 'x2') FOR UPDATE",
        )
        .await
        .unwrap();
    let blocked: Vec<_> = fences
        .into_iter()
        .map(|mut fence| {
            let store = store.clone();
            tokio::spawn(async move { store.append(&mut fence, &answer(2, "x")).await })
        })
        .collect();
    wait_count(
        &db,
        "both pooled connections to wait on the row lock",
        &lock_waits_of("pool-a"),
        2,
    )
    .await;
    assert_eq!(metrics.store_pool_in_use.get(), 2);

    // A third caller waits for a connection...
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            let outcome = store.append(&mut y, &answer(2, "y")).await;
            (outcome, y)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "no connection is free, so the caller waits"
    );
    // ...and proceeds when the lock holder lets go.
    locker.batch_execute("COMMIT").await.unwrap();
    for b in blocked {
        assert_eq!(
            within("a blocked append", b).await.unwrap().unwrap(),
            AppendOutcome::Created
        );
    }
    let (outcome, _) = within("the waiting append", waiting).await.unwrap();
    assert_eq!(outcome.unwrap(), AppendOutcome::Created);
    assert_eq!(
        db.count(&sessions_of("pool-a")).await,
        2,
        "never more connections than the pool size"
    );

    // A pool of one that never frees: every further caller gives up after the acquire
    // timeout with a clear, transient error; none waits for ever, none opens a connection.
    let mut cfg = config(&db.url.clone().with("application_name", "pool-b"));
    cfg.pool_size = 1;
    cfg.acquire_timeout = Duration::from_millis(300);
    cfg.transaction_timeout = Duration::from_secs(20);
    let (small, metrics) = connect(&cfg).await;
    let mut held = started(&small, "z").await;
    let callers: Vec<_> = (0..10).map(|i| key(&format!("free-{i}"))).collect();
    locker
        .batch_execute("BEGIN; SELECT 1 FROM abada_agent_runs WHERE run_key = 'z' FOR UPDATE")
        .await
        .unwrap();
    let holder = {
        let small = small.clone();
        tokio::spawn(async move { small.append(&mut held, &answer(2, "z")).await })
    };
    wait_count(
        &db,
        "the only pooled connection to wait on the row lock",
        &lock_waits_of("pool-b"),
        1,
    )
    .await;
    let started = Instant::now();
    let w = by("w");
    let attempts = callers.iter().map(|run| small.claim(run, &w, None));
    let results = within(
        "the callers to give up",
        futures::future::join_all(attempts),
    )
    .await;
    // Each gave up at its acquire timeout, not before, and not at some later bound (the
    // transaction timeout is 20 s): the upper bound leaves a loaded machine 1.7 s.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "the callers gave up after {waited:?} (acquire timeout 300 ms)"
    );
    for result in results {
        let e = result.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient);
        assert!(
            e.to_string().contains("no connection of the pool (1) came free within 300 ms (ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS)"),
            "{e}"
        );
    }
    assert_eq!(transient_errors(&metrics, "claim"), 10);
    assert_eq!(db.count(&sessions_of("pool-b")).await, 1);
    locker.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        within("the holder", holder).await.unwrap().unwrap(),
        AppendOutcome::Created
    );
    drop((store, small));
    db.drop().await;
}

/// A frozen holder of a lock (here: another session) costs a transaction at most the
/// transaction timeout, enforced by the server (`lock_timeout`) as well as by the worker.
#[tokio::test]
async fn a_transaction_stuck_on_a_lock_gives_up_after_the_transaction_timeout() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (setup, _) = connect(&config(&db.url)).await;
    let mut fence = started(&setup, "t").await;
    drop(setup);
    let mut cfg = config(&db.url);
    // The server's lock_timeout is the transaction timeout, the worker's own bound a quarter
    // more: 4 s leaves the server's cancellation 1 s to arrive first on a loaded machine.
    let timeout = Duration::from_secs(4);
    cfg.transaction_timeout = timeout;
    cfg.pool_size = 1;
    // Under load a debug build's password handshake can be slow, and opening a connection is
    // not what this test is about: retried until the pooled connection is open.
    let metrics = Arc::new(Metrics::new());
    let warm_up = key("warm-up");
    let store = until_ok("the store to connect", || {
        PgRunStore::connect(&cfg, metrics.clone())
    })
    .await;
    let w = by("w");
    until_ok("a pooled connection", || store.claim(&warm_up, &w, None)).await;
    let locker = db.sql().await;
    locker
        .batch_execute("BEGIN; SELECT 1 FROM abada_agent_runs WHERE run_key = 't' FOR UPDATE")
        .await
        .unwrap();
    let started = Instant::now();
    let e = store.append(&mut fence, &answer(2, "x")).await.unwrap_err();
    let took = started.elapsed();
    // At the server's lock_timeout (4 s), and never past the worker's own bound (a quarter
    // more, 5 s) plus 1 s for a loaded machine to deliver the error.
    assert!(
        took >= timeout && took < timeout + timeout / 4 + Duration::from_secs(1),
        "gave up after {took:?} (transaction timeout {timeout:?})"
    );
    assert_eq!(e.class(), ErrorClass::Transient, "{e:?}");
    assert!(
        e.to_string().contains("57014: canceling statement due to")
            || e.to_string()
                .contains("55P03: canceling statement due to lock timeout"),
        "the server enforced it: {e}"
    );
    assert_eq!(transient_errors(&metrics, "append"), 1);
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        store.append(&mut fence, &answer(2, "x")).await.unwrap(),
        AppendOutcome::Created
    );
    drop(store);
    db.drop().await;
}

#[tokio::test]
async fn the_store_going_away_is_transient_logged_once_and_recovery_works() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let logs = Logs::default();
    let _guard = logs.capture();
    let proxy = TcpProxy::start(db.url.addr()).await;
    let (store, metrics) = connect(&config(&db.url.clone().at(proxy.addr))).await;
    let mut fence = started(&store, "t").await;

    proxy.set(Mode::Down);
    for _ in 0..3 {
        let e = store.append(&mut fence, &answer(2, "a")).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient, "{e:?}");
        assert!(e.is_transient());
        assert!(e.to_string().contains("is unavailable"), "{e}");
    }
    assert_eq!(transient_errors(&metrics, "append"), 3);
    assert_eq!(
        logs.count("the run store is unavailable"),
        1,
        "{}",
        logs.text()
    );

    proxy.set(Mode::Forward);
    assert_eq!(
        store.append(&mut fence, &answer(2, "a")).await.unwrap(),
        AppendOutcome::Created
    );
    assert_eq!(
        logs.count("the run store is available again"),
        1,
        "{}",
        logs.text()
    );
    assert!(
        logs.text().contains("failed_transactions=3"),
        "{}",
        logs.text()
    );

    // A second outage is a second line.
    proxy.set(Mode::Down);
    assert!(store.append(&mut fence, &answer(3, "b")).await.is_err());
    assert_eq!(logs.count("the run store is unavailable"), 2);
    proxy.set(Mode::Forward);
    store.append(&mut fence, &answer(3, "b")).await.unwrap();
    drop(store);
    db.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Retention

#[tokio::test]
async fn finished_runs_are_deleted_after_retention_in_small_batches() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut cfg = config(&db.url);
    cfg.retention = Duration::from_secs(3600);
    cfg.sweep_batch = 10;
    let (store, metrics) = connect(&cfg).await;
    assert_eq!(store.sweep_interval(), Duration::from_secs(60));
    for i in 0..25 {
        let mut fence = started(&store, format!("done-{i:02}")).await;
        store.append(&mut fence, &answer(2, "ok")).await.unwrap();
        store.finish(&fence, RunEnd::Completed).await.unwrap();
    }
    // Marked, not deleted: the retention keeps them.
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_runs WHERE status = 'completed'")
            .await,
        25
    );
    assert_eq!(store.sweep().await.unwrap().finished, 0);

    // 23 of them finished two hours ago.
    db.sql()
        .await
        .batch_execute(
            "UPDATE abada_agent_runs SET finished_at = now() - interval '2 hours'
              WHERE run_key NOT IN ('done-00', 'done-01')",
        )
        .await
        .unwrap();
    let report = store.sweep().await.unwrap();
    assert_eq!(report.finished, 23);
    assert_eq!(report.abandoned, 0);
    assert_eq!(
        report.batches,
        3 + 1,
        "10 + 10 + 3 finished, then one empty abandoned batch"
    );
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 2);
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_steps").await, 4);
    assert_eq!(
        metrics
            .store_runs_deleted
            .get_or_create(&ReasonLabel { reason: "finished" })
            .get(),
        23
    );

    // A finished run claimed again (its task came back) is reopened with its journal.
    let again = store.claim(&key("done-00"), &by("w2"), None).await.unwrap();
    assert_eq!(again.steps.len(), 2);
    assert!(again.fence.attempt() > FIRST_ATTEMPT);

    // The background sweeper does the same on its own, every half retention (here 1 s).
    let mut short = config(&db.url);
    short.retention = Duration::from_secs(2);
    let (swept, _) = connect(&short).await;
    assert_eq!(swept.sweep_interval(), Duration::from_secs(1));
    db.sql()
        .await
        .batch_execute(
            "UPDATE abada_agent_runs SET finished_at = now() - interval '1 hour'
              WHERE run_key = 'done-01'",
        )
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let sweeper = swept.spawn_sweeper(stop.clone(), abada_agent_worker::random::Random::os());
    wait_count(
        &db,
        "the sweeper to delete the finished run",
        "SELECT count(*) FROM abada_agent_runs WHERE run_key = 'done-01'",
        0,
    )
    .await;
    stop.cancel();
    within("the sweeper to stop", sweeper).await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_runs WHERE run_key = 'done-00'")
            .await,
        1,
        "the reopened run is not finished"
    );
    drop((store, swept));
    db.drop().await;
}

/// A worker killed between the engine's complete and the store's finish leaves a run nobody
/// will finish: deleted once idle past ABADA_AGENT_STORE_ABANDONED_AFTER, never before.
#[tokio::test]
async fn a_run_never_finished_is_deleted_once_abandoned_and_not_before() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let cfg = config(&db.url);
    assert_eq!(cfg.abandoned_after, Some(Duration::from_secs(30 * 86_400)));
    let (store, metrics) = connect(&cfg).await;
    for name in ["orphan", "busy"] {
        let mut fence = store
            .claim(&key(name), &by("w"), Some(&input("hi")))
            .await
            .unwrap()
            .fence;
        store
            .append(&mut fence, &answer(2, "final answer"))
            .await
            .unwrap();
        // ...the engine accepts the completion, and the worker dies before finish.
    }
    let nothing = SweepReport {
        batches: 2,
        ..Default::default()
    };
    assert_eq!(store.sweep().await.unwrap(), nothing);
    db.sql()
        .await
        .batch_execute(
            "UPDATE abada_agent_runs SET updated_at = now() - interval '31 days' WHERE run_key = 'orphan'",
        )
        .await
        .unwrap();
    let report = store.sweep().await.unwrap();
    assert_eq!((report.finished, report.abandoned), (0, 1));
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_steps WHERE run_key = 'orphan'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_runs WHERE run_key = 'busy'")
            .await,
        1
    );
    assert_eq!(
        metrics
            .store_runs_deleted
            .get_or_create(&ReasonLabel {
                reason: "abandoned"
            })
            .get(),
        1
    );
    // An abandoned run is an orphan: nobody resumed it (a worker lost, a change that left it
    // behind); the sweeper reports it as one.
    assert_eq!(
        metrics
            .store_runs_orphaned
            .get_or_create(&ReasonLabel {
                reason: "abandoned"
            })
            .get(),
        1
    );

    // With ABADA_AGENT_STORE_ABANDONED_AFTER=never nothing unfinished is ever deleted.
    let mut never = config(&db.url);
    never.abandoned_after = None;
    let (keeper, _) = connect(&never).await;
    db.sql()
        .await
        .batch_execute("UPDATE abada_agent_runs SET updated_at = now() - interval '3650 days'")
        .await
        .unwrap();
    assert_eq!(keeper.sweep().await.unwrap().abandoned, 0);
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 1);
    drop((store, keeper));
    db.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Secrets and TLS

#[tokio::test]
async fn the_password_appears_in_no_error_log_line_or_debug_print() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let logs = Logs::default();
    let _guard = logs.capture();
    let password = db.url.password.clone();
    let wrong = format!("wrong-pw-{}", uuid::Uuid::new_v4().simple());
    let mut seen = Vec::new();

    // A wrong password: refused, and said so.
    let mut bad = db.url.clone();
    bad.password = wrong.clone();
    let e = PgRunStore::connect(&config(&bad), Arc::new(Metrics::new()))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(
        e.to_string().contains("password authentication failed"),
        "{e}"
    );
    seen.push(format!("{e} {e:?}"));

    // An unreachable server.
    let proxy = TcpProxy::start(db.url.addr()).await;
    proxy.set(Mode::Down);
    let e = PgRunStore::connect(
        &config(&db.url.clone().at(proxy.addr)),
        Arc::new(Metrics::new()),
    )
    .await
    .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Transient, "{e:?}");
    seen.push(format!("{e} {e:?}"));

    // A working store, its URL from a file, through an outage and back.
    proxy.set(Mode::Forward);
    let dir = std::env::temp_dir().join(format!("abada-store-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("url");
    std::fs::write(
        &file,
        format!("{}\n", db.url.clone().at(proxy.addr).render()),
    )
    .unwrap();
    let mut cfg = config(&db.url);
    cfg.url = Arc::new(SecretSource::file(&file));
    let (store, metrics) = connect(&cfg).await;
    let claim = store
        .claim(&key("t"), &by("w"), Some(&input("hi")))
        .await
        .unwrap();
    let mut fence = claim.fence.clone();
    proxy.set(Mode::Down);
    let e = store.append(&mut fence, &answer(2, "x")).await.unwrap_err();
    seen.push(format!("{e} {e:?}"));
    proxy.set(Mode::Forward);
    store.append(&mut fence, &answer(2, "x")).await.unwrap();
    seen.push(format!(
        "{store:?} {claim:?} {fence:?} {cfg:?} {}",
        store.redacted_url()
    ));
    seen.push(metrics.encode());
    seen.push(logs.text());
    assert!(logs.text().contains("run store ready"), "{}", logs.text());

    for text in &seen {
        assert!(!text.contains(&password), "the password leaked: {text}");
        assert!(!text.contains(&wrong), "the wrong password leaked: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    drop(store);
    db.drop().await;
}

/// `ABADA_AGENT_STORE_URL_FILE` is read again for every new connection: a rotated password
/// applies without a restart, and open connections carry on meanwhile.
#[tokio::test]
async fn a_rotated_url_file_applies_to_new_connections() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (first, second) = ("first-secret", "the-second-secret");
    let role = db.data_role(first).await;
    let admin = db.sql().await;
    let proxy = TcpProxy::start(db.url.addr()).await;
    let url_with = |password: &str| {
        let mut url = db.url.clone().at(proxy.addr);
        url.user = role.clone();
        url.password = password.into();
        format!("{}\n", url.render())
    };
    let dir = std::env::temp_dir().join(format!("abada-store-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("url");
    std::fs::write(&file, url_with(first)).unwrap();
    let mut cfg = config(&db.url);
    cfg.url = Arc::new(SecretSource::file(&file));
    cfg.pool_size = 1;
    let (store, _) = connect(&cfg).await;
    let mut fence = started(&store, "t").await;

    // The password changes in the database: the open connection carries on.
    admin
        .batch_execute(&format!("ALTER ROLE {role} PASSWORD '{second}'"))
        .await
        .unwrap();
    store.append(&mut fence, &answer(2, "two")).await.unwrap();
    // A new connection with the old file is refused...
    proxy.set(Mode::Down);
    wait_count(
        &db,
        "the role's session to be cut",
        &format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'"),
        0,
    )
    .await;
    proxy.set(Mode::Forward);
    let e = store
        .append(&mut fence, &answer(3, "three"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    // ...and with the rotated file accepted, without a restart.
    std::fs::write(&file, url_with(second)).unwrap();
    assert_eq!(
        store.append(&mut fence, &answer(3, "three")).await.unwrap(),
        AppendOutcome::Created
    );
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
    db.drop_with_role(&role).await;
}

/// Every `sslmode` against the test cluster, whose certificate (signed by the test CA) names
/// `localhost` only.
#[tokio::test]
async fn every_sslmode_does_what_the_readme_says() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let Ok(ca) = std::env::var("ABADA_TEST_DATABASE_CA_FILE") else {
        eprintln!(
            "skipping: ABADA_TEST_DATABASE_CA_FILE is not set (the CA of the test server's certificate; scripts/test sets it)"
        );
        return;
    };
    let ca = std::path::PathBuf::from(ca);
    let by_ip = db.url.clone();
    let by_name = {
        let mut url = db.url.clone().with("hostaddr", &db.url.host);
        url.host = "localhost".into();
        url
    };
    let attempt = |url: PgUrl, mode: &str, ca_file: Option<&std::path::Path>| {
        let mut cfg = config(&url.with("sslmode", mode));
        cfg.ca_file = ca_file.map(|p| p.to_path_buf());
        async move { PgRunStore::connect(&cfg, Arc::new(Metrics::new())).await }
    };

    let plain = attempt(by_ip.clone(), "disable", None).await.unwrap();
    assert_eq!(plain.server().tls, None);
    for mode in ["prefer", "require"] {
        let store = attempt(by_ip.clone(), mode, None).await.unwrap();
        assert!(
            store
                .server()
                .tls
                .as_deref()
                .is_some_and(|v| v.starts_with("TLS")),
            "{mode}"
        );
    }
    // verify-ca: the chain must lead to a trusted root; the name is not checked.
    let e = attempt(by_ip.clone(), "verify-ca", None).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(e.to_string().contains("ABADA_AGENT_CA_FILE"), "{e}");
    let store = attempt(by_ip.clone(), "verify-ca", Some(&ca))
        .await
        .unwrap();
    assert!(store.server().tls.is_some());
    // verify-full: the certificate must also name the host.
    let e = attempt(by_ip.clone(), "verify-full", Some(&ca))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    let e = attempt(by_name.clone(), "verify-full", None)
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    let store = attempt(by_name, "verify-full", Some(&ca)).await.unwrap();
    assert!(store.server().tls.is_some());
    let mut fence = started(&store, "tls").await;
    assert_eq!(
        store
            .append(&mut fence, &answer(2, "over TLS"))
            .await
            .unwrap(),
        AppendOutcome::Created
    );
    drop((plain, store));
    db.drop().await;
}

/// The real cluster reached as a remote store: by the name `localhost` (a name, so remote to
/// the worker) and without `sslmode`, it is `verify-full` with `channel_binding=require`: SCRAM
/// bound to the certificate, which PostgreSQL offers over TLS. Without the CA it is refused in
/// the handshake; `require` is refused unless allowed, and works with the allowance (channel
/// binding still required).
#[tokio::test]
async fn a_remote_store_is_verify_full_with_channel_binding_by_default() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let Ok(ca) = std::env::var("ABADA_TEST_DATABASE_CA_FILE") else {
        eprintln!("skipping: ABADA_TEST_DATABASE_CA_FILE is not set (scripts/test sets it)");
        return;
    };
    let mut by_name = db.url.clone();
    by_name
        .params
        .retain(|(k, _)| k != "sslmode" && k != "hostaddr");
    by_name.host = "localhost".into();
    let mut cfg = config(&by_name);
    cfg.ca_file = Some(ca.into());

    let store = within(
        "the store to connect by name",
        PgRunStore::connect(&cfg, Arc::new(Metrics::new())),
    )
    .await
    .unwrap();
    assert!(
        store.redacted_url().ends_with("sslmode=verify-full"),
        "{}",
        store.redacted_url()
    );
    assert!(store.server().tls.is_some());
    let mut fence = started(&store, "remote").await;
    assert_eq!(
        store.append(&mut fence, &answer(2, "bound")).await.unwrap(),
        AppendOutcome::Created
    );
    drop(store);

    let mut untrusted = cfg.clone();
    untrusted.ca_file = None;
    let e = PgRunStore::connect(&untrusted, Arc::new(Metrics::new()))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");

    let mut require = config(&by_name.clone().with("sslmode", "require"));
    let e = PgRunStore::connect(&require, Arc::new(Metrics::new()))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(
        e.to_string()
            .contains("ABADA_AGENT_STORE_ALLOW_INSECURE=true"),
        "{e}"
    );
    require.allow_insecure = true;
    let logs = Logs::default();
    let capture = logs.capture();
    let store = PgRunStore::connect(&require, Arc::new(Metrics::new()))
        .await
        .unwrap();
    drop(capture);
    assert!(store.server().tls.is_some());
    // One warning says what the allowance exposes; the password is in no line.
    assert_eq!(
        logs.count("ABADA_AGENT_STORE_ALLOW_INSECURE=true"),
        1,
        "{}",
        logs.text()
    );
    assert!(logs.text().contains("sslmode=require"), "{}", logs.text());
    assert!(!logs.text().contains(&by_name.password), "{}", logs.text());
    drop(store);
    db.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Figures

/// Append latency on loopback with concurrent appenders, printed (`--nocapture`), not asserted:
/// `ABADA_STORE_BENCH_APPENDERS` (default 8) runs of `ABADA_STORE_BENCH_APPENDS` (default 100)
/// appends each, pool of `ABADA_STORE_BENCH_POOL` (default 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_latency_figures() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let knob = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let appenders = knob("ABADA_STORE_BENCH_APPENDERS", 8);
    let appends = knob("ABADA_STORE_BENCH_APPENDS", 100);
    let mut cfg = config(&db.url);
    cfg.pool_size = knob("ABADA_STORE_BENCH_POOL", 8);
    let (store, metrics) = connect(&cfg).await;
    let began = Instant::now();
    let runs = (0..appenders).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let mut fence = started(&store, format!("bench-{i}")).await;
            let mut took = Vec::with_capacity(appends);
            for n in 0..appends {
                let step = answer(n as u64 + 2, &"a model answer of some length ".repeat(8));
                let t = Instant::now();
                assert_eq!(
                    store.append(&mut fence, &step).await.unwrap(),
                    AppendOutcome::Created
                );
                took.push(t.elapsed());
            }
            store.finish(&fence, RunEnd::Completed).await.unwrap();
            took
        })
    });
    // 800 transactions on a loaded 2-core machine: a hang guard, not a figure.
    let mut all: Vec<Duration> = within_for(
        Duration::from_secs(120),
        "the appenders",
        futures::future::join_all(runs),
    )
    .await
    .into_iter()
    .flat_map(|r| r.unwrap())
    .collect();
    let wall = began.elapsed();
    all.sort();
    let pct = |p: f64| all[((all.len() as f64 * p).ceil() as usize).saturating_sub(1)];
    println!(
        "store append on loopback: {appenders} appenders x {appends} appends, pool {}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {:.0} appends/s",
        cfg.pool_size,
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        all.last().unwrap().as_secs_f64() * 1e3,
        all.len() as f64 / wall.as_secs_f64(),
    );
    assert_eq!(all.len(), appenders * appends);
    assert_eq!(
        transactions(&metrics, "append"),
        (appenders * appends) as u64
    );
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 0);
    drop(store);
    db.drop().await;
}

// ---------------------------------------------------------------------------------------------
// The fleet's shared pace of model calls

/// Replicas reserving starts of one model in the store get distinct starts, each the spacing
/// after the one reserved before, whoever reserved it, as one queue; a start later than the
/// wait left is not reserved (and says how far off it is); another model has its own queue.
/// On the store's clock: only waits travel, so the replicas' clocks never meet.
#[tokio::test]
async fn replicas_reserving_model_starts_are_spaced_as_one_queue() {
    use abada_agent_worker::provider::capacity::SharedTurn;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (a, _) = connect(&config(&db.url)).await;
    let (b, _) = connect(&config(&db.url)).await;
    let spacing = Duration::from_millis(500);
    let within = Duration::from_secs(60);
    // Eight replicas' worth of reservations at once, from two stores (two pools).
    let mut joins = Vec::new();
    for i in 0..8 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        joins.push(tokio::spawn(async move {
            store.reserve_start("openai/m", spacing, within).await
        }));
    }
    let mut waits = Vec::new();
    for j in joins {
        match j.await.unwrap().unwrap() {
            SharedTurn::In(wait) => waits.push(wait),
            other => panic!("{other:?}"),
        }
    }
    waits.sort();
    // Taken within moments of each other, they are a spacing apart: never two starts closer.
    for w in waits.windows(2) {
        let gap = w[1].saturating_sub(w[0]);
        assert!(
            gap >= Duration::from_millis(400) && gap <= Duration::from_millis(600),
            "{waits:?}"
        );
    }
    assert!(waits[7] >= Duration::from_millis(3000), "{waits:?}");
    // Beyond the wait left: nothing reserved, and the next start is named.
    let next = a
        .reserve_start("openai/m", spacing, Duration::from_millis(100))
        .await
        .unwrap();
    let SharedTurn::Beyond(far) = next else {
        panic!("{next:?}");
    };
    assert!(far >= Duration::from_millis(3000), "{far:?}");
    let SharedTurn::In(after) = a.reserve_start("openai/m", spacing, within).await.unwrap() else {
        panic!("reserved within the wait");
    };
    // The start named (less the moments since), not one a spacing later: the refused
    // reservation took no start.
    assert!(
        after <= far && after + Duration::from_millis(400) > far,
        "{far:?} then {after:?}"
    );
    // Another model is another queue: its first start is now.
    assert_eq!(
        b.reserve_start("anthropic/other", spacing, within)
            .await
            .unwrap(),
        SharedTurn::In(Duration::ZERO)
    );
    // A hostile model name (long, any characters) is a key like any other, bounded.
    let odd = format!(
        "x/{}'; DROP TABLE abada_agent_runs; --{}",
        "é".repeat(400),
        "z".repeat(600)
    );
    assert!(matches!(
        a.reserve_start(&odd, spacing, within).await.unwrap(),
        SharedTurn::In(_)
    ));
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM abada_agent_model_pace")
            .await,
        3
    );
    drop((a, b));
    db.drop().await;
}
