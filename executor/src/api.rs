//! The kernel-facing HTTP API of `egress-executor serve`:
//! `POST /v1/invocations`, `POST /v1/invocations/{id}/abort`, `GET /metrics`,
//! `GET /healthz`. Error kinds map to HTTP statuses in `ErrorKind::http_status`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::executor::{Executor, InvocationRequest};

/// The router, ready for `axum::serve`. `/v1` needs the same bearer token as
/// the proxy's control API: tools share the host's loopback unless confined,
/// and must not be able to invoke other tools.
pub fn router(exec: Arc<Executor>) -> Router {
    let v1 = Router::new()
        .route("/v1/invocations", post(invoke))
        .route("/v1/invocations/{id}/abort", post(abort))
        .route_layer(axum::middleware::from_fn_with_state(exec.clone(), require_token));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .merge(v1)
        .with_state(exec)
}

async fn require_token(
    State(exec): State<Arc<Executor>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use subtle::ConstantTimeEq;
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let expected = exec.control_token();
    match (presented, expected) {
        (Some(p), Some(e)) if bool::from(p.as_bytes().ct_eq(e.as_bytes())) => next.run(req).await,
        (_, None) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({"error": {"code": "no_token", "message": "the executor has no control token to check against"}}),
            ),
        )
            .into_response(),
        _ => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Json(
                json!({"error": {"code": "unauthorized", "message": "Authorization: Bearer <control token> required"}}),
            ),
        )
            .into_response(),
    }
}

async fn invoke(
    State(exec): State<Arc<Executor>>,
    body: Result<Json<InvocationRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(r)) => r,
        Err(e) => {
            let r = InvocationResult::failed("", InvokeError::new(ErrorKind::BadRequest, e.body_text()));
            return (StatusCode::BAD_REQUEST, Json(r)).into_response();
        }
    };
    let result = exec.invoke(req).await;
    let status = result.error.as_ref().map(|e| e.kind.http_status()).unwrap_or(200);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    (status, Json(result)).into_response()
}

async fn abort(State(exec): State<Arc<Executor>>, Path(id): Path<String>) -> Response {
    if exec.abort(&id) {
        (StatusCode::OK, Json(json!({"aborted": true, "id": id}))).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": "not_found", "message": format!("no invocation `{id}` in flight")}})),
        )
            .into_response()
    }
}

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

async fn healthz() -> &'static str {
    "ok\n"
}
