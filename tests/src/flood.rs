//! A fast origin for byte-budget and slot tests: it sends as fast as its
//! peer reads and reads as fast as its peer sends, counting every byte it
//! receives, over plain TCP, HTTP/1.1, or HTTPS with HTTP/2 (`h2`, then
//! `http/1.1` by ALPN) or HTTP/1.1 only; and the tool's side of such
//! tests: a TLS tunnel through the proxy (trusting the appliance CA), an
//! HTTP/2 client on it, and byte pumps that count what crossed.
//!
//! - [`raw_flood`]: every connection is written to and read from at once,
//!   until either side fails;
//! - [`http_flood`] paths: `GET /down` answers `200` with an endless body;
//!   `POST /up` reads the request body, then answers `got N`; `POST /early`
//!   answers `200 early` at once and keeps reading the request body (the
//!   uploads in flight and the most at once are counted); a WebSocket
//!   handshake (`Upgrade: websocket`) gets its `101` and then the
//!   connection is written to and read from like a raw one.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// What one write of the origin (and of [`pour`]) carries.
const CHUNK: usize = 64 * 1024;

/// What the origin counted.
#[derive(Default)]
pub struct Counts {
    /// Bytes received from peers: request bodies, raw and WebSocket bytes.
    pub received: AtomicU64,
    /// Requests (or raw connections) seen.
    pub requests: AtomicUsize,
    /// Raw and WebSocket connections still being read.
    pub open: AtomicUsize,
    /// Uploads (`POST /early`, `POST /up`) still being read.
    pub uploads_open: AtomicUsize,
    /// The most uploads read at once.
    pub uploads_peak: AtomicUsize,
    /// Uploads read to their end.
    pub uploads_done: AtomicUsize,
    /// Uploads that failed before their end (reset, connection cut).
    pub uploads_cut: AtomicUsize,
}

pub struct FloodOrigin {
    pub addr: SocketAddr,
    /// The origin's CA (PEM), when it speaks TLS.
    pub ca_pem: Option<String>,
    pub counts: Arc<Counts>,
}

impl FloodOrigin {
    pub fn received(&self) -> u64 {
        self.counts.received.load(Ordering::SeqCst)
    }

    /// The bytes received, once every connection and upload the origin was
    /// reading has ended (waits at most 10 s).
    pub async fn received_in_the_end(&self) -> u64 {
        let c = &self.counts;
        for _ in 0..1000 {
            if c.open.load(Ordering::SeqCst) == 0 && c.uploads_open.load(Ordering::SeqCst) == 0 {
                return self.received();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the origin is still reading: the proxy did not close its side");
    }

    /// Waits (at most 10 s) until `done` uploads ended whole and `cut`
    /// ended cut, and nothing is read any more.
    pub async fn wait_uploads(&self, done: usize, cut: usize) {
        let c = &self.counts;
        for _ in 0..1000 {
            if c.uploads_done.load(Ordering::SeqCst) >= done && c.uploads_cut.load(Ordering::SeqCst) >= cut {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "uploads never ended: {} whole (want {done}), {} cut (want {cut})",
            c.uploads_done.load(Ordering::SeqCst),
            c.uploads_cut.load(Ordering::SeqCst)
        );
    }
}

/// Writes `CHUNK`s to `w` until a write fails.
pub async fn pour(mut w: impl AsyncWrite + Unpin) {
    let chunk = vec![b'f'; CHUNK];
    while w.write_all(&chunk).await.is_ok() {}
}

/// Reads `r` to its end (or its first error); returns the bytes read.
pub async fn drain(mut r: impl AsyncRead + Unpin) -> u64 {
    let mut buf = vec![0u8; CHUNK];
    let mut n = 0u64;
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return n,
            Ok(k) => n += k as u64,
        }
    }
}

/// Pours into and drains `s` at once until both stop; returns the bytes read.
pub async fn both_ways<S: AsyncRead + AsyncWrite>(s: S) -> u64 {
    let (r, w) = tokio::io::split(s);
    tokio::join!(drain(r), pour(w)).0
}

/// An origin on `addr` that writes to and reads from every connection at once.
pub async fn raw_flood(addr: &str) -> FloodOrigin {
    let l = TcpListener::bind(addr).await.unwrap();
    let o = FloodOrigin {
        addr: l.local_addr().unwrap(),
        ca_pem: None,
        counts: Arc::default(),
    };
    let counts = o.counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            counts.requests.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(flood_both(s, counts.clone()));
        }
    });
    o
}

/// Counts what `s` brings while pouring into it.
async fn flood_both<S: AsyncRead + AsyncWrite>(s: S, counts: Arc<Counts>) {
    counts.open.fetch_add(1, Ordering::SeqCst);
    let (mut r, w) = tokio::io::split(s);
    let read = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    counts.received.fetch_add(n as u64, Ordering::SeqCst);
                }
            }
        }
    };
    // Either side failing ends both: the proxy cut the connection.
    tokio::select! {
        _ = read => {}
        _ = pour(w) => {}
    }
    counts.open.fetch_sub(1, Ordering::SeqCst);
}

