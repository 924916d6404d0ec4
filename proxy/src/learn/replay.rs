//! `policy replay`: recorded decisions and denials re-decided under a new
//! policy by the data path's own pure steps ([`crate::data::decide::policy`]): the
//! tool configured, allowlist and IP literals, the tool's methods and its
//! hosts' method and path rules, the credentials' TLS rule, and the
//! recorded resolved addresses vetted against the new ranges. What needs
//! the request itself (a placeholder or secret in its head, budgets, the
//! run's state) is not replayed. A denial fact records no method: an HTTP
//! one is replayed as `GET`, and without a path its path rules are not. An
//! MCP call refused by its name is replayed by its name against the new
//! `[tools.<id>.mcp]`; one the new rules would decide by its arguments is
//! not (a fact holds their digest only).

use crate::addrs::{HostAddrs, SelfAddrs};
use crate::data::decide::policy::{self, Admission, Channel, Head};
use crate::data::decide::target::{Kind, Target};
use crate::learn::{Seen, What};
use egress_config::{Host, McpMatch, Mode, Policy};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// What a policy says of one recorded fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// Report mode lets it through, recording `reason`.
    Reported(String),
    Denied(String),
}

impl Verdict {
    /// Whether the fetch goes out.
    pub fn passes(&self) -> bool {
        !matches!(self, Verdict::Denied(_))
    }
}

/// The denial reasons the pure steps decide (others need the request); an
/// MCP refusal by name too (one by arguments needs the arguments, which a
/// fact never holds).
const REPLAYED: [&str; 11] = [
    "mcp_tool_not_allowed",
    "mcp_resource_not_allowed",
    "mcp_prompt_not_allowed",
    "not_allowlisted",
    "ip_literal",
    "private_address",
    "self_loop",
    "method_not_allowed",
    "path_not_allowed",
    "credential_requires_tls",
    "upgrade_not_allowed",
];

/// What the policy in force said when it was recorded; `None`: not a
/// decision the pure steps make.
pub fn recorded(s: &Seen) -> Option<Verdict> {
    match &s.what {
        What::Allowed { reported: false } => Some(Verdict::Allowed),
        What::Allowed { reported: true } => Some(Verdict::Reported(String::new())),
        What::Denied { reason, .. } if !REPLAYED.contains(&reason.as_str()) => None,
        What::Denied { reason, report: true } => Some(Verdict::Reported(reason.clone())),
        What::Denied { reason, report: false } => Some(Verdict::Denied(reason.clone())),
    }
}

/// A head with nothing in it: credentials are decided on the target alone.
struct NoHead;

impl Head for NoHead {
    fn any(&self, _: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        false
    }
}

/// `s` decided under `p`; `None` when it cannot be (no host, a DNS query).
pub fn decide(p: &Policy, s: &Seen) -> Option<Verdict> {
    if s.kind == "mcp" {
        return decide_mcp(p, s);
    }
    let host = s.parsed_host()?;
    let kind = match s.kind.as_str() {
        "http" => Kind::Http,
        "connect" | "transparent" => Kind::Connect,
        _ => return None,
    };
    let Some(tool) = p.tool(&s.tool) else {
        return Some(Verdict::Denied("not_allowlisted".into()));
    };
    let path = match (&s.path, kind) {
        (Some(path), Kind::Http) => http::uri::PathAndQuery::try_from(path.as_str()).ok(),
        _ => None,
    };
    let target = Target {
        kind,
        host: host.clone(),
        port: s.port,
        path_and_query: path,
    };
    let method = match kind {
        Kind::Connect => "CONNECT",
        Kind::Http => s.method.as_deref().unwrap_or("GET"),
    };
    let mut reported = None;
    let mut gate = |reason: crate::deny::DenyReason| {
        if tool.mode == Mode::Report && reason.reportable() {
            reported.get_or_insert(reason.code().to_owned());
            None
        } else {
            Some(Verdict::Denied(reason.code().to_owned()))
        }
    };
    let private = match policy::admit(tool, &target, method) {
        Admission::Allow { private } => private,
        Admission::Deny(d) => return Some(Verdict::Denied(d.reason.code().to_owned())),
        Admission::Report { denial, private } => {
            gate(denial.reason);
            private
        }
    };
    if kind == Kind::Connect || target.path_and_query.is_some() {
        if let Err(d) = policy::request_rules(tool, &target, method) {
            if let Some(v) = gate(d.reason) {
                return Some(v);
            }
        }
    }
    if let Err(d) = policy::credentials(tool, &p.secrets, &[], &target, Channel::Plain, &NoHead) {
        return Some(Verdict::Denied(d.reason.code().to_owned()));
    }
    let addrs = match host {
        Host::Ip(ip) => vec![ip],
        Host::Name(_) => s.addresses(),
    };
    let vetted = policy::vet(
        &addrs,
        s.port,
        &p.ranges,
        private,
        &SelfAddrs::default(),
        &HostAddrs::default(),
    );
    if let Some(d) = vetted.denial(&target) {
        if let Some(v) = gate(d.reason) {
            return Some(v);
        }
    }
    Some(match reported {
        Some(r) => Verdict::Reported(r),
        None => Verdict::Allowed,
    })
}

