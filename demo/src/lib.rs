//! The `demo` and `dev-engine` subcommands of `abada-agent-worker`: the whole system on loopback
//! with no keys and no services (the devkit engine emulator, the scripted model provider and the
//! MCP tool server in this process, and real workers claiming real leases over HTTP), told as a
//! timeline.
//!
//! Scenarios: `load` (twenty refund tasks, two workers of four slots), `takeover` (a frozen
//! worker's lease expires, another resumes the task from its journal, the first is fenced off),
//! `rate-limit` (fallback model, then a deferral that keeps the task's retries) and `approval`
//! (refunds that wait for a person). Each checks its own invariants; [`DemoReport::passed`] is
//! the verdict. [`run`] serves both the binary and the tests. `takeover --store` tells the
//! takeover on an engine without agent/1, kept durable by the PostgreSQL run store that
//! `ABADA_AGENT_STORE_URL` names; `approval` needs that store too; every other run needs nothing.
//!
//! This crate does not depend on the worker (the worker's binary depends on it, and Cargo forbids
//! the cycle): it starts and reaches its workers through its own port, [`workers::Workers`],
//! which the worker's devkit side implements with real workers and the binary passes in.

mod approval;
mod dev_engine;
mod load;
mod rate_limit;
mod takeover;
mod takeover_store;
mod timeline;
pub mod workers;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use abada_devkit::engine::{TaskSpec, TaskStatus, TaskView};
use abada_devkit::stack::{Stack, StackError};

pub(crate) use dev_engine::{DevEngineArgs, run_dev_engine};
use timeline::Timeline;
pub use timeline::{Event, Output};
use workers::{
    Freeze, FreezeAt, RunningWorker, STORE_ALLOW_INSECURE_VAR, STORE_URL_VAR, StartedWorker,
    TaskOutcome, WorkerEvent, WorkerSpec, Workers,
};

/// Which story the demo tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Load,
    Takeover,
    RateLimit,
    Approval,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Load => "load",
            Scenario::Takeover => "takeover",
            Scenario::RateLimit => "rate-limit",
            Scenario::Approval => "approval",
        }
    }

    pub fn parse(name: &str) -> Option<Scenario> {
        match name {
            "load" => Some(Scenario::Load),
            "takeover" => Some(Scenario::Takeover),
            "rate-limit" => Some(Scenario::RateLimit),
            "approval" => Some(Scenario::Approval),
            _ => None,
        }
    }
}

/// The demo's command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemoArgs {
    pub scenario: Scenario,
    pub output: Output,
    /// `--store` (the takeover on a plain v1 engine with this run store), and always for
    /// `approval` (a conversation waits for a person's decision only in the run store).
    pub store: Option<DemoStore>,
}

/// The run store of `takeover --store`: a `postgres://` URL (it may hold a password, so it is
/// printed redacted only).
#[derive(Clone, PartialEq, Eq)]
pub struct DemoStore {
    url: String,
    redacted: String,
    /// `ABADA_AGENT_STORE_ALLOW_INSECURE=true` in the demo's environment, passed on to its
    /// workers.
    allow_insecure: bool,
}

impl DemoStore {
    /// Checks the URL as the worker would (`ABADA_AGENT_STORE_URL`, with
    /// `ABADA_AGENT_STORE_ALLOW_INSECURE` from the environment).
    pub fn new(url: impl Into<String>, workers: &dyn Workers) -> Result<DemoStore, ArgsError> {
        let url = url.into();
        let allow_insecure = std::env::var(STORE_ALLOW_INSECURE_VAR)
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let redacted = workers
            .check_store_url(&url, allow_insecure)
            .map_err(ArgsError::BadStoreUrl)?;
        Ok(DemoStore {
            redacted,
            url,
            allow_insecure,
        })
    }

    /// The store as a demo worker is given it.
    pub(crate) fn for_worker(&self) -> (String, bool) {
        (self.url.clone(), self.allow_insecure)
    }

    /// The URL with its password replaced.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }
}

impl std::fmt::Debug for DemoStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DemoStore").field(&self.redacted).finish()
    }
}

