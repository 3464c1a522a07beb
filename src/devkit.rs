//! The devkit, as the worker sees it (the `devkit` feature, on by default): the stand-ins of the
//! `abada-devkit` crate under their usual paths (`devkit::engine`, `::model`, `::tools`, `::jwt`,
//! `::loadtest`, `::stack`), plus what needs the worker itself: in-process workers started
//! against a devkit [`stack::Stack`] ([`workers`]), the one engine decorator ([`gate`]), the
//! demo's freeze built on it ([`freeze`]), the adapter through which the `abada-demo` crate
//! starts its workers ([`demo_workers`]), and the worker's internals the simulator reuses
//! ([`sim_view`]).
//!
//! The production build (`--no-default-features`) has none of it. The deterministic simulator
//! and its in-memory world are a crate of their own (`sim/`, `abada-sim`), built only for it and
//! the tests.

pub use abada_devkit::{engine, jwt, loadtest, model, tools};

pub mod demo_workers;
pub mod freeze;
pub mod gate;
pub mod sim_view;
pub mod workers;

/// The stand-ins started together ([`abada_devkit::stack`]) and the workers started against
/// them ([`workers`]).
pub mod stack {
    pub use super::workers::{DeclaredLabelNames, StackWorkers, WorkerHandle, WorkerOptions};
    pub use abada_devkit::stack::*;
}
