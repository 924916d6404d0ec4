//! Tampering with a real store, each way `facts verify` names; and the
//! stores it must pass: untouched, pruned, migrated, reopened.

use super::*;
use crate::facts::chain::{Signer, Verifier};
use crate::facts::decisions::{DecisionLog, Limits as DecisionLimits};
use crate::facts::store::{CheckpointPolicy, Limits, SqliteStore};
use crate::facts::{denial, FactSink, FactTarget, NewFact};
use crate::metrics::{DecisionMetrics, StoreMetrics};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    key: Verifier,
    signer: Arc<Signer>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("facts.db");
    let (private, public) = Signer::generate("test-cell").unwrap();
    Fixture {
        _dir: dir,
        path,
        key: Verifier::parse(&public).unwrap(),
        signer: Arc::new(Signer::parse(&private).unwrap()),
    }
}

fn limits(f: &Fixture) -> Limits {
    Limits {
        cell: Some("cell-a".into()),
        checkpoints: Some(CheckpointPolicy {
            key: f.signer.clone(),
            every: Duration::from_secs(3600),
            records: 1_000_000,
        }),
        ..Limits::default()
    }
}

fn fact(i: usize) -> crate::facts::Fact {
    denial(NewFact {
        run: None,
        run_id: Some("run-1"),
        tool: Some("t"),
        reason: "not_allowlisted",
        mode: "enforce",
        target: Some(FactTarget {
            kind: "connect".into(),
            host: format!("h{i}.example"),
            port: 443,
        }),
        resolved: vec![],
        policy: "sha256:x",
        detail: "d".into(),
    })
}

/// A store holding `n` facts, closed (its writer signed a closing checkpoint).
async fn store(f: &Fixture, n: usize) {
    let s = SqliteStore::open(&f.path, limits(f), StoreMetrics::default());
    for i in 0..n {
        s.record(fact(i)).await.unwrap();
    }
    drop(s);
}

fn sql(f: &Fixture, q: &str) {
    let c = rusqlite::Connection::open(&f.path).unwrap();
    c.execute_batch(q).unwrap();
}

