//! One child's life: start it under the cold-start clock (run created on the
//! proxy with `activate:false`, scratch dir, scrubbed env, `booted` then
//! `ready`), watch it while warm, dispatch exactly one invocation under the
//! timeout clock, then kill its tree, end its run, read its facts, clean up.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio_util::sync::CancellationToken;

use crate::config::{ExecutorSection, ProcessConfig, Protocol};
use crate::confine::cgroup::CgroupDirs;
use crate::confine::plan::{Confinement, Prepared};
use crate::error::{ErrorKind, InvocationResult, InvokeError, Phase};
use crate::kill::KillReason;
use crate::metrics::Metrics;
use crate::pool::protocol::{self, ChildMsg, LineReader, ParentMsg, Read};
use crate::process::{self, Capture, ForkServer, Launch, Process, Spawner};
use crate::proxy::control::{ControlClient, ControlError, RunCreds};
use egress_api::Fact;

/// How long to wait for output pipes to close after the tree was killed.
/// Only a descendant that escaped the kill (process-group mode) makes this
/// wait matter; it never delays a normal run.
const PIPE_GRACE: Duration = Duration::from_millis(500);
/// Most emits kept per run (bytes are bounded by `max_run_bytes`).
const MAX_EMITS: usize = 10_000;
/// Facts returned with an invocation: one page of `GET /v1/runs/{id}/facts`
/// at its default limit (the rest stay on the proxy).
const FACTS_KEPT: usize = 100;

/// What every child shares: the spawner thread, the proxy client, metrics.
#[derive(Debug)]
pub struct Shared {
    pub spawner: Spawner,
    pub control: ControlClient,
    pub metrics: Metrics,
    pub exec: ExecutorSection,
    next_child: AtomicU64,
}

