//! The small pool of idle upstream HTTP/1.1 connections each run keeps for
//! its own plain-HTTP fetches. A pooled connection is reused only by the
//! same run and only when its address is in the new fetch's own vetted set,
//! so pinning is never weakened: the connection goes to an address this
//! fetch resolved and vetted, exactly as a fresh dial would. Every
//! connection's driver task dies when the run ends, at hard shutdown, or
//! when a fetch abandons it mid-exchange (its [`ConnGuard`] is dropped).
//! The connections themselves are made by `data::upstream`.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::client::conn::http1::SendRequest;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The request body type of upstream connections (the data plane's upload,
/// boxed so that the pool does not depend on it).
pub type UpBody = UnsyncBoxBody<Bytes, hyper::Error>;

/// How long an idle upstream connection is kept for reuse.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Cancels the connection's driver on drop unless disarmed (handed to the pool).
pub struct ConnGuard(Option<CancellationToken>);

impl ConnGuard {
    /// Guards a connection whose driver stops when `driver` is cancelled.
    pub fn new(driver: CancellationToken) -> Self {
        ConnGuard(Some(driver))
    }

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
    pub sender: SendRequest<UpBody>,
    pub guard: ConnGuard,
    pub reused: bool,
}

impl Conn {
    /// A token that stops this connection's driver when cancelled.
    pub fn cut_token(&self) -> CancellationToken {
        self.guard.0.clone().unwrap_or_default()
    }
}

struct Idle {
    addr: SocketAddr,
    sender: SendRequest<UpBody>,
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

    /// Keeps a connection whose exchange completed, at once if hyper has
    /// already finished its message (most of the time: no task to spawn);
    /// otherwise hands it back, for [`give_back`](Self::give_back).
    pub fn try_give_back(&self, conn: Conn, run_end: &CancellationToken) -> Result<(), Conn> {
        if !conn.sender.is_ready() {
            return Err(conn);
        }
        self.keep(conn, run_end);
        Ok(())
    }

    /// Waits (briefly) until hyper has finished the message of a connection
    /// whose exchange completed, then keeps it.
    pub async fn give_back(&self, mut conn: Conn, run_end: &CancellationToken) {
        let ready = tokio::time::timeout(Duration::from_secs(1), conn.sender.ready()).await;
        if matches!(ready, Ok(Ok(()))) {
            self.keep(conn, run_end);
        }
    }

    /// Keeps a ready connection unless the pool is full or the run ended
    /// meanwhile (`run_end`).
    fn keep(&self, mut conn: Conn, run_end: &CancellationToken) {
        if run_end.is_cancelled() {
            return;
        }
        let Some(token) = conn.guard.disarm() else { return };
        let Ok(mut idle) = self.idle.lock() else {
            token.cancel();
            return;
        };
        if idle.len() >= self.cap {
            token.cancel();
            return;
        }
        idle.push(Idle {
            addr: conn.addr,
            sender: conn.sender,
            token,
            since: Instant::now(),
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
