//! The file format: the walk over the TOML that types every section
//! (`[proxy]`, `[tools.<id>]`, and through [`crate::executor`] `[executor]`
//! and `[tools.<id>.process]`), validates it and builds [`Config`], naming
//! every problem by its key path. Only a syntax error stops the walk early.

use crate::allowlist::{Allowlist, Entry, EntryProtocol, Rule, RuleError};
use crate::credentials;
use crate::executor;
use crate::fleet;
use crate::mcp;
use crate::ranges::RangeTable;
use crate::reader::{Problems, Section};
use crate::requests::{PathPattern, Requests};
use crate::{
    Budgets, Config, Decisions, DnsConfig, InterceptionConfig, Isolation, Mode, Network, Policy, Problem, ProxyConfig,
    Rate, SecretScan, TlsConfig, ToolPolicy,
};
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Defaults of a `[tools.<id>]` table.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_CONCURRENT_FETCHES: usize = 8;
pub const DEFAULT_MAX_QUEUED_FETCHES: usize = 64;

const MIB: u64 = 1024 * 1024;
const HOUR: u64 = 3600;

/// The file as far as it can be read (an invalid value reads as its
/// default), and every problem; no configuration if it is not TOML.
pub(crate) fn parse(text: &str, file: &str, dir: &Path) -> (Option<Config>, Vec<Problem>) {
    let env = |k: &str| std::env::var(k).ok();
    parse_with_env(text, file, dir, &env, &fleet::hostname)
}

