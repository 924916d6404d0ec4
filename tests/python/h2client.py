"""HTTP/2 clients for the proxy's HTTP/2 tests (tests/tests/http2.rs): PyPI `httpx[http2]` for
requests, and the PyPI `h2` package for raw frames. Every client goes through the proxy of the
run's env (HTTPS_PROXY) and trusts the appliance CA (SSL_CERT_FILE), as a tool would.

  h2client.py get URL[|NAME:VALUE] [URL ...] [--http1]
      All URLs at once, over one connection (HTTP/2 unless --http1), each with the header
      after `|` if any ($API_TOKEN in it replaced by the placeholder). One JSON line per URL,
      in order: status, http_version, body, the deny reason header.

  h2client.py rapid-reset URL N
      One HTTP/2 connection through the proxy that opens N streams (GET URL) and resets each
      at once (HEADERS then RST_STREAM CANCEL), 50 to a write, until the proxy says GOAWAY
      or closes. One JSON line: goaway (its error code, or null), closed, sent (streams
      opened and reset before that).

  h2client.py continuation URL N
      One HTTP/2 connection through the proxy that sends a HEADERS frame without END_HEADERS,
      then N CONTINUATION frames of ~1 KiB each (the last with END_HEADERS), then reads as
      above. One JSON line: goaway, closed, sent (CONTINUATION frames written before the
      connection refused more), responses (HEADERS frames seen), resets.

  h2client.py bench URL N CONNS
      N GETs of URL over CONNS connections (HTTP/2: CONNS streams at a time on one
      connection when CONNS is negative), after a warm-up. One JSON line: requests per
      second.
"""

import asyncio
import base64
import json
import os
import socket
import ssl
import sys
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events
import hpack
import httpx
from hyperframe.frame import ContinuationFrame, HeadersFrame


def out(**kw):
    print(json.dumps(kw), flush=True)


def tls_context(h2_only=True):
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    ctx.set_alpn_protocols(["h2"] if h2_only else ["h2", "http/1.1"])
    return ctx


async def get(urls, http1):
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(http2=not http1, http1=True, limits=limits, verify=tls_context(False),
                                 trust_env=True, timeout=20) as c:
        async def one(u):
            headers = {}
            if "|" in u:
                u, h = u.split("|", 1)
                name, value = h.split(":", 1)
                headers[name.strip()] = value.strip().replace("$API_TOKEN", os.environ.get("API_TOKEN", ""))
            try:
                r = await c.get(u, headers=headers)
                return dict(url=u, status=r.status_code, http_version=r.http_version, body=r.text,
                            reason=r.headers.get("x-egress-deny-reason"))
            except Exception as e:  # a reset stream, a cut connection: reported, not raised
                return dict(url=u, status=None, error=repr(e))
        for r in await asyncio.gather(*(one(u) for u in urls)):
            out(**r)


def tunnel(url):
    """A TLS connection speaking h2 to URL's host, through the run's proxy (CONNECT)."""
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    target = urllib.parse.urlsplit(url)
    s = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
    auth = base64.b64encode(f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password)}".encode()).decode()
    hostport = f"{target.hostname}:{target.port or 443}"
    s.sendall(f"CONNECT {hostport} HTTP/1.1\r\nHost: {hostport}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        b = s.recv(1)
        if not b:
            raise SystemExit("the proxy closed the CONNECT")
        head += b
    if b" 200" not in head.split(b"\r\n")[0]:
        raise SystemExit(f"CONNECT refused: {head!r}")
    tls = tls_context().wrap_socket(s, server_hostname=target.hostname)
    assert tls.selected_alpn_protocol() == "h2", tls.selected_alpn_protocol()
    return tls, target


def request_headers(target):
    return [(":method", "GET"), (":scheme", "https"), (":authority", target.netloc),
            (":path", target.path or "/")]


def read_until_end(tls, conn, timeout=10):
    """Reads until GOAWAY or close; returns (goaway error code or None, closed, responses)."""
    tls.settimeout(timeout)
    goaway, closed, responses = None, False, 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = tls.recv(65536)
        except (ConnectionError, ssl.SSLError, OSError):
            closed = True
            break
        if not data:
            closed = True
            break
        try:
            events = conn.receive_data(data)
        except Exception:
            closed = True
            break
        for e in events:
            if isinstance(e, h2.events.ConnectionTerminated):
                goaway = int(e.error_code)
            elif isinstance(e, h2.events.ResponseReceived):
                responses += 1
        try:
            tls.sendall(conn.data_to_send())
        except (ConnectionError, ssl.SSLError, OSError):
            closed = True
            break
        if goaway is not None:
            break
    return goaway, closed, responses


def poll_events(tls, conn):
    """What the proxy sent so far, without waiting: (goaway error code or None, closed)."""
    import select
    goaway, closed = None, False
    while select.select([tls], [], [], 0)[0] or tls.pending():
        try:
            data = tls.recv(65536)
        except (ConnectionError, ssl.SSLError, OSError):
            return goaway, True
        if not data:
            return goaway, True
        try:
            events = conn.receive_data(data)
        except Exception:
            return goaway, True
        for e in events:
            if isinstance(e, h2.events.ConnectionTerminated):
                goaway = int(e.error_code)
    return goaway, closed


def rapid_reset(url, n):
    tls, target = tunnel(url)
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    tls.sendall(conn.data_to_send())
    # Streams opened and reset at once, 50 to a write, reading what the proxy says between.
    goaway, closed, sent = None, False, 0
    while sent < n and goaway is None and not closed:
        for _ in range(min(50, n - sent)):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, request_headers(target), end_stream=True)
            conn.reset_stream(sid, error_code=8)
            sent += 1
        try:
            tls.sendall(conn.data_to_send())
        except (ConnectionError, ssl.SSLError, OSError):
            closed = True
            break
        goaway, closed = poll_events(tls, conn)
    if goaway is None and not closed:
        goaway, closed, _ = read_until_end(tls, conn, timeout=3)
    out(goaway=goaway, closed=closed, sent=sent)


