#!/usr/bin/env python3
"""The fleet on Docker: two cells as containers on private Docker networks,
exporting their facts to one PostgreSQL.

The appliance image is the compose test's (tests/compose/run.py builds it
from what this machine has; this test reuses that build). Each cell is an
egress-proxy container with a `[cell]` and `[export] sink = "postgres"`, on
two networks the test creates: a service network, where this test is the
kernel, and a data network, whose gateway is a PostgreSQL 15 started here from
Debian's package (`initdb` in a temp dir, run as `postgres`, listening on that
gateway only, besides loopback). Checks, each with the exactly-once invariant
(per cell and epoch: count = max(seq) = the cell's newest local seq, ids
unique, every exported body equal to the local fact):

  1. denial floods on both cells are exported once;
  2. `docker kill` of cell-a in the middle of a flood, then `docker start`:
     the same store (same epoch) exports what was left, nothing twice;
  3. `docker network disconnect` of cell-b from the data network: its 403s
     and local facts go on, its lag grows and /readyz answers 503 past
     max_lag while cell-a exports on; `docker network connect` heals it and
     the lag is 0 within 10 s.

Keyed invocations retried at another cell (the fleet's idempotency) are
tested with real executors in executor/tests/fleet.rs, not here.
Skips loudly (exit 0) without a Docker engine, root or PostgreSQL 15.
Environment: LOOM_SKIP_CARGO=1 to reuse target/release as is.
"""

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error

import run as stack_test  # the compose test: its image build and helpers
from run import Failure, http, log, phase, poll, run

PREFIX = "loomfleettest"
SVC_NET, SVC_SUBNET = PREFIX + "-svc", "172.29.10.0/24"
DATA_NET, DATA_SUBNET, DATA_GATEWAY = PREFIX + "-data", "172.29.20.0/24", "172.29.20.1"
CELLS = {"cell-a": 2, "cell-b": 3}
PG_BIN = "/usr/lib/postgresql/15/bin"
MAX_LAG = 20


def skip(why):
    print("\n" + "#" * 72 + "\n# SKIP fleet test on Docker: %s\n" % why + "#" * 72 + "\n", flush=True)
    return 0


class Postgres:
    """A throwaway PostgreSQL 15 on the host, on loopback and `listen`."""

    def __init__(self, listen):
        self.dir = tempfile.mkdtemp(prefix="loom-fleet-pg-")
        run(["chown", "-R", "postgres:postgres", self.dir])
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        data = os.path.join(self.dir, "data")
        self.as_postgres("initdb", "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync", "-D", data)
        with open(os.path.join(data, "pg_hba.conf"), "a") as f:
            f.write("host all all %s trust\n" % DATA_SUBNET)
        opts = "-p %d -k %s -c listen_addresses='127.0.0.1,%s' -c fsync=off -c max_connections=50" % (
            self.port, self.dir, listen)
        self.as_postgres("pg_ctl", "start", "-w", "-t", "30", "-D", data, "-l",
                         os.path.join(self.dir, "server.log"), "-o", opts)
        self.data = data

    def as_postgres(self, program, *args):
        return run(["runuser", "-u", "postgres", "--", os.path.join(PG_BIN, program)] + list(args), cwd=self.dir)

    def query(self, sql):
        dsn = "host=127.0.0.1 port=%d user=postgres dbname=postgres sslmode=disable" % self.port
        r = run([os.path.join(PG_BIN, "psql"), "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c", sql])
        return r.stdout.strip()

    def close(self):
        run(["runuser", "-u", "postgres", "--", os.path.join(PG_BIN, "pg_ctl"), "stop", "-m", "immediate",
             "-D", self.data], check=False, cwd=self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)


