//! The fork-server stage (`fork_server = true`): a tool's reference Python
//! runner booted once (`loom_runner.py --fork-server`) forks each child
//! instead of the spawner starting a fresh interpreter; each child still
//! takes its own confinement before any tool code loads (see `ForkServer`).

use std::fmt::Write as _;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags,
    SocketType,
};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use serde_json::{json, Value};

use super::identity::{Hasher, Identity};
use super::{Process, Spawner};
use crate::config::ProcessConfig;
use crate::confine::plan::Confinement;
use crate::sys::{ChildSpec, Started};

/// How long the server may take to answer a fork, and a child to apply its
/// confinement (the first fork also waits for the server's own start).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest specification a child accepts (the runner's receive buffer).
const MAX_SPEC_BYTES: usize = 1 << 20;

/// A tool's fork server, started on first use.
///
/// The server is started by the spawner like any child, in a session and a
/// network namespace of its own, with nothing of the executor but a pidfd
/// of it. It never runs tool code and never sees what a child is given: for
/// each child the spawner thread sends it one socket, the server forks with
/// `CLONE_PARENT` (so the child is the executor's own child, reaped, killed
/// and waited for through its pidfd like any other) and answers the pid; the
/// spawner then sends the child its specification on that socket (its
/// environment, fds 0-4 and the confinement prepared for it: network
/// namespace, cgroup, rlimits, ids, Landlock ruleset, seccomp programs), and
/// the child applies it in the order `sys` applies it before `exec`, answers
/// `ok` (or the stage that failed and its errno), and only then loads the
/// tool. If the server is gone, children start the old way and
/// `executor_fork_server_up` says so.
#[derive(Debug)]
pub struct ForkServer {
    tool: String,
    command: Vec<String>,
    cwd: std::path::PathBuf,
    env: Vec<(String, String)>,
    path: String,
    /// The tool's confinement, which plans the server's own
    /// (`Confinement::fork_server`).
    confinement: Confinement,
    link: tokio::sync::OnceCell<Option<Arc<Link>>>,
    up: Arc<AtomicBool>,
}

/// A running server: the spawner thread's end of its socket.
#[derive(Debug)]
pub struct Link {
    tool: String,
    sock: OwnedFd,
    /// What the server was started from (its interpreter, from the
    /// descriptor it executed, and the runner), which every child it forks
    /// runs too.
    identity: Identity,
    /// Whether a child that would run something else was refused a fork
    /// (logged once).
    differs: AtomicBool,
    up: Arc<AtomicBool>,
    /// Kept so that dropping the link kills and reaps the server.
    _process: Mutex<Process>,
}

/// Why a fork did not give a child.
pub enum ForkFailure {
    /// The server is gone or answered nonsense (logged once): start this
    /// child (and the next ones) the old way.
    Server,
    /// The child was created but could not take its confinement (as a
    /// failed `exec` would): the start fails.
    Child(io::Error),
}

