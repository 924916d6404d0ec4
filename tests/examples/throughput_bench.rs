//! Whole-process benchmark of the allowed data path, side by side with a
//! direct connection in the same run: an HTTP origin on 127.0.0.2, the
//! release `egress-proxy` binary, and C keep-alive clients doing
//!   * plain HTTP GETs of a small body (requests/s, p50/p99 latency), and
//!   * one CONNECT tunnel per client streaming bulk bytes (MB/s),
//!
//! each first direct to the origin, then through the proxy. Other proxies
//! (squid, tinyproxy) can be compared with `EXTRA_PROXY=name=ip:port,…`
//! (unauthenticated forward proxies) when they are installed; see
//! `bench/proxies.sh`.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example throughput_bench [seconds] [clients]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, control_call, percentile_ms, TOKEN};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::process::{bench_args, free_addr, release_bin, ProxyProcess};
use egress_e2e::raw::read_response;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// C clients, each on one keep-alive connection to `via`, sending `req` in a loop.
async fn http_load(via: SocketAddr, req: Arc<Vec<u8>>, secs: u64, clients: usize) -> (f64, f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = vec![];
    for _ in 0..clients {
        let (stop, req) = (stop.clone(), req.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(via).await.unwrap();
            s.set_nodelay(true).unwrap();
            let mut lat = Vec::with_capacity(100_000);
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                // A proxy that closes after each response (no keep-alive) pays a reconnect.
                let r = match s.write_all(&req).await {
                    Ok(()) => read_response(&mut s, false).await,
                    Err(e) => Err(e),
                };
                let r = match r {
                    Ok(r) => r,
                    Err(_) => {
                        s = TcpStream::connect(via).await.unwrap();
                        s.set_nodelay(true).unwrap();
                        s.write_all(&req).await.unwrap();
                        read_response(&mut s, false).await.unwrap()
                    }
                };
                assert_eq!(r.status, 200, "{}", r.text());
                lat.push(t0.elapsed());
                if r.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) {
                    s = TcpStream::connect(via).await.unwrap();
                    s.set_nodelay(true).unwrap();
                }
            }
            lat
        }));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = vec![];
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let rate = all.len() as f64 / t0.elapsed().as_secs_f64();
    (
        rate.round(),
        percentile_ms(&mut all, 0.5),
        percentile_ms(&mut all, 0.99),
    )
}

/// C tunnels (or direct connections) to an echo origin, each pushing 64 KiB
/// writes and reading them back; returns MB/s of echoed payload.
async fn bulk_load(connect: impl Fn() -> tokio::task::JoinHandle<TcpStream>, secs: u64, clients: usize) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for _ in 0..clients {
        let s = connect().await.unwrap();
        let (stop, bytes) = (stop.clone(), bytes.clone());
        tasks.push(tokio::spawn(async move {
            let (mut r, mut w) = s.into_split();
            let chunk = vec![7u8; 64 * 1024];
            let stop2 = stop.clone();
            let writer = tokio::spawn(async move {
                while !stop2.load(Ordering::Relaxed) {
                    if w.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
                let _ = w.shutdown().await;
            });
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        bytes.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            }
            let _ = writer.await;
        }));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let moved = bytes.load(Ordering::Relaxed);
    let el = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    (moved as f64 / el / 1e6 * 10.0).round() / 10.0
}

