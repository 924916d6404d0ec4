//! The MCP decision routes the executor asks for each message of a confined
//! MCP session: `POST /v1/runs/{id}/mcp` decides its calls with the run's
//! tool's `[tools.<id>.mcp]` rules in force now (`decide::mcp`) and commits
//! the fact of every refused (or, in report mode, reported) call before it
//! answers; `POST /v1/runs/{id}/mcp/list` filters a list answer (no facts).

use crate::control::error::{bad_request, ApiError, ApiResult, AppJson};
use crate::data::decide::mcp::{arguments_digest, decide, keep_listed, McpRefusal};
use crate::facts::{FactTarget, NewFact, Recorded};
use crate::runs::{Run, RunError, RunState};
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use egress_api::mcp::{
    McpCall, McpCheck, McpDecision, McpList, McpListed, McpVerdict, MCP_CHECK_MAX_CALLS, MCP_LIST_MAX_NAMES,
    MCP_NAME_MAX,
};
use egress_api::ErrorBody;
use egress_config::{Mode, Policy, ToolPolicy};
use std::sync::Arc;
use std::time::Instant;

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

/// The longest called name a fact's target carries, in characters.
const FACT_NAME_MAX: usize = 256;

/// The run `id` (live, not ended), the policy in force and the run's tool
/// in it.
fn run_and_tool(sh: &Shared, id: &str) -> ApiResult<(Arc<Run>, Arc<Policy>, Arc<ToolPolicy>)> {
    let run = sh.runs.get(id).ok_or_else(|| RunError::NotFound(id.to_owned()))?;
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

/// What a fact's target says of a call: kind `mcp`, the called name (cut
/// at [`FACT_NAME_MAX`] characters, control characters replaced), port 0.
fn fact_target(call: &McpCall) -> FactTarget {
    let host = call
        .name
        .as_deref()
        .unwrap_or("")
        .chars()
        .take(FACT_NAME_MAX)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    FactTarget {
        kind: "mcp".to_owned(),
        host,
        port: 0,
    }
}

/// A fact's detail for a refused call: the method, the arguments' digest
/// and the refusal's message (which names the call, never an argument).
/// The digest comes first, so the 512-byte bound never cuts it.
fn fact_detail(call: &McpCall, refusal: &McpRefusal) -> String {
    let method: String = call.method.chars().take(64).collect();
    format!(
        "{method:?} arguments {}: {}",
        arguments_digest(call.arguments.as_ref()),
        refusal.message
    )
}

/// Commits the fact of one refused call (mode `enforce` or `report`),
/// timed and counted as every fact write is.
async fn record(
    sh: &Shared,
    run: &Run,
    policy: &Policy,
    mode: Mode,
    call: &McpCall,
    refusal: &McpRefusal,
) -> Result<Recorded, ApiError> {
    let fact = crate::facts::denial(NewFact {
        run_id: Some(&*run.id),
        tool: Some(&*run.tool),
        reason: refusal.reason.code(),
        mode: mode.as_str(),
        target: Some(fact_target(call)),
        resolved: vec![],
        policy: &policy.digest,
        detail: fact_detail(call, refusal),
    });
    let t0 = Instant::now();
    let res = sh.facts.record(fact).await;
    sh.metrics.fact_write_duration.observe(t0.elapsed().as_secs_f64());
    res.map_err(|e| {
        sh.metrics.fact_write_failures.inc();
        tracing::error!(error = %e, run = %run.id, "MCP denial fact could not be recorded; the check is refused");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "facts_unavailable",
            format!("the MCP denial could not be recorded ({e}); nothing is allowed"),
        )
    })
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
    Path(id): Path<String>,
    AppJson(req): AppJson<McpCheck>,
) -> ApiResult<Json<McpVerdict>> {
    if req.calls.len() > MCP_CHECK_MAX_CALLS {
        return Err(bad_request(format!(
            "at most {MCP_CHECK_MAX_CALLS} calls in one check, not {}",
            req.calls.len()
        )));
    }
    let (run, policy, tool) = run_and_tool(&sh, &id)?;
    let tm = sh.tool_metrics(Some(&run.tool));
    let decided: Vec<Option<McpRefusal>> = req
        .calls
        .iter()
        .map(|call| decide(tool.mcp.as_ref(), call).err())
        .collect();
    // Every refused call's fact at once, so a batch shares one commit.
    let writes = req.calls.iter().zip(&decided).filter_map(|(call, refused)| {
        let refusal = refused.as_ref()?;
        tm.denial(refusal.reason);
        Some(record(&sh, &run, &policy, tool.mode, call, refusal))
    });
    let mut recorded = futures_util::future::join_all(writes).await.into_iter();
    let report = tool.mode == Mode::Report;
    let mut allowed = true;
    let mut decisions = Vec::with_capacity(req.calls.len());
    for (call, refused) in req.calls.iter().zip(decided) {
        let Some(refusal) = refused else {
            decisions.push(McpDecision {
                allowed: true,
                reason: None,
                fact_id: None,
                message: None,
            });
            continue;
        };
        let fact = recorded.next().ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "a refused call has no fact write",
            )
        })??;
        allowed &= report;
        tracing::info!(
            target: "egress::mcp",
            run = %run.id,
            tool = %run.tool,
            method = %call.method,
            decision = if report { "reported" } else { "denied" },
            reason = refusal.reason.code(),
            fact = %fact.id,
            "MCP call {}",
            if report { "allowed in report mode" } else { "refused" }
        );
        decisions.push(McpDecision {
            allowed: report,
            reason: Some(refusal.reason.code().to_owned()),
            fact_id: Some(fact.id),
            message: Some(refusal.message),
        });
    }
    Ok(Json(McpVerdict { allowed, decisions }))
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
    let (_, _, tool) = run_and_tool(&sh, &id)?;
    let keep = req
        .names
        .iter()
        .map(|n| keep_listed(tool.mcp.as_ref(), req.kind, n))
        .collect();
    Ok(Json(McpListed { keep }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deny::DenyReason;
    use serde_json::json;

    fn call(name: &str, arguments: serde_json::Value) -> McpCall {
        McpCall {
            method: "tools/call".to_owned(),
            name: Some(name.to_owned()),
            arguments: Some(arguments),
        }
    }

    #[test]
    fn a_fact_names_the_call_and_the_digest_never_an_argument() {
        let c = call(
            "write_file",
            json!({"path": "/etc/passwd", "token": "sk-live-SECRET-4242"}),
        );
        let refusal = McpRefusal {
            reason: DenyReason::McpArgumentsNotAllowed,
            message: "MCP tool \"write_file\": these arguments are not allowed".to_owned(),
        };
        let detail = fact_detail(&c, &refusal);
        assert!(detail.starts_with("\"tools/call\" arguments sha256:"), "{detail}");
        assert!(detail.contains(&arguments_digest(c.arguments.as_ref())), "{detail}");
        assert!(detail.contains("write_file"), "{detail}");
        for secret in ["sk-live-SECRET-4242", "/etc/passwd", "token"] {
            assert!(!detail.contains(secret), "{secret} in {detail}");
        }
        let t = fact_target(&c);
        assert_eq!((t.kind.as_str(), t.host.as_str(), t.port), ("mcp", "write_file", 0));
    }

    #[test]
    fn a_fact_target_is_bounded_and_has_no_control_characters() {
        let long = format!("a\nb{}", "é".repeat(1000));
        let t = fact_target(&call(&long, json!({})));
        assert_eq!(t.host.chars().count(), FACT_NAME_MAX);
        assert!(t.host.starts_with("a b"));
        let none = McpCall {
            method: "tools/call".to_owned(),
            name: None,
            arguments: None,
        };
        assert_eq!(fact_target(&none).host, "");
        // The digest survives the detail's bound, whatever the message.
        let refusal = McpRefusal {
            reason: DenyReason::McpToolNotAllowed,
            message: "x".repeat(2000),
        };
        let detail = crate::facts::bounded(fact_detail(&none, &refusal));
        assert!(detail.contains(&arguments_digest(None)), "{detail}");
    }
}
