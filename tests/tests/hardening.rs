//! The second attack round on the proxy: uploads bounded by the deadline and
//! by their slot, request bodies counted, no run-id oracle in 407 answers,
//! valid origin-form targets, bounded facts, cursors that never wrap,
//! connection budgets on both listeners, the host's own addresses, and a
//! denial identifier that says nothing about other runs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{sample, TestProxy};
use egress_e2e::origin::upload_origin;
use egress_e2e::raw::send;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn tool(port: u16, extra: &str) -> String {
    format!("[tools.web]\negress = [\"allowed.test:{port}\"]\n{extra}\n")
}

/// Opens a POST through the proxy and dribbles `chunk` bytes every `every`
/// until `total` bytes went out, the write fails, or `cap` passes; never
/// reads the response. Returns when it stops writing.
async fn dribble_post(
    proxy: std::net::SocketAddr,
    auth: &str,
    url: &str,
    total: u64,
    chunk: usize,
    every: Duration,
    cap: Duration,
) -> TcpStream {
    let host = url.trim_start_matches("http://").split('/').next().unwrap();
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let head = format!(
        "POST {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\nContent-Length: {total}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let t0 = Instant::now();
    let data = vec![b'u'; chunk];
    let mut sent = 0u64;
    while sent < total && t0.elapsed() < cap {
        match tokio::time::timeout(Duration::from_secs(1), s.write_all(&data)).await {
            Ok(Ok(())) => sent += chunk as u64,
            Ok(Err(_)) => break,
            Err(_) => {} // socket buffer full: keep trying until the cap
        }
        tokio::time::sleep(every).await;
    }
    s
}

#[tokio::test]
async fn a_plain_http_upload_is_bounded_by_the_deadline_when_the_client_stops_reading() {
    let origin = upload_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port, "fetch_timeout_ms = 1500")).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let auth = run.auth();
    let proxy = p.proxy;
    let url = format!("http://allowed.test:{port}/early");
    let t0 = Instant::now();
    let client = tokio::spawn(async move {
        dribble_post(
            proxy,
            &auth,
            &url,
            100_000_000,
            16 * 1024,
            Duration::from_millis(20),
            Duration::from_secs(8),
        )
        .await
    });
    // The origin answered at once and is reading the upload.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(origin.received.load(Ordering::SeqCst) > 0, "the upload never started");
    tokio::time::sleep_until((t0 + Duration::from_millis(3500)).into()).await;
    let r1 = origin.received.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let r2 = origin.received.load(Ordering::SeqCst);
    assert_eq!(r1, r2, "upload bytes kept reaching the origin after the 1.5 s deadline");
    assert_eq!(
        origin.active.load(Ordering::SeqCst),
        0,
        "the upstream connection outlived the deadline"
    );
    p.wait_slots(&run, 0).await;
    let m = p.metrics().await;
    assert!(
        sample(&m, "egress_timeouts_total{tool=\"web\",phase=\"response\"}") >= 1.0
            || sample(&m, "egress_timeouts_total{tool=\"web\",phase=\"upload\"}") >= 1.0,
        "the cut was not counted as a timeout:\n{m}"
    );
    client.abort();
}

