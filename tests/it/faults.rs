//! The fault-injection suite: one scenario per fault group of the engine, the model
//! providers and the tool servers. Each runs a handful of refund tasks through in-process workers
//! (the real runner, agent runtime and HTTP clients) or the real binary against the devkit stack
//! with the fault on, checks the expected outcome, and then runs the one invariant checker
//! (`support::invariants`). The table of faults and what the worker does is in `docs/FAULTS.md`.

use std::collections::HashSet;
use std::time::Duration;

use abada_agent_worker::agent::AgentSettings;
use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::devkit::engine::{
    BadBody, Disposition, Fault, Operation, ProtocolLevel, TaskSpec, TaskStatus, TaskView,
};
use abada_agent_worker::devkit::model::{Fault as ModelFault, FaultTimes, Script, Turn};
use abada_agent_worker::devkit::stack::{
    Stack, StackWorkers, WorkerHandle, WorkerOptions, refund_script,
};
use abada_agent_worker::handler::TaskEnd;
use abada_agent_worker::runner::RunnerEvent;
use serde_json::{Map, Value, json};

use crate::support::invariants::{
    Expect, Recorder, Report, WorkerObservation, check_invariants, peak_memory_kib,
};
use crate::support::process::{WorkerProcess, stack_env};
use crate::support::wait::eventually;

/// A hang guard for each wait (not a timing assertion): long, since megabyte tool results in a
/// debug build on a loaded 2-core machine take seconds.
const LIMIT: Duration = Duration::from_secs(60);

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    crate::support::emulator_worker::within_for(LIMIT, what, fut).await
}

pub(crate) async fn stack() -> Stack {
    Stack::start(ProtocolLevel::AgentV1)
        .await
        .expect("the devkit stack starts")
}

/// Fast retries and short tool timeouts, so a scenario's faults play out in seconds.
/// The suite's agent settings: tool bounds well above what a loaded machine takes to answer, so
/// only the scenarios that make a tool server slow on purpose (with their own short bound) see
/// a timeout.
pub(crate) fn settings() -> AgentSettings {
    let mut s = Stack::fast_agent_settings();
    s.tool_sessions.call_timeout = Duration::from_secs(5);
    s.tool_sessions.open_timeout = Duration::from_secs(5);
    s
}

/// The scenarios' lock duration where no lease has to run out: generous, so a starved debug
/// process on a loaded machine never loses a healthy lease (a heartbeat may be 17 s late, 0.567
/// of the lock: src/heartbeat.rs). Heartbeats come every 10 s, so the short tasks here rarely
/// send one: the heartbeat faults injected below are met on the seeds of `sim.rs` and timed on
/// the paused clock in `paused_agent.rs`, not here.
const LOCK: Duration = Duration::from_secs(30);

/// The lock of the scenarios whose subject is a lease lost (a refused heartbeat): short, so a
/// heartbeat meets the running task; their logic is held on the paused clock
/// (`paused_agent::a_lost_lease_stops_the_agent_task_reports_nothing_and_closes_its_sessions`).
const LEASE_SUBJECT_LOCK: Duration = Duration::from_secs(5);

/// `n` refund tasks on `model` (a `provider/model`), orders `<prefix>-<i>`.
fn refund_tasks(
    stack: &Stack,
    prefix: &str,
    n: usize,
    model: &str,
    fallbacks: &[&str],
) -> Vec<String> {
    let agent = stack.refund_agent(model, fallbacks);
    stack.engine.create_tasks((0..n).map(|i| {
        let mut variables = Map::new();
        variables.insert("orderId".into(), json!(format!("{prefix}-{i}")));
        TaskSpec {
            variables,
            agent: Some(agent.clone()),
            retries: Some(3),
            ..TaskSpec::default()
        }
    }))
}

/// A worker with its recorder.
pub(crate) fn worker(
    stack: &Stack,
    id: &str,
    slots: u32,
    lock: Duration,
    agent: AgentSettings,
) -> (WorkerHandle, Recorder) {
    let mut opts = WorkerOptions::new(id, slots);
    opts.lock_duration = lock;
    opts.poll_interval = Duration::from_millis(100);
    let mut handle = stack.spawn_worker(opts, agent);
    let recorder = Recorder::attach(&stack.engine, &mut handle, slots);
    (handle, recorder)
}

/// Waits until every task satisfies `done`.
pub(crate) async fn wait_tasks(
    stack: &Stack,
    ids: &[String],
    what: &str,
    done: impl Fn(&TaskView) -> bool,
) -> Vec<TaskView> {
    within(what, async {
        stack
            .engine
            .wait_for(|e| {
                let views: Vec<TaskView> = ids.iter().filter_map(|id| e.task(id)).collect();
                (views.len() == ids.len() && views.iter().all(&done)).then_some(views)
            })
            .await
    })
    .await
}

async fn wait_completed(stack: &Stack, ids: &[String]) -> Vec<TaskView> {
    wait_tasks(stack, ids, "every task to complete", |t| {
        t.status == TaskStatus::Completed
    })
    .await
}

/// Stops the workers (staged), then checks every invariant and fails the test on a violation.
pub(crate) async fn finish(
    stack: &Stack,
    workers: Vec<(WorkerHandle, Recorder)>,
    expect: Expect,
    scenario: &str,
) -> Report {
    let mut observations = Vec::new();
    for (handle, mut recorder) in workers {
        handle.stop().await;
        recorder.drained().await;
        observations.push(recorder.observation());
    }
    let report = check_invariants(&stack.engine, &[&stack.tools], &observations, &expect).await;
    report.assert_ok(scenario);
    stack.shutdown().await;
    report
}

fn executed(stack: &Stack, op: Operation, task: &str) -> usize {
    stack
        .engine
        .calls()
        .iter()
        .filter(|c| {
            c.operation == op
                && c.task_id.as_deref() == Some(task)
                && c.disposition == Disposition::Executed
        })
        .count()
}

