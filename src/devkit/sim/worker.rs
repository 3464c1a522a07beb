//! One simulated worker: the production runner, heartbeat actor and agent runtime, wired to the
//! world's engine, model, tools and run store instead of HTTP, MCP and SQL, with every backoff's jitter off (the world's seeded
//! source is the only randomness), and its runner events copied into the world's trace.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::agent::definition::AgentsFile;
use crate::agent::limits::Ceilings;
use crate::agent::{AgentRuntime, AgentSettings};
use crate::backoff::Backoff;
use crate::devkit::engine::AGENT_TOPIC;
use crate::devkit::world::{Event, World, WorldEngine, WorldModel, WorldStore, WorldTools};
use crate::engine::Engine;
use crate::handler::TaskHandler;
use crate::metrics::Metrics;
use crate::provider::ProviderRegistry;
use crate::provider::fallback::RetryPolicy;
use crate::runner::{Runner, RunnerEvent, RunnerSettings};
use crate::tools::registry::{ToolRegistry, ToolsFile};

pub(crate) use crate::devkit::world::model::PROVIDER;

/// The tools' HTTP client of every simulated worker: built once (loading the platform's roots
/// takes milliseconds), never used (the world's tasks name no tool server).
fn tool_http() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(reqwest::Client::new).clone()
}

/// The agents file of a worker whose engine sends no definition: the simulation's agent under
/// the tasks' topic.
fn agents_file() -> AgentsFile {
    static FILE: std::sync::OnceLock<AgentsFile> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let definition: toml::Value =
            serde_json::from_value(crate::devkit::world::process::agent_definition(false))
                .expect("the simulation's agent is plain JSON");
        let mut agents = toml::map::Map::new();
        agents.insert(AGENT_TOPIC.to_string(), definition);
        let mut file = toml::map::Map::new();
        file.insert("agents".into(), toml::Value::Table(agents));
        let text = toml::to_string(&toml::Value::Table(file))
            .expect("the simulation's agent renders as TOML");
        AgentsFile::parse_str(&text).expect("the simulation's agent is a valid definition")
    })
    .clone()
}

/// The operator's registry of a worker whose engine issues no per-task credentials: the
/// world's tool server without authentication. Built once (its client loads the platform's
/// roots); it starts no token actor.
fn tool_registry() -> Arc<ToolRegistry> {
    static REGISTRY: std::sync::OnceLock<Arc<ToolRegistry>> = std::sync::OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let text = format!(
                "[servers.{}]\nurl = \"{}\"\nauth = \"none\"\n",
                crate::devkit::world::tools::SERVER,
                crate::devkit::world::tools::URL
            );
            let file = ToolsFile::parse(&text, std::path::Path::new("(simulation)"))
                .expect("the simulation's tools file is valid");
            Arc::new(
                ToolRegistry::start(file, reqwest::Client::builder())
                    .expect("the registry's client builds"),
            )
        })
        .clone()
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
    /// Starts worker `id` with `slots` slots against `world`.
    pub fn start(
        world: &Arc<World>,
        id: &str,
        slots: u32,
        lock_duration: Duration,
        poll_interval: Duration,
    ) -> SimWorker {
        let engine: Arc<dyn Engine> = Arc::new(WorldEngine::new(world.clone(), id));
        let mut providers = ProviderRegistry::default();
        providers.insert(PROVIDER, Arc::new(WorldModel::new(world.clone(), id)));
        let metrics = Arc::new(Metrics::new());
        let settings = AgentSettings {
            model_retry: RetryPolicy {
                initial_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(1),
                jitter: 0.0,
                unavailable_default: Duration::from_secs(1),
                ..RetryPolicy::default()
            },
            tool_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
                .without_jitter(),
            technical_retry: Backoff::new(Duration::from_secs(1), Duration::from_secs(4))
                .without_jitter(),
            store_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
                .without_jitter(),
            // A redeployment reaches new tasks within a tenth of a second (scenarios are
            // short, and a person's decision comes within one or two).
            bpmn: crate::agent::bpmn::BpmnSettings {
                latest_for: Duration::from_millis(100),
                ..Default::default()
            },
            ..AgentSettings::default()
        };
        let runtime = AgentRuntime::new(
            providers,
            world.store_journal.then(agents_file),
            tool_http(),
            settings,
            metrics.clone(),
            Ceilings::default(),
        )
        .with_tool_connector(Arc::new(WorldTools::new(world.clone(), id)));
        // The world's run store: where a plain v1 engine's runs live (it keeps no journal), and
        // where approval round trips wait between tasks on either engine. A store that fails is
        // waited out for a lock duration, as in `app.rs`.
        let runtime = runtime.with_store(
            Arc::new(WorldStore::new(world.clone(), id)),
            id,
            lock_duration,
        );
        let runtime = if world.store_journal {
            runtime.with_tool_registry(tool_registry())
        } else {
            runtime
        };
        let handler: Arc<dyn TaskHandler> = Arc::new(runtime);
        let mut rs = RunnerSettings::new(id, lock_duration);
        rs.max_tasks = slots;
        rs.poll_interval = poll_interval;
        rs.poll_jitter = 0.0;
        rs.shutdown_grace = Duration::from_secs(2);
        rs.error_backoff =
            Backoff::new(Duration::from_millis(200), Duration::from_secs(2)).without_jitter();
        rs.throttle_backoff =
            Backoff::new(Duration::from_millis(500), Duration::from_secs(4)).without_jitter();
        rs.heartbeat.retry_backoff = rs.heartbeat.retry_backoff.without_jitter();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let runner = Runner::new(engine, handler, rs, metrics.clone()).with_events(tx);
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
        let run = runner.run(shutdown.clone());
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
