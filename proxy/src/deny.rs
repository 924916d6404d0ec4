//! The one table that maps an outcome to what the client, the fact store and
//! the metrics see: deny reason codes (stable words shared by the
//! `X-Egress-Deny-Reason` header, facts and metric labels) with their HTTP
//! status, non-policy fetch errors with their `X-Egress-Error` code, the two
//! kinds of fetch and the phases a fetch deadline can expire in.

use http::StatusCode;

/// What a fetch is: a plain-HTTP request or a CONNECT tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Connect,
    Http,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Connect => "connect",
            Kind::Http => "http",
        }
    }
}

/// How a fetch is labelled in facts (`target.kind`), metrics (`kind`) and
/// logs: its kind, unless it came in transparently — a connection from a
/// sandbox that named no proxy (whatever it carried), or a query to the
/// sandbox's DNS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Connect,
    Http,
    Transparent,
    Dns,
}

impl Via {
    pub const ALL: [Via; 4] = [Via::Connect, Via::Http, Via::Transparent, Via::Dns];

    pub fn as_str(self) -> &'static str {
        match self {
            Via::Connect => "connect",
            Via::Http => "http",
            Via::Transparent => "transparent",
            Via::Dns => "dns",
        }
    }
}

impl From<Kind> for Via {
    fn from(k: Kind) -> Via {
        match k {
            Kind::Connect => Via::Connect,
            Kind::Http => Via::Http,
        }
    }
}

/// Where a fetch was when its deadline expired (the `phase` label of
/// `egress_fetch_timeouts_total` and of the log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for a concurrency slot.
    Slot,
    /// Resolving and vetting.
    Dns,
    /// Dialling the vetted addresses.
    Connect,
    /// Waiting for (or reading) the origin's response.
    Response,
    /// Inside an open CONNECT tunnel.
    Tunnel,
    /// Still sending the request body after the response was read.
    Upload,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Phase::Slot,
        Phase::Dns,
        Phase::Connect,
        Phase::Response,
        Phase::Tunnel,
        Phase::Upload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Slot => "slot",
            Phase::Dns => "dns",
            Phase::Connect => "connect",
            Phase::Response => "response",
            Phase::Tunnel => "tunnel",
            Phase::Upload => "upload",
        }
    }
}

/// A policy denial. The string codes are a stable interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenyReason {
    AuthMissing,
    AuthInvalid,
    RunNotActive,
    RunEnded,
    BadTarget,
    HostMismatch,
    IpLiteral,
    NotAllowlisted,
    PrivateAddress,
    SelfLoop,
    ConcurrencyLimit,
    MethodNotAllowed,
    /// A request whose path no method-and-path rule of its host allows.
    PathNotAllowed,
    /// A run's credential placeholder, or the real value of any
    /// credential, on a request to a host that is not one of the
    /// credential's hosts.
    CredentialMisuse,
    /// A plain-HTTP request to a credential's host: the credential goes
    /// only over TLS the proxy verified (unless `allow_plaintext`).
    CredentialRequiresTls,
    /// A request that needs a credential whose live source has no usable
    /// value: never read yet, or past its expiry (a token that could not
    /// be refreshed, a file or command failing past `stale_ms`). `503`:
    /// the request never left, and a later one may succeed.
    CredentialUnavailable,
    /// A request to a signing credential's host (`sign = { aws_sigv4 }`)
    /// in a form the proxy does not re-sign: a presigned query string,
    /// SigV4a, a signed-trailer upload, an unknown payload hash, a body
    /// too large to hash, a malformed `Authorization` or chunk. `400`.
    SignatureUnsupported,
    /// The run made `max_requests_per_run` fetches or moved
    /// `max_bytes_per_run` bytes already.
    BudgetExhausted,
    /// Faster than the tool's `max_request_rate` (beyond its burst).
    RateLimited,
    /// A request asking to switch to a protocol the proxy does not carry
    /// (`Upgrade` other than a WebSocket handshake: `h2c`, custom ones).
    UpgradeNotAllowed,
    /// A valid credential of a run bound to the listener handed over for it
    /// (its sandbox), presented anywhere else: the proxy's own listeners,
    /// another run's listener or transparent socket.
    CredentialElsewhere,
    /// A transparent connection whose first bytes are not a complete TLS
    /// ClientHello or HTTP/1.x request head within the head read timeout
    /// and byte bound (nothing at all, another protocol, HTTP/2 with prior
    /// knowledge), to an entry that does not say `protocol = "tcp"`.
    ProtocolUnknown,
    /// A credential host's answer the proxy cannot scrub of the secret (a
    /// coding it cannot read, a framing that disagrees with itself, a body
    /// where none may be): not passed on, `502`.
    Unscrubbable,
    /// An MCP `tools/call` whose tool no `[tools.<id>.mcp]` rule allows (no
    /// `tools` entry names it, a `deny_tools` entry without args does, or
    /// the call names no tool).
    McpToolNotAllowed,
    /// An MCP `tools/call` (or `prompts/get`) whose name is allowed but
    /// whose arguments no entry for it matches, or a deny entry with args
    /// matches.
    McpArgumentsNotAllowed,
    /// An MCP `resources/read` or `resources/subscribe` of a URI the rules
    /// do not allow.
    McpResourceNotAllowed,
    /// An MCP `prompts/get` of a prompt the rules do not allow.
    McpPromptNotAllowed,
}

