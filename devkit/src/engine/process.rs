//! Process instances: the little of BPMN the approval flow needs, run the way the real engine
//! 0.11 runs it (observed, /work/notes/real-engine.md §8). A [`ProcessModel`] is a graph of
//! service tasks (an external task on a topic), user tasks, script tasks, exclusive gateways and
//! end events; an instance carries the process variables and waits at one node at a time.
//!
//! The engine's rules kept here:
//! - completing an external task or a user task merges its variables into the instance (top
//!   level, whole values replaced) and moves the token on; variables written earlier persist, so
//!   a stale `agentStatus` routes again unless the worker sets it;
//! - a gateway takes the first flow whose condition holds, in model order, else its default flow,
//!   else the completion is refused with 400 "No matching condition and no default flow for
//!   gateway {id}" and nothing changes (the external task stays locked);
//! - reaching a service task creates a NEW external task: a new id, the same
//!   `processInstanceId` and `activityId`, `retries` 3, every process variable; there is no loop
//!   counter;
//! - a user task is listed, claimed and completed through `/api/v1/tasks` (see `process_api`);
//!   the caller is who the security mode says (`X-User` with groups `X-Groups` in the engine's
//!   `disabled` mode, the proxy's headers in `proxy` mode); a candidate may complete without
//!   claiming;
//! - a script task runs inside the move that reaches it and records no history entry; a move
//!   that comes back to a node it passed (the task it resumed from included) stops there and
//!   the token ends (`ProcessInstance.advance`'s `processedInThisRun`).
//!
//! Honest limits: a condition is only `${variable == 'value'}` (string, number or boolean), not
//! the engine's JavaScript; a script only sets variables from templates (below); no timers;
//! models are built in code (no BPMN parsing); a new external task has no `traceParent`; the JWT
//! mode's user-task API still takes `X-User` (the engine takes the token's
//! `preferred_username`).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A process the emulator can start.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessModel {
    /// The BPMN process id (`processId` of the start call).
    pub id: String,
    pub name: String,
    /// The node the start event leads to.
    pub start: String,
    pub nodes: Vec<ProcessNode>,
}

