//! Confinement of tool children (`isolation = "strict" | "best_effort" | "off"`):
//! what the host can provide (probed once, reported by `doctor`), the per-tool
//! plan (seccomp programs compiled once), and the per-child preparation done
//! in the parent before clone — a network namespace holding only `lo` with the
//! run's proxy listener on `127.0.0.1:3128`, a Landlock ruleset fd, cgroup
//! directories, rlimits and an unprivileged uid/gid. The child applies them
//! with raw system calls (`sys::ChildConfine`); nothing here runs in the child.

pub mod doctor;
pub mod transparent;

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::config::{ExecutorSection, Isolation, Network, ProcessConfig};
use crate::sys::{self, ChildConfine};

/// Port of the in-namespace proxy listener a confined child sees.
pub const CHILD_PROXY_PORT: u16 = 3128;
/// The address a confined child's proxy variables name.
pub const CHILD_PROXY: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, CHILD_PROXY_PORT);
/// `RLIMIT_NOFILE` of a confined child.
pub const MAX_OPEN_FILES: u64 = 1024;

/// System paths a runtime needs, readable and executable by every confined
/// child (missing ones are skipped). Tools add theirs with `read_paths`.
pub const SYSTEM_READ_PATHS: &[&str] = &[
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/sbin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/localtime",
    "/etc/alternatives",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
];

/// One confinement layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layer {
    /// Own network namespace: only `lo`, the proxy listener the only exit.
    Netns,
    /// Landlock filesystem rules (and TCP rules and scopes where the ABI has them).
    Landlock,
    /// seccomp filter denying the dangerous system calls.
    Seccomp,
    /// Unprivileged uid/gid (no supplementary groups).
    Identity,
    /// rlimits: core, open files, processes, CPU time.
    Rlimits,
    /// Memory and process-count limits through cgroups.
    Cgroup,
}

impl Layer {
    pub const ALL: [Layer; 6] = [
        Layer::Netns,
        Layer::Landlock,
        Layer::Seccomp,
        Layer::Identity,
        Layer::Rlimits,
        Layer::Cgroup,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Layer::Netns => "network namespace",
            Layer::Landlock => "landlock",
            Layer::Seccomp => "seccomp",
            Layer::Identity => "unprivileged uid/gid",
            Layer::Rlimits => "rlimits",
            Layer::Cgroup => "cgroup memory+pids",
        }
    }

    /// How an operator gets this layer when it is missing.
    pub fn remedy(self) -> &'static str {
        match self {
            Layer::Netns => "run the executor as root, or inside a user namespace where it holds CAP_SYS_ADMIN (e.g. `unshare -r`, or a container with user namespaces)",
            Layer::Landlock => "boot a kernel >= 5.13 with Landlock enabled (CONFIG_SECURITY_LANDLOCK=y, `lsm=...,landlock`)",
            Layer::Seccomp => "use a kernel with CONFIG_SECCOMP_FILTER",
            Layer::Identity => "run the executor as root (or with CAP_SETUID+CAP_SETGID), with the child uid/gid mapped in its user namespace",
            Layer::Rlimits => "setrlimit is always available",
            Layer::Cgroup => "give the executor a writable cgroup: v1 memory and pids hierarchies at /sys/fs/cgroup/{memory,pids}, or on cgroup v2 a delegated subtree (systemd Delegate=yes, a container with its own cgroup namespace and a writable /sys/fs/cgroup) or [executor] cgroup_root naming one, with memory and pids in its cgroup.controllers",
        }
    }

    /// What this layer costs, for `doctor`.
    pub fn cost(self) -> &'static str {
        match self {
            Layer::Netns => "a namespace + listener per child (kept ready in the background); relayed bytes are copied once more unless handed off",
            Layer::Landlock => "one ruleset per child (~0.1 ms), and a mount namespace for its private /dev/shm (~0.2 ms from fork to reap); no per-access cost worth measuring",
            Layer::Seccomp => "BPF compiled once per tool; a few ns per system call",
            Layer::Identity => "none",
            Layer::Rlimits => "none",
            Layer::Cgroup => "mkdirs and writes per child, rmdir after; v1: joining may wait for an RCU grace period (~10 ms without favordynmods); v2: created in it by clone3(CLONE_INTO_CGROUP), no join",
        }
    }
}

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

/// What the host provides, layer by layer (probed once per process).
#[derive(Debug, Clone)]
pub struct HostSupport {
    /// Per layer: `Ok(detail)` or `Err(why not)`.
    pub layers: BTreeMap<Layer, Result<String, String>>,
    pub landlock_abi: i32,
    pub cgroup: Option<CgroupHost>,
    /// Whether a child can have its own mount namespace with a private
    /// `/dev/shm` (else, under Landlock, it has no `/dev/shm` at all).
    pub private_shm: Result<(), String>,
    /// Whether a namespace can be set up for transparent egress (`nft`
    /// found, routes, rules and sockets made), with what it costs; or why not.
    pub transparent: Result<String, String>,
    /// Whether each child gets a PID namespace (`[executor] pid_namespace`
    /// and the privilege a network namespace needs too).
    pub pid_namespace: bool,
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

impl HostSupport {
    pub fn available(&self, layer: Layer) -> bool {
        matches!(self.layers.get(&layer), Some(Ok(_)))
    }

    /// The features the protections of a child rest on
    /// ([`crate::confine::doctor::verdicts`]).
    pub fn features(&self) -> crate::confine::doctor::Features {
        crate::confine::doctor::Features {
            landlock_abi: if self.available(Layer::Landlock) {
                self.landlock_abi
            } else {
                0
            },
            netns: self.available(Layer::Netns),
            pid_namespace: self.pid_namespace,
            seccomp: self.available(Layer::Seccomp),
            identity: self.available(Layer::Identity),
            cgroup: self.available(Layer::Cgroup),
        }
    }

    fn why_not(&self, layer: Layer) -> String {
        match self.layers.get(&layer) {
            Some(Err(e)) => e.clone(),
            _ => String::new(),
        }
    }
}

/// Probe the host (cached: the answer does not change while we run).
pub fn host(exec: &ExecutorSection) -> HostSupport {
    static HOST: OnceLock<HostSupport> = OnceLock::new();
    HOST.get_or_init(|| probe(exec)).clone()
}

fn probe(exec: &ExecutorSection) -> HostSupport {
    let mut layers = BTreeMap::new();
    layers.insert(
        Layer::Netns,
        match sys::new_netns(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)) {
            Ok(_) => Ok("own namespace with only lo; the proxy listener is the only exit".to_string()),
            Err(e) => Err(format!("cannot create a network namespace: {e}")),
        },
    );
    let netns_ok = matches!(layers.get(&Layer::Netns), Some(Ok(_)));
    let abi = sys::landlock_abi();
    let private_shm = if !Path::new("/dev/shm").is_dir() {
        Err("the host has no /dev/shm".to_string())
    } else {
        sys::private_shm_available()
            .map_err(|e| format!("cannot mount one in a mount namespace of the child's own: {e}"))
    };
    layers.insert(
        Layer::Landlock,
        if abi >= 1 {
            let mut d = format!("ABI {abi}: filesystem");
            if abi >= 4 {
                d.push_str(", TCP bind/connect");
            }
            if abi >= 6 {
                d.push_str(", abstract-socket and signal scoping");
            }
            match &private_shm {
                Ok(()) => d.push_str("; a private /dev/shm per child"),
                Err(e) => d.push_str(&format!("; no /dev/shm for children ({e})")),
            }
            Ok(d)
        } else {
            Err("the kernel has no Landlock (or it is disabled)".into())
        },
    );
    layers.insert(
        Layer::Seccomp,
        if sys::seccomp_available() {
            Ok(
                "filter compiled once per tool, denied calls fail with EPERM; no unix sockets but stream socketpairs"
                    .into(),
            )
        } else {
            Err("the kernel has no seccomp".into())
        },
    );
    layers.insert(Layer::Identity, identity_support(exec));
    layers.insert(
        Layer::Rlimits,
        Ok(format!("core 0, nofile {MAX_OPEN_FILES}, nproc, cpu from cpu_ms")),
    );
    let cgroup = cgroup_host(exec);
    layers.insert(
        Layer::Cgroup,
        match &cgroup {
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
        },
    );
    HostSupport {
        layers,
        landlock_abi: abi,
        cgroup: cgroup.ok(),
        private_shm,
        pid_namespace: netns_ok && exec.pid_namespace,
        transparent: if netns_ok {
            transparent_support()
        } else {
            Err("no network namespace".into())
        },
    }
}