/// An MCP call refused by its name, decided under `p` by the name alone
/// (`[tools.<id>.mcp]`, `McpList::check` without arguments); `None` when
/// the new rules would decide by the arguments, which were not recorded.
fn decide_mcp(p: &Policy, s: &Seen) -> Option<Verdict> {
    // Which list: the refusal's reason says, or an allowed call's method.
    let (kind, reason) = match &s.what {
        What::Denied { reason, .. } => match reason.as_str() {
            "mcp_tool_not_allowed" => (0, reason.clone()),
            "mcp_resource_not_allowed" => (1, reason.clone()),
            "mcp_prompt_not_allowed" => (2, reason.clone()),
            _ => return None,
        },
        What::Allowed { .. } => match s.method.as_deref() {
            Some("tools/call") => (0, "mcp_tool_not_allowed".to_owned()),
            Some(m) if m.starts_with("resources/") => (1, "mcp_resource_not_allowed".to_owned()),
            Some("prompts/get") => (2, "mcp_prompt_not_allowed".to_owned()),
            _ => return None,
        },
    };
    let Some(tool) = p.tool(&s.tool) else {
        return Some(Verdict::Denied(reason));
    };
    let Some(rules) = &tool.mcp else {
        return Some(Verdict::Allowed);
    };
    let list = [&rules.tools, &rules.resources, &rules.prompts][kind];
    match list.check(&s.host, None) {
        McpMatch::Allowed => Some(Verdict::Allowed),
        McpMatch::NameDenied | McpMatch::NameNotAllowed if tool.mode == Mode::Report => Some(Verdict::Reported(reason)),
        McpMatch::NameDenied | McpMatch::NameNotAllowed => Some(Verdict::Denied(reason)),
        McpMatch::ArgumentsDenied | McpMatch::ArgumentsNotAllowed => None,
    }
}

/// One target whose verdict changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Change {
    /// `host:port`, or `mcp <name>` for an MCP call.
    pub target: String,
    /// The new policy's reason (`becomes_denied`), or the old one
    /// (`becomes_allowed`).
    pub reason: String,
    /// Records replayed to this change.
    pub count: u64,
    /// Up to three: kind, method and path, and when.
    pub examples: Vec<String>,
}

/// One tool's changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ToolReplay {
    pub tool: String,
    /// Records of the tool replayed.
    pub replayed: u64,
    /// Fetches that went out (allowed, or let through by report mode) and
    /// that the new policy denies.
    pub becomes_denied: Vec<Change>,
    /// Fetches that were denied and that the new policy lets out.
    pub becomes_allowed: Vec<Change>,
}

/// What a new policy would change of the recorded traffic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Replay {
    /// The new policy's digest.
    pub policy: String,
    /// Records replayed.
    pub replayed: u64,
    /// Records not replayable (denials the pure steps do not make: budgets,
    /// authentication, run state, a credential in the head, ...).
    pub skipped: u64,
    /// Whether something that went out would be denied (the command exits 1).
    pub breaks: bool,
    /// Tools with a change, by id.
    pub tools: Vec<ToolReplay>,
}

#[derive(Default)]
struct Acc {
    replayed: u64,
    denied: BTreeMap<(String, String), Change>,
    allowed: BTreeMap<(String, String), Change>,
}

fn note(map: &mut BTreeMap<(String, String), Change>, target: String, reason: String, s: &Seen) {
    let c = map.entry((target.clone(), reason.clone())).or_insert_with(|| Change {
        target,
        reason,
        count: 0,
        examples: vec![],
    });
    c.count += s.count;
    if c.examples.len() < 3 {
        let what = match (&s.method, &s.path) {
            (Some(m), Some(p)) => format!("{m} {p}"),
            (Some(m), None) => m.clone(),
            _ => s.kind.clone(),
        };
        c.examples.push(format!("{what} at {}", s.at));
    }
}

