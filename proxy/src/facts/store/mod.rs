//! The embedded durable store of facts and of live runs' records: SQLite
//! in WAL mode with `synchronous = FULL`, so a fact is on disk when its
//! commit returns. Here is its face, [`SqliteStore`]; the one [`writer`]
//! thread commits in groups, [`reader`] answers queries, [`retention`]
//! keeps the budget, [`runs`] the run records, [`schema`] the tables.

pub mod dump;
pub(crate) mod links;
mod reader;
mod retention;
mod runs;
mod schema;
#[cfg(test)]
mod testing;
mod writer;

use crate::facts::chain::Signer;
use crate::facts::{Fact, FactError, FactQuery, FactSink, Recorded};
use crate::metrics::StoreMetrics;
use crate::runs::{RunRecord, RunWrite};
use futures_util::future::BoxFuture;
use rusqlite::{params, Connection};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};
use writer::{next_seq, open_for_writing, Writer};

/// The store's schema version (`PRAGMA user_version`): 0 before epochs, 2
/// with `store_info` (the epoch) and the export cursor, 3 with `bound` in
/// every run record, 4 with the hash chain (`chain` columns, anchors,
/// checkpoints).
pub const STORE_VERSION: i64 = 4;

/// Pending denials the writer may hold at once (senders wait beyond it).
pub const QUEUE: usize = 4096;

/// The `meta` key of the indexing watermark.
const INDEXED_UPTO: &str = "run_facts_upto";

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
    /// The cursors (`meta` keys) of the audit sinks' facts: retention never
    /// deletes a fact above the lowest (an absent one is 0).
    pub sink_cursors: Vec<String>,
    /// The same sinks' cursors over the signed checkpoints: retention
    /// deletes no checkpoint above the lowest.
    pub checkpoint_cursors: Vec<String>,
    /// Signed checkpoints of the chains (`[audit] signing_key_file`); none:
    /// the chains are kept, unsigned.
    pub checkpoints: Option<CheckpointPolicy>,
}

/// When and with what key the writer signs checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    pub key: Arc<Signer>,
    /// At least this often while records are written.
    pub every: Duration,
    /// After this many facts (at most once a second).
    pub records: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 1024 * 1024 * 1024,
            retention: Duration::from_secs(30 * 24 * 3600),
            cell: None,
            exported: false,
            others: Arc::default(),
            sink_cursors: Vec::new(),
            checkpoint_cursors: Vec::new(),
            checkpoints: None,
        }
    }
}

/// How often a signing writer is woken when idle.
fn limits_every(l: &Limits) -> Option<Duration> {
    l.checkpoints.as_ref().map(|c| c.every.max(Duration::from_millis(100)))
}

