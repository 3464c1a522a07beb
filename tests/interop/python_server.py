"""An MCP server built with the Python `mcp` SDK, for the interop tests (tests/it/mcp_interop.rs).

Run: python python_server.py. Serves streamable HTTP at /mcp on a port of 127.0.0.1 that the
system picks, and announces it on stdout as {"event": "listening", "port": <port>} (bound and
listening before it is announced, so the test never hands out a port someone else could take).
Its `record_key` tool answers with the `_meta` it received (idempotency key, traceparent) and the
Authorization header, so the Rust client can check they arrived intact.
"""

import json
import socket

import anyio
import uvicorn
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
    # What app.run("streamable-http") does, on a socket bound here to port 0.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    config = uvicorn.Config(
        app.streamable_http_app(host="127.0.0.1"),
        log_level=app.settings.log_level.lower(),
    )
    print(json.dumps({"event": "listening", "port": listener.getsockname()[1]}), flush=True)
    anyio.run(uvicorn.Server(config).serve, [listener])
