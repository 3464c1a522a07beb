//! McpSessions (src/tools.rs) against the devkit MCP tool server (devkit/src/tools.rs).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::devkit::tools::{
    AcceptAny, CredentialValidator, StaticTokens, ToolServer, ToolServerOptions,
};
use abada_agent_worker::secret::Secret;
use abada_agent_worker::tools::{
    CredentialError, CredentialSource, McpSessions, ToolError, ToolProtocol, ToolServerRef,
    ToolSessionOptions,
};
use async_trait::async_trait;
use serde_json::{Map, Value, json};

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Hands out `<server>-token-<n>` (n counts per server from 1), or refuses every request.
#[derive(Default)]
pub struct TestCredentials {
    issued: Mutex<HashMap<String, u64>>,
    pub refuse: bool,
    pub fixed: Option<String>,
    pub requests: AtomicU64,
}

impl TestCredentials {
    pub fn fixed(token: &str) -> Self {
        TestCredentials {
            fixed: Some(token.into()),
            ..Default::default()
        }
    }
}

#[async_trait]
impl CredentialSource for TestCredentials {
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if self.refuse {
            return Err(CredentialError::LeaseLost {
                server: server.into(),
            });
        }
        if let Some(token) = &self.fixed {
            return Ok(Some(Secret::new(token.clone())));
        }
        let mut issued = self.issued.lock().unwrap();
        let n = issued.entry(server.to_owned()).or_default();
        *n += 1;
        Ok(Some(Secret::new(format!("{server}-token-{n}"))))
    }
}

async fn server(name: &str) -> ToolServer {
    ToolServer::start(ToolServerOptions::new(name, Arc::new(AcceptAny)))
        .await
        .unwrap()
}

fn options() -> ToolSessionOptions {
    ToolSessionOptions {
        open_timeout: Duration::from_secs(10),
        call_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

fn sessions_for(servers: &[&ToolServer], credentials: Arc<dyn CredentialSource>) -> McpSessions {
    sessions_with(servers, credentials, Some(TRACEPARENT), options())
}

fn sessions_with(
    servers: &[&ToolServer],
    credentials: Arc<dyn CredentialSource>,
    traceparent: Option<&str>,
    options: ToolSessionOptions,
) -> McpSessions {
    McpSessions::new(
        reqwest::Client::new(),
        servers
            .iter()
            .map(|s| ToolServerRef {
                name: s.name().to_owned(),
                url: s.url(),
            })
            .collect(),
        credentials,
        traceparent.map(str::to_owned),
        options,
    )
}

/// Tool call arguments from a JSON object literal.
pub fn args(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("arguments must be an object"),
    }
}

#[tokio::test]
async fn lists_tools_with_read_only_annotations() {
    let orders = server("orders").await;
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    let tools = sessions.tools().await.unwrap();
    let by_name: HashMap<&str, bool> = tools
        .iter()
        .map(|t| (t.tool.as_str(), t.read_only))
        .collect();
    assert_eq!(by_name.len(), 4, "{tools:?}");
    assert!(by_name["lookup_order"]);
    assert!(by_name["echo"]);
    assert!(!by_name["issue_refund"]);
    assert!(tools.iter().all(|t| t.server == "orders"));
    let lookup = tools.iter().find(|t| t.tool == "lookup_order").unwrap();
    assert_eq!(lookup.input_schema["required"], json!(["orderId"]));

    let result = sessions
        .call(
            "orders",
            "lookup_order",
            args(json!({"orderId": "o-1"})),
            None,
        )
        .await
        .unwrap();
    assert!(!result.is_error);
    assert_eq!(
        result.structured_content.as_ref().unwrap()["orderId"],
        "o-1"
    );
    sessions.close().await;
    orders.shutdown().await;
}

/// A server told to offer fewer tools lists only those, and answers a call of another as an
/// unknown tool (the real model tier's refund agent sees a lookup and a write, nothing else).
#[tokio::test]
async fn a_server_offering_fewer_tools_lists_and_serves_only_those() {
    let orders = server("orders").await;
    orders.offer_only(&["lookup_order", "issue_refund"]);
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    let mut listed: Vec<String> = sessions
        .tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.tool)
        .collect();
    listed.sort();
    assert_eq!(listed, ["issue_refund", "lookup_order"]);
    let refused = sessions
        .call("orders", "echo", args(json!({"a": 1})), None)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, ToolError::UnknownTool { .. }),
        "{refused:?}"
    );
    sessions.close().await;
}

