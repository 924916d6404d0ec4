//! The embedded durable store of facts and of live runs' records (so runs
//! survive a restart; a record holds the SHA-256 of the run's secret, never
//! the secret). Facts: SQLite in WAL mode with
//! `synchronous = FULL`, so a fact is on disk when its commit returns. One
//! writer thread does group commit: it takes every pending denial (bounded
//! queue), folds identical ones of the batch into one fact with a `count`,
//! writes them in one transaction, and only then answers the waiting
//! requests. A flood therefore costs one commit per batch, however large,
//! and other runs' denials wait at most about two commits behind it. If the
//! store cannot be written the batch fails, `ready()` turns false and the
//! requests fail closed; the writer reopens the database on the next batch.
//!
//! A run's facts are found through `run_facts` (run, seq), which the writer
//! keeps up to date behind the facts, not in their commit: every fact of
//! one run shares that table's pages, so indexing each commit's facts at
//! once wrote one page per run the batch touched (in a flood from 32 runs,
//! 10 of the 16 pages a commit wrote). The writer indexes what it committed
//! after a commit once [`INDEX_EVERY`] has passed since it last did (or
//! [`INDEX_TAIL`] facts wait), and when the store closes, in one
//! transaction with the watermark `run_facts_upto` (every fact up to it is
//! indexed); a query by run reads the index up to the watermark and scans
//! the facts after it, in one statement, so it sees every committed fact.
//! A crash between the two loses nothing: the writer indexes the facts
//! above the watermark when it opens the store.
//!
//! The store has a size budget. Facts older than the retention age are
//! deleted, oldest first (at start, then at most once a minute while
//! denials are written). Younger facts are never deleted: when they alone
//! fill the budget, new denials fail closed until space is made (a larger
//! budget, a shorter retention), and `egress_facts_store_bytes` says so.

use crate::facts::{Fact, FactError, FactQuery, FactSink, Recorded};
use crate::metrics::StoreMetrics;
use crate::runs::{RunRecord, RunWrite};
use futures_util::future::BoxFuture;
use rusqlite::{params, Connection, OpenFlags};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{broadcast, mpsc, oneshot};

/// Pending denials the writer may hold at once (senders wait beyond it).
pub const QUEUE: usize = 4096;

/// How long committed facts may wait to be indexed by run (see the module
/// docs); queries scan them meanwhile.
const INDEX_EVERY: Duration = Duration::from_millis(100);

/// Facts waiting to be indexed by run beyond which they are indexed at once.
const INDEX_TAIL: usize = 4096;

/// The `meta` key of the indexing watermark.
const INDEXED_UPTO: &str = "run_facts_upto";

/// How often, at most, old facts are looked for while denials are written.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Facts deleted per statement when pruning (keeps each transaction short).
const PRUNE_CHUNK: i64 = 5000;

/// The store's schema version (`PRAGMA user_version`): 0 before epochs, 2
/// with `store_info` (the epoch) and the export cursor, 3 with `bound` in
/// every run record.
pub const STORE_VERSION: i64 = 3;

/// The `meta` key of the export cursor: every fact up to it is in the
/// fleet store.
const EXPORT_CURSOR: &str = "export_cursor";

/// How much a store may hold and for how long, and whose it is.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Bytes of the database holding facts.
    pub max_bytes: u64,
    /// Facts older than this may be deleted.
    pub retention: Duration,
    /// `[cell] id`, stamped on every fact.
    pub cell: Option<String>,
    /// Facts are exported: retention never deletes one above the export
    /// cursor (unexported facts count against the budget, which fails
    /// closed as with young facts).
    pub exported: bool,
    /// Bytes of the file that another budget counts (the decision log's
    /// table): left out of this one.
    pub others: Arc<AtomicU64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 1024 * 1024 * 1024,
            retention: Duration::from_secs(30 * 24 * 3600),
            cell: None,
            exported: false,
            others: Arc::default(),
        }
    }
}

/// Bytes of the database that hold data (freed pages are reused first).
fn used_bytes(c: &Connection) -> rusqlite::Result<u64> {
    let pages: i64 = c.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    let free: i64 = c.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
    let size: i64 = c.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(((pages - free).max(0) * size) as u64)
}

/// Deletes facts recorded before `cutoff` (an RFC 3339 time in the facts'
/// own format, so strings compare as times) and at most `upto` (the export
/// cursor when facts are exported), oldest first; returns how many.
/// The newest fact is always kept: `seq` continues from it after a restart.
fn prune_before(c: &Connection, cutoff: &str, upto: i64) -> rusqlite::Result<u64> {
    const CHUNK: &str = "SELECT seq FROM (SELECT seq, body FROM facts WHERE seq <= ?3 ORDER BY seq LIMIT ?1)
                 WHERE json_extract(body, '$.at') < ?2 AND seq < (SELECT MAX(seq) FROM facts)";
    let mut total = 0u64;
    loop {
        let tx = c.unchecked_transaction()?;
        tx.execute(
            &format!(
                "DELETE FROM run_facts WHERE (run_id, seq) IN (SELECT run_id, seq FROM facts WHERE seq IN ({CHUNK}))"
            ),
            params![PRUNE_CHUNK, cutoff, upto],
        )?;
        let n = tx.execute(
            &format!("DELETE FROM facts WHERE seq IN ({CHUNK})"),
            params![PRUNE_CHUNK, cutoff, upto],
        )?;
        tx.commit()?;
        total += n as u64;
        if (n as i64) < PRUNE_CHUNK {
            return Ok(total);
        }
    }
}

/// What the writer thread is asked to do.
enum Pending {
    Fact {
        fact: Fact,
        reply: oneshot::Sender<Result<Recorded, FactError>>,
    },
    Run {
        write: RunWrite,
        reply: oneshot::Sender<Result<RunWritten, FactError>>,
    },
    /// A run record write nobody waits for (`save_run_soon`): held until
    /// a waited-for run write or a `Flush` commits it.
    RunSoon(RunWrite),
    /// Commits the held run record writes.
    Flush,
    /// Moves the export cursor (never back).
    Cursor {
        seq: u64,
        reply: oneshot::Sender<Result<(), FactError>>,
    },
}

fn writer_stopped() -> FactError {
    FactError::Unavailable("fact store writer stopped".into())
}

/// Where a waited-for run record write is answered.
type RunReply = oneshot::Sender<Result<RunWritten, FactError>>;

/// Run record writes held for company at most; more are committed at once.
const MAX_HELD: usize = 256;

/// A run record written: for a deletion, whether the run may have facts.
#[derive(Clone, Copy)]
struct RunWritten {
    may_have_facts: bool,
}

/// What the store knows about itself, shared by its handle and its writer.
#[derive(Default)]
struct Identity {
    /// The store file's epoch (a new one if the file is replaced and reopened).
    epoch: Mutex<String>,
    /// The newest committed fact's seq.
    head: AtomicU64,
    /// The export cursor as last written.
    cursor: AtomicU64,
}

