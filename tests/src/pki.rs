//! A private PKI for `[control.tls]` tests: a CA, leaves it signs (a
//! server's for 127.0.0.1, clients' naming a principal by SAN), written as
//! PEM files, and HTTPS calls to a control listener with or without a
//! client certificate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};

use crate::raw::RawResponse;

/// A CA that signs leaves.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

/// A leaf's certificate and key files.
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Writes the CA's certificate to `dir/<file>`.
    pub fn write(&self, dir: &Path, file: &str) -> PathBuf {
        let p = dir.join(file);
        std::fs::write(&p, &self.pem).unwrap();
        p
    }

    /// A leaf with subject CN `cn` and the SANs `dns` (IP addresses are
    /// IP SANs), written to `dir/<stem>.pem` and `dir/<stem>.key` (0600).
    pub fn leaf(&self, dir: &Path, stem: &str, cn: &str, sans: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans
            .iter()
            .map(|s| match s.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*s).try_into().unwrap()),
            })
            .collect();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let leaf = Leaf {
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).unwrap();
        std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&leaf.key, std::fs::Permissions::from_mode(0o600)).unwrap();
        leaf
    }
}

/// One HTTPS request to `addr` (verified against `ca`), presenting
/// `client` if given; `Err` with the reason when the handshake fails.
pub async fn https_call(
    addr: SocketAddr,
    ca: &Path,
    client: Option<&Leaf>,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
    token: Option<&str>,
) -> Result<RawResponse, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = egress_api::tls::client_config(ca, client.map(|l| (l.cert.as_path(), l.key.as_path())))
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = egress_api::tls::server_name(&addr.ip().to_string()).map_err(|e| e.to_string())?;
    let mut tls = connector.connect(name, tcp).await.map_err(|e| e.to_string())?;
    let req = crate::harness::control_request(method, path, body, token);
    tls.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    // TLS 1.3 reports a refused client certificate after the handshake, at
    // the first read.
    match tokio::time::timeout(std::time::Duration::from_secs(10), tls.read_to_end(&mut out)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if out.is_empty() => return Err(e.to_string()),
        Ok(Err(_)) => {}
        Err(_) => return Err("no answer within 10 s".into()),
    }
    crate::raw::parse(&out).ok_or_else(|| format!("not an HTTP answer: {:?}", String::from_utf8_lossy(&out)))
}
