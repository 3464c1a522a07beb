//! The worker core over real HTTP: `HttpEngine` + `Runner` against the engine emulator on
//! 127.0.0.1 (two workers sharing a backlog, a frozen worker whose lease is taken over, lost and
//! header-less fetch responses, heartbeats and their refusal, retried completions, trace
//! context), and configuration errors through the real binary.
//!
//! Only behaviour is asserted, never timings: every wait is on an emulator change or a runner
//! event, bounded by a hang guard. Lease expiry is forced with the emulator's `advance` clock.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::devkit::engine::{
    self as emulator, AuthRejection, Authorizer, Disposition, EmulatorOptions, EngineEmulator,
    Fault, HeaderMap, Operation, TaskSpec, TaskStatus,
};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::runner::RunnerEvent;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;

use crate::support::emulator_worker::{
    CompletingHandler, WorkerOptions, accepted, calls_of, check_lease_discipline, spawn_worker,
    wait_completed, within,
};
use crate::support::tcp_proxy::{Mode, TcpProxy};

async fn start_emulator() -> EngineEmulator {
    emulator::start(EmulatorOptions::default())
        .await
        .expect("emulator starts on a free loopback port")
}

fn spec_sleeping(ms: u64) -> TaskSpec {
    let mut variables = Map::new();
    variables.insert("sleepMs".into(), ms.into());
    TaskSpec {
        variables,
        retries: Some(3),
        ..Default::default()
    }
}

// 1 -------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_200_tasks_each_completed_once_under_one_live_lease() {
    let emu = start_emulator().await;
    let ids = emu.create_tasks((0..200).map(|_| spec_sleeping(5)));
    // Generous: no lease has to run out here, and a starved process must lose none.
    let lock = Duration::from_secs(30);
    let w1 = spawn_worker(&emu, WorkerOptions::new("w-one", lock));
    let w2 = spawn_worker(&emu, WorkerOptions::new("w-two", lock));

    within("200 tasks completed", async {
        emu.wait_for(|e| {
            e.tasks()
                .iter()
                .all(|t| t.status == TaskStatus::Completed)
                .then_some(())
        })
        .await
    })
    .await;
    let max_tasks = [w1.engine.fetch_max_tasks(), w2.engine.fetch_max_tasks()];
    let events = [w1.stop().await, w2.stop().await];

    let calls = emu.calls();
    check_lease_discipline(&calls);
    // Each task was handed out by exactly one fetch (never to both workers).
    let mut handed: HashMap<&str, Vec<&str>> = HashMap::new();
    for c in calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
    {
        assert!(c.task_ids.len() <= 4, "a fetch returned more than 4: {c:?}");
        for id in &c.task_ids {
            handed
                .entry(id.as_str())
                .or_default()
                .push(c.worker_id.as_deref().unwrap_or(""));
        }
    }
    for id in &ids {
        let t = emu.task(id).unwrap();
        assert_eq!(t.counters.completes, 1, "task {id} completed once");
        assert_eq!(t.counters.acquisitions, 1, "task {id} acquired once");
        assert_eq!(t.counters.failures, 0, "task {id} never failed");
        let holders = &handed[id.as_str()];
        assert_eq!(holders.len(), 1, "task {id} handed out once: {holders:?}");
        let done_by = t.result_variables.as_ref().and_then(|v| v.get("doneBy"));
        assert_eq!(
            done_by.and_then(Value::as_str),
            Some(holders[0]),
            "task {id} completed by the worker that fetched it"
        );
    }
    for (worker, asked) in max_tasks.iter().enumerate() {
        assert!(!asked.is_empty(), "worker {worker} fetched");
        assert!(
            asked.iter().all(|&n| (1..=4).contains(&n)),
            "worker {worker} asked for maxTasks outside 1..=4: {asked:?}"
        );
    }
    // Both workers did work, and every task a runner started ended completed.
    for (worker, events) in events.iter().enumerate() {
        let ended: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                RunnerEvent::TaskEnded { outcome, .. } => Some(*outcome),
                _ => None,
            })
            .collect();
        assert!(!ended.is_empty(), "worker {worker} ran tasks");
        assert!(ended.iter().all(|o| *o == TaskEnd::Completed), "{ended:?}");
    }
    let total_ended: usize = events
        .iter()
        .flatten()
        .filter(|e| matches!(e, RunnerEvent::TaskEnded { .. }))
        .count();
    assert_eq!(total_ended, 200);
}