/// [`parse`] with the environment and host name given (`[cell]` reads them).
pub(crate) fn parse_with_env(
    text: &str,
    file: &str,
    dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    host: &dyn Fn() -> Option<String>,
) -> (Option<Config>, Vec<Problem>) {
    let root: toml::Table = match toml::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            let syntax = Problem {
                path: String::new(),
                message: one_line(&e.to_string()),
            };
            return (None, vec![syntax]);
        }
    };
    let mut p = Problems::default();
    let mut top = Section::new("", Some(toml::Value::Table(root)), &mut p);
    let (mut proxy, allow, deny) = {
        let mut s = top.table("proxy");
        let r = proxy(&mut s);
        s.finish();
        r
    };
    let tables = top.table("tools").entries();
    let mut tools = BTreeMap::new();
    for (id, v) in tables {
        let mut s = Section::new(format!("tools.{id}"), Some(v), top.problems);
        let t = tool(&id, &mut s);
        s.finish();
        tools.insert(id, t);
    }
    let mut executor = {
        let mut s = top.table("executor");
        let r = executor::executor(&mut s);
        s.finish();
        r
    };
    let cell = fleet::cell(top.optional_table("cell"), env, host);
    let export = {
        let mut s = top.table("export");
        let r = fleet::export(&mut s);
        s.finish();
        r
    };
    let mut audit = {
        let mut s = top.table("audit");
        let r = crate::audit::audit(&mut s);
        s.finish();
        r
    };
    let mut control = {
        let mut s = top.table("control");
        let principals_file: Option<PathBuf> = s.get("principals_file");
        if principals_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            let at = s.at("principals_file");
            s.problems.push(at, "must be a path");
        }
        let tls = s.optional_table("tls").map(|mut t| {
            let cert = t.required("cert", "the PEM certificate chain both control listeners serve");
            let key = t.required("key", "its PEM private key");
            let client_ca = t.required("client_ca", "the PEM CA certificates client certificates must chain to");
            let server_ca = t.get("server_ca");
            t.finish();
            crate::ControlTls {
                cert: cert.unwrap_or_default(),
                key: key.unwrap_or_default(),
                client_ca: client_ca.unwrap_or_default(),
                server_ca,
            }
        });
        let r = crate::ControlConfig {
            principals_file,
            metrics_require_token: s.or("metrics_require_token", false),
            tls,
        };
        s.finish();
        r
    };
    top.finish();
    if executor.allow_relay {
        for (id, t) in &tools {
            if t.process.as_ref().is_some_and(|p| p.network == Network::Transparent) {
                p.push(
                    format!("tools.{id}.network"),
                    "\"transparent\" needs the listener hand-off (its sockets are handed to the proxy for the run): \
                     it cannot be used with executor.allow_relay = true",
                );
            }
        }
    }
    fleet::check(cell.as_ref(), &export, &mut p);

    // Relative paths in the file are relative to `dir`.
    let rel = |p: &mut PathBuf| {
        if !dir.as_os_str().is_empty() && p.is_relative() {
            *p = if p.as_os_str() == "." {
                dir.to_path_buf()
            } else {
                dir.join(&*p)
            };
        }
    };
    // `:memory:` names no file (an in-memory store), wherever the file is.
    if proxy.facts.as_os_str() != ":memory:" {
        rel(&mut proxy.facts);
    }
    proxy.config_dir = dir.to_path_buf();
    proxy.handoff.iter_mut().for_each(rel);
    proxy.envelope.iter_mut().for_each(rel);
    control.principals_file.iter_mut().for_each(rel);
    if let Some(t) = control.tls.as_mut() {
        rel(&mut t.cert);
        rel(&mut t.key);
        rel(&mut t.client_ca);
        t.server_ca.iter_mut().for_each(rel);
    }
    if let Some(tls) = proxy.tls.as_mut() {
        rel(&mut tls.cert);
        rel(&mut tls.key);
    }
    proxy.interception.ca_dir.iter_mut().for_each(rel);
    audit.paths_mut(&mut |p| rel(p));
    proxy.interception.upstream_ca_file.iter_mut().for_each(rel);
    rel(&mut executor.scratch_dir);
    executor.cgroup.iter_mut().for_each(rel);
    executor.proxy_handoff.iter_mut().for_each(rel);
    for t in tools.values_mut() {
        if let Some(process) = t.process.as_mut() {
            rel(&mut process.cwd);
            process.read_paths.iter_mut().for_each(rel);
        }
        for c in &mut t.credentials {
            c.source.paths_mut(&mut |p| rel(p));
            if let Some(sign) = &mut c.sign {
                Arc::make_mut(sign).paths_mut(&mut |p| rel(p));
            }
        }
    }

    let mut canon = String::new();
    for (id, t) in &tools {
        let _ = writeln!(
            canon,
            "tool {id} mode={} methods={:?} inspect={}",
            t.mode.as_str(),
            t.methods,
            t.inspect
        );
        if t.budgets != Budgets::default() {
            let b = &t.budgets;
            let rate = b.rate.map(|r| (r.per_second, r.burst));
            let _ = writeln!(
                canon,
                "  budgets requests={:?} bytes={:?} rate={rate:?}",
                b.requests, b.bytes
            );
        }
        let mut sorted: Vec<String> = t.allowlist.entries().collect();
        sorted.sort();
        for r in sorted {
            let _ = writeln!(canon, "  {r}");
        }
        // The credential's rule, never its secret: a rotation is not a policy change.
        for c in &t.credentials {
            let hosts: Vec<String> = c.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
            let _ = writeln!(
                canon,
                "  credential {} hosts={hosts:?} header={} value={:?} env={} plaintext={:?}{}",
                c.name,
                c.header,
                c.value.as_written(),
                c.placeholder_env,
                c.allow_plaintext,
                // Written only when set: digests of policies without it stay as they were.
                if c.rewrite_websocket { " rewrite_websocket" } else { "" }
            );
        }
        // Written only when present: digests of policies without it stay as they were.
        if let Some(m) = &t.mcp {
            for line in m.canonical().lines() {
                let _ = writeln!(canon, "  {line}");
            }
        }
    }
    for n in &allow {
        let _ = writeln!(canon, "allow {n}");
    }
    for n in &deny {
        let _ = writeln!(canon, "deny {n}");
    }
    let digest = Sha256::digest(canon.as_bytes());
    let mut hex = String::with_capacity(7 + 64);
    hex.push_str("sha256:");
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    let config = Config {
        source: file.to_owned(),
        proxy,
        policy: Arc::new(Policy {
            tools: tools.into_iter().map(|(id, t)| (id, Arc::new(t))).collect(),
            ranges: RangeTable::new(allow, deny),
            digest: hex,
            secrets: SecretScan::default(),
        }),
        executor,
        cell,
        export,
        audit,
        control,
    };
    (Some(config), p.0)
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