impl Identity {
    fn epoch(&self) -> String {
        self.epoch.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Reads the epoch, head and cursor of a freshly opened store.
    fn load(&self, c: &Connection) -> rusqlite::Result<()> {
        let epoch: String = c.query_row("SELECT value FROM store_info WHERE key = 'epoch'", [], |r| r.get(0))?;
        let head = next_seq(c)? - 1;
        let cursor: i64 = c.query_row(
            "SELECT COALESCE((SELECT value FROM meta WHERE key = ?1), 0)",
            params![EXPORT_CURSOR],
            |r| r.get(0),
        )?;
        if let Ok(mut e) = self.epoch.lock() {
            *e = epoch;
        }
        self.head.store(head, Ordering::Release);
        self.cursor.store(cursor.max(0) as u64, Ordering::Release);
        Ok(())
    }
}

/// The SQLite fact store.
pub struct SqliteStore {
    tx: mpsc::Sender<Pending>,
    /// The writer thread: it ends once `tx` is gone, after indexing what
    /// it committed and closing the database.
    writer: Option<std::thread::JoinHandle<()>>,
    reader: Arc<Mutex<Option<Connection>>>,
    path: PathBuf,
    ready: Arc<AtomicBool>,
    live: broadcast::Sender<Fact>,
    identity: Arc<Identity>,
    cell: Option<String>,
}

fn open(path: &Path) -> rusqlite::Result<Connection> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            let _ = crate::facts::private::dir(dir, 0o700);
        }
    }
    if let Err(e) = crate::facts::private::files(path) {
        tracing::error!(path = %path.display(), error = %e, "cannot make the fact store's files private");
    }
    let c = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    c.pragma_update(None, "journal_mode", "WAL")?;
    c.pragma_update(None, "synchronous", "FULL")?;
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS facts (
            seq    INTEGER PRIMARY KEY,
            id     TEXT NOT NULL UNIQUE,
            run_id TEXT,
            body   TEXT NOT NULL
         );
         CREATE TABLE IF NOT EXISTS run_facts (
            run_id TEXT NOT NULL,
            seq    INTEGER NOT NULL,
            PRIMARY KEY (run_id, seq)
         ) WITHOUT ROWID;
         CREATE TABLE IF NOT EXISTS meta (
            key   TEXT PRIMARY KEY,
            value INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS runs (
            id   TEXT PRIMARY KEY,
            body TEXT NOT NULL
         );",
    )?;
    // Fail now, not on the first denial, if the file is not a usable database.
    c.query_row("SELECT count(*) FROM facts", [], |r| r.get::<_, i64>(0))?;
    migrate(&c)?;
    Ok(c)
}

/// Brings a store of an earlier schema to [`STORE_VERSION`], in one
/// transaction: a store made before epochs (version 0) gets one, drawn now,
/// as a new file does (its facts keep their bodies; they are read with the
/// store's epoch); a store made before run records said whether the run is
/// bound to its handed-over listener (below 3) gets that in every record
/// ([`bound_before_the_field`]).
fn migrate(c: &Connection) -> rusqlite::Result<()> {
    let version: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version >= STORE_VERSION {
        return Ok(());
    }
    let tx = c.unchecked_transaction()?;
    tx.execute_batch("CREATE TABLE IF NOT EXISTS store_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);")?;
    tx.execute(
        "INSERT OR IGNORE INTO store_info (key, value) VALUES ('epoch', ?1)",
        params![uuid::Uuid::new_v4().to_string()],
    )?;
    let bound = mark_bound(&tx)?;
    tx.pragma_update(None, "user_version", STORE_VERSION)?;
    tx.commit()?;
    if version > 0 {
        tracing::info!(
            from = version,
            to = STORE_VERSION,
            runs_bound = bound,
            "fact store migrated"
        );
    } else {
        tracing::info!(to = STORE_VERSION, runs_bound = bound, "fact store given an epoch");
    }
    Ok(())
}

/// Whether a run recorded before records said so must be taken as bound:
/// the executor's (label `source` = `executor`). The executor hands over
/// the listener of each confined child and cannot say afterwards which
/// children were; the proxy that held those listeners is gone (this runs
/// at its successor's start), so a confined child's credential is of use
/// only to a thief now. Taking every executor run as bound fails closed:
/// the cost is the fetches of unconfined children still running across
/// the upgrade (`credential_elsewhere`); their next invocations have new
/// runs.
fn bound_before_the_field(labels: &serde_json::Map<String, serde_json::Value>) -> bool {
    labels.get("source").and_then(|v| v.as_str()) == Some("executor")
}

/// Writes `bound` into every run record without it; returns how many it
/// made bound. An unreadable record is left as it is (it is skipped at
/// restore, as before).
fn mark_bound(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<usize> {
    let rows: Vec<(String, String)> = {
        let mut stmt = tx.prepare("SELECT id, body FROM runs")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let mut bound = 0;
    let mut update = tx.prepare("UPDATE runs SET body = ?2 WHERE id = ?1")?;
    for (id, body) in rows {
        let Ok(serde_json::Value::Object(mut rec)) = serde_json::from_str::<serde_json::Value>(&body) else {
            continue;
        };
        if rec.contains_key("bound") {
            continue;
        }
        let is = rec
            .get("labels")
            .and_then(|l| l.as_object())
            .is_some_and(bound_before_the_field);
        bound += usize::from(is);
        rec.insert("bound".into(), serde_json::Value::Bool(is));
        let body = serde_json::Value::Object(rec).to_string();
        update.execute(params![id, body])?;
    }
    Ok(bound)
}

/// The ids of the run records in the store.
fn run_ids(c: &Connection) -> rusqlite::Result<HashSet<String>> {
    let mut stmt = c.prepare("SELECT id FROM runs")?;
    let ids = stmt.query_map([], |r| r.get(0))?.collect();
    ids
}

fn next_seq(c: &Connection) -> rusqlite::Result<u64> {
    c.query_row("SELECT COALESCE(MAX(seq), 0) FROM facts", [], |r| r.get::<_, i64>(0))
        .map(|v| v as u64 + 1)
}

/// Opens the store for writing: [`open`], then [`catch_up`].
fn open_for_writing(path: &Path) -> rusqlite::Result<Connection> {
    let c = open(path)?;
    catch_up(&c)?;
    Ok(c)
}

/// Indexes by run every fact above the watermark (those a crash left
/// unindexed, or all of a store made before `run_facts`, whose index on
/// `facts(run_id, seq)` goes), and moves the watermark to the newest fact.
fn catch_up(c: &Connection) -> rusqlite::Result<()> {
    let tx = c.unchecked_transaction()?;
    tx.execute_batch("DROP INDEX IF EXISTS facts_by_run")?;
    let upto = indexed_upto(&tx)?;
    let n = tx.execute(
        "INSERT OR IGNORE INTO run_facts (run_id, seq) SELECT run_id, seq FROM facts WHERE seq > ?1 AND run_id IS NOT NULL",
        params![upto],
    )?;
    tx.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, (SELECT COALESCE(MAX(seq), 0) FROM facts))",
        params![INDEXED_UPTO],
    )?;
    tx.commit()?;
    if n > 0 {
        tracing::info!(facts = n, "indexed facts by run that were not yet");
    }
    Ok(())
}

