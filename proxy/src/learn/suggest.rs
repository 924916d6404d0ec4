//! `policy suggest`: a proposed `egress = [...]` for one tool from what it
//! did. Names it was denied (or, in report mode, only reported) for are
//! proposed with counts and first/last seen; listed entries are kept, and
//! those no decision record used are listed apart; names that resolved to
//! denied ranges and IP literals are listed apart, never proposed. With
//! `wildcards`, two or more names under one registrable domain (Public
//! Suffix List) on one port become `*.domain:port`; a wildcard over a
//! public suffix (`*.com`, `*.co.uk`) is never proposed. MCP tools a
//! server was asked for and the rules did not list (their facts, refused or
//! reported) are proposed for `[tools.<id>.mcp] tools`.

use crate::learn::{Seen, What};
use egress_config::{Allowlist, Host, Match, McpMatch, Rule, ToolPolicy};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One line of a proposal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Entry {
    /// The allowlist entry (`host:port`, `*.suffix:port`), or for a listed
    /// entry with method or path rules, as the config check prints it.
    pub entry: String,
    /// Fetches seen (a folded fact counts its repeats).
    pub count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last: Option<String>,
    /// The names a wildcard stands for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// What the name resolved to (names listed apart for denied ranges).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resolved: Vec<String>,
}

/// A proposed allowlist for one tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Proposal {
    pub tool: String,
    /// Records read (denials, reports and decisions of the tool).
    pub records: u64,
    /// Whether decision records said which listed entries were used
    /// (without any, `unused` is empty: usage is unknown).
    pub usage_known: bool,
    /// Listed entries kept: used ones, or all when usage is unknown.
    pub keep: Vec<Entry>,
    /// Entries to add.
    pub add: Vec<Entry>,
    /// Listed entries no decision record used.
    pub unused: Vec<Entry>,
    /// Names that resolved to denied ranges: never proposed.
    pub denied_ranges: Vec<Entry>,
    /// IP literals the tool asked for: never proposed.
    pub ip_literals: Vec<Entry>,
    /// MCP tools the tool's server was asked for and its `[tools.<id>.mcp]`
    /// did not list (refused, or only reported), to add to its `tools`; a
    /// name its rules deny by name is never proposed.
    pub mcp_tools: Vec<Entry>,
    /// The proposal as a TOML `[tools.<tool>]` table with comments.
    pub toml: String,
}

#[derive(Default)]
struct Tally {
    count: u64,
    first: Option<String>,
    last: Option<String>,
    resolved: Vec<String>,
}

impl Tally {
    fn add(&mut self, s: &Seen) {
        self.count += s.count;
        if self.first.as_ref().is_none_or(|f| s.at < *f) {
            self.first = Some(s.at.clone());
        }
        if self.last.as_ref().is_none_or(|l| s.at > *l) {
            self.last = Some(s.at.clone());
        }
        for a in &s.resolved {
            if !self.resolved.contains(a) && self.resolved.len() < 8 {
                self.resolved.push(a.clone());
            }
        }
    }

    fn merge(&mut self, o: &Tally) {
        self.count += o.count;
        for (mine, theirs, earlier) in [(&mut self.first, &o.first, true), (&mut self.last, &o.last, false)] {
            if let Some(t) = theirs {
                if mine.as_ref().is_none_or(|m| if earlier { t < m } else { t > m }) {
                    *mine = Some(t.clone());
                }
            }
        }
    }

    fn entry(&self, entry: String) -> Entry {
        Entry {
            entry,
            count: self.count,
            first: self.first.clone(),
            last: self.last.clone(),
            names: vec![],
            resolved: vec![],
        }
    }
}

/// Denials that say the name resolved only to denied addresses.
fn denied_range(reason: &str) -> bool {
    matches!(reason, "private_address" | "self_loop")
}

