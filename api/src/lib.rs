//! The control API's wire types: what kernels and the executor send to the
//! proxy's control listener and get back, and the bearer check both control
//! listeners (the proxy's and the executor's) apply. The proxy's handlers
//! build these types (so the JSON cannot drift from them), the OpenAPI
//! document at `/v1/openapi.json` is generated from them, and the executor's
//! client reads them, so the compiler checks that the two agree. Also what
//! both services share when they start: where the listener hand-off socket
//! is (`handoff`) and the sockets systemd passes them (`activation`).
#![forbid(unsafe_code)]

pub mod activation;
pub mod handoff;
pub mod jsonrpc;
pub mod mcp;
pub mod rules;
pub mod tls;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use utoipa::{IntoParams, ToSchema};

/// The `type` of every denial fact.
pub const FACT_TYPE: &str = "EGRESS_DENIED";
/// The `type` of the fact of a grant (`POST /v1/runs/{id}/grants`).
pub const GRANT_FACT_TYPE: &str = "EGRESS_GRANTED";
/// The `type` of the fact of a fetch held for a grant (`on_unlisted = "ask"`),
/// sent on the fact stream as `event: pending`.
pub const PENDING_FACT_TYPE: &str = "EGRESS_PENDING";
/// The `type` of the fact of a control action: a grant or reload refused,
/// a reload applied, a run ended by another principal, refused credentials
/// (counted), principals changed.
pub const CONTROL_FACT_TYPE: &str = "CONTROL_ACTION";
/// The fact schema version kernels fold.
pub const FACT_SCHEMA: &str = "1.9.0";

/// What the data plane tells a client it denied, for programs and agents:
/// always as the `X-Egress-Denial` header (compact one-line JSON, at most
/// [`DENIAL_HEADER_MAX`] bytes, ASCII with `\u` escapes), and as the whole
/// body, with `status` and `detail` added, when the request accepts
/// `application/json`. The plain-text body stays for people otherwise.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Denial {
    /// The deny reason code (as in facts and `X-Egress-Deny-Reason`).
    pub reason: String,
    /// The target as the proxy understood it (`host:port`), or the raw
    /// request target when it could not be made canonical (bounded); absent
    /// when withheld.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The run's tool; absent for authentication failures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The `id` of the fact that records this denial.
    pub fact_id: String,
    /// The decision step that denied it: `authentication`, `run_state`,
    /// `target`, `ip_literals`, `allowlist`, `methods`, `paths`,
    /// `address_ranges`, `self_loop`, `slots`, `credentials`, `budgets`,
    /// `upgrades` or `protocols`.
    pub rule: String,
    /// A fixed text per reason saying what to do (and what not to).
    pub hint: String,
    /// The HTTP status (JSON body only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The human-readable explanation (JSON body only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The largest `X-Egress-Denial` header value, in bytes.
pub const DENIAL_HEADER_MAX: usize = 2048;

/// Where a fact points.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct FactTarget {
    /// How the target was reached: `connect`, `http`, `transparent` or
    /// `dns` (a fetch), `grant` (a grant), `mcp` (an MCP call: `host` is the
    /// name it called, at most 256 characters, and `port` is 0).
    pub kind: String,
    pub host: String,
    pub port: u16,
}

/// One durable denial fact (`EGRESS_DENIED`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Fact {
    #[serde(rename = "type")]
    pub kind: String,
    pub schema: String,
    /// Global order, assigned by the store.
    pub seq: u64,
    /// UUID, shared by identical denials folded into this fact.
    pub id: String,
    pub at: String,
    pub run_id: Option<String>,
    pub tool: Option<String>,
    pub reason: String,
    /// `enforce` (the fetch was denied) or `report` (allowed, recorded).
    pub mode: String,
    pub target: Option<FactTarget>,
    pub resolved: Vec<String>,
    pub policy: String,
    pub detail: String,
    /// How many identical denials this fact stands for (coalescing).
    pub count: u64,
    /// The cell that recorded it (`[cell] id`; absent without a cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    /// The epoch of the store that holds it: a UUID drawn when the store
    /// file was made. `(cell, epoch, seq)` names a fact fleet-wide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    /// The principal the run is attributed to, or (for a `CONTROL_ACTION`)
    /// the principal that acted; absent for the control token's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// What the run's child executes (path → SHA-256), when the executor said.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub executables: BTreeMap<String, String>,
}