/// Reads `[proxy]`; also returns its allow and deny ranges.
fn proxy(s: &mut Section) -> (ProxyConfig, Vec<IpNet>, Vec<IpNet>) {
    let d = ProxyConfig::default();
    let listen = s.addr("listen", d.listen);
    let control = s.addr("control", d.control);
    if listen == control && listen.port() != 0 {
        let at = s.at("control");
        s.problems.push(at, "must differ from proxy.listen");
    }
    let facts: PathBuf = s.or("facts", d.facts);
    if facts.as_os_str().is_empty() {
        let at = s.at("facts");
        s.problems.push(at, "must be a file path");
    }
    let allow = nets(s, "allow_ranges");
    let deny = nets(s, "deny_ranges");
    let dns = {
        let mut t = s.table("dns");
        let mut servers = vec![];
        for (at, v) in t.list::<String>("servers").unwrap_or_default() {
            servers.extend(t.problems.addr(&at, &v));
        }
        let timeout = t.millis("timeout_ms", 1..=60_000, d.dns.timeout);
        t.finish();
        DnsConfig { servers, timeout }
    };
    let tls = s.optional_table("tls").map(|mut t| {
        let cert = t.required("cert", "a PEM certificate chain file");
        let key = t.required("key", "a PEM private key file");
        t.finish();
        TlsConfig {
            cert: cert.unwrap_or_default(),
            key: key.unwrap_or_default(),
        }
    });
    let interception = {
        let mut t = s.table("interception");
        let ca_dir: Option<PathBuf> = t.get("ca_dir");
        let upstream_ca_file: Option<PathBuf> = t.get("upstream_ca_file");
        for (key, p) in [("ca_dir", &ca_dir), ("upstream_ca_file", &upstream_ca_file)] {
            if p.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                let at = t.at(key);
                t.problems.push(at, "must be a path");
            }
        }
        t.finish();
        InterceptionConfig {
            ca_dir,
            upstream_ca_file,
        }
    };
    let cfg = ProxyConfig {
        listen,
        control,
        facts,
        config_dir: PathBuf::new(),
        handoff: s.get("handoff"),
        max_run: s.millis("max_run_ms", 1000..=7 * 24 * 3_600_000, d.max_run),
        max_runs: s.count("max_runs", 1..=1_000_000, d.max_runs),
        dns,
        header_read_timeout: s.millis("header_read_timeout_ms", 100..=300_000, d.header_read_timeout),
        activation_wait: s.millis("activation_wait_ms", 0..=60_000, d.activation_wait),
        max_header_bytes: s.count("max_header_bytes", 1024..=1024 * 1024, d.max_header_bytes),
        tunnel_idle_timeout: s.millis("tunnel_idle_timeout_ms", 100..=24 * 3_600_000, d.tunnel_idle_timeout),
        max_connections: s.count("max_connections", 1..=1_000_000, d.max_connections),
        max_pending_connections: s.count("max_pending_connections", 1..=1_000_000, d.max_pending_connections),
        pending_head_timeout: s.millis("pending_head_timeout_ms", 100..=300_000, d.pending_head_timeout),
        max_connections_per_run: s.count("max_connections_per_run", 1..=1_000_000, d.max_connections_per_run),
        max_control_connections: s.count("max_control_connections", 1..=1_000_000, d.max_control_connections),
        max_event_streams: s.count("max_event_streams", 1..=100_000, d.max_event_streams),
        facts_max_bytes: s.int("facts_max_mb", 1..=16 * 1024 * 1024, d.facts_max_bytes / MIB) * MIB,
        facts_retention: Duration::from_secs(
            s.int(
                "facts_retention_hours",
                1..=100 * 365 * 24,
                d.facts_retention.as_secs() / HOUR,
            ) * HOUR,
        ),
        decisions: decisions(s),
        decisions_max_bytes: s.int("decisions_max_mb", 1..=16 * 1024 * 1024, d.decisions_max_bytes / MIB) * MIB,
        decisions_retention: Duration::from_secs(
            s.int(
                "decisions_retention_hours",
                1..=100 * 365 * 24,
                d.decisions_retention.as_secs() / HOUR,
            ) * HOUR,
        ),
        drain_timeout: s.millis("drain_timeout_ms", 0..=3_600_000, d.drain_timeout),
        tls,
        envelope: s.get("envelope"),
        interception,
    };
    (cfg, allow, deny)
}

/// `decisions = "off" | "sampled" | "all"` and `decisions_sample` (1 in N).
fn decisions(s: &mut Section) -> Decisions {
    #[derive(Clone, Copy)]
    enum Choice {
        Off,
        Sampled,
        All,
    }
    let choice = s.choice(
        "decisions",
        &[("off", Choice::Off), ("sampled", Choice::Sampled), ("all", Choice::All)],
        Choice::Off,
    );
    let n = s.int("decisions_sample", 1..=1_000_000, 100) as u32;
    match choice {
        Choice::Off => Decisions::Off,
        Choice::Sampled => Decisions::Sampled(n),
        Choice::All => Decisions::All,
    }
}

