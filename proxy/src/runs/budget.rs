//! What a run has spent of its tool's budgets (`max_requests_per_run`,
//! `max_request_rate`, `max_bytes_per_run`): counters shared by every fetch
//! of the run, on every entrance and across concurrent tunnels, without a
//! lock. The rate is a generic cell rate algorithm (a token bucket kept as
//! one "theoretical arrival time"), advanced by compare-and-swap.

use egress_config::Budgets;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// Which budget a fetch would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    /// `max_requests_per_run` fetches were already made.
    Requests(u64),
    /// `max_bytes_per_run` bytes were already moved.
    Bytes(u64),
    /// Faster than `max_request_rate` allows (beyond its burst).
    Rate { per_second: u32, burst: u32 },
}

/// A run's spending.
#[derive(Debug)]
pub struct Spent {
    requests: AtomicU64,
    bytes: AtomicU64,
    /// The rate's theoretical arrival time of the next request, in
    /// nanoseconds since `epoch`.
    tat: AtomicU64,
    epoch: Instant,
    /// Fires when the byte budget is crossed: every open tunnel and body of
    /// the run selects on it.
    pub bytes_out: CancellationToken,
}

impl Default for Spent {
    fn default() -> Self {
        Spent {
            requests: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            tat: AtomicU64::new(0),
            epoch: Instant::now(),
            bytes_out: CancellationToken::new(),
        }
    }
}

impl Spent {
    /// Takes one request of `limits`, or says which budget it would exceed
    /// (and then takes nothing).
    pub fn take_request(&self, limits: &Budgets) -> Result<(), Exceeded> {
        if let Some(max) = limits.bytes {
            if self.bytes.load(Ordering::Relaxed) >= max {
                return Err(Exceeded::Bytes(max));
            }
        }
        if let Some(rate) = limits.rate {
            let now = self.epoch.elapsed().as_nanos() as u64;
            let interval = 1_000_000_000 / u64::from(rate.per_second.max(1));
            let tolerance = interval * u64::from(rate.burst.max(1) - 1);
            let mut tat = self.tat.load(Ordering::Relaxed);
            loop {
                let Some(next) = gcra(tat, now, interval, tolerance) else {
                    return Err(Exceeded::Rate {
                        per_second: rate.per_second,
                        burst: rate.burst,
                    });
                };
                match self
                    .tat
                    .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
                {
                    Ok(_) => break,
                    Err(seen) => tat = seen,
                }
            }
        }
        if let Some(max) = limits.requests {
            let took = self
                .requests
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < max).then_some(n + 1));
            if took.is_err() {
                return Err(Exceeded::Requests(max));
            }
        } else {
            self.requests.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Adds `n` moved bytes; returns whether this crossed `limit` (and fires
    /// [`Spent::bytes_out`] then).
    pub fn moved(&self, n: u64, limit: Option<u64>) -> bool {
        let before = self.bytes.fetch_add(n, Ordering::Relaxed);
        match limit {
            Some(max) if before < max && before + n >= max => {
                self.bytes_out.cancel();
                true
            }
            _ => false,
        }
    }

    /// Requests taken and bytes moved so far.
    pub fn used(&self) -> (u64, u64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

/// A fetch's share of its run's `max_bytes_per_run`: every byte it moves is
/// counted on the run at once (so concurrent tunnels share one count), and
/// the fetch whose bytes cross the limit runs `on_cut` (the fact) and fires
/// [`Spent::bytes_out`], which cuts every open fetch of the run.
pub struct ByteBudget {
    pub limit: u64,
    run: std::sync::Arc<super::Run>,
    on_cut: Box<dyn Fn() + Send + Sync>,
}

impl ByteBudget {
    pub fn new(limit: u64, run: std::sync::Arc<super::Run>, on_cut: Box<dyn Fn() + Send + Sync>) -> ByteBudget {
        ByteBudget { limit, run, on_cut }
    }

    /// Counts `n` bytes moved.
    pub fn moved(&self, n: usize) {
        if self.run.spent.moved(n as u64, Some(self.limit)) {
            (self.on_cut)();
        }
    }

    /// Fires once the run's bytes crossed the limit.
    pub fn exhausted(&self) -> &CancellationToken {
        &self.run.spent.bytes_out
    }
}

impl std::fmt::Debug for ByteBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBudget")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

/// One step of the generic cell rate algorithm: with the theoretical
/// arrival time `tat`, a request at `now` conforms if it is no more than
/// `tolerance` early; the new `tat` if it does.
fn gcra(tat: u64, now: u64, interval: u64, tolerance: u64) -> Option<u64> {
    let tat = tat.max(now);
    (tat - now <= tolerance).then_some(tat + interval)
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_config::Rate;

    #[test]
    fn the_rate_allows_its_burst_then_one_per_interval() {
        // 10/s, burst 3: three at once, the fourth refused, one more after
        // 100 ms.
        let (i, tol) = (100, 200);
        let mut tat = 0;
        for _ in 0..3 {
            tat = gcra(tat, 0, i, tol).unwrap();
        }
        assert_eq!(gcra(tat, 0, i, tol), None);
        assert_eq!(gcra(tat, 99, i, tol), None);
        assert!(gcra(tat, 100, i, tol).is_some());
        // Idle for long: the burst is back, no more.
        let t = 10_000;
        let mut tat2 = tat;
        for _ in 0..3 {
            tat2 = gcra(tat2, t, i, tol).unwrap();
        }
        assert_eq!(gcra(tat2, t, i, tol), None);
    }

    #[test]
    fn requests_and_rate_are_taken_once_each() {
        let s = Spent::default();
        let limits = Budgets {
            requests: Some(2),
            bytes: None,
            rate: None,
        };
        assert_eq!(s.take_request(&limits), Ok(()));
        assert_eq!(s.take_request(&limits), Ok(()));
        assert_eq!(s.take_request(&limits), Err(Exceeded::Requests(2)));
        assert_eq!(s.used().0, 2);
        let s = Spent::default();
        let burst = Budgets {
            requests: None,
            bytes: None,
            rate: Some(Rate {
                per_second: 1,
                burst: 2,
            }),
        };
        assert_eq!(s.take_request(&burst), Ok(()));
        assert_eq!(s.take_request(&burst), Ok(()));
        assert!(matches!(s.take_request(&burst), Err(Exceeded::Rate { .. })));
    }

    #[test]
    fn the_byte_budget_fires_once_when_crossed() {
        let s = Spent::default();
        assert!(!s.moved(60, Some(100)));
        assert!(!s.bytes_out.is_cancelled());
        assert!(s.moved(40, Some(100)));
        assert!(s.bytes_out.is_cancelled());
        assert!(!s.moved(10, Some(100)));
        let limits = Budgets {
            requests: None,
            bytes: Some(100),
            rate: None,
        };
        assert_eq!(s.take_request(&limits), Err(Exceeded::Bytes(100)));
    }
}
