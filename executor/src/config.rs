//! The executor's view of the shared config file: `[proxy] control`/`facts`,
//! `[executor]` and `[tools.<id>.process]`. Every other key belongs to the
//! proxy and is ignored here; unknown keys inside the two executor-owned tables
//! are errors naming the key path. Kept self-contained so it can later be
//! swapped for the `egress-config` crate.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A config error; every message names the file and the key path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read { file: String, source: std::io::Error },
    #[error("{file}: invalid TOML: {message}")]
    Syntax { file: String, message: String },
    #[error("{file}: unknown key `{path}`")]
    UnknownKey { file: String, path: String },
    #[error("{file}: `{path}`: {message}")]
    Invalid {
        file: String,
        path: String,
        message: String,
    },
}

/// What the executor reads from the file.
#[derive(Debug, Clone)]
pub struct Config {
    pub file: PathBuf,
    /// Directory of the config file; relative paths are relative to it.
    pub dir: PathBuf,
    pub control: SocketAddr,
    pub facts: PathBuf,
    /// `[proxy] max_run_ms`: runs expire this long after creation, so warm
    /// children are recycled before their run could expire.
    pub max_run_ms: u64,
    pub executor: ExecutorSection,
    /// Every tool id in `[tools]`, with its process section if it has one.
    pub tools: BTreeMap<String, Option<ProcessConfig>>,
}

/// `[executor]`.
#[derive(Debug, Clone)]
pub struct ExecutorSection {
    pub listen: SocketAddr,
    /// Parent of the per-run scratch directories.
    pub scratch_dir: PathBuf,
    /// Use a PID namespace per child where the host allows it.
    pub pid_namespace: bool,
    /// Bytes of stdout kept per child (head), and of stderr (tail).
    pub stdout_cap_bytes: usize,
    pub stderr_cap_bytes: usize,
    /// Largest protocol line, and all protocol bytes of one run.
    pub max_message_bytes: usize,
    pub max_run_bytes: usize,
    /// Unprivileged uid/gid of confined children: `child_uid_count`
    /// consecutive ids from these, one per child in turn.
    pub child_uid: u32,
    pub child_gid: u32,
    pub child_uid_count: u32,
    /// A delegated cgroup v2 directory for per-child cgroups (else v1).
    pub cgroup: Option<PathBuf>,
    /// Unix socket of the proxy's listener hand-off (unset: relay).
    pub proxy_handoff: Option<PathBuf>,
    /// The owner name `serve` creates runs under on the proxy (one per
    /// executor: a restarted instance ends what its predecessor left).
    pub name: String,
    /// The owner lease `serve` holds and renews every third of it: after a
    /// crash, the proxy ends the executor's runs within this.
    pub lease_ms: u64,
}

/// `isolation` of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// No confinement layer.
    Off,
    /// Every layer the host can provide; one warning per missing layer.
    BestEffort,
    /// Every layer, or the pool does not start.
    Strict,
}

/// `protocol` of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Loom,
    Plain,
}

/// `[tools.<id>.process]`.
#[derive(Debug, Clone)]
pub struct ProcessConfig {
    pub command: Vec<String>,
    pub cwd: PathBuf,
    /// Extra environment: literal values (never passed through from the
    /// executor's own environment).
    pub env: BTreeMap<String, String>,
    pub path: String,
    pub lang: String,
    pub cold_start_ms: u64,
    pub timeout_ms: u64,
    pub warm: usize,
    pub max: usize,
    pub queue: usize,
    pub isolation: Isolation,
    pub protocol: Protocol,
    /// Extra paths a confined child may read (and execute).
    pub read_paths: Vec<PathBuf>,
    /// cgroup memory limit of a confined child (its whole tree).
    pub memory_mb: u64,
    /// cgroup process limit of a confined child (its whole tree).
    pub max_pids: u64,
    /// CPU time limit (RLIMIT_CPU, rounded up to whole seconds) per process.
    pub cpu_ms: u64,
}

