#!/usr/bin/env bash
# Side-by-side benchmark in one command: installs the peers from Debian's
# packages (nginx as origin, squid, tinyproxy) when missing, builds, raises the
# open-files limit and runs egress-bench (bench/src/main.rs), which starts the
# origin, egress-proxy, squid and tinyproxy on loopback only, measures every
# figure and stops them, then runs the executor's warm-dispatch benchmark. A peer that cannot be installed is skipped loudly.
#
# Usage: bench/run.sh [--smoke] [--out FILE] [--only FIGURES] [--callgrind DIR]
#   --smoke  tiny counts and a debug build, for CI: numbers mean nothing.
#   --out    JSON results (default bench/results/<UTC time>.json, with
#            --smoke target/bench-smoke.json).
#   --only   comma-separated figures among keepalive, tunnels, bulk, idle,
#            denials, intercept, leafs, scrub, dispatch, sustained (default: all; dispatch and sustained need root).
#   --callgrind  egress-proxy under valgrind's callgrind: its user-space
#            instructions per operation (exact and repeatable; the rates are
#            then 30-50x lower and mean nothing). Dumps go to DIR.
# The Markdown table goes to stdout, progress to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=; args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1; args+=(--smoke) ;;
    --out) args+=(--out "$2"); shift ;;
    --only) args+=(--only "$2"); shift ;;
    --callgrind) args+=(--callgrind "$2"); shift ;;
    *) echo "usage: bench/run.sh [--smoke] [--out FILE] [--only FIGURES] [--callgrind DIR]" >&2; exit 2 ;;
  esac
  shift
done

# Peers from Debian. Installing must not start their system services, so a
# policy-rc.d that forbids it is put in place for the install when none exists.
missing=
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing="$missing nginx"
command -v squid >/dev/null || [ -x /usr/sbin/squid ] || missing="$missing squid"
command -v tinyproxy >/dev/null || missing="$missing tinyproxy"
# The warm-dispatch figure runs the Python and Node.js runners.
command -v node >/dev/null || missing="$missing nodejs"
command -v python3 >/dev/null || missing="$missing python3"
case " ${args[*]:-} " in *" --callgrind "*) command -v valgrind >/dev/null || missing="$missing valgrind" ;; esac
if [ -n "$missing" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  for p in $missing; do
    apt-get install -y -qq "$p" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$p" >/dev/null 2>&1; } \
      || echo "*** could not install $p: it will be skipped ***" >&2
  done
  [ -z "$policy" ] || rm -f /usr/sbin/policy-rc.d
elif [ -n "$missing" ]; then
  echo "*** not installed and cannot install (needs root and apt-get):$missing ***" >&2
fi

if [ -n "$smoke" ]; then
  cargo build -q -p egress-proxy -p egress-bench -p egress-executor --bins \
    --example dispatch_bench -p egress-tool --example rust_echo
  bin=target/debug/egress-bench
else
  cargo build -q --release -p egress-proxy -p egress-bench -p egress-executor --bins \
    --example dispatch_bench -p egress-tool --example rust_echo
  bin=target/release/egress-bench
fi

# 10,000 idle tunnels need a little over 20,000 descriptors in each proxy
# (two sockets each) and 10,000 here; raise the limit as far as allowed.
ulimit -Hn 200000 2>/dev/null || true
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# egress-bench kills what it starts; this is for a crash or a signal: each
# recorded pid still running one of the programs it started is killed.
pids=$(mktemp)
cleanup() {
  while read -r pid; do
    case "$(cat /proc/"$pid"/comm 2>/dev/null)" in
      nginx|squid|tinyproxy|egress-proxy) kill -9 "$pid" 2>/dev/null || true ;;
    esac
  done < "$pids"
  rm -f "$pids"
}
trap cleanup EXIT
# Everything runs on loopback, in a network namespace of its own when this
# is root: the host's connection tracking and firewall rules stay out of the
# figures. On a host whose rules load conntrack, the ~10,000 connections per
# second of the tunnel figures fill its table (TIME_WAIT entries live 120 s),
# and once it is full the kernel drops new SYNs: the path measured at that
# moment stalls on 1 s retransmits and its rate means nothing.
# LOOM_BENCH_HOST_NET=1 keeps the host's namespace.
# (`ip` comes from iproute2.)
if [ "$(id -u)" = 0 ] && [ -z "${LOOM_BENCH_HOST_NET:-}" ] && command -v ip >/dev/null \
  && unshare -n true 2>/dev/null; then
  unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$bin" --pids "$pids" "${args[@]}"
else
  "$bin" --pids "$pids" "${args[@]}"
fi
