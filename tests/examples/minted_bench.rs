//! What a minted credential costs on the data path: keep-alive requests/s
//! through the proxy to a credential host whose token the proxy mints
//! (OAuth2 client credentials, from the real authlib server of the tests)
//! against the same host with a static secret, in one run, rounds
//! alternating. The token is in the policy like a static secret, so the
//! two should not differ.
//!
//! Usage: `cargo run --release -p egress-e2e --example minted_bench [requests per client] [clients] [rounds]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::credentials::write_secret;
use egress_e2e::harness::{proxy_section, TestProxy, TestRun};
use egress_e2e::oauth2::OAuthServer;
use egress_e2e::raw::read_response;
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncWriteExt as _;

/// `n` keep-alive GETs on one connection to the proxy, for `run` to `url`.
async fn client(proxy: SocketAddr, run: TestRun, url: String, n: usize) {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.set_nodelay(true).unwrap();
    let host = url.trim_start_matches("http://").split('/').next().unwrap().to_owned();
    let req = format!(
        "GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\n\r\n",
        run.auth()
    );
    for _ in 0..n {
        s.write_all(req.as_bytes()).await.unwrap();
        let r = read_response(&mut s, false).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// Requests/s of `clients` keep-alive connections, `n` requests each.
async fn rate(p: &TestProxy, tool: &str, url: &str, n: usize, clients: usize) -> f64 {
    let mut runs = vec![];
    for _ in 0..clients {
        runs.push(p.run(tool).await);
    }
    let t0 = Instant::now();
    let tasks: Vec<_> = runs
        .into_iter()
        .map(|r| tokio::spawn(client(p.proxy, r, url.to_owned(), n)))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (n * clients) as f64 / t0.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (n, clients, rounds) = (arg(1, 2000), arg(2, 8), arg(3, 5));
    let dir = tempfile::tempdir().unwrap();
    let server = OAuthServer::start(dir.path(), 3600);
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let dns = FakeDns::start().await;
    dns.set("auth.example", &["127.0.0.2"]);
    dns.set("api.example", &["127.0.0.2"]);
    let cs = dir.path().join("client.secret");
    write_secret(&cs, "cs-loom-secret", 0o600);
    let st = dir.path().join("static.token");
    write_secret(&st, "static-token-0123456789abcdef0123", 0o600);
    let api = format!("api.example:{}", origin.addr.port());
    let cred = |tool: &str, source: &str| {
        format!(
            "[tools.{tool}]\negress = [\"{api}\"]\n[tools.{tool}.credentials.api]\nhosts = [\"{api}\"]\n\
             value = \"Bearer ${{secret}}\"\nplaceholder_env = \"API_TOKEN\"\nallow_plaintext = true\n{source}\n"
        )
    };
    let text = format!(
        "{}\n[proxy.interception]\nupstream_ca_file = \"{}\"\n{}{}",
        proxy_section(&dns, ""),
        server.ca_file.display(),
        cred("fixed", &format!("secret = {{ file = \"{}\" }}", st.display())),
        cred(
            "minted",
            &format!(
                "mint = {{ oauth2_client_credentials = {{ token_url = \"https://auth.example:{}/token\", client_id = \"loom\", \
                 client_secret = {{ file = \"{}\" }} }} }}",
                server.tls.port(),
                cs.display()
            )
        ),
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(1000)))).await;
    let url = format!("http://{api}/");
    // Warm-up.
    rate(&p, "fixed", &url, 200, clients).await;
    rate(&p, "minted", &url, 200, clients).await;
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..rounds {
        a.push(rate(&p, "fixed", &url, n, clients).await);
        b.push(rate(&p, "minted", &url, n, clients).await);
    }
    let (a, b) = (median(&mut a), median(&mut b));
    println!("keep-alive GETs through the proxy with the credential injected, {clients} clients x {n} x {rounds} rounds (medians)");
    println!("static secret (file):         {a:8.0} requests/s");
    println!("minted token (OAuth2):        {b:8.0} requests/s   ({:.2}x)", b / a);
    println!("token requests during the run: {}", server.token_requests().await);
}
