//! The load harness behind `examples/loadtest.rs`: hosts the engine emulator, the scripted model
//! and the tool server on loopback, runs the real worker binary (or the floor client) as a child
//! process, reads the child's CPU and memory from `/proc`, and derives every figure from the
//! emulator's call log. `BENCHMARKS.md` documents the commands and the results.
//!
//! Three scenarios:
//! - [`Scenario::Backlog`]: the child starts on an empty queue; after its first fetch the whole
//!   backlog is created at once and the run ends when every task is completed. Throughput, CPU
//!   per task, slot utilisation, refill delay, heartbeat lateness, lease expiries, peak RSS.
//! - [`Scenario::Pickup`]: tasks are created one at a time at random moments while slots are
//!   free; pickup latency is creation to the task's first request (its journal read).
//! - [`Scenario::Idle`]: no tasks; requests per second and RSS of an idle worker.
//!
//! Three knobs model a queue shared with other workers: [`LoadOptions::fetch_answer_cap`] makes
//! the emulator answer at most that many tasks per fetch (the partial answers concurrent fetches
//! get under `FOR UPDATE SKIP LOCKED`), [`LoadOptions::fetch_contention`] makes its fetches
//! contend as the real engine's do (each fetch's transaction holds its row locks for a while; on
//! H2 every candidate row, so a fetch meanwhile answers empty), and [`LoadOptions::workers`]
//! runs a backlog with that many worker processes on the one engine, each with `slots` slots,
//! reporting each worker's slot use (`worker_N_slot_utilisation`) and tasks, their spreads
//! around the mean, the share of the ceiling (all slots over the model latency) and the fetches
//! answered empty.
//!
//! With [`LoadOptions::store`] set, the engine is the plain v1 engine (the emulator's 0.11 mode:
//! no agent/1, no definition on tasks), the agent comes from an agents file and its tool server
//! from a registry file, the worker keeps its journal in that PostgreSQL run store, and a backlog
//! run also reads the worker's `/metrics` at its end: store transaction durations per operation
//! (`store_*` figures), the wait for a pooled connection and the store's errors.
//!
//! The floor client ([`run_floor_client`]) makes, per task, exactly the HTTP requests the worker
//! makes for a one-turn agent task (journal read, two journal appends, one model call, complete)
//! with the same fetch pattern and the same number of slots, and nothing else: its CPU per task
//! is the physical floor of the protocol on this machine.
//!
//! Timestamps of engine calls are the emulator's (millisecond resolution, taken on arrival,
//! before any injected latency). Nothing here asserts on time; it only measures.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::engine::{CallRecord, Disposition, Fault, Operation, TaskSpec, TaskStatus};
use super::model::{Script, Turn};
use super::stack::{ORDERS_SERVER, Stack};
use super::tools::{StaticTokens, ToolServer, ToolServerOptions};

/// The scripted model every benchmark task calls.
pub const BENCH_MODEL: &str = "bench";

/// What a run does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scenario {
    Backlog,
    Pickup,
    Idle { duration: Duration },
}

/// Which program runs as the child.
#[derive(Clone, Debug)]
pub enum ChildProgram {
    /// The worker binary at this path.
    Worker(PathBuf),
    /// `program args.. --floor-client <flags>`: a program that calls [`run_floor_client`].
    Floor { program: PathBuf, args: Vec<String> },
}

/// The knobs of one run.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub scenario: Scenario,
    pub slots: u32,
    pub tasks: u32,
    /// Waited by the scripted model before every answer.
    pub model_latency: Duration,
    /// Tool-call turns before the final answer (each calls `echo` on the devkit tool server).
    pub tool_calls: u32,
    /// Added by the emulator to every engine request.
    pub engine_latency: Duration,
    pub lock_duration: Duration,
    pub poll_interval: Duration,
    /// Size of the text each tool call sends and gets back, so conversations have a realistic
    /// weight.
    pub payload_bytes: usize,
    /// Waited by the tool server before every tool call's answer.
    pub tool_latency: Duration,
    /// Runs the worker on a plain v1 engine with its journal in this run store.
    pub store: Option<StoreTarget>,
    /// The most tasks the engine answers per fetch, whatever was asked (`None`: as asked).
    pub fetch_answer_cap: Option<std::num::NonZeroU32>,
    /// How the engine's fetches contend (`None`: each runs alone at its instant).
    pub fetch_contention: Option<super::engine::FetchContention>,
    /// Worker processes sharing the engine (backlog only; 1 to [`MAX_WORKERS`]).
    pub workers: u32,
    /// With several workers: the backlog is there before they start, and they start together
    /// (replicas deployed onto a waiting queue), instead of appearing once each has fetched
    /// from the empty queue (replicas idle when work arrives).
    pub backlog_first: bool,
    /// The model's provider rate limit: stated on every answer, 429 beyond.
    pub rate_limit: Option<super::model::RateLimit>,
}

/// The most worker processes one run starts.
pub const MAX_WORKERS: u32 = 4;

/// The run store a worker under load keeps its journal in.
#[derive(Clone)]
pub struct StoreTarget {
    /// `postgres://` URL; may hold a password, so it is never printed.
    pub url: String,
    /// `ABADA_AGENT_STORE_POOL_SIZE`; `None` keeps the worker's default.
    pub pool_size: Option<u32>,
}

impl std::fmt::Debug for StoreTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTarget")
            .field("url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .finish()
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            scenario: Scenario::Backlog,
            slots: 50,
            tasks: 1000,
            model_latency: Duration::from_millis(100),
            tool_calls: 0,
            engine_latency: Duration::ZERO,
            lock_duration: Duration::from_secs(60),
            poll_interval: Duration::from_millis(1000),
            payload_bytes: 200,
            tool_latency: Duration::ZERO,
            store: None,
            fetch_answer_cap: None,
            fetch_contention: None,
            workers: 1,
            backlog_first: false,
            rate_limit: None,
        }
    }
}

/// Why a run could not be done.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot start the devkit stack: {0}")]
    Stack(#[from] super::stack::StackError),
    #[error("cannot start {program}: {source}; build it first (cargo build --release)")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the child process {0}")]
    Child(String),
    #[error("the floor client supports one-turn tasks only (tool calls 0), got {0}")]
    FloorWithTools(u32),
    #[error("the floor client speaks agent/1 only; a run store needs the worker")]
    FloorWithStore,
    #[error("cannot write the {what} file of a store run: {source}")]
    Files {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the worker's /metrics could not be read: {0}")]
    Metrics(String),
    #[error(
        "{workers} workers asked for: a run starts 1 to {MAX_WORKERS}, the worker binary only, \
         on a backlog without a run store"
    )]
    Workers { workers: u32 },
}

/// One named figure of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub name: &'static str,
    pub unit: &'static str,
    pub value: f64,
}

