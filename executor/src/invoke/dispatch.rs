//! From a request to its pool: `POST /v1/invocations`'s body, the checks
//! made before any child is involved (the tool, `timeout_ms`, `run_id`), the
//! registry of invocations in flight by run id and key (for abort), the
//! answer as it came or as it was kept, and ad-hoc single runs (`run`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::ProcessConfig;
use crate::confine::plan::Confinement;
use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::invoke::journal::{InvocationSummary, Journaled, JOURNAL_MAX};
use crate::invoke::retained::Kept;
use crate::invoke::Executor;
use crate::pool::child::{Request, ToolSpec, Warm};

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
    /// Who asks (set by the API from the caller, never read from the
    /// body): the run is attributed to it, and only it (or admin) sees
    /// and aborts the invocation.
    #[serde(skip)]
    #[schema(ignore)]
    pub principal: Option<String>,
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
    pub(super) fn failed(tool: &str, error: InvokeError) -> Answer {
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
    pub(super) fn to_result(&self) -> InvocationResult {
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
pub(super) struct Done {
    pub(super) result: InvocationResult,
    pub(super) json: bytes::Bytes,
    pub(super) kept: Arc<Kept>,
}

impl From<Done> for Answer {
    fn from(d: Done) -> Answer {
        Answer::Live(Box::new(d.result), Some(d.json))
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
    /// Run one invocation. A repeated `idempotency_key` within
    /// [`IDEMPOTENCY_WINDOW`](crate::invoke::idempotency::IDEMPOTENCY_WINDOW)
    /// answers with the first invocation's result (or waits for it while it
    /// runs) instead of running the tool again — its stub with
    /// `body_dropped` once the body is no longer kept; the same key with a
    /// different request is `idempotency_conflict` (409).
    pub async fn invoke(&self, req: InvocationRequest) -> InvocationResult {
        self.answer(req).await.result()
    }

    /// Runs the tool once: the live answer, and the answer as kept for the
    /// journal and the idempotency key.
    pub(super) async fn invoke_once(&self, req: InvocationRequest, id: Option<String>) -> Done {
        let t0 = Instant::now();
        let id = id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let summary = InvocationSummary {
            invocation_id: id.clone(),
            tool: req.tool.clone(),
            state: "running",
            outcome: None,
            run_id: req.run_id.clone(),
            idempotency_key: req.idempotency_key.clone(),
            principal: req.principal.clone(),
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

    async fn invoke_inner(&self, req: InvocationRequest) -> InvocationResult {
        let Some(pool) = self.pools.get(&req.tool) else {
            let msg = if self.sessions.contains_key(&req.tool) {
                format!(
                    "tool `{}` serves MCP sessions (lifecycle = \"session\"), not invocations: open one at /v1/mcp/{}",
                    req.tool, req.tool
                )
            } else if self.config.tools.contains_key(&req.tool) {
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
            principal: req.principal,
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
            m.insert(k.clone(), (cancel.clone(), req.principal.clone()));
        }
        Ok(Registration { exec: self, keys })
    }

    /// Abort the in-flight invocation whose run id or idempotency key is `id`.
    pub fn abort(&self, id: &str) -> bool {
        self.abort_if(id, &|_| true)
    }

    /// [`abort`](Self::abort), if `visible` says the invocation's principal
    /// is the caller's to abort.
    pub fn abort_if(&self, id: &str, visible: &dyn Fn(Option<&str>) -> bool) -> bool {
        let token = self
            .inflight
            .lock()
            .ok()
            .and_then(|m| m.get(id).filter(|(_, p)| visible(p.as_deref())).map(|(t, _)| t.clone()));
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
                        principal: None,
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
}
