//! The only module with `unsafe`: creating a child with `clone3` and turning it
//! into the tool with `execve`, and adopting inherited file descriptors.
//! Everything the child does between clone and exec is a raw, async-signal-safe
//! system call on memory prepared before the clone; see `child_after_clone`.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use rustix::process::Pid;

use crate::confine::Confinement;

/// Everything needed to start one child, prepared in the parent.
pub struct ChildSpec {
    /// Absolute or cwd-relative path of the program (already resolved).
    pub program: CString,
    pub argv: Vec<CString>,
    /// `KEY=value` strings: the child's whole environment.
    pub envp: Vec<CString>,
    pub cwd: Option<CString>,
    /// Child ends, installed as fds 0, 1, 2, 3, 4 in the child.
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    pub ipc_in: OwnedFd,
    pub ipc_out: OwnedFd,
    /// Try to give the child its own PID namespace (needs CAP_SYS_ADMIN).
    pub pid_namespace: bool,
    pub confinement: Confinement,
}

/// A started child: its pid in our namespace and a pidfd for it.
pub struct Started {
    pub pid: Pid,
    pub pidfd: OwnedFd,
    /// Whether the child is PID 1 of its own PID namespace.
    pub pid_namespace: bool,
}

/// The `struct clone_args` of clone3(2), version 0 (64 bytes).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
}

/// Stages reported through the error pipe when the child fails before exec.
const STAGE_DEATHSIG: u8 = 1;
const STAGE_PARENT_GONE: u8 = 2;
const STAGE_DUP: u8 = 3;
const STAGE_CONFINE: u8 = 4;
const STAGE_CHDIR: u8 = 5;
const STAGE_EXEC: u8 = 6;
const STAGE_SIGNALS: u8 = 7;

fn stage_name(stage: u8) -> &'static str {
    match stage {
        STAGE_DEATHSIG => "setting the parent-death signal",
        STAGE_PARENT_GONE => "checking the executor is alive",
        STAGE_DUP => "installing fds 0-4",
        STAGE_CONFINE => "applying confinement",
        STAGE_CHDIR => "changing to the working directory",
        STAGE_EXEC => "executing the program",
        STAGE_SIGNALS => "resetting signal state",
        _ => "starting the child",
    }
}

/// Move `fd` to a number >= 10 so that installing fds 0..=4 in the child can
/// never overwrite a source before it is copied.
fn high(fd: OwnedFd) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(&fd, 10)?)
}

/// Start a child. Must be called from the long-lived spawner thread: the
/// parent-death signal fires when the *thread* that created the child exits.
/// `parent_pidfd` is a pidfd of this process, polled by the child to close the
/// race where the executor dies before the death signal is armed.
pub fn start(spec: ChildSpec, parent_pidfd: &OwnedFd) -> io::Result<Started> {
    let ChildSpec {
        program,
        argv,
        envp,
        cwd,
        stdin,
        stdout,
        stderr,
        ipc_in,
        ipc_out,
        pid_namespace,
        confinement,
    } = spec;
    let fds = [
        high(stdin)?,
        high(stdout)?,
        high(stderr)?,
        high(ipc_in)?,
        high(ipc_out)?,
    ];
    let (err_read, err_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let err_write = high(err_write)?;

    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());

    let prepared = Prepared {
        program: program.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        cwd: cwd.as_ref().map(|c| c.as_ptr()),
        fds: [
            fds[0].as_raw_fd(),
            fds[1].as_raw_fd(),
            fds[2].as_raw_fd(),
            fds[3].as_raw_fd(),
            fds[4].as_raw_fd(),
        ],
        err_fd: err_write.as_raw_fd(),
        parent_pidfd: parent_pidfd.as_raw_fd(),
        parent_pid: rustix::process::getpid().as_raw_nonzero().get(),
        confinement,
    };

    let mut used_ns = pid_namespace;
    let mut result = clone_child(&prepared, used_ns);
    if used_ns {
        if let Err(e) = &result {
            if matches!(
                e.raw_os_error(),
                Some(libc::EPERM) | Some(libc::EINVAL) | Some(libc::ENOSPC) | Some(libc::ENOSYS)
            ) {
                used_ns = false;
                result = clone_child(&prepared, false);
            }
        }
    }
    let (pid, pidfd) = result?;
    // The parent's copies of the child ends must close so EOFs propagate.
    drop(fds);
    drop(err_write);

    // A successful exec closes the CLOEXEC error pipe: read returns 0.
    let mut report = [0u8; 5];
    let mut got = 0;
    loop {
        match rustix::io::read(&err_read, &mut report[got..]) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if got == report.len() {
                    break;
                }
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                // Cannot tell whether exec succeeded: do not keep the child.
                let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
                let _ = rustix::process::waitid(
                    rustix::process::WaitId::PidFd(std::os::fd::AsFd::as_fd(&pidfd)),
                    rustix::process::WaitIdOptions::EXITED,
                );
                return Err(e.into());
            }
        }
    }
    if got == 0 {
        return Ok(Started {
            pid,
            pidfd,
            pid_namespace: used_ns,
        });
    }
    // The child failed before exec and is exiting; reap it so it leaves no zombie.
    let _ = rustix::process::waitid(
        rustix::process::WaitId::PidFd(std::os::fd::AsFd::as_fd(&pidfd)),
        rustix::process::WaitIdOptions::EXITED,
    );
    let errno = if got == report.len() {
        i32::from_ne_bytes([report[1], report[2], report[3], report[4]])
    } else {
        0
    };
    let os = io::Error::from_raw_os_error(errno);
    Err(io::Error::new(os.kind(), format!("{}: {}", stage_name(report[0]), os)))
}

