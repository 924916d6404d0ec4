#!/usr/bin/env bash
# Makes `qemu-system-x86_64` available for the VM matrix on a machine where
# installing Debian's qemu-system-x86 would remove a package (a newer
# qemu-utils from backports breaks the older qemu-system-common): the
# packages are fetched from the archive the machine's apt is configured with
# (`apt-get download`; no mirror is named here), unpacked with `dpkg-deb -x`
# under $LOOM_CACHE_DIR/qemu (default /var/cache/loom-egress/qemu), and only
# the shared libraries the emulator links are installed, the same way as any
# other package (never at the price of removing one). A wrapper in
# /usr/local/bin points the emulator at the unpacked firmware (-L) and
# modules (QEMU_MODULE_DIR: software emulation, TCG, is one).
#
# Does nothing when a qemu-system-x86_64 of the machine's own is on PATH;
# when the one on PATH is this script's wrapper, it checks again that the
# emulator's libraries are there (a package removed since takes one away)
# and installs what is missing. Exit 1 (and says why) when it cannot be
# made available; tests/vm/run.sh then skips loudly.
set -euo pipefail
CACHE_DIR=${LOOM_CACHE_DIR:-/var/cache/loom-egress}/qemu
root=$CACHE_DIR/root
emu=$root/usr/bin/qemu-system-x86_64
on_path=$(command -v qemu-system-x86_64 || true)
if [ -n "$on_path" ] && ! grep -qsF "$emu" "$on_path"; then
  exit 0
fi
if ! [ -x "$emu" ]; then
  rm -rf "$CACHE_DIR" && mkdir -p "$CACHE_DIR/debs"
  chmod 0755 "$CACHE_DIR/debs"
  (cd "$CACHE_DIR/debs" &&
    apt-get download -qq qemu-system-x86 qemu-system-common qemu-system-data seabios ipxe-qemu >/dev/null 2>&1) || {
    echo "tests/vm/qemu.sh: apt-get download of qemu-system-x86 failed" >&2
    exit 1
  }
  for d in "$CACHE_DIR"/debs/*.deb; do dpkg-deb -x "$d" "$root"; done
  # The emulator's own dependencies but the qemu packages just unpacked
  # (the ones that would remove a package) and the firmware.
  dpkg-deb -f "$CACHE_DIR"/debs/qemu-system-x86_*.deb Depends | tr ',' '\n' |
    sed 's/^ *//; s/ .*//; s/|.*//' | grep -v -e '^qemu-' -e '^seabios$' -e '^ipxe-qemu$' >"$CACHE_DIR/libs"
  rm -rf "$CACHE_DIR/debs"
fi
if ldd "$emu" | grep -q 'not found'; then
  # shellcheck disable=SC2046
  apt-get install -y -qq --no-remove --no-install-recommends $(cat "$CACHE_DIR/libs") >/dev/null || {
    echo "tests/vm/qemu.sh: the emulator's libraries cannot be installed: $(xargs <"$CACHE_DIR/libs")" >&2
    exit 1
  }
fi
if ldd "$emu" | grep -q 'not found'; then
  echo "tests/vm/qemu.sh: still missing: $(ldd "$emu" | awk '/not found/ {print $1}' | xargs)" >&2
  exit 1
fi
cat >/usr/local/bin/qemu-system-x86_64 <<EOF
#!/bin/sh
QEMU_MODULE_DIR="$root/usr/lib/x86_64-linux-gnu/qemu" exec "$emu" -L "$root/usr/share/qemu" -L "$root/usr/share/seabios" -L "$root/usr/lib/ipxe/qemu" "\$@"
EOF
chmod 0755 /usr/local/bin/qemu-system-x86_64
echo "tests/vm/qemu.sh: qemu-system-x86_64 unpacked under $root ($("$emu" --version | head -1))" >&2
