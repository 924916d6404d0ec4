//! Allow once: `POST /v1/runs/{id}/grants` lets exactly that run reach
//! exactly that `name:port`, for its uses and until its time, and dies with
//! the run; another run of the tool stays denied; the grant is a durable
//! fact (`EGRESS_GRANTED`), listed in the run view and counted. Whatever
//! the kernel asks, what the hard rules deny stays denied (`422
//! grant_not_permitted`): an IP address, a name resolving only to denied
//! addresses, a host of another tool's credential; and a grant passes only
//! the methods the tool allows. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, sample, TestProxy, TestRun};
use egress_e2e::origin::http_origin;
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

struct World {
    p: TestProxy,
    port: u16,
    _dir: tempfile::TempDir,
}

async fn world() -> World {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    std::mem::forget(origin);
    let dns = FakeDns::start().await;
    for name in ["listed.test", "extra.test", "another.test", "cred.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    dns.set("loopback.test", &["127.0.0.1"]);
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "s3cret-value-0123456789").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let text = format!(
        r#"{}
[proxy.interception]
ca_dir = "{}"

[tools.web]
egress = ["listed.test:{port}"]
methods = ["GET", "CONNECT"]

[tools.asker]
egress = []
on_unlisted = "ask"
ask_timeout_ms = 5000

[tools.impatient]
egress = []
on_unlisted = "ask"
ask_timeout_ms = 300

[tools.other]
egress = ["cred.test:443"]

[tools.other.credentials.api]
hosts = ["cred.test:443"]
value = "Bearer ${{secret}}"
secret = {{ file = "{}" }}
placeholder_env = "API_TOKEN"
"#,
        proxy_section(&dns, ""),
        dir.path().join("ca").display(),
        secret.display()
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await;
    World { p, port, _dir: dir }
}

async fn grant(p: &TestProxy, run: &TestRun, body: Value) -> (u16, Value) {
    p.control("POST", &format!("/v1/runs/{}/grants", run.id), Some(body))
        .await
}

#[tokio::test]
async fn a_grant_lets_one_run_reach_one_target_for_its_uses() {
    let w = world().await;
    let (p, port) = (&w.p, w.port);
    let run = p.run("web").await;
    let other_run = p.run("web").await;
    let url = format!("http://extra.test:{port}/");
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));

    let (status, g) = grant(p, &run, json!({"target": format!("EXTRA.test.:{port}"), "uses": 2})).await;
    assert_eq!(status, 201, "{g}");
    assert_eq!(g["target"], format!("extra.test:{port}"));
    assert_eq!(g["uses_left"], 2);
    let fact_id = g["fact_id"].as_str().unwrap().to_owned();
    let facts = p.facts().await;
    let fact = facts.iter().find(|f| f.id == fact_id).expect("the grant's fact");
    assert_eq!((fact.kind.as_str(), fact.reason.as_str()), ("EGRESS_GRANTED", "grant"));
    assert_eq!(fact.run_id.as_deref(), Some(run.id.as_str()));
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(v["grants"][0]["target"], format!("extra.test:{port}"), "{v}");

    // The tool's methods still hold for a granted target.
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Another run of the same tool, another port, another name: denied.
    assert_eq!(p.get(&other_run, &url, "").await.deny_reason(), Some("not_allowlisted"));
    let r = p.get(&run, &format!("http://extra.test:{}/", port + 1), "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    assert_eq!(
        p.get(&run, &format!("http://another.test:{port}/"), "")
            .await
            .deny_reason(),
        Some("not_allowlisted")
    );
    // A tunnel is a use too; then the grant is spent.
    let (r, _) = p.connect(&run, &format!("extra.test:{port}")).await;
    assert_eq!(r.status, 200);
    assert_eq!(p.get(&run, &url, "").await.deny_reason(), Some("not_allowlisted"));
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert!(v.get("grants").is_none(), "a spent grant is gone: {v}");
    let m = p.metrics().await;
    assert_eq!(
        sample(&m, "egress_grants_total{tool=\"web\",event=\"granted\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "egress_grants_total{tool=\"web\",event=\"used\"}"),
        2.0,
        "{m}"
    );

    // A time-bound grant expires; a grant ends with its run.
    let (status, _) = grant(
        p,
        &run,
        json!({"target": format!("extra.test:{port}"), "uses": 100, "ttl_ms": 200}),
    )
    .await;
    assert_eq!(status, 201);
    assert_eq!(p.get(&run, &url, "").await.status, 200);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(p.get(&run, &url, "").await.deny_reason(), Some("not_allowlisted"));
    let (status, _) = grant(
        p,
        &other_run,
        json!({"target": format!("extra.test:{port}"), "uses": 100}),
    )
    .await;
    assert_eq!(status, 201);
    p.end(&other_run).await;
    let (status, v) = grant(p, &other_run, json!({"target": format!("extra.test:{port}")})).await;
    assert_eq!((status, v["error"]["code"].as_str()), (409, Some("run_ended")), "{v}");
}

