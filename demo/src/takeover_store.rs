//! Scenario `takeover --store`: the seed's story on an engine without agent/1 (the emulator's
//! 0.11 mode: no attempt, no journal) kept durable by the PostgreSQL run store. Worker 1 is
//! frozen inside its keyed write (applied by the tool server, its answer held), so nothing of
//! it is journaled; the engine's clock moves past its lease; worker 2 takes the task, claims the
//! run in the store (a new attempt: the fencing token), resumes from the store's journal and
//! re-sends the write with its original key (deduplicated). Worker 1 wakes, tries to journal the
//! write's result, and the store refuses it (`RUN_STORE_FENCED`): it abandons the task silently.
//!
//! The agent comes from an agents file and the tool server from a registry file, as an operator
//! of a 0.11 engine would give them; both are written to a temporary directory for the run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::takeover::{LEASE, expire_w1_lease, w2_finishes, w2_takes_over};
use super::takeover::{call_json, call_text, operation_name};
use super::timeline::{Output, Timeline};
use super::workers::{FreezeAt, TaskOutcome, WorkerSpec, Workers};
use super::{Check, Crew, DemoError, DemoReport, DemoStore, metric_sum, pump, pump_until};
use abada_devkit::engine::{CallRecord, Disposition, Operation, ProtocolLevel, TaskStatus};
use abada_devkit::stack::{ORDERS_SERVER, REFUND_MODEL, Stack, refund_script};
use abada_devkit::tools::{StaticTokens, ToolServer, ToolServerOptions};

const SCENARIO: &str = "takeover";
const LIMIT: Duration = Duration::from_secs(20);

/// The agents and registry files of the run, deleted when dropped.
struct OperatorFiles {
    dir: PathBuf,
    agents: PathBuf,
    tools: PathBuf,
}

impl OperatorFiles {
    fn write(tools_url: &str) -> Result<OperatorFiles, DemoError> {
        let dir = std::env::temp_dir().join(format!(
            "abada-demo-store-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let files = OperatorFiles {
            agents: dir.join("agents.toml"),
            tools: dir.join("tools.toml"),
            dir,
        };
        let io = |e: std::io::Error| {
            DemoError::Setup(format!(
                "cannot write the demo's agents and tool registry files in {}: {e}",
                files.dir.display()
            ))
        };
        std::fs::create_dir_all(&files.dir).map_err(io)?;
        std::fs::write(
            &files.agents,
            format!(
                "[agents.\"abada:agent\"]\nname = \"refund-agent\"\nmodel = \"openai/{REFUND_MODEL}\"\n\
                 instructions = \"You handle refund requests. Look the order up, refund it, answer with JSON.\"\n\
                 input = \"${{orderId}}\"\ntoolServers = [\"{ORDERS_SERVER}\"]\nmaxTurns = 8\n\
                 resultVariable = \"refundDecision\"\n"
            ),
        )
        .map_err(io)?;
        std::fs::write(
            &files.tools,
            format!("[servers.{ORDERS_SERVER}]\nurl = \"{tools_url}\"\nauth = \"none\"\n"),
        )
        .map_err(io)?;
        Ok(files)
    }
}

impl Drop for OperatorFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) async fn run(
    workers: &dyn Workers,
    output: Output,
    store: &DemoStore,
) -> Result<DemoReport, DemoError> {
    let stack = Stack::start(ProtocolLevel::PlainV1).await?;
    stack.model.set_script(
        REFUND_MODEL,
        refund_script().with_latency(Duration::from_millis(100)),
    );
    // A 0.11 engine issues no tool credential: the operator registers the server (no auth here).
    let tools = ToolServer::start(
        ToolServerOptions::new(ORDERS_SERVER, Arc::new(StaticTokens::default())).anonymous(),
    )
    .await
    .map_err(|e| DemoError::Setup(e.to_string()));
    let result = match tools {
        Ok(tools) => {
            let result = match OperatorFiles::write(&tools.url()) {
                Ok(files) => scenario(workers, &stack, &tools, &files, store, output).await,
                Err(e) => Err(e),
            };
            tools.shutdown().await;
            result
        }
        Err(e) => Err(e),
    };
    stack.shutdown().await;
    result
}

fn worker_options(name: &str, files: &OperatorFiles, store: &DemoStore) -> WorkerSpec {
    let mut opts = WorkerSpec::new(name, 1);
    opts.lease = LEASE;
    opts.store = Some(store.for_worker());
    opts.agents_file = Some(files.agents.clone());
    opts.tools_file = Some(files.tools.clone());
    opts
}

