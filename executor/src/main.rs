//! `egress-executor`: `serve` runs the invocation API with warm pools;
//! `run` runs one ad-hoc command under a tool's run policy from a shell;
//! `mcp` is a session tool as a stdio MCP server (`api::bridge`).
//! Exit codes of `run` are documented in `docs/executor.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use egress_executor::{Config, ErrorKind, Executor, InvocationResult};
use serde_json::Value;
use std::io::Write as _;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "egress-executor",
    version,
    about = "Loom Egress executor: runs tools as single-use children bound to proxy runs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report which process-lifecycle guarantees this host provides, and
    /// whether the proxy's control API is reachable with the configured token.
    Doctor {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate the whole config file (what the proxy reads and what the
    /// executor reads) and each tool's command and files, without starting
    /// anything; every problem is printed; exit 1 if there is one.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Serve the invocation API on `[executor] listen`, keeping warm pools.
    Serve {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run one command under a tool's run policy; print its output and the
    /// run's denials.
    Run {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        tool: String,
        /// JSON written to the command's stdin (followed by a newline).
        #[arg(long)]
        input: Option<String>,
        /// Print the whole result as JSON on stdout instead.
        #[arg(long)]
        json: bool,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Serve a session tool of a running executor as a stdio MCP server
    /// (newline-delimited JSON-RPC on stdin and stdout), for agent hosts
    /// that start a command: each message goes to `/v1/mcp/<tool>`.
    Mcp {
        /// Where `[executor] listen` and the token are found; not needed
        /// with both `--executor` and `EGRESS_CONTROL_TOKEN`.
        #[arg(long, short)]
        config: Option<PathBuf>,
        #[arg(long)]
        tool: String,
        /// The executor's API (`http://host:port`), over `[executor] listen`.
        #[arg(long)]
        executor: Option<String>,
    },
}

fn main() -> ExitCode {
    egress_executor::release_large_allocations();
    let cli = Cli::parse();
    let verbose = matches!(cli.command, Command::Serve { .. });
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(if verbose { "info" } else { "warn" }));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("egress-executor: cannot start the runtime: {e}");
            return ExitCode::from(125);
        }
    };
    let r = match cli.command {
        Command::Serve { config } => rt.block_on(serve(config)).map(|()| 0),
        Command::Doctor { config } => rt.block_on(doctor(config)),
        Command::Check { config } => check(&config).map(|problems| u8::from(!problems.is_empty())),
        Command::Run {
            config,
            tool,
            input,
            json,
            command,
        } => rt.block_on(run(config, tool, input, json, command)),
        Command::Mcp { config, tool, executor } => rt
            .block_on(egress_executor::api::bridge::run(
                egress_executor::api::bridge::Options {
                    config,
                    executor,
                    tool,
                    token_env: token_env(),
                },
            ))
            .map(|()| 0),
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("egress-executor: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn token_env() -> Option<String> {
    std::env::var("EGRESS_CONTROL_TOKEN").ok()
}

async fn serve(config: PathBuf) -> anyhow::Result<()> {
    // First, before any child exists: the passed sockets are marked
    // close-on-exec as they are taken.
    let mut inherited = egress_api::activation::Inherited::from_env().context("socket activation")?;
    let config = Config::load(&config)?;
    let listen = config.executor.listen;
    let gate = binding_gate(&config, config.tools.values().flatten().map(|p| p.isolation));
    if let Some(g) = &gate {
        g.check_now().map_err(anyhow::Error::msg)?;
    }
    tracing::info!(binding = %config.binding.describe(), "confined children");
    let exec = Executor::new(config, token_env())?;
    subreaper(&exec);
    let listener = match inherited.take("executor")? {
        Some(l) => tokio::net::TcpListener::from_std(l).context("the socket passed by systemd")?,
        None => tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?,
    };
    for name in inherited.left() {
        tracing::warn!(name, "a socket passed by systemd is not used (expected: executor)");
    }
    tracing::info!(addr = %listener.local_addr()?, "executor listening");
    // Own the runs (ending what a crashed predecessor left), check that the
    // proxy receives hand-offs once its control API answers (never relay
    // because it was not up yet: refuse to go on), then warm the pools;
    // invocations that arrive before are served on demand.
    let stop = CancellationToken::new();
    let refused = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
    let (e, st, r) = (exec.clone(), stop.clone(), refused.clone());
    tokio::spawn(async move {
        e.take_ownership(st.clone()).await;
        if let Some(g) = gate.filter(|_| !st.is_cancelled()) {
            if let Err(why) = g.wait(egress_executor::proxy::binding::WAIT).await {
                let _ = r.set(why);
                st.cancel();
                return;
            }
            tracing::info!(socket = %g.socket().display(), "the proxy receives listener hand-offs");
        }
        e.warm_up();
    });
    let app = egress_executor::api::router(exec.clone());
    let st = stop.clone();
    match exec.control_tls().cloned() {
        Some(tls) => {
            let ended = stop.clone();
            tokio::spawn(async move {
                shutdown_signal().await;
                ended.cancel();
            });
            egress_executor::api::serve_tls(listener, app, &tls, stop.clone()).await?;
        }
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    tokio::select! {
                        _ = shutdown_signal() => {}
                        _ = st.cancelled() => {}
                    }
                })
                .await?
        }
    }
    stop.cancel();
    exec.shutdown();
    exec.drain(std::time::Duration::from_secs(5)).await;
    exec.release_ownership().await;
    match refused.get() {
        Some(why) => Err(anyhow::Error::msg(why.clone())),
        None => Ok(()),
    }
}

