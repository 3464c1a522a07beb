//! The tool calls of one attempt: the task's tool sessions and their listing, one call in its
//! `execute_tool` span (a keyed write journaled `tool/started` before it is sent, its key kept
//! across retries and resumes), what a tool error means (retry, incident, technical failure),
//! the result capped and journaled, and the lease's tool credentials (protocol.md B.3).

use async_trait::async_trait;
use serde_json::Value;
use tracing::{Instrument, Span};

use super::attempt::Attempt;
use super::journal::{self, ApprovalState, PendingCall};
use super::scope::{Step, incident};
use crate::conversation::{ToolCall, ToolResult, ToolSpec};
use crate::handler::{Outcome, TaskContext, TaskError};
use crate::metrics::ToolLabels;
use crate::secret::Secret;
use crate::telemetry::spans;
use crate::tools::{CredentialError, CredentialSource, ToolError};

/// The engine's tool-credential call for this task's lease (protocol.md B.3).
pub(super) struct LeaseCredentials {
    pub(super) ctx: TaskContext,
}

#[async_trait]
impl CredentialSource for LeaseCredentials {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        let credential = self.ctx.tool_credential(server).await;
        // SIM-BUG (feature `sim-bugs`, selected at run time): the credential logged.
        #[cfg(feature = "sim-bugs")]
        if let Ok(c) = &credential
            && crate::sim_bugs::active(crate::sim_bugs::Bug::CredentialLogged)
        {
            tracing::debug!(server, token = c.token.expose(), "tool credential received");
        }
        credential.map(|c| Some(c.token)).map_err(|e| match e {
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

impl Attempt<'_> {
    pub(super) async fn tool_specs(&mut self) -> Step<Vec<ToolSpec>> {
        if let Some(specs) = &self.tools.specs {
            return Ok(specs.clone());
        }
        let mut tries = 0;
        let specs = loop {
            tries += 1;
            // Biased, the answer first: a listing that came in as the worker stops is kept.
            let result = tokio::select! {
                biased;
                r = self.tools.sessions.tools() => r,
                _ = self.scope.ctx.stopped() => return Err(self.scope.released()),
            };
            match result {
                Ok(specs) => break specs,
                Err(e) => self.tool_error(e, tries, "listing tools").await?,
            }
        };
        self.tools.names.declare_tools(&specs);
        self.tools.specs = Some(specs.clone());
        Ok(specs)
    }

    /// Decides what a tool error means: `Ok` to retry after a backoff, `Err` to end.
    pub(super) async fn tool_error(&self, e: ToolError, tries: u32, what: &str) -> Step {
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
        if e.is_transient() && tries < self.scope.rt.settings.tool_attempts {
            let wait = self
                .scope
                .rt
                .settings
                .tool_backoff
                .delay(tries - 1, &self.scope.rt.random);
            tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying");
            // Biased, the stop first: no retry begins once the worker stops.
            tokio::select! {
                biased;
                _ = self.scope.ctx.stopped() => return Err(self.scope.released()),
                _ = tokio::time::sleep(wait) => return Ok(()),
            }
        }
        Err(self.scope.technical(format!("{what} failed: {e}")))
    }

    /// How many of `calls` would be keyed writes: calls of a listed tool that is a write
    /// ([`ToolSpec::is_write`]), with object arguments (what [`Attempt::run_tool_call`]
    /// journals as `tool/started`).
    pub(super) fn keyed_writes_in(&self, calls: &[ToolCall]) -> u32 {
        let specs = self.tools.specs.as_deref().unwrap_or_default();
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

    /// One tool call, in its `execute_tool` span (the journal writes about it included).
    pub(super) async fn run_tool_call(&mut self, pending: PendingCall) -> Step {
        let span = spans::execute_tool(&spans::ToolSpan {
            server: &pending.call.server,
            tool: &pending.call.tool,
            call_id: &pending.call.call_id,
        });
        self.tools.last_outcome = None;
        let result = self
            .tool_call(pending, &span)
            .instrument(span.clone())
            .await;
        spans::record_tool_end(&span, self.tools.last_outcome, result.is_err());
        result
    }

    pub(super) async fn tool_call(&mut self, pending: PendingCall, span: &Span) -> Step {
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
                // The names as the model sees them (`server__tool`): a name it can call.
                let names = crate::provider::tool_names::ToolNames::new(&specs);
                let offered: Vec<String> = specs
                    .iter()
                    .map(|s| names.function_name(&s.server, &s.tool))
                    .collect();
                let result = ToolResult::error_text(format!(
                    "There is no tool {:?}{}. Tool names are exact (case and prefix included): the tools offered are {}.",
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
                let key = self
                    .journal
                    .write_key(&self.scope.task.id, seq, &call, &arguments);
                self.record(journal::tool_started_step(seq, &key, &call))
                    .await?;
                Some(key)
            }
        };
        spans::record_tool_call(span, key.as_deref(), &arguments);
        let mut tries = 0;
        let result = loop {
            tries += 1;
            // Biased, the answer first: a call answered as the worker stops is journaled, not
            // sent again by the next attempt.
            let r = tokio::select! {
                biased;
                r = self.tools.sessions.call(&call.server, &call.tool, arguments.clone(), key.as_deref()) => r,
                _ = self.scope.ctx.stopped() => return Err(self.scope.released()),
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

    pub(super) async fn finish_tool(
        &mut self,
        span: &Span,
        call: &ToolCall,
        key: Option<&str>,
        result: ToolResult,
    ) -> Step {
        // Every result the model and the journal see is capped here, whatever produced it: a
        // server's result, its error message, or the worker's own (unknown tool, bad arguments).
        let result = crate::tools::cap_result(
            result,
            self.scope.rt.settings.tool_sessions.max_result_bytes,
        );
        spans::record_tool_result(span, &result);
        let seq = self.state.next_seq;
        self.record(journal::tool_finished_step(seq, key, call, &result))
            .await
    }

    /// Counts a tool call's outcome (a failed try included) and puts it on its span.
    pub(super) fn count_tool(&mut self, span: &Span, call: &ToolCall, outcome: &'static str) {
        spans::record_tool_outcome(span, outcome);
        self.tools.last_outcome = Some(outcome);
        let (server, tool) = self.tools.names.tool(&call.server, &call.tool);
        self.scope
            .rt
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
