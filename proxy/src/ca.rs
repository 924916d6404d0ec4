//! The appliance CA: the authority whose leaf certificates the proxy shows
//! a tool on the CONNECTs it intercepts (credential hosts, `inspect`), and
//! the roots it verifies those origins against.
//!
//! The CA lives in `[proxy.interception] ca_dir` (default: `ca/` beside the
//! facts store): `ca.key` (mode 0600, refused when group or others may read
//! it), `ca.pem`, and `bundle.pem` (the system roots plus the appliance CA,
//! which children are pointed at). It is generated on first start, loaded
//! on later starts and reloads, and replaced by `egress-proxy ca rotate`.
//! With `facts = ":memory:"` and no `ca_dir`, the CA is ephemeral: made at
//! start, its key never written, its public files in a private temporary
//! directory removed on exit.
//!
//! Leaves (ECDSA P-256, one key per authority, 30 days, renewed after 7) are
//! issued on the first CONNECT to a host and cached per host, under a byte
//! cap (`leaves.rs`). Every intercepted CONNECT shares one TLS server
//! configuration, which picks the leaf from the ClientHello's server name,
//! prefers AES-128-GCM with SHA-256 to the client's order, and resumes
//! sessions with tickets only (no per-session state).

mod leaves;

use egress_config::{Host, ProxyConfig};
use leaves::Leaves;
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use sha2::{Digest, Sha256};
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const BUNDLE: &str = "bundle.pem";

