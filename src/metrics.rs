//! Every Prometheus metric of the worker, defined in one place (names, help, labels, buckets),
//! and the text encoding served on `/metrics`. Agent, model and tool label values come from
//! [`labels::DeclaredNames`] only: the names the operator's files declare, each label capped.

pub mod labels;

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::task_end::TaskEnd;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
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

/// Structured output (`agent::output`): the agent's name (capped, as for its tokens) and why a
/// final answer was rejected (`truncated`, `not_json`, `too_large`, `schema`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutputLabels {
    pub agent: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EngineRequestLabels {
    pub operation: &'static str,
    pub status: String,
}

/// Provider and model values from [`labels::DeclaredNames::model`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub provider: String,
    pub model: String,
    pub outcome: &'static str,
}

/// Provider and model values from [`labels::DeclaredNames::model`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelTokenLabels {
    /// The agent definition's name: with the model, what an agent costs.
    pub agent: String,
    pub provider: String,
    pub model: String,
    pub direction: &'static str,
}

/// Server and tool values from [`labels::DeclaredNames::tool`].
/// `gen_ai.client.token.usage`'s attributes (GenAI semantic conventions v1.41.0), in their
/// Prometheus spelling.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct GenAiTokenLabels {
    pub gen_ai_operation_name: &'static str,
    pub gen_ai_provider_name: String,
    pub gen_ai_request_model: String,
    /// `input` or `output`.
    pub gen_ai_token_type: &'static str,
}

/// `gen_ai.client.operation.duration`'s attributes; `error_type` is empty (so absent) for a
/// call that succeeded.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct GenAiDurationLabels {
    pub gen_ai_operation_name: &'static str,
    pub gen_ai_provider_name: String,
    pub gen_ai_request_model: String,
    pub error_type: String,
}

/// A configured provider's name (a closed set, the operator's) and why its models are held.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HeldLabels {
    pub provider: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelRefLabels {
    pub provider: String,
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub server: String,
    pub tool: String,
    pub outcome: &'static str,
}

/// What happened to a tool call that needs a person's approval.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApprovalLabel {
    /// `requested` (the task stopped to ask), `requested_again` (a task carried no decision: the
    /// same request asked again), `approved` or `refused` (a decision journaled), `unusable` (a
    /// decision on another request, a consumed one, another call or other content: an incident,
    /// nothing performed).
    pub event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StoreOperationLabel {
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

/// `gen_ai.client.token.usage`'s bucket boundaries, as the conventions advise: 1, 4, 16, ...
/// 67108864 tokens.
fn genai_token_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 4.0, 14))
}

