//! The executor as a whole: one pool per tool with a process section, the
//! registry of in-flight invocations (for abort), and ad-hoc single runs.
//! `serve` and `run` are thin layers over this.

pub mod retained;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProcessConfig};
use crate::confine::plan::Confinement;
use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::invoke::retained::{Kept, Retained};
use crate::metrics::Metrics;
use crate::pool::child::{Request, Shared, ToolSpec, Warm};
use crate::pool::Pool;
use crate::process::Spawner;
use crate::proxy::control::ControlClient;

/// Why the executor cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Confinement(#[from] crate::confine::plan::Unavailable),
    #[error("cannot start the spawner thread: {0}")]
    Spawner(std::io::Error),
    #[error("the fleet's idempotency store: {0}")]
    Fleet(#[from] egress_fleet::PgError),
}

/// How long a warm child may wait for dispatch: its run (created at spawn)
/// must still have `cold_start_ms + timeout_ms` and a margin left when it is
/// dispatched, so it is recycled before then.
pub fn warm_max_idle(max_run: Duration, p: &ProcessConfig) -> Duration {
    let reserve = Duration::from_millis(p.cold_start_ms + p.timeout_ms + 5_000);
    max_run.saturating_sub(reserve).max(max_run / 2)
}

/// `POST /v1/invocations` body.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InvocationRequest {
    /// A tool of the config with a `[tools.<id>.process]` section.
    pub tool: String,
    /// Handed to the tool as it is; `null` when absent.
    #[serde(default)]
    pub input: Value,
    /// The run's id on the proxy (a dedicated cold child); a warm child's
    /// run when absent.
    #[serde(default)]
    #[schema(schema_with = egress_api::rules::invocation_run_id_schema)]
    pub run_id: Option<String>,
    /// A repeat with the same key and request gets the first answer (in a
    /// fleet, at any cell).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 256)]
    pub idempotency_key: Option<String>,
    /// At most the tool's `timeout_ms`, which applies when absent.
    #[serde(default, deserialize_with = "egress_api::rules::whole::option_u64")]
    #[schema(minimum = 1)]
    pub timeout_ms: Option<u64>,
}

/// The executor.
#[derive(Debug)]
pub struct Executor {
    shared: Arc<Shared>,
    pools: BTreeMap<String, Arc<Pool>>,
    config: Config,
    /// In-flight invocations by run id and idempotency key (for abort).
    inflight: Mutex<HashMap<String, CancellationToken>>,
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

/// Finished invocations listed by `GET /v1/invocations` (the oldest go
/// first); their answers' bodies are bounded in bytes by `journal_max_mb`.
pub const JOURNAL_MAX: usize = 1000;

/// One invocation as `GET /v1/invocations` lists it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct InvocationSummary {
    pub invocation_id: String,
    pub tool: String,
    /// `running` or `done`.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// `ok` or the error kind, once done.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Default)]
struct Journal {
    running: HashMap<String, InvocationSummary>,
    /// Newest last.
    done: std::collections::VecDeque<(InvocationSummary, Arc<Kept>)>,
}

/// What `GET /v1/invocations/{id}` finds.
#[derive(Debug)]
pub enum Found {
    Running(InvocationSummary),
    /// The answer as kept (whole, or its stub once the body was dropped).
    Done(Arc<Kept>),
}

/// An invocation's answer: as it came now, or as it was kept.
#[derive(Debug)]
pub enum Answer {
    /// Ran now, or failed before running: the live result, and its JSON
    /// when it was already serialized (to be kept).
    Live(Box<InvocationResult>, Option<bytes::Bytes>),
    /// Given again for a repeated idempotency key.
    Kept(Arc<Kept>),
    /// Given again for a key another cell of the fleet ran: its HTTP
    /// status and its JSON exactly as that cell sent them.
    Stored(u16, bytes::Bytes),
}

impl Answer {
    /// A failure before any child was involved.
    fn failed(tool: &str, error: InvokeError) -> Answer {
        Answer::Live(Box::new(InvocationResult::failed(tool, error)), None)
    }

    /// The answer as a result (a kept body is parsed again).
    pub fn result(self) -> InvocationResult {
        match self {
            Answer::Live(r, _) => *r,
            other => other.to_result(),
        }
    }

