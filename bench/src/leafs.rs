//! What a cached leaf certificate costs: an `inspect` tool with a `*.` rule
//! makes real intercepted HTTPS requests to many different names, one new
//! name per connection (CONNECT, TLS handshake naming it, one GET, close),
//! so the proxy issues and caches one leaf per name.
//!
//! Two fresh egress-proxies with the same config make the same requests to
//! the same names, each after a warm-up on other names: one as tool
//! `inspector` (intercepted), one as tool `blind` (the same rule without
//! `inspect`: blind tunnels, TLS end to end with the origin). Each one's RSS
//! growth per name is measured; the blind one's is what any name costs
//! (its DNS answers, in the resolver's cache and the proxy's), and the
//! difference is what interception keeps per name: the leaf, and up to
//! 256 names' sessions the proxy may resume with the origin (rustls'
//! client cache). Two processes rather than two passes in one, since a
//! second pass would reuse the memory the first one freed (old hash tables
//! after growing) and show less than it holds.

use crate::intercept;
use crate::load::{self, Binder, Conn, Path, ProxyTarget};
use crate::peers::{self, Egress, Launcher};
use crate::procfs;
use std::io;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// The suffix of every name (the rule, the origin's wildcard certificate).
const SUFFIX: &str = "leafs.test";
/// Names handshaken before the measured ones, so that what the first
/// connections allocate once is not counted.
const WARM_UP: usize = 50;

/// One figure's result (RSS growth in KiB per name).
pub struct Leafs {
    pub names: usize,
    pub kib_per_intercepted_name: f64,
    pub kib_per_blind_name: f64,
    /// The intercepted pass's rate, one request at a time.
    pub handshakes_per_s: f64,
    /// The intercepting proxy's user-space instructions per name (`--callgrind`).
    pub instructions: Option<f64>,
}

/// An egress-proxy whose tools `inspector` (intercepting every CONNECT) and
/// `blind` may reach `*.leafs.test:<port>`, verifying the origin against
/// its own CA.
fn egress_proxy(
    l: &Launcher,
    program: &std::path::Path,
    dns: std::net::SocketAddr,
    origin: &egress_e2e::tls_origin::TlsOrigin,
    token: &str,
    name: &str,
) -> io::Result<Egress> {
    let d = l.dir.join(name);
    std::fs::create_dir_all(&d)?;
    let ca = d.join("origin-ca.pem");
    std::fs::write(&ca, &origin.ca_pem)?;
    let extra = format!("[proxy.interception]\nupstream_ca_file = \"{}\"\n", ca.display());
    let rule = format!(
        "egress = [\"*.{SUFFIX}:{}\"]\nfetch_timeout_ms = 60000\nmax_concurrent_fetches = 64\n",
        origin.addr.port()
    );
    let tools = format!("[tools.inspector]\n{rule}inspect = true\n[tools.blind]\n{rule}");
    peers::egress_proxy_in(l, program, name, dns, &extra, &tools, token)
}

/// One intercepted request to `host` over a new connection.
async fn once(b: &Binder, via: &Path, tls: &tokio_rustls::TlsConnector, host: &str, port: u16) -> io::Result<()> {
    let tcp = via.open(b, 1024).await?.into_stream()?;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(io::Error::other)?;
    let s = tls.connect(name, tcp).await?;
    let req = format!("GET /small HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n");
    let (mut c, _) = load::exchange(Conn::new(s, 4096), req.as_bytes()).await?;
    c.s.shutdown().await
}

/// Handshakes for every name of `names`, one after another; the first
/// failure ends the figure.
async fn handshakes(
    b: &Binder,
    via: &Path,
    tls: &tokio_rustls::TlsConnector,
    names: &[String],
    port: u16,
) -> io::Result<()> {
    for host in names {
        let authority = format!("{host}:{port}");
        let mut via = via.clone();
        if let Some(p) = via.proxy.as_mut() {
            p.authority = authority;
        }
        once(b, &via, tls, host, port)
            .await
            .map_err(|e| io::Error::other(format!("{host}: {e}")))?;
    }
    Ok(())
}

