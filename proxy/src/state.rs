//! The proxy's shared state: the run registry, owners, the policy in force,
//! the fact sink, the resolver, metrics, the stop signals and the connection
//! admission of both listeners. Both planes hold an `Arc<Shared>`; it owns
//! no listener (those are in `data` and `control`, started by `server`).

use crate::addrs::{read_host_addrs, HostAddrs, SelfAddrs};
use crate::admission::Admission;
use crate::ca::Authority;
use crate::deny::FetchError;
use crate::dns::{Dial, Resolve};
use crate::facts::FactSink;
use crate::metrics::{ListenerReason, Metrics, ToolMetrics, ToolReason, ToolWhy};
use crate::runs::owners::{Owners, RESTART_GRACE};
use crate::runs::{EndReason, Gauged, Run, RunError, RunWrite, Runs};
use arc_swap::ArcSwap;
use egress_config::{Config, Policy, ProxyConfig};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// State shared by the data plane and the control API.
pub struct Shared {
    /// Random per process start: clients that see it change know the proxy
    /// restarted (their open connections are gone; stored runs are back).
    pub instance: String,
    pub runs: Runs,
    pub owners: Owners,
    pub policy: ArcSwap<Policy>,
    pub facts: Arc<dyn FactSink>,
    /// Allowed fetches, recorded off the answer path (`[proxy] decisions`).
    pub decisions: Arc<crate::facts::decisions::DecisionLog>,
    /// How fetches resolve names and dial vetted addresses.
    pub resolver: Arc<dyn Resolve>,
    pub dialer: Arc<dyn Dial>,
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
    /// Who may use the control API: the control token's principal and the
    /// principals file's (replaced on reload).
    pub principals: ArcSwap<egress_config::principals::Principals>,
    /// Refused control credentials not yet in a fact (`control::actions`).
    pub refused_credentials: std::sync::atomic::AtomicU64,
    /// `[proxy] envelope`'s policy: no policy in force, and no grant, may
    /// reach beyond it (replaced on reload).
    pub envelope: arc_swap::ArcSwapOption<Policy>,
    /// `[control] metrics_require_token`: `/metrics` needs the `metrics` scope.
    pub metrics_require_token: bool,
    pub config_path: Option<PathBuf>,
    /// TLS for both listeners, when configured.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// `[control.tls]`: the control listener's TLS, asking for client
    /// certificates (wins over `tls` there).
    pub control_tls: Option<tokio_rustls::TlsAcceptor>,
    /// The appliance CA of intercepted CONNECTs (replaced on reload after a
    /// rotation).
    pub ca: ArcSwap<Authority>,
    /// `http` or `https`: how clients reach the data listener.
    pub proxy_scheme: &'static str,
    /// Connection admission of the data and control listeners.
    pub data_admission: Arc<Admission>,
    pub control_admission: Arc<Admission>,
    /// Places for concurrent `/v1/facts/stream` readers.
    pub event_streams: Arc<Semaphore>,
    /// `[cell]` (`None`: a machine of its own).
    pub cell: Option<egress_config::CellConfig>,
    /// The fleet exporter, with `[export] sink = "postgres"`.
    pub exporter: Option<crate::facts::export::Exporter>,
    /// `[export]` as started.
    pub export_cfg: egress_config::ExportConfig,
    /// Live credential sources and their refreshers.
    pub creds: crate::creds::Live,
    /// This state, for the refreshers (they hold no strong reference).
    this: std::sync::Weak<Shared>,
}

