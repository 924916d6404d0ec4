//! Denial facts: the record the kernel folds into its event log
//! (`EGRESS_DENIED`, schema 1.7.0), and the [`FactSink`] a denial is handed
//! to before its response is written. The sink assigns `seq`; `id` is a UUID
//! assigned at creation so kernels fold idempotently. [`MemorySink`] is a
//! bounded in-memory store for tests and embedding.

pub mod chain;
pub mod decisions;
pub mod export;
pub mod ocsf;
pub(crate) mod private;
pub mod sinks;
pub(crate) mod store;
pub mod verify;

use crate::runs::{RunRecord, RunWrite};
use futures_util::future::BoxFuture;
use std::collections::VecDeque;
use std::sync::Mutex;
use tokio::sync::broadcast;

/// The longest `detail` a fact (and its log line and answer) carries, in
/// bytes: details quote attacker-controlled text (raw targets, `Host`
/// values), and a flood of large facts must not fill the disk.
pub const MAX_DETAIL: usize = 512;

/// `s` cut to at most [`MAX_DETAIL`] bytes (at a character boundary), with
/// control characters replaced, and `…` appended when it was cut.
pub fn bounded(s: String) -> String {
    if s.len() <= MAX_DETAIL && !s.chars().any(char::is_control) {
        return s;
    }
    let mut out = String::with_capacity(MAX_DETAIL + 3);
    for c in s.chars() {
        if out.len() + c.len_utf8() > MAX_DETAIL {
            out.push('…');
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

/// The most resolved addresses a fact lists.
pub const MAX_RESOLVED: usize = 32;

pub use egress_api::{Fact, FactTarget, FACT_SCHEMA as SCHEMA, FACT_TYPE};
pub use store::dump::{dump, Record, Records};

/// What a new denial fact says; [`denial`] turns it into a [`Fact`].
pub struct NewFact<'a> {
    pub run_id: Option<&'a str>,
    pub tool: Option<&'a str>,
    pub reason: &'static str,
    /// `enforce` or `report`.
    pub mode: &'static str,
    pub target: Option<FactTarget>,
    pub resolved: Vec<String>,
    /// The digest of the policy that decided.
    pub policy: &'a str,
    pub detail: String,
    /// The run the fact is about, for its principal and executables.
    pub run: Option<&'a crate::runs::Run>,
}

/// A new fact, not yet sequenced: bounded detail and address list, a fresh
/// `id`, the current time.
///
/// The id is a version 7 UUID: the time in milliseconds, then 74 random
/// bits. Ids made one after the other sort one after the other, so the
/// store's unique index on `id` grows at its end (one page per commit)
/// instead of taking a random page for every fact, as random (version 4)
/// ids did: that was a third of the pages each commit wrote. Within one
/// millisecond ids are in no particular order (a shared counter would be a
/// lock on every denial), which still keeps them in the index's last pages.
pub fn denial(n: NewFact<'_>) -> Fact {
    let mut resolved = n.resolved;
    resolved.truncate(MAX_RESOLVED);
    let now = std::time::SystemTime::now();
    let since = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let stamp = uuid::Timestamp::from_unix(uuid::NoContext, since.as_secs(), since.subsec_nanos());
    Fact {
        kind: FACT_TYPE.to_owned(),
        schema: SCHEMA.to_owned(),
        seq: 0,
        id: uuid::Uuid::new_v7(stamp).to_string(),
        at: crate::time::rfc3339(now),
        run_id: n.run_id.map(str::to_owned),
        tool: n.tool.map(str::to_owned),
        reason: n.reason.to_owned(),
        mode: n.mode.to_owned(),
        target: n.target,
        resolved,
        policy: n.policy.to_owned(),
        detail: bounded(n.detail),
        count: 1,
        cell: None,
        epoch: None,
        principal: n.run.and_then(|r| r.principal()).map(|p| p.to_string()),
        executables: n.run.map(|r| r.executables.clone()).unwrap_or_default(),
    }
}

/// Why a fact could not be recorded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FactError {
    #[error("fact store unavailable: {0}")]
    Unavailable(String),
}

/// Where a denial was stored: the fact's global `seq` (for kernels) and its
/// `id` (the one identifier a tool is shown; it reveals nothing of other
/// runs). Identical denials folded into one fact share both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub seq: u64,
    pub id: String,
}

