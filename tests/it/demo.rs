//! The demo's scenarios, run in-process through the `abada-demo` crate's function with the
//! worker's adapter (as the binary runs them): each must pass its own checks, and the facts
//! behind the checks are asserted here too.
//! `takeover --store` and `approval` run against a database of its own on the test PostgreSQL
//! (`ABADA_TEST_DATABASE_URL`, see `store.rs`).

use abada_agent_worker::devkit::demo_workers::DemoWorkers;
use abada_demo::{DemoArgs, DemoReport, DemoStore, Output, Scenario};
use serde_json::Value;

use crate::store::TestDb;

async fn run(scenario: Scenario) -> DemoReport {
    let report = abada_demo::run(
        &DemoWorkers,
        DemoArgs {
            scenario,
            output: Output::Silent,
            store: None,
        },
    )
    .await
    .expect("the scenario runs to its verdict");
    let failed: Vec<_> = report.checks.iter().filter(|c| !c.passed).collect();
    assert!(report.passed(), "failed checks: {failed:#?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_completes_twenty_tasks_once_with_four_slots_per_worker() {
    let report = run(Scenario::Load).await;
    assert_eq!(report.scenario, "load");
    assert_eq!(report.facts["completedOnce"], 20);
    assert_eq!(report.facts["writesApplied"], 20);
    assert_eq!(report.facts["duplicates"], 0);
    for first in report.facts["firstFetches"].as_array().unwrap() {
        assert_eq!(first["requested"], 4, "{first}");
    }
    assert_eq!(report.workers.len(), 2);
    let completed: u32 = report.workers.iter().map(|w| w.completed).sum();
    assert_eq!(completed, 20);
    for w in &report.workers {
        assert!(w.max_running <= 4, "{w:?}");
        assert_eq!(w.claimed, w.completed, "{w:?}");
        assert_eq!(w.model_calls, 3 * w.completed as u64, "{w:?}");
        assert_eq!(w.tool_calls, 2 * w.completed as u64, "{w:?}");
        assert_eq!(w.keyed_writes, w.completed as u64, "{w:?}");
        assert_eq!(w.leases_lost, 0);
    }
    // The timeline opens with the tasks and both 4-task claims.
    assert_eq!(report.events[0].event, "tasks_open");
    let claims: Vec<_> = report
        .events
        .iter()
        .filter(|e| e.event == "claimed")
        .take(2)
        .collect();
    assert!(
        claims
            .iter()
            .all(|e| e.data["claimed"].as_array().unwrap().len() == 4)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_fences_the_frozen_worker_and_deduplicates_the_write() {
    let report = run(Scenario::Takeover).await;
    let facts = &report.facts;
    assert_eq!(facts["writesApplied"], 1);
    assert_eq!(facts["duplicates"], 1);
    assert_eq!(facts["w2Attempt"], 2);
    assert_eq!(facts["completes"], 1);
    let w1_calls = facts["w1Calls"].as_array().unwrap();
    assert!(!w1_calls.is_empty());
    for c in w1_calls {
        assert_eq!(c["refused"], true, "{c}");
        assert_eq!(c["attempt"], 1, "{c}");
        assert!(
            matches!(
                c["code"].as_str(),
                Some("WORKER_LOCK_NOT_OWNED" | "STALE_ATTEMPT")
            ),
            "{c}"
        );
    }
    let probes: Vec<(&str, &str)> = facts["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["refused"], true, "{c}");
            (
                c["operation"].as_str().unwrap(),
                c["code"].as_str().unwrap_or(""),
            )
        })
        .collect();
    let ops: Vec<&str> = probes.iter().map(|p| p.0).collect();
    assert_eq!(
        ops,
        [
            "heartbeat",
            "journal-append",
            "tool-credentials",
            "complete"
        ]
    );
    assert!(
        probes
            .iter()
            .all(|(_, code)| matches!(*code, "WORKER_LOCK_NOT_OWNED" | "STALE_ATTEMPT"))
    );
    let w1 = &report.workers[0];
    assert_eq!((w1.claimed, w1.completed, w1.leases_lost), (1, 0, 1));
    let w2 = &report.workers[1];
    assert_eq!((w2.claimed, w2.completed, w2.leases_lost), (1, 1, 0));
    let journal: Vec<&str> = facts["journal"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        journal
            .iter()
            .filter(|s| s.starts_with("tool/started"))
            .count(),
        1
    );
}

/// The seed story on a plain v1 engine with the run store: the frozen worker is refused by the
/// store (`RUN_STORE_FENCED`), the write is applied once, the task completed once.
///
/// Its runtime's threads get 8 MiB of stack: in a debug build a task that journals a tool call
/// in the store needs more than tokio's default 2 MiB (`agent::run`'s nested futures are
/// large unoptimised; measured 2.1 MB deep at the overflow). Reported as a follow-up; the
/// production binary is a release build.
#[test]
fn takeover_on_the_store_is_fenced_by_the_store() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_stack_size(8 << 20)
        .enable_all()
        .build()
        .unwrap()
        .block_on(takeover_on_the_store());
}

async fn takeover_on_the_store() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let report = abada_demo::run(
        &DemoWorkers,
        DemoArgs {
            scenario: Scenario::Takeover,
            output: Output::Silent,
            store: Some(DemoStore::new(db.url.render(), &DemoWorkers).unwrap()),
        },
    )
    .await
    .expect("the scenario runs to its verdict");
    let failed: Vec<_> = report.checks.iter().filter(|c| !c.passed).collect();
    assert!(report.passed(), "failed checks: {failed:#?}");
    let facts = &report.facts;
    assert_eq!(facts["writesApplied"], 1);
    assert_eq!(facts["duplicates"], 1);
    assert_eq!(facts["acquisitions"], 2);
    assert_eq!(facts["w2StoreClaims"], 1);
    assert_eq!(facts["w1RefusedAppends"], 1);
    assert_eq!(facts["w1LeasesLostFenced"], 1);
    assert_eq!(facts["modelCalls"], serde_json::json!([2, 1]));
    assert_eq!(facts["completes"], 1);
    assert_eq!(facts["w2Finishes"], 1);
    assert!(
        !facts["store"].as_str().unwrap().contains(&db.url.password),
        "the password stays out of the report"
    );
    let refusal = report
        .events
        .iter()
        .find(|e| e.event == "refused")
        .expect("the timeline shows the store's refusal");
    assert_eq!(refusal.actor, "store");
    assert!(
        refusal.text.contains("RUN_STORE_FENCED"),
        "{}",
        refusal.text
    );
    let w1 = &report.workers[0];
    assert_eq!((w1.claimed, w1.completed, w1.leases_lost), (1, 0, 1));
    let w2 = &report.workers[1];
    assert_eq!((w2.claimed, w2.completed, w2.leases_lost), (1, 1, 0));
    // Retention 0: W2's finish deleted the run.
    assert_eq!(db.count("SELECT count(*) FROM abada_agent_runs").await, 0);
    db.drop().await;
}

