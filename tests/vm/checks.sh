#!/bin/sh
# Runs inside the VM (tests/vm/init): doctor, the strict smoke and the cgroup
# v2 checks, one `VMCHECK <check> ok|FAIL <detail>` line each, and
# `VMNUM <name> <value>` for cold starts. tests/vm/run.sh reads them.
T=/vm
export EGRESS_CONTROL_TOKEN=vm-test-token-0123456789
check() { # name ok? detail
  if [ "$2" = 0 ]; then echo "VMCHECK $1 ok $3"; else echo "VMCHECK $1 FAIL $3"; fi
}
cg=/sys/fs/cgroup
# A delegated subtree under a non-root cgroup, shaped as systemd makes one
# for a unit with Delegate=yes (loom.slice/loom-egress-executor.service):
# the parents enable memory, pids and cpu for it; the executor gets the rest.
echo "+memory +pids +cpu" >$cg/cgroup.subtree_control
mkdir -p $cg/loom.slice/executor.service
echo "+memory +pids +cpu" >$cg/loom.slice/cgroup.subtree_control
svc=$cg/loom.slice/executor.service

# The same file without a PID namespace per child (the proxy reads egress.toml).
sed 's/^pid_namespace = true/pid_namespace = false/' $T/egress.toml >/tmp/nopidns.toml
# ... and with no strict tool (the executor refuses every strict tool there on ABI < 6).
sed 's/^isolation = "strict"/isolation = "best_effort"/' /tmp/nopidns.toml >/tmp/escape.toml

egress-proxy serve --config $T/egress.toml >/tmp/proxy.log 2>&1 &
i=0; while [ $i -lt 100 ] && ! wget -q -O /dev/null http://127.0.0.1:3129/healthz 2>/dev/null; do sleep 0.2; i=$((i+1)); done
wget -q -O /dev/null http://127.0.0.1:3129/readyz; check proxy_up $? "$(tail -c 300 /tmp/proxy.log | tr '\n' ' ' | cut -c1-200)"

# Everything below runs in the delegated cgroup (the executor moves itself
# and this shell into its leaf on its first start).
echo $$ >$svc/cgroup.procs

egress-executor doctor --config $T/egress.toml >/tmp/doctor.txt 2>&1
sed 's/^/DOCTOR /' /tmp/doctor.txt
grep -q "^cgroup .*delegated subtree $svc " /tmp/doctor.txt; check delegated_subtree_non_root $? "$svc"
grep -q "created in their cgroup by clone3(CLONE_INTO_CGROUP)" /tmp/doctor.txt; check clone_into_cgroup $? ""
grep -q "cgroup.kill kills each tree at once" /tmp/doctor.txt; check cgroup_kill_available $? ""
grep -q "^isolation of .smoke. *ok *Strict" /tmp/doctor.txt; check doctor_strict_ok $? ""
grep -q "^spawn into a cgroup *ok" /tmp/doctor.txt; check doctor_spawn_into_cgroup $? ""
case $(uname -r) in
  6.1.*)
    grep -q "^TCP connect .*yes  network namespace.*stands in" /tmp/doctor.txt &&
      grep -q "^signals .*yes  PID namespace.*stands in" /tmp/doctor.txt &&
      grep -q "^abstract unix sockets .*yes  network namespace and seccomp.*stands in" /tmp/doctor.txt
    check stand_ins_abi2 $? "TCP by netns, signals by PID ns, abstract sockets by netns+seccomp"
    ;;
  *)
    ! grep -q "stands in$" /tmp/doctor.txt; check no_stand_ins $? "every protection native"
    ;;
esac

# Strict smoke: a plain command under strict.
out=$(egress-executor run --config $T/egress.toml --tool smoke --json -- sh -c 'echo hello-from-strict' 2>&1)
echo "$out" | grep -q '"ok": true' && echo "$out" | grep -q hello-from-strict; check strict_smoke $? "$(echo "$out" | tr '\n' ' ' | cut -c1-200)"

# Cold start: doctor's `true` spawn-to-exit medians, unconfined and strict.
sed -n 's/^cold start *`true` spawn to exit, median of 5: /VMNUM cold_start /p' /tmp/doctor.txt

