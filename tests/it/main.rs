//! The integration test binary (one binary keeps link time down): one module per area.

mod agent;
mod approval;
mod core_http;
mod demo;
mod durable;
mod emulator;
mod faults;
mod fuzz_props;
mod loadtest_smoke;
mod mcp_interop;
mod oidc;
mod operations;
mod provider;
mod runner;
mod secure;
mod store;
mod support;
mod tools;