/// What [`Shared::new`] needs besides the config.
pub(crate) struct Parts {
    pub facts: Arc<dyn FactSink>,
    pub decisions: Arc<crate::facts::decisions::DecisionLog>,
    pub metrics: Metrics,
    pub resolver: Arc<dyn Resolve>,
    pub dialer: Arc<dyn Dial>,
    pub me: SelfAddrs,
    pub proxy_authority: String,
    pub control_token: String,
    pub principals: egress_config::principals::Principals,
    pub envelope: Option<Arc<Policy>>,
    pub config_path: Option<PathBuf>,
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    pub control_tls: Option<tokio_rustls::TlsAcceptor>,
    pub ca: Authority,
    pub exporter: Option<crate::facts::export::Exporter>,
    /// `http` or `https` (from `cell.advertise_proxy`, else the listener's TLS).
    pub proxy_scheme: &'static str,
}

impl Shared {
    /// The state of a proxy with `cfg`, every tool's metrics created at 0.
    pub(crate) fn new(cfg: &Config, p: Parts) -> Arc<Shared> {
        let pc = &cfg.proxy;
        let evicted = |listener| {
            p.metrics
                .conns_refused
                .get_or_create(&ListenerReason {
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
        let shared = Arc::new_cyclic(|this| Shared {
            this: this.clone(),
            creds: crate::creds::Live::default(),
            instance: uuid::Uuid::new_v4().to_string(),
            runs: Runs::new(pc.max_runs, pc.max_run),
            owners: Owners::default(),
            policy: ArcSwap::new(cfg.policy.clone()),
            facts: p.facts,
            decisions: p.decisions,
            resolver: p.resolver,
            dialer: p.dialer,
            me: p.me,
            host_addrs: ArcSwap::from_pointee(read_host_addrs()),
            cfg: pc.clone(),
            metrics: p.metrics,
            tool_metrics: papaya::HashMap::new(),
            shutdown: CancellationToken::new(),
            control_stop: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            tasks: TaskTracker::new(),
            proxy_authority: p.proxy_authority,
            control_token: p.control_token,
            principals: ArcSwap::from_pointee(p.principals),
            refused_credentials: Default::default(),
            envelope: arc_swap::ArcSwapOption::new(p.envelope),
            metrics_require_token: cfg.control.metrics_require_token,
            config_path: p.config_path,
            proxy_scheme: p.proxy_scheme,
            tls: p.tls,
            control_tls: p.control_tls,
            ca: ArcSwap::from_pointee(p.ca),
            data_admission,
            control_admission,
            event_streams: Arc::new(Semaphore::new(pc.max_event_streams)),
            cell: cfg.cell.clone(),
            exporter: p.exporter,
            export_cfg: cfg.export.clone(),
        });
        shared.on_policy(&cfg.policy);
        shared.publish_cell_info();
        shared.tool_metrics(None);
        shared
    }

    /// Starts the refreshers of `policy`'s new live credentials and waits
    /// for their first reads (start and reload call this before the policy
    /// goes into force, then [`Shared::adopt_credentials`] on it).
    pub async fn prime_credentials(&self, policy: &Policy) {
        let env: std::sync::Weak<dyn crate::creds::Env> = self.this.clone();
        self.creds.prime(env, policy).await;
    }

    /// Writes the live credentials' values into `policy`.
    pub fn adopt_credentials(&self, policy: &mut Arc<Policy>) {
        if policy.tools.values().any(|t| {
            t.credentials
                .iter()
                .any(|c| matches!(c.source, egress_config::SecretSource::Live(_)))
        }) {
            self.creds.adopt(Arc::make_mut(policy));
        }
    }

    /// Sets `egress_cell_info{cell,epoch,policy}` from the cell, the
    /// store and the policy in force (at start and on every reload).
    pub fn publish_cell_info(&self) {
        self.metrics.set_cell_info(crate::metrics::CellInfo {
            cell: self.cell.as_ref().map(|c| c.id.clone()).unwrap_or_default(),
            epoch: self.facts.epoch().unwrap_or_default(),
            policy: self.policy.load().digest.clone(),
        });
    }

    /// Why the proxy is not ready, if it is not: `shutting_down`,
    /// `fact_store`, `cell_id_in_use` or `export_lag` (the first that holds).
    pub fn unready(&self) -> Option<&'static str> {
        if self.shutdown.is_cancelled() {
            return Some("shutting_down");
        }
        if !self.facts.ready() {
            return Some("fact_store");
        }
        if let Some(e) = &self.exporter {
            if e.state.cell_in_use.load(Ordering::Acquire) {
                return Some("cell_id_in_use");
            }
            if e.state.lag(&*self.facts) > e.state.max_lag {
                return Some("export_lag");
            }
        }
        None
    }

    /// Unexported facts (0 without an exporter).
    pub fn export_lag(&self) -> u64 {
        self.exporter.as_ref().map_or(0, |e| e.state.lag(&*self.facts))
    }

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

    /// What follows a policy coming into force (at start and after each
    /// reload): the series of every tool and credential exist (at 0), and
    /// each credential that may go in cleartext to any address is warned of.
    pub fn on_policy(&self, policy: &egress_config::Policy) {
        for (id, tool) in &policy.tools {
            self.tool_metrics(Some(id));
            for event in ["granted", "used", "asked"] {
                let _ = self.metrics.grants(id, event);
            }
            for c in &tool.credentials {
                let _ = self.metrics.credential_scrubs(id, &c.name);
                if c.allow_plaintext == egress_config::Plaintext::Anywhere {
                    tracing::warn!(
                        tool = %id,
                        credential = %c.name,
                        "allow_plaintext = \"force\": this credential's secret goes in plain HTTP to any address its hosts resolve to; whoever holds or intercepts that address reads it"
                    );
                }
            }
        }
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
            .get_or_create(&ListenerReason { listener, reason })
            .inc();
    }

    /// Counts a non-policy fetch error (error paths only: takes the family lock).
    pub fn count_error(&self, tool: &str, e: FetchError) {
        self.metrics
            .errors
            .get_or_create(&ToolReason {
                tool: tool.to_owned(),
                reason: e.code(),
            })
            .inc();
    }

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
                    if let Err(e) = facts.save_run(RunWrite::Delete(id)).await {
                        tracing::warn!(error = %e, "could not drop an ended run's record");
                    }
                });
            }
        }
        ended
    }

    /// Brings back the runs the store kept across a restart, and gives each
    /// of their owners a grace lease to renew.
    pub(crate) fn restore_runs(&self) {
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
                            let _ = self.owners.renew(owner, RESTART_GRACE, None);
                        }
                    }
                    self.run_created(&run);
                    restored += 1;
                }
                None => {
                    let facts = self.facts.clone();
                    tokio::spawn(async move {
                        let _ = facts.save_run(RunWrite::Delete(id)).await;
                    });
                }
            }
        }
        if total > 0 {
            tracing::info!(restored, dropped = total - restored, "runs restored from the store");
        }
    }

    /// Activates a run and moves it from the created to the active gauge.
    pub fn activate_run(&self, id: &str) -> Result<Arc<Run>, RunError> {
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
    pub(crate) fn run_ended(&self, run: &Run, why: EndReason) {
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
            .get_or_create(&ToolWhy {
                tool: run.tool.to_string(),
                why: why.as_str(),
            })
            .inc();
        tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, why = why.as_str(), "run ended");
    }
}

impl crate::creds::Env for Shared {
    fn resolver(&self) -> &dyn Resolve {
        &*self.resolver
    }

    fn dialer(&self) -> &dyn Dial {
        &*self.dialer
    }

    fn ranges(&self) -> egress_config::RangeTable {
        self.policy.load().ranges.clone()
    }

    fn authority(&self) -> Arc<Authority> {
        self.ca.load_full()
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A new policy only when a value, a usable time or an earlier value
    /// changed; the tools without live credentials are shared with the old.
    fn apply(&self) {
        self.policy.rcu(|p| {
            let mut next = Policy::clone(p);
            if self.creds.adopt(&mut next) {
                Arc::new(next)
            } else {
                Arc::clone(p)
            }
        });
    }
}
