#!/usr/bin/env python3
"""Invariants of the rendered Kubernetes manifests (deploy/k8s) that a schema
cannot check: every container has probes (long-running ones), resources and a
securityContext; no pod shares the node's network, PID or IPC namespace; the
proxy runs non-root, read-only, without capabilities; the executor adds only
the capabilities confinement needs; the termination grace outlasts the drain
plus the export flush; the cells' NetworkPolicy lets them out only to DNS,
PostgreSQL and the internet minus the proxy's default denied ranges (read from
`egress-proxy ranges --json`, never copied); a tenant namespace's pods reach
only the cells; the ConfigMap's config passes `egress-proxy check`.

    invariants.py --proxy BIN RENDERED.yaml...   exit 1 with every problem
    invariants.py --proxy BIN --self-test RENDERED.yaml
        breaks the manifests one way at a time and expects each to fail
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import tomllib

import yaml

# The kinds the fleet may use: core Kubernetes only (no CRDs, no operators).
CORE_KINDS = {
    "Namespace", "ConfigMap", "Secret", "Service", "StatefulSet",
    "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount",
}
# What confinement needs, and nothing else (docs/executor.md, "In a container").
EXECUTOR_CAPS = {"SYS_ADMIN", "NET_ADMIN", "SETUID", "SETGID", "KILL", "CHOWN", "FOWNER", "DAC_OVERRIDE"}
CELL_PORTS = {3128, 3129, 3130}
# The executor's own drain at SIGTERM (executor/src/main.rs), in seconds.
EXECUTOR_DRAIN_S = 5
# [export] flush_timeout_ms's default (config/src/fleet.rs), in seconds.
DEFAULT_FLUSH_S = 10


def load(paths):
    docs = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def ranges(proxy):
    out = subprocess.run([proxy, "ranges", "--json"], check=True, capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def check_config(proxy, text):
    """(problems, notes): `egress-proxy check` on the ConfigMap's file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "egress.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        r = subprocess.run([proxy, "check", "--config", path], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return [], []
        return [f"ConfigMap egress.toml fails `egress-proxy check`: {r.stderr.strip()}"], []


SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "k8s", "base", "statefulset.yaml")


def capability_comments(text):
    """Problems: a capability added in the manifest's source without a comment
    on its line saying what confinement needs it for (comments do not survive
    rendering, so this reads the source)."""
    problems, in_add, indent = [], False, 0
    for n, ln in enumerate(text.splitlines(), 1):
        stripped = ln.strip()
        if stripped == "add:":
            in_add, indent = True, len(ln) - len(ln.lstrip())
            continue
        if in_add:
            if stripped.startswith("- "):
                item = stripped[2:].split("#", 1)
                if len(item) < 2 or not item[1].strip():
                    problems.append(f"statefulset.yaml:{n}: capability {item[0].strip()} has no comment saying why")
            elif stripped and (len(ln) - len(ln.lstrip())) <= indent:
                in_add = False
    return problems


def pod_specs(docs):
    for d in docs:
        if d.get("kind") in ("StatefulSet", "Deployment", "DaemonSet", "Job", "ReplicaSet"):
            yield d, d["spec"]["template"]
        elif d.get("kind") == "Pod":
            yield d, d


def name(d):
    return f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"


