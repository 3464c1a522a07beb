//! The run store: durable agent runs in PostgreSQL, for engines that keep no journal
//! (protocol.md Part D; design.md "The run store"; the seed's short transactions, optimistic
//! claims and bounded pools).
//!
//! A run row per run holds the attempt number, the fencing token: every [`PgRunStore::claim`]
//! takes a new one from a database sequence that outlives the rows, in one short transaction, so
//! a run deleted and created again never hands out a token an earlier holder had. Who may claim
//! a run (another task of a process visit, or only its holder) is the admission rule's
//! (`admission`). Every [`PgRunStore::append`] is a compare-and-set on
//! the run row (attempt and version, exactly one row or none) plus the step insert, in one
//! statement; none means another attempt owns the run ([`StoreError::Fenced`]), and the caller
//! goes silent as after `STALE_ATTEMPT`. Before its claim a task reads the open runs that may be
//! its own ([`PgRunStore::locate`]: one statement, no lock). A one-turn task costs two
//! transactions besides: the claim
//! (which writes the input step) and the final step's append, written at once and fenced, so a
//! stale holder is stopped before it reports. Its finish, once the engine accepted the task's
//! end, is queued ([`PgRunStore::finish_later`], `finishes`) and rides with the next claim's
//! transaction, fenced by its attempt; an idle worker flushes it after a short delay, a worker
//! shutting down once its tasks are drained.
//!
//! No transaction or connection outlives a call: there is no public handle to either. The pool
//! is bounded (`ABADA_AGENT_STORE_POOL_SIZE`), and waiting for it is bounded too
//! (`ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS`), as is every transaction.
//!
//! [`RunStore`] is the seam: the operations the agent runtime asks of a run store (claim, fenced
//! append, finish). [`PgRunStore`] is the PostgreSQL implementation, and [`StoreHandle`] (the
//! store as a worker holds it, connecting in the background) implements it by delegating; a
//! stand-in (the simulator's in-memory store) implements it with the same rules: the admission
//! rule (`admission`), the step checks ([`check_step`]) and the fence ([`Fence::issue`]).
//!
//! Submodules: `handle` (the store as a worker holds it: connected in the background, swept,
//! reported to `/readyz`), `url` (the one reading of the URL, the TLS rules, the redacted form),
//! `tls` (rustls per `sslmode`),
//! `pool` (connections and the transaction wrapper), `migrate` (the schema), `runs` (the SQL of
//! claims, appends, finishes and sweeps), `finishes` (the finishes waiting for a transaction),
//! `admission` (which claim may take a run), `error` (classes), `outage` (one log line per
//! outage).

mod admission;
mod error;
mod finishes;
mod handle;
mod migrate;
mod outage;
mod pool;
mod runs;
mod settings;
mod tls;
mod url;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use admission::{Admission, Asking, ClaimRefusal, InputDigest, Phase, Seen, admit};
pub use error::{ErrorClass, FenceReason, StoreError};
pub(crate) use finishes::IDLE_FLUSH_AFTER;
pub use finishes::MAX_PENDING_FINISHES;
pub use handle::StoreHandle;
pub(crate) use handle::connect_backoff;
pub use runs::{
    Claim, Claimant, Fence, MAX_OPEN_RUNS, OpenRun, RunEnd, RunKey, RunLookup, check_step,
};
pub use settings::StoreConfig;
pub(crate) use url::StoreUrl;

use crate::engine::{AppendOutcome, JournalStep};
use crate::metrics::Metrics;
use finishes::PendingFinishes;
use pool::{Connector, Operation, Pool};
use runs::PendingFinish;
use runs::Sweep;

/// What the store's server told the worker at start-up (logged once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `server_version`, e.g. `15.18 (Debian 15.18-0+deb12u1)`.
    pub version: String,
    /// The TLS protocol of the start-up connection (`TLSv1.3`), `None` for plain TCP.
    pub tls: Option<String>,
}

