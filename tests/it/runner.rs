//! The runner and the heartbeat scheduler under tokio's paused clock: workers built by the
//! composition root (`Worker::build`, through `abada_sim::world::workers::start_in_world`) from a
//! configuration parsed the production way, each running a test's task handler, against the
//! simulator's in-process engine (the emulator's own state machine, `abada_sim::world`) behind the
//! devkit's one engine decorator: a `FaultGate`, whose knobs play what a test needs of the
//! engine (slow, silent or down, partial or surplus answers, refused extensions, a failure's
//! answer late) and which logs every call with its virtual time. Slots, refill, heartbeat
//! cadence, lease loss, local expiry, supersession, shutdown and panics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use abada_agent_worker::app::{Seams, Tuning};
use abada_agent_worker::devkit::engine::TaskSpec;
use abada_agent_worker::devkit::gate::{Call, FaultGate, FaultState, GatedEngine};
use abada_agent_worker::devkit::workers::{WorkerHandle, WorkerOptions};
use abada_agent_worker::engine::{Engine, Task};
use abada_agent_worker::handler::{Outcome, TaskContext, TaskEnd, TaskHandler};
use abada_agent_worker::runner::RunnerEvent;
use abada_sim::world::workers::start_in_world;
use abada_sim::world::{FaultPlan, World, WorldEngine, WorldOptions};
use async_trait::async_trait;
use serde_json::Map;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::support::wait::recv_within;

/// The engine of these tests: the simulator's world (the emulator's engine state machine,
/// in-process) and the gate every worker's engine passes (its knobs and its log of calls).
#[derive(Clone)]
struct TestEngine {
    world: Arc<World>,
    gate: Arc<FaultGate>,
}

impl TestEngine {
    fn new() -> Self {
        TestEngine {
            world: World::new(WorldOptions {
                seed: 1,
                lock_duration: Duration::from_secs(120),
                faults: FaultPlan::default(),
                store_journal: false,
            }),
            gate: FaultGate::new(),
        }
    }

    /// An engine holding `n` tasks.
    fn with_tasks(n: usize) -> Self {
        let e = TestEngine::new();
        for _ in 0..n {
            e.add();
        }
        e
    }

    /// Creates an `abada:agent` task with 3 retries (no definition: the tests' handlers run
    /// it) and returns its id.
    fn add(&self) -> String {
        self.add_with_retries(Some(3))
    }

    fn add_with_retries(&self, retries: Option<i32>) -> String {
        self.world.core().create_task(TaskSpec {
            retries,
            ..TaskSpec::default()
        })
    }

    /// The gate's knobs and what it saw.
    fn state(&self) -> MutexGuard<'_, FaultState> {
        self.gate.state()
    }

    fn calls(&self) -> Vec<Call> {
        self.gate.calls()
    }

    fn calls_for(&self, task_id: &str) -> Vec<Call> {
        self.gate.calls_for(task_id)
    }

    /// The engine's clock steps forward past every lease it granted: each locked task is
    /// offered again (its next attempt), while the worker holding it has not noticed.
    fn expire_leases(&self) {
        // From now on (the jump applies from world time 0, and was not there before).
        self.world.faults().plan.engine_clock_jump = Some((0, 3_600_000));
    }

    /// Worker `worker_id`'s engine: the world's, behind the gate.
    fn client(&self, worker_id: &str) -> Arc<dyn Engine> {
        GatedEngine::wrapper(self.gate.clone())(Arc::new(WorldEngine::new(
            self.world.clone(),
            worker_id,
        )))
    }
}

/// Sleeps (virtual time) and completes; counts how many run at once.
struct SleepHandler {
    work: Duration,
    running: AtomicUsize,
    most: AtomicUsize,
}

