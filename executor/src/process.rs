//! Child processes: the long-lived spawner thread that creates them (so the
//! parent-death signal is tied to a thread that lives as long as the
//! executor), the handle that kills a child's whole tree and reaps it through
//! its pidfd, capped capture of stdout/stderr, and the scrubbed environment.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

use crate::reaper::Reaper;
use crate::sys::{self, ChildConfine, ChildSpec, Started};

type Job = (ChildSpec, tokio::sync::oneshot::Sender<io::Result<Started>>);

/// Handle to the dedicated spawner thread. Every child is created on that
/// thread; dropping the last handle ends the thread, and the kernel then
/// SIGKILLs every child it created.
#[derive(Debug)]
pub struct Spawner {
    tx: Mutex<std::sync::mpsc::Sender<Job>>,
    reaper: Arc<Reaper>,
}

impl Spawner {
    pub fn start() -> io::Result<Spawner> {
        let me = rustix::process::pidfd_open(rustix::process::getpid(), rustix::process::PidfdFlags::empty())?;
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let reaper = Reaper::new();
        let known = reaper.clone();
        std::thread::Builder::new().name("loom-spawner".into()).spawn(move || {
            for (spec, reply) in rx {
                let r = {
                    // Registered before any sweep can look at it.
                    let mut k = known.known();
                    let r = sys::start(spec, &me);
                    if let Ok(s) = &r {
                        k.insert(s.pid.as_raw_nonzero().get());
                    }
                    r
                };
                if let Err(Ok(started)) = reply.send(r) {
                    // Nobody waits for this child any more: kill and reap.
                    let _ = rustix::process::pidfd_send_signal(&started.pidfd, Signal::KILL);
                    let _ = rustix::process::waitid(WaitId::PidFd(started.pidfd.as_fd()), WaitIdOptions::EXITED);
                    known.forget(started.pid.as_raw_nonzero().get());
                }
            }
        })?;
        Ok(Spawner {
            tx: Mutex::new(tx),
            reaper,
        })
    }

    /// The registry of this spawner's children (for subreaper sweeps).
    pub fn reaper(&self) -> &Arc<Reaper> {
        &self.reaper
    }

    /// Create a child on the spawner thread.
    pub async fn spawn(&self, spec: ChildSpec) -> io::Result<Process> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        {
            let tx = self.tx.lock().map_err(|_| io::Error::other("spawner lock poisoned"))?;
            tx.send((spec, reply))
                .map_err(|_| io::Error::other("spawner thread is gone"))?;
        }
        let started = rx.await.map_err(|_| io::Error::other("spawner thread is gone"))??;
        Process::new(started, self.reaper.clone())
    }
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitInfo {
    Code(i32),
    Signal(i32),
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitInfo::Code(c) => write!(f, "exit code {c}"),
            ExitInfo::Signal(s) => write!(f, "signal {s}"),
        }
    }
}

/// A live (or not yet reaped) child. Dropping it kills its tree.
#[derive(Debug)]
pub struct Process {
    pid: Pid,
    pidfd: Option<AsyncFd<OwnedFd>>,
    pid_namespace: bool,
    status: Option<ExitInfo>,
    reaper: Arc<Reaper>,
}

impl Process {
    fn new(s: Started, reaper: Arc<Reaper>) -> io::Result<Process> {
        let pid = s.pid;
        let pidfd = match sys::async_pidfd(s.pidfd) {
            Ok(fd) => fd,
            Err(e) => {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
                let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
                reaper.forget(pid.as_raw_nonzero().get());
                return Err(e);
            }
        };
        Ok(Process {
            pid,
            pidfd: Some(pidfd),
            pid_namespace: s.pid_namespace,
            status: None,
            reaper,
        })
    }

    /// The child's pid in the executor's PID namespace.
    pub fn pid(&self) -> i32 {
        self.pid.as_raw_nonzero().get()
    }

    /// Whether the child is PID 1 of its own PID namespace.
    pub fn in_pid_namespace(&self) -> bool {
        self.pid_namespace
    }