/// Every record of `seen` re-decided under `p`.
pub fn replay(p: &Policy, seen: &[Seen]) -> Replay {
    let mut tools: BTreeMap<String, Acc> = BTreeMap::new();
    let (mut replayed, mut skipped) = (0, 0);
    for s in seen {
        // A fetch report mode let through has its fact, replayed instead
        // (the fact names what report mode waived).
        if s.what == (What::Allowed { reported: true }) {
            continue;
        }
        let (Some(old), Some(new)) = (recorded(s), decide(p, s)) else {
            skipped += 1;
            continue;
        };
        replayed += 1;
        let acc = tools.entry(s.tool.clone()).or_default();
        acc.replayed += 1;
        let target = match s.parsed_host() {
            _ if s.kind == "mcp" => format!("mcp {}", s.host),
            Some(h) => format!("{h}:{}", s.port),
            None => format!("{}:{}", s.host, s.port),
        };
        match (old.passes(), new) {
            (true, Verdict::Denied(reason)) => note(&mut acc.denied, target, reason, s),
            (false, v) if v.passes() => {
                let Verdict::Denied(was) = old else { continue };
                note(&mut acc.allowed, target, was, s);
            }
            _ => {}
        }
    }
    let tools: Vec<ToolReplay> = tools
        .into_iter()
        .filter(|(_, a)| !(a.denied.is_empty() && a.allowed.is_empty()))
        .map(|(tool, a)| ToolReplay {
            tool,
            replayed: a.replayed,
            becomes_denied: a.denied.into_values().collect(),
            becomes_allowed: a.allowed.into_values().collect(),
        })
        .collect();
    Replay {
        policy: p.digest.clone(),
        replayed,
        skipped,
        breaks: tools.iter().any(|t| !t.becomes_denied.is_empty()),
        tools,
    }
}