#[tokio::test]
async fn an_upload_holds_its_slot_until_the_request_body_is_done() {
    let origin = upload_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port, "fetch_timeout_ms = 20000\nmax_concurrent_fetches = 2")).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let mut clients = vec![];
    for _ in 0..5 {
        let (auth, proxy) = (run.auth(), p.proxy);
        let url = format!("http://allowed.test:{port}/early-small");
        clients.push(tokio::spawn(async move {
            dribble_post(
                proxy,
                &auth,
                &url,
                400_000,
                2000,
                Duration::from_millis(20),
                Duration::from_secs(3),
            )
            .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(origin.received.load(Ordering::SeqCst) > 0, "no upload started");
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(v["slots"]["in_use"], 2, "answered uploads released their slots: {v}");
    assert!(
        origin.peak.load(Ordering::SeqCst) <= 2,
        "{} uploads of one run reached the origin at once with max_concurrent_fetches = 2",
        origin.peak.load(Ordering::SeqCst)
    );
    for c in clients {
        c.abort();
    }
}

#[tokio::test]
async fn request_bodies_and_heads_are_counted_in_metrics_the_run_view_and_the_log() {
    let origin = upload_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port, "fetch_timeout_ms = 5000")).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let body = vec![b'x'; 200_000];
    let mut req = format!(
        "POST http://allowed.test:{port}/sink HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        run.auth(),
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    let r = send(p.proxy, &req).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "got 200000");
    let t0 = Instant::now();
    loop {
        let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
        let up = v["bytes"]["up"].as_u64().unwrap_or(0);
        if up > 200_000 {
            assert!(up < 201_000, "head bytes overcounted: {up}");
            let down = v["bytes"]["down"].as_u64().unwrap();
            assert!((10..200).contains(&down), "response head + body: {down}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "run view never counted the upload: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = p.metrics().await;
    assert!(
        sample(&m, "egress_bytes_total{tool=\"web\",direction=\"up\"}") > 200_000.0,
        "{m}"
    );
}

#[tokio::test]
async fn a_target_with_only_a_fragment_goes_upstream_as_slash() {
    let origin = upload_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port, "fetch_timeout_ms = 5000")).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    for (target, want) in [
        (format!("http://allowed.test:{port}#frag"), "GET / HTTP/1.1"),
        (format!("http://allowed.test:{port}/a#frag"), "GET /a HTTP/1.1"),
        (format!("http://allowed.test:{port}?q=1#frag"), "GET /?q=1 HTTP/1.1"),
        (format!("http://allowed.test:{port}"), "GET / HTTP/1.1"),
    ] {
        origin.request_lines.lock().unwrap().clear();
        let req = format!(
            "GET {target} HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
            run.auth()
        );
        let r = send(p.proxy, req.as_bytes()).await;
        assert_eq!(r.status, 200, "{target}: {}", r.text());
        let lines = origin.request_lines.lock().unwrap().clone();
        assert_eq!(lines, vec![want.to_owned()], "{target}");
    }
}

#[tokio::test]
async fn fact_cursors_beyond_the_store_range_are_refused_never_replayed() {
    let p = TestProxy::start("[tools.web]\negress = []\n").await;
    let run = p.run("web").await;
    assert_eq!(
        p.get(&run, "http://evil.test/", "").await.deny_reason(),
        Some("not_allowlisted")
    );
    for path in ["/v1/facts", "/v1/facts/stream", &format!("/v1/runs/{}/facts", run.id)] {
        for after in [
            "9223372036854775808",
            "18446744073709551615",
            "99999999999999999999",
            "-1",
        ] {
            let r = p
                .control_raw(
                    "GET",
                    &format!("{path}?after={after}"),
                    None,
                    Some(egress_e2e::harness::TOKEN),
                )
                .await;
            assert_eq!(r.status, 400, "{path}?after={after}: {}", r.text());
        }
    }
    let (status, v) = p.control("GET", "/v1/facts?after=9223372036854775807", None).await;
    assert_eq!(status, 200);
    assert_eq!(v["facts"].as_array().unwrap().len(), 0, "{v}");
    let (_, v) = p.control("GET", "/v1/facts?after=0", None).await;
    assert_eq!(v["facts"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_407_does_not_tell_whether_a_run_exists_and_wrong_secrets_cannot_write_into_a_run() {
    let p = TestProxy::start("[tools.web]\negress = []\n").await;
    let victim = p.run("web").await;
    let long_path = "x".repeat(4000);
    let ask = |user: String| {
        let proxy = p.proxy;
        let long_path = long_path.clone();
        async move {
            let req = format!(
                "GET http://evil.test/{long_path} HTTP/1.1\r\nHost: evil.test\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
                egress_e2e::harness::basic(&user, "wrong-secret")
            );
            send(proxy, req.as_bytes()).await
        }
    };
    let existing = ask(victim.id.clone()).await;
    let unknown = ask("no-such-run".into()).await;
    assert_eq!((existing.status, unknown.status), (407, 407));
    assert_eq!(existing.text(), unknown.text(), "the body tells the two apart");
    let names = |r: &egress_e2e::raw::RawResponse| {
        let mut n: Vec<String> = r.headers.iter().map(|(k, _)| k.to_ascii_lowercase()).collect();
        n.sort();
        n
    };
    assert_eq!(names(&existing), names(&unknown), "the headers tell the two apart");
    for h in ["x-egress-deny-reason", "proxy-authenticate", "content-type"] {
        assert_eq!(existing.header(h), unknown.header(h), "{h}");
    }
    // A flood of wrong secrets against the victim run.
    for _ in 0..50 {
        assert_eq!(ask(victim.id.clone()).await.status, 407);
    }
    let (_, v) = p
        .control("GET", &format!("/v1/runs/{}/facts?limit=1000", victim.id), None)
        .await;
    let facts = v["facts"].as_array().unwrap();
    assert!(!facts.is_empty(), "the wrong secret was not recorded for the run");
    for f in facts {
        assert_eq!(f["reason"], "auth_invalid");
        let d = f["detail"].as_str().unwrap();
        assert!(
            !d.contains("xxxx") && !d.contains("evil.test"),
            "attacker text in the run's facts: {d}"
        );
    }
    let all = p.facts().await;
    let unknown_fact = all
        .iter()
        .find(|f| f.run_id.is_none() && f.reason == "auth_invalid")
        .unwrap();
    assert!(unknown_fact.detail.len() <= egress_proxy::facts::MAX_DETAIL + 3);
}

#[tokio::test]
async fn facts_and_answers_quoting_attacker_text_are_bounded() {
    let p = TestProxy::start("[tools.web]\negress = [\"allowed.test:80\"]\n").await;
    let run = p.run("web").await;
    let big = "h".repeat(30_000);
    // host_mismatch quoting a 30 KB Host value.
    let req = format!(
        "GET http://allowed.test/ HTTP/1.1\r\nHost: {big}.test\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
        run.auth()
    );
    let r = send(p.proxy, req.as_bytes()).await;
    assert_eq!(r.deny_reason(), Some("host_mismatch"));
    assert!(r.body.len() < 1024, "answer of {} bytes", r.body.len());
    // bad_target quoting a huge authority.
    let req = format!(
        "CONNECT {big}.test:443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    let r = send(p.proxy, req.as_bytes()).await;
    assert_eq!(r.deny_reason(), Some("bad_target"));
    let facts = p.facts().await;
    assert!(facts.len() >= 2);
    for f in &facts {
        let size = serde_json::to_string(f).unwrap().len();
        assert!(size < 2048, "a fact of {size} bytes: {}", f.detail);
    }
}

#[tokio::test]
async fn a_denial_names_its_fact_by_id_not_by_global_seq() {
    let p = TestProxy::start("[tools.web]\negress = []\n").await;
    let other = p.run("web").await;
    let me = p.run("web").await;
    for _ in 0..3 {
        p.get(&other, "http://evil.test/", "").await;
    }
    let r = p.get(&me, "http://evil.test/", "").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));
    assert!(r.header("x-egress-fact-seq").is_none(), "the global seq leaks to tools");
    let id = r.header("x-egress-fact-id").expect("fact id header");
    let (_, v) = p.control("GET", &format!("/v1/runs/{}/facts", me.id), None).await;
    assert_eq!(v["facts"][0]["id"], id);
}

/// One keep-alive request on `s` (the connection stays open).
async fn keep_alive_get(s: &mut TcpStream, auth: &str, url: &str) -> egress_e2e::raw::RawResponse {
    let host = url.trim_start_matches("http://").split('/').next().unwrap();
    let req = format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), egress_e2e::raw::read_response(s, false))
        .await
        .expect("no answer within 5 s")
        .unwrap()
}

async fn idle_sockets(addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut v = vec![];
    for _ in 0..n {
        v.push(TcpStream::connect(addr).await.unwrap());
    }
    v
}

async fn count_closed(socks: &mut [TcpStream]) -> usize {
    let mut closed = 0;
    for s in socks.iter_mut() {
        let mut b = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(5), tokio::io::AsyncReadExt::read(s, &mut b)).await
        {
            closed += 1;
        }
    }
    closed
}

#[tokio::test]
async fn idle_unauthenticated_sockets_cannot_lock_runs_out_of_the_data_listener() {
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start_with(
        "max_connections = 32\nmax_pending_connections = 16\npending_head_timeout_ms = 1000",
        &tool(port, "fetch_timeout_ms = 5000"),
        None,
    )
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let mut idle = idle_sockets(p.proxy, 100).await;
    let t0 = Instant::now();
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let r = keep_alive_get(&mut s, &run.auth(), &format!("http://allowed.test:{port}/")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "the run waited {:?} behind idle sockets",
        t0.elapsed()
    );
    let closed = count_closed(&mut idle).await;
    assert!(
        closed >= 84,
        "only {closed} of 100 idle sockets were pushed out by newer ones"
    );
    // The rest are closed by the head deadline; the established one is not.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(count_closed(&mut idle).await, 100);
    let r = keep_alive_get(&mut s, &run.auth(), &format!("http://allowed.test:{port}/")).await;
    assert_eq!(
        r.status, 200,
        "the authenticated connection was closed with the pending ones"
    );
    let m = p.metrics().await;
    assert!(
        sample(
            &m,
            "egress_connections_closed_total{listener=\"data\",reason=\"evicted\"}"
        ) >= 84.0,
        "{m}"
    );
    assert!(
        sample(
            &m,
            "egress_connections_closed_total{listener=\"data\",reason=\"head_timeout\"}"
        ) >= 1.0
    );
}

#[tokio::test]
async fn per_run_connection_caps_keep_runs_from_taking_every_place() {
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start_with(
        "max_connections = 5\nmax_connections_per_run = 3",
        &tool(port, "fetch_timeout_ms = 5000"),
        None,
    )
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let (a, b) = (p.run("web").await, p.run("web").await);
    let url = format!("http://allowed.test:{port}/");
    let mut held = vec![];
    for _ in 0..3 {
        let mut s = TcpStream::connect(p.proxy).await.unwrap();
        assert_eq!(keep_alive_get(&mut s, &a.auth(), &url).await.status, 200);
        held.push(s);
    }
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let r = keep_alive_get(&mut s, &a.auth(), &url).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-egress-error"), Some("run_connection_limit"));
    // The other run still gets in.
    for _ in 0..2 {
        let mut s = TcpStream::connect(p.proxy).await.unwrap();
        assert_eq!(keep_alive_get(&mut s, &b.auth(), &url).await.status, 200);
        held.push(s);
    }
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let r = keep_alive_get(&mut s, &b.auth(), &url).await;
    assert_eq!((r.status, r.header("x-egress-error")), (503, Some("connection_limit")));
    // A closed connection gives its place back.
    drop(held.remove(0));
    let t0 = Instant::now();
    loop {
        let mut s = TcpStream::connect(p.proxy).await.unwrap();
        if keep_alive_get(&mut s, &b.auth(), &url).await.status == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(3), "the place was never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn idle_sockets_cannot_lock_kernels_out_of_the_control_api() {
    let p = TestProxy::start_with(
        "max_pending_connections = 32\npending_head_timeout_ms = 1000\nmax_control_connections = 8",
        "[tools.web]\negress = []\n",
        None,
    )
    .await;
    let mut idle = idle_sockets(p.control, 300).await;
    let t0 = Instant::now();
    let r = p.control_raw("GET", "/healthz", None, None).await;
    assert_eq!(r.status, 200);
    let run = p.run("web").await;
    p.end(&run).await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "kernels waited {:?} behind idle sockets",
        t0.elapsed()
    );
    assert!(count_closed(&mut idle).await >= 268);
    let m = p.metrics().await;
    assert!(
        sample(
            &m,
            "egress_connections_closed_total{listener=\"control\",reason=\"evicted\"}"
        ) >= 268.0
    );
}

#[tokio::test]
async fn event_streams_have_their_own_cap() {
    let p = TestProxy::start_with("max_event_streams = 2", "[tools.web]\negress = []\n", None).await;
    let mut streams = vec![];
    for _ in 0..2 {
        let mut s = TcpStream::connect(p.control).await.unwrap();
        let req = format!(
            "GET /v1/facts/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
            egress_e2e::harness::TOKEN
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let r = egress_e2e::raw::read_response(&mut s, true).await.unwrap();
        assert_eq!(r.status, 200);
        streams.push(s);
    }
    let r = p
        .control_raw("GET", "/v1/facts/stream", None, Some(egress_e2e::harness::TOKEN))
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("too_many_streams"));
    // Request handling is unaffected.
    let run = p.run("web").await;
    p.end(&run).await;
    drop(streams);
}

/// Adds `addr` (with a prefix) to `lo` inside the isolated namespace.
fn add_to_lo(addr: &str) {
    let ok = std::process::Command::new("ip")
        .args(["addr", "add", addr, "dev", "lo"])
        .status()
        .unwrap();
    assert!(ok.success(), "cannot add {addr} to lo inside the namespace");
}

/// The host's own interface addresses are as much "inside" as loopback: a
/// service bound to `0.0.0.0` there is not reachable through an allowed name,
/// including an address that appears after start (picked up on reload).
/// Runs in a namespace holding only `lo`, where the fake DNS answers a
/// non-special address given to `lo`.
#[tokio::test]
async fn the_hosts_own_addresses_are_denied_in_an_isolated_netns() {
    if !egress_e2e::netns::isolated("the_hosts_own_addresses_are_denied_in_an_isolated_netns") {
        return;
    }
    add_to_lo("11.22.33.44/32");
    let admin = egress_e2e::origin::canary("0.0.0.0:0").await;
    let port = admin.addr.port();
    let dns = egress_e2e::FakeDns::start().await;
    dns.set("admin.test", &["11.22.33.44"]);
    dns.set("later.test", &["11.22.33.55"]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.toml");
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\n[proxy.dns]\nservers = [\"{}\"]\n[tools.web]\negress = [\"admin.test:{port}\", \"later.test:{port}\"]\nfetch_timeout_ms = 3000\n",
        dns.addr
    );
    std::fs::write(&path, &text).unwrap();
    let facts = std::sync::Arc::new(egress_proxy::facts::MemorySink::new(100));
    let p = TestProxy::start_config(dns, &text, Some(path.clone()), Some(facts)).await;
    let run = p.run("web").await;
    let (r, _) = p.connect(&run, &format!("admin.test:{port}")).await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (403, Some("private_address")),
        "{}",
        r.text()
    );
    // An address added after start is denied once the proxy has re-read them.
    add_to_lo("11.22.33.55/32");
    let (status, v) = p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status, 200, "{v}");
    let (r, _) = p.connect(&run, &format!("later.test:{port}")).await;
    assert_eq!((r.status, r.deny_reason()), (403, Some("private_address")));
    assert_eq!(admin.connections(), 0, "the proxy connected to the host's own address");
    let fact = p.facts().await.into_iter().last().unwrap();
    assert!(fact.detail.contains("this host's own interfaces"), "{}", fact.detail);
    // allow_ranges exempts them.
    std::fs::write(
        &path,
        text.replace("[proxy.dns]", "allow_ranges = [\"11.22.33.0/24\"]\n[proxy.dns]"),
    )
    .unwrap();
    let (status, _) = p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status, 200);
    let (r, _) = p.connect(&run, &format!("admin.test:{port}")).await;
    assert_eq!(r.status, 200);
    assert_eq!(admin.connections(), 1);
}

