#!/usr/bin/env bash
# Warm dispatch through the executor's HTTP API: builds the release proxy,
# executor, rust_echo and dispatch_bench, runs N sequential invocations per
# tool (Rust, Python runner, Node runner), unconfined and strict, and prints
# p50/p99. Run as root (PID namespaces, strict confinement).
# Usage: executor/bench/dispatch.sh [N [memory]]   (default 200; `memory`: the
# proxy keeps facts in memory, so its durable writes are not measured)
set -euo pipefail
cd "$(dirname "$0")/../.."
N="${1:-200}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build --release -p egress-proxy -p egress-executor --bins --example dispatch_bench -p egress-tool --example rust_echo
R="$CARGO_TARGET_DIR/release"
echo "# $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(python3 --version 2>&1), node $(node --version 2>&1), user $(id -un)"
"$R/examples/dispatch_bench" "$R/egress-proxy" "$R/egress-executor" "$R/examples/rust_echo" "$N" ${2:-}
