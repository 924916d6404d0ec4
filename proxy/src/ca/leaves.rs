//! The leaf certificates the proxy shows a tool on intercepted CONNECTs:
//! issued by the appliance CA for a host on first use (ECDSA P-256, one key
//! per authority, valid 30 days, replaced after 7), kept in a cache bounded
//! in bytes that lets the least recently used go first, and found by the
//! TLS server configuration that every intercepted CONNECT shares, from the
//! ClientHello's server name ([`BySni`]).

use super::CaError;
use egress_config::Host;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a leaf is valid, and when a cached one is replaced.
pub(super) const LEAF_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
pub(super) const LEAF_RENEW: Duration = Duration::from_secs(7 * 24 * 3600);
/// What the cached leaves may hold: an `inspect` tool with a `*.` rule can
/// name any number of hosts. At about 1.2 KiB a leaf, some 13,000 leaves.
pub(super) const CACHE_BYTES: usize = 16 << 20;

/// The leaves of one authority and where they come from.
pub(super) struct Leaves {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, sent after each leaf.
    pub(super) ca_der: CertificateDer<'static>,
    /// The one key of every leaf, for rcgen (signing the certificates) and
    /// for rustls (the handshakes).
    key: KeyPair,
    signer: Arc<dyn rustls::sign::SigningKey>,
    /// A cached leaf older than this is issued again.
    renew: Duration,
    cache: Mutex<Cache>,
}

impl Leaves {
    pub(super) fn new(
        issuer: Issuer<'static, KeyPair>,
        ca_der: CertificateDer<'static>,
        provider: &rustls::crypto::CryptoProvider,
        cap: usize,
    ) -> Result<Leaves, CaError> {
        let key = KeyPair::generate().map_err(|e| CaError::Issue(e.to_string()))?;
        let der = PrivateKeyDer::try_from(key.serialize_der()).map_err(|m| CaError::Issue(m.to_owned()))?;
        let signer = provider
            .key_provider
            .load_private_key(der)
            .map_err(|e| CaError::Tls(e.to_string()))?;
        Ok(Leaves {
            issuer,
            ca_der,
            key,
            signer,
            renew: LEAF_RENEW,
            cache: Mutex::new(Cache::new(cap)),
        })
    }

    /// The leaf (with the CA after it) for `host`: the cached one while it
    /// is younger than the renewal age, else a new one, cached.
    pub(super) fn get(&self, host: &Host) -> Result<Arc<CertifiedKey>, CaError> {
        let name = host.to_string();
        if let Some(k) = self.lock().get(&name, self.renew) {
            return Ok(k);
        }
        // Issued outside the lock: two first handshakes for one host may
        // both sign, and the second leaf replaces the first.
        let leaf = Arc::new(CertifiedKey::new(
            vec![self.certificate(host)?, self.ca_der.clone()],
            self.signer.clone(),
        ));
        self.lock().insert(name, leaf.clone());
        Ok(leaf)
    }

    /// A leaf certificate for `host`, signed by the CA.
    pub(super) fn certificate(&self, host: &Host) -> Result<CertificateDer<'static>, CaError> {
        let e = |e: rcgen::Error| CaError::Issue(e.to_string());
        let san = match host {
            Host::Name(n) => SanType::DnsName(n.clone().try_into().map_err(e)?),
            Host::Ip(ip) => SanType::IpAddress(*ip),
        };
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![san];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host.to_string());
        params.distinguished_name = dn;
        let now = ::time::OffsetDateTime::now_utc();
        params.not_before = now - ::time::Duration::hours(1);
        params.not_after = now + LEAF_VALIDITY;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        Ok(params.signed_by(&self.key, &self.issuer).map_err(e)?.der().clone())
    }

    /// (leaves, bytes) held now.
    #[cfg(test)]
    pub(super) fn held(&self) -> (usize, usize) {
        let c = self.lock();
        (c.map.len(), c.bytes)
    }

    #[cfg(test)]
    pub(super) fn set_renew(&mut self, renew: Duration) {
        self.renew = renew;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // A panic while holding the lock leaves a consistent cache.
        self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Resolves the leaf from the ClientHello's server name: the certificate
/// resolver of the server configuration all intercepted CONNECTs share.
/// The session has checked that the name is the CONNECT host before it
/// hands the configuration over; a ClientHello without a name gets a
/// configuration of its own with [`Fixed`] instead.
pub(super) struct BySni(pub(super) Arc<Leaves>);

impl std::fmt::Debug for BySni {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BySni")
    }
}

impl ResolvesServerCert for BySni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // rustls gives names in lower case without a trailing dot.
        let host = Host::Name(normalize(hello.server_name()?));
        match self.0.get(&host) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::error!(error = %e, %host, "cannot issue a leaf certificate");
                None
            }
        }
    }
}

