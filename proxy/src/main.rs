//! `egress-proxy`: `serve` runs the proxy (embedded default config when no
//! `--config` is given), `check` validates a config file without starting anything,
//! `ranges` prints the default denied address ranges (for fences built outside
//! the proxy, such as a NetworkPolicy's `except` lists), `policy suggest`
//! proposes a tool's allowlist from its recorded traffic, `policy
//! replay` re-decides the recorded traffic under a new config and `policy
//! diff` lists the change in reach between two configs.
#![forbid(unsafe_code)]

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use egress_config::Config;
use egress_proxy::TokenSource;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "egress-proxy",
    version,
    about = "Loom Egress: per-run authenticated egress proxy"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the proxy.
    Serve {
        /// Config file (TOML). Without it, the embedded default runs: loopback listeners, no tools, everything denied.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Log format.
        #[arg(long, value_enum, default_value = "text")]
        log_format: LogFormat,
    },
    /// Validate a config file and print a summary; exit 1 on error.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Print the default denied address ranges (IPv4, then IPv6), one per line with
    /// its registry entry, or as JSON: {"ipv4": [...], "ipv6": [...]}.
    Ranges {
        #[arg(long)]
        json: bool,
    },
    /// Learn from recorded traffic: the store the config's [proxy] facts names
    /// (read-only; the proxy may be running).
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// The appliance CA of intercepted CONNECTs.
    Ca {
        #[command(subcommand)]
        action: CaAction,
    },
    /// Principals of the control plane (`[control] principals_file`).
    Principal {
        #[command(subcommand)]
        action: PrincipalAction,
    },
    /// The fact store's records, read-only (the proxy may be running).
    Facts {
        #[command(subcommand)]
        action: FactsAction,
    },
    /// The key that signs the fact log's checkpoints.
    Audit {
        #[command(subcommand)]
        action: AuditAction,
    },
}

