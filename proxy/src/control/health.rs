//! Routes without credential: liveness, readiness (503 while draining or
//! when the fact store cannot write) and the Prometheus metrics.

use crate::state::Shared;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "The process serves", body = String)))]
pub(super) async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/readyz", tag = "health", responses(
    (status = 200, description = "Ready", body = String),
    (status = 503, description = "Shutting down (draining), the fact store cannot write, another process holds the cell id (`cell_id_in_use`), or more than `export.max_lag` facts wait to be exported (`export_lag`)", body = String),
))]
pub(super) async fn readyz(State(sh): State<Arc<Shared>>) -> Response {
    match sh.unready() {
        None => "ready\n".into_response(),
        Some("shutting_down") => (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response(),
        Some("fact_store") => (StatusCode::SERVICE_UNAVAILABLE, "fact store unavailable\n").into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "health", responses(
    (status = 200, description = "OpenMetrics text", body = String, content_type = "application/openmetrics-text"),
    (status = 401, description = "unauthorized: with `[control] metrics_require_token = true`, no token of a principal", body = egress_api::ErrorBody),
    (status = 403, description = "scope: with `[control] metrics_require_token = true`, the principal has no metrics scope", body = egress_api::ErrorBody),
))]
pub(super) async fn metrics(State(sh): State<Arc<Shared>>, req: axum::extract::Request) -> Response {
    if sh.metrics_require_token {
        let Some(p) = crate::control::caller::principal(&sh, &req) else {
            return crate::control::error::ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "[control] metrics_require_token: Authorization: Bearer <token> of a principal with the metrics scope required",
            )
            .into_response();
        };
        if let Err(e) = crate::control::caller::Caller(p).may(egress_config::principals::Action::Metrics) {
            return e.into_response();
        }
    }
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
