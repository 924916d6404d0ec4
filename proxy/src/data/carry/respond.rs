//! The answers the data plane writes itself: denials (with
//! `X-Egress-Deny-Reason`, the fact's id, the `X-Egress-Denial` JSON for
//! programs and agents and, for authentication, the challenge; a JSON body
//! when the request accepts it, short plain text otherwise) and non-policy
//! errors (with `X-Egress-Error`); and the bounded renderings of targets a
//! fact quotes.

use crate::data::carry::body::ProxyBody;
use crate::data::decide::auth::CHALLENGE;
use crate::data::decide::refusal::Refusal;
use crate::deny::{DenyReason, FetchError};
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

pub const DENY_HEADER: &str = "x-egress-deny-reason";
pub const ERROR_HEADER: &str = "x-egress-error";
/// The compact JSON form of a denial (`egress_api::Denial`).
pub const DENIAL_HEADER: &str = "x-egress-denial";
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

/// What a denial answer says besides its reason.
pub struct Denied<'a> {
    pub reason: DenyReason,
    /// The human-readable explanation (bounded by the caller).
    pub detail: &'a str,
    /// The `id` of the fact that records it.
    pub fact_id: &'a str,
    /// The target as understood, or the raw one (bounded); `None` withheld.
    pub target: Option<&'a str>,
    /// The run's tool (`None` for authentication failures).
    pub tool: Option<&'a str>,
    /// Whether the request accepts `application/json` ([`accepts_json`](crate::data::decide::refusal::accepts_json)).
    pub json: bool,
}

/// The most characters of a target the `X-Egress-Denial` header quotes.
const HEADER_TARGET_CHARS: usize = 128;

/// A denial: the reason's status and code, the fact that records it, and
/// the same as JSON in `X-Egress-Denial` (and as the body, if asked for).
pub fn denied(d: Denied<'_>) -> Response<ProxyBody> {
    let reason = d.reason;
    let mut denial = egress_api::Denial {
        reason: reason.code().to_owned(),
        target: d.target.map(|t| t.chars().take(HEADER_TARGET_CHARS).collect()),
        tool: d.tool.map(str::to_owned),
        fact_id: d.fact_id.to_owned(),
        rule: reason.rule().to_owned(),
        hint: reason.hint().to_owned(),
        status: None,
        detail: None,
    };
    let header = denial_header(&denial);
    let mut r = if d.json {
        denial.target = d.target.map(str::to_owned);
        denial.status = Some(reason.status().as_u16());
        denial.detail = Some(d.detail.to_owned());
        let mut r = Response::new(ProxyBody::text(serde_json::to_vec(&denial).unwrap_or_default()));
        *r.status_mut() = reason.status();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        r
    } else {
        text(
            reason.status(),
            format!("egress denied ({}): {}\n", reason.code(), d.detail),
        )
    };
    let h = r.headers_mut();
    h.insert(DENY_HEADER, HeaderValue::from_static(reason.code()));
    if let Ok(v) = HeaderValue::from_str(d.fact_id) {
        h.insert(FACT_HEADER, v);
    }
    if let Some(v) = header {
        h.insert(DENIAL_HEADER, v);
    }
    if reason.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        h.insert(header::PROXY_AUTHENTICATE, HeaderValue::from_static(CHALLENGE));
    }
    r
}

/// The `X-Egress-Denial` value: the compact JSON in visible ASCII (every
/// other character as a `\u` escape, which JSON reads back as it was), at
/// most `egress_api::DENIAL_HEADER_MAX` bytes (the target is dropped if it
/// would not fit, which the bound on it makes impossible in practice).
fn denial_header(d: &egress_api::Denial) -> Option<HeaderValue> {
    let ascii = |d: &egress_api::Denial| -> String {
        let json = serde_json::to_string(d).unwrap_or_default();
        let mut out = String::with_capacity(json.len());
        for c in json.chars() {
            if (' '..='~').contains(&c) {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        out
    };
    let mut v = ascii(d);
    if v.len() > egress_api::DENIAL_HEADER_MAX {
        let mut d = d.clone();
        d.target = None;
        v = ascii(&d);
    }
    HeaderValue::from_str(&v).ok()
}

/// A refusal of the decider as HTTP: a denial with its fact, or an error.
pub fn refused(r: Refusal) -> Response<ProxyBody> {
    match r {
        Refusal::Denied(d) => denied(Denied {
            reason: d.reason,
            detail: &d.detail,
            fact_id: &d.fact_id,
            target: d.target.as_deref(),
            tool: d.tool.as_deref(),
            json: d.json,
        }),
        Refusal::Failed { error, detail } => self::error(error, &detail),
    }
}

impl From<Refusal> for Response<ProxyBody> {
    fn from(r: Refusal) -> Self {
        refused(r)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deny::DenyReason;

    fn header_of(r: &Response<ProxyBody>) -> &str {
        r.headers()[DENIAL_HEADER].to_str().unwrap()
    }

    #[test]
    fn every_reason_answers_with_its_rule_and_hint_in_json() {
        for reason in DenyReason::ALL {
            for json in [false, true] {
                let r = denied(Denied {
                    reason,
                    detail: "why",
                    fact_id: "f-1",
                    target: Some("h.test:443"),
                    tool: Some("t"),
                    json,
                });
                let d: egress_api::Denial = serde_json::from_str(header_of(&r)).unwrap();
                assert_eq!(d.reason, reason.code());
                assert_eq!(d.rule, reason.rule());
                assert_eq!(d.hint, reason.hint());
                assert_eq!(
                    (d.fact_id.as_str(), d.target.as_deref(), d.tool.as_deref()),
                    ("f-1", Some("h.test:443"), Some("t"))
                );
                let ctype = r.headers()[header::CONTENT_TYPE].to_str().unwrap();
                assert_eq!(ctype == "application/json", json);
            }
        }
    }

    #[test]
    fn the_header_is_visible_ascii_bounded_and_reads_back() {
        let target: String = "\u{e9}\"\\\u{7f}\u{1F600}\t".repeat(400);
        let r = denied(Denied {
            reason: DenyReason::BadTarget,
            detail: "d",
            fact_id: "f",
            target: Some(&target),
            tool: Some("t\u{e9}"),
            json: true,
        });
        let h = header_of(&r);
        assert!(h.bytes().all(|b| (b' '..=b'~').contains(&b)), "{h}");
        assert!(h.len() <= egress_api::DENIAL_HEADER_MAX, "{}", h.len());
        let d: egress_api::Denial = serde_json::from_str(h).unwrap();
        let want: String = target.chars().take(HEADER_TARGET_CHARS).collect();
        assert_eq!(d.target, Some(want));
        assert_eq!(d.tool.as_deref(), Some("t\u{e9}"));
    }
}
