//! The journal of one attempt, wherever it lives (protocol.md Part B and D): the engine's
//! journal, the run store, or nowhere. One type, [`Journal`], owns the lookup of the task's run
//! in the store before any definition is read ([`Journal::locate`], `run_home`: a run found
//! lives there, whatever the latest definition says), the choice of home of a new run, opening
//! (reading the engine's journal, or claiming the run in the store: the fencing token), every
//! append (fenced by the lease; the store's retried within its patience), the keys of keyed
//! writes, and the commit of the run's end: a stored run is finished only once the engine has
//! accepted the completion ([`Journal::commit`] leaves that to the task's
//! [`AfterReport`](crate::handler::AfterReport)).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tracing::Span;

use super::approval;
use super::definition::AgentDefinition;
use super::journal::{self, Replayed};
use super::run_home::{self, Placed};
use super::run_key;
use super::scope::{Scope, Step, incident};
use crate::conversation::ToolCall;
use crate::engine::capabilities::{JournalSupport, NoJournalEvidence};
use crate::engine::{EngineError, FailureReport, JournalStep, Task, TraceParent};
use crate::handler::{AfterReport, FailureKind, Outcome, TaskEnd, TaskError, retries_unchanged};
use crate::store::{
    ClaimRefusal, Claimant, ErrorClass, Fence, OpenRun, RunEnd, RunKey, RunLookup, RunStore,
    StoreError,
};
use crate::telemetry::spans;

/// The field of a journal step's `data` holding the W3C context of the attempt that wrote it
/// (only while spans are exported), so the attempt resuming the run links to it.
pub(super) const JOURNALED_TRACE: &str = "traceparent";

/// Where this attempt journals its steps, and what it holds there.
pub(super) enum Journal {
    /// The engine's journal endpoints: an agent/1 task on an engine that has them.
    Engine,
    /// The run store: a task without `attempt` (an engine without agent/1, Part D), or a run
    /// that may wait for a person's decision across tasks.
    Store(StoreRun),
    /// Nowhere: the agent runs without durability and starts over on its next attempt.
    Nowhere(ContentKeys),
}

/// A task's run in the run store, as this attempt holds it.
pub(super) struct StoreRun {
    store: Arc<dyn RunStore>,
    /// Advanced by every append; what proves to the store that this attempt still owns the run.
    fence: Fence,
    /// This attempt's claim began the run's journal (a new run, or a visit's finished run
    /// started over): nothing was resumed.
    began: bool,
    /// The attempt stopped to ask a person: the run stays open for the task carrying the
    /// decision, whatever the engine does with this one's completion.
    awaits_decision: bool,
}

/// Without a journal: how many keyed writes of each content this attempt sent, for the `n` of
/// their content keys ([`journal::content_key`]).
#[derive(Default)]
pub(super) struct ContentKeys(HashMap<String, u32>);

/// A journal opened: where it lives, the run replayed from it, and whether it held steps of an
/// earlier attempt.
pub(super) struct Opened {
    pub(super) journal: Journal,
    pub(super) state: Replayed,
    pub(super) resumed: bool,
}

/// Where `task`'s journal lives: the one place that choice is made. A run that may wait for
/// a person's approval (`waits_across_tasks`) outlives its task, so it lives in the run store
/// under its process run key (`run_key`); the attempt refuses such a definition before this
/// when no store is configured. Otherwise a task without `attempt` is not an agent/1 task
/// (protocol.md Part B), and shows the engine speaks plain v1: its journal is in the run
/// store when one is configured, else nowhere. An agent/1 task journals to the engine
/// (authoritative there: its attempt is the engine's fencing token) unless the engine is
/// known to have no journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Home {
    Engine,
    Store,
    Nowhere,
}

fn home(scope: Scope<'_>, waits_across_tasks: bool, located: Option<&OpenRun>) -> Home {
    let rt = scope.rt;
    // A run found in the store (`run_home`) lives there, whatever the latest definition says.
    if located.is_some() && rt.store.is_some() {
        return Home::Store;
    }
    if waits_across_tasks && rt.store.is_some() {
        return Home::Store;
    }
    if scope.task.attempt.is_none() {
        if rt.store.is_some() {
            return Home::Store;
        }
        rt.capabilities
            .journal_missing(NoJournalEvidence::PlainTask);
        return Home::Nowhere;
    }
    match rt.capabilities.journal() {
        JournalSupport::Unknown | JournalSupport::Present => Home::Engine,
        JournalSupport::Absent => Home::Nowhere,
    }
}

