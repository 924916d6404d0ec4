//! `GET /v1/ca`: the appliance CA, for kernels and executors that build
//! their own trust bundle (or pin its fingerprint).

use crate::state::Shared;
use axum::extract::State;
use axum::Json;
use egress_api::CaView;
use std::sync::Arc;

#[utoipa::path(get, path = "/v1/ca", tag = "policy", security(("control_token" = [])),
    responses((status = 200, description = "The appliance CA in force", body = CaView)))]
pub(super) async fn get_ca(State(sh): State<Arc<Shared>>) -> Json<CaView> {
    let ca = sh.ca.load();
    Json(CaView {
        fingerprint: ca.fingerprint.clone(),
        pem: ca.pem.clone(),
        cert_file: ca.files.cert.display().to_string(),
        bundle_file: ca.files.bundle.display().to_string(),
        ephemeral: ca.is_ephemeral(),
    })
}
