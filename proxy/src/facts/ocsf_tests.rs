use super::*;
use egress_api::FactTarget;
use proptest::prelude::*;
use std::collections::BTreeMap;

const AT: &str = "2026-11-29T12:00:00.123Z";
const AT_MS: i64 = 1_795_953_600_123;

/// A fact of the sort the proxy records: run `run-1` of tool `web` for
/// principal `alice`, in cell `cell-a`, `seq` and `id` from the case.
fn fact(seq: u64, kind: &str, reason: &str, mode: &str, target: Option<(&str, &str, u16)>) -> Fact {
    Fact {
        kind: kind.to_owned(),
        schema: egress_api::FACT_SCHEMA.to_owned(),
        seq,
        id: format!("01a23594-5030-778f-921e-{seq:012x}"),
        at: AT.to_owned(),
        run_id: Some("run-1".to_owned()),
        tool: Some("web".to_owned()),
        reason: reason.to_owned(),
        mode: mode.to_owned(),
        target: target.map(|(k, h, p)| FactTarget {
            kind: k.to_owned(),
            host: h.to_owned(),
            port: p,
        }),
        resolved: vec![],
        policy: "sha256:4f2a".to_owned(),
        detail: format!("{reason}: the detail"),
        count: 1,
        cell: Some("cell-a".to_owned()),
        epoch: Some("0190b5e2-7c1d-7aaa-8bbb-123456789abc".to_owned()),
        principal: Some("alice".to_owned()),
        executables: BTreeMap::from([(
            "/usr/bin/python3".to_owned(),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".to_owned(),
        )]),
    }
}

fn denied(seq: u64, reason: &str, kind: &str, host: &str, port: u16) -> Fact {
    fact(seq, egress_api::FACT_TYPE, reason, "enforce", Some((kind, host, port)))
}

fn control(seq: u64, reason: &str) -> Fact {
    Fact {
        run_id: None,
        principal: Some("ops".to_owned()),
        executables: BTreeMap::new(),
        ..fact(seq, egress_api::CONTROL_FACT_TYPE, reason, "control", None)
    }
}

fn decision(seq: u64, kind: &str, host: &str, port: u16, method: Option<&str>, path: Option<&str>) -> Decision {
    Decision {
        seq,
        at: AT.to_owned(),
        run_id: "run-1".to_owned(),
        tool: "web".to_owned(),
        kind: kind.to_owned(),
        target: if kind == "mcp" {
            format!("mcp {host}")
        } else {
            format!("{host}:{port}")
        },
        host: host.to_owned(),
        port,
        method: method.map(str::to_owned),
        path: path.map(str::to_owned),
        status: (kind == "http").then_some(200),
        outcome: "ok".to_owned(),
        reported: false,
        bytes_up: 120,
        bytes_down: 4096,
        duration_ms: 35,
        policy: "sha256:4f2a".to_owned(),
        resolved: vec!["93.184.215.14".to_owned()],
        principal: Some("alice".to_owned()),
        executables: BTreeMap::new(),
    }
}

/// One row: a record, then the class, activity and disposition its event
/// must have.
struct Case {
    name: &'static str,
    event: Value,
    class: u64,
    activity: u64,
    disposition: u64,
    /// `metadata.uid`, `metadata.sequence`.
    uid: String,
    seq: u64,
}

fn f(name: &'static str, fact: Fact, (class, activity, disposition): (u64, u64, u64)) -> Case {
    Case {
        name,
        uid: fact.id.clone(),
        seq: fact.seq,
        event: fact_event(&fact, "1.2.3"),
        class,
        activity,
        disposition,
    }
}

fn d(name: &'static str, record: Decision, (class, activity): (u64, u64)) -> Case {
    Case {
        name,
        uid: decision_uid(&record),
        seq: record.seq,
        event: decision_event(&record, "1.2.3"),
        class,
        activity,
        disposition: 1,
    }
}

