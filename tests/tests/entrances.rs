//! One decision, many entrances: the one table of (target, expected
//! decision) cases, [`cases`], is fed by each entrance's harness: the
//! forward path (absolute-form HTTP), CONNECT, SOCKS5, and a request inside
//! an intercepted CONNECT over HTTP/1.1 and over HTTP/2. Each must come to
//! the same decision and record the same fact; a denied name is never
//! resolved. Then what only SOCKS5 has: its authentication, its commands
//! and address types, and a real client (curl `--socks5-hostname`).
//! Loopback origins on 127.0.0.2, fake DNS. (A transparent connection is
//! decided by the same steps; its harness needs a confined child, and its
//! cases are in `executor/tests/transparent.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, TestProxy, TestRun};
use egress_e2e::inside;
use egress_e2e::origin::http_origin;
use egress_e2e::raw::{connect, send};
use egress_e2e::socks::{self, Dest, Outcome};
use egress_e2e::tls_origin::tls_origin;
use std::net::IpAddr;

fn tools(port: u16) -> String {
    format!(
        "[tools.web]\negress = [\"allowed.test:{port}\", \"private.test:{port}\", \"127.0.0.2:{port}\"]\nfetch_timeout_ms = 5000\n"
    )
}

/// How a request went, by any entrance: allowed, or the deny reason of its
/// fact (the entrance's own answer read back into the shared outcome).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decided {
    Allowed,
    Denied(String),
}

async fn last_fact(p: &TestProxy, run: &TestRun, before: usize) -> Option<String> {
    let facts: Vec<_> = p
        .facts()
        .await
        .into_iter()
        .filter(|f| f.run_id.as_deref() == Some(&run.id))
        .collect();
    (facts.len() > before).then(|| facts.last().unwrap().reason.clone())
}

async fn facts_of(p: &TestProxy, run: &TestRun) -> usize {
    p.facts()
        .await
        .iter()
        .filter(|f| f.run_id.as_deref() == Some(&run.id))
        .count()
}

/// The decision of the forward path for `http://{authority}/`.
async fn forward(p: &TestProxy, run: &TestRun, authority: &str) -> Decided {
    let before = facts_of(p, run).await;
    let r = p.get(run, &format!("http://{authority}/"), "").await;
    match (r.status, last_fact(p, run, before).await) {
        (200, None) => Decided::Allowed,
        (_, Some(reason)) => {
            assert_eq!(r.deny_reason(), Some(reason.as_str()), "the answer and the fact agree");
            Decided::Denied(reason)
        }
        (s, None) => panic!("forward {authority}: {s} without a fact: {}", r.text()),
    }
}

async fn tunnel(p: &TestProxy, run: &TestRun, authority: &str) -> Decided {
    let before = facts_of(p, run).await;
    let (r, _) = connect(p.proxy, authority, Some(&run.auth())).await;
    match (r.status, last_fact(p, run, before).await) {
        (200, None) => Decided::Allowed,
        (_, Some(reason)) => {
            assert_eq!(r.deny_reason(), Some(reason.as_str()), "the answer and the fact agree");
            Decided::Denied(reason)
        }
        (s, None) => panic!("CONNECT {authority}: {s} without a fact"),
    }
}

async fn socks5(p: &TestProxy, run: &TestRun, dest: &Dest) -> Decided {
    let before = facts_of(p, run).await;
    let (code, _) = socks::connect(p.proxy, (&run.id, &run.secret), dest).await;
    match (code, last_fact(p, run, before).await) {
        (0, None) => Decided::Allowed,
        (2, Some(reason)) => Decided::Denied(reason),
        (c, f) => panic!("SOCKS5 {dest:?}: reply {c}, fact {f:?}"),
    }
}

