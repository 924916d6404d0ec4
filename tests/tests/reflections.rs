//! A credential host's answer reaches the tool scrubbed of the secret, or
//! not at all, however it is framed and coded and however the secret is
//! written in it, on every entrance: plain HTTP (a credential allowed in
//! cleartext on loopback), an intercepted CONNECT with the tool on
//! HTTP/1.1, and with the tool on HTTP/2 (to an HTTP/1.1 origin, through
//! the bridge, and to an HTTP/2 origin).
//!
//! - An answer the scrubber cannot read is `502 unscrubbable` with its
//!   fact: a transfer coding other than `chunked` (`gzip, chunked` without
//!   any `Content-Encoding`), a content coding other than `identity`
//!   however it is listed, `Content-Length: 0` over a chunked gzip body, a
//!   204 announcing a body, a 204 or 304 of an HTTP/2 origin whose frames
//!   carry bytes. What the tool gets then never holds the secret, not even
//!   once it inflates what it got.
//! - The secret as standard libraries write it (Python's `quote` leaving
//!   `/`, `quote_plus`, JSON `\/` and `\u00XX`, HTML references, any mix),
//!   and the decoded password of a `Basic` value in the same forms, come
//!   back as the placeholder.
//!
//! Origins on 127.0.0.2 answering exactly the bytes (or HTTP/2 frames)
//! each case gives; names from a fake DNS on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use base64::Engine as _;
use egress_e2e::credentials::{file_source, write_secret};
use egress_e2e::harness::{proxy_section, sample, TestProxy, TestRun};
use egress_e2e::inside::{self, Got};
use egress_e2e::raw_origin::{
    chunked, gunzip_stored, gzip_stored, raw_origin, Answer, Answerer, Asked, RawOrigin, Speaks,
};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A secret with characters every escaper writes differently.
const SECRET: &str = "sk-REAL/key+v=1 \"q\"&<x>";
/// The password of the `Basic` credential.
const PASSWORD: &str = "pa55/w0rd+\"long\"&<y>";

fn basic_secret() -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("robot:{PASSWORD}"))
}

/// The three origins of the credentials, one way of speaking each.
struct World {
    p: TestProxy,
    plain: RawOrigin,
    api: RawOrigin,
    h2: RawOrigin,
    ca: String,
    _dir: tempfile::TempDir,
}

/// Tool `w`: credential `api` (`Bearer`, placeholder `API_TOKEN`); tool
/// `b`: credential `basic` (`Basic`, placeholder `BASIC_TOKEN`); both on
/// `plain.example` (HTTP/1.1 on plain TCP, cleartext allowed on loopback),
/// `api.example` (HTTP/1.1 over TLS) and `h2.example` (HTTP/2 over TLS),
/// which answer as [`h1_answer`] and [`h2_answer`] say.
async fn world() -> World {
    let (answer, answer_h2): (Answerer, Answerer) = (Arc::new(h1_answer), Arc::new(h2_answer));
    let dns = FakeDns::start().await;
    for n in ["plain.example", "api.example", "h2.example"] {
        dns.set(n, &["127.0.0.2"]);
    }
    let plain = raw_origin("127.0.0.2:0", &[], Speaks::Plain, answer.clone()).await;
    let api = raw_origin("127.0.0.2:0", &["api.example"], Speaks::Tls, answer.clone()).await;
    let h2 = raw_origin("127.0.0.2:0", &["h2.example"], Speaks::TlsH2, answer_h2).await;
    let dir = tempfile::tempdir().unwrap();
    let roots = dir.path().join("roots.pem");
    std::fs::write(
        &roots,
        format!("{}{}", api.ca_pem.clone().unwrap(), h2.ca_pem.clone().unwrap()),
    )
    .unwrap();
    let (bearer, basic) = (dir.path().join("api.token"), dir.path().join("basic.token"));
    write_secret(&bearer, SECRET, 0o600);
    write_secret(&basic, &basic_secret(), 0o600);
    let hosts = format!(
        "\"plain.example:{}\", \"api.example:{}\", \"h2.example:{}\"",
        plain.addr.port(),
        api.addr.port(),
        h2.addr.port()
    );
    let text = format!(
        r#"{}[proxy.interception]
upstream_ca_file = "{}"
[tools.w]
egress = [{hosts}]
fetch_timeout_ms = 10000
[tools.w.credentials.api]
hosts = [{hosts}]
value = "Bearer ${{secret}}"
secret = {}
placeholder_env = "API_TOKEN"
allow_plaintext = true
[tools.b]
egress = [{hosts}]
fetch_timeout_ms = 10000
[tools.b.credentials.basic]
hosts = [{hosts}]
value = "Basic ${{secret}}"
secret = {}
placeholder_env = "BASIC_TOKEN"
allow_plaintext = true
"#,
        proxy_section(&dns, ""),
        roots.display(),
        file_source(&bearer),
        file_source(&basic),
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await;
    let (_, ca) = p.control("GET", "/v1/ca", None).await;
    World {
        ca: ca["pem"].as_str().unwrap().to_owned(),
        p,
        plain,
        api,
        h2,
        _dir: dir,
    }
}

/// How the tool reaches the credential host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entrance {
    /// Plain HTTP to `plain.example`.
    Plain,
    /// HTTP/1.1 inside an intercepted CONNECT to `api.example`.
    TlsH1,
    /// HTTP/2 inside an intercepted CONNECT to `api.example` (an HTTP/1.1
    /// origin: the bridge).
    TlsH2Bridge,
    /// HTTP/1.1 inside an intercepted CONNECT to `h2.example` (HTTP/2).
    TlsH1ToH2,
    /// HTTP/2 inside an intercepted CONNECT to `h2.example`.
    TlsH2,
}

