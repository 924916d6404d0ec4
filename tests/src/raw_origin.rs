//! An origin that answers with exactly what a test says, for the tests of
//! what a credential host's answer may carry back to a tool: on plain TCP
//! or TLS (a test CA of its own), HTTP/1.1 as raw bytes written as they are
//! (then the connection closes), or HTTP/2 (hyper's server) as a status,
//! headers, data frames and trailers. The answer is made from what was
//! asked (method, path, and the `Authorization` value received, to reflect
//! it); every request head is recorded. Also a gzip member made of stored
//! deflate blocks, cut where a test says (so that what it carries never
//! shows as one run of bytes, as real compression would), the inflater a
//! tool would run on it, and chunked framing.

use crate::origin::Heads;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the origin was asked.
#[derive(Debug, Clone)]
pub struct Asked {
    pub method: String,
    pub path: String,
    /// The `Authorization` value received ("" when none).
    pub key: String,
}

/// What the origin answers.
pub enum Answer {
    /// HTTP/1.1: these bytes, as they are.
    Raw(Vec<u8>),
    /// HTTP/2: this status and these headers; then these data frames (the
    /// head ends the stream when there are none and no trailers), then
    /// these trailers.
    H2 {
        status: u16,
        headers: Vec<(&'static str, String)>,
        data: Vec<Vec<u8>>,
        trailers: Vec<(&'static str, String)>,
    },
}

pub type Answerer = Arc<dyn Fn(&Asked) -> Answer + Send + Sync>;

/// How the origin is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaks {
    /// HTTP/1.1 on plain TCP.
    Plain,
    /// HTTP/1.1 over TLS (ALPN `http/1.1`).
    Tls,
    /// HTTP/2 over TLS (ALPN `h2`).
    TlsH2,
}

pub struct RawOrigin {
    pub addr: SocketAddr,
    /// The origin's CA, PEM (TLS only).
    pub ca_pem: Option<String>,
    heads: Heads,
}

impl RawOrigin {
    /// Every request head received: `METHOD target`, then `name: value`
    /// lines (names lower-case).
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// Starts an origin on `addr` (a certificate for `names` when over TLS).
pub async fn raw_origin(addr: &str, names: &[&str], speaks: Speaks, answer: Answerer) -> RawOrigin {
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (acceptor, ca_pem) = match speaks {
        Speaks::Plain => (None, None),
        Speaks::Tls | Speaks::TlsH2 => {
            let alpn: &[u8] = if speaks == Speaks::TlsH2 { b"h2" } else { b"http/1.1" };
            let (config, ca) = crate::tls_origin::test_server_config(names, &[alpn]);
            (Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))), Some(ca))
        }
    };
    let heads = Heads::default();
    let recorded = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (acceptor, answer, heads) = (acceptor.clone(), answer.clone(), recorded.clone());
            tokio::spawn(async move {
                match acceptor {
                    None => serve_h1(s, &answer, &heads).await,
                    Some(a) => {
                        let Ok(tls) = a.accept(s).await else { return };
                        if speaks == Speaks::TlsH2 {
                            serve_h2(tls, answer, heads).await;
                        } else {
                            serve_h1(tls, &answer, &heads).await;
                        }
                    }
                }
            });
        }
    });
    RawOrigin { addr, ca_pem, heads }
}

