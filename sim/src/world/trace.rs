//! The world's trace: every call the workers made and how the world answered, every runner
//! event, in order, stamped with the world's time. The simulator hashes it (the same seed must
//! give the same hash) and prints it for a replayed seed; the invariants read it.

use sha2::{Digest, Sha256};

/// What happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A worker started an engine call (`op` in the protocol's names).
    EngineCall {
        worker: String,
        op: &'static str,
        task: Option<String>,
        attempt: Option<u32>,
    },
    /// The world's answer to that call.
    EngineAnswer {
        worker: String,
        op: &'static str,
        task: Option<String>,
        attempt: Option<u32>,
        answer: Answer,
    },
    /// The answer just recorded ([`Event::EngineAnswer`], at the engine's execution) is late:
    /// it reaches the worker at its [`Event::Delivered`], or never (the worker gave up the call
    /// first). Every other answer reaches its worker 1 ms after its `EngineAnswer`.
    Late {
        worker: String,
        op: &'static str,
        task: Option<String>,
        attempt: Option<u32>,
    },
    /// A late answer the engine executed at `executed` reached the worker now.
    Delivered {
        worker: String,
        op: &'static str,
        task: Option<String>,
        attempt: Option<u32>,
        executed: u64,
    },
    /// A fetch's answer: the tasks and attempts handed to `worker`, of `asked`.
    Fetched {
        worker: String,
        asked: u32,
        tasks: Vec<(String, u32)>,
    },
    /// A worker started a run-store call (`claim`, `append`, `finish`) about run `run` for
    /// engine task `task` (a task's run is keyed by the task's id; a visit's run, which the
    /// tasks of one process visit share, by the instance and the node), with its fence's
    /// attempt (none for a claim) and `seq` (an append's step).
    StoreCall {
        worker: String,
        op: &'static str,
        run: String,
        task: String,
        attempt: Option<u64>,
        seq: Option<u64>,
    },
    /// The store's answer, as executed: `claimed` (with the attempt it handed out), `created`,
    /// `already-present`, `finished`, an error class (`fenced`, `refused`, ...), or an injected
    /// fault: `outage` (not executed), `answer-lost` (executed as the previous answer said, then
    /// the answer was lost).
    StoreAnswer {
        worker: String,
        op: &'static str,
        run: String,
        task: String,
        attempt: Option<u64>,
        seq: Option<u64>,
        answer: &'static str,
    },
    /// A model call: the provider name it went to (each its own quota and pacer), the task it
    /// was for (by its input), the turn, and the answer.
    ModelCall {
        worker: String,
        provider: &'static str,
        task: String,
        turn: usize,
        answer: &'static str,
    },
    /// A request to a model of the small window (`model::SMALL_WINDOW_PROVIDER`), as it came:
    /// its tokens by the world's count with the room for the answer, the window, and how many
    /// tool results it carried elided, keyed writes' among them.
    WindowRequest {
        worker: String,
        task: String,
        turn: usize,
        tokens: u64,
        window: u64,
        elided: usize,
        elided_writes: usize,
    },
    /// A tool call: the task it was for, the logical write (`n`) when it is one, the key it
    /// carried, and what the server did: `read`, `applied`, `deduplicated`, `5xx`,
    /// `applied-answer-lost`.
    ToolCall {
        worker: String,
        task: String,
        write: Option<u64>,
        key: Option<String>,
        answer: &'static str,
    },
    /// With a fetch's answer (`got` of `asked`): how many tasks of its topics waited unlocked
    /// at the engine when it answered (how deep the backlog was; rows another fetch's
    /// transaction held count: the contention an empty answer may hide).
    FetchBacklog {
        worker: String,
        asked: u32,
        got: usize,
        waiting: usize,
    },
    /// The runner of `worker` asked for `requested` tasks (its free slots) and got `got`.
    RunnerFetched {
        worker: String,
        requested: u32,
        got: usize,
    },
    /// The runner of `worker` started or ended a task (its own view).
    TaskStarted {
        worker: String,
        task: String,
        attempt: Option<u32>,
    },
    /// The task's work is done and its slot given back; its report goes out next.
    SlotFreed {
        worker: String,
        task: String,
        attempt: Option<u32>,
    },
    TaskEnded {
        worker: String,
        task: String,
        attempt: Option<u32>,
        outcome: String,
    },
    /// The schedule killed a worker (its tasks dropped at their current await) or started one.
    WorkerKilled {
        worker: String,
    },
    WorkerStarted {
        worker: String,
        slots: u32,
    },
    /// A person decided on an approval request of process `instance` (`approver`): the
    /// script's task and write (`n`, from the request's arguments), the request as the worker
    /// put it (requestId, callId, callDigest), the decision written into the decision variable
    /// (`None`: none), and the manner (`approve`, `forged-request`, ...).
    Decision {
        instance: String,
        task: String,
        write: Option<u64>,
        request_id: Option<String>,
        call_id: Option<String>,
        call_digest: Option<String>,
        written: Option<serde_json::Value>,
        manner: &'static str,
    },
    /// The reviewer sent the token of `instance` back to the agent node for a visit running
    /// script `again`, or (`None`) on to the end.
    Reviewed {
        instance: String,
        again: Option<String>,
    },
    /// The process author deployed `version` of the gated processes: instructions that
    /// perform no writes, their calls waiting for a person or not (`approval`).
    Redeployed {
        version: u32,
        approval: bool,
    },
    /// A sample of `worker`'s slots-in-use gauge (`abada_agent_slots_in_use`), as a run on the
    /// wire reads it from the worker's metrics (the simulator counts slots from the runner's
    /// events instead).
    SlotsInUse {
        worker: String,
        in_use: i64,
    },
    /// `worker` stopped and its last event was taken: every task it started has ended by now.
    WorkerStopped {
        worker: String,
    },
    /// The peak resident memory of `worker`'s process (a real binary's `VmHWM`), in KiB, and
    /// the bound it must stay under.
    PeakMemory {
        worker: String,
        kib: u64,
        bound_kib: u64,
    },
    /// A line logged by the workers (kept for the secret check, not hashed: its wording is not
    /// a behaviour).
    Log {
        line: String,
    },
}

/// How the world answered an engine call.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Executed and answered (a command the engine's rules make a no-op, such as a second
    /// `complete` of a completed task, is executed too).
    Ok,
    /// A repeat the engine answered without running anything: a request whose idempotency
    /// key ran before (answered from the engine's store), or a journal step already appended
    /// (answered 200 instead of 201).
    Replayed,
    /// Refused by the engine's rules: status, code and message (an `ENGINE_COMMAND_REJECTED`
    /// says the lease is gone only by its message).
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// An injected fault: `outage`, `5xx`, `409`, `refused`, `answer-lost` (executed, then the
    /// answer was lost).
    Fault(&'static str),
}

/// Every event with its time, in order.
#[derive(Debug, Default)]
pub struct Trace {
    pub events: Vec<(u64, Event)>,
}

impl Trace {
    pub fn push(&mut self, at: u64, event: Event) {
        self.events.push((at, event));
    }

    /// SHA-256 over every event, the workers' log lines, span fields and metrics included, as
    /// hex: the same seed gives the same hash, in any process (the workers' randomness is seeded
    /// from the seed: approval request ids, jitter).
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (at, e) in &self.events {
            h.update(format!("{at} {e:?}\n").as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The trace as text, one event a line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (at, e) in &self.events {
            out.push_str(&format!("{:>8}.{:03}s {e:?}\n", at / 1000, at % 1000));
        }
        out
    }
}
