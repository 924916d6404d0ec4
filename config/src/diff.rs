//! `policy diff`: the exact change in reach between two compiled policies,
//! per tool. Names, ports and addresses are probed through the allowlists'
//! own matching (one probe per class of names the entries tell apart), so
//! reordering, splitting or repeating entries is no change; methods and
//! paths, credentials, ranges, mode and limits are compared field by field.

use crate::allowlist::{Allowlist, Match, RequestRules, Rule};
use crate::host::Host;
use crate::requests::PathPattern;
use crate::{Isolation, Mode, Network, Policy, ToolPolicy};
use ipnet::IpNet;
use serde::Serialize;
use std::collections::BTreeSet;

/// Whether a change lets more through or less.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Widens,
    Narrows,
}

/// What a change is about, for joining recorded traffic to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// The hosts and ports an entry admits.
    Names(Rule),
    /// Addresses in a range (denied as `private_address`).
    Net(IpNet),
    /// Every fetch of the tool.
    Tool,
    /// Nothing a recorded fetch shows (budgets, slots, process limits).
    Limits,
}

/// One change in reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub direction: Direction,
    /// `host_added`, `wildcard_widened`, `mode_report`, ... (see
    /// docs/growing-a-policy.md).
    pub kind: &'static str,
    /// `None`: the whole policy (`[proxy]` ranges).
    pub tool: Option<String>,
    /// What changed: `*.example.com:443`, `max_requests_per_run`, `10.0.0.0/8`.
    pub target: String,
    /// Before and after, or what else it concerns ("" when nothing).
    pub detail: String,
    #[serde(skip)]
    pub scope: Scope,
}

impl Change {
    /// Whether a fetch of `tool` to `host:port`, whose verdict changed for
    /// `reason`, is one this change concerns.
    pub fn concerns(&self, tool: &str, host: &Host, port: u16, reason: &str) -> bool {
        if self.tool.as_deref().is_some_and(|t| t != tool) {
            return false;
        }
        match &self.scope {
            Scope::Names(rule) => rule.admits(host, port),
            Scope::Net(net) => match host {
                Host::Ip(ip) => net.contains(&ip.to_canonical()),
                Host::Name(_) => reason == "private_address",
            },
            Scope::Tool => true,
            Scope::Limits => false,
        }
    }

    /// How specific the scope is: a record goes to its most specific changes.
    pub fn specificity(&self) -> u8 {
        match self.scope {
            Scope::Names(_) => 3,
            Scope::Net(_) => 2,
            Scope::Tool => 1,
            Scope::Limits => 0,
        }
    }
}

/// Every change from `old` to `new`: widenings first, then by tool, kind
/// and target.
pub fn diff(old: &Policy, new: &Policy) -> Vec<Change> {
    let mut out = vec![];
    ranges(old, new, &mut out);
    let ids: BTreeSet<&String> = old.tools.keys().chain(new.tools.keys()).collect();
    for id in ids {
        let (o, n) = (old.tool(id).map(|t| &**t), new.tool(id).map(|t| &**t));
        let mut d = Diff {
            tool: id,
            out: &mut out,
        };
        match (o, n) {
            (None, Some(n)) => {
                d.push(Direction::Widens, "tool_added", id.as_str(), "", Scope::Tool);
                d.reach(&Allowlist::default(), &n.allowlist, None, Some(n));
                d.credentials(None, n);
            }
            (Some(_), None) => d.push(Direction::Narrows, "tool_removed", id.as_str(), "", Scope::Tool),
            (Some(o), Some(n)) => d.tool_pair(o, n),
            (None, None) => {}
        }
    }
    out.sort_by(|a, b| {
        (a.direction, &a.tool, a.kind, &a.target, &a.detail).cmp(&(b.direction, &b.tool, b.kind, &b.target, &b.detail))
    });
    out.dedup();
    out
}

