//! In-process workers, wired by the composition root ([`Worker::build`]) from a [`Config`]
//! parsed the production way from an environment map, running on the caller's runtime:
//!
//! - against a devkit [`Stack`], over real HTTP on loopback: the configuration names the stack's
//!   engine emulator and scripted model. The demo, the integration tests and the benchmarks
//!   start them through [`StackWorkers`];
//! - against anything else the caller's seams stand in for, from a configuration the caller
//!   parsed ([`start`]): the simulator's crate starts the paused-clock tests' workers against
//!   its in-memory world so (`abada_sim::world::workers`).
//!
//! What differs from a production worker goes through the seams: shorter backoffs
//! ([`fast_tuning`], [`StackWorkers::fast_agent_settings`]), an optional engine decorator
//! (a [`Gate`](super::gate::Gate)), stand-ins, and an event channel. The admin endpoints are not
//! served.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::stack::Stack;
use crate::agent::AgentSettings;
use crate::app::{Seams, Tuning, Worker};
use crate::backoff::Backoff;
use crate::config::{self, Config};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::provider::capacity::ModelCapacities;
use crate::provider::fallback::RetryPolicy;
use crate::runner::{RunnerEvent, WorkerStatus};

/// How an in-process worker is set up.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub worker_id: String,
    pub slots: u32,
    pub lock_duration: Duration,
    pub poll_interval: Duration,
    pub shutdown_grace: Duration,
    /// More `ABADA_AGENT_*` variables, set last (e.g. the run store's URL, an agents file).
    pub env: Vec<(String, String)>,
    /// The engine client's and the poll loop's backoffs: [`fast_tuning`] unless a test needs
    /// another (e.g. a command backoff cap above the `Retry-After` it checks).
    pub tuning: Tuning,
}

impl WorkerOptions {
    pub fn new(worker_id: impl Into<String>, slots: u32) -> Self {
        WorkerOptions {
            worker_id: worker_id.into(),
            slots,
            lock_duration: Duration::from_secs(10),
            poll_interval: Duration::from_millis(200),
            shutdown_grace: Duration::from_secs(5),
            env: Vec::new(),
            tuning: fast_tuning(),
        }
    }
}

/// A worker running in this process.
pub struct WorkerHandle {
    pub worker_id: String,
    pub shutdown: CancellationToken,
    pub events: mpsc::UnboundedReceiver<RunnerEvent>,
    pub metrics: Arc<Metrics>,
    pub status: Arc<WorkerStatus>,
    /// The worker's engine client, behind its decorator if it was given one.
    pub engine: Arc<dyn Engine>,
    /// The models' pacers (what `/readyz` reads: which models are held, and why).
    pub models: Option<Arc<ModelCapacities>>,
    join: tokio::task::JoinHandle<()>,
}

impl WorkerHandle {
    /// Staged shutdown, waiting for the drain to end.
    ///
    /// # Panics
    /// With the worker's own panic, when its runner panicked: a bug the caller must see.
    pub async fn stop(self) {
        self.shutdown.cancel();
        ended_cleanly(self.join.await);
    }

    /// [`WorkerHandle::stop`], then the events not received yet, in order.
    pub async fn stop_collecting(mut self) -> Vec<RunnerEvent> {
        self.shutdown.cancel();
        ended_cleanly((&mut self.join).await);
        let mut rest = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            rest.push(e);
        }
        rest
    }

    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