/// What is wrong with a command line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("unknown scenario {0:?}; choose load, takeover, rate-limit or approval")]
    UnknownScenario(String),
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    #[error("unknown argument {0:?}")]
    Unknown(String),
    #[error("--addr {0:?} is not an address like 127.0.0.1:5601")]
    BadAddr(String),
    #[error(
        "--store keeps the takeover's run in the PostgreSQL that ABADA_AGENT_STORE_URL names, and it is not set; \
         set it to a database the demo may create its tables in (e.g. postgres://user:password@127.0.0.1:5432/abada_demo), \
         or leave --store out: the demo needs no database without it"
    )]
    StoreWithoutUrl,
    #[error("ABADA_AGENT_STORE_URL {0}")]
    BadStoreUrl(String),
    #[error("--store applies to --scenario takeover only, not {0}")]
    StoreScenario(&'static str),
    #[error(
        "--scenario approval keeps each conversation waiting for a person's decision in the PostgreSQL run store that ABADA_AGENT_STORE_URL names, and it is not set; \
         set it to a database the demo may create its tables in (e.g. postgres://user:password@127.0.0.1:5432/abada_demo); \
         the other scenarios need no database"
    )]
    ApprovalWithoutUrl,
}

pub(crate) const DEMO_USAGE: &str = "\
usage: abada-agent-worker demo [--scenario load|takeover|rate-limit|approval] [--store] [--json]

  --scenario   load (default): 20 refund tasks, two workers of 4 slots
               takeover: a frozen worker's lease expires, another resumes from the journal
               rate-limit: fallback model on 429, then a deferral that keeps the retries
               approval: refunds that wait for a person in a user task, approved and refused;
               needs the PostgreSQL run store that ABADA_AGENT_STORE_URL names
  --store      takeover on an engine without agent/1 (0.11), the journal in the PostgreSQL run
               store that ABADA_AGENT_STORE_URL names; the store fences the frozen worker
  --json       one JSON object per event, then a summary object

Exits 0 when every check of the scenario passes, 1 otherwise.";

/// `--flag=value` or `--flag`: the flag and its inline value.
fn split_flag(arg: &str) -> (&str, Option<String>) {
    match arg.split_once('=') {
        Some((f, v)) => (f, Some(v.to_string())),
        None => (arg, None),
    }
}

/// A flag's value: inline (`--flag=value`) or the next argument.
fn flag_value<'a>(
    flag: &'static str,
    inline: Option<String>,
    rest: &mut impl Iterator<Item = &'a String>,
) -> Result<String, ArgsError> {
    inline
        .or_else(|| rest.next().cloned())
        .ok_or(ArgsError::MissingValue(flag))
}

/// Parses the arguments after `demo`. `color` says whether stdout is a terminal; `store_url` is
/// `ABADA_AGENT_STORE_URL`, used with `--store` and `approval` only, and checked by `workers`.
pub(crate) fn parse_demo_args(
    args: &[String],
    color: bool,
    store_url: Option<String>,
    workers: &dyn Workers,
) -> Result<DemoArgs, ArgsError> {
    let mut scenario = Scenario::Load;
    let mut json = false;
    let mut store = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = split_flag(arg);
        match flag {
            "--scenario" => {
                let value = flag_value("--scenario", inline, &mut it)?;
                scenario = Scenario::parse(&value).ok_or(ArgsError::UnknownScenario(value))?;
            }
            "--json" if inline.is_none() => json = true,
            "--store" if inline.is_none() => store = true,
            _ => return Err(ArgsError::Unknown(arg.clone())),
        }
    }
    let output = if json {
        Output::Json
    } else {
        Output::Human { color }
    };
    let store_url = store_url.filter(|u| !u.trim().is_empty());
    if scenario == Scenario::Approval {
        // The approval flow has nowhere to wait without the store: always read.
        let url = store_url.ok_or(ArgsError::ApprovalWithoutUrl)?;
        return Ok(DemoArgs {
            scenario,
            store: Some(DemoStore::new(url, workers)?),
            output,
        });
    }
    let store = match (store, store_url) {
        (false, _) => None,
        (true, _) if scenario != Scenario::Takeover => {
            return Err(ArgsError::StoreScenario(scenario.name()));
        }
        (true, None) => return Err(ArgsError::StoreWithoutUrl),
        (true, Some(url)) => Some(DemoStore::new(url, workers)?),
    };
    Ok(DemoArgs {
        scenario,
        store,
        output,
    })
}

