//! Shared test helpers.

pub mod emulator_worker;
pub mod fake_engine;
pub mod invariants;
pub mod net;
pub mod peers;
pub mod process;
pub mod tcp_proxy;
pub mod wait;
