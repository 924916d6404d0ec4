//! The unprivileged uid/gid of a confined child: whether the executor can
//! give one (CAP_SETUID and CAP_SETGID, the ids mapped in its user
//! namespace), and which one the next child gets, round robin over
//! `[executor] child_uid_count` ids from `child_uid`/`child_gid`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::ExecutorSection;

/// Whether children can run as the configured ids, and which.
pub fn support(exec: &ExecutorSection) -> Result<String, String> {
    let (uid, gid, count) = (exec.child_uid, exec.child_gid, exec.child_uid_count);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let (setgid, setuid) = (cap_eff & (1 << 6) != 0, cap_eff & (1 << 7) != 0);
    if !(setgid && setuid) {
        return Err("the executor lacks CAP_SETUID/CAP_SETGID (not root)".into());
    }
    let mapped = |file: &str, id: u32, n: u32| {
        let map = std::fs::read_to_string(file).unwrap_or_default();
        map.lines().any(|l| {
            let f: Vec<u64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            f.len() == 3 && u64::from(id) >= f[0] && u64::from(id) + u64::from(n) <= f[0] + f[2]
        })
    };
    if !mapped("/proc/self/uid_map", uid, count) || !mapped("/proc/self/gid_map", gid, count) {
        let ids = if count > 1 {
            format!("uids/gids {uid}/{gid} (+{count})")
        } else {
            format!("uid {uid} / gid {gid}")
        };
        return Err(format!("{ids} not mapped in the executor's user namespace"));
    }
    Ok(if count > 1 {
        format!("uid/gid from {uid}/{gid}, one of {count} per child")
    } else {
        format!("uid {uid}, gid {gid}")
    })
}

/// The ids children take in turn: `count` consecutive uid/gid pairs from
/// `(uid, gid)`. Clones share the turn.
#[derive(Debug, Clone)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    count: u32,
    next: Arc<AtomicU64>,
}

impl Ids {
    pub fn new(uid: u32, gid: u32, count: u32) -> Ids {
        Ids {
            uid,
            gid,
            count: count.max(1),
            next: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The uid/gid the next child gets.
    pub fn next(&self) -> (u32, u32) {
        let n = (self.next.fetch_add(1, Ordering::Relaxed) % u64::from(self.count)) as u32;
        (self.uid + n, self.gid + n)
    }
}