/// The proposal for tool `id` (its policy now: `tool`, if configured) from
/// `seen` (any tool's records: the others are skipped).
pub fn suggest(id: &str, tool: Option<&ToolPolicy>, seen: &[Seen], wildcards: bool) -> Proposal {
    let rules: Vec<Rule> = tool.map(|t| t.allowlist.rules().to_vec()).unwrap_or_default();
    let shown: Vec<String> = tool.map(|t| t.allowlist.entries().collect()).unwrap_or_default();
    let single: Vec<Allowlist> = rules.iter().map(|r| Allowlist::new(vec![r.clone()])).collect();
    let mut used: Vec<Tally> = rules.iter().map(|_| Tally::default()).collect();
    let mut wanted: BTreeMap<(String, u16), Tally> = BTreeMap::new();
    let mut ranges: BTreeMap<(String, u16), Tally> = BTreeMap::new();
    let mut literals: BTreeMap<(String, u16), Tally> = BTreeMap::new();
    let (mut records, mut decisions) = (0u64, 0u64);
    let mut mcp_tools: BTreeMap<String, Tally> = BTreeMap::new();
    let mcp = tool.and_then(|t| t.mcp.as_ref());
    for s in seen.iter().filter(|s| s.tool == id) {
        records += 1;
        if s.kind == "mcp" {
            let refused_by_name = matches!(&s.what, What::Denied { reason, .. } if reason == "mcp_tool_not_allowed");
            let denied = mcp.is_some_and(|m| m.tools.check(&s.host, None) == McpMatch::NameDenied);
            if refused_by_name && !denied && !s.host.is_empty() {
                mcp_tools.entry(s.host.clone()).or_default().add(s);
            }
            continue;
        }
        let Some(host) = s.parsed_host() else { continue };
        let key = (host.to_string(), s.port);
        match &s.what {
            What::Denied { reason, .. } if denied_range(reason) => ranges.entry(key).or_default().add(s),
            What::Denied { reason, .. } if reason == "ip_literal" => literals.entry(key).or_default().add(s),
            What::Denied { reason, .. } if reason == "not_allowlisted" => match host {
                Host::Ip(_) => literals.entry(key).or_default().add(s),
                Host::Name(_) => wanted.entry(key).or_default().add(s),
            },
            What::Denied { .. } => {}
            What::Allowed { reported } => {
                decisions += 1;
                let mut listed = false;
                for (i, a) in single.iter().enumerate() {
                    if matches!(a.check(&host, s.port), Match::Allowed { .. }) {
                        used[i].add(s);
                        listed = true;
                    }
                }
                // A reported fetch to an unlisted name has its own fact.
                if !listed && !reported && matches!(host, Host::Name(_)) {
                    wanted.entry(key).or_default().add(s);
                }
            }
        }
    }
    // A name that ever resolved into a denied range is never proposed.
    for k in ranges.keys() {
        wanted.remove(k);
    }
    let usage_known = decisions > 0;
    let (mut keep, mut unused) = (vec![], vec![]);
    for (tally, text) in used.iter().zip(&shown) {
        let e = tally.entry(text.clone());
        if tally.count > 0 || !usage_known {
            keep.push(e);
        } else {
            unused.push(e);
        }
    }
    let mut add = if wildcards {
        collapse(wanted, &ranges)
    } else {
        wanted
            .into_iter()
            .map(|((h, p), t)| t.entry(format!("{h}:{p}")))
            .collect()
    };
    add.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.entry.cmp(&b.entry)));
    let apart = |m: BTreeMap<(String, u16), Tally>| -> Vec<Entry> {
        m.into_iter()
            .map(|((h, p), t)| {
                let host = if h.contains(':') && !h.starts_with('[') {
                    format!("[{h}]")
                } else {
                    h
                };
                Entry {
                    resolved: t.resolved.clone(),
                    ..t.entry(format!("{host}:{p}"))
                }
            })
            .collect()
    };
    let mut p = Proposal {
        tool: id.to_owned(),
        records,
        usage_known,
        keep,
        add,
        unused,
        denied_ranges: apart(ranges),
        ip_literals: apart(literals),
        mcp_tools: mcp_tools.into_iter().map(|(n, t)| t.entry(n)).collect(),
        toml: String::new(),
    };
    p.toml = render(&p, &rules, &shown);
    p
}

