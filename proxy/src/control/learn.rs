//! What recorded traffic says about a policy, over the API: a tool's
//! proposed allowlist (`GET /v1/tools/{tool}/suggestion`) and a new
//! policy's replay (`POST /v1/policy/replay`). The issue asked for
//! `GET /v1/policy/replay` with the TOML in the body; a GET body is not
//! portable (proxies and clients drop it), so the TOML goes in a POST's
//! JSON body. Both call the same pure functions as `egress-proxy policy
//! suggest` and `policy replay` ([`crate::learn`]).

use crate::control::caller::Caller;
use crate::control::error::{bad_request, ApiError, ApiResult, AppJson, AppQuery};
use crate::learn::history::{self, Window};
use crate::learn::replay::{self, Replay};
use crate::learn::suggest::{self, Proposal};
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use egress_api::ErrorBody;
use serde::Deserialize;
use std::sync::Arc;

/// `since` of both calls: `30s`, `15m`, `24h`, `7d` (or seconds).
fn window(tool: Option<String>, since: Option<&str>) -> ApiResult<Window> {
    let since = match since {
        Some(s) => Some(crate::learn::since(crate::learn::parse_duration(s).ok_or_else(
            || bad_request(format!("since {s:?} is not a duration (e.g. 30m, 24h, 7d)")),
        )?)),
        None => None,
    };
    Ok(Window { tool, since })
}

fn unavailable(e: String) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "records_unavailable", e)
}

/// The query of a suggestion.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SuggestParams {
    /// Only records this recent: `30m`, `24h`, `7d` (default: all kept).
    #[serde(default)]
    #[param(pattern = r"^[0-9]{1,9}[smhd]?$")]
    pub since: Option<String>,
    /// Collapse two or more names under one registrable domain to
    /// `*.domain:port` (never over a public suffix).
    #[serde(default)]
    pub wildcards: bool,
}

#[utoipa::path(get, path = "/v1/tools/{tool}/suggestion", tag = "policy", security(("control_token" = [])),
    params(("tool" = String, Path, description = "Tool id"), SuggestParams),
    responses(
        (status = 200, description = "A proposed allowlist from the tool's denials, report-mode facts and decision records, with a TOML rendering", body = Proposal),
        (status = 400, description = "bad_request (since is not a duration)", body = ErrorBody),
        (status = 403, description = "scope: suggestions read every record (facts:all and decisions:all)", body = ErrorBody),
        (status = 404, description = "unknown_tool", body = ErrorBody),
        (status = 503, description = "records_unavailable", body = ErrorBody),
    ))]
pub(super) async fn suggestion(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(tool): Path<String>,
    AppQuery(q): AppQuery<SuggestParams>,
) -> ApiResult<Json<Proposal>> {
    caller.may(egress_config::principals::Action::Learn)?;
    let policy = sh.policy.load_full();
    let Some(t) = policy.tool(&tool) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_tool",
            format!("no tool {tool:?} is configured"),
        ));
    };
    let w = window(Some(tool.clone()), q.since.as_deref())?;
    let seen = history::read_live(&sh, &w).await.map_err(unavailable)?;
    Ok(Json(suggest::suggest(&tool, Some(t), &seen, q.wildcards)))
}

/// `POST /v1/policy/replay`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    /// The new configuration file's text (TOML); its policy is replayed.
    pub config: String,
    /// Only records this recent: `30m`, `24h`, `7d`.
    #[serde(default)]
    #[schema(pattern = r"^[0-9]{1,9}[smhd]?$")]
    pub since: Option<String>,
    /// Only this tool's records.
    #[serde(default)]
    pub tool: Option<String>,
}

#[utoipa::path(post, path = "/v1/policy/replay", tag = "policy", security(("control_token" = [])),
    request_body = ReplayRequest,
    responses(
        (status = 200, description = "What the new policy would change of the recorded decisions and denials, per tool (`breaks`: something that went out would be denied)", body = Replay),
        (status = 400, description = "bad_request (since is not a duration)", body = ErrorBody),
        (status = 403, description = "scope: replays read every record (facts:all and decisions:all)", body = ErrorBody),
        (status = 422, description = "invalid_config, with every problem", body = ErrorBody),
        (status = 503, description = "records_unavailable", body = ErrorBody),
    ))]
pub(super) async fn replay(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    AppJson(req): AppJson<ReplayRequest>,
) -> ApiResult<Json<Replay>> {
    caller.may(egress_config::principals::Action::Learn)?;
    let cfg = egress_config::Config::parse(&req.config, "replay.toml")
        .map_err(|e| crate::control::error::invalid_config(&e))?;
    let w = window(req.tool, req.since.as_deref())?;
    Ok(Json(replayed(&sh, &cfg.policy, &w).await?))
}

/// The recorded traffic of `w` replayed under `policy` (`503
/// records_unavailable` when it cannot be read): the replay and the diff's
/// join.
pub(super) async fn replayed(sh: &Shared, policy: &egress_config::Policy, w: &Window) -> ApiResult<Replay> {
    let seen = history::read_live(sh, w).await.map_err(unavailable)?;
    Ok(replay::replay(policy, &seen))
}
