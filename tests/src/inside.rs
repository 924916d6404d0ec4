//! A tool's side of an intercepted CONNECT: TLS to the proxy trusting only
//! the appliance CA, picking HTTP/1.1 or HTTP/2 by ALPN, and one request
//! inside, whose whole answer (every byte, trailers too) is kept for the
//! test to search.

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An answer inside the tunnel as the tool got it.
#[derive(Debug, Clone, Default)]
pub struct Got {
    /// 0 when no answer came (the stream or connection broke).
    pub status: u16,
    /// Names lower-case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Every byte the tool read (HTTP/1.1: as on the wire; HTTP/2: the
    /// head, body and trailers as text), and any error.
    pub all: Vec<u8>,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// TLS over `stream` (a tunnel) for `name`, trusting `ca_pem` only,
/// offering `alpn`.
pub async fn connect(
    ca_pem: &str,
    name: &str,
    alpn: &[&[u8]],
    stream: TcpStream,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let server = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(server, stream)
        .await
}

/// [`connect`] offering `alpn` alone, which must succeed.
pub async fn tls(
    ca_pem: &str,
    name: &str,
    alpn: &[u8],
    stream: TcpStream,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    connect(ca_pem, name, &[alpn], stream).await.unwrap()
}

/// One HTTP/1.1 request (`Connection: close`) with `headers` (`name:
/// value` lines), read to the end (10 s cap).
pub async fn h1(ca_pem: &str, authority: &str, stream: TcpStream, method: &str, path: &str, headers: &str) -> Got {
    let name = authority.split(':').next().unwrap();
    let mut t = tls(ca_pem, name, b"http/1.1", stream).await;
    let req = format!("{method} {path} HTTP/1.1\r\nHost: {authority}\r\n{headers}Connection: close\r\n\r\n");
    t.write_all(req.as_bytes()).await.unwrap();
    let mut all = vec![];
    let read = tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut all)).await;
    assert!(read.is_ok(), "no end of the answer within 10 s");
    let Some(r) = crate::raw::parse(&all) else {
        return Got { all, ..Got::default() };
    };
    Got {
        status: r.status,
        headers: r.headers,
        body: r.body,
        all,
    }
}

/// One HTTP/2 request with `headers` (name, value), its whole answer read
/// (10 s cap); a stream or connection error is kept in `all`.
pub async fn h2(
    ca_pem: &str,
    authority: &str,
    stream: TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Got {
    let name = authority.split(':').next().unwrap();
    let t = tls(ca_pem, name, b"h2", stream).await;
    assert_eq!(t.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "the proxy speaks h2");
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(t))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("https://{authority}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Empty::<Bytes>::new()).unwrap();
    let fut = async {
        let mut got = Got::default();
        let resp = match send.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                got.all = format!("error: {e}").into_bytes();
                return got;
            }
        };
        got.status = resp.status().as_u16();
        let mut text = format!("{}\n", got.status);
        for (k, v) in resp.headers() {
            let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
            text.push_str(&format!("{k}: {v}\n"));
            got.headers.push((k.to_string(), v));
        }
        got.all = text.into_bytes();
        let mut body = resp.into_body();
        while let Some(f) = body.frame().await {
            match f {
                Ok(f) => match f.into_data() {
                    Ok(d) => {
                        got.body.extend_from_slice(&d);
                        got.all.extend_from_slice(&d);
                    }
                    Err(f) => {
                        for (k, v) in f.into_trailers().unwrap_or_default().iter() {
                            got.all.extend_from_slice(
                                format!("\n{k}: {}", String::from_utf8_lossy(v.as_bytes())).as_bytes(),
                            );
                        }
                    }
                },
                Err(e) => {
                    got.all.extend_from_slice(format!("\nerror: {e}").as_bytes());
                    break;
                }
            }
        }
        got
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("the answer ends within 10 s")
}
