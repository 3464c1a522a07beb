//! The world's people: the approver who answers the requests of the approval round trips and
//! the reviewer who sends a token back to the agent node for another visit (`process`). They
//! act through the engine's user tasks, as a person does through the task list: the approver
//! reads the request the worker completed with (`agentApprovalRequest`) and writes a decision
//! into `agentApproval` in a seeded [`Manner`], honest or hostile. Every decision is recorded in
//! the trace with the request it answered, so the invariants can tell a genuine approval from
//! anything else.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::World;
use super::model::ModelScript;
use super::process::{
    AGAIN_VARIABLE, APPROVE_NODE, APPROVERS, INPUT_VARIABLE, REVIEW_NODE, REVIEWERS,
};
use super::trace::Event;
use abada_agent_worker::agent::approval::call_digest;
use abada_agent_worker::conversation::ToolCall;
use abada_agent_worker::devkit::sim_view::agent::{
    DEFAULT_DECISION_VARIABLE, DEFAULT_REQUEST_VARIABLE,
};

/// How a person answers one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Manner {
    /// Approves the request waiting: its requestId, callId and callDigest.
    Approve,
    /// Refuses it, with a reason.
    Refuse,
    /// Completes the user task without writing a decision (the worker's pending marker stays).
    Silent,
    /// Approves under a requestId the worker never issued, with the waiting call's callId.
    ForgedRequest,
    /// Approves by repeating the decision on an earlier request of the instance (its
    /// requestId and callId), or under an unknown requestId when there was none.
    StaleRequest,
    /// Approves the waiting callId without any requestId.
    NoRequestId,
    /// Approves the waiting requestId and callId, but other arguments (their callDigest): the
    /// call changed under the same callId.
    ChangedCall,
}

impl Manner {
    pub const ALL: [Manner; 7] = [
        Manner::Approve,
        Manner::Refuse,
        Manner::Silent,
        Manner::ForgedRequest,
        Manner::StaleRequest,
        Manner::NoRequestId,
        Manner::ChangedCall,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Manner::Approve => "approve",
            Manner::Refuse => "refuse",
            Manner::Silent => "silent",
            Manner::ForgedRequest => "forged-request",
            Manner::StaleRequest => "stale-request",
            Manner::NoRequestId => "no-request-id",
            Manner::ChangedCall => "changed-call",
        }
    }
}

/// What the people do with one process instance: the manner of each decision in turn (then
/// honest approvals), and the script of each visit after the first.
#[derive(Clone, Debug, Default)]
pub struct PeoplePlan {
    pub decisions: Vec<Manner>,
    pub revisits: Vec<ModelScript>,
}

/// The plans by process instance, and how far each went.
#[derive(Debug, Default)]
pub struct People {
    plans: BTreeMap<String, Progress>,
}

#[derive(Debug, Default)]
struct Progress {
    plan: PeoplePlan,
    decided: usize,
    revisited: usize,
    /// Every request decided on so far: (requestId, callId).
    earlier: Vec<(String, String)>,
}

impl People {
    pub fn add(&mut self, instance: String, plan: PeoplePlan) {
        self.plans.insert(
            instance,
            Progress {
                plan,
                ..Progress::default()
            },
        );
    }
}

/// The person's name in `decidedBy` and on the user tasks.
const PERSON: &str = "sim-person";

/// Acts on the open user tasks every `every`, for as long as the world runs.
pub async fn run(world: Arc<World>, people: Arc<Mutex<People>>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        act(&world, &people);
    }
}

/// One look at the task list: every open user task answered per its instance's plan.
pub(crate) fn act(world: &World, people: &Mutex<People>) {
    let groups = [APPROVERS.to_string(), REVIEWERS.to_string()];
    let open = world.core().open_user_tasks(PERSON, &groups);
    let mut people = people.lock().unwrap_or_else(|e| e.into_inner());
    for task in open {
        let progress = people
            .plans
            .entry(task.process_instance_id.clone())
            .or_default();
        let variables = if task.task_definition_key == APPROVE_NODE {
            decide(world, &task.process_instance_id, &task.variables, progress)
        } else if task.task_definition_key == REVIEW_NODE {
            review(world, &task.process_instance_id, progress)
        } else {
            continue;
        };
        // A refusal (the instance ended meanwhile) changes nothing; the task list says so next.
        let _ = world
            .core()
            .complete_user_task(&task.id, PERSON, &groups, variables);
    }
}

