//! Engines behind an authenticating proxy: `ABADA_AGENT_ENGINE_HEADERS_FILE`
//! against the emulator in the real engine's `proxy` security mode (`ProxyAuthorizer`), with the
//! real binary: the headers reach every engine call, a rotated file is picked up without a
//! restart, the values never reach the output, and a forbidden header is a start-up error.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{
    Operation, ProtocolLevel, ProxyAuthorizer, TaskSpec, TaskStatus,
};
use abada_agent_worker::devkit::stack::{Stack, StackOptions};
use serde_json::{Map, json};

use crate::support::process::{WorkerProcess, stack_env};
use crate::support::wait::eventually;

const USER: &str = "agent-worker-7f3a91";

fn temp_file(content: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("abada-headers-it-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("engine-headers");
    std::fs::write(&path, content).unwrap();
    (dir, path)
}

#[tokio::test]
async fn the_headers_file_gets_the_worker_past_the_proxy_and_is_reread_when_it_changes() {
    let stack = Stack::start_with(StackOptions {
        protocol: ProtocolLevel::AgentV1,
        authorizer: Some(std::sync::Arc::new(ProxyAuthorizer)),
    })
    .await
    .unwrap();
    // First without the group: the engine knows the user but refuses it (403 ACCESS_DENIED).
    let (dir, path) = temp_file(&format!("# proxy identity\nX-Auth-Request-User: {USER}\n"));
    let mut env = stack_env(&stack, "w-proxy");
    env.push((
        "ABADA_AGENT_ENGINE_HEADERS_FILE".into(),
        path.display().to_string(),
    ));
    let mut worker = WorkerProcess::spawn(&env).await;
    let limit = Duration::from_secs(20);
    tokio::time::timeout(limit, async {
        stack
            .engine
            .wait_for(|e| {
                e.calls()
                    .iter()
                    .any(|c| c.operation == Operation::FetchAndLock && c.status == 403)
                    .then_some(())
            })
            .await
    })
    .await
    .expect("a refused fetch");
    // The operator adds the group; the worker picks it up without a restart.
    std::fs::write(
        &path,
        format!("X-Auth-Request-User: {USER}\nX-Auth-Request-Groups: abada-worker\n"),
    )
    .unwrap();
    let ids = stack.engine.create_tasks((0..2).map(|i| {
        let mut variables = Map::new();
        variables.insert("orderId".into(), json!(format!("o-proxy-{i}")));
        TaskSpec {
            variables,
            agent: Some(stack.refund_agent("openai/refund", &[])),
            retries: Some(3),
            ..TaskSpec::default()
        }
    }));
    for id in &ids {
        tokio::time::timeout(limit, async {
            stack
                .engine
                .wait_for(|e| e.task(id).filter(|t| t.status == TaskStatus::Completed))
                .await
        })
        .await
        .expect("the task completes through the proxy");
    }
    // Every call about the tasks passed the proxy: none was refused once the group was there.
    let refused_about_tasks = stack
        .engine
        .calls()
        .iter()
        .filter(|c| c.task_id.is_some() && (c.status == 401 || c.status == 403))
        .count();
    assert_eq!(refused_about_tasks, 0);
    worker.signal("TERM");
    assert!(worker.wait(Duration::from_secs(15)).await.success());
    let output = [worker.stdout(), worker.stderr()].concat().join("\n");
    assert!(!output.contains(USER), "a header value reached the output");
    assert!(output.contains("x-auth-request-user"), "names are logged");
    let _ = std::fs::remove_dir_all(&dir);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_forbidden_or_malformed_header_is_a_start_up_error_without_its_value() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    for content in [
        "Transfer-Encoding: s3cr3t-chunked\n",
        "X-Auth-Request-User s3cr3t-user\n",
        "X-Auth-Request-User: a\nx-auth-request-user: s3cr3t-b\n",
    ] {
        let (dir, path) = temp_file(content);
        let mut env = stack_env(&stack, "w-bad-headers");
        env.push((
            "ABADA_AGENT_ENGINE_HEADERS_FILE".into(),
            path.display().to_string(),
        ));
        let mut worker = WorkerProcess::spawn_raw(&[], &env);
        let status = worker.wait(Duration::from_secs(15)).await;
        assert_eq!(status.code(), Some(2), "{content:?}");
        let said = |w: &WorkerProcess| [w.stdout(), w.stderr()].concat().join("\n");
        // The output readers may still be catching up with the exited process.
        eventually(
            Duration::from_secs(5),
            "the start-up error line",
            async || said(&worker).contains("ABADA_AGENT_ENGINE_HEADERS_FILE"),
        )
        .await;
        let output = said(&worker);
        assert!(output.contains("line "), "{output}");
        assert!(!output.contains("s3cr3t"), "{output}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    stack.shutdown().await;
}