// 2 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_frozen_worker_whose_lease_was_taken_over_reports_nothing_accepted() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(50));
    // A lease long enough that worker 1's own clock does not expire it while the test runs:
    // the takeover is made by the emulator's clock.
    let lock = Duration::from_secs(6);
    let w1 = spawn_worker(&emu, WorkerOptions::new("w-frozen", lock).max_tasks(1));
    w1.wait_event(|e| matches!(e, RunnerEvent::TaskStarted { .. }))
        .await;
    w1.engine.freeze();
    // Its handler finishes; the completion is held by the freeze.
    w1.engine.wait_blocked("complete").await;

    emu.advance(lock + Duration::from_secs(1));
    let gate = Arc::new(Semaphore::new(0));
    let w2 = spawn_worker(
        &emu,
        WorkerOptions::new("w-taker", lock).max_tasks(1).handler(
            CompletingHandler::new("w-taker", Duration::from_millis(10)).gated(gate.clone()),
        ),
    );
    w2.wait_event(
        |e| matches!(e, RunnerEvent::TaskStarted { task_id, attempt: Some(2) } if *task_id == id),
    )
    .await;
    let takeover = emu.calls().len();

    assert!(w1.engine.blocked_ops().contains(&"complete"));
    w1.engine.thaw();
    assert_eq!(w1.wait_ended(&id, 1).await, TaskEnd::LeaseLost);
    gate.add_permits(1);
    let done = wait_completed(&emu, &id).await;
    assert_eq!(w2.wait_ended(&id, 2).await, TaskEnd::Completed);
    w1.stop().await;
    w2.stop().await;

    assert_eq!(done.counters.completes, 1);
    assert_eq!(done.counters.acquisitions, 2);
    assert_eq!(done.worker_id.as_deref(), Some("w-taker"));
    let result = done.result_variables.expect("completed with variables");
    assert_eq!(result.get("doneBy"), Some(&json!("w-taker")));

    let calls = emu.calls();
    check_lease_discipline(&calls);
    let late: Vec<_> = calls[takeover..]
        .iter()
        .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
        .filter(|c| c.worker_id.as_deref() == Some("w-frozen"))
        .collect();
    assert!(
        !late.is_empty(),
        "worker 1's held calls reached the engine after thawing"
    );
    for c in &late {
        assert_eq!(c.disposition, Disposition::Refused, "{c:?}");
        assert!(matches!(c.status, 400 | 403 | 409), "{c:?}");
    }
    assert!(
        late.iter()
            .any(|c| c.operation == Operation::Complete && c.status == 403),
        "the late completion was refused as not owned: {late:?}"
    );
    let w1_reports = calls.iter().filter(|c| {
        c.task_id.as_deref() == Some(id.as_str())
            && c.worker_id.as_deref() == Some("w-frozen")
            && matches!(c.operation, Operation::Complete | Operation::Failure)
            && c.disposition == Disposition::Executed
    });
    assert_eq!(
        w1_reports.count(),
        0,
        "worker 1 reported nothing that was executed"
    );
}

