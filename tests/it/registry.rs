//! The operator's tool-server registry (src/tools/registry.rs, src/tools/address.rs) against
//! devkit MCP tool servers and oauth2-mock-server over real HTTP on 127.0.0.1: which credential
//! reaches which server, refreshes, redirects, refused addresses, start-up errors, and refund
//! agents run end to end through the emulator with a registry.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::app::{Seams, Worker};
use abada_agent_worker::config::{self, Config};
use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskStatus};
use abada_agent_worker::devkit::stack::Stack;
use abada_agent_worker::devkit::tools::{
    AcceptAny, CredentialValidator, StaticTokens, ToolServer, ToolServerOptions,
};
use abada_agent_worker::devkit::workers::{self, StackWorkers, WorkerOptions, worker_env};
use abada_agent_worker::secret::Secret;
use abada_agent_worker::tools::address::GuardedResolver;
use abada_agent_worker::tools::registry::{
    NamedServer, ServerResolutionError, ToolRegistry, ToolsFile,
};
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, McpSessions, ToolError, ToolServerRef, ToolSessionOptions,
};
use async_trait::async_trait;
use serde_json::json;

use crate::agent::{spec, wait_all_ended};
use crate::support::peers::mock_issuer;
use crate::support::scratch::ScratchDir as Dir;
use crate::tools::args;

/// The engine's credential, which no test here may ask for.
struct NoEngine;

#[async_trait]
impl CredentialSource for NoEngine {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        panic!("the engine was asked for a credential for {server}");
    }
}

/// Accepts any token not revoked, and records nothing (the server records the calls).
#[derive(Default)]
struct Revocable(Mutex<HashSet<String>>);

impl Revocable {
    fn revoke(&self, token: &str) {
        self.0.lock().unwrap().insert(token.to_string());
    }
}

impl CredentialValidator for Revocable {
    fn validate(&self, _server: &str, token: &str) -> bool {
        !token.is_empty() && !self.0.lock().unwrap().contains(token)
    }
}

async fn tool_server(name: &str, validator: Arc<dyn CredentialValidator>) -> ToolServer {
    ToolServer::start(ToolServerOptions::new(name, validator))
        .await
        .unwrap()
}

fn registry(text: &str) -> ToolRegistry {
    let file = ToolsFile::parse(text, Path::new("tools.toml")).unwrap();
    ToolRegistry::start(file, reqwest::Client::builder()).unwrap()
}

fn named(names: &[&str]) -> Vec<NamedServer> {
    names
        .iter()
        .map(|n| NamedServer {
            name: n.to_string(),
            url: None,
        })
        .collect()
}

/// One task's sessions over `names`, resolved against `registry`, on the tools' own client.
fn task_sessions(registry: &ToolRegistry, names: &[&str]) -> McpSessions {
    let resolved = ToolRegistry::resolve(Some(registry), &named(names), false).unwrap();
    let credentials = resolved.credentials(Arc::new(NoEngine));
    McpSessions::new(
        abada_agent_worker::tools::http_client(reqwest::Client::builder()).unwrap(),
        resolved.servers,
        Arc::new(credentials),
        None,
        ToolSessionOptions {
            open_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
}

async fn lookup(sessions: &mut McpSessions, server: &str) -> Result<(), ToolError> {
    sessions
        .call(
            server,
            "lookup_order",
            args(json!({"orderId": "o-1"})),
            None,
        )
        .await
        .map(|r| assert!(!r.is_error, "{r:?}"))
}

fn tokens_seen(server: &ToolServer) -> Vec<Option<String>> {
    server.calls().into_iter().map(|c| c.token).collect()
}

#[tokio::test]
async fn a_bearer_token_goes_on_every_call_and_a_rotated_file_is_used() {
    let dir = Dir::new("registry");
    let token_file = dir.write("orders-token", "tok-1\n");
    let validator = Arc::new(Revocable::default());
    let orders = tool_server("orders", validator.clone()).await;
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{}\"\nauth = \"bearer\"\ntokenFile = \"{}\"\n",
        orders.url(),
        token_file.display()
    ));

    let mut task1 = task_sessions(&registry, &["orders"]);
    lookup(&mut task1, "orders").await.unwrap();
    lookup(&mut task1, "orders").await.unwrap();
    task1.close().await;
    assert_eq!(tokens_seen(&orders), vec![Some("tok-1".to_string()); 2]);

    // The file is rotated: the next task sends the new token.
    dir.write("orders-token", "tok-2-rotated\n");
    let mut task2 = task_sessions(&registry, &["orders"]);
    lookup(&mut task2, "orders").await.unwrap();

    // Mid-task, the server stops accepting the token and the file is rotated again: the 401 is
    // answered by one new session with the re-read token, and the call goes through.
    validator.revoke("tok-2-rotated");
    dir.write("orders-token", "tok-3\n");
    lookup(&mut task2, "orders").await.unwrap();
    // Revoked with no newer file: the refusal stands after one re-read, no loop.
    validator.revoke("tok-3");
    let e = lookup(&mut task2, "orders").await.unwrap_err();
    assert!(matches!(e, ToolError::Unauthorized { .. }), "{e}");
    assert!(!e.to_string().contains("tok-3"), "{e}");
    task2.close().await;
    assert_eq!(
        tokens_seen(&orders),
        ["tok-1", "tok-1", "tok-2-rotated", "tok-3"]
            .map(|t| Some(t.to_string()))
            .to_vec()
    );
    orders.shutdown().await;
}

