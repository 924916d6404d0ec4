//! cgroup v1: the memory and pids hierarchies (and the cpu one, for
//! `cpu_percent`, where it is mounted and writable) under
//! `/sys/fs/cgroup/<controller>/loom-egress`, and each child's limits in
//! `memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`, `pids.max` and
//! `cpu.cfs_quota_us`.

use std::path::{Path, PathBuf};

use super::{CgroupHost, Limits, Writes, CPU_PERIOD_US};

/// The v1 hierarchies under `root`, when the host has v1 memory or pids
/// controllers there (`None`: it has neither, look for v2).
pub fn host(root: &Path) -> Option<Result<CgroupHost, String>> {
    let writable = |d: &Path| {
        std::fs::create_dir_all(d).is_ok()
            && rustix::fs::access(d, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK).is_ok()
    };
    let memory = root.join("memory").join("loom-egress");
    let pids = root.join("pids").join("loom-egress");
    // (The v1 pids root has no pids.max; its children do.)
    if root.join("memory/memory.limit_in_bytes").exists() && root.join("pids/cgroup.procs").exists() {
        if writable(&memory) && writable(&pids) {
            // The cpu controller (for `cpu_percent` only): its own hierarchy
            // or mounted together with cpuacct; optional.
            let cpu = ["cpu", "cpu,cpuacct"]
                .iter()
                .map(|h| root.join(h))
                .find(|h| h.join("cpu.cfs_quota_us").exists())
                .map(|h| h.join("loom-egress"))
                .filter(|d| writable(d));
            return Some(Ok(CgroupHost::V1 { memory, pids, cpu }));
        }
        return Some(Err("the cgroup v1 memory/pids hierarchies are not writable".into()));
    }
    if root.join("memory.limit_in_bytes").exists() || root.join("memory").join("tasks").exists() {
        return Some(Err("cgroup v1 without both memory and pids controllers".into()));
    }
    None
}

/// One child's cgroups, named `leaf`, in each hierarchy, with its limits.
pub fn writes(memory: &Path, pids: &Path, cpu: Option<&PathBuf>, leaf: &str, limits: &Limits) -> Writes {
    let mut writes = vec![
        (
            memory.join(leaf),
            vec![
                ("memory.limit_in_bytes", limits.memory_bytes.clone()),
                ("memory.memsw.limit_in_bytes", limits.memory_bytes.clone()),
                ("memory.swappiness", "0".to_string()),
            ],
        ),
        (pids.join(leaf), vec![("pids.max", limits.pids.clone())]),
    ];
    if let (Some(cpu), Some(quota)) = (cpu, &limits.cpu_quota_us) {
        writes.push((
            cpu.join(leaf),
            vec![
                ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
                ("cpu.cfs_quota_us", quota.clone()),
            ],
        ));
    }
    writes
}