/// One invariant a scenario checks.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    /// What was measured.
    pub detail: String,
}

impl Check {
    fn new(name: &str, passed: bool, detail: impl Into<String>) -> Check {
        Check {
            name: name.to_string(),
            passed,
            detail: detail.into(),
        }
    }
}

/// One worker's row of the summary table.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerSummary {
    pub worker: String,
    /// Tasks this worker locked (attempts started).
    pub claimed: u32,
    /// Tasks it completed (its `complete` accepted).
    pub completed: u32,
    /// Most tasks running at once.
    pub max_running: u32,
    /// Lease extensions the engine accepted.
    pub heartbeats: u32,
    /// Model calls sent (any answer).
    pub model_calls: u64,
    /// Tool calls sent (any result).
    pub tool_calls: u64,
    /// Keyed writes (`issue_refund`) that returned a result to this worker.
    pub keyed_writes: u64,
    /// Fetches that asked for tasks, and what the first one asked for and got.
    pub fetches: u32,
    pub(crate) first_fetch: Option<(u32, usize)>,
    /// Attempts that ended with the lease lost.
    pub leases_lost: u32,
}

/// What a scenario did and whether its checks passed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DemoReport {
    pub scenario: &'static str,
    pub events: Vec<Event>,
    pub workers: Vec<WorkerSummary>,
    pub checks: Vec<Check>,
    /// Scenario facts the checks are made of (also in the JSON summary).
    pub facts: Value,
    pub(crate) wall_seconds: f64,
}

impl DemoReport {
    /// The verdict: every check passed.
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }

    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

/// Why a scenario could not run to its verdict.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("the demo stack could not start: {0}")]
    Stack(#[from] StackError),
    #[error("scenario {scenario}: timed out after {seconds}s waiting for {what}")]
    Timeout {
        scenario: &'static str,
        what: String,
        seconds: u64,
    },
    #[error("the demo could not be set up: {0}")]
    Setup(String),
}

/// Runs one scenario to its verdict with workers started by `workers`, printing its timeline as
/// it goes (per `args.output`).
pub async fn run(workers: &dyn Workers, args: DemoArgs) -> Result<DemoReport, DemoError> {
    let report = match (args.scenario, &args.store) {
        (Scenario::Takeover, Some(store)) => {
            takeover_store::run(workers, args.output, store).await?
        }
        (Scenario::Load, _) => load::run(workers, args.output).await?,
        (Scenario::Takeover, None) => takeover::run(workers, args.output).await?,
        (Scenario::RateLimit, _) => rate_limit::run(workers, args.output).await?,
        (Scenario::Approval, Some(store)) => approval::run(workers, args.output, store).await?,
        (Scenario::Approval, None) => {
            return Err(DemoError::Setup(ArgsError::ApprovalWithoutUrl.to_string()));
        }
    };
    Timeline::print_summary(args.output, &report);
    Ok(report)
}

/// `abada-agent-worker demo ...`: parses, runs with workers started by `workers`, and maps the
/// verdict to the exit code.
pub fn cli_demo(workers: &dyn Workers, args: &[String]) -> ExitCode {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{DEMO_USAGE}");
        return ExitCode::SUCCESS;
    }
    let color = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let store_url = std::env::var(STORE_URL_VAR).ok();
    let args = match parse_demo_args(args, color, store_url, workers) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("abada-agent-worker demo: {e}\n\n{DEMO_USAGE}");
            return ExitCode::from(2);
        }
    };
    init_quiet_logging();
    let Some(runtime) = build_runtime() else {
        return ExitCode::FAILURE;
    };
    match runtime.block_on(run(workers, args)) {
        Ok(report) if report.passed() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("abada-agent-worker demo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `abada-agent-worker dev-engine [--addr HOST:PORT]`.
pub fn cli_dev_engine(args: &[String]) -> ExitCode {
    let args = match DevEngineArgs::parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "abada-agent-worker dev-engine: {e}\n\n{}",
                dev_engine::DEV_ENGINE_USAGE
            );
            return ExitCode::from(2);
        }
    };
    init_quiet_logging();
    let Some(runtime) = build_runtime() else {
        return ExitCode::FAILURE;
    };
    match runtime.block_on(run_dev_engine(args, wait_for_ctrl_c())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("abada-agent-worker dev-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn wait_for_ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        // No signal handling: run until killed.
        std::future::pending::<()>().await;
    }
}