#[tokio::test]
async fn a_credential_never_reaches_another_server() {
    let dir = Dir::new("registry");
    let token_file = dir.write("orders-token", "orders-only-token");
    let orders = tool_server("orders", Arc::new(StaticTokens::new(["orders-only-token"]))).await;
    let public =
        ToolServer::start(ToolServerOptions::new("public", Arc::new(AcceptAny)).anonymous())
            .await
            .unwrap();
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{}\"\nauth = \"bearer\"\ntokenFile = \"{}\"\n\
         [servers.public]\nurl = \"{}\"\nauth = \"none\"\n",
        orders.url(),
        token_file.display(),
        public.url()
    ));
    let mut sessions = task_sessions(&registry, &["orders", "public"]);
    assert_eq!(sessions.tools().await.unwrap().len(), 8);
    lookup(&mut sessions, "public").await.unwrap();
    lookup(&mut sessions, "orders").await.unwrap();
    lookup(&mut sessions, "public").await.unwrap();
    sessions.close().await;
    assert_eq!(tokens_seen(&public), vec![None, None]);
    assert_eq!(
        tokens_seen(&orders),
        vec![Some("orders-only-token".to_string())]
    );
    let c = public.counters().await;
    assert_eq!((c.sessions_opened, c.sessions_closed), (1, 1), "{c:?}");
    orders.shutdown().await;
    public.shutdown().await;
}

/// Answers every request with a 307 to `to`, and counts them.
async fn redirector(to: String) -> (String, Arc<Mutex<u32>>) {
    let hits = Arc::new(Mutex::new(0));
    let counted = hits.clone();
    let router = axum::Router::new().fallback(move || {
        let to = to.clone();
        let counted = counted.clone();
        async move {
            *counted.lock().unwrap() += 1;
            (
                axum::http::StatusCode::TEMPORARY_REDIRECT,
                [(axum::http::header::LOCATION, to)],
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, hits)
}

#[tokio::test]
async fn a_redirect_to_another_origin_is_not_followed_with_the_credential() {
    let dir = Dir::new("registry");
    let token_file = dir.write("orders-token", "redirect-me-token");
    // The other origin would accept anything: had the worker followed, it would show.
    let elsewhere = tool_server("elsewhere", Arc::new(AcceptAny)).await;
    let (url, hits) = redirector(elsewhere.url()).await;
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{url}\"\nauth = \"bearer\"\ntokenFile = \"{}\"\n",
        token_file.display()
    ));
    let mut sessions = task_sessions(&registry, &["orders"]);
    let e = sessions.tools().await.unwrap_err();
    assert!(e.to_string().contains("307"), "{e}");
    assert!(!e.to_string().contains("redirect-me-token"), "{e}");
    assert!(*hits.lock().unwrap() >= 1);
    let c = elsewhere.counters().await;
    assert_eq!((c.unauthorized, c.sessions_opened), (0, 0), "{c:?}");
    assert!(elsewhere.calls().is_empty());
    elsewhere.shutdown().await;
}

/// Resolves every name to fixed addresses (the test's DNS).
struct FixedDns(Vec<SocketAddr>);

impl reqwest::dns::Resolve for FixedDns {
    fn resolve(&self, _name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let addrs = self.0.clone();
        Box::pin(async move { Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs) })
    }
}

