//! Attacks on the decision path: authentication, run state, target
//! canonicalization, IP literals, allowlist-before-DNS, resolve-and-pin,
//! denied ranges, DNS rebinding, self-loops and report mode. Each test
//! asserts status, reason header, fact, and (where it matters) that no DNS
//! query or connection happened.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, TestProxy};
use egress_e2e::netns::isolated;
use egress_e2e::origin::{canary, echo_origin, http_origin, port_free_on};
use egress_e2e::raw::{connect, echo_through, send};
use serde_json::json;

fn tools(port: u16) -> String {
    format!(
        r#"
[tools.web]
egress = ["allowed.test:{port}", "*.cdn.test:{port}", "127.0.0.2:{port}", "loopy.test:{port}"]
fetch_timeout_ms = 5000
"#
    )
}

#[tokio::test]
async fn missing_and_wrong_credentials_get_407_and_a_fact() {
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&tools(origin.addr.port())).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let url = format!("http://allowed.test:{}/", origin.addr.port());
    let host = format!("allowed.test:{}", origin.addr.port());
    let run = p.run("web").await;

    let r = send(
        p.proxy,
        format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 407);
    assert_eq!(r.deny_reason(), Some("auth_missing"));
    assert!(r.header("proxy-authenticate").unwrap().starts_with("Basic"));

    let cases = [
        basic(&run.id, "wrong"),
        basic(&run.id, &run.secret[..run.secret.len() - 1]),
        basic("no-such-run", &run.secret),
        "Basic !!!notbase64".to_owned(),
        format!("Bearer {}", run.secret),
        "Basic".to_owned(),
        basic(&format!("{}:{}", run.id, run.secret), ""),
    ];
    for auth in &cases {
        let req =
            format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n");
        let r = send(p.proxy, req.as_bytes()).await;
        assert_eq!(r.status, 407, "{auth}");
        assert_eq!(r.deny_reason(), Some("auth_invalid"), "{auth}");
    }
    // CONNECT without credentials, too.
    let (r, _) = connect(p.proxy, &host, None).await;
    assert_eq!(r.status, 407);
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(p.dns.queries().is_empty(), "no DNS before authentication");
    let facts = p.facts().await;
    assert_eq!(facts.iter().filter(|f| f.reason == "auth_missing").count(), 2);
    assert_eq!(facts.iter().filter(|f| f.reason == "auth_invalid").count(), cases.len());
    // A wrong secret for a known run is attributed to that run.
    assert!(facts
        .iter()
        .any(|f| f.reason == "auth_invalid" && f.run_id.as_deref() == Some(&run.id)));
    // The right credential works and is never forwarded.
    let r = p
        .get(&run, &format!("http://allowed.test:{}/headers", origin.addr.port()), "")
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        !r.text().to_ascii_lowercase().contains("proxy-authorization"),
        "{}",
        r.text()
    );
}

/// The executor sends a run's activation beside the invocation, so the
/// child's first fetch may reach the proxy first: it is held (no DNS, no
/// connection to the origin) until the activation lands, then goes on; a
/// fetch whose run is not activated within `activation_wait_ms` is denied,
/// and one whose run ends while it waits is denied at once.
#[tokio::test]
async fn a_fetch_of_a_created_run_waits_for_its_activation_and_never_goes_out_before() {
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start_with("activation_wait_ms = 3000", &tools(origin.addr.port()), None).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let url = format!("http://allowed.test:{}/", origin.addr.port());
    let created = |id: &'static str| p.run_with(json!({"tool": "web", "run_id": id, "activate": false}));

    // Activated while the fetch waits: it goes through, and only after.
    let run = created("held-then-active").await;
    let fetch = p.get(&run, &url, "");
    let activate = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(p.dns.queries().is_empty(), "no DNS while the run is not active");
        assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
        let (s, _) = p.control("POST", "/v1/runs/held-then-active/activate", None).await;
        assert_eq!(s, 200);
    };
    let (r, ()) = tokio::join!(fetch, activate);
    assert_eq!((r.status, r.text()), (200, "hello from origin".to_owned()));
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 1);

    // Ended while it waits: denied at once, with the run's state.
    let run = created("held-then-ended").await;
    let fetch = p.get(&run, &url, "");
    let end = async {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let (s, _) = p.control("DELETE", "/v1/runs/held-then-ended", None).await;
        assert_eq!(s, 200);
    };
    let t0 = std::time::Instant::now();
    let (r, ()) = tokio::join!(fetch, end);
    assert_eq!((r.status, r.deny_reason()), (403, Some("run_ended")));
    assert!(
        t0.elapsed() < std::time::Duration::from_millis(2500),
        "not held past the end"
    );
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    let facts = p.facts().await;
    assert!(facts.iter().all(|f| f.reason != "run_not_active"), "{facts:#?}");
}

