//! Writing a credential into a plain-HTTP request bound for one of its
//! hosts: the run's placeholder is replaced wherever it appears — the
//! credential's header gets the rendered `value` template, any other header
//! and the request target get the raw secret (percent-encoded in the
//! target) — and when the placeholder appears nowhere, the credential's
//! header is set to the rendered value. Values carrying a secret are marked
//! sensitive. The decision whether a credential may go to a host is
//! `policy::credentials`; this module only rewrites.

use crate::data::carry::scrub;
use crate::data::decide::fetch::Injection;
use crate::data::decide::policy::contains;
use crate::runs::Run;
use egress_config::secrets::percent_encode;
use egress_config::Credential;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;

/// Writes each of `inj`'s credentials into a request of `run` (plain HTTP,
/// or inside an intercepted CONNECT), and asks the origin for a response
/// the proxy can scrub of them ([`scrub::ask_scrubbable`]).
pub fn write(inj: &Injection, run: &Run, headers: &mut HeaderMap, pq: &mut PathAndQuery) {
    // A signing credential's request is signed once its body is known
    // (`resign`), not written into here.
    for c in inj
        .creds
        .iter()
        .filter_map(|&i| inj.tool.credentials.get(i))
        .filter(|c| c.sign.is_none())
    {
        let ph = run.placeholder(&c.name).map(|(_, p)| &*p.value);
        apply(headers, pq, c, ph);
    }
    scrub::ask_scrubbable(headers);
}

/// `hay` with every `needle` replaced by `with`.
pub fn replace(hay: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + with.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

fn sensitive(v: &[u8]) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_bytes(v).ok()?;
    v.set_sensitive(true);
    Some(v)
}

/// Writes `cred` into `headers` and `pq`; `placeholder` is the run's for
/// this credential (`None` when the run predates the credential).
pub fn apply(headers: &mut HeaderMap, pq: &mut PathAndQuery, cred: &Credential, placeholder: Option<&str>) {
    let secret = cred.secret.expose();
    let rendered = cred.rendered();
    let mut seen = false;
    if let Some(ph) = placeholder.map(str::as_bytes) {
        for (name, value) in headers.iter_mut() {
            if !contains(value.as_bytes(), ph) {
                continue;
            }
            seen = true;
            let new = if name.as_str() == cred.header {
                sensitive(rendered.as_bytes())
            } else {
                sensitive(&replace(value.as_bytes(), ph, secret.as_bytes()))
            };
            if let Some(v) = new {
                *value = v;
            }
        }
        if contains(pq.as_str().as_bytes(), ph) {
            seen = true;
            let with = percent_encode(secret, b"0123456789ABCDEF", false);
            let new = replace(pq.as_str().as_bytes(), ph, with.as_bytes());
            if let Ok(p) = PathAndQuery::try_from(new) {
                *pq = p;
            }
        }
    }
    if !seen {
        if let (Ok(name), Some(v)) = (
            HeaderName::from_bytes(cred.header.as_bytes()),
            sensitive(rendered.as_bytes()),
        ) {
            headers.insert(name, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(header: &str, value: &str) -> Credential {
        let text = format!(
            "[tools.t]\negress = [\"api.example:80\"]\n[tools.t.credentials.c]\nhosts = [\"api.example:80\"]\nheader = \"{header}\"\nvalue = \"{value}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"C\"\n"
        );
        let c = egress_config::Config::parse(&text, "t").unwrap();
        let mut c = c.policy.tool("t").unwrap().credentials[0].clone();
        c.secret = egress_config::Secret::new("s e/cret");
        c
    }

    const PH: &str = "loom-cred-0123";

    fn run(c: &Credential, headers: &[(&str, &str)], pq: &str) -> (Vec<(String, String)>, String) {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let mut p = PathAndQuery::try_from(pq).unwrap();
        apply(&mut h, &mut p, c, Some(PH));
        let mut out: Vec<(String, String)> = h
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        out.sort();
        (out, p.to_string())
    }

    #[test]
    fn the_placeholder_becomes_the_secret_where_it_appears() {
        let c = cred("Authorization", "Bearer ${secret}");
        let (h, pq) = run(
            &c,
            &[
                ("authorization", &format!("token {PH}")),
                ("x-other", &format!("k={PH};")),
            ],
            &format!("/q?key={PH}&a=1"),
        );
        assert_eq!(
            h,
            [
                ("authorization".into(), "Bearer s e/cret".into()),
                ("x-other".into(), "k=s e/cret;".into())
            ]
        );
        assert_eq!(pq, "/q?key=s%20e%2Fcret&a=1");
    }

    #[test]
    fn an_absent_placeholder_sets_the_header() {
        let c = cred("X-Api-Key", "${secret}");
        let (h, pq) = run(&c, &[("x-api-key", "mine"), ("accept", "*/*")], "/");
        assert_eq!(
            h,
            [("accept".into(), "*/*".into()), ("x-api-key".into(), "s e/cret".into())]
        );
        assert_eq!(pq, "/");
        // In the query only: no header is added.
        let (h, pq) = run(&c, &[], &format!("/?k={PH}"));
        assert!(h.is_empty());
        assert_eq!(pq, "/?k=s%20e%2Fcret");
    }
}
