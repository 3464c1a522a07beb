//! The agent runtime end to end over real HTTP: emulator, scripted model (both wire formats),
//! the devkit MCP tool server, and the real runner; one test per outcome of protocol.md B.5.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::stack::{Stack, WorkerOptions};
use serde_json::{Map, Value, json};

pub fn spec(agent: Value, order: &str) -> TaskSpec {
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    TaskSpec {
        variables,
        agent: Some(agent),
        retries: Some(3),
        ..TaskSpec::default()
    }
}

pub async fn wait_all_ended(stack: &Stack, ids: &[String], limit: Duration) -> Vec<TaskView> {
    let ids = ids.to_vec();
    tokio::time::timeout(
        limit,
        stack.engine.wait_for(|e| {
            let views: Vec<TaskView> = ids.iter().filter_map(|id| e.task(id)).collect();
            views
                .iter()
                .all(|v| {
                    matches!(
                        v.status,
                        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
                    )
                })
                .then_some(views)
        }),
    )
    .await
    .expect("tasks did not end in time")
}

#[tokio::test]
async fn a_refund_agent_completes_through_both_wire_formats() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let ids = stack.engine.create_tasks([
        spec(stack.refund_agent("openai/refund", &[]), "o-1"),
        spec(stack.refund_agent("anthropic/refund", &[]), "o-2"),
    ]);
    let worker = stack.spawn_worker(WorkerOptions::new("w1", 4), Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(20)).await;
    for (view, order) in views.iter().zip(["o-1", "o-2"]) {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        let result = view.result_variables.as_ref().unwrap();
        assert_eq!(result["refundDecision"]["decision"], "refunded");
        assert_eq!(result["refundDecision"]["orderId"], order);
        assert_eq!(result["agentUsage"]["turns"], 3);
        assert_eq!(result["agentUsage"]["inputTokens"], 360);
        let kinds: Vec<String> = view
            .journal
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["kind"].as_str().unwrap(),
                    s["state"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "input/finished",
                "model/finished",
                "tool/finished",
                "model/finished",
                "tool/started",
                "tool/finished",
                "model/finished"
            ]
        );
        assert!(
            view.journal[2].get("key").is_none(),
            "a read-only call is not keyed"
        );
        let key = format!("abada:{}:5", view.id);
        assert_eq!(view.journal[4]["key"], key.as_str());
        assert_eq!(view.journal[5]["key"], key.as_str());
        assert_eq!(view.journal[4]["data"]["server"], "orders");
        assert_eq!(view.journal[4]["data"]["tool"], "issue_refund");
    }
    let counters = stack.tools.counters().await;
    assert_eq!(counters.writes_applied, 2);
    assert_eq!(counters.duplicates, 0);
    worker.stop().await;
    assert_eq!(stack.tools.counters().await.sessions_open, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn the_real_binary_runs_agents_and_drains_on_sigterm() {
    use crate::support::process::{WorkerProcess, stack_env};
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let ids = stack.engine.create_tasks(
        (0..3).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    let mut worker = WorkerProcess::spawn(&stack_env(&stack, "proc-1")).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(20)).await;
    assert!(views.iter().all(|v| v.status == TaskStatus::Completed));
    let (status, body) = worker.admin_get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit}");
    let logs = worker.stdout();
    assert!(
        logs.iter()
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "every line is JSON"
    );
    assert!(logs.iter().all(|l| l.contains("\"worker_id\":\"proc-1\"")));
    stack.shutdown().await;
}
