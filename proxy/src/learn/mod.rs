//! What recorded traffic says about a policy: [`suggest`] proposes a tool's
//! allowlist from its denials, report-mode facts and decision records;
//! [`replay`] re-decides recorded traffic under a new policy with the data
//! path's own pure decision functions. Both are pure and take [`Seen`]
//! records; [`history`] reads them from a proxy's store (the `policy`
//! commands) or its live state (the control API).

pub mod diff;
pub mod history;
pub mod replay;
pub mod suggest;

use crate::facts::decisions::Decision;
use crate::facts::Fact;
use egress_config::Host;
use std::net::IpAddr;

/// One recorded fetch, denial or decision alike, as suggest and replay see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub tool: String,
    /// `http`, `connect`, `transparent` or `dns`.
    pub kind: String,
    /// The canonical host as recorded (a name, or an address).
    pub host: String,
    pub port: u16,
    pub at: String,
    /// How many fetches this stands for (a folded fact's count).
    pub count: u64,
    pub method: Option<String>,
    pub path: Option<String>,
    pub resolved: Vec<String>,
    pub what: What,
}

/// What the policy in force said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    /// Allowed and carried (a decision record); `reported`: report mode
    /// let a denial of it through.
    Allowed { reported: bool },
    /// A denial fact, enforced or (`report`) only reported.
    Denied { reason: String, report: bool },
}

impl Seen {
    /// A fact with a target (others say nothing about destinations).
    pub fn from_fact(f: &Fact) -> Option<Seen> {
        let t = f.target.as_ref()?;
        if f.kind != crate::facts::FACT_TYPE {
            return None;
        }
        Some(Seen {
            tool: f.tool.clone()?,
            kind: t.kind.clone(),
            host: t.host.clone(),
            port: t.port,
            at: f.at.clone(),
            count: f.count.max(1),
            method: None,
            path: None,
            resolved: f.resolved.clone(),
            what: What::Denied {
                reason: f.reason.clone(),
                report: f.mode == "report",
            },
        })
    }

    pub fn from_decision(d: &Decision) -> Seen {
        Seen {
            tool: d.tool.clone(),
            kind: d.kind.clone(),
            host: d.host.clone(),
            port: d.port,
            at: d.at.clone(),
            count: 1,
            method: d.method.clone(),
            path: d.path.clone(),
            resolved: d.resolved.clone(),
            what: What::Allowed { reported: d.reported },
        }
    }

    /// The host as the policy functions take it.
    pub fn parsed_host(&self) -> Option<Host> {
        match self.host.parse::<IpAddr>() {
            Ok(ip) => Some(Host::Ip(ip)),
            Err(_) => egress_config::parse_host(&self.host).ok(),
        }
    }

    /// The addresses the name resolved to, as recorded.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.resolved.iter().filter_map(|a| a.parse().ok()).collect()
    }
}

/// `30s`, `15m`, `24h`, `7d` (or plain seconds) as a duration.
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        "d" => n.checked_mul(86_400)?,
        _ => return None,
    };
    Some(std::time::Duration::from_secs(secs))
}

/// The RFC 3339 time `d` ago (records at or after it are "since `d`").
pub fn since(d: std::time::Duration) -> String {
    crate::time::rfc3339(
        std::time::SystemTime::now()
            .checked_sub(d)
            .unwrap_or(std::time::UNIX_EPOCH),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_have_a_unit_or_are_seconds() {
        assert_eq!(parse_duration("90"), Some(std::time::Duration::from_secs(90)));
        assert_eq!(parse_duration("15m"), Some(std::time::Duration::from_secs(900)));
        assert_eq!(parse_duration("24h"), Some(std::time::Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Some(std::time::Duration::from_secs(604_800)));
        assert_eq!(parse_duration("7w"), None);
        assert_eq!(parse_duration("h"), None);
    }
}