/// One flow node, named by its BPMN element id (the `activityId` of its tasks).
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessNode {
    pub id: String,
    pub kind: NodeKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum NodeKind {
    /// `camunda:topic`: an external task. `agent` is the agent/1 definition the emulator sends
    /// with it (the real engine sends none).
    ServiceTask {
        topic: String,
        agent: Option<Value>,
        next: String,
    },
    UserTask {
        name: String,
        candidate_groups: Vec<String>,
        next: String,
    },
    ExclusiveGateway {
        flows: Vec<ConditionalFlow>,
        default: Option<String>,
    },
    /// A JavaScript script task, run by the engine inside the move that reaches it
    /// (`ProcessInstance.executeScript`: the variables are bound as globals, and after the
    /// script every global is written back, so `agentApproval = ...` sets a variable, while
    /// `variables.put(..)` only adds new ones: the bound old value is written back after it)
    /// and recording no history entry. `script` is its text (for the BPMN); what it does is
    /// `writes`: each variable set to its value, where a string `"${a.b}"` is the value at that
    /// path of the variables as the script found them (the little of JavaScript the emulator
    /// runs).
    ScriptTask {
        script: String,
        writes: Map<String, Value>,
        next: String,
    },
    End,
}

/// `${variable == 'equals'}` leading to `target`.
#[derive(Debug, Clone, PartialEq)]
pub struct ConditionalFlow {
    pub variable: String,
    pub equals: Value,
    pub target: String,
}

impl ProcessModel {
    /// The worked example `examples/refund-approval.bpmn` (process `refundApproval`): start →
    /// `refundAgent` (topic `abada:agent`) → gateway `agentOutcome`: `${agentStatus ==
    /// 'approval-required'}` → user task `approveRefund` "Approve refund" (candidate group
    /// `refund-approvers`) → back to `refundAgent`; default → end.
    pub fn refund_approval(agent: Option<Value>) -> Self {
        let node = |id: &str, kind| ProcessNode {
            id: id.into(),
            kind,
        };
        ProcessModel {
            id: "refundApproval".into(),
            name: "Refund with approval".into(),
            start: "refundAgent".into(),
            nodes: vec![
                node(
                    "refundAgent",
                    NodeKind::ServiceTask {
                        topic: super::AGENT_TOPIC.into(),
                        agent,
                        next: "agentOutcome".into(),
                    },
                ),
                node(
                    "agentOutcome",
                    NodeKind::ExclusiveGateway {
                        flows: vec![ConditionalFlow {
                            variable: "agentStatus".into(),
                            equals: Value::from("approval-required"),
                            target: "approveRefund".into(),
                        }],
                        default: Some("end".into()),
                    },
                ),
                node(
                    "approveRefund",
                    NodeKind::UserTask {
                        name: "Approve refund".into(),
                        candidate_groups: vec!["refund-approvers".into()],
                        next: "refundAgent".into(),
                    },
                ),
                node("end", NodeKind::End),
            ],
        }
    }

    fn node(&self, id: &str) -> Option<&ProcessNode> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// Where a token comes to rest.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Wait {
    /// An external task to create.
    External {
        activity_id: String,
        topic: String,
        agent: Option<Value>,
    },
    User {
        activity_id: String,
        name: String,
        candidate_groups: Vec<String>,
    },
    End {
        activity_id: String,
    },
}

/// At most this many gateways in a row: a model whose gateways route in a circle is refused
/// instead of looping.
const MAX_GATEWAY_HOPS: usize = 64;

/// Follows the flow from `from` over gateways and script tasks (which write `variables`) to
/// the next node that waits. `resumed` is the task whose completion moves the token: as in the
/// engine's `ProcessInstance.advance` (`processedInThisRun`), a move that comes back to a node
/// it already passed (the resumed task included, e.g. a script task leading straight back to
/// the agent) stops there and the token ends: the instance completes.
pub(crate) fn walk(
    model: &ProcessModel,
    from: &str,
    variables: &mut Map<String, Value>,
    resumed: Option<&str>,
) -> Result<Wait, String> {
    let mut id = from.to_string();
    let mut passed: Vec<String> = resumed.map(str::to_string).into_iter().collect();
    for _ in 0..MAX_GATEWAY_HOPS {
        let node = model
            .node(&id)
            .ok_or_else(|| format!("Process {} has no flow node {id}", model.id))?;
        if !matches!(node.kind, NodeKind::ExclusiveGateway { .. }) && passed.contains(&id) {
            return Ok(Wait::End { activity_id: id });
        }
        passed.push(id.clone());
        match &node.kind {
            NodeKind::ServiceTask { topic, agent, .. } => {
                return Ok(Wait::External {
                    activity_id: id,
                    topic: topic.clone(),
                    agent: agent.clone(),
                });
            }
            NodeKind::UserTask {
                name,
                candidate_groups,
                ..
            } => {
                return Ok(Wait::User {
                    activity_id: id,
                    name: name.clone(),
                    candidate_groups: candidate_groups.clone(),
                });
            }
            NodeKind::End => return Ok(Wait::End { activity_id: id }),
            NodeKind::ScriptTask { writes, next, .. } => {
                let found = variables.clone();
                for (name, value) in writes {
                    variables.insert(name.clone(), substitute(value, &found));
                }
                id = next.clone();
            }
            NodeKind::ExclusiveGateway { flows, default } => {
                let taken = flows
                    .iter()
                    .find(|f| variables.get(&f.variable) == Some(&f.equals))
                    .map(|f| f.target.clone())
                    .or_else(|| default.clone());
                id = taken.ok_or_else(|| {
                    format!("No matching condition and no default flow for gateway {id}")
                })?;
            }
        }
    }
    Err(format!(
        "Process {} routes through more than {MAX_GATEWAY_HOPS} gateways in a row from {from}",
        model.id
    ))
}

/// `value` with every string `"${a.b}"` in it replaced by the value at that dotted path of
/// `variables` (null when there is none).
fn substitute(value: &Value, variables: &Map<String, Value>) -> Value {
    match value {
        Value::String(s) => match s.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
            Some(path) => {
                let mut parts = path.split('.');
                let first = parts.next().and_then(|p| variables.get(p));
                parts
                    .try_fold(first, |v, p| Some(v.and_then(|v| v.get(p))))
                    .flatten()
                    .cloned()
                    .unwrap_or(Value::Null)
            }
            None => value.clone(),
        },
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), substitute(v, variables)))
                .collect(),
        ),
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| substitute(v, variables)).collect())
        }
        other => other.clone(),
    }
}

/// The node after `activity_id` (a task's outgoing flow).
pub(crate) fn next_of(model: &ProcessModel, activity_id: &str) -> Option<String> {
    match &model.node(activity_id)?.kind {
        NodeKind::ServiceTask { next, .. }
        | NodeKind::UserTask { next, .. }
        | NodeKind::ScriptTask { next, .. } => Some(next.clone()),
        _ => None,
    }
}

