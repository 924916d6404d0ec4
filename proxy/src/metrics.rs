//! Prometheus metrics (prometheus-client). Names are `egress_*`; every label
//! value is bounded (tool ids come from the config, `_unknown` otherwise;
//! never run ids, host names or addresses). Per-tool handles are resolved
//! once per run ([`ToolMetrics`]) so the data path touches only atomics.

use crate::deny::{DenyReason, Phase, Via};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// Histogram buckets in seconds, 1 ms to 60 s.
pub const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolKindDecision {
    pub tool: String,
    pub kind: &'static str,
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolReason {
    pub tool: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolKindOutcome {
    pub tool: String,
    pub kind: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolDirection {
    pub tool: String,
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolKind {
    pub tool: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolCredential {
    pub tool: String,
    pub credential: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CredentialOutcome {
    pub tool: String,
    pub credential: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabel {
    pub tool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolWhy {
    pub tool: String,
    pub why: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolState {
    pub tool: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

/// The reasons of `CONTROL_ACTION` facts (`control::actions`).
pub const CONTROL_ACTIONS: [&str; 8] = [
    "grant_refused",
    "reload_applied",
    "reload_refused",
    "run_ended_by_other",
    "principals_changed",
    "credential_refused",
    "beyond_envelope",
    "executable_mismatch",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DigestLabel {
    pub digest: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolPhase {
    pub tool: String,
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolEvent {
    pub tool: String,
    pub event: &'static str,
}

/// Every proxy metric.
pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<ToolKindDecision, Counter>,
    pub denials: Family<ToolReason, Counter>,
    pub fetch_duration: HistFamily<ToolKindOutcome>,
    pub dns_duration: Histogram,
    pub dns_failures: Family<KindLabel, Counter>,
    pub connect_duration: Histogram,
    pub bytes: Family<ToolDirection, Counter>,
    pub open: Family<ToolKind, Gauge>,
    pub slots_in_use: Family<ToolLabel, Gauge>,
    pub slot_wait: HistFamily<ToolLabel>,
    pub runs_active: Family<ToolState, Gauge>,
    pub runs_ended: Family<ToolWhy, Counter>,
    pub auth_failures: Family<ReasonLabel, Counter>,
    pub timeouts: Family<ToolPhase, Counter>,
    pub fact_write_duration: Histogram,
    pub fact_write_failures: Counter,
    pub facts_coalesced: Counter,
    pub errors: Family<ToolReason, Counter>,
    pub upstream_reused: Counter,
    /// Verified TLS handshakes with intercepted origins, by `kind` (`full`,
    /// `resumed`: a session the origin issued earlier was taken up again).
    pub upstream_tls: Family<KindLabel, Counter>,
    pub store: StoreMetrics,
    pub decisions: DecisionMetrics,
    /// Policy reloads by outcome (ok, error, beyond_envelope).
    pub reloads: Family<OutcomeLabel, Counter>,
    /// `CONTROL_ACTION` facts recorded, by reason.
    pub control_actions: Family<ReasonLabel, Counter>,
    /// `egress_config_info{digest}` = 1 for the policy in force.
    pub config_info: Family<DigestLabel, Gauge>,
    /// Connections closed by the admission rules, by listener and why.
    pub conns_refused: Family<ListenerReason, Counter>,
    /// Occurrences of a credential's secret replaced in responses.
    pub credential_scrubs: Family<ToolCredential, Counter>,
    /// Grants (`event` = `granted` | `used`), per tool.
    pub grants: Family<ToolEvent, Counter>,
    /// Reads of live credential sources, by outcome (`ok`, `error`,
    /// `timeout`), present at 0 for each live credential.
    pub credential_refresh: Family<CredentialOutcome, Counter>,
    /// Until when each live credential's value may be used (Unix seconds;
    /// 0 before any value).
    pub credential_expiry: Family<ToolCredential, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// The fleet exporter's (present at 0 without `[export]` too).
    pub export: ExportMetrics,
    /// The audit sinks'.
    pub audit: AuditMetrics,
    /// `egress_cell_info{cell,epoch,policy}` = 1.
    pub cell_info: Family<CellInfo, Gauge>,
}

/// The exporter's metrics.
#[derive(Clone)]
pub struct ExportMetrics {
    /// Facts committed locally and not yet in PostgreSQL.
    pub lag: Gauge,
    pub facts: Counter,
    /// Signed checkpoints copied to `egress_checkpoints`.
    pub checkpoints: Counter,
    /// Failures by kind (`connect`, `migrate`, `lock`, `read`, `write`).
    pub failures: Family<KindLabel, Counter>,
    pub batch_duration: Histogram,
    pub last_success: Gauge<f64, std::sync::atomic::AtomicU64>,
}

/// The kinds of exporter failure, all present at 0 from the start.
pub const EXPORT_FAILURES: [&str; 5] = ["connect", "migrate", "lock", "read", "write"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CellInfo {
    pub cell: String,
    pub epoch: String,
    pub policy: String,
}

/// The audit sinks' (`[audit.sinks.NAME]`), each present at 0 for every
/// configured sink ([`AuditMetrics::sink`]).
#[derive(Clone, Default)]
pub struct AuditMetrics {
    /// Records in the store not yet exported, by sink and `log`.
    pub lag: Family<SinkLog, Gauge>,
    pub exported: Family<SinkLog, Counter>,
    /// Records deleted before this sink exported them (decision records
    /// beyond their budget), by sink and `log`.
    pub dropped: Family<SinkLog, Counter>,
    pub failures: Family<SinkKind, Counter>,
    pub last_success: Family<SinkLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

/// The kinds of audit sink failure, all present at 0 from the start.
pub const AUDIT_FAILURES: [&str; 9] = [
    "read", "connect", "tls", "timeout", "write", "http_4xx", "http_429", "http_5xx", "rejected",
];

impl AuditMetrics {
    /// Makes every series of `sink` present (at 0), for the record logs `logs`.
    pub fn sink(&self, sink: &str, logs: &[&'static str]) {
        for log in logs {
            let l = SinkLog {
                sink: sink.to_owned(),
                log,
            };
            let _ = self.lag.get_or_create(&l);
            let _ = self.exported.get_or_create(&l);
            let _ = self.dropped.get_or_create(&l);
        }
        for kind in AUDIT_FAILURES {
            let _ = self.failures.get_or_create(&SinkKind {
                sink: sink.to_owned(),
                kind,
            });
        }
        let _ = self.last_success.get_or_create(&SinkLabel { sink: sink.to_owned() });
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLog {
    pub sink: String,
    /// `facts` or `decisions` (the OCSF `metadata.log_name`).
    pub log: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkKind {
    pub sink: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    pub sink: String,
}

/// The decision log's.
#[derive(Clone, Default)]
pub struct DecisionMetrics {
    /// Records dropped: the queue was full, or the store could not be written.
    pub dropped: Counter,
    pub recorded: Counter,
    /// Records deleted by the budget or the retention.
    pub pruned: Counter,
    pub bytes: Gauge,
    pub budget: Gauge,
}

/// The fact store's size and pruning.
#[derive(Clone, Default)]
pub struct StoreMetrics {
    pub coalesced: Counter,
    /// Bytes in use by the store (pages holding data).
    pub bytes: Gauge,
    pub budget: Gauge,
    pub pruned: Counter,
    /// Signed checkpoints of the fact log's chains.
    pub checkpoints: Counter,
    /// Unix time up to which every committed record was covered by a
    /// signed checkpoint (0: no key, or nothing signed yet).
    pub signed_through: Gauge<f64, std::sync::atomic::AtomicU64>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerReason {
    pub listener: &'static str,
    pub reason: &'static str,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<ToolKindDecision, Counter>::default();
        let denials = Family::<ToolReason, Counter>::default();
        let fetch_duration = HistFamily::<ToolKindOutcome>::new_with_constructor(histogram);
        let dns_duration = histogram();
        let dns_failures = Family::<KindLabel, Counter>::default();
        let connect_duration = histogram();
        let bytes = Family::<ToolDirection, Counter>::default();
        let open = Family::<ToolKind, Gauge>::default();
        let slots_in_use = Family::<ToolLabel, Gauge>::default();
        let slot_wait = HistFamily::<ToolLabel>::new_with_constructor(histogram);
        let runs_active = Family::<ToolState, Gauge>::default();
        let runs_ended = Family::<ToolWhy, Counter>::default();
        let auth_failures = Family::<ReasonLabel, Counter>::default();
        let timeouts = Family::<ToolPhase, Counter>::default();
        let fact_write_duration = histogram();
        let fact_write_failures = Counter::default();
        let facts_coalesced = Counter::default();
        let errors = Family::<ToolReason, Counter>::default();
        let upstream_reused = Counter::default();
        let upstream_tls = Family::<KindLabel, Counter>::default();
        for kind in ["full", "resumed"] {
            let _ = upstream_tls.get_or_create(&KindLabel { kind });
        }
        let store = StoreMetrics {
            coalesced: facts_coalesced.clone(),
            ..StoreMetrics::default()
        };
        let conns_refused = Family::<ListenerReason, Counter>::default();
        let reloads = Family::<OutcomeLabel, Counter>::default();
        let config_info = Family::<DigestLabel, Gauge>::default();
        for outcome in ["ok", "error", "beyond_envelope"] {
            let _ = reloads.get_or_create(&OutcomeLabel { outcome });
        }
        let control_actions = Family::<ReasonLabel, Counter>::default();
        for reason in CONTROL_ACTIONS {
            let _ = control_actions.get_or_create(&ReasonLabel { reason });
        }
        for kind in ["not_found", "failed"] {
            let _ = dns_failures.get_or_create(&KindLabel { kind });
        }
        for reason in DenyReason::AUTHENTICATION {
            let _ = auth_failures.get_or_create(&ReasonLabel { reason: reason.code() });
        }
        registry.register(
            "egress_requests",
            "Fetches by decision (allowed, denied, reported, error)",
            requests.clone(),
        );
        registry.register("egress_denials", "Denials by reason", denials.clone());
        registry.register(
            "egress_fetch_duration_seconds",
            "Fetch duration from authentication to the end of the response or tunnel",
            fetch_duration.clone(),
        );
        registry.register(
            "egress_dns_lookup_duration_seconds",
            "DNS lookup duration",
            dns_duration.clone(),
        );
        registry.register(
            "egress_dns_failures",
            "DNS lookups that gave no address",
            dns_failures.clone(),
        );
        registry.register(
            "egress_connect_duration_seconds",
            "Upstream TCP connect duration",
            connect_duration.clone(),
        );
        registry.register("egress_bytes", "Bytes relayed (up = client to origin)", bytes.clone());
        registry.register(
            "egress_open_connections",
            "Open upstream fetches and tunnels",
            open.clone(),
        );
        registry.register("egress_slots_in_use", "Concurrency slots held", slots_in_use.clone());
        registry.register(
            "egress_slot_wait_seconds",
            "Time spent waiting for a concurrency slot",
            slot_wait.clone(),
        );
        registry.register(
            "egress_runs_active",
            "Runs not yet ended, by state (created = warm, not yet activated; active)",
            runs_active.clone(),
        );
        registry.register("egress_runs_ended", "Runs ended, by why", runs_ended.clone());
        registry.register(
            "egress_auth_failures",
            "Proxy authentication failures",
            auth_failures.clone(),
        );
        registry.register("egress_timeouts", "Fetch deadlines expired, by phase", timeouts.clone());
        registry.register(
            "egress_fact_write_duration_seconds",
            "Time to durably record a fact",
            fact_write_duration.clone(),
        );
        registry.register(
            "egress_fact_write_failures",
            "Facts that could not be recorded",
            fact_write_failures.clone(),
        );
        registry.register(
            "egress_facts_coalesced",
            "Repeated identical denials folded into an existing fact's count",
            facts_coalesced.clone(),
        );
        registry.register(
            "egress_fetch_errors",
            "Fetches that failed for non-policy reasons (dns, connect, upstream, timeout)",
            errors.clone(),
        );
        registry.register(
            "egress_upstream_reused",
            "Plain-HTTP fetches that reused an idle upstream connection of their run",
            upstream_reused.clone(),
        );
        registry.register(
            "egress_upstream_tls_handshakes",
            "Verified TLS handshakes with intercepted origins, by kind (full, resumed)",
            upstream_tls.clone(),
        );
        registry.register(
            "egress_facts_store_bytes",
            "Bytes of the fact store holding facts",
            store.bytes.clone(),
        );
        registry.register(
            "egress_facts_store_budget_bytes",
            "Size budget of the fact store (proxy.facts_max_mb)",
            store.budget.clone(),
        );
        registry.register(
            "egress_facts_pruned",
            "Facts deleted because they were older than proxy.facts_retention_hours",
            store.pruned.clone(),
        );
        registry.register(
            "egress_audit_checkpoints",
            "Checkpoints of the fact log's hash chains signed with [audit] signing_key_file",
            store.checkpoints.clone(),
        );
        registry.register(
            "egress_audit_signed_through_timestamp_seconds",
            "Unix time up to which every committed fact and decision record was covered by a signed checkpoint (0 without [audit] signing_key_file)",
            store.signed_through.clone(),
        );
        registry.register(
            "egress_connections_closed",
            "Connections closed by admission rules (listener = data or control; reason = evicted, head_timeout, limit, run_limit)",
            conns_refused.clone(),
        );
        for listener in ["data", "control"] {
            for reason in ["evicted", "head_timeout", "limit", "run_limit"] {
                if listener == "control" && reason == "run_limit" {
                    continue;
                }
                let _ = conns_refused.get_or_create(&ListenerReason { listener, reason });
            }
        }
        registry.register("egress_reloads", "Policy reloads, by outcome", reloads.clone());
        registry.register(
            "egress_control_actions",
            "CONTROL_ACTION facts recorded, by reason",
            control_actions.clone(),
        );
        registry.register(
            "egress_config_info",
            "The digest of the policy in force (value 1)",
            config_info.clone(),
        );
        let credential_scrubs = Family::<ToolCredential, Counter>::default();
        registry.register(
            "egress_credential_scrubs",
            "Occurrences of a credential's real secret replaced by the run's placeholder in responses from its hosts",
            credential_scrubs.clone(),
        );
        let grants = Family::<ToolEvent, Counter>::default();
        registry.register(
            "egress_grants",
            "Grants a kernel made for one run (event=granted) and fetches they let through (event=used)",
            grants.clone(),
        );
        let credential_refresh = Family::<CredentialOutcome, Counter>::default();
        registry.register(
            "egress_credential_refresh",
            "Reads of live credential sources (a file with ttl_ms, a command, a minted token), by outcome (ok, error, timeout)",
            credential_refresh.clone(),
        );
        let credential_expiry = Family::<ToolCredential, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "egress_credential_expiry_seconds",
            "Until when a live credential's value may be used, as Unix seconds (0: no value yet)",
            credential_expiry.clone(),
        );
        let export = ExportMetrics {
            lag: Gauge::default(),
            facts: Counter::default(),
            checkpoints: Counter::default(),
            failures: Family::<KindLabel, Counter>::default(),
            batch_duration: histogram(),
            last_success: Gauge::default(),
        };
        for kind in EXPORT_FAILURES {
            let _ = export.failures.get_or_create(&KindLabel { kind });
        }
        registry.register(
            "egress_export_lag_facts",
            "Denial facts committed locally and not yet exported",
            export.lag.clone(),
        );
        registry.register(
            "egress_export_facts",
            "Denial facts exported to the fleet store",
            export.facts.clone(),
        );
        registry.register(
            "egress_export_checkpoints",
            "Signed checkpoints of the fact log copied to the fleet store (egress_checkpoints)",
            export.checkpoints.clone(),
        );
        registry.register(
            "egress_export_failures",
            "Exporter failures, by kind (connect, migrate, lock, read, write)",
            export.failures.clone(),
        );
        registry.register(
            "egress_export_batch_duration_seconds",
            "Time to export one batch of facts (one transaction)",
            export.batch_duration.clone(),
        );
        registry.register(
            "egress_export_last_success_timestamp_seconds",
            "Unix time of the last batch exported (or of the last check that found nothing to export)",
            export.last_success.clone(),
        );
        let audit = AuditMetrics::default();
        registry.register(
            "egress_audit_sink_lag_records",
            "Records in the store an audit sink has not exported yet, by sink and log (facts, decisions)",
            audit.lag.clone(),
        );
        registry.register(
            "egress_audit_sink_exported",
            "Records an audit sink delivered (OCSF events), by sink and log",
            audit.exported.clone(),
        );
        registry.register(
            "egress_audit_sink_dropped",
            "Records deleted from the store before an audit sink exported them (decision records beyond their budget), by sink and log",
            audit.dropped.clone(),
        );
        registry.register(
            "egress_audit_sink_failures",
            "Audit sink failures, by sink and kind (read, connect, tls, timeout, write, http_4xx, http_429, http_5xx, rejected)",
            audit.failures.clone(),
        );
        registry.register(
            "egress_audit_sink_last_success_timestamp_seconds",
            "Unix time an audit sink last delivered a batch or found nothing to export",
            audit.last_success.clone(),
        );
        let decisions = DecisionMetrics::default();
        registry.register(
            "egress_decisions_dropped",
            "Decision log records dropped because its queue was full or the store could not be written",
            decisions.dropped.clone(),
        );
        registry.register(
            "egress_decisions_recorded",
            "Decision log records written",
            decisions.recorded.clone(),
        );
        registry.register(
            "egress_decisions_pruned",
            "Decision log records deleted by its budget (proxy.decisions_max_mb) or retention",
            decisions.pruned.clone(),
        );
        registry.register(
            "egress_decisions_store_bytes",
            "Bytes the decision log holds",
            decisions.bytes.clone(),
        );
        registry.register(
            "egress_decisions_store_budget_bytes",
            "Size budget of the decision log (proxy.decisions_max_mb)",
            decisions.budget.clone(),
        );
        let cell_info = Family::<CellInfo, Gauge>::default();
        registry.register(
            "egress_cell_info",
            "The cell's id, its store's epoch and the policy in force (value 1)",
            cell_info.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector));
        Metrics {
            decisions,
            audit,
            grants,
            credential_refresh,
            credential_expiry,
            export,
            cell_info,
            credential_scrubs,
            registry,
            requests,
            denials,
            fetch_duration,
            dns_duration,
            dns_failures,
            connect_duration,
            bytes,
            open,
            slots_in_use,
            slot_wait,
            runs_active,
            runs_ended,
            auth_failures,
            timeouts,
            fact_write_duration,
            fact_write_failures,
            facts_coalesced,
            errors,
            upstream_reused,
            upstream_tls,
            store,
            conns_refused,
            reloads,
            control_actions,
            config_info,
        }
    }

    /// Counts a recorded `CONTROL_ACTION` fact.
    pub fn control_action(&self, reason: &'static str) {
        self.control_actions.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts a finished handshake with an intercepted origin by its kind.
    pub fn upstream_tls_done(&self, conn: &rustls::ClientConnection) {
        let kind = match conn.handshake_kind() {
            Some(rustls::HandshakeKind::Resumed) => "resumed",
            _ => "full",
        };
        self.upstream_tls.get_or_create(&KindLabel { kind }).inc();
    }

    /// Makes `digest` the one `egress_config_info` series.
    pub fn set_config(&self, old: Option<&str>, digest: &str) {
        if let Some(old) = old.filter(|o| *o != digest) {
            self.config_info.remove(&DigestLabel { digest: old.to_owned() });
        }
        self.config_info
            .get_or_create(&DigestLabel {
                digest: digest.to_owned(),
            })
            .set(1);
    }

    /// Makes `info` the one `egress_cell_info` series.
    pub fn set_cell_info(&self, info: CellInfo) {
        self.cell_info.clear();
        self.cell_info.get_or_create(&info).set(1);
    }

    /// Renders the OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The scrub counter of one credential of a tool (a label lookup: made
    /// for each credential when the policy is loaded, and on each scrub).
    pub fn credential_scrubs(&self, tool: &str, credential: &str) -> Counter {
        self.credential_scrubs.get_or_create_owned(&ToolCredential {
            tool: tool.to_owned(),
            credential: credential.to_owned(),
        })
    }

    /// The grant counter of a tool for `event` (`granted` or `used`).
    pub fn grants(&self, tool: &str, event: &'static str) -> Counter {
        self.grants.get_or_create_owned(&ToolEvent {
            tool: tool.to_owned(),
            event,
        })
    }

    /// Per-tool handles, resolved once (label lookups take a lock; the data path must not).
    pub fn tool(&self, tool: &str) -> Arc<ToolMetrics> {
        let t = || tool.to_owned();
        let kinds = Via::ALL.map(Via::as_str);
        let decisions = ["allowed", "denied", "reported", "error"];
        let outcomes = ["ok", "denied", "error", "timeout", "severed"];
        let per_kind = |k: &'static str| KindMetrics {
            requests: decisions.map(|d| {
                self.requests.get_or_create_owned(&ToolKindDecision {
                    tool: t(),
                    kind: k,
                    decision: d,
                })
            }),
            duration: outcomes.map(|o| {
                self.fetch_duration.get_or_create_owned(&ToolKindOutcome {
                    tool: t(),
                    kind: k,
                    outcome: o,
                })
            }),
            open: self.open.get_or_create_owned(&ToolKind { tool: t(), kind: k }),
        };
        // Every bounded label combination exists at 0 from the start, so
        // dashboards and alerts never see "no data" for a healthy system.
        for e in crate::deny::FetchError::COUNTED {
            let _ = self.errors.get_or_create(&ToolReason {
                tool: t(),
                reason: e.code(),
            });
        }
        for why in crate::runs::EndReason::ALL {
            let _ = self.runs_ended.get_or_create(&ToolWhy {
                tool: t(),
                why: why.as_str(),
            });
        }
        Arc::new(ToolMetrics {
            kinds: kinds.map(per_kind),
            denials: DenyReason::ALL.map(|r| {
                self.denials.get_or_create_owned(&ToolReason {
                    tool: t(),
                    reason: r.code(),
                })
            }),
            bytes_up: self.bytes.get_or_create_owned(&ToolDirection {
                tool: t(),
                direction: "up",
            }),
            bytes_down: self.bytes.get_or_create_owned(&ToolDirection {
                tool: t(),
                direction: "down",
            }),
            slots_in_use: self.slots_in_use.get_or_create_owned(&ToolLabel { tool: t() }),
            slot_wait: self.slot_wait.get_or_create_owned(&ToolLabel { tool: t() }),
            runs_created: self.runs_active.get_or_create_owned(&ToolState {
                tool: t(),
                state: "created",
            }),
            runs_active: self.runs_active.get_or_create_owned(&ToolState {
                tool: t(),
                state: "active",
            }),
            timeouts: Phase::ALL.map(|p| {
                self.timeouts.get_or_create_owned(&ToolPhase {
                    tool: t(),
                    phase: p.as_str(),
                })
            }),
        })
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Per-kind handles.
pub struct KindMetrics {
    requests: [Counter; 4],
    duration: [Histogram; 5],
    pub open: Gauge,
}

/// Decisions for `egress_requests_total{decision}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Allowed = 0,
    Denied = 1,
    Reported = 2,
    Error = 3,
}

/// Outcomes for `egress_fetch_duration_seconds{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok = 0,
    Denied = 1,
    Error = 2,
    Timeout = 3,
    Severed = 4,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Denied => "denied",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::Severed => "severed",
        }
    }
}

impl KindMetrics {
    pub fn request(&self, d: Decision) {
        self.requests[d as usize].inc();
    }

    pub fn duration(&self, o: Outcome, secs: f64) {
        self.duration[o as usize].observe(secs);
    }
}

/// Handles for one tool.
pub struct ToolMetrics {
    kinds: [KindMetrics; Via::ALL.len()],
    denials: [Counter; DenyReason::ALL.len()],
    pub bytes_up: Counter,
    pub bytes_down: Counter,
    pub slots_in_use: Gauge,
    pub slot_wait: Histogram,
    pub runs_created: Gauge,
    pub runs_active: Gauge,
    timeouts: [Counter; 6],
}

impl ToolMetrics {
    pub fn kind(&self, k: Via) -> &KindMetrics {
        match k {
            Via::Connect => &self.kinds[0],
            Via::Http => &self.kinds[1],
            Via::Transparent => &self.kinds[2],
            Via::Dns => &self.kinds[3],
        }
    }

    pub fn denial(&self, r: DenyReason) {
        if let Some(i) = DenyReason::ALL.iter().position(|x| *x == r) {
            self.denials[i].inc();
        }
    }

    pub fn timeout(&self, phase: Phase) {
        if let Some(i) = Phase::ALL.iter().position(|p| *p == phase) {
            self.timeouts[i].inc();
        }
    }
}

/// Process metrics read from `/proc/self` at scrape time.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let page = 4096.0;
        let ticks = 100.0;
        if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
            if let Some(rss) = statm.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()) {
                let g = ConstGauge::new(rss * page);
                g.encode(encoder.encode_descriptor(
                    "process_resident_memory_bytes",
                    "Resident memory size in bytes",
                    None,
                    g.metric_type(),
                )?)?;
            }
        }
        if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
            let g = ConstGauge::new(rd.count() as i64);
            g.encode(encoder.encode_descriptor("process_open_fds", "Open file descriptors", None, g.metric_type())?)?;
        }
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            // Fields after the parenthesised command name; utime and stime are 14th and 15th overall.
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                let ut = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
                let st = f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
                let c = ConstCounter::new((ut + st) / ticks);
                c.encode(encoder.encode_descriptor(
                    "process_cpu_seconds",
                    "User and system CPU time in seconds",
                    None,
                    c.metric_type(),
                )?)?;
            }
        }
        Ok(())
    }
}
