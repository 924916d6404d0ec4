//! A tool's compiled egress allowlist: exact `host:port` entries, `*.suffix:port`
//! wildcards (strict subdomains only) and exact IP-literal entries, each with
//! what a transparent connection to it may carry (`protocol`). Matching is
//! pure and happens before any DNS query.

use crate::host::{parse_host, Host, HostError};
use crate::requests::Requests;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

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

/// What a transparent connection to an entry may carry (`protocol`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EntryProtocol {
    /// The default: TLS (its ClientHello's server name must be the entry's
    /// name) or HTTP/1.x (each request's `Host` must be), waited for until
    /// its first bytes are complete; anything else is refused.
    #[default]
    TlsOrHttp,
    /// `protocol = "tcp"`: relayed raw at once, no byte looked at (for
    /// protocols whose server speaks first, or that are neither TLS nor HTTP).
    Tcp,
}

impl EntryProtocol {
    /// As written in the config file (`None`: the default, never written).
    pub fn as_written(self) -> Option<&'static str> {
        match self {
            EntryProtocol::TlsOrHttp => None,
            EntryProtocol::Tcp => Some("tcp"),
        }
    }
}

/// One allowlist entry as the file gives it: where, which requests, and
/// what a transparent connection may carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub rule: Rule,
    pub requests: Option<Requests>,
    pub protocol: EntryProtocol,
}