pub const DEFAULT_MEMORY_MB: u64 = 512;
pub const DEFAULT_MAX_PIDS: u64 = 64;
pub const DEFAULT_CHILD_ID: u32 = 65534;

pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
pub const DEFAULT_LANG: &str = "C.UTF-8";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:3130";
pub const DEFAULT_CONTROL: &str = "127.0.0.1:3129";

/// Variables the executor sets itself; `env` may not name them.
pub const RESERVED_ENV: &[&str] = &[
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "NODE_USE_ENV_PROXY",
    "LOOM_IPC_FDS",
    "TMPDIR",
    "PATH",
    "LANG",
];

const EXECUTOR_KEYS: &[&str] = &[
    "listen",
    "scratch_dir",
    "pid_namespace",
    "stdout_cap_bytes",
    "stderr_cap_bytes",
    "max_message_bytes",
    "max_run_bytes",
    "child_uid",
    "child_gid",
    "child_uid_count",
    "cgroup",
    "proxy_handoff",
    "name",
    "lease_ms",
];
const PROCESS_KEYS: &[&str] = &[
    "command",
    "cwd",
    "env",
    "path",
    "lang",
    "cold_start_ms",
    "timeout_ms",
    "pool",
    "isolation",
    "protocol",
    "read_paths",
    "memory_mb",
    "max_pids",
    "cpu_ms",
];
const POOL_KEYS: &[&str] = &["warm", "max", "queue"];

#[derive(Deserialize, Default)]
struct RawFile {
    #[serde(default)]
    proxy: RawProxy,
    executor: Option<toml::Table>,
    #[serde(default)]
    tools: BTreeMap<String, RawTool>,
}

#[derive(Deserialize, Default)]
struct RawProxy {
    control: Option<String>,
    facts: Option<PathBuf>,
    max_run_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
struct RawTool {
    process: Option<toml::Table>,
}

#[derive(Deserialize)]
struct RawExecutor {
    listen: Option<String>,
    scratch_dir: Option<PathBuf>,
    pid_namespace: Option<bool>,
    stdout_cap_bytes: Option<usize>,
    stderr_cap_bytes: Option<usize>,
    max_message_bytes: Option<usize>,
    max_run_bytes: Option<usize>,
    child_uid: Option<u32>,
    child_gid: Option<u32>,
    child_uid_count: Option<u32>,
    cgroup: Option<PathBuf>,
    proxy_handoff: Option<PathBuf>,
    name: Option<String>,
    lease_ms: Option<u64>,
}

#[derive(Deserialize)]
struct RawProcess {
    command: Vec<String>,
    cwd: Option<PathBuf>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    path: Option<String>,
    lang: Option<String>,
    cold_start_ms: Option<u64>,
    timeout_ms: Option<u64>,
    pool: Option<RawPool>,
    isolation: Option<String>,
    protocol: Option<String>,
    #[serde(default)]
    read_paths: Vec<PathBuf>,
    memory_mb: Option<u64>,
    max_pids: Option<u64>,
    cpu_ms: Option<u64>,
}

#[derive(Deserialize)]
struct RawPool {
    warm: Option<usize>,
    max: Option<usize>,
    queue: Option<usize>,
}

fn check_keys(file: &str, prefix: &str, table: &toml::Table, known: &[&str]) -> Result<(), ConfigError> {
    for key in table.keys() {
        if !known.contains(&key.as_str()) {
            return Err(ConfigError::UnknownKey {
                file: file.to_string(),
                path: format!("{prefix}.{key}"),
            });
        }
    }
    Ok(())
}

fn typed<T: serde::de::DeserializeOwned>(file: &str, path: &str, table: toml::Table) -> Result<T, ConfigError> {
    toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| ConfigError::Invalid {
            file: file.to_string(),
            path: path.to_string(),
            message: e.message().to_string(),
        })
}