impl Shared {
    pub fn new(spawner: Spawner, control: ControlClient, metrics: Metrics, exec: ExecutorSection) -> Self {
        Shared {
            spawner,
            control,
            metrics,
            exec,
            next_child: AtomicU64::new(1),
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
}

/// A started, ready child bound to its (not yet active) run.
#[derive(Debug)]
pub struct Warm {
    pub id: u64,
    /// The proxy generation it started under (see `ControlClient::generation`).
    pub generation: u64,
    tool: Arc<ToolSpec>,
    shared: Arc<Shared>,
    pub run: RunCreds,
    process: Process,
    ipc: Option<(pipe::Sender, LineReader<pipe::Receiver>)>,
    stdin: Option<pipe::Sender>,
    stdout: Option<Capture>,
    stderr: Option<Capture>,
    scratch: PathBuf,
    cleaned: bool,
    /// Stops the relay of the in-namespace proxy listener when dropped.
    relay: Option<tokio_util::sync::DropGuard>,
    cgroup: Option<CgroupDirs>,
    /// A transparent child's namespace, whose dropped UDP is counted in
    /// `tidy` (its nftables counter outlives the child with this fd).
    transparent_ns: Option<std::os::fd::OwnedFd>,
    /// Emits received so far (kept when the invocation then fails).
    emits: Vec<Value>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

/// Start a child for `tool`, bound to a new run (`run_id` if the kernel chose
/// one). Bounded by `cold_start_ms`: spawn→`booted` is phase `spawn`,
/// `booted`→`ready` is phase `load`. The phases: create the run, make the
/// scratch directory, prepare confinement, connect the child's proxy
/// listener (hand-off or relay), launch, wait for `ready`.
pub async fn start(shared: &Arc<Shared>, tool: &Arc<ToolSpec>, run_id: Option<&str>) -> Result<Warm, InvokeError> {
    let t0 = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(tool.process.cold_start_ms);
    let id = shared.next_id();
    // Read before the run is created: a proxy restart after this makes the
    // child stale, never the other way round.
    let generation = shared.control.generation();
    let run = create_run(shared, tool, run_id, deadline).await?;
    let scratch = shared
        .exec
        .scratch_dir
        .join(format!("{}-{}-{}", tool.id, std::process::id(), id));
    let early = Abandon {
        shared,
        run: &run,
        scratch: &scratch,
    };
    if let Err(e) = make_scratch(&scratch) {
        return Err(early
            .fail(format!("cannot create scratch directory {}: {e}", scratch.display()))
            .await);
    }
    let Prepared {
        child: confine,
        listener,
        transparent,
        transparent_ns,
        cgroup,
    } = match prepare(tool, &run, &scratch) {
        Ok(p) => p,
        Err(e) => return Err(early.fail(e).await),
    };
    let ProxyPath {
        handoff,
        relay,
        child_proxy_url,
    } = match proxy_path(shared, &run, listener) {
        Ok(p) => p,
        Err(e) => return Err(early.fail(e).await),
    };
    if transparent.is_some() && handoff.is_none() {
        return Err(early
            .fail(format!(
                "`{}` has network = \"transparent\", which needs the listener hand-off (not [executor] allow_relay)",
                tool.id
            ))
            .await);
    }
    let handoff = handoff.map(|(listener, socket)| HandOff {
        listener,
        socket,
        transparent,
    });
    let launched = match launch(shared, tool, &run, &scratch, &child_proxy_url, confine, handoff).await {
        Ok(l) => l,
        Err(e) => {
            if let Some(c) = cgroup {
                c.remove().await;
            }
            return Err(early.fail(e).await);
        }
    };
    if let Some(server) = &tool.fork {
        shared
            .metrics
            .fork_server(&tool.id, server.up(), launched.process.forked());
    }
    let mut warm = Warm {
        id,
        generation,
        tool: tool.clone(),
        shared: shared.clone(),
        run,
        process: launched.process,
        ipc: None,
        stdin: launched.stdin,
        stdout: Some(launched.stdout),
        stderr: Some(launched.stderr),
        scratch,
        cleaned: false,
        relay,
        cgroup,
        transparent_ns,
        emits: Vec::new(),
    };
    let m = &shared.metrics;
    let Some((ipc_tx, ipc_rx)) = launched.ipc else {
        // Plain children are ready once spawned.
        let dt = t0.elapsed().as_secs_f64();
        m.cold_start(&tool.id, "spawn", dt);
        m.cold_start(&tool.id, "total", dt);
        return Ok(warm);
    };
    let reader = LineReader::new(ipc_rx, shared.exec.max_message_bytes, shared.exec.max_run_bytes);
    match warm.wait_ready(reader, t0, deadline).await {
        Ok(reader) => {
            warm.ipc = Some((ipc_tx, reader));
            Ok(warm)
        }
        Err(e) => Err(warm.fail_start(e).await),
    }
}

/// Phase 1: the child's run on the proxy, created inactive.
async fn create_run(
    shared: &Shared,
    tool: &ToolSpec,
    run_id: Option<&str>,
    deadline: tokio::time::Instant,
) -> Result<RunCreds, InvokeError> {
    match tokio::time::timeout_at(deadline, shared.control.create_run(&tool.id, run_id)).await {
        Ok(Ok(run)) => Ok(run),
        // The kernel's run id names a run the proxy has (live, or ended
        // within its retention): the kernel's mistake, not the proxy's.
        Ok(Err(crate::proxy::control::ControlError::Rejected { status: 409, code, .. }))
            if code == "run_exists" && run_id.is_some() =>
        {
            Err(InvokeError::new(
                ErrorKind::RunExists,
                format!(
                    "run_id {:?} is taken: the proxy has a run with that id (pass a new one, or none)",
                    run_id.unwrap_or_default()
                ),
            ))
        }
        Ok(Err(e)) => Err(InvokeError::new(ErrorKind::Proxy, e.to_string())),
        Err(_) => Err(InvokeError::startup(
            Phase::Spawn,
            format!(
                "creating the run did not finish within cold_start_ms = {}",
                tool.process.cold_start_ms
            ),
        )),
    }
}

/// Undoes the first phases when a later one fails: ends the run and removes
/// the scratch directory.
struct Abandon<'a> {
    shared: &'a Shared,
    run: &'a RunCreds,
    scratch: &'a std::path::Path,
}

impl Abandon<'_> {
    async fn fail(self, message: String) -> InvokeError {
        let _ = self.shared.control.end(&self.run.run_id).await;
        let _ = tokio::fs::remove_dir_all(self.scratch).await;
        InvokeError::startup(Phase::Spawn, message)
    }
}

/// Phase 3: the confinement the child applies to itself, planned for its
/// command, scratch directory and proxy port.
fn prepare(tool: &ToolSpec, run: &RunCreds, scratch: &std::path::Path) -> Result<Prepared, String> {
    let p = &tool.process;
    let program = process::resolve_program(&p.command[0], &p.path, &p.cwd).ok();
    let mut files = crate::confine::landlock::command_files(&p.command, program.as_deref(), &p.cwd);
    // The CA files the proxy's env points the child's TLS clients at.
    files.extend(
        egress_api::CA_ENV
            .iter()
            .filter_map(|k| run.env.get(*k))
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_absolute()),
    );
    let port = crate::proxy::url::port(&run.proxy_url).unwrap_or(0);
    tool.confinement
        .prepare(&tool.id, scratch, &files, port)
        .map_err(|e| format!("cannot prepare the confinement of `{}`: {e}", tool.id))
}

