//! Support for the MCP session tests: the real servers' virtualenv (made by
//! `tests/mcp/servers.sh`) and what a confined server reads besides it, the
//! confined `mcp-server-time` tool's config, an executor's API served on
//! loopback, and the official Python SDK's client
//! (`tests/python/mcp_sdk_client.py`) driven through an endpoint; and a
//! remote MCP server for interception (the SDK's server behind TLS, a
//! tool's connection to it through the proxy).

use egress_executor::Executor;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::harness::{TestProxy, TestRun, TOKEN};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};

/// The bearer token the remote SDK server wants (a credential of its host).
pub const REMOTE_TOKEN: &str = "remote-mcp-REAL-token-5e6f";

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

/// One request to `/v1/mcp/{tool}`: its status, its `Mcp-Session-Id` and
/// its body as JSON (`Null` when empty).
pub async fn endpoint(
    addr: SocketAddr,
    tool: &str,
    method: &str,
    session: Option<&str>,
    body: Option<Value>,
) -> (u16, Option<String>, Value) {
    endpoint_as(addr, TOKEN, tool, method, session, body).await
}

/// [`endpoint`] with the bearer `token` of another principal.
pub async fn endpoint_as(
    addr: SocketAddr,
    token: &str,
    tool: &str,
    method: &str,
    session: Option<&str>,
    body: Option<Value>,
) -> (u16, Option<String>, Value) {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let bytes = body.map(|b| serde_json::to_vec(&b).unwrap()).unwrap_or_default();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("/v1/mcp/{tool}"))
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("authorization", format!("Bearer {token}"));
    if let Some(s) = session {
        req = req.header("mcp-session-id", s);
    }
    let resp = tx
        .send_request(req.body(Full::new(bytes::Bytes::from(bytes))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let id = resp
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)))
    };
    (status, id, v)
}

/// The SDK's server process, killed when dropped.
pub struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The SDK's Streamable HTTP server (`clients/testing/mcp_server.py`,
/// wanting [`REMOTE_TOKEN`]) on 127.0.0.1 (its port), answering as SSE or JSON.
pub fn sdk_server(json: bool) -> (Server, u16) {
    // The Host it is reached by through the proxy: any port of mcp.test.
    let script = crate::process::repo_root().join("clients/testing/mcp_server.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .args(["--tool", "demo", "--token", REMOTE_TOKEN, "--allow-host", "mcp.test:*"]);
    if json {
        cmd.arg("--json");
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line.trim().strip_prefix("port ").expect("port N").parse().unwrap();
    (Server(child), port)
}

/// TLS for `mcp.test` on 127.0.0.2, in front of the server's plain port:
/// its address and its CA.
pub async fn tls_front(backend: u16) -> (SocketAddr, String) {
    let (config, ca) = crate::tls_origin::test_server_config(&["mcp.test"], &[b"http/1.1"]);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else { return };
                let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", backend)).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    (addr, ca)
}

/// A tool's HTTP/1.1 connection to `authority` inside an intercepted
/// CONNECT, trusting the appliance CA only.
pub async fn tunnel(p: &TestProxy, run: &TestRun, authority: &str) -> Tunnel {
    let (r, stream) = crate::raw::connect(p.proxy, authority, Some(&run.auth())).await;
    assert_eq!(r.status, 200);
    let (_, ca) = p.control("GET", "/v1/ca", None).await;
    let tls = crate::inside::tls(ca["pem"].as_str().unwrap(), "mcp.test", b"http/1.1", stream).await;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    Tunnel {
        send,
        authority: authority.to_owned(),
    }
}

/// A tool's connection to a remote MCP server inside an intercepted CONNECT.
pub struct Tunnel {
    send: SendRequest<Full<Bytes>>,
    authority: String,
}

/// One POST of `body` (raw bytes) on the tunnel: the status, the session id,
/// and the JSON-RPC answer (from JSON, or from the SSE event that carries a
/// response; `Null` when there is none).
pub async fn post(t: &mut Tunnel, session: Option<&str>, body: Vec<u8>) -> (u16, Option<String>, Value) {
    t.send.ready().await.unwrap();
    let mut req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/mcp/demo")
        .header("host", t.authority.as_str())
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-11-25");
    if let Some(s) = session {
        req = req.header("mcp-session-id", s);
    }
    let resp = t
        .send
        .send_request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let sid = resp
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let sse = resp
        .headers()
        .get("content-type")
        .is_some_and(|v| v.to_str().unwrap().starts_with("text/event-stream"));
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    assert!(!text.contains(REMOTE_TOKEN), "the token never reaches the tool: {text}");
    let v = if sse {
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|v| v.get("id").is_some())
            .unwrap_or(Value::Null)
    } else if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    };
    (status, sid, v)
}

