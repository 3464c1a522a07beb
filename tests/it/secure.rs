//! The worker's identity towards the engine end to end: the real worker binary authenticating with OIDC client credentials at an
//! issuer nobody here wrote (oauth2-mock-server, driven by `tests/interop/oidc-mock.mjs` for
//! short-lived tokens, a missing scope and a checked client secret) against the engine emulator
//! in secured mode (JWTs checked against the issuer's JWKS); the start-up failures and their
//! recovery; a leak hunt over every log line at trace level; and the life of tool credentials.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use abada_agent_worker::devkit::engine::{
    AuthRejection, Authorizer, HeaderMap, ProtocolLevel, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::jwt::JwtValidator;
use abada_agent_worker::devkit::model::{Fault, FaultTimes, Script, Turn};
use abada_agent_worker::devkit::stack::{REFUND_MODEL, Stack, StackOptions, refund_script};
use abada_agent_worker::devkit::tools::{CredentialValidator, ToolServer, ToolServerOptions};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::agent::{spec, wait_all_ended};
use crate::support::peers::installed;
use crate::support::process::{WorkerProcess, stack_env};
use crate::support::wait::eventually;

const CLIENT_ID: &str = "worker-client";

// ---------------------------------------------------------------------------------------------
// The issuer: oauth2-mock-server behind tests/interop/oidc-mock.mjs.

/// How to start the mock issuer (see the script's header).
#[derive(Default, Clone)]
struct MockSettings {
    /// The issuer URL to advertise instead of `http://localhost:<its port>` (the address of an
    /// [`IssuerFront`]).
    issuer: Option<String>,
    ttl_secs: Option<u64>,
    scope: Option<String>,
    client_secret: Option<String>,
    keys_file: Option<PathBuf>,
}

/// A running mock issuer on 127.0.0.1; killed when dropped.
struct OidcMock {
    /// As it advertises itself: `http://localhost:<port>`.
    issuer: String,
    port: u16,
    /// Every stdout line of the script, parsed.
    events: Arc<Mutex<Vec<Value>>>,
    child: tokio::process::Child,
}

async fn start_mock(settings: &MockSettings) -> Option<OidcMock> {
    let package = installed(
        "oidc/node_modules/oauth2-mock-server/dist/index.mjs",
        "scripts/install-oidc-peer",
    )?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/oidc-mock.mjs");
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(&script)
        .arg(&package)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(issuer) = &settings.issuer {
        cmd.env("OIDC_MOCK_ISSUER", issuer);
    }
    if let Some(ttl) = settings.ttl_secs {
        cmd.env("OIDC_MOCK_TTL", ttl.to_string());
    }
    if let Some(scope) = &settings.scope {
        cmd.env("OIDC_MOCK_SCOPE", scope);
    }
    if let Some(secret) = &settings.client_secret {
        cmd.env("OIDC_MOCK_CLIENT_SECRET", secret);
    }
    if let Some(keys) = &settings.keys_file {
        cmd.env("OIDC_MOCK_KEYS", keys);
    }
    let mut child = cmd
        .spawn()
        .expect("cannot start node: is Node.js installed?");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let events = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sink = events.clone();
    tokio::spawn(async move {
        let mut tx = Some(tx);
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(event) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if event["event"] == "listening"
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(event.clone());
            }
            sink.lock().unwrap().push(event);
        }
    });
    let listening = tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .expect("the mock issuer did not start within 60 s")
        .expect("the mock issuer exited before listening");
    Some(OidcMock {
        issuer: listening["issuer"].as_str().unwrap().to_string(),
        port: listening["port"].as_u64().unwrap() as u16,
        events,
        child,
    })
}