/// `POST /v1/runs`.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    /// A tool of the config.
    pub tool: String,
    /// The kernel's own id for the run (1–128 of `A-Z a-z 0-9 - _ . ~`); a UUID when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = rules::run_id_schema)]
    pub run_id: Option<String>,
    /// Up to 64 labels (e.g. the kernel's id), returned in views and usable as a filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = rules::labels_schema)]
    pub labels: Option<Map<String, Value>>,
    /// `false` creates the run inactive (a warm child's): egress is denied
    /// (`run_not_active`) until `POST /v1/runs/{id}/activate`. Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activate: Option<bool>,
    /// Who creates the run; it must hold a lease (`PUT /v1/owners/{owner}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = rules::owner_schema)]
    pub owner: Option<String>,
    /// `true`: the run's credential is taken only on the listener that will
    /// be handed over for it (inside its sandbox), and refused everywhere
    /// else (`407 credential_elsewhere`) from its creation on, before the
    /// hand-off and after a proxy restart. The executor sets it for every
    /// child whose listener it hands over. A hand-off binds the run in any
    /// case. Default `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<bool>,
    /// What the run's child executes, as the executor hashed it from the
    /// descriptors it then executed: absolute path → lowercase hex SHA-256
    /// (at most 16). Copied into every fact and decision record of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = rules::executables_schema)]
    pub executables: Option<BTreeMap<String, String>>,
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
    #[schema(schema_with = rules::run_state_schema)]
    pub state: String,
    /// RFC 3339.
    pub created_at: String,
    pub expires_at: String,
    #[schema(value_type = Object)]
    pub labels: Map<String, Value>,
    pub owner: Option<String>,
    /// The principal that created the run (or the executor's kernel it was
    /// activated for); absent for the control token's built-in principal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// What the run's child executes (path → SHA-256), when the executor said.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub executables: BTreeMap<String, String>,
    /// The run's credential is taken only on the listener handed over for
    /// it (declared at creation, or bound by the hand-off).
    #[serde(default)]
    pub bound: bool,
    pub slots: Slots,
    /// Idle upstream connections the run keeps for its own plain-HTTP fetches.
    pub upstream_idle: usize,
    pub bytes: Bytes,
    /// Occurrences of each credential's real secret the proxy replaced with
    /// the run's placeholder in responses from the credential's hosts, by
    /// credential name (only credentials with at least one).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub credential_scrubs: std::collections::BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    /// `ended`, `expired`, `shutdown`, `lease_expired` or `owner_released`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<String>,
    /// The cell the run lives on (`[cell] id`; absent without a cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    /// Where the run's cell answers for it (`[cell] advertise_control`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_url: Option<String>,
    /// Live grants of the run (`POST /v1/runs/{id}/grants`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<GrantView>,
    /// What the run spent of its tool's budgets (absent when the tool has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<BudgetsView>,
    /// How each credential of the run's tool stands now (never its value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<CredentialView>,
}

/// How one credential stands: where its value comes from, how old it is,
/// until when it may be used, and how its last refresh went. Never the value.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CredentialView {
    pub name: String,
    /// `env` or `file` (read at start and on reload), or a live source:
    /// `file` with `ttl_ms`, `command`, `oauth2_client_credentials`,
    /// `oauth2_refresh_token`.
    pub source: String,
    /// Whether the proxy refreshes it itself (a live source).
    pub live: bool,
    /// Whether a request needing it gets it now (otherwise
    /// `credential_unavailable`).
    pub available: bool,
    /// When the value in hand was read or minted (RFC 3339; live sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_at: Option<String>,
    /// Its age in milliseconds (live sources with a value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
    /// Until when it may be used (RFC 3339; live sources with a value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// The last read or mint (live sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refresh: Option<RefreshView>,
    /// When the next read or mint is due (RFC 3339; live sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_refresh_at: Option<String>,
}

/// One read of a live credential source.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RefreshView {
    /// RFC 3339.
    pub at: String,
    /// `ok`, `error` or `timeout`.
    pub outcome: String,
    /// What failed (an HTTP status, an exit code; never a value or a body).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /v1/runs/{id}/grants`: allow this run one `name:port` its tool's
/// allowlist does not list, for `uses` fetches (default 1) until `ttl_ms`
/// from now (default: the run's end).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateGrant {
    /// `name:port` (a name, never an address).
    #[schema(max_length = 300)]
    pub target: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub ttl_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub uses: Option<u32>,
}

/// One live grant of a run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct GrantView {
    /// `name:port`, canonical.
    pub target: String,
    pub uses_left: u32,
    /// RFC 3339.
    pub expires_at: String,
    /// The `id` of the grant's fact (in the answer to the grant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fact_id: Option<String>,
}