const TO_H1_ORIGINS: [Entrance; 3] = [Entrance::Plain, Entrance::TlsH1, Entrance::TlsH2Bridge];
const TO_H2_ORIGIN: [Entrance; 2] = [Entrance::TlsH1ToH2, Entrance::TlsH2];

impl World {
    /// A run of `tool` and the placeholder of its credential.
    async fn run(&self, tool: &str) -> (TestRun, String) {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": tool }))).await;
        assert_eq!(status, 201, "{v}");
        let run = TestRun {
            id: v["run_id"].as_str().unwrap().to_owned(),
            secret: v["secret"].as_str().unwrap().to_owned(),
            url: v["proxy_url"].as_str().unwrap().to_owned(),
        };
        let env = if tool == "b" { "BASIC_TOKEN" } else { "API_TOKEN" };
        (run, v["env"][env].as_str().unwrap().to_owned())
    }

    /// `method path` through `e`, with `Authorization: auth`.
    async fn ask(&self, run: &TestRun, auth: &str, e: Entrance, method: &str, path: &str) -> Got {
        let (origin, name) = match e {
            Entrance::Plain => (&self.plain, "plain.example"),
            Entrance::TlsH1 | Entrance::TlsH2Bridge => (&self.api, "api.example"),
            Entrance::TlsH1ToH2 | Entrance::TlsH2 => (&self.h2, "h2.example"),
        };
        let authority = format!("{name}:{}", origin.addr.port());
        match e {
            Entrance::Plain => {
                let req = format!(
                    "{method} http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: {}\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n",
                    run.auth()
                );
                let mut s = TcpStream::connect(self.p.proxy).await.unwrap();
                s.write_all(req.as_bytes()).await.unwrap();
                let mut all = vec![];
                tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all))
                    .await
                    .expect("the answer ends")
                    .unwrap();
                let r = egress_e2e::raw::parse(&all).unwrap();
                Got {
                    status: r.status,
                    headers: r.headers,
                    body: r.body,
                    all,
                }
            }
            Entrance::TlsH1 | Entrance::TlsH1ToH2 => {
                let (r, s) = self.p.connect(run, &authority).await;
                assert_eq!(r.status, 200, "{}", r.text());
                let headers = format!("Authorization: {auth}\r\n");
                inside::h1(&self.ca, &authority, s, method, path, &headers).await
            }
            Entrance::TlsH2Bridge | Entrance::TlsH2 => {
                let (r, s) = self.p.connect(run, &authority).await;
                assert_eq!(r.status, 200, "{}", r.text());
                inside::h2(&self.ca, &authority, s, method, path, &[("authorization", auth)]).await
            }
        }
    }
}

