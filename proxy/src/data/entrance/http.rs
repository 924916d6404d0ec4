//! The forward and CONNECT entrance: the decision path of one fetch on the
//! proxy listener, in the order `docs/policy.md` gives ("The steps, in
//! order"), one function per step:
//!
//! 1. [`authenticate`](auth::authenticate): the run credential (`407` otherwise);
//! 2. [`Fetch::check_run`]: the run is active and its tool configured;
//! 3. [`Fetch::canonical_target`]: one canonical host and port;
//! 4. [`Fetch::admit`]: allowlist and methods, before any DNS;
//!    [`Fetch::credentials`]: placeholders and real secrets only to their
//!    credential's hosts (`credential_misuse`), credentials only over
//!    verified TLS (`credential_requires_tls`), and which to inject;
//! 5. [`Fetch::acquire_slot`]: one of the run's concurrency slots;
//! 6. [`Fetch::resolve_and_vet`]: resolve once, vet every address (and
//!    [`Fetch::plaintext_dial`]: loopback only for cleartext credentials);
//! 7. [`Fetch::dial`]: only the vetted addresses (or this run's idle
//!    connection to one of them);
//! 8. [`forward`](crate::data::carry::forward) (plain HTTP),
//!    [`tunnel`](crate::data::carry::tunnel) (CONNECT), or
//!    [`intercept`](crate::data::entrance::intercept) (a CONNECT to a credential host,
//!    or of an `inspect` tool: TLS terminated, each request inside decided
//!    again by [`decide::decide_inside`](crate::data::decide::fetch::decide_inside)).
//!
//! Steps 2–4 and the recording of denials are [`decide`](crate::data::decide::fetch)'s,
//! shared with every entrance; this module holds the rest. Steps 5–7 are
//! bounded by the fetch deadline and the run's end. Every denial is
//! recorded as a fact before its response is written ([`Fetch::deny`]); a
//! fact that cannot be recorded fails the request closed.

use crate::admission::{self, Refused};
use crate::data::carry::body::{Exchange, ProxyBody};
use crate::data::carry::finish::{Finish, Logged};
use crate::data::carry::forward::{self, Exchanging};
use crate::data::carry::respond;
use crate::data::carry::tunnel::{self, Client};
use crate::data::carry::upstream::Upstream;
use crate::data::decide::auth::{self, AuthFailure};
use crate::data::decide::fetch::Injection;
use crate::data::decide::fetch::{Ask, Dest, Fetch, ReqHead};
use crate::data::decide::policy::{self, Channel};
use crate::data::decide::refusal::Refusal;
use crate::data::decide::target::raw_target;
use crate::data::decide::target::{Kind, Target, TargetError};
use crate::data::entrance::intercept;
use crate::deny::{DenyReason, FetchError, Phase, Via};
use crate::dns::DnsError;
use crate::metrics::{Decision, KindLabel};
use crate::runs::slots::{self, Slot, SlotError};
use crate::runs::Run;
use crate::state::Shared;
use egress_config::{Host, Mode, Policy, ToolPolicy};
use http::{Method, Request, Response};
use hyper::body::Incoming;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant as StdInstant;
use tokio::time::Instant;

pub(in crate::data) type Answer = Response<ProxyBody>;

/// Why steps 5–7 gave no connection.
enum Halt {
    /// A recorded denial (or the error that replaced it): answer as is.
    Answered(Answer),
    /// A non-policy error, counted and answered with its code.
    Failed(FetchError, String),
    /// The fetch deadline expired (in the phase the fetch was in).
    Timeout,
}

impl From<Answer> for Halt {
    fn from(r: Answer) -> Halt {
        Halt::Answered(r)
    }
}

impl From<Refusal> for Halt {
    fn from(r: Refusal) -> Halt {
        Halt::Answered(r.into())
    }
}