/// The resident memory of `pid` once its connections have wound down.
async fn settled_rss(pid: u32) -> io::Result<u64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    procfs::rss_kib(pid).ok_or_else(|| io::Error::other("no VmRSS"))
}

/// A path through `proxy` as a new run of `tool`.
async fn via(proxy: &Egress, tool: &str) -> Path {
    let (id, secret) = egress_e2e::harness::create_run_at(proxy.control, tool).await;
    Path {
        name: tool.into(),
        addr: proxy.addr,
        proxy: Some(ProxyTarget {
            authority: String::new(),
            auth: Some(egress_e2e::harness::basic(&id, &secret)),
        }),
        pid: Some(proxy.daemon.pid()),
    }
}

/// What one pass measured, per name.
struct Pass {
    /// RSS growth, KiB.
    kib: f64,
    /// Names per second, one at a time.
    rate: f64,
    /// The proxy's user-space instructions (`--callgrind`).
    instructions: Option<f64>,
}

/// A fresh proxy for `tool`: what it takes per name of `names`, after a
/// warm-up on `warm`.
#[allow(clippy::too_many_arguments)]
async fn pass(
    l: &Launcher,
    program: &std::path::Path,
    dns: &egress_e2e::FakeDns,
    b: &Binder,
    origin: &egress_e2e::tls_origin::TlsOrigin,
    tool: &str,
    (warm, names): (&[String], &[String]),
    token: &str,
) -> io::Result<Pass> {
    let proxy = egress_proxy(
        l,
        program,
        dns.addr,
        origin,
        token,
        &format!("egress-proxy-leafs-{tool}"),
    )?;
    let tls = match tool {
        "inspector" => intercept::connector(&intercept::appliance_ca(&proxy, token).await?)?,
        _ => intercept::connector(&origin.ca_pem)?,
    };
    let via = via(&proxy, tool).await;
    let (port, pid) = (origin.addr.port(), proxy.daemon.pid());
    handshakes(b, &via, &tls, warm, port).await?;
    let before = settled_rss(pid).await?;
    let counting = crate::callgrind::start(Some(pid));
    let t0 = Instant::now();
    handshakes(b, &via, &tls, names, port).await?;
    let rate = names.len() as f64 / t0.elapsed().as_secs_f64();
    let instructions = counting.then(|| crate::callgrind::instructions(pid)).flatten();
    let after = settled_rss(pid).await?;
    let per = |v: f64| v / names.len() as f64;
    Ok(Pass {
        kib: per(after.saturating_sub(before) as f64),
        rate,
        instructions: instructions.map(|i| per(i as f64)),
    })
}

/// Starts the origin, then measures `n` names through blind tunnels and
/// intercepted, each on a fresh proxy.
pub async fn run(
    l: &Launcher,
    program: &std::path::Path,
    dns: &egress_e2e::FakeDns,
    b: &Binder,
    n: usize,
    token: &str,
) -> io::Result<Leafs> {
    let origin = intercept::start_origin(&[&format!("*.{SUFFIX}")])?;
    let names = |prefix: &str, n: usize| -> Vec<String> { (0..n).map(|i| format!("{prefix}{i}.{SUFFIX}")).collect() };
    let (warm, measured) = (names("warm", WARM_UP), names("n", n));
    for name in warm.iter().chain(&measured) {
        dns.set(name, &["127.0.0.2"]);
    }
    let names = (&warm[..], &measured[..]);
    let blind = pass(l, program, dns, b, &origin, "blind", names, token).await?;
    let intercepted = pass(l, program, dns, b, &origin, "inspector", names, token).await?;
    Ok(Leafs {
        names: n,
        kib_per_intercepted_name: intercepted.kib,
        kib_per_blind_name: blind.kib,
        handshakes_per_s: intercepted.rate,
        instructions: intercepted.instructions,
    })
}
