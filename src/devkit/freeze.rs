//! A freeze: a [`Gate`] that makes a worker stop talking to the engine, as a process paused by
//! the OS or a long garbage collection would, and wake up later with its requests still in hand.
//! The takeover demo has it put in front of a worker's engine client with
//! [`GatedEngine`](super::gate::GatedEngine) by the demo's adapter
//! ([`super::demo_workers`]), and drives it through the demo's `Freeze` port.
//!
//! While frozen, every call waits before it is sent (heartbeats included). A [`FreezePoint`]
//! armed on the [`FreezeGate`] freezes the gate by itself at a chosen place in a task's life
//! (before a journal step of a given kind and state, or before `complete`), once; the call that
//! hit it then waits like every other until [`FreezeGate::thaw`].

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::watch;

use super::gate::{Gate, Op};
use crate::engine::{JournalStep, TaskRef};

/// Where the gate freezes by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FreezePoint {
    /// Before sending a matching journal append: the step is not journaled.
    BeforeJournal(StepMatch),
    /// Before sending `complete`.
    BeforeComplete,
}

/// Which journal steps a [`FreezePoint`] is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepMatch {
    pub kind: String,
    pub state: String,
    /// Only steps with an idempotency key (keyed tool writes).
    pub(crate) keyed_only: bool,
}

impl StepMatch {
    /// Steps of this kind and state, e.g. `tool`/`started`.
    pub fn new(kind: &str, state: &str) -> StepMatch {
        StepMatch {
            kind: kind.into(),
            state: state.into(),
            keyed_only: false,
        }
    }

    /// Only the keyed ones.
    pub fn keyed(mut self) -> StepMatch {
        self.keyed_only = true;
        self
    }

    fn matches(&self, step: &JournalStep) -> bool {
        step.kind == self.kind
            && step.state == self.state
            && (!self.keyed_only || step.key.is_some())
    }
}

/// The switch shared by the decorator and whoever drives the freeze.
#[derive(Debug)]
pub(crate) struct FreezeGate {
    /// `Some(what happened)` while frozen.
    state: watch::Sender<Option<String>>,
    armed: Mutex<Option<FreezePoint>>,
}

impl FreezeGate {
    pub fn new() -> Arc<FreezeGate> {
        Arc::new(FreezeGate {
            state: watch::channel(None).0,
            armed: Mutex::new(None),
        })
    }

    /// Freezes at `point` the next time a call reaches it (once).
    pub(crate) fn arm(&self, point: FreezePoint) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(point);
    }

    /// Freezes now, for `reason`.
    pub fn freeze(&self, reason: impl Into<String>) {
        self.state.send_replace(Some(reason.into()));
    }

    /// Lets every waiting call go on.
    pub fn thaw(&self) {
        self.state.send_replace(None);
    }

    #[cfg(test)]
    fn is_frozen(&self) -> bool {
        self.state.borrow().is_some()
    }

    /// Waits until the gate is frozen; returns why.
    pub async fn frozen(&self) -> String {
        let mut rx = self.state.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            // The sender lives in `self`, so the channel cannot close while we borrow it.
            Err(_) => String::new(),
        }
    }

    async fn wait_thawed(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(Option::is_none).await;
    }

    /// Freezes when the armed point satisfies `is_here` (disarming it); true when it did.
    fn hit(&self, is_here: impl Fn(&FreezePoint) -> bool, reason: impl FnOnce() -> String) -> bool {
        let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        if armed.as_ref().is_some_and(is_here) {
            *armed = None;
            drop(armed);
            self.freeze(reason());
            return true;
        }
        false
    }
}

fn step_reason(task: &TaskRef, step: &JournalStep) -> String {
    format!(
        "before journaling step {} {}/{} of {}",
        step.seq, step.kind, step.state, task.task_id
    )
}

