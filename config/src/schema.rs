//! The file format: serde structs that mirror the TOML (unknown keys are
//! errors), and the validation pass that turns them into [`Config`], naming
//! every problem by its key path.

use crate::allowlist::{Allowlist, Rule};
use crate::ranges::RangeTable;
use crate::{Config, ConfigError, DnsConfig, Mode, Policy, Problem, ProxyConfig, TlsConfig, ToolPolicy};
use ipnet::IpNet;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    proxy: RawProxy,
    #[serde(default)]
    tools: BTreeMap<String, RawTool>,
    #[serde(default)]
    executor: Option<toml::Table>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawProxy {
    listen: String,
    control: String,
    facts: PathBuf,
    allow_ranges: Vec<String>,
    deny_ranges: Vec<String>,
    max_run_ms: u64,
    max_runs: u64,
    header_read_timeout_ms: u64,
    max_header_bytes: u64,
    tunnel_idle_timeout_ms: u64,
    max_connections: u64,
    max_pending_connections: u64,
    pending_head_timeout_ms: u64,
    max_connections_per_run: u64,
    max_control_connections: u64,
    max_event_streams: u64,
    facts_max_mb: u64,
    facts_retention_hours: u64,
    drain_timeout_ms: u64,
    dns: RawDns,
    tls: Option<RawTls>,
    handoff: Option<PathBuf>,
}

