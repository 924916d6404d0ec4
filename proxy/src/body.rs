//! Response bodies the data plane hands to hyper: a fixed short body for
//! denials and errors, or an upstream body streamed through unchanged but
//! guarded: it holds the fetch's concurrency slot, and is cut off when the
//! fetch deadline expires or the run ends. Dropping it releases everything.

use crate::finish::Finish;
use crate::runs::Run;
use crate::slots::Slot;
use crate::upstream::{Conn, UpstreamPool};
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::time::Sleep;
use tokio_util::sync::WaitForCancellationFutureOwned;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the proxy writes.
pub enum ProxyBody {
    Full(Option<Bytes>),
    Stream(Box<Guarded>),
}

impl ProxyBody {
    /// A guarded upstream body; one that is already complete is marked so.
    pub fn stream(mut g: Guarded) -> ProxyBody {
        if g.inner.is_end_stream() {
            g.completed();
        }
        ProxyBody::Stream(Box::new(g))
    }

    pub fn text(s: impl Into<Bytes>) -> ProxyBody {
        ProxyBody::Full(Some(s.into()))
    }

    pub fn empty() -> ProxyBody {
        ProxyBody::Full(None)
    }
}

/// An upstream body with its fetch's guards.
pub struct Guarded {
    pub inner: Incoming,
    pub deadline: Pin<Box<Sleep>>,
    pub cancel: Pin<Box<WaitForCancellationFutureOwned>>,
    pub finish: Finish,
    pub _slot: Slot,
    /// The upstream connection, handed back to the run's pool when the
    /// exchange completes; dropped (closed) on any other end.
    pub reuse: Option<(Arc<Run>, Conn)>,
}

impl Guarded {
    fn completed(&mut self) {
        self.finish.complete();
        if let Some((run, conn)) = self.reuse.take() {
            UpstreamPool::give_back(run, conn);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BodyCut {
    #[error("fetch deadline expired while streaming the response")]
    Deadline,
    #[error("run ended while streaming the response")]
    RunEnded,
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Stream(g) => {
                if g.cancel.as_mut().poll(cx).is_ready() {
                    g.finish.severed("run_ended");
                    return Poll::Ready(Some(Err(Box::new(BodyCut::RunEnded))));
                }
                if g.deadline.as_mut().poll(cx).is_ready() {
                    g.finish.timed_out("response");
                    return Poll::Ready(Some(Err(Box::new(BodyCut::Deadline))));
                }
                match Pin::new(&mut g.inner).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Some(d) = frame.data_ref() {
                            g.finish.down += d.len() as u64;
                        }
                        // hyper stops polling once the body says it has ended.
                        if g.inner.is_end_stream() {
                            g.completed();
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Err(e))) => {
                        g.finish.failed("upstream_failed");
                        Poll::Ready(Some(Err(Box::new(e))))
                    }
                    Poll::Ready(None) => {
                        g.completed();
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Stream(g) => g.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Stream(g) => g.inner.size_hint(),
        }
    }
}
