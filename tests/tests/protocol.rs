//! HTTP hygiene and robustness: hop-by-hop headers stripped both ways,
//! header size limit, header read timeout, garbage / truncated / pipelined
//! input, real clients (curl, Python requests), the control API's errors,
//! and the fact-before-response rule (a slow sink delays the answer; a
//! failing sink fails closed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{TestProxy, TOKEN};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::raw::{read_response, send, wait_closed};
use egress_proxy::facts::{Fact, FactError, FactQuery, FactSink, MemorySink, Recorded};
use futures_util::future::BoxFuture;
use serde_json::json;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn tool(port: u16) -> String {
    format!("[tools.web]\negress = [\"allowed.test:{port}\"]\nfetch_timeout_ms = 5000\n")
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let r = p
        .get(
            &run,
            &format!("http://allowed.test:{port}/headers"),
            "Connection: close, X-Drop-Me\r\nX-Drop-Me: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\nX-Keep: 1\r\n",
        )
        .await;
    assert_eq!(r.status, 200);
    let seen = r.text().to_ascii_lowercase();
    for gone in [
        "x-drop-me",
        "keep-alive",
        "te:",
        "proxy-connection",
        "upgrade",
        "proxy-authorization",
    ] {
        assert!(!seen.contains(gone), "{gone} reached the origin:\n{seen}");
    }
    assert!(seen.contains("x-keep: 1"));
    let r = p.get(&run, &format!("http://allowed.test:{port}/hop"), "").await;
    assert_eq!(r.status, 200);
    assert!(r.header("x-secret-hop").is_none() && r.header("proxy-authenticate").is_none());
    assert!(r.header("keep-alive").is_none());
    assert_eq!(r.header("x-kept"), Some("yes"));
}

#[tokio::test]
async fn oversized_heads_get_431_and_the_proxy_survives() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start_with("max_header_bytes = 8192", &tool(port), None).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let big = format!("X-Big: {}\r\n", "a".repeat(20_000));
    let r = p.get(&run, &format!("http://allowed.test:{port}/"), &big).await;
    assert_eq!(r.status, 431);
    assert_eq!(
        p.get(&run, &format!("http://allowed.test:{port}/"), "").await.status,
        200
    );
}

#[tokio::test]
async fn slow_heads_are_cut_by_the_header_read_timeout() {
    let p = TestProxy::start_with("header_read_timeout_ms = 300", &tool(80), None).await;
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    s.write_all(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allo")
        .await
        .unwrap();
    let t0 = Instant::now();
    wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("slowloris connection stayed open");
    assert!(t0.elapsed() < Duration::from_millis(300) + Duration::from_millis(1500));
    // Blank lines only (allowed before a request line by RFC 9112 §2.2): closed at the timeout.
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    s.write_all(b"\r\n\r\n\r\n").await.unwrap();
    wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("blank-line connection stayed open");
    // An idle connection that never sends anything is closed too.
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("idle connection stayed open");
}

#[tokio::test]
async fn garbage_truncated_and_pipelined_input() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    for garbage in [
        &b"\x00\x01\x02\xff\xfe garbage\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"HELLO WORLD HTTP/9.9\r\n\r\n",
    ] {
        let r = send(p.proxy, garbage).await;
        assert_eq!(r.status, 400, "{garbage:?}");
    }
    // Truncated head, then close: nothing breaks.
    for _ in 0..20 {
        let mut s = TcpStream::connect(p.proxy).await.unwrap();
        s.write_all(b"CONNECT allowed.test:").await.unwrap();
        drop(s);
    }
    // Non-UTF-8 in a header value must not panic.
    let r = p
        .get(
            &run,
            &format!("http://allowed.test:{port}/"),
            "X-Bin: \u{fffd}\u{1}\r\n",
        )
        .await;
    assert!(r.status == 200 || r.status == 400);
    // Two pipelined requests in one write get two answers, in order.
    let a = run.auth();
    let one = format!(
        "GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {a}\r\n\r\n"
    );
    let two = format!("GET http://allowed.test:{port}/headers HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {a}\r\nConnection: close\r\n\r\n");
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    s.write_all(format!("{one}{two}").as_bytes()).await.unwrap();
    let r1 = read_response(&mut s, false).await.unwrap();
    let r2 = read_response(&mut s, false).await.unwrap();
    assert_eq!((r1.status, r1.text().as_str()), (200, "hello from origin"));
    assert_eq!(r2.status, 200);
    assert!(r2.text().starts_with("GET /headers"));
    // Still serving.
    assert_eq!(
        p.get(&run, &format!("http://allowed.test:{port}/"), "").await.status,
        200
    );
}