/// The table: one row per record kind and entrance, then odd records.
#[rustfmt::skip]
fn table() -> Vec<Case> {
    let mcp = |method: &str| format!("{method:?} arguments sha256:e3b0c442: MCP tool \"write_file\" is not allowed");
    let granted = |by: &str| format!("{by} granted new.example:443 to run run-1 for 1 use(s), 60000 ms");
    let typed = |seq, kind: &str, reason: &str, mode: &str, target| fact(seq, kind, reason, mode, Some(target));
    let (denial, grant, pending) = (egress_api::FACT_TYPE, egress_api::GRANT_FACT_TYPE, egress_api::PENDING_FACT_TYPE);
    vec![
        // Denials, one per entrance. SOCKS5 records kind `connect`; an
        // intercepted request, an HTTP/2 stream and a WebSocket handshake
        // or message record kind `http`.
        f("denial http", denied(1, "not_allowlisted", "http", "evil.example", 80), (4002, 0, 2)),
        f("denial connect", denied(2, "not_allowlisted", "connect", "evil.example", 443), (4001, 1, 2)),
        f("denial socks", denied(3, "ip_literal", "connect", "203.0.113.9", 22), (4001, 1, 2)),
        f("denial transparent raw", denied(4, "protocol_unknown", "transparent", "db.example", 5432), (4001, 1, 2)),
        f("denial transparent tls", denied(5, "host_mismatch", "transparent", "api.example", 443), (4001, 1, 2)),
        f("denial intercepted", denied(6, "path_not_allowed", "http", "api.example", 443), (4002, 0, 2)),
        f("denial h2", denied(7, "method_not_allowed", "http", "api.example", 443), (4002, 0, 2)),
        f("denial websocket", denied(8, "upgrade_not_allowed", "http", "ws.example", 443), (4002, 0, 2)),
        f("denial dns", denied(9, "not_allowlisted", "dns", "leak.evil.test", 0), (4003, 1, 2)),
        f("denial credential misuse", denied(10, "credential_misuse", "http", "evil.example", 443), (4002, 0, 2)),
        f("denial ipv6 literal", denied(11, "ip_literal", "connect", "2001:db8::1", 443), (4001, 1, 2)),
        f("denial without a target", with(fact(12, denial, "auth_missing", "enforce", None), |f| {
            (f.run_id, f.tool, f.principal) = (None, None, None);
        }), (4001, 1, 2)),
        f("denial budget", with(denied(13, "budget_exhausted", "http", "api.example", 443), |f| f.count = 17), (4002, 0, 2)),
        f("denial resolved", with(denied(14, "private_address", "connect", "internal.example", 443), |f| {
            f.resolved = vec!["10.0.0.7".to_owned(), "fd00::7".to_owned()];
        }), (4001, 1, 2)),
        // Report mode: let through, recorded.
        f("report connect", typed(20, denial, "not_allowlisted", "report", ("connect", "new.example", 443)), (4001, 1, 1)),
        f("report dns", typed(21, denial, "not_allowlisted", "report", ("dns", "new.example", 0)), (4003, 1, 1)),
        // MCP calls refused or reported.
        f("mcp denial", with(denied(30, "mcp_tool_not_allowed", "mcp", "write_file", 0), |f| f.detail = mcp("tools/call")), (6003, 99, 2)),
        f("mcp report read", with(typed(31, denial, "mcp_resource_not_allowed", "report", ("mcp", "file:///etc/passwd", 0)), |f| {
            f.detail = mcp("resources/read");
        }), (6003, 2, 1)),
        // Grants and held fetches.
        f("grant", with(typed(40, grant, "grant", "grant", ("grant", "new.example", 443)), |f| f.detail = granted("principal ops")), (6003, 1, 1)),
        f("grant by the kernel", with(typed(41, grant, "grant", "grant", ("grant", "new.example", 443)), |f| f.detail = granted("the kernel")), (6003, 1, 1)),
        f("pending http", typed(42, pending, "pending", "ask", ("http", "new.example", 80)), (4002, 0, 14)),
        f("pending connect", typed(43, pending, "pending", "ask", ("connect", "new.example", 443)), (4001, 1, 14)),
        // Control actions.
        f("control reload applied", control(50, "reload_applied"), (6003, 3, 1)),
        f("control reload refused", control(51, "reload_refused"), (6003, 3, 2)),
        f("control grant refused", with(control(52, "grant_refused"), |f| f.run_id = Some("run-1".into())), (6003, 1, 26)),
        f("control beyond envelope", control(53, "beyond_envelope"), (6003, 3, 2)),
        f("control principals changed", control(54, "principals_changed"), (6003, 3, 1)),
        f("control run ended by other", with(control(55, "run_ended_by_other"), |f| f.run_id = Some("run-1".into())), (6003, 4, 1)),
        f("control executable mismatch", with(control(56, "executable_mismatch"), |f| f.principal = None), (6003, 1, 2)),
        f("control credential refused", with(control(57, "credential_refused"), |f| {
            (f.principal, f.tool, f.count) = (None, None, 7);
        }), (6003, 99, 26)),
        f("control unknown", control(58, "something_new"), (6003, 0, 0)),
        // Odd records: a type this mapping does not know, an unknown kind,
        // a time that is no RFC 3339 time, empty strings.
        f("unknown type", typed(60, "EGRESS_FUTURE", "future", "enforce", ("connect", "x.example", 443)), (4001, 1, 0)),
        f("unknown kind", denied(61, "not_allowlisted", "quic", "x.example", 443), (4001, 1, 2)),
        f("unparsable time", with(denied(62, "not_allowlisted", "http", "x.example", 80), |f| f.at = "yesterday".into()), (4002, 0, 2)),
        f("empty strings", with(denied(63, "", "http", "", 0), |f| {
            (f.id, f.policy) = (String::new(), String::new());
            (f.run_id, f.tool, f.principal) = (Some(String::new()), Some(String::new()), Some(String::new()));
        }), (4002, 0, 2)),
        // Decision records.
        d("decision http get", decision(1, "http", "example.com", 80, Some("GET"), Some("/index.html")), (4002, 3)),
        d("decision http post", decision(2, "http", "example.com", 8080, Some("POST"), Some("/submit")), (4002, 6)),
        d("decision http other method", decision(3, "http", "dav.example", 80, Some("PROPFIND"), Some("/")), (4002, 99)),
        d("decision connect", decision(4, "connect", "api.example", 443, Some("CONNECT"), None), (4001, 2)),
        d("decision transparent", decision(5, "transparent", "db.example", 5432, Some("CONNECT"), None), (4001, 2)),
        d("decision transparent http", decision(6, "transparent", "api.example", 80, Some("GET"), Some("/v1")), (4002, 3)),
        d("decision mcp call", decision(7, "mcp", "read_file", 0, Some("tools/call"), None), (6003, 99)),
        d("decision mcp read", decision(8, "mcp", "file:///srv/a", 0, Some("resources/read"), None), (6003, 2)),
        d("decision timed out", with_decision(decision(9, "connect", "slow.example", 443, Some("CONNECT"), None), |d| {
            (d.outcome, d.reported) = ("timeout".into(), true);
        }), (4001, 2)),
        d("decision ipv6", with_decision(decision(10, "connect", "[2001:db8::2]", 443, Some("CONNECT"), None), |d| d.resolved.clear()), (4001, 2)),
        // Signed checkpoints of the chains, and a note that does not read.
        k("checkpoint", 1, &signed_note(false)),
        k("checkpoint closed", 2, &signed_note(true)),
        k("checkpoint unreadable", 3, "not a note"),
        // A record's attestation (profile record_integrity).
        attested(f("denial attested", denied(70, "not_allowlisted", "connect", "evil.example", 443), (4001, 1, 2)), Some(&[7; 32])),
        attested(d("decision attested, first of its chain", decision(1, "connect", "api.example", 443, Some("CONNECT"), None), (4001, 2)), None),
    ]
}

