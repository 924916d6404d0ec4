//! `egress-proxy facts verify`: checks a store file offline against its
//! hash chains ([`crate::facts::chain`]) and the signed checkpoints (the
//! store's own, and any held off the box), and names every finding:
//!
//! - `altered`: a record is not what was chained (edited, or forged with a
//!   made-up chain value);
//! - `unchained`: a record without a chain value after the chain began
//!   (inserted by hand);
//! - `missing`: seqs absent between kept records (deleted);
//! - `reordered`: a record that was chained at another seq;
//! - `truncated`: a checkpoint covers records the store no longer holds at
//!   its end;
//! - `rewritten`: the chain at a checkpoint's size is not the signed one
//!   (history edited and its chain recomputed);
//! - `replaced`: checkpoints of another epoch of the cell whose newest is
//!   not a closing one (the store was replaced while records were live);
//! - `bad_signature`: a checkpoint whose signature does not verify.
//!
//! The walk reads each chain once, oldest first from its anchor; a record
//! is checked against its predecessor's stored chain value, so one edit is
//! one finding. Records that do not link are then classified against each
//! other (at most [`CLASSIFY`] of them): moved, following a moved one, or
//! altered.

use crate::facts::chain::{self, genesis, link, Checkpoint, Head, Kind, NoteError, Verifier};
use crate::facts::store::links;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use std::fmt;
use std::path::Path;

/// Records that do not link, classified against each other at most.
const CLASSIFY: usize = 256;

/// One thing found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Altered { kind: Kind, seq: u64 },
    Unchained { kind: Kind, seq: u64 },
    Missing { kind: Kind, from: u64, to: u64 },
    Reordered { kind: Kind, seq: u64, chained_at: u64 },
    Truncated { kind: Kind, signed: u64, held: u64 },
    Rewritten { kind: Kind, seq: u64 },
    Replaced { epoch: String, size: u64, time: String },
    BadSignature { checkpoint: String, why: String },
}

impl Finding {
    /// The finding's name, as the output's first word.
    pub fn name(&self) -> &'static str {
        match self {
            Finding::Altered { .. } => "altered",
            Finding::Unchained { .. } => "unchained",
            Finding::Missing { .. } => "missing",
            Finding::Reordered { .. } => "reordered",
            Finding::Truncated { .. } => "truncated",
            Finding::Rewritten { .. } => "rewritten",
            Finding::Replaced { .. } => "replaced",
            Finding::BadSignature { .. } => "bad_signature",
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.name();
        match self {
            Finding::Altered { kind, seq } => write!(
                f,
                "{n} {} seq {seq}: the record is not what was chained (edited, or forged)",
                kind.name()
            ),
            Finding::Unchained { kind, seq } => write!(
                f,
                "{n} {} seq {seq}: the record has no chain value (inserted outside the writer)",
                kind.name()
            ),
            Finding::Missing { kind, from, to } if from == to => {
                write!(f, "{n} {} seq {from}: the record was deleted", kind.name())
            }
            Finding::Missing { kind, from, to } => {
                write!(f, "{n} {} seq {from}-{to}: the records were deleted", kind.name())
            }
            Finding::Reordered { kind, seq, chained_at } => write!(
                f,
                "{n} {} seq {seq}: the record was chained at seq {chained_at}",
                kind.name()
            ),
            Finding::Truncated { kind, signed, held } => write!(
                f,
                "{n} {}: a checkpoint signed seq {signed}, the store ends at seq {held}: seq {}-{signed} were deleted",
                kind.name(),
                held + 1
            ),
            Finding::Rewritten { kind, seq } => write!(
                f,
                "{n} {} seq {seq}: the chain there is not the signed one: records up to it were rewritten",
                kind.name()
            ),
            Finding::Replaced { epoch, size, time } => write!(
                f,
                "{n}: epoch {epoch} (signed up to seq {size} at {time}) was never closed: its store was replaced"
            ),
            Finding::BadSignature { checkpoint, why } => write!(f, "{n}: checkpoint {checkpoint}: {why}"),
        }
    }
}

