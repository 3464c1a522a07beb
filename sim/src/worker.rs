//! One simulated worker: a production worker, built by the composition root
//! ([`Worker::build`]) from a [`Config`] parsed the production way from an environment map, so
//! the simulator runs the wiring production runs, every setting read from one place. The seams
//! replace what the world stands in for: the engine, the model provider, the tool connector, the
//! run store; and the randomness, a generator seeded from the seed and the worker's id, so every
//! backoff keeps its jitter and still replays. Only the timing no variable sets is shortened
//! (the agent's retries, the poll loop's backoffs), through the seams too. Its runner events are
//! copied into the world's trace.
//!
//! A worker on a plain v1 engine (the journals in the run store) reads its agent from an agents
//! file and the tool server from a tools file, as an operator writes them: [`SimFiles`] writes
//! both once per process, under a name of their content.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::schedule::ConfigChange;
use crate::world::{Event, World, WorldEngine, WorldModel, WorldStore, WorldTools};
use abada_agent_worker::agent::AgentSettings;
use abada_agent_worker::app::{Seams, Tuning, Worker};
use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::config::{self, Config};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::provider::ProviderRegistry;
use abada_agent_worker::provider::fallback::RetryPolicy;
use abada_agent_worker::random::Random;
use abada_agent_worker::runner::RunnerEvent;
use abada_devkit::engine::AGENT_TOPIC;

pub(crate) use crate::world::model::PROVIDER;
use crate::world::model::{SMALL_WINDOW, SMALL_WINDOW_PROVIDER};

/// The engine's URL in a simulated worker's configuration: required by the configuration, never
/// dialled (the world's engine replaces the client).
const ENGINE_URL: &str = "http://127.0.0.1:9/api";

/// The staged shutdown's grace period of every simulated worker.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The agents file and the tools file of a worker whose engine sends no definition: the
/// simulation's agent under the tasks' topic, and the world's tool server without
/// authentication; changed as the seed's [`ConfigChange`] says for a restarted worker.
struct SimFiles {
    agents: PathBuf,
    tools: PathBuf,
}

impl SimFiles {
    /// The files of a worker of `generation` (0: started with the seed; later: restarted),
    /// written if they are not there yet: in a directory named by a digest of their content,
    /// so processes running seeds at once share them and never see a half-written one (each
    /// file is written aside, then renamed into place).
    fn get(change: Option<ConfigChange>, generation: usize) -> SimFiles {
        use sha2::{Digest, Sha256};
        let changed = change.filter(|_| generation > 0);
        let agents = agents_text(change, changed.is_some());
        let tools = if changed == Some(ConfigChange::ServerRemoved) {
            "[servers]\n".to_string()
        } else {
            format!(
                "[servers.{}]\nurl = \"{}\"\nauth = \"none\"\n",
                crate::world::tools::SERVER,
                crate::world::tools::URL
            )
        };
        let digest = Sha256::digest(format!("{agents}\n{tools}").as_bytes());
        let name: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(format!("abada-sim-{name}"));
        let files = SimFiles {
            agents: dir.join("agents.toml"),
            tools: dir.join("tools.toml"),
        };
        for (path, text) in [(&files.agents, &agents), (&files.tools, &tools)] {
            if !path.exists() {
                write_aside_then_rename(path, text).unwrap_or_else(|e| {
                    panic!(
                        "the simulator cannot write {} ({e}); check that the temporary directory is writable",
                        path.display()
                    )
                });
            }
        }
        files
    }
}

/// Writes `text` to `path` through a file of this process beside it, renamed into place.
fn write_aside_then_rename(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let aside = path.with_extension(format!("{}.part", std::process::id()));
    std::fs::write(&aside, text)?;
    std::fs::rename(&aside, path)
}

