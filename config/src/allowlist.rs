//! A tool's compiled egress allowlist: exact `host:port` entries, `*.suffix:port`
//! wildcards (strict subdomains only) and exact IP-literal entries. Matching is
//! pure and happens before any DNS query.

use crate::host::{parse_host, Host, HostError};
use std::collections::HashMap;
use std::net::IpAddr;

/// One allowlist entry after validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    Exact { host: String, port: u16, private: bool },
    Suffix { suffix: String, port: u16, private: bool },
    Ip { ip: IpAddr, port: u16, private: bool },
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (p, private) = match self {
            Rule::Exact { host, port, private } => (write!(f, "{host}:{port}"), private),
            Rule::Suffix { suffix, port, private } => (write!(f, "*.{suffix}:{port}"), private),
            Rule::Ip {
                ip: IpAddr::V4(ip),
                port,
                private,
            } => (write!(f, "{ip}:{port}"), private),
            Rule::Ip {
                ip: IpAddr::V6(ip),
                port,
                private,
            } => (write!(f, "[{ip}]:{port}"), private),
        };
        p?;
        if *private {
            f.write_str(" (private)")?;
        }
        Ok(())
    }
}

/// Why an allowlist entry is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("a bare '*' would allow every host; list hosts or '*.suffix' entries")]
    BareWildcard,
    #[error("wildcards are only allowed as a whole leading label ('*.example.com')")]
    MidWildcard,
    #[error("a wildcard must cover a name, not an IP address")]
    WildcardIp,
    #[error("missing port: every entry is host:port")]
    MissingPort,
    #[error("port must be a decimal number in 1..=65535")]
    BadPort,
    #[error("bad host: {0}")]
    Host(#[from] HostError),
}

impl Rule {
    /// Parses `host` and `port` of one entry.
    pub fn parse(host: &str, port: u16, private: bool) -> Result<Rule, RuleError> {
        if port == 0 {
            return Err(RuleError::BadPort);
        }
        if host == "*" || host == "*." {
            return Err(RuleError::BareWildcard);
        }
        if let Some(rest) = host.strip_prefix("*.") {
            if rest.contains('*') {
                return Err(RuleError::MidWildcard);
            }
            return match parse_host(rest)? {
                Host::Name(suffix) => Ok(Rule::Suffix { suffix, port, private }),
                Host::Ip(_) => Err(RuleError::WildcardIp),
            };
        }
        if host.contains('*') {
            return Err(RuleError::MidWildcard);
        }
        match parse_host(host)? {
            Host::Name(host) => Ok(Rule::Exact { host, port, private }),
            Host::Ip(ip) => Ok(Rule::Ip {
                ip: ip.to_canonical(),
                port,
                private,
            }),
        }
    }

    /// Parses a `"host:port"` string entry (IPv6 in brackets).
    pub fn parse_str(entry: &str) -> Result<Rule, RuleError> {
        let (host, port) = if entry.starts_with('[') {
            let end = entry.find(']').ok_or(RuleError::Host(HostError::BadBracket))?;
            let port = entry[end + 1..].strip_prefix(':').ok_or(RuleError::MissingPort)?;
            (&entry[..=end], port)
        } else {
            entry.rsplit_once(':').ok_or(RuleError::MissingPort)?
        };
        let port = crate::host::parse_port(port).ok_or(RuleError::BadPort)?;
        Rule::parse(host, port, false)
    }
}

/// The result of matching a canonical target against an allowlist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    /// Listed; `private` lets resolved addresses fall in the default denied ranges.
    Allowed { private: bool },
    /// An IP literal the tool does not list.
    IpLiteral,
    /// A name the tool does not list for that port.
    NotAllowlisted,
}

/// Compiled allowlist: O(1) exact lookups, short scans for wildcards and IPs.
#[derive(Debug, Clone, Default)]
pub struct Allowlist {
    exact: HashMap<String, Vec<(u16, bool)>>,
    suffixes: Vec<(String, u16, bool)>,
    ips: Vec<(IpAddr, u16, bool)>,
    rules: Vec<Rule>,
}

