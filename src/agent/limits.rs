//! Limits on what a model can make the worker do: tool calls per answer and per task,
//! keyed writes per task, model turns, a wall-clock deadline, the token budget and the output cap
//! of each model call.
//!
//! A definition may ask for its own values; the worker-wide [`Ceilings`] (environment variables)
//! bound what any definition gets. [`Limits::resolve`] is the one place the two meet. Every limit
//! counts the task's journaled work too (a resumed attempt never gets a fresh allowance), and an
//! answer that would go over a limit is refused whole: nothing of it is journaled or performed.
//! Each refusal is a [`LimitExceeded`] whose message names the limit and its value. The
//! operator's [`ModelAllowList`] says which models a definition may name at all.

use std::collections::HashMap;
use std::time::Duration;

use crate::conversation::{AssistantMessage, Usage};
use crate::provider::ModelRef;

/// The default of `maxToolCallsPerAnswer`.
pub(crate) const DEFAULT_TOOL_CALLS_PER_ANSWER: u32 = 16;
/// The default of `maxToolCalls` (per task).
pub(crate) const DEFAULT_TOOL_CALLS_PER_TASK: u32 = 100;
/// The default of `maxKeyedWrites` (per task).
pub(crate) const DEFAULT_KEYED_WRITES_PER_TASK: u32 = 20;
/// The hard maximum of `maxTurns`, whatever the definition or the operator says.
pub(crate) const MAX_TURNS_CEILING: u32 = 200;
/// The default of `maxOutputTokens`: the output cap of one model call.
pub(crate) const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 4096;
/// The default ceiling of `maxOutputTokens` (`ABADA_AGENT_MAX_OUTPUT_TOKENS`): above what the
/// common models answer in one call, far below what a definition could ask for
/// (`2000000000` would otherwise reach the provider as `max_tokens`).
pub(crate) const DEFAULT_MAX_OUTPUT_TOKENS_CEILING: u32 = 32_768;
/// The default ceiling of `maxDurationMs` (one hour).
pub(crate) const DEFAULT_MAX_TASK_DURATION: Duration = Duration::from_secs(3600);
/// Worker-wide ceilings (`ABADA_AGENT_MAX_*`): no definition gets more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ceilings {
    pub tool_calls_per_answer: u32,
    pub tool_calls_per_task: u32,
    pub keyed_writes_per_task: u32,
    pub max_turns: u32,
    pub max_duration: Duration,
    /// `ABADA_AGENT_MAX_OUTPUT_TOKENS`: no model call asks for more output tokens.
    pub max_output_tokens: u32,
    /// `ABADA_AGENT_MAX_TOKEN_BUDGET`: no run spends more tokens, whatever its `tokenBudget`
    /// (a definition without one gets this); `None`: no ceiling.
    pub token_budget: Option<u64>,
    /// `ABADA_AGENT_DEFAULT_TOKEN_BUDGET`: the budget of a definition that sets none (still
    /// under the ceiling); `None`: such a run is bounded by the ceiling alone.
    pub default_token_budget: Option<u64>,
}

impl Default for Ceilings {
    fn default() -> Self {
        Ceilings {
            tool_calls_per_answer: DEFAULT_TOOL_CALLS_PER_ANSWER,
            tool_calls_per_task: DEFAULT_TOOL_CALLS_PER_TASK,
            keyed_writes_per_task: DEFAULT_KEYED_WRITES_PER_TASK,
            max_turns: MAX_TURNS_CEILING,
            max_duration: DEFAULT_MAX_TASK_DURATION,
            max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS_CEILING,
            token_budget: None,
            default_token_budget: None,
        }
    }
}

/// The models the operator allows, per provider (`ABADA_AGENT_PROVIDER_<NAME>_MODELS`): a
/// provider with a list takes only the models on it; a provider without one takes any. Checked
/// on every definition a task runs (the BPMN's, the agents file's, the engine's, a run's
/// journaled one), before anything is sent: a definition naming another model is an incident.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelAllowList {
    by_provider: HashMap<String, Vec<String>>,
}

/// A definition names a model its provider's allow-list does not hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "model {provider}/{model} is not among the models the operator allows for provider {provider:?} ({variable} = {allowed}); name one of them in the definition, or ask the operator to add it"
)]
pub struct ModelNotAllowed {
    pub provider: String,
    pub model: String,
    pub variable: String,
    pub allowed: String,
}

impl ModelAllowList {
    /// `(provider, models)` pairs; a provider with no model is left out (any model).
    pub fn new(lists: impl IntoIterator<Item = (String, Vec<String>)>) -> Self {
        ModelAllowList {
            by_provider: lists
                .into_iter()
                .filter(|(_, models)| !models.is_empty())
                .collect(),
        }
    }