impl Default for RawProxy {
    fn default() -> Self {
        RawProxy {
            listen: "127.0.0.1:3128".into(),
            control: "127.0.0.1:3129".into(),
            facts: PathBuf::from("var/egress-facts.db"),
            allow_ranges: vec![],
            deny_ranges: vec![],
            max_run_ms: 3_600_000,
            max_runs: 10_000,
            header_read_timeout_ms: 10_000,
            max_header_bytes: 32 * 1024,
            tunnel_idle_timeout_ms: 120_000,
            max_connections: 4096,
            max_pending_connections: 256,
            pending_head_timeout_ms: 3_000,
            max_connections_per_run: 64,
            max_control_connections: 256,
            max_event_streams: 32,
            facts_max_mb: 1024,
            facts_retention_hours: 720,
            drain_timeout_ms: 10_000,
            dns: RawDns::default(),
            tls: None,
            handoff: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawDns {
    servers: Vec<String>,
    timeout_ms: u64,
}

impl Default for RawDns {
    fn default() -> Self {
        RawDns {
            servers: vec![],
            timeout_ms: 2000,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert: PathBuf,
    key: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    #[serde(default)]
    egress: Vec<RawRule>,
    #[serde(default = "default_fetch_timeout")]
    fetch_timeout_ms: u64,
    #[serde(default = "default_max_concurrent")]
    max_concurrent_fetches: u64,
    #[serde(default = "default_max_queued")]
    max_queued_fetches: u64,
    #[serde(default)]
    mode: RawMode,
    #[serde(default)]
    methods: Option<Vec<String>>,
    #[serde(default)]
    process: Option<toml::Table>,
}

fn default_fetch_timeout() -> u64 {
    30_000
}
fn default_max_concurrent() -> u64 {
    8
}
fn default_max_queued() -> u64 {
    64
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawMode {
    #[default]
    Enforce,
    Report,
}

/// An allowlist entry: `"host:port"` or `{ host, port, private }`.
enum RawRule {
    Str(String),
    Table { host: String, port: u64, private: bool },
}

impl<'de> Deserialize<'de> for RawRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawRule;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(r#""host:port" or { host = "...", port = N, private = bool }"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawRule, E> {
                Ok(RawRule::Str(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawRule, A::Error> {
                let (mut host, mut port, mut private) = (None, None, false);
                while let Some(k) = m.next_key::<String>()? {
                    match k.as_str() {
                        "host" => host = Some(m.next_value::<String>()?),
                        "port" => port = Some(m.next_value::<u64>()?),
                        "private" => private = m.next_value::<bool>()?,
                        other => {
                            return Err(de::Error::unknown_field(other, &["host", "port", "private"]));
                        }
                    }
                }
                let host = host.ok_or_else(|| de::Error::missing_field("host"))?;
                let port = port.ok_or_else(|| de::Error::missing_field("port"))?;
                Ok(RawRule::Table { host, port, private })
            }
        }
        d.deserialize_any(V)
    }
}

struct Problems(Vec<Problem>);

impl Problems {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    fn addr(&mut self, path: &str, v: &str) -> SocketAddr {
        match v.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => {
                self.push(
                    path,
                    format!("{v:?} is not an ip:port socket address (names are not resolved here)"),
                );
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        }
    }

    fn range(&mut self, path: &str, lo: u64, hi: u64, v: u64) -> u64 {
        if v < lo || v > hi {
            self.push(path, format!("{v} is out of range {lo}..={hi}"));
        }
        v.clamp(lo, hi)
    }

    fn nets(&mut self, path: &str, list: &[String]) -> Vec<IpNet> {
        let mut out = vec![];
        for (i, s) in list.iter().enumerate() {
            match s.parse::<IpNet>() {
                Ok(n) => out.push(n.trunc()),
                Err(_) => match s.parse::<std::net::IpAddr>() {
                    Ok(ip) => out.push(IpNet::from(ip)),
                    Err(_) => self.push(
                        format!("{path}[{i}]"),
                        format!("{s:?} is not a CIDR (e.g. \"10.0.0.0/8\")"),
                    ),
                },
            }
        }
        out
    }
}

fn valid_tool_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && !id.starts_with('_')
}

pub(crate) fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| ConfigError {
        file: file.to_owned(),
        problems: vec![Problem {
            path: String::new(),
            message: one_line(&e.to_string()),
        }],
    })?;
    let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        ConfigError {
            file: file.to_owned(),
            problems: vec![Problem {
                path,
                message: one_line(&e.into_inner().to_string()),
            }],
        }
    })?;
    validate(raw, file)
}

/// toml errors are multi-line with a source excerpt; keep the message and position.
fn one_line(s: &str) -> String {
    let mut lines = s.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or_default().trim().to_owned();
    let last = s
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .trim()
        .to_owned();
    if first == last || last.is_empty() {
        first
    } else {
        format!("{last} ({first})")
    }
}

fn validate(raw: RawConfig, file: &str) -> Result<Config, ConfigError> {
    let mut p = Problems(vec![]);
    let rp = raw.proxy;
    let listen = p.addr("proxy.listen", &rp.listen);
    let control = p.addr("proxy.control", &rp.control);
    if listen == control && listen.port() != 0 {
        p.push("proxy.control", "must differ from proxy.listen");
    }
    if rp.facts.as_os_str().is_empty() {
        p.push("proxy.facts", "must be a file path");
    }
    let allow = p.nets("proxy.allow_ranges", &rp.allow_ranges);
    let deny = p.nets("proxy.deny_ranges", &rp.deny_ranges);
    let max_run_ms = p.range("proxy.max_run_ms", 1000, 7 * 24 * 3_600_000, rp.max_run_ms);
    let max_runs = p.range("proxy.max_runs", 1, 1_000_000, rp.max_runs);
    let hrt = p.range("proxy.header_read_timeout_ms", 100, 300_000, rp.header_read_timeout_ms);
    let mhb = p.range("proxy.max_header_bytes", 1024, 1024 * 1024, rp.max_header_bytes);
    let idle = p.range(
        "proxy.tunnel_idle_timeout_ms",
        100,
        24 * 3_600_000,
        rp.tunnel_idle_timeout_ms,
    );
    let maxc = p.range("proxy.max_connections", 1, 1_000_000, rp.max_connections);
    let pending = p.range(
        "proxy.max_pending_connections",
        1,
        1_000_000,
        rp.max_pending_connections,
    );
    let pending_head = p.range(
        "proxy.pending_head_timeout_ms",
        100,
        300_000,
        rp.pending_head_timeout_ms,
    );
    let per_run = p.range(
        "proxy.max_connections_per_run",
        1,
        1_000_000,
        rp.max_connections_per_run,
    );
    let control_conns = p.range(
        "proxy.max_control_connections",
        1,
        1_000_000,
        rp.max_control_connections,
    );
    let streams = p.range("proxy.max_event_streams", 1, 100_000, rp.max_event_streams);
    let facts_mb = p.range("proxy.facts_max_mb", 1, 16 * 1024 * 1024, rp.facts_max_mb);
    let retention = p.range(
        "proxy.facts_retention_hours",
        1,
        100 * 365 * 24,
        rp.facts_retention_hours,
    );
    let drain = p.range("proxy.drain_timeout_ms", 0, 3_600_000, rp.drain_timeout_ms);
    let dns_timeout = p.range("proxy.dns.timeout_ms", 1, 60_000, rp.dns.timeout_ms);
    let mut servers = vec![];
    for (i, s) in rp.dns.servers.iter().enumerate() {
        servers.push(p.addr(&format!("proxy.dns.servers[{i}]"), s));
    }

    let mut tools = BTreeMap::new();
    let mut canon = String::new();
    for (id, t) in raw.tools {
        let base = format!("tools.{id}");
        if !valid_tool_id(&id) {
            p.push(
                &base,
                "tool ids are 1-64 characters of a-z, 0-9, '_' and '-' (they become metric labels)",
            );
        }
        let mut rules = vec![];
        for (i, r) in t.egress.iter().enumerate() {
            let path = format!("{base}.egress[{i}]");
            let parsed = match r {
                RawRule::Str(s) => Rule::parse_str(s),
                RawRule::Table { host, port, private } => match u16::try_from(*port) {
                    Ok(port) => Rule::parse(host, port, *private),
                    Err(_) => Err(crate::RuleError::BadPort),
                },
            };
            match parsed {
                Ok(rule) => rules.push(rule),
                Err(e) => p.push(path, e.to_string()),
            }
        }
        let fetch = p.range(
            &format!("{base}.fetch_timeout_ms"),
            1,
            24 * 3_600_000,
            t.fetch_timeout_ms,
        );
        let maxc = p.range(
            &format!("{base}.max_concurrent_fetches"),
            1,
            65_536,
            t.max_concurrent_fetches,
        );
        let maxq = p.range(&format!("{base}.max_queued_fetches"), 0, 65_536, t.max_queued_fetches);
        let methods = t.methods.map(|ms| {
            ms.iter()
                .enumerate()
                .filter_map(|(i, m)| {
                    let up = m.to_ascii_uppercase();
                    if up.is_empty() || !up.bytes().all(|b| b.is_ascii_uppercase()) {
                        p.push(format!("{base}.methods[{i}]"), format!("{m:?} is not an HTTP method"));
                        None
                    } else {
                        Some(up)
                    }
                })
                .collect::<Vec<_>>()
        });
        let mode = match t.mode {
            RawMode::Enforce => Mode::Enforce,
            RawMode::Report => Mode::Report,
        };
        let _ = writeln!(canon, "tool {id} mode={} methods={methods:?}", mode.as_str());
        let mut sorted: Vec<String> = rules.iter().map(|r| r.to_string()).collect();
        sorted.sort();
        for r in sorted {
            let _ = writeln!(canon, "  {r}");
        }
        let policy = ToolPolicy {
            id: Arc::from(id.as_str()),
            allowlist: Allowlist::new(rules),
            fetch_timeout: Duration::from_millis(fetch),
            max_concurrent_fetches: maxc as usize,
            max_queued_fetches: maxq as usize,
            mode,
            methods,
            process: t.process,
        };
        tools.insert(id, Arc::new(policy));
    }
    for n in &allow {
        let _ = writeln!(canon, "allow {n}");
    }
    for n in &deny {
        let _ = writeln!(canon, "deny {n}");
    }

    let tls = rp.tls.map(|t| TlsConfig {
        cert: t.cert,
        key: t.key,
    });
    if !p.0.is_empty() {
        return Err(ConfigError {
            file: file.to_owned(),
            problems: p.0,
        });
    }
    let digest = Sha256::digest(canon.as_bytes());
    let mut hex = String::with_capacity(7 + 64);
    hex.push_str("sha256:");
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    Ok(Config {
        source: file.to_owned(),
        proxy: ProxyConfig {
            listen,
            control,
            facts: rp.facts,
            handoff: rp.handoff,
            max_run: Duration::from_millis(max_run_ms),
            max_runs: max_runs as usize,
            dns: DnsConfig {
                servers,
                timeout: Duration::from_millis(dns_timeout),
            },
            header_read_timeout: Duration::from_millis(hrt),
            max_header_bytes: mhb as usize,
            tunnel_idle_timeout: Duration::from_millis(idle),
            max_connections: maxc as usize,
            max_pending_connections: pending as usize,
            pending_head_timeout: Duration::from_millis(pending_head),
            max_connections_per_run: per_run as usize,
            max_control_connections: control_conns as usize,
            max_event_streams: streams as usize,
            facts_max_bytes: facts_mb * 1024 * 1024,
            facts_retention: Duration::from_secs(retention * 3600),
            drain_timeout: Duration::from_millis(drain),
            tls,
        },
        policy: Arc::new(Policy {
            tools,
            ranges: RangeTable::new(allow, deny),
            digest: hex,
        }),
        executor: raw.executor,
    })
}

#[cfg(test)]
mod tests {
    use crate::{Config, Host, Match, Mode};

