//! An HTTPS origin that speaks HTTP/2 (ALPN `h2`, then `http/1.1`) or
//! HTTP/1.1 only, for the HTTP/2 interception tests: a test CA of its own,
//! a record of every request head with the protocol it came in, and the
//! most requests it had in flight at once.
//! - any path: `200`, body `ok <version>` (e.g. `ok HTTP/2.0`);
//! - `/slow?ms=N`: the same after N ms;
//! - `/trailers`: a body, then trailers `x-origin-trailer: done`.

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

#[derive(Default)]
struct Seen {
    heads: Mutex<Vec<String>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    connections: AtomicUsize,
}

pub struct H2Origin {
    pub addr: SocketAddr,
    /// The origin's CA, PEM.
    pub ca_pem: String,
    seen: Arc<Seen>,
}

impl H2Origin {
    /// Every request head so far: `VERSION METHOD target`, then one
    /// `name: value` line per header (names lower-case).
    pub fn heads(&self) -> Vec<String> {
        self.seen.heads.lock().unwrap().clone()
    }

    /// The most requests in flight at once so far.
    pub fn max_in_flight(&self) -> usize {
        self.seen.max_in_flight.load(Ordering::SeqCst)
    }

    /// TLS connections accepted so far.
    pub fn connections(&self) -> usize {
        self.seen.connections.load(Ordering::SeqCst)
    }
}

struct InFlight(Arc<Seen>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn param(req: &Request<Incoming>, name: &str) -> u64 {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

async fn answer(seen: Arc<Seen>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let mut head = format!("{:?} {} {}\n", req.version(), req.method(), req.uri());
    for (k, v) in req.headers() {
        head.push_str(&format!("{}: {}\n", k, v.to_str().unwrap_or("?")));
    }
    {
        let mut heads = seen.heads.lock().unwrap();
        // A benchmark's load keeps only the first.
        if heads.len() < 10_000 {
            heads.push(head);
        }
    }
    let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    seen.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let _f = InFlight(seen.clone());
    let ms = param(&req, "ms");
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let text = format!("ok {:?}\n", req.version());
    let resp = if req.uri().path() == "/trailers" {
        let mut t = HeaderMap::new();
        t.insert("x-origin-trailer", "done".parse().unwrap());
        let frames = vec![
            Ok::<_, Infallible>(Frame::data(Bytes::from(text))),
            Ok(Frame::trailers(t)),
        ];
        Response::new(StreamBody::new(futures_util::stream::iter(frames)).boxed())
    } else {
        Response::new(Full::new(Bytes::from(text)).boxed())
    };
    Ok(resp)
}

/// Starts an HTTPS origin on `addr` whose certificate names `names`,
/// offering `h2` by ALPN when `h2` (else HTTP/1.1 only).
pub async fn h2_origin(addr: &str, names: &[&str], h2: bool) -> H2Origin {
    let (config, ca_pem) = crate::tls_origin::test_server_config(names, crate::tls_origin::alpn(h2));
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = s.set_nodelay(true);
            let (acceptor, seen) = (acceptor.clone(), s2.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else { return };
                seen.connections.fetch_add(1, Ordering::SeqCst);
                let picked_h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let svc = hyper::service::service_fn(move |req| answer(seen.clone(), req));
                if picked_h2 {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                }
            });
        }
    });
    H2Origin { addr, ca_pem, seen }
}
