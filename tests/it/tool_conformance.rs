//! One conformance suite for the tool stand-ins, held to real MCP servers that nobody here
//! wrote: the Node reference server `@modelcontextprotocol/server-everything` and a server of
//! the Python `mcp` SDK (`tests/interop/python_server.py`; both installed by
//! `scripts/install-interop-peers`, as for `mcp_interop.rs`).
//!
//! - On the wire (`wire::`), the same cases run against the two real servers and the devkit's
//!   MCP server (`devkit/src/tools.rs`): the streamable HTTP transport of MCP 2025-06-18 as the
//!   real servers answer it
//!   (<https://modelcontextprotocol.io/specification/2025-06-18/basic/transports>).
//!   Where the specification leaves a choice and the real servers differ, a case accepts what
//!   either does and nothing else: an unknown tool is a JSON-RPC error or an `isError` result;
//!   an ended or unknown session is refused 404 (the Python SDK, as the specification says) or
//!   400 (the Node reference server).
//! - Through the worker's tool seam (`seam::`), what the agent relies on from any tool server:
//!   the rmcp client (`McpSessions`) against the two real servers and the devkit's, and the
//!   simulator's in-process tool server (`src/devkit/world/tools.rs`). A keyed write answered
//!   from storage the second time (protocol.md B.2) is ours, not MCP's: that case runs on the two
//!   stand-ins only.
//!
//! `flaws::` shows the suite can fail: each deliberate departure ([`Flaw`]), played by the
//! client on the devkit server's answers as a stand-in could get them wrong, fails the cases
//! named for it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::devkit::engine::TaskSpec;
use abada_agent_worker::devkit::tools::{AcceptAny, ToolServer, ToolServerOptions};
use abada_agent_worker::engine::{Engine, FetchRequest, TaskRef};
use abada_agent_worker::secret::Secret;
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, McpSessions, TaskTools, ToolConnector, ToolServerRef,
    ToolSessionOptions, ToolSessions,
};
use abada_sim::world::{FaultPlan, World, WorldEngine, WorldOptions, WorldTools};
use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tokio::process::{Child, Command};

use crate::mcp_interop::{repo, spawn_announcing};
use crate::support::peers::installed;

// ---- the servers ------------------------------------------------------------------------------

/// A server under test, and what the cases call on it.
struct Server {
    name: &'static str,
    url: String,
    /// A read-only tool and its arguments.
    read: (&'static str, Value),
    /// A keyed write and its arguments, on the stand-ins (protocol.md B.2).
    write: Option<(&'static str, Value)>,
    _process: Option<Child>,
    devkit: Option<ToolServer>,
}

impl Server {
    async fn devkit() -> Server {
        let server = ToolServer::start(ToolServerOptions::new("orders", Arc::new(AcceptAny)))
            .await
            .expect("the devkit tool server starts");
        Server {
            name: "orders",
            url: server.url(),
            read: ("lookup_order", json!({"orderId": "o-1"})),
            write: Some((
                "issue_refund",
                json!({"orderId": "o-1", "amountCents": 1500}),
            )),
            _process: None,
            devkit: Some(server),
        }
    }

    /// The Node reference server; `None` when it is not installed (and
    /// `ABADA_SKIP_INTEROP=1`: else `installed` fails the test).
    async fn node() -> Option<Server> {
        let bin = installed(
            "node/node_modules/.bin/mcp-server-everything",
            "scripts/install-interop-peers",
        )?;
        let preload: &Path = &repo().join("tests/interop/force-loopback.js");
        let (child, port) = spawn_announcing(
            Command::new("node")
                .arg("-r")
                .arg(preload)
                .arg(&bin)
                .arg("streamableHttp")
                .env("PORT", "0"),
            "mcp-server-everything",
        )
        .await;
        Some(Server {
            name: "everything",
            url: format!("http://127.0.0.1:{port}/mcp"),
            read: ("echo", json!({"message": "hi"})),
            write: None,
            _process: Some(child),
            devkit: None,
        })
    }

    async fn python() -> Option<Server> {
        let python = installed("venv/bin/python", "scripts/install-interop-peers")?;
        let (child, port) = spawn_announcing(
            Command::new(python).arg(repo().join("tests/interop/python_server.py")),
            "python_server.py",
        )
        .await;
        Some(Server {
            name: "pyorders",
            url: format!("http://127.0.0.1:{port}/mcp"),
            read: ("shout", json!({"text": "hey"})),
            write: None,
            _process: Some(child),
            devkit: None,
        })
    }

    async fn stop(self) {
        if let Some(devkit) = self.devkit {
            devkit.shutdown().await;
        }
    }
}

// ---- the wire -----------------------------------------------------------------------------------

const VERSION: &str = "2025-06-18";

/// A deliberate departure of a tool server from what the real ones answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// The `initialize` answer carries no `Mcp-Session-Id`.
    NoSessionId,
    /// The `initialized` notification answered 200 with a body instead of 202.
    NotificationAnswered,
    /// A tool listed without an object `inputSchema`.
    SchemaNotObject,
    /// An unknown tool answered as a success.
    UnknownToolSucceeds,
    /// An unknown method answered with a result.
    MethodFound,
    /// A session still served after its DELETE.
    SessionOutlivesDelete,
    /// Any session id accepted.
    AnySessionAccepted,
}

const FLAWS: [Flaw; 7] = [
    Flaw::NoSessionId,
    Flaw::NotificationAnswered,
    Flaw::SchemaNotObject,
    Flaw::UnknownToolSucceeds,
    Flaw::MethodFound,
    Flaw::SessionOutlivesDelete,
    Flaw::AnySessionAccepted,
];

/// One answer: its status, content type, session header and JSON-RPC message (the JSON body,
/// or the first `data:` of an event stream).
#[derive(Debug)]
struct Reply {
    status: u16,
    content_type: String,
    session: Option<String>,
    message: Option<Value>,
}

impl Reply {
    fn result(&self) -> Option<&Value> {
        self.message.as_ref().and_then(|m| m.get("result"))
    }
    fn error_code(&self) -> Option<i64> {
        self.message
            .as_ref()
            .and_then(|m| m.pointer("/error/code"))
            .and_then(Value::as_i64)
    }
}

/// A raw MCP client on one server, with its session once opened.
struct Wire<'a> {
    http: reqwest::Client,
    server: &'a Server,
    session: Option<String>,
    flaw: Option<Flaw>,
    next_id: u64,
}