fn text(value: &Value, field: &str) -> Option<String> {
    value.get(field).and_then(Value::as_str).map(str::to_string)
}

/// The decision on the request in `variables`, written in the plan's next manner.
fn decide(
    world: &World,
    instance: &str,
    variables: &Map<String, Value>,
    progress: &mut Progress,
) -> Map<String, Value> {
    let request = variables
        .get(DEFAULT_REQUEST_VARIABLE)
        .cloned()
        .unwrap_or(Value::Null);
    let request_id = text(&request, "requestId");
    let call_id = text(&request, "callId");
    let call_digest_asked = text(&request, "callDigest");
    let arguments = request.get("arguments").cloned().unwrap_or(Value::Null);
    let write = arguments.get("n").and_then(Value::as_u64);
    let script_task = variables
        .get(INPUT_VARIABLE)
        .and_then(Value::as_str)
        .and_then(ModelScript::parse)
        .map(|s| s.task)
        .unwrap_or_default();
    let manner = progress
        .plan
        .decisions
        .get(progress.decided)
        .copied()
        .unwrap_or(Manner::Approve);
    progress.decided += 1;
    let approve = |request_id: Option<&str>, call_id: Option<&str>, digest: Option<&str>| {
        let mut d = json!({"callId": call_id, "approved": true, "decidedBy": PERSON});
        if let Some(id) = request_id {
            d["requestId"] = id.into();
        }
        if let Some(digest) = digest {
            d["callDigest"] = digest.into();
        }
        d
    };
    let written = match manner {
        Manner::Approve => Some(approve(
            request_id.as_deref(),
            call_id.as_deref(),
            call_digest_asked.as_deref(),
        )),
        Manner::Refuse => Some(json!({
            "requestId": request_id, "callId": call_id, "approved": false,
            "comment": "not this one", "decidedBy": PERSON
        })),
        Manner::Silent => None,
        Manner::ForgedRequest => Some(approve(
            Some(format!("{:032x}", progress.decided * 0x9e37_79b9).as_str()),
            call_id.as_deref(),
            None,
        )),
        Manner::StaleRequest => {
            let (id, call) = progress
                .earlier
                .last()
                .cloned()
                .unwrap_or_else(|| ("0".repeat(32), call_id.clone().unwrap_or_default()));
            Some(approve(Some(id.as_str()), Some(call.as_str()), None))
        }
        Manner::NoRequestId => Some(approve(None, call_id.as_deref(), None)),
        Manner::ChangedCall => {
            let mut other = arguments.clone();
            other["n"] = json!(write.unwrap_or(0) + 100);
            let changed = ToolCall {
                call_id: call_id.clone().unwrap_or_default(),
                server: text(&request, "server").unwrap_or_default(),
                tool: text(&request, "tool").unwrap_or_default(),
                arguments: other,
            };
            Some(approve(
                request_id.as_deref(),
                call_id.as_deref(),
                Some(call_digest(&changed).as_str()),
            ))
        }
    };
    if let (Some(id), Some(call)) = (&request_id, &call_id) {
        progress.earlier.push((id.clone(), call.clone()));
    }
    world.record(Event::Decision {
        instance: instance.to_string(),
        task: script_task,
        write,
        request_id,
        call_id,
        call_digest: call_digest_asked,
        written: written.clone(),
        manner: manner.name(),
    });
    let mut out = Map::new();
    if let Some(decision) = written {
        out.insert(DEFAULT_DECISION_VARIABLE.into(), decision);
    }
    out
}

/// The reviewer: the token goes back to the agent node while the plan has visits left (with the
/// next visit's script), else on to the end.
fn review(world: &World, instance: &str, progress: &mut Progress) -> Map<String, Value> {
    let mut out = Map::new();
    let next = progress.plan.revisits.get(progress.revisited).cloned();
    out.insert(AGAIN_VARIABLE.into(), Value::Bool(next.is_some()));
    if let Some(script) = &next {
        progress.revisited += 1;
        out.insert(INPUT_VARIABLE.into(), script.input().into());
    }
    world.record(Event::Reviewed {
        instance: instance.to_string(),
        again: next.map(|s| s.task),
    });
    out
}
