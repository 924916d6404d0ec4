#!/usr/bin/env python3
"""Static checks of the stack's dashboards and rules (no Docker needed):

- each dashboard JSON decodes into Grafana's own dashboard types (the
  grafana-foundation-sdk package) with no key the types do not know and every
  value of the type, enum or literal the types declare;
- every panel has a title, a description, a datasource, a query and a unit;
  both dashboards have the templated `tool` variable; build.py is up to date;
- every metric a dashboard or rule uses is one the code exports (read from
  proxy/src/metrics.rs and executor/src/metrics.rs) or a recording rule;
- every alert has a runbook line, and a promtool unit test that fires it and
  one that does not;
- Grafana's provisioning agrees with the dashboards and the compose file, and
  the compose file keeps the stack's rules (healthchecks, restarts, pinned
  images, no privileged container, all capabilities dropped, a non-root
  proxy, the executor and demo only on the internal tools network).

Also the source of every PromQL expression for the compose test
(`expressions()`). Usage: python3 tests/compose/stackcheck.py
"""

import enum
import json
import pathlib
import re
import subprocess
import sys
import types
import typing

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARDS = ["dashboards/egress.json", "dashboards/executor.json"]
RULES = ROOT / "dashboards/alerts.yml"
RULE_TESTS = ROOT / "dashboards/tests/alerts_test.yml"
METRIC_SOURCES = ["proxy/src/metrics.rs", "executor/src/metrics.rs"]
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "$tool": ".*"}


# ---------------------------------------------------------------- metrics ----

def exported_metrics():
    """Sample names the code exports: registered families and collector descriptors."""
    names = set()
    for src in METRIC_SOURCES:
        text = (ROOT / src).read_text()
        # registry.register("name", "help", family.clone()) and encode_descriptor("name", …)
        # registry.register("name", "help", field.clone()): the kind follows from the field's type.
        for m in re.finditer(r'register\(\s*"([a-z_:][a-z0-9_:]*)"\s*,\s*"(?:\\.|[^"\\])*"\s*,\s*([a-z_.]+)\.clone\(\)', text):
            # `store.bytes.clone()`: the field is the last segment of the path.
            base, field = m.group(1), m.group(2).split(".")[-1]
            names.add(base)
            kind = None
            decl = re.search(r"pub %s:\s*([^\n]+)" % field, text)
            if decl:
                d = decl.group(1)
                kind = "histogram" if "Hist" in d else "counter" if "Counter" in d else "gauge"
            if kind == "counter":
                names.add(base + "_total")
            elif kind == "histogram":
                names.update(base + s for s in ("_bucket", "_sum", "_count"))
        # Collectors: encode_descriptor("name", "help", None, c.metric_type()) of a ConstCounter/ConstGauge.
        for m in re.finditer(r'encode_descriptor\(\s*"([a-z_:][a-z0-9_:]*)"', text):
            names.add(m.group(1))
            before = text[max(0, m.start() - 300):m.start()]
            if before.rfind("ConstCounter") > before.rfind("ConstGauge"):
                names.add(m.group(1) + "_total")
    return names


KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan", "le"}


