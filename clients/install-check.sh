#!/usr/bin/env bash
# The kernel clients install the way their ecosystems expect (run by .ci/run):
#   - Python: `pip install ./clients/python` into a fresh virtualenv (build
#     isolation on: setuptools comes from PyPI), imported from outside the
#     source tree, its metadata and py.typed checked, and `mypy --strict` on
#     the module (mypy pinned in clients/python/requirements-test.txt);
#   - JavaScript: `npm pack` of ./clients/js installed into a fresh project
#     (offline: no dependencies), imported by name, its .d.ts shipped and
#     naming every export (clients/js/test/exports.test.mjs checks the source).
# Seconds; leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# -- Python -------------------------------------------------------------------
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --disable-pip-version-check "$root/clients/python"
rm -rf "$root/clients/python/build" "$root/clients/python/"*.egg-info
(cd "$tmp" && "$tmp/venv/bin/python" - <<'PY'
import importlib.metadata as md
import os
import loom_egress
from loom_egress import EgressError, ExecutorClient, McpError, McpSession, ProxyClient  # noqa: F401

assert "site-packages" in loom_egress.__file__, loom_egress.__file__
meta = md.metadata("loom-egress")
assert meta["Name"] == "loom-egress" and meta["Version"], meta
assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
assert meta["Requires-Python"], "python-requires"
assert os.path.isfile(os.path.join(os.path.dirname(loom_egress.__file__), "py.typed")), "py.typed"
assert ExecutorClient("http://127.0.0.1:1", token="t").mcp_url("x") == "http://127.0.0.1:1/v1/mcp/x"
print("python: loom-egress", meta["Version"], "installs and imports")
PY
)
python3 -m mypy --strict "$root/clients/python/loom_egress"
# The installed package is typed for its users too: a caller type-checks against it.
cat > "$tmp/user.py" <<'PY'
from loom_egress import ExecutorClient, McpError

def tools(url: str) -> list[str]:
    with ExecutorClient(url).mcp_session("fetch") as s:
        return [t["name"] for t in s.list_tools()]

def reason(e: McpError) -> str | None:
    return e.reason
PY
(cd "$tmp" && MYPYPATH= python3 -m mypy --strict --python-executable "$tmp/venv/bin/python" --no-incremental user.py)

# -- JavaScript ---------------------------------------------------------------
mkdir "$tmp/pack" "$tmp/project"
npm pack --silent --pack-destination "$tmp/pack" "$root/clients/js" >/dev/null
(cd "$tmp/project" \
  && npm init -y >/dev/null \
  && npm install --offline --no-audit --no-fund --silent "$tmp"/pack/loom-egress-*.tgz \
  && test -f node_modules/loom-egress/loom-egress.d.ts \
  && test ! -L node_modules/loom-egress \
  && node --input-type=module -e "
    import * as m from 'loom-egress';
    import fs from 'node:fs';
    const dts = fs.readFileSync('node_modules/loom-egress/loom-egress.d.ts', 'utf8');
    const declared = [...dts.matchAll(/^export declare (?:const|class|function) (\w+)/gm)].map((x) => x[1]).sort();
    const names = Object.keys(m).sort();
    if (JSON.stringify(declared) !== JSON.stringify(names)) {
      console.error('the .d.ts declares', declared, 'the module exports', names);
      process.exit(1);
    }
    const pkg = JSON.parse(fs.readFileSync('node_modules/loom-egress/package.json', 'utf8'));
    console.log('js: loom-egress', pkg.version, 'installs and imports;', names.length, 'exports, all typed');
  ")