#[tokio::test]
async fn run_lifecycle_gates_egress() {
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&tools(origin.addr.port())).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let url = format!("http://allowed.test:{}/", origin.addr.port());
    let run = p
        .run_with(json!({"tool": "web", "run_id": "kernel-run-1", "activate": false}))
        .await;
    assert_eq!(run.id, "kernel-run-1");

    let r = p.get(&run, &url, "").await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("run_not_active")));
    assert!(p.dns.queries().is_empty(), "a created run must not trigger DNS");

    let (s, v) = p.control("POST", "/v1/runs/kernel-run-1/activate", None).await;
    assert_eq!((s, v["state"].as_str()), (200, Some("active")));
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "hello from origin");

    p.end(&run).await;
    let r = p.get(&run, &url, "").await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("run_ended")));
    let (s, _) = p.control("POST", "/v1/runs/kernel-run-1/activate", None).await;
    assert_eq!(s, 409, "an ended run cannot be re-activated");
    let facts = p.facts().await;
    let reasons: Vec<_> = facts.iter().map(|f| f.reason.as_str()).collect();
    assert_eq!(reasons, ["run_not_active", "run_ended"]);
    assert!(facts
        .iter()
        .all(|f| f.run_id.as_deref() == Some("kernel-run-1") && f.tool.as_deref() == Some("web")));
}

#[tokio::test]
async fn runs_expire_after_max_run_ms() {
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start_with("max_run_ms = 1000", &tools(origin.addr.port()), None).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let url = format!("http://allowed.test:{}/", origin.addr.port());
    assert_eq!(p.get(&run, &url, "").await.status, 200);
    let t0 = std::time::Instant::now();
    loop {
        let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
        if v["state"] == "ended" {
            assert_eq!(v["end_reason"], "expired");
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "run never expired");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let r = p.get(&run, &url, "").await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("run_ended")));
}

#[tokio::test]
async fn ip_literals_in_every_spelling_are_denied_without_dns() {
    let p = TestProxy::start(&tools(8080)).await;
    let run = p.run("web").await;
    let spellings = [
        "10.0.0.1",
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0x7f.1",
        "0x7f000001",
        "0177.0.0.1",
        "017700000001",
        "127.0.0.1.",
        "[::1]",
        "[::ffff:7f00:1]",
        "[::ffff:127.0.0.1]",
        "[0:0:0:0:0:ffff:7f00:1]",
        "169.254.169.254",
        "0xa9.0xfe.0xa9.0xfe",
        "[fe80::1]",
        "0",
        "127.0.0.3",
        "[64:ff9b::7f00:1]",
    ];
    for host in spellings {
        let (r, _) = p.connect(&run, &format!("{host}:8080")).await;
        assert_eq!((r.status, r.deny_reason()), (403, Some("ip_literal")), "CONNECT {host}");
        let r = p.get(&run, &format!("http://{host}:8080/"), "").await;
        assert_eq!((r.status, r.deny_reason()), (403, Some("ip_literal")), "GET {host}");
    }
    assert!(
        p.dns.queries().is_empty(),
        "IP literals must not cause DNS: {:?}",
        p.dns.queries()
    );
    let facts = p.facts().await;
    assert_eq!(facts.len(), spellings.len() * 2);
    assert!(facts.iter().all(|f| f.reason == "ip_literal" && f.resolved.is_empty()));
}

#[tokio::test]
async fn an_exactly_listed_ip_literal_is_allowed() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&tools(echo.port())).await;
    let run = p.run("web").await;
    for spelling in ["127.0.0.2", "0x7f000002", "[::ffff:127.0.0.2]"] {
        let (r, mut s) = p.connect(&run, &format!("{spelling}:{}", echo.port())).await;
        assert_eq!(r.status, 200, "{spelling}");
        assert_eq!(echo_through(&mut s, b"ping").await, b"ping");
    }
    // Listed address, other port: denied.
    let (r, _) = p.connect(&run, &format!("127.0.0.2:{}", echo.port() ^ 1)).await;
    assert_eq!(r.deny_reason(), Some("ip_literal"));
}

