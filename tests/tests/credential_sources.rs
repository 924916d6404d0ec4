//! Live credential sources through the real proxy: OAuth2 tokens minted
//! from a real authorization server (authlib, tests/credentials), a file
//! re-read on its TTL, a command. The tool only ever holds its placeholder;
//! the API behind `api.example` (127.0.0.2, plain HTTP with
//! `allow_plaintext = true`) accepts a request only with a token its server
//! issued and that has not expired, so a 200 proves the token in force was
//! valid. Names resolve through a fake DNS; every address is loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::{api_credential, world, write_secret};
use egress_e2e::harness::{proxy_section, sample, TestRun};
use egress_e2e::oauth2::{available, OAuthServer};
use egress_e2e::{FakeDns, TestProxy};
use egress_proxy::facts::MemorySink;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A proxy whose tool `w` reaches `api.example` (the server's API) and
/// `other.example` (a canary), with the credential `api` minted by `mint`
/// (TOML of the `mint` table's inside).
struct Minted {
    p: TestProxy,
    server: OAuthServer,
    canary: egress_e2e::origin::Canary,
    _dir: tempfile::TempDir,
}

async fn minted(lifetime_s: u64, mint: impl Fn(&OAuthServer, &Path) -> String) -> Minted {
    let dir = tempfile::tempdir().unwrap();
    let server = OAuthServer::start(dir.path(), lifetime_s);
    let dns = FakeDns::start().await;
    for n in ["auth.example", "api.example", "other.example"] {
        dns.set(n, &["127.0.0.2"]);
    }
    let canary = egress_e2e::origin::canary("127.0.0.2:0").await;
    let api = format!("api.example:{}", server.plain.port());
    let text = format!(
        "{}\n[proxy.interception]\nupstream_ca_file = \"{}\"\n\n[tools.w]\negress = [\"{api}\", \"other.example:{}\"]\n\
         [tools.w.credentials.api]\nhosts = [\"{api}\"]\nvalue = \"Bearer ${{secret}}\"\nplaceholder_env = \"API_TOKEN\"\n\
         allow_plaintext = true\nmint = {}\n",
        proxy_section(&dns, ""),
        server.ca_file.display(),
        canary.addr.port(),
        mint(&server, dir.path()),
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await;
    Minted {
        p,
        server,
        canary,
        _dir: dir,
    }
}

/// `oauth2_client_credentials` for the server's confidential client.
fn client_credentials(s: &OAuthServer, dir: &Path, extra: &str) -> String {
    let cs = dir.join("client.secret");
    write_secret(&cs, "cs-loom-secret", 0o600);
    format!(
        "{{ oauth2_client_credentials = {{ token_url = \"https://auth.example:{}/token\", client_id = \"loom\", \
         client_secret = {{ file = \"{}\" }}, scope = \"read\"{extra} }} }}",
        s.tls.port(),
        cs.display()
    )
}

impl Minted {
    fn api(&self, path: &str) -> String {
        format!("http://api.example:{}{path}", self.server.plain.port())
    }

    async fn check(&self, run: &TestRun) -> egress_e2e::raw::RawResponse {
        self.p.get(run, &self.api("/api/check"), "").await
    }

    async fn issued(&self) -> Vec<String> {
        let s = self.server.stats().await;
        s["issued"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    }
}

#[tokio::test]
async fn fifty_concurrent_requests_cause_one_token_request() {
    if !available() {
        return;
    }
    let m = minted(60, |s, d| client_credentials(s, d, "")).await;
    let run = m.p.run("w").await;
    let m = Arc::new(m);
    let mut tasks = vec![];
    for _ in 0..50 {
        let (m, run) = (m.clone(), run.clone());
        tasks.push(tokio::spawn(async move { m.check(&run).await.status }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200, "every request carried a valid token");
    }
    assert_eq!(m.server.token_requests().await, 1, "one token request for all of them");
    let stats = m.server.stats().await;
    assert_eq!(stats["by_grant"]["client_credentials"], 1);
    // The run view shows the credential's state, never its value.
    let (_, view) = m.p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    let c = &view["credentials"][0];
    assert_eq!(c["name"], "api");
    assert_eq!(c["source"], "oauth2_client_credentials");
    assert_eq!(c["live"], true);
    assert_eq!(c["available"], true);
    assert_eq!(c["last_refresh"]["outcome"], "ok");
    assert!(c["expires_at"].is_string() && c["age_ms"].is_u64(), "{view}");
    let token = &m.issued().await[0];
    assert!(!view.to_string().contains(token.as_str()));
    let metrics = m.p.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "egress_credential_refresh_total{tool=\"w\",credential=\"api\",outcome=\"ok\"}"
        ),
        1.0
    );
    assert!(
        sample(
            &metrics,
            "egress_credential_expiry_seconds{tool=\"w\",credential=\"api\"}"
        ) > 1.0e9
    );
    assert!(!metrics.contains(token.as_str()));
}

#[tokio::test]
async fn an_expiring_token_is_refreshed_before_it_is_refused() {
    if !available() {
        return;
    }
    // 2-second tokens, refreshed 1 s before they expire.
    let m = minted(2, |s, d| client_credentials(s, d, ", refresh_before_ms = 1000")).await;
    let run = m.p.run("w").await;
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < Duration::from_secs(7) {
        let r = m.check(&run).await;
        assert_eq!(r.status, 200, "after {:?}: {}", start.elapsed(), r.text());
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let minted = m.server.token_requests().await;
    assert!(minted >= 4, "a token every second or so: {minted}");
    assert!(minted <= 12, "no refresh storm: {minted} for {n} requests");
}

#[tokio::test]
async fn a_token_server_down_serves_the_old_token_until_expiry_then_fails_closed() {
    if !available() {
        return;
    }
    let m = minted(3, |s, d| {
        client_credentials(s, d, ", refresh_before_ms = 2000, failure_ttl_ms = 200")
    })
    .await;
    let run = m.p.run("w").await;
    let minted_at = Instant::now();
    m.server.set_down(true).await;
    // Refreshes fail from 1 s on; the token in hand is still valid.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = m.check(&run).await;
    assert_eq!(r.status, 200, "the old token is served until it expires: {}", r.text());
    // Past its expiry: fail closed, with a fact.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(minted_at.elapsed()) + Duration::from_millis(300)).await;
    let r = m.check(&run).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.deny_reason(), Some("credential_unavailable"));
    let facts = m.p.facts_with_reason("credential_unavailable").await;
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert!(
        facts[0]["detail"]
            .as_str()
            .unwrap()
            .contains("credential api of tool w"),
        "{}",
        facts[0]
    );
    let metrics = m.p.metrics().await;
    assert!(
        sample(
            &metrics,
            "egress_credential_refresh_total{tool=\"w\",credential=\"api\",outcome=\"error\"}"
        ) >= 2.0,
        "{metrics}"
    );
    let (_, view) = m.p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    let c = &view["credentials"][0];
    assert_eq!(c["available"], false, "{view}");
    assert_eq!(c["last_refresh"]["outcome"], "error");
    let error = c["last_refresh"]["error"].as_str().unwrap();
    assert!(error.contains("answered 503"), "the status, never the body: {error}");
    assert!(!error.contains("token endpoint down"), "{error}");
    // The server is back: the next refresh (within failure_ttl_ms) serves again.
    m.server.set_down(false).await;
    let back = Instant::now();
    loop {
        let r = m.check(&run).await;
        if r.status == 200 {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(5), "not recovered: {}", r.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_minted_token_is_never_returned_to_the_tool_nor_sent_elsewhere() {
    if !available() {
        return;
    }
    let m = minted(60, |s, d| client_credentials(s, d, "")).await;
    let (status, v) =
        m.p.control("POST", "/v1/runs", Some(serde_json::json!({ "tool": "w" })))
            .await;
    assert_eq!(status, 201, "{v}");
    let run = TestRun {
        id: v["run_id"].as_str().unwrap().to_owned(),
        secret: v["secret"].as_str().unwrap().to_owned(),
        url: v["proxy_url"].as_str().unwrap().to_owned(),
    };
    let placeholder = v["env"]["API_TOKEN"].as_str().unwrap().to_owned();
    // A reflecting origin: it echoes the token it received.
    let r = m.p.get(&run, &m.api("/api/echo"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let token = m.issued().await.pop().unwrap();
    assert!(!r.text().contains(&token), "the minted token came back: {}", r.text());
    assert!(r.text().contains(&format!("Bearer {placeholder}")), "{}", r.text());
    // Sent to another allowed host: credential_misuse, and the host never sees it.
    let other = format!("http://other.example:{}/", m.canary.addr.port());
    for (url, headers) in [
        (other.clone(), format!("Authorization: Bearer {token}\r\n")),
        (format!("{other}?t={token}"), String::new()),
    ] {
        let r = m.p.get(&run, &url, &headers).await;
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(r.deny_reason(), Some("credential_misuse"));
    }
    assert_eq!(m.canary.connections(), 0);
}

#[tokio::test]
async fn a_rotated_refresh_token_is_used_for_the_next_refresh_and_written_back() {
    if !available() {
        return;
    }
    let rt_file = std::cell::RefCell::new(None);
    let m = minted(2, |s, d| {
        let f = d.join("refresh.token");
        write_secret(&f, "rt-initial", 0o600);
        *rt_file.borrow_mut() = Some(f.clone());
        format!(
            "{{ oauth2_refresh_token = {{ token_url = \"https://auth.example:{}/token\", client_id = \"loom-public\", \
             refresh_token = {{ file = \"{}\" }}, refresh_before_ms = 1000 }} }}",
            s.tls.port(),
            f.display()
        )
    })
    .await;
    let rt_file = rt_file.into_inner().unwrap();
    let run = m.p.run("w").await;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(3500) {
        let r = m.check(&run).await;
        assert_eq!(r.status, 200, "{}", r.text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stats = m.server.stats().await;
    let presented: Vec<&str> = stats["refresh_tokens_presented"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(presented.len() >= 3, "{stats}");
    assert_eq!(presented[0], "rt-initial");
    let mut seen = std::collections::BTreeSet::new();
    for p in &presented {
        assert!(
            seen.insert(*p),
            "a refresh token was presented twice (rotation ignored): {presented:?}"
        );
    }
    // The newest rotated token is in the file, for a restart.
    let on_disk = std::fs::read_to_string(&rt_file).unwrap();
    assert_ne!(on_disk.trim(), "rt-initial");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(&rt_file).unwrap().permissions().mode() & 0o777, 0o600);
}

#[tokio::test]
async fn a_token_endpoint_in_a_denied_range_is_never_dialled() {
    // No server: the endpoint's name resolves to the metadata address, which
    // the default ranges deny; the proxy refuses before dialling.
    let dir = tempfile::tempdir().unwrap();
    let w = world("unused-static").await;
    w.dns.set("auth.example", &["169.254.169.254"]);
    let cs = dir.path().join("cs");
    write_secret(&cs, "cs", 0o600);
    let api = format!("api.example:{}", w.origin.addr.port());
    let text = format!(
        "{}\n[tools.w]\negress = [\"{api}\"]\n[tools.w.credentials.api]\nhosts = [\"{api}\"]\nvalue = \"Bearer ${{secret}}\"\n\
         placeholder_env = \"API_TOKEN\"\nallow_plaintext = true\n\
         mint = {{ oauth2_client_credentials = {{ token_url = \"https://auth.example/token\", client_id = \"c\", client_secret = {{ file = \"{}\" }} }} }}\n",
        proxy_section(&w.dns, ""),
        cs.display()
    );
    let p = TestProxy::start_config(w.dns, &text, None, Some(Arc::new(MemorySink::new(100)))).await;
    let run = p.run("w").await;
    let r = p.get(&run, &format!("http://{api}/"), "").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.deny_reason(), Some("credential_unavailable"));
    assert_eq!(w.origin.heads().len(), 0, "the request did not leave");
    let (_, view) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    let e = view["credentials"][0]["last_refresh"]["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        e.contains("resolves to no address the policy allows: 169.254.169.254"),
        "{e}"
    );
}

/// A proxy with tool `w` whose credential `api` has `secret = {source}`.
async fn sourced(source: &str) -> (TestProxy, egress_e2e::origin::HttpOrigin, tempfile::TempDir, TestRun) {
    let w = world("unused-static").await;
    let api = format!("api.example:{}", w.origin.addr.port());
    let text = format!(
        "{}\n[tools.w]\negress = [\"{api}\"]\n{}allow_plaintext = true\n",
        proxy_section(&w.dns, ""),
        api_credential("w", &api, &source.replace("$DIR", &w.dir.path().display().to_string()))
    );
    let p = TestProxy::start_config(w.dns, &text, None, Some(Arc::new(MemorySink::new(1000)))).await;
    let run = p.run("w").await;
    (p, w.origin, w.dir, run)
}

/// The bearer token the origin saw last.
fn last_token(origin: &egress_e2e::origin::HttpOrigin) -> String {
    let head = origin.heads().pop().unwrap_or_default();
    head.lines()
        .find_map(|l| l.strip_prefix("authorization: Bearer "))
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn a_file_rotated_under_a_running_proxy_is_picked_up_within_its_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("tok");
    write_secret(&f, "file-value-one", 0o600);
    let (p, origin, _d, run) = sourced(&format!("{{ file = \"{}\", ttl_ms = 300 }}", f.display())).await;
    let url = format!("http://api.example:{}/", origin.addr.port());
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_token(&origin), "file-value-one");
    write_secret(&f, "file-value-two", 0o600);
    let start = Instant::now();
    loop {
        let r = p.get(&run, &url, "").await;
        assert_eq!(r.status, 200, "{}", r.text());
        if last_token(&origin) == "file-value-two" {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(3), "not picked up within its TTL");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The old value is still a secret of the policy: scrubbed, refused elsewhere.
    let r = p
        .get(&run, &format!("{url}headers"), "X-Echo: file-value-one\r\n")
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("x-echo: "), "{}", r.text());
    assert!(!r.text().contains("file-value-one"), "{}", r.text());
}

#[tokio::test]
async fn a_failing_command_keeps_its_last_value_then_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let v = dir.path().join("value");
    std::fs::write(&v, "cmd-value-1").unwrap();
    // Prints the file; exits 1 once it is gone.
    let source = format!(
        "{{ command = [\"/bin/sh\", \"-c\", \"cat {}\"], ttl_ms = 300, failure_ttl_ms = 100, stale_ms = 1500 }}",
        v.display()
    );
    let (p, origin, _d, run) = sourced(&source).await;
    let url = format!("http://api.example:{}/", origin.addr.port());
    assert_eq!(p.get(&run, &url, "").await.status, 200);
    assert_eq!(last_token(&origin), "cmd-value-1");
    std::fs::remove_file(&v).unwrap();
    let gone = Instant::now();
    // Within ttl + stale of its last good read, the last value is served.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let r = p.get(&run, &url, "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_token(&origin), "cmd-value-1");
    // Then it fails closed.
    loop {
        let r = p.get(&run, &url, "").await;
        if r.status == 503 {
            assert_eq!(r.deny_reason(), Some("credential_unavailable"));
            break;
        }
        assert!(gone.elapsed() < Duration::from_secs(5), "still served: {}", r.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, view) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    let c: &Value = &view["credentials"][0];
    assert_eq!(c["source"], "command");
    assert!(
        c["last_refresh"]["error"]
            .as_str()
            .unwrap()
            .contains("failed (exit status: 1)"),
        "{view}"
    );
}

#[test]
fn check_says_where_each_secret_comes_from_and_tries_live_ones_never_printing_a_value() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.token");
    write_secret(&good, "check-file-value", 0o600);
    let loose = dir.path().join("loose.token");
    write_secret(&loose, "check-loose-value", 0o644);
    let text = format!(
        "[tools.w]\negress = [\"a.example:443\", \"b.example:443\", \"c.example:443\", \"d.example:443\"]\n\
         [tools.w.credentials.file]\nhosts = [\"a.example:443\"]\nvalue = \"${{secret}}\"\nplaceholder_env = \"A\"\n\
         secret = {{ file = \"{}\", ttl_ms = 60000 }}\n\
         [tools.w.credentials.loose]\nhosts = [\"b.example:443\"]\nvalue = \"${{secret}}\"\nplaceholder_env = \"B\"\n\
         secret = {{ file = \"{}\", ttl_ms = 60000 }}\n\
         [tools.w.credentials.cmd]\nhosts = [\"c.example:443\"]\nvalue = \"${{secret}}\"\nplaceholder_env = \"C\"\n\
         secret = {{ command = [\"/bin/sh\", \"-c\", \"echo '{{\\\"value\\\": \\\"check-cmd-value\\\", \\\"expires_at\\\": 1893553445}}'\"] }}\n\
         [tools.w.credentials.minted]\nhosts = [\"d.example:443\"]\nvalue = \"Bearer ${{secret}}\"\nplaceholder_env = \"D\"\n\
         mint = {{ oauth2_client_credentials = {{ token_url = \"https://auth.example/token\", client_id = \"loom\", client_secret = {{ file = \"{}\" }} }} }}\n\
         [tools.s]\negress = [\"s3.example:443\", \"t.example:443\"]\n\
         [tools.s.credentials.aws]\nhosts = [\"s3.example:443\"]\nplaceholder_env = \"AWS_ACCESS_KEY_ID\"\n\
         sign = {{ aws_sigv4 = {{ service = \"s3\", region = \"eu-west-1\", access_key_id = {{ file = \"{}\" }}, secret_access_key = {{ file = \"{}\" }} }} }}\n\
         [tools.s.credentials.sts]\nhosts = [\"t.example:443\"]\nplaceholder_env = \"AK2\"\n\
         sign = {{ aws_sigv4 = {{ service = \"sts-test\", region = \"eu-west-1\", secret_env = \"SK2\", assume_role = {{ role_arn = \"arn:aws:iam::1:role/r\", region = \"eu-west-1\" }} }} }}\n",
        good.display(),
        loose.display(),
        good.display(),
        good.display(),
        good.display(),
    );
    let (ok, stdout, stderr) = egress_e2e::process::proxy_check(&text);
    assert!(ok, "{stdout}{stderr}");
    for want in [
        "re-read every 60000 ms, served 300000 ms stale at most (read now: ok)",
        "loose.token, re-read every 60000 ms, served 300000 ms stale at most (read now: FAILED:",
        "is mode 0644: a secret file must be 0600 or stricter",
        "secret: command /bin/sh, every 300000 ms, timeout 10000 ms, served 300000 ms stale at most (ran now: ok, expires 2030-01-02T03:04:05",
        "secret: minted (oauth2_client_credentials) at https://auth.example/token as client loom, refreshed 60000 ms before expiry (client_secret reads; the proxy mints at start)",
        "credential aws -> s3.example:443 signed again with SigV4 for s3 in eu-west-1 (CONNECTs there are intercepted; never in plain HTTP)",
        "secret key: file",
        "keys: aws_sts_assume_role arn:aws:iam::1:role/r at https://sts.eu-west-1.amazonaws.com/ for 3600 s, refreshed 300000 ms before expiry",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    for value in ["check-file-value", "check-loose-value", "check-cmd-value"] {
        assert!(!stdout.contains(value), "{stdout}");
    }
}
