//! Loopback origins for tests: an HTTP origin with a few behaviours chosen
//! by path, a TCP echo server (CONNECT target), a canary that only counts
//! the connections it receives, and a black hole whose accept queue is full
//! so that connects to it hang.

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

pub type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// An HTTP/1.1 origin. Paths:
/// `/` → `hello from origin`; the echoes of [`echo`] (`/headers` and the
/// others); `/slow-head?ms=N` → waits N ms before the head;
/// `/slow-body?ms=N` → head at once, then one chunk every N ms, forever;
/// `/bytes?n=N` → N bytes; `/hop` → a response carrying hop-by-hop headers.
pub struct HttpOrigin {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    heads: Heads,
}

impl HttpOrigin {
    /// Every request head received so far (the first 10 000), as [`head_text`] writes it.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// Request heads an origin received.
pub type Heads = Arc<std::sync::Mutex<Vec<String>>>;

/// Heads kept at most (a benchmark's load keeps only the first).
const MAX_HEADS: usize = 10_000;

/// Records `req`'s head in `heads`.
pub fn record(heads: &Heads, req: &Request<Incoming>) {
    let mut h = heads.lock().unwrap();
    if h.len() < MAX_HEADS {
        h.push(head_text(req));
    }
}

/// `METHOD target`, then one `name: value` line per header (names lower-case).
pub fn head_text(req: &Request<Incoming>) -> String {
    head_lines(req, format!("{} {}\n", req.method(), req.uri()))
}

/// `first`, then one `name: value` line per header of `req`.
fn head_lines(req: &Request<Incoming>, first: String) -> String {
    let mut s = first;
    for (k, v) in req.headers() {
        s.push_str(&format!("{}: {}\n", k, v.to_str().unwrap_or("?")));
    }
    s
}

/// What an origin echoes of the request it was sent, as debug endpoints,
/// error pages and redirects do (for credential scrubbing tests); `None`
/// for other requests. `key` below is the `Authorization` value received.
/// - `TRACE` (any path): the request head, `message/http`;
/// - `/headers`: the request head as received, its first line `METHOD
///   target HTTP/1.1` (`?chunk=N`: in N-byte frames);
/// - `/reflect`: `302` with `Location: /next?<query>`, `Set-Cookie:
///   auth=<key>`, `X-Echo-<key>: 1` (a name made of the key, when it is
///   one), `X-Echo: <key>`, a reason phrase quoting the key, and a JSON body
///   `{"authorization": <key with / escaped>, "query": <query>}`;
/// - `/error`: `401` with `invalid key: <key>`, chunked;
/// - `/sse?n=N&ms=M`: `text/event-stream`, N events `data: <key>`, one every
///   M ms, each in a frame of its own;
/// - `/gzip`: a body in `Content-Encoding: gzip`.
pub fn echo(req: &Request<Incoming>) -> Option<Response<Body>> {
    let key = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    if req.method() == http::Method::TRACE {
        return Some(
            Response::builder()
                .header("content-type", "message/http")
                .body(full(head_text(req)))
                .unwrap(),
        );
    }
    let chunked = |parts: Vec<Bytes>, ms: u64| {
        let stream = futures_util::stream::iter(parts.into_iter().enumerate()).then(move |(i, b)| async move {
            if i > 0 && ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Ok::<_, Infallible>(Frame::data(b))
        });
        BodyExt::boxed(StreamBody::new(stream))
    };
    Some(match req.uri().path() {
        "/headers" => {
            let first = format!("{} {} {:?}\n", req.method(), req.uri(), req.version());
            let text = Bytes::from(head_lines(req, first));
            let n = (param(req, "chunk") as usize).max(1).min(text.len().max(1));
            if param(req, "chunk") == 0 {
                Response::new(full(text))
            } else {
                let parts = text.chunks(n).map(Bytes::copy_from_slice).collect();
                Response::new(chunked(parts, 0))
            }
        }
        "/reflect" => {
            let mut r = Response::builder()
                .status(StatusCode::FOUND)
                .header("location", format!("/next?{query}"))
                .header("set-cookie", format!("auth={key}; Path=/"))
                .header("x-echo", &key);
            if let Ok(name) = http::HeaderName::from_bytes(format!("x-echo-{}", key.to_ascii_lowercase()).as_bytes()) {
                r = r.header(name, "1");
            }
            if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(format!("Found {key}").into_bytes()) {
                r = r.extension(reason);
            }
            let body = serde_json::json!({ "authorization": key, "query": query })
                .to_string()
                .replace('/', "\\/");
            r.body(full(body)).unwrap()
        }
        "/error" => Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .body(chunked(vec![Bytes::from("invalid key: "), Bytes::from(key)], 0))
            .unwrap(),
        "/sse" => {
            let events = (0..param(req, "n"))
                .map(|i| Bytes::from(format!("id: {i}\ndata: {key}\n\n")))
                .collect();
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(chunked(events, param(req, "ms")))
                .unwrap()
        }
        "/gzip" => Response::builder()
            .header("content-encoding", "gzip")
            .body(full(format!("not really gzip: {key}")))
            .unwrap(),
        _ => return None,
    })
}

fn param(req: &Request<Incoming>, key: &str) -> u64 {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into()).map_err(|e| match e {}).boxed()
}

