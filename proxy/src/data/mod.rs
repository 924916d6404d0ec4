//! The data plane: what happens to a request on the proxy listener (or on a
//! listener handed over for one run). [`fetch`] is the forward and CONNECT
//! entrance, one function per step; [`decide`] holds the decisions every
//! entrance shares (run, target, allowlist, credentials, each denial
//! recorded), on the pure [`policy`] functions. The other modules are what
//! the steps use: [`auth`] (the run credential), [`target`] (the canonical
//! target), [`upstream`] (dial the vetted addresses, HTTP/1.1 handshake),
//! [`forward`] (plain HTTP) with [`inject`] (credentials written into the
//! request) and [`scrub`] (secrets taken out of the response, which
//! [`relayed`] says it can read), [`tunnel`]
//! (CONNECT), [`intercept`] (a CONNECT whose TLS the proxy terminates, with
//! `ca` leaves; HTTP/2 inside it within the bounds of [`streams`]), [`websocket`] (a WebSocket after its handshake, on
//! either, with the frame codec [`wsframe`] when frames are rewritten),
//! [`body`] (bodies bounded by the deadline and the run),
//! [`finish`] (the fetch's outcome, once), [`respond`] (denial and error
//! answers), [`handoff`] (listeners handed over by the executor). The
//! resolver (`dns`) and the proxy's own addresses (`addrs`) are shared state.

pub(crate) mod auth;
pub(crate) mod body;
pub(crate) mod decide;
pub(crate) mod fetch;
pub(crate) mod finish;
pub(crate) mod forward;
pub(crate) mod handoff;
pub(crate) mod inject;
pub(crate) mod intercept;
pub(crate) mod nameserver;
pub(crate) mod policy;
pub(crate) mod prefixed;
pub(crate) mod relayed;
pub(crate) mod respond;
pub(crate) mod scrub;
pub(crate) mod sniff;
pub(crate) mod socks;
pub(crate) mod streams;
pub(crate) mod target;
pub(crate) mod transparent;
pub(crate) mod tunnel;
pub(crate) mod upstream;
pub(crate) mod websocket;
pub(crate) mod wsframe;

use crate::admission::{Admission, Conn};
use crate::listener::{self, serve_one, Serve, Spec};
use crate::state::Shared;
use hyper::server::conn::http1::Builder;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

/// Serves a data listener: the proxy's own (`bound` = `None`) or one handed
/// over for a single run, with the connection admission it belongs to.
pub(crate) async fn serve(sh: Arc<Shared>, l: TcpListener, bound: Option<auth::BoundRun>, admission: Arc<Admission>) {
    let mut builder = Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(sh.cfg.header_read_timeout)
        .max_buf_size(sh.cfg.max_header_bytes.max(8192) + 1024)
        .max_header_size(sh.cfg.max_header_bytes)
        .max_headers(128)
        .keep_alive(true)
        .half_close(false);
    let spec = Spec {
        name: "data",
        stop: sh.shutdown.clone(),
        drained: true,
    };
    let serve = DataConn {
        sh: sh.clone(),
        builder: Arc::new(builder),
        bound,
    };
    listener::accept_loop(sh, l, admission, spec, serve).await;
}

/// Serves fetches on one data connection.
#[derive(Clone)]
struct DataConn {
    sh: Arc<Shared>,
    builder: Arc<Builder>,
    bound: Option<auth::BoundRun>,
}

impl Serve for DataConn {
    async fn serve<I>(&self, io: I, conn: Arc<Conn>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sh, bound, svc_conn) = (self.sh.clone(), self.bound.clone(), conn.clone());
        let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            if let Some(b) = &bound {
                req.extensions_mut().insert(b.clone());
            }
            fetch::handle(sh.clone(), req, svc_conn.clone())
        });
        let c = self.builder.serve_connection(TokioIo::new(io), svc).with_upgrades();
        serve_one(&self.sh.shutdown, &self.sh.hard_stop, &conn.cut, c).await;
    }

    /// A plain TCP connection whose first byte is SOCKS5's version goes to
    /// that entrance; any other to HTTP (the byte is only peeked at).
    async fn serve_tcp(&self, s: TcpStream, conn: Arc<Conn>) {
        let mut first = [0u8; 1];
        let peeked = tokio::select! {
            r = s.peek(&mut first) => r,
            _ = conn.cut.cancelled() => return,
        };
        match peeked {
            Ok(1) if first[0] == socks::VERSION => {
                let served = socks::serve(self.sh.clone(), s, conn.clone(), self.bound.clone());
                tokio::select! {
                    _ = served => {}
                    _ = conn.cut.cancelled() => {}
                }
            }
            Ok(_) => self.serve(s, conn).await,
            Err(_) => {}
        }
    }
}
