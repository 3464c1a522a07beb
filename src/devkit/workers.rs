//! In-process workers against a devkit [`Stack`]: real workers, wired by the composition root
//! ([`Worker::build`]) from a [`Config`] that names the stack's engine emulator and scripted
//! model, running on the caller's runtime over real HTTP on loopback. The demo, the integration
//! tests and the benchmarks start them through [`StackWorkers`].
//!
//! What differs from a production worker goes through the seams: shorter backoffs
//! ([`fast_tuning`], [`StackWorkers::fast_agent_settings`]), an optional engine decorator, and an
//! event channel. The admin endpoints are not served.

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
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
    }

    /// [`WorkerHandle::stop`], then the events not received yet, in order.
    pub async fn stop_collecting(mut self) -> Vec<RunnerEvent> {
        self.shutdown.cancel();
        let _ = (&mut self.join).await;
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

/// The engine client's and the poll loop's backoffs shortened to milliseconds, so that a fault
/// is retried within a test's patience.
pub fn fast_tuning() -> Tuning {
    Tuning {
        command_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(500)),
        error_backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
        ..Tuning::default()
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
    engine: Option<crate::app::EngineWrapper>,
) -> WorkerHandle {
    let config = match Config::from_env(&worker_env(stack, &opts)) {
        Ok(c) => c,
        Err(e) => panic!("in-process worker {}: {e}", opts.worker_id),
    };
    start(
        &config,
        Seams {
            engine,
            agent,
            tuning: opts.tuning,
            ..Seams::default()
        },
    )
}
