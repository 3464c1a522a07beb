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
        }
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

    pub fn refuses_heartbeat(&self, task_id: &str) -> bool {
        self.refused_heartbeats.contains(task_id)
    }
}
