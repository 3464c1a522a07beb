//! The world's run store as one worker sees it: [`RunStore`] on the world's
//! [`MemoryRunStore`](super::store::MemoryRunStore), each call run under the world's faults as
//! the PostgreSQL store would meet them on the wire: held while its worker is frozen, never
//! returning once it is killed, refused during a store outage (transient, not executed),
//! slowed, or executed (committed) with its answer lost (transient: the caller retries, and an
//! append finds its own step). Every call and answer is recorded in the world's trace.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::World;
use super::trace::Event;
use abada_agent_worker::engine::{AppendOutcome, JournalStep};
use abada_agent_worker::store::{Claim, Claimant, Fence, RunEnd, RunKey, RunStore, StoreError};

/// How the world names its store in errors.
const STORE: &str = "memory://world";

/// One worker's view of the world's run store.
#[derive(Clone)]
pub(crate) struct WorldStore {
    world: Arc<World>,
    worker_id: String,
    /// The engine task of each attempt this worker's claims took (attempts never repeat), so
    /// a fence's calls name the task they are about: a visit's run is keyed by its process
    /// visit, not by the task holding it.
    tasks: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, String>>>,
}

impl WorldStore {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldStore {
            world,
            worker_id: worker_id.into(),
            tasks: Default::default(),
        }
    }

    /// The engine task whose claim took `attempt`.
    fn task_of(&self, attempt: u64) -> String {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&attempt)
            .cloned()
            .unwrap_or_default()
    }

    /// A call sent: recorded (a killed worker sends nothing).
    async fn send(
        &self,
        op: &'static str,
        run: &RunKey,
        task: &str,
        attempt: Option<u64>,
        seq: Option<u64>,
    ) {
        if self.world.faults().killed.contains(&self.worker_id) {
            std::future::pending::<()>().await;
        }
        self.world.record(Event::StoreCall {
            worker: self.worker_id.clone(),
            op,
            run: run.to_string(),
            task: task.to_string(),
            attempt,
            seq,
        });
    }

    /// A sent call's way to the store: held while frozen, refused in an outage, slowed. `Err`
    /// when the outage refused it (not executed).
    async fn deliver(
        &self,
        op: &'static str,
        run: &RunKey,
        task: &str,
        attempt: Option<u64>,
        seq: Option<u64>,
    ) -> Result<(), StoreError> {
        self.world.hold(&self.worker_id).await;
        let now = self.world.elapsed_ms();
        if self.world.faults().store_down(now) {
            // A refused connection takes a moment: no loop spins at one instant.
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.world.faults().count("store outage");
            self.answered(op, run, task, attempt, seq, "outage");
            return Err(unavailable("connection refused (simulated outage)"));
        }
        let (slow, slow_max) = {
            let f = self.world.faults();
            if f.active(now) {
                (f.plan.store_slow, f.plan.store_slow_max)
            } else {
                (0.0, Duration::ZERO)
            }
        };
        if slow > 0.0 && self.world.draw() < slow {
            let delay = slow_max.mul_f64(self.world.draw());
            self.world.faults().count("store slow");
            tokio::time::sleep(delay).await;
            self.world.hold(&self.worker_id).await;
        }
        Ok(())
    }

    /// The answer's way back: recorded as executed, maybe lost (the caller adds its 1 ms on
    /// the wire).
    #[allow(clippy::too_many_arguments)]
    async fn answer<T>(
        &self,
        op: &'static str,
        run: &RunKey,
        task: &str,
        attempt: Option<u64>,
        seq: Option<u64>,
        result: Result<T, StoreError>,
        label: impl Fn(&T) -> &'static str,
    ) -> Result<T, StoreError> {
        let answer = match &result {
            Ok(value) => label(value),
            Err(e) => e.class().label(),
        };
        // A claim that went ahead was recorded with the attempt it handed out (`claim`).
        if op != "claim" || result.is_err() {
            self.answered(op, run, task, attempt, seq, answer);
        }
        let odds = {
            let f = self.world.faults();
            if f.active(self.world.elapsed_ms()) {
                f.plan.store_answer_lost
            } else {
                0.0
            }
        };
        if odds > 0.0 && self.world.draw() < odds {
            self.world.faults().count("store answer lost");
            self.answered(op, run, task, attempt, seq, "answer-lost");
            Err(unavailable(
                "the connection closed after the commit (simulated)",
            ))
        } else {
            result
        }
    }

    fn answered(
        &self,
        op: &'static str,
        run: &RunKey,
        task: &str,
        attempt: Option<u64>,
        seq: Option<u64>,
        answer: &'static str,
    ) {
        self.world.record(Event::StoreAnswer {
            worker: self.worker_id.clone(),
            op,
            run: run.to_string(),
            task: task.to_string(),
            attempt,
            seq,
            answer,
        });
    }
}