/// The binding gate for children of these isolations (`None`: nothing to
/// check, the relay is allowed or no child gets a network namespace).
fn binding_gate(
    config: &Config,
    isolations: impl IntoIterator<Item = egress_executor::config::Isolation>,
) -> Option<egress_executor::proxy::binding::Gate> {
    let host = egress_executor::confine::host(&config.executor);
    egress_executor::proxy::binding::Gate::new(config, &host, isolations)
}

/// Problems of the file that need no running service: the whole schema
/// (every problem, with key paths, from `egress-config`), then for every
/// tool with a process section its command (found on its `path`) and the
/// files its program is known to read, relative to its `cwd` (an
/// interpreter's script, a runner's tool: `config::files_named`).
fn static_problems(file: &std::path::Path) -> Vec<String> {
    let (config, error) = Config::check(file);
    let mut problems: Vec<String> = error.iter().flat_map(|e| e.lines()).collect();
    let Some(config) = config else {
        return problems;
    };
    for (tool, process) in &config.tools {
        let Some(p) = process else { continue };
        if let Err(e) = egress_executor::process::resolve_program(&p.command[0], &p.path, &p.cwd) {
            problems.push(format!("tools.{tool}.process.command: {e}"));
        } else if p.command[0].contains('/') {
            let prog = p.cwd.join(&p.command[0]);
            if !prog.exists() {
                problems.push(format!(
                    "tools.{tool}.process.command: {} does not exist",
                    prog.display()
                ));
            }
        }
        for path in egress_executor::config::files_named(&p.command) {
            if !p.cwd.join(&path).exists() {
                problems.push(format!(
                    "tools.{tool}.process.command: {} does not exist (relative to cwd {})",
                    path,
                    p.cwd.display()
                ));
            }
        }
        if !p.cwd.is_dir() {
            problems.push(format!(
                "tools.{tool}.process.cwd: {} is not a directory",
                p.cwd.display()
            ));
        }
    }
    problems
}

