//! Who decided, as the engine recorded it: for a call of a tool server whose registry entry
//! names `approvers` (`tools::server_scope`), a decision read from the decision variable counts
//! only when the engine's activity history (`GET /v1/process-instances/{id}/history`, read page
//! by page from the newest) shows that the variables were written, between the task that asked
//! and the task that carries the answer, only by those approvers completing a user task. A
//! process variable is anybody's to write (a script task copying the visible `requestId`, a
//! user task the process author owns, the variables API); the history's `actor` is the engine's
//! word, provided its security is on, which an unauthenticated read tells (a secured engine
//! refuses it).
//!
//! What the real engine 0.11 records (its `ActivityHistoryService`, `AbadaEngine`,
//! `ExternalTaskCommandService`): the worker's completion of the asking task writes
//! `EVENT_CORRELATED` (the agent's activity), the new user task's `TASK_CREATED`, then
//! `EXTERNAL_TASK_COMPLETED` with `details.externalTaskId`; a person's completion of a user
//! task writes `TASK_COMPLETED` with the completer as `actor` (nothing of its variables); the
//! fetch that locks the answering task writes `EXTERNAL_TASK_LOCKED` with its id. A PATCH of
//! variables writes `VARIABLES_UPDATED` naming them; another worker's completion,
//! `EXTERNAL_TASK_COMPLETED` (and `EVENT_CORRELATED`); a timer, `TIMER_JOB_COMPLETED` by
//! `system`. Script tasks, Java-class service tasks and gateway conditions run inside the
//! engine's `advance` (the move a completion, a message or a timer makes) and write no entry:
//! so the approver's completion must be the last move before the answering task, and what the
//! author's code does within that very move, on the path from the approval task to the agent,
//! is out of the worker's sight (docs/THREAT_MODEL.md).

use std::collections::VecDeque;

use super::approval::{Decision, PendingRequest};
use super::attempt::Attempt;
use super::scope::{Step, incident};
use crate::conversation::ToolCall;
use crate::engine::{AnonymousAccess, EngineError, HistoryEvent};
use crate::handler::TaskError;
use crate::tools::server_scope::Approvers;

/// The most history pages read back from the newest to find the task that asked: 5,000
/// entries, far more than a person's decision lets happen in between.
const MAX_HISTORY_PAGES: u32 = 50;

/// Entries that write no process variable and move no token, as the engine 0.11 records them.
/// Every other entry (and any the worker does not know) may have written the decision: a
/// completion or a message writes variables, and every move of the token may run the author's
/// code (a script task, a Java-class service task, a JavaScript condition) that writes them out
/// of the history's sight. `TIMER_JOB_COMPLETED` is such a move, by `system`, never an approver.
const WRITES_NOTHING: &[&str] = &[
    "TASK_CREATED",
    "TASK_ASSIGNED",
    "TASK_CLAIMED",
    "TASK_UNCLAIMED",
    "TASK_FAILED",
    "EXTERNAL_TASK_LOCKED",
    "EXTERNAL_TASK_LOCK_EXTENDED",
    "EXTERNAL_TASK_FAILED",
    "EXTERNAL_TASK_RETRIES_SET",
    "TIMER_JOB_FAILED",
    "PROCESS_SUSPENDED",
    "PROCESS_RESUMED",
    "PROCESS_FAILED",
    "PROCESS_CANCELLED",
];

/// What a decision must be checked against.
pub(crate) struct Witness<'a> {
    /// The server whose approvers decide (for messages).
    pub server: &'a str,
    pub approvers: &'a Approvers,
    /// The task that completed asking (journaled with the request).
    pub asking_task: &'a str,
    /// The task carrying the decision now.
    pub answering_task: &'a str,
    /// The agent's activity: the engine's `EVENT_CORRELATED` there belongs to a completion of
    /// one of its external tasks, recorded as `EXTERNAL_TASK_COMPLETED` too.
    pub agent_activity: Option<&'a str>,
    /// The decision variable's name (a `VARIABLES_UPDATED` naming others is harmless).
    pub decision_variable: &'a str,
}