/// The fact store holds every denial, the runs' secret digests and
/// placeholders: the real binary started under umask 022 makes its files
/// 0600 (the `-wal` and `-shm` too) and its directory 0711 (the CA's public
/// files live below it; 0700 otherwise), and repairs looser modes it finds.
#[tokio::test]
async fn the_fact_store_is_private_whatever_the_umask() {
    use egress_e2e::harness::create_run_at;
    use egress_e2e::process::{bin, free_addr, ProxyProcess};
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let d = tempfile::tempdir().unwrap();
    let umask = d.path().join("umask-022.sh");
    std::fs::write(
        &umask,
        format!("#!/bin/sh\numask 022\nexec {} \"$@\"\n", bin("egress-proxy").display()),
    )
    .unwrap();
    std::fs::set_permissions(&umask, std::fs::Permissions::from_mode(0o755)).unwrap();
    let var = d.path().join("var");
    for (caught, layout) in [(false, "fresh"), (true, "loose")] {
        if caught {
            // What an older proxy, or a hand, left behind.
            std::fs::set_permissions(&var, std::fs::Permissions::from_mode(0o755)).unwrap();
            for f in ["facts.db", "facts.db-wal", "facts.db-shm"] {
                std::fs::set_permissions(var.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
            }
        }
        let (proxy, control) = (free_addr(), free_addr());
        let cfg = d.path().join("egress.toml");
        std::fs::write(
            &cfg,
            format!("[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"var/facts.db\"\n[tools.web]\negress = [\"allowed.test:80\"]\n"),
        )
        .unwrap();
        let pp = ProxyProcess::start_with_bin(&umask, &cfg, proxy, control, egress_e2e::harness::TOKEN, &[]);
        // A run is written to the store, so the WAL and its index exist.
        create_run_at(control, "web").await;
        assert_eq!(mode(&var), 0o711, "{layout}: the store's directory");
        for f in ["facts.db", "facts.db-wal", "facts.db-shm"] {
            assert_eq!(mode(&var.join(f)), 0o600, "{layout}: {f}");
        }
        assert_eq!(mode(&var.join("ca").join("ca.key")), 0o600);
        if caught {
            assert!(pp.logs().contains("repaired"), "a repair is logged: {}", pp.logs());
        }
        drop(pp);
    }
}
