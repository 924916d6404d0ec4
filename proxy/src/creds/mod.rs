//! Live credential sources: a file with `ttl_ms`, a command, a token the
//! proxy mints (OAuth2). One refresher task per live credential reads or
//! mints its value ahead of need (one request to a token endpoint however
//! many fetches wait: they never mint, they use the value in force), keeps
//! the last good value while reads fail, and puts each new value into the
//! policy in force ([`Live::adopt`]): there it is the credential's
//! `secret` like a static one, injected, scrubbed from answers and refused
//! anywhere else by the same code. Past its usable time (a token's expiry,
//! a value's `ttl_ms` + `stale_ms`), or before any value was read, a
//! request needing it is `credential_unavailable` (503, a fact).
//!
//! This room knows no `Shared`: the refreshers reach the proxy through
//! [`Env`], which the state implements.

mod aws;
mod command;
mod http;
mod oauth2;
pub(crate) mod sigv4;

use crate::ca::Authority;
use crate::dns::{Dial, Resolve};
use crate::metrics::{CredentialOutcome, Metrics, ToolCredential};
use egress_config::sources::{Grant, LiveKind, LiveSource};
use egress_config::{Policy, RangeTable, Secret, SecretSource};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;

pub use command::run_command;

/// What a refresher needs of the proxy.
pub trait Env: Send + Sync + 'static {
    fn resolver(&self) -> &dyn Resolve;
    fn dialer(&self) -> &dyn Dial;
    /// The address ranges of the policy in force (a token endpoint's
    /// addresses are vetted like a fetch's).
    fn ranges(&self) -> RangeTable;
    /// Verifies token endpoints' TLS (the roots of intercepted origins).
    fn authority(&self) -> Arc<Authority>;
    fn metrics(&self) -> &Metrics;
    /// Puts the refreshers' values into the policy in force.
    fn apply(&self);
}

/// The outcome of one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
    Timeout,
}

impl Outcome {
    pub const ALL: [Outcome; 3] = [Outcome::Ok, Outcome::Error, Outcome::Timeout];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
        }
    }
}

/// A value read, with its own expiry if it said one.
#[derive(Debug, Clone)]
pub struct Fresh {
    pub value: Secret,
    pub expires_at: Option<SystemTime>,
    /// A refresh token the endpoint rotated to.
    pub refresh_token: Option<Secret>,
    /// Temporary AWS keys (`assume_role`): the key id and session token
    /// that go with `value`, the secret key.
    pub aws: Option<AwsIds>,
}

/// The key id and session token of temporary AWS keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsIds {
    pub key_id: Secret,
    pub session_token: Secret,
}

impl Fresh {
    /// A value with neither expiry nor companions.
    pub fn value(value: Secret) -> Fresh {
        Fresh {
            value,
            expires_at: None,
            refresh_token: None,
            aws: None,
        }
    }
}

/// Why a read failed: the message names the source and the cause (an HTTP
/// status, an exit code), never a value or a body.
#[derive(Debug, Clone)]
pub struct Failure {
    pub outcome: Outcome,
    pub message: String,
}

impl Failure {
    pub fn error(message: impl Into<String>) -> Failure {
        Failure {
            outcome: Outcome::Error,
            message: message.into(),
        }
    }
}

/// What a live credential's refresher knows (never shown with the value).
#[derive(Debug, Clone, Default)]
struct State {
    value: Option<Secret>,
    /// The value before `value`, with how long it stays valid.
    previous: Option<(Secret, SystemTime)>,
    /// Until when `value` may be used.
    usable_until: Option<SystemTime>,
    /// When the value in hand was read.
    read_at: Option<SystemTime>,
    last_attempt: Option<SystemTime>,
    last_outcome: Option<Outcome>,
    last_error: Option<String>,
    /// A rotated refresh token (`oauth2_refresh_token`).
    refresh_token: Option<Secret>,
    /// The key id and session token that go with `value` (`assume_role`).
    aws: Option<AwsIds>,
    next_at: Option<SystemTime>,
}

/// One live credential.
struct Entry {
    tool: Arc<str>,
    name: Arc<str>,
    source: Arc<LiveSource>,
    state: Mutex<State>,
    stop: CancellationToken,
}

impl Entry {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn label(&self) -> ToolCredential {
        ToolCredential {
            tool: self.tool.to_string(),
            credential: self.name.to_string(),
        }
    }
}

type Key = (Arc<str>, Arc<str>);