/// What one chain held.
#[derive(Debug, Default, Clone)]
pub struct Walk {
    /// Records read in the chain (after its anchor).
    pub records: u64,
    /// Records at or below the anchor still held (written before chains).
    pub before: u64,
    /// The anchor: the chain starts after this seq.
    pub anchor: u64,
    /// The newest seq held.
    pub newest: u64,
    /// Why the chain starts at its anchor (`pruned`, `migrated`), if it has one.
    pub anchored: Option<String>,
}

/// What `verify` found.
#[derive(Debug, Default)]
pub struct Report {
    pub cell: String,
    pub epoch: String,
    pub facts: Walk,
    pub decisions: Walk,
    /// Checkpoints whose signature verified, and the newest of this epoch.
    pub checkpoints: usize,
    pub newest: Option<Checkpoint>,
    pub findings: Vec<Finding>,
    /// What is true but worth saying (records not yet signed, earlier epochs).
    pub notes: Vec<String>,
}

/// One chain's walk: the records that did not link, for classification.
struct Loose {
    seq: u64,
    body: Vec<u8>,
    stored: Head,
}

/// Verifies the store at `path` against its own checkpoints and the signed
/// notes `held` (kept off the box: a witness's, an export's); a checkpoint
/// verifies when one of `keys` signed it (the key in force, and those it
/// replaced).
pub fn verify(path: &Path, keys: &[Verifier], held: &[String]) -> Result<Report, String> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    c.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let bad = |e: rusqlite::Error| format!("{}: not a fact store with a hash chain? {e}", path.display());
    let epoch: String = c
        .query_row("SELECT value FROM store_info WHERE key = 'epoch'", [], |r| r.get(0))
        .map_err(bad)?;
    let mut notes: Vec<String> = c
        .prepare("SELECT note FROM checkpoints ORDER BY seq")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .map_err(bad)?;
    notes.extend(held.iter().cloned());
    let mut r = Report {
        epoch: epoch.clone(),
        ..Report::default()
    };
    // The cell: from the checkpoints (signed), else from a fact.
    let (verified, unsigned) = sort_notes(&notes, keys);
    r.findings
        .extend(unsigned.iter().map(|(cp, e)| bad_signature(cp.as_ref(), e)));
    r.checkpoints = verified.len();
    let cell_of_fact: Option<String> = c
        .query_row(
            "SELECT json_extract(body, '$.cell') FROM facts ORDER BY seq DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(bad)?
        .flatten();
    r.cell = verified
        .iter()
        .find(|cp| cp.epoch == epoch)
        .map(|cp| cp.cell.clone())
        .or(cell_of_fact)
        .unwrap_or_else(|| links::cell_name(None).to_owned());
    let cell = r.cell.clone();
    for kind in [Kind::Facts, Kind::Decisions] {
        let has_table: bool = c
            .query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
                params![links::table(kind)],
                |r| r.get(0),
            )
            .map_err(bad)?;
        if !has_table {
            continue;
        }
        let walk = walk(&c, kind, &cell, &epoch, &mut r.findings).map_err(bad)?;
        match kind {
            Kind::Facts => r.facts = walk,
            Kind::Decisions => r.decisions = walk,
        }
    }
    // This epoch's checkpoints against the chains held.
    let mine: Vec<&Checkpoint> = verified
        .iter()
        .filter(|cp| cp.epoch == epoch && cp.cell == cell)
        .collect();
    for cp in &mine {
        for (kind, signed, w) in [
            (Kind::Facts, (cp.size, &cp.head), &r.facts),
            (Kind::Decisions, (cp.decisions.0, &cp.decisions.1), &r.decisions),
        ] {
            let table = links::table(kind);
            let at = || {
                if signed.0 == w.anchor {
                    links::anchor(&c, kind).ok().flatten().map(|(_, h, _)| h)
                } else {
                    let mut stmt = c.prepare(&format!("SELECT chain FROM {table} WHERE seq = ?1")).ok()?;
                    chain_value(&mut stmt, signed.0)
                }
            };
            check(kind, signed, w, at, &mut r.findings);
        }
    }
    tidy(&mut r.findings);
    r.newest = mine
        .iter()
        .max_by_key(|cp| (cp.size, cp.decisions.0, cp.time.clone()))
        .map(|cp| (*cp).clone());
    match &r.newest {
        Some(cp) => {
            let (f, d) = (
                r.facts.newest.saturating_sub(cp.size),
                r.decisions.newest.saturating_sub(cp.decisions.0),
            );
            if f + d > 0 {
                r.notes.push(format!(
                    "{f} facts and {d} decision records after the newest checkpoint are chained but not yet signed"
                ));
            }
        }
        None => r.notes.push(format!(
            "no checkpoint of this epoch verified with key {}: the chains are checked, not their signatures",
            names(keys)
        )),
    }
    // Earlier epochs of this cell, from checkpoints held.
    let mut others: Vec<&Checkpoint> = verified
        .iter()
        .filter(|cp| cp.epoch != epoch && cp.cell == cell)
        .collect();
    others.sort_by(|a, b| (&a.epoch, a.size, &a.time).cmp(&(&b.epoch, b.size, &b.time)));
    let mut last: Vec<&Checkpoint> = Vec::new();
    for cp in others {
        match last.last_mut() {
            Some(l) if l.epoch == cp.epoch => *l = if cp.closed { cp } else { l },
            _ => last.push(cp),
        }
    }
    for cp in last {
        if cp.closed {
            r.notes.push(format!(
                "epoch {} was closed at seq {} ({}): an earlier store, not this one",
                cp.epoch, cp.size, cp.time
            ));
        } else {
            r.findings.push(Finding::Replaced {
                epoch: cp.epoch.clone(),
                size: cp.size,
                time: cp.time.clone(),
            });
        }
    }
    Ok(r)
}