/// What is handed to the proxy for a child: its in-namespace proxy
/// listener, and a transparent tool's four sockets.
struct HandOff {
    listener: std::net::TcpListener,
    socket: PathBuf,
    transparent: Option<[std::os::fd::OwnedFd; 4]>,
}

/// How a child reaches its run's proxy.
struct ProxyPath {
    /// The in-namespace listener to hand to the proxy, and the hand-off socket.
    handoff: Option<(std::net::TcpListener, PathBuf)>,
    /// Stops the relay of the in-namespace listener when dropped.
    relay: Option<tokio_util::sync::DropGuard>,
    /// The proxy URL in the child's environment.
    child_proxy_url: String,
}

/// Phase 4: with an in-namespace listener, either hand it to the proxy
/// (which then accepts in the namespace itself, bound to this run) or relay
/// it to the proxy's data port; without one, the run's URL as it is.
fn proxy_path(shared: &Shared, run: &RunCreds, listener: Option<std::net::TcpListener>) -> Result<ProxyPath, String> {
    let (handoff, listener) = match (listener, &shared.exec.proxy_handoff) {
        (Some(l), Some(path)) => (Some((l, path.clone())), None),
        (l, _) => (None, l),
    };
    let relay = match listener {
        None => None,
        Some(l) => match (
            crate::proxy::url::addr(&run.proxy_url),
            crate::proxy::relay::Relay::new(l),
        ) {
            (Some(upstream), Ok(r)) => Some(r.start(upstream)),
            (None, _) => {
                return Err(format!(
                    "the run's proxy URL names no IP address and port: {}",
                    run.proxy_url
                ))
            }
            (_, Err(e)) => return Err(format!("cannot serve the in-namespace proxy listener: {e}")),
        },
    };
    let child_proxy_url = if relay.is_some() || handoff.is_some() {
        crate::proxy::url::for_child(&run.proxy_url)
    } else {
        run.proxy_url.clone()
    };
    Ok(ProxyPath {
        handoff,
        relay,
        child_proxy_url,
    })
}

