//! The world's process shapes beyond one task: the process model its approval round trips and
//! re-entered nodes run on, deployed in the engine's own process state machine
//! (`abada_devkit::engine::ProcessModel`), and the tasks of two tokens at the agent node at once.
//!
//! Each model is deployed with its BPMN XML, the agent written on the service task as
//! `abada.agent.*` properties ([`bpmn_xml`]), as a process author writes it: a plain v1 engine
//! (the real engine 0.11) sends no definition with its tasks, and the workers read it from the
//! process API (`agent::bpmn`). Five processes (and `simWindow`, one agent node whose model has
//! a small context window, [`window_definition`]): `simProcess` (below), `simParallel` (the
//! gated agent node, then the end: its instance holds two tokens at the node), `simTask`
//! (one agent node whose service task defines no agent: the agents file's entry for the topic
//! runs it) and `simSchema` (one agent node whose agent's answer must match an output schema,
//! [`schema_definition`]). A redeployment ([`redeploy`]) deploys the next version of the two gated ones:
//! instructions that perform no writes, with or without approval, so a run that began on the
//! earlier version and waits for a person must keep its own (journaled) definition to perform
//! the call the person approved.
//!
//! The model (`simProcess`):
//!
//! ```text
//! start → gatedAgentNode (abada:agent) → routeAgent: agentStatus == 'approval-required' → approve
//!                                                    otherwise                           → review
//! approve (user task, group sim-approvers) → gatedAgentNode     (the decision: the node re-entered)
//! review  (user task, group sim-reviewers) → routeReview: simAgain == true → gatedAgentNode (a new visit)
//!                                                         otherwise        → end
//! ```
//!
//! Every call of the world's keyed write (`sim_write`) waits for a person's decision there
//! (`approval: "writes"`), so the conversation waits in the run store between the tasks of a
//! visit; the read-only lookup does not.

use serde_json::{Map, Value, json};

use abada_devkit::engine::{ConditionalFlow, NodeKind, ProcessModel, ProcessNode, TaskSpec};

use super::World;
use super::model::{ModelScript, NO_WRITES};

const PROCESS_ID: &str = "simProcess";
const PARALLEL_ID: &str = "simParallel";
const TASK_PROCESS_ID: &str = "simTask";
const SCHEMA_PROCESS_ID: &str = "simSchema";
const WINDOW_PROCESS_ID: &str = "simWindow";
/// The repair turns of the agent with an output schema ([`schema_definition`]): the agents
/// without one get the default (`sim_view::agent::DEFAULT_OUTPUT_REPAIR_TURNS`, for a cut answer).
pub(crate) const SCHEMA_REPAIR_TURNS: u32 = 2;
const AGENT_NODE: &str = "agentNode";
/// The agent node of `simProcess`: an id of its own, so an operator's agents-file entry for
/// that activity (`sim::worker`, a drawn configuration change) overrides that node alone.
pub(crate) const GATED_NODE: &str = "gatedAgentNode";
pub(crate) const APPROVE_NODE: &str = "approve";
pub(crate) const REVIEW_NODE: &str = "review";
/// The candidate groups of the two user tasks.
pub(crate) const APPROVERS: &str = "sim-approvers";
pub(crate) const REVIEWERS: &str = "sim-reviewers";
/// The variable that sends the token back to the agent node for a new visit.
pub(crate) const AGAIN_VARIABLE: &str = "simAgain";
/// The variable the agent's input renders (its script, see `ModelScript`).
pub(crate) const INPUT_VARIABLE: &str = "simInput";

/// The agent definition of version `version` of the gated processes (1: as first deployed;
/// later: redeployed, instructions that perform no writes, approval kept as `approval` says).
pub fn redeployed_definition(version: u32, approval: bool) -> Value {
    let mut def = agent_definition(approval);
    def["instructions"] =
        format!("Play the script your input names. {NO_WRITES} (version {version})").into();
    def
}

/// The schema of the structured-output agent's answer: small, one a gateway after the node
/// could route on (`route`).
pub fn output_schema() -> Value {
    json!({
        "type": "object",
        "required": ["task", "turns", "route"],
        "properties": {
            "task": {"type": "string"},
            "turns": {"type": "integer", "minimum": 0},
            "route": {"enum": ["done", "escalate"]}
        },
        "additionalProperties": false
    })
}

