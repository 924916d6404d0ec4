//! One child as the pool holds it, from its start to its teardown: what
//! every child shares (`Shared`), a tool as the executor runs it
//! (`ToolSpec`), one invocation (`Request`), and the started child (`Warm`):
//! watched while idle, killed with its whole tree, tidied. Its stages are
//! `start` (the cold start) and `converse` (its one invocation).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::net::unix::pipe;
use tokio_util::sync::CancellationToken;

use crate::config::{ExecutorSection, ProcessConfig};
use crate::confine::cgroup::CgroupDirs;
use crate::confine::plan::Confinement;
use crate::kill::KillReason;
use crate::metrics::Metrics;
use crate::pool::protocol::{LineReader, Read};
use crate::process::identity::Hasher;
use crate::process::{Capture, ForkServer, Process, Spawner};
use crate::proxy::control::{ControlClient, RunCreds};

/// How long to wait for output pipes to close after the tree was killed.
/// Only a descendant that escaped the kill (process-group mode) makes this
/// wait matter; it never delays a normal run.
pub(super) const PIPE_GRACE: Duration = Duration::from_millis(500);

/// What every child shares: the spawner thread, the proxy client, metrics,
/// the digests of the files children run.
#[derive(Debug)]
pub struct Shared {
    pub spawner: Spawner,
    pub control: ControlClient,
    pub metrics: Metrics,
    pub exec: ExecutorSection,
    /// Hashes what each child runs before it starts (again for every child;
    /// an unchanged file keeps its digest).
    pub identity: Hasher,
    next_child: AtomicU64,
    /// The last pin mismatch recorded at the proxy, by tool.
    mismatches: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl Shared {
    pub fn new(spawner: Spawner, control: ControlClient, metrics: Metrics, exec: ExecutorSection) -> Self {
        Shared {
            spawner,
            control,
            metrics,
            exec,
            identity: Hasher::new(),
            next_child: AtomicU64::new(1),
            mismatches: Default::default(),
        }
    }

    /// Whether `finding` is new for `tool` (then it is remembered).
    pub fn first_mismatch(&self, tool: &str, finding: &str) -> bool {
        let Ok(mut m) = self.mismatches.lock() else { return true };
        m.insert(tool.to_owned(), finding.to_owned()).as_deref() != Some(finding)
    }

    /// Forgets `tool`'s last finding (it could not be recorded: try again).
    pub fn forget_mismatch(&self, tool: &str) {
        if let Ok(mut m) = self.mismatches.lock() {
            m.remove(tool);
        }
    }

    pub fn next_id(&self) -> u64 {
        self.next_child.fetch_add(1, Ordering::Relaxed)
    }
}

/// A tool as the executor runs it.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub id: String,
    pub process: ProcessConfig,
    pub confinement: Confinement,
    /// Its fork server (`fork_server = true`), started with its first child.
    pub fork: Option<Arc<ForkServer>>,
}

impl ToolSpec {
    pub fn new(id: &str, process: ProcessConfig, confinement: Confinement) -> ToolSpec {
        let fork = ForkServer::for_tool(id, &process, &confinement).map(Arc::new);
        ToolSpec {
            id: id.to_string(),
            process,
            confinement,
            fork,
        }
    }
}

/// One invocation handed to a ready child.
#[derive(Debug, Clone)]
pub struct Request {
    pub input: Value,
    pub idempotency_key: Option<String>,
    pub timeout: Duration,
    pub cancel: CancellationToken,
    /// The principal the child's run is attributed to at its activation
    /// (`None`: the control token's).
    pub principal: Option<String>,
}

/// A started, ready child bound to its (not yet active) run.
#[derive(Debug)]
pub struct Warm {
    pub id: u64,
    /// The proxy generation it started under (see `ControlClient::generation`).
    pub generation: u64,
    pub(super) tool: Arc<ToolSpec>,
    pub(super) shared: Arc<Shared>,
    pub run: RunCreds,
    pub(super) process: Process,
    pub(super) ipc: Option<(pipe::Sender, LineReader<pipe::Receiver>)>,
    pub(super) stdin: Option<pipe::Sender>,
    pub(super) stdout: Option<Capture>,
    /// An MCP server's stdout, read by its session (not captured).
    pub(super) conversation: Option<pipe::Receiver>,
    pub(super) stderr: Option<Capture>,
    pub(super) scratch: PathBuf,
    pub(super) cleaned: bool,
    /// Stops the relay of the in-namespace proxy listener when dropped.
    pub(super) relay: Option<tokio_util::sync::DropGuard>,
    pub(super) cgroup: Option<CgroupDirs>,
    /// A transparent child's namespace, whose dropped UDP is counted in
    /// `tidy` (its nftables counter outlives the child with this fd).
    pub(super) transparent_ns: Option<std::os::fd::OwnedFd>,
    /// Emits received so far (kept when the invocation then fails).
    pub(super) emits: Vec<Value>,
}

/// Why a warm child stopped being usable before dispatch.
#[derive(Debug)]
pub struct Unusable(pub String);