impl OidcMock {
    /// One entry per token request: `status`, `access_token`, `scope`, `at_ms`.
    fn token_requests(&self) -> Vec<Value> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e["event"] == "token")
            .cloned()
            .collect()
    }

    fn issued_tokens(&self) -> Vec<String> {
        self.token_requests()
            .iter()
            .filter_map(|e| e["access_token"].as_str().map(str::to_string))
            .collect()
    }

    /// Changes `ttl`, `scope` or `clientSecret` of the running issuer.
    async fn configure(&self, body: Value) {
        let resp = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/__mock/config", self.port))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success());
    }

    /// A token straight from the token endpoint, as the worker would get it.
    async fn token(&self, secret: &str) -> String {
        let resp: Value = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/token", self.port))
            .basic_auth(CLIENT_ID, Some(secret))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("grant_type=client_credentials&scope=worker%3Aexecute")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        resp["access_token"].as_str().unwrap().to_string()
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The issuer's address as the worker knows it, held by the test for the whole test: while up,
/// it forwards each connection to the mock issuer's own port; while down, it closes each
/// connection unanswered (the worker cannot reach the issuer). So the issuer can go away and come
/// back, another process on another port, at the same URL without that port ever being free
/// for someone else to take.
struct IssuerFront {
    addr: SocketAddr,
    /// The mock issuer's port while up.
    backend: Arc<Mutex<Option<u16>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl IssuerFront {
    async fn bind() -> IssuerFront {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backend: Arc<Mutex<Option<u16>>> = Arc::default();
        let target = backend.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let backend = *target.lock().unwrap();
                tokio::spawn(async move {
                    let outbound = match backend {
                        Some(port) => tokio::net::TcpStream::connect(("127.0.0.1", port)).await,
                        None => Err(std::io::ErrorKind::NotConnected.into()),
                    };
                    match outbound {
                        Ok(mut outbound) => {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                        Err(_) => close_unanswered(inbound).await,
                    }
                });
            }
        });
        IssuerFront {
            addr,
            backend,
            accepting,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Up, in front of `mock`; or down with `None`.
    fn forward_to(&self, mock: Option<&OidcMock>) {
        *self.backend.lock().unwrap() = mock.map(|m| m.port);
    }
}

/// Takes the request, then closes the connection without an answer: every attempt fails the
/// same way ("connection closed before message completed"), whatever the timing (closing at
/// once would sometimes reset the request being written instead, a second kind of failure).
async fn close_unanswered(mut inbound: tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
            match inbound.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
}

impl Drop for IssuerFront {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// The secured engine: the JwtValidator adapter, observed.

#[derive(Default, Clone)]
struct GateLog {
    /// Per accepted request: the token's `jti`, its `exp` and the time of use (Unix seconds).
    accepted: Vec<(String, u64, u64)>,
    unauthenticated: u64,
    denied: u64,
}

/// The emulator's authorizer in these tests: [`JwtValidator`] as an [`Authorizer`] (the adapter
/// under test), plus a log of what it decided and a switch that revokes the next request's
/// token (answering 401 as an engine does for a revoked or rotated-out token).
struct Gate {
    validator: JwtValidator,
    revoke_next: AtomicU32,
    log: Mutex<GateLog>,
}

impl Gate {
    fn snapshot(&self) -> GateLog {
        self.log.lock().unwrap().clone()
    }
}

impl Authorizer for Gate {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        if self
            .revoke_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.log.lock().unwrap().unauthenticated += 1;
            return Err(AuthRejection::Unauthenticated(
                "the token has been revoked".into(),
            ));
        }
        let result = self.validator.authorize(headers);
        let mut log = self.log.lock().unwrap();
        match &result {
            Ok(()) => {
                let token = headers["authorization"]
                    .to_str()
                    .unwrap()
                    .strip_prefix("Bearer ")
                    .unwrap();
                let claims: Value =
                    jsonwebtoken::dangerous::insecure_decode_claims::<Value>(token).unwrap();
                log.accepted.push((
                    claims["jti"].as_str().unwrap_or_default().to_string(),
                    claims["exp"].as_u64().unwrap(),
                    unix_now(),
                ));
            }
            Err(AuthRejection::Unauthenticated(_)) => log.unauthenticated += 1,
            Err(AuthRejection::AccessDenied(_)) => log.denied += 1,
        }
        result
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The stack with its emulator secured by the mock issuer's keys.
async fn secured_stack(issuer: &str) -> (Stack, Arc<Gate>) {
    let validator = JwtValidator::load(issuer, reqwest::Client::builder())
        .await
        .unwrap();
    let gate = Arc::new(Gate {
        validator,
        revoke_next: AtomicU32::new(0),
        log: Mutex::new(GateLog::default()),
    });
    let stack = Stack::start_with(StackOptions {
        protocol: ProtocolLevel::AgentV1,
        authorizer: Some(gate.clone()),
    })
    .await
    .unwrap();
    (stack, gate)
}

/// The variables of a worker process against `stack`, authenticating at `issuer`.
fn oidc_env(stack: &Stack, worker_id: &str, issuer: &str) -> Vec<(String, String)> {
    let mut env = stack_env(stack, worker_id);
    env.push(("ABADA_AGENT_OIDC_ISSUER_URL".into(), issuer.into()));
    env.push(("ABADA_AGENT_OIDC_CLIENT_ID".into(), CLIENT_ID.into()));
    env
}

fn with(mut env: Vec<(String, String)>, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

// ---------------------------------------------------------------------------------------------
// Waiting and reading logs.

async fn readyz(worker: &WorkerProcess) -> (u16, String) {
    worker.admin_get("/readyz").await
}

fn log_lines(worker: &WorkerProcess) -> Vec<Value> {
    worker
        .stdout()
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// WARN and ERROR lines whose text mentions `needle`.
fn complaints(worker: &WorkerProcess, needle: &str) -> Vec<String> {
    log_lines(worker)
        .into_iter()
        .filter(|l| matches!(l["level"].as_str(), Some("WARN" | "ERROR")))
        .map(|l| l.to_string())
        .filter(|l| l.contains(needle))
        .collect()
}

/// Lines at any level with `message` equal to `message`.
/// Whether any log line of the worker holds `text` (the detail `/readyz` leaves out).
fn logged(worker: &WorkerProcess, text: &str) -> bool {
    worker.stdout().iter().any(|l| l.contains(text))
}

fn lines_with_message(worker: &WorkerProcess, message: &str) -> usize {
    log_lines(worker)
        .iter()
        .filter(|l| l["message"] == message)
        .count()
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("abada-secure-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Rewrites a mounted secret file the way a rotation does (new content, new length).
fn rotate(path: &Path, content: &str) {
    std::fs::write(path, format!("{content}\n")).unwrap();
}

/// One refund task per order, all on `openai/refund`.
fn refund_tasks(stack: &Stack, n: usize, prefix: &str) -> Vec<String> {
    stack.engine.create_tasks((0..n).map(|i| {
        spec(
            stack.refund_agent("openai/refund", &[]),
            &format!("{prefix}-{i}"),
        )
    }))
}

fn assert_all_completed(views: &[TaskView]) {
    for v in views {
        assert_eq!(
            v.status,
            TaskStatus::Completed,
            "task {} ended {:?}: {:?}",
            v.id,
            v.status,
            v.error_message
        );
    }
}

/// Fails the test with the worker's WARN and ERROR lines, if it logged any.
fn assert_no_complaints(worker: &WorkerProcess) {
    let lines = complaints(worker, "");
    assert!(lines.is_empty(), "{lines:#?}");
}

/// How a [`secured_run`] runs.
struct RunShape {
    worker_id: &'static str,
    tasks: usize,
    /// `ABADA_AGENT_MAX_TASKS`; the default when `None`.
    slots: Option<u32>,
    /// Latency of each model turn; the scripted model's own when `None`.
    turn: Option<Duration>,
    limit: Duration,
}

/// The worker binary against the secured stack, with tokens from a mock issuer started with
/// `settings`, once it has completed `shape.tasks` refund tasks. `None` when the mock is not
/// installed and ABADA_SKIP_INTEROP=1.
struct SecuredRun {
    mock: OidcMock,
    stack: Stack,
    gate: Arc<Gate>,
    worker: WorkerProcess,
}

async fn secured_run(settings: MockSettings, shape: RunShape) -> Option<SecuredRun> {
    let mock = start_mock(&settings).await?;
    let (stack, gate) = secured_stack(&mock.issuer).await;
    if let Some(turn) = shape.turn {
        stack
            .model
            .set_script(REFUND_MODEL, refund_script().with_latency(turn));
    }
    let ids = refund_tasks(&stack, shape.tasks, shape.worker_id);
    let mut env = with(
        oidc_env(&stack, shape.worker_id, &mock.issuer),
        &[("ABADA_AGENT_OIDC_CLIENT_SECRET", "s3cret-value")],
    );
    if let Some(slots) = shape.slots {
        env.push(("ABADA_AGENT_MAX_TASKS".into(), slots.to_string()));
    }
    let worker = WorkerProcess::spawn(&env).await;
    assert_all_completed(&wait_all_ended(&stack, &ids, shape.limit).await);
    Some(SecuredRun {
        mock,
        stack,
        gate,
        worker,
    })
}

impl SecuredRun {
    /// Checks that the worker complained about nothing, then stops everything.
    async fn finish(self) {
        assert_no_complaints(&self.worker);
        self.stack.shutdown().await;
        self.mock.stop().await;
    }
}

const DEBUG_LOGS: (&str, &str) = ("RUST_LOG", "info,abada_agent_worker=debug");

// ---------------------------------------------------------------------------------------------
// Interop: discovery, token, tasks against the secured emulator.

#[tokio::test]
async fn the_secured_emulator_answers_with_the_engine_error_bodies() {
    let Some(mock) = start_mock(&MockSettings::default()).await else {
        return;
    };
    let (stack, gate) = secured_stack(&mock.issuer).await;
    let fetch = format!(
        "{}/v1/external-tasks/fetch-and-lock",
        stack.engine.base_url()
    );
    let body =
        json!({"workerId": "w", "topics": ["abada:agent"], "lockDuration": 1000, "maxTasks": 1});
    let call = |token: Option<String>| {
        let mut req = reqwest::Client::new()
            .post(&fetch)
            .header("X-Abada-Worker-Protocol-Version", "1")
            .json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let check_error = |status: u16, code: &str, resp_status: u16, body: &Value| {
        assert_eq!(resp_status, status, "{body}");
        assert_eq!(body["status"], status, "{body}");
        assert_eq!(body["code"], code, "{body}");
        assert_eq!(
            body["path"], "/api/v1/external-tasks/fetch-and-lock",
            "{body}"
        );
        for field in ["timestamp", "message", "traceId"] {
            assert!(body[field].is_string(), "{field} in {body}");
        }
    };

    let resp = call(None).await.unwrap();
    let status = resp.status().as_u16();
    check_error(
        401,
        "AUTHENTICATION_REQUIRED",
        status,
        &resp.json().await.unwrap(),
    );

    let good = mock.token("any").await;
    let resp = call(Some(good.clone())).await.unwrap();
    assert_eq!(resp.status(), 200);

    let mut tampered: Vec<&str> = good.split('.').collect();
    let forged_sig = tampered[2].chars().rev().collect::<String>();
    tampered[2] = &forged_sig;
    let resp = call(Some(tampered.join("."))).await.unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    check_error(401, "AUTHENTICATION_REQUIRED", status, &body);
    assert!(
        !body.to_string().contains(&good[..40]),
        "the token is never quoted"
    );

    mock.configure(json!({"scope": "openid profile"})).await;
    let unscoped = mock.token("any").await;
    let resp = call(Some(unscoped)).await.unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    check_error(403, "ACCESS_DENIED", status, &body);
    assert!(
        body["message"].as_str().unwrap().contains("worker:execute"),
        "{body}"
    );

    mock.configure(json!({"scope": null, "ttl": 1})).await;
    let short = mock.token("any").await;
    // The emulator tolerates 30 s of clock skew, as engines do; beyond that it is expired.
    let later = SystemTime::now() + Duration::from_secs(40);
    assert!(
        gate.validator
            .validate_header_at(Some(&format!("Bearer {short}")), later)
            .is_err()
    );
    stack.shutdown().await;
    mock.stop().await;
}

#[tokio::test]
async fn the_worker_completes_tasks_against_the_secured_emulator() {
    let Some(run) = secured_run(
        MockSettings::default(),
        RunShape {
            worker_id: "secure-1",
            tasks: 5,
            slots: None,
            turn: None,
            limit: Duration::from_secs(30),
        },
    )
    .await
    else {
        return;
    };
    let (status, body) = readyz(&run.worker).await;
    assert_eq!(status, 200, "{body}");

    let tokens = run.mock.token_requests();
    assert_eq!(
        tokens.len(),
        1,
        "one token for every task and call: {tokens:?}"
    );
    assert_eq!(tokens[0]["status"], 200);
    let log = run.gate.snapshot();
    assert_eq!(log.unauthenticated + log.denied, 0);
    assert!(
        log.accepted.len() > 5 * 4,
        "every engine call carried the token"
    );
    run.finish().await;
}

/// Token lifetime 4 s (refreshed 2 s after receipt), tasks of about 6 s each.
#[tokio::test]
async fn a_token_that_expires_mid_run_is_refreshed_and_no_task_fails() {
    let Some(run) = secured_run(
        MockSettings {
            ttl_secs: Some(4),
            ..MockSettings::default()
        },
        RunShape {
            worker_id: "secure-exp",
            tasks: 6,
            slots: Some(6),
            turn: Some(Duration::from_secs(2)),
            limit: Duration::from_secs(60),
        },
    )
    .await
    else {
        return;
    };
    let log = run.gate.snapshot();
    let distinct: HashSet<&str> = log.accepted.iter().map(|(jti, ..)| jti.as_str()).collect();
    assert!(distinct.len() >= 2, "the token was replaced during the run");
    // Never sent once expired (the emulator's 30 s skew tolerance would have hidden it).
    for (jti, exp, used_at) in &log.accepted {
        assert!(
            used_at <= exp,
            "token {jti} used at {used_at}, expired at {exp}"
        );
    }
    assert_eq!(
        log.unauthenticated, 0,
        "no 401 needed: refreshed ahead of expiry"
    );
    let requests = run.mock.token_requests();
    assert!(requests.iter().all(|r| r["status"] == 200));
    run.finish().await;
}

/// 100 tasks on 50 slots, tokens of 4 s: the token endpoint is asked once per refresh window
/// (2 s), never once per waiting task.
#[tokio::test]
async fn a_hundred_concurrent_tasks_cause_one_token_request_per_expiry_window() {
    let Some(run) = secured_run(
        MockSettings {
            ttl_secs: Some(4),
            ..MockSettings::default()
        },
        RunShape {
            worker_id: "secure-100",
            tasks: 100,
            slots: Some(50),
            turn: Some(Duration::from_millis(1500)),
            limit: Duration::from_secs(120),
        },
    )
    .await
    else {
        return;
    };
    let requests = run.mock.token_requests();
    assert!(
        requests.len() >= 2,
        "the run outlived a token: {requests:?}"
    );
    let times: Vec<u64> = requests
        .iter()
        .map(|r| r["at_ms"].as_u64().unwrap())
        .collect();
    for pair in times.windows(2) {
        // A second request in the same window would come milliseconds after the first.
        assert!(
            pair[1] - pair[0] >= 1000,
            "two token requests {} ms apart: {times:?}",
            pair[1] - pair[0]
        );
    }
    let log = run.gate.snapshot();
    assert!(log.accepted.len() > 100 * 4);
    assert_eq!(log.unauthenticated, 0);
    run.finish().await;
}

// ---------------------------------------------------------------------------------------------
// Start-up failures: one clear line, not ready, recovery when fixed.

#[tokio::test]
async fn a_wrong_client_secret_says_so_once_and_a_rotated_secret_file_recovers() {
    let Some(mock) = start_mock(&MockSettings {
        client_secret: Some("the-right-client-secret".into()),
        ..MockSettings::default()
    })
    .await
    else {
        return;
    };
    let (stack, _gate) = secured_stack(&mock.issuer).await;
    let dir = temp_dir();
    let secret_file = dir.join("client-secret");
    rotate(&secret_file, "a-wrong-secret");
    let env = with(
        oidc_env(&stack, "secure-secret", &mock.issuer),
        &[
            (
                "ABADA_AGENT_OIDC_CLIENT_SECRET_FILE",
                secret_file.to_str().unwrap(),
            ),
            DEBUG_LOGS,
        ],
    );
    let worker = WorkerProcess::spawn(&env).await;
    const CLEAR: &str = "the issuer rejected the client credentials for client id worker-client";
    eventually(Duration::from_secs(30), "two refused grants", async || {
        mock.token_requests().len() >= 2
    })
    .await;
    let (status, body) = readyz(&worker).await;
    assert_eq!(status, 503);
    assert_eq!(
        body.trim(),
        "not ready: the worker cannot obtain its token from the OIDC issuer"
    );
    assert!(logged(&worker, CLEAR), "the log says what failed");
    assert!(
        logged(&worker, "ABADA_AGENT_OIDC_CLIENT_SECRET"),
        "the log says what to fix"
    );
    eventually(
        Duration::from_secs(10),
        "the repeat logged at debug",
        async || lines_with_message(&worker, "fetch-and-lock failed again") >= 1,
    )
    .await;

    rotate(&secret_file, "the-right-client-secret");
    eventually(
        Duration::from_secs(40),
        "ready after the rotation",
        async || readyz(&worker).await.0 == 200,
    )
    .await;
    let ids = refund_tasks(&stack, 2, "after-rotation");
    assert_all_completed(&wait_all_ended(&stack, &ids, Duration::from_secs(30)).await);

    let lines = complaints(&worker, CLEAR);
    assert_eq!(lines.len(), 1, "one clear line: {lines:#?}");
    let all = complaints(&worker, "");
    assert_eq!(all.len(), 1, "nothing else complained: {all:#?}");
    assert!(!worker.stdout().join("\n").contains("a-wrong-secret"));
    stack.shutdown().await;
    mock.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn an_unreachable_issuer_says_so_once_and_recovers_when_it_starts() {
    let dir = temp_dir();
    let front = IssuerFront::bind().await;
    let settings = MockSettings {
        issuer: Some(front.url()),
        keys_file: Some(dir.join("keys.json")),
        ..MockSettings::default()
    };
    let Some(first) = start_mock(&settings).await else {
        return;
    };
    let issuer = first.issuer.clone();
    assert_eq!(issuer, front.url());
    front.forward_to(Some(&first));
    // The engine knows the issuer's keys; then the issuer goes away.
    let (stack, _gate) = secured_stack(&issuer).await;
    front.forward_to(None);
    first.stop().await;

    let env = with(
        oidc_env(&stack, "secure-unreachable", &issuer),
        &[
            ("ABADA_AGENT_OIDC_CLIENT_SECRET", "s3cret-value"),
            DEBUG_LOGS,
        ],
    );
    let worker = WorkerProcess::spawn(&env).await;
    const CLEAR: &str = "cannot reach the OIDC issuer";
    eventually(Duration::from_secs(30), "a repeated failure", async || {
        lines_with_message(&worker, "fetch-and-lock failed again") >= 1
    })
    .await;
    let (status, body) = readyz(&worker).await;
    assert_eq!(status, 503);
    assert_eq!(
        body.trim(),
        "not ready: the worker cannot obtain its token from the OIDC issuer"
    );
    assert!(
        logged(&worker, CLEAR) && logged(&worker, &issuer),
        "the log says what failed"
    );

    // A new issuer process (the same signing keys) behind the same URL.
    let second = start_mock(&settings).await.unwrap();
    assert_eq!(second.issuer, issuer);
    front.forward_to(Some(&second));
    eventually(
        Duration::from_secs(40),
        "ready once the issuer is up",
        async || readyz(&worker).await.0 == 200,
    )
    .await;
    let ids = refund_tasks(&stack, 2, "after-issuer");
    assert_all_completed(&wait_all_ended(&stack, &ids, Duration::from_secs(30)).await);

    let lines = complaints(&worker, CLEAR);
    assert_eq!(lines.len(), 1, "one clear line: {lines:#?}");
    let all = complaints(&worker, "");
    assert_eq!(all.len(), 1, "nothing else complained: {all:#?}");
    stack.shutdown().await;
    second.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_token_without_the_scope_says_so_once_and_recovers_when_granted() {
    let Some(mock) = start_mock(&MockSettings {
        ttl_secs: Some(4),
        scope: Some("openid".into()),
        ..MockSettings::default()
    })
    .await
    else {
        return;
    };
    let (stack, gate) = secured_stack(&mock.issuer).await;
    let env = with(
        oidc_env(&stack, "secure-scope", &mock.issuer),
        &[
            ("ABADA_AGENT_OIDC_CLIENT_SECRET", "s3cret-value"),
            DEBUG_LOGS,
        ],
    );
    let worker = WorkerProcess::spawn(&env).await;
    const CLEAR: &str = "403 ACCESS_DENIED";
    eventually(Duration::from_secs(30), "a repeated refusal", async || {
        lines_with_message(&worker, "fetch-and-lock failed again") >= 1
    })
    .await;
    let (status, body) = readyz(&worker).await;
    assert_eq!(status, 503);
    assert_eq!(
        body.trim(),
        "not ready: the engine denies the worker access"
    );
    assert!(
        logged(&worker, CLEAR) && logged(&worker, "worker:execute"),
        "the log says what failed"
    );
    assert!(gate.snapshot().denied >= 2);

    // The issuer grants the scope from now on; the worker's next token carries it.
    mock.configure(json!({"scope": null})).await;
    eventually(Duration::from_secs(40), "ready once granted", async || {
        readyz(&worker).await.0 == 200
    })
    .await;
    let ids = refund_tasks(&stack, 2, "after-grant");
    assert_all_completed(&wait_all_ended(&stack, &ids, Duration::from_secs(30)).await);

    let lines = complaints(&worker, CLEAR);
    assert_eq!(lines.len(), 1, "one clear line: {lines:#?}");
    let all = complaints(&worker, "");
    assert_eq!(all.len(), 1, "nothing else complained: {all:#?}");
    stack.shutdown().await;
    mock.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Leak hunt.

/// A tool server's credential check that refuses everything (HTTP 401) and remembers what it
/// was shown.
#[derive(Default)]
struct RefuseAll(Mutex<Vec<String>>);

impl CredentialValidator for RefuseAll {
    fn validate(&self, _server: &str, token: &str) -> bool {
        self.0.lock().unwrap().push(token.to_string());
        false
    }
}

/// How the secrets reach the worker in one run.
#[derive(Clone, Copy, Debug)]
enum SecretsVia {
    /// OIDC secret from `_FILE`, provider keys from the variables.
    OidcFile,
    /// OIDC secret from the variable, provider keys from `_FILE`.
    OidcVariable,
}

#[tokio::test]
async fn no_secret_reaches_a_log_line_or_an_error_message() {
    for via in [SecretsVia::OidcFile, SecretsVia::OidcVariable] {
        if !leak_run(via).await {
            return;
        }
    }
}

/// One full scenario at trace level; false when the mock issuer is not installed.
async fn leak_run(via: SecretsVia) -> bool {
    let mark = |what: &str| format!("LEAKMARK-{what}-{}", uuid::Uuid::new_v4().simple());
    let oidc_secret = mark("oidc");
    let openai_key = mark("openai");
    let anthropic_key = mark("anthropic");
    let Some(mock) = start_mock(&MockSettings {
        ttl_secs: Some(6),
        client_secret: Some(oidc_secret.clone()),
        ..MockSettings::default()
    })
    .await
    else {
        return false;
    };
    let (stack, gate) = secured_stack(&mock.issuer).await;
    let refuser = Arc::new(RefuseAll::default());
    let billing = ToolServer::start(ToolServerOptions::new("billing", refuser.clone()))
        .await
        .unwrap();
    stack.model.set_script(
        REFUND_MODEL,
        refund_script().with_latency(Duration::from_millis(700)),
    );
    stack.model.set_script("limited", refund_script());
    stack.model.inject_fault(
        "limited",
        Fault::RateLimited {
            retry_after: Some(Duration::from_secs(5)),
        },
        FaultTimes::Always,
    );

    let mut specs = Vec::new();
    for i in 0..3 {
        specs.push(spec(
            stack.refund_agent("openai/refund", &[]),
            &format!("l-{i}"),
        ));
    }
    specs.push(spec(
        stack.refund_agent("anthropic/refund", &[]),
        "l-anthropic",
    ));
    // A 429 from the first model: falls back to the second.
    specs.push(spec(
        stack.refund_agent("openai/limited", &["anthropic/refund"]),
        "l-429",
    ));
    // A tool server answering 401: a technical failure, then an incident.
    let mut refused = stack.refund_agent("openai/refund", &[]);
    refused["toolServers"] = json!([{"name": "billing", "url": billing.url()}]);
    let mut refused_spec = spec(refused, "l-401");
    refused_spec.retries = Some(1);
    specs.push(refused_spec);
    let ids = stack.engine.create_tasks(specs);
    // The engine refuses the first call's token (401): one forced refresh, one retry.
    gate.revoke_next.store(1, Ordering::SeqCst);

    let dir = temp_dir();
    let mut env = oidc_env(&stack, "leaky", &mock.issuer);
    env.push(("RUST_LOG".into(), "trace".into()));
    let file = |name: &str, content: &str| {
        let path = dir.join(name);
        rotate(&path, content);
        path.to_str().unwrap().to_string()
    };
    match via {
        SecretsVia::OidcFile => {
            env.push((
                "ABADA_AGENT_OIDC_CLIENT_SECRET_FILE".into(),
                file("oidc", &oidc_secret),
            ));
            env.push((
                "ABADA_AGENT_PROVIDER_OPENAI_API_KEY".into(),
                openai_key.clone(),
            ));
            env.push((
                "ABADA_AGENT_PROVIDER_ANTHROPIC_API_KEY".into(),
                anthropic_key.clone(),
            ));
        }
        SecretsVia::OidcVariable => {
            env.push(("ABADA_AGENT_OIDC_CLIENT_SECRET".into(), oidc_secret.clone()));
            env.push((
                "ABADA_AGENT_PROVIDER_OPENAI_API_KEY_FILE".into(),
                file("openai", &openai_key),
            ));
            env.push((
                "ABADA_AGENT_PROVIDER_ANTHROPIC_API_KEY_FILE".into(),
                file("anthropic", &anthropic_key),
            ));
        }
    }
    let mut worker = WorkerProcess::spawn(&env).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(90)).await;
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(30)).await;
    assert!(exit.success(), "{via:?}: {exit}");

    // The scenario did what it says.
    let by_order = |order: &str| {
        views
            .iter()
            .find(|v| v.variables["orderId"] == order)
            .unwrap()
            .clone()
    };
    assert_eq!(by_order("l-401").status, TaskStatus::Failed, "{via:?}");
    for order in ["l-0", "l-1", "l-2", "l-anthropic", "l-429"] {
        assert_eq!(
            by_order(order).status,
            TaskStatus::Completed,
            "{via:?} {order}"
        );
    }
    assert!(stack.model.calls("limited") >= 1, "the 429 was met");
    assert!(gate.snapshot().unauthenticated >= 1, "the 401 was met");
    assert!(
        !refuser.0.lock().unwrap().is_empty(),
        "the tool 401 was met"
    );

    // Every secret of the run.
    let mut secrets = vec![oidc_secret, openai_key, anthropic_key];
    let access_tokens = mock.issued_tokens();
    assert!(access_tokens.len() >= 2, "{via:?}: {access_tokens:?}");
    let tool_credentials: HashSet<String> = stack
        .tools
        .calls()
        .into_iter()
        .filter_map(|c| c.token)
        .chain(refuser.0.lock().unwrap().iter().cloned())
        .collect();
    assert!(tool_credentials.len() >= 2, "{via:?}");
    // A JWT leaks if its payload or signature does, even without the rest.
    for token in &access_tokens {
        secrets.extend(token.split('.').skip(1).map(str::to_string));
    }
    secrets.extend(tool_credentials);
    assert!(secrets.iter().all(|s| s.len() >= 16), "{secrets:?}");

    let mut output = worker.stdout();
    output.extend(worker.stderr());
    assert!(
        output.iter().any(|l| l.contains("\"level\":\"TRACE\"")),
        "{via:?}: the worker logged at trace level"
    );
    let recorded: Vec<String> = stack
        .engine
        .tasks()
        .iter()
        .map(|v| serde_json::to_string(v).unwrap())
        .collect();
    for secret in &secrets {
        for line in output.iter().chain(&recorded) {
            assert!(
                !line.contains(secret.as_str()),
                "{via:?}: a secret ({}...) leaked into: {line}",
                &secret[..12]
            );
        }
    }
    stack.shutdown().await;
    billing.shutdown().await;
    mock.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
    true
}

// ---------------------------------------------------------------------------------------------
// Tool credentials.

#[tokio::test]
async fn only_the_lease_holder_gets_a_tool_credential() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let id = refund_tasks(&stack, 1, "cred").remove(0);
    let http = reqwest::Client::new();
    let base = format!("{}/v1/external-tasks", stack.engine.base_url());
    let post = |path: String, body: Value| {
        http.post(format!("{base}/{path}"))
            .header("X-Abada-Worker-Protocol-Version", "1")
            .json(&body)
            .send()
    };
    let fetch = |worker: &str| {
        post(
            "fetch-and-lock".into(),
            json!({"workerId": worker, "topics": ["abada:agent"], "lockDuration": 60000, "maxTasks": 1}),
        )
    };
    let credential = |worker: &str, attempt: u32| {
        post(
            format!("{id}/tool-credentials"),
            json!({"workerId": worker, "attempt": attempt, "server": "orders"}),
        )
    };

    let first: Value = fetch("w-old").await.unwrap().json().await.unwrap();
    assert_eq!(first[0]["attempt"], 1);
    let granted: Value = credential("w-old", 1).await.unwrap().json().await.unwrap();
    let old_token = granted["token"].as_str().unwrap().to_string();
    assert!(
        stack
            .engine
            .verify_tool_credential("orders", &old_token)
            .is_some()
    );
    assert!(
        stack
            .engine
            .verify_tool_credential("billing", &old_token)
            .is_none()
    );

    // The lease runs out (by the emulator's clock: a lease of real seconds would have to
    // outlast each fetch's credential call on a loaded machine) and another worker takes it.
    stack.engine.advance(Duration::from_secs(61));
    let second: Value = fetch("w-new").await.unwrap().json().await.unwrap();
    assert_eq!(second[0]["attempt"], 2);

    let stale = credential("w-old", 1).await.unwrap();
    assert_eq!(stale.status(), 403);
    let body: Value = stale.json().await.unwrap();
    assert_eq!(body["code"], "WORKER_LOCK_NOT_OWNED");
    let old_attempt = credential("w-new", 1).await.unwrap();
    assert_eq!(old_attempt.status(), 409);
    let body: Value = old_attempt.json().await.unwrap();
    assert_eq!(body["code"], "STALE_ATTEMPT");
    assert!(
        stack
            .engine
            .verify_tool_credential("orders", &old_token)
            .is_none(),
        "the stale holder's credential no longer opens the tool server"
    );
    let fresh = credential("w-new", 2).await.unwrap();
    assert_eq!(fresh.status(), 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_tool_credential_goes_only_to_its_server_and_dies_with_the_task() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let billing = stack.start_tool_server("billing").await.unwrap();
    stack.model.set_script(
        "two-servers",
        Script::new(vec![
            Turn::call("orders__lookup_order", json!({"orderId": "${input}"})),
            Turn::call("billing__echo", json!({"note": "charge ${input}"})),
            Turn::call("orders__echo", json!({"note": "again"})),
            Turn::text(r#"{"done": true}"#),
        ]),
    );
    let mut agent = stack.refund_agent("openai/two-servers", &[]);
    agent["toolServers"] = json!([
        {"name": "orders", "url": stack.tools.url()},
        {"name": "billing", "url": billing.url()},
    ]);
    let ids = stack
        .engine
        .create_tasks((0..2).map(|i| spec(agent.clone(), &format!("two-{i}"))));
    let worker = WorkerProcess::spawn(&stack_env(&stack, "creds")).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    assert_all_completed(&views);

    let tokens = |server: &ToolServer| -> Vec<String> {
        server
            .calls()
            .into_iter()
            .map(|c| c.token.unwrap())
            .collect()
    };
    let orders_tokens: HashSet<String> = tokens(&stack.tools).into_iter().collect();
    let billing_tokens: HashSet<String> = tokens(&billing).into_iter().collect();
    assert_eq!(orders_tokens.len(), 2, "one credential per task for orders");
    assert_eq!(
        billing_tokens.len(),
        2,
        "one credential per task for billing"
    );
    assert!(orders_tokens.is_disjoint(&billing_tokens));
    // Neither server was ever shown a credential it does not accept (the other server's).
    assert_eq!(stack.tools.counters().await.unauthorized, 0);
    assert_eq!(billing.counters().await.unauthorized, 0);
    for v in &views {
        assert_eq!(v.counters.credentials_issued, 2, "one per server, per task");
    }

    // The tasks are over: their credentials open nothing, and the worker keeps none.
    for token in orders_tokens.iter() {
        assert!(
            stack
                .engine
                .verify_tool_credential("orders", token)
                .is_none()
        );
    }
    for token in billing_tokens.iter() {
        assert!(
            stack
                .engine
                .verify_tool_credential("billing", token)
                .is_none()
        );
    }
    assert_eq!(stack.tools.counters().await.sessions_open, 0);
    assert_eq!(billing.counters().await.sessions_open, 0);
    let calls_after = (stack.tools.calls().len(), billing.calls().len());
    // A few idle polls later nothing more has reached either server.
    let polls_before = stack.engine.calls().len();
    eventually(Duration::from_secs(10), "three more polls", async || {
        stack.engine.calls().len() >= polls_before + 3
    })
    .await;
    assert_eq!(
        (stack.tools.calls().len(), billing.calls().len()),
        calls_after
    );
    drop(worker);
    billing.shutdown().await;
    stack.shutdown().await;
}