impl DenyReason {
    pub const ALL: [DenyReason; 27] = [
        DenyReason::AuthMissing,
        DenyReason::AuthInvalid,
        DenyReason::RunNotActive,
        DenyReason::RunEnded,
        DenyReason::BadTarget,
        DenyReason::HostMismatch,
        DenyReason::IpLiteral,
        DenyReason::NotAllowlisted,
        DenyReason::PrivateAddress,
        DenyReason::SelfLoop,
        DenyReason::ConcurrencyLimit,
        DenyReason::MethodNotAllowed,
        DenyReason::PathNotAllowed,
        DenyReason::CredentialMisuse,
        DenyReason::CredentialRequiresTls,
        DenyReason::CredentialUnavailable,
        DenyReason::SignatureUnsupported,
        DenyReason::BudgetExhausted,
        DenyReason::RateLimited,
        DenyReason::UpgradeNotAllowed,
        DenyReason::CredentialElsewhere,
        DenyReason::ProtocolUnknown,
        DenyReason::Unscrubbable,
        DenyReason::McpToolNotAllowed,
        DenyReason::McpArgumentsNotAllowed,
        DenyReason::McpResourceNotAllowed,
        DenyReason::McpPromptNotAllowed,
    ];

    /// The refusals of the authentication step (`407`).
    pub const AUTHENTICATION: [DenyReason; 3] = [
        DenyReason::AuthMissing,
        DenyReason::AuthInvalid,
        DenyReason::CredentialElsewhere,
    ];