/// A cursor query.
#[derive(Debug, Clone, Default)]
pub struct FactQuery {
    pub after: u64,
    pub limit: usize,
    pub run_id: Option<String>,
}

/// A fact as the store holds it: the JSON its chain value covers, byte for
/// byte, and that value (none for a fact written before the chain, or by a
/// sink without one).
#[derive(Debug, Clone)]
pub struct StoredFact {
    pub fact: Fact,
    pub body: String,
    pub chain: Option<chain::Head>,
}

/// A chained record as the store holds it: its seq, the JSON its chain
/// value covers, and that value.
pub type Chained = (u64, String, chain::Head);

/// How long a run record write queued by [`FactSink::save_run_soon`] waits
/// at most for another write to share its commit.
pub const RUN_WRITE_DELAY: std::time::Duration = std::time::Duration::from_millis(10);

/// Where denials go. `record` resolves only once the fact is stored as
/// durably as the sink can make it; callers answer the client afterwards.
pub trait FactSink: Send + Sync + 'static {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>>;
    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>>;
    /// Live feed of recorded facts (lagging subscribers re-read by cursor).
    fn subscribe(&self) -> broadcast::Receiver<Fact>;
    /// Whether the sink can currently record.
    fn ready(&self) -> bool {
        true
    }

    /// Keeps (or forgets) a run record durably, so that runs survive a
    /// proxy restart. Sinks without durable storage keep nothing.
    fn save_run(&self, _w: RunWrite) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(async { Ok(()) })
    }

    /// Queues a run record write without waiting for its commit: it is
    /// committed with the next write that is waited for, or within
    /// [`RUN_WRITE_DELAY`] at the latest, in the order it was queued (a
    /// deletion queued after it still wins). Returns once it is queued.
    /// Sinks without durable storage keep nothing.
    fn save_run_soon(&self, w: RunWrite) -> BoxFuture<'_, Result<(), FactError>> {
        self.save_run(w)
    }

    /// Forgets a run's record (`save_run` of a deletion) and says whether
    /// the run may have facts: `false` only when the sink knows that none
    /// was recorded for it, so its end need not read them. Every fact
    /// recorded before the call is readable once it returns.
    fn forget_run(&self, id: String) -> BoxFuture<'_, Result<bool, FactError>> {
        Box::pin(async move { self.save_run(RunWrite::Delete(id)).await.map(|()| true) })
    }

    /// The run records kept by `save_run` (read once, at start).
    fn load_runs(&self) -> Result<Vec<RunRecord>, FactError> {
        Ok(vec![])
    }

    /// The store's epoch (drawn when it was made), if it has one.
    fn epoch(&self) -> Option<String> {
        None
    }

    /// The newest recorded fact's `seq` (0: none yet).
    fn head(&self) -> u64 {
        0
    }

    /// The newest signed checkpoint of the store's hash chains (a C2SP
    /// signed note), if it signs them.
    fn checkpoint(&self) -> Option<std::sync::Arc<str>> {
        None
    }

    /// Up to `limit` facts after `after`, oldest first, as stored (the
    /// fleet export). A sink without a chain gives each fact's JSON.
    fn query_stored(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<StoredFact>, FactError>> {
        Box::pin(async move {
            let facts = self
                .query(FactQuery {
                    after,
                    limit,
                    run_id: None,
                })
                .await?;
            facts
                .into_iter()
                .map(|fact| {
                    let body = serde_json::to_string(&fact).map_err(|e| FactError::Unavailable(e.to_string()))?;
                    Ok(StoredFact {
                        fact,
                        body,
                        chain: None,
                    })
                })
                .collect()
        })
    }

    /// `kind`'s records `from..=to` that have a chain value, by seq: the
    /// JSON the value covers, and the value (a sink without a chain has
    /// none).
    fn chained(&self, _kind: chain::Kind, _from: u64, _to: u64) -> BoxFuture<'_, Result<Vec<Chained>, FactError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// The newest kept checkpoint's `seq` (0: none).
    fn checkpoint_head(&self) -> u64 {
        0
    }

    /// Up to `limit` kept checkpoints after `after`, oldest first: (seq,
    /// signed note). The audit sinks export them.
    fn checkpoints(&self, _after: u64, _limit: usize) -> BoxFuture<'_, Result<Vec<(u64, String)>, FactError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Every fact up to this `seq` is exported (as last recorded here).
    fn export_cursor(&self) -> u64 {
        0
    }

    /// Records that every fact up to `seq` is exported: retention may now
    /// delete them.
    fn set_export_cursor(&self, _seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(async { Ok(()) })
    }

    /// An audit sink's cursor `key` (`sink:<name>:<log>`): every record of
    /// its log up to it is exported (0: none yet).
    fn cursor(&self, _key: &str) -> u64 {
        0
    }

    /// Moves the cursor `key` up to `seq` (never back), durably where the
    /// sink is durable.
    fn set_cursor(&self, _key: &str, _seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Bounded in-memory sink: keeps the newest `capacity` facts.
pub struct MemorySink {
    inner: Mutex<(u64, VecDeque<Fact>)>,
    capacity: usize,
    tx: broadcast::Sender<Fact>,
    /// Drawn per process: the store lives as long as the process.
    epoch: String,
    cursor: std::sync::atomic::AtomicU64,
    /// The audit sinks' cursors (one pair per configured sink).
    cursors: Mutex<std::collections::HashMap<String, u64>>,
}

impl MemorySink {
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(1024);
        MemorySink {
            inner: Mutex::new((0, VecDeque::new())),
            capacity: capacity.max(1),
            tx,
            epoch: uuid::Uuid::new_v4().to_string(),
            cursor: std::sync::atomic::AtomicU64::new(0),
            cursors: Mutex::default(),
        }
    }
}

impl FactSink for MemorySink {
    fn record(&self, mut fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        let res = match self.inner.lock() {
            Ok(mut g) => {
                g.0 += 1;
                fact.seq = g.0;
                fact.epoch = Some(self.epoch.clone());
                if g.1.len() == self.capacity {
                    g.1.pop_front();
                }
                g.1.push_back(fact.clone());
                Ok(Recorded {
                    seq: fact.seq,
                    id: fact.id.clone(),
                })
            }
            Err(_) => Err(FactError::Unavailable("memory sink poisoned".into())),
        };
        if res.is_ok() {
            let _ = self.tx.send(fact);
        }
        Box::pin(async move { res })
    }

    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        let res = match self.inner.lock() {
            Ok(g) => Ok(g
                .1
                .iter()
                .filter(|f| f.seq > q.after && q.run_id.as_deref().is_none_or(|r| f.run_id.as_deref() == Some(r)))
                .take(q.limit)
                .cloned()
                .collect()),
            Err(_) => Err(FactError::Unavailable("memory sink poisoned".into())),
        };
        Box::pin(async move { res })
    }

    fn subscribe(&self) -> broadcast::Receiver<Fact> {
        self.tx.subscribe()
    }

    fn epoch(&self) -> Option<String> {
        Some(self.epoch.clone())
    }

    fn head(&self) -> u64 {
        self.inner.lock().map(|g| g.0).unwrap_or(0)
    }

    fn export_cursor(&self) -> u64 {
        self.cursor.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_export_cursor(&self, seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        self.cursor.fetch_max(seq, std::sync::atomic::Ordering::AcqRel);
        Box::pin(async { Ok(()) })
    }

    fn cursor(&self, key: &str) -> u64 {
        self.cursors.lock().ok().and_then(|c| c.get(key).copied()).unwrap_or(0)
    }

    fn set_cursor(&self, key: &str, seq: u64) -> BoxFuture<'_, Result<(), FactError>> {
        if let Ok(mut c) = self.cursors.lock() {
            let e = c.entry(key.to_owned()).or_insert(seq);
            *e = (*e).max(seq);
        }
        Box::pin(async { Ok(()) })
    }
}
