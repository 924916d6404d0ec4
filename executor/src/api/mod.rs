//! The kernel-facing HTTP API of `egress-executor serve`: invocations (run,
//! list, look up, abort), session tools' MCP endpoints ([`mcp`]; their
//! stdio client `egress-executor mcp` is [`bridge`]), `GET /metrics`,
//! `GET /healthz`, and its OpenAPI 3.1 document at `/v1/openapi.json`,
//! generated from the handlers (a route cannot exist without its entry).
//! Every `/v1` request is authenticated to a principal ([`caller`]) and
//! each handler asks its scopes; with `[control.tls]` the listener is
//! [`serve_tls`]. Error kinds map to HTTP statuses in `ErrorKind::http_status`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use egress_api::ErrorBody;
use serde_json::json;
use utoipa::OpenApi as _;
use utoipa_axum::{router::OpenApiRouter, routes};

use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::invoke::dispatch::InvocationRequest;
use crate::invoke::journal::{Found, InvocationSummary, JOURNAL_MAX};
use crate::invoke::Executor;
use caller::Caller;
use egress_config::principals::Action;

pub mod bridge;
pub mod caller;
pub mod mcp;

/// The router, ready for `axum::serve`. `/v1` needs the same bearer token as
/// the proxy's control API: tools share the host's loopback unless confined,
/// and must not be able to invoke other tools.
pub fn router(exec: Arc<Executor>) -> Router {
    let (v1, mut doc) = v1_routes().split_for_parts();
    let (open, open_doc) = open_routes().split_for_parts();
    doc.merge(open_doc);
    complete(&mut doc);
    let doc = Arc::new(doc);
    let auth = Arc::new(caller::Auth::new(exec.clone(), exec.principals_file().cloned()));
    let v1 = v1.route_layer(axum::middleware::from_fn_with_state(auth, caller::authenticate));
    Router::new()
        .merge(open)
        .route(
            "/v1/openapi.json",
            get(move || {
                let doc = doc.clone();
                async move { Json(doc.as_ref().clone()) }
            }),
        )
        .merge(v1)
        .with_state(exec)
}

/// Serves `app` on `listener` over `[control.tls]` until `stop`: the
/// handshake (within 10 s) asks for a client certificate, verified against
/// `client_ca` (any other CA fails it); a verified certificate's names go
/// with each request for [`caller`] to find its principal by subject.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: &egress_config::ControlTls,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), egress_api::tls::TlsError> {
    let config = egress_api::tls::server_config(&tls.cert, &tls.key, Some(&tls.client_ca))?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => return Ok(()),
        };
        let (acceptor, app, stop) = (acceptor.clone(), app.clone(), stop.clone());
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(stream));
            let Ok(Ok(tls)) = handshake.await else { return };
            let names = egress_api::tls::peer_names(tls.get_ref().1);
            let inner = hyper_util::service::TowerToHyperService::new(app);
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                use hyper::service::Service as _;
                req.extensions_mut().insert(names.clone());
                inner.call(req)
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                .with_upgrades();
            tokio::select! {
                _ = conn => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

#[derive(utoipa::OpenApi)]
#[openapi(info(
    title = "Loom Egress executor API",
    description = "Invoke tools as single-use confined children. Everything under /v1 needs `Authorization: Bearer <token>` of a principal (the proxy's control token, or a token of `[control] principals_file`) or, with `[control.tls]`, a client certificate naming one; what each may do is its scopes (403 otherwise)."
))]
struct ApiDoc;

fn v1_routes() -> OpenApiRouter<Arc<Executor>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(invoke, list_invocations))
        .routes(routes!(get_invocation))
        .routes(routes!(abort))
        .routes(routes!(get_cell))
        .routes(routes!(mcp::post, mcp::get, mcp::delete))
}

/// `GET /v1/cell`: the cell's id, the policy digest, invocations in
/// flight and pool capacity (the store's epoch is the proxy's: its own
/// `GET /v1/cell` says it).
#[utoipa::path(get, path = "/v1/cell", tag = "cell",
    security(("control_token" = [])),
    responses(
        (status = 200, description = "The cell's identity and capacity", body = egress_api::CellView),
        (status = 401, description = "unauthorized", body = ErrorBody),
    ))]
