//! The decision path of one fetch, in the order the README gives ("How one
//! fetch is decided"):
//! authenticate, run state, canonical target, allowlist (no DNS), slot,
//! resolve once and vet, dial the pinned addresses, then forward (plain
//! HTTP, RFC 9110 §7.6.1 hop-by-hop stripping) or tunnel (CONNECT). Every
//! denial is recorded as a fact before its response is written.

use crate::auth::{self, CHALLENGE};
use crate::body::{self, Exchange, Guarded, ProxyBody, Upload};
use crate::deny::{DenyReason, FetchError};
use crate::facts::{Fact, FactTarget};
use crate::finish::Finish;
use crate::metrics::{Decision, Outcome, ToolMetrics};
use crate::policy::{self, Admission, Denial};
use crate::runs::Run;
use crate::server::Shared;
use crate::slots::{self, SlotError};
use crate::target::{self, Kind, Target, TargetError};
use crate::tunnel;
use crate::upstream;
use egress_config::{Host, Mode, ToolPolicy};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant as StdInstant;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const DENY_HEADER: &str = "x-egress-deny-reason";
pub const ERROR_HEADER: &str = "x-egress-error";
/// The `id` of the fact that records a denial (never the global `seq`,
/// which would let a tool watch other runs' denials).
pub const FACT_HEADER: &str = "x-egress-fact-id";

/// Headers that never cross the proxy (RFC 9110 §7.6.1), plus the proxy's own.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .chain(h.get_all("proxy-connection").iter())
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