fn attested(mut c: Case, previous: Option<&crate::facts::chain::Head>) -> Case {
    attest(
        &mut c.event,
        &Attestation {
            chain_uid: "loom-egress/cell-a/e/facts",
            seq: c.seq,
            stored: "{}",
            fingerprint: &[9; 32],
            previous,
            authority: Some("cell-a-audit"),
        },
    );
    c
}

/// A signed checkpoint note, closed or not.
fn signed_note(closed: bool) -> String {
    use crate::facts::chain::{genesis, Checkpoint, Kind, Signer};
    let (private, _) = Signer::generate("cell-a-audit").unwrap();
    Checkpoint {
        cell: "cell-a".into(),
        epoch: "0b6a7c1e-5d2f-4c61-9a55-1f3e0d7a9b21".into(),
        size: 100,
        head: genesis(Kind::Facts, "cell-a", "e"),
        decisions: (7, genesis(Kind::Decisions, "cell-a", "e")),
        time: AT.into(),
        closed,
    }
    .sign(&Signer::parse(&private).unwrap())
}

fn k(name: &'static str, seq: u64, note: &str) -> Case {
    let event = checkpoint_event(seq, note, "1.2.3");
    Case {
        name,
        uid: event["metadata"]["uid"].as_str().unwrap().to_owned(),
        seq,
        event,
        class: 1008,
        activity: 99,
        disposition: 17,
    }
}

