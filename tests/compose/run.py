#!/usr/bin/env python3
"""The compose test: the local stack on a real Docker engine.

Builds the images from what this machine has (release binaries built here, a
Debian base made with debootstrap, Debian's Prometheus), starts
docker-compose.yml with tests/compose/docker-compose.test.yml over it, and
checks from outside the containers that:

  1. every service becomes healthy;
  2. the demo kernel's tools are allowed and denied as configured (proxy and
     executor metrics), and the facts API holds the denials;
  3. Prometheus scraped both services, loaded every rule without error, and
     every PromQL expression of both dashboards and of alerts.yml parses and
     evaluates, each dashboard query returning data;
  4. a confined tool's connections are bound to its run (the listener
     hand-off through the volume both containers share): another run's
     credential presented by the tool is refused, 407;
  5. nothing on the tools network reaches anything but the proxy: a tool
     process (run by the executor), the executor and demo containers connect
     and send DNS to a canary on the outside network, the origin, and the
     Docker host; the canary counts zero such connections and queries, while
     the proxy (positive control) does reach it;
  6. `down -v` leaves no container, network or volume behind.

Skips loudly (exit 0) when no Docker engine or no Compose is available.
Environment: LOOM_SKIP_CARGO=1 to reuse target/release as is;
LOOM_CACHE_DIR for the base filesystem cache (deploy/build-rootfs.sh).
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import stackcheck  # noqa: E402

PROJECT = "loomegresstest"
IMAGE = "loom-egress:local-test"
PROM_IMAGE = "loom-egress-prometheus:local-test"
CONTROL = "http://172.28.10.2:3129"
EXECUTOR = "http://172.28.10.3:3130"
PROMETHEUS = "http://127.0.0.1:9090"
CANARY = "172.28.20.50"
CANARY_REPORT = "http://%s:9001/" % CANARY
ORIGIN = "172.28.20.10"
PROXY_OUTSIDE = "172.28.20.2"
TOOLS_BRIDGE = "loom-tools"
DEMO_TOOLS = ["well-behaved", "probe-unlisted", "ip-literal", "slow", "times-out"]
# Nothing in this test may go through a proxy from the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

T0 = time.monotonic()
TIMINGS = []


def log(msg):
    print("[compose-test %6.1fs] %s" % (time.monotonic() - T0, msg), flush=True)


class Failure(Exception):
    pass


def run(cmd, check=True, capture=True, timeout=600, env=None, cwd=ROOT):
    r = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, text=True,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and r.returncode != 0:
        raise Failure("%s failed (%d):\n%s%s" % (" ".join(cmd), r.returncode, r.stdout or "", r.stderr or ""))
    return r


def phase(name):
    class P:
        def __enter__(self):
            self.t = time.monotonic()
            log("== " + name)

        def __exit__(self, *exc):
            TIMINGS.append((name, time.monotonic() - self.t))
    return P()


def http(url, token=None, data=None, timeout=10):
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode())
    if token:
        req.add_header("Authorization", "Bearer " + token)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with OPENER.open(req, timeout=timeout) as r:
        return r.read().decode()


def poll(what, fn, timeout, interval=2):
    """Calls fn until it returns a true value; raises Failure with its last complaint."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            ok, last = fn()
            if ok:
                return last
        except (OSError, ValueError, urllib.error.URLError) as e:
            last = "%s: %s" % (type(e).__name__, e)
        if time.monotonic() > deadline:
            raise Failure("%s: not within %ds: %s" % (what, timeout, last))
        time.sleep(interval)


# ------------------------------------------------------------------ compose ----

def compose_cmd():
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") and run(["docker-compose", "version"], check=False).returncode == 0:
        return ["docker-compose"]
    return None


class Stack:
    def __init__(self, compose, env_file):
        self.base = compose + ["-p", PROJECT, "-f", "docker-compose.yml", "-f", "tests/compose/docker-compose.test.yml"]
        self.env = dict(os.environ, EGRESS_ENV_FILE=env_file)

    def __call__(self, *args, check=True, capture=True, timeout=300):
        return run(self.base + list(args), check=check, capture=capture, timeout=timeout, env=self.env)

    def container(self, service):
        cid = self("ps", "-q", service).stdout.strip()
        if not cid:
            raise Failure("no container for service %s" % service)
        return cid

    def exec(self, service, *cmd, timeout=60):
        # `docker exec` on the container id: the same with Compose v1 and v2, no TTY.
        return run(["docker", "exec", self.container(service)] + list(cmd), check=False, timeout=timeout)


