//! The executor's part of the file: `[executor]` (how the executor serves
//! and confines) and `[tools.<id>.process]` (how one tool's children start,
//! pool and are limited), typed with their defaults, and their validation.

use crate::reader::Section;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// `PATH` of a child when its tool sets no `path`.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// `LANG` of a child when its tool sets no `lang`.
pub const DEFAULT_LANG: &str = "C.UTF-8";
/// The unprivileged uid and gid of confined children (`nobody`).
pub const DEFAULT_CHILD_ID: u32 = 65534;

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
    "LOOM_SOCKS_PROXY",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "AWS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "LOOM_IPC_FDS",
    "TMPDIR",
    "PATH",
    "LANG",
];

/// `[executor]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorConfig {
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
    /// `cgroup_root` (or `cgroup`): a delegated cgroup v2 directory for
    /// per-child cgroups; unset: the executor's own cgroup when it is
    /// delegated (cgroup v2), else the v1 memory and pids hierarchies.
    pub cgroup: Option<PathBuf>,
    /// The proxy's listener hand-off socket as the executor sees it, when
    /// that differs from `[proxy] handoff` (another mount path); unset: the
    /// proxy's own (see [`crate::Config::binding`]).
    pub proxy_handoff: Option<PathBuf>,
    /// Relay confined children's connections through the executor instead
    /// of handing their listeners to the proxy (the proxy on another host):
    /// the proxy then cannot bind a connection to its run.
    pub allow_relay: bool,
    /// The owner name `serve` creates runs under on the proxy (one per
    /// executor: a restarted instance ends what its predecessor left).
    pub name: String,
    /// The owner lease `serve` holds and renews every third of it: after a
    /// crash, the proxy ends the executor's runs within this (milliseconds).
    pub lease_ms: u64,
    /// MiB of finished invocations' answers kept for `GET /v1/invocations`
    /// and repeated idempotency keys; one answer keeps its body only up to a
    /// quarter of it.
    pub journal_max_mb: u64,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 3130)),
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
            allow_relay: false,
            name: "egress-executor".into(),
            lease_ms: 15_000,
            journal_max_mb: 64,
        }
    }
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

/// `network` of a tool: how its confined children reach the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Network {
    /// Only through the proxy variables (the in-namespace proxy listener);
    /// every other connect fails.
    #[default]
    Proxy,
    /// Also transparently: inside the child's network namespace every TCP
    /// connect to an outside address is redirected to the proxy with its
    /// destination, and every DNS query is answered by the proxy (listed
    /// names only). Needs the network namespace and the hand-off binding.
    Transparent,
}

impl Network {
    pub fn as_str(self) -> &'static str {
        match self {
            Network::Proxy => "proxy",
            Network::Transparent => "transparent",
        }
    }
}

/// `protocol` of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Loom,
    Plain,
    /// An MCP server speaking JSON-RPC on stdin and stdout, one message a
    /// line (the MCP stdio transport); only with `lifecycle = "session"`.
    McpStdio,
}

/// How long one child serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// One child, one `invoke` (the default).
    Invocation,
    /// One child, one session of many requests (an MCP server behind
    /// `/v1/mcp/<tool>`), until the client ends it, it idles for
    /// `session_idle_ms`, it reaches `session_max_ms`, the child exits or
    /// the executor stops.
    Session,
}

/// The bounds of a session tool's sessions (`lifecycle = "session"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// A session with no request for this long is closed.
    pub idle_ms: u64,
    /// A session is closed this long after it opened, whatever it does.
    pub max_ms: u64,
    /// Sessions open at once; one more is refused (`503`).
    pub max_sessions: usize,
    /// The largest message (one line) the server may send.
    pub max_message_bytes: usize,
    /// Bytes the server may send over one session, all messages together.
    pub max_session_bytes: u64,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            idle_ms: 300_000,
            max_ms: 3_600_000,
            max_sessions: 16,
            max_message_bytes: 4 << 20,
            max_session_bytes: 256 << 20,
        }
    }
}

