//! HTTP/2 and gRPC on intercepted hosts. The appliance leaf offers `h2`
//! and `http/1.1` by ALPN; a tool that picks `h2` gets HTTP/2, and each of
//! its streams is one request: decided (path rules per stream), injected
//! (the credential per stream, gRPC metadata included), scrubbed, holding
//! one of the run's `max_concurrent_fetches` slots. Toward the origin the
//! proxy offers its own ALPN and bridges to an HTTP/1.1-only origin. Floods
//! (rapid reset, CONTINUATION) are cut by the connection's bounds while
//! another run keeps being answered. Real clients: curl `--http2`, PyPI
//! `httpx[http2]`, `grpcio` (client and origin) and `h2` (raw frames), from
//! tests/python/. Origins on 127.0.0.2, names from a fake DNS on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::h2_origin::{h2_origin, H2Origin};
use egress_e2e::harness::{proxy_section, sample, TestProxy};
use egress_e2e::process::{client, Ran};
use egress_e2e::websocket::leaf;
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

const SECRET: &str = "h2-REAL-SECRET-api-7c8d9e";

/// Fails (says why) unless python3 can import what these tests use.
fn require_python() {
    let out = Command::new("python3")
        .args([
            "-c",
            "import httpx, h2, hpack, hyperframe, grpc; httpx.AsyncClient(http2=True)",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 with httpx[http2], h2 and grpcio is required for this test (pip install 'httpx[http2]' h2 grpcio): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python").join(name)
}

/// The gRPC origin (tests/python/grpc_echo.py) as a child: its port and
/// the calls it printed.
struct GrpcOrigin {
    child: Child,
    port: u16,
    calls: Arc<std::sync::Mutex<Vec<Value>>>,
}

impl GrpcOrigin {
    fn start(cert: &Path, key: &Path) -> GrpcOrigin {
        let mut child = Command::new("python3")
            .arg(script("grpc_echo.py"))
            .args(["serve", "--cert"])
            .arg(cert)
            .arg("--key")
            .arg(key)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
        let port = first["port"].as_u64().unwrap() as u16;
        let calls = Arc::new(std::sync::Mutex::new(vec![]));
        let c = calls.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&l) {
                    c.lock().unwrap().push(v);
                }
            }
        });
        GrpcOrigin { child, port, calls }
    }

    fn calls(&self) -> Vec<Value> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for GrpcOrigin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Tool `w`: `api.example` (an origin offering h2; only `/ok/**`, `/slow`
/// and `/trailers`), `old.example` (HTTP/1.1 only), `grpc.example` (the
/// gRPC origin); the credential `api` (placeholder `API_TOKEN`) on these
/// three; and `other.example` (h2, intercepted by its path rule, no
/// credential).
struct World {
    p: TestProxy,
    api: H2Origin,
    old: H2Origin,
    other: H2Origin,
    grpc: GrpcOrigin,
    _dir: tempfile::TempDir,
}

async fn world(max_concurrent_fetches: usize, max_queued_fetches: usize) -> World {
    require_python();
    let dns = FakeDns::start().await;
    for name in ["api.example", "old.example", "grpc.example", "other.example"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let api = h2_origin("127.0.0.2:0", &["api.example"], true).await;
    let old = h2_origin("127.0.0.2:0", &["old.example"], false).await;
    let other = h2_origin("127.0.0.2:0", &["other.example"], true).await;
    let (grpc_ca, cert, key) = leaf(dir.path(), "grpc.example");
    let grpc = GrpcOrigin::start(&cert, &key);
    let roots = dir.path().join("roots.pem");
    std::fs::write(&roots, format!("{}{}{}{grpc_ca}", api.ca_pem, old.ca_pem, other.ca_pem)).unwrap();
    let secret = dir.path().join("api.token");
    egress_e2e::credentials::write_secret(&secret, SECRET, 0o600);
    let (a, o, g, t) = (api.addr.port(), old.addr.port(), grpc.port, other.addr.port());
    let text = format!(
        r#"{}[proxy.interception]
upstream_ca_file = "{}"
[tools.w]
egress = [
  {{ host = "api.example", port = {a}, paths = ["/ok/**", "/slow", "/trailers"] }},
  "old.example:{o}",
  "grpc.example:{g}",
  {{ host = "other.example", port = {t}, paths = ["/**"] }},
]
max_concurrent_fetches = {max_concurrent_fetches}
max_queued_fetches = {max_queued_fetches}
fetch_timeout_ms = 20000
[tools.w.credentials.api]
hosts = ["api.example:{a}", "old.example:{o}", "grpc.example:{g}"]
value = "Bearer ${{secret}}"
secret = {{ file = "{}" }}
placeholder_env = "API_TOKEN"
"#,
        proxy_section(&dns, ""),
        roots.display(),
        secret.display(),
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), Some(Arc::new(MemorySink::new(10_000)))).await;
    World {
        p,
        api,
        old,
        other,
        grpc,
        _dir: dir,
    }
}

impl World {
    async fn run(&self) -> BTreeMap<String, String> {
        self.run_with_id().await.1
    }

    async fn run_with_id(&self) -> (String, BTreeMap<String, String>) {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
        assert_eq!(status, 201, "{v}");
        (
            v["run_id"].as_str().unwrap().to_owned(),
            serde_json::from_value(v["env"].clone()).unwrap(),
        )
    }

    fn api(&self, path: &str) -> String {
        format!("https://api.example:{}{path}", self.api.addr.port())
    }

    fn other(&self, path: &str) -> String {
        format!("https://other.example:{}{path}", self.other.addr.port())
    }

    fn old(&self, path: &str) -> String {
        format!("https://old.example:{}{path}", self.old.addr.port())
    }
}

async fn python(env: &BTreeMap<String, String>, name: &str, args: &[&str]) -> Ran {
    let s = script(name);
    let mut all = vec![s.to_str().unwrap()];
    all.extend_from_slice(args);
    let r = client(env, "python3", &all).await;
    assert!(r.ok, "{name} {args:?}: {}{}", r.stdout, r.stderr);
    r
}

/// curl `--http2` through the run's proxy: (negotiated version, status, body).
async fn curl_h2(env: &BTreeMap<String, String>, url: &str, extra: &[&str]) -> (String, String, String) {
    let mut args = vec![
        "-sS",
        "--http2",
        "--max-time",
        "10",
        "-w",
        "\n%{http_version} %{http_code}",
    ];
    args.extend_from_slice(extra);
    args.push(url);
    let r = client(env, "curl", &args).await;
    assert!(r.ok, "curl {url}: {}{}", r.stdout, r.stderr);
    let (body, last) = r.stdout.rsplit_once('\n').unwrap();
    let (v, s) = last.split_once(' ').unwrap();
    (v.to_owned(), s.to_owned(), body.to_owned())
}

fn bearer_placeholder(env: &BTreeMap<String, String>) -> String {
    format!("Authorization: Bearer {}", env["API_TOKEN"])
}

#[tokio::test]
async fn curl_speaks_h2_through_interception_to_an_h2_and_an_h1_only_origin() {
    let w = world(4, 8).await;
    let env = w.run().await;
    let auth = bearer_placeholder(&env);
    let (v, status, body) = curl_h2(&env, &w.api("/ok/a?x=1"), &["-H", &auth]).await;
    assert_eq!((v.as_str(), status.as_str()), ("2", "200"), "{body}");
    assert_eq!(body, "ok HTTP/2.0\n", "the h2 origin answered over h2");
    let head = w.api.heads().pop().unwrap();
    assert!(
        head.starts_with(&format!(
            "HTTP/2.0 GET https://api.example:{}/ok/a?x=1\n",
            w.api.addr.port()
        )),
        "{head}"
    );
    assert!(head.contains(&format!("authorization: Bearer {SECRET}\n")), "{head}");
    assert!(!head.contains(&env["API_TOKEN"]), "{head}");

    let (v, status, body) = curl_h2(&env, &w.old("/plain"), &["-H", &auth]).await;
    assert_eq!((v.as_str(), status.as_str()), ("2", "200"), "{body}");
    assert_eq!(body, "ok HTTP/1.1\n", "the h1-only origin answered over HTTP/1.1");
    let head = w.old.heads().pop().unwrap();
    assert!(head.starts_with("HTTP/1.1 GET /plain\n"), "{head}");
    assert!(
        head.contains(&format!("host: old.example:{}\n", w.old.addr.port())),
        "{head}"
    );
    assert!(head.contains(&format!("authorization: Bearer {SECRET}\n")), "{head}");

    // HTTP/1.1 still works, to an origin that would speak h2.
    let r = client(
        &env,
        "curl",
        &[
            "-sS",
            "--http1.1",
            "-w",
            "\n%{http_version}",
            "-H",
            &auth,
            &w.api("/ok/h1"),
        ],
    )
    .await;
    assert!(
        r.ok && r.stdout.ends_with("ok HTTP/2.0\n\n1.1"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert!(w.api.heads().pop().unwrap().contains(&format!("Bearer {SECRET}")));

    // A WebSocket handshake stays HTTP/1.1 toward the origin, even one
    // that speaks h2 (no extended CONNECT): this origin answers 200, no upgrade.
    let r = client(
        &env,
        "curl",
        &[
            "-sS",
            "--http1.1",
            "-H",
            "Connection: Upgrade",
            "-H",
            "Upgrade: websocket",
            "-H",
            "Sec-WebSocket-Version: 13",
            "-H",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            &w.api("/ok/ws"),
        ],
    )
    .await;
    assert!(r.ok && r.stdout == "ok HTTP/1.1\n", "{}{}", r.stdout, r.stderr);
    let head = w.api.heads().pop().unwrap();
    assert!(head.starts_with("HTTP/1.1 GET /ok/ws\n"), "{head}");
    assert!(head.contains("upgrade: websocket\n"), "{head}");
    assert!(head.contains(&format!("authorization: Bearer {SECRET}\n")), "{head}");
}

#[tokio::test]
async fn the_runs_next_tunnels_take_up_the_origin_s_h2_connection() {
    let w = world(4, 8).await;
    let (id, env) = w.run_with_id().await;
    let auth = bearer_placeholder(&env);
    for path in ["/ok/first", "/ok/second"] {
        let (v, status, body) = curl_h2(&env, &w.api(path), &["-H", &auth]).await;
        assert_eq!((v.as_str(), status.as_str()), ("2", "200"), "{body}");
        w.p.wait_upstream_idle(&id, 1).await;
    }
    // A tool speaking HTTP/1.1 this time: its requests go out as streams
    // on the same connection.
    let r = client(&env, "curl", &["-sS", "--http1.1", "-H", &auth, &w.api("/ok/third")]).await;
    assert!(r.ok && r.stdout == "ok HTTP/2.0\n", "{}{}", r.stdout, r.stderr);
    assert_eq!(
        w.api.connections(),
        1,
        "three tunnels of one run, one origin connection"
    );
    let heads = w.api.heads();
    assert_eq!(heads.len(), 3, "{heads:?}");
    for h in &heads {
        assert!(h.contains(&format!("authorization: Bearer {SECRET}\n")), "{h}");
    }
}

#[tokio::test]
async fn the_placeholder_is_checked_per_stream() {
    let w = world(4, 8).await;
    let env = w.run().await;
    // On one connection to a host that is not the credential's: the
    // stream carrying the placeholder is refused, the other one answered.
    let misuse = format!("{}|Authorization: Bearer $API_TOKEN", w.other("/a"));
    let r = python(&env, "h2client.py", &["get", &misuse, &w.other("/b")]).await;
    let lines = r.lines();
    assert_eq!(lines.len(), 2, "{}", r.stdout);
    assert_eq!(
        (lines[0]["status"].as_u64(), lines[0]["reason"].as_str()),
        (Some(403), Some("credential_misuse")),
        "{}",
        r.stdout
    );
    assert_eq!(lines[1]["status"], 200, "{}", r.stdout);
    let heads = w.other.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(heads[0].starts_with("HTTP/2.0 GET https://other.example:"), "{heads:?}");
    assert!(!heads[0].contains("authorization"), "{heads:?}");
    assert_eq!(w.p.facts_with_reason("credential_misuse").await.len(), 1);
    // And the placeholder to its own host, in a stream: the secret goes out.
    let own = format!("{}|Authorization: Bearer $API_TOKEN", w.api("/ok/own"));
    let r = python(&env, "h2client.py", &["get", &own]).await;
    assert_eq!(r.lines()[0]["status"], 200, "{}", r.stdout);
    let head = w.api.heads().pop().unwrap();
    assert!(head.contains(&format!("authorization: Bearer {SECRET}\n")), "{head}");
    assert!(!head.contains(&env["API_TOKEN"]), "{head}");
}

#[tokio::test]
async fn response_trailers_reach_an_h2_client() {
    let w = world(4, 8).await;
    let env = w.run().await;
    let r = client(
        &env,
        "curl",
        &[
            "-sS",
            "--http2",
            "-D",
            "/dev/stdout",
            "-o",
            "/dev/null",
            &w.api("/trailers"),
        ],
    )
    .await;
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("\nHTTP/2 200"), "{}", r.stdout);
    assert!(r.stdout.contains("x-origin-trailer: done"), "{}", r.stdout);
}

#[tokio::test]
async fn httpx_streams_are_decided_one_by_one_on_one_connection() {
    let w = world(4, 8).await;
    let env = w.run().await;
    let r = python(
        &env,
        "h2client.py",
        &["get", &w.api("/ok/1"), &w.api("/secret"), &w.api("/ok/2")],
    )
    .await;
    let lines = r.lines();
    assert_eq!(lines.len(), 3, "{}", r.stdout);
    for l in &lines {
        assert_eq!(l["http_version"], "HTTP/2", "{l}");
    }
    assert_eq!(lines[0]["status"], 200, "{}", r.stdout);
    assert_eq!(lines[0]["body"], "ok HTTP/2.0\n");
    assert_eq!(lines[1]["status"], 403, "{}", r.stdout);
    assert_eq!(lines[1]["reason"], "path_not_allowed", "{}", r.stdout);
    assert_eq!(lines[2]["status"], 200, "{}", r.stdout);
    let heads = w.api.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    for h in &heads {
        assert!(h.starts_with("HTTP/2.0 GET"), "{h}");
        assert!(h.contains(&format!("authorization: Bearer {SECRET}\n")), "{h}");
    }
    assert!(heads.iter().all(|h| !h.contains("/secret")), "{heads:?}");
    // One tunnel, one connection to the h2 origin, for all three streams.
    assert_eq!(w.api.connections(), 1);
    let denied = w.p.facts_with_reason("path_not_allowed").await;
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert!(denied[0]["detail"].as_str().unwrap().contains("/secret"), "{denied:?}");

    // To the HTTP/1.1-only origin: bridged, each stream on a connection of its own at a time.
    let r = python(&env, "h2client.py", &["get", &w.old("/a"), &w.old("/b"), &w.old("/c")]).await;
    let lines = r.lines();
    assert_eq!(lines.len(), 3, "{}", r.stdout);
    for l in &lines {
        assert_eq!(
            (l["status"].as_u64(), l["http_version"].as_str()),
            (Some(200), Some("HTTP/2")),
            "{l}"
        );
        assert_eq!(l["body"], "ok HTTP/1.1\n", "{l}");
    }
    let heads = w.old.heads();
    assert_eq!(heads.len(), 3, "{heads:?}");
    for h in &heads {
        assert!(h.starts_with("HTTP/1.1 GET /"), "{h}");
        assert!(h.contains(&format!("authorization: Bearer {SECRET}\n")), "{h}");
    }
}

#[tokio::test]
async fn grpc_unary_and_server_streaming_through_interception_with_the_credential_injected() {
    let w = world(4, 8).await;
    let env = w.run().await;
    let ca = env["SSL_CERT_FILE"].clone();
    let target = format!("grpc.example:{}", w.grpc.port);
    let r = python(
        &env,
        "grpc_echo.py",
        &["call", &target, "--ca", &ca, "--say", "hello", "--count", "5"],
    )
    .await;
    let lines = r.lines();
    let (_, all) = w.p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
    assert_eq!(lines.len(), 2, "{}{} {all}", r.stdout, r.stderr);
    assert_eq!(
        lines[0],
        json!({"kind": "unary", "reply": "echo:hello"}),
        "{}",
        r.stdout
    );
    assert_eq!(
        lines[1],
        json!({"kind": "stream", "replies": ["n=0", "n=1", "n=2", "n=3", "n=4"]}),
        "{}",
        r.stdout
    );
    let calls = w.grpc.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    for c in &calls {
        assert_eq!(c["authorization"], format!("Bearer {SECRET}"), "{c}");
    }
    assert!(!r.stdout.contains(SECRET));
}

#[tokio::test]
async fn the_run_slot_limit_bounds_concurrent_streams() {
    // Two slots: the CONNECT's (one stream at a time) and one more.
    let w = world(2, 16).await;
    let env = w.run().await;
    let urls: Vec<String> = (0..6).map(|_| w.api("/slow?ms=300")).collect();
    let mut args = vec!["get"];
    args.extend(urls.iter().map(String::as_str));
    let r = python(&env, "h2client.py", &args).await;
    let lines = r.lines();
    assert_eq!(lines.len(), 6, "{}", r.stdout);
    let (_, all) = w.p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
    assert!(lines.iter().all(|l| l["status"] == 200), "{} {all}", r.stdout);
    assert_eq!(w.api.heads().len(), 6);
    assert_eq!(w.api.max_in_flight(), 2, "streams beyond the run's slots waited");

    // No queue: streams beyond the slots are refused (`concurrency_limit`).
    let w = world(1, 0).await;
    let env = w.run().await;
    let urls: Vec<String> = (0..6).map(|_| w.api("/slow?ms=300")).collect();
    let mut args = vec!["get"];
    args.extend(urls.iter().map(String::as_str));
    let r = python(&env, "h2client.py", &args).await;
    let lines = r.lines();
    let ok = lines.iter().filter(|l| l["status"] == 200).count();
    let refused = lines.iter().filter(|l| l["reason"] == "concurrency_limit").count();
    let (_, all) = w.p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
    assert_eq!(ok + refused, 6, "{} {all}", r.stdout);
    assert!(ok >= 1 && refused >= 1, "{}", r.stdout);
    assert_eq!(w.api.max_in_flight(), 1);
    assert_eq!(w.p.facts_with_reason("concurrency_limit").await.len(), refused);
    // Each stream counted once: allowed, or denied for want of a slot.
    let m = w.p.metrics().await;
    let count = |d: &str| {
        sample(
            &m,
            &format!("egress_requests_total{{tool=\"w\",kind=\"http\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!((count("allowed"), count("denied")), (ok as f64, refused as f64), "{m}");
}

/// Another run's requests while a flood runs: all answered.
async fn other_run_answers(w: &World) {
    let env = w.run().await;
    for i in 0..5 {
        let (v, status, body) = curl_h2(&env, &w.api(&format!("/ok/other{i}")), &[]).await;
        assert_eq!((v.as_str(), status.as_str()), ("2", "200"), "{body}");
    }
}

/// `h2client.py <kind>` of `frames` against `/ok/flood` from one run while
/// another run's requests are answered; the flooder's last report.
async fn flood_beside_another_run(w: &World, kind: &str, frames: &str) -> Value {
    let flooder = w.run().await;
    let url = w.api("/ok/flood");
    let args = [kind, &url, frames];
    let flood = python(&flooder, "h2client.py", &args);
    let (r, ()) = tokio::join!(flood, other_run_answers(w));
    serde_json::from_str(r.stdout.lines().last().unwrap()).unwrap()
}

#[tokio::test]
async fn a_rapid_reset_flood_is_cut_while_another_run_is_answered() {
    let w = world(64, 64).await;
    let v = flood_beside_another_run(&w, "rapid-reset", "2000").await;
    // Cut well before 2000 streams: GOAWAY with ENHANCE_YOUR_CALM (0xb), or
    // the connection closed under a write still in flight (the client's
    // next write then meets the reset, which can discard the GOAWAY before
    // it is read).
    assert!(
        v["goaway"] == 11 || (v["goaway"].is_null() && v["closed"] == true),
        "{v}"
    );
    assert!(v["sent"].as_u64().unwrap() < 2000, "{v}");
    let seen = w.api.heads().iter().filter(|h| h.contains("/ok/flood")).count();
    assert!(seen < 200, "{seen} reset streams reached the origin");
}

#[tokio::test]
async fn a_continuation_flood_is_cut_while_another_run_is_answered() {
    let w = world(64, 64).await;
    let v = flood_beside_another_run(&w, "continuation", "1000").await;
    assert_eq!(v["responses"], 0, "{v}");
    assert!(v["goaway"].is_number() || v["closed"] == true, "{v}");
    assert!(w.api.heads().iter().all(|h| !h.contains("/ok/flood")));
}

#[tokio::test]
async fn a_refused_upload_gets_its_answer_not_a_reset() {
    // The denial is answered after what is left of the (small) body was
    // read, so the stream ends cleanly: no client sees a reset instead.
    let w = world(4, 8).await;
    let env = w.run().await;
    let body = "x=1".repeat(1000);
    for _ in 0..20 {
        let (v, status, _) = curl_h2(&env, &w.api("/secret"), &["-X", "POST", "-d", &body]).await;
        assert_eq!((v.as_str(), status.as_str()), ("2", "403"));
    }
    assert!(w.api.heads().is_empty());
}

/// An upload whose response ended early still holds its stream's slot:
/// with `max_concurrent_fetches = 2` and no queue, two streams answered at
/// once by an origin that keeps reading their request bodies leave no slot
/// for a third (`concurrency_limit`), until one of the uploads ends; the
/// origin never reads more than two uploads at once. Through an origin on
/// HTTP/2 and through the bridge to an HTTP/1.1-only one. No python: the
/// tool is hyper's HTTP/2 client on the tunnel.
#[tokio::test]
async fn an_upload_holds_its_streams_slot_after_the_response_ended() {
    use egress_e2e::flood::{self, http_flood, Speaks};
    for (name, h2) in [("h2.test", true), ("old.test", false)] {
        let origin = http_flood("127.0.0.2:0", Speaks::Https { name, h2 }).await;
        let port = origin.addr.port();
        let dir = tempfile::tempdir().unwrap();
        let roots = dir.path().join("roots.pem");
        std::fs::write(&roots, origin.ca_pem.as_deref().unwrap()).unwrap();
        let p = TestProxy::start_with(
            &format!("[proxy.interception]\nupstream_ca_file = \"{}\"", roots.display()),
            &format!(
                "[tools.s]\negress = [\"{name}:{port}\"]\ninspect = true\nmax_concurrent_fetches = 2\nmax_queued_fetches = 0\nfetch_timeout_ms = 20000\n"
            ),
            None,
        )
        .await;
        p.dns.set(name, &["127.0.0.2"]);
        let run = p.run("s").await;
        let (_, ca) = p.control("GET", "/v1/ca", None).await;
        // The CONNECT holds one of the two slots (its streams use it in turn).
        let (r, s) = egress_e2e::raw::connect(p.proxy, &format!("{name}:{port}"), Some(&run.auth())).await;
        assert_eq!(r.status, 200);
        let tls = flood::tls_inside(s, ca["pem"].as_str().unwrap(), name, true)
            .await
            .unwrap();
        let sender = flood::h2_client(tls).await;
        let post = |body| {
            let mut sender = sender.clone();
            let req = http::Request::builder()
                .method("POST")
                .uri(format!("https://{name}:{port}/early"))
                .body(body)
                .unwrap();
            async move { sender.send_request(req).await.unwrap() }
        };
        // Two uploads, each answered at once and read on by the origin.
        let mut uploads = vec![];
        for _ in 0..2 {
            let (tx, body) = flood::channel_body();
            tx.send(bytes::Bytes::from_static(b"first part")).await.unwrap();
            let resp = post(body).await;
            assert_eq!(resp.status(), 200);
            assert_eq!(flood::drain_body(resp.into_body()).await, 5, "the early answer, whole");
            uploads.push(tx);
        }
        // Both responses are over, both uploads still stream: no slot left.
        let (tx, body) = flood::channel_body();
        tx.send(bytes::Bytes::from_static(b"third")).await.unwrap();
        let third = post(body).await;
        assert_eq!(
            (
                third.status().as_u16(),
                third
                    .headers()
                    .get("x-egress-deny-reason")
                    .map(|v| v.to_str().unwrap().to_owned())
            ),
            (403, Some("concurrency_limit".to_owned())),
            "{name}: a third stream got a slot while two uploads were still open"
        );
        drop(tx);
        // One upload ends: its slot comes back, and a new stream takes it.
        uploads.pop();
        origin.wait_uploads(1, 0).await;
        let (tx, body) = flood::channel_body();
        tx.send(bytes::Bytes::from_static(b"fourth")).await.unwrap();
        let fourth = post(body).await;
        assert_eq!(
            fourth.status(),
            200,
            "{name}: the ended upload's slot was not given back"
        );
        drop(tx);
        drop(uploads);
        origin.wait_uploads(3, 0).await;
        assert_eq!(
            origin.counts.uploads_peak.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "{name}: more uploads than slots reached the origin at once"
        );
        assert_eq!(p.facts_with_reason("concurrency_limit").await.len(), 1);
    }
}
