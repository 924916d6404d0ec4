//! Address ranges a fetch may never reach by default (the IANA IPv4 and IPv6
//! special-purpose registries, RFC 6890 and successors), compiled with the
//! operator's `allow_ranges` / `deny_ranges` into one table that classifies a
//! resolved address. Addresses are canonicalized first (`::ffff:a.b.c.d` is
//! judged as `a.b.c.d`); embedded-IPv4 forms (NAT64, 6to4, Teredo, IPv4-
//! compatible) are denied as whole ranges.

use ipnet::IpNet;
use std::net::IpAddr;

/// The default denied ranges, with the registry entry each one stands for.
pub const DEFAULT_DENIED: &[(&str, &str)] = &[
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private-use"),
    ("100.64.0.0/10", "shared address space (CGNAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata)"),
    ("172.16.0.0/12", "private-use"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "6to4 relay anycast"),
    ("192.168.0.0/16", "private-use"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "limited broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible"),
    ("::ffff:0:0/96", "IPv4-mapped"),
    ("64:ff9b::/96", "NAT64 well-known prefix"),
    ("64:ff9b:1::/48", "NAT64 local-use"),
    ("100::/64", "discard-only"),
    ("2001::/32", "Teredo"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    ("fc00::/7", "unique local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
];

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeVerdict {
    /// The address may be dialled.
    Allowed,
    /// In a default special-purpose range and not exempted by `allow_ranges`.
    DefaultDenied(IpNet),
    /// In an operator's `deny_ranges`.
    OperatorDenied(IpNet),
}

/// Compiled range table.
#[derive(Debug, Clone)]
pub struct RangeTable {
    default_denied: Vec<IpNet>,
    allow: Vec<IpNet>,
    deny: Vec<IpNet>,
}

impl RangeTable {
    /// Builds the table from the operator's lists (the defaults always apply).
    pub fn new(allow: Vec<IpNet>, deny: Vec<IpNet>) -> Self {
        let default_denied = DEFAULT_DENIED
            .iter()
            .filter_map(|(net, _)| net.parse::<IpNet>().ok())
            .collect();
        RangeTable {
            default_denied,
            allow,
            deny,
        }
    }

    /// Classifies a resolved address. `private_ok` is a rule's `private = true`:
    /// it skips the default table, never the operator's `deny_ranges`.
    pub fn classify(&self, ip: IpAddr, private_ok: bool) -> RangeVerdict {
        let ip = ip.to_canonical();
        if let Some(net) = self.deny.iter().find(|n| n.contains(&ip)) {
            return RangeVerdict::OperatorDenied(*net);
        }
        if private_ok || self.allow.iter().any(|n| n.contains(&ip)) {
            return RangeVerdict::Allowed;
        }
        match self.default_denied.iter().find(|n| n.contains(&ip)) {
            Some(net) => RangeVerdict::DefaultDenied(*net),
            None => RangeVerdict::Allowed,
        }
    }

    pub fn allow_ranges(&self) -> &[IpNet] {
        &self.allow
    }

    pub fn deny_ranges(&self) -> &[IpNet] {
        &self.deny
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RangeTable {
        RangeTable::new(vec![], vec![])
    }

    #[test]
    fn default_table_parses_completely() {
        assert_eq!(table().default_denied.len(), DEFAULT_DENIED.len());
    }

    #[test]
    fn denied_addresses() {
        let denied = [
            "0.0.0.0",
            "0.1.2.3",
            "10.1.2.3",
            "100.64.0.1",
            "100.127.255.254",
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::127.0.0.1",
            "::8.8.8.8",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::7f00:1",
            "64:ff9b::808:808",
            "64:ff9b:1::1",
            "100::1",
            "2001::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "2001:db8::1",
            "2002:7f00:1::1",
            "2002:808:808::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
        ];
        for s in denied {
            let ip: IpAddr = s.parse().unwrap();
            assert!(
                matches!(table().classify(ip, false), RangeVerdict::DefaultDenied(_)),
                "{s}"
            );
            assert_eq!(table().classify(ip, true), RangeVerdict::Allowed, "{s} private_ok");
        }
    }

    #[test]
    fn public_addresses_are_allowed() {
        for s in [
            "8.8.8.8",
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.0",
            "172.32.0.1",
            "198.20.0.1",
            "2606:4700::1111",
            "2001:4860:4860::8888",
            "::ffff:8.8.8.8",
        ] {
            let ip: IpAddr = s.parse().unwrap();
            assert_eq!(table().classify(ip, false), RangeVerdict::Allowed, "{s}");
        }
    }

    #[test]
    fn operator_lists() {
        let t = RangeTable::new(
            vec!["127.0.0.2/32".parse().unwrap()],
            vec!["8.8.8.0/24".parse().unwrap()],
        );
        assert_eq!(t.classify("127.0.0.2".parse().unwrap(), false), RangeVerdict::Allowed);
        assert_eq!(
            t.classify("::ffff:127.0.0.2".parse().unwrap(), false),
            RangeVerdict::Allowed
        );
        assert!(matches!(
            t.classify("127.0.0.1".parse().unwrap(), false),
            RangeVerdict::DefaultDenied(_)
        ));
        assert!(matches!(
            t.classify("8.8.8.8".parse().unwrap(), false),
            RangeVerdict::OperatorDenied(_)
        ));
        assert!(matches!(
            t.classify("8.8.8.8".parse().unwrap(), true),
            RangeVerdict::OperatorDenied(_)
        ));
    }
}
