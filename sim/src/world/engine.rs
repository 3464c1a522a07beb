//! The world's engine as one worker sees it: the [`Engine`] trait on the devkit emulator's state
//! machine ([`EngineCore`](abada_devkit::engine::EngineCore)), in-process. Each call is turned
//! into the body the HTTP client would send, run under the world's faults (held while its worker
//! is frozen, refused during an outage, held unanswered through a hang, slowed, failed, or
//! executed with its answer lost), and a
//! refusal is classified by the HTTP client's own rules (`sim_view::engine_client::classify_answer`), so the
//! worker's core sees exactly the errors it would see over the wire. Every call and answer is
//! recorded in the world's trace.
//!
//! The HTTP client's own retries of a command are not played here (its wire tests hold them):
//! an error reaches the core as it would after those retries ran out.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};

use abada_devkit::engine::{CoreReply, Operation};

use super::World;
use super::trace::{Answer, Event};
use abada_agent_worker::devkit::sim_view::engine_client::{
    OP_PROCESS_DEFINITION, OP_PROCESS_INSTANCE, classify_answer, decode_journal,
    decode_locked_tasks, decode_tool_credential, journal_append_key, journal_append_refusal,
};
use abada_agent_worker::engine::{
    AppendOutcome, BpmnErrorReport, Engine, EngineError, FailureReport, FetchRequest, Journal,
    JournalStep, ProbeOutcome, ProcessDefinition, ProcessInstance, Task, TaskRef, ToolCredential,
};

/// One worker's view of the world's engine.
pub struct WorldEngine {
    world: Arc<World>,
    worker_id: String,
    /// A plain v1 engine sends no `attempt`: the engine's own count of acquisitions at this
    /// worker's latest fetch of each task, so the trace can tell this worker's acquisitions
    /// apart as it does with agent/1 (the trace's only; never sent).
    acquired: std::sync::Mutex<std::collections::BTreeMap<String, u32>>,
}

