//! A run's concurrency slots: FIFO acquisition bounded by the fetch deadline
//! and by a queue bound, held for the whole life of a fetch (DNS, connect,
//! response body or tunnel) and released on every exit path by `Drop`.

use crate::runs::Run;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::Ordering;
use tokio::sync::OwnedSemaphorePermit;

/// A held slot; dropping it releases the slot and the gauge.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Why no slot was obtained.
pub enum SlotError {
    /// Too many fetches already waiting (`concurrency_limit`).
    QueueFull,
    /// The semaphore was closed (cannot happen while the run lives).
    Closed,
}

struct Waiting<'a>(&'a Run);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Acquires one slot of the run, waiting in FIFO order. The caller bounds
/// the wait (deadline, run end, client gone) by dropping this future.
pub async fn acquire(run: &Run, gauge: Gauge) -> Result<Slot, SlotError> {
    if let Ok(permit) = run.slots.clone().try_acquire_owned() {
        gauge.inc();
        return Ok(Slot { _permit: permit, gauge });
    }
    if run.waiting.fetch_add(1, Ordering::AcqRel) >= run.max_waiting {
        run.waiting.fetch_sub(1, Ordering::AcqRel);
        return Err(SlotError::QueueFull);
    }
    let _w = Waiting(run);
    let permit = run.slots.clone().acquire_owned().await.map_err(|_| SlotError::Closed)?;
    gauge.inc();
    Ok(Slot { _permit: permit, gauge })
}
