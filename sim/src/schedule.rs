//! A seed's schedule: how many workers with how many slots, which tasks arrive when (their
//! script: turns, hostile answers), which faults hit what when (outages, hangs, freezes, kills, the odds
//! of the per-call faults), all drawn from one seeded `StdRng`, so a seed is a whole scenario.

use std::collections::BTreeMap;
use std::time::Duration;

use abada_devkit::model::Quantization;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::world::approver::Manner;
use crate::world::faults::{FaultPlan, Window};
use crate::world::provider_limit::ProviderLimitPlan;

/// One task the schedule creates.
#[derive(Clone, Debug)]
pub struct TaskPlan {
    /// The simulation's own name of the task (`k3`), in its input.
    pub key: String,
    pub at: u64,
    /// The model's tool-calling turns (`u`nknown tool, `r`ead, `w`rite), see `ModelScript`.
    pub steps: String,
    pub hostile: bool,
    /// The final answers the model plays before its good one (`o` off-schema, `c` cut, `t` a
    /// tool call written as text), see `ModelScript::finals`.
    pub finals: String,
    /// Its agent carries an output schema (`process::schema_definition`): one-task shapes only.
    pub schema: bool,
    /// Its agent's model has a small context window (`process::window_definition`), and its
    /// script reads enough to outgrow it: one-task shapes without a schema only.
    pub small_window: bool,
    pub retries: i32,
    /// How the task comes to the workers.
    pub shape: Shape,
}

/// How a planned task comes to the workers (`world::process`).
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// One engine task, created directly; its agent asks no one.
    Task,
    /// A process instance whose agent node waits for a person's decision on every keyed write:
    /// the approver answers the requests in `decisions`' manners in turn (then honestly
    /// approves), a decision re-entering the node; `preset`: a decision is in the decision
    /// variable from the start; the reviewer sends the token back for one visit per script of
    /// `revisits` (task `{key}v2`, `{key}v3`, with their steps).
    Approval {
        decisions: Vec<Manner>,
        preset: bool,
        revisits: Vec<String>,
    },
    /// Two tasks of one instance at the agent node (two tokens): this one and a twin (task
    /// `{key}t`, with `twin_steps`) reaching the node `twin_after` ms later (its branch had
    /// other work first), both gated as above; nothing decides their requests. A twin that
    /// comes while the first holder has been silent for longer than the hold (a long model
    /// call, a freeze) takes the run, and fences the holder.
    /// `first_long`: the first task's first answer comes after a long generation (its
    /// script begins with `R`, see `ModelScript`).
    Parallel {
        twin_steps: String,
        twin_after: u64,
        first_long: bool,
    },
}

/// The process author deploys the next version of the gated processes at `at` (ms): its
/// agent performs no writes, and waits for a person (`keeps_approval`) or not.
#[derive(Clone, Debug)]
pub struct Redeploy {
    pub at: u64,
    pub keeps_approval: bool,
}

/// A task a worker of the previous release was running when it was replaced by this release
/// (`world::upgrade`): its journal, in the previous release's format, holds its first step, a
/// keyed write, started and applied.
#[derive(Clone, Debug)]
pub struct UpgradedPlan {
    /// The script's name (`p0`, `p1`).
    pub key: String,
    /// The model's tool-calling turns, the first a write (played by the previous release).
    pub steps: String,
    pub retries: i32,
}

/// What the operator changes in the agents file or the tool registry between one generation of
/// workers and the next: a restarted worker (a new process) reads the changed files at its
/// start, while the workers not restarted keep what they read. Runs journaled before must keep
/// their journaled definition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigChange {
    /// The topic's entry tells the model to perform no writes (the world's model then plays
    /// every write as a read).
    Instructions,
    /// The topic's entry gains `approval = "writes"`.
    ApprovalAdded,
    /// The gated node of `simProcess` is overridden by an agents-file entry (its activity id),
    /// first as the BPMN defines it, then without approval and performing no writes.
    ApprovalDropped,
    /// The topic's entry lowers `maxTurns` to 1 (and `maxToolCalls` to 1).
    Limits,
    /// The tool server is removed from the registry.
    ServerRemoved,
}

impl ConfigChange {
    pub const ALL: [ConfigChange; 5] = [
        ConfigChange::Instructions,
        ConfigChange::ApprovalAdded,
        ConfigChange::ApprovalDropped,
        ConfigChange::Limits,
        ConfigChange::ServerRemoved,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConfigChange::Instructions => "instructions",
            ConfigChange::ApprovalAdded => "approval-added",
            ConfigChange::ApprovalDropped => "approval-dropped",
            ConfigChange::Limits => "limits",
            ConfigChange::ServerRemoved => "server-removed",
        }
    }
}

