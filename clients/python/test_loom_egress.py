"""Tests of loom_egress against the real egress-proxy and egress-executor.

    python3 -m unittest discover -s clients/python -v        # from the repository root

Binaries: $EGRESS_BIN_DIR (set by tests/tests/clients.rs), else target/debug.
Loopback only: the proxy's resolver points at a closed loopback port, and the
one fetch these tests make names an unlisted host, denied before any DNS.
"""

import http.server
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from loom_egress import EgressError, ExecutorClient, ProxyClient  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
TOKEN = "clients-test-token-0123456789"

TOOL = r'''
import time, urllib.request, urllib.error

def run(input, ctx):
    input = input or {}
    ctx.emit({"step": "start", "input": input})
    if input.get("sleep"):
        time.sleep(input["sleep"])
    if input.get("fail"):
        raise RuntimeError(input["fail"])
    out = {"echo": input, "run_id": ctx.run_id}
    if input.get("fetch"):
        try:  # HTTP_PROXY is the run's proxy URL
            with urllib.request.urlopen(input["fetch"], timeout=5) as r:
                out["status"] = r.status
        except urllib.error.HTTPError as e:
            out["status"] = e.code
            out["reason"] = e.headers.get("X-Egress-Deny-Reason")
    return out
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_path(name):
    d = os.environ.get("EGRESS_BIN_DIR") or os.path.join(ROOT, "target", "debug")
    p = os.path.join(d, name)
    if not os.path.exists(p):
        raise unittest.SkipTest("%s not built (cargo build -p egress-proxy -p egress-executor)" % p)
    return p


def wait_health(client, what, proc, log):
    t0 = time.monotonic()
    while not client.health(timeout=1):
        if proc.poll() is not None or time.monotonic() - t0 > 30:
            with open(log) as f:
                raise RuntimeError("%s did not start:\n%s" % (what, f.read()))
        time.sleep(0.05)


class Services:
    """egress-proxy and egress-executor on free loopback ports."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="loom-clients-py-")
        # Confined tools run as an unprivileged uid: the tool's directory
        # (its cwd, holding its file) must be readable by it.
        os.chmod(self.dir, 0o755)
        self.procs = []
        p_listen, p_control, p_exec, p_dns = (free_port() for _ in range(4))
        with open(os.path.join(self.dir, "echo.py"), "w") as f:
            f.write(TOOL)
        runner = os.path.join(ROOT, "executor", "runners", "loom_runner.py")
        config = os.path.join(self.dir, "egress.toml")
        with open(config, "w") as f:
            f.write(
                '[proxy]\nlisten = "127.0.0.1:%d"\ncontrol = "127.0.0.1:%d"\nfacts = ":memory:"\n'
                '[proxy.dns]\nservers = ["127.0.0.1:%d"]\ntimeout_ms = 500\n'
                '[executor]\nlisten = "127.0.0.1:%d"\nscratch_dir = "scratch"\n'
                '[tools.asker]\negress = []\non_unlisted = "ask"\nask_timeout_ms = 1500\n'
                '[tools.echo]\negress = ["allowed.example:80"]\n'
                '[tools.echo.process]\ncommand = ["python3", "%s", "echo.py"]\n'
                "timeout_ms = 20000\npool = { warm = 1, max = 4 }\n"
                % (p_listen, p_control, p_dns, p_exec, runner)
            )
        os.mkdir(os.path.join(self.dir, "scratch"))
        env = dict(os.environ, EGRESS_CONTROL_TOKEN=TOKEN, EGRESS_LOG="warn", RUST_LOG="warn")
        self.control_url = "http://127.0.0.1:%d" % p_control
        self.executor_url = "http://127.0.0.1:%d" % p_exec
        self.proxy = ProxyClient(self.control_url, TOKEN)
        self.executor = ExecutorClient(self.executor_url, TOKEN)
        try:
            for name, client in (("egress-proxy", self.proxy), ("egress-executor", self.executor)):
                log = os.path.join(self.dir, name + ".log")
                with open(log, "w") as out:
                    proc = subprocess.Popen(
                        [bin_path(name), "serve", "--config", config],
                        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out,
                    )
                self.procs.append(proc)
                wait_health(client, name, proc, log)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def denied_fetch(proxy_url, url="http://unlisted.example/"):
    """A fetch through the run's proxy with the standard library's own proxy support."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url}))
    try:
        with opener.open(url, timeout=5) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Egress-Deny-Reason")


S = None


def setUpModule():
    global S
    S = Services()


def tearDownModule():
    if S is not None:
        S.stop()


class ProxyClientTest(unittest.TestCase):
    def test_run_lifecycle(self):
        run = S.proxy.create_run("echo", run_id="py-life-1", labels={"kernel": "py"}, activate=False)
        self.assertEqual(run["run_id"], "py-life-1")
        self.assertEqual(run["state"], "created")
        self.assertEqual(run["labels"], {"kernel": "py"})
        self.assertTrue(run["secret"])
        self.assertTrue(run["proxy_url"].startswith("http://py-life-1:"))
        self.assertEqual(S.proxy.get_run("py-life-1")["state"], "created")
        self.assertEqual(S.proxy.activate_run("py-life-1")["state"], "active")
        ended = S.proxy.end_run("py-life-1")
        self.assertEqual(ended["state"], "ended")
        self.assertEqual(ended["end_reason"], "ended")
        with self.assertRaises(EgressError) as cm:
            S.proxy.activate_run("py-life-1")
        self.assertEqual((cm.exception.status, cm.exception.code), (409, "run_ended"))
        # Grants: an address is never granted; an ended run takes none.
        live = S.proxy.create_run("echo")
        with self.assertRaises(EgressError) as cm:
            S.proxy.grant(live["run_id"], "127.0.0.1:443", uses=2)
        self.assertEqual((cm.exception.status, cm.exception.code), (422, "grant_not_permitted"))
        S.proxy.end_run(live["run_id"])
        with self.assertRaises(EgressError) as cm:
            S.proxy.grant(live["run_id"], "api.example:443")
        self.assertEqual((cm.exception.status, cm.exception.code), (409, "run_ended"))
        # A generated id, active by default.
        run = S.proxy.create_run("echo")
        self.assertEqual(run["state"], "active")
        S.proxy.end_run(run["run_id"])

    def test_on_pending_sees_a_held_fetch(self):
        start = S.proxy.facts(after=0, limit=1000)["next"]
        run = S.proxy.create_run("asker", run_id="py-ask-1")
        result = {}

        def fetch():
            result["answer"] = denied_fetch(run["proxy_url"])

        t = threading.Thread(target=fetch)
        t.start()
        seen = []

        def decide(fact):
            seen.append(fact)
            return False  # left alone: denied when ask_timeout_ms runs out

        S.proxy.on_pending(decide, after=start, timeout=10, stop=lambda f: f.get("type") == "EGRESS_PENDING")
        t.join(10)
        self.assertEqual(len(seen), 1, seen)
        self.assertEqual((seen[0]["run_id"], seen[0]["reason"]), ("py-ask-1", "pending"))
        self.assertEqual(seen[0]["target"]["host"], "unlisted.example")
        self.assertEqual(result["answer"], (403, "not_allowlisted"))
        S.proxy.end_run("py-ask-1")

    def test_denial_facts_and_tail(self):
        start = S.proxy.facts(after=0, limit=1000)["next"]
        run = S.proxy.create_run("echo", run_id="py-deny-1")
        got = []
        ready = threading.Event()

        def tail():
            ready.set()
            for fact in S.proxy.tail_facts(after=start, timeout=15, stop=lambda f: f.get("run_id") == "py-deny-1"):
                got.append(fact)

        t = threading.Thread(target=tail)
        t.start()
        ready.wait()
        time.sleep(0.2)  # let the stream open: this denial should arrive live
        status, reason = denied_fetch(run["proxy_url"])
        self.assertEqual((status, reason), (403, "not_allowlisted"))
        t.join(20)
        self.assertFalse(t.is_alive())
        mine = [f for f in got if f.get("run_id") == "py-deny-1"]
        self.assertEqual(len(mine), 1, got)
        self.assertEqual(mine[0]["reason"], "not_allowlisted")
        self.assertEqual(mine[0]["target"]["host"], "unlisted.example")

        page = S.proxy.facts(run_id="py-deny-1")
        self.assertEqual([f["reason"] for f in page["facts"]], ["not_allowlisted"])
        self.assertEqual(page["facts"][0]["id"], mine[0]["id"])
        everything = S.proxy.facts(after=start, limit=1000)
        self.assertIn(mine[0]["id"], [f["id"] for f in everything["facts"]])
        self.assertGreaterEqual(everything["next"], mine[0]["seq"])
        # Replay from the cursor with a deadline: the stream ends by itself.
        replay = list(S.proxy.tail_facts(after=start, timeout=1.5))
        self.assertIn(mine[0]["id"], [f["id"] for f in replay])
        S.proxy.end_run("py-deny-1")

    def test_errors_are_typed(self):
        cases = [
            (lambda: S.proxy.create_run("no-such-tool"), 404, "unknown_tool"),
            (lambda: S.proxy.get_run("py-never-made"), 404, "run_not_found"),
            (lambda: ProxyClient(S.control_url, "wrong-token-0123456789").facts(), 401, "unauthorized"),
            (lambda: S.proxy.facts(after=2**63), 400, "bad_request"),
        ]
        S.proxy.create_run("echo", run_id="py-dup-1")
        cases.append((lambda: S.proxy.create_run("echo", run_id="py-dup-1"), 409, "run_exists"))
        for call, status, code in cases:
            with self.assertRaises(EgressError) as cm:
                call()
            self.assertEqual((cm.exception.status, cm.exception.code), (status, code), cm.exception)
            self.assertTrue(cm.exception.message)
        S.proxy.end_run("py-dup-1")
        closed = ProxyClient("http://127.0.0.1:%d" % free_port(), TOKEN, timeout=2)
        with self.assertRaises(EgressError) as cm:
            closed.get_run("x")
        self.assertEqual((cm.exception.status, cm.exception.code), (0, "connection_error"))

    def test_token_from_environment(self):
        old = os.environ.get("EGRESS_CONTROL_TOKEN")
        os.environ["EGRESS_CONTROL_TOKEN"] = TOKEN
        try:
            self.assertIn("facts", ProxyClient(S.control_url).facts(limit=1))
        finally:
            if old is None:
                del os.environ["EGRESS_CONTROL_TOKEN"]
            else:
                os.environ["EGRESS_CONTROL_TOKEN"] = old

    def test_health_and_metrics(self):
        self.assertTrue(S.proxy.health())
        self.assertTrue(S.proxy.ready())
        self.assertIn("egress_runs_active", S.proxy.metrics())


class ExecutorClientTest(unittest.TestCase):
    def test_invoke_returns_output_and_emits(self):
        r = S.executor.invoke("echo", {"x": 1}, idempotency_key="py-k-1", timeout_ms=10000)
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["output"]["echo"], {"x": 1})
        self.assertEqual(r["output"]["run_id"], r["run_id"])
        self.assertEqual(r["emits"], [{"step": "start", "input": {"x": 1}}])
        self.assertEqual(r["facts"], [])

    def test_invoke_denied_fetch_reports_the_fact(self):
        r = S.executor.invoke("echo", {"fetch": "http://unlisted.example/"}, run_id="py-inv-deny-1")
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["run_id"], "py-inv-deny-1")
        self.assertEqual((r["output"]["status"], r["output"]["reason"]), (403, "not_allowlisted"))
        self.assertEqual([f["reason"] for f in r["facts"]], ["not_allowlisted"])
        # The same fact through the proxy's API, under the kernel's run id.
        facts = S.proxy.facts(run_id="py-inv-deny-1")["facts"]
        self.assertEqual([f["id"] for f in facts], [f["id"] for f in r["facts"]])

    def test_tool_failure_is_a_result(self):
        r = S.executor.invoke("echo", {"fail": "boom"})
        self.assertFalse(r["ok"])
        self.assertEqual(r["error"]["kind"], "tool_error")
        self.assertIn("boom", r["error"]["message"])

    def test_abort_a_slow_tool(self):
        box = {}
        t = threading.Thread(target=lambda: box.update(r=S.executor.invoke("echo", {"sleep": 30}, idempotency_key="py-slow-1")))
        t0 = time.monotonic()
        t.start()
        while True:
            try:
                self.assertEqual(S.executor.abort("py-slow-1")["aborted"], True)
                break
            except EgressError as e:
                self.assertEqual((e.status, e.code), (404, "not_found"))
                self.assertLess(time.monotonic() - t0, 15, "never in flight")
                time.sleep(0.05)
        t.join(15)
        self.assertFalse(t.is_alive())
        self.assertFalse(box["r"]["ok"])
        self.assertEqual(box["r"]["error"]["kind"], "aborted")
        self.assertLess(time.monotonic() - t0, 20)

    def test_errors_are_typed(self):
        cases = [
            (lambda: S.executor.invoke("no-such-tool", {}), 404, "unknown_tool"),
            (lambda: S.executor.abort("nothing-in-flight"), 404, "not_found"),
            (lambda: ExecutorClient(S.executor_url, "wrong-token-0123456789").invoke("echo", {}), 401, "unauthorized"),
        ]
        for call, status, code in cases:
            with self.assertRaises(EgressError) as cm:
                call()
            self.assertEqual((cm.exception.status, cm.exception.code), (status, code), cm.exception)

    def test_health_and_metrics(self):
        self.assertTrue(S.executor.health())
        self.assertIn("executor_invocations_total", S.executor.metrics())


class _DroppingStream(http.server.BaseHTTPRequestHandler):
    """Serves one fact per connection, then drops it (tests reconnection)."""

    cursors = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        after = int(self.path.split("after=")[1])
        self.cursors.append(after)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        seq = after + 1
        body = ": keep-alive\n\nevent: fact\nid: %d\ndata: {\"seq\": %d,\ndata:  \"reason\": \"x\"}\n\n" % (seq, seq)
        self.wfile.write(body.encode())
        self.wfile.flush()
        self.close_connection = True


class TailReconnectTest(unittest.TestCase):
    def test_reconnects_from_the_last_id(self):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DroppingStream)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            c = ProxyClient("http://127.0.0.1:%d" % srv.server_address[1], TOKEN)
            facts = list(c.tail_facts(after=5, timeout=10, reconnect_delay=0.01, stop=lambda f: f["seq"] >= 8))
            self.assertEqual([f["seq"] for f in facts], [6, 7, 8])
            self.assertEqual(_DroppingStream.cursors, [5, 6, 7])
        finally:
            srv.shutdown()
            srv.server_close()


if __name__ == "__main__":
    unittest.main()
