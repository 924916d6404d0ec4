//! The only module with `unsafe`: `clone3` and `execveat`/`execve` with the child's
//! confinement applied between them (raw, async-signal-safe calls on memory
//! prepared before the clone: see `child_after_clone`), network namespaces,
//! inherited fds, the allocator's policy. It stays one file over 800 lines
//! on purpose: all the `unsafe` of the executor is audited in one place.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use rustix::process::Pid;

/// Everything needed to start one child, prepared in the parent.
pub struct ChildSpec {
    /// Absolute or cwd-relative path of the program (already resolved).
    pub program: CString,
    /// The program, open: the child executes this very descriptor
    /// (`execveat(fd, "", AT_EMPTY_PATH)`), the file its digest was read
    /// from, not whatever `program` names by then. `None`: `execve` of
    /// `program` (a `#!` script, which the kernel cannot run from a
    /// close-on-exec descriptor, and `doctor`'s probes).
    pub program_fd: Option<OwnedFd>,
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
    pub confine: ChildConfine,
}

/// What confinement the child applies to itself between clone and exec, all
/// prepared by the parent (`confine`): descriptors and a compiled BPF
/// program. An empty (`Default`) value applies nothing.
#[derive(Default)]
pub struct ChildConfine {
    /// `setsid()` instead of `setpgid(0, 0)`: a new session, no terminal.
    pub setsid: bool,
    /// `setns(fd, CLONE_NEWNET)`: the child's network namespace.
    pub netns: Option<OwnedFd>,
    /// Mount options of a private tmpfs on `/dev/shm` in a mount namespace
    /// of the child's own (`unshare(CLONE_NEWNS)`, propagation private), so
    /// POSIX semaphores and shared memory work without the host's.
    pub private_shm: Option<CString>,
    /// Landlock access rights the child grants itself on that `/dev/shm`
    /// (only it can name the new mount; 0: no rule).
    pub shm_access: u64,
    /// `cgroup.procs` files (opened for writing) the child moves itself into
    /// (cgroup v1; v2 when `clone3(CLONE_INTO_CGROUP)` is refused).
    pub cgroup_procs: Vec<OwnedFd>,
    /// A cgroup v2 directory the child is created in, with
    /// `clone3(CLONE_INTO_CGROUP)`: it never runs outside its cgroup.
    pub cgroup_dir: Option<OwnedFd>,
    /// `(resource, soft, hard)` for setrlimit.
    pub rlimits: Vec<(u32, u64, u64)>,
    /// `(uid, gid)`: drop supplementary groups, then setgid, then setuid.
    pub ids: Option<(u32, u32)>,
    pub no_new_privs: bool,
    /// A Landlock ruleset fd for `landlock_restrict_self`.
    pub landlock: Option<OwnedFd>,
    /// Classic BPF programs for `seccomp(SECCOMP_SET_MODE_FILTER)`, in order.
    pub seccomp: Vec<std::sync::Arc<Vec<seccompiler::sock_filter>>>,
}

/// `struct landlock_path_beneath_attr` (packed, as in the kernel's uapi).
#[repr(C, packed)]
struct LandlockPathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}
const LANDLOCK_ACCESS_FS_READ_FILE: u64 = 1 << 2;
const LANDLOCK_ACCESS_FS_READ_DIR: u64 = 1 << 3;

/// Most rlimits, cgroup files and seccomp programs a child applies.
const MAX_RLIMITS: usize = 8;
const MAX_CGROUPS: usize = 3;
const MAX_FILTERS: usize = 3;

/// `ChildConfine` as raw numbers and pointers, copied into the child.
#[derive(Clone, Copy)]
struct RawConfine {
    setsid: bool,
    netns: RawFd,
    /// NUL-terminated mount options, or null: no private `/dev/shm`.
    shm_data: *const libc::c_char,
    shm_access: u64,
    cgroup_procs: [RawFd; MAX_CGROUPS],
    rlimits: [(u32, u64, u64); MAX_RLIMITS],
    n_rlimits: usize,
    ids: Option<(u32, u32)>,
    no_new_privs: bool,
    landlock: RawFd,
    filters: [libc::sock_fprog; MAX_FILTERS],
    n_filters: usize,
}