def metric_names(expr):
    """Metric names a PromQL expression selects (a small tokenizer, enough for our rules)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)                    # strings
    e = re.sub(r"\{[^}]*\}", " ", e)                                # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)                               # ranges and subqueries
    e = re.sub(r"(?<![A-Za-z0-9_:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?", " ", e)  # numbers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        tok = m.group(0)
        after = e[m.end():].lstrip()
        if after.startswith("(") or tok.lower() in KEYWORDS or tok.startswith("$"):
            continue
        names.add(tok)
    return names


def load_rules():
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# ------------------------------------------------------------ expressions ----

def substitute(expr):
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return expr


def expressions():
    """(where, raw expression, must return data) for every query of the stack."""
    out = []
    for path in DASHBOARDS:
        d = json.loads((ROOT / path).read_text())
        for p in panels(d):
            for t in p.get("targets", []):
                out.append(("%s: %s [%s]" % (path, p["title"], t["refId"]), t["expr"], True))
    for r in load_rules():
        name = r.get("record") or r.get("alert")
        # An alert's expression returns data only while it fires; it must parse and evaluate.
        out.append(("alerts.yml: %s" % name, r["expr"], "record" in r))
    return out


def panels(d):
    for p in d.get("panels", []):
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


# ---------------------------------------------------- Grafana type checks ----

def check_value(value, hint, path, errors):
    """Checks `value` (already decoded by the SDK) against the type hint `hint`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is typing.Any or hint is object:
        # Panel options and custom field config are typed per panel plugin: check what the SDK decoded.
        if type(value).__module__.startswith("grafana_foundation_sdk."):
            check_object(value, path, errors)
        return
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        alternatives = [a for a in args if a is not type(None)]
        trials = []
        for a in alternatives:
            e = []
            check_value(value, a, path, e)
            if not e:
                return
            trials.append(e)
        # Report the errors of the one alternative that fits the value's shape, if any.
        shaped = [t for a, t in zip(alternatives, trials)
                  if isinstance(a, type) and isinstance(value, a) or typing.get_origin(a) is list and isinstance(value, list)]
        errors.extend(shaped[0] if len(shaped) == 1 else ["%s: %r matches none of %s" % (path, value, hint)])
        return
    if origin is typing.Literal:
        if value not in args:
            errors.append("%s: %r is not one of %s" % (path, value, args))
        return
    if origin in (list, typing.List):
        if not isinstance(value, list):
            errors.append("%s: expected a list, got %r" % (path, value))
            return
        for i, v in enumerate(value):
            check_value(v, args[0] if args else typing.Any, "%s[%d]" % (path, i), errors)
        return
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            errors.append("%s: expected an object, got %r" % (path, value))
            return
        for k, v in value.items():
            check_value(v, args[1] if len(args) > 1 else typing.Any, "%s.%s" % (path, k), errors)
        return
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        raw = value.value if isinstance(value, enum.Enum) else value
        if raw not in allowed:
            errors.append("%s: %r is not one of %s" % (path, raw, allowed))
        return
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            errors.append("%s: expected a number, got %r" % (path, value))
        return
    if hint in (int, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            errors.append("%s: expected %s, got %r" % (path, hint.__name__, value))
        return
    if isinstance(hint, type):
        if isinstance(value, dict) and hasattr(hint, "from_json"):
            value = hint.from_json(value)   # the SDK leaves some members (transformations) undecoded
        if not isinstance(value, hint):
            errors.append("%s: expected %s, got %r" % (path, hint.__name__, value))
            return
        check_object(value, path, errors)


def check_object(obj, path, errors):
    try:
        hints = typing.get_type_hints(type(obj))
    except Exception as e:  # an SDK class whose hints cannot be resolved: nothing to check
        errors.append("%s: cannot read the types of %s: %s" % (path, type(obj).__name__, e))
        return
    for name, hint in hints.items():
        if hasattr(obj, name):
            check_value(getattr(obj, name), hint, "%s.%s" % (path, name), errors)


def lost_keys(original, roundtrip, path=""):
    """Keys of `original` that the typed round trip dropped: keys Grafana's types do not know."""
    lost = []
    if isinstance(original, dict):
        if not isinstance(roundtrip, dict):
            return [path or "/"]
        for k, v in original.items():
            if k not in roundtrip:
                lost.append("%s.%s" % (path, k))
            else:
                lost.extend(lost_keys(v, roundtrip[k], "%s.%s" % (path, k)))
    elif isinstance(original, list) and isinstance(roundtrip, list):
        for i, (a, b) in enumerate(zip(original, roundtrip)):
            lost.extend(lost_keys(a, b, "%s[%d]" % (path, i)))
    return lost


def check_dashboard_types(path, raw, errors):
    from grafana_foundation_sdk.cog import plugins, runtime
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as pm

    plugins.register_default_plugins()
    d = dm.Dashboard.from_json(raw)
    check_object(d, path, errors)
    back = json.loads(json.dumps(d, cls=JSONEncoder))
    for k in lost_keys(raw, back):
        # `panels` of an expanded row are typed as generic panels in the SDK's RowPanel.
        errors.append("%s: key %s is not in Grafana's dashboard types" % (path, k))
    for p in d.panels or []:
        if isinstance(p, dm.RowPanel):
            continue
        where = "%s: panel %r" % (path, p.title)
        if runtime.panelcfg_config(p.type_val) is None:
            errors.append("%s: unknown panel type %r" % (where, p.type_val))
        elif p.options is not None and isinstance(p.options, dict):
            errors.append("%s: options were not decoded as %s options" % (where, p.type_val))
        for t in p.targets or []:
            if not isinstance(t, pm.Dataquery):
                errors.append("%s: target is not a Prometheus query: %r" % (where, t))


def check_dashboards(errors):
    exported = exported_metrics()
    recorded = {r["record"] for r in load_rules() if "record" in r}
    known = exported | recorded | {"up"}
    for path in DASHBOARDS:
        raw = json.loads((ROOT / path).read_text())
        check_dashboard_types(path, raw, errors)
        names = [v.get("name") for v in raw.get("templating", {}).get("list", [])]
        if "tool" not in names:
            errors.append("%s: no templated `tool` variable" % path)
        for v in raw.get("templating", {}).get("list", []):
            for m in metric_names(re.sub(r"label_values\(([^,]+),.*", r"\1", v.get("definition", ""))):
                if m not in known:
                    errors.append("%s: variable %s uses %s, which the code does not export" % (path, v["name"], m))
        seen_ids = set()
        for p in raw.get("panels", []):
            if p["id"] in seen_ids:
                errors.append("%s: duplicate panel id %s" % (path, p["id"]))
            seen_ids.add(p["id"])
        for p in panels(raw):
            where = "%s: panel %r" % (path, p.get("title"))
            if not p.get("title"):
                errors.append("%s: no title" % where)
            if not p.get("description"):
                errors.append("%s: no description" % where)
            if (p.get("datasource") or {}).get("uid") != "prometheus":
                errors.append("%s: no Prometheus datasource" % where)
            if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                errors.append("%s: no unit" % where)
            targets = p.get("targets") or []
            if not targets or not all(t.get("expr") for t in targets):
                errors.append("%s: no query" % where)
            for t in targets:
                if (t.get("datasource") or {}).get("uid") != "prometheus":
                    errors.append("%s [%s]: query without the Prometheus datasource" % (where, t.get("refId")))
                for m in metric_names(t.get("expr", "")):
                    if m not in known:
                        errors.append("%s: uses %s, which the code does not export" % (where, m))
    for r in load_rules():
        for m in metric_names(r["expr"]):
            if m not in known:
                errors.append("alerts.yml: %s uses %s, which the code does not export" % (r.get("record") or r.get("alert"), m))
    r = subprocess.run([sys.executable, str(ROOT / "dashboards/build.py"), "--check"], capture_output=True, text=True)
    if r.returncode != 0:
        errors.append(r.stderr.strip() or "dashboards/build.py --check failed")


def check_alerts(errors):
    alerts = [r for r in load_rules() if "alert" in r]
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
    for a in alerts:
        name = a["alert"]
        if not a.get("annotations", {}).get("runbook"):
            errors.append("alerts.yml: %s has no runbook annotation" % name)
        if name not in fired:
            errors.append("alerts_test.yml: no test where %s fires" % name)
        if name not in quiet:
            errors.append("alerts_test.yml: no test where %s stays quiet" % name)


def check_stack_files(errors):
    """Provisioning agrees with the dashboards and the compose file; the compose
    file keeps the stack's rules (health, restarts, pins, privileges, networks)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    ds = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    if [d.get("uid") for d in ds] != ["prometheus"]:
        errors.append("grafana datasource: expected one datasource with uid `prometheus`, the uid the dashboards use")
    provider = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/dashboards/loom-egress.yml").read_text())["providers"][0]
    mounts = dict(v.rsplit(":", 2)[:2] if v.count(":") >= 2 else v.split(":", 1) for v in services["grafana"]["volumes"])
    if mounts.get("./dashboards") != provider["options"]["path"]:
        errors.append("grafana: the dashboard provider path is not where docker-compose.yml mounts ./dashboards")
    home = services["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    if home != provider["options"]["path"] + "/egress.json":
        errors.append("grafana: the home dashboard is not the provisioned egress.json")
    if not services["grafana"]["environment"].get("GF_AUTH_ANONYMOUS_ENABLED") == "true" \
            or services["grafana"]["environment"].get("GF_AUTH_ANONYMOUS_ORG_ROLE") != "Viewer":
        errors.append("grafana: anonymous access must be enabled as Viewer")
    for name, svc in services.items():
        if "healthcheck" not in svc:
            errors.append("compose: service %s has no healthcheck" % name)
        if svc.get("restart") != "unless-stopped":
            errors.append("compose: service %s does not restart unless-stopped" % name)
        if svc.get("privileged"):
            errors.append("compose: service %s is privileged" % name)
        image = svc.get("image", "")
        if not re.search(r":v?\d+\.\d+\.\d+$", image):
            errors.append("compose: service %s image %r is not pinned to a version" % (name, image))
        if "ALL" not in svc.get("cap_drop", []):
            errors.append("compose: service %s does not drop all capabilities" % name)
    if (services["proxy"].get("user") or "0").split(":")[0] in ("0", "root"):
        errors.append("compose: the proxy must not run as root")
    for name in ("executor", "demo"):
        if set(services[name]["networks"]) != {"tools"}:
            errors.append("compose: %s must be on the tools network only" % name)
    if not compose["networks"]["tools"].get("internal"):
        errors.append("compose: the tools network must be internal")
    if set(services["proxy"]["networks"]) != {"tools", "egress"}:
        errors.append("compose: the proxy must be on both the tools and the egress network")
    for name in ("proxy", "executor", "demo"):
        if not services[name].get("env_file"):
            errors.append("compose: %s must take the control token from an env file" % name)
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM ") and "${" not in line and not re.search(r":[\w.-]*\d[\w.-]*( |$)", line):
            errors.append("Dockerfile: base image not pinned: %s" % line)


def main():
    errors = []
    check_dashboards(errors)
    check_alerts(errors)
    check_stack_files(errors)
    for e in errors:
        print("FAIL", e)
    n = sum(1 for path in DASHBOARDS for _ in panels(json.loads((ROOT / path).read_text())))
    if errors:
        sys.exit("stackcheck: %d problem(s)" % len(errors))
    print("stackcheck: %d panels in %d dashboards, %d rules: types, titles, units, queries, metrics, alert tests, provisioning and compose rules OK"
          % (n, len(DASHBOARDS), len(load_rules())))


if __name__ == "__main__":
    main()
