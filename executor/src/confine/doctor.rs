//! What `doctor` reports of confinement beyond the layers: which layer gives
//! each protection a confined child relies on on this kernel, or stands in
//! for it (`verdicts`, a pure function of the probed features, tested as the
//! table `docs/executor.md` shows), and the kernel's details
//! (`kernel_report`).

use std::path::Path;

use crate::confine::cgroup::v2::{kill_file_supported, EXECUTOR_LEAF};
use crate::confine::cgroup::CgroupHost;
use crate::confine::{HostSupport, Layer};
use crate::sys;

/// What the kernel and the executor's privileges give (probed by `confine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// Landlock ABI version (0: none).
    pub landlock_abi: i32,
    /// A network namespace per child (only `lo`; the proxy listener the only exit).
    pub netns: bool,
    /// A PID namespace per child (configured and permitted).
    pub pid_namespace: bool,
    pub seccomp: bool,
    /// An unprivileged uid/gid per child.
    pub identity: bool,
    /// cgroup memory and pids limits (v1 or v2).
    pub cgroup: bool,
}

/// One protection a confined child relies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protection {
    /// No read or write outside the system paths, its files and its scratch dir.
    Filesystem,
    /// No truncate(2) of a file it may not write (Landlock ABI 3).
    Truncate,
    /// No ioctl on devices (Landlock ABI 5).
    DeviceIoctl,
    /// TCP connect only to the proxy (Landlock ABI 4).
    TcpConnect,
    /// No TCP listener anyone else can reach (Landlock ABI 4).
    TcpBind,
    /// No connection to abstract unix sockets outside the sandbox (Landlock ABI 6).
    AbstractUnix,
    /// No signal to processes outside its own tree (Landlock ABI 6).
    Signals,
    /// The dangerous system calls denied (io_uring, ptrace, mount, bpf, …).
    Syscalls,
    /// Memory and process count bounded for the whole tree.
    MemoryPids,
}

impl Protection {
    pub const ALL: [Protection; 9] = [
        Protection::Filesystem,
        Protection::Truncate,
        Protection::DeviceIoctl,
        Protection::TcpConnect,
        Protection::TcpBind,
        Protection::AbstractUnix,
        Protection::Signals,
        Protection::Syscalls,
        Protection::MemoryPids,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Protection::Filesystem => "filesystem access",
            Protection::Truncate => "truncate",
            Protection::DeviceIoctl => "device ioctl",
            Protection::TcpConnect => "TCP connect",
            Protection::TcpBind => "TCP bind",
            Protection::AbstractUnix => "abstract unix sockets",
            Protection::Signals => "signals",
            Protection::Syscalls => "dangerous system calls",
            Protection::MemoryPids => "memory and pids",
        }
    }
}

/// How one protection is given on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub protection: Protection,
    /// The layer meant for it, when the kernel has it.
    pub native: Option<&'static str>,
    /// The layer that stands in when `native` is absent.
    pub stand_in: Option<&'static str>,
}

impl Verdict {
    /// Neither the layer meant for it nor a stand-in.
    pub fn missing(&self) -> bool {
        self.native.is_none() && self.stand_in.is_none()
    }

    /// One line for `doctor` and errors.
    pub fn describe(&self) -> String {
        match (self.native, self.stand_in) {
            (Some(n), _) => format!("{}: {n}", self.protection.name()),
            (None, Some(s)) => format!("{}: {s} stands in", self.protection.name()),
            (None, None) => format!("{}: MISSING", self.protection.name()),
        }
    }
}

/// The Landlock ABI that brings each feature.
pub const LANDLOCK_TRUNCATE: i32 = 3;
pub const LANDLOCK_TCP: i32 = 4;
pub const LANDLOCK_IOCTL_DEV: i32 = 5;
pub const LANDLOCK_SCOPES: i32 = 6;

/// The Landlock rights and scopes of an ABI, for `doctor`.
pub fn landlock_rights(abi: i32) -> String {
    if abi < 1 {
        return "none".into();
    }
    let mut have = vec!["fs read/write/execute/make/remove"];
    let mut lack = Vec::new();
    for (min, name) in [
        (2, "refer"),
        (LANDLOCK_TRUNCATE, "truncate"),
        (LANDLOCK_TCP, "TCP bind/connect"),
        (LANDLOCK_IOCTL_DEV, "ioctl_dev"),
        (LANDLOCK_SCOPES, "scopes abstract_unix_socket+signal"),
    ] {
        if abi >= min {
            have.push(name);
        } else {
            lack.push(format!("{name} (ABI {min})"));
        }
    }
    let mut s = format!("ABI {abi}: {}", have.join(", "));
    if !lack.is_empty() {
        s.push_str(&format!("; not: {}", lack.join(", ")));
    }
    s
}

