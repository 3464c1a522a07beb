//! Runs and steps in SQL: the lookup of a task's open runs before its claim (one statement),
//! the claim (one transaction that makes the attempt the fencing token), the append (one statement: a compare-and-set on the run row plus the step insert),
//! the diagnosis of an append that changed nothing, the finish and the sweeper's batches.
//!
//! Every statement is prepared once per connection ([`Statements`]), so a call is one round
//! trip. Steps go in and come out as [`JournalStep`], the shapes of protocol.md B.2, so replay
//! is the same code for the engine's journal and the store's.

use serde_json::Value;
use tokio_postgres::{Client, GenericClient, Row, Statement};

use super::admission::{Admission, Asking, InputDigest, Phase, Seen, admit};
use super::error::{FenceReason, StoreError, classify};
use crate::engine::{AppendOutcome, JournalStep};

/// The most a run's journal may hold, counted as the bytes of its step bodies: the same bound
/// as the engine client's response bodies, so a journal read is bounded by construction.
pub(crate) const MAX_JOURNAL_BYTES: u64 = 32 * 1024 * 1024;

/// The longest run key: far below PostgreSQL's index entry limit.
pub(crate) const MAX_RUN_KEY_BYTES: usize = 512;

/// The deepest nesting of arrays and objects a step body may have: below serde_json's limit of
/// 128, so every body stored can be read back (a step nobody can read would strand its run).
pub(crate) const MAX_BODY_DEPTH: usize = 100;

/// Which run: an opaque key. The engine's task id ([`RunKey::for_task`]), or, for a
/// conversation that spans several engine tasks, its process visit: process
/// instance, activity and loop counter ([`RunKey::for_visit`]), with no change to the schema.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RunKey {
    key: String,
    /// Many tasks claim a visit's run (the tasks of one visit, and the next visits): the
    /// admission rule (`admission`) decides which may take it and whether it begins afresh.
    /// A task's run is only ever claimed by its task, and reopened with its journal.
    per_visit: bool,
}

impl RunKey {
    /// A key the store can hold: 1 to 512 bytes, no control character.
    pub fn new(key: impl Into<String>) -> Result<RunKey, StoreError> {
        let key = key.into();
        if key.is_empty() || key.len() > MAX_RUN_KEY_BYTES || key.chars().any(char::is_control) {
            return Err(StoreError::Invalid(format!(
                "a run key must be 1 to {MAX_RUN_KEY_BYTES} bytes without control characters; got {} bytes",
                key.len()
            )));
        }
        Ok(RunKey {
            key,
            per_visit: false,
        })
    }

    /// The run of one engine task.
    pub fn for_task(task_id: &str) -> Result<RunKey, StoreError> {
        RunKey::new(task_id)
    }

    /// The key of a process visit's run (`run_key::run_key`): a finished (or answered) run under
    /// it is begun afresh by the next task, never reopened; a live holder's run is not taken.
    pub fn for_visit(key: impl Into<String>) -> Result<RunKey, StoreError> {
        Ok(RunKey {
            per_visit: true,
            ..RunKey::new(key)?
        })
    }

    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// A process visit's key ([`RunKey::for_visit`]), for the admission rule.
    pub fn is_per_visit(&self) -> bool {
        self.per_visit
    }
}

impl std::fmt::Display for RunKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}

/// An attempt's hold on a run: what every append proves to the store. Made only by a claim and
/// advanced only by the store's answers; a stale copy (a clone kept across a newer append, or
/// the fence of an attempt a newer claim replaced) is refused by the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    run_key: RunKey,
    attempt: u64,
    version: i64,
    next_seq: u64,
    journal_bytes: u64,
}

impl Fence {
    /// The fence a store's claim hands out: its run, the attempt it took (never handed out
    /// before), the run's version and next `seq`, and the bytes its journal holds. For a store
    /// implementation (a stand-in of [`RunStore`](super::RunStore)); the runtime never makes one.
    pub fn issue(
        run_key: RunKey,
        attempt: u64,
        version: i64,
        next_seq: u64,
        journal_bytes: u64,
    ) -> Fence {
        Fence {
            run_key,
            attempt,
            version,
            next_seq,
            journal_bytes,
        }
    }

    /// Advances the fence past a step the store accepted ([`check_step`]'s body): for a store
    /// implementation, on its own answer only.
    pub fn advance_past(&mut self, body: &StepBody) {
        self.advance(body);
    }

    /// The error a store answers a stale fence with.
    pub fn refusal(&self, reason: FenceReason) -> StoreError {
        self.fenced(reason)
    }

    pub fn run_key(&self) -> &RunKey {
        &self.run_key
    }

    /// The fencing token: this claim's attempt number, from a database sequence that outlives
    /// the run rows, so no two claims of any run ever share one (not 1, 2, 3 per run).
    pub fn attempt(&self) -> u64 {
        self.attempt
    }

    /// The run's version as this attempt last saw it change.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// The `seq` the next step must have.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Bytes of step bodies in the journal so far (at most [`MAX_JOURNAL_BYTES`]).
    pub fn journal_bytes(&self) -> u64 {
        self.journal_bytes
    }

    /// The attempt as the store holds it: read from a `bigint`, so it fits.
    fn attempt_sql(&self) -> i64 {
        i64::try_from(self.attempt).unwrap_or(i64::MAX)
    }

