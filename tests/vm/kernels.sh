#!/usr/bin/env bash
# Prints, one per line, `<name> <path to vmlinuz>` for each kernel of the VM
# matrix, fetched from the Debian archive the machine's apt is configured
# with (`apt-get download`; no mirror is named here) and cached under
# $LOOM_CACHE_DIR/vm (default /var/cache/loom-egress/vm): only the vmlinuz
# is kept. Matrix: bookworm's 6.1 (newest ABI package) and the 6.12 packaged
# for bookworm. Set LOOM_VM_KERNELS="6.1" to run one.
set -euo pipefail
CACHE_DIR=${LOOM_CACHE_DIR:-/var/cache/loom-egress}/vm
mkdir -p "$CACHE_DIR"
want=${LOOM_VM_KERNELS:-6.1 6.12}

newest() { apt-cache search --names-only "$1" | awk '{print $1}' | sort -V | tail -1; }

for k in $want; do
  case $k in
    6.1) pkg=$(newest '^linux-image-6\.1\.0-[0-9]+-amd64$') ;;
    6.12) pkg=$(newest '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$') ;;
    *) echo "kernels.sh: unknown kernel $k (6.1, 6.12)" >&2; exit 2 ;;
  esac
  if [ -z "$pkg" ]; then
    echo "kernels.sh: no package for Linux $k in the configured archive (apt-get update?)" >&2
    exit 1
  fi
  img="$CACHE_DIR/$pkg.vmlinuz"
  if [ ! -s "$img" ]; then
    work=$(mktemp -d "$CACHE_DIR/dl.XXXXXX")
    chmod 0755 "$work"
    (cd "$work" && apt-get download -qq "$pkg" >/dev/null)
    dpkg-deb --fsys-tarfile "$work"/*.deb | tar -xO --wildcards './boot/vmlinuz-*' >"$img.tmp"
    mv "$img.tmp" "$img"
    rm -rf "$work"
  fi
  echo "$k $img"
done
