//! Grants: a kernel's "allow once" for one run (`POST /v1/runs/{id}/grants`),
//! after asking a person. A grant stands in for a missing allowlist entry
//! of exactly one `name:port`, for a number of uses and until a time, for
//! that run only; it never widens the tool's policy and dies with the run.
//! Consulted only when the allowlist has already said no, so the lock here
//! is never on an allowed fetch's path.

use std::sync::Mutex;
use std::time::{Instant, SystemTime};

/// The most grants a run holds at once.
pub const MAX_GRANTS: usize = 64;

/// One grant.
#[derive(Debug, Clone)]
pub struct Grant {
    pub host: String,
    pub port: u16,
    /// Uses left.
    pub uses: u32,
    pub expires: Instant,
    pub expires_at: SystemTime,
}

/// A run's grants (bounded by [`MAX_GRANTS`]), and the fetches held for
/// one (`on_unlisted = "ask"`) woken when one is added.
#[derive(Debug, Default)]
pub struct Grants(Mutex<Vec<Grant>>, tokio::sync::Notify);

impl Grants {
    /// Adds `g` (a grant of the same `name:port` is replaced); `false` when
    /// the run already holds [`MAX_GRANTS`] live ones.
    pub fn add(&self, g: Grant) -> bool {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        v.retain(|x| x.uses > 0 && x.expires > now && !(x.host == g.host && x.port == g.port));
        if v.len() >= MAX_GRANTS {
            return false;
        }
        v.push(g);
        drop(v);
        self.1.notify_waiters();
        true
    }

    /// Resolves when a grant is added after this was called and polled
    /// ([`tokio::sync::futures::Notified::enable`] it before checking).
    pub fn added(&self) -> tokio::sync::futures::Notified<'_> {
        self.1.notified()
    }

    /// Takes one use of a live grant of `host:port`; the uses left after it.
    pub fn take(&self, host: &str, port: u16) -> Option<u32> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        v.retain(|x| x.uses > 0 && x.expires > now);
        let g = v.iter_mut().find(|x| x.host == host && x.port == port)?;
        g.uses -= 1;
        Some(g.uses)
    }

    /// Removes the grant of `host:port`, if any.
    pub fn remove(&self, host: &str, port: u16) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|x| !(x.host == host && x.port == port));
    }

    /// The live grants.
    pub fn list(&self) -> Vec<Grant> {
        let v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        v.iter().filter(|x| x.uses > 0 && x.expires > now).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn grant(host: &str, uses: u32, ttl: Duration) -> Grant {
        Grant {
            host: host.into(),
            port: 443,
            uses,
            expires: Instant::now() + ttl,
            expires_at: SystemTime::now() + ttl,
        }
    }

    #[test]
    fn uses_ttl_and_the_bound_hold() {
        let g = Grants::default();
        assert!(g.add(grant("a.test", 2, Duration::from_secs(60))));
        assert_eq!(g.take("a.test", 443), Some(1));
        assert_eq!(g.take("a.test", 80), None);
        assert_eq!(g.take("b.test", 443), None);
        assert_eq!(g.take("a.test", 443), Some(0));
        assert_eq!(g.take("a.test", 443), None);
        assert!(g.add(grant("c.test", 5, Duration::ZERO)));
        assert_eq!(g.take("c.test", 443), None, "expired");
        for i in 0..MAX_GRANTS {
            assert!(g.add(grant(&format!("h{i}.test"), 1, Duration::from_secs(60))));
        }
        assert!(!g.add(grant("one-more.test", 1, Duration::from_secs(60))));
        // The same name:port replaces, never adds.
        assert!(g.add(grant("h0.test", 3, Duration::from_secs(60))));
        assert_eq!(g.list().len(), MAX_GRANTS);
    }
}
