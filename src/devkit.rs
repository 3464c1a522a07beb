//! The devkit: small, faithful stand-ins for the engine, a model provider and a tool server.

pub mod jwt;
