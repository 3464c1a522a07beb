//! The world's scripted models: a [`ModelProvider`] that plays, for each task, the script its
//! input names (`sim:{task}:{steps}:{style}`): one answer per step, each a tool call: `u` a tool
//! nobody offers (the agent answers it with an error result, performing nothing), `r` the
//! world's read-only lookup, `w` the world's keyed write number `n` (its turn); then a final
//! answer naming the task. The `hostile` style sends malformed arguments to the unknown tool. Faults: 429
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
use crate::conversation::{AssistantMessage, Message, ToolCall, Usage};
use crate::provider::capacity::{ModelCapacities, RateLimits};
use crate::provider::{ModelProvider, ModelRef, ModelRequest, ModelResponse, ProviderError};

/// The provider name the world's model is registered under (`sim/…` in a definition).
pub(crate) const PROVIDER: &str = "sim";

/// What a task's input asks the model to play.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelScript {
    pub task: String,
    /// One character per tool-calling turn: `u`, `r` or `w`.
    pub steps: String,
    pub hostile: bool,
}

impl ModelScript {
    /// The input text that names this script (the agent's `input` template renders it).
    pub fn input(&self) -> String {
        let style = if self.hostile { "hostile" } else { "plain" };
        format!("sim:{}:{}:{style}", self.task, self.steps)
    }

    pub fn parse(text: &str) -> Option<ModelScript> {
        let mut parts = text.trim().strip_prefix("sim:")?.split(':');
        let task = parts.next()?.to_string();
        let steps = parts.next()?.to_string();
        let hostile = parts.next()? == "hostile";
        Some(ModelScript {
            task,
            steps,
            hostile,
        })
    }
}

/// One worker's provider of the world's models.
pub struct WorldModel {
    world: Arc<World>,
    worker_id: String,
    /// The worker's capacities, told what each answer states (as the adapters tell them).
    capacities: Option<Arc<ModelCapacities>>,
}

impl WorldModel {
    pub fn new(world: Arc<World>, worker_id: impl Into<String>) -> Self {
        WorldModel {
            world,
            worker_id: worker_id.into(),
            capacities: None,
        }
    }

    /// The model reporting every answer's rate-limit figures to `capacities`.
    pub fn with_capacities(mut self, capacities: Arc<ModelCapacities>) -> Self {
        self.capacities = Some(capacities);
        self
    }

    /// What an answer stated, for a call sent at `sent`, handed to the worker's capacities.
    fn observe(&self, model: &str, sent: tokio::time::Instant, limits: &RateLimits) {
        if let Some(c) = &self.capacities {
            let model = ModelRef {
                provider: PROVIDER.into(),
                model: model.to_string(),
            };
            c.observe(&model, sent, tokio::time::Instant::now(), limits);
        }
    }

    fn record(&self, task: &str, turn: usize, answer: &'static str) {
        self.world.record(Event::ModelCall {
            worker: self.worker_id.clone(),
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
        // Held while the worker is frozen, like its engine calls.
        self.world.hold(&self.worker_id).await;
        // The provider's limit, counted as the request arrives (`provider_limit`).
        let sent = tokio::time::Instant::now();
        let max_wait = self
            .capacities
            .as_ref()
            .map_or(Duration::from_secs(60), |c| c.policy().max_wait);
        let stated = match self
            .world
            .provider
            .arrive(sent, self.world.now_ms(), max_wait)
        {
            Arrival::Unlimited => None,
            Arrival::Admitted(limits) => Some(limits),
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
        let (p429, p5xx, slow, slow_max) = {
            let f = self.world.faults();
            if f.active(now) {
                let p = &f.plan;
                (p.model_429, p.model_5xx, p.model_slow, p.model_slow_max)
            } else {
                (0.0, 0.0, 0.0, Duration::ZERO)
            }
        };
        if slow > 0.0 && self.world.draw() < slow {
            self.world.faults().count("model slow");
            tokio::time::sleep(slow_max.mul_f64(self.world.draw())).await;
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
        let (message, answer) = match script.steps.as_bytes().get(turn) {
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
            None => (
                AssistantMessage {
                    text: Some(json!({"task": script.task, "turns": turn}).to_string()),
                    tool_calls: Vec::new(),
                },
                "final",
            ),
        };
        self.record(&script.task, turn, answer);
        if let Some(limits) = &stated {
            self.observe(&req.model, sent, limits);
        }
        Ok(ModelResponse {
            stop_reason: if answer == "final" {
                "stop"
            } else {
                "tool_calls"
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
