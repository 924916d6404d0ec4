//! The per-tool confinement plan (`isolation = "strict" | "best_effort" |
//! "off"`): which layers a tool's children get on this host (`strict`
//! refuses naming what is missing), and one child's preparation in the
//! parent before clone, each mechanism from its own file. The child applies
//! it with raw system calls (`sys::ChildConfine`); nothing here runs in it.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{ExecutorSection, Isolation, Network, ProcessConfig};
use crate::confine::cgroup::{self, CgroupDirs, CgroupHost};
use crate::confine::ids::Ids;
use crate::confine::{landlock, netns, rlimits, seccomp, shm, HostSupport, Layer};
use crate::sys::{self, ChildConfine};

/// Why a tool's requested confinement cannot be provided.
#[derive(Debug, thiserror::Error)]
#[error("{setting} for tool `{tool}` needs layers this host cannot provide: {}", .missing.join("; "))]
pub struct Unavailable {
    /// What asks for them: `isolation = "strict"` or `network = "transparent"`.
    pub setting: &'static str,
    pub tool: String,
    pub missing: Vec<String>,
}

/// The per-tool confinement plan.
#[derive(Debug, Clone)]
pub struct Confinement {
    pub isolation: Isolation,
    layers: Vec<Layer>,
    landlock_abi: i32,
    read_paths: Vec<PathBuf>,
    ids: Option<Ids>,
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
            match seccomp::programs() {
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
            netns::pool(transparent);
        }
        Ok(Confinement {
            isolation: p.isolation,
            layers,
            landlock_abi: host.landlock_abi,
            read_paths: p.read_paths.clone(),
            ids: Some(Ids::new(exec.child_uid, exec.child_gid, exec.child_uid_count)),
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
        let ids = match (self.has(Layer::Identity), &self.ids) {
            (true, Some(ids)) => format!("runs as uid {} / gid {} and ", ids.uid, ids.gid),
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
        self.ids.as_ref().map(Ids::next)
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
            seccomp::fork_server_programs()
                .map_err(|e| io::Error::other(format!("cannot compile its seccomp filter: {e}")))?
        } else {
            Vec::new()
        };
        let rlimits = if self.has(Layer::Rlimits) {
            rlimits::fork_server()
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
            // Without the pids controller only RLIMIT_NPROC is left. It
            // counts every task of the uid, so children sharing a uid
            // share it: the cap is max_pids times pool.max.
            let nproc = (c.ids.is_some() && !self.has(Layer::Cgroup)).then_some(self.nproc);
            c.rlimits = rlimits::child(self.cpu_ms, nproc);
        }
        let port = if self.has(Layer::Netns) {
            let ns = netns::pool(self.transparent).take()?;
            if ns.transparent.is_some() {
                out.transparent_ns = Some(ns.ns.try_clone()?);
            }
            c.netns = Some(ns.ns);
            out.listener = Some(ns.listener);
            out.transparent = ns.transparent;
            netns::CHILD_PROXY_PORT
        } else {
            proxy_port
        };
        if self.has(Layer::Landlock) {
            c.landlock = Some(landlock::ruleset(
                self.landlock_abi,
                self.transparent(),
                &self.read_paths,
                exec_files,
                scratch,
                port,
            )?);
            if self.private_shm {
                // Landlock keeps the host's /dev/shm (shared with every run
                // and the host) out of reach; multiprocessing's semaphores
                // need one, so each child gets its own, bounded like its
                // memory (tmpfs pages count in its cgroup).
                (c.private_shm, c.shm_access) = shm::mount(self.memory_mb, self.landlock_abi);
            }
        }
        c.seccomp = self.seccomp.clone();
        if self.has(Layer::Cgroup) {
            if let Some(host) = &self.cgroup {
                // (`for_tool` kept it only where the host can apply it.)
                let (dirs, procs, dir_fd) = cgroup::make(host, name, self.memory_mb, self.max_pids, self.cpu_percent)?;
                c.cgroup_procs = procs;
                c.cgroup_dir = dir_fd;
                out.cgroup = Some(dirs);
            }
        }
        Ok(out)
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

/// A cgroup for `doctor`'s probe child (so it can say how children join
/// theirs): `None` without a cgroup layer.
pub fn cgroup_probe(host: &HostSupport) -> Option<io::Result<Prepared>> {
    let h = host.cgroup.as_ref()?;
    Some(
        cgroup::make(h, "doctor-probe", 64, 16, None).map(|(dirs, procs, dir_fd)| {
            let mut p = Prepared::default();
            p.child.cgroup_procs = procs;
            p.child.cgroup_dir = dir_fd;
            p.cgroup = Some(dirs);
            p
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
}
