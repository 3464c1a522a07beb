//! One attempt of an agent run: the conversation loop. Find the task's run in the store (its
//! journaled definition, when it has one, is the definition: `run_home`), else resolve the
//! latest definition; check the models against the operator's allow-list; open the journal and
//! replay it, then loop (run the pending tool calls, call the model, journal its
//! answer) until a final answer, a limit, an error, a stop request or a lost lease; close every
//! MCP session on the way out and commit the run's end to its journal.
//!
//! What the loop leans on lives beside it: the journal wherever it lives (`run_journal`), the
//! tool calls (`tool_call`), the approval gate (`approval_gate`), and the outcomes an attempt
//! ends with (`scope`). Every step returns `Result<_, Outcome>`: `Err` carries the outcome that
//! ends the attempt, so `?` ends it from anywhere.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tracing::{Instrument, Span};

use super::AgentRuntime;
use super::approval::{self, ApprovalRules, NoWaitingPlace};
use super::approval_gate::approval_rules;
use super::attempt::{Attempt, Deadline, Toolbox, Trace};
use super::bpmn::{self, ResolveError};
use super::definition::AgentDefinition;
use super::journal::{self, PendingCall};
use super::limits::{LimitExceeded, Limits};
use super::output;
use super::run_journal::{JOURNALED_TRACE, Journal, Opened};
use super::scope::{Scope, Step, incident, limit_reached};
use super::tool_call::LeaseCredentials;
use crate::conversation::Usage;
use crate::engine::{FailureReport, JournalStep, Task};
use crate::handler::{FailureKind, Outcome, TaskContext, retries_unchanged};
use crate::metrics::labels::DeclaredNames;
use crate::provider::CallAttempt;
use crate::provider::ModelRequest;
use crate::provider::fallback::{ModelCallError, call_models};
use crate::provider::token_estimate;
use crate::telemetry::spans;
use crate::tools::TaskTools;
use crate::tools::registry::ToolRegistry;

type StepFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Step<T>> + Send + 'a>>;