fn with(mut f: Fact, change: impl FnOnce(&mut Fact)) -> Fact {
    change(&mut f);
    f
}

fn with_decision(mut d: Decision, change: impl FnOnce(&mut Decision)) -> Decision {
    change(&mut d);
    d
}

/// What every event must hold, whatever its input: the header and the
/// constraints the schema cannot say alone.
fn well_formed(name: &str, e: &Value) {
    let class = e["class_uid"].as_u64().unwrap();
    let activity = e["activity_id"].as_u64().unwrap();
    assert_eq!(e["type_uid"].as_u64(), Some(class * 100 + activity), "{name}");
    assert_eq!(e["category_uid"].as_u64(), Some(class / 1000), "{name}");
    assert!(e["severity_id"].is_u64() && e["time"].is_i64(), "{name}");
    let m = &e["metadata"];
    assert_eq!(m["version"], OCSF_VERSION, "{name}");
    assert_eq!(m["product"]["name"], PRODUCT, "{name}");
    assert!(m["uid"].as_str().is_some_and(|u| !u.is_empty()), "{name}");
    assert!(
        m["profiles"].as_array().unwrap().contains(&json!("security_control")),
        "{name}"
    );
    assert!(e["unmapped"]["loom"].is_object(), "{name}");
    match class {
        4001 | 4003 => assert!(e["src_endpoint"].is_object() || e["dst_endpoint"].is_object(), "{name}"),
        4002 => assert!(e["http_request"].is_object(), "{name}"),
        6003 => {
            assert!(e["actor"].is_object() && e["src_endpoint"].is_object(), "{name}");
            assert!(e["api"]["operation"].as_str().is_some_and(|o| !o.is_empty()), "{name}");
        }
        1008 => assert!(e["unmapped"]["loom"]["note"].is_string(), "{name}"),
        _ => panic!("{name}: class {class}"),
    }
    if e["actor"].is_object() && class / 1000 == 4 {
        assert!(m["profiles"].as_array().unwrap().contains(&json!("host")), "{name}");
    }
    let line = shorthand(e);
    assert!(
        !line.is_empty() && !line.contains(['\n', '\r', '\u{2028}', '\u{2029}']),
        "{name}: {line:?}"
    );
}

#[test]
fn every_record_kind_and_entrance_maps_to_its_class_activity_and_disposition() {
    let cases = table();
    for c in &cases {
        let e = &c.event;
        let got = (
            e["class_uid"].as_u64(),
            e["activity_id"].as_u64(),
            e["disposition_id"].as_u64(),
        );
        assert_eq!(
            got,
            (Some(c.class), Some(c.activity), Some(c.disposition)),
            "{}",
            c.name
        );
        assert_eq!(e["type_uid"].as_u64(), Some(c.class * 100 + c.activity), "{}", c.name);
        let uid = if c.uid.is_empty() { UNKNOWN } else { c.uid.as_str() };
        assert_eq!(e["metadata"]["uid"], uid, "{}", c.name);
        assert_eq!(e["metadata"]["sequence"].as_u64(), Some(c.seq), "{}", c.name);
        well_formed(c.name, e);
    }
    // `LOOM_OCSF_DUMP=<file>`: the table's events, one JSON a line, for
    // tests/ocsf/validate.py.
    if let Ok(path) = std::env::var("LOOM_OCSF_DUMP") {
        let lines: Vec<String> = cases.iter().map(|c| c.event.to_string()).collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    }
}

