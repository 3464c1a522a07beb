//! Scenario `takeover`: the seed's story, time-compressed. Worker 1 freezes mid-task after its
//! keyed write was applied but before its result was journaled; the engine's clock moves past
//! its lease; worker 2 takes the task, resumes from the journal and re-sends the write with its
//! original key (the tool server deduplicates it); worker 1 wakes and is fenced off: its calls
//! are refused and it abandons the task without reporting anything.
//!
//! The freeze is a [`Freeze`] in front of worker 1's engine client; lease expiry is the
//! emulator's [`advance`](abada_devkit::engine::EngineEmulator::advance), so worker 1's own
//! clock sees no time pass (as after a pause it could not notice) and nothing waits in real time.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::timeline::{Output, Timeline};
use super::workers::{Freeze, FreezeAt, ProbeStep, StaleProbe, TaskOutcome, WorkerSpec, Workers};
use super::{
    Check, Crew, DemoError, DemoReport, journal_names, pump, pump_until, refund_task, start_stack,
};
use abada_devkit::engine::{CallRecord, Disposition, Operation, TaskStatus};
use abada_devkit::stack::{ORDERS_SERVER, Stack};

const SCENARIO: &str = "takeover";
const LIMIT: Duration = Duration::from_secs(15);
/// Both takeover stories' lease: long enough that nothing expires unless the emulator's clock is
/// moved on.
pub(super) const LEASE: Duration = Duration::from_secs(10);

pub(super) async fn run(workers: &dyn Workers, output: Output) -> Result<DemoReport, DemoError> {
    let stack = start_stack(Duration::from_millis(100)).await?;
    let result = scenario(workers, &stack, output).await;
    stack.shutdown().await;
    result
}

pub(super) fn operation_name(op: Operation) -> String {
    serde_json::to_value(op)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{op:?}"))
}

pub(super) fn call_text(c: &CallRecord) -> String {
    let outcome = match (&c.error_code, c.disposition) {
        (Some(code), _) => format!("{} {code}", c.status),
        (None, Disposition::Refused) => format!("{} refused", c.status),
        (None, _) => format!("{} accepted", c.status),
    };
    format!(
        "{:<16} {} attempt {}: {outcome}",
        operation_name(c.operation),
        c.task_id.as_deref().unwrap_or("-"),
        c.attempt.map_or_else(|| "-".to_string(), |a| a.to_string()),
    )
}

pub(super) fn call_json(c: &CallRecord) -> Value {
    json!({
        "operation": operation_name(c.operation),
        "task": c.task_id,
        "worker": c.worker_id,
        "attempt": c.attempt,
        "status": c.status,
        "code": c.error_code,
        "refused": c.disposition == Disposition::Refused,
    })
}

fn is_refusal(c: &CallRecord) -> bool {
    c.disposition == Disposition::Refused && c.status >= 400
}

/// A fencing refusal: the engine says the caller no longer holds the task.
fn is_fenced(c: &CallRecord) -> bool {
    is_refusal(c)
        && matches!(
            c.error_code.as_deref(),
            Some("WORKER_LOCK_NOT_OWNED" | "STALE_ATTEMPT" | "WORKER_LOCK_EXPIRED")
        )
}

