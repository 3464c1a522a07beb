//! Agents defined on the BPMN service task: the emulator serves the process API as
//! the real engine does (`GET /v1/processes/instances/{id}`, `GET /v1/processes/{id}`, the
//! latest version only), and a worker WITHOUT an agents file runs the agent its service task's
//! `abada.agent.*` properties define. Each promise has its test: one definition read per
//! definition (counted on the emulator's call log), a redeployment that leaves a running run
//! alone and reaches new tasks, the operator's override, a bad property or a hostile XML as an
//! incident that names it.

use std::time::Duration;

use abada_agent_worker::agent::AgentSettings;
use abada_agent_worker::config;
use abada_agent_worker::devkit::engine::{
    InstanceStatus, Operation, ProcessInstanceView, ProcessModel, ProtocolLevel, TaskStatus,
    TaskView,
};
use abada_agent_worker::devkit::model::{Fault, FaultTimes, Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Map, json};

use crate::support::scratch::ScratchDir;

/// The worked example's process (`refundApproval`, service task `refundAgent`) with `properties`
/// (name, value) on the agent's service task, as a BPMN author writes it.
pub(crate) fn refund_bpmn(properties: &[(&str, &str)]) -> String {
    let escape = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('"', "&quot;")
    };
    let properties: String = properties
        .iter()
        .map(|(name, value)| {
            format!(
                "          <camunda:property name=\"abada.agent.{name}\" value=\"{}\"/>\n",
                escape(value)
            )
        })
        .collect();
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<bpmn:definitions xmlns:bpmn="http://www.omg.org/spec/BPMN/20100524/MODEL"
                  xmlns:camunda="http://camunda.org/schema/1.0/bpmn"
                  id="Definitions_Refund" targetNamespace="http://abada.dev/tests">
  <bpmn:process id="refundApproval" name="Refund with approval" isExecutable="true">
    <bpmn:startEvent id="start"/>
    <bpmn:serviceTask id="refundAgent" name="Refund agent" camunda:topic="abada:agent">
      <bpmn:extensionElements>
        <camunda:properties>
{properties}        </camunda:properties>
      </bpmn:extensionElements>
    </bpmn:serviceTask>
    <bpmn:endEvent id="end"/>
    <bpmn:sequenceFlow id="f1" sourceRef="start" targetRef="refundAgent"/>
    <bpmn:sequenceFlow id="f2" sourceRef="refundAgent" targetRef="end"/>
  </bpmn:process>
</bpmn:definitions>
"#
    )
}

/// An agent on model `openai/{model}` writing `resultVariable`.
fn agent_properties<'a>(model: &'a str, result_variable: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("name", "refund-agent"),
        ("model", model),
        ("instructions", "You decide refunds. Answer with JSON."),
        ("input", "Order ${orderId}"),
        ("maxTurns", "4"),
        ("resultVariable", result_variable),
        (
            "outputSchema",
            r#"{"type":"object","required":["decision"]}"#,
        ),
    ]
}

/// A model answering at once with JSON naming itself.
fn answer_script(model: &str) -> Script {
    Script::new(vec![Turn::text(format!(
        r#"{{"decision": "refunded", "by": "{model}", "order": "${{input}}"}}"#
    ))])
    .with_usage(50, 10)
}

fn start(stack: &Stack, order: &str) -> String {
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    stack
        .engine
        .start_process("refundApproval", variables)
        .unwrap()
}

async fn wait_completed(stack: &Stack, instance: &str) -> ProcessInstanceView {
    tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            e.process_instance(instance)
                .filter(|v| v.status == InstanceStatus::Completed)
        }),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "timed out waiting for instance {instance} to complete: {:?} {:?}",
            stack.engine.process_instance(instance),
            stack
                .engine
                .tasks()
                .into_iter()
                .map(|t| (t.status, t.error_message))
                .collect::<Vec<_>>()
        )
    })
}

async fn wait_incident(stack: &Stack, instance: &str) -> TaskView {
    tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            e.tasks()
                .into_iter()
                .find(|t| t.process_instance_id == instance && t.status == TaskStatus::Failed)
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for an incident on {instance}"))
}