/// The live credentials of the policy in force, each with its refresher.
#[derive(Default)]
pub struct Live {
    entries: Mutex<HashMap<Key, Arc<Entry>>>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How a live credential stands, for the run view and `check`.
#[derive(Debug, Clone)]
pub struct Status {
    pub tool: Arc<str>,
    pub name: Arc<str>,
    pub kind: &'static str,
    pub read_at: Option<SystemTime>,
    pub usable_until: Option<SystemTime>,
    pub last_attempt: Option<SystemTime>,
    pub last_outcome: Option<Outcome>,
    pub last_error: Option<String>,
    pub next_at: Option<SystemTime>,
}

fn live_sources(policy: &Policy) -> impl Iterator<Item = (&Arc<str>, &Arc<str>, &Arc<LiveSource>)> {
    policy.tools.values().flat_map(|t| {
        t.credentials.iter().filter_map(move |c| match &c.source {
            SecretSource::Live(l) => Some((&t.id, &c.name, l)),
            _ => None,
        })
    })
}

impl Live {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a refresher for each live credential of `policy` that has
    /// none (or whose source changed), and waits for each new one's first
    /// read (each bounded by its source's timeout), so that a policy put
    /// in force after this has their values. Existing ones keep theirs.
    pub async fn prime(&self, env: Weak<dyn Env>, policy: &Policy) {
        let mut first = vec![];
        {
            let mut entries = self.entries();
            for (tool, name, source) in live_sources(policy) {
                let key = (tool.clone(), name.clone());
                if entries.get(&key).is_some_and(|e| e.source == *source) {
                    continue;
                }
                if let Some(old) = entries.remove(&key) {
                    old.stop.cancel();
                }
                let e = Arc::new(Entry {
                    tool: tool.clone(),
                    name: name.clone(),
                    source: source.clone(),
                    state: Mutex::default(),
                    stop: CancellationToken::new(),
                });
                if let Some(env) = env.upgrade() {
                    let m = env.metrics();
                    for o in Outcome::ALL {
                        let _ = m.credential_refresh.get_or_create(&CredentialOutcome {
                            tool: tool.to_string(),
                            credential: name.to_string(),
                            outcome: o.as_str(),
                        });
                    }
                    let _ = m.credential_expiry.get_or_create(&e.label());
                }
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(refresher(e.clone(), env.clone(), tx));
                first.push((rx, timeout_of(source)));
                entries.insert(key, e);
            }
        }
        for (rx, timeout) in first {
            let _ = tokio::time::timeout(timeout + Duration::from_secs(1), rx).await;
        }
    }

    /// Stops the refreshers of credentials `policy` no longer has live.
    pub fn retain(&self, env: Option<&dyn Env>, policy: &Policy) {
        let keep: BTreeSet<(&str, &str)> = live_sources(policy).map(|(t, n, _)| (&**t, &**n)).collect();
        self.entries().retain(|(t, n), e| {
            let kept = keep.contains(&(&**t, &**n));
            if !kept {
                e.stop.cancel();
                if let Some(env) = env {
                    let m = env.metrics();
                    for o in Outcome::ALL {
                        m.credential_refresh.remove(&CredentialOutcome {
                            tool: t.to_string(),
                            credential: n.to_string(),
                            outcome: o.as_str(),
                        });
                    }
                    m.credential_expiry.remove(&e.label());
                }
            }
            kept
        });
    }

    /// Stops every refresher (shutdown).
    pub fn stop(&self) {
        for e in self.entries().values() {
            e.stop.cancel();
        }
    }

