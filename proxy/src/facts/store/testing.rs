//! What the store's tests share: a denial, a run record and its
//! activation, and reads of a store through its API and by raw SQL.

pub(super) use super::*;
pub(super) use crate::facts::{denial, FactTarget, NewFact};

pub(super) fn fact(run: &str, host: &str) -> Fact {
    denial(NewFact {
        run: None,
        run_id: Some(run),
        tool: Some("t"),
        reason: "not_allowlisted",
        mode: "enforce",
        target: Some(FactTarget {
            kind: "connect".into(),
            host: host.into(),
            port: 443,
        }),
        resolved: vec![],
        policy: "sha256:x",
        detail: "d".into(),
    })
}

pub(super) fn record(id: &str) -> RunRecord {
    RunRecord {
        id: id.into(),
        principal: None,
        executables: Default::default(),
        creator: None,
        tool: "t".into(),
        owner: None,
        labels: Default::default(),
        active: false,
        bound: false,
        created_at_ms: 0,
        expires_at_ms: u64::MAX,
        secret_sha256: "x".into(),
        max_slots: 1,
        max_waiting: 1,
        max_conns: 1,
        placeholders: vec![],
    }
}

pub(super) fn activated(id: &str) -> RunWrite {
    RunWrite::Update(RunRecord {
        active: true,
        ..record(id)
    })
}

pub(super) fn active(path: &Path, id: &str) -> i64 {
    raw(
        path,
        &format!("SELECT count(*) FROM runs WHERE id = '{id}' AND body LIKE '%\"active\":true%'"),
    )
}

pub(super) async fn all(s: &SqliteStore) -> Vec<Fact> {
    query(s, None, 0, 10_000).await
}

pub(super) async fn query(s: &SqliteStore, run: Option<&str>, after: u64, limit: usize) -> Vec<Fact> {
    s.query(FactQuery {
        after,
        limit,
        run_id: run.map(str::to_owned),
    })
    .await
    .unwrap()
}

pub(super) fn raw(path: &Path, sql: &str) -> i64 {
    let c = Connection::open(path).unwrap();
    c.query_row(sql, [], |r| r.get(0)).unwrap()
}

pub(super) async fn by_run(s: &SqliteStore, run: &str, after: u64, limit: usize) -> Vec<u64> {
    query(s, Some(run), after, limit).await.iter().map(|f| f.seq).collect()
}