    fn advance(&mut self, body: &StepBody) {
        self.version += 1;
        self.next_seq += 1;
        self.journal_bytes += body.bytes();
    }

    fn fenced(&self, reason: FenceReason) -> StoreError {
        StoreError::Fenced {
            run_key: self.run_key.key.clone(),
            attempt: self.attempt,
            reason,
        }
    }
}

/// The most open runs one lookup returns: a task holds one run, and its node's visits that wait
/// for a decision are named by key.
pub const MAX_OPEN_RUNS: usize = 16;

/// What a task asks the store before it claims: which open (running) runs could be its own,
/// found without any agent definition (`agent::run_home`).
#[derive(Clone, Copy, Debug)]
pub struct RunLookup<'a> {
    /// Exact keys: the task's own run, its node's visit, and visit keys the task names.
    pub keys: &'a [String],
    /// The task: the runs it holds under `prefix` are found too.
    pub task_id: &'a str,
    /// Its node's visit key (`process/{instance}/{activity}`): the runs the task holds under
    /// `{prefix}/` (a visit with a loop counter) are found whatever the counter's name.
    pub prefix: Option<&'a str>,
}

impl RunLookup<'_> {
    /// Whether the lookup finds a run of `key` held by `holder` (the rule every store keeps).
    pub fn matches(&self, key: &str, holder: Option<&str>) -> bool {
        self.keys.iter().any(|k| k == key)
            || self.prefix.is_some_and(|p| {
                holder == Some(self.task_id)
                    && key.len() > p.len()
                    && key.starts_with(p)
                    && key.as_bytes()[p.len()] == b'/'
            })
    }
}

/// An open run a lookup found.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenRun {
    pub run_key: String,
    /// The task of the run's latest claim.
    pub holder: Option<String>,
    pub phase: Phase,
    /// The agent definition journaled with the run's input (`data.definition`), if any.
    pub definition: Option<Value>,
}

/// What a claim returns: the fence for this attempt and the journal so far.
#[derive(Clone, Debug)]
pub struct Claim {
    pub fence: Fence,
    /// Every step of the run in `seq` order, the first step included when this claim wrote it.
    pub steps: Vec<JournalStep>,
    /// This claim began the run's journal: the run had no step (a new run, or a visit's run
    /// started over by the admission rule).
    pub created: bool,
}

/// Who claims a run: recorded on it, and what the admission rule (`admission`) weighs.
#[derive(Clone, Copy, Debug)]
pub struct Claimant<'a> {
    /// Recorded as the run's owner, for operators.
    pub worker_id: &'a str,
    /// The engine task claiming: the run's holder once claimed. Under a visit's key another
    /// task may take the run only as the admission rule says.
    pub task_id: &'a str,
    /// How long a visit's holder keeps its run against other tasks after its latest claim or
    /// write: the lock duration.
    pub hold: std::time::Duration,
}

/// How a run ended, once the engine accepted the outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// The task was completed.
    Completed,
    /// The task ended for good otherwise (a BPMN error that failed the process).
    Failed,
}

impl RunEnd {
    fn status(self) -> &'static str {
        match self {
            RunEnd::Completed => "completed",
            RunEnd::Failed => "failed",
        }
    }
}

/// A step's body as stored: its data as JSON text, with NUL characters (which `jsonb` cannot
/// hold) replaced by U+FFFD. The same conversion is applied before any comparison, so a retried
/// append of such a step still recognises itself.
#[derive(Clone, Debug)]
pub struct StepBody {
    text: String,
}

impl StepBody {
    pub(super) fn of(step: &JournalStep) -> Result<StepBody, StoreError> {
        if depth(&step.data) > MAX_BODY_DEPTH {
            return Err(StoreError::Invalid(format!(
                "step {} nests arrays and objects deeper than {MAX_BODY_DEPTH} levels",
                step.seq
            )));
        }
        let text = serde_json::to_string(&step.data)
            .map_err(|e| StoreError::Invalid(format!("step {} is not JSON: {e}", step.seq)))?;
        if !text.contains("\\u0000") {
            return Ok(StepBody { text });
        }
        let mut clean = step.data.clone();
        replace_nul(&mut clean);
        let text = serde_json::to_string(&clean)
            .map_err(|e| StoreError::Invalid(format!("step {} is not JSON: {e}", step.seq)))?;
        Ok(StepBody { text })
    }

    /// Its size, as counted against [`MAX_JOURNAL_BYTES`].
    pub fn bytes(&self) -> u64 {
        self.text.len() as u64
    }

    /// The body as a value again. Cannot fail: the text is serde_json's own output, nested no
    /// deeper than [`MAX_BODY_DEPTH`].
    pub fn value(&self) -> Value {
        serde_json::from_str(&self.text).expect("a body is serde_json output of bounded depth")
    }
}

/// Nesting depth of arrays and objects (a scalar is 0).
fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn replace_nul(value: &mut Value) {
    const NUL: char = '\0';
    match value {
        Value::String(s) if s.contains(NUL) => *s = s.replace(NUL, "\u{FFFD}"),
        Value::Array(items) => items.iter_mut().for_each(replace_nul),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains(NUL)) {
                let entries: Vec<(String, Value)> = std::mem::take(map).into_iter().collect();
                for (k, v) in entries {
                    map.insert(k.replace(NUL, "\u{FFFD}"), v);
                }
            }
            map.values_mut().for_each(replace_nul);
        }
        _ => {}
    }
}

