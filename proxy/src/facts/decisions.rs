//! The decision log: one record per allowed fetch or tunnel (run, tool,
//! kind, canonical target, method, status, bytes, duration, policy digest,
//! resolved addresses), kept with `[proxy] decisions = "sampled" | "all"`.
//! It is written off the answer path: the data path offers a record to a
//! bounded queue (`try_send`; a full queue drops it and counts
//! `egress_decisions_dropped_total`), and one writer thread inserts batches.
//! Records live in the fact store's file, in their own table `decisions`,
//! with their own byte budget (the oldest are dropped beyond it, unlike
//! facts) and retention; with an in-memory (or embedder's) fact sink, they
//! are kept in memory under the same budget. Denials stay facts, recorded
//! before they are answered.

use crate::facts::chain::{self, Head, Kind};
use crate::facts::store::links;
use crate::metrics::DecisionMetrics;
use egress_config::Decisions;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{broadcast, mpsc};

/// Records the queue holds before new ones are dropped.
pub const QUEUE: usize = 8192;

/// Records written per transaction at most.
const BATCH: usize = 1024;

/// How long the writer gathers records after the first of a batch.
const GATHER: Duration = Duration::from_millis(10);

/// How often, at most, old records are looked for and the table measured.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
const MEASURE_EVERY: Duration = Duration::from_secs(5);

/// What a record costs besides its JSON body, in the memory backend's and
/// the estimate's accounting (the row's columns and index entries).
const ROW_OVERHEAD: u64 = 64;

/// The longest path a record keeps (without its query, which may carry
/// secrets; paths longer are cut).
pub const MAX_PATH: usize = 256;

/// One allowed fetch or tunnel, as it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Decision {
    /// Position in the log (a cursor, like a fact's `seq`).
    pub seq: u64,
    /// When the fetch ended (RFC 3339, UTC, milliseconds).
    pub at: String,
    pub run_id: String,
    pub tool: String,
    /// `http`, `connect`, `transparent`, or `mcp` (an allowed MCP call:
    /// `host` is the called name, `method` the JSON-RPC method).
    pub kind: String,
    /// The canonical target, `host:port` (`mcp <name>` for an MCP call).
    pub target: String,
    pub host: String,
    pub port: u16,
    /// The method (a tunnel's is `CONNECT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The path without its query (plain HTTP only), at most 256 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The origin's status code, when one was seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// `ok`, `timeout`, `severed` or `error`.
    pub outcome: String,
    /// Report mode let a denial of this fetch through (a fact says which).
    #[serde(default)]
    pub reported: bool,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: u64,
    /// The digest of the policy that allowed it.
    pub policy: String,
    /// What the name resolved to (at most 32 addresses).
    #[serde(default)]
    pub resolved: Vec<String>,
    /// The principal the run is attributed to (absent: the control token's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// What the run's child executes (path → SHA-256), when the executor said.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub executables: std::collections::BTreeMap<String, String>,
}

/// A page of decisions.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DecisionsPage {
    pub decisions: Vec<Decision>,
    /// The cursor for the next call.
    pub next: u64,
}

/// Which records a query wants, oldest first.
#[derive(Debug, Clone, Default)]
pub struct DecisionQuery {
    pub after: u64,
    pub limit: usize,
    pub run_id: Option<String>,
    pub tool: Option<String>,
    /// Only records at or after this RFC 3339 time.
    pub since: Option<String>,
}

impl DecisionQuery {
    fn keeps(&self, d: &Decision) -> bool {
        d.seq > self.after
            && self.run_id.as_deref().is_none_or(|r| r == d.run_id)
            && self.tool.as_deref().is_none_or(|t| t == d.tool)
            && self.since.as_deref().is_none_or(|s| d.at.as_str() >= s)
    }
}

/// Why records cannot be read.
#[derive(Debug, Clone, thiserror::Error)]
#[error("decision log unavailable: {0}")]
pub struct DecisionError(pub String);

