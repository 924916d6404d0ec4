//! The decisions every entrance shares, each recorded as a fact before it
//! is answered: the run still active and its tool configured (step 2), one
//! canonical target (3), allowlist and methods before any DNS (4), and the
//! credentials (4: placeholders and real secrets only to their hosts, only
//! over verified TLS), and the refusal of a credential host's answer the
//! scrubber cannot read. The forward and CONNECT entrance ([`http`]) and
//! the requests inside an intercepted CONNECT ([`intercept`]) both call
//! these steps; the steps call the pure policy functions ([`policy`]) and
//! never an entrance. It is one file of some 840 lines on purpose: the
//! steps are methods of the one [`Fetch`] context and share its one way of
//! refusing (the fact first, then the [`Refusal`]), which a split by step
//! would scatter.
//!
//! [`http`]: crate::data::entrance::http
//! [`intercept`]: crate::data::entrance::intercept

use crate::data::decide::auth::{AuthFailure, Presented};
use crate::data::decide::policy::{self, Admission, Channel, Denial, Head, Upgrade};
use crate::data::decide::refusal::{self, Denied, Refusal};
use crate::data::decide::target::{self, fact_target, raw_target, Kind, Target, TargetError};
use crate::deny::{DenyReason, Phase, Via};
use crate::facts::{Fact, NewFact, Recorded};
use crate::metrics::{Decision, Outcome, ToolMetrics};
use crate::runs::budget::{ByteBudget, Exceeded};
use crate::runs::Run;
use crate::state::Shared;
use egress_api::FactTarget;
use egress_config::{Host, Mode, Policy, ToolPolicy};
use http::Request;
use hyper::body::Incoming;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant as StdInstant;
use tokio::time::Instant;

type Answer = Refusal;

/// What a denial points at.
pub(in crate::data) enum Dest<'a> {
    /// The canonical target (a fact's `target`).
    Target(&'a Target),
    /// The raw request target, before it could be made canonical (quoted in
    /// the fact's detail).
    Raw(String),
    /// Nothing: the request is not the named run's own (a wrong secret).
    Withheld,
}

/// What an entrance parsed from its input, as the decision steps take it
/// (the forward and CONNECT requests, SOCKS5, ...: each entrance is a
/// parser of its own, the steps are the same).
pub(in crate::data) struct Ask<'r> {
    /// The canonical target, or why the input names none.
    pub target: Result<Target, TargetError>,
    /// The method the tool uses (`CONNECT` for a tunnel, by any entrance).
    pub method: &'r str,
    /// The pieces of the input a credential could be carried in.
    pub head: &'r (dyn Head + Sync),
    /// The raw target, quoted in a fact when the run or the target is refused.
    pub raw: &'r (dyn Fn() -> String + Sync),
    /// The protocol the request asks to switch to ([`policy::upgrade_of`];
    /// `None` for tunnels and raw connections).
    pub upgrade: Upgrade,
    /// Where the run's credential (or its sandbox's connection) was
    /// presented: the binding rule is checked again once the run settled.
    pub at: Presented<'r>,
}

/// One fetch's context: the shared state, the policy snapshot, the run, and
/// what the fetch has become so far.
pub(in crate::data) struct Fetch<'a> {
    pub(in crate::data) sh: &'a Shared,
    pub(in crate::data) policy: &'a Policy,
    pub(in crate::data) run: Option<&'a Run>,
    pub(in crate::data) tm: &'a Arc<ToolMetrics>,
    pub(in crate::data) kind: Kind,
    /// How it is labelled (facts, metrics, logs): `kind`, unless transparent.
    pub(in crate::data) via: Via,
    pub(in crate::data) started: Instant,
    /// The [`Phase`] of the step in progress (index into `Phase::ALL`).
    pub(in crate::data) phase: AtomicU8,
    /// Whether report mode let a denial through.
    pub(in crate::data) reported: AtomicBool,
    /// Whether a denial is answered with a JSON body (the request accepts
    /// `application/json`).
    pub(in crate::data) json: bool,
}

