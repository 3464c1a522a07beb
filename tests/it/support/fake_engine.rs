//! An in-memory [`Engine`] for paused-clock tests of the runner and the heartbeat scheduler: no
//! sockets, so tokio's clock can auto-advance. It records every call with its virtual time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, Journal,
    JournalStep, LeaseLostReason, ProbeOutcome, Task, TaskRef, ToolCredential,
};
use async_trait::async_trait;
use serde_json::{Map, Value};
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct Call {
    pub at: Instant,
    pub op: &'static str,
    pub task_id: Option<String>,
    pub attempt: Option<u32>,
    /// For fetches: the maxTasks asked for, and the tasks handed out but not yet reported.
    pub max_tasks: u32,
    pub outstanding: usize,
}

#[derive(Default)]
pub struct FakeState {
    pub open: VecDeque<Task>,
    pub outstanding: HashSet<String>,
    pub calls: Vec<Call>,
    pub completed: HashMap<String, u32>,
    pub failures: Vec<(String, FailureReport)>,
    pub refuse_heartbeat: HashSet<String>,
    pub heartbeat_transient: bool,
    pub fetch_transient: bool,
    /// When set, [`Engine::probe`] answers (recorded as op `probe`): unreachable while
    /// `fetch_transient` is on, reachable otherwise. When not set, the trait default (cannot
    /// probe) applies.
    pub probe_supported: bool,
    /// A misbehaving engine: each fetch answer holds up to this many tasks beyond `maxTasks`.
    pub surplus: usize,
    /// A stalled engine: `failure` answers only after an hour.
    pub stall_failures: bool,
    /// A silent engine: while set, every call (recorded when sent) waits unanswered, with no
    /// client timeout to end it, until this is cleared; then it is answered as usual. An engine
    /// that accepts connections and never replies, seen through the worst client.
    pub hung: bool,
    /// When set, a fetch answers at most this many tasks, whatever it asked for: the partial
    /// answers of an engine whose concurrent fetches skip each other's locked rows.
    pub answer_cap: Option<usize>,
    /// The next this many fetches answer empty whatever the queue holds: fetches that found
    /// every row locked by another worker's fetch (the real engine on H2, devkit
    /// `engine/contention.rs`).
    pub empty_answers: usize,
    /// A slow engine: `complete` answers this long after it is called (recorded when called).
    pub complete_latency: Duration,
    /// An engine whose `failure` answer comes this long after the failure was applied.
    pub failure_latency: Duration,
    /// A failure's retry timeout runs out at once: the failed task is offered again (its next
    /// attempt) as soon as the failure is applied, before its answer is sent.
    pub reoffer_failed: bool,
}

#[derive(Clone, Default)]
pub struct FakeEngine {
    pub state: Arc<Mutex<FakeState>>,
}

pub fn task(id: &str) -> Task {
    Task {
        id: id.to_string(),
        topic: "abada:agent".into(),
        variables: Map::new(),
        process_instance_id: Some(format!("p-{id}")),
        activity_id: Some("agent".into()),
        retries: Some(3),
        lock_expiration_time: None,
        trace_parent: None,
        attempt: Some(1),
        agent: None,
    }
}

impl FakeEngine {
    pub fn with_tasks(n: usize) -> Self {
        let e = FakeEngine::default();
        for i in 0..n {
            e.push(task(&format!("t-{i:04}")));
        }
        e
    }

    pub fn push(&self, task: Task) {
        self.state.lock().unwrap().open.push_back(task);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().calls.clone()
    }

