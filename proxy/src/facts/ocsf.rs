//! Facts and decision records as OCSF 1.8.0 events: pure (no I/O, no
//! clock), total (every input gives an event, none panics). A fetch's fact
//! or record is a Network (4001), HTTP (4002) or DNS (4003) Activity by its
//! entrance; a grant, a control action and an MCP call are API Activity
//! (6003). The `security_control` profile carries what the proxy did
//! (action, disposition, the rule, the policy), `network_proxy` the proxy
//! itself; whatever OCSF has no place for, and the record's own words, are
//! under `unmapped.loom`. docs/audit.md ("OCSF mapping") is the mapping table and
//! says why each choice; `tests/ocsf/validate.py` checks events against the
//! schema.

use crate::deny::DenyReason;
use crate::facts::decisions::Decision;
use egress_api::Fact;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::net::IpAddr;

/// The OCSF schema version every event names (`metadata.version`).
pub const OCSF_VERSION: &str = "1.8.0";

/// `metadata.product.name` and `vendor_name`, and the proxy's endpoint name.
pub const PRODUCT: &str = "Loom Egress";

/// The name of the policy object (its `uid` is the digest).
const POLICY_NAME: &str = "Loom Egress policy";

/// The control API, as `api.service.name` of grants and control actions.
const CONTROL_API: &str = "Loom Egress control API";

/// What stands where OCSF requires a name Loom does not record.
const UNKNOWN: &str = "unknown";

/// The longest value `shorthand` quotes, in characters.
const SHORT_MAX: usize = 256;

/// An OCSF class: uid, name, category uid and name.
#[derive(Clone, Copy)]
struct Class {
    uid: u64,
    name: &'static str,
    category: u64,
    category_name: &'static str,
}

const NETWORK: Class = Class {
    uid: 4001,
    name: "Network Activity",
    category: 4,
    category_name: "Network Activity",
};
const HTTP: Class = Class {
    uid: 4002,
    name: "HTTP Activity",
    category: 4,
    category_name: "Network Activity",
};
const DNS: Class = Class {
    uid: 4003,
    name: "DNS Activity",
    category: 4,
    category_name: "Network Activity",
};
const EVENT_LOG: Class = Class {
    uid: 1008,
    name: "Event Log Activity",
    category: 1,
    category_name: "System Activity",
};
const API: Class = Class {
    uid: 6003,
    name: "API Activity",
    category: 6,
    category_name: "Application Activity",
};