/// Every protection's verdict on a host with `f`: given by the layer meant
/// for it, by a stand-in when this kernel lacks that layer's feature (an
/// older Landlock ABI), or missing outright. `strict` refuses to start only
/// when a protection is missing, not when a feature is.
pub fn verdicts(f: &Features) -> Vec<Verdict> {
    let ll = |min: i32, what: &'static str| (f.landlock_abi >= min).then_some(what);
    Protection::ALL
        .into_iter()
        .map(|p| {
            let (native, stand_in) = match p {
                Protection::Filesystem => (ll(1, "landlock filesystem rules"), None),
                // DAC: an unprivileged uid may only truncate files it may write.
                Protection::Truncate => (
                    ll(LANDLOCK_TRUNCATE, "landlock truncate right"),
                    f.identity
                        .then_some("unprivileged uid/gid (only files that uid may write)"),
                ),
                // Landlock's path rules let no device but null/zero/random be
                // opened; a new session has no terminal to TIOCSTI into.
                Protection::DeviceIoctl => (
                    ll(LANDLOCK_IOCTL_DEV, "landlock ioctl_dev right"),
                    ll(
                        1,
                        "landlock filesystem rules (no device but null, zero, random opens) and setsid",
                    ),
                ),
                Protection::TcpConnect => (
                    ll(LANDLOCK_TCP, "landlock TCP connect rule"),
                    f.netns
                        .then_some("network namespace (only lo; the proxy listener the only exit)"),
                ),
                Protection::TcpBind => (
                    ll(LANDLOCK_TCP, "landlock TCP bind rule"),
                    f.netns
                        .then_some("network namespace (a listener only its own lo reaches)"),
                ),
                // Abstract names live per network namespace; seccomp denies
                // socket(AF_UNIX) anyway.
                Protection::AbstractUnix => (
                    ll(LANDLOCK_SCOPES, "landlock abstract-socket scope"),
                    match (f.netns, f.seccomp) {
                        (true, true) => Some("network namespace and seccomp (no socket(AF_UNIX))"),
                        (true, false) => Some("network namespace"),
                        (false, true) => Some("seccomp (no socket(AF_UNIX))"),
                        (false, false) => None,
                    },
                ),
                Protection::Signals => (
                    ll(LANDLOCK_SCOPES, "landlock signal scope"),
                    f.pid_namespace.then_some("PID namespace (sees only its own tree)"),
                ),
                Protection::Syscalls => (f.seccomp.then_some("seccomp"), None),
                Protection::MemoryPids => (f.cgroup.then_some("cgroup memory+pids"), None),
            };
            Verdict {
                protection: p,
                native,
                stand_in: if native.is_some() { None } else { stand_in },
            }
        })
        .collect()
}

