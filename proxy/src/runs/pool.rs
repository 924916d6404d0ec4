//! The small pool of idle upstream connections each run keeps for its own
//! fetches: HTTP/1.1 connections of plain-HTTP fetches, and the verified TLS
//! connections (HTTP/1.1 or HTTP/2) of intercepted CONNECTs, which the
//! run's next intercepted CONNECT to the same name takes instead of dialling
//! and handshaking again. A pooled connection is reused only by the same
//! run and only when its address is in the new fetch's own vetted set, so
//! pinning is never weakened: the connection goes to an address this fetch
//! resolved and vetted, exactly as a fresh dial would. A verified
//! connection is reused only for the very name its certificate was
//! verified for, never for another name at the same address. Every
//! connection's driver task dies when the run ends, at hard shutdown, or
//! when a fetch abandons it mid-exchange (its [`ConnGuard`] is dropped).
//! The connections themselves are made by `data::carry::upstream`.

use bytes::Bytes;
use egress_config::Host;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::client::conn::{http1, http2};
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The request body type of upstream connections (the data plane's upload,
/// boxed so that the pool does not depend on it).
pub type UpBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

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
    pub sender: http1::SendRequest<UpBody>,
    pub guard: ConnGuard,
    pub reused: bool,
}

/// An HTTP/2 upstream connection (an intercepted origin that picked `h2`):
/// every stream of the session sends on a clone of `sender`; the driver
/// stops with the run, at shutdown, or when this is dropped (unless it was
/// kept in the pool).
pub struct H2Conn {
    pub addr: SocketAddr,
    pub sender: http2::SendRequest<UpBody>,
    pub guard: ConnGuard,
}

/// An upstream connection in the protocol the origin picked: HTTP/1.1 (plain
/// HTTP, or an intercepted origin's verified TLS) or HTTP/2 (an intercepted
/// origin that picked `h2` by ALPN).
pub enum Dialled {
    H1(Conn),
    H2(H2Conn),
}

impl Dialled {
    pub fn addr(&self) -> SocketAddr {
        match self {
            Dialled::H1(c) => c.addr,
            Dialled::H2(c) => c.addr,
        }
    }

    fn guard(&mut self) -> &mut ConnGuard {
        match self {
            Dialled::H1(c) => &mut c.guard,
            Dialled::H2(c) => &mut c.guard,
        }
    }

    fn is_closed(&self) -> bool {
        match self {
            Dialled::H1(c) => c.sender.is_closed(),
            Dialled::H2(c) => c.sender.is_closed(),
        }
    }

    fn is_ready(&self) -> bool {
        match self {
            Dialled::H1(c) => c.sender.is_ready(),
            Dialled::H2(c) => c.sender.is_ready(),
        }
    }

    /// Waits until the connection can take a request; `false` once it closed.
    async fn ready(&mut self) -> bool {
        match self {
            Dialled::H1(c) => c.sender.ready().await.is_ok(),
            Dialled::H2(c) => c.sender.ready().await.is_ok(),
        }
    }
}

impl Conn {
    /// A token that stops this connection's driver when cancelled.
    pub fn cut_token(&self) -> CancellationToken {
        self.guard.0.clone().unwrap_or_default()
    }
}

struct Idle {
    /// The name the connection's TLS was verified for (an intercepted
    /// origin's); `None` for a plain-HTTP connection.
    verified_for: Option<Host>,
    /// Its guard disarmed: `token` stops its driver.
    conn: Dialled,
    token: CancellationToken,
    since: Instant,
}

/// Drops (and closes) idle connections that closed or outlived `IDLE_TIMEOUT`.
fn retain_live(idle: &mut Vec<Idle>) {
    let now = Instant::now();
    idle.retain(|i| {
        let keep = !i.conn.is_closed() && now.duration_since(i.since) < IDLE_TIMEOUT;
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

    /// Takes an idle plain-HTTP connection to one of `vetted` on `port`, if any.
    pub fn take(&self, vetted: &[IpAddr], port: u16) -> Option<Conn> {
        match self.take_idle(None, vetted, port)? {
            Dialled::H1(c) => Some(c),
            Dialled::H2(_) => None,
        }
    }

    /// Takes an idle connection whose TLS was verified for `name`, to one
    /// of `vetted` on `port`, if any.
    pub fn take_verified(&self, name: &Host, vetted: &[IpAddr], port: u16) -> Option<Dialled> {
        self.take_idle(Some(name), vetted, port)
    }

    fn take_idle(&self, name: Option<&Host>, vetted: &[IpAddr], port: u16) -> Option<Dialled> {
        let mut idle = self.idle.lock().ok()?;
        retain_live(&mut idle);
        let pos = idle.iter().position(|i| {
            let addr = i.conn.addr();
            i.verified_for.as_ref() == name && addr.port() == port && vetted.contains(&addr.ip()) && i.conn.is_ready()
        })?;
        let Idle { mut conn, token, .. } = idle.swap_remove(pos);
        *conn.guard() = ConnGuard(Some(token));
        if let Dialled::H1(c) = &mut conn {
            c.reused = true;
        }
        Some(conn)
    }

    /// Keeps a connection whose exchange completed, at once if hyper has
    /// already finished its message (most of the time: no task to spawn);
    /// otherwise hands it back, for [`give_back`](Self::give_back).
    pub fn try_give_back(&self, conn: Conn, run_end: &CancellationToken) -> Result<(), Conn> {
        if !conn.sender.is_ready() {
            return Err(conn);
        }
        self.keep(None, Dialled::H1(conn), run_end);
        Ok(())
    }

    /// Waits (briefly) until hyper has finished the message of a connection
    /// whose exchange completed, then keeps it.
    pub async fn give_back(&self, conn: Conn, run_end: &CancellationToken) {
        self.settle(None, Dialled::H1(conn), run_end).await;
    }

    /// Keeps the verified connection of an intercepted CONNECT to `name`
    /// once its session is over, for the run's next intercepted CONNECT to
    /// that name, as [`give_back`](Self::give_back) does.
    pub async fn give_back_verified(&self, name: &Host, conn: Dialled, run_end: &CancellationToken) {
        self.settle(Some(name.clone()), conn, run_end).await;
    }

    /// Keeps `conn` once hyper has finished its last message: at once, or
    /// after waiting (at most 1 s) for that; a connection that does not get
    /// there is closed.
    async fn settle(&self, verified_for: Option<Host>, mut conn: Dialled, run_end: &CancellationToken) {
        if !conn.is_ready() {
            let ready = tokio::time::timeout(Duration::from_secs(1), conn.ready()).await;
            if !matches!(ready, Ok(true)) {
                return;
            }
        }
        self.keep(verified_for, conn, run_end);
    }

    /// Keeps a ready connection unless the pool is full or the run ended
    /// meanwhile (`run_end`).
    fn keep(&self, verified_for: Option<Host>, mut conn: Dialled, run_end: &CancellationToken) {
        if run_end.is_cancelled() {
            return;
        }
        let Some(token) = conn.guard().disarm() else { return };
        let Ok(mut idle) = self.idle.lock() else {
            token.cancel();
            return;
        };
        if idle.len() >= self.cap {
            token.cancel();
            return;
        }
        idle.push(Idle {
            verified_for,
            conn,
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
