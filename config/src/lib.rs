//! The one Loom Egress configuration file: typed schema, loading, validation
//! with errors that name the file, the key path and what is wrong, and the
//! compiled form the proxy decides with (allowlists, range tables, policy
//! digest). Pure: no I/O beyond reading the file, no async runtime.

pub mod allowlist;
pub mod host;
pub mod ranges;
mod schema;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use allowlist::{Allowlist, Match, Rule, RuleError};
pub use host::{parse_authority, parse_host, Host, HostError};
pub use ipnet::IpNet;
pub use ranges::{RangeTable, RangeVerdict};

/// The configuration used when no file is given: loopback listeners, no tools,
/// so every fetch is denied.
pub const EMBEDDED_DEFAULT: &str = r#"# Loom Egress embedded default: no tools, so everything is denied.
[proxy]
listen  = "127.0.0.1:3128"
control = "127.0.0.1:3129"
facts   = "var/egress-facts.db"
"#;

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `tools.weather.egress[2]`.
    pub path: String,
    pub message: String,
}

/// Every problem found while loading one file.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if p.path.is_empty() {
                write!(f, "{}: {}", self.file, p.message)?;
            } else {
                write!(f, "{}: {}: {}", self.file, p.path, p.message)?;
            }
        }
        Ok(())
    }
}

/// What a tool's policy does with a fetch it would deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    /// Allow, but record the denial enforce mode would have made.
    Report,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Report => "report",
        }
    }
}

/// One tool's compiled egress policy.
#[derive(Debug, Clone)]
pub struct ToolPolicy {
    pub id: Arc<str>,
    pub allowlist: Allowlist,
    pub fetch_timeout: Duration,
    pub max_concurrent_fetches: usize,
    /// Fetches that may wait for a slot before `concurrency_limit` denials start.
    pub max_queued_fetches: usize,
    pub mode: Mode,
    /// Upper-case HTTP methods allowed for plain-HTTP fetches (`None` = any;
    /// `CONNECT` must be listed to allow tunnels when set).
    pub methods: Option<Vec<String>>,
    /// The `[tools.<id>.process]` table, validated by the executor.
    pub process: Option<toml::Table>,
}

/// DNS settings.
#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// Name servers; empty = the system resolver configuration (resolv.conf).
    pub servers: Vec<SocketAddr>,
    pub timeout: Duration,
}

/// The `[proxy]` section, validated.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub listen: SocketAddr,
    pub control: SocketAddr,
    pub facts: PathBuf,
    /// Unix socket on which the executor hands over the listening socket it
    /// created inside a confined child's network namespace (`None`: off).
    pub handoff: Option<PathBuf>,
    pub max_run: Duration,
    pub max_runs: usize,
    pub dns: DnsConfig,
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub tunnel_idle_timeout: Duration,
    /// Established data connections (a request on them authenticated).
    pub max_connections: usize,
    /// Connections per listener that have not yet sent an authenticated
    /// request; the oldest is closed when a new one arrives beyond this.
    pub max_pending_connections: usize,
    /// How long a new connection may stay pending before it is closed.
    pub pending_head_timeout: Duration,
    /// Established data connections one run may hold.
    pub max_connections_per_run: usize,
    /// Established control connections (a request carried the token).
    pub max_control_connections: usize,
    /// Concurrent `/v1/facts/stream` readers.
    pub max_event_streams: usize,
    /// Size budget of the fact store, in bytes.
    pub facts_max_bytes: u64,
    /// Facts older than this may be deleted to stay within the budget.
    pub facts_retention: Duration,
    pub drain_timeout: Duration,
    pub tls: Option<TlsConfig>,
}

/// Certificate and key for TLS on both listeners.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The policy half of the configuration: what the proxy decides with. It can
/// be swapped at run time (reload) without touching listeners.
#[derive(Debug, Clone)]
pub struct Policy {
    pub tools: BTreeMap<String, Arc<ToolPolicy>>,
    pub ranges: RangeTable,
    /// `sha256:` + hex digest of the canonical policy text.
    pub digest: String,
}

impl Policy {
    pub fn tool(&self, id: &str) -> Option<&Arc<ToolPolicy>> {
        self.tools.get(id)
    }
}

/// A whole validated configuration file.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it came from (`<embedded default>` or a path).
    pub source: String,
    pub proxy: ProxyConfig,
    pub policy: Arc<Policy>,
    /// The `[executor]` table, validated by the executor.
    pub executor: Option<toml::Table>,
}

impl Config {
    /// Reads and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            problems: vec![Problem {
                path: String::new(),
                message: format!("cannot read file: {e}"),
            }],
        })?;
        let mut cfg = Config::parse(&text, &file)?;
        // Relative paths in the file are relative to the file's directory.
        if let Some(dir) = path.parent() {
            if cfg.proxy.facts.is_relative() && !dir.as_os_str().is_empty() {
                cfg.proxy.facts = dir.join(&cfg.proxy.facts);
            }
            if let Some(h) = cfg.proxy.handoff.as_mut() {
                if h.is_relative() && !dir.as_os_str().is_empty() {
                    *h = dir.join(&*h);
                }
            }
            if let Some(tls) = cfg.proxy.tls.as_mut() {
                if tls.cert.is_relative() && !dir.as_os_str().is_empty() {
                    tls.cert = dir.join(&tls.cert);
                }
                if tls.key.is_relative() && !dir.as_os_str().is_empty() {
                    tls.key = dir.join(&tls.key);
                }
            }
        }
        Ok(cfg)
    }

    /// The embedded default configuration.
    pub fn embedded_default() -> Config {
        match Config::parse(EMBEDDED_DEFAULT, "<embedded default>") {
            Ok(c) => c,
            // The embedded text is covered by a unit test; this arm is unreachable.
            Err(e) => panic!("embedded default config is invalid: {e}"),
        }
    }

    /// Parses and validates config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        schema::parse(text, file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_is_valid_and_denies_everything() {
        let c = Config::embedded_default();
        assert!(c.policy.tools.is_empty());
        assert_eq!(c.proxy.listen, "127.0.0.1:3128".parse().unwrap());
        assert_eq!(c.proxy.control, "127.0.0.1:3129".parse().unwrap());
    }
}
