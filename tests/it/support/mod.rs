//! Shared test helpers.

pub mod emulator_worker;
pub mod fake_engine;
pub mod invariants;
pub mod process;
pub mod tcp_proxy;
