//! CONNECT tunnels (RFC 9110 §9.3.6): after the `200`, bytes are copied both
//! ways, half-close aware, byte-counted, until both sides finish, the tunnel
//! idles past `tunnel_idle_timeout`, the fetch deadline expires or the run
//! ends. The slot is held until the tunnel is gone.

use crate::finish::Finish;
use crate::slots::Slot;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Counts bytes read and notes the time of the last activity.
struct Metered<'a, T> {
    io: T,
    bytes: &'a AtomicU64,
    last: &'a AtomicU64,
    epoch: Instant,
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<'_, T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.bytes.fetch_add(n as u64, Ordering::Relaxed);
            self.last
                .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<'_, T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

pub struct Tunnel {
    pub upgrade: OnUpgrade,
    pub upstream: TcpStream,
    pub slot: Slot,
    pub deadline: Instant,
    pub idle: Duration,
    pub cancel: CancellationToken,
    pub shutdown: CancellationToken,
    pub finish: Finish,
}

/// Runs a tunnel to completion. Spawned after the `200` is queued.
pub async fn run(t: Tunnel) {
    let Tunnel {
        upgrade,
        upstream,
        slot,
        deadline,
        idle,
        cancel,
        shutdown,
        finish,
    } = t;
    let _slot = slot;
    let client = tokio::select! {
        u = upgrade => match u {
            Ok(u) => u,
            Err(_) => { finish.failed("upgrade_failed"); return; }
        },
        _ = tokio::time::sleep_until(deadline) => { finish.timed_out("tunnel"); return; }
        _ = cancel.cancelled() => { finish.severed("run_ended"); return; }
    };
    let up = AtomicU64::new(0);
    let down = AtomicU64::new(0);
    let last = AtomicU64::new(0);
    let epoch = Instant::now();
    let mut a = Metered {
        io: TokioIo::new(client),
        bytes: &up,
        last: &last,
        epoch,
    };
    let mut b = Metered {
        io: upstream,
        bytes: &down,
        last: &last,
        epoch,
    };
    {
        let copy = tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, 16 * 1024, 16 * 1024);
        tokio::pin!(copy);
        let deadline_sleep = tokio::time::sleep_until(deadline);
        tokio::pin!(deadline_sleep);
        let mut idle_check = Box::pin(tokio::time::sleep(idle));
        loop {
            tokio::select! {
                r = &mut copy => {
                    match r {
                        Ok(_) => finish.complete(),
                        Err(_) => finish.failed("io_error"),
                    }
                    break;
                }
                _ = &mut deadline_sleep => { finish.timed_out("tunnel"); break; }
                _ = cancel.cancelled() => { finish.severed("run_ended"); break; }
                _ = shutdown.cancelled() => { finish.severed("shutdown"); break; }
                _ = &mut idle_check => {
                    let last_at = epoch + Duration::from_millis(last.load(Ordering::Relaxed));
                    let quiet = Instant::now().saturating_duration_since(last_at);
                    if quiet >= idle {
                        finish.severed("idle_timeout");
                        break;
                    }
                    idle_check.as_mut().reset(last_at + idle);
                }
            }
        }
    }
    finish.add_up(up.load(Ordering::Relaxed));
    finish.add_down(down.load(Ordering::Relaxed));
}
