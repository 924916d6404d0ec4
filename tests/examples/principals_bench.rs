//! What scoped principals cost on the control path: the run-creation rate
//! (`POST /v1/runs`, then `DELETE`, one connection per call as a kernel
//! without keep-alive does it) of a proxy with 1,000 principals in its file,
//! called with one of them, against a proxy in single-token mode, in one
//! run, rounds alternating. Principals never touch the data path.
//!
//! Usage: `cargo run --release -p egress-e2e --example principals_bench [runs per round] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_config::principals::token_hash;
use egress_e2e::harness::{control_call, proxy_section, TestProxy, TOKEN};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Instant;

const PRINCIPALS: usize = 1000;

async fn proxy(principals: Option<&std::path::Path>) -> TestProxy {
    let dns = FakeDns::start().await;
    let control = principals.map_or(String::new(), |p| {
        format!("[control]\nprincipals_file = \"{}\"\n", p.display())
    });
    let text = format!(
        "{}\n{control}\n[tools.search]\negress = [\"listed.test:443\"]\n",
        proxy_section(&dns, "")
    );
    TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await
}

/// Runs created and ended per second, `n` in a row, as `token`.
async fn rate(p: &TestProxy, token: &str, n: usize) -> f64 {
    let t0 = Instant::now();
    for _ in 0..n {
        let r = control_call(
            p.control,
            "POST",
            "/v1/runs",
            Some(json!({"tool": "search"})),
            Some(token),
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        let id = v["run_id"].as_str().unwrap();
        let r = control_call(p.control, "DELETE", &format!("/v1/runs/{id}"), None, Some(token)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    n as f64 / t0.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(500);
    let rounds: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("principals.toml");
    let mut text = String::new();
    for i in 0..PRINCIPALS {
        text.push_str(&format!(
            "[principals.kernel-{i}]\ntokens = [\"{}\"]\nscopes = [\"runs:search*\", \"invoke:search*\", \"facts:own\", \"grants:search*\"]\n\n",
            token_hash(&format!("kernel-{i}-token-0123456789abcdef"))
        ));
    }
    std::fs::write(&file, text).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let single = proxy(None).await;
    let scoped = proxy(Some(&file)).await;
    let kernel = format!("kernel-{}-token-0123456789abcdef", PRINCIPALS / 2);
    // Warm-up.
    rate(&single, TOKEN, 50).await;
    rate(&scoped, &kernel, 50).await;
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..rounds {
        a.push(rate(&single, TOKEN, n).await);
        b.push(rate(&scoped, &kernel, n).await);
    }
    let (a, b) = (median(&mut a), median(&mut b));
    println!("run creation and end, {n} in a row x {rounds} rounds (medians), one connection per call");
    println!("single-token mode:            {a:8.0} runs/s");
    println!("{PRINCIPALS} principals, a kernel's: {b:8.0} runs/s   ({:.2}x)", b / a);
}