    pub fn calls_for(&self, task_id: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.task_id.as_deref() == Some(task_id))
            .collect()
    }

    fn record(&self, op: &'static str, task: Option<&TaskRef>, max_tasks: u32) {
        let mut s = self.state.lock().unwrap();
        let outstanding = s.outstanding.len();
        s.calls.push(Call {
            at: Instant::now(),
            op,
            task_id: task.map(|t| t.task_id.clone()),
            attempt: task.and_then(|t| t.attempt),
            max_tasks,
            outstanding,
        });
    }

    /// Waits while the engine is [`FakeState::hung`].
    async fn silent(&self) {
        while self.state.lock().unwrap().hung {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn end(&self, task: &TaskRef) {
        self.state.lock().unwrap().outstanding.remove(&task.task_id);
    }
}

#[async_trait]
impl Engine for FakeEngine {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        self.record("fetch-and-lock", None, request.max_tasks);
        self.silent().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut s = self.state.lock().unwrap();
        if s.fetch_transient {
            return Err(EngineError::Transient {
                op: "fetch-and-lock",
                message: "down".into(),
                request_sent: false,
            });
        }
        let mut out = Vec::new();
        if s.empty_answers > 0 {
            s.empty_answers -= 1;
            return Ok(out);
        }
        let most = (request.max_tasks as usize + s.surplus).min(s.answer_cap.unwrap_or(usize::MAX));
        while out.len() < most {
            let Some(t) = s.open.pop_front() else { break };
            s.outstanding.insert(t.id.clone());
            out.push(t);
        }
        Ok(out)
    }

    async fn heartbeat(&self, task: &TaskRef, _lock: Duration) -> Result<(), EngineError> {
        self.record("heartbeat", Some(task), 0);
        self.silent().await;
        let s = self.state.lock().unwrap();
        if s.refuse_heartbeat.contains(&task.task_id) {
            return Err(EngineError::LeaseLost {
                op: "heartbeat",
                task_id: task.task_id.clone(),
                reason: LeaseLostReason::NotOwned,
            });
        }
        if s.heartbeat_transient {
            return Err(EngineError::Transient {
                op: "heartbeat",
                message: "down".into(),
                request_sent: false,
            });
        }
        Ok(())
    }

    async fn complete(&self, task: &TaskRef, _v: &Map<String, Value>) -> Result<(), EngineError> {
        self.record("complete", Some(task), 0);
        self.silent().await;
        let latency = self.state.lock().unwrap().complete_latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        *self
            .state
            .lock()
            .unwrap()
            .completed
            .entry(task.task_id.clone())
            .or_default() += 1;
        self.end(task);
        Ok(())
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        self.record("failure", Some(task), 0);
        self.silent().await;
        let stall = self.state.lock().unwrap().stall_failures;
        if stall {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let latency = {
            let mut s = self.state.lock().unwrap();
            s.failures.push((task.task_id.clone(), report.clone()));
            s.outstanding.remove(&task.task_id);
            if s.reoffer_failed {
                let mut again = self::task(&task.task_id);
                again.attempt = task.attempt.map(|a| a + 1);
                again.retries = Some(report.retries);
                s.open.push_back(again);
            }
            s.failure_latency
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        Ok(())
    }

    async fn bpmn_error(&self, task: &TaskRef, _r: &BpmnErrorReport) -> Result<(), EngineError> {
        self.record("bpmn-error", Some(task), 0);
        self.silent().await;
        self.end(task);
        Ok(())
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        self.record("journal-read", Some(task), 0);
        self.silent().await;
        Ok(Journal::default())
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        _step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        self.record("journal-append", Some(task), 0);
        self.silent().await;
        Ok(AppendOutcome::Created)
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        _server: &str,
    ) -> Result<ToolCredential, EngineError> {
        self.record("tool-credentials", Some(task), 0);
        self.silent().await;
        Ok(ToolCredential {
            token: abada_agent_worker::secret::Secret::new("tok"),
            expires_at: None,
        })
    }

    async fn probe(&self) -> ProbeOutcome {
        let (supported, down) = {
            let s = self.state.lock().unwrap();
            (s.probe_supported, s.fetch_transient)
        };
        if !supported {
            return ProbeOutcome::NotSupported;
        }
        self.record("probe", None, 0);
        if down {
            ProbeOutcome::Unreachable
        } else {
            ProbeOutcome::Reachable
        }
    }
}
