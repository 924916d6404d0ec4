//! Upstream connections of a fetch: dial the vetted addresses in order
//! (never anything else), refuse a connection that reached one of the
//! proxy's own listeners, and the HTTP/1.1 handshake (with upgrades, for
//! WebSocket) of plain-HTTP fetches,
//! whose connection then lives in the run's pool (`runs::pool`), and of
//! intercepted origins; the HTTP/2 handshake (RFC 9113 §3.4) of an
//! intercepted origin that picked `h2` by ALPN, and the one set of HTTP/2
//! bounds ([`H2_BOUNDS`]) both sides apply.

use crate::runs::pool::{Conn, ConnGuard, Dialled, H2Conn};
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
    // With upgrades: a `101` to a WebSocket handshake hands the connection
    // to the exchange (`hyper::upgrade::on` of the response); the driver then ends.
    let guard = drive(conn.with_upgrades(), run_end, hard_stop);
    Ok(Conn {
        addr,
        sender,
        guard,
        reused: false,
    })
}

/// The upstream connection a fetch goes out on.
pub enum Upstream {
    /// Freshly dialled to a vetted address.
    Stream(TcpStream, SocketAddr),
    /// An idle connection of the same run to an address in this fetch's vetted set.
    Pooled(Conn),
    /// An idle verified TLS connection of the same run, to the intercepted
    /// CONNECT's own name and an address in its vetted set.
    Verified(Dialled),
}

/// What bounds one HTTP/2 connection of a tool (the server side,
/// `entrance::h2`) and, for what comes back, the proxy's own HTTP/2
/// connection to the origin ([`handshake_h2`]).
pub struct H2Bounds {
    /// Streams open at once on one connection (`SETTINGS_MAX_CONCURRENT_STREAMS`);
    /// the run's `max_concurrent_fetches` bounds them further.
    pub max_concurrent_streams: u32,
    /// Bytes of one decoded header list (`SETTINGS_MAX_HEADER_LIST_SIZE`),
    /// counted as HPACK decodes them and across CONTINUATION frames: a
    /// block that grows past it ends the connection. Never above the
    /// proxy's `max_header_bytes` either.
    pub max_header_list_size: u32,
    /// The HPACK dynamic table the tool may make the proxy keep.
    pub header_table_size: u32,
    /// Flow-control window of a stream, and of the connection: what a tool
    /// can make the proxy buffer before it reads.
    pub initial_stream_window: u32,
    pub initial_connection_window: u32,
    /// The largest frame the proxy accepts.
    pub max_frame_size: u32,
    /// Bytes queued for sending per stream.
    pub max_send_buf_size: usize,
    /// Streams the tool opens and resets before they are served (the
    /// rapid-reset class, CVE-2023-44487): past this, `GOAWAY`
    /// (`ENHANCE_YOUR_CALM`).
    pub max_pending_accept_reset_streams: usize,
    /// Streams the proxy had to reset for the tool's protocol errors: past
    /// this, `GOAWAY`.
    pub max_local_error_reset_streams: usize,
}

/// The one set of HTTP/2 bounds.
pub const H2_BOUNDS: H2Bounds = H2Bounds {
    max_concurrent_streams: 100,
    max_header_list_size: 16 * 1024,
    header_table_size: 4096,
    initial_stream_window: 256 * 1024,
    initial_connection_window: 1024 * 1024,
    max_frame_size: 16 * 1024,
    max_send_buf_size: 256 * 1024,
    max_pending_accept_reset_streams: 20,
    max_local_error_reset_streams: 64,
};

/// The HTTP/2 handshake on a verified TLS stream whose ALPN is `h2`, with
/// the same bounds the server side applies to the tool
/// ([`H2_BOUNDS`]) for what comes back.
pub async fn handshake_h2<IO>(
    stream: IO,
    addr: SocketAddr,
    run_end: CancellationToken,
    hard_stop: CancellationToken,
) -> Result<H2Conn, hyper::Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let b = &H2_BOUNDS;
    let (sender, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .initial_stream_window_size(b.initial_stream_window)
        .initial_connection_window_size(b.initial_connection_window)
        .max_frame_size(b.max_frame_size)
        .max_header_list_size(b.max_header_list_size)
        .max_send_buf_size(b.max_send_buf_size)
        .handshake(TokioIo::new(stream))
        .await?;
    Ok(H2Conn {
        addr,
        sender,
        guard: drive(conn, run_end, hard_stop),
    })
}

/// Spawns a connection's driver, stopped with the run (`run_end`), at
/// shutdown (`hard_stop`), or when the returned guard's last holder drops it.
fn drive<C>(conn: C, run_end: CancellationToken, hard_stop: CancellationToken) -> ConnGuard
where
    C: std::future::Future + Send + 'static,
{
    let abandon = CancellationToken::new();
    let token = abandon.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = conn => {}
            _ = run_end.cancelled() => {}
            _ = hard_stop.cancelled() => {}
            _ = abandon.cancelled() => {}
        }
    });
    ConnGuard::new(token)
}
