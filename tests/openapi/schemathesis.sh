#!/usr/bin/env bash
# Schemathesis against both control APIs, each with its own served OpenAPI
# document: builds egress-proxy and egress-executor (debug), starts them on
# free loopback ports with a test config (tool `echo`: tests/openapi/echo_tool.py
# under the Python runner, unconfined), runs every check with positive and
# negative data, the seed and bounds of tests/openapi/schemathesis.toml,
# against the executor then the proxy, and stops both. Fails on any failure.
#
# Usage: tests/openapi/schemathesis.sh [--keep DIR]
#   --keep DIR  write the configs, logs and reports into DIR (kept), instead
#               of a temporary directory removed at the end.
# Needs: python3 with tests/openapi/requirements.txt installed, curl.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

keep=
case "${1:-}" in
  --keep) keep=$2; mkdir -p "$keep" ;;
  "") ;;
  *) echo "usage: tests/openapi/schemathesis.sh [--keep DIR]" >&2; exit 2 ;;
esac

python3 -c 'import schemathesis' 2>/dev/null || {
  echo "schemathesis is not installed: python3 -m pip install -r tests/openapi/requirements.txt" >&2
  exit 2
}
cargo build -q -p egress-proxy -p egress-executor --bins

work=${keep:-$(mktemp -d)}
pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  [ -n "$keep" ] || rm -rf "$work"
}
trap cleanup EXIT

# Three free loopback ports (bound to port 0, then released).
read -r data control executor < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)

cat > "$work/egress.toml" <<EOF
[proxy]
listen = "127.0.0.1:$data"
control = "127.0.0.1:$control"
facts = "facts.db"

[proxy.dns]
servers = ["127.0.0.1:9"]   # nothing listens: no resolver is ever asked
timeout_ms = 500

[audit]
signing_key_file = "audit.key"   # GET /v1/audit/checkpoint answers 200

[executor]
listen = "127.0.0.1:$executor"

[tools.echo]
egress = []

[tools.echo.process]
command = ["python3", "$root/executor/runners/loom_runner.py", "$root/tests/openapi/echo_tool.py"]
isolation = "off"
timeout_ms = 5000
pool = { warm = 1, max = 4 }
EOF

target/debug/egress-proxy audit keygen --out "$work/audit.key" >/dev/null
export EGRESS_CONTROL_TOKEN="schemathesis-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
export EGRESS_LOG=warn

# Waits until $1 answers 200, or fails naming the log $2.
wait_for() {
  for _ in $(seq 1 100); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ]; then
      return 0
    fi
    sleep 0.1
  done
  echo "no answer from $1; its log:" >&2
  tail -20 "$2" >&2
  exit 1
}

target/debug/egress-proxy serve --config "$work/egress.toml" >"$work/proxy.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$control/readyz" "$work/proxy.log"
target/debug/egress-executor serve --config "$work/egress.toml" >"$work/executor.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$executor/healthz" "$work/executor.log"

# One API: its document from the service itself, the settings of
# schemathesis.toml, the control token on every request.
fuzz() {
  local name=$1 port=$2
  echo "== schemathesis: $name (127.0.0.1:$port)"
  python3 -m schemathesis.cli --no-color --config-file tests/openapi/schemathesis.toml run \
    "http://127.0.0.1:$port/v1/openapi.json" \
    -H "Authorization: Bearer $EGRESS_CONTROL_TOKEN" \
    --report junit --report-dir "$work/report-$name"
}

status=0
# The executor first: the proxy's run releases owners, the executor's among them.
fuzz executor "$executor" || status=1
fuzz proxy "$control" || status=1
exit $status