/// Checks what the store cannot hold before any connection is used: the step's `seq`, NUL
/// characters in its texts, and the journal's bound given the `journal_bytes` it holds already.
pub fn check_step(
    run_key: &RunKey,
    journal_bytes: u64,
    step: &JournalStep,
) -> Result<StepBody, StoreError> {
    if step.seq == 0 || step.seq > i64::MAX as u64 {
        return Err(StoreError::Invalid(format!(
            "run {run_key}: step seq {} is out of range (1 and up)",
            step.seq
        )));
    }
    let texts = [Some(&step.kind), Some(&step.state), step.key.as_ref()];
    if texts.into_iter().flatten().any(|t| t.contains('\0')) {
        return Err(StoreError::Invalid(format!(
            "run {run_key}: step {} has a NUL character in its kind, state or key",
            step.seq
        )));
    }
    let body = StepBody::of(step)?;
    if journal_bytes.saturating_add(body.bytes()) > MAX_JOURNAL_BYTES {
        return Err(StoreError::Invalid(format!(
            "run {run_key}: step {} ({} bytes) would take the journal past {MAX_JOURNAL_BYTES} bytes",
            step.seq,
            body.bytes()
        )));
    }
    Ok(body)
}

/// The run as a claim finds it, its row locked until the claim commits: the row's part of what
/// the admission rule reads (`admission::Seen`), and its next seq for `JOURNAL_ENDS`.
const LOCK_RUN: &str = "
    SELECT status = 'running', holder_task,
           updated_at >= now() - $2::bigint * interval '1 millisecond', next_seq
      FROM abada_agent_runs
     WHERE run_key = $1::text
       FOR UPDATE";

/// The journal's first and last steps, read by a statement of its own once the row is locked:
/// its snapshot is taken after the lock, and every change of a run's steps takes that lock, so
/// it sees the journal as it stands (a join in `LOCK_RUN` would read the steps as they were
/// before a concurrent claim it waited for). The first step's texts give the journaled input's
/// digest (and its journaled BPMN definition, for a refusal to carry); the last step's kind,
/// state and number of tool calls the conversation's phase.
const JOURNAL_ENDS: &str = "
    SELECT f.kind, f.body->>'instructions', f.body->>'input',
           l.kind, l.state,
           CASE WHEN jsonb_typeof(l.body->'message'->'toolCalls') = 'array'
                THEN jsonb_array_length(l.body->'message'->'toolCalls') ELSE 0 END,
           (f.body->'definition')::text
      FROM (SELECT 1) AS one
      LEFT JOIN abada_agent_steps f ON f.run_key = $1::text AND f.seq = 1
      LEFT JOIN abada_agent_steps l ON l.run_key = $1::text AND l.seq = $2::bigint - 1";

/// The open runs a task may find as its own (`RunLookup`), newest first, each with its phase
/// (from its last step) and the definition journaled with its input.
const LOCATE: &str = "
    SELECT r.run_key, r.holder_task, l.kind, l.state,
           CASE WHEN jsonb_typeof(l.body->'message'->'toolCalls') = 'array'
                THEN jsonb_array_length(l.body->'message'->'toolCalls') ELSE 0 END,
           (f.body->'definition')::text
      FROM abada_agent_runs r
      LEFT JOIN abada_agent_steps f ON f.run_key = r.run_key AND f.seq = 1
      LEFT JOIN abada_agent_steps l ON l.run_key = r.run_key AND l.seq = r.next_seq - 1
     WHERE r.status = 'running'
       AND (r.run_key = ANY($1::text[])
            OR (r.holder_task = $2::text AND r.run_key ~>=~ $3::text AND r.run_key ~<~ $4::text))
     ORDER BY r.updated_at DESC, r.run_key
     LIMIT $5::bigint";

/// A new run. Nothing when a concurrent claim created it first (the claim then reads it again).
const CREATE_RUN: &str = "
    INSERT INTO abada_agent_runs
           (run_key, attempt, owner, holder_task, version, next_seq, journal_bytes, status)
    VALUES ($1::text, nextval('abada_agent_run_attempts'), $2::text, $3::text, 1, 1, 0, 'running')
    ON CONFLICT (run_key) DO NOTHING
    RETURNING attempt, version, next_seq, journal_bytes";

/// The run resumed by a new attempt (reopened if it was a task's finished run).
const RESUME_RUN: &str = "
    UPDATE abada_agent_runs
       SET attempt = nextval('abada_agent_run_attempts'), owner = $2::text, holder_task = $3::text,
           version = version + 1, status = 'running', finished_at = NULL, updated_at = now()
     WHERE run_key = $1::text
    RETURNING attempt, version, next_seq, journal_bytes";

/// The run begun again by a new attempt: its steps go, its next seq is 1 again. The attempt
/// comes from the sequence, so no fence of the conversation that went can match the new one.
const RESTART_RUN: &str = "
    WITH gone AS (DELETE FROM abada_agent_steps WHERE run_key = $1::text)
    UPDATE abada_agent_runs
       SET attempt = nextval('abada_agent_run_attempts'), owner = $2::text, holder_task = $3::text,
           version = version + 1, next_seq = 1, journal_bytes = 0, status = 'running',
           finished_at = NULL, updated_at = now()
     WHERE run_key = $1::text
    RETURNING attempt, version, next_seq, journal_bytes";