    /// Writes each live credential's value, usable time and earlier value
    /// into `policy` (unavailable where no refresher has a value), and
    /// rebuilds the secret scans of the tools that changed. Whether
    /// anything changed.
    pub fn adopt(&self, policy: &mut Policy) -> bool {
        let now = SystemTime::now();
        let entries = self.entries();
        let mut changed = BTreeSet::new();
        for (id, t) in policy.tools.iter_mut() {
            for i in 0..t.credentials.len() {
                let c = &t.credentials[i];
                let SecretSource::Live(source) = &c.source else {
                    continue;
                };
                let key = (t.id.clone(), c.name.clone());
                let (secret, until, previous, aws) = match entries.get(&key).filter(|e| e.source == *source) {
                    Some(e) => {
                        let s = e.state();
                        let previous: Vec<Secret> = s
                            .previous
                            .iter()
                            .filter(|(_, until)| *until > now)
                            .map(|(v, _)| v.clone())
                            .collect();
                        match &s.value {
                            Some(v) => (
                                v.clone(),
                                s.usable_until.unwrap_or(SystemTime::UNIX_EPOCH),
                                previous,
                                s.aws.clone(),
                            ),
                            None => (Secret::default(), SystemTime::UNIX_EPOCH, previous, None),
                        }
                    }
                    None => (Secret::default(), SystemTime::UNIX_EPOCH, vec![], None),
                };
                // Keys from assume_role: the key id and token go with the secret.
                let ids = match (&c.sign, &aws) {
                    (Some(sign), Some(a)) if sign.access_key_id.is_none() => {
                        Some((a.key_id.clone(), a.session_token.clone()))
                    }
                    (Some(sign), None) if sign.access_key_id.is_none() => Some((Secret::default(), Secret::default())),
                    _ => None,
                };
                let ids_same = match (&c.sign, &ids) {
                    (Some(sign), Some((k, t))) => sign.key_id == *k && sign.token == *t,
                    _ => true,
                };
                if c.secret == secret && c.usable_until == Some(until) && c.previous == previous && ids_same {
                    continue;
                }
                let c = &mut Arc::make_mut(t).credentials[i];
                c.secret = secret;
                c.usable_until = Some(until);
                c.previous = previous;
                if let (Some(sign), Some((k, tok))) = (&mut c.sign, ids) {
                    let sign = Arc::make_mut(sign);
                    sign.key_id = k;
                    sign.token = tok;
                }
                changed.insert(id.clone());
            }
        }
        if changed.is_empty() {
            return false;
        }
        policy.index_secrets_of(&changed);
        true
    }