/// An enum attribute's id with its caption (`activity_id`/`activity_name`,
/// `action_id`/`action`, ...).
type Id = (u64, &'static str);

// Network Activity.
const OPEN: Id = (1, "Open");
const CLOSE: Id = (2, "Close");
// DNS Activity.
const QUERY: Id = (1, "Query");
// API Activity.
const CREATE: Id = (1, "Create");
const READ: Id = (2, "Read");
const UPDATE: Id = (3, "Update");
const DELETE: Id = (4, "Delete");
// Any class.
const ACTIVITY_UNKNOWN: Id = (0, "Unknown");
const ACTIVITY_OTHER: Id = (99, "Other");

const OBSERVED: Id = (3, "Observed");
const LOGGED: Id = (17, "Logged");

// `action_id`.
const ACTION_UNKNOWN: Id = (0, "Unknown");
const ALLOWED_ACTION: Id = (1, "Allowed");
const DENIED: Id = (2, "Denied");
// `disposition_id`.
const DISPOSITION_UNKNOWN: Id = (0, "Unknown");
const ALLOWED: Id = (1, "Allowed");
const BLOCKED: Id = (2, "Blocked");
const DELAYED: Id = (14, "Delayed");
const UNAUTHORIZED: Id = (26, "Unauthorized");
// `severity_id`.
const SEVERITY_UNKNOWN: Id = (0, "Unknown");
const INFORMATIONAL: Id = (1, "Informational");
const LOW: Id = (2, "Low");
const MEDIUM: Id = (3, "Medium");
// `status_id`.
const STATUS_UNKNOWN: Id = (0, "Unknown");
const SUCCESS: Id = (1, "Success");
const FAILURE: Id = (2, "Failure");

/// What the proxy did, in the `security_control` profile's words, and how
/// the activity ended and weighs.
#[derive(Clone, Copy)]
struct Outcome {
    action: Id,
    disposition: Id,
    status: Id,
    severity: Id,
}

impl Outcome {
    const fn new(action: Id, disposition: Id, status: Id, severity: Id) -> Outcome {
        Outcome {
            action,
            disposition,
            status,
            severity,
        }
    }
}

/// The OCSF event of a fact (`EGRESS_DENIED`, `EGRESS_GRANTED`,
/// `EGRESS_PENDING`, `CONTROL_ACTION`; another type maps by its target with
/// an unknown outcome). `product_version` is the proxy's version.
pub fn fact_event(f: &Fact, product_version: &str) -> Value {
    let kind = f.target.as_ref().map(|t| t.kind.as_str());
    let mut e = match (f.kind.as_str(), kind) {
        (egress_api::CONTROL_FACT_TYPE, _) => control_event(f),
        (egress_api::GRANT_FACT_TYPE, _) => grant_event(f),
        (_, Some("mcp")) => mcp_fact_event(f),
        (_, Some("dns")) => dns_fact_event(f),
        (_, Some("http")) => http_fact_event(f),
        _ => network_fact_event(f),
    };
    e.metadata(
        nonempty(&f.id).unwrap_or(UNKNOWN).to_owned(),
        f.seq,
        &f.at,
        product_version,
    );
    e.set_metadata("tenant_uid", opt(f.cell.as_deref()));
    e.set_metadata("correlation_uid", opt(f.run_id.as_deref()));
    e.set_metadata("log_name", json!("facts"));
    e.set_metadata("event_code", str_or_unknown(&f.kind));
    e.set_metadata("log_version", str_or_unknown(&f.schema));
    e.set("count", json!(f.count));
    e.set("message", json!(f.detail));
    e.set("status_code", json!(f.reason));
    e.set("unmapped", json!({ "loom": fact_loom(f) }));
    e.finish()
}

/// The OCSF event of a decision record (one allowed fetch, tunnel or MCP
/// call, written when it ended). A record has no `id`, cell or epoch: its
/// `metadata.uid` is [`decision_uid`].
pub fn decision_event(d: &Decision, product_version: &str) -> Value {
    let status = if d.outcome == "ok" { SUCCESS } else { FAILURE };
    let outcome = Outcome::new(ALLOWED_ACTION, ALLOWED, status, INFORMATIONAL);
    // A transparent connection that carried plain HTTP is recorded per
    // request, with its method and path; one relayed whole, as `CONNECT`.
    let is_http = d.kind == "http"
        || (d.kind == "transparent"
            && (d.path.is_some() || d.method.as_deref().is_some_and(|m| !m.eq_ignore_ascii_case("CONNECT"))));
    let mut e = if d.kind == "mcp" {
        let call = Call {
            method: d.method.as_deref().unwrap_or(""),
            name: &d.host,
            tool: Some(&d.tool),
            principal: d.principal.as_deref(),
            run_id: Some(&d.run_id),
        };
        mcp_event(&call, outcome)
    } else if is_http {
        http_decision_event(d, outcome)
    } else {
        let mut e = Event::new(NETWORK, CLOSE, outcome);
        e.fetch(Some(&d.tool), d.principal.as_deref(), Some(&d.run_id));
        e.set_opt("dst_endpoint", endpoint(&d.host, d.port, &d.resolved));
        e.set("traffic", traffic(d));
        e
    };
    e.set("policy", policy(&d.policy));
    e.metadata(decision_uid(d), d.seq, &d.at, product_version);
    e.set_metadata("correlation_uid", opt(nonempty(&d.run_id)));
    e.set_metadata("log_name", json!("decisions"));
    e.set_metadata("event_code", json!("decision"));
    e.set("status_code", str_or_unknown(&d.outcome));
    if d.outcome != "ok" {
        e.set("status_detail", json!(d.outcome));
    }
    e.set("duration", json!(d.duration_ms));
    if let Some(end) = e.time {
        let start = i64::try_from(d.duration_ms).map_or(i64::MIN, |ms| end.saturating_sub(ms));
        e.set("start_time", json!(start));
        e.set("end_time", json!(end));
    }
    let mut loom = Map::new();
    loom.insert("type".into(), json!("decision"));
    loom.insert("kind".into(), json!(d.kind));
    loom.insert("target".into(), json!(d.target));
    if let Some(m) = &d.method {
        loom.insert("method".into(), json!(m));
    }
    loom.insert("outcome".into(), json!(d.outcome));
    loom.insert("reported".into(), json!(d.reported));
    insert_run_details(&mut loom, d.principal.as_deref(), &d.executables, &d.resolved);
    e.set("unmapped", json!({ "loom": loom }));
    e.finish()
}

/// An allowed HTTP request (plain, or on a transparent connection): the
/// activity is its method, the URL its host, port and path (a record of
/// kind `http` is plain HTTP through the proxy, so its scheme is `http`).
fn http_decision_event(d: &Decision, outcome: Outcome) -> Event {
    let method = d.method.as_deref().unwrap_or("");
    let activity = http_activity(method);
    let mut e = Event::new(HTTP, activity, outcome);
    if activity == ACTIVITY_OTHER {
        e.activity_name = Some(short(method));
    }
    e.fetch(Some(&d.tool), d.principal.as_deref(), Some(&d.run_id));
    e.set_opt("dst_endpoint", endpoint(&d.host, d.port, &d.resolved));
    let path = d.path.as_deref().and_then(nonempty).unwrap_or("/");
    let mut url = Map::new();
    url.insert("path".into(), json!(path));
    if let Some(host) = nonempty(&d.host) {
        url.insert("hostname".into(), json!(unbracket(host)));
        if d.kind == "http" {
            url.insert("scheme".into(), json!("http"));
            let whole = format!("http://{}{path}", authority(host, d.port));
            url.insert("url_string".into(), json!(whole));
        }
    }
    if d.port != 0 {
        url.insert("port".into(), json!(d.port));
    }
    let mut request = Map::new();
    // OCSF lists the methods `http_method` may be: those with an activity
    // of their own. Another is the activity's name.
    if activity != ACTIVITY_OTHER && activity != ACTIVITY_UNKNOWN {
        request.insert("http_method".into(), json!(method.to_ascii_uppercase()));
    }
    request.insert("url".into(), Value::Object(url));
    e.set("http_request", Value::Object(request));
    if let Some(code) = d.status {
        e.set("http_response", json!({ "code": code }));
        e.set("http_status", json!(code));
    }
    e.set("traffic", traffic(d));
    e
}

/// A decision record's `metadata.uid`: stable across exports of the same
/// record. The first 16 bytes of SHA-256 over `loom-egress decision`, the
/// record's `seq`, `at`, `run_id`, `kind` and `target` (each after a NUL),
/// as a UUID of version 8 (RFC 9562: the variant and version bits set, the
/// rest the digest's).
pub fn decision_uid(d: &Decision) -> String {
    let seq = d.seq.to_string();
    uuid_of(b"loom-egress decision", &[&seq, &d.at, &d.run_id, &d.kind, &d.target])
}

/// A version 8 UUID (RFC 9562) made of the SHA-256 of `domain` and `parts`
/// (each after a zero byte): the same parts, the same uid.
fn uuid_of(domain: &[u8], parts: &[&str]) -> String {
    let mut h = Sha256::new();
    h.update(domain);
    for part in parts {
        h.update([0u8]);
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let mut b = [0u8; 16];
    for (slot, byte) in b.iter_mut().zip(digest.iter()) {
        *slot = *byte;
    }
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let part = |from: usize, to: usize| hex.get(from..to).unwrap_or("");
    format!(
        "{}-{}-{}-{}-{}",
        part(0, 8),
        part(8, 12),
        part(12, 16),
        part(16, 20),
        part(20, 32)
    )
}

/// What the OCSF 1.9 `attestation` of a record says: the record's place in
/// its hash chain ([`crate::facts::chain`]).
pub struct Attestation<'a> {
    /// The chain: `loom-egress/<cell>/<epoch>/<facts|decisions>`.
    pub chain_uid: &'a str,
    pub seq: u64,
    /// The record as the store holds it: what the chain value covers (the
    /// event's `raw_data`).
    pub stored: &'a str,
    /// The record's chain value.
    pub fingerprint: &'a crate::facts::chain::Head,
    /// The previous record's (none: the first of the chain, or not held).
    pub previous: Option<&'a crate::facts::chain::Head>,
    /// The name of the key that signs the chain's checkpoints.
    pub authority: Option<&'a str>,
}

/// Adds the OCSF 1.9 `attestation` object (profile `record_integrity`) to
/// `event`: `fingerprint` is the record's chain value (SHA-256, hex) and
/// `prev_event.fingerprint` the previous record's, so that a receiver can
/// check the events link in order and that a signed checkpoint's head is
/// the fingerprint at its size; `raw_data` is the record as the store
/// holds it, which the fingerprint covers, so `facts verify --export`
/// recomputes it from the events alone. The fingerprint is not over the
/// event's own serialization; `metadata.version` stays 1.8.0.
pub fn attest(event: &mut Value, a: &Attestation<'_>) {
    let fingerprint = |h: &crate::facts::chain::Head| {
        let value: String = h.iter().map(|b| format!("{b:02x}")).collect();
        json!({ "algorithm_id": 3, "algorithm": "SHA-256", "value": value })
    };
    let mut att = json!({
        "uid": format!("{}/{}", a.chain_uid, a.seq),
        "chain_uid": a.chain_uid,
        "fingerprint": fingerprint(a.fingerprint),
    });
    if let Some(p) = a.previous {
        att["prev_event"] = json!({
            "uid": format!("{}/{}", a.chain_uid, a.seq.saturating_sub(1)),
            "fingerprint": fingerprint(p),
        });
    }
    if let Some(name) = a.authority {
        att["authority_uid"] = json!(name);
    }
    event["attestation"] = att;
    event["raw_data"] = json!(a.stored);
    if let Some(profiles) = event.pointer_mut("/metadata/profiles").and_then(Value::as_array_mut) {
        if !profiles.iter().any(|p| p == "record_integrity") {
            profiles.push(json!("record_integrity"));
        }
    }
}

/// The OCSF event of a signed checkpoint of the fact log's hash chains
/// (`seq`: its place among the store's checkpoints; `note`: the C2SP signed
/// note): Event Log Activity 1008, activity Other ("Checkpoint"), observed
/// and logged. Its `metadata.uid` is made of the note, so the same
/// checkpoint sent twice has the same uid; the note itself, with what it
/// says, is under `unmapped.loom`. A note that does not read still gives an
/// event, with the note as it was.
pub fn checkpoint_event(seq: u64, note: &str, product_version: &str) -> Value {
    let mut e = Event::new(
        EVENT_LOG,
        ACTIVITY_OTHER,
        Outcome::new(OBSERVED, LOGGED, SUCCESS, INFORMATIONAL),
    );
    e.activity_name = Some("Checkpoint".into());
    let read = crate::facts::chain::read_note(note).ok();
    let at = read.as_ref().map_or("", |c| c.time.as_str());
    e.metadata(uuid_of(b"loom-egress checkpoint", &[note]), seq, at, product_version);
    e.set_metadata("log_name", json!("checkpoints"));
    e.set_metadata("tenant_uid", opt(read.as_ref().map(|c| c.cell.as_str())));
    e.set("log_name", json!("Loom Egress fact store"));
    e.set("log_provider", json!(PRODUCT));
    let mut loom = json!({ "type": "CHECKPOINT", "note": note });
    match &read {
        Some(c) => {
            let origin = crate::facts::chain::origin(&c.cell, &c.epoch);
            e.set(
                "message",
                json!(format!(
                    "{origin}: facts to seq {}, decision records to seq {}{}",
                    c.size,
                    c.decisions.0,
                    if c.closed { ", closed" } else { "" }
                )),
            );
            loom["origin"] = json!(origin);
            loom["epoch"] = json!(c.epoch);
            loom["size"] = json!(c.size);
            loom["head"] = json!(crate::facts::chain::encode(&c.head));
            loom["decisions"] = json!({ "size": c.decisions.0, "head": crate::facts::chain::encode(&c.decisions.1) });
            loom["closed"] = json!(c.closed);
        }
        None => e.set("message", json!("a checkpoint whose note does not read")),
    }
    e.set("unmapped", json!({ "loom": loom }));
    e.finish()
}

/// A one-line summary of an event of this module (for a log body):
/// `DENIED not_allowlisted http evil.example:443 tool=web run=r-1`. What it
/// says, in order: what was done (`DENIED`, `REPORTED`, `PENDING`,
/// `GRANTED`, `ALLOWED`, `CONTROL`), the reason (a decision's method), the
/// kind of target, the target, then `tool=`, `run=`, `principal=` and
/// `count=` (above 1) when known; a checkpoint's is `CHECKPOINT <origin>
/// facts=N decisions=M [closed]`. Any JSON gives a line: what is missing is
/// left out, control characters and line breaks become spaces, each value
/// is cut to 256 characters.
pub fn shorthand(event: &Value) -> String {
    let loom = &event["unmapped"]["loom"];
    if loom["type"] == "CHECKPOINT" {
        let mut parts = vec![
            "CHECKPOINT".to_owned(),
            short(loom["origin"].as_str().unwrap_or(UNKNOWN)),
        ];
        parts.push(format!("facts={}", loom["size"].as_u64().unwrap_or(0)));
        parts.push(format!("decisions={}", loom["decisions"]["size"].as_u64().unwrap_or(0)));
        if loom["closed"] == true {
            parts.push("closed".into());
        }
        return parts.join(" ");
    }
    let word = match (loom["type"].as_str(), loom["mode"].as_str()) {
        (Some(egress_api::FACT_TYPE), Some("report")) => "REPORTED",
        (Some(egress_api::FACT_TYPE), _) => "DENIED",
        (Some(egress_api::GRANT_FACT_TYPE), _) => "GRANTED",
        (Some(egress_api::PENDING_FACT_TYPE), _) => "PENDING",
        (Some(egress_api::CONTROL_FACT_TYPE), _) => "CONTROL",
        (Some("decision"), _) => "ALLOWED",
        _ => match event["disposition_id"].as_u64() {
            Some(1) => "ALLOWED",
            Some(2) => "DENIED",
            Some(14) => "PENDING",
            _ => event["class_name"].as_str().unwrap_or("EVENT"),
        },
    };
    let mut parts = vec![short(word)];
    if let Some(r) = loom["reason"].as_str().or(loom["method"].as_str()) {
        parts.push(short(r));
    }
    let target = &loom["target"];
    if let Some(k) = target["kind"].as_str().or(loom["kind"].as_str()) {
        parts.push(short(k));
    }
    let named = match (target["host"].as_str(), target["port"].as_u64(), target.as_str()) {
        (Some(h), Some(p), _) if p != 0 => Some(format!("{}:{p}", short(h))),
        (Some(h), _, _) => Some(short(h)),
        (None, _, Some(t)) => Some(short(t)),
        _ => shorthand_endpoint(event),
    };
    if let Some(t) = named.filter(|t| !t.is_empty()) {
        parts.push(t);
    }
    let tool = event["actor"]["app_name"].as_str().or_else(|| {
        event["resources"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["type"] == "tool"))
            .and_then(|r| r["name"].as_str())
    });
    let fields = [
        ("tool", tool),
        ("run", event["metadata"]["correlation_uid"].as_str()),
        (
            "principal",
            event["actor"]["user"]["name"].as_str().filter(|p| *p != UNKNOWN),
        ),
    ];
    for (name, value) in fields {
        if let Some(v) = value {
            parts.push(format!("{name}={}", short(v)));
        }
    }
    if let Some(n) = event["count"].as_u64().filter(|n| *n > 1) {
        parts.push(format!("count={n}"));
    }
    parts.join(" ")
}

