//! The SOCKS5 entrance (RFC 1928) on the data listeners, for clients that
//! speak it (`ALL_PROXY=socks5h://run:secret@…`): detected on the first
//! byte (5) of a connection. It parses, and the decisions are the others':
//!
//! - the one method is username/password (RFC 1929) with the run's id and
//!   secret, checked as `Proxy-Authorization` is (a handed-over listener
//!   takes only its own run's credential, a bound run's credential is taken
//!   only there); no acceptable method, a wrong secret, an unknown run or a
//!   credential presented where its binding refuses it is a fact, status 1,
//!   and the connection is closed;
//! - the one command is `CONNECT`: `BIND` and `UDP ASSOCIATE` answer
//!   "command not supported" and are a `method_not_allowed` fact;
//! - a domain name goes through the same canonicalizer as every target and
//!   the allowlist before any DNS; an IPv4 or IPv6 address is an IP literal
//!   (`ip_literal` unless listed);
//! - then the CONNECT path's steps ([`Fetch::decide`], [`Fetch::open_tunnel`]):
//!   slots, resolve-and-pin, deadline, interception of credential hosts,
//!   facts. Every denial is a fact before its SOCKS answer, whose reply
//!   code says the class ([`reply_code`]).
//!
//! Every read of the negotiation is bounded in bytes (a name is at most 255)
//! and in time (`header_read_timeout_ms`).

use crate::admission::Conn;
use crate::data::carry::tunnel::Client;
use crate::data::decide::auth::{self, BoundRun};
use crate::data::decide::fetch::{Ask, Dest, Fetch};
use crate::data::decide::policy::Head;
use crate::data::decide::target::{Kind, Target, TargetError};
use crate::data::entrance::http::{establish, refuse_credential, Answer};
use crate::deny::{DenyReason, FetchError};
use crate::state::Shared;
use egress_config::Host;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The protocol version, and the first byte of a SOCKS5 connection.
pub const VERSION: u8 = 5;
const USER_PASS: u8 = 2;
const NO_METHOD: u8 = 0xff;
const CMD_CONNECT: u8 = 1;
const ATYP_V4: u8 = 1;
const ATYP_NAME: u8 = 3;
const ATYP_V6: u8 = 4;

/// RFC 1928 §6 reply codes.
mod rep {
    pub const OK: u8 = 0;
    pub const FAILURE: u8 = 1;
    pub const NOT_ALLOWED: u8 = 2;
    pub const HOST_UNREACHABLE: u8 = 4;
    pub const REFUSED: u8 = 5;
    pub const TTL_EXPIRED: u8 = 6;
    pub const COMMAND: u8 = 7;
    pub const ADDRESS_TYPE: u8 = 8;
}

/// The reply code for an answer the decision steps gave (a denial, or an
/// error that is not policy), read from the one outcome table's codes.
pub fn reply_code(a: &Answer) -> u8 {
    let header = |name: &str| a.headers().get(name).and_then(|v| v.to_str().ok());
    if header("x-egress-deny-reason").is_some() {
        return rep::NOT_ALLOWED;
    }
    match header("x-egress-error") {
        Some(e) if e == FetchError::DnsNotFound.code() || e == FetchError::DnsFailed.code() => rep::HOST_UNREACHABLE,
        Some(e) if e == FetchError::ConnectFailed.code() => rep::REFUSED,
        Some(e) if e == FetchError::Timeout.code() => rep::TTL_EXPIRED,
        _ => rep::FAILURE,
    }
}

/// The request's destination as SOCKS5 carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    Ip(IpAddr, u16),
    Name(String, u16),
}

impl Destination {
    /// The canonical target: a name through the one canonicalizer (which
    /// finds an address spelled as a name too).
    pub fn target(&self) -> Result<Target, TargetError> {
        let (host, port) = match self {
            Destination::Ip(ip, port) => (Host::Ip(*ip), *port),
            Destination::Name(n, port) => (
                egress_config::parse_host(n).map_err(|e| TargetError::Bad(format!("SOCKS5 name {n:?}: {e}")))?,
                *port,
            ),
        };
        if port == 0 {
            return Err(TargetError::Bad("SOCKS5 destination port 0".into()));
        }
        Ok(Target {
            kind: Kind::Connect,
            host,
            port,
            path_and_query: None,
        })
    }

