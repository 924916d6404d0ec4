//! Bodies of a plain-HTTP exchange. The request body goes upstream as an
//! [`Upload`], the response body comes back as a [`Guarded`] stream; both
//! hold the fetch's [`Exchange`], which holds the concurrency slot and the
//! fetch's [`Finish`], so the slot is released and the fetch is accounted
//! only when *both* directions are finished or cut. Each half counts its
//! bytes, and with a run byte budget passes no more of a frame than the
//! budget grants ([`let_pass`]): the rest waits for the next poll, and a
//! spent budget ends the body with [`BytesSpent`]. A [`watchdog`] task bounds the whole exchange by the fetch deadline
//! and the run's end whatever the peers' reading patterns: it cuts the
//! upstream connection and the client connection, which drops both halves.

use crate::data::carry::finish::Finish;
use crate::data::carry::scrub::{Scrub, Scrubbed};
use crate::deny::Phase;
use crate::runs::budget::{ByteBudget, BytesSpent, Grant};
use crate::runs::pool::Conn;
use crate::runs::slots::Slot;
use crate::runs::Run;
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{ready, Context, Poll};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the proxy writes.
pub enum ProxyBody {
    Full(Option<Bytes>),
    /// An origin's body, scrubbed of secrets when it comes from a
    /// credential's host.
    Stream(Scrubbed<Guarded>),
}

impl ProxyBody {
    /// A guarded upstream body; one that is already complete is marked so.
    pub fn stream(g: Guarded, scrub: Option<Scrub>) -> ProxyBody {
        if g.inner.is_end_stream() {
            g.exchange.response_done();
        }
        ProxyBody::Stream(Scrubbed::new(g, scrub))
    }

    pub fn text(s: impl Into<Bytes>) -> ProxyBody {
        ProxyBody::Full(Some(s.into()))
    }

    pub fn empty() -> ProxyBody {
        ProxyBody::Full(None)
    }
}

/// What both halves of one plain-HTTP exchange share. Dropped when the last
/// half goes: then the slot is released, the fetch is accounted, and the
/// upstream connection goes back to the run's pool if the exchange completed.
pub struct Exchange {
    pub finish: Finish,
    _slot: Slot,
    run: Arc<Run>,
    /// The upstream connection, set once its response head has arrived.
    conn: OnceLock<Conn>,
    response_done: AtomicBool,
    upload_done: AtomicBool,
    /// Whoever ends the exchange first (its drop, or the watchdog's cut).
    claimed: AtomicBool,
    /// Dropped with the exchange: tells the watchdog it is over.
    _over: oneshot::Sender<()>,
}

impl Exchange {
    /// A new exchange and the receiver its watchdog waits on.
    pub fn new(finish: Finish, slot: Slot, run: Arc<Run>) -> (Arc<Exchange>, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let ex = Arc::new(Exchange {
            finish,
            _slot: slot,
            run,
            conn: OnceLock::new(),
            response_done: AtomicBool::new(false),
            upload_done: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            _over: tx,
        });
        (ex, rx)
    }

    /// Hands over the upstream connection once the response head arrived.
    pub fn attach(&self, conn: Conn) {
        // Set once per exchange; a second connection cannot occur.
        let _ = self.conn.set(conn);
    }

    pub fn response_done(&self) {
        self.response_done.store(true, Ordering::Release);
    }

    pub fn upload_done(&self) {
        self.upload_done.store(true, Ordering::Release);
    }

    fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }

    /// The exchange became a relay (a WebSocket after its `101`), bounded
    /// like a tunnel by whoever holds it: the watchdog stands down, and
    /// the exchange's end records nothing and pools no connection (the
    /// relay records the outcome in `finish`).
    pub fn take_over(&self) {
        self.claim();
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let conn = self.conn.take();
        if !self.claim() {
            return;
        }
        if *self.response_done.get_mut() && *self.upload_done.get_mut() {
            self.finish.complete();
            if let Some(conn) = conn {
                if let Err(conn) = self.run.upstream.try_give_back(conn, &self.run.cancel) {
                    let run = self.run.clone();
                    tokio::spawn(async move { run.upstream.give_back(conn, &run.cancel).await });
                }
            }
        }
        // Otherwise the connection is dropped here, which stops its driver.
    }
}