/// A checkpoint that does not verify: what it says (when it reads), and why.
type Unsigned = (Option<Checkpoint>, NoteError);

/// `notes` sorted into the checkpoints one of `keys` signed, and the others.
fn sort_notes(notes: &[String], keys: &[Verifier]) -> (Vec<Checkpoint>, Vec<Unsigned>) {
    let mut verified = Vec::new();
    let mut unsigned = Vec::new();
    for note in notes {
        match verify_by_any(note, keys) {
            Ok(cp) => verified.push(cp),
            Err(e) => unsigned.push((chain::read_note(note).ok(), e)),
        }
    }
    (verified, unsigned)
}

/// Findings as reported: one truncation per chain (the furthest signed
/// size: every earlier checkpoint beyond the end says less), and no finding
/// twice in a row.
fn tidy(findings: &mut Vec<Finding>) {
    let furthest = |k: Kind, f: &[Finding]| {
        f.iter()
            .filter_map(|x| match x {
                Finding::Truncated { kind, signed, .. } if *kind == k => Some(*signed),
                _ => None,
            })
            .max()
    };
    let (facts, decisions) = (furthest(Kind::Facts, findings), furthest(Kind::Decisions, findings));
    findings.retain(|x| match x {
        Finding::Truncated { kind, signed, .. } => {
            Some(*signed) == if *kind == Kind::Facts { facts } else { decisions }
        }
        _ => true,
    });
    findings.dedup();
}

/// The finding of a checkpoint that does not verify (`cp`: what it says,
/// when it reads).
fn bad_signature(cp: Option<&Checkpoint>, e: &NoteError) -> Finding {
    let checkpoint = cp.map_or_else(
        || "(unreadable)".to_owned(),
        |cp| format!("{} size {} at {}", chain::origin(&cp.cell, &cp.epoch), cp.size, cp.time),
    );
    let why = match e {
        NoteError::Malformed(m) => format!("not a checkpoint: {m}"),
        e => e.to_string(),
    };
    Finding::BadSignature { checkpoint, why }
}