fn injected(stack: &Stack, op: Operation) -> usize {
    stack
        .engine
        .calls()
        .iter()
        .filter(|c| c.operation == op && c.disposition == Disposition::Injected)
        .count()
}

// ---- engine faults ---------------------------------------------------------------------------

/// Over HTTP, the emulator's latency faults; the lease logic under them is timed exactly on the
/// paused clock by `paused_agent::engine_latency_spikes_keep_every_lease_and_complete_every_task`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_latency_spikes_keep_every_lease_and_complete_every_task() {
    let s = stack().await;
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(300)),
    );
    for (op, ms) in [
        (Operation::Heartbeat, 600),
        (Operation::FetchAndLock, 300),
        (Operation::JournalAppend, 100),
        (Operation::Complete, 400),
    ] {
        s.engine.inject(Fault::Latency {
            operation: op,
            delay_ms: ms,
        });
    }
    let ids = refund_tasks(&s, "lat", 4, "openai/slowish", &[]);
    // A heartbeat every 1.7 s that itself takes 0.6 s.
    let w = worker(&s, "w-lat", 4, LOCK, settings());
    wait_completed(&s, &ids).await;
    for id in &ids {
        assert_eq!(executed(&s, Operation::Complete, id), 1);
    }
    finish(&s, vec![w], Expect::default(), "engine latency").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_5xx_on_every_operation_are_retried_with_the_same_key() {
    let s = stack().await;
    for (op, status) in [
        (Operation::FetchAndLock, 500),
        (Operation::Heartbeat, 502),
        (Operation::JournalRead, 504),
        (Operation::JournalAppend, 500),
        (Operation::ToolCredentials, 502),
        (Operation::Complete, 500),
    ] {
        s.engine.inject(Fault::ServerError {
            operation: op,
            count: 2,
            status: Some(status),
        });
    }
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(200)),
    );
    let ids = refund_tasks(&s, "5xx", 3, "openai/slowish", &[]);
    let w = worker(&s, "w-5xx", 4, LOCK, settings());
    let views = wait_completed(&s, &ids).await;
    assert!(
        views.iter().all(|t| t.attempt == 1),
        "no task needed a second attempt"
    );
    assert!(injected(&s, Operation::Complete) >= 2, "the fault was met");
    // The same key: each command refused with an injected 5xx is sent again, by the same
    // worker about the same task and attempt, under the very Idempotency-Key it first carried.
    let calls = s.engine.calls();
    let mut compared = 0;
    // (A fetch refused with a 5xx locked nothing: the poll loop's next fetch is a new request.)
    for op in [Operation::JournalAppend, Operation::Complete] {
        for (i, first) in calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.operation == op && c.disposition == Disposition::Injected)
        {
            let key = first
                .idempotency_key
                .as_deref()
                .unwrap_or_else(|| panic!("{op:?} sent without an Idempotency-Key"));
            let again = calls[i + 1..]
                .iter()
                .find(|c| {
                    c.operation == op
                        && c.worker_id == first.worker_id
                        && c.task_id == first.task_id
                        && c.attempt == first.attempt
                })
                .unwrap_or_else(|| panic!("{op:?} refused with a 5xx was never sent again"));
            assert_eq!(
                again.idempotency_key.as_deref(),
                Some(key),
                "{op:?} about {:?} re-sent under another key",
                first.task_id
            );
            compared += 1;
        }
    }
    assert!(
        compared >= 4,
        "two refusals each of two commands: {compared}"
    );
    finish(&s, vec![w], Expect::default(), "engine 5xx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_resets_before_the_command_runs_are_retried() {
    let s = stack().await;
    for op in [
        Operation::FetchAndLock,
        Operation::Heartbeat,
        Operation::JournalRead,
        Operation::JournalAppend,
        Operation::ToolCredentials,
        Operation::Complete,
    ] {
        s.engine.inject(Fault::ResetConnection {
            operation: op,
            count: 2,
        });
    }
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(200)),
    );
    let ids = refund_tasks(&s, "rst", 3, "openai/slowish", &[]);
    let w = worker(&s, "w-rst", 4, LOCK, settings());
    let views = wait_completed(&s, &ids).await;
    assert!(views.iter().all(|t| t.attempt == 1));
    assert_eq!(injected(&s, Operation::Complete), 2, "both resets met");
    finish(&s, vec![w], Expect::default(), "connection resets").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_dropped_after_the_command_committed_are_replayed_not_redone() {
    let s = stack().await;
    for op in [
        Operation::FetchAndLock,
        Operation::Heartbeat,
        Operation::JournalAppend,
        Operation::Complete,
        Operation::Failure,
    ] {
        s.engine.inject(Fault::DropResponse {
            operation: op,
            count: 1,
        });
    }
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(500)),
    );
    // A model that fails the first attempt's call and its two retries: that task ends in a
    // technical failure (its own: the model serves it alone), whose answer is dropped. Only that
    // attempt: a failure consumes a retry now, and three would be an incident.
    s.model.set_script("broken", refund_script());
    s.model
        .inject_fault("broken", ModelFault::ServerError, FaultTimes::Next(3));
    let ids = refund_tasks(&s, "drop", 3, "openai/slowish", &[]);
    let failing = refund_tasks(&s, "dropf", 1, "openai/broken", &[]);
    let w = worker(&s, "w-drop", 4, LOCK, settings());
    wait_completed(&s, &ids).await;
    let failed = &failing[0];
    within("the failing task's failure", async {
        s.engine
            .wait_for(|e| e.task(failed).filter(|t| t.counters.failures >= 1))
            .await
    })
    .await;
    // The model recovers: the next attempt completes.
    s.model.clear_faults("broken");
    let view = wait_completed(&s, &failing).await.remove(0);
    for id in ids.iter().chain(&failing) {
        assert_eq!(executed(&s, Operation::Complete, id), 1, "task {id}");
    }
    // Attempt 1's failure ran once; its retry (same key) was answered from storage.
    let first: Vec<_> = s
        .engine
        .calls()
        .into_iter()
        .filter(|c| {
            c.operation == Operation::Failure
                && c.task_id.as_deref() == Some(failed.as_str())
                && c.attempt == Some(1)
        })
        .collect();
    let count = |d: Disposition| first.iter().filter(|c| c.disposition == d).count();
    assert_eq!(count(Disposition::Executed), 1, "{first:?}");
    assert!(first[0].response_dropped);
    assert_eq!(count(Disposition::Replayed), 1, "{first:?}");
    assert_eq!(
        view.retries,
        Some(2),
        "one task's model failing while others are served: its own failure, one retry consumed \
         (never a deferral)"
    );
    let dropped: HashSet<Operation> = s
        .engine
        .calls()
        .iter()
        .filter(|c| c.response_dropped)
        .map(|c| c.operation)
        .collect();
    for op in [
        Operation::FetchAndLock,
        Operation::Complete,
        Operation::Failure,
    ] {
        assert!(dropped.contains(&op), "{op:?} answer dropped");
    }
    finish(&s, vec![w], Expect::default(), "dropped responses").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_429_with_retry_after_is_honoured() {
    let s = stack().await;
    s.engine.inject(Fault::Throttle {
        operation: Operation::FetchAndLock,
        count: 2,
        retry_after_secs: Some(1),
    });
    s.engine.inject(Fault::Throttle {
        operation: Operation::Complete,
        count: 1,
        retry_after_secs: Some(1),
    });
    s.engine.inject(Fault::Throttle {
        operation: Operation::JournalAppend,
        count: 1,
        retry_after_secs: None,
    });
    let ids = refund_tasks(&s, "thr", 3, "openai/refund", &[]);
    // A command backoff cap (30 s) far above the Retry-After: the client waits min(Retry-After,
    // cap), so a wait of the cap is told from the header's by a wide margin.
    let mut opts = WorkerOptions::new("w-thr", 4);
    opts.lock_duration = LOCK;
    opts.poll_interval = Duration::from_millis(100);
    opts.tuning.command_backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(30));
    let mut handle = s.spawn_worker(opts, settings());
    let recorder = Recorder::attach(&s.engine, &mut handle, 4);
    let w = (handle, recorder);
    wait_completed(&s, &ids).await;
    let throttled =
        w.1.events()
            .iter()
            .filter(|e| matches!(e, RunnerEvent::FetchFailed { error } if error.contains("429")))
            .count();
    assert_eq!(throttled, 2, "two throttled fetches, then work");
    assert_eq!(injected(&s, Operation::Complete), 1);
    // The throttled complete is sent again no sooner than its Retry-After (1 s), timed on the
    // emulator's clock between the 429 and the next complete of the same task (both stamped on
    // arrival; load only makes it later), and far under the cap (30 s): a hang guard, not a
    // margin. The exact wait (1 s to the millisecond, the same key, the cap) is timed on the
    // paused clock by `paused_engine_client::a_throttled_complete_is_sent_again_exactly_when_its_retry_after_says`.
    let calls = s.engine.calls();
    let throttled = calls
        .iter()
        .find(|c| c.operation == Operation::Complete && c.disposition == Disposition::Injected)
        .expect("a throttled complete");
    let next = calls
        .iter()
        .filter(|c| {
            c.operation == Operation::Complete
                && c.task_id == throttled.task_id
                && c.at > throttled.at
        })
        .map(|c| c.at)
        .min()
        .expect("the complete was sent again");
    let waited = (next - throttled.at).to_std().unwrap_or_default();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(15),
        "complete re-sent {waited:?} after a 429 with Retry-After: 1"
    );
    finish(&s, vec![w], Expect::default(), "429 with Retry-After").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_are_not_json_or_not_the_right_json_are_refused_not_trusted() {
    let s = stack().await;
    s.engine.inject(Fault::BadBody {
        operation: Operation::FetchAndLock,
        count: 2,
        body: BadBody::NotJson,
    });
    s.engine.inject(Fault::BadBody {
        operation: Operation::JournalRead,
        count: 1,
        body: BadBody::WrongJson,
    });
    s.engine.inject(Fault::BadBody {
        operation: Operation::ToolCredentials,
        count: 1,
        body: BadBody::WrongJson,
    });
    s.engine.inject(Fault::BadBody {
        operation: Operation::Heartbeat,
        count: 2,
        body: BadBody::NotJson,
    });
    let ids = refund_tasks(&s, "bad", 3, "openai/refund", &[]);
    let w = worker(&s, "w-bad", 4, LOCK, settings());
    let views = wait_completed(&s, &ids).await;
    let malformed =
        w.1.events()
            .iter()
            .filter(|e| matches!(e, RunnerEvent::FetchFailed { .. }))
            .count();
    assert!(malformed >= 2, "the two bad fetch bodies were refused");
    // The task that met the wrong journal body was failed technically (one retry), then resumed.
    let failures: u32 = views.iter().map(|t| t.counters.failures).sum();
    assert!(
        failures >= 1,
        "a bad journal body is a technical failure, not an empty journal"
    );
    assert!(views.iter().all(|t| t.retries.unwrap_or(0) >= 1));
    finish(&s, vec![w], Expect::default(), "bad bodies").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_without_the_protocol_header_is_not_processed() {
    let s = stack().await;
    s.engine.inject(Fault::OmitProtocolHeader { count: 1 });
    let ids = refund_tasks(&s, "hdr", 2, "openai/refund", &[]);
    let w = worker(&s, "w-hdr", 4, LOCK, settings());
    within("the refused fetch", w.1.wait_until(|ev| {
        ev.iter().any(|e| matches!(e, RunnerEvent::FetchFailed { error } if error.to_lowercase().contains("protocol")))
    }))
    .await;
    // The engine locked them for us, the worker did not take them: they wait out their lease.
    let stranded: Vec<String> = s
        .engine
        .calls()
        .iter()
        .find(|c| c.operation == Operation::FetchAndLock && !c.task_ids.is_empty())
        .map(|c| c.task_ids.clone())
        .unwrap_or_default();
    assert_eq!(stranded.len(), 2);
    s.engine.advance(LOCK + Duration::from_secs(1));
    let views = wait_completed(&s, &ids).await;
    assert!(
        views.iter().all(|t| t.attempt == 2),
        "taken again after the lease expired"
    );
    finish(
        &s,
        vec![w],
        Expect::lease_loss(stranded),
        "missing protocol header",
    )
    .await;
}

/// Item 3 over real HTTP: a short outage is ridden out (not ready, leases kept by retried
/// heartbeats); a longer one than the lease fences the running task (lease_lost, no report);
/// afterwards the worker is ready and fetching again, and the task resumes on a new attempt.
/// What stays here is the wire (refused connections, readiness, the client riding an outage
/// out); the timing logic is held exactly on the paused clock by
/// `paused_agent::a_short_engine_outage_is_ridden_out_and_every_lease_is_kept` and
/// `paused_agent::a_long_engine_outage_fences_the_task_at_its_local_expiry_and_it_resumes`
/// (lost at the local expiry to the millisecond); the 12 s below is a hang guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_outage_keeps_leases_while_it_can_fences_when_it_cannot_and_resumes() {
    let s = stack().await;
    // Model calls outlast the outages, so the tasks wait on the model, not on the engine,
    // while it is away; only heartbeats (and fetches) meet the outage.
    s.model.set_script(
        "slow",
        refund_script().with_latency(Duration::from_millis(2000)),
    );
    s.model.set_script(
        "slower",
        refund_script().with_latency(Duration::from_millis(4000)),
    );
    let lock = Duration::from_secs(3);
    let w = worker(&s, "w-out", 4, lock, settings());
    let recorder = &w.1;

    // Part 1: an outage shorter than the lease, during the first model call. It ends as soon
    // as a heartbeat has met it and the worker has noticed, so the lease keeps its whole margin
    // (a fixed outage length raced the heartbeat grid on a loaded machine).
    let short = refund_tasks(&s, "out1", 2, "openai/slow", &[]);
    within("both tasks' first step", async {
        s.engine
            .wait_for(|e| {
                short
                    .iter()
                    .all(|id| e.task(id).is_some_and(|t| t.counters.journal_appends >= 1))
                    .then_some(())
            })
            .await
    })
    .await;
    s.engine.set_outage(true);
    within(
        "a heartbeat to meet the outage and the worker to notice it",
        async {
            while recorder.status.is_ready()
                || !s
                    .engine
                    .calls()
                    .iter()
                    .any(|c| c.operation == Operation::Heartbeat && c.response_dropped)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        },
    )
    .await;
    s.engine.set_outage(false);
    let views = wait_completed(&s, &short).await;
    assert!(
        views.iter().all(|t| t.attempt == 1),
        "leases kept through a short outage"
    );
    within("ready again", async {
        while !recorder.status.is_ready() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // Part 2: an outage longer than the lease while a task runs.
    let long = refund_tasks(&s, "out2", 1, "openai/slower", &[]);
    let id = long[0].clone();
    within("the long task's first step", async {
        s.engine
            .wait_for(|e| e.task(&id).filter(|t| t.counters.journal_appends >= 1))
            .await
    })
    .await;
    s.engine.set_outage(true);
    let lost = {
        let id = id.clone();
        within("the task to fence itself", recorder.wait_until(move |ev| {
            ev.iter().any(|e| matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::LeaseLost, .. } if *task_id == id))
        }))
    };
    if tokio::time::timeout(Duration::from_secs(12), lost)
        .await
        .is_err()
    {
        panic!(
            "the task did not fence itself; events: {:#?}\ncalls: {:#?}",
            recorder.events(),
            s.engine
                .calls()
                .iter()
                .filter(|c| c.task_id.as_deref() == Some(id.as_str()))
                .map(|c| (c.operation, c.status, c.response_dropped, c.at))
                .collect::<Vec<_>>()
        );
    }
    assert!(!recorder.status.is_ready(), "not ready during the outage");
    // Past the engine's own lease too, so the task can be taken again.
    eventually(LIMIT, "the engine's lease to run out", async || {
        s.engine
            .task(&id)
            .and_then(|t| t.lock_expiration_time)
            .is_none_or(|expires| expires <= s.engine.now())
    })
    .await;
    let fetched_before = recorder
        .events()
        .iter()
        .filter(|e| matches!(e, RunnerEvent::Fetched { .. }))
        .count();
    // The model speeds up for the resumed attempt.
    s.model.set_script("slower", refund_script());
    s.engine.set_outage(false);
    within(
        "ready and fetching again",
        recorder.wait_until(|ev| {
            ev.iter()
                .filter(|e| matches!(e, RunnerEvent::Fetched { .. }))
                .count()
                > fetched_before
        }),
    )
    .await;
    let views = wait_completed(&s, &long).await;
    assert_eq!(views[0].attempt, 2, "resumed on a new attempt");
    assert!(recorder.status.is_ready());
    for op in [Operation::Complete, Operation::Failure] {
        assert!(
            !s.engine.calls().iter().any(|c| c.operation == op
                && c.task_id.as_deref() == Some(id.as_str())
                && c.attempt == Some(1)),
            "the fenced attempt reported nothing ({op:?})"
        );
    }
    finish(&s, vec![w], Expect::lease_loss([id]), "engine outage").await;
}

