//! What the decision log costs an allowed fetch: two proxies in this
//! process, each with its fact store in a SQLite file, one with `[proxy]
//! decisions = "all"` and one with `"off"`, a loopback HTTP origin and a
//! loopback echo origin. In the same run, alternating the two proxies
//! round by round, it measures over N sequential operations each:
//!   1. keep-alive: plain-HTTP GETs on one client connection (latency
//!      p50/p90 and requests per second);
//!   2. tunnels: a new CONNECT, 64 bytes echoed, closed (latency p50/p90).
//!
//! The record is offered to the log's queue when the fetch ends and written
//! by its own thread, so the figures should differ by no more than noise.
//! Records written and dropped are printed from the metrics.
//!
//! Usage: `cargo run --release -p egress-e2e --example decisions_bench [n] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{percentile_ms, proxy_section, sample, TestProxy, TestRun};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::FakeDns;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn proxy(store: &Path, mode: &str, tools: &str) -> TestProxy {
    let dns = FakeDns::start().await;
    dns.set("api.test", &["127.0.0.2"]);
    let section = proxy_section(&dns, &format!("decisions = \"{mode}\"")).replace(
        "facts = \"/nonexistent/facts.db\"",
        &format!("facts = \"{}\"", store.display()),
    );
    TestProxy::start_config(dns, &format!("{section}\n{tools}"), None, None).await
}

/// `n` GETs on one keep-alive connection: latencies and the wall time.
async fn keep_alive(p: &TestProxy, run: &TestRun, port: u16, n: usize) -> (Vec<Duration>, Duration) {
    let mut s = tokio::net::TcpStream::connect(p.proxy).await.unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!(
        "GET http://api.test:{port}/ HTTP/1.1\r\nHost: api.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(req.as_bytes()).await.unwrap();
        let r = egress_e2e::raw::read_response(&mut s, false).await.unwrap();
        assert_eq!(r.status, 200);
        lat.push(t.elapsed());
    }
    (lat, t0.elapsed())
}

/// `n` tunnels, each a new CONNECT with 64 bytes echoed.
async fn tunnels(p: &TestProxy, run: &TestRun, port: u16, n: usize) -> Vec<Duration> {
    let mut lat = Vec::with_capacity(n);
    let data = [7u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        let (r, mut s) = p.connect(run, &format!("api.test:{port}")).await;
        assert_eq!(r.status, 200);
        s.write_all(&data).await.unwrap();
        let mut back = [0u8; 64];
        s.read_exact(&mut back).await.unwrap();
        drop(s);
        lat.push(t.elapsed());
    }
    lat
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let rounds: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let origin = http_origin("127.0.0.2:0").await;
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let (port, eport) = (origin.addr.port(), echo.port());
    let tools = format!("[tools.web]\negress = [\"api.test:{port}\", \"api.test:{eport}\"]\n");
    let dir = tempfile::tempdir().unwrap();
    let mut results: Vec<(&str, Vec<Duration>, Duration, Vec<Duration>)> = vec![];
    let off = proxy(&dir.path().join("off.db"), "off", &tools).await;
    let all = proxy(&dir.path().join("all.db"), "all", &tools).await;
    for mode in ["off", "all"] {
        results.push((mode, vec![], Duration::ZERO, vec![]));
    }
    for round in 0..rounds {
        for (i, p) in [&off, &all].into_iter().enumerate() {
            let run = p.run("web").await;
            // Warm-up.
            keep_alive(p, &run, port, 50).await;
            let (lat, wall) = keep_alive(p, &run, port, n).await;
            let tun = tunnels(p, &run, eport, n / 4).await;
            let r = &mut results[i];
            r.1.extend(lat);
            r.2 += wall;
            r.3.extend(tun);
            p.end(&run).await;
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    println!(
        "{rounds} rounds alternating; per round {n} keep-alive GETs on one connection and {} tunnels (CONNECT, 64 bytes echoed) per proxy; in-process proxies, loopback origins, SQLite stores",
        n / 4
    );
    for (mode, mut ka, wall, mut tun) in results {
        let rps = ka.len() as f64 / wall.as_secs_f64();
        println!(
            "  decisions = {mode:<4} keep-alive p50 {:6.3} ms  p90 {:6.3} ms  {rps:8.0} req/s | tunnel p50 {:6.3} ms  p90 {:6.3} ms",
            percentile_ms(&mut ka, 0.5),
            percentile_ms(&mut ka, 0.9),
            percentile_ms(&mut tun, 0.5),
            percentile_ms(&mut tun, 0.9),
        );
    }
    // Let the writer catch up, then read its counters.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = all.metrics().await;
    println!(
        "  decisions = all: {} records written, {} dropped, {} bytes held",
        sample(&m, "egress_decisions_recorded_total"),
        sample(&m, "egress_decisions_dropped_total"),
        sample(&m, "egress_decisions_store_bytes")
    );
}
