//! The policy in force (`GET /v1/policy`) and its reload without restart
//! (`SIGHUP`, `POST /v1/policy/reload`): the
//! config file is read and validated again; on success the new policy (tools
//! and ranges) is swapped in atomically for new fetches; on error the old one
//! keeps running and every problem is reported. Credentials' secrets are
//! read again too, so a rotated secret is used from the next fetch on.
//! Listener addresses, the facts path and other `[proxy]` settings need a
//! restart.

use crate::control::caller::Caller;
use crate::control::error::{invalid_config, ApiError, AppJson};
use crate::control::{actions, envelope};
use crate::learn::diff::Report;
use crate::state::Shared;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use egress_api::{ErrorBody, PolicyDiff, PolicyView, Reloaded};
use egress_config::principals::{Action, Principals};
use egress_config::{Config, ConfigError};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("running on the embedded default configuration: there is no file to reload")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("appliance CA: {0}")]
    Ca(#[from] crate::ca::CaError),
    #[error("the new policy reaches beyond [proxy] envelope:\n{}", .0.text())]
    BeyondEnvelope(Box<Report>),
}

impl ReloadError {
    /// The metric label and fact reason of a refused reload.
    fn outcome(&self) -> &'static str {
        match self {
            ReloadError::BeyondEnvelope(_) => "beyond_envelope",
            _ => "error",
        }
    }
}

/// A reload applied: the new policy and its change in reach from the old.
pub struct Applied {
    pub policy: Arc<egress_config::Policy>,
    pub report: Report,
    /// How the principals changed (`None`: they did not).
    pub principals: Option<String>,
}

/// Re-reads the config file (and the principals file and the envelope)
/// and swaps the policy in; `by` names the principal that asked (`None`:
/// the control token's, or `SIGHUP`). The outcome is a `CONTROL_ACTION`
/// fact, with the digests before and after, and a log line with the diff.
pub async fn reload(sh: &Shared, by: Option<&str>) -> Result<Applied, ReloadError> {
    let before = sh.policy.load_full();
    let r = match load(sh) {
        Ok(cfg) => {
            // New live credentials read their first values before the policy goes into force.
            sh.prime_credentials(&cfg.policy).await;
            try_reload(sh, cfg)
        }
        Err(e) => Err(e),
    };
    let outcome = match &r {
        Ok(_) => "ok",
        Err(e) => e.outcome(),
    };
    sh.metrics
        .reloads
        .get_or_create(&crate::metrics::OutcomeLabel { outcome })
        .inc();
    let action = match &r {
        Ok(a) => actions::Action {
            reason: "reload_applied",
            principal: by,
            run: None,
            tool: None,
            target: None,
            detail: format!(
                "policy {} replaced {}: {} change(s), widens: {}",
                a.policy.digest,
                before.digest,
                a.report.changes.len(),
                a.report.widens
            ),
            policy: &a.policy.digest,
        },
        Err(e) => actions::Action {
            reason: if matches!(e, ReloadError::BeyondEnvelope(_)) {
                "beyond_envelope"
            } else {
                "reload_refused"
            },
            principal: by,
            run: None,
            tool: None,
            target: None,
            detail: format!("reload refused; policy {} stays in force: {e}", before.digest),
            policy: &before.digest,
        },
    };
    // The policy is already swapped: a fact the store refuses is logged,
    // not a reason to undo a reload the operator asked for.
    let _ = actions::record(sh, action).await;
    if let Ok(Applied {
        principals: Some(changes),
        policy,
        ..
    }) = &r
    {
        let _ = actions::record(
            sh,
            actions::Action {
                reason: "principals_changed",
                principal: by,
                run: None,
                tool: None,
                target: None,
                detail: format!("principals reloaded: {changes}"),
                policy: &policy.digest,
            },
        )
        .await;
    }
    r
}

/// The config file read again, its static secrets loaded.
fn load(sh: &Shared) -> Result<Config, ReloadError> {
    let path = sh.config_path.as_ref().ok_or(ReloadError::NoFile)?;
    let mut cfg = Config::load(path)?;
    cfg.load_secrets()?;
    Ok(cfg)
}

