//! Confinement of tool children, one mechanism per file (`netns`,
//! `transparent`, `landlock`, `shm`, `seccomp`, `ids`, `rlimits`, `cgroup`);
//! `plan` decides per tool which a child gets and prepares them in the
//! parent, `doctor` maps them to protections. This module is what the host
//! provides, layer by layer (probed once).

pub mod cgroup;
pub mod doctor;
pub mod ids;
pub mod landlock;
pub mod netns;
pub mod plan;
pub mod rlimits;
pub mod seccomp;
pub mod shm;
pub mod transparent;

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::config::ExecutorSection;
use crate::sys;

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

/// What the host provides, layer by layer (probed once per process).
#[derive(Debug, Clone)]
pub struct HostSupport {
    /// Per layer: `Ok(detail)` or `Err(why not)`.
    pub layers: BTreeMap<Layer, Result<String, String>>,
    pub landlock_abi: i32,
    pub cgroup: Option<cgroup::CgroupHost>,
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

impl HostSupport {
    pub fn available(&self, layer: Layer) -> bool {
        matches!(self.layers.get(&layer), Some(Ok(_)))
    }

    /// The features the protections of a child rest on
    /// ([`doctor::verdicts`]).
    pub fn features(&self) -> doctor::Features {
        doctor::Features {
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
    layers.insert(Layer::Netns, netns::support());
    let netns_ok = matches!(layers.get(&Layer::Netns), Some(Ok(_)));
    let abi = sys::landlock_abi();
    let private_shm = shm::support();
    layers.insert(Layer::Landlock, landlock::support(abi, &private_shm));
    layers.insert(Layer::Seccomp, seccomp::support());
    layers.insert(Layer::Identity, ids::support(exec));
    layers.insert(Layer::Rlimits, rlimits::support());
    let cgroup = cgroup::host(exec);
    layers.insert(Layer::Cgroup, cgroup::support(&cgroup));
    HostSupport {
        layers,
        landlock_abi: abi,
        cgroup: cgroup.ok(),
        private_shm,
        pid_namespace: netns_ok && exec.pid_namespace,
        transparent: if netns_ok {
            transparent::support()
        } else {
            Err("no network namespace".into())
        },
    }
}