/// A run's budgets: each `used` against its `limit` (absent: unlimited).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct BudgetsView {
    /// Fetches made (a tunnel, a plain request, each request inside an
    /// intercepted tunnel) and `max_requests_per_run`.
    pub requests: Used,
    /// Bytes both ways the run moved so far (counted as they move) and
    /// `max_bytes_per_run`.
    pub bytes: Used,
    /// `max_request_rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Used {
    pub used: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct RateView {
    pub per_second: u32,
    pub burst: u32,
}

/// `GET /v1/cell` (the proxy's and the executor's): who this cell is and
/// whether it takes new work.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CellView {
    /// `[cell] id` (absent without a cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The fact store's epoch (a UUID drawn when the store file was made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    /// The digest of the policy in force.
    pub policy: String,
    /// Runs not yet ended (the proxy) or invocations in flight (the executor).
    pub live_runs: u64,
    /// Children the executor's pools may hold at once (the executor only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_capacity: Option<u64>,
    /// Whether `/readyz` answers 200.
    pub ready: bool,
    /// Why not, when not (`shutting_down`, `fact_store`, `cell_id_in_use`,
    /// `export_lag`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Denial facts not yet exported (the proxy with `[export]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export_lag: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_proxy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_control: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_executor: Option<String>,
}

/// `201` of `POST /v1/runs`: the view plus the credential, shown only here.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CreatedRun {
    #[serde(flatten)]
    pub run: RunView,
    pub secret: String,
    /// `http://<run_id>:<secret>@<proxy listener>`: the child's proxy URL.
    pub proxy_url: String,
    /// Every variable the child needs for its egress, to pass on unchanged:
    /// the proxy URL variables (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and
    /// their lower-case forms, `NO_PROXY`/`no_proxy` empty,
    /// `NODE_USE_ENV_PROXY`) and, for each credential of the tool, its
    /// `placeholder_env` holding the run's placeholder (never the secret).
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
}

/// The variable holding the run's SOCKS5 URL (`socks5h://run:secret@…`).
/// Not `ALL_PROXY`, which stays the HTTP proxy URL: some HTTP clients
/// (httpx, for one) build a SOCKS transport for `ALL_PROXY` at start and
/// fail without an optional package, even for `http://` and `https://`.
pub const SOCKS_VAR: &str = "LOOM_SOCKS_PROXY";

/// The SOCKS5 form of an `http://` proxy URL (same credential and listener,
/// which speaks both); `None` for a listener with TLS (`https://`), which
/// speaks HTTP only.
pub fn socks_url(proxy_url: &str) -> Option<String> {
    proxy_url
        .strip_prefix("http://")
        .map(|rest| format!("socks5h://{rest}"))
}

/// The variables that point a child at its proxy URL (`CreatedRun::env`
/// without the placeholders): the upper- and lower-case proxy variables,
/// `NO_PROXY` empty so nothing bypasses the proxy, Node's switch that
/// makes its `fetch` honour them, and the SOCKS5 URL ([`SOCKS_VAR`]).
pub fn proxy_env(proxy_url: &str) -> std::collections::BTreeMap<String, String> {
    let mut env = std::collections::BTreeMap::new();
    for k in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        env.insert(k.to_owned(), proxy_url.to_owned());
    }
    env.insert("NO_PROXY".into(), String::new());
    env.insert("no_proxy".into(), String::new());
    if let Some(socks) = socks_url(proxy_url) {
        env.insert(SOCKS_VAR.into(), socks);
    }
    // Node >= 24 honours the proxy variables in fetch/http only with this.
    env.insert("NODE_USE_ENV_PROXY".into(), "1".into());
    env
}

/// The variables that make a child's TLS clients trust the appliance CA,
/// for a tool whose CONNECTs the proxy may intercept: OpenSSL, Python
/// `requests` and curl read `bundle` (the system roots plus the appliance
/// CA); Node adds `ca_cert` (the appliance CA alone) to its own roots.
pub const CA_ENV: [&str; 5] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "AWS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
];

