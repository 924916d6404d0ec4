//! The cost of interception: the same HTTPS requests to the Rust TLS origin
//! (`tls.test` on `127.0.0.2`, a test CA of its own) straight, through a
//! blind CONNECT tunnel of egress-proxy, and through an intercepted CONNECT,
//! where the proxy opens its own verified TLS to the origin, terminates the
//! client's TLS with a leaf of its appliance CA and writes a credential into
//! every request. The intercepting egress-proxy is a second instance with
//! its own config: tool `blind` (no credential) and tool `injected` (a
//! credential on the origin's `host:port`).
//!
//! Two loads per path, on the [`load::drive`] windows of the other figures:
//! keep-alive requests over established TLS connections, and new
//! connections (CONNECT, TLS handshake, one request, close). Clients do a
//! full handshake every time (no session resumption) and speak HTTP/1.1.

use crate::load::{self, Binder, Conn, Path, ProxyTarget, Timing, Window};
use crate::peers::{self, Egress, Launcher};
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The origin's name (its certificate's, the fake DNS's, the tools').
pub const HOST: &str = "tls.test";
/// The credential's secret, as the proxy reads it from its file; the origin
/// must receive it on the intercepted path only.
const SECRET: &str = "bench-secret-4d2b9e1f07a6";
/// The small response the clients ask for.
const PATH: &str = "/small";

/// One way a client reaches the TLS origin: TCP straight or through a
/// CONNECT (`tcp`), then TLS trusting `tls`'s roots.
#[derive(Clone)]
pub struct TlsPath {
    pub tcp: Path,
    tls: TlsConnector,
}

impl TlsPath {
    /// A TLS connection to the origin: TCP (and CONNECT), then a full handshake.
    pub async fn open(&self, b: &Binder) -> io::Result<Conn<TlsStream<TcpStream>>> {
        let tcp = self.tcp.open(b, 1024).await?.into_stream()?;
        let name = rustls::pki_types::ServerName::try_from(HOST).map_err(io::Error::other)?;
        let tls = self.tls.connect(name, tcp).await?;
        Ok(Conn::new(tls, 4096))
    }
}

/// A client TLS configuration trusting the certificates of `ca_pem` only,
/// offering HTTP/1.1, never resuming a session (every handshake is a full one).
pub fn connector(ca_pem: &str) -> io::Result<TlsConnector> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.map_err(io::Error::other)?).map_err(io::Error::other)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(TlsConnector::from(Arc::new(cfg)))
}