fn reads(stack: &Stack, operation: Operation) -> usize {
    stack
        .engine
        .calls()
        .iter()
        .filter(|c| c.operation == operation)
        .count()
}

/// Deploys version 2 of the refund process while `running` waits on version 1's failing model;
/// once the worker has read version 2 (a new attempt of the running task did), lets version 1's
/// model answer and checks the running instance ended on version 1's definition.
async fn redeploy_then_answer_v1(stack: &Stack, running: &str, v2_xml: String) {
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), v2_xml);
    // A run journaled in the engine learns of the redeployment when its next attempt reads the
    // latest version; one kept in the run store does not read it at all (it is found, with its
    // definition, before any definition is read): its next attempt calls version 1's model.
    let before = reads(stack, Operation::ProcessDefinitionRead);
    let calls = stack.model.calls("bpmn-v1");
    crate::support::wait::eventually(
        Duration::from_secs(30),
        "an attempt after the redeployment",
        async || {
            reads(stack, Operation::ProcessDefinitionRead) > before
                || stack.model.calls("bpmn-v1") > calls
        },
    )
    .await;
    stack.model.clear_faults("bpmn-v1");
    let done = wait_completed(stack, running).await;
    assert_eq!(done.variables["v1Result"]["by"], json!("bpmn-v1"));
    assert!(
        !done.variables.contains_key("v2Result"),
        "{:?}",
        done.variables
    );
}

/// Settings whose BPMN cache trusts a learned latest version for `latest_for`.
fn settings(latest_for: Duration) -> AgentSettings {
    let mut s = Stack::fast_agent_settings();
    s.bpmn.latest_for = latest_for;
    s
}

#[tokio::test]
async fn an_agent_defined_in_the_bpmn_runs_on_a_plain_v1_engine_without_an_agents_file() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "refundDecision")),
    );
    let instances: Vec<String> = (0..4).map(|i| start(&stack, &format!("o-{i}"))).collect();
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 4),
        settings(Duration::from_secs(600)),
    );
    for (i, instance) in instances.iter().enumerate() {
        let done = wait_completed(&stack, instance).await;
        assert_eq!(
            done.variables["refundDecision"],
            json!({"decision": "refunded", "by": "bpmn-v1", "order": format!("Order o-{i}")}),
            "the BPMN's resultVariable holds the answer, as JSON"
        );
    }
    // Four tasks of one definition, some of them concurrent: the definition is read once; each
    // instance is read once (the key of an instance never changes).
    assert_eq!(reads(&stack, Operation::ProcessDefinitionRead), 1);
    assert_eq!(reads(&stack, Operation::ProcessInstanceRead), 4);
    // The model saw the BPMN's instructions.
    let request = &stack.model.requests()[0];
    assert!(
        request.body.to_string().contains("You decide refunds"),
        "{}",
        request.body
    );
    worker.stop().await;
    stack.shutdown().await;
}

/// A run started on version 1 keeps version 1's agent after a redeployment (its definition is
/// journaled with its input): its model and result variable do not change mid-run. A task
/// first reached after the redeployment runs version 2.
#[tokio::test]
async fn a_redeployment_leaves_a_running_run_alone_and_reaches_new_tasks() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack.model.set_script("bpmn-v2", answer_script("bpmn-v2"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "v1Result")),
    );
    // Version 1's model is down: the run journals its input, then defers, and comes back.
    stack
        .model
        .inject_fault("bpmn-v1", Fault::ServiceUnavailable, FaultTimes::Always);
    let running = start(&stack, "o-1");
    // Every task reads the latest version again: the redeployment is seen at once.
    let worker = stack.spawn_worker(WorkerOptions::new("w1", 2), settings(Duration::ZERO));
    let journaled = tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            e.tasks()
                .into_iter()
                .find(|t| t.process_instance_id == running && !t.journal.is_empty())
        }),
    )
    .await
    .expect("the run journals its input");
    assert_eq!(
        journaled.journal[0]["data"]["definition"]["version"],
        json!(1),
        "{:?}",
        journaled.journal[0]
    );
    crate::support::wait::eventually(
        Duration::from_secs(30),
        "version 1's model is called (and fails)",
        async || stack.model.calls("bpmn-v1") >= 1,
    )
    .await;

    redeploy_then_answer_v1(
        &stack,
        &running,
        refund_bpmn(&agent_properties("openai/bpmn-v2", "v2Result")),
    )
    .await;
    assert_eq!(stack.model.calls("bpmn-v2"), 0, "the running run kept v1");

    let fresh = start(&stack, "o-2");
    let done = wait_completed(&stack, &fresh).await;
    assert_eq!(done.variables["v2Result"]["by"], json!("bpmn-v2"));
    worker.stop().await;
    stack.shutdown().await;
}

