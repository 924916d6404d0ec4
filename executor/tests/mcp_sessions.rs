//! MCP servers run confined as session tools: a real server from PyPI
//! (`mcp-server-time`, installed by `tests/mcp/servers.sh`) under the
//! strongest confinement here, spoken to by the official Python SDK's
//! client through `/v1/mcp/<tool>`, with the real proxy deciding each call
//! against `[tools.<id>.mcp]`: a listed tool answers, a tool the rules
//! leave out is not listed and its call is a JSON-RPC error carrying the
//! fact's id, and the session's end leaves no process and an ended run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, marked_processes, python, TempDir};
use egress_e2e::harness::{all_facts_at, control_call, TOKEN};
use egress_e2e::mcp::{serve, servers, time_tool};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

/// The official SDK's client, through the endpoint, doing `steps`.
async fn sdk(addr: SocketAddr, tool: &str, steps: Value) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_sdk_client.py");
    let url = format!("http://{addr}/v1/mcp/{tool}");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .args([url.as_str(), TOKEN, &steps.to_string()])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the SDK client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confined_mcp_server_answers_the_official_client_within_its_rules() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let venv = servers();
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-time");
    let marker = "loom-mcp-time-session";
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &time_tool(&venv, marker, ""));
    exec.warm_up();
    let sessions = exec.sessions("time").unwrap().clone();
    // A warm server is started and initialized before any client comes.
    assert!(
        eventually(Duration::from_secs(60), || sessions.live() == 1
            && marked_processes(marker).len() == 1)
        .await
    );
    let addr = serve(&exec).await;
    let out = sdk(
        addr,
        "time",
        json!([
            ["list"],
            ["call", "get_current_time", {"timezone": "Etc/UTC"}],
            ["call", "convert_time", {"source_timezone": "Etc/UTC", "time": "12:00", "target_timezone": "SECRET-ARG-zone"}]
        ]),
    )
    .await;
    assert_eq!(out["server"], json!("mcp-time"), "{out:#}");
    assert_eq!(out["protocol"], json!("2025-11-25"), "{out:#}");
    let steps = out["steps"].as_array().unwrap();
    // The server has two tools; the rules list one.
    assert_eq!(steps[0]["tools"], json!(["get_current_time"]), "{out:#}");
    assert_eq!(steps[1]["ok"], json!(true), "{out:#}");
    assert!(steps[1]["text"].as_str().unwrap().contains("Etc/UTC"), "{out:#}");
    // The other is refused before the server sees it, with the fact's id.
    assert_eq!(steps[2]["code"], json!(-32003), "{out:#}");
    assert_eq!(steps[2]["data"]["reason"], json!("mcp_tool_not_allowed"), "{out:#}");
    let fact_id = steps[2]["data"]["fact_id"].as_str().unwrap().to_owned();
    let facts = all_facts_at(control).await;
    let fact = facts
        .iter()
        .find(|f| f["id"] == json!(fact_id))
        .expect("the refusal's fact");
    assert_eq!(fact["reason"], json!("mcp_tool_not_allowed"));
    assert_eq!(fact["target"]["kind"], json!("mcp"));
    assert!(
        !fact.to_string().contains("SECRET-ARG"),
        "arguments never reach a fact: {fact}"
    );
    // The client closed its session (DELETE): the server's tree is gone,
    // its run ended; the warm one that replaced it waits.
    let run_id = fact["run_id"].as_str().unwrap().to_owned();
    assert!(eventually(Duration::from_secs(20), || sessions.count() == 0).await);
    let r = control_call(control, "GET", &format!("/v1/runs/{run_id}"), None, Some(TOKEN)).await;
    let run: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!((r.status, &run["state"]), (200, &json!("ended")), "{run}");
    assert!(eventually(Duration::from_secs(60), || marked_processes(marker).len() == 1).await);
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    assert!(marked_processes(marker).is_empty(), "nothing of the trees is left");
    drop(proxy);
}
