//! The proxy as an operated daemon, run as a real process where it matters:
//! durable facts across `kill -9`, SIGTERM drain, SIGHUP and API reload, the
//! `check` command (and the executor's, on the same file), the embedded default, TLS on both listeners, exact
//! metric deltas, the live fact stream and structured logs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, control_call, sample, TestProxy, TOKEN};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::process::{bin, free_addr, socket_activated, write_config, KillOnDrop, ProxyProcess};
use egress_e2e::raw::{read_response, send};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn addrs() -> (SocketAddr, SocketAddr) {
    (free_addr(), free_addr())
}

async fn create_run(control: SocketAddr, tool: &str) -> (String, String) {
    egress_e2e::harness::create_run_at(control, tool).await
}

async fn all_facts(control: SocketAddr) -> Vec<Value> {
    egress_e2e::harness::all_facts_at(control).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_denials_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = addrs();
    let cfg = write_config(
        dir.path(),
        proxy,
        control,
        "[tools.web]\negress = [\"allowed.test:443\"]\n",
    );
    let mut p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let (id, secret) = create_run(control, "web").await;
    let auth = Arc::new(basic(&id, &secret));
    // 8 clients deny in a loop, varying the target so not everything coalesces.
    let answered = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let mut clients = vec![];
    for c in 0..8 {
        let (auth, answered) = (auth.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            for i in 0.. {
                let req = format!(
                    "CONNECT evil{c}-{}.test:443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {auth}\r\n\r\n",
                    i % 7
                );
                let Ok(mut s) = TcpStream::connect(proxy).await else {
                    return;
                };
                if s.write_all(req.as_bytes()).await.is_err() {
                    return;
                }
                let Ok(r) = read_response(&mut s, true).await else {
                    return;
                };
                if r.status != 403 {
                    return;
                }
                let id = r.header("x-egress-fact-id").unwrap().to_owned();
                answered.lock().unwrap().insert(id);
            }
        }));
    }
    // Let denials flow, then kill -9 in the middle of the flood.
    let t0 = std::time::Instant::now();
    while answered.lock().unwrap().len() < 200 && t0.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.signal("KILL");
    assert_eq!(p.wait_exit(Duration::from_secs(5)), None, "killed by a signal");
    for c in clients {
        c.await.unwrap();
    }
    let answered = answered.lock().unwrap().clone();
    assert!(
        answered.len() >= 50,
        "too few denials answered before the kill: {}",
        answered.len()
    );

    let p2 = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let facts = all_facts(control).await;
    let stored_ids: BTreeSet<String> = facts.iter().map(|f| f["id"].as_str().unwrap().to_owned()).collect();
    let missing: Vec<_> = answered.difference(&stored_ids).collect();
    assert!(missing.is_empty(), "answered denials lost by kill -9: {missing:?}");
    let stored: BTreeSet<u64> = facts.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    let max = *stored.iter().max().unwrap();
    assert_eq!(stored.len() as u64, max, "seq has gaps");
    // seq continues after the restart.
    let (id2, secret2) = create_run(control, "web").await;
    let r = send(
        proxy,
        format!(
            "CONNECT evil.test:443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {}\r\n\r\n",
            basic(&id2, &secret2)
        )
        .as_bytes(),
    )
    .await;
    let id = r.header("x-egress-fact-id").unwrap();
    let facts = all_facts(control).await;
    let last = facts.last().unwrap();
    assert_eq!((last["id"].as_str(), last["seq"].as_u64()), (Some(id), Some(max + 1)));
    drop(p2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_fetches_then_exits_0() {
    let origin = http_origin("127.0.0.2:0").await;
    let dns = egress_e2e::FakeDns::start().await;
    dns.set("allowed.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = addrs();
    let cfg = dir.path().join("egress.toml");
    let port = origin.addr.port();
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\nallow_ranges = [\"127.0.0.2/32\"]\ndrain_timeout_ms = 5000\n[proxy.dns]\nservers = [\"{}\"]\n[tools.web]\negress = [\"allowed.test:{port}\"]\n",
            dns.addr
        ),
    )
    .unwrap();
    let mut p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let (id, secret) = create_run(control, "web").await;
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let req = format!(
        "GET http://allowed.test:{port}/slow-head?ms=700 HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {}\r\n\r\n",
        basic(&id, &secret)
    );
    s.write_all(req.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.signal("TERM");
    let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut s, false))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (200, "slow head"),
        "the in-flight fetch completed"
    );
    assert_eq!(p.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(
        TcpStream::connect(proxy).await.is_err(),
        "still accepting after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_policy_and_rejects_a_broken_file() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = addrs();
    let cfg = dir.path().join("egress.toml");
    let base = format!("[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n");
    std::fs::write(&cfg, format!("{base}[tools.web]\negress = [\"a.test:443\"]\n")).unwrap();
    let p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let (id, secret) = create_run(control, "web").await;
    let auth = basic(&id, &secret);
    let deny = |target: &'static str| {
        let auth = auth.clone();
        async move {
            send(
                proxy,
                format!("CONNECT {target} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {auth}\r\n\r\n").as_bytes(),
            )
            .await
        }
    };
    assert_eq!(deny("b.test:443").await.deny_reason(), Some("not_allowlisted"));
    let before = all_facts(control).await;
    let digest1 = before[0]["policy"].as_str().unwrap().to_owned();

    // A broken file is rejected; the old policy stays in force.
    std::fs::write(&cfg, format!("{base}[tools.web]\negress = [\"*:443\"]\n")).unwrap();
    p.signal("HUP");
    let t0 = std::time::Instant::now();
    while !p.logs().contains("policy reload rejected") {
        assert!(t0.elapsed() < Duration::from_secs(5), "{}", p.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        p.logs().contains("tools.web.egress[0]"),
        "the error names the key path: {}",
        p.logs()
    );
    let r = deny("b.test:443").await;
    assert_eq!(r.deny_reason(), Some("not_allowlisted"));

    // A good file applies to new fetches (b.test now passes the allowlist and
    // fails on DNS instead), and facts carry the new digest.
    std::fs::write(&cfg, format!("{base}[tools.web]\negress = [\"b.test:443\"]\n")).unwrap();
    p.signal("HUP");
    let t0 = std::time::Instant::now();
    while !p.logs().contains("policy reloaded") {
        assert!(t0.elapsed() < Duration::from_secs(5), "{}", p.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(deny("a.test:443").await.deny_reason(), Some("not_allowlisted"));
    let after = all_facts(control).await;
    let digest2 = after.last().unwrap()["policy"].as_str().unwrap().to_owned();
    assert_ne!(digest1, digest2);
}

#[tokio::test]
async fn reload_over_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let dns = egress_e2e::FakeDns::start().await;
    let cfg_path = dir.path().join("egress.toml");
    let section = egress_e2e::harness::proxy_section(&dns, "");
    std::fs::write(&cfg_path, format!("{section}[tools.web]\negress = [\"a.test:443\"]\n")).unwrap();
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    let sink = Arc::new(egress_proxy::facts::MemorySink::new(100));
    let p = TestProxy::start_config(dns, &text, Some(cfg_path.clone()), Some(sink)).await;
    std::fs::write(&cfg_path, format!("{section}[tools.web]\negress = [\"a.test\"]\n")).unwrap();
    let r = control_call(p.control, "POST", "/v1/policy/reload", None, Some(TOKEN)).await;
    assert_eq!(r.status, 422, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_config");
    assert_eq!(v["error"]["problems"][0]["path"], "tools.web.egress[0]");
    std::fs::write(
        &cfg_path,
        format!("{section}[tools.web]\negress = [\"b.test:443\"]\n[tools.new]\negress = []\n"),
    )
    .unwrap();
    let r = control_call(p.control, "POST", "/v1/policy/reload", None, Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["tools"], json!(["new", "web"]));
    let r = control_call(p.control, "POST", "/v1/runs", Some(json!({"tool": "new"})), Some(TOKEN)).await;
    assert_eq!(r.status, 201);
    p.shutdown().await;
}

/// Both binaries' `check` read the one schema: every problem of every
/// section (the proxy's, the tools', the executor's), each on its own line
/// with its key path, exit 1; a valid file passes both.
#[test]
fn check_validates_the_whole_file_in_both_binaries() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("egress.toml");
    let check = |name: &str| {
        let out = Command::new(bin(name))
            .args(["check", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    std::fs::write(
        &cfg,
        "[proxy]\nmax_runs = \"many\"\n[tools.web]\negress = [\"a.test:443\"]\n[tools.web.process]\ncommand = [\"true\"]\nisolation = \"tight\"\n[executor]\nlisen = \"127.0.0.1:1\"\nchild_uid = 0\n",
    )
    .unwrap();
    let file = cfg.display().to_string();
    let want = [
        format!("{file}: proxy.max_runs: invalid type: string \"many\", expected u64"),
        format!("{file}: tools.web.process.isolation: \"tight\" is not one of \"strict\", \"best_effort\", \"off\""),
        format!("{file}: executor.child_uid: must not be 0 (root)"),
        format!("{file}: executor.lisen: unknown key"),
    ];
    for name in ["egress-proxy", "egress-executor"] {
        let (code, text) = check(name);
        assert_eq!(code, Some(1), "{name}: {text}");
        for line in &want {
            assert!(
                text.lines().any(|l| l.starts_with(line.as_str())),
                "{name} did not report {line:?}:\n{text}"
            );
        }
    }
    std::fs::write(
        &cfg,
        "[tools.web]\negress = [\"a.test:443\"]\n[tools.web.process]\ncommand = [\"true\"]\n",
    )
    .unwrap();
    for name in ["egress-proxy", "egress-executor"] {
        let (code, text) = check(name);
        assert_eq!(code, Some(0), "{name}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_runs_and_denies_everything() {
    let dir = tempfile::tempdir().unwrap();
    // The embedded default listens on 127.0.0.1:3128/3129; skip if those are taken here.
    if std::net::TcpListener::bind("127.0.0.1:3128").is_err() || std::net::TcpListener::bind("127.0.0.1:3129").is_err()
    {
        eprintln!("ports 3128/3129 busy; skipping");
        return;
    }
    let log = dir.path().join("log");
    let mut child = Command::new(bin("egress-proxy"))
        .arg("serve")
        .current_dir(dir.path())
        .env_remove("EGRESS_CONTROL_TOKEN")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let control: SocketAddr = "127.0.0.1:3129".parse().unwrap();
    let t0 = std::time::Instant::now();
    let token_file = dir.path().join("var/egress-control.token");
    while !token_file.exists() || TcpStream::connect(control).await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let token = std::fs::read_to_string(&token_file).unwrap().trim().to_owned();
    let r = control_call(
        control,
        "POST",
        "/v1/runs",
        Some(json!({"tool": "anything"})),
        Some(&token),
    )
    .await;
    assert_eq!(r.status, 404, "no tools in the default config");
    let r = send(
        "127.0.0.1:3128".parse().unwrap(),
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, 407);
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(logs.contains("embedded default"), "{logs}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_both_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let extra = format!(
        "[proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        cert.display(),
        key.display()
    );
    let dns = egress_e2e::FakeDns::start().await;
    dns.set("allowed.test", &["127.0.0.2"]);
    let text = format!(
        "{}{extra}[tools.web]\negress = [\"allowed.test:{port}\"]\n",
        egress_e2e::harness::proxy_section(&dns, "")
    );
    let sink = Arc::new(egress_proxy::facts::MemorySink::new(100));
    let p = TestProxy::start_config(dns, &text, None, Some(sink)).await;
    let control = format!("https://127.0.0.1:{}", p.control.port());
    let cacert = cert.display().to_string();
    let out = tokio::task::block_in_place(|| {
        Command::new("curl")
            .args([
                "-sS",
                "-m",
                "10",
                "--cacert",
                &cacert,
                "-H",
                &format!("Authorization: Bearer {TOKEN}"),
            ])
            .args([
                "-H",
                "content-type: application/json",
                "-d",
                "{\"tool\":\"web\"}",
                &format!("{control}/v1/runs"),
            ])
            .output()
            .unwrap()
    });
    let v: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    let url = v["proxy_url"].as_str().unwrap().to_owned();
    assert!(url.starts_with("https://"), "{url}");
    let target = format!("http://allowed.test:{port}/");
    let run = |extra: &[&str]| {
        let mut c = Command::new("curl");
        c.args(["-sS", "-m", "10", "--proxy-cacert", &cacert, "-x", &url])
            .args(extra)
            .arg(&target);
        c.output().unwrap()
    };
    let plain = tokio::task::block_in_place(|| run(&[]));
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout),
        "hello from origin",
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    let tunnel = tokio::task::block_in_place(|| run(&["-p"]));
    assert_eq!(
        String::from_utf8_lossy(&tunnel.stdout),
        "hello from origin",
        "{}",
        String::from_utf8_lossy(&tunnel.stderr)
    );
    // A run bound to its sandbox's handed-over listener: its credential is
    // refused on the TLS listener as on the plain one.
    let bound = tokio::task::block_in_place(|| {
        Command::new("curl")
            .args(["-sS", "-m", "10", "--cacert", &cacert])
            .args(["-H", &format!("Authorization: Bearer {TOKEN}")])
            .args(["-H", "content-type: application/json"])
            .args(["-d", "{\"tool\":\"web\",\"bound\":true}", &format!("{control}/v1/runs")])
            .output()
            .unwrap()
    });
    let v: Value = serde_json::from_slice(&bound.stdout).unwrap();
    let bound_url = v["proxy_url"].as_str().unwrap().to_owned();
    let refused = tokio::task::block_in_place(|| {
        Command::new("curl")
            .args(["-sS", "-m", "10", "--proxy-cacert", &cacert, "-x", &bound_url])
            .args(["-o", "/dev/null", "-D", "-", &target])
            .output()
            .unwrap()
    });
    let head = String::from_utf8_lossy(&refused.stdout).to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 407") && head.contains("x-egress-deny-reason: credential_elsewhere"),
        "{head}"
    );
    // Plain HTTP to a TLS listener gets nothing useful.
    let plain_to_tls = tokio::task::block_in_place(|| {
        Command::new("curl")
            .args(["-sS", "-m", "5", "-x", &url.replace("https://", "http://"), &target])
            .output()
            .unwrap()
    });
    assert_ne!(String::from_utf8_lossy(&plain_to_tls.stdout), "hello from origin");
    p.shutdown().await;
}

#[tokio::test]
async fn metrics_move_by_exactly_what_happened() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let origin = http_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"allowed.test:{}\", \"allowed.test:{}\"]\n[tools.other]\negress = []\n",
        echo.port(),
        origin.addr.port()
    ))
    .await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let before = p.metrics().await;
    let run = p.run("web").await;
    // 3 allowed plain fetches, 2 allowed tunnels, 4 not_allowlisted, 1 ip_literal, 2 auth failures.
    for _ in 0..3 {
        let r = p
            .get(
                &run,
                &format!("http://allowed.test:{}/bytes?n=1000", origin.addr.port()),
                "",
            )
            .await;
        assert_eq!(r.status, 200);
    }
    for _ in 0..2 {
        let (r, mut s) = p.connect(&run, &format!("allowed.test:{}", echo.port())).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            egress_e2e::raw::echo_through(&mut s, b"0123456789").await,
            b"0123456789"
        );
        s.shutdown().await.unwrap();
        egress_e2e::raw::wait_closed(&mut s, Duration::from_secs(5))
            .await
            .unwrap();
    }
    for _ in 0..4 {
        assert_eq!(
            p.get(&run, "http://evil.test/", "").await.deny_reason(),
            Some("not_allowlisted")
        );
    }
    assert_eq!(
        p.connect(&run, "10.0.0.1:443").await.0.deny_reason(),
        Some("ip_literal")
    );
    send(p.proxy, b"CONNECT x.test:443 HTTP/1.1\r\nHost: x\r\n\r\n").await;
    send(
        p.proxy,
        format!(
            "CONNECT x.test:443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {}\r\n\r\n",
            basic(&run.id, "bad")
        )
        .as_bytes(),
    )
    .await;
    p.wait_slots(&run, 0).await;
    // Tunnel metrics are recorded when the tunnel task ends; wait for the open gauge to fall.
    let t0 = std::time::Instant::now();
    let after = loop {
        let m = p.metrics().await;
        if sample(&m, "egress_open_connections{tool=\"web\",kind=\"connect\"}") == 0.0 {
            break m;
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let d = |s: &str| sample(&after, s) - sample(&before, s);
    assert_eq!(
        d("egress_requests_total{tool=\"web\",kind=\"http\",decision=\"allowed\"}"),
        3.0
    );
    assert_eq!(
        d("egress_requests_total{tool=\"web\",kind=\"connect\",decision=\"allowed\"}"),
        2.0
    );
    assert_eq!(
        d("egress_requests_total{tool=\"web\",kind=\"http\",decision=\"denied\"}"),
        4.0
    );
    assert_eq!(
        d("egress_requests_total{tool=\"web\",kind=\"connect\",decision=\"denied\"}"),
        2.0,
        "ip_literal + wrong secret"
    );
    assert_eq!(d("egress_denials_total{tool=\"web\",reason=\"not_allowlisted\"}"), 4.0);
    assert_eq!(d("egress_denials_total{tool=\"web\",reason=\"ip_literal\"}"), 1.0);
    assert_eq!(d("egress_denials_total{tool=\"web\",reason=\"auth_invalid\"}"), 1.0);
    assert_eq!(
        d("egress_denials_total{tool=\"_unknown\",reason=\"auth_missing\"}"),
        1.0
    );
    assert_eq!(d("egress_auth_failures_total{reason=\"auth_missing\"}"), 1.0);
    assert_eq!(d("egress_auth_failures_total{reason=\"auth_invalid\"}"), 1.0);
    // Up: the 3 forwarded request heads (start line, Host, blank line; the
    // proxy's hop-by-hop headers are not forwarded) plus the tunnel bytes.
    let head = format!(
        "GET /bytes?n=1000 HTTP/1.1\r\nhost: allowed.test:{}\r\n\r\n",
        origin.addr.port()
    );
    assert_eq!(
        d("egress_bytes_total{tool=\"web\",direction=\"up\"}"),
        (3 * head.len() + 20) as f64,
        "request heads and tunnel bytes client→origin"
    );
    assert!(d("egress_bytes_total{tool=\"web\",direction=\"down\"}") >= 3000.0 + 20.0);
    assert_eq!(
        d("egress_fetch_duration_seconds_count{tool=\"web\",kind=\"http\",outcome=\"ok\"}"),
        3.0
    );
    assert_eq!(
        d("egress_fetch_duration_seconds_count{tool=\"web\",kind=\"connect\",outcome=\"ok\"}"),
        2.0
    );
    assert_eq!(d("egress_dns_lookup_duration_seconds_count"), 5.0);
    // Plain-HTTP fetches may reuse the run's idle upstream connection instead of dialling.
    assert_eq!(
        d("egress_connect_duration_seconds_count") + d("egress_upstream_reused_total"),
        5.0
    );
    assert_eq!(d("egress_runs_active{tool=\"web\",state=\"active\"}"), 1.0);
    assert_eq!(d("egress_fact_write_duration_seconds_count"), 7.0);
    assert_eq!(sample(&after, "egress_slots_in_use{tool=\"web\"}"), 0.0);
    p.end(&run).await;
    let m = p.metrics().await;
    assert_eq!(sample(&m, "egress_runs_active{tool=\"web\",state=\"active\"}"), 0.0);
    assert_eq!(sample(&m, "egress_runs_ended_total{tool=\"web\",why=\"ended\"}"), 1.0);
    // Bounded labels: no run id, host or address appears in any series.
    assert!(!m.contains(&run.id) && !m.contains("evil.test") && !m.contains("10.0.0.1"));
    assert!(m.contains("process_resident_memory_bytes") && m.contains("process_open_fds"));
}

#[tokio::test]
async fn the_fact_stream_replays_then_follows() {
    let p = TestProxy::start("[tools.web]\negress = []\n").await;
    let run = p.run("web").await;
    for i in 0..3 {
        p.get(&run, &format!("http://evil{i}.test/"), "").await;
    }
    let mut s = TcpStream::connect(p.control).await.unwrap();
    s.write_all(
        format!("GET /v1/facts/stream?after=1 HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let head = read_response(&mut s, true).await.unwrap();
    assert_eq!(head.status, 200);
    assert!(head.header("content-type").unwrap().starts_with("text/event-stream"));
    let mut seen = String::from_utf8_lossy(&head.body).into_owned();
    read_until(2, &mut seen, &mut s).await.expect("replay");
    assert!(
        seen.contains("id: 2") && seen.contains("id: 3") && !seen.contains("id: 1\n"),
        "{seen}"
    );
    p.get(&run, "http://live.test/", "").await;
    read_until(3, &mut seen, &mut s).await.expect("live fact");
    assert!(seen.contains("id: 4") && seen.contains("live.test"), "{seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_have_one_line_per_decision_and_no_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = addrs();
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n[tools.web]\negress = []\n"
        ),
    )
    .unwrap();
    let p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &["--log-format", "json"]);
    let (id, secret) = create_run(control, "web").await;
    let auth = basic(&id, &secret);
    let r = send(
        proxy,
        format!("CONNECT evil.test:443 HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {auth}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    let t0 = std::time::Instant::now();
    let line = loop {
        if let Some(l) = p
            .logs()
            .lines()
            .find(|l| l.contains("\"decision\":\"denied\""))
            .map(str::to_owned)
        {
            break l;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{}", p.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["run"], id.as_str());
    assert_eq!(v["tool"], "web");
    assert_eq!(v["reason"], "not_allowlisted");
    assert_eq!(v["dest"], "evil.test:443");
    assert!(v["duration_ms"].is_u64());
    let logs = p.logs();
    assert!(!logs.contains(&secret), "the run secret leaked into the logs");
    assert!(
        !logs.contains(auth.trim_start_matches("Basic ")),
        "Proxy-Authorization leaked into the logs"
    );
    assert!(!logs.contains(TOKEN), "the control token leaked into the logs");
}

async fn read_until(n: usize, seen: &mut String, s: &mut TcpStream) -> Result<(), tokio::time::error::Elapsed> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(5), async {
        while seen.matches("event: fact").count() < n {
            let k = s.read(&mut buf).await.unwrap();
            assert!(k > 0);
            seen.push_str(&String::from_utf8_lossy(&buf[..k]));
        }
    })
    .await
}

#[tokio::test]
async fn an_unusable_sqlite_store_fails_closed_and_unready() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("facts.db");
    std::fs::write(&db, vec![0x42u8; 16384]).unwrap();
    let dns = egress_e2e::FakeDns::start().await;
    let text = format!(
        "{}[tools.web]\negress = []\n",
        egress_e2e::harness::proxy_section(&dns, "").replace("/nonexistent/facts.db", db.to_str().unwrap())
    );
    // No sink given: the proxy opens the (unusable) store the config names.
    let p = TestProxy::start_config(dns, &text, None, None).await;
    let r = control_call(p.control, "GET", "/readyz", None, None).await;
    assert_eq!(r.status, 503);
    // A run that cannot be stored durably is not created.
    let r = control_call(p.control, "POST", "/v1/runs", Some(json!({"tool": "web"})), Some(TOKEN)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        (r.status, v["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{v}"
    );
    // A denial that cannot be recorded is refused.
    let r = send(p.proxy, b"CONNECT evil.test:443 HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!((r.status, r.header("x-egress-error")), (503, Some("facts_unavailable")));
    let r = control_call(p.control, "GET", "/v1/facts", None, Some(TOKEN)).await;
    assert_eq!(r.status, 503);
    let m = control_call(p.control, "GET", "/metrics", None, None).await.text();
    assert_eq!(sample(&m, "egress_fact_write_failures_total"), 1.0);
    p.shutdown().await;
}

/// Socket activation: systemd passes the proxy its listeners (`proxy`,
/// `control` by `FileDescriptorName=`), and the proxy serves on them and
/// binds nothing itself. The config names addresses this test holds, so a
/// bind would fail the start.
#[tokio::test]
async fn the_proxy_serves_on_the_sockets_systemd_passes() {
    let dir = tempfile::tempdir().unwrap();
    let held = [
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
    ];
    let (listen, control) = (held[0].local_addr().unwrap(), held[1].local_addr().unwrap());
    let cfg = write_config(
        dir.path(),
        listen,
        control,
        "[tools.web]\negress = [\"allowed.test:443\"]\n",
    );
    let cfg = cfg.display().to_string();
    let (child, addrs) = socket_activated(
        &["proxy", "control"],
        &bin("egress-proxy"),
        &["serve", "--config", &cfg],
        &[("EGRESS_CONTROL_TOKEN", TOKEN)],
        &dir.path().join("proxy.log"),
    );
    let _child = KillOnDrop(child);
    let log = || std::fs::read_to_string(dir.path().join("proxy.log")).unwrap_or_default();
    let (passed_proxy, passed_control) = (addrs["proxy"], addrs["control"]);
    let t0 = std::time::Instant::now();
    loop {
        let r = control_call(passed_control, "GET", "/v1/runs", None, Some(TOKEN)).await;
        if r.status == 200 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "not served: {}\n{}",
            r.status,
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The data listener answers, with the run's credential missing.
    let r = send(
        passed_proxy,
        b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n",
    )
    .await;
    assert_eq!((r.status, r.deny_reason()), (407, Some("auth_missing")), "{}", log());
    // A run's proxy URL names the passed listener, not the configured one.
    let r = control_call(
        passed_control,
        "POST",
        "/v1/runs",
        Some(json!({"tool": "web"})),
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, 201);
    let run: Value = serde_json::from_slice(&r.body).unwrap();
    let url = run["proxy_url"].as_str().unwrap();
    assert!(url.ends_with(&format!("@{passed_proxy}")), "{url}");
    assert!(log().contains("listening on a socket passed by systemd"), "{}", log());
    drop(held);
}