/// The `[tools.<id>.mcp]` rules of the one table of MCP cases ([`cases`]).
pub const CASE_RULES: &str = r#"tools = ["echo", "ec*o2", { name = "shout", args = { text = "ok*", "opts.level" = { min = 1, max = 3 } } }, { name = "pick", args = { color = ["red", "blue"] } }]
deny_tools = ["ecBADo2", { name = "shout", args = { text = "okBAD" } }]
resources = ["demo://*"]
prompts = ["greet"]
"#;

/// The one table of MCP rule cases every place that decides MCP calls is
/// fed (the executor's endpoint, a remote server through interception):
/// (method, params, the deny reason, or `None` for allowed).
pub fn cases() -> Vec<(&'static str, Value, Option<&'static str>)> {
    use serde_json::json;
    let tool = |name: &str, args: Value| json!({"name": name, "arguments": args});
    vec![
        ("tools/call", tool("echo", json!({"text": "a"})), None),
        ("tools/call", tool("ecXYo2", json!({})), None),
        ("tools/call", tool("ecBADo2", json!({})), Some("mcp_tool_not_allowed")),
        (
            "tools/call",
            tool("rm", json!({"path": "/"})),
            Some("mcp_tool_not_allowed"),
        ),
        (
            "tools/call",
            tool("\u{ff45}cho", json!({})),
            Some("mcp_tool_not_allowed"),
        ),
        (
            "tools/call",
            tool("shout", json!({"text": "okay", "opts": {"level": 2}})),
            None,
        ),
        (
            "tools/call",
            tool("shout", json!({"text": "nope", "opts": {"level": 2}})),
            Some("mcp_arguments_not_allowed"),
        ),
        (
            "tools/call",
            tool("shout", json!({"text": "okay", "opts": {"level": 9}})),
            Some("mcp_arguments_not_allowed"),
        ),
        (
            "tools/call",
            tool("shout", json!({"text": "okay"})),
            Some("mcp_arguments_not_allowed"),
        ),
        (
            "tools/call",
            tool("shout", json!({"text": "okBAD", "opts": {"level": 1}})),
            Some("mcp_arguments_not_allowed"),
        ),
        ("tools/call", tool("pick", json!({"color": "red"})), None),
        (
            "tools/call",
            tool("pick", json!({"color": "green"})),
            Some("mcp_arguments_not_allowed"),
        ),
        ("resources/read", json!({"uri": "demo://greeting"}), None),
        (
            "resources/read",
            json!({"uri": "file:///etc/passwd"}),
            Some("mcp_resource_not_allowed"),
        ),
        (
            "prompts/get",
            json!({"name": "greet", "arguments": {"name": "x"}}),
            None,
        ),
        (
            "prompts/get",
            json!({"name": "leak", "arguments": {}}),
            Some("mcp_prompt_not_allowed"),
        ),
        ("ping", json!({}), None),
    ]
}

/// What an answer says of its request's decision: the deny reason of a
/// refusal by the rules (`-32003`), or `None` (the server answered,
/// whatever it answered).
pub fn decided(answer: &Value) -> Option<String> {
    (answer["error"]["code"] == serde_json::json!(-32003)).then(|| {
        answer["error"]["data"]["reason"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    })
}
