//! The launch stage: everything a child gets at exec — its whole environment
//! (nothing inherited from the executor), its program found on its own
//! `PATH` (or the descriptor `identity` hashed it from), fds 0-4 wired to
//! pipes or `/dev/null` — handed to the spawner; the parent keeps its ends
//! and starts capturing output.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use tokio::net::unix::pipe;

use egress_tool::protocol::{IPC_FDS_VALUE, IPC_FDS_VAR};

use super::identity::Opened;
use super::{Capture, ForkServer, Process, Spawner};
use crate::sys::{ChildConfine, ChildSpec};

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

/// The executor's own variables: the proxy's `env` may not set them.
const OWN_ENV: [&str; 4] = [IPC_FDS_VAR, "TMPDIR", "PATH", "LANG"];

/// The whole environment of a child: nothing is inherited from the executor.
/// `egress` is what the proxy gave the run (proxy variables, credential
/// placeholders), passed on as it is.
pub fn child_env(
    egress: &BTreeMap<String, String>,
    tmpdir: &Path,
    path: &str,
    lang: &str,
    extra: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = egress
        .iter()
        .filter(|(k, _)| !OWN_ENV.contains(&k.as_str()) && !extra.contains_key(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.push((IPC_FDS_VAR.into(), IPC_FDS_VALUE.into()));
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

/// A command as `execve` takes it: its program found on the child's `PATH`,
/// its arguments, its whole environment and its working directory.
pub(super) struct ExecArgs {
    pub program: CString,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    pub cwd: CString,
}

/// `program`: the program already found (and opened by `identity`);
/// `None`: found here on the child's `path`.
pub(super) fn exec_args(
    command: &[String],
    env: &[(String, String)],
    path: &str,
    cwd: &Path,
    program: Option<&Path>,
) -> io::Result<ExecArgs> {
    let program_name = command
        .first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty command"))?;
    let program = match program {
        Some(p) => p.to_path_buf(),
        None => resolve_program(program_name, path, cwd)?,
    };
    Ok(ExecArgs {
        program: cstring(program.as_os_str().as_bytes(), "the program path")?,
        argv: command
            .iter()
            .map(|a| cstring(a.as_bytes(), "an argument"))
            .collect::<io::Result<_>>()?,
        envp: env
            .iter()
            .map(|(k, v)| cstring(format!("{k}={v}").as_bytes(), "an environment variable"))
            .collect::<io::Result<_>>()?,
        cwd: cstring(cwd.as_os_str().as_bytes(), "the working directory")?,
    })
}

/// The parent's ends of a freshly started child.
#[derive(Debug)]
pub struct Launched {
    pub process: Process,
    /// The protocol pipes (absent in plain mode).
    pub ipc: Option<(pipe::Sender, pipe::Receiver)>,
    pub stdin: Option<pipe::Sender>,
    /// Its stdout captured, or, for a conversation on stdio
    /// ([`Launch::conversation`]), not captured: read by the caller.
    pub stdout: Result<Capture, pipe::Receiver>,
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
    /// With `plain`: stdout is the child's side of a conversation (an MCP
    /// server's JSON-RPC), handed to the caller instead of captured.
    pub conversation: bool,
    pub pid_namespace: bool,
    /// Confinement the child applies to itself (prepared by `confine`).
    pub confine: ChildConfine,
    pub stdout_cap: usize,
    pub stderr_cap: usize,
    /// The tool's fork server, if it has one.
    pub fork: Option<&'a ForkServer>,
    /// The program opened and what the child runs hashed
    /// ([`super::identity::Hasher::open`]): the child executes that
    /// descriptor. `None`: the program found on `path` and run by path
    /// (`doctor`'s probes).
    pub exe: Option<Opened>,
}

/// Start a child with fds 0-4 wired and its output captured.
pub async fn launch(spawner: &Spawner, l: Launch<'_>) -> io::Result<Launched> {
    let program = l.exe.as_ref().map(|e| &e.program);
    let exec = exec_args(l.command, &l.env, l.path, l.cwd, program.map(|p| p.path.as_path()))?;
    let program_fd = match program {
        Some(p) if !p.script => Some(p.fd.try_clone()?),
        _ => None,
    };
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
        program: exec.program,
        program_fd,
        argv: exec.argv,
        envp: exec.envp,
        cwd: Some(exec.cwd),
        stdin,
        stdout: out_w,
        stderr: err_w,
        ipc_in,
        ipc_out,
        pid_namespace: l.pid_namespace,
        confine: l.confine,
    };
    let link = match l.fork {
        // Forked only from a server that runs what this child would run.
        Some(server) => server
            .link(spawner)
            .await
            .filter(|link| l.exe.as_ref().is_none_or(|e| link.runs(&e.identity))),
        None => None,
    };
    let mut process = spawner.spawn(spec, link).await?;
    if let (Some(exe), false) = (&l.exe, process.forked()) {
        if let Err(e) = unchanged(exe).await {
            let _ = process.kill_and_reap().await;
            return Err(e);
        }
    }
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
        stdout: if l.conversation {
            Err(out_rx)
        } else {
            Ok(Capture::start(out_rx, l.stdout_cap, 0))
        },
        stderr: Capture::start(err_rx, 0, l.stderr_cap),
    })
}