#[tokio::test]
async fn a_frozen_worker_gives_its_lease_up_by_its_own_clock_and_drops_its_held_heartbeat() {
    let emu = start_emulator().await;
    // Worker 1's task never finishes (its gate stays shut); its first heartbeat (at lock / 3) is
    // held by the freeze, so no extension is accepted and the worker's own clock ends the lease.
    let id = emu.create_task(spec_sleeping(10));
    let lock = Duration::from_millis(1500);
    let never = Arc::new(Semaphore::new(0));
    let w1 = spawn_worker(
        &emu,
        WorkerOptions::new("w-frozen", lock)
            .max_tasks(1)
            .handler(CompletingHandler::new("w-frozen", Duration::ZERO).gated(never)),
    );
    w1.wait_event(|e| matches!(e, RunnerEvent::TaskStarted { .. }))
        .await;
    w1.engine.freeze();
    w1.engine.wait_blocked("heartbeat").await;
    assert_eq!(
        w1.wait_ended(&id, 1).await,
        TaskEnd::LeaseLost,
        "the worker stopped the task on its own while the engine was unreachable"
    );
    // Giving the lease up aborts the extension still on its way: the engine is still frozen, yet
    // the held heartbeat is gone.
    w1.engine.wait_dropped("heartbeat").await;

    emu.advance(lock + Duration::from_secs(1));
    let w2 = spawn_worker(&emu, WorkerOptions::new("w-taker", lock).max_tasks(1));
    w2.wait_event(
        |e| matches!(e, RunnerEvent::TaskStarted { task_id, attempt: Some(2) } if *task_id == id),
    )
    .await;
    w1.engine.thaw();
    w1.stop().await;
    w2.stop().await;

    let calls = emu.calls();
    check_lease_discipline(&calls);
    assert!(
        calls
            .iter()
            .all(|c| !(c.worker_id.as_deref() == Some("w-frozen")
                && c.task_id.as_deref() == Some(id.as_str())
                && c.operation != Operation::FetchAndLock)),
        "worker 1 sent nothing about the task it gave up: {:?}",
        calls
            .iter()
            .filter(|c| c.worker_id.as_deref() == Some("w-frozen"))
            .map(|c| (c.operation, c.disposition))
            .collect::<Vec<_>>()
    );
}

// 3 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_lost_fetch_response_is_retried_with_the_same_key_and_its_tasks_run() {
    let emu = start_emulator().await;
    let ids = emu.create_tasks((0..3).map(|_| spec_sleeping(10)));
    emu.inject(Fault::DropResponse {
        operation: Operation::FetchAndLock,
        count: 1,
    });
    let w = spawn_worker(&emu, WorkerOptions::new("w-drop", Duration::from_secs(30)));
    for id in &ids {
        wait_completed(&emu, id).await;
    }
    let events = w.stop().await;

    let calls = emu.calls();
    let fetches: Vec<_> = calls
        .iter()
        .filter(|c| c.operation == Operation::FetchAndLock)
        .collect();
    let (first, second) = (fetches[0], fetches[1]);
    assert!(first.response_dropped && first.disposition == Disposition::Executed);
    assert_eq!(
        first.task_ids.len(),
        3,
        "the lost response had locked all three"
    );
    assert!(first.idempotency_key.is_some());
    assert_eq!(
        second.idempotency_key, first.idempotency_key,
        "same key on the retry"
    );
    assert_eq!(second.disposition, Disposition::Replayed);
    assert_eq!(
        second.task_ids, first.task_ids,
        "the replay returned the locked tasks"
    );
    for id in &ids {
        let t = emu.task(id).unwrap();
        assert_eq!(
            t.counters.acquisitions, 1,
            "{id} was not stranded and re-acquired"
        );
        assert_eq!(t.counters.completes, 1);
    }
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, RunnerEvent::FetchFailed { .. })),
        "the retry hid the lost response from the runner: {events:?}"
    );
    check_lease_discipline(&calls);
}

// 4 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_fetch_response_without_the_protocol_header_is_not_processed() {
    let emu = start_emulator().await;
    let ids = emu.create_tasks((0..2).map(|_| spec_sleeping(10)));
    emu.inject(Fault::OmitProtocolHeader { count: 1 });
    let lock = Duration::from_secs(5);
    let w = spawn_worker(&emu, WorkerOptions::new("w-header", lock));

    let failed = w
        .wait_event(|e| matches!(e, RunnerEvent::FetchFailed { .. }))
        .await;
    let RunnerEvent::FetchFailed { error } = failed else {
        unreachable!()
    };
    assert!(
        error.contains("X-Abada-Worker-Protocol-Version"),
        "the error names the missing header: {error}"
    );
    // The next fetch finds nothing (the tasks stay locked under the lost leases), and nothing
    // was started from the header-less answer.
    within("a fetch after the refused one", async {
        emu.wait_for(|e| {
            let fetches: Vec<_> = e
                .calls()
                .into_iter()
                .filter(|c| c.operation == Operation::FetchAndLock)
                .collect();
            (fetches.len() >= 2).then_some(())
        })
        .await
    })
    .await;
    assert!(
        !w.events()
            .iter()
            .any(|e| matches!(e, RunnerEvent::TaskStarted { .. })),
        "no task started from a response without the protocol header"
    );

    emu.advance(lock + Duration::from_secs(1));
    for id in &ids {
        let t = wait_completed(&emu, id).await;
        assert_eq!(
            t.counters.acquisitions, 2,
            "{id} re-acquired after its lease expired"
        );
        assert_eq!(t.counters.completes, 1);
        assert_eq!(t.attempt, 2);
    }
    let events = w.stop().await;
    for e in &events {
        if let RunnerEvent::TaskStarted { attempt, .. } = e {
            assert_eq!(
                *attempt,
                Some(2),
                "only the second acquisition ran: {events:?}"
            );
        }
    }
    let calls = emu.calls();
    for id in &ids {
        let completes = calls_of(&calls, id, Operation::Complete);
        assert_eq!(completes.len(), 1);
        assert_eq!(completes[0].attempt, Some(2));
    }
    check_lease_discipline(&calls);
}