/// A process instance, as `GET /api/v1/processes/instances/{id}` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInstanceView {
    pub id: String,
    pub process_definition_id: String,
    pub process_definition_name: String,
    /// Where the token waits; the end event's id once completed.
    pub current_activity_id: String,
    pub status: InstanceStatus,
    pub suspended: bool,
    pub variables: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum UserTaskStatus {
    Available,
    Claimed,
    Completed,
}

/// A user task, as `GET /api/v1/tasks` lists it (the engine's fields that a test or the demo
/// reads; `variables` are the instance's at the time of listing).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UserTaskView {
    pub id: String,
    pub task_definition_key: String,
    pub name: String,
    pub assignee: Option<String>,
    pub status: UserTaskStatus,
    pub candidate_users: Vec<String>,
    pub candidate_groups: Vec<String>,
    pub process_instance_id: String,
    pub process_definition_id: String,
    pub process_status: InstanceStatus,
    pub current_activity_id: String,
    pub variables: Map<String, Value>,
}

pub(crate) struct UserTask {
    pub id: String,
    pub instance: String,
    pub activity_id: String,
    pub name: String,
    pub candidate_groups: Vec<String>,
    pub assignee: Option<String>,
    pub status: UserTaskStatus,
}

impl UserTask {
    /// The engine's eligibility: the assignee, else a member of a candidate group.
    fn eligible(&self, user: &str, groups: &[String]) -> bool {
        match &self.assignee {
            Some(assignee) => assignee == user,
            None => self.candidate_groups.iter().any(|g| groups.contains(g)),
        }
    }
}

/// A process instance: the one record of it, whether a deployed model started it or a task
/// created through the admin API named it first. Operators suspend, cancel and fail it
/// (`state::InstanceAction`); a model's token moves it to `Completed` at its end event.
pub(crate) struct Instance {
    pub status: InstanceStatus,
    /// Separate from `status`, as in the engine: a suspended instance that a `bpmn-error` fails
    /// shows `FAILED` and suspended.
    pub suspended: bool,
    /// The model and the token; `None` for an instance only a task named (no model, so a
    /// `complete` does not end it).
    pub token: Option<Token>,
}

/// Where a started instance's token is, and the process variables it carries.
pub(crate) struct Token {
    pub model: String,
    /// The version of the model the instance started on: it runs that version's graph to its
    /// end, whatever is deployed since (the real engine pins an instance to its deployment:
    /// `AbadaEngine.java`, `processDefinitionDeploymentId`).
    pub version: i64,
    pub variables: Map<String, Value>,
    pub current: String,
}

impl Instance {
    pub fn named_by_task() -> Self {
        Instance {
            status: InstanceStatus::Running,
            suspended: false,
            token: None,
        }
    }

    pub fn started(token: Token) -> Self {
        Instance {
            token: Some(token),
            ..Instance::named_by_task()
        }
    }
}

/// Every deployed model, instance and user task.
#[derive(Default)]
pub(crate) struct Processes {
    /// The latest version of each process key: what a new instance starts on.
    pub models: HashMap<String, ProcessModel>,
    /// Every deployed version of each key, by (key, version): what a running instance runs.
    pub versions: HashMap<(String, i64), ProcessModel>,
    /// The latest deployment of each process key (the process API serves no older one).
    pub deployments: HashMap<String, Deployment>,
    /// The process API's reads answer 403 ACCESS_DENIED, as the engine does to an identity
    /// without `process:read`.
    pub reads_denied: bool,
    pub instances: BTreeMap<String, Instance>,
    pub user_tasks: BTreeMap<String, UserTask>,
    next_instance: u64,
    next_user_task: u64,
}

/// Who calls the user-task API: `X-User` and the comma-separated `X-Groups`.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub user: String,
    pub groups: Vec<String>,
}

/// What the engine keeps of a deployment, as the process API serves it.
#[derive(Debug, Clone)]
pub(crate) struct Deployment {
    pub version: i64,
    pub bpmn_xml: String,
    pub created_at_ms: i64,
}

/// A process definition, as `GET /api/v1/processes/{id}` answers it (the engine's
/// `ProcessDefinitionDto`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessDefinitionView {
    pub id: String,
    pub name: String,
    pub documentation: Option<String>,
    pub bpmn_xml: String,
    pub deployment_id: String,
    pub version: i64,
    pub created_at: String,
}