/// The first column of the rows `sql` selects for `cell`, as text.
async fn texts(client: &tokio_postgres::Client, sql: &str, cell: &str) -> Result<Vec<String>, String> {
    let rows = client
        .query(sql, &[&cell])
        .await
        .map_err(|e| format!("the fleet store: {e}"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The keys' names, for messages.
fn names(keys: &[Verifier]) -> String {
    keys.iter().map(Verifier::name).collect::<Vec<_>>().join(", ")
}

/// `note` verified by the first of `keys` that signed it; else why not (a
/// key whose signature does not verify, or an unreadable note, rather than
/// no signature by the others).
fn verify_by_any(note: &str, keys: &[Verifier]) -> Result<Checkpoint, NoteError> {
    let mut why = NoteError::Unsigned(names(keys));
    for key in keys {
        match chain::verify_note(note, key) {
            Ok(cp) => return Ok(cp),
            Err(NoteError::Unsigned(_)) => {}
            Err(e) => why = e,
        }
    }
    Err(why)
}

/// One chain walked oldest first, a record at a time, from where it
/// starts (its anchor, or genesis). A record is checked against its
/// predecessor's stored chain value, so one edit is one finding; the
/// records that do not link are named by [`Walker::finish`].
struct Walker {
    kind: Kind,
    start: u64,
    prev: Option<Head>,
    /// The chain the previous record should have had (from its own body).
    computed: Option<Head>,
    expect: u64,
    loose: Vec<Loose>,
    findings: Vec<Finding>,
    w: Walk,
}

impl Walker {
    /// A chain that starts after `start`, its first record linking to
    /// `first` (none: the first record cannot be checked).
    fn new(kind: Kind, start: u64, first: Option<Head>, anchored: Option<String>) -> Walker {
        Walker {
            kind,
            start,
            prev: first,
            computed: None,
            expect: start + 1,
            loose: Vec::new(),
            findings: Vec::new(),
            w: Walk {
                anchor: start,
                anchored,
                ..Walk::default()
            },
        }
    }

    fn row(&mut self, seq: u64, body: &[u8], stored: Option<Head>) {
        let kind = self.kind;
        self.w.newest = seq;
        if seq <= self.start {
            self.w.before += 1;
            return;
        }
        self.w.records += 1;
        if seq > self.expect {
            self.findings.push(Finding::Missing {
                kind,
                from: self.expect,
                to: seq - 1,
            });
            // The first record after a gap cannot be checked: its
            // predecessor is gone.
            (self.prev, self.computed) = (None, None);
        }
        self.expect = seq + 1;
        match (self.prev, stored) {
            (_, None) => {
                self.findings.push(Finding::Unchained { kind, seq });
                (self.prev, self.computed) = (None, None);
            }
            (None, Some(h)) => (self.prev, self.computed) = (Some(h), None),
            (Some(p), Some(h)) => {
                let this = link(kind, &p, seq, body);
                // A predecessor whose chain value alone was altered: this
                // record still links to what it should have held.
                let after_altered = self.computed.is_some_and(|c| link(kind, &c, seq, body) == h);
                self.computed = Some(this);
                if this != h && !after_altered {
                    if self.loose.len() < CLASSIFY {
                        self.loose.push(Loose {
                            seq,
                            body: body.to_vec(),
                            stored: h,
                        });
                    } else {
                        // Beyond what is classified: named as altered.
                        self.findings.push(Finding::Altered { kind, seq });
                    }
                }
                self.prev = Some(h);
            }
        }
    }

    /// Names the records that did not link (`stored(seq)`: the chain value
    /// held at a seq): chained at another of these seqs (`reordered`),
    /// intact but after a moved record (no finding), or altered.
    fn finish(mut self, mut stored: impl FnMut(u64) -> Option<Head>) -> (Walk, Vec<Finding>) {
        let kind = self.kind;
        enum Class {
            Moved(u64),
            AfterMoved,
            Altered,
        }
        for r in &self.loose {
            let mut class = Class::Altered;
            for q in self.loose.iter().filter(|q| q.seq != r.seq) {
                // Chained at q's place: after what is stored before q.
                if stored(q.seq - 1).is_some_and(|before_q| link(kind, &before_q, q.seq, &r.body) == r.stored) {
                    class = Class::Moved(q.seq);
                    break;
                }
                // Intact, after a record moved away from its predecessor's place.
                if link(kind, &q.stored, r.seq, &r.body) == r.stored {
                    class = Class::AfterMoved;
                    break;
                }
            }
            match class {
                Class::Moved(at) => self.findings.push(Finding::Reordered {
                    kind,
                    seq: r.seq,
                    chained_at: at,
                }),
                Class::AfterMoved => {}
                Class::Altered => self.findings.push(Finding::Altered { kind, seq: r.seq }),
            }
        }
        (self.w, self.findings)
    }
}

/// Walks one chain of the store from its anchor, oldest first.
fn walk(c: &Connection, kind: Kind, cell: &str, epoch: &str, findings: &mut Vec<Finding>) -> rusqlite::Result<Walk> {
    let anchor = links::anchor(c, kind)?;
    let (start, first) = anchor
        .as_ref()
        .map_or((0, genesis(kind, cell, epoch)), |(s, h, _)| (*s, *h));
    let mut walker = Walker::new(kind, start, Some(first), anchor.map(|(_, _, why)| why));
    let table = links::table(kind);
    let mut stmt = c.prepare(&format!("SELECT seq, body, chain FROM {table} ORDER BY seq"))?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let seq = row.get::<_, i64>(0)?.max(0) as u64;
        let body = row.get_ref(1)?;
        let body = body
            .as_bytes()
            .or_else(|_| body.as_str().map(str::as_bytes))
            .unwrap_or_default();
        let stored: Option<Head> = row.get::<_, Option<Vec<u8>>>(2)?.and_then(|b| b.try_into().ok());
        walker.row(seq, body, stored);
    }
    let mut chain_at = c.prepare(&format!("SELECT chain FROM {table} WHERE seq = ?1"))?;
    let (w, found) = walker.finish(|seq| chain_value(&mut chain_at, seq));
    findings.extend(found);
    Ok(w)
}

/// The chain value stored at `seq` (none: no such record, or unchained).
fn chain_value(stmt: &mut rusqlite::Statement<'_>, seq: u64) -> Option<Head> {
    stmt.query_row(params![seq.min(i64::MAX as u64) as i64], |r| {
        r.get::<_, Option<Vec<u8>>>(0)
    })
    .optional()
    .ok()
    .flatten()
    .flatten()
    .and_then(|b| b.try_into().ok())
}

/// Checks a checkpoint's `size` and `head` of one chain against the chain
/// walked (`at`: the chain value held at `size`).
fn check(
    kind: Kind,
    (size, head): (u64, &Head),
    w: &Walk,
    at: impl FnOnce() -> Option<Head>,
    findings: &mut Vec<Finding>,
) {
    if size > w.newest {
        findings.push(Finding::Truncated {
            kind,
            signed: size,
            held: w.newest,
        });
        return;
    }
    if size < w.anchor || size == 0 {
        // Pruned since (or nothing then): the anchor is past it.
        return;
    }
    // A record missing or unchained there is named by the walk already.
    if at().is_some_and(|h| &h != head) {
        findings.push(Finding::Rewritten { kind, seq: size });
    }
}

/// Verifies the facts the fleet store (`[export] sink = "postgres"`) holds
/// of `cell`, each epoch on its own, record by record: the exporter copies
/// each fact's stored JSON and chain value (`stored`, `chain`), and the
/// checkpoints (`egress_checkpoints`, with those `held`) are checked
/// against them. A fact exported before those columns has neither: such
/// facts at the start of an epoch are counted as written before the chain.
/// Decision records are not in the fleet store. A checkpoint beyond the
/// newest fact held is `truncated`: deleted there, or not exported yet (run
/// it when the cell's `export_lag` is 0). One report per epoch, oldest
/// first.
pub async fn verify_postgres(
    client: &tokio_postgres::Client,
    schema: &str,
    cell: &str,
    keys: &[Verifier],
    held: &[String],
) -> Result<Vec<Report>, String> {
    let s = egress_fleet::pg::ident(schema);
    let pg = |e: tokio_postgres::Error| format!("the fleet store: {e}");
    let mut notes = texts(
        client,
        &format!("SELECT note FROM {s}.egress_checkpoints WHERE cell = $1 ORDER BY at"),
        cell,
    )
    .await?;
    notes.extend(held.iter().cloned());
    let (verified, unsigned) = sort_notes(&notes, keys);
    let epochs = texts(
        client,
        &format!("SELECT epoch::text FROM {s}.egress_facts WHERE cell = $1 GROUP BY epoch ORDER BY min(at)"),
        cell,
    )
    .await?;
    let mut reports = Vec::new();
    for epoch in epochs {
        let rows = client
            .query(
                &format!(
                    "SELECT seq, stored, chain FROM {s}.egress_facts WHERE cell = $1 AND epoch = $2::text::uuid ORDER BY seq"
                ),
                &[&cell, &epoch],
            )
            .await
            .map_err(pg)?;
        let rows: Vec<(u64, Option<String>, Option<Head>)> = rows
            .iter()
            .map(|r| {
                let seq: i64 = r.get(0);
                let chain: Option<Vec<u8>> = r.get(2);
                (seq.max(0) as u64, r.get(1), chain.and_then(|c| c.try_into().ok()))
            })
            .collect();
        // Facts exported before the chain's columns (or written before the
        // chain) lead; the chain starts after them, from genesis. An epoch
        // whose export began after its first facts were pruned cannot
        // check its first record.
        let before = rows
            .iter()
            .take_while(|(_, body, chain)| body.is_none() || chain.is_none())
            .count();
        let (start, first) = match (before, rows.first()) {
            (0, Some((seq, _, _))) if *seq > 1 => (seq - 1, None),
            (0, _) => (0, Some(genesis(Kind::Facts, cell, &epoch))),
            (n, _) => (rows[n - 1].0, Some(genesis(Kind::Facts, cell, &epoch))),
        };
        let anchored = (before > 0).then(|| "exported before the chain".to_owned());
        let mut walker = Walker::new(Kind::Facts, start, first, anchored);
        for (seq, body, chain) in &rows {
            walker.row(*seq, body.as_deref().unwrap_or_default().as_bytes(), *chain);
        }
        let by_seq: std::collections::HashMap<u64, Head> = rows
            .iter()
            .filter_map(|(seq, _, chain)| Some((*seq, (*chain)?)))
            .collect();
        let (facts, mut findings) = walker.finish(|seq| by_seq.get(&seq).copied());
        let mine: Vec<&Checkpoint> = verified
            .iter()
            .filter(|cp| cp.epoch == epoch && cp.cell == cell)
            .collect();
        for cp in &mine {
            let at = || {
                by_seq
                    .get(&cp.size)
                    .copied()
                    .or(if cp.size == start { first } else { None })
            };
            check(Kind::Facts, (cp.size, &cp.head), &facts, at, &mut findings);
        }
        for (cp, e) in &unsigned {
            if cp.as_ref().is_none_or(|cp| cp.epoch == epoch) {
                findings.push(bad_signature(cp.as_ref(), e));
            }
        }
        tidy(&mut findings);
        let newest = mine
            .iter()
            .max_by_key(|cp| (cp.size, cp.time.clone()))
            .map(|cp| (*cp).clone());
        let mut notes = Vec::new();
        match &newest {
            Some(cp) if facts.newest > cp.size => notes.push(format!(
                "{} facts after the newest checkpoint are chained but not yet signed",
                facts.newest - cp.size
            )),
            Some(_) => {}
            None => notes.push(format!(
                "no checkpoint of this epoch verified with key {}: the chain is checked, not its signatures",
                names(keys)
            )),
        }
        reports.push(Report {
            cell: cell.to_owned(),
            epoch,
            facts,
            decisions: Walk::default(),
            checkpoints: mine.len(),
            newest,
            findings,
            notes,
        });
    }
    Ok(reports)
}

/// Verifies the records a sink exported with `[audit] record_integrity`
/// (`events`: its OCSF events, in any order, duplicates allowed), record by
/// record: each attested event's `raw_data` is the record as the store held
/// it and its `attestation.fingerprint` the chain value, so the chain is
/// walked again from the events alone, per (cell, epoch) and kind, and held
/// against the checkpoints among the events (and `held`). Events without
/// an attestation cannot be checked and are counted in a note. One report
/// per store epoch.
pub fn verify_export(events: &[serde_json::Value], keys: &[Verifier], held: &[String]) -> Result<Vec<Report>, String> {
    use std::collections::{BTreeMap, HashMap};
    let mut notes: Vec<String> = held.to_vec();
    // (cell, epoch) → kind → seq → (raw_data, fingerprint)
    type Chains = BTreeMap<(String, String), HashMap<Kind, BTreeMap<u64, (String, Option<Head>)>>>;
    let mut chains: Chains = BTreeMap::new();
    let mut unattested = 0u64;
    let mut conflicting: Vec<(String, String, Kind, u64)> = Vec::new();
    for e in events {
        if e.pointer("/metadata/log_name").and_then(|v| v.as_str()) == Some("checkpoints") {
            if let Some(n) = e.pointer("/unmapped/loom/note").and_then(|v| v.as_str()) {
                notes.push(n.to_owned());
            }
            continue;
        }
        let att = &e["attestation"];
        let parts = att["chain_uid"]
            .as_str()
            .and_then(|c| c.strip_prefix("loom-egress/"))
            .and_then(|c| {
                let (rest, kind) = c.rsplit_once('/')?;
                let (cell, epoch) = rest.rsplit_once('/')?;
                let kind = match kind {
                    "facts" => Kind::Facts,
                    "decisions" => Kind::Decisions,
                    _ => return None,
                };
                Some((cell.to_owned(), epoch.to_owned(), kind))
            });
        let seq = e.pointer("/metadata/sequence").and_then(|v| v.as_u64());
        let (Some((cell, epoch, kind)), Some(seq), Some(raw)) = (parts, seq, e["raw_data"].as_str()) else {
            unattested += 1;
            continue;
        };
        let fingerprint = att["fingerprint"]["value"].as_str().and_then(unhex);
        let slot = chains
            .entry((cell.clone(), epoch.clone()))
            .or_default()
            .entry(kind)
            .or_default();
        match slot.get(&seq) {
            // A duplicate (a batch sent again) is the same record.
            Some((r, f)) if r == raw && *f == fingerprint => {}
            Some(_) => conflicting.push((cell, epoch, kind, seq)),
            None => {
                slot.insert(seq, (raw.to_owned(), fingerprint));
            }
        }
    }
    if chains.is_empty() {
        return Err(format!(
            "no attested events among {} ({unattested} without an attestation): the sink needs [audit] record_integrity = true",
            events.len()
        ));
    }
    let (verified, unsigned) = sort_notes(&notes, keys);
    let mut reports = Vec::new();
    for ((cell, epoch), kinds) in chains {
        let mut findings = Vec::new();
        let mut walks: HashMap<Kind, (Walk, HashMap<u64, Head>)> = HashMap::new();
        for (kind, records) in kinds {
            let Some(first_seq) = records.keys().next().copied() else {
                continue;
            };
            let (start, first) = if first_seq == 1 {
                (0, Some(genesis(kind, &cell, &epoch)))
            } else {
                (first_seq - 1, None)
            };
            let mut walker = Walker::new(kind, start, first, (start > 0).then(|| "exported from here".to_owned()));
            for (seq, (raw, fingerprint)) in &records {
                walker.row(*seq, raw.as_bytes(), *fingerprint);
            }
            let by_seq: HashMap<u64, Head> = records.iter().filter_map(|(s, (_, f))| Some((*s, (*f)?))).collect();
            let (w, found) = walker.finish(|seq| by_seq.get(&seq).copied());
            findings.extend(found);
            walks.insert(kind, (w, by_seq));
        }
        for (c, e, kind, seq) in &conflicting {
            if *c == cell && *e == epoch {
                findings.push(Finding::Altered { kind: *kind, seq: *seq });
            }
        }
        let mine: Vec<&Checkpoint> = verified
            .iter()
            .filter(|cp| cp.epoch == epoch && cp.cell == cell)
            .collect();
        for cp in &mine {
            for (kind, (size, head)) in [
                (Kind::Facts, (cp.size, &cp.head)),
                (Kind::Decisions, (cp.decisions.0, &cp.decisions.1)),
            ] {
                if let Some((w, by_seq)) = walks.get(&kind) {
                    check(kind, (size, head), w, || by_seq.get(&size).copied(), &mut findings);
                }
            }
        }
        for (cp, e) in &unsigned {
            if cp.as_ref().is_none_or(|cp| cp.epoch == epoch) {
                findings.push(bad_signature(cp.as_ref(), e));
            }
        }
        tidy(&mut findings);
        let newest = mine
            .iter()
            .max_by_key(|cp| (cp.size, cp.decisions.0, cp.time.clone()))
            .map(|cp| (*cp).clone());
        let mut report_notes = Vec::new();
        if unattested > 0 {
            report_notes.push(format!("{unattested} events without an attestation were not checked"));
        }
        if newest.is_none() {
            report_notes.push(format!(
                "no checkpoint of this epoch verified with key {}: the chains are checked, not their signatures",
                names(keys)
            ));
        }
        let take = |k: Kind| walks.get(&k).map(|(w, _)| w.clone()).unwrap_or_default();
        reports.push(Report {
            cell,
            epoch,
            facts: take(Kind::Facts),
            decisions: take(Kind::Decisions),
            checkpoints: mine.len(),
            newest,
            findings,
            notes: report_notes,
        });
    }
    Ok(reports)
}

/// A chain value from its hex.
fn unhex(s: &str) -> Option<Head> {
    if s.len() != 64 {
        return None;
    }
    let mut h = [0u8; 32];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(h)
}

/// The signed notes in a file a witness or a sink kept: JSON lines of OCSF
/// events (a file sink's; the checkpoints' notes are under
/// `unmapped.loom.note`, other events are skipped), or notes one after the
/// other ([`split_notes`]).
pub fn notes_in(text: &str) -> Vec<String> {
    if !text.trim_start().starts_with('{') {
        return split_notes(text);
    }
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|e| e.pointer("/unmapped/loom/note")?.as_str().map(str::to_owned))
        .collect()
}

/// Splits text holding signed notes one after the other (a witness's file,
/// several `GET /v1/audit/checkpoint` answers) into notes.
pub fn split_notes(text: &str) -> Vec<String> {
    let mut notes = Vec::new();
    let mut cur = String::new();
    let mut signed = false;
    for line in text.split_inclusive('\n') {
        if signed && line.starts_with("loom-egress/") {
            notes.push(std::mem::take(&mut cur));
            signed = false;
        }
        if line.starts_with('\u{2014}') {
            signed = true;
        }
        cur.push_str(line);
    }
    if !cur.trim().is_empty() {
        notes.push(cur);
    }
    notes
        .into_iter()
        .map(|n| n.trim_end_matches('\n').to_owned() + "\n")
        .filter(|n| n.trim() != "")
        .collect()
}

#[cfg(test)]
#[path = "verify_tests.rs"]
mod tests;