    /// Every `(provider, model)` the operator allows by name: operator-declared names, so they
    /// may label metrics (`metrics::labels`).
    pub(crate) fn models(&self) -> impl Iterator<Item = (&str, &str)> {
        self.by_provider
            .iter()
            .flat_map(|(p, models)| models.iter().map(move |m| (p.as_str(), m.as_str())))
    }

    /// The first of `models` (a definition's chain) its provider's list does not hold.
    pub fn check(&self, models: &[ModelRef]) -> Result<(), ModelNotAllowed> {
        for m in models {
            if let Some(allowed) = self.by_provider.get(&m.provider)
                && !allowed.contains(&m.model)
            {
                return Err(ModelNotAllowed {
                    provider: m.provider.clone(),
                    model: m.model.clone(),
                    variable: format!(
                        "ABADA_AGENT_PROVIDER_{}_MODELS",
                        m.provider.to_ascii_uppercase().replace('-', "_")
                    ),
                    allowed: allowed.join(","),
                });
            }
        }
        Ok(())
    }
}

/// What a definition asked for (None: the default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requested {
    pub tool_calls_per_answer: Option<u32>,
    pub tool_calls_per_task: Option<u32>,
    pub keyed_writes_per_task: Option<u32>,
    pub(crate) max_duration_ms: Option<u64>,
}

/// The limits of one task: the definition's values (or the defaults), each lowered to its
/// ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub tool_calls_per_answer: u32,
    pub tool_calls_per_task: u32,
    pub keyed_writes_per_task: u32,
    pub max_turns: u32,
    pub max_duration: Duration,
    pub(crate) token_budget: Option<u64>,
    pub max_output_tokens: u32,
}

impl Limits {
    /// `max_turns` and `token_budget`/`max_output_tokens` come validated from the definition.
    pub fn resolve(
        requested: Requested,
        max_turns: u32,
        token_budget: Option<u64>,
        max_output_tokens: u32,
        ceilings: &Ceilings,
    ) -> Limits {
        Limits {
            tool_calls_per_answer: requested
                .tool_calls_per_answer
                .unwrap_or(DEFAULT_TOOL_CALLS_PER_ANSWER)
                .min(ceilings.tool_calls_per_answer),
            tool_calls_per_task: requested
                .tool_calls_per_task
                .unwrap_or(DEFAULT_TOOL_CALLS_PER_TASK)
                .min(ceilings.tool_calls_per_task),
            keyed_writes_per_task: requested
                .keyed_writes_per_task
                .unwrap_or(DEFAULT_KEYED_WRITES_PER_TASK)
                .min(ceilings.keyed_writes_per_task),
            max_turns: max_turns.min(ceilings.max_turns).min(MAX_TURNS_CEILING),
            max_duration: requested
                .max_duration_ms
                .map(Duration::from_millis)
                .unwrap_or(ceilings.max_duration)
                .min(ceilings.max_duration),
            token_budget: match (
                token_budget.or(ceilings.default_token_budget),
                ceilings.token_budget,
            ) {
                (Some(asked), Some(ceiling)) => Some(asked.min(ceiling)),
                (asked, ceiling) => asked.or(ceiling),
            },
            max_output_tokens: max_output_tokens.min(ceilings.max_output_tokens).max(1),
        }
    }

    /// Refuses a model answer that would take the task over a tool-call or keyed-write limit.
    /// `done` is what the task's journal already holds; `writes` is how many of the answer's
    /// calls would be keyed writes.
    pub fn check_answer(
        &self,
        answer: &AssistantMessage,
        writes: u32,
        done: &Spent,
    ) -> Result<(), LimitExceeded> {
        let calls = u32::try_from(answer.tool_calls.len()).unwrap_or(u32::MAX);
        if calls > self.tool_calls_per_answer {
            return Err(LimitExceeded::ToolCallsPerAnswer {
                limit: self.tool_calls_per_answer,
                asked: calls,
            });
        }
        if done.tool_calls.saturating_add(calls) > self.tool_calls_per_task {
            return Err(LimitExceeded::ToolCallsPerTask {
                limit: self.tool_calls_per_task,
                done: done.tool_calls,
                asked: calls,
            });
        }
        if done.keyed_writes.saturating_add(writes) > self.keyed_writes_per_task {
            return Err(LimitExceeded::KeyedWritesPerTask {
                limit: self.keyed_writes_per_task,
                done: done.keyed_writes,
                asked: writes,
            });
        }
        Ok(())
    }

