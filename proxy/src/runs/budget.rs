//! What a run has spent of its tool's budgets (`max_requests_per_run`,
//! `max_request_rate`, `max_bytes_per_run`): counters shared by every fetch
//! of the run, on every entrance and across concurrent tunnels, without a
//! lock. The rate is a generic cell rate algorithm (a token bucket kept as
//! one "theoretical arrival time"), advanced by compare-and-swap.
//!
//! The byte budget is spent by reservation: a carrier asks for what it is
//! about to move ([`ByteBudget::grant`]: at most what the run has left,
//! taken in one compare-and-swap), moves no more than it was granted, and
//! gives back what it did not move. So the run's fetches together never
//! move a byte past the budget, however many there are and however fast
//! their peers are.

use egress_config::Budgets;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// The error a carrier ends with when the run's byte budget is spent.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the run moved its max_bytes_per_run")]
pub struct BytesSpent;

impl From<BytesSpent> for std::io::Error {
    fn from(e: BytesSpent) -> std::io::Error {
        std::io::Error::other(e)
    }
}

/// The run's byte count and the grants in flight on it share one word, so
/// that a grant, a settlement and "is the budget spent for good?" are each
/// one atomic step: the low [`COUNT_BITS`] bits count bytes (moved, or
/// granted to a carrier moving them now), the bits above count grants not
/// yet settled. A grant lives for one read or write (no await inside it),
/// so there are never more in flight than threads.
const COUNT_BITS: u32 = 52;
const COUNT: u64 = (1 << COUNT_BITS) - 1;
const HOLDER: u64 = 1 << COUNT_BITS;

/// What a carrier may move now ([`Spent::reserve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// This many bytes (at least one, at most what was asked for).
    Granted(u64),
    /// Nothing left now, but other carriers hold grants they may give back
    /// in a moment: ask again (after yielding).
    Later,
    /// The budget is spent: the carrier ends ([`BytesSpent`]).
    Spent,
}

/// A run's spending.
#[derive(Debug)]
pub struct Spent {
    requests: AtomicU64,
    /// Bytes and grants in flight ([`COUNT_BITS`]).
    bytes: AtomicU64,
    /// The rate's theoretical arrival time of the next request, in
    /// nanoseconds since `epoch`.
    tat: AtomicU64,
    epoch: Instant,
    /// Set by the first to find the byte budget reached: that fetch
    /// records the cut's fact.
    cut: AtomicBool,
    /// Fires when the byte budget is reached: every open tunnel and body of
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
            cut: AtomicBool::new(false),
            bytes_out: CancellationToken::new(),
        }
    }
}

impl Spent {
    /// Takes one request of `limits`, or says which budget it would exceed
    /// (and then takes nothing).
    pub fn take_request(&self, limits: &Budgets) -> Result<(), Exceeded> {
        if let Some(max) = limits.bytes {
            if self.bytes.load(Ordering::Relaxed) & COUNT >= max {
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

    /// Grants up to `want` bytes of `limit` (one compare-and-swap); a
    /// [`Take::Granted`] must be settled ([`Spent::settle`]) once the bytes
    /// moved. [`Take::Spent`] also notes the budget reached ([`Spent::reached`]).
    pub fn reserve(&self, want: u64, limit: u64) -> Take {
        let want = want.max(1);
        let mut word = self.bytes.load(Ordering::Relaxed);
        loop {
            let count = word & COUNT;
            if count >= limit {
                if word >= HOLDER {
                    return Take::Later;
                }
                self.reached();
                return Take::Spent;
            }
            let granted = want.min(limit - count);
            match self
                .bytes
                .compare_exchange_weak(word, word + granted + HOLDER, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Take::Granted(granted),
                Err(seen) => word = seen,
            }
        }
    }

    /// Of `granted` bytes, `used` moved: the rest goes back. Returns whether
    /// the run has now reached `limit` with no grant in flight (the budget
    /// is spent for good), which fires [`Spent::bytes_out`].
    pub fn settle(&self, granted: u64, used: u64, limit: u64) -> bool {
        let back = granted - used.min(granted) + HOLDER;
        let word = self.bytes.fetch_sub(back, Ordering::AcqRel) - back;
        let spent = word < HOLDER && word & COUNT >= limit;
        if spent {
            self.reached();
        }
        spent
    }

    /// Takes exactly `n` bytes of `limit` (a message head, which goes whole
    /// or not at all): `None` when fewer are left (nothing taken), else
    /// whether this reached the limit for good (as [`Spent::settle`]).
    pub fn take_exact(&self, n: u64, limit: u64) -> Option<bool> {
        let took = self.bytes.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |word| {
            (word & COUNT).checked_add(n).filter(|c| *c <= limit).map(|_| word + n)
        });
        let now = took.ok()? + n;
        let spent = now < HOLDER && now & COUNT >= limit;
        if spent {
            self.reached();
        }
        Some(spent)
    }

    /// The budget is reached: fires [`Spent::bytes_out`] (every open fetch
    /// of the run is cut).
    fn reached(&self) {
        self.bytes_out.cancel();
    }

    /// Whether this caller is the first to report the cut (and records its
    /// fact).
    pub fn first_to_cut(&self) -> bool {
        !self.cut.swap(true, Ordering::AcqRel)
    }

    /// Requests taken and bytes moved so far (grants in flight included).
    pub fn used(&self) -> (u64, u64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed) & COUNT,
        )
    }
}

