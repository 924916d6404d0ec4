//! What a cached leaf certificate costs: an `inspect` tool with a `*.` rule
//! makes real intercepted HTTPS requests to many different names, one new
//! name per connection (CONNECT, TLS handshake naming it, one GET, close),
//! so the proxy issues and caches one leaf per name. The figure is the
//! growth of the proxy's resident memory divided by the names, measured on
//! a fresh egress-proxy of its own after a warm-up on other names.
//!
//! The growth per name holds everything the proxy keeps per name, not the
//! leaf alone: its DNS cache entry and, up to its bound of 256 names, the
//! session it may resume with the origin.

use crate::intercept;
use crate::load::{self, Binder, Conn, Path, ProxyTarget};
use crate::peers::{self, Egress, Launcher};
use crate::procfs;
use std::io;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// The suffix of every name (the rule, the origin's wildcard certificate).
const SUFFIX: &str = "leafs.test";
/// Names handshaken before the first measurement, so that what every
/// connection allocates once is not counted.
const WARM_UP: usize = 50;

/// One figure's result.
pub struct Leafs {
    pub names: usize,
    pub kib_per_leaf: f64,
    pub handshakes_per_s: f64,
}

/// An egress-proxy whose tool `inspector` intercepts every CONNECT to
/// `*.leafs.test:<port>`, verifying the origin against its own CA.
fn egress_proxy(
    l: &Launcher,
    program: &std::path::Path,
    dns: std::net::SocketAddr,
    origin: &egress_e2e::tls_origin::TlsOrigin,
    token: &str,
) -> io::Result<Egress> {
    let name = "egress-proxy-leafs";
    let d = l.dir.join(name);
    std::fs::create_dir_all(&d)?;
    let ca = d.join("origin-ca.pem");
    std::fs::write(&ca, &origin.ca_pem)?;
    let extra = format!("[proxy.interception]\nupstream_ca_file = \"{}\"\n", ca.display());
    let tools = format!(
        "[tools.inspector]\negress = [\"*.{SUFFIX}:{}\"]\ninspect = true\nfetch_timeout_ms = 60000\nmax_concurrent_fetches = 64\n",
        origin.addr.port()
    );
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

/// Starts the origin and the proxy, handshakes [`WARM_UP`] names, then
/// `n` new ones, and reports the RSS growth per new name.
pub async fn run(
    l: &Launcher,
    program: &std::path::Path,
    dns: &egress_e2e::FakeDns,
    b: &Binder,
    n: usize,
    token: &str,
) -> io::Result<Leafs> {
    let origin = intercept::start_origin(&[&format!("*.{SUFFIX}")])?;
    let warm: Vec<String> = (0..WARM_UP).map(|i| format!("warm{i}.{SUFFIX}")).collect();
    let names: Vec<String> = (0..n).map(|i| format!("n{i}.{SUFFIX}")).collect();
    for name in warm.iter().chain(&names) {
        dns.set(name, &["127.0.0.2"]);
    }
    let proxy = egress_proxy(l, program, dns.addr, &origin, token)?;
    let tls = intercept::connector(&intercept::appliance_ca(&proxy, token).await?)?;
    let (id, secret) = egress_e2e::harness::create_run_at(proxy.control, "inspector").await;
    let via = Path {
        name: "leafs".into(),
        addr: proxy.addr,
        proxy: Some(ProxyTarget {
            authority: String::new(),
            auth: Some(egress_e2e::harness::basic(&id, &secret)),
        }),
        pid: Some(proxy.daemon.pid()),
    };
    let port = origin.addr.port();
    let pid = proxy.daemon.pid();
    handshakes(b, &via, &tls, &warm, port).await?;
    let before = settled_rss(pid).await?;
    let t0 = Instant::now();
    handshakes(b, &via, &tls, &names, port).await?;
    let secs = t0.elapsed().as_secs_f64();
    let after = settled_rss(pid).await?;
    Ok(Leafs {
        names: n,
        kib_per_leaf: after.saturating_sub(before) as f64 / n as f64,
        handshakes_per_s: n as f64 / secs,
    })
}