impl ForkServer {
    /// The fork server of a tool with `fork_server = true`: the tool's
    /// command with `--fork-server` for its target, the tool's own
    /// variables (its `env`, PATH and LANG; none of a run's), and the
    /// confinement the tool's plan gives a fork server.
    pub fn for_tool(id: &str, process: &ProcessConfig, confinement: &Confinement) -> Option<ForkServer> {
        let command = process.fork_server_command()?;
        let mut env: Vec<(String, String)> = process.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        env.push(("PATH".into(), process.path.clone()));
        env.push(("LANG".into(), process.lang.clone()));
        Some(ForkServer {
            tool: id.to_string(),
            command,
            cwd: process.cwd.clone(),
            env,
            path: process.path.clone(),
            confinement: confinement.clone(),
            link: tokio::sync::OnceCell::new(),
            up: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Whether the server is running and forking.
    pub fn up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// The running server, started on the first call; `None` (children
    /// start the old way) if it cannot start or has died.
    pub async fn link(&self, spawner: &Spawner) -> Option<Arc<Link>> {
        let link = self
            .link
            .get_or_init(|| async {
                match self.start(spawner).await {
                    Ok(l) => Some(Arc::new(l)),
                    Err(e) => {
                        tracing::warn!(tool = %self.tool, "the fork server did not start ({e}): children start a fresh interpreter each");
                        None
                    }
                }
            })
            .await
            .clone()?;
        link.up.load(Ordering::Relaxed).then_some(link)
    }

    /// `doctor`'s check: start a server of this tool's (not the one its
    /// children use) and have it fork a child, which exits without loading
    /// the tool.
    pub async fn check(&self, spawner: &Spawner) -> Result<String, String> {
        let t0 = std::time::Instant::now();
        let link = self.start(spawner).await.map_err(|e| format!("does not start: {e}"))?;
        let ns = tokio::task::spawn_blocking(move || link.probe())
            .await
            .map_err(|e| e.to_string())??;
        Ok(format!(
            "booted and forked a child in {:.0} ms{}",
            t0.elapsed().as_secs_f64() * 1e3,
            if ns { " (its own PID namespace)" } else { "" }
        ))
    }

    async fn start(&self, spawner: &Spawner) -> io::Result<Link> {
        let (mine, theirs) = channel()?;
        let me = rustix::process::pidfd_open(rustix::process::getpid(), rustix::process::PidfdFlags::empty())?;
        let confine = self.confinement.fork_server()?;
        let opened = Hasher::new()
            .open(&self.command, &self.path, &self.cwd)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let exec = super::launch::exec_args(
            &self.command,
            &self.env,
            &self.path,
            &self.cwd,
            Some(&opened.program.path),
        )?;
        let program_fd = if opened.program.script {
            None
        } else {
            Some(opened.program.fd)
        };
        let spec = ChildSpec {
            program: exec.program,
            program_fd,
            argv: exec.argv,
            envp: exec.envp,
            cwd: Some(exec.cwd),
            stdin: theirs,
            stdout: super::dev_null()?,
            stderr: rustix::io::fcntl_dupfd_cloexec(rustix::stdio::stderr(), 3)?,
            ipc_in: me,
            ipc_out: super::dev_null()?,
            // A PID namespace's init cannot fork with CLONE_PARENT.
            pid_namespace: false,
            confine,
        };
        let process = spawner.spawn(spec, None).await?;
        self.up.store(true, Ordering::Relaxed);
        tracing::info!(tool = %self.tool, pid = process.pid(), "fork server started");
        Ok(Link {
            tool: self.tool.clone(),
            sock: mine,
            identity: opened.identity,
            differs: AtomicBool::new(false),
            up: self.up.clone(),
            _process: Mutex::new(process),
        })
    }
}

impl Link {
    /// Whether a child that would run `child` (hashed at its start) may be
    /// forked from this server: every file the server was started from
    /// hashes the same for the child. Otherwise (the interpreter or the
    /// runner changed on disk since the server booted) the child starts a
    /// fresh interpreter, so that it runs what its run says it runs.
    pub fn runs(&self, child: &Identity) -> bool {
        let same = self
            .identity
            .files()
            .all(|s| child.files().any(|c| c.path == s.path && c.sha256 == s.sha256));
        if !same && !self.differs.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                tool = %self.tool,
                "the fork server's interpreter or runner changed on disk since it started: children start a fresh interpreter each while it differs"
            );
        }
        same
    }

    /// Have the server fork a child that reads its specification from
    /// `theirs`: its pid, a pidfd of it, and whether it has its own PID
    /// namespace.
    fn ask(&self, theirs: &OwnedFd, pid_namespace: bool) -> Result<(Pid, OwnedFd, bool), ForkFailure> {
        let server = |e: io::Error| {
            if self.up.swap(false, Ordering::Relaxed) {
                tracing::warn!(tool = %self.tool, "the fork server is gone ({e}): children start a fresh interpreter each from now on");
            }
            ForkFailure::Server
        };
        let mut pid_namespace = pid_namespace;
        let pid = loop {
            let ask: &[u8] = if pid_namespace { b"F1" } else { b"F0" };
            send(&self.sock, ask, &[theirs.as_fd()]).map_err(server)?;
            let answer = recv(&self.sock, 64).map_err(server)?;
            let text = String::from_utf8_lossy(&answer);
            let number = |s: &str| s.parse::<i32>().ok();
            match (text.get(..1), text.get(1..).and_then(number)) {
                (Some("P"), Some(pid)) if pid > 0 => break pid,
                // As `sys` does: without the right to a PID namespace,
                // process groups.
                (Some("E"), Some(errno))
                    if pid_namespace && [libc::EPERM, libc::EINVAL, libc::ENOSPC].contains(&errno) =>
                {
                    pid_namespace = false;
                }
                (Some("E"), Some(errno)) => {
                    let os = io::Error::from_raw_os_error(errno);
                    return Err(ForkFailure::Child(io::Error::new(
                        os.kind(),
                        format!("the fork server could not fork: {os}"),
                    )));
                }
                _ => return Err(server(io::Error::other(format!("unexpected answer {text:?}")))),
            }
        };
        let pid = Pid::from_raw(pid).ok_or_else(|| server(io::Error::other("pid 0")))?;
        // Race-free: the child is this process's own (CLONE_PARENT) and is
        // reaped only through this pidfd, so its pid cannot be reused before.
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| ForkFailure::Child(e.into()))?;
        Ok((pid, pidfd, pid_namespace))
    }