/// [`CA_ENV`] with its values.
pub fn ca_env(bundle: &str, ca_cert: &str) -> std::collections::BTreeMap<String, String> {
    CA_ENV
        .iter()
        .map(|k| {
            let v = if *k == "NODE_EXTRA_CA_CERTS" { ca_cert } else { bundle };
            ((*k).to_owned(), v.to_owned())
        })
        .collect()
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
    #[param(schema_with = rules::run_state_filter_schema)]
    pub state: Option<String>,
    pub owner: Option<String>,
    /// `key=value`: runs whose label `key` is the string `value`.
    #[param(pattern = "=")]
    pub label: Option<String>,
    /// Paging: runs whose id sorts after this one.
    pub after: Option<String>,
    /// Runs per page: default 100; 0 counts as 1, above 1000 as 1000.
    #[param(maximum = 18446744073709551615_usize)]
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
    #[param(maximum = 9223372036854775807_usize)]
    pub after: u64,
    /// Facts per page: default 100; 0 counts as 1, above 1000 as 1000.
    /// The live stream ignores it.
    #[serde(default)]
    #[param(maximum = 18446744073709551615_usize)]
    pub limit: Option<usize>,
    /// `json` (default): the records as the store keeps them; `ocsf`: each
    /// as an OCSF 1.8.0 event (a page is then `{events, next}`).
    #[serde(default)]
    #[param(inline)]
    pub format: RecordFormat,
}

/// How the control API writes records (facts, decision records) in a page
/// or a stream: `?format=json` (default) or `?format=ocsf`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RecordFormat {
    /// The record as the store keeps it.
    #[default]
    Json,
    /// The record as an OCSF 1.8.0 event.
    Ocsf,
}

/// A page of records as OCSF events (`?format=ocsf`), oldest first: the
/// same records and the same `next` as the JSON page of the same query.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OcsfPage {
    #[schema(value_type = Vec<OcsfEvent>)]
    pub events: Vec<Value>,
    /// The cursor for the next call.
    pub next: u64,
}

/// An OCSF 1.8.0 event, as the OpenAPI document describes it: an object
/// with the base attributes every event has, open to the rest (the whole
/// event follows the schema of its class and profiles, which OCSF
/// publishes). A schema only: events are built as JSON values.
pub struct OcsfEvent;

impl utoipa::PartialSchema for OcsfEvent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, Type};
        let open = || Some(AdditionalProperties::FreeForm(true));
        let of = |t: Type, what: &str| ObjectBuilder::new().schema_type(t).description(Some(what));
        let metadata = ObjectBuilder::new()
            .description(Some("What every event of this API names"))
            .property("version", of(Type::String, "The OCSF version: `1.8.0`"))
            .property(
                "uid",
                of(Type::String, "The fact's `id`, or a decision record's derived uid"),
            )
            .property(
                "sequence",
                of(Type::Integer, "The record's `seq` (the cursor)").minimum(Some(0)),
            )
            .property(
                "product",
                of(Type::Object, "`name` `Loom Egress` and `version`, the proxy's"),
            )
            .required("version")
            .required("uid")
            .required("sequence")
            .required("product")
            .additional_properties(open());
        ObjectBuilder::new()
            .description(Some(
                "An OCSF 1.8.0 event: the base attributes are listed, the rest follow the class (`class_uid`) and the profiles (`metadata.profiles`) the event names",
            ))
            .property(
                "class_uid",
                of(Type::Integer, "4001 Network, 4002 HTTP, 4003 DNS or 6003 API Activity"),
            )
            .property("category_uid", of(Type::Integer, "4 Network or 6 Application Activity"))
            .property("type_uid", of(Type::Integer, "`class_uid` × 100 + `activity_id`"))
            .property("activity_id", of(Type::Integer, "The activity of the class"))
            .property("severity_id", of(Type::Integer, "0 Unknown to 6 Fatal"))
            .property("time", of(Type::Integer, "When, in epoch milliseconds"))
            .property("metadata", metadata)
            .required("class_uid")
            .required("category_uid")
            .required("type_uid")
            .required("activity_id")
            .required("severity_id")
            .required("time")
            .required("metadata")
            .additional_properties(open())
            .into()
    }
}

impl ToSchema for OcsfEvent {}

impl Cursor {
    /// The largest cursor the store can hold: `seq` is a signed 64-bit
    /// SQLite integer, so anything above is refused rather than wrapped.
    pub const MAX_AFTER: u64 = i64::MAX as u64;
}

/// A page of facts.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FactsPage {
    pub facts: Vec<Fact>,
    /// The cursor for the next call.
    pub next: u64,
}

/// `PUT /v1/owners/{owner}`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewOwner {
    /// How long the lease lasts from now, in milliseconds (1 000 – 600 000).
    #[serde(deserialize_with = "rules::whole::u64")]
    #[schema(minimum = 1000, maximum = 600000)]
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

/// `200` of `GET /v1/policy`: the policy in force.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PolicyView {
    /// The digest facts carry.
    pub policy: String,
    /// Tool ids of the config: the tools runs can be created for.
    pub tools: Vec<String>,
}

