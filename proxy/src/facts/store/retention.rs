//! The store's size budget and retention age: the bytes it holds and the
//! deletion of facts older than the retention age, oldest first (the writer
//! runs it at start, then at most once every [`PRUNE_EVERY`] while denials
//! are written; never a fact not yet exported). Younger facts are never
//! deleted: when they alone fill the budget, new denials fail closed.

use super::links;
use crate::facts::chain::Kind;
use rusqlite::{params, Connection};
use std::time::Duration;

/// How often, at most, old facts are looked for while denials are written.
pub(super) const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Facts deleted per statement when pruning (keeps each transaction short).
const PRUNE_CHUNK: i64 = 5000;

/// Bytes of the database that hold data (freed pages are reused first).
pub(super) fn used_bytes(c: &Connection) -> rusqlite::Result<u64> {
    let pages: i64 = c.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    let free: i64 = c.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
    let size: i64 = c.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(((pages - free).max(0) * size) as u64)
}

/// The lowest of the audit sinks' fact cursors `keys` (an absent one is 0;
/// no sink: no floor): retention deletes no fact above it.
pub(super) fn floor(identity: &super::Identity, keys: &[String]) -> i64 {
    keys.iter()
        .map(|k| identity.named(k).min(i64::MAX as u64) as i64)
        .min()
        .unwrap_or(i64::MAX)
}

/// Deletes facts recorded before `cutoff` (an RFC 3339 time in the facts'
/// own format, so strings compare as times) and at most `upto` (the export
/// cursor when facts are exported), oldest first; returns how many.
/// Only a prefix goes: deletion stops at the first fact younger than the
/// cutoff, so the chain's anchor (moved in the same transaction) is the
/// chain of the newest deleted fact and the oldest kept fact links to it.
/// The newest fact is always kept: `seq` continues from it after a restart.
pub(super) fn prune_before(c: &Connection, cutoff: &str, upto: i64) -> rusqlite::Result<u64> {
    let mut total = 0u64;
    loop {
        let end = old_prefix(c, cutoff, upto)?;
        let Some(end) = end else { return Ok(total) };
        let tx = c.unchecked_transaction()?;
        links::anchor_pruned(&tx, Kind::Facts, end as u64)?;
        tx.execute(
            "DELETE FROM run_facts WHERE (run_id, seq) IN (SELECT run_id, seq FROM facts WHERE seq <= ?1 AND run_id IS NOT NULL)",
            params![end],
        )?;
        let n = tx.execute("DELETE FROM facts WHERE seq <= ?1", params![end])?;
        tx.commit()?;
        total += n as u64;
        if n == 0 {
            return Ok(total);
        }
    }
}

/// The newest seq of the oldest facts (at most [`PRUNE_CHUNK`]) that are all
/// older than `cutoff`, at most `upto` and not the newest fact.
fn old_prefix(c: &Connection, cutoff: &str, upto: i64) -> rusqlite::Result<Option<i64>> {
    let mut stmt = c.prepare_cached(
        "SELECT seq, json_extract(body, '$.at') < ?2 FROM facts
         WHERE seq <= ?3 AND seq < (SELECT MAX(seq) FROM facts) ORDER BY seq LIMIT ?1",
    )?;
    let mut rows = stmt.query(params![PRUNE_CHUNK, cutoff, upto])?;
    let mut end = None;
    while let Some(r) = rows.next()? {
        let (seq, old): (i64, bool) = (r.get(0)?, r.get::<_, Option<bool>>(1)?.unwrap_or(false));
        if !old {
            break;
        }
        end = Some(seq);
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::store::testing::*;

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
        // Only a prefix goes (the chain's anchor is one seq): old3 and old4
        // came after young0 and wait for it to age.
        assert_eq!(hosts, ["young0", "old3", "old4", "young1", "young2", "young3"]);
        assert_eq!(
            raw(
                &path,
                "SELECT count(*) FROM run_facts WHERE seq NOT IN (SELECT seq FROM facts)"
            ),
            0,
            "an index row of a pruned fact is left"
        );
        assert_eq!(metrics.pruned.get(), 0, "old2 went at the previous start");
        drop(s);
        // Once young0 is old too, the whole old prefix goes.
        {
            let c = Connection::open(&path).unwrap();
            c.execute(
                "UPDATE facts SET body = json_set(body, '$.at', '2001-01-01T00:00:00.000Z') WHERE seq = 4",
                [],
            )
            .unwrap();
        }
        let metrics = StoreMetrics::default();
        let limits = Limits {
            retention: Duration::from_secs(3600),
            ..Limits::default()
        };
        let s = SqliteStore::open(&path, limits, metrics.clone());
        s.record(fact("r", "young4")).await.unwrap();
        let hosts: Vec<String> = all(&s).await.into_iter().map(|f| f.target.unwrap().host).collect();
        assert_eq!(hosts, ["young1", "young2", "young3", "young4"]);
        assert_eq!(metrics.pruned.get(), 3);
        assert!(metrics.bytes.get() > 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_at_its_budget_fails_closed_and_keeps_every_young_fact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let metrics = StoreMetrics::default();
        let limits = Limits {
            max_bytes: 96 * 1024,
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
        assert!(metrics.bytes.get() >= 96 * 1024);
        assert_eq!(metrics.budget.get(), 96 * 1024);
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retention_keeps_every_fact_an_audit_sink_has_not_exported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let s = SqliteStore::open(&path, Limits::default(), StoreMetrics::default());
        for i in 0..6 {
            let mut old = fact("r", &format!("old{i}"));
            old.at = "2001-01-01T00:00:00.000Z".into();
            s.record(old).await.unwrap();
        }
        s.set_cursor("sink:a:facts", 4).await.unwrap();
        s.set_cursor("sink:a:facts", 2).await.unwrap();
        assert_eq!(s.cursor("sink:a:facts"), 4, "a cursor never goes back");
        s.set_cursor("sink:b:facts", 2).await.unwrap();
        drop(s);
        let limits = |keys: &[&str]| Limits {
            retention: Duration::from_secs(3600),
            sink_cursors: keys.iter().map(|k| k.to_string()).collect(),
            ..Limits::default()
        };
        // Sink c has no cursor yet: nothing is pruned.
        let s = SqliteStore::open(
            &path,
            limits(&["sink:a:facts", "sink:c:facts"]),
            StoreMetrics::default(),
        );
        assert_eq!(s.cursor("sink:a:facts"), 4, "cursors survive a reopen");
        s.record(fact("r", "young")).await.unwrap();
        assert_eq!(all(&s).await.len(), 7);
        drop(s);
        // The lowest cursor (b's, 2) is the floor.
        let s = SqliteStore::open(
            &path,
            limits(&["sink:a:facts", "sink:b:facts"]),
            StoreMetrics::default(),
        );
        s.record(fact("r", "young")).await.unwrap();
        let seqs: Vec<u64> = all(&s).await.iter().map(|f| f.seq).collect();
        assert_eq!(seqs, [3, 4, 5, 6, 7, 8]);
    }
}