/// The figures of one run, in the order they were measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures(pub Vec<Figure>);

impl Figures {
    fn put(&mut self, name: &'static str, unit: &'static str, value: f64) {
        self.0.push(Figure { name, unit, value });
    }

    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.iter().find(|f| f.name == name).map(|f| f.value)
    }

    /// Per figure, the median over `runs` (figures missing from a run are left out of it).
    pub fn median(runs: &[Figures]) -> Figures {
        let mut out = Figures::default();
        let Some(first) = runs.first() else {
            return out;
        };
        for f in &first.0 {
            let mut values: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.get(f.name))
                .filter(|v| v.is_finite())
                .collect();
            values.sort_by(f64::total_cmp);
            let value = match values.len() {
                0 => f64::NAN,
                n if n % 2 == 1 => values[n / 2],
                n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
            };
            out.put(f.name, f.unit, value);
        }
        out
    }

    /// A Markdown table: figure, unit, value.
    pub fn table(&self) -> String {
        let mut s = String::from("| figure | value | unit |\n| --- | ---: | --- |\n");
        for f in &self.0 {
            s.push_str(&format!(
                "| {} | {} | {} |\n",
                f.name,
                fmt_value(f.value),
                f.unit
            ));
        }
        s
    }
}

fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// The model's script: `tool_calls` calls of `echo`, then one final text turn.
pub fn bench_script(opts: &LoadOptions) -> Script {
    let payload = "x".repeat(opts.payload_bytes);
    let mut turns: Vec<Turn> = (0..opts.tool_calls)
        .map(|_| Turn::call("echo", json!({"text": payload})))
        .collect();
    turns.push(Turn::text(r#"{"decision": "done", "input": "${input}"}"#));
    Script::new(turns)
        .with_latency(opts.model_latency)
        .with_usage(120, 30)
}

/// The agent definition every benchmark task carries.
pub fn bench_agent(stack: &Stack, opts: &LoadOptions) -> Value {
    let mut agent = json!({
        "name": "bench-agent",
        "model": format!("openai/{BENCH_MODEL}"),
        "instructions": "You answer benchmark requests with JSON.",
        "input": "${orderId}",
        "maxTurns": opts.tool_calls + 2,
        "resultVariable": "agentResult"
    });
    if opts.tool_calls > 0 {
        agent["toolServers"] = json!([{"name": ORDERS_SERVER, "url": stack.tools.url()}]);
    }
    agent
}

/// Linux clock ticks per second, for `/proc/<pid>/stat`.
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// User plus system CPU seconds of `pid` so far.
pub fn cpu_seconds(pid: u32, ticks: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / ticks)
}

/// A `kB` line of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in MB.
pub fn status_mb(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kb: f64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb / 1024.0)
    })
}

/// A child process that is terminated (then killed) when dropped.
struct ChildGuard {
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then up to `grace` for the exit, then SIGKILL.
    fn stop(&mut self, grace: Duration) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Lines of the child's output at WARN or ERROR level.
    fn problem_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"WARN\"") || l.contains("\"ERROR\"") || l.contains("panicked"))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::env::var_os("ABADA_LOADTEST_KEEP_LOG").is_none() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

fn spawn_child(
    which: &ChildProgram,
    stack: &Stack,
    opts: &LoadOptions,
    files: Option<&StoreFiles>,
    worker_id: &str,
) -> Result<ChildGuard, LoadError> {
    let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
    let log = std::env::temp_dir().join(format!("abada-loadtest-{}-{n}.log", std::process::id()));
    let out =
        std::fs::File::create(&log).map_err(|e| LoadError::Child(format!("log file: {e}")))?;
    let err = out
        .try_clone()
        .map_err(|e| LoadError::Child(format!("log file: {e}")))?;
    let mut cmd = match which {
        ChildProgram::Worker(bin) => {
            let mut cmd = Command::new(bin);
            cmd.env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("ABADA_AGENT_ENGINE_URL", stack.engine.base_url())
                .env("ABADA_AGENT_WORKER_ID", worker_id)
                .env("ABADA_AGENT_PROVIDERS", "openai")
                .env(
                    "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL",
                    stack.model.base_url_openai(),
                )
                .env("ABADA_AGENT_MAX_TASKS", opts.slots.to_string())
                .env(
                    "ABADA_AGENT_POLL_INTERVAL_MS",
                    opts.poll_interval.as_millis().to_string(),
                )
                .env(
                    "ABADA_AGENT_LOCK_DURATION_MS",
                    opts.lock_duration.as_millis().to_string(),
                )
                .env("ABADA_AGENT_HTTP_ADDR", "127.0.0.1:0")
                .env("ABADA_AGENT_LOG_FORMAT", "json")
                // The admin endpoints' address (an info line) is how a store run finds /metrics.
                .env("RUST_LOG", "warn,abada_agent_worker::app=info");
            if let (Some(store), Some(files)) = (&opts.store, files) {
                cmd.env("ABADA_AGENT_STORE_URL", &store.url)
                    .env("ABADA_AGENT_AGENTS_FILE", &files.agents)
                    .env("ABADA_AGENT_TOOLS_FILE", &files.tools);
                if let Some(size) = store.pool_size {
                    cmd.env("ABADA_AGENT_STORE_POOL_SIZE", size.to_string());
                }
            }
            cmd
        }
        ChildProgram::Floor { program, args } => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg("--floor-client").args([
                "--engine-url",
                &stack.engine.base_url(),
                "--model-url",
                &stack.model.base_url_openai(),
                "--slots",
                &opts.slots.to_string(),
                "--poll-ms",
                &opts.poll_interval.as_millis().to_string(),
                "--lock-ms",
                &opts.lock_duration.as_millis().to_string(),
            ]);
            cmd
        }
    };
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    let program = match which {
        ChildProgram::Worker(p) => p.display().to_string(),
        ChildProgram::Floor { program, .. } => program.display().to_string(),
    };
    let child = cmd
        .spawn()
        .map_err(|source| LoadError::Spawn { program, source })?;
    Ok(ChildGuard { child, log })
}

fn ms(t: &chrono::DateTime<chrono::Utc>) -> i64 {
    t.timestamp_millis()
}

