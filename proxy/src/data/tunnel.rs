//! CONNECT tunnels (RFC 9110 §9.3.6): after the `200`, bytes are relayed
//! both ways, half-close aware, byte-counted, until both sides finish, the
//! tunnel idles past `tunnel_idle_timeout`, the fetch deadline expires or the
//! run ends. The slot is held until the tunnel is gone.
//!
//! When both ends are plain TCP sockets the bytes never enter user space:
//! each direction moves them with `splice(2)` through a pipe of its own
//! (64 KiB of kernel buffer, no user buffer at all). Otherwise (a TLS data
//! listener) a buffered copy does the same job. Counting, idle timeout,
//! deadline and run-end cut behave the same on both paths.

use crate::data::finish::Finish;
use crate::data::prefixed::Prefixed;
use crate::deny::Phase;
use crate::runs::budget::ByteBudget;
use crate::runs::slots::Slot;
use bytes::Bytes;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// `EGRESS_NO_SPLICE=1` makes every tunnel use the buffered copy: a
/// diagnostics switch (and the baseline of the tunnel benchmark), read once.
fn splice_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("EGRESS_NO_SPLICE").is_none_or(|v| v.is_empty() || v == "0"))
}

/// Byte counters and the time of the last activity, shared by both
/// directions; and the fetch's share of its run's byte budget, if any
/// (counted as the bytes move).
pub(super) struct Meter {
    pub up: AtomicU64,
    pub down: AtomicU64,
    /// Milliseconds since `epoch` of the last byte moved.
    last: AtomicU64,
    epoch: Instant,
    budget: Option<Arc<ByteBudget>>,
}

impl Meter {
    /// A meter for the fetch `finish` closes: its totals go back with
    /// [`Meter::close`].
    pub fn new(finish: &Finish) -> Meter {
        Meter {
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            last: AtomicU64::new(0),
            epoch: Instant::now(),
            budget: finish.budget.clone(),
        }
    }

    fn moved(&self, counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
        self.last
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.moved(n);
        }
    }

    /// Hands the totals to `finish` (already counted on the byte budget).
    pub fn close(&self, finish: &Finish) {
        finish.add_metered(self.up.load(Ordering::Relaxed), self.down.load(Ordering::Relaxed));
    }

    fn last_at(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last.load(Ordering::Relaxed))
    }
}

/// Counts bytes read (and, with `writes`, bytes written) and notes the
/// time of the last activity (copy path, an intercepted client, a
/// WebSocket). Owns its share of the meter, so a metered stream can be
/// handed to hyper (an upgrade needs a `'static` connection).
pub(super) struct Metered<T> {
    pub io: T,
    pub meter: Arc<Meter>,
    /// Reads count as bytes up (the tool's side) or down (the origin's).
    pub reads_up: bool,
    /// Writes count too, the other way.
    pub writes: bool,
}

impl<T> Metered<T> {
    /// The tool's side of an intercepted session: reads count up, writes down.
    pub fn client(io: T, meter: &Arc<Meter>) -> Metered<T> {
        Metered {
            io,
            meter: meter.clone(),
            reads_up: true,
            writes: true,
        }
    }

    /// One side of a relay, counting what is read from it only: up from
    /// the tool (`reads_up`), down from the origin.
    pub fn side(io: T, meter: &Arc<Meter>, reads_up: bool) -> Metered<T> {
        Metered {
            io,
            meter: meter.clone(),
            reads_up,
            writes: false,
        }
    }

