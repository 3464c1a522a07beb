//! One attempt of an agent run: resolve the definition, replay the journal, then loop (run the
//! pending tool calls, call the model, journal its answer) until a final answer, a limit, an
//! error, a stop request or a lost lease; close every MCP session on the way out.
//!
//! Internally every step returns `Result<_, Outcome>`: `Err` carries the outcome that ends the
//! attempt, so `?` ends it from anywhere.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tracing::{Instrument, Span};

use super::approval::{self, ApprovalRules, NoWaitingPlace};
use super::bpmn::{self, ResolveError};
use super::definition::AgentDefinition;
use super::journal::{self, ApprovalState, PendingCall, Replayed};
use super::limits::{self, LimitExceeded, Limits};
use super::{AgentRuntime, JournalHome, RunStoreHome, run_key};
use crate::conversation::{ToolCall, ToolResult, ToolSpec, Usage};
use crate::engine::capabilities::NoJournalEvidence;
use crate::engine::{EngineError, FailureReport, JournalStep, Task, TraceParent};
use crate::handler::{
    FailureKind, Outcome, TaskContext, TaskError, retries_consumed, retries_unchanged,
};
use crate::metrics::ToolLabels;
use crate::metrics::labels::DeclaredNames;
use crate::provider::CallAttempt;
use crate::provider::ModelRequest;
use crate::provider::fallback::{ModelCallError, call_models};
use crate::secret::Secret;
use crate::store::{
    ClaimRefusal, Claimant, ErrorClass, Fence, RunEnd, RunKey, RunStore, StoreError,
};
use crate::telemetry::spans;
use crate::tools::registry::ToolRegistry;
use crate::tools::{CredentialError, CredentialSource, TaskTools, ToolError, ToolSessions};

type Step<T = ()> = Result<T, Outcome>;
type StepFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Step<T>> + Send + 'a>>;

/// Runs one attempt of the task to its outcome, inside its `invoke_agent` span.
pub(super) async fn run(rt: &AgentRuntime, task: &Task, ctx: &TaskContext) -> Outcome {
    let def = match rt.bpmn.resolve(task, ctx, rt.agents_file.as_ref()).await {
        Ok(d) => d,
        Err(e) => {
            let span = spans::invoke_unknown_agent(&task.id, task.trace_parent.as_ref());
            let outcome = span.in_scope(|| match e {
                ResolveError::Engine { what, source } => call_failed(rt, task, source, &what),
                e => incident("the agent definition cannot be used", e.to_string()),
            });
            spans::record_attempt_end(&span, outcome.end().as_str(), Some("definition"), 0, 0, 0);
            return outcome;
        }
    };
    // Which calls wait for a person: the definition's approval and that of each tool server it
    // uses in the operator's registry. Approval needs a place for the conversation to wait
    // across tasks (agent::approval): the run store, nothing else.
    let approval = approval_rules(rt, &def);
    if approval.may_stop() && rt.store.is_none() {
        let refused = NoWaitingPlace {
            agent: def.name.clone(),
        };
        return incident("the agent definition cannot be used", refused.to_string());
    }
    let first = def.models.first();
    let provider = first.map(|m| {
        rt.providers
            .get(&m.provider)
            .and_then(|p| p.semconv_name())
            .unwrap_or(&m.provider)
    });
    let span = spans::invoke_agent(&spans::AgentSpan {
        agent: &def.name,
        provider,
        model: first.map(|m| m.model.as_str()),
        task_id: &task.id,
        process_instance_id: task.process_instance_id.as_deref(),
        attempt: task.attempt,
        parent: task.trace_parent.as_ref(),
    });
    let mut resumed_steps = 0;
    let mut tokens = (0, 0);
    let outcome = async {
        let mut attempt = match Attempt::start(rt, task, ctx, def, approval, span.clone()).await {
            Ok(a) => a,
            Err(outcome) => return outcome,
        };
        resumed_steps = attempt.state.next_seq - 1;
        let before = attempt.state.usage;
        // The wall-clock deadline (`maxDurationMs`) bounds everything the attempt does, a model
        // or tool call in flight included: dropping the loop there is what a crash would do, and
        // the journal already holds every step that counts (a started keyed write keeps its key).
        let deadline = attempt.deadline;
        let outcome = tokio::select! {
            r = attempt.drive() => match r {
                Ok(()) => unreachable!("drive only ends with an outcome"),
                Err(outcome) => outcome,
            },
            _ = tokio::time::sleep_until(deadline.at) => limit_reached(&attempt.def, LimitExceeded::Duration {
                limit_ms: duration_ms(attempt.limits.max_duration),
                elapsed_ms: duration_ms(deadline.elapsed_before + deadline.started.elapsed()),
            }),
        };
        attempt.tools.close().await;
        let after = attempt.state.usage;
        tokens = (
            after.input_tokens.saturating_sub(before.input_tokens),
            after.output_tokens.saturating_sub(before.output_tokens),
        );
        let run_end = match &outcome {
            Outcome::Complete { .. } => Some(RunEnd::Completed),
            Outcome::BpmnError(_) => Some(RunEnd::Failed),
            _ => None,
        };
        // A run that stopped for approval is not finished: the task that carries the decision
        // claims it again by its run key and goes on.
        let run_end = run_end.filter(|_| !attempt.waiting_for_approval);
        if let (Some(run), Some(run_end)) = (attempt.store_run.take(), run_end) {
            // Finished once the engine accepts the outcome (`TaskHandler::ended`), not before: a
            // completion the engine never got must find the run, final answer included, next
            // time.
            rt.finishing
                .lock()
                .expect("finishing lock poisoned")
                .insert(ctx.lease().id(), (run.store, run.fence, run_end));
        }
        outcome
    }
    .instrument(span.clone())
    .await;
    spans::record_attempt_end(
        &span,
        outcome.end().as_str(),
        attempt_error_type(&outcome),
        tokens.0,
        tokens.1,
        resumed_steps,
    );
    outcome
}

