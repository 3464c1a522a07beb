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

use super::approval::{ApprovalPolicy, NoWaitingPlace};
use super::definition::{self, AgentDefinition};
use super::journal::{self, PendingCall, Replayed};
use super::{AgentRuntime, JournalHome};
use crate::conversation::{ToolCall, ToolResult, ToolSpec};
use crate::engine::capabilities::NoJournalEvidence;
use crate::engine::{EngineError, FailureReport, JournalStep, Task};
use crate::handler::{
    FailureKind, Outcome, TaskContext, TaskError, retries_consumed, retries_unchanged,
};
use crate::metrics::{ModelLabels, ModelTokenLabels, ToolLabels};
use crate::provider::ModelRequest;
use crate::provider::fallback::{CallAttempt, ModelCallError, call_with_fallback_observed};
use crate::secret::Secret;
use crate::tools::{CredentialError, CredentialSource, ToolError, ToolSessions};

type Step<T = ()> = Result<T, Outcome>;

/// Runs one attempt of the task to its outcome.
pub(super) async fn run(rt: &AgentRuntime, task: &Task, ctx: &TaskContext) -> Outcome {
    let def = match definition::resolve(task, rt.agents_file.as_ref()) {
        Ok(d) => d,
        Err(e) => return incident("the agent definition cannot be used", e.to_string()),
    };
    // Approval needs a place for the conversation to wait across tasks (agent::approval).
    if def.approval != ApprovalPolicy::Never {
        let refused = NoWaitingPlace {
            agent: def.name.clone(),
        };
        return incident("the agent definition cannot be used", refused.to_string());
    }
    let mut attempt = match Attempt::start(rt, task, ctx, def).await {
        Ok(a) => a,
        Err(outcome) => return outcome,
    };
    let outcome = match attempt.drive().await {
        Ok(()) => unreachable!("drive only ends with an outcome"),
        Err(outcome) => outcome,
    };
    attempt.tools.close().await;
    outcome
}

/// The engine's tool-credential call for this task's lease (protocol.md B.3).
struct LeaseCredentials {
    ctx: TaskContext,
}

