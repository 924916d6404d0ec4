//! A reader of another proxy's control API, for `egress-proxy facts export
//! --control`: pages through `GET /v1/facts` or `GET /v1/decisions` by
//! cursor (`after` = the last page's `next`) until a page moves it no
//! further, and hands each record or OCSF event on as one JSON line, written
//! as the API wrote it. It dials an IP address only (nothing here resolves a
//! name), speaks HTTP/1.1 or HTTPS with `[control.tls]`'s CA and an
//! optional client certificate, bounds each answer in bytes and in time, and
//! names an API refusal by its status, code and message.

use egress_api::RecordFormat;
use http_body_util::BodyExt as _;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The largest answer read, in bytes: a page holds at most 1000 records.
pub const MAX_ANSWER: usize = 64 << 20;
/// How long one page may take, from the dial to its last byte.
pub const PAGE_TIMEOUT: Duration = Duration::from_secs(60);
/// Records asked for per page by default (the API's largest page).
const PAGE: usize = 1000;

/// Why the records could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--control {url:?}: {why}")]
    Url { url: String, why: String },
    #[error("{0}")]
    Options(String),
    #[error("{0}")]
    Tls(#[from] egress_api::tls::TlsError),
    #[error("{url}: cannot connect: {message}")]
    Unreachable { url: String, message: String },
    #[error("{url}: no complete answer within {} s", PAGE_TIMEOUT.as_secs())]
    Timeout { url: String },
    #[error("{url}: HTTP {status} {code}: {message}")]
    Refused {
        url: String,
        status: u16,
        code: String,
        message: String,
    },
    #[error("{url}: the answer is larger than {MAX_ANSWER} bytes")]
    TooLarge { url: String },
    #[error("{url}: not a page of records: {why}")]
    NotAPage { url: String, why: String },
    #[error("writing the output: {0}")]
    Write(#[source] std::io::Error),
}

/// Where the control API listens: `http://IP:PORT` or `https://IP:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub https: bool,
}

/// Parses `--control`: a scheme, an IP address (IPv6 in brackets) and a
/// port, an optional trailing `/`, nothing else.
pub fn endpoint(url: &str) -> Result<Endpoint, ClientError> {
    let bad = |why: &str| ClientError::Url {
        url: url.to_owned(),
        why: why.to_owned(),
    };
    let (https, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(bad("give http://IP:PORT or https://IP:PORT"));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#', '@']) {
        return Err(bad("give the API's root (scheme, address and port), no path or user"));
    }
    let addr = authority.parse::<SocketAddr>().map_err(|_| {
        bad("the host must be an IP address with a port (127.0.0.1:9090, [::1]:9090): names are not resolved here")
    })?;
    Ok(Endpoint { addr, https })
}

/// Which records to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Records {
    Facts,
    Decisions,
}

/// A control API to read from.
pub struct Client {
    endpoint: Endpoint,
    tls: Option<tokio_rustls::TlsConnector>,
    token: Option<String>,
    page: usize,
}

impl Client {
    /// `ca` verifies the API's certificate (needed with https, refused
    /// with http); `identity` (cert, key) is a client certificate that
    /// names a principal; `token` a principal's bearer token.
    pub fn new(
        endpoint: Endpoint,
        ca: Option<&Path>,
        identity: Option<(&Path, &Path)>,
        token: Option<String>,
    ) -> Result<Client, ClientError> {
        let refuse = |why: &str| ClientError::Options(why.to_owned());
        let tls = match (endpoint.https, ca) {
            (true, Some(ca)) => {
                let config = egress_api::tls::client_config(ca, identity)?;
                Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
            }
            (true, None) => {
                return Err(refuse(
                    "an https:// control URL needs --ca FILE (the CA of the API's certificate)",
                ))
            }
            (false, Some(_)) => return Err(refuse("--ca is for an https:// control URL")),
            (false, None) if identity.is_some() => return Err(refuse("--cert is for an https:// control URL")),
            (false, None) => None,
        };
        if let Some(t) = &token {
            if http::HeaderValue::from_str(&format!("Bearer {t}")).is_err() {
                return Err(refuse(
                    "the control API token holds characters an HTTP header cannot carry",
                ));
            }
        }
        if token.is_none() && identity.is_none() {
            return Err(refuse(
                "no credential for the control API: set the token's variable (--token-env, default EGRESS_CONTROL_TOKEN) or give --cert and --key",
            ));
        }
        Ok(Client {
            endpoint,
            tls,
            token,
            page: PAGE,
        })
    }