/// The worked example's process with a refund agent whose refunds above 10,000 cents wait for a
/// person: one under the threshold done at once (one agent task, no stop), one approved by dana
/// and applied once, one refused by erin and explained to the customer, with no model call
/// before the stop paid again (same deep-stack runtime as the takeover above).
#[test]
fn approval_does_a_small_refund_at_once_applies_the_approved_one_explains_the_refused_one_and_ignores_a_forgery()
 {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_stack_size(8 << 20)
        .enable_all()
        .build()
        .unwrap()
        .block_on(approval_on_the_store());
}

async fn approval_on_the_store() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let report = abada_demo::run(
        &DemoWorkers,
        DemoArgs {
            scenario: Scenario::Approval,
            output: Output::Silent,
            store: Some(DemoStore::new(db.url.render(), &DemoWorkers).unwrap()),
        },
    )
    .await
    .expect("the scenario runs to its verdict");
    let failed: Vec<_> = report.checks.iter().filter(|c| !c.passed).collect();
    assert!(report.passed(), "failed checks: {failed:#?}");
    assert_eq!(report.checks.len(), 13);
    let facts = &report.facts;
    assert_eq!(facts["writesApplied"], 2);
    assert_eq!(facts["atOnce"]["agentTasks"], 1, "no approval stop");
    assert_eq!(facts["atOnce"]["writes"], 1);
    assert_eq!(facts["atOnce"]["modelCalls"], 3);
    let refunded = facts["atOnce"]["result"].as_str().unwrap();
    assert!(
        refunded.contains("o-2000") && refunded.contains("\"amountCents\":1500"),
        "the customer is told of the refund the tool applied: {refunded}"
    );
    assert_eq!(facts["approved"]["writes"], 1);
    assert_eq!(facts["approved"]["modelCalls"], 3);
    assert_eq!(facts["refused"]["writes"], 0);
    assert_eq!(facts["refused"]["modelCalls"], 3);
    let summary = facts["approved"]["request"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("o-2001") && summary.contains("25000 cents"),
        "{summary}"
    );
    let told = facts["refused"]["result"].as_str().unwrap();
    assert!(
        told.contains("\"refusedBy\":\"erin\"") && told.contains("not an instruction to you"),
        "{told}"
    );
    assert_eq!(
        facts["refused"]["request"]["arguments"]["amountCents"],
        40000
    );
    assert_eq!(
        facts["forged"]["writes"], 0,
        "the forged decision performed nothing"
    );
    assert!(
        facts["forged"]["incident"]
            .as_str()
            .unwrap()
            .contains("without a requestId"),
        "{}",
        facts["forged"]
    );
    assert!(
        !facts["store"].as_str().unwrap().contains(&db.url.password),
        "the password stays out of the report"
    );
    // The three runs that ended finished in the store once their last completion was accepted;
    // the forged decision's run still waits (its request open, for an operator to look at).
    let waiting = "SELECT count(*) FROM abada_agent_runs WHERE finished_at IS NULL";
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while db.count(waiting).await > 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        db.count(waiting).await,
        1,
        "only the forged one's run waits"
    );
    db.drop().await;
}

