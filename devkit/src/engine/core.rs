//! The emulator's engine without HTTP: the same state machine ([`super::state`]) and the same
//! body parsing as the HTTP layer, driven by plain calls with "now" given by the caller. The
//! worker's deterministic simulator runs its in-memory engine on this, so the simulated engine
//! and the HTTP emulator cannot disagree on a rule (ownership, fencing, idempotency, the
//! journal's sequence, the process instance's moves).
//!
//! What the HTTP layer adds and this has not: authentication, injected faults (the simulator
//! injects its own), the call log and the lease-time formatting of answers. Fetch contention
//! (module `contention`) is the state's, so it is here too; only the wait for a fetch's
//! transaction before its answer is the caller's (the HTTP layer sleeps it).

use serde_json::Value;

use super::ProtocolLevel;
use super::contention::FetchContention;
use super::http::parse_command_body;
use super::process::{
    Caller, ProcessDefinitionView, ProcessInstanceView, ProcessModel, UserTaskStatus, UserTaskView,
};
use super::state::{Disposition, EngineState, Operation, TaskSpec, TaskView};

/// Who calls an engine without HTTP: no identity, as a request without `X-User` to an engine
/// whose security is disabled (the history's `actor`).
const ANONYMOUS: &str = "anonymous";

/// An engine's refusal, as the HTTP layer would send it: status, error code and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreRefusal {
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl CoreRefusal {
    /// The refusal as the JSON error body the engine sends (`{code, message}`).
    pub fn body(&self) -> Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }
}

/// A successful answer: status and optional JSON body.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreReply {
    pub status: u16,
    pub body: Option<Value>,
    /// Answered from the idempotency store: the first request with the same key ran, this one
    /// ran nothing.
    pub replayed: bool,
}

/// The in-process engine: one state, no clock of its own, no I/O.
pub struct EngineCore {
    state: EngineState,
    protocol: ProtocolLevel,
    /// The latest "now" a call gave (the time of history entries of calls without one).
    now_ms: i64,
}

impl EngineCore {
    /// An engine speaking `protocol`; tool credentials live `credential_ttl_ms`; no call log.
    pub fn new(protocol: ProtocolLevel, credential_ttl_ms: i64) -> Self {
        EngineCore {
            state: EngineState::new(protocol, credential_ttl_ms, 0),
            protocol,
            now_ms: 0,
        }
    }

    pub fn create_task(&mut self, spec: TaskSpec) -> String {
        self.state.create_task(spec)
    }

    pub fn task(&self, id: &str) -> Option<TaskView> {
        self.state.task_view(id)
    }

    pub fn tasks(&self) -> Vec<TaskView> {
        self.state.task_views()
    }

    /// Replaces the journal of task `id` with `steps`, as earlier attempts (of a previous
    /// release, say) would have written them; false when there is no such task.
    pub fn seed_journal(&mut self, id: &str, steps: Vec<serde_json::Value>) -> bool {
        self.state.seed_journal(id, steps)
    }

    /// Makes fetches contend as on the real engine (module `contention`): the rows a fetch
    /// locks stay locked for [`FetchContention::transaction`] after its `now_ms`, and other
    /// fetches meanwhile skip them. The HTTP layer answers a fetch when its transaction ends;
    /// a caller of [`EngineCore::call`] should hand the answer on as late, so that its worker
    /// cannot fetch again inside its own transaction. `None`: each fetch runs alone.
    pub fn set_fetch_contention(&mut self, contention: Option<FetchContention>) {
        self.state.set_fetch_contention(contention);
    }

    /// How fetches contend now.
    pub fn fetch_contention(&self) -> Option<FetchContention> {
        self.state.fetch_contention()
    }

    /// Deploys `model` (its next version), as the engine's deployment does.
    pub fn deploy(&mut self, model: ProcessModel) {
        self.state.deploy(model, None);
    }

    /// Starts an instance of a deployed process: its token runs to its first waiting node.
    pub fn start_process(
        &mut self,
        process_id: &str,
        variables: serde_json::Map<String, Value>,
    ) -> Result<String, String> {
        self.state
            .start_process(process_id, variables, ANONYMOUS, self.now_ms)
    }

    /// Deploys `model` (its next version) with the BPMN XML the process API serves for it, as
    /// [`super::EngineEmulator::deploy_bpmn`] does.
    pub fn deploy_bpmn(&mut self, model: ProcessModel, bpmn_xml: String) {
        self.state.deploy(model, Some(bpmn_xml));
    }

    pub fn process_instance(&self, id: &str) -> Option<ProcessInstanceView> {
        self.state.process_instance(id)
    }

