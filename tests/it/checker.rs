//! The invariant checker itself (`support::invariants`): it must catch what it exists to catch.
//! Each test plays a worker's calls by hand against the engine emulator, breaking one rule, and
//! expects the checker to name the violation.

use abada_agent_worker::devkit::engine::{self, EmulatorOptions, TaskSpec};
use serde_json::{Value, json};

use crate::support::invariants::{Expect, INVARIANTS, check_invariants};

async fn post(emu: &engine::EngineEmulator, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/external-tasks/{path}", emu.base_url()))
        .header("X-Abada-Worker-Protocol-Version", "1")
        .json(&body)
        .send()
        .await
        .expect("the emulator answers");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn task() -> TaskSpec {
    TaskSpec {
        agent: Some(json!({"model": "openai/m", "input": "x"})),
        retries: Some(3),
        ..TaskSpec::default()
    }
}

/// The hole issue 17 closed: refusals of an attempt with a committed ending were all exempt, so
/// a `complete` sent after the journal refused a step (`JOURNAL_CONFLICT`) passed.
#[tokio::test]
async fn a_complete_after_a_journal_conflict_is_a_violation_even_though_it_committed() {
    let emu = engine::start(EmulatorOptions::default()).await.unwrap();
    let conflicted = emu.create_task(task());
    let clean = emu.create_task(task());
    let (status, locked) = post(
        &emu,
        "fetch-and-lock",
        json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": 10000, "maxTasks": 2}),
    )
    .await;
    assert_eq!(status, 200, "{locked}");
    for id in [&conflicted, &clean] {
        let step = json!({"workerId": "w1", "attempt": 1, "step":
            {"seq": 1, "kind": "input", "state": "finished", "data": {"instructions": "", "input": "x"}}});
        assert_eq!(post(&emu, &format!("{id}/journal"), step).await.0, 201);
    }
    let different = json!({"workerId": "w1", "attempt": 1, "step":
        {"seq": 1, "kind": "model", "state": "finished", "data": {}}});
    let (status, body) = post(&emu, &format!("{conflicted}/journal"), different).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("JOURNAL_CONFLICT"))
    );
    for id in [&conflicted, &clean] {
        let (status, body) = post(
            &emu,
            &format!("{id}/complete"),
            json!({"workerId": "w1", "attempt": 1, "variables": {}}),
        )
        .await;
        assert!(matches!(status, 200 | 204), "{status} {body}");
    }
    let report = check_invariants(&emu, &[], &[], &Expect::default()).await;
    let check = report
        .checks
        .iter()
        .find(|c| c.name == INVARIANTS[4])
        .expect("invariant 5 is checked");
    assert_eq!(check.violations.len(), 1, "{:?}", check.violations);
    assert!(
        check.violations[0].contains(&conflicted)
            && check.violations[0].contains("JOURNAL_CONFLICT"),
        "{:?}",
        check.violations
    );
    assert!(!report.passed());
    emu.shutdown().await;
}
