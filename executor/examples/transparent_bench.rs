//! Transparent egress benchmark (not a test; needs root, `nft` and
//! `python3`): the real `egress-proxy` binary and an executor here, one
//! Python tool with `network = "transparent"` whose child measures, against
//! the same origins on 127.0.0.2 (an echo server, a sink, an HTTP and an
//! HTTPS origin):
//!
//! - connection setup, N times, through the transparent path (`connect()`
//!   to the name, redirected to the proxy): raw TCP to an entry with
//!   `protocol = "tcp"` (connect until one byte has come back from the echo
//!   server), plain HTTP (connect, a `GET`, until the first byte of the
//!   answer) and TLS (connect until the handshake with the origin is done),
//!   the last two to entries whose first bytes the proxy reads whole and
//!   checks; and raw TCP through an explicit CONNECT tunnel (the proxy's
//!   listener in the same namespace, the run's credential);
//! - the proxy's CPU per connection for each (its `/proc` user+system time
//!   over the N connections, less an invocation that opens none);
//! - bulk raw TCP, M MiB written to the sink until it answers, through the
//!   transparent relay, a CONNECT tunnel, and direct (the same Python code
//!   run on the host, no proxy).
//!
//! Run (as root):
//! `cargo build --release -p egress-proxy && cargo run --release -p
//! egress-executor --example transparent_bench -- [N] [MiB] [runs]`
//! (defaults 300, 256, 3). `EGRESS_PROXY_BIN` names another proxy binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use egress_e2e::executor::{invocation, python_runner, strongest_isolation, TempDir};
use egress_e2e::stack::{proxy_bin, start_stack_with, Stack};
use egress_e2e::FakeDns;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOOL_PY: &str = r#"
import base64, json, os, socket, ssl, time
from urllib.parse import urlparse, unquote

DB, SINK = int(os.environ["DB"]), int(os.environ["SINK"])
WEB, TLS = int(os.environ.get("WEB", "0")), int(os.environ.get("TLS", "0"))

def via_connect(port):
    p = urlparse(os.environ["HTTP_PROXY"])
    auth = base64.b64encode(f"{unquote(p.username)}:{unquote(p.password)}".encode()).decode()
    s = socket.create_connection((p.hostname, p.port))
    s.sendall(f"CONNECT db.test:{port} HTTP/1.1\r\nHost: db.test:{port}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        c = s.recv(4096)
        if not c:
            raise RuntimeError("the proxy closed the CONNECT")
        head += c
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:200])
    return s

def transparent(port):
    return socket.create_connection(("db.test", port))

def direct(port):
    return socket.create_connection(("127.0.0.2", port))

def echo_once(open_):
    s = open_(DB)
    s.sendall(b"x")
    if s.recv(1) != b"x":
        raise RuntimeError("no echo")
    return s

def http_once(_):
    s = socket.create_connection(("web.test", WEB))
    s.sendall(f"GET / HTTP/1.1\r\nHost: web.test:{WEB}\r\nConnection: close\r\n\r\n".encode())
    if s.recv(1) != b"H":
        raise RuntimeError("no answer")
    return s

TLS_CTX = None

def tls_once(_):
    global TLS_CTX
    if TLS_CTX is None:
        TLS_CTX = ssl.create_default_context(cafile=os.environ["ORIGIN_CA"])
    return TLS_CTX.wrap_socket(socket.create_connection(("tls.test", TLS)), server_hostname="tls.test")

def setup(open_, n, once=echo_once):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = once(open_)
        out.append(time.perf_counter() - t0)
        s.close()
    return out

def bulk(open_, mib):
    s = open_(SINK)
    buf = b"\0" * (256 * 1024)
    t0 = time.perf_counter()
    for _ in range(mib * 4):
        s.sendall(buf)
    s.shutdown(socket.SHUT_WR)
    got = s.recv(64)
    took = time.perf_counter() - t0
    s.close()
    return {"seconds": took, "answer": got.decode()}

def run(input, ctx):
    open_ = {"transparent": transparent, "connect": via_connect, "direct": direct}[input["path"]]
    if input["what"] == "setup":
        once = {"raw": echo_once, "http": http_once, "tls": tls_once}[input.get("kind", "raw")]
        return setup(open_, input["n"], once)
    return bulk(open_, input["mib"])

if __name__ == "__main__":
    import sys
    print(json.dumps(run(json.loads(sys.argv[1]), None)))
"#;

/// The proxy's user+system CPU time so far (`/proc/<pid>/stat`, in the
/// kernel's USER_HZ = 100 ticks).
fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // Fields 14 and 15 of stat(5); `rest` starts at field 3.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// A TCP server that reads to EOF, then answers the byte count.
async fn sink(addr: &str) -> SocketAddr {
    let l = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                let mut total = 0u64;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) => break,
                        Ok(k) => total += k as u64,
                        Err(_) => return,
                    }
                }
                let _ = s.write_all(total.to_string().as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

fn p50_ms(v: &Value) -> f64 {
    let mut xs: Vec<f64> = v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2] * 1e3
}

