//! How the emulated engine's fetches contend with each other: which rows a fetch's
//! transaction locks, and for how long, so that a fetch running meanwhile skips them and may
//! answer fewer tasks than the queue holds, or none.
//!
//! The real engine 0.11 (its source, `engine/src/main/java/com/abada/engine/`):
//! - `core/ExternalTaskCommandService.fetchAndLock` is one transaction
//!   (`@AtomicRuntimeCommand`, i.e. `@Transactional`; `core/IdempotencyService.execute`, which
//!   wraps it for a request with an `Idempotency-Key`, is the same transaction, so it ends only
//!   after the answer is stored). It loops until `maxTasks` are locked or a round over the
//!   topics finds none: per topic one select, one row updated to `LOCKED` for the worker.
//! - The select is `persistence/repository/ExternalTaskRepository.findAvailableForUpdate`:
//!   `select * from external_tasks where topic_name = :topic and (status = 'OPEN' or (status =
//!   'LOCKED' and lock_expiration_time <= :now)) order by id limit 1 for update skip locked`.
//!   What it locks depends on the database:
//!   - **H2**, the `dev` profile (`application-dev.yaml`, `jdbc:h2:file:`), which every run of
//!     the real engine in this repository used: H2 2.3.232's `Select` drops an index order for
//!     `FOR UPDATE` unless the index is the row-id index (`external_tasks.id` is a `VARCHAR`
//!     key), so it reads every row that matches, locking each (`isConditionMetForUpdate`),
//!     and sorts and limits afterwards. One select locks **every candidate row of the topic**
//!     until the transaction commits, not only the row it returns.
//!   - **PostgreSQL**, the `prod` profile: `LockRows` under `Limit` locks rows one at a time as
//!     the limit pulls them, so a select locks **only the row it returns**.
//!
//!   A concurrent fetch's select skips every row another open transaction has locked
//!   (`SKIP LOCKED`). On H2 that is every task of the topic that was there when the other fetch
//!   began, so a fetch that starts during another's transaction answers **empty** on a deep
//!   backlog. Checked outside the repository with the engine's table and index (V1 and V8
//!   migrations) and the engine's own query on two connections: on H2 2.3.232 the second
//!   transaction got no row while the first, holding 2 of 20 `OPEN` rows as `LOCKED`, was open,
//!   and a row once it committed; on PostgreSQL 15 the second got a row at once.
//!
//! The emulator runs each command at one instant under its state lock, so by default fetches
//! never overlap (what PostgreSQL's one-row locks come to, save for the answer's timing). With
//! a [`FetchContention`] set, each fetch's transaction lasts [`FetchContention::transaction`]:
//! the rows it locked (per [`FetchLocks`]) stay locked that long in the emulator's clock, fetches
//! meanwhile skip them, and the HTTP layer answers the fetch when its transaction ends (the
//! real engine answers after its commit). Simplifications, each erring towards less contention
//! than the real engine: a fetch locks the candidates present when it starts (the real one also
//! locks rows that become candidates during its transaction, with its later selects); the
//! transaction's length is fixed (the real one grows with the backlog and with `maxTasks`, one
//! full scan per task on H2); commands other than fetches do not wait for a fetch's row locks
//! (the real `complete` or `heartbeat` of a row a fetch holds waits for its commit, then gets
//! the same answer the emulator gives at once).

use std::collections::HashMap;
use std::time::Duration;

/// What one fetch's transaction locks, by the engine's database (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FetchLocks {
    /// H2 (the engine's `dev` profile): every row its selects matched, whichever it returned.
    /// Fetches meanwhile answer empty while a backlog waits.
    #[default]
    EveryCandidate,
    /// PostgreSQL (the `prod` profile): only the rows it returned (and locked for its worker).
    /// Fetches meanwhile get the next rows, never an empty answer on a backlog.
    ReturnedRows,
}

/// Fetch transactions that last, and what they lock meanwhile (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchContention {
    pub locks: FetchLocks,
    /// From the fetch's first select to its commit and answer. Zero: no contention.
    pub transaction: Duration,
}