/// `gen_ai.client.operation.duration`'s bucket boundaries, as the conventions advise: 0.01,
/// 0.02, 0.04, ... 81.92 s.
fn genai_duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 14))
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
    pub(crate) fetch_duration: Histogram,
    pub(crate) tasks_claimed: Counter,
    pub(crate) tasks_ended: Family<OutcomeLabel, Counter>,
    pub(crate) task_duration: Family<OutcomeLabel, Histogram, fn() -> Histogram>,
    pub(crate) pickup_latency: Histogram,
    pub(crate) leases_extended: Counter,
    pub leases_lost: Family<ReasonLabel, Counter>,
    pub(crate) engine_request_duration: Family<EngineRequestLabels, Histogram, fn() -> Histogram>,
    pub model_calls: Family<ModelLabels, Counter>,
    pub(crate) model_call_duration: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub(crate) model_tokens: Family<ModelTokenLabels, Counter>,
    pub(crate) model_fallback_calls: Family<ModelRefLabels, Counter>,
    /// A model's circuit opened: unavailable for every task of the worker.
    pub(crate) model_circuit_opened: Family<ModelRefLabels, Counter>,
    /// Calls a model may start now by its provider's stated rate limit, as of its last call;
    /// a model whose provider states none has no series.
    pub(crate) model_capacity: Family<ModelRefLabels, Gauge>,
    /// How long each model call waited for its model's capacity before it went out.
    pub(crate) model_capacity_wait: Family<ModelRefLabels, Histogram, fn() -> Histogram>,
    /// Models held now (a 429 with retry-after, a 503, a stated budget at zero), by provider
    /// and reason; set when scraped.
    pub(crate) models_held: Family<HeldLabels, Gauge>,
    pub tool_calls: Family<ToolLabels, Counter>,
    /// Approval stops and decisions; a label per event only: agents and tools are on the
    /// journal and the logs, and the stops of one agent are few.
    pub approvals: Family<ApprovalLabel, Counter>,
    /// Final answers sent back to the model for a repair turn (off-schema, cut).
    pub(crate) output_repairs: Family<OutputLabels, Counter>,
    /// Final answers still rejected with no repair turn left: the task became an incident.
    pub(crate) output_failures: Family<OutputLabels, Counter>,
    /// Answers sent back to the model as malformed (a tool call written as text, an empty
    /// answer, a repeated call: `agent::answer_shape`).
    pub(crate) answer_repairs: Family<OutputLabels, Counter>,
    /// Malformed answers with no repair turn left: the task became an incident.
    pub(crate) answer_failures: Family<OutputLabels, Counter>,
    /// What a tolerant parse accepted (`_TOOL_CALLS_IN_TEXT=parse`).
    pub(crate) tolerated_answers: Family<OutputLabels, Counter>,
    pub(crate) backoff_seconds: Gauge<f64, AtomicU64>,
    pub(crate) store_transaction_duration:
        Family<StoreOperationLabel, Histogram, fn() -> Histogram>,
    pub(crate) store_pool_wait: Histogram,
    pub store_pool_in_use: Gauge,
    pub(crate) store_pool_open: Gauge,
    pub(crate) store_pool_max: Gauge,
    pub store_errors: Family<StoreErrorLabels, Counter>,
    pub store_runs_deleted: Family<ReasonLabel, Counter>,
    /// Runs of the store that nobody will resume, found at a claim (a second run the task
    /// holds, a waiting run a task names but cannot take) or deleted by the sweeper as
    /// abandoned.
    pub store_runs_orphaned: Family<ReasonLabel, Counter>,
    /// GenAI semantic conventions: tokens per model call, input and output apart.
    pub(crate) genai_token_usage: Family<GenAiTokenLabels, Histogram, fn() -> Histogram>,
    /// GenAI semantic conventions: the duration of each model call, failed ones included.
    pub(crate) genai_operation_duration: Family<GenAiDurationLabels, Histogram, fn() -> Histogram>,
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
            model_fallback_calls: Family::default(),
            model_circuit_opened: Family::default(),
            model_capacity: Family::default(),
            model_capacity_wait: Family::new_with_constructor(
                latency_histogram as fn() -> Histogram,
            ),
            models_held: Family::default(),
            tool_calls: Family::default(),
            approvals: Family::default(),
            output_repairs: Family::default(),
            output_failures: Family::default(),
            answer_repairs: Family::default(),
            answer_failures: Family::default(),
            tolerated_answers: Family::default(),
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
            store_runs_orphaned: Family::default(),
            genai_token_usage: Family::new_with_constructor(
                genai_token_histogram as fn() -> Histogram,
            ),
            genai_operation_duration: Family::new_with_constructor(
                genai_duration_histogram as fn() -> Histogram,
            ),
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
            "Model tokens by agent, provider, model and direction (input, output): what each agent costs",
            m.model_tokens.clone(),
        );
        registry.register(
            "abada_agent_model_fallback_calls",
            "Model calls to one of an agent's fallbackModels (its model failed first), by provider and model",
            m.model_fallback_calls.clone(),
        );
        registry.register(
            "abada_agent_model_circuit_opened",
            "Times a model was found unavailable for every task (its circuit opened: 429, 503, 529, unreachable, or failures of distinct tasks in a row), by provider and model",
            m.model_circuit_opened.clone(),
        );
        registry.register(
            "abada_agent_model_capacity",
            "Calls a model may start now by its provider's stated rate limit (x-ratelimit-*, anthropic-ratelimit-*, Retry-After, 429s), as of its last call, by provider and model",
            m.model_capacity.clone(),
        );
        registry.register(
            "abada_agent_model_capacity_wait_seconds",
            "Time a model call waited for its model's capacity (the provider's rate limit) before it went out, by provider and model",
            m.model_capacity_wait.clone(),
        );
        registry.register(
            "abada_agent_models_held",
            "Models whose calls cannot start now, by provider and reason (rate_limited: a 429 with retry-after; unavailable: a 503; requests_exhausted, tokens_exhausted: a stated budget at zero); each hold ends within ABADA_AGENT_MODEL_WAIT_MAX_MS, /readyz names the models",
            m.models_held.clone(),
        );
        registry.register(
            "abada_agent_tool_calls",
            "Tool calls by server, tool and outcome",
            m.tool_calls.clone(),
        );
        registry.register(
            "abada_agent_approvals",
            "Tool calls put to a person (requested) and the decisions acted on (approved, refused)",
            m.approvals.clone(),
        );
        registry.register(
            "abada_agent_output_repairs",
            "Final answers sent back to the model for a repair turn, by agent and reason (schema, not_json, too_large, truncated)",
            m.output_repairs.clone(),
        );
        registry.register(
            "abada_agent_output_failures",
            "Final answers still rejected after the repair turns (the task became an incident), by agent and reason",
            m.output_failures.clone(),
        );
        registry.register(
            "abada_agent_answer_repairs",
            "Malformed answers sent back to the model for a repair turn, by agent and reason (tool_call_as_text, empty_answer, repeated_call)",
            m.answer_repairs.clone(),
        );
        registry.register(
            "abada_agent_answer_failures",
            "Malformed answers with no repair turn left (the task became an incident), by agent and reason",
            m.answer_failures.clone(),
        );
        registry.register(
            "abada_agent_tolerated_answers",
            "Answers taken by the tolerant parse of a provider set to TOOL_CALLS_IN_TEXT=parse, by agent and reason (bare_json, fenced_json, tagged, with_text, tool_name, arguments_text)",
            m.tolerated_answers.clone(),
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
        registry.register(
            "abada_agent_store_runs_orphaned",
            "Runs of the run store nobody will resume, by how they were found (held_twice, named_elsewhere at a claim; abandoned by the sweeper)",
            m.store_runs_orphaned.clone(),
        );
        // The OpenTelemetry GenAI client metrics (semantic conventions v1.41.0), named as the
        // OpenTelemetry-to-Prometheus translation names them: `{token}` has no suffix, `s`
        // becomes `_seconds` (added by the unit).
        registry.register(
            "gen_ai_client_token_usage",
            "GenAI semantic conventions: number of input and output tokens used per model call",
            m.genai_token_usage.clone(),
        );
        registry.register_with_unit(
            "gen_ai_client_operation_duration",
            "GenAI semantic conventions: duration of each model call",
            prometheus_client::registry::Unit::Seconds,
            m.genai_operation_duration.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Sets `abada_agent_models_held` to the models held now (the series of reasons no longer
    /// held drop out).
    pub(crate) fn set_models_held(
        &self,
        held: &[(crate::provider::ModelRef, crate::provider::capacity::Held)],
    ) {
        self.models_held.clear();
        for (model, h) in held {
            self.models_held
                .get_or_create(&HeldLabels {
                    provider: labels::capped(&model.provider),
                    reason: h.reason.as_str(),
                })
                .inc();
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub(crate) fn observe_store_transaction(&self, operation: &'static str, took: Duration) {
        self.store_transaction_duration
            .get_or_create(&StoreOperationLabel { operation })
            .observe(took.as_secs_f64());
    }

    pub(crate) fn count_store_error(&self, operation: &'static str, class: &'static str) {
        self.store_errors
            .get_or_create(&StoreErrorLabels { operation, class })
            .inc();
    }

    pub(crate) fn count_store_runs_deleted(&self, reason: &'static str, runs: u64) {
        if runs > 0 {
            self.store_runs_deleted
                .get_or_create(&ReasonLabel { reason })
                .inc_by(runs);
            if reason == "abandoned" {
                self.count_store_runs_orphaned("abandoned", runs);
            }
        }
    }

    /// Counts `runs` orphaned runs found, by how (`held_twice`, `named_elsewhere`,
    /// `abandoned`).
    pub(crate) fn count_store_runs_orphaned(&self, reason: &'static str, runs: u64) {
        if runs > 0 {
            self.store_runs_orphaned
                .get_or_create(&ReasonLabel { reason })
                .inc_by(runs);
        }
    }

    /// Counts one model call in every model family: `model_calls`, its duration, the fallback
    /// calls, the tokens and both `gen_ai_*` families. Every provider and model label comes from
    /// `names` ([`labels::DeclaredNames::model`]): a model the task's definition did not declare
    /// is `other` in each of them, and a declared name is cut to [`labels::MAX_LABEL_LEN`].
    /// `agent` is the definition's name, already capped.
    pub(crate) fn observe_model_call(
        &self,
        names: &labels::DeclaredNames,
        agent: &str,
        a: &crate::provider::CallAttempt,
    ) {
        let (provider, model) = names.model(&a.model);
        // The conventions' provider name: `openai`, `anthropic`, or a configured provider's
        // name (the operator's, a closed set), cut like every label.
        let semconv_provider = labels::capped(&a.provider_name);
        let took = a.duration.as_secs_f64();
        self.genai_operation_duration
            .get_or_create(&GenAiDurationLabels {
                gen_ai_operation_name: "chat",
                gen_ai_provider_name: semconv_provider.clone(),
                gen_ai_request_model: model.clone(),
                error_type: if a.outcome == "ok" {
                    String::new()
                } else {
                    a.outcome.to_string()
                },
            })
            .observe(took);
        let labels = ModelLabels {
            provider: provider.clone(),
            model: model.clone(),
            outcome: a.outcome,
        };
        self.model_calls.get_or_create(&labels).inc();
        self.model_call_duration
            .get_or_create(&labels)
            .observe(took);
        let model_ref = ModelRefLabels {
            provider: provider.clone(),
            model: model.clone(),
        };
        self.model_capacity_wait
            .get_or_create(&model_ref)
            .observe(a.capacity_wait.as_secs_f64());
        if let Some(n) = a.capacity {
            self.model_capacity
                .get_or_create(&model_ref)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        if a.circuit_opened {
            self.model_circuit_opened
                .get_or_create(&ModelRefLabels {
                    provider: provider.clone(),
                    model: model.clone(),
                })
                .inc();
        }
        if a.fallback_index > 0 {
            self.model_fallback_calls
                .get_or_create(&ModelRefLabels {
                    provider: provider.clone(),
                    model: model.clone(),
                })
                .inc();
        }
        if let Some(u) = a.usage {
            for (direction, n) in [("input", u.input_tokens), ("output", u.output_tokens)] {
                self.genai_token_usage
                    .get_or_create(&GenAiTokenLabels {
                        gen_ai_operation_name: "chat",
                        gen_ai_provider_name: semconv_provider.clone(),
                        gen_ai_request_model: model.clone(),
                        gen_ai_token_type: direction,
                    })
                    .observe(n as f64);
                self.model_tokens
                    .get_or_create(&ModelTokenLabels {
                        agent: agent.to_string(),
                        provider: provider.clone(),
                        model: model.clone(),
                        direction,
                    })
                    .inc_by(n);
            }
        }
    }

    /// Counts an approval event: `requested`, `requested_again`, `approved`, `refused` or
    /// `unusable`.
    pub(crate) fn count_approval(&self, event: &'static str) {
        self.approvals.get_or_create(&ApprovalLabel { event }).inc();
    }

    /// A rejected final answer of agent `agent` (already capped): a repair turn, or, with
    /// `repaired` false, the incident.
    pub(crate) fn count_output_rejection(&self, agent: &str, reason: &'static str, repaired: bool) {
        let family = if repaired {
            &self.output_repairs
        } else {
            &self.output_failures
        };
        family
            .get_or_create(&OutputLabels {
                agent: agent.to_string(),
                reason,
            })
            .inc();
    }

    pub(crate) fn count_answer_repair(&self, agent: &str, reason: &'static str, repaired: bool) {
        let family = if repaired {
            &self.answer_repairs
        } else {
            &self.answer_failures
        };
        family
            .get_or_create(&OutputLabels {
                agent: agent.to_string(),
                reason,
            })
            .inc();
    }

    pub(crate) fn count_tolerated_answer(&self, agent: &str, reason: &'static str) {
        self.tolerated_answers
            .get_or_create(&OutputLabels {
                agent: agent.to_string(),
                reason,
            })
            .inc();
    }

    pub(crate) fn observe_engine_request(
        &self,
        operation: &'static str,
        status: String,
        took: Duration,
    ) {
        self.engine_request_duration
            .get_or_create(&EngineRequestLabels { operation, status })
            .observe(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(model: &str, fallback_index: usize) -> crate::provider::CallAttempt {
        crate::provider::CallAttempt {
            model: crate::provider::ModelRef::parse(model).unwrap(),
            provider_name: "openai".into(),
            fallback_index,
            outcome: "ok",
            usage: Some(crate::conversation::Usage {
                input_tokens: 10,
                output_tokens: 5,
            }),
            duration: Duration::from_millis(20),
            circuit_opened: true,
            capacity_wait: Duration::from_millis(250),
            capacity: Some(3),
        }
    }

    /// The names of a definition using `model` and `orders`, both declared by the operator.
    fn names_declaring(model: &crate::provider::ModelRef) -> labels::DeclaredNames {
        let operator = labels::OperatorNames {
            agents: ["refund-agent".to_string()].into(),
            models: [(model.provider.clone(), model.model.clone())].into(),
            servers: ["orders".to_string()].into(),
        };
        let vocabulary = std::sync::Arc::new(labels::Vocabulary::new(&operator));
        labels::DeclaredNames::of_definition(vocabulary, [model], ["orders"])
    }

    #[test]
    fn a_model_the_definition_did_not_declare_is_other_in_every_model_family() {
        let declared = crate::provider::ModelRef::parse("openai/gpt-4.1-mini").unwrap();
        let names = names_declaring(&declared);
        let m = Metrics::new();
        // A fallback call and its tokens, to a model name the engine sent but nobody declared.
        m.observe_model_call(
            &names,
            "refund-agent",
            &attempt("openai/undeclared-9f3a", 1),
        );
        let text = m.encode();
        assert!(!text.contains("undeclared-9f3a"), "{text}");
        for family in [
            "abada_agent_model_calls_total{",
            "abada_agent_model_call_duration_seconds_count{",
            "abada_agent_model_fallback_calls_total{",
            "abada_agent_model_circuit_opened_total{",
            "abada_agent_model_tokens_total{",
            "gen_ai_client_token_usage_count{",
            "gen_ai_client_operation_duration_seconds_count{",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(family))
                .unwrap_or_else(|| panic!("no {family} sample in {text}"));
            assert!(line.contains("model=\"other\""), "{line}");
        }
    }

    #[test]
    fn a_declared_model_name_is_cut_in_every_model_family() {
        let long = format!("openai/{}", "m".repeat(300));
        let declared = crate::provider::ModelRef::parse(&long).unwrap();
        let names = names_declaring(&declared);
        let m = Metrics::new();
        m.observe_model_call(&names, "refund-agent", &attempt(&long, 1));
        let text = m.encode();
        assert!(
            !text.contains(&"m".repeat(labels::MAX_LABEL_LEN + 1)),
            "{text}"
        );
        assert!(text.contains(&"m".repeat(labels::MAX_LABEL_LEN)), "{text}");
    }

    #[test]
    fn genai_metrics_have_the_conventions_names_and_buckets() {
        let m = Metrics::new();
        m.genai_token_usage
            .get_or_create(&GenAiTokenLabels {
                gen_ai_operation_name: "chat",
                gen_ai_provider_name: "openai".into(),
                gen_ai_request_model: "gpt-4o-mini".into(),
                gen_ai_token_type: "input",
            })
            .observe(120.0);
        m.genai_operation_duration
            .get_or_create(&GenAiDurationLabels {
                gen_ai_operation_name: "chat",
                gen_ai_provider_name: "openai".into(),
                gen_ai_request_model: "gpt-4o-mini".into(),
                error_type: String::new(),
            })
            .observe(0.5);
        let text = m.encode();
        for line in [
            "gen_ai_client_token_usage_bucket{le=\"1.0\",gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"gpt-4o-mini\",gen_ai_token_type=\"input\"} 0",
            "gen_ai_client_token_usage_bucket{le=\"256.0\",gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"gpt-4o-mini\",gen_ai_token_type=\"input\"} 1",
            "gen_ai_client_token_usage_bucket{le=\"67108864.0\",",
            "gen_ai_client_operation_duration_seconds_bucket{le=\"0.01\",",
            "gen_ai_client_operation_duration_seconds_bucket{le=\"81.92\",",
            "gen_ai_client_operation_duration_seconds_count{gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"gpt-4o-mini\",error_type=\"\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(!text.contains("abada_agent_gen_ai"));
    }

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