impl<'a> Fetch<'a> {
    pub(in crate::data) fn new(
        sh: &'a Shared,
        policy: &'a Policy,
        run: Option<&'a Run>,
        tm: &'a Arc<ToolMetrics>,
        kind: Kind,
        started: Instant,
    ) -> Self {
        Fetch {
            sh,
            policy,
            run,
            tm,
            kind,
            via: kind.into(),
            started,
            phase: AtomicU8::new(0),
            reported: AtomicBool::new(false),
            json: false,
        }
    }

    /// The same fetch, answering denials of the request with `headers` in
    /// JSON if it accepts `application/json`.
    pub(in crate::data) fn answering(mut self, headers: &http::HeaderMap) -> Self {
        self.json = refusal::accepts_json(headers);
        self
    }

    /// The same fetch, labelled as arriving `via` an entrance of its own.
    pub(in crate::data) fn via(mut self, via: Via) -> Self {
        self.via = via;
        self
    }

    /// Step 2: the run is active, and its tool still configured. Returns the
    /// tool's policy.
    pub(in crate::data) async fn check_run(
        &self,
        run: &Run,
        raw: &(dyn Fn() -> String + Sync),
    ) -> Result<Arc<ToolPolicy>, Answer> {
        // A created run is waited for (bounded): its executor activates it
        // while the invocation is already on its way to the child.
        let state = run.settled(self.sh.cfg.activation_wait).await;
        if let Err(reason) = policy::check_run(state) {
            let detail = format!("run {} is {}", run.id, state.as_str());
            return Err(self.deny(reason, detail, Dest::Raw(raw()), &[]).await);
        }
        match self.policy.tool(&run.tool) {
            Some(tool) => Ok(tool.clone()),
            None => {
                let detail = format!("tool {} is no longer configured", run.tool);
                Err(self
                    .deny(DenyReason::NotAllowlisted, detail, Dest::Raw(raw()), &[])
                    .await)
            }
        }
    }

    /// Step 3: the target an entrance parsed, or its refusal (`bad_target`,
    /// `host_mismatch`) quoting the raw target.
    pub(in crate::data) async fn canonical_target(
        &self,
        parsed: Result<Target, TargetError>,
        raw: &(dyn Fn() -> String + Sync),
    ) -> Result<Target, Answer> {
        match parsed {
            Ok(t) => Ok(t),
            Err(e) => Err(self.refuse_target(e, Dest::Raw(raw())).await),
        }
    }

    /// `bad_target` or `host_mismatch`.
    pub(in crate::data) async fn refuse_target(&self, e: TargetError, dest: Dest<'_>) -> Answer {
        let (reason, detail) = match e {
            TargetError::Bad(m) => (DenyReason::BadTarget, m),
            TargetError::HostMismatch(m) => (DenyReason::HostMismatch, m),
        };
        self.deny(reason, detail, dest, &[]).await
    }

    /// Step 4: the allowlist, the tool's methods and its hosts' method and
    /// path rules, before any DNS. Returns whether the matching rule lets
    /// addresses in private ranges through. A request a path rule allows
    /// leaves with its normal path in `target` (what the origin is sent).
    pub(in crate::data) async fn admit(
        &self,
        tool: &ToolPolicy,
        target: &mut Target,
        method: &str,
    ) -> Result<bool, Answer> {
        let private = match policy::admit(tool, target, method) {
            Admission::Allow { private } => private,
            Admission::Deny(d) if d.reason == DenyReason::NotAllowlisted => {
                if !(self.granted(tool, target, method) || self.ask(tool, target, method).await?) {
                    return Err(self.deny(d.reason, d.detail, Dest::Target(target), &[]).await);
                }
                false
            }
            Admission::Deny(d) => return Err(self.deny(d.reason, d.detail, Dest::Target(target), &[]).await),
            Admission::Report { denial, private } => {
                self.report(&denial, target, &[]).await?;
                private
            }
        };
        match policy::request_rules(tool, target, method) {
            Ok(None) => {}
            Ok(Some(normal)) => target.path_and_query = Some(normal),
            Err(d) if tool.mode == Mode::Report && d.reason.reportable() => self.report(&d, target, &[]).await?,
            Err(d) => return Err(self.deny(d.reason, d.detail, Dest::Target(target), &[]).await),
        }
        Ok(private)
    }

