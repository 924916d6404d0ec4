//! The kernel-facing control API: listing runs by filter with paging, ending
//! a run and collecting its denials in one call, run owners whose lease ends
//! their runs when it expires, and a graceful stop a load balancer can watch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::TestProxy;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const TOOLS: &str = "[tools.web]\negress = []\n[tools.other]\negress = []\n";

#[tokio::test]
async fn runs_are_listed_by_tool_state_owner_and_label_with_paging() {
    let p = TestProxy::start(TOOLS).await;
    let (s, _) = p
        .control("PUT", "/v1/owners/kernel-a", Some(json!({"lease_ms": 60000})))
        .await;
    assert_eq!(s, 200);
    for i in 0..5 {
        p.run_with(json!({"tool": "web", "run_id": format!("w{i}"), "labels": {"kernel": "k1"}, "owner": "kernel-a"}))
            .await;
    }
    p.run_with(json!({"tool": "other", "run_id": "o1", "activate": false, "labels": {"kernel": "k2"}}))
        .await;
    let (_, v) = p.control("DELETE", "/v1/runs/w4", None).await;
    assert_eq!(v["state"], "ended");
    let ids = |v: &Value| -> Vec<String> {
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["run_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, v) = p.control("GET", "/v1/runs", None).await;
    assert_eq!(ids(&v), ["o1", "w0", "w1", "w2", "w3", "w4"]);
    let (_, v) = p.control("GET", "/v1/runs?tool=web&state=active", None).await;
    assert_eq!(ids(&v), ["w0", "w1", "w2", "w3"]);
    let (_, v) = p.control("GET", "/v1/runs?state=created", None).await;
    assert_eq!(ids(&v), ["o1"]);
    let (_, v) = p.control("GET", "/v1/runs?owner=kernel-a&state=ended", None).await;
    assert_eq!(ids(&v), ["w4"]);
    let (_, v) = p.control("GET", "/v1/runs?label=kernel=k2", None).await;
    assert_eq!(ids(&v), ["o1"]);
    // Paging: two at a time until `next` is null.
    let mut all = vec![];
    let mut after = String::new();
    loop {
        let (_, v) = p.control("GET", &format!("/v1/runs?limit=2&after={after}"), None).await;
        all.extend(ids(&v));
        match v["next"].as_str() {
            Some(n) => after = n.to_owned(),
            None => break,
        }
    }
    assert_eq!(all, ["o1", "w0", "w1", "w2", "w3", "w4"]);
    for bad in ["state=sleeping", "label=nokey", "limit=x", "color=red"] {
        let (s, v) = p.control("GET", &format!("/v1/runs?{bad}"), None).await;
        assert_eq!(s, 400, "{bad}: {v}");
    }
}

#[tokio::test]
async fn ending_a_run_answers_with_its_facts_and_a_denial_summary() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("web").await;
    for _ in 0..3 {
        p.get(&run, "http://evil.test/", "").await;
    }
    p.get(&run, "http://10.0.0.1/", "").await;
    let (s, v) = p.control("DELETE", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(s, 200);
    assert_eq!(v["state"], "ended");
    assert_eq!(v["denials"]["total"], 4, "{v}");
    assert_eq!(v["denials"]["by_reason"]["not_allowlisted"], 3);
    assert_eq!(v["denials"]["by_reason"]["ip_literal"], 1);
    let facts = v["facts"].as_array().unwrap();
    assert!(facts.iter().all(|f| f["run_id"] == run.id.as_str()));
    assert_eq!(facts.iter().map(|f| f["count"].as_u64().unwrap()).sum::<u64>(), 4);
    assert_eq!(v["facts_truncated"], false);
}

#[tokio::test]
async fn an_owner_whose_lease_expires_has_its_runs_ended() {
    let p = TestProxy::start(TOOLS).await;
    // A run cannot name an owner without a lease.
    let (s, v) = p
        .control("POST", "/v1/runs", Some(json!({"tool": "web", "owner": "ghost"})))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (409, Some("owner_not_leased")));
    let (s, _) = p
        .control("PUT", "/v1/owners/crashy", Some(json!({"lease_ms": 1000})))
        .await;
    assert_eq!(s, 200);
    let (s, _) = p
        .control("PUT", "/v1/owners/alive", Some(json!({"lease_ms": 1000})))
        .await;
    assert_eq!(s, 200);
    let doomed = p.run_with(json!({"tool": "web", "owner": "crashy"})).await;
    let warm = p
        .run_with(json!({"tool": "web", "owner": "crashy", "activate": false}))
        .await;
    let kept = p.run_with(json!({"tool": "web", "owner": "alive"})).await;
    let free = p.run("web").await;
    let t0 = Instant::now();
    // "alive" heartbeats, "crashy" does not.
    while t0.elapsed() < Duration::from_millis(2000) {
        let (s, _) = p
            .control("PUT", "/v1/owners/alive", Some(json!({"lease_ms": 1000})))
            .await;
        assert_eq!(s, 200);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for (run, state) in [
        (&doomed, "ended"),
        (&warm, "ended"),
        (&kept, "active"),
        (&free, "active"),
    ] {
        let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
        assert_eq!(v["state"], state, "{v}");
        if state == "ended" {
            assert_eq!(v["end_reason"], "lease_expired");
        }
    }
    assert_eq!(
        p.get(&doomed, "http://evil.test/", "").await.deny_reason(),
        Some("run_ended")
    );
    let m = p.metrics().await;
    assert_eq!(
        egress_e2e::harness::sample(&m, "egress_runs_ended_total{tool=\"web\",why=\"lease_expired\"}"),
        2.0
    );
    // Releasing an owner ends its runs at once.
    let (s, v) = p.control("DELETE", "/v1/owners/alive", None).await;
    assert_eq!((s, v["ended"].as_u64()), (200, Some(1)));
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", kept.id), None).await;
    assert_eq!(
        (v["state"].as_str(), v["end_reason"].as_str()),
        (Some("ended"), Some("owner_released"))
    );
    let (s, _) = p.control("PUT", "/v1/owners/x", Some(json!({"lease_ms": 5}))).await;
    assert_eq!(s, 400);
}

#[tokio::test]
async fn a_graceful_stop_answers_readyz_503_while_it_drains() {
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let mut p = TestProxy::start_with(
        "drain_timeout_ms = 3000",
        &format!("[tools.web]\negress = [\"allowed.test:{port}\"]\nfetch_timeout_ms = 10000\n"),
        None,
    )
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    // An in-flight fetch that takes 1.5 s.
    let (proxy, auth) = (p.proxy, run.auth());
    let inflight = tokio::spawn(async move {
        let req = format!(
            "GET http://allowed.test:{port}/slow-head?ms=1500 HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n"
        );
        egress_e2e::raw::send(proxy, req.as_bytes()).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let handle = p.handle.take().unwrap();
    let stop = tokio::spawn(handle.shutdown());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Draining: not ready, but the control API still answers; no new data connections.
    let r = p.control_raw("GET", "/readyz", None, None).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let (s, _) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(s, 200);
    assert!(
        tokio::net::TcpStream::connect(p.proxy).await.is_err(),
        "the data listener still accepts during the drain"
    );
    let r = inflight.await.unwrap();
    assert_eq!(r.status, 200, "the in-flight fetch was not allowed to finish");
    stop.await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(p.control).await.is_err(),
        "control still open after the stop"
    );
}

#[tokio::test]
async fn every_bounded_series_exists_at_zero_and_runs_are_gauged_by_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.toml");
    let dns = egress_e2e::FakeDns::start().await;
    let text = format!("{}\n{TOOLS}", egress_e2e::harness::proxy_section(&dns, ""));
    std::fs::write(&path, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(path.clone()), None).await;
    let m = p.metrics().await;
    for series in [
        "egress_fetch_errors_total{tool=\"web\",reason=\"dns_failed\"}",
        "egress_fetch_errors_total{tool=\"_unknown\",reason=\"timeout\"}",
        "egress_dns_failures_total{kind=\"not_found\"}",
        "egress_auth_failures_total{reason=\"auth_invalid\"}",
        "egress_runs_ended_total{tool=\"other\",why=\"lease_expired\"}",
        "egress_denials_total{tool=\"_unknown\",reason=\"auth_missing\"}",
        "egress_runs_active{tool=\"web\",state=\"created\"}",
        "egress_reloads_total{outcome=\"error\"}",
        "egress_connections_closed_total{listener=\"control\",reason=\"evicted\"}",
    ] {
        assert!(
            m.lines().any(|l| l.starts_with(&format!("{series} 0"))),
            "{series} missing at start:\n{m}"
        );
    }
    let digest = |m: &str| {
        m.lines()
            .filter(|l| l.starts_with("egress_config_info{"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let before = digest(&m);
    assert_eq!(before.len(), 1, "{before:?}");
    assert!(before[0].ends_with(" 1"));
    // created → active → ended moves the gauges.
    let g = |m: &str, state: &str| {
        egress_e2e::harness::sample(m, &format!("egress_runs_active{{tool=\"web\",state=\"{state}\"}}"))
    };
    let run = p.run_with(json!({"tool": "web", "activate": false})).await;
    let m = p.metrics().await;
    assert_eq!((g(&m, "created"), g(&m, "active")), (1.0, 0.0));
    p.control("POST", &format!("/v1/runs/{}/activate", run.id), None).await;
    let m = p.metrics().await;
    assert_eq!((g(&m, "created"), g(&m, "active")), (0.0, 1.0));
    p.end(&run).await;
    let m = p.metrics().await;
    assert_eq!((g(&m, "created"), g(&m, "active")), (0.0, 0.0));
    // Reloads are counted by outcome and the digest follows the policy.
    std::fs::write(
        &path,
        text.replace("[tools.other]", "[tools.third]\negress = []\n[tools.other]"),
    )
    .unwrap();
    let (s, _) = p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(s, 200);
    std::fs::write(&path, "[tools.broken\n").unwrap();
    let (s, _) = p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(s, 422);
    let m = p.metrics().await;
    assert_eq!(
        egress_e2e::harness::sample(&m, "egress_reloads_total{outcome=\"ok\"}"),
        1.0
    );
    assert_eq!(
        egress_e2e::harness::sample(&m, "egress_reloads_total{outcome=\"error\"}"),
        1.0
    );
    let after = digest(&m);
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after, before, "the digest did not follow the reload");
}

/// A run created before a `kill -9` of the proxy works after its restart: its
/// credential authenticates, a warm run can still be activated, an ended run
/// stays ended, the secret is nowhere in the store, and the answers name a
/// new proxy instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_survive_a_proxy_restart_and_the_store_never_holds_a_secret() {
    use egress_e2e::harness::{basic, control_call, TOKEN};
    use egress_e2e::process::{free_addr, write_config, ProxyProcess};
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, "[tools.web]\negress = []\n");
    let mut p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let call = |m: &'static str, path: String, body: Option<Value>| async move {
        let r = control_call(control, m, &path, body, Some(TOKEN)).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        (r.status, v, r.header("x-egress-instance").map(str::to_owned))
    };
    let (s, _, _) = call("PUT", "/v1/owners/exec-1".into(), Some(json!({"lease_ms": 60000}))).await;
    assert_eq!(s, 200);
    let (s, live, inst1) = call(
        "POST",
        "/v1/runs".into(),
        Some(json!({"tool": "web", "owner": "exec-1", "labels": {"k": "v"}})),
    )
    .await;
    assert_eq!(s, 201);
    let (_, warm, _) = call(
        "POST",
        "/v1/runs".into(),
        Some(json!({"tool": "web", "activate": false})),
    )
    .await;
    let (_, gone, _) = call("POST", "/v1/runs".into(), Some(json!({"tool": "web"}))).await;
    let (s, _, _) = call("DELETE", format!("/v1/runs/{}", gone["run_id"].as_str().unwrap()), None).await;
    assert_eq!(s, 200);
    let deny = |run: &Value| {
        let auth = basic(run["run_id"].as_str().unwrap(), run["secret"].as_str().unwrap());
        async move {
            let req = format!("GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n");
            egress_e2e::raw::send(proxy, req.as_bytes()).await
        }
    };
    assert_eq!(deny(&live).await.deny_reason(), Some("not_allowlisted"));
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(5));
    let db = std::fs::read(dir.path().join("facts.db")).unwrap();
    let wal = std::fs::read(dir.path().join("facts.db-wal")).unwrap_or_default();
    for run in [&live, &warm, &gone] {
        let secret = run["secret"].as_str().unwrap().as_bytes();
        for file in [&db, &wal] {
            assert!(
                !file.windows(secret.len()).any(|w| w == secret),
                "a run secret is in the store"
            );
        }
    }
    let _p2 = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let (s, v, inst2) = call("GET", format!("/v1/runs/{}", live["run_id"].as_str().unwrap()), None).await;
    assert_eq!(
        (s, v["state"].as_str(), v["owner"].as_str()),
        (200, Some("active"), Some("exec-1")),
        "{v}"
    );
    assert_eq!(v["labels"]["k"], "v");
    assert_ne!(inst1, inst2, "the instance id did not change across the restart");
    assert!(inst2.is_some());
    assert_eq!(
        deny(&live).await.deny_reason(),
        Some("not_allowlisted"),
        "the credential no longer works"
    );
    assert_eq!(deny(&warm).await.deny_reason(), Some("run_not_active"));
    let (s, _, _) = call(
        "POST",
        format!("/v1/runs/{}/activate", warm["run_id"].as_str().unwrap()),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(deny(&warm).await.deny_reason(), Some("not_allowlisted"));
    // A wrong secret is still refused; an ended run stays gone.
    let wrong = json!({"run_id": live["run_id"], "secret": "0".repeat(48)});
    assert_eq!(deny(&wrong).await.status, 407);
    assert_eq!(deny(&gone).await.status, 407);
    // The restored owner has a grace lease to renew.
    let (_, v, _) = call("GET", "/v1/owners".into(), None).await;
    assert_eq!(v["owners"][0]["owner"], "exec-1", "{v}");
}

/// The OpenAPI document is served, is 3.1, lists exactly the routes the
/// proxy has, and its schemas reject answers that drift from them (every
/// control call of the tests is checked against it by the harness).
#[tokio::test]
async fn the_openapi_document_lists_every_route_and_its_schemas_bite() {
    let p = TestProxy::start(TOOLS).await;
    let r = p.control_raw("GET", "/v1/openapi.json", None, None).await;
    assert_eq!(r.status, 200);
    let served: Value = serde_json::from_slice(&r.body).unwrap();
    let spec = egress_e2e::harness::openapi();
    assert_eq!(
        &served,
        spec.doc(),
        "the served document differs from the generated one"
    );
    assert_eq!(served["openapi"], "3.1.0");
    let ops: Vec<String> = spec.operations().iter().map(|(m, p)| format!("{m} {p}")).collect();
    assert_eq!(
        ops,
        [
            "GET /healthz",
            "GET /metrics",
            "GET /readyz",
            "GET /v1/audit/checkpoint",
            "GET /v1/ca",
            "GET /v1/cell",
            "GET /v1/decisions",
            "GET /v1/decisions/stream",
            "GET /v1/facts",
            "GET /v1/facts/stream",
            "GET /v1/owners",
            "DELETE /v1/owners/{owner}",
            "PUT /v1/owners/{owner}",
            "GET /v1/policy",
            "POST /v1/policy/diff",
            "POST /v1/policy/reload",
            "POST /v1/policy/replay",
            "GET /v1/runs",
            "POST /v1/runs",
            "DELETE /v1/runs/{id}",
            "GET /v1/runs/{id}",
            "POST /v1/runs/{id}/activate",
            "GET /v1/runs/{id}/decisions",
            "GET /v1/runs/{id}/facts",
            "POST /v1/runs/{id}/grants",
            "POST /v1/runs/{id}/mcp",
            "POST /v1/runs/{id}/mcp/list",
            "POST /v1/tools/{tool}/executable_mismatch",
            "GET /v1/tools/{tool}/suggestion",
        ]
    );
    // Every operation answers something the document lists (the harness asserts it).
    let run = p.run("web").await;
    for (m, path) in [
        ("GET", "/healthz".to_owned()),
        ("GET", "/readyz".to_owned()),
        ("GET", "/v1/runs".to_owned()),
        ("GET", format!("/v1/runs/{}", run.id)),
        ("GET", format!("/v1/runs/{}/facts", run.id)),
        ("GET", "/v1/facts?after=0".to_owned()),
        ("GET", "/v1/owners".to_owned()),
        ("GET", "/v1/policy".to_owned()),
        ("POST", "/v1/policy/reload".to_owned()),
        ("POST", format!("/v1/runs/{}/activate", run.id)),
        ("DELETE", format!("/v1/runs/{}", run.id)),
        ("DELETE", "/v1/owners/nobody".to_owned()),
        ("GET", "/v1/runs/no-such-run".to_owned()),
    ] {
        p.control_raw(m, &path, None, Some(egress_e2e::harness::TOKEN)).await;
    }
    let r = p.control_raw("GET", "/v1/runs", None, None).await;
    assert_eq!(r.status, 401);
    // The schemas bite: a view missing a field, or with one too many, fails.
    let op = spec.operation("GET", "/v1/runs/x").unwrap();
    let (_, mut v) = p.control("GET", "/v1/runs", None).await;
    let mut view = v["runs"][0].take();
    assert!(op.check_response(200, &view).is_empty());
    view.as_object_mut().unwrap().insert("surprise".into(), json!(1));
    assert!(
        !op.check_response(200, &view).is_empty(),
        "an undocumented member passed"
    );
    view.as_object_mut().unwrap().remove("surprise");
    view.as_object_mut().unwrap().remove("tool");
    assert!(!op.check_response(200, &view).is_empty(), "a missing member passed");
    let create = spec.operation("POST", "/v1/runs").unwrap();
    assert!(!create.check_request(&json!({"tool": 5})).is_empty());
    assert!(create
        .check_request(&json!({"tool": "web", "activate": false}))
        .is_empty());
}

/// The document states every rule the control API enforces on a request:
/// each malformed request below is refused, and fails the document too (the
/// harness asserts the second half on every call: a request the document
/// allows must not be refused as malformed). Requests at the bounds pass
/// both, and so does an integer spelled as a whole float.
#[tokio::test]
async fn the_document_states_every_rule_the_control_api_enforces() {
    let p = TestProxy::start(TOOLS).await;
    let id128 = "a".repeat(128);
    let labels = |n: usize| -> Value { (0..n).map(|i| (format!("k{i}"), json!("v"))).collect() };
    let big = u64::MAX.to_string();
    let refused: Vec<(&str, String, Option<Value>)> = vec![
        ("POST", "/v1/runs".into(), Some(json!({"tool": "web", "run_id": "a b"}))),
        ("POST", "/v1/runs".into(), Some(json!({"tool": "web", "run_id": ""}))),
        (
            "POST",
            "/v1/runs".into(),
            Some(json!({"tool": "web", "run_id": "a".repeat(129)})),
        ),
        ("POST", "/v1/runs".into(), Some(json!({"tool": "web", "owner": "µ"}))),
        (
            "POST",
            "/v1/runs".into(),
            Some(json!({"tool": "web", "labels": labels(65)})),
        ),
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 999}))),
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 600001}))),
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 1500.5}))),
        ("PUT", "/v1/owners/a%20b".into(), Some(json!({"lease_ms": 1000}))),
        ("GET", "/v1/runs?state=sleeping".into(), None),
        ("GET", "/v1/runs?label=nokey".into(), None),
        ("GET", "/v1/runs?limit=-1".into(), None),
        ("GET", format!("/v1/runs?limit={big}0"), None),
        ("GET", "/v1/facts?after=9223372036854775808".into(), None),
        ("GET", format!("/v1/facts?limit={big}0"), None),
        ("GET", "/v1/runs/x/facts?after=-1".into(), None),
        ("GET", "/v1/facts?cursor=1".into(), None),
    ];
    for (m, path, body) in refused {
        let r = p
            .control_raw(m, &path, body.clone(), Some(egress_e2e::harness::TOKEN))
            .await;
        assert!(
            matches!(r.status, 400 | 422),
            "{m} {path} {body:?}: {} {}",
            r.status,
            r.text()
        );
    }
    let accepted: Vec<(&str, String, Option<Value>, u16)> = vec![
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 1000})), 200),
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 600000})), 200),
        ("PUT", "/v1/owners/k".into(), Some(json!({"lease_ms": 5100.0})), 200),
        (
            "POST",
            "/v1/runs".into(),
            Some(json!({"tool": "web", "run_id": id128, "owner": "k", "labels": labels(64)})),
            201,
        ),
        ("GET", "/v1/runs?state=created&label=k0%3Dv&limit=0".into(), None, 200),
        ("GET", format!("/v1/runs?limit={big}"), None, 200),
        (
            "GET",
            format!("/v1/facts?after=9223372036854775807&limit={big}"),
            None,
            200,
        ),
    ];
    for (m, path, body, want) in accepted {
        let r = p
            .control_raw(m, &path, body.clone(), Some(egress_e2e::harness::TOKEN))
            .await;
        assert_eq!(r.status, want, "{m} {path} {body:?}: {}", r.text());
    }
    let (_, v) = p.control("GET", "/v1/owners", None).await;
    assert_eq!(v["owners"][0]["lease_ms"], 5100, "{v}");

    // The document's bounds are the code's.
    let doc = egress_e2e::harness::openapi().doc();
    let schemas = &doc["components"]["schemas"];
    let lease = &schemas["RenewOwner"]["properties"]["lease_ms"];
    assert_eq!(lease["minimum"], egress_api::rules::LEASE_MS_MIN);
    assert_eq!(lease["maximum"], egress_api::rules::LEASE_MS_MAX);
    let create = &schemas["CreateRun"]["properties"];
    assert_eq!(create["labels"]["maxProperties"], egress_api::rules::MAX_LABELS);
    let param = |path: &str, method: &str, name: &str| -> Value {
        doc["paths"][path][method]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["schema"]
            .clone()
    };
    assert_eq!(
        param("/v1/facts", "get", "after")["maximum"],
        egress_api::Cursor::MAX_AFTER
    );
    for (path, method, name) in [("/v1/facts", "get", "limit"), ("/v1/runs", "get", "limit")] {
        assert_eq!(
            param(path, method, name)["maximum"],
            egress_api::rules::LIMIT_MAX,
            "{path}"
        );
    }
    let ids = [
        create["run_id"].clone(),
        create["owner"].clone(),
        param("/v1/owners/{owner}", "put", "owner"),
    ];
    let pattern = regex::Regex::new(egress_api::rules::ID_PATTERN).unwrap();
    for id in ids {
        assert_eq!(id["pattern"], egress_api::rules::ID_PATTERN, "{id}");
        assert_eq!(
            (id["minLength"].clone(), id["maxLength"].clone()),
            (json!(1), json!(128)),
            "{id}"
        );
    }
    // The pattern and the lengths say what `valid_id` checks.
    for s in [
        "a",
        "run-1.A_b~",
        "",
        "a b",
        "a/b",
        "é",
        "a\n",
        "x\u{0}",
        &"a".repeat(129),
        &id128,
    ] {
        let by_doc = pattern.is_match(s) && (1..=128).contains(&s.chars().count());
        assert_eq!(by_doc, egress_api::rules::valid_id(s), "{s:?}");
    }
}