const CA_VALIDITY_DAYS: i64 = 10 * 365;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is readable by other users (mode {mode:04o}); the CA key must be 0600")]
    Permissive { path: PathBuf, mode: u32 },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error("cannot issue a certificate: {0}")]
    Issue(String),
    #[error("TLS configuration rejected: {0}")]
    Tls(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The files a child's TLS clients are pointed at.
#[derive(Debug, Clone)]
pub struct CaFiles {
    /// The appliance CA alone (`NODE_EXTRA_CA_CERTS`).
    pub cert: PathBuf,
    /// The system roots plus the appliance CA (`SSL_CERT_FILE`, ...).
    pub bundle: PathBuf,
}

/// A temporary directory removed when the (ephemeral) authority goes.
struct Ephemeral(PathBuf);

impl Drop for Ephemeral {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct Authority {
    /// `sha256:` of the CA certificate (DER), for logs and `/v1/ca`.
    pub fingerprint: String,
    pub pem: String,
    pub files: CaFiles,
    leaves: Arc<Leaves>,
    /// The server side of every intercepted CONNECT whose ClientHello names
    /// its host: the leaf comes from the cache by that name.
    server: Arc<rustls::ServerConfig>,
    /// How intercepted origins are verified.
    upstream: Upstream,
    ephemeral: Option<Ephemeral>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("fingerprint", &self.fingerprint)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The shared server side of intercepted CONNECTs, its leaf from
/// `resolver`. Sessions resume with TLS 1.3 (and 1.2) tickets sealed by a
/// key of this authority (rotated every 6 hours, gone with a CA rotation
/// or reload) and never from server-side state: nothing is stored per
/// session, so nothing needs a bound.
fn server_config(resolver: Arc<dyn rustls::server::ResolvesServerCert>) -> Result<Arc<rustls::ServerConfig>, CaError> {
    let tls = |e: rustls::Error| CaError::Tls(e.to_string());
    // The suites in this order whatever the client's: AES-128-GCM with
    // SHA-256 first, whose key schedule costs the proxy less than
    // SHA-384's on every handshake (clients are local, with AES-NI).
    let mut server_provider = rustls::crypto::ring::default_provider();
    server_provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(server_provider))
        .with_safe_default_protocol_versions()
        .map_err(tls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.ignore_client_order = true;
    // h2 first: a tool that speaks it gets it (each stream one request,
    // `data::entrance::h2`); the rest keep HTTP/1.1.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(tls)?;
    Ok(Arc::new(config))
}

/// Where the CA lives for `cfg` (`None`: ephemeral).
pub fn ca_dir(cfg: &ProxyConfig) -> Option<PathBuf> {
    if let Some(d) = &cfg.interception.ca_dir {
        return Some(d.clone());
    }
    if cfg.facts.as_os_str() == ":memory:" {
        return None;
    }
    Some(cfg.home().join("ca"))
}

impl Authority {
    /// Loads the CA of `cfg` (generating it on first start), writes the
    /// bundle, and reads the roots for origins.
    pub fn open(cfg: &ProxyConfig) -> Result<Authority, CaError> {
        Authority::open_in(ca_dir(cfg).as_deref(), cfg)
    }

    /// [`Authority::open`] in `dir` (`None`: ephemeral).
    pub fn open_in(dir: Option<&Path>, cfg: &ProxyConfig) -> Result<Authority, CaError> {
        // Read once: the children's bundle and (without a lab file) the
        // origins' roots.
        let system = system_roots();
        let upstream = upstream_connector(cfg.interception.upstream_ca_file.as_deref(), &system)?;
        match dir {
            Some(dir) => {
                let (cert_pem, key) = match load(dir)? {
                    Some(ca) => ca,
                    None => {
                        let (pem, key) = generate()?;
                        write_ca(dir, &pem, &key)?;
                        tracing::info!(dir = %dir.display(), "generated the appliance CA");
                        (pem, key)
                    }
                };
                Authority::new(dir, cert_pem, key, upstream, &system, None)
            }
            None => {
                let dir = std::env::temp_dir().join(format!(
                    "loom-egress-ca-{}",
                    crate::runs::random_hex(8).map_err(|e| CaError::Issue(e.to_string()))?
                ));
                create_public_dir(&dir)?;
                let guard = Ephemeral(dir.clone());
                let (pem, key) = generate()?;
                write_file(&dir.join(CA_CERT), pem.as_bytes(), 0o644)?;
                Authority::new(&dir, pem, key, upstream, &system, Some(guard))
            }
        }
    }

    fn new(
        dir: &Path,
        pem: String,
        key: KeyPair,
        upstream: Upstream,
        system: &[CertificateDer<'static>],
        ephemeral: Option<Ephemeral>,
    ) -> Result<Authority, CaError> {
        let cert_path = dir.join(CA_CERT);
        let ca_der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| CaError::Invalid {
            path: cert_path.clone(),
            msg: e.to_string(),
        })?;
        let issuer = Issuer::from_ca_cert_der(&ca_der, key).map_err(|e| CaError::Invalid {
            path: cert_path.clone(),
            msg: e.to_string(),
        })?;
        let bundle = dir.join(BUNDLE);
        write_file(&bundle, bundle_text(&pem, system).as_bytes(), 0o644)?;
        let leaves = Arc::new(Leaves::new(issuer, ca_der.clone(), &provider(), leaves::CACHE_BYTES)?);
        Ok(Authority {
            fingerprint: fingerprint(&ca_der),
            server: server_config(Arc::new(leaves::BySni(leaves.clone())))?,
            pem,
            files: CaFiles {
                cert: cert_path,
                bundle,
            },
            leaves,
            upstream,
            ephemeral,
        })
    }

    /// Whether the CA lives only as long as this process.
    pub fn is_ephemeral(&self) -> bool {
        self.ephemeral.is_some()
    }

    /// The server side of an intercepted CONNECT to `host`, for a
    /// ClientHello naming `sni` (which the caller has checked is `host`):
    /// the configuration every such CONNECT shares. Without a name (an
    /// address, or a client that sends none), a copy of it whose resolver
    /// holds only `host`'s leaf, for this handshake; it shares the rest
    /// (tickets, provider) and is never cached. Either way the leaf is
    /// issued here when missing, so an error surfaces to the caller.
    pub fn server_config(&self, host: &Host, sni: Option<&str>) -> Result<Arc<rustls::ServerConfig>, CaError> {
        let leaf = self.leaves.get(host)?;
        match (host, sni) {
            (Host::Name(n), Some(sni)) if *n == leaves::normalize(sni) => Ok(self.server.clone()),
            _ => {
                let mut own = (*self.server).clone();
                own.cert_resolver = Arc::new(leaves::Fixed(leaf));
                Ok(Arc::new(own))
            }
        }
    }

    /// Opens TLS to an intercepted origin over `io` (already dialled to a
    /// vetted address), verifying its certificate for `host`, offering `h2`
    /// and `http/1.1` by ALPN (the origin picks; see [`alpn_h2`]).
    pub async fn connect<IO>(&self, host: &Host, io: IO) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        self.connect_with(&self.upstream.any, host, io).await
    }

    /// [`Authority::connect`] offering `http/1.1` only: for a request that
    /// must stay HTTP/1.1 (a WebSocket handshake; RFC 8441's extended
    /// CONNECT is not offered).
    pub async fn connect_h1<IO>(&self, host: &Host, io: IO) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        self.connect_with(&self.upstream.h1, host, io).await
    }

    async fn connect_with<IO>(
        &self,
        connector: &tokio_rustls::TlsConnector,
        host: &Host,
        io: IO,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let name = match host {
            Host::Name(n) => ServerName::try_from(n.clone())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?,
            Host::Ip(ip) => ServerName::IpAddress((*ip).into()),
        };
        connector.connect(name, io).await
    }
}

/// Whether a TLS connection (either side) agreed on `h2` by ALPN.
pub fn alpn_h2(conn: &rustls::CommonState) -> bool {
    conn.alpn_protocol() == Some(b"h2")
}

/// `sha256:` and the hex digest of a certificate.
fn fingerprint(der: &CertificateDer<'_>) -> String {
    let mut s = String::from("sha256:");
    for b in Sha256::digest(der.as_ref()) {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// A new CA: its certificate (PEM) and key.
fn generate() -> Result<(String, KeyPair), CaError> {
    let e = |e: rcgen::Error| CaError::Issue(e.to_string());
    let key = KeyPair::generate().map_err(e)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "Loom Egress appliance CA");
    dn.push(DnType::OrganizationName, "Loom Egress");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = ::time::OffsetDateTime::now_utc();
    params.not_before = now - ::time::Duration::days(1);
    params.not_after = now + ::time::Duration::days(CA_VALIDITY_DAYS);
    let cert = params.self_signed(&key).map_err(e)?;
    Ok((cert.pem(), key))
}

/// The CA in `dir`, if there is one. A key without a certificate (or the
/// reverse) is an error, not a reason to make a new CA.
fn load(dir: &Path) -> Result<Option<(String, KeyPair)>, CaError> {
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    let key_text = match std::fs::read_to_string(&key_path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(&key_path)(e)),
    };
    let cert_text = match std::fs::read_to_string(&cert_path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(&cert_path)(e)),
    };
    let (cert, key) = match (cert_text, key_text) {
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (c, k),
        (Some(_), None) => {
            return Err(CaError::Invalid {
                path: key_path,
                msg: format!("missing, but {} exists", cert_path.display()),
            })
        }
        (None, Some(_)) => {
            return Err(CaError::Invalid {
                path: cert_path,
                msg: format!("missing, but {} exists", key_path.display()),
            })
        }
    };
    let mode = std::fs::metadata(&key_path)
        .map_err(io(&key_path))?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 != 0 {
        return Err(CaError::Permissive { path: key_path, mode });
    }
    let key = KeyPair::from_pem(&key).map_err(|e| CaError::Invalid {
        path: key_path,
        msg: e.to_string(),
    })?;
    Ok(Some((cert, key)))
}

