//! The run registry: one entry per run with its credential, state, deadline
//! clock, concurrency slots and a cancellation token that severs every open
//! fetch of the run when it ends. Lookups on the data path are lock-free
//! (papaya); the map is bounded by `max_runs` live runs plus a short-lived
//! set of tombstones so that late requests of an ended run read `run_ended`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub mod budget;
pub mod grants;
pub mod names;
pub mod owners;
pub mod pool;
pub mod slots;

/// Where a run is in its life (the data path admits only `Active`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Created,
    Active,
    Ended,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Created => "created",
            RunState::Active => "active",
            RunState::Ended => "ended",
        }
    }
}

/// How long an ended run is remembered (so its credential answers `run_ended`).
pub const TOMBSTONE_RETENTION: Duration = Duration::from_secs(300);

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    Ended,
    Expired,
    Shutdown,
    /// The run's owner let its lease expire (crashed or hung).
    LeaseExpired,
    /// The run's owner released itself (e.g. a restarted instance).
    OwnerReleased,
}

impl EndReason {
    pub const ALL: [EndReason; 5] = [
        EndReason::Ended,
        EndReason::Expired,
        EndReason::Shutdown,
        EndReason::LeaseExpired,
        EndReason::OwnerReleased,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Ended => "ended",
            EndReason::Expired => "expired",
            EndReason::Shutdown => "shutdown",
            EndReason::LeaseExpired => "lease_expired",
            EndReason::OwnerReleased => "owner_released",
        }
    }
}

/// One run.
pub struct Run {
    pub id: Arc<str>,
    pub tool: Arc<str>,
    /// SHA-256 of the secret: the secret itself is shown once, at creation,
    /// and kept nowhere (not in memory, not in the store).
    secret_hash: [u8; 32],
    state: AtomicU8,
    /// Whether the run's credential is taken only on the listener handed
    /// over for it (see [`Run::bind`]). Never cleared.
    bound: AtomicBool,
    pub labels: serde_json::Map<String, serde_json::Value>,
    /// Who created the run and holds a lease for it, if anyone.
    pub owner: Option<Arc<str>>,
    pub created_at: SystemTime,
    pub expires_at: SystemTime,
    expires: Instant,
    ended: std::sync::OnceLock<(Instant, SystemTime, EndReason)>,
    /// Fires when the run ends; every fetch of the run selects on it.
    pub cancel: CancellationToken,
    /// Wakes the fetches waiting for the run's activation.
    activated: tokio::sync::Notify,
    /// The run's concurrency slots (FIFO).
    pub slots: Arc<Semaphore>,
    pub max_slots: usize,
    /// Fetches currently waiting for a slot.
    pub waiting: AtomicUsize,
    pub max_waiting: usize,
    /// Idle upstream connections of this run (plain HTTP), for reuse by this run only.
    pub upstream: pool::UpstreamPool,
    /// Which `egress_runs_active{state}` gauge counts the run (see [`Gauged`]).
    pub gauged: AtomicU8,
    /// Places for the run's established client connections.
    pub conns: Arc<Semaphore>,
    conns_max: usize,
    /// One placeholder per credential of the tool, made when the run was
    /// created: what the child holds instead of each secret.
    pub placeholders: Box<[Placeholder]>,
    /// Occurrences of each credential's secret scrubbed out of responses
    /// (same order as `placeholders`).
    scrubbed: Box<[AtomicU64]>,
    /// Names the sandbox's DNS handed synthetic addresses for (transparent
    /// egress); empty, and allocating nothing, for other runs.
    pub names: std::sync::Mutex<names::Names>,
    /// Bytes relayed by the run's finished fetches (see `Finish`).
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    /// What the run spent of its tool's budgets (requests, rate, bytes).
    pub spent: budget::Spent,
    /// What a kernel allowed this run beyond its tool's allowlist.
    pub grants: grants::Grants,
    /// The principal the run is attributed to (`None`: the control
    /// token's): its creator, or the caller an admin attributed it to.
    principal: arc_swap::ArcSwapOption<String>,
    /// The principal that created it (`None`: the control token's).
    pub creator: Option<Arc<str>>,
    /// What the run's child executes (path → SHA-256), as its creator said.
    pub executables: std::collections::BTreeMap<String, String>,
}

const CREATED: u8 = 0;
const ACTIVE: u8 = 1;
const ENDED: u8 = 2;