fn indexed_upto(c: &Connection) -> rusqlite::Result<i64> {
    c.query_row(
        "SELECT COALESCE((SELECT value FROM meta WHERE key = ?1), 0)",
        params![INDEXED_UPTO],
        |r| r.get(0),
    )
}

/// Key under which identical denials of one batch are folded: everything
/// but the fact's id, time and detail.
type FoldKey = (
    Option<String>,
    Option<String>,
    String,
    String,
    Option<(String, String, u16)>,
    Vec<String>,
);

/// One folded fact and the requests waiting for it.
type Group = (Fact, Vec<oneshot::Sender<Result<Recorded, FactError>>>);

fn fold_key(f: &Fact) -> FoldKey {
    (
        f.run_id.clone(),
        f.tool.clone(),
        f.reason.clone(),
        f.mode.clone(),
        f.target.as_ref().map(|t| (t.kind.clone(), t.host.clone(), t.port)),
        f.resolved.clone(),
    )
}

impl Drop for SqliteStore {
    /// Closes the store: its writer finishes (pending denials, the index)
    /// and closes the database before this returns, so the same file can be
    /// opened again at once.
    fn drop(&mut self) {
        let (closed, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.tx, closed));
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl SqliteStore {
    /// Opens (or creates) the store and starts its writer thread. A store that
    /// cannot be opened still starts, unready: denials fail closed until it can.
    pub fn open(path: &Path, limits: Limits, metrics: StoreMetrics) -> SqliteStore {
        let (tx, rx) = mpsc::channel(QUEUE);
        let ready = Arc::new(AtomicBool::new(false));
        let (live, _) = broadcast::channel(4096);
        let first = open_for_writing(path);
        if let Err(e) = &first {
            tracing::error!(path = %path.display(), error = %e, "fact store cannot be opened; denials will fail closed until it can");
        }
        let identity = Arc::new(Identity::default());
        let first = first.and_then(|c| identity.load(&c).map(|()| c));
        ready.store(first.is_ok(), Ordering::Release);
        let cell = limits.cell.clone();
        let reader = first.as_ref().ok().and_then(|_| open(path).ok());
        metrics.budget.set(limits.max_bytes as i64);
        let writer = Writer {
            path: path.to_owned(),
            conn: first.ok(),
            next: 0,
            ready: ready.clone(),
            live: live.clone(),
            limits,
            metrics,
            used: 0,
            pruned_at: None,
            unindexed: Vec::new(),
            indexed_at: Instant::now(),
            identity: identity.clone(),
            runs_seen: HashMap::new(),
            runs_before: None,
            held: Vec::new(),
        };
        let spawned = std::thread::Builder::new()
            .name("egress-facts".into())
            .spawn(move || writer.run(rx));
        let writer = match spawned {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the fact writer thread");
                ready.store(false, Ordering::Release);
                None
            }
        };
        SqliteStore {
            tx,
            writer,
            reader: Arc::new(Mutex::new(reader)),
            path: path.to_owned(),
            ready,
            live,
            identity,
            cell,
        }
    }

    /// Queues `p` for the writer.
    async fn send(&self, p: Pending) -> Result<(), FactError> {
        self.tx.send(p).await.map_err(|_| writer_stopped())
    }

    /// Queues what `ask` makes of a reply channel and waits for the answer.
    async fn ask<T>(&self, ask: impl FnOnce(oneshot::Sender<Result<T, FactError>>) -> Pending) -> Result<T, FactError> {
        let (reply, rx) = oneshot::channel();
        self.send(ask(reply)).await?;
        rx.await.map_err(|_| writer_stopped())?
    }

    fn read(
        reader: &Mutex<Option<Connection>>,
        path: &Path,
        q: &FactQuery,
        stamp: (&Option<String>, &str),
    ) -> Result<Vec<Fact>, FactError> {
        let mut guard = reader
            .lock()
            .map_err(|_| FactError::Unavailable("reader poisoned".into()))?;
        if guard.is_none() {
            *guard = Some(open(path).map_err(|e| FactError::Unavailable(e.to_string()))?);
        }
        let c = guard
            .as_ref()
            .ok_or_else(|| FactError::Unavailable("no reader".into()))?;
        let limit = q.limit.min(10_000) as i64;
        let rows: rusqlite::Result<Vec<String>> = match &q.run_id {
            Some(run) => c
                .prepare_cached(
                    "SELECT body FROM (
                         SELECT * FROM (
                             SELECT f.seq AS seq, f.body AS body FROM run_facts r JOIN facts f ON f.seq = r.seq
                             WHERE r.run_id = ?1 AND r.seq > ?2 ORDER BY r.seq LIMIT ?3)
                         UNION ALL
                         SELECT seq, body FROM facts
                         WHERE seq > max(?2, COALESCE((SELECT value FROM meta WHERE key = ?4), 0))
                           AND run_id = ?1
                     ) ORDER BY seq LIMIT ?3",
                )
                .and_then(|mut s| {
                    s.query_map(params![run, q.after as i64, limit, INDEXED_UPTO], |r| r.get(0))?
                        .collect()
                }),
            None => c
                .prepare_cached("SELECT body FROM facts WHERE seq > ?1 ORDER BY seq LIMIT ?2")
                .and_then(|mut s| s.query_map(params![q.after as i64, limit], |r| r.get(0))?.collect()),
        };
        let rows = rows.map_err(|e| {
            *guard = None;
            FactError::Unavailable(e.to_string())
        })?;
        rows.iter()
            .map(|b| {
                let mut f: Fact =
                    serde_json::from_str(b).map_err(|e| FactError::Unavailable(format!("corrupt fact: {e}")))?;
                // Facts written before the store had an epoch (migrated).
                if f.epoch.is_none() {
                    f.epoch = Some(stamp.1.to_owned());
                    f.cell.clone_from(stamp.0);
                }
                Ok(f)
            })
            .collect()
    }
}

