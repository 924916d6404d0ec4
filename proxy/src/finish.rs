//! The end of one fetch: a guard that, when dropped, records the fetch's
//! outcome, duration and bytes in the metrics and writes the one log line
//! per decision (run, tool, target, decision, reason, duration, bytes).
//! It never logs secrets or `Proxy-Authorization`.

use crate::metrics::{Outcome, ToolMetrics};
use crate::target::Kind;
use std::sync::Arc;
use std::time::Instant;

pub struct Finish {
    pub tm: Arc<ToolMetrics>,
    pub kind: Kind,
    pub started: Instant,
    pub run_id: Arc<str>,
    pub tool: Arc<str>,
    pub target: String,
    pub up: u64,
    pub down: u64,
    outcome: Outcome,
    reason: &'static str,
    open: bool,
    done: bool,
    silent: bool,
}

impl Finish {
    pub fn new(
        tm: Arc<ToolMetrics>,
        kind: Kind,
        started: Instant,
        run_id: Arc<str>,
        tool: Arc<str>,
        target: String,
    ) -> Finish {
        Finish {
            tm,
            kind,
            started,
            run_id,
            tool,
            target,
            up: 0,
            down: 0,
            outcome: Outcome::Severed,
            reason: "client_gone",
            open: false,
            done: false,
            silent: false,
        }
    }

    /// Marks the fetch as open upstream (gauge up until drop).
    pub fn opened(&mut self) {
        if !self.open {
            self.open = true;
            self.tm.kind(self.kind).open.inc();
        }
    }

    /// The fetch ended as a recorded denial: nothing more to count or log.
    pub fn discard(&mut self) {
        self.done = true;
        self.silent = true;
    }

    pub fn complete(&mut self) {
        self.set(Outcome::Ok, "");
    }

    pub fn timed_out(&mut self, phase: &'static str) {
        if !self.done {
            self.tm.timeout(phase);
        }
        self.set(Outcome::Timeout, phase);
    }

    pub fn severed(&mut self, why: &'static str) {
        self.set(Outcome::Severed, why);
    }

    pub fn failed(&mut self, why: &'static str) {
        self.set(Outcome::Error, why);
    }

    fn set(&mut self, o: Outcome, reason: &'static str) {
        if !self.done {
            self.done = true;
            self.outcome = o;
            self.reason = reason;
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        let km = self.tm.kind(self.kind);
        if self.open {
            km.open.dec();
        }
        if self.silent {
            return;
        }
        let secs = self.started.elapsed().as_secs_f64();
        km.duration(self.outcome, secs);
        self.tm.bytes_up.inc_by(self.up);
        self.tm.bytes_down.inc_by(self.down);
        let outcome = match self.outcome {
            Outcome::Ok => "ok",
            Outcome::Denied => "denied",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::Severed => "severed",
        };
        tracing::info!(
            target: "egress::fetch",
            run = %self.run_id,
            tool = %self.tool,
            kind = self.kind.as_str(),
            dest = %self.target,
            decision = "allowed",
            outcome,
            reason = self.reason,
            duration_ms = (secs * 1000.0) as u64,
            bytes_up = self.up,
            bytes_down = self.down,
            "fetch finished"
        );
    }
}
