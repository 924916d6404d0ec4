//! The control API for kernels, the executor and Prometheus: runs (create,
//! activate, end, inspect), facts (cursor, per run, live SSE tail), health,
//! readiness and metrics. Everything under `/v1` needs
//! `Authorization: Bearer <control token>` (constant-time compare); errors
//! are JSON `{"error":{"code","message"}}`.

use crate::api::{
    Bytes, CreateRun, CreatedRun, Cursor, DenialSummary, EndedRun, ErrorBody, FactsPage, OwnerList, OwnerReleased,
    OwnerView, RenewOwner, RunFilter, RunList, RunView, Slots,
};
use crate::facts::FactQuery;
use crate::runs::{valid_run_id, EndReason, NewRun, Run, RunError, RunWrite};
use crate::server::Shared;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use utoipa::OpenApi as _;
use utoipa_axum::{router::OpenApiRouter, routes};

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

/// The `/v1` routes, each documented in the OpenAPI document that the same
/// call builds: a route cannot exist without its entry.
fn api_routes() -> OpenApiRouter<Arc<Shared>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(create_run, list_runs))
        .routes(routes!(get_run, end_run))
        .routes(routes!(activate_run))
        .routes(routes!(run_facts))
        .routes(routes!(list_facts))
        .routes(routes!(crate::sse::stream))
        .routes(routes!(crate::reload::reload_handler))
        .routes(routes!(list_owners))
        .routes(routes!(renew_owner, release_owner))
}

/// The routes without credential, documented too.
fn open_routes() -> OpenApiRouter<Arc<Shared>> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
}

#[derive(utoipa::OpenApi)]
#[openapi(info(
    title = "Loom Egress proxy control API",
    description = "Runs, facts, owners and policy of the egress proxy. Everything under /v1 needs `Authorization: Bearer <control token>`; errors are `{\"error\":{\"code\",\"message\"}}`."
))]
struct ApiDoc;

/// What every operation shares, added once the routes are collected: the
/// bearer scheme, `401` on every `/v1` operation, and the JSON body
/// rejections (`400`, `413`, `415`, `422`) on every operation that takes one.
fn complete(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    doc.components.get_or_insert_with(Default::default).add_security_scheme(
        "control_token",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    let error = |what: &str| {
        ResponseBuilder::new()
            .description(what)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build()
    };
    for (path, item) in doc.paths.paths.iter_mut() {
        for op in [&mut item.get, &mut item.post, &mut item.put, &mut item.delete]
            .into_iter()
            .flatten()
        {
            let r = &mut op.responses.responses;
            if path.starts_with("/v1/") {
                r.entry("401".into())
                    .or_insert_with(|| error("unauthorized: no or a wrong control token").into());
            }
            if op.request_body.is_some() {
                for (status, what) in [
                    ("400", "bad_request: the body is not valid JSON for this call"),
                    ("413", "bad_request: the body is larger than 64 KiB"),
                    ("415", "bad_request: Content-Type is not application/json"),
                    ("422", "bad_request: the body does not match the schema"),
                ] {
                    r.entry(status.into()).or_insert_with(|| error(what).into());
                }
            }
        }
    }
}

/// The OpenAPI 3.1 document of the control API (served at `/v1/openapi.json`).
pub fn openapi() -> utoipa::openapi::OpenApi {
    let (_, mut doc) = api_routes().split_for_parts();
    let (_, open) = open_routes().split_for_parts();
    doc.merge(open);
    complete(&mut doc);
    doc
}

pub fn router(sh: Arc<Shared>) -> Router {
    let (api, mut doc) = api_routes().split_for_parts();
    let (open, open_doc) = open_routes().split_for_parts();
    doc.merge(open_doc);
    complete(&mut doc);
    let doc = Arc::new(doc);
    let api = api.route_layer(middleware::from_fn_with_state(sh.clone(), require_token));
    Router::new()
        .merge(open)
        .route(
            "/v1/openapi.json",
            axum::routing::get(move || {
                let doc = doc.clone();
                async move { Json(doc.as_ref().clone()) }
            }),
        )
        .merge(api)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .layer(middleware::map_response_with_state(sh.clone(), stamp_instance))
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
    while let Some(stream) = crate::server::accept(&sh.control_stop, &listener).await {
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
                        crate::server::serve_one(&sh2.control_stop, &sh2.control_stop, &conn.cut, c).await
                    }
                    Some(acceptor) => {
                        let hs = tokio::time::timeout(sh2.cfg.pending_head_timeout, acceptor.accept(stream)).await;
                        if let Ok(Ok(tls)) = hs {
                            let c = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
                            crate::server::serve_one(&sh2.control_stop, &sh2.control_stop, &conn.cut, c).await;
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

/// Every control answer names the proxy instance that gave it.
async fn stamp_instance(State(sh): State<Arc<Shared>>, mut r: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&sh.instance) {
        r.headers_mut().insert(INSTANCE_HEADER, v);
    }
    r
}

/// Names the proxy process that answered (changes on every restart).
pub const INSTANCE_HEADER: &str = "x-egress-instance";

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

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "The process serves", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/readyz", tag = "health", responses(
    (status = 200, description = "Ready", body = String),
    (status = 503, description = "Shutting down (draining), or the fact store cannot write", body = String),
))]
async fn readyz(State(sh): State<Arc<Shared>>) -> Response {
    if sh.shutdown.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    }
    if !sh.facts.ready() {
        return (StatusCode::SERVICE_UNAVAILABLE, "fact store unavailable\n").into_response();
    }
    "ready\n".into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "health", responses(
    (status = 200, description = "OpenMetrics text", body = String, content_type = "application/openmetrics-text"),
))]
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