    /// [`Answer::result`] without consuming the answer.
    fn to_result(&self) -> InvocationResult {
        match self {
            Answer::Live(r, _) => (**r).clone(),
            Answer::Kept(k) => k.answer(),
            Answer::Stored(_, json) => serde_json::from_slice(json).unwrap_or_else(|e| {
                InvocationResult::failed(
                    "",
                    InvokeError::new(
                        ErrorKind::Protocol,
                        format!("the fleet's stored answer is not a result: {e}"),
                    ),
                )
            }),
        }
    }

    /// The HTTP status and JSON body of `POST /v1/invocations`: serialized
    /// once (what was serialized to be kept is sent as it is).
    pub fn into_http(self) -> (u16, bytes::Bytes) {
        match self {
            Answer::Live(r, json) => {
                let status = r.error.as_ref().map_or(200, |e| e.kind.http_status());
                let json = json.unwrap_or_else(|| serde_json::to_vec(&r).unwrap_or_default().into());
                (status, json)
            }
            Answer::Kept(k) => (k.status(), k.answer_json()),
            Answer::Stored(status, json) => (status, json),
        }
    }
}

/// One invocation just run: its result, its JSON, and what is kept of it.
struct Done {
    result: InvocationResult,
    json: bytes::Bytes,
    kept: Arc<Kept>,
}

impl From<Done> for Answer {
    fn from(d: Done) -> Answer {
        Answer::Live(Box::new(d.result), Some(d.json))
    }
}

/// Removes a running entry whose invocation was dropped unfinished.
struct Journaled<'a> {
    exec: &'a Executor,
    id: Option<String>,
}

impl Drop for Journaled<'_> {
    fn drop(&mut self) {
        if let (Some(id), Ok(mut j)) = (self.id.take(), self.exec.journal.lock()) {
            j.running.remove(&id);
        }
    }
}

/// How long a finished invocation's answer is kept for its idempotency key.
pub const IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(600);
/// Keys remembered at most (the oldest finished ones are forgotten first).
const IDEMPOTENCY_MAX: usize = 10_000;
/// The longest idempotency key, in characters (at most 1 KiB).
pub const IDEMPOTENCY_KEY_MAX: usize = 256;
/// How long past its `cold_start_ms + timeout_ms` a fleet claim whose cell
/// never finished it (the cell died) is held before another cell may run
/// the key again: by then the tool has been killed by its own deadline.
const CLAIM_MARGIN: Duration = Duration::from_secs(60);

/// What an idempotency key stands for.
#[derive(Debug)]
struct Remembered {
    /// Digest of the request (tool, input, run id, timeout) that used the key.
    fingerprint: String,
    /// `None` while the invocation runs, then its answer as kept.
    answer: tokio::sync::watch::Receiver<Option<Arc<Kept>>>,
    finished: Option<Instant>,
}

/// The SHA-256 of the request (tool, input, run id, timeout), hex: the same
/// in every process, so cells of a fleet compare it, and the same for every
/// client's spelling of one input (see [`canonical`]).
fn fingerprint(req: &InvocationRequest) -> String {
    use sha2::{Digest, Sha256};
    let mut text = String::new();
    canonical(
        &serde_json::json!([req.tool, req.input, req.run_id, req.timeout_ms]),
        &mut text,
    );
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `v` as canonical JSON: object keys sorted, and a number with an integral
/// value written as an integer (`3.0` and `3` are one number, as a
/// JavaScript client sends it).
fn canonical(v: &Value, out: &mut String) {
    use std::fmt::Write as _;
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
                let _ = write!(out, "{}", f as i64);
            }
            _ => {
                let _ = write!(out, "{n}");
            }
        },
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}:", Value::String(k.clone()));
                canonical(&map[k], out);
            }
            out.push('}');
        }
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

/// Forgets a running key whose invocation was dropped before it finished.
struct Unfinished<'a> {
    exec: &'a Executor,
    key: Option<String>,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let (Some(k), Ok(mut m)) = (self.key.take(), self.exec.idempotency.lock()) {
            if m.get(&k).is_some_and(|r| r.finished.is_none()) {
                m.remove(&k);
            }
        }
    }
}

/// A keyed invocation, claimed or not.
enum Claimed {
    /// It ran here.
    Ran(Box<Done>),
    /// It did not run here: the fleet's answer, and whether it is final (to
    /// be remembered for the key here too).
    Elsewhere(Answer, bool),
}