#[derive(Subcommand)]
enum AuditAction {
    /// Make an Ed25519 signing key for `[audit] signing_key_file`: the
    /// private key is written to --out (created 0600, never overwritten),
    /// the verifier key to --out.pub and to stdout.
    Keygen {
        /// The key's name, as signature lines show it (no '+' or spaces).
        #[arg(long, default_value = "loom-egress")]
        name: String,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum FactsAction {
    /// Print every fact (or, with --decisions, every decision record) after
    /// --after, oldest first, one JSON object per line: as the API gives it
    /// (jsonl), or as an OCSF 1.8.0 event (ocsf). Read from a store file
    /// (--store, --config) or from a running proxy's control API (--control,
    /// page by page; the same lines). Exit 2 on error.
    Export {
        #[arg(long, value_enum, default_value = "jsonl")]
        format: ExportFormat,
        /// Only records whose seq is above this.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// The decision log instead of the facts.
        #[arg(long)]
        decisions: bool,
        /// The store file; without it, the one `[proxy] facts` of --config names.
        #[arg(long, conflicts_with_all = ["config", "control"])]
        store: Option<PathBuf>,
        #[arg(long, short, conflicts_with = "control")]
        config: Option<PathBuf>,
        /// A running proxy's control API, http://IP:PORT or https://IP:PORT
        /// (an address: no name is resolved). The principal sees what its
        /// scopes show (facts:own, decisions:own).
        #[arg(long)]
        control: Option<String>,
        /// The environment variable that holds the control API token.
        #[arg(long, default_value = "EGRESS_CONTROL_TOKEN", requires = "control")]
        token_env: String,
        /// With https: the CA of the API's certificate (`[control.tls]`
        /// server_ca, or client_ca).
        #[arg(long, requires = "control")]
        ca: Option<PathBuf>,
        /// With https: a client certificate (PEM) that names a principal;
        /// then no token is needed.
        #[arg(long, requires_all = ["control", "key"])]
        cert: Option<PathBuf>,
        /// The client certificate's private key (PEM).
        #[arg(long, requires = "cert")]
        key: Option<PathBuf>,
    },
    /// Check the store against its hash chains and signed checkpoints (its
    /// own, and --checkpoints held off the box); print each finding (edited,
    /// deleted, inserted or reordered records by seq, a truncated head, a
    /// replaced store, a bad signature). Exit 0 when everything verifies,
    /// 1 on any finding, 2 when it cannot check.
    Verify(VerifyArgs),
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// The verifier key (`name+hash+key`, as `audit keygen` printed it), or a
    /// file holding it. Repeatable: after a key rotation, give the keys that
    /// signed earlier checkpoints too.
    #[arg(long = "key", required = true)]
    keys: Vec<String>,
    /// Signed checkpoints held off the box: files holding one or more
    /// notes (a witness's copies of `GET /v1/audit/checkpoint`, or
    /// `egress_checkpoints`'), or a file sink's JSON lines (its checkpoint
    /// events), or directories of such files. Repeatable.
    #[arg(long = "checkpoints")]
    checkpoints: Vec<PathBuf>,
    /// The store file; without it, the one `[proxy] facts` of --config names.
    #[arg(long, conflicts_with_all = ["config", "postgres", "export"])]
    store: Option<PathBuf>,
    /// Verify what a sink exported instead: a file sink's directory (or
    /// files) of OCSF events sent with `[audit] record_integrity`, record by
    /// record, against the checkpoint events among them.
    #[arg(long, conflicts_with_all = ["config", "postgres"])]
    export: Vec<PathBuf>,
    /// Verify the facts the fleet store holds of this cell instead (its
    /// `[export]` DSN variable and schema, and `[cell] id`, from --config),
    /// each epoch on its own, against `egress_checkpoints`.
    #[arg(long, requires = "config")]
    postgres: bool,
    #[arg(long, short)]
    config: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    Jsonl,
    Ocsf,
}

#[derive(Subcommand)]
enum PrincipalAction {
    /// Add a principal with one new token: the token is printed once (to
    /// stdout), its SHA-256 appended to the principals file (created 0600).
    /// A running proxy takes it on its next reload.
    Add {
        /// The principal's name (1-128 of A-Z a-z 0-9 - _ . ~).
        name: String,
        /// A scope, repeated: invoke:<tools>, runs:<tools>, grants:<tools>,
        /// facts:own|all, decisions:own|all, policy:read, policy:reload,
        /// metrics, admin (<tools>: a tool id or a glob with `*`).
        #[arg(long = "scope")]
        scopes: Vec<String>,
        /// The principals file; without it, the one `[control]
        /// principals_file` of --config names.
        #[arg(long, conflicts_with = "config")]
        file: Option<PathBuf>,
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum PolicyAction {
    /// Print a proposed `egress = [...]` for a tool from its denials, report-mode
    /// facts and decision records, with counts and first/last seen; exit 2 on error.
    Suggest {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        tool: String,
        /// Only records this recent: 30m, 24h, 7d.
        #[arg(long)]
        since: Option<String>,
        /// Collapse names under one registrable domain to *.domain:port (never a public suffix).
        #[arg(long)]
        wildcards: bool,
        /// The store to read instead of the config's [proxy] facts.
        #[arg(long)]
        store: Option<PathBuf>,
    },
    /// Re-decide the recorded decisions and denials under NEW; print per tool what
    /// becomes denied or allowed. Exit 1 when something that went out would be
    /// denied, 0 otherwise, 2 on error.
    Replay {
        /// The new config (its [proxy] facts names the store, unless --store).
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        tool: Option<String>,
        #[arg(long)]
        store: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print every change in reach from OLD to NEW (computed from the compiled
    /// policies), widenings first; with --store or --control, the recorded
    /// fetches each change turns. Exit 1 when reach widened, 0 otherwise, 2 on error.
    Diff {
        old: PathBuf,
        new: PathBuf,
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
        /// A fact store to replay under NEW.
        #[arg(long, conflicts_with = "control")]
        store: Option<PathBuf>,
        /// A running proxy's control URL (http://host:port) that replays its records under NEW
        /// (token: EGRESS_CONTROL_TOKEN, else the token file in NEW's proxy home).
        #[arg(long)]
        control: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Subcommand)]
enum CaAction {
    /// Replace the CA with a new one (key 0600); a running proxy uses it
    /// from its next reload (SIGHUP or POST /v1/policy/reload).
    Rotate {
        #[arg(long, short)]
        config: PathBuf,
    },
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EGRESS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().flatten_event(true).with_current_span(false).init(),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { config } => check(&config),
        Cmd::Ranges { json } => ranges(json),
        Cmd::Ca {
            action: CaAction::Rotate { config },
        } => rotate_ca(&config),
        Cmd::Principal {
            action:
                PrincipalAction::Add {
                    name,
                    scopes,
                    file,
                    config,
                },
        } => principal_add(&name, &scopes, file, config),
        Cmd::Facts {
            action:
                FactsAction::Export {
                    format,
                    after,
                    decisions,
                    control: Some(url),
                    token_env,
                    ca,
                    cert,
                    key,
                    ..
                },
        } => done(
            export_remote(&url, &token_env, ca, cert.zip(key), format, after, decisions)
                .map(|()| std::process::ExitCode::SUCCESS),
        ),
        Cmd::Facts {
            action:
                FactsAction::Export {
                    format,
                    after,
                    decisions,
                    store,
                    config,
                    ..
                },
        } => done(export(format, after, decisions, store, config).map(|()| std::process::ExitCode::SUCCESS)),
        Cmd::Facts {
            action: FactsAction::Verify(args),
        } => done(verify(args)),
        Cmd::Audit {
            action: AuditAction::Keygen { name, out },
        } => done(keygen(&name, &out).map(|()| std::process::ExitCode::SUCCESS)),
        Cmd::Policy { action } => done(learn(action)),
        Cmd::Serve { config, log_format } => {
            init_logs(log_format);
            let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("egress-proxy: cannot start the runtime: {e}");
                    return std::process::ExitCode::from(2);
                }
            };
            match rt.block_on(serve(config)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("egress-proxy: {e:#}");
                    std::process::ExitCode::from(1)
                }
            }
        }
    }
}

/// `facts export`: the store's records to stdout, one JSON line each.
fn export(
    format: ExportFormat,
    after: u64,
    decisions: bool,
    store: Option<PathBuf>,
    config: Option<PathBuf>,
) -> Result<(), String> {
    use egress_proxy::facts::{dump, ocsf, Record, Records};
    use std::io::Write as _;
    let path = store_path(store, config)?;
    let what = if decisions { Records::Decisions } else { Records::Facts };
    let version = env!("CARGO_PKG_VERSION");
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let r = dump(&path, what, after, &mut |record| {
        let line = match (format, record) {
            (ExportFormat::Jsonl, Record::Fact(f)) => serde_json::to_string(&f),
            (ExportFormat::Jsonl, Record::Decision(d)) => serde_json::to_string(&d),
            (ExportFormat::Ocsf, Record::Fact(f)) => serde_json::to_string(&ocsf::fact_event(&f, version)),
            (ExportFormat::Ocsf, Record::Decision(d)) => serde_json::to_string(&ocsf::decision_event(&d, version)),
        }
        .map_err(std::io::Error::other)?;
        writeln!(out, "{line}")
    })
    .and_then(|_| out.flush().map_err(|e| e.to_string()));
    match r {
        // A reader that stopped early (`| head`) is not an error.
        Err(e) if e.contains("Broken pipe") => Ok(()),
        r => r,
    }
}

/// The exit code of a command that ran: its own, or 2 with its error on
/// stderr.
fn done(r: Result<std::process::ExitCode, String>) -> std::process::ExitCode {
    r.unwrap_or_else(|e| {
        eprintln!("egress-proxy: {e}");
        std::process::ExitCode::from(2)
    })
}

/// The store file `--store` names, or `--config`'s `[proxy] facts`.
fn store_path(store: Option<PathBuf>, config: Option<PathBuf>) -> Result<PathBuf, String> {
    let path = match (store, config) {
        (Some(s), _) => s,
        (None, Some(c)) => Config::load(&c).map_err(|e| e.to_string())?.proxy.facts,
        (None, None) => return Err("name the store: --store FILE or --config FILE".into()),
    };
    if path.as_os_str() == ":memory:" {
        return Err("the config keeps facts in memory: read them from the running proxy (GET /v1/facts)".into());
    }
    if !path.exists() {
        return Err(format!("{}: no fact store there", path.display()));
    }
    Ok(path)
}

/// `facts verify`: the report to stdout; exit 1 on any finding.
fn verify(a: VerifyArgs) -> Result<std::process::ExitCode, String> {
    use egress_proxy::facts::{chain::Verifier, verify};
    let mut keys = Vec::new();
    for k in &a.keys {
        let text = if k.contains('+') {
            k.clone()
        } else {
            std::fs::read_to_string(k).map_err(|e| format!("--key {k}: {e}"))?
        };
        keys.push(Verifier::parse(&text).map_err(|e| format!("--key {k}: {e}"))?);
    }
    let mut held = Vec::new();
    for text in read_all(&a.checkpoints)? {
        held.extend(verify::notes_in(&text));
    }
    let mut out = String::new();
    let mut findings = 0;
    if !a.export.is_empty() {
        let mut events = Vec::new();
        for text in read_all(&a.export)? {
            // Whole lines: one being written when the file was read is left out.
            for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                    events.push(v);
                }
            }
        }
        for r in verify::verify_export(&events, &keys, &held)? {
            findings += report(&mut out, &format!("export of {} events", events.len()), &r);
        }
    } else if a.postgres {
        let path = a.config.ok_or("--postgres reads [export] and [cell] from --config")?;
        let cfg = Config::load(&path).map_err(|e| e.to_string())?;
        let cell = cfg
            .cell
            .as_ref()
            .ok_or("--postgres: the config has no [cell] id")?
            .id
            .clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let reports = rt.block_on(async {
            let connector =
                egress_fleet::pg::Connector::from_env(&cfg.export, "loom-egress-verify").map_err(|e| e.to_string())?;
            let session = connector.open().await.map_err(|e| format!("the fleet store: {e}"))?;
            verify::verify_postgres(&session, &cfg.export.schema, &cell, &keys, &held).await
        })?;
        if reports.is_empty() {
            return Err(format!("the fleet store holds no facts of cell {cell}"));
        }
        for r in &reports {
            findings += report(&mut out, &format!("fleet store, schema {}", cfg.export.schema), r);
        }
    } else {
        let path = store_path(a.store, a.config)?;
        let r = verify::verify(&path, &keys, &held)?;
        findings += report(&mut out, &format!("store {}", path.display()), &r);
    }
    if findings == 0 {
        let _ = writeln!(out, "verified: no findings");
    } else {
        let _ = writeln!(out, "NOT VERIFIED: {findings} findings");
    }
    print!("{out}");
    Ok(if findings == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(1)
    })
}