    /// Step 4, the upgrade ([`policy::upgrade`]): a WebSocket handshake
    /// goes on (returns `true`), any other upgrade is `upgrade_not_allowed`.
    pub(in crate::data) async fn upgrade(
        &self,
        tool: &ToolPolicy,
        target: &Target,
        asked: &Upgrade,
    ) -> Result<bool, Answer> {
        match policy::upgrade(tool, target, asked) {
            Ok(ws) => Ok(ws),
            Err(d) => Err(self.deny(d.reason, d.detail, Dest::Target(target), &[]).await),
        }
    }

    /// Whether a grant of the run stands in for the missing allowlist entry
    /// of `target` (a name, exactly its port), within the tool's own
    /// `methods`: then one of its uses is taken. Every later step (ranges
    /// after DNS, self-loop, credentials, budgets) still applies.
    fn granted(&self, tool: &ToolPolicy, target: &Target, method: &str) -> bool {
        let (Some(run), Host::Name(name)) = (self.run, &target.host) else {
            return false;
        };
        if !matches!(
            policy::tool_methods(tool, target, method, false),
            Admission::Allow { .. }
        ) {
            return false;
        }
        let Some(left) = run.grants.take(name, target.port) else {
            return false;
        };
        self.sh.metrics.grants(&run.tool, "used").inc();
        tracing::info!(target: "egress::fetch", run = %run.id, tool = %run.tool, dest = %target, uses_left = left, "a grant let the fetch through");
        true
    }

    /// `on_unlisted = "ask"`: holds a fetch to an unlisted name (no DNS,
    /// one of the run's slots taken) for up to `ask_timeout_ms`, after a
    /// `pending` fact (`EGRESS_PENDING`, on the fact stream as `event:
    /// pending`) that a kernel answers with a grant. Whether a grant came in
    /// time (and one of its uses was taken); the run ending meanwhile is
    /// `run_ended`. Without a free slot, or a fact, nothing is held.
    async fn ask(&self, tool: &ToolPolicy, target: &Target, method: &str) -> Result<bool, Answer> {
        let (Some(timeout), Some(run), Host::Name(_)) = (tool.ask, self.run, &target.host) else {
            return Ok(false);
        };
        if !matches!(
            policy::tool_methods(tool, target, method, false),
            Admission::Allow { .. }
        ) {
            return Ok(false);
        }
        let Ok(_slot) = run.slots.clone().try_acquire_owned() else {
            return Ok(false);
        };
        let detail = format!(
            "{target} is not in the allowlist of tool {}: held up to {} ms for a grant of run {}",
            tool.id,
            timeout.as_millis(),
            run.id
        );
        let fact = Fact {
            kind: egress_api::PENDING_FACT_TYPE.to_owned(),
            ..crate::facts::denial(NewFact {
                run_id: Some(&run.id),
                tool: Some(&run.tool),
                reason: "pending",
                mode: "ask",
                target: Some(FactTarget {
                    kind: self.via.as_str().to_owned(),
                    ..fact_target(target)
                }),
                resolved: vec![],
                policy: &self.policy.digest,
                detail,
                run: Some(run),
            })
        };
        if self.sh.facts.record(fact).await.is_err() {
            return Ok(false);
        }
        self.sh.metrics.grants(&run.tool, "asked").inc();
        let until = Instant::now() + timeout;
        loop {
            let added = run.grants.added();
            tokio::pin!(added);
            added.as_mut().enable();
            if self.granted(tool, target, method) {
                return Ok(true);
            }
            tokio::select! {
                _ = &mut added => {}
                _ = tokio::time::sleep_until(until) => return Ok(false),
                _ = self.sh.hard_stop.cancelled() => return Ok(false),
                _ = run.cancel.cancelled() => {
                    let detail = format!("run {} ended while {target} waited for a grant", run.id);
                    return Err(self.deny(DenyReason::RunEnded, detail, Dest::Target(target), &[]).await);
                }
            }
        }
    }