#[tokio::test]
async fn keyed_write_is_applied_once_and_carries_key_and_traceparent() {
    let orders = server("orders").await;
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    let refund = args(json!({"orderId": "o-7", "amountCents": 1250}));
    let first = sessions
        .call(
            "orders",
            "issue_refund",
            refund.clone(),
            Some("abada:t-1:4"),
        )
        .await
        .unwrap();
    let second = sessions
        .call(
            "orders",
            "issue_refund",
            refund.clone(),
            Some("abada:t-1:4"),
        )
        .await
        .unwrap();
    assert_eq!(first, second, "a repeated key returns the first result");
    let unkeyed = sessions
        .call("orders", "issue_refund", refund, None)
        .await
        .unwrap();
    assert_ne!(unkeyed, first);

    let counters = orders.counters().await;
    assert_eq!(counters.writes_applied, 2);
    assert_eq!(counters.writes_unkeyed, 1);
    assert_eq!(counters.duplicates, 1);
    assert_eq!(counters.duplicates_per_key["abada:t-1:4"], 1);
    assert_eq!(counters.calls_per_tool["issue_refund"], 3);

    let calls = orders.calls();
    assert_eq!(calls[0].idempotency_key.as_deref(), Some("abada:t-1:4"));
    assert_eq!(calls[1].idempotency_key.as_deref(), Some("abada:t-1:4"));
    assert_eq!(calls[2].idempotency_key, None);
    assert!(
        calls
            .iter()
            .all(|c| c.traceparent.as_deref() == Some(TRACEPARENT))
    );
    sessions.close().await;
    orders.shutdown().await;
}

#[tokio::test]
async fn a_credential_goes_only_to_its_own_server() {
    let orders = server("orders").await;
    let billing = server("billing").await;
    let mut sessions = sessions_for(&[&orders, &billing], Arc::new(TestCredentials::default()));
    let tools = sessions.tools().await.unwrap();
    assert_eq!(tools.len(), 8);
    sessions
        .call("orders", "echo", args(json!({"to": "orders"})), None)
        .await
        .unwrap();
    sessions
        .call("billing", "echo", args(json!({"to": "billing"})), None)
        .await
        .unwrap();
    let orders_calls = orders.calls();
    let billing_calls = billing.calls();
    assert_eq!(orders_calls.len(), 1);
    assert_eq!(billing_calls.len(), 1);
    assert_eq!(orders_calls[0].token.as_deref(), Some("orders-token-1"));
    assert_eq!(billing_calls[0].token.as_deref(), Some("billing-token-1"));
    assert_eq!(orders_calls[0].arguments, json!({"to": "orders"}));
    sessions.close().await;
    orders.shutdown().await;
    billing.shutdown().await;
}

