//! The world's process shapes beyond one task: the process model its approval round trips and
//! re-entered nodes run on, deployed in the engine's own process state machine
//! (`abada_devkit::engine::ProcessModel`), and the tasks of two tokens at the agent node at once.
//!
//! The model (`simProcess`):
//!
//! ```text
//! start → agentNode (abada:agent) → routeAgent: agentStatus == 'approval-required' → approve
//!                                               otherwise                           → review
//! approve (user task, group sim-approvers) → agentNode          (the decision: the node re-entered)
//! review  (user task, group sim-reviewers) → routeReview: simAgain == true → agentNode (a new visit)
//!                                                         otherwise        → end
//! ```
//!
//! Every call of the world's keyed write (`sim_write`) waits for a person's decision there
//! (`approval: "writes"`), so the conversation waits in the run store between the tasks of a
//! visit; the read-only lookup does not.

use serde_json::{Map, Value, json};

use abada_devkit::engine::{ConditionalFlow, NodeKind, ProcessModel, ProcessNode, TaskSpec};

use super::World;
use super::model::ModelScript;

const PROCESS_ID: &str = "simProcess";
const AGENT_NODE: &str = "agentNode";
pub(crate) const APPROVE_NODE: &str = "approve";
pub(crate) const REVIEW_NODE: &str = "review";
/// The candidate groups of the two user tasks.
pub(crate) const APPROVERS: &str = "sim-approvers";
pub(crate) const REVIEWERS: &str = "sim-reviewers";
/// The variable that sends the token back to the agent node for a new visit.
pub(crate) const AGAIN_VARIABLE: &str = "simAgain";
/// The variable the agent's input renders (its script, see `ModelScript`).
pub(crate) const INPUT_VARIABLE: &str = "simInput";

/// The agent definition every simulated task carries (agent/1 `agent`); `gated`: its keyed
/// writes wait for a person's decision.
pub fn agent_definition(gated: bool) -> Value {
    let mut def = json!({
        "name": if gated { "sim-gated-agent" } else { "sim-agent" },
        "model": format!("{}/m1", super::model::PROVIDER),
        "instructions": "Play the script your input names.",
        "input": format!("${{{INPUT_VARIABLE}}}"),
        "toolServers": [{"name": super::tools::SERVER, "url": super::tools::URL}],
        "maxTurns": 8,
        "resultVariable": "simResult"
    });
    if gated {
        def["approval"] = json!("writes");
    }
    def
}

/// The process model of the module header, its agent node carrying `agent`.
pub fn model(agent: Value) -> ProcessModel {
    let node = |id: &str, kind| ProcessNode {
        id: id.into(),
        kind,
    };
    let when = |variable: &str, equals: Value, target: &str| ConditionalFlow {
        variable: variable.into(),
        equals,
        target: target.into(),
    };
    ProcessModel {
        id: PROCESS_ID.into(),
        name: "Simulated agent with approval and review".into(),
        start: AGENT_NODE.into(),
        nodes: vec![
            node(
                AGENT_NODE,
                NodeKind::ServiceTask {
                    topic: abada_devkit::engine::AGENT_TOPIC.into(),
                    agent: Some(agent),
                    next: "routeAgent".into(),
                },
            ),
            node(
                "routeAgent",
                NodeKind::ExclusiveGateway {
                    flows: vec![when(
                        "agentStatus",
                        Value::from(crate::agent::approval::STATUS_APPROVAL_REQUIRED),
                        APPROVE_NODE,
                    )],
                    default: Some(REVIEW_NODE.into()),
                },
            ),
            node(
                APPROVE_NODE,
                NodeKind::UserTask {
                    name: "Approve the agent's call".into(),
                    candidate_groups: vec![APPROVERS.into()],
                    next: AGENT_NODE.into(),
                },
            ),
            node(
                REVIEW_NODE,
                NodeKind::UserTask {
                    name: "Review the agent's answer".into(),
                    candidate_groups: vec![REVIEWERS.into()],
                    next: "routeReview".into(),
                },
            ),
            node(
                "routeReview",
                NodeKind::ExclusiveGateway {
                    flows: vec![when(AGAIN_VARIABLE, Value::Bool(true), AGENT_NODE)],
                    default: Some("end".into()),
                },
            ),
            node("end", NodeKind::End),
        ],
    }
}

/// The variables a task or an instance starts with: the script's input.
pub(crate) fn input_variables(script: &ModelScript) -> Map<String, Value> {
    let mut variables = Map::new();
    variables.insert(INPUT_VARIABLE.into(), script.input().into());
    variables
}

/// Deploys the model in the world's engine (once, before any instance starts).
pub fn deploy(world: &World) {
    world.core().deploy(model(agent_definition(true)));
}

/// Starts an instance of the model running `script`; `preset`: a
/// decision approving the script's first call is in the decision variable from the start
/// (written by whoever started the process, before any request existed). The instance's id.
pub fn start(world: &World, script: &ModelScript, preset: bool) -> Result<String, String> {
    let mut variables = input_variables(script);
    if preset {
        variables.insert(
            crate::agent::approval::ApprovalVariables::default().decision,
            json!({"requestId": "preset-by-the-starter", "callId": "call-0", "approved": true,
                   "decidedBy": "the process starter"}),
        );
    }
    world.core().start_process(PROCESS_ID, variables)
}

/// A task of one instance at the agent node, beside another token's (two tokens, as after a
/// parallel gateway): the same process instance and activity as `first`'s, hence the same run
/// key. `None`: `first`'s own task; `Some(twin)`: the twin's, with its script. The task's id.
pub(crate) fn start_parallel(
    world: &World,
    first: &ModelScript,
    twin: Option<&ModelScript>,
) -> String {
    let instance = format!("par-{}", first.task);
    world.core().create_task(TaskSpec {
        variables: input_variables(twin.unwrap_or(first)),
        agent: Some(agent_definition(true)),
        retries: Some(3),
        activity_id: Some(AGENT_NODE.into()),
        process_instance_id: Some(instance),
        ..TaskSpec::default()
    })
}
