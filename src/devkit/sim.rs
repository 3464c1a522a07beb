//! The deterministic simulator (issue 24): N production workers (runner, heartbeat actor, agent
//! runtime) against the in-memory [`world`](super::world) on tokio's current-thread runtime with
//! a paused clock. A seed is a whole scenario ([`schedule`]): tasks, workers, outages, freezes,
//! kills and the odds of per-call faults. After the run the [`invariants`] are checked on the
//! trace and the engine's final state; the trace's hash makes a seed's run comparable.
//!
//! With the `sim-bugs` feature, [`SimOptions::bug`] reintroduces one known bug in the worker
//! for the run (see `crate::sim_bugs`), to show the invariants catch it.

pub mod invariants;
pub mod schedule;
pub mod worker;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, json};

use crate::devkit::engine::{TaskSpec, TaskStatus, TaskView};
use crate::devkit::world::{ModelScript, Trace, World, WorldOptions};
pub use invariants::Violation;
use schedule::{Schedule, worker_id};
use worker::SimWorker;

/// How long after the faults stop every task must have ended.
pub const END_BOUND: Duration = Duration::from_secs(90);

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct SimOptions {
    pub seed: u64,
    /// Overrides the number of workers the seed draws.
    pub workers: Option<usize>,
    /// Keep the rendered trace in the report.
    pub keep_trace: bool,
    /// The bug to reintroduce for this run (`sim-bugs` builds only).
    #[cfg(feature = "sim-bugs")]
    pub bug: Option<crate::sim_bugs::Bug>,
}

/// What one seed's run gave.
#[derive(Debug)]
pub struct SeedReport {
    pub seed: u64,
    pub hash: String,
    pub violations: Vec<Violation>,
    /// The trace as text, when asked for.
    pub trace: Option<String>,
    /// Faults injected, by kind.
    pub injected: BTreeMap<&'static str, u64>,
    pub events: usize,
    /// The world's time when the run ended.
    pub sim_time: Duration,
    /// The journals lived in the run store (the engine spoke plain v1).
    pub store_journal: bool,
}

impl SeedReport {
    /// The one-line command that replays this seed with its full trace.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release --example simulate -- --seed {} --trace",
            self.seed
        )
    }
}

/// The agent definition every simulated task carries (agent/1 `agent`); a plain v1 engine
/// sends none, and the workers find it in their agents file under the tasks' topic.
pub fn agent_definition() -> serde_json::Value {
    json!({
        "name": "sim-agent",
        "model": format!("{}/m1", worker::PROVIDER),
        "instructions": "Play the script your input names.",
        "input": "${simInput}",
        "toolServers": [{"name": crate::devkit::world::tools::SERVER, "url": crate::devkit::world::tools::URL}],
        "maxTurns": 8,
        "resultVariable": "simResult"
    })
}

/// Runs one seed on `runtime`, which must be a fresh current-thread runtime with a paused
/// clock (`Builder::new_current_thread().enable_time().start_paused(true)`: tokio's
/// `test-util`, which the examples and tests have and the library does not).
pub fn run_seed(runtime: tokio::runtime::Runtime, options: &SimOptions) -> SeedReport {
    #[cfg(feature = "sim-bugs")]
    crate::sim_bugs::select(options.bug);
    let report = runtime.block_on(simulate(options));
    #[cfg(feature = "sim-bugs")]
    crate::sim_bugs::select(None);
    // Whatever is left (a killed worker's calls that never return) is dropped here.
    runtime.shutdown_background();
    report
}

async fn simulate(options: &SimOptions) -> SeedReport {
    let schedule = Schedule::generate(options.seed, options.workers);
    let world = World::new(WorldOptions {
        seed: options.seed,
        lock_duration: schedule.lock_duration,
        faults: schedule.faults.clone(),
        store_journal: schedule.store_journal,
    });
    // Tasks arrive on their schedule.
    let creator = {
        let world = world.clone();
        let tasks = schedule.tasks.clone();
        tokio::spawn(async move {
            let mut keys = BTreeMap::new();
            let start = tokio::time::Instant::now();
            let mut tasks = tasks;
            tasks.sort_by_key(|t| t.at);
            for t in tasks {
                tokio::time::sleep_until(start + Duration::from_millis(t.at)).await;
                let script = ModelScript {
                    task: t.key.clone(),
                    steps: t.steps.clone(),
                    hostile: t.hostile,
                };
                let mut variables = Map::new();
                variables.insert("simInput".into(), script.input().into());
                let id = world.core().create_task(TaskSpec {
                    variables,
                    agent: Some(agent_definition()),
                    retries: Some(t.retries),
                    ..TaskSpec::default()
                });
                keys.insert(t.key.clone(), id);
            }
            keys
        })
    };
    let mut workers: Vec<Option<SimWorker>> = (0..schedule.workers)
        .map(|n| {
            Some(SimWorker::start(
                &world,
                &worker_id(n, 0),
                schedule.slots,
                schedule.lock_duration,
                schedule.poll_interval,
            ))
        })
        .collect();
    let mut generations = vec![0usize; schedule.workers];
    // Kills and restarts, in time order.
    let mut actions: Vec<(u64, usize, bool)> = Vec::new();
    for k in &schedule.kills {
        actions.push((k.at, k.worker, false));
        actions.push((k.at + k.restart_after, k.worker, true));
    }
    actions.sort();
    let start = tokio::time::Instant::now();
    for (at, n, restart) in actions {
        tokio::time::sleep_until(start + Duration::from_millis(at)).await;
        if restart {
            if workers[n].is_none() {
                generations[n] += 1;
                workers[n] = Some(SimWorker::start(
                    &world,
                    &worker_id(n, generations[n]),
                    schedule.slots,
                    schedule.lock_duration,
                    schedule.poll_interval,
                ));
            }
        } else if let Some(w) = workers[n].take() {
            w.kill(&world);
        }
    }
    let keys = creator.await.unwrap_or_default();
    // Until every task ended, or the bound after the faults stopped.
    let deadline = start + Duration::from_millis(schedule.faults.quiet_at) + END_BOUND;
    loop {
        let all_ended = world.core().tasks().iter().all(ended);
        if all_ended || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let sim_time = start.elapsed();
    for w in workers.iter().flatten() {
        w.stop();
    }
    // Let the staged shutdowns run (their releases are part of the trace).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let views = world.core().tasks();
    let trace = std::mem::take(&mut *world.trace());
    let violations = invariants::check(&invariants::Facts {
        trace: &trace,
        views: &views,
        keys: &keys,
        schedule: &schedule,
        safety_margin: world.safety_margin,
    });
    let injected = world.faults().injected.clone();
    for w in workers.into_iter().flatten() {
        w.kill(&world);
    }
    let mut report = report(options, trace, violations, injected, sim_time);
    report.store_journal = schedule.store_journal;
    report
}

fn report(
    options: &SimOptions,
    trace: Trace,
    violations: Vec<Violation>,
    injected: BTreeMap<&'static str, u64>,
    sim_time: Duration,
) -> SeedReport {
    SeedReport {
        seed: options.seed,
        hash: trace.hash(),
        violations,
        trace: options.keep_trace.then(|| trace.render()),
        injected,
        events: trace.events.len(),
        sim_time,
        store_journal: false,
    }
}

/// Whether the engine sees the task as done for good.
pub fn ended(view: &TaskView) -> bool {
    matches!(
        view.status,
        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
    )
}
