//! The control plane: the API for kernels, the executor and Prometheus.
//! Routes live by subject (`runs`, `mcp`, `facts`, `decisions`, `sse`, `owners`,
//! `policy`, `learn`, `health`; `format` writes records as stored or as OCSF);
//! this module assembles them with their OpenAPI document and serves them
//! (`client` is the other side: the CLI's reader of another proxy's
//! records). Everything under `/v1` needs `Authorization: Bearer <token>` of
//! a principal (`caller`: the control token's, or the principals file's),
//! and each handler asks the caller's scopes; errors are
//! `{"error":{"code","message"}}` (`error`). A connection is admitted as on
//! the data listener: pending until a request carries a principal's token,
//! so idle or tokenless sockets cannot lock kernels out.

pub(crate) mod actions;
mod audit;
mod ca;
pub(crate) mod caller;
mod cell;
pub mod client;
mod decisions;
pub(crate) mod envelope;
pub(crate) mod error;
mod facts;
mod format;
mod health;
mod learn;
mod mcp;
mod owners;
pub(crate) mod policy;
pub(crate) mod runs;
mod sse;
pub(crate) mod token;

use crate::admission::Conn;
use crate::listener::{self, serve_one, Serve, Spec};
use crate::state::Shared;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use error::ApiError;
use hyper::server::conn::http1::Builder;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use utoipa::OpenApi as _;
use utoipa_axum::{router::OpenApiRouter, routes};

pub use policy::reload;

/// Names the proxy process that answered (changes on every restart).
pub const INSTANCE_HEADER: &str = "x-egress-instance";

/// The `/v1` routes, each documented in the OpenAPI document that the same
/// call builds: a route cannot exist without its entry.
fn api_routes() -> OpenApiRouter<Arc<Shared>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(runs::create_run, runs::list_runs))
        .routes(routes!(runs::get_run, runs::end_run))
        .routes(routes!(runs::activate_run))
        .routes(routes!(runs::create_grant))
        .merge(mcp::routes())
        .routes(routes!(facts::run_facts))
        .routes(routes!(facts::list_facts))
        .routes(routes!(sse::stream))
        .routes(routes!(decisions::list_decisions))
        .routes(routes!(decisions::run_decisions))
        .routes(routes!(decisions::stream))
        .routes(routes!(policy::reload_handler))
        .routes(routes!(policy::get_policy))
        .routes(routes!(policy::diff))
        .routes(routes!(actions::executable_mismatch))
        .routes(routes!(learn::suggestion))
        .routes(routes!(learn::replay))
        .routes(routes!(ca::get_ca))
        .routes(routes!(cell::get_cell))
        .routes(routes!(audit::checkpoint))
        .routes(routes!(owners::list_owners))
        .routes(routes!(owners::renew_owner, owners::release_owner))
}

/// The routes without credential, documented too.
fn open_routes() -> OpenApiRouter<Arc<Shared>> {
    OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics))
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Loom Egress proxy control API",
        description = "Runs, facts, owners and policy of the egress proxy. Everything under /v1 needs `Authorization: Bearer <token>` of a principal (the control token, or a token of `[control] principals_file`) or, with `[control.tls]`, a client certificate naming one; what each may do is its scopes (403 otherwise); errors are `{\"error\":{\"code\",\"message\"}}`. The component `Denial` is what the data plane (not this API) answers a denied fetch with: the `X-Egress-Denial` header, and the body when the request accepts `application/json`."
    ),
    components(schemas(egress_api::Denial))
)]
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
                    .or_insert_with(|| error("unauthorized: no token, or one of no principal").into());
                r.entry("403".into()).or_insert_with(|| {
                    error("scope, not_your_run: the principal may not do this (see the principals file)").into()
                });
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
    let api = api.route_layer(middleware::from_fn_with_state(sh.clone(), caller::authenticate));
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
pub async fn serve(sh: Arc<Shared>, l: TcpListener) {
    let mut builder = Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(sh.cfg.header_read_timeout);
    let spec = Spec {
        name: "control",
        stop: sh.control_stop.clone(),
        drained: false,
        tls: sh.control_tls.clone().or_else(|| sh.tls.clone()),
    };
    let serve = ControlConn {
        sh: sh.clone(),
        app: router(sh.clone()),
        builder: Arc::new(builder),
    };
    let admission = sh.control_admission.clone();
    listener::accept_loop(sh, l, admission, spec, serve).await;
}

/// Serves the control API on one connection.
#[derive(Clone)]
struct ControlConn {
    sh: Arc<Shared>,
    app: Router,
    builder: Arc<Builder>,
}

impl Serve for ControlConn {
    async fn serve<I>(&self, io: I, conn: Arc<Conn>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let inner = TowerToHyperService::new(self.app.clone());
        let (sh, svc_conn) = (self.sh.clone(), conn.clone());
        let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            use futures_util::future::Either;
            use hyper::service::Service as _;
            if let Some(peer) = svc_conn.peer() {
                req.extensions_mut().insert(peer.clone());
            }
            if svc_conn.is_pending() && caller::principal(&sh, &req).is_some() {
                if let Err(refused) = svc_conn.establish(None) {
                    sh.count_closed("control", refused.label());
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
        let c = self.builder.serve_connection(TokioIo::new(io), svc);
        let stop = &self.sh.control_stop;
        serve_one(stop, stop, &conn.cut, c).await;
    }
}

/// Every control answer names the proxy instance that gave it.
async fn stamp_instance(State(sh): State<Arc<Shared>>, mut r: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&sh.instance) {
        r.headers_mut().insert(INSTANCE_HEADER, v);
    }
    r
}
