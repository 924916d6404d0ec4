"""Example kernel: invokes the three example tools through the executor and
shows what the proxy recorded, with the Python kernel client.

    export EGRESS_CONTROL_TOKEN=example-control-token-0123456789
    target/debug/egress-proxy serve --config examples/egress.toml &
    target/debug/egress-executor serve --config examples/egress.toml &
    python3 examples/kernel.py

It serves a fake weather API on 127.0.0.2:8787 (the one place the weather
tools may fetch, see examples/egress.toml) and asks each weather tool to also
try http://evil.example/, which the proxy denies before any DNS. Exit status 0
when everything behaved as described.
"""

import argparse
import http.server
import json
import os
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from loom_egress import EgressError, ExecutorClient, ProxyClient  # noqa: E402

ORIGIN = ("127.0.0.2", 8787)


class Weather(http.server.BaseHTTPRequestHandler):
    """A fake weather API: GET /v1/now?city=X → JSON."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        city = q.get("city", ["?"])[0]
        body = json.dumps({"city": city, "temp": 21, "sky": "clear"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def token():
    """EGRESS_CONTROL_TOKEN, else the token file the proxy wrote beside its facts."""
    t = os.environ.get("EGRESS_CONTROL_TOKEN")
    if t:
        return t
    path = os.path.join(ROOT, "var", "egress-control.token")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        sys.exit("no control token: set EGRESS_CONTROL_TOKEN (or start the proxy so it writes %s)" % path)


def show_facts(facts, indent="    "):
    for f in facts:
        target = f.get("target") or {}
        print("%sfact seq=%s %s %s:%s (%s)" % (indent, f["seq"], f["reason"], target.get("host"), target.get("port"), f["detail"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", default="http://127.0.0.1:3129", help="the proxy's control API")
    ap.add_argument("--executor", default="http://127.0.0.1:3130", help="the executor's invocation API")
    args = ap.parse_args()

    proxy = ProxyClient(args.control, token())
    executor = ExecutorClient(args.executor, token())
    for name, client in (("proxy", proxy), ("executor", executor)):
        if not client.health(timeout=2):
            sys.exit("the %s does not answer; start it first (see docs/clients.md, 'The examples')" % name)

    origin = http.server.ThreadingHTTPServer(ORIGIN, Weather)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    origin_url = "http://%s:%d" % ORIGIN

    # The newest fact so far: everything after it is this script's doing.
    start = 0
    while True:
        page = proxy.facts(after=start, limit=1000)
        start = page["next"]
        if len(page["facts"]) < 1000:
            break

    problems = []
    weather_input = {"city": "Oslo", "origin": origin_url, "also_try": "http://evil.example/"}
    for tool, tool_input in (
        ("weather-py", weather_input),
        ("weather-js", weather_input),
        ("hello-rust", {"name": "kernel"}),
    ):
        print("== invoke %s %s" % (tool, json.dumps(tool_input)))
        try:
            r = executor.invoke(tool, tool_input, idempotency_key="example-%s-%d" % (tool, os.getpid()), timeout_ms=15000)
        except EgressError as e:
            print("   failed: %s" % e)
            problems.append(tool)
            continue
        if not r["ok"]:
            print("   error: %s" % json.dumps(r["error"]))
            problems.append(tool)
            continue
        print("   run %s in %s ms" % (r["run_id"], r["duration_ms"]))
        print("   output: %s" % json.dumps(r["output"]))
        for e in r["emits"]:
            print("   emit:   %s" % json.dumps(e))
        show_facts(r["facts"], "   ")
        if tool.startswith("weather") and (
            r["output"]["status"] != 200 or [f["reason"] for f in r["facts"]] != ["not_allowlisted"]
        ):
            problems.append(tool)

    # The proxy's API directly: a run of our own, one denied fetch through its
    # proxy URL (the standard library's proxy support), the run's view.
    print("== a run made by the kernel itself")
    run = proxy.create_run("weather-py", labels={"example": "kernel.py"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": run["proxy_url"]}))
    try:
        opener.open("http://metadata.example/latest", timeout=5)
        problems.append("direct run: fetch allowed")
    except urllib.error.HTTPError as e:
        print("   GET http://metadata.example/latest → %d %s" % (e.code, e.headers.get("X-Egress-Deny-Reason")))
    ended = proxy.end_run(run["run_id"])
    print("   run %s: %s (%s)" % (ended["run_id"], ended["state"], ended["end_reason"]))

    # Every denial since this script started, from the live fact stream.
    print("== facts since seq %d (GET /v1/facts/stream)" % start)
    seen = list(proxy.tail_facts(after=start, timeout=2))
    show_facts(seen, "   ")
    if len(seen) < 3:
        problems.append("expected 3 denial facts, saw %d" % len(seen))

    origin.shutdown()
    if problems:
        print("PROBLEMS: %s" % ", ".join(problems))
        return 1
    print("all good")
    return 0


if __name__ == "__main__":
    sys.exit(main())