/// `EXTRA_PROXY="squid=127.0.0.1:3180,tinyproxy=127.0.0.1:8888"`: unauthenticated
/// forward proxies to measure in the same run.
fn extra_proxies() -> Vec<(String, SocketAddr)> {
    std::env::var("EXTRA_PROXY")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or(("extra", kv));
            (k.to_owned(), v.parse().unwrap())
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let (secs, clients) = bench_args(16);
    let origin = http_origin("127.0.0.2:0").await;
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let dns = egress_e2e::FakeDns::start().await;
    dns.set("origin.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\nallow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n[tools.bench]\negress = [\"origin.test:{}\", \"origin.test:{}\"]\nfetch_timeout_ms = 600000\nmax_concurrent_fetches = 1024\n",
            dns.addr,
            origin.addr.port(),
            echo.port()
        ),
    )
    .unwrap();
    let mut p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);
    let r = control_call(control, "POST", "/v1/runs", Some(json!({"tool": "bench"})), Some(TOKEN)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let auth = basic(v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());

    let port = origin.addr.port();
    let direct_req = Arc::new(format!("GET /bytes?n=1024 HTTP/1.1\r\nHost: origin.test:{port}\r\n\r\n").into_bytes());
    let proxy_req = Arc::new(
        format!(
            "GET http://origin.test:{port}/bytes?n=1024 HTTP/1.1\r\nHost: origin.test:{port}\r\nProxy-Authorization: {auth}\r\n\r\n"
        )
        .into_bytes(),
    );
    let mut rows: Vec<(&str, (f64, f64, f64))> = vec![];
    let d = http_load(origin.addr, direct_req, secs, clients).await;
    rows.push(("direct", d));
    let e = http_load(proxy, proxy_req, secs, clients).await;
    rows.push(("egress-proxy", e));
    let extras = extra_proxies();
    for (name, addr) in &extras {
        let req = Arc::new(
            format!("GET http://127.0.0.2:{port}/bytes?n=1024 HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\n\r\n").into_bytes(),
        );
        rows.push((name.as_str(), http_load(*addr, req, secs, clients).await));
    }
    let m = control_call(control, "GET", "/metrics", None, None).await.text();
    let reused = egress_e2e::harness::sample(&m, "egress_upstream_reused_total");
    let dialled = egress_e2e::harness::sample(&m, "egress_connect_duration_seconds_count");
    println!("\negress-proxy upstream connections: {dialled} dialled, {reused} fetches reused an idle one");
    println!("\nHTTP GET 1 KiB, {clients} keep-alive clients, {secs} s each:\n");
    println!("| path | requests/s | p50 ms | p99 ms | vs direct |");
    println!("|---|---|---|---|---|");
    for (name, (rate, p50, p99)) in &rows {
        println!("| {name} | {rate} | {p50} | {p99} | {:.2} |", rate / d.0);
    }

    let echo_addr = echo;
    let direct_mb = bulk_load(
        move || tokio::spawn(async move { TcpStream::connect(echo_addr).await.unwrap() }),
        secs,
        clients,
    )
    .await;
    let auth2 = auth.clone();
    let tunnel_mb = bulk_load(
        move || {
            let auth = auth2.clone();
            tokio::spawn(async move {
                let target = format!("origin.test:{}", echo_addr.port());
                let (r, s) = egress_e2e::raw::connect(proxy, &target, Some(&auth)).await;
                assert_eq!(r.status, 200);
                s
            })
        },
        secs,
        clients,
    )
    .await;
    println!("\nCONNECT bulk echo (64 KiB writes), {clients} tunnels, {secs} s each:\n");
    println!("| path | MB/s echoed | vs direct |");
    println!("|---|---|---|");
    println!("| direct | {direct_mb} | 1.00 |");
    println!("| egress-proxy tunnel | {tunnel_mb} | {:.2} |", tunnel_mb / direct_mb);
    for (name, addr) in &extras {
        let addr = *addr;
        let mb = bulk_load(
            move || {
                tokio::spawn(async move {
                    let (r, s) = egress_e2e::raw::connect(addr, &echo_addr.to_string(), None).await;
                    assert_eq!(r.status, 200, "{}", r.text());
                    s
                })
            },
            secs,
            clients,
        )
        .await;
        println!("| {name} tunnel | {mb} | {:.2} |", mb / direct_mb);
    }
    p.signal("TERM");
    let _ = p.wait_exit(Duration::from_secs(15));
}