impl Replay {
    /// The report as the command prints it.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "replayed {} recorded decisions and denials under {} ({} not replayable)",
            self.replayed, self.policy, self.skipped
        );
        if self.tools.is_empty() {
            let _ = writeln!(out, "no change: every replayed fetch gets the verdict it had");
        }
        for t in &self.tools {
            let _ = writeln!(
                out,
                "tool {}: {} target(s) become denied, {} become allowed ({} records replayed)",
                t.tool,
                t.becomes_denied.len(),
                t.becomes_allowed.len(),
                t.replayed
            );
            for (what, list) in [("DENIED ", &t.becomes_denied), ("allowed", &t.becomes_allowed)] {
                for c in list {
                    let _ = writeln!(
                        out,
                        "  becomes {what} {} ({}): {} record(s), e.g. {}",
                        c.target,
                        c.reason,
                        c.count,
                        c.examples.join("; ")
                    );
                }
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A policy of `tools`, documentation addresses allowed (the learn
    /// tests' stand-ins for public ones).
    pub(crate) fn policy(tools: &str) -> Policy {
        // Documentation addresses stand for public ones here.
        egress_config::Config::parse(
            &format!("[proxy]\nallow_ranges = [\"192.0.2.0/24\"]\n{tools}"),
            "new.toml",
        )
        .unwrap()
        .policy
        .as_ref()
        .clone()
    }

    fn seen(tool: &str, kind: &str, host: &str, what: What, resolved: &[&str]) -> Seen {
        Seen {
            tool: tool.into(),
            kind: kind.into(),
            host: host.into(),
            port: 443,
            at: "2026-01-01T00:00:00.000Z".into(),
            count: 1,
            method: (kind == "http").then(|| "POST".to_owned()),
            path: (kind == "http").then(|| "/v1/x".to_owned()),
            resolved: resolved.iter().map(|s| s.to_string()).collect(),
            what,
        }
    }

    const OK: What = What::Allowed { reported: false };

    fn denied(reason: &str) -> What {
        What::Denied {
            reason: reason.into(),
            report: false,
        }
    }

    #[test]
    fn the_pure_steps_decide_each_record() {
        let p = policy(
            "[tools.t]\negress = [\"a.test:443\"]\nmethods = [\"GET\", \"CONNECT\"]\n[tools.r]\negress = []\nmode = \"report\"\n",
        );
        let d = |s: &Seen| decide(&p, s).unwrap();
        assert_eq!(d(&seen("t", "connect", "a.test", OK, &["192.0.2.1"])), Verdict::Allowed);
        assert_eq!(
            d(&seen("t", "connect", "b.test", OK, &["192.0.2.1"])),
            Verdict::Denied("not_allowlisted".into())
        );
        assert_eq!(
            d(&seen("t", "connect", "192.0.2.9", OK, &[])),
            Verdict::Denied("ip_literal".into())
        );
        assert_eq!(
            d(&seen("t", "http", "a.test", OK, &["192.0.2.1"])),
            Verdict::Denied("method_not_allowed".into()),
            "POST is not among the tool's methods"
        );
        // The recorded addresses are vetted against the new ranges.
        assert_eq!(
            d(&seen("t", "connect", "a.test", OK, &["10.0.0.1"])),
            Verdict::Denied("private_address".into())
        );
        assert_eq!(
            d(&seen("gone", "connect", "a.test", OK, &["192.0.2.1"])),
            Verdict::Denied("not_allowlisted".into())
        );
        assert_eq!(
            d(&seen("r", "connect", "b.test", OK, &["192.0.2.1"])),
            Verdict::Reported("not_allowlisted".into())
        );
        assert_eq!(decide(&p, &seen("t", "dns", "a.test", OK, &[])), None);
    }

    #[test]
    fn dropping_a_host_breaks_and_adding_one_does_not() {
        let seen = vec![
            seen("t", "connect", "a.test", OK, &["192.0.2.1"]),
            seen("t", "connect", "a.test", OK, &["192.0.2.1"]),
            seen("t", "connect", "b.test", OK, &["192.0.2.2"]),
            seen("t", "connect", "c.test", denied("not_allowlisted"), &[]),
            seen("t", "connect", "d.test", denied("budget_exhausted"), &[]),
            // Report mode let this one through: its fact is replayed, not it.
            seen(
                "t",
                "connect",
                "b.test",
                What::Allowed { reported: true },
                &["192.0.2.2"],
            ),
        ];
        let old = policy("[tools.t]\negress = [\"a.test:443\", \"b.test:443\"]\n");
        let same = replay(&old, &seen);
        assert!(!same.breaks && same.tools.is_empty(), "{}", same.text());
        assert_eq!((same.replayed, same.skipped), (4, 1));

        let dropped = replay(&policy("[tools.t]\negress = [\"a.test:443\"]\n"), &seen);
        assert!(dropped.breaks);
        let t = &dropped.tools[0];
        assert_eq!(t.becomes_denied.len(), 1);
        assert_eq!(
            (
                t.becomes_denied[0].target.as_str(),
                t.becomes_denied[0].reason.as_str(),
                t.becomes_denied[0].count
            ),
            ("b.test:443", "not_allowlisted", 1)
        );
        assert!(
            dropped.text().contains("becomes DENIED  b.test:443"),
            "{}",
            dropped.text()
        );

        let added = replay(
            &policy("[tools.t]\negress = [\"a.test:443\", \"b.test:443\", \"c.test:443\"]\n"),
            &seen,
        );
        assert!(!added.breaks);
        assert_eq!(added.tools[0].becomes_allowed[0].target, "c.test:443");
        assert_eq!(added.tools[0].becomes_allowed[0].reason, "not_allowlisted");
    }

    #[test]
    fn mcp_calls_refused_by_name_are_replayed_by_name_and_never_by_arguments() {
        let p = policy("[tools.t]\negress = []\n[tools.t.mcp]\ntools = [\"a\", { name = \"b\", args = { x = 1 } }]\ndeny_tools = [\"z\"]\n");
        let mcp = |name: &str, reason: &str| Seen {
            port: 0,
            method: None,
            path: None,
            ..seen("t", "mcp", name, denied(reason), &[])
        };
        assert_eq!(decide(&p, &mcp("a", "mcp_tool_not_allowed")), Some(Verdict::Allowed));
        assert_eq!(
            decide(&p, &mcp("c", "mcp_tool_not_allowed")),
            Some(Verdict::Denied("mcp_tool_not_allowed".into()))
        );
        assert_eq!(
            decide(&p, &mcp("z", "mcp_tool_not_allowed")),
            Some(Verdict::Denied("mcp_tool_not_allowed".into()))
        );
        // Allowed by name but only with arguments: unknown without them.
        assert_eq!(decide(&p, &mcp("b", "mcp_tool_not_allowed")), None);
        assert_eq!(recorded(&mcp("a", "mcp_arguments_not_allowed")), None);
        // Resources and prompts have no rules here: every one allowed.
        assert_eq!(
            decide(&p, &mcp("file:///x", "mcp_resource_not_allowed")),
            Some(Verdict::Allowed)
        );
        let r = replay(
            &p,
            &[mcp("a", "mcp_tool_not_allowed"), mcp("c", "mcp_tool_not_allowed")],
        );
        assert_eq!(r.tools[0].becomes_allowed[0].target, "mcp a");
        assert_eq!(r.replayed, 2);
    }
}