impl Run {
    pub fn state(&self) -> RunState {
        match self.state.load(Ordering::Acquire) {
            CREATED => RunState::Created,
            ACTIVE if Instant::now() < self.expires => RunState::Active,
            ACTIVE => RunState::Ended,
            _ => RunState::Ended,
        }
    }

    /// The run's state once it is no longer waiting to be activated: at once
    /// unless it is created, otherwise when it is activated or ends, or
    /// after `limit` (still created).
    pub async fn settled(&self, limit: Duration) -> RunState {
        let state = self.state();
        if state != RunState::Created || limit.is_zero() {
            return state;
        }
        let activated = self.activated.notified();
        tokio::pin!(activated);
        // Registered before the state is read again, so an activation in
        // between is not missed.
        activated.as_mut().enable();
        if self.state() != RunState::Created {
            return self.state();
        }
        tokio::select! {
            _ = activated => {}
            _ = self.cancel.cancelled() => {}
            _ = tokio::time::sleep(limit) => {}
        }
        self.state()
    }

    /// Binds the run to the listener handed over for it: from now on its
    /// credential is refused on every other listener and entrance
    /// (`credential_elsewhere`), also after a restart (the record keeps it).
    /// Returns whether the run was not bound before (its record must then
    /// be written again).
    pub fn bind(&self) -> bool {
        !self.bound.swap(true, Ordering::AcqRel)
    }

    /// Whether the run is bound to its own listener ([`Run::bind`]).
    pub fn is_bound(&self) -> bool {
        self.bound.load(Ordering::Acquire)
    }

    /// Constant-time comparison of the presented secret's hash.
    pub fn secret_matches(&self, presented: &[u8]) -> bool {
        self.secret_hash.ct_eq(&sha256(presented)).into()
    }

    /// What the store keeps of the run so that it survives a restart.
    /// The principal the run is attributed to (`None`: the control token's).
    pub fn principal(&self) -> Option<Arc<String>> {
        self.principal.load_full()
    }

    /// Attributes the run to `principal` (an admin acting for its caller;
    /// `None`: the control token's).
    pub fn attribute(&self, principal: Option<&str>) {
        self.principal.store(principal.map(|p| Arc::new(p.to_owned())));
    }

    pub fn record(&self) -> RunRecord {
        let ms = |t: SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        RunRecord {
            id: self.id.to_string(),
            tool: self.tool.to_string(),
            owner: self.owner.as_deref().map(str::to_owned),
            labels: self.labels.clone(),
            active: self.state.load(Ordering::Acquire) == ACTIVE,
            bound: self.is_bound(),
            created_at_ms: ms(self.created_at),
            expires_at_ms: ms(self.expires_at),
            secret_sha256: hex(&self.secret_hash),
            max_slots: self.max_slots,
            max_waiting: self.max_waiting,
            max_conns: self.conns_max,
            placeholders: self.placeholders.to_vec(),
            principal: self.principal().map(|p| p.to_string()),
            creator: self.creator.as_deref().map(str::to_owned),
            executables: self.executables.clone(),
        }
    }

    /// Adds a finished fetch's bytes to the run's totals.
    pub fn count_bytes(&self, up: u64, down: u64) {
        self.bytes_up.fetch_add(up, Ordering::Relaxed);
        self.bytes_down.fetch_add(down, Ordering::Relaxed);
    }

