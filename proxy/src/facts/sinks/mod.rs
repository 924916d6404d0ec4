//! The audit sinks (`[audit.sinks.NAME]`): each exports every record of
//! the store ([`records::RecordKind`]: facts, decision records, signed
//! checkpoints) as OCSF events, oldest first, by its own cursors in the
//! store (`meta` keys `sink:<name>:facts`, `…:decisions`,
//! `…:checkpoints`, moved through the store's writer and never back) after
//! the receiver took a batch. A restart or an
//! outage resumes after the cursor: no gap; a batch taken but not yet
//! recorded is sent again, with the same `metadata.uid`. Sinks only read
//! committed records, on their own tasks and connections, never on a
//! decision path; retention keeps what a sink has not exported.

mod file;
mod net;
mod otlp;
pub mod proto;
pub mod records;
mod syslog;

pub use otlp::severity_number;
pub use records::{Integrity, Record, RecordKind, Source, KINDS};
pub use syslog::{frame, message, severity};

use crate::dns::Resolve;
use crate::metrics::{AuditMetrics, SinkKind as SinkKindLabel, SinkLabel, SinkLog};
use egress_config::audit::{AuditConfig, SinkConfig, SinkKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Why one attempt failed: `kind` is the metric label.
#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: &'static str,
    pub message: String,
}

impl Failure {
    pub(crate) fn new(kind: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            message: message.into(),
        }
    }
}

/// A batch the receiver took.
#[derive(Debug, Clone, Copy, Default)]
pub struct Delivered {
    /// Records it said it rejected (OTLP partial success): not resent.
    pub rejected: u64,
}

/// Why the sinks cannot start.
#[derive(Debug, thiserror::Error)]
#[error("audit.sinks.{sink}: {message}")]
pub struct SinkError {
    pub sink: String,
    pub message: String,
}

/// The first pause after a failure; it doubles up to `retry_max_ms`.
const RETRY_FIRST: Duration = Duration::from_millis(100);

enum Transport {
    Otlp(otlp::Otlp),
    Syslog(syslog::Syslog),
    File(file::FileOut),
}

impl Transport {
    async fn send(&mut self, batch: &[Record]) -> Result<Delivered, Failure> {
        match self {
            Transport::Otlp(t) => t.send(batch).await,
            Transport::Syslog(t) => t.send(batch).await,
            Transport::File(t) => t.send(batch).await,
        }
    }
}

/// How long a stopping proxy waits for the sinks to deliver what is
/// committed (after the drain and the decision log's last records).
pub const FLUSH_AT_STOP: Duration = Duration::from_secs(5);

/// The running sinks.
pub struct Sinks {
    pub names: Vec<String>,
    source: Source,
    /// Each sink's cursors, in [`RecordKind::ALL`]'s order.
    cursors: Vec<Arc<[AtomicU64; KINDS]>>,
}

impl Sinks {
    /// Records committed and not yet delivered, over every sink and kind.
    pub fn lag(&self) -> u64 {
        self.cursors
            .iter()
            .flat_map(|c| {
                RecordKind::ALL
                    .into_iter()
                    .enumerate()
                    .map(|(i, k)| self.source.head(k).saturating_sub(c[i].load(Ordering::Acquire)))
            })
            .sum()
    }