// 5 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn heartbeats_extend_with_fresh_keys_and_a_refused_one_loses_the_task() {
    let emu = start_emulator().await;
    // Two slots: `long` runs 4 s under a 3 s lease (heartbeats at 1, 2 and 3 s, the third a
    // second before it ends); `refused` loses its lease at its first heartbeat (1 s); `after`
    // then takes the freed slot.
    let long = emu.create_task(spec_sleeping(4000));
    let refused = emu.create_task(spec_sleeping(3500));
    let after = emu.create_task(spec_sleeping(50));
    emu.inject(Fault::RefuseHeartbeats {
        task_id: refused.clone(),
    });
    let w = spawn_worker(
        &emu,
        WorkerOptions::new("w-beat", Duration::from_secs(3)).max_tasks(2),
    );

    assert_eq!(w.wait_ended(&refused, 1).await, TaskEnd::LeaseLost);
    wait_completed(&emu, &after).await;
    wait_completed(&emu, &long).await;
    let events = w.stop().await;
    let calls = emu.calls();

    // The long task: several heartbeats, each with its own key and the attempt.
    let beats = calls_of(&calls, &long, Operation::Heartbeat);
    assert!(
        beats.len() >= 3,
        "several heartbeats in 4 s at 1 s: {beats:?}"
    );
    let keys: HashSet<_> = beats.iter().map(|c| c.idempotency_key.clone()).collect();
    assert_eq!(keys.len(), beats.len(), "a fresh key per heartbeat");
    assert!(beats.iter().all(|c| c.idempotency_key.is_some()));
    for b in &beats {
        assert_eq!(b.attempt, Some(1), "{b:?}");
        assert!(accepted(b) && b.status == 204, "{b:?}");
    }
    assert_eq!(emu.task(&long).unwrap().counters.completes, 1);

    // The refused task: no report at all, ever.
    let refused_beats = calls_of(&calls, &refused, Operation::Heartbeat);
    assert!(!refused_beats.is_empty());
    assert!(refused_beats.iter().all(|c| c.status == 403));
    for op in [
        Operation::Complete,
        Operation::Failure,
        Operation::BpmnError,
    ] {
        assert!(
            calls_of(&calls, &refused, op).is_empty(),
            "no {op:?} for a task whose lease was lost"
        );
    }
    // Its slot was reused: `after` started once `refused` had ended.
    let pos = |pred: &dyn Fn(&RunnerEvent) -> bool| events.iter().position(pred).unwrap();
    let refused_end = pos(
        &|e| matches!(e, RunnerEvent::TaskEnded { task_id, attempt: Some(1), .. } if *task_id == refused),
    );
    let after_start =
        pos(&|e| matches!(e, RunnerEvent::TaskStarted { task_id, .. } if *task_id == after));
    assert!(refused_end < after_start, "{events:?}");
    check_lease_discipline(&calls);
}

// 6 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_completion_refused_with_concurrent_modification_is_retried_once_with_its_key() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(10));
    emu.inject(Fault::ConcurrentModification {
        operation: Operation::Complete,
        count: 1,
    });
    let w = spawn_worker(&emu, WorkerOptions::new("w-cm", Duration::from_secs(30)));
    let t = wait_completed(&emu, &id).await;
    assert_eq!(w.wait_ended(&id, 1).await, TaskEnd::Completed);
    w.stop().await;

    assert_eq!(t.counters.completes, 1);
    let calls = emu.calls();
    let completes = calls_of(&calls, &id, Operation::Complete);
    assert_eq!(completes.len(), 2, "{completes:?}");
    assert_eq!(completes[0].status, 409);
    assert_eq!(
        completes[0].error_code.as_deref(),
        Some("CONCURRENT_MODIFICATION")
    );
    assert_eq!(completes[1].disposition, Disposition::Executed);
    assert_eq!(completes[1].status, 200);
    assert_eq!(completes[0].idempotency_key, completes[1].idempotency_key);
    assert!(completes[0].idempotency_key.is_some());
}

