//! The fields of a tool `policy diff` compares one by one: its methods,
//! its credentials (by name) and its MCP rules (entry by entry, as
//! written).

use super::{Diff, Direction, Scope};
use crate::allowlist::Rule;
use crate::credentials::Plaintext;
use crate::mcp::{McpList, McpRules};
use crate::ToolPolicy;
use std::collections::{BTreeMap, BTreeSet};

impl Diff<'_> {
    /// The tool's own `methods` (plain-HTTP fetches).
    pub(super) fn methods(&mut self, o: &Option<Vec<String>>, n: &Option<Vec<String>>) {
        match (o, n) {
            (Some(o), None) => self.push(
                Direction::Widens,
                "methods_unrestricted",
                "methods",
                &format!("was {}", o.join(",")),
                Scope::Tool,
            ),
            (None, Some(n)) => self.push(
                Direction::Narrows,
                "methods_restricted",
                "methods",
                &n.join(","),
                Scope::Tool,
            ),
            (Some(o), Some(n)) => {
                let added: Vec<&str> = n.iter().filter(|m| !o.contains(m)).map(String::as_str).collect();
                let removed: Vec<&str> = o.iter().filter(|m| !n.contains(m)).map(String::as_str).collect();
                if !added.is_empty() {
                    self.push(
                        Direction::Widens,
                        "methods_added",
                        "methods",
                        &added.join(","),
                        Scope::Tool,
                    );
                }
                if !removed.is_empty() {
                    self.push(
                        Direction::Narrows,
                        "methods_removed",
                        "methods",
                        &removed.join(","),
                        Scope::Tool,
                    );
                }
            }
            (None, None) => {}
        }
    }

    /// Credentials by name: added, removed, hosts widened or narrowed,
    /// plain HTTP allowed further.
    pub(super) fn credentials(&mut self, o: Option<&ToolPolicy>, n: &ToolPolicy) {
        let (ob, nb) = (by_name(o), by_name(Some(n)));
        let hosts =
            |c: &crate::Credential| -> BTreeSet<String> { c.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect() };
        let rank = |p: Plaintext| match p {
            Plaintext::Never => 0,
            Plaintext::Loopback => 1,
            Plaintext::Anywhere => 2,
        };
        for (name, c) in &nb {
            let Some(was) = ob.get(name) else {
                let list: Vec<String> = hosts(c).into_iter().collect();
                self.push(
                    Direction::Widens,
                    "credential_added",
                    name,
                    &list.join(","),
                    Scope::Tool,
                );
                continue;
            };
            let (wh, ih) = (hosts(was), hosts(c));
            for (from, to, dir, kind) in [
                (&wh, &ih, Direction::Widens, "credential_hosts_widened"),
                (&ih, &wh, Direction::Narrows, "credential_hosts_narrowed"),
            ] {
                let diff: Vec<&String> = to.difference(from).collect();
                for h in diff {
                    let rule = Rule::parse_str(h).ok();
                    let scope = rule.map_or(Scope::Tool, Scope::Names);
                    self.push(dir, kind, name, h, scope);
                }
            }
            let (a, b) = (rank(was.allow_plaintext), rank(c.allow_plaintext));
            if a != b {
                let (dir, kind) = if b > a {
                    (Direction::Widens, "credential_plaintext_loosened")
                } else {
                    (Direction::Narrows, "credential_plaintext_tightened")
                };
                self.push(
                    dir,
                    kind,
                    name,
                    &format!("{:?} -> {:?}", was.allow_plaintext, c.allow_plaintext),
                    Scope::Tool,
                );
            }
        }
        for name in ob.keys().filter(|k| !nb.contains_key(*k)) {
            self.push(Direction::Narrows, "credential_removed", name, "", Scope::Tool);
        }
    }

    /// MCP rules, entry by entry (an entry is compared as written).
    pub(super) fn mcp(&mut self, o: Option<&McpRules>, n: Option<&McpRules>) {
        let (o, n) = match (o, n) {
            (None, None) => return,
            (Some(_), None) => return self.push(Direction::Widens, "mcp_unrestricted", "mcp", "", Scope::Tool),
            (None, Some(_)) => return self.push(Direction::Narrows, "mcp_restricted", "mcp", "", Scope::Tool),
            (Some(o), Some(n)) => (o, n),
        };
        for (kind, a, b) in [
            ("tools", &o.tools, &n.tools),
            ("resources", &o.resources, &n.resources),
            ("prompts", &o.prompts, &n.prompts),
        ] {
            self.mcp_list(kind, a, b);
        }
    }

    fn mcp_list(&mut self, kind: &str, a: &McpList, b: &McpList) {
        let show = |e: &crate::McpEntry| {
            if e.args.is_empty() {
                e.name.as_str().to_owned()
            } else {
                format!("{} (with argument rules)", e.name.as_str())
            }
        };
        match (&a.allow, &b.allow) {
            (Some(_), None) => self.push(Direction::Widens, "mcp_allow_unrestricted", kind, "", Scope::Tool),
            (None, Some(_)) => self.push(Direction::Narrows, "mcp_allow_restricted", kind, "", Scope::Tool),
            (Some(x), Some(y)) => {
                for e in y.iter().filter(|e| !x.contains(e)) {
                    self.push(Direction::Widens, "mcp_allow_added", kind, &show(e), Scope::Tool);
                }
                for e in x.iter().filter(|e| !y.contains(e)) {
                    self.push(Direction::Narrows, "mcp_allow_removed", kind, &show(e), Scope::Tool);
                }
            }
            (None, None) => {}
        }
        for e in a.deny.iter().filter(|e| !b.deny.contains(e)) {
            self.push(Direction::Widens, "mcp_deny_removed", kind, &show(e), Scope::Tool);
        }
        for e in b.deny.iter().filter(|e| !a.deny.contains(e)) {
            self.push(Direction::Narrows, "mcp_deny_added", kind, &show(e), Scope::Tool);
        }
    }
}

/// A tool's credentials by name.
fn by_name(t: Option<&ToolPolicy>) -> BTreeMap<String, &crate::Credential> {
    t.map(|t| t.credentials.iter().map(|c| (c.name.to_string(), c)).collect())
        .unwrap_or_default()
}