async fn get_cell(State(exec): State<Arc<Executor>>) -> Json<egress_api::CellView> {
    Json(exec.cell_view())
}

/// What every `/v1` operation shares, added once the routes are collected:
/// the bearer scheme, and `503 no_token` (an executor without a control
/// token refuses every call).
fn complete(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    doc.components.get_or_insert_with(Default::default).add_security_scheme(
        "control_token",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    let no_token = ResponseBuilder::new()
        .description("no_token: the executor has no control token to check against")
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build();
    for (path, item) in doc.paths.paths.iter_mut() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            op.responses
                .responses
                .entry("503".into())
                .or_insert_with(|| no_token.clone().into());
        }
    }
}

fn open_routes() -> OpenApiRouter<Arc<Executor>> {
    OpenApiRouter::new().routes(routes!(metrics)).routes(routes!(healthz))
}

/// The OpenAPI 3.1 document of this API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let (_, mut doc) = v1_routes().split_for_parts();
    let (_, open) = open_routes().split_for_parts();
    doc.merge(open);
    complete(&mut doc);
    doc
}

/// `GET /v1/invocations` answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct InvocationList {
    pub invocations: Vec<InvocationSummary>,
    /// The `after` of the next page; `null` on the last one.
    pub next: Option<String>,
}

/// An error answer that is not an invocation's result:
/// `{"error": {"code", "message"}}`, as the proxy's control API answers.
/// An error that is not an invocation's answer: the same `ErrorBody` as the
/// proxy's control API.
fn api_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(code, message))).into_response()
}

#[utoipa::path(post, path = "/v1/invocations", tag = "invocations", request_body = InvocationRequest,
    security(("control_token" = [])),
    responses(
        (status = 200, description = "The invocation ran: `ok`, or the tool's failure (tool_error, timeout, aborted, disconnected, protocol, startup). A repeated `idempotency_key` gets the first answer again, or its stub with `body_dropped` once the executor no longer keeps its body; the tool never runs twice (in a fleet, wherever the first ran: the answer is the owner's, with the owner's status)", body = InvocationResult),
        (status = 400, description = "bad_request: the body is not JSON of this schema (or over 2 MiB, or not `application/json`), `timeout_ms` is 0, `run_id` is not a valid id, or an invocation with this `run_id` or `idempotency_key` is in flight, or the key is empty or over 256 characters", body = InvocationResult),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "unknown_tool", body = InvocationResult),
        (status = 409, description = "idempotency_conflict (the key was used with another request, here or at another cell), run_exists (the proxy has a run with this `run_id`), in_progress (another cell runs this key: `cell` and `control_url` name it, and the same request sent there waits for the answer)", body = InvocationResult),
        (status = 502, description = "proxy: the proxy's control API failed", body = InvocationResult),
        (status = 503, description = "busy: no child within the pool's bounds; idempotency_unavailable: a keyed invocation in a fleet whose PostgreSQL cannot be asked (nothing ran); executable_mismatch: a file the tool's children would run does not hash to its pin in expect_sha256 (no child starts; the message names the path, the pinned and the actual digest)", body = InvocationResult),
    ))]
async fn invoke(
    State(exec): State<Arc<Executor>>,
    caller: Caller,
    body: Result<Json<InvocationRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let mut req = match body {
        Ok(Json(r)) => r,
        Err(e) => {
            let r = InvocationResult::failed("", InvokeError::new(ErrorKind::BadRequest, e.body_text()));
            return (StatusCode::BAD_REQUEST, Json(r)).into_response();
        }
    };
    if let Some(r) = caller.refuses(Action::Invoke { tool: &req.tool }) {
        return r;
    }
    req.principal = caller.recorded();
    let (status, json) = exec.answer(req).await.into_http();
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
}

