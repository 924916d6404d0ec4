#!/usr/bin/env bash
# Builds the appliance's base root filesystem from Debian packages with
# debootstrap and imports it as a local Docker image, for machines that cannot
# pull images. Prints the image tag on stdout.
#
# The mirror is the one this machine's apt configuration uses; the tarball is
# cached under $LOOM_CACHE_DIR (default /var/cache/loom-egress), keyed by the
# suite, the mirror and the package list, and rebuilt whenever it is missing.
set -euo pipefail

PACKAGES="python3 nodejs prometheus ca-certificates wget"
CACHE_DIR=${LOOM_CACHE_DIR:-/var/cache/loom-egress}
log() { echo "build-rootfs: $*" >&2; }

. /etc/os-release
SUITE=${LOOM_SUITE:-${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}}

# The first configured Debian mirror serving $SUITE/main (deb822 or one-line format).
mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$SUITE" '
      function flush() { if (uris != "" && (" " suites " ") ~ (" " suite " ") && (" " comps " ") ~ / main /) { split(uris, u, " "); print u[1]; found = 1; exit } uris = suites = comps = "" }
      /^[ \t]*$/ { flush(); next }
      /^URIs:/ { sub(/^URIs:[ \t]*/, ""); uris = $0 }
      /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
      /^Components:/ { sub(/^Components:[ \t]*/, ""); comps = $0 }
      END { if (!found) flush() }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk -v suite="$SUITE" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i+1) == suite) { for (j = i+2; j <= NF; j++) if ($j == "main") { print $i; exit } } }'
}
MIRROR=${LOOM_MIRROR:-$( (mirror || true) | head -n1)}
[ -n "$MIRROR" ] || { log "no Debian mirror for $SUITE/main in the apt configuration"; exit 1; }

KEY=$(printf '%s\n' "v1" "$SUITE" "$MIRROR" "$PACKAGES" | sha256sum | cut -c1-16)
TAG="loom-egress-rootfs:$SUITE-$KEY"
TARBALL="$CACHE_DIR/rootfs-$SUITE-$KEY.tar.gz"

if docker image inspect "$TAG" >/dev/null 2>&1; then
  log "image $TAG present"
  echo "$TAG"; exit 0
fi

if [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
  mkdir -p "$CACHE_DIR"
  work=$(mktemp -d "$CACHE_DIR/build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  log "debootstrap $SUITE from the configured mirror with: $PACKAGES (a few minutes)"
  debootstrap --variant=minbase --include="${PACKAGES// /,}" "$SUITE" "$work/root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
  # Nothing in the image needs package indexes, docs or caches.
  rm -rf "$work"/root/var/lib/apt/lists/* "$work"/root/var/cache/apt/*.bin "$work"/root/var/cache/apt/archives/*.deb \
         "$work"/root/usr/share/doc/* "$work"/root/usr/share/man/* "$work"/root/usr/share/info/* "$work"/root/var/log/*.log
  # A started daemon would not belong in an image.
  rm -f "$work"/root/etc/systemd/system/multi-user.target.wants/prometheus.service
  tar -C "$work/root" --numeric-owner -czf "$work/rootfs.tar.gz" .
  mv "$work/rootfs.tar.gz" "$TARBALL"
  log "cached $TARBALL ($(du -h "$TARBALL" | cut -f1))"
fi

log "docker import $TARBALL as $TAG"
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
              --change 'CMD ["/bin/bash"]' "$TARBALL" "$TAG" >/dev/null
echo "$TAG"
