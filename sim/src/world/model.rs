//! The world's scripted models: a [`ModelProvider`] that plays, for each task, the script its
//! input names (`sim:{task}:{steps}:{style}[:{finals}]`): one answer per step, each a tool call
//! (a step in capitals comes after a long generation, one and a half lock durations): `u` a tool
//! nobody offers (the agent answers it with an error result, performing nothing), `r` the
//! world's read-only lookup, `w` the world's keyed write number `n` (its turn); then the final
//! answers of `finals`, one per turn, each one a worker must send back (`o` off the schema of
//! [`super::process::output_schema`], `c` cut by the output limit, stop reason `length`, `t` a
//! tool call written as text in `<tool_call>` markup, as the real small model writes it,
//! docs/REAL_MODEL.md); then a final answer naming the task that matches that schema. The
//! `hostile` style sends malformed arguments to the unknown tool. Faults: 429
//! and 5xx answers and slowness, drawn from the world's seeded source; every call is recorded,
//! so the invariants can count the answers paid for. A call first meets the world's provider
//! limit when the seed has one (`provider_limit`: one quota for every worker), whose answers'
//! figures reach the worker's capacities as an adapter hands them over.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};

use super::World;
use super::provider_limit::{Arrival, LIMIT_REFUSED};
use super::trace::Event;
use abada_agent_worker::conversation::{AssistantMessage, Message, ToolCall, Usage};
use abada_agent_worker::provider::capacity::{ModelCapacities, RateLimits};
use abada_agent_worker::provider::{
    ModelProvider, ModelRef, ModelRequest, ModelResponse, ProviderError,
};

/// The provider name the world's model is registered under (`sim/…` in a definition).
pub(crate) const PROVIDER: &str = "sim";
/// The same models under a provider whose context window the workers are configured with
/// ([`SMALL_WINDOW`] tokens, `ABADA_AGENT_PROVIDER_SIMSMALL_CONTEXT_WINDOW`): the agents that
/// use it (`process::window_definition`) outgrow it, and the window elides old tool results.
pub(crate) const SMALL_WINDOW_PROVIDER: &str = "simsmall";
pub(crate) const SMALL_WINDOW: u64 = 1200;
/// The instruction the world's model obeys: told it (a redeployed agent's instructions say it,
/// `process::redeployed_definition`), the model plays every write of its script as a read, as a
/// model told so would.
pub(crate) const NO_WRITES: &str = "Perform no writes.";
/// The start of the worker's stub for an elided tool result (`agent::window`).
const ELIDED: &str = "[elided by the worker";

/// What a task's input asks the model to play.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelScript {
    pub task: String,
    /// One character per tool-calling turn: `u`, `r` or `w`.
    pub steps: String,
    pub hostile: bool,
    /// The final answers played before the good one, one character each: `o` off-schema, `c`
    /// cut, `t` a tool call written as text.
    pub finals: String,
}

/// How the world's model answered a final turn off its good answer ([`ModelScript::finals`]),
/// as recorded in [`Event::ModelCall`].
pub(crate) const OFF_SCHEMA: &str = "off-schema";
pub(crate) const CUT: &str = "cut";
pub(crate) const TEXT_CALL: &str = "text-call";

impl ModelScript {
    /// The input text that names this script (the agent's `input` template renders it).
    pub fn input(&self) -> String {
        let style = if self.hostile { "hostile" } else { "plain" };
        if self.finals.is_empty() {
            format!("sim:{}:{}:{style}", self.task, self.steps)
        } else {
            format!("sim:{}:{}:{style}:{}", self.task, self.steps, self.finals)
        }
    }

    pub fn parse(text: &str) -> Option<ModelScript> {
        let mut parts = text.trim().strip_prefix("sim:")?.split(':');
        let task = parts.next()?.to_string();
        let steps = parts.next()?.to_string();
        let hostile = parts.next()? == "hostile";
        let finals = parts.next().unwrap_or_default().to_string();
        Some(ModelScript {
            task,
            steps,
            hostile,
            finals,
        })
    }
}

/// One worker's provider of the world's models.
pub struct WorldModel {
    world: Arc<World>,
    worker_id: String,
    /// The context window this provider's models have, checked on every request.
    window: Option<u64>,
    /// The worker's capacities, told what each answer states (as the adapters tell them).
    capacities: Option<Arc<ModelCapacities>>,
}