/// Why the engine's record does not show an approver's decision; the decision performs
/// nothing (an incident, the request still open).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NotAttested {
    #[error(
        "the engine answered a read of the activity history sent with no identity: its security is disabled, so the actor it records is whatever a caller names (X-User), and no decision on tool server {server:?} can be told from a forgery; nothing was performed. Run the engine with abada.security.mode oidc or proxy"
    )]
    EngineOpen { server: String },
    #[error(
        "the engine's activity history of process instance {instance:?} does not show the completion of task {task} that asked for this decision (EXTERNAL_TASK_COMPLETED with that externalTaskId){within}; nothing was performed"
    )]
    AskingTaskNotFound {
        instance: String,
        task: String,
        within: String,
    },
    #[error(
        "no approver of tool server {server:?} completed a user task between the request and this task, as the engine's activity history records it: whatever wrote the decision variable (a script or service task, a form that is not the approval task, the variables API) is not an approver's decision; nothing was performed. The approval must be given by completing the process's approval task as one of the approvers ABADA_AGENT_TOOLS_FILE lists for {server:?}"
    )]
    NoApproverCompletion { server: String },
    #[error(
        "the engine's activity history records {event} at {activity} by {actor:?} between the request and this task, and {actor:?} is not an approver of tool server {server:?} in ABADA_AGENT_TOOLS_FILE: the decision variable may be theirs; nothing was performed"
    )]
    NotAnApprover {
        server: String,
        event: String,
        activity: String,
        actor: String,
    },
}

/// The approver who decided, by the engine's `history` of the instance (oldest first): every
/// entry after the asking task's `EXTERNAL_TASK_COMPLETED` and before the answering task's last
/// `EXTERNAL_TASK_LOCKED` (its variables are the instance's at that lock) that may have written
/// the decision variable must be by an approver, and one of them a `TASK_COMPLETED`; the last
/// such completion's actor is the one named.
pub(crate) fn judge(
    instance: &str,
    history: &[HistoryEvent],
    w: &Witness<'_>,
) -> Result<String, NotAttested> {
    let about = |e: &HistoryEvent, kind: &str, task: &str| {
        e.event_type == kind
            && e.details.get("externalTaskId").and_then(|v| v.as_str()) == Some(task)
    };
    let start = history
        .iter()
        .rposition(|e| about(e, "EXTERNAL_TASK_COMPLETED", w.asking_task))
        .ok_or_else(|| NotAttested::AskingTaskNotFound {
            instance: instance.to_string(),
            task: w.asking_task.to_string(),
            within: String::new(),
        })?;
    let end = history
        .iter()
        .rposition(|e| about(e, "EXTERNAL_TASK_LOCKED", w.answering_task))
        .filter(|end| *end > start)
        .unwrap_or(history.len());
    let mut decided_by = None;
    for e in &history[start + 1..end] {
        if !may_write_decision(e, w) {
            continue;
        }
        if !w.approvers.allows(&e.actor) {
            return Err(NotAttested::NotAnApprover {
                server: w.server.to_string(),
                event: e.event_type.clone(),
                activity: e
                    .activity_id
                    .clone()
                    .unwrap_or_else(|| "the instance".into()),
                actor: e.actor.clone(),
            });
        }
        if e.event_type == "TASK_COMPLETED" {
            decided_by = Some(e.actor.clone());
        }
    }
    decided_by.ok_or_else(|| NotAttested::NoApproverCompletion {
        server: w.server.to_string(),
    })
}

/// Whether entry `e` may have written the decision variable.
fn may_write_decision(e: &HistoryEvent, w: &Witness<'_>) -> bool {
    let kind = e.event_type.as_str();
    if WRITES_NOTHING.contains(&kind) {
        return false;
    }
    match kind {
        // The engine's record of an external task of the agent's node completing; that
        // completion has its own EXTERNAL_TASK_COMPLETED (written after it, same transaction).
        "EVENT_CORRELATED" => {
            w.agent_activity.is_none() || e.activity_id.as_deref() != w.agent_activity
        }
        // A PATCH naming other variables only cannot have written the decision.
        "VARIABLES_UPDATED" => match e.details.get("variableNames").and_then(|v| v.as_array()) {
            Some(names) => names
                .iter()
                .any(|n| n.as_str() == Some(w.decision_variable)),
            None => true,
        },
        _ => true,
    }
}

