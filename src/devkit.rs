//! The devkit: small, faithful in-process stand-ins for the systems the worker talks to (the
//! Abada engine, model providers, MCP tool servers). They serve the tests, the `dev-engine`
//! subcommand and the demo.

pub mod engine;
pub mod freeze;
pub mod gate;
pub mod jwt;
pub mod loadtest;
pub mod model;
pub mod stack;
pub mod tools;