/// How `policy` reaches beyond `envelope`: the widenings of the change from
/// the envelope to the policy (empty: within it).
pub fn beyond(envelope: &Policy, policy: &Policy) -> Vec<Change> {
    let mut out = diff(envelope, policy);
    out.retain(|c| c.direction == Direction::Widens);
    out
}

/// Whether a grant of `host:port` to a run of `tool` stays within
/// `envelope`: the envelope's tool lists it.
pub fn grant_within(envelope: &Policy, tool: &str, host: &Host, port: u16) -> bool {
    envelope
        .tool(tool)
        .is_some_and(|t| matches!(t.allowlist.check(host, port), Match::Allowed { .. }))
}

/// Whether any change widens reach.
pub fn widens(changes: &[Change]) -> bool {
    changes.iter().any(|c| c.direction == Direction::Widens)
}

/// The changes as `policy diff` prints them, one line each.
pub fn line(c: &Change) -> String {
    let dir = match c.direction {
        Direction::Widens => "WIDENS ",
        Direction::Narrows => "narrows",
    };
    let tool = c.tool.as_deref().map_or("[proxy]".to_owned(), |t| format!("tool {t}"));
    let mut l = format!("{dir} {tool}: {} {}", c.kind, c.target);
    if !c.detail.is_empty() {
        l.push_str(" (");
        l.push_str(&c.detail);
        l.push(')');
    }
    l
}

struct Diff<'a> {
    tool: &'a str,
    out: &'a mut Vec<Change>,
}

/// What an allowlist lets a name or address reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Reach {
    None,
    /// Public addresses only.
    Public,
    /// `private = true`: the default denied ranges too.
    Private,
}

fn reach(a: &Allowlist, host: &Host, port: u16) -> Reach {
    match a.check(host, port) {
        Match::Allowed { private: false } => Reach::Public,
        Match::Allowed { private: true } => Reach::Private,
        _ => Reach::None,
    }
}

/// One class of names (or one address) on one port: `shown` as an entry,
/// `host` a member of it.
struct Probe {
    shown: Rule,
    host: Host,
}

/// One probe per class of targets the two lists tell apart: each listed
/// name and address, and for each wildcard `*.s` a fresh name just under
/// `s` (which matches exactly the wildcards every unlisted name whose
/// longest listed wildcard is `*.s` matches), each on every listed port.
fn probes(a: &Allowlist, b: &Allowlist) -> Vec<Probe> {
    let rules = || a.rules().iter().chain(b.rules());
    let (mut names, mut suffixes, mut ports, mut ips) =
        (BTreeSet::new(), BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    for r in rules() {
        match r {
            Rule::Exact { host, port, .. } => {
                names.insert(host.clone());
                ports.insert(*port);
            }
            Rule::Suffix { suffix, port, .. } => {
                suffixes.insert(suffix.clone());
                ports.insert(*port);
            }
            Rule::Ip { ip, port, .. } => {
                ips.insert((*ip, *port));
            }
        }
    }
    let mut label = "loom-diff-probe".to_owned();
    while suffixes.iter().any(|s| names.contains(&format!("{label}.{s}"))) {
        label.push('x');
    }
    let mut out = vec![];
    for &port in &ports {
        for n in &names {
            let shown = Rule::Exact {
                host: n.clone(),
                port,
                private: false,
            };
            out.push(Probe {
                shown,
                host: Host::Name(n.clone()),
            });
        }
        for s in &suffixes {
            let shown = Rule::Suffix {
                suffix: s.clone(),
                port,
                private: false,
            };
            out.push(Probe {
                shown,
                host: Host::Name(format!("{label}.{s}")),
            });
        }
    }
    for (ip, port) in ips {
        out.push(Probe {
            shown: Rule::Ip {
                ip,
                port,
                private: false,
            },
            host: Host::Ip(ip),
        });
    }
    out
}

/// A change found at one probe, before the changes a wider probe explains
/// are dropped.
struct Found {
    direction: Direction,
    kind: &'static str,
    shown: Rule,
    detail: String,
    /// Probes changed alike share it: a covered one adds nothing.
    same: String,
}

/// One method (or any) with one path pattern (or any).
type Atom<'a> = (Option<&'a str>, Option<&'a PathPattern>);

fn atoms<'a>(rules: &RequestRules<'a>) -> Option<Vec<Atom<'a>>> {
    let RequestRules::Only(list) = rules else { return None };
    let mut out = vec![];
    for &r in list {
        let ms: Vec<Option<&str>> = match &r.methods {
            Some(ms) => ms.iter().map(|m| Some(m.as_str())).collect(),
            None => vec![None],
        };
        let ps: Vec<Option<&PathPattern>> = match &r.paths {
            Some(ps) => ps.iter().map(Some).collect(),
            None => vec![None],
        };
        for m in &ms {
            out.extend(ps.iter().map(|p| (*m, *p)));
        }
    }
    Some(out)
}