#[tokio::test]
async fn request_bodies_are_forwarded() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"allowed.test:{port}\", \"allowed.test:{}\"]\n",
        echo.port()
    ))
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let body = "x".repeat(100_000);
    let req = format!(
        "POST http://allowed.test:{port}/headers HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        run.auth(),
        body.len()
    );
    let r = send(p.proxy, req.as_bytes()).await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("content-length: 100000"), "{}", r.text());
    let r = p
        .get(&run, &format!("http://allowed.test:{port}/bytes?n=3000000"), "")
        .await;
    assert_eq!((r.status, r.body.len()), (200, 3_000_000));
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test]
async fn curl_works_unchanged_for_http_and_connect() {
    assert!(have("curl"), "curl is required for this test (apt-get install curl)");
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port)).await;
    let run = p.run("web").await;
    // curl resolves nothing itself through a proxy, but give it no chance: --noproxy '' and an allowed name.
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let url = run.url.clone();
    let target = format!("http://allowed.test:{port}/");
    let out = tokio::task::spawn_blocking(move || {
        let plain = Command::new("curl")
            .args(["-sS", "-m", "10", "-x", &url, &target])
            .output()
            .unwrap();
        let tunnel = Command::new("curl")
            .args(["-sS", "-m", "10", "-p", "-x", &url, &target])
            .output()
            .unwrap();
        let denied = Command::new("curl")
            .args([
                "-sS",
                "-m",
                "10",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-x",
                &url,
                "http://evil.test/",
            ])
            .output()
            .unwrap();
        let denied_tunnel = Command::new("curl")
            .args([
                "-sS",
                "-m",
                "10",
                "-o",
                "/dev/null",
                "-w",
                "%{http_connect}",
                "-x",
                &url,
                "https://evil.test/",
            ])
            .output()
            .unwrap();
        (plain, tunnel, denied, denied_tunnel)
    })
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.0.stdout),
        "hello from origin",
        "{}",
        String::from_utf8_lossy(&out.0.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.1.stdout),
        "hello from origin",
        "{}",
        String::from_utf8_lossy(&out.1.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.2.stdout), "403");
    assert_eq!(String::from_utf8_lossy(&out.3.stdout), "403");
    let reasons: Vec<String> = p.facts().await.into_iter().map(|f| f.reason).collect();
    assert_eq!(reasons, ["not_allowlisted", "not_allowlisted"]);
}

#[tokio::test]
async fn python_requests_works_unchanged() {
    let ok = Command::new("python3")
        .args(["-c", "import requests"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "python3 with requests is required for this test (pip install requests)"
    );
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let script = format!(
        r#"
import os, requests
s = requests.Session()
s.trust_env = True
r = s.get("http://allowed.test:{port}/", timeout=10)
print(r.status_code, r.text)
r = s.get("http://evil.test/", timeout=10)
print(r.status_code, r.headers.get("X-Egress-Deny-Reason"))
try:
    s.get("https://evil.test/", timeout=10)
    print("tunnel allowed?!")
except requests.exceptions.ProxyError as e:
    print("proxy refused tunnel")
"#
    );
    let url = run.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", &script])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", std::env::var("HOME").unwrap_or_default())
            .env("HTTP_PROXY", &url)
            .env("HTTPS_PROXY", &url)
            .env("NO_PROXY", "")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout,
        "200 hello from origin\n403 not_allowlisted\nproxy refused tunnel\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn control_api_errors_are_clear_json() {
    let p = TestProxy::start(&tool(80)).await;
    let r = p
        .control_raw("POST", "/v1/runs", Some(json!({"tool": "web"})), None)
        .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let r = p
        .control_raw(
            "POST",
            "/v1/runs",
            Some(json!({"tool": "web"})),
            Some("wrong-token-wrong-token"),
        )
        .await;
    assert_eq!(r.status, 401);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "unauthorized");
    for (body, status, code) in [
        (json!({"tool": "nope"}), 404, "unknown_tool"),
        (json!({"tool": "web", "run_id": "has space"}), 400, "bad_request"),
        (json!({"tool": "web", "run_id": "a:b"}), 400, "bad_request"),
        (json!({"tool": "web", "unknown": 1}), 422, "bad_request"),
        (json!({"tol": "web"}), 422, "bad_request"),
    ] {
        let (s, v) = p.control("POST", "/v1/runs", Some(body.clone())).await;
        assert_eq!((s, v["error"]["code"].as_str()), (status, Some(code)), "{body}: {v}");
    }
    p.run_with(json!({"tool": "web", "run_id": "dup"})).await;
    let (s, v) = p
        .control("POST", "/v1/runs", Some(json!({"tool": "web", "run_id": "dup"})))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (409, Some("run_exists")));
    let (s, v) = p.control("GET", "/v1/runs/missing", None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("run_not_found")));
    let (s, _) = p.control("DELETE", "/v1/runs/missing", None).await;
    assert_eq!(s, 404);
    // Malformed JSON.
    let raw = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 5\r\nConnection: close\r\n\r\n{{bad}}"
    );
    let r = send(p.control, raw.as_bytes()).await;
    assert_eq!(r.status, 400);
    // Health needs no token.
    assert_eq!(p.control_raw("GET", "/healthz", None, None).await.status, 200);
    assert_eq!(p.control_raw("GET", "/readyz", None, None).await.status, 200);
    assert_eq!(p.control_raw("GET", "/metrics", None, None).await.status, 200);
    assert_eq!(p.control_raw("GET", "/v1/facts", None, None).await.status, 401);
}