/// Which calls of `def` wait for a person: its own approval and that of each registry server it
/// uses (the operator's floor, which no definition lowers).
fn approval_rules(rt: &AgentRuntime, def: &AgentDefinition) -> ApprovalRules {
    ApprovalRules {
        definition: def.approval.clone(),
        servers: rt
            .tool_registry
            .as_deref()
            .map(|r| r.approval_policies(&def.tool_servers))
            .unwrap_or_default(),
    }
}

/// The `error.type` of an attempt span: none for an outcome that is no error of the attempt
/// (completed, a BPMN error the agent chose, deferred, released at shutdown).
fn attempt_error_type(outcome: &Outcome) -> Option<&'static str> {
    match outcome {
        Outcome::Complete { .. } | Outcome::BpmnError(_) => None,
        Outcome::Failure { kind, .. } => match kind {
            FailureKind::Technical => Some("technical"),
            FailureKind::Incident => Some("incident"),
            FailureKind::Deferred | FailureKind::Released => None,
        },
        Outcome::Abandoned => Some("lease_lost"),
    }
}

/// A task's run in the run store, as this attempt holds it.
struct StoreRun {
    store: Arc<dyn RunStore>,
    /// Advanced by every append; what proves to the store that this attempt still owns the run.
    fence: Fence,
    /// This attempt's claim began the run's journal (a new run, or a visit's finished run
    /// started over): nothing was resumed.
    began: bool,
}

/// Finishes a run after the engine accepted its end: a few quick tries, then it is left to the
/// sweeper (`ABADA_AGENT_STORE_ABANDONED_AFTER`); the task itself is done either way.
pub(super) async fn finish_in_store(
    rt: &AgentRuntime,
    store: &dyn RunStore,
    fence: &Fence,
    end: RunEnd,
) {
    for tries in 0..3u32 {
        match store.finish(fence, end).await {
            Ok(()) => return,
            Err(e) if e.is_transient() && tries < 2 => {
                tokio::time::sleep(rt.settings.store_backoff.delay(tries)).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the task ended but its run could not be finished in the run store; the sweeper deletes it once it is idle for ABADA_AGENT_STORE_ABANDONED_AFTER");
                return;
            }
        }
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// When the task must be over, on this process's clock.
#[derive(Clone, Copy, Debug)]
struct Deadline {
    at: tokio::time::Instant,
    /// When this attempt started, and how long the task had run before it (by the wall clock
    /// of the journal's `startedAtMs`).
    started: tokio::time::Instant,
    elapsed_before: Duration,
}

impl Deadline {
    fn new(limit: Duration, started_at_ms: Option<u64>, now: std::time::SystemTime) -> Self {
        // A clock that went back (or a journal without the stamp) counts as no time spent.
        let elapsed_before = started_at_ms.map_or(Duration::ZERO, |ms| {
            now.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .saturating_sub(Duration::from_millis(ms))
        });
        let started = tokio::time::Instant::now();
        Deadline {
            at: started + limit.saturating_sub(elapsed_before),
            started,
            elapsed_before,
        }
    }
}

/// The engine's tool-credential call for this task's lease (protocol.md B.3).
struct LeaseCredentials {
    ctx: TaskContext,
}

#[async_trait]
impl CredentialSource for LeaseCredentials {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        self.ctx
            .tool_credential(server)
            .await
            .map(|c| Some(c.token))
            .map_err(|e| match e {
                TaskError::LeaseLost(_) => CredentialError::LeaseLost {
                    server: server.to_string(),
                },
                TaskError::Engine(e) => CredentialError::Transient {
                    server: server.to_string(),
                    reason: e.to_string(),
                },
            })
    }
}

struct Attempt<'a> {
    rt: &'a AgentRuntime,
    task: &'a Task,
    ctx: &'a TaskContext,
    def: AgentDefinition,
    /// The definition's limits under the worker's ceilings.
    limits: Limits,
    deadline: Deadline,
    /// When this attempt started (the run's start when it journals its input step).
    started_at: std::time::SystemTime,
    state: Replayed,
    /// Where this attempt journals its steps (nowhere when the engine turned out to have no
    /// journal).
    journal: JournalHome,
    /// The run in the store, when the journal is there.
    store_run: Option<StoreRun>,
    tools: Box<dyn ToolSessions>,
    specs: Option<Vec<ToolSpec>>,
    /// The model and tool names this task may label metrics with.
    names: DeclaredNames,
    /// Model requests of this attempt that produced no journaled answer (failed, retried).
    unanswered_model_calls: u32,
    /// Without a journal: how many keyed writes of each content this attempt sent, for the `n`
    /// of their content keys ([`journal::content_key`]).
    identical_writes: std::collections::HashMap<String, u32>,
    traceparent: Option<String>,
    /// This attempt's `invoke_agent` span: its context is journaled with every step, so the
    /// attempt that resumes this run can link to it.
    span: Span,
    /// How the tool call running now was last counted, for its span's end.
    last_tool_outcome: Option<&'static str>,
    /// Which calls wait for a person's decision (the definition's and its servers' policies).
    approval: ApprovalRules,
    /// Set when this attempt completes the task to ask a person (the run stays open).
    waiting_for_approval: bool,
}