/// `host:port` of the event's destination (or DNS query), when it has one.
fn shorthand_endpoint(event: &Value) -> Option<String> {
    let dst = &event["dst_endpoint"];
    let host = dst["hostname"]
        .as_str()
        .or(dst["ip"].as_str())
        .or(event["query"]["hostname"].as_str())?;
    Some(match dst["port"].as_u64() {
        Some(p) if p != 0 => format!("{}:{p}", short(host)),
        _ => short(host),
    })
}

/// `s` on one line (control characters and line or paragraph separators
/// made spaces), at most [`SHORT_MAX`] characters.
fn short(s: &str) -> String {
    s.chars()
        .take(SHORT_MAX)
        .map(|c| if c.is_control() || c.is_whitespace() { ' ' } else { c })
        .collect()
}

/// An event being built: the class, activity and outcome fix the header
/// attributes; the rest is set by name.
struct Event {
    class: Class,
    activity: Id,
    activity_name: Option<String>,
    outcome: Outcome,
    attrs: Map<String, Value>,
    metadata: Map<String, Value>,
    profiles: Vec<&'static str>,
    time: Option<i64>,
}

impl Event {
    fn new(class: Class, activity: Id, outcome: Outcome) -> Event {
        let mut profiles = vec!["security_control"];
        if class.category == 4 {
            profiles.push("network_proxy");
        }
        Event {
            class,
            activity,
            activity_name: None,
            outcome,
            attrs: Map::new(),
            metadata: Map::new(),
            profiles,
            time: None,
        }
    }