const READ_STEPS: &str = "
    SELECT seq, kind, state, key, body::text
      FROM abada_agent_steps WHERE run_key = $1::text ORDER BY seq";

/// The compare-and-set and the insert in one statement (one implicit transaction): the insert
/// happens exactly when the run row matched (attempt, version, next seq, running).
const APPEND: &str = "
    WITH cas AS (
        UPDATE abada_agent_runs
           SET version = version + 1, next_seq = next_seq + 1,
               journal_bytes = journal_bytes + $5::bigint, updated_at = now()
         WHERE run_key = $1::text AND attempt = $2::bigint AND version = $3::bigint
           AND next_seq = $4::bigint AND status = 'running'
        RETURNING run_key, version
    )
    INSERT INTO abada_agent_steps (run_key, seq, attempt, run_version, kind, state, key, body)
    SELECT run_key, $4::bigint, $2::bigint, version, $6::text, $7::text, $8::text, $9::text::jsonb
      FROM cas";

const DIAGNOSE: &str = "
    SELECT r.attempt, r.version, r.next_seq, r.status,
           s.attempt, s.run_version, s.kind, s.state, s.key, s.body::text
      FROM abada_agent_runs r
      LEFT JOIN abada_agent_steps s ON s.run_key = r.run_key AND s.seq = $2::bigint
     WHERE r.run_key = $1::text";

const FINISH_MARK: &str = "
    UPDATE abada_agent_runs
       SET status = $3::text, finished_at = now(), updated_at = now(), version = version + 1
     WHERE run_key = $1::text AND attempt = $2::bigint AND status = 'running'";

/// Steps go with their run (`ON DELETE CASCADE`).
const FINISH_DELETE: &str =
    "DELETE FROM abada_agent_runs WHERE run_key = $1::text AND attempt = $2::bigint";

const RUN_STATE: &str = "SELECT attempt, status FROM abada_agent_runs WHERE run_key = $1::text";

/// Queued finishes (`finishes`) with a retention of zero: each run deleted only while the
/// attempt that queued its finish still holds it (its steps go with it). `run_key = ANY($1)`
/// makes the runs an index lookup: joined on the unnested arrays alone, the generic plan scans
/// the whole primary key (every run kept) for each claim.
const FINISH_QUEUED_DELETE: &str = "
    DELETE FROM abada_agent_runs r
     USING unnest($1::text[], $2::bigint[]) AS f(run_key, attempt)
     WHERE r.run_key = ANY($1::text[]) AND r.run_key = f.run_key AND r.attempt = f.attempt";

/// Queued finishes with runs kept: each run marked only while the attempt that queued its
/// finish still holds it and it is running (an index lookup, as above).
const FINISH_QUEUED_MARK: &str = "
    UPDATE abada_agent_runs r
       SET status = f.status, finished_at = now(), updated_at = now(), version = r.version + 1
      FROM unnest($1::text[], $2::bigint[], $3::text[]) AS f(run_key, attempt, status)
     WHERE r.run_key = ANY($1::text[]) AND r.run_key = f.run_key AND r.attempt = f.attempt
       AND r.status = 'running'";

const SWEEP_FINISHED: &str = "
    DELETE FROM abada_agent_runs WHERE run_key IN (
        SELECT run_key FROM abada_agent_runs
         WHERE finished_at IS NOT NULL
           AND finished_at <= now() - $1::bigint * interval '1 millisecond'
         ORDER BY finished_at LIMIT $2::bigint
           FOR UPDATE SKIP LOCKED)";

const SWEEP_ABANDONED: &str = "
    DELETE FROM abada_agent_runs WHERE run_key IN (
        SELECT run_key FROM abada_agent_runs
         WHERE finished_at IS NULL
           AND updated_at <= now() - $1::bigint * interval '1 millisecond'
         ORDER BY updated_at LIMIT $2::bigint
           FOR UPDATE SKIP LOCKED)";

/// A pooled connection with the store's statements prepared on it.
pub(super) struct PgConn {
    pub client: Client,
    pub(crate) statements: Statements,
}

/// The store's statements, prepared on each connection when it opens.
pub(super) struct Statements {
    lock_run: Statement,
    journal_ends: Statement,
    create_run: Statement,
    resume_run: Statement,
    restart_run: Statement,
    read_steps: Statement,
    append: Statement,
    diagnose: Statement,
    finish_mark: Statement,
    finish_delete: Statement,
    run_state: Statement,
    finish_queued_delete: Statement,
    finish_queued_mark: Statement,
    sweep_finished: Statement,
    sweep_abandoned: Statement,
    locate: Statement,
}