impl Journal {
    /// Opens the task's journal where it lives: reads the engine's (linking `span` to the
    /// attempt that wrote it last), or claims the run in the store (the input step written in
    /// the claim's transaction when the run is new), and replays it.
    /// Finds the task's run in the run store before any definition is read (`run_home`): the
    /// run it resumes, with its journaled definition, or none (a new run). Every run of this
    /// task left behind is reported as orphaned. Without a store: none.
    pub(super) async fn locate(scope: Scope<'_>) -> Step<Placed> {
        let (rt, task, ctx) = (scope.rt, scope.task, scope.ctx);
        let Some(home) = rt.store.as_ref() else {
            return Ok(Placed::default());
        };
        let wanted = run_home::lookup(task);
        let lookup = RunLookup {
            keys: &wanted.keys,
            task_id: &task.id,
            prefix: wanted.prefix.as_deref(),
        };
        let since = tokio::time::Instant::now();
        let mut tries = 0;
        let open = loop {
            match ctx.fenced(home.store.locate(&lookup)).await {
                Ok(open) => break open,
                Err(e) => {
                    store_retry(
                        scope,
                        e,
                        &mut tries,
                        since,
                        "looking up the task's run in the run store",
                    )
                    .await?
                }
            }
        };
        let placed = run_home::place(task, open);
        for (run, why) in &placed.orphans {
            let reason = match why {
                run_home::Orphaned::SecondRunOfTask => "held_twice",
                run_home::Orphaned::NamedButElsewhere => "named_elsewhere",
            };
            rt.metrics.count_store_runs_orphaned(reason, 1);
            tracing::warn!(
                orphaned_run = %run.run_key,
                resumed_run = placed.run.as_ref().map_or("", |r| r.run_key.as_str()),
                "an open run of this task is left behind: {}; nobody will resume it, and the sweeper deletes it after ABADA_AGENT_STORE_ABANDONED_AFTER",
                why.as_str()
            );
        }
        if let Some(run) = &placed.run {
            tracing::debug!(run_key = %run.run_key, pinned = run.definition.is_some(), "the task's run found in the run store");
        }
        Ok(placed)
    }

    pub(super) async fn open(
        scope: Scope<'_>,
        def: &AgentDefinition,
        waits_for_approval: bool,
        located: Option<&OpenRun>,
        span: &Span,
    ) -> Step<Opened> {
        let (journal, steps) = match home(scope, waits_for_approval, located) {
            Home::Engine => match scope.ctx.read_journal().await {
                Ok(j) => {
                    scope.rt.capabilities.journal_answered();
                    if let Some(previous) = last_journaled_trace(&j.steps) {
                        spans::link_resumed_attempt(span, &previous);
                    }
                    (Journal::Engine, j.steps)
                }
                Err(TaskError::Engine(e @ EngineError::TooLarge { .. })) => {
                    return Err(incident("the task's journal is too large", e.to_string()));
                }
                Err(TaskError::Engine(EngineError::NotFound { .. })) => {
                    scope
                        .rt
                        .capabilities
                        .journal_missing(NoJournalEvidence::NotFound);
                    (Journal::Nowhere(ContentKeys::default()), Vec::new())
                }
                Err(e) => return Err(scope.call_failed(e, "could not read the task's journal")),
            },
            Home::Store => {
                let (run, steps) = claim(scope, def, waits_for_approval, located).await?;
                (Journal::Store(run), steps)
            }
            Home::Nowhere => (Journal::Nowhere(ContentKeys::default()), Vec::new()),
        };
        // SIM-BUG (feature `sim-bugs`, selected at run time): a journal whose input step
        // carries no definition (the previous release's) replayed from its input step alone.
        #[cfg(feature = "sim-bugs")]
        let steps = if crate::sim_bugs::active(crate::sim_bugs::Bug::OldJournalFromInput)
            && steps.first().is_some_and(|s| {
                s.kind == journal::KIND_INPUT && s.data.get("definition").is_none()
            }) {
            steps[..1].to_vec()
        } else {
            steps
        };
        let state = Replayed::from_steps(&steps).map_err(|e| {
            let what = match journal {
                Journal::Store(_) => "the task's journal in the run store cannot be resumed",
                _ => "the task's journal cannot be resumed",
            };
            incident(what, e.to_string())
        })?;
        // A store claim writes the input step of a run it begins in the same transaction: that
        // step is no resumption.
        let resumed = match &journal {
            Journal::Store(run) => !run.began,
            _ => state.turns > 0 || state.input.is_some(),
        };
        Ok(Opened {
            journal,
            state,
            resumed,
        })
    }

