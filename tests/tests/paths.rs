//! Method and path rules (`methods`/`paths` on an allowlist entry), one
//! table through two entrances: plain HTTP on the forward path, and HTTPS
//! inside the interception a path rule turns on. Each case must get the
//! same decision and fact on both, and the origins, which log the raw
//! request targets they receive, must never see a path no rule allows: a
//! request goes out with the normal path that was matched. The client is
//! curl with `--path-as-is`, so dot-segments and escapes reach the proxy as
//! written. Then streams: an event stream reaches the client event by
//! event on both entrances. Origins on 127.0.0.2, fake DNS on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{proxy_section, TestProxy};
use egress_e2e::origin::http_origin;
use egress_e2e::raw::send;
use egress_e2e::tls_origin::tls_origin;
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

const RULES: &str = r#"methods = ["GET", "HEAD"], paths = ["/repos/acme/**", "/user"]"#;

/// How one request went: the path the origin received, or the deny reason.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Went {
    Reached(String),
    Denied(String),
}

use Went::{Denied, Reached};

fn reached(p: &str) -> Went {
    Reached(p.to_string())
}

fn denied(r: &str) -> Went {
    Denied(r.to_string())
}

/// (method, path as sent, outcome on both entrances).
fn cases() -> Vec<(&'static str, &'static str, Went)> {
    vec![
        ("GET", "/user", reached("/user")),
        ("HEAD", "/user", reached("/user")),
        ("GET", "/user?tab=1&x=%2f", reached("/user?tab=1&x=%2f")),
        ("GET", "/repos/acme", reached("/repos/acme")),
        ("GET", "/repos/acme/x/issues", reached("/repos/acme/x/issues")),
        ("GET", "/repos/acme/x/../y", reached("/repos/acme/y")),
        ("GET", "/repos/./acme/x", reached("/repos/acme/x")),
        ("GET", "/repos/acme/%7Ex", reached("/repos/acme/~x")),
        // Dot-segments that climb out of an allowed prefix: decided on
        // where they land.
        ("GET", "/repos/acme/../admin", denied("path_not_allowed")),
        ("GET", "/repos/acme/%2e%2e/admin", denied("path_not_allowed")),
        ("GET", "/repos/acme/%2E%2E/%2e%2e/user", reached("/user")),
        ("GET", "/repos/acme/x/../../../admin", denied("path_not_allowed")),
        ("GET", "/../user", denied("bad_target")),
        // Ambiguous between servers: refused.
        ("GET", "/repos/acme%2f..%2f..%2fadmin", denied("bad_target")),
        ("GET", "/repos/acme/x%5c..%5c..%5cadmin", denied("bad_target")),
        ("GET", "/repos/acme/..;/admin", denied("bad_target")),
        ("GET", "/repos/acme/%c0%ae%c0%ae/admin", denied("bad_target")),
        ("GET", "/user%00", denied("bad_target")),
        // Not the listed path: case, trailing dot, parameter, empty segment.
        ("GET", "/USER", denied("path_not_allowed")),
        ("GET", "/user.", denied("path_not_allowed")),
        ("GET", "/user;v=1", denied("path_not_allowed")),
        ("GET", "/repos//acme/x", denied("path_not_allowed")),
        ("GET", "//user", denied("path_not_allowed")),
        ("GET", "/admin", denied("path_not_allowed")),
        // Listed path, other method.
        ("POST", "/user", denied("method_not_allowed")),
        ("DELETE", "/repos/acme/x", denied("method_not_allowed")),
    ]
}

struct World {
    p: TestProxy,
    env: BTreeMap<String, String>,
    http_port: u16,
    tls_port: u16,
}

async fn world() -> (World, egress_e2e::origin::HttpOrigin, egress_e2e::tls_origin::TlsOrigin) {
    world_with(RULES).await
}