pub fn run_view(run: &Run) -> RunView {
    let (up, down) = run.bytes();
    let (ended_at, end_reason) = match run.ended() {
        Some((at, why)) => (Some(crate::time::rfc3339(at)), Some(why.as_str().to_owned())),
        // Past its expiry but not yet swept: it is already ended for every fetch.
        None if run.state() == crate::policy::RunState::Ended => {
            (Some(crate::time::rfc3339(run.expires_at)), Some("expired".to_owned()))
        }
        None => (None, None),
    };
    RunView {
        run_id: run.id.to_string(),
        tool: run.tool.to_string(),
        state: run.state().as_str().to_owned(),
        created_at: crate::time::rfc3339(run.created_at),
        expires_at: crate::time::rfc3339(run.expires_at),
        labels: run.labels.clone(),
        owner: run.owner.as_deref().map(str::to_owned),
        slots: Slots {
            max: run.max_slots,
            in_use: run.max_slots - run.slots.available_permits(),
        },
        upstream_idle: run.upstream.len(),
        bytes: Bytes { up, down },
        ended_at,
        end_reason,
    }
}

#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = CreateRun,
    security(("control_token" = [])),
    responses(
        (status = 201, description = "Created; the secret is shown only here", body = CreatedRun),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 404, description = "unknown_tool", body = ErrorBody),
        (status = 409, description = "run_exists, owner_not_leased", body = ErrorBody),
        (status = 429, description = "too_many_runs", body = ErrorBody),
        (status = 503, description = "store_unavailable: the run could not be stored durably", body = ErrorBody),
    ))]
async fn create_run(
    State(sh): State<Arc<Shared>>,
    body: Result<Json<CreateRun>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<CreatedRun>)> {
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
    let owner = match req.owner {
        Some(o) if !valid_run_id(&o) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "owner must be 1-128 characters of A-Z a-z 0-9 - _ . ~",
            ))
        }
        Some(o) if sh.owners.lease(&o).is_none() => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "owner_not_leased",
                format!("owner {o:?} holds no live lease: PUT /v1/owners/{o} first"),
            ))
        }
        o => o.map(|o| Arc::<str>::from(o.as_str())),
    };
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
            owner,
            activate: req.activate.unwrap_or(true),
            max_slots: tool.max_concurrent_fetches,
            max_waiting: tool.max_queued_fetches,
            max_conns: sh.cfg.max_connections_per_run,
        },
        secret.clone(),
    )?;
    if let Err(e) = sh.facts.save_run(RunWrite::Save(run.record())).await {
        sh.runs.end(&run, EndReason::Ended);
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!("the run could not be stored durably: {e}"),
        ));
    }
    sh.run_created(&run);
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, state = run.state().as_str(), "run created");
    let proxy_url = format!("{}://{}:{}@{}", sh.proxy_scheme, run.id, secret, sh.proxy_authority);
    Ok((
        StatusCode::CREATED,
        Json(CreatedRun {
            run: run_view(&run),
            secret,
            proxy_url,
        }),
    ))
}

fn find(sh: &Shared, id: &str) -> ApiResult<Arc<Run>> {
    sh.runs.get(id).ok_or_else(|| RunError::NotFound(id.to_owned()).into())
}

fn store_error(e: crate::facts::FactError) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", e.to_string())
}

#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "The run", body = RunView),
        (status = 404, description = "run_not_found (never existed, or ended more than five minutes ago)", body = ErrorBody),
    ))]
async fn get_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<RunView>> {
    let run = find(&sh, &id)?;
    Ok(Json(run_view(&run)))
}

