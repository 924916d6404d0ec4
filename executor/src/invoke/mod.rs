//! The executor as a whole, where an invocation enters: one pool per tool
//! with a process section, started and stopped here. Its stages: `dispatch`
//! (a request to its pool, abort, ad-hoc runs), `idempotency` (keys, here and
//! fleet-wide), `journal` (what `GET /v1/invocations` lists), `retained` (the
//! answers both keep, bounded in bytes), `owner` (the lease over its runs).

pub mod dispatch;
pub mod idempotency;
pub mod journal;
pub mod owner;
pub mod retained;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProcessConfig};
use crate::confine::plan::Confinement;
use crate::invoke::idempotency::{Remembered, IDEMPOTENCY_WINDOW};
use crate::invoke::journal::Journal;
use crate::invoke::retained::Retained;
use crate::metrics::Metrics;
use crate::pool::child::{Shared, ToolSpec};
use crate::pool::Pool;
use crate::process::Spawner;
use crate::proxy::control::ControlClient;
use crate::session::Sessions;

/// Why the executor cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Confinement(#[from] crate::confine::plan::Unavailable),
    #[error("cannot start the spawner thread: {0}")]
    Spawner(std::io::Error),
    #[error("the fleet's idempotency store: {0}")]
    Fleet(#[from] egress_fleet::PgError),
    #[error("[control.tls]: {0}")]
    Tls(#[from] egress_api::tls::TlsError),
}

/// How long a warm child may wait for dispatch: its run (created at spawn)
/// must still have `cold_start_ms + timeout_ms` and a margin left when it is
/// dispatched, so it is recycled before then.
pub fn warm_max_idle(max_run: Duration, p: &ProcessConfig) -> Duration {
    let reserve = Duration::from_millis(p.cold_start_ms + p.timeout_ms + 5_000);
    max_run.saturating_sub(reserve).max(max_run / 2)
}

/// The executor.
#[derive(Debug)]
pub struct Executor {
    shared: Arc<Shared>,
    pools: BTreeMap<String, Arc<Pool>>,
    /// The session tools' sessions (`lifecycle = "session"`), by tool.
    sessions: BTreeMap<String, Arc<Sessions>>,
    config: Config,
    /// In-flight invocations by run id and idempotency key (for abort).
    inflight: Mutex<HashMap<String, (CancellationToken, Option<String>)>>,
    /// Invocations by idempotency key, running or finished within the window.
    idempotency: Mutex<HashMap<String, Remembered>>,
    /// Fleet-wide claims of idempotency keys (`[export] sink = "postgres"`
    /// with a `[cell]`): a key runs once in the whole fleet.
    claims: Option<Arc<egress_fleet::Claims>>,
    /// Running and recently finished invocations (`GET /v1/invocations`).
    journal: Mutex<Journal>,
    /// The finished answers both of them hold, bounded by `journal_max_mb`.
    retained: Retained,
    /// Set by [`Executor::shutdown`]: the cell takes no new work.
    closing: std::sync::atomic::AtomicBool,
}

impl Executor {
    /// `[control.tls]`, which the API's listener serves.
    pub fn control_tls(&self) -> Option<&egress_config::ControlTls> {
        self.config.control_tls.as_ref()
    }

    /// `[control] principals_file`, which the API reads its principals from.
    pub fn principals_file(&self) -> Option<&std::path::PathBuf> {
        self.config.principals_file.as_ref()
    }

    /// The control token, as the proxy's control API expects it.
    pub fn control_token(&self) -> Option<String> {
        self.shared.control.token().ok()
    }

    /// Build the executor and start filling every pool. Fails loudly if a
    /// tool asks for confinement that is not available.
    pub fn new(config: Config, token_env: Option<String>) -> Result<Arc<Executor>, StartError> {
        crate::error::set_cell(config.cell.as_ref());
        let mut specs = Vec::new();
        let host = crate::confine::host(&config.executor);
        for (id, process) in &config.tools {
            if let Some(p) = process {
                let confinement = Confinement::for_tool(id, p, &config.executor, &host)?;
                specs.push(ToolSpec::new(id, p.clone(), confinement));
            }
        }
        let claims = match (&config.cell, config.export.sink) {
            (Some(cell), egress_config::Sink::Postgres) => Some(Arc::new(egress_fleet::Claims::new(
                egress_fleet::pg::Connector::from_env(&config.export, "loom-egress-executor")?,
                &config.export.schema,
                &cell.id,
                cell.advertise_executor.clone(),
                IDEMPOTENCY_WINDOW,
            ))),
            _ => None,
        };
        let shared = Arc::new(Shared::new(
            Spawner::start().map_err(StartError::Spawner)?,
            ControlClient::new(config.control, &config.home, token_env).with_tls(config.control_tls.as_ref())?,
            Metrics::new(),
            config.executor.clone(),
        ));
        for s in &specs {
            shared
                .metrics
                .register_tool(&s.id, s.confinement.transparent(), s.fork.is_some());
        }
        let (session_specs, specs): (Vec<_>, Vec<_>) = specs
            .into_iter()
            .partition(|s| s.process.lifecycle == egress_config::Lifecycle::Session);
        let sessions = session_specs
            .into_iter()
            .map(|s| (s.id.clone(), Sessions::new(s, shared.clone())))
            .collect();
        let pools = specs
            .into_iter()
            .map(|s| {
                let max_idle = warm_max_idle(config.max_run, &s.process);
                (s.id.clone(), Pool::new(s, shared.clone(), max_idle))
            })
            .collect();
        Ok(Arc::new(Executor {
            shared,
            pools,
            sessions,
            inflight: Mutex::new(HashMap::new()),
            idempotency: Mutex::new(HashMap::new()),
            claims,
            journal: Mutex::new(Journal::default()),
            retained: Retained::new(
                usize::try_from(config.executor.journal_max_mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
            ),
            closing: std::sync::atomic::AtomicBool::new(false),
            config,
        }))
    }

    /// Start warming every pool (needs a tokio runtime).
    pub fn warm_up(&self) {
        for pool in self.pools.values() {
            pool.fill();
        }
        for sessions in self.sessions.values() {
            sessions.fill();
        }
    }

    /// `GET /v1/cell`: the cell, the policy of the file, invocations in
    /// flight, and the children the pools may hold at once.
    pub fn cell_view(&self) -> egress_api::CellView {
        let cell = self.config.cell.as_ref();
        let live = self.inflight.lock().map(|m| m.len()).unwrap_or(0);
        let closing = self.closing.load(std::sync::atomic::Ordering::Relaxed);
        let capacity: usize = self.config.tools.values().flatten().map(|p| p.max).sum();
        egress_api::CellView {
            id: cell.map(|c| c.id.clone()),
            epoch: None,
            policy: self.config.policy_digest.clone(),
            live_runs: live as u64,
            pool_capacity: Some(capacity as u64),
            ready: !closing,
            reason: closing.then(|| "shutting_down".to_owned()),
            export_lag: None,
            advertise_proxy: cell.and_then(|c| c.advertise_proxy.clone()),
            advertise_control: cell.and_then(|c| c.advertise_control.clone()),
            advertise_executor: cell.and_then(|c| c.advertise_executor.clone()),
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The pool of `tool`, if it has a process section.
    pub fn pool(&self, tool: &str) -> Option<&Arc<Pool>> {
        self.pools.get(tool)
    }

    /// The sessions of `tool`, if it is a session tool.
    pub fn sessions(&self, tool: &str) -> Option<&Arc<Sessions>> {
        self.sessions.get(tool)
    }

    /// Whether the executor is stopping (it opens no session then).
    pub fn closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Make this process the subreaper of its children's descendants and
    /// sweep escapees (see `reaper`) after every kill of a process-group
    /// child and twice a second.
    /// Only for a process whose children all come from this executor.
    pub fn enable_subreaper(&self) -> std::io::Result<()> {
        let reaper = self.shared.spawner.reaper().clone();
        reaper.enable()?;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                reaper.sweep();
            }
        });
        Ok(())
    }

    /// Sweep escaped descendants until none turn up (bounded: a second at
    /// most). For `run`, before the process exits.
    pub async fn settle(&self) {
        let reaper = self.shared.spawner.reaper();
        if !reaper.enabled() {
            return;
        }
        let mut quiet = 0;
        for _ in 0..50 {
            if reaper.sweep() == 0 {
                quiet += 1;
                if quiet >= 3 {
                    return;
                }
            } else {
                quiet = 0;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stop refilling and kill idle children.
    pub fn shutdown(&self) {
        self.closing.store(true, std::sync::atomic::Ordering::Relaxed);
        for pool in self.pools.values() {
            pool.close();
        }
        for sessions in self.sessions.values() {
            sessions.close();
        }
    }

    /// After `shutdown`: wait (at most `within`) until every child is gone,
    /// so idle children's runs are ended on the proxy before the process exits.
    pub async fn drain(&self, within: Duration) {
        let end = tokio::time::Instant::now() + within;
        let live = || self.pools.values().any(|p| p.live() > 0) || self.sessions.values().any(|s| s.live() > 0);
        while live() && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
