//! Every Prometheus metric of the worker, defined in one place (names, help, labels, buckets),
//! and the text encoding served on `/metrics`.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::handler::TaskEnd;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: TaskEnd,
}

/// A task's ending as a label value: its one spelling, [`TaskEnd::as_str`].
impl EncodeLabelValue for TaskEnd {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineRequestLabels {
    pub operation: &'static str,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub provider: String,
    pub model: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelTokenLabels {
    pub provider: String,
    pub model: String,
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub server: String,
    pub tool: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreOperationLabel {
    pub operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreErrorLabels {
    pub operation: &'static str,
    pub class: &'static str,
}

fn store_histogram() -> Histogram {
    // 0.1 ms .. ~6.5 s: a store transaction on a LAN takes about a millisecond.
    Histogram::new(exponential_buckets(0.0001, 2.0, 17))
}

fn latency_histogram() -> Histogram {
    // 1 ms .. ~65 s
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

fn duration_histogram() -> Histogram {
    // 10 ms .. ~1.4 h
    Histogram::new(exponential_buckets(0.01, 2.5, 14))
}

/// The worker's metrics. Cheap to update from any task (atomics); shared behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    pub slots_in_use: Gauge,
    pub slots_total: Gauge,
    pub fetches: Family<ResultLabel, Counter>,
    pub fetch_duration: Histogram,
    pub tasks_claimed: Counter,
    pub tasks_ended: Family<OutcomeLabel, Counter>,
    pub task_duration: Family<OutcomeLabel, Histogram, fn() -> Histogram>,
    pub pickup_latency: Histogram,
    pub leases_extended: Counter,
    pub leases_lost: Family<ReasonLabel, Counter>,
    pub engine_request_duration: Family<EngineRequestLabels, Histogram, fn() -> Histogram>,
    pub model_calls: Family<ModelLabels, Counter>,
    pub model_call_duration: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub model_tokens: Family<ModelTokenLabels, Counter>,
    pub tool_calls: Family<ToolLabels, Counter>,
    pub backoff_seconds: Gauge<f64, AtomicU64>,
    pub store_transaction_duration: Family<StoreOperationLabel, Histogram, fn() -> Histogram>,
    pub store_pool_wait: Histogram,
    pub store_pool_in_use: Gauge,
    pub store_pool_open: Gauge,
    pub store_pool_max: Gauge,
    pub store_errors: Family<StoreErrorLabels, Counter>,
    pub store_runs_deleted: Family<ReasonLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            slots_in_use: Gauge::default(),
            slots_total: Gauge::default(),
            fetches: Family::default(),
            fetch_duration: latency_histogram(),
            tasks_claimed: Counter::default(),
            tasks_ended: Family::default(),
            task_duration: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            pickup_latency: latency_histogram(),
            leases_extended: Counter::default(),
            leases_lost: Family::default(),
            engine_request_duration: Family::new_with_constructor(
                latency_histogram as fn() -> Histogram,
            ),
            model_calls: Family::default(),
            model_call_duration: Family::new_with_constructor(
                latency_histogram as fn() -> Histogram,
            ),
            model_tokens: Family::default(),
            tool_calls: Family::default(),
            backoff_seconds: Gauge::default(),
            store_transaction_duration: Family::new_with_constructor(
                store_histogram as fn() -> Histogram,
            ),
            store_pool_wait: store_histogram(),
            store_pool_in_use: Gauge::default(),
            store_pool_open: Gauge::default(),
            store_pool_max: Gauge::default(),
            store_errors: Family::default(),
            store_runs_deleted: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "abada_agent_slots_in_use",
            "Slots running a task now",
            m.slots_in_use.clone(),
        );
        registry.register(
            "abada_agent_slots",
            "Slots of this worker (ABADA_AGENT_MAX_TASKS)",
            m.slots_total.clone(),
        );
        registry.register(
            "abada_agent_fetches",
            "fetch-and-lock requests by result (tasks, empty, error)",
            m.fetches.clone(),
        );
        registry.register(
            "abada_agent_fetch_duration_seconds",
            "Latency of fetch-and-lock requests",
            m.fetch_duration.clone(),
        );
        registry.register(
            "abada_agent_tasks_claimed",
            "Tasks locked by this worker",
            m.tasks_claimed.clone(),
        );
        registry.register(
            "abada_agent_tasks_ended",
            "Tasks ended by outcome (completed, bpmn_error, failed, deferred, incident, released, lease_lost)",
            m.tasks_ended.clone(),
        );
        registry.register(
            "abada_agent_task_duration_seconds",
            "Time from task start to its end, by outcome",
            m.task_duration.clone(),
        );
        registry.register(
            "abada_agent_pickup_latency_seconds",
            "Time from the fetch that locked a task to the task's start",
            m.pickup_latency.clone(),
        );
        registry.register(
            "abada_agent_leases_extended",
            "Lease extensions the engine accepted",
            m.leases_extended.clone(),
        );
        registry.register(
            "abada_agent_leases_lost",
            "Leases lost, by reason",
            m.leases_lost.clone(),
        );
        registry.register(
            "abada_agent_engine_request_duration_seconds",
            "Engine request latency by operation and HTTP status (or error)",
            m.engine_request_duration.clone(),
        );
        registry.register(
            "abada_agent_model_calls",
            "Model calls by provider, model and outcome",
            m.model_calls.clone(),
        );
        registry.register(
            "abada_agent_model_call_duration_seconds",
            "Model call latency by provider, model and outcome",
            m.model_call_duration.clone(),
        );
        registry.register(
            "abada_agent_model_tokens",
            "Model tokens by provider, model and direction (input, output)",
            m.model_tokens.clone(),
        );
        registry.register(
            "abada_agent_tool_calls",
            "Tool calls by server, tool and outcome",
            m.tool_calls.clone(),
        );
        registry.register(
            "abada_agent_backoff_seconds",
            "Current wait of the poll loop's error backoff (0 when healthy)",
            m.backoff_seconds.clone(),
        );
        registry.register(
            "abada_agent_store_transaction_duration_seconds",
            "Run-store transaction duration by operation (claim, append, finish, sweep), without the wait for a connection",
            m.store_transaction_duration.clone(),
        );
        registry.register(
            "abada_agent_store_pool_wait_seconds",
            "Wait for a run-store connection (opening one included)",
            m.store_pool_wait.clone(),
        );
        registry.register(
            "abada_agent_store_pool_connections_in_use",
            "Run-store connections checked out now",
            m.store_pool_in_use.clone(),
        );
        registry.register(
            "abada_agent_store_pool_connections_open",
            "Run-store connections open now (in use or idle)",
            m.store_pool_open.clone(),
        );
        registry.register(
            "abada_agent_store_pool_connections_max",
            "Run-store pool size (ABADA_AGENT_STORE_POOL_SIZE)",
            m.store_pool_max.clone(),
        );
        registry.register(
            "abada_agent_store_errors",
            "Run-store errors by operation and class (transient, fenced, conflict, misconfigured, invalid, internal)",
            m.store_errors.clone(),
        );
        registry.register(
            "abada_agent_store_runs_deleted",
            "Runs deleted by the run-store sweeper, by reason (finished, abandoned)",
            m.store_runs_deleted.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub fn observe_store_transaction(&self, operation: &'static str, took: Duration) {
        self.store_transaction_duration
            .get_or_create(&StoreOperationLabel { operation })
            .observe(took.as_secs_f64());
    }

    pub fn count_store_error(&self, operation: &'static str, class: &'static str) {
        self.store_errors
            .get_or_create(&StoreErrorLabels { operation, class })
            .inc();
    }

    pub fn count_store_runs_deleted(&self, reason: &'static str, runs: u64) {
        if runs > 0 {
            self.store_runs_deleted
                .get_or_create(&ReasonLabel { reason })
                .inc_by(runs);
        }
    }

    pub fn observe_engine_request(&self, operation: &'static str, status: String, took: Duration) {
        self.engine_request_duration
            .get_or_create(&EngineRequestLabels { operation, status })
            .observe(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_endings_are_labelled_with_their_one_spelling() {
        let m = Metrics::new();
        for end in TaskEnd::ALL {
            m.tasks_ended
                .get_or_create(&OutcomeLabel { outcome: end })
                .inc();
        }
        let text = m.encode();
        for end in TaskEnd::ALL {
            let line = format!(
                "abada_agent_tasks_ended_total{{outcome=\"{}\"}} 1",
                end.as_str()
            );
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }
}