fn addr(file: &str, path: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| ConfigError::Invalid {
        file: file.to_string(),
        path: path.to_string(),
        message: format!("`{s}` is not an IP address and port (names are never resolved)"),
    })
}

impl Config {
    /// Read and validate the file.
    pub fn load(file: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
            file: file.display().to_string(),
            source,
        })?;
        Config::parse(file, &text)
    }

    /// Validate `text` as if read from `file`.
    pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigError> {
        let f = file.display().to_string();
        let raw: RawFile = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            file: f.clone(),
            message: e.to_string(),
        })?;
        let dir = file
            .parent()
            .map(Path::to_path_buf)
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("."));
        // Absolute, so that paths relative to the file stay right for a child
        // that starts in another working directory (`cwd`).
        let dir = std::path::absolute(&dir).unwrap_or(dir);
        let rel = |p: PathBuf| if p.is_relative() { dir.join(p) } else { p };

        let control = addr(
            &f,
            "proxy.control",
            raw.proxy.control.as_deref().unwrap_or(DEFAULT_CONTROL),
        )?;
        let facts = rel(raw.proxy.facts.unwrap_or_else(|| PathBuf::from("var/egress-facts.db")));

        let executor = match raw.executor {
            None => ExecutorSection::defaults()?,
            Some(t) => {
                check_keys(&f, "executor", &t, EXECUTOR_KEYS)?;
                let r: RawExecutor = typed(&f, "executor", t)?;
                let d = ExecutorSection::defaults()?;
                let section = ExecutorSection {
                    listen: match r.listen {
                        Some(s) => addr(&f, "executor.listen", &s)?,
                        None => d.listen,
                    },
                    scratch_dir: r.scratch_dir.map(rel).unwrap_or(d.scratch_dir),
                    pid_namespace: r.pid_namespace.unwrap_or(d.pid_namespace),
                    stdout_cap_bytes: r.stdout_cap_bytes.unwrap_or(d.stdout_cap_bytes),
                    stderr_cap_bytes: r.stderr_cap_bytes.unwrap_or(d.stderr_cap_bytes),
                    max_message_bytes: r.max_message_bytes.unwrap_or(d.max_message_bytes),
                    max_run_bytes: r.max_run_bytes.unwrap_or(d.max_run_bytes),
                    child_uid: r.child_uid.unwrap_or(d.child_uid),
                    child_gid: r.child_gid.unwrap_or(d.child_gid),
                    child_uid_count: r.child_uid_count.unwrap_or(d.child_uid_count),
                    cgroup: r.cgroup.map(rel),
                    proxy_handoff: r.proxy_handoff.map(rel),
                    name: r.name.unwrap_or(d.name),
                    lease_ms: r.lease_ms.unwrap_or(d.lease_ms),
                };
                let name_ok = !section.name.is_empty()
                    && section.name.len() <= 128
                    && section
                        .name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'));
                if !name_ok {
                    return Err(ConfigError::Invalid {
                        file: f.clone(),
                        path: "executor.name".into(),
                        message: "must be 1-128 characters of A-Z a-z 0-9 - _ . ~".into(),
                    });
                }
                if !(1_000..=600_000).contains(&section.lease_ms) {
                    return Err(ConfigError::Invalid {
                        file: f.clone(),
                        path: "executor.lease_ms".into(),
                        message: format!("{} is out of range 1000..=600000", section.lease_ms),
                    });
                }
                if section.child_uid == 0 || section.child_gid == 0 || section.child_uid_count == 0 {
                    return Err(ConfigError::Invalid {
                        file: f.clone(),
                        path: "executor.child_uid".into(),
                        message: "child_uid and child_gid must not be 0 (root), child_uid_count at least 1".into(),
                    });
                }
                for (key, v) in [
                    ("max_message_bytes", section.max_message_bytes),
                    ("max_run_bytes", section.max_run_bytes),
                ] {
                    if v < 64 {
                        return Err(ConfigError::Invalid {
                            file: f.clone(),
                            path: format!("executor.{key}"),
                            message: "must be at least 64".into(),
                        });
                    }
                }
                section
            }
        };

        let mut tools = BTreeMap::new();
        for (id, tool) in raw.tools {
            let process = match tool.process {
                None => None,
                Some(t) => Some(parse_process(&f, &id, t, &dir)?),
            };
            tools.insert(id, process);
        }
        Ok(Config {
            file: file.to_path_buf(),
            dir,
            control,
            facts,
            max_run_ms: raw.proxy.max_run_ms.unwrap_or(3_600_000),
            executor,
            tools,
        })
    }

    /// The process config of `tool`: its own section, or defaults running
    /// `command` when the tool has none (used by `run -- CMD`).
    pub fn tool(&self, tool: &str) -> Option<&Option<ProcessConfig>> {
        self.tools.get(tool)
    }
}