impl WorldEngine {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldEngine {
            world,
            worker_id: worker_id.into(),
            acquired: Default::default(),
        }
    }

    /// Waits out the freezes of this worker that hold the current instant.
    async fn thaw(&self) {
        self.world.hold(&self.worker_id).await;
    }

    /// One call, and its answer's millisecond on the way back: what the worker does on
    /// learning the answer comes after the instant the world recorded it (the invariants tell
    /// "sent meanwhile" from "sent after learning" by time).
    async fn exchange(
        &self,
        name: &'static str,
        op: Operation,
        task: Option<&TaskRef>,
        body: Value,
    ) -> Result<CoreReply, EngineError> {
        self.exchange_keyed(name, op, task, None, body).await
    }

    /// [`Self::exchange`] with the `Idempotency-Key` the HTTP client would send. Only the
    /// journal append's key is stable across calls (the client's other keys are new per call,
    /// reused by its own retries, which the world does not play): with it, a retried append of
    /// the same step is answered as the first one was, as over HTTP.
    async fn exchange_keyed(
        &self,
        name: &'static str,
        op: Operation,
        task: Option<&TaskRef>,
        key: Option<&str>,
        body: Value,
    ) -> Result<CoreReply, EngineError> {
        self.exchange_timed(name, op, task, key, body)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`Self::exchange_keyed`], with the world's time at which the engine executed the call.
    async fn exchange_timed(
        &self,
        name: &'static str,
        op: Operation,
        task: Option<&TaskRef>,
        key: Option<&str>,
        body: Value,
    ) -> Result<(CoreReply, u64), EngineError> {
        let answer = self.exchange_at_engine(name, op, task, key, body).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        answer
    }

    /// One call: recorded, held while frozen, faulted, executed, recorded again.
    async fn exchange_at_engine(
        &self,
        name: &'static str,
        op: Operation,
        task: Option<&TaskRef>,
        key: Option<&str>,
        body: Value,
    ) -> Result<(CoreReply, u64), EngineError> {
        let task_id = task.map(|t| t.task_id.clone());
        let attempt = task.and_then(|t| t.attempt).or_else(|| {
            let acquired = self.acquired.lock().unwrap_or_else(|e| e.into_inner());
            task_id.as_ref().and_then(|id| acquired.get(id).copied())
        });
        if self.world.faults().killed.contains(&self.worker_id) {
            std::future::pending::<()>().await;
        }
        self.world.record(Event::EngineCall {
            worker: self.worker_id.clone(),
            op: name,
            task: task_id.clone(),
            attempt,
        });
        // On the wire from here: the engine executes the call whatever becomes of the caller
        // (a worker that gives the call up, at its lease's expiry or at shutdown, does not take
        // back a request already sent).
        let sent = tokio::spawn(at_engine(
            self.world.clone(),
            self.worker_id.clone(),
            name,
            op,
            task_id.clone(),
            attempt,
            key.map(str::to_string),
            body,
        ));
        let (reply, executed, late) = match sent.await {
            Ok(result) => result?,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        if let Some(delay) = late {
            // Executed; the answer reaches the worker only now, if it still waits.
            tokio::time::sleep(delay).await;
            self.thaw().await;
            self.world.record(Event::Delivered {
                worker: self.worker_id.clone(),
                op: name,
                task: task_id.clone(),
                attempt,
                executed,
            });
        }
        Ok((reply, executed))
    }

    /// A read of the process API (`GET /v1/processes/...`): recorded, held while frozen,
    /// refused in an outage, held through a hang, then `read` on the engine's state; `None` is
    /// the engine's 404. Not written, so on the wire only while its caller waits.
    async fn read_process<T>(
        &self,
        op: &'static str,
        task: &TaskRef,
        read: impl FnOnce(&abada_devkit::engine::EngineCore) -> Option<T>,
    ) -> Result<T, EngineError> {
        let task_id = Some(task.task_id.clone());
        let attempt = task.attempt.or_else(|| {
            let acquired = self.acquired.lock().unwrap_or_else(|e| e.into_inner());
            acquired.get(&task.task_id).copied()
        });
        if self.world.faults().killed.contains(&self.worker_id) {
            std::future::pending::<()>().await;
        }
        self.world.record(Event::EngineCall {
            worker: self.worker_id.clone(),
            op,
            task: task_id.clone(),
            attempt,
        });
        self.thaw().await;
        let answer = |a: Answer| Event::EngineAnswer {
            worker: self.worker_id.clone(),
            op,
            task: task_id.clone(),
            attempt,
            answer: a,
        };
        let now = self.world.elapsed_ms();
        let (down, hung_until) = {
            let f = self.world.faults();
            (f.engine_down(now), f.engine_hung_until(now))
        };
        let result = if down {
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.world.faults().count("engine outage");
            self.world.record(answer(Answer::Fault("outage")));
            Err(EngineError::Transient {
                op,
                message: "connection refused (simulated outage)".into(),
                request_sent: false,
            })
        } else if let Some(end) = hung_until {
            self.world.faults().count("engine hang");
            tokio::time::sleep(Duration::from_millis(end.saturating_sub(now).max(1))).await;
            self.world.record(answer(Answer::Fault("hang")));
            Err(EngineError::Transient {
                op,
                message: "no answer within the request timeout (simulated hang)".into(),
                request_sent: true,
            })
        } else {
            let found = read(&self.world.core());
            match found {
                Some(value) => {
                    self.world.record(answer(Answer::Ok));
                    Ok(value)
                }
                None => {
                    // As the engine answers (`devkit::engine::process_api`).
                    let code = "RESOURCE_NOT_FOUND";
                    self.world.record(answer(Answer::Refused {
                        status: 404,
                        code: code.into(),
                        message: "not found".into(),
                    }));
                    Err(classify(
                        op,
                        Some(&task.task_id),
                        404,
                        &json!({"code": code, "message": "not found"}),
                    ))
                }
            }
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        result
    }

    /// The tasks of `topics` a fetch could lock now: open, or locked with the lease expired
    /// (another fetch's row locks aside).
    fn waiting(&self, topics: &[String]) -> usize {
        let now = self.world.now_ms();
        self.world
            .core()
            .tasks()
            .iter()
            .filter(|t| topics.contains(&t.topic))
            .filter(|t| match t.status {
                abada_devkit::engine::TaskStatus::Open => true,
                abada_devkit::engine::TaskStatus::Locked => t
                    .lock_expiration_time
                    .is_some_and(|e| e.timestamp_millis() <= now),
                _ => false,
            })
            .count()
    }

    fn owned_body(&self, task: &TaskRef) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("workerId".into(), self.worker_id.clone().into());
        if let Some(a) = task.attempt {
            body.insert("attempt".into(), a.into());
        }
        body
    }
}

