//! The embedded durable fact store: SQLite in WAL mode with
//! `synchronous = FULL`, so a fact is on disk when its commit returns. One
//! writer thread does group commit: it takes every pending denial (bounded
//! queue), folds identical ones of the batch into one fact with a `count`,
//! writes them in one transaction, and only then answers the waiting
//! requests. A flood therefore costs one commit per batch, however large,
//! and other runs' denials wait at most about two commits behind it. If the
//! store cannot be written the batch fails, `ready()` turns false and the
//! requests fail closed; the writer reopens the database on the next batch.

use crate::facts::{Fact, FactError, FactQuery, FactSink};
use futures_util::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use rusqlite::{params, Connection, OpenFlags};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc, oneshot};

/// Pending denials the writer may hold at once (senders wait beyond it).
pub const QUEUE: usize = 4096;

struct Pending {
    fact: Fact,
    reply: oneshot::Sender<Result<u64, FactError>>,
}

/// The SQLite fact store.
pub struct SqliteStore {
    tx: mpsc::Sender<Pending>,
    reader: Arc<Mutex<Option<Connection>>>,
    path: PathBuf,
    ready: Arc<AtomicBool>,
    live: broadcast::Sender<Fact>,
}

fn open(path: &Path) -> rusqlite::Result<Connection> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            let _ = std::fs::create_dir_all(dir);
        }
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
         CREATE INDEX IF NOT EXISTS facts_by_run ON facts(run_id, seq);",
    )?;
    // Fail now, not on the first denial, if the file is not a usable database.
    c.query_row("SELECT count(*) FROM facts", [], |r| r.get::<_, i64>(0))?;
    Ok(c)
}

fn next_seq(c: &Connection) -> rusqlite::Result<u64> {
    c.query_row("SELECT COALESCE(MAX(seq), 0) FROM facts", [], |r| r.get::<_, i64>(0))
        .map(|v| v as u64 + 1)
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
type Group = (Fact, Vec<oneshot::Sender<Result<u64, FactError>>>);

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

impl SqliteStore {
    /// Opens (or creates) the store and starts its writer thread. A store that
    /// cannot be opened still starts, unready: denials fail closed until it can.
    pub fn open(path: &Path, coalesced: Counter) -> SqliteStore {
        let (tx, rx) = mpsc::channel(QUEUE);
        let ready = Arc::new(AtomicBool::new(false));
        let (live, _) = broadcast::channel(4096);
        let first = open(path);
        if let Err(e) = &first {
            tracing::error!(path = %path.display(), error = %e, "fact store cannot be opened; denials will fail closed until it can");
        }
        ready.store(first.is_ok(), Ordering::Release);
        let reader = first.as_ref().ok().and_then(|_| open(path).ok());
        let writer = Writer {
            path: path.to_owned(),
            conn: first.ok(),
            next: 0,
            ready: ready.clone(),
            live: live.clone(),
            coalesced,
        };
        let spawned = std::thread::Builder::new()
            .name("egress-facts".into())
            .spawn(move || writer.run(rx));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the fact writer thread");
            ready.store(false, Ordering::Release);
        }
        SqliteStore {
            tx,
            reader: Arc::new(Mutex::new(reader)),
            path: path.to_owned(),
            ready,
            live,
        }
    }

    fn read(reader: &Mutex<Option<Connection>>, path: &Path, q: &FactQuery) -> Result<Vec<Fact>, FactError> {
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
                .prepare_cached("SELECT body FROM facts WHERE run_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3")
                .and_then(|mut s| {
                    s.query_map(params![run, q.after as i64, limit], |r| r.get(0))?
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
            .map(|b| serde_json::from_str(b).map_err(|e| FactError::Unavailable(format!("corrupt fact: {e}"))))
            .collect()
    }
}

impl FactSink for SqliteStore {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<u64, FactError>> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.tx
                .send(Pending { fact, reply })
                .await
                .map_err(|_| FactError::Unavailable("fact writer stopped".into()))?;
            rx.await
                .map_err(|_| FactError::Unavailable("fact writer stopped".into()))?
        })
    }

    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        let (reader, path) = (self.reader.clone(), self.path.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || SqliteStore::read(&reader, &path, &q))
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
}