fn atom_covers(a: &Atom<'_>, b: &Atom<'_>) -> bool {
    let m = match (a.0, b.0) {
        (None, _) => true,
        (Some(x), Some(y)) => x == y,
        (Some(_), None) => false,
    };
    let p = match (a.1, b.1) {
        (None, _) => true,
        (Some(x), Some(y)) => x.covers(y),
        (Some(_), None) => false,
    };
    m && p
}

/// `b`'s atoms that no atom of `a` covers, as `METHOD /path` words.
fn uncovered(a: &[Atom<'_>], b: &[Atom<'_>]) -> Vec<String> {
    let mut out: Vec<String> = b
        .iter()
        .filter(|x| !a.iter().any(|y| atom_covers(y, x)))
        .map(|(m, p)| format!("{} {}", m.unwrap_or("*"), p.map_or("/**".to_owned(), |p| p.to_string())))
        .collect();
    out.sort();
    out.dedup();
    out
}

fn written(a: &[Atom<'_>]) -> String {
    uncovered(&[], a).join(", ")
}

fn limit(v: Option<u64>) -> String {
    v.map_or("unlimited".to_owned(), |v| v.to_string())
}

fn net_list(nets: &[IpNet]) -> Vec<IpNet> {
    IpNet::aggregate(&nets.to_vec())
}

fn covered_by(net: &IpNet, list: &[IpNet]) -> bool {
    list.iter().any(|n| n.contains(net))
}

fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// `allow_ranges` and `deny_ranges` (a range split in two is the same).
fn ranges(old: &Policy, new: &Policy, out: &mut Vec<Change>) {
    let push = |out: &mut Vec<Change>, direction, kind, net: &IpNet, detail: String| {
        out.push(Change {
            direction,
            kind,
            tool: None,
            target: net.to_string(),
            detail,
            scope: Scope::Net(*net),
        })
    };
    let special = |net: &IpNet| -> String {
        let names: Vec<String> = crate::ranges::DEFAULT_DENIED
            .iter()
            .filter_map(|(n, what)| Some((n.parse::<IpNet>().ok()?, what)))
            .filter(|(n, _)| overlaps(n, net))
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        names.join(", ")
    };
    let (oa, na) = (net_list(old.ranges.allow_ranges()), net_list(new.ranges.allow_ranges()));
    for (from, to, direction, kind) in [
        (&oa, &na, Direction::Widens, "allow_range_added"),
        (&na, &oa, Direction::Narrows, "allow_range_removed"),
    ] {
        for net in to.iter().filter(|n| !covered_by(n, from)) {
            // Outside every default denied range it changes nothing.
            let opens = special(net);
            if !opens.is_empty() {
                push(out, direction, kind, net, opens);
            }
        }
    }
    let (od, nd) = (net_list(old.ranges.deny_ranges()), net_list(new.ranges.deny_ranges()));
    for net in od.iter().filter(|n| !covered_by(n, &nd)) {
        push(out, Direction::Widens, "deny_range_removed", net, String::new());
    }
    for net in nd.iter().filter(|n| !covered_by(n, &od)) {
        push(out, Direction::Narrows, "deny_range_added", net, String::new());
    }
}

impl Diff<'_> {
    fn push(&mut self, direction: Direction, kind: &'static str, target: &str, detail: &str, scope: Scope) {
        self.out.push(Change {
            direction,
            kind,
            tool: Some(self.tool.to_owned()),
            target: target.to_owned(),
            detail: detail.to_owned(),
            scope,
        });
    }

    fn tool_pair(&mut self, o: &ToolPolicy, n: &ToolPolicy) {
        self.reach(&o.allowlist, &n.allowlist, Some(o), Some(n));
        self.credentials(Some(o), n);
        self.methods(&o.methods, &n.methods);
        let flip = |d: &mut Self, (key, was, is): (&str, bool, bool), widen: &'static str, narrow: &'static str| match (
            was, is,
        ) {
            (false, true) => d.push(Direction::Widens, widen, key, "", Scope::Tool),
            (true, false) => d.push(Direction::Narrows, narrow, key, "", Scope::Tool),
            _ => {}
        };
        flip(
            self,
            ("mode", o.mode == Mode::Report, n.mode == Mode::Report),
            "mode_report",
            "mode_enforce",
        );
        flip(self, ("inspect", !o.inspect, !n.inspect), "inspect_off", "inspect_on");
        flip(
            self,
            ("on_unlisted", o.ask.is_some(), n.ask.is_some()),
            "on_unlisted_ask",
            "on_unlisted_deny",
        );
        let net = |t: &ToolPolicy| t.process.as_ref().is_some_and(|p| p.network == Network::Transparent);
        flip(
            self,
            ("network", net(o), net(n)),
            "network_transparent",
            "network_proxy",
        );
        let ms = |d: std::time::Duration| Some(d.as_millis() as u64);
        let (ob, nb) = (o.budgets, n.budgets);
        let mut limits = vec![
            ("budget", "max_requests_per_run", ob.requests, nb.requests),
            ("budget", "max_bytes_per_run", ob.bytes, nb.bytes),
            (
                "budget",
                "max_request_rate.per_second",
                ob.rate.map(|r| r.per_second.into()),
                nb.rate.map(|r| r.per_second.into()),
            ),
            (
                "budget",
                "max_request_rate.burst",
                ob.rate.map(|r| r.burst.into()),
                nb.rate.map(|r| r.burst.into()),
            ),
            ("deadline", "fetch_timeout_ms", ms(o.fetch_timeout), ms(n.fetch_timeout)),
            (
                "slots",
                "max_concurrent_fetches",
                Some(o.max_concurrent_fetches as u64),
                Some(n.max_concurrent_fetches as u64),
            ),
            (
                "slots",
                "max_queued_fetches",
                Some(o.max_queued_fetches as u64),
                Some(n.max_queued_fetches as u64),
            ),
        ];
        if let (Some(oa), Some(na)) = (o.ask, n.ask) {
            limits.push(("deadline", "ask_timeout_ms", ms(oa), ms(na)));
        }
        if let (Some(op), Some(np)) = (&o.process, &n.process) {
            limits.extend([
                (
                    "deadline",
                    "process.timeout_ms",
                    Some(op.timeout_ms),
                    Some(np.timeout_ms),
                ),
                ("deadline", "process.cpu_ms", Some(op.cpu_ms), Some(np.cpu_ms)),
                ("slots", "process.max", Some(op.max as u64), Some(np.max as u64)),
                ("slots", "process.queue", Some(op.queue as u64), Some(np.queue as u64)),
                ("limit", "process.memory_mb", Some(op.memory_mb), Some(np.memory_mb)),
                ("limit", "process.max_pids", Some(op.max_pids), Some(np.max_pids)),
                ("limit", "process.cpu_percent", op.cpu_percent, np.cpu_percent),
            ]);
            let rank = |i: Isolation| match i {
                Isolation::Off => 0,
                Isolation::BestEffort => 1,
                Isolation::Strict => 2,
            };
            let (oi, ni) = (rank(op.isolation), rank(np.isolation));
            if oi != ni {
                let (dir, kind) = if ni < oi {
                    (Direction::Widens, "isolation_loosened")
                } else {
                    (Direction::Narrows, "isolation_tightened")
                };
                self.push(
                    dir,
                    kind,
                    "process.isolation",
                    &format!("{:?} -> {:?}", op.isolation, np.isolation),
                    Scope::Tool,
                );
            }
            for p in np.read_paths.iter().filter(|p| !op.read_paths.contains(p)) {
                self.push(
                    Direction::Widens,
                    "read_path_added",
                    &p.display().to_string(),
                    "",
                    Scope::Limits,
                );
            }
            for p in op.read_paths.iter().filter(|p| !np.read_paths.contains(p)) {
                self.push(
                    Direction::Narrows,
                    "read_path_removed",
                    &p.display().to_string(),
                    "",
                    Scope::Limits,
                );
            }
        }
        for (class, key, was, is) in limits {
            // `None` is unlimited: larger than any number.
            let (w, i) = (was.unwrap_or(u64::MAX), is.unwrap_or(u64::MAX));
            if w == i {
                continue;
            }
            let (dir, kind) = match (class, i > w) {
                ("budget", true) => (Direction::Widens, "budget_loosened"),
                ("budget", false) => (Direction::Narrows, "budget_tightened"),
                ("deadline", true) => (Direction::Widens, "deadline_loosened"),
                ("deadline", false) => (Direction::Narrows, "deadline_tightened"),
                ("slots", true) => (Direction::Widens, "slots_loosened"),
                ("slots", false) => (Direction::Narrows, "slots_tightened"),
                (_, true) => (Direction::Widens, "limit_loosened"),
                (_, false) => (Direction::Narrows, "limit_tightened"),
            };
            self.push(
                dir,
                kind,
                key,
                &format!("{} -> {}", limit(was), limit(is)),
                Scope::Limits,
            );
        }
        self.mcp(o.mcp.as_ref(), n.mcp.as_ref());
    }

    /// Hosts, ports, addresses, `private`, and the methods and paths of
    /// every target both lists admit.
    fn reach(&mut self, a: &Allowlist, b: &Allowlist, o: Option<&ToolPolicy>, n: Option<&ToolPolicy>) {
        let ps = probes(a, b);
        let mut found: Vec<Found> = vec![];
        for p in &ps {
            let port = p.shown.port();
            let (was, is) = (reach(a, &p.host, port), reach(b, &p.host, port));
            if was != is {
                let (dir, from, to) = if is > was {
                    (Direction::Widens, a, b)
                } else {
                    (Direction::Narrows, b, a)
                };
                let (high, low) = if is > was { (is, was) } else { (was, is) };
                let (kind, detail) = self.reach_kind(dir, p, from, to, high, low, &ps);
                found.push(Found {
                    direction: dir,
                    kind,
                    shown: p.shown.clone(),
                    detail,
                    same: format!("{was:?}>{is:?}"),
                });
                continue;
            }
            if was == Reach::None {
                continue;
            }
            let (ra, rb) = (a.requests(&p.host, port), b.requests(&p.host, port));
            let credentialed =
                |t: Option<&ToolPolicy>| t.is_some_and(|t| t.credentials.iter().any(|c| c.allows(&p.host, port)));
            let cred = credentialed(o) || credentialed(n);
            let kinds = if cred {
                [
                    "credential_requests_unrestricted",
                    "credential_requests_restricted",
                    "credential_requests_widened",
                    "credential_requests_narrowed",
                ]
            } else {
                [
                    "requests_unrestricted",
                    "requests_restricted",
                    "requests_widened",
                    "requests_narrowed",
                ]
            };
            let mut add = |direction, kind: &'static str, detail: String| {
                found.push(Found {
                    direction,
                    kind,
                    shown: p.shown.clone(),
                    same: format!("{kind} {detail}"),
                    detail,
                });
            };
            match (atoms(&ra), atoms(&rb)) {
                (None, None) => {}
                (Some(x), None) => add(
                    Direction::Widens,
                    kinds[0],
                    format!("any method and path; was {}", written(&x)),
                ),
                (None, Some(y)) => add(Direction::Narrows, kinds[1], format!("only {}", written(&y))),
                (Some(x), Some(y)) => {
                    let more = uncovered(&x, &y);
                    if !more.is_empty() {
                        add(Direction::Widens, kinds[2], more.join(", "));
                    }
                    let less = uncovered(&y, &x);
                    if !less.is_empty() {
                        add(Direction::Narrows, kinds[3], less.join(", "));
                    }
                }
            }
        }
        // A probe changed exactly as a wildcard covering it adds nothing.
        for f in &found {
            let explained = found.iter().any(|g| {
                g.shown != f.shown
                    && matches!(g.shown, Rule::Suffix { .. })
                    && g.direction == f.direction
                    && g.same == f.same
                    && g.shown.covers(&f.shown)
            });
            if !explained {
                let scope = Scope::Names(f.shown.clone());
                self.push(f.direction, f.kind, &f.shown.to_string(), &f.detail, scope);
            }
        }
    }

    /// The kind of a reach change at `p`, seen as widening from `from` to
    /// `to` (a narrowing is the same seen backwards).
    #[allow(clippy::too_many_arguments)]
    fn reach_kind(
        &self,
        dir: Direction,
        p: &Probe,
        from: &Allowlist,
        _to: &Allowlist,
        high: Reach,
        low: Reach,
        ps: &[Probe],
    ) -> (&'static str, String) {
        let w = dir == Direction::Widens;
        let pick = |widen: &'static str, narrow: &'static str| if w { widen } else { narrow };
        let private = if high == Reach::Private { "private" } else { "" };
        if low == Reach::Public {
            return (pick("private_opened", "private_closed"), String::new());
        }
        let port = p.shown.port();
        // The same target reached on other ports before.
        let other_ports: Vec<String> = ps
            .iter()
            .filter(|q| {
                q.shown.port() != port && q.host == p.host && reach(from, &q.host, q.shown.port()) != Reach::None
            })
            .map(|q| q.shown.port().to_string())
            .collect();
        let on_ports = |k: &str| {
            let mut d = format!("{k} {}", other_ports.join(","));
            if !private.is_empty() {
                d.push_str("; private");
            }
            d
        };
        match &p.shown {
            Rule::Ip { .. } => (pick("ip_added", "ip_removed"), private.to_owned()),
            Rule::Exact { .. } if !other_ports.is_empty() => (
                pick("port_added", "port_removed"),
                on_ports(if w { "was on" } else { "still on" }),
            ),
            Rule::Exact { .. } => (pick("host_added", "host_removed"), private.to_owned()),
            Rule::Suffix { .. } => {
                let under: Vec<String> = from
                    .rules()
                    .iter()
                    .filter(|r| matches!(r, Rule::Suffix { .. }) && p.shown.covers(r))
                    .map(|r| {
                        format!(
                            "*.{}",
                            match r {
                                Rule::Suffix { suffix, .. } => suffix.as_str(),
                                _ => "",
                            }
                        )
                    })
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                if !under.is_empty() {
                    let mut d = format!("{} {}", if w { "was" } else { "now" }, under.join(", "));
                    if !private.is_empty() {
                        d.push_str("; private");
                    }
                    (pick("wildcard_widened", "wildcard_narrowed"), d)
                } else if !other_ports.is_empty() {
                    (
                        pick("port_added", "port_removed"),
                        on_ports(if w { "was on" } else { "still on" }),
                    )
                } else {
                    (pick("wildcard_added", "wildcard_removed"), private.to_owned())
                }
            }
        }
    }
}

#[path = "diff_fields.rs"]
mod fields;

#[cfg(test)]
#[path = "diff_tests.rs"]
mod tests;
