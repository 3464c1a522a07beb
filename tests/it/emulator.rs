//! The engine emulator against protocol.md, over real HTTP: every refusal of A.2 and B.2 with its
//! body, idempotency, acquisition and takeover, failure semantics, the journal, tool credentials,
//! each fault kind, protocol levels and the authorizer hook.

use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::devkit::engine::{
    self, AuthRejection, Authorizer, Disposition, EmulatorOptions, EngineEmulator, Fault,
    HeaderMap, Operation, ProtocolLevel, TaskSpec, TaskStatus,
};
use serde_json::{Value, json};

const LEASE_MS: u64 = 60_000;

struct Harness {
    emu: EngineEmulator,
    http: reqwest::Client,
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn harness_with(opts: EmulatorOptions) -> Harness {
    let emu = engine::start(opts).await.expect("emulator starts");
    Harness {
        emu,
        http: reqwest::Client::new(),
    }
}

async fn harness() -> Harness {
    harness_with(EmulatorOptions::default()).await
}

fn agent_task() -> TaskSpec {
    TaskSpec {
        variables: serde_json::from_value(json!({"customerId": "c-17"})).unwrap(),
        agent: Some(json!({"name": "refund-agent", "model": "openai/gpt-4.1-mini"})),
        retries: Some(3),
        trace_parent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
        ..Default::default()
    }
}

impl Harness {
    /// A fetch asking for a lease of 0 ms: a 400, as on the real engine (docs/REAL_ENGINE.md).
    async fn zero_lease_fetch(&self) -> Answer {
        self.call(
            "fetch-and-lock",
            json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": 0}),
        )
        .await
    }

    async fn try_call(
        &self,
        path: &str,
        body: Value,
        key: Option<&str>,
    ) -> reqwest::Result<Answer> {
        let mut request = self
            .http
            .post(format!("{}/v1/external-tasks/{path}", self.emu.base_url()))
            .header("X-Abada-Worker-Protocol-Version", "1")
            .json(&body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await?;
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).expect("JSON body")
        };
        Ok(Answer {
            status,
            headers,
            body,
        })
    }

    async fn call(&self, path: &str, body: Value) -> Answer {
        self.try_call(path, body, None)
            .await
            .expect("request goes through")
    }

    async fn call_keyed(&self, path: &str, body: Value, key: &str) -> Answer {
        self.try_call(path, body, Some(key))
            .await
            .expect("request goes through")
    }

    async fn fetch(&self, worker: &str, max: u32) -> Vec<Value> {
        let answer = self
            .call(
                "fetch-and-lock",
                json!({"workerId": worker, "topics": ["abada:agent"], "lockDuration": LEASE_MS, "maxTasks": max}),
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.body.as_array().cloned().expect("array")
    }

    async fn fetch_one(&self, worker: &str) -> Value {
        let mut tasks = self.fetch(worker, 1).await;
        assert_eq!(tasks.len(), 1, "one task acquired");
        tasks.remove(0)
    }
}

fn ids(tasks: &[Value]) -> Vec<String> {
    tasks
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_string())
        .collect()
}

/// Checks the error envelope and returns its message.
fn assert_error(answer: &Answer, status: u16, code: &str, path_suffix: &str) -> String {
    assert_eq!(answer.status, status, "status of {}", answer.body);
    let body = &answer.body;
    assert_eq!(body["status"], status);
    assert_eq!(body["code"], code, "{body}");
    assert!(
        body["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{body}"
    );
    assert!(
        body["path"]
            .as_str()
            .unwrap()
            .starts_with("/api/v1/external-tasks/")
    );
    assert!(
        body["path"].as_str().unwrap().ends_with(path_suffix),
        "{body}"
    );
    assert!(
        body["traceId"].as_str().is_some_and(|t| t.len() == 32),
        "{body}"
    );
    body["message"].as_str().unwrap().to_string()
}

/// The real engine 0.11 prints `lockExpirationTime` with nine fractional digits
/// (`2026-11-30T21:53:17.215741611Z`, docs/REAL_ENGINE.md); the emulator prints the same
/// precision, so a client that only parses milliseconds fails here and not in production.
#[tokio::test]
async fn a_lease_expiry_has_nanosecond_precision_as_on_the_real_engine() {
    let h = harness().await;
    h.emu.create_tasks([agent_task()]);
    let task = h.fetch_one("w1").await;
    let text = task["lockExpirationTime"].as_str().expect("a string");
    let (_, fraction) = text.split_once('.').expect("a fractional part");
    let digits = fraction.strip_suffix('Z').expect("UTC, written Z");
    assert!(
        digits.len() == 9 && digits.bytes().all(|b| b.is_ascii_digit()),
        "nine fractional digits: {text}"
    );
    let lease: chrono::DateTime<chrono::Utc> = text.parse().unwrap();
    let expected = h.emu.now() + chrono::Duration::milliseconds(LEASE_MS as i64);
    assert!((lease - expected).num_seconds().abs() < 30, "{text}");
}

/// The real engine (Tomcat) answers its 400s and 500s with `Connection: close` and closes the
/// connection; its 401, 403, 404, 405 and 409 keep it open (docs/REAL_ENGINE.md).
#[tokio::test]
async fn a_400_or_500_closes_the_connection_as_on_the_real_engine() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let h = harness().await;
    let ids = h.emu.create_tasks([agent_task()]);
    let bad = h.zero_lease_fetch().await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.headers["connection"], "close");
    h.fetch_one("w1").await;
    let null = h
        .call(
            &format!("{}/complete", ids[0]),
            json!({"workerId": "w1", "variables": {"result": null}}),
        )
        .await;
    assert_eq!(null.status, 500);
    assert_eq!(null.headers["connection"], "close");
    let not_owned = h
        .call(
            &format!("{}/complete", ids[0]),
            json!({"workerId": "w2", "variables": {}}),
        )
        .await;
    assert_eq!(not_owned.status, 403);
    assert!(not_owned.headers.get("connection").is_none());

    // On the wire: after the 400 the server closes; the socket reads to its end.
    let addr = h.emu.base_url();
    let host = addr
        .trim_start_matches("http://")
        .trim_end_matches("/api")
        .to_string();
    let mut socket = tokio::net::TcpStream::connect(&host).await.unwrap();
    let body = r#"{"workerId":"w1","topics":["abada:agent"],"lockDuration":0}"#;
    let request = format!(
        "POST /api/v1/external-tasks/fetch-and-lock HTTP/1.1\r\nHost: {host}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut answer))
        .await
        .expect("the emulator closes the connection after a 400")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
}