#[test]
fn a_fact_keeps_its_identity_time_and_own_words() {
    let f = Fact {
        resolved: vec!["93.184.215.14".to_owned()],
        count: 3,
        ..denied(42, "not_allowlisted", "connect", "evil.example", 443)
    };
    let e = fact_event(&f, "1.2.3");
    assert_eq!(e["time"], AT_MS);
    assert_eq!(e["timezone_offset"], 0);
    assert_eq!(e["count"], 3);
    assert_eq!(e["message"], f.detail);
    assert_eq!(
        e["metadata"],
        json!({
            "uid": f.id, "sequence": 42, "version": "1.8.0",
            "product": { "name": "Loom Egress", "vendor_name": "Loom Egress", "version": "1.2.3" },
            "profiles": ["security_control", "network_proxy", "host"],
            "tenant_uid": "cell-a", "correlation_uid": "run-1", "log_name": "facts",
            "event_code": "EGRESS_DENIED", "log_version": egress_api::FACT_SCHEMA, "original_time": AT,
        })
    );
    assert_eq!(e["actor"], json!({ "app_name": "web", "user": { "name": "alice" } }));
    assert_eq!(
        e["dst_endpoint"],
        json!({ "hostname": "evil.example", "ip": "93.184.215.14", "port": 443 })
    );
    assert_eq!(e["src_endpoint"], json!({ "uid": "run-1" }));
    assert_eq!(
        e["firewall_rule"],
        json!({ "name": "allowlist", "uid": "not_allowlisted" })
    );
    assert_eq!(
        e["policy"],
        json!({ "name": "Loom Egress policy", "uid": "sha256:4f2a" })
    );
    assert_eq!((e["action_id"].as_u64(), e["status_id"].as_u64()), (Some(2), Some(2)));
    let loom = &e["unmapped"]["loom"];
    assert_eq!(loom["reason"], "not_allowlisted");
    assert_eq!(loom["mode"], "enforce");
    assert_eq!(loom["epoch"], "0190b5e2-7c1d-7aaa-8bbb-123456789abc");
    assert_eq!(loom["principal"], "alice");
    assert_eq!(
        loom["target"],
        json!({ "kind": "connect", "host": "evil.example", "port": 443 })
    );
    assert_eq!(loom["executables"]["/usr/bin/python3"].as_str().map(str::len), Some(64));
    assert_eq!(
        shorthand(&e),
        "DENIED not_allowlisted connect evil.example:443 tool=web run=run-1 principal=alice count=3"
    );
}

