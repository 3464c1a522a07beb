//! The deterministic simulator (the `abada-sim` crate, docs/SIMULATION.md): N production
//! workers (built by the worker's composition root, as the daemon's are: [`worker`]) against the
//! in-memory [`world`] on tokio's current-thread runtime with a paused clock. A seed is a whole
//! scenario ([`schedule`]): tasks, workers, outages, freezes, kills and the odds of per-call
//! faults. After the run the [`invariants`] are checked on the trace and the engine's final
//! state; the trace's hash makes a seed's run comparable.
//!
//! With the `sim-bugs` feature, `SimOptions::bug` reintroduces one known bug in the worker
//! for the run (see the worker's `sim_bugs`), to show the invariants catch it, each by the one
//! `bugs::caught_by` names.
//!
//! A crate of its own, beside the worker's: neither the production build nor the demo compiles
//! it. What it needs of the worker is the worker's public API (the composition root and its
//! seams, the engine, provider, tool and store traits, the agent's vocabulary).
#![forbid(unsafe_code)]
// The agent's future nests deeply (see the worker's lib.rs): the simulated workers spawn it.
#![recursion_limit = "256"]

#[cfg(feature = "sim-bugs")]
pub mod bugs;
pub mod invariants;
pub mod observed;
pub mod schedule;
pub mod secrets;
pub mod worker;
pub mod world;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::world::approver::{self, People, PeoplePlan};
use crate::world::{Event, ModelScript, Trace, World, WorldOptions, process};
use abada_devkit::engine::{TaskSpec, TaskStatus, TaskView};
pub use invariants::Violation;
use schedule::{Schedule, Shape, TaskPlan, worker_id};
use worker::SimWorker;

/// How long after the faults stop every task must have ended.
pub(crate) const END_BOUND: Duration = Duration::from_secs(90);

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
    pub bug: Option<abada_agent_worker::sim_bugs::Bug>,
}

/// What one seed's run gave.
#[derive(Debug)]
pub struct SeedReport {
    pub seed: u64,
    pub hash: String,
    pub violations: Vec<Violation>,
    /// The trace as text, when asked for.
    pub trace: Option<String>,
    /// Faults injected, by kind (`world::faults::KINDS`).
    pub injected: BTreeMap<&'static str, u64>,
    /// Per invariant, how many events (or tasks) it judged.
    pub judged: BTreeMap<&'static str, usize>,
    pub events: usize,
    /// The world's time when the run ended.
    pub sim_time: Duration,
    /// The journals lived in the run store (the engine spoke plain v1).
    pub store_journal: bool,
    /// The people's decisions, by manner (`approve`, `forged-request`, ...).
    pub decisions: BTreeMap<&'static str, u64>,
    /// Secrets the world handed out, and lines the workers emitted (log lines, span fields,
    /// metrics) that were searched for them.
    pub secrets: usize,
    pub emitted_lines: usize,
}

impl SeedReport {
    /// The one-line command that replays this seed with its full trace.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run -p abada-sim --release --example simulate -- --seed {} --trace",
            self.seed
        )
    }
}

/// Runs one seed on `runtime`, which must be a fresh current-thread runtime with a paused
/// clock (`Builder::new_current_thread().enable_time().start_paused(true)`: tokio's
/// `test-util`, which the examples and tests have and the library does not).
pub fn run_seed(runtime: tokio::runtime::Runtime, options: &SimOptions) -> SeedReport {
    #[cfg(feature = "sim-bugs")]
    abada_agent_worker::sim_bugs::select(options.bug);
    // A second dispatcher, alive for the seed, before the capture's: with one registered alone,
    // tracing decides whether a callsite first hit on another thread (another test of the same
    // binary) is of interest from that thread's subscriber only and caches "never", and the
    // capture misses that callsite's events on this thread for the rest of the seed. With two,
    // every registered dispatcher is asked.
    let _second = tracing::Dispatch::new(tracing_subscriber::registry());
    // Everything the workers log or put in a span, written down for the secret check.
    let capture = secrets::Capture::default();
    let subscriber = {
        use tracing_subscriber::layer::SubscriberExt;
        tracing_subscriber::registry().with(capture.clone())
    };
    let report = tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(simulate(options, &capture))
    });
    #[cfg(feature = "sim-bugs")]
    abada_agent_worker::sim_bugs::select(None);
    // Whatever is left (a killed worker's calls that never return) is dropped here.
    runtime.shutdown_background();
    report
}

