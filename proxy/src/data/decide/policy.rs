//! Pure policy decisions for one fetch: run state, allowlist (before any DNS),
//! method and path rules, credentials (placeholders and real secrets only to
//! their hosts, only over verified TLS), and vetting of resolved addresses
//! against the range table and the appliance's own listeners. No I/O, no
//! async: every entrance calls these and acts on the answer.

use crate::addrs::{HostAddrs, SelfAddrs};
use crate::creds::sigv4;
use crate::data::decide::target::{Kind, Target};
use crate::deny::DenyReason;
use crate::runs::{Placeholder, RunState};
use egress_config::allowlist::RequestRules;
use egress_config::requests::{self, Verdict};
use egress_config::{Credential, Host, Match, Mode, Plaintext, RangeTable, RangeVerdict, SecretScan, ToolPolicy};
use http::uri::PathAndQuery;
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

/// The pieces of a request head that a tool wrote and that could carry a
/// secret: method, target host, path and query, header names and values.
pub trait Head {
    /// Whether `f` holds for any piece.
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool;
    /// Calls `f` with each value of header `name` (lower-case), in order.
    /// A head without headers (a WebSocket message) has none.
    fn header(&self, _name: &str, _f: &mut dyn FnMut(&[u8])) {}
    /// The raw query string, without '?'.
    fn query(&self) -> Option<&str> {
        None
    }
}

/// How the request would go to the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// Plain HTTP: nothing verified who holds the pinned address.
    Plain,
    /// Inside TLS the proxy opened and verified for the host itself.
    VerifiedTls,
}

/// The credentials to write into one request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inject {
    /// Indices into the tool's `credentials` (empty: no allocation).
    pub creds: Vec<usize>,
    /// Plain HTTP under `allow_plaintext = true`: only loopback addresses
    /// may be dialled.
    pub loopback_only: bool,
}

/// The credentials step (after admission), for every entrance:
///
/// - a placeholder of the run anywhere in the head, to a host that is not
///   one of its credential's hosts, is `credential_misuse` (a credential no
///   longer configured has no host);
/// - so is the real value of any credential of the policy (`secrets`, in
///   any of its forms), unless the target is one of that credential's
///   hosts and it is the tool's own;
/// - a request to a credential's host that would go out in plain HTTP is
///   `credential_requires_tls` unless the credential allows plaintext.
///
/// Otherwise returns what to inject. Report mode never waives it.
pub fn credentials(
    tool: &ToolPolicy,
    secrets: &SecretScan,
    placeholders: &[Placeholder],
    target: &Target,
    channel: Channel,
    head: &dyn Head,
) -> Result<Inject, Denial> {
    for p in placeholders {
        let ph = p.value.as_bytes();
        if !head.any(&mut |piece| contains(piece, ph)) {
            continue;
        }
        let cred = tool.credentials.iter().find(|c| *c.name == *p.credential);
        if cred.is_some_and(|c| c.allows(&target.host, target.port)) {
            continue;
        }
        let detail = match cred {
            Some(c) => format!(
                "the placeholder of credential {} of tool {} was sent to {target}; it may only go to {}",
                p.credential,
                tool.id,
                hosts(c)
            ),
            None => format!(
                "the placeholder of credential {} was sent to {target}; tool {} no longer has that credential",
                p.credential, tool.id
            ),
        };
        return Err(misuse(detail));
    }
    if !secrets.is_empty() {
        let mut misused = None;
        head.any(&mut |piece| {
            misused = secrets
                .find_all(piece)
                .map(|f| secrets.owner(f.pattern))
                .find(|o| {
                    *o.tool != *tool.id
                        || !tool
                            .credentials
                            .get(o.credential)
                            .is_some_and(|c| c.allows(&target.host, target.port))
                })
                .cloned();
            misused.is_some()
        });
        if let Some(o) = misused {
            return Err(misuse(format!(
                "the real value of credential {} of tool {} was sent to {target}; it goes only to that credential's hosts",
                o.name, o.tool
            )));
        }
    }
    if target.kind == Kind::Connect {
        // A blind tunnel carries no header the proxy could set.
        return Ok(Inject::default());
    }
    let mut inject = Inject::default();
    for (i, c) in tool.credentials.iter().enumerate() {
        if !c.allows(&target.host, target.port) {
            continue;
        }
        if let Some(sign) = &c.sign {
            let ph = placeholders.iter().find(|p| *p.credential == *c.name);
            signature(tool, c, sign, ph.map(|p| &*p.value), target, head)?;
        }
        if c.unavailable() {
            return Err(Denial {
                reason: DenyReason::CredentialUnavailable,
                detail: format!(
                    "{target} needs credential {} of tool {}, whose {} source has no usable value (never read, or expired and not refreshed); the request did not leave",
                    c.name,
                    tool.id,
                    c.source.kind()
                ),
            });
        }
        if channel == Channel::Plain {
            match c.allow_plaintext {
                Plaintext::Never => {
                    return Err(Denial {
                        reason: DenyReason::CredentialRequiresTls,
                        detail: format!(
                            "{target} holds credential {} of tool {}, which goes only over TLS the proxy verified: use https:// (CONNECT)",
                            c.name, tool.id
                        ),
                    })
                }
                Plaintext::Loopback => inject.loopback_only = true,
                Plaintext::Anywhere => {}
            }
        }
        inject.creds.push(i);
    }
    Ok(inject)
}

