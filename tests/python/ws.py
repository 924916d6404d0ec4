"""WebSocket origin and client for the proxy's WebSocket tests (tests/tests/websocket.rs),
both the PyPI `websockets` package.

  ws.py serve [--cert C --key K]
      An echo origin on 127.0.0.2 (wss with a certificate): prints its port, then one JSON
      line per event: the handshake (path, Authorization, extensions offered) and every
      message received. Text and binary messages are echoed back; on /ws/reflect the echo
      also carries the handshake's bearer credential (a reflection).

  ws.py client URI [--forward] [--hold] [--split] [--big N] [--binary TEXT] [TEXT ...]
      Connects through the proxy of the run's env: for wss:// the package's own proxy support
      (CONNECT, from HTTPS_PROXY; the appliance CA from SSL_CERT_FILE); with --forward, a ws://
      handshake sent to the proxy in absolute form (the forward path), the run credential
      from HTTP_PROXY. Sends each TEXT (then --binary ones, then a text of N bytes) and
      prints each reply as JSON; --split sends each message in fragments of 7 bytes;
      --hold waits until the connection is closed and prints when and how. A refused
      handshake prints its status and deny reason.

  ws.py bench URI [--forward | --direct HOST] N
      Echo round trips of a 64-byte text message (after 200 to warm up): through the proxy
      of the run's env as `client` connects, or with --direct straight to HOST (the URI's
      name still used for TLS). Prints one JSON line: p50 and p99 in microseconds.
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

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidStatus


def out(**kw):
    print(json.dumps(kw), flush=True)


async def origin(cert, key):
    async def handler(ws):
        h = ws.request.headers
        out(event="open", path=ws.request.path, authorization=h.get("Authorization"),
            extensions=h.get("Sec-WebSocket-Extensions"))
        try:
            # /ws/reflect answers each message with the message and the
            # credential the handshake carried (a reflection, as a careless
            # API does), in the message's own type.
            token = (h.get("Authorization") or "").removeprefix("Bearer ")
            reflect = ws.request.path == "/ws/reflect"
            async for m in ws:
                if isinstance(m, bytes):
                    out(event="binary", data=m.decode("utf-8", "replace"))
                    reply = m + b" " + token.encode() if reflect else m
                else:
                    out(event="text", data=m)
                    reply = f"{m} {token}" if reflect else m
                await ws.send(reply)
        except ConnectionClosed:
            pass
        out(event="closed")

    ctx = None
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
    async with serve(handler, "127.0.0.2", 0, ssl=ctx, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        out(port=port)
        await asyncio.Future()


def forward_connection(absolute, auth):
    """A connection whose handshake names the whole URI and carries the run credential:
    what a client speaking to an HTTP proxy sends for plain HTTP."""

    class Forward(ClientConnection):
        def __init__(self, protocol, **kw):
            first = protocol.connect

            def connect_absolute():
                req = first()
                req.path = absolute + req.path
                req.headers["Proxy-Authorization"] = auth
                return req

            protocol.connect = connect_absolute
            super().__init__(protocol, **kw)

    return Forward


async def client(uri, forward, hold, texts, binaries, big, split):
    kw = {"open_timeout": 10, "ping_interval": None, "max_size": None}
    if forward:
        p = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
        auth = "Basic " + base64.b64encode(
            f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password)}".encode()).decode()
        u = urllib.parse.urlsplit(uri)
        absolute = f"http://{u.netloc}"
        kw["sock"] = socket.create_connection((p.hostname, p.port))
        kw["create_connection"] = forward_connection(absolute, auth)
    t0 = time.monotonic()
    try:
        ws = await connect(uri, **kw)
    except InvalidStatus as e:
        r = e.response
        out(event="refused", status=r.status_code, reason=r.headers.get("X-Egress-Deny-Reason"),
            error=r.headers.get("X-Egress-Error"))
        return
    out(event="open", status=ws.response.status_code, accept=ws.response.headers.get("Sec-WebSocket-Accept"))
    try:
        def pieces(m):
            return [m[i:i + 7] for i in range(0, len(m), 7)] if split else m

        for t in texts:
            await ws.send(pieces(t))
            out(event="reply", data=await asyncio.wait_for(ws.recv(), 10))
        for b in binaries:
            await ws.send(pieces(b.encode()))
            r = await asyncio.wait_for(ws.recv(), 10)
            out(event="reply", data=r.decode("utf-8", "replace") if isinstance(r, bytes) else r)
        if big:
            await ws.send("x" * big)
            r = await asyncio.wait_for(ws.recv(), 10)
            out(event="reply", length=len(r))
        if hold:
            out(event="holding")
            t1 = time.monotonic()
            await asyncio.wait_for(ws.wait_closed(), 30)
            out(event="closed", after_ms=int((time.monotonic() - t1) * 1000),
                code=ws.close_code, reason=ws.close_reason)
    except ConnectionClosed as e:
        out(event="closed", after_ms=int((time.monotonic() - t0) * 1000),
            code=e.rcvd.code if e.rcvd else None, reason=e.rcvd.reason if e.rcvd else None)
    else:
        await ws.close()


async def bench(uri, forward, direct, n):
    kw = {"open_timeout": 10, "ping_interval": None, "max_size": None}
    u = urllib.parse.urlsplit(uri)
    if direct:
        kw["sock"] = socket.create_connection((direct, u.port))
    elif forward:
        p = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
        auth = "Basic " + base64.b64encode(
            f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password)}".encode()).decode()
        kw["sock"] = socket.create_connection((p.hostname, p.port))
        kw["create_connection"] = forward_connection(f"http://{u.netloc}", auth)
    ws = await connect(uri, **kw)
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = "m" * 64
    for _ in range(200):
        await ws.send(msg)
        await ws.recv()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await ws.send(msg)
        await ws.recv()
        times.append(time.perf_counter_ns() - t0)
    await ws.close()
    times.sort()
    out(p50_us=round(times[len(times) // 2] / 1000, 1), p99_us=round(times[int(len(times) * 0.99)] / 1000, 1), n=n)


def main(argv):
    if argv[0] == "bench":
        direct = argv[argv.index("--direct") + 1] if "--direct" in argv else None
        asyncio.run(bench(argv[1], "--forward" in argv, direct, int(argv[-1])))
        return
    if argv[0] == "serve":
        cert = key = None
        if "--cert" in argv:
            cert = argv[argv.index("--cert") + 1]
            key = argv[argv.index("--key") + 1]
        asyncio.run(origin(cert, key))
        return
    uri = argv[1]
    rest = argv[2:]
    forward = "--forward" in rest
    hold = "--hold" in rest
    texts, binaries, big = [], [], 0
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--big":
            big = int(rest[i + 1])
            i += 2
            continue
        if a == "--binary":
            binaries.append(rest[i + 1])
            i += 2
            continue
        if a == "--split":
            i += 1
            continue
        if not a.startswith("--"):
            texts.append(a)
        i += 1
    asyncio.run(client(uri, forward, hold, texts, binaries, big, "--split" in rest))


if __name__ == "__main__":
    main(sys.argv[1:])