/// `check`: print every problem of the file, or a summary.
fn check(file: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let problems = static_problems(file);
    if problems.is_empty() {
        let config = Config::load(file)?;
        let tools: Vec<String> = config
            .tools
            .iter()
            .filter_map(|(t, p)| Some((t, p.as_ref()?)))
            .map(|(t, p)| match p.network {
                egress_executor::config::Network::Proxy => t.clone(),
                egress_executor::config::Network::Transparent => format!("{t} (network = \"transparent\")"),
            })
            .collect();
        println!("{}: ok", file.display());
        println!(
            "  executor  {} (owner {})",
            config.executor.listen, config.executor.name
        );
        println!("  proxy     control {}", config.control);
        println!("  binding   {}", config.binding.describe());
        println!(
            "  tools     {}",
            if tools.is_empty() {
                "none with a process section".into()
            } else {
                tools.join(", ")
            }
        );
    } else {
        for p in &problems {
            eprintln!("{p}");
        }
        eprintln!("{}: {} problem(s)", file.display(), problems.len());
    }
    Ok(problems)
}

/// One line per guarantee; exit 1 if a configured requirement is unmet.
/// `doctor`'s probe child: `true`, plain, unconfined (set `confine` to
/// confine it).
fn true_probe(pid_namespace: bool) -> egress_executor::process::Launch<'static> {
    static TRUE: std::sync::OnceLock<[String; 1]> = std::sync::OnceLock::new();
    egress_executor::process::Launch {
        command: TRUE.get_or_init(|| ["true".to_string()]),
        cwd: std::path::Path::new("/"),
        env: vec![("PATH".into(), egress_executor::config::DEFAULT_PATH.into())],
        path: egress_executor::config::DEFAULT_PATH,
        plain: true,
        conversation: false,
        pid_namespace,
        confine: Default::default(),
        stdout_cap: 0,
        stderr_cap: 0,
        fork: None,
        exe: None,
    }
}