// 7 -------------------------------------------------------------------------------------------

#[tokio::test]
async fn transient_server_errors_on_complete_are_retried_with_the_same_key() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(10));
    emu.inject(Fault::ServerError {
        operation: Operation::Complete,
        count: 2,
        status: None,
    });
    let w = spawn_worker(&emu, WorkerOptions::new("w-5xx", Duration::from_secs(30)));
    let t = wait_completed(&emu, &id).await;
    assert_eq!(w.wait_ended(&id, 1).await, TaskEnd::Completed);
    w.stop().await;

    assert_eq!(t.counters.completes, 1);
    let calls = emu.calls();
    let completes = calls_of(&calls, &id, Operation::Complete);
    assert_eq!(completes.len(), 3, "{completes:?}");
    assert!(
        completes[..2]
            .iter()
            .all(|c| c.status == 500 && c.disposition == Disposition::Injected)
    );
    assert_eq!(completes[2].disposition, Disposition::Executed);
    let keys: HashSet<_> = completes
        .iter()
        .map(|c| c.idempotency_key.clone())
        .collect();
    assert_eq!(keys.len(), 1, "one key for every try: {completes:?}");
}

#[tokio::test]
async fn a_lost_complete_response_is_retried_and_answered_from_the_replay() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(10));
    emu.inject(Fault::DropResponse {
        operation: Operation::Complete,
        count: 1,
    });
    let w = spawn_worker(&emu, WorkerOptions::new("w-lost", Duration::from_secs(3)));
    let t = wait_completed(&emu, &id).await;
    assert_eq!(w.wait_ended(&id, 1).await, TaskEnd::Completed);
    w.stop().await;

    assert_eq!(t.counters.completes, 1);
    let calls = emu.calls();
    let completes = calls_of(&calls, &id, Operation::Complete);
    assert_eq!(completes.len(), 2, "{completes:?}");
    assert!(completes[0].response_dropped);
    assert_eq!(completes[0].disposition, Disposition::Executed);
    assert_eq!(completes[1].disposition, Disposition::Replayed);
    assert_eq!(completes[1].status, 200);
    assert_eq!(completes[0].idempotency_key, completes[1].idempotency_key);
}

#[tokio::test]
async fn a_completion_sent_into_an_engine_outage_is_retried_with_its_key_until_it_lands() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(10));
    let gate = Arc::new(Semaphore::new(0));
    let w = spawn_worker(
        &emu,
        WorkerOptions::new("w-outage", Duration::from_secs(5))
            .max_tasks(1)
            .handler(CompletingHandler::new("w-outage", Duration::ZERO).gated(gate.clone())),
    );
    w.wait_event(|e| matches!(e, RunnerEvent::TaskStarted { .. }))
        .await;
    emu.set_outage(true);
    gate.add_permits(1);
    // Two tries of the completion hit the outage (closed connections, nothing executed).
    within("two completions lost in the outage", async {
        emu.wait_for(|e| (calls_of(&e.calls(), &id, Operation::Complete).len() >= 2).then_some(()))
            .await
    })
    .await;
    emu.set_outage(false);
    let t = wait_completed(&emu, &id).await;
    assert_eq!(w.wait_ended(&id, 1).await, TaskEnd::Completed);
    w.stop().await;

    assert_eq!(t.counters.completes, 1);
    let calls = emu.calls();
    let completes = calls_of(&calls, &id, Operation::Complete);
    let keys: HashSet<_> = completes
        .iter()
        .map(|c| c.idempotency_key.clone())
        .collect();
    assert_eq!(keys.len(), 1, "one key for every try: {completes:?}");
    assert!(completes[..2].iter().all(|c| c.response_dropped));
    assert_eq!(
        completes
            .iter()
            .filter(|c| c.disposition == Disposition::Executed)
            .count(),
        1
    );
}