/// Gives a won fleet claim up if its invocation is dropped before it ends
/// (the caller went away), so a retry may run it, as on one executor.
struct Release {
    claims: Arc<egress_fleet::Claims>,
    key: String,
    id: Option<String>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let (Some(id), Ok(rt)) = (self.id.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let (claims, key) = (self.claims.clone(), std::mem::take(&mut self.key));
        rt.spawn(async move {
            if let Err(e) = claims.release(&key, &id).await {
                tracing::warn!(error = %e, "an abandoned claim could not be released; it expires on its own");
            }
        });
    }
}

/// Removes an invocation from the abort registry when it ends.
struct Registration<'a> {
    exec: &'a Executor,
    keys: Vec<String>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Ok(mut m) = self.exec.inflight.lock() {
            for k in &self.keys {
                m.remove(k);
            }
        }
    }
}

impl Executor {
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
            ControlClient::new(config.control, &config.home, token_env),
            Metrics::new(),
            config.executor.clone(),
        ));
        for s in &specs {
            shared
                .metrics
                .register_tool(&s.id, s.confinement.transparent(), s.fork.is_some());
        }
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

    /// Makes this executor the owner of the runs it creates (`serve`): ends
    /// whatever a previous instance under the same `[executor] name` left on
    /// the proxy, removes scratch directories no live process owns, takes the
    /// owner lease and keeps renewing it, so a crash of this executor ends
    /// its runs on the proxy within `lease_ms`. Waits (logging) until the
    /// proxy answers or `stop` fires.
    pub async fn take_ownership(self: &Arc<Self>, stop: CancellationToken) {
        let name = self.config.executor.name.clone();
        let lease = Duration::from_millis(self.config.executor.lease_ms);
        self.remove_stale_scratch();
        let control = &self.shared.control;
        let mut warned = false;
        loop {
            let r = async {
                let ended = control.release_owner(&name).await?;
                control.renew_lease(&name, lease).await?;
                Ok::<u64, crate::proxy::control::ControlError>(ended)
            }
            .await;
            match r {
                Ok(ended) => {
                    if ended > 0 {
                        tracing::warn!(owner = %name, runs = ended, "ended the runs a previous instance left on the proxy");
                    }
                    break;
                }
                Err(crate::proxy::control::ControlError::Rejected { status: 404 | 405, .. }) => {
                    tracing::warn!("the proxy has no owner leases (an older version): this executor's runs are not leased, and a crash leaves them until max_run_ms");
                    return;
                }
                Err(e) if !warned => {
                    tracing::warn!(error = %e, "cannot take the owner lease yet; retrying every second");
                    warned = true;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
        }
        control.set_owner(&name);
        let exec = self.clone();
        tokio::spawn(async move {
            let every = lease / 3;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => return,
                }
                if let Err(e) = exec.shared.control.renew_lease(&name, lease).await {
                    tracing::warn!(error = %e, "renewing the owner lease failed; the proxy ends this executor's runs if it stays expired");
                }
            }
        });
    }

    /// At a graceful stop: ends every run still held under the owner name.
    pub async fn release_ownership(&self) {
        let name = &self.config.executor.name;
        match self.shared.control.release_owner(name).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(owner = %name, runs = n, "ended the executor's remaining runs"),
            Err(e) => tracing::warn!(error = %e, "could not release the owner lease at stop"),
        }
    }

    /// Removes scratch directories (`<tool>-<pid>-<n>`) whose executor
    /// process is gone: what a crashed instance left behind.
    fn remove_stale_scratch(&self) {
        let dir = &self.config.executor.scratch_dir;
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        let me = std::process::id();
        let mut removed = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let mut parts = name.rsplitn(3, '-');
            let (Some(_n), Some(pid), Some(_tool)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            let Ok(pid) = pid.parse::<u32>() else { continue };
            if pid != me
                && !std::path::Path::new(&format!("/proc/{pid}")).exists()
                && std::fs::remove_dir_all(e.path()).is_ok()
            {
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(removed, dir = %dir.display(), "removed scratch directories left by a previous instance");
        }
    }

    /// Start warming every pool (needs a tokio runtime).
    pub fn warm_up(&self) {
        for pool in self.pools.values() {
            pool.fill();
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

    /// Run one invocation. A repeated `idempotency_key` within
    /// [`IDEMPOTENCY_WINDOW`] answers with the first invocation's result (or
    /// waits for it while it runs) instead of running the tool again — its
    /// stub with `body_dropped` once the body is no longer kept; the same
    /// key with a different request is `idempotency_conflict` (409).
    pub async fn invoke(&self, req: InvocationRequest) -> InvocationResult {
        self.answer(req).await.result()
    }

    /// [`Executor::invoke`], with the answer as it came or as it was kept.
    /// In a fleet, a key new to this executor is first claimed fleet-wide
    /// (see [`Executor::claimed`]).
    pub async fn answer(&self, req: InvocationRequest) -> Answer {
        let Some(key) = req.idempotency_key.clone() else {
            return self.invoke_once(req, None).await.into();
        };
        if key.is_empty() || key.chars().count() > IDEMPOTENCY_KEY_MAX {
            return Answer::failed(
                &req.tool,
                InvokeError::new(
                    ErrorKind::BadRequest,
                    format!("idempotency_key must be 1-{IDEMPOTENCY_KEY_MAX} characters"),
                ),
            );
        }
        let fp = fingerprint(&req);
        let tx = {
            let Ok(mut m) = self.idempotency.lock() else {
                return self.invoke_once(req, None).await.into();
            };
            let now = Instant::now();
            m.retain(|_, r| r.finished.is_none_or(|t| now.duration_since(t) < IDEMPOTENCY_WINDOW));
            match m.get(&key) {
                Some(r) if r.fingerprint != fp => {
                    return Answer::failed(
                        &req.tool,
                        InvokeError::new(
                            ErrorKind::IdempotencyConflict,
                            format!("idempotency_key `{key}` was used with a different request"),
                        ),
                    );
                }
                Some(r) => Err(r.answer.clone()),
                None => {
                    if m.len() >= IDEMPOTENCY_MAX {
                        let oldest = m
                            .iter()
                            .filter_map(|(k, r)| r.finished.map(|t| (t, k.clone())))
                            .min()
                            .map(|(_, k)| k);
                        if let Some(k) = oldest {
                            m.remove(&k);
                        }
                    }
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    m.insert(
                        key.clone(),
                        Remembered {
                            fingerprint: fp.clone(),
                            answer: rx,
                            finished: None,
                        },
                    );
                    Ok(tx)
                }
            }
        };
        match tx {
            Ok(tx) => {
                let mut guard = Unfinished {
                    exec: self,
                    key: Some(key.clone()),
                };
                let (answer, kept, keep) = match self.claimed(req, &key, &fp).await {
                    Claimed::Ran(done) => {
                        let kept = done.kept.clone();
                        ((*done).into(), kept, true)
                    }
                    Claimed::Elsewhere(answer, remember) => {
                        // Waiting retries here get the same answer; only a
                        // final one (the owner's) is remembered.
                        let kept = self.retained.keep(&answer.to_result()).0;
                        (answer, kept, remember)
                    }
                };
                guard.key = None;
                if let Ok(mut m) = self.idempotency.lock() {
                    if keep {
                        if let Some(r) = m.get_mut(&key) {
                            r.finished = Some(Instant::now());
                        }
                    } else {
                        m.remove(&key);
                    }
                }
                let _ = tx.send(Some(kept));
                answer
            }
            Err(mut rx) => match rx.wait_for(Option::is_some).await {
                Ok(answer) => match answer.as_ref() {
                    Some(kept) => Answer::Kept(kept.clone()),
                    None => Answer::failed(&req.tool, InvokeError::new(ErrorKind::Aborted, "no answer")),
                },
                Err(_) => Answer::failed(
                    &req.tool,
                    InvokeError::new(
                        ErrorKind::Aborted,
                        format!("the first invocation with idempotency_key `{key}` was abandoned before it finished; send it again"),
                    ),
                ),
            },
        }
    }

    /// Runs a keyed invocation new to this executor, after claiming its key
    /// fleet-wide when this executor is a cell of a fleet. A key the fleet
    /// already knows answers as its owner would: the stored answer once it
    /// ended, `idempotency_conflict` for another request, `in_progress`
    /// (naming the owner) while it runs elsewhere. PostgreSQL unreachable:
    /// `idempotency_unavailable`, and nothing runs.
    async fn claimed(&self, req: InvocationRequest, key: &str, fp: &str) -> Claimed {
        let (Some(claims), Some(pool)) = (self.claims.as_ref(), self.pools.get(&req.tool)) else {
            return Claimed::Ran(Box::new(self.invoke_once(req, None).await));
        };
        let metrics = &self.shared.metrics;
        let id = uuid::Uuid::new_v4().to_string();
        let p = &pool.tool.process;
        let hold = Duration::from_millis(p.cold_start_ms + p.timeout_ms) + CLAIM_MARGIN;
        let fail = |kind, cell: Option<String>, url: Option<String>, message: String| {
            let mut r = InvocationResult::failed(&req.tool, InvokeError::new(kind, message));
            if cell.is_some() {
                (r.cell, r.control_url) = (cell, url);
            }
            Claimed::Elsewhere(Answer::Live(Box::new(r), None), false)
        };
        match claims.claim(key, fp, &id, hold).await {
            Err(e) => {
                metrics.claim("unavailable");
                tracing::warn!(error = %e, "a keyed invocation could not be claimed in the fleet; nothing ran");
                fail(
                    ErrorKind::IdempotencyUnavailable,
                    None,
                    None,
                    format!("the fleet's idempotency store cannot be asked ({e}); nothing ran: send it again later"),
                )
            }
            Ok(egress_fleet::Claim::Conflict { cell }) => {
                metrics.claim("conflict");
                fail(
                    ErrorKind::IdempotencyConflict,
                    None,
                    None,
                    format!("idempotency_key `{key}` was used with a different request (at cell {cell})"),
                )
            }
            Ok(egress_fleet::Claim::Running { cell, control_url }) => {
                metrics.claim("in_progress");
                let message = format!(
                    "idempotency_key `{key}` is running at cell {cell}; send the same request to its control_url for the answer"
                );
                fail(ErrorKind::InProgress, Some(cell), control_url, message)
            }
            Ok(egress_fleet::Claim::Done { status, answer, .. }) => {
                metrics.claim("done");
                Claimed::Elsewhere(Answer::Stored(status, answer.into()), true)
            }
            Ok(egress_fleet::Claim::Won) => {
                metrics.claim("won");
                let mut release = Release {
                    claims: claims.clone(),
                    key: key.to_owned(),
                    id: Some(id.clone()),
                };
                let done = self.invoke_once(req, Some(id.clone())).await;
                release.id = None;
                let (status, json) = (done.kept.status(), done.kept.answer_json());
                let answer = String::from_utf8_lossy(&json).into_owned();
                match claims.finish(key, &id, status, &answer).await {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        key,
                        "the claim was taken over as abandoned before its answer was stored"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "the answer of a claimed key could not be stored yet; retrying in the background");
                        let (claims, key) = (claims.clone(), key.to_owned());
                        tokio::spawn(async move {
                            let until = Instant::now() + IDEMPOTENCY_WINDOW;
                            while Instant::now() < until {
                                tokio::time::sleep(Duration::from_millis(500)).await;
                                if claims.finish(&key, &id, status, &answer).await.is_ok() {
                                    return;
                                }
                            }
                        });
                    }
                }
                Claimed::Ran(Box::new(done))
            }
        }
    }

    /// Runs the tool once: the live answer, and the answer as kept for the
    /// journal and the idempotency key.
    async fn invoke_once(&self, req: InvocationRequest, id: Option<String>) -> Done {
        let t0 = Instant::now();
        let id = id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let summary = InvocationSummary {
            invocation_id: id.clone(),
            tool: req.tool.clone(),
            state: "running",
            outcome: None,
            run_id: req.run_id.clone(),
            idempotency_key: req.idempotency_key.clone(),
            started_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            duration_ms: None,
        };
        if let Ok(mut j) = self.journal.lock() {
            j.running.insert(id.clone(), summary.clone());
        }
        let mut guard = Journaled {
            exec: self,
            id: Some(id.clone()),
        };
        let mut result = self.invoke_inner(req.clone()).await;
        result.invocation_id = Some(id.clone());
        result.duration_ms = t0.elapsed().as_millis().min(u128::from(u64::MAX)) as u64;
        if self.pools.contains_key(&req.tool) {
            self.shared
                .metrics
                .outcome(&req.tool, result.outcome(), t0.elapsed().as_secs_f64());
        }
        guard.id = None;
        let (kept, json) = self.retained.keep(&result);
        if let Ok(mut j) = self.journal.lock() {
            j.running.remove(&id);
            let done = InvocationSummary {
                state: "done",
                outcome: Some(result.outcome()),
                run_id: result.run_id.clone(),
                duration_ms: Some(result.duration_ms),
                ..summary
            };
            if j.done.len() >= JOURNAL_MAX {
                j.done.pop_front();
            }
            j.done.push_back((done, kept.clone()));
        }
        Done { result, json, kept }
    }

    /// Running and recently finished invocations, newest first, filtered
    /// (`tool`, `state`, `outcome`) and paged (`after`: the last id of the
    /// previous page).
    pub fn invocations(
        &self,
        tool: Option<&str>,
        state: Option<&str>,
        outcome: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<InvocationSummary>, Option<String>) {
        let Ok(j) = self.journal.lock() else {
            return (vec![], None);
        };
        let mut running: Vec<&InvocationSummary> = j.running.values().collect();
        running.sort_by(|a, b| {
            b.started_at_ms
                .cmp(&a.started_at_ms)
                .then(b.invocation_id.cmp(&a.invocation_id))
        });
        let all = running.into_iter().chain(j.done.iter().rev().map(|(s, _)| s));
        let mut seen_after = after.is_none();
        let mut out = vec![];
        let mut more = false;
        for s in all {
            if !seen_after {
                seen_after = after == Some(s.invocation_id.as_str());
                continue;
            }
            let keep = tool.is_none_or(|t| s.tool == t)
                && state.is_none_or(|st| s.state == st)
                && outcome.is_none_or(|o| s.outcome == Some(o));
            if keep {
                if out.len() == limit {
                    more = true;
                    break;
                }
                out.push(s.clone());
            }
        }
        let next = if more {
            out.last().map(|s| s.invocation_id.clone())
        } else {
            None
        };
        (out, next)
    }

    /// One invocation by its invocation id, run id or idempotency key.
    pub fn invocation(&self, id: &str) -> Option<Found> {
        let j = self.journal.lock().ok()?;
        let matches = |s: &InvocationSummary| {
            s.invocation_id == id || s.run_id.as_deref() == Some(id) || s.idempotency_key.as_deref() == Some(id)
        };
        if let Some(s) = j.running.values().find(|s| matches(s)) {
            return Some(Found::Running(s.clone()));
        }
        j.done
            .iter()
            .rev()
            .find(|(s, _)| matches(s))
            .map(|(_, k)| Found::Done(k.clone()))
    }

    async fn invoke_inner(&self, req: InvocationRequest) -> InvocationResult {
        let Some(pool) = self.pools.get(&req.tool) else {
            let msg = if self.config.tools.contains_key(&req.tool) {
                format!("tool `{}` has no [tools.{}.process] section", req.tool, req.tool)
            } else {
                format!("no tool `{}` in {}", req.tool, self.config.file.display())
            };
            return InvocationResult::failed(&req.tool, InvokeError::new(ErrorKind::UnknownTool, msg));
        };
        let configured = pool.tool.process.timeout_ms;
        let timeout_ms = match req.timeout_ms {
            Some(0) => {
                return InvocationResult::failed(
                    &req.tool,
                    InvokeError::new(ErrorKind::BadRequest, "timeout_ms must be positive"),
                )
            }
            Some(t) => t.min(configured),
            None => configured,
        };
        if let Some(id) = req.run_id.as_deref().filter(|id| !egress_api::rules::valid_id(id)) {
            return InvocationResult::failed(
                &req.tool,
                InvokeError::new(
                    ErrorKind::BadRequest,
                    format!("run_id {id:?} must be {}", egress_api::rules::ID_RULE),
                ),
            );
        }
        let cancel = CancellationToken::new();
        // If the caller goes away (its HTTP connection closes and this future
        // is dropped), the invocation is aborted and its child killed.
        let _abort_if_dropped = cancel.clone().drop_guard();
        let _registration = match self.register(&req, &cancel) {
            Ok(r) => r,
            Err(e) => return InvocationResult::failed(&req.tool, e),
        };
        let request = Request {
            input: req.input,
            idempotency_key: req.idempotency_key,
            timeout: Duration::from_millis(timeout_ms),
            cancel,
        };
        pool.invoke(request, req.run_id).await
    }

    fn register(&self, req: &InvocationRequest, cancel: &CancellationToken) -> Result<Registration<'_>, InvokeError> {
        let keys: Vec<String> = [req.run_id.as_ref(), req.idempotency_key.as_ref()]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        let mut m = self
            .inflight
            .lock()
            .map_err(|_| InvokeError::new(ErrorKind::BadRequest, "registry unavailable"))?;
        if let Some(k) = keys.iter().find(|k| m.contains_key(*k)) {
            return Err(InvokeError::new(
                ErrorKind::BadRequest,
                format!("an invocation with id `{k}` is already in flight"),
            ));
        }
        for k in &keys {
            m.insert(k.clone(), cancel.clone());
        }
        Ok(Registration { exec: self, keys })
    }

    /// Abort the in-flight invocation whose run id or idempotency key is `id`.
    pub fn abort(&self, id: &str) -> bool {
        let token = self.inflight.lock().ok().and_then(|m| m.get(id).cloned());
        match token {
            Some(t) => {
                t.cancel();
                true
            }
            None => false,
        }
    }

    /// Run `command` once, as a plain child under `tool`'s run policy (and its
    /// process limits, if it has a process section). No pool involved.
    pub async fn run_ad_hoc(
        &self,
        tool: &str,
        command: Vec<String>,
        input: Value,
        cwd: PathBuf,
        cancel: CancellationToken,
    ) -> InvocationResult {
        let Some(process) = self.config.tools.get(tool) else {
            return InvocationResult::failed(
                tool,
                InvokeError::new(
                    ErrorKind::UnknownTool,
                    format!("no tool `{tool}` in {}", self.config.file.display()),
                ),
            );
        };
        let p = ProcessConfig::ad_hoc(process.as_ref(), command, cwd);
        let host = crate::confine::host(&self.config.executor);
        let confinement = match Confinement::for_tool(tool, &p, &self.config.executor, &host) {
            Ok(c) => c,
            Err(e) => {
                return InvocationResult::failed(tool, InvokeError::startup(crate::error::Phase::Spawn, e.to_string()))
            }
        };
        let spec = Arc::new(ToolSpec::new(tool, p, confinement));
        let t0 = Instant::now();
        let mut result = match Warm::start(&self.shared, &spec, None).await {
            Ok(warm) => {
                let (result, teardown) = warm
                    .dispatch(Request {
                        input,
                        idempotency_key: None,
                        timeout: Duration::from_millis(spec.process.timeout_ms),
                        cancel,
                    })
                    .await;
                teardown.finish().await;
                result
            }
            Err(e) => InvocationResult::failed(tool, e),
        };
        result.duration_ms = t0.elapsed().as_millis().min(u128::from(u64::MAX)) as u64;
        result
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
    }

    /// After `shutdown`: wait (at most `within`) until every child is gone,
    /// so idle children's runs are ended on the proxy before the process exits.
    pub async fn drain(&self, within: Duration) {
        let end = tokio::time::Instant::now() + within;
        while self.pools.values().any(|p| p.live() > 0) && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input: &str) -> InvocationRequest {
        serde_json::from_value(serde_json::json!({
            "tool": "t", "input": serde_json::from_str::<Value>(input).unwrap(), "idempotency_key": "k",
        }))
        .unwrap()
    }

    #[test]
    fn one_input_spelled_two_ways_has_one_fingerprint() {
        let same = [
            (
                r#"{"n": 3.0, "a": [1.0, {"y": 1, "x": 2}]}"#,
                r#"{"a": [1, {"x": 2, "y": 1}], "n": 3}"#,
            ),
            (r#"{"big": 12345678.0}"#, r#"{"big": 12345678}"#),
        ];
        for (a, b) in same {
            assert_eq!(fingerprint(&request(a)), fingerprint(&request(b)), "{a} vs {b}");
        }
        let different = [
            (r#"{"n": 3.5}"#, r#"{"n": 3}"#),
            (r#"{"n": "3"}"#, r#"{"n": 3}"#),
            (r#"[1, 2]"#, r#"[2, 1]"#),
            (r#"{"a": null}"#, r#"{}"#),
        ];
        for (a, b) in different {
            assert_ne!(fingerprint(&request(a)), fingerprint(&request(b)), "{a} vs {b}");
        }
    }
}
