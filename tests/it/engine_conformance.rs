//! One conformance suite for the two engines the worker's core can run against without the real
//! Abada engine: the devkit's HTTP emulator, reached through the production `HttpEngine` client
//! on loopback, and the simulator's in-memory `WorldEngine` (the same state machine, no HTTP,
//! bodies built and answers classified beside the client's). The simulator is only as good as
//! its engine's agreement with the wire: each scenario runs the same calls on both and checks
//! the outcomes one by one, first against what protocol.md says (so a rule both got wrong fails
//! too), then against each other.
//!
//! Where they overlap: fetch-and-lock (partial answers, attempts, variables), heartbeat
//! (ownership, expiry), the journal (append, replayed append, stale attempt, read), complete,
//! failure (retries, retry timeout), bpmn-error, tool credentials. Not here: what only one has
//! (the process API and authentication over HTTP; the world's faults and trace).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value, json};

use abada_agent_worker::devkit::engine::{EngineEmulator, TaskSpec, TaskStatus};
use abada_agent_worker::engine::client::{EngineClientSettings, HttpEngine};
use abada_agent_worker::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, JournalStep,
    Task, TaskRef,
};
use abada_agent_worker::metrics::Metrics;
use abada_sim::world::{FaultPlan, World, WorldEngine, WorldOptions};

const LOCK: Duration = Duration::from_secs(30);

/// What a scenario needs of an engine besides the worker's calls: tasks to fetch, the engine's
/// clock moved, and the task as the engine holds it.
#[async_trait]
trait Stand: Send + Sync {
    fn engine(&self, worker_id: &str) -> Arc<dyn Engine>;
    fn create_task(&self, spec: TaskSpec) -> String;
    async fn advance(&self, by: Duration);
    fn status(&self, task_id: &str) -> (TaskStatus, Option<i32>, Option<Map<String, Value>>);
}

struct Http(EngineEmulator);

#[async_trait]
impl Stand for Http {
    fn engine(&self, worker_id: &str) -> Arc<dyn Engine> {
        let mut settings = EngineClientSettings::new(self.0.base_url(), worker_id);
        settings.request_timeout = Duration::from_secs(5);
        Arc::new(HttpEngine::new(
            reqwest::Client::new(),
            settings,
            None,
            Arc::new(Metrics::new()),
        ))
    }
    fn create_task(&self, spec: TaskSpec) -> String {
        self.0.create_task(spec)
    }
    async fn advance(&self, by: Duration) {
        self.0.advance(by);
    }
    fn status(&self, task_id: &str) -> (TaskStatus, Option<i32>, Option<Map<String, Value>>) {
        let t = self.0.task(task_id).expect("the task exists");
        (t.status, t.retries, t.result_variables)
    }
}

struct InMemory(Arc<World>);

#[async_trait]
impl Stand for InMemory {
    fn engine(&self, worker_id: &str) -> Arc<dyn Engine> {
        Arc::new(WorldEngine::new(self.0.clone(), worker_id))
    }
    fn create_task(&self, spec: TaskSpec) -> String {
        self.0.core().create_task(spec)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::advance(by).await;
    }
    fn status(&self, task_id: &str) -> (TaskStatus, Option<i32>, Option<Map<String, Value>>) {
        let t = self.0.core().task(task_id).expect("the task exists");
        (t.status, t.retries, t.result_variables)
    }
}

/// An outcome as the core acts on it: the error's variant (and lease-lost reason, or status and
/// code), never its message; a fetch's tasks by id, attempt, activity and variables.
fn outcome<T>(result: &Result<T, EngineError>, ok: impl Fn(&T) -> String) -> String {
    match result {
        Ok(v) => format!("ok {}", ok(v)),
        Err(e) => match e {
            EngineError::LeaseLost { reason, .. } => format!("lease-lost {reason}"),
            EngineError::Rejected { status, code, .. } => format!("rejected {status} {code}"),
            EngineError::NotFound { code, .. } => format!("not-found {code}"),
            EngineError::ConcurrentModification { .. } => "concurrent-modification".into(),
            EngineError::IdempotencyConflict { .. } => "idempotency-conflict".into(),
            EngineError::InvalidRequest { .. } => "invalid-request".into(),
            EngineError::Transient { .. } => "transient".into(),
            EngineError::MalformedResponse { detail, .. } => format!("malformed {detail}"),
            other => format!("other {other}"),
        },
    }
}