/// What the origin reflects: the `Authorization` value it received.
fn echo(a: &Asked) -> Vec<u8> {
    format!("you sent: {}\n", a.key).into_bytes()
}

fn rot13(b: &[u8]) -> Vec<u8> {
    b.iter()
        .map(|&c| match c {
            b'a'..=b'z' => (c - b'a' + 13) % 26 + b'a',
            b'A'..=b'Z' => (c - b'A' + 13) % 26 + b'A',
            c => c,
        })
        .collect()
}

/// Whether `bytes` give the secret away: as they are, inflated, de-chunked
/// or decoded the way the case coded it.
fn leaks(bytes: &[u8]) -> bool {
    let has = |b: &[u8]| b.windows(SECRET.len()).any(|w| w == SECRET.as_bytes());
    has(bytes) || has(&rot13(bytes)) || gunzip_stored(bytes).iter().any(|d| has(d)) || {
        let joined: Vec<u8> = String::from_utf8_lossy(bytes)
            .split("\r\n")
            .filter(|l| !l.chars().all(|c| c.is_ascii_hexdigit()))
            .collect::<String>()
            .into_bytes();
        has(&joined)
    }
}

/// The HTTP/1.1 answers, by path, of a credential host that reflects what
/// it was sent in ways the scrubber cannot read (`/refuse/...`), and in
/// ways it can (`/pass/...`).
fn h1_answer(a: &Asked) -> Answer {
    let e = echo(a);
    let z = gzip_stored(&e, e.len() - SECRET.len() / 2);
    let head = |s: &str| format!("HTTP/1.1 {s}\r\n\r\n").into_bytes();
    let with = |head: Vec<u8>, body: &[u8]| [head, body.to_vec()].concat();
    Answer::Raw(match a.path.as_str() {
        // The issue's cases.
        "/refuse/te-gzip" => with(head("200 OK\r\nTransfer-Encoding: gzip, chunked"), &chunked(&z, 7)),
        "/refuse/cl0-gzip" => with(
            head("200 OK\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip"),
            &chunked(&z, 7),
        ),
        // Transfer codings hyper does not take off, or reads to the close.
        "/refuse/te-gzip-only" => with(head("200 OK\r\nTransfer-Encoding: gzip"), &z),
        "/refuse/te-chunked-gzip" => with(head("200 OK\r\nTransfer-Encoding: chunked, gzip"), &z),
        "/refuse/te-two-fields" => with(
            head("200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked"),
            &chunked(&z, 5),
        ),
        "/refuse/te-empty-member" => with(head("200 OK\r\nTransfer-Encoding: chunked,"), &chunked(&e, 4)),
        "/refuse/te-and-length" => with(
            head(&format!(
                "200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: {}",
                e.len()
            )),
            &chunked(&e, 4),
        ),
        // Content codings, however they are listed.
        "/refuse/ce-gzip" => with(
            head(&format!(
                "200 OK\r\nContent-Encoding: gzip\r\nContent-Length: {}",
                z.len()
            )),
            &z,
        ),
        "/refuse/ce-identity-gzip" => with(
            head(&format!(
                "200 OK\r\nContent-Encoding: identity, gzip\r\nContent-Length: {}",
                z.len()
            )),
            &z,
        ),
        "/refuse/ce-repeated" => with(
            head("200 OK\r\nContent-Encoding: identity\r\nContent-Encoding: GZIP\r\nTransfer-Encoding: chunked"),
            &chunked(&z, 9),
        ),
        "/refuse/ce-unknown" => with(
            head(&format!(
                "200 OK\r\nContent-Encoding: x-rot13\r\nContent-Length: {}",
                e.len()
            )),
            &rot13(&e),
        ),
        // A 204 announcing a body.
        "/refuse/204-chunked" => with(head("204 No Content\r\nTransfer-Encoding: chunked"), &chunked(&e, 4)),
        "/refuse/204-length" => with(head(&format!("204 No Content\r\nContent-Length: {}", e.len())), &e),
        // Read as the HTTP layer frames them: nothing of a 304 or a HEAD
        // answer, identity spelled oddly, chunked alone.
        "/pass/304-length" => with(head(&format!("304 Not Modified\r\nContent-Length: {}", e.len())), &e),
        "/pass/head" => with(head(&format!("200 OK\r\nContent-Length: {}", e.len())), &e),
        "/pass/identity" => with(
            head(&format!(
                "200 OK\r\nContent-Encoding:  IDENTITY \r\nContent-Length: {}",
                e.len()
            )),
            &e,
        ),
        "/pass/chunked" => with(head("200 OK\r\nTransfer-Encoding: Chunked"), &chunked(&e, 3)),
        "/forms" => {
            let body = forms_of(&a.key);
            with(
                head(&format!("200 OK\r\nContent-Length: {}", body.len())),
                body.as_bytes(),
            )
        }
        other => panic!("no such case {other}"),
    })
}