impl Attempt<'_> {
    /// `decision` as it may be acted on: unchanged when `call`'s server names no approvers;
    /// else with the engine's name for who decided (`engine_actor`), or an incident saying why
    /// the engine's record does not show an approver's decision (nothing performed, nothing
    /// consumed: the request stays open).
    pub(super) async fn attest_decision(
        &self,
        call: &ToolCall,
        request: &PendingRequest,
        mut decision: Decision,
    ) -> Step<Decision> {
        let Some(approvers) = self
            .scope
            .rt
            .tool_registry
            .as_deref()
            .and_then(|r| r.approvers(&call.server))
        else {
            return Ok(decision);
        };
        let unusable = |e: NotAttested| {
            self.scope.rt.metrics.count_approval("unattested");
            incident("the approval decision cannot be used", e.to_string())
        };
        let task = self.scope.task;
        let Some(instance) = task.process_instance_id.as_deref() else {
            return Err(unusable(NotAttested::NoApproverCompletion {
                server: call.server.clone(),
            }));
        };
        let ctx = self.scope.ctx;
        match ctx.anonymous_history_read(instance).await {
            Ok(AnonymousAccess::Refused) => {}
            Ok(AnonymousAccess::Answered) => {
                return Err(unusable(NotAttested::EngineOpen {
                    server: call.server.clone(),
                }));
            }
            Err(e) => return Err(self.history_failed(e, instance)),
        }
        let witness = Witness {
            server: &call.server,
            approvers,
            asking_task: &request.task_id,
            answering_task: &task.id,
            agent_activity: task.activity_id.as_deref(),
            decision_variable: &self.def.approval_variables.decision,
        };
        let history = self
            .history_since_asking(instance, &request.task_id)
            .await?;
        let actor = match history {
            Some(history) => judge(instance, &history, &witness).map_err(unusable)?,
            None => {
                return Err(unusable(NotAttested::AskingTaskNotFound {
                    instance: instance.to_string(),
                    task: request.task_id.clone(),
                    within: format!(
                        " within its newest {} entries",
                        MAX_HISTORY_PAGES * crate::engine::HISTORY_PAGE_SIZE
                    ),
                }));
            }
        };
        tracing::info!(call_id = %call.call_id, server = %call.server, approver = %actor, "the engine records an approver of the server completing the approval task");
        decision.engine_actor = Some(actor);
        Ok(decision)
    }

    /// The instance's history from the page holding the asking task's completion to the
    /// newest, oldest first; `None` when that completion is not within
    /// [`MAX_HISTORY_PAGES`] of the newest. Pages are numbered from the oldest, so pages read
    /// while new entries arrive stay put.
    async fn history_since_asking(
        &self,
        instance: &str,
        asking_task: &str,
    ) -> Step<Option<Vec<HistoryEvent>>> {
        let ctx = self.scope.ctx;
        let read = |page| async move {
            ctx.process_history(instance, page)
                .await
                .map_err(|e| self.history_failed(e, instance))
        };
        let first = read(0).await?;
        let total = first.total_pages.unwrap_or(1).max(1);
        let asked = |events: &[HistoryEvent]| {
            events.iter().any(|e| {
                e.event_type == "EXTERNAL_TASK_COMPLETED"
                    && e.details.get("externalTaskId").and_then(|v| v.as_str()) == Some(asking_task)
            })
        };
        let mut pages: VecDeque<Vec<HistoryEvent>> = VecDeque::new();
        let mut found = false;
        for page in (1..total).rev() {
            if total - page > MAX_HISTORY_PAGES {
                return Ok(None);
            }
            let events = read(page).await?.events;
            found = asked(&events);
            pages.push_front(events);
            if found {
                break;
            }
        }
        if !found {
            pages.push_front(first.events);
        }
        Ok(Some(pages.into_iter().flatten().collect()))
    }

    /// A history read that failed: a refusal or an answer that cannot be used is an incident
    /// naming what the worker needs; anything else a technical failure (retried; the decision
    /// stays unread and unconsumed).
    fn history_failed(&self, e: TaskError, instance: &str) -> super::Outcome {
        match e {
            TaskError::Engine(
                e @ (EngineError::AccessDenied { .. }
                | EngineError::NotFound { .. }
                | EngineError::MalformedResponse { .. }
                | EngineError::TooLarge { .. }
                | EngineError::Unauthenticated { .. }),
            ) => {
                self.scope.rt.metrics.count_approval("unattested");
                incident(
                    "the approval decision cannot be used",
                    format!(
                        "the tool server's approvers are checked against the engine's activity history of process instance {instance:?}, which cannot be read ({e}); nothing was performed. Grant the worker's identity operations:read (OIDC scope operations:read; behind a proxy, the permission operations:read or the group abada-operator), then set the task's retries"
                    ),
                )
            }
            e => self.scope.call_failed(
                e,
                "cannot read the engine's activity history to check who decided",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn event(kind: &str, actor: &str, activity: &str, details: Value) -> HistoryEvent {
        HistoryEvent {
            event_type: kind.into(),
            actor: actor.into(),
            activity_id: Some(activity.into()),
            details: serde_json::from_value::<Map<String, Value>>(details).unwrap(),
        }
    }

    fn approvers() -> Approvers {
        Approvers {
            users: vec!["alice".into()],
        }
    }

    /// The engine's entries for one approval round trip (the order `ExternalTaskCommandService`
    /// and `AbadaEngine` write them), with `between` after the asking task's completion.
    fn round_trip(between: Vec<HistoryEvent>) -> Vec<HistoryEvent> {
        let mut h = vec![
            event("PROCESS_STARTED", "starter", "start", json!({})),
            event(
                "EXTERNAL_TASK_LOCKED",
                "worker",
                "refundAgent",
                json!({"externalTaskId": "t1"}),
            ),
            event("EVENT_CORRELATED", "worker", "refundAgent", json!({})),
            event(
                "TASK_CREATED",
                "worker",
                "approveRefund",
                json!({"assignee": ""}),
            ),
            event(
                "EXTERNAL_TASK_COMPLETED",
                "worker",
                "refundAgent",
                json!({"externalTaskId": "t1"}),
            ),
        ];
        h.extend(between);
        h.push(event(
            "EXTERNAL_TASK_LOCKED",
            "worker",
            "refundAgent",
            json!({"externalTaskId": "t2"}),
        ));
        h
    }

    fn judged(history: &[HistoryEvent]) -> Result<String, NotAttested> {
        let a = approvers();
        judge(
            "pi-1",
            history,
            &Witness {
                server: "orders",
                approvers: &a,
                asking_task: "t1",
                answering_task: "t2",
                agent_activity: Some("refundAgent"),
                decision_variable: "agentApproval",
            },
        )
    }

    #[test]
    fn an_approvers_completion_is_the_decision_and_anyone_elses_write_is_not() {
        let alice = event("TASK_COMPLETED", "alice", "approveRefund", json!({}));
        assert_eq!(judged(&round_trip(vec![alice.clone()])), Ok("alice".into()));
        // Claims, harmless PATCHes and the answering task's own entries do not matter.
        let fine = vec![
            event(
                "TASK_CLAIMED",
                "alice",
                "approveRefund",
                json!({"assignee": "alice"}),
            ),
            event(
                "VARIABLES_UPDATED",
                "ops",
                "",
                json!({"variableNames": ["note"]}),
            ),
            alice.clone(),
        ];
        assert_eq!(judged(&round_trip(fine)), Ok("alice".into()));
        // Nobody completed a user task: a script task wrote the decision out of sight.
        assert!(matches!(
            judged(&round_trip(vec![])),
            Err(NotAttested::NoApproverCompletion { .. })
        ));
        // A user task completed by someone else, before or after the approver.
        for other in [
            event("TASK_COMPLETED", "mallory", "authorsOwnTask", json!({})),
            event(
                "VARIABLES_UPDATED",
                "mallory",
                "",
                json!({"variableNames": ["agentApproval"]}),
            ),
            event("VARIABLES_UPDATED", "mallory", "", json!({})),
            event(
                "EXTERNAL_TASK_COMPLETED",
                "other-worker",
                "copyTask",
                json!({"externalTaskId": "x"}),
            ),
            event("EVENT_CORRELATED", "mallory", "messageCatch", json!({})),
            // A timer moved the token on its own: a script after it is out of sight.
            event(
                "TIMER_JOB_COMPLETED",
                "system",
                "wait",
                json!({"jobId": "j"}),
            ),
            event("SOMETHING_NEW", "mallory", "x", json!({})),
        ] {
            for history in [
                round_trip(vec![other.clone(), alice.clone()]),
                round_trip(vec![alice.clone(), other.clone()]),
            ] {
                let e = judged(&history).unwrap_err();
                assert!(
                    matches!(&e, NotAttested::NotAnApprover { actor, .. } if actor != "alice"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn the_window_is_from_the_asking_completion_to_the_answering_lock() {
        let alice = event("TASK_COMPLETED", "alice", "approveRefund", json!({}));
        // An approver's completion before the request does not answer it.
        let mut early = vec![alice.clone()];
        early.extend(round_trip(vec![]));
        assert!(judged(&early).is_err());
        // A write after the answering task was locked is not in its variables.
        let mut late = round_trip(vec![alice.clone()]);
        late.push(event("TASK_COMPLETED", "mallory", "x", json!({})));
        assert_eq!(judged(&late), Ok("alice".into()));
        // A lock of the answering task before a later one: the later one ends the window.
        let relocked = round_trip(vec![
            alice.clone(),
            event(
                "EXTERNAL_TASK_LOCKED",
                "worker",
                "refundAgent",
                json!({"externalTaskId": "t2"}),
            ),
            event(
                "VARIABLES_UPDATED",
                "mallory",
                "",
                json!({"variableNames": ["agentApproval"]}),
            ),
        ]);
        assert!(judged(&relocked).is_err());
        // No record of the asking task at all.
        assert!(matches!(
            judged(&[alice]),
            Err(NotAttested::AskingTaskNotFound { .. })
        ));
    }
}
