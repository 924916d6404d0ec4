//! Step 8 for an intercepted CONNECT: a CONNECT of a tool to one of its
//! credential hosts, or any CONNECT of an `inspect` tool
//! ([`policy::intercepts`](crate::data::decide::policy::intercepts)).
//!
//! The origin's TLS is already open and verified when the session starts
//! (`Fetch::intercept`). The session then terminates the tool's TLS with a
//! leaf of the appliance CA for the CONNECT host — after checking that the
//! ClientHello's server name (SNI), when there is one, is that host — and
//! serves HTTP/1.1 or, when the tool picks it by ALPN, HTTP/2 inside
//! ([`h2`]: its bounds, and what each stream holds): each request, or
//! each stream, is decided again
//! ([`fetch::decide_inside`]: run, allowlist, methods, `Host`, credential
//! misuse), gets the tool's credentials for this host written in
//! ([`inject`]), and goes out to the pinned address: over HTTP/2 when the
//! origin picked it by ALPN (every stream on one connection), else over
//! HTTP/1.1 (one connection per request in flight, dialled again when the
//! origin closed it; a WebSocket handshake always on HTTP/1.1). Its
//! response comes back scrubbed of them ([`scrub`]), with its trailers, or
//! refused when what it relays is not what the scrubber reads
//! ([`relayed`](crate::data::carry::relayed): an `unscrubbable` fact, the same on
//! every stream and whichever protocol the origin speaks).
//! An HTTP/2 stream also holds one of the run's slots and has its own
//! deadline, like any fetch. Bytes are counted
//! as the tool's TLS bytes; the idle timeout, the fetch deadline, the run's
//! end and shutdown bound the session like a tunnel, and the slot is held
//! until it is over. Then the session's upstream connections that finished
//! their last exchange go to the run's pool (`runs::pool`), where the run's
//! next intercepted CONNECT to the same name takes one up instead of
//! dialling and handshaking again.

use crate::ca;
use crate::data::carry::body::ProxyBody;
use crate::data::carry::finish::Finish;
use crate::data::carry::forward::strip_hop_by_hop;
use crate::data::carry::inject;
use crate::data::carry::prefixed::Prefixed;
use crate::data::carry::resign;
use crate::data::carry::respond;
use crate::data::carry::scrub::{self, Scrubbed};
use crate::data::carry::tunnel::{upgraded, Bounds, Client, Meter, Metered};
use crate::data::carry::upstream;
use crate::data::carry::websocket;
use crate::data::decide::fetch;
use crate::data::decide::target::{server_name_is, Target};
use crate::data::entrance::h2::{self, Held, Hold, StreamSlot};
use crate::data::entrance::mcp;
use crate::deny::{DenyReason, FetchError, Via};
use crate::runs::pool::{Conn, Dialled, H2Conn, UpBody};
use crate::runs::slots::{self, Slot, SlotError};
use crate::runs::Run;
use crate::state::Shared;
use arc_swap::ArcSwapOption;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt as _, Either};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A response inside the session: the origin's (scrubbed of the
/// credentials written into its request; for a stream, holding its slot
/// and bounded by its deadline), or the proxy's own.
type Answer = Response<Either<Held<Scrubbed<Incoming>>, ProxyBody>>;

/// An upstream error: what it counts as, and its detail.
type UpError = (FetchError, String);

/// Idle HTTP/1.1 connections kept for the streams of a tool's HTTP/2
/// connection bridged to an HTTP/1.1 origin.
const SPARE_CONNS: usize = 8;

/// The origin's side of a session as the CONNECT opened it.
pub enum OriginConn {
    /// A new TLS connection, verified, to the vetted address it was dialled to.
    Fresh(Box<tokio_rustls::client::TlsStream<TcpStream>>, SocketAddr),
    /// An idle connection of the run's pool, verified for the same name, to
    /// an address in this CONNECT's vetted set; HTTP already spoken on it.
    Pooled(Dialled),
}