fn try_reload(sh: &Shared, mut cfg: Config) -> Result<Applied, ReloadError> {
    sh.adopt_credentials(&mut cfg.policy);
    if cfg.proxy.listen != sh.cfg.listen || cfg.proxy.control != sh.cfg.control || cfg.proxy.facts != sh.cfg.facts {
        tracing::warn!("listener or facts changes in the [proxy] section need a restart; applying the policy only");
    }
    let principals = match &cfg.control.principals_file {
        Some(p) => egress_config::principals::Principals::load(p, &sh.control_token)?,
        None => egress_config::principals::Principals::single(&sh.control_token),
    };
    let envelope = match &cfg.proxy.envelope {
        Some(p) => Some(envelope::load(p)?),
        None => None,
    };
    if let Some(e) = &envelope {
        envelope::check(e, &cfg.policy).map_err(|r| ReloadError::BeyondEnvelope(Box::new(r)))?;
    }
    // The CA on disk again: a rotation takes effect here. An ephemeral one stays.
    let ca = if sh.ca.load().is_ephemeral() {
        None
    } else {
        Some(crate::ca::Authority::open(&sh.cfg)?)
    };
    let old = sh.policy.swap(cfg.policy.clone());
    // A refresh that landed since the adoption above, and the refreshers
    // of credentials the new policy no longer has.
    crate::creds::Env::apply(sh);
    sh.creds.retain(Some(sh), &cfg.policy);
    sh.envelope.store(envelope);
    let changed_principals = principals_changed(&sh.principals.load(), &principals);
    sh.principals.store(Arc::new(principals));
    if let Some(c) = &changed_principals {
        tracing::info!(file = ?cfg.control.principals_file, changes = %c, "principals reloaded");
    }
    if let Some(ca) = ca {
        if ca.fingerprint != sh.ca.load().fingerprint {
            tracing::info!(fingerprint = %ca.fingerprint, "appliance CA replaced");
        }
        sh.ca.store(Arc::new(ca));
    }
    sh.metrics.set_config(Some(&old.digest), &cfg.policy.digest);
    sh.publish_cell_info();
    sh.refresh_host_addrs();
    sh.on_policy(&cfg.policy);
    let report = crate::learn::diff::report(&old, &cfg.policy, None);
    let changes: Vec<String> = report
        .changes
        .iter()
        .map(|j| egress_config::diff::line(&j.change))
        .collect();
    tracing::info!(old = %old.digest, new = %cfg.policy.digest, tools = cfg.policy.tools.len(), widens = report.widens, changes = ?changes, "policy reloaded");
    Ok(Applied {
        policy: cfg.policy,
        report,
        principals: changed_principals,
    })
}

/// How the principals changed from `old` to `new`, by name (added,
/// removed, scopes or tokens changed); `None` when they did not.
fn principals_changed(old: &Principals, new: &Principals) -> Option<String> {
    let mut out = vec![];
    for p in new.iter() {
        match old.by_name(&p.name) {
            None => out.push(format!("added {}", p.name)),
            Some(o) if o != p => out.push(format!("changed {}", p.name)),
            Some(_) => {}
        }
    }
    for p in old.iter().filter(|p| new.by_name(&p.name).is_none()) {
        out.push(format!("removed {}", p.name));
    }
    // Tokens are not part of a principal's equality.
    if out.is_empty() && !old.same_tokens(new) {
        out.push("tokens changed".to_owned());
    }
    (!out.is_empty()).then(|| out.join(", "))
}

/// `POST /v1/policy/reload` (scope `policy:reload`).
#[utoipa::path(post, path = "/v1/policy/reload", tag = "policy", security(("control_token" = [])),
    responses(
        (status = 200, description = "The new policy is in force; the answer carries its change in reach from the old one", body = Reloaded),
        (status = 403, description = "scope: the caller has no policy:reload scope", body = ErrorBody),
        (status = 409, description = "no_config_file: running on the embedded default", body = ErrorBody),
        (status = 422, description = "invalid_config, with every problem; invalid_ca (the appliance CA cannot be loaded); beyond_envelope, with the diff against [proxy] envelope. The old policy stays", body = ErrorBody),
    ))]
