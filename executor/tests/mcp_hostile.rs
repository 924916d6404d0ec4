//! Session tools against servers that misbehave (`fixtures/hostile_mcp.py`,
//! confined like any server): a flood of messages, a 100 MB line, a server
//! that never answers `initialize`, one that answers with what is not
//! JSON, one that exits mid-call, one whose grandchild would outlive it.
//! Each is contained with a clear answer (a JSON-RPC error or a clean HTTP
//! error), its tree is gone, the executor's memory stays bounded, and
//! another session goes on answering. Then the session bounds:
//! `max_sessions` open at once and one more refused, and the idle timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, marked_processes, python, strongest_isolation, TempDir};
use egress_e2e::harness::{control_call, TOKEN};
use egress_e2e::mcp::{endpoint as mcp, serve};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

/// A session tool running the hostile server in `mode` (no warm server:
/// each session starts its own), `cold_start_ms` to start and initialize.
fn tool(id: &str, mode: &str, marker: &str, cold_start_ms: u64, extra: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hostile_mcp.py");
    format!(
        r#"
[tools.{id}]
egress = []
[tools.{id}.mcp]
deny_tools = ["secret"]
[tools.{id}.process]
command = ["python3", "{script}", "{mode}"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
env = {{ LOOM_TEST_MARK = "{marker}" }}
cold_start_ms = {cold_start_ms}
timeout_ms = 5000
max_message_bytes = 1048576
pool = {{ warm = 0, max = 1 }}
{extra}
"#,
        script = script.display(),
        iso = strongest_isolation(),
    )
}

fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
}

fn call(id: u64, name: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": name, "arguments": {"n": id}}})
}