    /// Step 4, the run's budgets: one more fetch of the run, counted
    /// whatever its entrance, unless it would exceed `max_requests_per_run`,
    /// `max_request_rate` or (already spent) `max_bytes_per_run`: then
    /// `budget_exhausted` or `rate_limited` (429). Never waived by report
    /// mode.
    pub(in crate::data) async fn spend(&self, tool: &ToolPolicy, target: &Target) -> Result<(), Answer> {
        let Some(run) = self.run else { return Ok(()) };
        let Err(e) = run.spent.take_request(&tool.budgets) else {
            return Ok(());
        };
        let (reason, detail) = match e {
            Exceeded::Requests(max) => (
                DenyReason::BudgetExhausted,
                format!(
                    "run {} made its {max} requests (max_requests_per_run of tool {})",
                    run.id, run.tool
                ),
            ),
            Exceeded::Bytes(max) => (
                DenyReason::BudgetExhausted,
                format!(
                    "run {} moved its {max} bytes (max_bytes_per_run of tool {})",
                    run.id, run.tool
                ),
            ),
            Exceeded::Rate { per_second, burst } => (
                DenyReason::RateLimited,
                format!(
                    "run {} exceeds {per_second} requests per second (burst {burst}; max_request_rate of tool {})",
                    run.id, run.tool
                ),
            ),
        };
        Err(self.deny(reason, detail, Dest::Target(target), &[]).await)
    }

    /// The fetch's share of its run's `max_bytes_per_run`: the fetch whose
    /// bytes cross it records the `budget_exhausted` fact (in the
    /// background: the cut is no answer to wait for), and every open fetch
    /// of the run is cut.
    pub(in crate::data) fn byte_budget(&self, run: &Arc<Run>, target: &Target, limit: u64) -> Arc<ByteBudget> {
        let facts = self.sh.facts.clone();
        let tm = self.tm.clone();
        let (run_id, tool, policy) = (run.id.clone(), run.tool.clone(), self.policy.digest.clone());
        let cut_run = run.clone();
        let target = FactTarget {
            kind: self.via.as_str().to_owned(),
            ..fact_target(target)
        };
        let on_cut = move || {
            tm.denial(DenyReason::BudgetExhausted);
            let fact = crate::facts::denial(NewFact {
                run_id: Some(&run_id),
                tool: Some(&tool),
                reason: DenyReason::BudgetExhausted.code(),
                mode: Mode::Enforce.as_str(),
                target: Some(target.clone()),
                resolved: vec![],
                policy: &policy,
                detail: format!(
                    "run {run_id} moved its {limit} bytes (max_bytes_per_run of tool {tool}): its open fetches are cut"
                ),
                run: Some(&cut_run),
            });
            let facts = facts.clone();
            tokio::spawn(async move {
                if let Err(e) = facts.record(fact).await {
                    tracing::error!(error = %e, "the budget_exhausted fact of a cut could not be recorded");
                }
            });
        };
        Arc::new(ByteBudget::new(limit, run.clone(), Box::new(on_cut)))
    }

    /// A head of a fetch already allowed (`what`: its `request`, or the
    /// origin's `response`) that does not fit what `run` has left of its
    /// `max_bytes_per_run`: it is not sent, and the fetch is answered
    /// `429 budget_exhausted` with its fact first. The run's other fetches
    /// go on with what is left. Counted as a denial of the budget (the
    /// fetch itself was counted when it was allowed).
    pub(in crate::data) async fn deny_head(&self, run: &Run, target: &Target, what: &str, n: u64) -> Answer {
        let reason = DenyReason::BudgetExhausted;
        self.tm.denial(reason);
        let (_, used) = run.spent.used();
        let limit = self
            .policy
            .tool(&run.tool)
            .and_then(|t| t.budgets.bytes)
            .unwrap_or(used);
        let detail = format!(
            "the {what} head ({n} bytes) to {target} does not fit the {} bytes run {} has left of its {limit} (max_bytes_per_run of tool {})",
            limit.saturating_sub(used),
            run.id,
            run.tool
        );
        tracing::info!(
            target: "egress::fetch",
            run = %run.id,
            tool = %run.tool,
            kind = self.via.as_str(),
            dest = %target,
            decision = "denied",
            reason = reason.code(),
            detail = %detail,
            "fetch cut by its byte budget"
        );
        let detail = crate::facts::bounded(detail);
        match self
            .record(reason, detail.clone(), Some(target), &[], Mode::Enforce)
            .await
        {
            Ok(recorded) => Refusal::Denied(Denied {
                reason,
                detail,
                fact_id: recorded.id,
                target: Some(target.to_string()),
                tool: Some(run.tool.to_string()),
                json: self.json,
            }),
            Err(e) => Refusal::unrecorded(&e),
        }
    }