fn identity_support(exec: &ExecutorSection) -> Result<String, String> {
    let (uid, gid, count) = (exec.child_uid, exec.child_gid, exec.child_uid_count);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let (setgid, setuid) = (cap_eff & (1 << 6) != 0, cap_eff & (1 << 7) != 0);
    if !(setgid && setuid) {
        return Err("the executor lacks CAP_SETUID/CAP_SETGID (not root)".into());
    }
    let mapped = |file: &str, id: u32, n: u32| {
        let map = std::fs::read_to_string(file).unwrap_or_default();
        map.lines().any(|l| {
            let f: Vec<u64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            f.len() == 3 && u64::from(id) >= f[0] && u64::from(id) + u64::from(n) <= f[0] + f[2]
        })
    };
    if !mapped("/proc/self/uid_map", uid, count) || !mapped("/proc/self/gid_map", gid, count) {
        let ids = if count > 1 {
            format!("uids/gids {uid}/{gid} (+{count})")
        } else {
            format!("uid {uid} / gid {gid}")
        };
        return Err(format!("{ids} not mapped in the executor's user namespace"));
    }
    Ok(if count > 1 {
        format!("uid/gid from {uid}/{gid}, one of {count} per child")
    } else {
        format!("uid {uid}, gid {gid}")
    })
}

fn cgroup_host(exec: &ExecutorSection) -> Result<CgroupHost, String> {
    let writable = |d: &Path| {
        std::fs::create_dir_all(d).is_ok()
            && rustix::fs::access(d, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK).is_ok()
    };
    if let Some(dir) = &exec.cgroup {
        return cgroup_v2(dir, false);
    }
    let root = Path::new("/sys/fs/cgroup");
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
            return Ok(CgroupHost::V1 { memory, pids, cpu });
        }
        return Err("the cgroup v1 memory/pids hierarchies are not writable".into());
    }
    if root.join("memory.limit_in_bytes").exists() || root.join("memory").join("tasks").exists() {
        return Err("cgroup v1 without both memory and pids controllers".into());
    }
    if root.join("cgroup.controllers").exists() {
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
        return cgroup_v2(&dir, true);
    }
    Err("no cgroup filesystem at /sys/fs/cgroup".into())
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
fn cgroup_v2(dir: &Path, own: bool) -> Result<CgroupHost, String> {
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

/// What the kernel gives beyond the layers, for `doctor`: Landlock rights,
/// seccomp, user namespaces, the PID namespace, the cgroup version and
/// controllers and how children join their cgroup.
pub fn kernel_report(host: &HostSupport) -> Vec<(String, String)> {
    let mut out = Vec::new();
    out.push((
        "landlock rights".to_string(),
        crate::confine::doctor::landlock_rights(host.landlock_abi),
    ));
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

/// A cgroup for `doctor`'s probe child (so it can say how children join
/// theirs): `None` without a cgroup layer.
pub fn cgroup_probe(host: &HostSupport) -> Option<io::Result<Prepared>> {
    let h = host.cgroup.as_ref()?;
    Some(
        make_cgroup(h, "doctor-probe", 64, 16, None).map(|(dirs, procs, dir_fd)| {
            let mut p = Prepared::default();
            p.child.cgroup_procs = procs;
            p.child.cgroup_dir = dir_fd;
            p.cgroup = Some(CgroupDirs(dirs));
            p
        }),
    )
}

/// Whether cgroups under `dir` have `cgroup.kill` (any child dir shows it).
fn kill_file_supported(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.path().join("cgroup.kill").exists())
}

/// Why a tool's requested confinement cannot be provided.
#[derive(Debug, thiserror::Error)]
#[error("{setting} for tool `{tool}` needs layers this host cannot provide: {}", .missing.join("; "))]
pub struct Unavailable {
    /// What asks for them: `isolation = "strict"` or `network = "transparent"`.
    pub setting: &'static str,
    pub tool: String,
    pub missing: Vec<String>,
}

/// Files a resolver reads, readable by a transparent tool's children (so
/// glibc, musl, Go and Node resolve as on the host: `/etc/hosts` first,
/// then the nameserver `resolv.conf` names, whose queries the namespace
/// redirects to the proxy's DNS whatever address it is).
pub const RESOLVER_READ_PATHS: &[&str] = &[
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
];

/// Whether transparent egress works on this host (probed once, when a
/// transparent tool or `doctor` first asks): `nft` is there, and a
/// namespace gets its routes, rules and sockets. `Ok` says what it costs.
pub fn transparent_support() -> Result<String, String> {
    static SUPPORT: OnceLock<Result<String, String>> = OnceLock::new();
    SUPPORT
        .get_or_init(|| {
            let nft = crate::confine::transparent::nft()?;
            let t0 = std::time::Instant::now();
            let made = sys::new_netns_with(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0), move || {
                crate::confine::transparent::set_up(&nft)
            });
            match made {
                Ok(_) => Ok(format!(
                    "nftables redirect in each child's namespace (set up in {:.1} ms here, kept ready in the background)",
                    t0.elapsed().as_secs_f64() * 1e3
                )),
                Err(e) => Err(format!("cannot set up a transparent namespace: {e}")),
            }
        })
        .clone()
}

/// The per-tool confinement plan.
#[derive(Debug, Clone)]
pub struct Confinement {
    pub isolation: Isolation,
    layers: Vec<Layer>,
    landlock_abi: i32,
    read_paths: Vec<PathBuf>,
    ids: Option<(u32, u32, u32)>,
    next_id: Arc<AtomicU64>,
    memory_mb: u64,
    max_pids: u64,
    nproc: u64,
    cpu_ms: u64,
    /// `cpu_percent`, when the host's cgroups can apply it.
    cpu_percent: Option<u64>,
    seccomp: Vec<Arc<Vec<seccompiler::sock_filter>>>,
    cgroup: Option<CgroupHost>,
    private_shm: bool,
    /// `network = "transparent"`: the namespace redirects every connect to
    /// the proxy (and Landlock leaves TCP connect to the namespace).
    transparent: bool,
}