/// What one sweep deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Finished runs past `ABADA_AGENT_STORE_RETENTION`.
    pub finished: u64,
    /// Unfinished runs idle past `ABADA_AGENT_STORE_ABANDONED_AFTER`.
    pub abandoned: u64,
    /// Transactions used (one per batch).
    pub batches: u32,
}

/// What the agent runtime asks of a run store: the seam between the runtime and PostgreSQL.
///
/// Every implementation keeps the same promises ([`PgRunStore`]'s docs say them in full):
/// - a claim hands out a fencing token ([`Fence::attempt`]) no claim of any run had before, and
///   admits or refuses the claimant by the admission rule;
/// - an append is a compare-and-set on the fence: a stale fence is [`StoreError::Fenced`],
///   nothing written; a retried append of the very step written is
///   [`AppendOutcome::AlreadyPresent`]; the fence advances on success only;
/// - a finish is idempotent for the fence's attempt, and fenced like an append: it never
///   touches a newer attempt's run. An implementation may defer it to its next transaction
///   (the worker's [`StoreHandle`] does, through [`PgRunStore::finish_later`]): `Ok` then means
///   queued, and a stale finish, when performed, changes nothing instead of answering
///   [`StoreError::Fenced`].
#[async_trait::async_trait]
pub trait RunStore: Send + Sync {
    /// Claims the run for a new attempt (see [`PgRunStore::claim`]).
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError>;

    /// Appends one step, fenced (see [`PgRunStore::append`]).
    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError>;

    /// Records that the run ended (see [`PgRunStore::finish`]).
    async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError>;

    /// The open runs a task may find as its own, newest first (see [`PgRunStore::locate`]):
    /// a read that changes nothing.
    async fn locate(&self, lookup: &RunLookup<'_>) -> Result<Vec<OpenRun>, StoreError>;
}

#[async_trait::async_trait]
impl RunStore for PgRunStore {
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        PgRunStore::claim(self, run_key, claimant, first_step).await
    }

    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        PgRunStore::append(self, fence, step).await
    }

    async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        PgRunStore::finish(self, fence, end).await
    }

    async fn locate(&self, lookup: &RunLookup<'_>) -> Result<Vec<OpenRun>, StoreError> {
        PgRunStore::locate(self, lookup).await
    }
}

/// The PostgreSQL run store: cheap to clone (one pool behind an `Arc`).
#[derive(Clone)]
pub struct PgRunStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    metrics: Arc<Metrics>,
    retention: Duration,
    abandoned_after: Option<Duration>,
    sweep_batch: usize,
    server: ServerInfo,
    migrations_applied: Vec<&'static str>,
    /// Finishes waiting to ride with the next transaction (`finishes`).
    finishes: Arc<PendingFinishes>,
}

impl std::fmt::Debug for PgRunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgRunStore")
            .field("store", &self.inner.pool.store())
            .field("server", &self.inner.server)
            .finish_non_exhaustive()
    }
}

