//! AWS SigV4 re-signing through the real proxy. The tool is a Python
//! process with the run's environment only (`tests/credentials/s3_tool.py`:
//! boto3, requests), whose AWS keys are the run's placeholder. The origin
//! (`tests/credentials/s3_origin.py`, HTTPS on 127.0.0.2 as `s3.example`)
//! accepts a request only when botocore's own signer, with the real keys,
//! computes the signature it carries. So a 200 proves the proxy signed it
//! with the real keys; the origin's log proves no placeholder signature
//! reached it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::aws::{available, S3Origin};
use egress_e2e::credentials::write_secret;
use egress_e2e::harness::{control_call, proxy_section, TestProxy, TOKEN as CONTROL_TOKEN};
use egress_e2e::process::{bin, client, free_addr, repo_root, write_config, ProxyProcess};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

const AK: &str = "AKIDREALKEY000000001";
const SK: &str = "real/secret+access+key/0123456789abcdefghij";
const SESSION: &str = "real-session-token-FwoGZXIvYXdzEXAMPLE0123456789";

struct World {
    p: TestProxy,
    origin: S3Origin,
    _dir: tempfile::TempDir,
}

async fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let origin = S3Origin::start(dir.path(), AK, SK, false);
    let dns = FakeDns::start().await;
    dns.set("s3.example", &["127.0.0.2"]);
    let s3 = format!("s3.example:{}", origin.addr.port());
    let (ak, sk, tok) = (dir.path().join("ak"), dir.path().join("sk"), dir.path().join("token"));
    write_secret(&ak, AK, 0o600);
    write_secret(&sk, SK, 0o600);
    write_secret(&tok, SESSION, 0o600);
    let text = format!(
        "{}\n[proxy.interception]\nupstream_ca_file = \"{}\"\n\n[tools.w]\negress = [\"{s3}\"]\n\
         [tools.w.credentials.aws]\nhosts = [\"{s3}\"]\nplaceholder_env = \"AWS_ACCESS_KEY_ID\"\n\
         sign = {{ aws_sigv4 = {{ service = \"s3\", region = \"us-east-1\", access_key_id = {{ file = \"{}\" }}, \
         secret_access_key = {{ file = \"{}\" }}, session_token = {{ file = \"{}\" }} }} }}\n",
        proxy_section(&dns, ""),
        origin.ca_file.display(),
        ak.display(),
        sk.display(),
        tok.display(),
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(10_000)))).await;
    World { p, origin, _dir: dir }
}

impl World {
    /// A new run's environment: all a tool gets.
    async fn env(&self) -> BTreeMap<String, String> {
        let (status, v) = self.p.control("POST", "/v1/runs", Some(json!({ "tool": "w" }))).await;
        assert_eq!(status, 201, "{v}");
        serde_json::from_value(v["env"].clone()).unwrap()
    }

    /// Runs `s3_tool.py ACTION` as the tool; its JSON answer.
    async fn tool(&self, env: &BTreeMap<String, String>, action: &str) -> Value {
        let script = repo_root().join("tests/credentials/s3_tool.py");
        let endpoint = format!("https://s3.example:{}", self.origin.addr.port());
        let r = client(env, "python3", &[script.to_str().unwrap(), action, &endpoint]).await;
        assert!(r.ok, "s3_tool.py {action}: {}{}", r.stdout, r.stderr);
        serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", r.stdout))
    }
}

/// Every request the origin got carried the real key id and the session
/// token, never the placeholder.
fn only_real_signatures(origin: &S3Origin, placeholder: &str) {
    let got = origin.requests();
    assert!(!got.is_empty());
    for r in &got {
        let auth = r["authorization"].as_str().unwrap();
        assert!(auth.starts_with(&format!("AWS4-HMAC-SHA256 Credential={AK}/")), "{r}");
        assert!(
            !r.to_string().contains(placeholder),
            "the placeholder reached the origin: {r}"
        );
        assert_eq!(r["security_token"], SESSION, "{r}");
    }
}

