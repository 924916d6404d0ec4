//! The fleet exporter (`[export] sink = "postgres"`): copies the cell's
//! committed denial facts, in `seq` order, into the fleet's PostgreSQL table
//! `egress_facts`, behind the local store and never on a decision path (a
//! denial is committed locally before its 403 whatever PostgreSQL does).
//!
//! Exactly once: the cursor is the table's `max(seq)` for this (cell,
//! epoch), read after every (re)connection, and each batch is one
//! transaction of `INSERT … ON CONFLICT DO NOTHING`, so a crash between the
//! commit and anything local repeats nothing. One session holds an advisory
//! lock on the cell id: a second process with the same id exports nothing
//! and is unready (`cell_id_in_use`). The local `export_cursor` follows the
//! remote one, and retention never deletes a fact above it.

use crate::facts::FactSink;
use crate::metrics::{ExportMetrics, KindLabel};
use egress_config::ExportConfig;
use egress_fleet::pg::{ident, timed, Connector, PgError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio_postgres::Client;

/// Pause between reconnections.
const RETRY: Duration = Duration::from_millis(500);

/// Why the exporter could not go on (the metric label of its failure).
pub type ExportError = PgError;

/// What `/readyz`, `/v1/cell` and the shutdown read of the exporter.
#[derive(Debug, Default)]
pub struct ExportState {
    /// Another session holds the cell id's lock: this process exports nothing.
    pub cell_in_use: AtomicBool,
    /// Every fact up to this `seq` is in PostgreSQL (as last known).
    pub exported: AtomicU64,
    pub max_lag: u64,
    /// Wakes an idle exporter (a stop's flush does not wait for `flush_ms`).
    wake: tokio::sync::Notify,
}

impl ExportState {
    /// Facts committed locally and not yet exported.
    pub fn lag(&self, facts: &dyn FactSink) -> u64 {
        facts.head().saturating_sub(self.exported.load(Ordering::Acquire))
    }
}

/// A started exporter.
pub struct Exporter {
    pub state: Arc<ExportState>,
}

impl Exporter {
    /// Reads the DSN from the environment variable `cfg.dsn_env` and starts
    /// exporting in the background (connection failures are retried; only a
    /// missing or unparsable DSN is an error here).
    pub fn start(
        cfg: &ExportConfig,
        cell: &str,
        facts: Arc<dyn FactSink>,
        metrics: ExportMetrics,
    ) -> Result<Exporter, ExportError> {
        let connector = Connector::from_env(cfg, "loom-egress-export")?;
        let state = Arc::new(ExportState {
            max_lag: cfg.max_lag,
            ..ExportState::default()
        });
        state.exported.store(facts.export_cursor(), Ordering::Release);
        let run = Run {
            connector,
            cfg: cfg.clone(),
            cell: cell.to_owned(),
            facts,
            metrics,
            state: state.clone(),
        };
        tokio::spawn(run.clone().gauge());
        tokio::spawn(run.forever());
        Ok(Exporter { state })
    }

    /// Waits until every fact committed so far is exported, or `budget`
    /// runs out; returns the lag left.
    pub async fn flush(&self, facts: &dyn FactSink, budget: Duration) -> u64 {
        let until = Instant::now() + budget;
        self.state.wake.notify_one();
        loop {
            let lag = self.state.lag(facts);
            if lag == 0 || Instant::now() >= until {
                return lag;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The advisory lock key of a cell id.
const LOCK_KEY: &str = "SELECT pg_try_advisory_lock(hashtextextended('loom-egress-cell:' || $1, 0))";

struct Run {
    connector: Connector,
    cfg: ExportConfig,
    cell: String,
    facts: Arc<dyn FactSink>,
    metrics: ExportMetrics,
    state: Arc<ExportState>,
}

impl Clone for Run {
    fn clone(&self) -> Self {
        Run {
            connector: self.connector.clone(),
            cfg: self.cfg.clone(),
            cell: self.cell.clone(),
            facts: self.facts.clone(),
            metrics: self.metrics.clone(),
            state: self.state.clone(),
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Run {
    /// Keeps the lag gauge current, also while PostgreSQL is away.
    async fn gauge(self) {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let lag = self.state.lag(&*self.facts);
            self.metrics.lag.set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }

    async fn forever(self) {
        loop {
            match self.session().await {
                Ok(()) => {}
                Err(e) => {
                    let kind = e.kind();
                    self.metrics.failures.get_or_create(&KindLabel { kind }).inc();
                    tracing::warn!(error = %e, "fact export interrupted; retrying");
                }
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// One connection: migrate, take the cell's lock, then export until
    /// something fails.
    async fn session(&self) -> Result<(), ExportError> {
        let mut client = self.connector.connect(&self.cfg.schema).await?;
        self.on(&mut client).await
    }

    async fn on(&self, client: &mut Client) -> Result<(), ExportError> {
        loop {
            let held: bool = timed("lock", client.query_one(LOCK_KEY, &[&self.cell])).await?.get(0);
            if held {
                break;
            }
            if !self.state.cell_in_use.swap(true, Ordering::AcqRel) {
                tracing::error!(cell = %self.cell, "another process holds this cell id: exporting nothing until it lets go");
            }
            self.metrics.failures.get_or_create(&KindLabel { kind: "lock" }).inc();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.state.cell_in_use.store(false, Ordering::Release);
        let table = format!("{}.egress_facts", ident(&self.cfg.schema));
        let cursor_sql =
            format!("SELECT COALESCE(max(seq), 0) FROM {table} WHERE cell = $1 AND epoch = $2::text::uuid");
        let insert = timed(
            "migrate",
            client.prepare(&format!(
                "INSERT INTO {table} (cell, epoch, seq, id, at, run_id, tool, reason, mode, policy, body, stored, chain)
                 SELECT $1, $2::text::uuid, u.seq, u.id::uuid, u.at::timestamptz, u.run_id, u.tool, u.reason, u.mode, u.policy, u.body::jsonb, u.stored, u.chain
                 FROM unnest($3::int8[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], $13::bytea[])
                   AS u(seq, id, at, run_id, tool, reason, mode, policy, body, stored, chain)
                 ON CONFLICT DO NOTHING"
            )),
        )
        .await?;
        let checkpoints = format!("{}.egress_checkpoints", ident(&self.cfg.schema));
        let save_checkpoint = timed(
            "migrate",
            client.prepare(&format!(
                "INSERT INTO {checkpoints} (cell, epoch, size, decisions, at, closed, note)
                 VALUES ($1, $2::text::uuid, $3, $4, $5::text::timestamptz, $6, $7) ON CONFLICT DO NOTHING"
            )),
        )
        .await?;
        let mut epoch = String::new();
        let mut cursor = 0u64;
        let mut signed: Option<Arc<str>> = None;
        loop {
            // The newest signed checkpoint, once (after the facts it covers
            // that were exported before it; a later batch is no matter).
            if let Some(note) = self.facts.checkpoint().filter(|n| signed.as_ref() != Some(n)) {
                if let Ok(cp) = crate::facts::chain::read_note(&note) {
                    timed(
                        "write",
                        client.execute(
                            &save_checkpoint,
                            &[
                                &self.cell,
                                &cp.epoch,
                                &(cp.size as i64),
                                &(cp.decisions.0 as i64),
                                &cp.time,
                                &cp.closed,
                                &&*note,
                            ],
                        ),
                    )
                    .await?;
                    self.metrics.checkpoints.inc();
                }
                signed = Some(note);
            }
            let now = self.facts.epoch().unwrap_or_default();
            if now != epoch {
                epoch = now;
                let max: i64 = timed("read", client.query_one(&cursor_sql, &[&self.cell, &epoch]))
                    .await?
                    .get(0);
                cursor = max.max(0) as u64;
                tracing::info!(cell = %self.cell, epoch = %epoch, cursor, "exporting facts after the fleet's cursor");
                self.advance(cursor).await;
            }
            let batch = self
                .facts
                .query_stored(cursor, self.cfg.batch_max)
                .await
                .map_err(|e| ExportError::Failed {
                    kind: "read",
                    message: e.to_string(),
                })?;
            if batch.is_empty() {
                self.metrics.last_success.set(now_secs());
                tokio::select! {
                    _ = tokio::time::sleep(self.cfg.flush) => {}
                    _ = self.state.wake.notified() => {}
                }
                continue;
            }
            let t0 = Instant::now();
            let n = batch.len();
            let full = n >= self.cfg.batch_max;
            let last = batch.last().map_or(cursor, |s| s.fact.seq);
            let mut cols: (Vec<i64>, Vec<String>, Vec<String>) = Default::default();
            let mut opt: (Vec<Option<String>>, Vec<Option<String>>) = Default::default();
            let mut rest: (Vec<String>, Vec<String>, Vec<String>, Vec<String>) = Default::default();
            let mut chained: (Vec<String>, Vec<Option<Vec<u8>>>) = Default::default();
            for stored in batch {
                let f = &stored.fact;
                chained.0.push(stored.body);
                chained.1.push(stored.chain.map(|h| h.to_vec()));
                let body = serde_json::to_string(f).map_err(|e| ExportError::Failed {
                    kind: "read",
                    message: e.to_string(),
                })?;
                cols.0.push(f.seq as i64);
                cols.1.push(f.id.clone());
                cols.2.push(f.at.clone());
                opt.0.push(f.run_id.clone());
                opt.1.push(f.tool.clone());
                rest.0.push(f.reason.clone());
                rest.1.push(f.mode.clone());
                rest.2.push(f.policy.clone());
                rest.3.push(body);
            }
            timed("write", async {
                let tx = client.transaction().await?;
                tx.execute(
                    &insert,
                    &[
                        &self.cell, &epoch, &cols.0, &cols.1, &cols.2, &opt.0, &opt.1, &rest.0, &rest.1, &rest.2,
                        &rest.3, &chained.0, &chained.1,
                    ],
                )
                .await?;
                tx.commit().await
            })
            .await?;
            self.metrics.batch_duration.observe(t0.elapsed().as_secs_f64());
            self.metrics.facts.inc_by(n as u64);
            self.metrics.last_success.set(now_secs());
            cursor = last;
            self.advance(cursor).await;
            if !full {
                tokio::time::sleep(self.cfg.flush.min(Duration::from_millis(20))).await;
            }
        }
    }

    /// Records locally that every fact up to `cursor` is exported.
    async fn advance(&self, cursor: u64) {
        self.state.exported.store(cursor, Ordering::Release);
        if let Err(e) = self.facts.set_export_cursor(cursor).await {
            tracing::warn!(error = %e, "the local export cursor could not be written");
        }
    }
}