#[tokio::test]
async fn shutdown_releases_an_unfinished_task_for_another_worker_at_once() {
    let emu = start_emulator().await;
    let id = emu.create_task(spec_sleeping(10));
    let never = Arc::new(Semaphore::new(0));
    let mut opts = WorkerOptions::new("w-leaving", Duration::from_secs(5))
        .max_tasks(1)
        .handler(CompletingHandler::new("w-leaving", Duration::ZERO).gated(never));
    opts.shutdown_grace = Duration::from_millis(200);
    let w = spawn_worker(&emu, opts);
    w.wait_event(|e| matches!(e, RunnerEvent::TaskStarted { .. }))
        .await;
    let events = w.stop().await;

    assert!(
        events.iter().any(|e| matches!(e,
            RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::Released, .. } if *task_id == id)),
        "{events:?}"
    );
    let t = emu.task(&id).unwrap();
    assert_eq!(t.status, TaskStatus::Open, "available again at once: {t:?}");
    assert!(!t.hidden);
    assert_eq!(t.retries, Some(3), "the release consumed no retry");
    assert_eq!(t.counters.failures, 1);
    assert_eq!(t.counters.completes, 0);
    // Another worker takes it straight away and finishes it.
    let w2 = spawn_worker(&emu, WorkerOptions::new("w-next", Duration::from_secs(5)));
    let t = wait_completed(&emu, &id).await;
    assert_eq!(t.attempt, 2);
    w2.stop().await;
    check_lease_discipline(&emu.calls());
}

// 8 -------------------------------------------------------------------------------------------

/// The emulator's call log does not record request headers; its authorizer hook sees them, so
/// this one lets everything through and keeps each request's `traceparent` by its
/// `Idempotency-Key` (every worker call carries one).
#[derive(Default)]
struct HeaderRecorder {
    traceparent_by_key: Mutex<HashMap<String, Option<String>>>,
}