impl Confinement {
    /// No confinement.
    pub fn off() -> Confinement {
        Confinement {
            isolation: Isolation::Off,
            layers: Vec::new(),
            landlock_abi: 0,
            read_paths: Vec::new(),
            ids: None,
            next_id: Arc::new(AtomicU64::new(0)),
            memory_mb: 0,
            max_pids: 0,
            nproc: 0,
            cpu_ms: 0,
            cpu_percent: None,
            seccomp: Vec::new(),
            cgroup: None,
            private_shm: false,
            transparent: false,
        }
    }

    /// The plan for one tool. `strict` fails naming every missing layer and
    /// how to get it; `best_effort` logs one line per layer not enforced.
    pub fn for_tool(
        tool: &str,
        p: &ProcessConfig,
        exec: &ExecutorSection,
        host: &HostSupport,
    ) -> Result<Confinement, Unavailable> {
        if p.isolation == Isolation::Off {
            return Ok(Confinement::off());
        }
        let mut layers = Vec::new();
        let mut missing = Vec::new();
        for layer in Layer::ALL {
            if host.available(layer) {
                layers.push(layer);
            } else {
                missing.push(format!(
                    "{}: {} ({})",
                    layer.name(),
                    host.why_not(layer),
                    layer.remedy()
                ));
            }
        }
        let mut seccomp = Vec::new();
        if layers.contains(&Layer::Seccomp) {
            match seccomp_programs() {
                Ok(s) => seccomp = s,
                Err(e) => {
                    layers.retain(|l| *l != Layer::Seccomp);
                    missing.push(format!("seccomp: cannot compile the filter: {e}"));
                }
            }
        }
        let transparent = p.network == Network::Transparent;
        if transparent {
            // Whatever the isolation: without the namespace nothing would
            // redirect the child's connects.
            let mut needs = Vec::new();
            if !layers.contains(&Layer::Netns) {
                needs.push(format!(
                    "{}: {} ({})",
                    Layer::Netns.name(),
                    host.why_not(Layer::Netns),
                    Layer::Netns.remedy()
                ));
            } else if let Err(e) = &host.transparent {
                needs.push(format!("transparent egress: {e}"));
            }
            if !needs.is_empty() {
                return Err(Unavailable {
                    setting: "network = \"transparent\"",
                    tool: tool.to_string(),
                    missing: needs,
                });
            }
        }
        if missing.is_empty() {
            // Every layer is there; a protection can still be missing when
            // the kernel lacks the feature meant for it and nothing stands in
            // (e.g. Landlock ABI < 6 without a PID namespace: signals).
            for v in crate::confine::doctor::verdicts(&host.features()) {
                if v.missing() {
                    missing.push(format!(
                        "{}: this kernel's Landlock ABI {} lacks it and no other layer stands in (see docs/executor.md, Hosts)",
                        v.protection.name(),
                        host.landlock_abi
                    ));
                }
            }
        }
        // `cpu_percent` is asked for per tool: missing only where it is.
        let cpu_percent = p
            .cpu_percent
            .filter(|_| host.cgroup.as_ref().is_some_and(CgroupHost::cpu));
        if p.cpu_percent.is_some() && cpu_percent.is_none() && host.cgroup.is_some() {
            missing.push(
                "cpu_percent: the cpu controller is not available to the executor's cgroups \
                 (cgroup v2: delegate cpu too, e.g. systemd Delegate=yes; v1: a writable cpu hierarchy)"
                    .to_string(),
            );
        }
        if !missing.is_empty() {
            if p.isolation == Isolation::Strict {
                return Err(Unavailable {
                    setting: "isolation = \"strict\"",
                    tool: tool.to_string(),
                    missing,
                });
            }
            for m in &missing {
                tracing::warn!(tool, "isolation = \"best_effort\": layer not enforced: {m}");
            }
        }
        if layers.contains(&Layer::Netns) {
            // Start preparing namespaces now, before the first child needs one.
            netns_pool(transparent);
        }
        Ok(Confinement {
            isolation: p.isolation,
            layers,
            landlock_abi: host.landlock_abi,
            read_paths: p.read_paths.clone(),
            ids: Some((exec.child_uid, exec.child_gid, exec.child_uid_count.max(1))),
            next_id: Arc::new(AtomicU64::new(0)),
            memory_mb: p.memory_mb,
            max_pids: p.max_pids,
            nproc: p.max_pids.saturating_mul(p.max as u64),
            cpu_ms: p.cpu_ms,
            cpu_percent,
            seccomp,
            cgroup: host.cgroup.clone(),
            private_shm: host.private_shm.is_ok(),
            transparent,
        })
    }

    /// Whether the child's namespace redirects every connect to the proxy.
    pub fn transparent(&self) -> bool {
        self.transparent && self.has(Layer::Netns)
    }

    pub fn has(&self, layer: Layer) -> bool {
        self.layers.contains(&layer)
    }

    /// The layers this plan applies.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// What to tell an operator when a confined child cannot open or enter
    /// something: which uid it runs as and what it may read.
    pub fn access_hint(&self) -> Option<String> {
        if self.isolation == Isolation::Off {
            return None;
        }
        let ids = match (self.has(Layer::Identity), self.ids) {
            (true, Some((uid, gid, _))) => format!("runs as uid {uid} / gid {gid} and "),
            _ => String::new(),
        };
        Some(format!(
            "the confined child {ids}may only read system paths, its program and script files and `read_paths`: \
             its working directory and files must be accessible to it (see docs/executor.md, Confinement)"
        ))
    }

    /// Whether a child of this plan is kept from every unix socket outside
    /// its sandbox, and how (for `doctor`): `(closed, detail)`.
    pub fn unix_sockets(&self) -> (bool, String) {
        if self.isolation == Isolation::Off {
            return (
                false,
                "isolation = \"off\": the child can connect to every unix socket its uid may write, by path or abstract name".into(),
            );
        }
        let mut abstract_by = Vec::new();
        if self.has(Layer::Netns) {
            abstract_by.push("its own network namespace");
        }
        if self.has(Layer::Landlock) && self.landlock_abi >= 6 {
            abstract_by.push("Landlock scoping");
        }
        if self.has(Layer::Seccomp) {
            let mut d = "seccomp denies socket(AF_UNIX) and datagram socketpairs (stream and seqpacket pairs stay: runtimes' own pipes)".to_string();
            if !abstract_by.is_empty() {
                d.push_str(&format!("; abstract names also by {}", abstract_by.join(" and ")));
            }
            d.push_str("; no socket among the fds a child starts with (0-4)");
            return (true, d);
        }
        let abstract_names = if abstract_by.is_empty() {
            "abstract names are OPEN too".to_string()
        } else {
            format!("abstract names are closed by {}", abstract_by.join(" and "))
        };
        (
            false,
            format!(
                "without seccomp the child can connect to every pathname unix socket its uid may write \
                 (the system D-Bus, X11, docker.sock, any 0666 socket): Landlock does not mediate connect(2) to a socket file \
                 and the network namespace does not cover the filesystem; {abstract_names}"
            ),
        )
    }