/// Resumes the runner's panic, if it panicked.
fn ended_cleanly(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined
        && e.is_panic()
    {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// The engine client's and the poll loop's backoffs shortened to milliseconds, so that a fault
/// is retried within a test's patience.
pub fn fast_tuning() -> Tuning {
    Tuning {
        command_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(500)),
        error_backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
        ..Tuning::default()
    }
}

/// The names an operator declares for the metrics' labels: only the operator's files declare
/// label values (`metrics::labels`), and a stack's agents are the engine's. An agents file with
/// one entry naming `agent`, its models and tool servers, keyed by no topic or activity (no task
/// uses it), in a directory of its own that is removed when the value is dropped; keep it for
/// the workers' life and give them [`DeclaredLabelNames::env`].
#[derive(Debug)]
pub struct DeclaredLabelNames {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl DeclaredLabelNames {
    /// Declares `agent`, its `models` (`provider/model`, at least one) and tool `servers`
    /// (`(name, url)`).
    pub fn write(
        agent: &str,
        models: &[&str],
        servers: &[(&str, &str)],
    ) -> std::io::Result<DeclaredLabelNames> {
        let (model, fallbacks) = models
            .split_first()
            .ok_or_else(|| std::io::Error::other("declare at least one model"))?;
        let list = |items: Vec<String>| items.join(", ");
        let text = format!(
            "[agents.\"declared-label-names\"]\nname = {agent:?}\nmodel = {model:?}\nfallbackModels = [{}]\ninput = \"unused\"\ntoolServers = [{}]\n",
            list(fallbacks.iter().map(|m| format!("{m:?}")).collect()),
            list(
                servers
                    .iter()
                    .map(|(name, url)| format!("{{ name = {name:?}, url = {url:?} }}"))
                    .collect()
            ),
        );
        let dir = std::env::temp_dir().join(format!("abada-labels-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("declared-label-names.toml");
        std::fs::write(&path, text)?;
        Ok(DeclaredLabelNames { dir, path })
    }

    /// The variable and value that give a worker the file.
    pub fn env(&self) -> (String, String) {
        (
            config::ENV_AGENTS_FILE.to_string(),
            self.path.display().to_string(),
        )
    }
}

impl Drop for DeclaredLabelNames {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The whole `ABADA_AGENT_*` environment of a worker against `stack`: its engine emulator, the
/// providers `openai` and `anthropic` (both served by the scripted model), and `opts`.
pub fn worker_env(stack: &Stack, opts: &WorkerOptions) -> HashMap<String, String> {
    let ms = |d: Duration| d.as_millis().to_string();
    let provider_timeout = ms(stack.provider_request_timeout());
    let mut env = HashMap::from([
        (config::ENV_ENGINE_URL.into(), stack.engine.base_url()),
        (config::ENV_WORKER_ID.into(), opts.worker_id.clone()),
        (config::ENV_MAX_TASKS.into(), opts.slots.to_string()),
        (config::ENV_POLL_INTERVAL_MS.into(), ms(opts.poll_interval)),
        (config::ENV_LOCK_DURATION_MS.into(), ms(opts.lock_duration)),
        (
            config::ENV_SHUTDOWN_GRACE_MS.into(),
            ms(opts.shutdown_grace),
        ),
        (config::ENV_ENGINE_TIMEOUT_MS.into(), "5000".into()),
        // Never bound: in-process workers serve no admin endpoints.
        (config::ENV_HTTP_ADDR.into(), "127.0.0.1:0".into()),
        (config::ENV_PROVIDERS.into(), "openai,anthropic".into()),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL".into(),
            stack.model.base_url_openai(),
        ),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_TIMEOUT_MS".into(),
            provider_timeout.clone(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_BASE_URL".into(),
            stack.model.base_url_anthropic(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_TIMEOUT_MS".into(),
            provider_timeout,
        ),
    ]);
    env.extend(opts.env.iter().cloned());
    env
}

/// Builds a worker from `config` and `seams` through the composition root and runs it on the
/// current runtime until its handle stops it.
///
/// # Panics
/// When the worker cannot be built: the configuration is the caller's, so that is a bug.
pub fn start(config: &Config, mut seams: Seams) -> WorkerHandle {
    let (tx, events) = mpsc::unbounded_channel();
    seams.events = Some(tx);
    let worker = match Worker::build(config, seams) {
        Ok(w) => w,
        Err(e) => panic!("in-process worker {}: {e}", config.worker_id),
    };
    let status = worker.runner.status();
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(crate::app::run_tasks(
        worker.runner,
        worker.store.clone(),
        shutdown.clone(),
    ));
    WorkerHandle {
        worker_id: config.worker_id.clone(),
        shutdown,
        events,
        metrics: worker.metrics,
        status,
        engine: worker.engine,
        models: worker.models,
        join,
    }
}

/// In-process workers on a devkit [`Stack`] (the stack itself cannot know the worker).
pub trait StackWorkers {
    /// Agent settings with short backoffs, for tests and the demo.
    fn fast_agent_settings() -> AgentSettings
    where
        Self: Sized,
    {
        AgentSettings {
            model_retry: RetryPolicy {
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(200),
                unavailable_default: Duration::from_secs(1),
                ..RetryPolicy::default()
            },
            tool_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
            technical_retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(2))
                .without_jitter(),
            store_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
            ..AgentSettings::default()
        }
    }

    /// Starts a worker with the real runner and agent runtime against the stack.
    fn spawn_worker(&self, opts: WorkerOptions, agent: AgentSettings) -> WorkerHandle;

    /// [`StackWorkers::spawn_worker`] with the worker's engine client wrapped by `wrap` (e.g.
    /// [`GatedEngine::wrapper`](super::gate::GatedEngine::wrapper)).
    fn spawn_worker_with(
        &self,
        opts: WorkerOptions,
        agent: AgentSettings,
        wrap: impl FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine> + Send + 'static,
    ) -> WorkerHandle;
}

impl StackWorkers for Stack {
    fn spawn_worker(&self, opts: WorkerOptions, agent: AgentSettings) -> WorkerHandle {
        spawn(self, opts, agent, None)
    }

    fn spawn_worker_with(
        &self,
        opts: WorkerOptions,
        agent: AgentSettings,
        wrap: impl FnOnce(Arc<dyn Engine>) -> Arc<dyn Engine> + Send + 'static,
    ) -> WorkerHandle {
        spawn(self, opts, agent, Some(Box::new(wrap)))
    }
}

fn spawn(
    stack: &Stack,
    opts: WorkerOptions,
    agent: AgentSettings,
    decorate_engine: Option<crate::app::EngineWrapper>,
) -> WorkerHandle {
    let config = match Config::from_env(&worker_env(stack, &opts)) {
        Ok(c) => c,
        Err(e) => panic!("in-process worker {}: {e}", opts.worker_id),
    };
    start(
        &config,
        Seams {
            decorate_engine,
            agent,
            tuning: opts.tuning,
            ..Seams::default()
        },
    )
}
