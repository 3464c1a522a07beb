//! Scenario `rate-limit`: the primary model answers 429 and the fallback model finishes the
//! task (a call does not wait for a busy model while a later one can take it); then the
//! provider is down (503, an outage: a busy limit alone is waited out inside the task), every
//! model is unavailable and the attempt is deferred without consuming a retry (a `failure`
//! with the task's retries unchanged and `retryTimeout` from Retry-After), and the task
//! completes once the provider recovers.
//!
//! The scripted model keys faults by model name, so the two providers serve the refund script
//! under two names, `refund-primary` (OpenAI wire format) and `refund-fallback` (Anthropic).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use super::timeline::{Output, Timeline};
use super::workers::{LabelNames, TaskOutcome, WorkerSpec, Workers};
use super::{
    Check, Crew, DemoError, DemoReport, model_calls_by_outcome, pump, pump_until, refund_task,
    start_stack,
};
use abada_devkit::engine::{TaskStatus, TaskView};
use abada_devkit::model::{Fault, FaultTimes};
use abada_devkit::stack::{Stack, refund_script};

const SCENARIO: &str = "rate-limit";
const LIMIT: Duration = Duration::from_secs(15);
const PRIMARY: &str = "refund-primary";
const FALLBACK: &str = "refund-fallback";
/// Long enough that the provider has recovered before the deferred task comes back, however
/// slowly the demo gets from the deferral to the recovery.
const RETRY_AFTER: Duration = Duration::from_secs(3);
const RETRIES: i32 = 3;

pub(super) async fn run(workers: &dyn Workers, output: Output) -> Result<DemoReport, DemoError> {
    let stack = start_stack(Duration::from_millis(100)).await?;
    let result = scenario(workers, &stack, output).await;
    stack.shutdown().await;
    result
}

/// `model: n outcome, m outcome` for the calls of one model.
fn calls_text(calls: &HashMap<(String, String), u64>, model: &str) -> String {
    let mut parts: Vec<String> = calls
        .iter()
        .filter(|((m, _), _)| m == model)
        .map(|((_, outcome), n)| format!("{n} {outcome}"))
        .collect();
    parts.sort();
    if parts.is_empty() {
        parts.push("no calls".into());
    }
    format!("{model}: {}", parts.join(", "))
}

fn count(calls: &HashMap<(String, String), u64>, model: &str, ok: bool) -> u64 {
    calls
        .iter()
        .filter(|((m, outcome), _)| m == model && (outcome == "ok") == ok)
        .map(|(_, n)| n)
        .sum()
}