fn unavailable(reason: &str) -> StoreError {
    StoreError::Unavailable {
        store: STORE.into(),
        reason: reason.into(),
    }
}

/// Runs a call already sent to its end whatever becomes of its caller (a worker that gives
/// the call up does not take back a statement on the wire), then its answer's 1 ms back.
async fn on_the_wire<T: Send + 'static>(
    call: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    let result = match tokio::spawn(call).await {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    result
}

#[async_trait]
impl RunStore for WorldStore {
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        let task = claimant.task_id.to_string();
        self.send("claim", run_key, &task, None, None).await;
        let (this, run_key, first_step) = (self.clone(), run_key.clone(), first_step.cloned());
        let (worker, hold) = (claimant.worker_id.to_string(), claimant.hold);
        on_the_wire(async move {
            this.deliver("claim", &run_key, &task, None, None).await?;
            let claimant = Claimant {
                worker_id: &worker,
                task_id: &task,
                hold,
            };
            let result = this
                .world
                .store
                .claim(&run_key, &claimant, first_step.as_ref())
                .await;
            if let Ok(claim) = &result {
                this.tasks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(claim.fence.attempt(), task.clone());
                // Recorded as executed, with the attempt it handed out, before any loss.
                this.answered(
                    "claim",
                    &run_key,
                    &task,
                    Some(claim.fence.attempt()),
                    None,
                    "claimed",
                );
            }
            this.answer("claim", &run_key, &task, None, None, result, |_| "claimed")
                .await
        })
        .await
    }

    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        let (run, attempt, seq) = (fence.run_key().clone(), fence.attempt(), step.seq);
        let task = self.task_of(attempt);
        self.send("append", &run, &task, Some(attempt), Some(seq))
            .await;
        let (this, sent, step) = (self.clone(), fence.clone(), step.clone());
        let result = on_the_wire(async move {
            this.deliver("append", &run, &task, Some(attempt), Some(seq))
                .await?;
            // The fence advances on the store's answer only: a lost answer leaves the caller's
            // fence where it was, as a lost acknowledgement does.
            let mut executed = sent;
            // SIM-BUG (feature `sim-bugs`, selected at run time): a store whose append checks
            // neither the attempt nor the version: it takes the fence as the holder's.
            #[cfg(feature = "sim-bugs")]
            if abada_agent_worker::sim_bugs::active(
                abada_agent_worker::sim_bugs::Bug::StoreUnfenced,
            ) && let Some(now) = this.world.store.run(run.as_str())
            {
                executed = Fence::issue(
                    run.clone(),
                    now.attempt,
                    now.version,
                    executed.next_seq(),
                    executed.journal_bytes(),
                );
            }
            let result = this.world.store.append(&mut executed, &step).await;
            this.answer(
                "append",
                &run,
                &task,
                Some(attempt),
                Some(seq),
                result,
                |o| match o {
                    AppendOutcome::Created => "created",
                    AppendOutcome::AlreadyPresent => "already-present",
                },
            )
            .await
            .map(|outcome| (outcome, executed))
        })
        .await;
        result.map(|(outcome, executed)| {
            *fence = executed;
            outcome
        })
    }

    async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        let (run, attempt) = (fence.run_key().clone(), fence.attempt());
        let task = self.task_of(attempt);
        self.send("finish", &run, &task, Some(attempt), None).await;
        let (this, fence) = (self.clone(), fence.clone());
        on_the_wire(async move {
            this.deliver("finish", &run, &task, Some(attempt), None)
                .await?;
            let result = this.world.store.finish(&fence, end).await;
            this.answer(
                "finish",
                &run,
                &task,
                Some(attempt),
                None,
                result,
                |_| "finished",
            )
            .await
        })
        .await
    }

    /// A read that changes nothing: passed to the world's store without a fault of its own (a
    /// lost answer or an outage shows on the claim that follows).
    async fn locate(
        &self,
        lookup: &abada_agent_worker::store::RunLookup<'_>,
    ) -> Result<Vec<abada_agent_worker::store::OpenRun>, StoreError> {
        self.world.store.locate(lookup).await
    }
}