impl Statements {
    /// Prepares them all, pipelined on the one connection.
    pub(super) async fn prepare(client: &Client) -> Result<Statements, tokio_postgres::Error> {
        let (
            lock_run,
            journal_ends,
            create_run,
            resume_run,
            restart_run,
            read_steps,
            append,
            diagnose,
            finish_mark,
            finish_delete,
            run_state,
            finish_queued_delete,
            finish_queued_mark,
            sweep_finished,
            sweep_abandoned,
            locate,
        ) = futures::try_join!(
            client.prepare(LOCK_RUN),
            client.prepare(JOURNAL_ENDS),
            client.prepare(CREATE_RUN),
            client.prepare(RESUME_RUN),
            client.prepare(RESTART_RUN),
            client.prepare(READ_STEPS),
            client.prepare(APPEND),
            client.prepare(DIAGNOSE),
            client.prepare(FINISH_MARK),
            client.prepare(FINISH_DELETE),
            client.prepare(RUN_STATE),
            client.prepare(FINISH_QUEUED_DELETE),
            client.prepare(FINISH_QUEUED_MARK),
            client.prepare(SWEEP_FINISHED),
            client.prepare(SWEEP_ABANDONED),
            client.prepare(LOCATE),
        )?;
        Ok(Statements {
            lock_run,
            journal_ends,
            create_run,
            resume_run,
            restart_run,
            read_steps,
            append,
            diagnose,
            finish_mark,
            finish_delete,
            run_state,
            finish_queued_delete,
            finish_queued_mark,
            sweep_finished,
            sweep_abandoned,
            locate,
        })
    }
}

fn attempt_of(store: &str, raw: i64) -> Result<u64, StoreError> {
    u64::try_from(raw).map_err(|_| {
        StoreError::Internal(format!(
            "the run store at {store} holds attempt {raw}, which is negative"
        ))
    })
}

/// The locked run as the admission rule reads it: `LOCK_RUN`'s row and `JOURNAL_ENDS`'s.
fn seen_of(run: &Row, ends: &Row) -> Seen {
    let first_kind: Option<String> = ends.get(0);
    let instructions: Option<String> = ends.get(1);
    let input: Option<String> = ends.get(2);
    let journaled_input = match (first_kind.as_deref(), input) {
        (Some("input"), Some(input)) => Some(InputDigest::of(
            instructions.as_deref().unwrap_or_default(),
            &input,
        )),
        _ => None,
    };
    let last_kind: Option<String> = ends.get(3);
    let last_state: Option<String> = ends.get(4);
    let tool_calls: Option<i32> = ends.get(5);
    let phase = match (last_kind, last_state) {
        (Some(kind), Some(state)) => {
            Phase::of_last_step(&kind, &state, i64::from(tool_calls.unwrap_or(0)))
        }
        _ => Phase::Working,
    };
    Seen {
        running: run.get(0),
        holder: run.get(1),
        held: run.get(2),
        journaled_input,
        journaled_definition: ends.get(6),
        phase,
    }
}