#[tokio::test]
async fn a_name_resolving_to_a_metadata_address_is_refused_at_connect_time() {
    let orders = tool_server("orders", Arc::new(AcceptAny)).await;
    // The name resolves to the real server first, then to the metadata address (a rebinding
    // answer): a guard that let the connection go would reach the loopback server, never the
    // metadata address, and the test would see the call.
    let dns = FixedDns(vec![orders.addr(), "169.254.169.254:80".parse().unwrap()]);
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .dns_resolver(GuardedResolver::over(Arc::new(dns)))
        .build()
        .unwrap();
    let mut sessions = McpSessions::new(
        client,
        vec![ToolServerRef {
            name: "orders".into(),
            url: format!("http://localhost:{}/mcp", orders.addr().port()),
        }],
        Arc::new(crate::tools::TestCredentials::default()),
        None,
        ToolSessionOptions::default(),
    );
    let e = sessions.tools().await.unwrap_err();
    assert!(matches!(e, ToolError::ForbiddenAddress { .. }), "{e}");
    assert!(e.to_string().contains("169.254.169.254"), "{e}");
    let c = orders.counters().await;
    assert_eq!((c.unauthorized, c.sessions_opened), (0, 0), "{c:?}");
    orders.shutdown().await;
}

// ---- aliases of a registered server ------------------------------------------------------------

/// Answers each name from a table, its answers in turn (the last one repeats), and counts the
/// queries; a name not in the table is not found.
#[derive(Default)]
struct TableDns {
    answers: std::collections::HashMap<String, Vec<SocketAddr>>,
    asked: Mutex<Vec<String>>,
}

impl TableDns {
    fn asked(&self, name: &str) -> usize {
        self.asked
            .lock()
            .unwrap()
            .iter()
            .filter(|n| *n == name)
            .count()
    }
}

impl reqwest::dns::Resolve for TableDns {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_string();
        let turn = {
            let mut asked = self.asked.lock().unwrap();
            asked.push(name.clone());
            asked.iter().filter(|n| **n == name).count() - 1
        };
        let answer = self
            .answers
            .get(&name)
            .map(|all| all[turn.min(all.len() - 1)]);
        Box::pin(async move {
            match answer {
                Some(addr) => Ok(Box::new(std::iter::once(addr)) as reqwest::dns::Addrs),
                None => Err(format!("no such name {name}").into()),
            }
        })
    }
}

/// `registry` with `ABADA_AGENT_TOOLS_UNREGISTERED=allow`, resolving through `dns` when given.
fn allowing(registry: ToolRegistry, dns: Option<Arc<dyn reqwest::dns::Resolve>>) -> ToolRegistry {
    registry.allow_unregistered(Arc::new(reqwest::Client::builder), dns)
}

/// One task's sessions over `servers` as a definition names them (an agent/1 task, whose
/// engine credential is `engine-token`), resolved against `registry`.
fn named_sessions(
    registry: &ToolRegistry,
    servers: &[(&str, &str)],
) -> Result<McpSessions, ServerResolutionError> {
    named_sessions_resolving(registry, servers, None)
}

/// [`named_sessions`] whose tools client resolves through `dns` (as the registry's guard does).
fn named_sessions_resolving(
    registry: &ToolRegistry,
    servers: &[(&str, &str)],
    dns: Option<Arc<dyn reqwest::dns::Resolve>>,
) -> Result<McpSessions, ServerResolutionError> {
    // A connection to the test's unroutable address fails at this bound at the latest.
    let open_timeout = Duration::from_secs(if dns.is_some() { 2 } else { 10 });
    let named: Vec<NamedServer> = servers
        .iter()
        .map(|(name, url)| NamedServer {
            name: name.to_string(),
            url: Some(url.to_string()),
        })
        .collect();
    let resolved = ToolRegistry::resolve(Some(registry), &named, true)?;
    let credentials = resolved.credentials(Arc::new(crate::tools::TestCredentials::fixed(
        "engine-token",
    )));
    let unregistered = resolved.unregistered();
    let http = match dns {
        // As the tools' client, with the test's resolver (`http_client` sets the system's).
        Some(dns) => reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(GuardedResolver::over(dns))
            .build()
            .unwrap(),
        None => abada_agent_worker::tools::http_client(reqwest::Client::builder()).unwrap(),
    };
    Ok(McpSessions::new(
        http,
        resolved.servers,
        Arc::new(credentials),
        None,
        ToolSessionOptions {
            open_timeout,
            call_timeout: Duration::from_secs(10),
            // The tests' own names (`rebind.test`) are not loopback by name; the channel rule
            // is not what is tested here.
            allow_insecure_http: true,
            ..Default::default()
        },
    )
    .with_unregistered(unregistered))
}