# Memory: 64 MiB touched under memory_mb = 32 -> reported as memory.
out=$(egress-executor run --config $T/egress.toml --tool hog --json -- dd if=/dev/zero of=/dev/null bs=64M count=1 2>&1)
echo "$out" | grep -q '"exit": "memory: '; check memory_kill_reported_as_memory $? "$(echo "$out" | grep -o '"exit": "[^"]*"' | head -1)"

# Fork bomb: stopped at pids.max = 16.
out=$(egress-executor run --config $T/egress.toml --tool bomb --json -- sh -c 'n=0; while [ $n -lt 100 ]; do sleep 3 & n=$((n+1)); done; echo forked=$n' 2>&1)
echo "$out" | grep -q "can't fork\|Resource temporarily unavailable"; check fork_bomb_stopped_at_pids_max $? "$(echo "$out" | grep -o "can't fork[^\\\\]*" | head -1)"

# CPU: cpu_percent = 10 -> the child's cgroup has cpu.max "10000 100000"
# (read from outside while the child sleeps).
egress-executor run --config $T/egress.toml --tool capped --json -- sleep 4 >/tmp/capped.txt 2>&1 &
capped=$!
i=0; while [ $i -lt 50 ] && ! ls $svc/capped-*/cpu.max >/dev/null 2>&1; do sleep 0.1; i=$((i+1)); done
max=$(cat $svc/capped-*/cpu.max 2>/dev/null)
wait $capped
[ "$max" = "10000 100000" ] && grep -q '"ok": true' /tmp/capped.txt; check cpu_max_from_cpu_percent $? "cpu.max: ${max:-none}"

# A tree whose grandchild left its session: cgroup.kill takes it, no
# process left (no PID namespace here, so only the cgroup holds it).
out=$(RUST_LOG=egress_executor=debug egress-executor run --config /tmp/escape.toml --tool escape --json -- sh -c 'setsid sleep 300 & echo escaped' 2>&1)
sleep 1
left=$(ps -o pid,args | grep '[s]leep 300' | wc -l)
echo "$out" | grep -q "killed the child's cgroup (cgroup.kill)"; check cgroup_kill_used $? ""
echo "$out" | grep -q escaped && [ "$left" = 0 ]; check tree_killed_no_process_left $? "sleep 300 processes left: $left; $(echo "$out" | grep -v "^ *\"" | tr "\n" " " | cut -c1-300)"

# No cgroup left behind: only the executor's leaf under the subtree.
sleep 0.5
rest=$(cd $svc && find . -mindepth 1 -maxdepth 1 -type d ! -name loom-executor | tr '\n' ' ')
[ -z "$rest" ]; check no_cgroup_left $? "${rest:-none}"

# A container with its own cgroup namespace (Docker's default on cgroup v2,
# Kubernetes on cgroup v2): /sys/fs/cgroup is the namespace's root, mounted
# read-only as Docker mounts it; the compose stack's entrypoint
# (deploy/start-executor.sh) remounts it writable and becomes the executor,
# which moves itself into a leaf there.
mkdir -p $cg/container
out=$(sh -c "echo \$\$ >$cg/container/cgroup.procs; exec $T/unshare -C -m sh -c 'umount -l /sys/fs/cgroup && mount -t cgroup2 -o ro cgroup2 /sys/fs/cgroup && $T/start-executor.sh doctor --config $T/egress.toml'" 2>&1)
echo "$out" | grep -q "^cgroup .*delegated subtree /sys/fs/cgroup (controllers: [a-z ]*memory pids); executor in loom-executor" &&
  echo "$out" | grep -q "^spawn into a cgroup *ok" && [ -d $cg/container/loom-executor ]
check container_cgroup_namespace $? "$(echo "$out" | grep '^cgroup   ' | cut -c30-200)"

# The same entrypoint where /sys/fs/cgroup is the host's tree (no cgroup
# namespace of its own): it stays read-only, one line says so, and the
# executor has no cgroup layer (its strict tools would not start).
out=$($T/unshare -m sh -c "mount -o remount,bind,ro /sys/fs/cgroup && $T/start-executor.sh doctor --config $T/egress.toml" 2>&1)
echo "$out" | grep -q "^start-executor: cgroup v2 without a private cgroup namespace" &&
  echo "$out" | grep -q "^isolation of .smoke. *FAIL"
check entrypoint_leaves_host_cgroups_read_only $? "$(echo "$out" | grep -m1 '^start-executor' | cut -c1-120)"

# Strict without a PID namespace: refused on Landlock ABI < 6 (signals), started on >= 6.
out=$(egress-executor run --config /tmp/nopidns.toml --tool strict-nopidns --json -- true 2>&1)
case $(uname -r) in
  6.1.*) echo "$out" | grep -q "signals: this kernel's Landlock ABI"; check strict_refuses_signals_unscoped $? "$(echo "$out" | tr '\n' ' ' | cut -c1-160)" ;;
  *) echo "$out" | grep -q '"ok": true'; check strict_without_pidns_on_abi6 $? "$(echo "$out" | tr '\n' ' ' | cut -c1-160)" ;;
esac

# The Rust malicious tool (executor/tests/confinement.rs) under strict, if in the image.
if [ -x $T/confinement ]; then
  (cd /tmp && timeout 300 $T/confinement rust_tool_is_contained_under_strict >/tmp/conf.txt 2>&1)
  rc=$?
  sed 's/^/CONF /' /tmp/conf.txt | tail -60
  check rust_malicious_tool_contained $rc "$(tail -1 /tmp/conf.txt)"
fi
# The Python malicious tool, its child forked by the tool's fork server (the
# child joins its v2 cgroup through cgroup.procs), if python3 is in the image.
if [ -x $T/confinement ] && [ -x /usr/bin/python3 ]; then
  (cd /tmp && timeout 300 $T/confinement python_tool_forked_by_its_fork_server_is_contained_under_strict >/tmp/confpy.txt 2>&1)
  rc=$?
  sed 's/^/CONFPY /' /tmp/confpy.txt | tail -60
  check python_forked_tool_contained $rc "$(tail -1 /tmp/confpy.txt)"
fi
