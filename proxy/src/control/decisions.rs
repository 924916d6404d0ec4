//! Decision log routes: every record by cursor (filtered by run and tool),
//! one run's records, and the live tail (`sse`'s [`tail`]), as stored or as
//! OCSF events (`format`). Cursors are checked and pages sized as for facts
//! ([`Paging`], [`page_size`]).

use crate::control::caller::Caller;
use crate::control::error::{ApiError, ApiResult};
use crate::control::facts::{page_size, Paged, Paging};
use crate::control::format::{decision_sse_in, decisions_page, DecisionsAnswer};
use crate::control::sse::{self, Feed};
use crate::facts::decisions::DecisionQuery;
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::Json;
use egress_api::ErrorBody;
use egress_config::principals::{Action, Record};
use futures_util::Stream;
use serde::Deserialize;
use std::convert::Infallible;
use std::sync::Arc;

/// A decision cursor and its filters.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DecisionFilter {
    /// Records with `seq` greater than this (0 ..= 2^63−1).
    #[serde(default)]
    #[param(maximum = 9223372036854775807_usize)]
    pub after: u64,
    /// Records per page: default 100; 0 counts as 1, above 1000 as 1000.
    /// The live stream ignores it.
    #[serde(default)]
    #[param(maximum = 18446744073709551615_usize)]
    pub limit: Option<usize>,
    /// Only this run's records.
    #[serde(default)]
    pub run: Option<String>,
    /// Only this tool's records.
    #[serde(default)]
    pub tool: Option<String>,
    /// `json` (default): the records as the store keeps them; `ocsf`: each
    /// as an OCSF 1.8.0 event.
    #[serde(default)]
    #[param(inline)]
    pub format: egress_api::RecordFormat,
}

impl Paged for DecisionFilter {
    fn after(&self) -> u64 {
        self.after
    }
}

impl DecisionFilter {
    fn query(self, limit: usize) -> DecisionQuery {
        DecisionQuery {
            after: self.after,
            limit,
            run_id: self.run,
            tool: self.tool,
            since: None,
        }
    }
}

fn unavailable(e: impl ToString) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "decisions_unavailable", e.to_string())
}

#[utoipa::path(get, path = "/v1/decisions", tag = "decisions", security(("control_token" = [])),
    params(DecisionFilter),
    responses(
        (status = 200, description = "Allowed fetches and tunnels recorded with seq > after, oldest first (empty with `decisions = \"off\"`): `{decisions, next}`, or with `format=ocsf` `{events, next}` (each record as an OCSF 1.8.0 event; the same `next`)", body = DecisionsAnswer),
        (status = 400, description = "bad_request (e.g. after above 2^63-1, a format other than json or ocsf)", body = ErrorBody),
        (status = 503, description = "decisions_unavailable", body = ErrorBody),
    ))]
pub(super) async fn list_decisions(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Paging(f): Paging<DecisionFilter>,
) -> ApiResult<Json<DecisionsAnswer>> {
    page(&sh, &caller, f, None).await
}

#[utoipa::path(get, path = "/v1/runs/{id}/decisions", tag = "decisions", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id"), DecisionFilter),
    responses(
        (status = 200, description = "The run's recorded fetches with seq > after: `{decisions, next}`, or with `format=ocsf` `{events, next}`", body = DecisionsAnswer),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 503, description = "decisions_unavailable", body = ErrorBody),
    ))]
pub(super) async fn run_decisions(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Paging(f): Paging<DecisionFilter>,
) -> ApiResult<Json<DecisionsAnswer>> {
    page(&sh, &caller, f, Some(id)).await
}

/// A page of what the caller may see: `next` moves past what it may not.
async fn page(
    sh: &Shared,
    caller: &Caller,
    f: DecisionFilter,
    run: Option<String>,
) -> ApiResult<Json<DecisionsAnswer>> {
    caller.may(Action::ReadDecisions)?;
    let (after, format) = (f.after, f.format);
    let limit = page_size(f.limit);
    let mut q = f.query(limit);
    if run.is_some() {
        q.run_id = run;
    }
    let mut decisions = sh.decisions.query(q).await.map_err(unavailable)?;
    let next = decisions.last().map(|d| d.seq).unwrap_or(after);
    decisions.retain(|d| caller.sees(Record::Decision, d.principal.as_deref()));
    Ok(Json(decisions_page(format, decisions, next)))
}

/// `GET /v1/decisions/stream`.
#[utoipa::path(get, path = "/v1/decisions/stream", tag = "decisions", security(("control_token" = [])),
    params(DecisionFilter),
    responses(
        (status = 200, description = "Server-Sent Events: `event: decision`, `id: <seq>`, `data: <decision JSON>` (with `format=ocsf`, its OCSF 1.8.0 event); replay from the cursor, then live", body = egress_api::SseEvent, content_type = "text/event-stream"),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 503, description = "too_many_streams", body = ErrorBody),
    ))]
pub(super) async fn stream(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Paging(f): Paging<DecisionFilter>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    caller.may(Action::ReadDecisions)?;
    let place = sse::place(&sh)?;
    let (after, event) = (f.after, decision_sse_in(f.format));
    let filter = f.query(500);
    let (log, paged) = (sh.decisions.clone(), filter.clone());
    let feed = Feed {
        rx: sh.decisions.subscribe(),
        page: Box::new(move |after| {
            let (log, q) = (log.clone(), DecisionQuery { after, ..paged.clone() });
            Box::pin(async move { log.query(q).await.map_err(|e| e.to_string()) })
        }),
        keep: Box::new(move |d| {
            filter.run_id.as_deref().is_none_or(|r| r == d.run_id)
                && filter.tool.as_deref().is_none_or(|t| t == d.tool)
                && caller.sees(Record::Decision, d.principal.as_deref())
        }),
        seq: |d| d.seq,
        event,
    };
    Ok(sse::tail(sh, place, after, feed))
}
