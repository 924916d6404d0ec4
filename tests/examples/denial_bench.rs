//! Whole-process benchmark of denials: starts the release `egress-proxy`
//! binary twice (durable SQLite facts, then `facts = ":memory:"`), and for
//! each measures
//!   1. unloaded denial latency (one client, sequential, keep-alive): p50/p99;
//!   2. a denial flood (C clients, distinct targets per client): answered
//!      denials/s and fact rows/s;
//!   3. fairness: while one run floods identical denials, another run's
//!      denial latency p50/p99.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example denial_bench [seconds] [clients]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, create_run_at, percentile_ms, TOKEN};
use egress_e2e::process::{bench_args, free_addr, release_bin, ProxyProcess};
use egress_e2e::raw::read_response;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn run_for(control: SocketAddr) -> String {
    let (id, secret) = create_run_at(control, "web").await;
    basic(&id, &secret)
}

async fn deny_once(s: &mut TcpStream, req: &[u8]) -> Duration {
    let t0 = Instant::now();
    s.write_all(req).await.unwrap();
    let r = read_response(s, false).await.unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    t0.elapsed()
}

fn req(target: &str, auth: &str) -> Vec<u8> {
    format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth}\r\n\r\n").into_bytes()
}

async fn fact_rows(control: SocketAddr) -> u64 {
    egress_e2e::harness::all_facts_at(control).await.len() as u64
}

async fn measure(label: &str, facts: &str, secs: u64, clients: usize) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!("[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"{facts}\"\n[tools.web]\negress = []\nmax_concurrent_fetches = 64\n"),
    )
    .unwrap();
    let mut p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);

    // 1. Unloaded latency.
    let auth = run_for(control).await;
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut lat = vec![];
    for i in 0..2000u32 {
        lat.push(deny_once(&mut s, &req(&format!("seq{}.test", i % 50), &auth)).await);
    }
    let (p50, p99) = (percentile_ms(&mut lat, 0.5), percentile_ms(&mut lat, 0.99));

    // 2. Flood: C clients, each its own run and targets (little coalescing).
    let rows0 = fact_rows(control).await;
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for c in 0..clients {
        let auth = run_for(control).await;
        let (stop, answered) = (stop.clone(), answered.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                deny_once(&mut s, &req(&format!("c{c}-{}.test", i % 1000), &auth)).await;
                answered.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let flood_rate = answered.load(Ordering::Relaxed) as f64 / elapsed;
    let rows = fact_rows(control).await - rows0;
    let rows_rate = rows as f64 / elapsed;

    // 3. Fairness: a flooder loops on one denied host; a victim measures.
    let stop = Arc::new(AtomicBool::new(false));
    let mut flooders = vec![];
    for _ in 0..clients {
        let auth = run_for(control).await;
        let stop = stop.clone();
        flooders.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let r = req("same.test", &auth);
            while !stop.load(Ordering::Relaxed) {
                deny_once(&mut s, &r).await;
            }
        }));
    }
    let victim = run_for(control).await;
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut vl = vec![];
    let t0 = Instant::now();
    let mut i = 0u32;
    while t0.elapsed() < Duration::from_secs(secs) {
        vl.push(deny_once(&mut s, &req(&format!("victim{}.test", i % 100), &victim)).await);
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.await.unwrap();
    }
    let (v50, v99) = (percentile_ms(&mut vl, 0.5), percentile_ms(&mut vl, 0.99));
    p.signal("TERM");
    let _ = p.wait_exit(Duration::from_secs(15));
    let out = json!({
        "sink": label,
        "unloaded_p50_ms": p50, "unloaded_p99_ms": p99,
        "flood_clients": clients, "flood_denials_per_s": flood_rate.round(), "flood_fact_rows_per_s": rows_rate.round(),
        "victim_p50_ms_under_flood": v50, "victim_p99_ms_under_flood": v99,
    });
    println!("{out}");
    out
}

#[tokio::main]
async fn main() {
    let (secs, clients) = bench_args(32);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("facts.db");
    let sqlite = measure("sqlite (WAL, synchronous=FULL)", db.to_str().unwrap(), secs, clients).await;
    let memory = measure("memory", ":memory:", secs, clients).await;
    println!("\n| sink | unloaded p50 | unloaded p99 | flood denials/s | fact rows/s | victim p50 under flood | victim p99 under flood |");
    println!("|---|---|---|---|---|---|---|");
    for v in [sqlite, memory] {
        println!(
            "| {} | {} ms | {} ms | {} | {} | {} ms | {} ms |",
            v["sink"].as_str().unwrap(),
            v["unloaded_p50_ms"],
            v["unloaded_p99_ms"],
            v["flood_denials_per_s"],
            v["flood_fact_rows_per_s"],
            v["victim_p50_ms_under_flood"],
            v["victim_p99_ms_under_flood"]
        );
    }
}