    /// Step 4, credentials ([`policy::credentials`]): a placeholder of the
    /// run, or the real value of any credential, anywhere in the head to a
    /// host that is not its credential's is denied, and so is a credential
    /// host over `channel` plain HTTP; otherwise the credentials to inject
    /// here. A policy without credentials takes the first branch and
    /// allocates nothing.
    pub(in crate::data) async fn credentials(
        &self,
        tool: &Arc<ToolPolicy>,
        run: &Run,
        target: &Target,
        head: &(dyn Head + Sync),
        channel: Channel,
    ) -> Result<Option<Injection>, Answer> {
        if self.policy.secrets.is_empty() && run.placeholders.is_empty() {
            return Ok(None);
        }
        match policy::credentials(tool, &self.policy.secrets, &run.placeholders, target, channel, head) {
            Ok(i) if i.creds.is_empty() => Ok(None),
            Ok(i) => Ok(Some(Injection {
                tool: tool.clone(),
                creds: i.creds,
                loopback_only: i.loopback_only,
            })),
            Err(d) => Err(self.deny(d.reason, d.detail, Dest::Target(target), &[]).await),
        }
    }

    /// Counts a fetch that goes out: allowed, or reported when report mode
    /// let one of its denials through.
    pub(in crate::data) fn count_allowed(&self, tool: &ToolPolicy) {
        self.allowed(tool).count();
    }

    /// [`Fetch::count_allowed`], to be done later (once the request goes out).
    fn allowed(&self, tool: &ToolPolicy) -> Allowed {
        let decision = if tool.mode == Mode::Report && self.reported.load(Ordering::Relaxed) {
            Decision::Reported
        } else {
            Decision::Allowed
        };
        Allowed {
            tm: self.tm.clone(),
            via: self.via,
            decision,
        }
    }

    pub(in crate::data) fn phase(&self) -> Phase {
        Phase::ALL[usize::from(self.phase.load(Ordering::Relaxed))]
    }

    pub(in crate::data) fn set_phase(&self, p: Phase) {
        let i = Phase::ALL.iter().position(|x| *x == p).unwrap_or(0);
        self.phase.store(i as u8, Ordering::Relaxed);
    }

    /// Records a denial fact, then builds the denial response.
    pub(in crate::data) async fn deny(
        &self,
        reason: DenyReason,
        detail: String,
        dest: Dest<'_>,
        resolved: &[IpAddr],
    ) -> Answer {
        self.deny_with(reason, detail.clone(), detail, dest, resolved).await
    }

    /// [`Fetch::deny`] with an answer to the client that differs from the
    /// fact's detail. A fact that cannot be recorded fails the request
    /// closed (`503 facts_unavailable`).
    pub(in crate::data) async fn deny_with(
        &self,
        reason: DenyReason,
        answer: String,
        detail: String,
        dest: Dest<'_>,
        resolved: &[IpAddr],
    ) -> Answer {
        let km = self.tm.kind(self.via);
        km.request(Decision::Denied);
        let answer = self.refuse(reason, answer, detail, dest, resolved).await;
        km.duration(Outcome::Denied, self.started.elapsed().as_secs_f64());
        answer
    }

    /// Counts the denial, records its fact, logs it and builds its answer
    /// (the request itself counted by the caller).
    async fn refuse(
        &self,
        reason: DenyReason,
        answer: String,
        detail: String,
        dest: Dest<'_>,
        resolved: &[IpAddr],
    ) -> Answer {
        self.tm.denial(reason);
        let (target, quoted, detail) = match dest {
            Dest::Target(t) => (Some(t), Some(t.to_string()), detail),
            Dest::Raw(r) => {
                let detail = format!("{detail} (target {r})");
                (None, Some(r), detail)
            }
            Dest::Withheld => (None, None, detail),
        };
        let detail = crate::facts::bounded(detail);
        let recorded = self
            .record(reason, detail.clone(), target, resolved, Mode::Enforce)
            .await;
        tracing::info!(
            target: "egress::fetch",
            run = self.run.map(|r| &*r.id).unwrap_or("-"),
            tool = self.run.map(|r| &*r.tool).unwrap_or("-"),
            kind = self.via.as_str(),
            dest = %target.map(|t| t.to_string()).unwrap_or_default(),
            decision = "denied",
            reason = reason.code(),
            duration_ms = self.started.elapsed().as_millis() as u64,
            detail = %detail,
            "fetch denied"
        );
        let tool = match reason.rule() {
            "authentication" => None,
            _ => self.run.map(|r| &*r.tool),
        };
        match recorded {
            Ok(recorded) => Refusal::Denied(Denied {
                reason,
                detail: crate::facts::bounded(answer),
                fact_id: recorded.id,
                target: quoted,
                tool: tool.map(str::to_owned),
                json: self.json,
            }),
            Err(e) => Refusal::unrecorded(&e),
        }
    }