impl SleepHandler {
    fn new(work: Duration) -> Arc<Self> {
        Arc::new(SleepHandler {
            work,
            running: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl TaskHandler for SleepHandler {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        struct Dec<'a>(&'a AtomicUsize);
        impl Drop for Dec<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _dec = Dec(&self.running);
        tokio::select! {
            _ = tokio::time::sleep(self.work) => {}
            _ = ctx.stopped() => return Outcome::released(&task, "shutting down"),
        }
        let mut variables = Map::new();
        variables.insert("done".into(), true.into());
        Outcome::Complete { variables }
    }
}

/// Worker `w-test`: 4 slots, the lease `lock`, a poll interval of a second, a grace of 25 s,
/// and production's backoffs without their jitter (the tests count fetches and time them).
fn options(lock: Duration) -> WorkerOptions {
    let defaults = Tuning::default();
    WorkerOptions {
        worker_id: "w-test".into(),
        slots: 4,
        lock_duration: lock,
        poll_interval: Duration::from_secs(1),
        shutdown_grace: Duration::from_secs(25),
        env: Vec::new(),
        tuning: Tuning {
            poll_jitter: 0.0,
            error_backoff: defaults.error_backoff.without_jitter(),
            throttle_backoff: defaults.throttle_backoff.without_jitter(),
            heartbeat_retry: defaults.heartbeat_retry.without_jitter(),
            contention_backoff: defaults.contention_backoff.without_jitter(),
            ..defaults
        },
    }
}

/// A worker built by the composition root, running `handler`, against `engine`.
fn start(engine: &TestEngine, handler: Arc<dyn TaskHandler>, opts: WorkerOptions) -> WorkerHandle {
    start_in_world(
        &engine.world,
        opts,
        &[],
        Seams {
            decorate_engine: Some(GatedEngine::wrapper(engine.gate.clone())),
            handler: Some(handler),
            ..Seams::default()
        },
    )
}

async fn wait_until(mut cond: impl FnMut() -> bool, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "condition not reached in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The runner's next event, within an hour of virtual time (a paused clock runs on forever
/// when none comes).
async fn next_event(events: &mut mpsc::UnboundedReceiver<RunnerEvent>) -> RunnerEvent {
    recv_within(events, Duration::from_secs(3600), "the runner's next event").await
}

fn completed(engine: &TestEngine) -> usize {
    engine.state().completed.len()
}

#[tokio::test(start_paused = true)]
async fn four_slots_twenty_tasks_never_more_than_four_and_fetch_asks_for_the_free_slots() {
    let engine = TestEngine::with_tasks(20);
    let handler = SleepHandler::new(Duration::from_secs(10));
    let mut s = options(Duration::from_secs(120));
    s.slots = 4;
    // A poll interval far longer than the run: refills must not wait for it.
    s.poll_interval = Duration::from_secs(3600);
    let started = Instant::now();
    let r = start(&engine, handler.clone(), s);
    wait_until(|| completed(&engine) == 20, Duration::from_secs(600)).await;
    let took = started.elapsed();
    r.stop().await;

    assert_eq!(
        handler.most.load(Ordering::SeqCst),
        4,
        "at most 4 at once, and 4 reached"
    );
    let fetches: Vec<_> = engine
        .calls()
        .into_iter()
        .filter(|c| c.op == "fetch-and-lock")
        .collect();
    for f in &fetches {
        assert_eq!(
            f.max_tasks as usize,
            4 - f.outstanding,
            "a fetch must ask for exactly the free slots"
        );
        assert!(f.max_tasks > 0, "no fetch with no free slot");
    }
    // 20 tasks of 10 s on 4 slots: 5 rounds; refilled at once, not after the 1 h poll interval.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(engine.state().completed.values().all(|&n| n == 1));
}

/// With every slot busy, the slot a task frees is asked for as soon as its work is done, not a
/// liveness tick or a poll interval later, and not after its report's answer either.
#[tokio::test(start_paused = true)]
async fn a_freed_slot_is_refilled_as_its_report_goes_out() {
    let engine = TestEngine::with_tasks(3);
    let handler = SleepHandler::new(Duration::from_secs(10));
    let mut s = options(Duration::from_secs(120));
    s.slots = 1;
    s.poll_interval = Duration::from_secs(3600);
    let r = start(&engine, handler, s);
    wait_until(|| completed(&engine) == 3, Duration::from_secs(60)).await;
    r.stop().await;
    let calls = engine.calls();
    let fetches: Vec<Instant> = calls
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .map(|c| c.at)
        .collect();
    let completes: Vec<Instant> = calls
        .iter()
        .filter(|c| c.op == "complete")
        .map(|c| c.at)
        .collect();
    assert_eq!(completes.len(), 3);
    for (i, done) in completes.iter().enumerate() {
        let next = fetches
            .iter()
            .find(|&&f| f >= *done)
            .unwrap_or_else(|| panic!("no fetch after completion {i}"));
        // The fake engine takes 1 ms of virtual time per fetch; the complete and the fetch for
        // the freed slot go out at the same instant.
        assert!(
            *next - *done <= Duration::from_millis(2),
            "completion {i}: the freed slot was asked for {:?} later",
            *next - *done
        );
    }
}

/// An engine slow to answer a complete does not hold the slot: the next task's fetch goes out
/// and its work starts while the complete is in flight (a slot's cycle is the work
/// plus one fetch). Reports in flight are bounded by the slots, so the tasks this worker holds
/// (handed out, not yet reported) never exceed twice the slots, and with every report permit
/// out a finished task keeps its slot (no fetch) until one returns.
#[tokio::test(start_paused = true)]
async fn a_slow_complete_does_not_hold_the_slot_and_reports_in_flight_are_bounded() {
    let engine = TestEngine::with_tasks(40);
    engine.state().complete_latency = Duration::from_millis(500);
    let handler = SleepHandler::new(Duration::from_millis(100));
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_secs(3600);
    let r = start(&engine, handler.clone(), s);
    wait_until(|| completed(&engine) == 40, Duration::from_secs(600)).await;
    let events = r.stop_collecting().await;
    let calls = engine.calls();
    let first = calls[0].at;
    let last = calls
        .iter()
        .filter(|c| c.op == "complete")
        .map(|c| c.at)
        .max()
        .unwrap();
    // Work 100 ms, complete 500 ms, 2 slots and 2 reports: the reports set the pace (2 per
    // 500 ms), not work + complete + fetch (2 per ~600 ms).
    let took = last - first;
    assert!(
        took < Duration::from_millis(40 / 2 * 500 + 500),
        "40 tasks took {took:?}: the complete's answer held the slots"
    );
    // The bound: never more than slots + reports handed out and unreported at a fetch.
    let most = calls
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .map(|c| c.outstanding + c.max_tasks as usize)
        .max()
        .unwrap();
    assert!(
        most <= 4,
        "a fetch could leave {most} tasks held on 2 slots"
    );
    assert!(handler.most.load(Ordering::SeqCst) <= 2);
    // A fetch went out while a complete was in flight (between a complete's call and its
    // answer): the work of the next task overlapped the report.
    let overlapped = calls
        .iter()
        .any(|c| c.op == "fetch-and-lock" && c.outstanding > 0);
    assert!(overlapped, "no fetch while a report was out");
    // Every task ended once; those that found a report permit gave their slot back first.
    let mut freed = std::collections::HashSet::new();
    let mut ended = 0;
    for e in events {
        match e {
            RunnerEvent::SlotFreed { task_id, .. } => {
                assert!(freed.insert(task_id));
            }
            RunnerEvent::TaskEnded { .. } => ended += 1,
            _ => {}
        }
    }
    assert_eq!(ended, 40);
    assert!(
        freed.len() >= 20,
        "only {} slots given back early",
        freed.len()
    );
}

fn fetch_times(engine: &TestEngine, since: Instant) -> Vec<Duration> {
    engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .map(|c| c.at - since)
        .collect()
}

/// An engine whose concurrent fetches skip each other's locked rows answers 2 of the
/// 8 tasks asked for. That is others fetching too, not an empty queue: the rest is fetched at
/// once, so 8 slots are busy, not 2 per poll interval.
#[tokio::test(start_paused = true)]
async fn a_partial_batch_is_followed_by_a_fetch_for_the_rest_before_any_poll_interval() {
    let engine = TestEngine::with_tasks(40);
    engine.state().answer_cap = Some(2);
    let handler = SleepHandler::new(Duration::from_millis(200));
    let mut s = options(Duration::from_secs(120));
    s.slots = 8;
    // A poll interval far longer than the run: any wait for it would show.
    s.poll_interval = Duration::from_secs(3600);
    let started = Instant::now();
    let mut r = start(&engine, handler.clone(), s);
    // Every partial answer is followed by a fetch for the slots still free, at once.
    let mut answers = Vec::new();
    while answers.len() < 4 {
        if let RunnerEvent::Fetched { requested, got } = next_event(&mut r.events).await {
            answers.push((requested, got, Instant::now()));
        }
    }
    assert_eq!(
        answers.iter().map(|a| (a.0, a.1)).collect::<Vec<_>>(),
        vec![(8, 2), (6, 2), (4, 2), (2, 2)],
        "asked for the rest after each partial answer"
    );
    let filled = answers[3].2 - started;
    // The fake engine takes 1 ms of virtual time per fetch: 4 fetches, no wait between them.
    assert!(
        filled <= Duration::from_millis(5),
        "8 slots filled after {filled:?}"
    );
    wait_until(|| completed(&engine) == 40, Duration::from_secs(600)).await;
    let took = started.elapsed();
    r.stop().await;
    assert_eq!(handler.most.load(Ordering::SeqCst), 8, "every slot in use");
    // 40 tasks of 200 ms on 8 slots: 5 rounds, about 1 s; never an hour's poll interval.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    for f in engine.calls().iter().filter(|c| c.op == "fetch-and-lock") {
        assert_eq!(
            f.max_tasks as usize,
            8 - f.outstanding,
            "asks for the free slots"
        );
    }
}

/// A queue that really holds fewer tasks than free slots is not a hot loop: 2, then 1, then an
/// empty answer. Right after tasks that may be contention, so it fetches again after a short
/// pause, backing off (25 ms doubling), and once the pauses would pass the poll interval it
/// waits the poll interval: 8 quick retries within one interval, then one fetch per interval.
#[tokio::test(start_paused = true)]
async fn a_short_queue_ends_in_empty_answers_that_back_off_to_the_poll_interval() {
    let engine = TestEngine::with_tasks(3);
    engine.state().answer_cap = Some(2);
    let handler = SleepHandler::new(Duration::from_secs(100));
    let mut s = options(Duration::from_secs(120));
    s.slots = 8;
    s.poll_interval = Duration::from_secs(10);
    // Production's jitter on the pauses: each between half and all of its nominal length.
    s.tuning.contention_backoff = Tuning::default().contention_backoff;
    let started = Instant::now();
    let mut r = start(&engine, handler, s);
    let mut answers = Vec::new();
    while answers.len() < 13 {
        if let RunnerEvent::Fetched { requested, got } = next_event(&mut r.events).await {
            answers.push((requested, got));
        }
    }
    let fetches = fetch_times(&engine, started);
    r.stop().await;
    assert_eq!(answers[..3], [(8, 2), (6, 1), (5, 0)]);
    assert!(answers[3..].iter().all(|a| *a == (5, 0)), "{answers:?}");
    assert!(fetches[2] < Duration::from_millis(5), "{fetches:?}");
    // Each fetch takes 1 ms of the engine's time.
    let gaps: Vec<Duration> = fetches.windows(2).map(|w| w[1] - w[0]).collect();
    for (k, gap) in gaps[2..10].iter().enumerate() {
        let nominal = Duration::from_millis(25 << k);
        assert!(
            *gap >= nominal / 2 && *gap <= nominal + Duration::from_millis(1),
            "retry {k}: {gap:?} for a pause of {nominal:?}: {fetches:?}"
        );
    }
    assert!(
        fetches[10] - fetches[2] < Duration::from_secs(7),
        "the retries all within one poll interval: {fetches:?}"
    );
    assert!(
        gaps[10..].iter().all(|g| *g >= Duration::from_secs(10)),
        "then the poll interval: {fetches:?}"
    );
}

/// A fetch that met another worker's locks answers empty though tasks wait (the real engine
/// on H2 locks every candidate row for the length of a fetch's transaction). Right after a
/// full answer that is contention, not an empty queue: the worker fetches again soon and
/// fills its slot, rather than idling it for the poll interval (an hour here).
#[tokio::test(start_paused = true)]
async fn an_empty_answer_after_a_full_one_fetches_again_soon() {
    let engine = TestEngine::with_tasks(10);
    let handler = SleepHandler::new(Duration::from_millis(300));
    let mut s = options(Duration::from_secs(120));
    // One slot: no other task's end can bring the next fetch.
    s.slots = 1;
    s.poll_interval = Duration::from_secs(3600);
    let started = Instant::now();
    let mut r = start(&engine, handler.clone(), s);
    // The first fetch is full; the next two, when its task has ended, meet locks.
    loop {
        if let RunnerEvent::Fetched { got, .. } = next_event(&mut r.events).await {
            assert_eq!(got, 1);
            break;
        }
    }
    engine.state().empty_answers = 2;
    let mut answers = Vec::new();
    while answers.len() < 3 {
        if let RunnerEvent::Fetched { requested, got } = next_event(&mut r.events).await {
            answers.push((requested, got, Instant::now() - started));
        }
    }
    let refilled = answers[2].2;
    wait_until(|| completed(&engine) == 10, Duration::from_secs(600)).await;
    let took = started.elapsed();
    r.stop().await;
    assert_eq!(
        answers.iter().map(|a| (a.0, a.1)).collect::<Vec<_>>(),
        [(1, 0), (1, 0), (1, 1)]
    );
    // The task ended at 301 ms; two pauses of at most 25 and 50 ms, 1 ms per fetch.
    assert!(
        refilled <= Duration::from_millis(301 + 25 + 50 + 3),
        "the slot refilled at {refilled:?}"
    );
    // 10 tasks of 300 ms on one slot; never an hour's poll interval.
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// A worker that starts beside busy ones on a backlog meets their locks first: its first
/// answers are empty though tasks wait. That is contention too, so it joins after a few short
/// pauses, not one poll interval (an hour here) per collision.
#[tokio::test(start_paused = true)]
async fn a_worker_whose_first_fetches_meet_locks_joins_within_a_few_pauses() {
    let engine = TestEngine::with_tasks(4);
    engine.state().empty_answers = 2;
    let mut s = options(Duration::from_secs(120));
    s.slots = 4;
    s.poll_interval = Duration::from_secs(3600);
    let started = Instant::now();
    let mut r = start(&engine, SleepHandler::new(Duration::from_secs(1)), s);
    let mut answers = Vec::new();
    while answers.len() < 3 {
        if let RunnerEvent::Fetched { requested, got } = next_event(&mut r.events).await {
            answers.push((requested, got, Instant::now() - started));
        }
    }
    r.stop().await;
    assert_eq!(
        answers.iter().map(|a| (a.0, a.1)).collect::<Vec<_>>(),
        [(4, 0), (4, 0), (4, 4)]
    );
    // Pauses of 25 and 50 ms (no jitter here), 1 ms per fetch.
    assert_eq!(answers[2].2, Duration::from_millis(25 + 50 + 3));
}

/// A task that ends while the loop waits out the poll interval after an empty answer frees its
/// slot and fetches at once: its completion may have made the next task of its process.
#[tokio::test(start_paused = true)]
async fn a_task_ending_during_the_idle_wait_triggers_a_fetch() {
    let engine = TestEngine::with_tasks(1);
    let handler = SleepHandler::new(Duration::from_secs(8));
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_secs(10);
    let started = Instant::now();
    let r = start(&engine, handler, s);
    wait_until(|| completed(&engine) == 1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    r.stop().await;
    let fetches = fetch_times(&engine, started);
    // 1 of 2 at 0, the rest at once: empty, right after tasks, so 8 quick retries (25 ms
    // doubling, under 6.4 s in all) before the idle wait starts; then the task's end at 8 s.
    assert_eq!(fetches.len(), 11, "{fetches:?}");
    assert!(fetches[1] < Duration::from_millis(5), "{fetches:?}");
    assert!(fetches[9] < Duration::from_millis(6_400), "{fetches:?}");
    let ended = engine
        .calls()
        .iter()
        .find(|c| c.op == "complete")
        .map(|c| c.at - started)
        .unwrap();
    assert!(
        fetches[10] >= ended && fetches[10] <= ended + Duration::from_millis(5),
        "fetched {:?} after the task's end, in a 10 s idle wait",
        fetches[10] - ended
    );
}

/// A task's end does not cut short the backoff after a failed fetch: the engine's trouble has
/// not ended because a task did.
#[tokio::test(start_paused = true)]
async fn a_task_ending_during_an_error_backoff_does_not_cut_it_short() {
    let engine = TestEngine::with_tasks(1);
    /// Takes the engine down as it starts, then works for 500 ms.
    struct TakesTheEngineDown(TestEngine);
    #[async_trait]
    impl TaskHandler for TakesTheEngineDown {
        async fn handle(&self, _task: Arc<Task>, _ctx: TaskContext) -> Outcome {
            self.0.state().fetch_transient = true;
            tokio::time::sleep(Duration::from_millis(500)).await;
            Outcome::Complete {
                variables: Map::new(),
            }
        }
    }
    // A fetch reaches the engine 1 ms after it is sent: the handler, started by the first
    // fetch's answer, takes the engine down before the fetch for the rest arrives.
    engine
        .state()
        .latency
        .insert("fetch-and-lock", Duration::from_millis(1));
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_secs(10);
    let started = Instant::now();
    let r = start(&engine, Arc::new(TakesTheEngineDown(engine.clone())), s);
    wait_until(|| completed(&engine) == 1, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    r.stop().await;
    let fetches = fetch_times(&engine, started);
    // 1 of 2 at 0; the rest at once fails: 1 s backoff (no jitter here), then 2 s. The task's
    // end at 0.5 s brings no fetch.
    assert!(fetches.len() >= 3, "{fetches:?}");
    assert!(fetches[1] < Duration::from_millis(5), "{fetches:?}");
    assert!(
        fetches[2] >= fetches[1] + Duration::from_secs(1),
        "the backoff was served in full: {fetches:?}"
    );
}

/// Workers sharing one engine whose answers are partial both fill their slots and share the
/// work evenly.
#[tokio::test(start_paused = true)]
async fn two_workers_on_one_partial_engine_fill_their_slots_and_share_the_work() {
    let engine = TestEngine::with_tasks(160);
    engine.state().answer_cap = Some(2);
    let handlers = [
        SleepHandler::new(Duration::from_millis(200)),
        SleepHandler::new(Duration::from_millis(200)),
    ];
    // Two workers of their own (ids `w-0`, `w-1`: the engine tells owners apart).
    let runs: Vec<WorkerHandle> = handlers
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut s = options(Duration::from_secs(120));
            s.worker_id = format!("w-{i}");
            s.slots = 8;
            start(&engine, h.clone(), s)
        })
        .collect();
    let counts = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    let mut stops = Vec::new();
    for (mut r, n) in runs.into_iter().zip(counts.iter().cloned()) {
        let mut events = std::mem::replace(&mut r.events, mpsc::unbounded_channel().1);
        stops.push(r);
        tokio::spawn(async move {
            while let Some(e) = events.recv().await {
                if matches!(e, RunnerEvent::TaskEnded { .. }) {
                    n.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    }
    wait_until(|| completed(&engine) == 160, Duration::from_secs(600)).await;
    for h in &handlers {
        assert_eq!(
            h.most.load(Ordering::SeqCst),
            8,
            "every slot of each worker in use"
        );
    }
    let done: Vec<usize> = counts.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    assert_eq!(done.iter().sum::<usize>(), 160);
    for n in &done {
        // Within 10 % of the even share of 80.
        assert!((72..=88).contains(n), "uneven: {done:?}");
    }
    for r in stops {
        r.stop().await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_empty_fetch_waits_the_poll_interval_and_a_full_batch_fetches_again_at_once() {
    let engine = TestEngine::with_tasks(0);
    let handler = SleepHandler::new(Duration::from_secs(1));
    let mut s = options(Duration::from_secs(120));
    s.poll_interval = Duration::from_secs(2);
    let r = start(&engine, handler, s);
    tokio::time::sleep(Duration::from_secs(11)).await;
    r.stop().await;
    let fetches: Vec<_> = engine
        .calls()
        .into_iter()
        .filter(|c| c.op == "fetch-and-lock")
        .collect();
    // The first answer, empty, may be contention (a worker starting beside busy ones): 6
    // quick retries, 25 ms doubling (1575 ms of the 2 s interval), each plus the 1 ms the
    // engine's answer takes; then 1 fetch per poll interval: t = 3.58, 5.58, 7.58, 9.58 s.
    let gaps: Vec<Duration> = fetches.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert_eq!(
        gaps[..6],
        [26, 51, 101, 201, 401, 801].map(Duration::from_millis),
        "{gaps:?}"
    );
    assert_eq!(fetches.len(), 11, "{gaps:?}");
    for gap in &gaps[6..] {
        assert!(
            *gap >= Duration::from_secs(2) && *gap < Duration::from_millis(2010),
            "{gap:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn heartbeats_every_third_of_the_lock_and_a_task_ten_times_slower_keeps_its_lease() {
    let engine = TestEngine::new();
    let ids = [engine.add(), engine.add(), engine.add()];
    let lock = Duration::from_secs(30);
    let handler = SleepHandler::new(lock * 10);
    let mut s = options(lock);
    s.poll_interval = Duration::from_secs(3600);
    let r = start(&engine, handler, s);
    wait_until(|| completed(&engine) == 3, Duration::from_secs(400)).await;
    r.stop().await;
    for id in ids.iter().map(String::as_str) {
        let beats: Vec<Instant> = engine
            .calls_for(id)
            .into_iter()
            .filter(|c| c.op == "heartbeat")
            .map(|c| c.at)
            .collect();
        // 300 s of work, one extension every 10 s: 29 or 30 of them.
        assert!(beats.len() >= 29, "{id}: {} heartbeats", beats.len());
        for pair in beats.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= Duration::from_millis(9_990) && gap <= Duration::from_millis(10_010),
                "{id}: heartbeat gap {gap:?}"
            );
        }
        let calls = engine.calls_for(id);
        assert_eq!(
            calls.last().unwrap().op,
            "complete",
            "{id}: completed, lease kept"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_extension_stops_the_task_silently_and_frees_its_slot() {
    let engine = TestEngine::new();
    let lost = engine.add();
    engine.state().refuse_heartbeat.insert(lost.clone());
    let handler = SleepHandler::new(Duration::from_secs(100));
    let mut s = options(Duration::from_secs(30));
    s.slots = 1;
    s.poll_interval = Duration::from_secs(1);
    let mut r = start(&engine, handler.clone(), s);
    // The first extension (t = 10 s) is refused: the task must end as lease_lost.
    loop {
        match next_event(&mut r.events).await {
            RunnerEvent::TaskEnded {
                task_id, outcome, ..
            } => {
                assert_eq!(task_id, lost);
                assert_eq!(outcome, TaskEnd::LeaseLost);
                break;
            }
            _ => continue,
        }
    }
    // The slot is free again: the next task is taken and completed.
    engine.add();
    wait_until(|| completed(&engine) == 1, Duration::from_secs(200)).await;
    r.stop().await;
    // Nothing about the lost attempt after the refusal. (The engine's lease of the refused task
    // runs out at 30 s and it offers the task again: a later attempt may be fetched.)
    let calls = engine.calls_for(&lost);
    let ops: Vec<_> = calls
        .iter()
        .filter(|c| c.attempt == Some(1))
        .map(|c| c.op)
        .collect();
    assert_eq!(ops, vec!["heartbeat"], "nothing after the refusal: {ops:?}");
    assert_eq!(
        handler.running.load(Ordering::SeqCst),
        0,
        "the handler was dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn no_accepted_extension_for_a_lock_duration_loses_the_lease_with_the_engine_down() {
    let engine = TestEngine::new();
    let cut_off = engine.add();
    engine.state().heartbeat_transient = true;
    let handler = SleepHandler::new(Duration::from_secs(1000));
    let lock = Duration::from_secs(30);
    let mut s = options(lock);
    s.slots = 1;
    s.poll_interval = Duration::from_secs(3600);
    let mut r = start(&engine, handler, s);
    let started = Instant::now();
    loop {
        if let RunnerEvent::TaskEnded { outcome, .. } = next_event(&mut r.events).await {
            assert_eq!(outcome, TaskEnd::LeaseLost);
            break;
        }
    }
    let lost_after = started.elapsed();
    // Lost by the worker's own clock before the engine's lease could run out (L minus margin).
    assert!(lost_after <= lock, "{lost_after:?}");
    assert!(
        lost_after >= lock - lock / 10 - Duration::from_millis(50),
        "{lost_after:?}"
    );
    r.stop().await;
    let ops: Vec<_> = engine.calls_for(&cut_off).iter().map(|c| c.op).collect();
    assert!(ops.iter().all(|op| *op == "heartbeat"), "{ops:?}");
    assert!(ops.len() >= 3, "transient failures are retried: {ops:?}");
}

/// Runs a worker of two slots on a task `dup`, has the engine hand out its attempt 2 two seconds
/// in (the engine's clock steps past the lease: the worker's own clock has not), and returns
/// `dup` and how both attempts ended, in order, once the worker has shut down.
async fn dup_fetched_again_2s_in(
    engine: &TestEngine,
    handler: Arc<dyn TaskHandler>,
) -> (String, Vec<(Option<u32>, TaskEnd)>) {
    let dup = engine.add();
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_secs(5);
    let mut r = start(engine, handler, s);
    tokio::time::sleep(Duration::from_secs(2)).await;
    engine.expire_leases();
    let mut ended = Vec::new();
    while ended.len() < 2 {
        if let RunnerEvent::TaskEnded {
            attempt, outcome, ..
        } = next_event(&mut r.events).await
        {
            ended.push((attempt, outcome));
        }
    }
    r.stop().await;
    (dup, ended)
}

#[tokio::test(start_paused = true)]
async fn the_same_task_fetched_again_stops_the_older_attempt() {
    let engine = TestEngine::new();
    let handler = SleepHandler::new(Duration::from_secs(50));
    let (dup, ended) = dup_fetched_again_2s_in(&engine, handler.clone()).await;
    assert_eq!(
        ended,
        vec![(Some(1), TaskEnd::LeaseLost), (Some(2), TaskEnd::Completed)]
    );
    let completes: Vec<_> = engine
        .calls_for(&dup)
        .into_iter()
        .filter(|c| c.op == "complete")
        .collect();
    assert_eq!(completes.len(), 1);
    assert_eq!(completes[0].attempt, Some(2));
    // The newer attempt's work began once the older one had stopped: never both at once.
    assert_eq!(handler.most.load(Ordering::SeqCst), 1);
}

/// When each attempt of a task did something, in order.
type AttemptTimes = Arc<std::sync::Mutex<Vec<(Option<u32>, Instant)>>>;

/// Holds something that takes a second to close (an MCP session, say): its close runs on the
/// task's cleanup tracker when the handler is dropped. Records when each attempt began and
/// when each close ended.
#[derive(Default)]
struct SlowToClose {
    began: AttemptTimes,
    closed: AttemptTimes,
}

#[async_trait]
impl TaskHandler for SlowToClose {
    async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
        self.began
            .lock()
            .unwrap()
            .push((task.attempt, Instant::now()));
        struct Session {
            attempt: Option<u32>,
            cleanup: tokio_util::task::TaskTracker,
            closed: AttemptTimes,
        }
        impl Drop for Session {
            fn drop(&mut self) {
                let (attempt, closed) = (self.attempt, self.closed.clone());
                self.cleanup.spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    closed.lock().unwrap().push((attempt, Instant::now()));
                });
            }
        }
        let _session = Session {
            attempt: task.attempt,
            cleanup: ctx.cleanup().clone(),
            closed: self.closed.clone(),
        };
        tokio::time::sleep(Duration::from_secs(50)).await;
        Outcome::Complete {
            variables: Map::new(),
        }
    }
}

/// A superseded attempt closes what it held (its cleanup, bounded) before the newer attempt of
/// the same task begins: never two attempts of one task at once in a worker, not even one
/// winding down beside one starting.
#[tokio::test(start_paused = true)]
async fn a_newer_attempt_begins_only_once_the_superseded_one_has_closed_what_it_held() {
    let engine = TestEngine::new();
    let handler = Arc::new(SlowToClose::default());
    let (_, ended) = dup_fetched_again_2s_in(&engine, handler.clone()).await;
    assert_eq!(
        ended,
        vec![(Some(1), TaskEnd::LeaseLost), (Some(2), TaskEnd::Completed)]
    );
    let closed = handler.closed.lock().unwrap().clone();
    let first_closed = closed.iter().find(|(a, _)| *a == Some(1)).unwrap().1;
    let began = handler.began.lock().unwrap().clone();
    let second = began.iter().find(|(a, _)| *a == Some(2)).unwrap().1;
    assert!(
        second >= first_closed,
        "attempt 2 began {:?} before attempt 1 had closed its session",
        first_closed - second
    );
}

/// Fails a task's first attempt technically and completes every later one, recording when
/// each attempt's work began and how many attempts of one task were in the handler at once.
#[derive(Default)]
struct FailFirstAttempt {
    began: AttemptTimes,
    running: AtomicUsize,
    most: AtomicUsize,
}

#[async_trait]
impl TaskHandler for FailFirstAttempt {
    async fn handle(&self, task: Arc<Task>, _ctx: TaskContext) -> Outcome {
        self.began
            .lock()
            .unwrap()
            .push((task.attempt, Instant::now()));
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        if task.attempt == Some(1) {
            return Outcome::Failure {
                kind: abada_agent_worker::handler::FailureKind::Technical,
                report: abada_agent_worker::engine::FailureReport {
                    error_message: "the tool server is down".into(),
                    error_details: String::new(),
                    retries: abada_agent_worker::handler::retries_consumed(&task),
                    retry_timeout: Duration::ZERO,
                },
            };
        }
        Outcome::Complete {
            variables: Map::new(),
        }
    }
}

/// The engine applies a failure, its retry timeout runs out, and it offers the task again
/// while the worker still waits for the failure's answer (the failure's `retryTimeout` is 0:
/// the engine offers the task again at once; its answer comes 2 s late); this worker, a slot
/// free, fetches it. The older attempt is not superseded: its report was accepted, and it ends `failed`,
/// not `lease_lost` (the race that once made `faults::a_tool_server_down_or_slow_...` flaky). The
/// newer attempt starts its work only once the older one has its answer: one attempt of a task
/// at a time in a worker.
#[tokio::test(start_paused = true)]
async fn a_task_offered_again_while_its_failure_awaits_its_answer_keeps_the_older_end() {
    let engine = TestEngine::new();
    let again = engine.add();
    engine.state().failure_latency = Duration::from_secs(2);
    let handler = Arc::new(FailFirstAttempt::default());
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_millis(200);
    let mut r = start(&engine, handler.clone(), s);
    let mut ended = Vec::new();
    while ended.len() < 2 {
        if let RunnerEvent::TaskEnded {
            attempt, outcome, ..
        } = next_event(&mut r.events).await
        {
            ended.push((attempt, outcome, Instant::now()));
        }
    }
    r.stop().await;
    let ends: Vec<_> = ended.iter().map(|(a, o, _)| (*a, *o)).collect();
    assert_eq!(
        ends,
        vec![(Some(1), TaskEnd::Failed), (Some(2), TaskEnd::Completed)],
        "the older attempt's accepted failure must end it as failed"
    );
    // The re-offer was fetched while the failure's answer was out...
    let calls = engine.calls_for(&again);
    let failure_at = calls.iter().find(|c| c.op == "failure").unwrap().at;
    let answered_at = failure_at + Duration::from_secs(2);
    let refetched = engine
        .calls()
        .iter()
        .any(|c| c.op == "fetch-and-lock" && c.at > failure_at && c.at < answered_at);
    assert!(refetched, "no fetch while the failure's answer was out");
    // ...and the newer attempt's work began only after that answer.
    let began = handler.began.lock().unwrap().clone();
    let second = began.iter().find(|(a, _)| *a == Some(2)).unwrap().1;
    assert!(
        second >= answered_at,
        "attempt 2 began {:?} before attempt 1's failure was answered",
        answered_at - second
    );
    assert_eq!(handler.most.load(Ordering::SeqCst), 1);
    let failures = engine.state().failures.len();
    assert_eq!(failures, 1, "the failure was sent once");
    assert_eq!(completed(&engine), 1);
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_short_tasks_finish_and_releases_the_rest_with_retries_unchanged() {
    let engine = TestEngine::new();
    let short = engine.add_with_retries(Some(2));
    let long = engine.add_with_retries(Some(2));
    /// Works 5 s on the task named, 500 s on any other.
    struct Mixed {
        short: String,
    }
    #[async_trait]
    impl TaskHandler for Mixed {
        async fn handle(&self, task: Arc<Task>, ctx: TaskContext) -> Outcome {
            let work = if task.id == self.short { 5 } else { 500 };
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(work)) => Outcome::Complete { variables: Map::new() },
                _ = ctx.stopped() => Outcome::released(&task, "shutting down"),
            }
        }
    }
    let mut s = options(Duration::from_secs(120));
    s.shutdown_grace = Duration::from_secs(20);
    let r = start(
        &engine,
        Arc::new(Mixed {
            short: short.clone(),
        }),
        s,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fetches_before = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .count();
    let signalled = Instant::now();
    r.stop().await;
    let took = signalled.elapsed();
    assert!(took <= Duration::from_secs(21), "exited after {took:?}");
    let fetches_after = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .count();
    assert_eq!(fetches_before, fetches_after, "no fetch after the signal");
    let st = engine.state();
    assert_eq!(st.completed.get(&short), Some(&1));
    assert_eq!(st.failures.len(), 1);
    let (id, report) = &st.failures[0];
    assert_eq!(*id, long);
    assert_eq!(report.retries, 2, "retries unchanged");
    assert_eq!(report.retry_timeout, Duration::ZERO);
}

/// An engine answering a fetch with more tasks than `maxTasks` asked for: the worker starts
/// what its free slots hold and releases the rest at once (retries unchanged, no retry wait),
/// instead of holding them locked, unstarted, until their locks expire.
#[tokio::test(start_paused = true)]
async fn tasks_beyond_max_tasks_are_released_at_once_with_retries_unchanged() {
    let engine = TestEngine::new();
    let ids: Vec<String> = (0..5).map(|_| engine.add_with_retries(Some(2))).collect();
    engine.state().surplus = 3;
    let handler = SleepHandler::new(Duration::from_secs(60));
    let mut s = options(Duration::from_secs(120));
    s.slots = 2;
    s.poll_interval = Duration::from_secs(3600);
    let mut r = start(&engine, handler.clone(), s);
    let fetched = loop {
        if let RunnerEvent::Fetched { requested, got } = next_event(&mut r.events).await {
            break (requested, got);
        }
    };
    assert_eq!(
        fetched,
        (2, 5),
        "the engine answered 5 tasks to a maxTasks of 2"
    );
    // Released within the fetch's own round trip, long before a lock (120 s) could expire.
    wait_until(
        || engine.state().failures.len() == 3,
        Duration::from_millis(100),
    )
    .await;
    let fetched_at = engine
        .calls()
        .iter()
        .find(|c| c.op == "fetch-and-lock")
        .unwrap()
        .at;
    {
        let st = engine.state();
        let mut released: Vec<&str> = st.failures.iter().map(|(id, _)| id.as_str()).collect();
        released.sort();
        assert_eq!(released, [&ids[2], &ids[3], &ids[4]]);
        for (id, report) in &st.failures {
            assert_eq!(report.retries, 2, "{id}: retries unchanged");
            assert_eq!(
                report.retry_timeout,
                Duration::ZERO,
                "{id}: offered again at once"
            );
        }
    }
    for id in &ids[2..] {
        let calls = engine.calls_for(id);
        assert_eq!(
            calls.iter().map(|c| c.op).collect::<Vec<_>>(),
            ["failure"],
            "{id} was never started nor extended, only released"
        );
        assert!(
            calls[0].at - fetched_at < Duration::from_millis(10),
            "{id} released late"
        );
    }
    // The two that fit run to completion; never more than the slots at once.
    wait_until(|| completed(&engine) == 2, Duration::from_secs(120)).await;
    assert_eq!(handler.most.load(Ordering::SeqCst), 2);
    r.stop().await;
}

/// A release (a surplus task, a task cut by shutdown) gives the engine's `retries` back exactly
/// as the engine sent them, odd values included. Clamped, an engine's `-1` went back as `0`, and
/// `retries: 0` makes an incident of a task nobody failed (the real engine: status `FAILED`).
#[tokio::test(start_paused = true)]
async fn releases_send_the_engines_retries_back_as_they_came_odd_values_included() {
    let odd = [
        Some(-1),
        Some(-7),
        Some(i32::MIN),
        Some(101),
        Some(i32::MAX),
        Some(0),
        None,
    ];
    let engine = TestEngine::new();
    let running = engine.add_with_retries(Some(-1));
    let surplus: Vec<String> = odd
        .iter()
        .map(|retries| engine.add_with_retries(*retries))
        .collect();
    engine.state().surplus = odd.len();
    let mut s = options(Duration::from_secs(120));
    s.slots = 1;
    s.poll_interval = Duration::from_secs(3600);
    let r = start(&engine, SleepHandler::new(Duration::from_secs(600)), s);
    wait_until(
        || engine.state().failures.len() == odd.len(),
        Duration::from_millis(100),
    )
    .await;
    // The running task, cut by the shutdown, is released too.
    r.stop().await;
    let st = engine.state();
    let sent: HashMap<&str, i32> = st
        .failures
        .iter()
        .map(|(id, report)| (id.as_str(), report.retries))
        .collect();
    assert_eq!(
        sent.get(running.as_str()),
        Some(&-1),
        "shutdown release: {sent:?}"
    );
    for (i, retries) in odd.iter().enumerate() {
        // The engine's null is its default, 3 (protocol.md B.5).
        let wanted = retries.unwrap_or(3);
        assert_eq!(
            sent.get(surplus[i].as_str()),
            Some(&wanted),
            "surplus release of retries {retries:?}: {sent:?}"
        );
    }
}

/// An engine that answers a surplus and then stalls on every release holds the poll loop for
/// the release bound (10 s) at most: the loop goes on fetching, and stays live.
#[tokio::test(start_paused = true)]
async fn a_stalled_surplus_release_holds_the_poll_loop_ten_seconds_at_most() {
    let engine = TestEngine::with_tasks(40);
    {
        let mut st = engine.state();
        st.surplus = 30;
        st.stall_failures = true;
    }
    let handler = SleepHandler::new(Duration::from_secs(1));
    let mut s = options(Duration::from_secs(120));
    s.slots = 1;
    let r = start(&engine, handler, s);
    let fetches = || {
        engine
            .calls()
            .into_iter()
            .filter(|c| c.op == "fetch-and-lock")
            .map(|c| c.at)
            .collect::<Vec<_>>()
    };
    wait_until(|| fetches().len() >= 2, Duration::from_secs(60)).await;
    let at = fetches();
    let gap = at[1] - at[0];
    assert!(
        gap >= Duration::from_secs(10) && gap < Duration::from_secs(11),
        "the next fetch came {gap:?} after the first"
    );
    assert_eq!(
        engine
            .calls()
            .iter()
            .filter(|c| c.op == "failure" && c.at < at[1])
            .count(),
        8,
        "8 releases at once before the next fetch, the rest left to their locks"
    );
    r.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_ignores_the_stop_signal_is_dropped_and_released_anyway() {
    let engine = TestEngine::with_tasks(1);
    let handler = SleepHandler::new(Duration::from_secs(10_000));
    struct Stubborn(Arc<SleepHandler>);
    #[async_trait]
    impl TaskHandler for Stubborn {
        async fn handle(&self, _task: Arc<Task>, _ctx: TaskContext) -> Outcome {
            tokio::time::sleep(self.0.work).await;
            Outcome::Complete {
                variables: Map::new(),
            }
        }
    }
    let mut s = options(Duration::from_secs(120));
    s.shutdown_grace = Duration::from_secs(3);
    let r = start(&engine, Arc::new(Stubborn(handler)), s);
    tokio::time::sleep(Duration::from_secs(1)).await;
    r.stop().await;
    let st = engine.state();
    assert_eq!(st.failures.len(), 1);
    assert_eq!(st.failures[0].1.retries, 3);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_fails_the_task_technically_and_keeps_its_slot() {
    let engine = TestEngine::new();
    let first = engine.add();
    engine.add();
    /// Panics on the task named, completes any other.
    struct Panics {
        on: String,
    }
    #[async_trait]
    impl TaskHandler for Panics {
        async fn handle(&self, task: Arc<Task>, _ctx: TaskContext) -> Outcome {
            if task.id == self.on {
                panic!("boom");
            }
            Outcome::Complete {
                variables: Map::new(),
            }
        }
    }
    let mut s = options(Duration::from_secs(120));
    s.slots = 1;
    let r = start(&engine, Arc::new(Panics { on: first }), s);
    wait_until(|| completed(&engine) == 1, Duration::from_secs(30)).await;
    r.stop().await;
    let st = engine.state();
    assert_eq!(st.failures.len(), 1);
    assert_eq!(st.failures[0].1.retries, 2, "one retry consumed");
    assert!(st.failures[0].1.error_details.contains("boom"));
}

#[tokio::test(start_paused = true)]
async fn fetch_errors_back_off_exponentially_and_reset_on_success() {
    let engine = TestEngine::new();
    engine.state().fetch_transient = true;
    let handler = SleepHandler::new(Duration::from_secs(1));
    let mut s = options(Duration::from_secs(120));
    s.poll_interval = Duration::from_millis(500);
    let r = start(&engine, handler, s);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let during_outage = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .count();
    // 1 + 2 + 4 + 6 + 6 ... seconds apart: at most a dozen attempts in a minute, not 120.
    assert!(
        (10..=12).contains(&during_outage),
        "{during_outage} fetches in 60 s"
    );
    engine.state().fetch_transient = false;
    tokio::time::sleep(Duration::from_secs(7)).await;
    let n1 = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .count();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let n2 = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock")
        .count();
    // Healthy again: one fetch per 500 ms poll interval.
    assert!(
        (9..=11).contains(&(n2 - n1)),
        "{} fetches in 5 s after recovery",
        n2 - n1
    );
    r.stop().await;
}

/// During a 60 s outage at most 12 fetches (with the production jitter on),
/// probes once per poll interval meanwhile, not ready; once the engine answers again, ready and
/// fetching within one poll interval.
#[tokio::test(start_paused = true)]
async fn an_outage_sees_at_most_twelve_fetches_and_fetching_resumes_within_one_poll_interval() {
    let engine = TestEngine::new();
    // The engine can be probed (the gate's default): unreachable while fetches fail.
    engine.state().fetch_transient = true;
    let mut s = options(Duration::from_secs(120));
    s.worker_id = "w-outage".into();
    // The backoffs keep their production jitter (the error backoff's 0.5): the bound must hold
    // with it.
    s.tuning = Tuning {
        poll_jitter: 0.0,
        ..Tuning::default()
    };
    let poll = s.poll_interval;
    let r = start(&engine, SleepHandler::new(Duration::from_secs(1)), s);
    let status = r.status.clone();

    let outage_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let count = |op: &str| engine.calls().iter().filter(|c| c.op == op).count();
    let fetches = count("fetch-and-lock");
    assert!(fetches <= 12, "{fetches} fetches in a 60 s outage");
    assert!(fetches >= 5, "still trying during the outage: {fetches}");
    let probes = count("probe");
    assert!(
        probes >= 40,
        "probed about once per poll interval: {probes}"
    );
    assert!(!status.is_ready(), "not ready during the outage");
    assert!(outage_start.elapsed() >= Duration::from_secs(60));

    engine.state().fetch_transient = false;
    let back = Instant::now();
    wait_until(|| status.is_ready(), Duration::from_secs(10)).await;
    let first_fetch_after = engine
        .calls()
        .iter()
        .filter(|c| c.op == "fetch-and-lock" && c.at >= back)
        .map(|c| c.at)
        .min()
        .expect("fetching again");
    let delay = first_fetch_after - back;
    // The engine's answer takes 1 ms of virtual time; the probe period is the poll interval.
    assert!(
        delay <= poll + Duration::from_millis(5),
        "fetching resumed {delay:?} after the engine came back (poll interval {poll:?})"
    );
    r.stop().await;
}

/// A worker process paused past its lease (SIGSTOP, a stalled VM) wakes with the heartbeat
/// scheduler's expiry timer and the task's next call both ready. The task must not win that
/// race: the call checks the worker's own clock against the lease's local expiry, not only the
/// latch the scheduler sets. Here the runtime's one thread is blocked past the lease (nothing
/// else can run, as in a stopped process), then the task reports at once: the `complete` used to
/// reach the engine; now nothing does, and the lease is lost as LOCAL_EXPIRY. The
/// crash test found this (a stale holder's `complete` of a task completed by the next holder).
#[tokio::test(flavor = "current_thread")]
async fn a_task_woken_past_its_local_expiry_makes_no_call_even_before_the_scheduler_runs() {
    use abada_agent_worker::engine::{FetchRequest, LeaseLostReason};
    use abada_agent_worker::handler::TaskError;
    use abada_agent_worker::heartbeat::{self, HeartbeatSettings};
    use abada_agent_worker::lease::Lease;
    use abada_agent_worker::metrics::Metrics;
    use abada_agent_worker::random::Random;
    use tokio_util::sync::CancellationToken;

    let engine = TestEngine::new();
    engine.add();
    let client = engine.client("w-frozen");
    let lock = Duration::from_millis(300);
    // A task this worker holds: the engine's lease of it is real.
    let task = client
        .fetch_and_lock(&FetchRequest {
            topics: vec!["abada:agent".into()],
            lock_duration: lock,
            max_tasks: 1,
        })
        .await
        .expect("the engine answers")
        .pop()
        .expect("the task is handed out");
    let scheduler = heartbeat::spawn(
        client.clone(),
        HeartbeatSettings::new(lock),
        Arc::new(Metrics::new()),
        None,
        Random::os(),
    );
    let lease = Lease::new(task.task_ref());
    scheduler.register(lease.clone(), Instant::now());
    // Let the scheduler take the registration (it records the local expiry).
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!lease.expired_locally() && !lease.is_lost());

    // Frozen: the thread itself sleeps past the lease, so no task of this runtime runs.
    std::thread::sleep(lock + Duration::from_millis(100));
    let ctx = TaskContext::new(client.clone(), lease.clone(), CancellationToken::new());
    let result = ctx.fenced(client.complete(lease.task(), &Map::new())).await;
    assert!(
        matches!(
            result,
            Err(TaskError::LeaseLost(LeaseLostReason::LocalExpiry))
        ),
        "{result:?}"
    );
    let calls: Vec<&'static str> = engine.calls().iter().map(|c| c.op).collect();
    assert!(
        !calls.contains(&"complete"),
        "a complete after local expiry: {calls:?}"
    );
    assert_eq!(lease.lost_reason(), Some(LeaseLostReason::LocalExpiry));
}

/// Works `work` (virtual time), then completes; task `silencing` makes the engine silent first,
/// so its completion is on its way when the engine stops answering.
struct SilencingHandler {
    engine: TestEngine,
    silencing: String,
    work: Duration,
}

#[async_trait]
impl TaskHandler for SilencingHandler {
    async fn handle(&self, task: Arc<Task>, _ctx: TaskContext) -> Outcome {
        tokio::time::sleep(self.work).await;
        if task.id == self.silencing {
            self.engine.state().hung = true;
        }
        Outcome::Complete {
            variables: Map::new(),
        }
    }
}

/// The stall on the real engine (docs/benchmarks-history.md, "The real engine 0.11 at full slots"):
/// the engine stops answering while a task's completion is on its way, with no client timeout to
/// end the call. The heartbeat scheduler no longer extends a lease whose task reports, so only the
/// lease's own clock can end it: the report ends at the local expiry (the last accepted
/// extension plus the lock less a tenth) as a lost lease, `LOCAL_EXPIRY`, its slot freed and
/// nothing about the task sent after; once the engine answers again, fetching goes on.
#[tokio::test(start_paused = true)]
async fn a_completion_the_engine_never_answers_ends_at_local_expiry_and_fetching_goes_on() {
    let engine = TestEngine::new();
    let silenced = engine.add();
    let handler = Arc::new(SilencingHandler {
        engine: engine.clone(),
        silencing: silenced.clone(),
        work: Duration::from_secs(25),
    });
    let mut s = options(Duration::from_secs(30));
    s.slots = 1;
    let started = Instant::now();
    let mut r = start(&engine, handler, s);
    let metrics = r.metrics.clone();

    let outcome = loop {
        if let RunnerEvent::TaskEnded {
            task_id, outcome, ..
        } = next_event(&mut r.events).await
        {
            assert_eq!(task_id, silenced);
            break outcome;
        }
    };
    let ended = started.elapsed();
    assert_eq!(outcome, TaskEnd::LeaseLost);
    // Extensions accepted at 10 s and 20 s; the completion went out at 25 s: lost at 20 + 27 s.
    let expiry = Duration::from_secs(47);
    assert!(
        ended >= expiry && ended < expiry + Duration::from_secs(1),
        "ended after {ended:?}, not at the local expiry ({expiry:?})"
    );
    let calls = engine.calls_for(&silenced);
    assert!(calls.iter().any(|c| c.op == "complete"), "{calls:?}");
    assert!(
        calls.iter().all(|c| c.at - started < expiry),
        "a call about the task after its local expiry: {calls:?}"
    );
    let lost = metrics.encode();
    assert!(
        lost.lines()
            .any(|l| l == "abada_agent_leases_lost_total{reason=\"LOCAL_EXPIRY\"} 1"),
        "{lost}"
    );

    // The engine answers again: the fetch that was waiting on it, or the next, takes a new task.
    let next = engine.add();
    engine.state().hung = false;
    wait_until(
        || engine.state().completed.contains_key(&next),
        Duration::from_secs(600),
    )
    .await;
    r.stop().await;
    // (The engine's lease of the task runs out at 50 s and it is offered again: its attempt 2
    // may be fetched; nothing more about attempt 1.)
    let of_attempt_1 = |calls: &[Call]| calls.iter().filter(|c| c.attempt == Some(1)).count();
    assert_eq!(
        of_attempt_1(&engine.calls_for(&silenced)),
        of_attempt_1(&calls),
        "nothing about the lost task once the engine answered again"
    );
}