impl WorldModel {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldModel {
            world,
            worker_id: worker_id.into(),
            window: None,
            capacities: None,
        }
    }

    /// The model reporting every answer's rate-limit figures to `capacities`.
    pub fn with_capacities(mut self, capacities: Arc<ModelCapacities>) -> Self {
        self.capacities = Some(capacities);
        self
    }

    /// The provider name this model is configured under.
    fn provider(&self) -> &'static str {
        if self.window.is_some() {
            SMALL_WINDOW_PROVIDER
        } else {
            PROVIDER
        }
    }

    /// What an answer stated, for a call sent at `sent`, handed to the worker's capacities.
    fn observe(&self, model: &str, sent: tokio::time::Instant, limits: &RateLimits) {
        if let Some(c) = &self.capacities {
            let model = ModelRef {
                provider: self.provider().into(),
                model: model.to_string(),
            };
            c.observe(&model, sent, tokio::time::Instant::now(), limits);
        }
    }

    /// The models of [`SMALL_WINDOW_PROVIDER`]: each request is measured against
    /// [`SMALL_WINDOW`] and read for elided results.
    pub fn with_small_window(mut self) -> Self {
        self.window = Some(SMALL_WINDOW);
        self
    }

    /// Records what the window's invariants judge: the request's size by the world's own count
    /// (its bytes at 3 a token, as many as the worker's estimate assumes, without its
    /// per-message overheads, plus the room asked for the answer), and the tool results it
    /// carries elided, keyed writes' among them.
    fn record_window(&self, task: &str, turn: usize, req: &ModelRequest, window: u64) -> u64 {
        let mut bytes = req.system.len();
        let (mut elided, mut elided_writes) = (0, 0);
        for m in &req.messages {
            bytes += match m {
                Message::User { text } => text.len(),
                Message::Assistant(a) => {
                    a.text.as_deref().map_or(0, str::len)
                        + a.tool_calls
                            .iter()
                            .map(|c| c.tool.len() + c.arguments.to_string().len())
                            .sum::<usize>()
                }
                Message::ToolResult { call, result } => {
                    let text = result.to_model_text();
                    if text.starts_with(ELIDED) {
                        elided += 1;
                        if call.tool == "sim_write" {
                            elided_writes += 1;
                        }
                    }
                    text.len()
                }
            };
        }
        for t in &req.tools {
            bytes += t.tool.len() + t.description.len() + t.input_schema.to_string().len();
        }
        let tokens = (bytes as u64).div_ceil(3) + u64::from(req.max_output_tokens.unwrap_or(0));
        self.world.record(Event::WindowRequest {
            worker: self.worker_id.clone(),
            task: task.to_string(),
            turn,
            tokens,
            window,
            elided,
            elided_writes,
        });
        tokens
    }

    fn record(&self, task: &str, turn: usize, answer: &'static str) {
        self.world.record(Event::ModelCall {
            worker: self.worker_id.clone(),
            provider: self.provider(),
            task: task.to_string(),
            turn,
            answer,
        });
    }
}

