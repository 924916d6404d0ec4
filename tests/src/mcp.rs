//! Support for the MCP session tests: the real servers' virtualenv (made by
//! `tests/mcp/servers.sh`), the confined `mcp-server-time` tool's config,
//! and an executor's API served on loopback for MCP clients to reach.

use egress_executor::Executor;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The servers' virtualenv: `LOOM_MCP_SERVERS`, else `target/mcp-servers`.
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

/// The real servers' Python, and where its standard library lives (what a
/// confined child must be able to read besides the virtualenv).
fn python_paths(venv: &Path) -> Vec<String> {
    let out = std::process::Command::new(venv.join("bin/python3"))
        .args(["-c", "import sys; print(sys.base_prefix)"])
        .output()
        .unwrap();
    let base = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    vec![venv.display().to_string(), base]
}

/// `[tools.time]`: `mcp-server-time` from `venv` as a session tool under the
/// strongest isolation here, its children marked with `marker` (for
/// [`crate::executor::marked_processes`]), the rules allowing only
/// `get_current_time`, one warm server; `extra` is appended.
pub fn time_tool(venv: &Path, marker: &str, extra: &str) -> String {
    let reads: Vec<String> = python_paths(venv).iter().map(|p| format!("{p:?}")).collect();
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
        reads = reads.join(", "),
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