/// Where records are kept.
enum Backend {
    Memory(Mutex<Memory>),
    Sqlite {
        path: PathBuf,
        reader: Mutex<Option<Connection>>,
    },
}

#[derive(Default)]
struct Memory {
    next: u64,
    bytes: u64,
    records: VecDeque<(Decision, u64)>,
}

/// How much the log may hold and for how long.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_bytes: u64,
    pub retention: Duration,
    /// Retention by age deletes no record above this (the lowest of the
    /// audit sinks' cursors). The byte budget still drops the oldest.
    pub floor: Floor,
    /// `[cell] id` (the chain's genesis names it).
    pub cell: Option<String>,
}

/// The lowest decision cursor of the audit sinks, read when pruning
/// (`u64::MAX` without sinks).
#[derive(Clone)]
pub struct Floor(pub Arc<dyn Fn() -> u64 + Send + Sync>);

impl Default for Floor {
    fn default() -> Self {
        Floor(Arc::new(|| u64::MAX))
    }
}

impl std::fmt::Debug for Floor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Floor({})", (self.0)())
    }
}

/// The decision log of one proxy.
pub struct DecisionLog {
    /// Record one in `every` allowed fetch (0: none).
    every: u64,
    tick: AtomicU64,
    /// The writer's queue; taken by [`DecisionLog::close`]. Loaded without
    /// a lock by every fetch that offers a record.
    tx: arc_swap::ArcSwapOption<mpsc::Sender<Decision>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    backend: Arc<Backend>,
    live: broadcast::Sender<Decision>,
    metrics: DecisionMetrics,
    /// Bytes the log's table holds in the fact store's file (the fact
    /// store's budget leaves them out).
    bytes: Arc<AtomicU64>,
    /// The newest record's seq (0: none).
    head: Arc<AtomicU64>,
}

impl Drop for DecisionLog {
    /// Lets the writer finish the records queued so far.
    fn drop(&mut self) {
        self.close();
    }
}