/// The claim, one transaction: performs the queued `finishes` first (`delete` with a retention
/// of zero: [`finish_queued`]), so a claim of a run whose finish was queued sees it finished, as
/// if that finish had had its own transaction before; then locks the run, lets the admission
/// rule decide, creates, resumes or begins the run again under a new attempt from the sequence,
/// writes `first_step` when the run has no step, and returns the journal. A refusal changes
/// nothing of the run claimed (the finishes it carried are committed).
pub(super) async fn claim(
    conn: &mut PgConn,
    store: &str,
    run_key: &RunKey,
    claimant: &Claimant<'_>,
    first_step: Option<(&JournalStep, StepBody)>,
    finishes: (&[PendingFinish], bool),
) -> Result<Claim, StoreError> {
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    let PgConn { client, statements } = conn;
    let tx = client.transaction().await.map_err(pg)?;
    let (finishes, delete) = finishes;
    finish_queued(&tx, statements, finishes, delete)
        .await
        .map_err(pg)?;
    let hold_ms = u64::try_from(claimant.hold.as_millis()).unwrap_or(u64::MAX);
    let asking = Asking {
        per_visit: run_key.per_visit,
        task_id: claimant.task_id,
        input: first_step
            .as_ref()
            .and_then(|(step, _)| InputDigest::of_step(step)),
        hold_ms,
    };
    let key = run_key.as_str();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
        [&key, &claimant.worker_id, &claimant.task_id];
    // Twice at most: a concurrent claim may create the run between the look and the insert,
    // and then the rule must look at it.
    let mut row = None;
    for _ in 0..2 {
        let found = tx
            .query_opt(
                &statements.lock_run,
                &[&key, &(hold_ms.min(i64::MAX as u64) as i64)],
            )
            .await
            .map_err(pg)?;
        let seen = match found {
            None => None,
            Some(run) => {
                let next_seq: i64 = run.get(3);
                let ends = tx
                    .query_one(&statements.journal_ends, &[&key, &next_seq])
                    .await
                    .map_err(pg)?;
                Some(seen_of(&run, &ends))
            }
        };
        let statement = match (admit(&asking, seen.as_ref()), seen.is_some()) {
            (Admission::Refuse(reason), _) => {
                // Commits the finishes carried; the run claimed is unchanged.
                tx.commit().await.map_err(pg)?;
                return Err(StoreError::Refused {
                    run_key: key.to_string(),
                    task_id: claimant.task_id.to_string(),
                    reason: Box::new(reason),
                });
            }
            (Admission::Begin, false) => &statements.create_run,
            (Admission::Begin, true) => &statements.restart_run,
            (Admission::Resume, _) => &statements.resume_run,
        };
        row = tx.query_opt(statement, &params).await.map_err(pg)?;
        if row.is_some() {
            break;
        }
    }
    let Some(row) = row else {
        return Err(StoreError::Unavailable {
            store: store.to_string(),
            reason: format!(
                "run {run_key} was created and deleted by concurrent claims and sweeps while this claim looked at it; try again"
            ),
        });
    };
    let attempt = attempt_of(store, row.get(0))?;
    let next_seq: i64 = row.get(2);
    let journal_bytes: i64 = row.get(3);
    let mut fence = Fence {
        run_key: run_key.clone(),
        attempt,
        version: row.get(1),
        next_seq: next_seq as u64,
        journal_bytes: journal_bytes as u64,
    };
    let steps = match (next_seq, first_step) {
        (1, Some((step, body))) => {
            // The row is locked by this transaction: the compare-and-set cannot miss.
            let params = append_params(&fence, step, &body);
            let written = tx
                .execute(&statements.append, &params.as_params())
                .await
                .map_err(pg)?;
            if written != 1 {
                return Err(StoreError::Internal(format!(
                    "run {run_key}: the first step was not written although the claim holds the run"
                )));
            }
            fence.advance(&body);
            vec![JournalStep {
                data: body.value(),
                ..step.clone()
            }]
        }
        (1, None) => Vec::new(),
        _ => {
            let rows = tx
                .query(&statements.read_steps, &[&run_key.as_str()])
                .await
                .map_err(pg)?;
            rows.iter()
                .map(|row| step_from_row(store, run_key, row))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    tx.commit().await.map_err(pg)?;
    Ok(Claim {
        created: next_seq == 1,
        fence,
        steps,
    })
}

/// The open runs `lookup` finds, newest first, at most [`MAX_OPEN_RUNS`]: one statement.
pub(super) async fn locate(
    conn: &mut PgConn,
    store: &str,
    lookup: &RunLookup<'_>,
) -> Result<Vec<OpenRun>, StoreError> {
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    // Keys starting with `{prefix}/`: from `{prefix}/` up to (not including) `{prefix}0`, '0'
    // being the byte after '/'. No prefix: an empty range.
    let (from, to) = lookup.prefix.map_or((String::new(), String::new()), |p| {
        (format!("{p}/"), format!("{p}0"))
    });
    let rows = conn
        .client
        .query(
            &conn.statements.locate,
            &[
                &lookup.keys,
                &lookup.task_id,
                &from,
                &to,
                &(MAX_OPEN_RUNS as i64),
            ],
        )
        .await
        .map_err(pg)?;
    rows.iter()
        .map(|row| {
            let kind: Option<String> = row.get(2);
            let state: Option<String> = row.get(3);
            let tool_calls: Option<i32> = row.get(4);
            let phase = match (kind, state) {
                (Some(kind), Some(state)) => {
                    Phase::of_last_step(&kind, &state, i64::from(tool_calls.unwrap_or(0)))
                }
                _ => Phase::Working,
            };
            let definition: Option<String> = row.get(5);
            Ok(OpenRun {
                run_key: row.get(0),
                holder: row.get(1),
                phase,
                // Text the store produced from a `jsonb` value: valid JSON.
                definition: definition.and_then(|d| serde_json::from_str(&d).ok()),
            })
        })
        .collect()
}

fn step_from_row(store: &str, run_key: &RunKey, row: &Row) -> Result<JournalStep, StoreError> {
    let seq: i64 = row.get(0);
    let body: String = row.get(4);
    let data = serde_json::from_str(&body).map_err(|e| {
        StoreError::Internal(format!(
            "run {run_key}: step {seq} in the run store at {store} is not valid JSON: {e}"
        ))
    })?;
    Ok(JournalStep {
        seq: seq as u64,
        kind: row.get(1),
        state: row.get(2),
        key: row.get(3),
        data,
    })
}

type Params<'a> = [&'a (dyn tokio_postgres::types::ToSql + Sync); 9];

fn append_params<'a>(
    fence: &'a Fence,
    step: &'a JournalStep,
    body: &'a StepBody,
) -> AppendParams<'a> {
    AppendParams {
        run_key: fence.run_key.as_str(),
        attempt: fence.attempt_sql(),
        version: fence.version,
        seq: step.seq as i64,
        len: body.bytes() as i64,
        kind: &step.kind,
        state: &step.state,
        key: step.key.as_deref(),
        body: &body.text,
    }
}

/// The append statement's parameters, owned long enough to borrow.
struct AppendParams<'a> {
    run_key: &'a str,
    attempt: i64,
    version: i64,
    seq: i64,
    len: i64,
    kind: &'a str,
    state: &'a str,
    key: Option<&'a str>,
    body: &'a str,
}

