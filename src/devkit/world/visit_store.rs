//! The world's run store, where the conversations of the approval round trips wait between
//! tasks: the [`RunStore`] seam with the SQL's rules (`store/runs.rs`), in memory. A claim asks
//! the production admission rule (`store::admit`) and takes its attempt from one counter that
//! never repeats; an append is the compare-and-set of `APPEND` (attempt, version, next seq,
//! running) and, when it changes nothing, the diagnosis of `diagnose` (its own step whose answer
//! was lost is `AlreadyPresent`; another attempt's is `Fenced`); a finish marks the run, is
//! idempotent for its attempt and fenced. Every call is held while its worker is frozen and
//! never returns once it is killed, like the world's other calls.
//!
//! Merge note: the `memstore` branch adds the in-memory store with its conformance suite
//! against PostgreSQL (and store faults); once merged, it replaces this stand-in
//! (`sim/worker.rs` builds the store in one place).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use super::World;
use crate::engine::{AppendOutcome, JournalStep};
use crate::store::{
    Admission, Asking, Claim, Claimant, Fence, FenceReason, InputDigest, Phase, RunEnd, RunKey,
    RunStore, Seen, StoreError, admit, check_step,
};

/// Every run of the world's store, shared by the workers.
#[derive(Debug, Default)]
pub struct Runs {
    /// The last attempt handed out: the sequence that outlives the rows.
    last_attempt: u64,
    rows: BTreeMap<String, Row>,
}

#[derive(Debug)]
struct Row {
    attempt: u64,
    version: i64,
    next_seq: u64,
    journal_bytes: u64,
    running: bool,
    holder_task: String,
    /// World time of the latest claim or write.
    updated_at: u64,
    /// Each step with the attempt and the run version that wrote it.
    steps: Vec<(JournalStep, u64, i64)>,
}

impl Runs {
    fn next_attempt(&mut self) -> u64 {
        self.last_attempt += 1;
        self.last_attempt
    }
}

/// What the admission rule reads of a run, as `LOCK_RUN` and `JOURNAL_ENDS` read it.
fn seen(row: &Row, now: u64, hold_ms: u64) -> Seen {
    let first = row.steps.first().map(|(s, ..)| s);
    let journaled_input = first.and_then(InputDigest::of_step);
    let journaled_definition = first
        .filter(|s| s.kind == "input")
        .and_then(|s| s.data.get("definition"))
        .map(Value::to_string);
    let phase = match row.steps.last() {
        Some((s, ..)) => {
            let tool_calls = s
                .data
                .get("message")
                .and_then(|m| m.get("toolCalls"))
                .and_then(Value::as_array)
                .map_or(0, |a| a.len() as i64);
            Phase::of_last_step(&s.kind, &s.state, tool_calls)
        }
        None => Phase::Working,
    };
    Seen {
        running: row.running,
        holder: Some(row.holder_task.clone()),
        held: row.updated_at.saturating_add(hold_ms) >= now,
        journaled_input,
        journaled_definition,
        phase,
    }
}

/// One worker's connection to the world's run store.
pub struct WorldRunStore {
    world: Arc<World>,
    worker_id: String,
}

impl WorldRunStore {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldRunStore {
            world,
            worker_id: worker_id.into(),
        }
    }
}