/// What an exchange's watchdog waits on besides the exchange's own end.
pub struct Bounds {
    pub deadline: Instant,
    pub run_end: CancellationToken,
    /// The drain timeout of a graceful stop expired.
    pub hard_stop: CancellationToken,
    /// The run's byte budget spent (`None`: it has none).
    pub budget: Option<CancellationToken>,
}

/// Bounds an exchange by its deadline, the run's end and the proxy's hard
/// stop: whichever comes first records the outcome and cuts the upstream
/// connection (`upstream_cut`) and the client connection (`client_cut`).
/// Returns as soon as the exchange is over.
pub async fn watchdog(
    exchange: Weak<Exchange>,
    over: oneshot::Receiver<()>,
    bounds: Bounds,
    upstream_cut: CancellationToken,
    client_cut: CancellationToken,
) {
    enum Cut {
        Deadline,
        RunEnded,
        Shutdown,
        Budget,
    }
    let why = tokio::select! {
        biased;
        _ = over => return,
        _ = tokio::time::sleep_until(bounds.deadline) => Cut::Deadline,
        _ = bounds.run_end.cancelled() => Cut::RunEnded,
        _ = bounds.hard_stop.cancelled() => Cut::Shutdown,
        _ = crate::data::carry::tunnel::spent(bounds.budget.as_ref()) => Cut::Budget,
    };
    let Some(ex) = exchange.upgrade() else { return };
    if !ex.claim() {
        return;
    }
    match why {
        Cut::Deadline => ex.finish.timed_out(if ex.response_done.load(Ordering::Acquire) {
            Phase::Upload
        } else {
            Phase::Response
        }),
        Cut::RunEnded => ex.finish.severed("run_ended"),
        Cut::Shutdown => ex.finish.severed("shutdown"),
        Cut::Budget => ex.finish.severed("budget_exhausted"),
    }
    upstream_cut.cancel();
    client_cut.cancel();
}

/// What of `data` the fetch's byte budget lets pass now: all of it (no
/// budget, or enough left), the part that fits (the rest is kept in `rest`
/// for the next poll), nothing yet (kept whole in `rest`: other carriers
/// hold what is left for a moment), or nothing ever.
pub fn let_pass(
    budget: Option<&ByteBudget>,
    data: Bytes,
    rest: &mut Option<Bytes>,
    cx: &mut Context<'_>,
) -> Poll<Result<Bytes, BytesSpent>> {
    let Some(b) = budget.filter(|_| !data.is_empty()) else {
        return Poll::Ready(Ok(data));
    };
    match b.grant(data.len()) {
        Grant::Granted(r) => {
            let n = r.len();
            r.used(n);
            if n < data.len() {
                *rest = Some(data.slice(n..));
                Poll::Ready(Ok(data.slice(..n)))
            } else {
                Poll::Ready(Ok(data))
            }
        }
        Grant::Later => {
            *rest = Some(data);
            cx.waker().wake_by_ref();
            Poll::Pending
        }
        Grant::Spent => Poll::Ready(Err(BytesSpent)),
    }
}

/// The request body on its way upstream: counts bytes, passes no more than
/// the byte budget grants, and marks the upload half of the exchange
/// finished at its end.
pub struct Upload {
    inner: Incoming,
    /// What the byte budget held back of the last frame.
    rest: Option<Bytes>,
    exchange: Arc<Exchange>,
}