/// A heartbeat refused as the engine refuses one whose lease another worker took over
/// (`WORKER_LOCK_NOT_OWNED`): the task ends `lease_lost` and nothing about that attempt is
/// reported, while the tasks beside it complete; once the refusals stop and the lease runs out,
/// the task runs again and completes. The invariant checker holds the rest: no ending call
/// after the refusal (invariant 5, which no longer exempts a refusal whose attempt commits an
/// ending afterwards), one outcome per task, no keyed write re-sent without the interruption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_heartbeat_ends_its_task_lease_lost_and_nothing_reports_it() {
    let s = stack().await;
    // Three model turns of 1 s each: a heartbeat (every third of the 5 s lease) comes while the
    // first or second is in flight.
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(1000)),
    );
    let ids = refund_tasks(&s, "hbr", 3, "openai/slowish", &[]);
    let refused = ids[0].clone();
    s.engine.inject(Fault::RefuseHeartbeats {
        task_id: refused.clone(),
    });
    let w = worker(&s, "w-hbr", 4, LEASE_SUBJECT_LOCK, settings());
    within("the refused task to end lease_lost", async {
        w.1.wait_until(|events| {
            events.iter().any(|e| {
                matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::LeaseLost, .. }
                    if *task_id == refused)
            })
        })
        .await
    })
    .await;
    let refusal = s
        .engine
        .calls()
        .into_iter()
        .find(|c| {
            c.task_id.as_deref() == Some(refused.as_str())
                && c.operation == Operation::Heartbeat
                && c.disposition == Disposition::Injected
        })
        .expect("the heartbeat was refused");
    assert_eq!(refusal.error_code.as_deref(), Some("WORKER_LOCK_NOT_OWNED"));
    s.engine.clear_faults();
    let views = wait_completed(&s, &ids).await;
    for v in &views {
        assert_eq!(v.counters.completes, 1, "task {}", v.id);
    }
    assert_eq!(
        views[0].attempt, 2,
        "the refused attempt reported nothing; the next one completed"
    );
    for c in
        s.engine.calls().iter().filter(|c| {
            c.task_id.as_deref() == Some(refused.as_str()) && c.attempt == refusal.attempt
        })
    {
        assert!(
            c.at <= refusal.at
                || !matches!(
                    c.operation,
                    Operation::Complete | Operation::Failure | Operation::BpmnError
                ),
            "the refused attempt reported {:?} after the refusal",
            c.operation
        );
    }
    finish(
        &s,
        vec![w],
        Expect::lease_loss([refused]),
        "refused heartbeats",
    )
    .await;
}