/// A registered server (whose calls all wait for a person) reached under another
/// name and another spelling of its URL. Spellings of its address are refused before anything
/// is sent; `localhost` for `127.0.0.1` is refused where the session opens, by the address it
/// resolves to. An unregistered server on another port, by the same names, is reached.
#[tokio::test]
async fn an_alias_of_a_registered_server_never_reaches_it_by_any_spelling() {
    let orders = tool_server("orders", Arc::new(AcceptAny)).await;
    let other = tool_server("other", Arc::new(AcceptAny)).await;
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{}\"\nauth = \"none\"\napproval = \"always\"\n",
        orders.url()
    ));
    let port = orders.addr().port();
    // By default the registry is the list: any other server is refused, alias or not.
    for url in [format!("http://localhost:{port}/mcp"), other.url()] {
        let e = named_sessions(&registry, &[("alias", &url)]).err().unwrap();
        assert!(
            matches!(&e, ServerResolutionError::Unregistered { server, .. } if server == "alias"),
            "{url}: {e}"
        );
    }
    let registry = allowing(registry, None);
    for alias in [
        format!("http://127.0.0.1.:{port}/mcp"),
        format!("http://[::ffff:127.0.0.1]:{port}/mcp"),
        format!("http://2130706433:{port}/MCP"),
        format!("http://0x7f.1:{port}/%6Dcp"),
        format!("https://127.0.0.1:{port}/mcp"),
    ] {
        let e = named_sessions(&registry, &[("alias", &alias)])
            .err()
            .unwrap();
        assert!(
            matches!(&e, ServerResolutionError::RegisteredUnderAnotherName { registered, .. } if registered == "orders"),
            "{alias}: {e}"
        );
    }
    for alias in [
        format!("http://localhost:{port}/mcp"),
        format!("http://LOCALHOST.:{port}/other/"),
    ] {
        let mut sessions = named_sessions(&registry, &[("alias", &alias)]).unwrap();
        let e = lookup(&mut sessions, "alias").await.unwrap_err();
        assert!(
            matches!(e, ToolError::ForbiddenAddress { .. }),
            "{alias}: {e}"
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!(
                "127.0.0.1:{port}, an address of tool server \"orders\""
            )),
            "{text}"
        );
    }
    let c = orders.counters().await;
    assert_eq!((c.sessions_opened, c.unauthorized), (0, 0), "{c:?}");
    assert!(orders.calls().is_empty());

    // Another server on another port, by name (a client pinned to what was checked) or by
    // address: reached, with the engine's credential.
    let other_port = other.addr().port();
    for url in [
        format!("http://localhost:{other_port}/mcp"),
        format!("http://127.0.0.1:{other_port}/mcp"),
    ] {
        let mut sessions = named_sessions(&registry, &[("payments", &url)]).unwrap();
        lookup(&mut sessions, "payments").await.unwrap();
        sessions.close().await;
    }
    assert_eq!(
        tokens_seen(&other),
        vec![Some("engine-token".to_string()); 2]
    );
    assert!(orders.calls().is_empty());
    orders.shutdown().await;
    other.shutdown().await;
}

/// The address checked is the address connected to. The name answers an address
/// that is no registered server's to the check, then the registered server's (a rebinding
/// DNS): the session connects where the check looked (192.0.2.1, TEST-NET-1, where nothing
/// answers), never to the registered server, and the name is resolved once.
#[tokio::test]
async fn a_name_is_connected_to_the_address_it_was_checked_at() {
    let orders = tool_server("orders", Arc::new(AcceptAny)).await;
    let port = orders.addr().port();
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{}\"\nauth = \"none\"\napproval = \"always\"\n",
        orders.url()
    ));
    let mut dns = TableDns::default();
    dns.answers.insert(
        "rebind.test".into(),
        vec![format!("192.0.2.1:{port}").parse().unwrap(), orders.addr()],
    );
    let dns = Arc::new(dns);
    let registry = allowing(registry, Some(dns.clone()));
    let mut sessions = named_sessions_resolving(
        &registry,
        &[("rebind", &format!("http://rebind.test:{port}/mcp"))],
        Some(dns.clone()),
    )
    .unwrap();
    let e = lookup(&mut sessions, "rebind").await.unwrap_err();
    assert!(matches!(e, ToolError::Unavailable { .. }), "{e}");
    assert_eq!(
        dns.asked("rebind.test"),
        1,
        "checked once, never re-resolved"
    );
    let c = orders.counters().await;
    assert_eq!((c.sessions_opened, c.unauthorized), (0, 0), "{c:?}");
    // Asked again (the task's retry), the name now answers the registered address: refused.
    let e = lookup(&mut sessions, "rebind").await.unwrap_err();
    assert!(matches!(e, ToolError::ForbiddenAddress { .. }), "{e}");
    assert!(e.to_string().contains("\"orders\""), "{e}");
    assert!(orders.calls().is_empty());
    orders.shutdown().await;
}

