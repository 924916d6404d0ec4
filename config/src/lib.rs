//! The one Loom Egress configuration file: typed schema, loading, validation
//! with errors that name the file, the key path and what is wrong, and the
//! compiled form the proxy decides with (allowlists, range tables, policy
//! digest). Pure: no I/O beyond reading the file, no async runtime.

pub mod allowlist;
pub mod audit;
pub mod binding;
pub mod credentials;
pub mod diff;
pub mod executor;
pub mod fleet;
pub mod host;
pub mod mcp;
pub mod principals;
pub mod ranges;
mod reader;
pub mod requests;
mod schema;
pub mod secrets;
pub mod sign;
pub mod sources;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use allowlist::{Allowlist, Entry, EntryProtocol, Match, Rule, RuleError};
pub use audit::AuditConfig;
pub use binding::Binding;
pub use credentials::{Credential, Plaintext, Secret, SecretSource, Template};
pub use executor::{ExecutorConfig, Isolation, Lifecycle, Network, ProcessConfig, Protocol, SessionLimits};
pub use fleet::{CellConfig, ExportConfig, Sink};
pub use host::{parse_authority, parse_host, Host, HostError};
pub use ipnet::IpNet;
pub use mcp::{McpEntry, McpList, McpMatch, McpRules};
pub use ranges::{RangeTable, RangeVerdict};
pub use schema::{DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_CONCURRENT_FETCHES, DEFAULT_MAX_QUEUED_FETCHES};
pub use secrets::SecretScan;
pub use sources::{LiveKind, LiveSource};

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

/// Every problem found while loading one file: unknown keys, values of the
/// wrong type and invalid values alike (only a syntax error stops the
/// reading, so it comes alone).
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl ConfigError {
    /// One line per problem: `file: key.path: message`.
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.problems.iter().map(|p| {
            if p.path.is_empty() {
                format!("{}: {}", self.file, p.message)
            } else {
                format!("{}: {}: {}", self.file, p.path, p.message)
            }
        })
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, line) in self.lines().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            f.write_str(&line)?;
        }
        Ok(())
    }
}

/// A tool's per-run budgets (`None`: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Budgets {
    /// `max_requests_per_run`: fetches (a tunnel, a plain request, each
    /// request inside an intercepted tunnel) a run may make.
    pub requests: Option<u64>,
    /// `max_bytes_per_run`: bytes both ways across all of a run's fetches.
    pub bytes: Option<u64>,
    /// `max_request_rate`: a token bucket per run.
    pub rate: Option<Rate>,
}

/// `max_request_rate = { per_second, burst }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_second: u32,
    /// Requests that may come at once (default: `per_second`).
    pub burst: u32,
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
    /// `[tools.<id>.credentials.<name>]`, by name; their secrets are empty
    /// until [`Config::load_secrets`].
    pub credentials: Vec<Credential>,
    /// `inspect = true`: every CONNECT of the tool is intercepted (HTTP-level
    /// policy and facts inside TLS), not only those to credential hosts.
    pub inspect: bool,
    /// `[tools.<id>.process]`: how the executor runs the tool (`None`: the
    /// executor does not serve it).
    pub process: Option<ProcessConfig>,
    /// The secrets of the tool's own credentials in every form (what its
    /// responses are scrubbed of); empty until [`Config::load_secrets`].
    pub secrets: SecretScan,
    /// Per-run budgets of requests, bytes and request rate.
    pub budgets: Budgets,
    /// `on_unlisted = "ask"`: how long a fetch to an unlisted name is held
    /// for a grant of its run (`None`: `"deny"`, denied at once).
    pub ask: Option<Duration>,
    /// `[tools.<id>.mcp]`: what the tool's MCP server may be asked for
    /// (`None`: no MCP rules, every call allowed).
    pub mcp: Option<McpRules>,
}

/// DNS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsConfig {
    /// Name servers; empty = the system resolver configuration (resolv.conf).
    pub servers: Vec<SocketAddr>,
    pub timeout: Duration,
}

