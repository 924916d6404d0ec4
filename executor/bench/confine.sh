#!/usr/bin/env bash
# Confinement benchmark: builds the confine_bench and rust_echo examples in
# release mode and runs them as root. Prints Markdown tables: cold start by
# layer (Rust and Python tools), warm dispatch under strict and off, and a
# 100 MiB download through the hand-off listener, the relay and no confinement.
# Usage: executor/bench/confine.sh [N]   (N cold starts per row, default 50)
set -euo pipefail
cd "$(dirname "$0")/../.."
N="${1:-50}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build --release -p egress-executor --example confine_bench -p egress-tool --example rust_echo
"$CARGO_TARGET_DIR/release/examples/confine_bench" "$CARGO_TARGET_DIR/release/examples/rust_echo" "$N"
