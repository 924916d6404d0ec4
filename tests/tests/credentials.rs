//! Credentials that never enter the sandbox: a run gets a placeholder per
//! credential of its tool (`POST /v1/runs` → `env`); on plain HTTP to one
//! of the credential's hosts (allowed here by `allow_plaintext = true`, the
//! origin being on loopback) the proxy writes the real secret in (replacing
//! the placeholder, or adding the header); the placeholder sent anywhere
//! else is `credential_misuse`, recorded, never forwarded; a rotated secret
//! is used after a reload; the secret shows in no fact, log line or metric.
//! What the origin received is read from its recording: what it echoes
//! back is scrubbed (`secrets.rs`). Loopback origins on 127.0.0.2, fake DNS.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::{api_credential, file_source, write_secret};
use egress_e2e::harness::{basic, proxy_section, TestRun, TOKEN};
use egress_e2e::origin::{http_origin, Canary, HttpOrigin};
use egress_e2e::process::{free_addr, write_config, ProxyProcess};
use egress_e2e::{FakeDns, TestProxy};
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SECRET: &str = "tok-REAL-SECRET-9f8e7d6c";
const ROTATED: &str = "tok-ROTATED-SECRET-1a2b3c";

/// The `[tools.w]` table: `api.example` holds the credential (in plain
/// HTTP, to loopback), `other.example` is allowed too but is not one of its
/// hosts.
fn tools(origin: u16, other: u16, secret_file: &Path) -> String {
    format!(
        r#"
[tools.w]
egress = ["api.example:{origin}", "other.example:{other}"]
{}allow_plaintext = true
"#,
        api_credential("w", &format!("api.example:{origin}"), &file_source(secret_file))
    )
}

struct Setup {
    p: TestProxy,
    origin: HttpOrigin,
    canary: Canary,
    dir: tempfile::TempDir,
    secret_file: PathBuf,
}

/// The world both proxies of these tests see.
async fn world() -> (FakeDns, HttpOrigin, Canary, tempfile::TempDir, PathBuf) {
    let w = egress_e2e::credentials::world(SECRET).await;
    (w.dns, w.origin, w.canary, w.dir, w.secret_file)
}

async fn setup() -> Setup {
    let (dns, origin, canary, dir, secret_file) = world().await;
    let text = format!(
        "{}\n{}",
        proxy_section(&dns, ""),
        tools(origin.addr.port(), canary.addr.port(), &secret_file)
    );
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(dns, &text, Some(cfg), Some(Arc::new(MemorySink::new(10_000)))).await;
    Setup {
        p,
        origin,
        canary,
        dir,
        secret_file,
    }
}

/// Creates a run of `w`; returns it and its `env`.
async fn run(p: &TestProxy) -> (TestRun, Value) {
    let (status, v) = p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
    assert_eq!(status, 201, "{v}");
    let run = TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    };
    (run, v["env"].clone())
}

fn placeholder(env: &Value) -> String {
    env["API_TOKEN"].as_str().unwrap().to_owned()
}

impl Setup {
    fn api(&self, path: &str) -> String {
        format!("http://api.example:{}{path}", self.origin.addr.port())
    }

    fn other(&self, path: &str) -> String {
        format!("http://other.example:{}{path}", self.canary.addr.port())
    }
}

#[tokio::test]
async fn a_run_gets_the_proxy_variables_and_one_placeholder_never_the_secret() {
    let s = setup().await;
    let (run, env) = run(&s.p).await;
    for k in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        assert_eq!(env[k].as_str(), Some(run.url.as_str()), "{k}");
    }
    assert_eq!(env["NO_PROXY"], "");
    let socks = run.url.replacen("http://", "socks5h://", 1);
    assert_eq!(env["LOOM_SOCKS_PROXY"].as_str(), Some(socks.as_str()));
    let ph = placeholder(&env);
    assert!(ph.starts_with("loom-cred-") && ph.len() == 10 + 32, "{ph}");
    let (_, env2) = self::run(&s.p).await;
    assert_ne!(placeholder(&env2), ph, "a placeholder is per run");
    let (_, view) = s.p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert!(!view.to_string().contains(SECRET) && !env.to_string().contains(SECRET));
}

