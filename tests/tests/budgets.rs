//! Per-run budgets (`max_requests_per_run`, `max_request_rate`,
//! `max_bytes_per_run`): one count per run shared by every entrance and
//! every concurrent tunnel; exceeding one is a `429` with
//! `budget_exhausted` or `rate_limited`, a fact recorded before the answer,
//! and the run view says what is used of what limit. Bytes are counted as
//! they move: the fetch that crosses the byte budget is cut, with every
//! other open fetch of the run, and that is a fact. Report mode waives
//! none of them. Loopback origin on 127.0.0.2, fake DNS.
//!
//! The byte budget is an exfiltration bound, so it is exact: no carrier
//! (splice, copy, body frame, WebSocket, intercepted TLS, HTTP/2 stream)
//! moves a byte past it, whatever the entrance and however many fetches
//! of the run move at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::flood::{self, http_flood, raw_flood, FloodOrigin, Speaks};
use egress_e2e::harness::{TestProxy, TestRun};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::raw::{connect, echo_through, wait_closed};
use egress_e2e::socks::{self, Dest};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

async fn world(budget: &str) -> (TestProxy, TestRun, u16) {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    std::mem::forget(origin);
    let tools = format!("[tools.web]\negress = [\"allowed.test:{port}\"]\n{budget}\n");
    let p = TestProxy::start(&tools).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    (p, run, port)
}

async fn view(p: &TestProxy, run: &TestRun) -> Value {
    let (status, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// The run's facts with `reason`.
async fn facts_with(p: &TestProxy, run: &TestRun, reason: &str) -> usize {
    p.facts()
        .await
        .iter()
        .filter(|f| f.run_id.as_deref() == Some(&run.id) && f.reason == reason)
        .count()
}

#[tokio::test]
async fn the_request_budget_is_one_count_across_entrances() {
    let (p, run, port) = world("max_requests_per_run = 4").await;
    let url = format!("http://allowed.test:{port}/");
    // Two plain requests, a CONNECT tunnel kept open and a SOCKS5 one: four.
    for _ in 0..2 {
        assert_eq!(p.get(&run, &url, "").await.status, 200);
    }
    let (r, _tunnel) = connect(p.proxy, &format!("allowed.test:{port}"), Some(&run.auth())).await;
    assert_eq!(r.status, 200);
    let dest = Dest::Name("allowed.test".into(), port);
    let (code, _socks) = socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    assert_eq!(code, 0);
    assert_eq!(
        view(&p, &run).await["budgets"]["requests"],
        serde_json::json!({"used": 4, "limit": 4})
    );
    // The fifth, by any entrance: 429 with a fact, nothing reaches the origin.
    let r = p.get(&run, &url, "").await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (429, Some("budget_exhausted")),
        "{}",
        r.text()
    );
    let (r, _) = connect(p.proxy, &format!("allowed.test:{port}"), Some(&run.auth())).await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("budget_exhausted")));
    let (code, _) = socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    assert_eq!(code, 2, "SOCKS5: not allowed by ruleset");
    assert_eq!(facts_with(&p, &run, "budget_exhausted").await, 3);
    // Refusals are not spending.
    assert_eq!(view(&p, &run).await["budgets"]["requests"]["used"], 4);
    // Another run of the same tool has its own budget.
    let other = p.run("web").await;
    assert_eq!(p.get(&other, &url, "").await.status, 200);
}

#[tokio::test]
async fn the_rate_allows_its_burst_then_refuses_until_a_token_returns() {
    let (p, run, port) = world("max_request_rate = { per_second = 2, burst = 3 }").await;
    let url = format!("http://allowed.test:{port}/");
    for i in 0..3 {
        assert_eq!(p.get(&run, &url, "").await.status, 200, "request {i} of the burst");
    }
    let r = p.get(&run, &url, "Accept: application/json\r\n").await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("rate_limited")), "{}", r.text());
    let body: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["rule"], "budgets");
    assert_eq!(facts_with(&p, &run, "rate_limited").await, 1);
    assert_eq!(
        view(&p, &run).await["budgets"]["rate"],
        serde_json::json!({"per_second": 2, "burst": 3})
    );
    // One token comes back every 500 ms.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(p.get(&run, &url, "").await.status, 200);
}