/// Whether `value` matches [`output_schema`], checked here by hand (not by the worker's
/// validator, which the invariants judge).
pub(crate) fn matches_output_schema(value: &Value) -> bool {
    let Some(o) = value.as_object() else {
        return false;
    };
    o.len() == 3
        && o.get("task").is_some_and(Value::is_string)
        && o.get("turns").and_then(Value::as_u64).is_some()
        && matches!(
            o.get("route").and_then(Value::as_str),
            Some("done" | "escalate")
        )
}

/// The agent with an output schema: ungated, its final answers judged against
/// [`output_schema`], with [`SCHEMA_REPAIR_TURNS`] repair turns.
pub fn schema_definition() -> Value {
    let mut def = agent_definition(false);
    def["name"] = "sim-schema-agent".into();
    def["outputSchema"] = output_schema();
    def["outputRepairTurns"] = SCHEMA_REPAIR_TURNS.into();
    def
}

/// The agent whose model has a small context window (`model::SMALL_WINDOW_PROVIDER`):
/// ungated, room for a 256-token answer.
pub fn window_definition() -> Value {
    let mut def = agent_definition(false);
    def["name"] = "sim-window-agent".into();
    def["model"] = format!("{}/m1", super::model::SMALL_WINDOW_PROVIDER).into();
    def["maxOutputTokens"] = 256.into();
    def
}

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

/// The BPMN XML of `model`, each service task carrying its agent (if any) as `abada.agent.*`
/// properties, as an author writes them: its tool servers by their registry names.
pub fn bpmn_xml(model: &ProcessModel) -> String {
    let escape = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
    };
    let mut tasks = String::new();
    for node in &model.nodes {
        let NodeKind::ServiceTask { topic, agent, .. } = &node.kind else {
            continue;
        };
        let mut properties = String::new();
        for (key, value) in agent
            .as_ref()
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let text = match (key.as_str(), value) {
                ("toolServers", Value::Array(servers)) => servers
                    .iter()
                    .filter_map(|s| s.get("name").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(","),
                (_, Value::String(t)) => t.clone(),
                (_, other) => other.to_string(),
            };
            properties.push_str(&format!(
                "          <camunda:property name=\"abada.agent.{key}\" value=\"{}\"/>\n",
                escape(&text)
            ));
        }
        let extension = if properties.is_empty() {
            String::new()
        } else {
            format!(
                "\n      <bpmn:extensionElements>\n        <camunda:properties>\n{properties}        </camunda:properties>\n      </bpmn:extensionElements>\n    "
            )
        };
        tasks.push_str(&format!(
            "    <bpmn:serviceTask id=\"{}\" camunda:type=\"external\" camunda:topic=\"{}\">{extension}</bpmn:serviceTask>\n",
            escape(&node.id),
            escape(topic)
        ));
    }
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<bpmn:definitions xmlns:bpmn=\"http://www.omg.org/spec/BPMN/20100524/MODEL\" xmlns:camunda=\"http://camunda.org/schema/1.0/bpmn\" id=\"defs\" targetNamespace=\"http://abada.example/sim\">\n  <bpmn:process id=\"{}\" name=\"{}\" isExecutable=\"true\">\n{tasks}  </bpmn:process>\n</bpmn:definitions>\n",
        escape(&model.id),
        escape(&model.name)
    )
}