// ---- oauth2 against oauth2-mock-server ------------------------------------------------------

/// The claims of a JWT, unverified.
fn claims(token: &str) -> serde_json::Value {
    jsonwebtoken::dangerous::insecure_decode_claims::<serde_json::Value>(token).unwrap()
}

#[tokio::test]
async fn an_oauth2_token_is_shared_sent_on_every_call_and_refreshed_once_on_a_401() {
    let Some(mock) = mock_issuer().await else {
        return;
    };
    let dir = Dir::new("registry");
    let secret = dir.write("client-secret", "tool-client-secret");
    let validator = Arc::new(Revocable::default());
    let orders = tool_server("orders", validator.clone()).await;
    let registry = registry(&format!(
        "[servers.orders]\nurl = \"{url}\"\nauth = \"oauth2\"\ntokenUrl = \"{issuer}/token\"\n\
         clientId = \"tool-client\"\nclientSecretFile = \"{secret}\"\nscopes = [\"orders:read\"]\n\
         resource = \"{url}\"\n",
        url = orders.url(),
        issuer = mock.issuer,
        secret = secret.display()
    ));
    // Two tasks at once share one token.
    let mut a = task_sessions(&registry, &["orders"]);
    let mut b = task_sessions(&registry, &["orders"]);
    let (ra, rb) = tokio::join!(lookup(&mut a, "orders"), lookup(&mut b, "orders"));
    ra.unwrap();
    rb.unwrap();
    lookup(&mut a, "orders").await.unwrap();
    let seen: Vec<String> = tokens_seen(&orders)
        .into_iter()
        .map(Option::unwrap)
        .collect();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter().all(|t| *t == seen[0]),
        "one token for every task"
    );
    let first = claims(&seen[0]);
    assert_eq!(first["scope"], "orders:read");
    assert_eq!(first["iss"], mock.issuer.as_str());

    // The mock signs iat in whole seconds and no jti: a token granted in the same second would
    // be the same token. Wait for the next second so the refreshed token differs.
    let iat = first["iat"].as_u64().unwrap();
    while std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        <= iat
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server revokes the token: the next call of each task gets a 401, the actor one
    // forced grant, and the calls go through with the new token.
    validator.revoke(&seen[0]);
    let (ra, rb) = tokio::join!(lookup(&mut a, "orders"), lookup(&mut b, "orders"));
    ra.unwrap();
    rb.unwrap();
    let after: Vec<String> = tokens_seen(&orders)
        .into_iter()
        .skip(3)
        .map(Option::unwrap)
        .collect();
    assert_eq!(after.len(), 2);
    assert!(after.iter().all(|t| *t == after[0] && *t != seen[0]));
    a.close().await;
    b.close().await;
    orders.shutdown().await;
}

// ---- end to end through the emulator -----------------------------------------------------------

fn fast_seams() -> Seams {
    Seams {
        agent: Stack::fast_agent_settings(),
        tuning: workers::fast_tuning(),
        ..Seams::default()
    }
}

fn config_with(stack: &Stack, id: &str, extra: &[(&str, &Path)]) -> Config {
    let mut env = worker_env(stack, &WorkerOptions::new(id, 4));
    for (var, path) in extra {
        env.insert(var.to_string(), path.display().to_string());
    }
    Config::from_env(&env).unwrap()
}