/// Filters of `GET /v1/invocations` (no others: an unknown one is `400`).
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct InvocationFilter {
    /// Only this tool.
    tool: Option<String>,
    #[param(schema_with = egress_api::rules::invocation_state_filter_schema)]
    state: Option<String>,
    /// Only this outcome: `ok` or an error kind.
    outcome: Option<String>,
    /// The last `invocation_id` of the previous page.
    after: Option<String>,
    /// Invocations per page: default 100; 0 counts as 1, above 1000 as 1000.
    #[param(maximum = 18446744073709551615_usize)]
    limit: Option<usize>,
}

/// `GET /v1/invocations`: running and recent invocations, newest first.
#[utoipa::path(get, path = "/v1/invocations", tag = "invocations",
    security(("control_token" = [])),
    params(InvocationFilter),
    responses(
        (status = 200, description = "Newest first", body = InvocationList),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 401, description = "unauthorized", body = ErrorBody),
    ))]
async fn list_invocations(
    State(exec): State<Arc<Executor>>,
    caller: Caller,
    q: Result<axum::extract::Query<InvocationFilter>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let f = match q {
        Ok(axum::extract::Query(f)) => f,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, "bad_request", e.body_text()),
    };
    if f.state.as_deref().is_some_and(|s| s != "running" && s != "done") {
        return api_error(StatusCode::BAD_REQUEST, "bad_request", "state must be running or done");
    }
    let limit = f.limit.unwrap_or(100).clamp(1, 1000);
    let (invocations, next) = exec.invocations(
        f.tool.as_deref(),
        f.state.as_deref(),
        f.outcome.as_deref(),
        f.after.as_deref(),
        limit,
        &|owner| caller.sees(owner),
    );
    Json(InvocationList { invocations, next }).into_response()
}

/// `GET /v1/invocations/{id}`: by invocation id, run id or idempotency key;
/// the whole result once done, the summary while it runs.
#[utoipa::path(get, path = "/v1/invocations/{id}", tag = "invocations",
    security(("control_token" = [])),
    params(("id" = String, Path, description = "Invocation id, run id or idempotency key")),
    responses(
        (status = 200, description = "`{\"state\": \"done\", \"result\": …}` (the answer as `POST` gave it, or its stub with `body_dropped` once the executor no longer keeps its body) or `{\"state\": \"running\", \"invocation\": …}`", body = Object),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found", body = ErrorBody),
    ))]
async fn get_invocation(State(exec): State<Arc<Executor>>, caller: Caller, Path(id): Path<String>) -> Response {
    match exec.invocation(&id, &|owner| caller.sees(owner)) {
        Some(Found::Done(kept)) => {
            // The kept JSON as it is, not parsed again.
            let result = kept.answer_json();
            let mut body = Vec::with_capacity(result.len() + 32);
            body.extend_from_slice(br#"{"state":"done","result":"#);
            body.extend_from_slice(&result);
            body.push(b'}');
            ([(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Some(Found::Running(s)) => Json(json!({"state": "running", "invocation": s})).into_response(),
        None => api_error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "no invocation `{id}` running or among the last {} finished",
                JOURNAL_MAX
            ),
        ),
    }
}

#[utoipa::path(post, path = "/v1/invocations/{id}/abort", tag = "invocations",
    security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id or idempotency key of an invocation in flight")),
    responses(
        (status = 200, description = "`{\"aborted\": true, \"id\"}`; the invocation answers `aborted`", body = Object),
        (status = 401, description = "unauthorized", body = ErrorBody),
        (status = 404, description = "not_found: nothing in flight with that id", body = ErrorBody),
    ))]
async fn abort(State(exec): State<Arc<Executor>>, caller: Caller, Path(id): Path<String>) -> Response {
    if exec.abort_if(&id, &|owner| caller.sees(owner)) {
        (StatusCode::OK, Json(json!({"aborted": true, "id": id}))).into_response()
    } else {
        api_error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no invocation `{id}` in flight"),
        )
    }
}

#[utoipa::path(get, path = "/metrics", tag = "health", responses((status = 200, description = "OpenMetrics text", body = String, content_type = "application/openmetrics-text")))]
async fn metrics(State(exec): State<Arc<Executor>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        exec.metrics().encode(),
    )
        .into_response()
}

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "The process serves", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}