/// A list of CIDRs (or single addresses) under `key`.
fn nets(s: &mut Section, key: &'static str) -> Vec<IpNet> {
    let mut out = vec![];
    for (at, v) in s.list::<String>(key).unwrap_or_default() {
        match v.parse::<IpNet>() {
            Ok(n) => out.push(n.trunc()),
            Err(_) => match v.parse::<std::net::IpAddr>() {
                Ok(ip) => out.push(IpNet::from(ip)),
                Err(_) => s
                    .problems
                    .push(at, format!("{v:?} is not a CIDR (e.g. \"10.0.0.0/8\")")),
            },
        }
    }
    out
}

fn valid_tool_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && !id.starts_with('_')
}

/// Reads `[tools.<id>]` with its `process` table.
fn tool(id: &str, s: &mut Section) -> ToolPolicy {
    if !valid_tool_id(id) {
        let at = s.path().to_owned();
        s.problems.push(
            at,
            "tool ids are 1-64 characters of a-z, 0-9, '_' and '-' (they become metric labels)",
        );
    }
    let mut rules = vec![];
    // Where each `protocol = "tcp"` entry is, for the checks that need the rest of the tool.
    let mut raw_at = vec![];
    for (at, v) in s.list::<toml::Value>("egress").unwrap_or_default() {
        if let Some(entry) = egress_rule(at.clone(), v, s) {
            if entry.protocol == EntryProtocol::Tcp {
                raw_at.push(format!("{at}.protocol"));
            }
            rules.push(entry);
        }
    }
    let methods = methods(s);
    let network = s.choice(
        "network",
        &[("proxy", Network::Proxy), ("transparent", Network::Transparent)],
        Network::Proxy,
    );
    let had_process = s.has("process");
    let mut process = s.optional_table("process").and_then(|mut t| {
        let p = executor::process(&mut t);
        t.finish();
        p
    });
    if network == Network::Transparent {
        let at = s.at("network");
        match process.as_mut() {
            Some(p) => {
                p.network = network;
                if p.isolation == Isolation::Off {
                    s.problems.push(
                        at,
                        "\"transparent\" needs the tool's children in a network namespace of their own: \
                         process.isolation must be \"strict\" or \"best_effort\", not \"off\"",
                    );
                }
            }
            None if had_process => {}
            None => s.problems.push(
                at,
                "\"transparent\" is how the executor confines the tool's children: it needs a [tools.<id>.process] section",
            ),
        }
    }
    let allowlist = Allowlist::with_entries(rules);
    let credentials = credentials::credentials(s, &allowlist, process.as_ref().map(|p| &p.env));
    let t = ToolPolicy {
        id: Arc::from(id),
        allowlist,
        credentials,
        fetch_timeout: s.millis("fetch_timeout_ms", 1..=24 * 3_600_000, DEFAULT_FETCH_TIMEOUT),
        max_concurrent_fetches: s.count("max_concurrent_fetches", 1..=65_536, DEFAULT_MAX_CONCURRENT_FETCHES),
        max_queued_fetches: s.count("max_queued_fetches", 0..=65_536, DEFAULT_MAX_QUEUED_FETCHES),
        mode: s.choice(
            "mode",
            &[("enforce", Mode::Enforce), ("report", Mode::Report)],
            Mode::Enforce,
        ),
        methods,
        inspect: s.or("inspect", false),
        process,
        secrets: SecretScan::default(),
        budgets: budgets(s),
        ask: ask(s),
        mcp: mcp::read(s),
    };
    raw_entries(&t, network, &raw_at, s);
    t
}

/// What a `protocol = "tcp"` entry (at each of `raw_at`) needs of its tool:
/// transparent connections, which are what it applies to; no `inspect`,
/// which promises every connection seen; and, when the tool restricts
/// `methods`, `CONNECT` among them, as the relay is decided as a CONNECT.
/// (Its own method and path rules, and credentials on its hosts, are
/// refused where they are read.)
fn raw_entries(t: &ToolPolicy, network: Network, raw_at: &[String], s: &mut Section) {
    let problem = if network != Network::Transparent {
        Some(
            "\"tcp\" says how a transparent connection is carried: it applies only to a tool with \
             network = \"transparent\" (leave it out otherwise)"
                .to_owned(),
        )
    } else if t.inspect {
        Some(
            "\"tcp\" relays bytes unseen, and inspect = true promises every connection of the tool \
             intercepted: use one or the other"
                .to_owned(),
        )
    } else if t.methods.as_ref().is_some_and(|m| !m.iter().any(|m| m == "CONNECT")) {
        Some(format!(
            "\"tcp\" relays are decided as a CONNECT, which {}.methods does not list",
            s.path()
        ))
    } else {
        None
    };
    if let Some(p) = problem {
        for at in raw_at {
            s.problems.push(at.clone(), p.clone());
        }
    }
}

