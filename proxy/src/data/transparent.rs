//! The transparent entrance: every TCP connection a confined child of a
//! `network = "transparent"` tool makes to an address outside its
//! namespace arrives here, on listeners the executor made inside that
//! namespace and handed over for the run. The namespace is the identity: a
//! connection is the run's, with no credential (and none accepted).
//!
//! The connection's original destination (`SO_ORIGINAL_DST`) is where the
//! child was going: a synthetic address its DNS was given for a name
//! (`runs::names`) stands for that name; any other address is an IP
//! literal, denied unless the tool lists it. Then its first bytes
//! ([`sniff`]) say what it carries, and the same decisions as every
//! entrance's apply:
//!
//! - plain HTTP: each request is origin-form on that host and port (`Host`
//!   naming another is `host_mismatch`), and goes the forward path (methods,
//!   credentials, facts); a `Proxy-Authorization` it carries grants
//!   nothing, but another bound run's valid credential is refused
//!   (`credential_elsewhere`, see `auth::carried`);
//! - TLS: its server name must be the name (`host_mismatch` otherwise), and
//!   it goes as a CONNECT would (intercepted for a credential host or an
//!   `inspect` tool, else a spliced tunnel to the pinned address);
//! - anything else (or nothing yet, when the server speaks first): a raw
//!   relay to the pinned address, as a CONNECT (a tool that restricts
//!   `methods` must list `CONNECT`).
//!
//! Facts, metrics and logs label these fetches `transparent`.

use crate::admission::{Admission, Conn};
use crate::data::auth::{self, Presented};
use crate::data::decide::{Ask, Dest, Fetch};
use crate::data::fetch::{establish, refuse_credential, serve_run};
use crate::data::policy::Head;
use crate::data::respond::{self, raw_target};
use crate::data::sniff::{self, First};
use crate::data::target::{self, server_name_is, Kind, Target, TargetError};
use crate::data::tunnel::Client;
use crate::deny::{DenyReason, Via};
use crate::listener::serve_one;
use crate::runs::{names, Run};
use crate::state::Shared;
use egress_config::Host;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a connection's first bytes are waited for before it counts as
/// one whose server speaks first (a raw relay).
const SNIFF_WAIT: Duration = Duration::from_millis(300);

/// Serves a run's transparent listener until the run ends.
pub async fn serve(sh: Arc<Shared>, run: Arc<Run>, l: TcpListener, admission: Arc<Admission>) {
    loop {
        let accepted = tokio::select! {
            a = l.accept() => a,
            _ = run.cancel.cancelled() => return,
            _ = sh.shutdown.cancelled() => return,
        };
        let Ok((s, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let _ = s.set_nodelay(true);
        let (sh2, run2, admission) = (sh.clone(), run.clone(), admission.clone());
        sh.tasks.spawn(async move {
            let conn = Arc::new(admission.admit(CancellationToken::new()));
            let cut = conn.cut.clone();
            tokio::select! {
                _ = one(&sh2, &run2, s, &conn) => {}
                _ = cut.cancelled() => {}
                _ = sh2.hard_stop.cancelled() => {}
            }
        });
    }
}

/// The original destination of a connection redirected to `s`'s listener.
fn original_destination(s: &TcpStream) -> std::io::Result<SocketAddr> {
    if s.local_addr()?.is_ipv4() {
        rustix::net::sockopt::ip_original_dst(s)
            .map(SocketAddr::V4)
            .map_err(Into::into)
    } else {
        rustix::net::sockopt::ipv6_original_dst(s)
            .map(SocketAddr::V6)
            .map_err(Into::into)
    }
}

/// Where the sandbox was going: the name a synthetic address stands for,
/// or the address itself.
pub fn destination(run: &Run, dest: SocketAddr) -> Target {
    let ip = dest.ip().to_canonical();
    let named = names::synthetic(ip)
        .then(|| run.names.lock().ok().and_then(|n| n.name(ip)))
        .flatten();
    Target {
        kind: Kind::Connect,
        host: match named {
            Some(n) => Host::Name(n.to_string()),
            None => Host::Ip(ip),
        },
        port: dest.port(),
        path_and_query: None,
    }
}

/// The destination's name, the one piece of a raw connection a credential
/// could be carried in.
struct Named<'a>(&'a Target);

impl Head for Named<'_> {
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        match &self.0.host {
            Host::Name(n) => f(n.as_bytes()),
            Host::Ip(_) => false,
        }
    }
}