/// Both origins listed with `rules` (the text of an entry's `methods`/`paths`).
async fn world_with(rules: &str) -> (World, egress_e2e::origin::HttpOrigin, egress_e2e::tls_origin::TlsOrigin) {
    let dns = FakeDns::start().await;
    dns.set("plain.test", &["127.0.0.2"]);
    dns.set("tls.test", &["127.0.0.2"]);
    let plain = http_origin("127.0.0.2:0").await;
    let tls = tls_origin("127.0.0.2:0", &["tls.test"]).await;
    let dir = tempfile::tempdir().unwrap();
    let roots = tls.write_ca(dir.path());
    let (hp, tp) = (plain.addr.port(), tls.addr.port());
    let text = format!(
        "{}[proxy.interception]\nupstream_ca_file = \"{}\"\n[tools.w]\negress = [\n  {{ host = \"plain.test\", port = {hp}, {rules} }},\n  {{ host = \"tls.test\", port = {tp}, {rules} }},\n]\nfetch_timeout_ms = 5000\n",
        proxy_section(&dns, ""),
        roots.display(),
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), Some(Arc::new(MemorySink::new(10_000)))).await;
    let (status, v) = p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
    assert_eq!(status, 201, "{v}");
    let env = serde_json::from_value(v["env"].clone()).unwrap();
    std::mem::forget(dir);
    (
        World {
            p,
            env,
            http_port: hp,
            tls_port: tp,
        },
        plain,
        tls,
    )
}

/// curl with the run's env only, the path as written.
async fn curl(env: &BTreeMap<String, String>, method: &str, url: &str) -> (String, Option<String>) {
    let mut cmd = std::process::Command::new("curl");
    cmd.args([
        "-sS",
        "--path-as-is",
        "--max-time",
        "10",
        "-o",
        "/dev/null",
        "-D",
        "-",
        "-X",
        method,
    ]);
    if method == "HEAD" {
        cmd.arg("-I");
    }
    cmd.arg(url).env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&out.stdout).into_owned();
    // The last response head (a proxy's CONNECT answer comes first).
    let last = head.rsplit("HTTP/").next().unwrap_or("").to_string();
    let status = last.split_whitespace().nth(1).unwrap_or("").to_string();
    let header = |name: &str| {
        last.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let reason = header("x-egress-deny-reason");
    if let Some(r) = &reason {
        // The same denial for programs: one line of JSON naming the
        // reason, its rule, the tool and the fact.
        let d: egress_api::Denial = serde_json::from_str(&header("x-egress-denial").unwrap_or_default())
            .unwrap_or_else(|e| panic!("{method} {url}: X-Egress-Denial: {e}: {head}"));
        assert_eq!(&d.reason, r, "{method} {url}");
        let rule = match r.as_str() {
            "path_not_allowed" => "paths",
            "method_not_allowed" => "methods",
            _ => "target",
        };
        assert_eq!(d.rule, rule, "{method} {url}");
        assert_eq!(Some(d.fact_id), header("x-egress-fact-id"), "{method} {url}");
        assert_eq!(d.tool.as_deref(), Some("w"), "{method} {url}");
    }
    assert!(
        !status.is_empty() && out.status.success(),
        "{method} {url}: {head} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (status, reason)
}

fn last_path(heads: &[String], before: usize) -> Option<String> {
    (heads.len() > before).then(|| {
        let first = heads.last().unwrap().lines().next().unwrap().to_string();
        first.split(' ').nth(1).unwrap().to_string()
    })
}

async fn facts(p: &TestProxy) -> Vec<Value> {
    let (_, v) = p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
    v["facts"].as_array().unwrap().clone()
}

#[tokio::test]
async fn one_table_of_path_rules_decides_the_same_in_plain_http_and_inside_interception() {
    let (w, plain, tls) = world().await;
    for (method, path, want) in cases() {
        for https in [false, true] {
            let url = if https {
                format!("https://tls.test:{}{path}", w.tls_port)
            } else {
                format!("http://plain.test:{}{path}", w.http_port)
            };
            let heads_before = if https { tls.heads().len() } else { plain.heads().len() };
            let facts_before = facts(&w.p).await.len();
            let (status, reason) = curl(&w.env, method, &url).await;
            let heads = if https { tls.heads() } else { plain.heads() };
            let got = match (reason, last_path(&heads, heads_before)) {
                (None, Some(p)) => Reached(p),
                (Some(r), None) => {
                    let facts = facts(&w.p).await;
                    assert_eq!(facts.len(), facts_before + 1, "{method} {url}: one fact");
                    let fact = facts.last().unwrap();
                    assert_eq!(
                        fact["reason"],
                        r.as_str(),
                        "{method} {url}: the answer and the fact agree"
                    );
                    assert_eq!(fact["target"]["kind"], "http", "{method} {url}: {fact}");
                    Denied(r)
                }
                (r, p) => panic!(
                    "{method} {url}: {status}, deny reason {r:?}, origin saw {p:?}; heads {:?} {:?}",
                    plain.heads(),
                    tls.heads()
                ),
            };
            assert_eq!(got, want, "{method} {url} ({status})");
        }
    }
    // What reached the origins is only what a rule allows.
    for head in plain.heads().iter().chain(tls.heads().iter()) {
        let line = head.lines().next().unwrap();
        let path = line.split(' ').nth(1).unwrap();
        let path = path.split('?').next().unwrap();
        assert!(
            path == "/user" || path == "/repos/acme" || path.starts_with("/repos/acme/"),
            "a path no rule allows reached an origin: {line}"
        );
        assert!(!path.contains(".."), "{line}");
    }
}

#[tokio::test]
async fn a_raw_backslash_or_fragment_never_reaches_the_origin() {
    let (w, plain, _tls) = world().await;
    let run_auth = {
        let (status, v) = w.p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
        assert_eq!(status, 201);
        let id = v["run_id"].as_str().unwrap().to_string();
        let secret = v["secret"].as_str().unwrap().to_string();
        egress_e2e::harness::TestRun {
            id,
            secret,
            url: String::new(),
        }
        .auth()
    };
    for path in [
        "/repos/acme/x\\..\\..\\admin",
        "/repos/acme/x/..\\admin",
        "/repos/acme/%5c",
    ] {
        let req = format!(
            "GET http://plain.test:{}{path} HTTP/1.1\r\nHost: plain.test:{}\r\nProxy-Authorization: {run_auth}\r\nConnection: close\r\n\r\n",
            w.http_port, w.http_port
        );
        let r = send(w.p.proxy, req.as_bytes()).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
    }
    assert!(plain.heads().is_empty(), "{:?}", plain.heads());
    // A fragment is not sent on: the origin sees the path before it, and
    // that is what is decided.
    for (path, status, seen) in [("/admin#/user", 403, None), ("/user#/../admin", 404, Some("GET /user"))] {
        let req = format!(
            "GET http://plain.test:{}{path} HTTP/1.1\r\nHost: plain.test:{}\r\nProxy-Authorization: {run_auth}\r\nConnection: close\r\n\r\n",
            w.http_port, w.http_port
        );
        let before = plain.heads().len();
        let r = send(w.p.proxy, req.as_bytes()).await;
        assert_eq!(r.status, status, "{path}: {}", r.text());
        let heads = plain.heads();
        assert_eq!(heads[before..].first().and_then(|h| h.lines().next()), seen, "{path}");
    }
}

#[test]
fn check_says_which_hosts_path_rules_intercept() {
    let text =
        format!("[tools.w]\negress = [{{ host = \"api.github.com\", port = 443, {RULES} }}, \"example.com:443\"]\n");
    let (ok, stdout, stderr) = egress_e2e::process::proxy_check(&text);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("api.github.com:443 methods=GET,HEAD paths=/repos/acme/**,/user"),
        "{stdout}"
    );
    assert!(stdout.contains("intercepted"), "{stdout}");
}