pub struct Session {
    pub sh: Arc<Shared>,
    pub run: Arc<Run>,
    /// The CONNECT target.
    pub target: Target,
    pub client: Client,
    pub upstream: OriginConn,
    pub slot: Slot,
    pub deadline: Instant,
    pub finish: Finish,
}

/// Runs an intercepted CONNECT to completion. Spawned after the success
/// answer (`200`, or SOCKS5's) is queued.
pub async fn run(s: Session) {
    let Session {
        sh,
        run,
        target,
        client,
        upstream,
        slot,
        deadline,
        finish,
    } = s;
    // The CONNECT's `slot` is held by the session (until its end, below);
    // one stream at a time may use it (`Origin::own`), others take slots
    // of their own.
    let meter = Arc::new(Meter::new(&finish));
    let budget_cut = finish.budget_cut();
    let closed = CancellationToken::new();
    let _closed = closed.clone().drop_guard();
    let addr = match &upstream {
        OriginConn::Fresh(_, addr) => *addr,
        OriginConn::Pooled(c) => c.addr(),
    };
    let origin = Arc::new(Origin {
        sh: sh.clone(),
        run: run.clone(),
        target,
        addr,
        h1: tokio::sync::Mutex::new(None),
        h2: ArcSwapOption::empty(),
        spare: Arc::new(std::sync::Mutex::new(Vec::new())),
        own: Arc::new(Semaphore::new(1)),
        closed,
        switched: std::sync::Mutex::new(None),
        finish,
    });
    let bounds = Bounds {
        deadline,
        idle: sh.cfg.tunnel_idle_timeout,
        cancel: &run.cancel,
        shutdown: &sh.hard_stop,
        budget: budget_cut.as_ref(),
    };
    match client {
        Client::Upgrade(upgrade) => {
            let Some(client) = upgraded(upgrade, deadline, &run.cancel, &origin.finish).await else {
                return;
            };
            let io = Metered::client(TokioIo::new(client), &meter);
            bounds.watch(origin.serve(io, upstream), &meter, &origin.finish).await;
        }
        Client::Tcp(client, early) => {
            let io = Metered::client(Prefixed::new(early, client), &meter);
            bounds.watch(origin.serve(io, upstream), &meter, &origin.finish).await;
        }
    }
    meter.close(&origin.finish);
    // The slot is free before the give-back, which may wait (briefly) for
    // an upstream connection to finish its last message.
    drop(slot);
    origin.give_back().await;
}

/// The `Host` header sent to an HTTPS origin (and an HTTP/2 `:authority`).
fn host_header(t: &Target) -> String {
    if t.port == 443 {
        t.host.to_string()
    } else {
        t.to_string()
    }
}

/// The origin side of one session.
struct Origin {
    sh: Arc<Shared>,
    run: Arc<Run>,
    target: Target,
    addr: SocketAddr,
    /// The HTTP/1.1 connection of a tool speaking HTTP/1.1 (`None` until
    /// the first handshake, or after a redial failed), and of a WebSocket
    /// handshake.
    h1: tokio::sync::Mutex<Option<Conn>>,
    /// The HTTP/2 connection, when the origin picked `h2`: every request
    /// (but a WebSocket handshake) goes out on a clone of its sender.
    h2: ArcSwapOption<H2Conn>,
    /// Idle HTTP/1.1 connections for the streams of a tool speaking HTTP/2
    /// to an origin that does not.
    spare: Arc<std::sync::Mutex<Vec<Conn>>>,
    /// The session's own slot, for one stream at a time.
    own: Arc<Semaphore>,
    /// Cancelled when the session is over.
    closed: CancellationToken,
    /// A WebSocket handshake the origin switched protocols for: joined
    /// once the tool's connection is upgraded.
    switched: std::sync::Mutex<Option<Switched>>,
    finish: Finish,
}

