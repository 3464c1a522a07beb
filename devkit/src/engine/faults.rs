//! Fault injection: what the emulator does wrong on purpose, so tests can see how a worker
//! behaves when the engine is slow, failing, or loses its answers.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Deserialize;

use super::state::Operation;

/// A fault to inject. Over HTTP: `POST /admin/faults` with e.g.
/// `{"kind": "dropResponse", "operation": "complete", "count": 1}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "kind",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Fault {
    /// Every call of `operation` waits `delay_ms` before it is handled (until cleared).
    Latency { operation: Operation, delay_ms: u64 },
    /// The next `count` calls of `operation` answer `status` (default 500, `INTERNAL_ERROR`)
    /// without executing.
    ServerError {
        operation: Operation,
        count: u32,
        #[serde(default)]
        status: Option<u16>,
    },
    /// The next `count` calls of `operation` execute (and commit), then the connection is closed
    /// without a response: the client sees a connection error.
    DropResponse { operation: Operation, count: u32 },
    /// The next `count` successful fetch-and-lock responses lack `X-Abada-Worker-Protocol-Version`.
    OmitProtocolHeader { count: u32 },
    /// Heartbeats and lock extensions of this task are refused with 403 `WORKER_LOCK_NOT_OWNED`
    /// (until cleared), as if another worker had taken it.
    RefuseHeartbeats { task_id: String },
    /// The next `count` calls of `operation` answer 409 `CONCURRENT_MODIFICATION` without executing.
    ConcurrentModification { operation: Operation, count: u32 },
    /// The next `count` calls of `operation` answer 429 `TOO_MANY_REQUESTS` with
    /// `Retry-After: <retry_after_secs>` (header left out when absent) without executing.
    Throttle {
        operation: Operation,
        count: u32,
        #[serde(default)]
        retry_after_secs: Option<u64>,
    },
    /// The next `count` calls of `operation` answer 200 with a body that is not the protocol's
    /// (see [`BadBody`]) without executing; a fetch still carries the protocol header, so the
    /// client's decoder is what meets the body.
    BadBody {
        operation: Operation,
        count: u32,
        body: BadBody,
    },
    /// The next `count` calls of `operation` have their connection closed before the command
    /// runs (nothing committed), unlike [`Fault::DropResponse`], which runs it first.
    ResetConnection { operation: Operation, count: u32 },
    /// The next `count` calls of `operation` about `task_id` are refused with 400
    /// `ENGINE_COMMAND_REJECTED` and `message`, without executing: a rule of the process the
    /// emulator has no model of, e.g. the engine's "No matching condition and no default flow
    /// for gateway {id}" when the completed variables route nowhere.
    Reject {
        operation: Operation,
        task_id: String,
        count: u32,
        message: String,
    },
}

/// What a [`Fault::BadBody`] answer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum BadBody {
    /// An HTML page, `text/html`, as from a proxy in front of the engine.
    NotJson,
    /// Valid JSON of the wrong shape: `{"unexpected": true}`, `application/json`.
    WrongJson,
}

impl BadBody {
    /// The content type and body of the answer.
    pub fn content(self) -> (&'static str, &'static str) {
        match self {
            BadBody::NotJson => (
                "text/html",
                "<html><body><h1>502 Bad Gateway</h1></body></html>",
            ),
            BadBody::WrongJson => ("application/json", r#"{"unexpected": true}"#),
        }
    }
}

/// An injected answer decided before the command runs, other than the error bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EarlyAnswer {
    Reset,
    Throttle { retry_after_secs: Option<u64> },
    BadBody(BadBody),
}

/// The faults in force. Outage is kept here too: while it is on, every `/api` request has its
/// connection closed without a response (the engine is "gone"); `/admin` keeps working.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    latency: HashMap<Operation, Duration>,
    server_errors: HashMap<Operation, (u32, u16)>,
    drops: HashMap<Operation, u32>,
    conflicts: HashMap<Operation, u32>,
    omit_header: u32,
    refused_heartbeats: HashSet<String>,
    throttles: HashMap<Operation, (u32, Option<u64>)>,
    bad_bodies: HashMap<Operation, (u32, BadBody)>,
    resets: HashMap<Operation, u32>,
    rejections: HashMap<(Operation, String), (u32, String)>,
    pub outage: bool,
}