/// `[tools.<id>.process]`, validated. Times are in milliseconds, as the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessConfig {
    pub command: Vec<String>,
    /// Working directory; `.` (the default) is the config file's directory.
    pub cwd: PathBuf,
    /// Extra environment: literal values (never passed through from the
    /// executor's own environment).
    pub env: BTreeMap<String, String>,
    pub path: String,
    pub lang: String,
    pub cold_start_ms: u64,
    pub timeout_ms: u64,
    /// `[pool]`: children kept started, at most alive, invocations waiting.
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
    /// cgroup CPU bandwidth of a confined child's whole tree, in percent of
    /// one CPU (`cpu.max`; v1: `cpu.cfs_quota_us`); unset: not limited.
    pub cpu_percent: Option<u64>,
    /// `[tools.<id>] network`: how the tool's children reach the network.
    pub network: Network,
    /// Start children by forking a booted reference Python runner
    /// (`loom_runner.py --fork-server`) instead of a fresh interpreter.
    pub fork_server: bool,
    /// One invocation per child, or one session.
    pub lifecycle: Lifecycle,
    /// The bounds of its sessions (read only with `lifecycle = "session"`).
    pub session: SessionLimits,
    /// `expect_sha256`: files the tool's children run, pinned to their
    /// SHA-256 (path as written, absolute or relative to `cwd` → 64
    /// lowercase hex digits). A child whose program or script hashes to
    /// anything else, or a pinned path its command does not run, is not
    /// started.
    pub expect_sha256: BTreeMap<PathBuf, String>,
}

/// The file name of the reference Python runner, the one runner with a fork
/// server.
pub const PYTHON_RUNNER: &str = "loom_runner.py";

/// Largest `cpu_percent`: 1000 CPUs.
pub const MAX_CPU_PERCENT: u64 = 100_000;

impl ProcessConfig {
    /// A process section that sets only `command`: every other key at its
    /// default.
    pub fn new(command: Vec<String>) -> Self {
        let (cold_start_ms, timeout_ms) = (10_000, 30_000);
        ProcessConfig {
            command,
            cwd: PathBuf::from("."),
            env: BTreeMap::new(),
            path: DEFAULT_PATH.into(),
            lang: DEFAULT_LANG.into(),
            cold_start_ms,
            timeout_ms,
            warm: 1,
            max: 8,
            queue: 64,
            isolation: Isolation::Strict,
            protocol: Protocol::Loom,
            read_paths: vec![],
            memory_mb: 512,
            max_pids: 64,
            cpu_ms: cold_start_ms + timeout_ms,
            cpu_percent: None,
            network: Network::Proxy,
            fork_server: false,
            lifecycle: Lifecycle::Invocation,
            session: SessionLimits::default(),
            expect_sha256: BTreeMap::new(),
        }
    }

    /// The fork server's command when `fork_server` is set: the tool's
    /// command with its target (the last argument) replaced by
    /// `--fork-server`.
    pub fn fork_server_command(&self) -> Option<Vec<String>> {
        if !self.fork_server {
            return None;
        }
        let (_, head) = self.command.split_last()?;
        let mut cmd = head.to_vec();
        cmd.push("--fork-server".into());
        Some(cmd)
    }
}

impl ProcessConfig {
    /// The settings of an ad-hoc command (`egress-executor run -- CMD`) in
    /// `cwd` under a tool's process section `base`: plain protocol, no pool,
    /// no fork server, and everything else (the network, environment,
    /// clocks, isolation, limits) from `base`, or, without one, what a
    /// process section that sets only `command` gets (strict isolation
    /// included). [`ProcessConfig::not_ad_hoc`] names what is left out.
    pub fn ad_hoc(base: Option<&ProcessConfig>, command: Vec<String>, cwd: PathBuf) -> Self {
        let base = base.cloned().unwrap_or_else(|| ProcessConfig::new(Vec::new()));
        ProcessConfig {
            command,
            cwd,
            warm: 0,
            max: 1,
            queue: 0,
            protocol: Protocol::Plain,
            fork_server: false,
            expect_sha256: BTreeMap::new(),
            ..base
        }
    }

    /// The settings of this section an ad-hoc command cannot have, as the
    /// file spells them: a fork server boots the tool's runtime for
    /// children of the tool's own command, not for another command, and
    /// `expect_sha256` pins the files of the tool's own command. (The
    /// pool and the protocol belong to the tool's runner, which an ad-hoc
    /// command replaces, so they are not named.)
    pub fn not_ad_hoc(&self) -> Vec<&'static str> {
        let mut left_out = Vec::new();
        if self.fork_server {
            left_out.push("fork_server = true");
        }
        if !self.expect_sha256.is_empty() {
            left_out.push("expect_sha256");
        }
        left_out
    }
}

