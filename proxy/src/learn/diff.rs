//! `policy diff` joined with `policy replay`: each change in reach between
//! two policies ([`egress_config::diff`]) with the recorded fetches whose
//! verdict the new policy changes, each replayed target given to the most
//! specific changes that concern it (a name before a range before the tool).

use crate::learn::replay::{self, Replay};
use egress_config::diff::{self as d, Direction};
use egress_config::Policy;
use serde::Serialize;
use std::fmt::Write as _;

/// One change, with the replayed targets it accounts for.
#[derive(Debug, Clone, Serialize)]
pub struct Joined {
    #[serde(flatten)]
    pub change: d::Change,
    /// With a replay only: fetches that were denied and now go out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub becomes_allowed: Option<Vec<replay::Change>>,
    /// With a replay only: fetches that went out and are now denied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub becomes_denied: Option<Vec<replay::Change>>,
}

/// The replay's counts and what no change accounts for (traffic recorded
/// under a policy other than OLD).
#[derive(Debug, Clone, Serialize)]
pub struct ReplaySummary {
    pub replayed: u64,
    pub skipped: u64,
    pub unattributed: Vec<replay::ToolReplay>,
}

/// What `policy diff` prints (`--format json`: this object).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The policies' digests.
    pub old: String,
    pub new: String,
    /// Whether some change widens reach (the command exits 1).
    pub widens: bool,
    pub changes: Vec<Joined>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplaySummary>,
}

/// The target of a replayed change as a host and port.
fn target(t: &str) -> Option<(egress_config::Host, u16)> {
    let (h, p) = t.rsplit_once(':')?;
    let host = match h
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
    {
        Ok(ip) => egress_config::Host::Ip(ip),
        Err(_) => egress_config::parse_host(h).ok()?,
    };
    Some((host, p.parse().ok()?))
}

/// The changes from `old` to `new`, joined with `replayed` (the replay of
/// recorded traffic under `new`) when given.
pub fn report(old: &Policy, new: &Policy, replayed: Option<Replay>) -> Report {
    let changes = d::diff(old, new);
    let with = replayed.is_some();
    let mut joined: Vec<Joined> = changes
        .into_iter()
        .map(|change| Joined {
            change,
            becomes_allowed: with.then(Vec::new),
            becomes_denied: with.then(Vec::new),
        })
        .collect();
    let summary = replayed.map(|r| {
        let mut unattributed = vec![];
        for t in r.tools {
            let mut left = replay::ToolReplay {
                tool: t.tool.clone(),
                replayed: t.replayed,
                becomes_denied: vec![],
                becomes_allowed: vec![],
            };
            for (allowed, list) in [(true, t.becomes_allowed), (false, t.becomes_denied)] {
                for c in list {
                    let Some((host, port)) = target(&c.target) else {
                        continue;
                    };
                    let concern: Vec<usize> = (0..joined.len())
                        .filter(|&i| joined[i].change.concerns(&t.tool, &host, port, &c.reason))
                        .collect();
                    let best = concern.iter().map(|&i| joined[i].change.specificity()).max();
                    let mut placed = false;
                    for &i in &concern {
                        if Some(joined[i].change.specificity()) == best {
                            let j = &mut joined[i];
                            let slot = if allowed {
                                &mut j.becomes_allowed
                            } else {
                                &mut j.becomes_denied
                            };
                            slot.get_or_insert_with(Vec::new).push(c.clone());
                            placed = true;
                        }
                    }
                    if !placed {
                        let slot = if allowed {
                            &mut left.becomes_allowed
                        } else {
                            &mut left.becomes_denied
                        };
                        slot.push(c);
                    }
                }
            }
            if !(left.becomes_allowed.is_empty() && left.becomes_denied.is_empty()) {
                unattributed.push(left);
            }
        }
        ReplaySummary {
            replayed: r.replayed,
            skipped: r.skipped,
            unattributed,
        }
    });
    Report {
        old: old.digest.clone(),
        new: new.digest.clone(),
        widens: joined.iter().any(|j| j.change.direction == Direction::Widens),
        changes: joined,
        replay: summary,
    }
}

