//! The demo's workers: the adapter that implements the `abada-demo` crate's port
//! ([`abada_demo::workers::Workers`]) with real in-process workers, started against a devkit
//! [`Stack`] through [`StackWorkers`] (so built by the composition root), their engine client
//! behind a [`FreezeGate`] when a scenario freezes one. The binary passes [`DemoWorkers`] to
//! `abada_demo::cli_demo`; the demo tests to `abada_demo::run`.
//!
//! It translates, and decides nothing: the worker's [`RunnerEvent`]s and [`TaskEnd`]s into the
//! demo's [`WorkerEvent`]s and [`TaskOutcome`]s, the demo's [`WorkerSpec`] into
//! [`WorkerOptions`], its [`FreezeAt`] into a [`FreezePoint`].

use std::sync::Arc;
use std::time::Duration;

use abada_demo::workers::{
    BoxFuture, Freeze, FreezeAt, RunningWorker, StaleProbe, StartedWorker, TaskOutcome,
    WorkerEvent, WorkerSpec, Workers,
};
use serde_json::Map;
use tokio::sync::mpsc;

use super::freeze::{FreezeGate, FreezePoint, StepMatch};
use super::gate::GatedEngine;
use super::stack::{DeclaredLabelNames, Stack, StackWorkers, WorkerHandle, WorkerOptions};
use crate::config;
use crate::engine::client::{EngineClientSettings, HttpEngine};
use crate::engine::{Engine, JournalStep, TaskRef};
use crate::heartbeat::HeartbeatEvent;
use crate::metrics::Metrics;
use crate::runner::RunnerEvent;
use crate::task_end::TaskEnd;

/// Real workers for the demo.
#[derive(Clone, Copy, Debug, Default)]
pub struct DemoWorkers;

impl Workers for DemoWorkers {
    fn start(&self, stack: &Stack, spec: WorkerSpec) -> Result<StartedWorker, String> {
        let mut opts = WorkerOptions::new(spec.name.clone(), spec.slots);
        opts.lock_duration = spec.lease;
        opts.poll_interval = spec.poll_interval;
        if let Some((url, allow_insecure)) = &spec.store {
            opts.env.push((config::ENV_STORE_URL.into(), url.clone()));
            if *allow_insecure {
                opts.env
                    .push((config::ENV_STORE_ALLOW_INSECURE.into(), "true".into()));
            }
        }
        if let Some(path) = &spec.agents_file {
            opts.env
                .push((config::ENV_AGENTS_FILE.into(), path.display().to_string()));
        }
        if let Some(path) = &spec.tools_file {
            opts.env
                .push((config::ENV_TOOLS_FILE.into(), path.display().to_string()));
        }
        let label_names = match &spec.label_names {
            Some(_) if spec.agents_file.is_some() => {
                return Err(format!(
                    "worker {}: declared label names and an agents file are one file; give one",
                    spec.name
                ));
            }
            Some(names) => {
                let models: Vec<&str> = names.models.iter().map(String::as_str).collect();
                let servers: Vec<(&str, &str)> = names
                    .servers
                    .iter()
                    .map(|(name, url)| (name.as_str(), url.as_str()))
                    .collect();
                let declared = DeclaredLabelNames::write(&names.agent, &models, &servers)
                    .map_err(|e| format!("cannot write the declared label names: {e}"))?;
                opts.env.push(declared.env());
                Some(declared)
            }
            None => None,
        };
        let settings = Stack::fast_agent_settings();
        let (mut handle, freeze) = match &spec.freeze {
            None => (stack.spawn_worker(opts, settings), None),
            Some(at) => {
                let gate = FreezeGate::new();
                if let Some(point) = freeze_point(at) {
                    gate.arm(point);
                }
                let handle =
                    stack.spawn_worker_with(opts, settings, GatedEngine::wrapper(gate.clone()));
                (handle, Some(gate as Arc<dyn Freeze>))
            }
        };
        let events = translate_events(std::mem::replace(
            &mut handle.events,
            mpsc::unbounded_channel().1,
        ));
        Ok(StartedWorker {
            worker: Box::new(DemoWorker {
                handle,
                _label_names: label_names,
            }),
            events,
            freeze,
        })
    }

    fn check_store_url(&self, url: &str, allow_insecure: bool) -> Result<String, String> {
        crate::store::StoreUrl::parse(url, allow_insecure)
            .map(|parsed| parsed.redacted().to_string())
            .map_err(|e| e.to_string())
    }

    fn probe_stale_attempt<'a>(&'a self, probe: &'a StaleProbe) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut settings =
                EngineClientSettings::new(probe.engine_url.clone(), probe.worker.clone());
            settings.command_attempts = 1;
            settings.request_timeout = Duration::from_secs(5);
            let engine = HttpEngine::new(
                reqwest::Client::new(),
                settings,
                None,
                Arc::new(Metrics::new()),
            );
            let stale = TaskRef {
                task_id: probe.task_id.clone(),
                attempt: probe.attempt,
                trace_parent: None,
            };
            let step = JournalStep {
                seq: probe.step.seq,
                kind: probe.step.kind.clone(),
                state: probe.step.state.clone(),
                key: probe.step.key.clone(),
                data: probe.step.data.clone(),
            };
            // The answers are the engine's call log's; a refusal is what the demo expects.
            let _ = engine.heartbeat(&stale, probe.lease).await;
            let _ = engine.append_journal(&stale, &step).await;
            let _ = engine.tool_credential(&stale, &probe.tool_server).await;
            let _ = engine.complete(&stale, &Map::new()).await;
        })
    }
}