/// Reads `[executor]`.
pub(crate) fn executor(s: &mut Section) -> ExecutorConfig {
    let d = ExecutorConfig::default();
    let cfg = ExecutorConfig {
        listen: s.addr("listen", d.listen),
        scratch_dir: s.or("scratch_dir", d.scratch_dir),
        pid_namespace: s.or("pid_namespace", d.pid_namespace),
        stdout_cap_bytes: s.or("stdout_cap_bytes", d.stdout_cap_bytes),
        stderr_cap_bytes: s.or("stderr_cap_bytes", d.stderr_cap_bytes),
        max_message_bytes: s.count("max_message_bytes", 64..=u64::MAX, d.max_message_bytes),
        max_run_bytes: s.count("max_run_bytes", 64..=u64::MAX, d.max_run_bytes),
        child_uid: s.or("child_uid", d.child_uid),
        child_gid: s.or("child_gid", d.child_gid),
        child_uid_count: s.or("child_uid_count", d.child_uid_count),
        // `cgroup_root`, or its older name `cgroup`.
        cgroup: {
            let root: Option<PathBuf> = s.get("cgroup_root");
            let old: Option<PathBuf> = s.get("cgroup");
            root.or(old)
        },
        proxy_handoff: s.get("proxy_handoff"),
        allow_relay: s.or("allow_relay", d.allow_relay),
        name: s.or("name", d.name),
        lease_ms: s.int("lease_ms", 1_000..=600_000, d.lease_ms),
        journal_max_mb: s.int("journal_max_mb", 1..=1 << 20, d.journal_max_mb),
    };
    let name_ok = !cfg.name.is_empty()
        && cfg.name.len() <= 128
        && cfg
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'));
    if !name_ok {
        let at = s.at("name");
        s.problems.push(at, "must be 1-128 characters of A-Z a-z 0-9 - _ . ~");
    }
    for (key, v) in [("child_uid", cfg.child_uid), ("child_gid", cfg.child_gid)] {
        if v == 0 {
            let at = s.at(key);
            s.problems.push(at, "must not be 0 (root)");
        }
    }
    if cfg.allow_relay && cfg.proxy_handoff.is_some() {
        let at = s.at("allow_relay");
        s.problems.push(
            at,
            "cannot be true while executor.proxy_handoff names a hand-off socket: choose one",
        );
    }
    if cfg.child_uid_count == 0 {
        let at = s.at("child_uid_count");
        s.problems.push(at, "must be at least 1");
    }
    cfg
}

