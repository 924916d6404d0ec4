//! The control API for kernels, the executor and Prometheus: runs (create,
//! activate, end, inspect), facts (cursor, per run, live SSE tail), health,
//! readiness and metrics. Everything under `/v1` needs
//! `Authorization: Bearer <control token>` (constant-time compare); errors
//! are JSON `{"error":{"code","message"}}`.

use crate::facts::FactQuery;
use crate::runs::{valid_run_id, EndReason, NewRun, Run, RunError};
use crate::server::Shared;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A control API error.
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    details: Option<Vec<Value>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            details: None,
        }
    }

    pub fn with_details(mut self, details: Vec<Value>) -> ApiError {
        self.details = Some(details);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut err = json!({"code": self.code, "message": self.message});
        if let Some(d) = self.details {
            err["problems"] = Value::Array(d);
        }
        (self.status, Json(json!({ "error": err }))).into_response()
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> ApiError {
        let (status, code) = match &e {
            RunError::Exists(_) => (StatusCode::CONFLICT, "run_exists"),
            RunError::TooMany(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_runs"),
            RunError::NotFound(_) => (StatusCode::NOT_FOUND, "run_not_found"),
            RunError::Ended(_) => (StatusCode::CONFLICT, "run_ended"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> ApiError {
        ApiError::new(e.status(), "bad_request", e.body_text())
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

pub fn router(sh: Arc<Shared>) -> Router {
    let api = Router::new()
        .route("/v1/runs", post(create_run))
        .route("/v1/runs/{id}", get(get_run).delete(end_run))
        .route("/v1/runs/{id}/activate", post(activate_run))
        .route("/v1/runs/{id}/facts", get(run_facts))
        .route("/v1/facts", get(list_facts))
        .route("/v1/facts/stream", get(crate::sse::stream))
        .route("/v1/policy/reload", post(crate::reload::reload_handler))
        .route_layer(middleware::from_fn_with_state(sh.clone(), require_token));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .with_state(sh)
}

/// Serves the control API (HTTP/1.1, or HTTPS when TLS is configured).
/// Connections are admitted as on the data listener (see `admission`): a
/// connection is pending until a request carries the control token, so idle
/// or tokenless sockets cannot lock kernels out.
pub async fn serve(sh: Arc<Shared>, listener: TcpListener) {
    let app = router(sh.clone());
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(sh.cfg.header_read_timeout);
    let builder = Arc::new(builder);
    while let Some(stream) = crate::server::accept(&sh, &listener).await {
        let sh2 = sh.clone();
        let inner = hyper_util::service::TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let conn = Arc::new(sh.control_admission.admit(CancellationToken::new()));
        tokio::spawn(async move {
            let svc_conn = conn.clone();
            let svc_sh = sh2.clone();
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                use futures_util::future::Either;
                use hyper::service::Service as _;
                if svc_conn.is_pending() && token_ok(&svc_sh, req.headers()) {
                    if let Err(refused) = svc_conn.establish(None) {
                        svc_sh.count_closed("control", refused.label());
                        let mut r = ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "too_many_connections",
                            "every control connection place is taken (proxy.max_control_connections)",
                        )
                        .into_response();
                        r.headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                        return Either::Left(std::future::ready(Ok::<_, std::convert::Infallible>(r)));
                    }
                }
                Either::Right(inner.call(req))
            });
            let serve = async {
                match &sh2.tls {
                    None => {
                        let c = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                        crate::server::serve_one(&sh2, &conn.cut, c).await
                    }
                    Some(acceptor) => {
                        let hs = tokio::time::timeout(sh2.cfg.pending_head_timeout, acceptor.accept(stream)).await;
                        if let Ok(Ok(tls)) = hs {
                            let c = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
                            crate::server::serve_one(&sh2, &conn.cut, c).await;
                        }
                    }
                }
            };
            tokio::select! {
                _ = serve => {}
                _ = crate::server::pending_deadline(&conn, sh2.cfg.pending_head_timeout) => {
                    sh2.count_closed("control", "head_timeout")
                }
            }
        });
    }
}

/// The bearer token of a control request, if any (scheme case-insensitive).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// Whether the request carries the control token (constant-time compare).
fn token_ok(sh: &Shared, headers: &HeaderMap) -> bool {
    bearer(headers).is_some_and(|t| bool::from(t.as_bytes().ct_eq(sh.control_token.as_bytes())))
}

async fn require_token(State(sh): State<Arc<Shared>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    match bearer(&headers) {
        Some(_) if token_ok(&sh, &headers) => next.run(req).await,
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "wrong control token").into_response(),
        None => {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Authorization: Bearer <control token> required",
            )
            .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
}

async fn readyz(State(sh): State<Arc<Shared>>) -> Response {
    if sh.shutdown.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    }
    if !sh.facts.ready() {
        return (StatusCode::SERVICE_UNAVAILABLE, "fact store unavailable\n").into_response();
    }
    "ready\n".into_response()
}

async fn metrics(State(sh): State<Arc<Shared>>) -> Response {
    let body = sh.metrics.render();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRun {
    tool: String,
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    labels: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    activate: Option<bool>,
}

pub fn run_view(run: &Run) -> Value {
    let mut v = json!({
        "run_id": &*run.id,
        "tool": &*run.tool,
        "state": run.state().as_str(),
        "created_at": crate::time::rfc3339(run.created_at),
        "expires_at": crate::time::rfc3339(run.expires_at),
        "labels": run.labels,
        "slots": {"max": run.max_slots, "in_use": run.max_slots - run.slots.available_permits()},
        "upstream_idle": run.upstream.len(),
        "bytes": {"up": run.bytes().0, "down": run.bytes().1},
    });
    match run.ended() {
        Some((at, why)) => {
            v["ended_at"] = json!(crate::time::rfc3339(at));
            v["end_reason"] = json!(why.as_str());
        }
        // Past its expiry but not yet swept: it is already ended for every fetch.
        None if run.state() == crate::policy::RunState::Ended => {
            v["ended_at"] = json!(crate::time::rfc3339(run.expires_at));
            v["end_reason"] = json!("expired");
        }
        None => {}
    }
    v
}

async fn create_run(
    State(sh): State<Arc<Shared>>,
    body: Result<Json<CreateRun>, JsonRejection>,
) -> ApiResult<Response> {
    let Json(req) = body?;
    let policy = sh.policy.load();
    let tool = policy.tool(&req.tool).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_tool",
            format!("no tool {:?} in the config", req.tool),
        )
    })?;
    let id = match req.run_id {
        Some(id) if valid_run_id(&id) => id,
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "run_id must be 1-128 characters of A-Z a-z 0-9 - _ . ~",
            ))
        }
        None => uuid::Uuid::new_v4().to_string(),
    };
    let labels = req.labels.unwrap_or_default();
    if labels.len() > 64 {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "at most 64 labels",
        ));
    }
    let secret = crate::runs::random_hex(24).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("no randomness: {e}"),
        )
    })?;
    let run = sh.runs.create(
        NewRun {
            id,
            tool: tool.id.clone(),
            labels,
            activate: req.activate.unwrap_or(true),
            max_slots: tool.max_concurrent_fetches,
            max_waiting: tool.max_queued_fetches,
            max_conns: sh.cfg.max_connections_per_run,
        },
        secret,
    )?;
    sh.tool_metrics(Some(&run.tool)).runs_active.inc();
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, state = run.state().as_str(), "run created");
    let mut v = run_view(&run);
    v["secret"] = json!(run.secret());
    v["proxy_url"] = json!(format!(
        "{}://{}:{}@{}",
        sh.proxy_scheme,
        run.id,
        run.secret(),
        sh.proxy_authority
    ));
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