/// The payload hashes (`x-amz-content-sha256`) the proxy signs with as
/// the tool wrote them, besides a hex SHA-256: the body is not read.
pub const PASSED_PAYLOADS: [&str; 2] = ["UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"];
/// A streaming upload whose chunks are signed: the proxy signs them again.
pub const SIGNED_CHUNKS: &str = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD";

/// The signing step of a credential with `sign = { aws_sigv4 }` (the
/// request goes to one of its hosts): the tool may have signed it only
/// with the run's placeholder as its key id, in the `Authorization`
/// header, or not at all; anything else is refused before the proxy signs.
///
/// - an `Authorization` of another key id, or of another scheme, and a
///   presigned query of another key id, are `credential_misuse`: the tool
///   holds no other key the proxy could vouch for;
/// - a presigned query of the placeholder, SigV4a, a malformed header, and
///   a payload hash the proxy does not sign with (a signed trailer, an
///   unknown value) are `signature_unsupported`.
fn signature(
    tool: &ToolPolicy,
    c: &Credential,
    sign: &egress_config::sign::AwsSigV4,
    placeholder: Option<&str>,
    target: &Target,
    head: &dyn Head,
) -> Result<(), Denial> {
    let unsupported = |why: &str| Denial {
        reason: DenyReason::SignatureUnsupported,
        detail: format!(
            "{target} is signed by the proxy with credential {} of tool {} (aws_sigv4, {}/{}); {why}",
            c.name, tool.id, sign.service, sign.region
        ),
    };
    let other_key = |how: &str| {
        misuse(format!(
            "{target} holds credential {} of tool {}, and the request was {how}: the tool may sign only with the placeholder key id the run gave it",
            c.name, tool.id
        ))
    };
    let mut problem = None;
    head.header("authorization", &mut |v| {
        if problem.is_some() {
            return;
        }
        let v = String::from_utf8_lossy(v);
        problem = if v.starts_with("AWS4-HMAC-SHA256") {
            match sigv4::parse_authorization(&v) {
                None => Some(unsupported("its Authorization is not a well-formed SigV4 header")),
                Some(p) if Some(p.access_key_id.as_str()) == placeholder => None,
                Some(_) => Some(other_key("signed with another key id")),
            }
        } else if v.starts_with("AWS4-ECDSA-P256-SHA256") {
            Some(unsupported(
                "it is signed with SigV4a, which the proxy does not re-sign",
            ))
        } else if v
            .strip_prefix("AWS ")
            .and_then(|r| r.split_once(':'))
            .is_some_and(|(id, _)| Some(id) == placeholder)
        {
            Some(unsupported("it is signed with SigV2, which the proxy does not re-sign"))
        } else {
            Some(other_key(
                "sent with an Authorization of its own (another scheme or key)",
            ))
        };
    });
    if let Some(d) = problem {
        return Err(d);
    }
    if let Some(q) = head.query().filter(|q| sigv4::is_presigned(q)) {
        return Err(match sigv4::presigned_key_id(q) {
            Some(id) if Some(id.as_str()) == placeholder => unsupported(
                "a presigned URL (a signature in the query) is not re-signed: sign in the Authorization header",
            ),
            _ => other_key("presigned with another key id"),
        });
    }
    let mut hashes = 0;
    head.header("x-amz-content-sha256", &mut |v| {
        hashes += 1;
        let ok = (v.len() == 64 && v.iter().all(u8::is_ascii_hexdigit))
            || PASSED_PAYLOADS.iter().any(|p| p.as_bytes() == v)
            || v == SIGNED_CHUNKS.as_bytes();
        if !ok && problem.is_none() {
            problem = Some(unsupported(&format!(
                "its payload hash {:?} is not one the proxy signs with (a hex SHA-256, UNSIGNED-PAYLOAD, \
                 STREAMING-UNSIGNED-PAYLOAD-TRAILER or {SIGNED_CHUNKS})",
                String::from_utf8_lossy(&v[..v.len().min(64)])
            )));
        }
    });
    if hashes > 1 {
        return Err(unsupported("it has more than one x-amz-content-sha256"));
    }
    problem.map_or(Ok(()), Err)
}

