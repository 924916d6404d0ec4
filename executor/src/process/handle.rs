//! The child handle: a started child's pid and pidfd. It kills the child's
//! whole tree (process group, and the leader through its pidfd), reaps the
//! leader, and kills and reaps in the background if dropped while alive.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use tokio::io::unix::AsyncFd;

use crate::process::reaper::Reaper;
use crate::sys::{self, Started};

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
    forked: bool,
    status: Option<ExitInfo>,
    reaper: Arc<Reaper>,
}

impl Process {
    pub(super) fn new(s: Started, reaper: Arc<Reaper>) -> io::Result<Process> {
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
            forked: s.forked,
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

    /// Whether a fork server forked the child.
    pub fn forked(&self) -> bool {
        self.forked
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

    /// Kill the tree and reap the leader; once this returns every process
    /// of the tree is gone. In a PID namespace the kernel guarantees that:
    /// the init's exit status is only reported after every other process of
    /// its namespace was killed and reaped. In process-group mode, members of
    /// the group that outlived the leader are killed, and descendants that
    /// left the group (re-parented to this subreaper) are swept.
    pub async fn kill_and_reap(&mut self) -> io::Result<ExitInfo> {
        self.kill_tree();
        let s = self.wait().await?;
        if !self.pid_namespace {
            let _ = rustix::process::kill_process_group(self.pid, Signal::KILL);
            self.reaper.sweep();
        }
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