impl DecisionLog {
    /// A log kept in the SQLite file `path` (the fact store's) when given,
    /// else in memory. `bytes` is where the table's size is published.
    pub fn open(
        mode: Decisions,
        path: Option<&Path>,
        limits: Limits,
        metrics: DecisionMetrics,
        bytes: Arc<AtomicU64>,
    ) -> DecisionLog {
        let every = match mode {
            Decisions::Off => 0,
            Decisions::Sampled(n) => u64::from(n.max(1)),
            Decisions::All => 1,
        };
        let backend = Arc::new(match path {
            Some(p) => Backend::Sqlite {
                path: p.to_owned(),
                reader: Mutex::new(None),
            },
            None => Backend::Memory(Mutex::new(Memory::default())),
        });
        metrics.budget.set(limits.max_bytes as i64);
        let head = Arc::new(AtomicU64::new(path.map_or(0, newest)));
        let (live, _) = broadcast::channel(4096);
        let mut log = DecisionLog {
            every,
            tick: AtomicU64::new(0),
            tx: arc_swap::ArcSwapOption::empty(),
            writer: Mutex::new(None),
            backend: backend.clone(),
            live: live.clone(),
            metrics: metrics.clone(),
            bytes: bytes.clone(),
            head: head.clone(),
        };
        if every == 0 {
            return log;
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = Writer {
            backend,
            conn: None,
            limits,
            live,
            metrics,
            bytes,
            head,
            pruned_at: None,
            measured_at: None,
            chain: [0; 32],
        };
        match std::thread::Builder::new()
            .name("egress-decisions".into())
            .spawn(move || writer.run(rx))
        {
            Ok(h) => {
                log.tx = arc_swap::ArcSwapOption::from_pointee(tx);
                log.writer = Mutex::new(Some(h));
            }
            Err(e) => tracing::error!(error = %e, "cannot start the decision log's writer; decisions are not recorded"),
        }
        log
    }

    /// A log that records nothing and holds nothing.
    pub fn off() -> DecisionLog {
        DecisionLog::open(
            Decisions::Off,
            None,
            Limits {
                max_bytes: 1,
                retention: Duration::from_secs(3600),
                floor: Floor::default(),
                cell: None,
            },
            DecisionMetrics::default(),
            Arc::default(),
        )
    }

    /// Whether the fetch starting now is to be recorded (one in `every`).
    pub fn sample(&self) -> bool {
        match self.every {
            0 => false,
            1 => true,
            n => self.tick.fetch_add(1, Ordering::Relaxed).is_multiple_of(n),
        }
    }

    /// Hands a record to the writer without waiting: a full queue drops it.
    pub fn offer(&self, d: Decision) {
        let Some(tx) = &*self.tx.load() else { return };
        if tx.try_send(d).is_err() {
            self.metrics.dropped.inc();
        }
    }

    /// Stops taking records; the writer writes what is queued and ends.
    pub fn close(&self) {
        self.tx.store(None);
        let writer = self.writer.lock().ok().and_then(|mut w| w.take());
        if let Some(w) = writer {
            let _ = w.join();
        }
    }

    /// Live feed of written records.
    pub fn subscribe(&self) -> broadcast::Receiver<Decision> {
        self.live.subscribe()
    }

    /// The newest record's seq (0: none yet).
    pub fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Bytes the log holds.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    /// Records matching `q`, oldest first.
    pub async fn query(&self, q: DecisionQuery) -> Result<Vec<Decision>, DecisionError> {
        let backend = self.backend.clone();
        tokio::task::spawn_blocking(move || read(&backend, &q))
            .await
            .map_err(|e| DecisionError(e.to_string()))?
    }
}

fn read(backend: &Backend, q: &DecisionQuery) -> Result<Vec<Decision>, DecisionError> {
    match backend {
        Backend::Memory(m) => {
            let m = m.lock().map_err(|_| DecisionError("poisoned".into()))?;
            Ok(m.records
                .iter()
                .map(|(d, _)| d)
                .filter(|d| q.keeps(d))
                .take(q.limit)
                .cloned()
                .collect())
        }
        Backend::Sqlite { path, reader } => {
            let mut guard = reader.lock().map_err(|_| DecisionError("poisoned".into()))?;
            if guard.is_none() {
                *guard = Some(open(path, false).map_err(|e| DecisionError(e.to_string()))?);
            }
            let c = guard.as_ref().ok_or_else(|| DecisionError("no reader".into()))?;
            let r = query_sqlite(c, q);
            if r.is_err() {
                *guard = None;
            }
            r.map_err(|e| DecisionError(e.to_string()))
        }
    }
}

/// Reads records from an open store (the proxy's reader, or the `policy`
/// commands reading the file of a proxy).
pub fn query_sqlite(c: &Connection, q: &DecisionQuery) -> rusqlite::Result<Vec<Decision>> {
    // A store that never had the log on has no table: no records.
    let table: i64 = c.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'decisions'",
        [],
        |r| r.get(0),
    )?;
    if table == 0 {
        return Ok(vec![]);
    }
    let mut sql = String::from("SELECT seq, body FROM decisions WHERE seq > ?1");
    if q.run_id.is_some() {
        sql.push_str(" AND run_id = ?2");
    }
    if q.tool.is_some() {
        sql.push_str(" AND tool = ?3");
    }
    if q.since.is_some() {
        sql.push_str(" AND at >= ?4");
    }
    sql.push_str(" ORDER BY seq LIMIT ?5");
    let mut s = c.prepare_cached(&sql)?;
    let mut binds: Vec<(usize, &dyn rusqlite::ToSql)> = vec![];
    let after = q.after.min(i64::MAX as u64) as i64;
    let limit = q.limit.min(100_000) as i64;
    binds.push((1, &after));
    if let Some(r) = &q.run_id {
        binds.push((2, r));
    }
    if let Some(t) = &q.tool {
        binds.push((3, t));
    }
    if let Some(since) = &q.since {
        binds.push((4, since));
    }
    binds.push((5, &limit));
    for (i, v) in binds {
        s.raw_bind_parameter(i, v)?;
    }
    let mut rows = s.raw_query();
    let mut out = vec![];
    while let Some(row) = rows.next()? {
        let (seq, body): (i64, String) = (row.get(0)?, row.get(1)?);
        match serde_json::from_str::<Decision>(&body) {
            Ok(d) => out.push(Decision { seq: seq as u64, ..d }),
            Err(e) => tracing::warn!(error = %e, "skipping an unreadable decision record"),
        }
    }
    Ok(out)
}