/// Phase 5: start the process with its scrubbed environment, handing its
/// listener to the proxy meanwhile (connections wait in the listener's
/// backlog; the run is not active before dispatch anyway).
async fn launch(
    shared: &Shared,
    tool: &ToolSpec,
    run: &RunCreds,
    scratch: &std::path::Path,
    proxy_url: &str,
    confine: crate::sys::ChildConfine,
    handoff: Option<HandOff>,
) -> Result<process::Launched, String> {
    let p = &tool.process;
    // The proxy's variables as it gave them, but the proxy URL (and its
    // SOCKS5 form) as this child reaches it (the in-namespace listener when
    // relayed or handed off).
    let run_socks = egress_api::socks_url(&run.proxy_url);
    let egress = run
        .env
        .iter()
        .map(|(k, v)| {
            let v = if *v == run.proxy_url {
                proxy_url.to_owned()
            } else if run_socks.as_deref() == Some(v.as_str()) {
                egress_api::socks_url(proxy_url).unwrap_or_default()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect();
    let mut env = process::child_env(&egress, scratch, &p.path, &p.lang, &p.env);
    let plain = p.protocol == Protocol::Plain;
    if plain {
        env.retain(|(k, _)| k != protocol::IPC_FDS_VAR);
    }
    let launch = process::launch(
        &shared.spawner,
        Launch {
            command: &p.command,
            cwd: &p.cwd,
            env,
            path: &p.path,
            plain,
            pid_namespace: shared.exec.pid_namespace,
            confine,
            stdout_cap: shared.exec.stdout_cap_bytes,
            stderr_cap: shared.exec.stderr_cap_bytes,
            fork: tool.fork.as_deref(),
        },
    );
    let handing = async {
        let Some(h) = &handoff else { return Ok(()) };
        crate::proxy::handoff::send(&h.socket, &run.run_id, &h.listener).await?;
        match &h.transparent {
            Some(fds) => crate::proxy::handoff::send_transparent(&h.socket, &run.run_id, fds).await,
            None => Ok(()),
        }
    };
    let (launched, handed) = tokio::join!(launch, handing);
    // The proxy holds the listener now (or the start fails): no copy here.
    drop(handoff);
    match (launched, handed) {
        (Ok(mut l), Err(e)) => {
            let _ = l.process.kill_and_reap().await;
            Err(format!(
                "cannot hand the child's proxy listener to the proxy: {e} (the child is not relayed: \
                 `egress-executor doctor` checks the hand-off socket; [executor] allow_relay = true relays instead)"
            ))
        }
        (Ok(l), Ok(())) => Ok(l),
        (Err(e), _) => {
            let hint = match (e.kind(), tool.confinement.access_hint()) {
                (std::io::ErrorKind::PermissionDenied, Some(h)) => format!(" ({h})"),
                _ => String::new(),
            };
            Err(format!("cannot start `{}`: {e}{hint}", p.command.join(" ")))
        }
    }
}

fn make_scratch(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o711).create(parent)?;
        // Traversable (not listable) by confined children's uid, so each can
        // reach its own directory (Landlock keeps them out of the others).
        let mode = std::fs::metadata(parent)?.permissions().mode() & 0o777;
        if mode & 0o011 != 0o011 {
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(mode | 0o011))?;
        }
    }
    std::fs::DirBuilder::new().mode(0o700).create(dir)
}

/// Why a warm child stopped being usable before dispatch.
#[derive(Debug)]
pub struct Unusable(pub String);

