//! Fact routes: every fact by cursor, one run's facts by cursor (the live
//! tail is `sse`).

use crate::control::error::{bad_request, ApiError, ApiResult, AppQuery};
use crate::facts::FactQuery;
use crate::state::Shared;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use egress_api::{Cursor, ErrorBody, FactsPage};
use std::sync::Arc;

/// A fact cursor from the query string: `400 bad_request` when it does not
/// parse or is above [`Cursor::MAX_AFTER`] (refused rather than wrapped).
pub struct FactCursor(pub Cursor);

impl<S: Send + Sync> FromRequestParts<S> for FactCursor {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let AppQuery(c) = AppQuery::<Cursor>::from_request_parts(parts, state).await?;
        if c.after > Cursor::MAX_AFTER {
            return Err(bad_request(format!("after must be at most {}", Cursor::MAX_AFTER)));
        }
        Ok(FactCursor(c))
    }
}

#[utoipa::path(get, path = "/v1/facts", tag = "facts", security(("control_token" = [])),
    params(Cursor),
    responses(
        (status = 200, description = "Facts with seq > after, oldest first", body = FactsPage),
        (status = 400, description = "bad_request (e.g. after above 2^63-1)", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
pub(super) async fn list_facts(State(sh): State<Arc<Shared>>, FactCursor(c): FactCursor) -> ApiResult<Json<FactsPage>> {
    query_facts(&sh, c, None).await
}

#[utoipa::path(get, path = "/v1/runs/{id}/facts", tag = "facts", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id"), Cursor),
    responses(
        (status = 200, description = "The run's facts with seq > after", body = FactsPage),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
pub(super) async fn run_facts(
    State(sh): State<Arc<Shared>>,
    Path(id): Path<String>,
    FactCursor(c): FactCursor,
) -> ApiResult<Json<FactsPage>> {
    query_facts(&sh, c, Some(id)).await
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
