#!/usr/bin/env bash
# Boots each kernel of the matrix (tests/vm/kernels.sh: Debian's 6.1 and
# 6.12) under qemu-system-x86_64 (software emulation is enough) with cgroup
# v2 at /sys/fs/cgroup, runs `egress-executor doctor`, a strict smoke and the
# cgroup v2 checks (tests/vm/checks.sh), and the Rust malicious tool of
# executor/tests/confinement.rs when its test binary is built (and the Python
# one, forked by its fork server, with Debian's python3); prints one
# line per kernel and check, and the cold starts. No network in the VM but its
# own loopback; results come back on the serial console.
#
# Kernels and images are cached under $LOOM_CACHE_DIR/vm (default
# /var/cache/loom-egress/vm). LOOM_VM_PROFILE=release|debug (default
# release) picks the binaries, built here if missing (only the two binaries).
# LOOM_VM_KERNELS="6.1" limits the matrix. Exit 1 if a check fails; skips
# loudly (exit 0) without qemu-system-x86_64 or busybox-static.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
CACHE_DIR=${LOOM_CACHE_DIR:-/var/cache/loom-egress}/vm
profile=${LOOM_VM_PROFILE:-release}
t0=$(date +%s)

if ! command -v qemu-system-x86_64 >/dev/null; then
  echo "tests/vm: SKIPPED: qemu-system-x86_64 not found (Debian: qemu-system-x86)" >&2
  exit 0
fi
busybox=/bin/busybox
if ! [ -x "$busybox" ] || ! file -L "$busybox" 2>/dev/null | grep -q 'statically linked'; then
  busybox=$(command -v busybox.static || true)
  [ -x /usr/bin/busybox ] && file -L /usr/bin/busybox | grep -q 'statically linked' && busybox=/usr/bin/busybox
fi
if [ -z "$busybox" ] || ! [ -x "$busybox" ]; then
  echo "tests/vm: SKIPPED: no static busybox (Debian: busybox-static)" >&2
  exit 0
fi
mkdir -p "$CACHE_DIR"

flag=""
[ "$profile" = release ] && flag=--release
bin=target/$profile
echo "tests/vm: building egress-executor and egress-proxy ($profile)" >&2
# Both, always (a no-op when fresh): the proxy reads the tools' sections too,
# so one older than the executor may refuse the config. .ci/run's compose
# test builds the same release binaries afterwards, at no extra cost.
cargo build $flag -q -p egress-executor -p egress-proxy --bins
proxy=$bin/egress-proxy
# The confinement suite's test binary (built by `cargo test -p egress-executor
# --test confinement`), this profile's or the debug one.
conf=$(ls -t "$bin"/deps/confinement-* target/debug/deps/confinement-* 2>/dev/null | while read -r f; do
  [ -f "$f" ] && [ -x "$f" ] && echo "$f"; done | head -1 || true)

# The image: busybox, the two binaries and their shared libraries, the
# confinement test binary (the Rust malicious tool and its harness), the
# init, checks and configs. Cached by the hash of its inputs.
inputs=(tests/vm/run.sh "$busybox" "$bin/egress-executor" "$proxy" tests/vm/init tests/vm/checks.sh tests/vm/egress.toml deploy/start-executor.sh)
[ -n "$conf" ] && inputs+=("$conf")
# Debian's Python, for the Python malicious tool forked by its fork server
# (the runner and the fixture at the paths the test binary was built with).
py=
if [ -n "$conf" ] && [ -x /usr/bin/python3 ]; then
  py=$(readlink -f /usr/bin/python3)
  pylib=/usr/lib/$(basename "$py")
  [ -d "$pylib" ] || py=
