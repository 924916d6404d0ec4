//! Queries of the store, on a connection of their own beside the writer's:
//! by run through the `run_facts` index up to its watermark and a scan of
//! the facts after it, in one statement, so a query sees every committed
//! fact; facts written before the store had an epoch are stamped with it.

use super::schema::open;
use super::INDEXED_UPTO;
use crate::facts::{Fact, FactError, FactQuery, StoredFact};
use rusqlite::{params, Connection};
use std::path::Path;
use std::sync::Mutex;

/// The reader connection, opened on `path` if it is not (or was dropped
/// after a failed query).
fn connection<'a>(
    reader: &'a Mutex<Option<Connection>>,
    path: &Path,
) -> Result<std::sync::MutexGuard<'a, Option<Connection>>, FactError> {
    let mut guard = reader
        .lock()
        .map_err(|_| FactError::Unavailable("reader poisoned".into()))?;
    if guard.is_none() {
        *guard = Some(open(path).map_err(|e| FactError::Unavailable(e.to_string()))?);
    }
    Ok(guard)
}

/// Up to `limit` signed checkpoints after `after`, oldest first, read on
/// `reader` (opened on `path` if it is not): (seq, note).
pub(super) fn checkpoints(
    reader: &Mutex<Option<Connection>>,
    path: &Path,
    after: u64,
    limit: usize,
) -> Result<Vec<(u64, String)>, FactError> {
    let mut guard = connection(reader, path)?;
    let c = guard
        .as_ref()
        .ok_or_else(|| FactError::Unavailable("no reader".into()))?;
    super::links::checkpoints(c, after, limit).map_err(|e| {
        *guard = None;
        FactError::Unavailable(e.to_string())
    })
}

/// `kind`'s chained records `from..=to` (seq, stored JSON, chain value),
/// read on `reader`.
pub(super) fn chained(
    reader: &Mutex<Option<Connection>>,
    path: &Path,
    kind: crate::facts::chain::Kind,
    (from, to): (u64, u64),
) -> Result<Vec<crate::facts::Chained>, FactError> {
    let mut guard = connection(reader, path)?;
    let c = guard
        .as_ref()
        .ok_or_else(|| FactError::Unavailable("no reader".into()))?;
    super::links::chained(c, kind, from, to).map_err(|e| {
        *guard = None;
        FactError::Unavailable(e.to_string())
    })
}

/// The facts `q` asks for, read on `reader` (opened on `path` if it is
/// not), with `stamp` (cell, epoch) for facts made before epochs.
pub(super) fn read(
    reader: &Mutex<Option<Connection>>,
    path: &Path,
    q: &FactQuery,
    stamp: (&Option<String>, &str),
) -> Result<Vec<Fact>, FactError> {
    let mut guard = connection(reader, path)?;
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
    rows.iter().map(|b| parse(b, stamp)).collect()
}

/// A stored body as a fact, stamped with `stamp` (cell, epoch) when it was
/// written before the store had an epoch (migrated).
fn parse(body: &str, stamp: (&Option<String>, &str)) -> Result<Fact, FactError> {
    let mut f: Fact = serde_json::from_str(body).map_err(|e| FactError::Unavailable(format!("corrupt fact: {e}")))?;
    if f.epoch.is_none() {
        f.epoch = Some(stamp.1.to_owned());
        f.cell.clone_from(stamp.0);
    }
    Ok(f)
}

/// Up to `limit` facts after `after`, oldest first, each with its stored
/// JSON and its chain value (the fleet export copies both, so that the
/// fleet store can be verified record by record).
pub(super) fn read_stored(
    reader: &Mutex<Option<Connection>>,
    path: &Path,
    after: u64,
    limit: usize,
    stamp: (&Option<String>, &str),
) -> Result<Vec<StoredFact>, FactError> {
    let mut guard = connection(reader, path)?;
    let c = guard
        .as_ref()
        .ok_or_else(|| FactError::Unavailable("no reader".into()))?;
    let rows: rusqlite::Result<Vec<(String, Option<Vec<u8>>)>> = c
        .prepare_cached("SELECT body, chain FROM facts WHERE seq > ?1 ORDER BY seq LIMIT ?2")
        .and_then(|mut s| {
            s.query_map(
                params![after.min(i64::MAX as u64) as i64, limit.min(10_000) as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?
            .collect()
        });
    let rows = rows.map_err(|e| {
        *guard = None;
        FactError::Unavailable(e.to_string())
    })?;
    rows.into_iter()
        .map(|(body, chain)| {
            Ok(StoredFact {
                fact: parse(&body, stamp)?,
                body,
                chain: chain.and_then(|c| c.try_into().ok()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::facts::store::testing::*;
    use crate::facts::store::writer::INDEX_EVERY;

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
}