async fn simulate(options: &SimOptions, capture: &secrets::Capture) -> SeedReport {
    let schedule = Schedule::generate(options.seed, options.workers);
    let world = World::new(WorldOptions {
        seed: options.seed,
        lock_duration: schedule.lock_duration,
        faults: schedule.faults.clone(),
        store_journal: schedule.store_journal,
    });
    process::deploy(&world);
    if schedule.faults.engine_clock_jump.is_some() {
        world.faults().count("engine clock step");
    }
    if schedule.config_change.is_some() {
        world.faults().count("agents file or registry changed");
    }
    // The runs the previous release left mid-run, there before this release's workers start.
    for u in &schedule.upgraded {
        let script = ModelScript {
            task: u.key.clone(),
            steps: u.steps.clone(),
            hostile: false,
            finals: String::new(),
        };
        if crate::world::upgrade::seed(&world, &script, u.retries)
            .await
            .is_some()
        {
            world.faults().count("run left by the previous release");
        }
    }
    let people = Arc::new(Mutex::new(People::default()));
    // Tasks arrive on their schedule, each in its shape.
    let creator = {
        let world = world.clone();
        let people = people.clone();
        let tasks = schedule.tasks.clone();
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            // Each planned task, and the twin token of each parallel shape, at its time.
            let mut arrivals: Vec<(u64, &TaskPlan, bool)> = Vec::new();
            for t in &tasks {
                arrivals.push((t.at, t, false));
                if let Shape::Parallel { twin_after, .. } = &t.shape {
                    arrivals.push((t.at + twin_after, t, true));
                }
            }
            arrivals.sort_by_key(|(at, _, _)| *at);
            // The instance of each parallel shape's first token, for its twin.
            let mut instances = BTreeMap::new();
            for (at, t, twin) in arrivals {
                tokio::time::sleep_until(start + Duration::from_millis(at)).await;
                arrive(&world, &people, t, twin, &mut instances);
            }
        })
    };
    // The process author redeploys the gated processes on the schedule's times.
    let redeploying = {
        let world = world.clone();
        let redeploys = schedule.redeploys.clone();
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            for (n, r) in redeploys.iter().enumerate() {
                tokio::time::sleep_until(start + Duration::from_millis(r.at)).await;
                let version = n as u32 + 2;
                process::redeploy(&world, version, r.keeps_approval);
                world.faults().count("redeploy");
                world.record(Event::Redeployed {
                    version,
                    approval: r.keeps_approval,
                });
            }
        })
    };
    // The people answer the user tasks, at a pace of the seed's.
    let pace = Duration::from_millis(200 + (options.seed % 7) * 200);
    let answering = tokio::spawn(approver::run(world.clone(), people.clone(), pace));
    let mut workers: Vec<Option<SimWorker>> = (0..schedule.workers)
        .map(|n| {
            Some(SimWorker::start(
                &world,
                options.seed,
                (schedule.config_change, 0),
                &worker_id(n, 0),
                schedule.slots,
                schedule.lock_duration,
                schedule.poll_interval,
            ))
        })
        .collect();
    let mut metrics: Vec<_> = workers
        .iter()
        .flatten()
        .map(|w| (w.id.clone(), w.metrics.clone()))
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
                let w = SimWorker::start(
                    &world,
                    options.seed,
                    (schedule.config_change, generations[n]),
                    &worker_id(n, generations[n]),
                    schedule.slots,
                    schedule.lock_duration,
                    schedule.poll_interval,
                );
                metrics.push((w.id.clone(), w.metrics.clone()));
                workers[n] = Some(w);
            }
        } else if let Some(w) = workers[n].take() {
            world.faults().count("worker kill");
            w.kill(&world);
        }
    }
    let _ = creator.await;
    let _ = redeploying.await;
    // Until every task ended and no person has anything left to do, or the bound after the
    // faults stopped.
    let deadline = start + Duration::from_millis(schedule.faults.quiet_at) + END_BOUND;
    loop {
        let all_ended = world.core().tasks().iter().all(ended)
            && world
                .core()
                .open_user_tasks(
                    "sim-person",
                    &[process::APPROVERS.into(), process::REVIEWERS.into()],
                )
                .is_empty();
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
    answering.abort();
    let views = world.core().tasks();
    let keys = scripts_of(&views);
    // What the workers said: their log lines and span fields, then their metrics.
    for (instant, line) in capture.take() {
        let at = instant.saturating_duration_since(start).as_millis() as u64;
        world.trace().push(at, Event::Log { line });
    }
    let now = world.elapsed_ms();
    for (id, m) in &metrics {
        // In a fixed order: the encoder lists a metric's label sets in the order of a hash map
        // seeded anew by each process.
        let text = m.encode();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort_unstable();
        for line in lines {
            world.trace().push(
                now,
                Event::Log {
                    line: format!("metrics of {id}: {line}"),
                },
            );
        }
    }
    let secrets = world.secrets();
    let mut trace = std::mem::take(&mut *world.trace());
    trace.events.sort_by_key(|(at, _)| *at);
    let violations = invariants::check(&invariants::Facts {
        trace: &trace,
        views: &views,
        keys: &keys,
        schedule: &schedule,
        safety_margin: world.safety_margin,
        secrets: &secrets,
        scenario: None,
    });
    let judged = invariants::judged(&invariants::Facts {
        trace: &trace,
        views: &views,
        keys: &keys,
        schedule: &schedule,
        safety_margin: world.safety_margin,
        secrets: &secrets,
        scenario: None,
    });
    let injected = world.faults().injected.clone();
    for w in workers.into_iter().flatten() {
        w.kill(&world);
    }
    let mut decisions = BTreeMap::new();
    let mut emitted_lines = 0;
    for (_, e) in &trace.events {
        match e {
            Event::Decision { manner, .. } => *decisions.entry(*manner).or_default() += 1,
            Event::Log { .. } => emitted_lines += 1,
            _ => {}
        }
    }
    SeedReport {
        judged,
        store_journal: schedule.store_journal,
        decisions,
        secrets: secrets.len(),
        emitted_lines,
        ..report(options, trace, violations, injected, sim_time)
    }
}