impl<'a> AppendParams<'a> {
    fn as_params(&'a self) -> Params<'a> {
        [
            &self.run_key,
            &self.attempt,
            &self.version,
            &self.seq,
            &self.len,
            &self.kind,
            &self.state,
            &self.key,
            &self.body,
        ]
    }
}

/// One append: the compare-and-set and the insert, then, only when they changed nothing, one
/// read that says why.
pub(super) async fn append(
    conn: &mut PgConn,
    store: &str,
    fence: &mut Fence,
    step: &JournalStep,
    body: &StepBody,
) -> Result<AppendOutcome, StoreError> {
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    let params = append_params(fence, step, body);
    let written = conn
        .client
        .execute(&conn.statements.append, &params.as_params())
        .await
        .map_err(pg)?;
    if written == 1 {
        fence.advance(body);
        return Ok(AppendOutcome::Created);
    }
    let row = conn
        .client
        .query_opt(
            &conn.statements.diagnose,
            &[&fence.run_key.as_str(), &(step.seq as i64)],
        )
        .await
        .map_err(pg)?;
    diagnose(store, fence, step, body, row)
}

/// Why an append changed nothing. A step of this attempt at that `seq`, identical, that moved
/// the run from this fence's version by exactly one, is this append's own step whose commit was
/// not acknowledged: `AlreadyPresent`, and the fence advances.
fn diagnose(
    store: &str,
    fence: &mut Fence,
    step: &JournalStep,
    body: &StepBody,
    row: Option<Row>,
) -> Result<AppendOutcome, StoreError> {
    let Some(row) = row else {
        return Err(fence.fenced(FenceReason::Gone));
    };
    let run_attempt = attempt_of(store, row.get(0))?;
    let run_version: i64 = row.get(1);
    let next_seq: i64 = row.get(2);
    let status: String = row.get(3);
    if run_attempt != fence.attempt {
        return Err(fence.fenced(FenceReason::StaleAttempt {
            current: run_attempt,
        }));
    }
    if status != "running" {
        return Err(fence.fenced(FenceReason::Finished));
    }
    let existing: Option<i64> = row.get(4);
    if let Some(step_attempt) = existing {
        let step_version: i64 = row.get(5);
        let kind: String = row.get(6);
        let state: String = row.get(7);
        let key: Option<String> = row.get(8);
        let stored: String = row.get(9);
        let stored: Option<Value> = serde_json::from_str(&stored).ok();
        let same = kind == step.kind
            && state == step.state
            && key == step.key
            && stored.as_ref() == Some(&body.value());
        if !same {
            return Err(StoreError::Conflict {
                run_key: fence.run_key.key.clone(),
                seq: step.seq,
                reason: "that seq holds a different step".into(),
            });
        }
        let own_lost_commit = step_attempt == fence.attempt_sql()
            && step_version == fence.version + 1
            && run_version == fence.version + 1;
        if own_lost_commit {
            fence.advance(body);
            return Ok(AppendOutcome::AlreadyPresent);
        }
    }
    if run_version != fence.version {
        return Err(fence.fenced(FenceReason::StaleVersion {
            expected: fence.version,
            current: run_version,
        }));
    }
    if step.seq as i64 != next_seq {
        return Err(StoreError::Conflict {
            run_key: fence.run_key.key.clone(),
            seq: step.seq,
            reason: format!("the next step of the run is seq {next_seq}: steps are contiguous"),
        });
    }
    Err(StoreError::Internal(format!(
        "run {}: the append of step {} changed nothing although the run matches it",
        fence.run_key, step.seq
    )))
}

/// Marks the run finished (or deletes it when `delete` is set). Idempotent for its attempt: a
/// retry after a lost acknowledgement finds the run finished or gone and succeeds.
pub(super) async fn finish(
    conn: &mut PgConn,
    store: &str,
    fence: &Fence,
    end: RunEnd,
    delete: bool,
) -> Result<(), StoreError> {
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    let key = fence.run_key.as_str();
    let attempt = fence.attempt_sql();
    let changed = if delete {
        conn.client
            .execute(&conn.statements.finish_delete, &[&key, &attempt])
            .await
    } else {
        conn.client
            .execute(
                &conn.statements.finish_mark,
                &[&key, &attempt, &end.status()],
            )
            .await
    }
    .map_err(pg)?;
    if changed == 1 {
        return Ok(());
    }
    let row = conn
        .client
        .query_opt(&conn.statements.run_state, &[&key])
        .await
        .map_err(pg)?;
    let Some(row) = row else {
        return Ok(()); // deleted already
    };
    let run_attempt = attempt_of(store, row.get(0))?;
    let status: String = row.get(1);
    if run_attempt != fence.attempt {
        return Err(fence.fenced(FenceReason::StaleAttempt {
            current: run_attempt,
        }));
    }
    if status != "running" {
        return Ok(()); // finished already
    }
    Err(StoreError::Internal(format!(
        "run {}: finishing changed nothing although attempt {} owns the running run",
        fence.run_key, fence.attempt
    )))
}

/// Performs queued finishes in one statement (none when `finishes` is empty): deletes the runs
/// (`delete`, a retention of zero) or marks them ended, each only while the attempt that queued
/// its finish holds it. A finish whose attempt was replaced by a newer claim, or whose run is
/// gone or finished already, matches nothing. Returns the runs changed.
pub(super) async fn finish_queued(
    client: &impl GenericClient,
    statements: &Statements,
    finishes: &[PendingFinish],
    delete: bool,
) -> Result<u64, tokio_postgres::Error> {
    if finishes.is_empty() {
        return Ok(0);
    }
    let keys: Vec<&str> = finishes.iter().map(|f| f.run_key.as_str()).collect();
    let attempts: Vec<i64> = finishes.iter().map(|f| f.attempt).collect();
    if delete {
        client
            .execute(&statements.finish_queued_delete, &[&keys, &attempts])
            .await
    } else {
        let ends: Vec<&str> = finishes.iter().map(|f| f.end.status()).collect();
        client
            .execute(&statements.finish_queued_mark, &[&keys, &attempts, &ends])
            .await
    }
}

/// Which runs a sweep deletes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sweep {
    /// Finished at least this long ago.
    Finished(std::time::Duration),
    /// Unfinished and untouched for at least this long.
    Abandoned(std::time::Duration),
}