    /// This plan with only `keep` of its layers (tests and benchmarks measure
    /// each layer alone).
    pub fn only(&self, keep: &[Layer]) -> Confinement {
        let mut c = self.clone();
        c.layers.retain(|l| keep.contains(l));
        if !c.has(Layer::Seccomp) {
            c.seccomp.clear();
        }
        c
    }

    /// The uid/gid the next child gets (round robin over the configured range).
    fn next_ids(&self) -> Option<(u32, u32)> {
        if !self.has(Layer::Identity) {
            return None;
        }
        let (uid, gid, count) = self.ids?;
        let n = (self.next_id.fetch_add(1, Ordering::Relaxed) % u64::from(count)) as u32;
        Some((uid + n, gid + n))
    }

    /// What a fork server of this tool runs under (`fork_server = true`):
    /// a session and a network namespace of its own (where its children get
    /// one), their rlimits but CPU time and process count, and, where they
    /// get seccomp, the union of their filters (`fork_server_seccomp`) with
    /// `no_new_privs`. It keeps the uid and capabilities it needs to confine
    /// its children, and so is not under Landlock (which forbids the `mount`
    /// of their private `/dev/shm`).
    pub fn fork_server(&self) -> io::Result<ChildConfine> {
        let netns = if self.has(Layer::Netns) {
            Some(sys::new_netns(std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 0))?.0)
        } else {
            None
        };
        let seccomp = if self.has(Layer::Seccomp) {
            fork_server_seccomp().map_err(|e| io::Error::other(format!("cannot compile its seccomp filter: {e}")))?
        } else {
            Vec::new()
        };
        // The children's own, but for their CPU time (the server lives
        // for many children) and the uid-wide process count.
        let rlimits = if self.has(Layer::Rlimits) {
            vec![
                (libc::RLIMIT_CORE, 0, 0),
                (libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
            ]
        } else {
            Vec::new()
        };
        Ok(ChildConfine {
            setsid: true,
            netns,
            rlimits,
            no_new_privs: !seccomp.is_empty(),
            seccomp,
            ..ChildConfine::default()
        })
    }

    /// Everything one child needs, prepared in the parent. `scratch` is the
    /// run's writable directory (chowned here to the child's uid);
    /// `exec_files` the program and script files the command names;
    /// `proxy_port` the proxy's data port, used for Landlock's TCP rule when
    /// there is no network namespace; `name` names the cgroup.
    pub fn prepare(&self, name: &str, scratch: &Path, exec_files: &[PathBuf], proxy_port: u16) -> io::Result<Prepared> {
        let mut out = Prepared::default();
        if self.isolation == Isolation::Off {
            return Ok(out);
        }
        let c = &mut out.child;
        // Every confined child: its own session (no controlling terminal to
        // inject input into) and no privilege gain through exec.
        c.setsid = true;
        c.no_new_privs = true;
        if self.has(Layer::Identity) {
            c.ids = self.next_ids();
            if let Some((uid, gid)) = c.ids {
                rustix::fs::chown(
                    scratch,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )?;
            }
        }
        if self.has(Layer::Rlimits) {
            let cpu_s = self.cpu_ms.div_ceil(1000).max(1);
            c.rlimits = vec![
                (libc::RLIMIT_CORE, 0, 0),
                (libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
                (libc::RLIMIT_CPU, cpu_s, cpu_s + 1),
            ];
            if c.ids.is_some() && !self.has(Layer::Cgroup) {
                // Without the pids controller only RLIMIT_NPROC is left. It
                // counts every task of the uid, so children sharing a uid
                // share it: the cap is max_pids times pool.max.
                c.rlimits.push((libc::RLIMIT_NPROC, self.nproc, self.nproc));
            }
        }
        let port = if self.has(Layer::Netns) {
            let ns = netns_pool(self.transparent).take()?;
            if ns.transparent.is_some() {
                out.transparent_ns = Some(ns.ns.try_clone()?);
            }
            c.netns = Some(ns.ns);
            out.listener = Some(ns.listener);
            out.transparent = ns.transparent;
            CHILD_PROXY_PORT
        } else {
            proxy_port
        };
        if self.has(Layer::Landlock) {
            c.landlock = Some(self.landlock_ruleset(scratch, exec_files, port)?);
            if self.private_shm {
                // Landlock keeps the host's /dev/shm (shared with every run
                // and the host) out of reach; multiprocessing's semaphores
                // need one, so each child gets its own, bounded like its
                // memory (tmpfs pages count in its cgroup).
                let mb = self.memory_mb.max(1);
                c.private_shm = std::ffi::CString::new(format!("size={mb}m,nr_inodes=4096,mode=1777")).ok();
                use landlock::Access as _;
                c.shm_access = landlock::AccessFs::from_all(landlock::ABI::from(self.landlock_abi)).bits();
            }
        }
        c.seccomp = self.seccomp.clone();
        if self.has(Layer::Cgroup) {
            if let Some(host) = &self.cgroup {
                // (`for_tool` kept it only where the host can apply it.)
                let (dirs, procs, dir_fd) = make_cgroup(host, name, self.memory_mb, self.max_pids, self.cpu_percent)?;
                c.cgroup_procs = procs;
                c.cgroup_dir = dir_fd;
                out.cgroup = Some(CgroupDirs(dirs));
            }
        }
        Ok(out)
    }

    fn landlock_ruleset(&self, scratch: &Path, exec_files: &[PathBuf], port: u16) -> io::Result<OwnedFd> {
        use landlock::{
            path_beneath_rules, Access, AccessFs, AccessNet, NetPort, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
            ABI,
        };
        let abi = ABI::from(self.landlock_abi);
        let err = |e: landlock::RulesetError| io::Error::other(format!("landlock: {e}"));
        let mut rs = Ruleset::default().handle_access(AccessFs::from_all(abi)).map_err(err)?;
        // TCP connect is restricted to the proxy's port, except for a
        // transparent tool: every connect in its namespace is redirected to
        // the proxy (the namespace and its nftables rules are the fence), so
        // a connect to any port must reach that redirect.
        let connect_rule = self.landlock_abi >= 4 && !self.transparent();
        if self.landlock_abi >= 4 {
            let net = if connect_rule {
                AccessNet::BindTcp | AccessNet::ConnectTcp
            } else {
                AccessNet::BindTcp.into()
            };
            rs = rs.handle_access(net).map_err(err)?;
        }
        if self.landlock_abi >= 6 {
            rs = rs.scope(Scope::from_all(abi)).map_err(err)?;
        }
        let read: Vec<PathBuf> = SYSTEM_READ_PATHS
            .iter()
            .map(PathBuf::from)
            .chain(self.read_paths.iter().cloned())
            .chain(exec_files.iter().cloned())
            .chain(
                RESOLVER_READ_PATHS
                    .iter()
                    .filter(|_| self.transparent())
                    .map(PathBuf::from),
            )
            .filter(|p| p.exists())
            .collect();
        let mut created = rs
            .create()
            .map_err(err)?
            .add_rules(path_beneath_rules(&read, AccessFs::from_read(abi)))
            .map_err(err)?
            .add_rules(path_beneath_rules(["/dev/null"], AccessFs::from_file(abi)))
            .map_err(err)?
            .add_rules(path_beneath_rules([scratch], AccessFs::from_all(abi)))
            .map_err(err)?;
        if connect_rule {
            created = created
                .add_rule(NetPort::new(port, AccessNet::ConnectTcp))
                .map_err(err)?;
        }
        let fd: Option<OwnedFd> = created.into();
        fd.ok_or_else(|| io::Error::other("landlock: no ruleset was created"))
    }
}

/// Namespaces kept ready, so a cold start does not wait for the kernel to
/// build one (a few ms here): each is fresh, holds only `lo` and its listener,
/// and is used by exactly one child.
const READY_NAMESPACES: usize = 4;

/// A network namespace made for one child: its proxy listener, and for a
/// transparent tool the four sockets of the transparent hand-off.
pub struct Namespace {
    pub ns: OwnedFd,
    pub listener: std::net::TcpListener,
    pub transparent: Option<[OwnedFd; 4]>,
}

/// Ready network namespaces with their proxy listener, refilled by a
/// background thread. One pool for plain namespaces, one for transparent
/// ones (routes, nftables rules and sockets made in advance too).
struct NetnsPool {
    ready: std::sync::Mutex<Vec<Namespace>>,
    wanted: std::sync::Condvar,
    transparent: bool,
}

fn netns_pool(transparent: bool) -> &'static NetnsPool {
    static PLAIN: OnceLock<&'static NetnsPool> = OnceLock::new();
    static TRANSPARENT: OnceLock<&'static NetnsPool> = OnceLock::new();
    let cell = if transparent { &TRANSPARENT } else { &PLAIN };
    cell.get_or_init(|| {
        let pool: &'static NetnsPool = Box::leak(Box::new(NetnsPool {
            ready: std::sync::Mutex::new(Vec::new()),
            wanted: std::sync::Condvar::new(),
            transparent,
        }));
        let spawned = std::thread::Builder::new()
            .name("loom-netns-pool".into())
            .spawn(move || pool.refill());
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the namespace pool thread; namespaces are created per child");
        }
        pool
    })
}