/// Opens a session of `tool`: its id.
async fn open(addr: SocketAddr, tool: &str) -> String {
    let (status, id, v) = mcp(addr, tool, "POST", None, Some(initialize())).await;
    assert_eq!(status, 200, "{tool}: {v}");
    id.unwrap()
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hostile_server_is_contained_with_a_clear_answer() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-hostile");
    let modes = ["echo", "flood", "long_line", "silent", "invalid", "exits", "grandchild"];
    let tools: String = modes
        .iter()
        .map(|m| {
            let cold = if *m == "silent" { 3000 } else { 20000 };
            tool(&m.replace('_', "-"), m, &format!("loom-mcp-hostile-{m}"), cold, "")
        })
        .collect();
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    let gone = |m: &str| marked_processes(&format!("loom-mcp-hostile-{m}")).is_empty();

    // A well-behaved session, open the whole time.
    let echo = open(addr, "echo").await;
    let (s, _, v) = mcp(addr, "echo", "POST", Some(&echo), Some(call(2, "echo"))).await;
    assert_eq!((s, &v["id"]), (200, &json!(2)), "{v}");
    let (s, _, v) = mcp(addr, "echo", "POST", Some(&echo), Some(call(3, "secret"))).await;
    assert_eq!(
        (s, &v["error"]["code"], &v["error"]["data"]["reason"]),
        (200, &json!(-32003), &json!("mcp_tool_not_allowed")),
        "{v}"
    );
    let rss = rss_kib();

    // Never answers initialize: 503 within cold_start_ms, nothing left.
    let (s, id, v) = mcp(addr, "silent", "POST", None, Some(initialize())).await;
    assert_eq!((s, id), (503, None), "{v}");
    assert_eq!(v["id"], json!(1), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("initialize"), "{v}");
    assert!(eventually(Duration::from_secs(10), || gone("silent")).await);

    // A 100 MB line: the session closes at the 1 MiB bound; the call gets
    // its error; the tree is gone.
    let s1 = open(addr, "long-line").await;
    let (s, _, v) = mcp(addr, "long-line", "POST", Some(&s1), Some(call(7, "echo"))).await;
    assert_eq!((s, &v["id"]), (200, &json!(7)), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("longer than 1048576"),
        "{v}"
    );
    assert!(
        eventually(Duration::from_secs(10), || gone("long_line")
            && exec.sessions("long-line").unwrap().count() == 0)
        .await
    );
    let (s, _, v) = mcp(addr, "long-line", "POST", Some(&s1), Some(call(8, "echo"))).await;
    assert_eq!(s, 404, "a closed session is gone: {v}");

    // Not JSON, and an exit mid-call: an error each, the session closed.
    for (tool, mode, says) in [("invalid", "invalid", "not JSON"), ("exits", "exits", "")] {
        let sid = open(addr, tool).await;
        let (s, _, v) = mcp(addr, tool, "POST", Some(&sid), Some(call(9, "echo"))).await;
        assert_eq!(
            (s, &v["id"], &v["error"]["code"]),
            (200, &json!(9), &json!(-32603)),
            "{tool}: {v}"
        );
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{tool}: {v}");
        assert!(eventually(Duration::from_secs(10), || gone(mode)).await, "{tool}");
    }

    // A flood with no stream reading it: the session closes at the queue's
    // bound (or the session's bytes); whatever was asked gets an error.
    let (s, id, v) = mcp(addr, "flood", "POST", None, Some(initialize())).await;
    if s == 200 {
        let (s, _, v) = mcp(addr, "flood", "POST", id.as_deref(), Some(call(4, "echo"))).await;
        assert!(s == 404 || v["error"]["code"] == json!(-32603), "{s}: {v}");
    } else {
        assert_eq!(s, 503, "{v}");
    }
    assert!(eventually(Duration::from_secs(20), || gone("flood")).await);

    // A grandchild that would outlive its server: the session's end kills
    // the whole tree.
    let g = open(addr, "grandchild").await;
    assert!(
        eventually(Duration::from_secs(10), || marked_processes(
            "loom-mcp-hostile-grandchild"
        )
        .len()
            == 2)
        .await
    );
    let (s, _, _) = mcp(addr, "grandchild", "DELETE", Some(&g), None).await;
    assert_eq!(s, 204);
    assert!(eventually(Duration::from_secs(10), || gone("grandchild")).await);

    // None of it touched the other session, nor grew the executor much.
    let (s, _, v) = mcp(addr, "echo", "POST", Some(&echo), Some(call(5, "echo"))).await;
    assert_eq!((s, &v["id"], v.get("error")), (200, &json!(5), None), "{v}");
    let grown = rss_kib().saturating_sub(rss);
    assert!(grown < 64 * 1024, "the executor grew by {grown} KiB");
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    assert!(gone("echo"));
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_bounded_in_number_and_closed_when_idle() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-bounds");
    let marker = "loom-mcp-bounds-echo";
    let tools = tool(
        "echo",
        "echo",
        marker,
        20000,
        "max_sessions = 50\nsession_idle_ms = 3000\n",
    );
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    // 50 at once: all open.
    let opened =
        futures_util::future::join_all((0..50).map(|_| mcp(addr, "echo", "POST", None, Some(initialize())))).await;
    let ids: Vec<String> = opened
        .iter()
        .map(|(s, id, v)| {
            assert_eq!(*s, 200, "{v}");
            id.clone().unwrap()
        })
        .collect();
    assert_eq!(exec.sessions("echo").unwrap().count(), 50);
    assert_eq!(marked_processes(marker).len(), 50);
    // One more: refused cleanly.
    let (s, id, v) = mcp(addr, "echo", "POST", None, Some(initialize())).await;
    assert_eq!((s, id), (503, None), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_sessions"), "{v}");
    // Each answers on its own session.
    let (s, _, v) = mcp(addr, "echo", "POST", Some(&ids[17]), Some(call(17, "echo"))).await;
    assert_eq!((s, &v["id"]), (200, &json!(17)), "{v}");
    // Idle for session_idle_ms: every session closed, its tree gone, its run ended.
    assert!(eventually(Duration::from_secs(30), || exec.sessions("echo").unwrap().count() == 0).await);
    assert!(eventually(Duration::from_secs(20), || marked_processes(marker).is_empty()).await);
    // A session's run is ended at the proxy after its tree is killed: its
    // end may still be on its way when the count reaches 0.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let active = loop {
        let r = control_call(control, "GET", "/v1/runs?tool=echo", None, Some(TOKEN)).await;
        let runs: Value = serde_json::from_slice(&r.body).unwrap();
        let active: Vec<Value> = runs["runs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] != json!("ended"))
            .cloned()
            .collect();
        if active.is_empty() || std::time::Instant::now() > deadline {
            break active;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(active.is_empty(), "{active:#?}");
    let (s, _, _) = mcp(addr, "echo", "POST", Some(&ids[0]), Some(call(1, "echo"))).await;
    assert_eq!(s, 404);
    exec.shutdown();
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_not_idle_while_a_request_is_carried() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-slow");
    let tools = tool("slow", "slow", "loom-mcp-slow", 20000, "session_idle_ms = 1500\n");
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    let sid = open(addr, "slow").await;
    // The server takes 3 s, twice the idle timeout: the call is answered.
    let (s, _, v) = mcp(addr, "slow", "POST", Some(&sid), Some(call(6, "echo"))).await;
    assert_eq!((s, &v["id"], v.get("error")), (200, &json!(6), None), "{v}");
    // Then, idle: closed.
    assert!(eventually(Duration::from_secs(20), || exec.sessions("slow").unwrap().count() == 0).await);
    assert!(eventually(Duration::from_secs(20), || marked_processes("loom-mcp-slow").is_empty()).await);
    exec.shutdown();
    drop(proxy);
}