impl PgRunStore {
    /// Connects, applies the migrations this worker carries under the advisory lock, and checks
    /// that the store's statements prepare. An unreachable store is [`ErrorClass::Transient`] (try again
    /// later); a refusal (password, database, TLS) is [`ErrorClass::Misconfigured`].
    pub async fn connect(
        config: &StoreConfig,
        metrics: Arc<Metrics>,
    ) -> Result<PgRunStore, StoreError> {
        let connector = Connector::new(config)?;
        let pool = Pool::new(connector, config, metrics.clone());
        // The migrations run on a connection of their own: they wait for other replicas' lock
        // and may take longer than a transaction of the store.
        let mut client = pool.open_unpooled().await?;
        let store = pool.store();
        let migrating = migrate::apply(&mut client, &store);
        let migrations_applied = tokio::time::timeout(
            migrate::MIGRATION_TIMEOUT + Duration::from_secs(5),
            migrating,
        )
        .await
        .map_err(|_| StoreError::Unavailable {
            store: store.to_string(),
            reason: format!(
                "the migrations did not finish within {} s",
                migrate::MIGRATION_TIMEOUT.as_secs()
            ),
        })??;
        let row = client
            .query_one(
                "SELECT current_setting('server_version'),
                        (SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl)",
                &[],
            )
            .await
            .map_err(|e| error::classify(&store, &e))?;
        let server = ServerInfo {
            version: row.get(0),
            tls: row.get(1),
        };
        // Proves that the store's statements prepare against the migrated schema; the pool
        // opens its own connections when they are first needed.
        runs::Statements::prepare(&client)
            .await
            .map_err(|e| error::classify(&store, &e))?;
        drop(client);
        if let Some(exposure) = pool.url().ok().and_then(|url| url.exposure()) {
            tracing::warn!(
                store = %store,
                exposure,
                "ABADA_AGENT_STORE_ALLOW_INSECURE=true: the run store is reached without verified TLS"
            );
        }
        tracing::info!(
            store = %store,
            server_version = %server.version,
            tls = server.tls.as_deref().unwrap_or("off"),
            pool_size = config.pool_size,
            migrations_applied = migrations_applied.len(),
            "run store ready"
        );
        Ok(PgRunStore {
            inner: Arc::new(Inner {
                pool,
                metrics,
                retention: config.retention,
                abandoned_after: config.abandoned_after,
                sweep_batch: config.sweep_batch.max(1),
                server,
                migrations_applied,
                finishes: Arc::new(PendingFinishes::new(finishes::MAX_PENDING_FINISHES)),
            }),
        })
    }

    /// The store's URL as it may be printed: hosts, ports, database and `sslmode` only.
    pub fn redacted_url(&self) -> Arc<str> {
        self.inner.pool.store()
    }

    pub fn server(&self) -> &ServerInfo {
        &self.inner.server
    }

    /// Why the store is unavailable now (the latest failure of an open outage), if it is.
    pub fn outage(&self) -> Option<String> {
        self.inner.pool.outage()
    }

    /// The migrations this instance applied at start-up (none when another replica had).
    pub fn migrations_applied(&self) -> &[&'static str] {
        &self.inner.migrations_applied
    }