impl FetchContention {
    /// The real engine on H2 whose fetch transactions last `transaction`.
    pub fn h2(transaction: Duration) -> Self {
        FetchContention {
            locks: FetchLocks::EveryCandidate,
            transaction,
        }
    }

    /// The transaction's length in the emulator's milliseconds.
    pub(crate) fn transaction_ms(&self) -> i64 {
        i64::try_from(self.transaction.as_millis()).unwrap_or(i64::MAX / 4)
    }
}

/// The row locks of the fetch transactions still open: per task number, when the transaction
/// holding its row ends. A row is held by one open transaction at most (another skips it), so
/// one instant per row is enough.
#[derive(Debug, Default)]
pub(crate) struct RowLocks {
    held_until: HashMap<u64, i64>,
}

impl RowLocks {
    /// Forgets the locks of transactions that ended by `now`.
    pub(crate) fn release_ended(&mut self, now: i64) {
        self.held_until.retain(|_, until| *until > now);
    }

    /// Whether another fetch's open transaction holds task `number`'s row (call
    /// [`RowLocks::release_ended`] first).
    pub(crate) fn is_held(&self, number: u64) -> bool {
        self.held_until.contains_key(&number)
    }

    /// Locks `rows` until `until`: a fetch's transaction that ends then.
    pub(crate) fn hold(&mut self, rows: impl IntoIterator<Item = u64>, until: i64) {
        for row in rows {
            self.held_until.insert(row, until);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ProtocolLevel;
    use crate::engine::state::{AGENT_TOPIC, EngineState, Operation, TaskSpec};
    use crate::engine::wire::{Command, FetchAndLockRequest};

    const MS: Duration = Duration::from_millis(1);

    fn engine(tasks: usize, contention: Option<FetchContention>) -> EngineState {
        let mut state = EngineState::new(ProtocolLevel::PlainV1, 60_000, 0);
        for _ in 0..tasks {
            state.create_task(TaskSpec::default());
        }
        state.set_fetch_contention(contention);
        state
    }

    /// One fetch at `now` of `topics`, leases of `lock_ms`; the ids it got.
    fn fetch_of(
        state: &mut EngineState,
        worker: &str,
        topics: &[&str],
        max_tasks: i64,
        lock_ms: i64,
        now: i64,
    ) -> Vec<String> {
        let fetch = Command::FetchAndLock(FetchAndLockRequest {
            worker_id: Some(worker.into()),
            topics: Some(topics.iter().map(|t| t.to_string()).collect()),
            lock_duration: Some(lock_ms),
            max_tasks: Some(max_tasks),
        });
        let (reply, _) = state
            .run(Operation::FetchAndLock, None, None, &fetch, now, "system")
            .expect("a valid fetch");
        let body = reply.body.expect("a fetch answers a list");
        body.as_array()
            .expect("a list")
            .iter()
            .map(|t| t["id"].as_str().expect("an id").to_string())
            .collect()
    }

    fn fetch(state: &mut EngineState, worker: &str, max_tasks: i64, now: i64) -> Vec<String> {
        fetch_of(state, worker, &[AGENT_TOPIC], max_tasks, 60_000, now)
    }

    fn ids(range: std::ops::RangeInclusive<u64>) -> Vec<String> {
        range.map(|n| format!("t-{n:06}")).collect()
    }

    /// H2: a fetch's transaction locks every candidate row, so a fetch that starts before it
    /// commits answers empty although 18 tasks wait; once it has committed, the next gets
    /// its tasks. (The engine's query run on H2 2.3.232 did the same, see the module docs.)
    #[test]
    fn on_h2_a_fetch_during_another_fetchs_transaction_answers_empty_on_a_backlog() {
        let mut state = engine(20, Some(FetchContention::h2(15 * MS)));
        assert_eq!(fetch(&mut state, "w1", 2, 1000), ids(1..=2));
        for at in [1000, 1001, 1014] {
            assert!(fetch(&mut state, "w2", 8, at).is_empty(), "at {at}");
        }
        // Committed at 1015: the rows are free, and this fetch locks the rest in turn.
        assert_eq!(fetch(&mut state, "w2", 8, 1015), ids(3..=10));
        assert!(fetch(&mut state, "w3", 8, 1029).is_empty());
        assert_eq!(fetch(&mut state, "w3", 8, 1030), ids(11..=18));
        // Without contention, the same fetches at the same instants each get their own tasks.
        let mut state = engine(20, None);
        assert_eq!(fetch(&mut state, "w1", 2, 1000), ids(1..=2));
        assert_eq!(fetch(&mut state, "w2", 8, 1001), ids(3..=10));
        // A zero transaction is no contention.
        let mut state = engine(20, Some(FetchContention::h2(Duration::ZERO)));
        assert_eq!(state.fetch_contention(), None);
        assert_eq!(fetch(&mut state, "w1", 2, 1000), ids(1..=2));
        assert_eq!(fetch(&mut state, "w2", 8, 1000), ids(3..=10));
    }

    /// PostgreSQL: a select locks only the row it returns, so a fetch during another's
    /// transaction gets the next rows.
    #[test]
    fn on_postgresql_a_concurrent_fetch_gets_the_next_rows() {
        let mut state = engine(
            20,
            Some(FetchContention {
                locks: FetchLocks::ReturnedRows,
                transaction: 15 * MS,
            }),
        );
        assert_eq!(fetch(&mut state, "w1", 2, 1000), ids(1..=2));
        assert_eq!(fetch(&mut state, "w2", 8, 1001), ids(3..=10));
        assert_eq!(fetch(&mut state, "w3", 50, 1002), ids(11..=20));
    }

    /// A row the open transaction holds stays held even when its lease has already expired
    /// (a lock duration shorter than the transaction): no other fetch takes it before the
    /// commit, on either database.
    #[test]
    fn a_row_a_transaction_returned_stays_locked_until_it_commits_whatever_its_lease() {
        for locks in [FetchLocks::EveryCandidate, FetchLocks::ReturnedRows] {
            let mut state = engine(
                1,
                Some(FetchContention {
                    locks,
                    transaction: 15 * MS,
                }),
            );
            assert_eq!(
                fetch_of(&mut state, "w1", &[AGENT_TOPIC], 1, 1, 1000),
                ids(1..=1)
            );
            // The lease expired at 1001; the transaction commits at 1015.
            assert!(fetch(&mut state, "w2", 1, 1005).is_empty(), "{locks:?}");
            assert_eq!(fetch(&mut state, "w2", 1, 1015), ids(1..=1), "{locks:?}");
        }
    }

    /// A fetch locks the candidates of the topics its selects scanned: with two topics and
    /// `maxTasks` 1, the loop stops after the first topic's select, and the second topic's
    /// rows stay free. Rows created after the transaction began are free too (a documented
    /// simplification: the real engine's later selects would lock them).
    #[test]
    fn only_the_topics_a_fetch_scanned_are_locked() {
        let mut state = engine(0, Some(FetchContention::h2(15 * MS)));
        for topic in ["a", "a", "b"] {
            state.create_task(TaskSpec {
                topic: Some(topic.into()),
                ..Default::default()
            });
        }
        assert_eq!(
            fetch_of(&mut state, "w1", &["a", "b"], 1, 60_000, 1000),
            ids(1..=1)
        );
        assert!(fetch_of(&mut state, "w2", &["a"], 8, 60_000, 1001).is_empty());
        assert_eq!(
            fetch_of(&mut state, "w2", &["a", "b"], 8, 60_000, 1002),
            ids(3..=3)
        );
        state.create_task(TaskSpec {
            topic: Some("a".into()),
            ..Default::default()
        });
        assert_eq!(
            fetch_of(&mut state, "w3", &["a"], 8, 60_000, 1003),
            ids(4..=4)
        );
        assert_eq!(
            fetch_of(&mut state, "w3", &["a"], 8, 60_000, 1015),
            ids(2..=2)
        );
    }
}
