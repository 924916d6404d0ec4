//! Prometheus metrics of the executor (`executor_*`), exposed on `/metrics`.
//! Labels are bounded: `tool` comes from the config, `phase`, `outcome`,
//! `reason` and `state` from fixed sets. Histograms are in seconds, 1 ms to 60 s.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets_range, Histogram};
use prometheus_client::registry::Registry;

use crate::kill::KillReason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabel {
    pub tool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub tool: String,
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub tool: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub tool: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// The results of a fleet idempotency claim (`executor_idempotency_claims`).
pub const CLAIM_RESULTS: [&str; 5] = ["won", "done", "in_progress", "conflict", "unavailable"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub tool: String,
    pub state: &'static str,
}

type SecondsHistogram = Family<PhaseLabels, Histogram, fn() -> Histogram>;
type ToolHistogram = Family<ToolLabel, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets_range(0.001, 60.0, 17))
}

/// All executor metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub pool_ready: Family<ToolLabel, Gauge>,
    pub cold_start: SecondsHistogram,
    pub invocations: Family<OutcomeLabels, Counter>,
    pub duration: ToolHistogram,
    pub kills: Family<ReasonLabels, Counter>,
    pub children: Family<StateLabels, Gauge>,
    /// Emits received from children (returned with every outcome).
    pub emits: Family<ToolLabel, Counter>,
    /// UDP datagrams a transparent tool's children sent anywhere but DNS,
    /// dropped in their namespaces (counted once each child is gone).
    pub udp_dropped: Family<ToolLabel, Counter>,
    /// Fleet idempotency claims of keyed invocations, by result.
    pub claims: Family<ResultLabel, Counter>,
    /// Whether a `fork_server` tool's fork server is running (1) or its
    /// children start a fresh interpreter each (0).
    pub fork_server_up: Family<ToolLabel, Gauge>,
    /// Children forked by a tool's fork server.
    pub forked: Family<ToolLabel, Counter>,
    /// Child starts refused because a file the child would run does not
    /// match its pin in `expect_sha256`.
    pub identity_mismatch: Family<ToolLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let pool_ready = Family::<ToolLabel, Gauge>::default();
        let cold_start: SecondsHistogram = Family::new_with_constructor(seconds_histogram);
        let invocations = Family::<OutcomeLabels, Counter>::default();
        let duration: ToolHistogram = Family::new_with_constructor(seconds_histogram);
        let kills = Family::<ReasonLabels, Counter>::default();
        let children = Family::<StateLabels, Gauge>::default();
        let emits = Family::<ToolLabel, Counter>::default();
        let udp_dropped = Family::<ToolLabel, Counter>::default();
        let claims = Family::<ResultLabel, Counter>::default();
        let fork_server_up = Family::<ToolLabel, Gauge>::default();
        let forked = Family::<ToolLabel, Counter>::default();
        let identity_mismatch = Family::<ToolLabel, Counter>::default();
        for result in CLAIM_RESULTS {
            let _ = claims.get_or_create(&ResultLabel { result });
        }
        registry.register(
            "executor_pool_ready",
            "Warm children loaded and waiting for an invocation",
            pool_ready.clone(),
        );
        registry.register(
            "executor_cold_start_seconds",
            "Cold start duration by phase: spawn (to booted), load (booted to ready), total",
            cold_start.clone(),
        );
        registry.register(
            "executor_invocations",
            "Invocations by outcome (ok or the error kind)",
            invocations.clone(),
        );
        registry.register(
            "executor_invocation_duration_seconds",
            "Invocation duration from request to response",
            duration.clone(),
        );
        registry.register("executor_kills", "Child trees killed, by reason", kills.clone());
        registry.register(
            "executor_children",
            "Live children by state (starting, ready, busy)",
            children.clone(),
        );
        registry.register(
            "executor_emits",
            "Emits received from children, returned with every outcome",
            emits.clone(),
        );
        registry.register(
            "executor_transparent_udp_dropped",
            "UDP datagrams a transparent tool's children sent anywhere but DNS, dropped in their namespaces",
            udp_dropped.clone(),
        );
        registry.register(
            "executor_idempotency_claims",
            "Fleet idempotency claims of keyed invocations ([export] sink = \"postgres\"), by result: won (runs here), done (the stored answer), in_progress (runs at another cell), conflict, unavailable (PostgreSQL could not be asked; nothing ran)",
            claims.clone(),
        );
        registry.register(
            "executor_fork_server_up",
            "1 while a fork_server tool's fork server forks its children; 0 when it did not start or died (children then start a fresh interpreter each)",
            fork_server_up.clone(),
        );
        registry.register(
            "executor_forked_children",
            "Children forked by a fork_server tool's fork server",
            forked.clone(),
        );
        registry.register(
            "executor_identity_mismatch",
            "Child starts refused because a file the child would run does not hash to its pin in expect_sha256 (or a pinned file is not run)",
            identity_mismatch.clone(),
        );
        Metrics {
            identity_mismatch,
            fork_server_up,
            forked,
            claims,
            emits,
            udp_dropped,
            registry,
            pool_ready,
            cold_start,
            invocations,
            duration,
            kills,
            children,
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    pub fn kill(&self, tool: &str, reason: KillReason) {
        self.kills
            .get_or_create(&ReasonLabels {
                tool: tool.to_string(),
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn cold_start(&self, tool: &str, phase: &'static str, seconds: f64) {
        self.cold_start
            .get_or_create(&PhaseLabels {
                tool: tool.to_string(),
                phase,
            })
            .observe(seconds);
    }

    /// A `fork_server` tool's child was started: by its server (`forked`)
    /// or the old way; `up`: whether the server is running.
    pub fn fork_server(&self, tool: &str, up: bool, forked: bool) {
        let label = ToolLabel { tool: tool.to_string() };
        self.fork_server_up.get_or_create(&label).set(i64::from(up));
        if forked {
            self.forked.get_or_create(&label).inc();
        }
    }

    /// A child start of `tool` refused by its pins.
    pub fn identity_mismatch(&self, tool: &str) {
        self.identity_mismatch
            .get_or_create(&ToolLabel { tool: tool.to_string() })
            .inc();
    }

    pub fn outcome(&self, tool: &str, outcome: &'static str, seconds: f64) {
        self.invocations
            .get_or_create(&OutcomeLabels {
                tool: tool.to_string(),
                outcome,
            })
            .inc();
        self.duration
            .get_or_create(&ToolLabel { tool: tool.to_string() })
            .observe(seconds);
    }

    /// Creates every bounded series of `tool` at 0, so dashboards and alerts
    /// see a healthy tool as 0, never as "no data".
    pub fn register_tool(&self, tool: &str, transparent: bool, fork_server: bool) {
        let t = || tool.to_string();
        if transparent {
            let _ = self.udp_dropped.get_or_create(&ToolLabel { tool: t() });
        }
        if fork_server {
            let _ = self.fork_server_up.get_or_create(&ToolLabel { tool: t() });
            let _ = self.forked.get_or_create(&ToolLabel { tool: t() });
        }
        for outcome in std::iter::once("ok").chain(crate::error::ErrorKind::ALL.iter().map(|k| k.as_str())) {
            let _ = self.invocations.get_or_create(&OutcomeLabels { tool: t(), outcome });
        }
        for reason in KillReason::ALL {
            let _ = self.kills.get_or_create(&ReasonLabels {
                tool: t(),
                reason: reason.as_str(),
            });
        }
        self.pool_state(tool, 0, 0, 0);
        let _ = self.emits.get_or_create(&ToolLabel { tool: t() });
        let _ = self.identity_mismatch.get_or_create(&ToolLabel { tool: t() });
    }

    pub fn claim(&self, result: &'static str) {
        self.claims.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn udp_dropped(&self, tool: &str, datagrams: u64) {
        self.udp_dropped
            .get_or_create(&ToolLabel { tool: tool.to_string() })
            .inc_by(datagrams);
    }

    pub fn pool_state(&self, tool: &str, ready: usize, starting: usize, busy: usize) {
        self.pool_ready
            .get_or_create(&ToolLabel { tool: tool.to_string() })
            .set(ready as i64);
        for (state, n) in [("ready", ready), ("starting", starting), ("busy", busy)] {
            self.children
                .get_or_create(&StateLabels {
                    tool: tool.to_string(),
                    state,
                })
                .set(n as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_documented_ones() {
        let m = Metrics::new();
        m.pool_state("echo", 1, 0, 0);
        m.cold_start("echo", "spawn", 0.01);
        m.outcome("echo", "ok", 0.002);
        m.kill("echo", KillReason::Timeout);
        m.register_tool("idle", false, false);
        m.identity_mismatch("echo");
        let text = m.encode();
        for needle in [
            "executor_pool_ready{tool=\"echo\"} 1",
            "executor_cold_start_seconds_bucket{le=\"0.001\",tool=\"echo\",phase=\"spawn\"}",
            "executor_invocations_total{tool=\"echo\",outcome=\"ok\"} 1",
            "executor_invocation_duration_seconds_count{tool=\"echo\"} 1",
            "executor_kills_total{tool=\"echo\",reason=\"timeout\"} 1",
            "executor_children{tool=\"echo\",state=\"ready\"} 1",
            "executor_identity_mismatch_total{tool=\"echo\"} 1",
            "executor_identity_mismatch_total{tool=\"idle\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
