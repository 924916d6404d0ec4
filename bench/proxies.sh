#!/usr/bin/env bash
# Side-by-side data-path benchmark: direct, egress-proxy, squid and tinyproxy in
# one run, on loopback only. Installs squid and tinyproxy if missing (Debian),
# starts them with minimal loopback configs, runs throughput_bench, stops them.
# Usage: bench/proxies.sh [seconds] [clients]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}; clients=${2:-16}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
if ! command -v squid >/dev/null || ! command -v tinyproxy >/dev/null; then
  apt-get update -qq && apt-get install -y -qq squid tinyproxy >/dev/null
fi
cat > "$work/squid.conf" <<CONF
http_port 127.0.0.1:13180
http_access allow all
cache deny all
access_log none
cache_log $work/squid-cache.log
pid_filename $work/squid.pid
visible_hostname localhost
dns_nameservers 127.0.0.1
workers 1
CONF
cat > "$work/tinyproxy.conf" <<CONF
Port 13181
Listen 127.0.0.1
Timeout 600
MaxClients 1024
Allow 127.0.0.1
LogLevel Critical
PidFile "$work/tinyproxy.pid"
CONF
squid -N -f "$work/squid.conf" >"$work/squid.out" 2>&1 & echo $! > "$work/squid-main.pid"
tinyproxy -d -c "$work/tinyproxy.conf" >"$work/tinyproxy.out" 2>&1 & echo $! > "$work/tinyproxy-main.pid"
sleep 2
cargo build --release -q -p egress-proxy --bin egress-proxy
cargo build --release -q -p egress-e2e --example throughput_bench
EXTRA_PROXY="squid=127.0.0.1:13180,tinyproxy=127.0.0.1:13181" \
  EGRESS_LOG=warn target/release/examples/throughput_bench "$secs" "$clients"
