//! Interop with MCP servers nobody here wrote.
