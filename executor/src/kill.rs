//! Why a child's tree was killed: the one vocabulary behind the `reason`
//! label of `executor_kills_total` (documented in `docs/executor.md`).

use crate::error::{ErrorKind, InvokeError};

/// Why a child was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KillReason {
    /// Its one invocation finished (result, tool error, or plain exit).
    Done,
    /// The invocation ran past its timeout.
    Timeout,
    /// The kernel aborted the invocation (or its caller went away).
    Abort,
    /// The child broke the protocol during the invocation.
    Protocol,
    /// The child closed its pipe or died before a result.
    Disconnected,
    /// Its run could not be activated on the proxy.
    ProxyError,
    /// It failed to start (before `ready`).
    Startup,
    /// An idle warm child made room for a dedicated one, or the pool closed.
    Evicted,
    /// An idle warm child exited, closed its pipe or spoke out of turn.
    WarmDeath,
    /// An idle warm child grew too old for its run and was replaced.
    Recycled,
}

impl KillReason {
    pub const ALL: [KillReason; 10] = [
        KillReason::Done,
        KillReason::Timeout,
        KillReason::Abort,
        KillReason::Protocol,
        KillReason::Disconnected,
        KillReason::ProxyError,
        KillReason::Startup,
        KillReason::Evicted,
        KillReason::WarmDeath,
        KillReason::Recycled,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            KillReason::Done => "done",
            KillReason::Timeout => "timeout",
            KillReason::Abort => "abort",
            KillReason::Protocol => "protocol",
            KillReason::Disconnected => "disconnected",
            KillReason::ProxyError => "proxy_error",
            KillReason::Startup => "startup",
            KillReason::Evicted => "evicted",
            KillReason::WarmDeath => "warm_death",
            KillReason::Recycled => "recycled",
        }
    }

    /// Why the child of a finished invocation is killed.
    pub fn after<T>(outcome: &Result<T, InvokeError>) -> KillReason {
        match outcome {
            Ok(_) => KillReason::Done,
            Err(e) => match e.kind {
                ErrorKind::Timeout => KillReason::Timeout,
                ErrorKind::Aborted => KillReason::Abort,
                ErrorKind::Protocol => KillReason::Protocol,
                ErrorKind::Disconnected => KillReason::Disconnected,
                ErrorKind::Proxy => KillReason::ProxyError,
                _ => KillReason::Done,
            },
        }
    }
}

impl std::fmt::Display for KillReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_documented_ones() {
        let labels: Vec<&str> = KillReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            [
                "done",
                "timeout",
                "abort",
                "protocol",
                "disconnected",
                "proxy_error",
                "startup",
                "evicted",
                "warm_death",
                "recycled"
            ]
        );
    }

    #[test]
    fn an_invocation_outcome_names_the_kill() {
        let err = |k| Err::<(), _>(InvokeError::new(k, "x"));
        assert_eq!(KillReason::after(&Ok::<(), InvokeError>(())), KillReason::Done);
        assert_eq!(KillReason::after(&err(ErrorKind::Timeout)), KillReason::Timeout);
        assert_eq!(KillReason::after(&err(ErrorKind::Aborted)), KillReason::Abort);
        assert_eq!(KillReason::after(&err(ErrorKind::Protocol)), KillReason::Protocol);
        assert_eq!(
            KillReason::after(&err(ErrorKind::Disconnected)),
            KillReason::Disconnected
        );
        assert_eq!(KillReason::after(&err(ErrorKind::Proxy)), KillReason::ProxyError);
        assert_eq!(KillReason::after(&err(ErrorKind::ToolError)), KillReason::Done);
    }
}
