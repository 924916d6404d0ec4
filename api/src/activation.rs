//! Listening sockets passed by systemd socket activation (`sd_listen_fds(3)`):
//! `LISTEN_PID` names this process, `LISTEN_FDS` counts the sockets from fd 3
//! on, and `LISTEN_FDNAMES` gives each its `FileDescriptorName=`. Both
//! services look up theirs by name (`proxy`, `control`, `executor`) and bind
//! from their config what they were not given. Sockets passed for another
//! process (a `LISTEN_PID` that is not ours, or none) are never taken.

use std::collections::BTreeMap;
use std::io;
use std::net::TcpListener;

/// The listening sockets systemd passed to this process, by name.
#[derive(Debug, Default)]
pub struct Inherited(BTreeMap<String, TcpListener>);

impl Inherited {
    /// Takes what systemd passed to this process, and clears the variables
    /// so that nothing started later sees them. Every passed socket must be
    /// a TCP listener; several with one name are refused.
    pub fn from_env() -> io::Result<Inherited> {
        let ours = std::env::var("LISTEN_PID")
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            .is_some_and(|p| p == std::process::id());
        if !ours {
            return Ok(Inherited::default());
        }
        let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
        std::env::remove_var("LISTEN_FDNAMES");
        let mut fds = listenfd::ListenFd::from_env();
        let mut taken = BTreeMap::new();
        for i in 0..fds.len() {
            // systemd names an unnamed socket "unknown".
            let name = names.split(':').nth(i).filter(|n| !n.is_empty()).unwrap_or("unknown");
            let l = fds
                .take_tcp_listener(i)
                .map_err(|e| io::Error::other(format!("socket activation: fd {} ({name}): {e}", i + 3)))?
                .ok_or_else(|| io::Error::other(format!("socket activation: fd {} ({name}) taken twice", i + 3)))?;
            if taken.insert(name.to_owned(), l).is_some() {
                return Err(io::Error::other(format!(
                    "socket activation: more than one socket named {name}"
                )));
            }
        }
        Ok(Inherited(taken))
    }

    /// The listener passed under `name`, non-blocking, if there is one.
    pub fn take(&mut self, name: &str) -> io::Result<Option<TcpListener>> {
        match self.0.remove(name) {
            Some(l) => {
                l.set_nonblocking(true)?;
                Ok(Some(l))
            }
            None => Ok(None),
        }
    }

    /// The names of the sockets not taken (for a warning: they are unused).
    pub fn left(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    // The variables are what systemd would set; no other test of this crate
    // reads the environment.
    #[allow(clippy::disallowed_methods)]
    fn sockets_passed_for_another_process_are_never_taken() {
        // As if systemd had passed one socket to process 1: fd 3 here is
        // whatever this test process has there, never a listener to adopt.
        std::env::set_var("LISTEN_PID", "1");
        std::env::set_var("LISTEN_FDS", "1");
        std::env::set_var("LISTEN_FDNAMES", "proxy");
        let mut got = Inherited::from_env().expect("nothing is looked at");
        assert!(got.take("proxy").unwrap().is_none());
        assert!(got.left().is_empty());
        // Left for the process they name.
        assert_eq!(std::env::var("LISTEN_FDS").as_deref(), Ok("1"));
        for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            std::env::remove_var(v);
        }
    }
}