/// The `[proxy]` section, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    pub listen: SocketAddr,
    pub control: SocketAddr,
    /// The fact store's file, or `:memory:` (never made relative).
    pub facts: PathBuf,
    /// The directory of the file this was read from (empty for text
    /// without one): where an in-memory store's neighbours go.
    pub config_dir: PathBuf,
    /// Unix socket on which the executor hands over the listening socket it
    /// created inside a confined child's network namespace, as written
    /// (`None`: the default beside the facts store, see
    /// [`ProxyConfig::handoff_socket`]).
    pub handoff: Option<PathBuf>,
    pub max_run: Duration,
    pub max_runs: usize,
    pub dns: DnsConfig,
    pub header_read_timeout: Duration,
    /// How long a fetch of a run that is created but not yet active waits
    /// for its activation before it is denied `run_not_active` (0: at once).
    /// The executor hands the invocation to the child and activates the
    /// run side by side, so the child's first fetch may come first.
    pub activation_wait: Duration,
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
    /// `decisions`: which allowed fetches the decision log records.
    pub decisions: Decisions,
    /// `decisions_max_mb`: size budget of the decision log, in bytes (the
    /// oldest records are dropped beyond it).
    pub decisions_max_bytes: u64,
    /// `decisions_retention_hours`: records older than this are deleted.
    pub decisions_retention: Duration,
    pub drain_timeout: Duration,
    pub tls: Option<TlsConfig>,
    /// The policy envelope: a config file whose tools and ranges bound what
    /// any policy in force may reach (see `egress_config::diff`).
    pub envelope: Option<PathBuf>,
    /// `[proxy.interception]`: the appliance CA and the roots origins are
    /// verified against, for CONNECTs the proxy terminates.
    pub interception: InterceptionConfig,
}

/// `[proxy] decisions`: which allowed fetches and tunnels the decision log
/// records (denials are facts, always recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decisions {
    /// None (the default).
    Off,
    /// One in `n` (`decisions_sample`).
    Sampled(u32),
    /// Every one.
    All,
}

/// `[proxy.interception]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InterceptionConfig {
    /// Where the appliance CA lives (`ca.pem`, `ca.key` 0600, `bundle.pem`).
    /// `None`: a directory `ca` beside the facts store; with `facts =
    /// ":memory:"`, an ephemeral CA that lives as long as the process.
    pub ca_dir: Option<PathBuf>,
    /// PEM roots that origins of intercepted connections are verified
    /// against instead of the system roots (labs and tests).
    pub upstream_ca_file: Option<PathBuf>,
}

impl ProxyConfig {
    /// The directory of the proxy's own files when the file names no other
    /// place (the control token, the hand-off socket, the appliance CA):
    /// the fact store's directory, or with an in-memory store the config
    /// file's.
    pub fn home(&self) -> PathBuf {
        if self.facts.as_os_str() == ":memory:" {
            self.config_dir.clone()
        } else {
            self.facts.parent().unwrap_or(Path::new("")).to_path_buf()
        }
    }
}

/// The defaults of every `[proxy]` key.
impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 3128)),
            control: SocketAddr::from(([127, 0, 0, 1], 3129)),
            facts: PathBuf::from("var/egress-facts.db"),
            config_dir: PathBuf::new(),
            handoff: None,
            max_run: Duration::from_secs(3600),
            max_runs: 10_000,
            dns: DnsConfig {
                servers: vec![],
                timeout: Duration::from_secs(2),
            },
            header_read_timeout: Duration::from_secs(10),
            activation_wait: Duration::from_secs(1),
            max_header_bytes: 32 * 1024,
            tunnel_idle_timeout: Duration::from_secs(120),
            max_connections: 4096,
            max_pending_connections: 256,
            pending_head_timeout: Duration::from_secs(3),
            max_connections_per_run: 64,
            max_control_connections: 256,
            max_event_streams: 32,
            facts_max_bytes: 1024 * 1024 * 1024,
            facts_retention: Duration::from_secs(720 * 3600),
            decisions: Decisions::Off,
            decisions_max_bytes: 256 * 1024 * 1024,
            decisions_retention: Duration::from_secs(168 * 3600),
            drain_timeout: Duration::from_secs(10),
            tls: None,
            envelope: None,
            interception: InterceptionConfig::default(),
        }
    }
}

