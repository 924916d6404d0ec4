//! The cgroup of a confined child: memory, process count and (with
//! `cpu_percent`) CPU for its whole tree. Which hierarchy the host gives
//! (`v1`: one per controller; `v2`: a delegated subtree), and one child's
//! cgroup made with its limits, killed at once, its OOM kills counted and
//! removed after the child is reaped.

pub mod v1;
pub mod v2;

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::ExecutorSection;

/// How the host can do cgroup limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupHost {
    /// v1: memory and pids hierarchies (parents of our per-child dirs), and
    /// the cpu hierarchy's when it is mounted and writable (`cpu_percent`).
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: Option<PathBuf>,
    },
    /// v2: a delegated directory (parent of our per-child dirs); `cpu`: the
    /// cpu controller is delegated to it, and is enabled for its children
    /// when the first child with `cpu_percent` is made (not before: once
    /// enabled, each child's cgroup weighs as much as the executor's leaf).
    V2 { dir: PathBuf, cpu: bool },
}

impl CgroupHost {
    /// Whether children can get a CPU bandwidth limit (`cpu_percent`).
    pub fn cpu(&self) -> bool {
        match self {
            CgroupHost::V1 { cpu, .. } => cpu.is_some(),
            CgroupHost::V2 { cpu, .. } => *cpu,
        }
    }
}

/// How the host can do cgroup limits for children, or why it cannot:
/// `[executor] cgroup_root` (v2) when set, else v1 hierarchies, else this
/// process's own delegated v2 subtree.
pub fn host(exec: &ExecutorSection) -> Result<CgroupHost, String> {
    if let Some(dir) = &exec.cgroup {
        return v2::delegated(dir, false);
    }
    let root = Path::new("/sys/fs/cgroup");
    if let Some(v1) = v1::host(root) {
        return v1;
    }
    if root.join("cgroup.controllers").exists() {
        return v2::own(root);
    }
    Err("no cgroup filesystem at /sys/fs/cgroup".into())
}

/// What the cgroup layer gives (for `doctor`), or why not.
pub fn support(host: &Result<CgroupHost, String>) -> Result<String, String> {
    match host {
        Ok(CgroupHost::V1 { cpu, .. }) => Ok(format!(
            "cgroup v1 memory + pids{} controllers",
            if cpu.is_some() { " + cpu" } else { "" }
        )),
        Ok(CgroupHost::V2 { dir, cpu }) => Ok(format!(
            "cgroup v2 under {}{}",
            dir.display(),
            if *cpu { " (+ cpu)" } else { "" }
        )),
        Err(e) => Err(e.clone()),
    }
}

/// Per-child cgroup directories.
#[derive(Debug)]
pub struct CgroupDirs(Vec<PathBuf>);

impl CgroupDirs {
    /// Kill every process in the child's cgroup at once (`cgroup.kill`,
    /// cgroup v2 on Linux 5.14+): escapees from its process group and
    /// session die with it. Whether the kernel had it.
    pub fn kill(&self) -> bool {
        let killed = self
            .0
            .iter()
            .map(|d| d.join("cgroup.kill"))
            .filter(|f| f.exists())
            .map(|f| std::fs::write(f, "1").is_ok())
            .fold(false, |a, b| a | b);
        if killed {
            tracing::debug!(cgroup = %self.0[0].display(), "killed the child's cgroup (cgroup.kill)");
        }
        killed
    }

    /// How many times the kernel's OOM killer killed a process of the
    /// child's tree at its memory limit (`memory.events` `oom_kill` on v2,
    /// `memory.oom_control` `oom_kill` on v1 4.13+).
    pub fn oom_kills(&self) -> u64 {
        let field = |text: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        self.0
            .iter()
            .filter_map(|d| {
                ["memory.events", "memory.oom_control"]
                    .iter()
                    .find_map(|f| std::fs::read_to_string(d.join(f)).ok().as_deref().and_then(field))
            })
            .sum()
    }

    /// The directories (v1: memory and pids; v2: one).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.0
    }

    /// Remove the directories; retried briefly while the last tasks exit.
    pub async fn remove(self) {
        self.kill();
        for dir in self.0 {
            for attempt in 0..50 {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if attempt == 49 => {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a child's cgroup")
                    }
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                }
            }
        }
    }
}

/// Counter making cgroup names unique within this process.
static CGROUP_SEQ: AtomicU64 = AtomicU64::new(0);

/// A child's cgroup directories with their limits written, the
/// `cgroup.procs` files the child writes itself into (the fallback), and on
/// v2 the directory's fd for `clone3(CLONE_INTO_CGROUP)`.
pub type MadeCgroup = (CgroupDirs, Vec<OwnedFd>, Option<OwnedFd>);

/// The CPU bandwidth period, in microseconds (the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

/// One child's limits as its cgroup files take them.
pub struct Limits {
    pub memory_bytes: String,
    pub pids: String,
    /// Microseconds of CPU per `CPU_PERIOD_US` (`cpu_percent`).
    pub cpu_quota_us: Option<String>,
}

/// Directories to make and the files to write in each.
pub type Writes = Vec<(PathBuf, Vec<(&'static str, String)>)>;

/// Makes a child's cgroup directories named after `name`, with its limits
/// written (`CgroupDirs` from the first, the rest for the child: its
/// `cgroup.procs` files and, on v2, the directory's fd).
pub fn make(
    host: &CgroupHost,
    name: &str,
    memory_mb: u64,
    max_pids: u64,
    cpu_percent: Option<u64>,
) -> io::Result<MadeCgroup> {
    let leaf = format!(
        "{name}-{}-{}",
        std::process::id(),
        CGROUP_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let limits = Limits {
        memory_bytes: memory_mb.saturating_mul(1 << 20).to_string(),
        pids: max_pids.to_string(),
        // percent of one CPU → microseconds of CPU per period (at least 1 ms:
        // the kernel's floor).
        cpu_quota_us: cpu_percent.map(|p| (p.saturating_mul(CPU_PERIOD_US) / 100).max(1000).to_string()),
    };
    let writes = match host {
        CgroupHost::V1 { memory, pids, cpu } => v1::writes(memory, pids, cpu.as_ref(), &leaf, &limits),
        CgroupHost::V2 { dir, .. } => v2::writes(dir, &leaf, &limits)?,
    };
    let mut dirs = Vec::new();
    let mut procs = Vec::new();
    let result = (|| -> io::Result<()> {
        for (dir, files) in &writes {
            std::fs::create_dir(dir)?;
            dirs.push(dir.clone());
            for (file, value) in files {
                let path = dir.join(file);
                match std::fs::write(&path, value) {
                    Ok(()) => {}
                    // Swap accounting is optional (and absent without swap).
                    Err(_) if file.contains("sw") => {}
                    Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
                }
            }
            procs.push(rustix::fs::open(
                dir.join("cgroup.procs"),
                rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?);
        }
        Ok(())
    })();
    let dir_fd = match (&result, host) {
        (Ok(()), CgroupHost::V2 { .. }) => match rustix::fs::open(
            &dirs[0],
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            Ok(fd) => Some(fd),
            Err(e) => {
                for d in &dirs {
                    let _ = std::fs::remove_dir(d);
                }
                return Err(e.into());
            }
        },
        _ => None,
    };
    if let Err(e) = result {
        for d in &dirs {
            let _ = std::fs::remove_dir(d);
        }
        return Err(e);
    }
    Ok((CgroupDirs(dirs), procs, dir_fd))
}