/// The text of each file `paths` name, directories read file by file (in
/// name order).
fn read_all(paths: &[PathBuf]) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for p in paths {
        let files: Vec<PathBuf> = if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("{}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file())
                .collect();
            v.sort();
            v
        } else {
            vec![p.clone()]
        };
        for f in files {
            out.push(std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?);
        }
    }
    Ok(out)
}

/// One verified store or epoch, as `facts verify` prints it: its findings' count.
fn report(out: &mut String, source: &str, r: &egress_proxy::facts::verify::Report) -> usize {
    let _ = writeln!(out, "{source} (cell {}, epoch {})", r.cell, r.epoch);
    for (name, w) in [("facts", &r.facts), ("decisions", &r.decisions)] {
        let from = match (&w.anchored, w.anchor) {
            (Some(why), a) => format!(", chained after seq {a} ({why})"),
            (None, _) => String::new(),
        };
        let _ = writeln!(
            out,
            "{name}: {} records checked up to seq {}{from}",
            w.records, w.newest
        );
    }
    let newest = r
        .newest
        .as_ref()
        .map(|c| {
            format!(
                "; newest covers facts to seq {} and decisions to seq {}, signed {}",
                c.size, c.decisions.0, c.time
            )
        })
        .unwrap_or_default();
    let _ = writeln!(out, "checkpoints: {} verified{newest}", r.checkpoints);
    for n in &r.notes {
        let _ = writeln!(out, "note: {n}");
    }
    for f in &r.findings {
        let _ = writeln!(out, "FINDING {f}");
    }
    r.findings.len()
}