fn diff(
    now: &HashMap<(String, String), u64>,
    before: &HashMap<(String, String), u64>,
) -> HashMap<(String, String), u64> {
    now.iter()
        .map(|(k, n)| (k.clone(), n - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

async fn wait_task(
    tl: &mut Timeline,
    crew: &mut Crew,
    stack: &Stack,
    id: &str,
    what: &str,
    check: impl Fn(&TaskView) -> bool + Send + 'static,
) -> Result<TaskView, DemoError> {
    let engine = stack.engine.clone();
    let id = id.to_string();
    pump(
        tl,
        crew,
        engine.wait_for(move |e| e.task(&id).filter(|v| check(v))),
        SCENARIO,
        what,
        LIMIT,
    )
    .await
}

/// Narrates until W1 has reported `n` attempts ended.
async fn worker_ended(tl: &mut Timeline, crew: &mut Crew, n: usize) -> Result<(), DemoError> {
    pump_until(
        tl,
        crew,
        |c| c.workers[0].ended.len() >= n,
        SCENARIO,
        "W1 to report the attempt's end",
        LIMIT,
    )
    .await
}

fn status_text(status: TaskStatus) -> String {
    serde_json::to_value(status)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{status:?}"))
}

fn retries_text(retries: Option<i32>) -> String {
    retries.map_or_else(|| "null".to_string(), |r| r.to_string())
}

async fn scenario(
    workers: &dyn Workers,
    stack: &Stack,
    output: Output,
) -> Result<DemoReport, DemoError> {
    let mut tl = Timeline::new(output);
    let latency = Duration::from_millis(100);
    stack
        .model
        .set_script(PRIMARY, refund_script().with_latency(latency));
    stack
        .model
        .set_script(FALLBACK, refund_script().with_latency(latency));
    let primary = format!("openai/{PRIMARY}");
    let fallback = format!("anthropic/{FALLBACK}");
    let agent = stack.refund_agent(&primary, &[fallback.as_str()]);
    stack.model.inject_fault(
        PRIMARY,
        Fault::RateLimited {
            retry_after: Some(RETRY_AFTER),
        },
        FaultTimes::Always,
    );
    tl.emit(
        "model",
        "rate_limited",
        format!(
            "{primary} answers 429 (Retry-After {}s) to every call; {fallback} is fine",
            RETRY_AFTER.as_secs()
        ),
        json!({"model": primary}),
    );
    // 1. The fallback finishes the task.
    let a = stack
        .engine
        .create_task(refund_task(agent.clone(), "o-501"));
    tl.emit(
        "engine",
        "task_open",
        format!("{a} OPEN: refund order o-501"),
        json!({"task": a}),
    );
    // Only an operator's names label metrics (the calls are counted by model): the worker's
    // agents file declares the agent and both models.
    let mut opts = WorkerSpec::new("W1", 2);
    opts.label_names = Some(LabelNames {
        agent: "refund-agent".into(),
        models: vec![primary.clone(), fallback.clone()],
        servers: Vec::new(),
    });
    let mut crew = Crew::new();
    crew.start(workers, stack, opts)?;
    tl.emit(
        "demo",
        "worker_started",
        format!("W1 starts; the agent's model is {primary}, fallbackModels [{fallback}]"),
        json!({"worker": "W1"}),
    );

    let a_view = wait_task(&mut tl, &mut crew, stack, &a, "task 1 to complete", |v| {
        super::is_final(v)
    })
    .await?;
    worker_ended(&mut tl, &mut crew, 1).await?;
    let phase1 = model_calls_by_outcome(&crew.workers[0].worker.metrics_text());
    tl.emit(
        "model",
        "calls",
        format!(
            "{}; {}",
            calls_text(&phase1, &primary),
            calls_text(&phase1, &fallback)
        ),
        json!({
            "primaryOk": count(&phase1, &primary, true),
            "primaryFailed": count(&phase1, &primary, false),
            "fallbackOk": count(&phase1, &fallback, true),
        }),
    );

    // 2. The provider down: every model unavailable, deferred, retries kept.
    stack.model.clear_faults(PRIMARY);
    for model in [PRIMARY, FALLBACK] {
        stack.model.inject_fault(
            model,
            Fault::Outage {
                retry_after: RETRY_AFTER,
            },
            FaultTimes::Always,
        );
    }
    tl.emit(
        "model",
        "down",
        format!(
            "the provider is down: {primary} and {fallback} answer 503 (Retry-After {}s), an outage: every model is unavailable",
            RETRY_AFTER.as_secs()
        ),
        json!({"models": [primary, fallback]}),
    );
    let b = stack.engine.create_task(refund_task(agent, "o-502"));
    tl.emit(
        "engine",
        "task_open",
        format!("{b} OPEN: refund order o-502, retries {RETRIES}"),
        json!({"task": b, "retries": RETRIES}),
    );
    let deferred = wait_task(
        &mut tl,
        &mut crew,
        stack,
        &b,
        "task 2 to be deferred",
        |v| v.counters.failures >= 1 || super::is_final(v),
    )
    .await?;
    let visible_in = deferred
        .lock_expiration_time
        .map(|at| (at - stack.engine.now()).num_milliseconds().max(0) as f64 / 1000.0);
    tl.emit(
        "engine",
        "deferred",
        format!(
            "{b} failure received: retries {} (unchanged), hidden {} for {:.1}s (retryTimeout from Retry-After): {}",
            retries_text(deferred.retries),
            if deferred.hidden { "yes" } else { "no" },
            visible_in.unwrap_or(0.0),
            deferred.error_message.as_deref().unwrap_or("")
        ),
        json!({
            "task": b,
            "retries": deferred.retries,
            "hidden": deferred.hidden,
            "visibleInSeconds": visible_in,
            "errorMessage": deferred.error_message,
        }),
    );
    worker_ended(&mut tl, &mut crew, 2).await?;
    let before_recovery = model_calls_by_outcome(&crew.workers[0].worker.metrics_text());

    // 3. The provider recovers; the task comes back after its retry timeout and completes.
    stack.model.clear_faults(PRIMARY);
    stack.model.clear_faults(FALLBACK);
    tl.emit(
        "model",
        "recovered",
        "the provider recovers: both models answer again",
        json!({}),
    );
    let b_view = wait_task(&mut tl, &mut crew, stack, &b, "task 2 to complete", |v| {
        super::is_final(v)
    })
    .await?;
    worker_ended(&mut tl, &mut crew, 3).await?;
    let after = model_calls_by_outcome(&crew.workers[0].worker.metrics_text());
    let phase3 = diff(&after, &before_recovery);
    tl.emit(
        "model",
        "calls",
        format!("after recovery: {}", calls_text(&phase3, &primary)),
        json!({"primaryOk": count(&phase3, &primary, true)}),
    );
    let workers = crew.stop().await;
    let ended = &workers[0].ended;

    // The verdict.
    let mut checks = Vec::new();
    let (p_ok, p_failed, f_ok) = (
        count(&phase1, &primary, true),
        count(&phase1, &primary, false),
        count(&phase1, &fallback, true),
    );
    checks.push(Check::new(
        "the fallback model finished task 1",
        a_view.status == TaskStatus::Completed && p_ok == 0 && p_failed >= 1 && f_ok == 3,
        format!(
            "{a} {}; {primary}: {p_ok} ok, {p_failed} refused; {fallback}: {f_ok} ok",
            status_text(a_view.status)
        ),
    ));
    let deferral_outcome = ended.iter().find(|(id, _, _)| *id == b).map(|(_, _, o)| *o);
    checks.push(Check::new(
        "every model unavailable: deferred without consuming a retry",
        deferral_outcome == Some(TaskOutcome::Deferred)
            && deferred.counters.failures == 1
            && deferred.retries == Some(RETRIES)
            && deferred.hidden,
        format!(
            "first attempt of {b} ended {}; retries {} after the failure (created with {RETRIES}); hidden {}",
            deferral_outcome.map_or("-", TaskOutcome::as_str),
            retries_text(deferred.retries),
            deferred.hidden
        ),
    ));
    let final_attempt = ended
        .iter()
        .rev()
        .find(|(id, _, _)| *id == b)
        .and_then(|(_, a, _)| *a);
    checks.push(Check::new(
        "completed once the provider recovered",
        b_view.status == TaskStatus::Completed
            && b_view.counters.completes == 1
            && b_view.counters.failures == 1
            && b_view.retries == Some(RETRIES)
            && final_attempt == Some(2),
        format!(
            "{b} {} on attempt {}, retries {}, {} failure",
            status_text(b_view.status),
            super::attempt_text(final_attempt),
            retries_text(b_view.retries),
            b_view.counters.failures
        ),
    ));
    let facts = json!({
        "task1": a,
        "task2": b,
        "primaryOk": p_ok,
        "primaryRefused": p_failed,
        "fallbackOk": f_ok,
        "retriesAfterDeferral": deferred.retries,
        "hiddenAfterDeferral": deferred.hidden,
        "failures": b_view.counters.failures,
        "completedAttempt": final_attempt,
        "retriesAtEnd": b_view.retries,
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