    /// Bytes relayed by the run's finished fetches: (up, down).
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.bytes_up.load(Ordering::Relaxed),
            self.bytes_down.load(Ordering::Relaxed),
        )
    }

    pub fn ended(&self) -> Option<(SystemTime, EndReason)> {
        self.ended.get().map(|(_, t, r)| (*t, *r))
    }

    /// The placeholder of `credential`, with its index.
    pub fn placeholder(&self, credential: &str) -> Option<(usize, &Placeholder)> {
        self.placeholders
            .iter()
            .enumerate()
            .find(|(_, p)| *p.credential == *credential)
    }

    /// Counts `n` occurrences of the secret of placeholder `i` scrubbed.
    pub fn count_scrubbed(&self, i: usize, n: u64) {
        if let Some(c) = self.scrubbed.get(i) {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Scrubbed occurrences by credential name (those with at least one).
    pub fn scrubbed(&self) -> impl Iterator<Item = (&str, u64)> {
        self.placeholders
            .iter()
            .zip(self.scrubbed.iter())
            .map(|(p, n)| (&*p.credential, n.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
    }
}

/// A run's stand-in for one credential of its tool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Placeholder {
    /// The credential's name in the tool's config.
    pub credential: Box<str>,
    /// `loom-cred-` and 32 random hex digits.
    pub value: Box<str>,
}

impl Placeholder {
    /// A fresh placeholder for `credential`.
    pub fn new(credential: &str) -> Result<Placeholder, getrandom::Error> {
        Ok(Placeholder {
            credential: credential.into(),
            value: format!("loom-cred-{}", random_hex(16)?).into_boxed_str(),
        })
    }
}

/// Values of [`Run::gauged`]: moved with atomic swaps so that a run counted
/// as created or active is uncounted exactly once, whatever races.
pub struct Gauged;

impl Gauged {
    pub const NONE: u8 = 0;
    pub const CREATED: u8 = 1;
    pub const ACTIVE: u8 = 2;
}

fn sha256(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(char::from_digit(u32::from(x >> 4), 16).unwrap_or('0'));
        s.push(char::from_digit(u32::from(x & 15), 16).unwrap_or('0'));
    }
    s
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        let d = |c: u8| char::from(c).to_digit(16);
        *o = u8::try_from(d(b[2 * i])? * 16 + d(b[2 * i + 1])?).ok()?;
    }
    Some(out)
}

/// A run as the store keeps it (never the secret: its SHA-256).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    pub id: String,
    pub tool: String,
    pub owner: Option<String>,
    pub labels: serde_json::Map<String, serde_json::Value>,
    pub active: bool,
    /// Bound to the listener handed over for it ([`Run::bind`]). Records of
    /// a store older than this field get it when the store is migrated
    /// (`facts::store`); a record without it reads as unbound.
    #[serde(default)]
    pub bound: bool,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub secret_sha256: String,
    pub max_slots: usize,
    pub max_waiting: usize,
    pub max_conns: usize,
    /// Kept so a restarted proxy still knows the child's placeholders.
    #[serde(default)]
    pub placeholders: Vec<Placeholder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creator: Option<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub executables: std::collections::BTreeMap<String, String>,
}

/// A change to a stored run.
#[derive(Debug, Clone, PartialEq)]
pub enum RunWrite {
    /// Created: keep (or replace) the record.
    Save(RunRecord),
    /// Activated: replace the record if it is still kept, so that a write
    /// that lost a race with the run's end cannot bring the run back.
    Update(RunRecord),
    /// Ended: nothing of it needs to survive a restart.
    Delete(String),
}

/// Errors the control API maps to HTTP answers.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("run id {0:?} already exists")]
    Exists(String),
    #[error("too many live runs (max_runs = {0})")]
    TooMany(usize),
    #[error("no run {0:?}")]
    NotFound(String),
    #[error("run {0:?} has ended")]
    Ended(String),
}

/// Parameters of a new run.
pub struct NewRun {
    pub id: String,
    pub tool: Arc<str>,
    pub labels: serde_json::Map<String, serde_json::Value>,
    pub owner: Option<Arc<str>>,
    pub activate: bool,
    pub max_slots: usize,
    pub max_waiting: usize,
    pub max_conns: usize,
    pub placeholders: Vec<Placeholder>,
    /// The principal it is attributed to (`None`: the control token's).
    pub principal: Option<Arc<str>>,
    /// The principal that created it (`None`: the control token's).
    pub creator: Option<Arc<str>>,
    pub executables: std::collections::BTreeMap<String, String>,
}

/// The registry.
pub struct Runs {
    map: papaya::HashMap<Arc<str>, Arc<Run>>,
    live: AtomicUsize,
    max_runs: usize,
    max_run: Duration,
}

/// Run ids: safe in a URL's userinfo, in logs and as a Basic-auth user
/// (the rule the OpenAPI document states, in `egress-api`).
pub use egress_api::rules::valid_id as valid_run_id;

/// A fresh random token, hex-encoded.
pub fn random_hex(bytes: usize) -> Result<String, getrandom::Error> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf)?;
    let mut s = String::with_capacity(bytes * 2);
    for b in buf {
        s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
        s.push(char::from_digit(u32::from(b & 15), 16).unwrap_or('0'));
    }
    Ok(s)
}