/// Writes a new CA into `dir`: the key (0600) first, then the certificate.
fn write_ca(dir: &Path, cert_pem: &str, key: &KeyPair) -> Result<(), CaError> {
    create_public_dir(dir)?;
    write_file(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&dir.join(CA_CERT), cert_pem.as_bytes(), 0o644)
}

/// Replaces the CA in `dir` with a new one; returns its fingerprint. A
/// running proxy takes it on its next reload.
pub fn rotate(dir: &Path) -> Result<String, CaError> {
    let (pem, key) = generate()?;
    write_ca(dir, &pem, &key)?;
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| CaError::Issue(e.to_string()))?;
    write_file(&dir.join(BUNDLE), bundle_text(&pem, &system_roots()).as_bytes(), 0o644)?;
    Ok(fingerprint(&der))
}

/// The CA's directory: created traversable by everyone, since confined
/// children (other uids) read `bundle.pem` and `ca.pem` in it.
fn create_public_dir(dir: &Path) -> Result<(), CaError> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(io(dir))?;
    }
    Ok(())
}

/// Writes `path` whole or not at all (a temporary file renamed over it).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CaError> {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The system's root certificates (distribution paths, `SSL_CERT_FILE`,
/// `SSL_CERT_DIR`).
fn system_roots() -> Vec<CertificateDer<'static>> {
    let roots = rustls_native_certs::load_native_certs().certs;
    if roots.is_empty() {
        tracing::warn!("no system root certificates found: the children's bundle holds the appliance CA only");
    }
    roots
}