/// One leaf, for a handshake whose ClientHello names no server.
#[derive(Debug)]
pub(super) struct Fixed(pub(super) Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// A server name as the cache keys it (a canonical host name).
pub(super) fn normalize(sni: &str) -> String {
    sni.trim_end_matches('.').to_ascii_lowercase()
}

struct Entry {
    leaf: Arc<CertifiedKey>,
    made: Instant,
    /// Its key in `Cache::order`.
    used: u64,
    bytes: usize,
}

/// Leaves by host, with the bytes they hold, least recently used first.
struct Cache {
    map: HashMap<String, Entry>,
    order: BTreeMap<u64, String>,
    tick: u64,
    bytes: usize,
    cap: usize,
}

/// Malloc's header on each of an entry's allocations.
const ALLOC_HEADER: usize = 16;

/// What one entry holds: its name twice (map key, `order`), both
/// certificates, the certified key, the slots of both maps and a header per
/// allocation (name ×2, certificate ×2, certificate list, certified key).
fn entry_bytes(name: &str, leaf: &CertifiedKey) -> usize {
    let certs: usize = leaf.cert.iter().map(|c| c.len()).sum();
    2 * name.len()
        + certs
        + leaf.cert.len() * std::mem::size_of::<CertificateDer<'static>>()
        + std::mem::size_of::<(Arc<()>, CertifiedKey)>()
        + std::mem::size_of::<(String, Entry)>()
        + std::mem::size_of::<(u64, String)>()
        + 6 * ALLOC_HEADER
}

impl Cache {
    fn new(cap: usize) -> Cache {
        Cache {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            cap,
        }
    }

    /// The leaf of `name` if it is younger than `renew`; marks it used.
    fn get(&mut self, name: &str, renew: Duration) -> Option<Arc<CertifiedKey>> {
        self.tick += 1;
        let tick = self.tick;
        let e = self.map.get_mut(name)?;
        if e.made.elapsed() >= renew {
            return None;
        }
        if let Some(n) = self.order.remove(&e.used) {
            self.order.insert(tick, n);
        }
        e.used = tick;
        Some(e.leaf.clone())
    }

    /// Caches `leaf` for `name` (replacing an older one), letting the least
    /// recently used go until it fits. A leaf larger than the whole cap is
    /// not kept.
    fn insert(&mut self, name: String, leaf: Arc<CertifiedKey>) {
        self.remove(&name);
        let bytes = entry_bytes(&name, &leaf);
        if bytes > self.cap {
            return;
        }
        while self.bytes + bytes > self.cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.remove(&oldest);
        }
        self.tick += 1;
        self.order.insert(self.tick, name.clone());
        self.bytes += bytes;
        self.map.insert(
            name,
            Entry {
                leaf,
                made: Instant::now(),
                used: self.tick,
                bytes,
            },
        );
    }

    fn remove(&mut self, name: &str) {
        if let Some(e) = self.map.remove(name) {
            self.order.remove(&e.used);
            self.bytes -= e.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The leaves of a new CA, cached under `cap` bytes.
    fn leaves(cap: usize) -> (Leaves, CertificateDer<'static>) {
        let (pem, key) = super::super::generate().unwrap();
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        let issuer = Issuer::from_ca_cert_der(&der, key).unwrap();
        let provider = rustls::crypto::ring::default_provider();
        (Leaves::new(issuer, der.clone(), &provider, cap).unwrap(), der)
    }

    use rustls::pki_types::pem::PemObject;

    fn name(i: usize) -> Host {
        Host::Name(format!("host-{i}.example"))
    }

    #[test]
    fn the_cache_stays_within_its_byte_cap_and_lets_the_least_recently_used_go() {
        let (one, _) = leaves(CACHE_BYTES);
        let per_leaf = {
            one.get(&name(0)).unwrap();
            one.held().1
        };
        assert!(per_leaf < 2048, "{per_leaf} bytes per leaf");
        let cap = 10 * per_leaf + per_leaf / 2;
        let (l, _) = leaves(cap);
        let kept = Host::Name("kept.example".into());
        let first_kept = l.get(&kept).unwrap();
        let first = l.get(&name(0)).unwrap();
        for i in 1..100 {
            l.get(&name(i)).unwrap();
            // Used between every issue: never the least recently used.
            assert!(
                Arc::ptr_eq(&first_kept, &l.get(&kept).unwrap()),
                "kept.example was let go at {i}"
            );
            let (n, bytes) = l.held();
            assert!(bytes <= cap, "{bytes} bytes held, cap {cap}");
            assert!(n <= 10, "{n} leaves");
        }
        assert_eq!(l.held().0, 10, "the cache is full, not emptied");
        // The most recent names are cached; the first went and is issued anew.
        let last = l.get(&name(99)).unwrap();
        assert!(Arc::ptr_eq(&last, &l.get(&name(99)).unwrap()));
        assert!(!Arc::ptr_eq(&first, &l.get(&name(0)).unwrap()));
        // A cap smaller than one leaf caches nothing, and still issues.
        let (none, _) = leaves(per_leaf / 2);
        assert!(none.get(&name(1)).is_ok());
        assert_eq!(none.held(), (0, 0));
    }

    #[test]
    fn leaves_are_valid_30_days_and_issued_again_after_the_renewal_age() {
        let (mut l, ca) = leaves(CACHE_BYTES);
        let h = name(1);
        let a = l.get(&h).unwrap();
        assert!(Arc::ptr_eq(&a, &l.get(&h).unwrap()), "cached while young");
        let at = |days: u64| {
            rustls::pki_types::UnixTime::since_unix_epoch(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    + Duration::from_secs(days * 24 * 3600),
            )
        };
        let leaf = &a.cert[0];
        assert!(crate::ca::tests::verify_at(&ca, leaf, "host-1.example", at(29)).is_ok());
        assert!(crate::ca::tests::verify_at(&ca, leaf, "host-1.example", at(31)).is_err());
        l.set_renew(Duration::ZERO);
        let b = l.get(&h).unwrap();
        assert!(!Arc::ptr_eq(&a, &b), "an old leaf is replaced");
        assert_eq!(l.held().0, 1, "replaced, not added");
    }
}
