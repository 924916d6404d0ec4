//! Owner routes: an owner (a kernel or an executor) holds a lease it renews
//! as a heartbeat; when the lease expires or is released, its live runs end.

use crate::control::caller::Caller;
use crate::control::error::{bad_request, ApiError, ApiResult, AppJson};
use crate::runs::owners::{Lease, OwnerError};
use crate::runs::valid_run_id;
use crate::runs::EndReason;
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use egress_api::{ErrorBody, OwnerList, OwnerReleased, OwnerView, RenewOwner};
use egress_config::principals::Action;
use std::sync::Arc;

/// `Ok` when `owner` has no live lease, one restored after a restart (held
/// by nobody until renewed), or one the caller holds (or the caller is admin).
fn held_by_caller(sh: &Shared, caller: &Caller, owner: &str) -> ApiResult<()> {
    match sh.owners.lease(owner).and_then(|l| l.holder) {
        Some(holder) => caller.may(Action::Lease {
            holder: holder.as_deref(),
        }),
        None => Ok(()),
    }
}

fn owner_view(owner: &str, lease: &Lease, live_runs: usize) -> OwnerView {
    OwnerView {
        owner: owner.to_owned(),
        lease_ms: lease.lease.as_millis() as u64,
        expires_at: crate::time::rfc3339(lease.expires_at),
        live_runs,
    }
}

/// `PUT /v1/owners/{owner}` `{lease_ms}`: creates or renews a lease (the heartbeat).
#[utoipa::path(put, path = "/v1/owners/{owner}", tag = "owners", security(("control_token" = [])),
    params(("owner" = String, Path, description = "Owner name (1–128 of A-Z a-z 0-9 - _ . ~)",
        pattern = "^[A-Za-z0-9._~-]+$", min_length = 1, max_length = 128)),
    request_body = RenewOwner,
    responses(
        (status = 200, description = "Leased until expires_at", body = OwnerView),
        (status = 400, description = "bad_request, bad_lease", body = ErrorBody),
        (status = 403, description = "not_your_lease: another principal holds the owner's lease (admin may renew it)", body = ErrorBody),
        (status = 429, description = "bad_lease: too many owners", body = ErrorBody),
    ))]
pub(super) async fn renew_owner(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(owner): Path<String>,
    AppJson(req): AppJson<RenewOwner>,
) -> ApiResult<Json<OwnerView>> {
    caller.may(Action::Owners)?;
    if !valid_run_id(&owner) {
        return Err(bad_request("owner must be 1-128 characters of A-Z a-z 0-9 - _ . ~"));
    }
    held_by_caller(&sh, &caller, &owner)?;
    let lease = sh
        .owners
        .renew(
            &owner,
            std::time::Duration::from_millis(req.lease_ms),
            Some(caller.recorded()),
        )
        .map_err(|e| {
            let status = match e {
                OwnerError::BadLease => StatusCode::BAD_REQUEST,
                OwnerError::TooMany => StatusCode::TOO_MANY_REQUESTS,
            };
            ApiError::new(status, "bad_lease", e.to_string())
        })?;
    Ok(Json(owner_view(&owner, &lease, sh.runs.live_runs_of(&owner).len())))
}

/// `DELETE /v1/owners/{owner}`: ends every live run of the owner and forgets it.
#[utoipa::path(delete, path = "/v1/owners/{owner}", tag = "owners", security(("control_token" = [])),
    params(("owner" = String, Path, description = "Owner name")),
    responses(
        (status = 200, description = "Its live runs ended (owner_released)", body = OwnerReleased),
        (status = 403, description = "not_your_lease: another principal holds the lease; not_your_run: the owner has live runs of another principal (admin may end them)", body = ErrorBody),
    ))]
pub(super) async fn release_owner(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(owner): Path<String>,
) -> ApiResult<Json<OwnerReleased>> {
    caller.may(Action::Owners)?;
    held_by_caller(&sh, &caller, &owner)?;
    let runs = sh.runs.live_runs_of(&owner);
    let me = caller.recorded();
    // Every run it would end must be one the caller may end.
    for other in runs.iter().filter(|r| r.creator.as_deref() != me.as_deref()) {
        let principal = other.principal();
        caller.may(Action::EndRun {
            tool: &other.tool,
            owner: principal.as_deref().map(String::as_str),
        })?;
    }
    let known = sh.owners.release(&owner);
    let ended = runs.len();
    for run in runs {
        sh.end_run(&run, EndReason::OwnerReleased);
    }
    if ended > 0 || known {
        tracing::info!(owner = %owner, runs = ended, "owner released; its runs ended");
    }
    Ok(Json(OwnerReleased { owner, ended }))
}

#[utoipa::path(get, path = "/v1/owners", tag = "owners", security(("control_token" = [])),
    responses((status = 200, description = "Owners and their leases", body = OwnerList)))]
pub(super) async fn list_owners(State(sh): State<Arc<Shared>>, caller: Caller) -> ApiResult<Json<OwnerList>> {
    caller.may(Action::Owners)?;
    let owners = sh
        .owners
        .list()
        .iter()
        .map(|(o, l)| owner_view(o, l, sh.runs.live_runs_of(o).len()))
        .collect();
    Ok(Json(OwnerList { owners }))
}