    /// `doctor`'s check: a child forked and reaped (it finds no
    /// specification on its socket and exits 0 without loading the tool).
    /// Whether it had its own PID namespace.
    pub fn probe(&self) -> Result<bool, String> {
        let (mine, theirs) = channel().map_err(|e| e.to_string())?;
        let (_, pidfd, pid_namespace) = match self.ask(&theirs, true) {
            Ok(forked) => forked,
            Err(ForkFailure::Server) => return Err("the fork server is gone".into()),
            Err(ForkFailure::Child(e)) => return Err(e.to_string()),
        };
        drop((mine, theirs));
        let status = rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED)
            .map_err(|e| e.to_string())?
            .ok_or("no exit status")?;
        match status.exit_status() {
            Some(0) if status.exited() => Ok(pid_namespace),
            _ => Err(format!("the forked child ended with {status:?}")),
        }
    }

    /// Fork a child for `spec` (on the spawner thread, with the registry of
    /// children locked by the caller).
    pub(super) fn fork(&self, spec: &ChildSpec) -> Result<Started, ForkFailure> {
        let (mine, theirs) = channel().map_err(ForkFailure::Child)?;
        let (pid, pidfd, pid_namespace) = self.ask(&theirs, spec.pid_namespace)?;
        drop(theirs);
        let give_up = |e: io::Error| {
            let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::KILL);
            let _ = rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED);
            ForkFailure::Child(e)
        };
        match configure(&mine, spec) {
            Ok(()) => {}
            Err(e) => return Err(give_up(e)),
        }
        match recv(&mine, 4096) {
            Ok(a) if a == b"ok" => Ok(Started {
                pid,
                pidfd,
                pid_namespace,
                forked: true,
            }),
            Ok(a) => Err(give_up(failed_stage(&a))),
            Err(e) => Err(give_up(io::Error::new(
                e.kind(),
                format!("the forked child did not confirm its confinement: {e}"),
            ))),
        }
    }
}

/// A child's socket: ours, and the end the server hands the child.
fn channel() -> io::Result<(OwnedFd, OwnedFd)> {
    let (mine, theirs) =
        rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_timeout(&mine, rustix::net::sockopt::Timeout::Recv, Some(ANSWER_TIMEOUT))?;
    Ok((mine, theirs))
}