/// Both sides of a switched WebSocket, waiting for their upgrades.
struct Switched {
    client: hyper::upgrade::OnUpgrade,
    origin: hyper::upgrade::OnUpgrade,
    rewrite: Option<websocket::Rewrite>,
}

impl Origin {
    /// A refusal after the request was counted ([`fetch::refuse_answer`]):
    /// its fact, then its answer.
    async fn refuse(&self, target: &Target, json: bool, reason: DenyReason, detail: String) -> Answer {
        let r = fetch::refuse_answer(&self.sh, &self.run, target, Via::Http, json, reason, detail).await;
        respond::refused(r).map(Either::Right)
    }

    /// The tool's TLS, then HTTP/1.1 or HTTP/2 inside it until the tool is done.
    async fn serve<IO>(self: &Arc<Self>, io: IO, upstream: OriginConn) -> io::Result<()>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io).await?;
        if let Some(sni) = start.client_hello().server_name() {
            if !server_name_is(&self.target.host, sni) {
                let sni = sni.to_owned();
                fetch::deny_sni(&self.sh, &self.run, &self.target, &sni).await;
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, "host_mismatch"));
            }
        }
        let hello = start.client_hello();
        let config = self.sh.ca.load().server_config(&self.target.host, hello.server_name());
        let config = config.map_err(|e| {
            tracing::error!(error = %e, dest = %self.target, "cannot issue a leaf certificate");
            io::Error::other(e.to_string())
        })?;
        let tls = start.into_stream(config).await?;
        let tool_h2 = ca::alpn_h2(tls.get_ref().1);
        let upstream = match upstream {
            OriginConn::Fresh(tls, _) => self.handshake(*tls).await.map_err(|(_, e)| io::Error::other(e))?,
            OriginConn::Pooled(conn) => conn,
        };
        match upstream {
            Dialled::H2(c) => self.h2.store(Some(Arc::new(c))),
            Dialled::H1(c) if tool_h2 => self.keep_spare(c),
            Dialled::H1(c) => *self.h1.lock().await = Some(c),
        }
        if tool_h2 {
            return self.serve_h2(tls).await;
        }
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.sh.cfg.header_read_timeout)
            .max_buf_size(self.sh.cfg.max_header_bytes.max(8192) + 1024)
            .max_header_size(self.sh.cfg.max_header_bytes)
            .max_headers(128)
            .keep_alive(true);
        let service = hyper::service::service_fn(|req| self.exchange(req, false));
        let served = builder
            .serve_connection(TokioIo::new(tls), service)
            .with_upgrades()
            .await;
        let switched = self.switched.lock().ok().and_then(|mut s| s.take());
        let Some(ws) = switched else {
            return served.map_err(io::Error::other);
        };
        // The origin's side first, while its connection is held (dropping
        // it would stop the driver before it hands the connection over).
        // The session's bounds (deadline, idle, run end) and its meter on
        // the tool's TLS cover the relay.
        let origin = ws.origin.await.map_err(io::Error::other);
        *self.h1.lock().await = None;
        let client = ws.client.await.map_err(io::Error::other)?;
        websocket::relay(TokioIo::new(client), TokioIo::new(origin?), ws.rewrite, &self.finish).await
    }

    /// HTTP/2 with the tool, within [`H2_BOUNDS`](crate::data::carry::upstream::H2_BOUNDS): each stream is
    /// one [`Origin::exchange`], on a task that ends with the session.
    async fn serve_h2<IO>(self: &Arc<Self>, tls: tokio_rustls::server::TlsStream<IO>) -> io::Result<()>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let exec = h2::SessionExec {
            cut: self.closed.clone(),
        };
        let me = self.clone();
        let service = hyper::service::service_fn(move |req| {
            let me = me.clone();
            async move { me.exchange(req, true).await }
        });
        h2::server(self.sh.cfg.max_header_bytes, exec)
            .serve_connection(TokioIo::new(tls), service)
            .await
            .map_err(io::Error::other)
    }

    /// One request inside the session (`stream`: an HTTP/2 stream).
    async fn exchange(&self, mut req: Request<Incoming>, stream: bool) -> Result<Answer, Infallible> {
        let inside = match fetch::decide_inside(&self.sh, &self.run, &self.target, &req).await {
            Ok(i) => i,
            Err(answer) => return Ok(early(answer.into(), req, stream).await),
        };
        // Step 5 for a stream: a slot of its own, within its own deadline.
        let hold = if stream {
            let deadline = Instant::now() + inside.fetch_timeout;
            match self.stream_slot(&inside.target, deadline).await {
                Ok(slot) => Some(Hold { slot, deadline }),
                Err(answer) => return Ok(early(answer, req, stream).await),
            }
        } else {
            None
        };
        inside.allowed.count();
        let client_upgrade = inside.websocket.then(|| hyper::upgrade::on(&mut req));
        let (parts, body) = req.into_parts();
        let method = parts.method.clone();
        let json = crate::data::decide::refusal::accepts_json(&parts.headers);
        let mut headers = parts.headers;
        // `TE: trailers` is the one TE an HTTP/2 request carries (gRPC
        // requires it); it goes on to an HTTP/2 origin.
        let te_trailers = headers
            .get_all(header::TE)
            .iter()
            .any(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
        strip_hop_by_hop(&mut headers);
        if inside.websocket {
            websocket::handshake_headers(&mut headers, websocket::reads_frames(inside.credentials.as_ref()));
        }
        if let Ok(v) = HeaderValue::from_str(&host_header(&self.target)) {
            headers.insert(header::HOST, v);
        }
        let mut pq = inside
            .target
            .path_and_query
            .clone()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        if let Some(inj) = &inside.credentials {
            inject::write(inj, &self.run, &mut headers, &mut pq);
        }
        // A stream's slot and deadline are held by both its directions:
        // the request body on its way to the origin, and the response.
        let deadline = hold.as_ref().map(|h| h.deadline);
        let (up_half, down_half) = match hold {
            Some(h) => {
                let (u, d) = h.split();
                (Some(u), Some(d))
            }
            None => (None, None),
        };
        // A tool with MCP rules: its JSON-RPC is decided before it goes on,
        // read (and a list answer filtered) within the fetch deadline.
        let mut list = None;
        let read_by = deadline.unwrap_or_else(|| Instant::now() + inside.fetch_timeout);
        let body = match inside.mcp.as_deref().filter(|_| mcp::applies(&method, &headers)) {
            Some(tool) => match mcp::request(&self.sh, &self.run, tool, &mut headers, body, read_by).await {
                Ok((bytes, l)) => {
                    list = l;
                    Either::Right(http_body_util::Full::new(bytes))
                }
                Err(answer) => return Ok(answer.map(Either::Right)),
            },
            None => Either::Left(body),
        };
        // A signing credential's request is signed once its body's hash is
        // known: read whole when the tool named none.
        let signing = inside.credentials.as_ref().and_then(|inj| {
            inj.creds
                .iter()
                .filter_map(|&i| inj.tool.credentials.get(i))
                .find_map(|c| Some((c, c.sign.as_deref()?)))
        });
        let body = match signing {
            Some((cred, sign)) => match resign::sign(cred, sign, &method, &mut headers, &pq, body, read_by).await {
                Ok(b) => b,
                Err(e) => {
                    let detail = format!(
                        "{}: credential {} could not sign the request: {e}",
                        self.target, cred.name
                    );
                    return Ok(self
                        .refuse(&inside.target, json, DenyReason::SignatureUnsupported, detail)
                        .await);
                }
            },
            None => resign::Resigned::Pass(body),
        };
        let mut up = Request::new(Held::new(body, up_half).boxed_unsync());
        *up.method_mut() = parts.method;
        *up.version_mut() = Version::HTTP_11;
        *up.headers_mut() = headers;
        *up.uri_mut() = http::Uri::from(pq);
        let sent = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, self.send(up, inside.websocket, stream, te_trailers))
                .await
                .unwrap_or_else(|_| {
                    Err((
                        FetchError::Timeout,
                        "no response before the stream's fetch deadline".into(),
                    ))
                }),
            None => self.send(up, inside.websocket, stream, te_trailers).await,
        };
        match sent {
            Ok(resp) if client_upgrade.is_some() && resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                Ok(self.switch(resp, client_upgrade, inside, json).await)
            }
            Ok(resp) => {
                let (mut parts, mut body) = resp.into_parts();
                // Scrubbed (or refused) on the head as received: its
                // framing headers say what the body relays.
                let injected = inside.credentials.as_ref().map(|c| &c.tool);
                let scrub = match scrub::response(
                    &self.sh, injected, &self.run, &method, &mut parts, &mut body, deadline,
                )
                .await
                {
                    Ok(s) => s,
                    Err(e) => {
                        let detail = format!("{}: {e}", self.target);
                        return Ok(self
                            .refuse(&inside.target, json, DenyReason::Unscrubbable, detail)
                            .await);
                    }
                };
                strip_hop_by_hop(&mut parts.headers);
                parts.version = if stream { Version::HTTP_2 } else { Version::HTTP_11 };
                if let (Some(list), Some(tool)) = (&list, inside.mcp.as_deref()) {
                    let body = Held::new(Scrubbed::new(body, scrub), down_half);
                    let filtered = match mcp::filter(tool, list, &mut parts.headers, body, read_by).await {
                        Ok(bytes) => ProxyBody::text(bytes),
                        Err(e) => {
                            parts.status = StatusCode::OK;
                            parts.headers.clear();
                            parts
                                .headers
                                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                            ProxyBody::text(e.to_string())
                        }
                    };
                    return Ok(Response::from_parts(parts, Either::Right(filtered)));
                }
                tracing::info!(
                    target: "egress::fetch",
                    run = %self.run.id,
                    tool = %self.run.tool,
                    kind = "intercepted",
                    dest = %self.target,
                    method = %method,
                    status = parts.status.as_u16(),
                    injected = inside.credentials.is_some(),
                    h2 = stream,
                    "request inside an intercepted tunnel"
                );
                Ok(Response::from_parts(
                    parts,
                    Either::Left(Held::new(Scrubbed::new(body, scrub), down_half)),
                ))
            }
            Err((e, detail)) => {
                self.sh.count_error(&self.run.tool, e);
                Ok(respond::error(e, &format!("{}: {detail}", self.target)).map(Either::Right))
            }
        }
    }

    /// The slot of a stream: the session's own when no other stream holds
    /// it, else one of the run's (FIFO, `concurrency_limit` past the
    /// queue bound), whichever frees first within the stream's deadline.
    async fn stream_slot(&self, target: &Target, deadline: Instant) -> Result<StreamSlot, Response<ProxyBody>> {
        if let Ok(p) = self.own.clone().try_acquire_owned() {
            return Ok(StreamSlot::Session(p));
        }
        let gauge = self.sh.tool_metrics(Some(&self.run.tool)).slots_in_use.clone();
        let ended = || respond::error(FetchError::RunEnded, &format!("run {} ended", self.run.id));
        tokio::select! {
            p = self.own.clone().acquire_owned() => p.map(StreamSlot::Session).map_err(|_| ended()),
            r = slots::acquire(&self.run, gauge) => match r {
                Ok(s) => Ok(StreamSlot::Run(s)),
                Err(SlotError::QueueFull) => {
                    let detail = format!(
                        "run {} already has {} fetches open and {} waiting (an HTTP/2 stream to {target})",
                        self.run.id, self.run.max_slots, self.run.max_waiting
                    );
                    Err(fetch::deny_inside(&self.sh, &self.run, target, DenyReason::ConcurrencyLimit, detail).await.into())
                }
                Err(SlotError::Closed) => Err(ended()),
            },
            _ = tokio::time::sleep_until(deadline) => {
                self.sh.count_error(&self.run.tool, FetchError::Timeout);
                Err(respond::error(FetchError::Timeout, &format!("{target}: no slot of run {} freed before the stream's fetch deadline", self.run.id)))
            }
        }
    }

    /// The origin switched protocols for a WebSocket handshake: its `101`
    /// goes to the tool with its headers as they came (scrubbed of the
    /// secret); [`Origin::serve`] joins both sides once upgraded. A `101`
    /// whose frames the proxy could not read (an extension it did not
    /// offer, when it reads them) is refused like an unreadable answer.
    async fn switch(
        &self,
        mut resp: Response<Incoming>,
        client: Option<hyper::upgrade::OnUpgrade>,
        inside: fetch::Inside,
        json: bool,
    ) -> Answer {
        let origin = hyper::upgrade::on(&mut resp);
        let (mut parts, mut body) = resp.into_parts();
        let injected = inside.credentials.as_ref();
        let rewrite = websocket::reads_frames(injected);
        let checked = scrub::response(
            &self.sh,
            injected.map(|c| &c.tool),
            &self.run,
            &http::Method::GET,
            &mut parts,
            &mut body,
            None,
        )
        .await
        .and_then(|_| websocket::check_accepted(rewrite, &parts.headers));
        if let Err(e) = checked {
            let detail = format!("{}: {e}", self.target);
            return self
                .refuse(&inside.target, json, DenyReason::Unscrubbable, detail)
                .await;
        }
        let Some(client) = client else {
            self.sh.count_error(&self.run.tool, FetchError::UpstreamFailed);
            let e = "the tool's side of the upgrade is gone";
            return respond::error(FetchError::UpstreamFailed, &format!("{}: {e}", self.target)).map(Either::Right);
        };
        tracing::info!(
            target: "egress::fetch",
            run = %self.run.id,
            tool = %self.run.tool,
            kind = "intercepted",
            dest = %self.target,
            method = "GET",
            status = 101,
            injected = injected.is_some(),
            rewrite,
            "WebSocket inside an intercepted tunnel"
        );
        let rewrite = websocket::Rewrite::new(&self.sh, &self.run, &inside.target, injected);
        if let Ok(mut s) = self.switched.lock() {
            *s = Some(Switched {
                client,
                origin,
                rewrite,
            });
        }
        Response::from_parts(parts, Either::Right(ProxyBody::empty()))
    }

    /// Sends `req` (origin-form, HTTP/1.1 as built by
    /// [`Origin::exchange`]) to the origin: on its HTTP/2 connection when it
    /// has one (but a WebSocket handshake, `websocket`, which stays on
    /// HTTP/1.1), else on an HTTP/1.1 connection: the session's one for a
    /// tool on HTTP/1.1, a spare one per request in flight for a tool's
    /// HTTP/2 `stream`s.
    async fn send(
        &self,
        req: Request<UpBody>,
        websocket: bool,
        stream: bool,
        te_trailers: bool,
    ) -> Result<Response<Incoming>, UpError> {
        if !websocket {
            if let Some(mut sender) = self.h2_sender().await? {
                let req = for_h2(req, &self.target, te_trailers)?;
                return sender
                    .send_request(req)
                    .await
                    .map_err(|e| (FetchError::UpstreamFailed, e.to_string()));
            }
            if stream {
                return self.send_spare(req).await;
            }
        }
        self.send_h1(req).await
    }

    /// A sender on the origin's HTTP/2 connection, dialled again when the
    /// origin closed it (`None`: the origin speaks HTTP/1.1, or no longer
    /// picked `h2`). No lock: a clone of the sender per request.
    async fn h2_sender(&self) -> Result<Option<hyper::client::conn::http2::SendRequest<UpBody>>, UpError> {
        let Some(conn) = self.h2.load_full() else {
            return Ok(None);
        };
        let mut sender = conn.sender.clone();
        if sender.ready().await.is_ok() {
            return Ok(Some(sender));
        }
        match self.dial(false).await? {
            Dialled::H2(c) => {
                let sender = c.sender.clone();
                self.h2.store(Some(Arc::new(c)));
                Ok(Some(sender))
            }
            Dialled::H1(c) => {
                self.h2.store(None);
                self.keep_spare(c);
                Ok(None)
            }
        }
    }

    /// Sends on the session's HTTP/1.1 connection; when the origin has
    /// closed it, on a new one to the same vetted address.
    async fn send_h1(&self, req: Request<UpBody>) -> Result<Response<Incoming>, UpError> {
        let mut slot = self.h1.lock().await;
        let ready = match slot.as_mut() {
            Some(c) => c.sender.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            *slot = Some(match self.take_spare() {
                Some(c) => c,
                None => self.dial_h1().await?,
            });
        }
        let Some(conn) = slot.as_mut() else {
            return Err((FetchError::UpstreamFailed, "no upstream connection".into()));
        };
        match conn.sender.try_send_request(req).await {
            Ok(r) => Ok(r),
            Err(mut e) => {
                let Some(req) = e.take_message() else {
                    return Err((FetchError::UpstreamFailed, e.into_error().to_string()));
                };
                // Closed before the request went out: once more, afresh.
                let mut fresh = self.dial_h1().await?;
                let r = fresh.sender.send_request(req).await;
                *slot = Some(fresh);
                r.map_err(|e| (FetchError::UpstreamFailed, e.to_string()))
            }
        }
    }

    /// Sends one stream's request on a spare HTTP/1.1 connection (or a new
    /// one), kept again for the next stream once its response is over.
    async fn send_spare(&self, req: Request<UpBody>) -> Result<Response<Incoming>, UpError> {
        let mut conn = match self.take_spare() {
            Some(c) => c,
            None => self.dial_h1().await?,
        };
        let resp = match conn.sender.try_send_request(req).await {
            Ok(r) => r,
            Err(mut e) => {
                let Some(req) = e.take_message() else {
                    return Err((FetchError::UpstreamFailed, e.into_error().to_string()));
                };
                conn = self.dial_h1().await?;
                conn.sender
                    .send_request(req)
                    .await
                    .map_err(|e| (FetchError::UpstreamFailed, e.to_string()))?
            }
        };
        let (spare, closed) = (self.spare.clone(), self.closed.clone());
        tokio::spawn(async move {
            tokio::select! {
                r = conn.sender.ready() => if r.is_ok() {
                    if let Ok(mut s) = spare.lock() {
                        if s.len() < SPARE_CONNS {
                            s.push(conn);
                        }
                    }
                },
                _ = closed.cancelled() => {}
            }
        });
        Ok(resp)
    }

    /// An idle, ready spare connection, if any.
    fn take_spare(&self) -> Option<Conn> {
        let mut s = self.spare.lock().ok()?;
        while let Some(c) = s.pop() {
            if c.sender.is_ready() {
                return Some(c);
            }
        }
        None
    }

    fn keep_spare(&self, c: Conn) {
        if let Ok(mut s) = self.spare.lock() {
            s.push(c);
        }
    }

    /// The session is over: its upstream connections that finished their
    /// last exchange go to the run's pool, for the run's next intercepted
    /// CONNECT to this name (a switched WebSocket's connection is gone
    /// already). Never to another run: the pool is the run's own, and its
    /// connections' drivers stop when the run ends.
    async fn give_back(&self) {
        let mut conns: Vec<Dialled> = Vec::new();
        if let Some(c) = self.h1.lock().await.take() {
            conns.push(Dialled::H1(c));
        }
        if let Some(c) = self.h2.swap(None).and_then(|c| Arc::try_unwrap(c).ok()) {
            conns.push(Dialled::H2(c));
        }
        if let Ok(mut spare) = self.spare.lock() {
            conns.extend(spare.drain(..).map(Dialled::H1));
        }
        for c in conns {
            self.run
                .upstream
                .give_back_verified(&self.target.host, c, &self.run.cancel)
                .await;
        }
    }

    /// The handshake on a verified TLS stream to the origin, in the
    /// protocol it picked by ALPN.
    async fn handshake(&self, tls: tokio_rustls::client::TlsStream<TcpStream>) -> Result<Dialled, UpError> {
        let (run_end, stop) = (self.run.cancel.clone(), self.sh.hard_stop.clone());
        if ca::alpn_h2(tls.get_ref().1) {
            return upstream::handshake_h2(tls, self.addr, run_end, stop)
                .await
                .map(Dialled::H2)
                .map_err(|e| (FetchError::UpstreamFailed, e.to_string()));
        }
        upstream::handshake(tls, self.addr, run_end, stop)
            .await
            .map(Dialled::H1)
            .map_err(|e| (FetchError::UpstreamFailed, e.to_string()))
    }

    /// A new verified TLS connection to the pinned address, offering `h2`
    /// unless `h1_only`.
    async fn dial(&self, h1_only: bool) -> Result<Dialled, UpError> {
        let addr = self.addr;
        let s = self
            .sh
            .dialer
            .dial(addr)
            .await
            .map_err(|e| (FetchError::ConnectFailed, format!("{addr}: {e}")))?;
        let ca = self.sh.ca.load_full();
        let tls = if h1_only {
            ca.connect_h1(&self.target.host, s).await
        } else {
            ca.connect(&self.target.host, s).await
        };
        let tls = tls.map_err(|e| (FetchError::UpstreamTls, format!("{addr}: {e}")))?;
        self.sh.metrics.upstream_tls_done(tls.get_ref().1);
        self.handshake(tls).await
    }

    /// A new HTTP/1.1 connection to the pinned address.
    async fn dial_h1(&self) -> Result<Conn, UpError> {
        match self.dial(true).await? {
            Dialled::H1(c) => Ok(c),
            Dialled::H2(_) => Err((FetchError::UpstreamFailed, "the origin picked h2, not offered".into())),
        }
    }
}

