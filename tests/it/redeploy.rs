//! A run's definition decides everything after its first step (design.md "Definitions from the
//! process model"): where its journal lives, whether it may stop for a person, the status it
//! writes. Each test changes something between two visits of the refund node, the way an
//! operator or a process author does, and checks the promises on the wire (the engine emulator
//! on plain v1, as the real engine 0.11, deploying versions as it does: an instance runs the
//! version it started on, the process API serves the latest) and in the run store (PostgreSQL):
//! an approved call is performed exactly once, or the task is an incident naming it; the
//! instance does not loop back to the person; no run is left open; a resume on the run's own
//! definition is no store refusal.
//!
//! The changes: a redeploy changing instructions, schema, tools, approval and limits at once
//! (the real engine's hole: version 2 no longer waits for a person while a version-1 instance
//! waits); a redeploy adding approval under a run that never stopped; the agents file and the
//! registry's approval changed across a restart; a tool server removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use abada_agent_worker::config;
use abada_agent_worker::devkit::engine::{InstanceStatus, ProcessModel, ProtocolLevel};
use abada_agent_worker::devkit::model::{Fault, FaultTimes};
use abada_agent_worker::devkit::stack::{
    REFUND_MODEL, Stack, StackWorkers, WorkerHandle, refund_script,
};
use abada_agent_worker::devkit::tools::{AcceptAny, ToolServer, ToolServerOptions};

use crate::approval::{
    decide, start_refund, store_worker, wait_for_approval, wait_incident, wait_instance,
};
use crate::bpmn::refund_bpmn;
use crate::store::TestDb;
use crate::support::scratch::ScratchDir;
use crate::support::wait::eventually;

/// A plain v1 stack (the real engine's protocol) with the run store, the refund model and two
/// anonymous tool servers the registry names `orders` and `billing`.
struct Setup {
    db: TestDb,
    stack: Stack,
    orders: ToolServer,
    billing: ToolServer,
    dir: ScratchDir,
}

async fn setup() -> Option<Setup> {
    let db = TestDb::create().await?;
    let stack = Stack::start(ProtocolLevel::PlainV1).await.unwrap();
    stack.model.set_script(REFUND_MODEL, refund_script());
    let server = async |name: &str| {
        ToolServer::start(ToolServerOptions::new(name, Arc::new(AcceptAny)).anonymous())
            .await
            .unwrap()
    };
    let orders = server("orders").await;
    let billing = server("billing").await;
    Some(Setup {
        db,
        stack,
        orders,
        billing,
        dir: ScratchDir::new("redeploy"),
    })
}

impl Setup {
    /// The registry: `orders` (with `orders_approval` when given) unless `without_orders`, and
    /// `billing`.
    fn registry(&self, orders_approval: Option<&str>, without_orders: bool) -> PathBuf {
        let mut text = format!(
            "[servers.billing]\nurl = \"{}\"\nauth = \"none\"\n",
            self.billing.url()
        );
        if !without_orders {
            text.push_str(&format!(
                "[servers.orders]\nurl = \"{}\"\nauth = \"none\"\n",
                self.orders.url()
            ));
            if let Some(approval) = orders_approval {
                text.push_str(&format!("approval = \"{approval}\"\n"));
            }
        }
        self.dir.write("tools.toml", &text)
    }

    /// A store worker with the registry `tools` and, when given, the agents file `agents`.
    fn worker(&self, id: &str, tools: &Path, agents: Option<&PathBuf>) -> WorkerHandle {
        let mut opts = store_worker(id, &self.db, Duration::from_secs(10));
        opts.env
            .push((config::ENV_TOOLS_FILE.into(), tools.display().to_string()));
        if let Some(agents) = agents {
            opts.env.push((
                "ABADA_AGENT_AGENTS_FILE".into(),
                agents.display().to_string(),
            ));
        }
        let mut settings = Stack::fast_agent_settings();
        // Every task reads the latest version: a redeploy is seen at once.
        settings.bpmn.latest_for = Duration::ZERO;
        self.stack.spawn_worker(opts, settings)
    }