async fn doctor(config: PathBuf) -> anyhow::Result<u8> {
    let file = config.clone();
    use egress_executor::confine::{plan::Confinement, Layer};
    use egress_executor::process::{launch, Spawner};
    let config = Config::load(&config)?;
    let mut failed = false;
    let mut line = |what: &str, ok: bool, detail: String| {
        println!("{:<28} {:<4} {detail}", what, if ok { "ok" } else { "FAIL" });
        failed |= !ok;
    };
    let spawner = Spawner::start().context("cannot start the spawner thread")?;
    let want_ns = config.executor.pid_namespace;
    let probe = launch(&spawner, true_probe(want_ns)).await;
    match probe {
        Ok(mut l) => {
            let ns = l.process.in_pid_namespace();
            let _ = l.process.kill_and_reap().await;
            line(
                "spawn (clone3/fork+pidfd)",
                true,
                "children start from the dedicated spawner thread".into(),
            );
            line(
                "parent-death signal",
                true,
                "PR_SET_PDEATHSIG=SIGKILL, executor liveness re-checked by pidfd".into(),
            );
            if want_ns {
                line(
                    "PID namespace per child",
                    ns,
                    if ns {
                        "whole-tree kills, also on the executor's death".into()
                    } else {
                        "not permitted (needs root or CAP_SYS_ADMIN): process groups + subreaper sweeps; grandchildren can outlive the executor's death".into()
                    },
                );
            } else {
                line(
                    "PID namespace per child",
                    true,
                    "disabled by [executor] pid_namespace = false: process groups only".into(),
                );
            }
        }
        Err(e) => line("spawn (clone3/fork+pidfd)", false, e.to_string()),
    }
    let host = egress_executor::confine::host(&config.executor);
    // A probe child in a cgroup of its own, so the report below can say how
    // children join theirs (clone3 CLONE_INTO_CGROUP or cgroup.procs).
    if let Some(prepared) = egress_executor::confine::plan::cgroup_probe(&host) {
        match prepared {
            Ok(mut prep) => {
                let cg = prep.cgroup.take();
                let mut probe = true_probe(false);
                probe.confine = prep.child;
                let probe = launch(&spawner, probe).await;
                let started = match probe {
                    Ok(mut l) => l.process.kill_and_reap().await.map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Some(c) = cg {
                    c.remove().await;
                }
                line(
                    "spawn into a cgroup",
                    started.is_ok(),
                    match started {
                        Ok(()) => "a probe child started in a cgroup of its own and was reaped".into(),
                        Err(e) => e.to_string(),
                    },
                );
            }
            Err(e) => line("spawn into a cgroup", false, format!("cannot make a cgroup: {e}")),
        }
    }
    println!();
    println!("{:<32} {:<4} {:<60} COST", "CONFINEMENT LAYER", "", "DETAIL");
    for layer in Layer::ALL {
        let (ok, detail) = match host.layers.get(&layer) {
            Some(Ok(d)) => (true, d.clone()),
            Some(Err(e)) => (false, format!("{e}; to get it: {}", layer.remedy())),
            None => (false, "not probed".to_string()),
        };
        println!(
            "{:<32} {:<4} {:<60} {}",
            layer.name(),
            if ok { "yes" } else { "NO" },
            detail,
            layer.cost()
        );
    }
    println!();
    println!("{:<32} {:<4} GIVEN BY (or what stands in)", "PROTECTION", "");
    for v in egress_executor::confine::doctor::verdicts(&host.features()) {
        let (state, by) = match (v.native, v.stand_in) {
            (Some(n), _) => ("yes", n.to_string()),
            (None, Some(s)) => ("yes", format!("{s} stands in")),
            (None, None) => ("NO", "missing: no layer gives it on this host".to_string()),
        };
        println!("{:<32} {state:<4} {by}", v.protection.name());
    }
    println!();
    for (what, detail) in egress_executor::confine::doctor::kernel_report(&host) {
        println!("{what:<32} {detail}");
    }
    if let Some(line) = cold_start_line(&spawner, &config, &host).await {
        println!("{line}");
    }
    let transparent = match &host.transparent {
        Ok(d) => (true, d.clone()),
        Err(e) => (false, e.clone()),
    };
    const TRANSPARENT_COST: &str =
        "routes, nftables rules and 4 sockets per namespace, made ahead like the namespace; \
         the proxy peeks at each connection's first bytes";
    println!(
        "{:<32} {:<4} {:<60} {TRANSPARENT_COST}",
        "transparent egress (nftables)",
        if transparent.0 { "yes" } else { "NO" },
        transparent.1,
    );
    println!();
    for (tool, process) in &config.tools {
        if let Some(p) = process {
            match Confinement::for_tool(tool, p, &config.executor, &host) {
                Ok(c) => {
                    let names: Vec<&str> = c.layers().iter().map(|l| l.name()).collect();
                    let (closed, unix) = c.unix_sockets();
                    line(
                        &format!("isolation of `{tool}`"),
                        true,
                        format!(
                            "{:?}, network = {:?}: {}",
                            p.isolation,
                            p.network.as_str(),
                            if names.is_empty() {
                                "none".into()
                            } else {
                                names.join(", ")
                            }
                        ),
                    );
                    // Reported, not required: `best_effort` and `off` are choices.
                    let state = if closed { "ok" } else { "OPEN" };
                    println!("{:<28} {state:<4} {unix}", format!("unix sockets of `{tool}`"));
                    if let Some(server) = egress_executor::pool::child::ToolSpec::new(tool, p.clone(), c).fork {
                        match server.check(&spawner).await {
                            Ok(how) => line(&format!("fork server of `{tool}`"), true, how),
                            Err(why) => line(
                                &format!("fork server of `{tool}`"),
                                false,
                                format!("{why}; its children would start a fresh interpreter each"),
                            ),
                        }
                    }
                }
                Err(e) => line(&format!("isolation of `{tool}`"), false, e.to_string()),
            }
        }
    }
    // What each tool's children run, hashed as a child start hashes it:
    // `sha256sum`'s lines, the values `expect_sha256` pins.
    let hasher = egress_executor::process::identity::Hasher::new();
    for (tool, process) in &config.tools {
        let Some(p) = process else { continue };
        let what = format!("executables of `{tool}`");
        match hasher.open(&p.command, &p.path, &p.cwd) {
            Ok(opened) => {
                let id = &opened.identity;
                let verdict = egress_executor::process::identity::verify(&p.expect_sha256, &p.cwd, id);
                let pins = match (&verdict, p.expect_sha256.len()) {
                    (Ok(()), 0) => "no pins (expect_sha256)".to_string(),
                    (Ok(()), n) => format!("{n} pinned in expect_sha256, all match"),
                    (Err(m), _) => format!("{m}: no child would start"),
                };
                let how = if opened.program.script {
                    "a #! script, run by path"
                } else {
                    "run from the descriptor hashed"
                };
                line(
                    &what,
                    verdict.is_ok(),
                    format!("{} file(s), the program {how}; {pins}", id.files().count()),
                );
                for h in id.files() {
                    println!("  {}  {}", h.sha256, h.path.display());
                }
            }
            Err(e) => line(&what, false, e.to_string()),
        }
    }
    let problems = static_problems(&file);
    line(
        "config file",
        problems.is_empty(),
        if problems.is_empty() {
            "valid for the proxy and the executor; every command and file found".into()
        } else {
            problems.join("; ")
        },
    );
    let control = egress_executor::proxy::control::ControlClient::new(config.control, &config.home, token_env())
        .with_tls(config.control_tls.as_ref())?;
    match control.probe().await {
        Ok(()) => line(
            "proxy control API",
            true,
            format!("{} answers, token accepted", config.control),
        ),
        Err(e) => line("proxy control API", false, e.to_string()),
    }
    // `run --tool T` runs strict when T has no process section.
    let isolations = config.tools.values().map(|p| {
        p.as_ref()
            .map_or(egress_executor::config::Isolation::Strict, |p| p.isolation)
    });
    match binding_gate(&config, isolations) {
        Some(g) => match g.probe().await {
            Ok(()) => line("listener hand-off", true, config.binding.describe()),
            Err(why) => line("listener hand-off", false, why),
        },
        None => line(
            "listener hand-off",
            true,
            match config.binding.socket() {
                Some(_) => format!(
                    "{}; not needed here: no child gets a network namespace",
                    config.binding.describe()
                ),
                None => config.binding.describe(),
            },
        ),
    }
    match control.tools().await {
        Ok(known) => {
            let missing: Vec<&str> = config
                .tools
                .iter()
                .filter(|(t, p)| p.is_some() && !known.contains(t))
                .map(|(t, _)| t.as_str())
                .collect();
            line(
                "tools known to the proxy",
                missing.is_empty(),
                if missing.is_empty() {
                    "every tool this executor serves is in the proxy's policy".into()
                } else {
                    format!(
                        "not in the proxy's policy (runs would be refused): {}",
                        missing.join(", ")
                    )
                },
            );
        }
        Err(e) => line("tools known to the proxy", false, e.to_string()),
    }
    Ok(u8::from(failed))
}

/// Every child of this process comes from the executor, so it can adopt and
/// kill descendants that leave their process group.
fn subreaper(exec: &Executor) {
    if let Err(e) = exec.enable_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper: in process-group mode, descendants that call setsid can outlive a kill");
    }
}