/// Certificate and key for TLS on both listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// The secrets of every credential of every tool in every form (what no
    /// request head may carry but to its credential's hosts); empty until
    /// [`Config::load_secrets`].
    pub secrets: SecretScan,
}

impl Policy {
    pub fn tool(&self, id: &str) -> Option<&Arc<ToolPolicy>> {
        self.tools.get(id)
    }

    /// Rebuilds the secret scans of the tools in `changed` and of the
    /// policy, after their credentials' values changed (a live source's
    /// refresh): the other tools' scans stay.
    pub fn index_secrets_of(&mut self, changed: &std::collections::BTreeSet<String>) {
        for (id, t) in self.tools.iter_mut() {
            if changed.contains(id) {
                let t = Arc::make_mut(t);
                t.secrets = SecretScan::build(t.credentials.iter().enumerate().map(|(i, c)| (&t.id, i, c)));
            }
        }
        self.secrets = SecretScan::build(
            self.tools
                .values()
                .flat_map(|t| t.credentials.iter().enumerate().map(move |(i, c)| (&t.id, i, c))),
        );
    }

    /// Builds the secret scans of the policy and of each tool from the
    /// credentials' loaded secrets.
    pub fn index_secrets(&mut self) {
        let all: std::collections::BTreeSet<String> = self.tools.keys().cloned().collect();
        self.index_secrets_of(&all);
    }
}

/// A whole validated configuration file.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it came from (`<embedded default>` or a path).
    pub source: String,
    pub proxy: ProxyConfig,
    pub policy: Arc<Policy>,
    pub executor: ExecutorConfig,
    /// `[cell]` (`None` without the table: a machine of its own, as before).
    pub cell: Option<CellConfig>,
    /// `[export]`.
    pub export: ExportConfig,
    /// `[audit]`: sinks of OCSF events, the chain's checkpoints.
    pub audit: AuditConfig,
    /// `[control]`.
    pub control: ControlConfig,
}

/// `[control]`: who may use the control plane (the proxy's control API and
/// the executor's API).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlConfig {
    /// The principals file (mode 0600); unset: single-token mode.
    pub principals_file: Option<PathBuf>,
    /// `GET /metrics` needs a principal with the `metrics` scope.
    pub metrics_require_token: bool,
    /// `[control.tls]`: HTTPS with optional client certificates on the
    /// control listener and the executor's listener.
    pub tls: Option<ControlTls>,
}

/// `[control.tls]`: the certificate both control listeners serve, the CA
/// whose client certificates they accept (a certificate from any other CA
/// fails the handshake; one from this CA names its principal by subject
/// CN or SAN), and the CA the executor verifies the proxy's with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
    /// Default: `client_ca` (one private CA issuing both).
    pub server_ca: Option<PathBuf>,
}

impl Config {
    /// Reads and validates a file; relative paths in it are relative to the
    /// file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let dir = path.parent().unwrap_or(Path::new(""));
        Config::load_relative_to(path, dir)
    }

    /// Reads and validates a file; relative paths in it are resolved against
    /// `dir` (the executor passes the file's directory made absolute, so a
    /// child that starts elsewhere still finds them).
    pub fn load_relative_to(path: &Path, dir: &Path) -> Result<Config, ConfigError> {
        let (file, config, problems) = read(path, dir);
        verdict(file, config, problems)
    }

    /// Reads a file as far as it goes, for a checker that wants to look
    /// further than the schema (the executor's `check` looks for each tool's
    /// program and files): see [`Checked`].
    pub fn check_relative_to(path: &Path, dir: &Path) -> Checked {
        let (file, config, problems) = read(path, dir);
        Checked {
            config,
            error: (!problems.is_empty()).then_some(ConfigError { file, problems }),
        }
    }

    /// Loads the secret of every credential (from the proxy's environment
    /// or a file of mode 0600 or stricter), reporting every one that cannot
    /// be loaded under its key path. Only the proxy calls this, at start and
    /// on each reload.
    pub fn load_secrets(&mut self) -> Result<(), ConfigError> {
        let mut problems = reader::Problems::default();
        let policy = Arc::make_mut(&mut self.policy);
        let tools = policy
            .tools
            .iter_mut()
            .map(|(id, t)| (id.as_str(), &mut Arc::make_mut(t).credentials));
        credentials::load_all(tools, &mut problems);
        if problems.0.is_empty() {
            policy.index_secrets();
            Ok(())
        } else {
            Err(ConfigError {
                file: self.source.clone(),
                problems: problems.0,
            })
        }
    }

    /// [`Config::parse_relative_to`] with the environment and host name
    /// given (what `[cell]` reads), for tests.
    pub fn parse_with_env(
        text: &str,
        file: &str,
        dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
        host: &dyn Fn() -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let (config, problems) = schema::parse_with_env(text, file, dir, env, host);
        verdict(file.to_owned(), config, problems)
    }

    /// The embedded default configuration.
    pub fn embedded_default() -> Config {
        match Config::parse(EMBEDDED_DEFAULT, "<embedded default>") {
            Ok(c) => c,
            // The embedded text is covered by a unit test; this arm is unreachable.
            Err(e) => panic!("embedded default config is invalid: {e}"),
        }
    }

    /// Parses and validates config text; `file` names it in errors. Relative
    /// paths stay as written.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        Config::parse_relative_to(text, file, Path::new(""))
    }

    /// Parses and validates config text, resolving relative paths against
    /// `dir` (a process `cwd` of `.`, the default, becomes `dir` itself).
    pub fn parse_relative_to(text: &str, file: &str, dir: &Path) -> Result<Config, ConfigError> {
        let (config, problems) = schema::parse(text, file, dir);
        verdict(file.to_owned(), config, problems)
    }
}

