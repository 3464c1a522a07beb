//! The operator's ceilings over what a definition (a less-trusted party: a process author, an
//! engine) can make the worker spend or store, on the wire: the output cap of a model call
//! (`ABADA_AGENT_MAX_OUTPUT_TOKENS`), the token budget (`ABADA_AGENT_MAX_TOKEN_BUDGET`,
//! `ABADA_AGENT_DEFAULT_TOKEN_BUDGET`), the models a provider may be asked for
//! (`ABADA_AGENT_PROVIDER_<NAME>_MODELS`), and what a completion may store in process
//! variables (well below what the worker accepts as the instance's next task).

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Value, json};

use crate::agent::{spec, wait_all_ended};

/// A definition on `model` that answers at once (no tool).
fn answering(stack: &Stack, model: &str) -> Value {
    let mut agent = stack.refund_agent(model, &[]);
    agent["toolServers"] = json!([]);
    agent
}

fn incident_text(view: &TaskView) -> String {
    format!(
        "{} {}",
        view.error_message.as_deref().unwrap_or_default(),
        view.error_details.as_deref().unwrap_or_default()
    )
}

/// A definition asking for two billion output tokens gets the operator's ceiling; one naming a
/// model the provider's allow-list lacks is an incident before anything is sent; one without
/// a budget gets the operator's default budget.
#[tokio::test]
async fn the_operators_ceilings_bound_what_a_definition_spends_and_which_models_it_names() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    for model in ["answer", "o1-pro-2025-03-19"] {
        stack.model.set_script(
            model,
            Script::new(vec![Turn::text(r#"{"ok": true}"#)]).with_usage(20, 5),
        );
    }
    let mut greedy = answering(&stack, "openai/answer");
    greedy["maxOutputTokens"] = json!(2_000_000_000u64);
    greedy["tokenBudget"] = json!(1_000_000_000u64);
    let expensive = answering(&stack, "openai/o1-pro-2025-03-19");
    let unbudgeted = answering(&stack, "anthropic/answer");
    let ids = stack.engine.create_tasks([
        spec(greedy, "o-1"),
        spec(expensive, "o-2"),
        spec(unbudgeted, "o-3"),
    ]);
    let mut opts = WorkerOptions::new("w-ceilings", 3);
    opts.env.extend([
        ("ABADA_AGENT_MAX_OUTPUT_TOKENS".into(), "1000".into()),
        ("ABADA_AGENT_MAX_TOKEN_BUDGET".into(), "100000".into()),
        ("ABADA_AGENT_DEFAULT_TOKEN_BUDGET".into(), "10".into()),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_MODELS".into(),
            "answer, gpt-4.1-mini".into(),
        ),
    ]);
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;

    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    let caps: Vec<u64> = stack
        .model
        .requests()
        .iter()
        .filter(|r| r.model == "answer")
        .filter_map(|r| {
            ["max_completion_tokens", "max_tokens"]
                .iter()
                .find_map(|k| r.body.get(*k).and_then(Value::as_u64))
        })
        .collect();
    assert_eq!(
        caps,
        vec![1000],
        "the output cap sent is the operator's ceiling"
    );

    assert_eq!(views[1].status, TaskStatus::Failed, "{:?}", views[1]);
    assert_eq!(views[1].retries, Some(0));
    let text = incident_text(&views[1]);
    assert!(
        text.contains("openai/o1-pro-2025-03-19")
            && text.contains("ABADA_AGENT_PROVIDER_OPENAI_MODELS = answer,gpt-4.1-mini"),
        "{text}"
    );
    assert_eq!(
        stack.model.calls("o1-pro-2025-03-19"),
        0,
        "nothing was sent"
    );

    assert_eq!(views[2].status, TaskStatus::Failed, "{:?}", views[2]);
    let text = incident_text(&views[2]);
    assert!(text.contains("tokenBudget = 10"), "{text}");
    worker.stop().await;
    stack.shutdown().await;
}

/// A final answer of 1.9 MB (the model's to choose) would be stored in a process variable that
/// the engine then hands to the instance's every next task: larger than the 1 MiB a worker
/// takes, so that next task would be an incident nobody can retry. The completion is refused
/// instead, an incident naming the variable and the cap, and nothing is stored.
#[tokio::test]
async fn a_result_too_large_to_store_is_an_incident_and_nothing_is_stored() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let huge = format!(r#"{{"report": "{}"}}"#, "x".repeat(1_900_000));
    stack
        .model
        .set_script("verbose", Script::new(vec![Turn::text(huge)]));
    let ids = stack
        .engine
        .create_tasks([spec(answering(&stack, "openai/verbose"), "o-1")]);
    let worker = stack.spawn_worker(
        WorkerOptions::new("w-stored", 1),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    let view = &views[0];
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.retries, Some(0));
    let text = incident_text(view);
    assert!(
        text.contains("too large to store")
            && text.contains("\"refundDecision\"")
            && text.contains("262144"),
        "{text}"
    );
    assert!(view.result_variables.is_none(), "nothing was stored");
    worker.stop().await;
    stack.shutdown().await;
}
