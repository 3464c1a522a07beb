//! Shared test helpers.

pub mod chaos;
pub mod emulator_worker;
pub mod invariants;
pub mod net;
pub mod peers;
pub mod process;
pub mod scratch;
pub mod steps;
pub mod tcp_proxy;
pub mod wait;