    /// As written, for facts that quote it.
    pub fn raw(&self) -> String {
        match self {
            Destination::Ip(IpAddr::V6(ip), port) => format!("[{ip}]:{port}"),
            Destination::Ip(ip, port) => format!("{ip}:{port}"),
            Destination::Name(n, port) => format!("{}:{port}", n.escape_debug()),
        }
    }
}

/// The destination is what a credential could be hidden in.
impl Head for Destination {
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        match self {
            Destination::Name(n, _) => f(n.as_bytes()),
            Destination::Ip(..) => false,
        }
    }
}

/// Why a negotiation ended before a decision.
#[derive(Debug, thiserror::Error)]
pub enum SocksError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the client stopped before {0} within the head read timeout")]
    Timeout(&'static str),
    #[error("not SOCKS5 (version {0})")]
    Version(u8),
}

/// A parsed request: the command and the destination (`Err`: an address
/// type the protocol does not define).
struct Request {
    command: u8,
    destination: Result<Destination, u8>,
}

/// Serves one SOCKS5 connection (its first byte, 5, not yet read).
pub async fn serve(sh: Arc<Shared>, s: TcpStream, conn: Arc<Conn>, bound: Option<BoundRun>) {
    let started = Instant::now();
    if let Err(e) = negotiate(&sh, s, &conn, bound.as_ref(), started).await {
        tracing::debug!(target: "egress::socks", error = %e, "SOCKS5 connection ended");
    }
}

async fn negotiate(
    sh: &Arc<Shared>,
    mut stream: TcpStream,
    conn: &Conn,
    bound: Option<&BoundRun>,
    started: Instant,
) -> Result<(), SocksError> {
    let s = &mut stream;
    let limit = sh.cfg.header_read_timeout;
    // Greeting: VER NMETHODS METHODS.
    let head = timed(limit, "the greeting", read_exact::<2>(s)).await?;
    if head[0] != VERSION {
        return Err(SocksError::Version(head[0]));
    }
    let methods = timed(limit, "the greeting", read_vec(s, usize::from(head[1]))).await?;
    let policy = sh.policy.load_full();
    if !methods.contains(&USER_PASS) {
        s.write_all(&[VERSION, NO_METHOD]).await?;
        let f = auth::AuthFailure {
            reason: DenyReason::AuthMissing,
            claimed: None,
            on: None,
        };
        refuse_credential(
            sh,
            &policy,
            f,
            (Kind::Connect, None),
            started,
            socks_raw("no username/password method offered"),
            false,
        )
        .await;
        return Ok(());
    }
    s.write_all(&[VERSION, USER_PASS]).await?;
    // RFC 1929: VER ULEN UNAME PLEN PASSWD.
    let ver_len = timed(limit, "the credential", read_exact::<2>(s)).await?;
    let user = timed(limit, "the credential", read_vec(s, usize::from(ver_len[1]))).await?;
    let plen = timed(limit, "the credential", read_exact::<1>(s)).await?;
    let secret = timed(limit, "the credential", read_vec(s, usize::from(plen[0]))).await?;
    let run = if ver_len[0] != 1 {
        Err(auth::AuthFailure {
            reason: DenyReason::AuthInvalid,
            claimed: None,
            on: None,
        })
    } else {
        auth::authenticate_pair(&sh.runs, &user, &secret, auth::Presented::on(bound))
    };
    let run = match run {
        Ok(run) => run,
        Err(f) => {
            s.write_all(&[1, 1]).await?;
            refuse_credential(
                sh,
                &policy,
                f,
                (Kind::Connect, None),
                started,
                socks_raw("before its request"),
                false,
            )
            .await;
            return Ok(());
        }
    };
    if establish(sh, conn, &run).is_some() {
        s.write_all(&[1, 1]).await?;
        return Ok(());
    }
    s.write_all(&[1, 0]).await?;
    let req = timed(limit, "the request", read_request(s)).await?;
    if sh.shutdown.is_cancelled() {
        return answer(s, rep::FAILURE).await;
    }
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(&run), &tm, Kind::Connect, started);
    let destination = match (req.command, req.destination) {
        (_, Err(atyp)) => {
            let detail = format!("SOCKS5 address type {atyp} is not defined (1: IPv4, 3: name, 4: IPv6)");
            let a = fetch
                .deny(DenyReason::BadTarget, detail, Dest::Raw(socks_raw("request")), &[])
                .await;
            drop(a);
            return answer(s, rep::ADDRESS_TYPE).await;
        }
        (CMD_CONNECT, Ok(d)) => d,
        (cmd, Ok(d)) => {
            let name = match cmd {
                2 => "BIND".to_owned(),
                3 => "UDP ASSOCIATE".to_owned(),
                n => format!("command {n}"),
            };
            let detail = format!("SOCKS5 {name} is not supported: CONNECT is the one command");
            fetch
                .deny(DenyReason::MethodNotAllowed, detail, Dest::Raw(d.raw()), &[])
                .await;
            return answer(s, rep::COMMAND).await;
        }
    };
    let raw = destination.raw();
    let ask = Ask {
        target: destination.target(),
        method: "CONNECT",
        head: &destination,
        raw: &|| raw.clone(),
        upgrade: crate::data::decide::policy::Upgrade::None,
        at: auth::Presented::on(bound),
    };
    let prepared = match fetch.decide(&run, ask).await {
        Ok(p) => p,
        Err(a) => return answer(s, reply_code(&a)).await,
    };
    let opened = match fetch.open_tunnel(prepared, sh, &run).await {
        Ok(o) => o,
        Err(a) => return answer(s, reply_code(&a)).await,
    };
    answer(s, rep::OK).await?;
    opened.start(Client::Tcp(stream, bytes::Bytes::new()));
    Ok(())
}