/// The same with the run store on a plain v1 engine, where the claim checks the task's rendered
/// input against the journaled one: a run begun on version 1 resumes on version 1 after a
/// redeployment that changed the instructions (its input is rendered from its journaled
/// definition, so it matches), instead of becoming an incident for an input that differs.
#[tokio::test]
async fn a_run_resumed_from_the_store_after_a_redeployment_keeps_its_definition() {
    let Some(db) = crate::store::TestDb::create().await else {
        return;
    };
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack.model.set_script("bpmn-v2", answer_script("bpmn-v2"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "v1Result")),
    );
    stack
        .model
        .inject_fault("bpmn-v1", Fault::ServiceUnavailable, FaultTimes::Always);
    let running = start(&stack, "o-1");
    let mut opts = WorkerOptions::new("w1", 2);
    opts.env = vec![(config::ENV_STORE_URL.to_string(), db.url.render())];
    let worker = stack.spawn_worker(opts, settings(Duration::ZERO));
    crate::support::wait::eventually(
        Duration::from_secs(30),
        "the run journals its input on version 1 in the store, and calls version 1's model",
        async || {
            // The worker creates the tables as it starts: none yet is no step yet.
            let journaled: i64 = db
                .sql()
                .await
                .query_one(
                    "SELECT count(*) FROM abada_agent_steps
                      WHERE seq = 1 AND body->'definition'->>'version' = '1'",
                    &[],
                )
                .await
                .map_or(0, |row| row.get(0));
            journaled == 1 && stack.model.calls("bpmn-v1") >= 1
        },
    )
    .await;

    // Version 2 renders other instructions: an input rendered from it differs from the run's.
    let mut v2 = agent_properties("openai/bpmn-v2", "v2Result");
    v2.retain(|(k, _)| *k != "instructions");
    v2.push((
        "instructions",
        "Version 2: decide refunds, answer with JSON.",
    ));
    redeploy_then_answer_v1(&stack, &running, refund_bpmn(&v2)).await;
    assert_eq!(stack.model.calls("bpmn-v2"), 0, "the resumed run kept v1");
    // Resuming on its own definition is no refusal of the store (docs/OPERATIONS.md: an incident).
    let refused: Vec<String> = worker
        .metrics
        .encode()
        .lines()
        .filter(|l| l.contains("class=\"refused\"") && !l.ends_with(" 0"))
        .map(str::to_string)
        .collect();
    assert_eq!(refused, Vec::<String>::new());
    let requests = stack.model.requests();
    let last = requests.last().expect("a model request");
    assert!(
        last.body.to_string().contains("You decide refunds")
            && !last.body.to_string().contains("Version 2"),
        "the resumed run sent version 1's instructions: {}",
        last.body
    );

    // A task first reached after the redeployment runs version 2, through the store too.
    let fresh = start(&stack, "o-2");
    let done = wait_completed(&stack, &fresh).await;
    assert_eq!(done.variables["v2Result"]["by"], json!("bpmn-v2"));
    worker.stop().await;
    stack.shutdown().await;
    db.drop().await;
}

