//! A run's names for transparent egress. The sandbox's DNS answers a name
//! the tool's policy lists with a synthetic address from `198.18.0.0/15`
//! (reserved for benchmarking, never a destination here; the proxy denies
//! it anyway): the same address for the run's life, each run counting from
//! the start of the pool (runs live in namespaces of their own). A
//! transparent connection to such an address is a connection to its name.
//! Bounded: at most [`MAX_NAMES`] per run.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

/// The pool's first address (`198.18.0.0` is not handed out).
const POOL_START: u32 = u32::from_be_bytes([198, 18, 0, 1]);
/// The pool's last address (`198.19.255.255`).
const POOL_END: u32 = u32::from_be_bytes([198, 19, 255, 255]);

/// Names a run may be handed addresses for.
pub const MAX_NAMES: usize = 4096;

/// Whether `ip` is in the synthetic pool.
pub fn synthetic(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => (POOL_START - 1..=POOL_END).contains(&u32::from(v4)),
        IpAddr::V6(_) => false,
    }
}

/// One run's map, both ways.
#[derive(Debug, Default)]
pub struct Names {
    by_name: HashMap<Arc<str>, Ipv4Addr>,
    by_addr: HashMap<Ipv4Addr, Arc<str>>,
}

impl Names {
    /// The address of `name` (canonical), handed out now if it has none;
    /// `None` when the run already holds [`MAX_NAMES`].
    pub fn address(&mut self, name: &str) -> Option<Ipv4Addr> {
        if let Some(a) = self.by_name.get(name) {
            return Some(*a);
        }
        if self.by_name.len() >= MAX_NAMES {
            return None;
        }
        let a = Ipv4Addr::from(POOL_START + self.by_name.len() as u32);
        let name: Arc<str> = Arc::from(name);
        self.by_name.insert(name.clone(), a);
        self.by_addr.insert(a, name);
        Some(a)
    }

    /// The name a synthetic address was handed out for.
    pub fn name(&self, ip: IpAddr) -> Option<Arc<str>> {
        match ip.to_canonical() {
            IpAddr::V4(v4) => self.by_addr.get(&v4).cloned(),
            IpAddr::V6(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_keeps_its_address_and_the_address_names_it() {
        let mut n = Names::default();
        let a = n.address("api.example").unwrap();
        assert_eq!(a, Ipv4Addr::new(198, 18, 0, 1));
        assert_eq!(n.address("api.example"), Some(a));
        let b = n.address("b.example").unwrap();
        assert_ne!(a, b);
        assert_eq!(n.name(IpAddr::V4(b)).as_deref(), Some("b.example"));
        assert_eq!(
            n.name("::ffff:198.18.0.1".parse().unwrap()).as_deref(),
            Some("api.example")
        );
        assert_eq!(n.name("198.18.0.99".parse().unwrap()), None);
    }

    #[test]
    fn the_pool_is_bounded_and_known() {
        let mut n = Names::default();
        for i in 0..MAX_NAMES {
            assert!(n.address(&format!("n{i}.example")).is_some());
        }
        assert_eq!(n.address("one.more.example"), None);
        assert!(n.address("n7.example").is_some(), "known names keep theirs");
        for (ip, want) in [
            ("198.18.0.0", true),
            ("198.19.255.255", true),
            ("198.20.0.0", false),
            ("198.17.255.255", false),
            ("::ffff:198.18.3.4", true),
            ("fd00::1", false),
        ] {
            assert_eq!(synthetic(ip.parse().unwrap()), want, "{ip}");
        }
    }
}
