//! Reading a store file from outside the proxy (`egress-proxy facts
//! export`): every fact, or every decision record, after a cursor, oldest
//! first, on a read-only connection (the proxy may be running and writing).
//! Facts written before the store had an epoch are stamped with it, as the
//! proxy's own reader does.

use crate::facts::decisions::Decision;
use crate::facts::Fact;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use std::path::Path;

/// Records read per query.
const PAGE: i64 = 1000;

/// Which records to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Records {
    Facts,
    Decisions,
}

/// One record of the store.
pub enum Record {
    Fact(Box<Fact>),
    Decision(Box<Decision>),
}

/// Calls `each` with every record of kind `what` in the store at `path`
/// whose seq is above `after`, oldest first; stops at `each`'s first error.
/// The number of records read.
pub fn dump(
    path: &Path,
    what: Records,
    after: u64,
    each: &mut dyn FnMut(Record) -> std::io::Result<()>,
) -> Result<u64, String> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    c.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let not_a_store = |e: rusqlite::Error| format!("{}: not a fact store? {e}", path.display());
    // A store made before epochs has no store_info: its facts carry none.
    let epoch: Option<String> = c
        .query_row("SELECT value FROM store_info WHERE key = 'epoch'", [], |r| r.get(0))
        .optional()
        .unwrap_or(None);
    let sql = match what {
        Records::Facts => "SELECT seq, body FROM facts WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        Records::Decisions => "SELECT seq, body FROM decisions WHERE seq > ?1 ORDER BY seq LIMIT ?2",
    };
    let mut stmt = c.prepare(sql).map_err(not_a_store)?;
    let mut cursor = i64::try_from(after).unwrap_or(i64::MAX);
    let mut n = 0;
    loop {
        let rows: Vec<(i64, String)> = stmt
            .query_map(params![cursor, PAGE], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let Some(last) = rows.last() else { break };
        cursor = last.0;
        for (seq, body) in rows {
            let record = match what {
                Records::Facts => {
                    let mut f: Fact =
                        serde_json::from_str(&body).map_err(|e| format!("fact {seq} is not a fact: {e}"))?;
                    if f.epoch.is_none() {
                        f.epoch.clone_from(&epoch);
                    }
                    Record::Fact(Box::new(f))
                }
                Records::Decisions => {
                    let mut d: Decision = serde_json::from_str(&body)
                        .map_err(|e| format!("decision {seq} is not a decision record: {e}"))?;
                    // The body's seq is the row's (assigned on insert).
                    d.seq = u64::try_from(seq).unwrap_or_default();
                    Record::Decision(Box::new(d))
                }
            };
            each(record).map_err(|e| e.to_string())?;
            n += 1;
        }
    }
    Ok(n)
}