/// Two elements of the process share the agent node's id (the last one read used to win, so a
/// second service task could replace the agent unseen): neither definition runs; the task is
/// an incident naming the id, and no model is called.
#[tokio::test]
async fn a_duplicate_service_task_id_is_an_incident_and_neither_definition_runs() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack.model.set_script("twin", answer_script("twin"));
    let xml = refund_bpmn(&agent_properties("openai/bpmn-v1", "refundDecision"));
    let twin = refund_bpmn(&agent_properties("openai/twin", "refundDecision"));
    let from = twin.find("    <bpmn:serviceTask").unwrap();
    let to = twin.find("    <bpmn:endEvent").unwrap();
    let xml = xml.replacen(
        "    <bpmn:endEvent",
        &format!("{}    <bpmn:endEvent", &twin[from..to]),
        1,
    );
    assert_eq!(
        xml.matches(r#"<bpmn:serviceTask id="refundAgent""#).count(),
        2
    );
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), xml);
    let instance = start(&stack, "o-1");
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 1),
        settings(Duration::from_secs(600)),
    );
    let failed = wait_incident(&stack, &instance).await;
    let message = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("2 elements have the id \"refundAgent\""),
        "{message}"
    );
    assert_eq!(stack.model.total_calls(), 0, "neither definition ran");
    worker.stop().await;
    stack.shutdown().await;
}

/// The operator's agents-file entry for the same activity wins over the BPMN's properties.
#[tokio::test]
async fn an_agents_file_entry_for_the_activity_overrides_the_bpmn() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack
        .model
        .set_script("operator", answer_script("operator"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "refundDecision")),
    );
    let dir = ScratchDir::new("bpmn-override");
    let agents = dir.write(
        "agents.toml",
        "[agents.refundAgent]\nmodel = \"openai/operator\"\ninput = \"${orderId}\"\nresultVariable = \"operatorResult\"\n",
    );
    let instances = [start(&stack, "o-1"), start(&stack, "o-2")];
    let mut opts = WorkerOptions::new("w1", 1);
    opts.env = vec![(
        config::ENV_AGENTS_FILE.to_string(),
        agents.display().to_string(),
    )];
    let worker = stack.spawn_worker(opts, settings(Duration::from_secs(600)));
    for instance in &instances {
        let done = wait_completed(&stack, instance).await;
        assert_eq!(done.variables["operatorResult"]["by"], json!("operator"));
        assert!(!done.variables.contains_key("refundDecision"));
    }
    assert_eq!(stack.model.calls("bpmn-v1"), 0);
    // The BPMN is looked at once, for the first task of the activity, to log the override.
    assert_eq!(reads(&stack, Operation::ProcessInstanceRead), 1);
    assert_eq!(reads(&stack, Operation::ProcessDefinitionRead), 1);
    worker.stop().await;
    stack.shutdown().await;
}

/// A bad property is an incident naming the property, the service task and the process; no
/// model is called.
#[tokio::test]
async fn a_bad_property_is_an_incident_naming_it_and_the_process() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let mut properties = agent_properties("openai/bpmn-v1", "refundDecision");
    properties.push(("toolServers", "orders, https://attacker.example/mcp"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&properties),
    );
    let instance = start(&stack, "o-1");
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 1),
        settings(Duration::from_secs(600)),
    );
    let failed = wait_incident(&stack, &instance).await;
    assert_eq!(failed.retries, Some(0));
    let message = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("process \"refundApproval\"")
            && message.contains("\"refundAgent\"")
            && message.contains("\"abada.agent.toolServers\"")
            && message.contains("registry"),
        "{message}"
    );
    assert_eq!(stack.model.total_calls(), 0);
    worker.stop().await;
    stack.shutdown().await;
}

