//! The load harness end to end on a tiny load (debug build, nothing timed): the real worker
//! binary as a child drains a small backlog, goes idle, picks tasks up, and the floor client
//! makes the same requests per task as the worker.

use std::path::PathBuf;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{Operation, ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::loadtest::{
    self, BENCH_MODEL, ChildProgram, FloorOptions, LoadOptions, Scenario,
};
use abada_agent_worker::devkit::stack::Stack;

use crate::support::process::BIN;

fn tiny(scenario: Scenario) -> LoadOptions {
    LoadOptions {
        scenario,
        slots: 3,
        tasks: 6,
        model_latency: Duration::ZERO,
        poll_interval: Duration::from_millis(50),
        // No heartbeat falls due in a run this short (it would count as one more request per
        // task), and none could be late enough to lose a lease.
        lock_duration: Duration::from_secs(30),
        ..LoadOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_run_of_the_real_binary_yields_every_figure() {
    let worker = ChildProgram::Worker(PathBuf::from(BIN));
    let f = loadtest::run(&worker, &tiny(Scenario::Backlog))
        .await
        .expect("the harness runs");
    for name in [
        "start_to_first_fetch",
        "tasks_per_s",
        "cpu_per_task",
        "refill_p99",
        "rss_peak",
    ] {
        let v = f
            .get(name)
            .unwrap_or_else(|| panic!("figure {name} missing"));
        assert!(v.is_finite() && v >= 0.0, "{name} = {v}");
    }
    // Journal read, two appends, complete: the one-turn protocol.
    assert_eq!(f.get("requests_per_task"), Some(4.0));
    assert_eq!(f.get("lease_expiries"), Some(0.0));
    assert_eq!(f.get("child_warn_error_lines"), Some(0.0));
}

/// The partial-answers scenario, tiny: two worker processes share one engine that answers at most 2
/// tasks per fetch; every task is done once, and each worker's slot use is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_on_a_partially_answering_engine_report_their_slot_use() {
    let worker = ChildProgram::Worker(PathBuf::from(BIN));
    let opts = LoadOptions {
        tasks: 12,
        fetch_answer_cap: std::num::NonZeroU32::new(2),
        workers: 2,
        ..tiny(Scenario::Backlog)
    };
    let f = loadtest::run(&worker, &opts)
        .await
        .expect("the harness runs");
    assert_eq!(
        f.get("worker_1_tasks").unwrap() + f.get("worker_2_tasks").unwrap(),
        12.0
    );
    for name in [
        "slot_utilisation",
        "worker_1_slot_utilisation",
        "worker_2_slot_utilisation",
        "slot_use_max_deviation_from_mean",
    ] {
        let v = f
            .get(name)
            .unwrap_or_else(|| panic!("figure {name} missing"));
        assert!(v.is_finite() && v >= 0.0, "{name} = {v}");
    }
    assert_eq!(f.get("lease_expiries"), Some(0.0));
    assert_eq!(f.get("child_warn_error_lines"), Some(0.0));
    // More workers than the harness starts, or a floor client sharing: refused, not run.
    for (which, workers) in [(worker.clone(), 5), (worker.clone(), 0)] {
        let bad = LoadOptions {
            workers,
            ..opts.clone()
        };
        assert!(loadtest::run(&which, &bad).await.is_err(), "{workers}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_idle_and_pickup_scenarios_run() {
    let worker = ChildProgram::Worker(PathBuf::from(BIN));
    let tools = LoadOptions {
        tool_calls: 2,
        ..tiny(Scenario::Backlog)
    };
    let f = loadtest::run(&worker, &tools).await.expect("tool-call run");
    assert_eq!(f.get("lease_expiries"), Some(0.0));
    let idle = loadtest::run(
        &worker,
        &tiny(Scenario::Idle {
            duration: Duration::from_millis(300),
        }),
    )
    .await
    .expect("idle run");
    assert!(idle.get("rss_idle").is_some_and(|v| v > 0.0));
    let pickup = LoadOptions {
        tasks: 2,
        ..tiny(Scenario::Pickup)
    };
    let f = loadtest::run(&worker, &pickup).await.expect("pickup run");
    assert!(f.get("pickup_p50").is_some_and(f64::is_finite));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_client_makes_the_workers_requests_per_task() {
    let opts = tiny(Scenario::Backlog);
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    stack
        .model
        .set_script(BENCH_MODEL, loadtest::bench_script(&opts));
    let agent = loadtest::bench_agent(&stack, &opts);
    let ids = stack.engine.create_tasks((0..4).map(|i| {
        let mut variables = serde_json::Map::new();
        variables.insert("orderId".into(), format!("o-{i}").into());
        abada_agent_worker::devkit::engine::TaskSpec {
            variables,
            agent: Some(agent.clone()),
            ..Default::default()
        }
    }));
    let floor = tokio::spawn(loadtest::run_floor_client(FloorOptions {
        engine_url: stack.engine.base_url(),
        model_url: stack.model.base_url_openai(),
        slots: 2,
        poll_interval: Duration::from_millis(50),
        lock_duration: Duration::from_secs(10),
    }));
    tokio::time::timeout(
        Duration::from_secs(30),
        stack.engine.wait_for(|e| {
            ids.iter()
                .all(|id| {
                    e.task(id)
                        .is_some_and(|t| t.status == TaskStatus::Completed)
                })
                .then_some(())
        }),
    )
    .await
    .expect("the floor client completes every task");
    floor.abort();
    for id in &ids {
        let task = stack.engine.task(id).unwrap();
        assert_eq!(task.journal.len(), 2, "{id}: input and model steps");
        let ops: Vec<Operation> = stack
            .engine
            .calls()
            .iter()
            .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
            .map(|c| c.operation)
            .collect();
        assert_eq!(
            ops,
            [
                Operation::JournalRead,
                Operation::JournalAppend,
                Operation::JournalAppend,
                Operation::Complete
            ]
        );
    }
    assert_eq!(stack.model.calls(BENCH_MODEL), 4);
    stack.shutdown().await;
}