/// The `p`-th percentile (0..=100, nearest rank) of `values` (sorted here).
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Waits for the child's first fetch (`worker`: the one fetching with that worker id; `None`:
/// anyone).
async fn wait_first_fetch(
    stack: &Stack,
    child: &mut ChildGuard,
    worker: Option<&str>,
) -> Result<(), LoadError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if stack.engine.calls().iter().any(|c| {
            c.operation == Operation::FetchAndLock
                && worker.is_none_or(|w| c.worker_id.as_deref() == Some(w))
        }) {
            return Ok(());
        }
        if let Ok(Some(status)) = child.child.try_wait() {
            return Err(LoadError::Child(format!(
                "exited with {status} before its first fetch: {:?}",
                child.problem_lines()
            )));
        }
        if Instant::now() > deadline {
            return Err(LoadError::Child("made no fetch within 30 s".into()));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Runs one scenario against `which` and returns its figures.
pub async fn run(which: &ChildProgram, opts: &LoadOptions) -> Result<Figures, LoadError> {
    if matches!(which, ChildProgram::Floor { .. }) {
        if opts.tool_calls > 0 {
            return Err(LoadError::FloorWithTools(opts.tool_calls));
        }
        if opts.store.is_some() {
            return Err(LoadError::FloorWithStore);
        }
    }
    let ticks = clock_ticks();
    let protocol = if opts.store.is_some() {
        super::engine::ProtocolLevel::PlainV1
    } else {
        super::engine::ProtocolLevel::AgentV1
    };
    if opts.workers != 1
        && (!(1..=MAX_WORKERS).contains(&opts.workers)
            || opts.scenario != Scenario::Backlog
            || opts.store.is_some()
            || !matches!(which, ChildProgram::Worker(_)))
    {
        return Err(LoadError::Workers {
            workers: opts.workers,
        });
    }
    let stack = Stack::start(protocol).await?;
    stack.engine.set_fetch_answer_cap(opts.fetch_answer_cap);
    stack.engine.set_fetch_contention(opts.fetch_contention);
    stack.model.set_script(BENCH_MODEL, bench_script(opts));
    if let Some(limit) = opts.rate_limit {
        stack.model.set_rate_limit(BENCH_MODEL, limit);
    }
    stack.tools.set_latency(opts.tool_latency);
    // A plain engine issues no tool credential: the store run's tool server takes none, and the
    // worker finds it in its registry.
    let store_tools = match &opts.store {
        None => None,
        Some(_) => {
            let server = ToolServer::start(
                ToolServerOptions::new(ORDERS_SERVER, Arc::new(StaticTokens::default()))
                    .anonymous(),
            )
            .await
            .map_err(super::stack::StackError::from)?;
            server.set_latency(opts.tool_latency);
            Some(server)
        }
    };
    let files = match &store_tools {
        Some(server) => Some(StoreFiles::write(&server.url(), opts)?),
        None => None,
    };
    let result = if opts.workers > 1 {
        shared_backlog(which, opts, &stack, ticks).await
    } else {
        run_on(which, opts, &stack, files.as_ref(), ticks).await
    };
    if let Some(server) = store_tools {
        server.shutdown().await;
    }
    stack.shutdown().await;
    result
}

async fn run_on(
    which: &ChildProgram,
    opts: &LoadOptions,
    stack: &Stack,
    files: Option<&StoreFiles>,
    ticks: f64,
) -> Result<Figures, LoadError> {
    inject_engine_latency(stack, opts);
    let started = Instant::now();
    let mut child = spawn_child(which, stack, opts, files, "bench-worker")?;
    wait_first_fetch(stack, &mut child, None).await?;
    let to_first_fetch = started.elapsed();
    let pid = child.pid();
    let mut figures = Figures::default();
    figures.put(
        "start_to_first_fetch",
        "ms",
        to_first_fetch.as_secs_f64() * 1000.0,
    );
    let mut result = match opts.scenario {
        Scenario::Backlog => backlog(stack, &mut child, opts, ticks, &mut figures).await,
        Scenario::Pickup => pickup(stack, &mut child, opts, &mut figures).await,
        Scenario::Idle { duration } => idle(stack, &mut child, duration, ticks, &mut figures).await,
    };
    if result.is_ok() && opts.store.is_some() {
        result = store_figures(&child, opts, &mut figures).await;
    }
    if result.is_ok() && opts.rate_limit.is_some() {
        rate_limit_figures(stack, &mut figures);
    }
    figures.put(
        "rss_peak",
        "MB",
        status_mb(pid, "VmHWM").unwrap_or(f64::NAN),
    );
    let problems = child.problem_lines();
    child.stop(Duration::from_secs(10));
    figures.put("child_warn_error_lines", "lines", problems.len() as f64);
    for line in problems.iter().take(3) {
        eprintln!("child: {line}");
    }
    result.map(|()| figures)
}

/// How well the worker used the provider's rate limit. The share of the limit used
/// (the calls let through over the most the limit allowed from the first call to the last),
/// 429s as a share of the model requests, tasks deferred (a `failure` reported for a task,
/// which the engine records), and claims given back (tasks locked by a fetch beyond the one
/// lock that completed them).
fn rate_limit_figures(stack: &Stack, figures: &mut Figures) {
    if let Some(u) = stack.model.rate_limit_use(BENCH_MODEL) {
        let requests = (u.admitted + u.refused) as f64;
        figures.put("limit_share_used", "%", u.share_used * 100.0);
        figures.put("model_requests", "req", requests);
        figures.put("model_429", "req", u.refused as f64);
        figures.put(
            "model_429_share",
            "% of requests",
            if requests > 0.0 {
                u.refused as f64 / requests * 100.0
            } else {
                0.0
            },
        );
    }
    let tasks = stack.engine.tasks();
    let deferred = tasks.iter().filter(|t| t.counters.failures > 0).count();
    let failures: u32 = tasks.iter().map(|t| t.counters.failures).sum();
    let claims: u32 = tasks.iter().map(|t| t.counters.acquisitions).sum();
    let completed = tasks
        .iter()
        .filter(|t| t.status == TaskStatus::Completed)
        .count() as u32;
    figures.put("tasks_deferred", "tasks", deferred as f64);
    figures.put("deferrals", "failures", f64::from(failures));
    figures.put(
        "claims_given_back",
        "claims",
        f64::from(claims.saturating_sub(completed)),
    );
}

/// Adds `opts.engine_latency` to every engine request.
fn inject_engine_latency(stack: &Stack, opts: &LoadOptions) {
    if !opts.engine_latency.is_zero() {
        for operation in [
            Operation::FetchAndLock,
            Operation::Heartbeat,
            Operation::ExtendLock,
            Operation::Complete,
            Operation::Failure,
            Operation::BpmnError,
            Operation::JournalRead,
            Operation::JournalAppend,
            Operation::ToolCredentials,
        ] {
            stack.engine.inject(Fault::Latency {
                operation,
                delay_ms: opts.engine_latency.as_millis() as u64,
            });
        }
    }
}

/// The agents and registry files of a store run, deleted when dropped.
struct StoreFiles {
    dir: PathBuf,
    agents: PathBuf,
    tools: PathBuf,
}

impl StoreFiles {
    /// The benchmark agent (as [`bench_agent`] sends it on agent/1) for the task topic, and the
    /// tool server at `tools_url` registered without a credential.
    fn write(tools_url: &str, opts: &LoadOptions) -> Result<StoreFiles, LoadError> {
        let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("abada-loadtest-store-{}-{n}", std::process::id()));
        let files = StoreFiles {
            agents: dir.join("agents.toml"),
            tools: dir.join("tools.toml"),
            dir,
        };
        let io = |what| move |source| LoadError::Files { what, source };
        std::fs::create_dir_all(&files.dir).map_err(io("directory"))?;
        let servers = if opts.tool_calls > 0 {
            format!("toolServers = [\"{ORDERS_SERVER}\"]\n")
        } else {
            String::new()
        };
        std::fs::write(
            &files.agents,
            format!(
                "[agents.\"{TOPIC}\"]\nname = \"bench-agent\"\nmodel = \"openai/{BENCH_MODEL}\"\n\
                 instructions = \"You answer benchmark requests with JSON.\"\ninput = \"${{orderId}}\"\n\
                 maxTurns = {}\nresultVariable = \"agentResult\"\n{servers}",
                opts.tool_calls + 2
            ),
        )
        .map_err(io("agents"))?;
        std::fs::write(
            &files.tools,
            format!("[servers.{ORDERS_SERVER}]\nurl = \"{tools_url}\"\nauth = \"none\"\n"),
        )
        .map_err(io("tool registry"))?;
        Ok(files)
    }
}