struct Writer {
    path: PathBuf,
    conn: Option<Connection>,
    next: u64,
    ready: Arc<AtomicBool>,
    live: broadcast::Sender<Fact>,
    coalesced: Counter,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Pending>) {
        if let Some(c) = &self.conn {
            match next_seq(c) {
                Ok(n) => self.next = n,
                Err(_) => self.conn = None,
            }
        }
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
        }
    }

    fn commit(&mut self, batch: &mut Vec<Pending>) {
        // Fold identical denials of this batch into one fact with a count.
        let mut groups: Vec<Group> = Vec::new();
        let mut index = HashMap::new();
        for p in batch.drain(..) {
            let key = fold_key(&p.fact);
            match index.get(&key) {
                Some(&i) => {
                    let g: &mut Group = &mut groups[i];
                    g.0.count += p.fact.count;
                    g.1.push(p.reply);
                }
                None => {
                    index.insert(key, groups.len());
                    groups.push((p.fact, vec![p.reply]));
                }
            }
        }
        let folded: usize = groups.iter().map(|g| g.1.len() - 1).sum();
        match self.write(&mut groups) {
            Ok(()) => {
                self.ready.store(true, Ordering::Release);
                self.coalesced.inc_by(folded as u64);
                for (fact, replies) in groups {
                    for r in replies {
                        let _ = r.send(Ok(fact.seq));
                    }
                    let _ = self.live.send(fact);
                }
            }
            Err(e) => {
                self.ready.store(false, Ordering::Release);
                self.conn = None;
                tracing::error!(path = %self.path.display(), error = %e, "fact store write failed");
                let msg = e.to_string();
                for (_, replies) in groups {
                    for r in replies {
                        let _ = r.send(Err(FactError::Unavailable(msg.clone())));
                    }
                }
            }
        }
    }

    fn write(&mut self, groups: &mut [Group]) -> rusqlite::Result<()> {
        if self.conn.is_none() {
            let c = open(&self.path)?;
            self.next = next_seq(&c)?;
            self.conn = Some(c);
        }
        let Some(c) = self.conn.as_mut() else {
            return Err(rusqlite::Error::InvalidQuery);
        };
        let tx = c.transaction()?;
        let mut seq = self.next;
        {
            let mut ins = tx.prepare_cached("INSERT INTO facts (seq, id, run_id, body) VALUES (?1, ?2, ?3, ?4)")?;
            for (fact, _) in groups.iter_mut() {
                fact.seq = seq;
                let body =
                    serde_json::to_string(fact).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                ins.execute(params![seq as i64, fact.id, fact.run_id, body])?;
                seq += 1;
            }
        }
        tx.commit()?;
        self.next = seq;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::FactTarget;

    fn fact(run: &str, host: &str) -> Fact {
        Fact::denial(
            Some(run),
            Some("t"),
            "not_allowlisted",
            "enforce",
            Some(FactTarget {
                kind: "connect".into(),
                host: host.into(),
                port: 443,
            }),
            vec![],
            "sha256:x",
            "d".into(),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn seq_is_gap_free_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Counter::default());
        assert!(s.ready());
        for i in 0..5 {
            assert_eq!(s.record(fact("r", &format!("h{i}"))).await.unwrap(), i + 1);
        }
        drop(s);
        let s = SqliteStore::open(&path, Counter::default());
        assert_eq!(s.record(fact("r", "again")).await.unwrap(), 6);
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
        let counter = Counter::default();
        let s = Arc::new(SqliteStore::open(&dir.path().join("f.db"), counter.clone()));
        let mut tasks = vec![];
        for _ in 0..2000 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.record(fact("flood", "evil.example")).await.unwrap()
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
    async fn a_corrupt_file_fails_closed_and_unready() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let s = SqliteStore::open(&path, Counter::default());
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
}
