//! The in-memory run store: [`RunStore`] with the compare-and-set rules of the PostgreSQL store
//! (`src/store/runs.rs`), statement for statement, on tokio's clock, so a paused runtime (the
//! simulator, a paused test) drives it. The same conformance suite runs against it and against
//! [`PgRunStore`](abada_agent_worker::store::PgRunStore) on real PostgreSQL (`tests/it/store_conformance.rs`),
//! so the stand-in cannot drift from the real thing.
//!
//! What it mirrors, and where:
//! - the claim (`runs::claim`): the admission rule ([`admit`]) on the run as it stands; create,
//!   resume or begin again under an attempt from one counter that outlives every run (the
//!   database sequence, starting at 2^32 as migration 0002 does), so a run deleted and created
//!   again never hands out an earlier holder's token; the input step written in the same step
//!   when the run has none;
//! - the append (`APPEND` plus `diagnose`): a compare-and-set on attempt, version, next `seq`
//!   and status; when it changes nothing, the same diagnosis in the same order (gone, stale
//!   attempt, finished, a different step at that `seq`, this fence's own lost commit, stale
//!   version, a gap);
//! - the finish (`FINISH_MARK`/`FINISH_DELETE` plus `RUN_STATE`): fenced by the attempt only,
//!   idempotent, deleting with a retention of zero;
//! - the sweeps (`SWEEP_FINISHED`, `SWEEP_ABANDONED`): oldest first, in batches.
//!
//! Each call is one critical section (a transaction): nothing is held across an await, so two
//! claims racing are serialised as PostgreSQL's row lock serialises them.
//!
//! One known difference: for a journaled input that is not a JSON string, PostgreSQL's `->>`
//! renders the value as `jsonb` text and this store as serde_json text; the digests of such a
//! run differ from any offered input either way (an offered input is always a string).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::time::Instant;

use abada_agent_worker::engine::{AppendOutcome, JournalStep};
use abada_agent_worker::store::{
    Admission, Asking, Claim, Claimant, Fence, FenceReason, InputDigest, MAX_OPEN_RUNS, OpenRun,
    Phase, RunEnd, RunKey, RunLookup, RunStore, Seen, StoreError, SweepReport, admit, check_step,
};

/// The first attempt the counter hands out: the PostgreSQL sequence's start (migration 0002).
pub const FIRST_ATTEMPT: u64 = 1 << 32;

/// How the store keeps and sweeps finished and idle runs (the store's part of `StoreConfig`).
#[derive(Clone, Copy, Debug)]
pub struct MemoryStoreSettings {
    /// How long a finished run is kept; zero deletes it in the finish.
    pub retention: Duration,
    /// An unfinished run untouched this long is swept; `None`: never.
    pub abandoned_after: Option<Duration>,
    /// Runs deleted per sweep batch.
    pub sweep_batch: usize,
}

impl Default for MemoryStoreSettings {
    /// `StoreConfig`'s defaults: retention 0, abandoned after 30 days, batches of 500.
    fn default() -> Self {
        MemoryStoreSettings {
            retention: Duration::ZERO,
            abandoned_after: Some(Duration::from_secs(30 * 86_400)),
            sweep_batch: 500,
        }
    }
}

/// A rule of the store deliberately broken ([`MemoryRunStore::with_flaw`]): the conformance
/// suite shows that each is caught, so none of its cases is a check that cannot fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flaw {
    /// Attempts counted per run (1, 2, 3, and 1 again once the run was deleted), as migration
    /// 0001 did: a run created again hands out a token an earlier holder had.
    AttemptPerRun,
    /// The append's compare-and-set (and its diagnosis) ignores the attempt.
    NoAttemptCheck,
    /// The append's compare-and-set ignores the next `seq`: a gap is written.
    NoSeqCheck,
    /// A retried append of the step it wrote is not recognised as its own lost commit.
    NoLostCommit,
    /// A finish ignores the attempt: a stale holder finishes the newer attempt's run.
    FinishUnfenced,
    /// A finish of a finished run is refused: not idempotent.
    FinishOnce,
    /// No admission rule: any claim of a running run resumes it.
    NoAdmission,
    /// The claim decides, lets other calls run, then writes on what it decided (no lock held
    /// between the look and the write).
    TornClaim,
}

/// The run store in memory. Cheap to share behind an `Arc`.
pub struct MemoryRunStore {
    state: Mutex<State>,
    settings: MemoryStoreSettings,
    flaw: Option<Flaw>,
    /// The clock's zero: times are kept as microseconds since it, signed, so a run can be
    /// backdated past it ([`MemoryRunStore::backdate`]).
    origin: Instant,
}