/// The engine's side of one call already sent: held while its worker is frozen, faulted,
/// executed, recorded. Its answer: the reply, when the engine executed it, and how long the
/// answer is late on its way back (`None`: on time).
#[allow(clippy::too_many_arguments)]
async fn at_engine(
    world: Arc<World>,
    worker: String,
    name: &'static str,
    op: Operation,
    task_id: Option<String>,
    attempt: Option<u32>,
    key: Option<String>,
    body: Value,
) -> Result<(CoreReply, u64, Option<Duration>), EngineError> {
    world.hold(&worker).await;
    let answer = |a: Answer| Event::EngineAnswer {
        worker: worker.clone(),
        op: name,
        task: task_id.clone(),
        attempt,
        answer: a,
    };
    let transient = |message: &str, request_sent: bool| EngineError::Transient {
        op: name,
        message: message.to_string(),
        request_sent,
    };
    let now = world.elapsed_ms();
    if world.faults().engine_down(now) {
        // A refused connection takes a moment, not nothing: no loop spins at one instant.
        tokio::time::sleep(Duration::from_millis(5)).await;
        world.faults().count("engine outage");
        world.record(answer(Answer::Fault("outage")));
        return Err(transient("connection refused (simulated outage)", false));
    }
    let hung_until = world.faults().engine_hung_until(now);
    if let Some(end) = hung_until {
        // Accepted, never answered: held to the hang's end (or dropped by the worker first).
        world.faults().count("engine hang");
        tokio::time::sleep(Duration::from_millis(end.saturating_sub(now).max(1))).await;
        world.record(answer(Answer::Fault("hang")));
        return Err(transient(
            "no answer within the request timeout (simulated hang)",
            true,
        ));
    }
    let (slow, slow_max, p5xx, p409, lost, refused, late, late_max) = {
        let f = world.faults();
        let p = &f.plan;
        if f.active(now) {
            (
                p.engine_slow,
                p.engine_slow_max,
                p.engine_5xx,
                p.engine_409,
                p.engine_answer_lost,
                p.refused,
                p.engine_answer_late,
                p.engine_late_max,
            )
        } else {
            (0.0, Duration::ZERO, 0.0, 0.0, 0.0, 0.0, 0.0, Duration::ZERO)
        }
    };
    if slow > 0.0 && world.draw() < slow {
        let delay = slow_max.mul_f64(world.draw());
        world.faults().count("engine slow");
        tokio::time::sleep(delay).await;
        world.hold(&worker).await;
    }
    if p5xx > 0.0 && world.draw() < p5xx {
        world.faults().count("engine 5xx");
        world.record(answer(Answer::Fault("5xx")));
        return Err(transient("HTTP 502 (simulated)", true));
    }
    if p409 > 0.0 && op != Operation::FetchAndLock && world.draw() < p409 {
        world.faults().count("engine 409");
        world.record(answer(Answer::Fault("409")));
        return Err(EngineError::ConcurrentModification { op: name });
    }
    let refusable = matches!(
        op,
        Operation::Heartbeat
            | Operation::JournalAppend
            | Operation::JournalRead
            | Operation::Complete
    );
    if refused > 0.0 && refusable && world.draw() < refused {
        world.faults().count("refused");
        world.record(answer(Answer::Fault("refused")));
        let (status, code) = if op == Operation::Heartbeat {
            (403, "WORKER_LOCK_NOT_OWNED")
        } else {
            (409, "STALE_ATTEMPT")
        };
        return Err(classify(
            name,
            task_id.as_deref(),
            status,
            &json!({"code": code, "message": "simulated refusal"}),
        ));
    }
    // SIM-BUG (feature `sim-bugs`, selected at run time): an engine that takes a journal
    // append from any attempt, as if its holder sent it.
    #[cfg(feature = "sim-bugs")]
    let body = match (op, task_id.as_deref(), body) {
        (Operation::JournalAppend, Some(id), mut body)
            if abada_agent_worker::sim_bugs::active(
                abada_agent_worker::sim_bugs::Bug::EngineAcceptsStaleAppend,
            ) =>
        {
            if let Some(view) = world.core().task(id) {
                body["attempt"] = view.attempt.into();
                if let Some(holder) = view.worker_id {
                    body["workerId"] = holder.into();
                }
            }
            body
        }
        (_, _, body) => body,
    };
    let result = world
        .core()
        .call(op, task_id.as_deref(), key.as_deref(), body, world.now_ms());
    match result {
        Ok(reply) => {
            if lost > 0.0 && world.draw() < lost {
                world.faults().count("engine answer lost");
                world.record(answer(Answer::Fault("answer-lost")));
                return Err(transient(
                    "connection reset after the request (simulated)",
                    true,
                ));
            }
            // A repeat that ran nothing: a key the engine saw before, or a journal step
            // already there (answered 200, not 201).
            let repeat = reply.replayed || (op == Operation::JournalAppend && reply.status == 200);
            world.record(answer(if repeat { Answer::Replayed } else { Answer::Ok }));
            let executed = world.elapsed_ms();
            let late = (late > 0.0 && world.draw() < late).then(|| {
                world.faults().count("engine answer late");
                world.record(Event::Late {
                    worker: worker.clone(),
                    op: name,
                    task: task_id.clone(),
                    attempt,
                });
                late_max.mul_f64(world.draw())
            });
            Ok((reply, executed, late))
        }
        Err(refusal) => {
            world.record(answer(Answer::Refused {
                status: refusal.status,
                code: refusal.code.clone(),
                message: refusal.message.clone(),
            }));
            Err(classify(
                name,
                task_id.as_deref(),
                refusal.status,
                &refusal.body(),
            ))
        }
    }
}

