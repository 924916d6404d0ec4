//! A sink's own connection: the host resolved by the proxy's resolver (an
//! IP literal as is), dialled directly within the timeout, TLS by rustls
//! with the sink's CA file or the system's roots. It never passes through
//! the data plane and makes no fact (no feedback loop).

use super::Failure;
use crate::dns::Resolve;
use egress_config::audit::Endpoint;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

/// Connects to `ep` within `timeout`, trying each address in turn.
pub(super) async fn dial(resolver: &dyn Resolve, ep: &Endpoint, timeout: Duration) -> Result<TcpStream, Failure> {
    let work = async {
        let ips: Vec<IpAddr> = match ep.host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => resolver
                .resolve(&ep.host)
                .await
                .map_err(|e| Failure::new("connect", format!("{}: DNS: {e}", ep.host)))?,
        };
        let mut last = String::from("no address");
        for ip in ips {
            match TcpStream::connect(SocketAddr::new(ip, ep.port)).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = format!("{ip}: {e}"),
            }
        }
        Err(Failure::new(
            "connect",
            format!("{}:{} unreachable ({last})", ep.host, ep.port),
        ))
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| Failure::new("timeout", format!("connecting to {}:{}", ep.host, ep.port)))?
}

/// A TLS client for a sink: `ca_file`'s certificates as roots, or the
/// system's; `alpn` offered when given.
pub(super) fn tls_config(ca_file: Option<&Path>, alpn: &[&[u8]]) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(p) => {
            for c in egress_api::tls::certs(p).map_err(|e| e.to_string())? {
                roots.add(c).map_err(|e| format!("{}: {e}", p.display()))?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(c);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The TLS session over `tcp`, the certificate checked for `name`.
pub(super) async fn tls(
    config: &Arc<rustls::ClientConfig>,
    name: &str,
    tcp: TcpStream,
    timeout: Duration,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, Failure> {
    let server = egress_api::tls::server_name(name).map_err(|e| Failure::new("tls", e.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(config.clone());
    match tokio::time::timeout(timeout, connector.connect(server, tcp)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(Failure::new("tls", format!("{name}: {e}"))),
        Err(_) => Err(Failure::new("timeout", format!("TLS handshake with {name}"))),
    }
}