fn take(counts: &mut HashMap<Operation, u32>, operation: Operation) -> bool {
    match counts.get_mut(&operation) {
        Some(n) if *n > 0 => {
            *n -= 1;
            true
        }
        _ => false,
    }
}

impl Faults {
    pub fn add(&mut self, fault: Fault) {
        match fault {
            Fault::Latency {
                operation,
                delay_ms,
            } => {
                self.latency
                    .insert(operation, Duration::from_millis(delay_ms));
            }
            Fault::ServerError {
                operation,
                count,
                status,
            } => {
                let status = status.filter(|s| (500..600).contains(s)).unwrap_or(500);
                self.server_errors.insert(operation, (count, status));
            }
            Fault::DropResponse { operation, count } => {
                self.drops.insert(operation, count);
            }
            Fault::OmitProtocolHeader { count } => self.omit_header = count,
            Fault::RefuseHeartbeats { task_id } => {
                self.refused_heartbeats.insert(task_id);
            }
            Fault::ConcurrentModification { operation, count } => {
                self.conflicts.insert(operation, count);
            }
            Fault::Throttle {
                operation,
                count,
                retry_after_secs,
            } => {
                self.throttles.insert(operation, (count, retry_after_secs));
            }
            Fault::BadBody {
                operation,
                count,
                body,
            } => {
                self.bad_bodies.insert(operation, (count, body));
            }
            Fault::ResetConnection { operation, count } => {
                self.resets.insert(operation, count);
            }
            Fault::Reject {
                operation,
                task_id,
                count,
                message,
            } => {
                self.rejections
                    .insert((operation, task_id), (count, message));
            }
        }
    }

    /// Consumes one injected early answer for `operation`: a reset first, then a throttle,
    /// then a bad body.
    pub(crate) fn take_early_answer(&mut self, operation: Operation) -> Option<EarlyAnswer> {
        if take(&mut self.resets, operation) {
            return Some(EarlyAnswer::Reset);
        }
        if let Some((n, retry_after_secs)) = self.throttles.get_mut(&operation)
            && *n > 0
        {
            *n -= 1;
            return Some(EarlyAnswer::Throttle {
                retry_after_secs: *retry_after_secs,
            });
        }
        if let Some((n, body)) = self.bad_bodies.get_mut(&operation)
            && *n > 0
        {
            *n -= 1;
            return Some(EarlyAnswer::BadBody(*body));
        }
        None
    }

    pub fn latency(&self, operation: Operation) -> Option<Duration> {
        self.latency.get(&operation).copied()
    }

    /// Consumes one injected server error for `operation`, returning its status.
    pub fn take_server_error(&mut self, operation: Operation) -> Option<u16> {
        match self.server_errors.get_mut(&operation) {
            Some((n, status)) if *n > 0 => {
                *n -= 1;
                Some(*status)
            }
            _ => None,
        }
    }

    pub fn take_drop(&mut self, operation: Operation) -> bool {
        take(&mut self.drops, operation)
    }

    pub fn take_conflict(&mut self, operation: Operation) -> bool {
        take(&mut self.conflicts, operation)
    }

    pub fn take_omit_header(&mut self) -> bool {
        if self.omit_header > 0 {
            self.omit_header -= 1;
            true
        } else {
            false
        }
    }

    /// Consumes one injected rejection of `operation` on `task_id`, returning its message.
    pub fn take_rejection(&mut self, operation: Operation, task_id: &str) -> Option<String> {
        match self.rejections.get_mut(&(operation, task_id.to_string())) {
            Some((n, message)) if *n > 0 => {
                *n -= 1;
                Some(message.clone())
            }
            _ => None,
        }
    }

    pub fn refuses_heartbeat(&self, task_id: &str) -> bool {
        self.refused_heartbeats.contains(task_id)
    }
}