    /// Waits until every committed record is delivered, or `budget` runs
    /// out; returns the lag left.
    pub async fn flush(&self, budget: Duration) -> u64 {
        let until = std::time::Instant::now() + budget;
        loop {
            let lag = self.lag();
            if lag == 0 || std::time::Instant::now() >= until {
                return lag;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The `meta` keys of every configured sink's cursor over `kind`.
pub fn cursor_keys(cfg: &AuditConfig, kind: RecordKind) -> Vec<String> {
    cfg.sinks.keys().map(|n| kind.cursor_key(n)).collect()
}

/// Builds every sink (a bad CA file or headers variable is an error now)
/// and starts each on its own task. `env` reads the environment.
pub fn start(
    cfg: &AuditConfig,
    cell: Option<&str>,
    source: Source,
    resolver: Arc<dyn Resolve>,
    metrics: AuditMetrics,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Sinks, SinkError> {
    let mut built = vec![];
    for (name, sc) in &cfg.sinks {
        let fail = |message: String| SinkError {
            sink: name.clone(),
            message,
        };
        let transport = match &sc.kind {
            SinkKind::Otlp(o) => {
                let headers = match &o.headers_env {
                    Some(var) => Some(env(var).ok_or_else(|| fail(format!("headers_env: {var} is not set")))?),
                    None => None,
                };
                Transport::Otlp(
                    otlp::Otlp::new(o, cell, headers.as_deref(), sc.timeout, resolver.clone()).map_err(fail)?,
                )
            }
            SinkKind::Syslog(s) => {
                Transport::Syslog(syslog::Syslog::new(s, cell, sc.timeout, resolver.clone()).map_err(fail)?)
            }
            SinkKind::File(f) => Transport::File(file::FileOut::new(f)),
        };
        built.push((name.clone(), sc.clone(), transport));
    }
    let mut names = vec![];
    let mut all_cursors = vec![];
    for (name, sc, transport) in built {
        metrics.sink(&name, &RecordKind::ALL.map(RecordKind::log));
        let cursors: Arc<[AtomicU64; KINDS]> =
            Arc::new(RecordKind::ALL.map(|k| AtomicU64::new(source.cursor(&name, k))));
        tracing::info!(sink = %name, kind = sc.kind.name(), facts_after = cursors[0].load(Ordering::Relaxed), decisions_after = cursors[1].load(Ordering::Relaxed), "audit sink starting");
        all_cursors.push(cursors.clone());
        let run = Run {
            name: name.clone(),
            cfg: sc,
            source: source.clone(),
            metrics: metrics.clone(),
            cursors,
        };
        tokio::spawn(run.clone_for_gauge().gauge());
        tokio::spawn(run.forever(transport));
        names.push(name);
    }
    Ok(Sinks {
        names,
        source,
        cursors: all_cursors,
    })
}

struct Run {
    name: String,
    cfg: SinkConfig,
    source: Source,
    metrics: AuditMetrics,
    /// Each kind's cursor, in [`RecordKind::ALL`]'s order.
    cursors: Arc<[AtomicU64; KINDS]>,
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A pause of `d` with jitter: uniform in [d/2, d].
fn jittered(d: Duration) -> Duration {
    let half = d / 2;
    let r = getrandom::u64().unwrap_or(0) % (u64::try_from(half.as_millis()).unwrap_or(1).max(1) + 1);
    half + Duration::from_millis(r)
}

impl Run {
    fn clone_for_gauge(&self) -> Run {
        Run {
            name: self.name.clone(),
            cfg: self.cfg.clone(),
            source: self.source.clone(),
            metrics: self.metrics.clone(),
            cursors: self.cursors.clone(),
        }
    }

    fn label(&self, kind: RecordKind) -> SinkLog {
        SinkLog {
            sink: self.name.clone(),
            log: kind.log(),
        }
    }

    /// Keeps the lag gauges current, also while the receiver is away.
    async fn gauge(self) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            for (i, kind) in RecordKind::ALL.into_iter().enumerate() {
                let lag = self
                    .source
                    .head(kind)
                    .saturating_sub(self.cursors[i].load(Ordering::Acquire));
                self.metrics
                    .lag
                    .get_or_create(&self.label(kind))
                    .set(i64::try_from(lag).unwrap_or(i64::MAX));
            }
        }
    }

    fn failed(&self, f: &Failure) {
        self.metrics
            .failures
            .get_or_create(&SinkKindLabel {
                sink: self.name.clone(),
                kind: f.kind,
            })
            .inc();
    }

    fn succeeded(&self) {
        self.metrics
            .last_success
            .get_or_create(&SinkLabel {
                sink: self.name.clone(),
            })
            .set(now_secs());
    }

    /// Reads a batch of `kind` after `after`, counting a failure.
    async fn read(&self, kind: RecordKind, after: u64) -> Option<Vec<Record>> {
        match self
            .source
            .read(kind, after, self.cfg.batch_max, self.cfg.batch_max_bytes)
            .await
        {
            Ok(b) => Some(b),
            Err(e) => {
                let f = Failure::new("read", e);
                self.failed(&f);
                tracing::warn!(sink = %self.name, log = kind.log(), error = %f.message, "audit sink cannot read the store");
                None
            }
        }
    }

    /// Sends `batch` until the receiver takes it, backing off between tries.
    async fn deliver(&self, transport: &mut Transport, batch: &[Record], backoff: &mut Duration) {
        loop {
            match transport.send(batch).await {
                Ok(d) => {
                    if d.rejected > 0 {
                        self.failed(&Failure::new("rejected", ""));
                    }
                    *backoff = RETRY_FIRST;
                    return;
                }
                Err(f) => {
                    self.failed(&f);
                    tracing::warn!(sink = %self.name, kind = f.kind, error = %f.message, retry_in_ms = backoff.as_millis() as u64, "audit sink delivery failed; retrying");
                    tokio::time::sleep(jittered(*backoff)).await;
                    *backoff = (*backoff * 2).min(self.cfg.retry_max);
                }
            }
        }
    }

    /// Visits the kinds in turn, one batch each: the next batch of a kind
    /// is read and mapped while the current one is with the receiver (at
    /// most one batch waits per kind, bounded like any batch).
    async fn forever(self, mut transport: Transport) {
        let mut backoff = RETRY_FIRST;
        let mut ahead: [Option<Vec<Record>>; KINDS] = std::array::from_fn(|_| None);
        loop {
            let mut moved = false;
            for (i, kind) in RecordKind::ALL.into_iter().enumerate() {
                let after = self.cursors[i].load(Ordering::Acquire);
                let batch = match ahead[i].take() {
                    Some(b) => b,
                    None => match self.read(kind, after).await {
                        Some(b) => b,
                        None => continue,
                    },
                };
                let (Some(first), Some(last)) = (batch.first().map(|r| r.seq), batch.last().map(|r| r.seq)) else {
                    continue;
                };
                // Seqs have no holes but those deletions made: records
                // dropped (decision records beyond their budget) before this
                // sink exported them. A sink's first read starts wherever the
                // store starts.
                if after > 0 && first > after + 1 {
                    let n = first - after - 1;
                    self.metrics.dropped.get_or_create(&self.label(kind)).inc_by(n);
                    tracing::warn!(sink = %self.name, log = kind.log(), after, next = first, dropped = n, "records were deleted before this sink exported them");
                }
                let ((), next) = tokio::join!(
                    self.deliver(&mut transport, &batch, &mut backoff),
                    self.read(kind, last)
                );
                ahead[i] = next.filter(|b| !b.is_empty());
                self.cursors[i].fetch_max(last, Ordering::AcqRel);
                if let Err(e) = self.source.advance(&self.name, kind, last).await {
                    tracing::warn!(sink = %self.name, error = %e, "an audit sink's cursor could not be written");
                }
                self.metrics
                    .exported
                    .get_or_create(&self.label(kind))
                    .inc_by(batch.len() as u64);
                self.succeeded();
                moved = true;
            }
            if !moved {
                self.succeeded();
                tokio::time::sleep(self.cfg.flush).await;
            }
        }
    }
}

#[cfg(test)]
mod tests;