/// Entry point: hyper service function for the data listeners. `conn` is
/// the client connection the request arrived on (its admission, and the
/// token that closes it).
pub async fn handle(sh: Arc<Shared>, req: Request<Incoming>, conn: Arc<admission::Conn>) -> Result<Answer, Infallible> {
    let started = Instant::now();
    let kind = if req.method() == Method::CONNECT {
        Kind::Connect
    } else {
        Kind::Http
    };
    if sh.shutdown.is_cancelled() {
        return Ok(respond::closing(respond::error(
            FetchError::ShuttingDown,
            "the proxy is shutting down",
        )));
    }
    // One policy snapshot decides the whole fetch and is the digest its facts carry.
    let policy = sh.policy.load_full();
    let at = auth::Presented::on(req.extensions().get::<auth::BoundRun>());
    let run = match auth::authenticate(&sh.runs, req.headers(), at) {
        Ok(run) => run,
        Err(f) => {
            let raw = raw_target(req.uri());
            let json = crate::data::decide::refusal::accepts_json(req.headers());
            return Ok(refuse_credential(&sh, &policy, f, (kind, None), started, raw, json).await);
        }
    };
    if let Some(r) = establish(&sh, &conn, &run) {
        return Ok(r);
    }
    let target = match kind {
        Kind::Connect => crate::data::decide::target::parse_connect(req.uri()),
        Kind::Http => crate::data::decide::target::parse_absolute(req.uri(), req.headers(), req.version()),
    };
    let bound = req.extensions().get::<auth::BoundRun>().cloned();
    let at = auth::Presented::on(bound.as_ref());
    Ok(serve_run(&sh, &policy, &run, req, target, &conn, (kind.into(), at), started).await)
}

/// Steps 2–8 for a request of `run` (authenticated by its credential, or by
/// the transparent connection it arrived on), whose target the entrance
/// parsed; `via` labels it, `at` is where it was presented.
#[allow(clippy::too_many_arguments)]
pub(in crate::data) async fn serve_run(
    sh: &Arc<Shared>,
    policy: &Policy,
    run: &Arc<Run>,
    mut req: Request<Incoming>,
    target: Result<Target, TargetError>,
    conn: &admission::Conn,
    (via, at): (Via, auth::Presented<'_>),
    started: Instant,
) -> Answer {
    let kind = if req.method() == Method::CONNECT {
        Kind::Connect
    } else {
        Kind::Http
    };
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, policy, Some(run), &tm, kind, started)
        .via(via)
        .answering(req.headers());
    let ask = Ask {
        target,
        method: req.method().as_str(),
        head: &ReqHead(&req),
        raw: &|| raw_target(req.uri()),
        upgrade: match kind {
            Kind::Connect => policy::Upgrade::None,
            Kind::Http => policy::upgrade_of(req.method().as_str(), req.headers()),
        },
        at,
    };
    match fetch.decide(run, ask).await {
        Ok(prepared) if kind == Kind::Http => fetch.carry(sh, prepared, run, req, conn).await,
        Ok(prepared) => match fetch.open_tunnel(prepared, sh, run).await {
            Ok(opened) => {
                opened.start(Client::Upgrade(hyper::upgrade::on(&mut req)));
                Response::new(ProxyBody::empty())
            }
            Err(r) => r,
        },
        Err(r) => r,
    }
}

/// What a tunnel carries: bytes as they are, or requests inside the TLS the
/// proxy terminates (with its own verified TLS to the origin).
enum Carried {
    Blind(tokio::net::TcpStream),
    Intercepted(intercept::OriginConn),
}

/// A tunnel opened to the origin, waiting for the entrance's success answer.
pub(in crate::data) struct Opened {
    sh: Arc<Shared>,
    run: Arc<Run>,
    target: Target,
    slot: Slot,
    deadline: Instant,
    finish: Finish,
    carried: Carried,
}

