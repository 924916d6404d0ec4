//! The store's side of the hash chain ([`crate::facts::chain`]): the
//! `chain` column of `facts` and `decisions`, the anchors where a chain
//! starts after the records below it were pruned or written before chains
//! (`chain_anchors`), and the signed checkpoints (`checkpoints`).
//!
//! A chain value is written in the same transaction as its record, by the
//! record's writer (the facts' one writer thread, the decision log's
//! writer), so a fact's chain is on disk before its 403. Retention deletes
//! only a prefix of a table, and moves the kind's anchor to the newest
//! deleted record's chain in the same transaction: the oldest kept record
//! links to the anchor.

use crate::facts::chain::{genesis, Checkpoint, Head, Kind};
use rusqlite::{params, Connection, OptionalExtension};

/// The table holding a kind's records.
pub(crate) fn table(kind: Kind) -> &'static str {
    match kind {
        Kind::Facts => "facts",
        Kind::Decisions => "decisions",
    }
}

/// The cell as chains and origins name it (`-` when the store has none).
pub(crate) fn cell_name(cell: Option<&str>) -> &str {
    cell.unwrap_or("-")
}

/// The store's epoch, drawn now if the file has none yet (by whichever
/// writer opens it first: the fact store, or the decision log).
pub(crate) fn epoch(c: &Connection) -> rusqlite::Result<String> {
    c.execute_batch("CREATE TABLE IF NOT EXISTS store_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);")?;
    c.execute(
        "INSERT OR IGNORE INTO store_info (key, value) VALUES ('epoch', ?1)",
        params![uuid::Uuid::new_v4().to_string()],
    )?;
    c.query_row("SELECT value FROM store_info WHERE key = 'epoch'", [], |r| r.get(0))
}

/// Creates the anchor and checkpoint tables.
pub(crate) fn create(c: &Connection) -> rusqlite::Result<()> {
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS chain_anchors (
            kind   TEXT PRIMARY KEY,
            seq    INTEGER NOT NULL,
            head   BLOB NOT NULL,
            reason TEXT NOT NULL,
            at     TEXT NOT NULL
         );
         CREATE TABLE IF NOT EXISTS checkpoints (
            seq       INTEGER PRIMARY KEY AUTOINCREMENT,
            epoch     TEXT NOT NULL,
            size      INTEGER NOT NULL,
            decisions INTEGER NOT NULL,
            at        TEXT NOT NULL,
            note      TEXT NOT NULL
         );",
    )
}

/// Adds the `chain` column to `table` if it has none (stores made before chains).
pub(crate) fn ensure_column(c: &Connection, table: &str) -> rusqlite::Result<()> {
    let has: bool = c.query_row(
        &format!("SELECT count(*) > 0 FROM pragma_table_info('{table}') WHERE name = 'chain'"),
        [],
        |r| r.get(0),
    )?;
    if !has {
        c.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN chain BLOB"))?;
    }
    Ok(())
}

fn head_of(b: Vec<u8>) -> Option<Head> {
    b.try_into().ok()
}