/// Wakes the writer every `every` while the store is open (a weak handle:
/// the ticker never keeps the store open), so that records written just
/// before a quiet spell are signed within `every`.
fn tick(tx: mpsc::WeakSender<Pending>, every: Duration) {
    let spawned = std::thread::Builder::new()
        .name("egress-facts-tick".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            let Some(tx) = tx.upgrade() else { return };
            // A full queue wakes the writer anyway.
            let _ = tx.try_send(Pending::Tick);
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the checkpoint ticker; checkpoints follow commits only");
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
    /// Wakes the writer to sign a checkpoint if one is due.
    Tick,
    /// Moves a cursor (the export cursor or a sink's `meta` key; never back).
    Cursor {
        key: String,
        seq: u64,
        reply: oneshot::Sender<Result<(), FactError>>,
    },
}

fn writer_stopped() -> FactError {
    FactError::Unavailable("fact store writer stopped".into())
}

/// Where a waited-for run record write is answered.
type RunReply = oneshot::Sender<Result<RunWritten, FactError>>;

/// A run record written: for a deletion, whether the run may have facts.
#[derive(Clone, Copy)]
struct RunWritten {
    pub(super) may_have_facts: bool,
}

/// What the store knows about itself, shared by its handle and its writer.
#[derive(Default)]
struct Identity {
    /// The store file's epoch (a new one if the file is replaced and reopened).
    pub(super) epoch: Mutex<String>,
    /// The newest committed fact's seq.
    pub(super) head: AtomicU64,
    /// The export cursor as last written.
    pub(super) cursor: AtomicU64,
    /// The audit sinks' cursors (`sink:*` keys of `meta`) as last written.
    pub(super) named: Mutex<HashMap<String, u64>>,
    /// The newest signed checkpoint (a signed note).
    pub(super) checkpoint: Mutex<Option<Arc<str>>>,
    /// The newest kept checkpoint's `seq` in its table.
    pub(super) checkpoint_seq: AtomicU64,
}

impl Identity {
    /// A sink's cursor as last written (0 when it has none).
    pub(super) fn named(&self, key: &str) -> u64 {
        self.named.lock().ok().and_then(|n| n.get(key).copied()).unwrap_or(0)
    }

    pub(super) fn epoch(&self) -> String {
        self.epoch.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Reads the epoch, head and cursor of a freshly opened store.
    pub(super) fn load(&self, c: &Connection) -> rusqlite::Result<()> {
        let epoch: String = c.query_row("SELECT value FROM store_info WHERE key = 'epoch'", [], |r| r.get(0))?;
        let head = next_seq(c)? - 1;
        let cursor: i64 = c.query_row(
            "SELECT COALESCE((SELECT value FROM meta WHERE key = ?1), 0)",
            params![EXPORT_CURSOR],
            |r| r.get(0),
        )?;
        let named = {
            let mut s = c.prepare("SELECT key, value FROM meta WHERE key LIKE 'sink:%'")?;
            let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()?
        };
        if let Ok(mut n) = self.named.lock() {
            for (k, v) in named {
                let v = v.max(0) as u64;
                let e = n.entry(k).or_insert(v);
                *e = (*e).max(v);
            }
        }
        if let Ok(mut e) = self.epoch.lock() {
            *e = epoch;
        }
        let newest = links::latest_checkpoint(c)?;
        self.checkpoint_seq
            .store(newest.as_ref().map_or(0, |(seq, _)| *seq), Ordering::Release);
        if let Ok(mut last) = self.checkpoint.lock() {
            *last = newest.map(|(_, note)| Arc::from(note));
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
        let reader = first.as_ref().ok().and_then(|_| schema::open(path).ok());
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
            chain: [0; 32],
            checkpointed: None,
        };
        let every = limits_every(&writer.limits);
        let spawned = std::thread::Builder::new()
            .name("egress-facts".into())
            .spawn(move || writer.run(rx));
        if let Some(every) = every {
            tick(tx.downgrade(), every);
        }
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
}

impl FactSink for SqliteStore {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(self.ask(|reply| Pending::Fact { fact, reply }))
    }

    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        let (cell, epoch) = (self.cell.clone(), self.identity.epoch());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || reader::read(&reader, &path, &q, (&cell, &epoch)))
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

    fn checkpoint(&self) -> Option<Arc<str>> {
        self.identity.checkpoint.lock().ok()?.clone()
    }

    fn query_stored(
        &self,
        after: u64,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<crate::facts::StoredFact>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        let (cell, epoch) = (self.cell.clone(), self.identity.epoch());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || reader::read_stored(&reader, &path, after, limit, (&cell, &epoch)))
                .await
                .map_err(|e| FactError::Unavailable(e.to_string()))?
        })
    }

    fn chained(
        &self,
        kind: crate::facts::chain::Kind,
        from: u64,
        to: u64,
    ) -> BoxFuture<'_, Result<Vec<crate::facts::Chained>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || reader::chained(&reader, &path, kind, (from, to)))
                .await
                .map_err(|e| FactError::Unavailable(e.to_string()))?
        })
    }

    fn checkpoint_head(&self) -> u64 {
        self.identity.checkpoint_seq.load(Ordering::Acquire)
    }

    fn checkpoints(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<(u64, String)>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || reader::checkpoints(&reader, &path, after, limit))
                .await
                .map_err(|e| FactError::Unavailable(e.to_string()))?
        })
    }

    fn export_cursor(&self) -> u64 {
        self.identity.cursor.load(Ordering::Acquire)
    }

    fn set_export_cursor(&self, seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        let key = EXPORT_CURSOR.to_owned();
        Box::pin(self.ask(move |reply| Pending::Cursor { key, seq, reply }))
    }

    fn cursor(&self, key: &str) -> u64 {
        self.identity.named(key)
    }

    fn set_cursor(&self, key: &str, seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        let key = key.to_owned();
        Box::pin(self.ask(move |reply| Pending::Cursor { key, seq, reply }))
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
        runs::load(&self.path)
    }
}
