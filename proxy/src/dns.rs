//! Resolve once, with hickory-resolver only: never `getaddrinfo`, never the
//! hosts file, no search domains (names are fully qualified). The addresses
//! returned are the ones the caller vets and dials; nothing re-resolves.
//!
//! The data path resolves through [`Resolve`] and dials through [`Dial`],
//! held in the shared state: [`Dns`] and [`TcpDial`] in the proxy, fakes in
//! unit tests (so deadlines and cut-offs are tested with paused time).

use egress_config::DnsConfig;
use futures_util::future::BoxFuture;
use hickory_resolver::config::{ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpStream;

/// Why a lookup gave no addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    #[error("no such name or no address records")]
    NotFound,
    #[error("lookup failed: {0}")]
    Failed(String),
}

/// Why the resolver could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot configure the DNS resolver: {0}")]
pub struct DnsInitError(String);

/// Names whose answers are kept in front of the resolver.
const ANSWERS_KEPT: usize = 4096;

/// An answer and the instant its TTL runs out.
struct Answer {
    ips: Arc<[IpAddr]>,
    until: Instant,
}

/// The proxy's one resolver, with the positive answers it gave kept until
/// their TTL runs out: a lock-free lookup per fetch instead of a trip
/// through the resolver's own cache (which stays, for what is not kept
/// here). Negative answers are not kept here.
pub struct Dns {
    resolver: TokioResolver,
    answers: papaya::HashMap<Box<str>, Answer>,
}

impl Dns {
    pub fn new(cfg: &DnsConfig) -> Result<Dns, DnsInitError> {
        let (rc, mut opts) = if cfg.servers.is_empty() {
            hickory_resolver::system_conf::read_system_conf().map_err(|e| DnsInitError(e.to_string()))?
        } else {
            let servers = cfg
                .servers
                .iter()
                .map(|s| {
                    let mut udp = ConnectionConfig::udp();
                    udp.port = s.port();
                    let mut tcp = ConnectionConfig::tcp();
                    tcp.port = s.port();
                    NameServerConfig::new(s.ip(), true, vec![udp, tcp])
                })
                .collect();
            (ResolverConfig::from_name_servers(servers), Default::default())
        };
        // Names arrive canonical and fully qualified: no search list, no hosts file.
        let (_, _, servers) = rc.into_parts();
        let rc = ResolverConfig::from_parts(None, vec![], servers);
        opts.ndots = 0;
        opts.timeout = cfg.timeout;
        opts.attempts = 1;
        opts.use_hosts_file = ResolveHosts::Never;
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        opts.cache_size = 4096;
        let resolver = hickory_resolver::Resolver::builder_with_config(rc, TokioRuntimeProvider::default())
            .with_options(opts)
            .build()
            .map_err(|e| DnsInitError(e.to_string()))?;
        Ok(Dns {
            resolver,
            answers: papaya::HashMap::new(),
        })
    }

    /// Resolves a canonical name (A and AAAA), from a kept answer whose TTL
    /// has not run out, or from the resolver.
    async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, DnsError> {
        if let Some(a) = self.answers.pin().get(name) {
            if Instant::now() < a.until {
                return Ok(a.ips.to_vec());
            }
        }
        let (ips, until) = self.ask(name).await?;
        let answers = self.answers.pin();
        if answers.len() >= ANSWERS_KEPT {
            let now = Instant::now();
            answers.retain(|_, a| now < a.until);
            if answers.len() >= ANSWERS_KEPT {
                answers.clear();
            }
        }
        answers.insert(
            name.into(),
            Answer {
                ips: ips.as_slice().into(),
                until,
            },
        );
        Ok(ips)
    }

    /// Asks the resolver; the answer and when its TTL runs out.
    async fn ask(&self, name: &str) -> Result<(Vec<IpAddr>, Instant), DnsError> {
        let mut fqdn = String::with_capacity(name.len() + 1);
        fqdn.push_str(name);
        fqdn.push('.');
        match self.resolver.lookup_ip(fqdn.as_str()).await {
            Ok(l) => {
                let ips: Vec<IpAddr> = l.iter().collect();
                if ips.is_empty() {
                    Err(DnsError::NotFound)
                } else {
                    Ok((ips, l.valid_until()))
                }
            }
            Err(e) if e.is_nx_domain() || e.is_no_records_found() => Err(DnsError::NotFound),
            Err(e) => Err(DnsError::Failed(e.to_string())),
        }
    }
}

/// How the data path resolves a canonical name (A and AAAA, once).
pub trait Resolve: Send + Sync + 'static {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Vec<IpAddr>, DnsError>>;
}

impl Resolve for Dns {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Vec<IpAddr>, DnsError>> {
        Box::pin(self.lookup(name))
    }
}

/// How the data path opens a TCP connection to one vetted address.
pub trait Dial: Send + Sync + 'static {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<TcpStream>>;
}

/// Dials with the operating system, without delay on small writes.
pub struct TcpDial;

impl Dial for TcpDial {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<TcpStream>> {
        Box::pin(async move {
            let s = TcpStream::connect(addr).await?;
            let _ = s.set_nodelay(true);
            Ok(s)
        })
    }
}