impl Allowlist {
    pub fn new(rules: Vec<Rule>) -> Self {
        let mut a = Allowlist::default();
        for rule in &rules {
            match rule {
                Rule::Exact { host, port, private } => {
                    let ports = a.exact.entry(host.clone()).or_default();
                    match ports.iter_mut().find(|(p, _)| p == port) {
                        Some((_, pr)) => *pr |= *private,
                        None => ports.push((*port, *private)),
                    }
                }
                Rule::Suffix { suffix, port, private } => a.suffixes.push((format!(".{suffix}"), *port, *private)),
                Rule::Ip { ip, port, private } => a.ips.push((*ip, *port, *private)),
            }
        }
        a.rules = rules;
        a
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Matches a canonical host and port. Never resolves anything.
    pub fn check(&self, host: &Host, port: u16) -> Match {
        match host {
            Host::Ip(ip) => {
                let ip = ip.to_canonical();
                match self.ips.iter().find(|(i, p, _)| *i == ip && *p == port) {
                    Some((_, _, private)) => Match::Allowed { private: *private },
                    None => Match::IpLiteral,
                }
            }
            Host::Name(name) => {
                if let Some(private) = self.exact_lookup(name, port) {
                    return Match::Allowed { private };
                }
                let mut private = None;
                for (suffix, p, pr) in &self.suffixes {
                    if *p == port && name.len() > suffix.len() && name.ends_with(suffix.as_str()) {
                        private = Some(private.unwrap_or(false) | *pr);
                    }
                }
                match private {
                    Some(private) => Match::Allowed { private },
                    None => Match::NotAllowlisted,
                }
            }
        }
    }

    fn exact_lookup(&self, name: &str, port: u16) -> Option<bool> {
        self.exact
            .get(name)?
            .iter()
            .find(|(p, _)| *p == port)
            .map(|(_, private)| *private)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> Allowlist {
        Allowlist::new(entries.iter().map(|e| Rule::parse_str(e).unwrap()).collect())
    }

    fn name(s: &str) -> Host {
        parse_host(s).unwrap()
    }

    #[test]
    fn exact_and_port() {
        let a = list(&["api.example.com:443"]);
        assert_eq!(
            a.check(&name("api.example.com"), 443),
            Match::Allowed { private: false }
        );
        assert_eq!(
            a.check(&name("API.Example.com."), 443),
            Match::Allowed { private: false }
        );
        assert_eq!(a.check(&name("api.example.com"), 80), Match::NotAllowlisted);
        assert_eq!(a.check(&name("x.api.example.com"), 443), Match::NotAllowlisted);
        assert_eq!(a.check(&name("api.example.com.evil"), 443), Match::NotAllowlisted);
        assert_eq!(a.check(&name("evilapi.example.com"), 443), Match::NotAllowlisted);
    }

    #[test]
    fn wildcard_is_strict_subdomains() {
        let a = list(&["*.tiles.example:443"]);
        assert_eq!(
            a.check(&name("a.tiles.example"), 443),
            Match::Allowed { private: false }
        );
        assert_eq!(
            a.check(&name("a.b.tiles.example"), 443),
            Match::Allowed { private: false }
        );
        assert_eq!(a.check(&name("tiles.example"), 443), Match::NotAllowlisted);
        assert_eq!(a.check(&name("eviltiles.example"), 443), Match::NotAllowlisted);
        assert_eq!(a.check(&name("a.tiles.example"), 80), Match::NotAllowlisted);
    }

    #[test]
    fn ip_literals_need_exact_listing() {
        let a = list(&["api.example.com:443", "10.0.0.1:8080", "[::1]:80"]);
        assert_eq!(a.check(&name("10.0.0.2"), 8080), Match::IpLiteral);
        assert_eq!(a.check(&name("10.0.0.1"), 443), Match::IpLiteral);
        assert_eq!(a.check(&name("10.0.0.1"), 8080), Match::Allowed { private: false });
        assert_eq!(a.check(&name("0xa000001"), 8080), Match::Allowed { private: false });
        assert_eq!(
            a.check(&name("[::ffff:10.0.0.1]"), 8080),
            Match::Allowed { private: false }
        );
        assert_eq!(a.check(&name("[::1]"), 80), Match::Allowed { private: false });
        assert_eq!(a.check(&name("127.0.0.1"), 443), Match::IpLiteral);
    }

    #[test]
    fn bad_entries() {
        assert_eq!(Rule::parse_str("*:443"), Err(RuleError::BareWildcard));
        assert_eq!(Rule::parse_str("a.*.example:443"), Err(RuleError::MidWildcard));
        assert_eq!(Rule::parse_str("*a.example:443"), Err(RuleError::MidWildcard));
        assert_eq!(Rule::parse_str("*.*.example:443"), Err(RuleError::MidWildcard));
        assert_eq!(Rule::parse_str("*.10.0.0.1:443"), Err(RuleError::WildcardIp));
        assert_eq!(Rule::parse_str("example.com"), Err(RuleError::MissingPort));
        assert_eq!(Rule::parse_str("example.com:0"), Err(RuleError::BadPort));
        assert_eq!(Rule::parse_str("example.com:http"), Err(RuleError::BadPort));
        assert!(matches!(Rule::parse_str("exa mple.com:80"), Err(RuleError::Host(_))));
    }
}