    pub fn code(self) -> &'static str {
        match self {
            DenyReason::AuthMissing => "auth_missing",
            DenyReason::AuthInvalid => "auth_invalid",
            DenyReason::RunNotActive => "run_not_active",
            DenyReason::RunEnded => "run_ended",
            DenyReason::BadTarget => "bad_target",
            DenyReason::HostMismatch => "host_mismatch",
            DenyReason::IpLiteral => "ip_literal",
            DenyReason::NotAllowlisted => "not_allowlisted",
            DenyReason::PrivateAddress => "private_address",
            DenyReason::SelfLoop => "self_loop",
            DenyReason::ConcurrencyLimit => "concurrency_limit",
            DenyReason::MethodNotAllowed => "method_not_allowed",
            DenyReason::PathNotAllowed => "path_not_allowed",
            DenyReason::CredentialMisuse => "credential_misuse",
            DenyReason::CredentialRequiresTls => "credential_requires_tls",
            DenyReason::CredentialUnavailable => "credential_unavailable",
            DenyReason::SignatureUnsupported => "signature_unsupported",
            DenyReason::BudgetExhausted => "budget_exhausted",
            DenyReason::RateLimited => "rate_limited",
            DenyReason::UpgradeNotAllowed => "upgrade_not_allowed",
            DenyReason::CredentialElsewhere => "credential_elsewhere",
            DenyReason::ProtocolUnknown => "protocol_unknown",
            DenyReason::Unscrubbable => "unscrubbable",
            DenyReason::McpToolNotAllowed => "mcp_tool_not_allowed",
            DenyReason::McpArgumentsNotAllowed => "mcp_arguments_not_allowed",
            DenyReason::McpResourceNotAllowed => "mcp_resource_not_allowed",
            DenyReason::McpPromptNotAllowed => "mcp_prompt_not_allowed",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            DenyReason::AuthMissing | DenyReason::AuthInvalid | DenyReason::CredentialElsewhere => {
                StatusCode::PROXY_AUTHENTICATION_REQUIRED
            }
            DenyReason::BadTarget | DenyReason::HostMismatch | DenyReason::SignatureUnsupported => {
                StatusCode::BAD_REQUEST
            }
            DenyReason::BudgetExhausted | DenyReason::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            // The origin's answer is what is refused, not the request.
            DenyReason::Unscrubbable => StatusCode::BAD_GATEWAY,
            // The proxy's own source failed, not the request.
            DenyReason::CredentialUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::FORBIDDEN,
        }
    }

    /// The decision step that makes this denial (`rule` in the
    /// `X-Egress-Denial` answer).
    pub fn rule(self) -> &'static str {
        match self {
            DenyReason::AuthMissing | DenyReason::AuthInvalid | DenyReason::CredentialElsewhere => "authentication",
            DenyReason::RunNotActive | DenyReason::RunEnded => "run_state",
            DenyReason::BadTarget | DenyReason::HostMismatch => "target",
            DenyReason::IpLiteral => "ip_literals",
            DenyReason::NotAllowlisted => "allowlist",
            DenyReason::PrivateAddress => "address_ranges",
            DenyReason::SelfLoop => "self_loop",
            DenyReason::ConcurrencyLimit => "slots",
            DenyReason::MethodNotAllowed => "methods",
            DenyReason::PathNotAllowed => "paths",
            DenyReason::CredentialMisuse
            | DenyReason::CredentialRequiresTls
            | DenyReason::CredentialUnavailable
            | DenyReason::SignatureUnsupported
            | DenyReason::Unscrubbable => "credentials",
            DenyReason::BudgetExhausted | DenyReason::RateLimited => "budgets",
            DenyReason::UpgradeNotAllowed => "upgrades",
            DenyReason::ProtocolUnknown => "protocols",
            DenyReason::McpToolNotAllowed
            | DenyReason::McpArgumentsNotAllowed
            | DenyReason::McpResourceNotAllowed
            | DenyReason::McpPromptNotAllowed => "mcp",
        }
    }

    /// What a program or an agent should do about this denial (`hint` in
    /// the `X-Egress-Denial` answer): fixed text, never the request's.
    pub fn hint(self) -> &'static str {
        match self {
            DenyReason::AuthMissing => {
                "the request carried no run credential; use the proxy URL given to this run; do not retry without it"
            }
            DenyReason::AuthInvalid => {
                "the credential belongs to no live run (it may have ended); do not retry with another credential"
            }
            DenyReason::RunNotActive => {
                "the run is not active yet: network access starts with the invocation, not while the tool loads"
            }
            DenyReason::RunEnded => "the run has ended; no further network access is possible for it",
            DenyReason::BadTarget => "the request target is malformed or cannot be normalised; fix the URL",
            DenyReason::HostMismatch => {
                "the Host header or TLS server name differs from the target; send each request to the host it names"
            }
            DenyReason::IpLiteral => {
                "IP addresses are not allowed as destinations; use the host name the policy lists; do not retry through another route"
            }
            DenyReason::NotAllowlisted => {
                "this destination is not allowed for this tool; ask the operator to allow it; do not retry through another route"
            }
            DenyReason::PrivateAddress => {
                "the name resolves to a private or reserved address, which is not allowed; do not retry through another route"
            }
            DenyReason::SelfLoop => "the proxy does not connect to itself or to the appliance's own services",
            DenyReason::ConcurrencyLimit => {
                "too many fetches of this run are in flight; wait for one to finish, then retry"
            }
            DenyReason::MethodNotAllowed => {
                "this method is not allowed on this host for this tool; use an allowed method or ask the operator"
            }
            DenyReason::PathNotAllowed => {
                "this path is not allowed on this host for this tool; ask the operator to allow it; do not retry through another route"
            }
            DenyReason::CredentialMisuse => {
                "a credential may be sent only to its own hosts; do not send it anywhere else"
            }
            DenyReason::CredentialRequiresTls => {
                "this host's credential is sent only over HTTPS; use https:// for this host"
            }
            DenyReason::CredentialUnavailable => {
                "the proxy has no valid credential for this host right now (its source failed); retry later; tell the operator if it lasts"
            }
            DenyReason::SignatureUnsupported => {
                "the proxy signs this host's requests: sign in the Authorization header with the placeholder keys, or not at all; no presigned URL"
            }
            DenyReason::BudgetExhausted => {
                "this run has used its budget of requests or bytes; finish with what you have; do not retry in this run"
            }
            DenyReason::RateLimited => "too many requests too fast for this run; wait a moment, then retry more slowly",
            DenyReason::UpgradeNotAllowed => {
                "only WebSocket upgrades are carried; send the request without an Upgrade header"
            }
            DenyReason::CredentialElsewhere => {
                "this credential works only inside its own sandbox, on the listener handed over for its run; do not retry"
            }
            DenyReason::ProtocolUnknown => {
                "only TLS or HTTP/1.x is carried here, sent at once; another protocol needs an entry with protocol = \"tcp\""
            }
            DenyReason::Unscrubbable => {
                "the credential host answered in a form the proxy cannot scrub (compressed or mis-framed); nothing of it was passed on"
            }
            DenyReason::McpToolNotAllowed => {
                "this MCP tool is not allowed for this tool; use a listed one or ask the operator; do not retry"
            }
            DenyReason::McpArgumentsNotAllowed => {
                "these arguments are not allowed for this MCP tool or prompt; change them or ask the operator"
            }
            DenyReason::McpResourceNotAllowed => {
                "this MCP resource is not allowed for this tool; read a listed one or ask the operator; do not retry"
            }
            DenyReason::McpPromptNotAllowed => {
                "this MCP prompt is not allowed for this tool; use a listed one or ask the operator; do not retry"
            }
        }
    }

    /// Denials that `mode = "report"` lets through (recording them).
    /// Authentication, run state, malformed targets and self-loops are never waived.
    pub fn reportable(self) -> bool {
        matches!(
            self,
            DenyReason::IpLiteral
                | DenyReason::NotAllowlisted
                | DenyReason::PrivateAddress
                | DenyReason::MethodNotAllowed
                | DenyReason::PathNotAllowed
                | DenyReason::ProtocolUnknown
                | DenyReason::McpToolNotAllowed
                | DenyReason::McpArgumentsNotAllowed
                | DenyReason::McpResourceNotAllowed
                | DenyReason::McpPromptNotAllowed
        )
    }
}