    fn set(&mut self, key: &str, value: Value) {
        self.attrs.insert(key.to_owned(), value);
    }

    fn set_opt(&mut self, key: &str, value: Option<Value>) {
        if let Some(v) = value {
            self.set(key, v);
        }
    }

    fn set_metadata(&mut self, key: &str, value: Value) {
        if !value.is_null() {
            self.metadata.insert(key.to_owned(), value);
        }
    }

    /// `metadata`'s uid, sequence and product, and the event's `time`
    /// (epoch milliseconds of `at`; 0 when `at` is no RFC 3339 time, which
    /// `metadata.original_time` keeps as it was).
    fn metadata(&mut self, uid: String, seq: u64, at: &str, product_version: &str) {
        self.set_metadata("uid", json!(uid));
        self.set_metadata("sequence", json!(seq));
        self.set_metadata("version", json!(OCSF_VERSION));
        self.set_metadata(
            "product",
            json!({ "name": PRODUCT, "vendor_name": PRODUCT, "version": product_version }),
        );
        self.set_metadata("original_time", json!(at));
        let parsed = parse_time(at);
        self.time = parsed.map(|(ms, _)| ms);
        self.set("time", json!(parsed.map_or(0, |(ms, _)| ms)));
        if let Some((_, offset)) = parsed.filter(|(_, o)| (-1080..=1080).contains(o)) {
            self.set("timezone_offset", json!(offset));
        }
    }