#[allow(clippy::ptr_arg)] // `outcome` hands it `&Vec<Task>`, the fetch's own type
fn tasks_line(tasks: &Vec<Task>) -> String {
    let mut parts: Vec<String> = tasks
        .iter()
        .map(|t| {
            format!(
                "{}#{} {} {} {}",
                t.id,
                t.attempt.unwrap_or(0),
                t.activity_id.as_deref().unwrap_or("-"),
                t.retries.map(|r| r.to_string()).unwrap_or("-".into()),
                Value::Object(t.variables.clone())
            )
        })
        .collect();
    parts.sort();
    format!("[{}]", parts.join(", "))
}

fn fetch(max_tasks: u32) -> FetchRequest {
    FetchRequest {
        topics: vec!["abada:agent".into()],
        lock_duration: LOCK,
        max_tasks,
    }
}

fn step(seq: u64, text: &str) -> JournalStep {
    JournalStep {
        seq,
        kind: "model".into(),
        state: "finished".into(),
        key: None,
        data: json!({ "text": text }),
    }
}

fn stale(task: &TaskRef) -> TaskRef {
    TaskRef {
        attempt: task.attempt.map(|a| a.saturating_sub(1)),
        ..task.clone()
    }
}

/// The calls of one scenario and what each answered, in order, one line each.
async fn lease_and_journal(stand: &dyn Stand) -> Vec<String> {
    let log = Log::default();
    scenario(stand, log.clone()).await;
    log.lines()
}

/// The lines of a scenario, kept where a scenario that cannot go on (a flawed engine's answer
/// it cannot use) leaves them.
#[derive(Clone, Default)]
struct Log(Arc<std::sync::Mutex<Vec<String>>>);

impl Log {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

async fn scenario(stand: &dyn Stand, log: Log) {
    let w1 = stand.engine("w1");
    let w2 = stand.engine("w2");
    let empty = w1.fetch_and_lock(&fetch(4)).await;
    log.push(format!(
        "fetch on an empty queue: {}",
        outcome(&empty, tasks_line)
    ));
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!("o-1"));
    for _ in 0..3 {
        stand.create_task(TaskSpec {
            variables: variables.clone(),
            ..TaskSpec::default()
        });
    }
    let first = w1.fetch_and_lock(&fetch(2)).await;
    log.push(format!(
        "w1 fetches 2 of 3: {}",
        outcome(&first, tasks_line)
    ));
    let second = w2.fetch_and_lock(&fetch(5)).await;
    log.push(format!(
        "w2 fetches the rest: {}",
        outcome(&second, tasks_line)
    ));
    let mine = first.expect("w1's fetch")[0].task_ref();
    let theirs = second.expect("w2's fetch")[0].task_ref();
    let r = w1.append_journal(&theirs, &step(1, "not yours")).await;
    log.push(format!(
        "w1 appends to w2's task: {}",
        outcome(&r, append_line)
    ));

    let r = w2.heartbeat(&mine, LOCK).await;
    log.push(format!(
        "w2 extends w1's lease: {}",
        outcome(&r, |_| "()".into())
    ));
    let r = w1.heartbeat(&mine, LOCK).await;
    log.push(format!(
        "w1 extends its lease: {}",
        outcome(&r, |_| "()".into())
    ));

    let r = w1.append_journal(&mine, &step(1, "hello")).await;
    log.push(format!("append seq 1: {}", outcome(&r, append_line)));
    let r = w1.append_journal(&mine, &step(1, "hello")).await;
    log.push(format!("the same step again: {}", outcome(&r, append_line)));
    let r = w1.append_journal(&mine, &step(1, "other")).await;
    log.push(format!(
        "seq 1 with another body: {}",
        outcome(&r, append_line)
    ));
    let r = w1.append_journal(&mine, &step(3, "gap")).await;
    log.push(format!("seq 3 after 1: {}", outcome(&r, append_line)));
    let r = w2.append_journal(&mine, &step(2, "not yours")).await;
    log.push(format!(
        "w2 appends to w1's task: {}",
        outcome(&r, append_line)
    ));
    let r = w1.read_journal(&mine).await;
    log.push(format!(
        "read: {}",
        outcome(&r, |j| format!(
            "{:?}",
            j.steps.iter().map(|s| s.seq).collect::<Vec<_>>()
        ))
    ));

