//! The integration test binary: one module per area.

mod mcp_interop;
mod tools;