// ---- provider faults -------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_429_and_529_fall_back_and_every_model_unavailable_defers() {
    let s = stack().await;
    for name in ["rl", "ovl", "down1", "down2"] {
        s.model.set_script(name, refund_script());
    }
    s.model.inject_fault(
        "rl",
        ModelFault::RateLimited {
            retry_after: Some(Duration::from_secs(1)),
        },
        FaultTimes::Always,
    );
    s.model
        .inject_fault("ovl", ModelFault::Overloaded, FaultTimes::Always);
    for name in ["down1", "down2"] {
        s.model
            .inject_fault(name, ModelFault::ServiceUnavailable, FaultTimes::Always);
    }
    let rl = refund_tasks(&s, "rl", 2, "openai/rl", &["anthropic/refund"]);
    let ovl = refund_tasks(&s, "ovl", 2, "anthropic/ovl", &["openai/refund"]);
    let down = refund_tasks(&s, "down", 1, "openai/down1", &["anthropic/down2"]);
    let w = worker(&s, "w-prov", 4, LOCK, settings());
    let mut both = rl.clone();
    both.extend(ovl.iter().cloned());
    let views = wait_completed(&s, &both).await;
    assert!(
        views.iter().all(|t| t.counters.failures == 0),
        "fell back at once"
    );
    let deferred = wait_tasks(&s, &down, "the deferral", |t| t.counters.failures >= 1).await;
    assert_eq!(deferred[0].retries, Some(3), "a deferral keeps the retries");
    // The models come back: the deferred task completes on its next attempt.
    s.model.clear_faults("down1");
    wait_completed(&s, &down).await;
    finish(&s, vec![w], Expect::default(), "provider 429/529/503").await;
}