    /// Step 1 refused: counted, then recorded and answered by its reason.
    /// The fetch's run is the one the failure is filed under
    /// ([`AuthFailure::claimed`]).
    pub(in crate::data) async fn deny_credential(&self, f: &AuthFailure, raw: String) -> Answer {
        self.sh
            .metrics
            .auth_failures
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: f.reason.code(),
            })
            .inc();
        match f.reason {
            DenyReason::CredentialElsewhere => self.deny_elsewhere(f.on.as_deref()).await,
            reason => self.deny_auth(reason, f.claimed.is_some(), raw).await,
        }
    }

    /// An authentication failure. The client gets the same answer whether
    /// the credential named an existing run with a wrong secret or a run
    /// that does not exist, so no run id can be probed. The fact of a wrong
    /// secret goes to the named run's facts with a fixed text and no target,
    /// so a tool cannot write its own text into another run's facts (and a
    /// flood of them folds into counted facts).
    async fn deny_auth(&self, reason: DenyReason, wrong_secret: bool, raw: String) -> Answer {
        let answer = match reason {
            DenyReason::AuthMissing => "Proxy-Authorization with the run's credential is required",
            _ => "the credential is not valid for any live run",
        };
        let (fact_detail, dest) = match (reason, wrong_secret) {
            (DenyReason::AuthMissing, _) => (answer.to_owned(), Dest::Raw(raw)),
            (_, true) => ("a wrong secret was presented for this run".to_owned(), Dest::Withheld),
            (_, false) => ("the credential names no known run".to_owned(), Dest::Raw(raw)),
        };
        self.deny_with(reason, answer.to_owned(), fact_detail, dest, &[]).await
    }

    /// The valid credential of this fetch's run, which is bound to the
    /// listener handed over for it, presented elsewhere: on the proxy's own
    /// listeners, or on `on`'s listener or transparent socket (whose
    /// sandbox presented it, and which gets a fact too). Only a holder of
    /// the valid secret gets this reason. The facts carry fixed texts and
    /// no target (the presenter is not the run's sandbox, and writes
    /// nothing of its own into the run's facts).
    async fn deny_elsewhere(&self, on: Option<&Run>) -> Answer {
        let id = self.run.map(|r| &*r.id).unwrap_or("-");
        let socket = if self.via == Via::Transparent {
            "a transparent socket"
        } else {
            "the listener"
        };
        let place = match on {
            Some(other) => format!("{socket} handed over for run {}", other.id),
            None => "the proxy's own listener".to_owned(),
        };
        if let Some(other) = on {
            let tm = self.sh.tool_metrics(Some(&other.tool));
            let theirs = Fetch::new(self.sh, self.policy, Some(other), &tm, self.kind, self.started).via(self.via);
            let detail =
                format!("the credential of run {id}, bound to its own sandbox, was presented on {socket} of this run");
            if let Err(e) = theirs
                .record(DenyReason::CredentialElsewhere, detail, None, &[], Mode::Enforce)
                .await
            {
                return Refusal::unrecorded(&e);
            }
        }
        let answer = "this credential is taken only inside its own sandbox, on the listener handed over for its run";
        let detail = format!(
            "this run's credential was presented on {place}; it is taken only on the listener handed over for this run"
        );
        self.deny_with(
            DenyReason::CredentialElsewhere,
            answer.to_owned(),
            detail,
            Dest::Withheld,
            &[],
        )
        .await
    }

    /// Report mode: record what enforce would have denied, then go on.
    pub(in crate::data) async fn report(&self, d: &Denial, target: &Target, resolved: &[IpAddr]) -> Result<(), Answer> {
        self.tm.denial(d.reason);
        self.reported.store(true, Ordering::Relaxed);
        tracing::info!(
            target: "egress::fetch",
            run = self.run.map(|r| &*r.id).unwrap_or("-"),
            tool = self.run.map(|r| &*r.tool).unwrap_or("-"),
            kind = self.via.as_str(),
            dest = %target,
            decision = "reported",
            reason = d.reason.code(),
            detail = %d.detail,
            "fetch allowed in report mode"
        );
        self.record(d.reason, d.detail.clone(), Some(target), resolved, Mode::Report)
            .await
            .map(|_| ())
            .map_err(|e| Refusal::unrecorded(&e))
    }

    /// Hands a fact to the sink and waits until it is stored.
    pub(in crate::data) async fn record(
        &self,
        reason: DenyReason,
        detail: String,
        target: Option<&Target>,
        resolved: &[IpAddr],
        mode: Mode,
    ) -> Result<Recorded, String> {
        let fact = crate::facts::denial(NewFact {
            run_id: self.run.map(|r| &*r.id),
            tool: self.run.map(|r| &*r.tool),
            reason: reason.code(),
            mode: mode.as_str(),
            target: target.map(|t| FactTarget {
                kind: self.via.as_str().to_owned(),
                ..fact_target(t)
            }),
            resolved: resolved.iter().map(|i| i.to_string()).collect(),
            policy: &self.policy.digest,
            detail,
            run: self.run,
        });
        let t0 = StdInstant::now();
        let res = self.sh.facts.record(fact).await;
        self.sh.metrics.fact_write_duration.observe(t0.elapsed().as_secs_f64());
        res.map_err(|e| {
            self.sh.metrics.fact_write_failures.inc();
            tracing::error!(error = %e, "denial fact could not be recorded; failing the request closed");
            format!("the denial could not be recorded ({e}); request refused")
        })
    }
}

