//! The run store as a worker holds it: connected in the background (so a store that is down at
//! start-up is an outage like any other, not a crash), then shared with every task, swept, its
//! queued finishes flushed when idle and at shutdown, and reported to `/readyz`.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::StoreConfig;
use super::{Claim, Claimant, Fence, PgRunStore, RunEnd, RunKey, RunStore, StoreError};
use crate::backoff::Backoff;
use crate::engine::{AppendOutcome, JournalStep};
use crate::metrics::Metrics;

/// Cheap to clone; every clone sees the same store once it is connected.
#[derive(Clone)]
pub struct StoreHandle {
    state: Arc<RwLock<State>>,
}

enum State {
    /// Not connected yet; the latest failure, if any.
    Connecting(Option<StoreError>),
    Ready(PgRunStore),
}

impl std::fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.read().expect("store handle lock poisoned");
        match &*state {
            State::Connecting(_) => f.write_str("StoreHandle(connecting)"),
            State::Ready(store) => f.debug_tuple("StoreHandle").field(store).finish(),
        }
    }
}

impl StoreHandle {
    /// Connects (and migrates) in the background, retrying with `backoff` until it succeeds
    /// or `stop` fires, then runs the sweeper and the idle flush of queued finishes (after
    /// `idle_flush`, [`PgRunStore::spawn_finisher`]) until `stop`. The backoff's and the
    /// sweeper's jitter come from `random` (the worker's). Must be called on a tokio runtime.
    pub(crate) fn connect_in_background(
        config: StoreConfig,
        metrics: Arc<Metrics>,
        backoff: Backoff,
        idle_flush: Duration,
        stop: CancellationToken,
        random: crate::random::Random,
    ) -> StoreHandle {
        let handle = StoreHandle {
            state: Arc::new(RwLock::new(State::Connecting(None))),
        };
        let state = handle.state.clone();
        tokio::spawn(async move {
            let mut failures = 0u32;
            let store = loop {
                // Biased, the stop first: nothing is connected for a worker that has stopped.
                let connected = tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    r = PgRunStore::connect(&config, metrics.clone()) => r,
                };
                match connected {
                    Ok(store) => break store,
                    Err(e) => {
                        let wait = backoff.delay(failures, &random);
                        failures = failures.saturating_add(1);
                        tracing::warn!(
                            error = %e,
                            retry_in_ms = wait.as_millis() as u64,
                            "cannot connect to the run store; tasks without a journal on the engine wait for it"
                        );
                        *state.write().expect("store handle lock poisoned") =
                            State::Connecting(Some(e));
                        tokio::select! {
                            biased;
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                }
            };
            let sweeper = store.spawn_sweeper(stop.clone(), random);
            let finisher = store.spawn_finisher(idle_flush, stop.clone());
            *state.write().expect("store handle lock poisoned") = State::Ready(store);
            let _ = tokio::join!(sweeper, finisher);
        });
        handle
    }

    /// A handle on a store already connected (tests, benchmarks).
    pub fn ready(store: PgRunStore) -> StoreHandle {
        StoreHandle {
            state: Arc::new(RwLock::new(State::Ready(store))),
        }
    }

    /// The store, or a transient error while it is not connected yet (the caller waits within
    /// its lease, as for any outage).
    pub fn get(&self) -> Result<PgRunStore, StoreError> {
        match &*self.state.read().expect("store handle lock poisoned") {
            State::Ready(store) => Ok(store.clone()),
            State::Connecting(latest) => Err(StoreError::Unavailable {
                store: "(not connected yet)".into(),
                reason: match latest {
                    Some(e) => format!("the worker is still connecting: {e}"),
                    None => "the worker is still connecting".into(),
                },
            }),
        }
    }

    /// Performs the finishes still queued (the worker's drain calls it once its tasks ended,
    /// before the store stops). What cannot be written is logged: those runs stay until the
    /// sweeper deletes them as abandoned.
    pub async fn flush(&self) {
        let Ok(store) = self.get() else {
            return; // never connected: no task finished through it
        };
        match store.flush().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(finishes = n, "queued run finishes written at shutdown"),
            Err(e) => tracing::warn!(
                error = %e,
                finishes = store.finishes_queued(),
                "the finishes of runs whose tasks ended could not be written at shutdown; those runs stay until ABADA_AGENT_STORE_ABANDONED_AFTER deletes them"
            ),
        }
    }

    /// Why the store cannot be used now (for `/readyz`), or `None` when it can.
    pub fn problem(&self) -> Option<String> {
        match &*self.state.read().expect("store handle lock poisoned") {
            // Short reasons only: the store's own error text (which may quote the server) is
            // in the log line, never in an answer anyone on the network can read.
            State::Ready(store) => store
                .outage()
                .map(|_| "run store: unavailable (see the worker's log)".into()),
            State::Connecting(None) => Some("run store: connecting".into()),
            State::Connecting(Some(_)) => {
                Some("run store: cannot connect yet (see the worker's log)".into())
            }
        }
    }
}

/// The connector's default backoff: quick first retries, then one try every 30 s.
pub(crate) fn connect_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(500), Duration::from_secs(30))
}

/// The store as the agent runtime holds it: each call goes to the connected store, or fails as
/// an outage (transient) while the worker is still connecting.
#[async_trait::async_trait]
impl RunStore for StoreHandle {
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        self.get()?.claim(run_key, claimant, first_step).await
    }

    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        self.get()?.append(fence, step).await
    }

    /// Queued to ride with the next claim ([`PgRunStore::finish_later`]): the finish costs no
    /// transaction of its own.
    async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        self.get()?.finish_later(fence, end).await
    }

    async fn locate(
        &self,
        lookup: &crate::store::RunLookup<'_>,
    ) -> Result<Vec<crate::store::OpenRun>, StoreError> {
        self.get()?.locate(lookup).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ErrorClass;

    /// A store still connecting answers every call of the runtime as an outage (transient:
    /// waited out within the lease), never as a refusal or a fence.
    #[tokio::test(start_paused = true)]
    async fn a_store_still_connecting_is_an_outage_to_the_runtime() {
        let handle = StoreHandle {
            state: Arc::new(RwLock::new(State::Connecting(None))),
        };
        let store: Arc<dyn RunStore> = Arc::new(handle);
        let key = RunKey::for_task("t-1").unwrap();
        let claimant = Claimant {
            worker_id: "w-1",
            task_id: "t-1",
            hold: Duration::from_secs(30),
        };
        let e = store.claim(&key, &claimant, None).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        let mut fence = Fence::issue(key, 1, 1, 1, 0);
        let step = crate::engine::JournalStep {
            seq: 1,
            kind: "input".into(),
            state: "finished".into(),
            key: None,
            data: serde_json::json!({"input": "x"}),
        };
        let e = store.append(&mut fence, &step).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        assert_eq!(
            fence.next_seq(),
            1,
            "a failed append does not advance the fence"
        );
        let e = store.finish(&fence, RunEnd::Completed).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
    }
}