fn print_row(label: &str, r: &[f64]) {
    println!(
        "{label:>4} {:>8.3} {:>8.3} {:>8.3} {:>8.3} | {:>6.0} {:>6.0} {:>6.0} {:>6.0} | {:>8.0} {:>8.0} {:>8.0}",
        r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10]
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::main]
async fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(d).max(1);
    let (n, mib, runs) = (arg(1, 300), arg(2, 256), arg(3, 3));
    if let Err(e) = egress_executor::confine::transparent::nft() {
        eprintln!("transparent egress unavailable: {e}");
        std::process::exit(2);
    }
    let (db, _) = egress_e2e::origin::echo_origin("127.0.0.2:0").await;
    let sink = sink("127.0.0.2:0").await;
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let tls = egress_e2e::tls_origin::tls_origin("127.0.0.2:0", &["tls.test"]).await;
    let dns = FakeDns::start().await;
    for name in ["db.test", "web.test", "tls.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = TempDir::new("transparent-bench");
    let ca = tls.write_ca(dir.path());
    let tool = dir.write("bench_tool.py", TOOL_PY);
    let isolation = strongest_isolation();
    let tools = format!(
        r#"
[tools.bench]
network = "transparent"
egress = [{{ host = "db.test", port = {db}, protocol = "tcp" }}, {{ host = "db.test", port = {sink}, protocol = "tcp" }},
          "web.test:{web}", "tls.test:{tls}"]
fetch_timeout_ms = 600000

[tools.bench.process]
command = ["python3", "{runner}", "bench_tool.py"]
env = {{ DB = "{db}", SINK = "{sink}", WEB = "{web}", TLS = "{tls}", ORIGIN_CA = "{ca}" }}
read_paths = ["{ca}"]
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 600000
"#,
        db = db.port(),
        sink = sink.port(),
        web = web.addr.port(),
        tls = tls.addr.port(),
        ca = ca.display(),
        runner = python_runner().display(),
    );
    let bin = proxy_bin().unwrap_or_else(|| panic!("build it first: cargo build --release -p egress-proxy"));
    let stack = start_stack_with(&bin, &dir, dns.addr, "", &tools, &[("RUST_LOG", "warn")]);
    let pid = stack.proxy.0.id();
    let Stack {
        proxy: _proxy, exec, ..
    } = stack;
    let invoke = |input: Value| {
        let exec = exec.clone();
        async move {
            let t0 = cpu(pid);
            let res = exec.invoke(invocation("bench", input)).await;
            assert!(res.ok, "{res:#?}");
            (res.output.unwrap(), cpu(pid) - t0)
        }
    };
    let direct = |input: Value| {
        let out = Command::new("python3")
            .arg(&tool)
            .arg(input.to_string())
            .env("DB", db.port().to_string())
            .env("SINK", sink.port().to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let mib_s = |v: &Value| {
        assert_eq!(v["answer"], json!((mib as u64 * 1024 * 1024).to_string()), "{v}");
        mib as f64 / v["seconds"].as_f64().unwrap()
    };

    println!("isolation {isolation}; N = {n} connections, {mib} MiB bulk, {runs} runs");
    println!("setup p50 (ms) and proxy CPU per connection (µs): transparent raw / HTTP / TLS, CONNECT raw; then MiB/s");
    println!(
        "{:>4} {:>8} {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} {:>6} | {:>8} {:>8} {:>8}",
        "run", "tp raw", "tp http", "tp tls", "CON raw", "raw", "http", "tls", "CON", "tp", "CON", "direct"
    );
    let mut rows: Vec<[f64; 11]> = vec![];
    for r in 1..=runs {
        let (_, base) = invoke(json!({"path": "transparent", "what": "setup", "n": 0})).await;
        let per = |d: Duration| d.saturating_sub(base).as_secs_f64() * 1e6 / n as f64;
        let mut setup = vec![];
        for (path, kind) in [
            ("transparent", "raw"),
            ("transparent", "http"),
            ("transparent", "tls"),
            ("connect", "raw"),
        ] {
            let (times, cpu) = invoke(json!({"path": path, "what": "setup", "kind": kind, "n": n})).await;
            setup.push((p50_ms(&times), per(cpu)));
        }
        let (tp_bulk, _) = invoke(json!({"path": "transparent", "what": "bulk", "mib": mib})).await;
        let (con_bulk, _) = invoke(json!({"path": "connect", "what": "bulk", "mib": mib})).await;
        let direct_bulk = direct(json!({"path": "direct", "what": "bulk", "mib": mib}));
        let row = [
            setup[0].0,
            setup[1].0,
            setup[2].0,
            setup[3].0,
            setup[0].1,
            setup[1].1,
            setup[2].1,
            setup[3].1,
            mib_s(&tp_bulk),
            mib_s(&con_bulk),
            mib_s(&direct_bulk),
        ];
        print_row(&r.to_string(), &row);
        rows.push(row);
    }
    let m: Vec<f64> = (0..11).map(|i| median(rows.iter().map(|r| r[i]).collect())).collect();
    print_row("med", &m);
    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
}