#[test]
fn the_binary_refuses_approval_without_a_store_url() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_abada-agent-worker"))
        .args(["demo", "--scenario", "approval"])
        .env_remove("ABADA_AGENT_STORE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ABADA_AGENT_STORE_URL") && stderr.contains("approval"),
        "{stderr}"
    );
}

#[test]
fn the_binary_refuses_store_without_a_url() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_abada-agent-worker"))
        .args(["demo", "--scenario", "takeover", "--store"])
        .env_remove("ABADA_AGENT_STORE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ABADA_AGENT_STORE_URL"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_falls_back_then_defers_without_consuming_a_retry() {
    let report = run(Scenario::RateLimit).await;
    let facts = &report.facts;
    assert_eq!(facts["primaryOk"], 0);
    // Once: its circuit holds the rate-limited primary off for its Retry-After, so
    // the later turns go straight to the fallback.
    assert_eq!(facts["primaryRefused"], 1);
    assert_eq!(facts["fallbackOk"], 3);
    assert_eq!(facts["retriesAfterDeferral"], 3);
    assert_eq!(facts["hiddenAfterDeferral"], true);
    assert_eq!(facts["failures"], 1);
    assert_eq!(facts["completedAttempt"], 2);
    assert_eq!(facts["retriesAtEnd"], 3);
    let ended: Vec<&str> = report
        .events
        .iter()
        .filter(|e| e.event == "task_ended")
        .filter_map(|e| e.data["outcome"].as_str())
        .collect();
    assert_eq!(ended, ["completed", "deferred", "completed"]);
}

#[test]
fn the_binary_exits_non_zero_on_a_bad_scenario() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_abada-agent-worker"))
        .args(["demo", "--scenario", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scenario"));
}

#[tokio::test]
async fn dev_engine_serves_the_admin_api_on_the_given_address() {
    // Port 0: the emulator binds a port the system picks, and its cheat sheet names it.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_abada-agent-worker"))
        .args(["dev-engine", "--addr", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = crate::support::wait::announcement(
        child.stdout.take().unwrap(),
        std::time::Duration::from_secs(30),
        "dev-engine",
        |line| {
            line.trim()
                .strip_prefix("engine URL for workers:")
                .map(|rest| rest.trim().to_string())
        },
    )
    .await;
    let port: u16 = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|rest| rest.strip_suffix("/api"))
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("not a loopback engine URL: {url}"));
    assert_ne!(
        port, 0,
        "the URL names the port bound, not the one asked for"
    );
    let created: Value = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/admin/tasks"))
        .json(&serde_json::json!({"variables": {"q": "2+2"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(created["ids"][0], "t-000001");
    child.start_kill().unwrap();
    let _ = child.wait().await;
}
