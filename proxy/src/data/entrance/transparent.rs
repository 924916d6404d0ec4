//! The transparent entrance: every TCP connection a confined child of a
//! `network = "transparent"` tool makes to an address outside its
//! namespace arrives here, on listeners the executor made inside that
//! namespace and handed over for the run. The namespace is the identity: a
//! connection is the run's, with no credential (and none accepted).
//!
//! The connection's original destination (`SO_ORIGINAL_DST`) is where the
//! child was going: a synthetic address its DNS was given for a name
//! (`runs::names`) stands for that name; any other address is an IP
//! literal, denied unless the tool lists it. A destination an entry relays
//! raw (`protocol = "tcp"`, [`policy::relays_raw`]) goes as a CONNECT would,
//! at once, no byte looked at. For any other, its first bytes are read
//! until they are whole ([`sniff`]: a ClientHello, a request head), within
//! `header_read_timeout_ms`, and the same decisions as every entrance's
//! apply:
//!
//! - plain HTTP: each request is origin-form on that host and port (`Host`
//!   naming another is `host_mismatch`), and goes the forward path (methods,
//!   credentials, facts); a `Proxy-Authorization` it carries grants
//!   nothing, but another bound run's valid credential is refused
//!   (`credential_elsewhere`, see `auth::carried`);
//! - TLS: its server name must be the name (`host_mismatch` otherwise), and
//!   it goes as a CONNECT would (intercepted for a credential host or an
//!   `inspect` tool, else a spliced tunnel to the pinned address);
//! - anything else — other bytes, nothing within the timeout (a server that
//!   speaks first), the client closing first, HTTP/2 with prior knowledge —
//!   is `protocol_unknown` ([`policy::unknown_protocol`]), a fact, and the
//!   connection is closed; nothing was sent anywhere. (Report mode records
//!   it and relays raw.)
//!
//! The bytes read go first to the origin (or the HTTP server). Facts,
//! metrics and logs label these fetches `transparent`.

use crate::admission::{Admission, Conn};
use crate::data::carry::prefixed::Prefixed;
use crate::data::carry::sniff::{self, First, Sniffed, Unknown};
use crate::data::carry::tunnel::Client;
use crate::data::decide::auth::{self, Presented};
use crate::data::decide::fetch::{Ask, Dest, Fetch};
use crate::data::decide::policy::{self, Head};
use crate::data::decide::target::raw_target;
use crate::data::decide::target::{self, server_name_is, Kind, Target, TargetError};
use crate::data::entrance::http::{establish, refuse_credential, serve_run};
use crate::deny::{DenyReason, Via};
use crate::listener::serve_one;
use crate::runs::{names, Run};
use crate::state::Shared;
use bytes::Bytes;
use egress_config::Host;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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

async fn one(sh: &Arc<Shared>, run: &Arc<Run>, mut s: TcpStream, conn: &Arc<Conn>) {
    if establish(sh, conn, run).is_some() {
        return;
    }
    let Ok(dest) = original_destination(&s) else {
        tracing::warn!(run = %run.id, "a transparent connection without its original destination; closed");
        return;
    };
    let started = Instant::now();
    let dest = destination(run, dest);
    let raw = sh
        .policy
        .load()
        .tool(&run.tool)
        .is_some_and(|t| policy::relays_raw(t, &dest));
    if raw {
        return relay(sh, run, s, Bytes::new(), dest, Carried::Raw, started).await;
    }
    let (wait, max_head) = (sh.cfg.header_read_timeout, sh.cfg.max_header_bytes);
    match sniff::sniff(&mut s, started, wait, max_head).await {
        Ok(Sniffed {
            first: First::Http,
            bytes,
        }) => http(sh, run, Prefixed::new(bytes, s), dest, conn).await,
        Ok(Sniffed {
            first: First::Tls { sni },
            bytes,
        }) => relay(sh, run, s, bytes, dest, Carried::Tls { sni }, started).await,
        Ok(Sniffed {
            first: First::Unknown(why),
            bytes,
        }) => unknown(sh, run, s, bytes, dest, why, started).await,
        Err(_) => {}
    }
}

/// Neither TLS nor HTTP the proxy can check: `protocol_unknown`, after the
/// run's own state (an ended run's connection is `run_ended`). Report mode
/// records it and relays raw.
async fn unknown(
    sh: &Arc<Shared>,
    run: &Arc<Run>,
    s: TcpStream,
    early: Bytes,
    dest: Target,
    why: Unknown,
    started: Instant,
) {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Connect, started).via(Via::Transparent);
    let raw = dest.to_string();
    let Ok(tool) = fetch.check_run(run, &|| raw.clone()).await else {
        return;
    };
    match policy::unknown_protocol(&tool, &dest, &why) {
        policy::Admission::Report { denial, .. } => {
            relay(sh, run, s, early, dest, Carried::Reported(denial), started).await;
        }
        policy::Admission::Deny(d) => {
            let _ = fetch.deny(d.reason, d.detail, Dest::Target(&dest), &[]).await;
        }
        policy::Admission::Allow { .. } => {}
    }
}

/// What a connection relayed as a CONNECT was found to carry.
enum Carried {
    /// A ClientHello, with its server name if it names one.
    Tls { sni: Option<String> },
    /// Nothing looked at: its entry says `protocol = "tcp"`.
    Raw,
    /// Neither TLS nor HTTP, let through by report mode: this denial is
    /// recorded first.
    Reported(policy::Denial),
}

/// A connection decided as a CONNECT to the destination, then carried, the
/// bytes read already (`early`) first: TLS, once its server name is the
/// destination's; raw.
async fn relay(
    sh: &Arc<Shared>,
    run: &Arc<Run>,
    s: TcpStream,
    early: Bytes,
    dest: Target,
    carried: Carried,
    started: Instant,
) {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Connect, started).via(Via::Transparent);
    match carried {
        Carried::Tls { sni: Some(sni) } if !server_name_is(&dest.host, &sni) => {
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
        Carried::Reported(denial) => {
            if fetch.report(&denial, &dest, &[]).await.is_err() {
                return;
            }
        }
        Carried::Tls { .. } | Carried::Raw => {}
    }
    let raw = dest.to_string();
    let ask = Ask {
        target: Ok(dest.clone()),
        method: "CONNECT",
        head: &Named(&dest),
        raw: &|| raw.clone(),
        upgrade: crate::data::decide::policy::Upgrade::None,
        at: Presented::RunListener(&run.id),
    };
    let Ok(prepared) = fetch.decide(run, ask).await else {
        return;
    };
    if let Ok(opened) = fetch.open_tunnel(prepared, sh, run).await {
        opened.start(Client::Tcp(s, early));
    }
}

/// Plain HTTP: an HTTP/1.1 server on the connection (its first head read
/// already), each request decided on the destination's host and port.
async fn http(sh: &Arc<Shared>, run: &Arc<Run>, s: Prefixed<TcpStream>, dest: Target, conn: &Arc<Conn>) {
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
                let (raw, json) = (
                    raw_target(req.uri()),
                    crate::data::decide::refusal::accepts_json(req.headers()),
                );
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
