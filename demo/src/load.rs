//! Scenario `load`: the worked example of the design. Twenty refund tasks arrive at once; two
//! workers of four slots claim 4 + 4; every completion frees a slot that the next poll fills.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use super::timeline::{Output, Timeline};
use super::workers::{LabelNames, TaskOutcome, WorkerEvent, WorkerSpec, Workers};
use super::{Check, Crew, DemoError, DemoReport, refund_task, start_stack, timeout_error};
use abada_devkit::engine::TaskStatus;
use abada_devkit::stack::{ORDERS_SERVER, Stack};

const SCENARIO: &str = "load";
const TASKS: usize = 20;
const SLOTS: u32 = 4;
const LIMIT: Duration = Duration::from_secs(25);
/// How long a task's end waits for its worker's refill fetch, to print both on one line.
const MERGE_WINDOW: Duration = Duration::from_millis(150);

/// A worker's lines not printed yet: ended tasks waiting for the refill, and a claim waiting
/// for its task ids.
#[derive(Default)]
struct Pending {
    ended: Vec<(String, TaskOutcome)>,
    /// Slots given back since the last line: a task's slot is free as its report goes out, so
    /// the worker may claim its next task before the report's answer ends the task.
    freed: u32,
    since: Option<Instant>,
    /// (asked, got, ids so far)
    claim: Option<(u32, usize, Vec<String>)>,
}

struct Board {
    /// Each worker's tasks holding a slot.
    running: HashMap<usize, u32>,
    /// Tasks whose slot was given back and that have not ended yet.
    freed_before_end: HashSet<String>,
    claimed_total: usize,
    ended_total: usize,
}

impl Board {
    fn totals(&self) -> (u32, usize) {
        let running: u32 = self.running.values().sum();
        (running, TASKS.saturating_sub(self.claimed_total))
    }
}

fn ids_text(ids: &[String]) -> String {
    ids.join(", ")
}

fn ended_text(ended: &[(String, TaskOutcome)]) -> String {
    let mut by_outcome: Vec<String> = Vec::new();
    for (id, outcome) in ended {
        let word = if *outcome == TaskOutcome::Completed {
            String::new()
        } else {
            format!(" ({outcome})")
        };
        by_outcome.push(format!("{id}{word}"));
    }
    let verb = if ended.iter().all(|(_, o)| *o == TaskOutcome::Completed) {
        "completed"
    } else {
        "ended"
    };
    format!("{} {verb}", by_outcome.join(", "))
}

pub(super) async fn run(workers: &dyn Workers, output: Output) -> Result<DemoReport, DemoError> {
    let stack = start_stack(Duration::from_millis(150)).await?;
    let result = scenario(workers, &stack, output).await;
    stack.shutdown().await;
    result
}

