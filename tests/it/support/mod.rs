//! Shared test helpers.

pub mod fake_engine;
pub mod process;
