//! The proxy's own addresses, which a fetch must never reach: its listening
//! sockets, and this host's interface addresses (re-read at start, on reload
//! and by the sweeper).

use std::net::{IpAddr, SocketAddr};

/// The appliance's own listening sockets: a fetch must never loop back into them.
#[derive(Debug, Clone, Default)]
pub struct SelfAddrs(pub Vec<SocketAddr>);

impl SelfAddrs {
    pub fn contains(&self, ip: IpAddr, port: u16) -> bool {
        let ip = ip.to_canonical();
        self.0.iter().any(|l| {
            l.port() == port
                && (l.ip().to_canonical() == ip || ip.is_unspecified() || (l.ip().is_unspecified() && ip.is_loopback()))
        })
    }
}

/// The addresses of this host's own interfaces (read at start, on reload
/// and periodically). A service listening on `0.0.0.0` of a public or VPC
/// address is as much "inside" as loopback, so these are denied unless
/// `allow_ranges` exempts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddrs(pub Vec<IpAddr>);

impl HostAddrs {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.0.iter().any(|h| h.to_canonical() == ip)
    }
}

/// This host's interface addresses (every interface, every family). On
/// failure the previous answer is kept by the caller's comparison, and an
/// empty set only means nothing extra is denied beyond the range table.
pub fn read_host_addrs() -> HostAddrs {
    match if_addrs::get_if_addrs() {
        Ok(list) => {
            let mut v: Vec<std::net::IpAddr> = list.iter().map(|i| i.ip().to_canonical()).collect();
            v.sort();
            v.dedup();
            HostAddrs(v)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the host's interface addresses");
            HostAddrs::default()
        }
    }
}