fn build_runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("abada-agent-worker: cannot start the async runtime: {e}");
            None
        }
    }
}

/// No log output unless `RUST_LOG` asks for it (then to stderr, so stdout stays the timeline).
fn init_quiet_logging() {
    if std::env::var_os("RUST_LOG").is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

// ---- shared by the scenarios ----------------------------------------------------------------

/// How long `Crew::stop` waits for a stopped worker's last events.
const FORWARDER_DRAIN: Duration = Duration::from_secs(5);

/// A worker of a scenario: the worker and what its events said.
pub(crate) struct DemoWorker {
    pub name: String,
    pub worker: Box<dyn RunningWorker>,
    pub stats: WorkerSummary,
    pub running: u32,
    /// Each attempt this worker ended: (task, attempt, outcome).
    pub ended: Vec<(String, Option<u32>, TaskOutcome)>,
}

/// The workers of a scenario, their events merged into one channel (per-worker order kept).
pub(crate) struct Crew {
    pub workers: Vec<DemoWorker>,
    tx: mpsc::UnboundedSender<(usize, WorkerEvent)>,
    pub rx: mpsc::UnboundedReceiver<(usize, WorkerEvent)>,
    /// One per worker: passes its events on, and ends once it has passed the last one.
    forwarders: Vec<tokio::task::JoinHandle<()>>,
}

impl Crew {
    pub fn new() -> Crew {
        let (tx, rx) = mpsc::unbounded_channel();
        Crew {
            workers: Vec::new(),
            tx,
            rx,
            forwarders: Vec::new(),
        }
    }

    /// Starts a worker per `spec` (with no freeze) and adds it.
    pub fn start(
        &mut self,
        workers: &dyn Workers,
        stack: &Stack,
        mut spec: WorkerSpec,
    ) -> Result<(), DemoError> {
        spec.freeze = None;
        let name = spec.name.clone();
        let started = workers.start(stack, spec).map_err(DemoError::Setup)?;
        self.add(name, started);
        Ok(())
    }

    /// Starts a worker per `spec`, its engine client behind a freeze armed `at`, and adds it;
    /// returns the freeze's switch.
    pub fn start_freezable(
        &mut self,
        workers: &dyn Workers,
        stack: &Stack,
        mut spec: WorkerSpec,
        at: FreezeAt,
    ) -> Result<Arc<dyn Freeze>, DemoError> {
        spec.freeze = Some(at);
        let name = spec.name.clone();
        let started = workers.start(stack, spec).map_err(DemoError::Setup)?;
        self.add(name.clone(), started).ok_or_else(|| {
            DemoError::Setup(format!(
                "the worker adapter started {name} without the freeze its scenario asked for"
            ))
        })
    }

    /// Adds a started worker.
    fn add(&mut self, name: String, started: StartedWorker) -> Option<Arc<dyn Freeze>> {
        let StartedWorker {
            worker,
            mut events,
            freeze,
        } = started;
        let index = self.workers.len();
        let tx = self.tx.clone();
        self.forwarders.push(tokio::spawn(async move {
            while let Some(e) = events.recv().await {
                if tx.send((index, e)).is_err() {
                    break;
                }
            }
        }));
        self.workers.push(DemoWorker {
            stats: WorkerSummary {
                worker: name.clone(),
                ..WorkerSummary::default()
            },
            name,
            worker,
            running: 0,
            ended: Vec::new(),
        });
        freeze
    }

    /// Updates the worker's counters from one event.
    pub(crate) fn absorb(&mut self, index: usize, event: &WorkerEvent) {
        let w = &mut self.workers[index];
        match event {
            WorkerEvent::Fetched { requested, got } => {
                w.stats.fetches += 1;
                if w.stats.first_fetch.is_none() {
                    w.stats.first_fetch = Some((*requested, *got));
                }
            }
            WorkerEvent::FetchFailed { .. } => {}
            WorkerEvent::TaskStarted { .. } => {
                w.stats.claimed += 1;
                w.running += 1;
                w.stats.max_running = w.stats.max_running.max(w.running);
            }
            // A slot is busy from a task's start until its work is done (its report goes out
            // after the slot is given back).
            WorkerEvent::SlotFreed { .. } => w.running = w.running.saturating_sub(1),
            WorkerEvent::TaskEnded {
                task_id,
                attempt,
                outcome,
            } => {
                match outcome {
                    TaskOutcome::Completed => w.stats.completed += 1,
                    TaskOutcome::LeaseLost => w.stats.leases_lost += 1,
                    _ => {}
                }
                w.ended.push((task_id.clone(), *attempt, *outcome));
            }
            WorkerEvent::LeaseExtended => w.stats.heartbeats += 1,
            WorkerEvent::LeaseLost { .. } => {}
        }
    }

    /// Stops every worker (staged shutdown), drains the remaining events, and fills the model
    /// and tool counters from each worker's metrics.
    pub async fn stop(mut self) -> Vec<DemoWorker> {
        for w in &self.workers {
            w.worker.stop();
        }
        for w in &self.workers {
            while !w.worker.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // A forwarder ends once its worker's event channel has closed, all of it passed on
        // (bounded: the report is made with what came, rather than never).
        for forwarder in self.forwarders.drain(..) {
            let _ = tokio::time::timeout(FORWARDER_DRAIN, forwarder).await;
        }
        while let Ok((i, e)) = self.rx.try_recv() {
            self.absorb(i, &e);
        }
        for w in &mut self.workers {
            let text = w.worker.metrics_text();
            w.stats.model_calls = metric_sum(&text, "abada_agent_model_calls_total", &[]);
            w.stats.tool_calls = metric_sum(&text, "abada_agent_tool_calls_total", &[]);
            w.stats.keyed_writes = metric_sum(
                &text,
                "abada_agent_tool_calls_total",
                &["tool=\"issue_refund\"", "outcome=\"ok\""],
            );
        }
        self.workers
    }
}

/// Sums the samples of a metric whose label set contains every one of `labels`.
pub(crate) fn metric_sum(text: &str, name: &str, labels: &[&str]) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            if !labels.iter().all(|want| rest.contains(want)) {
                return None;
            }
            let value: f64 = rest.rsplit(' ').next()?.parse().ok()?;
            Some(value as u64)
        })
        .sum()
}