#[tokio::test]
async fn the_byte_budget_cuts_the_fetch_that_crosses_it() {
    let (p, run, port) = world("max_bytes_per_run = 10000").await;
    // 100,000 bytes asked for: the download is cut at the budget, not served whole.
    let r = p
        .get(&run, &format!("http://allowed.test:{port}/bytes?n=100000"), "")
        .await;
    assert!(r.body.len() < 100_000, "{} bytes arrived", r.body.len());
    let v = view(&p, &run).await;
    let used = v["budgets"]["bytes"]["used"].as_u64().unwrap();
    assert!(used >= 10_000, "{v}");
    assert_eq!(v["budgets"]["bytes"]["limit"], 10000);
    // The cut is a fact (recorded off the answer path: wait for it).
    let mut facts = 0;
    for _ in 0..100 {
        facts = facts_with(&p, &run, "budget_exhausted").await;
        if facts > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(facts, 1);
    // And the next fetch is refused.
    let r = p.get(&run, &format!("http://allowed.test:{port}/"), "").await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (429, Some("budget_exhausted")),
        "{}",
        r.text()
    );
    assert_eq!(facts_with(&p, &run, "budget_exhausted").await, 2);
}

#[tokio::test]
async fn concurrent_tunnels_share_one_byte_budget_and_are_cut_together() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"echo.test:{}\"]\nmax_bytes_per_run = 10000\n",
        echo.port()
    ))
    .await;
    p.dns.set("echo.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let target = format!("echo.test:{}", echo.port());
    let (r, mut a) = p.connect(&run, &target).await;
    assert_eq!(r.status, 200);
    let (r, mut b) = p.connect(&run, &target).await;
    assert_eq!(r.status, 200);
    // 3,000 bytes each way through each: 6,000 per tunnel, under the budget alone.
    let chunk = vec![7u8; 3000];
    assert_eq!(echo_through(&mut a, &chunk).await, chunk);
    // The second tunnel's bytes cross the run's 10,000: both are cut.
    b.write_all(&chunk).await.unwrap();
    let cap = std::time::Duration::from_secs(5);
    assert!(wait_closed(&mut b, cap).await.is_some(), "the crossing tunnel is cut");
    assert!(
        wait_closed(&mut a, cap).await.is_some(),
        "the run's other tunnel is cut too"
    );
    let v = view(&p, &run).await;
    assert!(v["budgets"]["bytes"]["used"].as_u64().unwrap() >= 10_000, "{v}");
    for _ in 0..100 {
        if facts_with(&p, &run, "budget_exhausted").await == 1 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("no budget_exhausted fact for the cut");
}

#[tokio::test]
async fn report_mode_waives_no_budget_and_a_tool_without_one_shows_none() {
    let (p, run, port) = world("mode = \"report\"\nmax_requests_per_run = 1").await;
    let url = format!("http://allowed.test:{port}/");
    assert_eq!(p.get(&run, &url, "").await.status, 200);
    let r = p.get(&run, &url, "").await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("budget_exhausted")));
    let (p, run, _) = world("").await;
    assert!(view(&p, &run).await.get("budgets").is_none());
}

// --- The byte budget is exact on every carrier -------------------------
//
// A fast origin that sends as fast as it is read and reads as fast as it
// is sent to, eight fetches of one run at once, a budget of 256 KiB: what
// crosses the proxy (what the tool's side received plus what the origin
// received) never passes the budget, the run's count stops at the budget
// to the byte, and the cut is a `budget_exhausted` fact. Intercepted
// sessions are counted on the tool's TLS bytes, so the plaintext either
// side gets is within the budget too.

const BUDGET: u64 = 256 * 1024;
const FETCHES: usize = 8;
/// Each attack's cap: the cut comes long before.
const CAP: std::time::Duration = std::time::Duration::from_secs(30);

