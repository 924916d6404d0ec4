//! Whole-process benchmark of the OTLP audit sink: the release
//! `egress-proxy` with `[audit.sinks.siem] type = "otlp"` sending to the
//! test receiver (`tests/audit/otlp_receiver.py`, which decodes every
//! request with the reference `opentelemetry-proto` package). Measures
//!   1. export throughput: a backlog of denials built while the receiver is
//!      down, then the time until the sink's lag is 0 once it is up
//!      (records/s into the receiver);
//!   2. the lag under a paced flood of denials (a target rate, 30k/s by
//!      default): the denials/s reached, the highest lag seen, the lag at
//!      the end and how long it takes to reach 0.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example audit_bench [seconds] [clients] [target denials/s]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, control_call, create_run_at, sample, TOKEN};
use egress_e2e::process::{cpu_time, free_addr, free_port, python_server, release_bin, KillOnDrop, ProxyProcess};
use egress_e2e::raw::read_response;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const LAG: &str = "egress_audit_sink_lag_records{sink=\"siem\",log=\"facts\"}";
const EXPORTED: &str = "egress_audit_sink_exported_total{sink=\"siem\",log=\"facts\"}";

async fn metric(control: SocketAddr, series: &str) -> f64 {
    let r = control_call(control, "GET", "/metrics", None, Some(TOKEN)).await;
    sample(&r.text(), series)
}

fn receiver(out: &Path, port: u16) -> KillOnDrop {
    let port = std::ffi::OsString::from(port.to_string());
    let args = ["--out".as_ref(), out.as_os_str(), "--port".as_ref(), port.as_os_str()];
    KillOnDrop(python_server("tests/audit/otlp_receiver.py", &args).0)
}

/// Denials from `clients` keep-alive clients until `stop`, together at most
/// `rate` a second (0: as fast as they go); returns how many.
async fn flood(proxy: SocketAddr, auth: &str, clients: usize, rate: u64, stop: Arc<AtomicBool>) -> u64 {
    let total = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    let per_client = if rate == 0 { 0.0 } else { rate as f64 / clients as f64 };
    for c in 0..clients {
        let (auth, stop, total) = (auth.to_owned(), stop.clone(), total.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let t0 = Instant::now();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if per_client > 0.0 {
                    let due = t0 + Duration::from_secs_f64(i as f64 / per_client);
                    tokio::time::sleep_until(due.into()).await;
                }
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

async fn until_lag_zero(control: SocketAddr, cap: Duration) -> Duration {
    let t0 = Instant::now();
    // The gauge is refreshed every 250 ms: two zero readings in a row.
    let mut zeros = 0;
    while zeros < 2 {
        if metric(control, LAG).await == 0.0 {
            zeros += 1;
        } else {
            zeros = 0;
        }
        assert!(t0.elapsed() < cap, "the sink did not catch up within {cap:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let secs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let clients: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let rate: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(30_000);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("got.jsonl");
    let rx_port = free_port();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\nfacts_max_mb = 4096\n\
             [tools.web]\negress = []\nmax_concurrent_fetches = 64\n[cell]\nid = \"bench\"\n\
             [audit.sinks.siem]\ntype = \"otlp\"\nendpoint = \"http://127.0.0.1:{rx_port}\"\nretry_max_ms = 200\nflush_ms = 50\n"
        ),
    )
    .unwrap();
    let p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);
    let (id, secret) = create_run_at(control, "web").await;
    let auth = basic(&id, &secret);

    // 1. Throughput: a backlog built while the receiver is down.
    let stop = Arc::new(AtomicBool::new(false));
    let f = tokio::spawn({
        let (auth, stop) = (auth.clone(), stop.clone());
        async move { flood(proxy, &auth, clients, 0, stop).await }
    });
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let backlog = f.await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let lag = metric(control, LAG).await;
    let before = metric(control, EXPORTED).await;
    let rx = receiver(&out, rx_port);
    let (proxy_cpu, rx_cpu) = (cpu_time(p.child.id()), cpu_time(rx.0.id()));
    let took = until_lag_zero(control, Duration::from_secs(600)).await;
    let sent = metric(control, EXPORTED).await - before;
    let (proxy_cpu, rx_cpu) = (cpu_time(p.child.id()) - proxy_cpu, cpu_time(rx.0.id()) - rx_cpu);
    println!(
        "export: {sent:.0} records ({backlog} denials, lag {lag:.0}) into the receiver in {:.2} s = {:.0} records/s (batch_max 512, from the receiver's start); CPU: proxy {:.2} s, receiver {:.2} s",
        took.as_secs_f64(),
        sent / took.as_secs_f64(),
        proxy_cpu.as_secs_f64(),
        rx_cpu.as_secs_f64()
    );

    // 2. Lag under a paced flood, the receiver up.
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let f = tokio::spawn({
        let (auth, stop) = (auth.clone(), stop.clone());
        async move { flood(proxy, &auth, clients, rate, stop).await }
    });
    let mut peak = 0.0f64;
    while t0.elapsed() < Duration::from_secs(secs) {
        peak = peak.max(metric(control, LAG).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let n = f.await.unwrap();
    let flood_s = t0.elapsed().as_secs_f64();
    let at_end = metric(control, LAG).await;
    let drained = until_lag_zero(control, Duration::from_secs(600)).await;
    println!(
        "flood: {n} denials in {flood_s:.1} s = {:.0} denials/s (target {rate}/s, {clients} clients); lag peak {peak:.0}, at the end {at_end:.0}, 0 after {:.2} s",
        n as f64 / flood_s,
        drained.as_secs_f64()
    );
    drop(rx);
}