/// Resolves on SIGTERM or SIGINT. SIGHUP is caught and ignored (logged):
/// its default action would kill the executor and strand its children's
/// runs; the executor has nothing to reload in place (restart it instead).
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    let mut hup = signal(SignalKind::hangup()).ok();
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                tracing::warn!("SIGHUP ignored: the executor does not reload in place; restart it to apply a new config");
            }
        }
    }
    tracing::info!("shutting down");
}

async fn run(
    config: PathBuf,
    tool: String,
    input: Option<String>,
    json: bool,
    command: Vec<String>,
) -> anyhow::Result<u8> {
    let config = Config::load(&config)?;
    let input: Value = match input {
        Some(s) => serde_json::from_str(&s).context("--input is not valid JSON")?,
        None => Value::Null,
    };
    // A tool without a process section runs strict.
    let isolation = config.tool(&tool).map(|p| {
        p.as_ref()
            .map_or(egress_executor::config::Isolation::Strict, |p| p.isolation)
    });
    if let Some(g) = binding_gate(&config, isolation) {
        g.probe().await.map_err(anyhow::Error::msg)?;
    }
    // What the tool's section sets that an ad-hoc command cannot have,
    // named on the status line so nobody takes it for applied.
    let left_out = match config.tool(&tool) {
        Some(Some(p)) => p.not_ad_hoc(),
        _ => Vec::new(),
    };
    let exec = Executor::new(config, token_env())?;
    subreaper(&exec);
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c.cancel();
        }
    });
    let result = exec.run_ad_hoc(&tool, command, input, cwd, cancel).await;
    exec.settle().await;
    if json {
        // A closed stdout (`run --json | head`) is not an error of the run.
        let text = serde_json::to_string_pretty(&result)?;
        let mut out = std::io::stdout().lock();
        if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                return Err(e.into());
            }
        }
    } else {
        let mut out = std::io::stdout().lock();
        if let Err(e) = write!(out, "{}", result.stdout).and_then(|()| out.flush()) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                return Err(e.into());
            }
        }
        if let Some(e) = &result.error {
            if !e.stderr_tail.is_empty() {
                eprint!("{}", e.stderr_tail);
                if !e.stderr_tail.ends_with('\n') {
                    eprintln!();
                }
            }
        }
        eprint!("{}", summary(&result, &left_out));
    }
    Ok(exit_code(&result))
}