impl Runs {
    pub fn new(max_runs: usize, max_run: Duration) -> Self {
        Runs {
            map: papaya::HashMap::new(),
            live: AtomicUsize::new(0),
            max_runs,
            max_run,
        }
    }

    /// Looks a run up by id (lock-free).
    pub fn get(&self, id: &str) -> Option<Arc<Run>> {
        self.map.pin().get(id).cloned()
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Creates a run with a fresh secret.
    pub fn create(&self, new: NewRun, secret: String) -> Result<Arc<Run>, RunError> {
        self.create_bound(new, secret, false)
    }

    /// Creates a run with a fresh secret, bound to the listener that will
    /// be handed over for it if `bound` ([`Run::bind`]): its credential is
    /// refused elsewhere from its first instant.
    pub fn create_bound(&self, new: NewRun, secret: String, bound: bool) -> Result<Arc<Run>, RunError> {
        // Reserve a live slot first so concurrent creates cannot overshoot.
        if self.live.fetch_add(1, Ordering::AcqRel) >= self.max_runs {
            self.live.fetch_sub(1, Ordering::AcqRel);
            return Err(RunError::TooMany(self.max_runs));
        }
        let now = Instant::now();
        let wall = SystemTime::now();
        self.insert(
            new,
            sha256(secret.as_bytes()),
            bound,
            (wall, wall + self.max_run),
            now + self.max_run,
        )
    }

    /// Brings back a run the store kept across a restart. Runs past their
    /// expiry, with a bad record, or beyond `max_runs` are not restored.
    pub fn restore(&self, rec: RunRecord) -> Option<Arc<Run>> {
        let epoch = std::time::UNIX_EPOCH;
        let expires_at = epoch + Duration::from_millis(rec.expires_at_ms);
        let left = expires_at.duration_since(SystemTime::now()).ok()?;
        let hash = unhex32(&rec.secret_sha256)?;
        if self.live.fetch_add(1, Ordering::AcqRel) >= self.max_runs {
            self.live.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let new = NewRun {
            id: rec.id,
            tool: Arc::from(rec.tool.as_str()),
            labels: rec.labels,
            owner: rec.owner.map(|o| Arc::from(o.as_str())),
            activate: rec.active,
            max_slots: rec.max_slots,
            max_waiting: rec.max_waiting,
            max_conns: rec.max_conns,
            placeholders: rec.placeholders,
            principal: rec.principal.map(|p| Arc::from(p.as_str())),
            creator: rec.creator.map(|p| Arc::from(p.as_str())),
            executables: rec.executables,
        };
        let created = epoch + Duration::from_millis(rec.created_at_ms);
        // Bound whether or not its listener is ever handed over again.
        self.insert(new, hash, rec.bound, (created, expires_at), Instant::now() + left)
            .ok()
    }

    /// Inserts a run whose live place is already reserved.
    fn insert(
        &self,
        new: NewRun,
        secret_hash: [u8; 32],
        bound: bool,
        (created_at, expires_at): (SystemTime, SystemTime),
        expires: Instant,
    ) -> Result<Arc<Run>, RunError> {
        let run = Arc::new(Run {
            id: Arc::from(new.id.as_str()),
            tool: new.tool,
            secret_hash,
            state: AtomicU8::new(if new.activate { ACTIVE } else { CREATED }),
            bound: AtomicBool::new(bound),
            labels: new.labels,
            owner: new.owner,
            created_at,
            expires_at,
            expires,
            ended: std::sync::OnceLock::new(),
            cancel: CancellationToken::new(),
            activated: tokio::sync::Notify::new(),
            slots: Arc::new(Semaphore::new(new.max_slots)),
            max_slots: new.max_slots,
            waiting: AtomicUsize::new(0),
            max_waiting: new.max_waiting,
            upstream: pool::UpstreamPool::new(new.max_slots),
            gauged: AtomicU8::new(if new.activate { Gauged::ACTIVE } else { Gauged::CREATED }),
            conns: Arc::new(Semaphore::new(new.max_conns)),
            conns_max: new.max_conns,
            scrubbed: new.placeholders.iter().map(|_| AtomicU64::new(0)).collect(),
            names: Default::default(),
            placeholders: new.placeholders.into_boxed_slice(),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            spent: budget::Spent::default(),
            grants: grants::Grants::default(),
            principal: arc_swap::ArcSwapOption::new(new.principal.map(|p| Arc::new(p.to_string()))),
            creator: new.creator,
            executables: new.executables,
        });
        let map = self.map.pin();
        match map.try_insert(run.id.clone(), run.clone()) {
            Ok(_) => Ok(run),
            Err(_) => {
                self.live.fetch_sub(1, Ordering::AcqRel);
                Err(RunError::Exists(new.id))
            }
        }
    }

    /// created → active.
    pub fn activate(&self, id: &str) -> Result<Arc<Run>, RunError> {
        let run = self.get(id).ok_or_else(|| RunError::NotFound(id.to_owned()))?;
        match run
            .state
            .compare_exchange(CREATED, ACTIVE, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) | Err(ACTIVE) if run.state() == RunState::Active => {
                run.activated.notify_waiters();
                Ok(run)
            }
            _ => Err(RunError::Ended(id.to_owned())),
        }
    }

    /// Ends a run: revokes the credential, severs its fetches, frees its slots.
    /// Returns false if it had already ended.
    pub fn end(&self, run: &Run, why: EndReason) -> bool {
        if run.state.swap(ENDED, Ordering::AcqRel) == ENDED {
            return false;
        }
        let _ = run.ended.set((Instant::now(), SystemTime::now(), why));
        run.cancel.cancel();
        run.upstream.clear();
        self.live.fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Ends expired runs and forgets old tombstones. Returns the runs it expired.
    pub fn sweep(&self, now: Instant) -> Vec<Arc<Run>> {
        let mut expired = vec![];
        let mut forget = vec![];
        {
            let map = self.map.pin();
            for (id, run) in map.iter() {
                if run.state.load(Ordering::Acquire) != ENDED && now >= run.expires {
                    expired.push(run.clone());
                } else if run.state.load(Ordering::Acquire) != ENDED {
                    run.upstream.prune();
                } else if let Some((at, _, _)) = run.ended.get() {
                    if now.saturating_duration_since(*at) >= TOMBSTONE_RETENTION
                        || map.len() > self.max_runs.saturating_mul(2)
                    {
                        forget.push(id.clone());
                    }
                }
            }
            for id in forget {
                map.remove(&id);
            }
        }
        expired.retain(|r| self.end(r, EndReason::Expired));
        expired
    }

    /// Runs not yet ended.
    /// Every run the registry holds (live runs and recent tombstones).
    pub fn all(&self) -> Vec<Arc<Run>> {
        self.map.pin().iter().map(|(_, r)| r.clone()).collect()
    }

    /// Live runs owned by `owner`.
    pub fn live_runs_of(&self, owner: &str) -> Vec<Arc<Run>> {
        self.map
            .pin()
            .iter()
            .filter(|(_, r)| r.state.load(Ordering::Acquire) != ENDED && r.owner.as_deref() == Some(owner))
            .map(|(_, r)| r.clone())
            .collect()
    }

    pub fn live_runs(&self) -> Vec<Arc<Run>> {
        self.map
            .pin()
            .iter()
            .filter(|(_, r)| r.state.load(Ordering::Acquire) != ENDED)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(id: &str, activate: bool) -> NewRun {
        NewRun {
            principal: None,
            executables: Default::default(),
            creator: None,
            id: id.into(),
            tool: Arc::from("t"),
            labels: Default::default(),
            owner: None,
            activate,
            max_slots: 2,
            max_waiting: 4,
            max_conns: 8,
            placeholders: vec![],
        }
    }

    #[test]
    fn lifecycle() {
        let runs = Runs::new(2, Duration::from_secs(60));
        let r = runs.create(new("a", false), "s3cret".into()).unwrap();
        assert_eq!(r.state(), RunState::Created);
        assert!(matches!(
            runs.create(new("a", true), "x".into()),
            Err(RunError::Exists(_))
        ));
        runs.create(new("b", true), "x".into()).unwrap();
        assert!(matches!(
            runs.create(new("c", true), "x".into()),
            Err(RunError::TooMany(2))
        ));
        runs.activate("a").unwrap();
        assert_eq!(r.state(), RunState::Active);
        assert!(r.secret_matches(b"s3cret") && !r.secret_matches(b"s3creT") && !r.secret_matches(b"s3cre"));
        assert!(runs.end(&r, EndReason::Ended));
        assert!(!runs.end(&r, EndReason::Ended));
        assert!(r.cancel.is_cancelled());
        assert_eq!(r.state(), RunState::Ended);
        assert!(runs.activate("a").is_err());
        runs.create(new("c", true), "x".into()).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_created_run_settles_when_activated_or_ended_or_after_its_limit() {
        let runs = Arc::new(Runs::new(10, Duration::from_secs(60)));
        let wait = Duration::from_secs(5);
        // Activated while a fetch waits: it goes on as active.
        let a = runs.create(new("a", false), "x".into()).unwrap();
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { (a.settled(wait).await, tokio::time::Instant::now()) }
        });
        tokio::task::yield_now().await;
        let activated_at = tokio::time::Instant::now();
        runs.activate("a").unwrap();
        assert_eq!(waiting.await.unwrap(), (RunState::Active, activated_at));
        // Ended instead: it is ended, at once.
        let b = runs.create(new("b", false), "x".into()).unwrap();
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { (b.settled(wait).await, tokio::time::Instant::now()) }
        });
        tokio::task::yield_now().await;
        let ended_at = tokio::time::Instant::now();
        runs.end(&b, EndReason::Ended);
        assert_eq!(waiting.await.unwrap(), (RunState::Ended, ended_at));
        // Neither: still created after the limit; no limit, no wait.
        let c = runs.create(new("c", false), "x".into()).unwrap();
        let t0 = tokio::time::Instant::now();
        assert_eq!(c.settled(wait).await, RunState::Created);
        assert_eq!(t0.elapsed(), wait);
        let t0 = tokio::time::Instant::now();
        assert_eq!(c.settled(Duration::ZERO).await, RunState::Created);
        assert_eq!(t0.elapsed(), Duration::ZERO);
        // Already active: no wait either.
        runs.activate("c").unwrap();
        assert_eq!(c.settled(wait).await, RunState::Active);
    }