/// Reads `[tools.<id>.process]`; `None` when `command` is unusable.
pub(crate) fn process(s: &mut Section) -> Option<ProcessConfig> {
    let command: Option<Vec<String>> = s.required("command", "an array: program and arguments");
    let d = ProcessConfig::new(vec![]);
    let cold_start_ms = s.int("cold_start_ms", 1..=u64::MAX, d.cold_start_ms);
    let timeout_ms = s.int("timeout_ms", 1..=u64::MAX, d.timeout_ms);
    let mut env = BTreeMap::new();
    let mut env_section = s.table("env");
    for (k, v) in env_section.entries() {
        let at = env_section.at(&k);
        let Some(v) = env_section.problems.typed::<String>(&at, v) else {
            continue;
        };
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            env_section.problems.push(at, "is not a valid variable");
        } else if RESERVED_ENV.contains(&k.as_str()) {
            env_section.problems.push(
                at,
                "is set by the executor and cannot be configured here (use `path`/`lang` for PATH/LANG)",
            );
        } else {
            env.insert(k, v);
        }
    }
    env_section.finish();
    let mut pool = s.table("pool");
    let warm = pool.or("warm", d.warm);
    let max = pool.count("max", 1..=u64::MAX, d.max);
    let queue = pool.or("queue", d.queue);
    if warm > max {
        let at = pool.at("warm");
        pool.problems.push(at, format!("is {warm}, more than pool.max = {max}"));
    }
    pool.finish();
    let expect_sha256 = pins(s);
    let session_keys: Vec<&str> = SESSION_KEYS.into_iter().filter(|k| s.has(k)).collect();
    let p = ProcessConfig {
        command: vec![],
        cwd: s.or("cwd", d.cwd),
        env,
        path: s.or("path", d.path),
        lang: s.or("lang", d.lang),
        cold_start_ms,
        timeout_ms,
        warm,
        max,
        queue,
        isolation: s.choice(
            "isolation",
            &[
                ("strict", Isolation::Strict),
                ("best_effort", Isolation::BestEffort),
                ("off", Isolation::Off),
            ],
            d.isolation,
        ),
        protocol: s.choice(
            "protocol",
            &[
                ("loom", Protocol::Loom),
                ("plain", Protocol::Plain),
                ("mcp-stdio", Protocol::McpStdio),
            ],
            d.protocol,
        ),
        read_paths: s
            .list("read_paths")
            .unwrap_or_default()
            .into_iter()
            .map(|(_, p)| p)
            .collect(),
        memory_mb: s.int("memory_mb", 8..=u64::MAX, d.memory_mb),
        max_pids: s.int("max_pids", 1..=u64::MAX, d.max_pids),
        cpu_ms: s.int("cpu_ms", 1..=u64::MAX, cold_start_ms.saturating_add(timeout_ms)),
        cpu_percent: s.get::<u64>("cpu_percent").map(|v| {
            if !(1..=MAX_CPU_PERCENT).contains(&v) {
                let at = s.at("cpu_percent");
                s.problems
                    .push(at, format!("{v} is out of range 1..={MAX_CPU_PERCENT}"));
            }
            v.clamp(1, MAX_CPU_PERCENT)
        }),
        network: Network::Proxy,
        fork_server: s.or("fork_server", d.fork_server),
        lifecycle: s.choice(
            "lifecycle",
            &[("invocation", Lifecycle::Invocation), ("session", Lifecycle::Session)],
            d.lifecycle,
        ),
        session: SessionLimits {
            idle_ms: s.int("session_idle_ms", 1..=u64::MAX, d.session.idle_ms),
            max_ms: s.int("session_max_ms", 1..=u64::MAX, d.session.max_ms),
            max_sessions: s.count("max_sessions", 1..=65_536, d.session.max_sessions),
            max_message_bytes: s.count("max_message_bytes", 1024..=1 << 30, d.session.max_message_bytes),
            max_session_bytes: s.int("max_session_bytes", 1024..=u64::MAX, d.session.max_session_bytes),
        },
        expect_sha256,
    };
    sessions(&p, &session_keys, s);
    let command = command?;
    let at = s.at("command");
    if command.first().is_none_or(|c| c.is_empty()) {
        s.problems.push(at, "must name a program");
        return None;
    }
    if command.iter().any(|a| a.contains('\0')) {
        s.problems.push(at, "must not contain NUL bytes");
        return None;
    }
    if p.fork_server {
        let runner = command.len().checked_sub(2).map(|i| Path::new(&command[i]));
        let at = s.at("fork_server");
        if p.protocol != Protocol::Loom {
            s.problems.push(
                at,
                "needs protocol = \"loom\" (the fork server is the reference runner's)",
            );
        } else if runner.is_none_or(|r| r.file_name().is_none_or(|n| n != PYTHON_RUNNER)) {
            s.problems.push(
                at,
                format!(
                    "needs a command that runs the reference runner: [\"python3\", \".../{PYTHON_RUNNER}\", \"tool.py\"]"
                ),
            );
        }
    }
    Some(ProcessConfig { command, ..p })
}

/// Reads `expect_sha256`: each key a path (absolute, or relative to the
/// tool's `cwd`), each value a SHA-256 as `sha256sum` prints it.
fn pins(s: &mut Section) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut t = s.table("expect_sha256");
    for (k, v) in t.entries() {
        let at = t.at(&k);
        let Some(v) = t.problems.typed::<String>(&at, v) else {
            continue;
        };
        if let Err(why) = pin(&k, &v) {
            t.problems.push(at, why);
        } else {
            out.insert(PathBuf::from(k), v);
        }
    }
    t.finish();
    out
}

/// Why `path = digest` is not a valid pin.
fn pin(path: &str, digest: &str) -> Result<(), String> {
    if path.is_empty() || path.contains('\0') {
        return Err("is not a path (absolute, or relative to the tool's cwd)".into());
    }
    if path.starts_with('~') {
        return Err("is not expanded: write the absolute path (or one relative to the tool's cwd)".into());
    }
    if digest.len() != 64 || !digest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!(
            "{digest:?} is not a SHA-256: 64 lowercase hex digits, as `sha256sum` prints them"
        ));
    }
    Ok(())
}

