//! `egress-executor mcp --tool T`, the stdio bridge: the built binary in
//! front of a confined `mcp-server-time` (the real proxy deciding), spoken
//! to by the official Python SDK's stdio client (a listed tool answers, the
//! other is refused with `mcp_tool_not_allowed`; stdin's end ends the
//! session) and line by line (a garbage or oversized line gets a parse
//! error and the bridge goes on; SIGTERM ends the session), also found
//! through the config file (its address and token file); in front of a
//! stand-in endpoint, where a stream of 8 KiB messages and 50 concurrent
//! answers (pretty-printed) all come out as whole lines and stdin's end
//! sends the `DELETE`; and in front of no executor at all, where each
//! request gets a JSON-RPC error line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, marked_processes, python, TempDir};
use egress_e2e::harness::TOKEN;
use egress_e2e::mcp::{serve, servers, time_tool};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

const BRIDGE: &str = env!("CARGO_BIN_EXE_egress-executor");

fn bridge_args(addr: SocketAddr) -> Vec<String> {
    ["mcp", "--tool", "time", "--executor", &format!("http://{addr}")]
        .map(str::to_owned)
        .to_vec()
}

/// The official SDK's stdio client starting the bridge, doing `steps`.
async fn sdk_stdio(addr: SocketAddr, steps: Value) -> Value {
    let script = egress_e2e::process::repo_root().join("tests/python/mcp_sdk_client.py");
    let mut command = vec![BRIDGE.to_owned()];
    command.extend(bridge_args(addr));
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .args(["stdio", &json!(command).to_string(), &steps.to_string()])
            .env("EGRESS_CONTROL_TOKEN", TOKEN)
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

/// The bridge driven line by line: its stdin, and its stdout's lines.
struct Bridge {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Bridge {
    /// The bridge with `args`, given the token in `EGRESS_CONTROL_TOKEN`
    /// (else none: it finds the token file).
    fn start(args: &[String], token_env: bool) -> Bridge {
        let mut cmd = Command::new(BRIDGE);
        match token_env {
            true => cmd.env("EGRESS_CONTROL_TOKEN", TOKEN),
            false => cmd.env_remove("EGRESS_CONTROL_TOKEN"),
        };
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                if tx.send(l.unwrap()).is_err() {
                    return;
                }
            }
        });
        Bridge {
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    fn send(&mut self, line: &[u8]) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(line).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// The next line of stdout, as JSON (within 60 s).
    async fn next(&self) -> Value {
        let l = tokio::task::block_in_place(|| self.lines.recv_timeout(Duration::from_secs(60)))
            .expect("a line from the bridge");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("not one line of JSON ({e}): {l}"))
    }

    /// Waits for the bridge's exit (within 20 s): its status.
    async fn exit(mut self) -> std::process::ExitStatus {
        drop(self.stdin.take());
        for _ in 0..200 {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = self.child.kill();
        panic!("the bridge did not exit");
    }
}

fn initialize(id: u64) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "bridge-test", "version": "0"}}})
    .to_string()
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_serves_a_confined_server_to_a_stdio_client() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let venv = servers();
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-bridge");
    let marker = "loom-mcp-bridge-session";
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &time_tool(&venv, marker, ""));
    exec.warm_up();
    let sessions = exec.sessions("time").unwrap().clone();
    assert!(eventually(Duration::from_secs(60), || sessions.live() == 1).await);
    let addr = serve(&exec).await;

    // The official SDK's stdio client, through the bridge.
    let out = sdk_stdio(
        addr,
        json!([
            ["list"],
            ["call", "get_current_time", {"timezone": "Etc/UTC"}],
            ["call", "convert_time", {"source_timezone": "Etc/UTC", "time": "12:00", "target_timezone": "Europe/Paris"}]
        ]),
    )
    .await;
    assert_eq!(out["server"], json!("mcp-time"), "{out:#}");
    let steps = out["steps"].as_array().unwrap();
    assert_eq!(steps[0]["tools"], json!(["get_current_time"]), "{out:#}");
    assert_eq!(steps[1]["ok"], json!(true), "{out:#}");
    assert!(steps[1]["text"].as_str().unwrap().contains("Etc/UTC"), "{out:#}");
    assert_eq!(steps[2]["code"], json!(-32003), "{out:#}");
    assert_eq!(steps[2]["data"]["reason"], json!("mcp_tool_not_allowed"), "{out:#}");
    // The client closed the bridge's stdin: the session is ended.
    assert!(eventually(Duration::from_secs(20), || sessions.count() == 0).await);
    assert!(eventually(Duration::from_secs(60), || sessions.live() == 1).await);

    // Line by line: garbage and an oversized line get parse errors, the
    // bridge goes on; a list is answered; SIGTERM ends the session.
    let mut b = Bridge::start(&bridge_args(addr), true);
    b.send(b"this is not JSON");
    let e = b.next().await;
    assert_eq!((&e["id"], &e["error"]["code"]), (&Value::Null, &json!(-32700)), "{e}");
    b.send(&vec![b' '; (4 << 20) + 1]);
    let e = b.next().await;
    assert_eq!((&e["id"], &e["error"]["code"]), (&Value::Null, &json!(-32700)), "{e}");
    b.send(&initialize(1));
    let init = b.next().await;
    assert_eq!(init["id"], json!(1), "{init}");
    assert_eq!(init["result"]["serverInfo"]["name"], json!("mcp-time"), "{init}");
    assert_eq!(sessions.count(), 1);
    b.send(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    b.send(br#"[{"jsonrpc":"2.0","id":"a","method":"tools/list"},{"jsonrpc":"2.0","id":"b","method":"ping"}]"#);
    let batch = b.next().await;
    let batch = batch.as_array().unwrap_or_else(|| panic!("a batch answer: {batch}"));
    assert_eq!(batch.len(), 2);
    let list = batch.iter().find(|a| a["id"] == json!("a")).unwrap();
    assert_eq!(list["result"]["tools"].as_array().unwrap().len(), 1, "{list}");
    let pid = b.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(eventually(Duration::from_secs(20), || sessions.count() == 0).await);
    let status = b.exit().await;
    assert!(status.success(), "{status}");

    // With --config: the address from [executor] listen, the token from
    // the file in the proxy's home; a tool that is not a session tool is
    // refused at start.
    let egress = std::fs::read_to_string(dir.path().join("egress.toml")).unwrap();
    let listen = "[executor]\nlisten = \"127.0.0.1:0\"";
    assert!(egress.contains(listen));
    let file = dir.write(
        "bridge.toml",
        &egress.replace(listen, &format!("[executor]\nlisten = \"{addr}\"")),
    );
    dir.write("var/egress-control.token", &format!("{TOKEN}\n"));
    let file = file.display().to_string();
    assert!(eventually(Duration::from_secs(60), || sessions.live() == 1).await);
    let mut b = Bridge::start(&["mcp", "--config", &file, "--tool", "time"].map(str::to_owned), false);
    b.send(&initialize(2));
    let init = b.next().await;
    assert_eq!(init["result"]["serverInfo"]["name"], json!("mcp-time"), "{init}");
    assert_eq!(sessions.count(), 1);
    let status = b.exit().await;
    assert!(status.success(), "{status}");
    assert!(eventually(Duration::from_secs(20), || sessions.count() == 0).await);
    let out = Command::new(BRIDGE)
        .args(["mcp", "--config", &file, "--tool", "nope"])
        .env_remove("EGRESS_CONTROL_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`nope` is not a session tool"), "{err}");

    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    assert!(marked_processes(marker).is_empty(), "nothing of the trees is left");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_executor_each_request_gets_an_error_line() {
    // A port nothing listens on.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut b = Bridge::start(&bridge_args(addr), true);
    b.send(&initialize(7));
    let e = b.next().await;
    assert_eq!((&e["id"], &e["error"]["code"]), (&json!(7), &json!(-32603)), "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot reach the executor"),
        "{e}"
    );
    // A notification has nothing to answer; the next request is answered.
    b.send(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    b.send(&initialize(8));
    assert_eq!(b.next().await["id"], json!(8));
    let status = b.exit().await;
    assert!(status.success(), "{status}");
}

/// A stand-in for the executor's endpoint: `initialize` opens session `s1`,
/// any other request is answered pretty-printed (several lines), the
/// stream sends `events` notifications of 8 KiB each, `DELETE`s are counted.
async fn fake_endpoint(events: usize) -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let deleted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let d = deleted.clone();
    let post = |headers: HeaderMap, body: String| async move {
        let m: Value = serde_json::from_str(&body).unwrap();
        if m["method"] == json!("initialize") {
            assert!(headers.get("mcp-session-id").is_none());
            let r = json!({"jsonrpc": "2.0", "id": m["id"], "result": {"serverInfo": {"name": "fake"}}});
            return ([("mcp-session-id", "s1")], r.to_string()).into_response();
        }
        assert_eq!(headers.get("mcp-session-id").unwrap(), "s1");
        if m.get("id").is_none() {
            return StatusCode::ACCEPTED.into_response();
        }
        let r = json!({"jsonrpc": "2.0", "id": m["id"], "result": {"echo": m["params"]}});
        serde_json::to_string_pretty(&r).unwrap().into_response()
    };
    let get = move |headers: HeaderMap| async move {
        assert_eq!(headers.get("mcp-session-id").unwrap(), "s1");
        let frames = (0..events).map(|i| {
            let n = json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"i": i, "pad": "x".repeat(8 << 10)}});
            Ok::<_, std::convert::Infallible>(format!("event: message\ndata: {n}\n\n"))
        });
        (
            [("content-type", "text/event-stream")],
            axum::body::Body::from_stream(futures_util::stream::iter(frames)),
        )
    };
    let delete = move |headers: HeaderMap| async move {
        let id = headers.get("mcp-session-id").unwrap().to_str().unwrap().to_owned();
        d.lock().unwrap().push(id);
        StatusCode::NO_CONTENT
    };
    let app = axum::Router::new().route("/v1/mcp/time", axum::routing::post(post).get(get).delete(delete));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, deleted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_and_the_answers_are_whole_lines_and_stdin_end_deletes() {
    let events = 300;
    let (addr, deleted) = fake_endpoint(events).await;
    let mut b = Bridge::start(&bridge_args(addr), true);
    b.send(&initialize(0));
    assert_eq!(b.next().await["result"]["serverInfo"]["name"], json!("fake"));
    let calls = 50;
    for i in 1..=calls {
        b.send(
            json!({"jsonrpc": "2.0", "id": i, "method": "ping", "params": {"i": i}})
                .to_string()
                .as_bytes(),
        );
    }
    b.send(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    // Every line is whole JSON (`next` parses it): each answer once, each
    // of the stream's messages once, in the stream's order.
    let (mut answers, mut streamed) = (std::collections::BTreeSet::new(), Vec::new());
    while answers.len() < calls as usize || streamed.len() < events {
        let l = b.next().await;
        match l.get("id") {
            Some(id) => {
                assert_eq!(l["result"]["echo"]["i"], *id, "{l}");
                assert!(answers.insert(id.as_u64().unwrap()));
            }
            None => streamed.push(l["params"]["i"].as_u64().unwrap()),
        }
    }
    assert_eq!(streamed, (0..events as u64).collect::<Vec<_>>());
    let status = b.exit().await;
    assert!(status.success(), "{status}");
    assert_eq!(*deleted.lock().unwrap(), vec!["s1".to_owned()]);
}