impl Drop for StoreFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The store's own figures from the worker's `/metrics`, read at the end of the run: per
/// operation the transaction count and duration (p50 and p99 interpolated within the
/// histogram's factor-2 buckets, as Prometheus' `histogram_quantile` does; the mean exact),
/// transactions per task, the wait for a pooled connection, and the store's errors.
async fn store_figures(
    child: &ChildGuard,
    opts: &LoadOptions,
    figures: &mut Figures,
) -> Result<(), LoadError> {
    let addr = std::fs::read_to_string(&child.log)
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let rest = l.split_once("\"admin_addr\":\"")?.1;
            Some(rest.split_once('"')?.0.to_string())
        })
        .ok_or_else(|| LoadError::Metrics("the worker logged no admin_addr".into()))?;
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .map_err(|e| LoadError::Metrics(e.to_string()))?
        .text()
        .await
        .map_err(|e| LoadError::Metrics(e.to_string()))?;
    let name = "abada_agent_store_transaction_duration_seconds";
    let ms = |v: f64| v * 1000.0;
    let mut transactions = 0.0;
    for (op, [count, p50, p99, mean]) in [
        (
            "claim",
            [
                "store_claim_count",
                "store_claim_p50",
                "store_claim_p99",
                "store_claim_mean",
            ],
        ),
        (
            "append",
            [
                "store_append_count",
                "store_append_p50",
                "store_append_p99",
                "store_append_mean",
            ],
        ),
        (
            "finish",
            [
                "store_finish_count",
                "store_finish_p50",
                "store_finish_p99",
                "store_finish_mean",
            ],
        ),
    ] {
        let h = Histogram::parse(&text, name, &format!("operation=\"{op}\""));
        transactions += h.count;
        figures.put(count, "tx", h.count);
        figures.put(p50, "ms", ms(h.quantile(0.50)));
        figures.put(p99, "ms", ms(h.quantile(0.99)));
        figures.put(mean, "ms", ms(h.sum / h.count));
    }
    figures.put(
        "store_tx_per_task",
        "tx",
        transactions / f64::from(opts.tasks.max(1)),
    );
    let wait = Histogram::parse(&text, "abada_agent_store_pool_wait_seconds", "");
    figures.put("store_pool_wait_p50", "ms", ms(wait.quantile(0.50)));
    figures.put("store_pool_wait_p99", "ms", ms(wait.quantile(0.99)));
    let errors: f64 = text
        .lines()
        .filter(|l| l.starts_with("abada_agent_store_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b);
    figures.put("store_errors", "count", errors);
    Ok(())
}

/// One histogram (one label set) of a Prometheus text exposition.
#[derive(Debug, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound, cumulative count), in order; the last bound is `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// The series of `name` whose labels contain `labels` (`""`: the unlabelled one).
    pub fn parse(text: &str, name: &str, labels: &str) -> Histogram {
        let mut h = Histogram::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (metric, set) = match series.split_once('{') {
                Some((m, rest)) => (m, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let others: Vec<&str> = set
                .split(',')
                .filter(|l| !l.is_empty() && !l.starts_with("le="))
                .collect();
            if others.join(",") != labels {
                continue;
            }
            match metric.strip_prefix(name) {
                Some("_bucket") => {
                    let le = set
                        .split(',')
                        .find_map(|l| l.strip_prefix("le=\""))
                        .map(|v| v.trim_end_matches('"'));
                    let bound = match le {
                        Some("+Inf") => f64::INFINITY,
                        Some(v) => v.parse().unwrap_or(f64::NAN),
                        None => continue,
                    };
                    h.buckets.push((bound, value));
                }
                Some("_sum") => h.sum = value,
                Some("_count") => h.count = value,
                _ => {}
            }
        }
        h
    }

    /// The `q` quantile (0..=1), linear within its bucket; the largest finite bound when it
    /// falls in `+Inf`; NaN without observations.
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0.0, |b| b.1);
        if total <= 0.0 {
            return f64::NAN;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank {
                if bound.is_infinite() {
                    return lower.0;
                }
                let width = cumulative - lower.1;
                if width <= 0.0 {
                    return bound;
                }
                return lower.0 + (bound - lower.0) * (rank - lower.1) / width;
            }
            lower = (bound, cumulative);
        }
        lower.0
    }
}

async fn idle(
    stack: &Stack,
    child: &mut ChildGuard,
    duration: Duration,
    ticks: f64,
    figures: &mut Figures,
) -> Result<(), LoadError> {
    let pid = child.pid();
    let cpu0 = cpu_seconds(pid, ticks).unwrap_or(f64::NAN);
    let from = ms(&stack.engine.now());
    tokio::time::sleep(duration).await;
    let to = ms(&stack.engine.now());
    let cpu1 = cpu_seconds(pid, ticks).unwrap_or(f64::NAN);
    let calls = stack.engine.calls();
    let window: Vec<&CallRecord> = calls
        .iter()
        .filter(|c| ms(&c.at) > from && ms(&c.at) <= to)
        .collect();
    let secs = (to - from) as f64 / 1000.0;
    figures.put("idle_requests_per_s", "req/s", window.len() as f64 / secs);
    figures.put("idle_cpu", "% of a core", (cpu1 - cpu0) / secs * 100.0);
    figures.put(
        "rss_idle",
        "MB",
        status_mb(pid, "VmRSS").unwrap_or(f64::NAN),
    );
    Ok(())
}

