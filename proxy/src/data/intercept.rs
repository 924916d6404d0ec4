//! Step 8 for an intercepted CONNECT: a CONNECT of a tool to one of its
//! credential hosts, or any CONNECT of an `inspect` tool
//! ([`policy::intercepts`](crate::data::policy::intercepts)).
//!
//! The origin's TLS is already open and verified when the session starts
//! (`Fetch::intercept`). The session then terminates the tool's TLS with a
//! leaf of the appliance CA for the CONNECT host — after checking that the
//! ClientHello's server name (SNI), when there is one, is that host — and
//! serves HTTP/1.1 inside: each request is decided again
//! ([`decide::decide_inside`]: run, allowlist, methods, `Host`, credential
//! misuse), gets the tool's credentials for this host written in
//! ([`inject`]), and goes out on the one upstream connection (dialled again
//! to the same pinned address if the origin closed it); its response comes
//! back scrubbed of them ([`scrub`]). Bytes are counted
//! as the tool's TLS bytes; the idle timeout, the fetch deadline, the run's
//! end and shutdown bound the session like a tunnel, and the slot is held
//! until it is over.

use crate::data::body::ProxyBody;
use crate::data::decide;
use crate::data::finish::Finish;
use crate::data::forward::strip_hop_by_hop;
use crate::data::inject;
use crate::data::respond;
use crate::data::scrub::{self, Scrubbed};
use crate::data::target::{server_name_is, Target};
use crate::data::tunnel::{upgraded, Bounds, Client, Meter, Metered};
use crate::data::upstream;
use crate::data::websocket;
use crate::deny::FetchError;
use crate::runs::pool::{Conn, UpBody};
use crate::runs::slots::Slot;
use crate::runs::Run;
use crate::state::Shared;
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
use tokio::time::Instant;

/// A response inside the session: the origin's (scrubbed of the
/// credentials written into its request), or the proxy's own.
type Answer = Response<Either<Scrubbed<Incoming>, ProxyBody>>;

pub struct Session {
    pub sh: Arc<Shared>,
    pub run: Arc<Run>,
    /// The CONNECT target.
    pub target: Target,
    /// The vetted address the upstream connection was dialled to.
    pub addr: SocketAddr,
    pub client: Client,
    pub upstream: tokio_rustls::client::TlsStream<TcpStream>,
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
        addr,
        client,
        upstream,
        slot,
        deadline,
        finish,
    } = s;
    let _slot = slot;
    let meter = Arc::new(Meter::new(&finish));
    let budget_cut = finish.budget_cut();
    let origin = Origin {
        sh: &sh,
        run: &run,
        target: &target,
        addr,
        conn: tokio::sync::Mutex::new(None),
        switched: std::sync::Mutex::new(None),
        finish: &finish,
    };
    let bounds = Bounds {
        deadline,
        idle: sh.cfg.tunnel_idle_timeout,
        cancel: &run.cancel,
        shutdown: &sh.hard_stop,
        budget: budget_cut.as_ref(),
    };
    match client {
        Client::Upgrade(upgrade) => {
            let Some(client) = upgraded(upgrade, deadline, &run.cancel, &finish).await else {
                return;
            };
            let io = Metered::client(TokioIo::new(client), &meter);
            bounds.watch(origin.serve(io, upstream), &meter, &finish).await;
        }
        Client::Tcp(client) => {
            let io = Metered::client(client, &meter);
            bounds.watch(origin.serve(io, upstream), &meter, &finish).await;
        }
    }
    meter.close(&finish);
}

/// The `Host` header sent to an HTTPS origin.
fn host_header(t: &Target) -> String {
    if t.port == 443 {
        t.host.to_string()
    } else {
        t.to_string()
    }
}

/// The origin side of one session.
struct Origin<'a> {
    sh: &'a Arc<Shared>,
    run: &'a Arc<Run>,
    target: &'a Target,
    addr: SocketAddr,
    /// The upstream connection (`None` until the first handshake, or after
    /// a redial failed).
    conn: tokio::sync::Mutex<Option<Conn>>,
    /// A WebSocket handshake the origin switched protocols for: joined
    /// once the tool's connection is upgraded.
    switched: std::sync::Mutex<Option<Switched>>,
    finish: &'a Finish,
}

/// Both sides of a switched WebSocket, waiting for their upgrades.
struct Switched {
    client: hyper::upgrade::OnUpgrade,
    origin: hyper::upgrade::OnUpgrade,
    rewrite: Option<websocket::Rewrite>,
}

