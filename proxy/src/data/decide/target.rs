//! Parses and canonicalizes the target of one proxied request, once: CONNECT
//! needs authority-form `host:port` (RFC 9110 §9.3.6); plain HTTP needs
//! absolute-form `http://authority/...` (RFC 9112 §3.2.2) whose `Host` header
//! names the same authority, closing the Host-header bypass. The canonical
//! target is what matching, logging, facts and dialling all use.

use crate::facts::FactTarget;
use egress_config::{host::AuthorityError, parse_authority, Host};
use http::uri::{PathAndQuery, Uri};
use http::{HeaderMap, Version};
use std::fmt;

pub use crate::deny::Kind;

/// A canonical request target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub kind: Kind,
    pub host: Host,
    pub port: u16,
    /// Origin-form path and query for plain HTTP.
    pub path_and_query: Option<PathAndQuery>,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

impl Target {
    /// The `Host` header value to send upstream.
    pub fn host_header(&self) -> String {
        if self.port == 80 {
            self.host.to_string()
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Why a target was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetError {
    /// `bad_target`, with a message for the client.
    Bad(String),
    /// `host_mismatch`, with a message for the client.
    HostMismatch(String),
}

fn bad(msg: impl Into<String>) -> TargetError {
    TargetError::Bad(msg.into())
}

fn authority_error(raw: &str, e: AuthorityError) -> TargetError {
    bad(format!("target {raw:?}: {e}"))
}

/// Splits an authority that may omit its port (plain HTTP), applying `default_port`.
fn authority_with_default(raw: &str, default_port: u16) -> Result<(Host, u16), AuthorityError> {
    let has_port = if raw.starts_with('[') {
        raw.rfind(']').is_some_and(|i| raw[i + 1..].starts_with(':'))
    } else {
        raw.contains(':')
    };
    if has_port {
        parse_authority(raw)
    } else {
        let host = egress_config::parse_host(raw).map_err(AuthorityError::Host)?;
        Ok((host, default_port))
    }
}

/// CONNECT target: authority-form only.
pub fn parse_connect(uri: &Uri) -> Result<Target, TargetError> {
    if uri.scheme().is_some()
        || uri
            .path_and_query()
            .is_some_and(|p| !p.as_str().is_empty() && p.as_str() != "/")
    {
        return Err(bad("CONNECT needs an authority-form target (host:port)"));
    }
    let auth = uri
        .authority()
        .ok_or_else(|| bad("CONNECT needs an authority-form target (host:port)"))?;
    let raw = auth.as_str();
    let (host, port) = parse_authority(raw).map_err(|e| authority_error(raw, e))?;
    Ok(Target {
        kind: Kind::Connect,
        host,
        port,
        path_and_query: None,
    })
}

/// Plain-HTTP target: absolute-form `http://` URI, `Host` equal to its authority.
pub fn parse_absolute(uri: &Uri, headers: &HeaderMap, version: Version) -> Result<Target, TargetError> {
    let scheme = match uri.scheme_str() {
        Some(s) => s,
        None => return Err(bad("not a proxy request: use an absolute-form http:// URI or CONNECT")),
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(bad(format!(
            "scheme {scheme:?} is not forwarded; use CONNECT for https"
        )));
    }
    let auth = uri
        .authority()
        .ok_or_else(|| bad("absolute-form URI without an authority"))?;
    let raw = auth.as_str();
    let (host, port) = authority_with_default(raw, 80).map_err(|e| authority_error(raw, e))?;
    let mut hosts = headers.get_all(http::header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => return Err(TargetError::HostMismatch("more than one Host header".into())),
        (None, _) if version >= Version::HTTP_11 => {
            return Err(TargetError::HostMismatch(
                "HTTP/1.1 request without a Host header".into(),
            ))
        }
        (None, _) => {}
        (Some(v), None) => {
            let hv = v
                .to_str()
                .map_err(|_| TargetError::HostMismatch("Host header is not ASCII".into()))?;
            let same = authority_with_default(hv, 80).is_ok_and(|(h, p)| h == host && p == port);
            if !same {
                return Err(TargetError::HostMismatch(format!(
                    "Host header {hv:?} does not name the request target {raw:?}"
                )));
            }
        }
    }
    // The origin-form sent upstream is never empty: `/` for an empty path
    // (also when the target was only a fragment, which `http` keeps as an
    // empty path that renders as nothing), fragments never included.
    let pq = match uri.path_and_query() {
        Some(pq) if pq.as_str() == "/" => PathAndQuery::from_static("/"),
        Some(pq) if pq.as_str().starts_with('/') => pq.clone(),
        Some(pq) if pq.as_str().starts_with('?') => {
            PathAndQuery::try_from(format!("/{}", pq.as_str())).map_err(|_| bad("invalid path"))?
        }
        _ => PathAndQuery::from_static("/"),
    };
    Ok(Target {
        kind: Kind::Http,
        host,
        port,
        path_and_query: Some(pq),
    })
}

/// The target of a request inside an intercepted CONNECT to `connect`
/// (HTTPS): origin-form, or an absolute `https://` URI naming the same host
/// and port; its one `Host` (when present) naming them too, the port 443
/// when omitted. Anything else is `host_mismatch`: a tool may not tunnel to
/// one host and talk to another inside.
pub fn parse_inside(connect: &Target, uri: &Uri, headers: &HeaderMap) -> Result<Target, TargetError> {
    parse_on(connect, "https", 443, uri, headers)
}

/// The target of a plain-HTTP request on a transparent connection to
/// `dest` (the name or address the sandbox connected to, and its port):
/// as [`parse_inside`], for `http` and port 80 when omitted. A request may
/// not name another host than the one its connection goes to.
pub fn parse_transparent(dest: &Target, uri: &Uri, headers: &HeaderMap) -> Result<Target, TargetError> {
    parse_on(dest, "http", 80, uri, headers)
}

/// Whether a TLS server name (SNI) names `host` (names compare without case
/// and a trailing dot; an address never matches a name).
pub fn server_name_is(host: &Host, sni: &str) -> bool {
    match host {
        Host::Name(n) => n.eq_ignore_ascii_case(sni.trim_end_matches('.')),
        Host::Ip(ip) => sni.parse::<std::net::IpAddr>().is_ok_and(|s| s == *ip),
    }
}

fn parse_on(
    connect: &Target,
    scheme: &str,
    default_port: u16,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Target, TargetError> {
    let names_connect = |raw: &str| {
        authority_with_default(raw, default_port).is_ok_and(|(h, p)| h == connect.host && p == connect.port)
    };
    if let Some(auth) = uri.authority() {
        if !uri.scheme_str().is_some_and(|s| s.eq_ignore_ascii_case(scheme)) || !names_connect(auth.as_str()) {
            return Err(TargetError::HostMismatch(format!(
                "request target {:?} is not on the tunnel's host {connect}",
                uri.to_string()
            )));
        }
    }
    let mut hosts = headers.get_all(http::header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => return Err(TargetError::HostMismatch("more than one Host header".into())),
        (Some(v), None) => {
            let hv = v
                .to_str()
                .map_err(|_| TargetError::HostMismatch("Host header is not ASCII".into()))?;
            if !names_connect(hv) {
                return Err(TargetError::HostMismatch(format!(
                    "Host header {hv:?} does not name the tunnel's host {connect}"
                )));
            }
        }
        (None, _) => {}
    }
    let pq = match uri.path_and_query() {
        Some(pq) if pq.as_str().starts_with('/') => pq.clone(),
        Some(pq) if pq.as_str().starts_with('?') => {
            PathAndQuery::try_from(format!("/{}", pq.as_str())).map_err(|_| bad("invalid path"))?
        }
        Some(pq) if pq.as_str() == "*" => return Err(bad("asterisk-form is not forwarded")),
        _ => PathAndQuery::from_static("/"),
    };
    Ok(Target {
        kind: Kind::Http,
        host: connect.host.clone(),
        port: connect.port,
        path_and_query: Some(pq),
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_name_must_be_the_tunnel_s_host() {
        let name = Host::Name("api.example".into());
        assert!(server_name_is(&name, "api.example"));
        assert!(server_name_is(&name, "API.Example."));
        assert!(!server_name_is(&name, "other.example"));
        assert!(!server_name_is(&name, "api.example.evil"));
        let ip = Host::Ip("127.0.0.9".parse().unwrap());
        assert!(server_name_is(&ip, "127.0.0.9"));
        assert!(!server_name_is(&ip, "api.example"));
    }
    use http::HeaderValue;

    #[test]
    fn requests_inside_a_tunnel_stay_on_its_host() {
        let tunnel = parse_connect(&"api.example:443".parse().unwrap()).unwrap();
        let inside = |uri: &str, host: &[&str]| {
            let mut h = HeaderMap::new();
            for v in host {
                h.append(http::header::HOST, HeaderValue::from_str(v).unwrap());
            }
            parse_inside(&tunnel, &uri.parse().unwrap(), &h)
        };
        for (uri, host) in [
            ("/a?b=1", &["api.example"][..]),
            ("/a?b=1", &["API.example:443"][..]),
            ("/a?b=1", &[][..]),
            ("https://api.example/a?b=1", &["api.example"][..]),
        ] {
            let t = inside(uri, host).unwrap();
            assert_eq!(
                (t.kind, t.to_string(), t.path_and_query.unwrap().as_str()),
                (Kind::Http, "api.example:443".to_owned(), "/a?b=1"),
                "{uri} {host:?}"
            );
        }
        for (uri, host) in [
            ("/", &["other.example"][..]),
            ("/", &["api.example:8443"][..]),
            ("/", &["api.example", "api.example"][..]),
            ("https://other.example/", &["api.example"][..]),
            ("http://api.example:443/", &["api.example"][..]),
        ] {
            assert!(
                matches!(inside(uri, host), Err(TargetError::HostMismatch(_))),
                "{uri} {host:?}"
            );
        }
        let odd = parse_connect(&"api.example:8443".parse().unwrap()).unwrap();
        let mut h = HeaderMap::new();
        h.insert(http::header::HOST, HeaderValue::from_static("api.example"));
        assert!(
            parse_inside(&odd, &"/".parse().unwrap(), &h).is_err(),
            "no port means 443"
        );
    }

    fn connect(s: &str) -> Result<Target, TargetError> {
        let uri: Uri = s.parse().map_err(|_| bad("unparsable"))?;
        parse_connect(&uri)
    }

    fn absolute(s: &str, host: Option<&str>) -> Result<Target, TargetError> {
        let uri: Uri = s.parse().map_err(|_| bad("unparsable"))?;
        let mut h = HeaderMap::new();
        if let Some(v) = host {
            h.insert(http::header::HOST, HeaderValue::from_str(v).unwrap());
        }
        parse_absolute(&uri, &h, Version::HTTP_11)
    }

    #[test]
    fn connect_targets() {
        let t = connect("Example.COM.:443").unwrap();
        assert_eq!(
            (t.host.to_string(), t.port, t.kind),
            ("example.com".into(), 443, Kind::Connect)
        );
        assert!(matches!(connect("127.1:80").unwrap().host, Host::Ip(_)));
        assert!(matches!(connect("[::ffff:7f00:1]:80").unwrap().host, Host::Ip(_)));
        for bad_one in [
            "example.com",
            "example.com:0",
            "example.com:99999",
            "http://example.com:80",
            "ex%61mple.com:443",
        ] {
            assert!(matches!(connect(bad_one), Err(TargetError::Bad(_))), "{bad_one}");
        }
    }

    #[test]
    fn userinfo_in_connect_is_bad() {
        // http::Uri accepts userinfo in an authority; the canonicalizer must not.
        if let Ok(uri) = "user:pw@example.com:443".parse::<Uri>() {
            assert!(matches!(parse_connect(&uri), Err(TargetError::Bad(_))));
        }
    }

    #[test]
    fn absolute_targets() {
        let t = absolute("http://Example.com/a?b=1", Some("example.com")).unwrap();
        assert_eq!((t.host.to_string(), t.port), ("example.com".into(), 80));
        assert_eq!(t.path_and_query.unwrap().as_str(), "/a?b=1");
        let t = absolute("http://example.com:8080", Some("EXAMPLE.com:8080")).unwrap();
        assert_eq!((t.port, t.path_and_query.unwrap().as_str()), (8080, "/"));
        assert_eq!(
            absolute("http://example.com/", Some("example.com:80")).unwrap().port,
            80
        );
    }

    #[test]
    fn origin_form_is_never_empty() {
        for (raw, want) in [
            ("http://example.com:8080#frag", "/"),
            ("http://example.com#", "/"),
            ("http://example.com?q=1#f", "/?q=1"),
            ("http://example.com/p#f", "/p"),
        ] {
            // hyper parses request targets from shared bytes.
            let uri = Uri::from_maybe_shared(bytes::Bytes::from(raw)).unwrap();
            let mut h = http::HeaderMap::new();
            h.insert(http::header::HOST, http::HeaderValue::from_static("example.com:8080"));
            if !raw.contains(":8080") {
                h.insert(http::header::HOST, http::HeaderValue::from_static("example.com"));
            }
            let t = parse_absolute(&uri, &h, http::Version::HTTP_11).unwrap();
            let sent = Uri::from(t.path_and_query.unwrap()).to_string();
            assert_eq!(sent, want, "{raw}");
        }
    }

    #[test]
    fn absolute_rejections() {
        assert!(matches!(
            absolute("/relative", Some("example.com")),
            Err(TargetError::Bad(_))
        ));
        assert!(matches!(
            absolute("https://example.com/", Some("example.com")),
            Err(TargetError::Bad(_))
        ));
        assert!(matches!(
            absolute("http://user@example.com/", Some("example.com")),
            Err(TargetError::Bad(_))
        ));
        assert!(matches!(
            absolute("http://example.com:0/", Some("example.com:0")),
            Err(TargetError::Bad(_))
        ));
        assert!(matches!(
            absolute("http://allowed.example/", Some("evil.example")),
            Err(TargetError::HostMismatch(_))
        ));
        assert!(matches!(
            absolute("http://allowed.example/", Some("allowed.example:81")),
            Err(TargetError::HostMismatch(_))
        ));
        assert!(matches!(
            absolute("http://allowed.example/", None),
            Err(TargetError::HostMismatch(_))
        ));
    }

    #[test]
    fn double_host_is_a_mismatch() {
        let uri: Uri = "http://a.example/".parse().unwrap();
        let mut h = HeaderMap::new();
        h.append(http::header::HOST, HeaderValue::from_static("a.example"));
        h.append(http::header::HOST, HeaderValue::from_static("b.example"));
        assert!(matches!(
            parse_absolute(&uri, &h, Version::HTTP_11),
            Err(TargetError::HostMismatch(_))
        ));
    }

    proptest::proptest! {
        #[test]
        fn connect_parsing_never_panics_and_is_canonical(host in "[a-zA-Z0-9.:\\[\\]%@_-]{0,40}", port in proptest::option::of(0u32..70000)) {
            let raw = match port { Some(p) => format!("{host}:{p}"), None => host.clone() };
            if let Ok(uri) = raw.parse::<Uri>() {
                if let Ok(t) = parse_connect(&uri) {
                    // A canonical target re-parses to itself.
                    let again: Uri = t.to_string().parse().unwrap();
                    proptest::prop_assert_eq!(parse_connect(&again).unwrap(), t);
                }
            }
        }

        #[test]
        fn absolute_parsing_never_panics(s in "\\PC{0,60}", h in "\\PC{0,30}") {
            if let Ok(uri) = format!("http://{s}").parse::<Uri>() {
                let mut hm = HeaderMap::new();
                if let Ok(v) = HeaderValue::from_str(&h) {
                    hm.insert(http::header::HOST, v);
                }
                let _ = parse_absolute(&uri, &hm, Version::HTTP_11);
            }
        }
    }
}