    /// What every fetch's event has: the actor (the tool, for its
    /// principal), the source (the run's sandbox), the proxy, an outbound
    /// TCP connection.
    fn fetch(&mut self, tool: Option<&str>, principal: Option<&str>, run_id: Option<&str>) {
        if let Some(a) = actor_of(tool, principal) {
            self.set("actor", a);
            self.profiles.push("host");
        }
        self.set("src_endpoint", run_endpoint(run_id));
        self.set("proxy_endpoint", json!({ "name": PRODUCT }));
        self.set(
            "connection_info",
            json!({ "direction_id": 2, "direction": "Outbound", "protocol_name": "tcp", "protocol_num": 6 }),
        );
    }

    fn finish(self) -> Value {
        let c = self.class;
        let o = self.outcome;
        let mut e = self.attrs;
        let activity_name = self.activity_name.unwrap_or_else(|| self.activity.1.to_owned());
        let header = [
            ("category_uid", json!(c.category)),
            ("category_name", json!(c.category_name)),
            ("class_uid", json!(c.uid)),
            ("class_name", json!(c.name)),
            ("activity_id", json!(self.activity.0)),
            ("activity_name", json!(activity_name)),
            ("type_uid", json!(c.uid * 100 + self.activity.0)),
            ("type_name", json!(format!("{}: {}", c.name, self.activity.1))),
            ("severity_id", json!(o.severity.0)),
            ("severity", json!(o.severity.1)),
            ("status_id", json!(o.status.0)),
            ("status", json!(o.status.1)),
            ("action_id", json!(o.action.0)),
            ("action", json!(o.action.1)),
            ("disposition_id", json!(o.disposition.0)),
            ("disposition", json!(o.disposition.1)),
            ("is_alert", json!(o.severity.0 >= MEDIUM.0)),
        ];
        for (k, v) in header {
            e.insert(k.to_owned(), v);
        }
        let mut metadata = self.metadata;
        metadata.insert("profiles".into(), json!(self.profiles));
        e.insert("metadata".into(), Value::Object(metadata));
        Value::Object(e)
    }
}

/// A denial, report, pending or other fetch fact's outcome.
fn fetch_outcome(f: &Fact) -> Outcome {
    let violation = match DenyReason::ALL.iter().find(|r| r.code() == f.reason) {
        Some(DenyReason::CredentialMisuse | DenyReason::CredentialElsewhere) => MEDIUM,
        _ => LOW,
    };
    match f.kind.as_str() {
        egress_api::FACT_TYPE if f.mode == "report" => Outcome::new(ALLOWED_ACTION, ALLOWED, STATUS_UNKNOWN, violation),
        egress_api::FACT_TYPE => Outcome::new(DENIED, BLOCKED, FAILURE, violation),
        egress_api::PENDING_FACT_TYPE => Outcome::new(ACTION_UNKNOWN, DELAYED, STATUS_UNKNOWN, INFORMATIONAL),
        _ => Outcome::new(ACTION_UNKNOWN, DISPOSITION_UNKNOWN, STATUS_UNKNOWN, SEVERITY_UNKNOWN),
    }
}

