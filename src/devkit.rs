//! The devkit: small, faithful stand-ins for the engine, model providers and tool servers, used
//! by the tests and by `abada-agent-worker demo`.

pub mod model;
pub mod tools;
