//! A rolling upgrade: runs a worker of the previous release left mid-run, which this release's
//! workers resume.
//!
//! The previous release is the commit before `51d7c31` ("A run's definition decides
//! everything after its first step"): its journal's input step carries the agent's
//! definition only when the definition came from the BPMN (`bpmn::journal_snapshot` of that
//! commit); a definition from the agents file or sent by the engine was not journaled, so its
//! input step is `{"instructions", "input", "startedAtMs"}` alone. Its other steps (model,
//! tool `started`/`finished`, approval) are written as this release writes them; the `output`
//! kind (judged final answers) came later and is simply absent. So the journal this module
//! seeds is what that release left when its process died right after applying a keyed write:
//! the input step without a definition, the model's answer asking for the write (turn 0), and
//! the write's `tool/started` step with its key, the write applied by the tool server (its
//! ledger holds the key) and its answer never journaled.
//!
//! On an agent/1 engine the steps are the task's engine journal (`EngineCore::seed_journal`);
//! on a plain v1 engine they are the task's run in the run store, claimed and written by the
//! previous release's worker, silent since. This release must resume the run (send the write
//! again under its key, answered from the ledger, then ask the model for turn 1), never begin
//! it again (which would ask the model for turn 0 again, and pay the write again under a new
//! key); a journal it cannot resume safely must end as an incident that names why.

use serde_json::{Value, json};

use super::World;
use super::model::ModelScript;
use super::trace::Event;
use abada_agent_worker::agent::definition::AgentDefinition;
use abada_agent_worker::agent::journal;
use abada_agent_worker::conversation::{AssistantMessage, ToolCall, ToolResult, Usage};
use abada_agent_worker::engine::JournalStep;
use abada_agent_worker::store::{Claimant, RunKey, RunStore};
use abada_devkit::engine::TaskSpec;

/// The worker id the previous release's process had (it is gone: no call of it is simulated).
pub const PREVIOUS_WORKER: &str = "previous-release";

/// The journal the previous release left for `task_id` running `script` (whose first step is
/// a write) on `agent`, the agents-file or engine definition: the input step without the
/// definition, the model's turn 0, the write started.
fn previous_release_steps(task_id: &str, script: &ModelScript, agent: &Value) -> Vec<JournalStep> {
    let def = AgentDefinition::from_value(agent, "abada:agent")
        .expect("the simulation's agent is a valid definition");
    let (instructions, input) = def
        .render(&super::process::input_variables(script))
        .expect("the simulation's agent renders its input");
    // No `journal::with_definition`: the previous release journaled only BPMN definitions.
    let input_step =
        journal::started_input_step(1, &instructions, &input, std::time::SystemTime::now());
    let call = ToolCall {
        call_id: "call-0".into(),
        server: super::tools::SERVER.into(),
        tool: "sim_write".into(),
        arguments: json!({"task": script.task, "n": 0}),
    };
    let model = def
        .models
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    let answer = AssistantMessage {
        text: None,
        tool_calls: vec![call.clone()],
    };
    let usage = Usage {
        input_tokens: 100,
        output_tokens: 20,
    };
    vec![
        input_step,
        journal::model_step(2, &model, &answer, usage, "tool_calls"),
        journal::tool_started_step(3, &journal::write_key(task_id, 3), &call),
    ]
}

/// The write the previous release applied before it died: in the tool server's ledger under
/// its key, and in the trace as applied (the keyed-write invariant counts it).
fn applied_by_previous_release(world: &World, task_id: &str, script: &ModelScript) {
    let key = journal::write_key(task_id, 3);
    let result = ToolResult {
        content: vec![json!({"type": "text", "text": super::tools::receipt_text(&script.task, 0)})],
        structured_content: None,
        is_error: false,
    };
    world.ledger().by_key.insert(key.clone(), result);
    world.record(Event::ToolCall {
        worker: PREVIOUS_WORKER.into(),
        task: script.task.clone(),
        write: Some(0),
        key: Some(key),
        answer: "applied",
    });
}

/// Seeds a task of `script` (its steps begin with a write) in flight under the previous
/// release: on an agent/1 engine, a task sent with its definition and its engine journal; on a
/// plain one, a `simTask` instance whose run the previous release's worker claimed and wrote in
/// the run store. Returns the engine task's id.
pub async fn seed(world: &World, script: &ModelScript, retries: i32) -> Option<String> {
    let agent = super::process::agent_definition(false);
    if !world.store_journal {
        let id = world.core().create_task(TaskSpec {
            variables: super::process::input_variables(script),
            agent: Some(agent.clone()),
            retries: Some(retries),
            ..TaskSpec::default()
        });
        let steps = previous_release_steps(&id, script, &agent)
            .iter()
            .map(|s| serde_json::to_value(s).expect("a journal step is JSON"))
            .collect();
        world.core().seed_journal(&id, steps);
        applied_by_previous_release(world, &id, script);
        return Some(id);
    }
    let instance = super::process::start_task(world, script).ok()?;
    let id = world
        .core()
        .tasks()
        .into_iter()
        .find(|t| t.process_instance_id == instance)?
        .id;
    let steps = previous_release_steps(&id, script, &agent);
    let key = RunKey::for_task(&id).ok()?;
    let claimant = Claimant {
        worker_id: PREVIOUS_WORKER,
        task_id: &id,
        hold: world.lock_duration,
    };
    let store: &dyn RunStore = &world.store;
    let mut claim = store.claim(&key, &claimant, Some(&steps[0])).await.ok()?;
    for step in &steps[1..] {
        store.append(&mut claim.fence, step).await.ok()?;
    }
    applied_by_previous_release(world, &id, script);
    Some(id)
}
