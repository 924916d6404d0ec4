#!/usr/bin/env bash
# Prints the path of a promtool: the one on PATH, else the one from Debian's
# `prometheus` package, unpacked (not installed: installing it would start a
# Prometheus server on machines with systemd) into $LOOM_CACHE_DIR.
set -euo pipefail
if command -v promtool >/dev/null; then command -v promtool; exit 0; fi
CACHE_DIR=${LOOM_CACHE_DIR:-/var/cache/loom-egress}
dir="$CACHE_DIR/promtool"
if [ ! -x "$dir/usr/bin/promtool" ]; then
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  chmod 755 "$tmp"   # apt downloads as _apt
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download prometheus >/dev/null)
  dpkg-deb -x "$tmp"/prometheus_*.deb "$dir"
fi
echo "$dir/usr/bin/promtool"
