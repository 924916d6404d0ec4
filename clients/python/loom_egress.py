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

import http.client
import json
import os
import socket
import time
import urllib.parse

__all__ = ["EgressError", "ProxyClient", "ExecutorClient", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 10.0
TOKEN_ENV = "EGRESS_CONTROL_TOKEN"


class EgressError(Exception):
    """A failed call: `status` (HTTP status, 0 when no answer arrived),
    `code` (`run_not_found`, `unknown_tool`, `unauthorized`, `busy`, … or
    `connection_error` / `timeout` / `bad_response` on the client side),
    `message`, and `body` (the decoded JSON answer, if any)."""

    def __init__(self, status, code, message, body=None):
        super().__init__("%s %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class _Http:
    """One base URL, a bearer token, JSON in and out, a timeout on every call."""

    def __init__(self, base_url, token=None, timeout=DEFAULT_TIMEOUT):
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

    def _connect(self, timeout):
        if self._scheme == "https":
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, body):
        h = {"Accept": "application/json"}
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        if body is not None:
            h["Content-Type"] = "application/json"
        return h

    def request(self, method, path, body=None, timeout=None, raw=False):
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


def _decode(method, path, status, payload, raw=False):
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
        code = err.get("code") or err.get("kind") or code
        message = err.get("message") or message
    raise EgressError(status, code, message, value)


def _q(segment):
    return urllib.parse.quote(str(segment), safe="")


class ProxyClient:
    """The proxy's control API (`[proxy] control`, e.g. http://127.0.0.1:3129)."""

    def __init__(self, control_url, token=None, timeout=DEFAULT_TIMEOUT):
        self._http = _Http(control_url, token, timeout)

    # -- runs ---------------------------------------------------------------

    def create_run(self, tool, run_id=None, labels=None, activate=True, timeout=None):
        """`POST /v1/runs` → the run with its `secret` and `proxy_url` (only returned here)."""
        body = {"tool": tool, "activate": bool(activate)}
        if run_id is not None:
            body["run_id"] = run_id
        if labels is not None:
            body["labels"] = labels
        return self._http.request("POST", "/v1/runs", body, timeout)

    def activate_run(self, run_id, timeout=None):
        """`POST /v1/runs/{id}/activate` → the run view (`state: "active"`)."""
        return self._http.request("POST", "/v1/runs/%s/activate" % _q(run_id), None, timeout)

    def grant(self, run_id, target, ttl_ms=None, uses=None, timeout=None):
        """`POST /v1/runs/{id}/grants`: allow this one run `target` ("name:port")
        beyond its tool's allowlist, for `uses` fetches (default 1) until
        `ttl_ms` (default: the run's end) → the grant (`target`, `uses_left`,
        `expires_at`, `fact_id`). For a kernel, after asking a person. Hard
        rules stay: an address, a name resolving only to denied addresses, or
        a host of another tool's credential is `422 grant_not_permitted`."""
        body = {"target": target}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        if uses is not None:
            body["uses"] = uses
        return self._http.request("POST", "/v1/runs/%s/grants" % _q(run_id), body, timeout)

    def end_run(self, run_id, timeout=None):
        """`DELETE /v1/runs/{id}`: revokes the credential, severs open fetches."""
        return self._http.request("DELETE", "/v1/runs/%s" % _q(run_id), None, timeout)

    def get_run(self, run_id, timeout=None):
        """`GET /v1/runs/{id}` → the run view (state, slots, bytes, end_reason)."""
        return self._http.request("GET", "/v1/runs/%s" % _q(run_id), None, timeout)

    # -- facts --------------------------------------------------------------

    def facts(self, after=0, limit=100, run_id=None, timeout=None):
        """One page of facts with `seq > after`: `{"facts": [...], "next": cursor}`.
        With `run_id`, only that run's facts."""
        query = "?after=%d&limit=%d" % (int(after), int(limit))
        if run_id is None:
            path = "/v1/facts" + query
        else:
            path = "/v1/runs/%s/facts%s" % (_q(run_id), query)
        return self._http.request("GET", path, None, timeout)

    def all_facts(self, after=0, run_id=None, page=1000, timeout=None):
        """Every fact after the cursor (pages through `facts()`)."""
        out = []
        while True:
            r = self.facts(after=after, limit=page, run_id=run_id, timeout=timeout)
            out.extend(r["facts"])
            if len(r["facts"]) < page:
                return out
            after = r["next"]

    def tail_facts(self, after=0, timeout=None, read_timeout=45.0, reconnect_delay=0.5, stop=None):
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

        def remaining():
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
                event = {"event": "message", "id": None, "data": []}
                while True:
                    left = remaining()
                    if left is not None and left <= 0:
                        return
                    sock.settimeout(read_timeout if left is None else min(read_timeout, left))
                    line = resp.readline(1 << 20)  # handles chunked framing
                    if not line:
                        raise ConnectionError("stream closed")
                    line = line.decode("utf-8", "replace").rstrip("\r\n")
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

    def reload_policy(self, timeout=None):
        """`POST /v1/policy/reload` (422 `invalid_config` keeps the old policy)."""
        return self._http.request("POST", "/v1/policy/reload", None, timeout)

    def health(self, timeout=None):
        """True when `/healthz` answers 200."""
        return _probe(self._http, "/healthz", timeout)

    def ready(self, timeout=None):
        """True when `/readyz` answers 200 (the fact store can write)."""
        return _probe(self._http, "/readyz", timeout)

    def on_pending(self, decide, after=0, timeout=None, stop=None):
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

    def metrics(self, timeout=None):
        """Prometheus/OpenMetrics text of `/metrics`."""
        return self._http.request("GET", "/metrics", None, timeout, raw=True)


def _dispatch(event):
    if not event["data"] or event["event"] not in ("fact", "pending", "message"):
        return None
    try:
        value = json.loads("\n".join(event["data"]))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _probe(http_, path, timeout):
    try:
        http_.request("GET", path, None, timeout, raw=True)
        return True
    except EgressError:
        return False


# How many `in_progress` answers an invocation follows to the owning cell.
FOLLOW_MAX = 3


class ExecutorClient:
    """The executor's invocation API (`[executor] listen`, e.g. http://127.0.0.1:3130)."""

    def __init__(self, url, token=None, timeout=DEFAULT_TIMEOUT):
        self._http = _Http(url, token, timeout)

    def invoke(self, tool, input=None, idempotency_key=None, timeout_ms=None, run_id=None, timeout=None):
        """`POST /v1/invocations` → the invocation result:
        `{ok, tool, output | error{kind, message, stderr_tail}, emits, run_id, facts, stdout, exit, duration_ms}`.

        A tool that failed (`ok: false`: timeout, aborted, tool_error, …) is a
        result, not an exception; `busy` (503), `unknown_tool` (404),
        `bad_request` (400) and `unauthorized` (401) raise `EgressError`.
        The HTTP timeout defaults to the invocation's own budget plus a margin.

        In a fleet, a keyed invocation running at another cell answers `409
        in_progress` naming that cell's `control_url`: the same request is
        sent there (at most `FOLLOW_MAX` hops), where it waits for the
        answer. `idempotency_unavailable` (503) raises: nothing ran."""
        body = {"tool": tool, "input": input}
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
                return http_.request("POST", "/v1/invocations", body, timeout)
            except EgressError as e:
                owner = (e.body or {}).get("control_url") if isinstance(e.body, dict) else None
                if e.status != 409 or e.code != "in_progress" or not owner or owner.rstrip("/") == http_.base_url:
                    raise
                http_ = _Http(owner, http_.token, http_.timeout)
        return http_.request("POST", "/v1/invocations", body, timeout)

    def abort(self, key_or_run_id, timeout=None):
        """`POST /v1/invocations/{id}/abort` by idempotency key or run id →
        `{"aborted": true}`; 404 `not_found` when nothing with that id is in flight."""
        return self._http.request("POST", "/v1/invocations/%s/abort" % _q(key_or_run_id), None, timeout)

    def health(self, timeout=None):
        """True when `/healthz` answers 200."""
        return _probe(self._http, "/healthz", timeout)

    def metrics(self, timeout=None):
        """OpenMetrics text of `/metrics`."""
        return self._http.request("GET", "/metrics", None, timeout, raw=True)
