//! The engine's activity history: one entry per event it records about a process instance, as
//! the real engine 0.11 writes them (`ActivityHistoryService.record`, called from `AbadaEngine`
//! and `ExternalTaskCommandService`), served by `GET /api/v1/process-instances/{id}/history`
//! (`CockpitController.getHistory`): pages of `size` (1..=100, default 50) entries sorted by
//! `occurredAt`, the engine's `X-Page`, `X-Page-Size`, `X-Total-Count` and `X-Total-Pages`
//! headers (`Pagination`), 404 "Process instance not found: X" for an unknown instance.
//!
//! Who the `actor` is (`ActivityHistoryService`: the request's identity, else `system`; the
//! identity is `IdentityContextInterceptor`'s): in the `disabled` security mode the `X-User`
//! header, else `anonymous`; in the `proxy` mode `X-Auth-Request-User` (else the email header);
//! in the `oidc` mode the token's `preferred_username`. The emulator takes it from its
//! authorizer ([`super::Authorizer::identity`]), else from `X-User`.
//!
//! The entries and their `details`, in the order the engine writes them:
//! - start: `PROCESS_STARTED` (the start event), then `TASK_CREATED` (`assignee`,
//!   `assignmentStrategy`) for each user task reached;
//! - fetch: `EXTERNAL_TASK_LOCKED` (`externalTaskId`, `workerId`, `topic`) per task locked;
//! - external task completed: `EVENT_CORRELATED` (its activity), `TASK_CREATED` for each user
//!   task reached, then `EXTERNAL_TASK_COMPLETED` (`externalTaskId`, `workerId`);
//! - failure: `EXTERNAL_TASK_FAILED` (`externalTaskId`, `retries`); lock extension:
//!   `EXTERNAL_TASK_LOCK_EXTENDED` (`externalTaskId`, `workerId`); retries set:
//!   `EXTERNAL_TASK_RETRIES_SET` (`externalTaskId`, `retries`);
//! - BPMN error: `VARIABLES_UPDATED` (`variableNames`) when it carries variables,
//!   `PROCESS_FAILED`, then `EXTERNAL_TASK_BPMN_ERROR` (`externalTaskId`, `errorCode`,
//!   `errorMessage`);
//! - user task: `TASK_CLAIMED` (`assignee`), `TASK_COMPLETED` (no details: the engine records
//!   nothing of the variables a completion writes) then `TASK_CREATED` for each user task
//!   reached;
//! - the variables API: `VARIABLES_UPDATED` (`variableNames`);
//! - suspension, cancellation, failure: `PROCESS_SUSPENDED` / `PROCESS_RESUMED`,
//!   `PROCESS_CANCELLED` (`reason`), `PROCESS_FAILED`;
//! - a timer (not emulated: the emulator has no timers): `EVENT_CORRELATED` by `system` at the
//!   catch event, then `TIMER_JOB_COMPLETED` (`jobId`), as seen on the engine
//!   (docs/REAL_ENGINE.md).
//!
//! Script tasks and gateway conditions run inside the engine's `advance` and record nothing.
//! Honest limits: `traceId` is always null; entries of one instance keep the order they were
//! written in (the engine breaks `occurredAt` ties by a random id); only instances started from
//! a deployed model have a history (the instance a task created through the admin API names
//! has none: the load harness creates hundreds of thousands).

use std::collections::HashMap;

use serde::Serialize;
use serde_json::{Map, Value};

/// The engine's largest page (`Pagination.MAX_PAGE_SIZE`) and its default.
pub(crate) const MAX_PAGE_SIZE: usize = 100;
pub(crate) const DEFAULT_PAGE_SIZE: usize = 50;

/// One entry, as the history endpoint answers it (the engine's `ActivityHistoryDto`).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    pub id: String,
    pub process_instance_id: String,
    pub process_definition_id: Option<String>,
    pub activity_id: Option<String>,
    pub event_type: String,
    pub actor: String,
    pub occurred_at: String,
    pub trace_id: Option<String>,
    pub details: Map<String, Value>,
}

/// One page of an instance's history, with the figures of the engine's paging headers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HistoryPage {
    pub entries: Vec<HistoryEntry>,
    pub total_count: usize,
    pub total_pages: usize,
}

/// Every instance's history.
#[derive(Debug, Default)]
pub(crate) struct History {
    by_instance: HashMap<String, Vec<HistoryEntry>>,
    next: u64,
}

/// What one entry says, before the history gives it an id and a time.
pub(crate) struct Event<'a> {
    pub instance: &'a str,
    pub definition: Option<&'a str>,
    pub event_type: &'a str,
    pub activity: Option<&'a str>,
    pub actor: &'a str,
    pub details: Value,
}

impl History {
    /// Records `event` at `now_ms` (emulator time).
    pub fn record(&mut self, event: Event<'_>, now_ms: i64) {
        self.next += 1;
        let entry = HistoryEntry {
            id: format!("h-{:08}", self.next),
            process_instance_id: event.instance.to_string(),
            process_definition_id: event.definition.map(str::to_string),
            activity_id: event.activity.map(str::to_string),
            event_type: event.event_type.to_string(),
            // The engine's column is NOT NULL: with no identity it writes `system`.
            actor: if event.actor.is_empty() {
                "system".to_string()
            } else {
                event.actor.to_string()
            },
            occurred_at: chrono::DateTime::from_timestamp_millis(now_ms)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            trace_id: None,
            details: match event.details {
                Value::Object(map) => map,
                _ => Map::new(),
            },
        };
        self.by_instance
            .entry(event.instance.to_string())
            .or_default()
            .push(entry);
    }

    /// Page `page` of `size` entries of `instance`'s history, oldest first; the caller checks
    /// that the instance exists and the paging parameters are in range.
    pub fn page(&self, instance: &str, page: usize, size: usize) -> HistoryPage {
        let all = self
            .by_instance
            .get(instance)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let size = size.clamp(1, MAX_PAGE_SIZE);
        HistoryPage {
            entries: all
                .iter()
                .skip(page.saturating_mul(size))
                .take(size)
                .cloned()
                .collect(),
            total_count: all.len(),
            total_pages: all.len().div_ceil(size),
        }
    }

    /// Every entry of `instance` (tests, the demo).
    pub fn of(&self, instance: &str) -> Vec<HistoryEntry> {
        self.by_instance.get(instance).cloned().unwrap_or_default()
    }
}