/// `*.domain:port` for two or more wanted names under one registrable
/// domain, unless the domain is a public suffix or a name under it
/// resolved into a denied range; every other name stays exact.
fn collapse(wanted: BTreeMap<(String, u16), Tally>, ranges: &BTreeMap<(String, u16), Tally>) -> Vec<Entry> {
    let mut groups: BTreeMap<(String, u16), Vec<(String, Tally)>> = BTreeMap::new();
    let mut out = vec![];
    for ((name, port), t) in wanted {
        match psl::domain_str(&name).filter(|d| *d != name && !is_public_suffix(d)) {
            Some(d) => groups.entry((d.to_owned(), port)).or_default().push((name, t)),
            None => out.push(t.entry(format!("{name}:{port}"))),
        }
    }
    for ((domain, port), names) in groups {
        let tainted = ranges
            .keys()
            .any(|(n, p)| *p == port && n.ends_with(&format!(".{domain}")));
        if names.len() < 2 || tainted {
            out.extend(names.into_iter().map(|(n, t)| t.entry(format!("{n}:{port}"))));
            continue;
        }
        let mut total = Tally::default();
        for (_, t) in &names {
            total.merge(t);
        }
        out.push(Entry {
            names: names.into_iter().map(|(n, _)| n).collect(),
            ..total.entry(format!("*.{domain}:{port}"))
        });
    }
    out
}

/// Whether `name` is itself a public suffix (`com`, `co.uk`, `github.io`).
pub fn is_public_suffix(name: &str) -> bool {
    psl::suffix_str(name) == Some(name)
}

fn seen_text(e: &Entry) -> String {
    let mut s = format!("{} fetch{}", e.count, if e.count == 1 { "" } else { "es" });
    if !e.names.is_empty() {
        let _ = write!(s, " to {}", e.names.join(", "));
    }
    if let (Some(f), Some(l)) = (&e.first, &e.last) {
        let _ = write!(s, ", first {f}, last {l}");
    }
    s
}