    /// How each live credential stands (of `tool`, or all).
    pub fn statuses(&self, tool: Option<&str>) -> Vec<Status> {
        let mut out: Vec<Status> = self
            .entries()
            .values()
            .filter(|e| tool.is_none_or(|t| *e.tool == *t))
            .map(|e| {
                let s = e.state();
                Status {
                    tool: e.tool.clone(),
                    name: e.name.clone(),
                    kind: e.source.kind.name(),
                    read_at: s.read_at,
                    usable_until: s.usable_until,
                    last_attempt: s.last_attempt,
                    last_outcome: s.last_outcome,
                    last_error: s.last_error.clone(),
                    next_at: s.next_at,
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.tool, &a.name).cmp(&(&b.tool, &b.name)));
        out
    }
}

/// The longest one read of `source` may take.
fn timeout_of(source: &LiveSource) -> Duration {
    match &source.kind {
        LiveKind::File(_) => Duration::from_secs(5),
        LiveKind::Command(c) => c.timeout,
        LiveKind::OAuth2(o) => o.timeout,
        LiveKind::AwsSecretsManager(a) => a.timeout,
        LiveKind::AwsAssumeRole(a) => a.timeout,
    }
}

/// Reads `e`'s source once.
async fn read(e: &Entry, env: &dyn Env) -> Result<Fresh, Failure> {
    match &e.source.kind {
        LiveKind::File(path) => {
            let path = path.clone();
            let r = tokio::task::spawn_blocking(move || egress_config::sources::read_file(&path)).await;
            match r {
                Ok(Ok(value)) => Ok(Fresh::value(value)),
                Ok(Err(m)) => Err(Failure::error(m)),
                Err(e) => Err(Failure::error(format!("reading the file failed: {e}"))),
            }
        }
        LiveKind::Command(c) => {
            let c = c.clone();
            match tokio::task::spawn_blocking(move || run_command(&c)).await {
                Ok(r) => r,
                Err(e) => Err(Failure::error(format!("the command's thread failed: {e}"))),
            }
        }
        LiveKind::AwsSecretsManager(a) => aws::get_secret(a, env).await,
        LiveKind::AwsAssumeRole(a) => aws::assume_role(a, env).await,
        LiveKind::OAuth2(o) => {
            let rotated = e.state().refresh_token.clone();
            let fresh = oauth2::mint(o, &e.source.refresh, rotated.clone(), env).await?;
            if let (Grant::RefreshToken { refresh_token }, Some(new)) = (&o.grant, &fresh.refresh_token) {
                if rotated.as_ref() != Some(new) {
                    write_back(e, refresh_token, new).await;
                }
            }
            Ok(fresh)
        }
    }
}

/// Writes a rotated refresh token back to its `file` source (mode 0600,
/// replaced whole), so that a restart starts from it.
async fn write_back(e: &Entry, source: &SecretSource, token: &Secret) {
    let path = match source {
        SecretSource::File(p) => p.clone(),
        SecretSource::Live(l) => match &l.kind {
            LiveKind::File(p) => p.clone(),
            _ => return,
        },
        SecretSource::Env(_) => return,
    };
    let text = format!("{}\n", token.expose());
    let r = tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let tmp = path.with_extension("loom-tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })
    .await;
    match r {
        Ok(Ok(())) => {
            tracing::info!(tool = %e.tool, credential = %e.name, "rotated refresh token written back to its file")
        }
        Ok(Err(err)) => {
            tracing::warn!(tool = %e.tool, credential = %e.name, error = %err, "cannot write the rotated refresh token back to its file (kept in memory)")
        }
        Err(err) => {
            tracing::warn!(tool = %e.tool, credential = %e.name, error = %err, "cannot write the rotated refresh token back")
        }
    }
}

/// One live credential's refresher: reads, records, applies, sleeps
/// until the next read is due; until stopped or the proxy is gone.
async fn refresher(e: Arc<Entry>, env: Weak<dyn Env>, first: tokio::sync::oneshot::Sender<()>) {
    let mut first = Some(first);
    loop {
        let Some(en) = env.upgrade() else { return };
        let r = tokio::select! {
            r = read(&e, &*en) => r,
            _ = e.stop.cancelled() => return,
        };
        let next = record(&e, &*en, r);
        en.apply();
        drop(en);
        if let Some(f) = first.take() {
            let _ = f.send(());
        }
        tokio::select! {
            _ = tokio::time::sleep(next) => {}
            _ = e.stop.cancelled() => return,
        }
    }
}

/// The shortest wait between two reads.
const MIN_WAIT: Duration = Duration::from_millis(100);

/// Records a read's result in `e`'s state and metrics; how long until the
/// next read.
fn record(e: &Entry, env: &dyn Env, r: Result<Fresh, Failure>) -> Duration {
    let now = SystemTime::now();
    let refresh = &e.source.refresh;
    let m = env.metrics();
    let mut s = e.state();
    s.last_attempt = Some(now);
    let outcome = match &r {
        Ok(_) => Outcome::Ok,
        Err(f) => f.outcome,
    };
    m.credential_refresh
        .get_or_create(&CredentialOutcome {
            tool: e.tool.to_string(),
            credential: e.name.to_string(),
            outcome: outcome.as_str(),
        })
        .inc();
    s.last_outcome = Some(outcome);
    let wait = match r {
        Ok(fresh) => {
            s.last_error = None;
            let until = match fresh.expires_at {
                Some(t) => t,
                None => now + refresh.ttl + refresh.stale,
            };
            if s.value.as_ref().is_some_and(|v| *v != fresh.value) {
                if let (Some(old), Some(old_until)) = (s.value.take(), s.usable_until) {
                    s.previous = Some((old, old_until));
                }
            }
            s.value = Some(fresh.value);
            s.aws = fresh.aws;
            s.usable_until = Some(until);
            s.read_at = Some(now);
            if let Some(rt) = fresh.refresh_token {
                s.refresh_token = Some(rt);
            }
            match fresh.expires_at {
                Some(t) => {
                    let life = t.duration_since(now).unwrap_or_default();
                    life.saturating_sub(refresh.refresh_before.min(life / 2))
                }
                None => refresh.ttl,
            }
        }
        Err(f) => {
            // Logged with its cause (a status, an exit code), never a value or a body.
            tracing::warn!(tool = %e.tool, credential = %e.name, source = e.source.kind.name(), outcome = outcome.as_str(), error = %f.message, "credential refresh failed");
            s.last_error = Some(f.message);
            // Sooner when the value in hand runs out first.
            let left = s
                .usable_until
                .and_then(|u| u.duration_since(now).ok())
                .filter(|_| s.value.is_some());
            match left {
                Some(left) => refresh.failure_ttl.min(left / 2),
                None => refresh.failure_ttl,
            }
        }
    }
    .max(MIN_WAIT);
    let expiry = s
        .usable_until
        .and_then(|u| u.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    m.credential_expiry.get_or_create(&e.label()).set(expiry);
    s.next_at = Some(now + wait);
    wait
}

/// What `check` says of a credential's source: its kind, and for a live
/// file or command the outcome of one read now (with its expiry, if it
/// said one); for a minted token, whether its nested sources read. Never a
/// value.
pub fn describe(source: &SecretSource) -> String {
    let ms = |d: Duration| d.as_millis();
    let expiry = |f: &Fresh| match f.expires_at {
        Some(t) => format!(", expires {}", crate::time::rfc3339(t)),
        None => String::new(),
    };
    match source {
        SecretSource::Env(n) => format!("env {n} (read at start and on reload)"),
        SecretSource::File(p) => format!("file {} (read at start and on reload)", p.display()),
        SecretSource::Live(l) => match &l.kind {
            LiveKind::File(p) => {
                let now = match egress_config::sources::read_file(p) {
                    Ok(_) => "read now: ok".to_owned(),
                    Err(e) => format!("read now: FAILED: {e}"),
                };
                format!(
                    "file {}, re-read every {} ms, served {} ms stale at most ({now})",
                    p.display(),
                    ms(l.refresh.ttl),
                    ms(l.refresh.stale)
                )
            }
            LiveKind::Command(c) => {
                let now = match run_command(c) {
                    Ok(f) => format!("ran now: ok{}", expiry(&f)),
                    Err(f) => format!("ran now: FAILED ({}): {}", f.outcome.as_str(), f.message),
                };
                format!(
                    "command {}, every {} ms, timeout {} ms, served {} ms stale at most ({now})",
                    c.argv[0],
                    ms(l.refresh.ttl),
                    ms(c.timeout),
                    ms(l.refresh.stale)
                )
            }
            LiveKind::AwsSecretsManager(a) => {
                let keys = match aws::own_keys() {
                    Ok(_) => "the proxy's AWS keys are found".to_owned(),
                    Err(e) => format!("FAILED: {e}"),
                };
                format!(
                    "aws_secrets_manager {} in {} at {}{}, every {} ms, served {} ms stale at most ({keys}; the proxy reads it at start)",
                    a.secret_id,
                    a.region,
                    a.endpoint.text,
                    a.json_key.as_deref().map(|k| format!(", member {k}")).unwrap_or_default(),
                    ms(l.refresh.ttl),
                    ms(l.refresh.stale)
                )
            }
            LiveKind::AwsAssumeRole(a) => {
                let keys = match aws::own_keys() {
                    Ok(_) => "the proxy's AWS keys are found".to_owned(),
                    Err(e) => format!("FAILED: {e}"),
                };
                format!(
                    "aws_sts_assume_role {} at {} for {} s, refreshed {} ms before expiry ({keys}; the proxy assumes it at start)",
                    a.role_arn,
                    a.endpoint.text,
                    a.duration_s,
                    ms(l.refresh.refresh_before)
                )
            }
            LiveKind::OAuth2(o) => {
                let mut nested = vec![];
                if let Some(cs) = &o.client_secret {
                    nested.push(match read_nested(cs, "client_secret") {
                        Ok(_) => "client_secret reads".to_owned(),
                        Err(f) => format!("FAILED: {}", f.message),
                    });
                }
                if let Grant::RefreshToken { refresh_token } = &o.grant {
                    nested.push(match read_nested(refresh_token, "refresh_token") {
                        Ok(_) => "refresh_token reads".to_owned(),
                        Err(f) => format!("FAILED: {}", f.message),
                    });
                }
                format!(
                    "minted ({}) at {} as client {}, refreshed {} ms before expiry ({}; the proxy mints at start)",
                    l.kind.name(),
                    o.token_url.text,
                    o.client_id,
                    ms(l.refresh.refresh_before),
                    nested.join(", ")
                )
            }
        },
    }
}

/// The refresh token a refresh uses: the rotated one in memory, else its
/// source read now.
pub(crate) fn refresh_token_of(grant: &Grant, rotated: Option<Secret>) -> Result<Secret, Failure> {
    match (grant, rotated) {
        (_, Some(t)) => Ok(t),
        (Grant::RefreshToken { refresh_token }, None) => read_nested(refresh_token, "refresh_token"),
        (Grant::ClientCredentials, None) => Err(Failure::error("no refresh token")),
    }
}

/// A source nested in a mint (`client_secret`, `refresh_token`), read now.
pub(crate) fn read_nested(source: &SecretSource, what: &str) -> Result<Secret, Failure> {
    let r = match egress_config::sources::read_simple(source) {
        Some(r) => r,
        None => match source {
            SecretSource::Live(l) => match &l.kind {
                LiveKind::Command(c) => run_command(c).map(|f| f.value).map_err(|f| f.message),
                _ => Err(
                    "a minted token or AWS secret cannot be a mint's source (use a file, the environment or a command)"
                        .into(),
                ),
            },
            _ => Err("unreadable source".into()),
        },
    };
    r.map_err(|m| Failure::error(format!("{what}: {m}")))
}

#[cfg(test)]
mod tests;
