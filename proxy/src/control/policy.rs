//! The policy in force (`GET /v1/policy`) and its reload without restart
//! (`SIGHUP`, `POST /v1/policy/reload`): the
//! config file is read and validated again; on success the new policy (tools
//! and ranges) is swapped in atomically for new fetches; on error the old one
//! keeps running and every problem is reported. Credentials' secrets are
//! read again too, so a rotated secret is used from the next fetch on.
//! Listener addresses, the facts path and other `[proxy]` settings need a
//! restart.

use crate::control::error::ApiError;
use crate::state::Shared;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use egress_api::{ErrorBody, PolicyView, Problem, Reloaded};
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
}

/// Re-reads the config file and swaps the policy in. Returns the new digest.
pub fn reload(sh: &Shared) -> Result<Arc<egress_config::Policy>, ReloadError> {
    let r = try_reload(sh);
    let outcome = if r.is_ok() { "ok" } else { "error" };
    sh.metrics
        .reloads
        .get_or_create(&crate::metrics::OutcomeLabel { outcome })
        .inc();
    r
}

fn try_reload(sh: &Shared) -> Result<Arc<egress_config::Policy>, ReloadError> {
    let path = sh.config_path.as_ref().ok_or(ReloadError::NoFile)?;
    let mut cfg = Config::load(path)?;
    cfg.load_secrets()?;
    if cfg.proxy.listen != sh.cfg.listen || cfg.proxy.control != sh.cfg.control || cfg.proxy.facts != sh.cfg.facts {
        tracing::warn!("listener or facts changes in the [proxy] section need a restart; applying the policy only");
    }
    // The CA on disk again: a rotation takes effect here. An ephemeral one stays.
    let ca = if sh.ca.load().is_ephemeral() {
        None
    } else {
        Some(crate::ca::Authority::open(&sh.cfg)?)
    };
    let old = sh.policy.swap(cfg.policy.clone());
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
    tracing::info!(old = %old.digest, new = %cfg.policy.digest, tools = cfg.policy.tools.len(), "policy reloaded");
    Ok(cfg.policy)
}

/// `POST /v1/policy/reload`.
#[utoipa::path(post, path = "/v1/policy/reload", tag = "policy", security(("control_token" = [])),
    responses(
        (status = 200, description = "The new policy is in force", body = Reloaded),
        (status = 409, description = "no_config_file: running on the embedded default", body = ErrorBody),
        (status = 422, description = "invalid_config, with every problem, or invalid_ca (the appliance CA cannot be loaded); the old policy stays", body = ErrorBody),
    ))]
pub async fn reload_handler(State(sh): State<Arc<Shared>>) -> Result<Json<Reloaded>, ApiError> {
    match reload(&sh) {
        Ok(p) => Ok(Json(Reloaded {
            policy: p.digest.clone(),
            tools: p.tools.keys().cloned().collect(),
        })),
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
        Err(ReloadError::Config(e)) => {
            tracing::error!(error = %e, "policy reload rejected; the old policy stays in force");
            Err(invalid_config(&e))
        }
    }
}

/// `422 invalid_config` with every problem of `e`.
pub(crate) fn invalid_config(e: &ConfigError) -> ApiError {
    let problems = e
        .problems
        .iter()
        .map(|p| Problem {
            path: p.path.clone(),
            message: p.message.clone(),
        })
        .collect();
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_config", format!("{e}")).with_problems(problems)
}

/// `GET /v1/policy`: the digest and the tools of the policy in force.
#[utoipa::path(get, path = "/v1/policy", tag = "policy", security(("control_token" = [])),
    responses((status = 200, description = "The policy in force", body = PolicyView)))]
pub(super) async fn get_policy(State(sh): State<Arc<Shared>>) -> Json<PolicyView> {
    let p = sh.policy.load();
    Json(PolicyView {
        policy: p.digest.clone(),
        tools: p.tools.keys().cloned().collect(),
    })
}