/// Opens the store's file for the log (creating the table), or read-only.
pub fn open(path: &Path, write: bool) -> rusqlite::Result<Connection> {
    let flags = if write {
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX
    } else {
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX
    };
    let c = Connection::open_with_flags(path, flags)?;
    c.busy_timeout(Duration::from_secs(5))?;
    if write {
        c.pragma_update(None, "journal_mode", "WAL")?;
        // A record lost to a power cut is a sample lost, not a denial: the
        // log does not sync every commit (the facts' commits sync the WAL).
        c.pragma_update(None, "synchronous", "NORMAL")?;
        create(&c)?;
    }
    Ok(c)
}

fn create(c: &Connection) -> rusqlite::Result<()> {
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS decisions (
            seq    INTEGER PRIMARY KEY AUTOINCREMENT,
            at     TEXT NOT NULL,
            run_id TEXT NOT NULL,
            tool   TEXT NOT NULL,
            body   TEXT NOT NULL,
            chain  BLOB
         );
         CREATE INDEX IF NOT EXISTS decisions_by_run ON decisions (run_id, seq);
         CREATE INDEX IF NOT EXISTS decisions_by_tool ON decisions (tool, seq);",
    )?;
    // A table made before the hash chain gets its column; the anchor and
    // checkpoint tables exist once the fact store has opened the file.
    links::ensure_column(c, "decisions")?;
    links::create(c)
}

/// Bytes of the pages that hold the log's table and indexes.
fn table_bytes(c: &Connection) -> rusqlite::Result<u64> {
    c.query_row(
        "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat
         WHERE name IN ('decisions', 'decisions_by_run', 'decisions_by_tool')",
        [],
        |r| r.get::<_, i64>(0),
    )
    .map(|b| b.max(0) as u64)
}

/// The newest record's seq in the store file `path` (0: none, or unreadable).
fn newest(path: &Path) -> u64 {
    let Ok(c) = open(path, false) else { return 0 };
    c.query_row("SELECT COALESCE(MAX(seq), 0) FROM decisions", [], |r| {
        r.get::<_, i64>(0)
    })
    .map_or(0, |v| v.max(0) as u64)
}