#[async_trait]
impl ModelProvider for WorldModel {
    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let script = req
            .messages
            .iter()
            .find_map(|m| match m {
                Message::User { text } => ModelScript::parse(text),
                _ => None,
            })
            .ok_or_else(|| ProviderError::Rejected {
                provider: "sim".into(),
                model: req.model.clone(),
                status: 400,
                message: "no simulation script in the conversation".into(),
            })?;
        let turn = req
            .messages
            .iter()
            .filter(|m| matches!(m, Message::Assistant(_)))
            .count();
        if let Some(window) = self.window
            && self.record_window(&script.task, turn, req, window) > window
        {
            // As a real model refuses a request longer than its window: 400, OpenAI's
            // `context_length_exceeded` (its error code for it).
            return Err(ProviderError::Rejected {
                provider: SMALL_WINDOW_PROVIDER.into(),
                model: req.model.clone(),
                status: 400,
                message: format!(
                    "context_length_exceeded: this model's maximum context length is {window} tokens"
                ),
            });
        }
        // Held while the worker is frozen, like its engine calls.
        self.world.hold(&self.worker_id).await;
        // The provider's limit, counted as the request arrives (`provider_limit`).
        let sent = tokio::time::Instant::now();
        let max_wait = self
            .capacities
            .as_ref()
            .map_or(Duration::from_secs(60), |c| c.policy().max_wait());
        let stated =
            match self
                .world
                .provider
                .arrive(self.provider(), sent, self.world.now_ms(), max_wait)
            {
                Arrival::Unlimited => None,
                Arrival::Admitted(limits) => Some(limits),
                Arrival::Hostile(limits) => {
                    self.world.faults().count("model hostile header");
                    Some(limits)
                }
                Arrival::Refused {
                    limits,
                    retry_after,
                } => {
                    self.world.faults().count("model limit 429");
                    // A refusal takes a moment too, not nothing: no loop spins at one instant.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    self.record(&script.task, turn, LIMIT_REFUSED);
                    self.observe(&req.model, sent, &limits);
                    return Err(ProviderError::Unavailable {
                        provider: "sim".into(),
                        model: req.model.clone(),
                        status: Some(429),
                        message: "the provider's rate limit (simulated)".into(),
                        retry_after,
                    });
                }
            };
        let now = self.world.elapsed_ms();
        let (p429, p5xx, slow, slow_max, stall) = {
            let f = self.world.faults();
            if f.active(now) {
                let p = &f.plan;
                (
                    p.model_429,
                    p.model_5xx,
                    p.model_slow,
                    p.model_slow_max,
                    p.model_stall,
                )
            } else {
                (0.0, 0.0, 0.0, Duration::ZERO, 0.0)
            }
        };
        if slow > 0.0 && self.world.draw() < slow {
            self.world.faults().count("model slow");
            tokio::time::sleep(slow_max.mul_f64(self.world.draw())).await;
        }
        if stall > 0.0 && self.world.draw() < stall {
            self.world.faults().count("model stall");
            let lock = self.world.lock_duration;
            tokio::time::sleep(lock + lock.mul_f64(self.world.draw())).await;
        }
        if p429 > 0.0 && self.world.draw() < p429 {
            self.world.faults().count("model 429");
            self.record(&script.task, turn, "429");
            return Err(ProviderError::Unavailable {
                provider: "sim".into(),
                model: req.model.clone(),
                status: Some(429),
                message: "simulated rate limit".into(),
                retry_after: Some(Duration::from_millis(200)),
            });
        }
        if p5xx > 0.0 && self.world.draw() < p5xx {
            self.world.faults().count("model 5xx");
            self.record(&script.task, turn, "5xx");
            return Err(ProviderError::Transient {
                provider: "sim".into(),
                model: req.model.clone(),
                message: "simulated HTTP 502".into(),
                connect: false,
            });
        }
        // A model takes a moment to answer.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let step = script.steps.as_bytes().get(turn).copied();
        if step.is_some_and(|s| s.is_ascii_uppercase()) {
            // A long generation: the task's heartbeats keep its lease meanwhile.
            self.world.faults().count("model long generation");
            tokio::time::sleep(self.world.lock_duration.mul_f64(1.5)).await;
        }
        // Told to perform no writes (a redeployed definition), the model reads instead.
        let no_writes = req.system.contains(NO_WRITES);
        let step = step.map(|s| match s.to_ascii_lowercase() {
            b'w' if no_writes => b'r',
            s => s,
        });
        let (message, answer) = match step {
            Some(step) => {
                let (server, tool, arguments) = match step {
                    b'r' => (
                        super::tools::SERVER,
                        "sim_lookup",
                        json!({"task": script.task}),
                    ),
                    b'w' => (
                        super::tools::SERVER,
                        "sim_write",
                        json!({"task": script.task, "n": turn}),
                    ),
                    _ if script.hostile => ("", "sim_probe", Value::String("{not json".into())),
                    _ => ("", "sim_probe", json!({"turn": turn})),
                };
                (
                    AssistantMessage {
                        text: None,
                        tool_calls: vec![ToolCall {
                            call_id: format!("call-{turn}"),
                            server: server.into(),
                            tool: tool.into(),
                            arguments,
                        }],
                    },
                    "tool",
                )
            }
            None => {
                // The final turns: those of `finals` first, then the good answer.
                let good = json!({"task": script.task, "turns": turn, "route": "done"}).to_string();
                let played = turn
                    .checked_sub(script.steps.len())
                    .and_then(|f| script.finals.as_bytes().get(f).copied());
                let (text, answer) = match played {
                    Some(b'o') => (
                        json!({"task": script.task, "route": "sideways"}).to_string(),
                        OFF_SCHEMA,
                    ),
                    // What the output limit left of the good answer.
                    Some(b'c') => (good[..good.len() / 2].to_string(), CUT),
                    Some(b't') => (
                        format!(
                            "<tool_call>{}</tool_call>",
                            json!({"name": "sim_lookup", "arguments": {"task": script.task}})
                        ),
                        TEXT_CALL,
                    ),
                    _ => (good, "final"),
                };
                let kind = match answer {
                    OFF_SCHEMA => Some("model off-schema answer"),
                    CUT => Some("model cut answer"),
                    TEXT_CALL => Some("model text tool call"),
                    _ => None,
                };
                if let Some(kind) = kind {
                    self.world.faults().count(kind);
                }
                (
                    AssistantMessage {
                        text: Some(text),
                        tool_calls: Vec::new(),
                    },
                    answer,
                )
            }
        };
        self.record(&script.task, turn, answer);
        if let Some(limits) = &stated {
            self.observe(&req.model, sent, limits);
        }
        Ok(ModelResponse {
            stop_reason: match answer {
                "tool" => "tool_calls",
                CUT => "length",
                _ => "stop",
            }
            .into(),
            message,
            usage: Some(Usage {
                input_tokens: 100,
                output_tokens: 20,
            }),
            response_model: None,
            cache_read_tokens: None,
            cache_creation_tokens: None,
        })
    }
}
