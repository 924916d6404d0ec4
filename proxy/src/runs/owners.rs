//! Run owners and their leases. A kernel or executor that creates runs may
//! name itself their owner and hold a lease it renews by heartbeat
//! (`PUT /v1/owners/{owner}`). When the lease expires (the owner crashed or
//! hung) the proxy ends every live run of that owner, so no credential
//! outlives the process that handed it out by more than one lease. An owner
//! can also release itself (`DELETE`), ending its runs at once, e.g. when a
//! restarted instance clears what its predecessor left.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Shortest and longest lease an owner may ask for.
pub const MIN_LEASE: Duration = Duration::from_millis(egress_api::rules::LEASE_MS_MIN);
pub const MAX_LEASE: Duration = Duration::from_millis(egress_api::rules::LEASE_MS_MAX);
/// The lease an owner of restored runs gets after a proxy restart, to renew
/// before its runs are ended.
pub const RESTART_GRACE: Duration = Duration::from_secs(30);
/// Owners at most (each holds a lease; names are bounded like run ids).
pub const MAX_OWNERS: usize = 1024;

#[derive(Debug, Clone)]
pub struct Lease {
    pub lease: Duration,
    pub expires: Instant,
    pub expires_at: SystemTime,
    /// Who holds it: the principal that took it (`None`: the control
    /// token's). A lease given back to the owner of restored runs after a
    /// restart is held by nobody until its first renewal takes it.
    pub holder: Option<Option<Arc<str>>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OwnerError {
    #[error("lease_ms must be between {} and {}", MIN_LEASE.as_millis(), MAX_LEASE.as_millis())]
    BadLease,
    #[error("too many owners (at most {MAX_OWNERS})")]
    TooMany,
}

/// The owner registry (control-plane only: a plain mutex is enough).
#[derive(Default)]
pub struct Owners {
    map: Mutex<HashMap<String, Lease>>,
}

impl Owners {
    /// Creates or renews `owner`'s lease, held by `holder` (`None`: a
    /// restored run's grace lease, held by nobody yet).
    pub fn renew(&self, owner: &str, lease: Duration, holder: Option<Option<Arc<str>>>) -> Result<Lease, OwnerError> {
        if !(MIN_LEASE..=MAX_LEASE).contains(&lease) {
            return Err(OwnerError::BadLease);
        }
        let l = Lease {
            lease,
            expires: Instant::now() + lease,
            expires_at: SystemTime::now() + lease,
            holder,
        };
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if !map.contains_key(owner) && map.len() >= MAX_OWNERS {
            return Err(OwnerError::TooMany);
        }
        map.insert(owner.to_owned(), l.clone());
        Ok(l)
    }

    /// `owner`'s lease, if it holds a live one.
    pub fn lease(&self, owner: &str) -> Option<Lease> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(owner).cloned().filter(|l| Instant::now() < l.expires)
    }

    /// Forgets `owner`; returns whether it was registered.
    pub fn release(&self, owner: &str) -> bool {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(owner).is_some()
    }

    /// Removes and returns the owners whose lease expired by `now`.
    pub fn take_expired(&self, now: Instant) -> Vec<String> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<String> = map
            .iter()
            .filter(|(_, l)| now >= l.expires)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            map.remove(k);
        }
        gone
    }

    /// Every owner with its lease.
    pub fn list(&self) -> Vec<(String, Lease)> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, Lease)> = map.iter().map(|(k, l)| (k.clone(), l.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_expire_and_renewals_extend_them() {
        let o = Owners::default();
        assert_eq!(
            o.renew("x", Duration::from_millis(10), Some(None)).unwrap_err(),
            OwnerError::BadLease
        );
        o.renew("exec-a", MIN_LEASE, Some(None)).unwrap();
        assert!(o.lease("exec-a").is_some());
        assert!(o.take_expired(Instant::now()).is_empty());
        let later = Instant::now() + MIN_LEASE + Duration::from_millis(1);
        assert_eq!(o.take_expired(later), ["exec-a"]);
        assert!(o.lease("exec-a").is_none());
        o.renew("exec-b", MAX_LEASE, Some(None)).unwrap();
        assert!(o.release("exec-b"));
        assert!(!o.release("exec-b"));
    }
}