/// The file's name, what could be read of it, and every problem.
fn read(path: &Path, dir: &Path) -> (String, Option<Config>, Vec<Problem>) {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let (config, problems) = schema::parse(&text, &file, dir);
            (file, config, problems)
        }
        Err(e) => {
            let unreadable = Problem {
                path: String::new(),
                message: format!("cannot read file: {e}"),
            };
            (file, None, vec![unreadable])
        }
    }
}

/// A configuration only when it has no problem.
fn verdict(file: String, config: Option<Config>, problems: Vec<Problem>) -> Result<Config, ConfigError> {
    match config {
        Some(config) if problems.is_empty() => Ok(config),
        _ => Err(ConfigError { file, problems }),
    }
}

/// A file read as far as it goes: `config` is `None` only when the file
/// cannot be read or is not TOML; otherwise an invalid value reads as its
/// default (and is one of `error`'s problems) and a process section whose
/// `command` is unusable reads as absent.
#[derive(Debug)]
pub struct Checked {
    pub config: Option<Config>,
    pub error: Option<ConfigError>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// `facts = ":memory:"` is the in-memory store wherever the file lives;
    /// other relative facts paths are the file's directory's.
    #[test]
    fn an_in_memory_store_is_not_a_path_relative_to_the_file() {
        let dir = Path::new("/etc/loom");
        let c = Config::parse_relative_to("[proxy]\nfacts = \":memory:\"\n", "c.toml", dir).unwrap();
        assert_eq!(c.proxy.facts, PathBuf::from(":memory:"));
        assert_eq!(
            c.proxy.home(),
            PathBuf::from("/etc/loom"),
            "its neighbours go beside the file"
        );
        let c = Config::parse_relative_to("[proxy]\nfacts = \"var/f.db\"\n", "c.toml", dir).unwrap();
        assert_eq!(c.proxy.facts, PathBuf::from("/etc/loom/var/f.db"));
        assert_eq!(c.proxy.home(), PathBuf::from("/etc/loom/var"));
    }

