//! What both listeners (data and control) do with a TCP listener: accept
//! with back-off on errors such as `EMFILE`, admit every connection as
//! pending (`admission`), run the TLS handshake when TLS is configured, close
//! a connection still pending after `pending_head_timeout`, and drive hyper
//! connections with graceful and hard stops. What is served on a connection
//! is the caller's [`Serve`]. The TLS of both listeners is optional
//! (`[proxy.tls] cert/key`, PEM; [`acceptor`]): the data listener becomes an
//! HTTPS proxy (clients use `--proxy https://…`) and the control listener
//! serves HTTPS.

use crate::admission::{Admission, Conn};
use crate::state::Shared;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// What a listener serves on one admitted connection (after TLS, if any).
pub(crate) trait Serve: Clone + Send + Sync + 'static {
    /// Serves `io` until the connection ends or `conn.cut` fires.
    fn serve<I>(&self, io: I, conn: Arc<Conn>) -> impl Future<Output = ()> + Send
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Serves a plain TCP connection (no listener TLS): [`Serve::serve`],
    /// unless the listener tells entrances apart by their first bytes.
    fn serve_tcp(&self, s: TcpStream, conn: Arc<Conn>) -> impl Future<Output = ()> + Send {
        self.serve(s, conn)
    }
}

/// One listener's identity and stop signal.
pub(crate) struct Spec {
    /// `data` or `control` (the `listener` metric label).
    pub name: &'static str,
    /// Stops accepting.
    pub stop: CancellationToken,
    /// Whether connections are tracked for the drain (`Shared::tasks`).
    pub drained: bool,
    /// TLS of the listener (`None`: plain TCP).
    pub tls: Option<TlsAcceptor>,
}

/// Accepts on `listener` until `spec.stop`, serving each connection with
/// `serve` under `admission`.
pub(crate) async fn accept_loop<S: Serve>(
    sh: Arc<Shared>,
    listener: TcpListener,
    admission: Arc<Admission>,
    spec: Spec,
    serve: S,
) {
    // Accepting never waits for a place: admission decides per connection.
    while let Some(stream) = accept(&spec.stop, &listener).await {
        let conn = Arc::new(admission.admit(CancellationToken::new()));
        let task = one(sh.clone(), stream, conn, spec.name, spec.tls.clone(), serve.clone());
        if spec.drained {
            sh.tasks.spawn(task);
        } else {
            tokio::spawn(task);
        }
    }
}

/// One connection: TLS if configured, then `serve`, bounded by the pending
/// deadline.
async fn one<S: Serve>(
    sh: Arc<Shared>,
    stream: TcpStream,
    conn: Arc<Conn>,
    name: &'static str,
    tls: Option<TlsAcceptor>,
    serve: S,
) {
    let timeout = sh.cfg.pending_head_timeout;
    let served = async {
        match &tls {
            None => serve.serve_tcp(stream, conn.clone()).await,
            Some(acceptor) => {
                if let Ok(Ok(tls)) = tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                    // A verified client certificate's names (the control
                    // listener's principals by subject).
                    conn.set_peer(egress_api::tls::peer_names(tls.get_ref().1));
                    serve.serve(tls, conn.clone()).await;
                }
            }
        }
    };
    tokio::select! {
        _ = served => {}
        _ = pending_deadline(&conn, timeout) => sh.count_closed(name, "head_timeout"),
    }
}

/// Resolves when `conn` is still pending `timeout` after it was accepted
/// (never, once it is established).
async fn pending_deadline(conn: &Conn, timeout: Duration) {
    tokio::time::sleep(timeout).await;
    if !conn.is_pending() {
        std::future::pending::<()>().await;
    }
}

/// Accepts one TCP connection, backing off on errors such as EMFILE.
async fn accept(stop: &CancellationToken, listener: &TcpListener) -> Option<TcpStream> {
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    return Some(s);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.cancelled() => return None,
        }
    }
}

/// Drives one hyper connection; drops it at once when `cut` fires; when
/// `stop` fires lets it finish its in-flight request (graceful), and drops
/// it when `hard` fires.
pub(crate) async fn serve_one<C>(stop: &CancellationToken, hard: &CancellationToken, cut: &CancellationToken, conn: C)
where
    C: Future + GracefulConn,
{
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = cut.cancelled() => {}
        _ = stop.cancelled() => {
            conn.as_mut().graceful();
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = cut.cancelled() => {}
                _ = hard.cancelled() => {}
            }
        }
    }
}

/// hyper connections that can shut down gracefully.
pub(crate) trait GracefulConn {
    fn graceful(self: std::pin::Pin<&mut Self>);
}

impl<I, S> GracefulConn for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

impl<I, S> GracefulConn for hyper::server::conn::http1::Connection<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// Builds the acceptor shared by both listeners (`[proxy.tls]`).
pub fn acceptor(cfg: &egress_config::TlsConfig) -> Result<TlsAcceptor, egress_api::tls::TlsError> {
    let config = egress_api::tls::server_config(&cfg.cert, &cfg.key, None)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}