def project_leftovers():
    label = "label=com.docker.compose.project=%s" % PROJECT
    out = []
    for kind, cmd in (("container", ["docker", "ps", "-a", "-q", "--filter", label]),
                      ("network", ["docker", "network", "ls", "-q", "--filter", label]),
                      ("volume", ["docker", "volume", "ls", "-q", "--filter", label])):
        ids = run(cmd).stdout.split()
        out += ["%s %s" % (kind, i) for i in ids]
    return out


def wait_healthy(stack, services, timeout):
    def check():
        states = {}
        for s in services:
            cid = stack("ps", "-q", s).stdout.strip()
            if not cid:
                states[s] = "missing"
                continue
            st = json.loads(run(["docker", "inspect", cid]).stdout)[0]["State"]
            states[s] = (st.get("Health") or {}).get("Status") or st.get("Status")
            if st.get("Status") in ("exited", "dead"):
                raise Failure("service %s exited: %s" % (s, st))
        return all(v == "healthy" for v in states.values()), states
    return poll("services healthy", check, timeout)


# ------------------------------------------------------------------ metrics ----

def parse_metrics(text):
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        if "{" in name_labels:
            name, _, rest = name_labels.partition("{")
            labels = dict(kv.split("=", 1) for kv in split_labels(rest.rstrip("}")))
            labels = {k: v.strip('"') for k, v in labels.items()}
        else:
            name, labels = name_labels, {}
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            pass
    return out


def split_labels(s):
    parts, cur, q = [], "", False
    for ch in s:
        if ch == '"':
            q = not q
        if ch == "," and not q:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts


def total(samples, name, **want):
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in want.items()))


def promql(expr, timeout=15):
    body = http(PROMETHEUS + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=timeout)
    return json.loads(body)


# ---------------------------------------------------------------- isolation ----

# Run inside a container of the tools network (or as a tool process): tries
# to reach the outside directly. Prints what it reached; exit 0 if nothing.
PROBE = r"""
import json, socket, struct, sys
targets = json.loads(sys.argv[1])
reached = []
for host, port in targets["tcp"]:
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect((host, port))
        reached.append("tcp %s:%d" % (host, port))
    except OSError as e:
        print("tcp %s:%d: %s" % (host, port, e))
    finally:
        s.close()
def query(name):
    q = struct.pack(">HHHHHH", 0x4c4f, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    return q
for server, name in targets["dns"]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1)
    try:
        s.sendto(query(name), (server, 53))
        data, _ = s.recvfrom(4096)
        rcode = data[3] & 0x0F
        ancount = struct.unpack(">H", data[6:8])[0]
        print("dns %s via %s: rcode %d, %d answers" % (name, server, rcode, ancount))
        if ancount:
            reached.append("dns %s via %s" % (name, server))
    except OSError as e:
        print("dns %s via %s: %s" % (name, server, e))
    finally:
        s.close()
print("REACHED", json.dumps(reached))
sys.exit(1 if reached else 0)
"""


# Run by a confined tool: presents the credential in argv[1] (another run's)
# on the tool's own proxy listener and prints the status line.
STOLEN = r"""
import base64, socket, sys
auth = base64.b64encode(sys.argv[1].encode()).decode()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(("GET http://origin.demo.test:8080/ HTTP/1.1\r\nHost: origin.demo.test:8080\r\n"
           "Proxy-Authorization: Basic %s\r\nConnection: close\r\n\r\n" % auth).encode())
print("STATUS", s.recv(4096).split(b"\r\n")[0].decode())
"""


def check_binding(stack, token):
    with phase("binding: a confined tool's connections are bound to its run"):
        victim = json.loads(http(CONTROL + "/v1/runs", token=token, data={"tool": "well-behaved"}))
        try:
            r = stack.exec("executor", "egress-executor", "run", "--config", "/etc/loom-egress/egress.toml",
                           "--tool", "well-behaved", "--", "python3", "-c", STOLEN,
                           "%s:%s" % (victim["run_id"], victim["secret"]), timeout=120)
        finally:
            req = urllib.request.Request(CONTROL + "/v1/runs/" + victim["run_id"], method="DELETE")
            req.add_header("Authorization", "Bearer " + token)
            OPENER.open(req, timeout=10).read()
        out = (r.stdout + r.stderr).strip()
        if "STATUS HTTP/1.1 407" not in out:
            raise Failure("another run's credential was not refused on a tool's listener (exit %d):\n%s"
                          % (r.returncode, out))
        log("a tool presenting another live run's credential on its listener: %s"
            % next(l for l in out.splitlines() if l.startswith("STATUS")))