/// The real engine 0.11 (plain v1): no agent/1, so no engine credential; the agents file names
/// `orders`, the registry gives its URL and bearer token. Every tool call carries the registry's
/// token, each keyed write is applied once, nothing is asked of the agent/1 paths.
#[tokio::test]
async fn refund_agents_complete_on_a_plain_engine_with_the_registrys_credential() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let dir = Dir::new("registry");
    let token_file = dir.write("orders-token", "registry-token");
    let orders = tool_server("orders", Arc::new(StaticTokens::new(["registry-token"]))).await;
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.orders]\nurl = \"{}\"\nauth = \"bearer\"\ntokenFile = \"{}\"\n",
            orders.url(),
            token_file.display()
        ),
    );
    let agents = dir.write(
        "agents.toml",
        "[agents.\"abada:agent\"]\nmodel = \"openai/refund\"\ninput = \"${orderId}\"\n\
         toolServers = [\"orders\"]\nresultVariable = \"refundDecision\"\n",
    );
    let config = config_with(
        &stack,
        "plain-registry",
        &[
            (config::ENV_TOOLS_FILE, &tools),
            (config::ENV_AGENTS_FILE, &agents),
        ],
    );
    let ids = stack.engine.create_tasks(
        (0..3).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    let worker = workers::start(&config, fast_seams());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    worker.stop().await;
    for view in &views {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
    }
    let calls = orders.calls();
    assert_eq!(calls.len(), 6, "a lookup and a refund per task");
    assert!(
        calls
            .iter()
            .all(|c| c.token.as_deref() == Some("registry-token"))
    );
    let c = orders.counters().await;
    assert_eq!(
        (c.writes_applied, c.duplicates, c.unauthorized),
        (3, 0, 0),
        "{c:?}"
    );
    assert!(
        stack.tools.calls().is_empty(),
        "the stack's own server is not in the registry"
    );
    orders.shutdown().await;
    stack.shutdown().await;
}

/// An agent/1 engine sends definitions naming servers: by name (the registry's URL, with the
/// engine's credential as the registry says), and with a URL other than the registry's (an
/// incident naming the server; nothing sent to either URL).
#[tokio::test]
async fn engine_sent_definitions_name_registry_servers_and_a_wrong_url_is_an_incident() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = Dir::new("registry");
    let other = tool_server("orders", Arc::new(AcceptAny)).await;
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.orders]\nurl = \"{}\"\nauth = \"engine\"\n",
            stack.tools.url()
        ),
    );
    let config = config_with(&stack, "v1-registry", &[(config::ENV_TOOLS_FILE, &tools)]);
    let mut by_name = stack.refund_agent("openai/refund", &[]);
    by_name["toolServers"] = json!(["orders"]);
    let mut wrong_url = stack.refund_agent("openai/refund", &[]);
    wrong_url["toolServers"] = json!([{"name": "orders", "url": other.url()}]);
    let mut metadata = stack.refund_agent("openai/refund", &[]);
    metadata["toolServers"] = json!([{"name": "meta", "url": "http://169.254.169.254/mcp"}]);
    let mut unknown = stack.refund_agent("openai/refund", &[]);
    unknown["toolServers"] = json!(["payments"]);
    let ids = stack.engine.create_tasks([
        spec(by_name, "o-1"),
        spec(wrong_url, "o-2"),
        spec(metadata, "o-3"),
        spec(unknown, "o-4"),
    ]);
    let worker = workers::start(&config, fast_seams());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    worker.stop().await;
    assert_eq!(views[0].status, TaskStatus::Completed, "{:?}", views[0]);
    for (view, words) in views[1..].iter().zip([
        ["\"orders\"", "a URL other than the one"],
        ["\"meta\"", "link-local or cloud-metadata"],
        ["\"payments\"", "has no server of that name"],
    ]) {
        assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
        assert_eq!(view.retries, Some(0), "an incident: {view:?}");
        let message = view.error_message.clone().unwrap_or_default();
        for word in words {
            assert!(message.contains(word), "{word} in {message}");
        }
    }
    assert!(other.calls().is_empty());
    let c = other.counters().await;
    assert_eq!((c.unauthorized, c.sessions_opened), (0, 0), "{c:?}");
    // The registered server served the by-name task only: one lookup, one refund.
    assert_eq!(stack.tools.counters().await.writes_applied, 1);
    other.shutdown().await;
    stack.shutdown().await;
}

