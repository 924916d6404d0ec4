"""An OTLP/HTTP logs receiver for the audit sink tests: it decodes each
`POST /v1/logs` (protobuf) with the reference `opentelemetry-proto` package
and appends one JSON line per log record to OUT: the record's `ocsf.raw`
event's `metadata.uid`, `metadata.log_name` and `metadata.sequence`, its
body, severity number and time, and the resource's attributes. It answers
200 with an empty `ExportLogsServiceResponse`, or, with `--status N`, N
to every request (after decoding it); with `--delay-ms D` it waits D ms
before answering each request (a slow collector). Binds 127.0.0.1 only; prints
`{"port": P}` once listening.

Usage: python3 otlp_receiver.py --out FILE [--port P] [--status N] [--delay-ms D]
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

MAX_BODY = 64 << 20


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--status", type=int, default=200)
    ap.add_argument("--delay-ms", type=int, default=0)
    args = ap.parse_args()
    out = open(args.out, "a", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            n = int(self.headers.get("Content-Length", "0"))
            if self.path != "/v1/logs" or n > MAX_BODY:
                return self.answer(404, b"")
            if self.headers.get("Content-Type") != "application/x-protobuf":
                return self.answer(415, b"")
            req = logs_service_pb2.ExportLogsServiceRequest()
            req.ParseFromString(self.rfile.read(n))
            if args.delay_ms:
                time.sleep(args.delay_ms / 1000)
            if args.status != 200:
                return self.answer(args.status, b"no")
            lines = []
            for rl in req.resource_logs:
                resource = {a.key: value(a.value) for a in rl.resource.attributes}
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        attrs = {a.key: value(a.value) for a in r.attributes}
                        event = json.loads(attrs["ocsf.raw"])
                        lines.append(json.dumps({
                            "uid": event["metadata"]["uid"],
                            "log": event["metadata"]["log_name"],
                            "seq": event["metadata"]["sequence"],
                            "body": value(r.body),
                            "severity_number": r.severity_number,
                            "time_unix_nano": r.time_unix_nano,
                            "event_time": event.get("time"),
                            "resource": resource,
                            "auth": self.headers.get("Authorization"),
                        }))
            if lines:
                out.write("\n".join(lines) + "\n")
                out.flush()
            self.answer(200, logs_service_pb2.ExportLogsServiceResponse().SerializeToString())

        def answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