/// A new namespace for a child: plain, or set up for transparent egress.
pub fn new_namespace(transparent: bool) -> io::Result<Namespace> {
    if !transparent {
        let (ns, listener) = sys::new_netns(CHILD_PROXY)?;
        return Ok(Namespace {
            ns,
            listener,
            transparent: None,
        });
    }
    let nft = crate::confine::transparent::nft().map_err(io::Error::other)?;
    let (ns, listener, sockets) = sys::new_netns_with(CHILD_PROXY, move || crate::confine::transparent::set_up(&nft))?;
    Ok(Namespace {
        ns,
        listener,
        transparent: Some(sockets),
    })
}

impl NetnsPool {
    /// A ready namespace, or a new one if none is ready.
    fn take(&self) -> io::Result<Namespace> {
        let got = match self.ready.lock() {
            Ok(mut r) => r.pop(),
            Err(_) => None,
        };
        self.wanted.notify_one();
        match got {
            Some(ns) => Ok(ns),
            None => new_namespace(self.transparent),
        }
    }

    fn refill(&self) {
        loop {
            let short = match self.ready.lock() {
                Ok(r) => {
                    let r = self
                        .wanted
                        .wait_while(r, |r| r.len() >= READY_NAMESPACES)
                        .unwrap_or_else(|p| p.into_inner());
                    r.len() < READY_NAMESPACES
                }
                Err(_) => return,
            };
            if !short {
                continue;
            }
            match new_namespace(self.transparent) {
                Ok(ns) => {
                    if let Ok(mut r) = self.ready.lock() {
                        r.push(ns);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, transparent = self.transparent, "cannot prepare a network namespace");
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
        }
    }
}

/// One child's prepared confinement.
#[derive(Default)]
pub struct Prepared {
    /// What the child applies to itself.
    pub child: ChildConfine,
    /// The listener on `127.0.0.1:3128` inside the child's namespace.
    pub listener: Option<std::net::TcpListener>,
    /// A transparent tool's four in-namespace sockets
    /// (`egress_api::handoff::TRANSPARENT`'s order).
    pub transparent: Option<[OwnedFd; 4]>,
    /// A transparent child's network namespace, kept to read its dropped
    /// UDP count once the child is gone.
    pub transparent_ns: Option<OwnedFd>,
    /// The child's cgroup directories (removed after the child is reaped).
    pub cgroup: Option<CgroupDirs>,
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
type MadeCgroup = (Vec<PathBuf>, Vec<OwnedFd>, Option<OwnedFd>);

/// The v2 subtrees whose `cgroup.subtree_control` `+cpu` was written to
/// (one per executor; several only where one process drives several hosts).
static CPU_ENABLED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// The CPU bandwidth period, in microseconds (the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

fn make_cgroup(
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
    let bytes = memory_mb.saturating_mul(1 << 20).to_string();
    let pids = max_pids.to_string();
    // percent of one CPU → microseconds of CPU per period (at least 1 ms:
    // the kernel's floor).
    let quota = cpu_percent.map(|p| (p.saturating_mul(CPU_PERIOD_US) / 100).max(1000).to_string());
    let cpu_max = quota.as_ref().map(|q| format!("{q} {CPU_PERIOD_US}"));
    let period = CPU_PERIOD_US.to_string();
    let mut writes: Vec<(PathBuf, Vec<(&str, &str)>)> = Vec::new();
    match host {
        CgroupHost::V1 { memory, pids: p, cpu } => {
            writes.push((
                memory.join(&leaf),
                vec![
                    ("memory.limit_in_bytes", &bytes),
                    ("memory.memsw.limit_in_bytes", &bytes),
                    ("memory.swappiness", "0"),
                ],
            ));
            writes.push((p.join(&leaf), vec![("pids.max", &pids)]));
            if let (Some(cpu), Some(quota)) = (cpu, &quota) {
                writes.push((
                    cpu.join(&leaf),
                    vec![("cpu.cfs_period_us", &period), ("cpu.cfs_quota_us", quota)],
                ));
            }
        }
        CgroupHost::V2 { dir, .. } => {
            let mut files = vec![
                ("memory.max", bytes.as_str()),
                ("memory.swap.max", "0"),
                ("pids.max", &pids),
            ];
            if let Some(cpu_max) = &cpu_max {
                // Enabled on first use in this subtree (idempotent): see
                // `CgroupHost::V2`.
                let mut enabled = CPU_ENABLED.lock().unwrap_or_else(|e| e.into_inner());
                if !enabled.contains(dir) {
                    let ctl = dir.join("cgroup.subtree_control");
                    std::fs::write(&ctl, "+cpu")
                        .map_err(|e| io::Error::new(e.kind(), format!("{}: cannot enable cpu: {e}", ctl.display())))?;
                    enabled.push(dir.clone());
                }
                files.push(("cpu.max", cpu_max));
            }
            writes.push((dir.join(&leaf), files));
        }
    }
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
    Ok((dirs, procs, dir_fd))
}

/// The seccomp programs: one denying the listed calls with EPERM, one making
/// `clone3` fail with ENOSYS (its flags live in memory a filter cannot read,
/// so libc falls back to `clone`, whose flags the first program checks).
fn seccomp_programs() -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    programs_for(Filtered::Child)
}

/// Who a seccomp program set is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Filtered {
    /// A tool's child: every call of `DENIED_SYSCALLS`, and the rules below.
    Child,
    /// A tool's fork server: the same, but for what its children need
    /// before they install their own (joining a network namespace,
    /// `unshare(CLONE_NEWNS)` and `mount` for a private `/dev/shm`) and what
    /// it needs to fork them (`clone` with `CLONE_NEWPID`).
    ForkServer,
}

/// The programs a tool's fork server runs under: the union of what its
/// children get (their own filters then take the rest away).
pub fn fork_server_seccomp() -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    programs_for(Filtered::ForkServer)
}