#[tokio::test]
async fn an_expired_session_is_reopened_once_with_a_new_credential() {
    let orders = server("orders").await;
    let credentials = Arc::new(TestCredentials::default());
    let mut sessions = sessions_for(&[&orders], credentials.clone());
    let refund = args(json!({"orderId": "o-9", "amountCents": 500}));
    sessions
        .call(
            "orders",
            "lookup_order",
            args(json!({"orderId": "o-9"})),
            None,
        )
        .await
        .unwrap();
    orders.expire_sessions().await;
    let result = sessions
        .call("orders", "issue_refund", refund, Some("abada:t-2:3"))
        .await
        .unwrap();
    assert!(!result.is_error);
    assert_eq!(credentials.requests.load(Ordering::SeqCst), 2);
    let calls = orders.calls();
    let last = calls.last().unwrap();
    assert_eq!(last.idempotency_key.as_deref(), Some("abada:t-2:3"));
    assert_eq!(last.token.as_deref(), Some("orders-token-2"));
    assert_ne!(calls[0].session_id, last.session_id);
    let counters = orders.counters().await;
    assert_eq!(counters.sessions_opened, 2);
    assert_eq!(counters.sessions_expired, 1);
    assert_eq!(counters.writes_applied, 1);
    sessions.close().await;
    assert_eq!(orders.counters().await.sessions_open, 0);
    orders.shutdown().await;
}

#[tokio::test]
async fn a_down_server_gives_a_transient_error_and_recovers() {
    let orders = server("orders").await;
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    orders.set_down(true);
    let error = sessions.tools().await.unwrap_err();
    assert!(error.is_transient(), "{error:?}");
    // The error names the server, never its URL.
    let text = error.to_string();
    assert!(
        text.contains("tool server orders") && !text.contains(&orders.url()),
        "{text}"
    );
    orders.set_down(false);
    sessions.tools().await.unwrap();

    // Down in the middle of a session: the call fails transiently, the retry reopens.
    orders.set_down(true);
    let error = sessions
        .call("orders", "echo", args(json!({})), None)
        .await
        .unwrap_err();
    assert!(error.is_transient(), "{error:?}");
    orders.set_down(false);
    sessions
        .call("orders", "echo", args(json!({})), None)
        .await
        .unwrap();
    sessions.close().await;
    orders.shutdown().await;

    // Nobody listening at all.
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    let error = sessions.tools().await.unwrap_err();
    assert!(matches!(error, ToolError::Unavailable { .. }), "{error:?}");
}

#[tokio::test]
async fn oversized_results_are_capped_with_a_note_and_error_results_pass_through() {
    let orders = server("orders").await;
    let mut sessions = sessions_with(
        &[&orders],
        Arc::new(TestCredentials::default()),
        None,
        ToolSessionOptions {
            max_result_bytes: 4096,
            max_response_bytes: 512 * 1024,
            ..options()
        },
    );
    orders.set_oversized_results(Some(100_000));
    let result = sessions
        .call("orders", "echo", args(json!({"a": 1})), None)
        .await
        .unwrap();
    let size: usize = result.content.iter().map(|b| b.to_string().len()).sum();
    assert!(size < 4096 + 200, "{size}");
    assert!(result.to_model_text().contains("only the first 4096 bytes"));

    // Larger than the transport cap: never buffered whole. This server answers over SSE
    // (stateful mode), where rmcp reports the oversized event only as a closed stream; the
    // worker tells it apart (`tools::transport`): the call answers with an error result naming
    // the cap, as for a JSON answer, and is not retried.
    orders.set_oversized_results(Some(1024 * 1024));
    let calls_before = orders.calls().len();
    let result = sessions
        .call("orders", "echo", args(json!({"a": 1})), None)
        .await
        .unwrap();
    assert!(result.is_error);
    assert!(
        result
            .to_model_text()
            .contains("the tool result was larger than 524288 bytes and was discarded"),
        "{}",
        result.to_model_text()
    );
    assert_eq!(orders.calls().len(), calls_before + 1, "sent once");
    orders.set_oversized_results(None);
    // The session goes on.
    let result = sessions
        .call("orders", "echo", args(json!({"a": 2})), None)
        .await
        .unwrap();
    assert!(!result.is_error);

    orders.set_error_results(true);
    let result = sessions
        .call("orders", "echo", args(json!({"a": 1})), None)
        .await
        .unwrap();
    assert!(result.is_error);
    assert!(result.to_model_text().contains("injected failure"));
    assert_eq!(orders.calls().last().unwrap().traceparent, None);
    sessions.close().await;
    orders.shutdown().await;
}