/// An XML the engine serves is outside input: an entity bomb is refused (no DTD), a deep
/// nesting too, each an incident that says why, within the worker's bounds.
#[tokio::test]
async fn hostile_xml_from_the_engine_is_an_incident_not_a_crash() {
    let bomb = r#"<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<bpmn:definitions xmlns:bpmn="http://www.omg.org/spec/BPMN/20100524/MODEL">&lol3;</bpmn:definitions>"#;
    let deep = format!("{}{}", "<a>".repeat(50_000), "</a>".repeat(50_000));
    for (xml, says) in [(bomb.to_string(), "DTD"), (deep, "nest over 256 levels")] {
        let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
        stack
            .engine
            .deploy_bpmn(ProcessModel::refund_approval(None), xml);
        let instance = start(&stack, "o-1");
        let worker = stack.spawn_worker(
            WorkerOptions::new("w1", 1),
            settings(Duration::from_secs(600)),
        );
        let failed = wait_incident(&stack, &instance).await;
        let message = failed.error_message.unwrap_or_default();
        assert!(
            message.contains("process \"refundApproval\"")
                && message.contains("BPMN XML cannot be read")
                && message.contains(says),
            "{message}"
        );
        assert!(!worker.is_finished(), "the worker runs on");
        worker.stop().await;
        stack.shutdown().await;
    }
}

/// An XML larger than the worker reads is refused as its bytes arrive (the engine answer's
/// cap), an incident, not an allocation of the whole.
#[tokio::test]
async fn a_huge_definition_is_refused_at_the_read_cap() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let padding = " ".repeat(abada_agent_worker::body::PROCESS_DEFINITION_MAX_BYTES + 1);
    let mut xml = refund_bpmn(&agent_properties("openai/bpmn-v1", "r"));
    xml.push_str(&padding);
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), xml);
    let instance = start(&stack, "o-1");
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 1),
        settings(Duration::from_secs(600)),
    );
    let failed = wait_incident(&stack, &instance).await;
    let message = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("cannot read process definition \"refundApproval\"")
            && message.contains("4194304"),
        "{message}"
    );
    assert_eq!(stack.model.total_calls(), 0);
    worker.stop().await;
    stack.shutdown().await;
}

/// No agents file, no properties on the service task: the task is an incident that says where
/// a definition may be written.
#[tokio::test]
async fn a_service_task_without_properties_and_no_agents_file_says_where_to_define_the_agent() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.engine.deploy(ProcessModel::refund_approval(None));
    let instance = start(&stack, "o-1");
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 1),
        settings(Duration::from_secs(600)),
    );
    let failed = wait_incident(&stack, &instance).await;
    let message: String = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("abada.agent.* properties") && message.contains("ABADA_AGENT_AGENTS_FILE"),
        "{message}"
    );
    worker.stop().await;
    stack.shutdown().await;
}

/// An identity without `process:read`: the 403 is an incident that names the scope; with an
/// agents-file entry for the topic, that entry runs instead, and the process API is not asked
/// again for every task.
#[tokio::test]
async fn a_refused_process_read_names_process_read_or_falls_back_to_the_topic_entry() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack
        .model
        .set_script("operator", answer_script("operator"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "refundDecision")),
    );
    stack.engine.deny_process_reads(true);
    let instance = start(&stack, "o-1");
    let worker = stack.spawn_worker(
        WorkerOptions::new("w1", 1),
        settings(Duration::from_secs(600)),
    );
    let failed = wait_incident(&stack, &instance).await;
    let message = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("403 ACCESS_DENIED") && message.contains("process:read"),
        "{message}"
    );
    worker.stop().await;

    let dir = ScratchDir::new("bpmn-denied");
    let agents = dir.write(
        "agents.toml",
        "[agents.\"abada:agent\"]\nmodel = \"openai/operator\"\ninput = \"${orderId}\"\nresultVariable = \"operatorResult\"\n",
    );
    let mut opts = WorkerOptions::new("w2", 1);
    opts.env = vec![(
        config::ENV_AGENTS_FILE.to_string(),
        agents.display().to_string(),
    )];
    stack.engine.clear_calls();
    let instances = [start(&stack, "o-2"), start(&stack, "o-3")];
    let worker = stack.spawn_worker(opts, settings(Duration::from_secs(600)));
    for instance in &instances {
        let done = wait_completed(&stack, instance).await;
        assert_eq!(done.variables["operatorResult"]["by"], json!("operator"));
    }
    assert_eq!(
        reads(&stack, Operation::ProcessInstanceRead),
        1,
        "refused once, then left alone"
    );
    assert_eq!(stack.model.calls("bpmn-v1"), 0);
    worker.stop().await;
    stack.shutdown().await;
}