#[tokio::test]
async fn fetch_returns_locked_tasks_in_id_order_with_every_field() {
    let h = harness().await;
    let ids_created = h
        .emu
        .create_tasks([agent_task(), agent_task(), agent_task()]);
    let answer = h
        .call(
            "fetch-and-lock",
            json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS, "maxTasks": 2, "unknownField": true}),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.headers["x-abada-worker-protocol-version"], "1");
    let tasks = answer.body.as_array().unwrap();
    assert_eq!(ids(tasks), ids_created[..2]);
    let task = &tasks[0];
    assert_eq!(task["topicName"], "abada:agent");
    assert_eq!(task["variables"]["customerId"], "c-17");
    assert_eq!(task["retries"], 3);
    assert_eq!(task["attempt"], 1);
    assert_eq!(task["agent"]["name"], "refund-agent");
    assert_eq!(task["protocolVersion"], "1");
    assert!(task["processInstanceId"].is_string() && task["activityId"].is_string());
    assert_eq!(
        task["traceParent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    let lease: chrono::DateTime<chrono::Utc> = task["lockExpirationTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let expected = h.emu.now() + chrono::Duration::milliseconds(LEASE_MS as i64);
    assert!(
        (lease - expected).num_seconds().abs() < 30,
        "lease is now + lockDuration"
    );

    let view = h.emu.task(&ids_created[0]).unwrap();
    assert_eq!(view.status, TaskStatus::Locked);
    assert_eq!(view.worker_id.as_deref(), Some("w1"));
    assert_eq!(view.counters.acquisitions, 1);
    // The third is left for the next fetch; then nothing is left.
    assert_eq!(ids(&h.fetch("w2", 50).await), ids_created[2..]);
    assert!(h.fetch("w2", 50).await.is_empty());
}

#[tokio::test]
async fn fetch_bounds_and_malformed_bodies_are_refused_like_the_engine() {
    let h = harness().await;
    let cases = [
        (
            json!({"workerId": " ", "topics": ["a"], "lockDuration": 1}),
            "workerId is required",
        ),
        (
            json!({"workerId": "w", "topics": [], "lockDuration": 1}),
            "At least one non-blank topic is required",
        ),
        (
            json!({"workerId": "w", "topics": ["a", " "], "lockDuration": 1}),
            "At least one non-blank topic is required",
        ),
        (
            json!({"workerId": "w", "topics": ["a"], "lockDuration": 0}),
            "lockDuration must be between 1 and 3600000 milliseconds",
        ),
        (
            json!({"workerId": "w", "topics": ["a"], "lockDuration": 3_600_001}),
            "lockDuration must be between 1 and 3600000 milliseconds",
        ),
        (
            json!({"workerId": "w", "topics": ["a"], "lockDuration": 1, "maxTasks": 0}),
            "maxTasks must be between 1 and 50",
        ),
        (
            json!({"workerId": "w", "topics": ["a"], "lockDuration": 1, "maxTasks": 51}),
            "maxTasks must be between 1 and 50",
        ),
    ];
    for (body, message) in cases {
        let answer = h.call("fetch-and-lock", body).await;
        assert_eq!(
            assert_error(&answer, 400, "ENGINE_COMMAND_REJECTED", "/fetch-and-lock"),
            message
        );
    }
    let ok = h
        .call(
            "fetch-and-lock",
            json!({"workerId": "w", "topics": ["a"], "lockDuration": 3_600_000, "maxTasks": 50}),
        )
        .await;
    assert_eq!(ok.status, 200);

    let malformed = h
        .call(
            "fetch-and-lock",
            json!({"workerId": "w", "topics": "not-a-list"}),
        )
        .await;
    assert_eq!(
        assert_error(&malformed, 400, "INVALID_REQUEST", "/fetch-and-lock"),
        "Request validation failed"
    );
    assert_eq!(
        malformed.body["details"]["reason"],
        "Malformed or invalid request body"
    );
    let raw = h
        .http
        .post(format!(
            "{}/v1/external-tasks/fetch-and-lock",
            h.emu.base_url()
        ))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let unknown = h.call("no-such-thing/at/all", json!({})).await;
    assert_error(&unknown, 404, "RESOURCE_NOT_FOUND", "/no-such-thing/at/all");
}

#[tokio::test]
async fn every_ownership_refusal_has_its_code_and_message() {
    let h = harness().await;
    let [open, held]: [String; 2] = h
        .emu
        .create_tasks([agent_task(), agent_task()])
        .try_into()
        .unwrap();
    // Take both, then fail the first so that it is OPEN again.
    assert_eq!(h.fetch("w1", 2).await.len(), 2);
    let reopen = h
        .call(
            &format!("{open}/failure"),
            json!({"workerId": "w1", "retries": 3, "retryTimeout": 0}),
        )
        .await;
    assert_eq!(reopen.status, 200);

    let missing = h
        .call(
            "t-999999/heartbeat",
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await;
    assert_eq!(
        assert_error(
            &missing,
            400,
            "ENGINE_COMMAND_REJECTED",
            "/t-999999/heartbeat"
        ),
        "External task not found: t-999999"
    );
    let not_locked = h
        .call(
            &format!("{open}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await;
    assert_eq!(
        assert_error(&not_locked, 400, "ENGINE_COMMAND_REJECTED", "/heartbeat"),
        format!("External task is not locked: {open}")
    );
    let not_owned = h
        .call(
            &format!("{held}/complete"),
            json!({"workerId": "w2", "variables": {}}),
        )
        .await;
    assert_eq!(
        assert_error(&not_owned, 403, "WORKER_LOCK_NOT_OWNED", "/complete"),
        format!("Worker does not own external task lock: {held}")
    );
    let bad_duration = h
        .call(
            &format!("{held}/extend-lock"),
            json!({"workerId": "w1", "lockDuration": 0}),
        )
        .await;
    assert_error(
        &bad_duration,
        400,
        "ENGINE_COMMAND_REJECTED",
        "/extend-lock",
    );
    let stale = h
        .call(
            &format!("{held}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000, "attempt": 7}),
        )
        .await;
    assert_eq!(
        assert_error(&stale, 409, "STALE_ATTEMPT", "/heartbeat"),
        "The task is on attempt 1"
    );

    h.emu.advance(Duration::from_millis(LEASE_MS + 1));
    for op in [
        "heartbeat",
        "extend-lock",
        "complete",
        "failure",
        "bpmn-error",
    ] {
        let body = json!({"workerId": "w1", "lockDuration": 1000, "errorCode": "E", "variables": {}, "retries": 1});
        let expired = h.call(&format!("{held}/{op}"), body).await;
        assert_eq!(
            assert_error(&expired, 409, "WORKER_LOCK_EXPIRED", op),
            format!("External task lock has expired: {held}")
        );
    }
    // Idempotent refusals are not stored: nothing was executed.
    assert_eq!(h.emu.task(&held).unwrap().counters.completes, 0);
}

#[tokio::test]
async fn a_lease_that_expired_is_taken_over_and_the_old_owner_is_fenced() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    let first = h.fetch_one("w1").await;
    assert_eq!(first["attempt"], 1);
    assert!(
        h.fetch("w2", 5).await.is_empty(),
        "a live lease is never handed out twice"
    );
    h.emu.advance(Duration::from_millis(LEASE_MS + 1));
    let second = h.fetch_one("w2").await;
    assert_eq!(
        (second["id"].as_str().unwrap(), second["attempt"].as_i64()),
        (id.as_str(), Some(2))
    );
    let old = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000, "attempt": 1}),
        )
        .await;
    assert_error(&old, 403, "WORKER_LOCK_NOT_OWNED", "/heartbeat");
    let ok = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w2", "lockDuration": 1000, "attempt": 2}),
        )
        .await;
    assert_eq!(ok.status, 204);

    // A worker re-acquiring its own expired task: the older attempt is stale even for it.
    h.emu.advance(Duration::from_millis(1001));
    let third = h.fetch_one("w2").await;
    assert_eq!(third["attempt"], 3);
    let stale = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w2", "variables": {}, "attempt": 2}),
        )
        .await;
    assert_error(&stale, 409, "STALE_ATTEMPT", "/complete");
    let done = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w2", "variables": {"x": 1}, "attempt": 3}),
        )
        .await;
    assert_eq!((done.status, &done.body), (200, &Value::Null));
    assert_eq!(h.emu.task(&id).unwrap().counters.acquisitions, 3);
}

#[tokio::test]
async fn complete_twice_is_a_no_op_the_second_time() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    for _ in 0..2 {
        let answer = h
            .call(
                &format!("{id}/complete"),
                json!({"workerId": "w1", "variables": {"agentResult": "ok"}}),
            )
            .await;
        assert_eq!(answer.status, 200);
    }
    // Even another worker gets 200 on a completed task, as in the engine.
    let other = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w9", "variables": {}}),
        )
        .await;
    assert_eq!(other.status, 200);
    let view = h.emu.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::Completed);
    assert_eq!(view.counters.completes, 1);
    assert_eq!(view.result_variables.unwrap()["agentResult"], "ok");
}