async fn one(sh: &Arc<Shared>, run: &Arc<Run>, s: TcpStream, conn: &Arc<Conn>) {
    if establish(sh, conn, run).is_some() {
        return;
    }
    let Ok(dest) = original_destination(&s) else {
        tracing::warn!(run = %run.id, "a transparent connection without its original destination; closed");
        return;
    };
    let started = Instant::now();
    let dest = destination(run, dest);
    match sniff::sniff(&s, SNIFF_WAIT).await {
        Ok(First::Http) => http(sh, run, s, dest, conn).await,
        Ok(First::Tls { sni }) => relay(sh, run, s, dest, sni, started).await,
        Ok(First::Other) => relay(sh, run, s, dest, None, started).await,
        Err(_) => {}
    }
}

/// TLS or anything else: decided as a CONNECT to the destination, then
/// carried (the bytes peeked at are still in the socket).
async fn relay(sh: &Arc<Shared>, run: &Arc<Run>, s: TcpStream, dest: Target, sni: Option<String>, started: Instant) {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Connect, started).via(Via::Transparent);
    if let Some(sni) = sni.filter(|n| !server_name_is(&dest.host, n)) {
        let detail = format!(
            "TLS server name {:?} is not the name {} the connection goes to",
            sni.escape_debug().to_string(),
            dest.host
        );
        let _ = fetch
            .deny(DenyReason::HostMismatch, detail, Dest::Target(&dest), &[])
            .await;
        return;
    }
    let raw = dest.to_string();
    let ask = Ask {
        target: Ok(dest.clone()),
        method: "CONNECT",
        head: &Named(&dest),
        raw: &|| raw.clone(),
        upgrade: crate::data::policy::Upgrade::None,
        at: Presented::RunListener(&run.id),
    };
    let Ok(prepared) = fetch.decide(run, ask).await else {
        return;
    };
    if let Ok(opened) = fetch.open_tunnel(prepared, sh, run).await {
        opened.start(Client::Tcp(s));
    }
}

/// Plain HTTP: an HTTP/1.1 server on the connection, each request decided
/// on the destination's host and port.
async fn http(sh: &Arc<Shared>, run: &Arc<Run>, s: TcpStream, dest: Target, conn: &Arc<Conn>) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(sh.cfg.header_read_timeout)
        .max_buf_size(sh.cfg.max_header_bytes.max(8192) + 1024)
        .max_header_size(sh.cfg.max_header_bytes)
        .max_headers(128)
        .keep_alive(true);
    let dest = Arc::new(dest);
    let (sh2, run2, conn2) = (sh.clone(), run.clone(), conn.clone());
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let (sh, run, conn, dest) = (sh2.clone(), run2.clone(), conn2.clone(), dest.clone());
        async move {
            let started = Instant::now();
            let target = if req.method() == http::Method::CONNECT {
                Err(TargetError::Bad(
                    "CONNECT on a transparent connection: it goes to one host already".into(),
                ))
            } else {
                target::parse_transparent(&dest, req.uri(), req.headers())
            };
            let policy = sh.policy.load_full();
            if let Err(f) = auth::carried(&sh.runs, req.headers(), &run) {
                let (raw, json) = (raw_target(req.uri()), respond::accepts_json(req.headers()));
                let how = (Kind::Http, Some(Via::Transparent));
                return Ok(refuse_credential(&sh, &policy, f, how, started, raw, json).await);
            }
            let at = Presented::RunListener(&run.id);
            Ok::<_, std::convert::Infallible>(
                serve_run(&sh, &policy, &run, req, target, &conn, (Via::Transparent, at), started).await,
            )
        }
    });
    let c = builder.serve_connection(TokioIo::new(s), svc).with_upgrades();
    serve_one(&sh.shutdown, &sh.hard_stop, &conn.cut, c).await;
}
