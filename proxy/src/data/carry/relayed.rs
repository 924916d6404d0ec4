//! What a credential host's response relays to the tool, decided on the
//! response as the proxy received it (its head before hop-by-hop headers
//! are removed, and whether the HTTP layer has ended its body), not on
//! what one header claims. The scrubber reads identity bytes only, so a
//! response whose relayed bytes could be anything else is refused
//! (`unscrubbable`), never passed on unread:
//!
//! - a coding it cannot read in either header: a transfer coding other
//!   than one `chunked` (RFC 9112 §7; hyper takes `chunked` off, and relays
//!   what is under it, or reads to the close when `chunked` is not last),
//!   or a content coding other than `identity` (RFC 9110 §8.4), members
//!   compared without case, across repeated fields;
//! - a framing that disagrees with itself: `Transfer-Encoding` and
//!   `Content-Length` together (RFC 9112 §6.1: the length is ignored and
//!   the body read chunked, whatever the length said);
//! - a body where none may be (RFC 9110 §6.4.1): `Transfer-Encoding` or a
//!   non-zero `Content-Length` on a 1xx or 204; and on a 204, 304 or an
//!   answer to `HEAD` whose body did not end with its head, any byte that
//!   follows ([`Relay::MustBeEmpty`], checked on the frames themselves).
//!
//! A body that has ended with the head relays nothing, whatever its
//! headers say; one with bytes relays them as the HTTP layer framed them.
//! Pure: table-tested below.

use http::header::{self, HeaderMap, HeaderName};
use http::{Method, StatusCode};

/// What goes to the tool after the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relay {
    /// No byte: the body ended with the head.
    Nothing,
    /// Identity bytes, which the scrubber reads.
    Body,
    /// No byte may follow (an answer to `HEAD`, a 204 or 304), but the body
    /// did not end with the head: its frames must carry none.
    MustBeEmpty,
}

/// Why a credential host's response cannot be relayed scrubbed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error(
        "the credential host answered in {header} {coding:?}, which the proxy cannot read to scrub the secret (it asked for identity)"
    )]
    Coding { header: &'static str, coding: String },
    #[error("the credential host's framing disagrees with itself: {0}")]
    Framing(&'static str),
    #[error("the credential host sent a body where none may be: {0}")]
    BodyWhereNone(String),
}

/// What the response with this status and head, to `method`, relays;
/// `ended`: its body ended with the head (the HTTP layer knows it has no
/// byte).
pub fn relayed(method: &Method, status: StatusCode, headers: &HeaderMap, ended: bool) -> Result<Relay, Unreadable> {
    let code = status.as_u16();
    if status.is_informational() || status == StatusCode::NO_CONTENT {
        if headers.contains_key(header::TRANSFER_ENCODING) {
            return Err(Unreadable::BodyWhereNone(format!("a {code} with Transfer-Encoding")));
        }
        if let Some(v) = headers
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .find(|v| v.as_bytes().trim_ascii() != b"0")
        {
            return Err(Unreadable::BodyWhereNone(format!(
                "a {code} with Content-Length {:?}",
                String::from_utf8_lossy(v.as_bytes())
            )));
        }
    }
    if *method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(if ended { Relay::Nothing } else { Relay::MustBeEmpty });
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        let mut chunked = 0;
        for m in members(headers, &header::TRANSFER_ENCODING) {
            if m.is_empty() {
                return Err(Unreadable::Framing("an empty member in Transfer-Encoding"));
            }
            if !m.eq_ignore_ascii_case(b"chunked") {
                return Err(coding("transfer-encoding", m));
            }
            chunked += 1;
        }
        if chunked != 1 {
            return Err(Unreadable::Framing("chunked more than once in Transfer-Encoding"));
        }
        if headers.contains_key(header::CONTENT_LENGTH) {
            return Err(Unreadable::Framing("both Transfer-Encoding and Content-Length"));
        }
    }
    if ended {
        return Ok(Relay::Nothing);
    }
    match members(headers, &header::CONTENT_ENCODING).find(|m| !m.is_empty() && !m.eq_ignore_ascii_case(b"identity")) {
        Some(m) => Err(coding("content-encoding", m)),
        None => Ok(Relay::Body),
    }
}

/// The members of a comma-separated list field, across its field lines,
/// without surrounding whitespace (empty members included).
fn members<'h>(headers: &'h HeaderMap, name: &HeaderName) -> impl Iterator<Item = &'h [u8]> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
}

