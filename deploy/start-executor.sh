#!/bin/sh
# The executor's entrypoint in the compose stack's container: makes this
# container's own cgroup writable, in this container's mount namespace only,
# so that isolation "strict" gets its cgroup layer (every child's memory and
# process limits, nested inside the container's), then becomes the executor
# with the arguments given.
#
# - cgroup v2: /sys/fs/cgroup is the container's cgroup namespace root (Docker
#   gives a container a private cgroup namespace on v2 hosts by default). It
#   is remounted writable only if it really is a namespace root (this
#   process's cgroup reads "/"): with the host's namespace it would be the
#   host's whole tree, and that stays read-only. The executor then moves
#   itself into the leaf `loom-executor` and enables memory and pids for its
#   children (docs/executor.md, "cgroup v2").
# - cgroup v1: the runtime binds the container's own memory and pids cgroups
#   at /sys/fs/cgroup/memory and /sys/fs/cgroup/pids; both are remounted
#   writable, and the cpu one where it is mounted (a tool's cpu_percent).
#
# Needs CAP_SYS_ADMIN and a security profile that allows mount (AppArmor
# "unconfined" for this container). When the remount is refused, one line
# says so and the executor starts anyway: its strict tools then refuse to
# start, and `egress-executor doctor` names the missing cgroup layer.
set -eu
say() { echo "start-executor: $*" >&2; }
remount() {
  if ! err=$(mount -o remount,bind,rw "$1" 2>&1); then
    say "cannot make $1 writable ($err): no cgroup layer, strict tools will not start"
  fi
}
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  if [ "$(sed -n 's/^0:://p' /proc/self/cgroup)" = / ]; then
    remount /sys/fs/cgroup
  else
    say "cgroup v2 without a private cgroup namespace: /sys/fs/cgroup stays read-only (run the container with --cgroupns=private)"
  fi
else
  for c in memory pids; do
    remount "/sys/fs/cgroup/$c"
  done
  # cpu (a tool's cpu_percent) where it is mounted; optional.
  if [ -d /sys/fs/cgroup/cpu ]; then remount /sys/fs/cgroup/cpu; fi
fi
exec /usr/local/bin/egress-executor "$@"