/// Raw pointers and numbers the child uses; all memory is owned by `start`.
struct Prepared {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: Option<*const libc::c_char>,
    fds: [RawFd; 5],
    err_fd: RawFd,
    parent_pidfd: RawFd,
    parent_pid: i32,
    confinement: Confinement,
}

fn clone_child(prepared: &Prepared, pid_namespace: bool) -> io::Result<(Pid, OwnedFd)> {
    let mut pidfd: libc::c_int = -1;
    let mut args = CloneArgs {
        flags: libc::CLONE_PIDFD as u64,
        pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..CloneArgs::default()
    };
    if pid_namespace {
        args.flags |= libc::CLONE_NEWPID as u64;
    }
    // SAFETY: clone3 with no stack and no CLONE_VM behaves like fork: the child
    // gets a copy of the address space and continues here with return value 0.
    // `args` and `pidfd` are valid for the duration of the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::addr_of!(args),
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) && !pid_namespace {
            // Kernels before 5.3, or seccomp profiles that hide clone3.
            return fork_child(prepared);
        }
        return Err(err);
    }
    if ret == 0 {
        child_after_clone(prepared, pid_namespace);
    }
    let pid = Pid::from_raw(ret as i32).ok_or_else(|| io::Error::other("clone3 returned pid 0"))?;
    // SAFETY: the kernel stored a fresh pidfd owned by nobody else in `pidfd`.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok((pid, pidfd))
}

/// Fallback without clone3: plain fork, then a pidfd for the child (race-free:
/// the child cannot be reaped, so its pid cannot be reused, before we open it).
fn fork_child(prepared: &Prepared) -> io::Result<(Pid, OwnedFd)> {
    // SAFETY: the child only runs `child_after_clone`, which makes nothing but
    // async-signal-safe system calls before exec or _exit.
    let ret = unsafe { libc::fork() };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    if ret == 0 {
        child_after_clone(prepared, false);
    }
    let pid = Pid::from_raw(ret).ok_or_else(|| io::Error::other("fork returned pid 0"))?;
    match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok((pid, fd)),
        Err(e) => {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
            Err(e.into())
        }
    }
}

/// Report `stage` and errno through the error pipe and exit. Never returns.
fn fail(p: &Prepared, stage: u8) -> ! {
    // SAFETY: errno location, write(2) and _exit(2) are async-signal-safe; the
    // buffer is on this stack.
    unsafe {
        let errno = *libc::__errno_location();
        let e = errno.to_ne_bytes();
        let buf = [stage, e[0], e[1], e[2], e[3]];
        libc::write(p.err_fd, buf.as_ptr().cast(), buf.len());
        libc::_exit(127)
    }
}

/// Runs in the child between clone and exec. Only raw system calls: no
/// allocation, no locks, no Rust runtime facilities.
fn child_after_clone(p: &Prepared, pid_namespace: bool) -> ! {
    // SAFETY: every call below is a plain async-signal-safe system call on
    // memory and descriptors prepared by the parent before clone.
    unsafe {
        // Signals: Rust ignores SIGPIPE and a runtime may block signals; the
        // tool starts with default dispositions and an empty mask.
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        if libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) != 0 {
            fail(p, STAGE_SIGNALS);
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);

        // Own process group, so group kills reach every same-group descendant.
        libc::setpgid(0, 0);

        // Die with the spawner thread (and so with the executor).
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            fail(p, STAGE_DEATHSIG);
        }
        // The executor may have died before the signal was armed: a pidfd of
        // it is readable once it has exited. Outside a PID namespace also
        // compare getppid() (inside one it is always 0).
        let mut pfd = libc::pollfd {
            fd: p.parent_pidfd,
            events: libc::POLLIN,
            revents: 0,
        };
        let n = libc::poll(&mut pfd, 1, 0);
        if n != 0 || (!pid_namespace && libc::getppid() != p.parent_pid) {
            fail(p, STAGE_PARENT_GONE);
        }

        for (target, &src) in p.fds.iter().enumerate() {
            if libc::dup2(src, target as libc::c_int) < 0 {
                fail(p, STAGE_DUP);
            }
        }
        // Nothing but fds 0-4 survives exec (everything else becomes CLOEXEC).
        libc::syscall(
            libc::SYS_close_range,
            5 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
        );

        if p.confinement.apply_in_child().is_err() {
            fail(p, STAGE_CONFINE);
        }
        if let Some(cwd) = p.cwd {
            if libc::chdir(cwd) != 0 {
                fail(p, STAGE_CHDIR);
            }
        }
        libc::execve(p.program, p.argv, p.envp);
        fail(p, STAGE_EXEC)
    }
}

/// Take ownership of a descriptor inherited from the parent (the tool side of
/// the protocol: fds 3 and 4). Fails if `fd` is not open.
pub fn adopt_inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 3 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to adopt stdio"));
    }
    // SAFETY: fcntl(F_GETFD) only inspects the descriptor table.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor is open (checked above) and, by the protocol's
    // contract, inherited for this purpose and owned by no other object; the
    // caller adopts each announced descriptor once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Register a pidfd with the tokio reactor (readable once the child exits).
pub fn async_pidfd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: `OwnedFd` owns an open descriptor, keeps it open until the
    // AsyncFd drops it, and `as_raw_fd` always returns that same number.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
            .map_err(|e| io::Error::other(e.to_string()))
    }
}