#[derive(Debug)]
struct State {
    runs: BTreeMap<String, Run>,
    /// The next attempt: the sequence, which outlives every run.
    next_attempt: u64,
}

/// A row of `abada_agent_runs` and its steps.
#[derive(Clone, Debug)]
struct Run {
    attempt: u64,
    owner: String,
    holder_task: Option<String>,
    version: i64,
    next_seq: u64,
    journal_bytes: u64,
    status: Status,
    updated_at: i64,
    finished_at: Option<i64>,
    steps: BTreeMap<u64, StoredStep>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Running,
    Completed,
    Failed,
}

/// A row of `abada_agent_steps`.
#[derive(Clone, Debug)]
struct StoredStep {
    /// The attempt that wrote it, and the run's version after it.
    attempt: u64,
    run_version: i64,
    kind: String,
    state: String,
    key: Option<String>,
    /// The body as the store keeps it (NUL characters as U+FFFD).
    body: Value,
}

impl StoredStep {
    fn journal_step(&self, seq: u64) -> JournalStep {
        JournalStep {
            seq,
            kind: self.kind.clone(),
            state: self.state.clone(),
            key: self.key.clone(),
            data: self.body.clone(),
        }
    }
}

/// What a run holds at a glance, for checks (the simulator's invariants, tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunView {
    pub attempt: u64,
    pub owner: String,
    pub holder_task: Option<String>,
    pub version: i64,
    pub next_seq: u64,
    pub running: bool,
    /// Per step in `seq` order: the attempt that wrote it.
    pub(crate) step_attempts: Vec<u64>,
}

impl MemoryRunStore {
    /// An empty store whose clock starts now.
    pub fn new(settings: MemoryStoreSettings) -> MemoryRunStore {
        MemoryRunStore {
            state: Mutex::new(State {
                runs: BTreeMap::new(),
                next_attempt: FIRST_ATTEMPT,
            }),
            settings: MemoryStoreSettings {
                sweep_batch: settings.sweep_batch.max(1),
                ..settings
            },
            origin: Instant::now(),
            flaw: None,
        }
    }

    /// The store with one of its rules broken: for showing that the conformance suite catches
    /// each; never for a simulation.
    pub fn with_flaw(mut self, flaw: Flaw) -> MemoryRunStore {
        self.flaw = Some(flaw);
        self
    }

