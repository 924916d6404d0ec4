//! Secrets go one way: the real value goes only to its hosts, never comes
//! back to the tool, and never goes in cleartext.
//!
//! - A credential host that echoes what it was sent (its debug endpoint,
//!   TRACE, an error page, a redirect, a cookie, an event stream) hands the
//!   tool the placeholder, never the secret: heads, bodies (however they
//!   are split) and trailers are scrubbed, counted in
//!   `egress_credential_scrubs_total` and the run's view. A body in a
//!   content coding the proxy cannot read is refused (`502 unscrubbable`,
//!   a fact; every other way of framing or coding an answer, and every
//!   entrance, in `reflections.rs`).
//! - The real value of any credential of the policy, in any form, on a
//!   request to any host but its own is `credential_misuse`.
//! - A plain-HTTP request to a credential host is `credential_requires_tls`
//!   unless the credential allows plaintext; `allow_plaintext = true`
//!   reaches loopback addresses only.
//!
//! Loopback origins on 127.0.0.2 and a fake DNS; the test whose names
//! resolve elsewhere runs in a namespace holding only `lo`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::{api_credential, file_source, world, World};
use egress_e2e::harness::{proxy_section, sample, TestRun};
use egress_e2e::netns::isolated;
use egress_e2e::origin::{canary, Canary, HttpOrigin};
use egress_e2e::TestProxy;
use egress_proxy::facts::MemorySink;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SECRET: &str = "sk-REAL/secret value-7f3a";

struct Setup {
    p: TestProxy,
    origin: HttpOrigin,
    canary: Canary,
    _dir: tempfile::TempDir,
}

