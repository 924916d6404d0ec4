//! cgroup v2: the delegated subtree children's cgroups are made in (the
//! executor's own, or `[executor] cgroup_root`), made ready once (the
//! executor's processes moved into a leaf of their own, memory and pids
//! enabled for children, cpu on first use), and each child's limits in
//! `memory.max`, `memory.swap.max`, `pids.max` and `cpu.max`.

use std::io;
use std::path::{Path, PathBuf};

use super::{CgroupHost, Limits, Writes, CPU_PERIOD_US};

/// The delegated subtree of this process's own cgroup, under `root` (the
/// unified hierarchy's mount).
pub fn own(root: &Path) -> Result<CgroupHost, String> {
    // The unified hierarchy: our own cgroup, if it was delegated to us
    // (systemd `Delegate=yes`, a container's cgroup namespace, a user
    // session's delegated slice).
    let own = own_cgroup_v2().ok_or("cgroup v2: cannot read this process's cgroup from /proc/self/cgroup")?;
    let own = own.trim_start_matches('/');
    let mut dir = if own.is_empty() {
        root.to_path_buf()
    } else {
        root.join(own)
    };
    // Started from our own leaf (by an earlier executor's shell, say):
    // the delegated subtree is its parent.
    if dir.file_name().is_some_and(|n| n == EXECUTOR_LEAF)
        && dir.parent().is_some_and(|p| p.join("cgroup.procs").exists())
    {
        dir.pop();
    }
    delegated(&dir, true)
}

/// This process's cgroup v2 path (the `0::` line of `/proc/self/cgroup`).
fn own_cgroup_v2() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_string)
}

/// Name of the leaf the executor moves itself into, beside its children's
/// cgroups ("no internal processes": a cgroup with controllers enabled for
/// its children holds no process itself).
pub const EXECUTOR_LEAF: &str = "loom-executor";

/// A delegated cgroup v2 directory `dir` made ready for per-child cgroups:
/// memory and pids available to it, its `cgroup.subtree_control` writable;
/// the processes in it (the executor, when `own`) moved into
/// [`EXECUTOR_LEAF`], then memory and pids enabled for its children.
pub fn delegated(dir: &Path, own: bool) -> Result<CgroupHost, String> {
    let d = dir.display();
    let controllers = std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map_err(|e| format!("{d}: not a cgroup v2 directory ({e})"))?;
    let has = |list: &str, c: &str| list.split_whitespace().any(|x| x == c);
    if !(has(&controllers, "memory") && has(&controllers, "pids")) {
        return Err(format!(
            "cgroup v2 {d}: memory and pids are not both delegated to it (cgroup.controllers: \"{}\"); \
             run under systemd with Delegate=yes, or set [executor] cgroup_root to a delegated directory",
            controllers.trim()
        ));
    }
    let ctl_file = dir.join("cgroup.subtree_control");
    if rustix::fs::access(&ctl_file, rustix::fs::Access::WRITE_OK).is_err()
        || rustix::fs::access(dir, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK).is_err()
    {
        return Err(format!(
            "cgroup v2 {d}{}: not delegated (its cgroup.subtree_control is not writable); \
             run under systemd with Delegate=yes, or set [executor] cgroup_root",
            if own { " (this process's own cgroup)" } else { "" }
        ));
    }
    let ctl = std::fs::read_to_string(&ctl_file).unwrap_or_default();
    // The real root cgroup (exempt from "no internal processes") is the one
    // without `cgroup.type`; a cgroup namespace's root (a container's) has it.
    let is_root = !dir.join("cgroup.type").exists();
    if !(has(&ctl, "memory") && has(&ctl, "pids")) {
        if !is_root {
            // Every process here (ours, in a delegated unit) into a leaf.
            let leaf = dir.join(EXECUTOR_LEAF);
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            if !procs.trim().is_empty() {
                match std::fs::create_dir(&leaf) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(format!("cgroup v2 {}: {e}", leaf.display())),
                }
                for pid in procs.lines() {
                    match std::fs::write(leaf.join("cgroup.procs"), pid) {
                        Ok(()) => {}
                        // Gone meanwhile.
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                        Err(e) => {
                            return Err(format!(
                                "cgroup v2 {d}: cannot move process {pid} into {EXECUTOR_LEAF}: {e}"
                            ))
                        }
                    }
                }
            }
        }
        std::fs::write(&ctl_file, "+memory +pids")
            .map_err(|e| format!("cgroup v2 {d}: cannot enable memory and pids in cgroup.subtree_control: {e}"))?;
    }
    // cpu for `cpu_percent`, when delegated too (optional: a tool that asks
    // for it without it is refused or warned about, per its isolation).
    Ok(CgroupHost::V2 {
        dir: dir.to_path_buf(),
        cpu: has(&controllers, "cpu"),
    })
}

/// The v2 subtrees whose `cgroup.subtree_control` `+cpu` was written to
/// (one per executor; several only where one process drives several hosts).
static CPU_ENABLED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// One child's cgroup under `dir`, named `leaf`, with its limits; the cpu
/// controller is enabled for the subtree's children the first time a child
/// has a CPU limit (see `CgroupHost::V2`).
pub fn writes(dir: &Path, leaf: &str, limits: &Limits) -> io::Result<Writes> {
    let mut files = vec![
        ("memory.max", limits.memory_bytes.clone()),
        ("memory.swap.max", "0".to_string()),
        ("pids.max", limits.pids.clone()),
    ];
    if let Some(quota) = &limits.cpu_quota_us {
        // Enabled on first use in this subtree (idempotent): see
        // `CgroupHost::V2`.
        let mut enabled = CPU_ENABLED.lock().unwrap_or_else(|e| e.into_inner());
        if !enabled.iter().any(|d| d == dir) {
            let ctl = dir.join("cgroup.subtree_control");
            std::fs::write(&ctl, "+cpu")
                .map_err(|e| io::Error::new(e.kind(), format!("{}: cannot enable cpu: {e}", ctl.display())))?;
            enabled.push(dir.to_path_buf());
        }
        files.push(("cpu.max", format!("{quota} {CPU_PERIOD_US}")));
    }
    Ok(vec![(dir.join(leaf), files)])
}

/// Whether cgroups under `dir` have `cgroup.kill` (any child dir shows it).
pub fn kill_file_supported(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.path().join("cgroup.kill").exists())
}