impl RawConfine {
    fn from(c: &ChildConfine) -> io::Result<RawConfine> {
        let too_many = |what| io::Error::new(io::ErrorKind::InvalidInput, format!("too many {what}"));
        if c.rlimits.len() > MAX_RLIMITS {
            return Err(too_many("rlimits"));
        }
        if c.cgroup_procs.len() > MAX_CGROUPS {
            return Err(too_many("cgroups"));
        }
        if c.seccomp.len() > MAX_FILTERS {
            return Err(too_many("seccomp programs"));
        }
        let mut r = RawConfine {
            setsid: c.setsid,
            netns: c.netns.as_ref().map_or(-1, |f| f.as_raw_fd()),
            shm_data: c.private_shm.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
            shm_access: c.shm_access,
            cgroup_procs: [-1; MAX_CGROUPS],
            rlimits: [(0, 0, 0); MAX_RLIMITS],
            n_rlimits: c.rlimits.len(),
            ids: c.ids,
            no_new_privs: c.no_new_privs,
            landlock: c.landlock.as_ref().map_or(-1, |f| f.as_raw_fd()),
            filters: [libc::sock_fprog {
                len: 0,
                filter: std::ptr::null_mut(),
            }; MAX_FILTERS],
            n_filters: c.seccomp.len(),
        };
        for (i, fd) in c.cgroup_procs.iter().enumerate() {
            r.cgroup_procs[i] = fd.as_raw_fd();
        }
        for (i, l) in c.rlimits.iter().enumerate() {
            r.rlimits[i] = *l;
        }
        for (i, prog) in c.seccomp.iter().enumerate() {
            let len = u16::try_from(prog.len()).map_err(|_| too_many("BPF instructions"))?;
            r.filters[i] = libc::sock_fprog {
                len,
                // seccompiler's `sock_filter` has the kernel's layout
                // (u16 code, u8 jt, u8 jf, u32 k), as does libc's.
                filter: prog.as_ptr() as *mut libc::sock_filter,
            };
        }
        Ok(r)
    }
}

/// A started child: its pid in our namespace and a pidfd for it.
pub struct Started {
    pub pid: Pid,
    pub pidfd: OwnedFd,
    /// Whether the child is PID 1 of its own PID namespace.
    pub pid_namespace: bool,
    /// Whether a fork server forked it (rather than `exec`).
    pub forked: bool,
}

/// The `struct clone_args` of clone3(2), version 2 (88 bytes; passed as
/// version 0, 64 bytes, unless `cgroup` is used).
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
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}
const CLONE_ARGS_SIZE_VER0: usize = 64;
/// `CLONE_INTO_CGROUP` (Linux 5.7).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// How children joined their cgroup v2 so far: 0 none yet, 1 created in it
/// by `clone3(CLONE_INTO_CGROUP)`, else the errno that refused it (and the
/// child wrote `cgroup.procs` before exec instead).
static INTO_CGROUP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// How children join their cgroup v2, for `doctor` (after a child started).
pub fn clone_into_cgroup_report() -> String {
    match INTO_CGROUP.load(std::sync::atomic::Ordering::Relaxed) {
        0 => "no child started in a cgroup v2 yet".into(),
        1 => "children are created in their cgroup by clone3(CLONE_INTO_CGROUP)".into(),
        e => format!(
            "clone3(CLONE_INTO_CGROUP) refused ({}): children write cgroup.procs before exec",
            io::Error::from_raw_os_error(e)
        ),
    }
}

/// Stages reported through the error pipe when the child fails before exec.
const STAGE_DEATHSIG: u8 = 1;
const STAGE_PARENT_GONE: u8 = 2;
const STAGE_DUP: u8 = 3;
const STAGE_CHDIR: u8 = 5;
const STAGE_EXEC: u8 = 6;
const STAGE_SIGNALS: u8 = 7;
const STAGE_NETNS: u8 = 8;
const STAGE_CGROUP: u8 = 9;
const STAGE_RLIMIT: u8 = 10;
const STAGE_IDS: u8 = 11;
const STAGE_NNP: u8 = 12;
const STAGE_LANDLOCK: u8 = 13;
const STAGE_SECCOMP: u8 = 14;
const STAGE_SESSION: u8 = 15;
const STAGE_SHM: u8 = 16;

