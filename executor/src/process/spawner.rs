//! The spawner stage: one long-lived thread creates every child, so the
//! parent-death signal (`PR_SET_PDEATHSIG`, tied to the creating *thread*)
//! fires only when the executor itself dies. A child is registered with the
//! reaper before any sweep can see it.

use std::io;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use rustix::process::{Signal, WaitId, WaitIdOptions};

use super::fork::{ForkFailure, Link};
use super::Process;
use crate::process::reaper::Reaper;
use crate::sys::{self, ChildSpec, Started};

/// A child to create, through a fork server's link or by the spawner itself.
type Job = (
    ChildSpec,
    Option<Arc<Link>>,
    tokio::sync::oneshot::Sender<io::Result<Started>>,
);

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
            for (spec, fork, reply) in rx {
                let r = {
                    // Registered before any sweep can look at it.
                    let mut k = known.known();
                    let r = match fork.as_ref().map(|link| link.fork(&spec)) {
                        Some(Ok(started)) => Ok(started),
                        Some(Err(ForkFailure::Child(e))) => Err(e),
                        // The server is gone: the old way.
                        Some(Err(ForkFailure::Server)) | None => sys::start(spec, &me),
                    };
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

    /// Create a child on the spawner thread (forked by `fork`'s server when
    /// given one that is up).
    pub async fn spawn(&self, spec: ChildSpec, fork: Option<Arc<Link>>) -> io::Result<Process> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        {
            let tx = self.tx.lock().map_err(|_| io::Error::other("spawner lock poisoned"))?;
            tx.send((spec, fork, reply))
                .map_err(|_| io::Error::other("spawner thread is gone"))?;
        }
        let started = rx.await.map_err(|_| io::Error::other("spawner thread is gone"))??;
        Process::new(started, self.reaper.clone())
    }
}