impl Origin<'_> {
    /// The tool's TLS, then HTTP/1.1 inside it until the tool is done.
    async fn serve<IO>(&self, io: IO, upstream: tokio_rustls::client::TlsStream<TcpStream>) -> io::Result<()>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io).await?;
        if let Some(sni) = start.client_hello().server_name() {
            if !server_name_is(&self.target.host, sni) {
                let sni = sni.to_owned();
                decide::deny_sni(self.sh, self.run, self.target, &sni).await;
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
        let conn = upstream::handshake(upstream, self.addr, self.run.cancel.clone(), self.sh.hard_stop.clone())
            .await
            .map_err(io::Error::other)?;
        *self.conn.lock().await = Some(conn);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.sh.cfg.header_read_timeout)
            .max_buf_size(self.sh.cfg.max_header_bytes.max(8192) + 1024)
            .max_header_size(self.sh.cfg.max_header_bytes)
            .max_headers(128)
            .keep_alive(true);
        let service = hyper::service::service_fn(|req| self.exchange(req));
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
        *self.conn.lock().await = None;
        let client = ws.client.await.map_err(io::Error::other)?;
        websocket::relay(TokioIo::new(client), TokioIo::new(origin?), ws.rewrite, self.finish).await
    }

    /// One request inside the session.
    async fn exchange(&self, mut req: Request<Incoming>) -> Result<Answer, Infallible> {
        let inside = match decide::decide_inside(self.sh, self.run, self.target, &req).await {
            Ok(i) => i,
            Err(answer) => return Ok(answer.map(Either::Right)),
        };
        let client_upgrade = inside.websocket.then(|| hyper::upgrade::on(&mut req));
        let (parts, body) = req.into_parts();
        let method = parts.method.clone();
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        if inside.websocket {
            websocket::handshake_headers(&mut headers, websocket::rewrites(inside.credentials.as_ref()));
        }
        if let Ok(v) = HeaderValue::from_str(&host_header(self.target)) {
            headers.insert(header::HOST, v);
        }
        let mut pq = inside
            .target
            .path_and_query
            .clone()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        if let Some(inj) = &inside.credentials {
            inject::write(inj, self.run, &mut headers, &mut pq);
        }
        let mut up = Request::new(body.boxed_unsync());
        *up.method_mut() = parts.method;
        *up.version_mut() = Version::HTTP_11;
        *up.headers_mut() = headers;
        *up.uri_mut() = http::Uri::from(pq);
        match self.send(up).await {
            Ok(resp) if client_upgrade.is_some() && resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                Ok(self.switch(resp, client_upgrade, inside))
            }
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                let scrub = match scrub::response(
                    self.sh,
                    inside.credentials.as_ref().map(|c| &c.tool),
                    self.run,
                    &method,
                    &mut parts,
                ) {
                    Ok(s) => s,
                    Err(e) => {
                        self.sh.count_error(&self.run.tool, FetchError::Unscrubbable);
                        return Ok(
                            respond::error(FetchError::Unscrubbable, &format!("{}: {e}", self.target))
                                .map(Either::Right),
                        );
                    }
                };
                tracing::info!(
                    target: "egress::fetch",
                    run = %self.run.id,
                    tool = %self.run.tool,
                    kind = "intercepted",
                    dest = %self.target,
                    method = %method,
                    status = parts.status.as_u16(),
                    injected = inside.credentials.is_some(),
                    "request inside an intercepted tunnel"
                );
                Ok(Response::from_parts(parts, Either::Left(Scrubbed::new(body, scrub))))
            }
            Err((e, detail)) => {
                self.sh.count_error(&self.run.tool, e);
                Ok(respond::error(e, &format!("{}: {detail}", self.target)).map(Either::Right))
            }
        }
    }

    /// The origin switched protocols for a WebSocket handshake: its `101`
    /// goes to the tool with its headers as they came (scrubbed of the
    /// secret); [`Origin::serve`] joins both sides once upgraded.
    fn switch(
        &self,
        mut resp: Response<Incoming>,
        client: Option<hyper::upgrade::OnUpgrade>,
        inside: decide::Inside,
    ) -> Answer {
        let origin = hyper::upgrade::on(&mut resp);
        let (mut parts, _) = resp.into_parts();
        let injected = inside.credentials.as_ref();
        let rewrite = websocket::rewrites(injected);
        let checked = scrub::response(
            self.sh,
            injected.map(|c| &c.tool),
            self.run,
            &http::Method::GET,
            &mut parts,
        )
        .and_then(|_| websocket::check_accepted(rewrite, &parts.headers));
        let (Some(client), Ok(_)) = (client, &checked) else {
            self.sh.count_error(&self.run.tool, FetchError::UpstreamFailed);
            let e = checked.err().unwrap_or_default();
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
        let rewrite = websocket::Rewrite::new(self.sh, self.run, &inside.target, injected);
        if let Ok(mut s) = self.switched.lock() {
            *s = Some(Switched {
                client,
                origin,
                rewrite,
            });
        }
        Response::from_parts(parts, Either::Right(ProxyBody::empty()))
    }

    /// Sends `req` on the upstream connection; when the origin has closed
    /// it, on a new one to the same vetted address.
    async fn send(&self, req: Request<UpBody>) -> Result<Response<Incoming>, (FetchError, String)> {
        let mut slot = self.conn.lock().await;
        let ready = match slot.as_mut() {
            Some(c) => c.sender.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            *slot = Some(self.redial().await?);
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
                let mut fresh = self.redial().await?;
                let r = fresh.sender.send_request(req).await;
                *slot = Some(fresh);
                r.map_err(|e| (FetchError::UpstreamFailed, e.to_string()))
            }
        }
    }

    /// A new verified TLS connection to the pinned address.
    async fn redial(&self) -> Result<Conn, (FetchError, String)> {
        let addr = self.addr;
        let s = self
            .sh
            .dialer
            .dial(addr)
            .await
            .map_err(|e| (FetchError::ConnectFailed, format!("{addr}: {e}")))?;
        let ca = self.sh.ca.load_full();
        let tls = ca
            .connect(&self.target.host, s)
            .await
            .map_err(|e| (FetchError::UpstreamTls, format!("{addr}: {e}")))?;
        upstream::handshake(tls, addr, self.run.cancel.clone(), self.sh.hard_stop.clone())
            .await
            .map_err(|e| (FetchError::UpstreamFailed, e.to_string()))
    }
}
