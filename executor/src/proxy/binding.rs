//! Whether confined children can be bound to their runs, before any is
//! started: the gate `serve`, `run` and `doctor` apply. The hand-off socket
//! passes `socket`'s checks and the proxy answers a probe on it, or the
//! executor refuses to start, naming the keys. Only `[executor] allow_relay`
//! lets children be relayed instead.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{Binding, Config, Isolation};
use crate::confine::{HostSupport, Layer};
use crate::proxy::handoff;
use crate::proxy::socket::{vet, SocketError};

/// Whether a child of `isolation` gets an in-namespace listener on this
/// host (and so needs the binding).
pub fn needs_listener(isolation: Isolation, host: &HostSupport) -> bool {
    isolation != Isolation::Off && host.available(Layer::Netns)
}

/// What must hold before confined children start: the proxy receives
/// hand-offs on `socket`.
#[derive(Debug, Clone)]
pub struct Gate {
    socket: PathBuf,
    binding: Binding,
}

/// How long `serve` waits for the hand-off socket once the proxy's control
/// API answers (the proxy binds the socket before it serves that API).
pub const WAIT: Duration = Duration::from_secs(5);

impl Gate {
    /// The gate for children of these isolations; `None` when none of them
    /// gets a listener or the file allows the relay.
    pub fn new(config: &Config, host: &HostSupport, isolations: impl IntoIterator<Item = Isolation>) -> Option<Gate> {
        let socket = config.binding.socket()?;
        isolations.into_iter().any(|i| needs_listener(i, host)).then(|| Gate {
            socket: socket.to_path_buf(),
            binding: config.binding.clone(),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The static checks, only if the socket is there already (the proxy
    /// may start later): wrong permissions refuse at once.
    pub fn check_now(&self) -> Result<(), String> {
        match vet(&self.socket) {
            Err(SocketError::Missing(_)) | Ok(()) => Ok(()),
            Err(e) => Err(self.refusal(&e.to_string())),
        }
    }

    /// The checks, then the proxy's answer to a probe on the socket.
    pub async fn probe(&self) -> Result<(), String> {
        handoff::probe(&self.socket)
            .await
            .map_err(|e| self.refusal(&e.to_string()))
    }

    /// [`Gate::probe`], retried for `within` (a proxy restarting replaces
    /// its socket before it serves its control API again).
    pub async fn wait(&self, within: Duration) -> Result<(), String> {
        let end = tokio::time::Instant::now() + within;
        loop {
            match self.probe().await {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() >= end => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// The operator's message: what failed, which key named the socket, and
    /// the two ways out.
    fn refusal(&self, why: &str) -> String {
        format!(
            "confined children cannot be bound to their runs: the listener hand-off socket {} ({}) cannot be used: {why}. \
             Both services derive it from this file: run the proxy on this host with this file ([proxy] handoff moves \
             the socket for both; [executor] proxy_handoff names where the executor sees it, if elsewhere), or set \
             [executor] allow_relay = true to relay children's connections instead (the proxy on another host; they \
             are then not bound to their run)",
            self.socket.display(),
            self.binding.source()
        )
    }
}
