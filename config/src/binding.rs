//! Where a confined child's connections meet the proxy. Both services read
//! the one file, so both derive the listener hand-off socket from it: `[proxy]
//! handoff`, else `egress-handoff.sock` beside `[proxy] facts` (where the
//! control token file lives too); the executor may name its own view of the
//! same socket (`[executor] proxy_handoff`). Only `[executor] allow_relay`
//! gives that up for the relay, which does not bind connections to a run.

use crate::{Config, ProxyConfig};
use std::path::{Path, PathBuf};

/// The file name of the default hand-off socket, beside the facts store.
pub const HANDOFF_SOCKET: &str = "egress-handoff.sock";

/// How the executor connects a confined child's in-namespace listener to
/// the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// Handed to the proxy over `socket`, which binds every connection on it
    /// to the child's run; `key` is the key path the socket comes from
    /// (`proxy.facts` when it is the default beside the facts store).
    Handoff { socket: PathBuf, key: &'static str },
    /// `[executor] allow_relay = true`: the executor carries each connection
    /// to the proxy's data port; the proxy cannot tell which run's sandbox
    /// it came from.
    Relay,
}

impl Binding {
    /// The hand-off socket, if the binding is a hand-off.
    pub fn socket(&self) -> Option<&Path> {
        match self {
            Binding::Handoff { socket, .. } => Some(socket),
            Binding::Relay => None,
        }
    }

    /// Where the socket comes from, in words: `[proxy] handoff`, …
    pub fn source(&self) -> &'static str {
        match self {
            Binding::Handoff { key: "proxy.facts", .. } => "the default beside [proxy] facts",
            Binding::Handoff {
                key: "proxy.handoff", ..
            } => "[proxy] handoff",
            Binding::Handoff { .. } => "[executor] proxy_handoff",
            Binding::Relay => "[executor] allow_relay",
        }
    }

    /// One line for `check` and `doctor`.
    pub fn describe(&self) -> String {
        match self {
            Binding::Handoff { socket, .. } => format!(
                "hand-off to {} ({}): each confined child's connections are bound to its run",
                socket.display(),
                self.source()
            ),
            Binding::Relay => "relay ([executor] allow_relay = true): confined children's connections reach \
                               the proxy through the executor and are not bound to their run"
                .into(),
        }
    }
}

impl ProxyConfig {
    /// The socket the proxy receives listeners on: `handoff`, else the
    /// default in the proxy's [`home`](ProxyConfig::home) (beside the facts
    /// store, or the config file with an in-memory store).
    pub fn handoff_socket(&self) -> PathBuf {
        self.handoff.clone().unwrap_or_else(|| self.home().join(HANDOFF_SOCKET))
    }
}

