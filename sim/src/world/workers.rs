//! In-process workers against the [`World`], for the paused-clock tests (`tests/it/runner.rs`,
//! `tests/it/paused_agent.rs`): built by the worker's composition root (the devkit's
//! [`start`]) from a configuration parsed the production way, with the world's engine in place of
//! the client and the caller's seams for the models, the tools or the task handler, with no
//! socket, so tokio's paused clock drives them. The simulator's own workers are [`crate::worker`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::app::Seams;
use abada_agent_worker::config::{self, Config};
use abada_agent_worker::devkit::workers::{WorkerHandle, WorkerOptions, start};

use super::{World, WorldEngine};

/// The engine's URL in the configuration of a worker against the world: the configuration
/// requires one; it is never dialled (the world's engine replaces the client).
const WORLD_ENGINE_URL: &str = "http://127.0.0.1:9/api";

/// The whole `ABADA_AGENT_*` environment of a worker against the simulator's world: `opts`,
/// and the model providers named in `providers` (kind `openai`; a stand-in registry given
/// through [`Seams::providers`] replaces their adapters).
pub fn world_worker_env(opts: &WorkerOptions, providers: &[&str]) -> HashMap<String, String> {
    let ms = |d: Duration| d.as_millis().to_string();
    let mut env = HashMap::from([
        (config::ENV_ENGINE_URL.into(), WORLD_ENGINE_URL.into()),
        (config::ENV_WORKER_ID.into(), opts.worker_id.clone()),
        (config::ENV_MAX_TASKS.into(), opts.slots.to_string()),
        (config::ENV_POLL_INTERVAL_MS.into(), ms(opts.poll_interval)),
        (config::ENV_LOCK_DURATION_MS.into(), ms(opts.lock_duration)),
        (
            config::ENV_SHUTDOWN_GRACE_MS.into(),
            ms(opts.shutdown_grace),
        ),
    ]);
    if !providers.is_empty() {
        env.insert(config::ENV_PROVIDERS.into(), providers.join(","));
        for name in providers {
            env.insert(
                format!(
                    "ABADA_AGENT_PROVIDER_{}_KIND",
                    name.to_ascii_uppercase().replace('-', "_")
                ),
                "openai".into(),
            );
        }
    }
    env.extend(opts.env.iter().cloned());
    env
}

/// Starts a worker against the simulator's `world` on the current runtime (a paused one in
/// tests), built by the composition root from [`world_worker_env`]'s configuration with
/// `opts.tuning` and `seams`: its engine is the world's engine for `opts.worker_id` (unless
/// `seams` gives one), behind the seams' decorator.
///
/// # Panics
/// When the worker cannot be built: the configuration is the caller's, so that is a bug.
pub fn start_in_world(
    world: &Arc<World>,
    opts: WorkerOptions,
    providers: &[&str],
    mut seams: Seams,
) -> WorkerHandle {
    let config = match Config::from_env(&world_worker_env(&opts, providers)) {
        Ok(c) => c,
        Err(e) => panic!("in-process worker {}: {e}", opts.worker_id),
    };
    if seams.engine.is_none() {
        seams.engine = Some(Arc::new(WorldEngine::new(world.clone(), &opts.worker_id)));
    }
    seams.tuning = opts.tuning;
    start(&config, seams)
}