#[async_trait]
impl RunStore for WorldRunStore {
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        if let Some(step) = first_step {
            if step.seq != 1 {
                return Err(StoreError::Invalid(format!(
                    "run {run_key}: the first step must have seq 1, not {}",
                    step.seq
                )));
            }
            check_step(run_key, 0, step)?;
        }
        self.world.hold(&self.worker_id).await;
        let now = self.world.elapsed_ms();
        let hold_ms = u64::try_from(claimant.hold.as_millis()).unwrap_or(u64::MAX);
        let asking = Asking {
            per_visit: run_key.is_per_visit(),
            task_id: claimant.task_id,
            input: first_step.and_then(InputDigest::of_step),
            hold_ms,
        };
        let mut runs = self.world.runs();
        let found = runs
            .rows
            .get(run_key.as_str())
            .map(|r| seen(r, now, hold_ms));
        let admission = admit(&asking, found.as_ref());
        if let Admission::Refuse(reason) = admission {
            return Err(StoreError::Refused {
                run_key: run_key.to_string(),
                task_id: claimant.task_id.to_string(),
                reason: Box::new(reason),
            });
        }
        let attempt = runs.next_attempt();
        let row = match (admission, runs.rows.remove(run_key.as_str())) {
            (Admission::Resume, Some(row)) => Row {
                attempt,
                version: row.version + 1,
                running: true,
                holder_task: claimant.task_id.to_string(),
                updated_at: now,
                ..row
            },
            (_, old) => Row {
                attempt,
                // A run begun again keeps counting its versions; a new one starts at 1.
                version: old.map_or(1, |r| r.version + 1),
                next_seq: 1,
                journal_bytes: 0,
                running: true,
                holder_task: claimant.task_id.to_string(),
                updated_at: now,
                steps: Vec::new(),
            },
        };
        let mut fence = Fence::issue(
            run_key.clone(),
            row.attempt,
            row.version,
            row.next_seq,
            row.journal_bytes,
        );
        let created = row.next_seq == 1;
        let row = runs.rows.entry(run_key.as_str().to_string()).or_insert(row);
        if let (true, Some(step)) = (created, first_step) {
            let body = check_step(run_key, 0, step)?;
            row.version += 1;
            row.next_seq += 1;
            row.journal_bytes += body.bytes();
            row.steps.push((step.clone(), attempt, row.version));
            fence.advance_past(&body);
        }
        Ok(Claim {
            fence,
            steps: row.steps.iter().map(|(s, ..)| s.clone()).collect(),
            created,
        })
    }

    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        let body = check_step(fence.run_key(), fence.journal_bytes(), step)?;
        self.world.hold(&self.worker_id).await;
        let now = self.world.elapsed_ms();
        let mut runs = self.world.runs();
        let Some(row) = runs.rows.get_mut(fence.run_key().as_str()) else {
            return Err(fence.refusal(FenceReason::Gone));
        };
        if row.attempt == fence.attempt()
            && row.version == fence.version()
            && row.next_seq == step.seq
            && row.running
        {
            row.version += 1;
            row.next_seq += 1;
            row.journal_bytes += body.bytes();
            row.updated_at = now;
            row.steps.push((step.clone(), fence.attempt(), row.version));
            fence.advance_past(&body);
            return Ok(AppendOutcome::Created);
        }
        // `diagnose`: why nothing changed.
        if row.attempt != fence.attempt() {
            return Err(fence.refusal(FenceReason::StaleAttempt {
                current: row.attempt,
            }));
        }
        if !row.running {
            return Err(fence.refusal(FenceReason::Finished));
        }
        let existing = step
            .seq
            .checked_sub(1)
            .and_then(|i| row.steps.get(i as usize));
        if let Some((stored, attempt, version)) = existing {
            let same = stored.kind == step.kind
                && stored.state == step.state
                && stored.key == step.key
                && stored.data == step.data;
            if !same {
                return Err(StoreError::Conflict {
                    run_key: fence.run_key().to_string(),
                    seq: step.seq,
                    reason: "that seq holds a different step".into(),
                });
            }
            if *attempt == fence.attempt()
                && *version == fence.version() + 1
                && row.version == fence.version() + 1
            {
                fence.advance_past(&body);
                return Ok(AppendOutcome::AlreadyPresent);
            }
        }
        if row.version != fence.version() {
            return Err(fence.refusal(FenceReason::StaleVersion {
                expected: fence.version(),
                current: row.version,
            }));
        }
        Err(StoreError::Conflict {
            run_key: fence.run_key().to_string(),
            seq: step.seq,
            reason: format!(
                "the next step of the run is seq {}: steps are contiguous",
                row.next_seq
            ),
        })
    }

    async fn finish(&self, fence: &Fence, _end: RunEnd) -> Result<(), StoreError> {
        self.world.hold(&self.worker_id).await;
        let now = self.world.elapsed_ms();
        let mut runs = self.world.runs();
        let Some(row) = runs.rows.get_mut(fence.run_key().as_str()) else {
            return Ok(()); // deleted already
        };
        if row.attempt != fence.attempt() {
            return Err(fence.refusal(FenceReason::StaleAttempt {
                current: row.attempt,
            }));
        }
        if row.running {
            row.running = false;
            row.version += 1;
            row.updated_at = now;
        }
        Ok(())
    }
}
