//! What the fleet's idempotency claim costs a keyed invocation (not a test;
//! needs root and PostgreSQL 15, like `executor/tests/fleet.rs`). Three
//! executors in this process, each with a fake proxy and the same Python
//! tool (warm pool, returns at once): `plain` (no `[export]`), and cells
//! `bench-a` and `bench-b` on one throwaway PostgreSQL on loopback.
//! Measures, over N sequential invocations each, p50/p90 of
//!   1. unkeyed at `plain` (the baseline);
//!   2. keyed at `plain` (the executor's own key map);
//!   3. keyed at `bench-a` (claim, run, store the answer: two statements);
//!   4. each key of 3 retried at `bench-b` (the stored answer, no run);
//!
//! and the claim and finish statements alone (`egress_fleet::Claims`).
//!
//! Run (as root): `cargo run --release -p egress-executor --example
//! claim_bench -- [N] [runs]` (defaults 300, 3).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_e2e::executor::{beside_fake_control, invocation, python_runner, TempDir};
use egress_e2e::fake_control::FakeControl;
use egress_e2e::harness::percentile_ms;
use egress_e2e::postgres::Postgres;
use egress_executor::{Executor, InvocationRequest};
use serde_json::json;

const DSN_ENV: &str = "EGRESS_CLAIM_BENCH_DSN";

async fn executor(tag: &str, fleet: Option<&str>) -> (FakeControl, TempDir, Arc<Executor>) {
    let dir = TempDir::new(tag);
    dir.write("fast.py", "def run(input, ctx):\n    return {'n': input}\n");
    let cell = fleet
        .map(|id| format!("[cell]\nid = \"{id}\"\n[export]\nsink = \"postgres\"\ndsn_env = \"{DSN_ENV}\"\n"))
        .unwrap_or_default();
    let tools = format!(
        "{cell}[tools.fast]\negress = []\n[tools.fast.process]\ncommand = [\"python3\", \"{}\", \"fast.py\"]\n\
         pool = {{ warm = 2, max = 4 }}\nisolation = \"off\"\n",
        python_runner().display()
    );
    let (control, exec) = beside_fake_control(&dir, false, &tools).await;
    exec.warm_up();
    (control, dir, exec)
}

fn request(n: usize, key: Option<String>) -> InvocationRequest {
    InvocationRequest {
        idempotency_key: key,
        ..invocation("fast", json!(n))
    }
}

async fn series(exec: &Executor, n: usize, key: impl Fn(usize) -> Option<String>) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        let r = exec.invoke(request(i, key(i))).await;
        out.push(t0.elapsed());
        assert!(r.ok, "{r:?}");
    }
    out
}

fn line(name: &str, mut v: Vec<Duration>) -> (String, f64) {
    let p50 = percentile_ms(&mut v, 0.5);
    (
        format!(
            "{name:<44} p50 {p50:>7.2} ms  p90 {:>7.2} ms",
            percentile_ms(&mut v, 0.9)
        ),
        p50,
    )
}

fn main() {
    let Some(pg) = Postgres::start() else { return };
    // Read by both cells of this process (one DSN, as in a fleet); set
    // before the runtime starts any thread.
    #[allow(clippy::disallowed_methods)]
    std::env::set_var(DSN_ENV, pg.dsn());
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
    drop(pg);
}

async fn bench() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(300);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let (_c0, _d0, plain) = executor("bench-plain", None).await;
    let (_c1, _d1, a) = executor("bench-a", Some("bench-a")).await;
    let (_c2, _d2, b) = executor("bench-b", Some("bench-b")).await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the pools warm up
    for run in 0..runs {
        let tag = format!("r{run}");
        let mut lines = vec![];
        lines.push(line("unkeyed, no fleet", series(&plain, n, |_| None).await));
        let k = |i: usize| Some(format!("{tag}-plain-{i}"));
        lines.push(line("keyed, no fleet", series(&plain, n, k).await));
        let k = |i: usize| Some(format!("{tag}-fleet-{i}"));
        lines.push(line("keyed, claimed in the fleet (runs)", series(&a, n, k).await));
        lines.push(line(
            "same keys retried at another cell (stored)",
            series(&b, n, k).await,
        ));
        println!("run {}: {n} sequential invocations each", run + 1);
        let base = lines[1].1;
        for (text, p50) in &lines {
            println!("  {text}  ({:+.2} ms vs keyed, no fleet)", p50 - base);
        }
    }
    // The two statements alone.
    let cfg = egress_config::ExportConfig {
        dsn_env: DSN_ENV.into(),
        ..Default::default()
    };
    let claims = egress_fleet::Claims::new(
        egress_fleet::pg::Connector::from_env(&cfg, "claim-bench").unwrap(),
        "public",
        "bench-c",
        None,
        Duration::from_secs(600),
    );
    let (mut claim, mut finish) = (vec![], vec![]);
    for i in 0..n {
        let (key, id) = (format!("raw-{i}"), uuid::Uuid::new_v4().to_string());
        let t0 = Instant::now();
        assert_eq!(
            claims.claim(&key, "d", &id, Duration::from_secs(60)).await.unwrap(),
            egress_fleet::Claim::Won
        );
        claim.push(t0.elapsed());
        let t0 = Instant::now();
        assert!(claims.finish(&key, &id, 200, "{}").await.unwrap());
        finish.push(t0.elapsed());
    }
    println!("statements alone, {n} keys:");
    println!("  {}", line("claim (INSERT … ON CONFLICT … RETURNING)", claim).0);
    println!("  {}", line("finish (UPDATE + bounded prune)", finish).0);
}