    const GOOD: &str = r#"
[proxy]
listen = "127.0.0.1:3128"
control = "127.0.0.1:3129"
facts = "egress-facts.db"
allow_ranges = ["127.0.0.2/32"]
max_run_ms = 60000

[proxy.dns]
servers = ["127.0.0.1:5353"]
timeout_ms = 500

[tools.weather]
egress = ["api.weather.example:443", "*.tiles.example:443",
          { host = "prometheus.internal", port = 9090, private = true }]
fetch_timeout_ms = 10000
max_concurrent_fetches = 4
mode = "report"

[tools.weather.process]
command = ["python3", "tools/weather.py"]
"#;

    #[test]
    fn parses_the_design_example() {
        let c = Config::parse(GOOD, "egress.toml").unwrap();
        let t = c.policy.tool("weather").unwrap();
        assert_eq!(t.mode, Mode::Report);
        assert_eq!(t.max_concurrent_fetches, 4);
        assert_eq!(
            t.allowlist.check(&Host::Name("prometheus.internal".into()), 9090),
            Match::Allowed { private: true }
        );
        assert_eq!(c.proxy.dns.servers.len(), 1);
        assert!(c.policy.digest.starts_with("sha256:"));
        assert!(t.process.is_some());
    }

    #[test]
    fn digest_follows_policy_not_formatting() {
        let a = Config::parse(GOOD, "a").unwrap();
        let b = Config::parse(&GOOD.replace("max_run_ms = 60000", "max_run_ms = 70000"), "b").unwrap();
        let c = Config::parse(&GOOD.replace("api.weather.example", "api2.weather.example"), "c").unwrap();
        assert_eq!(a.policy.digest, b.policy.digest);
        assert_ne!(a.policy.digest, c.policy.digest);
    }

