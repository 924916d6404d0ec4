//! Starting and stopping the proxy: binds the data and control listeners,
//! owns the shared state, runs the accept loop (bounded by
//! `max_connections`, hyper HTTP/1.1 with upgrades, header size limit and
//! header read timeout), the run-expiry sweeper, and graceful shutdown.

use crate::admission::{Admission, Conn};
use crate::dns::Dns;
use crate::facts::{FactSink, MemorySink};
use crate::metrics::{Metrics, ToolMetrics};
use crate::policy::{HostAddrs, SelfAddrs};
use crate::runs::{EndReason, Gauged, Run, Runs};
use arc_swap::ArcSwap;
use egress_config::{Config, Policy, ProxyConfig};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// State shared by the data plane and the control API.
pub struct Shared {
    /// Random per process start: clients that see it change know the proxy
    /// restarted (their open connections are gone; stored runs are back).
    pub instance: String,
    pub runs: Runs,
    pub owners: crate::owners::Owners,
    pub policy: ArcSwap<Policy>,
    pub facts: Arc<dyn FactSink>,
    pub dns: Dns,
    pub me: SelfAddrs,
    /// This host's interface addresses, refreshed on reload and by the sweeper.
    pub host_addrs: ArcSwap<HostAddrs>,
    pub cfg: ProxyConfig,
    pub metrics: Metrics,
    tool_metrics: papaya::HashMap<Arc<str>, Arc<ToolMetrics>>,
    /// Stop accepting data connections; they finish their in-flight request,
    /// and `/readyz` answers 503 from now on.
    pub shutdown: CancellationToken,
    /// Close the control listener: the last step of a graceful stop, so that
    /// kernels and load balancers can watch the drain.
    pub control_stop: CancellationToken,
    /// The drain timeout expired: cut tunnels and streaming bodies.
    pub hard_stop: CancellationToken,
    /// Client connections and tunnels, so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// `host:port` clients use to reach the data listener.
    pub proxy_authority: String,
    pub control_token: String,
    pub config_path: Option<PathBuf>,
    /// TLS for both listeners, when configured.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// `http` or `https`: how clients reach the data listener.
    pub proxy_scheme: &'static str,
    /// Connection admission of the data and control listeners.
    pub data_admission: Arc<crate::admission::Admission>,
    pub control_admission: Arc<crate::admission::Admission>,
    /// Places for concurrent `/v1/facts/stream` readers.
    pub event_streams: Arc<Semaphore>,
}

impl Shared {
    /// Per-tool metric handles: one lock-free lookup on the data path. A tool
    /// gets its own handles once it is in the policy (so the label set stays
    /// bounded by the config); anything else shares `_unknown`.
    pub fn tool_metrics(&self, tool: Option<&str>) -> Arc<ToolMetrics> {
        let map = self.tool_metrics.pin();
        if let Some(m) = tool.and_then(|t| map.get(t)) {
            return m.clone();
        }
        let name = match tool {
            Some(t) if self.policy.load().tools.contains_key(t) => t,
            _ => "_unknown",
        };
        map.get_or_insert_with(Arc::from(name), || self.metrics.tool(name))
            .clone()
    }

    /// Whether a just-connected upstream socket is a connection to one of our
    /// own listeners (catches listeners bound to unspecified addresses).
    pub fn is_self_connection(&self, s: &TcpStream) -> bool {
        match (s.local_addr(), s.peer_addr()) {
            (Ok(l), Ok(p)) => l.ip() == p.ip() && self.me.0.iter().any(|m| m.port() == p.port()),
            _ => false,
        }
    }

    /// Re-reads this host's interface addresses (start, reload, sweeper).
    pub fn refresh_host_addrs(&self) {
        let now = read_host_addrs();
        if **self.host_addrs.load() != now {
            tracing::info!(addresses = ?now.0, "host interface addresses changed");
            self.host_addrs.store(Arc::new(now));
        }
    }