struct Writer {
    backend: Arc<Backend>,
    conn: Option<Connection>,
    limits: Limits,
    live: broadcast::Sender<Decision>,
    metrics: DecisionMetrics,
    bytes: Arc<AtomicU64>,
    head: Arc<AtomicU64>,
    pruned_at: Option<Instant>,
    measured_at: Option<Instant>,
    /// The chain at the newest written record (read when connecting).
    chain: Head,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Decision>) {
        let mut batch = Vec::with_capacity(BATCH);
        if matches!(*self.backend, Backend::Sqlite { .. }) {
            self.connect();
            self.maintain(true);
        }
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            // Gather what comes meanwhile: one transaction per GATHER of
            // records, not one per record when fetches come one by one.
            std::thread::sleep(GATHER);
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(d) => batch.push(d),
                    Err(_) => break,
                }
            }
            self.write(&mut batch);
        }
    }

    fn connect(&mut self) -> Option<&Connection> {
        if self.conn.is_none() {
            if let Backend::Sqlite { path, .. } = &*self.backend {
                let cell = links::cell_name(self.limits.cell.as_deref());
                let opened = open(path, true).and_then(|c| {
                    let epoch = links::epoch(&c)?;
                    let (_, head) = links::resume(&c, Kind::Decisions, cell, &epoch, true)?;
                    Ok((c, head))
                });
                match opened {
                    Ok((c, head)) => (self.conn, self.chain) = (Some(c), head),
                    Err(e) => tracing::warn!(error = %e, "the decision log cannot open the store"),
                }
            }
        }
        self.conn.as_ref()
    }

    fn write(&mut self, batch: &mut Vec<Decision>) {
        let n = batch.len() as u64;
        let backend = self.backend.clone();
        let written = match &*backend {
            Backend::Memory(m) => match m.lock() {
                Ok(mut m) => {
                    for mut d in batch.drain(..) {
                        m.next += 1;
                        d.seq = m.next;
                        let size = serde_json::to_string(&d).map_or(0, |s| s.len() as u64) + ROW_OVERHEAD;
                        m.bytes += size;
                        self.head.fetch_max(d.seq, Ordering::AcqRel);
                        let _ = self.live.send(d.clone());
                        m.records.push_back((d, size));
                    }
                    let mut dropped = 0;
                    while m.bytes > self.limits.max_bytes {
                        let Some((_, size)) = m.records.pop_front() else { break };
                        m.bytes -= size;
                        dropped += 1;
                    }
                    let cutoff = cutoff(self.limits.retention);
                    let floor = (self.limits.floor.0)();
                    while m.records.front().is_some_and(|(d, _)| d.at < cutoff && d.seq <= floor) {
                        if let Some((_, size)) = m.records.pop_front() {
                            m.bytes -= size;
                            dropped += 1;
                        }
                    }
                    self.metrics.pruned.inc_by(dropped);
                    self.bytes.store(m.bytes, Ordering::Release);
                    self.metrics.bytes.set(m.bytes as i64);
                    Ok(())
                }
                Err(_) => Err("poisoned".to_owned()),
            },
            Backend::Sqlite { .. } => self.insert(batch).map_err(|e| e.to_string()),
        };
        batch.clear();
        match written {
            Ok(()) => {
                self.metrics.recorded.inc_by(n);
            }
            Err(e) => {
                self.conn = None;
                self.metrics.dropped.inc_by(n);
                tracing::warn!(error = %e, records = n, "decision records could not be written; dropped");
            }
        }
        self.maintain(false);
    }

    fn insert(&mut self, batch: &mut [Decision]) -> rusqlite::Result<()> {
        let live = self.live.clone();
        self.connect();
        let Some(c) = self.conn.as_ref() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        // IMMEDIATE: the transaction reads (the next seq) before it writes;
        // a deferred one that another connection's commit (the fact
        // writer's) overtook between the two fails at once with "database
        // is locked" instead of waiting, and the batch was dropped.
        let tx = rusqlite::Transaction::new_unchecked(c, rusqlite::TransactionBehavior::Immediate)?;
        let mut added = 0;
        let mut head = self.chain;
        {
            // The body is written with seq 0: the row's seq is read with it.
            // Seqs follow the table's AUTOINCREMENT counter (never reused),
            // known before the insert so that the chain is written with it.
            let mut seq: i64 = tx
                .prepare_cached("SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'decisions'), 0)")?
                .query_row([], |r| r.get(0))?;
            let mut ins = tx.prepare_cached(
                "INSERT INTO decisions (seq, at, run_id, tool, body, chain) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for d in batch.iter_mut() {
                let json =
                    serde_json::to_string(d).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                added += json.len() as u64 + ROW_OVERHEAD;
                seq += 1;
                d.seq = seq as u64;
                head = chain::link(Kind::Decisions, &head, d.seq, json.as_bytes());
                ins.execute(params![seq, d.at, d.run_id, d.tool, json, &head[..]])?;
            }
        }
        tx.commit()?;
        self.chain = head;
        for d in batch.iter() {
            let _ = live.send(d.clone());
        }
        if let Some(last) = batch.last() {
            self.head.fetch_max(last.seq, Ordering::AcqRel);
        }
        let b = self.bytes.fetch_add(added, Ordering::AcqRel) + added;
        self.metrics.bytes.set(b as i64);
        Ok(())
    }

    /// SQLite: deletes records past the retention age (at most once a
    /// minute), then the oldest while over the budget; measures the table.
    fn maintain(&mut self, now: bool) {
        let Backend::Sqlite { .. } = &*self.backend else { return };
        let prune = now || self.pruned_at.is_none_or(|t| t.elapsed() >= PRUNE_EVERY);
        let over = self.bytes.load(Ordering::Acquire) > self.limits.max_bytes;
        let measure = now || over || self.measured_at.is_none_or(|t| t.elapsed() >= MEASURE_EVERY);
        if !(prune || over || measure) {
            return;
        }
        let (retention, max) = (self.limits.retention, self.limits.max_bytes);
        let floor = (self.limits.floor.0)().min(i64::MAX as u64) as i64;
        let Some(c) = self.connect() else { return };
        let mut deleted = 0;
        if prune {
            match prune_before(c, &cutoff(retention), floor) {
                Ok(n) => deleted += n,
                Err(e) => tracing::warn!(error = %e, "pruning old decision records failed"),
            }
        }
        let mut used = table_bytes(c).unwrap_or(0);
        if used > max {
            match drop_oldest(c, used - max + max / 10) {
                Ok(n) => deleted += n,
                Err(e) => tracing::warn!(error = %e, "dropping the oldest decision records failed"),
            }
            used = table_bytes(c).unwrap_or(used);
        }
        if prune {
            self.pruned_at = Some(Instant::now());
        }
        self.measured_at = Some(Instant::now());
        self.metrics.pruned.inc_by(deleted);
        self.bytes.store(used, Ordering::Release);
        self.metrics.bytes.set(used as i64);
    }
}