fn response(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::text(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn deny_response(reason: DenyReason, detail: &str) -> Response<ProxyBody> {
    let mut r = response(
        reason.status(),
        format!("egress denied ({}): {detail}\n", reason.code()),
    );
    r.headers_mut()
        .insert(DENY_HEADER, HeaderValue::from_static(reason.code()));
    if reason.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        r.headers_mut()
            .insert(header::PROXY_AUTHENTICATE, HeaderValue::from_static(CHALLENGE));
    }
    r
}

fn error_response(e: FetchError, detail: &str) -> Response<ProxyBody> {
    let mut r = response(e.status(), format!("egress error ({}): {detail}\n", e.code()));
    r.headers_mut().insert(ERROR_HEADER, HeaderValue::from_static(e.code()));
    r
}

fn fact_target(t: &Target) -> FactTarget {
    let host = match &t.host {
        Host::Name(n) => n.clone(),
        Host::Ip(ip) => ip.to_string(),
    };
    FactTarget {
        kind: t.kind.as_str().to_owned(),
        host,
        port: t.port,
    }
}

/// A short, printable, bounded rendering of an unparsed target for facts.
fn raw_target(uri: &http::Uri) -> String {
    let s = uri.to_string();
    let mut out: String = s.chars().filter(|c| !c.is_control()).take(256).collect();
    if s.len() > 256 {
        out.push('…');
    }
    out
}

/// Entry point: hyper service function for the data listener.
/// `conn` is the client connection the request arrived on (its admission,
/// and the token that closes it).
pub async fn handle(
    sh: Arc<Shared>,
    mut req: Request<Incoming>,
    conn: Arc<crate::admission::Conn>,
) -> Result<Response<ProxyBody>, Infallible> {
    let started = StdInstant::now();
    let kind = if req.method() == Method::CONNECT {
        Kind::Connect
    } else {
        Kind::Http
    };
    if sh.shutdown.is_cancelled() {
        let mut r = error_response(FetchError::ShuttingDown, "the proxy is shutting down");
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(r);
    }
    // One policy snapshot decides the whole fetch and is the digest its facts carry.
    let pol = sh.policy.load_full();
    // 1. Authenticate.
    let run = match auth::authenticate(&sh.runs, req.headers(), req.extensions().get::<auth::BoundRun>()) {
        Ok(run) => run,
        Err(f) => {
            sh.metrics
                .auth_failures
                .get_or_create(&crate::metrics::ReasonLabel {
                    reason: f.reason.code(),
                })
                .inc();
            let tool = f.claimed.as_ref().map(|r| r.tool.clone());
            let tm = sh.tool_metrics(tool.as_deref());
            let ctx = Ctx::new(&sh, &pol, f.claimed.as_deref(), &tm, kind, started);
            return Ok(ctx
                .deny_auth(f.reason, f.claimed.is_some(), raw_target(req.uri()))
                .await);
        }
    };
    if let Err(refused) = conn.establish(Some(&run)) {
        sh.count_closed("data", refused.label());
        let (e, detail) = match refused {
            crate::admission::Refused::RunLimit => (
                FetchError::RunConnectionLimit,
                format!(
                    "run {} already holds {} connections (proxy.max_connections_per_run)",
                    run.id, sh.cfg.max_connections_per_run
                ),
            ),
            crate::admission::Refused::Limit => (
                FetchError::ConnectionLimit,
                "every connection place of the proxy is taken (proxy.max_connections)".to_owned(),
            ),
        };
        let mut r = error_response(e, &detail);
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(r);
    }
    let tool_policy = pol.tool(&run.tool).cloned();
    let tm = sh.tool_metrics(Some(&run.tool));
    let ctx = Ctx::new(&sh, &pol, Some(&run), &tm, kind, started);
    // The fetch deadline opens now that the head is authenticated.
    let timeout = tool_policy.as_ref().map(|t| t.fetch_timeout).unwrap_or_default();
    let deadline = Instant::from_std(started) + timeout;

    // 2. Run state.
    if let Err(reason) = policy::check_run(run.state()) {
        let detail = format!("run {} is {}", run.id, run.state().as_str());
        return Ok(ctx.deny(reason, detail, None, Some(raw_target(req.uri())), &[]).await);
    }
    let Some(tool) = tool_policy else {
        let detail = format!("tool {} is no longer configured", run.tool);
        return Ok(ctx
            .deny(
                DenyReason::NotAllowlisted,
                detail,
                None,
                Some(raw_target(req.uri())),
                &[],
            )
            .await);
    };

    // 3. Canonical target.
    let parsed = match kind {
        Kind::Connect => target::parse_connect(req.uri()),
        Kind::Http => target::parse_absolute(req.uri(), req.headers(), req.version()),
    };
    let target = match parsed {
        Ok(t) => t,
        Err(e) => {
            let (reason, detail) = match e {
                TargetError::Bad(m) => (DenyReason::BadTarget, m),
                TargetError::HostMismatch(m) => (DenyReason::HostMismatch, m),
            };
            return Ok(ctx.deny(reason, detail, None, Some(raw_target(req.uri())), &[]).await);
        }
    };

    // 4. Allowlist (and methods) before any DNS.
    let private = match policy::admit(&tool, &target, req.method().as_str()) {
        Admission::Allow { private } => private,
        Admission::Deny(d) => return Ok(ctx.deny(d.reason, d.detail, Some(&target), None, &[]).await),
        Admission::Report { denial, private } => {
            if let Err(r) = ctx.report(&denial, &target, &[]).await {
                return Ok(r);
            }
            private
        }
    };

    // 5-7: slot, resolve, vet, connect — bounded by the deadline and the run.
    let finish = Finish::new(tm.clone(), kind, started, run.clone(), target.to_string());
    let prepared = tokio::select! {
        r = ctx.prepare(&tool, &target, private) => r,
        _ = tokio::time::sleep_until(deadline) => Err(Prepared::Timeout),
        _ = run.cancel.cancelled() => Err(Prepared::Error(FetchError::RunEnded, format!("run {} ended", run.id), "run_ended")),
    };
    let (slot, upstream) = match prepared {
        Ok(ok) => ok,
        Err(Prepared::Response(r)) => {
            finish.discard();
            return Ok(r);
        }
        Err(Prepared::Timeout) => {
            finish.timed_out(ctx.phase());
            tm.kind(kind).request(Decision::Error);
            sh.count_error(&run.tool, FetchError::Timeout);
            return Ok(error_response(
                FetchError::Timeout,
                &format!("fetch deadline of {} ms expired", timeout.as_millis()),
            ));
        }
        Err(Prepared::Error(e, detail, why)) => {
            finish.failed(why);
            tm.kind(kind).request(Decision::Error);
            sh.count_error(&run.tool, e);
            return Ok(error_response(e, &detail));
        }
    };
    finish.opened();
    tm.kind(kind).request(if tool.mode == Mode::Report && ctx.reported() {
        Decision::Reported
    } else {
        Decision::Allowed
    });

    match kind {
        Kind::Connect => {
            let Upstream::Stream(stream, _) = upstream else {
                return Ok(error_response(
                    FetchError::UpstreamFailed,
                    "tunnels never use pooled connections",
                ));
            };
            let upgrade = hyper::upgrade::on(&mut req);
            sh.tasks.spawn(tunnel::run(tunnel::Tunnel {
                upgrade,
                upstream: stream,
                slot,
                deadline,
                idle: sh.cfg.tunnel_idle_timeout,
                cancel: run.cancel.clone(),
                shutdown: sh.hard_stop.clone(),
                finish,
            }));
            Ok(Response::new(ProxyBody::empty()))
        }
        Kind::Http => Ok(forward(
            &sh,
            &run,
            req,
            &target,
            upstream,
            Exchange::new(finish, slot, run.clone()),
            deadline,
            conn.cut.clone(),
        )
        .await),
    }
}

/// The upstream connection a fetch goes out on.
enum Upstream {
    /// Freshly dialled to a vetted address.
    Stream(TcpStream, SocketAddr),
    /// An idle connection of the same run to an address in this fetch's vetted set.
    Pooled(upstream::Conn),
}

/// Why preparation (steps 5-7) did not give a connection.
enum Prepared {
    Response(Response<ProxyBody>),
    Timeout,
    Error(FetchError, String, &'static str),
}

/// Per-request context for decisions that need the shared state.
struct Ctx<'a> {
    sh: &'a Shared,
    policy: &'a egress_config::Policy,
    run: Option<&'a Run>,
    tm: &'a Arc<ToolMetrics>,
    kind: Kind,
    started: StdInstant,
    /// Index into `metrics::PHASES` of the step in progress.
    phase: AtomicU8,
    /// Whether report mode let a denial through.
    reported: AtomicBool,
}

impl<'a> Ctx<'a> {
    fn new(
        sh: &'a Shared,
        policy: &'a egress_config::Policy,
        run: Option<&'a Run>,
        tm: &'a Arc<ToolMetrics>,
        kind: Kind,
        started: StdInstant,
    ) -> Self {
        Ctx {
            sh,
            policy,
            run,
            tm,
            kind,
            started,
            phase: AtomicU8::new(0),
            reported: AtomicBool::new(false),
        }
    }

    fn phase(&self) -> &'static str {
        crate::metrics::PHASES[usize::from(self.phase.load(Ordering::Relaxed)).min(4)]
    }

    fn set_phase(&self, p: u8) {
        self.phase.store(p, Ordering::Relaxed);
    }

    fn reported(&self) -> bool {
        self.reported.load(Ordering::Relaxed)
    }

    /// Records a denial fact, then builds the denial response. A fact that
    /// cannot be recorded fails the request closed (503 facts_unavailable).
    async fn deny(
        &self,
        reason: DenyReason,
        detail: String,
        target: Option<&Target>,
        raw: Option<String>,
        resolved: &[IpAddr],
    ) -> Response<ProxyBody> {
        self.deny_with(reason, detail.clone(), detail, target, raw, resolved)
            .await
    }

    /// [`Ctx::deny`] with an answer to the client that differs from the
    /// fact's detail. `raw` (an unparsed target) is quoted in the fact.
    async fn deny_with(
        &self,
        reason: DenyReason,
        answer: String,
        detail: String,
        target: Option<&Target>,
        raw: Option<String>,
        resolved: &[IpAddr],
    ) -> Response<ProxyBody> {
        let km = self.tm.kind(self.kind);
        self.tm.denial(reason);
        km.request(Decision::Denied);
        let detail = match &raw {
            Some(r) => format!("{detail} (target {r})"),
            None => detail,
        };
        let detail = crate::facts::bounded(detail);
        let recorded = self
            .record(reason, detail.clone(), target, resolved, Mode::Enforce)
            .await;
        km.duration(Outcome::Denied, self.started.elapsed().as_secs_f64());
        tracing::info!(
            target: "egress::fetch",
            run = self.run.map(|r| &*r.id).unwrap_or("-"),
            tool = self.run.map(|r| &*r.tool).unwrap_or("-"),
            kind = self.kind.as_str(),
            dest = %target.map(|t| t.to_string()).or(raw).unwrap_or_default(),
            decision = "denied",
            reason = reason.code(),
            duration_ms = self.started.elapsed().as_millis() as u64,
            detail = %detail,
            "fetch denied"
        );
        match recorded {
            Ok(recorded) => {
                let mut r = deny_response(reason, &crate::facts::bounded(answer));
                if let Ok(v) = HeaderValue::from_str(&recorded.id) {
                    r.headers_mut().insert(FACT_HEADER, v);
                }
                r
            }
            Err(e) => error_response(FetchError::FactsUnavailable, &e),
        }
    }

    /// An authentication failure. The client gets the same answer whether
    /// the credential named an existing run with a wrong secret or a run
    /// that does not exist, so no run id can be probed. The fact of a wrong
    /// secret goes to the named run's facts with a fixed text and no target,
    /// so a tool cannot write its own text into another run's facts (and a
    /// flood of them folds into counted facts).
    async fn deny_auth(&self, reason: DenyReason, wrong_secret: bool, raw: String) -> Response<ProxyBody> {
        let answer = match reason {
            DenyReason::AuthMissing => "Proxy-Authorization with the run's credential is required",
            _ => "the credential is not valid for any live run",
        };
        let (fact_detail, raw) = match (reason, wrong_secret) {
            (DenyReason::AuthMissing, _) => (answer.to_owned(), Some(raw)),
            (_, true) => ("a wrong secret was presented for this run".to_owned(), None),
            (_, false) => ("the credential names no known run".to_owned(), Some(raw)),
        };
        self.deny_with(reason, answer.to_owned(), fact_detail, None, raw, &[])
            .await
    }

    /// Report mode: record what enforce would have denied, then go on.
    async fn report(&self, d: &Denial, target: &Target, resolved: &[IpAddr]) -> Result<(), Response<ProxyBody>> {
        self.tm.denial(d.reason);
        self.reported.store(true, Ordering::Relaxed);
        tracing::info!(
            target: "egress::fetch",
            run = self.run.map(|r| &*r.id).unwrap_or("-"),
            tool = self.run.map(|r| &*r.tool).unwrap_or("-"),
            kind = self.kind.as_str(),
            dest = %target,
            decision = "reported",
            reason = d.reason.code(),
            detail = %d.detail,
            "fetch allowed in report mode"
        );
        self.record(d.reason, d.detail.clone(), Some(target), resolved, Mode::Report)
            .await
            .map(|_| ())
            .map_err(|e| error_response(FetchError::FactsUnavailable, &e))
    }

    async fn record(
        &self,
        reason: DenyReason,
        detail: String,
        target: Option<&Target>,
        resolved: &[IpAddr],
        mode: Mode,
    ) -> Result<crate::facts::Recorded, String> {
        let fact = Fact::denial(
            self.run.map(|r| &*r.id),
            self.run.map(|r| &*r.tool),
            reason.code(),
            mode.as_str(),
            target.map(fact_target),
            resolved.iter().map(|i| i.to_string()).collect(),
            &self.policy.digest,
            detail,
        );
        let t0 = StdInstant::now();
        let res = self.sh.facts.record(fact).await;
        self.sh.metrics.fact_write_duration.observe(t0.elapsed().as_secs_f64());
        match res {
            Ok(recorded) => Ok(recorded),
            Err(e) => {
                self.sh.metrics.fact_write_failures.inc();
                tracing::error!(error = %e, "denial fact could not be recorded; failing the request closed");
                Err(format!("the denial could not be recorded ({e}); request refused"))
            }
        }
    }

    /// Steps 5-7: slot, resolve once, vet, dial the vetted addresses.
    async fn prepare(
        &self,
        tool: &ToolPolicy,
        target: &Target,
        private: bool,
    ) -> Result<(slots::Slot, Upstream), Prepared> {
        let Some(run) = self.run else {
            return Err(Prepared::Error(FetchError::RunEnded, "no run".into(), "run_ended"));
        };
        // 5. Concurrency slot.
        let t0 = StdInstant::now();
        let slot = match slots::acquire(run, self.tm.slots_in_use.clone()).await {
            Ok(s) => s,
            Err(SlotError::QueueFull) => {
                let detail = format!(
                    "run {} already has {} fetches open and {} waiting",
                    run.id, run.max_slots, run.max_waiting
                );
                return Err(Prepared::Response(
                    self.deny(DenyReason::ConcurrencyLimit, detail, Some(target), None, &[])
                        .await,
                ));
            }
            Err(SlotError::Closed) => {
                return Err(Prepared::Error(
                    FetchError::RunEnded,
                    format!("run {} ended", run.id),
                    "run_ended",
                ))
            }
        };
        self.tm.slot_wait.observe(t0.elapsed().as_secs_f64());

        // 6. Resolve once and pin.
        self.set_phase(1);
        let resolved: Vec<IpAddr> = match &target.host {
            Host::Ip(ip) => vec![*ip],
            Host::Name(name) => {
                let t0 = StdInstant::now();
                let r = self.sh.dns.resolve(name).await;
                self.sh.metrics.dns_duration.observe(t0.elapsed().as_secs_f64());
                match r {
                    Ok(ips) => ips,
                    Err(crate::dns::DnsError::NotFound) => {
                        self.sh
                            .metrics
                            .dns_failures
                            .get_or_create(&crate::metrics::KindLabel { kind: "not_found" })
                            .inc();
                        return Err(Prepared::Error(
                            FetchError::DnsNotFound,
                            format!("{name} has no address records"),
                            "dns_not_found",
                        ));
                    }
                    Err(crate::dns::DnsError::Failed(e)) => {
                        self.sh
                            .metrics
                            .dns_failures
                            .get_or_create(&crate::metrics::KindLabel { kind: "failed" })
                            .inc();
                        return Err(Prepared::Error(
                            FetchError::DnsFailed,
                            format!("lookup of {name} failed: {e}"),
                            "dns_failed",
                        ));
                    }
                }
            }
        };
        let vetted = policy::vet(
            &resolved,
            target.port,
            &self.policy.ranges,
            private,
            &self.sh.me,
            &self.sh.host_addrs.load(),
        );
        let denial = vetted.denial(target);
        let mut dial = vetted.allowed;
        if let Some(d) = denial {
            if tool.mode == Mode::Report && d.reason.reportable() {
                self.report(&d, target, &resolved).await.map_err(Prepared::Response)?;
                dial.extend(vetted.private.iter().copied());
            } else {
                return Err(Prepared::Response(
                    self.deny(d.reason, d.detail, Some(target), None, &resolved).await,
                ));
            }
        }

        // 7. Dial only vetted addresses, in order — or reuse this run's idle
        // connection to one of them (plain HTTP only).
        self.set_phase(2);
        if self.kind == Kind::Http {
            if let Some(conn) = run.upstream.take(&dial, target.port) {
                self.sh.metrics.upstream_reused.inc();
                return Ok((slot, Upstream::Pooled(conn)));
            }
        }
        let mut last_err = None;
        for ip in dial {
            let addr = SocketAddr::new(ip, target.port);
            let t0 = StdInstant::now();
            match TcpStream::connect(addr).await {
                Ok(s) => {
                    self.sh.metrics.connect_duration.observe(t0.elapsed().as_secs_f64());
                    if self.sh.is_self_connection(&s) {
                        drop(s);
                        let detail = format!("{target} ({addr}) is the proxy's own listener");
                        return Err(Prepared::Response(
                            self.deny(DenyReason::SelfLoop, detail, Some(target), None, &resolved)
                                .await,
                        ));
                    }
                    let _ = s.set_nodelay(true);
                    return Ok((slot, Upstream::Stream(s, addr)));
                }
                Err(e) => last_err = Some(format!("{addr}: {e}")),
            }
        }
        Err(Prepared::Error(
            FetchError::ConnectFailed,
            format!(
                "could not connect to {target}: {}",
                last_err.unwrap_or_else(|| "no address".into())
            ),
            "connect_failed",
        ))
    }
}

