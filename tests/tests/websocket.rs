//! WebSocket through the proxy, with the PyPI `websockets` package as both
//! client and origin (tests/python/ws.py): `ws://` on the forward path (the
//! handshake in absolute form, as to any HTTP proxy) and `wss://` through
//! interception (a credential host: CONNECT, the appliance CA from the
//! run's env). The handshake is decided like any request: it carries the
//! injected credential, a path no rule allows gets no upgrade, and other
//! upgrades (h2c) are refused. After the `101`, the socket is held to the
//! run's end and its deadline, holds its slot and is counted; with
//! `rewrite_websocket` the placeholder in a text message reaches the origin
//! as the secret, the echo of the secret comes back as the placeholder, and
//! a binary message carrying the placeholder closes the socket with a
//! `credential_misuse` fact. Origins on 127.0.0.2, fake DNS on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, TestProxy, TestRun};
use egress_e2e::origin::{http_origin, HttpOrigin};
use egress_e2e::tls_origin::{tls_origin, TlsOrigin};
use egress_e2e::websocket::{leaf, require_websockets, script, WsOrigin};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

const API_SECRET: &str = "ws-REAL-SECRET-api-1a2b3c";
const PLAIN_SECRET: &str = "ws-REAL-SECRET-plain-4d5e6f";

/// Tool `w`: `plain.test` (a `ws://` origin, credential `plain` in
/// cleartext to loopback), `api.example` (a `wss://` origin, credential
/// `api`), both restricted to `GET /ws/**`; and `heads.test` /
/// `tlsheads.test`, origins that record every request head, restricted to
/// `GET` (so the HTTPS one is intercepted).
struct World {
    p: TestProxy,
    plain: WsOrigin,
    tls: WsOrigin,
    heads: HttpOrigin,
    tls_heads: TlsOrigin,
    _dir: tempfile::TempDir,
}

async fn world(rewrite: bool, fetch_timeout_ms: u64) -> World {
    require_websockets();
    let dns = FakeDns::start().await;
    for name in ["plain.test", "api.example", "heads.test", "tlsheads.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let (ws_ca, cert, key) = leaf(dir.path(), "api.example");
    let plain = WsOrigin::start(None);
    let tls = WsOrigin::start(Some((&cert, &key)));
    let heads = http_origin("127.0.0.2:0").await;
    let tls_heads = tls_origin("127.0.0.2:0", &["tlsheads.test"]).await;
    let roots = dir.path().join("roots.pem");
    std::fs::write(&roots, format!("{ws_ca}{}", tls_heads.ca_pem)).unwrap();
    let secret = |name: &str, value: &str| {
        let p = dir.path().join(name);
        egress_e2e::credentials::write_secret(&p, value, 0o600);
        p.display().to_string()
    };
    let (pp, tp, hp, thp) = (plain.port, tls.port, heads.addr.port(), tls_heads.addr.port());
    let rules = r#"methods = ["GET"], paths = ["/ws/**"]"#;
    let text = format!(
        r#"{}[proxy.interception]
upstream_ca_file = "{}"
[tools.w]
egress = [
  {{ host = "plain.test", port = {pp}, {rules} }},
  {{ host = "api.example", port = {tp}, {rules} }},
  {{ host = "heads.test", port = {hp}, methods = ["GET"] }},
  {{ host = "tlsheads.test", port = {thp}, methods = ["GET"] }},
]
fetch_timeout_ms = {fetch_timeout_ms}
[tools.w.credentials.api]
hosts = ["api.example:{tp}"]
value = "Bearer ${{secret}}"
secret = {{ file = "{}" }}
placeholder_env = "API_TOKEN"
rewrite_websocket = {rewrite}
[tools.w.credentials.plain]
hosts = ["plain.test:{pp}"]
value = "Bearer ${{secret}}"
secret = {{ file = "{}" }}
placeholder_env = "PLAIN_TOKEN"
allow_plaintext = true
rewrite_websocket = {rewrite}
"#,
        proxy_section(&dns, ""),
        roots.display(),
        secret("api.token", API_SECRET),
        secret("plain.token", PLAIN_SECRET),
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), Some(Arc::new(MemorySink::new(10_000)))).await;
    World {
        p,
        plain,
        tls,
        heads,
        tls_heads,
        _dir: dir,
    }
}