/// The simulation's agent under the tasks' topic, as an agents file; with the seed's `change`
/// once `changed` (a restarted worker's file). A seed that drops approval overrides the gated
/// node of `simProcess` by its activity id in every generation: as the BPMN defines it first,
/// then without approval and performing no writes (as a redeployment that drops it).
fn agents_text(change: Option<ConfigChange>, changed: bool) -> String {
    use crate::world::{model, process};
    let mut topic = process::agent_definition(false);
    let mut gated_node = None;
    match (change, changed) {
        (Some(ConfigChange::ApprovalDropped), false) => {
            gated_node = Some(process::agent_definition(true));
        }
        (Some(ConfigChange::ApprovalDropped), true) => {
            let mut def = process::agent_definition(false);
            def["instructions"] = format!(
                "Play the script your input names. {} (agents file, changed)",
                model::NO_WRITES
            )
            .into();
            gated_node = Some(def);
        }
        (Some(ConfigChange::Instructions), true) => {
            topic["instructions"] = format!(
                "Play the script your input names. {} (agents file, changed)",
                model::NO_WRITES
            )
            .into();
        }
        (Some(ConfigChange::ApprovalAdded), true) => {
            topic["approval"] = "writes".into();
        }
        (Some(ConfigChange::ServerRemoved), true) => {
            // The worker refuses to start with an entry naming a server the registry lacks: the
            // operator removes it from both (the BPMN's definitions still name it).
            topic["toolServers"] = serde_json::json!([]);
        }
        (Some(ConfigChange::Limits), true) => {
            topic["maxTurns"] = 1.into();
            topic["maxToolCalls"] = 1.into();
        }
        _ => {}
    }
    let to_toml = |def: serde_json::Value| -> toml::Value {
        serde_json::from_value(def).expect("the simulation's agent is plain JSON")
    };
    let mut agents = toml::map::Map::new();
    agents.insert(AGENT_TOPIC.to_string(), to_toml(topic));
    if let Some(def) = gated_node {
        agents.insert(process::GATED_NODE.to_string(), to_toml(def));
    }
    let mut file = toml::map::Map::new();
    file.insert("agents".into(), toml::Value::Table(agents));
    toml::to_string(&toml::Value::Table(file)).expect("the simulation's agent renders as TOML")
}

/// The `ABADA_AGENT_*` environment of worker `id` against `world`.
fn worker_env(
    world: &World,
    change: Option<ConfigChange>,
    generation: usize,
    id: &str,
    slots: u32,
    lock_duration: Duration,
    poll_interval: Duration,
) -> HashMap<String, String> {
    let ms = |d: Duration| d.as_millis().to_string();
    let provider = PROVIDER.to_ascii_uppercase();
    let small = SMALL_WINDOW_PROVIDER.to_ascii_uppercase();
    let mut env = HashMap::from([
        (config::ENV_ENGINE_URL.to_string(), ENGINE_URL.to_string()),
        (config::ENV_WORKER_ID.to_string(), id.to_string()),
        (config::ENV_MAX_TASKS.to_string(), slots.to_string()),
        (config::ENV_POLL_INTERVAL_MS.to_string(), ms(poll_interval)),
        (config::ENV_LOCK_DURATION_MS.to_string(), ms(lock_duration)),
        (
            config::ENV_SHUTDOWN_GRACE_MS.to_string(),
            ms(SHUTDOWN_GRACE),
        ),
        (
            config::ENV_PROVIDERS.to_string(),
            format!("{PROVIDER},{SMALL_WINDOW_PROVIDER}"),
        ),
        (
            format!("ABADA_AGENT_PROVIDER_{provider}_KIND"),
            "openai".to_string(),
        ),
        (
            format!("ABADA_AGENT_PROVIDER_{small}_KIND"),
            "openai".to_string(),
        ),
        (
            format!("ABADA_AGENT_PROVIDER_{small}_CONTEXT_WINDOW"),
            SMALL_WINDOW.to_string(),
        ),
    ]);
    if world.store_journal {
        let files = SimFiles::get(change, generation);
        env.insert(
            config::ENV_AGENTS_FILE.to_string(),
            files.agents.display().to_string(),
        );
        env.insert(
            config::ENV_TOOLS_FILE.to_string(),
            files.tools.display().to_string(),
        );
    }
    env
}

/// The agent's retries, shortened to the simulation's scale (jitter kept: it is drawn from the
/// worker's seeded randomness).
fn agent_settings() -> AgentSettings {
    AgentSettings {
        model_retry: RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            unavailable_default: Duration::from_secs(1),
            ..RetryPolicy::default()
        },
        tool_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
        technical_retry: Backoff::new(Duration::from_secs(1), Duration::from_secs(4))
            .without_jitter(),
        store_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
        // A redeployment reaches new tasks within a tenth of a second (scenarios are short, and
        // a person's decision comes within one or two).
        bpmn: abada_agent_worker::agent::bpmn::BpmnSettings {
            latest_for: Duration::from_millis(100),
            ..Default::default()
        },
        // One thread, whose order a blocking thread's validation would race.
        validate_inline: true,
        ..AgentSettings::default()
    }
}

/// The poll loop's backoffs at the simulation's scale.
fn tuning() -> Tuning {
    Tuning {
        error_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(2)),
        throttle_backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(4)),
        ..Tuning::default()
    }
}