class Cell:
    def __init__(self, name, tmp, token, dsn):
        self.name, self.token = name, token
        self.container = "%s-%s" % (PREFIX, name)
        n = CELLS[name]
        self.svc_ip, self.data_ip = "172.29.10.%d" % n, "172.29.20.%d" % n
        self.control = "http://%s:3129" % self.svc_ip
        self.proxy = (self.svc_ip, 3128)
        cfg = os.path.join(tmp, name + ".toml")
        with open(cfg, "w") as f:
            f.write(
                '[proxy]\nlisten = "%s:3128"\ncontrol = "%s:3129"\nfacts = "/var/lib/loom-egress/facts.db"\n'
                '[proxy.dns]\nservers = ["127.0.0.1:9"]\n'
                '[tools.t]\negress = ["allowed.example:443"]\n'
                '[cell]\nid = "%s"\nadvertise_control = "%s"\n'
                '[export]\nsink = "postgres"\ndsn_env = "EGRESS_EXPORT_DSN"\nflush_ms = 50\nmax_lag = %d\n'
                % (self.svc_ip, self.svc_ip, name, self.control, MAX_LAG))
        os.chmod(cfg, 0o644)
        run(["docker", "create", "--name", self.container, "--network", SVC_NET, "--ip", self.svc_ip,
             "--label", "loom.fleet.test=1", "-e", "EGRESS_CONTROL_TOKEN=" + token, "-e", "EGRESS_EXPORT_DSN=" + dsn,
             "-v", "%s:/etc/loom-egress/egress.toml:ro" % cfg, stack_test.IMAGE])
        self.connect()
        run(["docker", "start", self.container])
        self.wait_healthy()

    def connect(self):
        run(["docker", "network", "connect", "--ip", self.data_ip, DATA_NET, self.container])

    def disconnect(self):
        run(["docker", "network", "disconnect", DATA_NET, self.container])

    def wait_healthy(self):
        poll(self.name + " healthy", lambda: (http(self.control + "/healthz") is not None, "no answer"), 30, 0.2)

    def get(self, path):
        return json.loads(http(self.control + path, token=self.token))

    def lag(self):
        return self.get("/v1/cell")["export_lag"]

    def readyz(self):
        try:
            return 200, http(self.control + "/readyz").strip()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode().strip()

    def new_run(self):
        v = json.loads(http(self.control + "/v1/runs", token=self.token, data={"tool": "t"}))
        return "Basic " + base64.b64encode(("%s:%s" % (v["run_id"], v["secret"])).encode()).decode()

    def local_facts(self):
        out, after = [], 0
        while True:
            page = self.get("/v1/facts?after=%d&limit=1000" % after)["facts"]
            if not page:
                return out
            after = page[-1]["seq"]
            out.extend(page)

    def logs(self):
        r = run(["docker", "logs", "--tail", "30", self.container], check=False)
        return (r.stdout or "") + (r.stderr or "")


def deny(proxy, auth, n):
    """One denied fetch; its status, or None when the proxy is gone."""
    host = "h%d.denied.example" % n
    req = "GET http://%s/ HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\nConnection: close\r\n\r\n" % (host, host, auth)
    try:
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(req.encode())
            head = s.recv(64).decode(errors="replace")
        return int(head.split(" ")[1])
    except (OSError, ValueError, IndexError):
        return None


def flood(cell, auth, start, count, workers=8, stop_after=None):
    """`count` denials numbered from `start`; returns how many were 403.
    With stop_after, calls it once that many were answered (from a worker)."""
    lock, state = threading.Lock(), {"next": start, "ok": 0, "fired": False}

    def worker():
        while True:
            with lock:
                n = state["next"]
                if n >= start + count:
                    return
                state["next"] += 1
            status = deny(cell.proxy, auth, n)
            if status is None:
                return
            if status != 403:
                raise Failure("%s answered a denial %s" % (cell.name, status))
            with lock:
                state["ok"] += 1
                fire = stop_after is not None and state["ok"] >= stop_after[0] and not state["fired"]
                state["fired"] |= fire
            if fire:
                stop_after[1]()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return state["ok"]


def exported_once(pg, cell):
    local = cell.local_facts()
    if not local:
        raise Failure("%s has no facts" % cell.name)
    epoch, head = local[0]["epoch"], local[-1]["seq"]
    where = "cell = '%s' AND epoch = '%s'" % (cell.name, epoch)
    row = pg.query("SELECT count(*), COALESCE(max(seq), 0), count(DISTINCT id) FROM egress_facts WHERE " + where)
    if row != "%d|%d|%d" % (head, head, head):
        raise Failure("%s: count | max(seq) | distinct ids = %s, the local head is %d" % (cell.name, row, head))
    remote = [json.loads(line) for line in
              pg.query("SELECT body::text FROM egress_facts WHERE %s ORDER BY seq" % where).splitlines()]
    if remote != [f for f in local if f["epoch"] == epoch]:
        raise Failure("%s: the exported bodies differ from the local facts" % cell.name)
    return head, epoch


def until_exported(cell, cap=10):
    poll("%s's lag 0" % cell.name, lambda: (cell.lag() == 0, "lag %s" % cell.lag()), cap, 0.05)


def leftovers():
    found = []
    for cmd in (["docker", "ps", "-a", "-q", "--filter", "label=loom.fleet.test=1"],
                ["docker", "network", "ls", "-q", "--filter", "name=" + PREFIX]):
        found += run(cmd, check=False).stdout.split()
    return found


def cleanup():
    for c in CELLS:
        run(["docker", "rm", "-f", "%s-%s" % (PREFIX, c)], check=False)
    for net in (SVC_NET, DATA_NET):
        run(["docker", "network", "rm", net], check=False)