/// The deferrals a worker reported, by task.
fn deferrals(recorder: &Recorder, task: &str) -> usize {
    recorder
        .events()
        .iter()
        .filter(|e| {
            matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::Deferred, .. }
                if task_id == task)
        })
        .count()
}

/// The attacker's test: one request that the model answers with a 500 every
/// time (llama.cpp did, for a conversation past its context), beside tasks the same model
/// answers. It consumes its retries and ends in an incident, never deferred; the others complete.
/// On the old worker it was deferred "without consuming a retry" again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_request_beside_healthy_ones_consumes_its_retries_and_is_never_deferred() {
    let s = stack().await;
    s.model.set_script("shared", refund_script());
    s.model.inject_request_fault(
        "shared",
        "poison-0",
        ModelFault::ServerError,
        FaultTimes::Always,
    );
    let healthy = refund_tasks(&s, "healthy", 4, "openai/shared", &[]);
    let poison = refund_tasks(&s, "poison", 1, "openai/shared", &[]);
    let (w, recorder) = worker(&s, "w-poison", 4, LOCK, settings());
    wait_completed(&s, &healthy).await;
    let failed = wait_tasks(&s, &poison, "the poison task's incident", |t| {
        t.status == TaskStatus::Failed
    })
    .await;
    assert_eq!(failed[0].retries, Some(0));
    assert_eq!(
        failed[0].counters.failures, 3,
        "3, 2, 1, then the incident: one retry consumed per attempt"
    );
    assert!(
        failed[0]
            .error_message
            .as_deref()
            .is_some_and(|m| m.contains("HTTP 500")),
        "{:?}",
        failed[0].error_message
    );
    assert_eq!(deferrals(&recorder, &poison[0]), 0, "never deferred");
    for id in &healthy {
        assert_eq!(deferrals(&recorder, id), 0, "{id}");
    }
    finish(&s, vec![(w, recorder)], Expect::default(), "poison request").await;
}