/// Behind the engine's `proxy` security mode, the worker's headers file reaches the process
/// API's reads too, and `abada-worker` alone does not grant them: the incident names
/// `process:read`; with the permission `process:read` the agent runs.
#[tokio::test]
async fn behind_the_proxy_the_process_reads_need_the_process_read_permission() {
    use abada_agent_worker::devkit::engine::ProxyAuthorizer;
    use abada_agent_worker::devkit::stack::StackOptions;
    let stack = Stack::start_with(StackOptions {
        protocol: ProtocolLevel::PlainV1,
        authorizer: Some(std::sync::Arc::new(ProxyAuthorizer)),
    })
    .await
    .unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    stack.engine.deploy_bpmn(
        ProcessModel::refund_approval(None),
        refund_bpmn(&agent_properties("openai/bpmn-v1", "refundDecision")),
    );
    let dir = ScratchDir::new("bpmn-proxy");
    let worker_with = |headers: &str, id: &str| {
        let path = dir.write(&format!("{id}.headers"), headers);
        let mut opts = WorkerOptions::new(id, 1);
        opts.env = vec![(
            config::ENV_ENGINE_HEADERS_FILE.to_string(),
            path.display().to_string(),
        )];
        stack.spawn_worker(opts, settings(Duration::from_secs(600)))
    };

    let refused = start(&stack, "o-1");
    let worker = worker_with(
        "X-Auth-Request-User: agent-worker\nX-Auth-Request-Groups: abada-worker\n",
        "w1",
    );
    let failed = wait_incident(&stack, &refused).await;
    let message = failed.error_message.unwrap_or_default();
    assert!(
        message.contains("403 ACCESS_DENIED") && message.contains("process:read"),
        "{message}"
    );
    worker.stop().await;

    let allowed = start(&stack, "o-2");
    let worker = worker_with(
        "X-Auth-Request-User: agent-worker\nX-Auth-Request-Permissions: worker:execute,process:read\n",
        "w2",
    );
    let done = wait_completed(&stack, &allowed).await;
    assert_eq!(done.variables["refundDecision"]["by"], json!("bpmn-v1"));
    worker.stop().await;
    stack.shutdown().await;
}

/// From the BPMN service task's `abada.agent.outputSchema` property: a schema hiding the chain
/// of `anyOf`s that crashed every replica in turn (under `dependencies`, which the walker did
/// not know, and every other place a subschema sits) is refused when the definition is read:
/// an incident naming the keyword and where, and the process; no model is called. Each
/// deployment is a new version, read at once.
#[tokio::test]
async fn a_schema_hiding_an_any_of_chain_in_the_bpmn_is_an_incident_naming_where() {
    use crate::output::{HIDING_PLACES, chain_under, names_the_place};
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script("bpmn-v1", answer_script("bpmn-v1"));
    let worker = stack.spawn_worker(WorkerOptions::new("w1", 1), settings(Duration::ZERO));
    for keyword in HIDING_PLACES {
        let schema = chain_under(keyword).to_string();
        let mut properties = agent_properties("openai/bpmn-v1", "refundDecision");
        properties.retain(|(name, _)| *name != "outputSchema");
        properties.push(("outputSchema", &schema));
        stack.engine.deploy_bpmn(
            ProcessModel::refund_approval(None),
            refund_bpmn(&properties),
        );
        let instance = start(&stack, "o-1");
        let failed = wait_incident(&stack, &instance).await;
        assert_eq!(failed.retries, Some(0));
        let message = failed.error_message.unwrap_or_default();
        assert!(
            names_the_place(&message, keyword) && message.contains("\"refundApproval\""),
            "{keyword}: {message}"
        );
    }
    assert_eq!(stack.model.total_calls(), 0);
    worker.stop().await;
    stack.shutdown().await;
}
