//! abada-agent-worker: a daemon that runs the agent nodes of Abada BPMN processes.
//!
//! See `ARCHITECTURE.md` for the code map, the invariants and a glossary.
#![forbid(unsafe_code)]

pub mod auth;
pub mod conversation;
pub mod devkit;
pub mod secret;
pub mod tls;
