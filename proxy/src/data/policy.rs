//! Pure policy decisions for one fetch: run state, allowlist (before any DNS),
//! method restrictions, and vetting of resolved addresses against the range
//! table and the appliance's own listeners. No I/O, no async: the data plane
//! calls these and acts on the answer.

use crate::addrs::{HostAddrs, SelfAddrs};
use crate::data::target::{Kind, Target};
use crate::deny::DenyReason;
use crate::runs::{Placeholder, RunState};
use egress_config::{Match, Mode, RangeTable, RangeVerdict, ToolPolicy};
use std::net::IpAddr;

/// Lifecycle state of a run.
/// Run-state gate (step 2).
pub fn check_run(state: RunState) -> Result<(), DenyReason> {
    match state {
        RunState::Active => Ok(()),
        RunState::Created => Err(DenyReason::RunNotActive),
        RunState::Ended => Err(DenyReason::RunEnded),
    }
}

/// A denial decided by policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub reason: DenyReason,
    pub detail: String,
}

/// Outcome of the pre-DNS checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Go on; `private` lets resolved addresses fall in default denied ranges.
    Allow { private: bool },
    /// Deny now, without any DNS query.
    Deny(Denial),
    /// Report mode: record this denial, then go on as if allowed.
    Report { denial: Denial, private: bool },
}

fn gate(tool: &ToolPolicy, denial: Denial, private: bool) -> Admission {
    if tool.mode == Mode::Report && denial.reason.reportable() {
        Admission::Report { denial, private }
    } else {
        Admission::Deny(denial)
    }
}

/// The credentials step (after admission): a placeholder of the run that
/// `present` finds in the request is a `credential_misuse` denial unless the
/// target is one of its credential's hosts (a credential no longer
/// configured has no host). Otherwise returns the indices of the tool's
/// credentials to inject on this target (none: an empty list, which does
/// not allocate). Report mode never waives it.
pub fn credentials(
    tool: &ToolPolicy,
    placeholders: &[Placeholder],
    target: &Target,
    present: impl Fn(&str) -> bool,
) -> Result<Vec<usize>, Denial> {
    for p in placeholders {
        if !present(&p.value) {
            continue;
        }
        let cred = tool.credentials.iter().find(|c| *c.name == *p.credential);
        if cred.is_some_and(|c| c.allows(&target.host, target.port)) {
            continue;
        }
        let detail = match cred {
            Some(c) => {
                let hosts: Vec<String> = c.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
                format!(
                    "the placeholder of credential {} of tool {} was sent to {target}; it may only go to {}",
                    p.credential,
                    tool.id,
                    hosts.join(", ")
                )
            }
            None => format!(
                "the placeholder of credential {} was sent to {target}; tool {} no longer has that credential",
                p.credential, tool.id
            ),
        };
        return Err(Denial {
            reason: DenyReason::CredentialMisuse,
            detail,
        });
    }
    if target.kind == Kind::Connect {
        // A blind tunnel carries no header the proxy could set.
        return Ok(Vec::new());
    }
    Ok(tool
        .credentials
        .iter()
        .enumerate()
        .filter(|(_, c)| c.allows(&target.host, target.port))
        .map(|(i, _)| i)
        .collect())
}

/// Whether a CONNECT of `tool` to `target` is intercepted (TLS terminated
/// with a leaf of the appliance CA, HTTP policy applied inside) rather than
/// a blind tunnel: the tool inspects everything, or one of its credentials
/// may go there.
pub fn intercepts(tool: &ToolPolicy, target: &Target) -> bool {
    tool.inspect || tool.credentials.iter().any(|c| c.allows(&target.host, target.port))
}