    fn errors(text: &str) -> String {
        Config::parse(text, "bad.toml").unwrap_err().to_string()
    }

    #[test]
    fn unknown_keys_name_their_path() {
        let e = errors("[proxy]\nlisten = \"127.0.0.1:1\"\nlistne = 3\n");
        assert!(
            e.contains("bad.toml") && e.contains("proxy") && e.contains("listne"),
            "{e}"
        );
        let e = errors("[tools.a]\negress = []\nfetch_timeout = 3\n");
        assert!(e.contains("tools.a") && e.contains("fetch_timeout"), "{e}");
        let e = errors("[tools.a]\negress = [{ host = \"x.example\", port = 1, privat = true }]\n");
        assert!(e.contains("tools.a.egress[0]") && e.contains("privat"), "{e}");
    }

    #[test]
    fn every_semantic_error_is_reported() {
        let e = errors(
            "[proxy]\nlisten = \"localhost:3128\"\nallow_ranges = [\"10.0.0.0/33\"]\n[tools.a]\negress = [\"*:443\", \"ok.example:443\", \"x.example\"]\nmax_concurrent_fetches = 0\n[tools.Bad]\n",
        );
        for want in [
            "bad.toml: proxy.listen:",
            "proxy.allow_ranges[0]",
            "tools.a.egress[0]: a bare '*'",
            "tools.a.egress[2]: missing port",
            "tools.a.max_concurrent_fetches: 0 is out of range",
            "tools.Bad: tool ids",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let e = errors("[proxy\nlisten = 1");
        assert!(e.contains("bad.toml") && e.contains("line"), "{e}");
    }
}
