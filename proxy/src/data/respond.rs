//! The answers the data plane writes itself: denials (with
//! `X-Egress-Deny-Reason`, the fact's id and, for authentication, the
//! challenge) and non-policy errors (with `X-Egress-Error`), as short
//! plain-text bodies; and the bounded renderings of targets a fact quotes.

use crate::data::auth::CHALLENGE;
use crate::data::body::ProxyBody;
use crate::data::target::Target;
use crate::deny::{DenyReason, FetchError};
use crate::facts::FactTarget;
use egress_config::Host;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

pub const DENY_HEADER: &str = "x-egress-deny-reason";
pub const ERROR_HEADER: &str = "x-egress-error";
/// The `id` of the fact that records a denial (never the global `seq`,
/// which would let a tool watch other runs' denials).
pub const FACT_HEADER: &str = "x-egress-fact-id";

fn text(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::text(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// A denial: the reason's status and code, and the fact that records it.
pub fn denied(reason: DenyReason, detail: &str, fact_id: &str) -> Response<ProxyBody> {
    let mut r = text(
        reason.status(),
        format!("egress denied ({}): {detail}\n", reason.code()),
    );
    let h = r.headers_mut();
    h.insert(DENY_HEADER, HeaderValue::from_static(reason.code()));
    if let Ok(v) = HeaderValue::from_str(fact_id) {
        h.insert(FACT_HEADER, v);
    }
    if reason.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        h.insert(header::PROXY_AUTHENTICATE, HeaderValue::from_static(CHALLENGE));
    }
    r
}

/// A non-policy error: the error's status and code.
pub fn error(e: FetchError, detail: &str) -> Response<ProxyBody> {
    let mut r = text(e.status(), format!("egress error ({}): {detail}\n", e.code()));
    r.headers_mut().insert(ERROR_HEADER, HeaderValue::from_static(e.code()));
    r
}

/// `r` with `Connection: close`: the client connection ends after it.
pub fn closing(mut r: Response<ProxyBody>) -> Response<ProxyBody> {
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Where a fact points, from a canonical target.
pub fn fact_target(t: &Target) -> FactTarget {
    let host = match &t.host {
        Host::Name(n) => n.clone(),
        Host::Ip(ip) => ip.to_string(),
    };
    FactTarget {
        kind: t.kind.as_str().to_owned(),
        host,
        port: t.port,
    }
}

/// A short, printable, bounded rendering of an unparsed target for facts.
pub fn raw_target(uri: &http::Uri) -> String {
    let s = uri.to_string();
    let mut out: String = s.chars().filter(|c| !c.is_control()).take(256).collect();
    if s.len() > 256 {
        out.push('…');
    }
    out
}