/// A process of one agent node carrying `agent`: `simTask` (no agent on the node: the agents
/// file's), then the end; `simParallel` (gated), whose two tokens then wait at a join nobody
/// completes (the engine's process model has one token per instance: an end reached by the
/// first token would end the instance under the second).
fn single_node(id: &str, agent: Option<Value>) -> ProcessModel {
    let joined = id == PARALLEL_ID;
    let mut nodes = vec![ProcessNode {
        id: AGENT_NODE.into(),
        kind: NodeKind::ServiceTask {
            topic: abada_devkit::engine::AGENT_TOPIC.into(),
            agent,
            next: if joined { "join" } else { "end" }.into(),
        },
    }];
    if joined {
        nodes.push(ProcessNode {
            id: "join".into(),
            kind: NodeKind::UserTask {
                name: "The branches join".into(),
                candidate_groups: vec!["sim-nobody".into()],
                next: "end".into(),
            },
        });
    }
    nodes.push(ProcessNode {
        id: "end".into(),
        kind: NodeKind::End,
    });
    ProcessModel {
        id: id.into(),
        name: format!("Simulated agent node ({id})"),
        start: AGENT_NODE.into(),
        nodes,
    }
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
        start: GATED_NODE.into(),
        nodes: vec![
            node(
                GATED_NODE,
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
                        Value::from(
                            abada_agent_worker::devkit::sim_view::agent::STATUS_APPROVAL_REQUIRED,
                        ),
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
                    next: GATED_NODE.into(),
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
                    flows: vec![when(AGAIN_VARIABLE, Value::Bool(true), GATED_NODE)],
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

/// Deploys the processes in the world's engine (once, before any instance starts), each with
/// its BPMN XML.
pub fn deploy(world: &World) {
    let mut core = world.core();
    for model in [
        model(agent_definition(true)),
        single_node(PARALLEL_ID, Some(agent_definition(true))),
        single_node(TASK_PROCESS_ID, None),
        single_node(SCHEMA_PROCESS_ID, Some(schema_definition())),
        single_node(WINDOW_PROCESS_ID, Some(window_definition())),
    ] {
        let xml = bpmn_xml(&model);
        core.deploy_bpmn(model, xml);
    }
}

/// Deploys version `version` of the gated processes: instructions that perform no writes,
/// approval kept or dropped. Instances that started keep routing on their version; the
/// process API serves this one from now on.
pub fn redeploy(world: &World, version: u32, approval: bool) {
    let agent = redeployed_definition(version, approval);
    let mut core = world.core();
    for model in [
        model(agent.clone()),
        single_node(PARALLEL_ID, Some(agent.clone())),
    ] {
        let xml = bpmn_xml(&model);
        core.deploy_bpmn(model, xml);
    }
}

/// Starts an instance of `simTask` running `script`: one task whose definition comes from the
/// agents file (the topic's entry), on an engine that sends none.
pub(crate) fn start_task(world: &World, script: &ModelScript) -> Result<String, String> {
    world
        .core()
        .start_process(TASK_PROCESS_ID, input_variables(script))
}

/// Starts an instance of `simSchema` running `script`: one task whose definition (with its
/// output schema) comes from the BPMN.
pub(crate) fn start_schema_task(world: &World, script: &ModelScript) -> Result<String, String> {
    world
        .core()
        .start_process(SCHEMA_PROCESS_ID, input_variables(script))
}

/// Starts an instance of `simWindow` running `script`: one task whose agent's model has a
/// small context window.
pub(crate) fn start_window_task(world: &World, script: &ModelScript) -> Result<String, String> {
    world
        .core()
        .start_process(WINDOW_PROCESS_ID, input_variables(script))
}

/// Starts an instance of `simParallel` running `script` at its agent node (the first token).
pub(crate) fn start_parallel_instance(
    world: &World,
    script: &ModelScript,
) -> Result<String, String> {
    world
        .core()
        .start_process(PARALLEL_ID, input_variables(script))
}

/// Starts an instance of the model running `script`; `preset`: a
/// decision approving the script's first call is in the decision variable from the start
/// (written by whoever started the process, before any request existed). The instance's id.
pub fn start(world: &World, script: &ModelScript, preset: bool) -> Result<String, String> {
    let mut variables = input_variables(script);
    if preset {
        variables.insert(
            abada_agent_worker::devkit::sim_view::agent::DEFAULT_DECISION_VARIABLE.into(),
            json!({"requestId": "preset-by-the-starter", "callId": "call-0", "approved": true,
                   "decidedBy": "the process starter"}),
        );
    }
    world.core().start_process(PROCESS_ID, variables)
}

/// A task of one instance at the agent node, beside another token's (two tokens, as after a
/// parallel gateway): the same process instance and activity as `first`'s, hence the same run
/// key. `None`: `first`'s own task; `Some(twin)`: the twin's, with its script. `instance`: the
/// `simParallel` instance of a plain engine's first token (its tasks carry no definition); on
/// an agent/1 engine the tasks carry theirs and belong to no process the engine routes. The
/// task's id.
pub(crate) fn start_parallel(
    world: &World,
    first: &ModelScript,
    twin: Option<&ModelScript>,
    instance: Option<&str>,
) -> String {
    let (instance, agent) = match instance {
        Some(i) => (i.to_string(), None),
        None => (format!("par-{}", first.task), Some(agent_definition(true))),
    };
    world.core().create_task(TaskSpec {
        variables: input_variables(twin.unwrap_or(first)),
        agent,
        retries: Some(3),
        activity_id: Some(AGENT_NODE.into()),
        process_instance_id: Some(instance),
        ..TaskSpec::default()
    })
}