#[tokio::test]
async fn idempotency_replays_the_stored_answer_and_refuses_another_body() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let body = json!({"workerId": "w1", "variables": {"a": 1, "b": 2}});
    assert_eq!(
        h.call_keyed(&format!("{id}/complete"), body.clone(), "k-complete")
            .await
            .status,
        200
    );
    // Same body with its keys in another order and an unknown field: same request.
    let replay = h
        .call_keyed(
            &format!("{id}/complete"),
            json!({"variables": {"b": 2, "a": 1}, "workerId": "w1", "x": 0}),
            "k-complete",
        )
        .await;
    assert_eq!(replay.status, 200);
    let conflict = h
        .call_keyed(
            &format!("{id}/complete"),
            json!({"workerId": "w1", "variables": {"a": 9}}),
            "k-complete",
        )
        .await;
    assert_eq!(
        assert_error(&conflict, 400, "IDEMPOTENCY_CONFLICT", "/complete"),
        "Idempotency-Key was already used for a different request"
    );
    // The same key on another operation is a conflict too.
    let other_op = h
        .call_keyed(&format!("{id}/heartbeat"), body, "k-complete")
        .await;
    assert_error(&other_op, 400, "IDEMPOTENCY_CONFLICT", "/heartbeat");
    assert_eq!(h.emu.task(&id).unwrap().counters.completes, 1);
    let dispositions: Vec<_> = h
        .emu
        .calls()
        .into_iter()
        .filter(|c| c.operation == Operation::Complete)
        .map(|c| c.disposition)
        .collect();
    assert_eq!(
        dispositions,
        [
            Disposition::Executed,
            Disposition::Replayed,
            Disposition::Refused
        ]
    );

    // A heartbeat that reuses its key is answered from storage and extends nothing.
    let id2 = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let hb = json!({"workerId": "w1", "lockDuration": 1000});
    assert_eq!(
        h.call_keyed(&format!("{id2}/heartbeat"), hb.clone(), "k-hb")
            .await
            .status,
        204
    );
    let lease = h.emu.task(&id2).unwrap().lock_expiration_time;
    h.emu.advance(Duration::from_millis(500));
    assert_eq!(
        h.call_keyed(&format!("{id2}/heartbeat"), hb, "k-hb")
            .await
            .status,
        204
    );
    assert_eq!(h.emu.task(&id2).unwrap().lock_expiration_time, lease);
    assert_eq!(h.emu.task(&id2).unwrap().counters.heartbeats, 1);

    // Records live 24 hours: after that the key is free again.
    h.emu.advance(Duration::from_secs(24 * 3600 + 1));
    let reused = h
        .call_keyed(
            "fetch-and-lock",
            json!({"workerId": "w1", "topics": ["x"], "lockDuration": 1}),
            "k-complete",
        )
        .await;
    assert_eq!(reused.status, 200);
}

#[tokio::test]
async fn a_fetch_replay_returns_the_stored_list_and_locks_nothing_more() {
    let h = harness().await;
    h.emu.create_tasks([agent_task(), agent_task()]);
    let body = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS, "maxTasks": 5});
    let first = h
        .call_keyed("fetch-and-lock", body.clone(), "k-fetch")
        .await;
    assert_eq!(first.body.as_array().unwrap().len(), 2);
    h.emu.create_tasks([agent_task(), agent_task()]);
    let replay = h.call_keyed("fetch-and-lock", body, "k-fetch").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.headers["x-abada-worker-protocol-version"], "1");
    assert_eq!(replay.body, first.body);
    let open = h
        .emu
        .tasks()
        .into_iter()
        .filter(|t| t.status == TaskStatus::Open)
        .count();
    assert_eq!(open, 2, "the replay locked nothing more");
}

#[tokio::test]
async fn failure_sets_retries_hides_for_the_timeout_and_makes_incidents() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let failed = h
        .call(&format!("{id}/failure"), json!({"workerId": "w1", "errorMessage": "boom", "errorDetails": "trace", "retries": 2, "retryTimeout": 0}))
        .await;
    assert_eq!((failed.status, &failed.body), (200, &Value::Null));
    let view = h.emu.task(&id).unwrap();
    assert_eq!(
        (view.status, view.retries, view.worker_id),
        (TaskStatus::Open, Some(2), None)
    );
    assert_eq!(view.error_message.as_deref(), Some("boom"));

    let again = h.fetch_one("w2").await;
    assert_eq!(
        (again["retries"].as_i64(), again["attempt"].as_i64()),
        (Some(2), Some(2))
    );
    let hidden = h
        .call(
            &format!("{id}/failure"),
            json!({"workerId": "w2", "retries": 1, "retryTimeout": 5000}),
        )
        .await;
    assert_eq!(hidden.status, 200);
    let view = h.emu.task(&id).unwrap();
    assert!(view.hidden && view.worker_id.is_none());
    assert!(
        h.fetch("w3", 5).await.is_empty(),
        "hidden until the retry timeout"
    );
    // The engine keeps a hidden task LOCKED without a worker: nobody owns it.
    let poke = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w2", "lockDuration": 1000}),
        )
        .await;
    assert_error(&poke, 403, "WORKER_LOCK_NOT_OWNED", "/heartbeat");
    h.emu.advance(Duration::from_millis(5001));
    h.fetch_one("w3").await;

    let incident = h
        .call(
            &format!("{id}/failure"),
            json!({"workerId": "w3", "retries": 0}),
        )
        .await;
    assert_eq!(incident.status, 200);
    assert_eq!(h.emu.task(&id).unwrap().status, TaskStatus::Failed);
    h.emu.advance(Duration::from_millis(LEASE_MS * 2));
    assert!(
        h.fetch("w3", 5).await.is_empty(),
        "an incident is not handed out"
    );
    assert!(h.emu.set_retries(&id, 1));
    h.fetch_one("w3").await;
}

#[tokio::test]
async fn bpmn_error_records_the_business_error() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let blank = h
        .call(
            &format!("{id}/bpmn-error"),
            json!({"workerId": "w1", "errorCode": " "}),
        )
        .await;
    assert_eq!(
        assert_error(&blank, 400, "ENGINE_COMMAND_REJECTED", "/bpmn-error"),
        "BPMN errorCode is required"
    );
    let answer = h
        .call(&format!("{id}/bpmn-error"), json!({"workerId": "w1", "errorCode": "REFUSED", "errorMessage": "no", "variables": {"why": "policy"}}))
        .await;
    assert_eq!(answer.status, 204);
    let view = h.emu.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::BpmnError);
    assert_eq!(view.bpmn_error_code.as_deref(), Some("REFUSED"));
    assert_eq!(view.result_variables.unwrap()["why"], "policy");
}