/// The status line and the denials table printed by `run`; the status line
/// ends with the tool's settings the ad-hoc command did not get.
pub fn summary(r: &InvocationResult, left_out: &[&str]) -> String {
    let mut s = String::new();
    let run = r.run_id.as_deref().unwrap_or("-");
    let not_applied = if left_out.is_empty() {
        String::new()
    } else {
        format!(" [not applied to an ad-hoc command: {}]", left_out.join(", "))
    };
    match &r.error {
        None => s.push_str(&format!("run {run}: ok in {} ms{not_applied}\n", r.duration_ms)),
        Some(e) => {
            let phase = match e.phase {
                Some(p) => format!(
                    " (phase {})",
                    serde_json::to_string(&p).unwrap_or_default().trim_matches('"')
                ),
                None => String::new(),
            };
            s.push_str(&format!(
                "run {run}: {}{phase}: {} ({} ms){not_applied}\n",
                e.kind.as_str(),
                e.message,
                r.duration_ms
            ));
        }
    }
    if let Some(e) = &r.facts_error {
        s.push_str(&format!("facts unavailable: {e}\n"));
    }
    if r.facts.is_empty() {
        s.push_str("no denials\n");
        return s;
    }
    let rows: Vec<[String; 4]> = r
        .facts
        .iter()
        .map(|f| {
            let count = if f.count > 1 {
                format!(" x{}", f.count)
            } else {
                String::new()
            };
            let target = match &f.target {
                Some(t) => format!("{}:{} {}", t.host, t.port, t.kind),
                None => "?: ".to_owned(),
            };
            [
                f.seq.to_string(),
                format!("{}{count}", f.reason),
                target,
                f.detail.clone(),
            ]
        })
        .collect();
    let headers = ["SEQ", "REASON", "TARGET", "DETAIL"];
    let mut widths = headers.map(str::len);
    for row in &rows {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: [&str; 4]| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == 3 {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        l.trim_end().to_string() + "\n"
    };
    s.push_str(&format!("{} denial(s):\n", rows.len()));
    s.push_str(&line(headers));
    for row in &rows {
        s.push_str(&line([&row[0], &row[1], &row[2], &row[3]]));
    }
    s
}

/// 0 ok; the command's own code if it exited non-zero; 124 timeout;
/// 130 aborted; 137 killed by a signal; 125 anything else (startup, proxy…).
fn exit_code(r: &InvocationResult) -> u8 {
    let Some(e) = &r.error else { return 0 };
    match e.kind {
        ErrorKind::ToolError => match r.exit.as_deref().and_then(|x| x.strip_prefix("exit code ")) {
            Some(c) => c.parse::<u8>().ok().filter(|c| *c != 0).unwrap_or(1),
            None => 137,
        },
        ErrorKind::Timeout => 124,
        ErrorKind::Aborted => 130,
        _ => 125,
    }
}

/// What strict costs a cold start here, for `doctor`: the median of 5
/// spawn-to-exit times of `true` with no confinement and with every layer a
/// strict tool gets on this host (namespace from the ready pool, Landlock,
/// seccomp, uid, rlimits, its cgroup). `None` when strict cannot run here.
async fn cold_start_line(
    spawner: &egress_executor::process::Spawner,
    config: &Config,
    host: &egress_executor::confine::HostSupport,
) -> Option<String> {
    use egress_executor::confine::plan::Confinement;
    use egress_executor::process::{launch, Launch};
    let p = egress_executor::config::ProcessConfig::ad_hoc(None, vec!["true".into()], "/".into());
    let strict = Confinement::for_tool("doctor-cold-start", &p, &config.executor, host).ok()?;
    let path = egress_executor::config::DEFAULT_PATH;
    let program = egress_executor::process::resolve_program("true", path, std::path::Path::new("/")).ok()?;
    std::fs::create_dir_all(&config.executor.scratch_dir).ok()?;
    let mut times = [Vec::new(), Vec::new()];
    // One warm-up of each, then 5 measured.
    for round in 0..6 {
        for (i, confined) in [false, true].into_iter().enumerate() {
            let scratch = tempfile_dir(&config.executor.scratch_dir).ok()?;
            let t0 = std::time::Instant::now();
            let prepared = if confined {
                strict
                    .prepare("doctor-cold-start", &scratch, std::slice::from_ref(&program), 3128)
                    .ok()?
            } else {
                Default::default()
            };
            let egress_executor::confine::plan::Prepared {
                child,
                listener,
                cgroup,
                ..
            } = prepared;
            let l = launch(
                spawner,
                Launch {
                    command: &["true".to_string()],
                    cwd: &scratch,
                    env: vec![("PATH".into(), path.into())],
                    path,
                    plain: true,
                    conversation: false,
                    pid_namespace: config.executor.pid_namespace,
                    confine: child,
                    stdout_cap: 0,
                    stderr_cap: 0,
                    fork: None,
                    exe: None,
                },
            )
            .await;
            let ok = match l {
                Ok(mut l) => l.process.wait().await.is_ok(),
                Err(_) => false,
            };
            let took = t0.elapsed();
            drop(listener);
            if let Some(c) = cgroup {
                c.remove().await;
            }
            let _ = std::fs::remove_dir_all(&scratch);
            if !ok {
                return None;
            }
            if round > 0 {
                times[i].push(took.as_secs_f64() * 1e3);
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (off, on) = (median(&mut times[0]), median(&mut times[1]));
    Some(format!(
        "{:<32} {:<4} `true` spawn to exit, median of 5: unconfined {off:.1} ms, strict {on:.1} ms ({:+.1} ms)",
        "cold start",
        "",
        on - off
    ))
}

/// A fresh directory under `parent` (0711 parent: children reach only their own).
fn tempfile_dir(parent: &std::path::Path) -> std::io::Result<PathBuf> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let d = parent.join(format!(
        "doctor-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir(&d)?;
    Ok(d)
}
