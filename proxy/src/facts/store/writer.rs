//! The one writer thread and its group-commit path, in one place: it takes
//! every pending denial (bounded queue), folds identical ones of the batch
//! into one fact with a `count`, writes them in one transaction and only
//! then answers; run records and the export cursor ride the same batches.

use super::links::{self, cell_name};
use super::retention::{self, PRUNE_EVERY};
use super::runs::{self, run_ids};
use super::schema::open;
use super::{Identity, Limits, Pending, RunReply, RunWritten, EXPORT_CURSOR, INDEXED_UPTO, QUEUE};
use crate::facts::chain::{self, Checkpoint, Head, Kind};
use crate::facts::{Fact, FactError, Recorded};
use crate::metrics::StoreMetrics;
use crate::runs::RunWrite;
use rusqlite::{params, Connection};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{broadcast, mpsc, oneshot};

/// How long committed facts may wait to be indexed by run (see
/// [`Writer`]); queries scan them meanwhile.
pub(super) const INDEX_EVERY: Duration = Duration::from_millis(100);

/// Facts waiting to be indexed by run beyond which they are indexed at once.
const INDEX_TAIL: usize = 4096;

/// Now, in Unix seconds.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The shortest time between two checkpoints signed for their record count.
const CHECKPOINT_FLOOR: Duration = Duration::from_secs(1);

/// Run record writes held for company at most; more are committed at once.
const MAX_HELD: usize = 256;

pub(super) fn next_seq(c: &Connection) -> rusqlite::Result<u64> {
    c.query_row("SELECT COALESCE(MAX(seq), 0) FROM facts", [], |r| r.get::<_, i64>(0))
        .map(|v| v as u64 + 1)
}