#[async_trait]
impl CredentialSource for LeaseCredentials {
    async fn credential(&self, server: &str) -> Result<Secret, CredentialError> {
        self.ctx
            .tool_credential(server)
            .await
            .map(|c| c.token)
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
    state: Replayed,
    /// Where this attempt journals its steps (nowhere when the engine turned out to have no
    /// journal).
    journal: JournalHome,
    tools: ToolSessions,
    specs: Option<Vec<ToolSpec>>,
    /// Model requests of this attempt that produced no journaled answer (failed, retried).
    unanswered_model_calls: u32,
    traceparent: Option<String>,
}

impl<'a> Attempt<'a> {
    async fn start(
        rt: &'a AgentRuntime,
        task: &'a Task,
        ctx: &'a TaskContext,
        def: AgentDefinition,
    ) -> Step<Attempt<'a>> {
        let (state, journal) = match rt.journal_home(task) {
            JournalHome::Engine => match ctx.read_journal().await {
                Ok(j) => {
                    rt.capabilities.journal_answered();
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
            JournalHome::Nowhere => (Replayed::empty(), JournalHome::Nowhere),
        };
        if state.turns > 0 || state.input.is_some() {
            tracing::info!(
                resumed_steps = state.next_seq - 1,
                turns = state.turns,
                pending_tool_calls = state.pending.len(),
                "resuming the agent run from its journal"
            );
        }
        let traceparent = task.trace_parent.as_ref().map(|t| t.child_header());
        let tools = ToolSessions::new(
            rt.tool_http.clone(),
            def.tool_servers.clone(),
            Arc::new(LeaseCredentials { ctx: ctx.clone() }),
            traceparent.clone(),
            rt.settings.tool_sessions.clone(),
        );
        Ok(Attempt {
            rt,
            task,
            ctx,
            def,
            state,
            journal,
            tools,
            specs: None,
            unanswered_model_calls: 0,
            traceparent,
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
            self.journal(journal::input_step(seq, &instructions, &input))
                .await?;
        }
        loop {
            self.boundary()?;
            if let Some(answer) = self.state.final_answer.clone() {
                return Err(self.complete(&answer));
            }
            if let Some(next) = self.state.pending.first().cloned() {
                self.run_tool_call(next).await?;
                continue;
            }
            self.call_model().await?;
        }
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

    async fn journal(&mut self, step: JournalStep) -> Step {
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
            JournalHome::Nowhere => {}
        }
        self.state
            .apply(&step)
            .map_err(|e| technical(self.rt, self.task, format!("internal journal error: {e}")))
    }

    fn complete(&self, answer: &str) -> Outcome {
        let mut variables = Map::new();
        variables.insert(self.def.result_variable.clone(), parse_answer(answer));
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
        self.specs = Some(specs.clone());
        Ok(specs)
    }

    /// Decides what a tool error means: `Ok` to retry after a backoff, `Err` to end.
    async fn tool_error(&self, e: ToolError, tries: u32, what: &str) -> Step {
        if e.is_lease_lost() {
            return Err(Outcome::Abandoned);
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
        let budget_left = match self.def.token_budget {
            Some(budget) => {
                let used = self.state.usage.total();
                if used >= budget {
                    return Err(incident(
                        "tokenBudget spent",
                        format!(
                            "agent {}: tokenBudget {budget} spent ({used} tokens: {} in, {} out) after {} model turns without a final answer",
                            self.def.name,
                            self.state.usage.input_tokens,
                            self.state.usage.output_tokens,
                            self.state.turns
                        ),
                    ));
                }
                Some(budget - used)
            }
            None => None,
        };
        if self.state.turns >= self.def.max_turns {
            return Err(incident(
                "maxTurns reached",
                format!(
                    "agent {}: maxTurns {} reached without a final answer ({} tokens in, {} out)",
                    self.def.name,
                    self.def.max_turns,
                    self.state.usage.input_tokens,
                    self.state.usage.output_tokens
                ),
            ));
        }
        let tools = self.tool_specs().await?;
        let (instructions, _) = self.state.input.clone().unwrap_or_default();
        let request = ModelRequest {
            model: String::new(),
            system: instructions,
            messages: self.state.messages.clone(),
            tools,
            max_output_tokens: budget_left.map(|b| b.min(u32::MAX as u64) as u32),
            traceparent: self.traceparent.clone(),
        };
        let metrics = self.rt.metrics.clone();
        let mut unanswered = 0u32;
        let mut observe = |a: &CallAttempt| {
            let labels = ModelLabels {
                provider: a.model.provider.clone(),
                model: a.model.model.clone(),
                outcome: a.outcome,
            };
            metrics.model_calls.get_or_create(&labels).inc();
            metrics
                .model_call_duration
                .get_or_create(&labels)
                .observe(a.duration.as_secs_f64());
            if let Some(u) = a.usage {
                for (direction, n) in [("input", u.input_tokens), ("output", u.output_tokens)] {
                    metrics
                        .model_tokens
                        .get_or_create(&ModelTokenLabels {
                            provider: a.model.provider.clone(),
                            model: a.model.model.clone(),
                            direction,
                        })
                        .inc_by(n);
                }
            } else {
                unanswered += 1;
            }
        };
        let result = tokio::select! {
            r = call_with_fallback_observed(
                &self.rt.providers,
                &self.def.models,
                &request,
                &self.rt.settings.model_retry,
                &mut observe,
            ) => r,
            _ = self.ctx.stopped() => return Err(self.released()),
        };
        self.unanswered_model_calls += unanswered;
        let (model, response) = result.map_err(|e| self.model_error(e))?;
        let seq = self.state.next_seq;
        self.journal(journal::model_step(
            seq,
            &model.to_string(),
            &response.message,
            response.usage,
            &response.stop_reason,
        ))
        .await
    }

    fn model_error(&self, e: ModelCallError) -> Outcome {
        match e {
            ModelCallError::AllUnavailable { retry_after, .. } => {
                tracing::warn!(error = %e, retry_after_ms = retry_after.as_millis() as u64, "every model is unavailable; deferring the attempt without consuming a retry");
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
            ModelCallError::Task { .. } | ModelCallError::ContextTooLong { .. } => {
                incident("the model refused the request", e.to_string())
            }
        }
    }

    async fn run_tool_call(&mut self, pending: PendingCall) -> Step {
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
                self.count_tool(&call, "unknown_tool");
                return self.finish_tool(&call, None, result).await;
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
                self.count_tool(&call, "bad_arguments");
                return self.finish_tool(&call, None, result).await;
            }
        };
        let read_only = spec.is_some_and(|s| s.read_only) && pending.started_key.is_none();
        let key = match (&pending.started_key, read_only) {
            (Some(key), _) => Some(key.clone()),
            (None, true) => None,
            (None, false) => {
                let seq = self.state.next_seq;
                let key = journal::write_key(&self.task.id, seq);
                self.journal(journal::tool_started_step(seq, &key, &call))
                    .await?;
                Some(key)
            }
        };
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
        self.count_tool(
            &call,
            if result.is_error {
                "error_result"
            } else {
                "ok"
            },
        );
        self.finish_tool(&call, key.as_deref(), result).await
    }

    async fn finish_tool(
        &mut self,
        call: &ToolCall,
        key: Option<&str>,
        result: ToolResult,
    ) -> Step {
        let seq = self.state.next_seq;
        self.journal(journal::tool_finished_step(seq, key, call, &result))
            .await
    }

    fn count_tool(&self, call: &ToolCall, outcome: &'static str) {
        self.rt
            .metrics
            .tool_calls
            .get_or_create(&ToolLabels {
                server: call.server.clone(),
                tool: call.tool.clone(),
                outcome,
            })
            .inc();
    }
}

/// The final answer as a process variable: parsed JSON when it is JSON (also inside a
/// ```json fence), else the text.
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
    let attempt = task.attempt.unwrap_or(1).saturating_sub(1);
    let retry_timeout = rt.settings.technical_retry.delay(attempt);
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

#[cfg(test)]
mod tests {
    use super::*;

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