/// The same cases an HTTP/2 origin can make (it has no transfer coding).
fn h2_answer(a: &Asked) -> Answer {
    let e = echo(a);
    let z = gzip_stored(&e, e.len() - SECRET.len() / 2);
    let h2 = |status: u16, headers: Vec<(&'static str, String)>, data: Vec<Vec<u8>>, trailers| Answer::H2 {
        status,
        headers,
        data,
        trailers,
    };
    match a.path.as_str() {
        "/refuse/ce-gzip" => h2(200, vec![("content-encoding", "gzip".into())], vec![z], vec![]),
        "/refuse/cl0-gzip" => h2(
            200,
            vec![("content-encoding", "gzip".into()), ("content-length", "0".into())],
            vec![z],
            vec![],
        ),
        "/refuse/ce-identity-gzip" => h2(
            200,
            vec![("content-encoding", "identity, gzip".into())],
            vec![z],
            vec![],
        ),
        "/refuse/204-data" => h2(204, vec![], vec![vec![], e], vec![]),
        "/refuse/304-data" => h2(304, vec![], vec![e], vec![]),
        "/pass/204-trailers" => h2(
            204,
            vec![],
            vec![],
            vec![("x-echo", String::from_utf8_lossy(&echo(a)).trim().to_owned())],
        ),
        "/pass/identity" => h2(200, vec![("content-encoding", "Identity".into())], vec![e], vec![]),
        "/forms" => h2(200, vec![], vec![forms_of(&a.key).into_bytes()], vec![]),
        other => panic!("no such case {other}"),
    }
}

/// The values an origin reflects of `key` (the `Authorization` it got):
/// the token of a `Bearer` value; the `user:password` of a `Basic` one and
/// its password.
fn reflected(key: &str) -> Vec<String> {
    if let Some(t) = key.strip_prefix("Bearer ") {
        return vec![t.to_owned()];
    }
    let b = key.strip_prefix("Basic ").unwrap_or("");
    let decoded = base64::engine::general_purpose::STANDARD.decode(b).unwrap_or_default();
    let decoded = String::from_utf8(decoded).unwrap_or_default();
    let password = decoded.split_once(':').map(|(_, p)| p.to_owned()).unwrap_or_default();
    vec![decoded, password]
}

/// `s` as each of these writes it: Python's `quote` (leaving `/`),
/// `quote_plus`, PHP's `json_encode` (`\/`), every character as `\u00XX`,
/// Go's `encoding/json` (`\u003c`), Python's `html.escape`, and a mix
/// character by character.
fn spellings(s: &str) -> Vec<(&'static str, String)> {
    let pct = |c: char| c.to_string().bytes().map(|b| format!("%{b:02X}")).collect::<String>();
    let unreserved = |c: char| c.is_ascii_alphanumeric() || "-._~".contains(c);
    let quote = s
        .chars()
        .map(|c| {
            if unreserved(c) || c == '/' {
                c.to_string()
            } else {
                pct(c)
            }
        })
        .collect();
    let quote_plus = s
        .chars()
        .map(|c| match c {
            ' ' => "+".to_owned(),
            c if unreserved(c) => c.to_string(),
            c => pct(c),
        })
        .collect();
    let php = s
        .chars()
        .map(|c| match c {
            '"' | '\\' | '/' => format!("\\{c}"),
            c => c.to_string(),
        })
        .collect();
    let all_u = s.chars().map(|c| format!("\\u{:04x}", u32::from(c))).collect();
    let go = s
        .chars()
        .map(|c| match c {
            '"' => "\\\"".to_owned(),
            '<' | '>' | '&' => format!("\\u{:04x}", u32::from(c)),
            c => c.to_string(),
        })
        .collect();
    let html = s
        .chars()
        .map(|c| match c {
            '&' => "&amp;".to_owned(),
            '<' => "&lt;".to_owned(),
            '>' => "&gt;".to_owned(),
            '"' => "&quot;".to_owned(),
            '\'' => "&#x27;".to_owned(),
            c => c.to_string(),
        })
        .collect();
    let mixed = s
        .chars()
        .enumerate()
        .map(|(i, c)| match i % 4 {
            0 => c.to_string(),
            1 => pct(c),
            2 => format!("\\u{:04X}", u32::from(c)),
            _ => format!("&#{};", u32::from(c)),
        })
        .collect();
    vec![
        ("quote", quote),
        ("quote_plus", quote_plus),
        ("json_php", php),
        ("json_u", all_u),
        ("json_go", go),
        ("html", html),
        ("mixed", mixed),
    ]
}