impl From<(Rule, Option<Requests>)> for Entry {
    fn from((rule, requests): (Rule, Option<Requests>)) -> Entry {
        Entry {
            rule,
            requests,
            protocol: EntryProtocol::TlsOrHttp,
        }
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

    /// The entry's port.
    pub fn port(&self) -> u16 {
        match self {
            Rule::Exact { port, .. } | Rule::Suffix { port, .. } | Rule::Ip { port, .. } => *port,
        }
    }

    /// Whether `self` covers `other`: every host and port `other` admits,
    /// `self` admits too (`private` aside). Same port, and the same name or
    /// address, or `self` a wildcard `*.s` and `other` a name strictly under
    /// `s`, or a wildcard `*.s` or `*.t` with `t` strictly under `s`. An
    /// exact name never covers a wildcard, an address never a name.
    pub fn covers(&self, other: &Rule) -> bool {
        if self.port() != other.port() {
            return false;
        }
        match (self, other) {
            (Rule::Exact { host: a, .. }, Rule::Exact { host: b, .. }) => a == b,
            (Rule::Ip { ip: a, .. }, Rule::Ip { ip: b, .. }) => a == b,
            (Rule::Suffix { suffix: s, .. }, Rule::Exact { host: h, .. }) => strictly_under(h, s),
            (Rule::Suffix { suffix: s, .. }, Rule::Suffix { suffix: t, .. }) => t == s || strictly_under(t, s),
            _ => false,
        }
    }

    /// Whether the entry admits `host` on `port` (as [`Allowlist::check`]
    /// would with this entry alone).
    pub fn admits(&self, host: &Host, port: u16) -> bool {
        match host {
            Host::Ip(ip) => matches!(self, Rule::Ip { ip: i, port: p, .. } if *i == ip.to_canonical() && *p == port),
            Host::Name(n) => self.covers(&Rule::Exact {
                host: n.clone(),
                port,
                private: false,
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

/// Whether `name` is a strict subdomain of `suffix` (at a label boundary).
fn strictly_under(name: &str, suffix: &str) -> bool {
    name.len() > suffix.len() + 1 && name.ends_with(suffix) && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
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

/// Compiled allowlist: every decision is a few hash lookups, whatever the
/// number of rules: one for an exact name, one per label boundary of the name
/// for wildcards (`a.b.example.com` looks up `b.example.com`, `example.com`
/// and `com`), one for an IP literal.
#[derive(Debug, Clone, Default)]
pub struct Allowlist {
    exact: HashMap<String, Ports>,
    /// Wildcard suffixes without the `*.`: `*.example.com` is `example.com`.
    suffixes: HashMap<String, Ports>,
    ips: HashMap<(IpAddr, u16), bool>,
    rules: Vec<Rule>,
    /// The method and path rules of each entry in `rules` (same order).
    requests: Vec<Option<Arc<Requests>>>,
    /// Only when some entry has method or path rules: every entry, by key.
    restricted: Option<Box<RequestTable>>,
    /// What each entry in `rules` lets a transparent connection carry.
    protocols: Vec<EntryProtocol>,
    /// Only when some entry says `protocol = "tcp"`: those entries, by key.
    raw: Option<Box<RawTable>>,
}

/// The entries relayed raw, by what they match (ports per name).
#[derive(Debug, Clone, Default)]
struct RawTable {
    exact: HashMap<String, Vec<u16>>,
    suffixes: HashMap<String, Vec<u16>>,
    ips: HashSet<(IpAddr, u16)>,
}

/// One entry's port and its method and path rules (`None`: any request).
type PortRequests = (u16, Option<Arc<Requests>>);

/// Every entry's method and path rules, by what it matches.
#[derive(Debug, Clone, Default)]
struct RequestTable {
    exact: HashMap<String, Vec<PortRequests>>,
    suffixes: HashMap<String, Vec<PortRequests>>,
    ips: HashMap<(IpAddr, u16), Vec<Option<Arc<Requests>>>>,
}

/// What the entries matching a host and port allow of its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestRules<'a> {
    /// Some matching entry allows every request (or none matches).
    Any,
    /// Every matching entry restricts methods or paths: a request must be
    /// allowed by one of these.
    Only(Vec<&'a Requests>),
}

/// The ports listed for one name, each with its `private` flag (several rules
/// for the same name and port are one: `private` if any of them is).
type Ports = Vec<(u16, bool)>;

fn add_port(ports: &mut Ports, port: u16, private: bool) {
    match ports.iter_mut().find(|(p, _)| *p == port) {
        Some((_, pr)) => *pr |= private,
        None => ports.push((port, private)),
    }
}

fn port_lookup(ports: &Ports, port: u16) -> Option<bool> {
    ports.iter().find(|(p, _)| *p == port).map(|(_, private)| *private)
}

impl Allowlist {
    pub fn new(rules: Vec<Rule>) -> Self {
        Allowlist::with_requests(rules.into_iter().map(|r| (r, None)).collect())
    }

    /// An allowlist whose entries may restrict methods and paths.
    pub fn with_requests(entries: Vec<(Rule, Option<Requests>)>) -> Self {
        Allowlist::with_entries(entries.into_iter().map(Entry::from).collect())
    }

    /// An allowlist whose entries may restrict methods and paths, and say
    /// what a transparent connection to them may carry.
    pub fn with_entries(entries: Vec<Entry>) -> Self {
        let mut protocols = Vec::with_capacity(entries.len());
        let (rules, requests): (Vec<Rule>, Vec<Option<Arc<Requests>>>) = entries
            .into_iter()
            .map(|e| {
                protocols.push(e.protocol);
                (e.rule, e.requests.map(Arc::new))
            })
            .unzip();
        let mut a = Allowlist::default();
        if protocols.contains(&EntryProtocol::Tcp) {
            let mut t = RawTable::default();
            for (rule, _) in rules.iter().zip(&protocols).filter(|(_, p)| **p == EntryProtocol::Tcp) {
                match rule {
                    Rule::Exact { host, port, .. } => t.exact.entry(host.clone()).or_default().push(*port),
                    Rule::Suffix { suffix, port, .. } => t.suffixes.entry(suffix.clone()).or_default().push(*port),
                    Rule::Ip { ip, port, .. } => {
                        t.ips.insert((*ip, *port));
                    }
                }
            }
            a.raw = Some(Box::new(t));
        }
        a.protocols = protocols;
        if requests.iter().any(Option::is_some) {
            let mut t = RequestTable::default();
            for (rule, q) in rules.iter().zip(&requests) {
                match rule {
                    Rule::Exact { host, port, .. } => t.exact.entry(host.clone()).or_default().push((*port, q.clone())),
                    Rule::Suffix { suffix, port, .. } => {
                        t.suffixes.entry(suffix.clone()).or_default().push((*port, q.clone()))
                    }
                    Rule::Ip { ip, port, .. } => t.ips.entry((*ip, *port)).or_default().push(q.clone()),
                }
            }
            a.restricted = Some(Box::new(t));
        }
        a.requests = requests;
        for rule in &rules {
            match rule {
                Rule::Exact { host, port, private } => {
                    add_port(a.exact.entry(host.clone()).or_default(), *port, *private)
                }
                Rule::Suffix { suffix, port, private } => {
                    add_port(a.suffixes.entry(suffix.clone()).or_default(), *port, *private)
                }
                // The first rule for an address and port decides, as before.
                Rule::Ip { ip, port, private } => {
                    a.ips.entry((*ip, *port)).or_insert(*private);
                }
            }
        }
        a.rules = rules;
        a
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Each entry with its method and path rules and its protocol, as
    /// written in `check`'s output and the policy digest:
    /// `host:port[ (private)][ methods=…][ paths=…][ protocol=tcp]`.
    pub fn entries(&self) -> impl Iterator<Item = String> + '_ {
        self.rules
            .iter()
            .zip(&self.requests)
            .zip(&self.protocols)
            .map(|((r, q), p)| {
                let mut e = match q {
                    Some(q) => format!("{r}{q}"),
                    None => r.to_string(),
                };
                if let Some(p) = p.as_written() {
                    e.push_str(" protocol=");
                    e.push_str(p);
                }
                e
            })
    }

    /// What each entry lets a transparent connection carry (same order as
    /// [`Allowlist::rules`]).
    pub fn protocols(&self) -> &[EntryProtocol] {
        &self.protocols
    }

    /// Whether a transparent connection to `host` and `port` is relayed
    /// raw at once: some entry matching them (exact, wildcard or address,
    /// as [`Allowlist::check`] matches) says `protocol = "tcp"`. Without
    /// such an entry in the list this is one branch.
    pub fn relays_raw(&self, host: &Host, port: u16) -> bool {
        let Some(t) = &self.raw else {
            return false;
        };
        match host {
            Host::Ip(ip) => t.ips.contains(&(ip.to_canonical(), port)),
            Host::Name(name) => {
                let on = |ports: Option<&Vec<u16>>| ports.is_some_and(|p| p.contains(&port));
                on(t.exact.get(name.as_str()))
                    || name.match_indices('.').any(|(i, _)| on(t.suffixes.get(&name[i + 1..])))
            }
        }
    }

    /// Whether some entry restricts methods or paths (its host's CONNECTs
    /// are intercepted).
    pub fn restricts_requests(&self) -> bool {
        self.restricted.is_some()
    }

    /// What the entries matching `host` and `port` allow of its requests
    /// (the same entries [`Allowlist::check`] matches, all of them).
    /// Without any method or path rule in the list this is one branch.
    pub fn requests(&self, host: &Host, port: u16) -> RequestRules<'_> {
        let Some(t) = &self.restricted else {
            return RequestRules::Any;
        };
        let mut matching: Vec<&Option<Arc<Requests>>> = Vec::new();
        fn on_port(v: &[PortRequests], port: u16) -> impl Iterator<Item = &Option<Arc<Requests>>> {
            v.iter().filter(move |(p, _)| *p == port).map(|(_, q)| q)
        }
        match host {
            Host::Ip(ip) => matching.extend(t.ips.get(&(ip.to_canonical(), port)).into_iter().flatten()),
            Host::Name(name) => {
                matching.extend(t.exact.get(name.as_str()).into_iter().flat_map(|v| on_port(v, port)));
                for (i, _) in name.match_indices('.') {
                    matching.extend(
                        t.suffixes
                            .get(&name[i + 1..])
                            .into_iter()
                            .flat_map(|v| on_port(v, port)),
                    );
                }
            }
        }
        if matching.is_empty() || matching.iter().any(|q| q.is_none()) {
            return RequestRules::Any;
        }
        RequestRules::Only(matching.into_iter().flatten().map(Arc::as_ref).collect())
    }

    /// Whether some rule lists the name `name` (exact, or a strict subdomain
    /// of a wildcard) on any port: what an in-sandbox DNS answers for.
    pub fn lists_name(&self, name: &str) -> bool {
        self.exact.contains_key(name)
            || (!self.suffixes.is_empty()
                && name
                    .match_indices('.')
                    .any(|(i, _)| self.suffixes.contains_key(&name[i + 1..])))
    }

    /// Matches a canonical host and port. Never resolves anything.
    pub fn check(&self, host: &Host, port: u16) -> Match {
        match host {
            Host::Ip(ip) => match self.ips.get(&(ip.to_canonical(), port)) {
                Some(private) => Match::Allowed { private: *private },
                None => Match::IpLiteral,
            },
            Host::Name(name) => {
                if let Some(private) = self.exact.get(name.as_str()).and_then(|p| port_lookup(p, port)) {
                    return Match::Allowed { private };
                }
                // Every strict suffix starting at a label boundary; a wildcard
                // never matches its own suffix (`*.example.com` ≠ `example.com`).
                let mut private = None;
                if !self.suffixes.is_empty() {
                    for (i, _) in name.match_indices('.') {
                        if let Some(pr) = self.suffixes.get(&name[i + 1..]).and_then(|p| port_lookup(p, port)) {
                            private = Some(private.unwrap_or(false) | pr);
                        }
                    }
                }
                match private {
                    Some(private) => Match::Allowed { private },
                    None => Match::NotAllowlisted,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_listed_on_some_port_or_not_at_all() {
        let a = list(&["api.example:443", "*.cdn.example:8443", "10.0.0.1:80"]);
        for (n, want) in [
            ("api.example", true),
            ("x.cdn.example", true),
            ("a.b.cdn.example", true),
            ("cdn.example", false),
            ("example", false),
            ("xapi.example", false),
            ("10.0.0.1", false),
        ] {
            assert_eq!(a.lists_name(n), want, "{n}");
        }
        assert!(!Allowlist::default().lists_name("api.example"));
    }

    fn list(entries: &[&str]) -> Allowlist {
        Allowlist::new(entries.iter().map(|e| Rule::parse_str(e).unwrap()).collect())
    }

    fn name(s: &str) -> Host {
        parse_host(s).unwrap()
    }

    /// The same decisions as scanning every rule, one by one.
    fn linear(a: &Allowlist, host: &Host, port: u16) -> Match {
        let or = |acc: Option<bool>, pr: bool| Some(acc.unwrap_or(false) | pr);
        match host {
            Host::Ip(ip) => {
                let ip = ip.to_canonical();
                let first = a.rules().iter().find_map(|r| match r {
                    Rule::Ip {
                        ip: i,
                        port: p,
                        private,
                    } if *i == ip && *p == port => Some(*private),
                    _ => None,
                });
                first.map_or(Match::IpLiteral, |private| Match::Allowed { private })
            }
            Host::Name(name) => {
                let (mut exact, mut suffix) = (None, None);
                for r in a.rules() {
                    match r {
                        Rule::Exact { host, port: p, private } if host == name && *p == port => {
                            exact = or(exact, *private)
                        }
                        Rule::Suffix {
                            suffix: s,
                            port: p,
                            private,
                        } if *p == port && name.len() > s.len() + 1 && name.ends_with(&format!(".{s}")) => {
                            suffix = or(suffix, *private)
                        }
                        _ => {}
                    }
                }
                exact
                    .or(suffix)
                    .map_or(Match::NotAllowlisted, |private| Match::Allowed { private })
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn decides_like_a_linear_scan(
            entries in proptest::collection::vec((0usize..3, 1usize..4, 0usize..2, proptest::bool::ANY), 0..12),
            queries in proptest::collection::vec((1usize..5, 0usize..2, 0usize..4), 1..8),
        ) {
            const LABELS: [&str; 4] = ["a", "b", "ex", "com"];
            const PORTS: [u16; 2] = [80, 443];
            let pick = |n: usize, seed: usize| (0..n).map(|k| LABELS[(seed + k * 3) % 4]).collect::<Vec<_>>().join(".");
            let rules: Vec<Rule> = entries
                .iter()
                .enumerate()
                .map(|(i, (kind, n, port, private))| {
                    let host = match kind {
                        0 => pick(*n, i),
                        1 => format!("*.{}", pick(*n, i)),
                        _ => format!("10.0.0.{}", n),
                    };
                    Rule::parse(&host, PORTS[*port], *private).unwrap()
                })
                .collect();
            let a = Allowlist::new(rules);
            for (n, port, seed) in queries {
                for host in [pick(n, seed), format!("10.0.0.{n}")] {
                    let h = name(&host);
                    proptest::prop_assert_eq!(a.check(&h, PORTS[port]), linear(&a, &h, PORTS[port]), "{} {}", host, PORTS[port]);
                }
            }
        }
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
    fn raw_entries_are_found_as_check_matches_them() {
        let tcp = |e: &str| Entry {
            protocol: EntryProtocol::Tcp,
            ..Entry::from((Rule::parse_str(e).unwrap(), None))
        };
        let checked = |e: &str| Entry::from((Rule::parse_str(e).unwrap(), None));
        let a = Allowlist::with_entries(vec![
            checked("web.example:443"),
            tcp("db.example:5432"),
            tcp("*.pg.example:5432"),
            tcp("10.0.0.1:22"),
            // Entries add up: the wildcard's raw relay covers the exact
            // name listed without it, as `private` would.
            checked("a.pg.example:5432"),
        ]);
        for (host, port, raw) in [
            ("db.example", 5432, true),
            ("DB.example.", 5432, true),
            ("db.example", 5433, false),
            ("web.example", 443, false),
            ("x.db.example", 5432, false),
            ("a.pg.example", 5432, true),
            ("a.b.pg.example", 5432, true),
            ("pg.example", 5432, false),
            ("10.0.0.1", 22, true),
            ("[::ffff:10.0.0.1]", 22, true),
            ("10.0.0.1", 23, false),
            ("10.0.0.2", 22, false),
        ] {
            assert_eq!(a.relays_raw(&name(host), port), raw, "{host}:{port}");
        }
        assert!(!list(&["db.example:5432"]).relays_raw(&name("db.example"), 5432));
        let shown: Vec<String> = a.entries().collect();
        assert_eq!(shown[0], "web.example:443");
        assert_eq!(shown[1], "db.example:5432 protocol=tcp");
        assert_eq!(shown[3], "10.0.0.1:22 protocol=tcp");
        assert_eq!(a.protocols()[2], EntryProtocol::Tcp);
        assert_eq!(a.protocols()[4], EntryProtocol::TlsOrHttp);
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
