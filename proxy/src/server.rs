//! Starting and stopping the proxy: binds the data and control listeners,
//! builds the shared state, starts both planes, the hand-off listener and
//! the sweeper (run expiry, owners' leases, host addresses), and stops them
//! in order on shutdown (drain, cut, end runs, close the control listener).

use crate::addrs::SelfAddrs;
use crate::dns::{Dns, TcpDial};
use crate::facts::{FactSink, MemorySink};
use crate::metrics::Metrics;
use crate::runs::EndReason;
use crate::state::{Parts, Shared};
use egress_config::Config;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// How to start a proxy.
pub struct Options {
    pub config: Config,
    /// The file the config came from (for reloads); `None` = embedded default.
    pub config_path: Option<PathBuf>,
    /// Control token; `None` = from the environment or the token file.
    pub control_token: Option<String>,
    /// Fact sink; `None` = the default store.
    pub facts: Option<Arc<dyn FactSink>>,
    /// Listeners passed by systemd (`proxy`, `control`), used instead of
    /// binding the configured addresses.
    pub listeners: egress_api::activation::Inherited,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind {what} listener {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] egress_config::ConfigError),
    #[error("the policy reaches beyond [proxy] envelope:\n{0}")]
    BeyondEnvelope(String),
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsInitError),
    #[error("control token: {0}")]
    Token(#[from] crate::control::token::TokenError),
    #[error("[proxy.tls]: {0}")]
    Tls(egress_api::tls::TlsError),
    #[error("[control.tls]: {0}")]
    ControlTls(egress_api::tls::TlsError),
    #[error("appliance CA: {0}")]
    Ca(#[from] crate::ca::CaError),
    #[error("fleet export: {0}")]
    Export(#[from] crate::facts::export::ExportError),
    #[error(transparent)]
    Sinks(#[from] crate::facts::sinks::SinkError),
    #[error("[audit] {0}")]
    Audit(String),
    #[error("cannot listen for listener hand-offs on {}: {source}", path.display())]
    Handoff {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// A running proxy.
pub struct Handle {
    pub proxy_addr: SocketAddr,
    pub control_addr: SocketAddr,
    pub token: String,
    pub token_source: Option<crate::control::token::TokenSource>,
    pub shared: Arc<Shared>,
    tasks: JoinSet<()>,
    /// The audit sinks, flushed at the end of a stop.
    sinks: Option<crate::facts::sinks::Sinks>,
}

impl Handle {
    /// Stops accepting data connections (`/readyz` turns 503 while the
    /// control listener stays up), lets in-flight fetches finish up to the
    /// drain timeout, ends every run, closes the control listener, returns.
    pub async fn shutdown(mut self) {
        let sh = self.shared.clone();
        tracing::info!(
            drain_ms = sh.cfg.drain_timeout.as_millis() as u64,
            "stopping: no new data connections, draining"
        );
        sh.shutdown.cancel();
        sh.tasks.close();
        if tokio::time::timeout(sh.cfg.drain_timeout, sh.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("drain timeout expired; cutting the remaining fetches");
        }
        sh.hard_stop.cancel();
        for run in sh.runs.live_runs() {
            sh.end_run(&run, EndReason::Shutdown);
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), sh.tasks.wait()).await;
        if let Some(e) = &sh.exporter {
            let budget = sh.export_cfg.flush_timeout;
            tracing::info!(
                lag = sh.export_lag(),
                budget_ms = budget.as_millis() as u64,
                "flushing the fact export"
            );
            match e.flush(&*sh.facts, budget).await {
                0 => tracing::info!("every fact is exported"),
                lag => tracing::warn!(
                    lag,
                    "stopping with facts not yet exported (they stay in the local store)"
                ),
            }
        }
        // The records of the fetches just drained are written before the end.
        let log = sh.decisions.clone();
        let _ = tokio::task::spawn_blocking(move || log.close()).await;
        if let Some(sinks) = &self.sinks {
            match sinks.flush(crate::facts::sinks::FLUSH_AT_STOP).await {
                0 => tracing::info!("every record is delivered to the audit sinks"),
                lag => tracing::warn!(
                    lag,
                    "stopping with records the audit sinks have not delivered (sent after the next start)"
                ),
            }
        }
        sh.control_stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        self.tasks.abort_all();
    }
}

fn advertised(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v) if v.is_unspecified() => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::IpAddr::V6(v) if v.is_unspecified() => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port()).to_string()
}

/// Retention by age of the decision log keeps every record above the
/// lowest of the audit sinks' decision cursors.
fn decision_floor(audit: &egress_config::AuditConfig, facts: &Arc<dyn FactSink>) -> crate::facts::decisions::Floor {
    let keys = crate::facts::sinks::cursor_keys(audit, crate::facts::sinks::RecordKind::Decisions);
    if keys.is_empty() {
        return crate::facts::decisions::Floor::default();
    }
    let facts = facts.clone();
    crate::facts::decisions::Floor(Arc::new(move || {
        keys.iter().map(|k| facts.cursor(k)).min().unwrap_or(u64::MAX)
    }))
}

/// Makes the fact store's directory private (0700), or traversable only
/// (0711) when the appliance CA's public files live below it, for confined
/// children of other uids to read.
fn store_dir(pc: &egress_config::ProxyConfig) {
    let Some(dir) = pc.facts.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return;
    };
    let ca_below = crate::ca::ca_dir(pc).is_some_and(|ca| ca.starts_with(dir));
    if let Err(e) = crate::facts::private::dir(dir, if ca_below { 0o711 } else { 0o700 }) {
        tracing::error!(dir = %dir.display(), error = %e, "cannot make the fact store's directory private");
    }
}

/// The listener systemd passed as `what`, or `addr` bound.
async fn listener(
    inherited: &mut egress_api::activation::Inherited,
    what: &'static str,
    addr: SocketAddr,
) -> Result<TcpListener, StartError> {
    let bind_error = |source| StartError::Bind { what, addr, source };
    match inherited.take(what).map_err(bind_error)? {
        Some(l) => {
            let l = TcpListener::from_std(l).map_err(bind_error)?;
            tracing::info!(what, addr = ?l.local_addr().ok(), "listening on a socket passed by systemd");
            Ok(l)
        }
        None => TcpListener::bind(addr).await.map_err(bind_error),
    }
}

/// Binds both listeners (or takes those systemd passed) and starts serving.
pub async fn start(opts: Options) -> Result<Handle, StartError> {
    let mut cfg = opts.config;
    // Credentials' secrets are the proxy's alone: loaded here and on reload.
    cfg.load_secrets()?;
    let pc = cfg.proxy.clone();
    let mut inherited = opts.listeners;
    let proxy_l = listener(&mut inherited, "proxy", pc.listen).await?;
    let control_l = listener(&mut inherited, "control", pc.control).await?;
    for name in inherited.left() {
        tracing::warn!(
            name,
            "a socket passed by systemd is not used (expected: proxy, control)"
        );
    }
    let proxy_addr = proxy_l.local_addr().map_err(|source| StartError::Bind {
        what: "proxy",
        addr: pc.listen,
        source,
    })?;
    let control_addr = control_l.local_addr().map_err(|source| StartError::Bind {
        what: "control",
        addr: pc.control,
        source,
    })?;
    let (token, token_source) = match opts.control_token {
        Some(t) => (t, None),
        None => {
            let (t, s) =
                crate::control::token::resolve(std::env::var(crate::control::token::TOKEN_ENV).ok(), &pc.home())?;
            (t, Some(s))
        }
    };
    let principals = match &cfg.control.principals_file {
        Some(path) => egress_config::principals::Principals::load(path, &token)?,
        None => egress_config::principals::Principals::single(&token),
    };
    let envelope = match &pc.envelope {
        Some(path) => {
            let envelope = crate::control::envelope::load(path)?;
            if let Err(report) = crate::control::envelope::check(&envelope, &cfg.policy) {
                return Err(StartError::BeyondEnvelope(report.text()));
            }
            Some(envelope)
        }
        None => None,
    };
    let metrics = Metrics::new();
    // An embedder's own fact sink has no directory to keep the CA beside:
    // its CA is ephemeral unless `ca_dir` is set.
    let own_sink = opts.facts.is_some();
    if opts.facts.is_none() && pc.facts.as_os_str() != ":memory:" {
        store_dir(&pc);
    }
    // The key that signs the chains' checkpoints: refused at start when
    // unreadable, malformed, or readable by others.
    if let Some(path) = cfg
        .audit
        .signing_key_file
        .as_ref()
        .filter(|p| cfg.audit.signing_key_create && !p.exists())
    {
        let name = cfg.cell.as_ref().map_or("loom-egress", |c| c.id.as_str());
        let public = crate::facts::chain::Signer::create_file(path, name).map_err(StartError::Audit)?;
        tracing::info!(path = %path.display(), verifier_key = %public, "made the checkpoint signing key ([audit] signing_key_create); keep the verifier key where the verifiers are");
    }
    let checkpoints = match &cfg.audit.signing_key_file {
        Some(path) => Some(crate::facts::store::CheckpointPolicy {
            key: Arc::new(crate::facts::chain::Signer::from_file(path).map_err(StartError::Audit)?),
            every: cfg.audit.checkpoint,
            records: cfg.audit.checkpoint_records,
        }),
        None => None,
    };
    let authority = checkpoints.as_ref().map(|c| c.key.name().to_owned());
    let decision_bytes: Arc<std::sync::atomic::AtomicU64> = Arc::default();
    let sqlite = opts.facts.is_none() && pc.facts.as_os_str() != ":memory:";
    let facts: Arc<dyn FactSink> = match opts.facts {
        Some(f) => f,
        None if pc.facts.as_os_str() == ":memory:" => {
            tracing::warn!("facts = \":memory:\": denial facts are kept in memory only and lost on exit");
            Arc::new(MemorySink::new(100_000))
        }
        None => Arc::new(crate::facts::store::SqliteStore::open(
            &pc.facts,
            crate::facts::store::Limits {
                max_bytes: pc.facts_max_bytes,
                retention: pc.facts_retention,
                cell: cfg.cell.as_ref().map(|c| c.id.clone()),
                exported: cfg.export.sink == egress_config::Sink::Postgres,
                others: decision_bytes.clone(),
                sink_cursors: crate::facts::sinks::cursor_keys(&cfg.audit, crate::facts::sinks::RecordKind::Facts),
                checkpoint_cursors: crate::facts::sinks::cursor_keys(
                    &cfg.audit,
                    crate::facts::sinks::RecordKind::Checkpoints,
                ),
                checkpoints,
            },
            metrics.store.clone(),
        )),
    };
    // The decision log shares the fact store's file (its own table and
    // budget), or memory with an in-memory or embedder's sink.
    let decisions = Arc::new(crate::facts::decisions::DecisionLog::open(
        pc.decisions,
        sqlite.then_some(pc.facts.as_path()),
        crate::facts::decisions::Limits {
            max_bytes: pc.decisions_max_bytes,
            retention: pc.decisions_retention,
            floor: decision_floor(&cfg.audit, &facts),
            cell: cfg.cell.as_ref().map(|c| c.id.clone()),
        },
        metrics.decisions.clone(),
        decision_bytes,
    ));
    if let Some(cell) = &cfg.cell {
        crate::control::error::set_cell(cell);
    }
    let exporter = match (&cfg.cell, cfg.export.sink) {
        (Some(cell), egress_config::Sink::Postgres) => Some(crate::facts::export::Exporter::start(
            &cfg.export,
            &cell.id,
            facts.clone(),
            metrics.export.clone(),
        )?),
        _ => None,
    };
    let dns: Arc<dyn crate::dns::Resolve> = Arc::new(Dns::new(&pc.dns)?);
    let sinks = if cfg.audit.sinks.is_empty() {
        None
    } else {
        let source = crate::facts::sinks::Source {
            facts: facts.clone(),
            decisions: decisions.clone(),
            version: env!("CARGO_PKG_VERSION"),
            integrity: cfg.audit.record_integrity.then(|| crate::facts::sinks::Integrity {
                cell: crate::facts::store::links::cell_name(cfg.cell.as_ref().map(|c| c.id.as_str())).to_owned(),
                authority,
            }),
        };
        let env = |k: &str| std::env::var(k).ok();
        Some(crate::facts::sinks::start(
            &cfg.audit,
            cfg.cell.as_ref().map(|c| c.id.as_str()),
            source,
            dns.clone(),
            metrics.audit.clone(),
            &env,
        )?)
    };
    // The scheme and authority of runs' proxy URLs: the advertised ones.
    let (proxy_scheme, proxy_authority) = match cfg.cell.as_ref().and_then(|c| c.advertise_proxy.as_deref()) {
        Some(url) => match url.split_once("://") {
            Some(("https", a)) => ("https", a.to_owned()),
            Some((_, a)) => ("http", a.to_owned()),
            None => ("http", url.to_owned()),
        },
        None => (if pc.tls.is_some() { "https" } else { "http" }, advertised(proxy_addr)),
    };
    let tls = match &pc.tls {
        Some(t) => Some(crate::listener::acceptor(t).map_err(StartError::Tls)?),
        None => None,
    };
    let control_tls = match &cfg.control.tls {
        Some(t) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(
            egress_api::tls::server_config(&t.cert, &t.key, Some(&t.client_ca)).map_err(StartError::ControlTls)?,
        ))),
        None => None,
    };
    let ca = if own_sink && pc.interception.ca_dir.is_none() {
        crate::ca::Authority::open_in(None, &pc)?
    } else {
        crate::ca::Authority::open(&pc)?
    };
    tracing::info!(fingerprint = %ca.fingerprint, cert = %ca.files.cert.display(), ephemeral = ca.is_ephemeral(), "appliance CA loaded");
    let shared = Shared::new(
        &cfg,
        Parts {
            facts,
            decisions,
            metrics,
            resolver: dns,
            dialer: Arc::new(TcpDial),
            me: SelfAddrs(vec![proxy_addr, control_addr]),
            proxy_authority,
            proxy_scheme,
            exporter,
            control_token: token.clone(),
            principals,
            envelope,
            config_path: opts.config_path,
            tls,
            control_tls,
            ca,
        },
    );
    // Live credentials' first values, before the first fetch can need them.
    shared.prime_credentials(&cfg.policy).await;
    crate::creds::Env::apply(&*shared);
    shared.restore_runs();
    shared.metrics.set_config(None, &cfg.policy.digest);
    let mut tasks = JoinSet::new();
    tasks.spawn(crate::data::serve(
        shared.clone(),
        proxy_l,
        None,
        shared.data_admission.clone(),
    ));
    if let Some(h) = crate::data::entrance::handoff::socket(&pc, own_sink) {
        let senders = crate::data::entrance::handoff::Senders::new(&cfg.executor);
        match crate::data::entrance::handoff::bind(&h.path) {
            Ok(l) => {
                tracing::info!(socket = %h.path.display(), only_root = senders.only_root(), "receiving listener hand-offs");
                tasks.spawn(crate::data::entrance::handoff::serve(shared.clone(), l, senders));
            }
            Err(source) if h.explicit => return Err(StartError::Handoff { path: h.path, source }),
            Err(e) => {
                tracing::warn!(socket = %h.path.display(), error = %e, "cannot listen for listener hand-offs at the default socket beside the facts store: confined children of an executor on this host cannot be bound to their runs (set [proxy] handoff)")
            }
        }
    }
    tasks.spawn(crate::control::serve(shared.clone(), control_l));
    tasks.spawn(sweeper(shared.clone()));
    tracing::info!(proxy = %proxy_addr, control = %control_addr, policy = %cfg.policy.digest, tools = cfg.policy.tools.len(), "egress proxy listening");
    Ok(Handle {
        proxy_addr,
        control_addr,
        token,
        token_source,
        shared,
        tasks,
        sinks,
    })
}

/// How often the host's interface addresses are re-read.
const HOST_ADDRS_EVERY: Duration = Duration::from_secs(10);

async fn sweeper(sh: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_addrs = std::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sh.shutdown.cancelled() => return,
        }
        let now = std::time::Instant::now();
        for run in sh.runs.sweep(now) {
            sh.run_ended(&run, EndReason::Expired);
        }
        for owner in sh.owners.take_expired(now) {
            let runs = sh.runs.live_runs_of(&owner);
            tracing::warn!(owner = %owner, runs = runs.len(), "owner's lease expired; ending its runs");
            for run in runs {
                sh.end_run(&run, EndReason::LeaseExpired);
            }
        }
        if last_addrs.elapsed() >= HOST_ADDRS_EVERY {
            last_addrs = std::time::Instant::now();
            let sh = sh.clone();
            let _ = tokio::task::spawn_blocking(move || sh.refresh_host_addrs()).await;
        }
    }
}