/// One line per spelling of each value reflected of `key`.
fn forms_of(key: &str) -> String {
    let mut out = String::new();
    for v in reflected(key) {
        for (name, spelled) in spellings(&v) {
            out.push_str(&format!("{name}: {spelled}\n"));
        }
    }
    out
}

/// What [`forms_of`] gives once every value is the placeholder `ph`.
fn forms_scrubbed(key: &str, ph: &str) -> String {
    let mut out = String::new();
    for _ in reflected(key) {
        for (name, _) in spellings("x") {
            out.push_str(&format!("{name}: {ph}\n"));
        }
    }
    out
}

const H1_REFUSED: [&str; 13] = [
    "/refuse/te-gzip",
    "/refuse/cl0-gzip",
    "/refuse/te-gzip-only",
    "/refuse/te-chunked-gzip",
    "/refuse/te-two-fields",
    "/refuse/te-empty-member",
    "/refuse/te-and-length",
    "/refuse/ce-gzip",
    "/refuse/ce-identity-gzip",
    "/refuse/ce-repeated",
    "/refuse/ce-unknown",
    "/refuse/204-chunked",
    "/refuse/204-length",
];

const H2_REFUSED: [&str; 5] = [
    "/refuse/ce-gzip",
    "/refuse/cl0-gzip",
    "/refuse/ce-identity-gzip",
    "/refuse/204-data",
    "/refuse/304-data",
];

#[tokio::test]
async fn what_the_scrubber_cannot_read_is_refused_on_every_entrance_with_its_fact() {
    let w = world().await;
    let (run, ph) = w.run("w").await;
    let auth = format!("Bearer {ph}");
    let cases = TO_H1_ORIGINS
        .iter()
        .flat_map(|e| H1_REFUSED.map(|p| (*e, p)))
        .chain(TO_H2_ORIGIN.iter().flat_map(|e| H2_REFUSED.map(|p| (*e, p))));
    let (mut refused, mut wrong) = (0, vec![]);
    for (e, path) in cases {
        let got = w.ask(&run, &auth, e, "GET", path).await;
        let outcome = (got.status, got.header("x-egress-deny-reason"));
        if leaks(&got.all) || leaks(&got.body) {
            wrong.push(format!("{e:?} {path}: {outcome:?}, the secret given away"));
        } else if outcome != (502, Some("unscrubbable")) || got.header("x-egress-fact-id").is_none() {
            wrong.push(format!("{e:?} {path}: {outcome:?}"));
        }
        refused += 1;
    }
    assert!(wrong.is_empty(), "not refused:\n{}", wrong.join("\n"));
    // Each of them really reflected the secret.
    for o in [&w.plain, &w.api, &w.h2] {
        assert!(o.heads().iter().all(|h| h.contains(SECRET)), "{:?}", o.heads());
    }
    let facts = w.p.facts_with_reason("unscrubbable").await;
    assert_eq!(facts.len(), refused, "one fact each");
    for f in &facts {
        let text = f.to_string();
        assert!(!text.contains(SECRET), "{text}");
        assert_eq!(f["run_id"], run.id.as_str(), "{text}");
        assert!(f["detail"].as_str().unwrap().contains("credential host"), "{text}");
    }
    let m = w.p.metrics().await;
    assert_eq!(
        sample(&m, "egress_denials_total{tool=\"w\",reason=\"unscrubbable\"}"),
        refused as f64
    );
}