#[utoipa::path(post, path = "/v1/runs/{id}/activate", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "Active (activating an active run is a no-op)", body = RunView),
        (status = 404, description = "run_not_found", body = ErrorBody),
        (status = 409, description = "run_ended", body = ErrorBody),
        (status = 503, description = "store_unavailable", body = ErrorBody),
    ))]
async fn activate_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<RunView>> {
    let run = sh.activate_run(&id)?;
    sh.facts
        .save_run(RunWrite::Save(run.record()))
        .await
        .map_err(store_error)?;
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, "run activated");
    Ok(Json(run_view(&run)))
}

/// Ends the run and answers with its final view, its facts (up to
/// [`END_FACTS`]) and a summary of its denials, so ending a run and
/// collecting what it was denied is one call.
#[utoipa::path(delete, path = "/v1/runs/{id}", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "Ended: every open fetch of the run is severed", body = EndedRun),
        (status = 404, description = "run_not_found", body = ErrorBody),
        (status = 503, description = "facts_unavailable, store_unavailable", body = ErrorBody),
    ))]
async fn end_run(State(sh): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<EndedRun>> {
    let run = find(&sh, &id)?;
    sh.end_run(&run, EndReason::Ended);
    sh.facts
        .save_run(RunWrite::Delete(id.clone()))
        .await
        .map_err(store_error)?;
    let facts = sh
        .facts
        .query(FactQuery {
            after: 0,
            limit: END_FACTS + 1,
            run_id: Some(id),
        })
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e.to_string()))?;
    let facts_truncated = facts.len() > END_FACTS;
    let mut facts = facts;
    facts.truncate(END_FACTS);
    let mut by_reason = serde_json::Map::new();
    let mut total = 0u64;
    for f in &facts {
        total += f.count;
        let n = by_reason.get(&f.reason).and_then(Value::as_u64).unwrap_or(0);
        by_reason.insert(f.reason.clone(), Value::from(n + f.count));
    }
    Ok(Json(EndedRun {
        run: run_view(&run),
        facts,
        facts_truncated,
        denials: DenialSummary { total, by_reason },
    }))
}

/// Facts returned with an ended run (the rest by `GET /v1/runs/{id}/facts`).
pub const END_FACTS: usize = 1000;

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
}

/// `GET /v1/runs`: live runs and recently ended ones, by id, filtered and paged.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", security(("control_token" = [])),
    params(RunFilter),
    responses(
        (status = 200, description = "Runs sorted by id", body = RunList),
        (status = 400, description = "bad_request", body = ErrorBody),
    ))]
async fn list_runs(
    State(sh): State<Arc<Shared>>,
    q: Result<Query<RunFilter>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<RunList>> {
    let Query(f) = q.map_err(|e| bad_request(e.body_text()))?;
    if let Some(s) = &f.state {
        if !matches!(s.as_str(), "created" | "active" | "ended") {
            return Err(bad_request("state must be created, active or ended"));
        }
    }
    let label = match &f.label {
        Some(l) => Some(
            l.split_once('=')
                .ok_or_else(|| bad_request("label must be key=value"))?,
        ),
        None => None,
    };
    let limit = f.limit.unwrap_or(100).clamp(1, 1000);
    let mut runs: Vec<Arc<Run>> = sh
        .runs
        .all()
        .into_iter()
        .filter(|r| f.tool.as_deref().is_none_or(|t| *r.tool == *t))
        .filter(|r| f.state.as_deref().is_none_or(|s| r.state().as_str() == s))
        .filter(|r| f.owner.as_deref().is_none_or(|o| r.owner.as_deref() == Some(o)))
        .filter(|r| label.is_none_or(|(k, v)| r.labels.get(k).and_then(Value::as_str) == Some(v)))
        .filter(|r| f.after.as_deref().is_none_or(|a| &*r.id > a))
        .collect();
    runs.sort_by(|a, b| a.id.cmp(&b.id));
    let more = runs.len() > limit;
    runs.truncate(limit);
    let next = if more {
        runs.last().map(|r| r.id.to_string())
    } else {
        None
    };
    Ok(Json(RunList {
        runs: runs.iter().map(|r| run_view(r)).collect(),
        next,
    }))
}

fn owner_view(owner: &str, lease: &crate::owners::Lease, live_runs: usize) -> OwnerView {
    OwnerView {
        owner: owner.to_owned(),
        lease_ms: lease.lease.as_millis() as u64,
        expires_at: crate::time::rfc3339(lease.expires_at),
        live_runs,
    }
}

/// `PUT /v1/owners/{owner}` `{lease_ms}`: creates or renews a lease (the heartbeat).
#[utoipa::path(put, path = "/v1/owners/{owner}", tag = "owners", security(("control_token" = [])),
    params(("owner" = String, Path, description = "Owner name (1–128 of A-Z a-z 0-9 - _ . ~)")),
    request_body = RenewOwner,
    responses(
        (status = 200, description = "Leased until expires_at", body = OwnerView),
        (status = 400, description = "bad_request, bad_lease", body = ErrorBody),
        (status = 429, description = "bad_lease: too many owners", body = ErrorBody),
    ))]