#[tokio::test]
async fn the_origin_sees_the_real_token_when_the_child_sends_the_placeholder() {
    let s = setup().await;
    let (run, env) = run(&s.p).await;
    let ph = placeholder(&env);
    let r =
        s.p.get(
            &run,
            &s.api(&format!("/headers?key={ph}")),
            &format!("Authorization: token {ph}\r\nX-Echo: k={ph}\r\n"),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = s.origin.heads().pop().unwrap();
    assert!(seen.contains(&format!("authorization: Bearer {SECRET}\n")), "{seen}");
    assert!(seen.contains(&format!("x-echo: k={SECRET}\n")), "{seen}");
    assert!(seen.starts_with(&format!("GET /headers?key={SECRET}\n")), "{seen}");
    assert!(!seen.contains(&ph), "{seen}");
    // What it echoed comes back with the placeholder again.
    assert!(
        r.text().contains(&format!("authorization: Bearer {ph}\n")),
        "{}",
        r.text()
    );
    assert!(!r.text().contains(SECRET), "{}", r.text());
}

/// The last request head the origin received.
fn last_head(s: &Setup) -> String {
    s.origin.heads().pop().unwrap_or_default()
}

#[tokio::test]
async fn the_origin_sees_the_injected_header_when_the_child_sends_nothing() {
    let s = setup().await;
    let (run, _) = run(&s.p).await;
    let r = s.p.get(&run, &s.api("/headers"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = last_head(&s);
    assert!(seen.contains(&format!("authorization: Bearer {SECRET}\n")), "{seen}");
    // A header the child set itself is replaced: the proxy is the authority.
    let r =
        s.p.get(&run, &s.api("/headers"), "Authorization: Bearer forged\r\n")
            .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = last_head(&s);
    assert!(seen.contains(&format!("authorization: Bearer {SECRET}\n")), "{seen}");
    assert!(!seen.contains("forged"));
}

#[tokio::test]
async fn the_placeholder_to_another_host_is_credential_misuse_and_never_leaves() {
    let s = setup().await;
    let (run, env) = run(&s.p).await;
    let ph = placeholder(&env);
    // Without the placeholder the other host is reached (the canary counts it).
    let r = s.p.get(&run, &s.other("/"), "").await;
    assert_ne!(r.header("x-egress-deny-reason"), Some("credential_misuse"));
    let before = s.canary.connections();
    assert_eq!(before, 1, "the allowed host is reachable without the placeholder");

    for (path, headers) in [
        ("/".to_owned(), format!("Authorization: Bearer {ph}\r\n")),
        (format!("/leak?token={ph}"), String::new()),
        (format!("/{ph}"), String::new()),
    ] {
        let r = s.p.get(&run, &s.other(&path), &headers).await;
        assert_eq!(r.status, 403, "{path}: {}", r.text());
        assert_eq!(r.header("x-egress-deny-reason"), Some("credential_misuse"));
        assert!(!r.text().contains(&ph) && !r.text().contains(SECRET), "{}", r.text());
    }
    assert_eq!(s.canary.connections(), before, "nothing reached the other host");
    let facts: Vec<_> =
        s.p.facts()
            .await
            .into_iter()
            .filter(|f| f.reason == "credential_misuse")
            .collect();
    assert!(!facts.is_empty());
    for f in &facts {
        let text = serde_json::to_string(f).unwrap();
        assert!(f.detail.contains("credential api"), "{text}");
        assert!(!text.contains(&ph) && !text.contains(SECRET), "{text}");
    }
    let m = s.p.metrics().await;
    assert!(m.contains("reason=\"credential_misuse\""), "the denial is counted");
    // The credential's own host still gets it.
    let r =
        s.p.get(&run, &s.api("/headers"), &format!("Authorization: Bearer {ph}\r\n"))
            .await;
    assert_eq!(r.status, 200);
    assert!(s.origin.hits.load(std::sync::atomic::Ordering::SeqCst) >= 1);
}

#[tokio::test]
async fn a_rotated_secret_is_used_after_a_reload() {
    let s = setup().await;
    let (run, _) = run(&s.p).await;
    s.p.get(&run, &s.api("/headers"), "").await;
    assert!(last_head(&s).contains(SECRET));
    write_secret(&s.secret_file, ROTATED, 0o600);
    let (status, v) = s.p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status, 200, "{v}");
    let r = s.p.get(&run, &s.api("/headers"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = last_head(&s);
    assert!(seen.contains(&format!("authorization: Bearer {ROTATED}\n")), "{seen}");
    assert!(!seen.contains(SECRET));
    // The rotated secret is the one scrubbed from responses now.
    assert!(!r.text().contains(ROTATED), "{}", r.text());
}

#[tokio::test]
async fn a_secret_file_readable_by_others_is_a_config_error() {
    let s = setup().await;
    write_secret(&s.secret_file, ROTATED, 0o644);
    let (status, v) = s.p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status, 422, "{v}");
    assert_eq!(v["error"]["code"], "invalid_config");
    assert_eq!(
        v["error"]["problems"][0]["path"], "tools.w.credentials.api.secret",
        "{v}"
    );
    assert!(
        v["error"]["problems"][0]["message"].as_str().unwrap().contains("0644"),
        "{v}"
    );
    assert!(!v.to_string().contains(ROTATED));
    // The old policy, with the old secret, stays in force.
    let (run, _) = run(&s.p).await;
    s.p.get(&run, &s.api("/headers"), "").await;
    assert!(last_head(&s).contains(SECRET));
    // And a proxy does not start on it.
    let text = std::fs::read_to_string(s.dir.path().join("egress.toml")).unwrap();
    let config = egress_config::Config::parse(&text, "egress.toml").unwrap();
    let started = egress_proxy::start(egress_proxy::Options {
        config,
        config_path: None,
        control_token: Some(TOKEN.into()),
        facts: Some(Arc::new(MemorySink::new(10))),
        listeners: Default::default(),
    })
    .await;
    let e = started.err().expect("the proxy refuses a 0644 secret file").to_string();
    assert!(
        e.contains("tools.w.credentials.api.secret") && e.contains("0644"),
        "{e}"
    );
}

/// The real binary, so its log output can be searched: after injected,
/// refused and rotated requests, the secret is in no log line, no fact,
/// no metric and no run view.
#[tokio::test]
async fn the_secret_never_shows_in_facts_logs_or_metrics() {
    use egress_e2e::harness::{all_facts_at, control_call};
    let (dns, origin, canary, dir, secret_file) = world().await;
    let rest = format!(
        "allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n{}",
        dns.addr,
        tools(origin.addr.port(), canary.addr.port(), &secret_file)
    );
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, &rest);
    let pp = ProxyProcess::start(&cfg, proxy, control, TOKEN, &["--log-format", "json"]);
    let created = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": "w" })), Some(TOKEN)).await;
    assert_eq!(created.status, 201, "{}", created.text());
    let v: Value = serde_json::from_slice(&created.body).unwrap();
    let (id, secret) = (v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let ph = v["env"]["API_TOKEN"].as_str().unwrap().to_owned();
    let get = |url: String, extra: String| {
        let host = url
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap_or("")
            .to_owned();
        let req = format!(
            "GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\nConnection: close\r\n{extra}\r\n",
            basic(id, secret)
        );
        async move { egress_e2e::send(proxy, req.as_bytes()).await }
    };
    let api = format!("http://api.example:{}", origin.addr.port());
    let other = format!("http://other.example:{}", canary.addr.port());
    let r = get(
        format!("{api}/headers?k={ph}"),
        format!("Authorization: Bearer {ph}\r\n"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(origin.heads().pop().unwrap().contains(SECRET), "injected");
    assert!(
        r.text().contains(&ph) && !r.text().contains(SECRET),
        "scrubbed: {}",
        r.text()
    );
    let r = get(format!("{other}/?k={ph}"), String::new()).await;
    assert_eq!(r.header("x-egress-deny-reason"), Some("credential_misuse"));
    let r = get(format!("{other}/"), format!("X-Token: {ph}\r\n")).await;
    assert_eq!(r.header("x-egress-deny-reason"), Some("credential_misuse"));
    let r = get(format!("http://not-listed.example/?k={ph}"), String::new()).await;
    assert_eq!(r.status, 403);
    write_secret(&secret_file, ROTATED, 0o600);
    let reload = control_call(control, "POST", "/v1/policy/reload", None, Some(TOKEN)).await;
    assert_eq!(reload.status, 200, "{}", reload.text());
    get(format!("{api}/headers"), String::new()).await;
    assert!(origin.heads().pop().unwrap().contains(ROTATED));

    let facts = serde_json::to_string(&all_facts_at(control).await).unwrap();
    assert!(facts.contains("credential_misuse"), "{facts}");
    let metrics = control_call(control, "GET", "/metrics", None, None).await.text();
    let view = control_call(control, "GET", &format!("/v1/runs/{id}"), None, Some(TOKEN))
        .await
        .text();
    let policy = control_call(control, "GET", "/v1/policy", None, Some(TOKEN))
        .await
        .text();
    let logs = pp.logs();
    assert!(logs.contains("credential_misuse"), "the denials are logged: {logs}");
    for (what, text) in [
        ("facts", &facts),
        ("metrics", &metrics),
        ("logs", &logs),
        ("run view", &view),
        ("policy", &policy),
    ] {
        for s in [SECRET, ROTATED] {
            assert!(!text.contains(s), "the secret shows in the {what}");
        }
    }
}

/// `secret = { env = "..." }`: the proxy reads the secret from its own
/// environment (given to the proxy process, never to the child) and injects
/// it; the run's env map carries only the placeholder.
#[tokio::test]
async fn a_secret_from_the_proxys_environment_is_injected() {
    use egress_e2e::harness::control_call;
    let dns = FakeDns::start().await;
    dns.set("api.example", &["127.0.0.2"]);
    let origin = http_origin("127.0.0.2:0").await;
    let dir = tempfile::tempdir().unwrap();
    let port = origin.addr.port();
    let rest = format!(
        r#"allow_ranges = ["127.0.0.2/32"]
[proxy.dns]
servers = ["{dns}"]
[tools.w]
egress = ["api.example:{port}"]
{}"#,
        api_credential(
            "w",
            &format!("api.example:{port}"),
            "{ env = \"LOOM_TEST_API_SECRET\" }"
        ) + "allow_plaintext = true\n",
        dns = dns.addr
    );
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, &rest);
    let _pp = ProxyProcess::start_with_env(
        &egress_e2e::process::bin("egress-proxy"),
        &cfg,
        (proxy, control),
        TOKEN,
        &[],
        &[("LOOM_TEST_API_SECRET", SECRET)],
    );
    let created = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": "w" })), Some(TOKEN)).await;
    assert_eq!(created.status, 201, "{}", created.text());
    assert!(
        !created.text().contains(SECRET),
        "the run's answer must not carry the secret"
    );
    let v: Value = serde_json::from_slice(&created.body).unwrap();
    let (id, secret) = (v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let req = format!(
        "GET http://api.example:{port}/headers HTTP/1.1\r\nHost: api.example:{port}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
        basic(id, secret)
    );
    let r = egress_e2e::send(proxy, req.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = origin.heads().pop().unwrap();
    assert!(seen.contains(&format!("Bearer {SECRET}")), "{seen}");
}