/// The rule that decided a fetch fact: its step (`DenyReason::rule`) and
/// reason code; a pending fetch's is the allowlist's.
fn firewall_rule(reason: &str) -> Value {
    let name = match DenyReason::ALL.iter().find(|r| r.code() == reason) {
        Some(r) => Some(r.rule()),
        None if reason == "pending" => Some("allowlist"),
        None => None,
    };
    match name {
        Some(n) => json!({ "name": n, "uid": str_or_unknown(reason) }),
        None => json!({ "uid": str_or_unknown(reason) }),
    }
}

fn policy(digest: &str) -> Value {
    match nonempty(digest) {
        Some(d) => json!({ "name": POLICY_NAME, "uid": d }),
        None => json!({ "name": POLICY_NAME }),
    }
}

/// The common part of a fetch fact's event (4001, 4002, 4003).
fn fetch_fact(class: Class, activity: Id, f: &Fact) -> Event {
    let mut e = Event::new(class, activity, fetch_outcome(f));
    e.fetch(f.tool.as_deref(), f.principal.as_deref(), f.run_id.as_deref());
    e.set("firewall_rule", firewall_rule(&f.reason));
    e.set("policy", policy(&f.policy));
    e
}

/// CONNECT, SOCKS5, transparent connections, and facts without a target.
fn network_fact_event(f: &Fact) -> Event {
    let mut e = fetch_fact(NETWORK, OPEN, f);
    if let Some(t) = &f.target {
        e.set_opt("dst_endpoint", endpoint(&t.host, t.port, &f.resolved));
    }
    e
}

/// A plain or intercepted HTTP request, an HTTP/2 stream, a WebSocket
/// handshake or message: a fact records no method, so the activity is
/// Unknown, and neither scheme nor path, so the URL is `//host:port`.
fn http_fact_event(f: &Fact) -> Event {
    let mut e = fetch_fact(HTTP, ACTIVITY_UNKNOWN, f);
    let mut request = Map::new();
    if let Some(t) = &f.target {
        e.set_opt("dst_endpoint", endpoint(&t.host, t.port, &f.resolved));
        if let Some(host) = nonempty(&t.host) {
            let mut url = Map::new();
            url.insert("hostname".into(), json!(unbracket(host)));
            if t.port != 0 {
                url.insert("port".into(), json!(t.port));
            }
            url.insert("url_string".into(), json!(format!("//{}", authority(host, t.port))));
            request.insert("url".into(), Value::Object(url));
        }
    }
    e.set("http_request", Value::Object(request));
    e
}

/// A query to the sandbox's DNS: the queried name; its type is not
/// recorded.
fn dns_fact_event(f: &Fact) -> Event {
    let mut e = fetch_fact(DNS, QUERY, f);
    let host = f.target.as_ref().map_or("", |t| t.host.as_str());
    e.set("query", json!({ "hostname": host, "opcode_id": 0, "opcode": "Query" }));
    e
}

/// A refused or reported MCP call: the method is the quoted start of the
/// fact's detail (`"tools/call" arguments sha256:…`).
fn mcp_fact_event(f: &Fact) -> Event {
    let method = quoted_start(&f.detail).unwrap_or_default();
    let call = Call {
        method: &method,
        name: f.target.as_ref().map_or("", |t| t.host.as_str()),
        tool: f.tool.as_deref(),
        principal: f.principal.as_deref(),
        run_id: f.run_id.as_deref(),
    };
    let mut e = mcp_event(&call, fetch_outcome(f));
    e.set("firewall_rule", firewall_rule(&f.reason));
    e.set("policy", policy(&f.policy));
    e
}

/// An MCP call, as a fact or a decision record knows it.
struct Call<'a> {
    /// The JSON-RPC method (`tools/call`, `resources/read`, ...).
    method: &'a str,
    /// The called tool, resource URI or prompt.
    name: &'a str,
    tool: Option<&'a str>,
    principal: Option<&'a str>,
    run_id: Option<&'a str>,
}

/// An MCP call's API Activity: the method is the operation (and the
/// activity's name when it is Other), the called name the resource, the
/// run's tool the actor and its sandbox the source.
fn mcp_event(c: &Call<'_>, outcome: Outcome) -> Event {
    let activity = mcp_activity(c.method);
    let mut e = Event::new(API, activity, outcome);
    if activity == ACTIVITY_OTHER {
        e.activity_name = Some(short(c.method));
    }
    e.set("actor", actor(c.tool, c.principal));
    e.set("src_endpoint", run_endpoint(c.run_id));
    e.set("api", json!({ "operation": str_or_unknown(c.method) }));
    e.set(
        "resources",
        json!([{ "name": str_or_unknown(c.name), "type": mcp_resource_type(c.method) }]),
    );
    e
}