/// Deletes the oldest records whose bodies add up to about `bytes`.
fn drop_oldest(c: &Connection, bytes: u64) -> rusqlite::Result<u64> {
    let upto = {
        let mut s = c.prepare_cached("SELECT seq, length(body) FROM decisions ORDER BY seq")?;
        let mut rows = s.query([])?;
        let (mut freed, mut upto) = (0u64, None);
        while let Some(r) = rows.next()? {
            let (seq, len): (i64, i64) = (r.get(0)?, r.get(1)?);
            freed += len.max(0) as u64 + ROW_OVERHEAD;
            upto = Some(seq);
            if freed >= bytes {
                break;
            }
        }
        upto
    };
    match upto {
        Some(seq) => delete_upto(c, seq),
        None => Ok(0),
    }
}

/// Deletes the records older than `cutoff` (RFC 3339) that come before
/// the first younger one: a prefix, as the chain's anchor needs.
fn prune_before(c: &Connection, cutoff: &str, floor: i64) -> rusqlite::Result<u64> {
    let first_young: Option<i64> = c
        .prepare_cached("SELECT seq FROM decisions WHERE at >= ?1 ORDER BY seq LIMIT 1")?
        .query_row(params![cutoff], |r| r.get(0))
        .optional()?;
    let upto: Option<i64> = match first_young {
        Some(s) => Some(s - 1),
        None => c.query_row("SELECT MAX(seq) FROM decisions", [], |r| r.get(0))?,
    };
    // Never a record an audit sink has not exported (above `floor`).
    match upto.map(|u| u.min(floor)) {
        Some(seq) if seq > 0 => delete_upto(c, seq),
        _ => Ok(0),
    }
}

