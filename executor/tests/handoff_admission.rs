//! Listeners handed over to the proxy (`[proxy] handoff`), seen from the
//! proxy's side: a connection on a run's listener only takes that run's
//! credential, and each handed-off listener has its own pending-connection
//! set, so one sandbox flooding its listener with idle sockets cannot push
//! out another sandbox's pending connections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::TestProxy;
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

    // Run B's credential is refused on run A's listener; A's own is accepted.
    let mut s = TcpStream::connect(addr_a).await.unwrap();
    let r = ask(&mut s, &b.auth()).await;
    assert_eq!((r.status, r.deny_reason()), (407, Some("auth_invalid")));
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