    fn flawed(&self, flaw: Flaw) -> bool {
        self.flaw == Some(flaw)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Microseconds since the store's origin.
    fn now(&self) -> i64 {
        i64::try_from(self.origin.elapsed().as_micros()).unwrap_or(i64::MAX)
    }

    /// The run as it stands, `None` when there is none.
    pub fn run(&self, run_key: &str) -> Option<RunView> {
        self.state().runs.get(run_key).map(|r| RunView {
            attempt: r.attempt,
            owner: r.owner.clone(),
            holder_task: r.holder_task.clone(),
            version: r.version,
            next_seq: r.next_seq,
            running: r.status == Status::Running,
            step_attempts: r.steps.values().map(|s| s.attempt).collect(),
        })
    }

    /// Test control: the run's latest change (and its finish) as if it had happened `by`
    /// earlier, as a test of the PostgreSQL store moves `updated_at` and `finished_at` back.
    pub fn backdate(&self, run_key: &RunKey, by: Duration) {
        let by = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        if let Some(run) = self.state().runs.get_mut(run_key.as_str()) {
            run.updated_at = run.updated_at.saturating_sub(by);
            run.finished_at = run.finished_at.map(|f| f.saturating_sub(by));
        }
    }

    /// One pass of the sweeper (`PgRunStore::sweep`): finished runs past the retention, then
    /// unfinished runs idle past the abandonment limit, oldest first, in batches.
    pub fn sweep(&self) -> SweepReport {
        let mut report = SweepReport::default();
        let batch = self.settings.sweep_batch;
        let kinds = std::iter::once(Sweep::Finished(self.settings.retention))
            .chain(self.settings.abandoned_after.map(Sweep::Abandoned));
        for sweep in kinds {
            loop {
                let deleted = self.sweep_batch(sweep, batch);
                report.batches += 1;
                match sweep {
                    Sweep::Finished(_) => report.finished += deleted,
                    Sweep::Abandoned(_) => report.abandoned += deleted,
                }
                if deleted < batch as u64 {
                    break;
                }
            }
        }
        report
    }

    fn sweep_batch(&self, sweep: Sweep, batch: usize) -> u64 {
        let now = self.now();
        let mut state = self.state();
        let mut due: Vec<(i64, String)> = state
            .runs
            .iter()
            .filter_map(|(key, run)| {
                let at = match sweep {
                    Sweep::Finished(age) => run
                        .finished_at
                        .filter(|f| *f <= now.saturating_sub(micros(age))),
                    Sweep::Abandoned(age) => Some(run.updated_at).filter(|u| {
                        run.finished_at.is_none() && *u <= now.saturating_sub(micros(age))
                    }),
                }?;
                Some((at, key.clone()))
            })
            .collect();
        due.sort();
        due.truncate(batch);
        for (_, key) in &due {
            state.runs.remove(key);
        }
        due.len() as u64
    }

    /// The claim (`runs::claim`), one critical section; `decided`: the admission a
    /// [`Flaw::TornClaim`] took before it let other calls run.
    fn claim_now(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
        decided: Option<Admission>,
    ) -> Result<Claim, StoreError> {
        let first = match first_step {
            None => None,
            Some(step) if step.seq != 1 => {
                return Err(StoreError::Invalid(format!(
                    "run {run_key}: the first step must have seq 1, not {}",
                    step.seq
                )));
            }
            Some(step) => Some((step, check_step(run_key, 0, step)?)),
        };
        let hold_ms = u64::try_from(claimant.hold.as_millis()).unwrap_or(u64::MAX);
        let asking = Asking {
            per_visit: run_key.is_per_visit(),
            task_id: claimant.task_id,
            input: first
                .as_ref()
                .and_then(|(step, _)| InputDigest::of_step(step)),
            hold_ms,
        };
        let now = self.now();
        let mut state = self.state();
        let key = run_key.as_str();
        let seen = state.runs.get(key).map(|run| seen(run, now, hold_ms));
        let admission = match decided {
            Some(decided) => decided,
            None if self.flawed(Flaw::NoAdmission) => match seen {
                Some(_) => Admission::Resume,
                None => Admission::Begin,
            },
            None => admit(&asking, seen.as_ref()),
        };
        let attempt = match admission {
            Admission::Refuse(reason) => {
                return Err(StoreError::Refused {
                    run_key: key.to_string(),
                    task_id: claimant.task_id.to_string(),
                    reason: Box::new(reason),
                });
            }
            _ if self.flawed(Flaw::AttemptPerRun) => {
                state.runs.get(key).map_or(1, |r| r.attempt + 1)
            }
            _ => state.take_attempt(),
        };
        let exists = state.runs.contains_key(key);
        let run = match (admission, exists) {
            // CREATE_RUN
            (Admission::Begin, false) => state.runs.entry(key.to_string()).or_insert(Run {
                attempt,
                owner: claimant.worker_id.to_string(),
                holder_task: Some(claimant.task_id.to_string()),
                version: 1,
                next_seq: 1,
                journal_bytes: 0,
                status: Status::Running,
                updated_at: now,
                finished_at: None,
                steps: BTreeMap::new(),
            }),
            // RESTART_RUN
            (Admission::Begin, true) => {
                let run = state.runs.get_mut(key).expect("the run exists");
                run.steps.clear();
                run.next_seq = 1;
                run.journal_bytes = 0;
                run.taken(attempt, claimant, now);
                run
            }
            // RESUME_RUN
            (Admission::Resume, true) => {
                let run = state.runs.get_mut(key).expect("the run exists");
                run.taken(attempt, claimant, now);
                run
            }
            (Admission::Resume, false) | (Admission::Refuse(_), _) => {
                return Err(StoreError::Internal(format!(
                    "run {run_key}: the admission rule resumed a run that does not exist"
                )));
            }
        };
        let next_seq = run.next_seq;
        let mut fence = Fence::issue(
            run_key.clone(),
            run.attempt,
            run.version,
            run.next_seq,
            run.journal_bytes,
        );
        let steps = match (next_seq, first) {
            (1, Some((step, body))) => {
                // The run is this claim's: the compare-and-set cannot miss.
                let data = body.value();
                run.write(&fence, step, data.clone(), body.bytes(), now);
                fence.advance_past(&body);
                vec![JournalStep {
                    data,
                    ..step.clone()
                }]
            }
            (1, None) => Vec::new(),
            _ => run
                .steps
                .iter()
                .map(|(seq, s)| s.journal_step(*seq))
                .collect(),
        };
        Ok(Claim {
            created: next_seq == 1,
            fence,
            steps,
        })
    }

    /// What the admission rule says of the run as it stands ([`Flaw::TornClaim`]'s look).
    fn decide(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Admission {
        let hold_ms = u64::try_from(claimant.hold.as_millis()).unwrap_or(u64::MAX);
        let asking = Asking {
            per_visit: run_key.is_per_visit(),
            task_id: claimant.task_id,
            input: first_step.and_then(InputDigest::of_step),
            hold_ms,
        };
        let now = self.now();
        let state = self.state();
        let seen = state
            .runs
            .get(run_key.as_str())
            .map(|run| seen(run, now, hold_ms));
        admit(&asking, seen.as_ref())
    }

    /// The append (`APPEND`, then `diagnose` when it changed nothing), one critical section.
    fn append_now(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        let body = check_step(fence.run_key(), fence.journal_bytes(), step)?;
        let data = body.value();
        let now = self.now();
        let mut state = self.state();
        let Some(run) = state.runs.get_mut(fence.run_key().as_str()) else {
            return Err(fence.refusal(FenceReason::Gone));
        };
        let attempt_checked = !self.flawed(Flaw::NoAttemptCheck);
        let matches = (run.attempt == fence.attempt() || !attempt_checked)
            && run.version == fence.version()
            && (run.next_seq == step.seq || self.flawed(Flaw::NoSeqCheck))
            && run.status == Status::Running;
        if matches {
            run.write(fence, step, data, body.bytes(), now);
            fence.advance_past(&body);
            return Ok(AppendOutcome::Created);
        }
        if run.attempt != fence.attempt() && attempt_checked {
            return Err(fence.refusal(FenceReason::StaleAttempt {
                current: run.attempt,
            }));
        }
        if run.status != Status::Running {
            return Err(fence.refusal(FenceReason::Finished));
        }
        if let Some(existing) = run.steps.get(&step.seq) {
            let same = existing.kind == step.kind
                && existing.state == step.state
                && existing.key == step.key
                && existing.body == data;
            if !same {
                return Err(StoreError::Conflict {
                    run_key: fence.run_key().to_string(),
                    seq: step.seq,
                    reason: "that seq holds a different step".into(),
                });
            }
            let own_lost_commit = !self.flawed(Flaw::NoLostCommit)
                && existing.attempt == fence.attempt()
                && existing.run_version == fence.version() + 1
                && run.version == fence.version() + 1;
            if own_lost_commit {
                fence.advance_past(&body);
                return Ok(AppendOutcome::AlreadyPresent);
            }
        }
        if run.version != fence.version() {
            return Err(fence.refusal(FenceReason::StaleVersion {
                expected: fence.version(),
                current: run.version,
            }));
        }
        if step.seq != run.next_seq {
            return Err(StoreError::Conflict {
                run_key: fence.run_key().to_string(),
                seq: step.seq,
                reason: format!(
                    "the next step of the run is seq {}: steps are contiguous",
                    run.next_seq
                ),
            });
        }
        Err(StoreError::Internal(format!(
            "run {}: the append of step {} changed nothing although the run matches it",
            fence.run_key(),
            step.seq
        )))
    }

    /// The finish (`FINISH_DELETE` or `FINISH_MARK`, then `RUN_STATE` when it changed nothing),
    /// one critical section.
    fn finish_now(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        let now = self.now();
        let mut state = self.state();
        let key = fence.run_key().as_str();
        let Some(run) = state.runs.get_mut(key) else {
            return Ok(()); // deleted already
        };
        if run.attempt == fence.attempt() || self.flawed(Flaw::FinishUnfenced) {
            if self.settings.retention.is_zero() {
                // FINISH_DELETE matches the attempt whatever the status.
                state.runs.remove(key);
                return Ok(());
            }
            if run.status == Status::Running {
                run.status = match end {
                    RunEnd::Completed => Status::Completed,
                    RunEnd::Failed => Status::Failed,
                };
                run.finished_at = Some(now);
                run.updated_at = now;
                run.version += 1;
            } else if self.flawed(Flaw::FinishOnce) {
                return Err(fence.refusal(FenceReason::Finished));
            }
            return Ok(()); // finished now, or already
        }
        Err(fence.refusal(FenceReason::StaleAttempt {
            current: run.attempt,
        }))
    }
}

impl State {
    /// `nextval('abada_agent_run_attempts')`.
    fn take_attempt(&mut self) -> u64 {
        let attempt = self.next_attempt;
        self.next_attempt += 1;
        attempt
    }
}

impl Run {
    /// What `RESUME_RUN` and `RESTART_RUN` set alike.
    fn taken(&mut self, attempt: u64, claimant: &Claimant<'_>, now: i64) {
        self.attempt = attempt;
        self.owner = claimant.worker_id.to_string();
        self.holder_task = Some(claimant.task_id.to_string());
        self.version += 1;
        self.status = Status::Running;
        self.finished_at = None;
        self.updated_at = now;
    }

    /// The compare-and-set's update and the step's insert, once it matched.
    fn write(&mut self, fence: &Fence, step: &JournalStep, body: Value, bytes: u64, now: i64) {
        self.version += 1;
        self.next_seq += 1;
        self.journal_bytes += bytes;
        self.updated_at = now;
        self.steps.insert(
            step.seq,
            StoredStep {
                attempt: fence.attempt(),
                run_version: self.version,
                kind: step.kind.clone(),
                state: step.state.clone(),
                key: step.key.clone(),
                body,
            },
        );
    }
}

/// The run as the admission rule reads it (`LOCK_RUN` and `JOURNAL_ENDS`).
fn seen(run: &Run, now: i64, hold_ms: u64) -> Seen {
    let hold = i64::try_from(hold_ms.saturating_mul(1000)).unwrap_or(i64::MAX);
    let first = run.steps.get(&1);
    let text = |v: Option<&Value>| match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };
    let journaled_input = first.and_then(|f| {
        if f.kind != "input" {
            return None;
        }
        let input = text(f.body.get("input"))?;
        let instructions = text(f.body.get("instructions")).unwrap_or_default();
        Some(InputDigest::of(&instructions, &input))
    });
    let phase = match run.next_seq.checked_sub(1).and_then(|s| run.steps.get(&s)) {
        Some(last) => {
            let tool_calls = last
                .body
                .get("message")
                .and_then(|m| m.get("toolCalls"))
                .and_then(Value::as_array)
                .map_or(0, |calls| calls.len() as i64);
            Phase::of_last_step(&last.kind, &last.state, tool_calls)
        }
        None => Phase::Working,
    };
    Seen {
        running: run.status == Status::Running,
        holder: run.holder_task.clone(),
        held: run.updated_at >= now.saturating_sub(hold),
        journaled_input,
        journaled_definition: first
            .and_then(|f| f.body.get("definition"))
            .map(Value::to_string),
        phase,
    }
}

#[derive(Clone, Copy, Debug)]
enum Sweep {
    Finished(Duration),
    Abandoned(Duration),
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[async_trait]
impl RunStore for MemoryRunStore {
    async fn claim(
        &self,
        run_key: &RunKey,
        claimant: &Claimant<'_>,
        first_step: Option<&JournalStep>,
    ) -> Result<Claim, StoreError> {
        if self.flawed(Flaw::TornClaim) {
            let decided = self.decide(run_key, claimant, first_step);
            tokio::task::yield_now().await;
            return self.claim_now(run_key, claimant, first_step, Some(decided));
        }
        self.claim_now(run_key, claimant, first_step, None)
    }