def read_raw_until_end(tls, timeout=10):
    """Frames as they come (no HTTP/2 state machine: the flood bypassed it), until GOAWAY or
    close: (goaway error code or None, closed, response HEADERS seen, RST_STREAMs seen)."""
    tls.settimeout(timeout)
    buf, goaway, closed, responses, resets = b"", None, False, 0, 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and goaway is None:
        try:
            data = tls.recv(65536)
        except (ConnectionError, ssl.SSLError, OSError):
            closed = True
            break
        if not data:
            closed = True
            break
        buf += data
        while len(buf) >= 9:
            length = int.from_bytes(buf[0:3], "big")
            if len(buf) < 9 + length:
                break
            kind, payload = buf[3], buf[9:9 + length]
            buf = buf[9 + length:]
            if kind == 0x7:
                goaway = int.from_bytes(payload[4:8], "big")
            elif kind == 0x1:
                responses += 1
            elif kind == 0x3:
                resets += 1
    return goaway, closed, responses, resets


def continuation(url, n):
    tls, target = tunnel(url)
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    tls.sendall(conn.data_to_send())
    enc = hpack.Encoder()
    first = HeadersFrame(1)
    first.flags.add("END_STREAM")
    first.data = enc.encode(request_headers(target))
    tls.sendall(first.serialize())
    sent = 0
    for i in range(n):
        f = ContinuationFrame(1)
        # A new literal header each time (never indexed): ~1 KiB per frame.
        f.data = enc.encode([(f"x-flood-{i}", "a" * 1000)], huffman=False)
        if i == n - 1:
            f.flags.add("END_HEADERS")
        try:
            tls.sendall(f.serialize())
        except (ConnectionError, ssl.SSLError, OSError):
            break
        sent += 1
    goaway, closed, responses, resets = read_raw_until_end(tls)
    out(goaway=goaway, closed=closed, responses=responses, resets=resets, sent=sent)


async def bench(url, n, conns):
    """Requests per second of N GETs: over CONNS HTTP/1.1 connections (one request at a time
    on each), or (CONNS < 0) over one HTTP/2 connection with -CONNS streams at a time."""
    h2_streams = conns < 0
    width = -conns if h2_streams else conns
    clients = []
    for _ in range(1 if h2_streams else width):
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        clients.append(httpx.AsyncClient(http2=h2_streams, http1=not h2_streams, limits=limits,
                                         verify=tls_context(False), trust_env=True, timeout=30))

    async def worker(c, count):
        for _ in range(count):
            r = await c.get(url)
            assert r.status_code == 200, r.status_code

    async def round(total):
        per = total // width
        await asyncio.gather(*(worker(clients[i % len(clients)], per) for i in range(width)))

    await round(max(width * 20, 100))
    t0 = time.perf_counter()
    await round(n)
    took = time.perf_counter() - t0
    for c in clients:
        await c.aclose()
    out(requests=n, seconds=took, per_second=n / took)


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "get":
        http1 = "--http1" in args
        asyncio.run(get([a for a in args if not a.startswith("--")], http1))
    elif cmd == "rapid-reset":
        rapid_reset(args[0], int(args[1]))
    elif cmd == "continuation":
        continuation(args[0], int(args[1]))
    elif cmd == "bench":
        asyncio.run(bench(args[0], int(args[1]), int(args[2])))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