impl World {
    async fn run(&self) -> (TestRun, BTreeMap<String, String>) {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
        assert_eq!(status, 201, "{v}");
        let run = TestRun {
            id: v["run_id"].as_str().unwrap().to_owned(),
            secret: v["secret"].as_str().unwrap().to_owned(),
            url: v["proxy_url"].as_str().unwrap().to_owned(),
        };
        (run, serde_json::from_value(v["env"].clone()).unwrap())
    }

    /// The two ways in: (URI of `path`, `--forward`, the origin, its
    /// credential's placeholder variable and secret).
    fn ways(&self, path: &str) -> [(String, bool, &WsOrigin, &'static str, &'static str); 2] {
        [
            (
                format!("ws://plain.test:{}{path}", self.plain.port),
                true,
                &self.plain,
                "PLAIN_TOKEN",
                PLAIN_SECRET,
            ),
            (
                format!("wss://api.example:{}{path}", self.tls.port),
                false,
                &self.tls,
                "API_TOKEN",
                API_SECRET,
            ),
        ]
    }

    async fn facts(&self, reason: &str) -> Vec<Value> {
        let (_, v) = self.p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
        v["facts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["reason"] == reason)
            .cloned()
            .collect()
    }

    async fn run_view(&self, run: &TestRun) -> Value {
        self.p.control("GET", &format!("/v1/runs/{}", run.id), None).await.1
    }
}

/// The data of the client's `reply` events, in order.
fn replies(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|e| e["event"] == "reply")
        .map(|e| &e["data"])
        .collect()
}

/// The run's `credential_scrubs`, summed over its credentials.
fn credential_scrubs(v: &Value) -> u64 {
    v["credential_scrubs"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum()
}

/// The client's command with the run's env only (plus `PATH`, `HOME`).
fn client_cmd(env: &BTreeMap<String, String>, uri: &str, forward: bool, args: &[&str]) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(script()).arg("client").arg(uri);
    if forward {
        cmd.arg("--forward");
    }
    cmd.args(args).env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    if let Ok(home) = std::env::var("HOME") {
        cmd.env("HOME", home);
    }
    cmd
}

