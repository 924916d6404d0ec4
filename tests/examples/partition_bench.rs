//! Whole-process benchmark of a partition in the fleet: the release
//! `egress-proxy` as cell `cell-a` on the fleet's network of namespaces
//! (`egress_e2e::fleet_net`; root and Debian's `postgresql` needed), a
//! steady denial flood from the kernel's host, and the cell's port on the
//! data bridge cut for P seconds mid-flood. Measures the lag when the cut
//! heals, the time until it is 0 again, the catch-up rate, and that the
//! flood's rate held through the cut.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example partition_bench [cut seconds] [rate per second]`
//! (defaults 60 and 1000).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::fleet_net::FleetNet;
use egress_e2e::harness::{basic, control_call, create_run_at, TOKEN};
use egress_e2e::postgres::Postgres;
use egress_e2e::process::{release_bin, write_config, ProxyProcess};
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

/// Denials at `rate` per second (4 keep-alive clients, paced) until `stop`;
/// counts them in `total`.
async fn steady(proxy: SocketAddr, auth: String, rate: u64, stop: Arc<AtomicBool>, total: Arc<AtomicU64>) {
    let mut tasks = vec![];
    for c in 0..4u64 {
        let (auth, stop, total) = (auth.clone(), stop.clone(), total.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let mut tick = tokio::time::interval(Duration::from_micros(4_000_000 / rate));
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let host = format!("c{c}-{i}.denied.example");
                let req = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\n\r\n");
                s.write_all(req.as_bytes()).await.unwrap();
                assert_eq!(read_response(&mut s, false).await.unwrap().status, 403);
                total.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn main() {
    let Some(net) = FleetNet::enter_program(&["cell-a"]) else {
        return;
    };
    let mut args = std::env::args().skip(1);
    let cut_secs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(60);
    let rate: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let Some(pg) = Postgres::start_in(Some(&net.ns("db")), net.db_ip()) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ip = net.service_ip("cell-a");
        let (proxy, control): (SocketAddr, SocketAddr) =
            (format!("{ip}:3128").parse().unwrap(), format!("{ip}:3129").parse().unwrap());
        let cfg = write_config(
            dir.path(),
            proxy,
            control,
            "[tools.web]\negress = []\nmax_concurrent_fetches = 64\n\
             [cell]\nid = \"cell-a\"\n[export]\nsink = \"postgres\"\nmax_lag = 1000000000\n",
        );
        let dsn = pg.dsn();
        let _p = ProxyProcess::start_within(
            Some(&net.ns("cell-a")),
            &release_bin(),
            &cfg,
            (proxy, control),
            TOKEN,
            &[],
            &[("EGRESS_EXPORT_DSN", dsn.as_str())],
        );
        let (id, secret) = create_run_at(control, "web").await;
        let (stop, total) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let flood = tokio::spawn(steady(proxy, basic(&id, &secret), rate, stop.clone(), total.clone()));
        let count_for = async |secs: u64| {
            let (n0, t0) = (total.load(Ordering::Relaxed), Instant::now());
            tokio::time::sleep(Duration::from_secs(secs)).await;
            (total.load(Ordering::Relaxed) - n0) as f64 / t0.elapsed().as_secs_f64()
        };
        let before = count_for(5).await;
        let lag_before = lag(control).await;
        net.cut("cell-a");
        let during = count_for(cut_secs).await;
        let lag_at_heal = lag(control).await;
        net.heal("cell-a");
        let t0 = Instant::now();
        let mut least = u64::MAX;
        loop {
            let l = lag(control).await;
            least = least.min(l);
            if l == 0 || t0.elapsed() > Duration::from_secs(120) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let caught_up = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        flood.await.unwrap();
        println!(
            "steady flood at {rate}/s asked: {before:.0} denials/s before the cut (lag {lag_before}), {during:.0}/s during the {cut_secs} s cut"
        );
        println!(
            "lag when healed: {lag_at_heal} facts; 0 again {caught_up:.2} s after healing (while the flood went on) = {:.0} facts/s above the flood",
            lag_at_heal as f64 / caught_up
        );
        assert_eq!(least, 0, "the lag did not reach 0 within 120 s");
        let rows = pg.number("SELECT count(*) FROM egress_facts");
        let max = pg.number("SELECT max(seq) FROM egress_facts");
        assert_eq!(rows, max, "exported exactly once");
    });
}