    // Past the lease (and past w2's: it renewed nothing), another worker takes attempt 2.
    stand.advance(LOCK + Duration::from_secs(1)).await;
    let r = w1.heartbeat(&mine, LOCK).await;
    log.push(format!(
        "w1 extends an expired lease: {}",
        outcome(&r, |_| "()".into())
    ));
    let again = w2.fetch_and_lock(&fetch(5)).await;
    log.push(format!(
        "w2 fetches after every lease expired: {}",
        outcome(&again, tasks_line)
    ));
    let again = again.expect("w2's second fetch");
    let new = again
        .iter()
        .find(|t| t.id == mine.task_id)
        .expect("w1's task fetched again")
        .task_ref();
    let r = w2.read_journal(&new).await;
    log.push(format!(
        "attempt 2 reads the journal: {}",
        outcome(&r, |j| format!(
            "{:?}",
            j.steps.iter().map(|s| s.seq).collect::<Vec<_>>()
        ))
    ));
    let r = w2.append_journal(&new, &step(1, "hello")).await;
    log.push(format!(
        "attempt 2 appends the step already there: {}",
        outcome(&r, append_line)
    ));
    let r = w1.append_journal(&mine, &step(2, "stale")).await;
    log.push(format!(
        "the old attempt appends: {}",
        outcome(&r, append_line)
    ));
    let r = w2.append_journal(&stale(&new), &step(2, "stale")).await;
    log.push(format!(
        "w2 with the old attempt number appends: {}",
        outcome(&r, append_line)
    ));
    let r = w1.complete(&mine, &Map::new()).await;
    log.push(format!(
        "the old attempt completes: {}",
        outcome(&r, |_| "()".into())
    ));

    let mut result = Map::new();
    result.insert("decision".into(), json!({"refunded": true}));
    let r = w2.complete(&new, &result).await;
    log.push(format!(
        "attempt 2 completes: {}",
        outcome(&r, |_| "()".into())
    ));
    let r = w2.complete(&new, &result).await;
    log.push(format!(
        "a second complete: {}",
        outcome(&r, |_| "()".into())
    ));
    let r = w2.heartbeat(&new, LOCK).await;
    log.push(format!(
        "a heartbeat after the complete: {}",
        outcome(&r, |_| "()".into())
    ));
    log.push(format!("engine holds: {:?}", stand.status(&new.task_id)));

    // The other two tasks: a failure with retries and a timeout, a BPMN error.
    let rest: Vec<TaskRef> = again
        .iter()
        .filter(|t| t.id != mine.task_id)
        .map(Task::task_ref)
        .collect();
    let failing = &rest[0];
    let r = w2
        .failure(
            failing,
            &FailureReport {
                error_message: "the model is down".into(),
                error_details: "HTTP 503".into(),
                retries: 2,
                retry_timeout: Duration::from_secs(10),
            },
        )
        .await;
    log.push(format!(
        "failure, 2 retries left: {}",
        outcome(&r, |_| "()".into())
    ));
    let hidden = w1.fetch_and_lock(&fetch(5)).await;
    log.push(format!(
        "fetch within the retry timeout: {}",
        outcome(&hidden, tasks_line)
    ));
    stand.advance(Duration::from_secs(11)).await;
    let back = w1.fetch_and_lock(&fetch(5)).await;
    log.push(format!(
        "fetch after the retry timeout: {}",
        outcome(&back, tasks_line)
    ));
    let erring = &rest[1];
    let mut vars = Map::new();
    vars.insert("reason".into(), json!("not refundable"));
    let r = w2
        .bpmn_error(
            erring,
            &BpmnErrorReport {
                error_code: "NOT_REFUNDABLE".into(),
                error_message: "the order is older than 90 days".into(),
                variables: vars,
            },
        )
        .await;
    log.push(format!("bpmn-error: {}", outcome(&r, |_| "()".into())));
    log.push(format!("engine holds: {:?}", stand.status(&erring.task_id)));
}

fn append_line(o: &AppendOutcome) -> String {
    format!("{o:?}")
}

