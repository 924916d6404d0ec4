//! Support for the MCP session tests: the real servers' virtualenv (made by
//! `tests/mcp/servers.sh`) and what a confined server reads besides it, the
//! confined `mcp-server-time` tool's config, an executor's API served on
//! loopback, and the official Python SDK's client
//! (`tests/python/mcp_sdk_client.py`) driven through an endpoint.

use egress_executor::Executor;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::harness::TOKEN;

/// The servers' virtualenv: `LOOM_MCP_SERVERS`, else `target/mcp-servers`
/// (fails, naming the script, when it is not there).
pub fn servers() -> PathBuf {
    let venv = std::env::var_os("LOOM_MCP_SERVERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::process::repo_root().join("target/mcp-servers"));
    assert!(
        venv.join("bin/python3").exists(),
        "the MCP servers are not installed at {} (run tests/mcp/servers.sh)",
        venv.display()
    );
    venv
}

/// The virtualenv and its Python's own prefix, as TOML strings for a
/// tool's `read_paths` (what a confined server reads besides `/usr`).
pub fn server_reads(venv: &Path) -> String {
    let out = std::process::Command::new(venv.join("bin/python3"))
        .args(["-c", "import sys; print(sys.base_prefix)"])
        .output()
        .unwrap();
    let base = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    format!("{:?}, {base:?}", venv.display().to_string())
}

/// `[tools.time]`: `mcp-server-time` from `venv` as a session tool under the
/// strongest isolation here, its children marked with `marker` (for
/// [`crate::executor::marked_processes`]), the rules allowing only
/// `get_current_time`, one warm server; `extra` is appended.
pub fn time_tool(venv: &Path, marker: &str, extra: &str) -> String {
    format!(
        r#"
[tools.time]
egress = []
[tools.time.mcp]
tools = ["get_current_time"]
[tools.time.process]
command = ["{py}", "-m", "mcp_server_time", "--local-timezone", "UTC"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
read_paths = [{reads}]
env = {{ LOOM_TEST_MARK = "{marker}" }}
cold_start_ms = 60000
timeout_ms = 30000
pool = {{ warm = 1, max = 1 }}
{extra}
"#,
        py = venv.join("bin/python3").display(),
        iso = crate::executor::strongest_isolation(),
        reads = server_reads(venv),
    )
}

/// Serves the executor's API (its router) on `127.0.0.1:0`: the address.
pub async fn serve(exec: &Arc<Executor>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = egress_executor::api::router(exec.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The official SDK's client through `http://{addr}/v1/mcp/{tool}` doing
/// `steps` (`[["list"], ["call", name, arguments], ...]`): what it printed
/// (`server`, `protocol`, and per step `tools`, or `ok` and `text`, or the
/// error's `code`, `message` and `data`).
pub async fn sdk(addr: SocketAddr, tool: &str, steps: Value) -> Value {
    let script = crate::process::repo_root().join("tests/python/mcp_sdk_client.py");
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