/// The proxy's own answer to a request it did not send on (a denial). On a
/// stream whose request body is still coming, what is left of it is read
/// first (up to [`SETTLE_BYTES`], for at most [`SETTLE_TIME`]): the answer
/// then ends the stream cleanly, where answering first would reset the
/// stream under a client still sending, which some report as an error
/// instead of the answer.
async fn early(answer: Response<ProxyBody>, req: Request<Incoming>, stream: bool) -> Answer {
    if stream && !hyper::body::Body::is_end_stream(req.body()) {
        crate::data::carry::body::drain(&mut req.into_body(), SETTLE_BYTES, SETTLE_TIME).await;
    }
    answer.map(Either::Right)
}

/// What [`early`] reads of a refused stream's request body, at most.
const SETTLE_BYTES: usize = 64 * 1024;
const SETTLE_TIME: std::time::Duration = std::time::Duration::from_secs(1);

/// A request built for HTTP/1.1 made an HTTP/2 one: the authority goes in
/// the URI (`:authority`), not in `Host`; `TE: trailers` goes on when the
/// tool sent it.
fn for_h2(req: Request<UpBody>, target: &Target, te_trailers: bool) -> Result<Request<UpBody>, UpError> {
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    parts.uri = http::Uri::builder()
        .scheme(http::uri::Scheme::HTTPS)
        .authority(host_header(target))
        .path_and_query(pq)
        .build()
        .map_err(|e| (FetchError::UpstreamFailed, e.to_string()))?;
    parts.version = Version::HTTP_2;
    parts.headers.remove(header::HOST);
    if te_trailers {
        parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    Ok(Request::from_parts(parts, body))
}