    #[test]
    fn expiry() {
        let runs = Runs::new(10, Duration::from_millis(1000));
        let r = runs.create(new("a", true), "x".into()).unwrap();
        assert!(runs.sweep(Instant::now()).is_empty());
        let later = Instant::now() + Duration::from_secs(2);
        assert_eq!(runs.sweep(later).len(), 1);
        assert!(r.cancel.is_cancelled());
        assert_eq!(runs.live(), 0);
        assert!(runs.get("a").is_some());
        runs.sweep(later + TOMBSTONE_RETENTION);
        assert!(runs.get("a").is_none());
    }

    /// A run bound at creation or later (its listener's hand-off) stays
    /// bound, and its record brings it back bound after a restart, whether
    /// or not a listener is ever handed over again.
    #[test]
    fn a_binding_is_kept_in_the_record_and_restored() {
        let runs = Runs::new(10, Duration::from_secs(60));
        let declared = runs.create_bound(new("d", false), "x".into(), true).unwrap();
        let later = runs.create(new("l", true), "x".into()).unwrap();
        let never = runs.create(new("n", true), "x".into()).unwrap();
        assert!(declared.is_bound() && !later.is_bound());
        assert!(!declared.bind(), "already bound");
        assert!(later.bind(), "bound by the hand-off");
        assert!(!later.bind());
        let restarted = Runs::new(10, Duration::from_secs(60));
        for (run, bound) in [(&declared, true), (&later, true), (&never, false)] {
            let rec = run.record();
            assert_eq!(rec.bound, bound, "{}", run.id);
            let back: RunRecord = serde_json::from_str(&serde_json::to_string(&rec).unwrap()).unwrap();
            assert_eq!(restarted.restore(back).unwrap().is_bound(), bound, "{}", run.id);
        }
        // A record without the field (migrated stores have it) reads unbound.
        let mut v = serde_json::to_value(never.record()).unwrap();
        v.as_object_mut().unwrap().remove("bound");
        assert!(!serde_json::from_value::<RunRecord>(v).unwrap().bound);
    }

    #[test]
    fn run_ids() {
        assert!(valid_run_id("run-1.A_b~"));
        for bad in ["", "a:b", "a@b", "a/b", "a b", "é"] {
            assert!(!valid_run_id(bad), "{bad}");
        }
        assert!(!valid_run_id(&"a".repeat(129)));
    }
}