/// A request: VER CMD RSV ATYP DST.ADDR DST.PORT.
async fn read_request(s: &mut TcpStream) -> Result<Request, SocksError> {
    let head = read_exact::<4>(s).await?;
    if head[0] != VERSION {
        return Err(SocksError::Version(head[0]));
    }
    let destination = match head[3] {
        ATYP_V4 => {
            let a = read_exact::<4>(s).await?;
            Ok(Destination::Ip(IpAddr::V4(Ipv4Addr::from(a)), port(s).await?))
        }
        ATYP_V6 => {
            let a = read_exact::<16>(s).await?;
            Ok(Destination::Ip(IpAddr::V6(Ipv6Addr::from(a)), port(s).await?))
        }
        ATYP_NAME => {
            let len = read_exact::<1>(s).await?;
            let name = read_vec(s, usize::from(len[0])).await?;
            let name = String::from_utf8_lossy(&name).into_owned();
            Ok(Destination::Name(name, port(s).await?))
        }
        other => Err(other),
    };
    Ok(Request {
        command: head[1],
        destination,
    })
}

async fn port(s: &mut TcpStream) -> io::Result<u16> {
    Ok(u16::from_be_bytes(read_exact::<2>(s).await?))
}

async fn read_exact<const N: usize>(s: &mut TcpStream) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b).await?;
    Ok(b)
}

/// At most 255 bytes: every length SOCKS5 sends is one byte.
async fn read_vec(s: &mut TcpStream, n: usize) -> io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).await?;
    Ok(b)
}

async fn timed<T, E: Into<SocksError>>(
    limit: std::time::Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, SocksError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(SocksError::Timeout(what)),
    }
}

/// A reply with `code` and an unspecified bound address (0.0.0.0:0).
async fn answer(s: &mut TcpStream, code: u8) -> Result<(), SocksError> {
    s.write_all(&[VERSION, code, 0, ATYP_V4, 0, 0, 0, 0, 0, 0]).await?;
    Ok(())
}

/// The raw target a fact quotes when the SOCKS5 request named none yet.
fn socks_raw(when: &str) -> String {
    format!("SOCKS5, {when}")
}