    /// Counts a connection closed by an admission rule.
    pub fn count_closed(&self, listener: &'static str, reason: &'static str) {
        self.metrics
            .conns_refused
            .get_or_create(&crate::metrics::ListenerReason { listener, reason })
            .inc();
    }

    /// Counts a non-policy fetch error (error paths only: takes the family lock).
    pub fn count_error(&self, tool: &str, e: crate::deny::FetchError) {
        self.metrics
            .errors
            .get_or_create(&crate::metrics::ToolReason {
                tool: tool.to_owned(),
                reason: e.code(),
            })
            .inc();
    }

    /// Ends a run and keeps the run gauges in step.
    /// Ends a run and keeps the run gauges in step. Its stored record is
    /// dropped in the background, except at shutdown: runs survive a restart
    /// (`DELETE /v1/runs/{id}` drops it itself, before answering).
    pub fn end_run(&self, run: &Run, why: EndReason) -> bool {
        let ended = self.runs.end(run, why);
        if ended {
            self.run_ended(run, why);
            if !matches!(why, EndReason::Shutdown | EndReason::Ended) {
                let facts = self.facts.clone();
                let id = run.id.to_string();
                tokio::spawn(async move {
                    if let Err(e) = facts.save_run(crate::runs::RunWrite::Delete(id)).await {
                        tracing::warn!(error = %e, "could not drop an ended run's record");
                    }
                });
            }
        }
        ended
    }

    /// Brings back the runs the store kept across a restart, and gives each
    /// of their owners a grace lease to renew.
    fn restore_runs(&self) {
        let records = match self.facts.load_runs() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "stored runs cannot be read; starting without them");
                return;
            }
        };
        let total = records.len();
        let mut restored = 0;
        for rec in records {
            let id = rec.id.clone();
            match self.runs.restore(rec) {
                Some(run) => {
                    if let Some(owner) = &run.owner {
                        if self.owners.lease(owner).is_none() {
                            let _ = self.owners.renew(owner, crate::owners::RESTART_GRACE);
                        }
                    }
                    self.run_created(&run);
                    restored += 1;
                }
                None => {
                    let facts = self.facts.clone();
                    tokio::spawn(async move {
                        let _ = facts.save_run(crate::runs::RunWrite::Delete(id)).await;
                    });
                }
            }
        }
        if total > 0 {
            tracing::info!(restored, dropped = total - restored, "runs restored from the store");
        }
    }

    /// Activates a run and moves it from the created to the active gauge.
    pub fn activate_run(&self, id: &str) -> Result<Arc<Run>, crate::runs::RunError> {
        let run = self.runs.activate(id)?;
        if run
            .gauged
            .compare_exchange(Gauged::CREATED, Gauged::ACTIVE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let tm = self.tool_metrics(Some(&run.tool));
            tm.runs_created.dec();
            tm.runs_active.inc();
        }
        Ok(run)
    }

    /// Counts a new run in the gauge of its state.
    pub fn run_created(&self, run: &Run) {
        let tm = self.tool_metrics(Some(&run.tool));
        match run.gauged.load(Ordering::Acquire) {
            Gauged::CREATED => {
                tm.runs_created.inc();
            }
            Gauged::ACTIVE => {
                tm.runs_active.inc();
            }
            _ => {}
        }
    }

    /// Accounts for a run that has just ended (by its kernel, expiry or shutdown).
    fn run_ended(&self, run: &Run, why: EndReason) {
        let tm = self.tool_metrics(Some(&run.tool));
        match run.gauged.swap(Gauged::NONE, Ordering::AcqRel) {
            Gauged::CREATED => {
                tm.runs_created.dec();
            }
            Gauged::ACTIVE => {
                tm.runs_active.dec();
            }
            _ => {}
        }
        self.metrics
            .runs_ended
            .get_or_create(&crate::metrics::ToolWhy {
                tool: run.tool.to_string(),
                why: why.as_str(),
            })
            .inc();
        tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, why = why.as_str(), "run ended");
    }
}

