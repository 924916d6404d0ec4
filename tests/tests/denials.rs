//! Denials a program or an agent can read: every denial carries
//! `X-Egress-Denial`, one line of JSON (`egress_api::Denial`: reason,
//! target, tool, fact id, the rule that denied, a fixed hint), visible ASCII
//! and bounded even for a hostile target; a request that accepts
//! `application/json` gets the same object as its body, with status and
//! detail. One table of denials through the forward path and CONNECT, each
//! with and without `Accept: application/json`; the answer and the fact
//! agree. (Inside interception: `paths.rs`; transparent plain HTTP:
//! the executor's `transparent.rs`.) Loopback only, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_api::{Denial, DENIAL_HEADER_MAX};
use egress_e2e::harness::{basic, TestProxy, TestRun};
use egress_e2e::raw::{send, RawResponse};

fn tools() -> String {
    [
        "[tools.web]",
        r#"egress = ["allowed.test:80", "private.test:80", { host = "rules.test", port = 80, methods = ["GET"], paths = ["/ok"] }]"#,
        "fetch_timeout_ms = 5000",
    ]
    .join("\n")
}

/// How a request is sent: through the run's credential or not.
enum Cred {
    Run,
    None,
    Wrong,
}

/// One denial case: the request line and extra headers, how it
/// authenticates, and what must come back.
struct Case {
    name: &'static str,
    method: &'static str,
    target: &'static str,
    host: &'static str,
    cred: Cred,
    reason: &'static str,
    rule: &'static str,
    /// The `target` the answer names (`None`: withheld).
    names: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    let case = |name, method, target, host, cred, reason, rule, names| Case {
        name,
        method,
        target,
        host,
        cred,
        reason,
        rule,
        names,
    };
    vec![
        case(
            "unlisted",
            "GET",
            "http://evil.test/",
            "evil.test",
            Cred::Run,
            "not_allowlisted",
            "allowlist",
            Some("evil.test:80"),
        ),
        case(
            "ip literal",
            "GET",
            "http://192.0.2.1/",
            "192.0.2.1",
            Cred::Run,
            "ip_literal",
            "ip_literals",
            Some("192.0.2.1:80"),
        ),
        case(
            "private",
            "GET",
            "http://private.test/",
            "private.test",
            Cred::Run,
            "private_address",
            "address_ranges",
            Some("private.test:80"),
        ),
        case(
            "method",
            "POST",
            "http://rules.test/ok",
            "rules.test",
            Cred::Run,
            "method_not_allowed",
            "methods",
            Some("rules.test:80"),
        ),
        case(
            "path",
            "GET",
            "http://rules.test/admin",
            "rules.test",
            Cred::Run,
            "path_not_allowed",
            "paths",
            Some("rules.test:80"),
        ),
        case(
            "host",
            "GET",
            "http://allowed.test/",
            "other.test",
            Cred::Run,
            "host_mismatch",
            "target",
            Some("http://allowed.test/"),
        ),
        case(
            "no credential",
            "GET",
            "http://allowed.test/",
            "allowed.test",
            Cred::None,
            "auth_missing",
            "authentication",
            Some("http://allowed.test/"),
        ),
        case(
            "wrong secret",
            "GET",
            "http://allowed.test/",
            "allowed.test",
            Cred::Wrong,
            "auth_invalid",
            "authentication",
            None,
        ),
        case(
            "connect unlisted",
            "CONNECT",
            "evil.test:443",
            "evil.test:443",
            Cred::Run,
            "not_allowlisted",
            "allowlist",
            Some("evil.test:443"),
        ),
    ]
}

async fn ask(p: &TestProxy, run: &TestRun, c: &Case, json: bool) -> RawResponse {
    let auth = match c.cred {
        Cred::Run => format!("Proxy-Authorization: {}\r\n", run.auth()),
        Cred::None => String::new(),
        Cred::Wrong => format!("Proxy-Authorization: {}\r\n", basic(&run.id, "not-the-secret")),
    };
    let accept = if json {
        "Accept: text/html, Application/JSON;q=0.9\r\n"
    } else {
        ""
    };
    let req = format!(
        "{} {} HTTP/1.1\r\nHost: {}\r\n{auth}{accept}Content-Length: 0\r\nConnection: close\r\n\r\n",
        c.method, c.target, c.host
    );
    send(p.proxy, req.as_bytes()).await
}