fn stage_name(stage: u8) -> &'static str {
    match stage {
        STAGE_DEATHSIG => "setting the parent-death signal",
        STAGE_PARENT_GONE => "checking the executor is alive",
        STAGE_DUP => "installing fds 0-4",
        STAGE_CHDIR => "changing to the working directory",
        STAGE_EXEC => "executing the program",
        STAGE_SIGNALS => "resetting signal state",
        STAGE_NETNS => "entering the network namespace",
        STAGE_CGROUP => "joining the cgroup",
        STAGE_RLIMIT => "setting rlimits",
        STAGE_IDS => "switching to the unprivileged uid/gid",
        STAGE_NNP => "setting no_new_privs",
        STAGE_LANDLOCK => "applying the Landlock ruleset",
        STAGE_SECCOMP => "installing the seccomp filter",
        STAGE_SESSION => "starting a new session",
        STAGE_SHM => "mounting the private /dev/shm",
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
        program_fd,
        argv,
        envp,
        cwd,
        stdin,
        stdout,
        stderr,
        ipc_in,
        ipc_out,
        pid_namespace,
        mut confine,
    } = spec;
    // Every descriptor the child uses after installing fds 0-4 must not be
    // one of 0-4 itself.
    confine.netns = confine.netns.map(high).transpose()?;
    confine.landlock = confine.landlock.map(high).transpose()?;
    confine.cgroup_procs = confine.cgroup_procs.into_iter().map(high).collect::<io::Result<_>>()?;
    confine.cgroup_dir = confine.cgroup_dir.map(high).transpose()?;
    let cgroup_dir = confine.cgroup_dir.as_ref().map_or(-1, |f| f.as_raw_fd());
    // Close-on-exec (as every descriptor above 4 is made in the child): the
    // kernel runs a binary from it all the same, and the tool never holds it.
    let program_fd = program_fd.map(high).transpose()?;
    let parent_pidfd = rustix::io::fcntl_dupfd_cloexec(parent_pidfd, 10)?;
    let parent_pidfd = &parent_pidfd;
    let raw_confine = RawConfine::from(&confine)?;
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
        program_fd: program_fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
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
        confine: raw_confine,
    };

    let mut used_ns = pid_namespace;
    let mut result = clone_child(&prepared, used_ns, cgroup_dir);
    if used_ns {
        if let Err(e) = &result {
            if matches!(
                e.raw_os_error(),
                Some(libc::EPERM) | Some(libc::EINVAL) | Some(libc::ENOSPC) | Some(libc::ENOSYS)
            ) {
                used_ns = false;
                result = clone_child(&prepared, false, cgroup_dir);
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
            forked: false,
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
    /// >= 0: execute this descriptor instead of `program`.
    program_fd: RawFd,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: Option<*const libc::c_char>,
    fds: [RawFd; 5],
    err_fd: RawFd,
    parent_pidfd: RawFd,
    parent_pid: i32,
    confine: RawConfine,
}

/// `cgroup_dir` (>= 0): a cgroup v2 directory to create the child in
/// (`CLONE_INTO_CGROUP`); if the kernel refuses, the child is created
/// outside and writes its `cgroup.procs` itself before exec.
fn clone_child(prepared: &Prepared, pid_namespace: bool, cgroup_dir: RawFd) -> io::Result<(Pid, OwnedFd)> {
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
    let into = cgroup_dir >= 0 && INTO_CGROUP.load(std::sync::atomic::Ordering::Relaxed) <= 1;
    let clone3 = |args: &CloneArgs, size: usize| {
        // SAFETY: clone3 with no stack and no CLONE_VM behaves like fork: the
        // child gets a copy of the address space and continues here with
        // return value 0. `args` and `pidfd` are valid for the call.
        unsafe { libc::syscall(libc::SYS_clone3, std::ptr::from_ref(args), size) }
    };
    let mut ret = -1;
    let mut in_cgroup = false;
    if into {
        let mut with = CloneArgs {
            flags: args.flags | CLONE_INTO_CGROUP,
            cgroup: cgroup_dir as u64,
            ..args
        };
        with.pidfd = args.pidfd;
        ret = clone3(&with, std::mem::size_of::<CloneArgs>());
        if ret == 0 {
            child_after_clone(prepared, pid_namespace, true);
        }
        if ret > 0 {
            in_cgroup = true;
            INTO_CGROUP.store(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
            // Refused as a feature (kernel < 5.7, a filter hiding it): join
            // by cgroup.procs from now on. Other errors are the clone's own.
            if matches!(errno, libc::E2BIG | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) {
                INTO_CGROUP.store(errno, std::sync::atomic::Ordering::Relaxed);
            } else {
                return Err(io::Error::from_raw_os_error(errno));
            }
        }
    }
    if !in_cgroup {
        ret = clone3(&args, CLONE_ARGS_SIZE_VER0);
    }
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) && !pid_namespace {
            // Kernels before 5.3, or seccomp profiles that hide clone3.
            return fork_child(prepared);
        }
        return Err(err);
    }
    if ret == 0 {
        child_after_clone(prepared, pid_namespace, false);
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
        child_after_clone(prepared, false, false);
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
/// `in_cgroup`: created in its cgroup v2 already (`CLONE_INTO_CGROUP`).
fn child_after_clone(p: &Prepared, pid_namespace: bool, in_cgroup: bool) -> ! {
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

        let c = &p.confine;
        // Own process group (and with confinement, own session), so group
        // kills reach every same-group descendant.
        if c.setsid {
            if libc::setsid() < 0 {
                fail(p, STAGE_SESSION);
            }
        } else {
            libc::setpgid(0, 0);
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

        // Privileged steps first, while the child still has the executor's
        // credentials.
        if c.netns >= 0 && libc::setns(c.netns, libc::CLONE_NEWNET) != 0 {
            fail(p, STAGE_NETNS);
        }
        if !c.shm_data.is_null() && !private_shm(c.shm_data) {
            fail(p, STAGE_SHM);
        }
        for &fd in &c.cgroup_procs[..] {
            // "0" moves the writer itself (cgroup v1 and v2).
            if !in_cgroup && fd >= 0 && libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                fail(p, STAGE_CGROUP);
            }
        }
        for &(resource, soft, hard) in &c.rlimits[..c.n_rlimits] {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::syscall(
                libc::SYS_prlimit64,
                0,
                resource,
                &lim as *const libc::rlimit,
                std::ptr::null_mut::<libc::rlimit>(),
            ) != 0
            {
                fail(p, STAGE_RLIMIT);
            }
        }
        if let Some((uid, gid)) = c.ids {
            // Raw system calls, not libc's wrappers: glibc's set*id
            // broadcast the change to every thread it believes exists, and
            // after a raw clone it still believes in the parent's threads
            // (it would wait for them forever).
            if libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
            {
                fail(p, STAGE_IDS);
            }
        }

        // Die with the spawner thread (and so with the executor). Armed after
        // the uid change, which clears it.
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

        if c.no_new_privs && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            fail(p, STAGE_NNP);
        }
        if c.landlock >= 0 {
            // The child's own /proc/self (only the child can name it; the
            // parent's would be its own): read-only, added to the prepared
            // ruleset just before it is enforced. Best effort: a kernel
            // without procfs here simply has no rule.
            let dir = libc::open(
                c"/proc/self".as_ptr(),
                libc::O_PATH | libc::O_CLOEXEC | libc::O_DIRECTORY,
            );
            if dir >= 0 {
                let attr = LandlockPathBeneath {
                    allowed_access: LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR,
                    parent_fd: dir,
                };
                libc::syscall(
                    libc::SYS_landlock_add_rule,
                    c.landlock,
                    1 as libc::c_int, /* LANDLOCK_RULE_PATH_BENEATH */
                    std::ptr::addr_of!(attr),
                    0u32,
                );
                libc::close(dir);
            }
            // The private /dev/shm mounted above: a new inode only this
            // process can name. Without the rule, semaphores fail (EACCES).
            if c.shm_access != 0 {
                let dir = libc::open(c"/dev/shm".as_ptr(), libc::O_PATH | libc::O_CLOEXEC | libc::O_DIRECTORY);
                if dir < 0 {
                    fail(p, STAGE_LANDLOCK);
                }
                let attr = LandlockPathBeneath {
                    allowed_access: c.shm_access,
                    parent_fd: dir,
                };
                if libc::syscall(
                    libc::SYS_landlock_add_rule,
                    c.landlock,
                    1 as libc::c_int, /* LANDLOCK_RULE_PATH_BENEATH */
                    std::ptr::addr_of!(attr),
                    0u32,
                ) != 0
                {
                    fail(p, STAGE_LANDLOCK);
                }
                libc::close(dir);
            }
            if libc::syscall(libc::SYS_landlock_restrict_self, c.landlock, 0u32) != 0 {
                fail(p, STAGE_LANDLOCK);
            }
        }
        for f in &c.filters[..c.n_filters] {
            // Last: from here on the filter applies to this process too.
            if libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0 as libc::c_uint,
                f as *const libc::sock_fprog,
            ) != 0
            {
                fail(p, STAGE_SECCOMP);
            }
        }
        if let Some(cwd) = p.cwd {
            if libc::chdir(cwd) != 0 {
                fail(p, STAGE_CHDIR);
            }
        }
        if p.program_fd >= 0 {
            // The hashed descriptor itself: no path is looked up again, so
            // a file renamed over the program since it was hashed is not
            // what runs. Landlock checks the execute right on the file's
            // own path, as for execve.
            libc::syscall(
                libc::SYS_execveat,
                p.program_fd,
                c"".as_ptr(),
                p.argv,
                p.envp,
                libc::AT_EMPTY_PATH,
            );
        } else {
            libc::execve(p.program, p.argv, p.envp);
        }
        fail(p, STAGE_EXEC)
    }
}

