//! The approval gate of one attempt (`agent::approval` is the pure part): before a pending
//! call runs, whether it needs a person's decision; the request journaled and the task
//! completed asking for it; the decision read from the next task, checked against the request
//! (and, for a server with approvers, against the engine's record of who completed the task:
//! `agent::approver`) and journaled before it is acted on.

use tracing::Instrument;

use super::AgentRuntime;
use super::approval::{self, ApprovalRules};
use super::attempt::Attempt;
use super::definition::AgentDefinition;
use super::journal::{self, ApprovalState, PendingCall};
use super::scope::{Step, incident};
use crate::conversation::ToolCall;
use crate::handler::Outcome;
use crate::telemetry::spans;
use serde_json::{Map, json};

/// Which calls of `def` wait for a person: its own approval and that of each registry server it
/// uses (the operator's floor, which no definition lowers).
pub(super) fn approval_rules(rt: &AgentRuntime, def: &AgentDefinition) -> ApprovalRules {
    ApprovalRules {
        definition: def.approval.clone(),
        servers: rt
            .tool_registry
            .as_deref()
            .map(|r| r.approval_policies(&def.tool_servers))
            .unwrap_or_default(),
    }
}

impl Attempt<'_> {
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
    pub(super) async fn approval_gate(&mut self, next: &PendingCall) -> Step<bool> {
        // A call already put to a person waits for their decision even when no rule asks for
        // approval any more (the registry changed since): the journal holds the request.
        if next.started_key.is_some()
            || (!self.approval.may_stop() && self.state.approval.is_none())
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
                .is_some_and(|spec| {
                    self.approval.needs_approval(
                        spec,
                        &call.arguments,
                        &self.state.performed_without_approval,
                    )
                });
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
            Some(ApprovalState::Requested(request)) if request.task_id == self.scope.task.id => {
                Err(self.stop_for_approval(call, &request))
            }
            Some(ApprovalState::Requested(request)) => {
                self.same_call_as_requested(call, &request)?;
                let read = approval::read_decision(
                    &self.scope.task.variables,
                    &self.def.approval_variables.decision,
                    &request,
                    &self.state.consumed_requests,
                );
                let decision = match read {
                    Ok(d) => d,
                    Err(e) if e.asks_again() => {
                        tracing::info!(call_id = %call.call_id, "{e}");
                        self.scope.rt.metrics.count_approval("requested_again");
                        return Err(self.stop_for_approval(call, &request));
                    }
                    Err(e) => {
                        self.scope.rt.metrics.count_approval("unusable");
                        return Err(incident(
                            "the approval decision cannot be used",
                            e.to_string(),
                        ));
                    }
                };
                // The operator's approvers: the engine's record of who completed the task.
                let decision = self.attest_decision(call, &request, decision).await?;
                let seq = self.state.next_seq;
                self.record(journal::approval_decided_step(seq, &decision))
                    .await?;
                self.scope.rt.metrics.count_approval(if decision.approved {
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
    pub(super) async fn request_approval(&mut self, call: &ToolCall) -> Step<Outcome> {
        // Only a run kept under its process visit can be found by the task carrying the
        // decision: a run that began where no approval applied (kept under its task, or in the
        // engine's journal) and now meets one (the registry changed since) stops here.
        if !self.journal.run_key().is_some_and(|k| k.is_per_visit()) {
            return Err(incident(
                "the call needs a person's approval, but this run cannot wait for one",
                format!(
                    "call {} ({} of server {}) needs approval now, but the run began when no approval applied to it and is kept where no task carrying a decision can find it; nothing was performed. Let the run finish without that approval (restore the registry's approval for the server while it runs), or complete the task by hand",
                    call.call_id, call.tool, call.server
                ),
            ));
        }
        let request =
            approval::PendingRequest::new(call, &self.scope.task.id, &self.scope.rt.random);
        let seq = self.state.next_seq;
        self.record(journal::approval_requested_step(seq, &request))
            .await?;
        self.scope.rt.metrics.count_approval("requested");
        Ok(self.stop_for_approval(call, &request))
    }

    /// The call waiting is exactly the one put to the person (server, tool and arguments, by
    /// the digest journaled with the request); anything else performs nothing: an incident.
    pub(super) fn same_call_as_requested(
        &self,
        call: &ToolCall,
        request: &approval::PendingRequest,
    ) -> Step {
        if request.is_for(call) {
            return Ok(());
        }
        self.scope.rt.metrics.count_approval("unusable");
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
    pub(super) fn stop_for_approval(
        &mut self,
        call: &ToolCall,
        request: &approval::PendingRequest,
    ) -> Outcome {
        self.journal.await_decision();
        let summary = self.state.messages.iter().rev().find_map(|m| match m {
            crate::conversation::Message::Assistant(a) => Some(a.text.clone().unwrap_or_default()),
            _ => None,
        });
        let run_key = self
            .journal
            .run_key()
            .map(|k| k.to_string())
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
}
