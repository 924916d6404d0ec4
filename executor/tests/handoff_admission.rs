//! Listeners handed over to the proxy (`[proxy] handoff`), seen from the
//! proxy's side: a connection on a run's listener only takes that run's
//! credential; a run bound to its listener is taken nowhere else (every
//! other listener and entrance, also after a restart); and each handed-off
//! listener has its own pending-connection set, so one sandbox flooding its
//! listener with idle sockets cannot push out another sandbox's pending
//! connections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{all_facts_at, basic, control_call, sample, TestProxy, TOKEN};
use egress_e2e::origin::http_origin;
use egress_e2e::process::{free_addr, write_config, ProxyProcess};
use egress_e2e::raw::RawResponse;
use egress_e2e::socks::{negotiate, Dest, Outcome};
use egress_e2e::FakeDns;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn ask(s: &mut TcpStream, auth: &str) -> egress_e2e::raw::RawResponse {
    let req = format!("GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nProxy-Authorization: {auth}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), egress_e2e::raw::read_response(s, false))
        .await
        .expect("an answer within 5 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_off_listeners_bind_their_run_and_keep_their_own_pending_connections() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("handoff.sock");
    let p = TestProxy::start_with(
        &format!("handoff = \"{}\"\nmax_pending_connections = 64", sock.display()),
        "[tools.web]\negress = []\n",
        None,
    )
    .await;
    let (a, b) = (p.run("web").await, p.run("web").await);
    let la = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let lb = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (addr_a, addr_b) = (la.local_addr().unwrap(), lb.local_addr().unwrap());
    egress_executor::proxy::handoff::send(&sock, &a.id, &la).await.unwrap();
    egress_executor::proxy::handoff::send(&sock, &b.id, &lb).await.unwrap();
    drop((la, lb));

    // Run B's credential is refused on run A's listener (B is bound to its
    // own by the hand-off); A's own is accepted.
    let mut s = TcpStream::connect(addr_a).await.unwrap();
    let r = ask(&mut s, &b.auth()).await;
    assert_eq!((r.status, r.deny_reason()), (407, Some("credential_elsewhere")));
    let mut s = TcpStream::connect(addr_a).await.unwrap();
    assert_eq!(ask(&mut s, &a.auth()).await.deny_reason(), Some("not_allowlisted"));

    // A pending connection on B's listener survives a flood of idle sockets on A's.
    let mut waiting = TcpStream::connect(addr_b).await.unwrap();
    let mut flood = vec![];
    for _ in 0..300 {
        flood.push(TcpStream::connect(addr_a).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = ask(&mut waiting, &b.auth()).await;
    assert_eq!(
        r.deny_reason(),
        Some("not_allowlisted"),
        "B's pending connection was pushed out by A's flood"
    );
    drop(flood);
}

/// The hand-off socket is an authority (a listener sent there is bound to
/// whichever run the sender names), so the proxy checks who sends on the
/// connection's peer credentials, not only by the socket's mode: root or its
/// own user, never another. Even a socket whose mode was opened up (or the
/// instant between bind and chmod) lets no other user hand anything over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_send_even_through_a_socket_opened_to_all() {
    use egress_e2e::executor::{is_root, which};
    use std::os::unix::fs::PermissionsExt;
    let (Some(setpriv), Some(python)) = (which("setpriv"), which("python3")) else {
        eprintln!("SKIPPED: needs setpriv and python3");
        return;
    };
    if !is_root() {
        eprintln!("SKIPPED: needs root (to act as another uid)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let sock = dir.path().join("handoff.sock");
    let p = TestProxy::start_with(
        &format!("handoff = \"{}\"", sock.display()),
        "[tools.web]\negress = []\n",
        None,
    )
    .await;
    // Root (the executor) is answered.
    egress_executor::proxy::handoff::probe(&sock).await.unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = "import socket, sys\n\
                  s = socket.socket(socket.AF_UNIX)\n\
                  s.connect(sys.argv[1])\n\
                  try:\n    s.sendall(b'loom-handoff-probe/1\\n')\nexcept OSError:\n    pass\n\
                  print(s.recv(512).decode(), end='')\n";
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(setpriv)
            .args(["--reuid=4242", "--regid=4242", "--clear-groups", "--"])
            .arg(python)
            .args(["-c", script])
            .arg(&sock)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.starts_with("error uid 4242 may not hand over listeners"),
        "{answer:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    p.shutdown().await;
}

/// The answer to a plain-HTTP request for `url` with credential `auth`
/// presented on the listener at `addr`.
async fn get_at(addr: SocketAddr, url: &str, auth: &str) -> RawResponse {
    let host = url.trim_start_matches("http://").trim_end_matches('/');
    let req = format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n");
    egress_e2e::raw::send(addr, req.as_bytes()).await
}

/// A run created by the control API (`body`): (id, secret).
async fn create(control: SocketAddr, body: Value) -> (String, String) {
    let r = control_call(control, "POST", "/v1/runs", Some(body), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    (
        v["run_id"].as_str().unwrap().into(),
        v["secret"].as_str().unwrap().into(),
    )
}

/// A listener on loopback handed over to the proxy for `run`; its address.
async fn hand_over(sock: &std::path::Path, run: &str) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    egress_executor::proxy::handoff::send(sock, run, &l).await.unwrap();
    addr
}

/// The reported attack, on every entrance, and across a restart: the
/// credential of a run bound to the listener handed over for it (a strict
/// child's, copied out of its sandbox) is presented on the proxy's own
/// listener (forward, CONNECT, a CONNECT the proxy would intercept, SOCKS5)
/// and on another run's handed-over listener (HTTP, SOCKS5). Each is `407
/// credential_elsewhere` (SOCKS5: status 1) with a fact on the run (and on
/// the other run whose sandbox presented it), and nothing reaches the
/// origin. It holds for a run declared bound at creation and not yet
/// handed over, and for one bound only by its hand-off; the run's own
/// listener works as before; a wrong secret is `auth_invalid` as before.
/// After a `kill -9` and a restart over the same store, the restored runs
/// are still bound though no listener was handed over again, and a new
/// hand-off serves the run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_runs_credential_is_refused_on_every_other_entrance_also_after_a_restart() {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dns = FakeDns::start().await;
    dns.set("allowed.test", &["127.0.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("handoff.sock");
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(
        dir.path(),
        proxy,
        control,
        &format!(
            "handoff = \"{}\"\nallow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\ntimeout_ms = 2000\n\
             [tools.web]\negress = [\"allowed.test:{port}\"]\n\
             [tools.seen]\negress = [\"allowed.test:{port}\"]\ninspect = true\n",
            sock.display(),
            dns.addr
        ),
    );
    let mut p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    // Declared bound and handed over (the executor's strict children), a
    // second such sandbox, bound only by its hand-off, declared and not yet
    // handed over, an inspected tool's, and a kernel's unbound run.
    let a = create(control, json!({"tool": "web", "bound": true, "activate": true})).await;
    let b = create(control, json!({"tool": "web", "bound": true})).await;
    let c = create(control, json!({"tool": "web"})).await;
    let d = create(control, json!({"tool": "web", "bound": true})).await;
    let i = create(control, json!({"tool": "seen", "bound": true})).await;
    let u = create(control, json!({"tool": "web"})).await;
    let la = hand_over(&sock, &a.0).await;
    let lb = hand_over(&sock, &b.0).await;
    let _lc = hand_over(&sock, &c.0).await;
    let url = format!("http://allowed.test:{port}/");
    let target = format!("allowed.test:{port}");
    let dest = Dest::Name("allowed.test".into(), port);
    let auth = |r: &(String, String)| basic(&r.0, &r.1);
    let bound = |id: &str| {
        let id = id.to_owned();
        async move {
            let r = control_call(control, "GET", &format!("/v1/runs/{id}"), None, Some(TOKEN)).await;
            serde_json::from_slice::<Value>(&r.body).unwrap()["bound"].clone()
        }
    };
    assert_eq!(bound(&c.0).await, json!(true), "the hand-off binds the run");
    assert_eq!(bound(&u.0).await, json!(false));

    // Refused on `at` over HTTP (forward and CONNECT) and SOCKS5; returns
    // how many refusals were made.
    let refused_everywhere = |run: (String, String), at: SocketAddr, connect: bool, when: &'static str| {
        let (url, target, dest) = (url.clone(), target.clone(), dest.clone());
        async move {
            let r = get_at(at, &url, &basic(&run.0, &run.1)).await;
            assert_eq!(
                (r.status, r.deny_reason()),
                (407, Some("credential_elsewhere")),
                "run {} on {at} {when}: {}",
                run.0,
                r.text()
            );
            assert!(r.header("proxy-authenticate").is_some_and(|v| v.starts_with("Basic")));
            let mut n = 1;
            if connect {
                let (r, _) = egress_e2e::raw::connect(at, &target, Some(&basic(&run.0, &run.1))).await;
                assert_eq!((r.status, r.deny_reason()), (407, Some("credential_elsewhere")));
                n += 1;
            }
            let socks = negotiate(at, (&run.0, &run.1), &[2], 1, &dest).await;
            assert!(matches!(socks, Outcome::Auth(1)), "{socks:?}");
            n + 1
        }
    };
    let mut on = std::collections::HashMap::<String, usize>::new();
    for run in [&a, &c, &d] {
        *on.entry(run.0.clone()).or_default() += refused_everywhere(run.clone(), proxy, true, "").await;
    }
    // The inspected tool's CONNECT is refused before any TLS.
    let (r, _) = egress_e2e::raw::connect(proxy, &target, Some(&auth(&i))).await;
    assert_eq!((r.status, r.deny_reason()), (407, Some("credential_elsewhere")));
    on.insert(i.0.clone(), 1);
    // On another run's listener: facts on both runs.
    *on.entry(a.0.clone()).or_default() += refused_everywhere(a.clone(), lb, false, "").await;
    on.insert(b.0.clone(), 2);
    // The run's own listener: as before.
    assert_eq!(get_at(la, &url, &auth(&a)).await.status, 200);
    let (code, _) = egress_e2e::socks::connect(la, (&a.0, &a.1), &dest).await;
    assert_eq!(code, 0);
    // An unbound run: the proxy's listener takes it, a bound listener does not.
    assert_eq!(get_at(proxy, &url, &auth(&u)).await.status, 200);
    assert_eq!(get_at(la, &url, &auth(&u)).await.deny_reason(), Some("auth_invalid"));
    // A wrong secret of a bound run says nothing of its binding.
    let wrong = get_at(proxy, &url, &basic(&a.0, &"0".repeat(48))).await;
    assert_eq!((wrong.status, wrong.deny_reason()), (407, Some("auth_invalid")));
    // Connections: the two allowed requests and the allowed SOCKS5 tunnel.
    assert_eq!(
        origin.hits.load(Ordering::SeqCst),
        3,
        "only the allowed fetches reached the origin"
    );

    let facts = all_facts_at(control).await;
    let elsewhere = |id: &str| {
        facts
            .iter()
            .filter(|f| f["reason"] == "credential_elsewhere" && f["run_id"] == id)
            .map(|f| f["count"].as_u64().unwrap_or(1) as usize)
            .sum::<usize>()
    };
    for (id, n) in &on {
        assert_eq!(elsewhere(id), *n, "credential_elsewhere facts of {id}: {facts:#?}");
    }
    let on_main = facts
        .iter()
        .find(|f| f["run_id"] == a.0.as_str() && f["detail"].as_str().unwrap().contains("the proxy's own listener"));
    assert!(on_main.is_some_and(|f| f["target"].is_null()), "{facts:#?}");
    assert!(
        facts.iter().any(|f| f["run_id"] == b.0.as_str()
            && f["detail"]
                .as_str()
                .unwrap()
                .contains(&format!("the credential of run {}", a.0))),
        "{facts:#?}"
    );
    let m = control_call(control, "GET", "/metrics", None, Some(TOKEN)).await.text();
    let total: usize = [&a, &c, &d, &i].iter().map(|r| on[&r.0]).sum();
    assert_eq!(
        sample(&m, "egress_auth_failures_total{reason=\"credential_elsewhere\"}"),
        total as f64
    );

    // kill -9, and a restart over the same store: no listener is handed
    // over again, the bound runs stay bound.
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(5));
    let _p2 = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    for run in [&a, &c, &d] {
        refused_everywhere(run.clone(), proxy, true, "after the restart").await;
        assert_eq!(bound(&run.0).await, json!(true));
    }
    assert_eq!(get_at(proxy, &url, &auth(&u)).await.status, 200);
    // A new hand-off serves the restored run again.
    let la2 = hand_over(&sock, &a.0).await;
    assert_eq!(get_at(la2, &url, &auth(&a)).await.status, 200);
    assert_eq!(origin.hits.load(Ordering::SeqCst), 5);
}