#[tokio::test]
async fn too_many_runs_is_429() {
    let p = TestProxy::start_with("max_runs = 2", &tool(80), None).await;
    p.run("web").await;
    let r2 = p.run("web").await;
    let (s, v) = p.control("POST", "/v1/runs", Some(json!({"tool": "web"}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (429, Some("too_many_runs")));
    p.end(&r2).await;
    p.run("web").await;
}

/// A sink that takes its time, so the test can see the answer waits for it.
struct SlowSink(MemorySink, Duration);

impl FactSink for SlowSink {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(async move {
            tokio::time::sleep(self.1).await;
            self.0.record(fact).await
        })
    }
    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        self.0.query(q)
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Fact> {
        self.0.subscribe()
    }
}

struct BrokenSink;

impl FactSink for BrokenSink {
    fn record(&self, _: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(async { Err(FactError::Unavailable("disk full".into())) })
    }
    fn query(&self, _: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        Box::pin(async { Err(FactError::Unavailable("disk full".into())) })
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Fact> {
        tokio::sync::broadcast::channel(1).1
    }
    fn ready(&self) -> bool {
        false
    }
}

#[tokio::test]
async fn the_fact_is_recorded_before_the_denial_is_answered() {
    let sink = Arc::new(SlowSink(MemorySink::new(100), Duration::from_millis(400)));
    let p = TestProxy::start_with("", &tool(80), Some(sink.clone())).await;
    let run = p.run("web").await;
    let t0 = Instant::now();
    let r = p.get(&run, "http://evil.test/", "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "answered before the fact was stored"
    );
    assert_eq!(p.facts().await.len(), 1);
}

#[tokio::test]
async fn a_broken_fact_store_fails_closed() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start_with(
        "",
        &format!("[tools.web]\negress = [\"allowed.test:{port}\"]\n[tools.rep]\negress = []\nmode = \"report\"\n"),
        Some(Arc::new(BrokenSink)),
    )
    .await;
    p.dns.set("other.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let r = p.get(&run, "http://evil.test/", "").await;
    assert_eq!((r.status, r.header("x-egress-error")), (503, Some("facts_unavailable")));
    // Report mode must not let a fetch through when its fact cannot be written.
    let rep = p.run("rep").await;
    let r = p.get(&rep, &format!("http://other.test:{port}/"), "").await;
    assert_eq!((r.status, r.header("x-egress-error")), (503, Some("facts_unavailable")));
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(p.control_raw("GET", "/readyz", None, None).await.status, 503);
    let m = p.metrics().await;
    assert!(
        egress_e2e::harness::sample(&m, "egress_fact_write_failures_total") >= 2.0,
        "{m}"
    );
}

/// Bytes a client sends right behind its CONNECT (before it reads the `200`)
/// reach the origin first and are counted; a large transfer arrives intact
/// both ways (the tunnel's kernel-side relay).
#[tokio::test]
async fn bytes_sent_with_the_connect_and_bulk_transfers_cross_a_tunnel_intact() {
    use tokio::io::AsyncReadExt;
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&tool(echo.port())).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let target = format!("allowed.test:{}", echo.port());
    let head = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {}\r\n\r\nearly-bytes",
        run.auth()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let r = read_response(&mut s, true).await.unwrap();
    assert_eq!(r.status, 200);
    let mut got = r.body.clone();
    while got.len() < 11 {
        let mut b = [0u8; 64];
        let n = s.read(&mut b).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&b[..n]);
    }
    assert_eq!(&got[..11], b"early-bytes");
    // 4 MiB of varied bytes, written and read concurrently.
    let data: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let (mut rd, mut wr) = s.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&sent).await.unwrap();
        wr.shutdown().await.unwrap();
    });
    let mut back = Vec::with_capacity(data.len());
    tokio::time::timeout(Duration::from_secs(20), rd.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "bytes changed on the way");
    let (_, v) = {
        let t0 = Instant::now();
        loop {
            let (s, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
            if v["bytes"]["up"].as_u64().unwrap_or(0) > 0 || t0.elapsed() > Duration::from_secs(5) {
                break (s, v);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert_eq!(v["bytes"]["up"].as_u64(), Some(11 + data.len() as u64), "{v}");
    assert_eq!(v["bytes"]["down"].as_u64(), Some(11 + data.len() as u64));
}
