//! The demo's port to the worker: what a scenario asks of the workers it starts, in the demo's
//! own words. The demo crate does not depend on the worker (the worker's binary runs the demo,
//! and Cargo forbids the cycle); the worker's devkit side implements [`Workers`]
//! (`abada_agent_worker::devkit::demo_workers`) with real workers, built by its composition root
//! and claiming real leases over HTTP from a devkit [`Stack`], and the binary hands that
//! adapter to [`crate::run`].
//!
//! The vocabulary mirrors only what the timeline and the verdicts read: a worker's events
//! ([`WorkerEvent`], [`TaskOutcome`]), its metrics as Prometheus text (what `/metrics` would
//! serve), a freeze in front of its engine client ([`FreezeAt`], [`Freeze`]), and the calls a
//! stale attempt could still send ([`StaleProbe`]).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use abada_devkit::stack::Stack;
use serde_json::Value;
use tokio::sync::mpsc;

/// A future the port returns (the port is used as `&dyn Workers`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The worker's variable that names the run store (`--store`, `approval`).
pub const STORE_URL_VAR: &str = "ABADA_AGENT_STORE_URL";
/// The worker's variable that lets the run store be reached without TLS.
pub const STORE_ALLOW_INSECURE_VAR: &str = "ABADA_AGENT_STORE_ALLOW_INSECURE";

/// Starts and reaches the workers of a scenario.
pub trait Workers: Send + Sync {
    /// Starts a worker against `stack` (its engine emulator, the providers `openai` and
    /// `anthropic` served by its scripted model) on the current runtime, with agent settings of
    /// short backoffs; or says what it could not set up (e.g. a file it writes). A worker whose
    /// configuration the worker refuses is a bug of the scenario: the adapter panics.
    fn start(&self, stack: &Stack, spec: WorkerSpec) -> Result<StartedWorker, String>;

    /// Checks a run store URL as the worker would (with `allow_insecure` as
    /// [`STORE_ALLOW_INSECURE_VAR`] says); the URL with its password replaced, or why it is
    /// refused (with no secret in it).
    fn check_store_url(&self, url: &str, allow_insecure: bool) -> Result<String, String>;

    /// Sends, through the worker's own engine client with one try each, the calls `probe`'s
    /// stale attempt could still make: extend, journal append, tool credential, complete. The
    /// answers are not returned; the engine's call log holds them.
    fn probe_stale_attempt<'a>(&'a self, probe: &'a StaleProbe) -> BoxFuture<'a, ()>;
}

/// How a worker is set up.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    pub name: String,
    pub slots: u32,
    pub lease: Duration,
    pub poll_interval: Duration,
    /// The run store's URL and whether it may be reached without TLS.
    pub store: Option<(String, bool)>,
    /// An operator's agents file and tool registry file.
    pub agents_file: Option<PathBuf>,
    pub tools_file: Option<PathBuf>,
    /// The names the worker's metrics may carry as labels (an operator's agents file declares
    /// them; a stack's agents are the engine's). Not with [`WorkerSpec::agents_file`].
    pub label_names: Option<LabelNames>,
    /// Puts the worker's engine client behind a freeze, armed at this point.
    pub freeze: Option<FreezeAt>,
}

impl WorkerSpec {
    /// Lease 10 s, polls every 200 ms, nothing else.
    pub fn new(name: &str, slots: u32) -> WorkerSpec {
        WorkerSpec {
            name: name.to_string(),
            slots,
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(200),
            store: None,
            agents_file: None,
            tools_file: None,
            label_names: None,
            freeze: None,
        }
    }
}

/// An agent, its models (`provider/model`, the first the primary) and tool servers
/// (`(name, url)`), declared as an operator would.
#[derive(Clone, Debug)]
pub struct LabelNames {
    pub agent: String,
    pub models: Vec<String>,
    pub servers: Vec<(String, String)>,
}