/// A kind's anchor: the seq below which records are not chained here (pruned,
/// or written before chains) and the chain the next record links to.
pub(crate) fn anchor(c: &Connection, kind: Kind) -> rusqlite::Result<Option<(u64, Head, String)>> {
    let row: Option<(i64, Vec<u8>, String)> = c
        .query_row(
            "SELECT seq, head, reason FROM chain_anchors WHERE kind = ?1",
            params![kind.name()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    Ok(row.and_then(|(s, h, why)| Some((s.max(0) as u64, head_of(h)?, why))))
}

fn set_anchor(c: &Connection, kind: Kind, seq: u64, head: &Head, reason: &str) -> rusqlite::Result<()> {
    c.prepare_cached(
        "INSERT INTO chain_anchors (kind, seq, head, reason, at) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (kind) DO UPDATE SET seq = excluded.seq, head = excluded.head, reason = excluded.reason, at = excluded.at",
    )?
    .execute(params![
        kind.name(),
        seq as i64,
        &head[..],
        reason,
        crate::time::rfc3339(std::time::SystemTime::now())
    ])?;
    Ok(())
}

/// Where a kind's chain goes on: the newest record's seq and chain. A
/// table whose newest record has no chain was written before chains: the
/// chain starts after it, and the anchor (reason `migrated`) says so, once
/// (with `mark`; a reader that may not write gets the same answer without
/// it). An empty table goes on from its anchor, or from genesis.
pub(crate) fn resume(c: &Connection, kind: Kind, cell: &str, epoch: &str, mark: bool) -> rusqlite::Result<(u64, Head)> {
    let g = genesis(kind, cell, epoch);
    let newest: Option<(i64, Option<Vec<u8>>)> = c
        .query_row(
            &format!("SELECT seq, chain FROM {} ORDER BY seq DESC LIMIT 1", table(kind)),
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let anchor = anchor(c, kind)?;
    Ok(match newest {
        None => anchor.map_or((0, g), |(s, h, _)| (s, h)),
        Some((seq, Some(h))) => (seq as u64, head_of(h).unwrap_or(g)),
        Some((seq, None)) => {
            let seq = seq as u64;
            match anchor {
                Some((s, h, _)) if s >= seq => (s, h),
                // Unchained records after the chain began: `facts verify`
                // names them; the chain goes on after them.
                Some(_) => (seq, g),
                None => {
                    if mark {
                        set_anchor(c, kind, seq, &g, "migrated")?;
                        tracing::info!(
                            kind = kind.name(),
                            upto = seq,
                            "records written before the hash chain; it starts after them"
                        );
                    }
                    (seq, g)
                }
            }
        }
    })
}

/// Called in the transaction that deletes a kind's records up to `upto`
/// (a prefix), before it does: moves the anchor to the chain of `upto`.
pub(crate) fn anchor_pruned(c: &Connection, kind: Kind, upto: u64) -> rusqlite::Result<()> {
    let at: Option<Option<Vec<u8>>> = c
        .query_row(
            &format!("SELECT chain FROM {} WHERE seq = ?1", table(kind)),
            params![upto as i64],
            |r| r.get(0),
        )
        .optional()?;
    let Some(head) = at.flatten().and_then(head_of) else {
        // Unchained records (from before chains) go below the anchor already.
        return Ok(());
    };
    if anchor(c, kind)?.is_some_and(|(s, _, _)| s >= upto) {
        return Ok(());
    }
    set_anchor(c, kind, upto, &head, "pruned")
}

/// `kind`'s records `from..=to` that have a chain value, by seq: the JSON
/// the value covers, and the value (none when the table does not exist
/// yet).
pub(crate) fn chained(c: &Connection, kind: Kind, from: u64, to: u64) -> rusqlite::Result<Vec<crate::facts::Chained>> {
    let exists: bool = c.query_row(
        "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
        params![table(kind)],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(Vec::new());
    }
    let mut s = c.prepare_cached(&format!(
        "SELECT seq, body, chain FROM {} WHERE seq >= ?1 AND seq <= ?2 AND chain IS NOT NULL ORDER BY seq",
        table(kind)
    ))?;
    let clamp = |v: u64| v.min(i64::MAX as u64) as i64;
    let rows = s.query_map(params![clamp(from), clamp(to)], |r| {
        Ok((
            r.get::<_, i64>(0)?.max(0) as u64,
            r.get::<_, String>(1)?,
            r.get::<_, Vec<u8>>(2)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (seq, body, chain) = row?;
        if let Ok(h) = chain.try_into() {
            out.push((seq, body, h));
        }
    }
    Ok(out)
}

/// Keeps a signed checkpoint; its `seq` in the table (the audit sinks'
/// order).
pub(crate) fn save_checkpoint(c: &Connection, cp: &Checkpoint, note: &str) -> rusqlite::Result<u64> {
    c.prepare_cached("INSERT INTO checkpoints (epoch, size, decisions, at, note) VALUES (?1, ?2, ?3, ?4, ?5)")?
        .execute(params![cp.epoch, cp.size as i64, cp.decisions.0 as i64, cp.time, note])?;
    Ok(c.last_insert_rowid().max(0) as u64)
}

/// The newest checkpoint kept, with its `seq`, if any.
pub(crate) fn latest_checkpoint(c: &Connection) -> rusqlite::Result<Option<(u64, String)>> {
    c.query_row("SELECT seq, note FROM checkpoints ORDER BY seq DESC LIMIT 1", [], |r| {
        Ok((r.get::<_, i64>(0)?.max(0) as u64, r.get(1)?))
    })
    .optional()
}

/// Up to `limit` checkpoints after `after`, oldest first: (seq, note).
pub(crate) fn checkpoints(c: &Connection, after: u64, limit: usize) -> rusqlite::Result<Vec<(u64, String)>> {
    let mut s = c.prepare_cached("SELECT seq, note FROM checkpoints WHERE seq > ?1 ORDER BY seq LIMIT ?2")?;
    let rows = s.query_map(
        params![after.min(i64::MAX as u64) as i64, limit.min(10_000) as i64],
        |r| Ok((r.get::<_, i64>(0)?.max(0) as u64, r.get(1)?)),
    )?;
    rows.collect()
}

/// Deletes checkpoints signed before `cutoff` (RFC 3339) and at most
/// `upto` (what every audit sink has sent), keeping the newest.
pub(crate) fn prune_checkpoints(c: &Connection, cutoff: &str, upto: i64) -> rusqlite::Result<usize> {
    c.execute(
        "DELETE FROM checkpoints WHERE at < ?1 AND seq <= ?2 AND seq < (SELECT MAX(seq) FROM checkpoints)",
        params![cutoff, upto],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_checkpoints_go_but_never_one_a_sink_has_not_sent_nor_the_newest() {
        let c = Connection::open_in_memory().unwrap();
        create(&c).unwrap();
        for at in [
            "2001-01-01T00:00:00.000Z",
            "2001-01-02T00:00:00.000Z",
            "2001-01-03T00:00:00.000Z",
        ] {
            c.execute(
                "INSERT INTO checkpoints (epoch, size, decisions, at, note) VALUES ('e', 1, 0, ?1, 'n')",
                [at],
            )
            .unwrap();
        }
        let kept =
            |c: &Connection| -> Vec<u64> { checkpoints(c, 0, 10).unwrap().into_iter().map(|(s, _)| s).collect() };
        // A sink has sent the first only: the second waits for it.
        assert_eq!(prune_checkpoints(&c, "2026-01-01T00:00:00.000Z", 1).unwrap(), 1);
        assert_eq!(kept(&c), [2, 3]);
        // Every sink has sent them all: the newest is still kept.
        assert_eq!(prune_checkpoints(&c, "2026-01-01T00:00:00.000Z", i64::MAX).unwrap(), 1);
        assert_eq!(kept(&c), [3]);
        assert_eq!(latest_checkpoint(&c).unwrap(), Some((3, "n".to_owned())));
    }
}