/// The system roots (PEM) followed by the appliance CA.
fn bundle_text(ca_pem: &str, system: &[CertificateDer<'_>]) -> String {
    use base64::Engine as _;
    let mut out = String::new();
    for c in system {
        out.push_str("-----BEGIN CERTIFICATE-----\n");
        let b64 = base64::engine::general_purpose::STANDARD.encode(c.as_ref());
        for line in b64.as_bytes().chunks(64) {
            out.push_str(std::str::from_utf8(line).unwrap_or_default());
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
    }
    out.push_str(ca_pem);
    out
}

/// The TLS clients of intercepted origins: one verification, two ALPN offers.
struct Upstream {
    /// `h2` and `http/1.1`.
    any: tokio_rustls::TlsConnector,
    /// `http/1.1` only.
    h1: tokio_rustls::TlsConnector,
}

/// Verifies origins against `file` (PEM), or the system roots.
fn upstream_connector(file: Option<&Path>, system: &[CertificateDer<'static>]) -> Result<Upstream, CaError> {
    let mut roots = rustls::RootCertStore::empty();
    match file {
        Some(path) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<_, _>>())
                .map_err(|e| CaError::Invalid {
                    path: path.to_owned(),
                    msg: e.to_string(),
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(CaError::Invalid {
                    path: path.to_owned(),
                    msg: "no usable CERTIFICATE block (proxy.interception.upstream_ca_file)".into(),
                });
            }
        }
        None => {
            let (added, _) = roots.add_parsable_certificates(system.iter().cloned());
            if added == 0 {
                tracing::warn!("no system root certificates: every intercepted origin will fail with upstream_tls");
            }
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| CaError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    // HTTP/1.1 only: for what must stay HTTP/1.1 (a WebSocket handshake).
    let mut h1 = config.clone();
    h1.alpn_protocols = vec![b"http/1.1".to_vec()];
    // Both otherwise: the origin picks, the session bridges what differs.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Upstream {
        any: tokio_rustls::TlsConnector::from(Arc::new(config)),
        h1: tokio_rustls::TlsConnector::from(Arc::new(h1)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path) -> ProxyConfig {
        ProxyConfig {
            facts: dir.join("facts.db"),
            ..Default::default()
        }
    }

    #[test]
    fn the_ca_is_made_once_kept_private_and_loaded_again() {
        let dir = tempfile::tempdir().unwrap();
        let a = Authority::open(&cfg(dir.path())).unwrap();
        let ca = dir.path().join("ca");
        let mode = |f: &str| std::fs::metadata(ca.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(CA_KEY), 0o600);
        assert_eq!(mode(CA_CERT), 0o644);
        assert_eq!(mode(BUNDLE), 0o644);
        let bundle = std::fs::read_to_string(ca.join(BUNDLE)).unwrap();
        assert!(bundle.ends_with(&a.pem), "the bundle ends with the appliance CA");
        let b = Authority::open(&cfg(dir.path())).unwrap();
        assert_eq!(a.fingerprint, b.fingerprint, "a second start loads the same CA");
        // A readable key is refused, not used.
        std::fs::set_permissions(ca.join(CA_KEY), std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Authority::open(&cfg(dir.path())).unwrap_err().to_string();
        assert!(e.contains("the CA key must be 0600"), "{e}");
        std::fs::set_permissions(ca.join(CA_KEY), std::fs::Permissions::from_mode(0o600)).unwrap();
        // Rotation makes a new one.
        let f = rotate(&ca).unwrap();
        assert_ne!(f, a.fingerprint);
        assert_eq!(Authority::open(&cfg(dir.path())).unwrap().fingerprint, f);
    }

    #[test]
    fn a_memory_store_gets_an_ephemeral_ca_whose_files_go_with_it() {
        let c = ProxyConfig {
            facts: PathBuf::from(":memory:"),
            ..Default::default()
        };
        let a = Authority::open(&c).unwrap();
        assert!(a.is_ephemeral());
        let dir = a.files.cert.parent().unwrap().to_owned();
        assert!(a.files.bundle.exists() && !dir.join(CA_KEY).exists());
        drop(a);
        assert!(!dir.exists());
    }

    /// A verifier trusting only `ca`, at `now`.
    fn verifier(ca: &CertificateDer<'static>) -> Arc<rustls::client::WebPkiServerVerifier> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .unwrap()
    }

    pub(super) fn verify_at(
        ca: &CertificateDer<'static>,
        leaf: &CertificateDer<'_>,
        name: &str,
        now: rustls::pki_types::UnixTime,
    ) -> Result<(), rustls::Error> {
        let name = ServerName::try_from(name.to_owned()).unwrap();
        rustls::client::danger::ServerCertVerifier::verify_server_cert(&*verifier(ca), leaf, &[], &name, &[], now)
            .map(|_| ())
    }

    fn verify(ca: &CertificateDer<'static>, leaf: &CertificateDer<'_>, name: &str) -> Result<(), rustls::Error> {
        verify_at(ca, leaf, name, rustls::pki_types::UnixTime::now())
    }

    #[test]
    fn leaves_chain_to_the_ca_and_are_cached_per_host() {
        let dir = tempfile::tempdir().unwrap();
        let a = Authority::open(&cfg(dir.path())).unwrap();
        let h = Host::Name("api.example".into());
        let one = a.leaves.get(&h).unwrap();
        assert!(Arc::ptr_eq(&one, &a.leaves.get(&h).unwrap()));
        assert!(!Arc::ptr_eq(
            &one,
            &a.leaves.get(&Host::Name("b.example".into())).unwrap()
        ));
        assert_eq!(one.cert[1], a.leaves.ca_der, "the CA follows the leaf");
        // A client that trusts only the CA accepts the leaf for its host only.
        let leaf = &one.cert[0];
        assert!(verify(&a.leaves.ca_der, leaf, "api.example").is_ok());
        assert!(verify(&a.leaves.ca_der, leaf, "other.example").is_err());
        for ip in ["127.0.0.9", "::1"] {
            let cert = a.leaves.certificate(&Host::Ip(ip.parse().unwrap())).unwrap();
            assert!(verify(&a.leaves.ca_der, &cert, ip).is_ok(), "{ip}");
        }
        // Another CA's leaf is not accepted.
        let other = tempfile::tempdir().unwrap();
        let b = Authority::open(&cfg(other.path())).unwrap();
        assert!(verify(&a.leaves.ca_der, &b.leaves.certificate(&h).unwrap(), "api.example").is_err());
    }

    /// A client trusting only `ca`, sending a server name or not.
    fn client(ca: &CertificateDer<'static>, sni: bool) -> Arc<rustls::ClientConfig> {
        client_with(ca, sni, provider())
    }

    /// [`client`] offering the cipher suites of `provider`.
    fn client_with(
        ca: &CertificateDer<'static>,
        sni: bool,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        let mut c = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        c.enable_sni = sni;
        Arc::new(c)
    }

    /// A whole handshake in memory between `client` (verifying `name`) and
    /// `server`; the chain the server showed.
    fn handshake(
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
        name: &str,
    ) -> Result<Vec<CertificateDer<'static>>, rustls::Error> {
        handshake_suite(server, client, name).map(|(chain, _)| chain)
    }

    /// [`handshake`], with the cipher suite the two agreed on.
    fn handshake_suite(
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
        name: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, Option<rustls::CipherSuite>), rustls::Error> {
        fn transfer(from: &mut rustls::Connection, to: &mut rustls::Connection) -> Result<(), rustls::Error> {
            let mut buf = Vec::new();
            while from.wants_write() {
                from.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                to.read_tls(&mut rd).unwrap();
                to.process_new_packets()?;
            }
            Ok(())
        }
        let name = ServerName::try_from(name.to_owned()).unwrap();
        let mut c = rustls::Connection::Client(rustls::ClientConnection::new(client, name)?);
        let mut s = rustls::Connection::Server(rustls::ServerConnection::new(server)?);
        for _ in 0..8 {
            if !c.is_handshaking() && !s.is_handshaking() {
                let chain = c.peer_certificates().unwrap_or_default();
                let suite = c.negotiated_cipher_suite().map(|s| s.suite());
                return Ok((chain.iter().map(|c| c.clone().into_owned()).collect(), suite));
            }
            transfer(&mut c, &mut s)?;
            transfer(&mut s, &mut c)?;
        }
        Err(rustls::Error::General("the handshake did not finish".into()))
    }

    #[test]
    fn many_names_share_one_server_configuration_each_with_its_own_leaf() {
        let dir = tempfile::tempdir().unwrap();
        let a = Authority::open(&cfg(dir.path())).unwrap();
        let shared = a
            .server_config(&Host::Name("n0.example".into()), Some("n0.example"))
            .unwrap();
        for i in 0..64 {
            let name = format!("n{i}.example");
            let config = a.server_config(&Host::Name(name.clone()), Some(&name)).unwrap();
            assert!(Arc::ptr_eq(&config, &shared), "{name} has a configuration of its own");
            // The client verifies the leaf for the name it asked for.
            let chain = handshake(config, client(&a.leaves.ca_der, true), &name).unwrap();
            assert!(verify(&a.leaves.ca_der, &chain[0], &name).is_ok(), "{name}");
        }
        // A name in another case, or with the trailing dot, is the same host.
        let upper = a
            .server_config(&Host::Name("n1.example".into()), Some("N1.Example."))
            .unwrap();
        assert!(Arc::ptr_eq(&upper, &shared));
        assert_eq!(a.leaves.held().0, 64, "one leaf per name");
    }

    #[test]
    fn a_client_hello_without_a_name_gets_the_connect_host_s_leaf() {
        let dir = tempfile::tempdir().unwrap();
        let a = Authority::open(&cfg(dir.path())).unwrap();
        let anonymous = client(&a.leaves.ca_der, false);
        let h = Host::Name("api.example".into());
        let config = a.server_config(&h, None).unwrap();
        assert!(!Arc::ptr_eq(&config, &a.server), "a configuration for this handshake");
        let chain = handshake(config, anonymous.clone(), "api.example").unwrap();
        assert!(verify(&a.leaves.ca_der, &chain[0], "api.example").is_ok());
        // The shared configuration has no name to find a leaf by.
        assert!(handshake(a.server.clone(), anonymous.clone(), "api.example").is_err());
        // Addresses: clients send no server name for them.
        for ip in ["127.0.0.9", "::1"] {
            let config = a.server_config(&Host::Ip(ip.parse().unwrap()), None).unwrap();
            let chain = handshake(config, client(&a.leaves.ca_der, true), ip).unwrap();
            assert!(verify(&a.leaves.ca_der, &chain[0], ip).is_ok(), "{ip}");
        }
        // A name that is not the host's (refused by the caller before) does
        // not reach the shared configuration either.
        let config = a.server_config(&h, Some("other.example")).unwrap();
        assert!(!Arc::ptr_eq(&config, &a.server));
        assert!(handshake(config, client(&a.leaves.ca_der, true), "other.example").is_err());
    }

    #[test]
    fn the_proxy_picks_aes_128_gcm_whatever_the_client_prefers() {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
        let dir = tempfile::tempdir().unwrap();
        let a = Authority::open(&cfg(dir.path())).unwrap();
        let h = Host::Name("api.example".into());
        let config = || a.server_config(&h, Some("api.example")).unwrap();
        // rustls' clients (like OpenSSL's) list AES-256-GCM first.
        let preferring = client(&a.leaves.ca_der, true);
        assert_eq!(
            preferring.crypto_provider().cipher_suites[0].suite(),
            TLS13_AES_256_GCM_SHA384
        );
        let (_, suite) = handshake_suite(config(), preferring, "api.example").unwrap();
        assert_eq!(suite, Some(TLS13_AES_128_GCM_SHA256));
        // A client offering AES-256-GCM only still gets it.
        let mut only = rustls::crypto::ring::default_provider();
        only.cipher_suites.retain(|s| s.suite() == TLS13_AES_256_GCM_SHA384);
        let only = client_with(&a.leaves.ca_der, true, Arc::new(only));
        let (_, suite) = handshake_suite(config(), only, "api.example").unwrap();
        assert_eq!(suite, Some(TLS13_AES_256_GCM_SHA384));
    }
}