impl Opened {
    /// Runs the tunnel on its own task with `client`, the tool's side.
    pub(in crate::data) fn start(self, client: Client) {
        let Opened {
            sh,
            run,
            target,
            slot,
            deadline,
            finish,
            carried,
        } = self;
        let tasks = sh.tasks.clone();
        match carried {
            Carried::Blind(upstream) => tasks.spawn(tunnel::run(tunnel::Tunnel {
                client,
                upstream,
                slot,
                deadline,
                idle: sh.cfg.tunnel_idle_timeout,
                cancel: run.cancel.clone(),
                shutdown: sh.hard_stop.clone(),
                finish,
            })),
            Carried::Intercepted(upstream) => tasks.spawn(intercept::run(intercept::Session {
                sh,
                run,
                target,
                client,
                upstream,
                slot,
                deadline,
                finish,
            })),
        };
    }
}

/// Step 1 failed: count it, record the fact (quoting `raw`, the target as
/// the entrance received it) under the run it is filed under, answer `407`.
/// `via` labels it when the entrance is not `kind`'s own (transparent).
#[allow(clippy::too_many_arguments)]
pub(in crate::data) async fn refuse_credential(
    sh: &Shared,
    policy: &Policy,
    f: AuthFailure,
    (kind, via): (Kind, Option<Via>),
    started: Instant,
    raw: String,
    json: bool,
) -> Answer {
    let tm = sh.tool_metrics(f.claimed.as_ref().map(|r| &*r.tool));
    let mut fetch = Fetch::new(sh, policy, f.claimed.as_deref(), &tm, kind, started);
    if let Some(via) = via {
        fetch = fetch.via(via);
    }
    fetch.json = json;
    fetch.deny_credential(&f, raw).await.into()
}

/// The authenticated request's connection takes its place among the
/// proxy's and the run's established connections; or the answer that
/// closes it.
pub(in crate::data) fn establish(sh: &Shared, conn: &admission::Conn, run: &Run) -> Option<Answer> {
    let refused = conn.establish(Some(run)).err()?;
    sh.count_closed("data", refused.label());
    let (e, detail) = match refused {
        Refused::RunLimit => (
            FetchError::RunConnectionLimit,
            format!(
                "run {} already holds {} connections (proxy.max_connections_per_run)",
                run.id, sh.cfg.max_connections_per_run
            ),
        ),
        Refused::Limit => (
            FetchError::ConnectionLimit,
            "every connection place of the proxy is taken (proxy.max_connections)".to_owned(),
        ),
    };
    Some(respond::closing(respond::error(e, &detail)))
}

/// A fetch that passed steps 1–7: what step 8 carries it on.
pub(in crate::data) struct Prepared {
    target: Target,
    slot: Slot,
    upstream: Upstream,
    finish: Finish,
    deadline: Instant,
    credentials: Option<Injection>,
    /// A CONNECT whose TLS the proxy terminates ([`policy::intercepts`]).
    intercept: bool,
    /// A WebSocket handshake ([`policy::upgrade`]).
    websocket: bool,
}