/// What protocol.md (A.2, B.2) says each call of [`lease_and_journal`] answers.
fn expected() -> Vec<&'static str> {
    vec![
        "fetch on an empty queue: ok []",
        r#"w1 fetches 2 of 3: ok [t-000001#1 agentTask - {"orderId":"o-1"}, t-000002#1 agentTask - {"orderId":"o-1"}]"#,
        r#"w2 fetches the rest: ok [t-000003#1 agentTask - {"orderId":"o-1"}]"#,
        "w1 appends to w2's task: lease-lost WORKER_LOCK_NOT_OWNED",
        "w2 extends w1's lease: lease-lost WORKER_LOCK_NOT_OWNED",
        "w1 extends its lease: ok ()",
        "append seq 1: ok Created",
        // A.3: the same key and body are answered as the first time (201).
        "the same step again: ok Created",
        "seq 1 with another body: lease-lost JOURNAL_CONFLICT",
        "seq 3 after 1: lease-lost JOURNAL_CONFLICT",
        "w2 appends to w1's task: lease-lost WORKER_LOCK_NOT_OWNED",
        "read: ok [1]",
        "w1 extends an expired lease: lease-lost WORKER_LOCK_EXPIRED",
        r#"w2 fetches after every lease expired: ok [t-000001#2 agentTask - {"orderId":"o-1"}, t-000002#2 agentTask - {"orderId":"o-1"}, t-000003#2 agentTask - {"orderId":"o-1"}]"#,
        "attempt 2 reads the journal: ok [1]",
        // B.2: an identical step under another attempt (another key) is 200.
        "attempt 2 appends the step already there: ok AlreadyPresent",
        // Ownership is checked before the attempt: w1 no longer holds the lock at all.
        "the old attempt appends: lease-lost WORKER_LOCK_NOT_OWNED",
        "w2 with the old attempt number appends: lease-lost STALE_ATTEMPT",
        "the old attempt completes: lease-lost WORKER_LOCK_NOT_OWNED",
        "attempt 2 completes: ok ()",
        // A.2: a complete on a COMPLETED task is 200 and does nothing.
        "a second complete: ok ()",
        "a heartbeat after the complete: lease-lost NOT_LOCKED",
        r#"engine holds: (Completed, None, Some({"decision": Object {"refunded": Bool(true)}}))"#,
        "failure, 2 retries left: ok ()",
        "fetch within the retry timeout: ok []",
        r#"fetch after the retry timeout: ok [t-000002#3 agentTask 2 {"orderId":"o-1"}]"#,
        "bpmn-error: ok ()",
        r#"engine holds: (BpmnError, None, Some({"reason": String("not refundable")}))"#,
    ]
}

fn check(name: &str, got: &[String]) {
    let want = expected();
    for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        assert_eq!(
            g, w,
            "{name}: call {i} answered otherwise than protocol.md says"
        );
    }
    assert_eq!(got.len(), want.len(), "{name}: {got:#?}");
}

#[tokio::test]
async fn the_http_emulator_answers_as_the_protocol_says() {
    let emu = abada_agent_worker::devkit::engine::start(Default::default())
        .await
        .expect("the emulator starts on 127.0.0.1");
    let got = lease_and_journal(&Http(emu)).await;
    check("HTTP emulator", &got);
}

#[tokio::test(start_paused = true)]
async fn the_in_memory_engine_answers_as_the_protocol_says() {
    let world = World::new(WorldOptions {
        seed: 1,
        lock_duration: LOCK,
        faults: FaultPlan::default(),
        store_journal: false,
    });
    let got = lease_and_journal(&InMemory(world)).await;
    check("in-memory engine", &got);
}

/// The two side by side: the same calls, the same answers, line for line (the check above
/// pins each to the protocol; this one names the first line where they part).
#[tokio::test]
async fn the_in_memory_engine_and_the_http_emulator_agree_call_for_call() {
    let emu = abada_agent_worker::devkit::engine::start(Default::default())
        .await
        .expect("the emulator starts on 127.0.0.1");
    let over_http = lease_and_journal(&Http(emu)).await;
    // The world's clock is tokio's: a runtime of its own, paused, on this thread.
    let in_memory = std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime")
            .block_on(async {
                let world = World::new(WorldOptions {
                    seed: 1,
                    lock_duration: LOCK,
                    faults: FaultPlan::default(),
                    store_journal: false,
                });
                lease_and_journal(&InMemory(world)).await
            })
    })
    .join()
    .expect("the in-memory run");
    for (i, (h, m)) in over_http.iter().zip(in_memory.iter()).enumerate() {
        assert_eq!(
            h, m,
            "call {i}: the in-memory engine answers otherwise than over HTTP"
        );
    }
    assert_eq!(over_http.len(), in_memory.len());
}