async fn pickup(
    stack: &Stack,
    child: &mut ChildGuard,
    opts: &LoadOptions,
    figures: &mut Figures,
) -> Result<(), LoadError> {
    let agent = bench_agent(stack, opts);
    let mut created = Vec::new();
    let poll_ms = opts.poll_interval.as_millis() as f64;
    for i in 0..opts.tasks {
        // Poisson arrivals (exponential gaps, mean one poll interval): arrivals then see the poll
        // loop at a uniformly random phase (PASTA), which is what "pickup latency" means.
        let u: f64 = rand::random::<f64>().max(1e-9);
        let gap = (poll_ms * -u.ln()).min(poll_ms * 5.0);
        tokio::time::sleep(Duration::from_secs_f64(gap / 1000.0)).await;
        let id = stack.engine.create_task(task_spec(&agent, i));
        created.push((id, ms(&stack.engine.now())));
    }
    wait_all_done(stack, std::slice::from_mut(child), opts, &created).await?;
    let calls = stack.engine.calls();
    let mut first_call: HashMap<&str, i64> = HashMap::new();
    for c in &calls {
        if let Some(id) = &c.task_id {
            first_call.entry(id.as_str()).or_insert(ms(&c.at));
        }
    }
    let mut latencies: Vec<f64> = created
        .iter()
        .filter_map(|(id, at)| first_call.get(id.as_str()).map(|s| (s - at) as f64))
        .collect();
    figures.put("pickup_p50", "ms", percentile(&mut latencies, 50.0));
    figures.put("pickup_p99", "ms", percentile(&mut latencies, 99.0));
    figures.put("pickup_max", "ms", percentile(&mut latencies, 100.0));
    Ok(())
}

fn task_spec(agent: &Value, i: u32) -> TaskSpec {
    let mut variables = serde_json::Map::new();
    variables.insert("orderId".into(), json!(format!("o-{i}")));
    TaskSpec {
        variables,
        agent: Some(agent.clone()),
        ..TaskSpec::default()
    }
}

/// Waits until every created task is completed (or failed), sampling the children's peak RSS
/// (the largest of any one) on the way.
async fn wait_all_done(
    stack: &Stack,
    children: &mut [ChildGuard],
    opts: &LoadOptions,
    created: &[(String, i64)],
) -> Result<f64, LoadError> {
    let expected_model_calls = u64::from(opts.tasks) * u64::from(opts.tool_calls + 1);
    let mut rss_max: f64 = 0.0;
    let mut last_progress = (Instant::now(), 0u64);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        for child in children.iter() {
            if let Some(rss) = status_mb(child.pid(), "VmRSS") {
                rss_max = rss_max.max(rss);
            }
        }
        let model_calls = stack.model.total_calls();
        if model_calls != last_progress.1 {
            last_progress = (Instant::now(), model_calls);
        }
        if model_calls >= expected_model_calls {
            let open = created
                .iter()
                .filter(|(id, _)| {
                    stack.engine.task(id).is_none_or(|t| {
                        !matches!(
                            t.status,
                            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
                        )
                    })
                })
                .count();
            if open == 0 {
                return Ok(rss_max);
            }
        }
        for child in children.iter_mut() {
            if let Ok(Some(status)) = child.child.try_wait() {
                return Err(LoadError::Child(format!(
                    "exited with {status} during the run: {:?}",
                    child.problem_lines()
                )));
            }
        }
        let stall = opts.model_latency * 3 + opts.poll_interval * 3 + Duration::from_secs(30);
        if last_progress.0.elapsed() > stall {
            let problems: Vec<String> = children.iter().flat_map(|c| c.problem_lines()).collect();
            return Err(LoadError::Child(format!(
                "made no progress for {} s ({model_calls} of {expected_model_calls} model calls): {problems:?}",
                stall.as_secs(),
            )));
        }
    }
}

async fn backlog(
    stack: &Stack,
    child: &mut ChildGuard,
    opts: &LoadOptions,
    ticks: f64,
    figures: &mut Figures,
) -> Result<(), LoadError> {
    let pid = child.pid();
    let agent = bench_agent(stack, opts);
    figures.put(
        "rss_before_load",
        "MB",
        status_mb(pid, "VmRSS").unwrap_or(f64::NAN),
    );
    let cpu0 = cpu_seconds(pid, ticks).unwrap_or(f64::NAN);
    let wall0 = Instant::now();
    let ids = stack
        .engine
        .create_tasks((0..opts.tasks).map(|i| task_spec(&agent, i)));
    let created_at = ms(&stack.engine.now());
    let created: Vec<(String, i64)> = ids.into_iter().map(|id| (id, created_at)).collect();
    let rss_max = wait_all_done(stack, std::slice::from_mut(child), opts, &created).await?;
    let cpu1 = cpu_seconds(pid, ticks).unwrap_or(f64::NAN);
    let wall = wall0.elapsed().as_secs_f64();
    let n = f64::from(opts.tasks);
    let calls = stack.engine.calls();
    let a = analyse(&calls, opts);

    figures.put("tasks_per_s", "tasks/s", n / a.span_s);
    figures.put("cpu_per_task", "ms", (cpu1 - cpu0) / n * 1000.0);
    figures.put("cpu_total", "s", cpu1 - cpu0);
    figures.put("cpu_share", "% of a core", (cpu1 - cpu0) / wall * 100.0);
    figures.put("slot_utilisation", "%", a.utilisation * 100.0);
    let mut refill = a.refill;
    figures.put("refill_p50", "ms", percentile(&mut refill, 50.0));
    figures.put("refill_p99", "ms", percentile(&mut refill, 99.0));
    figures.put("refill_max", "ms", percentile(&mut refill, 100.0));
    let mut late = a.heartbeat_lateness;
    figures.put("heartbeats", "count", late.len() as f64);
    figures.put("heartbeat_late_p50", "ms", percentile(&mut late, 50.0));
    figures.put("heartbeat_late_p99", "ms", percentile(&mut late, 99.0));
    figures.put("heartbeat_late_max", "ms", percentile(&mut late, 100.0));
    figures.put("lease_expiries", "count", a.lease_expiries as f64);
    figures.put("requests_per_task", "req", a.requests_per_task);
    figures.put("fetches_per_task", "req", a.fetches as f64 / n);
    figures.put("rss_busy_max", "MB", rss_max);
    Ok(())
}

/// The figure names of each worker's slot use and task count in a shared run.
const WORKER_SLOT_USE: [&str; MAX_WORKERS as usize] = [
    "worker_1_slot_utilisation",
    "worker_2_slot_utilisation",
    "worker_3_slot_utilisation",
    "worker_4_slot_utilisation",
];
const WORKER_TASKS: [&str; MAX_WORKERS as usize] = [
    "worker_1_tasks",
    "worker_2_tasks",
    "worker_3_tasks",
    "worker_4_tasks",
];