/// A new network namespace in which only `lo` exists and is up, and a TCP
/// listener bound to `addr` inside it. Created on a short-lived thread:
/// `unshare(CLONE_NEWNET)` moves only the calling thread, which then exits, so
/// no executor thread is ever left inside. Returns a namespace fd for
/// `setns` and the listener (which keeps working from any thread).
pub fn new_netns(addr: std::net::SocketAddrV4) -> io::Result<(OwnedFd, std::net::TcpListener)> {
    new_netns_with(addr, || Ok(())).map(|(ns, l, ())| (ns, l))
}

/// [`new_netns`], then `inside` run on the thread that is in the new
/// namespace (what it creates, it creates there; a process it spawns starts
/// there), its result returned beside.
pub fn new_netns_with<T: Send + 'static>(
    addr: std::net::SocketAddrV4,
    inside: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<(OwnedFd, std::net::TcpListener, T)> {
    std::thread::Builder::new()
        .name("loom-netns".into())
        .spawn(move || -> io::Result<(OwnedFd, std::net::TcpListener, T)> {
            // SAFETY: unshare only changes this thread's namespace membership;
            // the thread exits right after, taking nothing else with it.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            loopback_up()?;
            let listener = std::net::TcpListener::bind(addr)?;
            let extra = inside()?;
            let ns = rustix::fs::open(
                "/proc/thread-self/ns/net",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?;
            Ok((ns, listener, extra))
        })?
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

/// Moves the calling thread into a mount namespace of its own (propagation
/// private: nothing reaches the host's) and mounts a fresh tmpfs with
/// options `data` over `/dev/shm` there; it dies with the namespace. Raw
/// system calls only (the child calls it between clone and exec).
///
/// # Safety
/// `data` must point to a NUL-terminated string.
unsafe fn private_shm(data: *const libc::c_char) -> bool {
    // SAFETY: plain system calls on constant C strings and `data`.
    unsafe {
        libc::unshare(libc::CLONE_NEWNS) == 0
            && libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) == 0
            && libc::mount(
                c"tmpfs".as_ptr(),
                c"/dev/shm".as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                data.cast(),
            ) == 0
    }
}

/// Whether a child can get its private `/dev/shm`: the child's very steps,
/// tried on a short-lived thread (whose mount namespace dies with it), so a
/// host that refuses any of them (a container's seccomp or AppArmor profile
/// denying `mount`) is known before a child depends on it.
pub fn private_shm_available() -> io::Result<()> {
    std::thread::Builder::new()
        .name("loom-shm-probe".into())
        .spawn(|| -> io::Result<()> {
            // SAFETY: unshare moves only this thread (with its own fs_struct)
            // into the new namespace, where the mounts happen; the thread
            // exits right after, and the namespace with it.
            if unsafe { private_shm(c"size=1m,nr_inodes=16,mode=1777".as_ptr()) } {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        })?
        .join()
        .map_err(|_| io::Error::other("the probe thread panicked"))?
}

/// Set `IFF_UP` on `lo` in the calling thread's network namespace.
fn loopback_up() -> io::Result<()> {
    let sock = rustix::net::socket(rustix::net::AddressFamily::INET, rustix::net::SocketType::DGRAM, None)?;
    // SAFETY: `ifreq` is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write `req`, which is a
    // valid, initialised ifreq naming `lo`, on an open socket.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) != 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes every allocation of 1 MiB or more its own mapping, returned to the
/// system when freed. Answers of megabytes pass through the executor (a
/// protocol line, its parsed value, the JSON sent and kept); with glibc's
/// default, the threshold rises to the size of the largest block freed (up
/// to 32 MiB) and such blocks come from per-thread arenas, which keep the
/// memory after a free: the process grows with every large answer even
/// though it holds none. For the binary (a process-wide setting), first
/// thing in `main`.
pub fn release_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc's tuning parameters (under
    // its own lock); no memory is touched.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// The Landlock ABI version of the running kernel (0: none).
pub fn landlock_abi() -> i32 {
    // SAFETY: LANDLOCK_CREATE_RULESET_VERSION with a null attr and size 0
    // only returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32, /* LANDLOCK_CREATE_RULESET_VERSION */
        )
    };
    if v < 0 {
        0
    } else {
        v as i32
    }
}

/// Whether the kernel has seccomp (`PR_GET_SECCOMP` succeeds).
pub fn seccomp_available() -> bool {
    // SAFETY: PR_GET_SECCOMP only reads this thread's seccomp mode.
    unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) >= 0 }
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