    /// Asks for `n` records per page (1 ..= 1000; the default is 1000).
    pub fn page_size(mut self, n: usize) -> Client {
        self.page = n.clamp(1, PAGE);
        self
    }

    /// Every record after `after`, oldest first, each handed to `out` as
    /// one JSON text; returns how many. A scoped principal gets only what
    /// it may see: the cursor still moves past the rest.
    pub async fn export(
        &self,
        what: Records,
        format: RecordFormat,
        mut after: u64,
        out: &mut dyn FnMut(&str) -> std::io::Result<()>,
    ) -> Result<u64, ClientError> {
        let (route, key) = match (what, format) {
            (Records::Facts, RecordFormat::Json) => ("/v1/facts", "facts"),
            (Records::Decisions, RecordFormat::Json) => ("/v1/decisions", "decisions"),
            (Records::Facts, RecordFormat::Ocsf) => ("/v1/facts", "events"),
            (Records::Decisions, RecordFormat::Ocsf) => ("/v1/decisions", "events"),
        };
        let format = match format {
            RecordFormat::Json => "json",
            RecordFormat::Ocsf => "ocsf",
        };
        let mut count = 0;
        loop {
            let path = format!("{route}?after={after}&limit={}&format={format}", self.page);
            let url = format!("{}{path}", self.base());
            let body = tokio::time::timeout(PAGE_TIMEOUT, self.get(&url, &path))
                .await
                .map_err(|_| ClientError::Timeout { url: url.clone() })??;
            let (records, next) = page(&body, key).map_err(|why| ClientError::NotAPage { url, why })?;
            for r in &records {
                out(r.get()).map_err(ClientError::Write)?;
                count += 1;
            }
            if next <= after {
                return Ok(count);
            }
            after = next;
        }
    }

    fn base(&self) -> String {
        let scheme = if self.endpoint.https { "https" } else { "http" };
        format!("{scheme}://{}", self.endpoint.addr)
    }

    /// One `GET`: the body of a `2xx`, else the API's refusal.
    async fn get(&self, url: &str, path: &str) -> Result<bytes::Bytes, ClientError> {
        let unreachable = |e: &dyn std::fmt::Display| ClientError::Unreachable {
            url: url.to_owned(),
            message: e.to_string(),
        };
        let tcp = tokio::net::TcpStream::connect(self.endpoint.addr)
            .await
            .map_err(|e| unreachable(&e))?;
        let mut req = hyper::Request::get(path).header("host", self.endpoint.addr.to_string());
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(|e| unreachable(&e))?;
        let resp = match &self.tls {
            Some(tls) => {
                let name = egress_api::tls::server_name(&self.endpoint.addr.ip().to_string())?;
                let io = tls.connect(name, tcp).await.map_err(|e| unreachable(&e))?;
                send(hyper_util::rt::TokioIo::new(io), req).await
            }
            None => send(hyper_util::rt::TokioIo::new(tcp), req).await,
        }
        .map_err(|e| unreachable(&e))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    ClientError::TooLarge { url: url.to_owned() }
                } else {
                    unreachable(&e)
                }
            })?
            .to_bytes();
        if status.is_success() {
            return Ok(body);
        }
        let (code, message) = refusal(&body);
        Err(ClientError::Refused {
            url: url.to_owned(),
            status: status.as_u16(),
            code,
            message,
        })
    }
}

async fn send<I>(
    io: I,
    req: hyper::Request<http_body_util::Empty<bytes::Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io).await?;
    // Ends with the connection, when the answer is read and `send` dropped.
    tokio::spawn(conn);
    send.send_request(req).await
}