/// Steps 5–8: the run's slot, DNS, the dial and the carrying; the
/// decisions before them are [`decide`]'s.
impl Fetch<'_> {
    /// Steps 2–7 for an authenticated request, whatever its entrance.
    pub(in crate::data) async fn decide(&self, run: &Arc<Run>, ask: Ask<'_>) -> Result<Prepared, Answer> {
        let tool = self.check_run(run, ask.raw).await?;
        // Again once the run settled: a run bound by its listener's hand-off
        // while this fetch waited for the activation is refused here too.
        if let Err(f) = auth::check_binding(&self.sh.runs, run.clone(), ask.at) {
            let how = (self.kind, Some(self.via));
            return Err(refuse_credential(self.sh, self.policy, f, how, self.started, (ask.raw)(), self.json).await);
        }
        // The fetch deadline opens now that the head is authenticated.
        let deadline = self.started + tool.fetch_timeout;
        let mut target = self.canonical_target(ask.target, ask.raw).await?;
        let private = self.admit(&tool, &mut target, ask.method).await?;
        let websocket = self.upgrade(&tool, &target, &ask.upgrade).await?;
        let credentials = self.credentials(&tool, run, &target, ask.head, Channel::Plain).await?;
        self.spend(&tool, &target).await?;
        let intercept = self.kind == Kind::Connect && policy::intercepts(&tool, &target);
        let mut finish = Finish::new(self.tm.clone(), self.via, self.started, run.clone(), target.to_string());
        finish.budget = tool.budgets.bytes.map(|limit| self.byte_budget(run, &target, limit));
        let connected = async {
            let slot = self.acquire_slot(run, &target).await?;
            let (dial, resolved) = self.resolve_and_vet(&tool, &target, private).await?;
            let dial = self
                .plaintext_dial(credentials.as_ref(), &target, dial, &resolved)
                .await?;
            let upstream = self.dial(run, &target, dial, &resolved, intercept).await?;
            Ok::<_, Halt>((slot, upstream, resolved))
        };
        let halted = tokio::select! {
            r = connected => r,
            _ = tokio::time::sleep_until(deadline) => Err(Halt::Timeout),
            _ = run.cancel.cancelled() => Err(Halt::Failed(FetchError::RunEnded, format!("run {} ended", run.id))),
        };
        let (slot, upstream, resolved) = match halted {
            Ok(ok) => ok,
            Err(halt) => return Err(self.halted(halt, finish, &run.tool, tool.fetch_timeout)),
        };
        if self.sh.decisions.sample() {
            finish.logged = Some(Box::new(self.logged(&target, ask.method, &resolved)));
        }
        finish.opened();
        self.count_allowed(&tool);
        Ok(Prepared {
            target,
            slot,
            upstream,
            finish,
            deadline,
            credentials,
            intercept,
            websocket,
        })
    }

    /// The decision log's record of this fetch, once its addresses are known.
    fn logged(&self, target: &Target, method: &str, resolved: &[IpAddr]) -> Logged {
        let mut resolved: Vec<String> = resolved.iter().map(|i| i.to_string()).collect();
        resolved.truncate(crate::facts::MAX_RESOLVED);
        Logged {
            log: self.sh.decisions.clone(),
            host: target.host.to_string(),
            port: target.port,
            method: Some(if self.kind == Kind::Connect { "CONNECT" } else { method }.to_owned()),
            path: target
                .path_and_query
                .as_ref()
                .map(|pq| crate::facts::decisions::record_path(pq.as_str())),
            policy: self.policy.digest.to_string(),
            resolved,
            reported: self.reported.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// The answer of a fetch that stopped in steps 5–7.
    fn halted(&self, halt: Halt, finish: Finish, tool: &str, timeout: std::time::Duration) -> Answer {
        let (e, detail) = match halt {
            Halt::Answered(r) => {
                finish.discard();
                return r;
            }
            Halt::Timeout => {
                finish.timed_out(self.phase());
                (
                    FetchError::Timeout,
                    format!("fetch deadline of {} ms expired", timeout.as_millis()),
                )
            }
            Halt::Failed(e, detail) => {
                finish.failed(e.code());
                (e, detail)
            }
        };
        self.tm.kind(self.via).request(Decision::Error);
        self.sh.count_error(tool, e);
        respond::error(e, &detail)
    }

    /// Step 8 for plain HTTP: forward.
    async fn carry(
        &self,
        sh: &Arc<Shared>,
        p: Prepared,
        run: &Arc<Run>,
        req: Request<Incoming>,
        conn: &admission::Conn,
    ) -> Answer {
        let Prepared {
            target,
            slot,
            upstream,
            finish,
            deadline,
            credentials,
            intercept: _,
            websocket,
        } = p;
        let (exchange, over) = Exchange::new(finish, slot, run.clone());
        let x = Exchanging {
            upstream,
            exchange,
            over,
            deadline,
            client_cut: conn.cut.clone(),
            credentials,
            websocket,
        };
        forward::forward(self, sh, run, req, &target, x).await
    }

    /// Step 8 for a tunnel (CONNECT, or any entrance that relays bytes):
    /// a blind one is open once dialled; an intercepted one once the
    /// proxy's own TLS to the origin verified (`502 upstream_tls`
    /// otherwise), or at once on the run's idle connection verified for
    /// the same name. The entrance then sends its success answer and
    /// [`Opened::start`]s it.
    pub(in crate::data) async fn open_tunnel(
        &self,
        p: Prepared,
        sh: &Arc<Shared>,
        run: &Arc<Run>,
    ) -> Result<Opened, Answer> {
        let Prepared {
            target,
            slot,
            upstream,
            finish,
            deadline,
            intercept,
            ..
        } = p;
        let carried = match upstream {
            Upstream::Stream(stream, _) if !intercept => Carried::Blind(stream),
            Upstream::Stream(stream, addr) => {
                let tls = self
                    .verify_origin(run, &target, stream, addr, deadline, &finish)
                    .await?;
                Carried::Intercepted(intercept::OriginConn::Fresh(Box::new(tls), addr))
            }
            Upstream::Verified(conn) if intercept => Carried::Intercepted(intercept::OriginConn::Pooled(conn)),
            Upstream::Pooled(_) | Upstream::Verified(_) => {
                return Err(respond::error(
                    FetchError::UpstreamFailed,
                    "a tunnel takes a pooled connection only when intercepted, and only a verified one",
                ))
            }
        };
        Ok(Opened {
            sh: sh.clone(),
            run: run.clone(),
            target,
            slot,
            deadline,
            finish,
            carried,
        })
    }

    /// The proxy's own TLS to an intercepted origin, verified for the
    /// CONNECT's name (`502 upstream_tls` otherwise), bounded by the
    /// deadline and the run's end.
    async fn verify_origin(
        &self,
        run: &Run,
        target: &Target,
        stream: tokio::net::TcpStream,
        addr: SocketAddr,
        deadline: Instant,
        finish: &Finish,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, Answer> {
        let ca = self.sh.ca.load_full();
        let tls = tokio::select! {
            r = ca.connect(&target.host, stream) => r,
            _ = tokio::time::sleep_until(deadline) => {
                finish.timed_out(Phase::Connect);
                self.sh.count_error(&run.tool, FetchError::Timeout);
                return Err(respond::error(FetchError::Timeout, &format!("TLS to {target} did not finish before the fetch deadline")));
            }
            _ = run.cancel.cancelled() => {
                finish.severed("run_ended");
                return Err(respond::error(FetchError::RunEnded, &format!("run {} ended", run.id)));
            }
        };
        match tls {
            Ok(s) => {
                self.sh.metrics.upstream_tls_done(s.get_ref().1);
                Ok(s)
            }
            Err(e) => {
                finish.failed(FetchError::UpstreamTls.code());
                self.sh.count_error(&run.tool, FetchError::UpstreamTls);
                Err(respond::error(
                    FetchError::UpstreamTls,
                    &format!("{target} ({addr}): {e}"),
                ))
            }
        }
    }

    /// A plain-HTTP request carrying a credential that may go in cleartext
    /// only to loopback: the vetted addresses that are loopback, or the
    /// `credential_requires_tls` denial.
    async fn plaintext_dial(
        &self,
        credentials: Option<&Injection>,
        target: &Target,
        dial: Vec<IpAddr>,
        resolved: &[IpAddr],
    ) -> Result<Vec<IpAddr>, Halt> {
        if !credentials.is_some_and(|c| c.loopback_only) {
            return Ok(dial);
        }
        match policy::loopback_dial(target, dial) {
            Ok(dial) => Ok(dial),
            Err(d) => Err(self
                .deny(d.reason, d.detail, Dest::Target(target), resolved)
                .await
                .into()),
        }
    }

    /// Step 5: one of the run's concurrency slots (waiting in a bounded queue).
    async fn acquire_slot(&self, run: &Run, target: &Target) -> Result<Slot, Halt> {
        self.set_phase(Phase::Slot);
        let t0 = StdInstant::now();
        let slot = match slots::acquire(run, self.tm.slots_in_use.clone()).await {
            Ok(s) => s,
            Err(SlotError::QueueFull) => {
                let detail = format!(
                    "run {} already has {} fetches open and {} waiting",
                    run.id, run.max_slots, run.max_waiting
                );
                return Err(self
                    .deny(DenyReason::ConcurrencyLimit, detail, Dest::Target(target), &[])
                    .await
                    .into());
            }
            Err(SlotError::Closed) => return Err(Halt::Failed(FetchError::RunEnded, format!("run {} ended", run.id))),
        };
        self.tm.slot_wait.observe(t0.elapsed().as_secs_f64());
        Ok(slot)
    }

    /// Step 6: resolve once and vet every address against the ranges, this
    /// host's addresses and the proxy's own listeners. Returns the addresses
    /// to dial, in order, and everything the name resolved to (for facts).
    async fn resolve_and_vet(
        &self,
        tool: &ToolPolicy,
        target: &Target,
        private: bool,
    ) -> Result<(Vec<IpAddr>, Vec<IpAddr>), Halt> {
        self.set_phase(Phase::Dns);
        let resolved = match &target.host {
            Host::Ip(ip) => vec![*ip],
            Host::Name(name) => self.resolve(name).await?,
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
                self.report(&d, target, &resolved).await?;
                dial.extend(vetted.private.iter().copied());
            } else {
                return Err(self
                    .deny(d.reason, d.detail, Dest::Target(target), &resolved)
                    .await
                    .into());
            }
        }
        Ok((dial, resolved))
    }

    async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, Halt> {
        let t0 = StdInstant::now();
        let r = self.sh.resolver.resolve(name).await;
        self.sh.metrics.dns_duration.observe(t0.elapsed().as_secs_f64());
        let (e, detail) = match r {
            Ok(ips) => return Ok(ips),
            Err(DnsError::NotFound) => (FetchError::DnsNotFound, format!("{name} has no address records")),
            Err(DnsError::Failed(e)) => (FetchError::DnsFailed, format!("lookup of {name} failed: {e}")),
        };
        let kind = if e == FetchError::DnsNotFound {
            "not_found"
        } else {
            "failed"
        };
        self.sh.metrics.dns_failures.get_or_create(&KindLabel { kind }).inc();
        Err(Halt::Failed(e, detail))
    }

    /// Step 7: dial the vetted addresses in order — or reuse this run's idle
    /// connection to one of them: for plain HTTP, and for an `intercept`ed
    /// CONNECT a connection whose TLS was verified for the CONNECT's name.
    /// A connection that reached one of the proxy's own listeners is
    /// `self_loop`.
    async fn dial(
        &self,
        run: &Run,
        target: &Target,
        dial: Vec<IpAddr>,
        resolved: &[IpAddr],
        intercept: bool,
    ) -> Result<Upstream, Halt> {
        self.set_phase(Phase::Connect);
        let pooled = match self.kind {
            Kind::Http => run.upstream.take(&dial, target.port).map(Upstream::Pooled),
            _ if intercept => run
                .upstream
                .take_verified(&target.host, &dial, target.port)
                .map(Upstream::Verified),
            _ => None,
        };
        if let Some(pooled) = pooled {
            self.sh.metrics.upstream_reused.inc();
            return Ok(pooled);
        }
        let mut last_err = None;
        for ip in dial {
            let addr = SocketAddr::new(ip, target.port);
            let t0 = StdInstant::now();
            match self.sh.dialer.dial(addr).await {
                Ok(s) if self.sh.is_self_connection(&s) => {
                    drop(s);
                    let detail = format!("{target} ({addr}) is the proxy's own listener");
                    return Err(self
                        .deny(DenyReason::SelfLoop, detail, Dest::Target(target), resolved)
                        .await
                        .into());
                }
                Ok(s) => {
                    self.sh.metrics.connect_duration.observe(t0.elapsed().as_secs_f64());
                    return Ok(Upstream::Stream(s, addr));
                }
                Err(e) => last_err = Some(format!("{addr}: {e}")),
            }
        }
        Err(Halt::Failed(
            FetchError::ConnectFailed,
            format!(
                "could not connect to {target}: {}",
                last_err.unwrap_or_else(|| "no address".into())
            ),
        ))
    }
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
