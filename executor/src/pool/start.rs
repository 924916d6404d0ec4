//! The cold start of a child, bounded by `cold_start_ms`, phase by phase:
//! what it will run hashed and checked against the tool's pins, its run
//! created on the proxy with `activate:false` (carrying those digests), its scratch
//! directory, its confinement prepared, its proxy listener handed to the
//! proxy (or relayed), the process launched with its scrubbed environment,
//! then `booted` (phase `spawn`) and `ready` (phase `load`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::unix::pipe;

use crate::config::Protocol;
use crate::confine::plan::Prepared;
use crate::error::{ErrorKind, InvokeError, Phase};
use crate::kill::KillReason;
use crate::pool::child::{Shared, ToolSpec, Warm};
use crate::pool::protocol::{self, ChildMsg, LineReader, Read};
use crate::process::identity::{self, Opened};
use crate::process::{self, Launch};
use crate::proxy::control::{Executables, RunCreds};

impl Warm {
    /// Start a child for `tool`, bound to a new run (`run_id` if the kernel chose
    /// one). Bounded by `cold_start_ms`: spawn→`booted` is phase `spawn`,
    /// `booted`→`ready` is phase `load`. The phases: hash what the child
    /// will run (a file that does not match its pin starts nothing), create
    /// the run, make the scratch directory, prepare confinement, connect the
    /// child's proxy listener (hand-off or relay), launch, wait for `ready`.
    pub async fn start(shared: &Arc<Shared>, tool: &Arc<ToolSpec>, run_id: Option<&str>) -> Result<Warm, InvokeError> {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(tool.process.cold_start_ms);
        let id = shared.next_id();
        // Read before the run is created: a proxy restart after this makes the
        // child stale, never the other way round.
        let generation = shared.control.generation();
        let exe = identify(shared, tool).await?;
        let executables = Executables {
            program_sha256: exe.identity.program.sha256.clone(),
            files: exe.identity.executables(),
        };
        let bound = hands_off(shared, tool);
        let run = create_run(shared, tool, run_id, bound, &executables, deadline).await?;
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
        let takes = Takes { confine, exe };
        let launched = match launch(shared, tool, &run, &scratch, &child_proxy_url, takes, handoff).await {
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
        let (stdout, conversation) = match launched.stdout {
            Ok(captured) => (Some(captured), None),
            Err(pipe) => (None, Some(pipe)),
        };
        let mut warm = Warm {
            id,
            generation,
            tool: tool.clone(),
            shared: shared.clone(),
            run,
            process: launched.process,
            ipc: None,
            stdin: launched.stdin,
            stdout,
            conversation,
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

    async fn fail_start(mut self, mut e: InvokeError) -> InvokeError {
        let (_, tail, _) = self.stop(KillReason::Startup).await;
        self.tidy().await;
        let _ = self.shared.control.end(&self.run.run_id).await;
        e.stderr_tail = tail;
        e
    }
}

/// Whether a child of `tool` gets an in-namespace listener that is handed
/// over to the proxy (not relayed): its run is then created bound to it, so
/// that its credential is refused everywhere else from the start (see
/// [`proxy_path`], which hands it over).
fn hands_off(shared: &Shared, tool: &ToolSpec) -> bool {
    tool.confinement.has(crate::confine::Layer::Netns) && shared.exec.proxy_handoff.is_some()
}

/// Phase 0: what the child will run — its program opened and hashed from
/// that descriptor, the files its command names hashed — checked against
/// the tool's `expect_sha256`. A file that does not match its pin starts
/// no child: logged, counted, answered `executable_mismatch`.
async fn identify(shared: &Arc<Shared>, tool: &Arc<ToolSpec>) -> Result<Opened, InvokeError> {
    let (s, t) = (shared.clone(), tool.clone());
    // Reading a large file for the first time takes a while: not on a
    // runtime thread.
    let opened = tokio::task::spawn_blocking(move || {
        let p = &t.process;
        s.identity.open(&p.command, &p.path, &p.cwd)
    })
    .await
    .map_err(|e| InvokeError::startup(Phase::Spawn, format!("hashing what `{}` runs failed: {e}", tool.id)))?
    .map_err(|e| {
        InvokeError::startup(
            Phase::Spawn,
            format!("cannot start `{}`: {e}", tool.process.command.join(" ")),
        )
    })?;
    let p = &tool.process;
    if let Err(m) = identity::verify(&p.expect_sha256, &p.cwd, &opened.identity) {
        shared.metrics.identity_mismatch(&tool.id);
        tracing::error!(tool = %tool.id, "{m}: no child of it starts");
        // A durable fact at the proxy before the answer, once per mismatch
        // (the pool retries with its backoff; the same finding is not
        // recorded again).
        let text = m.to_string();
        if shared.first_mismatch(&tool.id, &text) {
            if let Err(e) = shared.control.report_mismatch(&tool.id, &text).await {
                shared.forget_mismatch(&tool.id);
                tracing::error!(tool = %tool.id, error = %e, "the executable mismatch could not be recorded at the proxy");
            }
        }
        return Err(InvokeError::new(
            ErrorKind::ExecutableMismatch,
            format!("no child of `{}` starts: {m}", tool.id),
        ));
    }
    Ok(opened)
}

/// Phase 1: the child's run on the proxy, created inactive (and `bound` to
/// the listener that will be handed over for it), carrying what its child
/// will run.
async fn create_run(
    shared: &Shared,
    tool: &ToolSpec,
    run_id: Option<&str>,
    bound: bool,
    executables: &Executables,
    deadline: tokio::time::Instant,
) -> Result<RunCreds, InvokeError> {
    let create = shared.control.create_run(&tool.id, run_id, bound, Some(executables));
    match tokio::time::timeout_at(deadline, create).await {
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

/// What a child takes with it into its exec: the confinement it applies to
/// itself and its program, opened and hashed (phases 3 and 0).
struct Takes {
    confine: crate::sys::ChildConfine,
    exe: Opened,
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
    takes: Takes,
    handoff: Option<HandOff>,
) -> Result<process::Launched, String> {
    let Takes { confine, exe } = takes;
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
    // An MCP server speaks on stdin and stdout, with nothing on fds 3-4.
    let plain = p.protocol != Protocol::Loom;
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
            conversation: p.protocol == Protocol::McpStdio,
            pid_namespace: shared.exec.pid_namespace,
            confine,
            stdout_cap: shared.exec.stdout_cap_bytes,
            stderr_cap: shared.exec.stderr_cap_bytes,
            fork: tool.fork.as_deref(),
            exe: Some(exe),
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
