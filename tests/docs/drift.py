#!/usr/bin/env python3
"""The docs against the code, where the comparison can be mechanical.

- Deny reasons and fetch errors: the tables of docs/policy.md against the
  one outcome table (proxy/src/deny.rs): every code in both, with the same
  status and rule; every `X-Egress-Deny-Reason:` / `X-Egress-Error:` value
  any page shows is a real code.
- Metrics: every family the two services register is listed in
  docs/metrics.md, and every metric-like name any page shows in backticks is
  one they export.
- Config keys: every key `egress-config` reads is named in
  docs/configuration.md, and every key of every TOML example in the docs is
  one it reads.

Run by .ci/run; exits 1 with one line per drift.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

sys.path.insert(0, str(ROOT / "tests" / "compose"))
from stackcheck import exported_metrics  # noqa: E402  (the same reading the dashboards are checked with)


def rel(p):
    return p.relative_to(ROOT)


# ------------------------------------------------------------ outcomes ----

def arms(text, enum, fn):
    """{variant: value} of `match self` in `fn <fn>(self)` of `impl <enum>`;
    `_` gives the default for variants not named."""
    impl = re.search(r"impl %s \{(.*?)\n\}" % enum, text, re.S)
    if not impl:
        raise SystemExit(f"drift: no `impl {enum}` in proxy/src/deny.rs")
    body = re.search(r"fn %s\(self\)[^{]*\{\s*match self \{(.*?)\n        \}" % fn, impl.group(1), re.S)
    if not body:
        raise SystemExit(f"drift: no `{enum}::{fn}` match in proxy/src/deny.rs")
    out, default = {}, None
    arm = r"((?:%s::\w+\s*\|?\s*)+|_)\s*=>\s*(?:\{\s*([^{}]+?)\s*\}|([^,{]+?)\s*,\n)" % enum
    for m in re.finditer(arm, body.group(1) + "\n"):
        value = (m.group(2) or m.group(3)).strip().strip('"')
        if m.group(1) == "_":
            default = value
        for v in re.findall(r"%s::(\w+)" % enum, m.group(1)):
            out[v] = value
    return out, default


STATUS = {
    "PROXY_AUTHENTICATION_REQUIRED": "407", "BAD_REQUEST": "400", "FORBIDDEN": "403",
    "TOO_MANY_REQUESTS": "429", "BAD_GATEWAY": "502", "SERVICE_UNAVAILABLE": "503",
    "GATEWAY_TIMEOUT": "504",
}


def status_of(expr):
    return STATUS.get(expr.replace("StatusCode::", ""), expr)


def outcomes():
    """(deny reasons {code: (status, rule)}, fetch errors {code: status})."""
    text = (ROOT / "proxy/src/deny.rs").read_text()
    codes, _ = arms(text, "DenyReason", "code")
    status, default = arms(text, "DenyReason", "status")
    rules, _ = arms(text, "DenyReason", "rule")
    deny = {c: (status_of(status.get(v, default)), rules[v]) for v, c in codes.items()}
    ecodes, _ = arms(text, "FetchError", "code")
    estatus, edefault = arms(text, "FetchError", "status")
    errors = {c: status_of(estatus.get(v, edefault)) for v, c in ecodes.items()}
    return deny, errors


def table_rows(text, heading):
    """The rows of the first table after `heading`, as lists of cells."""
    at = text.find(heading)
    if at < 0:
        return None
    rows, started = [], False
    # The heading is the table's header row: the rows start after it.
    for line in text[at:].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set(cells[0]) <= set("-: "):
                rows.append(cells)
        elif started:
            break
    return rows


def unquote(cell):
    return cell.strip().strip("`")


def check_outcomes(errors):
    deny, fetch = outcomes()
    policy = (ROOT / "docs/policy.md").read_text()
    rows = table_rows(policy, "| code | status | rule | meaning |")
    if rows is None:
        errors.append("docs/policy.md: the deny reasons table (| code | status | rule | meaning |) is gone")
        rows = []
    documented = {}
    for cells in rows:
        documented[unquote(cells[0])] = (cells[1], unquote(cells[2]))
    for code, (status, rule) in deny.items():
        if code not in documented:
            errors.append(f"docs/policy.md: deny reason `{code}` (proxy/src/deny.rs) is not in the deny reasons table")
        elif documented[code] != (status, rule):
            errors.append(f"docs/policy.md: deny reason `{code}` is documented as {documented[code]}, the code says {(status, rule)}")
    for code in documented:
        if code not in deny:
            errors.append(f"docs/policy.md: deny reason `{code}` is documented but proxy/src/deny.rs has no such code")
    rows = table_rows(policy, "| status | `X-Egress-Error` | meaning |") or []
    if not rows:
        errors.append("docs/policy.md: the errors table (| status | `X-Egress-Error` | meaning |) is gone")
    documented = {unquote(c[1]): c[0] for c in rows if unquote(c[1]) not in ("—", "-", "")}
    for code, status in fetch.items():
        if code not in documented:
            errors.append(f"docs/policy.md: error `{code}` (proxy/src/deny.rs) is not in the errors table")
        elif documented[code] != status:
            errors.append(f"docs/policy.md: error `{code}` is documented with status {documented[code]}, the code says {status}")
    for code in documented:
        if code not in fetch:
            errors.append(f"docs/policy.md: error `{code}` is documented but proxy/src/deny.rs has no such code")
    known = set(deny) | set(fetch)
    for doc in DOCS:
        for m in re.finditer(r"X-Egress-(?:Deny-Reason|Error):\s*`?([a-z_]+)", doc.read_text()):
            if m.group(1) not in known and m.group(1) != "code":
                errors.append(f"{rel(doc)}: `{m.group(0)}` names no deny reason or error of proxy/src/deny.rs")


# ------------------------------------------------------------- metrics ----

# Backticked names that look like metrics but are not: the crates (as Rust
# spells them) and the fleet's PostgreSQL tables and views (read from its
# schema below).
CRATES = {
    "egress_api", "egress_config", "egress_e2e", "egress_executor", "egress_fleet", "egress_proxy",
    "egress_splice", "egress_tool",
}


def not_metrics():
    names = set(CRATES)
    sql = sorted((ROOT / "fleet").rglob("*.rs")) + sorted((ROOT / "deploy").rglob("*.sql"))
    for src in sql:
        names.update(re.findall(
            r"(?i)create\s+(?:or\s+replace\s+)?(?:table|view|index)\s+(?:if\s+not\s+exists\s+)?(?:\{s\}\.)?(\w+)",
            src.read_text()))
    # The executor's claims table, named with its schema at run time.
    names.update(re.findall(r'format!\("\{\}\.(\w+)"', (ROOT / "fleet/src/claims.rs").read_text()))
    return names


METRIC = r"(?:egress|executor|process)_[a-z0-9_]+"


def check_metrics(errors):
    exported = exported_metrics()
    listed = set(re.findall(r"`(%s)" % METRIC, (ROOT / "docs/metrics.md").read_text()))
    # A family is listed under one of its sample names (a counter with
    # `_total`, a histogram by its base name).
    missing = set()
    for name in sorted(exported):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        if not ({name, base, base + "_total"} & listed):
            missing.add(base)
    for base in sorted(missing):
        errors.append(f"docs/metrics.md: `{base}` is exported but not listed")
    skip = not_metrics()
    for doc in DOCS:
        for m in re.finditer(r"`(%s)(?:\{[^`]*\})?`" % METRIC, doc.read_text()):
            name = m.group(1)
            if name not in skip and name not in exported:
                errors.append(f"{rel(doc)}: `{name}` is not a metric either service exports")


# --------------------------------------------------------- config keys ----

READERS = r"(?:take|table|optional_table|get|or|required|list|int|count|millis|addr|choice|has)"


def code_keys():
    """Keys `egress-config` reads: the first argument of a section's reader
    (`s.or("key", …)`, `s.list::<T>("key")`), or the key a helper is given
    beside the section (`nets(s, "key")`, `pick(&mut s, "key", …)`)."""
    keys = set()
    for src in sorted((ROOT / "config/src").glob("*.rs")):
        text = src.read_text().split("#[cfg(test)]")[0]
        keys.update(re.findall(r"\.%s(?:::<[^>]*>+)?\(\s*\"([a-z][a-z0-9_]*)\"" % READERS, text))
        keys.update(re.findall(r"\b[a-z_]+\(\s*(?:&mut\s+)?[a-z]\w*\s*,\s*\"([a-z][a-z0-9_]*)\"", text))
    return keys


def toml_blocks(text):
    return re.findall(r"```toml\n(.*?)```", text, re.S)


def keys_of(block):
    """Lower-case keys a TOML example sets, commented-out ones included."""
    keys = set()
    for line in block.splitlines():
        line = re.sub(r"^\s*#\s?", "", line)
        if line.lstrip().startswith("["):
            continue
        m = re.match(r"\s*([a-z][a-z0-9_]*)\s*=", line)
        if m:
            keys.add(m.group(1))
        for inline in re.findall(r"\{([^{}]*)\}", line):
            keys.update(re.findall(r"(?:^|,)\s*([a-z][a-z0-9_]*)\s*=", inline))
    return keys


def check_config(errors):
    keys = code_keys()
    reference = (ROOT / "docs/configuration.md").read_text()
    named = set(re.findall(r"[a-z][a-z0-9_]*", reference))
    for key in sorted(keys):
        if key not in named:
            errors.append(f"docs/configuration.md: config key `{key}` (config/src) is not documented")
    for doc in DOCS:
        for block in toml_blocks(doc.read_text()):
            for key in sorted(keys_of(block) - keys):
                errors.append(f"{rel(doc)}: a TOML example sets `{key}`, which egress-config does not read")


def main():
    errors = []
    check_outcomes(errors)
    check_metrics(errors)
    check_config(errors)
    for e in errors:
        print(e)
    if errors:
        print(f"drift: {len(errors)} difference(s) between the docs and the code")
        return 1
    print("drift: deny reasons, errors, metrics and config keys in the docs match the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