/// One request head, then the answer's bytes, then the close.
async fn serve_h1<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, answer: &Answerer, heads: &Heads) {
    let mut head = vec![];
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 64 * 1024 {
            return;
        }
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let first: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
    let mut recorded = format!("{} {}\n", first.first().unwrap_or(&""), first.get(1).unwrap_or(&""));
    let mut key = String::new();
    for l in lines.take_while(|l| !l.is_empty()) {
        if let Some((k, v)) = l.split_once(':') {
            let k = k.trim().to_ascii_lowercase();
            if k == "authorization" {
                key = v.trim().to_owned();
            }
            recorded.push_str(&format!("{k}: {}\n", v.trim()));
        }
    }
    heads.lock().unwrap().push(recorded);
    let asked = Asked {
        method: first.first().unwrap_or(&"").to_string(),
        path: first.get(1).unwrap_or(&"").to_string(),
        key,
    };
    let Answer::Raw(bytes) = answer(&asked) else {
        panic!("an HTTP/1.1 origin answers raw bytes");
    };
    let _ = s.write_all(&bytes).await;
    let _ = s.flush().await;
    let _ = s.shutdown().await;
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// HTTP/2 with hyper's server, each stream answered as told.
async fn serve_h2<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(s: S, answer: Answerer, heads: Heads) {
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (answer, heads) = (answer.clone(), heads.clone());
        async move {
            crate::origin::record(&heads, &req);
            let key = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            let asked = Asked {
                method: req.method().to_string(),
                path: req.uri().path_and_query().map(|p| p.to_string()).unwrap_or_default(),
                key,
            };
            let Answer::H2 {
                status,
                headers,
                data,
                trailers,
            } = answer(&asked)
            else {
                panic!("an HTTP/2 origin answers frames");
            };
            let mut frames: Vec<Result<Frame<Bytes>, Infallible>> =
                data.into_iter().map(|d| Ok(Frame::data(Bytes::from(d)))).collect();
            if !trailers.is_empty() {
                let mut t = http::HeaderMap::new();
                for (k, v) in trailers {
                    t.append(HeaderName::from_static(k), HeaderValue::from_str(&v).unwrap());
                }
                frames.push(Ok(Frame::trailers(t)));
            }
            let body: Body = if frames.is_empty() {
                http_body_util::Empty::new().boxed()
            } else {
                StreamBody::new(futures_util::stream::iter(frames)).boxed()
            };
            let mut r = Response::new(body);
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            for (k, v) in headers {
                r.headers_mut()
                    .append(HeaderName::from_static(k), HeaderValue::from_str(&v).unwrap());
            }
            Ok::<_, Infallible>(r)
        }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(s), svc)
        .await;
}

/// `body` as chunks of at most `n` bytes, with the last chunk.
pub fn chunked(body: &[u8], n: usize) -> Vec<u8> {
    let mut out = vec![];
    for c in body.chunks(n.max(1)) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A gzip member (RFC 1952) of `data` in two stored deflate blocks cut at
/// `cut` (RFC 1951 §3.2.4): what it carries is never one run of bytes.
pub fn gzip_stored(data: &[u8], cut: usize) -> Vec<u8> {
    let cut = cut.min(data.len());
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    for (last, block) in [(0u8, &data[..cut]), (1u8, &data[cut..])] {
        let len = block.len() as u16;
        out.push(last);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

/// What a tool inflating [`gzip_stored`]'s members finds in `bytes`:
/// every member that starts anywhere in them, inflated.
pub fn gunzip_stored(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![];
    for start in 0..bytes.len().saturating_sub(10) {
        if bytes[start..].starts_with(&[0x1f, 0x8b, 8, 0]) {
            if let Some(d) = inflate_stored(&bytes[start + 10..]) {
                out.push(d);
            }
        }
    }
    out
}

fn inflate_stored(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = vec![];
    loop {
        let (&head, rest) = b.split_first()?;
        if head >> 1 & 3 != 0 || rest.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let data = rest.get(4..4 + len)?;
        out.extend_from_slice(data);
        b = &rest[4 + len..];
        if head & 1 == 1 {
            return Some(out);
        }
    }
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { crc >> 1 ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_gzip_member_hides_its_run_and_inflates_back() {
        let data = b"Bearer tok-SECRET-value";
        let z = gzip_stored(data, 12);
        assert!(!z.windows(data.len()).any(|w| w == data));
        assert_eq!(gunzip_stored(&z), [data.to_vec()]);
        // The check value gzip would write for this input.
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(chunked(b"abcde", 2), b"2\r\nab\r\n2\r\ncd\r\n1\r\ne\r\n0\r\n\r\n");
    }
}
