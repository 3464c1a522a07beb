"""An MCP server built with the Python `mcp` SDK, for the interop tests (tests/it/mcp_interop.rs).

Run: python python_server.py <port>. Serves streamable HTTP on 127.0.0.1:<port>/mcp.
Its `record_key` tool answers with the `_meta` it received (idempotency key, traceparent) and the
Authorization header, so the Rust client can check they arrived intact.
"""

import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

app = MCPServer("abada-interop-python")


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def shout(text: str) -> str:
    """Returns the text in upper case."""
    return text.upper()


@app.tool()
def record_key(note: str, ctx: Context) -> dict:
    """A write: echoes the idempotency key and traceparent from _meta, and the bearer token."""
    meta = ctx.request_context.meta or {}
    request = ctx.request_context.request
    authorization = request.headers.get("authorization") if request is not None else None
    return {
        "note": note,
        "idempotencyKey": meta.get("io.abada/idempotency-key"),
        "traceparent": meta.get("traceparent"),
        "authorization": authorization,
    }


if __name__ == "__main__":
    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
