//! An HTTPS origin for interception tests: a test CA of its own (the
//! proxy's `upstream_ca_file` in the tests), a leaf for the names given,
//! and a recording of every request head it receives. It answers `ok`
//! without echoing anything, so what a client received can be checked for
//! the secret apart from what the origin saw.

use crate::origin::{self, Heads};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;

pub struct TlsOrigin {
    pub addr: SocketAddr,
    /// The origin's CA, PEM.
    pub ca_pem: String,
    heads: Heads,
    conns: Arc<Conns>,
}

/// The TLS connections the origin accepted, and how many of them are open.
#[derive(Default)]
struct Conns {
    accepted: AtomicUsize,
    open: AtomicUsize,
}

impl TlsOrigin {
    /// Every request head received so far (the first 10 000): `METHOD target` then the headers,
    /// one per line, names lower-case.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }

    /// TLS connections accepted so far (handshake complete).
    pub fn accepted(&self) -> usize {
        self.conns.accepted.load(Ordering::SeqCst)
    }

    /// TLS connections accepted and not yet closed.
    pub fn open(&self) -> usize {
        self.conns.open.load(Ordering::SeqCst)
    }

    /// Writes the origin's CA into `dir`; returns the file.
    pub fn write_ca(&self, dir: &Path) -> PathBuf {
        let p = dir.join(format!("origin-ca-{}.pem", self.addr.port()));
        std::fs::write(&p, &self.ca_pem).unwrap();
        p
    }
}

/// The ALPN offer of a test server or client: `h2` and `http/1.1`, or
/// `http/1.1` alone.
pub fn alpn(h2: bool) -> &'static [&'static [u8]] {
    if h2 {
        &[b"h2", b"http/1.1"]
    } else {
        &[b"http/1.1"]
    }
}

/// A TLS server configuration for `names` under a test CA of its own,
/// offering `alpn`; and that CA, PEM (what the proxy is to trust).
pub fn test_server_config(names: &[&str], alpn: &[&[u8]]) -> (rustls::ServerConfig, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "test origin CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let leaf = CertificateParams::new(names).unwrap().signed_by(&key, &issuer).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone(), ca_cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    (config, ca_cert.pem())
}

/// Starts an HTTPS origin on `addr` whose certificate names `names`.
pub async fn tls_origin(addr: &str, names: &[&str]) -> TlsOrigin {
    let (config, ca_pem) = test_server_config(names, &[]);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let heads = Heads::default();
    let h = heads.clone();
    let conns = Arc::new(Conns::default());
    let counted = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            // As real origins do: with Nagle on, the response written
            // after the session tickets waits for the client's delayed ACK
            // (~40 ms), which a benchmark of new connections would measure.
            let _ = s.set_nodelay(true);
            let (acceptor, h, counted) = (acceptor.clone(), h.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else { return };
                counted.accepted.fetch_add(1, Ordering::SeqCst);
                counted.open.fetch_add(1, Ordering::SeqCst);
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    origin::record(&h, &req);
                    let resp = origin::echo(&req).unwrap_or_else(|| {
                        Response::new(
                            Full::new(Bytes::from_static(b"ok from the tls origin\n"))
                                .map_err(|e| match e {})
                                .boxed(),
                        )
                    });
                    async { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
                counted.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    TlsOrigin {
        addr,
        ca_pem,
        heads,
        conns,
    }
}
