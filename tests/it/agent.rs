//! The agent runtime end to end over real HTTP: emulator, scripted model (both wire formats),
//! the devkit MCP tool server, and the real runner; one test per outcome of protocol.md B.5.

use std::time::Duration;

use abada_agent_worker::devkit::engine::{ProtocolLevel, TaskSpec, TaskStatus, TaskView};
use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
use serde_json::{Map, Value, json};

pub fn spec(agent: Value, order: &str) -> TaskSpec {
    let mut variables = Map::new();
    variables.insert("orderId".into(), json!(order));
    TaskSpec {
        variables,
        agent: Some(agent),
        retries: Some(3),
        ..TaskSpec::default()
    }
}

/// A task's journal as one `kind/state` per step, to compare with an expected run.
pub fn step_kinds(view: &TaskView) -> Vec<String> {
    view.journal
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                s["kind"].as_str().unwrap_or("?"),
                s["state"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

/// The journal of a refund agent run to its end: the input, three model turns, a read-only
/// lookup, and the keyed refund (started, then finished).
pub const FULL_REFUND_RUN: [&str; 7] = [
    "input/finished",
    "model/finished",
    "tool/finished",
    "model/finished",
    "tool/started",
    "tool/finished",
    "model/finished",
];

pub async fn wait_all_ended(stack: &Stack, ids: &[String], limit: Duration) -> Vec<TaskView> {
    let ids = ids.to_vec();
    tokio::time::timeout(
        limit,
        stack.engine.wait_for(|e| {
            let views: Vec<TaskView> = ids.iter().filter_map(|id| e.task(id)).collect();
            views
                .iter()
                .all(|v| {
                    matches!(
                        v.status,
                        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::BpmnError
                    )
                })
                .then_some(views)
        }),
    )
    .await
    .expect("tasks did not end in time")
}

#[tokio::test]
async fn a_refund_agent_completes_through_both_wire_formats() {
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let ids = stack.engine.create_tasks([
        spec(stack.refund_agent("openai/refund", &[]), "o-1"),
        spec(stack.refund_agent("anthropic/refund", &[]), "o-2"),
    ]);
    let worker = stack.spawn_worker(WorkerOptions::new("w1", 4), Stack::fast_agent_settings());
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(20)).await;
    for (view, order) in views.iter().zip(["o-1", "o-2"]) {
        assert_eq!(view.status, TaskStatus::Completed, "{view:?}");
        let result = view.result_variables.as_ref().unwrap();
        assert_eq!(result["refundDecision"]["decision"], "refunded");
        assert_eq!(result["refundDecision"]["orderId"], order);
        assert_eq!(result["agentUsage"]["turns"], 3);
        assert_eq!(result["agentUsage"]["inputTokens"], 360);
        assert_eq!(step_kinds(view), FULL_REFUND_RUN);
        assert!(
            view.journal[2].get("key").is_none(),
            "a read-only call is not keyed"
        );
        let key = format!("abada:{}:5", view.id);
        assert_eq!(view.journal[4]["key"], key.as_str());
        assert_eq!(view.journal[5]["key"], key.as_str());
        assert_eq!(view.journal[4]["data"]["server"], "orders");
        assert_eq!(view.journal[4]["data"]["tool"], "issue_refund");
    }
    let counters = stack.tools.counters().await;
    assert_eq!(counters.writes_applied, 2);
    assert_eq!(counters.duplicates, 0);
    worker.stop().await;
    assert_eq!(stack.tools.counters().await.sessions_open, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn the_real_binary_runs_agents_and_drains_on_sigterm() {
    use crate::support::process::{WorkerProcess, stack_env};
    let stack = Stack::start(ProtocolLevel::AgentV1).await.unwrap();
    let ids = stack.engine.create_tasks(
        (0..3).map(|i| spec(stack.refund_agent("openai/refund", &[]), &format!("o-{i}"))),
    );
    let mut worker = WorkerProcess::spawn(&stack_env(&stack, "proc-1")).await;
    let views = wait_all_ended(&stack, &ids, Duration::from_secs(20)).await;
    assert!(views.iter().all(|v| v.status == TaskStatus::Completed));
    let (status, body) = worker.admin_get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    worker.signal("TERM");
    let exit = worker.wait(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit}");
    let logs = worker.stdout();
    assert!(
        logs.iter()
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "every line is JSON"
    );
    assert!(logs.iter().all(|l| l.contains("\"worker_id\":\"proc-1\"")));
    stack.shutdown().await;
}

mod outcomes {
    //! Every outcome of protocol.md B.5 through the real HTTP paths.

    use std::time::Duration;

    use abada_agent_worker::backoff::Backoff;
    use abada_agent_worker::devkit::engine::{Fault as EngineFault, TaskStatus, TaskView};
    use abada_agent_worker::devkit::model::{Fault, FaultTimes, Script, Turn};
    use abada_agent_worker::devkit::stack::{Stack, StackWorkers, WorkerOptions};
    use abada_agent_worker::handler::TaskEnd;
    use abada_agent_worker::runner::RunnerEvent;
    use serde_json::json;

    use super::{spec, wait_all_ended};
    use crate::support::wait::{eventually, recv_within};

    async fn stack() -> Stack {
        Stack::start(abada_agent_worker::devkit::engine::ProtocolLevel::AgentV1)
            .await
            .unwrap()
    }

    /// The task once its first failure has been reported.
    async fn first_failure(s: &Stack, id: &str) -> TaskView {
        tokio::time::timeout(
            Duration::from_secs(20),
            s.engine.wait_for(|e| {
                let t = e.task(id)?;
                (t.counters.failures == 1).then_some(t)
            }),
        )
        .await
        .expect("a failure reported within 20 s")
    }

    /// One refund task (order `order`) whose every model call takes `latency`.
    fn one_slow_refund(s: &Stack, latency: Duration, order: &str) -> Vec<String> {
        s.model.set_script(
            "slow",
            super::super::agent::refund_like().with_latency(latency),
        );
        s.engine
            .create_tasks([spec(s.refund_agent("openai/slow", &[]), order)])
    }

    /// Waits until the tool server has seen every MCP session closed (a session a task drops is
    /// closed in the background).
    async fn sessions_all_closed(s: &Stack) {
        eventually(
            Duration::from_secs(10),
            "every MCP session to be closed",
            async || s.tools.counters().await.sessions_open == 0,
        )
        .await;
    }

    fn looping() -> Script {
        Script::new(vec![Turn::call(
            "lookup_order",
            json!({"orderId": "${input}"}),
        )])
        .with_usage(1000, 200)
    }

    #[tokio::test]
    async fn max_turns_reached_is_an_incident_with_the_figures() {
        let s = stack().await;
        s.model.set_script("loop", looping());
        let mut agent = s.refund_agent("openai/loop", &[]);
        agent["maxTurns"] = json!(3);
        let ids = s.engine.create_tasks([spec(agent, "o-1")]);
        let w = s.spawn_worker(WorkerOptions::new("w", 2), Stack::fast_agent_settings());
        let v = &wait_all_ended(&s, &ids, Duration::from_secs(20)).await[0];
        assert_eq!(v.status, TaskStatus::Failed, "an incident");
        assert_eq!(v.retries, Some(0));
        let msg = v.error_message.clone().unwrap();
        assert!(msg.contains("maxTurns = 3 reached"), "{msg}");
        assert!(msg.contains("3000 tokens in"), "{msg}");
        assert_eq!(s.model.calls("loop"), 3);
        w.stop().await;
        assert_eq!(s.tools.counters().await.sessions_open, 0);
    }

    #[tokio::test]
    async fn a_spent_token_budget_is_an_incident_and_caps_each_call() {
        let s = stack().await;
        s.model.set_script("loop", looping());
        let mut agent = s.refund_agent("anthropic/loop", &[]);
        agent["tokenBudget"] = json!(2500);
        let ids = s.engine.create_tasks([spec(agent, "o-1")]);
        let w = s.spawn_worker(WorkerOptions::new("w", 2), Stack::fast_agent_settings());
        let v = &wait_all_ended(&s, &ids, Duration::from_secs(20)).await[0];
        assert_eq!(v.status, TaskStatus::Failed);
        let msg = v.error_message.clone().unwrap();
        // 1200 per call: after two calls 100 tokens are left, less than the third request's own
        // estimate, so it is not sent.
        assert!(
            msg.contains("tokenBudget = 2500 would be exceeded: 2400 tokens spent"),
            "{msg}"
        );
        // Each call's output cap is what the budget leaves after the request's estimate: under
        // 2500 and 1300, never the whole of either.
        let caps: Vec<u64> = s
            .model
            .requests()
            .iter()
            .filter(|r| r.model == "loop")
            .map(|r| r.body["max_tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(caps.len(), 2, "{caps:?}");
        assert!(caps[0] < 2500 && caps[0] > 2000, "{caps:?}");
        assert!(caps[1] < 1300 && caps[1] > 800, "{caps:?}");
        w.stop().await;
    }

    /// A provider allowing 2 requests/s and saying so in `x-ratelimit-*` headers,
    /// 429 beyond: the worker uses its limit without claiming tasks that cannot start, nor
    /// sending calls the limit refuses, nor deferring a task (a failure the engine records).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rate_limited_provider_is_used_to_its_limit_without_deferrals() {
        use abada_agent_worker::devkit::model::RateLimit;
        let s = stack().await;
        s.model
            .set_script("limited", super::super::agent::refund_like());
        s.model.set_rate_limit(
            "limited",
            RateLimit {
                per_second: 4.0,
                burst: 2,
            },
        );
        let agent = s.refund_agent("openai/limited", &[]);
        let ids = s
            .engine
            .create_tasks((0..12).map(|i| spec(agent.clone(), &format!("o-{i}"))));
        let w = s.spawn_worker(WorkerOptions::new("w", 8), Stack::fast_agent_settings());
        let done = wait_all_ended(&s, &ids, Duration::from_secs(60)).await;
        assert!(done.iter().all(|v| v.status == TaskStatus::Completed));
        let deferred: u32 = done.iter().map(|v| v.counters.failures).sum();
        assert_eq!(deferred, 0, "no task deferred");
        let claims: u32 = done.iter().map(|v| v.counters.acquisitions).sum();
        assert_eq!(claims, 12, "no claim given back");
        let used = s.model.rate_limit_use("limited").unwrap();
        let calls_per_task = s.model.calls("limited") as f64 / 12.0;
        assert!(
            used.refused as f64 <= 0.1 * (used.admitted + used.refused) as f64,
            "429s under 10 % of requests: {used:?} ({calls_per_task} calls per task)"
        );
        w.stop().await;
    }

    #[tokio::test]
    async fn a_tool_server_down_is_a_technical_failure_that_consumes_one_retry() {
        let s = stack().await;
        s.tools.set_down(true);
        let ids = s
            .engine
            .create_tasks([spec(s.refund_agent("openai/refund", &[]), "o-1")]);
        let w = s.spawn_worker(WorkerOptions::new("w", 2), Stack::fast_agent_settings());
        let v = first_failure(&s, &ids[0]).await;
        assert_eq!(v.retries, Some(2), "one retry consumed");
        assert!(v.hidden, "an exponential retryTimeout hides it");
        assert!(v.error_message.unwrap().contains("orders"));
        w.stop().await;
        s.tools.set_down(false);
        assert_eq!(s.tools.counters().await.sessions_open, 0);
    }

    #[tokio::test]
    async fn malformed_model_output_after_retries_is_technical() {
        let s = stack().await;
        s.model
            .set_script("garbled", super::super::agent::refund_like());
        s.model
            .inject_fault("garbled", Fault::MalformedBody, FaultTimes::Always);
        let ids = s
            .engine
            .create_tasks([spec(s.refund_agent("openai/garbled", &[]), "o-1")]);
        // A long retryTimeout: no second attempt adds calls before they are counted.
        let mut settings = Stack::fast_agent_settings();
        settings.technical_retry =
            Backoff::new(Duration::from_secs(60), Duration::from_secs(600)).without_jitter();
        let w = s.spawn_worker(WorkerOptions::new("w", 2), settings);
        let v = first_failure(&s, &ids[0]).await;
        assert_eq!(v.retries, Some(2));
        assert_eq!(s.model.calls("garbled"), 3, "one call and two retries");
        w.stop().await;
    }

    #[tokio::test]
    async fn definition_errors_and_hard_model_errors_are_incidents() {
        let s = stack().await;
        let mut missing_var = s.refund_agent("openai/refund", &[]);
        missing_var["input"] = json!("Customer ${customerId}");
        let unknown_provider = s.refund_agent("mistral/large", &[]);
        let unscripted = s.refund_agent("openai/no-such-model", &[]);
        let ids = s.engine.create_tasks([
            spec(missing_var, "o-1"),
            spec(unknown_provider, "o-2"),
            spec(unscripted, "o-3"),
        ]);
        let w = s.spawn_worker(WorkerOptions::new("w", 4), Stack::fast_agent_settings());
        let views = wait_all_ended(&s, &ids, Duration::from_secs(20)).await;
        for v in &views {
            assert_eq!(v.status, TaskStatus::Failed, "{v:?}");
            assert_eq!(v.retries, Some(0));
        }
        assert!(
            views[0]
                .error_message
                .as_ref()
                .unwrap()
                .contains("no variable \"customerId\"")
        );
        assert!(
            views[1]
                .error_message
                .as_ref()
                .unwrap()
                .contains("\"mistral\", which is not configured")
        );
        assert!(
            views[2]
                .error_message
                .as_ref()
                .unwrap()
                .contains("rejected the request")
        );
        w.stop().await;
    }

    #[tokio::test]
    async fn fifty_tasks_at_once_never_see_each_others_words_credentials_or_usage() {
        let s = stack().await;
        let ids = s.engine.create_tasks((0..50).map(|i| {
            spec(
                s.refund_agent("openai/refund", &[]),
                &format!("secret-word-{i:02}x"),
            )
        }));
        let mut opts = WorkerOptions::new("w", 50);
        opts.lock_duration = Duration::from_secs(30);
        let w = s.spawn_worker(opts, Stack::fast_agent_settings());
        let views = wait_all_ended(&s, &ids, Duration::from_secs(60)).await;
        for v in &views {
            assert_eq!(v.status, TaskStatus::Completed);
            let usage = &v.result_variables.as_ref().unwrap()["agentUsage"];
            assert_eq!(usage["inputTokens"], 360, "usage is per task");
            assert_eq!(usage["turns"], 3);
        }
        // Every model request mentions exactly one task's words.
        for r in s.model.requests() {
            let body = r.body.to_string();
            let hits: Vec<String> = (0..50)
                .map(|i| format!("secret-word-{i:02}x"))
                .filter(|w| body.contains(w.as_str()))
                .collect();
            assert_eq!(hits.len(), 1, "a request mixes tasks: {hits:?}");
        }
        // Each credential is used by exactly one task's calls, and no two tasks share one.
        let mut by_token: std::collections::HashMap<String, std::collections::HashSet<String>> =
            Default::default();
        for c in s.tools.calls() {
            let order = c.arguments["orderId"].as_str().unwrap().to_string();
            by_token
                .entry(c.token.clone().unwrap())
                .or_default()
                .insert(order);
        }
        assert!(by_token.values().all(|orders| orders.len() == 1));
        assert_eq!(by_token.len(), 50, "one credential per task");
        w.stop().await;
        assert_eq!(s.tools.counters().await.sessions_open, 0);
    }

    /// A task cut by shutdown while its MCP session is open: the runner drops it, and its
    /// session is closed (with the task's credential, still valid) before the lease is given
    /// back. A real server refuses a close whose credential died with the lease, and the
    /// session stays open there. The tool server takes longer over the close than the task has
    /// to stop (`stop_wait`, 500 ms) and less than the close timeout (5 s): the task's own
    /// close is cut by the abort, and a close left running in the background would still be
    /// under way when the worker has stopped. Once it has, no session is open and no close was
    /// refused, with no waiting.
    #[tokio::test]
    async fn a_task_cut_by_shutdown_closes_its_sessions_before_giving_the_lease_back() {
        let s = stack().await;
        let ids = one_slow_refund(&s, Duration::from_secs(120), "cut");
        let mut opts = WorkerOptions::new("w", 1);
        opts.shutdown_grace = Duration::from_millis(100);
        let w = s.spawn_worker(opts, Stack::fast_agent_settings());
        // The tools are listed before the first model call, which then hangs.
        eventually(
            Duration::from_secs(30),
            "the task's MCP session to be open",
            async || s.tools.counters().await.sessions_open == 1,
        )
        .await;
        s.tools.set_close_latency(Duration::from_millis(1500));
        w.stop().await;
        let c = s.tools.counters().await;
        assert_eq!((c.sessions_open, c.unauthorized), (0, 0), "{c:?}");
        assert_eq!(c.sessions_closed, 1, "{c:?}");
        let t = s.engine.task(&ids[0]).unwrap();
        assert_ne!(t.status, TaskStatus::Locked, "the lease was given back");
    }

    /// The wire half of a mixed run (its logic, every ending and every session set released,
    /// is held on the paused clock by `paused_agent::no_tool_session_outlives_a_mixed_run`):
    /// with the devkit MCP server, every real rmcp session is closed on the server once the
    /// worker has stopped, whatever the task's ending: completed, an incident, a lost lease, cut
    /// by the shutdown. No timing race: the lost and cut tasks' model calls hang (120 s), so the
    /// first heartbeat always meets a lost one mid call and a cut one is always still
    /// running at the stop; every wait is a hang guard. The lease is 9 s: the first heartbeat (3 s)
    /// ends the lost ones soon, and the cut ones keep theirs on a starved process (a heartbeat
    /// may be 5 s late).
    #[tokio::test]
    async fn no_mcp_session_outlives_a_mixed_run() {
        let s = stack().await;
        s.model.set_script("loop", looping());
        s.model.set_script(
            "slow",
            super::super::agent::refund_like().with_latency(Duration::from_secs(120)),
        );
        let mut capped = s.refund_agent("openai/loop", &[]);
        capped["maxTurns"] = json!(2);
        let mut specs = vec![];
        for i in 0..6 {
            specs.push(spec(
                s.refund_agent("openai/refund", &[]),
                &format!("ok-{i}"),
            ));
        }
        specs.push(spec(capped, "capped"));
        for kind in ["lost", "cut"] {
            for i in 0..3 {
                specs.push(spec(
                    s.refund_agent("openai/slow", &[]),
                    &format!("{kind}-{i}"),
                ));
            }
        }
        let ids = s.engine.create_tasks(specs);
        for id in &ids[7..10] {
            s.engine.inject(EngineFault::RefuseHeartbeats {
                task_id: id.clone(),
            });
        }
        let mut opts = WorkerOptions::new("w", 16);
        opts.lock_duration = Duration::from_secs(9);
        opts.shutdown_grace = Duration::from_millis(100);
        let mut w = s.spawn_worker(opts, Stack::fast_agent_settings());
        // Successes and the incident end; the lost leases end at their first heartbeat.
        let views = wait_all_ended(&s, &ids[..7], Duration::from_secs(30)).await;
        assert!(views[..6].iter().all(|v| v.status == TaskStatus::Completed));
        assert_eq!(views[6].status, TaskStatus::Failed, "{:?}", views[6]);
        let mut lost = std::collections::HashSet::new();
        while !ids[7..10].iter().all(|id| lost.contains(id)) {
            if let RunnerEvent::TaskEnded {
                task_id,
                outcome: TaskEnd::LeaseLost,
                ..
            } = recv_within(
                &mut w.events,
                Duration::from_secs(30),
                "the lost leases' end",
            )
            .await
            {
                lost.insert(task_id);
            }
        }
        // The cut tasks are still in their first model call (it hangs): the stop cuts them.
        for id in &ids[10..] {
            let t = s.engine.task(id).unwrap();
            assert_eq!(
                (t.status, t.counters.failures),
                (TaskStatus::Locked, 0),
                "{t:?}"
            );
        }
        w.stop().await;
        for id in &ids[10..] {
            let t = s.engine.task(id).unwrap();
            assert_eq!(t.counters.failures, 1, "released at the stop: {t:?}");
        }
        sessions_all_closed(&s).await;
        let c = s.tools.counters().await;
        assert!(c.sessions_opened >= 13, "{c:?}");
        assert_eq!((c.sessions_open, c.unauthorized), (0, 0), "{c:?}");
        // Nothing it still owned is left locked to the worker that stopped (the emulator keeps
        // the lost ones locked to it until their lease runs out: it refused their heartbeats).
        for t in s
            .engine
            .tasks()
            .into_iter()
            .filter(|t| !ids[7..10].contains(&t.id))
        {
            assert!(
                !(t.status == TaskStatus::Locked && t.worker_id.as_deref() == Some("w")),
                "{} still locked to the stopped worker",
                t.id
            );
        }
    }
}

/// The refund script under another model name.
pub fn refund_like() -> abada_agent_worker::devkit::model::Script {
    abada_agent_worker::devkit::stack::refund_script()
}