/// A refund task for order `order`.
pub(crate) fn refund_task(agent: Value, order: &str) -> TaskSpec {
    let mut variables = serde_json::Map::new();
    variables.insert("orderId".into(), json!(order));
    TaskSpec {
        variables,
        agent: Some(agent),
        retries: Some(3),
        ..TaskSpec::default()
    }
}

pub(crate) fn is_final(view: &TaskView) -> bool {
    matches!(
        view.status,
        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
    )
}

/// Short `kind/state` names of a journal, e.g. `tool/started issue_refund`.
pub(crate) fn journal_names(view: &TaskView) -> Vec<String> {
    view.journal
        .iter()
        .map(|s| {
            let kind = s["kind"].as_str().unwrap_or("?");
            let state = s["state"].as_str().unwrap_or("?");
            match s["data"]["tool"].as_str() {
                Some(tool) => format!("{kind}/{state} {tool}"),
                None => format!("{kind}/{state}"),
            }
        })
        .collect()
}

/// Seconds for a timeout error.
pub(crate) fn timeout_error(scenario: &'static str, what: &str, limit: Duration) -> DemoError {
    DemoError::Timeout {
        scenario,
        what: what.to_string(),
        seconds: limit.as_secs(),
    }
}

/// The counts by model and outcome from a worker's metrics: `(model, outcome) -> calls`.
pub(crate) fn model_calls_by_outcome(metrics_text: &str) -> HashMap<(String, String), u64> {
    let mut out = HashMap::new();
    for line in metrics_text.lines() {
        let Some(rest) = line.strip_prefix("abada_agent_model_calls_total{") else {
            continue;
        };
        let label = |name: &str| -> String {
            let key = format!("{name}=\"");
            rest.split_once(&key)
                .and_then(|(_, v)| v.split_once('"'))
                .map(|(v, _)| v.to_string())
                .unwrap_or_default()
        };
        let value: u64 = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or(0);
        let model = format!("{}/{}", label("provider"), label("model"));
        *out.entry((model, label("outcome"))).or_insert(0) += value;
    }
    out
}