#[tokio::test]
async fn malformed_targets_are_bad_target() {
    let p = TestProxy::start(&tools(443)).await;
    let run = p.run("web").await;
    let a = run.auth();
    let cases: Vec<String> = vec![
        "CONNECT allowed.test HTTP/1.1\r\nHost: allowed.test\r\n".into(),
        "CONNECT allowed.test:0 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT allowed.test:65536 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT allowed.test:+443 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT user@allowed.test:443 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT allowed%2etest:443 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT [allowed.test]:443 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT allowed..test:443 HTTP/1.1\r\nHost: x\r\n".into(),
        "CONNECT 256.1.1.1:443 HTTP/1.1\r\nHost: x\r\n".into(),
        "GET /relative HTTP/1.1\r\nHost: allowed.test\r\n".into(),
        "GET https://allowed.test:443/ HTTP/1.1\r\nHost: allowed.test:443\r\n".into(),
        "GET http://user:pw@allowed.test:443/ HTTP/1.1\r\nHost: allowed.test:443\r\n".into(),
        "GET http://allowed.test:0/ HTTP/1.1\r\nHost: allowed.test:0\r\n".into(),
    ];
    for head in &cases {
        let req = format!("{head}Proxy-Authorization: {a}\r\nConnection: close\r\n\r\n");
        let r = send(p.proxy, req.as_bytes()).await;
        // hyper itself rejects some of these at parse time with a bare 400.
        assert_eq!(r.status, 400, "{head}");
        if let Some(reason) = r.deny_reason() {
            assert_eq!(reason, "bad_target", "{head}");
        }
    }
    assert!(p.dns.queries().is_empty());
    let facts = p.facts().await;
    assert!(
        facts.len() >= cases.len() - 4,
        "most malformed targets reach the proxy and leave a fact"
    );
    assert!(facts.iter().all(|f| f.reason == "bad_target"));
}

#[tokio::test]
async fn host_header_must_name_the_target() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    p.dns.set("evil.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let a = run.auth();
    let cases = [
        format!("GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: evil.test:{port}\r\n"),
        format!("GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test\r\n"),
        format!("GET http://allowed.test:{port}/ HTTP/1.1\r\n"),
        format!("GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\nHost: evil.test:{port}\r\n"),
    ];
    for head in &cases {
        let r = send(
            p.proxy,
            format!("{head}Proxy-Authorization: {a}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!((r.status, r.deny_reason()), (400, Some("host_mismatch")), "{head}");
    }
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(p.dns.queries().is_empty());
    // The regenerated Host is the canonical target.
    let r = send(
        p.proxy,
        format!("GET http://ALLOWED.test.:{port}/headers HTTP/1.1\r\nHost: allowed.TEST:{port}\r\nProxy-Authorization: {a}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains(&format!("host: allowed.test:{port}")), "{}", r.text());
    assert!(
        r.text().starts_with("GET /headers "),
        "origin-form upstream: {}",
        r.text()
    );
}

#[tokio::test]
async fn allowlist_is_checked_before_any_dns_query() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    p.dns.set("a.cdn.test", &["127.0.0.2"]);
    p.dns.set("evil.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let denied = [
        format!("evil.test:{port}"),
        format!("allowed.test:{}", port ^ 1),
        format!("cdn.test:{port}"),
        format!("allowed.test.evil.test:{port}"),
        format!("xallowed.test:{port}"),
    ];
    for t in &denied {
        let (r, _) = p.connect(&run, t).await;
        assert_eq!((r.status, r.deny_reason()), (403, Some("not_allowlisted")), "{t}");
    }
    assert!(
        p.dns.queries().is_empty(),
        "denied names were looked up: {:?}",
        p.dns.queries()
    );
    for t in [
        format!("allowed.test:{port}"),
        format!("A.CDN.test:{port}"),
        format!("a.cdn.test.:{port}"),
    ] {
        let (r, mut s) = p.connect(&run, &t).await;
        assert_eq!(r.status, 200, "{t}");
        assert_eq!(echo_through(&mut s, b"hello tunnel").await, b"hello tunnel");
    }
    let facts = p.facts().await;
    assert_eq!(facts.len(), denied.len());
    assert_eq!(facts[0].target.as_ref().unwrap().host, "evil.test");
    assert_eq!(facts[0].target.as_ref().unwrap().kind, "connect");
}

#[tokio::test]
async fn names_resolving_to_denied_loopback_are_private_address() {
    let can = canary("127.0.0.1:0").await;
    let port = can.addr.port();
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.1"]);
    let run = p.run("web").await;
    let (r, _) = p.connect(&run, &format!("allowed.test:{port}")).await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("private_address")));
    let r = p.get(&run, &format!("http://allowed.test:{port}/"), "").await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("private_address")));
    assert_eq!(can.connections(), 0, "the proxy dialled a denied address");
    let facts = p.facts().await;
    assert_eq!(facts.len(), 2);
    assert_eq!(facts[0].resolved, ["127.0.0.1"]);
}