/// `200` of `GET /v1/ca`: the appliance CA that signs the leaves of
/// intercepted CONNECTs.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CaView {
    /// `sha256:` and the hex digest of the certificate (DER).
    pub fingerprint: String,
    /// The certificate, PEM.
    pub pem: String,
    /// The files the proxy's `env` points children at: the CA alone, and the
    /// system roots plus the CA.
    pub cert_file: String,
    pub bundle_file: String,
    /// Whether the CA lives only as long as the proxy process.
    pub ephemeral: bool,
}

/// One event of a Server-Sent Events stream of the control API, as a
/// client parses it (the OpenAPI document's schema of each event).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SseEvent {
    /// The record's `seq` (the cursor to resume after).
    pub id: String,
    /// `fact`, `pending` or `decision`.
    pub event: String,
    /// The record, JSON.
    pub data: String,
}

/// `POST /v1/tools/{tool}/executable_mismatch`: what the executor refused
/// to start, recorded as a `CONTROL_ACTION` fact before it answers.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutableMismatch {
    /// Which file, its pinned digest and the one found (at most 512 bytes kept).
    #[schema(max_length = 4096)]
    pub detail: String,
}

/// `200` of `POST /v1/policy/reload`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Reloaded {
    /// The digest of the policy now in force.
    pub policy: String,
    pub tools: Vec<String>,
    /// The digest of the policy it replaced.
    #[serde(default)]
    pub previous: String,
    /// Whether some change widens reach.
    #[serde(default)]
    pub widens: bool,
    /// The change in reach from the previous policy, widenings first.
    #[serde(default)]
    pub changes: Vec<PolicyChange>,
}

/// One change in reach between two policies (`policy diff`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PolicyChange {
    /// `widens` or `narrows`.
    pub direction: String,
    /// `host_added`, `wildcard_widened`, `mode_report`, `tool_added`, ...
    pub kind: String,
    /// The tool (`null`: the whole policy, `[proxy]` ranges).
    pub tool: Option<String>,
    pub target: String,
    pub detail: String,
    /// With a replay: recorded fetches that were denied and now go out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub becomes_allowed: Option<Vec<Value>>,
    /// With a replay: recorded fetches that went out and are now denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub becomes_denied: Option<Vec<Value>>,
}

/// `200` of `POST /v1/policy/diff`, and the `details` of `422
/// beyond_envelope`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PolicyDiff {
    /// The digests of the two policies.
    pub old: String,
    pub new: String,
    pub widens: bool,
    pub changes: Vec<PolicyChange>,
    /// With a replay: its counts and what no change accounts for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub replay: Option<Value>,
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
    /// The cell that answered (`[cell] id`; absent without a cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    /// Where that cell answers (`[cell] advertise_control`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_url: Option<String>,
    /// `beyond_envelope`: how the refused policy reaches beyond the envelope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<PolicyDiff>,
}

/// Every error answer of the control API.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    /// An error answer with `code` and `message`.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code: code.into(),
                message: message.into(),
                problems: None,
                cell: None,
                control_url: None,
                diff: None,
            },
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header, if any. The
/// scheme is case-insensitive (RFC 9110 §11.1); surrounding spaces are
/// ignored.
pub fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = v.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// Whether `headers` carry `expected` as their bearer token, compared in
/// constant time.
pub fn bearer_matches(headers: &http::HeaderMap, expected: &str) -> bool {
    use subtle::ConstantTimeEq;
    bearer(headers).is_some_and(|t| bool::from(t.as_bytes().ct_eq(expected.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, http::HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for (value, token) in [
            ("Bearer abc", Some("abc")),
            ("bearer abc", Some("abc")),
            ("BEARER  abc ", Some("abc")),
            ("Basic abc", None),
            ("Bearer", None),
            ("abc", None),
        ] {
            assert_eq!(bearer(&headers(value)), token, "{value:?}");
        }
        assert_eq!(bearer(&http::HeaderMap::new()), None);
    }

    #[test]
    fn bearer_matches_only_the_exact_token() {
        assert!(bearer_matches(&headers("bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(&headers("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(&headers("Bearer s3cret2"), "s3cret"));
        assert!(!bearer_matches(&headers("Basic s3cret"), "s3cret"));
    }

    #[test]
    fn create_run_round_trips_and_omits_absent_fields() {
        let c = CreateRun {
            tool: "t".into(),
            activate: Some(false),
            ..Default::default()
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v, serde_json::json!({"tool": "t", "activate": false}));
        let back: CreateRun = serde_json::from_value(v).unwrap();
        assert_eq!(back.activate, Some(false));
    }
}