/// A page's records under `key`, each as the API wrote it, and its `next`.
fn page<'a>(body: &'a [u8], key: &str) -> Result<(Vec<&'a RawValue>, u64), String> {
    let fields: BTreeMap<&str, &RawValue> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let next = fields
        .get("next")
        .and_then(|n| serde_json::from_str::<u64>(n.get()).ok())
        .ok_or("no `next` cursor")?;
    let records = fields
        .get(key)
        .and_then(|l| serde_json::from_str::<Vec<&RawValue>>(l.get()).ok())
        .ok_or(format!("no `{key}` list"))?;
    Ok((records, next))
}

/// The code and message of an API error body (`{"error":{"code","message"}}`),
/// or, for another body, `-` and its start.
fn refusal(body: &[u8]) -> (String, String) {
    match serde_json::from_slice::<egress_api::ErrorBody>(body) {
        Ok(b) => (b.error.code, b.error.message),
        Err(_) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
            ("-".into(), text.trim().to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_url_is_an_ip_address_and_a_port() {
        let e = endpoint("http://127.0.0.1:9090").unwrap();
        assert_eq!((e.addr, e.https), ("127.0.0.1:9090".parse().unwrap(), false));
        let e = endpoint("https://[::1]:9443/").unwrap();
        assert_eq!((e.addr, e.https), ("[::1]:9443".parse().unwrap(), true));
        for bad in [
            "127.0.0.1:9090",
            "ftp://127.0.0.1:9090",
            "http://localhost:9090",
            "http://127.0.0.1",
            "http://127.0.0.1:9090/v1/facts",
            "http://u@127.0.0.1:9090",
            "http://127.0.0.1:9090?x",
            "http://",
        ] {
            let e = endpoint(bad).unwrap_err();
            assert!(e.to_string().starts_with("--control"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_client_needs_a_credential_and_a_ca_exactly_for_https() {
        let http = endpoint("http://127.0.0.1:1").unwrap();
        let https = endpoint("https://127.0.0.1:1").unwrap();
        let tok = || Some("t".to_owned());
        assert!(Client::new(http.clone(), None, None, tok()).is_ok());
        for (e, ca, want) in [
            (http.clone(), None, "no credential"),
            (https.clone(), None, "needs --ca"),
            (http.clone(), Some(Path::new("/x")), "--ca is for an https"),
        ] {
            let token = if want == "no credential" { None } else { tok() };
            let err = Client::new(e, ca, None, token).err().unwrap();
            assert!(err.to_string().contains(want), "{err}");
        }
        let err = Client::new(http.clone(), None, None, Some("a\nb".into()))
            .err()
            .unwrap();
        assert!(err.to_string().contains("cannot carry"), "{err}");
        let err = Client::new(https, Some(Path::new("/nonexistent/ca.pem")), None, tok())
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_page_gives_its_records_and_cursor_or_says_what_is_missing() {
        let (r, next) = page(br#"{"events":[{"b":1,"a":2},{"b":2}],"next":7}"#, "events").unwrap();
        assert_eq!((r.len(), next), (2, 7));
        assert_eq!(r[0].get(), r#"{"b":1,"a":2}"#, "as written, not re-ordered");
        assert!(page(br#"{"facts":[],"next":7}"#, "events")
            .unwrap_err()
            .contains("events"));
        assert!(page(br#"{"events":[]}"#, "events").unwrap_err().contains("next"));
        assert!(page(b"<html>", "events").is_err());
    }

    #[test]
    fn a_refusal_is_named_by_the_api_s_code_and_message() {
        let (c, m) = refusal(br#"{"error":{"code":"scope","message":"no facts scope"}}"#);
        assert_eq!((c.as_str(), m.as_str()), ("scope", "no facts scope"));
        let long = vec![b'x'; 10_000];
        let (c, m) = refusal(&long);
        assert_eq!((c.as_str(), m.len()), ("-", 200));
    }
}
