"""Loom Egress kernel client for Python (one module, standard library only).

Two classes, one per service:

    from loom_egress import ProxyClient, ExecutorClient, EgressError

    proxy = ProxyClient("http://127.0.0.1:3129")          # token: EGRESS_CONTROL_TOKEN
    run = proxy.create_run("weather", labels={"kernel": "k1"})
    # ... hand run["proxy_url"] to the tool as HTTP_PROXY/HTTPS_PROXY ...
    proxy.end_run(run["run_id"])
    for fact in proxy.tail_facts(after=0, timeout=5):    # Server-Sent Events
        print(fact["reason"], fact["target"])

    executor = ExecutorClient("http://127.0.0.1:3130")
    result = executor.invoke("weather", {"city": "Oslo"}, idempotency_key="k-1")
    result["ok"], result.get("output"), result["emits"], result["facts"]

Every call has a timeout (seconds). A non-2xx answer raises `EgressError`
carrying the HTTP status, the JSON error `code` (the executor's `error.kind`
for invocations) and its message. Control calls use `http.client` directly,
so HTTP_PROXY in the kernel's own environment never reroutes them.

API references: docs/api.md (proxy control API), docs/executor.md
(invocation API).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import socket
import time
import urllib.parse
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Union, cast

__all__ = [
    "EgressError",
    "ProxyClient",
    "ExecutorClient",
    "McpError",
    "McpSession",
    "DEFAULT_TIMEOUT",
    "MCP_PROTOCOL_VERSION",
    "MCP_MAX_ANSWER_BYTES",
]

DEFAULT_TIMEOUT: float = 10.0
TOKEN_ENV = "EGRESS_CONTROL_TOKEN"

Json = Any
"""A decoded JSON value."""


class EgressError(Exception):
    """A failed call: `status` (HTTP status, 0 when no answer arrived),
    `code` (`run_not_found`, `unknown_tool`, `unauthorized`, `busy`, … or
    `connection_error` / `timeout` / `bad_response` on the client side),
    `message`, and `body` (the decoded JSON answer, if any)."""

    def __init__(self, status: int, code: str, message: str, body: Json = None) -> None:
        super().__init__("%s %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class _Http:
    """One base URL, a bearer token, JSON in and out, a timeout on every call."""

    def __init__(self, base_url: str, token: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base URL must be http(s)://host:port, got %r" % base_url)
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout = timeout

    def _connect(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        if self._scheme == "https":
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, body: Json) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        if body is not None:
            h["Content-Type"] = "application/json"
        return h

    def request(
        self, method: str, path: str, body: Json = None, timeout: Optional[float] = None, raw: bool = False
    ) -> Json:
        """Send one request; return the decoded JSON (or text with raw=True)."""
        timeout = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode("utf-8")
        conn = self._connect(timeout)
        try:
            try:
                conn.request(method, self._prefix + path, body=data, headers=self._headers(body))
                resp = conn.getresponse()
                payload = resp.read()
            except socket.timeout as e:
                raise EgressError(0, "timeout", "%s %s: no answer within %ss" % (method, path, timeout)) from e
            except (OSError, http.client.HTTPException) as e:
                raise EgressError(0, "connection_error", "%s %s: %s" % (method, path, e)) from e
        finally:
            conn.close()
        return _decode(method, path, resp.status, payload, raw)

    def obj(self, method: str, path: str, body: Json = None, timeout: Optional[float] = None) -> dict[str, Any]:
        """`request` whose answer is a JSON object."""
        return cast("dict[str, Any]", self.request(method, path, body, timeout))

    def text(self, path: str, timeout: Optional[float] = None) -> str:
        """`GET path` as text."""
        return cast(str, self.request("GET", path, None, timeout, raw=True))


def _decode(method: str, path: str, status: int, payload: bytes, raw: bool = False) -> Json:
    text = payload.decode("utf-8", "replace")
    ok = 200 <= status < 300
    if raw and ok:
        return text
    try:
        value = json.loads(text) if text else None
    except ValueError:
        if ok:
            raise EgressError(status, "bad_response", "%s %s: answer is not JSON" % (method, path)) from None
        raise EgressError(status, "http_%d" % status, text.strip()[:500] or "HTTP %d" % status) from None
    if ok:
        return value
    code, message = "http_%d" % status, text.strip()[:500]
    err = value.get("error") if isinstance(value, dict) else None
    if isinstance(err, dict):
        # Proxy and executor API: {"error":{"code",…}}; invocation: {"error":{"kind",…}}.
        named = err.get("code") or err.get("kind")
        code = named if isinstance(named, str) else code
        message = str(err.get("message") or message)
    raise EgressError(status, code, message, value)


def _q(segment: object) -> str:
    return urllib.parse.quote(str(segment), safe="")


class ProxyClient:
    """The proxy's control API (`[proxy] control`, e.g. http://127.0.0.1:3129)."""

    def __init__(self, control_url: str, token: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._http = _Http(control_url, token, timeout)

    # -- runs ---------------------------------------------------------------

    def create_run(
        self,
        tool: str,
        run_id: Optional[str] = None,
        labels: Optional[dict[str, str]] = None,
        activate: bool = True,
        timeout: Optional[float] = None,
    ) -> dict[str, Any]:
        """`POST /v1/runs` → the run with its `secret` and `proxy_url` (only returned here)."""
        body: dict[str, Any] = {"tool": tool, "activate": bool(activate)}
        if run_id is not None:
            body["run_id"] = run_id
        if labels is not None:
            body["labels"] = labels
        return self._http.obj("POST", "/v1/runs", body, timeout)

    def activate_run(self, run_id: str, timeout: Optional[float] = None) -> dict[str, Any]:
        """`POST /v1/runs/{id}/activate` → the run view (`state: "active"`)."""
        return self._http.obj("POST", "/v1/runs/%s/activate" % _q(run_id), None, timeout)

    def grant(
        self,
        run_id: str,
        target: str,
        ttl_ms: Optional[int] = None,
        uses: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> dict[str, Any]:
        """`POST /v1/runs/{id}/grants`: allow this one run `target` ("name:port")
        beyond its tool's allowlist, for `uses` fetches (default 1) until
        `ttl_ms` (default: the run's end) → the grant (`target`, `uses_left`,
        `expires_at`, `fact_id`). For a kernel, after asking a person. Hard
        rules stay: an address, a name resolving only to denied addresses, or
        a host of another tool's credential is `422 grant_not_permitted`."""
        body: dict[str, Any] = {"target": target}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        if uses is not None:
            body["uses"] = uses
        return self._http.obj("POST", "/v1/runs/%s/grants" % _q(run_id), body, timeout)

    def end_run(self, run_id: str, timeout: Optional[float] = None) -> dict[str, Any]:
        """`DELETE /v1/runs/{id}`: revokes the credential, severs open fetches."""
        return self._http.obj("DELETE", "/v1/runs/%s" % _q(run_id), None, timeout)

    def get_run(self, run_id: str, timeout: Optional[float] = None) -> dict[str, Any]:
        """`GET /v1/runs/{id}` → the run view (state, slots, bytes, end_reason)."""
        return self._http.obj("GET", "/v1/runs/%s" % _q(run_id), None, timeout)

    # -- facts --------------------------------------------------------------

    def facts(
        self, after: int = 0, limit: int = 100, run_id: Optional[str] = None, timeout: Optional[float] = None
    ) -> dict[str, Any]:
        """One page of facts with `seq > after`: `{"facts": [...], "next": cursor}`.
        With `run_id`, only that run's facts."""
        query = "?after=%d&limit=%d" % (int(after), int(limit))
        if run_id is None:
            path = "/v1/facts" + query
        else:
            path = "/v1/runs/%s/facts%s" % (_q(run_id), query)
        return self._http.obj("GET", path, None, timeout)

    def all_facts(
        self, after: int = 0, run_id: Optional[str] = None, page: int = 1000, timeout: Optional[float] = None
    ) -> list[dict[str, Any]]:
        """Every fact after the cursor (pages through `facts()`)."""
        out: list[dict[str, Any]] = []
        while True:
            r = self.facts(after=after, limit=page, run_id=run_id, timeout=timeout)
            out.extend(r["facts"])
            if len(r["facts"]) < page:
                return out
            after = r["next"]

    def tail_facts(
        self,
        after: int = 0,
        timeout: Optional[float] = None,
        read_timeout: float = 45.0,
        reconnect_delay: float = 0.5,
        stop: Optional[Callable[[dict[str, Any]], bool]] = None,
    ) -> Iterator[dict[str, Any]]:
        """Iterate over facts from `GET /v1/facts/stream` (replay after the
        cursor, then live). Keep-alive comments are skipped; a dropped or
        silent connection (nothing for `read_timeout` s; the proxy sends a
        keep-alive every 15 s) is reopened from the last `id` seen.

        Ends when `timeout` seconds (total) have passed, when `stop(fact)`
        returns true (after yielding that fact), or when the caller breaks out.
        Errors that are the caller's (401, 400, …) raise `EgressError`;
        `503 too_many_streams` and connection failures are retried."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = int(after)

        def remaining() -> Optional[float]:
            return None if deadline is None else deadline - time.monotonic()

        while True:
            left = remaining()
            if left is not None and left <= 0:
                return
            conn = None
            try:
                wait = read_timeout if left is None else min(read_timeout, left)
                conn = self._http._connect(wait)
                headers = self._http._headers(None)
                headers["Accept"] = "text/event-stream"
                conn.request("GET", self._http._prefix + "/v1/facts/stream?after=%d" % cursor, headers=headers)
                sock = conn.sock  # the response may take it over (close-delimited body)
                resp = conn.getresponse()
                if resp.status != 200:
                    payload = resp.read()
                    if resp.status == 503:
                        raise ConnectionError("stream refused: 503")
                    _decode("GET", "/v1/facts/stream", resp.status, payload)
                    raise EgressError(resp.status, "bad_response", "unexpected status")
                event: dict[str, Any] = {"event": "message", "id": None, "data": []}
                while True:
                    left = remaining()
                    if left is not None and left <= 0:
                        return
                    if sock is not None:
                        sock.settimeout(read_timeout if left is None else min(read_timeout, left))
                    raw_line = resp.readline(1 << 20)  # handles chunked framing
                    if not raw_line:
                        raise ConnectionError("stream closed")
                    line = raw_line.decode("utf-8", "replace").rstrip("\r\n")
                    if line == "":
                        fact = _dispatch(event)
                        event = {"event": "message", "id": None, "data": []}
                        if fact is None:
                            continue
                        if isinstance(fact.get("seq"), int):
                            cursor = max(cursor, fact["seq"])
                        yield fact
                        if stop is not None and stop(fact):
                            return
                        continue
                    if line.startswith(":"):
                        continue  # keep-alive comment
                    field, _, value = line.partition(":")
                    if value.startswith(" "):
                        value = value[1:]
                    if field == "data":
                        event["data"].append(value)
                    elif field == "event":
                        event["event"] = value
                    elif field == "id":
                        event["id"] = value
                        if value.isdigit():
                            cursor = max(cursor, int(value))
            except EgressError:
                raise
            except (OSError, http.client.HTTPException, ConnectionError):
                # Dropped, refused or silent: reconnect from the cursor.
                left = remaining()
                if left is not None and left <= 0:
                    return
                time.sleep(reconnect_delay if left is None else max(0.0, min(reconnect_delay, left)))
            finally:
                if conn is not None:
                    conn.close()

    # -- operations ---------------------------------------------------------

    def reload_policy(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """`POST /v1/policy/reload` (422 `invalid_config` keeps the old policy)."""
        return self._http.obj("POST", "/v1/policy/reload", None, timeout)

    def health(self, timeout: Optional[float] = None) -> bool:
        """True when `/healthz` answers 200."""
        return _probe(self._http, "/healthz", timeout)

    def ready(self, timeout: Optional[float] = None) -> bool:
        """True when `/readyz` answers 200 (the fact store can write)."""
        return _probe(self._http, "/readyz", timeout)

    def on_pending(
        self,
        decide: Callable[[dict[str, Any]], Union[bool, dict[str, Any], None]],
        after: int = 0,
        timeout: Optional[float] = None,
        stop: Optional[Callable[[dict[str, Any]], bool]] = None,
    ) -> None:
        """Answer fetches held for a grant (tools with `on_unlisted = "ask"`):
        for each `EGRESS_PENDING` fact on the fact stream after `after`,
        `decide(fact)` returns a falsy value (leave it: it is denied when its
        `ask_timeout_ms` runs out), `True` (grant its target once to its run)
        or a dict of `grant` options (`uses`, `ttl_ms`). A run that ended
        meanwhile is skipped. Returns when `timeout` seconds have passed or
        `stop(fact)` is true; the other facts of the stream go by."""
        for fact in self.tail_facts(after=after, timeout=timeout, stop=stop):
            if fact.get("type") != "EGRESS_PENDING" or not fact.get("run_id"):
                continue
            answer = decide(fact)
            if not answer:
                continue
            opts = answer if isinstance(answer, dict) else {}
            t = fact.get("target") or {}
            try:
                self.grant(fact["run_id"], "%s:%s" % (t.get("host"), t.get("port")), **opts)
            except EgressError as e:
                if e.status not in (404, 409):
                    raise

    def metrics(self, timeout: Optional[float] = None) -> str:
        """Prometheus/OpenMetrics text of `/metrics`."""
        return self._http.text("/metrics", timeout)


def _dispatch(event: dict[str, Any]) -> Optional[dict[str, Any]]:
    if not event["data"] or event["event"] not in ("fact", "pending", "message"):
        return None
    try:
        value = json.loads("\n".join(event["data"]))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _probe(http_: _Http, path: str, timeout: Optional[float]) -> bool:
    try:
        http_.request("GET", path, None, timeout, raw=True)
        return True
    except EgressError:
        return False


# How many `in_progress` answers an invocation follows to the owning cell.
FOLLOW_MAX = 3


class ExecutorClient:
    """The executor's invocation API (`[executor] listen`, e.g. http://127.0.0.1:3130)."""

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._http = _Http(url, token, timeout)

    def invoke(
        self,
        tool: str,
        input: Json = None,
        idempotency_key: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        run_id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> dict[str, Any]:
        """`POST /v1/invocations` → the invocation result:
        `{ok, tool, output | error{kind, message, stderr_tail}, emits, run_id, facts, stdout, exit, duration_ms}`.

        A tool that failed (`ok: false`: timeout, aborted, tool_error, …) is a
        result, not an exception; `busy` (503), `executable_mismatch` (503: a
        file the tool runs does not match its pin, no child starts),
        `unknown_tool` (404), `bad_request` (400) and `unauthorized` (401)
        raise `EgressError`.
        The HTTP timeout defaults to the invocation's own budget plus a margin.

        In a fleet, a keyed invocation running at another cell answers `409
        in_progress` naming that cell's `control_url`: the same request is
        sent there (at most `FOLLOW_MAX` hops), where it waits for the
        answer. `idempotency_unavailable` (503) raises: nothing ran."""
        body: dict[str, Any] = {"tool": tool, "input": input}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        if timeout_ms is not None:
            body["timeout_ms"] = int(timeout_ms)
        if run_id is not None:
            body["run_id"] = run_id
        if timeout is None:
            # Queueing and a cold start may come before the tool's own clock.
            timeout = max(self._http.timeout, (timeout_ms or 30000) / 1000.0 + 30.0)
        http_ = self._http
        for _ in range(FOLLOW_MAX):
            try:
                return http_.obj("POST", "/v1/invocations", body, timeout)
            except EgressError as e:
                owner = (e.body or {}).get("control_url") if isinstance(e.body, dict) else None
                if e.status != 409 or e.code != "in_progress" or not owner or owner.rstrip("/") == http_.base_url:
                    raise
                http_ = _Http(owner, http_.token, http_.timeout)
        return http_.obj("POST", "/v1/invocations", body, timeout)

    def abort(self, key_or_run_id: str, timeout: Optional[float] = None) -> dict[str, Any]:
        """`POST /v1/invocations/{id}/abort` by idempotency key or run id →
        `{"aborted": true}`; 404 `not_found` when nothing with that id is in flight."""
        return self._http.obj("POST", "/v1/invocations/%s/abort" % _q(key_or_run_id), None, timeout)

    def health(self, timeout: Optional[float] = None) -> bool:
        """True when `/healthz` answers 200."""
        return _probe(self._http, "/healthz", timeout)

    def metrics(self, timeout: Optional[float] = None) -> str:
        """OpenMetrics text of `/metrics`."""
        return self._http.text("/metrics", timeout)

    # -- MCP ----------------------------------------------------------------

    def mcp_url(self, tool: str) -> str:
        """The Streamable HTTP endpoint of an MCP tool, `<url>/v1/mcp/<tool>`:
        what to give an MCP SDK or an agent host, with `mcp_headers()`."""
        return "%s/v1/mcp/%s" % (self._http.base_url, _q(tool))

    def mcp_headers(self) -> dict[str, str]:
        """The headers an MCP SDK sends to `mcp_url(tool)`: the executor's
        bearer token (empty when there is none)."""
        return {"Authorization": "Bearer " + self._http.token} if self._http.token else {}

    def mcp_session(
        self, tool: str, timeout: Optional[float] = None, max_answer_bytes: Optional[int] = None
    ) -> McpSession:
        """Open an MCP session with a confined tool (`initialize`, then
        `notifications/initialized`); close it with `close()` or use it as a
        context manager. Raises `McpError` or `EgressError` when it cannot open."""
        session = McpSession(
            self.mcp_url(tool),
            self._http.token,
            self._http.timeout if timeout is None else timeout,
            MCP_MAX_ANSWER_BYTES if max_answer_bytes is None else max_answer_bytes,
        )
        session.open()
        return session


# The MCP revision this client asks for: the session-based one (Mcp-Session-Id).
MCP_PROTOCOL_VERSION = "2025-11-25"
# The most bytes one MCP answer may have (JSON body, or an SSE stream up to the answer).
MCP_MAX_ANSWER_BYTES = 16 << 20
_SSE_LINE_MAX = 1 << 20


class McpError(Exception):
    """A JSON-RPC error answer: `code` (an integer, e.g. -32602), `message`
    and `data`. A call the executor refused carries the deny `reason`
    (`mcp_tool_not_allowed`, `mcp_arguments_not_allowed`, …) and the
    `fact_id` of the fact it recorded in `data`: see `reason`, `fact_id`.
    `status` is the HTTP status it came with (200, or e.g. 404 for a session
    the server no longer knows when the server answers that in JSON-RPC)."""

    def __init__(self, code: int, message: str, data: Json = None, method: str = "", status: int = 200) -> None:
        super().__init__("%s: JSON-RPC error %s: %s" % (method or "mcp", code, message))
        self.status = status
        self.code = code
        self.message = message
        self.data = data
        self.method = method

    @property
    def reason(self) -> Optional[str]:
        """`data.reason`, when the answer carries one."""
        v = self.data.get("reason") if isinstance(self.data, dict) else None
        return v if isinstance(v, str) else None

    @property
    def fact_id(self) -> Optional[str]:
        """`data.fact_id`, when the answer carries one."""
        v = self.data.get("fact_id") if isinstance(self.data, dict) else None
        return v if isinstance(v, str) else None


def _sse_events(readline: Callable[[int], bytes], budget: int) -> Iterator[tuple[str, str, Optional[str]]]:
    """The events of a `text/event-stream` as `(event, data, id)`, read line
    by line (HTML Living Standard, "Parsing an event stream"): `data:` lines
    joined with newlines, comments skipped, `retry:` and unknown fields
    ignored, an event with no data not dispatched. Reads at most `budget`
    bytes in all and lines of at most 1 MiB; past either it raises `EgressError`."""
    event, data, last_id = "", [], None  # type: str, list[str], Optional[str]
    read = 0
    first = True
    while True:
        raw = readline(_SSE_LINE_MAX + 1)
        read += len(raw)
        if read > budget:
            raise EgressError(0, "too_large", "MCP answer is over %d bytes" % budget)
        if len(raw) > _SSE_LINE_MAX and not raw.endswith(b"\n"):
            raise EgressError(0, "too_large", "an SSE line is over %d bytes" % _SSE_LINE_MAX)
        if not raw:
            return  # an unfinished event at the end of the stream is dropped
        line = raw.decode("utf-8", "replace")
        if first:
            line = line.lstrip("\ufeff")
            first = False
        line = line.rstrip("\n").rstrip("\r")
        if line == "":
            if data:
                yield (event or "message", "\n".join(data), last_id)
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id" and "\0" not in value:
            last_id = value


class McpSession:
    """One MCP session with a tool through the executor's Streamable HTTP
    endpoint (`/v1/mcp/<tool>`): JSON-RPC over POST, each answer JSON or an
    SSE stream, the session named by `Mcp-Session-Id`, ended by DELETE.

        with executor.mcp_session("fetch") as s:
            tools = s.list_tools()
            result = s.call_tool("fetch", {"url": "https://example.org/"})

    A JSON-RPC error answer raises `McpError`; a transport failure or a
    non-2xx HTTP answer that is not JSON-RPC raises `EgressError`. Every
    answer is read within `max_answer_bytes`. Requests and notifications the
    server sends on an answer's stream are skipped (this client declares no
    capabilities)."""

    def __init__(
        self,
        url: str,
        token: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_answer_bytes: int = MCP_MAX_ANSWER_BYTES,
    ) -> None:
        self._http = _Http(url, token, timeout)
        self.url = self._http.base_url
        self.max_answer_bytes = max_answer_bytes
        self.session_id: Optional[str] = None
        self.protocol_version: Optional[str] = None
        self.server_info: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self._ids = itertools.count(1)

    # -- lifecycle ------------------------------------------------------------

    def open(self, client_name: str = "loom-egress", client_version: str = "0.1.0") -> dict[str, Any]:
        """`initialize` (the session id comes with its answer), then
        `notifications/initialized`. Returns the `initialize` result."""
        result = self.request(
            "initialize",
            {
                "protocolVersion": MCP_PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": client_name, "version": client_version},
            },
        )
        self.protocol_version = result.get("protocolVersion") if isinstance(result.get("protocolVersion"), str) else None
        self.server_info = result.get("serverInfo") or {}
        self.capabilities = result.get("capabilities") or {}
        self.notify("notifications/initialized")
        return result

    def close(self, timeout: Optional[float] = None) -> None:
        """`DELETE` the session. A session the server no longer knows (404)
        or one it does not let clients end (405) counts as closed."""
        if self.session_id is None:
            return
        conn = self._http._connect(self._http.timeout if timeout is None else timeout)
        try:
            try:
                conn.request("DELETE", self._http._prefix, headers=self._headers(False))
                resp = conn.getresponse()
                payload = resp.read(64 << 10)
            except (OSError, http.client.HTTPException) as e:
                raise EgressError(0, "connection_error", "DELETE %s: %s" % (self.url, e)) from e
        finally:
            conn.close()
        self.session_id = None
        if resp.status not in (200, 202, 204, 404, 405):
            _decode("DELETE", self.url, resp.status, payload)

    def __enter__(self) -> McpSession:
        if self.session_id is None and self.protocol_version is None:
            self.open()
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

    # -- MCP methods ----------------------------------------------------------

    def list_tools(self) -> list[dict[str, Any]]:
        """`tools/list`, every page: the tools the rules let through."""
        return self._all("tools/list", "tools")

    def call_tool(self, name: str, arguments: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """`tools/call` → its result (`content`, `isError`, `structuredContent`).
        A call the rules refuse raises `McpError` with `reason` and `fact_id`."""
        return self.request("tools/call", {"name": name, "arguments": arguments or {}})

    def list_resources(self) -> list[dict[str, Any]]:
        """`resources/list`, every page."""
        return self._all("resources/list", "resources")

    def read_resource(self, uri: str) -> dict[str, Any]:
        """`resources/read` → `{"contents": [...]}`."""
        return self.request("resources/read", {"uri": uri})

    def list_prompts(self) -> list[dict[str, Any]]:
        """`prompts/list`, every page."""
        return self._all("prompts/list", "prompts")

    def get_prompt(self, name: str, arguments: Optional[dict[str, str]] = None) -> dict[str, Any]:
        """`prompts/get` → `{"messages": [...], ...}`."""
        params: dict[str, Any] = {"name": name}
        if arguments is not None:
            params["arguments"] = arguments
        return self.request("prompts/get", params)

    def ping(self) -> None:
        """`ping`."""
        self.request("ping")

    def _all(self, method: str, key: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cursor: Optional[str] = None
        for _ in range(1000):  # a server that pages forever is cut off
            result = self.request(method, {} if cursor is None else {"cursor": cursor})
            items = result.get(key)
            if isinstance(items, list):
                out.extend(i for i in items if isinstance(i, dict))
            nxt = result.get("nextCursor")
            if not isinstance(nxt, str) or not nxt:
                return out
            cursor = nxt
        raise EgressError(0, "bad_response", "%s: more than 1000 pages" % method)

    # -- JSON-RPC over Streamable HTTP -----------------------------------------

    def request(self, method: str, params: Optional[dict[str, Any]] = None, timeout: Optional[float] = None) -> dict[str, Any]:
        """Any JSON-RPC request → its `result` (an object); an error answer raises `McpError`."""
        rid = next(self._ids)
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        answer = self._post(msg, rid, timeout)
        if answer is None:
            raise EgressError(0, "bad_response", "%s: no answer to request %d" % (method, rid))
        err = answer.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            raise McpError(
                code if isinstance(code, int) else 0,
                str(err.get("message") or ""),
                err.get("data"),
                method,
            )
        result = answer.get("result")
        if not isinstance(result, dict):
            raise EgressError(0, "bad_response", "%s: the answer has no result object" % method)
        return result

    def notify(self, method: str, params: Optional[dict[str, Any]] = None, timeout: Optional[float] = None) -> None:
        """A JSON-RPC notification (no answer expected; the server says 202)."""
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self._post(msg, None, timeout)

    def _headers(self, body: bool) -> dict[str, str]:
        h = self._http._headers({} if body else None)
        h["Accept"] = "application/json, text/event-stream"
        if self.session_id is not None:
            h["Mcp-Session-Id"] = self.session_id
        if self.protocol_version is not None:
            h["Mcp-Protocol-Version"] = self.protocol_version
        return h

    def _post(self, msg: dict[str, Any], rid: Optional[int], timeout: Optional[float]) -> Optional[dict[str, Any]]:
        method = str(msg.get("method"))
        data = json.dumps(msg).encode("utf-8")
        timeout = self._http.timeout if timeout is None else timeout
        conn = self._http._connect(timeout)
        try:
            try:
                conn.request("POST", self._http._prefix, body=data, headers=self._headers(True))
                resp = conn.getresponse()
                sid = resp.getheader("Mcp-Session-Id")
                if sid is not None and self.session_id is None:
                    self.session_id = sid
                ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
                if ctype == "text/event-stream" and 200 <= resp.status < 300:
                    return self._from_sse(resp, rid, method, time.monotonic() + timeout)
                payload = resp.read(self.max_answer_bytes + 1)
            except socket.timeout as e:
                raise EgressError(0, "timeout", "%s: no answer within %ss" % (method, timeout)) from e
            except (OSError, http.client.HTTPException) as e:
                raise EgressError(0, "connection_error", "%s %s: %s" % (method, self.url, e)) from e
        finally:
            conn.close()
        if len(payload) > self.max_answer_bytes:
            raise EgressError(resp.status, "too_large", "%s: answer is over %d bytes" % (method, self.max_answer_bytes))
        if rid is None and 200 <= resp.status < 300:
            return None
        try:
            value = json.loads(payload) if payload else None
        except ValueError:
            value = None
        if rid is not None:
            found = _answer_to(value, rid)
            if found is not None:
                return found
        if not 200 <= resp.status < 300:
            err = value.get("error") if isinstance(value, dict) and "jsonrpc" in value else None
            if isinstance(err, dict) and isinstance(err.get("code"), int):
                # A JSON-RPC error not about this request (id null): the session or the message.
                raise McpError(err["code"], str(err.get("message") or ""), err.get("data"), method, resp.status)
            # Not JSON-RPC: the endpoint's own error ({"error": {"code", "message"}}).
            _decode("POST", self.url, resp.status, payload)
        if rid is None:
            return None
        raise EgressError(resp.status, "bad_response", "%s: the answer is not a JSON-RPC answer to %d" % (method, rid))

    def _from_sse(
        self, resp: http.client.HTTPResponse, rid: Optional[int], method: str, deadline: float
    ) -> Optional[dict[str, Any]]:
        """The answer to `rid` on an SSE stream, within the call's whole
        timeout (a server trickling comments does not hold the call longer)."""

        def readline(limit: int) -> bytes:
            if time.monotonic() > deadline:
                raise EgressError(0, "timeout", "%s: no answer within the timeout" % method)
            return resp.readline(limit)

        for _event, data, _id in _sse_events(readline, self.max_answer_bytes):
            try:
                value = json.loads(data)
            except ValueError:
                continue
            if rid is not None:
                found = _answer_to(value, rid)
                if found is not None:
                    return found
        if rid is None:
            return None
        raise EgressError(resp.status, "bad_response", "%s: the stream ended without an answer" % method)


def _answer_to(value: Json, rid: int) -> Optional[dict[str, Any]]:
    """The JSON-RPC answer with id `rid` in a message or a batch, if any."""
    for m in value if isinstance(value, list) else [value]:
        if isinstance(m, dict) and m.get("id") == rid and ("result" in m or "error" in m):
            return m
    return None
