//! HTTP/2 against HTTP/1.1 through interception, with the release
//! `egress-proxy`: keep-alive GETs (the credential injected into each) by a
//! Rust client (hyper) inside a CONNECT tunnel, the appliance CA trusted,
//! to an origin offering `h2` (`api.example`) and to an HTTP/1.1-only one
//! (`old.example`):
//!   - one connection, one request at a time, HTTP/1.1 and HTTP/2;
//!   - 8 at a time: 8 HTTP/1.1 connections, or 8 streams on one HTTP/2
//!     connection;
//!
//! requests per second (median of the rounds) and the proxy's own CPU time
//! per request (user+system from `/proc`, over all rounds). Then gRPC unary
//! calls per second with the `grpcio` (PyPI) client and origin of
//! `tests/python/grpc_echo.py`, through interception against direct (one
//! channel, one call at a time). Origins on 127.0.0.2, fake DNS on loopback.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example h2_bench [requests per round] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use base64::Engine as _;
use bytes::Bytes;
use egress_e2e::h2_origin::h2_origin;
use egress_e2e::harness::{control_call, TOKEN};
use egress_e2e::process::{cpu_time, free_addr, release_bin, ProxyProcess};
use egress_e2e::websocket::leaf;
use egress_e2e::FakeDns;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject as _;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

/// A run of `tool`: (its `Proxy-Authorization` value, its env).
async fn run(control: SocketAddr, tool: &str) -> (String, BTreeMap<String, String>) {
    let r = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": tool })), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let cred = format!("{}:{}", v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let auth = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(cred));
    (auth, serde_json::from_value(v["env"].clone()).unwrap())
}