async fn serve_origin(req: Request<Incoming>, heads: Heads) -> Result<Response<Body>, Infallible> {
    record(&heads, &req);
    if let Some(r) = echo(&req) {
        return Ok(r);
    }
    let path = req.uri().path().to_owned();
    let resp = match path.as_str() {
        "/slow-head" => {
            tokio::time::sleep(Duration::from_millis(param(&req, "ms"))).await;
            Response::new(full("slow head"))
        }
        "/slow-body" => {
            let ms = param(&req, "ms").max(1);
            let stream = futures_util::stream::unfold(0u64, move |i| async move {
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Some((Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"tick\n"))), i + 1))
            });
            Response::new(BodyExt::boxed(StreamBody::new(stream)))
        }
        "/bytes" => Response::new(full(vec![b'x'; param(&req, "n") as usize])),
        "/hop" => Response::builder()
            .header("connection", "x-secret-hop")
            .header("x-secret-hop", "leak")
            .header("keep-alive", "timeout=5")
            .header("proxy-authenticate", "Basic realm=origin")
            .header("x-kept", "yes")
            .body(full("hop"))
            .unwrap(),
        "/" => Response::new(full("hello from origin")),
        _ => Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(full("not found"))
            .unwrap(),
    };
    Ok(resp)
}

/// Starts an HTTP origin on `ip:port` (port 0 = any).
pub async fn http_origin(addr: &str) -> HttpOrigin {
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let heads = Heads::default();
    let (h, recorded) = (hits.clone(), heads.clone());
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            h.fetch_add(1, Ordering::SeqCst);
            let recorded = recorded.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| serve_origin(req, recorded.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    HttpOrigin { addr, hits, heads }
}

/// A TCP server that echoes what it reads; counts connections.
pub async fn echo_origin(addr: &str) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            n2.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => {
                            let _ = s.shutdown().await;
                            return;
                        }
                        Ok(k) => {
                            if s.write_all(&buf[..k]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, n)
}

/// A TCP server that speaks first (as SMTP, SSH or MySQL servers do): it
/// writes `banner` on each connection, then echoes what it reads; counts
/// connections.
pub async fn banner_origin(addr: &str, banner: &'static [u8]) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            n2.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if s.write_all(banner).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, n)
}

/// A listener that accepts and counts connections, then closes them.
pub struct Canary {
    pub addr: SocketAddr,
    pub count: Arc<AtomicUsize>,
}

impl Canary {
    pub fn connections(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

pub async fn canary(addr: &str) -> Canary {
    let l = TcpListener::bind(addr).await.unwrap();
    let addr = l.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            c.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    Canary { addr, count }
}

/// A listener whose accept queue is full: new connects hang (SYNs are dropped).
pub struct BlackHole {
    pub addr: SocketAddr,
    _listener: TcpListener,
    _fill: Vec<TcpStream>,
}

pub async fn black_hole(ip: &str) -> BlackHole {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    let listener = sock.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fill = vec![];
    // Fill the accept queue; once full, further SYNs are dropped.
    for _ in 0..8 {
        match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
            Ok(Ok(s)) => fill.push(s),
            _ => break,
        }
    }
    BlackHole {
        addr,
        _listener: listener,
        _fill: fill,
    }
}

/// A port that is free on every one of `ips` (for servers that must share a
/// port across loopback addresses, e.g. an origin and a canary).
pub fn port_free_on(ips: &[&str]) -> u16 {
    loop {
        let first = std::net::TcpListener::bind(format!("{}:0", ips[0])).unwrap();
        let port = first.local_addr().unwrap().port();
        let rest: Vec<_> = ips[1..]
            .iter()
            .map(|ip| std::net::TcpListener::bind(format!("{ip}:{port}")))
            .collect();
        if rest.iter().all(Result::is_ok) {
            return port;
        }
    }
}

/// A raw HTTP/1.1 origin for upload tests. It records each request line and
/// counts the request-body bytes it receives. Paths: `/early` answers at once
/// with a 1 GiB body (written as fast as the peer reads) while it keeps
/// reading the request; `/early-small` answers at once with a short complete
/// body and keeps reading; anything else reads the whole body (by
/// `Content-Length`) and then answers `got N`.
pub struct UploadOrigin {
    pub addr: SocketAddr,
    /// Request-body bytes received, across all connections.
    pub received: Arc<std::sync::atomic::AtomicU64>,
    /// Requests currently being received (their connection still open).
    pub active: Arc<AtomicUsize>,
    /// The most requests ever received at once.
    pub peak: Arc<AtomicUsize>,
    pub request_lines: Arc<std::sync::Mutex<Vec<String>>>,
}

pub async fn upload_origin(addr: &str) -> UploadOrigin {
    let l = TcpListener::bind(addr).await.unwrap();
    let o = UploadOrigin {
        addr: l.local_addr().unwrap(),
        received: Arc::default(),
        active: Arc::default(),
        peak: Arc::default(),
        request_lines: Arc::default(),
    };
    let (received, active, peak, lines) = (
        o.received.clone(),
        o.active.clone(),
        o.peak.clone(),
        o.request_lines.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (received, active, peak, lines) = (received.clone(), active.clone(), peak.clone(), lines.clone());
            tokio::spawn(async move {
                let (mut rd, mut wr) = s.into_split();
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match rd.read(&mut b).await {
                        Ok(1) => head.push(b[0]),
                        _ => return,
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let line = text.lines().next().unwrap_or("").to_owned();
                lines.lock().unwrap().push(line.clone());
                let len: u64 = text
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                let writer = match path.as_str() {
                    "/early" => Some(tokio::spawn(async move {
                        let _ = wr
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
                            .await;
                        let chunk = vec![b'd'; 64 * 1024];
                        while wr.write_all(&chunk).await.is_ok() {}
                    })),
                    "/early-small" => {
                        let _ = wr.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nearly").await;
                        None
                    }
                    _ => {
                        let mut got = 0u64;
                        let mut buf = vec![0u8; 64 * 1024];
                        while got < len {
                            match rd.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    got += n as u64;
                                    received.fetch_add(n as u64, Ordering::SeqCst);
                                }
                            }
                        }
                        let body = format!("got {got}");
                        let _ = wr
                            .write_all(
                                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes(),
                            )
                            .await;
                        active.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                };
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match rd.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            received.fetch_add(n as u64, Ordering::SeqCst);
                        }
                    }
                }
                active.fetch_sub(1, Ordering::SeqCst);
                if let Some(w) = writer {
                    w.abort();
                }
            });
        }
    });
    o
}
