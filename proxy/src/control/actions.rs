//! Control actions as facts (`CONTROL_ACTION`): what a principal did or was
//! refused on the control plane, durable before the answer like a denial:
//! a grant or reload refused, a reload applied (with the policy digests
//! before and after), a run ended by a principal it is not attributed to,
//! the principals changed, and refused credentials, which are counted into
//! one fact per [`CREDENTIAL_WINDOW`] rather than one per attempt (an
//! attacker guessing tokens must not be able to fill the store).

use crate::facts::{denial, NewFact};
use crate::runs::Run;
use crate::state::Shared;
use egress_api::{Fact, FactTarget, CONTROL_FACT_TYPE};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// `POST /v1/tools/{tool}/executable_mismatch`: the executor refused to
/// start a child of `tool` whose files do not meet its `expect_sha256`;
/// recorded as a `CONTROL_ACTION` (reason `executable_mismatch`) before
/// the answer, so before the executor answers its `503`. Admin only.
#[utoipa::path(post, path = "/v1/tools/{tool}/executable_mismatch", tag = "policy",
    security(("control_token" = [])),
    params(("tool" = String, Path, description = "Tool id")),
    request_body = egress_api::ExecutableMismatch,
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "bad_request: detail over 4096 bytes", body = egress_api::ErrorBody),
        (status = 403, description = "scope: only an admin (the executor) reports", body = egress_api::ErrorBody),
        (status = 503, description = "facts_unavailable", body = egress_api::ErrorBody),
    ))]
pub(super) async fn executable_mismatch(
    axum::extract::State(sh): axum::extract::State<std::sync::Arc<Shared>>,
    caller: crate::control::caller::Caller,
    axum::extract::Path(tool): axum::extract::Path<String>,
    crate::control::error::AppJson(req): crate::control::error::AppJson<egress_api::ExecutableMismatch>,
) -> Result<axum::http::StatusCode, crate::control::error::ApiError> {
    caller.may(egress_config::principals::Action::ReportExecutor)?;
    if req.detail.len() > 4096 {
        return Err(crate::control::error::bad_request("detail is at most 4096 bytes"));
    }
    let policy = sh.policy.load();
    let tool: String = tool.chars().take(128).collect();
    let f = fact(Action {
        reason: "executable_mismatch",
        principal: caller.recorded().as_deref(),
        run: None,
        tool: Some(&tool),
        target: None,
        detail: format!("a child of tool {tool:?} was not started: {}", req.detail),
        policy: &policy.digest,
    });
    sh.facts.record(f).await.map_err(|e| {
        crate::control::error::ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "facts_unavailable",
            e.to_string(),
        )
    })?;
    sh.metrics.control_action("executable_mismatch");
    Ok(axum::http::StatusCode::NO_CONTENT)
}

/// Refused credentials are summed over this long into one fact.
pub const CREDENTIAL_WINDOW: Duration = Duration::from_secs(10);

/// What a control action fact says.
pub struct Action<'a> {
    /// `grant_refused`, `reload_applied`, `reload_refused`,
    /// `run_ended_by_other`, `principals_changed`, `credential_refused`.
    pub reason: &'static str,
    /// The principal that acted (`None`: the control token's, or unknown).
    pub principal: Option<&'a str>,
    pub run: Option<&'a Run>,
    /// The tool it is about when there is no run (the run's otherwise).
    pub tool: Option<&'a str>,
    pub target: Option<FactTarget>,
    pub detail: String,
    /// The policy digest the action is about (a reload's new one).
    pub policy: &'a str,
}

/// The fact of `a`.
pub fn fact(a: Action<'_>) -> Fact {
    let mut f = Fact {
        kind: CONTROL_FACT_TYPE.to_owned(),
        ..denial(NewFact {
            run_id: a.run.map(|r| &*r.id),
            tool: a.run.map(|r| &*r.tool).or(a.tool),
            reason: a.reason,
            mode: "control",
            target: a.target,
            resolved: vec![],
            policy: a.policy,
            detail: a.detail,
            run: a.run,
        })
    };
    // The actor, not the run's principal: who did it is what is recorded.
    f.principal = a.principal.map(str::to_owned);
    f
}

/// Records `a`; `Err` (logged) when the store cannot: the caller then
/// refuses what it was about to do, as a denial without its fact is.
pub async fn record(sh: &Shared, a: Action<'_>) -> Result<(), String> {
    let reason = a.reason;
    match sh.facts.record(fact(a)).await {
        Ok(_) => {
            sh.metrics.control_action(reason);
            Ok(())
        }
        Err(e) => {
            sh.metrics.fact_write_failures.inc();
            tracing::error!(error = %e, reason, "control action fact could not be recorded");
            Err(e.to_string())
        }
    }
}

impl Shared {
    /// Counts a refused credential on the control plane; the first of a
    /// window schedules the window's one fact.
    pub fn refused_credential(self: &std::sync::Arc<Self>) {
        if self.refused_credentials.fetch_add(1, Ordering::AcqRel) != 0 {
            return;
        }
        let sh = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(CREDENTIAL_WINDOW).await;
            let n = sh.refused_credentials.swap(0, Ordering::AcqRel);
            let policy = sh.policy.load().digest.clone();
            let mut f = fact(Action {
                reason: "credential_refused",
                principal: None,
                run: None,
                tool: None,
                target: None,
                detail: format!(
                    "{n} control request(s) with an unknown token in {} s",
                    CREDENTIAL_WINDOW.as_secs()
                ),
                policy: &policy,
            });
            f.count = n;
            if let Err(e) = sh.facts.record(f).await {
                tracing::error!(error = %e, refused = n, "the refused-credentials fact could not be recorded");
            } else {
                sh.metrics.control_action("credential_refused");
            }
        });
    }
}
