//! Fact routes: every fact by cursor, one run's facts by cursor (the live
//! tail is `sse`), as stored or as OCSF events (`format`).

use crate::control::caller::Caller;
use crate::control::error::{bad_request, ApiError, ApiResult, AppQuery};
use crate::control::format::{facts_page, FactsAnswer};
use crate::facts::FactQuery;
use crate::state::Shared;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use egress_api::{Cursor, ErrorBody};
use egress_config::principals::{Action, Record};
use std::sync::Arc;

/// A query with a cursor (`after`), as [`Paging`] checks it.
pub trait Paged {
    fn after(&self) -> u64;
}

impl Paged for Cursor {
    fn after(&self) -> u64 {
        self.after
    }
}

/// A cursor query from the query string (facts, decisions): `400
/// bad_request` when it does not parse or `after` is above
/// [`Cursor::MAX_AFTER`] (refused rather than wrapped).
pub struct Paging<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Paged> FromRequestParts<S> for Paging<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let AppQuery(c) = AppQuery::<T>::from_request_parts(parts, state).await?;
        if c.after() > Cursor::MAX_AFTER {
            return Err(bad_request(format!("after must be at most {}", Cursor::MAX_AFTER)));
        }
        Ok(Paging(c))
    }
}

/// A page's size from its `limit`: default 100; 0 counts as 1, above 1000
/// as 1000.
pub fn page_size(limit: Option<usize>) -> usize {
    limit.unwrap_or(100).clamp(1, 1000)
}

#[utoipa::path(get, path = "/v1/facts", tag = "facts", security(("control_token" = [])),
    params(Cursor),
    responses(
        (status = 200, description = "Facts with seq > after, oldest first: `{facts, next}`, or with `format=ocsf` `{events, next}` (each fact as an OCSF 1.8.0 event; the same `next`)", body = FactsAnswer),
        (status = 400, description = "bad_request (e.g. after above 2^63-1, a format other than json or ocsf)", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
pub(super) async fn list_facts(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Paging(c): Paging<Cursor>,
) -> ApiResult<Json<FactsAnswer>> {
    query_facts(&sh, &caller, c, None).await
}

#[utoipa::path(get, path = "/v1/runs/{id}/facts", tag = "facts", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id"), Cursor),
    responses(
        (status = 200, description = "The run's facts with seq > after: `{facts, next}`, or with `format=ocsf` `{events, next}`", body = FactsAnswer),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
pub(super) async fn run_facts(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Paging(c): Paging<Cursor>,
) -> ApiResult<Json<FactsAnswer>> {
    query_facts(&sh, &caller, c, Some(id)).await
}

/// A page of what the caller may see (`facts:own`: facts of its runs and
/// its own control actions); `next` moves past what it may not.
async fn query_facts(sh: &Shared, caller: &Caller, c: Cursor, run_id: Option<String>) -> ApiResult<Json<FactsAnswer>> {
    caller.may(Action::ReadFacts)?;
    let limit = page_size(c.limit);
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
    let mut facts = facts;
    facts.retain(|f| caller.sees(Record::Fact, f.principal.as_deref()));
    Ok(Json(facts_page(c.format, facts, next)))
}