fi
[ -n "$py" ] && inputs+=("$py" executor/runners/loom_runner.py executor/tests/fixtures/malicious_tool.py)
key=$(cat "${inputs[@]}" | sha256sum | cut -c1-16)
image="$CACHE_DIR/image-$key.cpio.gz"
if ! [ -s "$image" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  r=$work/root
  mkdir -p $r/bin $r/sbin $r/usr/bin $r/usr/local/bin $r/etc $r/vm $r/proc $r/sys $r/dev $r/tmp $r/run $r/root
  cp "$busybox" $r/bin/busybox
  ln -s busybox $r/bin/sh
  strip -o $r/usr/local/bin/egress-executor "$bin/egress-executor"
  strip -o $r/usr/local/bin/egress-proxy "$proxy"
  # util-linux unshare (busybox's has no cgroup namespace): the container check.
  cp "$(command -v unshare)" $r/vm/unshare
  [ -n "$conf" ] && strip -o $r/vm/confinement "$conf"
  if [ -n "$py" ]; then
    cp "$py" $r/usr/bin/ && ln -s "$(basename "$py")" $r/usr/bin/python3
    mkdir -p $r/usr/lib
    tar -C /usr/lib -cf - --exclude=test --exclude=idlelib --exclude=tkinter --exclude=turtledemo \
      --exclude=ensurepip --exclude=lib2to3 --exclude=pydoc_data --exclude=site-packages \
      --exclude=dist-packages --exclude='config-*' "$(basename "$pylib")" | tar -C $r/usr/lib -xf -
    mkdir -p "$r$root/executor/runners" "$r$root/executor/tests/fixtures"
    cp executor/runners/loom_runner.py "$r$root/executor/runners/"
    cp executor/tests/fixtures/malicious_tool.py "$r$root/executor/tests/fixtures/"
  fi
  for f in $r/usr/local/bin/* $r/vm/unshare ${conf:+$r/vm/confinement} ${py:+$r/usr/bin/$(basename "$py") $r$pylib/lib-dynload/*.so}; do
    ldd "$f" | grep -o '/[^ ]*' || true
  done | sort -u | while read -r lib; do
    mkdir -p "$r$(dirname "$lib")"
    cp -L "$lib" "$r$lib"
  done
  cp tests/vm/init $r/init
  chmod +x $r/init
  cp tests/vm/checks.sh tests/vm/egress.toml deploy/start-executor.sh $r/vm/
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >$r/etc/passwd
  printf 'root:x:0:\nnogroup:x:65534:\n' >$r/etc/group
  (cd $r && find . | "$busybox" cpio -o -H newc 2>/dev/null | gzip -1) >"$image.tmp"
  mv "$image.tmp" "$image"
  rm -rf "$work"
  trap - EXIT
fi
echo "tests/vm: image $(basename "$image") ($(du -h "$image" | cut -f1)), binaries: $profile" >&2

fail=0
results=$(mktemp)
# This host (cgroup v1 here): what doctor says with the same file (the
# proxy is not running here, so its lines fail and are not read).
hk=$(uname -r)
d=$("$bin/egress-executor" doctor --config tests/vm/egress.toml 2>&1 || true)
if echo "$d" | grep -q '^isolation of .smoke. *ok *Strict'; then st=ok; else st=FAIL; fi
echo "host $hk strict_starts $st" | tee -a "$results"
echo "host $hk cgroup $(echo "$d" | sed -n 's/^cgroup   *//p' | cut -c1-160)"
echo "host $hk cold_start $(echo "$d" | sed -n 's/^cold start *`true` spawn to exit, median of 5: //p')"
while read -r name vmlinuz; do
  log="$CACHE_DIR/console-$name.log"
  s=$(date +%s)
  timeout 300 qemu-system-x86_64 -m 1536 -smp 1 -cpu max -nographic -no-reboot \
    -nic none -kernel "$vmlinuz" -initrd "$image" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init cgroup_no_v1=all lsm=landlock,lockdown,yama,apparmor,bpf" \
    </dev/null >"$log" 2>&1 || true
  tr -d '\r' <"$log" >"$log.txt"
  kver=$(grep -m1 -o 'Linux version [^ ]*' "$log.txt" | cut -d' ' -f3 || true)
  if ! grep -q 'VMDONE' "$log.txt"; then
    echo "vm $name ${kver:-?} boot FAIL no VMDONE within 300 s (console: $log)"
    fail=1
  fi
  grep -o 'VMCHECK .*' "$log.txt" | while read -r _ check state detail; do
    echo "vm $name $check $state $detail"
  done | tee -a "$results"
  grep -o 'VMNUM .*' "$log.txt" | sed "s/^VMNUM /vm $name /"
  echo "vm $name boot+checks $(( $(date +%s) - s )) s (console: $log.txt)"
done < <(tests/vm/kernels.sh)
grep -q ' FAIL ' "$results" && fail=1
rm -f "$results"
echo "tests/vm: matrix done in $(( $(date +%s) - t0 )) s" >&2
exit "$fail"