impl FactSink for SqliteStore {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(self.ask(|reply| Pending::Fact { fact, reply }))
    }

    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        let (cell, epoch) = (self.cell.clone(), self.identity.epoch());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || SqliteStore::read(&reader, &path, &q, (&cell, &epoch)))
                .await
                .map_err(|e| FactError::Unavailable(e.to_string()))?
        })
    }

    fn subscribe(&self) -> broadcast::Receiver<Fact> {
        self.live.subscribe()
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    fn epoch(&self) -> Option<String> {
        Some(self.identity.epoch()).filter(|e| !e.is_empty())
    }

    fn head(&self) -> u64 {
        self.identity.head.load(Ordering::Acquire)
    }

    fn export_cursor(&self) -> u64 {
        self.identity.cursor.load(Ordering::Acquire)
    }

    fn set_export_cursor(&self, seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(self.ask(move |reply| Pending::Cursor { seq, reply }))
    }

    fn save_run(&self, write: RunWrite) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(async move { self.ask(|reply| Pending::Run { write, reply }).await.map(|_| ()) })
    }

    fn save_run_soon(&self, write: RunWrite) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(async move {
            self.send(Pending::RunSoon(write)).await?;
            // A weak handle: a store being dropped does not wait for it.
            let tx = self.tx.downgrade();
            tokio::spawn(async move {
                tokio::time::sleep(crate::facts::RUN_WRITE_DELAY).await;
                if let Some(tx) = tx.upgrade() {
                    let _ = tx.send(Pending::Flush).await;
                }
            });
            Ok(())
        })
    }

    fn forget_run(&self, id: String) -> BoxFuture<'_, Result<bool, FactError>> {
        Box::pin(async move {
            let write = RunWrite::Delete(id);
            let written = self.ask(|reply| Pending::Run { write, reply }).await?;
            Ok(written.may_have_facts)
        })
    }

    fn load_runs(&self) -> Result<Vec<RunRecord>, FactError> {
        let c = open(&self.path).map_err(|e| FactError::Unavailable(e.to_string()))?;
        let mut stmt = c
            .prepare("SELECT body FROM runs")
            .map_err(|e| FactError::Unavailable(e.to_string()))?;
        let bodies: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect())
            .map_err(|e| FactError::Unavailable(e.to_string()))?;
        Ok(bodies
            .iter()
            .filter_map(|b| match serde_json::from_str(b) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(error = %e, "skipping an unreadable stored run");
                    None
                }
            })
            .collect())
    }
}