impl ExecutorSection {
    fn defaults() -> Result<Self, ConfigError> {
        Ok(ExecutorSection {
            listen: DEFAULT_LISTEN.parse().map_err(|_| ConfigError::Invalid {
                file: String::new(),
                path: "executor.listen".into(),
                message: "bad default".into(),
            })?,
            scratch_dir: std::env::temp_dir().join("loom-egress"),
            pid_namespace: true,
            stdout_cap_bytes: 1 << 20,
            stderr_cap_bytes: 16 << 10,
            max_message_bytes: 1 << 20,
            max_run_bytes: 16 << 20,
            child_uid: DEFAULT_CHILD_ID,
            child_gid: DEFAULT_CHILD_ID,
            child_uid_count: 1,
            cgroup: None,
            proxy_handoff: None,
            name: "egress-executor".into(),
            lease_ms: 15_000,
        })
    }
}

impl ProcessConfig {
    /// Defaults for an ad-hoc command (`run -- CMD`): plain protocol, no
    /// pool, strict isolation (as for any tool that does not say otherwise).
    pub fn ad_hoc(command: Vec<String>, cwd: PathBuf) -> Self {
        ProcessConfig {
            command,
            cwd,
            env: BTreeMap::new(),
            path: DEFAULT_PATH.to_string(),
            lang: DEFAULT_LANG.to_string(),
            cold_start_ms: 10_000,
            timeout_ms: 30_000,
            warm: 0,
            max: 1,
            queue: 0,
            isolation: Isolation::Strict,
            protocol: Protocol::Plain,
            read_paths: Vec::new(),
            memory_mb: DEFAULT_MEMORY_MB,
            max_pids: DEFAULT_MAX_PIDS,
            cpu_ms: 40_000,
        }
    }
}