fn find(sh: &Shared, id: &str) -> ApiResult<Arc<Run>> {
    sh.runs.get(id).ok_or_else(|| RunError::NotFound(id.to_owned()).into())
}

async fn get_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let run = find(&sh, &id)?;
    Ok(Json(run_view(&run)))
}

async fn activate_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let run = sh.runs.activate(&id)?;
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, "run activated");
    Ok(Json(run_view(&run)))
}

async fn end_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let run = find(&sh, &id)?;
    sh.end_run(&run, EndReason::Ended);
    Ok(Json(run_view(&run)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cursor {
    #[serde(default)]
    pub after: u64,
    #[serde(default)]
    pub limit: Option<usize>,
}

impl Cursor {
    /// The largest cursor the store can hold: `seq` is a signed 64-bit
    /// SQLite integer, so anything above is refused rather than wrapped.
    pub const MAX_AFTER: u64 = i64::MAX as u64;

    /// A cursor from the query string, or `400 bad_request` naming what is wrong.
    pub fn from_query(q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>) -> ApiResult<Cursor> {
        let Query(c) = q.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
        if c.after > Self::MAX_AFTER {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("after must be at most {}", Self::MAX_AFTER),
            ));
        }
        Ok(c)
    }
}

async fn list_facts(
    State(sh): State<Arc<Shared>>,
    q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Value>> {
    query_facts(&sh, Cursor::from_query(q)?, None).await
}

async fn run_facts(
    State(sh): State<Arc<Shared>>,
    Path(id): Path<String>,
    q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Value>> {
    query_facts(&sh, Cursor::from_query(q)?, Some(id)).await
}

async fn query_facts(sh: &Shared, c: Cursor, run_id: Option<String>) -> ApiResult<Json<Value>> {
    let limit = c.limit.unwrap_or(100).clamp(1, 1000);
    let facts = sh
        .facts
        .query(FactQuery {
            after: c.after,
            limit,
            run_id,
        })
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e.to_string()))?;
    let next = facts.last().map(|f| f.seq).unwrap_or(c.after);
    Ok(Json(json!({"facts": facts, "next": next})))
}
