//! Approval of tool calls (issue 14) end to end: the emulator runs the worked example's process
//! (agent node, gateway on agentStatus, user task "Approve refund", back to the agent node) and
//! the real runner works its agent tasks.
//!
//! Today the agent runtime keeps no run in the run store, so a conversation has nowhere to wait
//! for a person: a definition that asks for approval is refused before anything is performed.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProcessModel, ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Map, json};

#[tokio::test]
async fn an_agent_asking_for_approval_without_a_run_store_is_an_incident_and_performs_nothing() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let mut agent = stack.refund_agent("openai/refund", &[]);
    agent["approval"] = json!("writes");
    stack
        .engine
        .deploy(ProcessModel::refund_approval(Some(agent)));
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!("o-77"));
    let instance = stack
        .engine
        .start_process("refundApproval", variables)
        .unwrap();
    let worker = stack.spawn_worker(WorkerOptions::new("w1", 2), Stack::fast_agent_settings());

    let failed = tokio::time::timeout(
        Duration::from_secs(20),
        stack.engine.wait_for(|e| {
            e.tasks()
                .into_iter()
                .find(|t| t.process_instance_id == instance && t.status == TaskStatus::Failed)
        }),
    )
    .await
    .expect("the task becomes an incident");
    assert_eq!(failed.retries, Some(0));
    let message = failed.error_message.clone().unwrap_or_default();
    assert!(
        message.contains("\"refund-agent\"")
            && message.contains("approval")
            && message.contains("run store")
            && message.contains("nothing was performed"),
        "{message}"
    );
    assert!(failed.journal.is_empty(), "no step was journaled");
    assert_eq!(stack.model.total_calls(), 0, "no model call was paid");
    assert_eq!(stack.tools.counters().await.writes_applied, 0);
    let view = stack.engine.process_instance(&instance).unwrap();
    assert_eq!(
        view.current_activity_id, "refundAgent",
        "the token did not move"
    );
    worker.stop().await;
    stack.shutdown().await;
}

/// The emulator's model is the worked example's BPMN: same process, nodes, topic, condition,
/// candidate group and flows (checked on the file's text; the emulator does not parse BPMN).
#[test]
fn the_emulated_model_is_the_worked_example_bpmn() {
    use abada_agent_worker::devkit::engine::NodeKind;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/refund-approval.bpmn");
    let text = std::fs::read_to_string(path).expect("the example BPMN exists");
    // The elements only, without the explaining comment.
    let bpmn = match (text.find("<!--"), text.find("-->")) {
        (Some(start), Some(end)) if start < end => format!("{}{}", &text[..start], &text[end..]),
        _ => text,
    };
    let model = ProcessModel::refund_approval(None);
    assert!(bpmn.contains(&format!(
        r#"<bpmn:process id="{}" name="{}""#,
        model.id, model.name
    )));
    assert!(bpmn.contains(&format!(
        r#"<bpmn:sequenceFlow id="toAgent" sourceRef="start" targetRef="{}"/>"#,
        model.start
    )));
    assert!(!bpmn.contains("camunda:type"), "refused by the engine");
    for node in &model.nodes {
        let id = &node.id;
        match &node.kind {
            NodeKind::ServiceTask { topic, next, .. } => {
                assert!(bpmn.contains(&format!(
                    r#"<bpmn:serviceTask id="{id}" name="Refund agent" camunda:topic="{topic}">"#
                )));
                assert!(bpmn.contains(&format!(r#"sourceRef="{id}" targetRef="{next}"/>"#)));
            }
            NodeKind::UserTask {
                name,
                candidate_groups,
                next,
            } => {
                assert!(bpmn.contains(&format!(
                    r#"<bpmn:userTask id="{id}" name="{name}" camunda:candidateGroups="{}">"#,
                    candidate_groups.join(",")
                )));
                assert!(bpmn.contains(&format!(r#"sourceRef="{id}" targetRef="{next}"/>"#)));
            }
            NodeKind::ExclusiveGateway { flows, default } => {
                assert!(bpmn.contains(&format!(
                    r#"<bpmn:exclusiveGateway id="{id}" name="Agent status?" default="done">"#
                )));
                assert_eq!(default.as_deref(), Some("end"));
                assert!(bpmn.contains(&format!(
                    r#"<bpmn:sequenceFlow id="done" name="done" sourceRef="{id}" targetRef="end"/>"#
                )));
                for flow in flows {
                    assert!(
                        bpmn.contains(&format!(r#"sourceRef="{id}" targetRef="{}">"#, flow.target))
                    );
                    assert!(bpmn.contains(&format!(
                        "${{{} == '{}'}}",
                        flow.variable,
                        flow.equals.as_str().unwrap()
                    )));
                }
            }
            NodeKind::End => assert!(bpmn.contains(&format!(r#"<bpmn:endEvent id="{id}""#))),
        }
    }
}