/// Allowlist and method checks (steps 4 and the method rule). Never resolves.
/// An intercepted CONNECT is not a method the tool uses on the origin: the
/// methods apply to the requests inside it instead.
pub fn admit(tool: &ToolPolicy, target: &Target, method: &str) -> Admission {
    let private = match tool.allowlist.check(&target.host, target.port) {
        Match::Allowed { private } => private,
        Match::IpLiteral => {
            let denial = Denial {
                reason: DenyReason::IpLiteral,
                detail: format!("IP literal {target} is not listed for tool {}", tool.id),
            };
            return gate(tool, denial, false);
        }
        Match::NotAllowlisted => {
            let denial = Denial {
                reason: DenyReason::NotAllowlisted,
                detail: format!("{target} is not in the allowlist of tool {}", tool.id),
            };
            return gate(tool, denial, false);
        }
    };
    // Only a tool that restricts methods asks whether the CONNECT is intercepted.
    let methods = tool
        .methods
        .as_ref()
        .filter(|_| !(target.kind == Kind::Connect && intercepts(tool, target)));
    if let Some(methods) = methods {
        let m = if target.kind == Kind::Connect {
            "CONNECT"
        } else {
            method
        };
        if !methods.iter().any(|x| x == m) {
            let denial = Denial {
                reason: DenyReason::MethodNotAllowed,
                detail: format!("method {m} is not allowed for tool {}", tool.id),
            };
            return gate(tool, denial, private);
        }
    }
    Admission::Allow { private }
}

/// Addresses after vetting (step 6), in resolver order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vetted {
    /// Canonical addresses that may be dialled.
    pub allowed: Vec<IpAddr>,
    /// Addresses dropped by range rules.
    pub private: Vec<IpAddr>,
    /// Addresses dropped because they are the appliance's own listeners.
    pub self_loop: Vec<IpAddr>,
    /// Of `private`, those dropped because they are this host's own addresses.
    pub host: Vec<IpAddr>,
}

impl Vetted {
    /// The denial to make when nothing is left to dial.
    pub fn denial(&self, target: &Target) -> Option<Denial> {
        if !self.allowed.is_empty() {
            return None;
        }
        if !self.self_loop.is_empty() && self.private.is_empty() {
            return Some(Denial {
                reason: DenyReason::SelfLoop,
                detail: format!("{target} resolves to the proxy's own listener"),
            });
        }
        if self.private.is_empty() && self.self_loop.is_empty() {
            return None;
        }
        let list: Vec<String> = self
            .private
            .iter()
            .chain(&self.self_loop)
            .map(|i| i.to_string())
            .collect();
        let mut detail = format!("{target} resolves only to denied addresses: {}", list.join(", "));
        if !self.host.is_empty() {
            let host: Vec<String> = self.host.iter().map(|i| i.to_string()).collect();
            detail.push_str(&format!(" ({} of this host's own interfaces)", host.join(", ")));
        }
        Some(Denial {
            reason: DenyReason::PrivateAddress,
            detail,
        })
    }
}

/// Canonicalizes and vets resolved addresses. Duplicates are dropped.
pub fn vet(
    resolved: &[IpAddr],
    port: u16,
    ranges: &RangeTable,
    private_ok: bool,
    me: &SelfAddrs,
    host: &HostAddrs,
) -> Vetted {
    let mut v = Vetted::default();
    for ip in resolved {
        let ip = ip.to_canonical();
        if v.allowed.contains(&ip) || v.private.contains(&ip) || v.self_loop.contains(&ip) {
            continue;
        }
        if me.contains(ip, port) {
            v.self_loop.push(ip);
            continue;
        }
        match ranges.classify(ip, private_ok) {
            RangeVerdict::Allowed if host.contains(ip) && !ranges.allow_ranges().iter().any(|n| n.contains(&ip)) => {
                v.private.push(ip);
                v.host.push(ip);
            }
            RangeVerdict::Allowed => v.allowed.push(ip),
            RangeVerdict::DefaultDenied(_) | RangeVerdict::OperatorDenied(_) => v.private.push(ip),
        }
    }
    v
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