/// The typed error the HTTP client would make of this refusal.
fn classify(op: &'static str, task: Option<&str>, status: u16, body: &Value) -> EngineError {
    classify_answer(
        op,
        task,
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        HeaderMap::new(),
        body.to_string().into_bytes(),
    )
}

fn malformed(op: &'static str, detail: String) -> EngineError {
    EngineError::MalformedResponse { op, detail }
}

#[async_trait]
impl Engine for WorldEngine {
    async fn fetch_and_lock(&self, request: &FetchRequest) -> Result<Vec<Task>, EngineError> {
        let op = "fetch-and-lock";
        let body = json!({
            "workerId": self.worker_id,
            "topics": request.topics,
            "lockDuration": request.lock_duration.as_millis() as u64,
            "maxTasks": request.max_tasks,
        });
        let (reply, executed) = self
            .exchange_timed(op, Operation::FetchAndLock, None, None, body)
            .await?;
        // How deep the backlog was when the engine answered; with contention, the answer
        // comes when the fetch's transaction commits.
        let waiting = self.waiting(&request.topics);
        let transaction = self.world.core().fetch_contention().map(|c| c.transaction);
        if let Some(transaction) = transaction {
            tokio::time::sleep(transaction).await;
        }
        let bytes = reply.body.unwrap_or(Value::Null).to_string();
        let (tasks, rejected) =
            decode_locked_tasks(bytes.as_bytes()).map_err(|e| malformed(op, e))?;
        if !rejected.is_empty() {
            return Err(malformed(op, rejected.join("; ")));
        }
        let tasks_seen = tasks
            .iter()
            .map(|t| {
                let attempt = t.attempt.unwrap_or_else(|| {
                    let engine = self.world.core().task(&t.id).map_or(0, |v| v.attempt);
                    self.acquired
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(t.id.clone(), engine);
                    engine
                });
                (t.id.clone(), attempt)
            })
            .collect();
        let got = tasks.len();
        // Stamped when the engine handed the tasks out (the trace is sorted by time): a late
        // answer's tasks were this worker's from then on.
        self.world.trace().push(
            executed,
            Event::Fetched {
                worker: self.worker_id.clone(),
                asked: request.max_tasks,
                tasks: tasks_seen,
            },
        );
        self.world.trace().push(
            executed,
            Event::FetchBacklog {
                worker: self.worker_id.clone(),
                asked: request.max_tasks,
                got,
                waiting,
            },
        );
        Ok(tasks)
    }

    async fn heartbeat(&self, task: &TaskRef, lock_duration: Duration) -> Result<(), EngineError> {
        let mut body = self.owned_body(task);
        body.insert(
            "lockDuration".into(),
            (lock_duration.as_millis() as u64).into(),
        );
        self.exchange("heartbeat", Operation::Heartbeat, Some(task), body.into())
            .await
            .map(|_| ())
    }

    async fn complete(
        &self,
        task: &TaskRef,
        variables: &Map<String, Value>,
    ) -> Result<(), EngineError> {
        let mut body = self.owned_body(task);
        body.insert("variables".into(), Value::Object(variables.clone()));
        self.exchange("complete", Operation::Complete, Some(task), body.into())
            .await
            .map(|_| ())
    }