/// A planned task's arrival in its shape; `twin`: the second token of a parallel shape. On a
/// plain engine every task belongs to a process instance (the real engine has no other), and
/// its definition comes from the BPMN or the agents file; on an agent/1 engine it comes with
/// the task.
fn arrive(
    world: &World,
    people: &Mutex<People>,
    t: &TaskPlan,
    twin: bool,
    instances: &mut BTreeMap<String, String>,
) {
    let script = |task: String, steps: &str| ModelScript {
        task,
        steps: steps.to_string(),
        hostile: t.hostile,
        finals: String::new(),
    };
    let first = ModelScript {
        finals: t.finals.clone(),
        ..script(t.key.clone(), &t.steps)
    };
    match &t.shape {
        Shape::Task if world.store_journal && t.small_window => {
            let _ = process::start_window_task(world, &first);
        }
        Shape::Task if world.store_journal && t.schema => {
            let _ = process::start_schema_task(world, &first);
        }
        Shape::Task if world.store_journal => {
            let _ = process::start_task(world, &first);
        }
        Shape::Task => {
            world.core().create_task(TaskSpec {
                variables: process::input_variables(&first),
                agent: Some(if t.schema {
                    process::schema_definition()
                } else if t.small_window {
                    process::window_definition()
                } else {
                    process::agent_definition(false)
                }),
                retries: Some(t.retries),
                ..TaskSpec::default()
            });
        }
        Shape::Approval {
            decisions,
            preset,
            revisits,
        } => {
            let Ok(instance) = process::start(world, &first, *preset) else {
                return;
            };
            let revisits = revisits
                .iter()
                .enumerate()
                .map(|(i, steps)| script(format!("{}v{}", t.key, i + 2), steps))
                .collect();
            people.lock().unwrap_or_else(|e| e.into_inner()).add(
                instance,
                PeoplePlan {
                    decisions: decisions.clone(),
                    revisits,
                },
            );
        }
        Shape::Parallel { twin_steps, .. } if world.store_journal => {
            if twin {
                if let Some(instance) = instances.get(&t.key) {
                    let second = script(format!("{}t", t.key), twin_steps);
                    process::start_parallel(world, &first, Some(&second), Some(instance));
                }
            } else if let Ok(instance) = process::start_parallel_instance(world, &first) {
                instances.insert(t.key.clone(), instance);
            }
        }
        Shape::Parallel { twin_steps, .. } => {
            let second = twin.then(|| script(format!("{}t", t.key), twin_steps));
            process::start_parallel(world, &first, second.as_ref(), None);
        }
    }
}

/// The engine tasks that ran each script (by the script's task name, from their input): one,
/// or the tasks of a visit's approval round trip.
fn scripts_of(views: &[TaskView]) -> BTreeMap<String, Vec<String>> {
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for v in views {
        let script = v
            .variables
            .get(process::INPUT_VARIABLE)
            .and_then(serde_json::Value::as_str)
            .and_then(ModelScript::parse);
        if let Some(s) = script {
            keys.entry(s.task).or_default().push(v.id.clone());
        }
    }
    keys
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
        judged: BTreeMap::new(),
        events: trace.events.len(),
        sim_time,
        store_journal: false,
        decisions: BTreeMap::new(),
        secrets: 0,
        emitted_lines: 0,
    }
}

/// Whether the engine sees the task as done for good.
pub fn ended(view: &TaskView) -> bool {
    matches!(
        view.status,
        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
    )
}