#[tokio::test]
async fn boto3_with_placeholder_keys_works_unchanged_and_the_origin_sees_only_real_signatures() {
    if !available() {
        return;
    }
    let w = world().await;
    let env = w.env().await;
    let placeholder = env["AWS_ACCESS_KEY_ID"].clone();
    assert!(placeholder.starts_with("loom-cred-"), "{env:?}");
    assert_eq!(
        env["AWS_SECRET_ACCESS_KEY"], placeholder,
        "the tool signs with the placeholder as its secret key"
    );
    assert!(
        env.contains_key("AWS_CA_BUNDLE"),
        "boto3 trusts the appliance CA from AWS_CA_BUNDLE"
    );

    // put_object (300 kB, boto3's default unsigned trailer checksum),
    // get_object, head_object, and a small put with a SHA-256 checksum.
    let r = w.tool(&env, "boto").await;
    assert_eq!(r["same"], true, "{r}");
    assert_eq!(r["length"], 300_000, "{r}");
    assert_eq!(r["small"], "hello from a tool", "{r}");
    let got = w.origin.requests();
    assert!(
        got.iter().all(|r| r["outcome"] == "ok"),
        "every request verified: {got:?}"
    );
    assert!(got.len() >= 5, "{got:?}");
    only_real_signatures(&w.origin, &placeholder);

    // A request the tool did not sign: the proxy signs it, hashing its
    // body for S3; one too large to hash is refused before it leaves.
    let before = w.origin.requests().len();
    let r = w.tool(&env, "unsigned").await;
    assert_eq!((r["put"].as_u64(), r["get"].as_u64()), (Some(200), Some(200)), "{r}");
    assert_eq!(r["body"], "plain body");
    assert_eq!(r["big"], 400, "{r}");
    assert_eq!(r["big_denial"]["reason"], "signature_unsupported", "{r}");
    assert_eq!(w.origin.requests().len(), before + 2, "the oversized body never left");
    let facts = w.p.facts_with_reason("signature_unsupported").await;
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert!(
        facts[0]["detail"].as_str().unwrap().contains("max_body_bytes"),
        "{facts:?}"
    );

    // A reflecting origin: the key id and the session token it saw are
    // scrubbed from the answer; the secret key was never sent.
    let r = w.tool(&env, "echo").await;
    assert_eq!(r["status"], 200, "{r}");
    let text = r["text"].as_str().unwrap();
    assert!(text.contains("x-amz-date") || text.contains("X-Amz-Date"), "{text}");
    for secret in [AK, SESSION, SK] {
        assert!(!text.contains(secret), "{secret} reached the tool: {text}");
    }
    only_real_signatures(&w.origin, &placeholder);
}

#[tokio::test]
async fn a_streaming_upload_with_signed_chunks_is_signed_again_chunk_by_chunk() {
    if !available() {
        return;
    }
    let w = world().await;
    let env = w.env().await;
    let r = w.tool(&env, "chunked").await;
    assert_eq!(
        r["put"], 200,
        "the origin checked every chunk signature under the real key: {r}"
    );
    assert_eq!(r["same"], true, "{r}");
    only_real_signatures(&w.origin, &env["AWS_ACCESS_KEY_ID"]);
}

#[tokio::test]
async fn another_key_id_is_credential_misuse_and_a_presigned_url_is_refused() {
    if !available() {
        return;
    }
    let w = world().await;
    let env = w.env().await;
    // Signed with a real-looking key the proxy does not own: refused
    // before anything leaves; the origin never sees it.
    let r = w.tool(&env, "other_key").await;
    assert_eq!(r["status"], 403, "{r}");
    assert!(r["reason"].as_str().unwrap().contains("credential_misuse"), "{r}");
    assert!(w.origin.requests().is_empty(), "{:?}", w.origin.requests());
    let facts = w.p.facts_with_reason("credential_misuse").await;
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert!(
        facts[0]["detail"].as_str().unwrap().contains("another key id"),
        "{facts:?}"
    );
    assert!(!facts[0].to_string().contains("AKIAIOSFODNN7EXAMPLE"), "{facts:?}");

    // A presigned URL (a signature in the query), even by the placeholder.
    // SigV2 (boto3's default for S3) and SigV4.
    let r = w.tool(&env, "presigned").await;
    for version in ["s3", "s3v4"] {
        assert_eq!(r[version]["status"], 400, "{r}");
        assert_eq!(r[version]["denial"]["reason"], "signature_unsupported", "{r}");
    }
    assert!(w.origin.requests().is_empty());
}

