//! Upstream connections of a fetch: dial the vetted addresses in order
//! (never anything else), refuse a connection that reached one of the
//! proxy's own listeners, and the HTTP/1.1 handshake (with upgrades, for
//! WebSocket) of plain-HTTP fetches,
//! whose connection then lives in the run's pool (`runs::pool`).

use crate::runs::pool::{Conn, ConnGuard};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Performs the HTTP/1.1 handshake on a dialled, vetted stream (or the TLS
/// over one, intercepted CONNECTs) and spawns its driver, bound to the run
/// (`run_end`) and to shutdown (`hard_stop`).
pub async fn handshake<IO>(
    stream: IO,
    addr: SocketAddr,
    run_end: CancellationToken,
    hard_stop: CancellationToken,
) -> Result<Conn, hyper::Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await?;
    let abandon = CancellationToken::new();
    let token = abandon.clone();
    // With upgrades: a `101` to a WebSocket handshake hands the connection
    // to the exchange (`hyper::upgrade::on` of the response); the driver then ends.
    let conn = conn.with_upgrades();
    tokio::spawn(async move {
        tokio::select! {
            _ = conn => {}
            _ = run_end.cancelled() => {}
            _ = hard_stop.cancelled() => {}
            _ = abandon.cancelled() => {}
        }
    });
    Ok(Conn {
        addr,
        sender,
        guard: ConnGuard::new(token),
        reused: false,
    })
}

/// The upstream connection a fetch goes out on.
pub enum Upstream {
    /// Freshly dialled to a vetted address.
    Stream(TcpStream, SocketAddr),
    /// An idle connection of the same run to an address in this fetch's vetted set.
    Pooled(Conn),
}