impl Upload {
    pub fn new(inner: Incoming, exchange: Arc<Exchange>) -> Upload {
        if inner.is_end_stream() {
            exchange.upload_done();
        }
        Upload {
            inner,
            rest: None,
            exchange,
        }
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let fx = &this.exchange.finish;
        let data = match this.rest.take() {
            Some(d) => d,
            None => match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => d,
                    Err(trailers) => {
                        if this.inner.is_end_stream() {
                            this.exchange.upload_done();
                        }
                        return Poll::Ready(Some(Ok(trailers)));
                    }
                },
                None => {
                    this.exchange.upload_done();
                    return Poll::Ready(None);
                }
                Some(Err(e)) => {
                    fx.severed("client_gone");
                    return Poll::Ready(Some(Err(e.into())));
                }
            },
        };
        match ready!(let_pass(fx.budget.as_deref(), data, &mut this.rest, cx)) {
            Ok(d) => {
                fx.add_up(d.len() as u64);
                if this.rest.is_none() && this.inner.is_end_stream() {
                    this.exchange.upload_done();
                }
                Poll::Ready(Some(Ok(Frame::data(d))))
            }
            Err(e) => {
                fx.severed("budget_exhausted");
                Poll::Ready(Some(Err(e.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An upstream response body on its way to the client: counts bytes,
/// passes no more than the byte budget grants, and marks the response half
/// of the exchange finished at its end.
pub struct Guarded {
    pub inner: Incoming,
    /// What the byte budget held back of the last frame.
    pub rest: Option<Bytes>,
    pub exchange: Arc<Exchange>,
}

impl Guarded {
    pub fn new(inner: Incoming, exchange: Arc<Exchange>) -> Guarded {
        Guarded {
            inner,
            rest: None,
            exchange,
        }
    }
}

impl Body for Guarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let g = self.get_mut();
        let fx = &g.exchange.finish;
        let data = match g.rest.take() {
            Some(d) => d,
            None => match ready!(Pin::new(&mut g.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => d,
                    Err(trailers) => {
                        // hyper stops polling once the body says it has ended.
                        if g.inner.is_end_stream() {
                            g.exchange.response_done();
                        }
                        return Poll::Ready(Some(Ok(trailers)));
                    }
                },
                None => {
                    g.exchange.response_done();
                    return Poll::Ready(None);
                }
                Some(Err(e)) => {
                    fx.failed("upstream_failed");
                    return Poll::Ready(Some(Err(e.into())));
                }
            },
        };
        match ready!(let_pass(fx.budget.as_deref(), data, &mut g.rest, cx)) {
            Ok(d) => {
                fx.add_down(d.len() as u64);
                if g.rest.is_none() && g.inner.is_end_stream() {
                    g.exchange.response_done();
                }
                Poll::Ready(Some(Ok(Frame::data(d))))
            }
            Err(e) => {
                fx.severed("budget_exhausted");
                Poll::Ready(Some(Err(e.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Stream(s) => Pin::new(s).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Stream(s) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Stream(s) => s.size_hint(),
        }
    }
}

/// Approximate size of a message head as written on the wire: the start
/// line and every header line (`name: value\r\n`) plus the blank line.
pub fn head_len(start_line: usize, headers: &http::HeaderMap) -> u64 {
    let fields: usize = headers.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    (start_line + 2 + fields + 2) as u64
}

/// Reads what is left of a request body the proxy answers without sending
/// on, dropping it: up to `max` bytes, for at most `time`, so that a client
/// still sending reads the answer instead of a reset connection.
pub async fn drain<B>(body: &mut B, max: usize, time: std::time::Duration)
where
    B: Body + Unpin,
{
    use http_body_util::BodyExt as _;
    let mut left = max;
    let _ = tokio::time::timeout(time, async {
        while let Some(Ok(frame)) = body.frame().await {
            match frame.data_ref() {
                Some(d) if bytes::Buf::remaining(d) >= left => return,
                Some(d) => left -= bytes::Buf::remaining(d),
                None => {}
            }
        }
    })
    .await;
}