    /// Whether the journal is kept in the run store.
    pub(super) fn in_store(&self) -> bool {
        matches!(self, Journal::Store(_))
    }

    /// The run's key in the store, when it is kept there.
    pub(super) fn run_key(&self) -> Option<&RunKey> {
        match self {
            Journal::Store(run) => Some(run.fence.run_key()),
            _ => None,
        }
    }

    /// The attempt stops to ask a person: its run stays open for the task carrying the
    /// decision.
    pub(super) fn await_decision(&mut self) {
        if let Journal::Store(run) = self {
            run.awaits_decision = true;
        }
    }

    /// The idempotency key of a keyed write about to be journaled at `seq`: `abada:{task}:{seq}`
    /// with a journal; without one, derived from the call's content (so the same write re-sent
    /// by a run that starts over keeps its key).
    pub(super) fn write_key(
        &mut self,
        task_id: &str,
        seq: u64,
        call: &ToolCall,
        arguments: &serde_json::Map<String, Value>,
    ) -> String {
        match self {
            Journal::Nowhere(ContentKeys(identical)) => {
                let args = Value::Object(arguments.clone());
                let probe = journal::content_key(task_id, &call.server, &call.tool, &args, 0);
                let n = identical.entry(probe).or_insert(0);
                *n += 1;
                journal::content_key(task_id, &call.server, &call.tool, &args, *n)
            }
            _ => journal::write_key(task_id, seq),
        }
    }

    /// Appends `step` where the journal lives, fenced by the lease (the store's by this
    /// attempt's claim as well).
    pub(super) async fn append(&mut self, scope: Scope<'_>, step: &JournalStep) -> Step {
        match self {
            Journal::Engine => scope
                .ctx
                .append_journal(step)
                .await
                .map(|_| ())
                .map_err(|e| scope.call_failed(e, &format!("could not journal step {}", step.seq))),
            Journal::Store(run) => run.append(scope, step).await,
            Journal::Nowhere(_) => Ok(()),
        }
    }

    /// Commits the run's end with the attempt's `outcome`: a stored run that completed (or
    /// ended in a BPMN error) and does not wait for a decision is finished once the engine has
    /// accepted that outcome, not before: a completion the engine never got must find the run,
    /// final answer included, next time.
    pub(super) fn commit(self, scope: Scope<'_>, outcome: &Outcome) {
        let Journal::Store(run) = self else {
            return;
        };
        let end = match outcome {
            Outcome::Complete { .. } => RunEnd::Completed,
            Outcome::BpmnError(_) => RunEnd::Failed,
            _ => return,
        };
        if run.awaits_decision {
            return;
        }
        // SIM-BUG (feature `sim-bugs`, selected at run time): the run finished before the
        // engine accepted the outcome.
        #[cfg(feature = "sim-bugs")]
        if crate::sim_bugs::active(crate::sim_bugs::Bug::StoreFinishBeforeComplete) {
            let (store, fence) = (run.store, run.fence);
            tokio::spawn(async move { store.finish(&fence, end).await });
            return;
        }
        scope.ctx.after_report(Box::new(FinishRun {
            store: run.store,
            fence: run.fence,
            end,
            backoff: scope.rt.settings.store_backoff,
            random: scope.rt.random.clone(),
        }));
    }
}

impl StoreRun {
    /// Appends `step` to the run in the store, fenced by this attempt's claim; a transient
    /// failure is retried with the same fence and step (a write whose acknowledgement was lost
    /// is recognised) for as long as the store's patience allows.
    async fn append(&mut self, scope: Scope<'_>, step: &JournalStep) -> Step {
        let since = tokio::time::Instant::now();
        let mut tries = 0;
        loop {
            let result = scope
                .ctx
                .fenced(self.store.append(&mut self.fence, step))
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(e) => {
                    let what = format!("journaling step {} in the run store", step.seq);
                    store_retry(scope, e, &mut tries, since, &what).await?
                }
            }
        }
    }
}

/// A stored run to finish once the engine accepted its end.
struct FinishRun {
    store: Arc<dyn RunStore>,
    fence: Fence,
    end: RunEnd,
    backoff: crate::backoff::Backoff,
    random: crate::random::Random,
}