    /// The approved write was performed exactly once, on `orders`, keyed; `billing` (version
    /// 2's server) was never called.
    async fn one_keyed_refund(&self) {
        let orders = self.orders.counters().await;
        assert_eq!(orders.writes_applied, 1, "{orders:?}");
        assert_eq!(orders.duplicates, 0, "{orders:?}");
        let keys = self.orders.keys_sent("issue_refund");
        assert!(keys.iter().all(Option::is_some), "{keys:?}");
        let billing = self.billing.counters().await;
        assert!(billing.calls_per_tool.is_empty(), "{billing:?}");
    }

    /// Nothing is left open in the store (the final finish is flushed by the idle worker).
    async fn no_run_left_open(&self) {
        eventually(Duration::from_secs(20), "no run left open", async || {
            self.db
                .count("SELECT count(*) FROM abada_agent_runs WHERE status = 'running'")
                .await
                == 0
        })
        .await;
    }

    async fn shutdown(self, workers: Vec<WorkerHandle>) {
        for w in workers {
            w.stop().await;
        }
        self.orders.shutdown().await;
        self.billing.shutdown().await;
        self.stack.shutdown().await;
        self.db.drop().await;
    }
}

/// Version 1 of the refund agent on the BPMN: `orders`, approval of writes.
fn v1() -> Vec<(&'static str, &'static str)> {
    vec![
        ("name", "refund-agent"),
        ("model", "openai/refund"),
        (
            "instructions",
            "Version 1: look the order up, refund it, answer with JSON.",
        ),
        ("input", "${orderId}"),
        ("toolServers", "orders"),
        ("maxTurns", "8"),
        ("resultVariable", "refundDecision"),
        ("approval", "writes"),
    ]
}

/// Version 2 changes everything a run could be held to: its instructions, its output schema
/// (which version 1's answer does not meet), its tool server, its approval (none) and its
/// limits (one turn, which version 1's run has spent).
fn v2() -> Vec<(&'static str, &'static str)> {
    vec![
        ("name", "refund-agent"),
        ("model", "openai/refund"),
        ("instructions", "Version 2: never refund, answer with JSON."),
        ("input", "${orderId}"),
        ("toolServers", "billing"),
        ("maxTurns", "1"),
        ("resultVariable", "refundDecision"),
        ("approval", "never"),
        ("outputSchema", r#"{"type":"object","required":["v2Only"]}"#),
    ]
}

/// The store errors a worker counted, by labels, that are not zero.
fn store_errors(worker: &WorkerHandle) -> Vec<String> {
    worker
        .metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("abada_agent_store_errors_total") && !l.ends_with(" 0"))
        .map(str::to_string)
        .collect()
}

/// The real engine's hole: version 2 of the process no longer lets the agent's calls wait for
/// a person (its tool servers changed) while a version-1 instance waits for approval. The
/// decision arrives on a new task: it resumes the version-1 run from the store, performs the
/// approved refund once, on version 1's server, and completes writing `agentStatus = done`,
/// so the instance ends instead of looping back to the person. Nothing of version 2 is used,
/// no run is left open, and the resume is no store refusal.
#[tokio::test]
async fn a_redeploy_that_no_longer_waits_leaves_a_waiting_run_on_its_own_definition() {
    let Some(s) = setup().await else {
        return;
    };
    let stack = &s.stack;
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), refund_bpmn(&v1()));
    let instance = start_refund(stack, "o-1");
    let worker = s.worker("w1", &s.registry(None, false), None);
    wait_for_approval(stack, &instance).await;
    assert_eq!(s.orders.counters().await.writes_applied, 0);

    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), refund_bpmn(&v2()));
    decide(stack, &instance, "dana", true, "fine").await;
    let done = wait_instance(stack, &instance, "the instance's end", |v| {
        v.status == InstanceStatus::Completed
    })
    .await;
    assert_eq!(done.variables["agentStatus"], "done");
    assert_eq!(done.variables["refundDecision"]["decision"], "refunded");
    s.one_keyed_refund().await;
    assert_eq!(
        stack.model.total_calls(),
        3,
        "lookup, refund, answer: nothing was asked again"
    );
    assert!(
        stack
            .model
            .requests()
            .iter()
            .all(|r| !r.body.to_string().contains("Version 2")),
        "version 2's instructions reached the model"
    );
    s.no_run_left_open().await;
    assert_eq!(store_errors(&worker), Vec::<String>::new());
    s.shutdown(vec![worker]).await;
}