/// A grant made (`POST /v1/runs/{id}/grants`): an API Create whose
/// resources are the granted target and the run; its actor is the
/// granting principal, which only the detail names.
fn grant_event(f: &Fact) -> Event {
    let outcome = Outcome::new(ALLOWED_ACTION, ALLOWED, SUCCESS, INFORMATIONAL);
    let mut e = Event::new(API, CREATE, outcome);
    let granter = f
        .detail
        .strip_prefix("principal ")
        .and_then(|rest| rest.split_once(" granted "))
        .map(|(p, _)| p);
    e.set("actor", user_actor(granter));
    e.set("src_endpoint", json!({ "name": UNKNOWN }));
    e.set(
        "api",
        json!({ "operation": "grant", "service": { "name": CONTROL_API } }),
    );
    e.set("resources", Value::Array(subjects(f)));
    e.set("policy", policy(&f.policy));
    e
}

/// A control action: an API call of the control plane (or `SIGHUP`), by
/// the principal that acted.
fn control_event(f: &Fact) -> Event {
    let (activity, outcome) = match f.reason.as_str() {
        "grant_refused" => (CREATE, Outcome::new(DENIED, UNAUTHORIZED, FAILURE, LOW)),
        "beyond_envelope" => (UPDATE, Outcome::new(DENIED, BLOCKED, FAILURE, LOW)),
        "reload_applied" => (UPDATE, Outcome::new(ALLOWED_ACTION, ALLOWED, SUCCESS, INFORMATIONAL)),
        "reload_refused" => (UPDATE, Outcome::new(DENIED, BLOCKED, FAILURE, LOW)),
        "principals_changed" => (UPDATE, Outcome::new(ALLOWED_ACTION, ALLOWED, SUCCESS, INFORMATIONAL)),
        "run_ended_by_other" => (DELETE, Outcome::new(ALLOWED_ACTION, ALLOWED, SUCCESS, INFORMATIONAL)),
        "executable_mismatch" => (CREATE, Outcome::new(DENIED, BLOCKED, FAILURE, MEDIUM)),
        "credential_refused" => (ACTIVITY_OTHER, Outcome::new(DENIED, UNAUTHORIZED, FAILURE, LOW)),
        _ => (
            ACTIVITY_UNKNOWN,
            Outcome::new(ACTION_UNKNOWN, DISPOSITION_UNKNOWN, STATUS_UNKNOWN, SEVERITY_UNKNOWN),
        ),
    };
    let mut e = Event::new(API, activity, outcome);
    if f.reason == "credential_refused" {
        e.activity_name = Some("Authenticate".to_owned());
    }
    e.set("actor", user_actor(f.principal.as_deref()));
    e.set("src_endpoint", json!({ "name": UNKNOWN }));
    e.set(
        "api",
        json!({ "operation": str_or_unknown(&f.reason), "service": { "name": CONTROL_API } }),
    );
    let resources = subjects(f);
    if !resources.is_empty() {
        e.set("resources", Value::Array(resources));
    }
    e.set("policy", policy(&f.policy));
    e
}

/// What a grant or control action is about: its target, run and tool.
fn subjects(f: &Fact) -> Vec<Value> {
    let mut out = Vec::new();
    if let Some(t) = f.target.as_ref().filter(|t| !t.host.is_empty()) {
        out.push(json!({ "name": authority(&t.host, t.port), "type": "target" }));
    }
    if let Some(run) = f.run_id.as_deref().and_then(nonempty) {
        out.push(json!({ "uid": run, "type": "run" }));
    }
    if let Some(tool) = f.tool.as_deref().and_then(nonempty) {
        out.push(json!({ "name": tool, "type": "tool" }));
    }
    out
}

/// An MCP method's API activity: what reads is Read, anything else (a
/// tool call, a subscription) Other, an empty one Unknown.
fn mcp_activity(method: &str) -> Id {
    match method {
        "" => ACTIVITY_UNKNOWN,
        "resources/read"
        | "prompts/get"
        | "tools/list"
        | "resources/list"
        | "resources/templates/list"
        | "prompts/list" => READ,
        _ => ACTIVITY_OTHER,
    }
}

fn mcp_resource_type(method: &str) -> &'static str {
    if method.starts_with("tools/") {
        "mcp tool"
    } else if method.starts_with("resources/") {
        "mcp resource"
    } else if method.starts_with("prompts/") {
        "mcp prompt"
    } else {
        "mcp"
    }
}

/// An HTTP method's activity (HTTP Activity's enum; another method is
/// Other, none Unknown).
fn http_activity(method: &str) -> Id {
    match method.to_ascii_uppercase().as_str() {
        "" => ACTIVITY_UNKNOWN,
        "CONNECT" => (1, "Connect"),
        "DELETE" => (2, "Delete"),
        "GET" => (3, "Get"),
        "HEAD" => (4, "Head"),
        "OPTIONS" => (5, "Options"),
        "POST" => (6, "Post"),
        "PUT" => (7, "Put"),
        "TRACE" => (8, "Trace"),
        "PATCH" => (9, "Patch"),
        _ => ACTIVITY_OTHER,
    }
}

