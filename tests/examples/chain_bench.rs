//! What the hash chain and signed checkpoints cost durable denials, and how
//! fast `facts verify` reads: the release `egress-proxy` with its records
//! chained but no key ("chained"), with a key signing every second and
//! every 10,000 facts ("signed"), and, when `LOOM_BASE_BIN` names a binary
//! built from before the chain, that one ("base"; the same config without
//! `[audit]`). Rounds alternate the variants; each round floods a fresh
//! store from C keep-alive clients (their own runs, distinct targets) for S
//! seconds and counts answered denials/s. Then `facts verify` reads the
//! largest signed store: records/s.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example chain_bench [seconds] [clients] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, create_run_at, deny_distinct, TOKEN};
use egress_e2e::process::{bench_args, free_addr, release_bin, ProxyProcess};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One round of one variant: answered denials/s, and the store it left.
async fn round(bin: &Path, audit: &str, secs: u64, clients: usize, dir: &Path) -> (f64, PathBuf) {
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n\
             [tools.web]\negress = []\nmax_concurrent_fetches = 64\n{audit}"
        ),
    )
    .unwrap();
    let mut p = ProxyProcess::start_with_bin(bin, &cfg, proxy, control, TOKEN, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = vec![];
    for c in 0..clients {
        let (id, secret) = create_run_at(control, "web").await;
        let auth = basic(&id, &secret);
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            deny_distinct(proxy, &auth, &format!("c{c}"), &stop, u64::MAX).await
        }));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut answered = 0;
    for t in tasks {
        answered += t.await.unwrap();
    }
    let rate = answered as f64 / t0.elapsed().as_secs_f64();
    p.signal("TERM");
    let _ = p.wait_exit(Duration::from_secs(30));
    (rate, dir.join("facts.db"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let (secs, clients) = bench_args(32);
    let rounds: usize = std::env::args().nth(3).and_then(|a| a.parse().ok()).unwrap_or(3);
    let head = release_bin();
    let base = std::env::var_os("LOOM_BASE_BIN").map(PathBuf::from);
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("audit.key");
    let made = std::process::Command::new(&head)
        .args(["audit", "keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(made.status.success());
    let signed = format!(
        "[audit]\nsigning_key_file = \"{}\"\ncheckpoint_ms = 1000\ncheckpoint_records = 10000\n",
        key.display()
    );
    let mut variants: Vec<(&str, &Path, &str)> = vec![("chained", &head, ""), ("signed", &head, &signed)];
    if let Some(b) = &base {
        variants.insert(0, ("base", b, ""));
    }
    let mut rates: Vec<Vec<f64>> = vec![vec![]; variants.len()];
    let mut largest: Option<(u64, tempfile::TempDir)> = None;
    for r in 0..rounds {
        for (i, (name, bin, audit)) in variants.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let (rate, store) = round(bin, audit, secs, clients, dir.path()).await;
            println!("round {r} {name}: {rate:.0} denials/s");
            rates[i].push(rate);
            if *name == "signed" {
                let size = std::fs::metadata(&store).map(|m| m.len()).unwrap_or(0);
                if largest.as_ref().is_none_or(|(s, _)| size > *s) {
                    largest = Some((size, dir));
                }
            }
        }
    }
    let medians: Vec<f64> = rates.iter_mut().map(|v| median(v)).collect();
    let reference = medians[0];
    println!("\nmedian durable denials/s over {rounds} rounds of {secs} s, {clients} clients:");
    for ((name, _, _), m) in variants.iter().zip(&medians) {
        println!("  {name:8} {m:8.0}  ({:.3}x of {})", m / reference, variants[0].0);
    }
    // `facts verify` on the largest signed store.
    let (_, dir) = largest.unwrap();
    let store = dir.path().join("facts.db");
    let public = keys.path().join("audit.key.pub");
    let t0 = Instant::now();
    let out = std::process::Command::new(&head)
        .args(["facts", "verify", "--store"])
        .arg(&store)
        .arg("--key")
        .arg(&public)
        .output()
        .unwrap();
    let took = t0.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let records: u64 = text
        .lines()
        .filter_map(|l| l.split(": ").nth(1)?.split(" ").next()?.parse::<u64>().ok())
        .take(2)
        .sum();
    println!(
        "\nfacts verify: {records} records in {took:.2} s = {:.0} records/s (whole process: open, signatures, both chains)",
        records as f64 / took
    );
}