/// `audit keygen`: a new signing key, private to --out, public beside it.
fn keygen(name: &str, out: &std::path::Path) -> Result<(), String> {
    let public = egress_proxy::facts::chain::Signer::create_file(out, name)?;
    println!("{public}");
    Ok(())
}

/// `facts export --control`: the same lines, read page by page from a
/// running proxy's control API.
fn export_remote(
    url: &str,
    token_env: &str,
    ca: Option<PathBuf>,
    identity: Option<(PathBuf, PathBuf)>,
    format: ExportFormat,
    after: u64,
    decisions: bool,
) -> Result<(), String> {
    use egress_proxy::control_client::{endpoint, Client, ClientError, Records};
    use std::io::Write as _;
    let token = std::env::var(token_env)
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let client = Client::new(
        endpoint(url).map_err(|e| e.to_string())?,
        ca.as_deref(),
        identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        token,
    )
    .map_err(|e| e.to_string())?;
    let what = if decisions { Records::Decisions } else { Records::Facts };
    let format = match format {
        ExportFormat::Jsonl => egress_api::RecordFormat::Json,
        ExportFormat::Ocsf => egress_api::RecordFormat::Ocsf,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let r = rt
        .block_on(client.export(what, format, after, &mut |line| writeln!(out, "{line}")))
        .and_then(|_| out.flush().map_err(ClientError::Write));
    match r {
        // A reader that stopped early (`| head`) is not an error.
        Err(ClientError::Write(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.map(|_| ()).map_err(|e| e.to_string()),
    }
}

/// The default denied table, split by family in its own order.
fn ranges(json: bool) -> std::process::ExitCode {
    let mut out = String::new();
    let table = egress_config::ranges::DEFAULT_DENIED;
    let (v4, v6): (Vec<_>, Vec<_>) = table.iter().partition(|(net, _)| !net.contains(':'));
    if json {
        fn nets(l: &[&(&'static str, &'static str)]) -> Vec<&'static str> {
            l.iter().map(|(n, _)| *n).collect()
        }
        let _ = writeln!(out, "{}", serde_json::json!({ "ipv4": nets(&v4), "ipv6": nets(&v6) }));
    } else {
        for (net, what) in v4.iter().chain(v6.iter()) {
            let _ = writeln!(out, "{net:<20} {what}");
        }
    }
    emit(&out)
}

fn check(path: &std::path::Path) -> std::process::ExitCode {
    let mut out = String::new();
    match Config::load(path).and_then(|mut c| c.load_secrets().map(|()| c)) {
        Ok(c) => {
            let _ = writeln!(out, "{}: ok", path.display());
            let _ = writeln!(out, "  listen  {}", c.proxy.listen);
            let _ = writeln!(out, "  control {}", c.proxy.control);
            let _ = writeln!(out, "  facts   {}", c.proxy.facts.display());
            let _ = writeln!(
                out,
                "  handoff {} ({}: receives confined children's listeners from the executor)",
                c.proxy.handoff_socket().display(),
                if c.proxy.handoff.is_some() {
                    "[proxy] handoff"
                } else {
                    "the default beside the facts store"
                }
            );
            let _ = writeln!(out, "  policy  {}", c.policy.digest);
            match &c.audit.signing_key_file {
                Some(p) if c.audit.signing_key_create && !p.exists() => {
                    let _ = writeln!(
                        out,
                        "  audit   checkpoints signed every {} ms and {} facts, with a key made at the first start at {} (signing_key_create)",
                        c.audit.checkpoint.as_millis(),
                        c.audit.checkpoint_records,
                        p.display()
                    );
                }
                Some(p) => match egress_proxy::facts::chain::Signer::from_file(p) {
                    Ok(key) => {
                        let _ = writeln!(
                            out,
                            "  audit   checkpoints signed every {} ms and {} facts, verifier key {}",
                            c.audit.checkpoint.as_millis(),
                            c.audit.checkpoint_records,
                            key.verifier()
                        );
                    }
                    Err(e) => {
                        eprintln!("{}: [audit] {e}", path.display());
                        return std::process::ExitCode::from(1);
                    }
                },
                None => {
                    let _ = writeln!(
                        out,
                        "  audit   records chained, checkpoints not signed (no [audit] signing_key_file)"
                    );
                }
            }
            for (name, sink) in &c.audit.sinks {
                use egress_config::audit::SinkKind;
                let to = match &sink.kind {
                    SinkKind::Otlp(o) => format!(
                        "otlp {}://{}:{}{}",
                        if o.https { "https" } else { "http" },
                        o.endpoint.host,
                        o.endpoint.port,
                        o.path
                    ),
                    SinkKind::Syslog(y) => format!(
                        "syslog {}:{}{}",
                        y.endpoint.host,
                        y.endpoint.port,
                        if y.tls { " (TLS)" } else { "" }
                    ),
                    SinkKind::File(f) => format!(
                        "file {} ({} files of at most {} bytes)",
                        f.path.display(),
                        f.max_files,
                        f.max_file_bytes
                    ),
                };
                let _ = writeln!(
                    out,
                    "  sink    {name}: {to}: every fact, decision record and checkpoint as OCSF"
                );
            }
            match egress_proxy::ca_dir(&c.proxy) {
                Some(d) => {
                    let _ = writeln!(out, "  ca      {} (appliance CA of intercepted CONNECTs)", d.display());
                }
                None => {
                    let _ = writeln!(
                        out,
                        "  ca      ephemeral (facts in memory, no [proxy.interception] ca_dir)"
                    );
                }
            }
            let r = &c.policy.ranges;
            let _ = writeln!(
                out,
                "  ranges  default denied table ({} entries), allow {:?}, deny {:?}",
                egress_config::ranges::DEFAULT_DENIED.len(),
                r.allow_ranges().iter().map(|n| n.to_string()).collect::<Vec<_>>(),
                r.deny_ranges().iter().map(|n| n.to_string()).collect::<Vec<_>>()
            );
            if c.policy.tools.is_empty() {
                let _ = writeln!(out, "  tools   none: every fetch is denied");
            }
            for (id, t) in &c.policy.tools {
                let _ = writeln!(
                    out,
                    "  tool {id}: mode={} fetch_timeout={}ms max_concurrent_fetches={} rules={}",
                    t.mode.as_str(),
                    t.fetch_timeout.as_millis(),
                    t.max_concurrent_fetches,
                    t.allowlist.rules().len()
                );
                let transparent = t
                    .process
                    .as_ref()
                    .is_some_and(|p| p.network == egress_config::Network::Transparent);
                if transparent {
                    let _ = writeln!(
                        out,
                        "    network transparent: a connection's first bytes are waited for up to {} ms \
                         (proxy.header_read_timeout_ms) and must be TLS or HTTP/1.x, else it is denied \
                         (protocol_unknown); entries with protocol=tcp are relayed raw at once",
                        c.proxy.header_read_timeout.as_millis()
                    );
                }
                for (r, protocol) in t.allowlist.entries().zip(t.allowlist.protocols()) {
                    let mut notes = vec![];
                    if r.contains(" methods=") || r.contains(" paths=") {
                        notes.push("method and path rules: CONNECTs there are intercepted");
                    }
                    if transparent {
                        notes.push(match protocol {
                            egress_config::EntryProtocol::Tcp => "transparent: relayed raw, nothing checked",
                            egress_config::EntryProtocol::TlsOrHttp => {
                                "transparent: checked (TLS server name or HTTP Host)"
                            }
                        });
                    }
                    if notes.is_empty() {
                        let _ = writeln!(out, "    {r}");
                    } else {
                        let _ = writeln!(out, "    {r}  ({})", notes.join("; "));
                    }
                }
                if t.inspect {
                    let _ = writeln!(out, "    inspect: every CONNECT is intercepted");
                }
                for cr in &t.credentials {
                    let hosts: Vec<String> = cr.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
                    let plain = match cr.allow_plaintext {
                        egress_config::Plaintext::Never => "never in plain HTTP",
                        egress_config::Plaintext::Loopback => "plain HTTP too, to loopback addresses only",
                        egress_config::Plaintext::Anywhere => {
                            "plain HTTP too, to any address (UNSAFE: allow_plaintext = \"force\")"
                        }
                    };
                    let how = match &cr.sign {
                        Some(s) => format!("signed again with SigV4 for {} in {}", s.service, s.region),
                        None => format!("in {}", cr.header),
                    };
                    let _ = writeln!(
                        out,
                        "    credential {} -> {} {how} (CONNECTs there are intercepted; {plain})",
                        cr.name,
                        hosts.join(", "),
                    );
                    let what = match &cr.sign {
                        Some(s) if s.access_key_id.is_none() => "keys",
                        Some(_) => "secret key",
                        None => "secret",
                    };
                    let _ = writeln!(
                        out,
                        "      {what}: {}",
                        egress_proxy::describe_secret_source(&cr.source)
                    );
                }
            }
            emit(&out)
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// `policy suggest` and `policy replay`.
fn learn(action: PolicyAction) -> Result<std::process::ExitCode, String> {
    use egress_proxy::learn::{history, replay, suggest};
    let window = |tool: Option<String>, since: Option<String>| -> Result<history::Window, String> {
        let since = match since {
            Some(s) => Some(egress_proxy::learn::since(
                egress_proxy::learn::parse_duration(&s)
                    .ok_or(format!("--since {s:?} is not a duration (30m, 24h, 7d)"))?,
            )),
            None => None,
        };
        Ok(history::Window { tool, since })
    };
    let store = |c: &Config, given: Option<PathBuf>| -> Result<PathBuf, String> {
        let p = given.unwrap_or_else(|| c.proxy.facts.clone());
        if p.as_os_str() == ":memory:" {
            return Err("the config keeps facts in memory: nothing to read here; use the control API (GET /v1/tools/{tool}/suggestion, POST /v1/policy/replay) of the running proxy".into());
        }
        if !p.exists() {
            return Err(format!("{}: no fact store there (--store names another)", p.display()));
        }
        Ok(p)
    };
    match action {
        PolicyAction::Suggest {
            config,
            tool,
            since,
            wildcards,
            store: given,
        } => {
            let c = Config::load(&config).map_err(|e| e.to_string())?;
            let path = store(&c, given)?;
            let seen = history::read_store(&path, &window(Some(tool.clone()), since)?)?;
            let t = c.policy.tool(&tool);
            if t.is_none() {
                eprintln!(
                    "note: tool {tool:?} is not in {}: every name it used is proposed",
                    config.display()
                );
            }
            let p = suggest::suggest(&tool, t.map(|t| t.as_ref()), &seen, wildcards);
            Ok(emit(&p.toml))
        }
        PolicyAction::Replay {
            config,
            since,
            tool,
            store: given,
            json,
        } => {
            let c = Config::load(&config).map_err(|e| e.to_string())?;
            let path = store(&c, given)?;
            let seen = history::read_store(&path, &window(tool, since)?)?;
            let r = replay::replay(&c.policy, &seen);
            let out = if json {
                serde_json::to_string_pretty(&r).map_err(|e| e.to_string())? + "\n"
            } else {
                r.text()
            };
            let code = emit(&out);
            Ok(if r.breaks {
                std::process::ExitCode::from(1)
            } else {
                code
            })
        }
        PolicyAction::Diff {
            old,
            new,
            format,
            store,
            control,
        } => {
            let o = Config::load(&old).map_err(|e| e.to_string())?;
            let n = Config::load(&new).map_err(|e| e.to_string())?;
            let replayed = match (store, control) {
                (Some(path), _) => {
                    if !path.exists() {
                        return Err(format!("{}: no fact store there", path.display()));
                    }
                    let seen = history::read_store(&path, &history::Window::default())?;
                    Some(replay::replay(&n.policy, &seen))
                }
                (None, Some(url)) => Some(remote_replay(&url, &n, &new)?),
                (None, None) => None,
            };
            let r = egress_proxy::learn::diff::report(&o.policy, &n.policy, replayed);
            let out = match format {
                Format::Json => serde_json::to_string_pretty(&r).map_err(|e| e.to_string())? + "\n",
                Format::Text => r.text(),
            };
            let code = emit(&out);
            Ok(if r.widens {
                std::process::ExitCode::from(1)
            } else {
                code
            })
        }
    }
}

/// `POST /v1/policy/replay` of a running proxy with NEW's text: the proxy
/// replays what it recorded (the same replay as `--store`).
fn remote_replay(
    url: &str,
    new: &Config,
    path: &std::path::Path,
) -> Result<egress_proxy::learn::replay::Replay, String> {
    use http_body_util::BodyExt as _;
    let authority = url
        .strip_prefix("http://")
        .ok_or(format!("--control {url:?}: only http://host:port is supported"))?
        .trim_end_matches('/')
        .to_owned();
    let token = match std::env::var("EGRESS_CONTROL_TOKEN") {
        Ok(t) => t.trim().to_owned(),
        Err(_) => {
            let file = egress_proxy::token_path(&new.proxy.home());
            std::fs::read_to_string(&file)
                .map_err(|e| format!("no EGRESS_CONTROL_TOKEN, and {}: {e}", file.display()))?
                .trim()
                .to_owned()
        }
    };
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let body = serde_json::json!({ "config": text }).to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::post("/v1/policy/replay")
            .header("host", authority.as_str())
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("{url}: {status}: {}", String::from_utf8_lossy(&bytes)));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("{url}: not a replay: {e}"))
    })
}

/// Writes a command's whole output; a reader that stopped early (`| head`)
/// is not an error.
fn emit(out: &str) -> std::process::ExitCode {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("{e}");
            std::process::ExitCode::from(1)
        }
        _ => std::process::ExitCode::SUCCESS,
    }
}