/// Starts the stack with the refund script slowed to `latency` per model turn, so the
/// timeline is readable.
pub(crate) async fn start_stack(latency: Duration) -> Result<Stack, DemoError> {
    let stack = Stack::start(abada_devkit::engine::ProtocolLevel::AgentV1).await?;
    stack.model.set_script(
        abada_devkit::stack::REFUND_MODEL,
        abada_devkit::stack::refund_script().with_latency(latency),
    );
    Ok(stack)
}

/// Prints a worker event in plain words (scenarios with few tasks); empty polls, fetch counts
/// and successful heartbeats are left out.
pub(crate) fn narrate(tl: &mut Timeline, name: &str, event: &WorkerEvent) {
    match event {
        WorkerEvent::TaskStarted { task_id, attempt } => tl.emit(
            name,
            "claimed",
            format!("claims {task_id} (attempt {})", attempt_text(*attempt)),
            json!({"task": task_id, "attempt": attempt}),
        ),
        WorkerEvent::TaskEnded {
            task_id,
            attempt,
            outcome,
        } => {
            let text = match outcome {
                TaskOutcome::Completed => format!("{task_id} completed"),
                TaskOutcome::LeaseLost => {
                    format!("{task_id}: lease lost -> abandons the attempt, reports nothing")
                }
                TaskOutcome::Deferred => {
                    format!("{task_id} deferred: failure with retries unchanged and a retryTimeout")
                }
                other => format!("{task_id} ended: {other}"),
            };
            tl.emit(
                name,
                "task_ended",
                text,
                json!({"task": task_id, "attempt": attempt, "outcome": outcome.as_str()}),
            );
        }
        WorkerEvent::SlotFreed { .. } => {}
        WorkerEvent::FetchFailed { error } => tl.emit(
            name,
            "fetch_failed",
            format!("fetch failed: {error}"),
            json!({"error": error}),
        ),
        WorkerEvent::LeaseLost { reason } => tl.emit(
            name,
            "lease_lost",
            format!("heartbeat: lease lost ({reason})"),
            json!({"reason": reason}),
        ),
        WorkerEvent::Fetched { .. } | WorkerEvent::LeaseExtended => {}
    }
}

pub(crate) fn attempt_text(attempt: Option<u32>) -> String {
    attempt.map_or_else(|| "-".to_string(), |a| a.to_string())
}

/// Narrates worker events until `until` resolves; a timeout after `limit`.
pub(crate) async fn pump<T>(
    tl: &mut Timeline,
    crew: &mut Crew,
    until: impl std::future::Future<Output = T>,
    scenario: &'static str,
    what: &str,
    limit: Duration,
) -> Result<T, DemoError> {
    tokio::pin!(until);
    let deadline = tokio::time::sleep(limit);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            Some((i, event)) = crew.rx.recv() => {
                crew.absorb(i, &event);
                let name = crew.workers[i].name.clone();
                narrate(tl, &name, &event);
            }
            value = &mut until => return Ok(value),
            _ = &mut deadline => return Err(timeout_error(scenario, what, limit)),
        }
    }
}

