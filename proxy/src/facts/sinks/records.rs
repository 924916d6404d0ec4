//! What a sink exports, and the one place its kinds are listed
//! ([`RecordKind`]): each kind is a log of the store with its own `seq` and
//! its own cursor per sink (`meta` key `sink:<name>:<log>`), read oldest
//! first and mapped to OCSF events by [`crate::facts::ocsf`]. A new kind
//! is a new variant here, with its `read` and `head`.

use crate::facts::decisions::{DecisionLog, DecisionQuery};
use crate::facts::{chain, ocsf};
use crate::facts::{FactQuery, FactSink};
use serde_json::Value;
use std::sync::Arc;

/// The kinds of record a sink exports, each in `seq` order by its own cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// Denial, pending, grant and control facts (`facts`).
    Facts,
    /// Decision-log records: allowed fetches (`decisions`).
    Decisions,
    /// Signed checkpoints of the chains over the other two (`checkpoints`).
    Checkpoints,
}

/// How many kinds there are (the length of a sink's cursor array).
pub const KINDS: usize = 3;

impl RecordKind {
    /// Every kind, in the order a sink visits them. A new kind is added
    /// here, to [`KINDS`], and to `log`, [`Source::read`] and
    /// [`Source::head`].
    pub const ALL: [RecordKind; KINDS] = [RecordKind::Facts, RecordKind::Decisions, RecordKind::Checkpoints];

    /// The log's name: the OCSF `metadata.log_name`, the metric label `log`
    /// and the last part of the cursor's key.
    pub fn log(self) -> &'static str {
        match self {
            RecordKind::Facts => "facts",
            RecordKind::Decisions => "decisions",
            RecordKind::Checkpoints => "checkpoints",
        }
    }

    /// The `meta` key of `sink`'s cursor over this log.
    pub fn cursor_key(self, sink: &str) -> String {
        format!("sink:{sink}:{}", self.log())
    }
}

/// One record as a sink sends it.
#[derive(Debug, Clone)]
pub struct Record {
    pub kind: RecordKind,
    pub seq: u64,
    /// The OCSF event.
    pub event: Value,
    /// The event as JSON text (what `ocsf.raw`, syslog's MSG and a file
    /// line carry).
    pub json: String,
}

impl Record {
    fn new(kind: RecordKind, seq: u64, event: Value) -> Record {
        let json = event.to_string();
        Record { kind, seq, event, json }
    }

    /// `metadata.uid`: what a receiver drops duplicates by.
    pub fn uid(&self) -> &str {
        self.event
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// `time`, in epoch milliseconds (0 when absent).
    pub fn time_ms(&self) -> u64 {
        self.event.get("time").and_then(Value::as_u64).unwrap_or(0)
    }

    /// `severity_id` (0, Unknown, when absent).
    pub fn severity_id(&self) -> u64 {
        self.event.get("severity_id").and_then(Value::as_u64).unwrap_or(0)
    }
}

/// Where a sink reads the committed records of each kind.
#[derive(Clone)]
pub struct Source {
    pub facts: Arc<dyn FactSink>,
    pub decisions: Arc<DecisionLog>,
    /// The proxy's version, for `metadata.product.version`.
    pub version: &'static str,
    /// `[audit] record_integrity`: events of chained records carry their
    /// OCSF 1.9 attestation.
    pub integrity: Option<Integrity>,
}

/// What the attestation of a sink's events names.
#[derive(Clone, Debug)]
pub struct Integrity {
    /// The cell as chains name it (`-` without `[cell]`).
    pub cell: String,
    /// The name of the checkpoints' signing key, if one signs them.
    pub authority: Option<String>,
}

impl Source {
    /// Up to `limit` records of `kind` after `after`, oldest first, cut
    /// after the one that brings their JSON to `max_bytes` (at least one).
    pub async fn read(
        &self,
        kind: RecordKind,
        after: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Vec<Record>, String> {
        let mut out: Vec<Record> = match kind {
            RecordKind::Facts => self
                .facts
                .query(FactQuery {
                    after,
                    limit,
                    run_id: None,
                })
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|f| Record::new(kind, f.seq, ocsf::fact_event(&f, self.version)))
                .collect(),
            RecordKind::Decisions => self
                .decisions
                .query(DecisionQuery {
                    after,
                    limit,
                    ..DecisionQuery::default()
                })
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|d| Record::new(kind, d.seq, ocsf::decision_event(&d, self.version)))
                .collect(),
            RecordKind::Checkpoints => self
                .facts
                .checkpoints(after, limit)
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|(seq, note)| Record::new(kind, seq, ocsf::checkpoint_event(seq, &note, self.version)))
                .collect(),
        };
        if let Some(integrity) = &self.integrity {
            self.attest(kind, after, integrity, &mut out).await?;
        }
        let mut bytes = 0;
        let mut keep = out.len();
        for (i, r) in out.iter().enumerate() {
            bytes += r.json.len();
            if bytes >= max_bytes {
                keep = i + 1;
                break;
            }
        }
        out.truncate(keep);
        Ok(out)
    }

    /// Adds each record's attestation (its chain value and the previous
    /// one's, read from the store) to its event; checkpoints and records
    /// without a chain value are left as they are.
    async fn attest(
        &self,
        kind: RecordKind,
        after: u64,
        integrity: &Integrity,
        out: &mut [Record],
    ) -> Result<(), String> {
        let chain_kind = match kind {
            RecordKind::Facts => chain::Kind::Facts,
            RecordKind::Decisions => chain::Kind::Decisions,
            RecordKind::Checkpoints => return Ok(()),
        };
        let Some(last) = out.last().map(|r| r.seq) else {
            return Ok(());
        };
        let values: std::collections::HashMap<u64, (String, chain::Head)> = self
            .facts
            .chained(chain_kind, after, last)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(seq, body, head)| (seq, (body, head)))
            .collect();
        let epoch = self.facts.epoch().unwrap_or_default();
        let chain_uid = format!("{}/{}", chain::origin(&integrity.cell, &epoch), kind.log());
        for r in out.iter_mut() {
            let Some((stored, fingerprint)) = values.get(&r.seq) else {
                continue;
            };
            ocsf::attest(
                &mut r.event,
                &ocsf::Attestation {
                    chain_uid: &chain_uid,
                    seq: r.seq,
                    stored,
                    fingerprint,
                    previous: values.get(&r.seq.wrapping_sub(1)).map(|(_, h)| h),
                    authority: integrity.authority.as_deref(),
                },
            );
            r.json = r.event.to_string();
        }
        Ok(())
    }

    /// The newest committed record's `seq` of `kind`.
    pub fn head(&self, kind: RecordKind) -> u64 {
        match kind {
            RecordKind::Facts => self.facts.head(),
            RecordKind::Decisions => self.decisions.head(),
            RecordKind::Checkpoints => self.facts.checkpoint_head(),
        }
    }

    /// The cursor of `sink` over `kind`, as last written.
    pub fn cursor(&self, sink: &str, kind: RecordKind) -> u64 {
        self.facts.cursor(&kind.cursor_key(sink))
    }

    /// Moves the cursor of `sink` over `kind` (through the store's writer).
    pub async fn advance(&self, sink: &str, kind: RecordKind, seq: u64) -> Result<(), String> {
        self.facts
            .set_cursor(&kind.cursor_key(sink), seq)
            .await
            .map_err(|e| e.to_string())
    }
}
