//! The integration test binary (one binary keeps link time down): one module per area.

mod agent;
mod emulator;
mod loadtest_smoke;
mod mcp_interop;
mod oidc;
mod provider;
mod runner;
mod support;
mod tools;
