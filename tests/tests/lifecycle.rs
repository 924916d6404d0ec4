//! Deadlines, concurrency slots and run ends: slow DNS, a blackholed connect
//! and a slow origin each end within the fetch deadline plus a margin; slots
//! are held for a fetch's whole life and released on every exit path; ending
//! a run severs its tunnels and in-flight requests at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::TestProxy;
use egress_e2e::origin::{black_hole, echo_origin, http_origin};
use egress_e2e::raw::{echo_through, read_response, wait_closed};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MARGIN: Duration = Duration::from_millis(1500);

fn tool(port: u16, timeout_ms: u64, slots: u64, queued: u64) -> String {
    format!(
        "[tools.web]\negress = [\"allowed.test:{port}\", \"slow.test:{port}\", \"hole.test:{port}\"]\nfetch_timeout_ms = {timeout_ms}\nmax_concurrent_fetches = {slots}\nmax_queued_fetches = {queued}\n"
    )
}

#[tokio::test]
async fn slow_dns_ends_at_the_deadline_with_504() {
    let p = TestProxy::start(&tool(443, 400, 4, 4)).await;
    p.dns.set("slow.test", &["127.0.0.2"]);
    p.dns.delay("slow.test", Duration::from_secs(5));
    let run = p.run("web").await;
    let t0 = Instant::now();
    let (r, _) = p.connect(&run, "slow.test:443").await;
    let took = t0.elapsed();
    assert_eq!((r.status, r.header("x-egress-error")), (504, Some("timeout")));
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(400) + MARGIN,
        "{took:?}"
    );
    assert!(p.facts().await.is_empty(), "timeouts are errors, not denials");
    p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn blackholed_connect_ends_at_the_deadline() {
    let hole = black_hole("127.0.0.2").await;
    let port = hole.addr.port();
    let p = TestProxy::start(&tool(port, 500, 4, 4)).await;
    p.dns.set("hole.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let t0 = Instant::now();
    let (r, _) = p.connect(&run, &format!("hole.test:{port}")).await;
    let took = t0.elapsed();
    assert_eq!(
        (r.status, r.header("x-egress-error")),
        (504, Some("timeout")),
        "{}",
        r.text()
    );
    assert!(took < Duration::from_millis(500) + MARGIN, "{took:?}");
    let m = p.metrics().await;
    assert!(
        m.contains("egress_timeouts_total{tool=\"web\",phase=\"connect\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn slow_origin_head_gets_504_and_slow_body_is_cut() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let p = TestProxy::start(&tool(port, 600, 4, 4)).await;
    p.dns.set("slow.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let t0 = Instant::now();
    let r = p
        .get(&run, &format!("http://slow.test:{port}/slow-head?ms=5000"), "")
        .await;
    assert_eq!((r.status, r.header("x-egress-error")), (504, Some("timeout")));
    assert!(t0.elapsed() < Duration::from_millis(600) + MARGIN);

    // Body already streaming when the deadline hits: the connection is closed.
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let req = format!(
        "GET http://slow.test:{port}/slow-body?ms=50 HTTP/1.1\r\nHost: slow.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    let t0 = Instant::now();
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_response(&mut s, true).await.unwrap();
    assert_eq!(head.status, 200);
    let closed = wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("connection was not closed at the deadline");
    assert!(t0.elapsed() < Duration::from_millis(600) + MARGIN, "{closed:?}");
    p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn tunnels_live_no_longer_than_the_deadline() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start(&tool(port, 700, 4, 4)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let t0 = Instant::now();
    let (r, mut s) = p.connect(&run, &format!("allowed.test:{port}")).await;
    assert_eq!(r.status, 200);
    assert_eq!(echo_through(&mut s, b"abc").await, b"abc");
    wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("tunnel outlived its deadline");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(650) && took < Duration::from_millis(700) + MARGIN,
        "{took:?}"
    );
    p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn idle_tunnels_are_closed() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start_with("tunnel_idle_timeout_ms = 300", &tool(port, 30_000, 4, 4), None).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let (r, mut s) = p.connect(&run, &format!("allowed.test:{port}")).await;
    assert_eq!(r.status, 200);
    // Activity keeps it open past the idle timeout...
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(echo_through(&mut s, b"keepalive").await, b"keepalive");
    }
    // ...silence closes it.
    let t0 = Instant::now();
    wait_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("idle tunnel not closed");
    assert!(t0.elapsed() < Duration::from_millis(300) + MARGIN);
}

#[tokio::test]
async fn slots_bound_concurrency_and_are_held_by_tunnels() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start(&tool(port, 800, 2, 0)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let target = format!("allowed.test:{port}");
    let (r1, mut t1) = p.connect(&run, &target).await;
    let (r2, _t2) = p.connect(&run, &target).await;
    assert_eq!((r1.status, r2.status), (200, 200));
    assert_eq!(p.slots_in_use(&run).await, 2);
    // No queue: the third is denied at once.
    let (r3, _) = p.connect(&run, &target).await;
    assert_eq!((r3.status, r3.deny_reason()), (403, Some("concurrency_limit")));
    // Closing a tunnel frees its slot.
    t1.shutdown().await.unwrap();
    drop(t1);
    p.wait_slots(&run, 1).await;
    let (r4, mut t4) = p.connect(&run, &target).await;
    assert_eq!(r4.status, 200);
    assert_eq!(echo_through(&mut t4, b"x").await, b"x");
    let facts = p.facts().await;
    assert_eq!(facts.iter().filter(|f| f.reason == "concurrency_limit").count(), 1);
}

#[tokio::test]
async fn waiting_for_a_slot_is_fifo_and_bounded_by_the_deadline() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start(&tool(port, 800, 1, 4)).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let target = format!("allowed.test:{port}");
    // The holder gives its slot back after 200 ms: the waiter gets it then.
    let (r1, mut t1) = p.connect(&run, &target).await;
    assert_eq!(r1.status, 200);
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        t1.shutdown().await.unwrap();
        drop(t1);
    });
    let t0 = Instant::now();
    let (r2, t2) = p.connect(&run, &target).await;
    assert_eq!(r2.status, 200);
    assert!(
        t0.elapsed() >= Duration::from_millis(150),
        "the waiter did not wait: {:?}",
        t0.elapsed()
    );
    release.await.unwrap();
    // A holder that keeps its tunnel: the waiter's wait ends by its own deadline
    // (the holder's deadline, a little earlier, may hand the slot over just in time).
    let t0 = Instant::now();
    let (r3, _) = p.connect(&run, &target).await;
    assert!(r3.status == 504 || r3.status == 200, "{}", r3.status);
    assert!(t0.elapsed() < Duration::from_millis(800) + MARGIN, "{:?}", t0.elapsed());
    drop(t2);
    let m = p.metrics().await;
    let waited = egress_e2e::harness::sample(&m, "egress_slot_wait_seconds_sum{tool=\"web\"}");
    assert!(waited >= 0.15, "slot wait histogram: {waited}");
}

#[tokio::test]
async fn slots_are_released_when_the_client_aborts_during_dns() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let port = echo.port();
    let p = TestProxy::start(&tool(port, 10_000, 1, 4)).await;
    p.dns.set("slow.test", &["127.0.0.2"]);
    p.dns.delay("slow.test", Duration::from_secs(8));
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let req = format!(
        "CONNECT slow.test:{port} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    p.wait_slots(&run, 1).await;
    drop(s);
    p.wait_slots(&run, 0).await;
    let t0 = Instant::now();
    let (r, _) = p.connect(&run, &format!("allowed.test:{port}")).await;
    assert_eq!(r.status, 200);
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "the aborted fetch still held the slot"
    );
}