/// `on_unlisted = "deny" | "ask"` and `ask_timeout_ms` of a tool.
fn ask(s: &mut Section) -> Option<Duration> {
    let ask = s.choice("on_unlisted", &[("deny", false), ("ask", true)], false);
    let timeout = s.millis("ask_timeout_ms", 1..=600_000, DEFAULT_ASK_TIMEOUT);
    ask.then_some(timeout)
}

/// `ask_timeout_ms` when not set.
const DEFAULT_ASK_TIMEOUT: Duration = Duration::from_secs(30);

/// `max_requests_per_run`, `max_bytes_per_run` and `max_request_rate` of a tool.
fn budgets(s: &mut Section) -> Budgets {
    let positive = |s: &mut Section, key: &'static str, max: u64| s.has(key).then(|| s.int(key, 1..=max, 1));
    let requests = positive(s, "max_requests_per_run", 1 << 40);
    let bytes = positive(s, "max_bytes_per_run", 1 << 50);
    let rate = s.optional_table("max_request_rate").map(|mut t| {
        if !t.has("per_second") {
            t.problems
                .push(t.at("per_second"), "is required: requests per second, 1-1000000");
        }
        let per_second = t.int("per_second", 1..=1_000_000, 1) as u32;
        let burst = t.int("burst", 1..=1_000_000, u64::from(per_second)) as u32;
        t.finish();
        Rate { per_second, burst }
    });
    Budgets { requests, bytes, rate }
}

/// Upper-case HTTP methods (`methods` of a tool or of an allowlist entry).
fn methods(s: &mut Section) -> Option<Vec<String>> {
    s.list::<String>("methods").map(|ms| {
        ms.into_iter()
            .filter_map(|(at, m)| {
                let up = m.to_ascii_uppercase();
                if up.is_empty() || !up.bytes().all(|b| b.is_ascii_uppercase()) {
                    s.problems.push(at, format!("{m:?} is not an HTTP method"));
                    None
                } else {
                    Some(up)
                }
            })
            .collect()
    })
}