def main():
    if shutil.which("docker") is None or run(["docker", "info"], check=False).returncode != 0:
        return skip("no Docker engine available")
    if os.geteuid() != 0:
        return skip("it needs root (to run PostgreSQL as `postgres`)")
    if not os.path.exists(os.path.join(PG_BIN, "initdb")):
        return skip("PostgreSQL 15 is not installed (.ci/run installs `postgresql`)")
    token = secrets.token_hex(24)
    tmp = tempfile.mkdtemp(prefix="loom-fleet-test-")
    os.chmod(tmp, 0o755)
    pg, cells, ok = None, {}, False
    try:
        stack_test.build(None)
        cleanup()
        with phase("networks, PostgreSQL on the data network's gateway, two cells"):
            run(["docker", "network", "create", "--subnet", SVC_SUBNET, SVC_NET])
            run(["docker", "network", "create", "--subnet", DATA_SUBNET, "--gateway", DATA_GATEWAY, DATA_NET])
            pg = Postgres(DATA_GATEWAY)
            dsn = "host=%s port=%d user=postgres dbname=postgres sslmode=disable" % (DATA_GATEWAY, pg.port)
            for name in CELLS:
                cells[name] = Cell(name, tmp, token, dsn)
        a, b = cells["cell-a"], cells["cell-b"]
        auth_a, auth_b = a.new_run(), b.new_run()

        with phase("1. floods on both cells, exported once"):
            results = {}
            ts = [threading.Thread(target=lambda c=c, au=au: results.__setitem__(c.name, flood(c, au, 0, 200)))
                  for c, au in ((a, auth_a), (b, auth_b))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if results != {"cell-a": 200, "cell-b": 200}:
                raise Failure("denials answered: %s" % results)
            for c in (a, b):
                until_exported(c)
                log("%s: %d facts exported once (epoch %s)" % ((c.name,) + exported_once(pg, c)))

        with phase("2. docker kill in a flood, docker start: the same store exports the rest"):
            epoch = a.local_facts()[0]["epoch"]
            answered = flood(a, auth_a, 1000, 400, stop_after=(100, lambda: run(["docker", "kill", a.container])))
            if answered < 100:
                raise Failure("only %d denials answered before the kill" % answered)
            run(["docker", "start", a.container])
            a.wait_healthy()
            auth_a = a.new_run()
            if flood(a, auth_a, 2000, 50) != 50:
                raise Failure("cell-a after its restart does not answer denials")
            until_exported(a)
            head, epoch_after = exported_once(pg, a)
            if epoch_after != epoch:
                raise Failure("the restarted cell has a new epoch %s (was %s): its store was lost" % (epoch_after, epoch))
            dupes = pg.query("SELECT count(*) - count(DISTINCT id) FROM egress_facts")
            if dupes != "0":
                raise Failure("%s duplicate ids in egress_facts" % dupes)
            log("cell-a killed after %d answered denials, restarted: %d facts, epoch kept, none twice" % (answered, head))

        with phase("3. cell-b disconnected from the data network, then connected again"):
            b.disconnect()
            got = flood(b, auth_b, 3000, 60), flood(a, auth_a, 3000, 30)
            if got != (60, 30):
                raise Failure("denials answered while cut (cell-b, cell-a): %s" % (got,))
            poll("cell-b's lag past max_lag", lambda: (b.lag() > MAX_LAG, "lag %s" % b.lag()), 10, 0.1)
            poll("cell-b unready", lambda: (b.readyz() == (503, "export_lag"), b.readyz()), 10, 0.1)
            until_exported(a)
            if a.readyz()[0] != 200:
                raise Failure("cell-a is unready while only cell-b is cut: %s" % (a.readyz(),))
            lag_cut = b.lag()
            b.connect()
            t0 = time.monotonic()
            until_exported(b, cap=10)
            log("cell-b: lag %d while cut, 0 again %.2f s after `docker network connect`" % (lag_cut, time.monotonic() - t0))
            poll("cell-b ready", lambda: (b.readyz()[0] == 200, b.readyz()), 10, 0.1)
            for c in (a, b):
                exported_once(pg, c)
        ok = True
    except (Failure, subprocess.TimeoutExpired) as e:
        print("\nFAIL fleet test on Docker: %s\n" % e, flush=True)
        for c in cells.values():
            print("--- %s\n%s" % (c.name, c.logs()[-8000:]))
    finally:
        cleanup()
        if pg is not None:
            pg.close()
        shutil.rmtree(tmp, ignore_errors=True)
    left = leftovers()
    if left:
        print("FAIL fleet test on Docker: left behind %s" % left, flush=True)
        ok = False
    for name, secs in stack_test.TIMINGS:
        log("timing: %-60s %6.1fs" % (name, secs))
    log("%s in %.1fs" % ("PASS" if ok else "FAIL", time.monotonic() - stack_test.T0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