fn render(p: &Proposal, rules: &[Rule], shown: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Proposed egress of tool {:?} from {} recorded denials, reports and decisions.",
        p.tool, p.records
    );
    if !p.usage_known {
        let _ = writeln!(
            out,
            "# No decision records (decisions = \"off\"?): which listed entries are used is unknown; all are kept."
        );
    }
    let _ = writeln!(out, "[tools.{}]\negress = [", p.tool);
    let plain = |entry: &str| {
        rules
            .iter()
            .zip(shown)
            .any(|(r, s)| s == entry && r.to_string() == *s && !s.ends_with(" (private)"))
    };
    for e in &p.keep {
        if plain(&e.entry) {
            let _ = writeln!(out, "    {:?},  # listed: {}", e.entry, seen_text(e));
        } else {
            let _ = writeln!(
                out,
                "    # listed, keep as written in the config: {}  ({})",
                e.entry,
                seen_text(e)
            );
        }
    }
    for e in &p.add {
        let _ = writeln!(out, "    {:?},  # add: {}", e.entry, seen_text(e));
    }
    let _ = writeln!(out, "]");
    if !p.unused.is_empty() {
        let _ = writeln!(out, "# Listed but unused by any recorded decision (left out above):");
        for e in &p.unused {
            let _ = writeln!(out, "#   {:?}", e.entry);
        }
    }
    if !p.denied_ranges.is_empty() {
        let _ = writeln!(out, "# Never proposed: these resolved to denied ranges.");
        for e in &p.denied_ranges {
            let _ = writeln!(
                out,
                "#   {:?}  # {}; resolved {}",
                e.entry,
                seen_text(e),
                e.resolved.join(", ")
            );
        }
    }
    if !p.ip_literals.is_empty() {
        let _ = writeln!(out, "# Never proposed: IP literals.");
        for e in &p.ip_literals {
            let _ = writeln!(out, "#   {:?}  # {}", e.entry, seen_text(e));
        }
    }
    if !p.mcp_tools.is_empty() {
        let _ = writeln!(
            out,
            "# MCP tools its server was asked for that [tools.{}.mcp] does not list; add to its `tools`:",
            p.tool
        );
        for e in &p.mcp_tools {
            let _ = writeln!(out, "#   {:?},  # {}", e.entry, seen_text(e));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(host: &str, port: u16, what: What, at: &str) -> Seen {
        Seen {
            tool: "t".into(),
            kind: "connect".into(),
            host: host.into(),
            port,
            at: at.into(),
            count: 1,
            method: None,
            path: None,
            resolved: vec!["192.0.2.1".into()],
            what,
        }
    }

    fn denied(reason: &str) -> What {
        What::Denied {
            reason: reason.into(),
            report: true,
        }
    }

    const ALLOWED: What = What::Allowed { reported: false };

    fn tool(egress: &str) -> ToolPolicy {
        let text = format!("[tools.t]\negress = {egress}\n");
        let c = egress_config::Config::parse(&text, "t.toml").unwrap();
        c.policy.tool("t").unwrap().as_ref().clone()
    }

    fn entries(v: &[Entry]) -> Vec<&str> {
        v.iter().map(|e| e.entry.as_str()).collect()
    }

    #[test]
    fn denied_names_are_proposed_with_counts_and_first_and_last_seen() {
        let t = tool("[\"api.test:443\", \"old.test:443\"]");
        let s = vec![
            seen("new.test", 443, denied("not_allowlisted"), "2026-01-01T00:00:02.000Z"),
            seen("new.test", 443, denied("not_allowlisted"), "2026-01-01T00:00:01.000Z"),
            seen("api.test", 443, ALLOWED, "2026-01-01T00:00:03.000Z"),
            seen("other", 443, denied("not_allowlisted"), "2026-01-01T00:00:03.000Z"),
        ];
        let mut s2 = s.clone();
        s2[3].tool = "other-tool".into();
        let p = suggest("t", Some(&t), &s2, false);
        assert_eq!(entries(&p.add), ["new.test:443"]);
        assert_eq!(p.add[0].count, 2);
        assert_eq!(p.add[0].first.as_deref(), Some("2026-01-01T00:00:01.000Z"));
        assert_eq!(p.add[0].last.as_deref(), Some("2026-01-01T00:00:02.000Z"));
        assert_eq!(entries(&p.keep), ["api.test:443"]);
        assert_eq!(entries(&p.unused), ["old.test:443"]);
        assert!(p.toml.contains("\"new.test:443\",  # add: 2 fetches"), "{}", p.toml);
        // The TOML parses and lists what is proposed.
        let v: toml::Value = toml::from_str(&p.toml).unwrap();
        assert_eq!(
            v["tools"]["t"]["egress"],
            toml::Value::Array(vec!["api.test:443".into(), "new.test:443".into()])
        );
    }

    #[test]
    fn without_decision_records_every_listed_entry_is_kept() {
        let t = tool("[\"api.test:443\"]");
        let p = suggest(
            "t",
            Some(&t),
            &[seen("x.test", 443, denied("not_allowlisted"), "a")],
            false,
        );
        assert!(!p.usage_known);
        assert_eq!(entries(&p.keep), ["api.test:443"]);
        assert!(p.unused.is_empty());
    }

    #[test]
    fn names_in_denied_ranges_and_ip_literals_are_never_proposed() {
        let s = vec![
            seen("inside.test", 443, denied("not_allowlisted"), "a"),
            seen("inside.test", 443, denied("private_address"), "b"),
            seen("192.0.2.7", 443, denied("ip_literal"), "c"),
            seen("::1", 443, denied("ip_literal"), "c"),
        ];
        let p = suggest("t", None, &s, true);
        assert!(p.add.is_empty(), "{:?}", p.add);
        assert_eq!(entries(&p.denied_ranges), ["inside.test:443"]);
        assert_eq!(entries(&p.ip_literals), ["192.0.2.7:443", "[::1]:443"]);
        assert!(p.toml.contains("Never proposed"), "{}", p.toml);
    }

    #[test]
    fn wildcards_collapse_under_a_registrable_domain_never_a_public_suffix() {
        let names = [
            "a.one.com",
            "b.two.com",
            "x.shop.co.uk",
            "y.shop.co.uk",
            "p.foo.github.io",
            "q.bar.github.io",
            "one.example.org",
            "one.com",
            "two.com",
            "one.co.uk",
            "two.co.uk",
        ];
        let s: Vec<Seen> = names
            .iter()
            .map(|n| seen(n, 443, denied("not_allowlisted"), "a"))
            .collect();
        let p = suggest("t", None, &s, true);
        let got = entries(&p.add);
        assert!(got.contains(&"*.shop.co.uk:443"), "{got:?}");
        for bad in ["*.com:443", "*.co.uk:443", "*.github.io:443", "*.uk:443", "*.org:443"] {
            assert!(!got.contains(&bad), "{bad} proposed: {got:?}");
        }
        for exact in [
            "a.one.com:443",
            "b.two.com:443",
            "p.foo.github.io:443",
            "one.example.org:443",
        ] {
            assert!(got.contains(&exact), "{exact} missing: {got:?}");
        }
        let w = p.add.iter().find(|e| e.entry == "*.shop.co.uk:443").unwrap();
        assert_eq!((w.count, w.names.len()), (2, 2));
        // Without --wildcards, never.
        let p = suggest("t", None, &s, false);
        assert!(p.add.iter().all(|e| !e.entry.starts_with('*')));
        assert!(is_public_suffix("co.uk") && is_public_suffix("com") && !is_public_suffix("shop.co.uk"));
    }

    #[test]
    fn a_wildcard_is_not_proposed_over_a_name_in_a_denied_range() {
        let s = vec![
            seen("a.corp.example.com", 443, denied("not_allowlisted"), "a"),
            seen("b.corp.example.com", 443, denied("not_allowlisted"), "a"),
            seen("db.example.com", 443, denied("private_address"), "a"),
        ];
        let got: Vec<String> = suggest("t", None, &s, true).add.into_iter().map(|e| e.entry).collect();
        assert_eq!(got, ["a.corp.example.com:443", "b.corp.example.com:443"]);
    }

    #[test]
    fn mcp_tools_asked_for_and_not_listed_are_proposed_never_a_denied_one() {
        let text = "[tools.t]\negress = []\n[tools.t.mcp]\ntools = [\"a\"]\ndeny_tools = [\"bad\"]\n";
        let c = egress_config::Config::parse(text, "t.toml").unwrap();
        let t = c.policy.tool("t").unwrap().as_ref().clone();
        let mcp = |name: &str, reason: &str| Seen {
            kind: "mcp".into(),
            port: 0,
            ..seen(
                name,
                0,
                What::Denied {
                    reason: reason.into(),
                    report: false,
                },
                "2026-01-01T00:00:00.000Z",
            )
        };
        let s = suggest(
            "t",
            Some(&t),
            &[
                mcp("b", "mcp_tool_not_allowed"),
                mcp("b", "mcp_tool_not_allowed"),
                mcp("bad", "mcp_tool_not_allowed"),
                mcp("a", "mcp_arguments_not_allowed"),
            ],
            false,
        );
        assert_eq!(entries(&s.mcp_tools), ["b"]);
        assert_eq!(s.mcp_tools[0].count, 2);
        assert!(s.add.is_empty(), "MCP names are never egress entries: {:?}", s.add);
        assert!(
            s.toml.contains("#   \"b\",") && !s.toml.contains("\"bad\""),
            "{}",
            s.toml
        );
    }
}