/// What the kernel gives beyond the layers, for `doctor`: Landlock rights,
/// seccomp, user namespaces, the PID namespace, the cgroup version and
/// controllers and how children join their cgroup.
pub fn kernel_report(host: &HostSupport) -> Vec<(String, String)> {
    let mut out = Vec::new();
    out.push(("landlock rights".to_string(), landlock_rights(host.landlock_abi)));
    out.push((
        "seccomp".to_string(),
        if host.available(Layer::Seccomp) {
            "filter mode (SECCOMP_SET_MODE_FILTER), x32 and foreign arches guarded".into()
        } else {
            "absent".into()
        },
    ));
    let read = |f: &str| std::fs::read_to_string(f).ok().map(|s| s.trim().to_string());
    let max_userns = read("/proc/sys/user/max_user_namespaces").unwrap_or_else(|| "?".into());
    let unpriv = read("/proc/sys/kernel/unprivileged_userns_clone")
        .map(|v| format!(", unprivileged_userns_clone {v}"))
        .unwrap_or_default();
    out.push((
        "user namespaces".to_string(),
        format!(
            "max_user_namespaces {max_userns}{unpriv}; children cannot create one (seccomp denies unshare and namespace flags of clone; clone3 fails with ENOSYS)"
        ),
    ));
    out.push((
        "PID namespace per child".to_string(),
        if host.pid_namespace {
            "yes: signals and process visibility confined to the child's tree".into()
        } else {
            "no ([executor] pid_namespace = false, or not permitted)".into()
        },
    ));
    let root = Path::new("/sys/fs/cgroup");
    let version = if root.join("cgroup.controllers").exists() {
        "v2 (unified)"
    } else if root.join("unified/cgroup.controllers").exists() {
        "v1 + v2 (hybrid)"
    } else if root.join("memory").exists() || root.join("pids").exists() {
        "v1"
    } else {
        "none"
    };
    let detail = match &host.cgroup {
        Some(CgroupHost::V1 { memory, pids, cpu }) => format!(
            "{version}; per-child cgroups under {} and {}{}; children join by writing cgroup.procs before exec",
            memory.display(),
            pids.display(),
            cpu.as_ref().map_or_else(
                || " (no writable cpu hierarchy: no cpu_percent)".into(),
                |c| format!(" and {}", c.display())
            )
        ),
        Some(CgroupHost::V2 { dir, cpu }) => {
            let controllers = read(&format!("{}/cgroup.controllers", dir.display())).unwrap_or_default();
            let kill = if dir.join(format!("{EXECUTOR_LEAF}/cgroup.kill")).exists()
                || root.join("cgroup.kill").exists()
                || kill_file_supported(dir)
            {
                "cgroup.kill kills each tree at once"
            } else {
                "no cgroup.kill (kernel < 5.14): process-group and PID-namespace kills"
            };
            format!(
                "{version}; delegated subtree {} (controllers: {controllers}); executor in {EXECUTOR_LEAF}; {kill}; {}; {}",
                dir.display(),
                sys::clone_into_cgroup_report(),
                if *cpu {
                    "cpu delegated (cpu_percent)"
                } else {
                    "cpu not delegated: no cpu_percent"
                }
            )
        }
        None => format!("{version}; no cgroup layer"),
    };
    out.push(("cgroup".to_string(), detail));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(abi: i32) -> Features {
        Features {
            landlock_abi: abi,
            netns: true,
            pid_namespace: true,
            seccomp: true,
            identity: true,
            cgroup: true,
        }
    }

    fn get(v: &[Verdict], p: Protection) -> &Verdict {
        v.iter().find(|x| x.protection == p).unwrap()
    }

    /// The table of docs/executor.md (Hosts), row by row.
    #[test]
    fn the_mapping_table() {
        // Linux 6.12+ (ABI 6, 7): every protection by the layer meant for it.
        for abi in [6, 7] {
            let v = verdicts(&full(abi));
            assert!(v.iter().all(|x| x.native.is_some() && x.stand_in.is_none()), "{v:?}");
        }
        // Linux 6.1 (ABI 2): TCP by the network namespace, scopes by the
        // namespaces, truncate by the uid, ioctl by the path rules.
        let v = verdicts(&full(2));
        assert_eq!(
            get(&v, Protection::Filesystem).native,
            Some("landlock filesystem rules")
        );
        for (p, by) in [
            (Protection::TcpConnect, "network namespace"),
            (Protection::TcpBind, "network namespace"),
            (Protection::AbstractUnix, "network namespace and seccomp"),
            (Protection::Signals, "PID namespace"),
            (Protection::Truncate, "unprivileged uid/gid"),
            (Protection::DeviceIoctl, "landlock filesystem rules"),
        ] {
            let x = get(&v, p);
            assert!(x.native.is_none(), "{x:?}");
            assert!(x.stand_in.unwrap().starts_with(by), "{x:?}");
            assert!(!x.missing());
        }
        assert!(v.iter().all(|x| !x.missing()));
        // ABI 4 and 5: TCP native, scopes still stood in for.
        let v = verdicts(&full(5));
        assert!(get(&v, Protection::TcpConnect).native.is_some());
        assert!(get(&v, Protection::DeviceIoctl).native.is_some());
        assert!(get(&v, Protection::Signals).stand_in.is_some());
    }

    /// What is missing when a stand-in is missing too.
    #[test]
    fn missing_only_without_a_stand_in() {
        // ABI < 6 without a PID namespace: nothing keeps signals in.
        let v = verdicts(&Features {
            pid_namespace: false,
            ..full(5)
        });
        assert!(get(&v, Protection::Signals).missing());
        assert_eq!(v.iter().filter(|x| x.missing()).count(), 1);
        // ... but ABI 6 scopes them itself.
        let v = verdicts(&Features {
            pid_namespace: false,
            ..full(6)
        });
        assert!(v.iter().all(|x| !x.missing()));
        // ABI < 4 without a network namespace: TCP is open.
        let v = verdicts(&Features {
            netns: false,
            ..full(3)
        });
        assert!(get(&v, Protection::TcpConnect).missing());
        assert!(get(&v, Protection::TcpBind).missing());
        assert!(!get(&v, Protection::AbstractUnix).missing());
        // No Landlock: the filesystem has no stand-in.
        let v = verdicts(&full(0));
        assert!(get(&v, Protection::Filesystem).missing());
        assert!(get(&v, Protection::DeviceIoctl).missing());
        // No seccomp, no cgroup.
        let v = verdicts(&Features {
            seccomp: false,
            cgroup: false,
            ..full(7)
        });
        assert!(get(&v, Protection::Syscalls).missing() && get(&v, Protection::MemoryPids).missing());
    }

    #[test]
    fn landlock_rights_by_abi() {
        assert_eq!(landlock_rights(0), "none");
        let r = landlock_rights(2);
        assert!(
            r.starts_with("ABI 2: fs read/write/execute/make/remove, refer; not: truncate (ABI 3)"),
            "{r}"
        );
        assert!(r.contains("TCP bind/connect (ABI 4)") && r.contains("scopes abstract_unix_socket+signal (ABI 6)"));
        let r = landlock_rights(6);
        assert!(r.contains("scopes") && !r.contains("not:"), "{r}");
    }
}