/// Aliases through the emulator on an agent/1 engine: the registry's `orders` has
/// `approval = "always"`. Engine-sent definitions reach it under other names and spellings, or
/// name a server the registry lacks: with the default `ABADA_AGENT_TOOLS_UNREGISTERED` each is
/// an incident naming the server, and no server sees a call; no approval was escaped.
#[tokio::test]
async fn engine_sent_aliases_and_unregistered_servers_are_incidents_by_default() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = Dir::new("registry");
    let other = tool_server("payments", Arc::new(AcceptAny)).await;
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.orders]\nurl = \"{}\"\nauth = \"engine\"\napproval = \"always\"\n",
            stack.tools.url()
        ),
    );
    let config = config_with(&stack, "v1-aliases", &[(config::ENV_TOOLS_FILE, &tools)]);
    let port = stack.tools.addr().port();
    let definitions = [
        ("orders-alias", format!("http://localhost:{port}/mcp")),
        ("orders-dot", format!("http://127.0.0.1.:{port}/%6Dcp")),
        ("payments", other.url()),
    ];
    let ids = stack
        .engine
        .create_tasks(definitions.iter().enumerate().map(|(i, (name, url))| {
            let mut agent = stack.refund_agent("openai/refund", &[]);
            agent["toolServers"] = json!([{"name": name, "url": url}]);
            spec(agent, &format!("o-{i}"))
        }));
    let worker = workers::start(&config, fast_seams());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    worker.stop().await;
    for (view, words) in views.iter().zip([
        ["\"orders-alias\"", "ABADA_AGENT_TOOLS_UNREGISTERED"],
        ["\"orders-dot\"", "registers as server \"orders\""],
        ["\"payments\"", "ABADA_AGENT_TOOLS_UNREGISTERED"],
    ]) {
        assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
        assert_eq!(view.retries, Some(0), "an incident: {view:?}");
        let message = view.error_message.clone().unwrap_or_default();
        for word in words {
            assert!(message.contains(word), "{word} in {message}");
        }
    }
    assert!(stack.tools.calls().is_empty());
    assert!(other.calls().is_empty());
    let c = stack.tools.counters().await;
    assert_eq!((c.sessions_opened, c.unauthorized), (0, 0), "{c:?}");
    other.shutdown().await;
    stack.shutdown().await;
}

/// Aliases with `ABADA_AGENT_TOOLS_UNREGISTERED=allow` through the emulator: `localhost` for
/// the registered `127.0.0.1` server (whose calls all wait for a person) is refused where the
/// session opens, as an incident naming the registered server; a server the registry does not
/// list, at another port, completes with the engine's credential through a pinned client.
#[tokio::test]
async fn with_unregistered_servers_allowed_an_alias_by_address_is_still_an_incident() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let dir = Dir::new("registry");
    let payments = tool_server("payments", Arc::new(AcceptAny)).await;
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.orders]\nurl = \"{}\"\nauth = \"engine\"\napproval = \"always\"\n",
            stack.tools.url()
        ),
    );
    let mut env = worker_env(&stack, &WorkerOptions::new("v1-allow", 4));
    env.insert(config::ENV_TOOLS_FILE.into(), tools.display().to_string());
    env.insert(config::ENV_TOOLS_UNREGISTERED.into(), "allow".into());
    let config = Config::from_env(&env).unwrap();
    let port = stack.tools.addr().port();
    let definitions = [
        ("orders-alias", format!("http://localhost:{port}/mcp")),
        (
            "payments",
            format!("http://localhost:{}/mcp", payments.addr().port()),
        ),
    ];
    let ids = stack
        .engine
        .create_tasks(definitions.iter().enumerate().map(|(i, (name, url))| {
            let mut agent = stack.refund_agent("openai/refund", &[]);
            agent["toolServers"] = json!([{"name": name, "url": url}]);
            spec(agent, &format!("o-{i}"))
        }));
    let worker = workers::start(&config, fast_seams());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(30)).await;
    worker.stop().await;
    assert_eq!(views[0].status, TaskStatus::Failed, "{:?}", views[0]);
    assert_eq!(views[0].retries, Some(0), "an incident: {:?}", views[0]);
    let message = views[0].error_message.clone().unwrap_or_default();
    for word in [
        "tool server orders-alias is refused",
        &format!("127.0.0.1:{port}, an address of tool server \"orders\""),
    ] {
        assert!(message.contains(word), "{word} in {message}");
    }
    assert!(!message.contains("http://"), "no URL: {message}");
    assert_eq!(views[1].status, TaskStatus::Completed, "{:?}", views[1]);
    assert_eq!(payments.counters().await.writes_applied, 1);
    assert!(payments.calls().iter().all(|c| c.token.is_some()));
    assert!(stack.tools.calls().is_empty());
    let c = stack.tools.counters().await;
    assert_eq!((c.sessions_opened, c.unauthorized), (0, 0), "{c:?}");
    payments.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_bad_registry_or_an_agents_file_naming_an_unknown_server_stops_the_start() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let dir = Dir::new("registry");
    let start_error = |extra: &[(&str, &Path)]| {
        let config = config_with(&stack, "bad", extra);
        match Worker::build(&config, Seams::default()) {
            Ok(_) => panic!("the worker started"),
            Err(e) => e.to_string(),
        }
    };
    let tools = dir.write(
        "tools.toml",
        "[servers.orders]\nurl = \"http://127.0.0.1:1/mcp\"\nauth = \"bearer\"\ntokenFile = \"/nonexistent/orders-token\"\n",
    );
    let e = start_error(&[(config::ENV_TOOLS_FILE, &tools)]);
    assert!(
        e.contains(&tools.display().to_string())
            && e.contains("server \"orders\", field tokenFile")
            && e.contains("/nonexistent/orders-token"),
        "{e}"
    );
    let tools = dir.write(
        "tools.toml",
        "[servers.orders]\nurl = \"http://127.0.0.1:1/mcp\"\nauth = \"none\"\n",
    );
    let agents = dir.write(
        "agents.toml",
        "[agents.refund]\nmodel = \"openai/refund\"\ninput = \"x\"\ntoolServers = [\"payments\"]\n",
    );
    let e = start_error(&[
        (config::ENV_TOOLS_FILE, &tools),
        (config::ENV_AGENTS_FILE, &agents),
    ]);
    assert!(
        e.contains(&agents.display().to_string())
            && e.contains("agent \"refund\"")
            && e.contains("\"payments\""),
        "{e}"
    );
    let e = start_error(&[(config::ENV_TOOLS_FILE, &dir.0.join("missing.toml"))]);
    assert!(e.contains("cannot read the tools file"), "{e}");
    stack.shutdown().await;
}