/// A backlog shared by `opts.workers` worker processes of `opts.slots` slots each on one
/// engine: each child starts on the empty queue; once all have fetched, the whole backlog is
/// created at once (with [`LoadOptions::backlog_first`], it is there before they all start
/// together) and the run ends when every task is completed. Throughput, CPU per task,
/// slot use overall and per worker over the deep-backlog window, and the largest deviation of
/// a worker's slot use from the mean.
async fn shared_backlog(
    which: &ChildProgram,
    opts: &LoadOptions,
    stack: &Stack,
    ticks: f64,
) -> Result<Figures, LoadError> {
    inject_engine_latency(stack, opts);
    let worker_ids: Vec<String> = (1..=opts.workers)
        .map(|i| format!("bench-worker-{i}"))
        .collect();
    let cpu = |children: &[ChildGuard]| -> f64 {
        children
            .iter()
            .map(|c| cpu_seconds(c.pid(), ticks).unwrap_or(f64::NAN))
            .sum()
    };
    let agent = bench_agent(stack, opts);
    let backlog = || {
        let ids = stack
            .engine
            .create_tasks((0..opts.tasks).map(|i| task_spec(&agent, i)));
        (ids, ms(&stack.engine.now()))
    };
    let mut children = Vec::new();
    let (cpu0, (ids, created_at)) = if opts.backlog_first {
        let created = backlog();
        for id in &worker_ids {
            children.push(spawn_child(which, stack, opts, None, id)?);
        }
        (cpu(&children), created)
    } else {
        for id in &worker_ids {
            let mut child = spawn_child(which, stack, opts, None, id)?;
            wait_first_fetch(stack, &mut child, Some(id)).await?;
            children.push(child);
        }
        (cpu(&children), backlog())
    };
    let created: Vec<(String, i64)> = ids.into_iter().map(|id| (id, created_at)).collect();
    let result = wait_all_done(stack, &mut children, opts, &created).await;
    let cpu1 = cpu(&children);
    let mut problems = 0;
    for child in &mut children {
        let lines = child.problem_lines();
        for line in lines.iter().take(3) {
            eprintln!("child: {line}");
        }
        problems += lines.len();
        child.stop(Duration::from_secs(10));
    }
    let rss_max = result?;
    let n = f64::from(opts.tasks);
    let calls = stack.engine.calls();
    let a = analyse(&calls, opts);
    let shares = slot_use_by_worker(&calls, opts.slots, &worker_ids);

    let mut figures = Figures::default();
    figures.put("tasks_per_s", "tasks/s", n / a.span_s);
    figures.put("cpu_per_task", "ms", (cpu1 - cpu0) / n * 1000.0);
    figures.put("slot_utilisation", "%", shares.overall * 100.0);
    for (i, (u, tasks)) in shares.per_worker.iter().enumerate() {
        figures.put(WORKER_SLOT_USE[i], "%", u * 100.0);
        figures.put(WORKER_TASKS[i], "tasks", *tasks as f64);
    }
    let mean = shares.per_worker.iter().map(|w| w.0).sum::<f64>() / shares.per_worker.len() as f64;
    let spread = shares
        .per_worker
        .iter()
        .map(|w| (w.0 - mean).abs() / mean)
        .fold(0.0, f64::max);
    figures.put("slot_use_max_deviation_from_mean", "%", spread * 100.0);
    let tasks_mean = n / shares.per_worker.len() as f64;
    let tasks_spread = shares
        .per_worker
        .iter()
        .map(|w| (w.1 as f64 - tasks_mean).abs() / tasks_mean)
        .fold(0.0, f64::max);
    figures.put("tasks_max_deviation_from_mean", "%", tasks_spread * 100.0);
    // All slots busy with nothing but the model call: slots x workers per model latency.
    let ceiling = f64::from(opts.slots * opts.workers) / opts.model_latency.as_secs_f64().max(1e-6);
    figures.put("share_of_ceiling", "%", n / a.span_s / ceiling * 100.0);
    figures.put("requests_per_task", "req", a.requests_per_task);
    figures.put("fetches_per_task", "req", a.fetches as f64 / n);
    let (fetches, empty) = fetch_answers(&calls);
    figures.put("fetches", "req", fetches as f64);
    figures.put("fetches_empty", "req", empty as f64);
    figures.put("lease_expiries", "count", a.lease_expiries as f64);
    figures.put("rss_busy_max", "MB", rss_max);
    figures.put("child_warn_error_lines", "lines", problems as f64);
    Ok(figures)
}

/// The fetches the engine ran over the run, and how many of them answered no task.
fn fetch_answers(calls: &[CallRecord]) -> (usize, usize) {
    let ran: Vec<&CallRecord> = calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
        .filter(|c| c.disposition == Disposition::Executed && c.status == 200)
        .collect();
    let empty = ran.iter().filter(|c| c.task_ids.is_empty()).count();
    (ran.len(), empty)
}

/// Slot use of a shared run over its deep-backlog window (first lock to the last lock).
struct SlotShares {
    /// All workers' slots together, over the whole window.
    overall: f64,
    /// Per worker, in the order given: its slot use from its own first lock to the end of the
    /// window, and the tasks it completed.
    per_worker: Vec<(f64, usize)>,
}

/// Each worker's slot use: the time its tasks held a slot (lock to complete, cut at the end of
/// the window) over its part of the window times its `slots`.
fn slot_use_by_worker(calls: &[CallRecord], slots: u32, workers: &[String]) -> SlotShares {
    let executed = |c: &&CallRecord| c.disposition == Disposition::Executed;
    // Task -> (worker, lock time) of its latest acquisition.
    let mut locked: HashMap<&str, (&str, i64)> = HashMap::new();
    for f in calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
        .filter(executed)
    {
        let worker = f.worker_id.as_deref().unwrap_or_default();
        for id in &f.task_ids {
            locked.insert(id.as_str(), (worker, ms(&f.at)));
        }
    }
    let first_lock = locked.values().map(|l| l.1).min().unwrap_or(0);
    let last_lock = locked.values().map(|l| l.1).max().unwrap_or(0);
    let window = (last_lock - first_lock) as f64;
    let mut ended: HashMap<&str, i64> = HashMap::new();
    for c in calls
        .iter()
        .filter(|c| c.operation == Operation::Complete)
        .filter(executed)
    {
        if let Some(id) = c.task_id.as_deref() {
            ended.insert(id, ms(&c.at));
        }
    }
    // Per worker: busy slot time, tasks completed, its first lock.
    let mut busy: HashMap<&str, (f64, usize, i64)> = HashMap::new();
    for (id, (worker, from)) in &locked {
        let to = ended.get(id).copied().unwrap_or(last_lock).min(last_lock);
        let entry = busy.entry(worker).or_insert((0.0, 0, *from));
        entry.0 += (to - from).max(0) as f64;
        entry.1 += usize::from(ended.contains_key(id));
        entry.2 = entry.2.min(*from);
    }
    let slots = f64::from(slots);
    let per_worker: Vec<(f64, usize)> = workers
        .iter()
        .map(|w| match busy.get(w.as_str()) {
            // From the worker's own first lock: workers started one after another, each
            // waiting out its poll interval on the empty queue, do not join at the same
            // instant, and that start is not what their sharing is about.
            // A worker whose first lock is the run's last has an empty window: no measured use
            // (not 0/0), as in a small run where one worker took the whole queue first.
            Some(&(b, tasks, first)) => (share(b, (last_lock - first) as f64 * slots), tasks),
            None => (0.0, 0),
        })
        .collect();
    let total: f64 = busy.values().map(|b| b.0).sum();
    SlotShares {
        overall: share(total, window * slots * workers.len() as f64),
        per_worker,
    }
}