fn coding(header: &'static str, m: &[u8]) -> Unreadable {
    Unreadable::Coding {
        header,
        coding: String::from_utf8_lossy(m).chars().take(64).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn head(fields: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in fields {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn only_identity_bytes_are_relayed() {
        let get = Method::GET;
        let ok = StatusCode::OK;
        for (fields, ended, want) in [
            (vec![], false, Ok(Relay::Body)),
            (vec![("content-length", "12")], false, Ok(Relay::Body)),
            (vec![("transfer-encoding", "chunked")], false, Ok(Relay::Body)),
            (vec![("transfer-encoding", " Chunked\t")], false, Ok(Relay::Body)),
            (vec![("content-encoding", "identity")], false, Ok(Relay::Body)),
            (
                vec![("content-encoding", "IDENTITY, ,identity")],
                false,
                Ok(Relay::Body),
            ),
            (vec![("content-encoding", "")], false, Ok(Relay::Body)),
            // Known to be empty: nothing to read, whatever the head says.
            (
                vec![("content-encoding", "gzip"), ("content-length", "0")],
                true,
                Ok(Relay::Nothing),
            ),
            (vec![("content-encoding", "br")], true, Ok(Relay::Nothing)),
        ] {
            assert_eq!(relayed(&get, ok, &head(&fields), ended), want, "{fields:?}");
        }
    }

    #[test]
    fn a_coding_the_scrubber_cannot_read_is_refused_in_either_header() {
        let ce = |c: &str| Unreadable::Coding {
            header: "content-encoding",
            coding: c.into(),
        };
        let te = |c: &str| Unreadable::Coding {
            header: "transfer-encoding",
            coding: c.into(),
        };
        for (fields, want) in [
            (vec![("content-encoding", "gzip")], ce("gzip")),
            (vec![("content-encoding", "identity, gzip")], ce("gzip")),
            (
                vec![("content-encoding", "identity"), ("content-encoding", "br")],
                ce("br"),
            ),
            (vec![("content-encoding", "x-identity")], ce("x-identity")),
            (vec![("content-encoding", "\"identity\"")], ce("\"identity\"")),
            (vec![("content-encoding", "identity;q=1")], ce("identity;q=1")),
            (vec![("content-encoding", "aes128gcm")], ce("aes128gcm")),
            (vec![("transfer-encoding", "gzip, chunked")], te("gzip")),
            (
                vec![("transfer-encoding", "gzip"), ("transfer-encoding", "chunked")],
                te("gzip"),
            ),
            (vec![("transfer-encoding", "chunked, gzip")], te("gzip")),
            (vec![("transfer-encoding", "gzip")], te("gzip")),
            (vec![("transfer-encoding", "identity")], te("identity")),
            (vec![("transfer-encoding", "deflate,chunked")], te("deflate")),
            (
                vec![("transfer-encoding", "chunked"), ("content-encoding", "deflate")],
                ce("deflate"),
            ),
        ] {
            assert_eq!(
                relayed(&Method::GET, StatusCode::OK, &head(&fields), false),
                Err(want),
                "{fields:?}"
            );
        }
        let e = relayed(
            &Method::GET,
            StatusCode::OK,
            &head(&[("content-encoding", "gzip")]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("content-encoding \"gzip\""), "{e}");
    }

    #[test]
    fn a_framing_that_disagrees_with_itself_is_refused() {
        for fields in [
            vec![("transfer-encoding", "chunked"), ("content-length", "0")],
            vec![("transfer-encoding", "chunked"), ("content-length", "40")],
            vec![("transfer-encoding", "chunked,")],
            vec![("transfer-encoding", ", chunked")],
            vec![("transfer-encoding", "chunked, chunked")],
            vec![("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")],
        ] {
            let r = relayed(&Method::GET, StatusCode::OK, &head(&fields), false);
            assert!(matches!(r, Err(Unreadable::Framing(_))), "{fields:?}: {r:?}");
            // Even when the HTTP layer says the body ended.
            let r = relayed(&Method::GET, StatusCode::OK, &head(&fields), true);
            assert!(r.is_err(), "{fields:?}: {r:?}");
        }
    }

    #[test]
    fn where_no_body_may_be_none_is_relayed() {
        let get = Method::GET;
        for (method, status, fields, ended, want) in [
            (&get, 204, vec![], true, Ok(Relay::Nothing)),
            (&get, 204, vec![("content-length", "0")], true, Ok(Relay::Nothing)),
            (&get, 304, vec![("content-length", "120")], true, Ok(Relay::Nothing)),
            (&get, 304, vec![("content-encoding", "gzip")], true, Ok(Relay::Nothing)),
            (
                &Method::HEAD,
                200,
                vec![("content-length", "120")],
                true,
                Ok(Relay::Nothing),
            ),
            (
                &Method::HEAD,
                200,
                vec![("transfer-encoding", "gzip, chunked")],
                true,
                Ok(Relay::Nothing),
            ),
            (&get, 101, vec![], true, Ok(Relay::Nothing)),
            // Frames may follow the head (HTTP/2): they must be empty.
            (&get, 204, vec![], false, Ok(Relay::MustBeEmpty)),
            (&get, 304, vec![], false, Ok(Relay::MustBeEmpty)),
            (
                &Method::HEAD,
                200,
                vec![("content-encoding", "gzip")],
                false,
                Ok(Relay::MustBeEmpty),
            ),
            // A 204 (or 1xx) may not announce a body.
            (
                &get,
                204,
                vec![("transfer-encoding", "chunked")],
                true,
                Err(Unreadable::BodyWhereNone("a 204 with Transfer-Encoding".into())),
            ),
            (
                &get,
                204,
                vec![("content-length", "25")],
                true,
                Err(Unreadable::BodyWhereNone("a 204 with Content-Length \"25\"".into())),
            ),
            (
                &get,
                101,
                vec![("transfer-encoding", "chunked")],
                true,
                Err(Unreadable::BodyWhereNone("a 101 with Transfer-Encoding".into())),
            ),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(
                relayed(method, status, &head(&fields), ended),
                want,
                "{method} {status} {fields:?}"
            );
        }
    }
}