/// Narrates worker events until `done(crew)` holds.
pub(crate) async fn pump_until(
    tl: &mut Timeline,
    crew: &mut Crew,
    done: impl Fn(&Crew) -> bool,
    scenario: &'static str,
    what: &str,
    limit: Duration,
) -> Result<(), DemoError> {
    let deadline = tokio::time::Instant::now() + limit;
    while !done(crew) {
        // Biased, the workers' events first: the timeline tells them before a timeout.
        tokio::select! {
            biased;
            Some((i, event)) = crew.rx.recv() => {
                crew.absorb(i, &event);
                let name = crew.workers[i].name.clone();
                narrate(tl, &name, &event);
            }
            _ = tokio::time::sleep_until(deadline) => return Err(timeout_error(scenario, what, limit)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use workers::{BoxFuture, StaleProbe};

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// Checks store URLs only: a `postgres://` URL is accepted and redacted to its host, any
    /// other refused (the worker's own check is tested with the worker's adapter).
    struct UrlsOnly;

    impl Workers for UrlsOnly {
        fn start(&self, _: &Stack, spec: WorkerSpec) -> Result<StartedWorker, String> {
            panic!("{} would start: these tests start no worker", spec.name)
        }

        fn check_store_url(&self, url: &str, _allow_insecure: bool) -> Result<String, String> {
            match url.strip_prefix("postgres://") {
                Some(rest) => Ok(format!(
                    "postgres://***@{}",
                    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
                )),
                None => Err("is not a postgres:// URL".into()),
            }
        }

        fn probe_stale_attempt<'a>(&'a self, _: &'a StaleProbe) -> BoxFuture<'a, ()> {
            Box::pin(async {})
        }
    }

    fn parse(list: &[&str], color: bool, store_url: Option<String>) -> Result<DemoArgs, ArgsError> {
        parse_demo_args(&args(list), color, store_url, &UrlsOnly)
    }

    #[test]
    fn the_command_line_is_parsed_by_hand() {
        let a = parse(&[], true, None).unwrap();
        assert_eq!(a.scenario, Scenario::Load);
        assert_eq!(a.output, Output::Human { color: true });
        let a = parse(&["--scenario", "takeover", "--json"], true, None).unwrap();
        assert_eq!(a.scenario, Scenario::Takeover);
        assert_eq!(a.output, Output::Json);
        let a = parse(&["--scenario=rate-limit"], false, None).unwrap();
        assert_eq!(a.scenario, Scenario::RateLimit);
        assert_eq!(
            parse(&["--scenario", "chaos"], false, None),
            Err(ArgsError::UnknownScenario("chaos".into()))
        );
        assert_eq!(
            parse(&["--scenario"], false, None),
            Err(ArgsError::MissingValue("--scenario"))
        );
        assert_eq!(
            parse(&["--fast"], false, None),
            Err(ArgsError::Unknown("--fast".into()))
        );
    }

    #[test]
    fn store_needs_the_takeover_and_a_url_and_never_prints_the_password() {
        let url = Some("postgres://abada:s3cret@127.0.0.1:5432/abada_demo".to_string());
        // Without --store the variable is not even read.
        let a = parse(&["--scenario", "takeover"], false, url.clone()).unwrap();
        assert_eq!(a.store, None);
        let a = parse(&["--scenario", "takeover", "--store"], false, url.clone()).unwrap();
        let store = a.store.unwrap();
        assert_eq!(store.redacted(), "postgres://***@127.0.0.1:5432/abada_demo");
        assert!(!format!("{store:?}").contains("s3cret"));
        assert_eq!(
            parse(&["--scenario", "takeover", "--store"], false, None),
            Err(ArgsError::StoreWithoutUrl)
        );
        assert!(
            ArgsError::StoreWithoutUrl
                .to_string()
                .contains("ABADA_AGENT_STORE_URL")
        );
        assert_eq!(
            parse(&["--store"], false, url.clone()),
            Err(ArgsError::StoreScenario("load"))
        );
        let bad = parse(
            &["--scenario", "takeover", "--store"],
            false,
            Some("mysql://root:s3cret@db/x".into()),
        )
        .unwrap_err();
        assert!(matches!(bad, ArgsError::BadStoreUrl(_)), "{bad}");
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
    }

    #[test]
    fn metric_sums_filter_by_labels() {
        let text = "# HELP x\n\
            abada_agent_tool_calls_total{server=\"orders\",tool=\"issue_refund\",outcome=\"ok\"} 3\n\
            abada_agent_tool_calls_total{server=\"orders\",tool=\"lookup_order\",outcome=\"ok\"} 4\n\
            abada_agent_tool_calls_total_other 9\n";
        assert_eq!(metric_sum(text, "abada_agent_tool_calls_total", &[]), 7);
        assert_eq!(
            metric_sum(
                text,
                "abada_agent_tool_calls_total",
                &["tool=\"issue_refund\""]
            ),
            3
        );
    }
}