/// `busy` over `capacity`, 0 when there was no capacity to use (an empty window).
fn share(busy: f64, capacity: f64) -> f64 {
    if capacity > 0.0 { busy / capacity } else { 0.0 }
}

/// What the call log of a backlog run says.
struct Analysis {
    /// First lock to last complete, seconds.
    span_s: f64,
    utilisation: f64,
    refill: Vec<f64>,
    heartbeat_lateness: Vec<f64>,
    lease_expiries: usize,
    requests_per_task: f64,
    fetches: usize,
}

fn analyse(calls: &[CallRecord], opts: &LoadOptions) -> Analysis {
    let executed = |c: &CallRecord| c.disposition == Disposition::Executed;
    let fetches: Vec<&CallRecord> = calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
        .collect();
    // Task -> lock time (the fetch that returned it; the latest one if taken again).
    let mut locked: HashMap<&str, i64> = HashMap::new();
    let mut acquisitions: HashMap<&str, u32> = HashMap::new();
    for f in fetches.iter().filter(|c| executed(c)) {
        for id in &f.task_ids {
            locked.insert(id.as_str(), ms(&f.at));
            *acquisitions.entry(id.as_str()).or_default() += 1;
        }
    }
    let completes: Vec<&CallRecord> = calls
        .iter()
        .filter(|c| c.operation == Operation::Complete && executed(c))
        .collect();
    let first_lock = locked.values().copied().min().unwrap_or(0);
    let last_lock = locked.values().copied().max().unwrap_or(0);
    let last_complete = completes.iter().map(|c| ms(&c.at)).max().unwrap_or(0);

    // Slot utilisation over the deep-backlog window: first lock to the fetch that emptied it.
    let window = (last_lock - first_lock) as f64;
    let mut busy = 0.0;
    for c in &completes {
        let Some(id) = c.task_id.as_deref() else {
            continue;
        };
        let Some(&from) = locked.get(id) else {
            continue;
        };
        let to = ms(&c.at).min(last_lock);
        if to > from {
            busy += (to - from) as f64;
        }
    }
    // Tasks still running at the end of the window count up to it.
    let completed: std::collections::HashSet<&str> = completes
        .iter()
        .filter_map(|c| c.task_id.as_deref())
        .collect();
    for (id, &from) in &locked {
        if !completed.contains(id) && last_lock > from {
            busy += (last_lock - from) as f64;
        }
    }
    let utilisation = if window > 0.0 {
        busy / (window * f64::from(opts.slots))
    } else {
        f64::NAN
    };

    // Refill delay: each complete inside the window to the next fetch request.
    let fetch_times: Vec<i64> = fetches.iter().map(|f| ms(&f.at)).collect();
    let refill = completes
        .iter()
        .map(|c| ms(&c.at))
        .filter(|&t| t < last_lock)
        .filter_map(|t| {
            let i = fetch_times.partition_point(|&f| f < t);
            fetch_times.get(i).map(|&f| (f - t) as f64)
        })
        .collect();

    // Heartbeat lateness: k-th extension of a lease is due at lock + k * L/3.
    let period = opts.lock_duration.as_millis() as f64 / 3.0;
    let mut seen: HashMap<&str, u32> = HashMap::new();
    let mut heartbeat_lateness = Vec::new();
    for c in calls
        .iter()
        .filter(|c| matches!(c.operation, Operation::Heartbeat | Operation::ExtendLock))
    {
        let Some(id) = c.task_id.as_deref() else {
            continue;
        };
        let Some(&lock) = locked.get(id) else {
            continue;
        };
        let k = seen.entry(id).or_default();
        *k += 1;
        let due = lock as f64 + f64::from(*k) * period;
        heartbeat_lateness.push(ms(&c.at) as f64 - due);
    }

    let expired_refusals = calls
        .iter()
        .filter(|c| c.error_code.as_deref() == Some("WORKER_LOCK_EXPIRED"))
        .count();
    let reacquired = acquisitions.values().filter(|&&n| n > 1).count();
    let per_task = calls.iter().filter(|c| c.task_id.is_some()).count();
    Analysis {
        span_s: (last_complete - first_lock) as f64 / 1000.0,
        utilisation,
        refill,
        heartbeat_lateness,
        lease_expiries: expired_refusals + reacquired,
        requests_per_task: per_task as f64 / f64::from(opts.tasks.max(1)),
        fetches: fetches.len(),
    }
}

// ---- the floor client ----------------------------------------------------------------------

/// The floor client's settings (from its command line).
#[derive(Clone, Debug)]
pub struct FloorOptions {
    pub engine_url: String,
    pub model_url: String,
    pub slots: u32,
    pub poll_interval: Duration,
    pub lock_duration: Duration,
}

const WORKER_ID: &str = "bench-floor";
const TOPIC: &str = "abada:agent";
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The minimal client: the worker's HTTP requests for one-turn tasks and no worker logic. Runs
/// until the process is terminated.
pub async fn run_floor_client(opts: FloorOptions) {
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .expect("a plain loopback HTTP client always builds");
    let base = format!("{}/v1/external-tasks", opts.engine_url);
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.slots as usize));
    let freed = Arc::new(tokio::sync::Notify::new());
    loop {
        let free = slots.available_permits() as u32;
        if free == 0 {
            freed.notified().await;
            continue;
        }
        let Ok(mut batch) = slots.clone().try_acquire_many_owned(free) else {
            continue;
        };
        let body = json!({
            "workerId": WORKER_ID,
            "topics": [TOPIC],
            "lockDuration": opts.lock_duration.as_millis() as u64,
            "maxTasks": free,
        });
        let tasks: Vec<Value> =
            match post(&http, &format!("{base}/fetch-and-lock"), &body, true).await {
                Some(Value::Array(tasks)) => tasks,
                _ => Vec::new(),
            };
        let got = tasks.len();
        for task in tasks {
            let Some(permit) = batch.split(1) else { break };
            let (http, base, model_url, freed) = (
                http.clone(),
                base.clone(),
                opts.model_url.clone(),
                freed.clone(),
            );
            tokio::spawn(async move {
                floor_task(&http, &base, &model_url, &task).await;
                drop(permit);
                freed.notify_one();
            });
        }
        drop(batch);
        // The worker's fetch policy: only an empty answer waits the poll interval, and a
        // freed slot (also one freed while the fetch was out) ends that wait.
        if got == 0 {
            tokio::select! {
                _ = tokio::time::sleep(opts.poll_interval) => {}
                _ = freed.notified() => {}
            }
        }
    }
}

