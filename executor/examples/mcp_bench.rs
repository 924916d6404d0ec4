//! MCP session benchmark (not a test; run as root for strict confinement):
//! the real proxy binary and an executor serving its API on loopback, one
//! session tool running `tests/fixtures/hostile_mcp.py echo` (a stdio MCP
//! server without the SDK, so the figures are the appliance's, not the
//! SDK's) under the strongest confinement here. Prints:
//!
//! - `tools/call` round trip through `/v1/mcp/<tool>` (one kept-alive
//!   connection; each call decided by the proxy) against the same server
//!   spoken to directly over its stdio: p50/p99 and the p50 overhead;
//! - session open (`initialize` answered) from a warm server against a cold
//!   start;
//! - sessions opened and ended per second, back to back, for 5 s;
//! - RSS per idle session: the servers' and the executor's growth.
//!
//! `cargo run --release -p egress-executor --example mcp_bench [-- N]` (N
//! calls per row, default 500), after `cargo build --release -p egress-proxy`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, marked_processes, strongest_isolation, TempDir};
use egress_e2e::harness::TOKEN;
use egress_e2e::mcp::serve;
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use serde_json::{json, Value};

const MARK: &str = "loom-mcp-bench";

fn script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hostile_mcp.py")
        .display()
        .to_string()
}

fn tool(id: &str, warm: usize) -> String {
    format!(
        r#"
[tools.{id}]
egress = []
[tools.{id}.mcp]
tools = ["echo"]
[tools.{id}.process]
command = ["python3", "{script}", "echo"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
env = {{ LOOM_TEST_MARK = "{MARK}-{id}" }}
cold_start_ms = 20000
max_sessions = 64
pool = {{ warm = {warm}, max = 64 }}
"#,
        script = script(),
        iso = strongest_isolation(),
    )
}

async fn connect(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    tx
}

async fn post(
    tx: &mut SendRequest<Full<Bytes>>,
    tool: &str,
    method: &str,
    session: Option<&str>,
    body: &Value,
) -> (Option<String>, Value) {
    tx.ready().await.unwrap();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("/v1/mcp/{tool}"))
        .header("host", "executor")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"));
    if let Some(s) = session {
        req = req.header("mcp-session-id", s);
    }
    let bytes = if method == "DELETE" {
        vec![]
    } else {
        serde_json::to_vec(body).unwrap()
    };
    let resp = tx
        .send_request(req.body(Full::new(Bytes::from(bytes))).unwrap())
        .await
        .unwrap();
    let id = resp
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (id, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})
}

fn call(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": "echo", "arguments": {"n": id}}})
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The same calls to the same server over its own stdio, unconfined.
fn direct(n: u64) -> Vec<Duration> {
    let mut child = Command::new("python3")
        .args([script().as_str(), "echo"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut ask = |v: &Value| {
        writeln!(stdin, "{v}").unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
    };
    ask(&initialize());
    for i in 0..50 {
        ask(&call(i));
    }
    let mut took = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        ask(&call(i));
        took.push(t.elapsed());
    }
    let _ = child.kill();
    let _ = child.wait();
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(500);
    let bin = proxy_bin().expect("the proxy binary (cargo build --release -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-bench");
    let tools = format!("{}{}", tool("warm", 1), tool("cold", 0));
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &tools);
    exec.warm_up();
    let addr = serve(&exec).await;
    let warm = exec.sessions("warm").unwrap().clone();
    assert!(eventually(Duration::from_secs(60), || warm.live() == 1).await);

    // Round trip: through the endpoint, and direct.
    let mut tx = connect(addr).await;
    let (sid, _) = post(&mut tx, "warm", "POST", None, &initialize()).await;
    let sid = sid.unwrap();
    for i in 0..50 {
        post(&mut tx, "warm", "POST", Some(&sid), &call(i)).await;
    }
    let mut through = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        let (_, v) = post(&mut tx, "warm", "POST", Some(&sid), &call(i)).await;
        through.push(t.elapsed());
        assert!(v.get("result").is_some(), "{v}");
    }
    post(&mut tx, "warm", "DELETE", Some(&sid), &Value::Null).await;
    let mut stdio = tokio::task::spawn_blocking(move || direct(n)).await.unwrap();
    let (tp50, tp99, dp50, dp99) = (
        pct(&mut through, 0.5),
        pct(&mut through, 0.99),
        pct(&mut stdio, 0.5),
        pct(&mut stdio, 0.99),
    );
    println!("tools/call round trip, {n} calls: endpoint p50 {tp50:.3} ms p99 {tp99:.3} ms; direct stdio p50 {dp50:.3} ms p99 {dp99:.3} ms; p50 overhead {:.3} ms", tp50 - dp50);

    // Session open: warm (wait for the refill before each) and cold.
    let mut warm_open = Vec::new();
    let mut cold_open = Vec::new();
    for _ in 0..20 {
        assert!(eventually(Duration::from_secs(30), || warm.live() == 1 && warm.count() == 0).await);
        let t = Instant::now();
        let (sid, _) = post(&mut tx, "warm", "POST", None, &initialize()).await;
        warm_open.push(t.elapsed());
        post(&mut tx, "warm", "DELETE", sid.as_deref(), &Value::Null).await;
        let t = Instant::now();
        let (sid, _) = post(&mut tx, "cold", "POST", None, &initialize()).await;
        cold_open.push(t.elapsed());
        post(&mut tx, "cold", "DELETE", sid.as_deref(), &Value::Null).await;
    }
    println!(
        "session open, 20 each: from warm p50 {:.2} ms p99 {:.2} ms; cold p50 {:.2} ms p99 {:.2} ms",
        pct(&mut warm_open, 0.5),
        pct(&mut warm_open, 0.99),
        pct(&mut cold_open, 0.5),
        pct(&mut cold_open, 0.99)
    );

    // Sessions per second, back to back (each waits for no refill).
    let t = Instant::now();
    let mut opened = 0u64;
    while t.elapsed() < Duration::from_secs(5) {
        let (sid, _) = post(&mut tx, "cold", "POST", None, &initialize()).await;
        post(&mut tx, "cold", "DELETE", sid.as_deref(), &Value::Null).await;
        opened += 1;
    }
    println!(
        "sessions opened and ended back to back: {:.1}/s",
        opened as f64 / t.elapsed().as_secs_f64()
    );

    // RSS per idle session.
    let cold = exec.sessions("cold").unwrap().clone();
    assert!(eventually(Duration::from_secs(30), || cold.live() == 0).await);
    let me = rss_kib("self");
    let mut ids = Vec::new();
    for _ in 0..20 {
        let (sid, _) = post(&mut tx, "cold", "POST", None, &initialize()).await;
        ids.push(sid.unwrap());
    }
    let servers: u64 = marked_processes(&format!("{MARK}-cold"))
        .iter()
        .map(|p| rss_kib(&p.to_string()))
        .sum();
    let grown = rss_kib("self").saturating_sub(me);
    println!(
        "20 idle sessions: servers {:.1} MiB each, executor +{:.1} KiB each",
        servers as f64 / 20.0 / 1024.0,
        grown as f64 / 20.0
    );
    for sid in &ids {
        post(&mut tx, "cold", "DELETE", Some(sid), &Value::Null).await;
    }
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    drop(proxy);
}
