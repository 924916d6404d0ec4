//! The relay fallback (no hand-off socket configured): the executor accepts
//! on a confined child's in-namespace listener and carries each connection to
//! the proxy's data address, with `splice(2)` through a pipe per direction (no
//! user-space buffer). The proxy then sees the executor as the client, so
//! connections are not bound to the run the way a handed-off listener's are.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Most connections relayed at once for one child.
const MAX_RELAYED: usize = 64;

/// A child's listener, served by the executor.
pub struct Relay {
    listener: TcpListener,
}

impl Relay {
    pub fn new(l: std::net::TcpListener) -> io::Result<Relay> {
        l.set_nonblocking(true)?;
        Ok(Relay {
            listener: TcpListener::from_std(l)?,
        })
    }

    /// Serve until the returned guard is dropped (which also cuts every
    /// relayed connection).
    pub fn start(self, upstream: SocketAddr) -> DropGuard {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_RELAYED));
        tokio::spawn(async move {
            loop {
                let permit = tokio::select! {
                    _ = token.cancelled() => return,
                    p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                };
                let accepted = tokio::select! {
                    _ = token.cancelled() => return,
                    a = self.listener.accept() => a,
                };
                let Ok((inner, _)) = accepted else { continue };
                let token = token.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let Ok(outer) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = inner.set_nodelay(true);
                    let _ = outer.set_nodelay(true);
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = carry(&inner, &outer) => {}
                    }
                });
            }
        });
        stop.drop_guard()
    }
}

/// Both directions until both reached EOF (or one failed).
async fn carry(a: &TcpStream, b: &TcpStream) -> io::Result<()> {
    egress_splice::both_ways(a, b, |_| {}, |_| {}).await
}
