//! The world's tool server, behind the agent runtime's [`ToolConnector`] seam: a read-only
//! `sim_lookup` and a keyed write `sim_write`, and the ledger of writes applied. A write with an
//! idempotency key already applied is answered from the ledger without applying it again (as a
//! well-behaved MCP server does); a write without a key is applied every time it arrives.
//! Like an MCP server behind the engine's per-task credentials, it asks each task's session
//! for its credential once (the production `CredentialSource`: the engine's `tool-credentials`
//! for the lease) and refuses one the engine did not issue (401).
//! Faults: 5xx, slowness, and a write applied whose answer is lost. Every call is recorded, so
//! the invariants can count the applications of each logical write.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value, json};

use super::World;
use super::trace::Event;
use abada_agent_worker::conversation::{ToolResult, ToolSpec};
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, TaskTools, ToolConnector, ToolError, ToolSessions,
};

/// The one server of the world's tools, as a definition names it.
pub const SERVER: &str = "simtools";
/// Its URL in definitions: never connected (the connector is in-process).
pub const URL: &str = "http://127.0.0.1:9/mcp";

/// The writes applied, shared by every worker: by idempotency key, the result sent.
#[derive(Debug, Default)]
pub struct Ledger {
    pub(crate) by_key: BTreeMap<String, ToolResult>,
}

/// One worker's connector to the world's tool server.
pub struct WorldTools {
    world: Arc<World>,
    worker_id: String,
}

impl WorldTools {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldTools {
            world,
            worker_id: worker_id.into(),
        }
    }
}

impl ToolConnector for WorldTools {
    fn sessions(&self, task: TaskTools) -> Box<dyn ToolSessions> {
        Box::new(WorldSessions {
            world: self.world.clone(),
            worker_id: self.worker_id.clone(),
            credentials: task.credentials,
            authorized: false,
        })
    }
}

struct WorldSessions {
    world: Arc<World>,
    worker_id: String,
    credentials: Arc<dyn CredentialSource>,
    /// The session was opened with a credential the engine issued.
    authorized: bool,
}

impl WorldSessions {
    fn unavailable(&self, reason: &str) -> ToolError {
        ToolError::Unavailable {
            server: SERVER.into(),
            reason: reason.into(),
        }
    }

    /// Opens the session on first use: the task's credential, checked against those the
    /// engine issued.
    async fn open(&mut self) -> Result<(), ToolError> {
        if self.authorized {
            return Ok(());
        }
        if self.world.store_journal {
            // A plain engine issues no per-task credential: the workers reach the server
            // through the operator's registry entry, which has no authentication (`sim::worker`).
            self.authorized = true;
            return Ok(());
        }
        let credential = self
            .credentials
            .credential(SERVER)
            .await
            .map_err(|e| match e {
                CredentialError::LeaseLost { server } => ToolError::CredentialRefused { server },
                CredentialError::Transient { server, reason } => ToolError::Unavailable {
                    server,
                    reason: format!("no credential: {reason}"),
                },
            })?;
        let issued = credential.is_some_and(|c| self.world.issued(c.expose()));
        if !issued {
            return Err(ToolError::Unauthorized {
                server: SERVER.into(),
            });
        }
        self.authorized = true;
        Ok(())
    }

    fn record(&self, task: &str, write: Option<u64>, key: Option<&str>, answer: &'static str) {
        self.world.record(Event::ToolCall {
            worker: self.worker_id.clone(),
            task: task.to_string(),
            write,
            key: key.map(str::to_string),
            answer,
        });
    }
}

fn spec(tool: &str, read_only: bool) -> ToolSpec {
    ToolSpec {
        server: SERVER.into(),
        tool: tool.into(),
        description: format!("the simulation's {tool}"),
        input_schema: json!({"type": "object"}),
        read_only,
        destructive: false,
    }
}

#[async_trait]
impl ToolSessions for WorldSessions {
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, ToolError> {
        self.open().await?;
        Ok(vec![spec("sim_lookup", true), spec("sim_write", false)])
    }

    async fn call(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<ToolResult, ToolError> {
        if server != SERVER || !matches!(tool, "sim_lookup" | "sim_write") {
            return Err(ToolError::UnknownTool {
                server: server.into(),
                tool: tool.into(),
            });
        }
        let task = arguments
            .get("task")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let write = (tool == "sim_write")
            .then(|| arguments.get("n").and_then(Value::as_u64))
            .flatten();
        self.open().await?;
        self.world.hold(&self.worker_id).await;
        let now = self.world.elapsed_ms();
        let (p5xx, slow, slow_max, lost) = {
            let f = self.world.faults();
            if f.active(now) {
                let p = &f.plan;
                (p.tool_5xx, p.tool_slow, p.tool_slow_max, p.tool_answer_lost)
            } else {
                (0.0, 0.0, Duration::ZERO, 0.0)
            }
        };
        if slow > 0.0 && self.world.draw() < slow {
            self.world.faults().count("tool slow");
            tokio::time::sleep(slow_max.mul_f64(self.world.draw())).await;
            self.world.hold(&self.worker_id).await;
        }
        if p5xx > 0.0 && self.world.draw() < p5xx {
            self.world.faults().count("tool 5xx");
            self.record(&task, write, idempotency_key, "5xx");
            return Err(self.unavailable("HTTP 502 (simulated)"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let Some(n) = write else {
            self.record(&task, None, None, "read");
            return Ok(ToolResult {
                content: vec![json!({"type": "text", "text": lookup_text(&task)})],
                structured_content: None,
                is_error: false,
            });
        };
        let result = ToolResult {
            content: vec![json!({"type": "text", "text": receipt_text(&task, n)})],
            structured_content: None,
            is_error: false,
        };
        let deduplicated = idempotency_key.and_then(|k| self.world.ledger().by_key.get(k).cloned());
        if let Some(stored) = deduplicated {
            self.record(&task, write, idempotency_key, "deduplicated");
            return Ok(stored);
        }
        if let Some(k) = idempotency_key {
            self.world
                .ledger()
                .by_key
                .insert(k.to_string(), result.clone());
        }
        if lost > 0.0 && self.world.draw() < lost {
            self.world.faults().count("tool write answer lost");
            self.record(&task, write, idempotency_key, "applied-answer-lost");
            return Err(self.unavailable("connection reset after the write (simulated)"));
        }
        self.record(&task, write, idempotency_key, "applied");
        Ok(result)
    }

    async fn close(&mut self) {}
}

/// The lookup's answer: an order record of about 1.2 KB, as a real lookup returns (what a small
/// context window makes the worker elide).
fn lookup_text(task: &str) -> String {
    let mut text = format!("order of {task}: ok");
    for line in 0..24 {
        text.push_str(&format!(
            "; line {line:02}: 1 x item-{line:02} at 10.00 EUR"
        ));
    }
    text
}

/// A write's receipt, of about 470 bytes: longer than the worker's stub for an elided result,
/// so only the rule that keeps keyed results keeps it whole.
pub(crate) fn receipt_text(task: &str, n: u64) -> String {
    let mut text = format!("write {n} of {task} applied");
    for line in 0..16 {
        text.push_str(&format!("; receipt {line:02}: ok at 10:00:{line:02}"));
    }
    text
}