/// Where a worker's freeze holds its engine calls by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FreezeAt {
    /// Nowhere: only [`Freeze::freeze`] freezes it.
    Manual,
    /// Before sending a journal append of this kind and state (only keyed steps when
    /// `keyed_only`): the step is not journaled.
    BeforeJournal {
        kind: String,
        state: String,
        keyed_only: bool,
    },
    /// Before sending `complete`.
    BeforeComplete,
}

/// The switch of a worker's freeze: while frozen, every call the worker makes to the engine
/// (heartbeats included) waits before it is sent.
pub trait Freeze: Send + Sync {
    /// Freezes now, for `reason`.
    fn freeze(&self, reason: &str);
    /// Lets every waiting call go on.
    fn thaw(&self);
    /// Waits until frozen (by [`FreezeAt`] or [`Freeze::freeze`]); returns why.
    fn frozen(&self) -> BoxFuture<'_, String>;
}

/// A worker that runs.
pub trait RunningWorker: Send + Sync {
    /// Its metrics in the Prometheus text format.
    fn metrics_text(&self) -> String;
    /// Starts the staged shutdown.
    fn stop(&self);
    /// Whether it has stopped.
    fn is_finished(&self) -> bool;
}

/// What [`Workers::start`] gives back.
pub struct StartedWorker {
    pub worker: Box<dyn RunningWorker>,
    /// Its events in order; closed once it has stopped and every event was sent.
    pub events: mpsc::UnboundedReceiver<WorkerEvent>,
    /// The switch of its freeze, when [`WorkerSpec::freeze`] asked for one.
    pub freeze: Option<Arc<dyn Freeze>>,
}

/// What a worker tells of its work (what the timeline narrates and the summary counts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// A fetch asked for `requested` tasks (the free slots) and got `got`.
    Fetched {
        requested: u32,
        got: usize,
    },
    FetchFailed {
        error: String,
    },
    TaskStarted {
        task_id: String,
        attempt: Option<u32>,
    },
    /// The task's work is done and its slot free; its report is about to be sent.
    SlotFreed {
        task_id: String,
        attempt: Option<u32>,
    },
    TaskEnded {
        task_id: String,
        attempt: Option<u32>,
        outcome: TaskOutcome,
    },
    /// The engine accepted a lease extension.
    LeaseExtended,
    /// The heartbeat found the lease lost, for `reason`.
    LeaseLost {
        reason: String,
    },
}

/// How an attempt ended, as the worker's logs and metrics spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskOutcome {
    Completed,
    BpmnError,
    Failed,
    /// Every model was unavailable: `failure` with retries kept and a retry timeout.
    Deferred,
    Incident,
    Released,
    /// Another worker owns the task; nothing was reported.
    LeaseLost,
    ReportFailed,
}

impl TaskOutcome {
    /// The spelling of the worker's log lines and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskOutcome::Completed => "completed",
            TaskOutcome::BpmnError => "bpmn_error",
            TaskOutcome::Failed => "failed",
            TaskOutcome::Deferred => "deferred",
            TaskOutcome::Incident => "incident",
            TaskOutcome::Released => "released",
            TaskOutcome::LeaseLost => "lease_lost",
            TaskOutcome::ReportFailed => "report_failed",
        }
    }
}

impl std::fmt::Display for TaskOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The calls of a stale attempt, sent as `worker` holding `attempt` of `task_id`.
#[derive(Clone, Debug)]
pub struct StaleProbe {
    /// The engine's base URL (`.../api`).
    pub engine_url: String,
    pub worker: String,
    pub task_id: String,
    pub attempt: Option<u32>,
    /// The extension asked for.
    pub lease: Duration,
    /// The journal step appended.
    pub step: ProbeStep,
    /// The tool server whose credential is asked for.
    pub tool_server: String,
}

/// A journal step as the worker would append it.
#[derive(Clone, Debug)]
pub struct ProbeStep {
    pub seq: u64,
    pub kind: String,
    pub state: String,
    pub key: Option<String>,
    pub data: Value,
}
