//! The end of one fetch: a record shared by whatever carries the fetch (the
//! request body, the response body, a tunnel) that, when the last of them
//! drops it, records the fetch's outcome, duration and bytes in the metrics
//! and in the run's counters, and writes the one log line per decision (run,
//! tool, target, decision, reason, duration, bytes), and, when the fetch is
//! sampled, offers its record to the decision log (never waiting for it).
//! The first outcome set wins; it never logs secrets or
//! `Proxy-Authorization`.

use crate::deny::{Phase, Via};
use crate::facts::decisions::{Decision, DecisionLog};
use crate::metrics::{Outcome, ToolMetrics};
use crate::runs::budget::ByteBudget;
use crate::runs::Run;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use tokio::time::Instant;

pub struct Finish {
    pub tm: Arc<ToolMetrics>,
    pub kind: Via,
    pub started: Instant,
    pub run: Arc<Run>,
    pub target: String,
    up: AtomicU64,
    down: AtomicU64,
    end: OnceLock<(Outcome, &'static str)>,
    open: AtomicBool,
    silent: AtomicBool,
    /// The run's byte budget, when its tool has one.
    pub budget: Option<Arc<ByteBudget>>,
    /// The origin's status code (0: none seen).
    status: AtomicU16,
    /// The decision log's record, when this fetch is sampled.
    pub logged: Option<Box<Logged>>,
}

/// What a fetch's decision record says besides what [`Finish`] counts.
pub struct Logged {
    pub log: Arc<DecisionLog>,
    pub host: String,
    pub port: u16,
    pub method: Option<String>,
    pub path: Option<String>,
    pub policy: String,
    pub resolved: Vec<String>,
    pub reported: bool,
}

impl Finish {
    pub fn new(tm: Arc<ToolMetrics>, kind: Via, started: Instant, run: Arc<Run>, target: String) -> Finish {
        Finish {
            tm,
            kind,
            started,
            run,
            target,
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            end: OnceLock::new(),
            open: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            budget: None,
            status: AtomicU16::new(0),
            logged: None,
        }
    }

    /// The origin answered with `status`.
    pub fn set_status(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    /// Bytes already counted on the run's byte budget as they moved (a
    /// [`Meter`](crate::data::carry::tunnel::Meter)'s totals).
    pub fn add_metered(&self, up: u64, down: u64) {
        self.up.fetch_add(up, Ordering::Relaxed);
        self.down.fetch_add(down, Ordering::Relaxed);
    }

    /// Fires once the run's byte budget is spent (never without one).
    pub fn budget_cut(&self) -> Option<tokio_util::sync::CancellationToken> {
        self.budget.as_ref().map(|b| b.exhausted().clone())
    }

    /// Body bytes sent towards the origin (already granted by the byte budget).
    pub fn add_up(&self, n: u64) {
        self.up.fetch_add(n, Ordering::Relaxed);
    }

    /// Body bytes sent towards the client (already granted by the byte budget).
    pub fn add_down(&self, n: u64) {
        self.down.fetch_add(n, Ordering::Relaxed);
    }

    /// A message head of `n` bytes about to go towards the origin (`up`) or
    /// the client: taken whole from the byte budget and counted, or `false`
    /// (nothing taken) when it does not fit what the run has left.
    pub fn head(&self, n: u64, up: bool) -> bool {
        if let Some(b) = &self.budget {
            if !b.take_head(n as usize) {
                return false;
            }
        }
        if up {
            self.add_up(n);
        } else {
            self.add_down(n);
        }
        true
    }

    /// Marks the fetch as open upstream (gauge up until drop).
    pub fn opened(&self) {
        if !self.open.swap(true, Ordering::Relaxed) {
            self.tm.kind(self.kind).open.inc();
        }
    }

    /// The fetch ended as a recorded denial: nothing more to count or log.
    pub fn discard(&self) {
        self.silent.store(true, Ordering::Relaxed);
        self.set(Outcome::Denied, "");
    }

    pub fn complete(&self) {
        self.set(Outcome::Ok, "");
    }

    pub fn timed_out(&self, phase: Phase) {
        if self.set(Outcome::Timeout, phase.as_str()) {
            self.tm.timeout(phase);
        }
    }

    pub fn severed(&self, why: &'static str) {
        self.set(Outcome::Severed, why);
    }

    pub fn failed(&self, why: &'static str) {
        self.set(Outcome::Error, why);
    }

    /// Sets the outcome if none is set yet; returns whether this call set it.
    fn set(&self, o: Outcome, reason: &'static str) -> bool {
        self.end.set((o, reason)).is_ok()
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        let km = self.tm.kind(self.kind);
        if *self.open.get_mut() {
            km.open.dec();
        }
        if *self.silent.get_mut() {
            return;
        }
        let (outcome, reason) = *self.end.get().unwrap_or(&(Outcome::Severed, "client_gone"));
        let (up, down) = (*self.up.get_mut(), *self.down.get_mut());
        let secs = self.started.elapsed().as_secs_f64();
        km.duration(outcome, secs);
        self.tm.bytes_up.inc_by(up);
        self.tm.bytes_down.inc_by(down);
        self.run.count_bytes(up, down);
        tracing::info!(
            target: "egress::fetch",
            run = %self.run.id,
            tool = %self.run.tool,
            kind = self.kind.as_str(),
            dest = %self.target,
            decision = "allowed",
            outcome = outcome.as_str(),
            reason,
            duration_ms = (secs * 1000.0) as u64,
            bytes_up = up,
            bytes_down = down,
            "fetch finished"
        );
        if let Some(l) = self.logged.take() {
            let status = *self.status.get_mut();
            l.log.offer(Decision {
                seq: 0,
                at: crate::time::rfc3339(std::time::SystemTime::now()),
                run_id: self.run.id.to_string(),
                tool: self.run.tool.to_string(),
                principal: self.run.principal().map(|p| p.to_string()),
                executables: self.run.executables.clone(),
                kind: self.kind.as_str().to_owned(),
                target: std::mem::take(&mut self.target),
                host: l.host,
                port: l.port,
                method: l.method,
                path: l.path,
                status: (status != 0).then_some(status),
                outcome: outcome.as_str().to_owned(),
                reported: l.reported,
                bytes_up: up,
                bytes_down: down,
                duration_ms: (secs * 1000.0) as u64,
                policy: l.policy,
                resolved: l.resolved,
            });
        }
    }
}
