"""The demo kernel: keeps invoking the demo tools through the executor's API so
every dashboard panel has data within a minute (standard library only).

    python3 kernel.py              run forever (the `demo` service)
    python3 kernel.py facts [N]    print the proxy's last N denial facts
    python3 kernel.py health       exit 0 if an invocation finished recently

Environment: EGRESS_CONTROL_TOKEN (required), EXECUTOR_URL, PROXY_CONTROL_URL,
DEMO_INTERVAL_S (seconds between rounds, default 2).
"""

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

EXECUTOR = os.environ.get("EXECUTOR_URL", "http://172.28.10.3:3130")
CONTROL = os.environ.get("PROXY_CONTROL_URL", "http://172.28.10.2:3129")
INTERVAL = float(os.environ.get("DEMO_INTERVAL_S", "2"))
HEARTBEAT = "/tmp/demo-heartbeat"
TOOLS = {
    "well-behaved": lambda n: {"city": ["Oslo", "Lagos", "Lima", "Pune"][n % 4]},
    "probe-unlisted": lambda n: {},
    "ip-literal": lambda n: {},
    "slow": lambda n: {},
    "times-out": lambda n: {},
}
# Nothing here may go through a proxy: the kernel talks to the services directly.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(method, url, body=None, timeout=60):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", "Bearer " + os.environ["EGRESS_CONTROL_TOKEN"])
    req.add_header("Content-Type", "application/json")
    try:
        with OPENER.open(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.load(e)
        except ValueError:
            return e.code, {}


def invoke(tool, n):
    started = time.monotonic()
    try:
        status, res = call("POST", EXECUTOR + "/v1/invocations",
                           {"tool": tool, "input": TOOLS[tool](n), "idempotency_key": "demo-%s-%d-%d" % (tool, os.getpid(), n)})
    except OSError as e:
        print("%-15s executor unreachable: %s" % (tool, e), flush=True)
        return
    took = time.monotonic() - started
    if res.get("ok"):
        outcome = "ok"
    else:
        err = res.get("error") or {}
        outcome = "%s%s" % (err.get("kind", "http %d" % status), "/" + err["phase"] if err.get("phase") else "")
    denials = ", ".join("%s %s:%s" % (f.get("reason"), f.get("target", {}).get("host"), f.get("target", {}).get("port"))
                        for f in res.get("facts") or [])
    print("%-15s %-12s %5.2fs  denials: %s" % (tool, outcome, took, denials or "-"), flush=True)
    with open(HEARTBEAT, "w") as f:
        f.write(str(time.time()))


def run_forever():
    busy = {t: threading.Event() for t in TOOLS}
    n = 0
    print("demo kernel: invoking %s every %.1fs through %s" % (", ".join(TOOLS), INTERVAL, EXECUTOR), flush=True)
    while True:
        for tool in TOOLS:
            if busy[tool].is_set():
                continue          # one invocation per tool at a time
            busy[tool].set()

            def one(t=tool, k=n):
                try:
                    invoke(t, k)
                finally:
                    busy[t].clear()
            threading.Thread(target=one, daemon=True).start()
        n += 1
        time.sleep(INTERVAL)


def facts(limit):
    """The last `limit` facts: pages through the cursor API (at most 100 pages of 1000)."""
    last, after = [], 0
    for _ in range(100):
        status, body = call("GET", CONTROL + "/v1/facts?after=%d&limit=1000" % after)
        if status != 200:
            sys.exit("facts API answered %d: %s" % (status, body))
        page = body.get("facts", [])
        last = (last + page)[-limit:]
        if not page or body.get("next") in (None, after):
            break
        after = body["next"]
    print("%-6s %-15s %-17s %-32s %s" % ("SEQ", "TOOL", "REASON", "TARGET", "COUNT"))
    for f in last:
        t = f.get("target", {})
        print("%-6s %-15s %-17s %-32s %s" % (f.get("seq"), f.get("tool"), f.get("reason"),
                                             "%s:%s %s" % (t.get("host"), t.get("port"), t.get("kind")), f.get("count", 1)))


def health():
    try:
        with open(HEARTBEAT) as f:
            age = time.time() - float(f.read())
    except (OSError, ValueError):
        sys.exit("no invocation finished yet")
    if age > 60:
        sys.exit("last invocation finished %.0fs ago" % age)


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "run"
    if cmd == "run":
        run_forever()
    elif cmd == "facts":
        facts(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    elif cmd == "health":
        health()
    else:
        sys.exit(__doc__)