/// Runs `s3_tool.py ACTION` as a new run of tool `w` on the proxy whose
/// control API is `control`: the run's id and env, and the tool's answer.
async fn tool_at(
    control: std::net::SocketAddr,
    origin: &S3Origin,
    action: &str,
) -> (String, BTreeMap<String, String>, Value) {
    let r = control_call(
        control,
        "POST",
        "/v1/runs",
        Some(json!({ "tool": "w" })),
        Some(CONTROL_TOKEN),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let env: BTreeMap<String, String> = serde_json::from_value(v["env"].clone()).unwrap();
    let script = repo_root().join("tests/credentials/s3_tool.py");
    let endpoint = format!("https://s3.example:{}", origin.addr.port());
    let out = client(&env, "python3", &[script.to_str().unwrap(), action, &endpoint]).await;
    assert!(out.ok, "s3_tool.py {action}: {}{}", out.stdout, out.stderr);
    let answer = serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    (v["run_id"].as_str().unwrap().to_owned(), env, answer)
}

#[tokio::test]
async fn keys_from_sts_assume_role_sign_the_tool_s_requests() {
    if !available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The origin accepts the real keys and the temporary keys moto (as
    // STS, in the origin's process) issued.
    let origin = S3Origin::start(dir.path(), AK, SK, true);
    let sts = origin.sts.unwrap();
    let dns = FakeDns::start().await;
    dns.set("s3.example", &["127.0.0.2"]);
    let s3 = format!("s3.example:{}", origin.addr.port());
    let (proxy, control) = (free_addr(), free_addr());
    let rest = format!(
        "allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n[proxy.interception]\nupstream_ca_file = \"{}\"\n\
         [tools.w]\negress = [\"{s3}\"]\n[tools.w.credentials.aws]\nhosts = [\"{s3}\"]\nplaceholder_env = \"AWS_ACCESS_KEY_ID\"\n\
         sign = {{ aws_sigv4 = {{ service = \"s3\", region = \"us-east-1\", assume_role = {{ \
         role_arn = \"arn:aws:iam::123456789012:role/s3-writer\", region = \"us-east-1\", duration_s = 900, \
         endpoint = \"http://{sts}/\", allow_plaintext = true }} }} }}\n",
        dns.addr,
        origin.ca_file.display(),
    );
    let cfg = write_config(dir.path(), proxy, control, &rest);
    // The proxy's own AWS keys, in its environment only: they ask STS.
    let p = ProxyProcess::start_with_env(
        &bin("egress-proxy"),
        &cfg,
        (proxy, control),
        CONTROL_TOKEN,
        &[],
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDPROXYOWNKEY00001"),
            ("AWS_SECRET_ACCESS_KEY", "proxy-own-secret-access-key"),
        ],
    );
    let (id, env, r) = tool_at(p.control, &origin, "boto").await;
    assert_eq!(r["same"], true, "{r}");
    let got = origin.requests();
    assert!(!got.is_empty());
    for g in &got {
        assert_eq!(g["outcome"], "ok", "{g}");
        let key = g["key_id"].as_str().unwrap();
        assert!(key.starts_with("ASIA"), "signed with moto's temporary key id: {g}");
        assert!(!g["security_token"].as_str().unwrap().is_empty(), "{g}");
        assert!(!g.to_string().contains(&env["AWS_ACCESS_KEY_ID"]), "{g}");
    }
    // The run view names the source and its expiry (900 s), never a value.
    let view = control_call(p.control, "GET", &format!("/v1/runs/{id}"), None, Some(CONTROL_TOKEN)).await;
    let view: Value = serde_json::from_slice(&view.body).unwrap();
    let c = &view["credentials"][0];
    assert_eq!(c["source"], "aws_sts_assume_role", "{view}");
    assert_eq!(c["last_refresh"]["outcome"], "ok", "{view}");
    // A reflecting path: the temporary key id and token never reach the tool.
    let key = got[0]["key_id"].as_str().unwrap().to_owned();
    let token = got[0]["security_token"].as_str().unwrap().to_owned();
    let (_, _, r) = tool_at(p.control, &origin, "echo").await;
    assert_eq!(r["status"], 200, "{r}");
    let text = r["text"].as_str().unwrap();
    assert!(!text.contains(&key) && !text.contains(&token), "{text}");
    let log = std::fs::read_to_string(&p.log).unwrap();
    assert!(
        !log.contains(&token) && !log.contains(&key),
        "the proxy's log holds no value"
    );
}