/// An `oauth2` server's client secret goes to its `tokenUrl`, so a plain http://
/// token endpoint that is not loopback stops the start (naming the file, the server and the
/// field) and receives nothing; `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allows it and the
/// start-up warning's list names it. The endpoint is a listener on 127.0.0.1 reached as
/// `0.0.0.0`, an address the channel check does not count as loopback (it is not one; an
/// IPv4-mapped `[::ffff:127.0.0.1]` is) but which Linux delivers to the local
/// host: had the worker sent anything, the listener would have seen a connection.
#[tokio::test]
async fn an_oauth2_client_secret_for_a_plain_http_token_endpoint_stops_the_start() {
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    let dir = Dir::new("registry");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(Mutex::new(0u32));
    let counted = connections.clone();
    let accepting = tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            *counted.lock().unwrap() += 1;
        }
    });
    let secret = dir.write("billing-secret", "client-secret-17\n");
    let token_url = format!("http://0.0.0.0:{port}/token");
    let tools = dir.write(
        "tools.toml",
        &format!(
            "[servers.billing]\nurl = \"http://127.0.0.1:1/mcp\"\nauth = \"oauth2\"\ntokenUrl = \"{token_url}\"\nclientId = \"worker\"\nclientSecretFile = \"{}\"\n",
            secret.display()
        ),
    );
    let refused = config_with(&stack, "clear", &[(config::ENV_TOOLS_FILE, &tools)]);
    let e = match Worker::build(&refused, Seams::default()) {
        Ok(_) => panic!("the worker started with a client secret bound for http://"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&tools.display().to_string())
            && e.contains("server \"billing\", field tokenUrl")
            && e.contains(
                "the OAuth 2.0 client secret of tool server billing would travel in clear"
            )
            && e.contains("ABADA_AGENT_ALLOW_INSECURE_HTTP=true"),
        "{e}"
    );
    assert!(!e.contains("client-secret-17"), "{e}");
    assert!(
        refused.credentials_in_clear().is_empty(),
        "nothing is allowed in clear without the variable"
    );

    let mut env = worker_env(&stack, &WorkerOptions::new("allowed", 4));
    env.insert(config::ENV_TOOLS_FILE.into(), tools.display().to_string());
    env.insert(config::ENV_ALLOW_INSECURE_HTTP.into(), "true".into());
    let allowed = Config::from_env(&env).unwrap();
    let worker = Worker::build(&allowed, Seams::default());
    assert!(worker.is_ok(), "allowed by the variable");
    // The file is read once, by the worker's setup: the warning is the worker's, not the
    // configuration's (which names only the channels of the variables).
    let clear = worker.as_ref().unwrap().credentials_in_clear.clone();
    assert!(
        !allowed
            .credentials_in_clear()
            .iter()
            .any(|c| c.contains("tool server billing")),
        "the configuration alone does not read the tools file"
    );
    assert!(
        clear.contains(&format!(
            "the OAuth 2.0 client secret of tool server billing to {}",
            reqwest::Url::parse(&token_url).unwrap()
        )),
        "{clear:?}"
    );
    assert!(!format!("{clear:?}").contains("client-secret-17"));
    drop(worker);
    assert_eq!(
        *connections.lock().unwrap(),
        0,
        "nothing reached the token endpoint"
    );
    accepting.abort();
    stack.shutdown().await;
}