    /// SIGKILL the whole tree: the process group, and the leader through its
    /// pidfd. In a PID namespace the leader is its init, whose death makes
    /// the kernel kill every process in the namespace. Idempotent.
    pub fn kill_tree(&self) {
        if self.status.is_some() {
            return;
        }
        let _ = rustix::process::kill_process_group(self.pid, Signal::KILL);
        if let Some(fd) = &self.pidfd {
            let _ = rustix::process::pidfd_send_signal(fd.get_ref(), Signal::KILL);
        }
    }

    fn try_reap(&mut self) -> io::Result<Option<ExitInfo>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let Some(fd) = &self.pidfd else {
            return Ok(None);
        };
        let r = rustix::process::waitid(
            WaitId::PidFd(fd.get_ref().as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
        )?;
        let Some(st) = r else { return Ok(None) };
        let info = match (st.exit_status(), st.terminating_signal()) {
            (Some(c), _) if st.exited() => ExitInfo::Code(c),
            (_, Some(s)) => ExitInfo::Signal(s),
            (Some(c), None) => ExitInfo::Code(c),
            (None, None) => return Ok(None),
        };
        self.status = Some(info);
        self.reaper.forget(self.pid());
        Ok(Some(info))
    }

    /// Wait for the leader to exit and reap it. Cancel-safe.
    pub async fn wait(&mut self) -> io::Result<ExitInfo> {
        loop {
            if let Some(s) = self.try_reap()? {
                return Ok(s);
            }
            let Some(fd) = &self.pidfd else {
                return Err(io::Error::other("child already released"));
            };
            let mut guard = fd.readable().await?;
            guard.clear_ready();
        }
    }

    /// Kill the tree and reap the leader. With a PID namespace, once this
    /// returns every process of the tree is gone.
    pub async fn kill_and_reap(&mut self) -> io::Result<ExitInfo> {
        self.kill_tree();
        let s = self.wait().await?;
        // Members of the group that outlived the leader (process-group mode),
        // and descendants that left the group and were re-parented to us.
        let _ = rustix::process::kill_process_group(self.pid, Signal::KILL);
        self.reaper.sweep();
        Ok(s)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        self.kill_tree();
        if matches!(self.try_reap(), Ok(Some(_))) {
            return;
        }
        // Reap in the background so the killed child leaves no zombie.
        let Some(fd) = self.pidfd.take() else { return };
        let reaper = self.reaper.clone();
        let pid = self.pid();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = fd.readable().await;
                let _ = rustix::process::waitid(WaitId::PidFd(fd.get_ref().as_fd()), WaitIdOptions::EXITED);
                reaper.forget(pid);
            });
        } else {
            let _ = rustix::process::waitid(WaitId::PidFd(fd.get_ref().as_fd()), WaitIdOptions::EXITED);
            reaper.forget(pid);
        }
    }
}

/// Bytes kept from one output stream: the first `head_cap` and the last
/// `tail_cap` bytes, with the total seen.
#[derive(Debug, Default)]
pub struct Captured {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total: u64,
}

impl Captured {
    pub fn new(head_cap: usize, tail_cap: usize) -> Self {
        Captured {
            head_cap,
            tail_cap,
            ..Default::default()
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if self.tail_cap == 0 {
            return;
        }
        if data.len() >= self.tail_cap {
            data = &data[data.len() - self.tail_cap..];
            self.tail.clear();
        }
        let excess = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..excess);
        self.tail.extend(data);
    }

    /// The head as text (lossy), marked if the stream was longer.
    pub fn head_text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        let shown = self.head.len() as u64 + self.tail.len() as u64;
        if self.total > shown && self.tail_cap == 0 {
            s.push_str(&format!("\n[… {} more bytes not kept]", self.total - shown));
        }
        s
    }

    /// The last bytes as text (lossy), marked if earlier bytes were dropped.
    pub fn tail_text(&self) -> String {
        if self.head_cap > 0 && self.tail.is_empty() {
            return String::from_utf8_lossy(&self.head).into_owned();
        }
        let bytes: Vec<u8> = self.tail.iter().copied().collect();
        let s = String::from_utf8_lossy(&bytes).into_owned();
        if self.total > bytes.len() as u64 {
            format!("[… {} earlier bytes not kept]\n{s}", self.total - bytes.len() as u64)
        } else {
            s
        }
    }
}