/// The keys of `[tools.<id>.process]` that only a session tool reads.
const SESSION_KEYS: [&str; 5] = [
    "session_idle_ms",
    "session_max_ms",
    "max_sessions",
    "max_message_bytes",
    "max_session_bytes",
];

/// What `lifecycle = "session"` and `protocol = "mcp-stdio"` need of each
/// other and of the rest of the section: one goes with the other (a session
/// is an MCP conversation, an MCP server serves a session), and a session
/// child is started fresh (no fork server). The session keys are refused
/// on an invocation tool, where nothing would read them.
fn sessions(p: &ProcessConfig, session_keys: &[&str], s: &mut Section) {
    let session = p.lifecycle == Lifecycle::Session;
    let mcp = p.protocol == Protocol::McpStdio;
    if session && !mcp {
        let at = s.at("lifecycle");
        s.problems.push(
            at,
            "\"session\" needs protocol = \"mcp-stdio\" (a session is an MCP conversation)",
        );
    }
    if mcp && !session {
        let at = s.at("protocol");
        s.problems.push(
            at,
            "\"mcp-stdio\" needs lifecycle = \"session\" (an MCP server serves one session)",
        );
    }
    if session && p.fork_server {
        let at = s.at("fork_server");
        s.problems
            .push(at, "a session child is started fresh: leave fork_server out");
    }
    if !session {
        for key in session_keys {
            let at = s.at(key);
            s.problems.push(at, "applies only to lifecycle = \"session\"");
        }
    }
    if p.session.idle_ms > p.session.max_ms && session {
        let at = s.at("session_idle_ms");
        s.problems.push(
            at,
            format!(
                "is {}, more than session_max_ms = {}",
                p.session.idle_ms, p.session.max_ms
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, Isolation, Network, ProcessConfig, Protocol};
    use std::path::{Path, PathBuf};

    fn errors(text: &str) -> String {
        Config::parse(text, "egress.toml").unwrap_err().to_string()
    }

    #[test]
    fn unknown_keys_name_their_path() {
        let e = errors("[executor]\nlisten = \"127.0.0.1:1\"\nlisen = 2\n");
        assert!(
            e.starts_with("egress.toml: executor.lisen: unknown key (expected one of: "),
            "{e}"
        );
        let e = errors("[tools.t.process]\ncommand = [\"x\"]\ntimeout = 3\n");
        assert!(e.contains("tools.t.process.timeout: unknown key"), "{e}");
        let e = errors("[tools.t.process]\ncommand = [\"x\"]\npool = { warm = 1, maximum = 3 }\n");
        assert!(e.contains("tools.t.process.pool.maximum: unknown key"), "{e}");
    }

    const MCP: &str = "command = [\"x\"]\nlifecycle = \"session\"\nprotocol = \"mcp-stdio\"\n";

    /// A session tool: an MCP server, its sessions bounded by default.
    #[test]
    fn a_session_tool_is_an_mcp_server_with_bounded_sessions() {
        let text = format!("[tools.t.process]\n{MCP}max_sessions = 3\n");
        let c = Config::parse(&text, "egress.toml").unwrap();
        let p = c.policy.tools["t"].process.clone().unwrap();
        assert_eq!(
            (p.lifecycle, p.protocol),
            (crate::Lifecycle::Session, Protocol::McpStdio)
        );
        assert_eq!(p.session.max_sessions, 3);
        assert_eq!(p.session.idle_ms, 300_000);
        assert_eq!(p.session.max_ms, 3_600_000);
    }

    /// Each bad value is one problem, at its key path.
    #[test]
    fn invalid_values_are_errors() {
        const P: &str = "tools.t.process";
        for (section, body, key) in [
            (P, "command = []", "command"),
            (P, "command = [\"x\"]\npool = { warm = 9, max = 2 }", "pool.warm"),
            (P, "command = [\"x\"]\npool = { max = 0 }", "pool.max"),
            (P, "command = [\"x\"]\nisolation = \"tight\"", "isolation"),
            (P, "command = [\"x\"]\nprotocol = \"grpc\"", "protocol"),
            (P, "command = [\"x\"]\nenv = { PATH = \"/bin\" }", "env.PATH"),
            (P, "command = [\"x\"]\nenv = { \"A=B\" = \"1\" }", "env.A=B"),
            (P, "command = [\"x\"]\ntimeout_ms = 0", "timeout_ms"),
            (P, "command = [\"x\"]\ncold_start_ms = 0", "cold_start_ms"),
            (P, "command = [\"x\"]\nmax_pids = 0", "max_pids"),
            (P, "command = [\"x\"]\nmemory_mb = 1", "memory_mb"),
            (P, "command = [\"x\"]\ncpu_ms = 0", "cpu_ms"),
            (P, "command = [\"x\"]\nlifecycle = \"session\"", "lifecycle"),
            (P, "command = [\"x\"]\nlifecycle = \"forever\"", "lifecycle"),
            (P, "command = [\"x\"]\nprotocol = \"mcp-stdio\"", "protocol"),
            (P, "command = [\"x\"]\nmax_sessions = 4", "max_sessions"),
            (P, "command = [\"x\"]\nsession_idle_ms = 4", "session_idle_ms"),
            (P, &format!("{MCP}max_sessions = 0"), "max_sessions"),
            (
                P,
                &format!("{MCP}session_idle_ms = 9\nsession_max_ms = 8"),
                "session_idle_ms",
            ),
            (P, &format!("{MCP}max_message_bytes = 10"), "max_message_bytes"),
            (P, "command = [\"x\"]\ncpu_percent = 0", "cpu_percent"),
            (P, "command = [\"x\"]\ncpu_percent = 100001", "cpu_percent"),
            (P, "command = \"x\"", "command"),
            (
                P,
                "command = [\"x\"]\nexpect_sha256 = { \"t.py\" = \"ABCD\" }",
                "expect_sha256.t.py",
            ),
            (
                P,
                &format!(
                    "command = [\"x\"]\nexpect_sha256 = {{ \"/t.py\" = \"{}\" }}",
                    "A".repeat(64)
                ),
                "expect_sha256./t.py",
            ),
            (
                P,
                &format!(
                    "command = [\"x\"]\nexpect_sha256 = {{ \"~/t.py\" = \"{}\" }}",
                    "a".repeat(64)
                ),
                "expect_sha256.~/t.py",
            ),
            (
                P,
                "command = [\"x\"]\nexpect_sha256 = { \"t.py\" = 1 }",
                "expect_sha256.t.py",
            ),
            (P, "command = [\"x\"]\nexpect_sha256 = [\"t.py\"]", "expect_sha256"),
            (P, "cwd = \"/\"", "command"),
            ("executor", "child_uid = 0", "child_uid"),
            ("executor", "child_gid = 0", "child_gid"),
            ("executor", "child_uid_count = 0", "child_uid_count"),
            ("executor", "lease_ms = 10", "lease_ms"),
            ("executor", "journal_max_mb = 0", "journal_max_mb"),
            ("executor", "journal_max_mb = \"64\"", "journal_max_mb"),
            ("executor", "name = \"a b\"", "name"),
            ("executor", "max_message_bytes = 8", "max_message_bytes"),
            ("executor", "listen = \"localhost:1\"", "listen"),
            ("executor", "pid_namespace = \"yes\"", "pid_namespace"),
            ("executor", "allow_relay = 1", "allow_relay"),
        ] {
            let e = errors(&format!("[{section}]\n{body}\n"));
            assert!(e.starts_with(&format!("egress.toml: {section}.{key}: ")), "{body}: {e}");
            assert_eq!(e.lines().count(), 1, "{body}: {e}");
        }
    }

    /// `network = "transparent"` needs a process section, a network
    /// namespace (not `isolation = "off"`) and the hand-off binding; the
    /// default is `"proxy"`.
    #[test]
    fn transparent_network_needs_a_namespace_and_the_handoff() {
        let net = |text: &str| {
            Config::parse(text, "egress.toml").unwrap().policy.tools["t"]
                .process
                .as_ref()
                .unwrap()
                .network
        };
        assert_eq!(net("[tools.t.process]\ncommand = [\"x\"]\n"), crate::Network::Proxy);
        for iso in ["strict", "best_effort"] {
            let text = format!(
                "[tools.t]\nnetwork = \"transparent\"\n[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{iso}\"\n"
            );
            assert_eq!(net(&text), crate::Network::Transparent, "{iso}");
        }
        for (text, want) in [
            (
                "[tools.t]\nnetwork = \"transparent\"\n[tools.t.process]\ncommand = [\"x\"]\nisolation = \"off\"\n",
                "egress.toml: tools.t.network: \"transparent\" needs the tool's children in a network namespace",
            ),
            (
                "[tools.t]\nnetwork = \"transparent\"\n",
                "egress.toml: tools.t.network: \"transparent\" is how the executor confines",
            ),
            (
                "[executor]\nallow_relay = true\n[tools.t]\nnetwork = \"transparent\"\n[tools.t.process]\ncommand = [\"x\"]\n",
                "egress.toml: tools.t.network: \"transparent\" needs the listener hand-off",
            ),
            (
                "[tools.t]\nnetwork = \"direct\"\n[tools.t.process]\ncommand = [\"x\"]\n",
                "egress.toml: tools.t.network: \"direct\" is not one of \"proxy\", \"transparent\"",
            ),
        ] {
            let e = errors(text);
            assert!(e.starts_with(want), "{text}: {e}");
            assert_eq!(e.lines().count(), 1, "{text}: {e}");
        }
        // The relay is fine for tools that only use the proxy variables.
        let relay = "[executor]\nallow_relay = true\n[tools.t.process]\ncommand = [\"x\"]\n";
        assert_eq!(net(relay), crate::Network::Proxy);
    }

    /// An ad-hoc command takes its tool's section whole but for the command,
    /// the directory, the pool, the protocol and the fork server; its
    /// network is the tool's.
    #[test]
    fn an_ad_hoc_command_inherits_its_tools_settings() {
        let c = Config::parse(
            "[tools.t]\nnetwork = \"transparent\"\n[tools.t.process]\ncommand = [\"x\"]\nisolation = \"best_effort\"\n\
             memory_mb = 64\nmax_pids = 9\ncpu_ms = 1500\ncpu_percent = 50\nenv = { A = \"b\" }\n\
             pool = { warm = 2, max = 4 }\n",
            "f",
        )
        .unwrap();
        let base = c.policy.tools["t"].process.clone().unwrap();
        let p = ProcessConfig::ad_hoc(Some(&base), vec!["sh".into()], PathBuf::from("/w"));
        let want = ProcessConfig {
            command: vec!["sh".into()],
            cwd: PathBuf::from("/w"),
            warm: 0,
            max: 1,
            queue: 0,
            protocol: Protocol::Plain,
            fork_server: false,
            ..base.clone()
        };
        assert_eq!(p, want);
        assert_eq!(p.network, Network::Transparent);
        assert!(base.not_ad_hoc().is_empty());
        let forked = ProcessConfig {
            fork_server: true,
            ..base
        };
        assert_eq!(forked.not_ad_hoc(), ["fork_server = true"]);
        assert_eq!(
            (p.isolation, p.cpu_percent, p.env["A"].as_str()),
            (Isolation::BestEffort, Some(50), "b")
        );
        let bare = ProcessConfig::ad_hoc(None, vec!["sh".into()], PathBuf::from("/w"));
        assert_eq!(
            (bare.isolation, bare.memory_mb, bare.cpu_percent),
            (Isolation::Strict, 512, None)
        );
    }

    #[test]
    fn isolation_levels_and_limits_parse() {
        for (v, want) in [
            ("strict", Isolation::Strict),
            ("best_effort", Isolation::BestEffort),
            ("off", Isolation::Off),
        ] {
            let c = Config::parse(
                &format!("[tools.t.process]\ncommand = [\"x\"]\nisolation = \"{v}\"\n"),
                "f",
            )
            .unwrap();
            assert_eq!(c.policy.tools["t"].process.as_ref().unwrap().isolation, want);
        }
        let c = Config::parse_relative_to(
            "[tools.t.process]\ncommand = [\"x\"]\nprotocol = \"plain\"\nread_paths = [\"data\", \"/srv/x\"]\nmemory_mb = 64\nmax_pids = 9\ncpu_ms = 1500\ncpu_percent = 50\npool = { warm = 0, max = 2, queue = 0 }\n",
            "f",
            Path::new("/etc/loom"),
        )
        .unwrap();
        let p = c.policy.tools["t"].process.clone().unwrap();
        assert_eq!(p.read_paths, [PathBuf::from("/etc/loom/data"), PathBuf::from("/srv/x")]);
        assert_eq!(p.cwd, Path::new("/etc/loom"));
        assert_eq!(
            (p.memory_mb, p.max_pids, p.cpu_ms, p.cpu_percent),
            (64, 9, 1500, Some(50))
        );
        assert_eq!((p.warm, p.max, p.queue, p.protocol), (0, 2, 0, Protocol::Plain));
    }

    #[test]
    fn a_fork_server_needs_the_reference_python_runner() {
        let c = Config::parse(
            "[tools.t.process]\ncommand = [\"python3\", \"-S\", \"r/loom_runner.py\", \"t.py\"]\nfork_server = true\n",
            "f",
        )
        .unwrap();
        let p = c.policy.tools["t"].process.clone().unwrap();
        assert_eq!(
            p.fork_server_command().unwrap(),
            ["python3", "-S", "r/loom_runner.py", "--fork-server"]
        );
        let off = Config::parse(
            "[tools.t.process]\ncommand = [\"python3\", \"r/loom_runner.py\", \"t.py\"]\n",
            "f",
        );
        assert_eq!(
            off.unwrap().policy.tools["t"]
                .process
                .clone()
                .unwrap()
                .fork_server_command(),
            None
        );
        for (text, want) in [
            (
                "command = [\"python3\", \"t.py\"]\nfork_server = true",
                "f: tools.t.process.fork_server: needs a command that runs the reference runner",
            ),
            (
                "command = [\"node\", \"loom_runner.js\", \"t.mjs\"]\nfork_server = true",
                "f: tools.t.process.fork_server: needs a command that runs the reference runner",
            ),
            (
                "command = [\"python3\", \"loom_runner.py\", \"t.py\"]\nprotocol = \"plain\"\nfork_server = true",
                "f: tools.t.process.fork_server: needs protocol = \"loom\"",
            ),
        ] {
            let e = Config::parse(&format!("[tools.t.process]\n{text}\n"), "f")
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(want), "{text}: {e}");
        }
    }

    /// `expect_sha256` pins paths as written (absolute, or relative to the
    /// tool's `cwd`, resolved when a child starts) to `sha256sum`'s digits;
    /// an ad-hoc command, which runs something else, does not take them.
    #[test]
    fn pins_are_paths_to_lowercase_sha256() {
        let (a, b) = ("0123456789abcdef".repeat(4), "f".repeat(64));
        let c = Config::parse(
            &format!(
                "[tools.t.process]\ncommand = [\"python3\", \"t.py\"]\n\
                 expect_sha256 = {{ \"/usr/bin/python3\" = \"{a}\", \"t.py\" = \"{b}\" }}\n"
            ),
            "f",
        )
        .unwrap();
        let p = c.policy.tools["t"].process.clone().unwrap();
        assert_eq!(
            p.expect_sha256.into_iter().collect::<Vec<_>>(),
            [
                (PathBuf::from("/usr/bin/python3"), a.clone()),
                (PathBuf::from("t.py"), b)
            ]
        );
        let table = Config::parse(
            &format!("[tools.t.process]\ncommand = [\"x\"]\n[tools.t.process.expect_sha256]\n\"/x\" = \"{a}\"\n"),
            "f",
        )
        .unwrap();
        let p = table.policy.tools["t"].process.clone().unwrap();
        assert_eq!(p.expect_sha256.len(), 1);
        assert_eq!(p.not_ad_hoc(), ["expect_sha256"]);
        let ad_hoc = ProcessConfig::ad_hoc(Some(&p), vec!["sh".into()], PathBuf::from("/w"));
        assert!(ad_hoc.expect_sha256.is_empty());
        let e = errors("[tools.t.process]\ncommand = [\"x\"]\nexpect_sha256 = { \"t.py\" = \"abc\" }\n");
        assert_eq!(
            e,
            "egress.toml: tools.t.process.expect_sha256.t.py: \"abc\" is not a SHA-256: 64 lowercase hex digits, as `sha256sum` prints them"
        );
    }

    #[test]
    fn cpu_defaults_to_cold_start_plus_timeout() {
        let c = Config::parse(
            "[tools.t.process]\ncommand = [\"x\"]\ncold_start_ms = 1000\ntimeout_ms = 2000\n",
            "f",
        )
        .unwrap();
        assert_eq!(c.policy.tools["t"].process.as_ref().unwrap().cpu_ms, 3000);
    }
}
