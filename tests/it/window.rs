//! The context window over real HTTP: the scripted model refuses, in each
//! wire format's words, any request whose prompt and output cap exceed its window, and records
//! every request it received with its prompt's size. A conversation that outgrows the window
//! elides its oldest tool results and completes; one that cannot fit ends with an incident
//! naming the sizes; no request past the window is ever sent.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus, TaskView};
use abada_agent_worker::devkit::model::{RecordedRequest, Script, Turn};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Value, json};

use crate::agent::{spec, wait_all_ended};

const INCIDENT: &str = "the conversation is too long for the model's context window";
const ELIDED: &str = "[elided by the worker";

/// `documents` calls of `read_document`, `bytes` long each, one per answer, then a final answer.
fn reading_script(documents: usize, bytes: u64, window: u64) -> Script {
    let mut turns: Vec<Turn> = (0..documents)
        .map(|i| {
            Turn::call(
                "read_document",
                json!({"documentId": format!("doc-{i}"), "bytes": bytes}),
            )
        })
        .collect();
    turns.push(Turn::text(r#"{"summary": "read them all"}"#));
    Script::new(turns).with_context_window(window)
}

fn reader(stack: &Stack, model: &str, max_output_tokens: u32) -> Value {
    let mut agent = stack.refund_agent(model, &[]);
    agent["instructions"] = json!("Read the documents one by one, then summarise them.");
    agent["maxTurns"] = json!(12);
    agent["maxOutputTokens"] = json!(max_output_tokens);
    agent["resultVariable"] = json!("summary");
    agent
}

/// The requests the scripted model received for `model`.
fn requests_of(stack: &Stack, model: &str) -> Vec<RecordedRequest> {
    stack
        .model
        .requests()
        .into_iter()
        .filter(|r| r.model == model)
        .collect()
}

fn cap_of(r: &RecordedRequest) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| r.body.get(*k).and_then(Value::as_u64))
        .expect("every request carries an output cap")
}

fn elided_in(r: &RecordedRequest) -> usize {
    r.body.to_string().matches(ELIDED).count()
}

fn tool_results(view: &TaskView) -> Vec<String> {
    view.journal
        .iter()
        .filter(|s| s["kind"] == "tool" && s["state"] == "finished")
        .map(|s| s["data"]["result"].to_string())
        .collect()
}

/// The incident's message and details, as an operator reads them.
fn incident_text(view: &TaskView) -> String {
    format!(
        "{} {}",
        view.error_message.as_deref().unwrap_or_default(),
        view.error_details.as_deref().unwrap_or_default()
    )
}