def host_listener(ip):
    """A TCP listener on a host address; returns (port, connections list, stop)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 0))
    s.listen(16)
    s.settimeout(0.5)
    got, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            try:
                c, peer = s.accept()
                got.append(peer[0])
                c.close()
            except OSError:
                pass
        s.close()
    threading.Thread(target=loop, daemon=True).start()
    return s.getsockname()[1], got, stop


def bridge_address(name):
    r = run(["ip", "-4", "-o", "addr", "show", "dev", name], check=False)
    for tok in r.stdout.split():
        if "/" in tok and tok[0].isdigit():
            return tok.split("/")[0]
    return None


# -------------------------------------------------------------------- steps ----

def build(compose):
    with phase("release binaries"):
        if os.environ.get("LOOM_SKIP_CARGO") != "1":
            run(["cargo", "build", "--release", "-p", "egress-proxy", "-p", "egress-executor"], capture=False, timeout=3600)
        for b in ("egress-proxy", "egress-executor"):
            if not os.access(os.path.join(ROOT, "target/release", b), os.X_OK):
                raise Failure("target/release/%s missing" % b)
    with phase("base filesystem (debootstrap, cached)"):
        rootfs = run([os.path.join(ROOT, "deploy/build-rootfs.sh")], timeout=1800).stdout.strip().splitlines()[-1]
        log("base image " + rootfs)
    with phase("images"):
        env = dict(os.environ, DOCKER_BUILDKIT="0")   # no buildx here; the legacy builder reads the same Dockerfile
        for target, tag in (("local", IMAGE), ("local-prometheus", PROM_IMAGE)):
            run(["docker", "build", "-q", "--network", "none", "--target", target, "--build-arg", "ROOTFS=" + rootfs,
                 "-t", tag, "."], env=env, timeout=900)


def check_demo(stack, token):
    with phase("demo: allowed and denied fetches, facts"):
        def metrics_ready():
            p = parse_metrics(http(CONTROL + "/metrics"))
            e = parse_metrics(http(EXECUTOR + "/metrics"))
            want = {
                "well-behaved http allowed": total(p, "egress_requests_total", tool="well-behaved", kind="http", decision="allowed"),
                "well-behaved connect allowed": total(p, "egress_requests_total", tool="well-behaved", kind="connect", decision="allowed"),
                "probe-unlisted not_allowlisted": total(p, "egress_denials_total", tool="probe-unlisted", reason="not_allowlisted"),
                "probe-unlisted private_address": total(p, "egress_denials_total", tool="probe-unlisted", reason="private_address"),
                "ip-literal ip_literal": total(p, "egress_denials_total", tool="ip-literal", reason="ip_literal"),
                "slow allowed": total(p, "egress_requests_total", tool="slow", decision="allowed"),
                "times-out fetch timeouts": total(p, "egress_timeouts_total", tool="times-out"),
                "times-out executor kills": total(e, "executor_kills_total", tool="times-out", reason="timeout"),
                "well-behaved ok invocations": total(e, "executor_invocations_total", tool="well-behaved", outcome="ok"),
                "well-behaved children forked by its fork server": total(e, "executor_forked_children_total", tool="well-behaved"),
                "well-behaved denials (none)": -total(p, "egress_denials_total", tool="well-behaved") or 1,
            }
            missing = [k for k, v in want.items() if v <= 0]
            return not missing, "still zero: %s" % ", ".join(missing)
        poll("demo traffic in the metrics", metrics_ready, 120)
        log("metrics: every demo tool allowed/denied/timed out as configured")

        facts = json.loads(http(CONTROL + "/v1/facts?after=0&limit=1000", token=token))["facts"]
        seen = {(f["tool"], f["reason"]) for f in facts}
        need = {("probe-unlisted", "not_allowlisted"), ("probe-unlisted", "private_address"), ("ip-literal", "ip_literal")}
        if not need <= seen:
            raise Failure("facts API lacks %s; has %s" % (need - seen, seen))
        if any(f["tool"] == "well-behaved" for f in facts):
            raise Failure("the well-behaved tool has denial facts: %s" % [f for f in facts if f["tool"] == "well-behaved"])
        hosts = {f["target"]["host"] for f in facts}
        log("facts API: %d denial facts, reasons %s, hosts %s" % (len(facts), sorted({r for _, r in seen}), sorted(hosts)))

        # The operator's commands from docs/stack.md, inside the containers.
        r = stack.exec("demo", "python3", "/opt/loom-egress/demo/kernel.py", "facts", "5")
        if r.returncode != 0 or "REASON" not in r.stdout or not any(x in r.stdout for x in ("not_allowlisted", "ip_literal")):
            raise Failure("kernel.py facts failed (%d): %s%s" % (r.returncode, r.stdout, r.stderr))
        r = stack.exec("executor", "egress-executor", "doctor", "--config", "/etc/loom-egress/egress.toml")
        if r.returncode != 0 or "token accepted" not in r.stdout \
                or "hand-off to /run/loom-egress/handoff.sock ([proxy] handoff)" not in r.stdout:
            raise Failure("egress-executor doctor failed (%d): %s%s" % (r.returncode, r.stdout, r.stderr))
        # Every demo tool is strict, with the cgroup layer the entrypoint's
        # remount gives (deploy/start-executor.sh): their pools would not
        # start otherwise, and doctor says so per tool.
        lines = r.stdout.splitlines()
        for tool in DEMO_TOOLS:
            row = next((l for l in lines if l.startswith("isolation of `%s`" % tool)), "")
            if not re.search(r"\bok\s+Strict\b", row) or "cgroup memory+pids" not in row:
                raise Failure("%s is not strict with its cgroup layer in the container: %r" % (tool, row))
        log("kernel.py facts and egress-executor doctor work in the containers; doctor says:\n    "
            + "\n    ".join(r.stdout.strip().splitlines()))


def check_prometheus():
    with phase("prometheus: targets, rules, every expression"):
        def targets_up():
            t = json.loads(http(PROMETHEUS + "/api/v1/targets"))["data"]["activeTargets"]
            health = {x["labels"]["job"]: x["health"] for x in t}
            ok = health.get("egress-proxy") == "up" and health.get("egress-executor") == "up"
            return ok, health
        log("targets: %s" % poll("both services scraped", targets_up, 60))

        def rules_ok():
            groups = json.loads(http(PROMETHEUS + "/api/v1/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            bad = [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"]
            expected = {r.get("record") or r.get("alert") for r in stackcheck.load_rules()}
            loaded = {r["name"] for r in rules}
            return not bad and expected <= loaded, "unhealthy %s, missing %s" % (bad, expected - loaded)
        poll("rules loaded and evaluated", rules_ok, 60)

        exprs = stackcheck.expressions()
        # The dashboards' tool variables.
        for metric in ("egress_requests_total", "executor_invocations_total"):
            exprs.append(("variable tool (%s)" % metric, "group by (tool) (%s)" % metric, True))

        def all_evaluate():
            problems = []
            for where, raw, need_data in exprs:
                expr = stackcheck.substitute(raw)
                r = promql(expr)
                if r.get("status") != "success":
                    problems.append("%s: %s" % (where, r.get("error")))
                elif need_data and not r["data"]["result"]:
                    problems.append("%s: no data for %s" % (where, expr))
            return not problems, "\n  " + "\n  ".join(problems)
        poll("every expression evaluates with data", all_evaluate, 120, interval=5)
        tools = {s["metric"]["tool"] for s in promql("group by (tool) (egress_requests_total)")["data"]["result"]}
        if not set(DEMO_TOOLS) <= tools:
            raise Failure("tool variable lacks demo tools: %s" % (set(DEMO_TOOLS) - tools))
        log("%d expressions parse and evaluate; every dashboard query returns data" % len(exprs))


def check_isolation(stack):
    with phase("isolation: nothing leaves the tools network except through the proxy"):
        gw = bridge_address(TOOLS_BRIDGE)
        if gw is None:
            raise Failure("no host address on bridge %s" % TOOLS_BRIDGE)
        port, host_got, stop = host_listener(gw)
        targets = {"tcp": [[CANARY, 9000], [ORIGIN, 8080], [PROXY_OUTSIDE, 3129], [gw, port]],
                   # Straight to the canary, and through Docker's embedded resolver, whose
                   # upstream for these containers is the canary (the override's `dns`).
                   "dns": [[CANARY, "direct.canary.test"], ["127.0.0.11", "forwarded.canary.test"]]}
        arg = json.dumps(targets)
        firewall = os.path.join(ROOT, "deploy/host-firewall.sh")
        can_firewall = os.geteuid() == 0 and shutil.which("iptables")
        try:
            if can_firewall:
                # Docker's gap, shown before it is closed: an internal network does not stop
                # traffic addressed to the host itself.
                r = stack.exec("demo", "python3", "-c", PROBE, json.dumps({"tcp": [[gw, port]], "dns": []}))
                log("without deploy/host-firewall.sh a container reaches the host's %s: %s" % (gw, "yes" if r.returncode else "no"))
                run([firewall, "apply"])
            else:
                log("LOUD NOTICE: not root or no iptables: deploy/host-firewall.sh not applied; the host-address check is skipped")
                targets["tcp"] = [t for t in targets["tcp"] if t[0] != gw]
                arg = json.dumps(targets)
            host_got.clear()
            attempts = [
                ("a tool process (egress-executor run --tool well-behaved)",
                 stack.exec("executor", "egress-executor", "run", "--config", "/etc/loom-egress/egress.toml",
                            "--tool", "well-behaved", "--", "python3", "-c", PROBE, arg, timeout=120)),
                ("the executor container", stack.exec("executor", "python3", "-c", PROBE, arg, timeout=120)),
                ("the demo kernel container", stack.exec("demo", "python3", "-c", PROBE, arg, timeout=120)),
            ]
            for who, r in attempts:
                out = (r.stdout + r.stderr).strip()
                if r.returncode != 0 or "REACHED []" not in out:
                    raise Failure("%s reached something directly (exit %d):\n%s" % (who, r.returncode, out))
                log("%s: reached nothing\n    %s" % (who, "\n    ".join(l for l in out.splitlines() if l.startswith(("tcp ", "dns ")))))
            if host_got:
                raise Failure("the host listener on %s got connections from %s" % (gw, host_got))
        finally:
            stop.set()
            if can_firewall:
                run([firewall, "remove"], check=False)

        # Positive control: the proxy, on the outside network too, does reach the canary.
        r = stack.exec("proxy", "python3", "-c", "import socket; socket.create_connection(('%s', 9000), timeout=3).close()" % CANARY)
        if r.returncode != 0:
            raise Failure("positive control: the proxy cannot reach the canary: %s" % r.stderr)
        seen = json.loads(http(CANARY_REPORT))
        tools_net = [ip for ip in seen["tcp"] + seen["dns"] if ip.startswith("172.28.10.")]
        if seen["tcp"] != [PROXY_OUTSIDE] or tools_net:
            raise Failure("canary saw %s; expected exactly one TCP connection, from the proxy (%s)" % (seen, PROXY_OUTSIDE))
        log("canary: 0 connections and 0 DNS queries from the tools network; 1 from the proxy (positive control); "
            "DNS queries seen: %s" % (seen["dns"] or "none"))
        if seen["dns"]:
            raise Failure("DNS queries reached the canary: %s" % seen["dns"])


def main():
    if shutil.which("docker") is None or run(["docker", "info"], check=False).returncode != 0:
        print("\n" + "#" * 72 + "\n# SKIP compose test: no Docker engine available\n" + "#" * 72 + "\n", flush=True)
        return 0
    compose = compose_cmd()
    if compose is None:
        print("\n" + "#" * 72 + "\n# SKIP compose test: Docker is here but neither `docker compose` nor `docker-compose`\n" + "#" * 72 + "\n", flush=True)
        return 0
    log("compose command: %s" % " ".join(compose))
    tmp = tempfile.mkdtemp(prefix="loom-compose-test-")
    env_file = os.path.join(tmp, "test.env")
    token = secrets.token_hex(24)
    with open(env_file, "w") as f:
        f.write("EGRESS_CONTROL_TOKEN=%s\n" % token)
    stack = Stack(compose, env_file)
    ok = False
    try:
        build(compose)
        with phase("compose up"):
            stack("down", "-v", "--remove-orphans", check=False)
            stack("up", "-d", "--no-build")
            states = wait_healthy(stack, ["proxy", "executor", "prometheus", "origin", "demo", "canary"], 180)
            log("healthy: %s" % ", ".join(sorted(states)))
        check_demo(stack, token)
        check_prometheus()
        check_binding(stack, token)
        check_isolation(stack)
        ok = True
    except (Failure, subprocess.TimeoutExpired) as e:
        print("\nFAIL compose test: %s\n" % e, flush=True)
        r = stack("ps", check=False)
        print(r.stdout, r.stderr)
        r = stack("logs", "--no-color", "--tail", "40", check=False)
        print(r.stdout[-20000:], r.stderr[-2000:])
    finally:
        with phase("compose down -v"):
            stack("down", "-v", "--remove-orphans", check=False)
            left = project_leftovers()
        shutil.rmtree(tmp, ignore_errors=True)
    if left:
        print("FAIL compose test: `down -v` left %s" % left, flush=True)
        ok = False
    else:
        log("down -v left no container, network or volume")
    for name, secs in TIMINGS:
        log("timing: %-60s %6.1fs" % (name, secs))
    log("%s in %.1fs" % ("PASS" if ok else "FAIL", time.monotonic() - T0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