/// A fetch that failed for a reason that is not policy: answered with
/// `502`/`504`/`503` and `X-Egress-Error`, counted, not recorded as a fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchError {
    /// The name does not exist or has no address records.
    DnsNotFound,
    /// The resolver failed (server failure, refused, unreachable).
    DnsFailed,
    /// Every vetted address refused or failed the connection.
    ConnectFailed,
    /// The fetch deadline expired.
    Timeout,
    /// The upstream broke the HTTP exchange.
    UpstreamFailed,
    /// The origin of an intercepted CONNECT failed TLS: its certificate did
    /// not verify for the host, or the handshake broke.
    UpstreamTls,
    /// The run ended while the fetch was in flight.
    RunEnded,
    /// The fact store could not record a denial, so the request fails closed.
    FactsUnavailable,
    /// The proxy is shutting down.
    ShuttingDown,
    /// Every established connection place of the data listener is taken.
    ConnectionLimit,
    /// The run already holds `max_connections_per_run` connections.
    RunConnectionLimit,
}

impl FetchError {
    /// The errors `egress_fetch_errors_total` counts; the others have metrics
    /// of their own (`egress_fact_write_failures_total`,
    /// `egress_connections_closed_total`) or are a shutdown.
    pub const COUNTED: [FetchError; 7] = [
        FetchError::DnsNotFound,
        FetchError::DnsFailed,
        FetchError::ConnectFailed,
        FetchError::Timeout,
        FetchError::UpstreamFailed,
        FetchError::UpstreamTls,
        FetchError::RunEnded,
    ];

    pub fn code(self) -> &'static str {
        match self {
            FetchError::DnsNotFound => "dns_not_found",
            FetchError::DnsFailed => "dns_failed",
            FetchError::ConnectFailed => "connect_failed",
            FetchError::Timeout => "timeout",
            FetchError::UpstreamFailed => "upstream_failed",
            FetchError::UpstreamTls => "upstream_tls",
            FetchError::RunEnded => "run_ended",
            FetchError::FactsUnavailable => "facts_unavailable",
            FetchError::ShuttingDown => "shutting_down",
            FetchError::ConnectionLimit => "connection_limit",
            FetchError::RunConnectionLimit => "run_connection_limit",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            FetchError::Timeout => StatusCode::GATEWAY_TIMEOUT,
            FetchError::FactsUnavailable
            | FetchError::ShuttingDown
            | FetchError::RunEnded
            | FetchError::ConnectionLimit => StatusCode::SERVICE_UNAVAILABLE,
            FetchError::RunConnectionLimit => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::BAD_GATEWAY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for r in DenyReason::ALL {
            assert!(seen.insert(r.code()));
            assert!(r.code().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
            let server = matches!(r, DenyReason::Unscrubbable | DenyReason::CredentialUnavailable);
            assert!(r.status().is_client_error() != server, "{r:?}");
            assert!(r.rule().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
            assert!(r.hint().is_ascii() && r.hint().len() < 160, "{}", r.hint());
        }
    }
}