/// The program the child now runs (by its descriptor) is what was hashed.
/// Its stamp is compared first: unchanged, and settled when it was hashed
/// (not racy), nothing was written to it between the hash and the exec.
/// Changed (a write in place, or only its link count: renamed over,
/// removed), or racy, it is read again from the descriptor, which no one
/// can write to any more while the child runs it (the kernel refuses:
/// `ETXTBSY`), and must hash the same.
async fn unchanged(exe: &Opened) -> io::Result<()> {
    let p = &exe.program;
    if p.script {
        return Ok(());
    }
    let now = super::identity::Stamp::of(&std::fs::File::from(p.fd.try_clone()?).metadata()?);
    if now == p.stamp && !p.racy {
        return Ok(());
    }
    let fd = p.fd.try_clone()?;
    let digest = tokio::task::spawn_blocking(move || super::identity::digest_fd(&fd))
        .await
        .map_err(io::Error::other)??;
    if digest == exe.identity.program.sha256 {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "`{}` was written to after it was hashed (sha256 {}), before the child ran it (sha256 {digest}): \
             not run; the next start hashes it again",
            p.path.display(),
            exe.identity.program.sha256
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_is_exactly_the_listed_keys() {
        let mut extra = BTreeMap::new();
        extra.insert("TOOL_MODE".to_string(), "x".to_string());
        let mut egress = egress_api::proxy_env("http://r:s@127.0.0.1:3128");
        egress.insert("API_TOKEN".into(), "loom-cred-0".into());
        egress.insert("PATH".into(), "/proxy/may/not/set/this".into());
        let env = child_env(&egress, Path::new("/tmp/s"), "/bin", "C", &extra);
        let keys: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "ALL_PROXY",
                "API_TOKEN",
                "HTTPS_PROXY",
                "HTTP_PROXY",
                "LOOM_SOCKS_PROXY",
                "NODE_USE_ENV_PROXY",
                "NO_PROXY",
                "all_proxy",
                "http_proxy",
                "https_proxy",
                "no_proxy",
                "LOOM_IPC_FDS",
                "TMPDIR",
                "PATH",
                "LANG",
                "TOOL_MODE"
            ]
        );
        assert!(env.contains(&("PATH".into(), "/bin".into())));
    }

    /// A scratch directory holding `prog`, a copy of `from` (mode 0755).
    fn program_copy(tag: &str, from: &str) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("loom-launch-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prog = dir.join("prog");
        std::fs::copy(from, &prog).unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        (dir, prog)
    }

    fn plain<'a>(command: &'a [String], dir: &'a Path, exe: Option<Opened>) -> Launch<'a> {
        Launch {
            command,
            cwd: dir,
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            path: "/usr/bin:/bin",
            plain: true,
            conversation: false,
            pid_namespace: false,
            confine: Default::default(),
            stdout_cap: 0,
            stderr_cap: 0,
            fork: None,
            exe,
        }
    }

    async fn exit_of(spawner: &Spawner, l: Launch<'_>) -> io::Result<super::super::ExitInfo> {
        launch(spawner, l).await?.process.wait().await
    }

    /// The child executes the very descriptor its program was hashed from:
    /// a program replaced by rename after the hash (`true` by `false`) still
    /// runs as hashed; by path, the same command runs the replacement.
    #[tokio::test]
    async fn the_hashed_descriptor_is_what_runs() {
        use super::super::ExitInfo;
        let (dir, prog) = program_copy("fd", "/bin/true");
        let command = ["./prog".to_string()];
        let exe = super::super::identity::Hasher::new()
            .open(&command, "/usr/bin:/bin", &dir)
            .unwrap();
        assert!(!exe.program.script);
        assert_eq!(exe.identity.program.path, prog);
        let replacement = dir.join("new");
        std::fs::copy("/bin/false", &replacement).unwrap();
        std::fs::rename(&replacement, &prog).unwrap();
        let spawner = Spawner::start().unwrap();
        let hashed = exit_of(&spawner, plain(&command, &dir, Some(exe))).await.unwrap();
        assert_eq!(hashed, ExitInfo::Code(0), "the program as hashed (true) runs");
        let by_path = exit_of(&spawner, plain(&command, &dir, None)).await.unwrap();
        assert_eq!(by_path, ExitInfo::Code(1), "by path, the replacement (false) runs");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A program written in place between its hash and its exec is the
    /// same descriptor but not the hashed content: the child is killed and
    /// the start fails, saying so. (Renamed over, as above, its stamp
    /// changes too, but its content does not: it runs.)
    #[tokio::test]
    async fn a_program_written_after_its_hash_does_not_run() {
        use std::io::Write as _;
        let (dir, prog) = program_copy("write", "/bin/true");
        let command = ["./prog".to_string()];
        let exe = super::super::identity::Hasher::new()
            .open(&command, "/usr/bin:/bin", &dir)
            .unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&prog)
            .unwrap()
            .write_all(b"\0")
            .unwrap();
        let spawner = Spawner::start().unwrap();
        let e = launch(&spawner, plain(&command, &dir, Some(exe))).await.unwrap_err();
        assert!(e.to_string().contains("was written to after it was hashed"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A program changed just before its hash (racy) is read again after
    /// the exec even with its stamp unchanged: a write in the same
    /// timestamp tick can leave the stamp as it was. (Simulated: the digest
    /// the start would send is not the file's.) Settled, an unchanged
    /// stamp is enough.
    #[tokio::test]
    async fn a_racy_program_is_read_again_after_its_exec() {
        let (dir, _) = program_copy("racy", "/bin/true");
        let command = ["./prog".to_string()];
        let spawner = Spawner::start().unwrap();
        for racy in [true, false] {
            let mut exe = super::super::identity::Hasher::new()
                .open(&command, "/usr/bin:/bin", &dir)
                .unwrap();
            assert!(exe.program.racy, "just copied");
            exe.program.racy = racy;
            exe.identity.program.sha256 = "0".repeat(64);
            let started = launch(&spawner, plain(&command, &dir, Some(exe))).await;
            assert_eq!(started.is_err(), racy, "racy = {racy}: {started:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `#!` program runs (by path: the kernel cannot hand its interpreter
    /// a close-on-exec descriptor), its interpreter hashed beside it.
    #[tokio::test]
    async fn a_script_program_runs_by_path() {
        use super::super::ExitInfo;
        use std::os::unix::fs::PermissionsExt;
        let (dir, prog) = program_copy("script", "/bin/true");
        std::fs::write(&prog, "#!/bin/sh\nexit 3\n").unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let command = ["./prog".to_string()];
        let exe = super::super::identity::Hasher::new()
            .open(&command, "/usr/bin:/bin", &dir)
            .unwrap();
        assert!(exe.program.script);
        assert_eq!(exe.identity.others[0].path, PathBuf::from("/bin/sh"));
        let spawner = Spawner::start().unwrap();
        let exit = exit_of(&spawner, plain(&command, &dir, Some(exe))).await.unwrap();
        assert_eq!(exit, ExitInfo::Code(3));
        std::fs::remove_dir_all(&dir).unwrap();
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