/// The head of an HTTP request as the credential checks see it.
pub(in crate::data) struct ReqHead<'r>(pub &'r Request<Incoming>);

impl Head for ReqHead<'_> {
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        let (req, uri) = (self.0, self.0.uri());
        f(req.method().as_str().as_bytes())
            || uri.authority().is_some_and(|a| f(a.as_str().as_bytes()))
            || uri.path_and_query().is_some_and(|pq| f(pq.as_str().as_bytes()))
            || req
                .headers()
                .iter()
                .any(|(k, v)| f(k.as_str().as_bytes()) || f(v.as_bytes()))
    }

    fn header(&self, name: &str, f: &mut dyn FnMut(&[u8])) {
        self.0.headers().get_all(name).iter().for_each(|v| f(v.as_bytes()));
    }

    fn query(&self) -> Option<&str> {
        self.0.uri().query()
    }
}

/// The count of an allowed request, taken when it goes out: at once for a
/// request inside HTTP/1.1, after its slot for an HTTP/2 stream (a stream
/// refused for want of one counts as that denial only).
pub struct Allowed {
    tm: Arc<ToolMetrics>,
    via: Via,
    decision: Decision,
}

impl Allowed {
    pub fn count(&self) {
        self.tm.kind(self.via).request(self.decision);
    }
}

/// What a request inside an intercepted CONNECT goes out with.
pub struct Inside {
    pub target: Target,
    pub credentials: Option<Injection>,
    /// A WebSocket handshake, decided like any request.
    pub websocket: bool,
    /// The tool's `fetch_timeout_ms`: an HTTP/2 stream's own deadline.
    pub fetch_timeout: std::time::Duration,
    /// Its count as allowed (or reported), for the caller to take.
    pub allowed: Allowed,
    /// The tool has `[tools.<id>.mcp]` rules: its MCP messages inside are
    /// decided too (`entrance::mcp`).
    pub mcp: Option<Arc<ToolPolicy>>,
}

/// Credentials of the tool that go into one request.
pub struct Injection {
    pub tool: Arc<ToolPolicy>,
    /// Indices into `tool.credentials`.
    pub creds: Vec<usize>,
    /// Plain HTTP under `allow_plaintext = true`: dialled to loopback only.
    pub loopback_only: bool,
}