/// How to start a proxy.
pub struct Options {
    pub config: Config,
    /// The file the config came from (for reloads); `None` = embedded default.
    pub config_path: Option<PathBuf>,
    /// Control token; `None` = from the environment or the token file.
    pub control_token: Option<String>,
    /// Fact sink; `None` = the default store.
    pub facts: Option<Arc<dyn FactSink>>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind {what} listener {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsInitError),
    #[error("control token: {0}")]
    Token(#[from] crate::token::TokenError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
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
    pub token_source: Option<crate::token::TokenSource>,
    pub shared: Arc<Shared>,
    tasks: JoinSet<()>,
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

/// Binds both listeners and starts serving.
pub async fn start(opts: Options) -> Result<Handle, StartError> {
    let cfg = opts.config;
    let pc = cfg.proxy.clone();
    let proxy_l = TcpListener::bind(pc.listen).await.map_err(|source| StartError::Bind {
        what: "proxy",
        addr: pc.listen,
        source,
    })?;
    let control_l = TcpListener::bind(pc.control).await.map_err(|source| StartError::Bind {
        what: "control",
        addr: pc.control,
        source,
    })?;
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
            let (t, s) = crate::token::resolve(std::env::var(crate::token::TOKEN_ENV).ok(), &pc.facts)?;
            (t, Some(s))
        }
    };
    let metrics = Metrics::new();
    let facts: Arc<dyn FactSink> = match opts.facts {
        Some(f) => f,
        None if pc.facts.as_os_str() == ":memory:" => {
            tracing::warn!("facts = \":memory:\": denial facts are kept in memory only and lost on exit");
            Arc::new(MemorySink::new(100_000))
        }
        None => Arc::new(crate::store::SqliteStore::open(
            &pc.facts,
            crate::store::Limits {
                max_bytes: pc.facts_max_bytes,
                retention: pc.facts_retention,
            },
            metrics.store.clone(),
        )),
    };
    let dns = Dns::new(&pc.dns)?;
    let tls = match &pc.tls {
        Some(t) => Some(crate::tls::acceptor(t)?),
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let evicted = |listener| {
        metrics
            .conns_refused
            .get_or_create(&crate::metrics::ListenerReason {
                listener,
                reason: "evicted",
            })
            .clone()
    };
    let data_admission = Admission::new(pc.max_pending_connections, pc.max_connections, evicted("data"));
    let control_admission = Admission::new(
        pc.max_pending_connections,
        pc.max_control_connections,
        evicted("control"),
    );
    let shared = Arc::new(Shared {
        instance: uuid::Uuid::new_v4().to_string(),
        runs: Runs::new(pc.max_runs, pc.max_run),
        owners: crate::owners::Owners::default(),
        policy: ArcSwap::new(cfg.policy.clone()),
        facts,
        dns,
        me: SelfAddrs(vec![proxy_addr, control_addr]),
        host_addrs: ArcSwap::from_pointee(read_host_addrs()),
        cfg: pc.clone(),
        metrics,
        tool_metrics: papaya::HashMap::new(),
        shutdown: CancellationToken::new(),
        control_stop: CancellationToken::new(),
        hard_stop: CancellationToken::new(),
        tasks: TaskTracker::new(),
        proxy_authority: advertised(proxy_addr),
        control_token: token.clone(),
        config_path: opts.config_path,
        tls,
        proxy_scheme: scheme,
        data_admission,
        control_admission,
        event_streams: Arc::new(Semaphore::new(pc.max_event_streams)),
    });
    for tool in cfg.policy.tools.keys() {
        shared.tool_metrics(Some(tool));
    }
    shared.tool_metrics(None);
    shared.restore_runs();
    shared.metrics.set_config(None, &cfg.policy.digest);
    let mut tasks = JoinSet::new();
    tasks.spawn(accept_loop(shared.clone(), proxy_l, None));
    if let Some(path) = &pc.handoff {
        let l = crate::handoff::bind(path).map_err(|source| StartError::Handoff {
            path: path.clone(),
            source,
        })?;
        tasks.spawn(crate::handoff::serve(shared.clone(), l));
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
    })
}

