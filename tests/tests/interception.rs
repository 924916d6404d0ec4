//! Credentials over HTTPS: a CONNECT to one of a tool's credential hosts
//! (or any CONNECT of an `inspect` tool) is intercepted. The proxy shows
//! the tool a leaf of the appliance CA, opens its own verified TLS to the
//! origin, and decides every request inside: the secret replaces the
//! placeholder, a placeholder to another host is `credential_misuse`, the
//! SNI and `Host` must name the tunnel's host, `methods` apply. Real
//! clients (curl, Python `requests`) are pointed at the appliance CA by the
//! run's `env` map alone. Origins are HTTPS on 127.0.0.2 with a test CA of
//! their own (`[proxy.interception] upstream_ca_file`); names come from a
//! fake DNS on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::{api_credential, file_source};
use egress_e2e::harness::{proxy_section, TestProxy, TestRun};
use egress_e2e::process::{client, Ran};
use egress_e2e::tls_origin::{tls_origin, TlsOrigin};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const SECRET: &str = "tok-REAL-SECRET-https-5e6f7a";
const ROTATED: &str = "tok-ROTATED-SECRET-https-8b9c";

fn write_secret(path: &Path, value: &str) {
    egress_e2e::credentials::write_secret(path, value, 0o600);
}

struct World {
    p: TestProxy,
    /// `api.example`: the credential's host.
    api: TlsOrigin,
    /// `other.example`: allowed, not the credential's host.
    other: TlsOrigin,
    dir: tempfile::TempDir,
    secret_file: PathBuf,
}

/// A proxy whose tool `w` holds credential `api` for `api.example` and may
/// also reach `other.example`; `tool_extra` adds keys to `[tools.w]`,
/// `interception` to `[proxy.interception]`.
async fn world(tool_extra: &str, interception: &str) -> World {
    world_with(tool_extra, interception, &["api.example"]).await
}

/// What both kinds of proxy (in-process, binary) of these tests see: the
/// names, the two HTTPS origins, the secret in a 0600 file, and the text of
/// `[proxy.interception]` (plus `interception`) and `[tools.w]` (plus
/// `tool_extra`).
struct Origins {
    dns: FakeDns,
    api: TlsOrigin,
    other: TlsOrigin,
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    text: String,
}

async fn origins(tool_extra: &str, interception: &str, api_names: &[&str]) -> Origins {
    let dns = FakeDns::start().await;
    dns.set("api.example", &["127.0.0.2"]);
    dns.set("other.example", &["127.0.0.2"]);
    dns.set("wrong.example", &["127.0.0.2"]);
    let api = tls_origin("127.0.0.2:0", api_names).await;
    let other = tls_origin("127.0.0.2:0", &["other.example"]).await;
    let dir = tempfile::tempdir().unwrap();
    let interception = interception.replace("{dir}", &dir.path().display().to_string());
    let secret_file = dir.path().join("api.token");
    write_secret(&secret_file, SECRET);
    // Both origins' CAs: the roots the proxy verifies origins against.
    let roots = dir.path().join("origin-roots.pem");
    std::fs::write(&roots, format!("{}{}", api.ca_pem, other.ca_pem)).unwrap();
    let (a, o) = (api.addr.port(), other.addr.port());
    let text = format!(
        r#"
[proxy.interception]
upstream_ca_file = "{}"
{interception}
[tools.w]
egress = ["api.example:{a}", "other.example:{o}", "wrong.example:{a}"]
{tool_extra}
{}"#,
        roots.display(),
        api_credential("w", &format!("api.example:{a}"), &file_source(&secret_file))
    );
    Origins {
        dns,
        api,
        other,
        dir,
        secret_file,
        text,
    }
}

