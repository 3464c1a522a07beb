//! The devkit: small, faithful in-process stand-ins for the systems the worker talks to (the
//! Abada engine, model providers, MCP tool servers), the stack that starts them together, and the
//! load harness's core. They serve the worker's tests, its `demo` and `dev-engine` subcommands and
//! its benchmarks.
//!
//! This crate does not depend on the worker: the stand-ins speak the protocol from the other
//! side of the wire, as the real systems would. What needs the worker's own types (in-process
//! workers, engine decorators) lives in the worker's `devkit` module, behind its `devkit` feature.
#![forbid(unsafe_code)]

pub mod engine;
pub mod jwt;
pub mod loadtest;
pub mod model;
pub mod stack;
pub mod tools;