/// A fetch's share of its run's `max_bytes_per_run`. Every carrier of the
/// fetch asks it before it moves bytes ([`ByteBudget::grant`]); grants come
/// out of the run's one count, so concurrent fetches share it. When the run
/// reaches the limit, [`Spent::bytes_out`] fires, which cuts every open
/// fetch of the run, and the fetch that saw it first runs `on_cut` (the
/// `budget_exhausted` fact).
pub struct ByteBudget {
    pub limit: u64,
    run: std::sync::Arc<super::Run>,
    on_cut: Box<dyn Fn() + Send + Sync>,
}

/// Bytes a carrier may move now, given back (what was not used) when
/// dropped or settled with [`Reservation::used`].
pub enum Grant<'a> {
    Granted(Reservation<'a>),
    Later,
    Spent,
}

/// A grant of [`Reservation::len`] bytes in flight.
pub struct Reservation<'a> {
    budget: &'a ByteBudget,
    granted: u64,
    settled: bool,
}

impl Reservation<'_> {
    /// The bytes granted (at least one).
    pub fn len(&self) -> usize {
        self.granted as usize
    }

    /// `n` of the granted bytes moved; the rest goes back.
    pub fn used(mut self, n: usize) {
        self.settled = true;
        self.budget.settle(self.granted as usize, n);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.budget.settle(self.granted as usize, 0);
        }
    }
}

impl ByteBudget {
    pub fn new(limit: u64, run: std::sync::Arc<super::Run>, on_cut: Box<dyn Fn() + Send + Sync>) -> ByteBudget {
        ByteBudget { limit, run, on_cut }
    }

