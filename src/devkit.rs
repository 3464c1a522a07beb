//! Faithful stand-ins for the systems around the worker (engine, model providers, tool servers), used by the tests and the demo.

pub mod model;