fn budget_tool(egress: &str, extra: &str) -> String {
    format!(
        "[tools.web]\negress = [{egress}]\nmax_bytes_per_run = {BUDGET}\nmax_concurrent_fetches = 32\nfetch_timeout_ms = 60000\n{extra}\n"
    )
}

/// After the attack: the run's count is the budget to the byte, the bytes
/// that crossed are within it, and the cut is a fact.
async fn spent_exactly(p: &TestProxy, run: &TestRun, crossed: u64, what: &str) {
    assert!(
        crossed <= BUDGET,
        "{what}: {crossed} bytes crossed a budget of {BUDGET} ({} over)",
        crossed - BUDGET
    );
    eprintln!("{what}: {crossed} of {BUDGET} bytes crossed");
    let v = view(p, run).await;
    assert_eq!(
        v["budgets"]["bytes"]["used"].as_u64(),
        Some(BUDGET),
        "{what}: the run's count passed its budget: {v}"
    );
    for _ in 0..250 {
        if facts_with(p, run, "budget_exhausted").await >= 1 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("{what}: no budget_exhausted fact for the cut");
}

/// Runs `FETCHES` copies of `one` at once (each returns the bytes its tool
/// side received), within [`CAP`]; their sum.
async fn at_once<F, Fut>(one: F) -> u64
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = u64> + Send + 'static,
{
    let all: Vec<_> = (0..FETCHES).map(|_| tokio::spawn(one())).collect();
    let mut sum = 0;
    for t in all {
        sum += tokio::time::timeout(CAP, t)
            .await
            .expect("a fetch outlived the budget's cut")
            .unwrap();
    }
    sum
}

#[tokio::test]
async fn no_byte_crosses_the_budget_through_blind_tunnels_or_socks5() {
    for entrance in ["connect", "socks5"] {
        let origin = raw_flood("127.0.0.2:0").await;
        let port = origin.addr.port();
        let p = TestProxy::start(&budget_tool(&format!("\"flood.test:{port}\""), "")).await;
        p.dns.set("flood.test", &["127.0.0.2"]);
        let run = p.run("web").await;
        let (proxy, r2) = (p.proxy, run.clone());
        let got = at_once(move || {
            let run = r2.clone();
            async move {
                let s = if entrance == "connect" {
                    let (r, s) = connect(proxy, &format!("flood.test:{port}"), Some(&run.auth())).await;
                    assert_eq!(r.status, 200);
                    s
                } else {
                    let dest = Dest::Name("flood.test".into(), port);
                    let (code, s) = socks::connect(proxy, (&run.id, &run.secret), &dest).await;
                    assert_eq!(code, 0);
                    s
                };
                flood::both_ways(s).await
            }
        })
        .await;
        spent_exactly(&p, &run, got + origin.received_in_the_end().await, entrance).await;
    }
}

/// A request through the proxy on a fresh connection (absolute form, the
/// run's credential): the response, whose body the caller reads.
async fn forward(
    proxy: std::net::SocketAddr,
    run: &TestRun,
    method: &str,
    url: &str,
    body: flood::H2Body,
) -> Option<http::Response<hyper::body::Incoming>> {
    let s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("host", url.split('/').nth(2).unwrap())
        .header("proxy-authorization", run.auth())
        .body(body)
        .unwrap();
    sender.send_request(req).await.ok()
}

#[tokio::test]
async fn no_byte_crosses_the_budget_through_plain_downloads_and_uploads() {
    for (method, path) in [("GET", "/down"), ("POST", "/up")] {
        let origin = http_flood("127.0.0.2:0", Speaks::Http).await;
        let port = origin.addr.port();
        let p = TestProxy::start(&budget_tool(&format!("\"flood.test:{port}\""), "")).await;
        p.dns.set("flood.test", &["127.0.0.2"]);
        let run = p.run("web").await;
        let (proxy, r2) = (p.proxy, run.clone());
        let url = format!("http://flood.test:{port}{path}");
        let got = at_once(move || {
            let (run, url) = (r2.clone(), url.clone());
            async move {
                let body = if method == "POST" {
                    flood::endless_body()
                } else {
                    http_body_util::BodyExt::boxed(http_body_util::Empty::new())
                };
                match forward(proxy, &run, method, &url, body).await {
                    Some(r) => flood::drain_body(r.into_body()).await,
                    None => 0,
                }
            }
        })
        .await;
        spent_exactly(
            &p,
            &run,
            got + origin.received_in_the_end().await,
            &format!("{method} {path}"),
        )
        .await;
    }
}

/// A WebSocket handshake on `s` (to `authority`, with `auth` as the
/// proxy's credential on the forward path); after its `101`, floods both
/// ways and returns what came back (the bytes read past the head included).
async fn websocket<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    target: &str,
    authority: &str,
    auth: Option<&str>,
) -> u64 {
    use tokio::io::AsyncReadExt;
    let mut head = format!(
        "GET {target} HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    );
    if let Some(a) = auth {
        head.push_str(&format!("Proxy-Authorization: {a}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    // The 101's head, byte by byte, so nothing after it is taken.
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await.unwrap_or(0) == 0 {
            return 0;
        }
        got.push(b[0]);
    }
    if !got.starts_with(b"HTTP/1.1 101") {
        // A fetch refused at its start, once the budget is spent.
        return 0;
    }
    flood::both_ways(s).await
}

#[tokio::test]
async fn no_byte_crosses_the_budget_through_forward_websockets() {
    let origin = http_flood("127.0.0.2:0", Speaks::Http).await;
    let port = origin.addr.port();
    let p = TestProxy::start(&budget_tool(&format!("\"flood.test:{port}\""), "")).await;
    p.dns.set("flood.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let (proxy, r2) = (p.proxy, run.clone());
    let got = at_once(move || {
        let run = r2.clone();
        async move {
            let s = tokio::net::TcpStream::connect(proxy).await.unwrap();
            let authority = format!("flood.test:{port}");
            websocket(s, &format!("http://{authority}/ws"), &authority, Some(&run.auth())).await
        }
    })
    .await;
    spent_exactly(&p, &run, got + origin.received_in_the_end().await, "websocket").await;
}

/// An `inspect` tool's world: every CONNECT to the HTTPS flood origin
/// (`tls.test`, h2 offered) is intercepted.
async fn intercepted_world(dir: &std::path::Path) -> (TestProxy, TestRun, FloodOrigin, String) {
    let origin = http_flood(
        "127.0.0.2:0",
        Speaks::Https {
            name: "tls.test",
            h2: true,
        },
    )
    .await;
    let port = origin.addr.port();
    let roots = dir.join("roots.pem");
    std::fs::write(&roots, origin.ca_pem.as_deref().unwrap()).unwrap();
    let p = TestProxy::start_with(
        &format!("[proxy.interception]\nupstream_ca_file = \"{}\"", roots.display()),
        &budget_tool(&format!("\"tls.test:{port}\""), "inspect = true"),
        None,
    )
    .await;
    p.dns.set("tls.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let (_, ca) = p.control("GET", "/v1/ca", None).await;
    let ca = ca["pem"].as_str().unwrap().to_owned();
    (p, run, origin, ca)
}

/// The tool's TLS through an intercepted CONNECT to `tls.test`, or `None`
/// once the budget refuses the CONNECT or cuts the handshake.
async fn intercepted(
    proxy: std::net::SocketAddr,
    run: &TestRun,
    port: u16,
    ca: &str,
    h2: bool,
) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let (r, s) = connect(proxy, &format!("tls.test:{port}"), Some(&run.auth())).await;
    if r.status != 200 {
        return None;
    }
    flood::tls_inside(s, ca, "tls.test", h2).await.ok()
}

#[tokio::test]
async fn no_byte_crosses_the_budget_inside_interception_on_http1_and_websockets() {
    for case in ["download", "upload", "websocket"] {
        let dir = tempfile::tempdir().unwrap();
        let (p, run, origin, ca) = intercepted_world(dir.path()).await;
        let port = origin.addr.port();
        let (proxy, r2) = (p.proxy, run.clone());
        let got = at_once(move || {
            let (run, ca) = (r2.clone(), ca.clone());
            async move {
                let Some(tls) = intercepted(proxy, &run, port, &ca, false).await else {
                    return 0;
                };
                let authority = format!("tls.test:{port}");
                if case == "websocket" {
                    return websocket(tls, "/ws", &authority, None).await;
                }
                let Ok((mut sender, conn)) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await
                else {
                    return 0;
                };
                tokio::spawn(conn);
                let (method, path, body) = match case {
                    "upload" => ("POST", "/up", flood::endless_body()),
                    _ => (
                        "GET",
                        "/down",
                        http_body_util::BodyExt::boxed(http_body_util::Empty::new()),
                    ),
                };
                let req = http::Request::builder()
                    .method(method)
                    .uri(path)
                    .header("host", authority)
                    .body(body)
                    .unwrap();
                match sender.send_request(req).await {
                    Ok(r) => flood::drain_body(r.into_body()).await,
                    Err(_) => 0,
                }
            }
        })
        .await;
        spent_exactly(&p, &run, got + origin.received_in_the_end().await, case).await;
    }
}

#[tokio::test]
async fn no_byte_crosses_the_budget_on_http2_streams_inside_interception() {
    // One HTTP/2 connection, eight streams: four downloads, four uploads.
    let dir = tempfile::tempdir().unwrap();
    let (p, run, origin, ca) = intercepted_world(dir.path()).await;
    let port = origin.addr.port();
    let tls = intercepted(p.proxy, &run, port, &ca, true).await.unwrap();
    let sender = flood::h2_client(tls).await;
    let streams: Vec<_> = (0..FETCHES)
        .map(|i| {
            let mut sender = sender.clone();
            tokio::spawn(async move {
                let (method, path, body) = if i % 2 == 0 {
                    (
                        "GET",
                        "/down",
                        http_body_util::BodyExt::boxed(http_body_util::Empty::new()),
                    )
                } else {
                    ("POST", "/up", flood::endless_body())
                };
                let req = http::Request::builder()
                    .method(method)
                    .uri(format!("https://tls.test:{port}{path}"))
                    .body(body)
                    .unwrap();
                match sender.send_request(req).await {
                    Ok(r) => flood::drain_body(r.into_body()).await,
                    Err(_) => 0,
                }
            })
        })
        .collect();
    let mut got = 0;
    for s in streams {
        got += tokio::time::timeout(CAP, s)
            .await
            .expect("a stream outlived the cut")
            .unwrap();
    }
    spent_exactly(&p, &run, got + origin.received_in_the_end().await, "h2 streams").await;
}

#[tokio::test]
async fn a_head_that_does_not_fit_the_budget_is_not_sent_and_is_answered_with_its_fact() {
    // 1,000 bytes: a request head of 2,000 cannot go, a small one can; the
    // origin's answer (head and body) must fit what is left, or the tool
    // gets the proxy's 429 instead of it.
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"allowed.test:{port}\"]\nmax_bytes_per_run = 1000\n"
    ))
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let url = format!("http://allowed.test:{port}/");
    let big = format!("X-Padding: {}\r\n", "p".repeat(2000));
    let r = p.get(&run, &url, &big).await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (429, Some("budget_exhausted")),
        "{}",
        r.text()
    );
    assert!(r.text().contains("request head"), "{}", r.text());
    assert!(origin.heads().is_empty(), "the head that did not fit went out");
    assert_eq!(facts_with(&p, &run, "budget_exhausted").await, 1);
    // Nothing was taken: a small request still goes, whole.
    assert_eq!(view(&p, &run).await["budgets"]["bytes"]["used"], 0);
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(origin.heads().len(), 1);
    // 2,000 bytes asked for: the response's head fits, its body is cut at
    // the budget (the connection is closed, what was left goes no further).
    let mut s = tokio::net::TcpStream::connect(p.proxy).await.unwrap();
    let req = format!(
        "GET http://allowed.test:{port}/bytes?n=2000 HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let got = flood::drain(s).await;
    assert!(got < 1000, "{got} bytes arrived");
    assert_eq!(view(&p, &run).await["budgets"]["bytes"]["used"], 1000);
}
