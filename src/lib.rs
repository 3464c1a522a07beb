//! abada-agent-worker: a daemon that runs the agent nodes of Abada BPMN processes.
//!
//! See `ARCHITECTURE.md` for the code map, the invariants and a glossary.
#![forbid(unsafe_code)]

pub mod admin;
pub mod agent;
pub mod app;
pub mod auth;
pub mod backoff;
pub mod config;
pub mod conversation;
pub mod decoders;
#[cfg(feature = "devkit")]
pub mod demo;
#[cfg(feature = "devkit")]
pub mod devkit;
pub mod engine;
pub mod errors;
pub mod handler;
pub mod heartbeat;
pub mod lease;
pub mod metrics;
pub mod provider;
pub mod runner;
pub mod secret;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod tools;
