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
//!
//! With a run byte budget ([`ByteBudget`]) every carrier here asks it
//! before it moves bytes and moves no more than it grants: a splice asks
//! for at most the grant, a [`Metered`] read or write is cut to it. A
//! carrier whose run has spent its budget ends with [`BytesSpent`], and
//! the tunnel's outcome is `budget_exhausted`.

use crate::data::carry::finish::Finish;
use crate::data::carry::prefixed::Prefixed;
use crate::deny::Phase;
use crate::runs::budget::{ByteBudget, BytesSpent, Take};
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
/// (asked before the bytes move).
pub(in crate::data) struct Meter {
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
    }

    /// One direction of the meter, for a splice.
    fn direction(&self, up: bool) -> Direction<'_> {
        Direction { meter: self, up }
    }

    /// Hands the totals to `finish` (already taken from the byte budget).
    pub fn close(&self, finish: &Finish) {
        finish.add_metered(self.up.load(Ordering::Relaxed), self.down.load(Ordering::Relaxed));
    }

    fn last_at(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last.load(Ordering::Relaxed))
    }
}

/// One direction of a [`Meter`] as the splice crate's allowance: each read
/// of a splice asks the byte budget first.
struct Direction<'a> {
    meter: &'a Meter,
    up: bool,
}

impl Direction<'_> {
    fn counter(&self) -> &AtomicU64 {
        if self.up {
            &self.meter.up
        } else {
            &self.meter.down
        }
    }
}

impl egress_splice::Allowance for Direction<'_> {
    fn take(&self, want: usize) -> egress_splice::Take {
        let Some(b) = &self.meter.budget else {
            return egress_splice::Take::Granted(want);
        };
        match b.reserve(want) {
            Take::Granted(g) => egress_splice::Take::Granted(g as usize),
            Take::Later => egress_splice::Take::Later,
            Take::Spent => egress_splice::Take::Spent,
        }
    }

    fn settle(&self, granted: usize, read: usize) {
        if let Some(b) = &self.meter.budget {
            b.settle(granted, read);
        }
        if read > 0 {
            self.meter.moved(self.counter(), read);
        }
    }
}

/// Which way the bytes a [`Metered`] stream counts go.
#[derive(Clone, Copy)]
pub(in crate::data) enum Way {
    /// Towards the origin.
    Up,
    /// Towards the tool.
    Down,
}

/// Counts the bytes read from a stream, or written to it, or both, and
/// notes the time of the last activity (copy path, an intercepted client, a
/// WebSocket); with a byte budget, each counted read or write is cut to
/// what the budget grants first, and fails with [`BytesSpent`] once it is
/// spent. Owns its share of the meter, so a metered stream can be handed to
/// hyper (an upgrade needs a `'static` connection).
pub(in crate::data) struct Metered<T> {
    pub io: T,
    pub meter: Arc<Meter>,
    /// Reads count, this way.
    reads: Option<Way>,
    /// Writes count, this way.
    writes: Option<Way>,
}

impl<T> Metered<T> {
    /// The tool's side of an intercepted session: its TLS bytes, reads
    /// counting up and writes down.
    pub fn client(io: T, meter: &Arc<Meter>) -> Metered<T> {
        Metered {
            io,
            meter: meter.clone(),
            reads: Some(Way::Up),
            writes: Some(Way::Down),
        }
    }

    /// One side of a relay, counting what is written to it: down to the
    /// tool's side, up to the origin's (`origin`).
    pub fn side(io: T, meter: &Arc<Meter>, origin: bool) -> Metered<T> {
        Metered {
            io,
            meter: meter.clone(),
            reads: None,
            writes: Some(if origin { Way::Up } else { Way::Down }),
        }
    }
}

impl Meter {
    fn counter(&self, way: Way) -> &AtomicU64 {
        match way {
            Way::Up => &self.up,
            Way::Down => &self.down,
        }
    }
}