#[tokio::test]
async fn close_leaves_no_session_open_and_drop_closes_too() {
    let orders = server("orders").await;
    let billing = server("billing").await;
    let mut sessions = sessions_for(&[&orders, &billing], Arc::new(TestCredentials::default()));
    sessions.tools().await.unwrap();
    assert_eq!(orders.counters().await.sessions_open, 1);
    assert_eq!(billing.counters().await.sessions_open, 1);
    sessions.close().await;
    for server in [&orders, &billing] {
        let counters = server.counters().await;
        assert_eq!(counters.sessions_open, 0, "{counters:?}");
        assert_eq!(counters.sessions_closed, 1);
    }

    // Dropped without close (a cancelled task): closed in the background.
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::default()));
    sessions.tools().await.unwrap();
    assert_eq!(orders.counters().await.sessions_open, 1);
    drop(sessions);
    crate::support::wait::eventually(
        Duration::from_secs(10),
        "the dropped session to be closed",
        async || orders.counters().await.sessions_open == 0,
    )
    .await;
    assert_eq!(orders.counters().await.sessions_closed, 2);

    // Cancelled while closing (a lost lease aborts the task waiting in `close`): the closing
    // goes on without it.
    let mut sessions = sessions_for(&[&orders, &billing], Arc::new(TestCredentials::default()));
    sessions.tools().await.unwrap();
    // Polled exactly once, then dropped: a zero timeout would poll it again once its timer
    // (1 ms resolution) fires, and on a quiet machine the closes can be done by then.
    {
        let mut closing = std::pin::pin!(sessions.close());
        assert!(
            futures::poll!(closing.as_mut()).is_pending(),
            "closing takes more than one poll"
        );
    }
    crate::support::wait::eventually(
        Duration::from_secs(10),
        "the sessions whose closing was cancelled to be closed",
        async || {
            orders.counters().await.sessions_open == 0
                && billing.counters().await.sessions_open == 0
        },
    )
    .await;
    orders.shutdown().await;
    billing.shutdown().await;
}

#[tokio::test]
async fn a_rejected_credential_and_a_refused_one_are_typed() {
    let orders = ToolServer::start(ToolServerOptions::new(
        "orders",
        Arc::new(StaticTokens::new(["good-token"])),
    ))
    .await
    .unwrap();
    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::fixed("bad-token")));
    let error = sessions.tools().await.unwrap_err();
    assert!(matches!(error, ToolError::Unauthorized { .. }), "{error:?}");
    assert!(!error.to_string().contains("bad-token"));
    assert!(orders.counters().await.unauthorized >= 1);

    let mut sessions = sessions_for(&[&orders], Arc::new(TestCredentials::fixed("good-token")));
    sessions.tools().await.unwrap();
    let error = sessions
        .call("orders", "nope", Map::new(), None)
        .await
        .unwrap_err();
    assert!(matches!(error, ToolError::UnknownTool { .. }), "{error:?}");
    let error = sessions
        .call("elsewhere", "echo", Map::new(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(error, ToolError::UnknownServer { .. }),
        "{error:?}"
    );
    sessions.close().await;

    let refusing = TestCredentials {
        refuse: true,
        ..Default::default()
    };
    let mut sessions = sessions_for(&[&orders], Arc::new(refusing));
    let error = sessions.tools().await.unwrap_err();
    assert!(error.is_lease_lost(), "{error:?}");
    orders.shutdown().await;
}

#[tokio::test]
async fn a_call_slower_than_its_timeout_is_transient() {
    let orders = server("orders").await;
    let mut sessions = sessions_with(
        &[&orders],
        Arc::new(TestCredentials::default()),
        None,
        // Far below the latency, so the slow call surely times out; long enough for the call
        // after it (which may open a new session) on a loaded machine.
        ToolSessionOptions {
            call_timeout: Duration::from_secs(2),
            ..options()
        },
    );
    sessions.tools().await.unwrap();
    orders.set_latency(Duration::from_secs(30));
    let error = sessions
        .call("orders", "echo", args(json!({})), None)
        .await
        .unwrap_err();
    assert!(error.is_transient(), "{error:?}");
    assert!(error.to_string().contains("no answer within"), "{error}");
    orders.set_latency(Duration::ZERO);
    sessions
        .call("orders", "echo", args(json!({})), None)
        .await
        .unwrap();
    sessions.close().await;
    orders.shutdown().await;
}

