//! Namespace setup benchmark (not a test; needs root and, for the
//! transparent rows, `nft`): the time to make one child's network namespace
//! as the pool does in the background, plain (`lo` up, the proxy listener)
//! and for transparent egress (also routes, the nftables table by `nft -f -`,
//! the four hand-off sockets). One at a time, N each (default 50), after one
//! warm-up of each. Run: `cargo run --release -p egress-executor --example
//! netns_bench [N]`.

use std::time::{Duration, Instant};

use egress_executor::confine::netns::new_namespace;

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mean = v.iter().map(|d| ms(*d)).sum::<f64>() / v.len().max(1) as f64;
    let at = |q: f64| ms(v[((v.len() as f64 - 1.0) * q).round() as usize]);
    (at(0.5), at(0.99), mean)
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(50)
        .max(1);
    println!(
        "{:<40} {:>8} {:>8} {:>8}",
        format!("namespace setup (N = {n})"),
        "p50 ms",
        "p99 ms",
        "mean ms"
    );
    for (label, transparent) in [
        ("plain (lo + proxy listener)", false),
        ("transparent (+ routes, nft, 4 sockets)", true),
    ] {
        if let Err(e) = new_namespace(transparent) {
            println!("{label:<40} unavailable: {e}");
            continue;
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            let ns = new_namespace(transparent).unwrap_or_else(|e| panic!("{e}"));
            v.push(t0.elapsed());
            drop(ns);
        }
        let (p50, p99, mean) = stats(v);
        println!("{label:<40} {p50:>8.2} {p99:>8.2} {mean:>8.2}");
    }
}