/// The one table of decision cases every entrance is fed: (host as
/// written, port, expected), for a tool that may reach `allowed.test`,
/// `private.test` (which resolves to a private address) and `127.0.0.2` on
/// the origin's `port`. Names go by SOCKS5 as names, addresses as addresses.
fn cases(port: u16) -> Vec<(&'static str, u16, Decided)> {
    let allowed = Decided::Allowed;
    let denied = |r: &str| Decided::Denied(r.to_owned());
    vec![
        ("allowed.test", port, allowed.clone()),
        ("ALLOWED.test.", port, allowed.clone()),
        ("allowed.test", port + 1, denied("not_allowlisted")),
        ("other.test", port, denied("not_allowlisted")),
        ("x.allowed.test", port, denied("not_allowlisted")),
        ("127.0.0.2", port, allowed.clone()),
        ("127.0.0.2", port + 1, denied("ip_literal")),
        ("127.0.0.1", port, denied("ip_literal")),
        ("2130706433", port, denied("ip_literal")),
        ("0x7f.1", port, denied("ip_literal")),
        ("private.test", port, denied("private_address")),
        ("::1", port, denied("ip_literal")),
    ]
}

fn names(p: &TestProxy) {
    p.dns.set("allowed.test", &["127.0.0.2"]);
    p.dns.set("private.test", &["127.0.0.3"]);
    p.dns.set("other.test", &["127.0.0.2"]);
}

fn authority(host: &str, port: u16) -> String {
    match host.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{host}]:{port}"),
        Err(_) => format!("{host}:{port}"),
    }
}

fn only_allowed_names_resolved(p: &TestProxy) {
    let asked = p.dns.queries();
    assert!(
        asked
            .iter()
            .all(|q| q.starts_with("allowed.test") || q.starts_with("private.test")),
        "only allowed names were resolved: {asked:?}"
    );
}

#[tokio::test]
async fn every_entrance_comes_to_the_same_decision() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tools(port)).await;
    names(&p);
    let run = p.run("web").await;
    for (host, port, want) in cases(port) {
        let authority = authority(host, port);
        let dest = match host.parse::<IpAddr>() {
            Ok(ip) => Dest::Ip(ip, port),
            Err(_) => Dest::Name(host.to_owned(), port),
        };
        assert_eq!(forward(&p, &run, &authority).await, want, "forward {authority}");
        assert_eq!(tunnel(&p, &run, &authority).await, want, "CONNECT {authority}");
        assert_eq!(socks5(&p, &run, &dest).await, want, "SOCKS5 {dest:?}");
    }
    only_allowed_names_resolved(&p);
}

/// A request inside an intercepted CONNECT, over HTTP/1.1 or HTTP/2: the
/// CONNECT is decided first (a denial there is the row's decision), then
/// the request inside, against the same rules.
async fn intercepted(p: &TestProxy, run: &TestRun, ca: &str, authority: &str, h2: bool) -> Decided {
    let before = facts_of(p, run).await;
    let (r, stream) = connect(p.proxy, authority, Some(&run.auth())).await;
    if r.status != 200 {
        let reason = last_fact(p, run, before).await;
        let reason = reason.unwrap_or_else(|| panic!("CONNECT {authority}: {} without a fact", r.status));
        assert_eq!(r.deny_reason(), Some(reason.as_str()), "the answer and the fact agree");
        return Decided::Denied(reason);
    }
    let got = if h2 {
        inside::h2(ca, authority, stream, "GET", "/", &[]).await
    } else {
        inside::h1(ca, authority, stream, "GET", "/", "").await
    };
    match (got.status, last_fact(p, run, before).await) {
        (200, None) => Decided::Allowed,
        (_, Some(reason)) => {
            assert_eq!(
                got.header("x-egress-deny-reason"),
                Some(reason.as_str()),
                "the answer and the fact agree"
            );
            Decided::Denied(reason)
        }
        (s, None) => panic!(
            "inside {authority} (h2: {h2}): {s} without a fact: {}",
            String::from_utf8_lossy(&got.all)
        ),
    }
}