async fn scenario(
    workers: &dyn Workers,
    stack: &Stack,
    tools: &ToolServer,
    files: &OperatorFiles,
    store: &DemoStore,
    output: Output,
) -> Result<DemoReport, DemoError> {
    let mut tl = Timeline::new(output);
    // A plain engine sends no definition: the agents file has it.
    let mut task = super::refund_task(serde_json::Value::Null, "o-417");
    task.agent = None;
    let id = stack.engine.create_task(task);
    tl.emit(
        "engine",
        "task_open",
        format!(
            "{id} OPEN on a plain v1 engine (no agent/1: no attempt, no journal): refund order o-417"
        ),
        json!({"task": id}),
    );
    tl.emit(
        "store",
        "store",
        "the run store keeps the journal; its attempt number is the fencing token",
        json!({}),
    );

    // Worker 1 is frozen inside its keyed write: the refund is applied, its answer held.
    tools.hold_next_write();
    let mut crew = Crew::new();
    let gate1 = crew.start_freezable(
        workers,
        stack,
        worker_options("W1", files, store),
        FreezeAt::Manual,
    )?;
    tl.emit(
        "demo",
        "worker_started",
        "W1 starts (1 slot, lease 10s, run store)",
        json!({"worker": "W1"}),
    );
    pump(
        &mut tl,
        &mut crew,
        tools.holding(),
        SCENARIO,
        "W1 to reach its keyed write",
        LIMIT,
    )
    .await?;
    gate1.freeze("inside its keyed write");
    let key = tools
        .calls()
        .iter()
        .find(|c| c.tool == "issue_refund")
        .and_then(|c| c.idempotency_key.clone())
        .unwrap_or_default();
    let applied_at_freeze = tools.counters().await.writes_applied;
    tl.emit(
        "tools",
        "write_applied",
        format!(
            "issue_refund with key {key}: refund applied (writes applied: {applied_at_freeze}); its answer is held"
        ),
        json!({"key": key, "writesApplied": applied_at_freeze}),
    );
    tl.emit(
        "W1",
        "frozen",
        "FREEZES inside its keyed write: no heartbeats, the result not journaled",
        json!({}),
    );
    expire_w1_lease(&mut tl, stack, &id);

    let gate2 = w2_takes_over(
        &mut tl,
        &mut crew,
        workers,
        stack,
        worker_options("W2", files, store),
        ", run store",
        SCENARIO,
        LIMIT,
    )
    .await?;
    let w2_text = crew.workers[1].worker.metrics_text();
    let w2_claims = metric_sum(
        &w2_text,
        "abada_agent_store_transaction_duration_seconds_count",
        &["operation=\"claim\""],
    );
    tl.emit(
        "W2",
        "claimed_run",
        "claims the run in the store: a new attempt from the store's sequence, W1's is stale; \
         reads the journal: issue_refund started, no result",
        json!({"storeClaims": w2_claims}),
    );
    let counters = tools.counters().await;
    tl.emit(
        "tools",
        "deduplicated",
        format!(
            "W2 re-sends issue_refund with key {key}: seen before, answered from storage (applied {}, duplicates {})",
            counters.writes_applied, counters.duplicates
        ),
        json!({"writesApplied": counters.writes_applied, "duplicates": counters.duplicates}),
    );
    tl.emit(
        "W2",
        "held",
        "holds before complete, so that W1 wakes while W2 owns the run",
        json!({}),
    );

    // Worker 1 wakes: its write's answer arrives, and it goes to journal it.
    let mark = stack.engine.calls().len();
    tools.release_held();
    tl.emit(
        "W1",
        "wakes",
        "WAKES with the write's answer and journals it, under its own stale attempt",
        json!({}),
    );
    pump_until(
        &mut tl,
        &mut crew,
        |c| !c.workers[0].ended.is_empty(),
        SCENARIO,
        "W1 to give the task up",
        LIMIT,
    )
    .await?;
    let w1_text = crew.workers[0].worker.metrics_text();
    let refused = metric_sum(
        &w1_text,
        "abada_agent_store_errors_total",
        &["operation=\"append\"", "class=\"fenced\""],
    );
    let fenced = metric_sum(
        &w1_text,
        "abada_agent_leases_lost_total",
        &["reason=\"RUN_STORE_FENCED\""],
    );
    tl.emit(
        "store",
        "refused",
        format!(
            "REFUSES W1's append (its attempt is no longer the run's): RUN_STORE_FENCED ({refused} refused, lease lost {fenced})"
        ),
        json!({"code": "RUN_STORE_FENCED", "refusedAppends": refused, "leasesLost": fenced}),
    );
    // Its heartbeats were held by the freeze: let them go, the engine refuses them too.
    gate1.thaw();
    let w1_about_task = {
        let id = id.clone();
        move |c: &CallRecord| {
            c.worker_id.as_deref() == Some("W1") && c.task_id.as_deref() == Some(id.as_str())
        }
    };

    // Worker 2 finishes.
    w2_finishes(&mut tl, &mut crew, stack, &*gate2, &id, SCENARIO, LIMIT).await?;
    let w2_finished = {
        let w2 = &crew.workers[1].worker;
        let finished = || {
            metric_sum(
                &w2.metrics_text(),
                "abada_agent_store_transaction_duration_seconds_count",
                &["operation=\"finish\""],
            )
        };
        // The run is finished in the store once the completion was accepted: a moment later.
        let deadline = tokio::time::Instant::now() + LIMIT;
        while finished() == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        finished()
    };
    tl.emit(
        "store",
        "finished",
        format!("W2 finishes the run ({w2_finished} finish): retention 0 deletes it"),
        json!({"finishes": w2_finished}),
    );
    let w1_calls: Vec<CallRecord> = stack.engine.calls()[mark..]
        .iter()
        .filter(|c| w1_about_task(c))
        .cloned()
        .collect();
    for c in &w1_calls {
        tl.emit(
            "engine",
            "w1_call",
            format!("W1 {}", call_text(c)),
            call_json(c),
        );
    }
    let workers = crew.stop().await;

    // The verdict.
    let view = stack.engine.task(&id);
    let counters = tools.counters().await;
    let all = stack.engine.calls();
    let mut checks = Vec::new();
    checks.push(Check::new(
        "W1 froze after its keyed write was applied",
        applied_at_freeze == 1 && !key.is_empty(),
        format!("key {key}, writes applied at the freeze: {applied_at_freeze}"),
    ));
    let acquisitions = view.as_ref().map_or(0, |v| v.counters.acquisitions);
    checks.push(Check::new(
        "W2 took the task over and claimed the run in the store",
        acquisitions == 2 && w2_claims == 1 && workers[1].stats.claimed == 1,
        format!("engine acquisitions {acquisitions}, W2 store claims {w2_claims}"),
    ));
    let dup = counters.duplicates_per_key.get(&key).copied().unwrap_or(0);
    checks.push(Check::new(
        "the write was applied once and its re-send deduplicated",
        counters.writes_applied == 1 && counters.duplicates == 1 && dup == 1,
        format!(
            "tool server: {} applied, {} duplicate (key {key}: {dup})",
            counters.writes_applied, counters.duplicates
        ),
    ));
    let w2_model_calls = workers[1].stats.model_calls;
    checks.push(Check::new(
        "W2 resumed from the store's journal without paying finished turns again",
        w2_model_calls == 1 && workers[0].stats.model_calls == 2,
        format!(
            "model calls: W1 {}, W2 {w2_model_calls} (the final answer only)",
            workers[0].stats.model_calls
        ),
    ));
    let w1_outcome = workers[0].ended.first().map(|e| e.2);
    checks.push(Check::new(
        "the store refused W1's append: RUN_STORE_FENCED",
        refused == 1 && fenced == 1 && w1_outcome == Some(TaskOutcome::LeaseLost),
        format!(
            "refused appends {refused}, leases lost RUN_STORE_FENCED {fenced}; W1 ended {}",
            w1_outcome.map_or("-", TaskOutcome::as_str)
        ),
    ));
    let w1_reports = all
        .iter()
        .filter(|c| {
            c.worker_id.as_deref() == Some("W1")
                && matches!(
                    c.operation,
                    Operation::Complete | Operation::Failure | Operation::BpmnError
                )
        })
        .count();
    checks.push(Check::new(
        "W1 abandoned the task silently",
        w1_reports == 0
            && w1_calls
                .iter()
                .all(|c| c.disposition == Disposition::Refused),
        format!(
            "W1 sent {w1_reports} complete/failure/bpmn-error; after waking: {}",
            if w1_calls.is_empty() {
                "no engine call".to_string()
            } else {
                w1_calls
                    .iter()
                    .map(|c| {
                        format!(
                            "{} {}",
                            operation_name(c.operation),
                            c.error_code.as_deref().unwrap_or("accepted")
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ),
    ));
    let completes = view.as_ref().map_or(0, |v| v.counters.completes);
    let by_w2 = all.iter().any(|c| {
        c.operation == Operation::Complete
            && c.disposition == Disposition::Executed
            && c.worker_id.as_deref() == Some("W2")
    });
    checks.push(Check::new(
        "completed exactly once, by W2",
        completes == 1
            && by_w2
            && view
                .as_ref()
                .is_some_and(|v| v.status == TaskStatus::Completed),
        format!("{completes} accepted complete; by W2: {by_w2}"),
    ));
    checks.push(Check::new(
        "W2 finished the run in the store",
        w2_finished == 1,
        format!("{w2_finished} finish"),
    ));
    let facts = json!({
        "task": id,
        "key": key,
        "store": store.redacted(),
        "writesApplied": counters.writes_applied,
        "duplicates": counters.duplicates,
        "acquisitions": acquisitions,
        "w2StoreClaims": w2_claims,
        "w1RefusedAppends": refused,
        "w1LeasesLostFenced": fenced,
        "w1Calls": w1_calls.iter().map(call_json).collect::<Vec<_>>(),
        "modelCalls": [workers[0].stats.model_calls, w2_model_calls],
        "completes": completes,
        "w2Finishes": w2_finished,
    });
    let wall_seconds = (tl.seconds() * 10.0).round() / 10.0;
    Ok(DemoReport {
        scenario: SCENARIO,
        events: tl.into_events(),
        workers: workers.into_iter().map(|w| w.stats).collect(),
        checks,
        facts,
        wall_seconds,
    })
}