impl<'a> Attempt<'a> {
    async fn start(
        rt: &'a AgentRuntime,
        task: &'a Task,
        ctx: &'a TaskContext,
        def: AgentDefinition,
        approval: ApprovalRules,
        span: Span,
    ) -> Step<Attempt<'a>> {
        let mut store_run = None;
        let waits = approval.may_stop();
        let (state, journal) = match rt.journal_home(task, waits) {
            JournalHome::Engine => match ctx.read_journal().await {
                Ok(j) => {
                    rt.capabilities.journal_answered();
                    if let Some(previous) = last_journaled_trace(&j.steps) {
                        spans::link_resumed_attempt(&span, &previous);
                    }
                    match Replayed::from_steps(&j.steps) {
                        Ok(r) => (r, JournalHome::Engine),
                        Err(e) => {
                            return Err(incident(
                                "the task's journal cannot be resumed",
                                e.to_string(),
                            ));
                        }
                    }
                }
                Err(TaskError::Engine(e @ EngineError::TooLarge { .. })) => {
                    return Err(incident("the task's journal is too large", e.to_string()));
                }
                Err(TaskError::Engine(EngineError::NotFound { .. })) => {
                    rt.capabilities.journal_missing(NoJournalEvidence::NotFound);
                    (Replayed::empty(), JournalHome::Nowhere)
                }
                Err(e) => {
                    return Err(call_failed(
                        rt,
                        task,
                        e,
                        "could not read the task's journal",
                    ));
                }
            },
            JournalHome::Store => {
                let home = rt
                    .store
                    .as_ref()
                    .expect("the store home is chosen only with a store");
                let (run, steps) = claim_in_store(rt, home, task, ctx, &def, waits).await?;
                store_run = Some(run);
                match Replayed::from_steps(&steps) {
                    Ok(r) => (r, JournalHome::Store),
                    Err(e) => {
                        return Err(incident(
                            "the task's journal in the run store cannot be resumed",
                            e.to_string(),
                        ));
                    }
                }
            }
            JournalHome::Nowhere => (Replayed::empty(), JournalHome::Nowhere),
        };
        // A store claim writes the input step of a run it begins in the same transaction: that
        // step is no resumption.
        let resumed = match &store_run {
            Some(run) => !run.began,
            None => state.turns > 0 || state.input.is_some(),
        };
        if resumed {
            tracing::info!(
                resumed_steps = state.next_seq - 1,
                turns = state.turns,
                pending_tool_calls = state.pending.len(),
                "resuming the agent run from its journal"
            );
        }
        // A run started on a BPMN definition keeps it: the engine serves only the latest
        // version, and a redeployment must not change a running run's agent.
        let (def, approval) = match &state.definition {
            Some(snapshot) => {
                let def = bpmn::from_journal_snapshot(snapshot).map_err(|e| {
                    incident(
                        "the run's journaled agent definition cannot be used",
                        e.to_string(),
                    )
                })?;
                let approval = approval_rules(rt, &def);
                (def, approval)
            }
            None => (def, approval),
        };
        // Which servers, at which URL, with which credential: the registry decides; the
        // definition only names them. Nothing is sent to a server that fails here.
        let servers = ToolRegistry::resolve(
            rt.tool_registry.as_deref(),
            &def.tool_servers,
            task.attempt.is_some(),
        )
        .map_err(|e| {
            incident(
                "a tool server of the agent definition cannot be used",
                e.to_string(),
            )
        })?;
        let credentials = servers.credentials(Arc::new(LeaseCredentials { ctx: ctx.clone() }));
        let unregistered = servers.unregistered();
        let limits = Limits::resolve(
            def.limits,
            def.max_turns,
            def.token_budget,
            def.max_output_tokens,
            &rt.ceilings,
        );
        let started_at = std::time::SystemTime::now();
        let deadline = Deadline::new(limits.max_duration, state.started_at_ms, started_at);
        // Tool servers of the worker's registry, once it exists, are declared here too.
        let names = DeclaredNames::of_definition(
            &def.models,
            def.tool_servers.iter().map(|s| s.name.as_str()),
        );
        let traceparent = task.trace_parent.as_ref().map(|t| t.child_header());
        let tools = rt.tools.sessions(TaskTools {
            servers: servers.servers,
            credentials: Arc::new(credentials),
            traceparent: traceparent.clone(),
            cleanup: ctx.cleanup().clone(),
            unregistered,
        });
        Ok(Attempt {
            rt,
            task,
            ctx,
            def,
            limits,
            deadline,
            started_at,
            state,
            journal,
            store_run,
            tools,
            specs: None,
            names,
            unanswered_model_calls: 0,
            identical_writes: std::collections::HashMap::new(),
            traceparent,
            span,
            last_tool_outcome: None,
            approval,
            waiting_for_approval: false,
        })
    }

    /// The loop; ends only with `Err(outcome)`.
    async fn drive(&mut self) -> Step {
        if self.state.input.is_none() {
            let (instructions, input) = self
                .def
                .render(&self.task.variables)
                .map_err(|e| incident("the agent definition cannot be used", e.to_string()))?;
            let seq = self.state.next_seq;
            let step = journal::started_input_step(seq, &instructions, &input, self.started_at);
            self.journal(journal::with_definition(step, &self.def))
                .await?;
        }
        loop {
            self.boundary()?;
            if let Some(answer) = self.state.final_answer.clone() {
                return Err(self.complete(&answer));
            }
            if let Some(next) = self.state.pending.first().cloned() {
                if self.boxed_gate(&next).await? {
                    self.boxed_tool_call(next).await?;
                }
                continue;
            }
            self.boxed_model_call().await?;
        }
    }

    // The loop's steps are built on the heap by these plain functions: a debug build gives an
    // async fn's frame a slot for every future it awaits, so awaiting them inline would stack
    // the gate's, the tool call's and the model call's state machines into one frame of the
    // loop (over a megabyte along one task's poll chain, past a test thread's 2 MiB).
    fn boxed_gate<'s>(&'s mut self, next: &'s PendingCall) -> StepFuture<'s, bool> {
        Box::pin(self.approval_gate(next))
    }

    fn boxed_tool_call(&mut self, next: PendingCall) -> StepFuture<'_, ()> {
        Box::pin(self.run_tool_call(next))
    }

    fn boxed_model_call(&mut self) -> StepFuture<'_, ()> {
        Box::pin(self.call_model())
    }

    /// A step boundary: stop here when the lease is gone or the worker is shutting down.
    fn boundary(&self) -> Step {
        if self.ctx.lease().is_lost() {
            return Err(Outcome::Abandoned);
        }
        if self.ctx.stop_requested() {
            return Err(Outcome::released(
                self.task,
                "the worker shut down before the agent finished; another worker resumes it from the journal",
            ));
        }
        Ok(())
    }

    async fn journal(&mut self, mut step: JournalStep) -> Step {
        if let (Some(trace), Value::Object(data)) =
            (spans::traceparent_of(&self.span), &mut step.data)
        {
            data.insert(JOURNALED_TRACE.into(), Value::String(trace));
        }
        match self.journal {
            JournalHome::Engine => {
                self.ctx.append_journal(&step).await.map_err(|e| {
                    call_failed(
                        self.rt,
                        self.task,
                        e,
                        &format!("could not journal step {}", step.seq),
                    )
                })?;
            }
            JournalHome::Store => self.append_in_store(&step).await?,
            JournalHome::Nowhere => {}
        }
        self.state
            .apply(&step)
            .map_err(|e| technical(self.rt, self.task, format!("internal journal error: {e}")))
    }

    /// Appends `step` to the run in the store, fenced by this attempt's claim; a transient
    /// failure is retried with the same fence and step (a write whose acknowledgement was lost
    /// is recognised) for as long as the store's patience allows.
    async fn append_in_store(&mut self, step: &JournalStep) -> Step {
        let since = tokio::time::Instant::now();
        let mut tries = 0;
        loop {
            let run = self
                .store_run
                .as_mut()
                .expect("a store journal has a store run");
            let result = self
                .ctx
                .fenced(run.store.append(&mut run.fence, step))
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(e) => {
                    let what = format!("journaling step {} in the run store", step.seq);
                    store_retry(self.rt, self.task, self.ctx, e, &mut tries, since, &what).await?
                }
            }
        }
    }

    fn complete(&self, answer: &str) -> Outcome {
        let mut variables = Map::new();
        variables.insert(self.def.result_variable.clone(), parse_answer(answer));
        if self.approval.may_stop() {
            // Always written: the engine keeps the last value, and the gateway routes on it.
            variables.insert(
                self.def.approval_variables.status.clone(),
                json!(approval::STATUS_DONE),
            );
        }
        variables.insert(
            "agentUsage".into(),
            json!({
                "inputTokens": self.state.usage.input_tokens,
                "outputTokens": self.state.usage.output_tokens,
                "turns": self.state.turns,
                "modelCalls": self.state.turns + self.unanswered_model_calls,
            }),
        );
        Outcome::Complete { variables }
    }

    /// Whether the first pending call may run now. A call that needs a person's approval
    /// (`agent::approval`) and has no decision is journaled as requested (a new `requestId`
    /// and the call's digest) and the task completes asking for it; a redelivery of that same
    /// task asks again (no model call, nothing performed); any other task of the run must carry
    /// the decision on that request, which is journaled (its `requestId` consumed) before it is
    /// acted on. No decision at all: the same request is asked again. A decision on another
    /// request, a consumed one, another call or other content, or a call that is no longer the
    /// one put to the person: an incident, nothing performed. Approved: `true`, and the call
    /// runs as a keyed write, its digest checked once more. Refused: the model reads who refused
    /// it and why (`false`: nothing performed). A call already started (its key journaled) was
    /// approved before and only finishes.
    async fn approval_gate(&mut self, next: &PendingCall) -> Step<bool> {
        if next.started_key.is_some()
            || !self.approval.may_stop()
            || !next.call.arguments.is_object()
        {
            return Ok(true);
        }
        let call = &next.call;
        // A call already put to a person needed approval then: no tool listing is needed to act
        // on its decision (nothing but the store stands between the decision and the write).
        if self.state.approval.is_none() {
            let specs = self.tool_specs().await?;
            let needs = specs
                .iter()
                .find(|s| s.server == call.server && s.tool == call.tool)
                .is_some_and(|spec| self.approval.needs_approval(spec, &call.arguments));
            if !needs {
                // An unknown tool is answered by `run_tool_call` without performing anything.
                return Ok(true);
            }
        }
        match self.state.approval.clone() {
            Some(ApprovalState::Decided { request, decision }) if decision.approved => {
                // Checked again before performing: the call sent is the one put to the person.
                self.same_call_as_requested(call, &request)?;
                tracing::info!(call_id = %call.call_id, "the call was approved; performing it");
                Ok(true)
            }
            Some(ApprovalState::Decided { decision, .. }) => {
                tracing::info!(call_id = %call.call_id, "the call was refused; the model is told");
                // The refused call still has its `execute_tool` span: the model asked for it.
                let span = spans::execute_tool(&spans::ToolSpan {
                    server: &call.server,
                    tool: &call.tool,
                    call_id: &call.call_id,
                });
                let finished = self
                    .finish_tool(&span, call, None, approval::refusal_result(call, &decision))
                    .instrument(span.clone())
                    .await;
                spans::record_tool_end(&span, Some("refused"), finished.is_err());
                finished?;
                Ok(false)
            }
            // Journaled by a worker before requestIds: nothing could bind a decision to it, so
            // it is put to a person again under a new request.
            Some(ApprovalState::Requested(request)) if request.request_id.is_none() => {
                Err(self.request_approval(call).await?)
            }
            Some(ApprovalState::Requested(request)) if request.task_id == self.task.id => {
                Err(self.stop_for_approval(call, &request))
            }
            Some(ApprovalState::Requested(request)) => {
                self.same_call_as_requested(call, &request)?;
                let read = approval::read_decision(
                    &self.task.variables,
                    &self.def.approval_variables.decision,
                    &request,
                    &self.state.consumed_requests,
                );
                let decision = match read {
                    Ok(d) => d,
                    Err(e) if e.asks_again() => {
                        tracing::info!(call_id = %call.call_id, "{e}");
                        self.rt.metrics.count_approval("requested_again");
                        return Err(self.stop_for_approval(call, &request));
                    }
                    Err(e) => {
                        self.rt.metrics.count_approval("unusable");
                        return Err(incident(
                            "the approval decision cannot be used",
                            e.to_string(),
                        ));
                    }
                };
                let seq = self.state.next_seq;
                self.journal(journal::approval_decided_step(seq, &decision))
                    .await?;
                self.rt.metrics.count_approval(if decision.approved {
                    "approved"
                } else {
                    "refused"
                });
                Ok(false)
            }
            None => Err(self.request_approval(call).await?),
        }
    }

    /// Puts `call` to a person under a new request (a fresh requestId and the call's digest),
    /// journaled before the task completes asking for it.
    async fn request_approval(&mut self, call: &ToolCall) -> Step<Outcome> {
        let request = approval::PendingRequest::new(call, &self.task.id);
        let seq = self.state.next_seq;
        self.journal(journal::approval_requested_step(seq, &request))
            .await?;
        self.rt.metrics.count_approval("requested");
        Ok(self.stop_for_approval(call, &request))
    }

    /// The call waiting is exactly the one put to the person (server, tool and arguments, by
    /// the digest journaled with the request); anything else performs nothing: an incident.
    fn same_call_as_requested(&self, call: &ToolCall, request: &approval::PendingRequest) -> Step {
        if request.is_for(call) {
            return Ok(());
        }
        self.rt.metrics.count_approval("unusable");
        Err(incident(
            "the approval decision cannot be used",
            format!(
                "the call {} waiting in the run store is not the call put to the person (its server, tool or arguments differ from the digest journaled with the request); nothing was performed",
                call.call_id
            ),
        ))
    }

    /// Completes the task asking a person about `call` under `request`: the status and the
    /// request variables, `summary` the model's own text of the turn that asked for it, and the
    /// decision variable overwritten with a pending marker (a decision preset or left over is
    /// gone before anyone could use it).
    fn stop_for_approval(
        &mut self,
        call: &ToolCall,
        request: &approval::PendingRequest,
    ) -> Outcome {
        self.waiting_for_approval = true;
        let summary = self.state.messages.iter().rev().find_map(|m| match m {
            crate::conversation::Message::Assistant(a) => Some(a.text.clone().unwrap_or_default()),
            _ => None,
        });
        let run_key = self
            .store_run
            .as_ref()
            .map(|r| r.fence.run_key().to_string())
            .unwrap_or_default();
        tracing::info!(call_id = %call.call_id, server = %call.server, tool = %call.tool, run_key = %run_key, "a tool call waits for a person's approval; completing the task with the request");
        let names = &self.def.approval_variables;
        let mut variables = Map::new();
        variables.insert(
            names.status.clone(),
            json!(approval::STATUS_APPROVAL_REQUIRED),
        );
        variables.insert(
            names.request.clone(),
            approval::approval_request(call, request, summary.as_deref(), &run_key),
        );
        variables.insert(names.decision.clone(), approval::pending_marker(request));
        Outcome::Complete { variables }
    }

    async fn tool_specs(&mut self) -> Step<Vec<ToolSpec>> {
        if let Some(specs) = &self.specs {
            return Ok(specs.clone());
        }
        let mut tries = 0;
        let specs = loop {
            tries += 1;
            let result = tokio::select! {
                r = self.tools.tools() => r,
                _ = self.ctx.stopped() => return Err(self.released()),
            };
            match result {
                Ok(specs) => break specs,
                Err(e) => self.tool_error(e, tries, "listing tools").await?,
            }
        };
        self.names.declare_tools(&specs);
        self.specs = Some(specs.clone());
        Ok(specs)
    }

    /// Decides what a tool error means: `Ok` to retry after a backoff, `Err` to end.
    async fn tool_error(&self, e: ToolError, tries: u32, what: &str) -> Step {
        if e.is_lease_lost() {
            return Err(Outcome::Abandoned);
        }
        if matches!(e, ToolError::ForbiddenAddress { .. }) {
            return Err(incident(
                "a tool server of the agent definition cannot be used",
                format!("{what}: {e}"),
            ));
        }
        if matches!(e, ToolError::InsecureChannel { .. }) {
            return Err(incident("a tool server is refused", format!("{what}: {e}")));
        }
        if matches!(e, ToolError::TooLarge { .. }) {
            return Err(incident(
                "a tool server sent more than the worker reads",
                format!("{what}: {e}"),
            ));
        }
        if e.is_transient() && tries < self.rt.settings.tool_attempts {
            let wait = self.rt.settings.tool_backoff.delay(tries - 1);
            tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying");
            tokio::select! {
                _ = tokio::time::sleep(wait) => return Ok(()),
                _ = self.ctx.stopped() => return Err(self.released()),
            }
        }
        Err(technical(self.rt, self.task, format!("{what} failed: {e}")))
    }

    fn released(&self) -> Outcome {
        Outcome::released(
            self.task,
            "the worker shut down before the agent finished; another worker resumes it from the journal",
        )
    }

    async fn call_model(&mut self) -> Step {
        if self.state.turns >= self.limits.max_turns {
            return Err(limit_reached(
                &self.def,
                LimitExceeded::MaxTurns {
                    limit: self.limits.max_turns,
                    input: self.state.usage.input_tokens,
                    output: self.state.usage.output_tokens,
                },
            ));
        }
        let tools = self.tool_specs().await?;
        let (instructions, _) = self.state.input.clone().unwrap_or_default();
        let mut request = ModelRequest {
            model: String::new(),
            system: instructions,
            messages: self.state.messages.clone(),
            tools,
            max_output_tokens: None,
            traceparent: self.traceparent.clone(),
        };
        // The budget is checked against the request about to go out, not only what was spent:
        // one call must not overshoot it by a context window.
        let estimated_input = limits::estimate_request_tokens(&request);
        let cap = self
            .limits
            .output_cap(self.state.usage, estimated_input)
            .map_err(|e| limit_reached(&self.def, e))?;
        request.max_output_tokens = Some(cap);
        let metrics = self.rt.metrics.clone();
        let names = &self.names;
        let agent = crate::metrics::labels::capped(&self.def.name);
        let mut unanswered = 0u32;
        let mut observe = |a: &CallAttempt| {
            metrics.observe_model_call(names, &agent, a);
            if a.outcome != "ok" {
                unanswered += 1;
            }
        };
        let result = tokio::select! {
            r = call_models(
                &self.rt.providers,
                &self.def.models,
                &request,
                &self.rt.settings.model_retry,
                &self.task.id,
                &mut observe,
            ) => r,
            _ = self.ctx.stopped() => return Err(self.released()),
        };
        self.unanswered_model_calls += unanswered;
        let (model, response) = match result {
            Ok(answered) => answered,
            Err(e) => return Err(self.model_error(e).await),
        };
        // Nothing of an answer over a limit is journaled or performed.
        let writes = self.keyed_writes_in(&response.message.tool_calls);
        self.limits
            .check_answer(&response.message, writes, &self.state.spent)
            .map_err(|e| limit_reached(&self.def, e))?;
        // A provider that reports no usage still spends the budget: count the estimate.
        let (usage, estimated) = match response.usage {
            Some(u) => (u, false),
            None => (
                Usage {
                    input_tokens: estimated_input,
                    output_tokens: limits::estimate_answer_tokens(&response.message),
                },
                true,
            ),
        };
        let seq = self.state.next_seq;
        let mut step = journal::model_step(
            seq,
            &model.to_string(),
            &response.message,
            usage,
            &response.stop_reason,
        );
        if estimated {
            step.data["usageEstimated"] = json!(true);
        }
        self.journal(step).await
    }

    /// How many of `calls` would be keyed writes: calls of a listed tool that is a write
    /// ([`ToolSpec::is_write`]), with object arguments (what [`Attempt::run_tool_call`]
    /// journals as `tool/started`).
    fn keyed_writes_in(&self, calls: &[ToolCall]) -> u32 {
        let specs = self.specs.as_deref().unwrap_or_default();
        let n = calls
            .iter()
            .filter(|c| {
                c.arguments.is_object()
                    && specs
                        .iter()
                        .any(|s| s.server == c.server && s.tool == c.tool && s.is_write())
            })
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// How a model call that got no answer ends the attempt. A deferral (retries kept) only
    /// while every model of the chain is unavailable for everyone; with the run store, at most
    /// `ABADA_AGENT_MAX_DEFERRALS_PER_RUN` times per run, each journaled before it is reported.
    async fn model_error(&mut self, e: ModelCallError) -> Outcome {
        match e {
            ModelCallError::AllUnavailable { retry_after, .. } => {
                if self.journal == JournalHome::Store {
                    let deferral = self.state.deferrals.saturating_add(1);
                    let max = self.rt.max_deferrals_per_run;
                    if deferral > max {
                        return incident(
                            "the run was deferred too often",
                            format!(
                                "the run was deferred {} times because every model was unavailable, the most ABADA_AGENT_MAX_DEFERRALS_PER_RUN allows ({max}); the last time: {e}. Check the models' availability, then retry the incident",
                                self.state.deferrals
                            ),
                        );
                    }
                    let step = journal::deferral_step(self.state.next_seq, deferral, retry_after);
                    if let Err(outcome) = self.journal(step).await {
                        return outcome;
                    }
                }
                tracing::warn!(error = %e, retry_after_ms = retry_after.as_millis() as u64, deferrals = self.state.deferrals, "every model is unavailable for every task; deferring the attempt without consuming a retry");
                Outcome::Failure {
                    kind: FailureKind::Deferred,
                    report: FailureReport {
                        error_message: "every model is unavailable now; the attempt is deferred"
                            .into(),
                        error_details: e.to_string(),
                        retries: retries_unchanged(self.task),
                        retry_timeout: retry_after,
                    },
                }
            }
            ModelCallError::Technical { .. } => {
                technical(self.rt, self.task, format!("model call failed: {e}"))
            }
            ModelCallError::NoModels | ModelCallError::UnknownProvider { .. } => {
                incident("the agent definition cannot be used", e.to_string())
            }
            ModelCallError::Task { ref source, .. }
                if matches!(**source, crate::provider::ProviderError::TooLarge { .. }) =>
            {
                incident("the model's answer is too large", e.to_string())
            }
            ModelCallError::ContextTooLong { .. } => incident(
                "the conversation is too long for the model's context window",
                e.to_string(),
            ),
            ModelCallError::Task { .. } => incident("the model refused the request", e.to_string()),
        }
    }

    /// One tool call, in its `execute_tool` span (the journal writes about it included).
    async fn run_tool_call(&mut self, pending: PendingCall) -> Step {
        let span = spans::execute_tool(&spans::ToolSpan {
            server: &pending.call.server,
            tool: &pending.call.tool,
            call_id: &pending.call.call_id,
        });
        self.last_tool_outcome = None;
        let result = self
            .tool_call(pending, &span)
            .instrument(span.clone())
            .await;
        spans::record_tool_end(&span, self.last_tool_outcome, result.is_err());
        result
    }

    async fn tool_call(&mut self, pending: PendingCall, span: &Span) -> Step {
        let call = pending.call.clone();
        let specs = self.tool_specs().await?;
        let spec = specs
            .iter()
            .find(|s| s.server == call.server && s.tool == call.tool);
        let arguments = match (&call.arguments, spec) {
            _ if pending.started_key.is_some() => {
                call.arguments.as_object().cloned().unwrap_or_default()
            }
            (_, None) => {
                let offered: Vec<String> = specs
                    .iter()
                    .map(|s| format!("{}/{}", s.server, s.tool))
                    .collect();
                let result = ToolResult::error_text(format!(
                    "There is no tool {:?}{}. The tools offered are: {}.",
                    call.tool,
                    if call.server.is_empty() {
                        String::new()
                    } else {
                        format!(" on server {:?}", call.server)
                    },
                    offered.join(", ")
                ));
                self.count_tool(span, &call, "unknown_tool");
                return self.finish_tool(span, &call, None, result).await;
            }
            (Value::Object(map), Some(_)) => map.clone(),
            (other, Some(_)) => {
                let raw = match other {
                    Value::String(s) => s.clone(),
                    v => v.to_string(),
                };
                let shown: String = raw.chars().take(200).collect();
                let result = ToolResult::error_text(format!(
                    "The arguments for {} were not a JSON object ({shown}); call the tool again with a JSON object matching its input schema.",
                    call.tool
                ));
                self.count_tool(span, &call, "bad_arguments");
                return self.finish_tool(span, &call, None, result).await;
            }
        };
        // A call a person approved is keyed and journaled like any write, whatever its tool
        // claims: nothing but the journal stands between the decision and sending it again.
        let approved = matches!(
            &self.state.approval,
            Some(ApprovalState::Decided { decision, .. })
                if decision.approved && decision.call_id == call.call_id
        );
        let read_only =
            spec.is_some_and(|s| !s.is_write()) && !approved && pending.started_key.is_none();
        let key = match (&pending.started_key, read_only) {
            // SIM-BUG (feature `sim-bugs`, selected at run time): the resumed write loses its key.
            #[cfg(feature = "sim-bugs")]
            (Some(_), _) if crate::sim_bugs::active(crate::sim_bugs::Bug::KeyedWriteWithoutKey) => {
                None
            }
            (Some(key), _) => Some(key.clone()),
            (None, true) => None,
            (None, false) => {
                let seq = self.state.next_seq;
                let key = match self.journal {
                    // No journal to remember the key by: derive it from the call itself, so
                    // the same write re-sent by a run that starts over keeps its key.
                    JournalHome::Nowhere => {
                        let args = Value::Object(arguments.clone());
                        let probe =
                            journal::content_key(&self.task.id, &call.server, &call.tool, &args, 0);
                        let n = self.identical_writes.entry(probe).or_insert(0);
                        *n += 1;
                        journal::content_key(&self.task.id, &call.server, &call.tool, &args, *n)
                    }
                    _ => journal::write_key(&self.task.id, seq),
                };
                self.journal(journal::tool_started_step(seq, &key, &call))
                    .await?;
                Some(key)
            }
        };
        spans::record_tool_call(span, key.as_deref(), &arguments);
        let mut tries = 0;
        let result = loop {
            tries += 1;
            let r = tokio::select! {
                r = self.tools.call(&call.server, &call.tool, arguments.clone(), key.as_deref()) => r,
                _ = self.ctx.stopped() => return Err(self.released()),
            };
            match r {
                Ok(result) => break result,
                Err(ToolError::UnknownTool { .. }) => {
                    break ToolResult::error_text(format!(
                        "There is no tool {:?} on server {:?}.",
                        call.tool, call.server
                    ));
                }
                Err(ToolError::Protocol { reason, .. }) => {
                    // A JSON-RPC error from the tool: the model may correct itself.
                    break ToolResult::error_text(format!("The tool call failed: {reason}"));
                }
                Err(e) => {
                    self.count_tool(
                        span,
                        &call,
                        if e.is_transient() {
                            "unavailable"
                        } else {
                            "error"
                        },
                    );
                    self.tool_error(
                        e,
                        tries,
                        &format!("calling tool {}/{}", call.server, call.tool),
                    )
                    .await?;
                }
            }
        };
        spans::record_tool_tries(span, tries);
        self.count_tool(
            span,
            &call,
            if result.is_error {
                "error_result"
            } else {
                "ok"
            },
        );
        self.finish_tool(span, &call, key.as_deref(), result).await
    }

    async fn finish_tool(
        &mut self,
        span: &Span,
        call: &ToolCall,
        key: Option<&str>,
        result: ToolResult,
    ) -> Step {
        // Every result the model and the journal see is capped here, whatever produced it: a
        // server's result, its error message, or the worker's own (unknown tool, bad arguments).
        let result =
            crate::tools::cap_result(result, self.rt.settings.tool_sessions.max_result_bytes);
        spans::record_tool_result(span, &result);
        let seq = self.state.next_seq;
        self.journal(journal::tool_finished_step(seq, key, call, &result))
            .await
    }

    /// Counts a tool call's outcome (a failed try included) and puts it on its span.
    fn count_tool(&mut self, span: &Span, call: &ToolCall, outcome: &'static str) {
        spans::record_tool_outcome(span, outcome);
        self.last_tool_outcome = Some(outcome);
        let (server, tool) = self.names.tool(&call.server, &call.tool);
        self.rt
            .metrics
            .tool_calls
            .get_or_create(&ToolLabels {
                server,
                tool,
                outcome,
            })
            .inc();
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
            .is_some_and(|k| k == run_key.as_str());
    if !says_waiting || steps.iter().any(|s| s.kind == journal::KIND_APPROVAL) {
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

/// Claims the task's run in the store (the fencing token of this attempt) and returns the
/// journal so far; the input step is written in the claim's transaction when the run is new.
/// The store's admission rule decides whether this task may take the run at all (its input
/// must equal the journaled one; a visit's run held by another live task is not taken): a
/// refusal is an incident that performed nothing.
async fn claim_in_store(
    rt: &AgentRuntime,
    home: &RunStoreHome,
    task: &Task,
    ctx: &TaskContext,
    def: &AgentDefinition,
    waits_for_approval: bool,
) -> Step<(StoreRun, Vec<JournalStep>)> {
    // A run that may wait for approval is keyed by its process visit, so the task carrying the
    // decision finds it; any other by its task.
    let run_key = if waits_for_approval {
        let key = run_key::run_key(task, def.loop_counter_variable.as_deref())
            .map_err(|e| incident("the task cannot wait for approval", e.to_string()))?;
        RunKey::for_visit(key)
    } else {
        RunKey::for_task(&task.id)
    }
    .map_err(|e| incident("the task cannot be kept in the run store", e.to_string()))?;
    let (instructions, input) = def
        .render(&task.variables)
        .map_err(|e| incident("the agent definition cannot be used", e.to_string()))?;
    // Stamped with the run's start, so the wall-clock limit (maxDurationMs) counts from the
    // task's first start on every attempt, as with the engine's journal. Not for a visit's run:
    // the wait for a person's decision is no agent time, so its limit counts per task.
    let first = if waits_for_approval {
        journal::input_step(1, &instructions, &input)
    } else {
        journal::started_input_step(1, &instructions, &input, std::time::SystemTime::now())
    };
    let first = journal::with_definition(first, def);
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
            .fenced(async {
                let claim = home.store.claim(&run_key, &claimant, Some(&first)).await?;
                Ok((home.store.clone(), claim))
            })
            .await;
        match claimed {
            Ok((store, claim)) => {
                tracing::debug!(
                    run_attempt = claim.fence.attempt(),
                    steps = claim.steps.len(),
                    "run claimed in the run store"
                );
                if waits_for_approval {
                    waiting_run_not_lost(task, def, &run_key, &claim.steps)?;
                }
                let run = StoreRun {
                    store,
                    began: claim.created,
                    fence: claim.fence,
                };
                return Ok((run, claim.steps));
            }
            Err(TaskError::Engine(e @ StoreError::Refused { .. })) => {
                return Err(refused_claim(&e));
            }
            Err(e) => {
                store_retry(
                    rt,
                    task,
                    ctx,
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

/// The incident of a claim the store's admission rule refused; the run stays with its holder.
fn refused_claim(e: &StoreError) -> Outcome {
    let StoreError::Refused { reason, .. } = e else {
        return incident("the run store refused the claim", e.to_string());
    };
    match reason {
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
    rt: &AgentRuntime,
    task: &Task,
    ctx: &TaskContext,
    e: TaskError<StoreError>,
    tries: &mut u32,
    since: tokio::time::Instant,
    what: &str,
) -> Step {
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
            return Err(technical(rt, task, format!("{what} failed: {e}")));
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
                retry_timeout: rt.settings.technical_retry.delay(0),
            },
        });
    }
    let wait = rt.settings.store_backoff.delay(*tries);
    *tries = tries.saturating_add(1);
    tracing::debug!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying");
    tokio::select! {
        _ = tokio::time::sleep(wait) => Ok(()),
        _ = ctx.lease().lost() => Err(Outcome::Abandoned),
        _ = ctx.stopped() => Err(Outcome::released(
            task,
            "the worker shut down before the agent finished; another worker resumes it from the run store",
        )),
    }
}

/// The field of a journal step's `data` holding the W3C context of the attempt that wrote it
/// (only while spans are exported), so the attempt resuming the run links to it.
const JOURNALED_TRACE: &str = "traceparent";

/// The context of the attempt that wrote the last step with one.
fn last_journaled_trace(steps: &[JournalStep]) -> Option<TraceParent> {
    steps.iter().rev().find_map(|s| {
        s.data
            .get(JOURNALED_TRACE)?
            .as_str()
            .and_then(TraceParent::parse)
    })
}

/// The final answer as a process variable: parsed JSON when it is JSON (also inside a
/// Markdown code fence tagged `json`), else the text.
fn parse_answer(text: &str) -> Value {
    let trimmed = text.trim();
    let unfenced = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|rest| rest.strip_suffix("```"))
        .map(str::trim)
        .unwrap_or(trimmed);
    match serde_json::from_str::<Value>(unfenced) {
        Ok(v) if !unfenced.is_empty() => v,
        _ => Value::String(text.to_string()),
    }
}

/// A limit ends the task as an incident naming the limit and its value.
fn limit_reached(def: &AgentDefinition, e: LimitExceeded) -> Outcome {
    tracing::warn!(agent = %def.name, limit = e.name(), "an agent limit was reached");
    incident(
        &format!("agent {:?} reached a limit", def.name),
        e.to_string(),
    )
}

/// An incident: `failure` with `retries: 0`, for an operator to see, fix and retry.
fn incident(message: &str, details: String) -> Outcome {
    tracing::error!(details = %details, "{message}: the task becomes an incident");
    Outcome::Failure {
        kind: FailureKind::Incident,
        report: FailureReport {
            error_message: format!("{message}: {details}"),
            error_details: details,
            retries: 0,
            retry_timeout: Duration::ZERO,
        },
    }
}

/// The outcome of a call about the task that failed and cannot be done without: nothing to
/// report when the lease is lost, else a technical failure saying `what` went wrong.
fn call_failed(rt: &AgentRuntime, task: &Task, e: TaskError, what: &str) -> Outcome {
    e.into_outcome(|e| technical(rt, task, format!("{what}: {e}")))
}

/// A technical failure: one retry consumed, an exponential `retryTimeout` by attempt.
fn technical(rt: &AgentRuntime, task: &Task, details: String) -> Outcome {
    let retry_timeout = rt.settings.technical_retry.delay(earlier_failures(task));
    tracing::warn!(details = %details, retry_in_ms = retry_timeout.as_millis() as u64, "technical failure: one retry consumed");
    Outcome::Failure {
        kind: FailureKind::Technical,
        report: FailureReport {
            error_message: details.clone(),
            error_details: details,
            retries: retries_consumed(task),
            retry_timeout,
        },
    }
}

/// How many technical failures came before this one, for the backoff: an agent/1 task counts
/// its attempts; a plain v1 task only the retries it has left, which each technical failure
/// lowers by one from [`crate::handler::DEFAULT_RETRIES`] (the engine's own starting value may
/// differ: the backoff then starts at its first step, never past its cap).
fn earlier_failures(task: &Task) -> u32 {
    match task.attempt {
        Some(attempt) => attempt.saturating_sub(1),
        None => u32::try_from(crate::handler::DEFAULT_RETRIES - crate::handler::task_retries(task))
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain v1 task backs off longer as its retries run down, like an agent/1 task as its
    /// attempts grow (issue 23: a request that fails on its own consumes a retry with backoff).
    #[test]
    fn technical_failures_back_off_by_attempt_or_by_the_retries_used() {
        let task = |attempt: Option<u32>, retries: Option<i32>| Task {
            id: "t-1".into(),
            topic: "abada:agent".into(),
            variables: Default::default(),
            process_instance_id: None,
            activity_id: None,
            retries,
            lock_expiration_time: None,
            trace_parent: None,
            attempt,
            agent: None,
        };
        assert_eq!(earlier_failures(&task(Some(1), Some(3))), 0);
        assert_eq!(earlier_failures(&task(Some(4), Some(3))), 3);
        assert_eq!(earlier_failures(&task(None, None)), 0);
        assert_eq!(earlier_failures(&task(None, Some(3))), 0);
        assert_eq!(earlier_failures(&task(None, Some(1))), 2);
        assert_eq!(earlier_failures(&task(None, Some(0))), 3);
        assert_eq!(earlier_failures(&task(None, Some(50))), 0);
        assert_eq!(earlier_failures(&task(None, Some(i32::MIN))), 3);
    }

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
                },
                ["input differs", "sha256:", "loopCounterVariable"],
            ),
        ];
        for (reason, needles) in cases {
            let e = StoreError::Refused {
                run_key: "process/pi-1/refundAgent".into(),
                task_id: "t-2".into(),
                reason,
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

    #[test]
    fn answers_that_are_json_become_json() {
        assert_eq!(
            parse_answer("{\"approved\": true}"),
            json!({"approved": true})
        );
        assert_eq!(parse_answer("```json\n{\"a\": 1}\n```"), json!({"a": 1}));
        assert_eq!(parse_answer("  [1, 2] "), json!([1, 2]));
        assert_eq!(parse_answer("Refund approved."), json!("Refund approved."));
        assert_eq!(parse_answer(""), json!(""));
    }
}
