//! The data plane: many entrances around one decider. An [`entrance`] parses
//! what arrives on the proxy listener (or on a listener handed over for one
//! run) into the canonical target and request facts; [`decide`] decides it
//! (run, target, allowlist, credentials, each denial recorded); [`carry`]
//! carries the answer. Imports go entrance → decide and carry, never back.

pub(crate) mod carry;
pub(crate) mod decide;
pub(crate) mod entrance;

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
pub(crate) async fn serve(
    sh: Arc<Shared>,
    l: TcpListener,
    bound: Option<decide::auth::BoundRun>,
    admission: Arc<Admission>,
) {
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
        tls: sh.tls.clone(),
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
    bound: Option<decide::auth::BoundRun>,
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
            entrance::http::handle(sh.clone(), req, svc_conn.clone())
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
            Ok(1) if first[0] == entrance::socks::VERSION => {
                let served = entrance::socks::serve(self.sh.clone(), s, conn.clone(), self.bound.clone());
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
