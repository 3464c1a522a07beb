//! The real `abada-agent-worker` binary as a child process, for tests that need signals,
//! exit codes, the OS's view of the process, or its raw log output.
//!
//! `WorkerProcess::spawn` starts the binary with a cleared environment plus the given variables
//! (admin endpoints on `127.0.0.1:0`, JSON logs), collects every stdout/stderr line, and learns
//! the admin address from the start-up log line. The child is killed when the handle is dropped.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::devkit::stack::Stack;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const BIN: &str = env!("CARGO_BIN_EXE_abada-agent-worker");

/// The binary to run: `ABADA_AGENT_WORKER_BIN` when set (the release build, to measure its
/// memory: `docs/FAULTS.md`), else the test build's.
pub fn bin() -> String {
    std::env::var("ABADA_AGENT_WORKER_BIN").unwrap_or_else(|_| BIN.to_string())
}

pub struct WorkerProcess {
    child: Child,
    pub pid: u32,
    pub admin: Option<SocketAddr>,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
}

/// The variables that point a worker process at the in-process stack (providers `openai` and
/// `anthropic` both served by the scripted model).
pub fn stack_env(stack: &Stack, worker_id: &str) -> Vec<(String, String)> {
    [
        ("ABADA_AGENT_ENGINE_URL", stack.engine.base_url()),
        ("ABADA_AGENT_WORKER_ID", worker_id.to_string()),
        ("ABADA_AGENT_PROVIDERS", "openai,anthropic".into()),
        (
            "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL",
            stack.model.base_url_openai(),
        ),
        (
            "ABADA_AGENT_PROVIDER_ANTHROPIC_BASE_URL",
            stack.model.base_url_anthropic(),
        ),
        ("ABADA_AGENT_POLL_INTERVAL_MS", "200".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

impl WorkerProcess {
    /// Starts the daemon and waits until its admin endpoints listen.
    pub async fn spawn(env: &[(String, String)]) -> WorkerProcess {
        let mut p = Self::spawn_raw(&[], env);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(addr) = p.find_admin_addr() {
                p.admin = Some(addr);
                return p;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!(
                    "worker exited with {status} before listening:\n{}\n{}",
                    p.stdout().join("\n"),
                    p.stderr().join("\n")
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "worker did not start listening:\n{}",
                p.stdout().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the binary with `args` and exactly `env` (plus PATH, and defaults for the admin
    /// address and log format unless given), without waiting for anything.
    pub fn spawn_raw(args: &[&str], env: &[(String, String)]) -> WorkerProcess {
        let mut cmd = Command::new(bin());
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("ABADA_AGENT_HTTP_ADDR", "127.0.0.1:0")
            .env("ABADA_AGENT_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("the worker binary starts");
        let pid = child.id().expect("a running child has a pid");
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for (pipe, sink) in [
            (
                Box::new(out) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                stdout.clone(),
            ),
            (Box::new(err), stderr.clone()),
        ] {
            tokio::spawn(async move {
                let mut lines = BufReader::new(pipe).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    sink.lock().unwrap().push(line);
                }
            });
        }
        WorkerProcess {
            child,
            pid,
            admin: None,
            stdout,
            stderr,
        }
    }

    fn find_admin_addr(&self) -> Option<SocketAddr> {
        self.stdout().iter().find_map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).ok()?;
            v.get("admin_addr")?.as_str()?.parse().ok()
        })
    }

    pub fn stdout(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends a signal by name (`TERM`, `INT`, `KILL`, `STOP`, `CONT`).
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid.to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} {} failed", self.pid);
    }

    /// Waits for the process to exit, at most `limit`.
    pub async fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .expect("the worker did not exit in time")
            .expect("waiting on the worker")
    }

    /// GET on the admin endpoints: status and body.
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let addr = self.admin.expect("spawned with spawn()");
        let resp = reqwest::get(format!("http://{addr}{path}"))
            .await
            .expect("admin endpoint answers");
        (
            resp.status().as_u16(),
            resp.text().await.unwrap_or_default(),
        )
    }
}