    /// Claims the run for a new attempt, in one transaction: the admission rule (`admission`)
    /// decides whether the claimant begins the run (created, or started over with no step),
    /// resumes it (its journal so far) or is refused ([`StoreError::Refused`], nothing
    /// changed). A claim that goes ahead takes a new attempt from the sequence, records the
    /// claimant's worker and task, and returns the journal so far. When the run has no step yet
    /// and `first_step` is given (the input step, `seq` 1), that step is written in the same
    /// transaction; it is also what a resumed run's journaled input must equal.
    ///
    /// The finishes queued by [`PgRunStore::finish_later`] ride with the claim: performed first
    /// in its transaction, committed with it (a refusal included), and queued again when the
    /// transaction fails or the claim is cancelled.
    pub async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        let first = match first_step {
            None => None,
            Some(step) if step.seq != 1 => {
                return Err(self.refused(
                    Operation::Claim,
                    StoreError::Invalid(format!(
                        "run {run_key}: the first step must have seq 1, not {}",
                        step.seq
                    )),
                ));
            }
            Some(step) => match runs::check_step(run_key, 0, step) {
                Ok(body) => Some((step, body)),
                Err(e) => return Err(self.refused(Operation::Claim, e)),
            },
        };
        let store = self.inner.pool.store();
        let batch = self.inner.finishes.take(None);
        let finishes = (batch.items(), self.inner.retention.is_zero());
        let result = self
            .inner
            .pool
            .transaction(Operation::Claim, |mut conn| async move {
                let result =
                    runs::claim(conn.conn(), &store, run_key, claimant, first, finishes).await;
                (conn, result)
            })
            .await;
        if matches!(&result, Ok(_) | Err(StoreError::Refused { .. })) {
            batch.done();
        }
        result
    }

    /// Appends one step, fenced: one statement that compare-and-sets the run row on this
    /// fence's attempt and version and inserts the step. On success the fence advances.
    ///
    /// - [`AppendOutcome::AlreadyPresent`]: the step was written by this very append before, and
    ///   the acknowledgement was lost (a retry after a transient error); the fence advances.
    /// - [`StoreError::Fenced`]: another attempt owns the run (or this fence is a stale copy):
    ///   stop and report nothing.
    /// - [`StoreError::Conflict`]: that `seq` holds a different step, or leaves a gap.
    /// - [`ErrorClass::Transient`]: unknown whether it was written; retry with the same fence
    ///   and step within the lease. The same holds when the call was cancelled midway: the
    ///   fence has not moved, and the retry finds the step if it was written.
    pub async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        let body = match runs::check_step(fence.run_key(), fence.journal_bytes(), step) {
            Ok(body) => body,
            Err(e) => return Err(self.refused(Operation::Append, e)),
        };
        let store = self.inner.pool.store();
        self.inner
            .pool
            .transaction(Operation::Append, |mut conn| async move {
                let result = runs::append(conn.conn(), &store, fence, step, &body).await;
                (conn, result)
            })
            .await
    }

    /// Records that the run ended, after the engine accepted the outcome. With a retention of
    /// zero the run and its steps are deleted in this transaction; otherwise it is marked and
    /// the sweeper deletes it later. Idempotent for the fence's attempt; [`StoreError::Fenced`]
    /// when a newer attempt owns the run.
    pub async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        let store = self.inner.pool.store();
        let delete = self.inner.retention.is_zero();
        self.inner
            .pool
            .transaction(Operation::Finish, |mut conn| async move {
                let result = runs::finish(conn.conn(), &store, fence, end, delete).await;
                (conn, result)
            })
            .await
    }

    /// The open (running) runs `lookup` finds, newest first, at most [`MAX_OPEN_RUNS`]: those of
    /// its exact keys, and those its task holds under its node's visit prefix, each with its
    /// phase and the definition journaled with its input. One statement, no lock: a claim
    /// decides afterwards, under its own lock, whether the task may take the run it picked.
    pub async fn locate(&self, lookup: &RunLookup<'_>) -> Result<Vec<OpenRun>, StoreError> {
        let store = self.inner.pool.store();
        self.inner
            .pool
            .transaction(Operation::Locate, |mut conn| async move {
                let result = runs::locate(conn.conn(), &store, lookup).await;
                (conn, result)
            })
            .await
    }

    /// Queues the run's finish, after the engine accepted the outcome, to ride with the store's
    /// next transaction (a claim, or a flush: [`PgRunStore::flush`], [`PgRunStore::spawn_finisher`])
    /// instead of taking one of its own. Performed, it is [`PgRunStore::finish`] without the
    /// answer: fenced by the attempt (a newer attempt's run is left alone), idempotent. With
    /// the queue full, the caller flushes it here, its own finish included; a failed flush keeps
    /// them queued.
    pub async fn finish_later(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        let finish = PendingFinish::of(fence, end);
        match self.inner.finishes.push(finish) {
            Ok(()) => Ok(()),
            Err(finishes::Full(finish)) => self.flush_with(Some(finish)).await.map(|_| ()),
        }
    }

    /// Performs every queued finish now, in one transaction (none when nothing is queued), and
    /// returns how many were carried. On failure they stay queued. The worker calls it once its
    /// tasks are drained, before it stops.
    pub async fn flush(&self) -> Result<usize, StoreError> {
        self.flush_with(None).await
    }

    /// Finishes queued and not yet performed.
    pub fn finishes_queued(&self) -> usize {
        self.inner.finishes.len()
    }

    async fn flush_with(&self, extra: Option<PendingFinish>) -> Result<usize, StoreError> {
        let batch = self.inner.finishes.take(extra);
        if batch.items().is_empty() {
            return Ok(0);
        }
        let store = self.inner.pool.store();
        let delete = self.inner.retention.is_zero();
        let items = batch.items();
        self.inner
            .pool
            .transaction(Operation::Finish, |mut conn| async move {
                let pg = conn.conn();
                let result = runs::finish_queued(&pg.client, &pg.statements, items, delete)
                    .await
                    .map_err(|e| error::classify(&store, &e));
                (conn, result)
            })
            .await?;
        Ok(batch.done())
    }

    /// Flushes the queued finishes whenever the oldest has waited `after` without a claim to
    /// carry it (an idle worker), until `stop`. A failed flush is tried again `after` later.
    pub fn spawn_finisher(
        &self,
        after: Duration,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        let queue = self.inner.finishes.clone();
        tokio::spawn(finishes::idle_flusher(queue, after, stop, move || {
            let store = store.clone();
            async move {
                if let Err(e) = store.flush().await {
                    tracing::debug!(error = %e, "flushing the queued run finishes failed; retrying later");
                }
            }
        }))
    }

    /// One pass of the sweeper: deletes finished runs past the retention and unfinished runs
    /// idle past the abandonment limit, each in batches of at most `sweep_batch` runs, one short
    /// transaction per batch (no connection held between batches).
    pub async fn sweep(&self) -> Result<SweepReport, StoreError> {
        let mut report = SweepReport::default();
        let mut sweeps = vec![Sweep::Finished(self.inner.retention)];
        sweeps.extend(self.inner.abandoned_after.map(Sweep::Abandoned));
        let batch = self.inner.sweep_batch;
        for sweep in sweeps {
            loop {
                let store = self.inner.pool.store();
                let deleted = self
                    .inner
                    .pool
                    .transaction(Operation::Sweep, |mut conn| async move {
                        let result = runs::sweep_batch(conn.conn(), &store, sweep, batch).await;
                        (conn, result)
                    })
                    .await?;
                report.batches += 1;
                self.inner
                    .metrics
                    .count_store_runs_deleted(sweep.reason(), deleted);
                match sweep {
                    Sweep::Finished(_) => report.finished += deleted,
                    Sweep::Abandoned(_) => report.abandoned += deleted,
                }
                if deleted < batch as u64 {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        Ok(report)
    }

    /// Runs [`PgRunStore::sweep`] every [`PgRunStore::sweep_interval`] (stretched by up to 10 %,
    /// so replicas spread out, drawn from `random`) until `stop` is cancelled. A failed pass is
    /// retried at the next tick; the outage log has said what failed.
    pub fn spawn_sweeper(
        &self,
        stop: CancellationToken,
        random: crate::random::Random,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                let wait = crate::backoff::stretched(store.sweep_interval(), 0.1, &random);
                // Biased, the stop first (here and in every background loop of the store): no
                // pass begins once the worker stops.
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
                match store.sweep().await {
                    // Orphans: runs nobody resumed (a task that never came back, a change that
                    // left them behind); a run waiting for a decision goes with them.
                    Ok(r) if r.abandoned > 0 => tracing::warn!(
                        finished = r.finished,
                        abandoned = r.abandoned,
                        batches = r.batches,
                        "the run-store sweeper deleted orphaned runs: unfinished and idle past ABADA_AGENT_STORE_ABANDONED_AFTER, nobody resumed them (abada_agent_store_runs_orphaned_total{{reason=\"abandoned\"}})"
                    ),
                    Ok(r) if r.finished > 0 => tracing::info!(
                        finished = r.finished,
                        abandoned = r.abandoned,
                        batches = r.batches,
                        "the run-store sweeper deleted runs"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::debug!(error = %e, "a run-store sweep failed"),
                }
            }
        })
    }

    /// Half the retention, between 1 s and 60 s; 60 s with a retention of zero (finishing deletes
    /// then, and the sweeper is left with abandoned runs).
    pub fn sweep_interval(&self) -> Duration {
        let retention = self.inner.retention;
        if retention.is_zero() {
            return Duration::from_secs(60);
        }
        (retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// Counts an error found before any connection was used.
    fn refused(&self, operation: Operation, error: StoreError) -> StoreError {
        self.inner
            .metrics
            .count_store_error(operation.label(), error.class().label());
        error
    }
}