/// A worker killed at `at`; a fresh one (new id) takes its place `restart_after` later.
#[derive(Clone, Debug)]
pub struct Kill {
    pub worker: usize,
    pub at: u64,
    pub(crate) restart_after: u64,
}

/// Everything a seed decides.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub seed: u64,
    pub workers: usize,
    pub slots: u32,
    pub lock_duration: Duration,
    pub poll_interval: Duration,
    pub tasks: Vec<TaskPlan>,
    pub kills: Vec<Kill>,
    pub faults: FaultPlan,
    /// The journals live in the run store (the engine speaks plain v1): a third of the seeds.
    pub store_journal: bool,
    /// Redeployments of the gated processes, in time order.
    pub redeploys: Vec<Redeploy>,
    /// Runs the previous release left mid-run (`world::upgrade`), resumed by this release's
    /// workers.
    pub upgraded: Vec<UpgradedPlan>,
    /// The agents-file or registry change every restarted worker reads (plain engines only:
    /// an agent/1 engine sends the definitions).
    pub config_change: Option<ConfigChange>,
}

/// The worker id of worker slot `n` in its `generation` (a restarted worker is a new process).
pub fn worker_id(n: usize, generation: usize) -> String {
    if generation == 0 {
        format!("w{n}")
    } else {
        format!("w{n}r{generation}")
    }
}