    async fn append(
        &self,
        fence: &mut Fence,
        step: &JournalStep,
    ) -> Result<AppendOutcome, StoreError> {
        self.append_now(fence, step)
    }

    async fn finish(&self, fence: &Fence, end: RunEnd) -> Result<(), StoreError> {
        self.finish_now(fence, end)
    }

    /// The SQL's lookup (`runs::LOCATE`): running runs of the exact keys, or held by the task
    /// under its node's prefix; newest first, then by key; at most [`MAX_OPEN_RUNS`].
    async fn locate(&self, lookup: &RunLookup<'_>) -> Result<Vec<OpenRun>, StoreError> {
        let state = self.state();
        let mut found: Vec<(i64, OpenRun)> = state
            .runs
            .iter()
            .filter(|(key, run)| {
                run.status == Status::Running && lookup.matches(key, run.holder_task.as_deref())
            })
            .map(|(key, run)| {
                let seen = seen(run, 0, 0);
                let definition = run
                    .steps
                    .get(&1)
                    .and_then(|f| f.body.get("definition"))
                    .cloned();
                (
                    run.updated_at,
                    OpenRun {
                        run_key: key.clone(),
                        holder: run.holder_task.clone(),
                        phase: seen.phase,
                        definition,
                    },
                )
            })
            .collect();
        found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.run_key.cmp(&b.1.run_key)));
        Ok(found
            .into_iter()
            .take(MAX_OPEN_RUNS)
            .map(|(_, run)| run)
            .collect())
    }
}