    /// Every default of the file, spelled out: changing one is a decision
    /// this test makes visible (and adding a field makes it fail to compile).
    #[test]
    fn the_complete_default_configuration() {
        let c = Config::embedded_default();
        assert_eq!(c.source, "<embedded default>");
        assert_eq!(
            c.proxy,
            ProxyConfig {
                listen: "127.0.0.1:3128".parse().unwrap(),
                control: "127.0.0.1:3129".parse().unwrap(),
                facts: PathBuf::from("var/egress-facts.db"),
                config_dir: PathBuf::new(),
                handoff: None,
                max_run: Duration::from_millis(3_600_000),
                max_runs: 10_000,
                dns: DnsConfig {
                    servers: vec![],
                    timeout: Duration::from_millis(2000),
                },
                header_read_timeout: Duration::from_millis(10_000),
                activation_wait: Duration::from_millis(1000),
                max_header_bytes: 32_768,
                tunnel_idle_timeout: Duration::from_millis(120_000),
                max_connections: 4096,
                max_pending_connections: 256,
                pending_head_timeout: Duration::from_millis(3000),
                max_connections_per_run: 64,
                max_control_connections: 256,
                max_event_streams: 32,
                facts_max_bytes: 1024 << 20,
                facts_retention: Duration::from_secs(720 * 3600),
                decisions: Decisions::Off,
                decisions_max_bytes: 256 << 20,
                decisions_retention: Duration::from_secs(168 * 3600),
                drain_timeout: Duration::from_millis(10_000),
                tls: None,
                envelope: None,
                interception: InterceptionConfig::default(),
            }
        );
        assert_eq!(
            c.executor,
            ExecutorConfig {
                listen: "127.0.0.1:3130".parse().unwrap(),
                scratch_dir: std::env::temp_dir().join("loom-egress"),
                pid_namespace: true,
                stdout_cap_bytes: 1 << 20,
                stderr_cap_bytes: 16 << 10,
                max_message_bytes: 1 << 20,
                max_run_bytes: 16 << 20,
                child_uid: 65534,
                child_gid: 65534,
                child_uid_count: 1,
                cgroup: None,
                proxy_handoff: None,
                allow_relay: false,
                name: "egress-executor".into(),
                lease_ms: 15_000,
                journal_max_mb: 64,
            }
        );
        // Confined children are bound to their runs with no key set: both
        // services find the hand-off socket beside the facts store.
        assert_eq!(
            c.binding(),
            Binding::Handoff {
                socket: PathBuf::from("var/egress-handoff.sock"),
                key: "proxy.facts"
            }
        );
        assert!(c.policy.tools.is_empty(), "no tools: every fetch is denied");
        assert_eq!(c.cell, None, "no [cell]: a machine of its own");
        assert_eq!(
            c.export,
            ExportConfig {
                sink: Sink::None,
                dsn_env: "EGRESS_EXPORT_DSN".into(),
                batch_max: 500,
                flush: Duration::from_millis(200),
                max_lag: 10_000,
                schema: "public".into(),
                flush_timeout: Duration::from_secs(10),
            }
        );
        assert!(c.policy.ranges.allow_ranges().is_empty() && c.policy.ranges.deny_ranges().is_empty());
        // The digest of the empty policy (the canonical text is empty).
        assert_eq!(
            c.policy.digest,
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );

        // The embedded text only restates defaults: an empty file is the same.
        let empty = Config::parse("", "empty.toml").unwrap();
        assert_eq!((empty.proxy, empty.executor), (c.proxy, c.executor));

        // A tool that sets nothing but its command.
        let c = Config::parse("[tools.t.process]\ncommand = [\"x\"]\n", "t.toml").unwrap();
        let t = c.policy.tool("t").unwrap();
        assert_eq!(
            (
                t.fetch_timeout,
                t.max_concurrent_fetches,
                t.max_queued_fetches,
                t.mode,
                &t.methods
            ),
            (Duration::from_millis(30_000), 8, 64, Mode::Enforce, &None)
        );
        assert!(t.allowlist.rules().is_empty());
        assert!(t.credentials.is_empty());
        assert_eq!(
            t.process,
            Some(ProcessConfig {
                command: vec!["x".into()],
                cwd: PathBuf::from("."),
                env: BTreeMap::new(),
                path: "/usr/local/bin:/usr/bin:/bin".into(),
                lang: "C.UTF-8".into(),
                cold_start_ms: 10_000,
                timeout_ms: 30_000,
                warm: 1,
                max: 8,
                queue: 64,
                isolation: Isolation::Strict,
                protocol: Protocol::Loom,
                read_paths: vec![],
                memory_mb: 512,
                max_pids: 64,
                cpu_ms: 40_000,
                cpu_percent: None,
                network: crate::Network::Proxy,
                fork_server: false,
                lifecycle: crate::Lifecycle::Invocation,
                session: crate::SessionLimits::default(),
                expect_sha256: BTreeMap::new(),
            })
        );
    }
}