async fn scenario(
    workers: &dyn Workers,
    stack: &Stack,
    output: Output,
) -> Result<DemoReport, DemoError> {
    let mut tl = Timeline::new(output);
    let agent = stack.refund_agent("openai/refund", &[]);
    let ids = stack.engine.create_tasks(
        (1..=TASKS).map(|i| refund_task(agent.clone(), &format!("o-{:03}", 100 + i))),
    );
    tl.emit(
        "engine",
        "tasks_open",
        format!(
            "{TASKS} refund tasks OPEN ({}..{}): look up, refund (keyed write), answer in JSON",
            ids[0],
            ids[TASKS - 1]
        ),
        json!({"tasks": ids}),
    );
    // Only an operator's names label metrics (the keyed writes are counted by tool): the
    // workers' agents file declares the agent, its model and its tool server.
    let names = LabelNames {
        agent: "refund-agent".into(),
        models: vec!["openai/refund".into()],
        servers: vec![(ORDERS_SERVER.into(), stack.tools.url())],
    };
    let mut crew = Crew::new();
    for name in ["W1", "W2"] {
        let mut opts = WorkerSpec::new(name, SLOTS);
        opts.label_names = Some(names.clone());
        // Tasks take about a second; a 30s lease is extended only when a task is very slow
        // (a heartbeat racing `complete` would make the runner count a lost lease: see the
        // runner's report path).
        opts.lease = Duration::from_secs(30);
        opts.poll_interval = Duration::from_millis(200);
        crew.start(workers, stack, opts)?;
    }
    tl.emit(
        "demo",
        "workers_started",
        format!("W1 and W2 start, {SLOTS} slots each, lease 30s (extended every 10s)"),
        json!({"workers": ["W1", "W2"], "slots": SLOTS}),
    );

    let mut board = Board {
        running: HashMap::new(),
        freed_before_end: HashSet::new(),
        claimed_total: 0,
        ended_total: 0,
    };
    let mut pending: HashMap<usize, Pending> = HashMap::new();
    let deadline = Instant::now() + LIMIT;
    let engine = stack.engine.clone();
    let all_done = {
        let ids = ids.clone();
        async move {
            engine
                .wait_for(|e| {
                    ids.iter()
                        .all(|id| e.task(id).is_some_and(|v| super::is_final(&v)))
                        .then_some(())
                })
                .await
        }
    };
    tokio::pin!(all_done);
    let mut engine_done = false;
    loop {
        // Done when the engine saw every task end and every worker reported its ends.
        if engine_done && board.ended_total >= TASKS {
            break;
        }
        let next_flush = pending
            .values()
            .filter(|p| p.claim.is_none())
            .filter_map(|p| p.since)
            .min()
            .map(|s| s + MERGE_WINDOW);
        // Biased, in the order written: the workers' events, the engine's end, the flush of a
        // stale row, the timeout.
        tokio::select! {
            biased;
            Some((i, event)) = crew.rx.recv() => {
                crew.absorb(i, &event);
                on_event(&mut tl, &crew, &mut board, &mut pending, i, event);
            }
            _ = &mut all_done, if !engine_done => engine_done = true,
            _ = sleep_until_opt(next_flush) => flush_stale(&mut tl, &crew, &mut board, &mut pending),
            _ = tokio::time::sleep_until(deadline) => {
                return Err(timeout_error(SCENARIO, "all 20 tasks to end", LIMIT));
            }
        }
    }
    for i in 0..crew.workers.len() {
        flush(&mut tl, &crew, &mut board, &mut pending, i);
    }
    tl.emit(
        "engine",
        "all_completed",
        format!("all {TASKS} tasks COMPLETED"),
        json!({}),
    );
    let workers = crew.stop().await;
    let views = stack.engine.tasks();
    let counters = stack.tools.counters().await;

    let mut checks = Vec::new();
    let once = views
        .iter()
        .filter(|v| v.status == TaskStatus::Completed && v.counters.completes == 1)
        .count();
    checks.push(Check::new(
        "20 completed exactly once",
        once == TASKS && views.len() == TASKS,
        format!("{once} of {TASKS} tasks COMPLETED with one accepted complete each"),
    ));
    let most = workers
        .iter()
        .map(|w| w.stats.max_running)
        .max()
        .unwrap_or(0);
    checks.push(Check::new(
        "never more than 4 running per worker",
        most <= SLOTS && workers.iter().all(|w| w.stats.max_running <= SLOTS),
        format!(
            "most running at once: {}",
            workers
                .iter()
                .map(|w| format!("{} {}", w.name, w.stats.max_running))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ));
    let first: Vec<String> = workers
        .iter()
        .map(|w| match w.stats.first_fetch {
            Some((asked, got)) => format!("{} asked {asked} got {got}", w.name),
            None => format!("{} never fetched", w.name),
        })
        .collect();
    checks.push(Check::new(
        "first fetches ask for 4 each",
        workers
            .iter()
            .all(|w| w.stats.first_fetch.is_some_and(|(asked, _)| asked == SLOTS)),
        first.join(", "),
    ));
    let lost: u32 = workers.iter().map(|w| w.stats.leases_lost).sum();
    let reacquired = views
        .iter()
        .filter(|v| v.counters.acquisitions != 1)
        .count();
    checks.push(Check::new(
        "no lease lost",
        lost == 0 && reacquired == 0,
        format!("{lost} leases lost, {reacquired} tasks locked more than once"),
    ));
    checks.push(Check::new(
        "every keyed write applied once",
        counters.writes_applied == TASKS as u64
            && counters.duplicates == 0
            && counters.writes_unkeyed == 0,
        format!(
            "tool server: {} refunds applied, {} duplicates, {} without a key",
            counters.writes_applied, counters.duplicates, counters.writes_unkeyed
        ),
    ));
    let facts = json!({
        "tasks": TASKS,
        "completedOnce": once,
        "writesApplied": counters.writes_applied,
        "duplicates": counters.duplicates,
        "firstFetches": workers.iter().map(|w| json!({
            "worker": w.name,
            "requested": w.stats.first_fetch.map(|f| f.0),
            "got": w.stats.first_fetch.map(|f| f.1),
        })).collect::<Vec<_>>(),
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

fn on_event(
    tl: &mut Timeline,
    crew: &Crew,
    board: &mut Board,
    pending: &mut HashMap<usize, Pending>,
    i: usize,
    event: WorkerEvent,
) {
    match event {
        WorkerEvent::Fetched { requested, got } => {
            let p = pending.entry(i).or_default();
            if got == 0 && p.ended.is_empty() {
                // An empty poll with nothing to say.
                return;
            }
            p.claim = Some((requested, got, Vec::new()));
            if got == 0 {
                flush(tl, crew, board, pending, i);
            }
        }
        WorkerEvent::SlotFreed { task_id, .. } => {
            board.freed_before_end.insert(task_id);
            pending.entry(i).or_default().freed += 1;
        }
        WorkerEvent::TaskStarted { task_id, .. } => {
            let p = pending.entry(i).or_default();
            if let Some((_, got, ids)) = &mut p.claim {
                ids.push(task_id);
                if ids.len() >= *got {
                    flush(tl, crew, board, pending, i);
                }
            }
        }
        WorkerEvent::TaskEnded {
            task_id, outcome, ..
        } => {
            board.ended_total += 1;
            let p = pending.entry(i).or_default();
            if !board.freed_before_end.remove(&task_id) {
                p.freed += 1;
            }
            p.ended.push((task_id, outcome));
            p.since.get_or_insert_with(Instant::now);
        }
        WorkerEvent::FetchFailed { error } => {
            let name = crew.workers[i].name.clone();
            tl.emit(
                &name,
                "fetch_failed",
                format!("fetch failed: {error}"),
                json!({"error": error}),
            );
        }
        WorkerEvent::LeaseExtended | WorkerEvent::LeaseLost { .. } => {}
    }
}

/// Prints worker `i`'s pending line: its ended tasks and/or its claim.
fn flush(
    tl: &mut Timeline,
    crew: &Crew,
    board: &mut Board,
    pending: &mut HashMap<usize, Pending>,
    i: usize,
) {
    let Some(p) = pending.get_mut(&i) else {
        return;
    };
    if p.ended.is_empty() && p.claim.is_none() {
        return;
    }
    let name = crew.workers[i].name.clone();
    let ended = std::mem::take(&mut p.ended);
    let freed = std::mem::take(&mut p.freed);
    p.since = None;
    let claim = p.claim.take();
    // The board changes only when a line is printed, so the lines add up as read.
    let got = claim.as_ref().map_or(0, |c| c.1);
    let mine = board.running.entry(i).or_default();
    *mine = mine.saturating_sub(freed) + got as u32;
    board.claimed_total += got;
    let (running, waiting) = board.totals();
    let mine = board.running.get(&i).copied().unwrap_or(0);
    let state = format!("{name} {mine}/{SLOTS}; {running} running, {waiting} waiting");
    let mut parts = Vec::new();
    if !ended.is_empty() {
        parts.push(ended_text(&ended));
    }
    let claimed_ids = match &claim {
        Some((asked, got, ids)) if *got > 0 => {
            parts.push(format!("asks {asked}, claims {got} ({})", ids_text(ids)));
            ids.clone()
        }
        Some((asked, _, _)) => {
            parts.push(format!("asks {asked}, none left"));
            Vec::new()
        }
        None => Vec::new(),
    };
    let event = match (ended.is_empty(), claimed_ids.is_empty()) {
        (true, _) => "claimed",
        (false, true) => "ended",
        (false, false) => "ended_and_claimed",
    };
    tl.emit(
        &name,
        event,
        format!("{} -> {state}", parts.join(" -> ")),
        json!({
            "ended": ended.iter().map(|(id, o)| json!({"task": id, "outcome": o.as_str()})).collect::<Vec<_>>(),
            "claimed": claimed_ids,
            "workerRunning": mine,
            "running": running,
            "waiting": waiting,
        }),
    );
}

fn flush_stale(
    tl: &mut Timeline,
    crew: &Crew,
    board: &mut Board,
    pending: &mut HashMap<usize, Pending>,
) {
    let now = Instant::now();
    let stale: Vec<usize> = pending
        .iter()
        .filter(|(_, p)| p.since.is_some_and(|s| s + MERGE_WINDOW <= now) && p.claim.is_none())
        .map(|(i, _)| *i)
        .collect();
    for i in stale {
        flush(tl, crew, board, pending, i);
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
