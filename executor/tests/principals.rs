//! Scoped principals at the executor's API, beside the real proxy, both
//! reading one principals file: kernel A cannot invoke a tool outside its
//! globs (403), and what it invokes is attributed to it end to end: its
//! child's run is activated for A, so the denial the tool meets is a fact
//! of A's, which B cannot read. B cannot see, look up or abort A's
//! invocations, nor get A's answer by reusing A's idempotency key (409),
//! nor use A's MCP session; a token the file does not hold is 401. Real
//! proxy binary, Python runner, loopback only.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use egress_config::principals::token_hash;
use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, python, python_runner, strongest_isolation, TempDir};
use egress_e2e::harness::control_call;
use egress_e2e::mcp::{endpoint_as, serve};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

const A: &str = "kernel-a-token-0123456789abcdef";
const B: &str = "kernel-b-token-0123456789abcdef";

const FETCH_PY: &str = r#"
import time, urllib.request, urllib.error

def run(input, ctx):
    time.sleep((input or {}).get("sleep", 0))
    try:
        urllib.request.urlopen("http://denied.test/", timeout=10)
        return {"status": 200}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "reason": e.headers.get("X-Egress-Deny-Reason")}
"#;

/// The principals file `text` in `dir`, private as the services require.
fn principals_file(dir: &TempDir, text: &str) -> std::path::PathBuf {
    let p = dir.write("principals.toml", text);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// `[tools.search]`: the fetching tool under the Python runner, one warm child.
fn search_tool() -> String {
    format!(
        "[tools.search]\negress = []\n[tools.search.process]\ncommand = [\"python3\", \"{}\", \"fetch.py\"]\npool = {{ warm = 1, max = 2 }}\ntimeout_ms = 20000\n",
        python_runner().display()
    )
}

fn body(r: &egress_e2e::raw::RawResponse) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kernel_invokes_sees_and_aborts_only_its_own() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("principals");
    dir.write("fetch.py", FETCH_PY);
    let principals = principals_file(
        &dir,
        &format!(
            "[principals.kernel-a]\ntokens = [\"{}\"]\nscopes = [\"invoke:search*\", \"facts:own\"]\n\n\
             [principals.kernel-b]\ntokens = [\"{}\"]\nscopes = [\"invoke:search*\", \"facts:own\"]\n",
            token_hash(A),
            token_hash(B)
        ),
    );
    let hostile = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hostile_mcp.py");
    let tools = format!(
        r#"
[control]
principals_file = "{principals}"

{search}
[tools.shell]
egress = []
[tools.shell.process]
command = ["python3", "{runner}", "fetch.py"]
pool = {{ warm = 0, max = 1 }}

[tools.search-mcp]
egress = []
[tools.search-mcp.process]
command = ["python3", "{hostile}", "good"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
cold_start_ms = 20000
timeout_ms = 5000
pool = {{ warm = 0, max = 2 }}
"#,
        principals = principals.display(),
        search = search_tool(),
        runner = python_runner().display(),
        hostile = hostile.display(),
        iso = strongest_isolation(),
    );
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &tools);
    exec.warm_up();
    let pool = exec.pool("search").unwrap().clone();
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);
    let addr = serve(&exec).await;
    let invoke = |token: &'static str, tool: &str, key: &str| {
        let body = json!({"tool": tool, "input": null, "idempotency_key": key});
        async move { control_call(addr, "POST", "/v1/invocations", Some(body), Some(token)).await }
    };

    // A tool outside A's globs; a token nobody holds.
    let r = invoke(A, "shell", "a-shell").await;
    assert_eq!(
        (r.status, body(&r)["error"]["code"].clone()),
        (403, json!("scope")),
        "{}",
        r.text()
    );
    let r = invoke("nobody-0123456789abcdef01234", "search", "x").await;
    assert_eq!(r.status, 401);

    // A's invocation: its run is A's, so is the fact of the denial it met.
    let r = invoke(A, "search", "a-1").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let a = body(&r);
    assert_eq!(a["output"]["status"], json!(403), "{a}");
    let run_id = a["run_id"].as_str().unwrap().to_owned();
    let fact = a["facts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["reason"] == "not_allowlisted")
        .cloned()
        .expect("the denial's fact");
    assert_eq!(fact["principal"], json!("kernel-a"), "{fact}");
    let facts_as = |token: &'static str| async move {
        let r = control_call(control, "GET", "/v1/facts?after=0&limit=1000", None, Some(token)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        body(&r)["facts"].as_array().unwrap().clone()
    };
    assert!(facts_as(A).await.iter().any(|f| f["run_id"] == json!(run_id)));
    assert!(facts_as(B).await.iter().all(|f| f["run_id"] != json!(run_id)));

    // B: not A's answer by its key, not in B's list, not found, not abortable.
    let r = invoke(B, "search", "a-1").await;
    assert_eq!(r.status, 409, "{}", r.text());
    let inv = a["invocation_id"].as_str().unwrap();
    let r = control_call(addr, "GET", "/v1/invocations", None, Some(B)).await;
    assert!(!r.text().contains(inv), "{}", r.text());
    let r = control_call(addr, "GET", "/v1/invocations", None, Some(A)).await;
    assert!(r.text().contains(inv), "{}", r.text());
    for id in [inv, "a-1", run_id.as_str()] {
        let r = control_call(addr, "GET", &format!("/v1/invocations/{id}"), None, Some(B)).await;
        assert_eq!(r.status, 404, "{id}: {}", r.text());
        let r = control_call(addr, "GET", &format!("/v1/invocations/{id}"), None, Some(A)).await;
        assert_eq!(r.status, 200, "{id}: {}", r.text());
    }

    // Another kernel cannot abort A's invocation in flight.
    let slow = json!({"tool": "search", "input": {"sleep": 2}, "idempotency_key": "a-slow"});
    let running = tokio::spawn(async move { control_call(addr, "POST", "/v1/invocations", Some(slow), Some(A)).await });
    assert!(
        eventually(Duration::from_secs(10), || exec
            .invocations(None, Some("running"), None, None, 10, &|_| true)
            .0
            .iter()
            .any(|i| i.idempotency_key.as_deref() == Some("a-slow")))
        .await
    );
    let r = control_call(addr, "POST", "/v1/invocations/a-slow/abort", None, Some(B)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = running.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(body(&r)["ok"], json!(true), "not aborted: {}", r.text());

    // MCP: A's session is A's alone.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let (status, session, v) = endpoint_as(addr, A, "search-mcp", "POST", None, Some(init)).await;
    assert_eq!(status, 200, "{v}");
    let session = session.unwrap();
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    let (status, _, v) = endpoint_as(addr, B, "search-mcp", "POST", Some(&session), Some(list.clone())).await;
    assert_eq!(status, 404, "{v}");
    let (status, _, _) = endpoint_as(addr, B, "search-mcp", "DELETE", Some(&session), None).await;
    assert_eq!(status, 404);
    let (status, _, v) = endpoint_as(addr, A, "search-mcp", "POST", Some(&session), Some(list)).await;
    assert_eq!(status, 200, "{v}");
    let (status, _, _) = endpoint_as(addr, A, "search-mcp", "DELETE", Some(&session), None).await;
    assert_eq!(status, 204);
    drop(proxy);
}

/// `[control.tls]` end to end: the proxy's control listener and the
/// executor's both serve TLS with client certificates; the executor's own
/// client reaches the proxy over it (its pool warms, its runs are created
/// and activated); a kernel whose certificate names it invokes with no
/// token, and its run is its own at the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_certificate_invokes_over_tls_end_to_end() {
    use egress_e2e::pki::{https_call, Ca};
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("control-tls");
    dir.write("fetch.py", FETCH_PY);
    let d = dir.write("pki/.keep", "");
    let d = d.parent().unwrap();
    let ca = Ca::new("control CA");
    let ca_file = ca.write(d, "ca.pem");
    let server = ca.leaf(d, "server", "control", &["127.0.0.1"]);
    let kernel = ca.leaf(d, "kernel-a", "kernel-a", &["kernel-a.kernels.test"]);
    let principals = principals_file(
        &dir,
        "[principals.kernel-a]\nsubjects = [\"kernel-a.kernels.test\"]\nscopes = [\"invoke:search\", \"facts:own\"]\n",
    );
    let tools = format!(
        r#"
[control]
principals_file = "{principals}"
[control.tls]
cert = "{cert}"
key = "{key}"
client_ca = "{ca}"

{search}"#,
        principals = principals.display(),
        cert = server.cert.display(),
        key = server.key.display(),
        ca = ca_file.display(),
        search = search_tool(),
    );
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &tools);
    exec.warm_up();
    let pool = exec.pool("search").unwrap().clone();
    assert!(
        eventually(Duration::from_secs(30), || pool.counts().0 == 1).await,
        "the executor's client creates its warm child's run over TLS"
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let tls = exec.control_tls().unwrap().clone();
    let app = egress_executor::api::router(exec.clone());
    let serving = stop.clone();
    tokio::spawn(async move { egress_executor::api::serve_tls(listener, app, &tls, serving).await });
    let body = json!({"tool": "search", "input": null});
    let r = https_call(
        addr,
        &ca_file,
        Some(&kernel),
        "POST",
        "/v1/invocations",
        Some(body.clone()),
        None,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = body_of(&r);
    let fact = v["facts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["reason"] == "not_allowlisted")
        .cloned()
        .expect("the denial's fact");
    assert_eq!(fact["principal"], json!("kernel-a"), "{fact}");
    // The same kernel at the proxy, by its certificate: its facts.
    let r = https_call(control, &ca_file, Some(&kernel), "GET", "/v1/facts?after=0", None, None)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains(v["run_id"].as_str().unwrap()), "{}", r.text());
    // Without a certificate or a token: 401.
    let r = https_call(addr, &ca_file, None, "POST", "/v1/invocations", Some(body), None)
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    stop.cancel();
    drop(proxy);
}

fn body_of(r: &egress_e2e::raw::RawResponse) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}