async fn post(http: &reqwest::Client, url: &str, body: &Value, keyed: bool) -> Option<Value> {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .header("X-Abada-Worker-Protocol-Version", "1")
        .header("traceparent", TRACEPARENT)
        .body(body.to_string());
    if keyed {
        req = req.header("Idempotency-Key", uuid::Uuid::new_v4().to_string());
    }
    let resp = req.send().await.ok()?;
    let bytes = resp.bytes().await.ok()?;
    if bytes.is_empty() {
        return Some(Value::Null);
    }
    serde_json::from_slice(&bytes).ok()
}

async fn floor_task(http: &reqwest::Client, base: &str, model_url: &str, task: &Value) {
    let id = task["id"].as_str().unwrap_or_default();
    let attempt = task["attempt"].clone();
    let agent = &task["agent"];
    let instructions = agent["instructions"].as_str().unwrap_or_default();
    let input = task["variables"]["orderId"].as_str().unwrap_or_default();
    let url = |action: &str| format!("{base}/{id}/{action}");
    post(
        http,
        &url("journal/read"),
        &json!({"workerId": WORKER_ID, "attempt": attempt}),
        false,
    )
    .await;
    let step = |seq: u64, kind: &str, data: Value| {
        json!({"workerId": WORKER_ID, "attempt": attempt,
               "step": {"seq": seq, "kind": kind, "state": "finished", "data": data}})
    };
    post(
        http,
        &url("journal"),
        &step(
            1,
            "input",
            json!({"instructions": instructions, "input": input}),
        ),
        true,
    )
    .await;
    let model = agent["model"]
        .as_str()
        .and_then(|m| m.split_once('/'))
        .map_or(BENCH_MODEL, |(_, m)| m);
    let answer = post(
        http,
        &format!("{model_url}/chat/completions"),
        &json!({"model": model, "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": input}]}),
        false,
    )
    .await
    .unwrap_or_default();
    let text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    post(
        http,
        &url("journal"),
        &step(
            2,
            "model",
            json!({"model": model, "message": {"role": "assistant", "content": text},
                   "usage": answer["usage"], "stopReason": "end_turn"}),
        ),
        true,
    )
    .await;
    post(
        http,
        &url("complete"),
        &json!({"workerId": WORKER_ID, "attempt": attempt,
                "variables": {"agentResult": text}}),
        true,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::{CallRecord, Disposition, Histogram, Operation, slot_use_by_worker};

    fn call(at_ms: i64, operation: Operation, worker: &str, tasks: &[&str]) -> CallRecord {
        CallRecord {
            at: chrono::DateTime::from_timestamp_millis(at_ms).unwrap(),
            operation,
            task_id: (operation != Operation::FetchAndLock).then(|| tasks[0].to_string()),
            worker_id: Some(worker.to_string()),
            attempt: Some(1),
            idempotency_key: None,
            traceparent: None,
            status: 200,
            error_code: None,
            error_message: None,
            disposition: Disposition::Executed,
            response_dropped: false,
            task_ids: if operation == Operation::FetchAndLock {
                tasks.iter().map(|t| t.to_string()).collect()
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn slot_use_is_counted_per_worker_over_the_deep_backlog_window() {
        // Window 0..1000 ms, 2 slots each. w1 holds a slot the whole window and another for
        // 500 ms (75 %). w2 joins at 500 ms and holds one slot from then on (50 % of its
        // 500 ms); its last task still runs at the end of the window.
        let calls = [
            call(0, Operation::FetchAndLock, "w1", &["a", "b"]),
            call(500, Operation::Complete, "w1", &["b"]),
            call(500, Operation::FetchAndLock, "w2", &["c"]),
            call(1000, Operation::FetchAndLock, "w2", &["d"]),
            call(1200, Operation::Complete, "w1", &["a"]),
            call(1300, Operation::Complete, "w2", &["c"]),
        ];
        let workers = ["w1".to_string(), "w2".to_string(), "w3".to_string()];
        let shares = slot_use_by_worker(&calls, 2, &workers);
        assert_eq!(shares.per_worker, vec![(0.75, 2), (0.5, 1), (0.0, 0)]);
        // 2000 ms busy of 3 workers x 2 slots x 1000 ms.
        assert!(
            (shares.overall - 1.0 / 3.0).abs() < 1e-9,
            "{}",
            shares.overall
        );
    }

    const TEXT: &str = "\
# HELP abada_agent_store_transaction_duration_seconds x
abada_agent_store_transaction_duration_seconds_sum{operation=\"append\"} 0.012
abada_agent_store_transaction_duration_seconds_count{operation=\"append\"} 10
abada_agent_store_transaction_duration_seconds_bucket{le=\"0.001\",operation=\"append\"} 0
abada_agent_store_transaction_duration_seconds_bucket{operation=\"append\",le=\"0.002\"} 8
abada_agent_store_transaction_duration_seconds_bucket{operation=\"append\",le=\"0.004\"} 10
abada_agent_store_transaction_duration_seconds_bucket{operation=\"append\",le=\"+Inf\"} 10
abada_agent_store_transaction_duration_seconds_bucket{operation=\"claim\",le=\"+Inf\"} 3
abada_agent_store_pool_wait_seconds_bucket{le=\"0.001\"} 4
abada_agent_store_pool_wait_seconds_bucket{le=\"+Inf\"} 5
";

    #[test]
    fn quantiles_interpolate_within_buckets_of_one_label_set() {
        let h = Histogram::parse(
            TEXT,
            "abada_agent_store_transaction_duration_seconds",
            "operation=\"append\"",
        );
        assert_eq!(h.buckets.len(), 4);
        assert_eq!((h.sum, h.count), (0.012, 10.0));
        // Rank 5 of 8 in (1 ms, 2 ms]; rank 9.9 of the last two in (2 ms, 4 ms].
        assert!((h.quantile(0.5) - 0.001625).abs() < 1e-9);
        assert!((h.quantile(0.99) - 0.0039).abs() < 1e-9);
        // Beyond the last finite bound: that bound.
        let wait = Histogram::parse(TEXT, "abada_agent_store_pool_wait_seconds", "");
        assert_eq!(wait.quantile(0.99), 0.001);
        assert!(Histogram::default().quantile(0.5).is_nan());
    }
}