/// How [`http_flood`] speaks.
pub enum Speaks {
    /// Plain HTTP/1.1.
    Http,
    /// HTTPS for `name` (a CA of its own), offering `h2` by ALPN when `h2`.
    Https { name: &'static str, h2: bool },
}

/// An HTTP origin on `addr` with the paths of the module's head.
pub async fn http_flood(addr: &str, speaks: Speaks) -> FloodOrigin {
    let l = TcpListener::bind(addr).await.unwrap();
    let (acceptor, ca_pem) = match speaks {
        Speaks::Http => (None, None),
        Speaks::Https { name, h2 } => {
            let (acceptor, ca) = tls_acceptor(name, h2);
            (Some(acceptor), Some(ca))
        }
    };
    let o = FloodOrigin {
        addr: l.local_addr().unwrap(),
        ca_pem,
        counts: Arc::default(),
    };
    let counts = o.counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = s.set_nodelay(true);
            let (acceptor, counts) = (acceptor.clone(), counts.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| answer(counts.clone(), req));
                let Some(acceptor) = acceptor else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .with_upgrades()
                        .await;
                    return;
                };
                let Ok(tls) = acceptor.accept(s).await else { return };
                if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .with_upgrades()
                        .await;
                }
            });
        }
    });
    o
}

fn full(text: impl Into<Bytes>) -> Body {
    Full::new(text.into()).boxed()
}

/// An upload being read, counted open until dropped.
struct Upload(Arc<Counts>);

impl Upload {
    fn start(counts: &Arc<Counts>) -> Upload {
        let now = counts.uploads_open.fetch_add(1, Ordering::SeqCst) + 1;
        counts.uploads_peak.fetch_max(now, Ordering::SeqCst);
        Upload(counts.clone())
    }

    /// Reads `body` to its end; returns the bytes and whether it ended whole.
    async fn read(self, mut body: Incoming) -> (u64, bool) {
        let mut got = 0u64;
        let whole = loop {
            match body.frame().await {
                None => break true,
                Some(Err(_)) => break false,
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        got += d.len() as u64;
                        self.0.received.fetch_add(d.len() as u64, Ordering::SeqCst);
                    }
                }
            }
        };
        let ended = if whole {
            &self.0.uploads_done
        } else {
            &self.0.uploads_cut
        };
        ended.fetch_add(1, Ordering::SeqCst);
        (got, whole)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        self.0.uploads_open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn answer(counts: Arc<Counts>, mut req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    counts.requests.fetch_add(1, Ordering::SeqCst);
    let websocket = req
        .headers()
        .get(http::header::UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"));
    if websocket {
        let upgrade = hyper::upgrade::on(&mut req);
        let c = counts.clone();
        tokio::spawn(async move {
            if let Ok(u) = upgrade.await {
                flood_both(TokioIo::new(u), c).await;
            }
        });
        let mut r = Response::new(full(""));
        *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = r.headers_mut();
        h.insert(http::header::UPGRADE, "websocket".parse().unwrap());
        h.insert(http::header::CONNECTION, "upgrade".parse().unwrap());
        // Not checked by the proxy; a real client would.
        h.insert("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=".parse().unwrap());
        return Ok(r);
    }
    let path = req.uri().path().to_owned();
    let body = req.into_body();
    Ok(match path.as_str() {
        "/down" => {
            let chunk = Bytes::from(vec![b'd'; CHUNK]);
            let endless = futures_util::stream::repeat_with(move || Ok(Frame::data(chunk.clone())));
            Response::new(StreamBody::new(endless).boxed())
        }
        "/early" => {
            let upload = Upload::start(&counts);
            tokio::spawn(upload.read(body));
            Response::new(full("early"))
        }
        _ => {
            let (got, _) = Upload::start(&counts).read(body).await;
            Response::new(full(format!("got {got}")))
        }
    })
}

/// A TLS acceptor for `name` with a CA of its own (returned as PEM).
fn tls_acceptor(name: &str, h2: bool) -> (tokio_rustls::TlsAcceptor, String) {
    let (config, ca) = crate::tls_origin::test_server_config(&[name], crate::tls_origin::alpn(h2));
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca)
}

/// The tool's TLS inside a CONNECT tunnel `stream` (already answered
/// `200`): trusting `ca_pem` only (the appliance CA), for `name`,
/// offering `h2` by ALPN when `h2` (else HTTP/1.1 only).
pub async fn tls_inside(
    stream: TcpStream,
    ca_pem: &str,
    name: &str,
    h2: bool,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    crate::inside::connect(ca_pem, name, crate::tls_origin::alpn(h2), stream).await
}

/// The request body of [`h2_client`]'s requests: frames sent through a channel.
pub type H2Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// An HTTP/2 client on `tls` (which must have picked `h2`); its connection
/// is driven on a task of its own.
pub async fn h2_client(
    tls: tokio_rustls::client::TlsStream<TcpStream>,
) -> hyper::client::conn::http2::SendRequest<H2Body> {
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(&b"h2"[..]),
        "the proxy did not pick h2"
    );
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// A request body the test feeds by hand: the sender, and the body.
pub fn channel_body() -> (tokio::sync::mpsc::Sender<Bytes>, H2Body) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

/// An endless request body of `CHUNK`s.
pub fn endless_body() -> H2Body {
    let chunk = Bytes::from(vec![b'u'; CHUNK]);
    StreamBody::new(futures_util::stream::repeat_with(move || {
        Ok(Frame::data(chunk.clone()))
    }))
    .boxed()
}

/// Reads a response body to its end (or error); returns the bytes read.
pub async fn drain_body(mut body: Incoming) -> u64 {
    let mut n = 0u64;
    while let Some(Ok(f)) = body.frame().await {
        if let Some(d) = f.data_ref() {
            n += d.len() as u64;
        }
    }
    n
}