impl Sweep {
    /// The `reason` label of `abada_agent_store_runs_deleted_total`.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Sweep::Finished(_) => "finished",
            Sweep::Abandoned(_) => "abandoned",
        }
    }
}

/// Deletes at most `batch` runs (and their steps) of one kind; one short transaction.
pub(super) async fn sweep_batch(
    conn: &mut PgConn,
    store: &str,
    sweep: Sweep,
    batch: usize,
) -> Result<u64, StoreError> {
    let (statement, age) = match sweep {
        Sweep::Finished(age) => (&conn.statements.sweep_finished, age),
        Sweep::Abandoned(age) => (&conn.statements.sweep_abandoned, age),
    };
    let age_ms = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
    conn.client
        .execute(statement, &[&age_ms, &(batch as i64)])
        .await
        .map_err(|e| classify(store, &e))
}

/// One run to finish: which run, which attempt's, how it ended, and since when it waits.
#[derive(Clone, Debug)]
pub(super) struct PendingFinish {
    pub(super) run_key: String,
    /// The fence's attempt: the finish matches the run only while this attempt holds it.
    pub(super) attempt: i64,
    pub(super) end: RunEnd,
    pub(super) queued_at: tokio::time::Instant,
}

impl PendingFinish {
    pub(super) fn of(fence: &Fence, end: RunEnd) -> PendingFinish {
        PendingFinish {
            run_key: fence.run_key().as_str().to_string(),
            attempt: i64::try_from(fence.attempt()).unwrap_or(i64::MAX),
            end,
            queued_at: tokio::time::Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fence() -> Fence {
        Fence {
            run_key: RunKey::new("t-1").unwrap(),
            attempt: 1,
            version: 2,
            next_seq: 2,
            journal_bytes: 0,
        }
    }

    fn step(seq: u64, data: Value) -> JournalStep {
        JournalStep {
            seq,
            kind: "model".into(),
            state: "finished".into(),
            key: None,
            data,
        }
    }

    #[test]
    fn run_keys_are_bounded_and_printable() {
        assert!(RunKey::new("c0a8-17").is_ok());
        assert!(RunKey::for_task(&"x".repeat(512)).is_ok());
        assert!(RunKey::new("").is_err());
        assert!(RunKey::new("x".repeat(513)).is_err());
        assert!(RunKey::new("a\0b").is_err());
        assert!(RunKey::new("a\nb").is_err());
    }

    #[test]
    fn nul_characters_become_replacement_characters_everywhere() {
        let s = step(
            2,
            json!({"text": "a\u{0}b", "list": ["\u{0}"], "k\u{0}": {"n": 1}}),
        );
        let body = StepBody::of(&s).unwrap();
        assert!(!body.text.contains("\\u0000"), "{}", body.text);
        assert_eq!(
            body.value(),
            json!({"text": "a\u{FFFD}b", "list": ["\u{FFFD}"], "k\u{FFFD}": {"n": 1}})
        );
        // An escaped backslash followed by "u0000" is text, not a NUL: left alone.
        let s = step(2, json!({"text": "\\u0000"}));
        assert_eq!(
            StepBody::of(&s).unwrap().value(),
            json!({"text": "\\u0000"})
        );
    }

    #[test]
    fn bodies_too_deep_to_read_back_are_refused() {
        let mut deep = json!("leaf");
        for _ in 0..MAX_BODY_DEPTH {
            deep = json!([deep]);
        }
        assert_eq!(depth(&deep), MAX_BODY_DEPTH);
        let body = StepBody::of(&step(2, deep.clone())).unwrap();
        assert_eq!(body.value(), deep);
        let e = StepBody::of(&step(2, json!([deep]))).unwrap_err();
        assert_eq!(e.class(), super::super::ErrorClass::Invalid);
        assert!(e.to_string().contains("deeper than 100 levels"), "{e}");
    }

    #[test]
    fn steps_the_store_cannot_hold_are_refused_before_any_connection() {
        let f = fence();
        assert!(check_step(&f.run_key, 0, &step(0, json!({}))).is_err());
        let mut bad = step(2, json!({}));
        bad.key = Some("abada:t\0:2".into());
        assert!(check_step(&f.run_key, 0, &bad).is_err());
        let e =
            check_step(&f.run_key, MAX_JOURNAL_BYTES - 2, &step(2, json!({"a": 1}))).unwrap_err();
        assert_eq!(e.class(), super::super::ErrorClass::Invalid);
        assert!(e.to_string().contains("past 33554432 bytes"), "{e}");
        assert_eq!(
            check_step(&f.run_key, 0, &step(2, json!({"a": 1})))
                .unwrap()
                .bytes(),
            7
        );
    }
}