// ---- the suite can fail ---------------------------------------------------------------------

/// A deliberate departure from protocol.md, played on the in-memory engine's answers as an
/// engine stand-in could get a rule wrong (the world's engine itself is the simulator's, left
/// as it is): each is a rule the suite's scenario must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// A.2: any worker's call on a lease accepted (`WORKER_LOCK_NOT_OWNED` never answered).
    OwnerUnchecked,
    /// B.2: a stale attempt's call accepted (`STALE_ATTEMPT` never answered).
    StaleAttemptAccepted,
    /// A.2: an expired lease extended (`WORKER_LOCK_EXPIRED` never answered).
    ExpiredLockExtended,
    /// A.3, B.2: the same journal step sent again is a conflict, not the first answer.
    AppendNotIdempotent,
    /// B.1: a task fetched again keeps its attempt.
    AttemptNotCounted,
    /// A.2: a failure's retry timeout ignored: the task is offered again at once.
    RetryTimeoutIgnored,
    /// A.2: a complete on a completed task refused instead of answered 200.
    SecondCompleteRefused,
    /// A.2: a fetch answered with more tasks than `maxTasks`.
    OverMaxTasks,
}

const FLAWS: [Flaw; 8] = [
    Flaw::OwnerUnchecked,
    Flaw::StaleAttemptAccepted,
    Flaw::ExpiredLockExtended,
    Flaw::AppendNotIdempotent,
    Flaw::AttemptNotCounted,
    Flaw::RetryTimeoutIgnored,
    Flaw::SecondCompleteRefused,
    Flaw::OverMaxTasks,
];

/// The in-memory engine with one flaw.
struct Flawed {
    inner: Arc<dyn Engine>,
    flaw: Flaw,
    /// Journal steps and completes already answered, for the flaws that remember.
    seen: std::sync::Mutex<Vec<String>>,
}

impl Flawed {
    /// A lease-lost refusal the flaw turns into an acceptance.
    fn accepts(&self, e: &EngineError) -> bool {
        use abada_agent_worker::engine::LeaseLostReason as R;
        matches!(
            (self.flaw, e),
            (
                Flaw::OwnerUnchecked,
                EngineError::LeaseLost {
                    reason: R::NotOwned,
                    ..
                }
            ) | (
                Flaw::StaleAttemptAccepted,
                EngineError::LeaseLost {
                    reason: R::StaleAttempt,
                    ..
                }
            ) | (
                Flaw::ExpiredLockExtended,
                EngineError::LeaseLost {
                    reason: R::Expired,
                    ..
                }
            )
        )
    }

    fn first_time(&self, what: String) -> bool {
        let mut seen = self.seen.lock().unwrap();
        if seen.contains(&what) {
            false
        } else {
            seen.push(what);
            true
        }
    }

    fn accepting<T: Default>(&self, r: Result<T, EngineError>) -> Result<T, EngineError> {
        match r {
            Err(e) if self.accepts(&e) => Ok(T::default()),
            other => other,
        }
    }
}

#[async_trait]
impl Engine for Flawed {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        let mut tasks = self.inner.fetch_and_lock(request).await?;
        match self.flaw {
            Flaw::AttemptNotCounted => {
                for t in &mut tasks {
                    t.attempt = Some(1);
                }
            }
            Flaw::OverMaxTasks if !tasks.is_empty() => {
                let more = self
                    .inner
                    .fetch_and_lock(&FetchRequest {
                        max_tasks: 1,
                        ..request.clone()
                    })
                    .await?;
                tasks.extend(more);
            }
            _ => {}
        }
        Ok(tasks)
    }
    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        let r = self.inner.heartbeat(task, lock_duration).await;
        self.accepting(r)
    }
    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        if self.flaw == Flaw::SecondCompleteRefused
            && !self.first_time(format!("complete {}", task.task_id))
        {
            return Err(EngineError::LeaseLost {
                op: "complete",
                task_id: task.task_id.clone(),
                reason: abada_agent_worker::engine::LeaseLostReason::NotLocked,
            });
        }
        let r = self.inner.complete(task, variables).await;
        self.accepting(r)
    }
    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        let mut report = report.clone();
        if self.flaw == Flaw::RetryTimeoutIgnored {
            report.retry_timeout = Duration::ZERO;
        }
        let r = self.inner.failure(task, &report).await;
        self.accepting(r)
    }
    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        let r = self.inner.bpmn_error(task, report).await;
        self.accepting(r)
    }
    async fn read_journal(
        &self,
        task: &TaskRef,
    ) -> Result<abada_agent_worker::engine::Journal, EngineError> {
        self.inner.read_journal(task).await
    }
    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        if self.flaw == Flaw::AppendNotIdempotent
            && !self.first_time(format!(
                "{} {:?} {} {}",
                task.task_id, task.attempt, step.seq, step.data
            ))
        {
            return Err(EngineError::LeaseLost {
                op: "journal-append",
                task_id: task.task_id.clone(),
                reason: abada_agent_worker::engine::LeaseLostReason::JournalConflict,
            });
        }
        match self.inner.append_journal(task, step).await {
            Err(e) if self.accepts(&e) => Ok(AppendOutcome::Created),
            other => other,
        }
    }
    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<abada_agent_worker::engine::ToolCredential, EngineError> {
        self.inner.tool_credential(task, server).await
    }
}

