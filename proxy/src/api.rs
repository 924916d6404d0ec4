//! The control API's wire types: what kernels and the executor send and get
//! back. Handlers build these (so the JSON cannot drift from the types), and
//! the OpenAPI document at `/v1/openapi.json` is generated from them.

use crate::facts::Fact;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};

/// `POST /v1/runs`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    /// A tool of the config.
    pub tool: String,
    /// The kernel's own id for the run (1–128 of `A-Z a-z 0-9 - _ . ~`); a UUID when absent.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Up to 64 labels (e.g. the kernel's id), returned in views and usable as a filter.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub labels: Option<Map<String, Value>>,
    /// `false` creates the run inactive (a warm child's): egress is denied
    /// (`run_not_active`) until `POST /v1/runs/{id}/activate`. Default `true`.
    #[serde(default)]
    pub activate: Option<bool>,
    /// Who creates the run; it must hold a lease (`PUT /v1/owners/{owner}`).
    #[serde(default)]
    pub owner: Option<String>,
}

/// A run's concurrency slots.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Slots {
    pub max: usize,
    pub in_use: usize,
}

/// Bytes relayed by a run's finished fetches.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Bytes {
    pub up: u64,
    pub down: u64,
}

/// What the proxy knows of a run.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunView {
    pub run_id: String,
    pub tool: String,
    /// `created`, `active` or `ended`.
    pub state: String,
    /// RFC 3339.
    pub created_at: String,
    pub expires_at: String,
    #[schema(value_type = Object)]
    pub labels: Map<String, Value>,
    pub owner: Option<String>,
    pub slots: Slots,
    /// Idle upstream connections the run keeps for its own plain-HTTP fetches.
    pub upstream_idle: usize,
    pub bytes: Bytes,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    /// `ended`, `expired`, `shutdown`, `lease_expired` or `owner_released`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<String>,
}

/// `201` of `POST /v1/runs`: the view plus the credential, shown only here.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CreatedRun {
    #[serde(flatten)]
    pub run: RunView,
    pub secret: String,
    /// `http://<run_id>:<secret>@<proxy listener>`: the child's proxy URL.
    pub proxy_url: String,
}

/// Denials of an ended run, by reason (counts include folded facts).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DenialSummary {
    pub total: u64,
    #[schema(value_type = Object)]
    pub by_reason: Map<String, Value>,
}

/// `200` of `DELETE /v1/runs/{id}`: the final view and what the run was denied.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EndedRun {
    #[serde(flatten)]
    pub run: RunView,
    /// Up to 1000 facts of the run, oldest first.
    pub facts: Vec<Fact>,
    /// More facts exist (`GET /v1/runs/{id}/facts`).
    pub facts_truncated: bool,
    pub denials: DenialSummary,
}

/// Filters of `GET /v1/runs`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RunFilter {
    pub tool: Option<String>,
    /// `created`, `active` or `ended`.
    pub state: Option<String>,
    pub owner: Option<String>,
    /// `key=value`: runs whose label `key` is the string `value`.
    pub label: Option<String>,
    /// Paging: runs whose id sorts after this one.
    pub after: Option<String>,
    /// 1–1000, default 100.
    pub limit: Option<usize>,
}

/// `200` of `GET /v1/runs`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<RunView>,
    /// The `after` of the next page; `null` on the last one.
    pub next: Option<String>,
}

/// A fact cursor.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct Cursor {
    /// Facts with `seq` greater than this (0 ..= 2^63−1).
    #[serde(default)]
    pub after: u64,
    /// 1–1000, default 100.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// A page of facts.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FactsPage {
    pub facts: Vec<Fact>,
    /// The cursor for the next call.
    pub next: u64,
}

/// `PUT /v1/owners/{owner}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewOwner {
    /// 1 000 – 600 000.
    pub lease_ms: u64,
}

/// An owner and its lease.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OwnerView {
    pub owner: String,
    pub lease_ms: u64,
    pub expires_at: String,
    pub live_runs: usize,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OwnerList {
    pub owners: Vec<OwnerView>,
}

/// `200` of `DELETE /v1/owners/{owner}`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OwnerReleased {
    pub owner: String,
    /// Live runs of the owner that were ended.
    pub ended: usize,
}

/// `200` of `POST /v1/policy/reload`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Reloaded {
    /// The digest of the policy now in force.
    pub policy: String,
    pub tools: Vec<String>,
}

/// One problem of a rejected config.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable: `run_not_found`, `unknown_tool`, …
    pub code: String,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problems: Option<Vec<Problem>>,
}

/// Every error answer of the control API.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}