/// The actor of a fetch: the tool as the application, the principal it
/// runs for as the user; `None` when neither is known.
fn actor_of(tool: Option<&str>, principal: Option<&str>) -> Option<Value> {
    let mut a = Map::new();
    if let Some(t) = tool.and_then(nonempty) {
        a.insert("app_name".into(), json!(t));
    }
    if let Some(p) = principal.and_then(nonempty) {
        a.insert("user".into(), json!({ "name": p }));
    }
    (!a.is_empty()).then_some(Value::Object(a))
}

/// [`actor_of`], or the user `unknown` where the class requires an actor.
fn actor(tool: Option<&str>, principal: Option<&str>) -> Value {
    actor_of(tool, principal).unwrap_or_else(|| user_actor(None))
}

/// The principal that acted as the actor's user (`unknown` without one).
fn user_actor(principal: Option<&str>) -> Value {
    json!({ "user": { "name": principal.and_then(nonempty).unwrap_or(UNKNOWN) } })
}

/// The run's sandbox as an endpoint: its run id, or `unknown`.
fn run_endpoint(run_id: Option<&str>) -> Value {
    match run_id.and_then(nonempty) {
        Some(r) => json!({ "uid": r }),
        None => json!({ "name": UNKNOWN }),
    }
}

/// A destination: an IP literal as `ip`, a name as `hostname` with the
/// first address it resolved to as `ip`; the port unless 0. `None` when
/// there is neither a name nor an address.
fn endpoint(host: &str, port: u16, resolved: &[String]) -> Option<Value> {
    let host = unbracket(host);
    let mut e = Map::new();
    if let Ok(ip) = host.parse::<IpAddr>() {
        e.insert("ip".into(), json!(ip.to_string()));
    } else {
        if !host.is_empty() {
            e.insert("hostname".into(), json!(host));
        }
        if let Some(ip) = resolved.iter().find_map(|r| unbracket(r).parse::<IpAddr>().ok()) {
            e.insert("ip".into(), json!(ip.to_string()));
        }
    }
    if e.is_empty() {
        return None;
    }
    if port != 0 {
        e.insert("port".into(), json!(port));
    }
    Some(Value::Object(e))
}

/// `host:port` (`[v6]:port` for an IPv6 address; the host alone for port
/// 0).
fn authority(host: &str, port: u16) -> String {
    let host = unbracket(host);
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    if port == 0 {
        host
    } else {
        format!("{host}:{port}")
    }
}

fn unbracket(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

fn traffic(d: &Decision) -> Value {
    json!({
        "bytes_out": d.bytes_up,
        "bytes_in": d.bytes_down,
        "bytes": d.bytes_up.saturating_add(d.bytes_down),
    })
}

/// The fact in its own words (`unmapped.loom`).
fn fact_loom(f: &Fact) -> Map<String, Value> {
    let mut loom = Map::new();
    loom.insert("type".into(), json!(f.kind));
    loom.insert("schema".into(), json!(f.schema));
    loom.insert("reason".into(), json!(f.reason));
    loom.insert("mode".into(), json!(f.mode));
    loom.insert("detail".into(), json!(f.detail));
    loom.insert(
        "target".into(),
        match &f.target {
            Some(t) => json!({ "kind": t.kind, "host": t.host, "port": t.port }),
            None => Value::Null,
        },
    );
    if let Some(epoch) = &f.epoch {
        loom.insert("epoch".into(), json!(epoch));
    }
    insert_run_details(&mut loom, f.principal.as_deref(), &f.executables, &f.resolved);
    loom
}

fn insert_run_details(
    loom: &mut Map<String, Value>,
    principal: Option<&str>,
    executables: &std::collections::BTreeMap<String, String>,
    resolved: &[String],
) {
    if let Some(p) = principal {
        loom.insert("principal".into(), json!(p));
    }
    if !executables.is_empty() {
        loom.insert("executables".into(), json!(executables));
    }
    if !resolved.is_empty() {
        loom.insert("resolved".into(), json!(resolved));
    }
}

/// Epoch milliseconds and the offset in minutes of an RFC 3339 time.
fn parse_time(at: &str) -> Option<(i64, i64)> {
    let t = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()?;
    let ms = i64::try_from(t.unix_timestamp_nanos().div_euclid(1_000_000)).ok()?;
    Some((ms, i64::from(t.offset().whole_minutes())))
}

/// The string a detail starts with when it starts with a quoted one (as
/// `{:?}` writes it; an escaped character is taken as it is), at most 64
/// characters.
fn quoted_start(detail: &str) -> Option<String> {
    let rest = detail.strip_prefix('"')?;
    let mut out = String::new();
    let mut escaped = false;
    for c in rest.chars() {
        match c {
            '"' if !escaped => return Some(out),
            '\\' if !escaped => escaped = true,
            _ => {
                escaped = false;
                out.push(c);
            }
        }
        if out.chars().count() > 64 {
            return None;
        }
    }
    None
}

fn nonempty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn opt(s: Option<&str>) -> Value {
    s.and_then(nonempty).map_or(Value::Null, |v| json!(v))
}

fn str_or_unknown(s: &str) -> Value {
    json!(nonempty(s).unwrap_or(UNKNOWN))
}

#[cfg(test)]
#[path = "ocsf_tests.rs"]
mod tests;