struct FlawedMemory(Arc<World>, Flaw);

#[async_trait]
impl Stand for FlawedMemory {
    fn engine(&self, worker_id: &str) -> Arc<dyn Engine> {
        Arc::new(Flawed {
            inner: Arc::new(WorldEngine::new(self.0.clone(), worker_id)),
            flaw: self.1,
            seen: Default::default(),
        })
    }
    fn create_task(&self, spec: TaskSpec) -> String {
        self.0.core().create_task(spec)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::advance(by).await;
    }
    fn status(&self, task_id: &str) -> (TaskStatus, Option<i32>, Option<Map<String, Value>>) {
        let t = self.0.core().task(task_id).expect("the task exists");
        (t.status, t.retries, t.result_variables)
    }
}

/// The lines of the scenario that answer otherwise than protocol.md says, with `flaw`.
async fn departures(flaw: Flaw) -> Vec<String> {
    let world = World::new(WorldOptions {
        seed: 1,
        lock_duration: LOCK,
        faults: FaultPlan::default(),
        store_journal: false,
    });
    let log = Log::default();
    let played = log.clone();
    let finished = tokio::spawn(async move { scenario(&FlawedMemory(world, flaw), played).await })
        .await
        .is_ok();
    let got = log.lines();
    let want = expected();
    let mut off: Vec<String> = got
        .iter()
        .zip(want.iter())
        .filter(|(g, w)| g != w)
        .map(|(g, _)| g.split(':').next().unwrap_or_default().to_string())
        .collect();
    if !finished || got.len() != want.len() {
        off.push(format!("{} lines instead of {}", got.len(), want.len()));
    }
    off
}

/// Each deliberate departure from protocol.md fails the scenario at the calls written for it
/// (the sound engines pass it, above).
#[tokio::test(start_paused = true)]
async fn every_departure_from_the_protocol_fails_the_suite() {
    let expected: [(Flaw, &[&str]); 8] = [
        (
            Flaw::OwnerUnchecked,
            &[
                "w1 appends to w2's task",
                "w2 extends w1's lease",
                "w2 appends to w1's task",
            ],
        ),
        (
            Flaw::StaleAttemptAccepted,
            &["w2 with the old attempt number appends"],
        ),
        (Flaw::ExpiredLockExtended, &["w1 extends an expired lease"]),
        (Flaw::AppendNotIdempotent, &["the same step again"]),
        (
            Flaw::AttemptNotCounted,
            &["w2 fetches after every lease expired"],
        ),
        (
            Flaw::RetryTimeoutIgnored,
            &["fetch within the retry timeout"],
        ),
        (Flaw::SecondCompleteRefused, &["a second complete"]),
        (Flaw::OverMaxTasks, &["w1 fetches 2 of 3"]),
    ];
    assert_eq!(expected.len(), FLAWS.len(), "a flaw without its calls");
    let mut report = Vec::new();
    for (flaw, calls) in expected {
        let off = departures(flaw).await;
        for call in calls {
            assert!(
                off.iter().any(|o| o == call),
                "{flaw:?}: \"{call}\" answered as the protocol says; off: {off:?}"
            );
        }
        report.push(format!("{flaw:?}: {off:?}"));
    }
    eprintln!("{}", report.join("\n"));
}