    /// Up to `want` (at least one) bytes to move now.
    pub fn grant(&self, want: usize) -> Grant<'_> {
        match self.reserve(want) {
            Take::Granted(granted) => Grant::Granted(Reservation {
                budget: self,
                granted,
                settled: false,
            }),
            Take::Later => Grant::Later,
            Take::Spent => Grant::Spent,
        }
    }

    /// [`ByteBudget::grant`] for a carrier that settles by hand (the
    /// splice crate's [`egress_splice::Allowance`]): every
    /// [`Take::Granted`] must be followed by one [`ByteBudget::settle`].
    pub fn reserve(&self, want: usize) -> Take {
        let take = self.run.spent.reserve(want as u64, self.limit);
        if take == Take::Spent {
            self.cut();
        }
        take
    }

    /// Of `granted` bytes, `used` moved; the rest goes back.
    pub fn settle(&self, granted: usize, used: usize) {
        if self.run.spent.settle(granted as u64, used as u64, self.limit) {
            self.cut();
        }
    }

    /// Takes a message head of `n` bytes whole, or says it does not fit
    /// what the run has left (and takes nothing).
    pub fn take_head(&self, n: usize) -> bool {
        match self.run.spent.take_exact(n as u64, self.limit) {
            Some(spent) => {
                if spent {
                    self.cut();
                }
                true
            }
            None => false,
        }
    }

    /// The run reached its budget: the first fetch to see it records the fact.
    fn cut(&self) {
        if self.run.spent.first_to_cut() {
            (self.on_cut)();
        }
    }

    /// Fires once the run's bytes reached the limit.
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
    fn grants_never_pass_the_limit_and_what_is_not_moved_goes_back() {
        let s = Spent::default();
        assert_eq!(s.reserve(60, 100), Take::Granted(60));
        assert!(!s.settle(60, 60, 100));
        // 40 left: a grant of 64 KiB is cut to them.
        assert_eq!(s.reserve(64 * 1024, 100), Take::Granted(40));
        // While that grant is in flight the budget looks spent, but is not
        // for good: the others are told to ask again.
        assert_eq!(s.reserve(1, 100), Take::Later);
        assert!(!s.bytes_out.is_cancelled());
        // Only 10 of the 40 moved: 30 come back.
        assert!(!s.settle(40, 10, 100));
        assert_eq!(s.used().1, 70);
        assert_eq!(s.reserve(30, 100), Take::Granted(30));
        assert!(!s.bytes_out.is_cancelled());
        assert!(s.settle(30, 30, 100), "the last byte spends the budget");
        assert!(s.bytes_out.is_cancelled());
        assert_eq!(s.reserve(1, 100), Take::Spent);
        assert_eq!(s.used().1, 100);
        let limits = Budgets {
            requests: None,
            bytes: Some(100),
            rate: None,
        };
        assert_eq!(s.take_request(&limits), Err(Exceeded::Bytes(100)));
    }

    #[test]
    fn the_largest_budget_the_config_takes_fits_the_count() {
        // `max_bytes_per_run` is at most 1 PiB (config/src/schema.rs).
        let s = Spent::default();
        let max = 1u64 << 50;
        assert!(max < COUNT);
        assert_eq!(s.reserve(u64::MAX, max), Take::Granted(max));
        assert!(s.settle(max, max, max));
        assert_eq!(s.used().1, max);
    }

    #[test]
    fn a_head_goes_whole_or_not_at_all() {
        let s = Spent::default();
        assert_eq!(s.take_exact(70, 100), Some(false));
        assert_eq!(s.take_exact(31, 100), None, "31 do not fit in 30");
        assert_eq!(s.used().1, 70);
        assert!(!s.bytes_out.is_cancelled());
        assert_eq!(s.take_exact(30, 100), Some(true));
        assert!(s.bytes_out.is_cancelled());
    }

    #[test]
    fn concurrent_carriers_move_exactly_the_budget_together() {
        // Eight threads ask for chunks of every size and move a part of
        // each grant: together they move the budget to the byte, never
        // more, and the budget is reported reached once.
        const LIMIT: u64 = 1_000_003;
        for round in 0..20u64 {
            let s = std::sync::Arc::new(Spent::default());
            let reached = std::sync::Arc::new(AtomicU64::new(0));
            let moved = std::sync::Arc::new(AtomicU64::new(0));
            let threads: Vec<_> = (0..8u64)
                .map(|t| {
                    let (s, reached, moved) = (s.clone(), reached.clone(), moved.clone());
                    std::thread::spawn(move || {
                        let mut x = round * 31 + t * 7 + 1;
                        loop {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            let want = (x >> 33) % 70_000 + 1;
                            match s.reserve(want, LIMIT) {
                                Take::Granted(g) => {
                                    assert!(g <= want);
                                    let used = if x % 3 == 0 { g / 2 } else { g };
                                    moved.fetch_add(used, Ordering::Relaxed);
                                    if s.settle(g, used, LIMIT) {
                                        reached.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                Take::Later => std::thread::yield_now(),
                                Take::Spent => return,
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(moved.load(Ordering::Relaxed), LIMIT, "round {round}");
            assert_eq!(s.used().1, LIMIT);
            assert!(s.bytes_out.is_cancelled());
            assert_eq!(reached.load(Ordering::Relaxed), 1, "reached once for good");
        }
    }
}