/// Of the vetted addresses, those a plain-HTTP request carrying a
/// credential may go to when only loopback is allowed
/// ([`Inject::loopback_only`]); or the denial when none is.
pub fn loopback_dial(target: &Target, dial: Vec<IpAddr>) -> Result<Vec<IpAddr>, Denial> {
    let local: Vec<IpAddr> = dial.into_iter().filter(|ip| ip.to_canonical().is_loopback()).collect();
    if local.is_empty() {
        return Err(Denial {
            reason: DenyReason::CredentialRequiresTls,
            detail: format!(
                "{target} does not resolve to a loopback address, and its credential goes in plain HTTP only to loopback (allow_plaintext = true)"
            ),
        });
    }
    Ok(local)
}

fn misuse(detail: String) -> Denial {
    Denial {
        reason: DenyReason::CredentialMisuse,
        detail,
    }
}

fn hosts(c: &Credential) -> String {
    let hosts: Vec<String> = c.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
    hosts.join(", ")
}

/// Whether `needle` occurs in `hay`.
pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.len() >= needle.len() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether a CONNECT of `tool` to `target` is intercepted (TLS terminated
/// with a leaf of the appliance CA, HTTP policy applied inside) rather than
/// a blind tunnel: the tool inspects everything, or one of its credentials
/// may go there.
pub fn intercepts(tool: &ToolPolicy, target: &Target) -> bool {
    tool.inspect
        || tool.credentials.iter().any(|c| c.allows(&target.host, target.port))
        || matches!(
            tool.allowlist.requests(&target.host, target.port),
            RequestRules::Only(_)
        )
}

/// The method and path rules of the entries matching an HTTP request's
/// host (`methods`/`paths` of an allowlist entry), decided on its normal
/// path ([`egress_config::requests::normalise`]). `Ok(Some(pq))`: allowed,
/// and `pq` (the normal path and the query as sent) is what goes to the
/// origin, so it receives the path that was matched. `Ok(None)`: no rule
/// restricts this host, the request goes as it came. A tunnel is not
/// decided here: one to a restricted host is intercepted ([`intercepts`])
/// and its requests are.
pub fn request_rules(tool: &ToolPolicy, target: &Target, method: &str) -> Result<Option<PathAndQuery>, Denial> {
    if target.kind != Kind::Http {
        return Ok(None);
    }
    let RequestRules::Only(rules) = tool.allowlist.requests(&target.host, target.port) else {
        return Ok(None);
    };
    let pq = target.path_and_query.as_ref().map_or("/", |pq| pq.as_str());
    let (path, query) = match pq.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (pq, None),
    };
    let shown = Bounded(path);
    let normal = requests::normalise(path).map_err(|e| Denial {
        reason: DenyReason::BadTarget,
        detail: format!("path {shown} of {target} has no normal form: {e}"),
    })?;
    let denial = |reason, what: &str| Denial {
        reason,
        detail: format!("{what} {target}{} for tool {}", Bounded(&normal), tool.id),
    };
    match requests::verdict(rules, method, &normal) {
        Verdict::Allowed => {}
        Verdict::MethodNotAllowed => {
            return Err(denial(
                DenyReason::MethodNotAllowed,
                &format!("no rule allows method {} on", Bounded(method)),
            ))
        }
        Verdict::PathNotAllowed => return Err(denial(DenyReason::PathNotAllowed, "no rule allows the path")),
    }
    let sent = match query {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    PathAndQuery::try_from(sent).map(Some).map_err(|e| Denial {
        reason: DenyReason::BadTarget,
        detail: format!("path of {target}: {e}"),
    })
}

/// At most 256 bytes of a tool's text in a denial's detail.
struct Bounded<'a>(&'a str);

