//! Where [`Seen`] records come from: a proxy's store file, read-only (the
//! `policy` commands; the proxy may be running: its store is in WAL mode),
//! or a running proxy's fact sink and decision log (the control API). Both
//! read at most [`MAX_RECORDS`] facts and as many decision records.

use crate::facts::decisions::{self, DecisionQuery};
use crate::facts::{Fact, FactQuery};
use crate::learn::Seen;
use crate::state::Shared;
use rusqlite::{params, Connection, OpenFlags};
use std::path::Path;

/// The most facts, and the most decision records, one read takes.
pub const MAX_RECORDS: usize = 1_000_000;

const PAGE: usize = 5000;

/// Which records: one tool's or all, since a time or all.
#[derive(Debug, Clone, Default)]
pub struct Window {
    pub tool: Option<String>,
    /// RFC 3339: records at or after it.
    pub since: Option<String>,
}

impl Window {
    fn keeps_fact(&self, f: &Fact) -> bool {
        self.tool.as_deref().is_none_or(|t| f.tool.as_deref() == Some(t))
            && self.since.as_deref().is_none_or(|s| f.at.as_str() >= s)
    }
}

/// The records of a store file.
pub fn read_store(path: &Path, w: &Window) -> Result<Vec<Seen>, String> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    c.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let mut out = vec![];
    let mut after = 0i64;
    let mut read = 0;
    let mut stmt = c
        .prepare(
            "SELECT seq, body FROM facts WHERE seq > ?1 AND (?2 IS NULL OR json_extract(body, '$.tool') = ?2)
             ORDER BY seq LIMIT ?3",
        )
        .map_err(|e| format!("{}: not a fact store? {e}", path.display()))?;
    while read < MAX_RECORDS {
        let rows: Vec<(i64, String)> = stmt
            .query_map(params![after, w.tool, PAGE as i64], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(|e| e.to_string())?;
        let Some(last) = rows.last() else { break };
        after = last.0;
        read += rows.len();
        for (_, body) in rows {
            if let Ok(f) = serde_json::from_str::<Fact>(&body) {
                if w.keeps_fact(&f) {
                    out.extend(Seen::from_fact(&f));
                }
            }
        }
    }
    let mut q = DecisionQuery {
        after: 0,
        limit: PAGE,
        run_id: None,
        tool: w.tool.clone(),
        since: w.since.clone(),
    };
    let mut read = 0;
    while read < MAX_RECORDS {
        let page = decisions::query_sqlite(&c, &q).map_err(|e| e.to_string())?;
        let Some(last) = page.last() else { break };
        q.after = last.seq;
        read += page.len();
        out.extend(page.iter().map(Seen::from_decision));
    }
    Ok(out)
}

/// The records of a running proxy.
pub async fn read_live(sh: &Shared, w: &Window) -> Result<Vec<Seen>, String> {
    let mut out = vec![];
    let (mut after, mut read) = (0, 0);
    while read < MAX_RECORDS {
        let page = sh
            .facts
            .query(FactQuery {
                after,
                limit: PAGE,
                run_id: None,
            })
            .await
            .map_err(|e| e.to_string())?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        read += page.len();
        out.extend(page.iter().filter(|f| w.keeps_fact(f)).filter_map(Seen::from_fact));
    }
    let mut q = DecisionQuery {
        after: 0,
        limit: PAGE,
        run_id: None,
        tool: w.tool.clone(),
        since: w.since.clone(),
    };
    let mut read = 0;
    while read < MAX_RECORDS {
        let page = sh.decisions.query(q.clone()).await.map_err(|e| e.to_string())?;
        let Some(last) = page.last() else { break };
        q.after = last.seq;
        read += page.len();
        out.extend(page.iter().map(Seen::from_decision));
    }
    Ok(out)
}
