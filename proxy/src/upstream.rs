//! Upstream HTTP/1.1 connections for plain-HTTP fetches, and the small pool
//! of idle ones each run keeps. A pooled connection is reused only by the
//! same run and only when its address is in the new fetch's own vetted set,
//! so pinning is never weakened: the connection goes to an address this
//! fetch resolved and vetted, exactly as a fresh dial would. Every
//! connection's driver task dies when the run ends, at hard shutdown, or
//! when a fetch abandons it mid-exchange (its [`ConnGuard`] is dropped).

use crate::body::Upload;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// How long an idle upstream connection is kept for reuse.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Cancels the connection's driver on drop unless disarmed (handed to the pool).
pub struct ConnGuard(Option<CancellationToken>);

impl ConnGuard {
    fn disarm(&mut self) -> Option<CancellationToken> {
        self.0.take()
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.cancel();
        }
    }
}

/// A connection ready to carry one exchange.
pub struct Conn {
    pub addr: SocketAddr,
    pub sender: SendRequest<Upload>,
    pub guard: ConnGuard,
    pub reused: bool,
}

impl Conn {
    /// A token that stops this connection's driver when cancelled.
    pub fn cut_token(&self) -> CancellationToken {
        self.guard.0.clone().unwrap_or_default()
    }
}

/// Performs the HTTP/1.1 handshake on a dialled, vetted stream and spawns its
/// driver, bound to the run (`run_end`) and to shutdown (`hard_stop`).
pub async fn handshake(
    stream: TcpStream,
    addr: SocketAddr,
    run_end: CancellationToken,
    hard_stop: CancellationToken,
) -> Result<Conn, hyper::Error> {
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await?;
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
    Ok(Conn {
        addr,
        sender,
        guard: ConnGuard(Some(token)),
        reused: false,
    })
}

struct Idle {
    addr: SocketAddr,
    sender: SendRequest<Upload>,
    token: CancellationToken,
    since: Instant,
}

/// Drops (and closes) idle connections that closed or outlived `IDLE_TIMEOUT`.
fn retain_live(idle: &mut Vec<Idle>) {
    let now = Instant::now();
    idle.retain(|i| {
        let keep = !i.sender.is_closed() && now.duration_since(i.since) < IDLE_TIMEOUT;
        if !keep {
            i.token.cancel();
        }
        keep
    });
}

/// A run's idle upstream connections (at most `cap`, each at most `IDLE_TIMEOUT` old).
pub struct UpstreamPool {
    idle: Mutex<Vec<Idle>>,
    cap: usize,
}

impl UpstreamPool {
    pub fn new(cap: usize) -> Self {
        UpstreamPool {
            idle: Mutex::new(Vec::new()),
            cap,
        }
    }

    /// Takes an idle connection to one of `vetted` on `port`, if any.
    pub fn take(&self, vetted: &[IpAddr], port: u16) -> Option<Conn> {
        let mut idle = self.idle.lock().ok()?;
        retain_live(&mut idle);
        let pos = idle
            .iter()
            .position(|i| i.addr.port() == port && vetted.contains(&i.addr.ip()) && i.sender.is_ready())?;
        let i = idle.swap_remove(pos);
        Some(Conn {
            addr: i.addr,
            sender: i.sender,
            guard: ConnGuard(Some(i.token)),
            reused: true,
        })
    }

    /// Returns a connection whose exchange completed; waits (briefly) until
    /// hyper has finished the message, and drops it if it cannot be reused.
    pub fn give_back(run: std::sync::Arc<crate::runs::Run>, mut conn: Conn) {
        tokio::spawn(async move {
            let ready = tokio::time::timeout(Duration::from_secs(1), conn.sender.ready()).await;
            if !matches!(ready, Ok(Ok(()))) || run.cancel.is_cancelled() {
                return;
            }
            let Some(token) = conn.guard.disarm() else { return };
            let Ok(mut idle) = run.upstream.idle.lock() else {
                token.cancel();
                return;
            };
            if idle.len() >= run.upstream.cap {
                token.cancel();
                return;
            }
            idle.push(Idle {
                addr: conn.addr,
                sender: conn.sender,
                token,
                since: Instant::now(),
            });
        });
    }

    /// Drops expired idle connections.
    pub fn prune(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            retain_live(&mut idle);
        }
    }

    /// Closes every idle connection (run end).
    pub fn clear(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            for i in idle.drain(..) {
                i.token.cancel();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.idle.lock().map(|i| i.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