#[tokio::test]
async fn mixed_answers_dial_only_vetted_addresses() {
    // allowed.test answers a denied address first, then an allowed one.
    let port = port_free_on(&["127.0.0.2", "127.0.0.1"]);
    let _origin = http_origin(&format!("127.0.0.2:{port}")).await;
    let can = canary(&format!("127.0.0.1:{port}")).await;
    let p = TestProxy::start(&tools(port)).await;
    p.dns.set("allowed.test", &["127.0.0.1", "127.0.0.2"]);
    let run = p.run("web").await;
    for _ in 0..5 {
        let r = p.get(&run, &format!("http://allowed.test:{port}/"), "").await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(can.connections(), 0);
}

#[tokio::test]
async fn dns_rebinding_never_reaches_the_denied_address() {
    // Same port on an allowed (127.0.0.2) and a denied (127.0.0.3) address;
    // the name alternates between them with TTL 0.
    let port = port_free_on(&["127.0.0.2", "127.0.0.3"]);
    let _origin = http_origin(&format!("127.0.0.2:{port}")).await;
    let can = canary(&format!("127.0.0.3:{port}")).await;
    let p = TestProxy::start(&tools(port)).await;
    p.dns.rotate("allowed.test", &[&["127.0.0.2"], &["127.0.0.3"]], 0);
    let run = p.run("web").await;
    let (mut ok, mut denied) = (0, 0);
    for i in 0..20 {
        let r = if i % 2 == 0 {
            p.get(&run, &format!("http://allowed.test:{port}/"), "").await
        } else {
            let (r, _) = p.connect(&run, &format!("allowed.test:{port}")).await;
            r
        };
        match (r.status, r.deny_reason()) {
            (200, _) => ok += 1,
            (403, Some("private_address")) => denied += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(can.connections(), 0, "a rebinding answer was dialled");
    assert!(ok > 0 && denied > 0, "both answers were seen: ok={ok} denied={denied}");
    assert!(
        p.dns.queries().len() >= 20,
        "TTL 0 answers are looked up again per fetch"
    );
}

#[tokio::test]
async fn the_proxy_never_connects_to_itself() {
    // Loopback is fully allowed here; the self-loop rule must still hold.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen_port = free.local_addr().unwrap().port();
    drop(free);
    let dns = egress_e2e::FakeDns::start().await;
    let tools = format!(
        "[tools.web]\negress = [\"loopy.test:{listen_port}\", \"127.0.0.1:{listen_port}\", {{ host = \"private.test\", port = {listen_port}, private = true }}]\n"
    );
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:{listen_port}\"\ncontrol = \"127.0.0.1:0\"\nallow_ranges = [\"127.0.0.0/8\"]\n[proxy.dns]\nservers = [\"{}\"]\n{tools}",
        dns.addr
    );
    let facts = std::sync::Arc::new(egress_proxy::facts::MemorySink::new(100));
    let p = TestProxy::start_config(dns.clone(), &text, None, Some(facts)).await;
    dns.set("loopy.test", &["127.0.0.1"]);
    dns.set("private.test", &["127.0.0.1"]);
    let run = p.run("web").await;
    for t in [
        format!("loopy.test:{listen_port}"),
        format!("127.0.0.1:{listen_port}"),
        format!("private.test:{listen_port}"),
    ] {
        let (r, _) = p.connect(&run, &t).await;
        assert_eq!((r.status, r.deny_reason()), (403, Some("self_loop")), "{t}");
    }
}

#[tokio::test]
async fn report_mode_allows_and_records() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"allowed.test:{port}\"]\nmode = \"report\"\n"
    ))
    .await;
    p.dns.set("other.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let r = p.get(&run, &format!("http://other.test:{port}/"), "").await;
    assert_eq!(r.status, 200, "report mode lets it through");
    let facts = p.facts().await;
    assert_eq!(facts.len(), 1);
    assert_eq!(
        (facts[0].reason.as_str(), facts[0].mode.as_str()),
        ("not_allowlisted", "report")
    );
    // Authentication is never waived.
    let r = send(
        p.proxy,
        format!("GET http://other.test:{port}/ HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 407);
}

#[tokio::test]
async fn a_removed_tool_denies_its_runs() {
    // A run whose tool is not in the policy (e.g. removed by reload) gets nothing.
    let p = TestProxy::start(&tools(80)).await;
    let (s, v) = p.control("POST", "/v1/runs", Some(json!({"tool": "nope"}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("unknown_tool")));
}

/// Non-loopback answers (metadata, private, NAT64, 6to4, Teredo, IPv4-mapped)
/// run inside a network namespace holding only `lo`.
#[tokio::test]
async fn non_loopback_private_answers_are_denied_in_an_isolated_netns() {
    if !isolated("non_loopback_private_answers_are_denied_in_an_isolated_netns") {
        return;
    }
    let p = TestProxy::start(&tools(443)).await;
    let answers: &[&[&str]] = &[
        &["10.0.0.1"],
        &["169.254.169.254"],
        &["100.64.0.1"],
        &["172.16.5.4"],
        &["192.168.1.1"],
        &["198.18.0.1"],
        &["224.0.0.1"],
        &["0.0.0.0"],
        &["::ffff:169.254.169.254"],
        &["::ffff:10.0.0.1"],
        &["::a9fe:a9fe"],
        &["64:ff9b::a9fe:a9fe"],
        &["64:ff9b:1::1"],
        &["2002:a9fe:a9fe::1"],
        &["2001:0:4136:e378:8000:63bf:3fff:fdd2"],
        &["fd00::1"],
        &["fe80::1"],
        &["::1"],
        &["10.0.0.1", "fd00::2", "169.254.169.254"],
    ];
    let run = p.run("web").await;
    for (i, set) in answers.iter().enumerate() {
        let name = format!("h{i}.cdn.test");
        p.dns.set(&name, set);
        let (r, _) = p.connect(&run, &format!("{name}:443")).await;
        assert_eq!((r.status, r.deny_reason()), (403, Some("private_address")), "{set:?}");
    }
    let facts = p.facts().await;
    assert_eq!(facts.len(), answers.len());
    assert!(facts
        .iter()
        .all(|f| f.reason == "private_address" && !f.resolved.is_empty()));
}

/// A listener on the unspecified address is reachable through every local
/// address, not only loopback: the post-connect check must catch it. Runs in
/// an isolated namespace, where `lo` is given a private address of its own.
#[tokio::test]
async fn self_loop_through_a_non_loopback_local_address_is_caught_in_an_isolated_netns() {
    if !isolated("self_loop_through_a_non_loopback_local_address_is_caught_in_an_isolated_netns") {
        return;
    }
    let ok = std::process::Command::new("ip")
        .args(["addr", "add", "10.9.9.9/32", "dev", "lo"])
        .status()
        .unwrap();
    assert!(ok.success(), "cannot add an address to lo inside the namespace");
    let port = port_free_on(&["0.0.0.0"]);
    let dns = egress_e2e::FakeDns::start().await;
    let text = format!(
        "[proxy]\nlisten = \"0.0.0.0:{port}\"\ncontrol = \"127.0.0.1:0\"\nallow_ranges = [\"10.9.9.9/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n[tools.web]\negress = [\"me.test:{port}\"]\n",
        dns.addr
    );
    dns.set("me.test", &["10.9.9.9"]);
    let facts = std::sync::Arc::new(egress_proxy::facts::MemorySink::new(100));
    let p = TestProxy::start_config(dns, &text, None, Some(facts)).await;
    let run = p.run("web").await;
    let (r, _) = p.connect(&run, &format!("me.test:{port}")).await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("self_loop")));
}