#[tokio::test]
async fn what_the_http_layer_frames_as_empty_or_identity_is_relayed_scrubbed() {
    let w = world().await;
    let (run, ph) = w.run("w").await;
    let auth = format!("Bearer {ph}");
    for e in TO_H1_ORIGINS {
        for (method, path, status, body) in [
            ("GET", "/pass/304-length", 304, false),
            ("HEAD", "/pass/head", 200, false),
            ("GET", "/pass/identity", 200, true),
            ("GET", "/pass/chunked", 200, true),
        ] {
            let got = w.ask(&run, &auth, e, method, path).await;
            let all = String::from_utf8_lossy(&got.all);
            assert!(!leaks(&got.all), "{e:?} {method} {path}:\n{all}");
            assert_eq!(got.status, status, "{e:?} {method} {path}:\n{all}");
            let want = if body {
                format!("you sent: Bearer {ph}\n")
            } else {
                String::new()
            };
            assert_eq!(
                String::from_utf8_lossy(&got.body),
                want,
                "{e:?} {method} {path}:\n{all}"
            );
        }
    }
    for e in TO_H2_ORIGIN {
        let got = w.ask(&run, &auth, e, "GET", "/pass/identity").await;
        assert_eq!(got.status, 200, "{e:?}");
        assert_eq!(String::from_utf8_lossy(&got.body), format!("you sent: Bearer {ph}\n"));
        // Trailers after a 204 of an HTTP/2 origin: relayed (to a tool on
        // HTTP/2), scrubbed.
        let got = w.ask(&run, &auth, e, "GET", "/pass/204-trailers").await;
        let all = String::from_utf8_lossy(&got.all);
        assert!(!leaks(&got.all), "{e:?}:\n{all}");
        assert_eq!((got.status, got.body.len()), (204, 0), "{e:?}:\n{all}");
        if e == Entrance::TlsH2 {
            assert!(all.contains(&format!("x-echo: you sent: Bearer {ph}")), "{all}");
        }
    }
    assert!(w.p.facts_with_reason("unscrubbable").await.is_empty());
}

#[tokio::test]
async fn the_secret_as_libraries_write_it_comes_back_as_the_placeholder() {
    let w = world().await;
    let mut wrong = vec![];
    for tool in ["w", "b"] {
        let (run, ph) = w.run(tool).await;
        let auth = if tool == "w" {
            format!("Bearer {ph}")
        } else {
            ph.clone()
        };
        for e in TO_H1_ORIGINS.into_iter().chain(TO_H2_ORIGIN) {
            let got = w.ask(&run, &auth, e, "GET", "/forms").await;
            let all = String::from_utf8_lossy(&got.all);
            assert_eq!(got.status, 200, "{tool} {e:?}:\n{all}");
            let key = if tool == "w" {
                format!("Bearer {SECRET}")
            } else {
                format!("Basic {}", basic_secret())
            };
            let (got, want) = (String::from_utf8_lossy(&got.body), forms_scrubbed(&key, &ph));
            assert_eq!(got.lines().count(), want.lines().count(), "{tool} {e:?}:\n{got}");
            for (g, w) in got.lines().zip(want.lines()).filter(|(g, w)| g != w) {
                wrong.push(format!("{tool} {e:?}: {g} (want {w})"));
            }
            assert!(
                !all.contains(PASSWORD) && !leaks(all.as_bytes()),
                "{tool} {e:?}:\n{all}"
            );
        }
    }
    assert!(wrong.is_empty(), "not scrubbed:\n{}", wrong.join("\n"));
    // The origins were sent the real values, and reflected them.
    assert!(w.plain.heads().iter().any(|h| h.contains(&basic_secret())));
    let forms = forms_of(&format!("Basic {}", basic_secret()));
    assert!(
        forms.contains("pa55/w0rd%2B%22long") && forms.contains("\\u0070\\u0061"),
        "{forms}"
    );
}
