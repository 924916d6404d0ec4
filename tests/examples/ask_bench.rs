//! What holding a fetch for a grant costs when the grant comes at once
//! (`on_unlisted = "ask"`): the proxy in this process, a loopback origin,
//! and a kernel stand-in that grants each held fetch the moment its
//! pending fact is recorded. Measures, over N sequential fetches each,
//! the latency p50/p90 of
//!   1. a fetch to a listed name (the baseline);
//!   2. a held fetch granted at once (pending fact, grant, then the fetch);
//!   3. a fetch through a run with request, rate and byte budgets set
//!      (the budget step and byte counting on the path).
//!
//! Usage: `cargo run --release -p egress-e2e --example ask_bench [n]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{percentile_ms, TestProxy};
use egress_e2e::origin::http_origin;
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let tools = format!(
        "[tools.listed]\negress = [\"listed.test:{port}\"]\n\
         [tools.budgeted]\negress = [\"listed.test:{port}\"]\nmax_requests_per_run = 1000000\n\
         max_bytes_per_run = 1000000000\nmax_request_rate = {{ per_second = 1000000, burst = 1000000 }}\n\
         [tools.asker]\negress = []\non_unlisted = \"ask\"\nask_timeout_ms = 5000\n"
    );
    let p = TestProxy::start(&tools).await;
    p.dns.set("listed.test", &["127.0.0.2"]);
    p.dns.set("held.test", &["127.0.0.2"]);

    // The kernel stand-in: grants every pending fetch as soon as its fact is in.
    let mut facts = p.facts.subscribe();
    let control = p.control;
    tokio::spawn(async move {
        while let Ok(f) = facts.recv().await {
            if f.kind != egress_api::PENDING_FACT_TYPE {
                continue;
            }
            let (Some(run), Some(t)) = (f.run_id, f.target) else {
                continue;
            };
            let body = json!({"target": format!("{}:{}", t.host, t.port)});
            let r = egress_e2e::harness::control_call(
                control,
                "POST",
                &format!("/v1/runs/{run}/grants"),
                Some(body),
                Some(egress_e2e::harness::TOKEN),
            )
            .await;
            assert_eq!(r.status, 201, "{}", r.text());
        }
    });

    let mut report = vec![];
    for (tool, host) in [
        ("listed", "listed.test"),
        ("asker", "held.test"),
        ("budgeted", "listed.test"),
    ] {
        let run = p.run(tool).await;
        let url = format!("http://{host}:{port}/");
        // Warm-up.
        for _ in 0..10 {
            assert_eq!(p.get(&run, &url, "").await.status, 200);
        }
        let mut lat: Vec<Duration> = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            let r = p.get(&run, &url, "").await;
            lat.push(t0.elapsed());
            assert_eq!(r.status, 200, "{tool}: {}", r.text());
        }
        report.push((tool, percentile_ms(&mut lat, 0.5), percentile_ms(&mut lat, 0.9)));
    }
    println!("{n} sequential fetches each (new connection per fetch), in-process proxy, loopback origin");
    let base = report[0].1;
    for (tool, p50, p90) in &report {
        println!(
            "  {tool:<9} p50 {p50:6.3} ms  p90 {p90:6.3} ms  (p50 {:+.3} ms against listed)",
            p50 - base
        );
    }
}
