"""A real Streamable HTTP MCP server for the kernel clients' tests.

    python3 clients/testing/mcp_server.py --tool demo --token T [--json] [--allow-host H:P]

The official Python SDK's MCPServer (pinned in
clients/python/requirements-test.txt) at `/v1/mcp/<tool>` on 127.0.0.1, port
chosen by the OS, printed as `port N` on stdout once it listens. It answers
POSTs as SSE (or as JSON with --json), and refuses a request without
`Authorization: Bearer <token>` with 401, as the executor's endpoint does.
Tools: `echo` (succeeds), `refused` (a JSON-RPC error whose `data` carries a
deny `reason` and `fact_id`, as the executor's refusals do), `shout`; one
resource `demo://greeting` and one prompt `greet`. `--allow-host` adds a
Host header value its DNS-rebinding check accepts (the proxy's tests put it
behind TLS under another name).
"""

import argparse
import json
import socket
import sys
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError


def build(tool: str, token: str, json_response: bool, allow_hosts: list[str]) -> Any:
    server = MCPServer("clients-test")

    @server.tool()
    def echo(text: str) -> str:
        """Answers its text."""
        return "echo: " + text

    @server.tool()
    def shout(text: str) -> str:
        """Answers its text in capitals."""
        return text.upper()

    @server.tool()
    def refused(url: str) -> str:
        """Always refused, as a rule refuses a call."""
        raise MCPError(
            code=-32001,
            message="tool call refused: fetch is not allowed",
            data={"reason": "mcp_tool_not_allowed", "fact_id": "fact-0001", "tool": "refused"},
        )

    @server.resource("demo://greeting")
    def greeting() -> str:
        """A fixed text."""
        return "hello from a resource"

    @server.prompt()
    def greet(name: str) -> str:
        """A greeting for a name."""
        return "Say hello to " + name

    security = None
    if allow_hosts:
        from mcp.server.transport_security import TransportSecuritySettings

        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", *allow_hosts],
            allowed_origins=[],
        )
    app = server.streamable_http_app(
        streamable_http_path="/v1/mcp/" + tool, json_response=json_response, transport_security=security
    )
    expected = ("Bearer " + token).encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            body = json.dumps({"error": {"code": "unauthorized", "message": "bearer token required"}}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return guarded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", default="demo")
    ap.add_argument("--token", required=True)
    ap.add_argument("--json", action="store_true", help="answer POSTs as JSON instead of SSE")
    ap.add_argument("--allow-host", action="append", default=[], help="a Host header value to accept too")
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until the server accepts
    port = sock.getsockname()[1]
    config = uvicorn.Config(build(args.tool, args.token, args.json, args.allow_host), log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    print("port %d" % port, flush=True)
    srv.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
