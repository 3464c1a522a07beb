//! The devkit, as the worker sees it (the `devkit` feature, on by default): the stand-ins of the
//! `abada-devkit` crate under their usual paths (`devkit::engine`, `::model`, `::tools`, `::jwt`,
//! `::loadtest`, `::stack`), plus what needs the worker itself: in-process workers started
//! against a devkit [`stack::Stack`] ([`workers`]), the one engine decorator ([`gate`]), the
//! demo's freeze built on it ([`freeze`]), and the adapter through which the `abada-demo` crate
//! starts its workers ([`demo_workers`]).
//!
//! The production build (`--no-default-features`) has none of it.

pub use abada_devkit::{engine, jwt, loadtest, model, tools};

pub mod demo_workers;
pub mod freeze;
pub mod gate;
pub mod workers;

/// The stand-ins started together ([`abada_devkit::stack`]) and the workers started against
/// them ([`workers`]).
pub mod stack {
    pub use super::workers::{DeclaredLabelNames, StackWorkers, WorkerHandle, WorkerOptions};
    pub use abada_devkit::stack::*;
}
pub mod sim;
pub mod world;