    async fn failure(&self, task: &TaskRef, report: &FailureReport) -> Result<(), EngineError> {
        let mut body = self.owned_body(task);
        body.insert("errorMessage".into(), report.error_message.clone().into());
        body.insert("errorDetails".into(), report.error_details.clone().into());
        body.insert("retries".into(), report.retries.into());
        body.insert(
            "retryTimeout".into(),
            (report.retry_timeout.as_millis() as u64).into(),
        );
        self.exchange("failure", Operation::Failure, Some(task), body.into())
            .await
            .map(|_| ())
    }

    async fn bpmn_error(
        &self,
        task: &TaskRef,
        report: &BpmnErrorReport,
    ) -> Result<(), EngineError> {
        let mut body = self.owned_body(task);
        body.insert("errorCode".into(), report.error_code.clone().into());
        body.insert("errorMessage".into(), report.error_message.clone().into());
        body.insert("variables".into(), Value::Object(report.variables.clone()));
        self.exchange("bpmn-error", Operation::BpmnError, Some(task), body.into())
            .await
            .map(|_| ())
    }

    async fn read_journal(&self, task: &TaskRef) -> Result<Journal, EngineError> {
        let op = "journal-read";
        let body = self.owned_body(task);
        let reply = self
            .exchange(op, Operation::JournalRead, Some(task), body.into())
            .await?;
        let bytes = reply.body.unwrap_or(Value::Null).to_string();
        decode_journal(bytes.as_bytes()).map_err(|e| malformed(op, e))
    }

    async fn append_journal(
        &self,
        task: &TaskRef,
        step: &JournalStep,
    ) -> Result<AppendOutcome, EngineError> {
        let mut body = self.owned_body(task);
        body.insert(
            "step".into(),
            serde_json::to_value(step).unwrap_or(Value::Null),
        );
        let key = journal_append_key(task, step);
        let reply = self
            .exchange_keyed(
                "journal-append",
                Operation::JournalAppend,
                Some(task),
                Some(&key),
                body.into(),
            )
            .await
            .map_err(|e| journal_append_refusal(task, e))?;
        Ok(if reply.status == 201 {
            AppendOutcome::Created
        } else {
            AppendOutcome::AlreadyPresent
        })
    }

    async fn tool_credential(
        &self,
        task: &TaskRef,
        server: &str,
    ) -> Result<ToolCredential, EngineError> {
        let op = "tool-credentials";
        let mut body = self.owned_body(task);
        body.insert("server".into(), server.into());
        let reply = self
            .exchange(op, Operation::ToolCredentials, Some(task), body.into())
            .await?;
        let body = reply.body.unwrap_or(Value::Null);
        if let Some(token) = body.get("token").and_then(Value::as_str) {
            self.world.secret_issued(
                token.to_string(),
                format!(
                    "the tool credential for {server} issued to {} for task {} attempt {:?}",
                    self.worker_id, task.task_id, task.attempt
                ),
            );
        }
        decode_tool_credential(body.to_string().as_bytes())
            .ok_or_else(|| malformed(op, "a tool credential without a token".into()))
    }

    async fn process_instance(
        &self,
        task: &TaskRef,
        instance_id: &str,
    ) -> Result<ProcessInstance, EngineError> {
        self.read_process(OP_PROCESS_INSTANCE, task, |core| {
            core.process_instance(instance_id)
                .map(|view| ProcessInstance {
                    id: view.id,
                    process_definition_id: view.process_definition_id,
                })
        })
        .await
    }

    async fn process_definition(
        &self,
        task: &TaskRef,
        definition_id: &str,
    ) -> Result<ProcessDefinition, EngineError> {
        self.read_process(OP_PROCESS_DEFINITION, task, |core| {
            core.process_definition(definition_id)
                .map(|view| ProcessDefinition {
                    id: view.id,
                    version: Some(view.version),
                    bpmn_xml: view.bpmn_xml,
                })
        })
        .await
    }

    async fn probe(&self) -> ProbeOutcome {
        let now = self.world.elapsed_ms();
        let hung_until = self.world.faults().engine_hung_until(now);
        if let Some(end) = hung_until {
            tokio::time::sleep(Duration::from_millis(end.saturating_sub(now).max(1))).await;
            return ProbeOutcome::Unreachable;
        }
        if self.world.faults().engine_down(self.world.elapsed_ms()) {
            ProbeOutcome::Unreachable
        } else {
            ProbeOutcome::Reachable
        }
    }
}