/// The Rust HTTPS test origin on a thread (and runtime) of its own, as
/// [`peers::rust_origin`] for plain HTTP, its certificate naming `names`.
pub fn start_origin(names: &[&str]) -> io::Result<egress_e2e::tls_origin::TlsOrigin> {
    let (tx, rx) = std::sync::mpsc::channel();
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Ok(rt) = rt {
            rt.block_on(async move {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let o = egress_e2e::tls_origin::tls_origin("127.0.0.2:0", &names).await;
                let _ = tx.send(o);
                std::future::pending::<()>().await;
            });
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .map_err(|_| io::Error::other("the Rust TLS origin did not start"))
}

/// The second egress-proxy: `[proxy.interception] upstream_ca_file` = the
/// origin's CA, tool `blind` allowed the origin, tool `injected` allowed it
/// with a credential on it (`Bearer ${secret}`, secret from a 0600 file).
pub fn egress_proxy(
    l: &Launcher,
    program: &std::path::Path,
    dns: std::net::SocketAddr,
    origin: &egress_e2e::tls_origin::TlsOrigin,
    token: &str,
) -> io::Result<Egress> {
    use std::os::unix::fs::PermissionsExt;
    let name = "egress-proxy-intercept";
    let d = l.dir.join(name);
    std::fs::create_dir_all(&d)?;
    let ca = d.join("origin-ca.pem");
    std::fs::write(&ca, &origin.ca_pem)?;
    let secret = d.join("api.token");
    std::fs::write(&secret, format!("{SECRET}\n"))?;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    let port = origin.addr.port();
    let limits = "fetch_timeout_ms = 3600000\nmax_concurrent_fetches = 65536\nmax_queued_fetches = 65536\n";
    let extra = format!("[proxy.interception]\nupstream_ca_file = \"{}\"\n", ca.display());
    let tools = format!(
        "[tools.blind]
egress = [\"{HOST}:{port}\"]
{limits}[tools.injected]
egress = [\"{HOST}:{port}\"]
{limits}[tools.injected.credentials.api]
hosts = [\"{HOST}:{port}\"]
value = \"Bearer ${{secret}}\"
secret = {{ file = \"{}\" }}
placeholder_env = \"API_TOKEN\"
",
        secret.display()
    );
    peers::egress_proxy_in(l, program, name, dns, &extra, &tools, token)
}

/// The appliance CA of `proxy` (PEM), from `GET /v1/ca`.
pub async fn appliance_ca(proxy: &Egress, token: &str) -> io::Result<String> {
    let r = egress_e2e::harness::control_call(proxy.control, "GET", "/v1/ca", None, Some(token)).await;
    if r.status != 200 {
        return Err(io::Error::other(format!(
            "GET /v1/ca answered {}: {}",
            r.status,
            r.text()
        )));
    }
    let ca: serde_json::Value = serde_json::from_slice(&r.body).map_err(io::Error::other)?;
    ca["pem"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| io::Error::other("GET /v1/ca: no pem"))
}

/// The three paths: `direct-tls`, `blind-tunnel` (tool `blind`, TLS
/// end-to-end with the origin) and `intercepted` (tool `injected`, TLS with
/// the proxy's leaf, trusting the appliance CA from `GET /v1/ca`).
pub async fn paths(
    origin: &egress_e2e::tls_origin::TlsOrigin,
    proxy: &Egress,
    token: &str,
) -> io::Result<Vec<(String, TlsPath)>> {
    let appliance_pem = appliance_ca(proxy, token).await?;
    let authority = format!("{HOST}:{}", origin.addr.port());
    let via = |tool: &str| {
        let authority = authority.clone();
        let tool = tool.to_owned();
        async move {
            let (id, secret) = egress_e2e::harness::create_run_at(proxy.control, &tool).await;
            Path {
                name: tool,
                addr: proxy.addr,
                proxy: Some(ProxyTarget {
                    authority,
                    auth: Some(egress_e2e::harness::basic(&id, &secret)),
                }),
                pid: Some(proxy.daemon.pid()),
            }
        }
    };
    let origin_tls = connector(&origin.ca_pem)?;
    Ok(vec![
        (
            "direct-tls".into(),
            TlsPath {
                tcp: Path {
                    name: "direct-tls".into(),
                    addr: origin.addr,
                    proxy: None,
                    pid: None,
                },
                tls: origin_tls.clone(),
            },
        ),
        (
            "blind-tunnel".into(),
            TlsPath {
                tcp: via("blind").await,
                tls: origin_tls,
            },
        ),
        (
            "intercepted".into(),
            TlsPath {
                tcp: via("injected").await,
                tls: connector(&appliance_pem)?,
            },
        ),
    ])
}

/// The request every client sends (origin form: inside TLS).
pub fn request(origin: &egress_e2e::tls_origin::TlsOrigin) -> Vec<u8> {
    format!("GET {PATH} HTTP/1.1\r\nHost: {HOST}:{}\r\n\r\n", origin.addr.port()).into_bytes()
}

/// One request per path before any load, checked at the origin: the
/// credential arrives on the intercepted path and only there. (Each path's
/// TLS trusts one CA only, so a handshake also proves which side answered.)
pub async fn check(
    b: &Binder,
    origin: &egress_e2e::tls_origin::TlsOrigin,
    paths: &[(String, TlsPath)],
    req: &[u8],
) -> io::Result<()> {
    let want = format!("authorization: Bearer {SECRET}");
    for (name, path) in paths {
        let c = path
            .open(b)
            .await
            .map_err(|e| io::Error::other(format!("{name}: {e}")))?;
        load::exchange(c, req)
            .await
            .map_err(|e| io::Error::other(format!("{name}: {e}")))?;
        let head = origin.heads().pop().unwrap_or_default();
        if head.contains(&want) != (name == "intercepted") {
            return Err(io::Error::other(format!(
                "{name}: the origin received an unexpected credential header:\n{head}"
            )));
        }
    }
    Ok(())
}

/// `conns` keep-alive TLS connections, each sending `req` and reading the
/// response in a loop; a connection that fails is opened again (counted in
/// `errors`; the request is not retried, the next one pays the handshake).
pub async fn keepalive(b: &Arc<Binder>, path: &TlsPath, req: &[u8], conns: usize, t: &Timing) -> Window {
    let req: Arc<[u8]> = req.into();
    load::drive(conns, t, path.tcp.pid, |_, phase| {
        let (b, path, req) = (b.clone(), path.clone(), req.clone());
        async move {
            let mut lat = vec![];
            let mut errors = 0;
            let mut conn = None;
            while !phase.stopped() {
                let t0 = Instant::now();
                let c = match conn.take() {
                    Some(c) => c,
                    None => match path.open(&b).await {
                        Ok(c) => c,
                        Err(_) => {
                            errors += 1;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    },
                };
                match load::exchange(c, &req).await {
                    Ok((c, keep)) => {
                        conn = keep.then_some(c);
                        if phase.counting() {
                            lat.push(load::micros(t0.elapsed()));
                        }
                    }
                    Err(_) => errors += 1,
                }
            }
            (lat, errors)
        }
    })
    .await
}

/// New TLS connections, `in_flight` at a time: (CONNECT → `200` →) TLS
/// handshake → `req` → response → close (`close_notify`, FIN).
pub async fn new_conns(b: &Arc<Binder>, path: &TlsPath, req: &[u8], in_flight: usize, t: &Timing) -> Window {
    let req: Arc<[u8]> = req.into();
    load::drive(in_flight, t, path.tcp.pid, |_, phase| {
        let (b, path, req) = (b.clone(), path.clone(), req.clone());
        async move {
            let mut lat = vec![];
            let mut failed = 0;
            while !phase.stopped() {
                let t0 = Instant::now();
                let r = async {
                    let c = path.open(&b).await?;
                    let (mut c, _) = load::exchange(c, &req).await?;
                    c.s.shutdown().await
                }
                .await;
                match r {
                    Ok(()) => {
                        if phase.counting() {
                            lat.push(load::micros(t0.elapsed()));
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (lat, failed)
        }
    })
    .await
}
