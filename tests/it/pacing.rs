//! Pacing model calls, end to end: a real worker against the engine emulator and a scripted
//! provider that states hostile figures or refuses with a wait. No figure stops the worker
//! for longer than the model wait, a held model stops only its own calls (the other models'
//! tasks keep being fetched), and `/readyz` and `/metrics` say which model is held and why.

use std::net::SocketAddr;
use std::time::Duration;

use abada_agent_worker::admin::{self, AdminState};
use abada_agent_worker::devkit::engine::{Operation, TaskStatus};
use abada_agent_worker::devkit::model::{Fault, FaultTimes};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use tokio_util::sync::CancellationToken;

use crate::agent::{refund_like, spec, wait_all_ended};
use crate::faults::stack;

/// A worker of 4 slots whose calls wait at most `model_wait` for their model.
fn worker(
    s: &Stack,
    id: &str,
    model_wait: Duration,
) -> abada_agent_worker::devkit::workers::WorkerHandle {
    let mut opts = WorkerOptions::new(id, 4);
    opts.env.push((
        "ABADA_AGENT_MODEL_WAIT_MAX_MS".into(),
        model_wait.as_millis().to_string(),
    ));
    s.spawn_worker(opts, Stack::fast_agent_settings())
}

/// The figures that held a model for ever (and with it every fetch of the worker), each stated
/// on every 200 of one model: the worker still runs that model's tasks (each wait ends within
/// the model wait) and keeps fetching and running another model's tasks meanwhile, none of
/// them deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_figure_holds_its_model_briefly_and_never_the_other_models() {
    let cases: [(&str, &[(&str, &str)]); 3] = [
        (
            "Azure: no requests left, a reset in plain seconds",
            &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "6"),
            ],
        ),
        (
            "a limit of 0 and no reset",
            &[
                ("x-ratelimit-limit-requests", "0"),
                ("x-ratelimit-remaining-requests", "0"),
            ],
        ),
        (
            "retry-after on a 200 and an unreadable reset",
            &[
                ("retry-after", "3600"),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "NaN"),
            ],
        ),
    ];
    for (case, headers) in cases {
        let s = stack().await;
        s.model.set_script("gateway", refund_like());
        s.model.set_script("direct", refund_like());
        s.model.set_answer_headers("gateway", headers);
        let w = worker(&s, "w", Duration::from_secs(2));
        // The gateway's first task teaches the worker its figure.
        let first = s
            .engine
            .create_tasks([spec(s.refund_agent("openai/gateway", &[]), "g-0")]);
        let done = wait_all_ended(&s, &first, Duration::from_secs(30)).await;
        assert_eq!(done[0].status, TaskStatus::Completed, "{case}");
        // Then tasks of another model, and more of the gateway's, on the same topic.
        let mut specs: Vec<_> = (0..6)
            .map(|i| spec(s.refund_agent("openai/direct", &[]), &format!("d-{i}")))
            .collect();
        specs
            .extend((1..3).map(|i| spec(s.refund_agent("openai/gateway", &[]), &format!("g-{i}"))));
        let ids = s.engine.create_tasks(specs);
        let done = wait_all_ended(&s, &ids, Duration::from_secs(60)).await;
        assert!(
            done.iter().all(|v| v.status == TaskStatus::Completed),
            "{case}: {:?}",
            done.iter()
                .map(|v| (&v.status, &v.error_message))
                .collect::<Vec<_>>()
        );
        // The other model's tasks were never held up: not one deferral. (The gateway's own
        // tasks may be: after each of its calls it says no call may go for the whole model
        // wait, so its queue waits longer than a call may; deferred, they still complete.)
        let deferred: u32 = done[..6].iter().map(|v| v.counters.failures).sum();
        assert_eq!(deferred, 0, "{case}: the other model's tasks deferred");
        assert_eq!(
            s.model.calls("direct"),
            18,
            "{case}: three calls each, none refused"
        );
        // The poll loop waited, it did not spin: fetches stay in the tens.
        let fetches = s
            .engine
            .calls()
            .iter()
            .filter(|c| c.operation == Operation::FetchAndLock)
            .count();
        assert!(fetches < 500, "{case}: {fetches} fetches");
        w.stop().await;
    }
}

/// A 429 asking for a long wait holds its model: `/readyz` (still ready: the other models
/// work) names the model, the reason and how long, and `abada_agent_models_held` counts it,
/// on the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_and_the_metrics_say_which_model_is_held_and_why() {
    let s = stack().await;
    s.model.set_script("busy", refund_like());
    s.model.inject_fault(
        "busy",
        Fault::RateLimited {
            retry_after: Some(Duration::from_secs(40)),
        },
        FaultTimes::Next(1),
    );
    let w = worker(&s, "w", Duration::from_secs(60));
    let stop = CancellationToken::new();
    let addr: SocketAddr = admin::serve(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        AdminState {
            store: None,
            models: w.models.clone(),
            status: w.status.clone(),
            metrics: w.metrics.clone(),
            stall_limit: Duration::from_secs(60),
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let ids = s
        .engine
        .create_tasks([spec(s.refund_agent("openai/busy", &[]), "b-0")]);
    // The 429 came; the task waits inside for the 40 s it asked.
    tokio::time::timeout(Duration::from_secs(20), async {
        while s.model.calls("busy") == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the model was called");
    let http = reqwest::Client::new();
    let (status, body) = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let r = http
                .get(format!("http://{addr}/readyz"))
                .send()
                .await
                .unwrap();
            let status = r.status();
            let body = r.text().await.unwrap();
            if body.contains("openai/busy") {
                return (status, body);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("/readyz names the held model");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("rate_limited"), "{body}");
    assert!(body.contains("429"), "{body}");
    let held_for: u64 = body
        .split("for ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{body}"));
    assert!(held_for > 20_000 && held_for <= 40_000, "{body}");
    let metrics = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("abada_agent_models_held{provider=\"openai\",reason=\"rate_limited\"} 1"),
        "{metrics}"
    );
    let view = s.engine.task(&ids[0]).unwrap();
    assert_eq!(view.counters.failures, 0, "waiting inside, not deferred");
    stop.cancel();
    w.stop().await;
}