#[async_trait]
impl AfterReport for FinishRun {
    /// Finishes the run when the engine accepted the completion (or BPMN error): the worker's
    /// store queues the finish to ride with its next claim transaction (`store/finishes.rs`),
    /// fenced by this attempt; a store that cannot take it gets a few quick tries, then it is
    /// left to the sweeper (`ABADA_AGENT_STORE_ABANDONED_AFTER`); the task itself is done
    /// either way. Any other end keeps the run for the next attempt.
    async fn reported(self: Box<Self>, end: TaskEnd) {
        if !matches!(end, TaskEnd::Completed | TaskEnd::BpmnError) {
            return;
        }
        for tries in 0..3u32 {
            match self.store.finish(&self.fence, self.end).await {
                Ok(()) => return,
                Err(e) if e.is_transient() && tries < 2 => {
                    tokio::time::sleep(self.backoff.delay(tries, &self.random)).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the task ended but its run could not be finished in the run store; the sweeper deletes it once it is idle for ABADA_AGENT_STORE_ABANDONED_AFTER");
                    return;
                }
            }
        }
    }
}

/// Claims the task's run in the store (the fencing token of this attempt) and returns the
/// journal so far; the input step is written in the claim's transaction when the run is new.
/// The store's admission rule decides whether this task may take the run at all (its input
/// must equal the journaled one; a visit's run held by another live task is not taken): a
/// refusal is an incident that performed nothing.
async fn claim(
    scope: Scope<'_>,
    def: &AgentDefinition,
    waits_for_approval: bool,
    located: Option<&OpenRun>,
) -> Step<(StoreRun, Vec<JournalStep>)> {
    let (rt, task, ctx) = (scope.rt, scope.task, scope.ctx);
    let home = rt
        .store
        .as_ref()
        .expect("the store home is chosen only with a store");
    // A run found in the store keeps its key. A new run that may wait for approval is keyed
    // by its process visit, so the task carrying the decision finds it; any other by its task.
    let run_key = match located {
        Some(run) if run.run_key == task.id => RunKey::for_task(&task.id),
        Some(run) => RunKey::for_visit(run.run_key.clone()),
        None if waits_for_approval => {
            let key = run_key::run_key(task, def.loop_counter_variable.as_deref())
                .map_err(|e| incident("the task cannot wait for approval", e.to_string()))?;
            RunKey::for_visit(key)
        }
        None => RunKey::for_task(&task.id),
    }
    .map_err(|e| incident("the task cannot be kept in the run store", e.to_string()))?;
    let waits_for_approval = run_key.is_per_visit();
    let first_step = |def: &AgentDefinition| -> Step<JournalStep> {
        let (instructions, input) = def
            .render(&task.variables)
            .map_err(|e| incident("the agent definition cannot be used", e.to_string()))?;
        // Stamped with the run's start, so the wall-clock limit (maxDurationMs) counts from the
        // task's first start on every attempt, as with the engine's journal. Not for a visit's
        // run: the wait for a person's decision is no agent time, so its limit counts per task.
        let first = if waits_for_approval {
            journal::input_step(1, &instructions, &input)
        } else {
            journal::started_input_step(1, &instructions, &input, std::time::SystemTime::now())
        };
        Ok(journal::with_definition(first, def))
    };
    let mut first = first_step(def)?;
    // Set once the input is rendered from the run's journaled definition instead of the one
    // offered (a redeployment since the run began).
    let mut rendered_from_journal = false;
    // Another task holds a visit's run against this one for a lock duration after its latest
    // claim or write: as long as the engine lets a silent worker keep its task.
    let claimant = Claimant {
        worker_id: &home.worker_id,
        task_id: &task.id,
        hold: home.patience,
    };
    let since = tokio::time::Instant::now();
    let mut tries = 0;
    loop {
        let claimed = ctx
            .fenced(home.store.claim(&run_key, &claimant, Some(&first)))
            .await;
        match claimed {
            Ok(claim) => {
                tracing::debug!(
                    run_attempt = claim.fence.attempt(),
                    steps = claim.steps.len(),
                    "run claimed in the run store"
                );
                waiting_run_not_lost(task, def, &run_key, &claim.steps)?;
                let run = StoreRun {
                    store: home.store.clone(),
                    began: claim.created,
                    fence: claim.fence,
                    awaits_decision: false,
                };
                return Ok((run, claim.steps));
            }
            Err(TaskError::Engine(e @ StoreError::Refused { .. })) => {
                // A resumed run renders its input from the definition it journaled, not from a
                // redeployment since (`bpmn::journaled_definition_to_render`); once.
                if let StoreError::Refused { reason, .. } = &e
                    && let ClaimRefusal::InputDiffers {
                        journaled_definition: Some(journaled),
                        ..
                    } = reason.as_ref()
                    && !rendered_from_journal
                    && let Some(own) = super::bpmn::journaled_definition_to_render(journaled, def)
                {
                    let own = own.map_err(|e| {
                        incident(
                            "the run's journaled agent definition cannot be used",
                            e.to_string(),
                        )
                    })?;
                    first = first_step(&own)?;
                    rendered_from_journal = true;
                    continue;
                }
                return Err(refused_claim(&e));
            }
            Err(e) => {
                store_retry(
                    scope,
                    e,
                    &mut tries,
                    since,
                    "claiming the run in the run store",
                )
                .await?
            }
        }
    }
}