enum Session<'s> {
    Own,
    None,
    Other(&'s str),
}

impl<'a> Wire<'a> {
    fn new(server: &'a Server, flaw: Option<Flaw>) -> Self {
        Wire {
            http: reqwest::Client::new(),
            server,
            session: None,
            flaw,
            next_id: 1,
        }
    }

    async fn send(
        &mut self,
        method: reqwest::Method,
        body: Option<String>,
        session: Session<'_>,
        version: &str,
    ) -> Reply {
        let session = match session {
            Session::Own => self.session.clone(),
            Session::None => None,
            Session::Other(id) => Some(id.to_string()),
        };
        let mut request = self
            .http
            .request(method.clone(), &self.server.url)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .header("authorization", "Bearer conformance");
        if let Some(id) = &session {
            request = request
                .header("mcp-session-id", id)
                .header("mcp-protocol-version", version);
        }
        if let Some(body) = body.clone() {
            request = request.body(body);
        }
        // Departures played before the server sees the request.
        if self.flaw == Some(Flaw::SessionOutlivesDelete) && method == reqwest::Method::DELETE {
            return Reply {
                status: 200,
                content_type: String::new(),
                session: None,
                message: None,
            };
        }
        if self.flaw == Some(Flaw::AnySessionAccepted)
            && session.is_some()
            && session != self.session
        {
            let own = self.session.clone();
            return Box::pin(self.send(
                method,
                body,
                own.as_deref().map_or(Session::None, Session::Other),
                version,
            ))
            .await;
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let session = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let text = response.text().await.unwrap_or_default();
        let message = if content_type.starts_with("text/event-stream") {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .find_map(|d| serde_json::from_str(d.trim()).ok())
        } else {
            serde_json::from_str(&text).ok()
        };
        let mut reply = Reply {
            status,
            content_type,
            session,
            message,
        };
        self.depart(&body.unwrap_or_default(), &mut reply);
        reply
    }

    /// Departures played on the server's answer.
    fn depart(&self, request: &str, reply: &mut Reply) {
        let Some(flaw) = self.flaw else { return };
        let request: Value = serde_json::from_str(request).unwrap_or(Value::Null);
        let method = request["method"].as_str().unwrap_or_default();
        match (flaw, method) {
            (Flaw::NoSessionId, "initialize") => reply.session = None,
            (Flaw::NotificationAnswered, "notifications/initialized") => {
                reply.status = 200;
                reply.message = Some(json!({"jsonrpc": "2.0", "result": {}}));
            }
            (Flaw::SchemaNotObject, "tools/list") => {
                if let Some(tools) = reply
                    .message
                    .as_mut()
                    .and_then(|m| m.pointer_mut("/result/tools"))
                    .and_then(Value::as_array_mut)
                    && let Some(first) = tools.first_mut()
                {
                    first["inputSchema"] = json!({"type": "string"});
                }
            }
            (Flaw::UnknownToolSucceeds, "tools/call") => {
                reply.message = Some(json!({"jsonrpc": "2.0", "id": request["id"],
                    "result": {"content": [{"type": "text", "text": "done"}]}}));
            }
            (Flaw::MethodFound, "foo/bar") => {
                reply.message = Some(json!({"jsonrpc": "2.0", "id": request["id"], "result": {}}));
            }
            _ => {}
        }
    }

    fn request(&mut self, method: &str, params: Value) -> String {
        self.next_id += 1;
        json!({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
            .to_string()
    }

    async fn call(&mut self, method: &str, params: Value) -> Reply {
        let body = self.request(method, params);
        self.send(reqwest::Method::POST, Some(body), Session::Own, VERSION)
            .await
    }

    async fn initialize(&mut self) -> Reply {
        let body = self.request(
            "initialize",
            json!({"protocolVersion": VERSION, "capabilities": {},
                   "clientInfo": {"name": "abada-conformance", "version": "1"}}),
        );
        let reply = self
            .send(reqwest::Method::POST, Some(body), Session::None, VERSION)
            .await;
        self.session = reply.session.clone();
        reply
    }

    async fn initialized(&mut self) -> Reply {
        let body = json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string();
        self.send(reqwest::Method::POST, Some(body), Session::Own, VERSION)
            .await
    }

    /// The handshake, checked by [`handshake`]; the other cases start from it.
    async fn open(&mut self) -> Verdict {
        let reply = self.initialize().await;
        check(reply.session.is_some(), || "no Mcp-Session-Id".into())?;
        let reply = self.initialized().await;
        check(reply.status == 202, || format!("initialized: {reply:?}"))
    }
}

type Verdict = Result<(), String>;

fn check(ok: bool, what: impl FnOnce() -> String) -> Verdict {
    if ok { Ok(()) } else { Err(what()) }
}

/// `initialize` answers the version asked for (each server supports it), its tools capability
/// and its name, on a JSON or event-stream answer, with a session id of visible ASCII
/// (0x21 to 0x7E); `notifications/initialized` is accepted with 202 and no body.
async fn handshake(w: &mut Wire<'_>) -> Verdict {
    let reply = w.initialize().await;
    check(reply.status == 200, || format!("initialize: {reply:?}"))?;
    check(
        reply.content_type.starts_with("application/json")
            || reply.content_type.starts_with("text/event-stream"),
        || format!("content type {:?}", reply.content_type),
    )?;
    let result = reply
        .result()
        .ok_or_else(|| format!("no result: {reply:?}"))?;
    check(result["protocolVersion"] == VERSION, || {
        format!("protocol version {}", result["protocolVersion"])
    })?;
    check(result["capabilities"]["tools"].is_object(), || {
        format!("capabilities {}", result["capabilities"])
    })?;
    check(result["serverInfo"]["name"].is_string(), || {
        format!("serverInfo {}", result["serverInfo"])
    })?;
    let session = reply.session.clone().ok_or("no Mcp-Session-Id")?;
    check(
        !session.is_empty() && session.bytes().all(|b| (0x21..=0x7e).contains(&b)),
        || format!("session id {session:?}"),
    )?;
    let reply = w.initialized().await;
    check(reply.status == 202 && reply.message.is_none(), || {
        format!("initialized: {reply:?}")
    })
}

/// `tools/list`: every tool named, with an object input schema; annotations, when given, with
/// a boolean `readOnlyHint`; the server's read tool among them.
async fn listing(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let reply = w.call("tools/list", json!({})).await;
    let tools = reply
        .result()
        .and_then(|r| r["tools"].as_array())
        .ok_or_else(|| format!("tools/list: {reply:?}"))?;
    check(!tools.is_empty(), || "no tools".into())?;
    for tool in tools {
        check(tool["name"].as_str().is_some_and(|n| !n.is_empty()), || {
            format!("a tool without a name: {tool}")
        })?;
        check(tool["inputSchema"]["type"] == "object", || {
            format!("{}: input schema {}", tool["name"], tool["inputSchema"])
        })?;
        if let Some(hint) = tool.pointer("/annotations/readOnlyHint") {
            check(hint.is_boolean(), || {
                format!("{}: readOnlyHint {hint}", tool["name"])
            })?;
        }
    }
    let read = w.server.read.0;
    check(tools.iter().any(|t| t["name"] == read), || {
        format!("no tool {read}")
    })
}

/// A tool nobody has: a JSON-RPC error, or a result flagged `isError` (both real servers).
async fn unknown_tool(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let reply = w
        .call(
            "tools/call",
            json!({"name": "no_such_tool", "arguments": {}}),
        )
        .await;
    let refused = reply.error_code().is_some()
        || reply
            .result()
            .is_some_and(|r| r["isError"] == true && r["content"].is_array());
    check(refused, || format!("an unknown tool: {reply:?}"))
}

/// A method nobody has: JSON-RPC `-32601`.
async fn unknown_method(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let reply = w.call("foo/bar", json!({})).await;
    check(
        reply.error_code() == Some(-32601) && reply.result().is_none(),
        || format!("an unknown method: {reply:?}"),
    )
}

/// Requests the transport refuses with 400: no session id after the handshake, an unsupported
/// `MCP-Protocol-Version`, a body that is not JSON (a JSON-RPC `-32700` when there is a body).
async fn bad_requests(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let body = w.request("tools/list", json!({}));
    let reply = w
        .send(reqwest::Method::POST, Some(body), Session::None, VERSION)
        .await;
    check(reply.status == 400 && reply.result().is_none(), || {
        format!("no session: {reply:?}")
    })?;
    let body = w.request("tools/list", json!({}));
    let reply = w
        .send(
            reqwest::Method::POST,
            Some(body),
            Session::Own,
            "1999-01-01",
        )
        .await;
    check(reply.status == 400 && reply.result().is_none(), || {
        format!("an unsupported version: {reply:?}")
    })?;
    let reply = w
        .send(
            reqwest::Method::POST,
            Some("{\"jsonrpc\":".into()),
            Session::Own,
            VERSION,
        )
        .await;
    check(
        reply.status == 400
            && reply
                .message
                .as_ref()
                .is_none_or(|_| reply.error_code() == Some(-32700)),
        || format!("not JSON: {reply:?}"),
    )
}

/// A session ends with its DELETE (a success: the specification names no status; both real
/// servers answer 200, rmcp's server 202); a request on it then is refused (404, or 400 from the
/// Node server) with no result.
async fn session_end(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let reply = w
        .send(reqwest::Method::DELETE, None, Session::Own, VERSION)
        .await;
    check(matches!(reply.status, 200 | 202 | 204), || {
        format!("DELETE: {reply:?}")
    })?;
    let reply = w.call("tools/list", json!({})).await;
    check(
        matches!(reply.status, 400 | 404) && reply.result().is_none(),
        || format!("after DELETE: {reply:?}"),
    )
}

/// A session id the server never gave: refused (404, or 400 from the Node server), no result.
async fn unknown_session(w: &mut Wire<'_>) -> Verdict {
    w.open().await?;
    let body = w.request("tools/list", json!({}));
    let reply = w
        .send(
            reqwest::Method::POST,
            Some(body),
            Session::Other("no-such-session-0000"),
            VERSION,
        )
        .await;
    check(
        matches!(reply.status, 400 | 404) && reply.result().is_none(),
        || format!("an unknown session: {reply:?}"),
    )
}

type Case = for<'a, 'b> fn(
    &'a mut Wire<'b>,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Verdict> + Send + 'a>,
>;

const CASES: [(&str, Case); 7] = [
    ("handshake", |w| Box::pin(handshake(w))),
    ("listing", |w| Box::pin(listing(w))),
    ("unknown_tool", |w| Box::pin(unknown_tool(w))),
    ("unknown_method", |w| Box::pin(unknown_method(w))),
    ("bad_requests", |w| Box::pin(bad_requests(w))),
    ("session_end", |w| Box::pin(session_end(w))),
    ("unknown_session", |w| Box::pin(unknown_session(w))),
];

async fn failures(server: &Server, flaw: Option<Flaw>) -> Vec<(&'static str, String)> {
    let mut failed = Vec::new();
    for (name, case) in CASES {
        let mut wire = Wire::new(server, flaw);
        if let Err(why) = case(&mut wire).await {
            failed.push((name, why));
        }
    }
    failed
}

mod wire {
    use super::*;

    #[tokio::test]
    async fn the_node_reference_server() {
        let Some(server) = Server::node().await else {
            return;
        };
        let failed = failures(&server, None).await;
        assert!(failed.is_empty(), "{}: {failed:#?}", server.name);
    }

    #[tokio::test]
    async fn the_python_sdk_server() {
        let Some(server) = Server::python().await else {
            return;
        };
        let failed = failures(&server, None).await;
        assert!(failed.is_empty(), "{}: {failed:#?}", server.name);
    }

    /// The devkit's server answers every case as the real ones do.
    #[tokio::test]
    async fn the_devkit_server() {
        let server = Server::devkit().await;
        let failed = failures(&server, None).await;
        assert!(failed.is_empty(), "{}: {failed:#?}", server.name);
        server.stop().await;
    }
}

mod flaws {
    use super::*;

    /// Each deliberate departure fails the cases written for it (the sound devkit server passes
    /// them all, `wire::`).
    #[tokio::test]
    async fn every_departure_from_the_real_servers_fails_its_cases() {
        let expected: [(Flaw, &[&str]); 7] = [
            (
                Flaw::NoSessionId,
                &["handshake", "listing", "unknown_tool", "session_end"],
            ),
            (Flaw::NotificationAnswered, &["handshake", "listing"]),
            (Flaw::SchemaNotObject, &["listing"]),
            (Flaw::UnknownToolSucceeds, &["unknown_tool"]),
            (Flaw::MethodFound, &["unknown_method"]),
            (Flaw::SessionOutlivesDelete, &["session_end"]),
            (Flaw::AnySessionAccepted, &["unknown_session"]),
        ];
        assert_eq!(expected.len(), FLAWS.len(), "a flaw without its cases");
        let server = Server::devkit().await;
        let mut report = Vec::new();
        for (flaw, cases) in expected {
            let failed: Vec<&str> = failures(&server, Some(flaw))
                .await
                .into_iter()
                .map(|(case, _)| case)
                .collect();
            for case in cases {
                assert!(
                    failed.contains(case),
                    "{flaw:?}: {case} passed; failed: {failed:?}"
                );
            }
            report.push(format!("{flaw:?}: {failed:?}"));
        }
        server.stop().await;
        eprintln!("{}", report.join("\n"));
    }
}

// ---- through the tool seam ------------------------------------------------------------------

/// A fixed credential for every server (the real servers ignore it; the devkit's accepts any).
struct Fixed(String);

#[async_trait]
impl CredentialSource for Fixed {
    async fn credential(&self, _server: &str) -> Result<Option<Secret>, CredentialError> {
        Ok(Some(Secret::new(self.0.clone())))
    }
}

fn args(value: &Value) -> Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

/// What the agent relies on from a task's tool sessions on `server`: its tools listed under
/// its name with object schemas, the read tool read-only (and the write tool not); the read
/// tool answers without error; a tool nobody has is an error, not a result taken for an answer.
async fn seam_cases(
    sessions: &mut dyn ToolSessions,
    server: &str,
    read: &(&str, Value),
    write: Option<&(&str, Value)>,
) -> Verdict {
    let tools = sessions
        .tools()
        .await
        .map_err(|e| format!("listing: {e}"))?;
    check(!tools.is_empty(), || "no tools".into())?;
    for tool in &tools {
        check(tool.server == server && !tool.tool.is_empty(), || {
            format!("listed {}/{}", tool.server, tool.tool)
        })?;
        check(tool.input_schema["type"] == "object", || {
            format!("{}: schema {}", tool.tool, tool.input_schema)
        })?;
    }
    let spec = |name: &str| tools.iter().find(|t| t.tool == name);
    check(spec(read.0).is_some_and(|t| t.read_only), || {
        format!("{} is not a listed read-only tool", read.0)
    })?;
    if let Some((write, _)) = write {
        check(spec(write).is_some_and(|t| !t.read_only), || {
            format!("{write} is not a listed write")
        })?;
    }
    let answer = sessions
        .call(server, read.0, args(&read.1), None)
        .await
        .map_err(|e| format!("{}: {e}", read.0))?;
    check(!answer.is_error && !answer.content.is_empty(), || {
        format!("{}: {answer:?}", read.0)
    })?;
    match sessions
        .call(server, "no_such_tool", Map::new(), None)
        .await
    {
        Err(_) => {}
        Ok(result) => check(result.is_error, || {
            format!("an unknown tool answered {result:?}")
        })?,
    }
    Ok(())
}

/// A keyed write sent twice under one key: the same answer, applied once (protocol.md B.2).
async fn keyed_write_once(
    sessions: &mut dyn ToolSessions,
    server: &str,
    write: &(&str, Value),
) -> Result<(), String> {
    let key = "abada:t-conformance:3";
    let first = sessions
        .call(server, write.0, args(&write.1), Some(key))
        .await
        .map_err(|e| format!("first write: {e}"))?;
    let second = sessions
        .call(server, write.0, args(&write.1), Some(key))
        .await
        .map_err(|e| format!("second write: {e}"))?;
    check(!first.is_error && first.content == second.content, || {
        format!("{first:?} then {second:?}")
    })
}

fn mcp_sessions(server: &Server) -> McpSessions {
    McpSessions::new(
        reqwest::Client::new(),
        vec![ToolServerRef {
            name: server.name.into(),
            url: server.url.clone(),
        }],
        Arc::new(Fixed(format!("{}-credential", server.name))),
        None,
        ToolSessionOptions {
            open_timeout: Duration::from_secs(20),
            call_timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
}

mod seam {
    use super::*;

    #[tokio::test]
    async fn the_real_servers_through_the_rmcp_client() {
        for server in [Server::node().await, Server::python().await]
            .into_iter()
            .flatten()
        {
            let mut sessions = mcp_sessions(&server);
            seam_cases(&mut sessions, server.name, &server.read, None)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", server.name));
            sessions.close().await;
        }
    }

    #[tokio::test]
    async fn the_devkit_server_through_the_rmcp_client() {
        let server = Server::devkit().await;
        let mut sessions = mcp_sessions(&server);
        seam_cases(
            &mut sessions,
            server.name,
            &server.read,
            server.write.as_ref(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let write = server.write.clone().expect("the devkit has a write");
        keyed_write_once(&mut sessions, server.name, &write)
            .await
            .unwrap();
        sessions.close().await;
        let counters = server.devkit.as_ref().unwrap().counters().await;
        assert_eq!(
            (counters.writes_applied, counters.duplicates),
            (1, 1),
            "{counters:?}"
        );
        server.stop().await;
    }

    /// The simulator's tool server: sessions opened with a credential its engine issued to a
    /// task's lease, as the production source asks for it.
    #[tokio::test(start_paused = true)]
    async fn the_simulators_tool_server() {
        let world = World::new(WorldOptions {
            seed: 1,
            lock_duration: Duration::from_secs(30),
            faults: FaultPlan::default(),
            store_journal: false,
        });
        world.core().create_task(TaskSpec::default());
        let engine = WorldEngine::new(world.clone(), "w1");
        let task = engine
            .fetch_and_lock(&FetchRequest {
                topics: vec!["abada:agent".into()],
                lock_duration: Duration::from_secs(30),
                max_tasks: 1,
            })
            .await
            .unwrap()
            .remove(0);
        struct Issued(WorldEngine, TaskRef);
        #[async_trait]
        impl CredentialSource for Issued {
            async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
                let issued = self.0.tool_credential(&self.1, server).await.map_err(|e| {
                    CredentialError::Transient {
                        server: server.into(),
                        reason: e.to_string(),
                    }
                })?;
                Ok(Some(issued.token))
            }
        }
        let server = abada_sim::world::tools::SERVER;
        let mut sessions = WorldTools::new(world.clone(), "w1").sessions(TaskTools {
            servers: Vec::new(),
            credentials: Arc::new(Issued(engine, task.task_ref())),
            traceparent: None,
            cleanup: Default::default(),
            unregistered: None,
        });
        let read = ("sim_lookup", json!({"task": "k1"}));
        let write = ("sim_write", json!({"task": "k1", "n": 1}));
        seam_cases(sessions.as_mut(), server, &read, Some(&write))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        keyed_write_once(sessions.as_mut(), server, &write)
            .await
            .unwrap();
        sessions.close().await;
        let applied = world
            .trace()
            .events
            .iter()
            .filter(|(_, e)| {
                matches!(e, abada_sim::world::Event::ToolCall { answer, write: Some(_), .. } if *answer == "applied")
            })
            .count();
        assert_eq!(applied, 1, "the keyed write applied once");
    }
}