fn parse_process(f: &str, id: &str, table: toml::Table, dir: &Path) -> Result<ProcessConfig, ConfigError> {
    let prefix = format!("tools.{id}.process");
    check_keys(f, &prefix, &table, PROCESS_KEYS)?;
    if let Some(toml::Value::Table(pool)) = table.get("pool") {
        check_keys(f, &format!("{prefix}.pool"), pool, POOL_KEYS)?;
    }
    if !table.contains_key("command") {
        return Err(ConfigError::Invalid {
            file: f.to_string(),
            path: format!("{prefix}.command"),
            message: "is required (an array: program and arguments)".into(),
        });
    }
    let r: RawProcess = typed(f, &prefix, table)?;
    let invalid = |key: &str, message: String| ConfigError::Invalid {
        file: f.to_string(),
        path: format!("{prefix}.{key}"),
        message,
    };
    if r.command.is_empty() || r.command[0].is_empty() {
        return Err(invalid("command", "must name a program".into()));
    }
    if r.command.iter().any(|a| a.contains('\0')) {
        return Err(invalid("command", "must not contain NUL bytes".into()));
    }
    for (k, v) in &r.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(invalid(&format!("env.{k}"), "is not a valid variable".into()));
        }
        if RESERVED_ENV.contains(&k.as_str()) {
            return Err(invalid(
                &format!("env.{k}"),
                "is set by the executor and cannot be configured here (use `path`/`lang` for PATH/LANG)".into(),
            ));
        }
    }
    let cold_start_ms = r.cold_start_ms.unwrap_or(10_000);
    let timeout_ms = r.timeout_ms.unwrap_or(30_000);
    if cold_start_ms == 0 {
        return Err(invalid("cold_start_ms", "must be positive".into()));
    }
    if timeout_ms == 0 {
        return Err(invalid("timeout_ms", "must be positive".into()));
    }
    let (warm, max, queue) = match r.pool {
        None => (1, 8, 64),
        Some(p) => (p.warm.unwrap_or(1), p.max.unwrap_or(8), p.queue.unwrap_or(64)),
    };
    if max == 0 {
        return Err(invalid("pool.max", "must be at least 1".into()));
    }
    if warm > max {
        return Err(invalid("pool.warm", format!("is {warm}, more than pool.max = {max}")));
    }
    let isolation = match r.isolation.as_deref() {
        Some("off") => Isolation::Off,
        Some("best_effort") => Isolation::BestEffort,
        None | Some("strict") => Isolation::Strict,
        Some(other) => {
            return Err(invalid(
                "isolation",
                format!("`{other}` is not one of \"strict\", \"best_effort\", \"off\""),
            ))
        }
    };
    let memory_mb = r.memory_mb.unwrap_or(DEFAULT_MEMORY_MB);
    let max_pids = r.max_pids.unwrap_or(DEFAULT_MAX_PIDS);
    if memory_mb < 8 {
        return Err(invalid("memory_mb", "must be at least 8".into()));
    }
    if max_pids == 0 {
        return Err(invalid("max_pids", "must be at least 1".into()));
    }
    let cpu_ms = r.cpu_ms.unwrap_or(cold_start_ms.saturating_add(timeout_ms));
    if cpu_ms == 0 {
        return Err(invalid("cpu_ms", "must be positive".into()));
    }
    let read_paths: Vec<PathBuf> = r
        .read_paths
        .into_iter()
        .map(|p| if p.is_relative() { dir.join(p) } else { p })
        .collect();
    let protocol = match r.protocol.as_deref() {
        None | Some("loom") => Protocol::Loom,
        Some("plain") => Protocol::Plain,
        Some(other) => {
            return Err(invalid(
                "protocol",
                format!("`{other}` is not one of \"loom\", \"plain\""),
            ))
        }
    };
    let cwd = match r.cwd {
        Some(c) if c.is_relative() => dir.join(c),
        Some(c) => c,
        None => dir.to_path_buf(),
    };
    Ok(ProcessConfig {
        command: r.command,
        cwd,
        env: r.env,
        path: r.path.unwrap_or_else(|| DEFAULT_PATH.to_string()),
        lang: r.lang.unwrap_or_else(|| DEFAULT_LANG.to_string()),
        cold_start_ms,
        timeout_ms,
        warm,
        max,
        queue,
        isolation,
        protocol,
        read_paths,
        memory_mb,
        max_pids,
        cpu_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/etc/loom/egress.toml"), s)
    }

    #[test]
    fn defaults_and_relative_paths() {
        let c = parse(
            r#"
[proxy]
listen = "127.0.0.1:3128"
something_else = 1
[tools.weather]
egress = ["a.example:443"]
[tools.weather.process]
command = ["python3", "tools/weather.py"]
[tools.bare]
egress = []
"#,
        )
        .unwrap();
        assert_eq!(c.control.to_string(), "127.0.0.1:3129");
        assert_eq!(c.facts, Path::new("/etc/loom/var/egress-facts.db"));
        assert_eq!(c.executor.listen.to_string(), "127.0.0.1:3130");
        let p = c.tools["weather"].clone().unwrap();
        assert_eq!(p.cwd, Path::new("/etc/loom"));
        assert_eq!((p.warm, p.max, p.cold_start_ms, p.timeout_ms), (1, 8, 10_000, 30_000));
        assert_eq!(p.protocol, Protocol::Loom);
        assert_eq!(p.isolation, Isolation::Strict);
        assert_eq!((p.memory_mb, p.max_pids, p.cpu_ms), (512, 64, 40_000));
        assert_eq!(c.executor.child_uid, 65534);
        assert!(c.tools["bare"].is_none());
    }

    #[test]
    fn unknown_keys_name_their_path() {
        let e = parse("[executor]\nlisten = \"127.0.0.1:1\"\nlisen = 2\n").unwrap_err();
        assert_eq!(e.to_string(), "/etc/loom/egress.toml: unknown key `executor.lisen`");
        let e = parse("[tools.t.process]\ncommand = [\"x\"]\ntimeout = 3\n").unwrap_err();
        assert!(e.to_string().contains("`tools.t.process.timeout`"), "{e}");
        let e = parse("[tools.t.process]\ncommand = [\"x\"]\npool = { warm = 1, maximum = 3 }\n").unwrap_err();
        assert!(e.to_string().contains("`tools.t.process.pool.maximum`"), "{e}");
    }

    #[test]
    fn invalid_values_are_errors() {
        for (body, path) in [
            ("command = []", "command"),
            ("command = [\"x\"]\npool = { warm = 9, max = 2 }", "pool.warm"),
            ("command = [\"x\"]\nisolation = \"tight\"", "isolation"),
            ("command = [\"x\"]\nprotocol = \"grpc\"", "protocol"),
            ("command = [\"x\"]\nenv = { PATH = \"/bin\" }", "env.PATH"),
            ("command = [\"x\"]\ntimeout_ms = 0", "timeout_ms"),
            ("cwd = \"/\"", "command"),
        ] {
            let e = parse(&format!("[tools.t.process]\n{body}\n")).unwrap_err();
            assert!(e.to_string().contains(&format!("tools.t.process.{path}")), "{e}");
        }
        let e = parse("[proxy]\ncontrol = \"localhost:3129\"\n").unwrap_err();
        assert!(e.to_string().contains("proxy.control"), "{e}");
    }

    #[test]
    fn isolation_levels_and_limits_parse() {
        for (v, want) in [
            ("strict", Isolation::Strict),
            ("best_effort", Isolation::BestEffort),
            ("off", Isolation::Off),
        ] {
            let c = parse(&format!("[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{v}\"\n")).unwrap();
            assert_eq!(c.tools["t"].as_ref().unwrap().isolation, want);
        }
        let c = parse(
            "[tools.t.process]\ncommand = [\"x\"]\nread_paths = [\"data\", \"/srv/x\"]\nmemory_mb = 64\nmax_pids = 9\ncpu_ms = 1500\n",
        )
        .unwrap();
        let p = c.tools["t"].as_ref().unwrap();
        assert_eq!(p.read_paths, [PathBuf::from("/etc/loom/data"), PathBuf::from("/srv/x")]);
        assert_eq!((p.memory_mb, p.max_pids, p.cpu_ms), (64, 9, 1500));
        for body in ["max_pids = 0", "memory_mb = 1", "cpu_ms = 0"] {
            let e = parse(&format!("[tools.t.process]\ncommand = [\"x\"]\n{body}\n")).unwrap_err();
            assert!(e.to_string().contains(body.split(' ').next().unwrap()), "{e}");
        }
        let e = parse("[executor]\nchild_uid = 0\n").unwrap_err();
        assert!(e.to_string().contains("executor.child_uid"), "{e}");
    }
}