/// A task that says it carries the decision for a run waiting in the store (its status
/// variable `approval-required`, its request naming this run key) whose run holds no approval
/// step at all: the conversation that waited is gone (deleted as abandoned after
/// `ABADA_AGENT_STORE_ABANDONED_AFTER`, or the store was replaced). Starting over would ask the
/// model again and could repeat the writes made before the stop under new keys, so the task
/// becomes an incident instead, having performed nothing.
fn waiting_run_not_lost(
    task: &Task,
    def: &AgentDefinition,
    run_key: &RunKey,
    steps: &[JournalStep],
) -> Step<()> {
    let vars = &def.approval_variables;
    // The run the request names: this one, or (when this task's run is kept elsewhere, its
    // definition changed since) any visit of this node.
    let node = run_home::lookup(task).prefix;
    let names_this_node = |k: &str| {
        k == run_key.as_str()
            || node.as_deref().is_some_and(|p| {
                k == p || k.strip_prefix(p).is_some_and(|r| r.starts_with("/loop/"))
            })
    };
    let says_waiting = task
        .variables
        .get(&vars.status)
        .and_then(Value::as_str)
        .is_some_and(|s| s == approval::STATUS_APPROVAL_REQUIRED)
        && task
            .variables
            .get(&vars.request)
            .and_then(|r| r.get("runKey"))
            .and_then(Value::as_str)
            .is_some_and(names_this_node);
    if !says_waiting || steps.iter().any(|s| s.kind == journal::KIND_APPROVAL) {
        return Ok(());
    }
    // SIM-BUG (feature `sim-bugs`, selected at run time): a conversation gone unnoticed.
    #[cfg(feature = "sim-bugs")]
    if crate::sim_bugs::active(crate::sim_bugs::Bug::RunHomeFromLatest)
        || crate::sim_bugs::active(crate::sim_bugs::Bug::RedeployHole)
    {
        return Ok(());
    }
    Err(incident(
        "the conversation waiting for this approval is gone from the run store",
        format!(
            "the task's {status} is {required:?} and its {request} names run {run_key}, but the \
             run store holds no approval request for that run: it was deleted as abandoned \
             (ABADA_AGENT_STORE_ABANDONED_AFTER) or the store was replaced. Nothing was \
             performed; starting over could repeat the writes made before the stop. To start \
             the conversation over anyway, set {status} to another value and retry the task",
            status = vars.status,
            required = approval::STATUS_APPROVAL_REQUIRED,
            request = vars.request,
        ),
    ))
}

/// The incident of a claim the store's admission rule refused; the run stays with its holder.
fn refused_claim(e: &StoreError) -> Outcome {
    let StoreError::Refused { reason, .. } = e else {
        return incident("the run store refused the claim", e.to_string());
    };
    match reason.as_ref() {
        ClaimRefusal::InputDiffers { .. } => incident(
            "the task's input differs from the conversation kept under its run key",
            format!(
                "{e}. Resuming would continue another conversation: another visit of the node \
                 holds the run (the process came back to the node while the run waits for a \
                 decision, and the definition has no loopCounterVariable), or the variables the \
                 definition's instructions and input read changed since the run began. Nothing \
                 was performed. Give the node a loopCounterVariable that tells its visits apart, \
                 or restore the variables; a run left alone is deleted after \
                 ABADA_AGENT_STORE_ABANDONED_AFTER, and a retry after that starts over"
            ),
        ),
        ClaimRefusal::HeldByAnotherTask { .. } => incident(
            "another live task holds the conversation of this node visit",
            format!(
                "{e}: two tokens reached the node at once (parallel branches, a multi-instance \
                 node) and would share one conversation. Nothing was performed. Give the node a \
                 loopCounterVariable that tells the tokens apart; a retry once the other task \
                 has ended, or has been silent for a lock duration, takes the run"
            ),
        ),
    }
}

