#!/usr/bin/env bash
# Executor benchmark: builds the executor's bench and rust_echo examples in
# release mode and runs them. Prints Markdown tables (median and p99 of cold
# start, warm round trip, and sequential / 8-way concurrent throughput).
# Usage: executor/bench/run.sh [N]   (N invocations per measurement, default 200)
# Run as root to measure the default PID-namespace mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
N="${1:-200}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build --release -p egress-executor --example bench -p egress-tool --example rust_echo
echo "# $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) cores, kernel $(uname -r), $(/usr/bin/python3 --version 2>&1 || true) (tools run /usr/bin/python3), user $(id -un)"
"$CARGO_TARGET_DIR/release/examples/bench" "$CARGO_TARGET_DIR/release/examples/rust_echo" "$N"