/// [`world`] with the names the api origin's certificate carries;
/// `{dir}` in `interception` is the test's directory.
async fn world_with(tool_extra: &str, interception: &str, api_names: &[&str]) -> World {
    let o = origins(tool_extra, interception, api_names).await;
    let text = format!("{}{}", proxy_section(&o.dns, ""), o.text);
    let cfg = o.dir.path().join("egress.toml");
    std::fs::write(&cfg, &text).unwrap();
    let p = TestProxy::start_config(o.dns, &text, Some(cfg), Some(Arc::new(MemorySink::new(10_000)))).await;
    World {
        p,
        api: o.api,
        other: o.other,
        dir: o.dir,
        secret_file: o.secret_file,
    }
}

impl World {
    async fn run(&self) -> (String, BTreeMap<String, String>) {
        let (run, env) = self.run_full().await;
        (run.id, env)
    }

    async fn run_full(&self) -> (TestRun, BTreeMap<String, String>) {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
        assert_eq!(status, 201, "{v}");
        let env = serde_json::from_value(v["env"].clone()).unwrap();
        let run = TestRun {
            id: v["run_id"].as_str().unwrap().to_owned(),
            secret: v["secret"].as_str().unwrap().to_owned(),
            url: v["proxy_url"].as_str().unwrap().to_owned(),
        };
        (run, env)
    }

    fn api_url(&self, path: &str) -> String {
        format!("https://api.example:{}{path}", self.api.addr.port())
    }

    fn other_url(&self, path: &str) -> String {
        format!("https://other.example:{}{path}", self.other.addr.port())
    }
}

/// curl through the run's proxy (from `HTTPS_PROXY`) trusting `CURL_CA_BUNDLE`;
/// prints the body then the status code.
async fn curl(env: &BTreeMap<String, String>, url: &str, extra: &[&str]) -> Ran {
    let mut args = vec!["-sS", "--max-time", "10", "-w", "\n%{http_code}", "-D", "/dev/stderr"];
    args.extend_from_slice(extra);
    args.push(url);
    client(env, "curl", &args).await
}

fn status(r: &Ran) -> &str {
    r.stdout.lines().last().unwrap_or("")
}

#[tokio::test]
async fn the_run_env_points_clients_at_the_appliance_ca() {
    let w = world("", "").await;
    let (_, env) = w.run().await;
    let (status, ca) = w.p.control("GET", "/v1/ca", None).await;
    assert_eq!(status, 200, "{ca}");
    assert!(ca["fingerprint"].as_str().unwrap().starts_with("sha256:"));
    let pem = ca["pem"].as_str().unwrap();
    for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "AWS_CA_BUNDLE"] {
        assert_eq!(env[k], ca["bundle_file"].as_str().unwrap(), "{k}");
    }
    assert_eq!(env["NODE_EXTRA_CA_CERTS"], ca["cert_file"].as_str().unwrap());
    let bundle = std::fs::read_to_string(&env["SSL_CERT_FILE"]).unwrap();
    assert!(bundle.ends_with(pem), "the bundle holds the appliance CA");
    assert_eq!(std::fs::read_to_string(&env["NODE_EXTRA_CA_CERTS"]).unwrap(), pem);
    assert!(!serde_json::to_string(&env).unwrap().contains(SECRET));
}

