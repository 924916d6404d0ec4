//! What SigV4 re-signing costs, with the release `egress-proxy`: the same
//! HTTPS origin (a sink on 127.0.0.2 that reads every body) reached through
//! interception under two names, `s3.example` with a signing credential
//! (`sign = { aws_sigv4 }`) and `api.example` with a header credential (no
//! signing), in one run, rounds alternating:
//!
//! - keep-alive GETs on one connection, signed by the tool with its
//!   placeholder: requests/s and the proxy's CPU time per request;
//! - a 100 MiB PUT with `x-amz-content-sha256: UNSIGNED-PAYLOAD` (the body
//!   passes untouched): MiB/s and the proxy's CPU per MiB;
//! - a 100 MiB streaming upload with 64 KiB signed chunks
//!   (`STREAMING-AWS4-HMAC-SHA256-PAYLOAD`: each chunk read whole and its
//!   signature written again) against the same bytes to the header
//!   credential's host.
//!
//! Usage: `cargo build --release -p egress-proxy --bin egress-proxy && cargo run --release -p egress-e2e --example sigv4_bench [GETs per round] [MiB per upload] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use base64::Engine as _;
use bytes::Bytes;
use egress_e2e::harness::{control_call, TOKEN};
use egress_e2e::process::{cpu_time, free_addr, release_bin, ProxyProcess};
use egress_e2e::FakeDns;
use http_body_util::{BodyExt as _, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

const MIB: usize = 1 << 20;
const CHUNK: usize = 64 * 1024;

/// An HTTPS origin for `names` that reads every request body whole (and
/// drops it) and answers `ok`; its CA in PEM.
async fn sink(names: &[&str]) -> (SocketAddr, String) {
    let (config, ca) = egress_e2e::tls_origin::test_server_config(names, egress_e2e::tls_origin::alpn(false));
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = s.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else { return };
                let svc = hyper::service::service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                    let mut body = req.into_body();
                    while let Some(f) = body.frame().await {
                        if f.is_err() {
                            break;
                        }
                    }
                    Ok::<_, Infallible>(hyper::Response::new(http_body_util::Full::new(Bytes::from_static(
                        b"ok",
                    ))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, ca)
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// An HTTP/1.1 connection inside TLS through a CONNECT tunnel of the proxy.
async fn open(
    proxy: SocketAddr,
    auth: &str,
    host: &str,
    port: u16,
    ca: &str,
) -> hyper::client::conn::http1::SendRequest<Body> {
    let (r, s) = egress_e2e::raw::connect(proxy, &format!("{host}:{port}"), Some(auth)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.set_nodelay(true).unwrap();
    let tls = egress_e2e::inside::tls(ca, host, b"http/1.1", s).await;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    send
}

/// What the tool's AWS SDK would send, signed with the placeholder (the
/// proxy does not check the tool's signature, only its key id).
fn signed_head(b: http::request::Builder, placeholder: &str, payload: &str) -> http::request::Builder {
    let auth = format!(
        "AWS4-HMAC-SHA256 Credential={placeholder}/20261206/us-east-1/s3/aws4_request, \
         SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={}",
        "0".repeat(64)
    );
    b.header("authorization", auth)
        .header("x-amz-date", "20261206T120000Z")
        .header("x-amz-content-sha256", payload)
}

/// `mib` MiB as frames of 1 MiB (one buffer, shared).
fn bulk(mib: usize) -> Body {
    let block = Bytes::from(vec![b'x'; MIB]);
    let frames = (0..mib).map(move |_| Ok::<_, Infallible>(Frame::data(block.clone())));
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// `mib` MiB as an aws-chunked body of 64 KiB chunks (signatures of zeros:
/// the proxy writes its own), and its length.
fn chunked(mib: usize) -> (Body, u64) {
    let mut one = format!("{CHUNK:x};chunk-signature={}\r\n", "0".repeat(64)).into_bytes();
    one.extend(std::iter::repeat_n(b'x', CHUNK));
    one.extend_from_slice(b"\r\n");
    let last = Bytes::from(format!("0;chunk-signature={}\r\n\r\n", "0".repeat(64)));
    let n = mib * MIB / CHUNK;
    let len = (one.len() * n + last.len()) as u64;
    // 16 chunks per frame, as an SDK writes them.
    let frame = Bytes::from(one.repeat(16));
    let frames = (0..n / 16)
        .map(move |_| Ok::<_, Infallible>(Frame::data(frame.clone())))
        .chain(std::iter::once(Ok(Frame::data(last))));
    (StreamBody::new(futures_util::stream::iter(frames)).boxed(), len)
}

struct Target<'a> {
    host: &'a str,
    port: u16,
    signing: bool,
}

fn get(t: &Target, placeholder: &str) -> hyper::Request<Body> {
    let b = hyper::Request::get("/bucket/key").header("host", format!("{}:{}", t.host, t.port));
    let b = if t.signing {
        signed_head(
            b,
            placeholder,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        )
    } else {
        b
    };
    b.body(Empty::new().boxed()).unwrap()
}

fn put(t: &Target, placeholder: &str, mib: usize, chunks: bool) -> hyper::Request<Body> {
    let b = hyper::Request::put("/bucket/big").header("host", format!("{}:{}", t.host, t.port));
    let (body, len) = if chunks {
        chunked(mib)
    } else {
        (bulk(mib), (mib * MIB) as u64)
    };
    let b = b.header("content-length", len);
    let b = match (t.signing, chunks) {
        (true, true) => signed_head(b, placeholder, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD")
            .header("content-encoding", "aws-chunked")
            .header("x-amz-decoded-content-length", mib * MIB),
        (true, false) => signed_head(b, placeholder, "UNSIGNED-PAYLOAD"),
        (false, _) => b,
    };
    b.body(body).unwrap()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(4000);
    let mib: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(100);
    let rounds: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    let dns = FakeDns::start().await;
    for name in ["s3.example", "api.example"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let (origin, ca_pem) = sink(&["s3.example", "api.example"]).await;
    let roots = dir.path().join("roots.pem");
    std::fs::write(&roots, ca_pem).unwrap();
    let file = |name: &str, value: &str| {
        let p = dir.path().join(name);
        egress_e2e::credentials::write_secret(&p, value, 0o600);
        p.display().to_string()
    };
    let (ak, sk, token) = (
        file("ak", "AKIDREALKEY000000001"),
        file("sk", "real/secret+access+key/0123456789abcdefghij"),
        file("token", "bench-REAL-SECRET-0123456789"),
    );
    let port = origin.port();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \":memory:\"\nallow_ranges = [\"127.0.0.2/32\"]\n\
             [proxy.dns]\nservers = [\"{}\"]\n[proxy.interception]\nupstream_ca_file = \"{}\"\n\
             [tools.b]\negress = [\"s3.example:{port}\", \"api.example:{port}\"]\nfetch_timeout_ms = 600000\n\
             [tools.b.credentials.aws]\nhosts = [\"s3.example:{port}\"]\nplaceholder_env = \"AWS_ACCESS_KEY_ID\"\n\
             sign = {{ aws_sigv4 = {{ service = \"s3\", region = \"us-east-1\", access_key_id = {{ file = \"{ak}\" }}, \
             secret_access_key = {{ file = \"{sk}\" }} }} }}\n\
             [tools.b.credentials.api]\nhosts = [\"api.example:{port}\"]\nvalue = \"Bearer ${{secret}}\"\n\
             secret = {{ file = \"{token}\" }}\nplaceholder_env = \"API_TOKEN\"\n",
            dns.addr,
            roots.display(),
        ),
    )
    .unwrap();
    let p = ProxyProcess::start_with_bin(&release_bin(), &cfg, proxy, control, TOKEN, &[]);
    let r = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": "b" })), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let cred = format!("{}:{}", v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let auth = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(cred));
    let placeholder = v["env"]["AWS_ACCESS_KEY_ID"].as_str().unwrap().to_owned();
    // The appliance CA alone (the child's NODE_EXTRA_CA_CERTS).
    let ca = std::fs::read_to_string(v["env"]["NODE_EXTRA_CA_CERTS"].as_str().unwrap()).unwrap();
    let targets = [
        Target {
            host: "api.example",
            port,
            signing: false,
        },
        Target {
            host: "s3.example",
            port,
            signing: true,
        },
    ];
    let pid = p.child.id();

    // Keep-alive GETs: requests/s and proxy CPU per request.
    let mut rate = [vec![], vec![]];
    let mut cpu = [Duration::ZERO; 2];
    for _ in 0..rounds {
        for (i, t) in targets.iter().enumerate() {
            let mut s = open(proxy, &auth, t.host, t.port, &ca).await;
            let (t0, c0) = (Instant::now(), cpu_time(pid));
            for _ in 0..n {
                s.ready().await.unwrap_or_else(|e| panic!("{}: {e}", t.host));
                let resp = s.send_request(get(t, &placeholder)).await.unwrap();
                assert_eq!(resp.status(), 200, "{}", t.host);
                resp.into_body().collect().await.unwrap();
            }
            cpu[i] += cpu_time(pid) - c0;
            rate[i].push(n as f64 / t0.elapsed().as_secs_f64());
        }
    }
    println!("keep-alive GETs, one connection ({n} per round, {rounds} rounds, median):");
    let base = median(&mut rate[0]);
    for (i, label) in ["header credential", "SigV4 re-signed"].iter().enumerate() {
        let r = median(&mut rate[i]);
        let us = cpu[i].as_secs_f64() * 1e6 / (n * rounds) as f64;
        println!(
            "  {label:<22} {r:>9.0} req/s ({:.2}x)  proxy CPU {us:.1} us/request",
            r / base
        );
    }

    // Uploads: MiB/s and proxy CPU per MiB.
    for (label, chunks) in [("unsigned payload", false), ("signed 64 KiB chunks", true)] {
        let mut speed = [vec![], vec![]];
        let mut cpu = [Duration::ZERO; 2];
        for _ in 0..rounds {
            for (i, t) in targets.iter().enumerate() {
                let mut s = open(proxy, &auth, t.host, t.port, &ca).await;
                let (t0, c0) = (Instant::now(), cpu_time(pid));
                let resp = s.send_request(put(t, &placeholder, mib, chunks)).await.unwrap();
                assert_eq!(resp.status(), 200, "{}", t.host);
                resp.into_body().collect().await.unwrap();
                cpu[i] += cpu_time(pid) - c0;
                speed[i].push(mib as f64 / t0.elapsed().as_secs_f64());
            }
        }
        println!("{mib} MiB upload, {label} ({rounds} rounds, median):");
        let base = median(&mut speed[0]);
        for (i, name) in ["header credential", "SigV4 re-signed"].iter().enumerate() {
            let s = median(&mut speed[i]);
            let ms = cpu[i].as_secs_f64() * 1e3 / (mib * rounds) as f64;
            println!(
                "  {name:<22} {s:>9.0} MiB/s ({:.2}x)  proxy CPU {ms:.2} ms/MiB",
                s / base
            );
        }
    }
    drop(p);
}
