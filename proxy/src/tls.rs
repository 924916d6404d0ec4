//! Optional TLS on both listeners (`[proxy.tls] cert/key`, PEM): the data
//! listener becomes an HTTPS proxy (clients use `--proxy https://…`) and the
//! control listener serves HTTPS. rustls with the ring provider.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: cannot read certificates: {msg}")]
    Cert { path: String, msg: String },
    #[error("{path}: cannot read the private key: {msg}")]
    Key { path: String, msg: String },
    #[error("TLS configuration rejected: {0}")]
    Config(String),
}

/// Builds the acceptor shared by both listeners.
pub fn acceptor(cfg: &egress_config::TlsConfig) -> Result<TlsAcceptor, TlsError> {
    let cert_path = cfg.cert.display().to_string();
    let key_path = cfg.key.display().to_string();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.cert)
        .map_err(|e| TlsError::Cert {
            path: cert_path.clone(),
            msg: e.to_string(),
        })?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Cert {
            path: cert_path.clone(),
            msg: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Cert {
            path: cert_path,
            msg: "no CERTIFICATE block found".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(&cfg.key).map_err(|e| TlsError::Key {
        path: key_path,
        msg: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let mut config = config;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