/// What a failed run-store call means: `Ok` to try again (after a backoff), `Err` to end.
/// A refusal (another attempt claimed the run) has marked the lease lost: silence. An outage or
/// a full pool is waited out within the store's patience (the lock duration), then the task
/// is given back with its retries unchanged; a result whose steps could not be journaled is
/// never reported.
async fn store_retry(
    scope: Scope<'_>,
    e: TaskError<StoreError>,
    tries: &mut u32,
    since: tokio::time::Instant,
    what: &str,
) -> Step {
    let (rt, task, ctx) = (scope.rt, scope.task, scope.ctx);
    let e = match e {
        TaskError::LeaseLost(_) => return Err(Outcome::Abandoned),
        TaskError::Engine(e) => e,
    };
    match e.class() {
        ErrorClass::Transient | ErrorClass::Misconfigured => {}
        ErrorClass::Invalid => {
            return Err(incident(
                "the run store cannot keep this run",
                format!("{what}: {e}"),
            ));
        }
        ErrorClass::Refused => return Err(refused_claim(&e)),
        ErrorClass::Fenced | ErrorClass::Conflict | ErrorClass::Internal => {
            return Err(scope.technical(format!("{what} failed: {e}")));
        }
    }
    let patience = rt.store.as_ref().map_or(Duration::ZERO, |h| h.patience);
    if since.elapsed() >= patience {
        tracing::warn!(error = %e, waited_ms = since.elapsed().as_millis() as u64, "{what} failed for longer than the lock duration; the task is given back without consuming a retry");
        return Err(Outcome::Failure {
            kind: FailureKind::Deferred,
            report: FailureReport {
                error_message: "the run store is unavailable; the attempt is deferred".into(),
                error_details: format!("{what}: {e}"),
                retries: retries_unchanged(task),
                retry_timeout: rt.settings.technical_retry.delay(0, &rt.random),
            },
        });
    }
    let wait = rt.settings.store_backoff.delay(*tries, &rt.random);
    *tries = tries.saturating_add(1);
    tracing::debug!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying");
    // Biased: a lost lease first (silence outranks a release), then the stop, then the retry.
    tokio::select! {
        biased;
        _ = ctx.lease().lost() => Err(Outcome::Abandoned),
        _ = ctx.stopped() => Err(Outcome::released(
            task,
            "the worker shut down before the agent finished; another worker resumes it from the run store",
        )),
        _ = tokio::time::sleep(wait) => Ok(()),
    }
}

/// The context of the attempt that wrote the last step with one.
fn last_journaled_trace(steps: &[JournalStep]) -> Option<TraceParent> {
    steps.iter().rev().find_map(|s| {
        s.data
            .get(JOURNALED_TRACE)?
            .as_str()
            .and_then(TraceParent::parse)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused claim ends the task as an incident (no retry) that says why and what to do.
    #[test]
    fn a_refused_claim_is_an_incident_that_says_what_to_do() {
        let digest = crate::store::InputDigest::of;
        let cases = [
            (
                ClaimRefusal::HeldByAnotherTask {
                    holder: "t-1".into(),
                    hold_ms: 30_000,
                },
                ["another live task holds", "task t-1", "loopCounterVariable"],
            ),
            (
                ClaimRefusal::InputDiffers {
                    journaled: Some(digest("i", "o-1")),
                    offered: digest("i", "o-2"),
                    journaled_definition: None,
                },
                ["input differs", "sha256:", "loopCounterVariable"],
            ),
        ];
        for (reason, needles) in cases {
            let e = StoreError::Refused {
                run_key: "process/pi-1/refundAgent".into(),
                task_id: "t-2".into(),
                reason: Box::new(reason),
            };
            let Outcome::Failure { kind, report } = refused_claim(&e) else {
                panic!("not a failure")
            };
            assert_eq!(kind, FailureKind::Incident);
            assert_eq!(report.retries, 0);
            for needle in needles {
                assert!(
                    report.error_message.contains(needle),
                    "{needle}: {report:?}"
                );
            }
            assert!(report.error_details.contains("task t-2"), "{report:?}");
        }
    }
}
