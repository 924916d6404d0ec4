//! Catching descendants that escaped their process group. With
//! `PR_SET_CHILD_SUBREAPER` set on the executor, an orphaned descendant of a
//! child is re-parented to the executor; any child the spawner did not create
//! is such an escapee, and a sweep SIGKILLs and reaps it. Only the binary
//! enables this (a library host may have children of its own).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::process::{Pid, Signal, WaitOptions};

use crate::confine::transparent;

/// Pids of the children the spawner created and has not reaped yet, and
/// whether this process is a subreaper.
#[derive(Debug, Default)]
pub struct Reaper {
    known: Mutex<HashSet<i32>>,
    enabled: AtomicBool,
}

impl Reaper {
    pub fn new() -> Arc<Reaper> {
        Arc::new(Reaper::default())
    }

    /// Lock the set of known children (held by the spawner across a clone,
    /// so a sweep never sees a child that is not registered yet).
    pub fn known(&self) -> MutexGuard<'_, HashSet<i32>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forget a child once it has been reaped.
    pub fn forget(&self, pid: i32) {
        self.known().remove(&pid);
    }

    /// Become the subreaper of every descendant. Process-wide: only for a
    /// process whose children all come from the spawner (the binary).
    pub fn enable(&self) -> std::io::Result<()> {
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
        self.enabled.store(true, Ordering::Release);
        Ok(())
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// SIGKILL every child of this process the spawner did not create, and
    /// reap those already dead. Returns how many were found.
    pub fn sweep(&self) -> usize {
        if !self.enabled() {
            return 0;
        }
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let known = self.known();
        let helpers = transparent::helpers();
        let mut found = 0;
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return 0;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let helper = helpers.as_ref().is_some_and(|h| h.contains(&pid));
            if known.contains(&pid) || helper || parent_of(pid) != Some(me) {
                continue;
            }
            let Some(p) = Pid::from_raw(pid) else { continue };
            found += 1;
            let _ = rustix::process::kill_process(p, Signal::KILL);
            let _ = rustix::process::waitpid(Some(p), WaitOptions::NOHANG);
        }
        if found > 0 {
            tracing::warn!(count = found, "killed descendants that escaped their process group");
        }
        found
    }
}

/// The parent pid from `/proc/<pid>/stat` (the field after the `(comm)`).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_parent_of_this_process() {
        let me = std::process::id() as i32;
        let parent = parent_of(me).unwrap();
        assert_eq!(
            parent,
            rustix::process::getppid()
                .map(|p| p.as_raw_nonzero().get())
                .unwrap_or(0)
        );
    }

    #[test]
    fn disabled_sweep_does_nothing() {
        assert_eq!(Reaper::new().sweep(), 0);
    }
}
