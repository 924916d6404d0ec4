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
        .route("/v1/invocations", post(invoke).get(list_invocations))
        .route("/v1/invocations/{id}", get(get_invocation))
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

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct InvocationFilter {
    tool: Option<String>,
    /// `running` or `done`.
    state: Option<String>,
    /// `ok` or an error kind.
    outcome: Option<String>,
    /// The last `invocation_id` of the previous page.
    after: Option<String>,
    /// 1-1000, default 100.
    limit: Option<usize>,
}

/// `GET /v1/invocations`: running and recent invocations, newest first.
async fn list_invocations(
    State(exec): State<Arc<Executor>>,
    q: Result<axum::extract::Query<InvocationFilter>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let f = match q {
        Ok(axum::extract::Query(f)) => f,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"code": "bad_request", "message": e.body_text()}})),
            )
                .into_response()
        }
    };
    if f.state.as_deref().is_some_and(|s| s != "running" && s != "done") {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"code": "bad_request", "message": "state must be running or done"}})),
        )
            .into_response();
    }
    let limit = f.limit.unwrap_or(100).clamp(1, 1000);
    let (invocations, next) = exec.invocations(
        f.tool.as_deref(),
        f.state.as_deref(),
        f.outcome.as_deref(),
        f.after.as_deref(),
        limit,
    );
    Json(json!({"invocations": invocations, "next": next})).into_response()
}

/// `GET /v1/invocations/{id}`: by invocation id, run id or idempotency key;
/// the whole result once done, the summary while it runs.
async fn get_invocation(State(exec): State<Arc<Executor>>, Path(id): Path<String>) -> Response {
    match exec.invocation(&id) {
        Some(crate::executor::Found::Done(r)) => Json(json!({"state": "done", "result": r})).into_response(),
        Some(crate::executor::Found::Running(s)) => Json(json!({"state": "running", "invocation": s})).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": "not_found", "message": format!("no invocation `{id}` running or among the last {} finished", crate::executor::JOURNAL_MAX)}})),
        )
            .into_response(),
    }
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