/// Deletes the records up to `seq`, moving the chain's anchor to it in the
/// same transaction.
fn delete_upto(c: &Connection, seq: i64) -> rusqlite::Result<u64> {
    let tx = c.unchecked_transaction()?;
    let newest: Option<i64> = tx.query_row("SELECT MAX(seq) FROM decisions WHERE seq <= ?1", params![seq], |r| {
        r.get(0)
    })?;
    let Some(newest) = newest else { return Ok(0) };
    links::anchor_pruned(&tx, Kind::Decisions, newest as u64)?;
    let n = tx.execute("DELETE FROM decisions WHERE seq <= ?1", params![newest])?;
    tx.commit()?;
    Ok(n as u64)
}

fn cutoff(retention: Duration) -> String {
    crate::time::rfc3339(
        SystemTime::now()
            .checked_sub(retention)
            .unwrap_or(SystemTime::UNIX_EPOCH),
    )
}

/// A path as a record keeps it: no query, at most [`MAX_PATH`] bytes.
pub fn record_path(pq: &str) -> String {
    let path = pq.split_once('?').map_or(pq, |(p, _)| p);
    if path.len() <= MAX_PATH {
        return path.to_owned();
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    path[..end].to_owned()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn record(tool: &str, host: &str, at: &str) -> Decision {
        Decision {
            principal: None,
            executables: Default::default(),
            seq: 0,
            at: at.into(),
            run_id: "r".into(),
            tool: tool.into(),
            kind: "connect".into(),
            target: format!("{host}:443"),
            host: host.into(),
            port: 443,
            method: Some("CONNECT".into()),
            path: None,
            status: None,
            outcome: "ok".into(),
            reported: false,
            bytes_up: 10,
            bytes_down: 20,
            duration_ms: 1,
            policy: "sha256:x".into(),
            resolved: vec!["192.0.2.1".into()],
        }
    }

    fn now() -> String {
        crate::time::rfc3339(SystemTime::now())
    }

    fn log(path: Option<&Path>, max_bytes: u64) -> DecisionLog {
        DecisionLog::open(
            Decisions::All,
            path,
            Limits {
                max_bytes,
                retention: Duration::from_secs(3600),
                floor: Floor::default(),
                cell: None,
            },
            DecisionMetrics::default(),
            Arc::default(),
        )
    }

    async fn all(l: &DecisionLog) -> Vec<Decision> {
        l.query(DecisionQuery {
            limit: 1_000_000,
            ..DecisionQuery::default()
        })
        .await
        .unwrap()
    }

    #[test]
    fn sampling_takes_one_in_n() {
        let l = DecisionLog::open(
            Decisions::Sampled(4),
            None,
            Limits {
                max_bytes: 1 << 20,
                retention: Duration::from_secs(60),
                floor: Floor::default(),
                cell: None,
            },
            DecisionMetrics::default(),
            Arc::default(),
        );
        assert_eq!((0..100).filter(|_| l.sample()).count(), 25);
        assert!(!DecisionLog::off().sample());
    }

    #[test]
    fn a_path_is_kept_without_its_query_and_bounded() {
        assert_eq!(record_path("/a/b?token=secret"), "/a/b");
        assert_eq!(record_path(&"é".repeat(200)).len(), 256);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_are_kept_in_sqlite_filtered_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let l = log(Some(&path), 1 << 30);
        for (tool, host) in [("a", "x.example"), ("b", "y.example"), ("a", "z.example")] {
            l.offer(record(tool, host, &now()));
        }
        l.close();
        let got = all(&l).await;
        assert_eq!(got.iter().map(|d| d.seq).collect::<Vec<_>>(), [1, 2, 3]);
        let q = DecisionQuery {
            limit: 10,
            tool: Some("a".into()),
            ..DecisionQuery::default()
        };
        let hosts: Vec<String> = l.query(q).await.unwrap().into_iter().map(|d| d.host).collect();
        assert_eq!(hosts, ["x.example", "z.example"]);
        drop(l);
        let l = log(Some(&path), 1 << 30);
        l.offer(record("a", "w.example", &now()));
        l.close();
        assert_eq!(all(&l).await.last().unwrap().seq, 4, "seq continues after a reopen");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_its_budget_the_log_drops_its_oldest_records() {
        for sqlite in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.db");
            let budget = 256 * 1024;
            let l = log(sqlite.then_some(path.as_path()), budget);
            for i in 0..6000 {
                l.offer(record("a", &format!("h{i}.example"), &now()));
                if i % 1000 == 999 {
                    // Let the writer keep up: this test is not about the queue.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            l.close();
            let got = all(&l).await;
            assert!(got.len() < 6000, "nothing was dropped (sqlite {sqlite})");
            assert!(got.len() > 100, "too much was dropped: {} left", got.len());
            assert_eq!(got.last().unwrap().host, "h5999.example", "the newest is kept");
            assert!(l.bytes() <= budget, "{} bytes held, budget {budget}", l.bytes());
            let seqs: Vec<u64> = got.iter().map(|d| d.seq).collect();
            assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "the oldest went first");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_older_than_the_retention_are_deleted() {
        for sqlite in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.db");
            let l = log(sqlite.then_some(path.as_path()), 1 << 30);
            l.offer(record("a", "old.example", "2001-01-01T00:00:00.000Z"));
            l.offer(record("a", "young.example", &now()));
            l.close();
            let hosts: Vec<String> = all(&l).await.into_iter().map(|d| d.host).collect();
            if sqlite {
                // Pruned when the store is next opened (and once a minute).
                drop(l);
                let l = log(Some(&path), 1 << 30);
                l.close();
                let hosts: Vec<String> = all(&l).await.into_iter().map(|d| d.host).collect();
                assert_eq!(hosts, ["young.example"]);
            } else {
                assert_eq!(hosts, ["young.example"]);
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retention_by_age_keeps_records_an_audit_sink_has_not_exported() {
        for sqlite in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.db");
            let open = |floor: u64| {
                DecisionLog::open(
                    Decisions::All,
                    sqlite.then_some(path.as_path()),
                    Limits {
                        max_bytes: 1 << 30,
                        retention: Duration::from_secs(3600),
                        floor: Floor(Arc::new(move || floor)),
                        cell: None,
                    },
                    DecisionMetrics::default(),
                    Arc::default(),
                )
            };
            let l = open(1);
            for h in ["old1.example", "old2.example", "old3.example"] {
                l.offer(record("a", h, "2001-01-01T00:00:00.000Z"));
            }
            l.offer(record("a", "young.example", &now()));
            l.close();
            assert_eq!(l.head(), 4);
            let l = if sqlite {
                drop(l);
                let l = open(1);
                l.close();
                l
            } else {
                l
            };
            let hosts: Vec<String> = all(&l).await.into_iter().map(|d| d.host).collect();
            assert_eq!(
                hosts,
                ["old2.example", "old3.example", "young.example"],
                "sqlite {sqlite}: only old1 was exported by every sink"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let metrics = DecisionMetrics::default();
        let l = DecisionLog::open(
            Decisions::All,
            None,
            Limits {
                max_bytes: 1 << 30,
                retention: Duration::from_secs(3600),
                floor: Floor::default(),
                cell: None,
            },
            metrics.clone(),
            Arc::default(),
        );
        // Hold the memory store's lock so the writer stalls on its first batch.
        let Backend::Memory(m) = &*l.backend else {
            unreachable!()
        };
        let held = m.lock().unwrap();
        let t0 = Instant::now();
        for i in 0..(QUEUE + BATCH + 100) {
            l.offer(record("a", &format!("h{i}"), &now()));
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "offer waited");
        drop(held);
        l.close();
        assert!(metrics.dropped.get() >= 100, "dropped {}", metrics.dropped.get());
        assert_eq!(
            metrics.dropped.get() + metrics.recorded.get(),
            (QUEUE + BATCH + 100) as u64
        );
    }
}