/// A stream being captured by a background task.
#[derive(Debug)]
pub struct Capture {
    buf: Arc<Mutex<Captured>>,
    task: tokio::task::JoinHandle<()>,
}

impl Capture {
    /// Start reading `rx` into a buffer keeping `head`/`tail` bytes.
    pub fn start(rx: pipe::Receiver, head: usize, tail: usize) -> Capture {
        let buf = Arc::new(Mutex::new(Captured::new(head, tail)));
        let b = buf.clone();
        let task = tokio::spawn(async move {
            let mut rx = rx;
            let mut chunk = vec![0u8; 16 * 1024];
            loop {
                match rx.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Ok(mut g) = b.lock() {
                            g.push(&chunk[..n]);
                        }
                    }
                }
            }
        });
        Capture { buf, task }
    }

    /// Wait up to `grace` for the writer side to close (every holder of the
    /// pipe dead), then stop reading and return what was kept. The grace only
    /// matters when a descendant escaped the kill and still holds the pipe.
    pub async fn finish(self, grace: std::time::Duration) -> Captured {
        let mut task = self.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
        }
        match self.buf.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(_) => Captured::default(),
        }
    }
}

/// A pipe whose read end the executor keeps (non-blocking, async) and whose
/// write end goes to the child.
pub fn child_to_parent() -> io::Result<(pipe::Receiver, OwnedFd)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let rx = pipe::Receiver::from_owned_fd(r)?;
    Ok((rx, w))
}

/// A pipe whose write end the executor keeps and whose read end goes to the child.
pub fn parent_to_child() -> io::Result<(OwnedFd, pipe::Sender)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let tx = pipe::Sender::from_owned_fd(w)?;
    Ok((r, tx))
}

/// `/dev/null` for a child's stdin.
pub fn dev_null() -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?)
}

/// The whole environment of a child: nothing is inherited from the executor.
pub fn child_env(
    proxy_url: &str,
    tmpdir: &Path,
    path: &str,
    lang: &str,
    extra: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for k in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        env.push((k.to_string(), proxy_url.to_string()));
    }
    env.push(("NO_PROXY".into(), String::new()));
    env.push(("no_proxy".into(), String::new()));
    // Node >= 24 honours the proxy variables in fetch/http only with this.
    env.push(("NODE_USE_ENV_PROXY".into(), "1".into()));
    env.push((
        crate::protocol::IPC_FDS_VAR.into(),
        crate::protocol::IPC_FDS_VALUE.into(),
    ));
    env.push(("TMPDIR".into(), tmpdir.display().to_string()));
    env.push(("PATH".into(), path.to_string()));
    env.push(("LANG".into(), lang.to_string()));
    for (k, v) in extra {
        env.push((k.clone(), v.clone()));
    }
    env
}

/// Find `program` the way execvp would, but on the child's `PATH`, not ours.
pub fn resolve_program(program: &str, path: &str, cwd: &Path) -> io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        let p = Path::new(program);
        return Ok(if p.is_relative() { cwd.join(p) } else { p.to_path_buf() });
    }
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        let candidate = if candidate.is_relative() {
            cwd.join(candidate)
        } else {
            candidate
        };
        if let Ok(m) = std::fs::metadata(&candidate) {
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                return Ok(candidate);
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("`{program}` not found on PATH {path}"),
    ))
}

fn cstring(s: &[u8], what: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{what} contains a NUL byte")))
}

/// The parent's ends of a freshly started child.
#[derive(Debug)]
pub struct Launched {
    pub process: Process,
    /// The protocol pipes (absent in plain mode).
    pub ipc: Option<(pipe::Sender, pipe::Receiver)>,
    pub stdin: Option<pipe::Sender>,
    pub stdout: Capture,
    pub stderr: Capture,
}

/// What to launch.
pub struct Launch<'a> {
    pub command: &'a [String],
    pub cwd: &'a Path,
    pub env: Vec<(String, String)>,
    pub path: &'a str,
    /// Plain mode: input on a stdin pipe, `/dev/null` on fds 3 and 4.
    pub plain: bool,
    pub pid_namespace: bool,
    /// Confinement the child applies to itself (prepared by `confine`).
    pub confine: ChildConfine,
    pub stdout_cap: usize,
    pub stderr_cap: usize,
}