#[tokio::test]
async fn curl_over_https_sends_the_placeholder_and_the_origin_gets_the_secret() {
    let w = world("", "").await;
    let (_, env) = w.run().await;
    let ph = env["API_TOKEN"].clone();
    // The placeholder in the header and in the query.
    let auth = format!("Authorization: Bearer {ph}");
    let r = curl(&env, &w.api_url(&format!("/data?key={ph}")), &["-H", &auth]).await;
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(status(&r), "200", "{} {}", r.stdout, r.stderr);
    assert!(r.stdout.contains("ok from the tls origin"));
    // Without any placeholder: the header is added.
    let r = curl(&env, &w.api_url("/plain"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    let heads = w.api.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(
        heads[0].starts_with(&format!("GET /data?key={SECRET}\n")),
        "{}",
        heads[0]
    );
    for h in &heads {
        assert!(h.contains(&format!("authorization: Bearer {SECRET}\n")), "{h}");
        assert!(!h.contains(&ph), "the origin never sees the placeholder: {h}");
        assert!(h.contains(&format!("host: api.example:{}\n", w.api.addr.port())), "{h}");
    }
    assert!(!r.stdout.contains(SECRET) && !r.stderr.contains(SECRET));
}

#[tokio::test]
async fn a_verified_origin_connection_serves_its_runs_next_connect_to_that_name_only() {
    // inspect: `wrong.example` (the api origin's address, whose certificate
    // names api.example only) is intercepted too.
    let w = world("inspect = true", "").await;
    let port = w.api.addr.port();
    let (a, env_a) = w.run_full().await;
    let r = curl(&env_a, &w.api_url("/one"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    w.p.wait_upstream_idle(&a.id, 1).await;
    // The run's next intercepted CONNECT to the name: no dial, no handshake.
    let r = curl(&env_a, &w.api_url("/two"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    assert_eq!(
        w.api.accepted(),
        1,
        "the second tunnel went out on the first one's connection"
    );
    let heads = w.api.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    for h in &heads {
        assert!(h.contains(&format!("authorization: Bearer {SECRET}\n")), "{h}");
    }
    w.p.wait_upstream_idle(&a.id, 1).await;
    // Another name at the same address never takes that connection: its
    // own handshake fails verification.
    let (resp, _) = w.p.connect(&a, &format!("wrong.example:{port}")).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("upstream_tls"));
    // Another run: a connection of its own, whose handshake resumes the
    // session the origin gave the first run's.
    let before = w.api.accepted();
    let (b, env_b) = w.run_full().await;
    let r = curl(&env_b, &w.api_url("/three"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    assert_eq!(
        w.api.accepted(),
        before + 1,
        "a run never takes another run's connection"
    );
    let m = w.p.metrics().await;
    for line in [
        "egress_upstream_reused_total 1",
        "egress_upstream_tls_handshakes_total{kind=\"full\"} 1",
        "egress_upstream_tls_handshakes_total{kind=\"resumed\"} 1",
    ] {
        assert!(m.contains(line), "{line} not in\n{m}");
    }
    // A run's end closes the connections its pool kept.
    w.p.end(&a).await;
    w.p.end(&b).await;
    let closed = egress_e2e::executor::eventually(Duration::from_secs(5), || w.api.open() == 0).await;
    assert!(
        closed,
        "{} origin connection(s) still open after both runs ended",
        w.api.open()
    );
}

#[tokio::test]
async fn a_connection_left_mid_response_is_not_kept_for_the_next_tunnel() {
    let w = world("", "").await;
    let (a, env) = w.run_full().await;
    // A response of 40 events 100 ms apart; the client leaves after 0.5 s.
    let r = curl(&env, &w.api_url("/sse?n=40&ms=100"), &["--max-time", "0.5"]).await;
    assert!(!r.ok, "curl was to give up mid-response: {}", r.stdout);
    w.p.wait_slots(&a, 0).await;
    // Past the pool's wait for the connection to finish its message.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, v) = w.p.control("GET", &format!("/v1/runs/{}", a.id), None).await;
    assert_eq!(v["upstream_idle"], 0, "{v}");
    let r = curl(&env, &w.api_url("/plain"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    assert!(
        r.stdout.starts_with("ok from the tls origin\n"),
        "the next tunnel's answer is its own, not the rest of the stream: {}",
        r.stdout
    );
    assert_eq!(w.api.accepted(), 2, "the abandoned connection was not reused");
}

#[tokio::test]
async fn python_requests_trusts_the_bundle_from_the_env_map() {
    let w = world("", "").await;
    let (_, env) = w.run().await;
    let script = format!(
        "import os, requests\n\
         r = requests.get('{}', headers={{'Authorization': 'Bearer ' + os.environ['API_TOKEN']}}, timeout=10)\n\
         print(r.status_code, r.text.strip())\n\
         print(os.environ['API_TOKEN'])\n",
        w.api_url("/py")
    );
    let r = client(&env, "python3", &["-c", &script]).await;
    assert!(r.ok, "python3 requests: {}", r.stderr);
    assert!(r.stdout.starts_with("200 ok from the tls origin"), "{}", r.stdout);
    assert!(!r.stdout.contains(SECRET) && !r.stderr.contains(SECRET));
    let heads = w.api.heads();
    assert!(
        heads[0].contains(&format!("authorization: Bearer {SECRET}\n")),
        "{heads:?}"
    );
}

#[tokio::test]
async fn a_placeholder_inside_tls_to_another_host_is_credential_misuse() {
    // `inspect`: the tunnel to other.example is intercepted too, so the
    // placeholder can be seen there.
    let w = world("inspect = true", "").await;
    let (run, env) = w.run().await;
    let ph = env["API_TOKEN"].clone();
    let auth = format!("Authorization: Bearer {ph}");
    let r = curl(&env, &w.other_url("/steal"), &["-H", &auth]).await;
    assert_eq!(status(&r), "403", "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .to_ascii_lowercase()
            .contains("x-egress-deny-reason: credential_misuse"),
        "{}",
        r.stderr
    );
    let r = curl(&env, &w.other_url(&format!("/steal?k={ph}")), &[]).await;
    assert_eq!(status(&r), "403", "{}", r.stderr);
    assert!(
        w.other.heads().is_empty(),
        "nothing reached the other host: {:?}",
        w.other.heads()
    );
    let facts = w.p.facts_with_reason("credential_misuse").await;
    assert_eq!(facts.len(), 2, "{facts:?}");
    assert_eq!(facts[0]["run_id"], run.as_str());
    let text = serde_json::to_string(&facts).unwrap();
    assert!(!text.contains(SECRET) && !text.contains(&ph), "{text}");
    // The same tool's plain requests to other.example still go through.
    let r = curl(&env, &w.other_url("/fine"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    assert!(!w.other.heads()[0].to_ascii_lowercase().contains("authorization"));
}

#[tokio::test]
async fn the_server_name_and_host_must_be_the_tunnel_s_host() {
    let w = world("", "").await;
    let (run, env) = w.run_full().await;
    // A Host naming another server inside the tunnel to api.example.
    let r = curl(&env, &w.api_url("/"), &["-H", "Host: other.example"]).await;
    assert_eq!(status(&r), "400", "{}", r.stderr);
    assert!(
        r.stderr
            .to_ascii_lowercase()
            .contains("x-egress-deny-reason: host_mismatch"),
        "{}",
        r.stderr
    );
    // A TLS handshake that names another server (SNI) than the CONNECT target.
    let api = format!("api.example:{}", w.api.addr.port());
    let (resp, stream) = w.p.connect(&run, &api).await;
    assert_eq!(resp.status, 200);
    let (_, ca) = w.p.control("GET", "/v1/ca", None).await;
    let ca = ca["pem"].as_str().unwrap();
    let tls = tls_client(ca, "other.example", &api, stream).await;
    assert!(tls.is_err(), "the handshake is refused: {tls:?}");
    // The same handshake naming the CONNECT target succeeds.
    let (_, stream) = w.p.connect(&run, &api).await;
    let tls = tls_client(ca, "api.example", &api, stream).await;
    assert!(
        tls.as_ref().is_ok_and(|t| t.contains("ok from the tls origin")),
        "{tls:?}"
    );
    assert_eq!(
        w.api.heads().len(),
        1,
        "only the last request arrived: {:?}",
        w.api.heads()
    );
    let facts = w.p.facts_with_reason("host_mismatch").await;
    assert_eq!(facts.len(), 2, "{facts:?}");
    assert!(
        facts.iter().any(|f| f["detail"]
            .as_str()
            .unwrap()
            .contains("TLS server name \"other.example\"")),
        "{facts:?}"
    );
}

/// The interception entrance reads the whole ClientHello before it checks
/// its server name, as the transparent one does: a hello naming another
/// server, sent as its record header, a pause, then one byte at a time, is
/// `host_mismatch` all the same, and nothing reaches the origin.
#[tokio::test]
async fn a_paused_client_hello_inside_interception_is_checked_whole() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let w = world("", "").await;
    let (run, _) = w.run_full().await;
    let api = format!("api.example:{}", w.api.addr.port());
    let (resp, mut stream) = w.p.connect(&run, &api).await;
    assert_eq!(resp.status, 200);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("paused.example").unwrap();
    let mut hello = vec![];
    rustls::ClientConnection::new(Arc::new(config), name)
        .unwrap()
        .write_tls(&mut hello)
        .unwrap();
    stream.set_nodelay(true).unwrap();
    stream.write_all(&hello[..5]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    for b in &hello[5..] {
        stream.write_all(std::slice::from_ref(b)).await.unwrap();
    }
    // No ServerHello: the proxy closes the tunnel.
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    let facts = w.p.facts_with_reason("host_mismatch").await;
    assert!(
        facts.iter().any(|f| f["detail"]
            .as_str()
            .unwrap()
            .contains("TLS server name \"paused.example\"")),
        "{facts:?}"
    );
    assert!(w.api.heads().is_empty(), "{:?}", w.api.heads());
}

/// A TLS client over `stream` (a tunnel) trusting `ca_pem` only, naming
/// `sni`, that sends one `GET /` with `Host: host` and reads the answer.
async fn tls_client(ca_pem: &str, sni: &str, host: &str, stream: tokio::net::TcpStream) -> std::io::Result<String> {
    tls_client_with(ca_pem, sni, true, host, stream).await
}

/// [`tls_client`] verifying the server for `name`, which it sends as the
/// server name only when `send_sni`.
async fn tls_client_with(
    ca_pem: &str,
    sni: &str,
    send_sni: bool,
    host: &str,
    stream: tokio::net::TcpStream,
) -> std::io::Result<String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut config = config;
    config.enable_sni = send_sni;
    let name = rustls::pki_types::ServerName::try_from(sni.to_owned()).unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, stream)
        .await?;
    // TLS 1.3: the server's refusal may only show on the first read.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tls.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    tls.read_to_end(&mut buf).await?;
    if buf.is_empty() {
        return Err(std::io::Error::other("no answer"));
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[tokio::test]
async fn a_client_hello_without_a_server_name_gets_the_connect_host_s_leaf() {
    // Intercepted CONNECTs share one TLS configuration that finds the leaf
    // by the ClientHello's server name; a client that sends none must still
    // be shown the CONNECT host's leaf, for names of several hosts.
    let w = world("inspect = true", "").await;
    let (run, _) = w.run_full().await;
    let (_, ca) = w.p.control("GET", "/v1/ca", None).await;
    let ca = ca["pem"].as_str().unwrap();
    for (host, port) in [
        ("api.example", w.api.addr.port()),
        ("other.example", w.other.addr.port()),
    ] {
        let target = format!("{host}:{port}");
        for send_sni in [false, true, false] {
            let (resp, stream) = w.p.connect(&run, &target).await;
            assert_eq!(resp.status, 200);
            let tls = tls_client_with(ca, host, send_sni, &target, stream).await;
            assert!(
                tls.as_ref().is_ok_and(|t| t.contains("ok from the tls origin")),
                "{host}, server name sent: {send_sni}: {tls:?}"
            );
        }
    }
    assert_eq!(w.api.heads().len() + w.other.heads().len(), 6);
}

#[tokio::test]
async fn methods_apply_to_the_requests_inside_an_intercepted_tunnel() {
    // No CONNECT in `methods`: intercepted tunnels are admitted, and each
    // request inside is held to the list.
    let w = world("inspect = true\nmethods = [\"GET\"]", "").await;
    let (_, env) = w.run().await;
    let r = curl(&env, &w.other_url("/get"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    let r = curl(&env, &w.other_url("/post"), &["-X", "POST", "-d", "x=1"]).await;
    assert_eq!(status(&r), "403", "{}", r.stderr);
    assert!(
        r.stderr
            .to_ascii_lowercase()
            .contains("x-egress-deny-reason: method_not_allowed"),
        "{}",
        r.stderr
    );
    let heads = w.other.heads();
    assert_eq!(heads.len(), 1, "only the GET arrived: {heads:?}");
    assert_eq!(w.p.facts_with_reason("method_not_allowed").await.len(), 1);
}

#[tokio::test]
async fn an_origin_failing_verification_is_upstream_tls() {
    // The credential host's origin shows a certificate for another name.
    let w = world_with("", "", &["elsewhere.example"]).await;
    let (run, env) = w.run_full().await;
    let (resp, _) = w.p.connect(&run, &format!("api.example:{}", w.api.addr.port())).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("upstream_tls"));
    assert!(resp.text().contains("api.example"), "{}", resp.text());
    let r = curl(&env, &w.api_url("/"), &[]).await;
    assert!(!r.ok && r.stderr.contains("502"), "{}", r.stderr);
    assert!(w.api.heads().is_empty());
    let m = w.p.metrics().await;
    assert!(
        egress_e2e::harness::sample(&m, "egress_fetch_errors_total{tool=\"w\",reason=\"upstream_tls\"}") >= 2.0,
        "{m}"
    );
}

#[tokio::test]
async fn hosts_without_a_credential_stay_blind_tunnels() {
    let w = world("", "").await;
    let (run, _) = w.run_full().await;
    // wrong.example is the api origin's address; the tool has no credential
    // there and does not inspect: the client talks TLS with the origin itself.
    let port = w.api.addr.port();
    let (resp, stream) = w.p.connect(&run, &format!("wrong.example:{port}")).await;
    assert_eq!(resp.status, 200);
    let tls = tls_client(&w.api.ca_pem, "api.example", &format!("api.example:{port}"), stream).await;
    assert!(tls.is_ok(), "the origin's own certificate: {:?}", tls.err());
    // And the appliance CA's leaf is what a credential host shows.
    let (_, stream) = w.p.connect(&run, &format!("api.example:{port}")).await;
    assert!(
        tls_client(&w.api.ca_pem, "api.example", &format!("api.example:{port}"), stream)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_rotated_secret_and_a_rotated_ca_take_effect_on_reload() {
    let w = world("", "ca_dir = \"{dir}/ca\"").await;
    let (_, env) = w.run().await;
    let (_, before) = w.p.control("GET", "/v1/ca", None).await;
    assert_eq!(before["ephemeral"], false);
    let ca_dir = w.dir.path().join("ca");
    let mode = std::fs::metadata(ca_dir.join("ca.key")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let r = curl(&env, &w.api_url("/one"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);

    write_secret(&w.secret_file, ROTATED);
    let rotated = egress_proxy::rotate_ca(&ca_dir).unwrap();
    let (status_code, v) = w.p.control("POST", "/v1/policy/reload", None).await;
    assert_eq!(status_code, 200, "{v}");
    let (_, after) = w.p.control("GET", "/v1/ca", None).await;
    assert_eq!(after["fingerprint"], rotated.as_str());
    assert_ne!(after["fingerprint"], before["fingerprint"]);
    // The bundle the env map names now holds the new CA, and its leaves verify.
    let r = curl(&env, &w.api_url("/two"), &[]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    let heads = w.api.heads();
    assert!(heads[0].contains(&format!("Bearer {SECRET}\n")), "{heads:?}");
    assert!(heads[1].contains(&format!("Bearer {ROTATED}\n")), "{heads:?}");
    // A client still trusting the old CA alone is refused the new leaf.
    let old = w.dir.path().join("old-ca.pem");
    std::fs::write(&old, before["pem"].as_str().unwrap()).unwrap();
    let r = curl(&env, &w.api_url("/three"), &["--cacert", old.to_str().unwrap()]).await;
    assert!(!r.ok, "{}", r.stdout);
}

#[tokio::test]
async fn the_secret_never_shows_in_facts_metrics_or_views() {
    let w = world("inspect = true", "").await;
    let (run, env) = w.run().await;
    let ph = env["API_TOKEN"].clone();
    let auth = format!("Authorization: Bearer {ph}");
    for url in [w.api_url("/a"), w.other_url("/b")] {
        let _ = curl(&env, &url, &["-H", &auth]).await;
    }
    assert_eq!(w.p.facts_with_reason("credential_misuse").await.len(), 1);
    let (_, facts) = w.p.control("GET", "/v1/facts?after=0&limit=1000", None).await;
    let (_, view) = w.p.control("GET", &format!("/v1/runs/{run}"), None).await;
    let (_, ca) = w.p.control("GET", "/v1/ca", None).await;
    let metrics = w.p.metrics().await;
    for (what, text) in [
        ("facts", facts.to_string()),
        ("run view", view.to_string()),
        ("ca", ca.to_string()),
        ("metrics", metrics),
    ] {
        assert!(!text.contains(SECRET), "the secret shows in the {what}");
    }
}

/// The real binary, JSON logs: intercepted requests (injected, denied as
/// misuse, refused by SNI) leave the secret in no log line, the CA key
/// stays 0600 beside the facts store, and the process dumps no core.
#[tokio::test]
async fn the_real_binary_logs_no_secret_over_https() {
    use egress_e2e::harness::{control_call, TOKEN};
    use egress_e2e::process::{free_addr, write_config, ProxyProcess};
    let w = origins("inspect = true", "", &["api.example"]).await;
    let (a, o) = (w.api.addr.port(), w.other.addr.port());
    let rest = format!(
        "allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n{}",
        w.dns.addr, w.text
    );
    let dir = &w.dir;
    let api = &w.api;
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, &rest);
    let pp = ProxyProcess::start(&cfg, proxy, control, TOKEN, &["--log-format", "json"]);
    let created = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": "w" })), Some(TOKEN)).await;
    assert_eq!(created.status, 201, "{}", created.text());
    let v: Value = serde_json::from_slice(&created.body).unwrap();
    let env: BTreeMap<String, String> = serde_json::from_value(v["env"].clone()).unwrap();
    let ph = env["API_TOKEN"].clone();
    let key = dir.path().join("ca").join("ca.key");
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    let auth = format!("Authorization: Bearer {ph}");
    let r = curl(&env, &format!("https://api.example:{a}/x?k={ph}"), &["-H", &auth]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
    let r = curl(&env, &format!("https://other.example:{o}/y"), &["-H", &auth]).await;
    assert_eq!(status(&r), "403", "{}", r.stderr);
    let sni = format!("other.example:{o}:api.example:{a}");
    let _ = curl(&env, &format!("https://other.example:{o}/z"), &["--connect-to", &sni]).await;
    assert!(api.heads()[0].contains(SECRET), "{:?}", api.heads());
    let logs = pp.logs();
    assert!(logs.contains("request inside an intercepted tunnel"), "{logs}");
    // The process holding the secret and the CA key writes no core dump.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", pp.child.id())).unwrap();
    let core = limits.lines().find(|l| l.starts_with("Max core file size")).unwrap();
    let soft_hard: Vec<&str> = core.split_whitespace().skip(4).take(2).collect();
    assert_eq!(soft_hard, ["0", "0"], "{core}");
    assert!(logs.contains("credential_misuse"), "{logs}");
    assert!(!logs.contains(SECRET), "the secret is in the logs");
    let facts = serde_json::to_string(&egress_e2e::harness::all_facts_at(control).await).unwrap();
    assert!(!facts.contains(SECRET), "{facts}");
    assert!(
        facts.contains("TLS server name"),
        "curl --connect-to sent SNI other.example: {facts}"
    );
}

#[tokio::test]
async fn what_the_origin_echoes_inside_tls_comes_back_with_the_placeholder() {
    let w = world("", "").await;
    let (run, env) = w.run_full().await;
    let ph = env["API_TOKEN"].clone();
    let auth = format!("Authorization: Bearer {ph}");
    let cases = [
        ("GET", "/headers"),
        ("GET", "/headers?chunk=2"),
        ("GET", "/reflect"),
        ("TRACE", "/anything"),
        ("GET", "/error"),
        ("GET", "/sse?n=2"),
    ];
    for (method, path) in cases {
        let r = curl(&env, &w.api_url(path), &["-X", method, "-H", &auth]).await;
        assert!(r.ok, "{method} {path}: {}", r.stderr);
        let all = format!("{}\n{}", r.stderr, r.stdout);
        assert!(!all.contains(SECRET), "{method} {path} hands back the secret:\n{all}");
        assert!(all.contains(&ph), "{method} {path} echoes the placeholder:\n{all}");
    }
    let heads = w.api.heads();
    assert_eq!(heads.len(), cases.len());
    assert!(heads.iter().all(|h| h.contains(SECRET)), "{heads:?}");
    // A body the proxy could not scrub is not passed on.
    let r = curl(&env, &w.api_url("/gzip"), &["-H", "Accept-Encoding: gzip"]).await;
    assert_eq!(status(&r), "502", "{}", r.stdout);
    assert!(
        r.stderr
            .to_ascii_lowercase()
            .contains("x-egress-deny-reason: unscrubbable"),
        "{}",
        r.stderr
    );
    assert!(!r.stdout.contains(SECRET) && !r.stderr.contains(SECRET));
    let (_, view) = w.p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    let n = view["credential_scrubs"]["api"].as_u64().unwrap_or(0);
    assert!(n >= cases.len() as u64, "{view}");
    let m = w.p.metrics().await;
    let counted = egress_e2e::harness::sample(&m, "egress_credential_scrubs_total{tool=\"w\",credential=\"api\"}");
    assert_eq!(counted, n as f64);
}

#[tokio::test]
async fn the_real_value_inside_tls_goes_only_to_its_host() {
    let w = world("inspect = true", "").await;
    let (_, env) = w.run().await;
    let auth = format!("Authorization: Bearer {SECRET}");
    let r = curl(&env, &w.other_url("/steal"), &["-H", &auth]).await;
    assert_eq!(status(&r), "403", "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .to_ascii_lowercase()
            .contains("x-egress-deny-reason: credential_misuse"),
        "{}",
        r.stderr
    );
    let r = curl(&env, &w.other_url(&format!("/steal?k={SECRET}")), &[]).await;
    assert_eq!(status(&r), "403", "{}", r.stderr);
    assert!(w.other.heads().is_empty(), "{:?}", w.other.heads());
    let facts = w.p.facts_with_reason("credential_misuse").await;
    assert_eq!(facts.len(), 2, "{facts:?}");
    assert!(!serde_json::to_string(&facts).unwrap().contains(SECRET));
    // To its own host it is what the proxy writes anyway.
    let r = curl(&env, &w.api_url("/own"), &["-H", &auth]).await;
    assert_eq!(status(&r), "200", "{}", r.stderr);
}

/// A SOCKS5 CONNECT to a credential host is intercepted like an HTTP
/// CONNECT: the same decision, the same injection.
#[tokio::test]
async fn a_socks5_connect_to_a_credential_host_is_intercepted_too() {
    let w = world("", "").await;
    let (run, env) = w.run_full().await;
    let ph = env["API_TOKEN"].clone();
    let socks = format!("socks5h://{}:{}@{}", run.id, run.secret, w.p.proxy);
    let auth = format!("Authorization: Bearer {ph}");
    let r = curl(&env, &w.api_url("/via-socks"), &["--proxy", &socks, "-H", &auth]).await;
    assert_eq!(status(&r), "200", "{} {}", r.stdout, r.stderr);
    let heads = w.api.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(
        heads[0].contains(&format!("authorization: Bearer {SECRET}\n")),
        "{}",
        heads[0]
    );
    assert!(!r.stdout.contains(SECRET) && !r.stderr.contains(SECRET));
}