/// The gate's armed point for `at` (none for a freeze only the scenario sets off).
fn freeze_point(at: &FreezeAt) -> Option<FreezePoint> {
    match at {
        FreezeAt::Manual => None,
        FreezeAt::BeforeJournal {
            kind,
            state,
            keyed_only,
        } => {
            let step = StepMatch::new(kind, state);
            Some(FreezePoint::BeforeJournal(if *keyed_only {
                step.keyed()
            } else {
                step
            }))
        }
        FreezeAt::BeforeComplete => Some(FreezePoint::BeforeComplete),
    }
}

/// A demo worker: the worker and the label names file it reads, kept for its life.
struct DemoWorker {
    handle: WorkerHandle,
    _label_names: Option<DeclaredLabelNames>,
}

impl RunningWorker for DemoWorker {
    fn metrics_text(&self) -> String {
        self.handle.metrics.encode()
    }

    fn stop(&self) {
        self.handle.shutdown.cancel();
    }

    fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

impl Freeze for FreezeGate {
    fn freeze(&self, reason: &str) {
        FreezeGate::freeze(self, reason);
    }

    fn thaw(&self) {
        FreezeGate::thaw(self);
    }

    fn frozen(&self) -> BoxFuture<'_, String> {
        Box::pin(FreezeGate::frozen(self))
    }
}

/// The worker's events in the demo's words, in order; the channel closes after the worker's.
fn translate_events(
    mut from: mpsc::UnboundedReceiver<RunnerEvent>,
) -> mpsc::UnboundedReceiver<WorkerEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = from.recv().await {
            if let Some(event) = demo_event(event)
                && tx.send(event).is_err()
            {
                break;
            }
        }
    });
    rx
}

/// What the demo reads of a worker's event; heartbeats sent or failed tell it nothing.
fn demo_event(event: RunnerEvent) -> Option<WorkerEvent> {
    Some(match event {
        RunnerEvent::Fetched { requested, got } => WorkerEvent::Fetched { requested, got },
        RunnerEvent::FetchFailed { error } => WorkerEvent::FetchFailed { error },
        RunnerEvent::TaskStarted { task_id, attempt } => {
            WorkerEvent::TaskStarted { task_id, attempt }
        }
        RunnerEvent::SlotFreed { task_id, attempt } => WorkerEvent::SlotFreed { task_id, attempt },
        RunnerEvent::TaskEnded {
            task_id,
            attempt,
            outcome,
        } => WorkerEvent::TaskEnded {
            task_id,
            attempt,
            outcome: task_outcome(outcome),
        },
        RunnerEvent::Heartbeat(HeartbeatEvent::Extended { .. }) => WorkerEvent::LeaseExtended,
        RunnerEvent::Heartbeat(HeartbeatEvent::Lost { reason, .. }) => WorkerEvent::LeaseLost {
            reason: reason.to_string(),
        },
        RunnerEvent::Heartbeat(HeartbeatEvent::Sent { .. } | HeartbeatEvent::Failed { .. }) => {
            return None;
        }
    })
}

fn task_outcome(end: TaskEnd) -> TaskOutcome {
    match end {
        TaskEnd::Completed => TaskOutcome::Completed,
        TaskEnd::BpmnError => TaskOutcome::BpmnError,
        TaskEnd::Failed => TaskOutcome::Failed,
        TaskEnd::Deferred => TaskOutcome::Deferred,
        TaskEnd::Incident => TaskOutcome::Incident,
        TaskEnd::Released => TaskOutcome::Released,
        TaskEnd::LeaseLost => TaskOutcome::LeaseLost,
        TaskEnd::ReportFailed => TaskOutcome::ReportFailed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_end_keeps_its_spelling_in_the_demo() {
        for end in TaskEnd::ALL {
            assert_eq!(task_outcome(end).as_str(), end.as_str());
            assert_eq!(task_outcome(end).to_string(), end.to_string());
        }
    }

    #[test]
    fn the_demo_reads_the_store_from_the_workers_variables() {
        assert_eq!(abada_demo::workers::STORE_URL_VAR, config::ENV_STORE_URL);
        assert_eq!(
            abada_demo::workers::STORE_ALLOW_INSECURE_VAR,
            config::ENV_STORE_ALLOW_INSECURE
        );
    }

    #[test]
    fn a_demo_store_url_is_checked_by_the_worker_and_never_shows_its_password() {
        let url = "postgres://abada:s3cret@127.0.0.1:5432/abada_demo";
        let store = abada_demo::DemoStore::new(url, &DemoWorkers).unwrap();
        assert!(!store.redacted().contains("s3cret"), "{}", store.redacted());
        assert!(!format!("{store:?}").contains("s3cret"));
        let bad = abada_demo::DemoStore::new("mysql://root:s3cret@db/x", &DemoWorkers).unwrap_err();
        assert!(
            matches!(bad, abada_demo::ArgsError::BadStoreUrl(_)),
            "{bad}"
        );
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
    }
}