async fn renew_owner(
    State(sh): State<Arc<Shared>>,
    Path(owner): Path<String>,
    body: Result<Json<RenewOwner>, JsonRejection>,
) -> ApiResult<Json<OwnerView>> {
    let Json(req) = body?;
    if !valid_run_id(&owner) {
        return Err(bad_request("owner must be 1-128 characters of A-Z a-z 0-9 - _ . ~"));
    }
    let lease = sh
        .owners
        .renew(&owner, std::time::Duration::from_millis(req.lease_ms))
        .map_err(|e| {
            let status = match e {
                crate::owners::OwnerError::BadLease => StatusCode::BAD_REQUEST,
                crate::owners::OwnerError::TooMany => StatusCode::TOO_MANY_REQUESTS,
            };
            ApiError::new(status, "bad_lease", e.to_string())
        })?;
    Ok(Json(owner_view(&owner, &lease, sh.runs.live_runs_of(&owner).len())))
}

/// `DELETE /v1/owners/{owner}`: ends every live run of the owner and forgets it.
#[utoipa::path(delete, path = "/v1/owners/{owner}", tag = "owners", security(("control_token" = [])),
    params(("owner" = String, Path, description = "Owner name")),
    responses((status = 200, description = "Its live runs ended (owner_released)", body = OwnerReleased)))]
async fn release_owner(State(sh): State<Arc<Shared>>, Path(owner): Path<String>) -> Json<OwnerReleased> {
    let known = sh.owners.release(&owner);
    let runs = sh.runs.live_runs_of(&owner);
    let ended = runs.len();
    for run in runs {
        sh.end_run(&run, EndReason::OwnerReleased);
    }
    if ended > 0 || known {
        tracing::info!(owner = %owner, runs = ended, "owner released; its runs ended");
    }
    Json(OwnerReleased { owner, ended })
}

#[utoipa::path(get, path = "/v1/owners", tag = "owners", security(("control_token" = [])),
    responses((status = 200, description = "Owners and their leases", body = OwnerList)))]
async fn list_owners(State(sh): State<Arc<Shared>>) -> Json<OwnerList> {
    let owners = sh
        .owners
        .list()
        .iter()
        .map(|(o, l)| owner_view(o, l, sh.runs.live_runs_of(o).len()))
        .collect();
    Json(OwnerList { owners })
}

impl Cursor {
    /// The largest cursor the store can hold: `seq` is a signed 64-bit
    /// SQLite integer, so anything above is refused rather than wrapped.
    pub const MAX_AFTER: u64 = i64::MAX as u64;

    /// A cursor from the query string, or `400 bad_request` naming what is wrong.
    pub fn from_query(q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>) -> ApiResult<Cursor> {
        let Query(c) = q.map_err(|e| bad_request(e.body_text()))?;
        if c.after > Self::MAX_AFTER {
            return Err(bad_request(format!("after must be at most {}", Self::MAX_AFTER)));
        }
        Ok(c)
    }
}

#[utoipa::path(get, path = "/v1/facts", tag = "facts", security(("control_token" = [])),
    params(Cursor),
    responses(
        (status = 200, description = "Facts with seq > after, oldest first", body = FactsPage),
        (status = 400, description = "bad_request (e.g. after above 2^63-1)", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
async fn list_facts(
    State(sh): State<Arc<Shared>>,
    q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<FactsPage>> {
    query_facts(&sh, Cursor::from_query(q)?, None).await
}

#[utoipa::path(get, path = "/v1/runs/{id}/facts", tag = "facts", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id"), Cursor),
    responses(
        (status = 200, description = "The run's facts with seq > after", body = FactsPage),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
async fn run_facts(
    State(sh): State<Arc<Shared>>,
    Path(id): Path<String>,
    q: Result<Query<Cursor>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<FactsPage>> {
    query_facts(&sh, Cursor::from_query(q)?, Some(id)).await
}

async fn query_facts(sh: &Shared, c: Cursor, run_id: Option<String>) -> ApiResult<Json<FactsPage>> {
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
    Ok(Json(FactsPage { facts, next }))
}