pub async fn reload_handler(State(sh): State<Arc<Shared>>, caller: Caller) -> Result<Json<Reloaded>, ApiError> {
    let by = caller.recorded();
    if let Err(refused) = caller.may(Action::PolicyReload) {
        let policy = sh.policy.load();
        actions::record(
            &sh,
            actions::Action {
                reason: "reload_refused",
                principal: by.as_deref(),
                run: None,
                tool: None,
                target: None,
                detail: format!("reload refused: {}", refused.message()),
                policy: &policy.digest,
            },
        )
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e))?;
        return Err(refused);
    }
    match reload(&sh, by.as_deref()).await {
        Ok(a) => {
            let view = a.report.view();
            Ok(Json(Reloaded {
                policy: a.policy.digest.clone(),
                tools: a.policy.tools.keys().cloned().collect(),
                previous: view.old,
                widens: view.widens,
                changes: view.changes,
            }))
        }
        Err(ReloadError::NoFile) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_config_file",
            ReloadError::NoFile.to_string(),
        )),
        Err(e @ ReloadError::Ca(_)) => {
            tracing::error!(error = %e, "policy reload rejected; the old policy stays in force");
            Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_ca",
                e.to_string(),
            ))
        }
        Err(ReloadError::BeyondEnvelope(r)) => {
            tracing::error!(diff = %r.text(), "policy reload rejected: beyond [proxy] envelope; the old policy stays in force");
            Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "beyond_envelope",
                "the new policy reaches beyond [proxy] envelope (details in diff); the old policy stays in force",
            )
            .with_diff(r.view()))
        }
        Err(ReloadError::Config(e)) => {
            tracing::error!(error = %e, "policy reload rejected; the old policy stays in force");
            Err(invalid_config(&e))
        }
    }
}

/// `GET /v1/policy`: the digest and the tools of the policy in force.
#[utoipa::path(get, path = "/v1/policy", tag = "policy", security(("control_token" = [])),
    responses(
        (status = 200, description = "The policy in force", body = PolicyView),
        (status = 403, description = "scope: the caller has no policy:read scope", body = ErrorBody),
    ))]
pub(super) async fn get_policy(State(sh): State<Arc<Shared>>, caller: Caller) -> Result<Json<PolicyView>, ApiError> {
    caller.may(Action::PolicyRead)?;
    let p = sh.policy.load();
    Ok(Json(PolicyView {
        policy: p.digest.clone(),
        tools: p.tools.keys().cloned().collect(),
    }))
}

/// `POST /v1/policy/diff`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffRequest {
    /// A configuration file's text (TOML): the policy compared with the
    /// one in force.
    pub config: String,
    /// Join recorded traffic in: which recorded decisions and denials the
    /// new policy would change (as `POST /v1/policy/replay`). Needs
    /// `facts:all` and `decisions:all`. Default `false`.
    #[serde(default)]
    pub replay: bool,
}

/// The exact change in reach from the policy in force to a candidate's,
/// computed from the compiled policies (see `egress-proxy policy diff`).
#[utoipa::path(post, path = "/v1/policy/diff", tag = "policy", security(("control_token" = [])),
    request_body = DiffRequest,
    responses(
        (status = 200, description = "Every change in reach, widenings first (`widens`: some change lets more through)", body = PolicyDiff),
        (status = 403, description = "scope: the caller has no policy:read scope (or, with replay, no facts:all and decisions:all)", body = ErrorBody),
        (status = 422, description = "invalid_config, with every problem", body = ErrorBody),
        (status = 503, description = "records_unavailable (with replay)", body = ErrorBody),
    ))]
pub(super) async fn diff(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    AppJson(req): AppJson<DiffRequest>,
) -> Result<Json<PolicyDiff>, ApiError> {
    caller.may(Action::PolicyRead)?;
    if req.replay {
        caller.may(Action::Learn)?;
    }
    let cfg = Config::parse(&req.config, "candidate.toml").map_err(|e| invalid_config(&e))?;
    let old = sh.policy.load_full();
    let replayed = if req.replay {
        let all = crate::learn::history::Window {
            tool: None,
            since: None,
        };
        Some(crate::control::learn::replayed(&sh, &cfg.policy, &all).await?)
    } else {
        None
    };
    Ok(Json(crate::learn::diff::report(&old, &cfg.policy, replayed).view()))
}
