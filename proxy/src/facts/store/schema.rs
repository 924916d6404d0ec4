//! The store's tables and their migrations: [`open`] makes the file
//! private, opens it in WAL mode with `synchronous = FULL`, creates what is
//! missing and fails at once on a file that is not a usable database;
//! [`migrate`] brings an earlier schema to [`STORE_VERSION`] in one transaction.

use super::STORE_VERSION;
use rusqlite::{params, Connection, OpenFlags};
use std::path::Path;

pub(super) fn open(path: &Path) -> rusqlite::Result<Connection> {
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
            body   TEXT NOT NULL,
            chain  BLOB
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
/// ([`bound_before_the_field`]); a store made before the hash chain
/// (below 4) gets the `chain` column and the anchor and checkpoint tables
/// (its facts stay unchained: the chain starts after them, see
/// [`super::links::resume`]).
pub(super) fn migrate(c: &Connection) -> rusqlite::Result<()> {
    let version: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version >= STORE_VERSION {
        return Ok(());
    }
    let tx = c.unchecked_transaction()?;
    super::links::epoch(&tx)?;
    let bound = mark_bound(&tx)?;
    super::links::ensure_column(&tx, "facts")?;
    super::links::create(&tx)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::store::testing::*;

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
}
