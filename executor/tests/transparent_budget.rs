//! The transparent entrance's raw relay is held to the run's byte budget
//! like every other carrier: eight connections of one run, redirected to
//! the proxy as a `network = "transparent"` sandbox's are, relaying bytes
//! both ways with a fast origin, never move a byte past
//! `max_bytes_per_run`. The proxy runs in this process; its transparent
//! listeners are handed to it with the executor's own sender
//! (`handoff::send_transparent`), which is why this test lives here.
//!
//! Runs in a network namespace of its own holding only `lo` (re-executed
//! under `unshare -rn`), where an nftables rule redirects the test
//! client's connections (from 127.0.0.5) to the origin on 127.0.0.2 to the
//! proxy's listener, so they carry their original destination. Skipped
//! loudly without nft.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::flood::{self, raw_flood};
use egress_e2e::harness::TestProxy;
use std::os::fd::OwnedFd;
use std::time::Duration;

const BUDGET: u64 = 256 * 1024;
const FETCHES: usize = 8;

#[test]
fn a_transparent_raw_relay_moves_no_byte_past_the_budget() {
    if !egress_e2e::netns::isolated("a_transparent_raw_relay_moves_no_byte_past_the_budget") {
        return;
    }
    let nft = match egress_executor::confine::transparent::nft() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            return;
        }
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(relay_within_the_budget(nft));
}

async fn relay_within_the_budget(nft: std::path::PathBuf) {
    let origin = raw_flood("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let handoff = dir.path().join("handoff.sock");
    let p = TestProxy::start_with(
        &format!("handoff = \"{}\"", handoff.display()),
        &format!(
            "[tools.t]\nnetwork = \"transparent\"\negress = [{{ host = \"127.0.0.2\", port = {port}, protocol = \"tcp\" }}]\nmax_bytes_per_run = {BUDGET}\nmax_concurrent_fetches = 32\nfetch_timeout_ms = 60000\n[tools.t.process]\ncommand = [\"true\"]\n"
        ),
        None,
    )
    .await;
    let run = p.run("t").await;
    // The sandbox's four sockets: its TCP listeners (both on 127.0.0.1
    // here), its DNS's UDP socket and TCP listener.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let to = listener.local_addr().unwrap().port();
    let fds: [OwnedFd; 4] = [
        listener.into(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().into(),
        std::net::UdpSocket::bind("127.0.0.1:0").unwrap().into(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().into(),
    ];
    egress_executor::proxy::handoff::send_transparent(&handoff, &run.id, &fds)
        .await
        .unwrap();
    drop(fds);
    let rules = format!(
        "table ip budget {{\n chain out {{\n  type nat hook output priority -100; policy accept;\n  \
         ip saddr 127.0.0.5 ip daddr 127.0.0.2 tcp dport {port} redirect to :{to}\n }}\n}}\n"
    );
    let out = std::process::Command::new(nft)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn();
    let mut child = out.unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), rules.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success(), "nft refused {rules}");

    let clients: Vec<_> = (0..FETCHES)
        .map(|_| {
            tokio::spawn(async move {
                let s = tokio::net::TcpSocket::new_v4().unwrap();
                s.bind("127.0.0.5:0".parse().unwrap()).unwrap();
                let s = s.connect(format!("127.0.0.2:{port}").parse().unwrap()).await.unwrap();
                flood::both_ways(s).await
            })
        })
        .collect();
    let mut got = 0;
    for c in clients {
        got += tokio::time::timeout(Duration::from_secs(30), c)
            .await
            .expect("a connection outlived the budget's cut")
            .unwrap();
    }
    let crossed = got + origin.received_in_the_end().await;
    eprintln!("transparent raw: {crossed} of {BUDGET} bytes crossed");
    assert!(crossed <= BUDGET, "{crossed} bytes crossed a budget of {BUDGET}");
    assert!(
        origin.counts.requests.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "nothing reached the origin"
    );
    let (_, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(v["budgets"]["bytes"]["used"].as_u64(), Some(BUDGET), "{v}");
    let mut facts = vec![];
    for _ in 0..250 {
        facts = p.facts_with_reason("budget_exhausted").await;
        if !facts.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!facts.is_empty(), "no budget_exhausted fact for the cut");
    assert_eq!(facts[0]["target"]["kind"], "transparent", "{facts:?}");
}
