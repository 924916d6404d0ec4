//! The confinement seam: what is applied to a child between clone and exec.
//! Today only `off` exists; `strict` (network namespace, Landlock, seccomp,
//! rlimits, unprivileged uid) is accepted by the config but refused at start,
//! loudly, until it is built. Nothing here pretends to confine.

use crate::config::Isolation;

/// A confinement step. Must be `Copy` and its child-side work
/// async-signal-safe: it runs in the child after clone, before exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confinement {
    /// No confinement beyond the executor's own guarantees (fresh process
    /// group or PID namespace, scrubbed environment, fds 0-4 only).
    Off,
}

/// Why a requested confinement cannot be provided.
#[derive(Debug, thiserror::Error)]
#[error("isolation = \"strict\" was requested for tool `{tool}`, but strict confinement (network namespace, Landlock, seccomp) is not implemented yet; set isolation = \"off\" to run this tool unconfined")]
pub struct Unavailable {
    pub tool: String,
}

impl Confinement {
    /// The confinement for a tool's configured isolation level.
    pub fn for_isolation(tool: &str, isolation: Isolation) -> Result<Self, Unavailable> {
        match isolation {
            Isolation::Off => Ok(Confinement::Off),
            Isolation::Strict => Err(Unavailable { tool: tool.to_string() }),
        }
    }

    /// Child side, between clone and exec. Returns `Err(())` (with errno set)
    /// on failure; the caller reports the errno and exits.
    #[allow(clippy::result_unit_err)]
    pub fn apply_in_child(self) -> Result<(), ()> {
        match self {
            Confinement::Off => Ok(()),
        }
    }
}