#[tokio::test]
async fn the_journal_is_contiguous_across_attempts_and_refuses_conflicts() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let read = h
        .call(
            &format!("{id}/journal/read"),
            json!({"workerId": "w1", "attempt": 1}),
        )
        .await;
    assert_eq!(read.body, json!({"attempt": 1, "steps": []}));
    let step1 = json!({"seq": 1, "kind": "input", "state": "finished", "data": {"instructions": "i", "input": "u"}});
    let append = |step: Value, attempt: i64, worker: &'static str| {
        let h = &h;
        let id = id.clone();
        async move {
            h.call(
                &format!("{id}/journal"),
                json!({"workerId": worker, "attempt": attempt, "step": step}),
            )
            .await
        }
    };
    assert_eq!(append(step1.clone(), 1, "w1").await.status, 201);
    assert_eq!(
        append(step1.clone(), 1, "w1").await.status,
        200,
        "identical step: a retried append"
    );
    let different = append(
        json!({"seq": 1, "kind": "model", "state": "finished", "data": {}}),
        1,
        "w1",
    )
    .await;
    assert_error(&different, 409, "JOURNAL_CONFLICT", "/journal");
    let gap = append(
        json!({"seq": 3, "kind": "model", "state": "finished", "data": {}}),
        1,
        "w1",
    )
    .await;
    assert_error(&gap, 409, "JOURNAL_CONFLICT", "/journal");
    let stale = append(
        json!({"seq": 2, "kind": "model", "state": "finished", "data": {}}),
        0,
        "w1",
    )
    .await;
    assert_error(&stale, 409, "STALE_ATTEMPT", "/journal");
    let foreign = append(
        json!({"seq": 2, "kind": "model", "state": "finished", "data": {}}),
        1,
        "w2",
    )
    .await;
    assert_error(&foreign, 403, "WORKER_LOCK_NOT_OWNED", "/journal");
    let no_attempt = h
        .call(&format!("{id}/journal/read"), json!({"workerId": "w1"}))
        .await;
    assert_error(&no_attempt, 409, "STALE_ATTEMPT", "/journal/read");
    let bad_step = h
        .call(
            &format!("{id}/journal"),
            json!({"workerId": "w1", "attempt": 1, "step": {"seq": 0}}),
        )
        .await;
    assert_error(&bad_step, 400, "INVALID_REQUEST", "/journal");

    h.emu.advance(Duration::from_millis(LEASE_MS + 1));
    let expired = h
        .call(
            &format!("{id}/journal/read"),
            json!({"workerId": "w1", "attempt": 1}),
        )
        .await;
    assert_error(&expired, 409, "WORKER_LOCK_EXPIRED", "/journal/read");
    h.fetch_one("w2").await;
    let step2 = json!({"seq": 2, "kind": "model", "state": "finished", "data": {"model": "m"}});
    assert_eq!(
        append(step2.clone(), 2, "w2").await.status,
        201,
        "seq continues on the next attempt"
    );
    let read = h
        .call(
            &format!("{id}/journal/read"),
            json!({"workerId": "w2", "attempt": 2}),
        )
        .await;
    assert_eq!(read.body, json!({"attempt": 2, "steps": [step1, step2]}));
    assert_eq!(h.emu.task(&id).unwrap().journal.len(), 2);
}

#[tokio::test]
async fn tool_credentials_go_to_the_lease_holder_only() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let issued = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w1", "attempt": 1, "server": "orders"}),
        )
        .await;
    assert_eq!(issued.status, 200);
    let token = issued.body["token"].as_str().unwrap().to_string();
    assert!(issued.body["expiresAt"].is_string());
    assert_eq!(
        h.emu.verify_tool_credential("orders", &token),
        Some((id.clone(), 1))
    );
    assert_eq!(
        h.emu.verify_tool_credential("billing", &token),
        None,
        "bound to its server"
    );
    assert_eq!(h.emu.verify_tool_credential("orders", "forged"), None);

    let foreign = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w2", "attempt": 1, "server": "orders"}),
        )
        .await;
    assert_error(&foreign, 403, "WORKER_LOCK_NOT_OWNED", "/tool-credentials");
    let stale = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w1", "attempt": 5, "server": "orders"}),
        )
        .await;
    assert_error(&stale, 409, "STALE_ATTEMPT", "/tool-credentials");

    h.emu.advance(Duration::from_millis(LEASE_MS + 1));
    assert_eq!(
        h.emu.verify_tool_credential("orders", &token),
        None,
        "lease gone, credential dead"
    );
    let expired = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w1", "attempt": 1, "server": "orders"}),
        )
        .await;
    assert_error(&expired, 409, "WORKER_LOCK_EXPIRED", "/tool-credentials");
}

#[tokio::test]
async fn injected_server_errors_latency_and_conflicts() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.emu.inject(Fault::ServerError {
        operation: Operation::FetchAndLock,
        count: 2,
        status: None,
    });
    for _ in 0..2 {
        let answer = h
            .call(
                "fetch-and-lock",
                json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS}),
            )
            .await;
        assert_error(&answer, 500, "INTERNAL_ERROR", "/fetch-and-lock");
    }
    h.emu.inject(Fault::Latency {
        operation: Operation::FetchAndLock,
        delay_ms: 20,
    });
    h.fetch_one("w1").await;

    h.emu.inject(Fault::ConcurrentModification {
        operation: Operation::Complete,
        count: 1,
    });
    let body = json!({"workerId": "w1", "variables": {}});
    let conflict = h
        .call_keyed(&format!("{id}/complete"), body.clone(), "k1")
        .await;
    assert_error(&conflict, 409, "CONCURRENT_MODIFICATION", "/complete");
    assert_eq!(
        h.call_keyed(&format!("{id}/complete"), body, "k1")
            .await
            .status,
        200
    );
    assert_eq!(h.emu.task(&id).unwrap().counters.completes, 1);
}

#[tokio::test]
async fn a_dropped_response_still_commits_and_the_retry_replays() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    h.emu.inject(Fault::DropResponse {
        operation: Operation::Complete,
        count: 1,
    });
    let body = json!({"workerId": "w1", "variables": {"r": 1}});
    let lost = h
        .try_call(&format!("{id}/complete"), body.clone(), Some("k-done"))
        .await;
    assert!(lost.is_err(), "the client sees a connection error");
    assert_eq!(
        h.emu.task(&id).unwrap().status,
        TaskStatus::Completed,
        "the command committed"
    );
    let retry = h
        .call_keyed(&format!("{id}/complete"), body, "k-done")
        .await;
    assert_eq!(retry.status, 200);
    assert_eq!(h.emu.task(&id).unwrap().counters.completes, 1);
    let calls: Vec<_> = h
        .emu
        .calls()
        .into_iter()
        .filter(|c| c.operation == Operation::Complete)
        .collect();
    assert!(calls[0].response_dropped && calls[0].disposition == Disposition::Executed);
    assert_eq!(calls[1].disposition, Disposition::Replayed);

    // A lost fetch response: the retry with the same key gets the same tasks.
    h.emu.create_task(agent_task());
    h.emu.inject(Fault::DropResponse {
        operation: Operation::FetchAndLock,
        count: 1,
    });
    let fetch = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS});
    assert!(
        h.try_call("fetch-and-lock", fetch.clone(), Some("k-f"))
            .await
            .is_err()
    );
    let replay = h.call_keyed("fetch-and-lock", fetch, "k-f").await;
    assert_eq!(replay.body.as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn the_protocol_header_can_be_omitted_and_heartbeats_refused() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.emu.inject(Fault::OmitProtocolHeader { count: 1 });
    let fetch = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS});
    let without = h.call("fetch-and-lock", fetch.clone()).await;
    assert!(
        without
            .headers
            .get("x-abada-worker-protocol-version")
            .is_none()
    );
    let with = h.call("fetch-and-lock", fetch).await;
    assert_eq!(with.headers["x-abada-worker-protocol-version"], "1");

    h.emu.inject(Fault::RefuseHeartbeats {
        task_id: id.clone(),
    });
    let refused = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await;
    assert_error(&refused, 403, "WORKER_LOCK_NOT_OWNED", "/heartbeat");
    h.emu.clear_faults();
    let ok = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await;
    assert_eq!(ok.status, 204);
}

