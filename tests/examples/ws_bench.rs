//! WebSocket echo round trip through the release `egress-proxy` against
//! direct: the `websockets` (PyPI) client and origin of `tests/python/ws.py`
//! on loopback, a 64-byte text message echoed N times on one socket (after
//! 200 to warm up), p50 and p99 for
//!   - `ws://` direct, through the forward path (frames untouched), and
//!     through the forward path with `rewrite_websocket` (frames read);
//!   - `wss://` direct, through interception (frames untouched), and through
//!     interception with `rewrite_websocket`.
//!
//! The client is the same Python program in every case, so the difference
//! is what the proxy adds; and the proxy's own CPU time per round trip
//! (user+system from `/proc`, over the warm-up and the N round trips), a
//! figure the machine's load disturbs less than latency. Origins on
//! 127.0.0.2, fake DNS on loopback.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example ws_bench [round trips]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{control_call, TOKEN};
use egress_e2e::process::{cpu_time, free_addr, release_bin, ProxyProcess};
use egress_e2e::websocket::{leaf, require_websockets, script, WsOrigin};
use egress_e2e::FakeDns;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;

/// (label, the client's env, URI, how it connects).
type Case<'a> = (&'a str, &'a BTreeMap<String, String>, &'a String, &'a [&'a str]);

/// The run's env for `tool`.
async fn run_env(control: SocketAddr, tool: &str) -> BTreeMap<String, String> {
    let r = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": tool })), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    serde_json::from_value(v["env"].clone()).unwrap()
}

/// One bench run of the client: (p50, p99) in microseconds.
fn bench(env: &BTreeMap<String, String>, uri: &str, how: &[&str], n: usize) -> (f64, f64) {
    let mut cmd = Command::new("python3");
    cmd.arg(script()).args(["bench", uri]).args(how).arg(n.to_string());
    cmd.env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    if let Ok(home) = std::env::var("HOME") {
        cmd.env("HOME", home);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|_| panic!("{uri} {how:?}: {text}{}", String::from_utf8_lossy(&out.stderr)));
    (v["p50_us"].as_f64().unwrap(), v["p99_us"].as_f64().unwrap())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    require_websockets();
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(5000);
    let dns = FakeDns::start().await;
    dns.set("plain.test", &["127.0.0.2"]);
    dns.set("api.example", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = leaf(dir.path(), "api.example");
    let ca_file = dir.path().join("ws-ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let plain = WsOrigin::start(None);
    let tls = WsOrigin::start(Some((&cert, &key)));
    let secret = dir.path().join("token");
    egress_e2e::credentials::write_secret(&secret, "bench-REAL-SECRET-0123456789", 0o600);
    let (proxy, control) = (free_addr(), free_addr());
    let (pp, tp) = (plain.port, tls.port);
    let tool = |id: &str, rewrite: bool| {
        format!(
            "[tools.{id}]\negress = [\"plain.test:{pp}\", \"api.example:{tp}\"]\nfetch_timeout_ms = 600000\n\
             [tools.{id}.credentials.api]\nhosts = [\"api.example:{tp}\", \"plain.test:{pp}\"]\nvalue = \"Bearer ${{secret}}\"\n\
             secret = {{ file = \"{}\" }}\nplaceholder_env = \"API_TOKEN\"\nallow_plaintext = true\nrewrite_websocket = {rewrite}\n",
            secret.display()
        )
    };
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \":memory:\"\nallow_ranges = [\"127.0.0.2/32\"]\n\
             [proxy.dns]\nservers = [\"{}\"]\n[proxy.interception]\nupstream_ca_file = \"{}\"\n{}{}",
            dns.addr,
            ca_file.display(),
            tool("untouched", false),
            tool("rewritten", true)
        ),
    )
    .unwrap();
    let p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);
    let untouched = run_env(control, "untouched").await;
    let rewritten = run_env(control, "rewritten").await;
    let mut direct_env: BTreeMap<String, String> = BTreeMap::new();
    direct_env.insert("SSL_CERT_FILE".into(), ca_file.display().to_string());

    let ws = format!("ws://plain.test:{pp}/ws/echo");
    let wss = format!("wss://api.example:{tp}/ws/echo");
    let cases: [Case; 6] = [
        ("ws direct", &direct_env, &ws, &["--direct", "127.0.0.2"]),
        ("ws forward path, frames untouched", &untouched, &ws, &["--forward"]),
        ("ws forward path, rewrite_websocket", &rewritten, &ws, &["--forward"]),
        ("wss direct", &direct_env, &wss, &["--direct", "127.0.0.2"]),
        ("wss interception, frames untouched", &untouched, &wss, &[]),
        ("wss interception, rewrite_websocket", &rewritten, &wss, &[]),
    ];
    println!("WebSocket echo round trip, 64-byte text, n = {n} (µs)");
    println!("{:<40} {:>8} {:>8} {:>14}", "path", "p50", "p99", "proxy CPU/rt");
    for (label, env, uri, how) in cases {
        // On the blocking pool: the fake DNS answers on this runtime meanwhile.
        let (env, uri, how) = (
            env.clone(),
            uri.clone(),
            how.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        );
        let cpu0 = cpu_time(p.child.id());
        let (p50, p99) = tokio::task::spawn_blocking(move || {
            let how: Vec<&str> = how.iter().map(String::as_str).collect();
            bench(&env, &uri, &how, n)
        })
        .await
        .unwrap();
        let cpu = (cpu_time(p.child.id()) - cpu0).as_secs_f64() * 1e6 / (n + 200) as f64;
        println!("{label:<40} {p50:>8.1} {p99:>8.1} {cpu:>14.1}");
    }
}