impl Authorizer for HeaderRecorder {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        let get = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        if let Some(key) = get("idempotency-key") {
            self.traceparent_by_key
                .lock()
                .unwrap()
                .insert(key, get("traceparent"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn calls_about_a_task_continue_its_trace() {
    const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
    const PARENT_SPAN: &str = "b7ad6b7169203331";
    let recorder = Arc::new(HeaderRecorder::default());
    let emu = emulator::start(EmulatorOptions {
        authorizer: Some(recorder.clone()),
        ..Default::default()
    })
    .await
    .unwrap();
    let id = emu.create_task(TaskSpec {
        trace_parent: Some(format!("00-{TRACE_ID}-{PARENT_SPAN}-01")),
        ..spec_sleeping(700)
    });
    // 900 ms lease: a heartbeat every 300 ms while the task runs 700 ms.
    let w = spawn_worker(
        &emu,
        WorkerOptions::new("w-trace", Duration::from_millis(900)),
    );
    wait_completed(&emu, &id).await;
    w.stop().await;

    let calls = emu.calls();
    let recorded = recorder.traceparent_by_key.lock().unwrap().clone();
    let about_task: Vec<_> = calls
        .iter()
        .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
        .collect();
    assert!(
        about_task
            .iter()
            .any(|c| c.operation == Operation::Heartbeat)
    );
    assert!(
        about_task
            .iter()
            .any(|c| c.operation == Operation::Complete)
    );
    let mut spans = HashSet::new();
    for c in &about_task {
        let key = c
            .idempotency_key
            .as_deref()
            .expect("every call carries a key");
        let tp = recorded
            .get(key)
            .cloned()
            .flatten()
            .unwrap_or_else(|| panic!("no traceparent on {c:?}"));
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "{tp}");
        assert_eq!(parts[0], "00", "{tp}");
        assert_eq!(parts[1], TRACE_ID, "continues the task's trace: {tp}");
        assert_eq!(parts[2].len(), 16, "{tp}");
        assert_ne!(parts[2], PARENT_SPAN, "a span of its own: {tp}");
        assert_eq!(parts[3], "01", "{tp}");
        spans.insert(parts[2].to_string());
    }
    assert_eq!(spans.len(), about_task.len(), "a fresh span id per call");
    // A fetch belongs to no task: its own root trace.
    let fetch = calls
        .iter()
        .find(|c| c.operation == Operation::FetchAndLock)
        .unwrap();
    let tp = recorded[fetch.idempotency_key.as_deref().unwrap()]
        .clone()
        .expect("fetch carries a traceparent");
    assert!(!tp.contains(TRACE_ID), "{tp}");
}

// 9 -------------------------------------------------------------------------------------------

mod config_errors {
    //! The real binary with a cleared environment: a bad value exits 2 with one stderr line
    //! naming the variable, the problem and the allowed range, before any network call.

    use std::net::TcpListener;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    const BIN: &str = env!("CARGO_BIN_EXE_abada-agent-worker");

    /// An engine URL nobody should call, and the listener to check that.
    fn trap() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let url = format!("http://{}/api", l.local_addr().unwrap());
        (l, url)
    }

    struct Run {
        code: Option<i32>,
        stderr: String,
    }

    fn run(vars: &[(&str, &str)]) -> Run {
        let mut cmd = Command::new(BIN);
        cmd.env_clear()
            .env("ABADA_AGENT_HTTP_ADDR", "127.0.0.1:0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("the binary starts");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the binary did not exit on a bad configuration: {vars:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        Run {
            code: out.status.code(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn assert_config_error(vars: &[(&str, &str)], var: &str, must_contain: &[&str]) {
        let run = run(vars);
        assert_eq!(
            run.code,
            Some(2),
            "exit code for {vars:?}; stderr: {}",
            run.stderr
        );
        let lines: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert_eq!(lines.len(), 1, "exactly one stderr line: {:?}", run.stderr);
        assert!(lines[0].contains(var), "names {var}: {}", lines[0]);
        for s in must_contain {
            assert!(lines[0].contains(s), "says {s:?}: {}", lines[0]);
        }
    }

    fn assert_untouched(listener: &TcpListener) {
        match listener.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("the engine URL received a connection: {other:?}"),
        }
    }

    #[test]
    fn bad_numbers_and_formats_exit_2_with_one_line_and_no_network() {
        let (listener, url) = trap();
        let url = url.as_str();
        // No engine URL at all.
        assert_config_error(&[], "ABADA_AGENT_ENGINE_URL", &["required"]);
        // One bad value beside a valid engine URL: (variable, value, what stderr must say).
        let cases: [(&str, &str, &[&str]); 6] = [
            ("ABADA_AGENT_MAX_TASKS", "0", &["0", "1..=50"]),
            ("ABADA_AGENT_MAX_TASKS", "51", &["51", "1..=50"]),
            ("ABADA_AGENT_LOCK_DURATION_MS", "0", &["1..=3600000"]),
            (
                "ABADA_AGENT_LOCK_DURATION_MS",
                "3600001",
                &["3600001", "1..=3600000"],
            ),
            (
                "ABADA_AGENT_POLL_INTERVAL_MS",
                "fast",
                &["fast", "not a whole number", "1..=3600000"],
            ),
            ("ABADA_AGENT_LOG_FORMAT", "xml", &["xml", "json", "pretty"]),
        ];
        for (var, value, says) in cases {
            assert_config_error(&[("ABADA_AGENT_ENGINE_URL", url), (var, value)], var, says);
        }
        assert_untouched(&listener);
    }

    #[test]
    fn a_secret_in_a_bad_configuration_is_never_printed() {
        let (listener, url) = trap();
        let secret = "sk-test-6f1c2a9e-never-print-me";
        let vars = [
            ("ABADA_AGENT_ENGINE_URL", url.as_str()),
            ("ABADA_AGENT_PROVIDERS", "mystery"),
            ("ABADA_AGENT_PROVIDER_MYSTERY_KIND", "cohere"),
            ("ABADA_AGENT_PROVIDER_MYSTERY_API_KEY", secret),
        ];
        assert_config_error(
            &vars,
            "ABADA_AGENT_PROVIDER_MYSTERY_KIND",
            &["openai", "anthropic"],
        );
        let run = run(&vars);
        assert!(!run.stderr.contains(secret), "{}", run.stderr);
        assert!(!run.stderr.contains("never-print-me"), "{}", run.stderr);
        assert_untouched(&listener);
    }
}

/// Two writers with one worker id and attempt race for a journal seq: the loser's append meets
/// IDEMPOTENCY_CONFLICT (same key, other body) and must read it as "the journal moved on".
#[tokio::test]
async fn an_append_key_conflict_means_the_journal_moved_on() {
    use abada_agent_worker::engine::client::{EngineClientSettings, HttpEngine};
    use abada_agent_worker::engine::{Engine, FetchRequest, JournalStep, LeaseLostReason};
    use abada_agent_worker::metrics::Metrics;

    let emu = abada_agent_worker::devkit::engine::start(Default::default())
        .await
        .unwrap();
    emu.create_task(TaskSpec::default());
    let client = HttpEngine::new(
        reqwest::Client::new(),
        EngineClientSettings::new(emu.base_url(), "w-same"),
        None,
        Arc::new(Metrics::new()),
    );
    let tasks = client
        .fetch_and_lock(&FetchRequest {
            topics: vec!["abada:agent".into()],
            lock_duration: Duration::from_secs(30),
            max_tasks: 1,
        })
        .await
        .unwrap();
    let task = tasks[0].task_ref();
    let step = |text: &str| JournalStep {
        seq: 1,
        kind: "input".into(),
        state: "finished".into(),
        key: None,
        data: serde_json::json!({"instructions": "", "input": text}),
    };
    client.append_journal(&task, &step("first")).await.unwrap();
    let err = client
        .append_journal(&task, &step("second"))
        .await
        .unwrap_err();
    assert_eq!(
        err.lease_lost(),
        Some(LeaseLostReason::JournalConflict),
        "{err}"
    );
    emu.shutdown().await;
}

// The engine that never answers ---------------------------------------------------------------

/// The stall on the real engine 0.11 (docs/benchmarks-history.md, "The real engine 0.11 at full
/// slots"): the engine accepts connections and answers nothing, while one task works and another's
/// completion is on its way. Every lease is lost at its local expiry (lock less a tenth, by the
/// worker's clock), the held task's by the heartbeat scheduler and the reporting one's by its
/// fenced report (before: the report rode the outage out for a whole lock duration past the
/// expiry, still sending, and ended `report_failed`); no call about either attempt reaches the
/// engine after it answers again; and the worker fetches again then, from free slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_answers_loses_leases_at_local_expiry_and_fetching_resumes() {
    let emu = start_emulator().await;
    let proxy = TcpProxy::start(emu.addr()).await;
    let lock = Duration::from_secs(3);
    let gate = Arc::new(Semaphore::new(0));
    let mut opts = WorkerOptions::new("w-silent", lock)
        .max_tasks(2)
        .handler(CompletingHandler::new("w-silent", Duration::from_millis(1)).gated(gate.clone()));
    opts.engine_url = Some(format!("http://{}/api", proxy.addr));
    opts.request_timeout = Duration::from_millis(400);
    let held = emu.create_task(spec_sleeping(600_000));
    let reporting = emu.create_task(spec_sleeping(0));
    let w = spawn_worker(&emu, opts);
    for id in [&held, &reporting] {
        w.wait_event(|e| matches!(e, RunnerEvent::TaskStarted { task_id, .. } if task_id == id))
            .await;
    }

    proxy.set(Mode::Silent);
    gate.add_permits(1);
    assert_eq!(w.wait_ended(&reporting, 1).await, TaskEnd::LeaseLost);
    assert_eq!(w.wait_ended(&held, 1).await, TaskEnd::LeaseLost);

    // The engine answers again: its leases of attempt 1 have run out there too.
    let fresh = emu.create_task(spec_sleeping(0));
    gate.add_permits(10);
    emu.advance(lock);
    let answering_again = emu.now();
    proxy.set(Mode::Forward);
    wait_completed(&emu, &fresh).await;
    wait_completed(&emu, &reporting).await;
    w.stop().await;

    let calls = emu.calls();
    let late: Vec<_> = calls
        .iter()
        .filter(|c| {
            c.attempt == Some(1)
                && (c.task_id.as_deref() == Some(held.as_str())
                    || c.task_id.as_deref() == Some(reporting.as_str()))
                && c.at >= answering_again
        })
        .collect();
    assert!(late.is_empty(), "calls about lost attempts: {late:?}");
    check_lease_discipline(&calls);
}