/// Every call waits while the gate is frozen; the call that reaches the armed point freezes it.
#[async_trait]
impl Gate for FreezeGate {
    async fn before(&self, op: Op<'_>, task: Option<&TaskRef>) {
        self.wait_thawed().await;
        let hit = match (op, task) {
            (Op::Complete, Some(task)) => self.hit(
                |p| *p == FreezePoint::BeforeComplete,
                || format!("before completing {}", task.task_id),
            ),
            (Op::JournalAppend(step), Some(task)) => self.hit(
                |p| matches!(p, FreezePoint::BeforeJournal(m) if m.matches(step)),
                || step_reason(task, step),
            ),
            _ => false,
        };
        if hit {
            self.wait_thawed().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devkit::gate::GatedEngine;
    use crate::engine::{
        AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, Journal,
        Task, ToolCredential,
    };
    use serde_json::{Map, Value};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    /// Counts appends; answers everything else with a harmless value.
    #[derive(Default)]
    struct Counting(AtomicU32);

    #[async_trait]
    impl Engine for Counting {
        async fn fetch_and_lock(&self, _: &FetchRequest) -> Result<Vec<Task>, EngineError> {
            Ok(vec![])
        }
        async fn heartbeat(&self, _: &TaskRef, _: Duration) -> Result<(), EngineError> {
            Ok(())
        }
        async fn complete(&self, _: &TaskRef, _: &Map<String, Value>) -> Result<(), EngineError> {
            Ok(())
        }
        async fn failure(&self, _: &TaskRef, _: &FailureReport) -> Result<(), EngineError> {
            Ok(())
        }
        async fn bpmn_error(&self, _: &TaskRef, _: &BpmnErrorReport) -> Result<(), EngineError> {
            Ok(())
        }
        async fn read_journal(&self, _: &TaskRef) -> Result<Journal, EngineError> {
            Ok(Journal::default())
        }
        async fn append_journal(
            &self,
            _: &TaskRef,
            _: &JournalStep,
        ) -> Result<AppendOutcome, EngineError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(AppendOutcome::Created)
        }
        async fn tool_credential(
            &self,
            _: &TaskRef,
            _: &str,
        ) -> Result<ToolCredential, EngineError> {
            Err(EngineError::InvalidRequest {
                op: "tool-credentials",
                message: "not here".into(),
            })
        }
    }

    fn task() -> TaskRef {
        TaskRef {
            task_id: "t-000001".into(),
            attempt: Some(1),
            trace_parent: None,
        }
    }

    fn step(kind: &str, state: &str) -> JournalStep {
        JournalStep {
            seq: 5,
            kind: kind.into(),
            state: state.into(),
            key: Some("abada:t-000001:5".into()),
            data: Value::Null,
        }
    }

    #[tokio::test]
    async fn an_armed_point_freezes_every_call_until_thawed() {
        let inner = Arc::new(Counting::default());
        let gate = FreezeGate::new();
        gate.arm(FreezePoint::BeforeJournal(StepMatch::new(
            "tool", "started",
        )));
        let engine = GatedEngine::wrap(inner.clone(), gate.clone());
        engine
            .append_journal(&task(), &step("model", "finished"))
            .await
            .unwrap();
        assert!(!gate.is_frozen());
        let call = {
            let engine = engine.clone();
            tokio::spawn(async move {
                engine
                    .append_journal(&task(), &step("tool", "started"))
                    .await
            })
        };
        let reason = gate.frozen().await;
        assert!(
            reason.contains("before journaling step 5 tool/started"),
            "{reason}"
        );
        let hb = {
            let engine = engine.clone();
            tokio::spawn(async move { engine.heartbeat(&task(), Duration::from_secs(1)).await })
        };
        tokio::task::yield_now().await;
        assert!(!call.is_finished() && !hb.is_finished());
        assert_eq!(inner.0.load(Ordering::SeqCst), 1, "not sent while frozen");
        gate.thaw();
        call.await.unwrap().unwrap();
        hb.await.unwrap().unwrap();
        assert_eq!(inner.0.load(Ordering::SeqCst), 2);
        // Disarmed after one hit.
        engine
            .append_journal(&task(), &step("tool", "started"))
            .await
            .unwrap();
        assert!(!gate.is_frozen());
    }

    #[tokio::test]
    async fn before_points_hold_the_call_back() {
        let inner = Arc::new(Counting::default());
        let gate = FreezeGate::new();
        gate.arm(FreezePoint::BeforeJournal(
            StepMatch::new("tool", "finished").keyed(),
        ));
        let engine = GatedEngine::wrap(inner.clone(), gate.clone());
        let mut unkeyed = step("tool", "finished");
        unkeyed.key = None;
        engine.append_journal(&task(), &unkeyed).await.unwrap();
        assert!(!gate.is_frozen(), "only keyed steps match");
        let call = {
            let engine = engine.clone();
            tokio::spawn(async move {
                engine
                    .append_journal(&task(), &step("tool", "finished"))
                    .await
            })
        };
        gate.frozen().await;
        assert_eq!(inner.0.load(Ordering::SeqCst), 1, "not sent while frozen");
        gate.thaw();
        call.await.unwrap().unwrap();
        assert_eq!(inner.0.load(Ordering::SeqCst), 2);
    }
}