def check(docs, proxy):
    problems, notes = [], []
    bad = problems.append

    for d in docs:
        if d.get("kind") not in CORE_KINDS:
            bad(f"{name(d)}: not one of the core kinds the fleet may use")

    configs = [d for d in docs if d.get("kind") == "ConfigMap" and "egress.toml" in (d.get("data") or {})]
    if len(configs) != 1:
        bad(f"expected one ConfigMap with egress.toml, found {len(configs)}")
        cfg_text = ""
    else:
        cfg_text = configs[0]["data"]["egress.toml"]
    cfg = tomllib.loads(cfg_text) if cfg_text else {}

    sets = [d for d in docs if d.get("kind") == "StatefulSet"]
    if len(sets) != 1:
        bad(f"expected one StatefulSet (the cells), found {len(sets)}")

    for owner, tpl in pod_specs(docs):
        spec = tpl["spec"]
        for k in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(k):
                bad(f"{name(owner)}: {k} is set (a NetworkPolicy cannot select host-networked pods)")
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            where = f"{name(owner)} container {c['name']}"
            res = c.get("resources") or {}
            if not (res.get("requests") and res.get("limits") and "memory" in res["limits"]):
                bad(f"{where}: resources need requests and limits (memory at least)")
            if not c.get("securityContext"):
                bad(f"{where}: no securityContext")
        for c in spec.get("containers", []):
            where = f"{name(owner)} container {c['name']}"
            for p in ("readinessProbe", "livenessProbe"):
                if not c.get(p):
                    bad(f"{where}: no {p}")

    for st in sets:
        spec = st["spec"]
        pod = spec["template"]["spec"]
        ctrs = {c["name"]: c for c in pod.get("containers", [])}
        proxy_c, exec_c = ctrs.get("proxy"), ctrs.get("executor")
        if not proxy_c or not exec_c:
            bad(f"{name(st)}: needs containers proxy and executor")
            continue

        # Probes: the proxy's readiness is /readyz, liveness /healthz.
        rp = (proxy_c.get("readinessProbe") or {}).get("httpGet", {}).get("path")
        lp = (proxy_c.get("livenessProbe") or {}).get("httpGet", {}).get("path")
        if rp != "/readyz" or lp != "/healthz":
            bad(f"{name(st)}: the proxy's probes must be /readyz (readiness) and /healthz (liveness), are {rp}, {lp}")

        sc = proxy_c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if not (sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0):
            bad(f"{name(st)}: the proxy must run as a non-root uid")
        if sc.get("readOnlyRootFilesystem") is not True:
            bad(f"{name(st)}: the proxy's root filesystem must be read-only")
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
            bad(f"{name(st)}: the proxy must not escalate privileges")
        if caps.get("drop") != ["ALL"] or caps.get("add"):
            bad(f"{name(st)}: the proxy must drop ALL capabilities and add none")

        esc = exec_c.get("securityContext") or {}
        ecaps = esc.get("capabilities") or {}
        added = set(ecaps.get("add") or [])
        if ecaps.get("drop") != ["ALL"]:
            bad(f"{name(st)}: the executor must drop ALL capabilities before adding")
        if added - EXECUTOR_CAPS:
            bad(f"{name(st)}: the executor adds capabilities confinement does not need: {sorted(added - EXECUTOR_CAPS)}")
        if esc.get("privileged"):
            bad(f"{name(st)}: the executor must not be privileged")
        if esc.get("readOnlyRootFilesystem") is not True:
            bad(f"{name(st)}: the executor's root filesystem must be read-only")

        # The cell id is the pod's name, in both containers.
        for c in (proxy_c, exec_c):
            env = {e["name"]: e for e in c.get("env", [])}
            ref = env.get("EGRESS_CELL_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref != "metadata.name":
                bad(f"{name(st)} container {c['name']}: EGRESS_CELL_ID must come from the pod name (fieldRef metadata.name)")
            for k in ("EGRESS_ADVERTISE_PROXY", "EGRESS_ADVERTISE_CONTROL", "EGRESS_ADVERTISE_EXECUTOR"):
                v = env.get(k, {}).get("value", "")
                if f".{spec.get('serviceName')}." not in v or "$(EGRESS_CELL_ID)" not in v:
                    bad(f"{name(st)} container {c['name']}: {k} must name the pod in the headless Service")

        # One cell per node.
        terms = (((pod.get("affinity") or {}).get("podAntiAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        if not any(t.get("topologyKey") == "kubernetes.io/hostname" for t in terms):
            bad(f"{name(st)}: required pod anti-affinity on kubernetes.io/hostname (one cell per node)")

        # The fact store on a PVC, mounted where the config puts it.
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        facts = (cfg.get("proxy") or {}).get("facts", "")
        mounted = [m for m in proxy_c.get("volumeMounts", []) if m["name"] in claims]
        if not any(facts.startswith(m["mountPath"].rstrip("/") + "/") for m in mounted):
            bad(f"{name(st)}: the fact store {facts!r} is not on a volumeClaimTemplates volume of the proxy")

        # Both containers see the hand-off socket's directory and ca_dir (the
        # children read the CA bundle there) from one volume.
        def volume_of(c, path):
            best = None
            for m in c.get("volumeMounts", []):
                mp = m["mountPath"].rstrip("/") + "/"
                if path.startswith(mp) and (best is None or len(mp) > len(best[0])):
                    best = (mp, m["name"])
            return best and best[1]

        proxy_cfg = cfg.get("proxy") or {}
        shared = {"[proxy] handoff": proxy_cfg.get("handoff"),
                  "[proxy.interception] ca_dir": (proxy_cfg.get("interception") or {}).get("ca_dir")}
        for key, path in shared.items():
            if not path:
                bad(f"{name(st)}: the config needs an absolute {key} on a volume both containers mount")
                continue
            path = path.rstrip("/") + "/"
            vp, ve = volume_of(proxy_c, path), volume_of(exec_c, path)
            if not vp or vp != ve:
                bad(f"{name(st)}: {key} {path} is not on one volume of both containers ({vp}, {ve})")

        # Grace > drain + flush.
        grace = pod.get("terminationGracePeriodSeconds", 30)
        drain = (cfg.get("proxy") or {}).get("drain_timeout_ms", 10000) / 1000
        flush = (cfg.get("export") or {}).get("flush_timeout_ms", DEFAULT_FLUSH_S * 1000) / 1000
        if not grace > max(drain, EXECUTOR_DRAIN_S) + flush:
            bad(f"{name(st)}: terminationGracePeriodSeconds {grace} is not longer than the drain ({drain:g} s) plus the flush ({flush:g} s)")

        # Services: headless (not-ready addresses published) for per-cell names.
        svcs = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
        hl = svcs.get(spec.get("serviceName"))
        if not hl or hl["spec"].get("clusterIP") != "None" or hl["spec"].get("publishNotReadyAddresses") is not True:
            bad(f"{name(st)}: serviceName must be a headless Service with publishNotReadyAddresses: true")
        if not any(s["spec"].get("clusterIP") != "None" and s["spec"].get("type", "ClusterIP") == "ClusterIP"
                   and not s["spec"].get("publishNotReadyAddresses") for s in svcs.values()):
            bad("no ClusterIP Service (ready cells only) for new work")
        if not any(d.get("kind") == "PodDisruptionBudget" for d in docs):
            bad("no PodDisruptionBudget")

    # The cells' NetworkPolicy.
    want = ranges(proxy)
    cell_labels = {}
    if sets:
        cell_labels = sets[0]["spec"]["selector"].get("matchLabels", {})
    nps = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    cells_np = [n for n in nps if n["spec"].get("podSelector", {}).get("matchLabels") == cell_labels and cell_labels]
    if len(cells_np) != 1:
        bad(f"expected one NetworkPolicy selecting the cells, found {len(cells_np)}")
    for np_ in cells_np:
        spec = np_["spec"]
        if set(spec.get("policyTypes", [])) != {"Ingress", "Egress"}:
            bad(f"{name(np_)}: policyTypes must be Ingress and Egress")
        for rule in spec.get("ingress", []):
            peers = rule.get("from") or []
            if not peers or any("namespaceSelector" not in p or "ipBlock" in p for p in peers):
                bad(f"{name(np_)}: every ingress rule must come from selected namespaces only")
            ports = {p.get("port") for p in rule.get("ports") or [{}]}
            if not ports <= CELL_PORTS:
                bad(f"{name(np_)}: ingress to ports {sorted(ports, key=str)} beyond the cells' {sorted(CELL_PORTS)}")
        blocks = {}
        for rule in spec.get("egress", []):
            peers = rule.get("to") or []
            if not peers:
                bad(f"{name(np_)}: an egress rule without `to` allows everything")
            for p in peers:
                if "ipBlock" in p:
                    blocks[p["ipBlock"]["cidr"]] = p["ipBlock"].get("except") or []
        if set(blocks) != {"0.0.0.0/0", "::/0"}:
            bad(f"{name(np_)}: egress ipBlocks must be exactly 0.0.0.0/0 and ::/0, are {sorted(blocks)}")
        for cidr, fam in (("0.0.0.0/0", "ipv4"), ("::/0", "ipv6")):
            got = blocks.get(cidr)
            if got is not None and sorted(got) != sorted(want[fam]):
                missing = sorted(set(want[fam]) - set(got))
                extra = sorted(set(got) - set(want[fam]))
                bad(f"{name(np_)}: the except list of {cidr} differs from `egress-proxy ranges`: missing {missing}, extra {extra}")

    # Tenant namespaces (the overlay): default-deny egress except to the cells.
    for np_ in nps:
        if np_ in cells_np:
            continue
        spec = np_["spec"]
        if spec.get("podSelector") != {} or spec.get("policyTypes") != ["Egress"]:
            bad(f"{name(np_)}: a tenant policy must select every pod and fence Egress")
        for rule in spec.get("egress", []):
            for p in rule.get("to") or [None]:
                if p is None or "ipBlock" in p:
                    bad(f"{name(np_)}: a tenant's egress may go only to the cells and DNS, not to addresses")
                    continue
                sel = (p.get("podSelector") or {}).get("matchLabels") or {}
                if sel != cell_labels and sel.get("k8s-app") != "kube-dns":
                    bad(f"{name(np_)}: egress to {sel or 'every pod'}: only the cells and DNS")

    with open(SOURCE, encoding="utf-8") as f:
        problems += capability_comments(f.read())

    if cfg_text:
        p, n = check_config(proxy, cfg_text)
        problems += p
        notes += n
    return problems, notes


def self_test(docs, proxy):
    """Each break must be found; the manifests as rendered must pass."""

    def first(kind, pred=lambda d: True):
        return next(d for d in docs_ if d.get("kind") == kind and pred(d))

    def ctr(n):
        sts = first("StatefulSet")
        return next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == n)

    def cells_np():
        return first("NetworkPolicy", lambda d: d["spec"]["podSelector"] != {})

    breaks = {
        "proxy without readinessProbe": lambda: ctr("proxy").pop("readinessProbe"),
        "hostNetwork": lambda: first("StatefulSet")["spec"]["template"]["spec"].__setitem__("hostNetwork", True),
        "executor without resources": lambda: ctr("executor").pop("resources"),
        "init container without securityContext":
            lambda: first("StatefulSet")["spec"]["template"]["spec"]["initContainers"][0].pop("securityContext"),
        "proxy as root": lambda: ctr("proxy")["securityContext"].update(runAsUser=0, runAsNonRoot=False),
        "executor with NET_RAW": lambda: ctr("executor")["securityContext"]["capabilities"]["add"].append("NET_RAW"),
        "grace 15 s": lambda: first("StatefulSet")["spec"]["template"]["spec"].__setitem__(
            "terminationGracePeriodSeconds", 15),
        "an IPv6 denied range missing from except": lambda: next(
            p["ipBlock"]["except"] for r in cells_np()["spec"]["egress"] for p in r.get("to", [])
            if p.get("ipBlock", {}).get("cidr") == "::/0").pop(),
        "egress to 10.0.0.0/8": lambda: cells_np()["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}),
        "ingress from anywhere": lambda: cells_np()["spec"]["ingress"].append({"ports": [{"port": 3129}]}),
        "not headless-published": lambda: first("Service", lambda d: d["spec"].get("clusterIP") == "None")[
            "spec"].pop("publishNotReadyAddresses"),
        "cell id not from the pod name": lambda: ctr("proxy").__setitem__("env", [
            {"name": "EGRESS_CELL_ID", "value": "cell-a"} if e["name"] == "EGRESS_CELL_ID" else e
            for e in ctr("proxy")["env"]]),
        "a config the proxy refuses": lambda: first("ConfigMap", lambda d: "egress.toml" in d.get("data", {}))[
            "data"].__setitem__("egress.toml", first("ConfigMap", lambda d: "egress.toml" in d.get("data", {}))[
                "data"]["egress.toml"].replace("drain_timeout_ms", "drain_timeout_msx")),
        "hand-off socket not shared": lambda: ctr("executor").__setitem__("volumeMounts", [
            m for m in ctr("executor")["volumeMounts"] if m["mountPath"] != "/run/loom-egress"]),
        "a kind outside the core set": lambda: docs_.append(
            {"kind": "Certificate", "metadata": {"name": "x"}}),
    }
    if any(d.get("kind") == "NetworkPolicy" and d["spec"].get("podSelector") == {} for d in docs):
        breaks["tenant egress to the internet"] = lambda: first(
            "NetworkPolicy", lambda d: d["spec"]["podSelector"] == {})["spec"]["egress"].append(
            {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})

    # What each break must be reported as (not merely some other problem).
    expect = {
        "proxy without readinessProbe": "no readinessProbe",
        "hostNetwork": "hostNetwork is set",
        "executor without resources": "executor: resources",
        "init container without securityContext": "no securityContext",
        "proxy as root": "non-root",
        "executor with NET_RAW": "NET_RAW",
        "grace 15 s": "terminationGracePeriodSeconds 15",
        "an IPv6 denied range missing from except": "except list of ::/0",
        "egress to 10.0.0.0/8": "10.0.0.0/8",
        "ingress from anywhere": "every ingress rule",
        "not headless-published": "publishNotReadyAddresses",
        "cell id not from the pod name": "EGRESS_CELL_ID",
        "a config the proxy refuses": "drain_timeout_msx",
        "a kind outside the core set": "Certificate/x",
        "hand-off socket not shared": "[proxy] handoff",
        "tenant egress to the internet": "a tenant's egress",
    }
    ok = True
    docs_ = copy.deepcopy(docs)
    problems, _ = check(docs_, proxy)
    if problems:
        print("self-test: the unbroken manifests fail:\n  " + "\n  ".join(problems))
        ok = False
    with open(SOURCE, encoding="utf-8") as f:
        src = f.read()
    uncommented = src.replace("- NET_ADMIN     #", "- NET_ADMIN  \n#", 1)
    if src == uncommented or not capability_comments(src) == [] or not capability_comments(uncommented):
        print("self-test: a capability without its comment: NOT caught")
        ok = False
    else:
        print(f"self-test: a capability without its comment: caught ({capability_comments(uncommented)[0]})")
    for what, brk in breaks.items():
        docs_ = copy.deepcopy(docs)
        brk()
        problems, _ = check(docs_, proxy)
        hit = [p for p in problems if expect[what] in p]
        if hit:
            print(f"self-test: {what}: caught ({hit[0].splitlines()[0]})")
        else:
            print(f"self-test: {what}: NOT caught")
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy", required=True, help="the egress-proxy binary")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("rendered", nargs="+")
    a = ap.parse_args()
    docs = load(a.rendered)
    if a.self_test:
        return 0 if self_test(docs, a.proxy) else 1
    problems, notes = check(docs, a.proxy)
    for n in notes:
        print(n)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        return 1
    print(f"{', '.join(a.rendered)}: {len(docs)} objects, invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
