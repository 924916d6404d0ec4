//! Warm dispatch benchmark (not a test; run as root for the default PID
//! namespaces and strict confinement): N sequential `POST /v1/invocations`
//! through the executor's HTTP API, each answered by a warm child, for a
//! trivial Rust tool (`rust_echo`), the Python runner and the Node runner,
//! unconfined and strict (listener hand-off). The real `egress-proxy` and
//! `egress-executor` binaries run as separate processes on loopback, as in a
//! deployment; the client keeps one connection alive. Before each timed call
//! it waits until the pool is back to its warm target (so every call finds a
//! ready child; the refill of the previous one may still be running).
//! Prints p50/p99 per row, and a baseline: a bare round trip to the proxy's
//! and the executor's HTTP servers after the same idle gap, which is what
//! each hop of a dispatch costs on the machine; with `--json FILE`, the rows
//! as JSON too. Run through `executor/bench/dispatch.sh`, or as the
//! `dispatch` figure of `bench/run.sh`.
//!
//! With `--sustained SECS` it measures a sustained rate instead (the
//! `sustained` figure): strict confinement, a Rust and a Python tool (the
//! latter exec'd, and forked by its fork server: `pyf`) with
//! pools of `warm = 2, max = 8`, and 1, 8 and 32 clients (one connection
//! each) invoking back to back for SECS seconds without waiting for the
//! pool. Per row: invocations/s, p50/p99 latency, the share of the window
//! the pool had no ready child (sampled every 5 ms), and the mean cold start
//! of the children that refilled it.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

const TOKEN: &str = "dispatch-bench-token-0123456789";
const WARM: usize = 2;
/// Concurrent clients of the sustained rows.
const CLIENTS: [usize; 3] = [1, 8, 32];

/// A child process killed (and reaped) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first so the executor drains its children.
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    l.local_addr().unwrap_or_else(|e| panic!("addr: {e}"))
}

fn start(bin: &Path, config: &Path, log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let child = Command::new(bin)
        .args(["serve", "--config"])
        .arg(config)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    Proc(child)
}