/// The XML served for a model deployed without one: its service tasks with their topics.
pub(crate) fn minimal_bpmn(model: &ProcessModel) -> String {
    let escape = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('"', "&quot;")
    };
    let mut tasks = String::new();
    for node in &model.nodes {
        if let NodeKind::ServiceTask { topic, .. } = &node.kind {
            tasks.push_str(&format!(
                "    <bpmn:serviceTask id=\"{}\" camunda:type=\"external\" camunda:topic=\"{}\"/>\n",
                escape(&node.id),
                escape(topic)
            ));
        }
    }
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<bpmn:definitions xmlns:bpmn=\"http://www.omg.org/spec/BPMN/20100524/MODEL\" xmlns:camunda=\"http://camunda.org/schema/1.0/bpmn\" id=\"defs\" targetNamespace=\"http://abada.example/devkit\">\n  <bpmn:process id=\"{}\" name=\"{}\" isExecutable=\"true\">\n{tasks}  </bpmn:process>\n</bpmn:definitions>\n",
        escape(&model.id),
        escape(&model.name)
    )
}

impl Processes {
    pub fn definition_view(&self, id: &str) -> Option<ProcessDefinitionView> {
        let deployment = self.deployments.get(id)?;
        let model = self.models.get(id)?;
        Some(ProcessDefinitionView {
            id: id.to_string(),
            name: model.name.clone(),
            documentation: None,
            bpmn_xml: deployment.bpmn_xml.clone(),
            deployment_id: format!("dep-{id}-{}", deployment.version),
            version: deployment.version,
            created_at: chrono::DateTime::from_timestamp_millis(deployment.created_at_ms)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        })
    }

    /// The model an instance runs: the version it started on.
    pub fn model_of(&self, token: &Token) -> Option<&ProcessModel> {
        self.versions
            .get(&(token.model.clone(), token.version))
            .or_else(|| self.models.get(&token.model))
    }

    /// A fresh id, never one a task created through the admin API already named.
    pub fn new_instance_id(&mut self) -> String {
        loop {
            self.next_instance += 1;
            let id = format!("pi-{:06}", self.next_instance);
            if !self.instances.contains_key(&id) {
                return id;
            }
        }
    }

    pub fn new_user_task(&mut self, instance: &str, wait: &Wait) -> Option<String> {
        let Wait::User {
            activity_id,
            name,
            candidate_groups,
        } = wait
        else {
            return None;
        };
        self.next_user_task += 1;
        let id = format!("u-{:06}", self.next_user_task);
        self.user_tasks.insert(
            id.clone(),
            UserTask {
                id: id.clone(),
                instance: instance.to_string(),
                activity_id: activity_id.clone(),
                name: name.clone(),
                candidate_groups: candidate_groups.clone(),
                assignee: None,
                status: UserTaskStatus::Available,
            },
        );
        Some(id)
    }

    pub fn instance_view(&self, id: &str) -> Option<ProcessInstanceView> {
        let instance = self.instances.get(id)?;
        let token = instance.token.as_ref()?;
        let model = self.model_of(token);
        Some(ProcessInstanceView {
            id: id.to_string(),
            process_definition_id: token.model.clone(),
            process_definition_name: model.map(|m| m.name.clone()).unwrap_or_default(),
            current_activity_id: token.current.clone(),
            status: instance.status,
            suspended: instance.suspended,
            variables: token.variables.clone(),
        })
    }

    pub fn user_task_view(&self, task: &UserTask) -> UserTaskView {
        let record = self.instances.get(&task.instance);
        let instance = record.and_then(|i| i.token.as_ref());
        UserTaskView {
            id: task.id.clone(),
            task_definition_key: task.activity_id.clone(),
            name: task.name.clone(),
            assignee: task.assignee.clone(),
            status: task.status,
            candidate_users: Vec::new(),
            candidate_groups: task.candidate_groups.clone(),
            process_instance_id: task.instance.clone(),
            process_definition_id: instance.map(|i| i.model.clone()).unwrap_or_default(),
            process_status: record.map_or(InstanceStatus::Completed, |i| i.status),
            current_activity_id: instance.map(|i| i.current.clone()).unwrap_or_default(),
            variables: instance.map(|i| i.variables.clone()).unwrap_or_default(),
        }
    }

    /// The user tasks `caller` may see (eligible or assigned to them), optionally of one status.
    pub fn visible_user_tasks(
        &self,
        caller: &Caller,
        status: Option<UserTaskStatus>,
    ) -> Vec<UserTaskView> {
        self.user_tasks
            .values()
            .filter(|t| {
                t.assignee.as_deref() == Some(caller.user.as_str())
                    || t.candidate_groups.iter().any(|g| caller.groups.contains(g))
            })
            .filter(|t| status.is_none_or(|s| t.status == s))
            .map(|t| self.user_task_view(t))
            .collect()
    }