/// What a counted read or write may move: `Ok(None)` without a budget (as
/// much as asked), `Ok(Some(granted))`, `Pending` while other carriers
/// hold what is left, or the budget spent.
fn granted(budget: Option<&ByteBudget>, want: usize, cx: &mut Context<'_>) -> Poll<io::Result<Option<usize>>> {
    let Some(b) = budget else {
        return Poll::Ready(Ok(None));
    };
    match b.reserve(want) {
        Take::Granted(g) => Poll::Ready(Ok(Some(g as usize))),
        Take::Later => {
            // Another carrier's grant is settled within its own poll:
            // ask again on the next turn.
            cx.waker().wake_by_ref();
            Poll::Pending
        }
        Take::Spent => Poll::Ready(Err(BytesSpent.into())),
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let Some(way) = this.reads else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        let want = buf.remaining();
        if want == 0 {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let budget = this.meter.budget.as_deref();
        let grant = match granted(budget, want, cx) {
            Poll::Ready(Ok(g)) => g,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        let (r, n) = match grant {
            Some(g) if g < want => {
                let mut part = ReadBuf::new(buf.initialize_unfilled_to(g));
                let r = Pin::new(&mut this.io).poll_read(cx, &mut part);
                let n = part.filled().len();
                buf.advance(n);
                (r, n)
            }
            _ => {
                let before = buf.filled().len();
                let r = Pin::new(&mut this.io).poll_read(cx, buf);
                (r, buf.filled().len() - before)
            }
        };
        if let (Some(b), Some(g)) = (budget, grant) {
            b.settle(g, n);
        }
        if n > 0 {
            this.meter.moved(this.meter.counter(way), n);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let Some(way) = this.writes.filter(|_| !buf.is_empty()) else {
            return Pin::new(&mut this.io).poll_write(cx, buf);
        };
        let budget = this.meter.budget.as_deref();
        let grant = match granted(budget, buf.len(), cx) {
            Poll::Ready(Ok(g)) => g,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        let r = Pin::new(&mut this.io).poll_write(cx, &buf[..grant.unwrap_or(buf.len())]);
        let n = match &r {
            Poll::Ready(Ok(n)) => *n,
            _ => 0,
        };
        if let (Some(b), Some(g)) = (budget, grant) {
            b.settle(g, n);
        }
        if n > 0 {
            this.meter.moved(this.meter.counter(way), n);
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
    let (up, down) = (meter.direction(true), meter.direction(false));
    let relay = async {
        if !early.is_empty() {
            write_all(upstream, &early, &up).await?;
        }
        drop(early);
        egress_splice::both_ways_within(client, upstream, &up, &down).await
    };
    bounds.watch(relay, meter, finish).await;
}

/// Any client and upstream stream: a buffered copy both ways (also a
/// WebSocket's frames, when the proxy does not read them).
pub(in crate::data) async fn copied<C, U>(
    client: C,
    upstream: U,
    meter: &Arc<Meter>,
    bounds: &Bounds<'_>,
    finish: &Finish,
) where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let mut a = Metered::side(client, meter, false);
    let mut b = Metered::side(upstream, meter, true);
    let copy = async {
        tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, 16 * 1024, 16 * 1024)
            .await
            .map(|_| ())
    };
    bounds.watch(copy, meter, finish).await;
}

/// The client's connection once the `200` is out, unless the upgrade fails,
/// the deadline expires or the run ends first (recorded in `finish`).
pub(in crate::data) async fn upgraded(
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
pub(in crate::data) struct Bounds<'a> {
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
                        // A carrier stopped by the spent budget (its cut
                        // may not have been seen here yet).
                        Err(_) if self.budget.is_some_and(|b| b.is_cancelled()) => {
                            finish.severed("budget_exhausted");
                        }
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
pub(in crate::data) async fn spent(budget: Option<&CancellationToken>) {
    match budget {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// Writes `buf` to a socket shared with another task (`&TcpStream`), each
/// write no more than `way` grants.
async fn write_all(s: &TcpStream, mut buf: &[u8], way: &Direction<'_>) -> io::Result<()> {
    use egress_splice::Allowance as _;
    while !buf.is_empty() {
        s.writable().await?;
        let granted = match way.take(buf.len()) {
            egress_splice::Take::Granted(g) => g.min(buf.len()),
            egress_splice::Take::Later => {
                tokio::task::yield_now().await;
                continue;
            }
            egress_splice::Take::Spent => return Err(BytesSpent.into()),
        };
        let wrote = s.try_write(&buf[..granted]);
        way.settle(granted, *wrote.as_ref().unwrap_or(&0));
        match wrote {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