#[tokio::test]
async fn a_grant_never_allows_what_the_hard_rules_deny() {
    let w = world().await;
    let (p, port) = (&w.p, w.port);
    let run = p.run("web").await;
    for (target, why) in [
        ("127.0.0.2:80".to_string(), "IP address"),
        ("[::1]:443".to_string(), "IP address"),
        ("2130706433:80".to_string(), "IP address"),
        (format!("loopback.test:{port}"), "denied addresses"),
        ("cred.test:443".to_string(), "another tool's credential"),
        ("nowhere.test:443".to_string(), "cannot be resolved"),
    ] {
        let (status, v) = grant(p, &run, json!({ "target": target })).await;
        assert_eq!(status, 422, "{target}: {v}");
        assert_eq!(v["error"]["code"], "grant_not_permitted", "{target}");
        assert!(v["error"]["message"].as_str().unwrap().contains(why), "{target}: {v}");
    }
    for bad in ["no-port.test", "a b:80", ":80", "", "x.test:99999"] {
        let (status, v) = grant(p, &run, json!({ "target": bad })).await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (422, Some("bad_target")),
            "{bad:?}: {v}"
        );
    }
    let (status, _) = p
        .control(
            "POST",
            "/v1/runs/no-such-run/grants",
            Some(json!({"target": "x.test:1"})),
        )
        .await;
    assert_eq!(status, 404);
    for body in [
        json!({"target": format!("extra.test:{port}"), "uses": 0}),
        json!({"target": format!("extra.test:{port}"), "uses": 1_000_001}),
        json!({"target": format!("extra.test:{port}"), "ttl_ms": 0}),
        json!({"target": format!("extra.test:{port}"), "extra": 1}),
    ] {
        // 400, or 422 for a body that is not the schema (as every body).
        let (status, v) = grant(p, &run, body.clone()).await;
        assert!(matches!(status, 400 | 422), "{body}: {v}");
        assert_eq!(v["error"]["code"], "bad_request", "{body}: {v}");
    }
    // A granted name's later checks still apply: POST is not a method of
    // the tool, so the grant lets nothing through (and is not spent).
    let (status, v) = grant(p, &run, json!({"target": format!("extra.test:{port}")})).await;
    assert_eq!(status, 201, "{v}");
    let req = format!(
        "POST http://extra.test:{port}/ HTTP/1.1\r\nHost: extra.test:{port}\r\nProxy-Authorization: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        run.auth()
    );
    let r = egress_e2e::raw::send(p.proxy, req.as_bytes()).await;
    assert_eq!(r.status, 403);
    assert_eq!(p.get(&run, &format!("http://extra.test:{port}/"), "").await.status, 200);
    // No grant was recorded for the refusals.
    let granted = p.facts().await.iter().filter(|f| f.kind == "EGRESS_GRANTED").count();
    assert_eq!(granted, 1);
}

/// A fetch of `url` by `run`, in a task of its own (it may be held).
fn hold(p: &TestProxy, run: &TestRun, url: &str) -> tokio::task::JoinHandle<egress_e2e::raw::RawResponse> {
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or("")
        .to_owned();
    let req = format!(
        "GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
        run.auth()
    );
    let proxy = p.proxy;
    tokio::spawn(async move { egress_e2e::raw::send(proxy, req.as_bytes()).await })
}

/// Waits (up to 5 s) for the run's `EGRESS_PENDING` fact; returns its target.
async fn pending_of(p: &TestProxy, run: &TestRun) -> String {
    for _ in 0..250 {
        let facts = p.facts().await;
        if let Some(f) = facts
            .iter()
            .find(|f| f.kind == "EGRESS_PENDING" && f.run_id.as_deref() == Some(&run.id))
        {
            let t = f.target.as_ref().unwrap();
            return format!("{}:{}", t.host, t.port);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("no pending fact for run {}", run.id);
}

#[tokio::test]
async fn ask_holds_an_unlisted_fetch_until_a_grant_or_its_timeout() {
    let w = world().await;
    let (p, port) = (&w.p, w.port);
    let after = p.facts().await.iter().map(|f| f.seq).max().unwrap_or(0);
    let run = p.run("asker").await;
    let url = format!("http://extra.test:{port}/");
    // Held: no DNS, a slot taken, a pending event; a grant lets it go on.
    let held = hold(p, &run, &url);
    assert_eq!(pending_of(p, &run).await, format!("extra.test:{port}"));
    let event = p.sse_event(&format!("/v1/facts/stream?after={after}"), "pending").await;
    assert!(event.contains("EGRESS_PENDING") && event.contains(&run.id), "{event}");
    assert!(
        !p.dns.queries().iter().any(|q| q.contains("extra.test")),
        "resolved while held"
    );
    assert_eq!(p.slots_in_use(&run).await, 1, "the held fetch holds a slot");
    assert!(!held.is_finished());
    let (status, v) = grant(p, &run, json!({"target": format!("extra.test:{port}")})).await;
    assert_eq!(status, 201, "{v}");
    let r = held.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let m = p.metrics().await;
    assert_eq!(
        sample(&m, "egress_grants_total{tool=\"asker\",event=\"asked\"}"),
        1.0,
        "{m}"
    );

    // No grant in time: denied as without ask, with its fact.
    let run = p.run("impatient").await;
    let asked_before = p.dns.queries().len();
    let t0 = std::time::Instant::now();
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    assert!(
        t0.elapsed() >= std::time::Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        p.dns.queries().len(),
        asked_before,
        "nothing resolved for a fetch never granted"
    );

    // The run ending cuts a held fetch at once.
    let run = p.run("asker").await;
    let held = hold(p, &run, &url);
    pending_of(p, &run).await;
    let t0 = std::time::Instant::now();
    p.end(&run).await;
    let r = tokio::time::timeout(std::time::Duration::from_secs(2), held)
        .await
        .expect("the held fetch ends with its run")
        .unwrap();
    assert_ne!(r.status, 200);
    assert!(t0.elapsed() < std::time::Duration::from_secs(2));
    // A tool without ask is denied at once (the other tests).
}
