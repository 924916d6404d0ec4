//! Whole-process benchmark of the fleet export: the release `egress-proxy`
//! with `[export] sink = "postgres"` and a throwaway PostgreSQL 15 on
//! loopback (root and Debian's `postgresql` needed, see
//! `egress_e2e::postgres`). Measures
//!   1. the local denial rate (C clients, distinct targets) with the
//!      exporter running, and the export lag at the end of the flood;
//!   2. export throughput: a backlog built while PostgreSQL is stopped,
//!      then the time until the lag is 0 once it is back (facts/s).
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example export_bench [seconds] [clients]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, control_call, create_run_at, TOKEN};
use egress_e2e::postgres::Postgres;
use egress_e2e::process::{bench_args, free_addr, release_bin, ProxyProcess};
use egress_e2e::raw::read_response;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn lag(control: SocketAddr) -> u64 {
    let r = control_call(control, "GET", "/v1/cell", None, Some(TOKEN)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    v["export_lag"].as_u64().unwrap()
}

/// Denials from `clients` keep-alive clients until `stop`; returns how many.
async fn flood(proxy: SocketAddr, auth: &str, clients: usize, stop: Arc<AtomicBool>) -> u64 {
    let total = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for c in 0..clients {
        let (auth, stop, total) = (auth.to_owned(), stop.clone(), total.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let host = format!("c{c}-{i}.denied.example");
                let req = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\n\r\n");
                s.write_all(req.as_bytes()).await.unwrap();
                let r = read_response(&mut s, false).await.unwrap();
                assert_eq!(r.status, 403);
                total.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    total.load(Ordering::Relaxed)
}

async fn flood_for(proxy: SocketAddr, auth: &str, clients: usize, secs: u64) -> (u64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let f = tokio::spawn({
        let (auth, stop) = (auth.to_owned(), stop.clone());
        async move { flood(proxy, &auth, clients, stop).await }
    });
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let n = f.await.unwrap();
    (n, t0.elapsed().as_secs_f64())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let (secs, clients) = bench_args(16);
    let Some(mut pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n\
             [tools.web]\negress = []\nmax_concurrent_fetches = 64\n\
             [cell]\nid = \"bench\"\n[export]\nsink = \"postgres\"\nmax_lag = 1000000000\n"
        ),
    )
    .unwrap();
    let dsn = pg.dsn();
    let _p = ProxyProcess::start_with_env(
        &release_bin(),
        &cfg,
        (proxy, control),
        TOKEN,
        &[],
        &[("EGRESS_EXPORT_DSN", dsn.as_str())],
    );
    let (id, secret) = create_run_at(control, "web").await;
    let auth = basic(&id, &secret);

    // 1. The local denial rate with the exporter keeping up behind it.
    let (n, took) = flood_for(proxy, &auth, clients, secs).await;
    let lag_at_end = lag(control).await;
    let t0 = Instant::now();
    while lag(control).await > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drained = t0.elapsed();
    println!(
        "flood with export: {n} denials in {took:.1} s = {:.0} denials/s ({clients} clients); lag at the end {lag_at_end}, 0 after {:.2} s",
        n as f64 / took,
        drained.as_secs_f64()
    );

    // 2. Export throughput: a backlog built while PostgreSQL is away.
    pg.stop();
    let (backlog, _) = flood_for(proxy, &auth, clients, secs).await;
    let facts = lag(control).await;
    pg.resume();
    let t0 = Instant::now();
    while lag(control).await > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = t0.elapsed().as_secs_f64();
    println!(
        "catch-up: {facts} facts ({backlog} denials) exported in {took:.2} s after PostgreSQL came back = {:.0} facts/s (batch_max 500, includes the reconnection, at most 0.5 s)",
        facts as f64 / took
    );
    let rows = pg.number("SELECT count(*) FROM egress_facts");
    let max = pg.number("SELECT max(seq) FROM egress_facts");
    assert_eq!(rows, max, "exported exactly once");
}