/// The other way round: version 1 never stops, so its run is kept under its task; version 2,
/// deployed while the run is deferred (its model down), asks for approval of writes. The
/// redelivered task resumes its own run under its own key on version 1: it refunds without
/// stopping, and never begins a second conversation that would ask a person.
#[tokio::test]
async fn a_redelivered_run_keeps_its_home_when_a_redeploy_adds_approval() {
    let Some(s) = setup().await else {
        return;
    };
    let stack = &s.stack;
    let mut never = v1();
    never.retain(|(k, _)| *k != "approval");
    let mut writes = v1();
    writes.retain(|(k, _)| *k != "instructions");
    writes.push(("instructions", "Version 2: ask before refunding."));
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), refund_bpmn(&never));
    stack
        .model
        .inject_fault(REFUND_MODEL, Fault::ServiceUnavailable, FaultTimes::Always);
    let instance = start_refund(stack, "o-1");
    let worker = s.worker("w1", &s.registry(None, false), None);
    eventually(
        Duration::from_secs(30),
        "the run journals its input under its task and calls the model (which is down)",
        async || {
            // The worker creates the tables as it starts: none yet is no run yet.
            let runs: i64 =
                s.db.sql()
                    .await
                    .query_one(
                        "SELECT count(*) FROM abada_agent_runs WHERE run_key NOT LIKE 'process/%'",
                        &[],
                    )
                    .await
                    .map_or(0, |row| row.get(0));
            runs == 1 && stack.model.calls(REFUND_MODEL) >= 1
        },
    )
    .await;
    stack
        .engine
        .deploy_bpmn(ProcessModel::refund_approval(None), refund_bpmn(&writes));
    let before = stack.model.calls(REFUND_MODEL);
    eventually(
        Duration::from_secs(30),
        "the task is redelivered after the redeploy",
        async || stack.model.calls(REFUND_MODEL) > before,
    )
    .await;
    stack.model.clear_faults(REFUND_MODEL);
    let done = wait_instance(stack, &instance, "the instance's end", |v| {
        v.status == InstanceStatus::Completed
    })
    .await;
    assert_eq!(done.variables["refundDecision"]["decision"], "refunded");
    assert!(
        !done.variables.contains_key("agentApprovalRequest"),
        "nobody was asked: {:?}",
        done.variables
    );
    s.one_keyed_refund().await;
    assert_eq!(
        s.db.count("SELECT count(*) FROM abada_agent_runs WHERE run_key LIKE 'process/%'")
            .await,
        0,
        "no second conversation was begun under the visit"
    );
    assert_eq!(store_errors(&worker), Vec::<String>::new());
    s.no_run_left_open().await;
    s.shutdown(vec![worker]).await;
}

/// The agents file's entry for the node, `[agents.refundAgent]`, with `approval` and a line
/// of instructions.
fn agents_file(s: &Setup, approval: &str, version: &str, server: &str) -> PathBuf {
    s.dir.write(
        "agents.toml",
        &format!(
            r#"[agents.refundAgent]
name = "refund-agent"
model = "openai/refund"
instructions = "{version}: look the order up, refund it, answer with JSON."
input = "${{orderId}}"
toolServers = ["{server}"]
maxTurns = 8
resultVariable = "refundDecision"
approval = "{approval}"
"#
        ),
    )
}

/// The agents file changed across a restart while a run waits for approval: the new worker
/// resumes the run on the entry it started with (journaled with its input), performs the
/// approved write once and ends the instance.
#[tokio::test]
async fn an_agents_file_changed_across_a_restart_leaves_a_waiting_run_on_its_entry() {
    let Some(s) = setup().await else {
        return;
    };
    let stack = &s.stack;
    stack.engine.deploy(ProcessModel::refund_approval(None));
    let tools = s.registry(None, false);
    let first = agents_file(&s, "writes", "Version 1", "orders");
    let instance = start_refund(stack, "o-1");
    let worker = s.worker("w1", &tools, Some(&first));
    wait_for_approval(stack, &instance).await;
    worker.stop().await;

    let second = agents_file(&s, "never", "Version 2", "billing");
    let worker = s.worker("w2", &tools, Some(&second));
    decide(stack, &instance, "dana", true, "fine").await;
    let done = wait_instance(stack, &instance, "the instance's end", |v| {
        v.status == InstanceStatus::Completed
    })
    .await;
    assert_eq!(done.variables["agentStatus"], "done");
    s.one_keyed_refund().await;
    assert_eq!(stack.model.total_calls(), 3);
    s.no_run_left_open().await;
    assert_eq!(store_errors(&worker), Vec::<String>::new());
    s.shutdown(vec![worker]).await;
}