struct Writer {
    path: PathBuf,
    conn: Option<Connection>,
    next: u64,
    ready: Arc<AtomicBool>,
    live: broadcast::Sender<Fact>,
    limits: Limits,
    metrics: StoreMetrics,
    /// Bytes in use after the last write or prune.
    used: u64,
    pruned_at: Option<Instant>,
    /// Committed facts of runs not yet in `run_facts`: (run, seq).
    unindexed: Vec<(String, u64)>,
    indexed_at: Instant,
    identity: Arc<Identity>,
    /// Runs whose record this writer made, each with whether one of its
    /// facts was committed since: a run's end skips reading its facts when
    /// it has none. An entry lives from the run's record to its deletion.
    runs_seen: HashMap<String, bool>,
    /// Runs whose record was in the store when it was opened (their facts
    /// are unknown), or `None` if the store was not readable then (every
    /// run's are).
    runs_before: Option<HashSet<String>>,
    /// Run record writes queued by `save_run_soon`, not yet committed.
    held: Vec<RunWrite>,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Pending>) {
        if let Some(c) = &self.conn {
            match next_seq(c) {
                Ok(n) => self.next = n,
                Err(_) => self.conn = None,
            }
        }
        if self.conn.is_some() {
            self.prune();
        }
        self.runs_before = self.conn.as_ref().and_then(|c| run_ids(c).ok());
        let mut batch = Vec::with_capacity(256);
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            while batch.len() < QUEUE {
                match rx.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            self.commit(&mut batch);
            if self.unindexed.len() >= INDEX_TAIL || self.indexed_at.elapsed() >= INDEX_EVERY {
                self.index();
            }
        }
        // Closing: what is held is committed now.
        self.commit(&mut vec![Pending::Flush]);
        self.index();
    }

    /// Writes the committed facts' `run_facts` rows and the watermark.
    fn index(&mut self) {
        self.indexed_at = Instant::now();
        if self.unindexed.is_empty() {
            return;
        }
        let Some(c) = self.conn.as_mut() else { return };
        let upto = self.next.saturating_sub(1) as i64;
        let written = (|| {
            let tx = c.transaction()?;
            {
                let mut ins = tx.prepare_cached("INSERT OR IGNORE INTO run_facts (run_id, seq) VALUES (?1, ?2)")?;
                for (run, seq) in &self.unindexed {
                    ins.execute(params![run, *seq as i64])?;
                }
                tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)")?
                    .execute(params![INDEXED_UPTO, upto])?;
            }
            tx.commit()
        })();
        if let Err(e) = written {
            // The watermark did not move: queries still scan these facts,
            // and the reopen at the next batch indexes them (`catch_up`).
            tracing::warn!(error = %e, "indexing facts by run failed; the store is reopened");
            self.conn = None;
        }
        self.unindexed.clear();
    }

    fn commit(&mut self, batch: &mut Vec<Pending>) {
        // Fold identical denials of this batch into one fact with a count.
        let mut groups: Vec<Group> = Vec::new();
        let mut index = HashMap::new();
        // Run record writes in the order they were queued, after the held
        // ones (older); those with a reply are waited for.
        let mut runs: Vec<(RunWrite, Option<RunReply>)> = self.held.drain(..).map(|w| (w, None)).collect();
        let mut waited = false;
        let mut flush = false;
        let mut cursors = Vec::new();
        for p in batch.drain(..) {
            let (fact, reply) = match p {
                Pending::Fact { fact, reply } => (fact, reply),
                Pending::Run { write, reply } => {
                    runs.push((write, Some(reply)));
                    waited = true;
                    continue;
                }
                Pending::RunSoon(write) => {
                    runs.push((write, None));
                    continue;
                }
                Pending::Flush => {
                    flush = true;
                    continue;
                }
                Pending::Cursor { seq, reply } => {
                    cursors.push((seq, reply));
                    continue;
                }
            };
            let key = fold_key(&fact);
            match index.get(&key) {
                Some(&i) => {
                    let g: &mut Group = &mut groups[i];
                    g.0.count += fact.count;
                    g.1.push(reply);
                }
                None => {
                    index.insert(key, groups.len());
                    groups.push((fact, vec![reply]));
                }
            }
        }
        // Facts first: a run's deletion is answered only once every fact
        // queued before it is committed (`DELETE /v1/runs/{id}` reads the
        // run's facts when its deletion returns).
        self.commit_facts(groups);
        if !(waited || flush || runs.len() >= MAX_HELD) {
            // Only writes nobody waits for: they wait for company (a
            // waited-for write or the flush `save_run_soon` scheduled).
            self.held.extend(runs.into_iter().map(|(w, _)| w));
        } else if !runs.is_empty() {
            // Run records are small and never limited by the facts' budget.
            let r = self
                .write_runs(&runs)
                .map_err(|e| FactError::Unavailable(e.to_string()));
            if let Err(e) = &r {
                tracing::error!(path = %self.path.display(), error = %e, "run records could not be written");
                self.conn = None;
            }
            for (write, reply) in runs {
                let written = r.clone().map(|()| self.note_run(&write));
                if let Some(reply) = reply {
                    let _ = reply.send(written);
                }
            }
        }
        if let Some(upto) = cursors.iter().map(|(s, _)| *s).max() {
            let r = self
                .write_cursor(upto)
                .map_err(|e| FactError::Unavailable(e.to_string()));
            if let Err(e) = &r {
                tracing::warn!(error = %e, "the export cursor could not be written");
                self.conn = None;
            }
            for (_, reply) in cursors {
                let _ = reply.send(r.clone());
            }
        }
    }

    /// Writes one batch's facts (folded into `groups`) and answers them.
    fn commit_facts(&mut self, mut groups: Vec<Group>) {
        if groups.is_empty() {
            return;
        }
        let folded: usize = groups.iter().map(|g| g.1.len() - 1).sum();
        let reopened = self.conn.is_none() && self.reopen().is_ok();
        if reopened || self.pruned_at.is_none_or(|t| t.elapsed() >= PRUNE_EVERY) || self.used >= self.limits.max_bytes {
            self.prune();
        }
        let result = if self.conn.is_some() && self.used >= self.limits.max_bytes {
            Err(format!(
                "the fact store holds {} bytes, its budget (proxy.facts_max_mb) is {} bytes, and no fact is older than proxy.facts_retention_hours",
                self.used, self.limits.max_bytes
            ))
        } else {
            self.write(&mut groups).map_err(|e| e.to_string())
        };
        match result {
            Ok(()) => {
                self.ready.store(true, Ordering::Release);
                self.metrics.coalesced.inc_by(folded as u64);
                self.measure();
                for (fact, replies) in groups {
                    if let Some(seen) = fact.run_id.as_ref().and_then(|r| self.runs_seen.get_mut(r)) {
                        *seen = true;
                    }
                    for r in replies {
                        let _ = r.send(Ok(Recorded {
                            seq: fact.seq,
                            id: fact.id.clone(),
                        }));
                    }
                    let _ = self.live.send(fact);
                }
            }
            Err(msg) => {
                self.ready.store(false, Ordering::Release);
                self.conn = None;
                tracing::error!(path = %self.path.display(), error = %msg, "fact store write failed");
                for (_, replies) in groups {
                    for r in replies {
                        let _ = r.send(Err(FactError::Unavailable(msg.clone())));
                    }
                }
            }
        }
    }

    /// Keeps `runs_seen` in step with a committed run record write; for a
    /// deletion, says whether the run may have facts.
    fn note_run(&mut self, write: &RunWrite) -> RunWritten {
        match write {
            RunWrite::Update(_) => RunWritten { may_have_facts: true },
            RunWrite::Save(rec) => {
                if self.runs_before.as_ref().is_some_and(|b| !b.contains(&rec.id)) {
                    self.runs_seen.entry(rec.id.clone()).or_insert(false);
                }
                RunWritten { may_have_facts: true }
            }
            RunWrite::Delete(id) => {
                if let Some(b) = self.runs_before.as_mut() {
                    b.remove(id);
                }
                RunWritten {
                    may_have_facts: self.runs_seen.remove(id).unwrap_or(true),
                }
            }
        }
    }

    /// Updates `used` and its gauge from the database.
    fn measure(&mut self) {
        if let Some(Ok(used)) = self.conn.as_ref().map(used_bytes) {
            let used = used.saturating_sub(self.limits.others.load(Ordering::Acquire));
            self.used = used;
            self.metrics.bytes.set(used as i64);
        }
    }

    /// Deletes facts older than the retention age, then measures.
    fn prune(&mut self) {
        self.pruned_at = Some(Instant::now());
        let cutoff = SystemTime::now()
            .checked_sub(self.limits.retention)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let cutoff = crate::time::rfc3339(cutoff);
        let upto = if self.limits.exported {
            self.identity.cursor.load(Ordering::Acquire) as i64
        } else {
            i64::MAX
        };
        if let Some(c) = &self.conn {
            match prune_before(c, &cutoff, upto) {
                Ok(0) => {}
                Ok(n) => {
                    self.metrics.pruned.inc_by(n);
                    tracing::info!(deleted = n, before = %cutoff, "pruned facts older than the retention age");
                }
                Err(e) => tracing::warn!(error = %e, "pruning old facts failed"),
            }
        }
        self.measure();
    }

    fn reopen(&mut self) -> rusqlite::Result<()> {
        let c = open_for_writing(&self.path)?;
        self.unindexed.clear();
        self.identity.load(&c)?;
        self.next = next_seq(&c)?;
        self.conn = Some(c);
        Ok(())
    }

    /// Moves the export cursor up to `upto` (never back).
    fn write_cursor(&mut self, upto: u64) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            self.reopen()?;
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        c.prepare_cached(
            "INSERT INTO meta (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
        )?
        .execute(params![EXPORT_CURSOR, upto as i64])?;
        self.identity.cursor.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }

    fn write_runs(&mut self, runs: &[(RunWrite, Option<RunReply>)]) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            self.reopen()?;
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        let tx = c.transaction()?;
        {
            let mut save = tx.prepare_cached("INSERT OR REPLACE INTO runs (id, body) VALUES (?1, ?2)")?;
            let mut update = tx.prepare_cached("UPDATE runs SET body = ?2 WHERE id = ?1")?;
            let mut delete = tx.prepare_cached("DELETE FROM runs WHERE id = ?1")?;
            for (w, _) in runs {
                match w {
                    RunWrite::Save(rec) => {
                        let body = serde_json::to_string(rec)
                            .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                        save.execute(params![rec.id, body])?;
                    }
                    RunWrite::Update(rec) => {
                        let body = serde_json::to_string(rec)
                            .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                        update.execute(params![rec.id, body])?;
                    }
                    RunWrite::Delete(id) => {
                        delete.execute(params![id])?;
                    }
                }
            }
        }
        tx.commit()
    }

    fn write(&mut self, groups: &mut [Group]) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            self.reopen()?;
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        let tx = c.transaction()?;
        let mut seq = self.next;
        let epoch = self.identity.epoch();
        {
            let mut ins = tx.prepare_cached("INSERT INTO facts (seq, id, run_id, body) VALUES (?1, ?2, ?3, ?4)")?;
            for (fact, _) in groups.iter_mut() {
                fact.seq = seq;
                fact.cell.clone_from(&self.limits.cell);
                fact.epoch = Some(epoch.clone());
                let body =
                    serde_json::to_string(fact).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                ins.execute(params![seq as i64, fact.id, fact.run_id, body])?;
                seq += 1;
            }
        }
        tx.commit()?;
        self.next = seq;
        self.identity.head.store(seq - 1, Ordering::Release);
        let runs = groups.iter().filter_map(|(f, _)| Some((f.run_id.clone()?, f.seq)));
        self.unindexed.extend(runs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::{denial, FactTarget, NewFact};

    fn fact(run: &str, host: &str) -> Fact {
        denial(NewFact {
            run_id: Some(run),
            tool: Some("t"),
            reason: "not_allowlisted",
            mode: "enforce",
            target: Some(FactTarget {
                kind: "connect".into(),
                host: host.into(),
                port: 443,
            }),
            resolved: vec![],
            policy: "sha256:x",
            detail: "d".into(),
        })
    }

    /// `DELETE /v1/runs/{id}` reads the run's facts once its deletion is
    /// committed: a fact queued before the deletion (here in the same batch
    /// of the writer, most of the time) must be readable by then.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_deletion_returns_after_the_facts_queued_before_it() {
        use futures_util::FutureExt as _;
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open(&dir.path().join("f.db"), Limits::default(), StoreMetrics::default());
        s.record(fact("warm-up", "a.example")).await.unwrap();
        for i in 0..100 {
            let run = format!("r{i}");
            // Its first poll queues the fact; its answer is not awaited.
            assert!(s.record(fact(&run, "b.example")).now_or_never().is_none());
            assert!(s.forget_run(run.clone()).await.unwrap(), "iteration {i}: it has a fact");
            assert_eq!(
                query(&s, Some(&run), 0, 10).await.len(),
                1,
                "iteration {i}: the deletion returned before the fact queued ahead of it was committed"
            );
        }
    }

    fn record(id: &str) -> RunRecord {
        RunRecord {
            id: id.into(),
            tool: "t".into(),
            owner: None,
            labels: Default::default(),
            active: false,
            bound: false,
            created_at_ms: 0,
            expires_at_ms: u64::MAX,
            secret_sha256: "x".into(),
            max_slots: 1,
            max_waiting: 1,
            max_conns: 1,
            placeholders: vec![],
        }
    }

    fn activated(id: &str) -> RunWrite {
        RunWrite::Update(RunRecord {
            active: true,
            ..record(id)
        })
    }

    /// A run's end skips reading its facts only when the store knows it has
    /// none: its record was made by this store's writer and no fact of it
    /// was committed since. A run kept from before the store was opened,
    /// or one with a fact, is read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_known_to_have_no_facts_is_forgotten_without_a_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        s.save_run(RunWrite::Save(record("kept"))).await.unwrap();
        s.save_run(RunWrite::Save(record("kept-with-facts"))).await.unwrap();
        s.record(fact("kept-with-facts", "a.example")).await.unwrap();
        drop(s);
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for id in ["clean", "denied", "activated-then-denied"] {
            s.save_run(RunWrite::Save(record(id))).await.unwrap();
        }
        s.record(fact("denied", "b.example")).await.unwrap();
        s.save_run(activated("activated-then-denied")).await.unwrap();
        s.record(fact("activated-then-denied", "c.example")).await.unwrap();
        // Activated after the reopen: still unknown.
        s.save_run(activated("kept")).await.unwrap();
        assert!(!s.forget_run("clean".into()).await.unwrap());
        for id in [
            "denied",
            "activated-then-denied",
            "kept",
            "kept-with-facts",
            "never-made",
        ] {
            assert!(s.forget_run(id.into()).await.unwrap(), "{id}: its facts must be read");
        }
        assert_eq!(query(&s, Some("kept-with-facts"), 0, 10).await.len(), 1);
        // Forgotten: a second end of the same id is no longer known.
        assert!(s.forget_run("clean".into()).await.unwrap());
    }

    fn active(path: &Path, id: &str) -> i64 {
        raw(
            path,
            &format!("SELECT count(*) FROM runs WHERE id = '{id}' AND body LIKE '%\"active\":true%'"),
        )
    }

    /// An activation's record write is not waited for: it is committed
    /// within RUN_WRITE_DELAY, or with the next waited-for write, or when
    /// the store closes, in the order the writes were queued; and it only
    /// updates a record still kept, so it never brings back an ended run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_activation_is_committed_soon_in_order_and_never_brings_back_an_ended_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        // Within the delay.
        s.save_run(RunWrite::Save(record("a"))).await.unwrap();
        s.save_run_soon(activated("a")).await.unwrap();
        let t0 = Instant::now();
        while active(&path, "a") == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the activation was never committed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Queued before the run's end: the end wins, then and later.
        s.save_run(RunWrite::Save(record("b"))).await.unwrap();
        s.save_run_soon(activated("b")).await.unwrap();
        s.forget_run("b".into()).await.unwrap();
        assert_eq!(raw(&path, "SELECT count(*) FROM runs WHERE id = 'b'"), 0);
        // Written after the end (it lost a race with it): not brought back.
        s.save_run(RunWrite::Save(record("c"))).await.unwrap();
        s.forget_run("c".into()).await.unwrap();
        s.save_run(activated("c")).await.unwrap();
        s.save_run_soon(activated("c")).await.unwrap();
        // Closing commits what is held.
        s.save_run(RunWrite::Save(record("d"))).await.unwrap();
        s.save_run_soon(activated("d")).await.unwrap();
        drop(s);
        assert_eq!(
            active(&path, "d"),
            1,
            "the store closed without committing a held write"
        );
        tokio::time::sleep(crate::facts::RUN_WRITE_DELAY * 3).await;
        assert_eq!(raw(&path, "SELECT count(*) FROM runs WHERE id IN ('b', 'c')"), 0);
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        let mut kept: Vec<(String, bool)> = s.load_runs().unwrap().into_iter().map(|r| (r.id, r.active)).collect();
        kept.sort();
        assert_eq!(kept, [("a".to_owned(), true), ("d".to_owned(), true)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn seq_is_gap_free_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert!(s.ready());
        for i in 0..5 {
            assert_eq!(s.record(fact("r", &format!("h{i}"))).await.unwrap().seq, i + 1);
        }
        drop(s);
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert_eq!(s.record(fact("r", "again")).await.unwrap().seq, 6);
        let all = s
            .query(FactQuery {
                after: 0,
                limit: 100,
                run_id: None,
            })
            .await
            .unwrap();
        assert_eq!(all.iter().map(|f| f.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
        let after = s
            .query(FactQuery {
                after: 4,
                limit: 1,
                run_id: None,
            })
            .await
            .unwrap();
        assert_eq!(after[0].seq, 5);
        let by_run = s
            .query(FactQuery {
                after: 0,
                limit: 100,
                run_id: Some("nobody".into()),
            })
            .await
            .unwrap();
        assert!(by_run.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_identical_denials_is_coalesced_not_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = StoreMetrics::default();
        let counter = metrics.coalesced.clone();
        let s = Arc::new(SqliteStore::open(&dir.path().join("f.db"), Limits::default(), metrics));
        let mut tasks = vec![];
        for _ in 0..2000 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.record(fact("flood", "evil.example")).await.unwrap().seq
            }));
        }
        let mut seqs = vec![];
        for t in tasks {
            seqs.push(t.await.unwrap());
        }
        let all = s
            .query(FactQuery {
                after: 0,
                limit: 10_000,
                run_id: None,
            })
            .await
            .unwrap();
        let total: u64 = all.iter().map(|f| f.count).sum();
        assert_eq!(total, 2000, "every denial is accounted for");
        assert!(all.len() < 2000, "identical denials were folded ({} facts)", all.len());
        assert_eq!(counter.get() as usize, 2000 - all.len());
        // Every answered denial points at a stored fact.
        for q in seqs {
            assert!(all.iter().any(|f| f.seq == q));
        }
    }

    async fn all(s: &SqliteStore) -> Vec<Fact> {
        query(s, None, 0, 10_000).await
    }

    async fn query(s: &SqliteStore, run: Option<&str>, after: u64, limit: usize) -> Vec<Fact> {
        s.query(FactQuery {
            after,
            limit,
            run_id: run.map(str::to_owned),
        })
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn facts_older_than_the_retention_are_pruned_and_younger_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for i in 0..3 {
            let mut old = fact("r", &format!("old{i}"));
            old.at = "2001-01-01T00:00:00.000Z".into();
            s.record(old).await.unwrap();
        }
        drop(s);
        // Only old facts: the newest is kept so that seq continues after it.
        let s = SqliteStore::open(
            &path,
            Limits {
                retention: Duration::from_secs(3600),
                ..Limits::default()
            },
            StoreMetrics::default(),
        );
        assert_eq!(s.record(fact("r", "young0")).await.unwrap().seq, 4);
        assert_eq!(all(&s).await.len(), 2);
        drop(s);
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for i in 3..5 {
            let mut old = fact("r", &format!("old{i}"));
            old.at = "2001-01-01T00:00:00.000Z".into();
            s.record(old).await.unwrap();
        }
        s.record(fact("r", "young1")).await.unwrap();
        s.record(fact("r", "young2")).await.unwrap();
        drop(s);
        let metrics = StoreMetrics::default();
        let limits = Limits {
            retention: Duration::from_secs(3600),
            ..Limits::default()
        };
        let s = SqliteStore::open(&path, limits, metrics.clone());
        // Pruning runs when the writer starts; the next commit waits behind it.
        let next = s.record(fact("r", "young3")).await.unwrap();
        assert_eq!(next.seq, 9, "seq never goes back after pruning");
        let hosts: Vec<String> = all(&s).await.into_iter().map(|f| f.target.unwrap().host).collect();
        assert_eq!(hosts, ["young0", "young1", "young2", "young3"]);
        assert_eq!(
            raw(
                &path,
                "SELECT count(*) FROM run_facts WHERE seq NOT IN (SELECT seq FROM facts)"
            ),
            0,
            "an index row of a pruned fact is left"
        );
        assert_eq!(
            metrics.pruned.get(),
            2,
            "old3 and old4 (old2 went at the previous start)"
        );
        assert!(metrics.bytes.get() > 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_at_its_budget_fails_closed_and_keeps_every_young_fact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let metrics = StoreMetrics::default();
        let limits = Limits {
            max_bytes: 64 * 1024,
            ..Limits::default()
        };
        let s = SqliteStore::open(&path, limits, metrics.clone());
        let mut stored = 0;
        let err = loop {
            let mut f = fact("r", &format!("h{stored}"));
            f.detail = "d".repeat(400);
            match s.record(f).await {
                Ok(_) => stored += 1,
                Err(e) => break e,
            }
            assert!(stored < 10_000, "the budget never bit");
        };
        assert!(err.to_string().contains("budget"), "{err}");
        assert!(stored > 10, "only {stored} facts fit");
        assert!(!s.ready());
        assert_eq!(all(&s).await.len(), stored, "a fact was dropped to make room");
        assert!(metrics.bytes.get() >= 64 * 1024);
        assert_eq!(metrics.budget.get(), 64 * 1024);
        drop(s);
        // A larger budget makes room again.
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert!(s.record(fact("r", "after")).await.is_ok());
        assert_eq!(all(&s).await.len(), stored + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pages_another_budget_counts_are_left_out_of_this_one() {
        for (others, fits) in [(0u64, false), (64 << 20, true)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.db");
            {
                // Another table of the file (the decision log's) holds 1 MiB.
                let c = Connection::open(&path).unwrap();
                c.execute_batch("CREATE TABLE other (b BLOB); INSERT INTO other VALUES (zeroblob(1048576));")
                    .unwrap();
            }
            let limits = Limits {
                max_bytes: 256 * 1024,
                others: Arc::new(AtomicU64::new(others)),
                ..Limits::default()
            };
            let s = SqliteStore::open(&path, limits, StoreMetrics::default());
            let mut ok = true;
            for i in 0..3 {
                ok &= s.record(fact("r", &format!("h{i}"))).await.is_ok();
            }
            assert_eq!(ok, fits, "others = {others}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_file_fails_closed_and_unready() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert!(!s.ready());
        assert!(s.record(fact("r", "h")).await.is_err());
        assert!(!s.ready());
        assert!(s
            .query(FactQuery {
                after: 0,
                limit: 1,
                run_id: None
            })
            .await
            .is_err());
    }

    fn raw(path: &Path, sql: &str) -> i64 {
        let c = Connection::open(path).unwrap();
        c.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    async fn by_run(s: &SqliteStore, run: &str, after: u64, limit: usize) -> Vec<u64> {
        query(s, Some(run), after, limit).await.iter().map(|f| f.seq).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runs_facts_are_found_before_and_after_they_are_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for i in 0..10 {
            s.record(fact(if i % 2 == 0 { "a" } else { "b" }, &format!("h{i}")))
                .await
                .unwrap();
        }
        // Whatever the writer has indexed yet, a query sees every fact.
        assert_eq!(by_run(&s, "a", 0, 100).await, [1, 3, 5, 7, 9]);
        drop(s);
        // Reopened: everything is indexed, the watermark at the newest fact.
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert_eq!(raw(&path, "SELECT count(*) FROM run_facts WHERE run_id = 'a'"), 5);
        assert_eq!(raw(&path, "SELECT value FROM meta WHERE key = 'run_facts_upto'"), 10);
        for i in 10..14 {
            s.record(fact(if i % 2 == 0 { "a" } else { "b" }, &format!("h{i}")))
                .await
                .unwrap();
        }
        // Indexed facts and the unindexed tail, in order, with cursor and limit.
        assert_eq!(by_run(&s, "a", 0, 100).await, [1, 3, 5, 7, 9, 11, 13]);
        assert_eq!(by_run(&s, "a", 5, 3).await, [7, 9, 11]);
        assert_eq!(by_run(&s, "a", 9, 100).await, [11, 13]);
        assert_eq!(by_run(&s, "b", 10, 1).await, [12]);
        assert!(by_run(&s, "nobody", 0, 100).await.is_empty());
        // Under traffic the writer indexes within INDEX_EVERY.
        tokio::time::sleep(INDEX_EVERY + Duration::from_millis(20)).await;
        s.record(fact("a", "late")).await.unwrap();
        let t0 = Instant::now();
        while raw(&path, "SELECT count(*) FROM run_facts WHERE run_id = 'a'") < 8 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the writer never indexed the new facts"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(raw(&path, "SELECT value FROM meta WHERE key = 'run_facts_upto'"), 15);
        assert_eq!(by_run(&s, "a", 0, 100).await, [1, 3, 5, 7, 9, 11, 13, 15]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_made_before_run_facts_is_indexed_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        {
            // The schema of earlier versions: an index on facts(run_id, seq).
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE facts (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, run_id TEXT, body TEXT NOT NULL);
                 CREATE INDEX facts_by_run ON facts(run_id, seq);
                 CREATE TABLE runs (id TEXT PRIMARY KEY, body TEXT NOT NULL);",
            )
            .unwrap();
            for (seq, run) in [(1, "a"), (2, "b"), (3, "a")] {
                let mut f = fact(run, "old");
                f.seq = seq;
                let body = serde_json::to_string(&f).unwrap();
                c.execute(
                    "INSERT INTO facts (seq, id, run_id, body) VALUES (?1, ?2, ?3, ?4)",
                    params![seq as i64, f.id, run, body],
                )
                .unwrap();
            }
        }
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert_eq!(by_run(&s, "a", 0, 100).await, [1, 3]);
        assert_eq!(raw(&path, "SELECT count(*) FROM run_facts"), 3);
        assert_eq!(
            raw(&path, "SELECT count(*) FROM sqlite_master WHERE name = 'facts_by_run'"),
            0,
            "the old index is dropped"
        );
        assert_eq!(s.record(fact("a", "new")).await.unwrap().seq, 4);
        assert_eq!(by_run(&s, "a", 0, 100).await, [1, 3, 4]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_store_draws_an_epoch_and_stamps_it_and_the_cell_on_every_fact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let limits = Limits {
            cell: Some("cell-a".into()),
            ..Limits::default()
        };
        let s = SqliteStore::open(&path, limits.clone(), StoreMetrics::default());
        let epoch = s.epoch().unwrap();
        assert!(uuid::Uuid::parse_str(&epoch).is_ok(), "{epoch}");
        s.record(fact("r", "h")).await.unwrap();
        assert_eq!(s.head(), 1);
        let f = &all(&s).await[0];
        assert_eq!(
            (f.cell.as_deref(), f.epoch.as_deref()),
            (Some("cell-a"), Some(epoch.as_str()))
        );
        drop(s);
        // The same file keeps its epoch; a new file gets another.
        let s = SqliteStore::open(&path, limits.clone(), StoreMetrics::default());
        assert_eq!(s.epoch().unwrap(), epoch);
        assert_eq!(s.head(), 1);
        drop(s);
        std::fs::remove_file(&path).unwrap();
        let s = SqliteStore::open(&path, limits, StoreMetrics::default());
        assert_ne!(s.epoch().unwrap(), epoch, "a replaced store is a new epoch");
        assert_eq!(raw(&path, "PRAGMA user_version"), STORE_VERSION);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_made_before_epochs_is_migrated_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        {
            // The schema of version 0 (1.7.0 facts, no store_info, no user_version).
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE facts (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, run_id TEXT, body TEXT NOT NULL);
                 CREATE TABLE run_facts (run_id TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID;
                 CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
                 CREATE TABLE runs (id TEXT PRIMARY KEY, body TEXT NOT NULL);",
            )
            .unwrap();
            let mut f = fact("a", "old");
            f.seq = 1;
            let mut body: serde_json::Value = serde_json::to_value(&f).unwrap();
            body.as_object_mut().unwrap().remove("epoch");
            body["schema"] = "1.7.0".into();
            c.execute(
                "INSERT INTO facts (seq, id, run_id, body) VALUES (1, ?1, 'a', ?2)",
                params![f.id, body.to_string()],
            )
            .unwrap();
        }
        let s = SqliteStore::open(
            &path,
            Limits {
                cell: Some("cell-a".into()),
                ..Limits::default()
            },
            StoreMetrics::default(),
        );
        assert!(s.ready());
        assert_eq!(raw(&path, "PRAGMA user_version"), STORE_VERSION);
        let epoch = s.epoch().expect("an epoch was drawn");
        assert_eq!(s.head(), 1);
        assert_eq!(s.record(fact("a", "new")).await.unwrap().seq, 2);
        let facts = all(&s).await;
        for f in &facts {
            assert_eq!(f.epoch.as_deref(), Some(epoch.as_str()), "seq {}", f.seq);
            assert_eq!(f.cell.as_deref(), Some("cell-a"));
        }
    }

    /// A store of version 2 holds run records that do not say whether the
    /// run is bound to its handed-over listener. Opened, every record says
    /// so: the executor's runs bound (their listeners died with the proxy
    /// that held them: fail closed), others not; a record that already says
    /// it, or cannot be read, is left as it is; it happens once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_records_from_before_the_binding_are_migrated_failing_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let body = |id: &str, labels: serde_json::Value, bound: Option<bool>| {
            let mut v = serde_json::to_value(record(id)).unwrap();
            let o = v.as_object_mut().unwrap();
            o.insert("labels".into(), labels);
            match bound {
                Some(b) => o.insert("bound".into(), b.into()),
                None => o.remove("bound"),
            };
            v.to_string()
        };
        {
            let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
            assert!(s.ready());
            drop(s);
            // Back to version 2, with records as it wrote them.
            let c = Connection::open(&path).unwrap();
            c.pragma_update(None, "user_version", 2).unwrap();
            for (id, b) in [
                ("exec", body("exec", serde_json::json!({"source": "executor"}), None)),
                ("kernel", body("kernel", serde_json::json!({"k": "v"}), None)),
                ("spoofed", body("spoofed", serde_json::json!({"source": 7}), None)),
                (
                    "kept",
                    body("kept", serde_json::json!({"source": "executor"}), Some(false)),
                ),
                ("broken", "{not json".to_owned()),
            ] {
                c.execute("INSERT INTO runs (id, body) VALUES (?1, ?2)", params![id, b])
                    .unwrap();
            }
        }
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        assert!(s.ready());
        assert_eq!(raw(&path, "PRAGMA user_version"), STORE_VERSION);
        let mut got: Vec<(String, bool)> = s.load_runs().unwrap().into_iter().map(|r| (r.id, r.bound)).collect();
        got.sort();
        let want = [("exec", true), ("kept", false), ("kernel", false), ("spoofed", false)];
        assert_eq!(got, want.map(|(i, b)| (i.to_owned(), b)));
        assert_eq!(raw(&path, "SELECT count(*) FROM runs WHERE body LIKE '%\"bound\"%'"), 4);
        assert_eq!(
            raw(
                &path,
                "SELECT count(*) FROM runs WHERE id = 'broken' AND body = '{not json'"
            ),
            1
        );
        // Once: a record written unbound after the migration stays so.
        s.save_run(RunWrite::Save(RunRecord {
            labels: serde_json::json!({"source": "executor"}).as_object().unwrap().clone(),
            ..record("later")
        }))
        .await
        .unwrap();
        drop(s);
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        let later = s.load_runs().unwrap().into_iter().find(|r| r.id == "later").unwrap();
        assert!(!later.bound);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retention_never_deletes_a_fact_not_yet_exported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for i in 0..4 {
            let mut old = fact("r", &format!("old{i}"));
            old.at = "2001-01-01T00:00:00.000Z".into();
            s.record(old).await.unwrap();
        }
        s.set_export_cursor(2).await.unwrap();
        assert_eq!(s.export_cursor(), 2);
        s.set_export_cursor(1).await.unwrap();
        assert_eq!(s.export_cursor(), 2, "the cursor never goes back");
        drop(s);
        let limits = Limits {
            retention: Duration::from_secs(3600),
            exported: true,
            ..Limits::default()
        };
        let s = SqliteStore::open(&path, limits, StoreMetrics::default());
        assert_eq!(s.export_cursor(), 2);
        s.record(fact("r", "young")).await.unwrap();
        let seqs: Vec<u64> = all(&s).await.iter().map(|f| f.seq).collect();
        assert_eq!(seqs, [3, 4, 5], "old facts 3 and 4 are not exported yet: kept");
    }
}
