//! TLS of the listeners (`[proxy.tls]`) and of the control plane
//! (`[control.tls]`), shared by the proxy's listeners, the executor's
//! listener and the executor's client of the proxy. With `[control.tls]` the server side asks for a client certificate and accepts one only
//! if it chains to `client_ca` (any other fails the handshake); a client
//! without one goes on to bearer tokens. A verified certificate's names
//! (its subject CNs and its DNS, URI and email SANs) are what a principal's
//! `subjects` match ([`PeerNames`]).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Why the control plane's TLS cannot be set up (the file and what is wrong).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: cannot read certificates: {msg}")]
    Cert { path: String, msg: String },
    #[error("{path}: cannot read the private key: {msg}")]
    Key { path: String, msg: String },
    #[error("TLS configuration rejected: {0}")]
    Config(String),
}

/// The names of the verified client certificate of a connection, put in
/// each of its requests' extensions by the listener.
#[derive(Debug, Clone, Default)]
pub struct PeerNames(pub Arc<[String]>);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in the PEM file at `path` (at least one).
pub fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let shown = path.display().to_string();
    let fail = |msg: String| TlsError::Cert {
        path: shown.clone(),
        msg,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| fail(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| fail(e.to_string()))?;
    if certs.is_empty() {
        return Err(fail("no CERTIFICATE block found".into()));
    }
    Ok(certs)
}

fn roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(path)? {
        roots.add(c).map_err(|e| TlsError::Cert {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// A listener's server configuration: `cert` and `key`, and, with
/// `client_ca`, client certificates verified against it (optional: a client
/// may present none and authenticate with a token).
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<rustls::ServerConfig, TlsError> {
    let chain = certs(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.display().to_string(),
        msg: e.to_string(),
    })?;
    let b = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let b = match client_ca {
        None => b.with_no_client_auth(),
        Some(ca) => b.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?,
        ),
    };
    let mut config = b
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The client configuration of a control-plane client: the server's
/// certificate verified against `server_ca`; a client certificate when
/// `identity` (cert, key) is given.
pub fn client_config(server_ca: &Path, identity: Option<(&Path, &Path)>) -> Result<rustls::ClientConfig, TlsError> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots(server_ca)?);
    let mut config = match identity {
        None => b.with_no_client_auth(),
        Some((cert, key)) => {
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
                path: key.display().to_string(),
                msg: e.to_string(),
            })?;
            b.with_client_auth_cert(certs(cert)?, key)
                .map_err(|e| TlsError::Config(e.to_string()))?
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The name a client verifies the server's certificate for, from the
/// host it dials (an IP address is verified as one).
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(host.to_owned()).map_err(|e| TlsError::Config(format!("{host}: {e}")))
}

/// The names of a verified client certificate (its leaf): subject CNs,
/// then DNS, URI and email SANs. Empty without a certificate.
pub fn peer_names(conn: &rustls::ServerConnection) -> PeerNames {
    let Some(leaf) = conn.peer_certificates().and_then(|c| c.first()) else {
        return PeerNames::default();
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(leaf.as_ref()) else {
        return PeerNames::default();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        use x509_parser::extensions::GeneralName;
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) | GeneralName::URI(d) | GeneralName::RFC822Name(d) => {
                    names.push((*d).to_owned())
                }
                _ => {}
            }
        }
    }
    names.truncate(32);
    PeerNames(names.into())
}