async fn scenario(
    workers: &dyn Workers,
    stack: &Stack,
    output: Output,
) -> Result<DemoReport, DemoError> {
    let mut tl = Timeline::new(output);
    let agent = stack.refund_agent("openai/refund", &[]);
    let id = stack.engine.create_task(refund_task(agent, "o-417"));
    tl.emit(
        "engine",
        "task_open",
        format!("{id} OPEN: refund order o-417 (look up, refund with a keyed write, answer)"),
        json!({"task": id}),
    );

    // Worker 1 freezes before journaling the result of its keyed write.
    let mut crew = Crew::new();
    let mut w1 = WorkerSpec::new("W1", 1);
    w1.lease = LEASE;
    let gate1 = crew.start_freezable(
        workers,
        stack,
        w1,
        FreezeAt::BeforeJournal {
            kind: "tool".into(),
            state: "finished".into(),
            keyed_only: true,
        },
    )?;
    tl.emit(
        "demo",
        "worker_started",
        "W1 starts (1 slot, lease 10s)",
        json!({"worker": "W1"}),
    );
    let reason = pump(
        &mut tl,
        &mut crew,
        gate1.frozen(),
        SCENARIO,
        "W1 to reach its keyed write",
        LIMIT,
    )
    .await?;
    let view = stack.engine.task(&id);
    let key = view
        .as_ref()
        .and_then(|v| {
            v.journal
                .iter()
                .find(|s| s["state"] == "started")
                .and_then(|s| s["key"].as_str().map(str::to_string))
        })
        .unwrap_or_default();
    let applied_at_freeze = stack.tools.counters().await.writes_applied;
    tl.emit(
        "tools",
        "write_applied",
        format!(
            "issue_refund with key {key}: refund applied (writes applied: {applied_at_freeze})"
        ),
        json!({"key": key, "writesApplied": applied_at_freeze}),
    );
    tl.emit(
        "W1",
        "frozen",
        format!("FREEZES {reason}: no heartbeats, no calls"),
        json!({"reason": reason}),
    );
    if let Some(v) = &view {
        tl.emit(
            "engine",
            "journal",
            format!("journal of {id}: {}", journal_names(v).join(", ")),
            json!({"journal": journal_names(v)}),
        );
    }
    expire_w1_lease(&mut tl, stack, &id);

    let mut w2 = WorkerSpec::new("W2", 1);
    w2.lease = LEASE;
    let gate2 = w2_takes_over(&mut tl, &mut crew, workers, stack, w2, "", SCENARIO, LIMIT).await?;
    let counters = stack.tools.counters().await;
    let resent = stack
        .tools
        .calls()
        .iter()
        .filter(|c| c.idempotency_key.as_deref() == Some(key.as_str()))
        .count();
    tl.emit(
        "W2",
        "resumed",
        format!(
            "read the journal: tool/started {key} without a result -> re-sends issue_refund with that key"
        ),
        json!({"key": key}),
    );
    tl.emit(
        "tools",
        "deduplicated",
        format!(
            "key {key} seen before: answered from storage, not applied again (applied {}, duplicates {})",
            counters.writes_applied, counters.duplicates
        ),
        json!({"writesApplied": counters.writes_applied, "duplicates": counters.duplicates, "sendsWithKey": resent}),
    );
    if let Some(v) = stack.engine.task(&id) {
        tl.emit(
            "engine",
            "journal",
            format!("journal of {id}: {}", journal_names(&v).join(", ")),
            json!({"journal": journal_names(&v)}),
        );
    }
    tl.emit(
        "W2",
        "held",
        "holds before complete, so that W1 wakes while W2 owns the task",
        json!({}),
    );

    // Worker 1 wakes.
    let mark = stack.engine.calls().len();
    gate1.thaw();
    tl.emit(
        "W1",
        "wakes",
        "WAKES and carries on where it stopped: journal the write's result",
        json!({}),
    );
    let w1_about_task = {
        let id = id.clone();
        move |c: &CallRecord| {
            c.worker_id.as_deref() == Some("W1") && c.task_id.as_deref() == Some(id.as_str())
        }
    };
    let engine = stack.engine.clone();
    let first_call = w1_about_task.clone();
    pump(
        &mut tl,
        &mut crew,
        engine.wait_for(move |e| e.calls()[mark..].iter().any(&first_call).then_some(())),
        SCENARIO,
        "W1's first call after waking",
        LIMIT,
    )
    .await?;
    let mut w1_calls: Vec<CallRecord> = Vec::new();
    let show_new_calls = |tl: &mut Timeline, shown: &mut Vec<CallRecord>| {
        let now: Vec<CallRecord> = stack.engine.calls()[mark..]
            .iter()
            .filter(|c| w1_about_task(c))
            .cloned()
            .collect();
        for c in &now[shown.len()..] {
            tl.emit(
                "engine",
                "w1_call",
                format!("W1 {}", call_text(c)),
                call_json(c),
            );
        }
        *shown = now;
    };
    show_new_calls(&mut tl, &mut w1_calls);
    pump_until(
        &mut tl,
        &mut crew,
        |c| !c.workers[0].ended.is_empty(),
        SCENARIO,
        "W1 to give the task up",
        LIMIT,
    )
    .await?;
    show_new_calls(&mut tl, &mut w1_calls);

    // Every fenced call of the stale attempt, as W1 would send them had it carried on.
    let probe_mark = stack.engine.calls().len();
    tl.emit(
        "demo",
        "probes",
        "probe: each fenced call W1's stale attempt could still make, sent as W1 attempt 1",
        json!({}),
    );
    probe_stale_attempt(workers, stack, &id, &key).await;
    let probes: Vec<CallRecord> = stack.engine.calls()[probe_mark..]
        .iter()
        .filter(|c| w1_about_task(c))
        .cloned()
        .collect();
    for c in &probes {
        tl.emit(
            "engine",
            "probe",
            format!("W1 {}", call_text(c)),
            call_json(c),
        );
    }

    // Worker 2 finishes.
    w2_finishes(&mut tl, &mut crew, stack, &*gate2, &id, SCENARIO, LIMIT).await?;
    let workers = crew.stop().await;

    // The verdict.
    let view = stack.engine.task(&id);
    let counters = stack.tools.counters().await;
    let all = stack.engine.calls();
    let mut checks = Vec::new();
    checks.push(Check::new(
        "W1 froze after its keyed write was applied",
        applied_at_freeze == 1 && !key.is_empty(),
        format!("key {key}, writes applied at the freeze: {applied_at_freeze}"),
    ));
    let w2_attempt = workers[1].ended.first().and_then(|e| e.1);
    checks.push(Check::new(
        "W2 took the task over on a new attempt",
        w2_attempt == Some(2)
            && view
                .as_ref()
                .is_some_and(|v| v.worker_id.as_deref() == Some("W2")),
        format!("W2 ran attempt {}", super::attempt_text(w2_attempt)),
    ));
    let dup = counters.duplicates_per_key.get(&key).copied().unwrap_or(0);
    checks.push(Check::new(
        "the write was applied once and its re-send deduplicated",
        counters.writes_applied == 1 && counters.duplicates == 1 && dup == 1,
        format!(
            "tool server: {} applied, {} duplicate (key {key}: {dup})",
            counters.writes_applied, counters.duplicates
        ),
    ));
    let w1_outcome = workers[0].ended.first().map(|e| e.2);
    checks.push(Check::new(
        "W1's calls after waking were refused",
        !w1_calls.is_empty()
            && w1_calls.iter().all(is_fenced)
            && w1_outcome == Some(TaskOutcome::LeaseLost),
        format!(
            "{}; W1 ended {}",
            w1_calls
                .iter()
                .map(|c| format!(
                    "{} {}",
                    operation_name(c.operation),
                    c.error_code.as_deref().unwrap_or("accepted")
                ))
                .collect::<Vec<_>>()
                .join(", "),
            w1_outcome.map_or("-", TaskOutcome::as_str)
        ),
    ));
    let w1_reports = all[..probe_mark]
        .iter()
        .filter(|c| {
            c.worker_id.as_deref() == Some("W1")
                && matches!(
                    c.operation,
                    Operation::Complete | Operation::Failure | Operation::BpmnError
                )
        })
        .count();
    checks.push(Check::new(
        "W1 abandoned the task silently",
        w1_reports == 0,
        format!("W1 sent {w1_reports} complete/failure/bpmn-error"),
    ));
    let wanted = [
        Operation::Heartbeat,
        Operation::JournalAppend,
        Operation::ToolCredentials,
        Operation::Complete,
    ];
    let probes_ok = wanted
        .iter()
        .all(|op| probes.iter().any(|c| c.operation == *op && is_fenced(c)))
        && probes.iter().all(is_fenced);
    checks.push(Check::new(
        "every fenced call of the stale attempt is refused",
        probes_ok,
        probes
            .iter()
            .map(|c| {
                format!(
                    "{} {}",
                    operation_name(c.operation),
                    c.error_code.as_deref().unwrap_or("accepted")
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
    ));
    let completes = view.as_ref().map_or(0, |v| v.counters.completes);
    let by_w2 = all.iter().any(|c| {
        c.operation == Operation::Complete
            && c.disposition == Disposition::Executed
            && c.worker_id.as_deref() == Some("W2")
            && c.attempt == Some(2)
    });
    checks.push(Check::new(
        "completed exactly once, by W2",
        completes == 1
            && by_w2
            && view
                .as_ref()
                .is_some_and(|v| v.status == TaskStatus::Completed),
        format!("{completes} accepted complete; by W2 attempt 2: {by_w2}"),
    ));
    let journal = view.as_ref().map(journal_names).unwrap_or_default();
    let keyed_steps = view.as_ref().map_or(0, |v| {
        v.journal
            .iter()
            .filter(|s| s["key"].as_str() == Some(key.as_str()))
            .count()
    });
    checks.push(Check::new(
        "the journal holds the write once",
        keyed_steps == 2,
        format!(
            "{keyed_steps} steps with key {key} (started + finished); journal: {}",
            journal.join(", ")
        ),
    ));
    let facts = json!({
        "task": id,
        "key": key,
        "writesApplied": counters.writes_applied,
        "duplicates": counters.duplicates,
        "w1Calls": w1_calls.iter().map(call_json).collect::<Vec<_>>(),
        "probes": probes.iter().map(call_json).collect::<Vec<_>>(),
        "w2Attempt": w2_attempt,
        "completes": completes,
        "journal": journal,
    });
    let wall_seconds = (tl.seconds() * 10.0).round() / 10.0;
    Ok(DemoReport {
        scenario: SCENARIO,
        events: tl.into_events(),
        workers: workers.into_iter().map(|w| w.stats).collect(),
        checks,
        facts,
        wall_seconds,
    })
}

/// Sends extend, journal append, tool-credential and complete as W1's attempt 1 (one try
/// each, no retries); the engine's answers land in its call log.
async fn probe_stale_attempt(workers: &dyn Workers, stack: &Stack, id: &str, key: &str) {
    let probe = StaleProbe {
        engine_url: stack.engine.base_url(),
        worker: "W1".into(),
        task_id: id.to_string(),
        attempt: Some(1),
        lease: LEASE,
        step: ProbeStep {
            seq: 6,
            kind: "tool".into(),
            state: "finished".into(),
            key: Some(key.to_string()),
            data: json!({"server": ORDERS_SERVER, "tool": "issue_refund", "result": {"content": [], "isError": false}}),
        },
        tool_server: ORDERS_SERVER.into(),
    };
    // Each answer is a refusal; what matters is what the engine logged.
    workers.probe_stale_attempt(&probe).await;
}

/// Worker 1 is frozen: the emulator's clock jumps past its lease (both takeover stories do so).
pub(super) fn expire_w1_lease(tl: &mut Timeline, stack: &Stack, id: &str) {
    let jump = LEASE + Duration::from_secs(1);
    stack.engine.advance(jump);
    tl.emit(
        "engine",
        "lease_expired",
        format!(
            "clock +{}s (emulator time): W1's {}s lease on {id} has expired",
            jump.as_secs(),
            LEASE.as_secs()
        ),
        json!({"advancedMs": jump.as_millis() as u64}),
    );
}

/// Worker 2 starts with `options`, takes the task over and is held just before `complete`, so
/// that worker 1 wakes while worker 2 owns the task (both takeover stories do so); returns the
/// gate that holds it. `what_else` ends the start-up line of the timeline.
#[allow(clippy::too_many_arguments)]
pub(super) async fn w2_takes_over(
    tl: &mut Timeline,
    crew: &mut Crew,
    workers: &dyn Workers,
    stack: &Stack,
    options: WorkerSpec,
    what_else: &str,
    scenario: &'static str,
    limit: Duration,
) -> Result<Arc<dyn Freeze>, DemoError> {
    let slots = options.slots;
    let lease = options.lease.as_secs();
    let gate2 = crew.start_freezable(workers, stack, options, FreezeAt::BeforeComplete)?;
    tl.emit(
        "demo",
        "worker_started",
        format!("W2 starts ({slots} slot, lease {lease}s{what_else})"),
        json!({"worker": "W2"}),
    );
    pump(
        tl,
        crew,
        gate2.frozen(),
        scenario,
        "W2 to resume the task",
        limit,
    )
    .await?;
    Ok(gate2)
}

/// Worker 2, frozen before its completion, is let go: it completes the task and reports the
/// end (both takeover stories end so).
pub(super) async fn w2_finishes(
    tl: &mut Timeline,
    crew: &mut Crew,
    stack: &Stack,
    gate2: &dyn Freeze,
    id: &str,
    scenario: &'static str,
    limit: Duration,
) -> Result<(), DemoError> {
    gate2.thaw();
    tl.emit("W2", "released", "goes on: complete", json!({}));
    let engine = stack.engine.clone();
    let done_id = id.to_string();
    pump(
        tl,
        crew,
        engine.wait_for(move |e| {
            e.task(&done_id)
                .filter(|v| v.status == TaskStatus::Completed)
        }),
        scenario,
        "W2 to complete the task",
        limit,
    )
    .await?;
    pump_until(
        tl,
        crew,
        |c| !c.workers[1].ended.is_empty(),
        scenario,
        "W2 to report the end",
        limit,
    )
    .await
}