fn findings(f: &Fixture, held: &[String]) -> Vec<String> {
    let r = verify(&f.path, std::slice::from_ref(&f.key), held).unwrap();
    r.findings.iter().map(ToString::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untouched_store_verifies_and_is_covered_by_its_closing_checkpoint() {
    let f = fixture();
    store(&f, 20).await;
    let r = verify(&f.path, std::slice::from_ref(&f.key), &[]).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert_eq!((r.facts.records, r.facts.newest), (20, 20));
    let newest = r.newest.expect("a checkpoint");
    assert!(newest.closed);
    assert_eq!((newest.cell.as_str(), newest.size), ("cell-a", 20));
    assert!(r.notes.is_empty(), "{:?}", r.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tampering_is_named_by_seq() {
    // (what is done with SQL, the findings expected)
    let cases: &[(&str, &[&str])] = &[
        (
            "UPDATE facts SET body = replace(body, 'not_allowlisted', 'ip_literal') WHERE seq = 7",
            &["altered facts seq 7"],
        ),
        ("DELETE FROM facts WHERE seq = 9", &["missing facts seq 9:"]),
        ("DELETE FROM facts WHERE seq >= 18", &["truncated facts: a checkpoint signed seq 20, the store ends at seq 17"]),
        (
            // Two rows swap places (body and chain move together).
            "UPDATE facts SET seq = -5 WHERE seq = 5; UPDATE facts SET seq = 5 WHERE seq = 12; UPDATE facts SET seq = 12 WHERE seq = -5;",
            &["reordered facts seq 5: the record was chained at seq 12", "reordered facts seq 12: the record was chained at seq 5"],
        ),
        (
            // Two bodies swap, chains stay.
            "UPDATE facts SET body = (SELECT body FROM facts WHERE seq = 4) || '' WHERE seq = 3;",
            &["altered facts seq 3"],
        ),
        (
            "INSERT INTO facts (seq, id, run_id, body) SELECT 21, 'forged', run_id, body FROM facts WHERE seq = 20",
            &["unchained facts seq 21"],
        ),
        (
            "INSERT INTO facts (seq, id, run_id, body, chain) SELECT 21, 'forged', run_id, replace(body, 'h19', 'h99'), chain FROM facts WHERE seq = 20",
            &["altered facts seq 21"],
        ),
        (
            // Edited, and the chain recomputed from there on would still
            // differ from the signed head; here the chain column is
            // copied from a later row instead.
            "UPDATE facts SET chain = (SELECT chain FROM facts WHERE seq = 20) WHERE seq = 10",
            &["altered facts seq 10"],
        ),
        (
            "UPDATE checkpoints SET note = replace(note, char(10) || '20' || char(10), char(10) || '19' || char(10))",
            &["bad_signature: checkpoint loom-egress/cell-a/"],
        ),
    ];
    for (tamper, want) in cases {
        let f = fixture();
        store(&f, 20).await;
        assert!(findings(&f, &[]).is_empty());
        sql(&f, tamper);
        let got = findings(&f, &[]);
        assert_eq!(got.len(), want.len(), "{tamper}: {got:?}");
        for (g, w) in got.iter().zip(want.iter()) {
            assert!(g.starts_with(w), "{tamper}: got {g:?}, want {w:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_signature_bit_is_a_bad_signature() {
    let f = fixture();
    store(&f, 3).await;
    let c = rusqlite::Connection::open(&f.path).unwrap();
    let note: String = c.query_row("SELECT note FROM checkpoints", [], |r| r.get(0)).unwrap();
    let (text, sig) = note.trim_end().rsplit_once(' ').unwrap();
    use base64::Engine;
    let mut blob = base64::engine::general_purpose::STANDARD.decode(sig).unwrap();
    blob[20] ^= 0x01;
    let flipped = format!("{text} {}\n", base64::engine::general_purpose::STANDARD.encode(blob));
    c.execute("UPDATE checkpoints SET note = ?1", [&flipped]).unwrap();
    let got = findings(&f, &[]);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].contains("does not verify"), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recomputed_chain_is_caught_by_the_checkpoint_held_off_the_box() {
    let f = fixture();
    store(&f, 10).await;
    let witness = latest(&f);
    // Rewrite record 4 and recompute the chain from there, as anyone can
    // (the chain has no secret); remove the store's own checkpoints.
    let c = rusqlite::Connection::open(&f.path).unwrap();
    c.execute("UPDATE facts SET body = replace(body, 'h3.', 'h7.') WHERE seq = 4", [])
        .unwrap();
    let mut prev: Head = c
        .query_row("SELECT chain FROM facts WHERE seq = 3", [], |r| r.get::<_, Vec<u8>>(0))
        .unwrap()
        .try_into()
        .unwrap();
    for seq in 4..=10u64 {
        let body: String = c
            .query_row("SELECT body FROM facts WHERE seq = ?1", [seq as i64], |r| r.get(0))
            .unwrap();
        prev = link(Kind::Facts, &prev, seq, body.as_bytes());
        c.execute(
            "UPDATE facts SET chain = ?2 WHERE seq = ?1",
            rusqlite::params![seq as i64, &prev[..]],
        )
        .unwrap();
    }
    c.execute("DELETE FROM checkpoints", []).unwrap();
    assert!(
        findings(&f, &[]).is_empty(),
        "without a checkpoint the rewrite is invisible"
    );
    let got = findings(&f, &[witness]);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with("rewritten facts seq 10"), "{got:?}");
}

fn latest(f: &Fixture) -> String {
    let c = rusqlite::Connection::open(&f.path).unwrap();
    c.query_row("SELECT note FROM checkpoints ORDER BY seq DESC LIMIT 1", [], |r| {
        r.get(0)
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_store_is_named_unless_its_epoch_was_closed() {
    let f = fixture();
    // An epoch signed while live (not closed), then the store replaced.
    let s = SqliteStore::open(&f.path, limits(&f), StoreMetrics::default());
    for i in 0..5 {
        s.record(fact(i)).await.unwrap();
    }
    // The first commit signs at once (the first checkpoint is due).
    let live = s.checkpoint().expect("a checkpoint").to_string();
    let old_epoch = s.epoch().unwrap();
    drop(s);
    let closed = latest(&f);
    std::fs::remove_file(&f.path).unwrap();
    let _ = std::fs::remove_file(f.path.with_extension("db-wal"));
    store(&f, 3).await;
    let got = findings(&f, std::slice::from_ref(&live));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with(&format!("replaced: epoch {old_epoch}")), "{got:?}");
    // Its closing checkpoint held too: an earlier store, closed.
    let r = verify(&f.path, std::slice::from_ref(&f.key), &[live, closed]).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert!(r.notes.iter().any(|n| n.contains("was closed")), "{:?}", r.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pruned_store_verifies_from_its_anchor_and_a_migrated_one_from_its_marker() {
    let f = fixture();
    store(&f, 10).await;
    // Half the facts old: retention prunes them (a prefix) at the next open.
    sql(
        &f,
        "UPDATE facts SET body = json_set(body, '$.at', '2001-01-01T00:00:00.000Z') WHERE seq <= 5",
    );
    let l = Limits {
        retention: Duration::from_secs(3600),
        ..limits(&f)
    };
    let s = SqliteStore::open(&f.path, l, StoreMetrics::default());
    s.record(fact(10)).await.unwrap();
    drop(s);
    let r = verify(&f.path, std::slice::from_ref(&f.key), &[]).unwrap();
    // Editing an old fact's time broke their links, but they are gone.
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert_eq!(
        (r.facts.anchor, r.facts.records, r.facts.anchored.as_deref()),
        (5, 6, Some("pruned"))
    );

    // A store of version 3 (no chain), migrated: the chain starts after it.
    let g = fixture();
    store(&g, 4).await;
    sql(
        &g,
        "UPDATE facts SET chain = NULL; DELETE FROM chain_anchors; DELETE FROM checkpoints; PRAGMA user_version = 3;",
    );
    let s = SqliteStore::open(&g.path, limits(&g), StoreMetrics::default());
    s.record(fact(4)).await.unwrap();
    drop(s);
    let r = verify(&g.path, std::slice::from_ref(&g.key), &[]).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert_eq!((r.facts.anchor, r.facts.before, r.facts.records), (4, 4, 1));
    assert_eq!(r.facts.anchored.as_deref(), Some("migrated"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_records_are_chained_and_signed_with_the_facts() {
    let f = fixture();
    let s = SqliteStore::open(&f.path, limits(&f), StoreMetrics::default());
    s.record(fact(0)).await.unwrap();
    let log = DecisionLog::open(
        egress_config::Decisions::All,
        Some(&f.path),
        DecisionLimits {
            max_bytes: 1 << 30,
            retention: Duration::from_secs(3600),
            cell: Some("cell-a".into()),
            floor: Default::default(),
        },
        DecisionMetrics::default(),
        Arc::default(),
    );
    for i in 0..6 {
        log.offer(crate::facts::decisions::tests::record(
            "t",
            &format!("h{i}"),
            "2026-01-01T00:00:00.000Z",
        ));
    }
    log.close();
    drop(s);
    let r = verify(&f.path, std::slice::from_ref(&f.key), &[]).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert_eq!(r.decisions.records, 6);
    assert_eq!(
        r.newest.unwrap().decisions.0,
        6,
        "the closing checkpoint signs the decisions too"
    );
    sql(
        &f,
        "UPDATE decisions SET body = replace(body, '\"h2\"', '\"h9\"') WHERE seq = 3",
    );
    let got = findings(&f, &[]);
    assert_eq!(
        got,
        ["altered decisions seq 3: the record is not what was chained (edited, or forged)"]
    );
}

#[test]
fn notes_one_after_another_are_split() {
    let (private, _) = Signer::generate("k").unwrap();
    let key = Signer::parse(&private).unwrap();
    let cp = |size| Checkpoint {
        cell: "c".into(),
        epoch: "e".into(),
        size,
        head: [1; 32],
        decisions: (0, [2; 32]),
        time: "t".into(),
        closed: false,
    };
    let text = format!("{}\n{}", cp(1).sign(&key), cp(2).sign(&key));
    let notes = split_notes(&text);
    assert_eq!(notes.len(), 2);
    assert_eq!(notes[1], cp(2).sign(&key));
}

#[test]
fn notes_are_read_from_a_file_sinks_events_too() {
    let (private, _) = Signer::generate("k").unwrap();
    let key = Signer::parse(&private).unwrap();
    let cp = Checkpoint {
        cell: "c".into(),
        epoch: "e".into(),
        size: 3,
        head: [1; 32],
        decisions: (0, [2; 32]),
        time: "2026-12-06T20:00:00.000Z".into(),
        closed: false,
    };
    let note = cp.sign(&key);
    let event = crate::facts::ocsf::checkpoint_event(7, &note, "1.2.3");
    let lines = format!("{{\"class_uid\": 4001, \"unmapped\": {{\"loom\": {{}}}}}}\n{event}\nnot json\n");
    assert_eq!(notes_in(&lines), std::slice::from_ref(&note));
    assert_eq!(notes_in(&note), [note]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_of_a_replaced_key_verify_when_it_is_given_too() {
    let f = fixture();
    store(&f, 3).await;
    // The key is rotated: the same store, checkpoints by a new key from now on.
    let (private, public) = Signer::generate("test-cell-2").unwrap();
    let new = Fixture {
        signer: Arc::new(Signer::parse(&private).unwrap()),
        key: Verifier::parse(&public).unwrap(),
        path: f.path.clone(),
        _dir: tempfile::tempdir().unwrap(),
    };
    store(&new, 2).await;
    let both = [new.key.clone(), f.key.clone()];
    let r = verify(&f.path, &both, &[]).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let only_new = findings(&new, &[]);
    assert!(
        !only_new.is_empty() && only_new.iter().all(|x| x.contains("no signature by key test-cell-2")),
        "{only_new:?}"
    );
}