    /// The output cap of the next model call, or why it must not be sent: the budget left after
    /// the request's own (estimated) input, never more than `maxOutputTokens`.
    pub fn output_cap(&self, used: Usage, estimated_input: u64) -> Result<u32, LimitExceeded> {
        let Some(budget) = self.token_budget else {
            return Ok(self.max_output_tokens);
        };
        let spent = used.total();
        let left = budget.saturating_sub(spent);
        if estimated_input >= left {
            return Err(LimitExceeded::TokenBudget {
                limit: budget,
                spent,
                next_request: estimated_input,
            });
        }
        let cap = (left - estimated_input).min(u64::from(self.max_output_tokens));
        Ok(u32::try_from(cap).unwrap_or(u32::MAX))
    }
}

/// What a task has done so far, from its journal (every attempt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spent {
    /// Tool calls of every journaled model answer.
    pub tool_calls: u32,
    /// `tool/started` steps: keyed writes sent (or about to be).
    pub keyed_writes: u32,
}

/// A limit the task reached; the task becomes an incident with this message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitExceeded {
    #[error(
        "limit maxToolCallsPerAnswer = {limit} exceeded: the model asked for {asked} tool calls in one answer; none of them was performed (raise maxToolCallsPerAnswer, up to ABADA_AGENT_MAX_TOOL_CALLS_PER_ANSWER, or fix the prompt)"
    )]
    ToolCallsPerAnswer { limit: u32, asked: u32 },
    #[error(
        "limit maxToolCalls = {limit} exceeded: the task has made {done} tool calls and the model asked for {asked} more; none of them was performed (raise maxToolCalls, up to ABADA_AGENT_MAX_TOOL_CALLS_PER_TASK)"
    )]
    ToolCallsPerTask { limit: u32, done: u32, asked: u32 },
    #[error(
        "limit maxKeyedWrites = {limit} exceeded: the task has sent {done} keyed writes and the model's answer holds {asked} more; none of the answer's calls was performed (raise maxKeyedWrites, up to ABADA_AGENT_MAX_KEYED_WRITES_PER_TASK)"
    )]
    KeyedWritesPerTask { limit: u32, done: u32, asked: u32 },
    #[error(
        "limit maxTurns = {limit} reached without a final answer ({input} tokens in, {output} out)"
    )]
    MaxTurns { limit: u32, input: u64, output: u64 },
    #[error(
        "limit maxDurationMs = {limit_ms} reached: the task has run {elapsed_ms} ms since its first attempt started (raise maxDurationMs, up to ABADA_AGENT_MAX_TASK_DURATION_MS)"
    )]
    Duration { limit_ms: u64, elapsed_ms: u64 },
    #[error(
        "limit tokenBudget = {limit} would be exceeded: {spent} tokens spent, the next request is estimated at {next_request} input tokens; it was not sent"
    )]
    TokenBudget {
        limit: u64,
        spent: u64,
        next_request: u64,
    },
}