/// Step 8 for plain HTTP: origin-form request over the pinned connection.
/// The request body streams upstream while the response comes back; the
/// exchange (slot, accounting) lasts until both are finished, and a watchdog
/// bounds both directions by the deadline and the run's end.
#[allow(clippy::too_many_arguments)]
async fn forward(
    sh: &Shared,
    run: &Arc<Run>,
    req: Request<Incoming>,
    target: &Target,
    upstream: Upstream,
    (exchange, over): (Arc<Exchange>, tokio::sync::oneshot::Receiver<()>),
    deadline: Instant,
    client_cut: CancellationToken,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    if let Ok(v) = HeaderValue::from_str(&target.host_header()) {
        headers.insert(header::HOST, v);
    }
    let pq = target
        .path_and_query
        .clone()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    exchange.finish.add_up(body::head_len(
        parts.method.as_str().len() + pq.as_str().len() + 10,
        &headers,
    ));
    let mut up = Request::new(Upload::new(body, exchange.clone()));
    *up.method_mut() = parts.method;
    *up.version_mut() = Version::HTTP_11;
    *up.headers_mut() = headers;
    *up.uri_mut() = http::Uri::from(pq);
    let fx = &exchange.finish;
    let exchange_fut = async {
        let mut conn = match upstream {
            Upstream::Pooled(c) => c,
            Upstream::Stream(s, addr) => upstream::handshake(s, addr, run.cancel.clone(), sh.hard_stop.clone())
                .await
                .map_err(|e| e.to_string())?,
        };
        sh.tasks.spawn(body::watchdog(
            Arc::downgrade(&exchange),
            over,
            body::Bounds {
                deadline,
                run_end: run.cancel.clone(),
                hard_stop: sh.hard_stop.clone(),
            },
            conn.cut_token(),
            client_cut,
        ));
        match conn.sender.try_send_request(up).await {
            Ok(resp) => Ok((resp, conn)),
            Err(mut e) => {
                // A pooled connection that closed before our request went out:
                // dial the same vetted address afresh and send it there.
                let Some(req) = e.take_message().filter(|_| conn.reused) else {
                    return Err(e.into_error().to_string());
                };
                let addr = conn.addr;
                drop(conn);
                let s = TcpStream::connect(addr).await.map_err(|e| format!("{addr}: {e}"))?;
                let _ = s.set_nodelay(true);
                let mut fresh = upstream::handshake(s, addr, run.cancel.clone(), sh.hard_stop.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                let resp = fresh.sender.send_request(req).await.map_err(|e| e.to_string())?;
                Ok((resp, fresh))
            }
        }
    };
    let (resp, conn) = tokio::select! {
        r = exchange_fut => match r {
            Ok(x) => x,
            Err(e) => {
                fx.failed("upstream_failed");
                sh.count_error(&run.tool, FetchError::UpstreamFailed);
                return error_response(FetchError::UpstreamFailed, &format!("{target}: {e}"));
            }
        },
        _ = tokio::time::sleep_until(deadline) => {
            fx.timed_out("response");
            sh.count_error(&run.tool, FetchError::Timeout);
            return error_response(FetchError::Timeout, &format!("{target} did not answer before the fetch deadline"));
        }
        _ = run.cancel.cancelled() => {
            fx.severed("run_ended");
            return error_response(FetchError::RunEnded, &format!("run {} ended", run.id));
        }
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    fx.add_down(body::head_len(
        parts.status.canonical_reason().map_or(3, |r| r.len() + 4) + 9,
        &parts.headers,
    ));
    exchange.attach(conn);
    Response::from_parts(parts, ProxyBody::stream(Guarded { inner: body, exchange }))
}