/// Calls a fork server keeps and its children's filters deny.
const FORK_SERVER_NEEDS: [i64; 3] = [libc::SYS_setns, libc::SYS_unshare, libc::SYS_mount];

fn programs_for(who: Filtered) -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
        SeccompRule, TargetArch,
    };
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in DENIED_SYSCALLS {
        if who == Filtered::ForkServer && FORK_SERVER_NEEDS.contains(nr) {
            continue;
        }
        rules.insert(*nr, Vec::new());
    }
    // socket(2): only AF_INET and AF_INET6, and never raw or packet types.
    // No AF_UNIX: Landlock does not mediate connect(2) to a socket file, nor
    // sendto(2) naming one, so a unix socket the child could create could
    // reach every world-writable socket of the host (D-Bus, X11, docker.sock).
    let family_not = |f: i32| Cond::new(0, Len::Dword, Op::Ne, f as u64);
    let socket_rules = vec![
        SeccompRule::new(vec![family_not(libc::AF_INET)?, family_not(libc::AF_INET6)?])?,
        SeccompRule::new(vec![Cond::new(
            1,
            Len::Dword,
            Op::MaskedEq(0xf),
            libc::SOCK_RAW as u64,
        )?])?,
        SeccompRule::new(vec![Cond::new(
            1,
            Len::Dword,
            Op::MaskedEq(0xf),
            10, /* SOCK_PACKET */
        )?])?,
    ];
    rules.insert(libc::SYS_socket, socket_rules);
    // socketpair(2): runtimes make their own pipes with it (Node's and
    // libuv's child stdio and IPC, Python's `socketpair`, multiprocessing's
    // duplex `Pipe`). Only AF_UNIX stream and seqpacket pairs: those cannot
    // be re-targeted (connect fails with EISCONN, a destination address is
    // refused or ignored). A datagram pair could `sendto`/`connect` any host
    // datagram socket, and AF_UNIX treats SOCK_RAW as a datagram socket.
    let mut pair_rules = vec![SeccompRule::new(vec![family_not(libc::AF_UNIX)?])?];
    for ty in 0..=0xf_u64 {
        if ty != libc::SOCK_STREAM as u64 && ty != libc::SOCK_SEQPACKET as u64 {
            pair_rules.push(SeccompRule::new(vec![Cond::new(
                1,
                Len::Dword,
                Op::MaskedEq(0xf),
                ty,
            )?])?);
        }
    }
    rules.insert(libc::SYS_socketpair, pair_rules);
    // clone(2) with any namespace flag.
    let mut clone_rules = Vec::new();
    for flag in [
        libc::CLONE_NEWNS,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        libc::CLONE_NEWCGROUP,
    ] {
        if who == Filtered::ForkServer && flag == libc::CLONE_NEWPID {
            continue;
        }
        let f = flag as u64;
        clone_rules.push(SeccompRule::new(vec![Cond::new(0, Len::Qword, Op::MaskedEq(f), f)?])?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    let eperm = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    let mut clone3 = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let enosys = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let a: seccompiler::BpfProgram = eperm.try_into()?;
    let b: seccompiler::BpfProgram = enosys.try_into()?;
    let mut programs = vec![Arc::new(a), Arc::new(b)];
    if let Some(x32) = x32_guard() {
        programs.push(Arc::new(x32));
    }
    Ok(programs)
}

/// On x86_64, system calls of the x32 ABI carry the x86_64 audit arch with
/// bit 30 set in their number, so no rule above matches them (`socket` is
/// 41 there, `41 | 1 << 30` in x32). Kernels with x32 enabled would let
/// them through: they fail with ENOSYS, as on a kernel without x32.
fn x32_guard() -> Option<seccompiler::BpfProgram> {
    #[cfg(target_arch = "x86_64")]
    {
        use seccompiler::sock_filter;
        const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
        const X32_SYSCALL_BIT: u32 = 0x4000_0000;
        let stmt = |code: u32, k: u32| sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        };
        let jump = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        Some(vec![
            // seccomp_data.arch (offset 4): not x86_64 → allow (the main
            // program already kills every foreign arch).
            stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
            jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, AUDIT_ARCH_X86_64, 0, 3),
            // seccomp_data.nr (offset 0): x32 numbers fail.
            stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
            jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, X32_SYSCALL_BIT, 0, 1),
            stmt(
                libc::BPF_RET | libc::BPF_K,
                libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
            ),
            stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
        ])
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// System calls a confined child may not make at all (they fail with EPERM).
pub const DENIED_SYSCALLS: &[i64] = &[
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
];

/// The files a command names: the resolved program and every argument that
/// is an existing regular file (relative to `cwd`; also `file:function`), so
/// a confined child can read its own script without the rest of its
/// directory.
pub fn command_files(command: &[String], program: Option<&Path>, cwd: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = program.map(Path::to_path_buf).into_iter().collect();
    for a in command.iter().skip(1) {
        if a.starts_with('-') || a.is_empty() {
            continue;
        }
        // `tool.py` or the runners' `tool.py:function` form.
        for candidate in [Some(a.as_str()), a.rsplit_once(':').map(|(f, _)| f)]
            .into_iter()
            .flatten()
        {
            let p = Path::new(candidate);
            let p = if p.is_relative() { cwd.join(p) } else { p.to_path_buf() };
            if p.is_file() {
                out.push(p);
                break;
            }
        }
    }
    out
}

/// The proxy URL a confined child gets: the run's credential, with the host
/// part replaced by the in-namespace listener.
pub fn child_proxy_url(run_url: &str) -> String {
    let (scheme, rest) = run_url.split_once("://").unwrap_or(("http", run_url));
    let creds = rest.rsplit_once('@').map(|(c, _)| c);
    match creds {
        Some(c) => format!("{scheme}://{c}@{CHILD_PROXY}"),
        None => format!("{scheme}://{CHILD_PROXY}"),
    }
}