    /// `GET /api/v1/processes/{id}`: the latest deployed version of a process, with its XML.
    pub fn process_definition(&self, id: &str) -> Option<ProcessDefinitionView> {
        self.state.process_definition(id)
    }

    /// The open user tasks `user` of `groups` may see, with their instance's variables.
    pub fn open_user_tasks(&self, user: &str, groups: &[String]) -> Vec<UserTaskView> {
        let caller = Caller {
            user: user.to_string(),
            groups: groups.to_vec(),
        };
        let mut open = self
            .state
            .user_tasks(&caller, Some(UserTaskStatus::Available));
        open.extend(
            self.state
                .user_tasks(&caller, Some(UserTaskStatus::Claimed)),
        );
        open
    }

    /// Completes user task `id` as `user` of `groups` (the engine's rules: eligibility, the
    /// variables merged, the token moved on).
    pub fn complete_user_task(
        &mut self,
        id: &str,
        user: &str,
        groups: &[String],
        variables: serde_json::Map<String, Value>,
    ) -> Result<(), String> {
        let caller = Caller {
            user: user.to_string(),
            groups: groups.to_vec(),
        };
        self.state
            .complete_user_task(id, &caller, variables, self.now_ms)
    }

    /// One request of the worker protocol: `body` as the worker would send it, `key` its
    /// `Idempotency-Key`, `now_ms` the engine's clock. The endpoints this protocol level lacks
    /// answer 404 as over HTTP.
    pub fn call(
        &mut self,
        op: Operation,
        task_id: Option<&str>,
        key: Option<&str>,
        body: Value,
        now_ms: i64,
    ) -> Result<CoreReply, CoreRefusal> {
        let available = match op {
            Operation::JournalRead | Operation::JournalAppend => {
                self.protocol == ProtocolLevel::AgentV1
            }
            Operation::ToolCredentials => self.protocol != ProtocolLevel::PlainV1,
            _ => true,
        };
        let refusal = |e: super::wire::ApiError| CoreRefusal {
            status: e.status.as_u16(),
            code: e.code.to_string(),
            message: e.message,
        };
        if !available {
            return Err(refusal(super::wire::ApiError::not_found_resource()));
        }
        let command = parse_command_body(op, Some(body), false).map_err(refusal)?;
        self.now_ms = self.now_ms.max(now_ms);
        match self
            .state
            .run(op, task_id, key, &command, now_ms, ANONYMOUS)
        {
            Ok((reply, disposition)) => Ok(CoreReply {
                status: reply.status.as_u16(),
                body: reply.body,
                replayed: disposition == Disposition::Replayed,
            }),
            Err(e) => Err(refusal(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stale_attempt_is_fenced_and_a_complete_is_accepted_once() {
        let mut core = EngineCore::new(ProtocolLevel::AgentV1, 60_000);
        let id = core.create_task(TaskSpec::default());
        let fetch = json!({"workerId": "w1", "topics": ["abada:agent"], "lockDuration": 1000, "maxTasks": 1});
        let got = core
            .call(Operation::FetchAndLock, None, None, fetch.clone(), 0)
            .unwrap();
        assert_eq!(got.body.unwrap()[0]["attempt"], 1);
        // Expired at 1001: another worker takes attempt 2.
        let again = json!({"workerId": "w2", "topics": ["abada:agent"], "lockDuration": 1000, "maxTasks": 1});
        let got = core
            .call(Operation::FetchAndLock, None, None, again, 1001)
            .unwrap();
        assert_eq!(got.body.unwrap()[0]["attempt"], 2);
        let append = json!({"workerId": "w1", "attempt": 1, "step": {"seq": 1, "kind": "input", "state": "ok"}});
        let refused = core
            .call(Operation::JournalAppend, Some(&id), None, append, 1002)
            .unwrap_err();
        assert_eq!(
            (refused.status, refused.code.as_str()),
            (403, "WORKER_LOCK_NOT_OWNED")
        );
        let stale = json!({"workerId": "w2", "attempt": 1, "variables": {}});
        let refused = core
            .call(Operation::Complete, Some(&id), None, stale, 1003)
            .unwrap_err();
        assert_eq!(
            (refused.status, refused.code.as_str()),
            (409, "STALE_ATTEMPT")
        );
        let ok = json!({"workerId": "w2", "attempt": 2, "variables": {"x": 1}});
        core.call(Operation::Complete, Some(&id), None, ok, 1004)
            .unwrap();
        assert_eq!(core.task(&id).unwrap().counters.completes, 1);
    }
}