/// An allowlist entry: `"host:port"` or `{ host, port, private, methods, paths, protocol }`.
fn egress_rule(at: String, v: toml::Value, s: &mut Section) -> Option<Entry> {
    let (parsed, requests, protocol) = match v {
        toml::Value::String(v) => (Rule::parse_str(&v), None, EntryProtocol::TlsOrHttp),
        toml::Value::Table(_) => {
            let mut t = Section::new(at.clone(), Some(v), s.problems);
            let host: Option<String> = t.required("host", "a host name or address");
            let port: Option<u64> = t.required("port", "1-65535");
            let private = t.or("private", false);
            let methods = methods(&mut t);
            let paths = t.list::<String>("paths").map(|ps| {
                ps.into_iter()
                    .filter_map(|(at, p)| match PathPattern::parse(&p) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            t.problems.push(at, e);
                            None
                        }
                    })
                    .collect()
            });
            let protocol = match t.get::<String>("protocol") {
                None => EntryProtocol::TlsOrHttp,
                Some(p) if p == "tcp" => EntryProtocol::Tcp,
                Some(p) => {
                    let at = t.at("protocol");
                    t.problems.push(
                        at,
                        format!(
                            "{p:?} is not a protocol an entry names: \"tcp\" (relayed raw, nothing checked); \
                             leave it out for TLS or HTTP, checked"
                        ),
                    );
                    EntryProtocol::TlsOrHttp
                }
            };
            if protocol == EntryProtocol::Tcp && (methods.is_some() || paths.is_some()) {
                let at = t.at("protocol");
                t.problems.push(
                    at,
                    "\"tcp\" relays bytes unseen, so no request on it could be held to methods or paths: \
                     use one or the other",
                );
            }
            t.finish();
            let requests = (methods.is_some() || paths.is_some()).then_some(Requests { methods, paths });
            let (host, port) = (host?, port?);
            let rule = match u16::try_from(port) {
                Ok(port) => Rule::parse(&host, port, private),
                Err(_) => Err(RuleError::BadPort),
            };
            (rule, requests, protocol)
        }
        other => {
            s.problems.push(
                at,
                format!(
                    r#"must be "host:port" or {{ host = "...", port = N, private = bool, methods = [...], paths = [...], protocol = "tcp" }}, not {}"#,
                    other.type_str()
                ),
            );
            return None;
        }
    };
    match parsed {
        Ok(rule) => Some(Entry {
            rule,
            requests,
            protocol,
        }),
        Err(e) => {
            s.problems.push(at, e.to_string());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, Decisions, Host, Match, Mode};
    use std::path::{Path, PathBuf};
    use std::time::Duration;

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
    fn budgets_are_read_checked_and_policy() {
        use crate::{Budgets, Rate};
        let c = Config::parse(
            "[tools.t]\nmax_requests_per_run = 5\nmax_bytes_per_run = 1000\nmax_request_rate = { per_second = 2 }\n",
            "t.toml",
        )
        .unwrap();
        let b = c.policy.tool("t").unwrap().budgets;
        assert_eq!(
            b,
            Budgets {
                requests: Some(5),
                bytes: Some(1000),
                rate: Some(Rate {
                    per_second: 2,
                    burst: 2
                })
            }
        );
        let none = Config::parse("[tools.t]\n", "t.toml").unwrap();
        assert_eq!(none.policy.tool("t").unwrap().budgets, Budgets::default());
        assert_ne!(c.policy.digest, none.policy.digest);
        let e = errors("[tools.t]\nmax_requests_per_run = 0\nmax_request_rate = { burst = 0, every = 1 }\n");
        assert!(e.contains("tools.t.max_requests_per_run"), "{e}");
        assert!(e.contains("tools.t.max_request_rate.per_second"), "{e}");
        assert!(e.contains("tools.t.max_request_rate.burst"), "{e}");
        assert!(e.contains("tools.t.max_request_rate.every"), "{e}");
        // on_unlisted: "deny" by default, "ask" holds for ask_timeout_ms.
        assert_eq!(none.policy.tool("t").unwrap().ask, None);
        let ask = |text: &str| Config::parse(text, "t.toml").unwrap().policy.tool("t").unwrap().ask;
        assert_eq!(
            ask("[tools.t]\non_unlisted = \"ask\"\n"),
            Some(std::time::Duration::from_secs(30))
        );
        assert_eq!(
            ask("[tools.t]\non_unlisted = \"ask\"\nask_timeout_ms = 1500\n"),
            Some(std::time::Duration::from_millis(1500))
        );
        let e = errors("[tools.t]\non_unlisted = \"maybe\"\nask_timeout_ms = 0\n");
        assert!(e.contains("tools.t.on_unlisted"), "{e}");
        assert!(e.contains("tools.t.ask_timeout_ms"), "{e}");
    }

    #[test]
    fn the_decision_log_keys_are_read_and_checked() {
        let c = |text: &str| Config::parse(text, "t.toml").unwrap().proxy;
        assert_eq!(c("[proxy]\n").decisions, Decisions::Off);
        assert_eq!(c("[proxy]\ndecisions = \"all\"\n").decisions, Decisions::All);
        assert_eq!(
            c("[proxy]\ndecisions = \"sampled\"\n").decisions,
            Decisions::Sampled(100)
        );
        let p = c("[proxy]\ndecisions = \"sampled\"\ndecisions_sample = 7\ndecisions_max_mb = 3\ndecisions_retention_hours = 2\n");
        assert_eq!(p.decisions, Decisions::Sampled(7));
        assert_eq!(p.decisions_max_bytes, 3 << 20);
        assert_eq!(p.decisions_retention, Duration::from_secs(7200));
        let e = errors("[proxy]\ndecisions = \"some\"\ndecisions_sample = 0\ndecisions_max_mb = 0\n");
        for key in ["proxy.decisions:", "proxy.decisions_sample", "proxy.decisions_max_mb"] {
            assert!(e.contains(key), "{key}: {e}");
        }
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
    fn entries_carry_method_and_path_rules() {
        use crate::allowlist::RequestRules;
        let text = "[tools.gh]\negress = [{ host = \"api.github.com\", port = 443, methods = [\"get\", \"HEAD\"], paths = [\"/repos/acme/*\", \"/user\"] }, \"cdn.example:443\"]\n";
        let c = Config::parse(text, "t.toml").unwrap();
        let t = c.policy.tool("gh").unwrap();
        let gh = Host::Name("api.github.com".into());
        let RequestRules::Only(rules) = t.allowlist.requests(&gh, 443) else {
            panic!("restricted")
        };
        assert_eq!(
            rules[0].methods.as_deref(),
            Some(&["GET".to_string(), "HEAD".to_string()][..])
        );
        assert_eq!(
            t.allowlist.requests(&Host::Name("cdn.example".into()), 443),
            RequestRules::Any
        );
        assert_eq!(t.allowlist.check(&gh, 443), Match::Allowed { private: false });
        let entries: Vec<String> = t.allowlist.entries().collect();
        assert_eq!(
            entries[0],
            "api.github.com:443 methods=GET,HEAD paths=/repos/acme/*,/user"
        );
        // A path rule is policy: changing it changes the digest.
        let other = Config::parse(&text.replace("/user", "/users"), "t.toml").unwrap();
        assert_ne!(c.policy.digest, other.policy.digest);
        // Patterns must be normal paths; methods tokens.
        let e = errors(
            "[tools.gh]\negress = [{ host = \"a.example\", port = 443, methods = [\"G T\"], paths = [\"/a/../b\", \"/x?y\", \"/a/**b\"] }]\n",
        );
        assert!(
            e.contains("tools.gh.egress[0].methods[0]: \"G T\" is not an HTTP method"),
            "{e}"
        );
        assert!(
            e.contains("tools.gh.egress[0].paths[0]: \"/a/../b\" is not a normal path; write it as \"/b\""),
            "{e}"
        );
        assert!(e.contains("tools.gh.egress[0].paths[1]"), "{e}");
        assert!(
            e.contains("tools.gh.egress[0].paths[2]: \"/a/**b\": '**' must be a whole segment"),
            "{e}"
        );
    }

    #[test]
    fn a_raw_tcp_entry_is_read_and_held_to_what_it_can_mean() {
        let tool = |extra: &str, egress: &str| {
            format!(
                "[tools.t]\nnetwork = \"transparent\"\negress = [{egress}]\n{extra}\n[tools.t.process]\ncommand = [\"x\"]\n"
            )
        };
        let raw = r#"{ host = "db.internal", port = 5432, private = true, protocol = "tcp" }, "web.example:443""#;
        let c = Config::parse(&tool("", raw), "t.toml").unwrap();
        let t = c.policy.tool("t").unwrap();
        assert!(t.allowlist.relays_raw(&Host::Name("db.internal".into()), 5432));
        assert!(!t.allowlist.relays_raw(&Host::Name("web.example".into()), 443));
        assert_eq!(
            t.allowlist.check(&Host::Name("db.internal".into()), 5432),
            Match::Allowed { private: true }
        );
        // The protocol is policy: it is in the digest; a list without it
        // keeps the digest it had.
        let checked = Config::parse(&tool("", &raw.replace(r#", protocol = "tcp""#, "")), "t.toml").unwrap();
        assert_ne!(c.policy.digest, checked.policy.digest);
        let e = errors(&tool("", r#"{ host = "db.internal", port = 5432, protocol = "udp" }"#));
        assert!(
            e.contains("tools.t.egress[0].protocol: \"udp\" is not a protocol an entry names"),
            "{e}"
        );
        // Method and path rules need the requests seen; so do inspect and
        // credentials; a tool restricting methods must allow CONNECT; and it
        // means something on transparent connections only.
        let e = errors(&tool(
            "",
            r#"{ host = "db.internal", port = 5432, protocol = "tcp", methods = ["GET"] }"#,
        ));
        assert!(
            e.contains("tools.t.egress[0].protocol: \"tcp\" relays bytes unseen"),
            "{e}"
        );
        let e = errors(&tool("inspect = true", raw));
        assert!(
            e.contains("tools.t.egress[0].protocol:") && e.contains("inspect = true"),
            "{e}"
        );
        let e = errors(&tool("methods = [\"GET\"]", raw));
        assert!(
            e.contains("tools.t.egress[0].protocol: \"tcp\" relays are decided as a CONNECT, which tools.t.methods does not list"),
            "{e}"
        );
        assert!(Config::parse(&tool("methods = [\"GET\", \"CONNECT\"]", raw), "t.toml").is_ok());
        let e = errors(&format!("[tools.t]\negress = [{raw}]\n"));
        assert!(
            e.contains("tools.t.egress[0].protocol:") && e.contains("network = \"transparent\""),
            "{e}"
        );
        let e = errors(&tool(
            "[tools.t.credentials.db]\nhosts = [\"db.internal:5432\"]\nvalue = \"Bearer ${secret}\"\nsecret = { env = \"DB_TOKEN\" }\nplaceholder_env = \"DB_TOKEN\"",
            raw,
        ));
        assert_eq!(
            e,
            "bad.toml: tools.t.credentials.db.hosts[0]: db.internal:5432 is relayed raw (an egress entry with \
             protocol = \"tcp\"), and a credential is written only into requests the proxy sees",
        );
    }

    #[test]
    fn interception_settings_and_inspect() {
        let c = Config::parse_relative_to(
            "[proxy.interception]\nca_dir = \"ca\"\nupstream_ca_file = \"/etc/lab/roots.pem\"\n\
             [tools.a]\negress = [\"a.example:443\"]\ninspect = true\n[tools.b]\negress = []\n",
            "c.toml",
            Path::new("/etc/loom"),
        )
        .unwrap();
        assert_eq!(c.proxy.interception.ca_dir, Some(PathBuf::from("/etc/loom/ca")));
        assert_eq!(
            c.proxy.interception.upstream_ca_file,
            Some(PathBuf::from("/etc/lab/roots.pem"))
        );
        assert!(c.policy.tool("a").unwrap().inspect);
        assert!(!c.policy.tool("b").unwrap().inspect, "off by default");
        // Turning inspection on is a policy change.
        let off = Config::parse(
            "[tools.a]\negress = [\"a.example:443\"]\n[tools.b]\negress = []\n",
            "c.toml",
        )
        .unwrap();
        assert_ne!(off.policy.digest, c.policy.digest);
        let e = errors("[proxy.interception]\nca_dir = \"\"\ncadir = 1\n[tools.a]\negress = []\ninspect = \"yes\"\n");
        for want in [
            "proxy.interception.ca_dir: must be a path",
            "proxy.interception.cadir: unknown key",
            "tools.a.inspect: invalid type",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
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

    /// Unknown keys, wrong types and invalid values of every section come
    /// in one report, in the order of the walk (proxy, tools, executor).
    #[test]
    fn every_problem_of_every_section_is_reported_at_once() {
        let e = errors(
            r#"
[proxy]
listen = "127.0.0.1:3128"
control = 3129
max_runs = "many"
listne = "x"
[proxy.dns]
servers = ["127.0.0.1:53", 53]
[tools.web]
egress = ["api.example:443", 443, { host = "db.internal", port = 70000 }]
mode = "audit"
[tools.web.process]
command = ["python3", "web.py"]
pool = { warm = 3, max = 2 }
isolation = "tight"
[executor]
lease_ms = "15s"
child_uid = 0
[extra]
"#,
        );
        assert_eq!(
            e,
            r#"bad.toml: proxy.control: invalid type: integer `3129`, expected a string
bad.toml: proxy.dns.servers[1]: invalid type: integer `53`, expected a string
bad.toml: proxy.max_runs: invalid type: string "many", expected u64
bad.toml: proxy.listne: unknown key (expected one of: activation_wait_ms, allow_ranges, control, decisions, decisions_max_mb, decisions_retention_hours, decisions_sample, deny_ranges, dns, drain_timeout_ms, envelope, facts, facts_max_mb, facts_retention_hours, handoff, header_read_timeout_ms, interception, listen, max_connections, max_connections_per_run, max_control_connections, max_event_streams, max_header_bytes, max_pending_connections, max_run_ms, max_runs, pending_head_timeout_ms, tls, tunnel_idle_timeout_ms)
bad.toml: tools.web.egress[1]: must be "host:port" or { host = "...", port = N, private = bool, methods = [...], paths = [...], protocol = "tcp" }, not integer
bad.toml: tools.web.egress[2]: port must be a decimal number in 1..=65535
bad.toml: tools.web.process.pool.warm: is 3, more than pool.max = 2
bad.toml: tools.web.process.isolation: "tight" is not one of "strict", "best_effort", "off"
bad.toml: tools.web.mode: "audit" is not one of "enforce", "report"
bad.toml: executor.lease_ms: invalid type: string "15s", expected u64
bad.toml: executor.child_uid: must not be 0 (root)
bad.toml: extra: unknown key (expected one of: audit, cell, control, executor, export, proxy, tools)"#
        );
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let e = errors("[proxy\nlisten = 1");
        assert!(e.contains("bad.toml") && e.contains("line"), "{e}");
    }
}