/// The port of a run's proxy URL, also when it names a host (a cell's
/// `advertise_proxy`): what Landlock lets a child without its own network
/// namespace connect to.
pub fn proxy_port(run_url: &str) -> Option<u16> {
    let rest = run_url.split_once("://").map_or(run_url, |(_, r)| r);
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split('/').next().unwrap_or(host);
    host.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// The proxy's data address from a run's proxy URL (an IP literal; never
/// resolved).
pub fn proxy_addr(run_url: &str) -> Option<std::net::SocketAddr> {
    let rest = run_url.split_once("://").map_or(run_url, |(_, r)| r);
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split('/').next().unwrap_or(host);
    host.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_port_is_read_from_a_name_too() {
        assert_eq!(proxy_port("http://r:s@cell-a.cells.example:3128"), Some(3128));
        assert_eq!(proxy_port("http://r:s@127.0.0.1:9"), Some(9));
        assert_eq!(proxy_port("http://r:s@[::1]:7"), Some(7));
        assert_eq!(proxy_port("http://r:s@cell-a"), None);
    }

    #[test]
    fn child_proxy_url_keeps_the_credential() {
        assert_eq!(
            child_proxy_url("http://run-1:s3cret@127.0.0.1:9"),
            "http://run-1:s3cret@127.0.0.1:3128"
        );
        assert_eq!(
            proxy_addr("http://run-1:s3cret@127.0.0.1:9/").map(|a| a.to_string()),
            Some("127.0.0.1:9".to_string())
        );
        assert_eq!(proxy_addr("http://r:s@proxy.example:3128"), None);
    }

    fn host_without(missing: Layer) -> HostSupport {
        let mut layers = BTreeMap::new();
        for l in Layer::ALL {
            layers.insert(
                l,
                if l == missing {
                    Err("absent here".to_string())
                } else {
                    Ok(String::new())
                },
            );
        }
        HostSupport {
            layers,
            landlock_abi: 7,
            cgroup: None,
            private_shm: Ok(()),
            transparent: Ok(String::new()),
            pid_namespace: true,
        }
    }

    /// Strict starts on an older Landlock ABI when the namespaces stand in,
    /// and refuses when a protection would be missing: ABI 5 without a PID
    /// namespace leaves signals unscoped.
    #[test]
    fn strict_refuses_only_when_a_protection_is_missing() {
        let file = Path::new("/etc/loom/egress.toml");
        let c = crate::config::Config::parse(file, "[tools.t.process]\ncommand = [\"x\"]\nisolation = \"strict\"\n")
            .unwrap();
        let p = c.tools["t"].clone().unwrap();
        let mut host = host_without(Layer::Netns);
        host.layers.insert(Layer::Netns, Ok(String::new()));
        host.landlock_abi = 2;
        assert!(Confinement::for_tool("t", &p, &c.executor, &host).is_ok());
        host.landlock_abi = 5;
        host.pid_namespace = false;
        let msg = Confinement::for_tool("t", &p, &c.executor, &host)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("signals: this kernel's Landlock ABI 5 lacks it"), "{msg}");
        host.landlock_abi = 6;
        assert!(Confinement::for_tool("t", &p, &c.executor, &host).is_ok());
    }

    #[test]
    fn strict_refuses_naming_the_missing_layer_best_effort_goes_on() {
        let file = Path::new("/etc/loom/egress.toml");
        let cfg = |iso: &str| {
            crate::config::Config::parse(
                file,
                &format!("[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{iso}\"\n"),
            )
            .unwrap()
        };
        let c = cfg("strict");
        let p = c.tools["t"].clone().unwrap();
        let e = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Landlock)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("tool `t`") && msg.contains("landlock: absent here"),
            "{msg}"
        );
        assert!(msg.contains("CONFIG_SECURITY_LANDLOCK"), "{msg}");
        let ok = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Netns)).is_err();
        assert!(ok);

        let c = cfg("best_effort");
        let p = c.tools["t"].clone().unwrap();
        let b = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Landlock)).unwrap();
        assert!(!b.has(Layer::Landlock) && b.has(Layer::Netns) && b.has(Layer::Seccomp));

        let c = cfg("off");
        let p = c.tools["t"].clone().unwrap();
        let o = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Landlock)).unwrap();
        assert!(o.layers().is_empty());
    }

    /// `cpu_percent` on a host whose cgroups lack the cpu controller: strict
    /// refuses naming it, best_effort starts without the limit, and a host
    /// with the controller gives it.
    #[test]
    fn cpu_percent_needs_the_cpu_controller() {
        let file = Path::new("/etc/loom/egress.toml");
        let cfg = |iso: &str| {
            let c = crate::config::Config::parse(
                file,
                &format!("[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{iso}\"\ncpu_percent = 50\n"),
            )
            .unwrap();
            (c.tools["t"].clone().unwrap(), c.executor)
        };
        let mut host = host_without(Layer::Netns);
        host.layers.insert(Layer::Netns, Ok(String::new()));
        host.cgroup = Some(CgroupHost::V2 {
            dir: PathBuf::from("/sys/fs/cgroup/x"),
            cpu: false,
        });
        let (p, exec) = cfg("strict");
        let msg = Confinement::for_tool("t", &p, &exec, &host).unwrap_err().to_string();
        assert!(
            msg.contains("cpu_percent: the cpu controller is not available"),
            "{msg}"
        );
        let (b, exec) = cfg("best_effort");
        assert_eq!(Confinement::for_tool("t", &b, &exec, &host).unwrap().cpu_percent, None);
        host.cgroup = Some(CgroupHost::V1 {
            memory: PathBuf::from("/m"),
            pids: PathBuf::from("/p"),
            cpu: Some(PathBuf::from("/c")),
        });
        assert_eq!(
            Confinement::for_tool("t", &p, &exec, &host).unwrap().cpu_percent,
            Some(50)
        );
    }

    /// A transparent tool without its fence does not start, whatever its
    /// isolation: no namespace, or no way to set one up (`nft` missing).
    #[test]
    fn transparent_refuses_without_the_namespace_or_nft_even_best_effort() {
        let file = Path::new("/etc/loom/egress.toml");
        let c = crate::config::Config::parse(
            file,
            "[tools.t]\nnetwork = \"transparent\"\n[tools.t.process]\ncommand = [\"x\"]\nisolation = \"best_effort\"\n",
        )
        .unwrap();
        let p = c.tools["t"].clone().unwrap();
        let e = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Netns)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("network = \"transparent\" for tool `t`") && msg.contains("network namespace: absent here"),
            "{msg}"
        );
        let mut no_nft = host_without(Layer::Cgroup);
        no_nft.transparent = Err("no nft binary".into());
        let msg = Confinement::for_tool("t", &p, &c.executor, &no_nft)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("transparent egress: no nft binary"), "{msg}");
        // With both, best_effort goes on without the missing cgroup.
        let ok = Confinement::for_tool("t", &p, &c.executor, &host_without(Layer::Cgroup)).unwrap();
        assert!(ok.transparent() && ok.has(Layer::Netns));
    }

    #[test]
    fn doctor_says_whether_unix_sockets_are_closed() {
        let file = Path::new("/etc/loom/egress.toml");
        let plan = |iso: &str, missing: Layer| {
            let c = crate::config::Config::parse(
                file,
                &format!("[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{iso}\"\n"),
            )
            .unwrap();
            let p = c.tools["t"].clone().unwrap();
            Confinement::for_tool("t", &p, &c.executor, &host_without(missing)).unwrap()
        };
        let (closed, d) = plan("best_effort", Layer::Cgroup).unix_sockets();
        assert!(
            closed && d.contains("socket(AF_UNIX)") && d.contains("namespace and Landlock"),
            "{d}"
        );
        let (closed, d) = plan("best_effort", Layer::Seccomp).unix_sockets();
        assert!(
            !closed && d.starts_with("without seccomp") && d.contains("abstract names are closed"),
            "{d}"
        );
        let (closed, d) = plan("best_effort", Layer::Seccomp)
            .only(&[Layer::Identity])
            .unix_sockets();
        assert!(!closed && d.contains("abstract names are OPEN too"), "{d}");
        let (closed, d) = plan("off", Layer::Cgroup).unix_sockets();
        assert!(!closed && d.contains("isolation = \"off\""), "{d}");
    }

    /// Runs classic BPF `prog` on a `seccomp_data` (the instructions
    /// seccompiler emits, and `x32_guard`'s).
    fn run_bpf(prog: &[seccompiler::sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&nr.to_le_bytes());
        data.extend_from_slice(&arch.to_le_bytes());
        data.extend_from_slice(&0u64.to_le_bytes());
        for a in args {
            data.extend_from_slice(&a.to_le_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            let code = u32::from(i.code);
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                    let at = i.k as usize;
                    acc = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
                }
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= i.k,
                c if c == libc::BPF_JMP | libc::BPF_JA => pc += i.k as usize,
                c if c & 0x07 == libc::BPF_JMP => {
                    let taken = match c & 0xf0 {
                        0x10 => acc == i.k,     // JEQ
                        0x20 => acc > i.k,      // JGT
                        0x30 => acc >= i.k,     // JGE
                        0x40 => acc & i.k != 0, // JSET
                        other => panic!("jump {other:#x}"),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                c if c & 0x07 == libc::BPF_RET => return i.k,
                other => panic!("opcode {other:#x}"),
            }
        }
    }

    /// What the child's filters answer for one call: the first program that
    /// does not allow it decides (enough for these cases).
    fn verdict(arch: u32, nr: i64, args: [u64; 6]) -> u32 {
        let programs = seccomp_programs().unwrap();
        programs
            .iter()
            .map(|p| run_bpf(p, arch, nr as u32, args))
            .find(|r| *r != libc::SECCOMP_RET_ALLOW)
            .unwrap_or(libc::SECCOMP_RET_ALLOW)
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn unix_sockets_are_denied_but_stream_socketpairs_stay() {
        const ARCH: u32 = 0xc000_003e;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let allow = libc::SECCOMP_RET_ALLOW;
        let call = |nr: i64, a: i32, b: i32| verdict(ARCH, nr, [a as u64, b as u64, 0, 0, 0, 0]);
        let (unix, inet, inet6) = (libc::AF_UNIX, libc::AF_INET, libc::AF_INET6);
        let (stream, dgram, seq, raw) = (
            libc::SOCK_STREAM,
            libc::SOCK_DGRAM,
            libc::SOCK_SEQPACKET,
            libc::SOCK_RAW,
        );
        let flags = libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        for (what, nr, family, ty, want) in [
            ("socket unix stream", libc::SYS_socket, unix, stream, eperm),
            ("socket unix dgram", libc::SYS_socket, unix, dgram | flags, eperm),
            ("socket unix seqpacket", libc::SYS_socket, unix, seq, eperm),
            ("socket netlink", libc::SYS_socket, libc::AF_NETLINK, dgram, eperm),
            ("socket inet stream", libc::SYS_socket, inet, stream | flags, allow),
            ("socket inet6 dgram", libc::SYS_socket, inet6, dgram, allow),
            ("socket inet raw", libc::SYS_socket, inet, raw, eperm),
            (
                "socketpair unix stream",
                libc::SYS_socketpair,
                unix,
                stream | flags,
                allow,
            ),
            (
                "socketpair unix seqpacket",
                libc::SYS_socketpair,
                unix,
                seq | libc::SOCK_CLOEXEC,
                allow,
            ),
            ("socketpair unix dgram", libc::SYS_socketpair, unix, dgram, eperm),
            (
                "socketpair unix dgram cloexec",
                libc::SYS_socketpair,
                unix,
                dgram | flags,
                eperm,
            ),
            ("socketpair unix raw", libc::SYS_socketpair, unix, raw, eperm),
            ("socketpair unix type 0", libc::SYS_socketpair, unix, 0, eperm),
            ("socketpair inet stream", libc::SYS_socketpair, inet, stream, eperm),
            ("getpid", libc::SYS_getpid, 0, 0, allow),
            ("x32 socket", libc::SYS_socket | 0x4000_0000, unix, stream, enosys),
            (
                "x32 io_uring_setup",
                libc::SYS_io_uring_setup | 0x4000_0000,
                1,
                0,
                enosys,
            ),
        ] {
            assert_eq!(call(nr, family, ty), want, "{what}");
        }
        // A foreign arch (i386 through int 0x80: socketcall and all) is killed.
        assert_eq!(
            verdict(0x4000_0003, 102, [1, 0, 0, 0, 0, 0]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    /// A fork server keeps what its children need before their own
    /// filters (and to fork them into a PID namespace), and nothing else
    /// its children are denied.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_fork_server_filter_is_the_childrens_but_for_what_they_need_first() {
        const ARCH: u32 = 0xc000_003e;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let server = fork_server_seccomp().unwrap();
        let verdict = |nr: i64, args: [u64; 6]| {
            server
                .iter()
                .map(|p| run_bpf(p, ARCH, nr as u32, args))
                .find(|r| *r != libc::SECCOMP_RET_ALLOW)
                .unwrap_or(libc::SECCOMP_RET_ALLOW)
        };
        let fork = (libc::CLONE_PARENT | libc::CLONE_NEWPID | libc::SIGCHLD) as u64;
        for (what, nr, args) in [
            ("setns", libc::SYS_setns, [3, libc::CLONE_NEWNET as u64, 0, 0, 0, 0]),
            (
                "unshare(CLONE_NEWNS)",
                libc::SYS_unshare,
                [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0],
            ),
            ("mount", libc::SYS_mount, [0; 6]),
            (
                "clone(CLONE_PARENT|CLONE_NEWPID)",
                libc::SYS_clone,
                [fork, 0, 0, 0, 0, 0],
            ),
        ] {
            assert_eq!(verdict(nr, args), libc::SECCOMP_RET_ALLOW, "{what}");
            assert_eq!(self::verdict(ARCH, nr, args), eperm, "{what} is the child's to lose");
        }
        for (what, nr, args) in [
            ("ptrace", libc::SYS_ptrace, [0; 6]),
            ("io_uring_setup", libc::SYS_io_uring_setup, [0; 6]),
            ("bpf", libc::SYS_bpf, [0; 6]),
            (
                "socket(AF_UNIX)",
                libc::SYS_socket,
                [libc::AF_UNIX as u64, 1, 0, 0, 0, 0],
            ),
            (
                "clone(CLONE_NEWUSER)",
                libc::SYS_clone,
                [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0],
            ),
            (
                "clone(CLONE_NEWNET)",
                libc::SYS_clone,
                [libc::CLONE_NEWNET as u64, 0, 0, 0, 0, 0],
            ),
        ] {
            assert_eq!(verdict(nr, args), eperm, "{what}");
        }
    }

    #[test]
    fn seccomp_programs_compile() {
        let p = seccomp_programs().unwrap();
        assert_eq!(p.len(), if cfg!(target_arch = "x86_64") { 3 } else { 2 });
        assert!(p[0].len() > DENIED_SYSCALLS.len());
    }
}