impl Schedule {
    /// The schedule of `seed`; `workers` overrides the drawn number of workers.
    pub fn generate(seed: u64, workers: Option<usize>) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed);
        let workers = workers.unwrap_or_else(|| rng.random_range(1..=3));
        let slots = rng.random_range(1..=3);
        let lock_ms: u64 = rng.random_range(3..=8) * 1000;
        let lock_duration = Duration::from_millis(lock_ms);
        let quiet_at = rng.random_range(20_000..=40_000);
        let count = rng.random_range(2..=8);
        // Process shapes come from a source of their own: the scenario drawn from `rng` (tasks,
        // faults) stays what it was before shapes existed, one-task shapes included.
        let mut shapes = StdRng::seed_from_u64(seed ^ 0x00a9_90a1_5a9e);
        let mut tasks: Vec<TaskPlan> = (0..count)
            .map(|i| TaskPlan {
                key: format!("k{i}"),
                at: if rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(0..quiet_at)
                },
                steps: (0..rng.random_range(0..=3))
                    .map(|_| ['u', 'r', 'w', 'w'][rng.random_range(0..4)])
                    .collect(),
                hostile: rng.random_bool(0.15),
                finals: String::new(),
                schema: false,
                small_window: false,
                retries: rng.random_range(3..=6),
                shape: Shape::Task,
            })
            .collect();
        for t in &mut tasks {
            t.shape = draw_shape(&mut shapes, lock_ms);
            if let Shape::Parallel {
                first_long: true, ..
            } = t.shape
            {
                // The first holder's first answer comes after a long generation: a twin
                // arriving meanwhile finds its run silent past the hold.
                t.steps.insert(0, 'R');
            }
            if !matches!(t.shape, Shape::Task) && !t.steps.to_ascii_lowercase().contains('w') {
                // A gated shape asks a person at least once.
                t.steps.push('w');
            }
        }
        let window = |rng: &mut StdRng, max_len: u64| {
            let start = rng.random_range(0..quiet_at.saturating_sub(max_len).max(1));
            let end = start + rng.random_range(200..=max_len);
            Window { start, end }
        };
        let mut engine_outages = Vec::new();
        for _ in 0..rng.random_range(0..=2) {
            engine_outages.push(window(&mut rng, lock_ms * 2));
        }
        let mut freezes = BTreeMap::new();
        let mut kills = Vec::new();
        for n in 0..workers {
            if rng.random_bool(0.4) {
                // Past the lease half of the time.
                let w = window(&mut rng, lock_ms * 2);
                freezes.insert(worker_id(n, 0), vec![w]);
            }
            if workers > 1 && rng.random_bool(0.25) {
                kills.push(Kill {
                    worker: n,
                    at: rng.random_range(500..quiet_at),
                    restart_after: rng.random_range(0..=lock_ms * 2),
                });
            }
        }
        let odds = |rng: &mut StdRng, max: f64| {
            if rng.random_bool(0.5) {
                rng.random_range(0.0..max)
            } else {
                0.0
            }
        };
        let mut faults = FaultPlan {
            quiet_at,
            engine_outages,
            engine_hangs: Vec::new(),
            engine_slow: odds(&mut rng, 0.3),
            engine_slow_max: Duration::from_millis(rng.random_range(10..=lock_ms)),
            engine_5xx: odds(&mut rng, 0.1),
            engine_409: odds(&mut rng, 0.05),
            engine_answer_lost: odds(&mut rng, 0.05),
            refused: odds(&mut rng, 0.05),
            engine_clock_jump: rng
                .random_bool(0.3)
                // Within the workers' safety margin (a tenth of the lock): past it, no worker can
                // know its lease is gone (docs/SIMULATION.md, "Outside the fault model").
                .then(|| {
                    (
                        rng.random_range(0..quiet_at),
                        rng.random_range(1..lock_ms / 10),
                    )
                }),
            model_429: odds(&mut rng, 0.2),
            model_5xx: odds(&mut rng, 0.2),
            model_slow: odds(&mut rng, 0.3),
            model_slow_max: Duration::from_millis(rng.random_range(10..=lock_ms * 2)),
            tool_5xx: odds(&mut rng, 0.1),
            tool_slow: odds(&mut rng, 0.3),
            tool_slow_max: Duration::from_millis(rng.random_range(10..=lock_ms)),
            tool_answer_lost: odds(&mut rng, 0.2),
            freezes,
            ..FaultPlan::default()
        };
        // Drawn last, so that every earlier draw (and a seed's scenario without a hang) stays
        // what it was before hangs were simulated.
        for _ in 0..rng.random_range(0..=1) {
            faults.engine_hangs.push(window(&mut rng, lock_ms * 2));
        }
        // The run store's part is drawn from a source of its own, so the seeds that keep their
        // journals in the engine play the very scenarios they played before it existed.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5707_e5ee_d000);
        let store_journal = rng.random_bool(1.0 / 3.0);
        if store_journal {
            for _ in 0..rng.random_range(0..=2) {
                faults.store_outages.push(window(&mut rng, lock_ms * 2));
            }
            faults.store_slow = odds(&mut rng, 0.3);
            faults.store_slow_max = Duration::from_millis(rng.random_range(10..=lock_ms));
            faults.store_answer_lost = odds(&mut rng, 0.1);
        }
        // What came after the run store, from a source of its own likewise.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x1a7e_a45e_7e4c);
        faults.engine_answer_late = odds(&mut rng, 0.15);
        faults.engine_late_max = Duration::from_millis(rng.random_range(500..=lock_ms));
        faults.model_stall = odds(&mut rng, 0.15);
        // Redeployments: at any time, or while an approval round trip's first request waits
        // for its person (its arrival, then a moment).
        let waits: Vec<u64> = tasks
            .iter()
            .filter(|t| matches!(t.shape, Shape::Approval { .. }))
            .map(|t| t.at)
            .collect();
        let mut redeploys: Vec<Redeploy> = (0..rng.random_range(0..=2))
            .map(|_| {
                let at = if !waits.is_empty() && rng.random_bool(0.5) {
                    waits[rng.random_range(0..waits.len())] + rng.random_range(50..=1_500)
                } else {
                    rng.random_range(0..quiet_at)
                };
                Redeploy {
                    at: at.min(quiet_at),
                    keeps_approval: rng.random_bool(0.5),
                }
            })
            .collect();
        redeploys.sort_by_key(|r| r.at);
        // Structured output, from a source of its own likewise: half the one-task shapes run
        // the agent with an output schema, and half of the one-task shapes' models answer off
        // their good final answer first, up to three times (past the repair turns, sometimes).
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0075_7c7e_d000);
        for t in tasks.iter_mut().filter(|t| t.shape == Shape::Task) {
            t.schema = rng.random_bool(0.5);
            if rng.random_bool(0.5) {
                // Off-schema only where there is a schema: without one, it is a good answer.
                let kinds: &[char] = if t.schema {
                    &['o', 'c', 't']
                } else {
                    &['c', 't']
                };
                t.finals = (0..rng.random_range(1..=3))
                    .map(|_| kinds[rng.random_range(0..kinds.len())])
                    .collect();
            }
        }
        // The context window, from a source of its own likewise: a quarter of the one-task
        // shapes without a schema or off answers run on the small window, with four to six
        // turns that read or write.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0c07_7e47_3100);
        for t in tasks.iter_mut().filter(|t| t.shape == Shape::Task) {
            if !t.schema && t.finals.is_empty() && rng.random_bool(0.25) {
                t.small_window = true;
                t.steps = (0..rng.random_range(4..=6))
                    .map(|_| ['r', 'r', 'w'][rng.random_range(0..3)])
                    .collect();
            }
        }
        // The fleet's conditions, from a source of their own too (every draw above stays what
        // it was): half of the seeds a provider limit every worker shares (its requests a
        // minute, enforced a second's worth per second window or bucket, stated or not, the
        // replicas pacing as one queue or each alone), half of those with several workers an
        // engine whose fetches contend (a fetch meanwhile answers empty).
        let mut rng = StdRng::seed_from_u64(seed ^ 0x00f1_ee70_11a1);
        if rng.random_bool(0.5) {
            faults.provider_limit = Some(ProviderLimitPlan {
                requests_per_minute: [60, 120, 240][rng.random_range(0..3)],
                quantization: if rng.random_bool(0.75) {
                    Quantization::SecondWindow
                } else {
                    Quantization::SecondBucket
                },
                stated: rng.random_bool(0.75),
                shared_pacing: workers > 1 && rng.random_bool(0.5),
                hostile: false,
            });
        }
        // Hostile rate-limit headers, from a source of their own (every draw above stays what
        // it was): a third of the limited seeds answer through a gateway that states them.
        if let Some(limit) = faults.provider_limit.as_mut() {
            limit.hostile = StdRng::seed_from_u64(seed ^ 0x4057_11e0_0001).random_bool(0.35);
        }
        if workers > 1 && rng.random_bool(0.5) {
            faults.fetch_contention = Some(Duration::from_millis(rng.random_range(15..=100)));
        }
        // Agents-file and registry changes across restarts, from a source of their own likewise:
        // half the seeds on a plain engine change one thing for the restarted workers, and one
        // whose workers are never killed gets a kill (and its restart).
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0a9e_47f1_1e00);
        let mut config_change = None;
        if store_journal && rng.random_bool(0.5) {
            // Approval dropped weighs double: it is the change a pinned definition matters most for.
            let kinds = [
                ConfigChange::Instructions,
                ConfigChange::ApprovalAdded,
                ConfigChange::ApprovalDropped,
                ConfigChange::ApprovalDropped,
                ConfigChange::Limits,
                ConfigChange::ServerRemoved,
            ];
            config_change = Some(kinds[rng.random_range(0..kinds.len())]);
            if kills.is_empty() {
                kills.push(Kill {
                    worker: rng.random_range(0..workers),
                    at: rng.random_range(500..quiet_at),
                    restart_after: rng.random_range(0..=lock_ms),
                });
            }
        }
        // A rolling upgrade, from a source of its own likewise: two seeds in five find one or two
        // runs the previous release left mid-run.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0019_9ade_0001);
        let mut upgraded = Vec::new();
        if rng.random_bool(0.4) {
            for i in 0..rng.random_range(1..=2) {
                let rest: String = (0..rng.random_range(0..=2))
                    .map(|_| ['r', 'w'][rng.random_range(0..2)])
                    .collect();
                upgraded.push(UpgradedPlan {
                    key: format!("p{i}"),
                    steps: format!("w{rest}"),
                    retries: rng.random_range(3..=6),
                });
            }
        }
        Schedule {
            seed,
            workers,
            slots,
            lock_duration,
            poll_interval: Duration::from_millis(500),
            tasks,
            kills,
            faults,
            store_journal,
            redeploys,
            config_change,
            upgraded,
        }
    }
}