/// The other side of that: a model that fails every task (an outage answering 500)
/// is down for everyone once distinct tasks failed in a row: the tasks are deferred with their
/// retries kept (at most the first ones, before the circuit knew, consumed one), and all
/// complete once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_failing_every_task_defers_them_with_their_retries_until_it_is_back() {
    let s = stack().await;
    s.model.set_script("out500", refund_script());
    s.model
        .inject_fault("out500", ModelFault::ServerError, FaultTimes::Always);
    let ids = refund_tasks(&s, "out", 4, "openai/out500", &[]);
    let (w, recorder) = worker(&s, "w-out500", 4, LOCK, settings());
    within(
        "two deferrals of every task",
        recorder.wait_until(|ev| {
            ids.iter().all(|id| {
                ev.iter()
                    .filter(|e| matches!(e, RunnerEvent::TaskEnded { task_id, outcome: TaskEnd::Deferred, .. } if task_id == id))
                    .count()
                    >= 2
            })
        }),
    )
    .await;
    for view in ids.iter().filter_map(|id| s.engine.task(id)) {
        assert!(
            view.retries >= Some(2),
            "task {}: at most one retry consumed before the circuit opened ({:?})",
            view.id,
            view.retries
        );
    }
    let opened = w
        .metrics
        .encode()
        .lines()
        .find(|l| {
            // The engine's definition names the model; no operator's file does: `other`.
            l.starts_with("abada_agent_model_circuit_opened_total{")
                && l.contains("model=\"other\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(
        opened >= Some(1.0),
        "the circuit's opening is counted: {opened:?}"
    );
    s.model.clear_faults("out500");
    let views = wait_completed(&s, &ids).await;
    assert!(views.iter().all(|v| v.retries >= Some(2)), "{views:?}");
    finish(
        &s,
        vec![(w, recorder)],
        Expect::default(),
        "model down for everyone",
    )
    .await;
}

/// A conversation past the model's context, in each wire format's own words
/// (llama.cpp's is a 500), ends the task at once as an incident that says so: not retried,
/// not deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_overflow_in_every_wire_format_is_an_incident_without_retry_or_deferral() {
    let s = stack().await;
    let cases = [
        ("ctxo", "openai/ctxo", ModelFault::ContextExceeded),
        ("ctxa", "anthropic/ctxa", ModelFault::ContextExceeded),
        ("ctxl", "openai/ctxl", ModelFault::LlamaCppContextExceeded),
        (
            "ctxla",
            "anthropic/ctxla",
            ModelFault::LlamaCppContextExceeded,
        ),
    ];
    let mut ids = Vec::new();
    for (name, model, fault) in &cases {
        s.model.set_script(*name, refund_script());
        s.model
            .inject_fault(*name, fault.clone(), FaultTimes::Always);
        ids.extend(refund_tasks(&s, name, 1, model, &[]));
    }
    let (w, recorder) = worker(&s, "w-ctx", 4, LOCK, settings());
    let views = wait_tasks(&s, &ids, "the incidents", |t| {
        t.status == TaskStatus::Failed
    })
    .await;
    for ((name, ..), view) in cases.iter().zip(&views) {
        assert_eq!(view.retries, Some(0), "{name}: an incident");
        assert_eq!(view.counters.failures, 1, "{name}: reported once");
        assert_eq!(s.model.calls(name), 1, "{name}: never retried");
        assert_eq!(deferrals(&recorder, &view.id), 0, "{name}: never deferred");
        let message = view.error_message.as_deref().unwrap_or_default();
        assert!(
            message.contains("too long for the model's context"),
            "{name}: {message}"
        );
    }
    finish(
        &s,
        vec![(w, recorder)],
        Expect::default(),
        "context overflow",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_500_timeouts_and_broken_bodies_are_retried_then_technical() {
    let s = stack().await;
    s.set_provider_request_timeout(Duration::from_millis(800));
    for name in ["e500", "hang", "trunc", "malf", "always"] {
        s.model.set_script(name, refund_script());
    }
    s.model
        .inject_fault("e500", ModelFault::ServerError, FaultTimes::Next(2));
    s.model.inject_fault(
        "hang",
        ModelFault::Hang(Duration::from_secs(3)),
        FaultTimes::Next(1),
    );
    s.model
        .inject_fault("trunc", ModelFault::TruncatedBody, FaultTimes::Next(1));
    s.model
        .inject_fault("malf", ModelFault::MalformedBody, FaultTimes::Next(1));
    s.model
        .inject_fault("always", ModelFault::MalformedBody, FaultTimes::Always);
    let mut ids = Vec::new();
    for name in ["e500", "hang", "trunc", "malf"] {
        ids.extend(refund_tasks(&s, name, 1, &format!("openai/{name}"), &[]));
    }
    let broken = refund_tasks(&s, "always", 1, "anthropic/always", &[]);
    let w = worker(&s, "w-prov2", 6, LOCK, settings());
    let views = wait_completed(&s, &ids).await;
    assert!(
        views.iter().all(|t| t.attempt == 1),
        "retried within the attempt"
    );
    // Technical failures consume one retry each (3, 2, 1), then the task is an incident.
    let failed = wait_tasks(&s, &broken, "the incident", |t| {
        t.status == TaskStatus::Failed
    })
    .await;
    assert_eq!(failed[0].counters.failures, 3);
    assert_eq!(failed[0].retries, Some(0));
    assert!(
        failed[0]
            .error_message
            .as_deref()
            .is_some_and(|m| m.contains("malformed")),
        "{:?}",
        failed[0].error_message
    );
    // The model is fixed and an operator retries the incident: it completes.
    s.model.clear_faults("always");
    assert!(s.engine.set_retries(&broken[0], 1));
    wait_completed(&s, &broken).await;
    finish(
        &s,
        vec![w],
        Expect::default(),
        "provider 500/timeouts/bad bodies",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_with_unparsable_arguments_or_an_unknown_tool_are_answered_as_errors() {
    let s = stack().await;
    // A string where an object belongs is what an unparsable arguments string decodes to.
    s.model.set_script(
        "sloppy",
        Script::new(vec![
            Turn::call("lookup_order", json!("{\"orderId\": ")),
            Turn::call("no_such_tool", json!({"orderId": "${input}"})),
            Turn::call(
                "issue_refund",
                json!({"orderId": "${input}", "amountCents": 1500, "reason": "damaged"}),
            ),
            Turn::text(r#"{"decision": "refunded", "orderId": "${input}"}"#),
        ]),
    );
    let ids = refund_tasks(&s, "sloppy", 2, "openai/sloppy", &[]);
    let anth = refund_tasks(&s, "sloppya", 1, "anthropic/sloppy", &[]);
    let w = worker(&s, "w-sloppy", 4, LOCK, settings());
    let mut all = ids.clone();
    all.extend(anth);
    let views = wait_completed(&s, &all).await;
    for t in &views {
        let errors = t
            .journal
            .iter()
            .filter(|step| step.pointer("/data/result/isError") == Some(&Value::Bool(true)))
            .count();
        assert!(
            errors >= 2,
            "task {}: both bad calls answered as errors",
            t.id
        );
    }
    let counters = s.tools.counters().await;
    assert!(
        !counters.calls_per_tool.contains_key("no_such_tool"),
        "never sent"
    );
    finish(&s, vec![w], Expect::default(), "bad tool calls").await;
}

// ---- tool server faults ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_server_down_or_slow_past_its_timeout_fails_technically_then_resumes() {
    let s = stack().await;
    s.tools.set_down(true);
    let down = refund_tasks(&s, "tdown", 2, "openai/refund", &[]);
    // A 10 s technical retry (the emulator's clock is moved past it): no task can fail twice
    // before the other has failed once.
    let retry = Duration::from_secs(10);
    let mut agent = settings();
    // The call timeout is rmcp's, on the wire. The retry logic under it (the same key,
    // tool_attempts sends, the resume) is held exactly on the paused clock by
    // `paused_agent::a_keyed_write_answered_after_its_timeout_is_resent_under_its_key_then_resumed`.
    agent.tool_sessions.call_timeout = Duration::from_millis(500);
    agent.technical_retry = Backoff::new(retry, retry).without_jitter();
    let tries = agent.tool_attempts;
    let w = worker(&s, "w-tools", 4, LOCK, agent);
    let views = wait_tasks(&s, &down, "technical failures", |t| {
        t.counters.failures >= 1
    })
    .await;
    assert!(
        views.iter().all(|t| t.retries == Some(2)),
        "one retry consumed"
    );
    s.tools.set_down(false);
    s.engine.advance(retry + Duration::from_secs(1));
    wait_completed(&s, &down).await;

    // The keyed write slow past the call timeout (500 ms): `issue_refund` is applied at once but
    // answered 1.5 s later, after the worker gave up on it (the lookup before it stays prompt,
    // so the write is what times out). The attempt re-sends it under its key `tool_attempts`
    // times in all, then fails technically; the resume sends it once more under the same key,
    // and the server answers every re-send from storage without applying it again.
    let before = s.tools.counters().await;
    let sent_before = s.tools.calls().len();
    s.tools
        .set_answer_latency("issue_refund", Duration::from_millis(1500));
    let slow = refund_tasks(&s, "tslow", 2, "openai/refund", &[]);
    wait_tasks(&s, &slow, "keyed-write timeouts to fail the tasks", |t| {
        t.counters.failures >= 1
    })
    .await;
    s.tools.set_answer_latency("issue_refund", Duration::ZERO);
    s.engine.advance(retry + Duration::from_secs(1));
    wait_completed(&s, &slow).await;
    let after = s.tools.counters().await;
    let calls = s.tools.calls();
    for id in &slow {
        let keys: Vec<Option<String>> = calls[sent_before..]
            .iter()
            .filter(|c| {
                c.tool == "issue_refund"
                    && c.idempotency_key
                        .as_deref()
                        .is_some_and(|k| k.starts_with(&format!("abada:{id}:")))
            })
            .map(|c| c.idempotency_key.clone())
            .collect();
        assert_eq!(
            keys.len() as u32,
            tries + 1,
            "task {id}: {tries} slow sends, one after the resume: {keys:?}"
        );
        assert!(
            keys.iter().all(|k| *k == keys[0]),
            "task {id}: re-sent under the same key: {keys:?}"
        );
    }
    assert_eq!(
        after.writes_applied - before.writes_applied,
        2,
        "each slow task's refund applied once"
    );
    assert_eq!(
        after.duplicates - before.duplicates,
        u64::from(2 * tries),
        "each re-send answered from storage"
    );
    finish(
        &s,
        vec![w],
        Expect::default().tool_tries(tries),
        "tool server down / slow",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_sessions_error_results_and_oversized_results_still_complete() {
    let s = stack().await;
    s.model.set_script(
        "slowish",
        refund_script().with_latency(Duration::from_millis(300)),
    );
    // Expired sessions: forget every session once the first tool call went through.
    let exp = refund_tasks(&s, "texp", 2, "openai/slowish", &[]);
    // On a loaded machine a 3 MiB result can take seconds to arrive (every attempt then fails
    // as "unavailable") and its decoding can hold the worker's threads long enough to starve a
    // short lease's heartbeats: nothing here hangs or expires, so both bounds are long.
    let mut agent = settings();
    agent.tool_sessions.call_timeout = Duration::from_secs(10);
    let w = worker(&s, "w-tools2", 4, Duration::from_secs(30), agent);
    within("a first tool call", async {
        while s.tools.calls().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    s.tools.expire_sessions().await;
    wait_completed(&s, &exp).await;

    // isError results: handed to the model, which answers; nothing applied.
    s.tools.set_error_results(true);
    let err = refund_tasks(&s, "terr", 2, "openai/refund", &[]);
    let views = wait_completed(&s, &err).await;
    assert!(views.iter().all(|t| {
        t.journal
            .iter()
            .any(|step| step.pointer("/data/result/isError") == Some(&Value::Bool(true)))
    }));
    s.tools.set_error_results(false);

    // Oversized results: cut to the cap before the model and the journal see them.
    s.tools.set_oversized_results(Some(3 * 1024 * 1024));
    let big = refund_tasks(&s, "tbig", 2, "openai/refund", &[]);
    let views = wait_completed(&s, &big).await;
    for t in &views {
        let largest = t
            .journal
            .iter()
            .map(|step| step.to_string().len())
            .max()
            .unwrap_or(0);
        assert!(
            largest < 512 * 1024,
            "task {}: a journal step of {largest} bytes",
            t.id
        );
    }
    s.tools.set_oversized_results(None);
    finish(
        &s,
        vec![w],
        Expect::default(),
        "expired sessions / isError / oversized",
    )
    .await;
}

// ---- the real binary -------------------------------------------------------------------------

/// Peak resident memory allowed for the real (debug) binary: it idles at about 20 MiB; the run
/// holds at most 4 tasks (the default slots), each with a conversation of a few KiB and tool
/// results capped at 64 KiB, plus HTTP pools. 256 MiB leaves ample room for allocator slack while
/// still catching a leak that grows with the number of tasks or retries.
const MEMORY_BOUND_KIB: u64 = 256 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_binary_rides_out_a_fault_mix_without_panic_in_bounded_memory() {
    let s = stack().await;
    s.engine.inject(Fault::ServerError {
        operation: Operation::JournalAppend,
        count: 3,
        status: Some(502),
    });
    s.engine.inject(Fault::ResetConnection {
        operation: Operation::Complete,
        count: 2,
    });
    s.engine.inject(Fault::DropResponse {
        operation: Operation::JournalAppend,
        count: 2,
    });
    s.engine.inject(Fault::BadBody {
        operation: Operation::FetchAndLock,
        count: 1,
        body: BadBody::WrongJson,
    });
    s.engine.inject(Fault::Throttle {
        operation: Operation::ToolCredentials,
        count: 1,
        retry_after_secs: Some(1),
    });
    s.model
        .inject_fault("refund", ModelFault::TruncatedBody, FaultTimes::Next(1));
    s.tools.set_oversized_results(Some(1024 * 1024));
    let ids = refund_tasks(&s, "bin", 8, "openai/refund", &[]);
    let mut env = stack_env(&s, "proc-faults");
    // Nothing here waits for a lease to run out; decoding 1 MiB results in a debug build on a
    // loaded machine must not starve a heartbeat.
    env.push(("ABADA_AGENT_LOCK_DURATION_MS".into(), "30000".into()));
    let mut p = WorkerProcess::spawn(&env).await;
    wait_completed(&s, &ids).await;
    let peak = peak_memory_kib(p.pid).expect("VmHWM readable on Linux");
    let (_, metrics) = p.admin_get("/metrics").await;
    let slots = metrics
        .lines()
        .find(|l| l.starts_with("abada_agent_slots_in_use"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as i64);
    p.signal("TERM");
    let status = p.wait(Duration::from_secs(20)).await;
    assert!(status.success(), "exit {status}");
    let mut output = p.stdout();
    output.extend(p.stderr());
    let observation = WorkerObservation {
        worker_id: "proc-faults".into(),
        max_tasks: 4,
        events: Vec::new(),
        slot_samples: slots.into_iter().collect(),
        output,
        memory: Some((peak, MEMORY_BOUND_KIB)),
    };
    eprintln!("real binary under faults: peak resident memory {peak} KiB");
    let report = check_invariants(&s.engine, &[&s.tools], &[observation], &Expect::default()).await;
    report.assert_ok("real binary fault mix");
    // The promises only a run on the wire can judge had something to judge here: the keyed
    // refunds, the tasks' leases, the binary's memory.
    for invariant in abada_sim::invariants::WIRE_ONLY {
        assert!(
            report.judged.get(invariant).copied().unwrap_or(0) > 0,
            "{invariant:?} judged nothing: {:?}",
            report.judged
        );
    }
    s.shutdown().await;
}

/// The new faults are in the emulator's admin API too (`POST /admin/faults`).
#[tokio::test]
async fn the_new_engine_faults_can_be_injected_over_the_admin_api() {
    let s = stack().await;
    let http = reqwest::Client::new();
    for body in [
        json!({"kind": "throttle", "operation": "fetch-and-lock", "count": 1, "retryAfterSecs": 2}),
        json!({"kind": "badBody", "operation": "journal-read", "count": 1, "body": "wrongJson"}),
        json!({"kind": "badBody", "operation": "fetch-and-lock", "count": 1, "body": "notJson"}),
        json!({"kind": "resetConnection", "operation": "complete", "count": 1}),
    ] {
        let r = http
            .post(format!("{}/admin/faults", s.engine.root_url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "{body}");
    }
    // The throttle comes first for fetch: 429 with Retry-After, nothing locked.
    let r = http
        .post(format!("{}/v1/external-tasks/fetch-and-lock", s.engine.base_url()))
        .header("X-Abada-Worker-Protocol-Version", "1")
        .json(&json!({"workerId": "w", "topics": ["abada:agent"], "lockDuration": 1000, "maxTasks": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "2");
    // Then the HTML body, with a 200.
    let r = http
        .post(format!("{}/v1/external-tasks/fetch-and-lock", s.engine.base_url()))
        .header("X-Abada-Worker-Protocol-Version", "1")
        .json(&json!({"workerId": "w", "topics": ["abada:agent"], "lockDuration": 1000, "maxTasks": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().starts_with("<html>"));
    // An outage closes the API root too (what a worker probes); admin still answers.
    s.engine.set_outage(true);
    assert!(http.get(s.engine.base_url()).send().await.is_err());
    s.engine.set_outage(false);
    assert!(http.get(s.engine.base_url()).send().await.is_ok());
    s.shutdown().await;
}