fn principal_add(
    name: &str,
    scopes: &[String],
    file: Option<PathBuf>,
    config: Option<PathBuf>,
) -> std::process::ExitCode {
    let path = match (file, config) {
        (Some(f), _) => f,
        (None, Some(c)) => match Config::load(&c) {
            Ok(cfg) => match cfg.control.principals_file {
                Some(p) => p,
                None => {
                    eprintln!("{}: [control] principals_file is not set; pass --file", c.display());
                    return std::process::ExitCode::from(2);
                }
            },
            Err(e) => {
                eprintln!("{e}");
                return std::process::ExitCode::from(2);
            }
        },
        (None, None) => {
            eprintln!("egress-proxy principal add: pass --file PATH or --config FILE");
            return std::process::ExitCode::from(2);
        }
    };
    match egress_proxy::add_principal(&path, name, scopes) {
        Ok(token) => {
            println!("{token}");
            eprintln!(
                "principal {name} added to {}; its token is above and is shown only now. Reload the proxy (SIGHUP or POST /v1/policy/reload) to let it in",
                path.display()
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egress-proxy: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

fn rotate_ca(path: &std::path::Path) -> std::process::ExitCode {
    let c = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(1);
        }
    };
    let Some(dir) = egress_proxy::ca_dir(&c.proxy) else {
        eprintln!(
            "{}: the CA is ephemeral (facts = \":memory:\" and no [proxy.interception] ca_dir): nothing to rotate",
            path.display()
        );
        return std::process::ExitCode::from(1);
    };
    match egress_proxy::rotate_ca(&dir) {
        Ok(fingerprint) => {
            println!("{}: new appliance CA {fingerprint}", dir.display());
            println!("reload the proxy (SIGHUP or POST /v1/policy/reload) to issue leaves from it; children started from then on trust it");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egress-proxy: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Raises the soft limit on open files to the hard limit: every connection
/// and tunnel holds descriptors (a spliced tunnel four more for its pipes),
/// and `max_connections` should be reachable, not capped by a default of 1024.
fn raise_nofile_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        let raised = Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::debug!(limit = ?lim.maximum, "raised the open-file limit"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
        }
    }
}

/// The proxy holds credentials' secrets and the CA key: no core dump of it
/// is written (`RLIMIT_CORE` 0), and it is not dumpable (no ptrace attach
/// by other processes of its uid, `/proc/<pid>/mem` and `environ` root's).
fn no_core_dumps() {
    use rustix::process::{set_dumpable_behavior, setrlimit, DumpableBehavior, Resource, Rlimit};
    let zero = Rlimit {
        current: Some(0),
        maximum: Some(0),
    };
    if let Err(e) = setrlimit(Resource::Core, zero) {
        tracing::warn!(error = %e, "cannot turn core dumps off");
    }
    if let Err(e) = set_dumpable_behavior(DumpableBehavior::NotDumpable) {
        tracing::warn!(error = %e, "cannot make the process non-dumpable");
    }
}

async fn serve(path: Option<PathBuf>) -> anyhow::Result<()> {
    raise_nofile_limit();
    no_core_dumps();
    let config = match &path {
        Some(p) => Config::load(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => {
            tracing::warn!("no --config given: running the embedded default (listen 127.0.0.1:3128, control 127.0.0.1:3129, no tools, everything denied)");
            Config::embedded_default()
        }
    };
    let handle = egress_proxy::start(egress_proxy::Options {
        config,
        config_path: path,
        control_token: None,
        facts: None,
        listeners: egress_api::activation::Inherited::from_env().context("socket activation")?,
    })
    .await
    .context("cannot start")?;
    match &handle.token_source {
        Some(TokenSource::Env) => tracing::info!("control token from EGRESS_CONTROL_TOKEN"),
        Some(TokenSource::File(p)) => {
            tracing::info!(path = %p.display(), "control token read from file")
        }
        Some(TokenSource::Generated(p)) => {
            tracing::info!(path = %p.display(), "control token generated (mode 0600)")
        }
        None => {}
    }
    let shared = handle.shared.clone();
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).context("SIGHUP handler")?;
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("SIGTERM handler")?;
    loop {
        tokio::select! {
            _ = hup.recv() => {
                if let Err(e) = egress_proxy::reload(&shared, None).await {
                    tracing::error!("policy reload rejected, the old policy stays in force: {e}");
                }
            }
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    tracing::info!("shutting down: draining in-flight fetches");
    handle.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}