fn draw_steps(rng: &mut StdRng, max: usize) -> String {
    (0..rng.random_range(1..=max))
        .map(|_| ['u', 'r', 'w', 'w'][rng.random_range(0..4)])
        .collect()
}

/// A task's shape: mostly one task, else an approval round trip (its people's manners, a preset
/// decision, re-entries) or two tokens at once.
fn draw_shape(rng: &mut StdRng, lock_ms: u64) -> Shape {
    let roll: f64 = rng.random();
    if roll < 0.55 {
        return Shape::Task;
    }
    if roll < 0.87 {
        // Honest approval weighs most; every hostile manner has its share.
        let weights = [5, 2, 1, 1, 1, 1, 1];
        let total: u32 = weights.iter().sum();
        let rounds = rng.random_range(0..=3);
        let decisions = (0..rounds)
            .map(|_| {
                let mut pick = rng.random_range(0..total);
                let mut chosen = Manner::Approve;
                for (m, w) in Manner::ALL.into_iter().zip(weights) {
                    if pick < w {
                        chosen = m;
                        break;
                    }
                    pick -= w;
                }
                chosen
            })
            .collect();
        let preset = rng.random_bool(0.2);
        let mut revisits = Vec::new();
        while revisits.len() < 2 && rng.random_bool(0.35) {
            revisits.push(draw_steps(rng, 2));
        }
        return Shape::Approval {
            decisions,
            preset,
            revisits,
        };
    }
    let twin_steps = draw_steps(rng, 2);
    let twin_after = if rng.random_bool(1.0 / 3.0) {
        0
    } else {
        rng.random_range(lock_ms..=lock_ms * 2)
    };
    Shape::Parallel {
        twin_steps,
        twin_after,
        first_long: rng.random_bool(0.5),
    }
}
