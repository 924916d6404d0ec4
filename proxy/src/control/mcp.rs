//! The MCP decision routes the executor asks for each message of a confined
//! MCP session: `POST /v1/runs/{id}/mcp` decides its calls with the run's
//! tool's `[tools.<id>.mcp]` rules in force now (`decide::mcp_check`, which
//! commits the fact of every refused or reported call before it answers);
//! `POST /v1/runs/{id}/mcp/list` filters a list answer (no facts).

use crate::control::caller::Caller;
use crate::control::error::{bad_request, ApiError, ApiResult, AppJson};
use crate::data::decide::mcp::keep_listed;
use crate::data::decide::mcp_check;
use crate::runs::{Run, RunError, RunState};
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use egress_api::mcp::{
    McpCheck, McpList, McpListed, McpVerdict, MCP_CHECK_MAX_CALLS, MCP_LIST_MAX_NAMES, MCP_NAME_MAX,
};
use egress_api::ErrorBody;
use egress_config::{Policy, ToolPolicy};
use std::sync::Arc;

/// The largest body of these routes: an MCP message's arguments can be
/// large (a file's contents to write), up to the executor's own bound on a
/// session message (`max_message_bytes`, 4 MiB by default); every other
/// route keeps the control API's 64 KiB.
pub const BODY_MAX: usize = 16 << 20;

/// The two routes, with their own body bound ([`BODY_MAX`]).
pub(super) fn routes() -> utoipa_axum::router::OpenApiRouter<Arc<Shared>> {
    utoipa_axum::router::OpenApiRouter::new()
        .routes(utoipa_axum::routes!(check))
        .routes(utoipa_axum::routes!(list))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_MAX))
}

/// The run `id` (live, not ended), the policy in force and the run's tool
/// in it.
fn run_and_tool(sh: &Shared, caller: &Caller, id: &str) -> ApiResult<(Arc<Run>, Arc<Policy>, Arc<ToolPolicy>)> {
    let run = crate::control::runs::find_for(sh, caller, id)?;
    if run.state() == RunState::Ended {
        return Err(RunError::Ended(id.to_owned()).into());
    }
    let policy = sh.policy.load_full();
    let Some(tool) = policy.tool(&run.tool).cloned() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_tool",
            format!("tool {:?} of run {id} is no longer configured", &*run.tool),
        ));
    };
    Ok((run, policy, tool))
}

/// Decides the calls of one JSON-RPC message (a request, or every request
/// of a batch) of the run's MCP session with its tool's rules in force now.
/// A refused call's fact is committed before the answer; in report mode the
/// call is allowed and its fact says `report`. One refused call refuses
/// the whole message (`allowed: false`), every call still decided.
#[utoipa::path(post, path = "/v1/runs/{id}/mcp", tag = "mcp", request_body = McpCheck,
    security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "The verdict, one decision per call in order; each refused or reported call's fact is committed before this answer", body = McpVerdict),
        (status = 400, description = "bad_request: more than 256 calls", body = ErrorBody),
        (status = 404, description = "run_not_found; unknown_tool: the run's tool is no longer configured", body = ErrorBody),
        (status = 409, description = "run_ended", body = ErrorBody),
        (status = 503, description = "facts_unavailable: a refused call's fact could not be recorded (nothing is allowed)", body = ErrorBody),
    ))]
pub(super) async fn check(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    AppJson(req): AppJson<McpCheck>,
) -> ApiResult<Json<McpVerdict>> {
    if req.calls.len() > MCP_CHECK_MAX_CALLS {
        return Err(bad_request(format!(
            "at most {MCP_CHECK_MAX_CALLS} calls in one check, not {}",
            req.calls.len()
        )));
    }
    let (run, policy, tool) = run_and_tool(&sh, &caller, &id)?;
    let verdict = mcp_check::check(&sh, &run, &policy, &tool, &req.calls)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "facts_unavailable",
                format!("the MCP denial could not be recorded ({e}); nothing is allowed"),
            )
        })?;
    Ok(Json(verdict))
}

/// Which entries of one `*/list` answer the run's MCP client may see: an
/// entry is kept when some rule could allow a call to it. Records nothing.
#[utoipa::path(post, path = "/v1/runs/{id}/mcp/list", tag = "mcp", request_body = McpList,
    security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "One flag per name, in order: `true` keeps the entry", body = McpListed),
        (status = 400, description = "bad_request: more than 4096 names, or a name longer than 2048 characters", body = ErrorBody),
        (status = 404, description = "run_not_found; unknown_tool: the run's tool is no longer configured", body = ErrorBody),
        (status = 409, description = "run_ended", body = ErrorBody),
    ))]
pub(super) async fn list(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    AppJson(req): AppJson<McpList>,
) -> ApiResult<Json<McpListed>> {
    if req.names.len() > MCP_LIST_MAX_NAMES {
        return Err(bad_request(format!(
            "at most {MCP_LIST_MAX_NAMES} names in one list check, not {}",
            req.names.len()
        )));
    }
    if let Some(i) = req
        .names
        .iter()
        .position(|n| n.len() > MCP_NAME_MAX && n.chars().count() > MCP_NAME_MAX)
    {
        return Err(bad_request(format!(
            "names[{i}] is longer than {MCP_NAME_MAX} characters"
        )));
    }
    let (_, _, tool) = run_and_tool(&sh, &caller, &id)?;
    let keep = req
        .names
        .iter()
        .map(|n| keep_listed(tool.mcp.as_ref(), req.kind, n))
        .collect();
    Ok(Json(McpListed { keep }))
}