#[test]
fn entrances_fill_their_class_attributes() {
    let http = fact_event(&denied(1, "not_allowlisted", "http", "evil.example", 443), "v");
    assert_eq!(
        http["http_request"],
        json!({ "url": { "hostname": "evil.example", "port": 443, "url_string": "//evil.example:443" } })
    );
    assert_eq!(
        shorthand(&http),
        "DENIED not_allowlisted http evil.example:443 tool=web run=run-1 principal=alice"
    );
    let v6 = fact_event(&denied(2, "ip_literal", "http", "2001:db8::1", 443), "v");
    assert_eq!(v6["http_request"]["url"]["url_string"], "//[2001:db8::1]:443");
    assert_eq!(v6["dst_endpoint"], json!({ "ip": "2001:db8::1", "port": 443 }));
    let dns = fact_event(&denied(3, "not_allowlisted", "dns", "leak.evil.test", 0), "v");
    assert_eq!(dns["query"]["hostname"], "leak.evil.test");
    assert!(dns.get("dst_endpoint").is_none());
    let report = fact_event(
        &fact(
            4,
            egress_api::FACT_TYPE,
            "not_allowlisted",
            "report",
            Some(("connect", "n.example", 443)),
        ),
        "v",
    );
    assert_eq!(
        (report["action_id"].as_u64(), report["status_id"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(shorthand(&report).starts_with("REPORTED not_allowlisted connect n.example:443"));
    let pending = fact_event(
        &fact(
            5,
            egress_api::PENDING_FACT_TYPE,
            "pending",
            "ask",
            Some(("connect", "n.example", 443)),
        ),
        "v",
    );
    assert_eq!(pending["action_id"], 0);
    assert_eq!(
        pending["firewall_rule"],
        json!({ "name": "allowlist", "uid": "pending" })
    );
    let misuse = fact_event(&denied(6, "credential_misuse", "http", "evil.example", 443), "v");
    assert_eq!(
        (misuse["severity_id"].as_u64(), misuse["is_alert"].as_bool()),
        (Some(3), Some(true))
    );
    let mcp = fact_event(
        &Fact {
            detail: "\"tools/call\" arguments sha256:00: MCP tool \"write_file\" is not allowed".to_owned(),
            ..denied(7, "mcp_tool_not_allowed", "mcp", "write_file", 0)
        },
        "v",
    );
    assert_eq!(mcp["api"], json!({ "operation": "tools/call" }));
    assert_eq!(mcp["activity_name"], "tools/call");
    assert_eq!(mcp["resources"], json!([{ "name": "write_file", "type": "mcp tool" }]));
    assert_eq!(
        mcp["firewall_rule"],
        json!({ "name": "mcp", "uid": "mcp_tool_not_allowed" })
    );
    let grant = fact_event(
        &Fact {
            detail: "principal ops granted n.example:443 to run run-1 for 1 use(s), 1000 ms".to_owned(),
            ..fact(
                8,
                egress_api::GRANT_FACT_TYPE,
                "grant",
                "grant",
                Some(("grant", "n.example", 443)),
            )
        },
        "v",
    );
    assert_eq!(grant["actor"], json!({ "user": { "name": "ops" } }));
    assert_eq!(
        grant["resources"],
        json!([
            { "name": "n.example:443", "type": "target" },
            { "uid": "run-1", "type": "run" },
            { "name": "web", "type": "tool" },
        ])
    );
    assert!(shorthand(&grant).starts_with("GRANTED grant grant n.example:443"));
    let refused = fact_event(
        &Fact {
            principal: None,
            tool: None,
            count: 7,
            ..control(9, "credential_refused")
        },
        "v",
    );
    assert_eq!(refused["actor"], json!({ "user": { "name": "unknown" } }));
    assert_eq!(refused["activity_name"], "Authenticate");
    assert_eq!(shorthand(&refused), "CONTROL credential_refused count=7");
}

#[test]
fn a_decision_is_a_closed_connection_or_a_request_with_a_stable_uid() {
    let r = decision(7, "http", "example.com", 80, Some("GET"), Some("/a"));
    let e = decision_event(&r, "1.2.3");
    assert_eq!(
        e["http_request"],
        json!({ "http_method": "GET", "url": {
            "hostname": "example.com", "port": 80, "path": "/a", "scheme": "http",
            "url_string": "http://example.com:80/a" } })
    );
    assert_eq!(e["http_response"], json!({ "code": 200 }));
    assert_eq!(
        e["traffic"],
        json!({ "bytes_out": 120, "bytes_in": 4096, "bytes": 4216 })
    );
    assert_eq!(
        (e["start_time"].as_i64(), e["end_time"].as_i64()),
        (Some(AT_MS - 35), Some(AT_MS))
    );
    assert_eq!(e["metadata"]["log_name"], "decisions");
    assert!(e["metadata"].get("tenant_uid").is_none());
    assert_eq!(
        shorthand(&e),
        "ALLOWED GET http example.com:80 tool=web run=run-1 principal=alice"
    );
    // A method OCSF does not list is the activity's name, not `http_method`.
    let dav = decision_event(
        &decision(8, "http", "dav.example", 80, Some("PROPFIND"), Some("/")),
        "v",
    );
    assert_eq!(
        (dav["activity_id"].as_u64(), dav["activity_name"].as_str()),
        (Some(99), Some("PROPFIND"))
    );
    assert!(dav["http_request"].get("http_method").is_none());
    assert_eq!(dav["unmapped"]["loom"]["method"], "PROPFIND");
    // The uid: a UUID of version 8, the same for the same record, another
    // for another.
    let uid = decision_uid(&r);
    assert_eq!(uid.len(), 36);
    assert_eq!(uid.as_bytes()[14], b'8');
    assert!(matches!(uid.as_bytes()[19], b'8' | b'9' | b'a' | b'b'), "{uid}");
    assert_eq!(uid, decision_uid(&r.clone()));
    assert_ne!(uid, decision_uid(&Decision { seq: 8, ..r.clone() }));
    assert_ne!(
        uid,
        decision_uid(&Decision {
            run_id: "run-2".into(),
            ..r
        })
    );
    let failed = decision_event(
        &Decision {
            outcome: "severed".into(),
            ..decision(1, "connect", "a.example", 443, Some("CONNECT"), None)
        },
        "v",
    );
    assert_eq!(
        (failed["status_id"].as_u64(), failed["status_detail"].as_str()),
        (Some(2), Some("severed"))
    );
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9.:\\[\\]-]{0,40}",
        ".{0,80}",
        "[\\x00-\\x1f\"\\\\]{0,8}",
    ]
}

fn kind() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("http".to_owned()),
        Just("connect".to_owned()),
        Just("transparent".to_owned()),
        Just("dns".to_owned()),
        Just("mcp".to_owned()),
        Just("grant".to_owned()),
        text(),
    ]
}