#[tokio::test]
async fn slots_are_released_when_the_client_aborts_during_connect_and_mid_body() {
    let hole = black_hole("127.0.0.2").await;
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"hole.test:{}\", \"slow.test:{}\"]\nfetch_timeout_ms = 20000\nmax_concurrent_fetches = 1\n",
        hole.addr.port(),
        origin.addr.port()
    ))
    .await;
    p.dns.set("hole.test", &["127.0.0.2"]);
    p.dns.set("slow.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let req = format!(
        "CONNECT hole.test:{} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {}\r\n\r\n",
        hole.addr.port(),
        run.auth()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    p.wait_slots(&run, 1).await;
    drop(s);
    p.wait_slots(&run, 0).await;

    let mut s = TcpStream::connect(p.proxy).await.unwrap();
    let port = origin.addr.port();
    let req = format!(
        "GET http://slow.test:{port}/slow-body?ms=50 HTTP/1.1\r\nHost: slow.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_response(&mut s, true).await.unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(p.slots_in_use(&run).await, 1, "the slot is held while the body streams");
    drop(s);
    p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn ending_a_run_severs_tunnels_and_in_flight_requests() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"allowed.test:{}\", \"slow.test:{}\"]\nfetch_timeout_ms = 30000\n",
        echo.port(),
        origin.addr.port()
    ))
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    p.dns.set("slow.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let (r, mut tunnel) = p.connect(&run, &format!("allowed.test:{}", echo.port())).await;
    assert_eq!(r.status, 200);
    assert_eq!(echo_through(&mut tunnel, b"x").await, b"x");

    let port = origin.addr.port();
    let mut slow = TcpStream::connect(p.proxy).await.unwrap();
    let req = format!(
        "GET http://slow.test:{port}/slow-head?ms=20000 HTTP/1.1\r\nHost: slow.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    slow.write_all(req.as_bytes()).await.unwrap();
    p.wait_slots(&run, 2).await;

    let t0 = Instant::now();
    p.end(&run).await;
    wait_closed(&mut tunnel, Duration::from_secs(5))
        .await
        .expect("tunnel survived the end of its run");
    let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut slow, false))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((r.status, r.header("x-egress-error")), (503, Some("run_ended")));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "severing took {:?}",
        t0.elapsed()
    );
    p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn upstream_connections_are_reused_only_by_their_run_and_only_to_vetted_addresses() {
    // Two origins on the same port: 127.0.0.2 and 127.0.0.4, both allowed.
    let port = egress_e2e::origin::port_free_on(&["127.0.0.2", "127.0.0.4"]);
    let a = http_origin(&format!("127.0.0.2:{port}")).await;
    let b = http_origin(&format!("127.0.0.4:{port}")).await;
    let p = TestProxy::start_with(
        "allow_ranges = [\"127.0.0.2/32\", \"127.0.0.4/32\"]",
        &format!("[tools.web]\negress = [\"allowed.test:{port}\", \"other.test:{port}\"]\n"),
        None,
    )
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let url = format!("http://allowed.test:{port}/");
    let conns = |o: &egress_e2e::origin::HttpOrigin| o.hits.load(std::sync::atomic::Ordering::SeqCst);
    let run1 = p.run("web").await;
    assert_eq!(p.get(&run1, &url, "").await.status, 200);
    p.wait_upstream_idle(&run1.id, 1).await;
    assert_eq!(p.get(&run1, &url, "").await.status, 200);
    assert_eq!(conns(&a), 1, "the second fetch of the run reused the connection");
    p.wait_upstream_idle(&run1.id, 1).await;

    // Another run never gets run1's connection.
    let run2 = p.run("web").await;
    assert_eq!(p.get(&run2, &url, "").await.status, 200);
    assert_eq!(conns(&a), 2);

    // A name resolving elsewhere: the idle connection to 127.0.0.2 is not in this
    // fetch's vetted set, so the fetch dials the new address.
    // (a second name, so no resolver cache can answer with the old address)
    p.dns.set("other.test", &["127.0.0.4"]);
    let r = p.get(&run1, &format!("http://other.test:{port}/"), "").await;
    assert_eq!(r.status, 200);
    assert_eq!((conns(&a), conns(&b)), (2, 1));
    let m = p.metrics().await;
    assert_eq!(egress_e2e::harness::sample(&m, "egress_upstream_reused_total"), 1.0);
    // Ending the run closes its idle connections.
    p.end(&run1).await;
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", run1.id), None).await;
    assert_eq!(v["upstream_idle"], 0);
}