/// Accepts each token for one request only: a credential that dies right after the server
/// created the session, as a task's does when its lease is lost while the session opens.
#[derive(Default)]
struct OneRequestPerToken(Mutex<HashSet<String>>);

impl CredentialValidator for OneRequestPerToken {
    fn validate(&self, _server: &str, token: &str) -> bool {
        self.0.lock().unwrap().insert(token.to_owned())
    }
}

/// The `initialize` answer created a session, then the handshake failed (its `initialized`
/// notification refused): rmcp never learns to close that session, so the opener closes it,
/// with the credential it was opened with (which the server lets its owner use to close).
#[tokio::test]
async fn a_handshake_refused_after_the_server_opened_its_session_closes_that_session() {
    let orders = ToolServer::start(ToolServerOptions::new(
        "orders",
        Arc::new(OneRequestPerToken::default()),
    ))
    .await
    .unwrap();
    let mut sessions = sessions_with(
        &[&orders],
        Arc::new(TestCredentials::default()),
        None,
        ToolSessionOptions {
            protocol: ToolProtocol::Initialize,
            ..options()
        },
    );
    let error = sessions.tools().await.unwrap_err();
    assert!(
        matches!(
            error,
            ToolError::Unauthorized { .. } | ToolError::Unavailable { .. }
        ),
        "{error:?}"
    );
    let c = orders.counters().await;
    assert!(c.sessions_opened >= 1 && c.unauthorized >= 1, "{c:?}");
    assert_eq!(c.sessions_open, 0, "{c:?}");
    assert_eq!(c.sessions_closed, c.sessions_opened, "{c:?}");
    drop(sessions);
    orders.shutdown().await;
}

/// A task dropped while its session opening waits for another opening's protocol negotiation
/// (the first session to a server negotiates while later ones wait) leaves nothing to wait
/// for: the opening sees that nobody waits for it and stops, before it sends anything. Its
/// task's cleanup (which the runner awaits before giving the lease back) is done while the
/// other negotiation is still stuck; before, it waited for that negotiation and then opened,
/// listed and closed a session nobody wanted.
#[tokio::test]
async fn an_opening_nobody_waits_for_stops_waiting_for_another_openings_negotiation() {
    let orders = server("orders").await;
    orders.hold_openings(true);
    let options = options();
    let credentials: Arc<dyn CredentialSource> = Arc::new(TestCredentials::default());
    let mut first = sessions_with(&[&orders], credentials.clone(), None, options.clone());
    let negotiating = tokio::spawn(async move {
        let listed = first.tools().await.map(|tools| tools.len());
        first.close().await;
        listed
    });
    orders.openings_arrived(1).await;

    let cleanup = tokio_util::task::TaskTracker::new();
    let mut second =
        sessions_with(&[&orders], credentials, None, options).with_cleanup(cleanup.clone());
    let waiting = tokio::spawn(async move { second.tools().await.map(|tools| tools.len()) });
    tokio::task::yield_now().await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    cleanup.close();
    tokio::time::timeout(Duration::from_secs(10), cleanup.wait())
        .await
        .expect("the dropped opening still waits for the other opening's negotiation");
    assert_eq!(orders.openings(), 1, "the dropped opening sent a request");

    orders.hold_openings(false);
    assert!(negotiating.await.unwrap().unwrap() > 0);
    let c = orders.counters().await;
    assert_eq!(c.sessions_opened, 1, "{c:?}");
    assert_eq!(c.sessions_open, 0, "{c:?}");
    orders.shutdown().await;
}
