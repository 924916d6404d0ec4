"""Tests of the MCP session methods of loom_egress against a real Streamable
HTTP MCP server: the official Python SDK's, started by
clients/testing/mcp_server.py on 127.0.0.1 (port 0) at /v1/mcp/<tool>, behind
a bearer check, answering as SSE (and, in a second server, as JSON).

    python3 -m unittest discover -s clients/python -v        # from the repository root

Needs the `mcp` package (clients/python/requirements-test.txt); without it
these tests fail, they do not skip.
"""

import http.server
import io
import os
import subprocess
import sys
import threading
import time
import unittest
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from loom_egress import EgressError, ExecutorClient, McpError, McpSession  # noqa: E402
from loom_egress import _sse_events  # noqa: E402

SERVER = os.path.join(os.path.dirname(HERE), "testing", "mcp_server.py")
TOKEN = "mcp-test-token-0123456789"


class McpServer:
    """The SDK server as a child process; `url` is its base URL."""

    def __init__(self, json_response: bool = False) -> None:
        args = [sys.executable, SERVER, "--tool", "demo", "--token", TOKEN]
        if json_response:
            args.append("--json")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.proc.kill()
            raise RuntimeError("the MCP test server did not start (is `mcp` installed?): %r" % line)
        self.url = "http://127.0.0.1:%d" % int(line.split()[1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


SSE: Optional[McpServer] = None
JSON: Optional[McpServer] = None


def setUpModule() -> None:
    global SSE, JSON
    SSE = McpServer()
    JSON = McpServer(json_response=True)


def tearDownModule() -> None:
    for s in (SSE, JSON):
        if s is not None:
            s.stop()


def client(server: Optional[McpServer], token: str = TOKEN) -> ExecutorClient:
    assert server is not None
    return ExecutorClient(server.url, token=token, timeout=10)


class McpSessionTest(unittest.TestCase):
    def check_session(self, server: Optional[McpServer]) -> None:
        with client(server).mcp_session("demo") as s:
            self.assertTrue(s.session_id)
            self.assertEqual(s.protocol_version, "2025-11-25")
            self.assertEqual(s.server_info.get("name"), "clients-test")
            self.assertEqual(sorted(t["name"] for t in s.list_tools()), ["echo", "refused", "shout"])
            r = s.call_tool("echo", {"text": "hi"})
            self.assertFalse(r["isError"])
            self.assertEqual(r["content"][0]["text"], "echo: hi")
            self.assertEqual([x["uri"] for x in s.list_resources()], ["demo://greeting"])
            self.assertEqual(s.read_resource("demo://greeting")["contents"][0]["text"], "hello from a resource")
            self.assertEqual([p["name"] for p in s.list_prompts()], ["greet"])
            p = s.get_prompt("greet", {"name": "Ann"})
            self.assertEqual(p["messages"][0]["content"]["text"], "Say hello to Ann")
            self.assertEqual(s.request("tools/call", {"name": "shout", "arguments": {"text": "a"}})["content"][0]["text"], "A")
            s.ping()
            sid = s.session_id
        # Closed: the server no longer knows the session id.
        self.assertIsNone(s.session_id)
        stale = McpSession(client(server).mcp_url("demo"), TOKEN)
        stale.session_id, stale.protocol_version = sid, "2025-11-25"
        with self.assertRaises((EgressError, McpError)) as cm:
            stale.list_tools()
        self.assertEqual(cm.exception.status, 404)
        self.assertIsInstance(cm.exception.code, int if isinstance(cm.exception, McpError) else str)

    def test_session_over_sse(self) -> None:
        self.check_session(SSE)

    def test_session_over_json(self) -> None:
        self.check_session(JSON)

    def test_jsonrpc_error_is_typed_with_reason_and_fact_id(self) -> None:
        for server in (SSE, JSON):
            with client(server).mcp_session("demo") as s:
                with self.assertRaises(McpError) as cm:
                    s.call_tool("refused", {"url": "https://example.org/"})
                e = cm.exception
                self.assertEqual(e.code, -32001)
                self.assertIn("not allowed", e.message)
                self.assertEqual(e.reason, "mcp_tool_not_allowed")
                self.assertEqual(e.fact_id, "fact-0001")
                self.assertEqual(e.data["tool"], "refused")
                with self.assertRaises(McpError) as cm:
                    s.request("no/such/method")
                self.assertEqual(cm.exception.code, -32601)
                self.assertIsNone(cm.exception.reason)
                # The session is still good after an error.
                self.assertEqual(s.call_tool("echo", {"text": "x"})["content"][0]["text"], "echo: x")

    def test_bearer_token_is_sent(self) -> None:
        with self.assertRaises(EgressError) as cm:
            client(SSE, token="wrong-token").mcp_session("demo")
        self.assertEqual(cm.exception.status, 401)
        self.assertEqual(cm.exception.code, "unauthorized")

    def test_url_and_headers_for_an_sdk(self) -> None:
        c = ExecutorClient("http://127.0.0.1:3130/", token="t0k")
        self.assertEqual(c.mcp_url("my tool"), "http://127.0.0.1:3130/v1/mcp/my%20tool")
        self.assertEqual(c.mcp_headers(), {"Authorization": "Bearer t0k"})

    def test_official_sdk_client_with_url_and_headers(self) -> None:
        # What docs/clients.md shows: the SDK's own client, handed mcp_url and mcp_headers.
        import anyio
        import httpx2
        from mcp import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        c = client(SSE)

        async def main() -> Any:
            async with httpx2.AsyncClient(headers=c.mcp_headers()) as http:
                async with streamable_http_client(c.mcp_url("demo"), http_client=http) as (read, write, *_):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        return await session.call_tool("echo", {"text": "sdk"})

        r = anyio.run(main)
        self.assertEqual(r.content[0].text, "echo: sdk")

    def test_answer_bound(self) -> None:
        with client(SSE).mcp_session("demo", max_answer_bytes=600) as s:
            with self.assertRaises(EgressError) as cm:
                s.list_tools()
            self.assertEqual(cm.exception.code, "too_large")


class _Trickle(http.server.BaseHTTPRequestHandler):
    """An MCP endpoint that answers every POST with an SSE stream of comments only."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Mcp-Session-Id", "s-1")
        self.end_headers()
        try:
            for _ in range(400):  # 20 s at most
                self.wfile.write(b": still here\n\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def log_message(self, *args: Any) -> None:
        pass


class HostileServerTest(unittest.TestCase):
    def test_a_trickling_stream_is_cut_at_the_timeout(self) -> None:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            url = "http://127.0.0.1:%d/v1/mcp/demo" % srv.server_address[1]
            t0 = time.monotonic()
            with self.assertRaises(EgressError) as cm:
                McpSession(url, "t", timeout=1.0).open()
            self.assertEqual(cm.exception.code, "timeout")
            self.assertLess(time.monotonic() - t0, 10)
        finally:
            srv.shutdown()
            srv.server_close()


def events(text: bytes, budget: int = 1 << 20) -> list:
    return list(_sse_events(io.BytesIO(text).readline, budget))


class SseParserTest(unittest.TestCase):
    def test_multi_line_data_comments_ids(self) -> None:
        got = events(
            b"\xef\xbb\xbf: a comment\r\n"
            b"event: message\nid: 7\ndata: {\"a\":\ndata:  1}\nretry: 10\nunknown: x\n\n"
            b":keep-alive\n\n"
            b"data\n\n"
            b"id: 8\ndata:x\n\n"
            b"data: unfinished"
        )
        self.assertEqual(got, [("message", '{"a":\n 1}', "7"), ("message", "", "7"), ("message", "x", "8")])

    def test_bounds(self) -> None:
        with self.assertRaises(EgressError):
            events(b"data: " + b"x" * (2 << 20) + b"\n\n", budget=64 << 20)
        with self.assertRaises(EgressError):
            events(b"data: x\n\n" * 100, budget=500)


if __name__ == "__main__":
    unittest.main()