async fn connect(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let t = Instant::now();
    loop {
        if let Ok(s) = tokio::net::TcpStream::connect(addr).await {
            let _ = s.set_nodelay(true);
            let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .unwrap_or_else(|e| panic!("handshake: {e}"));
            tokio::spawn(conn);
            return tx;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "nothing listens on {addr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn call(tx: &mut SendRequest<Full<Bytes>>, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "executor")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.map(|b| b.to_string()).unwrap_or_default())))
        .unwrap_or_else(|e| panic!("{e}"));
    tx.ready().await.unwrap_or_else(|e| panic!("connection: {e}"));
    let res = tx.send_request(req).await.unwrap_or_else(|e| panic!("request: {e}"));
    let status = res.status().as_u16();
    let body = res
        .into_body()
        .collect()
        .await
        .unwrap_or_else(|e| panic!("body: {e}"))
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// The value of the series `series` (name and labels) in `/metrics`.
async fn metric(tx: &mut SendRequest<Full<Bytes>>, series: &str) -> f64 {
    let (_, text) = call(tx, "GET", "/metrics", None).await;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// `executor_pool_ready{tool="…"}`.
async fn ready(tx: &mut SendRequest<Full<Bytes>>, tool: &str) -> usize {
    metric(tx, &format!("executor_pool_ready{{tool=\"{tool}\"}}")).await as usize
}

/// Cold starts of `tool` so far: (count, seconds in all).
async fn cold_starts(tx: &mut SendRequest<Full<Bytes>>, tool: &str) -> (f64, f64) {
    let series = |what: &str| format!("executor_cold_start_seconds_{what}{{tool=\"{tool}\",phase=\"total\"}}");
    (metric(tx, &series("count")).await, metric(tx, &series("sum")).await)
}

/// One sustained row: `clients` connections invoking `tool` back to back
/// for `window`. Returns the row's JSON.
async fn sustained_row(listen: SocketAddr, tool: &str, clients: usize, window: Duration) -> Value {
    let mut probe = connect(listen).await;
    let t = Instant::now();
    while ready(&mut probe, tool).await < WARM {
        assert!(t.elapsed() < Duration::from_secs(60), "`{tool}` never got warm");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cold_before = cold_starts(&mut probe, tool).await;
    let start = Instant::now();
    let end = start + window;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let tool = tool.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut tx = connect(listen).await;
            let mut v = Vec::new();
            while Instant::now() < end {
                let body = json!({"tool": tool, "input": {"client": c, "i": v.len()}});
                let t0 = Instant::now();
                let (status, answer) = call(&mut tx, "POST", "/v1/invocations", Some(body)).await;
                v.push(t0.elapsed());
                assert!(status == 200 && answer.contains("\"ok\":true"), "{status} {answer}");
            }
            v
        }));
    }
    let (mut samples, mut empty) = (0u64, 0u64);
    while Instant::now() < end {
        samples += 1;
        if ready(&mut probe, tool).await == 0 {
            empty += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut v = Vec::new();
    for t in tasks {
        v.extend(t.await.unwrap_or_else(|e| panic!("client: {e}")));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cold_after = cold_starts(&mut probe, tool).await;
    let refills = cold_after.0 - cold_before.0;
    let cold_ms = if refills > 0.0 {
        (cold_after.1 - cold_before.1) / refills * 1e3
    } else {
        0.0
    };
    let rate = v.len() as f64 / elapsed;
    let (p50, p99) = (quantile_ms(&mut v, 0.5), quantile_ms(&mut v, 0.99));
    let empty_pct = 100.0 * empty as f64 / samples.max(1) as f64;
    json!({"tool": tool, "clients": clients, "invocations": v.len(), "per_s": rate,
           "p50_ms": p50, "p99_ms": p99, "pool_empty_pct": empty_pct, "refill_cold_start_ms": cold_ms})
}

fn quantile_ms(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    // `--json FILE`: the rows as JSON too (for `egress-bench`).
    let json_out = args.iter().position(|a| a == "--json").map(|i| {
        let f = args
            .get(i + 1)
            .cloned()
            .unwrap_or_else(|| panic!("--json needs a file"));
        args.drain(i..i + 2);
        PathBuf::from(f)
    });
    // `--sustained SECS`: the sustained-rate rows instead of the dispatch table.
    let sustained = args.iter().position(|a| a == "--sustained").map(|i| {
        let secs: f64 = args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("--sustained needs seconds"));
        args.drain(i..i + 2);
        Duration::from_secs_f64(secs)
    });
    let mut rows = Vec::new();
    let usage =
        "usage: dispatch_bench EGRESS_PROXY EGRESS_EXECUTOR RUST_ECHO [N [memory]] [--sustained SECS] [--json FILE]";
    let bin = |i: usize| {
        let p = PathBuf::from(args.get(i).unwrap_or_else(|| panic!("{usage}")));
        std::fs::canonicalize(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let (proxy_bin, exec_bin, echo) = (bin(1), bin(2), bin(3));
    let n: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(200);
    // `memory`: the proxy keeps facts and runs in memory, so its durable
    // writes (create, end) leave the measurement.
    let in_memory = args.get(5).is_some_and(|a| a == "memory");
    let runners = Path::new(env!("CARGO_MANIFEST_DIR")).join("runners");
    let dir = std::env::temp_dir().join(format!("loom-dispatch-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("var")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(dir.join("echo.py"), "def run(input, ctx):\n    return input\n").unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(dir.join("echo.js"), "exports.run = (input) => input;\n").unwrap_or_else(|e| panic!("{e}"));

    println!(
        "# {} cores, kernel {}, {} processes on the host, N = {n}, facts {}\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        std::fs::read_dir("/proc")
            .map(|d| d
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
                .count())
            .unwrap_or(0),
        if in_memory { "in memory" } else { "in SQLite" },
    );
    if let Some(window) = sustained {
        println!(
            "| sustained, strict, {:.0} s | clients | invocations/s | p50 ms | p99 ms | pool empty | refill cold start ms |\n|---|---|---|---|---|---|---|",
            window.as_secs_f64()
        );
    } else {
        println!(
            "| warm dispatch through the API | isolation | p50 ms | p99 ms | exit of the child |\n|---|---|---|---|---|"
        );
    }
    let isolations: &[&str] = if sustained.is_some() {
        &["strict"]
    } else {
        &["off", "strict"]
    };
    for &isolation in isolations {
        let (control, listen, data) = (free_port(), free_port(), free_port());
        let handoff = dir.join(format!("var/handoff-{isolation}.sock"));
        let _ = std::fs::remove_file(&handoff);
        let max = if sustained.is_some() { 8 } else { 4 };
        let pool = format!("pool = {{ warm = {WARM}, max = {max}, queue = 64 }}\nisolation = \"{isolation}\"");
        let text = format!(
            r#"[proxy]
listen = "{data}"
control = "{control}"
facts = "{facts}"
handoff = "{handoff}"
[executor]
listen = "{listen}"
scratch_dir = "{scratch}"
proxy_handoff = "{handoff}"
[tools.rs]
egress = []
[tools.rs.process]
command = ["{echo}"]
{pool}
[tools.py]
egress = []
[tools.py.process]
command = ["python3", "{runners}/loom_runner.py", "{dir}/echo.py"]
{pool}
[tools.pyf]
egress = []
[tools.pyf.process]
command = ["python3", "{runners}/loom_runner.py", "{dir}/echo.py"]
fork_server = true
{pool}
[tools.node]
egress = []
[tools.node.process]
command = ["node", "{runners}/loom_runner.js", "{dir}/echo.js"]
{pool}
"#,
            facts = if in_memory {
                ":memory:".to_string()
            } else {
                dir.join(format!("var/facts-{isolation}.db")).display().to_string()
            },
            handoff = handoff.display(),
            scratch = dir.join("scratch").display(),
            echo = echo.display(),
            runners = runners.display(),
            dir = dir.display(),
        );
        let config = dir.join(format!("{isolation}.toml"));
        std::fs::write(&config, text).unwrap_or_else(|e| panic!("{e}"));
        let proxy = start(&proxy_bin, &config, &dir.join(format!("proxy-{isolation}.log")));
        let _ = connect(control).await;
        let exec = start(&exec_bin, &config, &dir.join(format!("executor-{isolation}.log")));
        let mut tx = connect(listen).await;
        if let Some(window) = sustained {
            for (name, tool) in [
                ("Rust echo", "rs"),
                ("Python runner echo", "py"),
                ("Python runner echo, fork server", "pyf"),
            ] {
                for clients in CLIENTS {
                    let row = sustained_row(listen, tool, clients, window).await;
                    println!(
                        "| {name} | {clients} | {:.1} | {:.2} | {:.2} | {:.0} % | {:.1} |",
                        row["per_s"].as_f64().unwrap_or(0.0),
                        row["p50_ms"].as_f64().unwrap_or(0.0),
                        row["p99_ms"].as_f64().unwrap_or(0.0),
                        row["pool_empty_pct"].as_f64().unwrap_or(0.0),
                        row["refill_cold_start_ms"].as_f64().unwrap_or(0.0),
                    );
                    rows.push(row);
                }
            }
            continue;
        }
        for (name, tool) in [
            ("Rust echo", "rs"),
            ("Python runner echo", "py"),
            ("Node runner echo", "node"),
        ] {
            let mut v = Vec::with_capacity(n);
            let mut exits = std::collections::BTreeMap::<String, usize>::new();
            for i in 0..n {
                let t = Instant::now();
                while ready(&mut tx, tool).await < WARM {
                    assert!(
                        t.elapsed() < Duration::from_secs(60),
                        "`{tool}` never got warm; see {}",
                        dir.display()
                    );
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                let body = json!({"tool": tool, "input": {"i": i}});
                let t0 = Instant::now();
                let (status, answer) = call(&mut tx, "POST", "/v1/invocations", Some(body)).await;
                v.push(t0.elapsed());
                let r: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
                assert!(status == 200 && r["ok"] == json!(true), "{status} {answer}");
                *exits
                    .entry(r["exit"].as_str().unwrap_or("none").to_string())
                    .or_default() += 1;
            }
            let exits: Vec<String> = exits.iter().map(|(k, c)| format!("{k} ×{c}")).collect();
            let (p50, p99) = (quantile_ms(&mut v, 0.5), quantile_ms(&mut v, 0.99));
            println!("| {name} | {isolation} | {p50:.2} | {p99:.2} | {} |", exits.join(", "));
            rows.push(json!({"tool": tool, "isolation": isolation, "p50_ms": p50, "p99_ms": p99}));
        }
        if isolation == "off" {
            // What one hop costs here: a bare HTTP round trip to each
            // server, each after the same ~2 ms without traffic that the
            // dispatch loop leaves between calls. A warm dispatch makes
            // four of them (kernel to executor, activate, end, and the
            // child's invoke and result) besides its own work.
            let mut proxy_tx = connect(control).await;
            for (name, tx) in [("proxy control API", &mut proxy_tx), ("executor API", &mut tx)] {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let t0 = Instant::now();
                    let (status, _) = call(tx, "GET", "/healthz", None).await;
                    v.push(t0.elapsed());
                    assert_eq!(status, 200);
                }
                let (p50, p99) = (quantile_ms(&mut v, 0.5), quantile_ms(&mut v, 0.99));
                println!("| baseline: `GET /healthz` of the {name}, 2 ms after the last call | — | {p50:.2} | {p99:.2} | — |");
                let tool = if name.starts_with("proxy") {
                    "baseline-proxy"
                } else {
                    "baseline-executor"
                };
                rows.push(json!({"tool": tool, "isolation": "-", "p50_ms": p50, "p99_ms": p99}));
            }
        }
        drop(tx);
        drop(exec);
        drop(proxy);
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(f) = json_out {
        let doc = json!({"n": n, "facts": if in_memory { "memory" } else { "sqlite" },
                         "sustained_s": sustained.map(|w| w.as_secs_f64()), "rows": rows});
        std::fs::write(&f, doc.to_string()).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}