impl Config {
    /// The binding the executor applies to every confined child.
    pub fn binding(&self) -> Binding {
        let e = &self.executor;
        match (&e.proxy_handoff, &self.proxy.handoff) {
            _ if e.allow_relay => Binding::Relay,
            (Some(socket), _) => Binding::Handoff {
                socket: socket.clone(),
                key: "executor.proxy_handoff",
            },
            (None, Some(socket)) => Binding::Handoff {
                socket: socket.clone(),
                key: "proxy.handoff",
            },
            (None, None) => Binding::Handoff {
                socket: self.proxy.handoff_socket(),
                key: "proxy.facts",
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str, dir: &str) -> Config {
        Config::parse_relative_to(text, "egress.toml", Path::new(dir)).unwrap()
    }

    fn handoff(socket: &str, key: &'static str) -> Binding {
        Binding::Handoff {
            socket: PathBuf::from(socket),
            key,
        }
    }

    /// With no key, both services find the same socket beside the facts
    /// store, wherever the file puts it.
    #[test]
    fn the_default_socket_is_beside_the_facts_store_for_both_services() {
        for (text, dir, want) in [
            // The embedded default (no file): relative to the working directory.
            ("", "", "var/egress-handoff.sock"),
            // The same file read from /etc/loom.
            ("", "/etc/loom", "/etc/loom/var/egress-handoff.sock"),
            (
                "[proxy]\nfacts = \"/srv/egress/facts.db\"\n",
                "/etc/loom",
                "/srv/egress/egress-handoff.sock",
            ),
            (
                "[proxy]\nfacts = \"../var/f.db\"\n",
                "/etc/loom",
                "/etc/loom/../var/egress-handoff.sock",
            ),
            (
                "[proxy]\nfacts = \"facts.db\"\n",
                "/etc/loom",
                "/etc/loom/egress-handoff.sock",
            ),
            // Facts in memory: beside the config file, or in the working
            // directory for a config without one (as the token file).
            (
                "[proxy]\nfacts = \":memory:\"\n",
                "/etc/loom",
                "/etc/loom/egress-handoff.sock",
            ),
            ("[proxy]\nfacts = \":memory:\"\n", "", "egress-handoff.sock"),
        ] {
            let c = at(text, dir);
            assert_eq!(c.proxy.handoff_socket(), PathBuf::from(want), "{text:?} in {dir:?}");
            assert_eq!(c.binding(), handoff(want, "proxy.facts"), "{text:?} in {dir:?}");
        }
        assert_eq!(
            Config::embedded_default().proxy.handoff_socket(),
            PathBuf::from("var/egress-handoff.sock")
        );
    }

    /// `[proxy] handoff` is one key for both; `[executor] proxy_handoff`
    /// is the executor's view of it (another mount path), and wins there.
    #[test]
    fn explicit_keys_take_precedence_in_their_order() {
        let c = at("[proxy]\nhandoff = \"run/h.sock\"\n", "/etc/loom");
        assert_eq!(c.proxy.handoff_socket(), PathBuf::from("/etc/loom/run/h.sock"));
        assert_eq!(c.binding(), handoff("/etc/loom/run/h.sock", "proxy.handoff"));
        let c = at(
            "[proxy]\nhandoff = \"/run/a.sock\"\n[executor]\nproxy_handoff = \"/mnt/a.sock\"\n",
            "/etc/loom",
        );
        assert_eq!(c.proxy.handoff_socket(), PathBuf::from("/run/a.sock"));
        assert_eq!(c.binding(), handoff("/mnt/a.sock", "executor.proxy_handoff"));
        let c = at("[executor]\nproxy_handoff = \"h.sock\"\n", "/etc/loom");
        assert_eq!(
            c.proxy.handoff_socket(),
            PathBuf::from("/etc/loom/var/egress-handoff.sock")
        );
        assert_eq!(c.binding(), handoff("/etc/loom/h.sock", "executor.proxy_handoff"));
    }

    /// The relay only when the operator says so, and never together with a
    /// socket the executor was told to use.
    #[test]
    fn allow_relay_is_the_only_way_to_the_relay() {
        let c = at("[executor]\nallow_relay = true\n", "/etc/loom");
        assert_eq!(c.binding(), Binding::Relay);
        assert_eq!(c.binding().socket(), None);
        // The proxy's own key stays the proxy's (the same file on its host).
        let c = at(
            "[proxy]\nhandoff = \"/run/h.sock\"\n[executor]\nallow_relay = true\n",
            "/",
        );
        assert_eq!(c.binding(), Binding::Relay);
        assert!(at("[executor]\nallow_relay = false\n", "/")
            .binding()
            .socket()
            .is_some());
        for (body, want) in [
            (
                "allow_relay = true\nproxy_handoff = \"/run/h.sock\"",
                "egress.toml: executor.allow_relay: cannot be true while executor.proxy_handoff names a hand-off socket: choose one",
            ),
            ("allow_relay = \"yes\"", "egress.toml: executor.allow_relay: "),
        ] {
            let e = Config::parse(&format!("[executor]\n{body}\n"), "egress.toml")
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(want), "{body}: {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