    /// The engine's claim rules.
    pub fn claim(&mut self, id: &str, caller: &Caller) -> Result<(), String> {
        let task = self
            .user_tasks
            .get_mut(id)
            .ok_or_else(|| format!("Task not found: {id}"))?;
        if task.status == UserTaskStatus::Completed {
            return Err("Task is already completed.".into());
        }
        if !task.eligible(&caller.user, &caller.groups) {
            return Err(format!(
                "User {} is not eligible to claim task {id}",
                caller.user
            ));
        }
        task.assignee = Some(caller.user.clone());
        task.status = UserTaskStatus::Claimed;
        Ok(())
    }

    /// Checks that `caller` may complete user task `id`; returns its instance and activity.
    pub fn check_completion(&self, id: &str, caller: &Caller) -> Result<(String, String), String> {
        let task = self
            .user_tasks
            .get(id)
            .ok_or_else(|| format!("Task not found: {id}"))?;
        if task.status == UserTaskStatus::Completed {
            return Err("Task is already completed.".into());
        }
        if !task.eligible(&caller.user, &caller.groups) {
            return Err(format!(
                "User {} is not eligible to complete task {id}",
                caller.user
            ));
        }
        Ok((task.instance.clone(), task.activity_id.clone()))
    }
}

/// The lifecycle of a process instance as its external tasks see it (the engine's
/// `ProcessStatus`). Suspension is a separate flag ([`InstanceView::suspended`]), as in the
/// engine, where a suspended instance that a `bpmn-error` fails shows `FAILED` and suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InstanceStatus {
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl InstanceStatus {
    pub(super) fn terminal(self) -> bool {
        self != InstanceStatus::Running
    }

    pub(super) fn as_str(self) -> &'static str {
        match self {
            InstanceStatus::Running => "RUNNING",
            InstanceStatus::Completed => "COMPLETED",
            InstanceStatus::Failed => "FAILED",
            InstanceStatus::Cancelled => "CANCELLED",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars(v: Value) -> Map<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_gateway_routes_on_agent_status_and_defaults_to_the_end() {
        let model = ProcessModel::refund_approval(None);
        let required = vars(json!({"agentStatus": "approval-required"}));
        assert!(matches!(
            walk(&model, "agentOutcome", &mut required.clone(), None),
            Ok(Wait::User { ref activity_id, .. }) if activity_id == "approveRefund"
        ));
        for other in [json!({"agentStatus": "done"}), json!({})] {
            assert_eq!(
                walk(&model, "agentOutcome", &mut vars(other), None),
                Ok(Wait::End {
                    activity_id: "end".into()
                })
            );
        }
        assert!(matches!(
            walk(&model, "approveRefund", &mut required.clone(), None),
            Ok(Wait::User { .. })
        ));
        assert_eq!(
            next_of(&model, "approveRefund").as_deref(),
            Some("refundAgent")
        );
    }

    /// The engine's `processedInThisRun`: a move that comes back to the task it resumed from
    /// (here through a script task) stops there and the token ends; after a wait it goes on.
    #[test]
    fn a_move_back_to_the_task_it_started_from_ends_the_token_as_the_engine_does() {
        let mut model = ProcessModel::refund_approval(None);
        if let NodeKind::ExclusiveGateway { flows, .. } = &mut model.nodes[1].kind {
            flows[0].target = "forge".into();
        }
        model.nodes.push(ProcessNode {
            id: "forge".into(),
            kind: NodeKind::ScriptTask {
                script: "agentApproval = 'x'".into(),
                writes: vars(json!({"agentApproval": "${agentStatus}"})),
                next: "refundAgent".into(),
            },
        });
        let mut v = vars(json!({"agentStatus": "approval-required"}));
        assert_eq!(
            walk(&model, "agentOutcome", &mut v, Some("refundAgent")),
            Ok(Wait::End {
                activity_id: "refundAgent".into()
            })
        );
        assert_eq!(v["agentApproval"], "approval-required", "the script ran");
        assert!(matches!(
            walk(&model, "forge", &mut v, Some("approveRefund")),
            Ok(Wait::External { .. })
        ));
    }

    #[test]
    fn a_gateway_without_match_or_default_and_a_gateway_circle_are_refused() {
        let mut model = ProcessModel::refund_approval(None);
        if let NodeKind::ExclusiveGateway { default, .. } = &mut model.nodes[1].kind {
            *default = None;
        }
        assert_eq!(
            walk(&model, "agentOutcome", &mut Map::new(), None),
            Err("No matching condition and no default flow for gateway agentOutcome".into())
        );
        if let NodeKind::ExclusiveGateway { default, .. } = &mut model.nodes[1].kind {
            *default = Some("agentOutcome".into());
        }
        assert!(walk(&model, "agentOutcome", &mut Map::new(), None).is_err());
    }
}
