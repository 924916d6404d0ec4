//! Growing a policy: the decision log (`[proxy] decisions`) records every
//! allowed fetch and tunnel with its bytes, off the answer path, in the
//! fact store's file; `policy suggest` proposes an allowlist from what a
//! report-mode tool did; `policy replay` re-decides the recorded traffic
//! under a new policy. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, sample, TestProxy};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::FakeDns;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// A proxy whose facts and decisions go to `store`, with `extra` `[proxy]`
/// keys and `tools`.
async fn proxy_at(dns: FakeDns, store: &Path, extra: &str, tools: &str) -> TestProxy {
    let section = proxy_section(&dns, extra).replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    let text = format!("{section}\n{tools}");
    TestProxy::start_config(dns, &text, None, None).await
}

/// Every decision record the API lists with `query` (e.g. `tool=web`),
/// waiting (up to 5 s) until there are at least `n`.
async fn decisions(p: &TestProxy, query: &str, n: usize) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let (status, v) = p
            .control("GET", &format!("/v1/decisions?{query}&limit=1000"), None)
            .await;
        assert_eq!(status, 200, "{v}");
        let list = v["decisions"].as_array().unwrap().clone();
        if list.len() >= n || t0.elapsed() > Duration::from_secs(5) {
            return list;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn decisions_all_records_every_allowed_fetch_with_its_bytes_and_no_denial() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    dns.set("api.test", &["127.0.0.2"]);
    dns.set("other.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let tools = format!(
        "[tools.web]\negress = [\"api.test:{port}\", \"api.test:{}\"]\n[tools.quiet]\negress = [\"api.test:{port}\"]\n",
        echo.port()
    );
    let p = proxy_at(dns, &dir.path().join("facts.db"), "decisions = \"all\"", &tools).await;
    let run = p.run("web").await;
    for i in 0..5 {
        let r = p.get(&run, &format!("http://api.test:{port}/?i={i}"), "").await;
        assert_eq!(r.status, 200);
    }
    let r = p.get(&run, &format!("http://api.test:{port}/missing"), "").await;
    assert_eq!(r.status, 404);
    let (r, mut s) = p.connect(&run, &format!("api.test:{}", echo.port())).await;
    assert_eq!(r.status, 200);
    assert_eq!(egress_e2e::raw::echo_through(&mut s, b"ping").await, b"ping");
    drop(s);
    // A denial is a fact, never a decision record.
    let r = p.get(&run, &format!("http://other.test:{port}/"), "").await;
    assert_eq!(r.status, 403);

    let list = decisions(&p, "tool=web", 7).await;
    assert_eq!(list.len(), 7, "{list:#?}");
    let http: Vec<&Value> = list.iter().filter(|d| d["kind"] == "http").collect();
    assert_eq!(http.len(), 6);
    for d in &http {
        assert_eq!(d["run_id"], run.id.as_str());
        assert_eq!(d["target"], format!("api.test:{port}"));
        assert_eq!(d["method"], "GET");
        assert_eq!(d["outcome"], "ok");
        assert!(d["bytes_up"].as_u64().unwrap() > 0, "{d}");
        assert!(d["bytes_down"].as_u64().unwrap() > 0, "{d}");
        assert!(d["policy"].as_str().unwrap().starts_with("sha256:"));
        assert_eq!(d["resolved"], serde_json::json!(["127.0.0.2"]));
        assert!(d["path"].as_str().unwrap().starts_with('/'), "{d}");
        assert!(!d["path"].as_str().unwrap().contains('?'), "a query is never kept: {d}");
    }
    assert_eq!(http.iter().filter(|d| d["status"] == 200).count(), 5);
    assert_eq!(http.iter().filter(|d| d["status"] == 404).count(), 1);
    let tunnel = list.iter().find(|d| d["kind"] == "connect").unwrap();
    assert_eq!(tunnel["method"], "CONNECT");
    assert_eq!(tunnel["bytes_up"], 4);
    assert_eq!(tunnel["bytes_down"], 4);

    // The run's own records, by cursor; another tool's filter sees none.
    let (_, v) = p
        .control("GET", &format!("/v1/runs/{}/decisions?limit=3", run.id), None)
        .await;
    assert_eq!(v["decisions"].as_array().unwrap().len(), 3);
    let next = v["next"].as_u64().unwrap();
    let (_, v) = p
        .control("GET", &format!("/v1/runs/{}/decisions?after={next}", run.id), None)
        .await;
    assert_eq!(v["decisions"].as_array().unwrap().len(), 4);
    assert!(decisions(&p, "tool=quiet", 0).await.is_empty());
    let (status, _) = p.control("GET", "/v1/decisions?after=9223372036854775808", None).await;
    assert_eq!(status, 400);

    // The live stream replays from the cursor.
    let ev = first_event(&p, "/v1/decisions/stream?after=0&tool=web").await;
    assert!(
        ev.contains("event: decision") && ev.contains("\"tool\":\"web\""),
        "{ev}"
    );

    let m = p.metrics().await;
    assert_eq!(sample(&m, "egress_decisions_recorded_total"), 7.0);
    assert_eq!(sample(&m, "egress_decisions_dropped_total"), 0.0);
    assert!(sample(&m, "egress_decisions_store_bytes") > 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn decisions_off_records_nothing() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    dns.set("api.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let p = proxy_at(
        dns,
        &dir.path().join("facts.db"),
        "",
        &format!("[tools.web]\negress = [\"api.test:{port}\"]\n"),
    )
    .await;
    let run = p.run("web").await;
    assert_eq!(p.get(&run, &format!("http://api.test:{port}/"), "").await.status, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(decisions(&p, "tool=web", 0).await.is_empty());
    assert_eq!(sample(&p.metrics().await, "egress_decisions_recorded_total"), 0.0);
}

/// The first event of an SSE stream at `path`, as raw text.
async fn first_event(p: &TestProxy, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(p.control).await.unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nAccept: text/event-stream\r\n\r\n",
        egress_e2e::harness::TOKEN
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "the stream closed");
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen);
            if let Some(i) = text.find("event: ") {
                if text[i..].contains("\n\n") {
                    return text[i..].to_owned();
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("an event on the stream")
}
