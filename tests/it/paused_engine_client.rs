//! The engine HTTP client's waits timed exactly: its retry of a throttled command on tokio's
//! paused clock, over a real socket to the engine emulator on 127.0.0.1.
//!
//! A paused clock and real IO do not mix by themselves: whenever the runtime waits on a
//! socket, tokio moves a paused clock to its next timer (the request timeout would fire). A
//! blocking task held for the whole test stops that (tokio does not auto-advance while one
//! runs), so the clock moves only when the test calls `advance`, and the socket works in real
//! time meanwhile. Every wait on the socket is bounded by a real-time hang guard; no verdict
//! depends on how fast the machine is: the instants compared are the paused clock's.
//!
//! The wire twin, `faults::throttling_429_with_retry_after_is_honoured`, keeps what only whole
//! tasks through the stack show (throttled fetches, the worker completing every task).

use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::backoff::Backoff;
use abada_agent_worker::devkit::engine::{
    self as emulator, EmulatorOptions, EngineEmulator, Fault, Operation, TaskSpec,
};
use abada_agent_worker::engine::client::{EngineClientSettings, HttpEngine};
use abada_agent_worker::engine::{Engine, FetchRequest};
use abada_agent_worker::metrics::Metrics;
use serde_json::Map;
use tokio::time::Instant;

/// The hang guard of a wait on the socket: real time, never a verdict.
const HANG_GUARD: std::time::Duration = std::time::Duration::from_secs(30);

/// Holds tokio's paused clock still while it lives: a blocking task that runs until dropped.
struct ClockHeld {
    release: std::sync::mpsc::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ClockHeld {
    fn new() -> ClockHeld {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let task = tokio::task::spawn_blocking(move || {
            let _ = held.recv();
        });
        ClockHeld { release, task }
    }

    async fn release(self) {
        let _ = self.release.send(());
        self.task.await.expect("the blocking task ends");
    }
}

/// Lets the runtime work (the socket, the emulator) until `done` holds, in real time, at most
/// [`HANG_GUARD`]; the paused clock does not move.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + HANG_GUARD;
    while !done() {
        assert!(
            std::time::Instant::now() < end,
            "{what}: not within {HANG_GUARD:?}"
        );
        tokio::task::yield_now().await;
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Lets the runtime work for `real` of real time (whatever was sent arrives meanwhile).
async fn settle(real: std::time::Duration) {
    let end = std::time::Instant::now() + real;
    while std::time::Instant::now() < end {
        tokio::task::yield_now().await;
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn completes(emu: &EngineEmulator, task: &str) -> Vec<emulator::CallRecord> {
    emu.calls()
        .into_iter()
        .filter(|c| c.operation == Operation::Complete && c.task_id.as_deref() == Some(task))
        .collect()
}

/// Whether the client has read a 429 answer to `complete` `n` times (it then sleeps at once,
/// in the same poll: the sleep starts at the instant the test sees).
fn throttled_read(metrics: &Metrics, n: u64) -> bool {
    metrics.encode().lines().any(|l| {
        l.starts_with("abada_agent_engine_request_duration_seconds_count{")
            && l.contains(r#"operation="complete""#)
            && l.contains(r#"status="429""#)
            && l.ends_with(&format!(" {n}"))
    })
}

/// A `complete` answered 429 with `Retry-After: 1` is sent again exactly one second later by the
/// paused clock, under the same `Idempotency-Key`: not a millisecond sooner (nothing goes out
/// at 999 ms, though the socket is given real time to carry it), not the backoff's own delays
/// (20 ms, nor the 5 s cap). One with `Retry-After: 30`, above the command backoff's cap (5 s),
/// waits the cap exactly (the client bounds every wait inside a lease: `min(Retry-After,
/// cap)`).
#[tokio::test(start_paused = true)]
async fn a_throttled_complete_is_sent_again_exactly_when_its_retry_after_says() {
    let held = ClockHeld::new();
    let emu = emulator::start(EmulatorOptions::default())
        .await
        .expect("emulator starts on a free loopback port");
    for _ in 0..2 {
        emu.create_task(TaskSpec::default());
    }
    let metrics = Arc::new(Metrics::new());
    let mut settings = EngineClientSettings::new(emu.base_url(), "w-paused");
    settings.command_backoff =
        Backoff::new(Duration::from_millis(20), Duration::from_secs(5)).without_jitter();
    let client = Arc::new(HttpEngine::new(
        reqwest::Client::new(),
        settings,
        None,
        metrics.clone(),
    ));
    let tasks = client
        .fetch_and_lock(&FetchRequest {
            topics: vec!["abada:agent".into()],
            lock_duration: Duration::from_secs(300),
            max_tasks: 2,
        })
        .await
        .expect("the fetch");
    assert_eq!(tasks.len(), 2);

    for (n, (task, retry_after, waits)) in [
        (&tasks[0], 1, Duration::from_secs(1)),
        (&tasks[1], 30, Duration::from_secs(5)),
    ]
    .into_iter()
    .enumerate()
    {
        let task = task.task_ref();
        emu.inject(Fault::Throttle {
            operation: Operation::Complete,
            count: 1,
            retry_after_secs: Some(retry_after),
        });
        let sent_at = Instant::now();
        let completing = tokio::spawn({
            let client = client.clone();
            let task = task.clone();
            async move {
                let result = client.complete(&task, &Map::new()).await;
                (result, Instant::now())
            }
        });
        until("the 429 read by the client", || {
            throttled_read(&metrics, n as u64 + 1)
        })
        .await;
        assert_eq!(completes(&emu, &task.task_id).len(), 1);

        // A millisecond short of the wait: nothing is sent, though the socket has time.
        tokio::time::advance(waits - Duration::from_millis(1)).await;
        settle(std::time::Duration::from_millis(300)).await;
        let sent = completes(&emu, &task.task_id);
        assert_eq!(
            sent.len(),
            1,
            "Retry-After: {retry_after}: complete sent again before {waits:?}: {sent:#?}"
        );
        assert!(!completing.is_finished());

        // The wait is over: sent again, accepted.
        tokio::time::advance(Duration::from_millis(1)).await;
        until("the complete sent again and answered", || {
            completing.is_finished()
        })
        .await;
        let (result, done_at) = completing.await.expect("the completing task");
        result.expect("the second complete is accepted");
        assert_eq!(
            done_at - sent_at,
            waits,
            "Retry-After: {retry_after}: the only time that passed is the wait"
        );
        let sent = completes(&emu, &task.task_id);
        assert_eq!(sent.len(), 2, "{sent:#?}");
        assert!(sent[0].idempotency_key.is_some());
        assert_eq!(
            sent[0].idempotency_key, sent[1].idempotency_key,
            "re-sent under its key"
        );
        assert_eq!((sent[0].status, sent[1].status), (429, 200));
    }
    emu.shutdown().await;
    held.release().await;
}