fn fact_type() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(egress_api::FACT_TYPE.to_owned()),
        Just(egress_api::GRANT_FACT_TYPE.to_owned()),
        Just(egress_api::PENDING_FACT_TYPE.to_owned()),
        Just(egress_api::CONTROL_FACT_TYPE.to_owned()),
        text(),
    ]
}

fn time_text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(AT.to_owned()),
        Just("9999-12-31T23:59:59.999+23:59".to_owned()),
        Just("0000-01-01T00:00:00Z".to_owned()),
        text(),
    ]
}

fn mangled_fact() -> impl Strategy<Value = Fact> {
    let head = (fact_type(), any::<u64>(), text(), time_text(), any::<u64>());
    let who = (
        proptest::option::of(text()),
        proptest::option::of(text()),
        proptest::option::of(text()),
        proptest::option::of(text()),
        proptest::option::of(text()),
    );
    let what = (
        text(),
        prop_oneof![Just("enforce".to_owned()), Just("report".to_owned()), text()],
        proptest::option::of((kind(), text(), any::<u16>())),
        proptest::collection::vec(text(), 0..3),
        text(),
        proptest::collection::btree_map(text(), text(), 0..2),
    );
    (head, who, what).prop_map(
        |(
            (kind, seq, id, at, count),
            (run_id, tool, cell, epoch, principal),
            (reason, mode, target, resolved, detail, executables),
        )| Fact {
            kind,
            schema: "1.9.0".to_owned(),
            seq,
            id,
            at,
            run_id,
            tool,
            reason,
            mode,
            target: target.map(|(kind, host, port)| FactTarget { kind, host, port }),
            resolved,
            policy: "sha256:00".to_owned(),
            detail,
            count,
            cell,
            epoch,
            principal,
            executables,
        },
    )
}

fn mangled_decision() -> impl Strategy<Value = Decision> {
    let head = (any::<u64>(), time_text(), text(), text(), kind(), text(), any::<u16>());
    let rest = (
        proptest::option::of(prop_oneof![Just("GET".to_owned()), Just("CONNECT".to_owned()), text()]),
        proptest::option::of(text()),
        proptest::option::of(any::<u16>()),
        prop_oneof![Just("ok".to_owned()), text()],
        any::<bool>(),
        (any::<u64>(), any::<u64>(), any::<u64>()),
        proptest::collection::vec(text(), 0..3),
        proptest::option::of(text()),
    );
    (head, rest).prop_map(
        |(
            (seq, at, run_id, tool, kind, host, port),
            (method, path, status, outcome, reported, (up, down, ms), resolved, principal),
        )| Decision {
            seq,
            at,
            run_id,
            tool,
            target: format!("{host}:{port}"),
            kind,
            host,
            port,
            method,
            path,
            status,
            outcome,
            reported,
            bytes_up: up,
            bytes_down: down,
            duration_ms: ms,
            policy: String::new(),
            resolved,
            principal,
            executables: BTreeMap::new(),
        },
    )
}