fn replayed_lines(out: &mut String, allowed: &[replay::Change], denied: &[replay::Change]) {
    for (what, was, list) in [("allowed", "was ", allowed), ("DENIED ", "", denied)] {
        for c in list {
            let _ = writeln!(
                out,
                "    becomes {what} {} ({was}{}): {} record(s), e.g. {}",
                c.target,
                c.reason,
                c.count,
                c.examples.join("; ")
            );
        }
    }
}

impl Report {
    /// The report as the control API answers it.
    pub fn view(&self) -> egress_api::PolicyDiff {
        let values = |v: &Option<Vec<replay::Change>>| {
            v.as_ref()
                .map(|v| v.iter().filter_map(|c| serde_json::to_value(c).ok()).collect())
        };
        egress_api::PolicyDiff {
            old: self.old.clone(),
            new: self.new.clone(),
            widens: self.widens,
            changes: self
                .changes
                .iter()
                .map(|j| egress_api::PolicyChange {
                    direction: match j.change.direction {
                        Direction::Widens => "widens",
                        Direction::Narrows => "narrows",
                    }
                    .to_owned(),
                    kind: j.change.kind.to_owned(),
                    tool: j.change.tool.clone(),
                    target: j.change.target.clone(),
                    detail: j.change.detail.clone(),
                    becomes_allowed: values(&j.becomes_allowed),
                    becomes_denied: values(&j.becomes_denied),
                })
                .collect(),
            replay: self.replay.as_ref().and_then(|r| serde_json::to_value(r).ok()),
        }
    }

    /// One line per change, widenings first, each with the recorded fetches
    /// it changes indented under it; a summary last.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for j in &self.changes {
            let _ = writeln!(out, "{}", d::line(&j.change));
            replayed_lines(
                &mut out,
                j.becomes_allowed.as_deref().unwrap_or_default(),
                j.becomes_denied.as_deref().unwrap_or_default(),
            );
        }
        let n = |dir| self.changes.iter().filter(|j| j.change.direction == dir).count();
        if self.changes.is_empty() {
            let _ = writeln!(out, "no change in reach");
        } else {
            let _ = writeln!(
                out,
                "{} change(s) widen reach, {} narrow it",
                n(Direction::Widens),
                n(Direction::Narrows)
            );
        }
        if let Some(r) = &self.replay {
            let _ = writeln!(
                out,
                "replayed {} recorded decisions and denials ({} not replayable)",
                r.replayed, r.skipped
            );
            for t in &r.unattributed {
                let _ = writeln!(out, "  tool {}: changes no diff line accounts for", t.tool);
                replayed_lines(&mut out, &t.becomes_allowed, &t.becomes_denied);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::replay::tests::policy;
    use crate::learn::{Seen, What};

    fn denied(host: &str) -> Seen {
        Seen {
            tool: "t".into(),
            kind: "connect".into(),
            host: host.into(),
            port: 443,
            at: "2026-01-01T00:00:00.000Z".into(),
            count: 2,
            method: None,
            path: None,
            resolved: vec!["192.0.2.1".into()],
            what: What::Denied {
                reason: "not_allowlisted".into(),
                report: false,
            },
        }
    }

    #[test]
    fn a_denied_fetch_the_new_policy_allows_shows_under_its_change() {
        let old = policy("[tools.t]\negress = [\"a.test:443\"]\n");
        let new = policy("[tools.t]\negress = [\"a.test:443\", \"*.b.test:443\"]\nmode = \"report\"\n");
        let seen = vec![denied("x.b.test"), denied("c.test")];
        let r = report(&old, &new, Some(replay::replay(&new, &seen)));
        assert!(r.widens);
        let wild = r.changes.iter().find(|j| j.change.kind == "wildcard_added").unwrap();
        let allowed = wild.becomes_allowed.as_ref().unwrap();
        assert_eq!((allowed[0].target.as_str(), allowed[0].count), ("x.b.test:443", 2));
        // c.test goes out only because report mode lets it: the tool's change.
        let mode = r.changes.iter().find(|j| j.change.kind == "mode_report").unwrap();
        assert_eq!(mode.becomes_allowed.as_ref().unwrap()[0].target, "c.test:443");
        let text = r.text();
        assert!(
            text.contains(
                "WIDENS  tool t: wildcard_added *.b.test:443\n    becomes allowed x.b.test:443 (was not_allowlisted): 2 record(s)"
            ),
            "{text}"
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["changes"][0]["direction"], "widens");
        assert!(report(&old, &old, None).changes.is_empty());
    }
}