/// TLS through a CONNECT tunnel of the proxy to `host:port`, offering `alpn`.
async fn tunnel(proxy: SocketAddr, auth: &str, host: &str, port: u16, ca: &Path, alpn: &[&[u8]]) -> Tls {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!("CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\nProxy-Authorization: {auth}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).await.unwrap(), 1, "the proxy closed the CONNECT");
        head.push(b[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, s)
        .await
        .unwrap()
}

fn get(host: &str, port: u16, h2: bool) -> http::Request<Empty<Bytes>> {
    let b = http::Request::get(format!("https://{host}:{port}/ok/bench"));
    let b = if h2 {
        b.version(http::Version::HTTP_2)
    } else {
        b.uri("/ok/bench").header("host", format!("{host}:{port}"))
    };
    b.body(Empty::new()).unwrap()
}

/// One way of sending: HTTP/1.1 over `width` connections, or HTTP/2 with
/// `width` streams at a time on one connection.
struct Case {
    label: &'static str,
    h2: bool,
    width: usize,
    host: &'static str,
}

enum Sender {
    H1(Vec<hyper::client::conn::http1::SendRequest<Empty<Bytes>>>),
    H2(hyper::client::conn::http2::SendRequest<Empty<Bytes>>),
}

async fn open(c: &Case, proxy: SocketAddr, auth: &str, port: u16, ca: &Path) -> Sender {
    if c.h2 {
        let tls = tunnel(proxy, auth, c.host, port, ca, &[b"h2"]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let (s, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        return Sender::H2(s);
    }
    let mut all = vec![];
    for _ in 0..c.width {
        let tls = tunnel(proxy, auth, c.host, port, ca, &[b"http/1.1"]).await;
        let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
        tokio::spawn(conn);
        all.push(s);
    }
    Sender::H1(all)
}

/// `n` requests on the HTTP/2 connection, `width` streams at a time;
/// returns how long they took.
async fn round_h2(
    s: &hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    c: &Case,
    port: u16,
    n: usize,
) -> Duration {
    let t0 = Instant::now();
    let per = n / c.width;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..c.width {
        let (mut s, host) = (s.clone(), c.host);
        tasks.spawn(async move {
            for _ in 0..per {
                let resp = s.send_request(get(host, port, true)).await.unwrap();
                assert_eq!(resp.status(), 200);
                resp.into_body().collect().await.unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    t0.elapsed()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// gRPC unary calls per second by `grpc_echo.py call` with `args`.
fn grpc_rate(env: &BTreeMap<String, String>, args: &[String]) -> f64 {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/grpc_echo.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg("call").args(args).env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|_| panic!("{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr)));
    v["per_second"].as_f64().unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(4000);
    let rounds: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let dns = FakeDns::start().await;
    for name in ["api.example", "old.example", "grpc.example"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let api = h2_origin("127.0.0.2:0", &["api.example"], true).await;
    let old = h2_origin("127.0.0.2:0", &["old.example"], false).await;
    let (grpc_ca, cert, key) = leaf(dir.path(), "grpc.example");
    let grpc_ca_file = dir.path().join("grpc-ca.pem");
    std::fs::write(&grpc_ca_file, &grpc_ca).unwrap();
    let mut grpc = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/grpc_echo.py"))
        .args(["serve", "--cert"])
        .arg(&cert)
        .arg("--key")
        .arg(&key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(grpc.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let gp = first["port"].as_u64().unwrap() as u16;
    // The calls' log lines are not read: drain them.
    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    let roots = dir.path().join("roots.pem");
    std::fs::write(&roots, format!("{}{}{grpc_ca}", api.ca_pem, old.ca_pem)).unwrap();
    let secret = dir.path().join("token");
    egress_e2e::credentials::write_secret(&secret, "bench-REAL-SECRET-0123456789", 0o600);
    let (ap, op) = (api.addr.port(), old.addr.port());
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \":memory:\"\nallow_ranges = [\"127.0.0.2/32\"]\n\
             [proxy.dns]\nservers = [\"{}\"]\n[proxy.interception]\nupstream_ca_file = \"{}\"\n\
             [tools.b]\negress = [\"api.example:{ap}\", \"old.example:{op}\", \"grpc.example:{gp}\"]\n\
             fetch_timeout_ms = 600000\nmax_concurrent_fetches = 16\n\
             [tools.b.credentials.api]\nhosts = [\"api.example:{ap}\", \"old.example:{op}\", \"grpc.example:{gp}\"]\n\
             value = \"Bearer ${{secret}}\"\nsecret = {{ file = \"{}\" }}\nplaceholder_env = \"API_TOKEN\"\n",
            dns.addr,
            roots.display(),
            secret.display()
        ),
    )
    .unwrap();
    let p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);
    let (auth, env) = run(control, "b").await;
    let ca = Path::new(&env["SSL_CERT_FILE"]).to_owned();

    let cases = [
        Case {
            label: "h1, 1 connection -> h1 origin",
            h2: false,
            width: 1,
            host: "old.example",
        },
        Case {
            label: "h1, 1 connection -> h2 origin",
            h2: false,
            width: 1,
            host: "api.example",
        },
        Case {
            label: "h2, 1 stream -> h2 origin",
            h2: true,
            width: 1,
            host: "api.example",
        },
        Case {
            label: "h1, 8 connections -> h1 origin",
            h2: false,
            width: 8,
            host: "old.example",
        },
        Case {
            label: "h2, 8 streams -> h2 origin",
            h2: true,
            width: 8,
            host: "api.example",
        },
        Case {
            label: "h2, 8 streams -> h1 origin",
            h2: true,
            width: 8,
            host: "old.example",
        },
    ];
    println!("Intercepted keep-alive GETs, credential injected, {rounds} rounds of {n}");
    println!("{:<34} {:>10} {:>16}", "case", "req/s p50", "proxy CPU/req µs");
    let mut rates = vec![];
    for c in &cases {
        let port = if c.host == "api.example" { ap } else { op };
        let mut s = open(c, proxy, &auth, port, &ca).await;
        round_any(&mut s, c, port, 200.max(c.width * 20)).await;
        let cpu0 = cpu_time(p.child.id());
        let mut r = vec![];
        for _ in 0..rounds {
            let took = round_any(&mut s, c, port, n).await;
            r.push(n as f64 / took.as_secs_f64());
        }
        let cpu = (cpu_time(p.child.id()) - cpu0).as_secs_f64() * 1e6 / (n * rounds) as f64;
        let rate = median(&mut r);
        rates.push(rate);
        println!("{:<34} {rate:>10.0} {cpu:>16.1}", c.label);
    }
    println!(
        "ratios h2/h1: 1 at a time {:.2} (same h2 origin), 8 at a time {:.2}",
        rates[2] / rates[1],
        rates[4] / rates[3]
    );

    let calls = (n / 2).to_string();
    let target = format!("grpc.example:{gp}");
    let through: Vec<String> = vec![
        target.clone(),
        "--ca".into(),
        ca.display().to_string(),
        "--calls".into(),
        calls.clone(),
    ];
    let direct: Vec<String> = vec![
        target,
        "--ca".into(),
        grpc_ca_file.display().to_string(),
        "--direct".into(),
        format!("127.0.0.2:{gp}"),
        "--calls".into(),
        calls,
    ];
    let (mut d, mut t) = (vec![], vec![]);
    for _ in 0..rounds.min(3) {
        let (env2, dir2) = (env.clone(), direct.clone());
        d.push(
            tokio::task::spawn_blocking(move || grpc_rate(&env2, &dir2))
                .await
                .unwrap(),
        );
        let (env2, thr2) = (env.clone(), through.clone());
        t.push(
            tokio::task::spawn_blocking(move || grpc_rate(&env2, &thr2))
                .await
                .unwrap(),
        );
    }
    let (d, t) = (median(&mut d), median(&mut t));
    println!("gRPC unary calls/s (grpcio, one channel, one call at a time, {} calls): direct {d:.0}, through interception {t:.0} (ratio {:.2})", n / 2, t / d);
    let _ = grpc.kill();
    let _ = grpc.wait();
}

/// `n` requests, `width` at a time (HTTP/1.1: one connection per task,
/// handed to it and back); returns how long they took.
async fn round_any(s: &mut Sender, c: &Case, port: u16, n: usize) -> Duration {
    match s {
        Sender::H2(s) => round_h2(s, c, port, n).await,
        Sender::H1(v) => {
            let t0 = Instant::now();
            let per = n / c.width;
            let mut tasks = tokio::task::JoinSet::new();
            for mut conn in std::mem::take(v) {
                let host = c.host;
                tasks.spawn(async move {
                    for _ in 0..per {
                        conn.ready().await.unwrap();
                        let resp = conn.send_request(get(host, port, false)).await.unwrap();
                        assert_eq!(resp.status(), 200);
                        resp.into_body().collect().await.unwrap();
                    }
                    conn
                });
            }
            while let Some(r) = tasks.join_next().await {
                v.push(r.unwrap());
            }
            t0.elapsed()
        }
    }
}