/// Runs the client to its end; returns the events it printed.
async fn client(env: &BTreeMap<String, String>, uri: &str, forward: bool, args: &[&str]) -> Vec<Value> {
    let mut cmd = client_cmd(env, uri, forward, args);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let events: Vec<Value> = stdout.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(
        out.status.success() && !events.is_empty(),
        "{uri}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    events
}

/// A client that holds its socket open: its events as they come.
struct Holding {
    child: Child,
    events: mpsc::UnboundedReceiver<Value>,
}

impl Holding {
    fn start(env: &BTreeMap<String, String>, uri: &str, forward: bool) -> Holding {
        let mut child = client_cmd(env, uri, forward, &["ping", "--hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (tx, events) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&l) {
                    let _ = tx.send(v);
                }
            }
        });
        Holding { child, events }
    }

    /// The next event (within `secs`; the proxy runs on this runtime, so
    /// the wait must not block it).
    async fn next(&mut self, secs: u64) -> Value {
        match tokio::time::timeout(Duration::from_secs(secs), self.events.recv()).await {
            Ok(Some(v)) => v,
            _ => panic!("no event from the client within {secs} s"),
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn the_handshake_carries_the_credential_and_echo_works_both_ways() {
    let w = world(false, 20_000).await;
    let (run, env) = w.run().await;
    for (uri, forward, origin, var, secret) in w.ways("/ws/echo") {
        let placeholder = env[var].clone();
        let said = format!("with {placeholder} untouched");
        let events = client(&env, &uri, forward, &["hello", &said, "--binary", "bin-hello"]).await;
        assert_eq!(events[0]["status"], 101, "{uri}: {events:?}");
        let replies = replies(&events);
        assert_eq!(replies, ["hello", said.as_str(), "bin-hello"], "{uri}");
        let opened = origin.wait("open", 1).await;
        assert_eq!(opened[0]["path"], "/ws/echo", "{uri}");
        assert_eq!(
            opened[0]["authorization"],
            format!("Bearer {secret}"),
            "{uri}: the handshake carries the injected credential"
        );
        // Without rewrite_websocket the frames pass untouched: the
        // placeholder reaches the origin as written.
        let texts: Vec<Value> = origin
            .wait("text", 2)
            .await
            .into_iter()
            .map(|e| e["data"].clone())
            .collect();
        assert_eq!(texts, [json!("hello"), json!(said)], "{uri}");
        assert_eq!(origin.wait("binary", 1).await[0]["data"], "bin-hello", "{uri}");
    }
    // The frames were counted in the run's bytes, and the slots are free.
    let v = w.run_view(&run).await;
    assert!(v["bytes"]["up"].as_u64().unwrap() > 0, "{v}");
    assert!(v["bytes"]["down"].as_u64().unwrap() > 0, "{v}");
    w.p.wait_slots(&run, 0).await;
}

#[tokio::test]
async fn a_path_not_allowed_gets_no_upgrade() {
    let w = world(false, 20_000).await;
    let (_run, env) = w.run().await;
    for (uri, forward, origin, _, _) in w.ways("/admin") {
        let events = client(&env, &uri, forward, &["hello"]).await;
        assert_eq!(events[0]["event"], "refused", "{uri}: {events:?}");
        assert_eq!(events[0]["status"], 403, "{uri}");
        assert_eq!(events[0]["reason"], "path_not_allowed", "{uri}");
        assert!(origin.of("open").is_empty(), "{uri}: {:?}", origin.events());
    }
    let facts = w.facts("path_not_allowed").await;
    assert_eq!(facts.len(), 2, "{facts:?}");
}

#[tokio::test]
async fn other_upgrades_are_refused_with_a_fact() {
    let w = world(false, 20_000).await;
    let (_run, env) = w.run().await;
    let urls = [
        format!("http://heads.test:{}/", w.heads.addr.port()),
        format!("https://tlsheads.test:{}/", w.tls_heads.addr.port()),
    ];
    for url in &urls {
        for upgrade in ["h2c", "custom-proto/1"] {
            let mut cmd = Command::new("curl");
            cmd.args(["-sS", "--http1.1", "--max-time", "10", "-o", "/dev/null", "-D", "-"])
                .args(["-H", "Connection: Upgrade, HTTP2-Settings"])
                .args(["-H", &format!("Upgrade: {upgrade}")])
                .args(["-H", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"])
                .arg(url)
                .env_clear()
                .envs(&env)
                .env("PATH", std::env::var("PATH").unwrap_or_default());
            let out = tokio::task::spawn_blocking(move || cmd.output())
                .await
                .unwrap()
                .unwrap();
            let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
            let last = head.rsplit("http/").next().unwrap_or("");
            assert!(last.starts_with("1.1 403"), "{url} {upgrade}: {head}");
            assert!(
                last.contains("x-egress-deny-reason: upgrade_not_allowed"),
                "{url} {upgrade}: {head}"
            );
        }
    }
    assert!(w.heads.heads().is_empty(), "{:?}", w.heads.heads());
    assert!(w.tls_heads.heads().is_empty(), "{:?}", w.tls_heads.heads());
    let facts = w.facts("upgrade_not_allowed").await;
    assert_eq!(facts.len(), 4, "{facts:?}");
    assert!(
        facts.iter().any(|f| f["detail"].as_str().unwrap().contains("h2c")),
        "{facts:?}"
    );
}

#[tokio::test]
async fn the_run_end_cuts_an_open_socket_which_holds_its_slot() {
    let w = world(false, 20_000).await;
    for (uri, forward, _, _, _) in w.ways("/ws/hold") {
        let (run, env) = w.run().await;
        let mut c = Holding::start(&env, &uri, forward);
        assert_eq!(c.next(15).await["status"], 101, "{uri}");
        assert_eq!(c.next(10).await["data"], "ping", "{uri}");
        assert_eq!(c.next(10).await["event"], "holding", "{uri}");
        w.p.wait_slots(&run, 1).await;
        w.p.end(&run).await;
        let closed = c.next(5).await;
        assert_eq!(closed["event"], "closed", "{uri}: {closed}");
        assert!(closed["after_ms"].as_u64().unwrap() < 3000, "{uri}: {closed}");
    }
}

#[tokio::test]
async fn the_deadline_cuts_an_open_socket() {
    let w = world(false, 2_500).await;
    for (uri, forward, _, _, _) in w.ways("/ws/hold") {
        let (run, env) = w.run().await;
        let mut c = Holding::start(&env, &uri, forward);
        assert_eq!(c.next(15).await["status"], 101, "{uri}");
        assert_eq!(c.next(10).await["data"], "ping", "{uri}");
        assert_eq!(c.next(10).await["event"], "holding", "{uri}");
        // Cut at the fetch deadline (2.5 s after the handshake began), long
        // before the client would give up (30 s).
        let closed = c.next(10).await;
        assert_eq!(closed["event"], "closed", "{uri}: {closed}");
        let after = closed["after_ms"].as_u64().unwrap();
        assert!((1000..3000).contains(&after), "{uri}: {closed}");
        w.p.wait_slots(&run, 0).await;
    }
}

#[tokio::test]
async fn rewrite_websocket_puts_the_secret_in_text_and_takes_it_out_of_the_echo() {
    let w = world(true, 20_000).await;
    let (run, env) = w.run().await;
    for (uri, forward, origin, var, secret) in w.ways("/ws/echo") {
        let placeholder = env[var].clone();
        let said = format!("token={placeholder};again={placeholder}");
        // Long enough for a 16-bit length, with the placeholder at the end.
        let long = format!("{}{placeholder}", "x".repeat(70_000));
        let events = client(&env, &uri, forward, &[&said, &long, "plain"]).await;
        assert_eq!(events[0]["status"], 101, "{uri}: {events:?}");
        let replies = replies(&events);
        let shown: Vec<String> = replies
            .iter()
            .map(|r| r.as_str().unwrap_or("").chars().rev().take(80).collect())
            .collect();
        assert!(
            replies == [said.as_str(), long.as_str(), "plain"],
            "{uri}: the echo carries the placeholder; got (reversed ends) {shown:?}"
        );
        let opened = origin.wait("open", 1).await;
        assert_eq!(opened[0]["authorization"], format!("Bearer {secret}"), "{uri}");
        assert!(
            opened[0]["extensions"].is_null(),
            "{uri}: no extension is offered when frames are read: {}",
            opened[0]
        );
        let texts: Vec<String> = origin
            .wait("text", 3)
            .await
            .into_iter()
            .map(|e| e["data"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            texts[0],
            format!("token={secret};again={secret}"),
            "{uri}: the origin got the secret"
        );
        assert!(
            texts[1] == format!("{}{secret}", "x".repeat(70_000)),
            "{uri}: ends {:?}",
            &texts[1][texts[1].len().saturating_sub(80)..]
        );
        assert_eq!(texts[2], "plain", "{uri}");
        // The placeholder split across fragments (7 bytes each, a ping-free
        // continuation chain): the whole message is what is rewritten.
        let split = format!("split {placeholder} end");
        let events = client(&env, &uri, forward, &["--split", &split]).await;
        assert_eq!(events[1]["data"], split.as_str(), "{uri}: {events:?}");
        let got = origin.wait("text", 4).await;
        assert_eq!(got[3]["data"], format!("split {secret} end"), "{uri}");
    }
    // The scrubbed echoes are counted for the run.
    let v = w.run_view(&run).await;
    let scrubs = credential_scrubs(&v);
    assert!(scrubs >= 6, "{v}");
}

/// An origin that reflects the credential in its messages (text and
/// binary) gives the tool the placeholder, never the secret, whether or not
/// the tool's own messages are rewritten: a handshake that carried a
/// credential has its origin's frames read and scrubbed like a response
/// body, and offers no extension (a compressed message could not be
/// scrubbed).
#[tokio::test]
async fn a_reflected_secret_reaches_the_tool_as_the_placeholder_in_every_mode() {
    for rewrite in [false, true] {
        let w = world(rewrite, 20_000).await;
        let (run, env) = w.run().await;
        for (uri, forward, origin, var, secret) in w.ways("/ws/reflect") {
            let placeholder = env[var].clone();
            let events = client(&env, &uri, forward, &["hello", "--binary", "bin"]).await;
            assert_eq!(events[0]["status"], 101, "{uri}: {events:?}");
            let replies = replies(&events);
            assert_eq!(
                replies,
                [
                    json!(format!("hello {placeholder}")),
                    json!(format!("bin {placeholder}"))
                ]
                .iter()
                .collect::<Vec<_>>(),
                "rewrite_websocket = {rewrite}, {uri}: the reflected secret {secret} is scrubbed"
            );
            let opened = origin.wait("open", 1).await;
            assert!(
                opened[0]["extensions"].is_null(),
                "{uri}: no extension is offered on a credential's handshake: {}",
                opened[0]
            );
        }
        let v = w.run_view(&run).await;
        let scrubs = credential_scrubs(&v);
        assert!(scrubs >= 4, "rewrite_websocket = {rewrite}: {v}");
    }
}

#[tokio::test]
async fn a_binary_message_with_the_placeholder_is_credential_misuse() {
    let w = world(true, 20_000).await;
    let (_run, env) = w.run().await;
    for (uri, forward, origin, var, _) in w.ways("/ws/echo") {
        let placeholder = env[var].clone();
        let events = client(
            &env,
            &uri,
            forward,
            &["fine", "--binary", &format!("bin {placeholder}")],
        )
        .await;
        assert_eq!(events[0]["status"], 101, "{uri}: {events:?}");
        assert_eq!(events[1]["data"], "fine", "{uri}: {events:?}");
        let closed = events.last().unwrap();
        assert_eq!(closed["event"], "closed", "{uri}: {events:?}");
        assert_eq!(closed["code"], 1008, "{uri}: {closed}");
        assert!(
            closed["reason"].as_str().unwrap().contains("credential_misuse"),
            "{uri}: {closed}"
        );
        // Split across fragments: refused all the same.
        let events = client(
            &env,
            &uri,
            forward,
            &["--split", "--binary", &format!("bin {placeholder}")],
        )
        .await;
        assert_eq!(events.last().unwrap()["code"], 1008, "{uri}: {events:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(origin.of("binary").is_empty(), "{uri}: {:?}", origin.events());
    }
    let facts = w.facts("credential_misuse").await;
    assert_eq!(facts.len(), 4, "{facts:?}");
    assert!(
        facts[0]["detail"]
            .as_str()
            .unwrap()
            .contains("binary WebSocket message"),
        "{facts:?}"
    );
}

#[tokio::test]
async fn a_message_over_the_cap_closes_a_socket_whose_frames_are_read() {
    let w = world(true, 20_000).await;
    let (_run, env) = w.run().await;
    for (uri, forward, origin, _, _) in w.ways("/ws/echo") {
        // 1 MiB passes; one byte more closes the socket (1009), and the
        // origin never gets the message.
        let events = client(&env, &uri, forward, &["--big", "1048576"]).await;
        assert_eq!(events[1]["length"], 1_048_576, "{uri}: {events:?}");
        let events = client(&env, &uri, forward, &["--big", "1048577"]).await;
        let closed = events.last().unwrap();
        assert_eq!(closed["event"], "closed", "{uri}: {events:?}");
        assert_eq!(closed["code"], 1009, "{uri}: {closed}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let lengths: Vec<usize> = origin
            .of("text")
            .iter()
            .map(|e| e["data"].as_str().unwrap().len())
            .collect();
        assert_eq!(lengths, [1_048_576], "{uri}");
    }
}
