#!/usr/bin/env bash
# The systemd units of deploy/systemd: `systemd-analyze verify` passes (with
# stand-in executables at the units' ExecStart paths, so the check does not
# need the binaries installed), the directives the docs promise are there,
# and `systemd-analyze security` scores them (printed; recorded in
# docs/operations.md#systemd). Needs systemd-analyze (Debian: systemd);
# skips loudly without it.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v systemd-analyze >/dev/null; then
  echo "tests/systemd: SKIPPED: systemd-analyze not found (install Debian's systemd package)" >&2
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/units"
for b in egress-proxy egress-executor; do
  printf '#!/bin/sh\nexit 0\n' >"$work/bin/$b"
  chmod +x "$work/bin/$b"
done
for u in deploy/systemd/*.service deploy/systemd/*.socket; do
  sed "s#/usr/local/bin/#$work/bin/#g" "$u" >"$work/units/$(basename "$u")"
done

fail=0
out=$(cd "$work/units" && SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no ./*.service ./*.socket 2>&1) || fail=1
# verify also complains about unrelated units of the host (e.g. a missing
# network-online.target provider); only lines naming our units count.
ours=$(printf '%s\n' "$out" | grep -E 'loom-egress-(proxy|executor|control)\.(service|socket)' || true)
if [ -n "$ours" ]; then
  printf '%s\n' "$ours" >&2
  fail=1
elif [ "$fail" = 1 ]; then
  # A failure with no line about our units: show it all, still a failure.
  printf '%s\n' "$out" >&2
fi
[ "$fail" = 0 ] && echo "ok   systemd-analyze verify deploy/systemd/*.service deploy/systemd/*.socket"

need() { # unit directive=value
  if grep -qx "$2" "deploy/systemd/$1"; then
    echo "ok   $1: $2"
  else
    echo "FAIL $1: missing $2" >&2
    fail=1
  fi
}
for d in DynamicUser=yes ProtectSystem=strict StateDirectory=loom-egress NoNewPrivileges=yes \
  'CapabilityBoundingSet=' 'RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6' 'SystemCallFilter=@system-service'; do
  need loom-egress-proxy.service "$d"
done
for d in Delegate=yes NoNewPrivileges=yes ProtectSystem=strict \
  'CapabilityBoundingSet=CAP_SYS_ADMIN CAP_NET_ADMIN CAP_SETUID CAP_SETGID CAP_CHOWN CAP_FOWNER CAP_KILL CAP_DAC_OVERRIDE'; do
  need loom-egress-executor.service "$d"
done
# Socket activation: the names the binaries look the passed sockets up by.
need loom-egress-proxy.socket FileDescriptorName=proxy
need loom-egress-control.socket FileDescriptorName=control
need loom-egress-executor.socket FileDescriptorName=executor
need loom-egress-proxy.service 'Sockets=loom-egress-proxy.socket loom-egress-control.socket'
# Directives that would break a confinement layer (docs/operations.md#systemd).
for d in '^ProtectControlGroups=yes' '^RestrictNamespaces=' '^PrivateUsers=' '^MemoryDenyWriteExecute='; do
  if grep -qE "$d" deploy/systemd/loom-egress-executor.service; then
    echo "FAIL loom-egress-executor.service: ${d#^} breaks a confinement layer" >&2
    fail=1
  fi
done

# Exposure scores (lower is better); `security --offline` reads unit files
# (systemd >= 252). Printed, not asserted.
if systemd-analyze security --help 2>&1 | grep -q -- '--offline'; then
  for u in loom-egress-proxy.service loom-egress-executor.service; do
    score=$(cd "$work/units" && systemd-analyze security --offline=yes --no-pager "./$u" 2>/dev/null \
      | grep -E 'Overall exposure level' | sed 's/\x1b\[[0-9;]*m//g' | sed 's/.*: *//' || true)
    echo "info systemd-analyze security $u: ${score:-unavailable}"
  done
fi
exit "$fail"
