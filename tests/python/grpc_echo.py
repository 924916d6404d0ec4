"""A gRPC origin and client for the proxy's HTTP/2 tests (tests/tests/http2.rs), both the PyPI
`grpcio` package, with raw-bytes messages (no generated code).

  grpc_echo.py serve --cert C --key K
      A TLS gRPC server on 127.0.0.2: prints its port, then one JSON line per call (method,
      the `authorization` metadata it received). Methods: /test.Echo/Say (unary: answers
      b"echo:" + the request) and /test.Echo/Count (server streaming: N messages b"n=<i>" for
      a request b"<N>").

  grpc_echo.py call HOST:PORT --ca FILE [--direct ADDR] [--say TEXT] [--count N] [--calls N]
      Calls through the proxy of the run's env (grpc's own HTTPS_PROXY support: CONNECT with
      the run credential), trusting FILE (the appliance CA), with metadata
      `authorization: Bearer $API_TOKEN` (the placeholder). --direct ADDR connects straight to
      ADDR instead (the name still used for TLS). Prints one JSON line per result, or, with
      --calls N, one line with unary calls per second.
"""

import json
import os
import sys
import time
from concurrent import futures

import grpc


def out(**kw):
    print(json.dumps(kw), flush=True)


def ident(b):
    return b


def serve(cert, key):
    def meta(ctx):
        return dict(ctx.invocation_metadata()).get("authorization")

    def say(req, ctx):
        out(event="call", method="Say", authorization=meta(ctx))
        return b"echo:" + req

    def count(req, ctx):
        out(event="call", method="Count", authorization=meta(ctx))
        for i in range(int(req.decode())):
            yield f"n={i}".encode()

    handlers = grpc.method_handlers_generic_handler("test.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(say, ident, ident),
        "Count": grpc.unary_stream_rpc_method_handler(count, ident, ident),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handlers,))
    creds = grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())])
    port = server.add_secure_port("127.0.0.2:0", creds)
    server.start()
    out(port=port)
    server.wait_for_termination()


def call(target, ca, direct, say, count, calls):
    creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
    host = target.rsplit(":", 1)[0]
    options = []
    target_addr = target
    if direct:
        # Straight to ADDR, with the name for TLS and the same :authority.
        options = [("grpc.enable_http_proxy", 0), ("grpc.ssl_target_name_override", host),
                   ("grpc.default_authority", target)]
        target_addr = direct
    md = (("authorization", f"Bearer {os.environ.get('API_TOKEN', '')}"),)
    with grpc.secure_channel(target_addr, creds, options=options) as ch:
        unary = ch.unary_unary("/test.Echo/Say", request_serializer=ident, response_deserializer=ident)
        stream = ch.unary_stream("/test.Echo/Count", request_serializer=ident, response_deserializer=ident)
        try:
            if calls:
                for _ in range(200):
                    unary(b"warm", metadata=md, timeout=10)
                t0 = time.perf_counter()
                for _ in range(calls):
                    unary(b"x", metadata=md, timeout=10)
                took = time.perf_counter() - t0
                out(calls=calls, seconds=took, per_second=calls / took)
                return
            if say is not None:
                r = unary(say.encode(), metadata=md, timeout=10)
                out(kind="unary", reply=r.decode())
            if count is not None:
                got = [m.decode() for m in stream(str(count).encode(), metadata=md, timeout=10)]
                out(kind="stream", replies=got)
        except grpc.RpcError as e:
            out(kind="error", code=str(e.code()), details=e.details(),
                trailers={k: v for k, v in (e.trailing_metadata() or ())})


def main():
    cmd, args = sys.argv[1], sys.argv[2:]

    def opt(name, default=None):
        return args[args.index(name) + 1] if name in args else default

    if cmd == "serve":
        serve(opt("--cert"), opt("--key"))
    elif cmd == "call":
        calls = opt("--calls")
        count = opt("--count")
        call(args[0], opt("--ca"), opt("--direct"), opt("--say"), int(count) if count else None,
             int(calls) if calls else None)
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