/// Tool `w` (`tool_extra` in its table): credential `api` on `api.example`
/// (`cred_extra` in its table), `other.example` allowed too; tool `v`: no
/// credential, `other.example` allowed.
async fn setup(tool_extra: &str, cred_extra: &str) -> Setup {
    let World {
        dns,
        origin,
        canary,
        dir,
        secret_file,
    } = world(SECRET).await;
    let (a, o) = (origin.addr.port(), canary.addr.port());
    let text = format!(
        "{}\n[tools.w]\negress = [\"api.example:{a}\", \"other.example:{o}\"]\n{tool_extra}\n{}{cred_extra}\n[tools.v]\negress = [\"other.example:{o}\"]\n",
        proxy_section(&dns, ""),
        api_credential("w", &format!("api.example:{a}"), &file_source(&secret_file))
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await;
    Setup {
        p,
        origin,
        canary,
        _dir: dir,
    }
}

/// `allow_plaintext = true`: the plain-HTTP origins here are on loopback.
const PLAIN: &str = "allow_plaintext = true\n";

impl Setup {
    fn api(&self, path: &str) -> String {
        format!("http://api.example:{}{path}", self.origin.addr.port())
    }

    fn other(&self, path: &str) -> String {
        format!("http://other.example:{}{path}", self.canary.addr.port())
    }

    /// A run of `tool` and its credential placeholder (if any).
    async fn run(&self, tool: &str) -> (TestRun, String) {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": tool }))).await;
        assert_eq!(status, 201, "{v}");
        let run = TestRun {
            id: v["run_id"].as_str().unwrap().to_owned(),
            secret: v["secret"].as_str().unwrap().to_owned(),
            url: v["proxy_url"].as_str().unwrap().to_owned(),
        };
        (run, v["env"]["API_TOKEN"].as_str().unwrap_or("").to_owned())
    }

    /// Every byte of the answer to a plain-HTTP request (status line,
    /// head, body as framed), read to the end.
    async fn raw(&self, run: &TestRun, method: &str, url: &str, extra: &str) -> String {
        let host = url.trim_start_matches("http://").split('/').next().unwrap();
        let req = format!(
            "{method} {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\nConnection: close\r\n{extra}\r\n",
            run.auth()
        );
        let mut s = TcpStream::connect(self.p.proxy).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = vec![];
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .expect("the answer ends")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// The value of `egress_credential_scrubs_total` for `w`'s `api`.
async fn scrubs(p: &TestProxy) -> f64 {
    sample(
        &p.metrics().await,
        "egress_credential_scrubs_total{tool=\"w\",credential=\"api\"}",
    )
}

#[tokio::test]
async fn what_a_credential_host_echoes_comes_back_with_the_placeholder() {
    let s = setup("", PLAIN).await;
    let (run, ph) = s.run("w").await;
    assert_eq!(scrubs(&s.p).await, 0.0, "the series exists at 0");
    let auth = format!("Authorization: Bearer {ph}\r\n");
    let cases = [
        ("GET", s.api("/headers"), auth.clone()),
        ("GET", s.api("/headers?chunk=3"), auth.clone()),
        ("GET", s.api(&format!("/headers?chunk=1&key={ph}")), String::new()),
        ("GET", s.api(&format!("/reflect?key={ph}")), auth.clone()),
        ("TRACE", s.api("/anything"), auth.clone()),
        ("GET", s.api("/error"), auth.clone()),
        ("GET", s.api("/sse?n=3"), auth.clone()),
    ];
    for (method, url, extra) in &cases {
        let got = s.raw(&run, method, url, extra).await;
        assert!(got.starts_with("HTTP/1.1 "), "{method} {url}: {got}");
        assert!(!got.contains(SECRET), "{method} {url} hands back the secret:\n{got}");
        assert!(!got.contains("sk-REAL%2Fsecret%20value"), "{method} {url}:\n{got}");
        assert!(got.contains(&ph), "{method} {url} echoes the placeholder:\n{got}");
    }
    // Each echo really carried the secret from the origin.
    let heads = s.origin.heads();
    assert_eq!(heads.len(), cases.len());
    assert!(
        heads
            .iter()
            .all(|h| h.contains(SECRET) || h.contains("sk-REAL%2Fsecret%20value-7f3a")),
        "{heads:?}"
    );
    let reflect = s.raw(&run, "GET", &s.api(&format!("/reflect?key={ph}")), &auth).await;
    for part in [
        format!("location: /next?key={ph}"),
        format!("set-cookie: auth=Bearer {ph}; Path=/"),
        format!("x-echo: Bearer {ph}"),
        format!("\"authorization\":\"Bearer {ph}\""),
    ] {
        assert!(reflect.contains(&part), "{part} in:\n{reflect}");
    }
    assert!(!reflect.to_ascii_lowercase().contains("content-length"), "{reflect}");
    let counted = scrubs(&s.p).await;
    assert!(counted >= cases.len() as f64, "{counted}");
    let (_, view) = s.p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(view["credential_scrubs"]["api"].as_f64(), Some(counted), "{view}");
}

#[tokio::test]
async fn an_event_stream_from_a_credential_host_stays_live() {
    let s = setup("", PLAIN).await;
    let (run, ph) = s.run("w").await;
    // The second event comes a minute after the first: the first must be
    // read long before it.
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: api.example:{}\r\nProxy-Authorization: {}\r\n\r\n",
        s.api("/sse?n=2&ms=60000"),
        s.origin.addr.port(),
        run.auth()
    );
    let mut c = TcpStream::connect(s.p.proxy).await.unwrap();
    c.write_all(req.as_bytes()).await.unwrap();
    let mut got = vec![];
    let first = async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("\n\n\r\n") {
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("the first event arrives while the stream is open");
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains(&format!("data: Bearer {ph}\n\n")), "{text}");
    assert!(!text.contains(SECRET), "{text}");
}

#[tokio::test]
async fn a_body_the_proxy_cannot_scrub_is_refused_and_the_origin_is_asked_for_identity() {
    let s = setup("", PLAIN).await;
    let (run, _) = s.run("w").await;
    let r = s.p.get(&run, &s.api("/gzip"), "Accept-Encoding: gzip\r\n").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.deny_reason(), Some("unscrubbable"));
    assert!(!r.text().contains(SECRET), "{}", r.text());
    let m = s.p.metrics().await;
    assert_eq!(
        sample(&m, "egress_denials_total{tool=\"w\",reason=\"unscrubbable\"}"),
        1.0
    );
    let facts = s.p.facts_with_reason("unscrubbable").await;
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert_eq!(Some(facts[0]["id"].as_str().unwrap()), r.header("x-egress-fact-id"));
    // Whatever the client asks, the origin is asked for the whole body in identity.
    s.p.get(
        &run,
        &s.api("/headers"),
        "Accept-Encoding: gzip, br\r\nRange: bytes=10-20\r\nIf-Range: \"x\"\r\n",
    )
    .await;
    let head = s.origin.heads().pop().unwrap();
    assert!(head.contains("accept-encoding: identity\n"), "{head}");
    assert!(!head.contains("range"), "{head}");
}

#[tokio::test]
async fn the_real_value_goes_to_no_other_host_from_any_tool() {
    let s = setup("", PLAIN).await;
    let (w, _) = s.run("w").await;
    let (v, _) = s.run("v").await;
    let r = s.p.get(&w, &s.other("/"), "").await;
    assert_ne!(r.deny_reason(), Some("credential_misuse"));
    assert_eq!(s.canary.connections(), 1, "the other host is reachable");
    let encoded = "sk-REAL%2Fsecret%20value-7f3a";
    let tries = [
        (&w, s.other("/"), format!("Authorization: Bearer {SECRET}\r\n")),
        (&w, s.other(&format!("/leak?k={encoded}")), String::new()),
        (&w, s.other("/sk-REAL%2fsecret%20value-7f3a"), String::new()),
        (
            &w,
            s.other("/"),
            "X-Data: {\"k\":\"sk-REAL\\/secret value-7f3a\"}\r\n".to_owned(),
        ),
        (&v, s.other("/"), format!("Cookie: k={SECRET}\r\n")),
        (&v, s.other(&format!("/?{encoded}")), String::new()),
    ];
    for (run, url, extra) in &tries {
        let r = s.p.get(run, url, extra).await;
        assert_eq!(
            (r.status, r.deny_reason()),
            (403, Some("credential_misuse")),
            "{url} {extra}: {}",
            r.text()
        );
        assert!(!r.text().contains(SECRET), "{}", r.text());
    }
    assert_eq!(
        s.canary.connections(),
        1,
        "nothing carrying the secret reached the other host"
    );
    let facts: Vec<_> =
        s.p.facts()
            .await
            .into_iter()
            .filter(|f| f.reason == "credential_misuse")
            .collect();
    assert_eq!(facts.len(), tries.len());
    for f in &facts {
        let text = serde_json::to_string(f).unwrap();
        assert!(f.detail.contains("real value of credential api of tool w"), "{text}");
        assert!(!text.contains(SECRET) && !text.contains(encoded), "{text}");
    }
    // To its own host, the real value is only what the proxy writes anyway.
    let r =
        s.p.get(&w, &s.api("/"), &format!("Authorization: Bearer {SECRET}\r\n"))
            .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn a_credential_goes_in_cleartext_only_where_allowed() {
    for mode in ["enforce", "report"] {
        let s = setup(&format!("mode = \"{mode}\""), "").await;
        let (run, ph) = s.run("w").await;
        for extra in [String::new(), format!("Authorization: Bearer {ph}\r\n")] {
            let r = s.p.get(&run, &s.api("/headers"), &extra).await;
            assert_eq!(
                (r.status, r.deny_reason()),
                (403, Some("credential_requires_tls")),
                "{}",
                r.text()
            );
            assert!(
                r.text().contains("https://"),
                "the answer says what to do: {}",
                r.text()
            );
        }
        assert!(s.origin.heads().is_empty(), "nothing was sent in cleartext");
        let facts = s.p.facts().await;
        assert!(facts.iter().any(|f| f.reason == "credential_requires_tls"));
        // Other hosts of the tool are unaffected.
        let r = s.p.get(&run, &s.other("/"), "").await;
        assert_ne!(r.deny_reason(), Some("credential_requires_tls"));
    }
}

/// `allow_plaintext = true` sends cleartext to loopback addresses only,
/// whatever the name: a name resolving elsewhere is refused; `"force"`
/// lifts that. In a namespace holding only `lo`, given 10.9.9.9.
#[tokio::test]
async fn cleartext_to_a_credential_host_reaches_loopback_only_in_an_isolated_netns() {
    if !isolated("cleartext_to_a_credential_host_reaches_loopback_only_in_an_isolated_netns") {
        return;
    }
    let ok = std::process::Command::new("ip")
        .args(["addr", "add", "10.9.9.9/32", "dev", "lo"])
        .status()
        .unwrap();
    assert!(ok.success(), "cannot add an address to lo inside the namespace");
    let far = canary("10.9.9.9:0").await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("api.token");
    egress_e2e::credentials::write_secret(&secret, SECRET, 0o600);
    for (plaintext, reached) in [("true", false), ("\"force\"", true)] {
        let dns = egress_e2e::FakeDns::start().await;
        dns.set("far.example", &["10.9.9.9"]);
        let host = format!("far.example:{}", far.addr.port());
        let text = format!(
            "{}\n[tools.w]\negress = [\"{host}\"]\n{}allow_plaintext = {plaintext}\n",
            proxy_section(&dns, "allow_ranges = [\"10.9.9.9/32\"]"),
            api_credential("w", &host, &file_source(&secret))
        );
        let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(100)))).await;
        let run = p.run("w").await;
        let before = far.connections();
        let r = p.get(&run, &format!("http://{host}/"), "").await;
        if reached {
            assert_eq!(far.connections(), before + 1, "forced cleartext goes anywhere");
        } else {
            assert_eq!((r.status, r.deny_reason()), (403, Some("credential_requires_tls")));
            assert_eq!(far.connections(), before, "no cleartext left loopback");
        }
    }
}
