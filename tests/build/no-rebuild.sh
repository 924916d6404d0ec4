#!/usr/bin/env bash
# Builds reuse their work: after a build of a set of members, building any
# member or subset again compiles nothing, because every member depends on
# the workspace-hack crate (`cargo hakari`), which turns on one set of
# features of each shared crate. Run by .ci/run after the workspace's debug
# build (cargo test --workspace) and after bench/run.sh's release build.
#
# Usage: tests/build/no-rebuild.sh [--release] FIRST… -- SUBSET… [-- SUBSET…]…
#   the first group of build flags (say `--workspace`) is built as it may;
#   each later group (say `-p egress-proxy`) is built in turn and must
#   compile nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=()
if [ "${1:-}" = "--release" ]; then profile=(--release); shift; fi
status=0
first=1
run() {
  local out
  out=$(cargo build "${profile[@]}" "$@" 2>&1) || { echo "$out" >&2; exit 1; }
  local compiled
  compiled=$(grep -E '^\s+Compiling ' <<<"$out" || true)
  if [ $first = 1 ]; then
    first=0
    echo "no-rebuild: cargo build ${profile[*]} $*: built ($(grep -c . <<<"$compiled" || true) compiled)"
  elif [ -n "$compiled" ]; then
    echo "no-rebuild: cargo build ${profile[*]} $* compiled again:" >&2
    echo "$compiled" >&2
    status=1
  else
    echo "no-rebuild: cargo build ${profile[*]} $*: nothing compiled"
  fi
}
group=()
for a in "$@"; do
  if [ "$a" = "--" ]; then run "${group[@]}"; group=(); else group+=("$a"); fi
done
[ ${#group[@]} -eq 0 ] || run "${group[@]}"
exit $status
