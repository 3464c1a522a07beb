//! abada-agent-worker: a daemon that runs the agent nodes of Abada BPMN processes.
//!
//! See `ARCHITECTURE.md` for the code map, the invariants and a glossary.
#![forbid(unsafe_code)]
// The agent's future nests deeply (task handler, attempt span, deadline, conversation, model
// fallback, spans, store, MCP session): past rustc's default query depth of 128.
#![recursion_limit = "256"]

pub mod admin;
pub mod agent;
pub mod app;
pub mod auth;
pub mod backoff;
pub(crate) mod base_url;
pub mod body;
pub mod channel;
pub mod config;
pub mod conversation;
pub mod decoders;
#[cfg(feature = "devkit")]
pub mod devkit;
pub mod engine;
pub mod env;
pub mod errors;
pub mod handler;
pub mod heartbeat;
pub mod lease;
pub mod metrics;
pub mod provider;
pub mod random;
pub mod redact;
pub mod runner;
pub mod secret;
#[cfg(feature = "sim-bugs")]
pub mod sim_bugs;
pub mod store;
pub mod task_end;
pub mod telemetry;
pub mod tls;
pub mod tools;