/// Start a child with fds 0-4 wired and its output captured.
pub async fn launch(spawner: &Spawner, l: Launch<'_>) -> io::Result<Launched> {
    let program_name = l
        .command
        .first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty command"))?;
    let program = resolve_program(program_name, l.path, l.cwd)?;
    let argv = l
        .command
        .iter()
        .map(|a| cstring(a.as_bytes(), "an argument"))
        .collect::<io::Result<Vec<_>>>()?;
    let envp = l
        .env
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}").as_bytes(), "an environment variable"))
        .collect::<io::Result<Vec<_>>>()?;
    let (ipc_in, ipc_out, ipc) = if l.plain {
        (dev_null()?, dev_null()?, None)
    } else {
        let (ipc_in, ipc_tx) = parent_to_child()?;
        let (ipc_rx, ipc_out) = child_to_parent()?;
        (ipc_in, ipc_out, Some((ipc_tx, ipc_rx)))
    };
    let (out_rx, out_w) = child_to_parent()?;
    let (err_rx, err_w) = child_to_parent()?;
    let (stdin, stdin_tx) = if l.plain {
        let (r, tx) = parent_to_child()?;
        (r, Some(tx))
    } else {
        (dev_null()?, None)
    };
    let spec = ChildSpec {
        program: cstring(program.as_os_str().as_bytes(), "the program path")?,
        argv,
        envp,
        cwd: Some(cstring(l.cwd.as_os_str().as_bytes(), "the working directory")?),
        stdin,
        stdout: out_w,
        stderr: err_w,
        ipc_in,
        ipc_out,
        pid_namespace: l.pid_namespace,
        confine: l.confine,
    };
    let process = spawner.spawn(spec).await?;
    if l.pid_namespace && !process.in_pid_namespace() {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "cannot create PID namespaces here (needs root or CAP_SYS_ADMIN): children run in \
                 process groups (escapees are swept only by the subreaper of the binary), and \
                 grandchildren can outlive the executor's death; see docs/executor.md"
            );
        }
    }
    Ok(Launched {
        process,
        ipc,
        stdin: stdin_tx,
        stdout: Capture::start(out_rx, l.stdout_cap, 0),
        stderr: Capture::start(err_rx, 0, l.stderr_cap),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_keeps_head_and_tail() {
        let mut c = Captured::new(4, 0);
        c.push(b"abcdefgh");
        assert_eq!(c.head_text(), "abcd\n[… 4 more bytes not kept]");
        let mut t = Captured::new(0, 4);
        t.push(b"abc");
        t.push(b"defgh");
        assert_eq!(t.tail_text(), "[… 4 earlier bytes not kept]\nefgh");
        let mut s = Captured::new(0, 10);
        s.push(b"short");
        assert_eq!(s.tail_text(), "short");
    }

    #[test]
    fn env_is_exactly_the_listed_keys() {
        let mut extra = BTreeMap::new();
        extra.insert("TOOL_MODE".to_string(), "x".to_string());
        let env = child_env("http://r:s@127.0.0.1:3128", Path::new("/tmp/s"), "/bin", "C", &extra);
        let keys: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "HTTP_PROXY",
                "HTTPS_PROXY",
                "ALL_PROXY",
                "http_proxy",
                "https_proxy",
                "all_proxy",
                "NO_PROXY",
                "no_proxy",
                "NODE_USE_ENV_PROXY",
                "LOOM_IPC_FDS",
                "TMPDIR",
                "PATH",
                "LANG",
                "TOOL_MODE"
            ]
        );
    }

    #[test]
    fn resolves_on_the_childs_path() {
        let p = resolve_program("sh", "/nonexistent:/bin:/usr/bin", Path::new("/")).unwrap();
        assert!(p.ends_with("sh"));
        assert!(resolve_program("sh", "/nonexistent", Path::new("/")).is_err());
        assert_eq!(
            resolve_program("./t.py", "", Path::new("/srv")).unwrap(),
            PathBuf::from("/srv/./t.py")
        );
    }
}