impl LimitExceeded {
    /// The limit's name, as in the definition (for logs and the incident's message).
    pub fn name(&self) -> &'static str {
        match self {
            LimitExceeded::ToolCallsPerAnswer { .. } => "maxToolCallsPerAnswer",
            LimitExceeded::ToolCallsPerTask { .. } => "maxToolCalls",
            LimitExceeded::KeyedWritesPerTask { .. } => "maxKeyedWrites",
            LimitExceeded::MaxTurns { .. } => "maxTurns",
            LimitExceeded::Duration { .. } => "maxDurationMs",
            LimitExceeded::TokenBudget { .. } => "tokenBudget",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::ToolCall;
    use serde_json::json;

    fn answer(calls: usize) -> AssistantMessage {
        AssistantMessage {
            text: None,
            tool_calls: (0..calls)
                .map(|i| ToolCall {
                    call_id: format!("c{i}"),
                    server: "s".into(),
                    tool: "t".into(),
                    arguments: json!({}),
                })
                .collect(),
        }
    }

    fn limits() -> Limits {
        Limits::resolve(
            Requested::default(),
            20,
            Some(1000),
            100,
            &Ceilings::default(),
        )
    }

    #[test]
    fn definitions_get_the_defaults_and_never_more_than_the_ceilings() {
        let l = limits();
        assert_eq!(l.tool_calls_per_answer, 16);
        assert_eq!(l.tool_calls_per_task, 100);
        assert_eq!(l.keyed_writes_per_task, 20);
        assert_eq!(l.max_duration, DEFAULT_MAX_TASK_DURATION);
        let ceilings = Ceilings {
            tool_calls_per_answer: 4,
            tool_calls_per_task: 10,
            keyed_writes_per_task: 2,
            max_turns: 5,
            max_duration: Duration::from_secs(60),
            max_output_tokens: 64,
            token_budget: Some(5_000),
            default_token_budget: Some(2_000),
        };
        let asked = Requested {
            tool_calls_per_answer: Some(300),
            tool_calls_per_task: Some(3),
            keyed_writes_per_task: Some(50),
            max_duration_ms: Some(3_600_000),
        };
        let l = Limits::resolve(asked, 150, None, 100, &ceilings);
        assert_eq!(l.tool_calls_per_answer, 4);
        assert_eq!(l.tool_calls_per_task, 3);
        assert_eq!(l.keyed_writes_per_task, 2);
        assert_eq!(l.max_turns, 5);
        assert_eq!(l.max_duration, Duration::from_secs(60));
        // The operator's spend ceilings: the output cap and the budget never above them; a
        // definition without a budget gets the default.
        assert_eq!(l.max_output_tokens, 64);
        assert_eq!(l.token_budget, Some(2_000));
        let l = Limits::resolve(asked, 10, Some(u64::MAX), u32::MAX, &ceilings);
        assert_eq!((l.max_output_tokens, l.token_budget), (64, Some(5_000)));
        let no_default = Ceilings {
            default_token_budget: None,
            ..ceilings
        };
        let l = Limits::resolve(asked, 10, None, 2_000_000_000, &no_default);
        assert_eq!((l.max_output_tokens, l.token_budget), (64, Some(5_000)));
        let l = Limits::resolve(asked, 10, None, 2_000_000_000, &Ceilings::default());
        assert_eq!(l.max_output_tokens, DEFAULT_MAX_OUTPUT_TOKENS_CEILING);
        assert_eq!(l.token_budget, None);
    }

    #[test]
    fn only_the_models_on_a_providers_list_pass_and_unlisted_providers_take_any() {
        let allow = ModelAllowList::new([
            ("openai".to_string(), vec!["gpt-4.1-mini".to_string()]),
            ("local".to_string(), Vec::new()),
        ]);
        let chain = |names: &[&str]| -> Vec<ModelRef> {
            names.iter().map(|n| ModelRef::parse(n).unwrap()).collect()
        };
        assert!(
            allow
                .check(&chain(&["openai/gpt-4.1-mini", "anthropic/x", "local/y"]))
                .is_ok()
        );
        let e = allow
            .check(&chain(&["openai/gpt-4.1-mini", "openai/o1-pro-2025-03-19"]))
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("openai/o1-pro-2025-03-19")
                && text.contains("ABADA_AGENT_PROVIDER_OPENAI_MODELS = gpt-4.1-mini"),
            "{text}"
        );
        assert!(
            ModelAllowList::default()
                .check(&chain(&["openai/anything"]))
                .is_ok()
        );
    }

    #[test]
    fn answers_over_a_limit_are_refused_naming_it() {
        let l = limits();
        assert!(l.check_answer(&answer(16), 0, &Spent::default()).is_ok());
        let e = l
            .check_answer(&answer(300), 0, &Spent::default())
            .unwrap_err();
        assert_eq!(e.name(), "maxToolCallsPerAnswer");
        assert!(e.to_string().contains("maxToolCallsPerAnswer = 16"));
        assert!(e.to_string().contains("300 tool calls"));
        let done = Spent {
            tool_calls: 95,
            keyed_writes: 19,
        };
        let e = l.check_answer(&answer(6), 0, &done).unwrap_err();
        assert!(e.to_string().contains("maxToolCalls = 100"), "{e}");
        assert!(l.check_answer(&answer(5), 1, &done).is_ok());
        let e = l.check_answer(&answer(2), 2, &done).unwrap_err();
        assert!(e.to_string().contains("maxKeyedWrites = 20"), "{e}");
    }

    #[test]
    fn the_output_cap_is_what_the_budget_leaves_after_the_request_never_all_of_it() {
        let l = limits();
        let used = Usage {
            input_tokens: 500,
            output_tokens: 100,
        };
        // 400 left, 250 estimated input: 150 could go out, maxOutputTokens is 100.
        assert_eq!(l.output_cap(used, 250), Ok(100));
        assert_eq!(l.output_cap(used, 350), Ok(50));
        let e = l.output_cap(used, 400).unwrap_err();
        assert!(e.to_string().contains("tokenBudget = 1000"), "{e}");
        let spent = Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX,
        };
        assert!(l.output_cap(spent, 0).is_err());
        let unbudgeted = Limits {
            token_budget: None,
            ..l
        };
        assert_eq!(unbudgeted.output_cap(spent, u64::MAX), Ok(100));
    }
}
