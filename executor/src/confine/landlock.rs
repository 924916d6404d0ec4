//! Landlock, the filesystem and TCP fence of a confined child: what the
//! kernel's ABI gives, the paths every child may read, the files its command
//! names, and one child's ruleset made in the parent: read only there, write
//! only its scratch directory, TCP connect only to the proxy's port (left to
//! the namespace for a transparent tool).

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

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

/// What Landlock gives on this kernel (`abi` 0: none), with whether a child
/// gets a private `/dev/shm` under it (`shm`).
pub fn support(abi: i32, shm: &Result<(), String>) -> Result<String, String> {
    if abi >= 1 {
        let mut d = format!("ABI {abi}: filesystem");
        if abi >= 4 {
            d.push_str(", TCP bind/connect");
        }
        if abi >= 6 {
            d.push_str(", abstract-socket and signal scoping");
        }
        match shm {
            Ok(()) => d.push_str("; a private /dev/shm per child"),
            Err(e) => d.push_str(&format!("; no /dev/shm for children ({e})")),
        }
        Ok(d)
    } else {
        Err("the kernel has no Landlock (or it is disabled)".into())
    }
}

/// One child's ruleset (its fd, for `landlock_restrict_self` in the child):
/// read `SYSTEM_READ_PATHS`, `read_paths`, `exec_files` (and, for a
/// `transparent` tool, `RESOLVER_READ_PATHS`), write `scratch`, connect to
/// TCP `port` only (where the ABI has TCP rules and the tool is not
/// transparent).
pub fn ruleset(
    landlock_abi: i32,
    transparent: bool,
    read_paths: &[PathBuf],
    exec_files: &[PathBuf],
    scratch: &Path,
    port: u16,
) -> io::Result<OwnedFd> {
    use landlock::{
        path_beneath_rules, Access, AccessFs, AccessNet, NetPort, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, ABI,
    };
    let abi = ABI::from(landlock_abi);
    let err = |e: landlock::RulesetError| io::Error::other(format!("landlock: {e}"));
    let mut rs = Ruleset::default().handle_access(AccessFs::from_all(abi)).map_err(err)?;
    // TCP connect is restricted to the proxy's port, except for a
    // transparent tool: every connect in its namespace is redirected to
    // the proxy (the namespace and its nftables rules are the fence), so
    // a connect to any port must reach that redirect.
    let connect_rule = landlock_abi >= 4 && !transparent;
    if landlock_abi >= 4 {
        let net = if connect_rule {
            AccessNet::BindTcp | AccessNet::ConnectTcp
        } else {
            AccessNet::BindTcp.into()
        };
        rs = rs.handle_access(net).map_err(err)?;
    }
    if landlock_abi >= 6 {
        rs = rs.scope(Scope::from_all(abi)).map_err(err)?;
    }
    let read: Vec<PathBuf> = SYSTEM_READ_PATHS
        .iter()
        .map(PathBuf::from)
        .chain(read_paths.iter().cloned())
        .chain(exec_files.iter().cloned())
        .chain(RESOLVER_READ_PATHS.iter().filter(|_| transparent).map(PathBuf::from))
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