/// This host's interface addresses (every interface, every family). On
/// failure the previous answer is kept by the caller's comparison, and an
/// empty set only means nothing extra is denied beyond the range table.
fn read_host_addrs() -> HostAddrs {
    match if_addrs::get_if_addrs() {
        Ok(list) => {
            let mut v: Vec<std::net::IpAddr> = list.iter().map(|i| i.ip().to_canonical()).collect();
            v.sort();
            v.dedup();
            HostAddrs(v)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the host's interface addresses");
            HostAddrs::default()
        }
    }
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

/// Serves the data listener, or (`bound`) a listener handed over for one run.
pub(crate) async fn accept_loop(sh: Arc<Shared>, listener: TcpListener, bound: Option<crate::auth::BoundRun>) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(sh.cfg.header_read_timeout)
        .max_buf_size(sh.cfg.max_header_bytes.max(8192) + 1024)
        .max_header_size(sh.cfg.max_header_bytes)
        .max_headers(128)
        .keep_alive(true)
        .half_close(false);
    let builder = Arc::new(builder);
    // Accepting never waits for a place: admission decides per connection.
    while let Some(stream) = accept(&sh.shutdown, &listener).await {
        let sh2 = sh.clone();
        let builder = builder.clone();
        let conn = Arc::new(sh.data_admission.admit(CancellationToken::new()));
        let bound = bound.clone();
        sh.tasks.spawn(async move {
            let svc_sh = sh2.clone();
            let svc_conn = conn.clone();
            let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                if let Some(b) = &bound {
                    req.extensions_mut().insert(b.clone());
                }
                crate::fetch::handle(svc_sh.clone(), req, svc_conn.clone())
            });
            let serve = async {
                match &sh2.tls {
                    None => {
                        serve_one(
                            &sh2.shutdown,
                            &sh2.hard_stop,
                            &conn.cut,
                            builder.serve_connection(TokioIo::new(stream), svc).with_upgrades(),
                        )
                        .await
                    }
                    Some(acceptor) => {
                        let hs = tokio::time::timeout(sh2.cfg.pending_head_timeout, acceptor.accept(stream)).await;
                        if let Ok(Ok(tls)) = hs {
                            serve_one(
                                &sh2.shutdown,
                                &sh2.hard_stop,
                                &conn.cut,
                                builder.serve_connection(TokioIo::new(tls), svc).with_upgrades(),
                            )
                            .await;
                        }
                    }
                }
            };
            tokio::select! {
                _ = serve => {}
                _ = pending_deadline(&conn, sh2.cfg.pending_head_timeout) => sh2.count_closed("data", "head_timeout"),
            }
        });
    }
    drop(listener);
}

/// Resolves when `conn` is still pending `timeout` after it was accepted
/// (never, once it is established).
pub(crate) async fn pending_deadline(conn: &Conn, timeout: Duration) {
    tokio::time::sleep(timeout).await;
    if !conn.is_pending() {
        std::future::pending::<()>().await;
    }
}

/// Accepts one TCP connection, backing off on errors such as EMFILE.
pub(crate) async fn accept(stop: &CancellationToken, listener: &TcpListener) -> Option<TcpStream> {
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    return Some(s);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.cancelled() => return None,
        }
    }
}

/// Drives one hyper connection; drops it at once when `cut` fires; when
/// `stop` fires lets it finish its in-flight request (graceful), and drops
/// it when `hard` fires.
pub(crate) async fn serve_one<C>(stop: &CancellationToken, hard: &CancellationToken, cut: &CancellationToken, conn: C)
where
    C: std::future::Future + GracefulConn,
{
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = cut.cancelled() => {}
        _ = stop.cancelled() => {
            conn.as_mut().graceful();
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = cut.cancelled() => {}
                _ = hard.cancelled() => {}
            }
        }
    }
}

/// hyper connections that can shut down gracefully.
pub(crate) trait GracefulConn {
    fn graceful(self: std::pin::Pin<&mut Self>);
}

impl<I, S> GracefulConn for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

impl<I, S> GracefulConn for hyper::server::conn::http1::Connection<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}