/// Send the child its specification: one message, JSON and descriptors.
fn configure(chan: &OwnedFd, spec: &ChildSpec) -> io::Result<()> {
    let c = &spec.confine;
    let mut fds: Vec<BorrowedFd<'_>> = vec![
        spec.stdin.as_fd(),
        spec.stdout.as_fd(),
        spec.stderr.as_fd(),
        spec.ipc_in.as_fd(),
        spec.ipc_out.as_fd(),
    ];
    let mut at = serde_json::Map::new();
    fn add<'a>(fds: &mut Vec<BorrowedFd<'a>>, fd: BorrowedFd<'a>) -> usize {
        fds.push(fd);
        fds.len() - 1
    }
    // A v2 cgroup the exec path creates children in (CLONE_INTO_CGROUP):
    // a forked child joins it through its cgroup.procs instead.
    let in_dir = c
        .cgroup_dir
        .as_ref()
        .map(|dir| {
            rustix::fs::openat(
                dir,
                "cgroup.procs",
                rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
        })
        .transpose()?;
    if let Some(f) = &c.netns {
        at.insert("netns".into(), json!(add(&mut fds, f.as_fd())));
    }
    if let Some(f) = &c.landlock {
        at.insert("landlock".into(), json!(add(&mut fds, f.as_fd())));
    }
    let mut cgroups = Vec::new();
    for f in c
        .cgroup_procs
        .iter()
        .map(AsFd::as_fd)
        .chain(in_dir.as_ref().map(AsFd::as_fd))
    {
        cgroups.push(add(&mut fds, f));
    }
    at.insert("cgroups".into(), json!(cgroups));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let env: Vec<Value> = spec
        .envp
        .iter()
        .map(|kv| {
            let kv = text(kv.as_bytes());
            let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
            json!([k, v])
        })
        .collect();
    // Python's own argv: the runner's path and the target.
    let argv: Vec<String> = spec
        .argv
        .iter()
        .rev()
        .take(2)
        .rev()
        .map(|a| text(a.as_bytes()))
        .collect();
    let filters: Vec<String> = c
        .seccomp
        .iter()
        .map(|prog| {
            let mut hex = String::with_capacity(prog.len() * 16);
            for i in prog.iter() {
                let mut raw = [0u8; 8];
                raw[..2].copy_from_slice(&i.code.to_ne_bytes());
                raw[2] = i.jt;
                raw[3] = i.jf;
                raw[4..].copy_from_slice(&i.k.to_ne_bytes());
                for b in raw {
                    let _ = write!(hex, "{b:02x}");
                }
            }
            hex
        })
        .collect();
    let body = json!({
        "argv": argv,
        "env": env,
        "cwd": spec.cwd.as_ref().map(|c| text(c.as_bytes())),
        "setsid": c.setsid,
        "shm": c.private_shm.as_ref().map(|d| text(d.as_bytes())),
        "shm_access": c.shm_access,
        "rlimits": c.rlimits,
        "ids": c.ids,
        "nnp": c.no_new_privs,
        "filters": filters,
        "fds": at,
    });
    let body = serde_json::to_vec(&body).map_err(io::Error::other)?;
    if body.len() > MAX_SPEC_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the child's specification is {} bytes, more than {MAX_SPEC_BYTES}",
                body.len()
            ),
        ));
    }
    send(chan, &body, &fds)
}

/// A child's `{"stage": ..., "errno": ...}` as an error like `sys`'s.
fn failed_stage(answer: &[u8]) -> io::Error {
    let v: Value = serde_json::from_slice(answer).unwrap_or(Value::Null);
    let stage = v["stage"].as_str().unwrap_or("starting");
    let errno = v["errno"].as_i64().and_then(|e| i32::try_from(e).ok()).unwrap_or(0);
    let os = io::Error::from_raw_os_error(errno);
    let detail = v["message"].as_str().map(|m| format!(" ({m})")).unwrap_or_default();
    io::Error::new(
        os.kind(),
        format!("{stage}: {os}{detail} (in a child of the fork server)"),
    )
}

fn send(sock: &OwnedFd, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(msg)], &mut control, SendFlags::NOSIGNAL)?;
    if n != msg.len() {
        return Err(io::Error::other("short write"));
    }
    Ok(())
}

/// One message (no descriptors expected); empty: the peer closed.
fn recv(sock: &OwnedFd, max: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; max];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer within 10 s"))
            }
            r => break r?,
        }
    };
    // Descriptors nobody should have sent are closed with `control`.
    drop(control);
    if r.bytes == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed its socket",
        ));
    }
    buf.truncate(r.bytes);
    Ok(buf)
}
