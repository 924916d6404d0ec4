//! Connection admission for both listeners, so that sockets nobody has
//! authenticated cannot lock out the kernels and the runs that have.
//!
//! A new connection is *pending* until a request on it authenticates (a run's
//! credential on the data listener, the control token on the control
//! listener). Pending connections of a listener are bounded by
//! `max_pending_connections`: a new one beyond the bound closes the *oldest*
//! pending one, so idle sockets are pushed out by live clients instead of
//! keeping them out; and each must authenticate within
//! `pending_head_timeout_ms`. Accepting never waits.
//!
//! An authenticated connection is *established*: it takes one of the
//! listener's established places (`max_connections` for data,
//! `max_control_connections` for control) and, on the data listener, one of
//! its run's `max_connections_per_run`, so no run can hold every place. A
//! connection that finds no place is answered and closed.

use crate::runs::Run;
use prometheus_client::metrics::counter::Counter;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// One listener's admission state.
pub struct Admission {
    /// Pending connections, oldest first: (id, the connection's cut token).
    pending: Mutex<VecDeque<(u64, CancellationToken)>>,
    max_pending: usize,
    next_id: AtomicU64,
    established: Arc<Semaphore>,
    evicted: Counter,
}

impl Admission {
    pub fn new(max_pending: usize, max_established: usize, evicted: Counter) -> Arc<Admission> {
        Self::sharing(max_pending, Arc::new(Semaphore::new(max_established)), evicted)
    }

    /// An admission with its own pending set whose established places are
    /// `established`, shared with other listeners (a handed-off listener has
    /// its own pending set, so one sandbox cannot push out another's pending
    /// connections, but takes places from the proxy's `max_connections`).
    pub fn sharing(max_pending: usize, established: Arc<Semaphore>, evicted: Counter) -> Arc<Admission> {
        Arc::new(Admission {
            pending: Mutex::new(VecDeque::with_capacity(max_pending.min(4096))),
            max_pending: max_pending.max(1),
            next_id: AtomicU64::new(0),
            established,
            evicted,
        })
    }

    /// The established places (to share with another listener).
    pub fn established_places(&self) -> Arc<Semaphore> {
        self.established.clone()
    }

    /// The eviction counter (to share with another listener).
    pub fn evicted_counter(&self) -> Counter {
        self.evicted.clone()
    }

    /// Admits a just-accepted connection as pending, closing the oldest
    /// pending connections beyond the bound. `cut` closes this connection.
    pub fn admit(self: &Arc<Self>, cut: CancellationToken) -> Conn {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut q) = self.pending.lock() {
            while q.len() >= self.max_pending {
                match q.pop_front() {
                    Some((_, oldest)) => {
                        oldest.cancel();
                        self.evicted.inc();
                    }
                    None => break,
                }
            }
            q.push_back((id, cut.clone()));
        }
        Conn {
            admission: self.clone(),
            id,
            cut,
            established: OnceLock::new(),
            peer: OnceLock::new(),
        }
    }

    fn leave_pending(&self, id: u64) {
        if let Ok(mut q) = self.pending.lock() {
            if let Some(pos) = q.iter().position(|(i, _)| *i == id) {
                q.remove(pos);
            }
        }
    }
}

/// Why an authenticated connection found no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every established place of the listener is taken.
    Limit,
    /// The run holds `max_connections_per_run` connections already.
    RunLimit,
}

impl Refused {
    pub fn label(self) -> &'static str {
        match self {
            Refused::Limit => "limit",
            Refused::RunLimit => "run_limit",
        }
    }
}

/// One connection's admission: pending until [`Conn::establish`] succeeds.
pub struct Conn {
    admission: Arc<Admission>,
    id: u64,
    /// Closes the connection (eviction, head deadline, a fetch's cut).
    pub cut: CancellationToken,
    established: OnceLock<(OwnedSemaphorePermit, Option<OwnedSemaphorePermit>)>,
    /// The names of the client certificate the TLS handshake verified.
    peer: OnceLock<egress_api::tls::PeerNames>,
}

impl Conn {
    pub fn set_peer(&self, names: egress_api::tls::PeerNames) {
        let _ = self.peer.set(names);
    }

    /// The verified client certificate's names, if there was one.
    pub fn peer(&self) -> Option<&egress_api::tls::PeerNames> {
        self.peer.get().filter(|p| !p.0.is_empty())
    }

    pub fn is_pending(&self) -> bool {
        self.established.get().is_none()
    }

    /// The connection carried an authenticated request (of `run`, on the
    /// data listener). Idempotent: later requests find it established. A
    /// connection first established by one run stays charged to that run.
    pub fn establish(&self, run: Option<&Run>) -> Result<(), Refused> {
        if !self.is_pending() {
            return Ok(());
        }
        let per_run = match run {
            Some(r) => Some(r.conns.clone().try_acquire_owned().map_err(|_| Refused::RunLimit)?),
            None => None,
        };
        let global = self
            .admission
            .established
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refused::Limit)?;
        // Two requests of one connection never run at once (HTTP/1.1), so
        // this cannot race; if it did, the loser's permits are simply dropped.
        let _ = self.established.set((global, per_run));
        self.admission.leave_pending(self.id);
        Ok(())
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.is_pending() {
            self.admission.leave_pending(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_pending_connection_makes_room() {
        let evicted = Counter::default();
        let a = Admission::new(2, 10, evicted.clone());
        let tokens: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
        let c0 = a.admit(tokens[0].clone());
        let c1 = a.admit(tokens[1].clone());
        assert!(!tokens[0].is_cancelled());
        let c2 = a.admit(tokens[2].clone());
        assert!(tokens[0].is_cancelled(), "the oldest pending connection was not closed");
        assert!(!tokens[1].is_cancelled() && !tokens[2].is_cancelled());
        assert_eq!(evicted.get(), 1);
        // An established connection leaves the pending set: it is never evicted.
        c1.establish(None).unwrap();
        let t3 = CancellationToken::new();
        let _c3 = a.admit(t3.clone());
        assert!(!tokens[1].is_cancelled());
        assert!(!tokens[2].is_cancelled(), "room was left by the established connection");
        let t4 = CancellationToken::new();
        let _c4 = a.admit(t4);
        assert!(tokens[2].is_cancelled());
        drop((c0, c1, c2));
    }

    #[test]
    fn established_places_are_bounded_and_given_back() {
        let a = Admission::new(10, 1, Counter::default());
        let c1 = a.admit(CancellationToken::new());
        let c2 = a.admit(CancellationToken::new());
        assert_eq!(c1.establish(None), Ok(()));
        assert_eq!(c1.establish(None), Ok(()), "idempotent");
        assert_eq!(c2.establish(None), Err(Refused::Limit));
        assert!(c2.is_pending());
        drop(c1);
        assert_eq!(c2.establish(None), Ok(()));
    }
}
