//! Live runs' records (so runs survive a restart; a record holds the
//! SHA-256 of the run's secret, never the secret): the statements of their
//! writes, which the writer commits in its batches, the ids of the runs
//! kept, and the records' load at start.

use super::schema::open;
use super::RunReply;
use crate::facts::FactError;
use crate::runs::{RunRecord, RunWrite};
use rusqlite::{params, Connection};
use std::collections::HashSet;
use std::path::Path;

/// The ids of the run records in the store.
pub(super) fn run_ids(c: &Connection) -> rusqlite::Result<HashSet<String>> {
    let mut stmt = c.prepare("SELECT id FROM runs")?;
    let ids = stmt.query_map([], |r| r.get(0))?.collect();
    ids
}

/// The run records kept in the store at `path` (an unreadable one is
/// skipped, with a warning).
pub(super) fn load(path: &Path) -> Result<Vec<RunRecord>, FactError> {
    let c = open(path).map_err(|e| FactError::Unavailable(e.to_string()))?;
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

/// Writes a batch's run record writes in one transaction on `c`.
pub(super) fn write_runs(c: &mut Connection, runs: &[(RunWrite, Option<RunReply>)]) -> rusqlite::Result<()> {
    let tx = c.transaction()?;
    {
        let mut save = tx.prepare_cached("INSERT OR REPLACE INTO runs (id, body) VALUES (?1, ?2)")?;
        let mut update = tx.prepare_cached("UPDATE runs SET body = ?2 WHERE id = ?1")?;
        let mut delete = tx.prepare_cached("DELETE FROM runs WHERE id = ?1")?;
        for (w, _) in runs {
            match w {
                RunWrite::Save(rec) => {
                    let body =
                        serde_json::to_string(rec).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
                    save.execute(params![rec.id, body])?;
                }
                RunWrite::Update(rec) => {
                    let body =
                        serde_json::to_string(rec).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::store::testing::*;

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
            // Its first poll queues the fact; its answer is not awaited (on a
            // loaded machine the writer may even have committed it by then).
            let _ = s.record(fact(&run, "b.example")).now_or_never();
            assert!(s.forget_run(run.clone()).await.unwrap(), "iteration {i}: it has a fact");
            assert_eq!(
                query(&s, Some(&run), 0, 10).await.len(),
                1,
                "iteration {i}: the deletion returned before the fact queued ahead of it was committed"
            );
        }
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
}