proptest! {
    #[test]
    fn any_fact_maps_without_panic_to_a_well_formed_event(f in mangled_fact()) {
        let e = fact_event(&f, "");
        well_formed("mangled fact", &e);
        prop_assert_eq!(e["metadata"]["sequence"].as_u64(), Some(f.seq));
    }

    #[test]
    fn any_decision_maps_without_panic_to_a_well_formed_event(d in mangled_decision()) {
        let e = decision_event(&d, "");
        well_formed("mangled decision", &e);
        let uid = decision_uid(&d);
        prop_assert_eq!(e["metadata"]["uid"].as_str(), Some(uid.as_str()));
    }

    #[test]
    fn any_json_has_a_shorthand_of_one_line(s in ".{0,200}") {
        let v = serde_json::from_str(&s).unwrap_or(Value::String(s));
        let line = shorthand(&v);
        let one_line = !line.contains(['\n', '\r', '\u{2028}', '\u{2029}']);
        prop_assert!(one_line, "{:?}", line);
    }
}

#[test]
fn a_checkpoint_maps_to_event_log_activity_with_its_note_and_a_uid_made_of_it() {
    let note = signed_note(true);
    let e = checkpoint_event(5, &note, "1.2.3");
    assert_eq!(
        (e["class_uid"].as_u64(), e["type_uid"].as_u64()),
        (Some(1008), Some(100899))
    );
    assert_eq!(e["activity_name"], "Checkpoint");
    assert_eq!(e["time"], AT_MS);
    assert_eq!(e["metadata"]["log_name"], "checkpoints");
    assert_eq!(e["metadata"]["tenant_uid"], "cell-a");
    let loom = &e["unmapped"]["loom"];
    assert_eq!(loom["note"], note.as_str());
    assert_eq!(
        (loom["size"].as_u64(), loom["decisions"]["size"].as_u64()),
        (Some(100), Some(7))
    );
    assert_eq!(loom["closed"], true);
    assert_eq!(
        e["metadata"]["uid"],
        checkpoint_event(9, &note, "9.9.9")["metadata"]["uid"],
        "the uid is the note's"
    );
    assert_ne!(
        e["metadata"]["uid"],
        checkpoint_event(5, &signed_note(true), "1.2.3")["metadata"]["uid"]
    );
    assert_eq!(
        shorthand(&e),
        "CHECKPOINT loom-egress/cell-a/0b6a7c1e-5d2f-4c61-9a55-1f3e0d7a9b21 facts=100 decisions=7 closed"
    );
}

#[test]
fn an_attestation_carries_the_chain_value_and_the_previous_one() {
    let mut e = fact_event(&denied(5, "not_allowlisted", "connect", "evil.example", 443), "1.2.3");
    let (fp, prev) = ([0xab; 32], [0x01; 32]);
    let a = Attestation {
        chain_uid: "loom-egress/cell-a/e/facts",
        seq: 5,
        stored: "{\"seq\":5}",
        fingerprint: &fp,
        previous: Some(&prev),
        authority: Some("cell-a-audit"),
    };
    attest(&mut e, &a);
    attest(&mut e, &a);
    let att = &e["attestation"];
    assert_eq!(att["uid"], "loom-egress/cell-a/e/facts/5");
    assert_eq!(att["chain_uid"], "loom-egress/cell-a/e/facts");
    assert_eq!(att["authority_uid"], "cell-a-audit");
    assert_eq!(
        att["fingerprint"],
        json!({ "algorithm_id": 3, "algorithm": "SHA-256", "value": "ab".repeat(32) })
    );
    assert_eq!(att["prev_event"]["uid"], "loom-egress/cell-a/e/facts/4");
    assert_eq!(att["prev_event"]["fingerprint"]["value"], "01".repeat(32));
    assert_eq!(e["raw_data"], "{\"seq\":5}", "the stored record the fingerprint covers");
    let profiles = e["metadata"]["profiles"].as_array().unwrap();
    assert_eq!(
        profiles.iter().filter(|p| *p == "record_integrity").count(),
        1,
        "{profiles:?}"
    );
}