#[tokio::test]
async fn a_conversation_that_outgrows_its_window_elides_old_results_and_goes_on() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // OpenAI's format on a model the worker knows (gpt-4: 8,192 tokens, from the table); the
    // Anthropic format on a provider configured with a window.
    stack
        .model
        .set_script("gpt-4", reading_script(6, 8000, 8192));
    stack
        .model
        .set_script("reader", reading_script(6, 6000, 6000));
    let ids = stack.engine.create_tasks([
        spec(reader(&stack, "openai/gpt-4", 500), "o-1"),
        spec(reader(&stack, "anthropic/reader", 400), "o-2"),
    ]);
    let mut opts = WorkerOptions::new("w-window", 2);
    opts.env.push((
        "ABADA_AGENT_PROVIDER_ANTHROPIC_CONTEXT_WINDOW".into(),
        "6000".into(),
    ));
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    for (view, (model, window, bytes)) in views
        .iter()
        .zip([("gpt-4", 8192u64, 8000usize), ("reader", 6000, 6000)])
    {
        assert_eq!(view.status, TaskStatus::Completed, "{model}: {view:?}");
        let result = view.result_variables.as_ref().unwrap();
        assert_eq!(result["summary"]["summary"], "read them all", "{model}");
        // The journal keeps every result whole: the elision is derived, never stored.
        let results = tool_results(view);
        assert_eq!(results.len(), 6, "{model}");
        assert!(
            results
                .iter()
                .all(|r| r.len() > bytes && !r.contains(ELIDED)),
            "{model}"
        );
        let requests = requests_of(&stack, model);
        assert_eq!(
            requests.len(),
            7,
            "{model}: one request per turn, none refused"
        );
        for r in &requests {
            assert!(
                r.prompt_tokens + cap_of(r) <= window,
                "{model}: a request past the window was sent: {} + {}",
                r.prompt_tokens,
                cap_of(r)
            );
        }
        // Without elision the last request would hold six documents: far past the window.
        let last = requests.last().unwrap();
        assert!(elided_in(last) >= 3, "{model}: {}", elided_in(last));
        // The oldest go first and the latest answer's result stays whole.
        let text = last.body.to_string();
        let first_doc = text.find("Document doc-0:");
        let last_doc = text.find("Document doc-5:");
        assert!(first_doc.is_none(), "{model}: the oldest result was kept");
        assert!(last_doc.is_some(), "{model}: the latest result was elided");
        // Elided results stay elided: the count never falls from one request to the next.
        let counts: Vec<usize> = requests.iter().map(elided_in).collect();
        assert!(
            counts.windows(2).all(|w| w[0] <= w[1]),
            "{model}: {counts:?}"
        );
    }
    worker.stop().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_conversation_that_cannot_fit_ends_with_an_incident_naming_the_sizes() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // An input larger than the window: not one request goes out.
    stack
        .model
        .set_script("small", reading_script(1, 100, 4096));
    // A latest result larger than the window: it cannot be elided, the task ends after it.
    stack
        .model
        .set_script("small2", reading_script(2, 40_000, 4096));
    let mut big_input = spec(reader(&stack, "openai/small", 256), "o-1");
    big_input
        .variables
        .insert("orderId".into(), json!("x".repeat(30_000)));
    let ids = stack.engine.create_tasks([
        big_input,
        spec(reader(&stack, "anthropic/small2", 256), "o-2"),
    ]);
    let mut opts = WorkerOptions::new("w-window-full", 2);
    for provider in ["OPENAI", "ANTHROPIC"] {
        opts.env.push((
            format!("ABADA_AGENT_PROVIDER_{provider}_CONTEXT_WINDOW"),
            "4096".into(),
        ));
    }
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    for (view, (model, sent)) in views.iter().zip([("small", 0), ("small2", 1)]) {
        assert_eq!(view.status, TaskStatus::Failed, "{model}: {view:?}");
        assert_eq!(view.retries, Some(0), "{model}: an incident");
        assert_eq!(view.counters.failures, 1, "{model}: reported once");
        let details = incident_text(view);
        assert!(details.starts_with(INCIDENT), "{model}: {details}");
        for part in [
            "context window of 4096 tokens",
            "maxOutputTokens = 256",
            "needs an estimated",
        ] {
            assert!(details.contains(part), "{model}: {part}: {details}");
        }
        assert_eq!(requests_of(&stack, model).len(), sent, "{model}");
    }
    worker.stop().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_models_own_refusal_of_a_window_the_worker_does_not_know_is_the_same_incident() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // No window configured or known for "unknown": the worker sends, the model refuses with
    // its sizes, in each wire format; never retried, never deferred, the same wording.
    stack
        .model
        .set_script("unknown", reading_script(3, 20_000, 4000));
    let ids = stack.engine.create_tasks([
        spec(reader(&stack, "openai/unknown", 300), "o-1"),
        spec(reader(&stack, "anthropic/unknown", 300), "o-2"),
    ]);
    let worker = stack.spawn_worker(
        WorkerOptions::new("w-window-unknown", 2),
        Stack::fast_agent_settings(),
    );
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    for view in &views {
        assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
        assert_eq!(view.retries, Some(0), "an incident");
        assert_eq!(view.counters.failures, 1);
        let details = incident_text(view);
        assert!(details.starts_with(INCIDENT), "{details}");
        assert!(details.contains("4000"), "the model's sizes: {details}");
    }
    // Each task: the first request fits, the second (one 20,000-byte result) does not; refused
    // once, never retried.
    assert_eq!(requests_of(&stack, "unknown").len(), 4);
    worker.stop().await;
    stack.shutdown().await;
}

/// A keyed write's result is the model's only record that the write was performed: it is never
/// elided, however old (the oldest results go first otherwise), and every stub says the call
/// was performed and must not be repeated to perform it again (an elided result used to invite
/// "call the tool again", a second refund under a new key).
#[tokio::test]
async fn a_keyed_writes_result_is_never_elided_and_every_stub_says_not_to_repeat() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    // A refund whose result (the order id echoed) is larger than a stub, then five documents.
    let order = format!("o-{}", "7".repeat(3000));
    let mut turns = vec![Turn::call(
        "issue_refund",
        json!({"orderId": order, "amountCents": 1500}),
    )];
    turns.extend((0..5).map(|i| {
        Turn::call(
            "read_document",
            json!({"documentId": format!("doc-{i}"), "bytes": 6000}),
        )
    }));
    turns.push(Turn::text(r#"{"summary": "refunded, then read them all"}"#));
    stack
        .model
        .set_script("writer", Script::new(turns).with_context_window(8000));
    let ids = stack
        .engine
        .create_tasks([spec(reader(&stack, "anthropic/writer", 400), "o-1")]);
    let mut opts = WorkerOptions::new("w-window-write", 1);
    opts.env.push((
        "ABADA_AGENT_PROVIDER_ANTHROPIC_CONTEXT_WINDOW".into(),
        "8000".into(),
    ));
    let worker = stack.spawn_worker(opts, Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    let requests = requests_of(&stack, "writer");
    let last = requests.last().expect("requests").body.to_string();
    assert!(elided_in(requests.last().unwrap()) >= 2, "{last}");
    assert!(
        last.contains("rf-1"),
        "the refund's result was elided from the last request"
    );
    for stub in last.split(ELIDED).skip(1) {
        let stub = &stub[..stub.find(']').unwrap_or(stub.len())];
        assert!(
            stub.contains("was performed") && stub.contains("Do not repeat the call"),
            "{stub}"
        );
    }
    assert_eq!(stack.tools.counters().await.writes_applied, 1);
    worker.stop().await;
    stack.shutdown().await;
}