/// Opens the store for writing: [`open`], then [`catch_up`].
pub(super) fn open_for_writing(path: &Path) -> rusqlite::Result<Connection> {
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

/// The writer thread does group commit: it takes every pending denial (bounded
/// queue), folds identical ones of the batch into one fact with a `count`,
/// writes them in one transaction, and only then answers the waiting
/// requests. A flood therefore costs one commit per batch, however large,
/// and other runs' denials wait at most about two commits behind it. If the
/// store cannot be written the batch fails, `ready()` turns false and the
/// requests fail closed; the writer reopens the database on the next batch.
///
/// A run's facts are found through `run_facts` (run, seq), which the writer
/// keeps up to date behind the facts, not in their commit: every fact of
/// one run shares that table's pages, so indexing each commit's facts at
/// once wrote one page per run the batch touched (in a flood from 32 runs,
/// 10 of the 16 pages a commit wrote). The writer indexes what it committed
/// after a commit once [`INDEX_EVERY`] has passed since it last did (or
/// [`INDEX_TAIL`] facts wait), and when the store closes, in one
/// transaction with the watermark `run_facts_upto` (every fact up to it is
/// indexed); a query by run reads the index up to the watermark and scans
/// the facts after it, in one statement, so it sees every committed fact.
/// A crash between the two loses nothing: the writer indexes the facts
/// above the watermark when it opens the store.
pub(super) struct Writer {
    pub(super) path: PathBuf,
    pub(super) conn: Option<Connection>,
    pub(super) next: u64,
    pub(super) ready: Arc<AtomicBool>,
    pub(super) live: broadcast::Sender<Fact>,
    pub(super) limits: Limits,
    pub(super) metrics: StoreMetrics,
    /// Bytes in use after the last write or prune.
    pub(super) used: u64,
    pub(super) pruned_at: Option<Instant>,
    /// Committed facts of runs not yet in `run_facts`: (run, seq).
    pub(super) unindexed: Vec<(String, u64)>,
    pub(super) indexed_at: Instant,
    pub(super) identity: Arc<Identity>,
    /// Runs whose record this writer made, each with whether one of its
    /// facts was committed since: a run's end skips reading its facts when
    /// it has none. An entry lives from the run's record to its deletion.
    pub(super) runs_seen: HashMap<String, bool>,
    /// Runs whose record was in the store when it was opened (their facts
    /// are unknown), or `None` if the store was not readable then (every
    /// run's are).
    pub(super) runs_before: Option<HashSet<String>>,
    /// Run record writes queued by `save_run_soon`, not yet committed.
    pub(super) held: Vec<RunWrite>,
    /// The facts' chain at the newest committed fact (what the next links to).
    pub(super) chain: Head,
    /// The last signed checkpoint: when, and the facts' and decision
    /// records' sizes it covered.
    pub(super) checkpointed: Option<(Instant, u64, u64)>,
}

impl Writer {
    pub(super) fn run(mut self, mut rx: mpsc::Receiver<Pending>) {
        if let Some(c) = &self.conn {
            match next_seq(c).and_then(|n| Ok((n, self.resume_chain(c)?))) {
                Ok((n, chain)) => (self.next, self.chain) = (n, chain),
                Err(_) => self.conn = None,
            }
        }
        if self.conn.is_some() {
            self.prune();
        }
        self.runs_before = self.conn.as_ref().and_then(|c| run_ids(c).ok());
        // What was found at open is signed at once (a witness may take it).
        self.checkpoint(false);
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
            if self.checkpoint_due() {
                self.checkpoint(false);
            }
        }
        // Closing: what is held is committed now, and signed.
        self.commit(&mut vec![Pending::Flush]);
        self.index();
        self.checkpoint(true);
    }

    /// Where the facts' chain goes on in the store `c`.
    fn resume_chain(&self, c: &Connection) -> rusqlite::Result<Head> {
        let cell = cell_name(self.limits.cell.as_deref());
        links::resume(c, Kind::Facts, cell, &self.identity.epoch(), true).map(|(_, h)| h)
    }

    /// Whether a checkpoint is to be signed now: never without a key; the
    /// first at once; then every `checkpoint_every`, or after
    /// `checkpoint_records` facts but at most once per [`CHECKPOINT_FLOOR`].
    fn checkpoint_due(&self) -> bool {
        let Some(policy) = &self.limits.checkpoints else {
            return false;
        };
        let Some((at, size, _)) = self.checkpointed else {
            return true;
        };
        let since = at.elapsed();
        since >= policy.every
            || (since >= CHECKPOINT_FLOOR && self.next.saturating_sub(1).saturating_sub(size) >= policy.records)
    }

    /// Signs and keeps a checkpoint of both chains as committed now (unless
    /// nothing was committed since the last one and the writer is not
    /// closing). A failure is logged: the chain itself is on disk anyway.
    pub(super) fn checkpoint(&mut self, closed: bool) {
        let Some(policy) = self.limits.checkpoints.clone() else {
            return;
        };
        let Some(c) = self.conn.as_ref() else { return };
        let epoch = self.identity.epoch();
        let cell = cell_name(self.limits.cell.as_deref()).to_owned();
        // The decision log's table appears with its first record.
        let decisions = links::resume(c, Kind::Decisions, &cell, &epoch, false)
            .unwrap_or_else(|_| (0, chain::genesis(Kind::Decisions, &cell, &epoch)));
        let size = self.next.saturating_sub(1);
        if !closed && self.checkpointed.is_some_and(|(_, s, d)| (s, d) == (size, decisions.0)) {
            // Nothing new: the last checkpoint still covers every record.
            self.checkpointed = Some((Instant::now(), size, decisions.0));
            self.metrics.signed_through.set(unix_now());
            return;
        }
        let cp = Checkpoint {
            cell,
            epoch,
            size,
            head: self.chain,
            decisions,
            time: crate::time::rfc3339(SystemTime::now()),
            closed,
        };
        let note = cp.sign(&policy.key);
        match links::save_checkpoint(c, &cp, &note) {
            Ok(seq) => {
                self.identity.checkpoint_seq.store(seq, Ordering::Release);
                self.checkpointed = Some((Instant::now(), size, cp.decisions.0));
                self.metrics.checkpoints.inc();
                self.metrics.signed_through.set(unix_now());
                if let Ok(mut last) = self.identity.checkpoint.lock() {
                    *last = Some(note.into());
                }
            }
            Err(e) => tracing::warn!(error = %e, "a checkpoint could not be kept; the next commit tries again"),
        }
    }

    /// Writes the committed facts' `run_facts` rows and the watermark.
    pub(super) fn index(&mut self) {
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

    pub(super) fn commit(&mut self, batch: &mut Vec<Pending>) {
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
                Pending::Tick => continue,
                Pending::Cursor { key, seq, reply } => {
                    cursors.push((key, seq, reply));
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
        // Each key's highest, in one write each.
        let mut highest: HashMap<String, u64> = HashMap::new();
        for (key, seq, _) in &cursors {
            let e = highest.entry(key.clone()).or_insert(*seq);
            *e = (*e).max(*seq);
        }
        let mut written = HashMap::new();
        for (key, upto) in highest {
            let r = self
                .write_cursor(&key, upto)
                .map_err(|e| FactError::Unavailable(e.to_string()));
            if let Err(e) = &r {
                tracing::warn!(error = %e, key, "a cursor could not be written");
                self.conn = None;
            }
            written.insert(key, r);
        }
        for (key, _, reply) in cursors {
            let r = written
                .get(&key)
                .cloned()
                .unwrap_or_else(|| Err(super::writer_stopped()));
            let _ = reply.send(r);
        }
    }

    /// Writes one batch's facts (folded into `groups`) and answers them.
    pub(super) fn commit_facts(&mut self, mut groups: Vec<Group>) {
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

    pub(super) fn reopen(&mut self) -> rusqlite::Result<()> {
        let c = open_for_writing(&self.path)?;
        self.unindexed.clear();
        self.identity.load(&c)?;
        self.next = next_seq(&c)?;
        self.chain = self.resume_chain(&c)?;
        self.conn = Some(c);
        Ok(())
    }

    /// Moves the cursor `key` (the export cursor or a sink's) up to `upto`
    /// (never back).
    pub(super) fn write_cursor(&mut self, key: &str, upto: u64) -> rusqlite::Result<()> {
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
        .execute(params![key, upto as i64])?;
        if key == EXPORT_CURSOR {
            self.identity.cursor.fetch_max(upto, Ordering::AcqRel);
        } else if let Ok(mut n) = self.identity.named.lock() {
            let e = n.entry(key.to_owned()).or_insert(upto);
            *e = (*e).max(upto);
        }
        Ok(())
    }

    pub(super) fn write(&mut self, groups: &mut [Group]) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            self.reopen()?;
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        let tx = c.transaction()?;
        let mut seq = self.next;
        let mut head = self.chain;
        let epoch = self.identity.epoch();
        {
            let mut ins =
                tx.prepare_cached("INSERT INTO facts (seq, id, run_id, body, chain) VALUES (?1, ?2, ?3, ?4, ?5)")?;
            for (fact, _) in groups.iter_mut() {
                fact.seq = seq;
                fact.cell.clone_from(&self.limits.cell);
                fact.epoch = Some(epoch.clone());
                let body =
                    serde_json::to_string(fact).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                head = chain::link(Kind::Facts, &head, seq, body.as_bytes());
                ins.execute(params![seq as i64, fact.id, fact.run_id, body, &head[..]])?;
                seq += 1;
            }
        }
        tx.commit()?;
        self.next = seq;
        self.chain = head;
        self.identity.head.store(seq - 1, Ordering::Release);
        let runs = groups.iter().filter_map(|(f, _)| Some((f.run_id.clone()?, f.seq)));
        self.unindexed.extend(runs);
        Ok(())
    }

    /// Updates `used` and its gauge from the database.
    pub(super) fn measure(&mut self) {
        if let Some(Ok(used)) = self.conn.as_ref().map(retention::used_bytes) {
            let used = used.saturating_sub(self.limits.others.load(Ordering::Acquire));
            self.used = used;
            self.metrics.bytes.set(used as i64);
        }
    }

    /// Deletes facts older than the retention age, then measures.
    pub(super) fn prune(&mut self) {
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
        let upto = upto.min(retention::floor(&self.identity, &self.limits.sink_cursors));
        if let Some(c) = &self.conn {
            match retention::prune_before(c, &cutoff, upto) {
                Ok(0) => {}
                Ok(n) => {
                    self.metrics.pruned.inc_by(n);
                    tracing::info!(deleted = n, before = %cutoff, "pruned facts older than the retention age");
                }
                Err(e) => tracing::warn!(error = %e, "pruning old facts failed"),
            }
            let sent = retention::floor(&self.identity, &self.limits.checkpoint_cursors);
            if let Err(e) = links::prune_checkpoints(c, &cutoff, sent) {
                tracing::warn!(error = %e, "pruning old checkpoints failed");
            }
        }
        self.measure();
    }

    /// Keeps `runs_seen` in step with a committed run record write; for a
    /// deletion, says whether the run may have facts.
    pub(super) fn note_run(&mut self, write: &RunWrite) -> RunWritten {
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

    /// Writes a batch's run record writes, reopening the store if needed.
    pub(super) fn write_runs(&mut self, runs: &[(RunWrite, Option<RunReply>)]) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            self.reopen()?;
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        runs::write_runs(c, runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::store::testing::*;

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
}