/// Only the registry asked for approval (the definition says never), and the operator lifts
/// it across a restart while two runs wait: each decision still decides its call. The
/// approved one is performed once; the refused one never (the model reads the refusal); both
/// instances end, `agentStatus` rewritten although no rule asks for approval any more.
#[tokio::test]
async fn a_registry_approval_lifted_across_a_restart_still_honours_each_decision() {
    let Some(s) = setup().await else {
        return;
    };
    let stack = &s.stack;
    stack.engine.deploy(ProcessModel::refund_approval(None));
    let agents = agents_file(&s, "never", "Version 1", "orders");
    let approved = start_refund(stack, "o-1");
    let refused = start_refund(stack, "o-2");
    let worker = s.worker("w1", &s.registry(Some("writes"), false), Some(&agents));
    wait_for_approval(stack, &approved).await;
    wait_for_approval(stack, &refused).await;
    worker.stop().await;

    let worker = s.worker("w2", &s.registry(None, false), Some(&agents));
    decide(stack, &approved, "dana", true, "fine").await;
    decide(stack, &refused, "dana", false, "not this one").await;
    for instance in [&approved, &refused] {
        let done = wait_instance(stack, instance, "the instance's end", |v| {
            v.status == InstanceStatus::Completed
        })
        .await;
        assert_eq!(done.variables["agentStatus"], "done", "{instance}");
    }
    let orders = s.orders.counters().await;
    assert_eq!(
        orders.writes_applied, 1,
        "only the approved refund: {orders:?}"
    );
    assert_eq!(orders.calls_per_tool.get("issue_refund"), Some(&1));
    s.no_run_left_open().await;
    s.shutdown(vec![worker]).await;
}

/// The tool server of a waiting run is gone from the registry after a restart (the agents file
/// moved the agent to another server): the approved call cannot be performed, and the task is
/// an incident that says so, naming the call, the server and the request; nothing is
/// performed anywhere and the instance stays at the node (no loop).
#[tokio::test]
async fn an_approved_call_whose_server_was_removed_is_an_incident_naming_it() {
    let Some(s) = setup().await else {
        return;
    };
    let stack = &s.stack;
    stack.engine.deploy(ProcessModel::refund_approval(None));
    let first = agents_file(&s, "writes", "Version 1", "orders");
    let instance = start_refund(stack, "o-1");
    let worker = s.worker("w1", &s.registry(None, false), Some(&first));
    let waiting = wait_for_approval(stack, &instance).await;
    let request_id = waiting.variables["agentApprovalRequest"]["requestId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    worker.stop().await;

    let second = agents_file(&s, "never", "Version 2", "billing");
    let worker = s.worker("w2", &s.registry(None, true), Some(&second));
    decide(stack, &instance, "dana", true, "fine").await;
    let failed = wait_incident(stack, &instance, "the incident").await;
    assert_eq!(failed.retries, Some(0));
    let text = format!(
        "{} {}",
        failed.error_message.clone().unwrap_or_default(),
        failed.error_details.clone().unwrap_or_default()
    );
    for needle in [
        "an approved call was not performed",
        "issue_refund",
        "\"orders\"",
        request_id.as_str(),
        "dana",
    ] {
        assert!(text.contains(needle), "{needle:?} missing: {text}");
    }
    assert_eq!(s.orders.counters().await.writes_applied, 0);
    assert!(s.billing.counters().await.calls_per_tool.is_empty());
    let view = stack.engine.process_instance(&instance).unwrap();
    assert_eq!(view.current_activity_id, "refundAgent", "no loop: {view:?}");
    assert!(!view.variables.contains_key("refundDecision"));
    s.shutdown(vec![worker]).await;
}