/// The seed of worker `id`'s randomness in the run of `seed`: its own stream, whatever the
/// other workers draw.
fn worker_seed(seed: u64, id: &str) -> u64 {
    // FNV-1a over the id, mixed with the seed.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    hash ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A worker running on the simulation's runtime.
pub(crate) struct SimWorker {
    pub id: String,
    /// Its metrics, as `/metrics` would serve them.
    pub metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    join: JoinHandle<()>,
}

impl SimWorker {
    /// Starts worker `id` of the run of `seed`, with `slots` slots, against `world`; `config`:
    /// the seed's agents-file or registry change and the worker's generation (0 at the seed's
    /// start: the files before the change; later, restarted: after it).
    ///
    /// # Panics
    /// When the worker cannot be built: its configuration is the simulator's, so that is a bug.
    pub fn start(
        world: &Arc<World>,
        seed: u64,
        config: (Option<ConfigChange>, usize),
        id: &str,
        slots: u32,
        lock_duration: Duration,
        poll_interval: Duration,
    ) -> SimWorker {
        let env = worker_env(
            world,
            config.0,
            config.1,
            id,
            slots,
            lock_duration,
            poll_interval,
        );
        let config = Config::from_env(&env)
            .unwrap_or_else(|e| panic!("simulated worker {id}: its configuration: {e}"));
        let mut providers = ProviderRegistry::default();
        let capacities = providers.capacities().clone();
        providers.insert(
            PROVIDER,
            Arc::new(WorldModel::new(world.clone(), id).with_capacities(capacities.clone())),
        );
        providers.insert(
            SMALL_WINDOW_PROVIDER,
            Arc::new(
                WorldModel::new(world.clone(), id)
                    .with_small_window()
                    .with_capacities(capacities.clone()),
            ),
        );
        // Replicas sharing the provider's quota pace as one queue, as with a shared run store.
        if world.provider.plan().is_some_and(|p| p.shared_pacing) {
            capacities.share_pace(Arc::new(crate::world::provider_limit::WorldPace::new(
                world.clone(),
                id,
            )));
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let seams = Seams {
            engine: Some(Arc::new(WorldEngine::new(world.clone(), id))),
            providers: Some(providers),
            tools: Some(Arc::new(WorldTools::new(world.clone(), id))),
            // Where a plain v1 engine's runs live (it keeps no journal), and where approval
            // round trips wait between tasks on either engine.
            store: Some(Arc::new(WorldStore::new(world.clone(), id))),
            agent: agent_settings(),
            tuning: tuning(),
            events: Some(tx),
            random: Random::seeded(worker_seed(seed, id)),
            ..Seams::default()
        };
        let worker =
            Worker::build(&config, seams).unwrap_or_else(|e| panic!("simulated worker {id}: {e}"));
        let metrics = worker.metrics.clone();
        let shutdown = CancellationToken::new();
        let forward = {
            let world = world.clone();
            let worker = id.to_string();
            async move {
                while let Some(e) = rx.recv().await {
                    let event = match e {
                        RunnerEvent::Fetched { requested, got } => Event::RunnerFetched {
                            worker: worker.clone(),
                            requested,
                            got,
                        },
                        RunnerEvent::TaskStarted { task_id, attempt } => Event::TaskStarted {
                            worker: worker.clone(),
                            task: task_id,
                            attempt,
                        },
                        RunnerEvent::SlotFreed { task_id, attempt } => Event::SlotFreed {
                            worker: worker.clone(),
                            task: task_id,
                            attempt,
                        },
                        RunnerEvent::TaskEnded {
                            task_id,
                            attempt,
                            outcome,
                        } => Event::TaskEnded {
                            worker: worker.clone(),
                            task: task_id,
                            attempt,
                            outcome: outcome.as_str().to_string(),
                        },
                        _ => continue,
                    };
                    world.record(event);
                }
            }
        };
        let run = abada_agent_worker::app::run_tasks(worker.runner, worker.store, shutdown.clone());
        let join = tokio::spawn(async move {
            // The events are copied as they come, in the runner's order.
            tokio::join!(run, forward);
        });
        world.record(Event::WorkerStarted {
            worker: id.to_string(),
            slots,
        });
        SimWorker {
            id: id.to_string(),
            metrics,
            shutdown,
            join,
        }
    }

    /// Kills the worker: its calls never return from now on, and its runner (with every task
    /// future it owns) is dropped at its current await.
    pub fn kill(self, world: &World) {
        world.faults().killed.insert(self.id.clone());
        world.record(Event::WorkerKilled {
            worker: self.id.clone(),
        });
        self.join.abort();
    }

    /// Asks for the staged shutdown without waiting for it.
    pub fn stop(&self) {
        self.shutdown.cancel();
    }
}