impl Warm {
    /// The child's pid (in the executor's namespace).
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// Kill the tree and reap it (once this returns, no process of the tree
    /// is left), then collect its output: `(stdout head, stderr tail, exit)`.
    pub(super) async fn stop(&mut self, reason: KillReason) -> (String, String, Option<String>) {
        // cgroup v2 (5.14+): the whole cgroup at once, escapees included.
        if let Some(c) = &self.cgroup {
            c.kill();
        }
        let exit = match self.process.kill_and_reap().await {
            Ok(s) => Some(s.to_string()),
            Err(_) => None,
        };
        // A tree the kernel's OOM killer hit at its memory limit reports
        // `memory`, not just the signal.
        let oom = self.cgroup.as_ref().map_or(0, |c| c.oom_kills());
        let exit = if oom > 0 {
            Some(format!(
                "memory: {oom} process(es) of the tree killed at memory_mb = {} (oom_kill in its cgroup); {}",
                self.tool.process.memory_mb,
                exit.unwrap_or_else(|| "reaped".into())
            ))
        } else {
            exit
        };
        self.shared.metrics.kill(&self.tool.id, reason);
        // Close our ends so nothing can block on them.
        self.ipc = None;
        self.stdin = None;
        let finish = |c: Option<Capture>| async move {
            match c {
                Some(c) => c.finish(PIPE_GRACE).await,
                None => crate::process::Captured::default(),
            }
        };
        let (out, err) = tokio::join!(finish(self.stdout.take()), finish(self.stderr.take()));
        (out.head_text(), err.tail_text(), exit)
    }

    /// What is left once the tree is dead: stop the relay, remove the
    /// cgroup and the scratch directory.
    pub(super) async fn tidy(&mut self) {
        self.relay = None;
        if let Some(c) = self.cgroup.take() {
            c.remove().await;
        }
        if let Some(ns) = self.transparent_ns.take() {
            self.count_dropped_udp(ns).await;
        }
        let _ = tokio::fs::remove_dir_all(&self.scratch).await;
        self.cleaned = true;
    }

    /// Adds what the dead child's namespace dropped to the UDP metric (a
    /// failure to read it is logged: the datagrams were dropped either way).
    async fn count_dropped_udp(&self, ns: std::os::fd::OwnedFd) {
        use std::os::fd::AsFd as _;
        let read = tokio::task::spawn_blocking(move || {
            let nft = crate::confine::transparent::nft().map_err(std::io::Error::other)?;
            crate::confine::transparent::udp_dropped(&nft, ns.as_fd())
        })
        .await;
        match read {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => self.shared.metrics.udp_dropped(&self.tool.id, n),
            Ok(Err(e)) => tracing::warn!(tool = %self.tool.id, error = %e, "cannot read the dropped UDP count"),
            Err(e) => tracing::warn!(tool = %self.tool.id, error = %e, "cannot read the dropped UDP count"),
        }
    }

    /// Wait, while warm, for a protocol child to become unusable: it exited,
    /// closed its IPC pipe, or sent anything at all (a violation before
    /// `invoke`). Cancel-safe; never returns while the child is healthy, nor
    /// for plain children.
    pub async fn watch(&mut self) -> Unusable {
        match &mut self.ipc {
            Some((_, reader)) => {
                tokio::select! {
                    r = reader.next() => match r {
                        Read::Msg(m) => Unusable(format!("sent `{}` while idle", m.kind())),
                        Read::Violation(v) => Unusable(v),
                        Read::Eof | Read::Failed(_) => Unusable("closed its IPC pipe while idle".into()),
                    },
                    s = self.process.wait() => Unusable(match s {
                        Ok(s) => format!("exited while idle ({s})"),
                        Err(e) => format!("lost while idle: {e}"),
                    }),
                }
            }
            // A plain child runs from the moment it is spawned: its exit is
            // its result, read at dispatch (its run is inactive until then,
            // so work done before reading stdin gets no network).
            None => std::future::pending().await,
        }
    }

    /// An MCP server's two ends of its conversation, taken once by its
    /// session: its stdin and its stdout.
    pub fn take_conversation(&mut self) -> Option<(pipe::Sender, pipe::Receiver)> {
        match (self.stdin.take(), self.conversation.take()) {
            (Some(tx), Some(rx)) => Some((tx, rx)),
            _ => None,
        }
    }

    /// Waits until the child exits (cancel-safe; the child is not reaped
    /// for good: [`Warm::close`] still kills its tree).
    pub async fn exited(&mut self) -> String {
        match self.process.wait().await {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        }
    }

    /// Ends a session child: its tree killed and reaped, its run ended (so
    /// its facts are final), its scratch directory and cgroup removed.
    /// Returns the tail of its stderr.
    pub async fn close(mut self, reason: KillReason) -> String {
        let (_, tail, _) = self.stop(reason).await;
        self.conversation = None;
        self.tidy().await;
        let _ = self.shared.control.end(&self.run.run_id).await;
        tail
    }

    /// The shared parts every child of the executor uses (the proxy client).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Kill a child that will not be used; end its run.
    pub async fn discard(mut self, reason: KillReason) {
        self.stop(reason).await;
        self.tidy().await;
        let _ = self.shared.control.end(&self.run.run_id).await;
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        // Dropped without `dispatch`/`discard` (executor shutting down): the
        // process handle kills the tree; remove the scratch directory here.
        if !self.cleaned {
            if let Some(c) = &self.cgroup {
                c.kill();
            }
            self.process.kill_tree();
            let _ = std::fs::remove_dir_all(&self.scratch);
            if let (Some(c), Ok(rt)) = (self.cgroup.take(), tokio::runtime::Handle::try_current()) {
                // Removable once the killed tree is gone.
                rt.spawn(c.remove());
            }
        }
    }
}

/// A dispatched child whose tree is dead and whose run is ended, with its
/// relay, cgroup and scratch directory still to remove.
#[derive(Debug)]
pub struct Teardown(pub(super) Warm);

impl Teardown {
    pub async fn finish(mut self) {
        self.0.tidy().await;
    }
}