#[tokio::test]
async fn an_outage_drops_api_connections_but_not_admin() {
    let h = harness().await;
    h.emu.create_task(agent_task());
    h.emu.set_outage(true);
    let fetch = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS});
    assert!(
        h.try_call("fetch-and-lock", fetch.clone(), None)
            .await
            .is_err()
    );
    let admin = h
        .http
        .get(format!("{}/admin/tasks", h.emu.root_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(admin.status(), 200);
    let off = h
        .http
        .post(format!("{}/admin/outage", h.emu.root_url()))
        .json(&json!({"enabled": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(off.status(), 204);
    assert_eq!(
        h.call("fetch-and-lock", fetch)
            .await
            .body
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn protocol_levels_without_journal_and_plain_v1() {
    let h = harness_with(EmulatorOptions {
        protocol: ProtocolLevel::AgentV1WithoutJournal,
        ..Default::default()
    })
    .await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let read = h
        .call(
            &format!("{id}/journal/read"),
            json!({"workerId": "w1", "attempt": 1}),
        )
        .await;
    assert_error(&read, 404, "RESOURCE_NOT_FOUND", "/journal/read");
    let creds = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w1", "attempt": 1, "server": "s"}),
        )
        .await;
    assert_eq!(creds.status, 200);

    let h = harness_with(EmulatorOptions {
        protocol: ProtocolLevel::PlainV1,
        ..Default::default()
    })
    .await;
    let id = h.emu.create_task(agent_task());
    let task = h.fetch_one("w1").await;
    assert!(task.get("attempt").is_none() && task.get("agent").is_none());
    let creds = h
        .call(
            &format!("{id}/tool-credentials"),
            json!({"workerId": "w1", "attempt": 1, "server": "s"}),
        )
        .await;
    assert_error(&creds, 404, "RESOURCE_NOT_FOUND", "/tool-credentials");
    let ignored = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000, "attempt": 42}),
        )
        .await;
    assert_eq!(ignored.status, 204, "plain v1 ignores attempt");
}

struct BearerOnly;

impl Authorizer for BearerOnly {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        match headers.get("authorization").and_then(|v| v.to_str().ok()) {
            None => Err(AuthRejection::Unauthenticated(
                "Bearer token required".into(),
            )),
            Some("Bearer good") => Ok(()),
            Some(_) => Err(AuthRejection::AccessDenied(
                "worker:execute scope required".into(),
            )),
        }
    }
}

#[tokio::test]
async fn the_authorizer_guards_api_but_not_admin() {
    let h = harness_with(EmulatorOptions {
        authorizer: Some(Arc::new(BearerOnly)),
        ..Default::default()
    })
    .await;
    let fetch = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS});
    let anonymous = h.call("fetch-and-lock", fetch.clone()).await;
    assert_eq!(
        assert_error(
            &anonymous,
            401,
            "AUTHENTICATION_REQUIRED",
            "/fetch-and-lock"
        ),
        "Bearer token required"
    );
    let url = format!("{}/v1/external-tasks/fetch-and-lock", h.emu.base_url());
    let denied = h
        .http
        .post(&url)
        .bearer_auth("bad")
        .json(&fetch)
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 403);
    assert_eq!(
        denied.json::<Value>().await.unwrap()["code"],
        "ACCESS_DENIED"
    );
    let ok = h
        .http
        .post(&url)
        .bearer_auth("good")
        .json(&fetch)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    // A secured engine wants the v1 completion body with a workerId.
    let id = h.emu.create_task(agent_task());
    let complete = h
        .http
        .post(format!(
            "{}/v1/external-tasks/{id}/complete",
            h.emu.base_url()
        ))
        .bearer_auth("good")
        .json(&json!({"variables": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(complete.status(), 400);
    let body: Value = complete.json().await.unwrap();
    assert_eq!(
        (body["code"].as_str(), body["message"].as_str()),
        (
            Some("INVALID_REQUEST"),
            Some("workerId is required for external-task completion")
        )
    );
    let admin = h
        .http
        .get(format!("{}/admin/calls", h.emu.root_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(admin.status(), 200);
}

#[tokio::test]
async fn the_admin_api_over_http() {
    let h = harness().await;
    let root = h.emu.root_url();
    let created: Value = h
        .http
        .post(format!("{root}/admin/tasks"))
        .json(&json!([{"variables": {"a": 1}}, {"topic": "other", "retries": 2}]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids = created["ids"].as_array().unwrap();
    assert_eq!(ids.len(), 2);
    let task: Value = h
        .http
        .get(format!("{root}/admin/tasks/{}", ids[1].as_str().unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (
            task["topic"].as_str(),
            task["status"].as_str(),
            task["retries"].as_i64()
        ),
        (Some("other"), Some("OPEN"), Some(2))
    );
    h.fetch_one("w1").await;
    let fault = h
        .http
        .post(format!("{root}/admin/faults"))
        .json(&json!({"kind": "serverError", "operation": "heartbeat", "count": 1, "status": 503}))
        .send()
        .await
        .unwrap();
    assert_eq!(fault.status(), 204);
    let hb = h
        .call(
            &format!("{}/heartbeat", ids[0].as_str().unwrap()),
            json!({"workerId": "w1", "lockDuration": 10}),
        )
        .await;
    assert_error(&hb, 503, "INTERNAL_ERROR", "/heartbeat");
    let advanced: Value = h
        .http
        .post(format!("{root}/admin/clock/advance"))
        .json(&json!({"ms": LEASE_MS + 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(advanced["offsetMs"], LEASE_MS + 1);
    assert_eq!(h.fetch_one("w2").await["attempt"], 2);
    let calls: Value = h
        .http
        .get(format!("{root}/admin/calls"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let calls = calls.as_array().unwrap();
    assert_eq!(calls.last().unwrap()["operation"], "fetch-and-lock");
    assert_eq!(calls.last().unwrap()["workerId"], "w2");
    assert!(
        calls
            .iter()
            .any(|c| c["status"] == 503 && c["disposition"] == "injected")
    );
    h.emu.shutdown().await;
    assert!(
        h.http
            .get(format!("{root}/admin/tasks"))
            .send()
            .await
            .is_err(),
        "shut down"
    );
}

#[tokio::test]
async fn wait_for_wakes_on_the_change_it_waits_for() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    let emu = h.emu.clone();
    let waiter = {
        let id = id.clone();
        tokio::spawn(async move {
            emu.wait_for(|e| e.task(&id).filter(|t| t.status == TaskStatus::Completed))
                .await
        })
    };
    h.fetch_one("w1").await;
    h.call(
        &format!("{id}/complete"),
        json!({"workerId": "w1", "variables": {}}),
    )
    .await;
    let done = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken")
        .unwrap();
    assert_eq!(done.counters.completes, 1);

    // Unknown API paths are logged too, and task times serialize as the engine prints them.
    h.call("t-000001/nope", json!({})).await;
    let last = h.emu.calls().pop().unwrap();
    assert_eq!((last.operation, last.status), (Operation::Unknown, 404));
    let view = serde_json::to_value(h.emu.task(&id).unwrap()).unwrap();
    assert!(view["lockExpirationTime"].is_null());
    let call = serde_json::to_value(&last).unwrap();
    assert!(call["at"].as_str().unwrap().ends_with('Z'));
}

// ---- fidelity to the real engine 0.11 (docs/REAL_ENGINE.md, one test per difference) ---------

/// A `complete` or `bpmn-error` with a top-level JSON `null` variable is a 500 `INTERNAL_ERROR`
/// that stores nothing (the engine's `Map.copyOf` throws), the task stays locked and the key is
/// free again; a nested null is stored. (REAL_ENGINE.md: "top-level null".)
#[tokio::test]
async fn a_top_level_null_variable_is_a_500_that_stores_nothing() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let null = json!({"workerId": "w1", "variables": {"agentResult": null}});
    let answer = h
        .call_keyed(&format!("{id}/complete"), null.clone(), "k-null")
        .await;
    let message = assert_error(&answer, 500, "INTERNAL_ERROR", "/complete");
    assert_eq!(message, "The engine could not complete the request");
    let view = h.emu.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::Locked);
    assert_eq!(view.worker_id.as_deref(), Some("w1"));
    assert_eq!(view.result_variables, None);
    let answer = h
        .call(
            &format!("{id}/bpmn-error"),
            json!({"workerId": "w1", "errorCode": "E", "variables": {"x": null}}),
        )
        .await;
    assert_error(&answer, 500, "INTERNAL_ERROR", "/bpmn-error");
    // The refusal stored nothing under the key: another body with it executes.
    let nested = json!({"workerId": "w1", "variables": {"agentResult": {"note": null}}});
    let answer = h
        .call_keyed(&format!("{id}/complete"), nested, "k-null")
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let view = h.emu.task(&id).unwrap();
    assert_eq!(view.status, TaskStatus::Completed);
    assert_eq!(
        view.result_variables.unwrap()["agentResult"],
        json!({"note": null})
    );
}

/// A heartbeat without `workerId` is a 500 (the engine throws building its history entry),
/// after the lock checks; with it, a 204. (REAL_ENGINE.md §12.2.)
#[tokio::test]
async fn a_heartbeat_without_a_worker_id_is_a_500() {
    let h = harness_with(EmulatorOptions {
        protocol: ProtocolLevel::PlainV1,
        ..Default::default()
    })
    .await;
    let id = h.emu.create_task(agent_task());
    let answer = h
        .call(&format!("{id}/heartbeat"), json!({"lockDuration": 1000}))
        .await;
    assert_error(&answer, 400, "ENGINE_COMMAND_REJECTED", "/heartbeat");
    h.fetch_one("w1").await;
    let answer = h
        .call(&format!("{id}/heartbeat"), json!({"lockDuration": 1000}))
        .await;
    assert_error(&answer, 500, "INTERNAL_ERROR", "/heartbeat");
    let answer = h
        .call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await;
    assert_eq!(answer.status, 204);
    assert_eq!(h.emu.task(&id).unwrap().counters.heartbeats, 1);
}

/// `X-Abada-Worker-Protocol-Version: 1` comes on fetch-and-lock answers only: not on their
/// errors, not on any other operation. (REAL_ENGINE.md §12.8.)
#[tokio::test]
async fn the_protocol_header_comes_on_fetch_answers_only() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    let answer = h
        .call(
            "fetch-and-lock",
            json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": LEASE_MS}),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.headers["x-abada-worker-protocol-version"], "1");
    let bad = h.zero_lease_fetch().await;
    assert_eq!(bad.status, 400);
    for answer in [
        bad,
        h.call(
            &format!("{id}/heartbeat"),
            json!({"workerId": "w1", "lockDuration": 1000}),
        )
        .await,
        h.call(&format!("{id}/complete"), json!({"workerId": "w2"}))
            .await,
        h.call(&format!("{id}/complete"), json!({"workerId": "w1"}))
            .await,
    ] {
        assert!(
            answer
                .headers
                .get("x-abada-worker-protocol-version")
                .is_none(),
            "{} {}",
            answer.status,
            answer.body
        );
    }
}

/// Tasks of suspended, cancelled and failed instances are still handed out; their `complete`
/// is refused with the engine's messages (not a lease loss), while heartbeats and `failure`
/// work; an operator cannot cancel an instance that ended. (REAL_ENGINE.md §12.10.)
#[tokio::test]
async fn tasks_of_suspended_or_ended_instances_are_fetched_and_their_completion_refused() {
    use abada_agent_worker::devkit::engine::{InstanceAction, InstanceStatus};
    let h = harness_with(EmulatorOptions {
        protocol: ProtocolLevel::PlainV1,
        ..Default::default()
    })
    .await;
    let mut made = Vec::new();
    for (instance, action) in [
        ("p-susp", InstanceAction::Suspend),
        ("p-canc", InstanceAction::Cancel),
        ("p-fail", InstanceAction::Fail),
    ] {
        let id = h.emu.create_task(TaskSpec {
            process_instance_id: Some(instance.into()),
            ..agent_task()
        });
        h.emu.instance_action(instance, action).unwrap();
        made.push(id);
    }
    assert_eq!(
        h.emu.instance_action("p-canc", InstanceAction::Cancel),
        Err("Process instance is already in a terminal state: CANCELLED".into())
    );
    assert!(
        h.emu
            .instance_action("nope", InstanceAction::Suspend)
            .is_err()
    );
    assert_eq!(ids(&h.fetch("w1", 5).await), made, "all handed out");
    let expected = [
        "Process instance is suspended: p-susp",
        "Process instance is already in a terminal state: CANCELLED",
        "Process instance is already in a terminal state: FAILED",
    ];
    for (id, message) in made.iter().zip(expected) {
        let beat = h
            .call(
                &format!("{id}/heartbeat"),
                json!({"workerId": "w1", "lockDuration": LEASE_MS}),
            )
            .await;
        assert_eq!(beat.status, 204, "heartbeats work: {}", beat.body);
        let answer = h
            .call(
                &format!("{id}/complete"),
                json!({"workerId": "w1", "variables": {"a": 1}}),
            )
            .await;
        assert_eq!(
            assert_error(&answer, 400, "ENGINE_COMMAND_REJECTED", "/complete"),
            message
        );
        assert_eq!(h.emu.task(id).unwrap().status, TaskStatus::Locked);
    }
    // `failure` with retries 0 is accepted: the way out.
    let answer = h
        .call(
            &format!("{}/failure", made[0]),
            json!({"workerId": "w1", "errorMessage": "refused", "retries": 0}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(h.emu.task(&made[0]).unwrap().status, TaskStatus::Failed);
    // Resumed, the instance takes completions again.
    h.emu
        .instance_action("p-susp", InstanceAction::Resume)
        .unwrap();
    assert!(h.emu.set_retries(&made[0], 1));
    let again = h.fetch_one("w1").await;
    assert_eq!(again["id"], made[0].as_str());
    let answer = h
        .call(
            &format!("{}/complete", made[0]),
            json!({"workerId": "w1", "variables": {"a": 1}}),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        h.emu.instance("p-susp").unwrap().status,
        InstanceStatus::Running
    );
}

/// `bpmn-error` is accepted on a suspended instance and fails it (it shows `FAILED` and still
/// suspended); on an ended instance it is accepted and changes nothing more. (REAL_ENGINE.md
/// §12.11.)
#[tokio::test]
async fn a_bpmn_error_fails_a_suspended_instance() {
    use abada_agent_worker::devkit::engine::{InstanceAction, InstanceStatus, InstanceView};
    let h = harness().await;
    let suspended = h.emu.create_task(TaskSpec {
        process_instance_id: Some("p-a".into()),
        ..agent_task()
    });
    let cancelled = h.emu.create_task(TaskSpec {
        process_instance_id: Some("p-b".into()),
        ..agent_task()
    });
    h.emu
        .instance_action("p-a", InstanceAction::Suspend)
        .unwrap();
    h.emu
        .instance_action("p-b", InstanceAction::Cancel)
        .unwrap();
    h.fetch("w1", 2).await;
    for id in [&suspended, &cancelled] {
        let answer = h
            .call(
                &format!("{id}/bpmn-error"),
                json!({"workerId": "w1", "errorCode": "REFUND_DENIED"}),
            )
            .await;
        assert_eq!(answer.status, 204, "{}", answer.body);
        assert_eq!(h.emu.task(id).unwrap().status, TaskStatus::BpmnError);
    }
    assert_eq!(
        h.emu.instance("p-a"),
        Some(InstanceView {
            status: InstanceStatus::Failed,
            suspended: true
        })
    );
    assert_eq!(
        h.emu.instance("p-b").unwrap().status,
        InstanceStatus::Cancelled
    );
    // Over the admin API too.
    let view: Value = h
        .http
        .get(format!("{}/admin/instances/p-a", h.emu.root_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view, json!({"status": "FAILED", "suspended": true}));
    let r = h
        .http
        .post(format!("{}/admin/instances/p-b", h.emu.root_url()))
        .json(&json!({"action": "cancel"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["error"],
        "Process instance is already in a terminal state: CANCELLED"
    );
}

/// A completion the process cannot route (the engine's gateway without a matching flow) is
/// emulated by the `reject` fault: 400 with the message, nothing executed.
#[tokio::test]
async fn the_reject_fault_refuses_a_command_with_the_engines_message() {
    let h = harness().await;
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let r = h
        .http
        .post(format!("{}/admin/faults", h.emu.root_url()))
        .json(&json!({"kind": "reject", "operation": "complete", "taskId": id, "count": 1,
                       "message": "No matching condition and no default flow for gateway agentOutcome"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let body = json!({"workerId": "w1", "variables": {"a": 1}});
    let answer = h.call(&format!("{id}/complete"), body.clone()).await;
    assert_eq!(
        assert_error(&answer, 400, "ENGINE_COMMAND_REJECTED", "/complete"),
        "No matching condition and no default flow for gateway agentOutcome"
    );
    let calls = h.emu.calls();
    assert_eq!(calls.last().unwrap().disposition, Disposition::Injected);
    assert_eq!(h.call(&format!("{id}/complete"), body).await.status, 200);
}

// ---- processes: the approval loop of the real engine ------------------------------------------

impl Harness {
    /// A call to the process or user-task API as `user` with `groups` (the engine's X-User and
    /// X-Groups): status and JSON body.
    async fn user_call(
        &self,
        method: reqwest::Method,
        path_and_query: &str,
        user: Option<(&str, &str)>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path_and_query}", self.emu.base_url()));
        if let Some((user, groups)) = user {
            request = request.header("X-User", user).header("X-Groups", groups);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request goes through");
        let status = response.status().as_u16();
        let body = response.json().await.unwrap_or(Value::Null);
        (status, body)
    }
}

const ALICE: Option<(&str, &str)> = Some(("alice", "refund-approvers"));
const BOB: Option<(&str, &str)> = Some(("bob", "sales"));

#[tokio::test]
async fn an_approval_loops_back_to_the_agent_node_as_a_new_task_of_the_same_instance() {
    let h = harness().await;
    h.emu.deploy(engine::ProcessModel::refund_approval(Some(
        json!({"name": "refund-agent"}),
    )));
    let (status, started) = h
        .user_call(
            reqwest::Method::POST,
            "/v1/processes/start?processId=refundApproval",
            None,
            Some(json!({"orderId": "o-77", "amount": 900})),
        )
        .await;
    assert_eq!(status, 200, "{started}");
    let instance = started["processInstanceId"].as_str().unwrap().to_string();

    let first = h.fetch_one("w1").await;
    assert_eq!(first["processInstanceId"], instance.as_str());
    assert_eq!(first["activityId"], "refundAgent");
    assert_eq!(first["retries"], 3);
    assert_eq!(first["variables"]["orderId"], "o-77");
    assert_eq!(first["agent"]["name"], "refund-agent");
    let request = json!({"callId": "call_1", "server": "orders", "tool": "refund", "arguments": {"amount": 900}});
    let done = h
        .call(
            &format!("{}/complete", first["id"].as_str().unwrap()),
            json!({"workerId": "w1", "variables": {"agentStatus": "approval-required", "agentApprovalRequest": request}}),
        )
        .await;
    assert_eq!(done.status, 200, "{}", done.body);
    let view = h.emu.process_instance(&instance).unwrap();
    assert_eq!(view.current_activity_id, "approveRefund");
    assert_eq!(view.status, engine::InstanceStatus::Running);
    assert!(
        h.fetch("w1", 10).await.is_empty(),
        "the token waits at the user task"
    );

    // Only a candidate sees the task; anyone else sees nothing.
    for caller in [BOB, None] {
        let (status, listed) = h
            .user_call(reqwest::Method::GET, "/v1/tasks", caller, None)
            .await;
        assert_eq!((status, listed), (200, json!([])));
    }
    let (_, listed) = h
        .user_call(reqwest::Method::GET, "/v1/tasks", ALICE, None)
        .await;
    let user_task = &listed[0];
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(user_task["name"], "Approve refund");
    assert_eq!(user_task["taskDefinitionKey"], "approveRefund");
    assert_eq!(user_task["status"], "AVAILABLE");
    assert_eq!(user_task["candidateGroups"], json!(["refund-approvers"]));
    assert_eq!(user_task["processInstanceId"], instance.as_str());
    assert_eq!(user_task["variables"]["agentApprovalRequest"], request);
    let user_task_id = user_task["id"].as_str().unwrap().to_string();

    let (status, refused) = h
        .user_call(
            reqwest::Method::POST,
            &format!("/v1/tasks/claim?taskId={user_task_id}"),
            BOB,
            None,
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(refused["code"], "ENGINE_COMMAND_REJECTED");
    assert_eq!(
        refused["message"],
        format!("User bob is not eligible to claim task {user_task_id}")
    );
    let (status, claimed) = h
        .user_call(
            reqwest::Method::POST,
            &format!("/v1/tasks/claim?taskId={user_task_id}"),
            ALICE,
            None,
        )
        .await;
    assert_eq!(
        (status, claimed),
        (200, json!({"status": "Claimed", "taskId": user_task_id}))
    );
    let decision = json!({"agentApproval": {"callId": "call_1", "approved": true, "comment": "OK, loyal customer", "decidedBy": "alice"}});
    let complete_path = format!("/v1/tasks/complete?taskId={user_task_id}");
    let (status, completed) = h
        .user_call(
            reqwest::Method::POST,
            &complete_path,
            ALICE,
            Some(decision.clone()),
        )
        .await;
    assert_eq!(
        (status, completed),
        (200, json!({"status": "Completed", "taskId": user_task_id}))
    );
    let (status, again) = h
        .user_call(
            reqwest::Method::POST,
            &complete_path,
            ALICE,
            Some(decision.clone()),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(again["message"], "Task is already completed.");

    // A NEW external task: new id, same instance and activity, every variable, the stale ones too.
    let second = h.fetch_one("w2").await;
    assert_ne!(second["id"], first["id"]);
    assert_eq!(second["processInstanceId"], instance.as_str());
    assert_eq!(second["activityId"], "refundAgent");
    assert_eq!(second["retries"], 3);
    assert_eq!(second["attempt"], 1);
    assert_eq!(second["variables"]["agentStatus"], "approval-required");
    assert_eq!(second["variables"]["agentApprovalRequest"], request);
    assert_eq!(
        second["variables"]["agentApproval"],
        decision["agentApproval"]
    );
    assert_eq!(second["variables"]["amount"], 900);

    // A second round: a candidate may complete without claiming.
    let second_id = second["id"].as_str().unwrap();
    h.call(
        &format!("{second_id}/complete"),
        json!({"workerId": "w2", "variables": {"agentStatus": "approval-required"}}),
    )
    .await;
    let (_, listed) = h
        .user_call(
            reqwest::Method::GET,
            "/v1/tasks?status=AVAILABLE",
            ALICE,
            None,
        )
        .await;
    let next_user_task = listed[0]["id"].as_str().unwrap().to_string();
    assert_ne!(next_user_task, user_task_id);
    let (status, _) = h
        .user_call(
            reqwest::Method::POST,
            &format!("/v1/tasks/complete?taskId={next_user_task}"),
            ALICE,
            Some(json!({"agentApproval": {"callId": "call_2", "approved": false, "comment": "no", "decidedBy": "alice"}})),
        )
        .await;
    assert_eq!(status, 200);

    // `agentStatus = "done"` ends the instance.
    let third = h.fetch_one("w1").await;
    assert_eq!(third["variables"]["agentApproval"]["callId"], "call_2");
    let done = h
        .call(
            &format!("{}/complete", third["id"].as_str().unwrap()),
            json!({"workerId": "w1", "variables": {"agentStatus": "done", "agentResult": "refused"}}),
        )
        .await;
    assert_eq!(done.status, 200);
    let (status, ended) = h
        .user_call(
            reqwest::Method::GET,
            &format!("/v1/processes/instances/{instance}"),
            None,
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(ended["status"], "COMPLETED");
    assert_eq!(ended["currentActivityId"], "end");
    assert_eq!(ended["variables"]["agentResult"], "refused");
    assert!(h.fetch("w1", 10).await.is_empty());
    let (_, open) = h
        .user_call(
            reqwest::Method::GET,
            "/v1/tasks?status=AVAILABLE",
            ALICE,
            None,
        )
        .await;
    assert_eq!(open, json!([]));
}

#[tokio::test]
async fn a_gateway_that_routes_nowhere_refuses_the_completion_and_the_task_stays_locked() {
    let h = harness().await;
    let mut model = engine::ProcessModel::refund_approval(None);
    for node in &mut model.nodes {
        if let engine::NodeKind::ExclusiveGateway { default, .. } = &mut node.kind {
            *default = None;
        }
    }
    h.emu.deploy(model);
    let instance = h
        .emu
        .start_process("refundApproval", serde_json::Map::new())
        .unwrap();
    let task = h.fetch_one("w1").await;
    let id = task["id"].as_str().unwrap();
    let refused = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w1", "variables": {"agentStatus": "done"}}),
        )
        .await;
    let message = assert_error(&refused, 400, "ENGINE_COMMAND_REJECTED", "/complete");
    assert_eq!(
        message,
        "No matching condition and no default flow for gateway agentOutcome"
    );
    assert_eq!(h.emu.task(id).unwrap().status, TaskStatus::Locked);
    assert_eq!(
        h.emu
            .process_instance(&instance)
            .unwrap()
            .current_activity_id,
        "refundAgent"
    );
    let routed = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w1", "variables": {"agentStatus": "approval-required"}}),
        )
        .await;
    assert_eq!(routed.status, 200);
    assert_eq!(
        h.emu
            .process_instance(&instance)
            .unwrap()
            .current_activity_id,
        "approveRefund"
    );
}

#[tokio::test]
async fn unknown_processes_instances_and_user_tasks_are_refused_like_the_engine() {
    let h = harness().await;
    let (status, body) = h
        .user_call(
            reqwest::Method::POST,
            "/v1/processes/start?processId=nope",
            None,
            None,
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(body["code"], "ENGINE_COMMAND_REJECTED");
    assert_eq!(body["message"], "Unknown process ID: nope");
    let (status, body) = h
        .user_call(
            reqwest::Method::GET,
            "/v1/processes/instances/pi-9",
            None,
            None,
        )
        .await;
    assert_eq!(
        (status, body["code"].clone()),
        (404, json!("RESOURCE_NOT_FOUND"))
    );
    let (status, body) = h
        .user_call(
            reqwest::Method::POST,
            "/v1/tasks/claim?taskId=u-9",
            ALICE,
            None,
        )
        .await;
    assert_eq!(
        (status, body["message"].clone()),
        (400, json!("Task not found: u-9"))
    );
    let (status, body) = h
        .user_call(
            reqwest::Method::POST,
            "/v1/tasks/complete?taskId=u-9",
            ALICE,
            Some(json!([1])),
        )
        .await;
    assert_eq!(
        (status, body["code"].clone()),
        (400, json!("INVALID_REQUEST"))
    );
    // A task created through the admin API belongs to no process: completing it moves nothing.
    let id = h.emu.create_task(agent_task());
    h.fetch_one("w1").await;
    let done = h
        .call(
            &format!("{id}/complete"),
            json!({"workerId": "w1", "variables": {"agentStatus": "approval-required"}}),
        )
        .await;
    assert_eq!(done.status, 200);
    assert!(h.fetch("w1", 10).await.is_empty());
}

/// The real engine on H2 locks every row its acquisition query matches until its fetch's
/// transaction commits (devkit `engine/contention.rs`): a fetch that starts meanwhile answers
/// empty on a backlog, and the first is answered only when its transaction ends. Set over the
/// admin API; bad bodies refused; off again, fetches run alone.
#[tokio::test]
async fn with_fetch_contention_a_fetch_during_anothers_transaction_answers_empty() {
    let h = Arc::new(harness().await);
    h.emu.create_tasks((0..20).map(|_| agent_task()));
    let set = |body: Value| {
        h.http
            .post(format!("{}/admin/fetch-contention", h.emu.root_url()))
            .json(&body)
            .send()
    };
    for bad in [
        json!({"transactionMs": -1}),
        json!({"transactionMs": 60001}),
        json!({"transactionMs": 15, "locks": "everything"}),
        json!({"holdMs": 15}),
    ] {
        assert_eq!(set(bad.clone()).await.unwrap().status(), 400, "{bad}");
    }
    // A transaction far longer than the test (the leases, 60 s, outlast it): it ends when the
    // clock is moved on.
    assert_eq!(
        set(json!({"transactionMs": 30000})).await.unwrap().status(),
        204
    );
    let began = h.emu.now();
    let fetch = |worker: &'static str, max: u32| {
        let h = h.clone();
        tokio::spawn(async move {
            let got = h.fetch(worker, max).await;
            (ids(&got), h.emu.now())
        })
    };
    let recorded = |worker: &'static str| {
        let h = h.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                h.emu.wait_for(|e| {
                    e.calls()
                        .iter()
                        .any(|c| c.worker_id.as_deref() == Some(worker))
                        .then_some(())
                }),
            )
            .await
            .expect("the fetch reaches the emulator")
        }
    };
    let first = fetch("w1", 2);
    recorded("w1").await;
    let second = fetch("w2", 8);
    recorded("w2").await;
    h.emu.advance(Duration::from_secs(30));
    let (first, first_answered) = first.await.unwrap();
    let (second, _) = second.await.unwrap();
    assert_eq!(first, ["t-000001", "t-000002"]);
    assert!(second.is_empty(), "18 tasks wait, all locked: {second:?}");
    assert!(
        first_answered >= began + chrono::Duration::seconds(30),
        "answered at its transaction's end, not at once: {began} -> {first_answered}"
    );
    // Committed: the next fetch gets its tasks (contention off, it answers at once).
    assert_eq!(
        set(json!({"transactionMs": null})).await.unwrap().status(),
        204
    );
    assert_eq!(
        ids(&h.fetch("w2", 8).await),
        (3..=10).map(|n| format!("t-{n:06}")).collect::<Vec<_>>()
    );
}

/// The emulator answers partially, as concurrent fetches do on the real engine
/// (`FOR UPDATE SKIP LOCKED`), when told so over the admin API; a bad cap is refused.
#[tokio::test]
async fn a_fetch_answer_cap_set_over_the_admin_api_makes_answers_partial() {
    let h = harness().await;
    h.emu.create_tasks((0..5).map(|_| agent_task()));
    let set = |body: Value| {
        h.http
            .post(format!("{}/admin/fetch-answer-cap", h.emu.root_url()))
            .json(&body)
            .send()
    };
    for bad in [
        json!({"maxTasks": 0}),
        json!({"maxTasks": -1}),
        json!({"cap": 2}),
    ] {
        assert_eq!(set(bad.clone()).await.unwrap().status(), 400, "{bad}");
    }
    assert_eq!(set(json!({"maxTasks": 2})).await.unwrap().status(), 204);
    let a = h.fetch("w1", 8).await;
    let b = h.fetch("w2", 8).await;
    assert_eq!(
        (ids(&a), ids(&b)),
        (
            vec!["t-000001".to_string(), "t-000002".to_string()],
            vec!["t-000003".to_string(), "t-000004".to_string()]
        )
    );
    assert_eq!(set(json!({"maxTasks": null})).await.unwrap().status(), 204);
    h.emu.create_tasks((0..3).map(|_| agent_task()));
    assert_eq!(h.fetch("w1", 8).await.len(), 4, "no cap any more");
}
