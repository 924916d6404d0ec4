//! HTTP/2 inside an intercepted session (RFC 9113), when the tool picks
//! `h2` by ALPN: the bounds of the server side ([`H2_BOUNDS`], kept with
//! the client side's in `carry::upstream`: streams,
//! header lists against HPACK bombs and CONTINUATION floods (§6.10),
//! flow-control windows (§5.2), and resets against the rapid-reset class),
//! what each stream holds while it is open (one of the run's slots and its
//! own deadline, [`StreamSlot`], [`Hold`] and [`Held`]), and the executor
//! that keeps every stream's task inside its session.
//!
//! A stream holds its slot until *both* its directions have ended: the
//! request body sent on to the origin and the response sent to the tool
//! (an upload still streaming after an early answer keeps it), and each
//! direction fails at the stream's deadline, so neither outlives it.
//!
//! Each stream is one request: the session hands it to the same function
//! as an HTTP/1.1 request inside interception (`intercept::Origin::exchange`),
//! so it is decided, injected, scrubbed and counted the same way.

use crate::data::carry::upstream::H2_BOUNDS;
use crate::runs::slots::Slot;
use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// The server side of a tool's HTTP/2 connection, with [`H2_BOUNDS`]
/// (`max_header_bytes` lowers the header list bound). Extended CONNECT
/// (RFC 8441) is not offered: a WebSocket stays on HTTP/1.1.
pub fn server(max_header_bytes: usize, exec: SessionExec) -> hyper::server::conn::http2::Builder<SessionExec> {
    let b = &H2_BOUNDS;
    let headers = u32::try_from(max_header_bytes)
        .unwrap_or(u32::MAX)
        .min(b.max_header_list_size);
    let mut builder = hyper::server::conn::http2::Builder::new(exec);
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(b.max_concurrent_streams)
        .max_header_list_size(headers)
        .header_table_size(b.header_table_size)
        .initial_stream_window_size(b.initial_stream_window)
        .initial_connection_window_size(b.initial_connection_window)
        .max_frame_size(b.max_frame_size)
        .max_send_buf_size(b.max_send_buf_size)
        .max_pending_accept_reset_streams(b.max_pending_accept_reset_streams)
        .max_local_error_reset_streams(b.max_local_error_reset_streams);
    builder
}

/// Runs the tasks of one session's streams, each until it ends or the
/// session does (`cut`, cancelled when the session is over): no stream
/// outlives its connection, its run or its bounds.
#[derive(Clone)]
pub struct SessionExec {
    pub cut: CancellationToken,
}

impl<F> hyper::rt::Executor<F> for SessionExec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let cut = self.cut.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = fut => {}
                _ = cut.cancelled() => {}
            }
        });
    }
}

/// The slot a stream holds: the session's own (the one its CONNECT took,
/// free while no other stream holds it) or another of the run's.
pub enum StreamSlot {
    Session(#[allow(dead_code)] OwnedSemaphorePermit),
    Run(#[allow(dead_code)] Slot),
}

/// What a stream holds while either of its directions is open: its slot,
/// and its deadline (past it, a direction still open fails and the stream
/// is reset).
pub struct Hold {
    pub slot: StreamSlot,
    pub deadline: Instant,
}

impl Hold {
    /// The two halves of the hold: one for the request body on its way to
    /// the origin, one for the response on its way to the tool. The slot
    /// is given back when both have ended (or failed, or were dropped).
    pub fn split(self) -> (Half, Half) {
        let slot = Arc::new(self.slot);
        let half = |slot| Half {
            _slot: slot,
            deadline: Box::pin(tokio::time::sleep_until(self.deadline)),
        };
        (half(slot.clone()), half(slot))
    }
}

/// One direction's share of a stream's [`Hold`].
pub struct Half {
    /// Given back when the last half is gone.
    _slot: Arc<StreamSlot>,
    deadline: Pin<Box<Sleep>>,
}

/// A body of one direction of a stream; with a [`Half`], bounded by the
/// stream's deadline and holding its share of the slot until the body ends,
/// fails or is dropped.
pub struct Held<B> {
    inner: B,
    hold: Option<Half>,
}

impl<B> Held<B> {
    pub fn new(inner: B, hold: Option<Half>) -> Held<B> {
        Held { inner, hold }
    }
}

/// The stream's deadline passed while one of its directions was still open.
#[derive(Debug, thiserror::Error)]
#[error("the stream's fetch deadline expired")]
pub struct StreamTimeout;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<B> Body for Held<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(h) = &mut this.hold {
            if h.deadline.as_mut().poll(cx).is_ready() {
                this.hold = None;
                return Poll::Ready(Some(Err(Box::new(StreamTimeout))));
            }
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.hold = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                // hyper stops polling once a body says it has ended.
                if this.inner.is_end_stream() {
                    this.hold = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.hold = None;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;
    use std::sync::Arc;

    /// A body that never ends.
    struct Endless;

    impl Body for Endless {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn both_directions_fail_at_the_deadline_and_give_the_slot_back() {
        let own = Arc::new(tokio::sync::Semaphore::new(1));
        let slot = StreamSlot::Session(own.clone().try_acquire_owned().unwrap());
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let (up, down) = Hold { slot, deadline }.split();
        let (mut upload, mut body) = (Held::new(Endless, Some(up)), Held::new(Endless, Some(down)));
        assert_eq!(own.available_permits(), 0, "held while the bodies run");
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.is::<StreamTimeout>(), "{err}");
        assert!(Instant::now() >= deadline);
        assert_eq!(own.available_permits(), 0, "the upload still holds it");
        let err = upload.frame().await.unwrap().unwrap_err();
        assert!(err.is::<StreamTimeout>(), "{err}");
        assert_eq!(own.available_permits(), 1, "given back at the deadline");
    }

    #[tokio::test]
    async fn the_slot_is_given_back_when_both_directions_ended() {
        let own = Arc::new(tokio::sync::Semaphore::new(1));
        let slot = StreamSlot::Session(own.clone().try_acquire_owned().unwrap());
        let far = Instant::now() + std::time::Duration::from_secs(60);
        let (up, down) = Hold { slot, deadline: far }.split();
        let mut upload = Held::new(http_body_util::Full::new(Bytes::from_static(b"up")), Some(up));
        let mut held = Held::new(http_body_util::Full::new(Bytes::from_static(b"ok")), Some(down));
        let data = held.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&data[..], b"ok");
        assert!(held.frame().await.is_none());
        assert_eq!(own.available_permits(), 0, "an upload still open keeps the slot");
        assert_eq!(&upload.frame().await.unwrap().unwrap().into_data().unwrap()[..], b"up");
        assert_eq!(own.available_permits(), 1, "given back at the upload's end");
        let mut plain = Held::new(http_body_util::Full::new(Bytes::from_static(b"x")), None);
        assert_eq!(&plain.frame().await.unwrap().unwrap().into_data().unwrap()[..], b"x");
    }

    #[test]
    fn the_bounds_stay_within_what_the_protocol_allows() {
        let b = &H2_BOUNDS;
        // RFC 9113 §6.5.2: frames between 16 KiB and 16 MiB - 1, windows under 2^31.
        assert!((16_384..16_777_216).contains(&b.max_frame_size));
        assert!(b.initial_stream_window <= b.initial_connection_window);
        assert!(b.initial_connection_window < 1 << 31);
        assert!(b.max_pending_accept_reset_streams > 0 && b.max_local_error_reset_streams > 0);
    }
}
