//! The integration test binary (one binary keeps link time down): one module per area.

mod agent;
mod approval;
mod checker;
mod content_keys;
mod core_http;
mod demo;
mod durable;
mod emulator;
mod faults;
mod fuzz_props;
mod hostile;
mod hostile_model;
mod loadtest_smoke;
mod mcp_interop;
mod oidc;
mod operations;
mod provider;
mod proxy_headers;
mod refusals;
mod registry;
mod runner;
mod secure;
mod store;
mod store_runs;
mod support;
mod tools;
