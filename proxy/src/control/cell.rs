//! `GET /v1/cell`: who this cell is (id, the store's epoch, the policy in
//! force, its advertised URLs) and whether it takes new work, for fleet
//! tooling and kernels choosing a cell.

use crate::state::Shared;
use axum::extract::State;
use axum::Json;
use egress_api::CellView;
use std::sync::Arc;

#[utoipa::path(get, path = "/v1/cell", tag = "cell",
    security(("control_token" = [])),
    responses((status = 200, description = "The cell's identity and readiness (without `[cell]`: no id, the store's epoch and the policy)", body = CellView)))]
pub(super) async fn get_cell(State(sh): State<Arc<Shared>>) -> Json<CellView> {
    let reason = sh.unready();
    let cell = sh.cell.as_ref();
    Json(CellView {
        id: cell.map(|c| c.id.clone()),
        epoch: sh.facts.epoch(),
        policy: sh.policy.load().digest.clone(),
        live_runs: sh.runs.live_runs().len() as u64,
        pool_capacity: None,
        ready: reason.is_none(),
        reason: reason.map(str::to_owned),
        export_lag: sh.exporter.as_ref().map(|_| sh.export_lag()),
        advertise_proxy: cell.and_then(|c| c.advertise_proxy.clone()),
        advertise_control: cell.and_then(|c| c.advertise_control.clone()),
        advertise_executor: cell.and_then(|c| c.advertise_executor.clone()),
    })
}