#[tokio::test]
async fn requests_inside_interception_come_to_the_same_decision() {
    let origin = tls_origin("127.0.0.2:0", &["allowed.test", "127.0.0.2"]).await;
    let port = origin.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let roots = origin.write_ca(dir.path());
    let dns = egress_e2e::dns::FakeDns::start().await;
    let text = format!(
        "{}\n[proxy.interception]\nupstream_ca_file = \"{}\"\n{}inspect = true\n",
        proxy_section(&dns, ""),
        roots.display(),
        tools(port)
    );
    let p = TestProxy::start_config(
        dns,
        &text,
        None,
        Some(std::sync::Arc::new(egress_proxy::facts::MemorySink::new(10_000))),
    )
    .await;
    names(&p);
    let run = p.run("web").await;
    let (_, ca) = p.control("GET", "/v1/ca", None).await;
    let ca = ca["pem"].as_str().unwrap();
    for (host, port, want) in cases(port) {
        let authority = authority(host, port);
        for h2 in [false, true] {
            let got = intercepted(&p, &run, ca, &authority, h2).await;
            assert_eq!(got, want, "inside {authority} (h2: {h2})");
        }
    }
    let served = cases(port).iter().filter(|c| c.2 == Decided::Allowed).count() * 2;
    assert_eq!(
        origin.heads().len(),
        served,
        "each allowed request, and only those, reached the origin"
    );
    only_allowed_names_resolved(&p);
}

#[tokio::test]
async fn socks5_authenticates_the_run_and_speaks_connect_only() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let dest = Dest::Name("allowed.test".into(), port);
    // No username/password offered: no acceptable method, and a fact.
    assert!(matches!(
        socks::negotiate(p.proxy, ("", ""), &[0], 1, &dest).await,
        Outcome::Method(0xff)
    ));
    // A wrong secret, an unknown run: refused, the wrong secret filed under the run.
    for (user, pass) in [(run.id.as_str(), "wrong"), ("no-such-run", run.secret.as_str())] {
        assert!(matches!(
            socks::negotiate(p.proxy, (user, pass), &[2], 1, &dest).await,
            Outcome::Auth(1)
        ));
    }
    let facts = p.facts().await;
    assert!(facts.iter().any(|f| f.reason == "auth_missing"));
    assert!(facts
        .iter()
        .any(|f| f.reason == "auth_invalid" && f.run_id.as_deref() == Some(&run.id)));
    assert_eq!(facts.iter().filter(|f| f.reason == "auth_invalid").count(), 2);
    // BIND and UDP ASSOCIATE: not supported, and a fact.
    for cmd in [2u8, 3] {
        match socks::negotiate(p.proxy, (&run.id, &run.secret), &[2], cmd, &dest).await {
            Outcome::Reply(7, _) => {}
            other => panic!("command {cmd}: {other:?}"),
        }
    }
    let facts = p.facts().await;
    let refused: Vec<_> = facts.iter().filter(|f| f.reason == "method_not_allowed").collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[0].detail.contains("BIND") && refused[1].detail.contains("UDP ASSOCIATE"));
    // An undefined address type.
    match socks::negotiate(p.proxy, (&run.id, &run.secret), &[2], 1, &Dest::Undefined(9)).await {
        Outcome::Reply(8, _) => {}
        other => panic!("{other:?}"),
    }
    assert!(p.facts().await.iter().any(|f| f.reason == "bad_target"));
    assert_eq!(
        origin.hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing reached the origin"
    );
    // The run's end: the credential no longer works.
    p.end(&run).await;
    let (code, _) = socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    assert_eq!(code, 2);
    assert!(p.facts().await.iter().any(|f| f.reason == "run_ended"));
}

/// curl, a real SOCKS5 client, through the proxy with the run's credential:
/// an allowed name goes through (and is resolved by the proxy, never by
/// curl), a denied one is refused.
#[tokio::test]
async fn curl_speaks_socks5_through_the_proxy() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let proxy = format!("socks5h://{}:{}@{}", run.id, run.secret, p.proxy);
    let curl = |url: String| {
        let proxy = proxy.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "10",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "--proxy",
                    &proxy,
                    &url,
                ])
                .output()
                .unwrap()
        })
    };
    let out = curl(format!("http://allowed.test:{port}/")).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = curl(format!("http://denied.test:{port}/")).await.unwrap();
    assert!(!out.status.success());
    assert!(p
        .facts()
        .await
        .iter()
        .any(|f| f.reason == "not_allowlisted" && f.target.as_ref().is_some_and(|t| t.host == "denied.test")));
    assert!(!p.dns.queries().iter().any(|q| q.starts_with("denied.test")));
    // HTTP on the same port is unaffected.
    let r = send(
        p.proxy,
        format!(
            "GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
            run.auth()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
}