/// The `X-Egress-Denial` of `r`: present, visible ASCII, bounded, JSON.
fn denial_header(r: &RawResponse, what: &str) -> Denial {
    let h = r
        .header("x-egress-denial")
        .unwrap_or_else(|| panic!("{what}: no X-Egress-Denial: {r:?}"));
    assert!(h.len() <= DENIAL_HEADER_MAX, "{what}: {} bytes", h.len());
    assert!(h.bytes().all(|b| (b' '..=b'~').contains(&b)), "{what}: {h}");
    serde_json::from_str(h).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {h}"))
}

#[tokio::test]
async fn every_denial_says_what_and_why_in_json() {
    let p = TestProxy::start(&tools()).await;
    p.dns.set("private.test", &["10.1.2.3"]);
    let run = p.run("web").await;
    let mut hints = std::collections::HashMap::new();
    for c in cases() {
        for json in [false, true] {
            let what = format!("{} (json {json})", c.name);
            let r = ask(&p, &run, &c, json).await;
            assert_eq!(r.deny_reason(), Some(c.reason), "{what}: {r:?}");
            let d = denial_header(&r, &what);
            assert_eq!(d.reason, c.reason, "{what}");
            assert_eq!(d.rule, c.rule, "{what}");
            assert_eq!(d.target.as_deref(), c.names, "{what}");
            let auth = c.rule == "authentication";
            assert_eq!(d.tool.as_deref(), (!auth).then_some("web"), "{what}");
            assert_eq!(Some(d.fact_id.as_str()), r.header("x-egress-fact-id"), "{what}");
            assert!(
                d.status.is_none() && d.detail.is_none(),
                "{what}: the header is compact"
            );
            // The fixed hint of the reason, whatever the request.
            assert!(!d.hint.is_empty());
            assert_eq!(hints.entry(c.reason).or_insert(d.hint.clone()), &d.hint, "{what}");
            // The fact it names is the one recorded.
            let facts = p.facts().await;
            let fact = facts.iter().find(|f| f.id == d.fact_id);
            assert_eq!(fact.map(|f| f.reason.as_str()), Some(c.reason), "{what}");
            let ctype = r.header("content-type").unwrap_or_default().to_string();
            if json {
                assert_eq!(ctype, "application/json", "{what}");
                let body: Denial =
                    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{what}: {e}: {}", r.text()));
                assert_eq!(body.status, Some(r.status), "{what}");
                assert!(body.detail.as_deref().is_some_and(|t| !t.is_empty()), "{what}");
                assert_eq!(
                    Denial {
                        status: None,
                        detail: None,
                        ..body
                    },
                    d,
                    "{what}: the body is the header plus status and detail"
                );
            } else {
                assert!(ctype.starts_with("text/plain"), "{what}: {ctype}");
                assert!(r.text().starts_with(&format!("egress denied ({})", c.reason)), "{what}");
            }
        }
    }
}

#[tokio::test]
async fn a_hostile_target_cannot_stretch_the_header() {
    let p = TestProxy::start(&tools()).await;
    let run = p.run("web").await;
    // A target that cannot be made canonical, quoted raw (a port out of
    // range, then 3000 characters), and a 192-character unlisted name.
    let long_name = format!("{0}.{0}.{0}.evil.test", "a".repeat(60));
    for (target, host, reason) in [
        (
            format!("http://evil.test:99999999/{}", "x".repeat(3000)),
            "evil.test:99999999".to_string(),
            "bad_target",
        ),
        (
            format!("http://{long_name}/{}", "x".repeat(3000)),
            long_name.clone(),
            "not_allowlisted",
        ),
    ] {
        for json in [false, true] {
            let accept = if json { "Accept: application/json\r\n" } else { "" };
            let req = format!(
                "GET {target} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\n{accept}Connection: close\r\n\r\n",
                run.auth()
            );
            let r = send(p.proxy, req.as_bytes()).await;
            assert_eq!(r.deny_reason(), Some(reason), "{r:?}");
            let d = denial_header(&r, reason);
            assert_eq!(d.reason, reason);
            // Bounded: the header quotes at most 128 characters of a target.
            assert_eq!(d.target.as_deref().map(|t| t.chars().count()), Some(128), "{d:?}");
            if json {
                let body: Denial = serde_json::from_slice(&r.body).unwrap();
                assert_eq!(body.reason, reason);
                assert!(r.body.len() < 2048, "{} bytes", r.body.len());
            }
        }
    }
}