/// When each `id:` line of an event stream reached curl (`-N`: no buffering
/// in curl), counted from the first.
async fn arrivals(env: &BTreeMap<String, String>, url: &str) -> Vec<std::time::Duration> {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sSN", "--max-time", "10", url]).env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    cmd.stdout(std::process::Stdio::piped());
    tokio::task::spawn_blocking(move || {
        let mut child = cmd.spawn().unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut first = None;
        let mut at = vec![];
        for line in out.lines().map_while(Result::ok) {
            if line.starts_with("id:") {
                let now = std::time::Instant::now();
                at.push(now - *first.get_or_insert(now));
            }
        }
        let _ = child.wait();
        at
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn an_event_stream_arrives_event_by_event_on_both_entrances() {
    // The origin sends 4 events 250 ms apart: buffered anywhere on the way,
    // they would arrive together at the end.
    let (w, plain, tls) = world_with(r#"methods = ["GET"], paths = ["/sse"]"#).await;
    for url in [
        format!("http://plain.test:{}/sse?n=4&ms=250", w.http_port),
        format!("https://tls.test:{}/sse?n=4&ms=250", w.tls_port),
    ] {
        let at = arrivals(&w.env, &url).await;
        assert_eq!(at.len(), 4, "{url}: {at:?}");
        assert!(
            at[3] >= std::time::Duration::from_millis(500),
            "{url}: the events arrived together, the stream was buffered: {at:?}"
        );
    }
    // Nothing added to what the client asked for: no Accept-Encoding.
    for head in plain.heads().iter().chain(tls.heads().iter()) {
        assert!(!head.contains("accept-encoding"), "{head}");
    }
}