/// Runs one attempt of the task to its outcome, inside its `invoke_agent` span.
pub(super) async fn run(rt: &AgentRuntime, task: &Task, ctx: &TaskContext) -> Outcome {
    // Where the run lives is found first, from the task alone (`run_home`): a run the store
    // keeps for this task runs the definition it journaled, whatever was deployed since.
    let placed = match Journal::locate(Scope { rt, task, ctx }).await {
        Ok(placed) => placed,
        Err(outcome) => return outcome,
    };
    // SIM-BUG (feature `sim-bugs`, selected at run time): the latest definition decides.
    #[cfg(feature = "sim-bugs")]
    let placed = if crate::sim_bugs::active(crate::sim_bugs::Bug::RunHomeFromLatest)
        || crate::sim_bugs::active(crate::sim_bugs::Bug::RedeployHole)
    {
        super::run_home::Placed::default()
    } else {
        placed
    };
    let pinned = placed
        .run
        .as_ref()
        .and_then(|r| r.definition.as_ref())
        .map(bpmn::from_journal_snapshot);
    // SIM-BUG (feature `sim-bugs`, selected at run time): the agents file's latest entry
    // instead of the journaled definition.
    #[cfg(feature = "sim-bugs")]
    let pinned = match pinned {
        Some(Ok(def)) if agents_file_latest_bug(&def) => None,
        pinned => pinned,
    };
    let resolved = match pinned {
        Some(Ok(def)) => Ok(def),
        Some(Err(e)) => Err(ResolveError::Bpmn(e)),
        None => rt.bpmn.resolve(task, ctx, rt.agents_file.as_ref()).await,
    };
    let def = match resolved.and_then(|def| usable(rt, def)) {
        Ok(d) => d,
        Err(e) => {
            let span = spans::invoke_unknown_agent(&task.id, task.trace_parent.as_ref());
            let outcome = span.in_scope(|| match e {
                ResolveError::Engine { what, source } => {
                    Scope { rt, task, ctx }.call_failed(source, &what)
                }
                e => incident("the agent definition cannot be used", e.to_string()),
            });
            spans::record_attempt_end(&span, outcome.end().as_str(), Some("definition"), 0, 0, 0);
            return outcome;
        }
    };
    // Admission learns which models the tasks of this topic use: a model held then gates the
    // fetches of its own topics only.
    rt.providers
        .capacities()
        .attribute(&task.topic, &def.models, tokio::time::Instant::now());
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
        let scope = Scope { rt, task, ctx };
        let located = placed.run.as_ref();
        let mut attempt = match Attempt::start(scope, def, approval, located, span.clone()).await
        {
            Ok(a) => a,
            Err(outcome) => return outcome,
        };
        resumed_steps = attempt.state.next_seq - 1;
        let before = attempt.state.usage;
        // The wall-clock deadline (`maxDurationMs`) bounds everything the attempt does, a model
        // or tool call in flight included: dropping the loop there is what a crash would do, and
        // the journal already holds every step that counts (a started keyed write keeps its key).
        let deadline = attempt.deadline;
        // Biased, the attempt first: an outcome reached at the deadline's instant stands.
        let outcome = tokio::select! {
            biased;
            r = attempt.drive() => match r {
                Ok(()) => unreachable!("drive only ends with an outcome"),
                Err(outcome) => outcome,
            },
            _ = tokio::time::sleep_until(deadline.at) => limit_reached(&attempt.def, LimitExceeded::Duration {
                limit_ms: duration_ms(attempt.limits.max_duration),
                elapsed_ms: duration_ms(deadline.elapsed_before + deadline.started.elapsed()),
            }),
        };
        let outcome = unperformed_approval(
            &attempt.state,
            task,
            &attempt.def,
            super::scope::stored_variables_fit(outcome),
        );
        attempt.tools.sessions.close().await;
        let after = attempt.state.usage;
        tokens = (
            after.input_tokens.saturating_sub(before.input_tokens),
            after.output_tokens.saturating_sub(before.output_tokens),
        );
        attempt.journal.commit(scope, &outcome);
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

/// `def`, if the operator allows every model it names (`ABADA_AGENT_PROVIDER_<NAME>_MODELS`);
/// else the definition cannot be used: nothing is sent.
fn usable(rt: &AgentRuntime, def: AgentDefinition) -> Result<AgentDefinition, ResolveError> {
    rt.allowed_models.check(&def.models).map_err(|e| {
        ResolveError::Definition(super::definition::DefinitionError::Invalid {
            name: def.name.clone(),
            reason: e.to_string(),
        })
    })?;
    Ok(def)
}

/// An incident of a run whose first pending call a person approved and that was not performed:
/// the incident says so, with the call, so an approved write is never dropped unseen. Any
/// other outcome passes unchanged (a technical failure or a release comes back and performs it).
fn unperformed_approval(
    state: &journal::Replayed,
    task: &Task,
    def: &AgentDefinition,
    outcome: Outcome,
) -> Outcome {
    // Journaled, or carried by this task and not read yet (the attempt ended before its gate).
    let (request, decision, journaled) = match &state.approval {
        Some(journal::ApprovalState::Decided { request, decision }) => {
            (request, decision.clone(), true)
        }
        Some(journal::ApprovalState::Requested(request)) => match approval::read_decision(
            &task.variables,
            &def.approval_variables.decision,
            request,
            &state.consumed_requests,
        ) {
            Ok(decision) => (request, decision, false),
            Err(_) => return outcome,
        },
        None => return outcome,
    };
    let Outcome::Failure {
        kind: FailureKind::Incident,
        mut report,
    } = outcome
    else {
        return outcome;
    };
    let Some(call) = state
        .pending
        .first()
        .filter(|p| decision.approved && p.call.call_id == request.call_id)
    else {
        return Outcome::Failure {
            kind: FailureKind::Incident,
            report,
        };
    };
    let sent = match (call.started_key.is_some(), journaled) {
        (true, _) => {
            "it may have been sent once under its idempotency key; a retry re-sends it under the same key"
        }
        (false, true) => "it was not sent; a retry performs it once the cause is fixed",
        (false, false) => {
            "it was not sent and the decision was not consumed; a retry performs it once the cause is fixed"
        }
    };
    report.error_details = format!(
        "the call {tool} of server {server} (callId {call_id}, requestId {request_id}) was approved by {by} and is not performed: {sent}. {details}",
        tool = call.call.tool,
        server = call.call.server,
        call_id = call.call.call_id,
        request_id = decision.request_id,
        by = decision.decided_by,
        details = report.error_details,
    );
    report.error_message = format!(
        "an approved call was not performed: {}",
        report.error_message
    );
    Outcome::Failure {
        kind: FailureKind::Incident,
        report,
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

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whether the `agents-file-latest` bug is selected and `def` came from the agents file.
#[cfg(feature = "sim-bugs")]
fn agents_file_latest_bug(def: &AgentDefinition) -> bool {
    crate::sim_bugs::active(crate::sim_bugs::Bug::AgentsFileLatest)
        && def
            .source
            .as_ref()
            .is_some_and(|s| s.kind == super::definition::SOURCE_AGENTS_FILE)
}

impl<'a> Attempt<'a> {
    async fn start(
        scope: Scope<'a>,
        def: AgentDefinition,
        approval: ApprovalRules,
        located: Option<&crate::store::OpenRun>,
        span: Span,
    ) -> Step<Attempt<'a>> {
        let (rt, task, ctx) = (scope.rt, scope.task, scope.ctx);
        let Opened {
            journal,
            state,
            resumed,
        } = Journal::open(scope, &def, approval.may_stop(), located, &span).await?;
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
        // SIM-BUG (feature `sim-bugs`, selected at run time): the journaled definition
        // ignored for the agents file's latest entry.
        #[cfg(feature = "sim-bugs")]
        let journaled = state
            .definition
            .as_ref()
            .filter(|_| !agents_file_latest_bug(&def));
        #[cfg(not(feature = "sim-bugs"))]
        let journaled = state.definition.as_ref();
        let (def, approval) = match journaled {
            Some(snapshot) => {
                let def = bpmn::from_journal_snapshot(snapshot)
                    .map_err(ResolveError::Bpmn)
                    .and_then(|def| usable(rt, def))
                    .map_err(|e| {
                        unperformed_approval(
                            &state,
                            task,
                            &def,
                            incident(
                                "the run's journaled agent definition cannot be used",
                                e.to_string(),
                            ),
                        )
                    })?;
                let approval = approval_rules(rt, &def);
                (def, approval)
            }
            None => (def, approval),
        };
        // Which tasks may use each server (its scope in the registry), then which servers, at
        // which URL, with which credential: the registry decides; the definition only names
        // them. Nothing is sent to a server that fails here.
        super::tool_scope::check(scope, &def).await?;
        let servers = ToolRegistry::resolve(
            rt.tool_registry.as_deref(),
            &def.tool_servers,
            task.attempt.is_some(),
        )
        .map_err(|e| {
            unperformed_approval(
                &state,
                task,
                &def,
                incident(
                    "a tool server of the agent definition cannot be used",
                    e.to_string(),
                ),
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
        let deadline = Deadline::new(
            limits.max_duration,
            state.started_at_ms,
            std::time::SystemTime::now(),
        );
        // Only what the operator's files declare labels metrics (the registry's servers, the
        // agents file's agents, models and servers): this definition may be the engine's.
        let names = DeclaredNames::of_definition(
            rt.labels.clone(),
            &def.models,
            def.tool_servers.iter().map(|s| s.name.as_str()),
        );
        let traceparent = task
            .trace_parent
            .as_ref()
            .map(|t| t.child_header(&rt.random));
        let sessions = rt.tools.sessions(TaskTools {
            servers: servers.servers,
            credentials: Arc::new(credentials),
            traceparent: traceparent.clone(),
            cleanup: ctx.cleanup().clone(),
            unregistered,
        });
        Ok(Attempt {
            scope,
            def,
            limits,
            deadline,
            state,
            journal,
            tools: Toolbox {
                sessions,
                specs: None,
                names,
                last_outcome: None,
            },
            trace: Trace { span, traceparent },
            approval,
            unanswered_model_calls: 0,
        })
    }

    /// The loop; ends only with `Err(outcome)`.
    async fn drive(&mut self) -> Step {
        if self.state.input.is_none() {
            let (instructions, input) = self
                .def
                .render(&self.scope.task.variables)
                .map_err(|e| incident("the agent definition cannot be used", e.to_string()))?;
            let seq = self.state.next_seq;
            let step =
                journal::started_input_step(seq, &instructions, &input, self.deadline.started_at);
            self.record(journal::with_definition(step, &self.def))
                .await?;
        }
        loop {
            self.scope.boundary()?;
            if let Some(answer) = self.state.final_answer.clone() {
                // [judging] The stored value is the judged one (judged now if the journal holds
                // no verdict yet); a rejection with a repair turn left asks the model again.
                match self.judged_value(&answer).await? {
                    Some(value) => return Err(self.complete(value)),
                    None => continue,
                }
            }
            if let Some(next) = self.state.pending.first().cloned() {
                // [answer shape] A call repeated after its result is answered, not performed.
                if self.boxed_repeat(&next).await? {
                    continue;
                }
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

    fn boxed_repeat<'s>(&'s mut self, next: &'s PendingCall) -> StepFuture<'s, bool> {
        Box::pin(self.answer_repeated_call(next))
    }

    fn boxed_tool_call(&mut self, next: PendingCall) -> StepFuture<'_, ()> {
        Box::pin(self.run_tool_call(next))
    }

    fn boxed_model_call(&mut self) -> StepFuture<'_, ()> {
        Box::pin(self.call_model())
    }

    /// Journals `step` (with this attempt's trace context) where the journal lives, then
    /// applies it to the run's state.
    pub(super) async fn record(&mut self, mut step: JournalStep) -> Step {
        if let (Some(trace), Value::Object(data)) =
            (spans::traceparent_of(&self.trace.span), &mut step.data)
        {
            data.insert(JOURNALED_TRACE.into(), Value::String(trace));
        }
        self.journal.append(self.scope, &step).await?;
        self.state
            .apply(&step)
            .map_err(|e| self.scope.technical(format!("internal journal error: {e}")))
    }

    fn complete(&self, value: Value) -> Outcome {
        let mut variables = Map::new();
        variables.insert(self.def.result_variable.clone(), value);
        let status = &self.def.approval_variables.status;
        let ever_stopped = !self.state.consumed_requests.is_empty()
            || self.scope.task.variables.contains_key(status);
        // SIM-BUG (feature `sim-bugs`, selected at run time): written only by a definition
        // that may stop.
        #[cfg(feature = "sim-bugs")]
        let ever_stopped =
            ever_stopped && !crate::sim_bugs::active(crate::sim_bugs::Bug::RedeployHole);
        if self.approval.may_stop() || ever_stopped {
            // Written on every completion of a node that may stop, or ever did (this run, or an
            // earlier visit: the variable is there): the engine keeps the last value, and a
            // stale "approval-required" would route the token back to the person.
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
            traceparent: self.trace.traceparent.clone(),
            // [output] structured output: the schema, native or instructed per wire format.
            output: self
                .def
                .output_schema
                .as_ref()
                .map(|s| s.format(&self.def.name)),
        };
        // [window] the request fits the smallest context window of the chain (older
        // tool results elided, derived from the journal), or the task ends naming the sizes.
        let kept = &self.state.keyed_results;
        // SIM-BUG (feature `sim-bugs`, selected at run time): no keyed result kept.
        #[cfg(feature = "sim-bugs")]
        let no_keyed = std::collections::HashSet::new();
        #[cfg(feature = "sim-bugs")]
        let kept = if crate::sim_bugs::active(crate::sim_bugs::Bug::KeyedResultElided) {
            &no_keyed
        } else {
            kept
        };
        // SIM-BUG (feature `sim-bugs`, selected at run time): the window not consulted.
        #[cfg(feature = "sim-bugs")]
        let fits = !crate::sim_bugs::active(crate::sim_bugs::Bug::WindowIgnored);
        #[cfg(not(feature = "sim-bugs"))]
        let fits = true;
        if fits {
            super::window::fit_to_chain(
                &mut request,
                self.scope.rt.providers.context_windows(),
                &self.def.models,
                self.limits.max_output_tokens,
                kept,
            )
            .map_err(|e| incident(super::window::INCIDENT, e.to_string()))?;
        }
        // The budget is checked against the request about to go out, not only what was spent:
        // one call must not overshoot it by a context window.
        let estimated_input = token_estimate::estimate_request_tokens(&request);
        let cap = self
            .limits
            .output_cap(self.state.usage, estimated_input)
            .map_err(|e| limit_reached(&self.def, e))?;
        request.max_output_tokens = Some(cap);
        let metrics = self.scope.rt.metrics.clone();
        let names = &self.tools.names;
        let agent = names.agent(&self.def.name);
        let mut unanswered = 0u32;
        let mut observe = |a: &CallAttempt| {
            metrics.observe_model_call(names, &agent, a);
            if a.outcome != "ok" {
                unanswered += 1;
            }
        };
        // Biased, the answer first: a model answer that came in as the worker stops is paid
        // for; it is kept rather than asked again.
        let result = tokio::select! {
            biased;
            r = call_models(
                &self.scope.rt.providers,
                &self.def.models,
                &request,
                &self.scope.rt.settings.model_retry,
                &self.scope.task.id,
                &mut observe,
            ) => r,
            _ = self.scope.ctx.stopped() => return Err(self.scope.released()),
        };
        self.unanswered_model_calls += unanswered;
        let (model, mut response) = match result {
            Ok(answered) => answered,
            Err(e) => return Err(self.model_error(e).await),
        };
        // [answer shape] A tool call written as text, an empty answer, a repeated call: parsed
        // (the provider's `_TOOL_CALLS_IN_TEXT=parse`) or sent back, before any rule applies.
        let shape = self.examine_answer(&model, &mut response);
        // Nothing of an answer over a limit is journaled or performed.
        // [answer shape] A repeated write is answered, never sent: no keyed write.
        let writes = self
            .keyed_writes_in(&response.message.tool_calls)
            .saturating_sub(shape.repeated_writes);
        self.limits
            .check_answer(&response.message, writes, &self.state.spent)
            .map_err(|e| limit_reached(&self.def, e))?;
        // A provider that reports no usage still spends the budget: count the estimate.
        let (usage, estimated) = match response.usage {
            Some(u) => (u, false),
            None => (
                Usage {
                    input_tokens: estimated_input,
                    output_tokens: token_estimate::estimate_answer_tokens(&response.message),
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
        // [judging] A final answer the validator must judge is journaled first, then judged
        // (the verdict journaled after it): a validation that never ends cannot make the
        // model be paid again and again.
        let text = response.message.text.as_deref().unwrap_or_default();
        if !shape.is_malformed()
            && response.message.tool_calls.is_empty()
            && output::needs_validator(self.def.output_schema.as_ref(), text, &response.stop_reason)
        {
            let answer = text.to_string();
            self.record(step).await?;
            return self
                .judge_final_answer(&answer, super::judging::Pass::First)
                .await
                .map(|_| ());
        }
        // [output] Any other final answer off the schema, or cut by the output limit, is
        // journaled with the repair message the model reads next (a resumed run replays it),
        // never stored.
        let verdict = if shape.is_malformed() {
            output::Verdict::Accepted
        } else {
            output::verdict(
                self.def.output_schema.as_ref(),
                &response.message,
                &response.stop_reason,
                Some(cap),
                self.state.output_repairs,
                self.def.output_repair_turns,
            )
        };
        if let Some(rejection) = verdict.rejection() {
            step.data[output::JOURNAL_FIELD] = output::journal_record(rejection);
        }
        shape.mark(&mut step);
        self.record(step).await?;
        self.answer_shape_outcome(shape)?;
        self.output_verdict(verdict)
    }

    /// [output] Counts a rejected final answer; the incident once no repair turn is left.
    pub(super) fn output_verdict(&self, verdict: output::Verdict) -> Step {
        let agent = self.tools.names.agent(&self.def.name);
        match verdict {
            output::Verdict::Accepted => Ok(()),
            output::Verdict::Repair(r) => {
                tracing::info!(agent = %self.def.name, reason = r.reason.as_str(), location = r.location.as_deref().unwrap_or(""), "the final answer was rejected; the model gets a repair turn");
                self.scope
                    .rt
                    .metrics
                    .count_output_rejection(&agent, r.reason.as_str(), true);
                Ok(())
            }
            output::Verdict::Exhausted(r) => {
                self.scope
                    .rt
                    .metrics
                    .count_output_rejection(&agent, r.reason.as_str(), false);
                Err(incident(
                    "the agent's final answer cannot be stored",
                    r.incident_details(&self.def.name, self.def.output_repair_turns),
                ))
            }
        }
    }

    /// How a model call that got no answer ends the attempt. A deferral (retries kept) only
    /// while every model of the chain is unavailable for everyone; with the run store, at most
    /// `ABADA_AGENT_MAX_DEFERRALS_PER_RUN` times per run, each journaled before it is reported.
    async fn model_error(&mut self, e: ModelCallError) -> Outcome {
        match e {
            ModelCallError::AllUnavailable { retry_after, .. } => {
                if self.journal.in_store() {
                    let deferral = self.state.deferrals.saturating_add(1);
                    let max = self.scope.rt.max_deferrals_per_run;
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
                    if let Err(outcome) = self.record(step).await {
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
                        retries: retries_unchanged(self.scope.task),
                        retry_timeout: retry_after,
                    },
                }
            }
            ModelCallError::Technical { .. } => {
                self.scope.technical(format!("model call failed: {e}"))
            }
            ModelCallError::NoModels | ModelCallError::UnknownProvider { .. } => {
                incident("the agent definition cannot be used", e.to_string())
            }
            ModelCallError::Task { ref source, .. }
                if matches!(**source, crate::provider::ProviderError::TooLarge { .. }) =>
            {
                incident("the model's answer is too large", e.to_string())
            }
            ModelCallError::ContextTooLong { .. } => {
                incident(super::window::INCIDENT, e.to_string())
            }
            ModelCallError::Task { .. } => incident("the model refused the request", e.to_string()),
        }
    }
}