impl std::fmt::Display for Bounded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MAX: usize = 256;
        if self.0.len() <= MAX {
            return f.write_str(self.0);
        }
        let mut end = MAX;
        while !self.0.is_char_boundary(end) {
            end -= 1;
        }
        write!(f, "{}…", &self.0[..end])
    }
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
    tool_methods(tool, target, method, private)
}

/// The tool's own `methods`, for a target its allowlist (or a grant of the
/// run) admits.
pub fn tool_methods(tool: &ToolPolicy, target: &Target, method: &str, private: bool) -> Admission {
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

/// Whether a transparent connection to `target` is relayed raw at once,
/// without a byte looked at: an entry matching it says `protocol = "tcp"`.
/// Otherwise its first bytes are waited for, and only TLS (its server name
/// checked) or HTTP/1.x (each request's `Host` checked) goes on.
pub fn relays_raw(tool: &ToolPolicy, target: &Target) -> bool {
    tool.allowlist.relays_raw(&target.host, target.port)
}

/// A transparent connection to `target` whose first bytes are no TLS or
/// HTTP/1.x the proxy can check (`what` says what it did instead), where no
/// entry relays raw: `protocol_unknown`. Report mode records it and lets
/// it through as a raw relay.
pub fn unknown_protocol(tool: &ToolPolicy, target: &Target, what: &dyn std::fmt::Display) -> Admission {
    let denial = Denial {
        reason: DenyReason::ProtocolUnknown,
        detail: format!(
            "the connection to {target} {what}: tool {} carries only TLS or HTTP/1.x there \
             (an entry with protocol = \"tcp\" relays another protocol raw)",
            tool.id
        ),
    };
    gate(tool, denial, false)
}

/// Step 4 for a name the sandbox's DNS is asked (transparent egress): a
/// name some rule of the tool lists, on any port, is answered (the port is
/// decided when the child connects); any other is `not_allowlisted`, and no
/// real DNS query is made; an address asked as a name is an `ip_literal`.
pub fn lookup(tool: &ToolPolicy, host: &Host, qtype: &str) -> Admission {
    let denial = match host {
        Host::Name(n) if tool.allowlist.lists_name(n) => return Admission::Allow { private: false },
        Host::Name(n) => Denial {
            reason: DenyReason::NotAllowlisted,
            detail: format!("DNS query ({qtype}) for {n}: no rule of tool {} lists it", tool.id),
        },
        Host::Ip(ip) => Denial {
            reason: DenyReason::IpLiteral,
            detail: format!("DNS query ({qtype}) for the address {ip}: not a name"),
        },
    };
    gate(tool, denial, false)
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

/// The protocol a request asks to switch to (RFC 9110 §7.8), as an
/// entrance parsed it from the head ([`upgrade_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upgrade {
    /// No `Upgrade` header: an ordinary request.
    None,
    /// A WebSocket opening handshake (RFC 6455 §4.1): `GET`, `Upgrade:
    /// websocket`, `Connection: upgrade`, `Sec-WebSocket-Key` and
    /// `Sec-WebSocket-Version`.
    WebSocket,
    /// Anything else that names an upgrade (`h2c`, a custom protocol, a
    /// WebSocket handshake missing a part), as written (bounded).
    Other(String),
}

/// Whether a comma-separated header holds `token` (case-insensitive).
fn has_token(h: &http::HeaderMap, name: http::header::HeaderName, token: &str) -> bool {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Parses the upgrade a request asks for from its method and head. Only
/// a request whose `Connection` names `upgrade` asks for one (RFC 9110
/// §7.8); an `Upgrade` header without it is a stray hop-by-hop header,
/// stripped like the others.
pub fn upgrade_of(method: &str, h: &http::HeaderMap) -> Upgrade {
    use http::header;
    let asked: Vec<&[u8]> = h.get_all(header::UPGRADE).iter().map(|v| v.as_bytes()).collect();
    if asked.is_empty() || !has_token(h, header::CONNECTION, "upgrade") {
        return Upgrade::None;
    }
    let websocket = asked.len() == 1 && asked[0].trim_ascii().eq_ignore_ascii_case(b"websocket");
    if websocket
        && method == "GET"
        && h.contains_key(header::SEC_WEBSOCKET_KEY)
        && h.contains_key(header::SEC_WEBSOCKET_VERSION)
    {
        return Upgrade::WebSocket;
    }
    let shown: Vec<String> = asked.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect();
    let mut shown = Bounded(&shown.join(", ")).to_string();
    if websocket {
        shown.push_str(
            " (an incomplete handshake: GET with Connection: upgrade, Sec-WebSocket-Key and Sec-WebSocket-Version)",
        );
    }
    Upgrade::Other(shown)
}

/// The upgrade step, for every entrance that carries HTTP: a WebSocket
/// handshake is decided like any request (the other steps) and carried;
/// any other upgrade is `upgrade_not_allowed` (never waived by report
/// mode: the proxy cannot carry it). Returns whether the request is a
/// WebSocket handshake.
pub fn upgrade(tool: &ToolPolicy, target: &Target, asked: &Upgrade) -> Result<bool, Denial> {
    match asked {
        Upgrade::None => Ok(false),
        Upgrade::WebSocket => Ok(true),
        Upgrade::Other(p) => Err(Denial {
            reason: DenyReason::UpgradeNotAllowed,
            detail: format!(
                "upgrade to {p} on {target} for tool {}: only WebSocket is carried",
                tool.id
            ),
        }),
    }
}

/// The credential checks of one WebSocket message from the tool, after
/// the handshake, to a host of `rewriting` (credentials with
/// `rewrite_websocket`): first [`credentials`] on the payload, as on a
/// request head (another host's placeholder, another credential's real
/// value); then a binary message (or a control frame) that carries a
/// placeholder of the run or the real value of the tool's credentials is
/// `credential_misuse` too: only text messages are rewritten.
pub fn websocket_message(
    tool: &ToolPolicy,
    secrets: &SecretScan,
    placeholders: &[Placeholder],
    target: &Target,
    text: bool,
    payload: &[u8],
) -> Result<(), Denial> {
    struct Payload<'a>(&'a [u8]);
    impl Head for Payload<'_> {
        fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
            f(self.0)
        }
    }
    credentials(
        tool,
        secrets,
        placeholders,
        target,
        Channel::VerifiedTls,
        &Payload(payload),
    )?;
    if text {
        return Ok(());
    }
    let placeholder = placeholders.iter().find(|p| contains(payload, p.value.as_bytes()));
    let secret = tool.secrets.find(payload).is_some();
    if placeholder.is_none() && !secret {
        return Ok(());
    }
    let what = match placeholder {
        Some(p) => format!("the placeholder of credential {}", p.credential),
        None => "the real value of a credential".to_owned(),
    };
    Err(misuse(format!(
        "a binary WebSocket message to {target} carries {what}; only text messages are rewritten (rewrite_websocket)"
    )))
}
