//! MCP rules on a remote MCP server reached over HTTPS: the official Python
//! SDK's Streamable HTTP server (`clients/testing/mcp_server.py`, which
//! wants a bearer token) behind TLS on 127.0.0.2, reached by a tool through
//! the proxy with `inspect = true`, the token a credential of the server's
//! host only. Through interception, in both of the server's answer forms
//! (SSE and JSON): calls decided by the tool's `[tools.<id>.mcp]` rules (a
//! refused call answered by the proxy with its fact, never sent on),
//! `tools/list` filtered, a batch with one refusal refused whole, a body
//! with a key twice refused, the credential injected, arguments never in a
//! fact.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::{api_credential, file_source, write_secret};
use egress_e2e::dns::FakeDns;
use egress_e2e::harness::{proxy_section, TestProxy, TestRun};
use egress_e2e::mcp::{post, sdk_server, tls_front, tunnel, Server, REMOTE_TOKEN as TOKEN};
use serde_json::{json, Value};
use std::sync::Arc;

fn req(id: u64, method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

fn call(id: u64, name: &str, args: Value) -> Value {
    req(id, "tools/call", json!({"name": name, "arguments": args}))
}

fn bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// The proxy, a run of `remote`, the server's authority; `extra` adds keys
/// to `[tools.remote]`.
async fn world(json: bool, extra: &str) -> (TestProxy, TestRun, String, Server, tempfile::TempDir) {
    let (server, backend) = sdk_server(json);
    let (front, origin_ca) = tls_front(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let roots = dir.path().join("roots.pem");
    std::fs::write(&roots, origin_ca).unwrap();
    let secret = dir.path().join("token");
    write_secret(&secret, TOKEN, 0o600);
    let dns = FakeDns::start().await;
    dns.set("mcp.test", &["127.0.0.2"]);
    let authority = format!("mcp.test:{}", front.port());
    let text = format!(
        r#"{}
[proxy.interception]
upstream_ca_file = "{}"
[tools.remote]
egress = ["{authority}"]
inspect = true
{extra}
[tools.remote.mcp]
tools = ["echo", {{ name = "shout", args = {{ text = "ok*" }} }}]
{}"#,
        proxy_section(&dns, ""),
        roots.display(),
        api_credential("remote", &authority, &file_source(&secret)),
    );
    let p = TestProxy::start_config(
        dns,
        &text,
        None,
        Some(Arc::new(egress_proxy::facts::MemorySink::new(1000))),
    )
    .await;
    let run = p.run("remote").await;
    (p, run, authority, server, dir)
}

async fn the_rules_hold_on_a_remote_server(json: bool) {
    let (p, run, authority, _server, _dir) = world(json, "").await;
    let mut t = tunnel(&p, &run, &authority).await;
    let init = req(
        1,
        "initialize",
        json!({"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}),
    );
    let (s, sid, v) = post(&mut t, None, bytes(&init)).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        v["result"]["serverInfo"].is_object(),
        "the credential reached the server: {v}"
    );
    let sid = sid.unwrap();
    let (s, _, _) = post(
        &mut t,
        Some(&sid),
        bytes(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"})),
    )
    .await;
    assert_eq!(s, 202);
    // The list: only what the rules allow.
    let (_, _, v) = post(&mut t, Some(&sid), bytes(&req(2, "tools/list", json!({})))).await;
    let names: Vec<&str> = v["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["echo", "shout"], "{v}");
    // Allowed calls are answered by the server.
    let (_, _, v) = post(&mut t, Some(&sid), bytes(&call(3, "echo", json!({"text": "hi"})))).await;
    assert_eq!(v["result"]["content"][0]["text"], json!("echo: hi"), "{v}");
    let (_, _, v) = post(&mut t, Some(&sid), bytes(&call(4, "shout", json!({"text": "okay"})))).await;
    assert_eq!(v["result"]["content"][0]["text"], json!("OKAY"), "{v}");
    // A tool the rules leave out: answered by the proxy (the server's own
    // refusal would be -32001 with its fixed fact id), with its fact.
    let (s, _, v) = post(
        &mut t,
        Some(&sid),
        bytes(&call(5, "refused", json!({"url": "SECRET-ARG-1"}))),
    )
    .await;
    assert_eq!(
        (s, &v["id"], &v["error"]["code"]),
        (200, &json!(5), &json!(-32003)),
        "{v}"
    );
    assert_eq!(v["error"]["data"]["reason"], json!("mcp_tool_not_allowed"), "{v}");
    let fact_id = v["error"]["data"]["fact_id"].as_str().unwrap().to_owned();
    assert_ne!(fact_id, "fact-0001");
    // Arguments outside their matcher.
    let (_, _, v) = post(
        &mut t,
        Some(&sid),
        bytes(&call(6, "shout", json!({"text": "SECRET-ARG-2"}))),
    )
    .await;
    assert_eq!(v["error"]["data"]["reason"], json!("mcp_arguments_not_allowed"), "{v}");
    // A batch with one refusal: refused whole, nothing sent.
    let batch = json!([
        call(7, "echo", json!({"text": "a"})),
        call(8, "refused", json!({"url": "b"}))
    ]);
    let (s, _, _) = post(&mut t, Some(&sid), bytes(&batch)).await;
    assert_eq!(s, 200);
    // A key twice: two readers could see two calls; refused, not sent.
    let dup = br#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"echo","name":"refused","arguments":{"text":"x"}}}"#;
    let (s, _, v) = post(&mut t, Some(&sid), dup.to_vec()).await;
    assert_eq!((s, &v["error"]["code"]), (400, &json!(-32700)), "{v}");
    // The facts: kind mcp, the names, never the arguments.
    let facts = p.facts().await;
    let mcp: Vec<_> = facts
        .iter()
        .filter(|f| f.target.as_ref().is_some_and(|t| t.kind == "mcp"))
        .collect();
    assert!(
        mcp.iter()
            .any(|f| f.id == fact_id && f.reason == "mcp_tool_not_allowed"),
        "{facts:#?}"
    );
    assert!(
        mcp.iter().any(|f| f.reason == "mcp_arguments_not_allowed"),
        "{facts:#?}"
    );
    let all = serde_json::to_string(&facts).unwrap();
    assert!(!all.contains("SECRET-ARG"), "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_hold_on_a_remote_server_answering_sse() {
    the_rules_hold_on_a_remote_server(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_hold_on_a_remote_server_answering_json() {
    the_rules_hold_on_a_remote_server(true).await;
}

/// An MCP message that never arrives whole is not held past the fetch
/// deadline: answered `408` (nothing sent), or cut with its tunnel, whose
/// own deadline started first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_message_that_never_arrives_is_cut_at_the_fetch_deadline() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (p, run, authority, _server, _dir) = world(true, "fetch_timeout_ms = 1000").await;
    let (r, stream) = egress_e2e::raw::connect(p.proxy, &authority, Some(&run.auth())).await;
    assert_eq!(r.status, 200);
    let (_, ca) = p.control("GET", "/v1/ca", None).await;
    let mut tls = egress_e2e::inside::tls(ca["pem"].as_str().unwrap(), "mcp.test", b"http/1.1", stream).await;
    let head = format!(
        "POST /v1/mcp/demo HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"jsonrpc\""
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let t0 = std::time::Instant::now();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), tls.read(&mut buf))
        .await
        .expect("an answer or the end before 10 s");
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    if let Ok(n) = read {
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
    }
}