impl Warm {
    /// The child's pid (in the executor's namespace).
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// Phase 6 of `start`: read `booted` then `ready` before `deadline`.
    async fn wait_ready(
        &mut self,
        mut reader: LineReader<pipe::Receiver>,
        t0: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<LineReader<pipe::Receiver>, InvokeError> {
        let m = &self.shared.metrics;
        let tool = &self.tool.id;
        let mut phase = Phase::Spawn;
        let mut booted_at = None;
        loop {
            let next = tokio::select! {
                // Lines written before an exit are read before the exit is seen.
                biased;
                r = reader.next() => r,
                s = self.process.wait() => {
                    let how = s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                    return Err(InvokeError::startup(phase, format!("the child exited ({how}) before `ready`")));
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(InvokeError::startup(phase, format!(
                        "no `{}` within cold_start_ms = {}",
                        if phase == Phase::Spawn { "booted" } else { "ready" },
                        self.tool.process.cold_start_ms
                    )));
                }
            };
            match next {
                Read::Msg(ChildMsg::Booted) if phase == Phase::Spawn => {
                    phase = Phase::Load;
                    booted_at = Some(Instant::now());
                    m.cold_start(tool, "spawn", t0.elapsed().as_secs_f64());
                }
                Read::Msg(ChildMsg::Ready) if phase == Phase::Load => {
                    if let Some(b) = booted_at {
                        m.cold_start(tool, "load", b.elapsed().as_secs_f64());
                    }
                    m.cold_start(tool, "total", t0.elapsed().as_secs_f64());
                    return Ok(reader);
                }
                Read::Msg(ChildMsg::Error { message }) => {
                    return Err(InvokeError::startup(
                        phase,
                        format!("the tool failed to start: {message}"),
                    ))
                }
                Read::Msg(other) => {
                    return Err(InvokeError::startup(
                        phase,
                        format!("protocol violation: `{}` before `ready`", other.kind()),
                    ))
                }
                Read::Violation(v) => return Err(InvokeError::startup(phase, format!("protocol violation: {v}"))),
                Read::Eof | Read::Failed(_) => {
                    return Err(InvokeError::startup(
                        phase,
                        "the child closed its IPC pipe (exited?) before `ready`",
                    ))
                }
            }
        }
    }

    /// Kill the tree and reap it (once this returns, no process of the tree
    /// is left), then collect its output: `(stdout head, stderr tail, exit)`.
    async fn stop(&mut self, reason: KillReason) -> (String, String, Option<String>) {
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
    async fn tidy(&mut self) {
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

    async fn fail_start(mut self, mut e: InvokeError) -> InvokeError {
        let (_, tail, _) = self.stop(KillReason::Startup).await;
        self.tidy().await;
        let _ = self.shared.control.end(&self.run.run_id).await;
        e.stderr_tail = tail;
        e
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

    /// Kill a child that will not be used; end its run.
    pub async fn discard(mut self, reason: KillReason) {
        self.stop(reason).await;
        self.tidy().await;
        let _ = self.shared.control.end(&self.run.run_id).await;
    }

    /// Run exactly one invocation on this child, then kill it. The answer is
    /// complete once the tree is dead and the run ended (its facts read with
    /// the same call); the rest (relay, cgroup, scratch directory) is left to
    /// [`Teardown::finish`], after the caller has its answer.
    pub async fn dispatch(mut self, req: Request) -> (InvocationResult, Teardown) {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + req.timeout;
        let outcome = self.converse(&req, deadline).await;
        let run_id = self.run.run_id.clone();
        // The kill goes out first (`stop` signals the tree on its first
        // poll), then the run's end travels to the proxy while the tree dies:
        // both are on the answer's path, neither waits for the other.
        let shared = self.shared.clone();
        let ((stdout, stderr_tail, exit), (facts, facts_error)) = tokio::join!(
            self.stop(KillReason::after(&outcome)),
            end_run(&shared.control, &run_id)
        );
        let (output, emits, error) = match outcome {
            Ok((output, emits)) => (Some(output), emits, None),
            Err(mut e) => {
                e.stderr_tail = stderr_tail;
                if let Some(m) = exit.as_deref().filter(|x| x.starts_with("memory:")) {
                    e.message = format!("{} ({m})", e.message);
                }
                (None, std::mem::take(&mut self.emits), Some(e))
            }
        };
        let output = match (output, self.tool.process.protocol) {
            (Some(Value::Null), Protocol::Plain) => Some(json!({"exit_code": 0, "stdout": stdout})),
            (o, _) => o,
        };
        self.shared
            .metrics
            .emits
            .get_or_create(&crate::metrics::ToolLabel {
                tool: self.tool.id.clone(),
            })
            .inc_by(emits.len() as u64);
        let result = InvocationResult {
            invocation_id: None,
            ok: error.is_none(),
            tool: self.tool.id.clone(),
            output,
            error,
            emits,
            run_id: Some(run_id),
            facts,
            facts_error,
            stdout,
            exit,
            duration_ms: ms(t0.elapsed()),
            body_dropped: None,
            cell: crate::error::cell().0,
            control_url: crate::error::cell().1,
        };
        (result, Teardown(self))
    }

    /// The invocation itself, up to (not including) the kill.
    async fn converse(
        &mut self,
        req: &Request,
        deadline: tokio::time::Instant,
    ) -> Result<(Value, Vec<Value>), InvokeError> {
        let timeout_err = || {
            InvokeError::new(
                ErrorKind::Timeout,
                format!("no result within {} ms", req.timeout.as_millis()),
            )
        };
        let aborted = || InvokeError::new(ErrorKind::Aborted, "aborted by the kernel");
        if self.tool.process.protocol == Protocol::Plain {
            return self.converse_plain(req, deadline).await;
        }
        let Some((tx, reader)) = &mut self.ipc else {
            return Err(InvokeError::new(ErrorKind::Disconnected, "no IPC pipe"));
        };
        let emits = &mut self.emits;
        let line = protocol::encode(&ParentMsg::Invoke {
            run_id: self.run.run_id.clone(),
            input: req.input.clone(),
            idempotency_key: req.idempotency_key.clone(),
        });
        // The dispatch is decided: the activation leaves first, so that it
        // is usually at the proxy before the child's first fetch.
        let mut activation = Activation::start(&self.shared, &self.run.run_id);
        tokio::select! {
            w = tx.write_all(&line) => w.map_err(|e| InvokeError::new(
                ErrorKind::Disconnected, format!("cannot send invoke: {e}")))?,
            _ = tokio::time::sleep_until(deadline) => return Err(timeout_err()),
            _ = req.cancel.cancelled() => return Err(aborted()),
        }
        loop {
            let next = tokio::select! {
                biased;
                e = activation.failed() => return Err(e),
                r = reader.next() => r,
                _ = req.cancel.cancelled() => {
                    // Advisory: the SIGKILL follows at once.
                    let _ = tx.try_write(&protocol::encode(&ParentMsg::Abort));
                    return Err(aborted());
                }
                _ = tokio::time::sleep_until(deadline) => return Err(timeout_err()),
                s = self.process.wait() => {
                    // The leader died. Lines it wrote before dying are still
                    // in the pipe: kill the rest of the tree so every writer
                    // is gone, then read what is left.
                    self.process.kill_tree();
                    let exit = s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                    return drain_after_exit(reader, emits, exit).await;
                }
            };
            match handle(next, emits) {
                Step::Continue => {}
                Step::Done(r) => return r,
            }
        }
    }

    async fn converse_plain(
        &mut self,
        req: &Request,
        deadline: tokio::time::Instant,
    ) -> Result<(Value, Vec<Value>), InvokeError> {
        let mut activation = Activation::start(&self.shared, &self.run.run_id);
        if let Some(mut stdin) = self.stdin.take() {
            let mut bytes = Vec::new();
            if !req.input.is_null() {
                bytes = serde_json::to_vec(&req.input).unwrap_or_default();
                bytes.push(b'\n');
            }
            // Written by a task so a child that never reads stdin cannot
            // block us; the task ends when the pipe closes.
            tokio::spawn(async move {
                let _ = stdin.write_all(&bytes).await;
            });
        }
        let status = tokio::select! {
            biased;
            e = activation.failed() => return Err(e),
            s = self.process.wait() => s,
            _ = tokio::time::sleep_until(deadline) => {
                return Err(InvokeError::new(
                    ErrorKind::Timeout,
                    format!("did not exit within {} ms", req.timeout.as_millis()),
                ))
            }
            _ = req.cancel.cancelled() => return Err(InvokeError::new(ErrorKind::Aborted, "aborted by the kernel")),
        };
        match status {
            Ok(process::ExitInfo::Code(0)) => Ok((Value::Null, Vec::new())),
            Ok(s) => Err(InvokeError::new(ErrorKind::ToolError, format!("exited with {s}"))),
            Err(e) => Err(InvokeError::new(
                ErrorKind::Disconnected,
                format!("lost the child: {e}"),
            )),
        }
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

/// The activation of a dispatched child's run on the proxy. It is sent when
/// the invocation is handed to the child and travels beside it, so its round
/// trip is off the answer's path: the proxy holds the child's fetches until
/// it lands (`[proxy] activation_wait_ms`) instead of denying them. The run
/// turns active only once the executor has committed to this dispatch. A
/// child that answers first does not wait for it: its run is ended next, and
/// an activation arriving after the end is refused, so the run never turns
/// active again.
struct Activation(Option<tokio::task::JoinHandle<Result<(), ControlError>>>);

impl Activation {
    fn start(shared: &Arc<Shared>, run_id: &str) -> Self {
        let (shared, run_id) = (shared.clone(), run_id.to_owned());
        Activation(Some(tokio::spawn(
            async move { shared.control.activate(&run_id).await },
        )))
    }

    /// Resolves only if the activation failed. When the proxy refused it
    /// (the run was ended, or is unknown to it), the run never turned
    /// active, so none of the child's fetches went out, and the pool may
    /// serve the invocation on a fresh child. Any other failure leaves the
    /// outcome unknown (the proxy may have taken the request), so the
    /// invocation fails without a second try.
    async fn failed(&mut self) -> InvokeError {
        let Some(task) = self.0.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = task.await;
        self.0 = None;
        let (message, retry_fresh) = match outcome {
            Ok(Ok(())) => return std::future::pending().await,
            Ok(Err(e)) => {
                let refused = matches!(e, ControlError::Rejected { status: 404 | 409, .. });
                (e.to_string(), refused)
            }
            Err(join) => (join.to_string(), false),
        };
        InvokeError {
            retry_fresh,
            ..InvokeError::new(ErrorKind::Proxy, format!("activating the run: {message}"))
        }
    }
}

/// A dispatched child whose tree is dead and whose run is ended, with its
/// relay, cgroup and scratch directory still to remove.
#[derive(Debug)]
pub struct Teardown(Warm);

impl Teardown {
    pub async fn finish(mut self) {
        self.0.tidy().await;
    }
}

enum Step {
    Continue,
    Done(Result<(Value, Vec<Value>), InvokeError>),
}

/// End the run and read its facts: from the answer to the end itself when
/// the proxy includes them, otherwise (an older proxy, or more facts than it
/// includes) with a second call.
async fn end_run(control: &ControlClient, run_id: &str) -> (Vec<Fact>, Option<String>) {
    let ended = match control.end_with_facts(run_id).await {
        Ok(Some(mut facts)) => {
            facts.truncate(FACTS_KEPT);
            return (facts, None);
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    match (control.facts(run_id).await, ended) {
        (Err(e), _) => (Vec::new(), Some(e.to_string())),
        (Ok(f), Err(e)) => (f, Some(format!("ending the run: {e}"))),
        (Ok(f), Ok(())) => (f, None),
    }
}

fn handle(next: Read, emits: &mut Vec<Value>) -> Step {
    let violation = |m: String| Step::Done(Err(InvokeError::new(ErrorKind::Protocol, m)));
    match next {
        Read::Msg(ChildMsg::Emit { fact }) => {
            if emits.len() >= MAX_EMITS {
                return violation(format!("more than {MAX_EMITS} emits in one run"));
            }
            emits.push(fact);
            Step::Continue
        }
        Read::Msg(ChildMsg::Result { output }) => Step::Done(Ok((output, std::mem::take(emits)))),
        Read::Msg(ChildMsg::Error { message }) => Step::Done(Err(InvokeError::new(ErrorKind::ToolError, message))),
        Read::Msg(other) => violation(format!("`{}` after `invoke`", other.kind())),
        Read::Violation(v) => violation(v),
        Read::Eof => Step::Done(Err(InvokeError::new(
            ErrorKind::Disconnected,
            "the child closed its IPC pipe before a result",
        ))),
        Read::Failed(e) => Step::Done(Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("IPC read failed before a result: {e}"),
        ))),
    }
}

async fn drain_after_exit(
    reader: &mut LineReader<pipe::Receiver>,
    emits: &mut Vec<Value>,
    exit: String,
) -> Result<(Value, Vec<Value>), InvokeError> {
    let drained = tokio::time::timeout(PIPE_GRACE, async {
        loop {
            match handle(reader.next().await, emits) {
                Step::Continue => {}
                Step::Done(r) => return r,
            }
        }
    })
    .await;
    match drained {
        Ok(Err(e)) if e.kind == ErrorKind::Disconnected => Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("the child exited ({exit}) before a result"),
        )),
        Ok(r) => r,
        Err(_) => Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("the child exited ({exit}) before a result"),
        )),
    }
}
