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
//! The connections themselves are made by `data::upstream`.

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

/// A verified TLS connection to an intercepted origin, in the protocol the
/// origin picked by ALPN.
pub enum Verified {
    H1(Conn),
    H2(H2Conn),
}

impl Verified {
    pub fn addr(&self) -> SocketAddr {
        match self {
            Verified::H1(c) => c.addr,
            Verified::H2(c) => c.addr,
        }
    }
}

/// What an idle connection sends on.
enum Sender {
    H1(http1::SendRequest<UpBody>),
    H2(http2::SendRequest<UpBody>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }

    fn is_ready(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_ready(),
            Sender::H2(s) => s.is_ready(),
        }
    }

    /// Waits until the connection can take a request; `false` once it closed.
    async fn ready(&mut self) -> bool {
        match self {
            Sender::H1(s) => s.ready().await.is_ok(),
            Sender::H2(s) => s.ready().await.is_ok(),
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
    addr: SocketAddr,
    /// The name the connection's TLS was verified for (an intercepted
    /// origin's); `None` for a plain-HTTP connection.
    verified_for: Option<Host>,
    sender: Sender,
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

    /// Takes an idle plain-HTTP connection to one of `vetted` on `port`, if any.
    pub fn take(&self, vetted: &[IpAddr], port: u16) -> Option<Conn> {
        match self.take_idle(None, vetted, port)? {
            Verified::H1(c) => Some(c),
            Verified::H2(_) => None,
        }
    }

    /// Takes an idle connection whose TLS was verified for `name`, to one
    /// of `vetted` on `port`, if any.
    pub fn take_verified(&self, name: &Host, vetted: &[IpAddr], port: u16) -> Option<Verified> {
        self.take_idle(Some(name), vetted, port)
    }

    fn take_idle(&self, name: Option<&Host>, vetted: &[IpAddr], port: u16) -> Option<Verified> {
        let mut idle = self.idle.lock().ok()?;
        retain_live(&mut idle);
        let pos = idle.iter().position(|i| {
            i.verified_for.as_ref() == name
                && i.addr.port() == port
                && vetted.contains(&i.addr.ip())
                && i.sender.is_ready()
        })?;
        let i = idle.swap_remove(pos);
        let guard = ConnGuard(Some(i.token));
        Some(match i.sender {
            Sender::H1(sender) => Verified::H1(Conn {
                addr: i.addr,
                sender,
                guard,
                reused: true,
            }),
            Sender::H2(sender) => Verified::H2(H2Conn {
                addr: i.addr,
                sender,
                guard,
            }),
        })
    }

    /// Keeps a connection whose exchange completed, at once if hyper has
    /// already finished its message (most of the time: no task to spawn);
    /// otherwise hands it back, for [`give_back`](Self::give_back).
    pub fn try_give_back(&self, conn: Conn, run_end: &CancellationToken) -> Result<(), Conn> {
        if !conn.sender.is_ready() {
            return Err(conn);
        }
        self.keep(None, conn.addr, Sender::H1(conn.sender), conn.guard, run_end);
        Ok(())
    }

    /// Waits (briefly) until hyper has finished the message of a connection
    /// whose exchange completed, then keeps it.
    pub async fn give_back(&self, mut conn: Conn, run_end: &CancellationToken) {
        let ready = tokio::time::timeout(Duration::from_secs(1), conn.sender.ready()).await;
        if matches!(ready, Ok(Ok(()))) {
            self.keep(None, conn.addr, Sender::H1(conn.sender), conn.guard, run_end);
        }
    }

    /// Keeps the verified connection of an intercepted CONNECT to `name`
    /// once its session is over, for the run's next intercepted CONNECT to
    /// that name: at once if hyper has finished its last message, otherwise
    /// after waiting (briefly) for that; a connection that does not get
    /// there is closed.
    pub async fn give_back_verified(&self, name: &Host, conn: Verified, run_end: &CancellationToken) {
        let (addr, mut sender, guard) = match conn {
            Verified::H1(c) => (c.addr, Sender::H1(c.sender), c.guard),
            Verified::H2(c) => (c.addr, Sender::H2(c.sender), c.guard),
        };
        if !sender.is_ready() {
            let ready = tokio::time::timeout(Duration::from_secs(1), sender.ready()).await;
            if !matches!(ready, Ok(true)) {
                return;
            }
        }
        self.keep(Some(name.clone()), addr, sender, guard, run_end);
    }

    /// Keeps a ready connection unless the pool is full or the run ended
    /// meanwhile (`run_end`).
    fn keep(
        &self,
        verified_for: Option<Host>,
        addr: SocketAddr,
        sender: Sender,
        mut guard: ConnGuard,
        run_end: &CancellationToken,
    ) {
        if run_end.is_cancelled() {
            return;
        }
        let Some(token) = guard.disarm() else { return };
        let Ok(mut idle) = self.idle.lock() else {
            token.cancel();
            return;
        };
        if idle.len() >= self.cap {
            token.cancel();
            return;
        }
        idle.push(Idle {
            addr,
            verified_for,
            sender,
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