/// Steps 2–4 again for one request inside an intercepted CONNECT to
/// `connect` (the caller counts it: [`Inside::allowed`]), with the policy in force now (a reload applies from the next
/// request on): the run still active and its tool configured; the request
/// on the tunnel's host (`host_mismatch`); allowlist and methods; and the
/// credentials (a misused placeholder denied; those to write in returned).
/// Denials are recorded and answered like any other, as kind `http`.
pub async fn decide_inside(
    sh: &Shared,
    run: &Arc<Run>,
    connect: &Target,
    req: &Request<Incoming>,
) -> Result<Inside, Answer> {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Http, Instant::now()).answering(req.headers());
    let tool = fetch.check_run(run, &|| raw_target(req.uri())).await?;
    let mut target = match target::parse_inside(connect, req.uri(), req.headers()) {
        Ok(t) => t,
        Err(e) => return Err(fetch.refuse_target(e, Dest::Target(connect)).await),
    };
    fetch.admit(&tool, &mut target, req.method().as_str()).await?;
    let asked = policy::upgrade_of(req.method().as_str(), req.headers());
    let websocket = fetch.upgrade(&tool, &target, &asked).await?;
    let credentials = fetch
        .credentials(&tool, run, &target, &ReqHead(req), Channel::VerifiedTls)
        .await?;
    fetch.spend(&tool, &target).await?;
    Ok(Inside {
        target,
        credentials,
        websocket,
        fetch_timeout: tool.fetch_timeout,
        allowed: fetch.allowed(&tool),
        mcp: tool.mcp.is_some().then(|| tool.clone()),
    })
}

/// A request inside an intercepted CONNECT refused after its decision
/// (an HTTP/2 stream over the run's `max_concurrent_fetches` queue):
/// recorded and answered like any denial, as kind `http`.
pub async fn deny_inside(sh: &Shared, run: &Run, target: &Target, reason: DenyReason, detail: String) -> Answer {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Http, Instant::now());
    fetch.deny(reason, detail, Dest::Target(target), &[]).await
}

/// A refusal after the request was decided and counted, to a request of
/// `run` to `target` that came in `via` (`json`: it accepts
/// `application/json`): a credential host's answer that the scrubber cannot
/// read ([`relayed`](crate::data::carry::relayed); `unscrubbable`, a `502`
/// that stands for the answer, of which nothing is passed on), or a signed
/// request whose body cannot be re-signed (`signature_unsupported`). A fact,
/// then the answer; this counts the denial.
pub async fn refuse_answer(
    sh: &Shared,
    run: &Run,
    target: &Target,
    via: Via,
    json: bool,
    reason: DenyReason,
    detail: String,
) -> Answer {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let mut fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Http, Instant::now()).via(via);
    fetch.json = json;
    fetch
        .refuse(reason, detail.clone(), detail, Dest::Target(target), &[])
        .await
}

/// An intercepted CONNECT whose TLS names another server (SNI) than the
/// CONNECT target: a `host_mismatch` fact (the connection is then closed;
/// there is no HTTP answer to give before the handshake).
pub async fn deny_sni(sh: &Shared, run: &Run, connect: &Target, sni: &str) {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Connect, Instant::now());
    let detail = format!("TLS server name {sni:?} is not the tunnel's host {connect}");
    let _ = fetch
        .deny(DenyReason::HostMismatch, detail, Dest::Target(connect), &[])
        .await;
}

/// A WebSocket message of the tool that [`policy::websocket_message`]
/// refused, after the handshake to `target`: recorded as a fact like a
/// request's denial (kind `http`). Returns the fact's id (or why there is
/// none), for the close frame.
pub async fn deny_message(sh: &Shared, run: &Run, target: &Target, d: Denial) -> String {
    let policy = sh.policy.load_full();
    let tm = sh.tool_metrics(Some(&run.tool));
    let fetch = Fetch::new(sh, &policy, Some(run), &tm, Kind::Http, Instant::now());
    let refusal = fetch.deny(d.reason, d.detail, Dest::Target(target), &[]).await;
    refusal.fact_id().unwrap_or("unrecorded").to_owned()
}