    fn counter(&self, read: bool) -> &AtomicU64 {
        if read == self.reads_up {
            &self.meter.up
        } else {
            &self.meter.down
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.meter.moved(self.counter(true), n);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let (true, Poll::Ready(Ok(n))) = (self.writes, &r) {
            if *n > 0 {
                self.meter.moved(self.counter(false), *n);
            }
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The tool's side of a tunnel: a CONNECT's connection, upgraded once the
/// `200` is out, or a connection an entrance holds itself (SOCKS5, after
/// its success reply; a transparent connection) with the bytes it read
/// from it already (a transparent connection's ClientHello), which go
/// first.
pub enum Client {
    Upgrade(OnUpgrade),
    Tcp(TcpStream, Bytes),
}

pub struct Tunnel {
    pub client: Client,
    pub upstream: TcpStream,
    pub slot: Slot,
    pub deadline: Instant,
    pub idle: Duration,
    pub cancel: CancellationToken,
    pub shutdown: CancellationToken,
    pub finish: Finish,
}

/// Runs a tunnel to completion. Spawned after the success answer is queued.
pub async fn run(t: Tunnel) {
    let Tunnel {
        client,
        upstream,
        slot,
        deadline,
        idle,
        cancel,
        shutdown,
        finish,
    } = t;
    let _slot = slot;
    let meter = Arc::new(Meter::new(&finish));
    let budget_cut = finish.budget_cut();
    let bounds = Bounds {
        deadline,
        idle,
        cancel: &cancel,
        shutdown: &shutdown,
        budget: budget_cut.as_ref(),
    };
    match client {
        Client::Tcp(client, early) if splice_enabled() => {
            spliced(&client, &upstream, early, &meter, &bounds, &finish).await;
        }
        Client::Tcp(client, early) => copied(Prefixed::new(early, client), upstream, &meter, &bounds, &finish).await,
        Client::Upgrade(upgrade) => {
            let Some(client) = upgraded(upgrade, deadline, &cancel, &finish).await else {
                return;
            };
            let plain = if splice_enabled() {
                client.downcast::<TokioIo<TcpStream>>()
            } else {
                Err(client)
            };
            match plain {
                // What the client sent after its CONNECT, before the `200`,
                // shares hyper's whole read buffer (8 KiB): it is dropped
                // once written instead of being held for the tunnel's life.
                Ok(parts) => {
                    let client = parts.io.into_inner();
                    spliced(&client, &upstream, parts.read_buf, &meter, &bounds, &finish).await;
                }
                Err(client) => copied(TokioIo::new(client), upstream, &meter, &bounds, &finish).await,
            }
        }
    }
    meter.close(&finish);
}

/// Both ends plain TCP: `early` bytes first, then `splice(2)` both ways.
async fn spliced(
    client: &TcpStream,
    upstream: &TcpStream,
    early: Bytes,
    meter: &Meter,
    bounds: &Bounds<'_>,
    finish: &Finish,
) {
    let relay = async {
        if !early.is_empty() {
            write_all(upstream, &early).await?;
            meter.moved(&meter.up, early.len());
        }
        drop(early);
        egress_splice::both_ways(
            client,
            upstream,
            |n| meter.moved(&meter.up, n),
            |n| meter.moved(&meter.down, n),
        )
        .await
    };
    bounds.watch(relay, meter, finish).await;
}

/// Any client and upstream stream: a buffered copy both ways (also a
/// WebSocket's frames, when the proxy does not read them).
pub(super) async fn copied<C, U>(client: C, upstream: U, meter: &Arc<Meter>, bounds: &Bounds<'_>, finish: &Finish)
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let mut a = Metered::side(client, meter, true);
    let mut b = Metered::side(upstream, meter, false);
    let copy = async {
        tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, 16 * 1024, 16 * 1024)
            .await
            .map(|_| ())
    };
    bounds.watch(copy, meter, finish).await;
}

/// The client's connection once the `200` is out, unless the upgrade fails,
/// the deadline expires or the run ends first (recorded in `finish`).
pub(super) async fn upgraded(
    upgrade: OnUpgrade,
    deadline: Instant,
    cancel: &CancellationToken,
    finish: &Finish,
) -> Option<hyper::upgrade::Upgraded> {
    tokio::select! {
        u = upgrade => match u {
            Ok(u) => Some(u),
            Err(_) => { finish.failed("upgrade_failed"); None }
        },
        _ = tokio::time::sleep_until(deadline) => { finish.timed_out(Phase::Tunnel); None }
        _ = cancel.cancelled() => { finish.severed("run_ended"); None }
    }
}

/// What ends a tunnel besides its two ends finishing.
pub(super) struct Bounds<'a> {
    pub deadline: Instant,
    pub idle: Duration,
    pub cancel: &'a CancellationToken,
    pub shutdown: &'a CancellationToken,
    /// The run's byte budget spent (`None`: it has none).
    pub budget: Option<&'a CancellationToken>,
}

impl Bounds<'_> {
    /// Drives `relay` until it ends or a bound cuts it; records the outcome.
    pub async fn watch(&self, relay: impl Future<Output = io::Result<()>>, meter: &Meter, finish: &Finish) {
        tokio::pin!(relay);
        let deadline_sleep = tokio::time::sleep_until(self.deadline);
        tokio::pin!(deadline_sleep);
        let mut idle_check = Box::pin(tokio::time::sleep(self.idle));
        loop {
            tokio::select! {
                r = &mut relay => {
                    match r {
                        Ok(()) => finish.complete(),
                        Err(_) => finish.failed("io_error"),
                    }
                    return;
                }
                _ = &mut deadline_sleep => { finish.timed_out(Phase::Tunnel); return; }
                _ = self.cancel.cancelled() => { finish.severed("run_ended"); return; }
                _ = self.shutdown.cancelled() => { finish.severed("shutdown"); return; }
                _ = spent(self.budget) => { finish.severed("budget_exhausted"); return; }
                _ = &mut idle_check => {
                    let last_at = meter.last_at();
                    if Instant::now().saturating_duration_since(last_at) >= self.idle {
                        finish.severed("idle_timeout");
                        return;
                    }
                    idle_check.as_mut().reset(last_at + self.idle);
                }
            }
        }
    }
}

/// Resolves when `budget` fires; never without one.
pub(super) async fn spent(budget: Option<&CancellationToken>) {
    match budget {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// Writes `buf` to a socket shared with another task (`&TcpStream`).
async fn write_all(s: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
