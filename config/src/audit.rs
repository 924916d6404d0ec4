//! `[audit]`: where the store's records go as OCSF events (named sinks
//! under `[audit.sinks.NAME]`, each of type `otlp`, `syslog` or `file`),
//! and the keys of the hash chain's signed checkpoints (`signing_key_file`,
//! `checkpoint_ms`, `checkpoint_records`). Secrets never come from the
//! file: an OTLP sink's headers come from the environment variable it
//! names.

use crate::reader::Section;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// The most sinks one proxy runs (each is a task, a cursor pair and a
/// metric label).
pub const MAX_SINKS: usize = 16;

/// `[audit]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditConfig {
    /// Sinks by name (the name is a metric label and part of the cursors'
    /// keys in the store).
    pub sinks: BTreeMap<String, SinkConfig>,
    /// The Ed25519 key checkpoints are signed with (none: unsigned).
    pub signing_key_file: Option<PathBuf>,
    /// Make the key at start when the file does not exist (first boot).
    pub signing_key_create: bool,
    /// A checkpoint at least this often.
    pub checkpoint: Duration,
    /// A checkpoint at least every this many records.
    pub checkpoint_records: u64,
    /// The sinks' events of chained records carry their OCSF 1.9
    /// attestation (profile `record_integrity`).
    pub record_integrity: bool,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            sinks: BTreeMap::new(),
            signing_key_file: None,
            signing_key_create: false,
            checkpoint: Duration::from_millis(60_000),
            checkpoint_records: 10_000,
            record_integrity: false,
        }
    }
}

/// One sink: what every type shares, then its own settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkConfig {
    /// Records sent in one batch at most.
    pub batch_max: usize,
    /// Bytes of OCSF JSON in one batch at most (one record always goes).
    pub batch_max_bytes: usize,
    /// How often an idle sink looks for new records.
    pub flush: Duration,
    /// One attempt (connect, send, answer) at most.
    pub timeout: Duration,
    /// The longest pause between retries (backoff doubles up to it).
    pub retry_max: Duration,
    pub kind: SinkKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkKind {
    Otlp(OtlpSink),
    Syslog(SyslogSink),
    File(FileSink),
}

impl SinkKind {
    pub fn name(&self) -> &'static str {
        match self {
            SinkKind::Otlp(_) => "otlp",
            SinkKind::Syslog(_) => "syslog",
            SinkKind::File(_) => "file",
        }
    }
}

/// Where a network sink connects: a host (name or IP literal) and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

/// `type = "otlp"`: OTLP/HTTP logs in protobuf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpSink {
    /// `http` or `https`.
    pub https: bool,
    pub endpoint: Endpoint,
    /// The path records are POSTed to (`{endpoint path}/v1/logs`).
    pub path: String,
    /// The environment variable holding extra headers, `k=v,k2=v2`.
    pub headers_env: Option<String>,
    /// PEM CA certificates the collector's certificate must chain to
    /// (default: the system's roots).
    pub ca_file: Option<PathBuf>,
    /// The resource attribute `service.name`.
    pub service_name: String,
}

/// `type = "syslog"`: RFC 5424 over TCP (RFC 6587 octet counting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyslogSink {
    pub endpoint: Endpoint,
    /// TLS (RFC 5425) on the connection.
    pub tls: bool,
    pub ca_file: Option<PathBuf>,
    /// The name the server's certificate is checked for (default: host).
    pub server_name: Option<String>,
    pub app_name: String,
    /// HOSTNAME (default: the cell id, else the machine's name).
    pub hostname: Option<String>,
    /// The facility of PRI (13, log audit, by default).
    pub facility: u8,
}

/// `type = "file"`: JSONL, rotated by size and count, mode 0600.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSink {
    pub path: PathBuf,
    /// A file is rotated before it would grow past this.
    pub max_file_bytes: u64,
    /// Files kept, the current one included.
    pub max_files: usize,
}

/// Whether `name` can name a sink (a metric label and a store key).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name.as_bytes()[0].is_ascii_lowercase()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn env_name(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `host:port`, `[v6]:port`, the port within 1..=65535.
fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| format!("{s:?} is not [address]:port"))?;
        (h, p)
    } else {
        s.rsplit_once(':').ok_or_else(|| format!("{s:?} has no :port"))?
    };
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{s:?}: the port is not a number in 1..=65535"))?;
    let bad = |b: u8| !(b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b':' || b == b'_');
    if host.is_empty() || host.len() > 253 || host.bytes().any(bad) {
        return Err(format!("{s:?}: {host:?} is not a host name or IP address"));
    }
    Ok(Endpoint {
        host: host.to_ascii_lowercase(),
        port,
    })
}

/// `http[s]://host[:port][/path]` (port 4318 by default, OTLP/HTTP's).
fn parse_url(s: &str) -> Result<(bool, Endpoint, String), String> {
    let (https, rest) = if let Some(r) = s.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = s.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!("{s:?} is not an http:// or https:// URL"));
    };
    if s.len() > 512 || s.contains(['?', '#', '@']) || s.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(format!("{s:?}: an endpoint has no user, query or fragment"));
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let with_port = if authority.ends_with(']') || !authority.contains(':') {
        format!("{authority}:4318")
    } else {
        authority.to_owned()
    };
    let endpoint = parse_endpoint(&with_port)?;
    Ok((https, endpoint, format!("{path}/v1/logs")))
}

/// Reads `[audit]`.
pub(crate) fn audit(s: &mut Section) -> AuditConfig {
    let d = AuditConfig::default();
    let signing_key_file: Option<PathBuf> = s.get("signing_key_file");
    if signing_key_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
        let at = s.at("signing_key_file");
        s.problems.push(at, "must be a path");
    }
    let signing_key_create = s.or("signing_key_create", d.signing_key_create);
    if signing_key_create && signing_key_file.is_none() {
        let at = s.at("signing_key_create");
        s.problems
            .push(at, "needs signing_key_file: the path of the key to make");
    }
    let checkpoint = s.millis("checkpoint_ms", 1_000..=86_400_000, d.checkpoint);
    let checkpoint_records = s.int("checkpoint_records", 1..=100_000_000, d.checkpoint_records);
    let record_integrity = s.or("record_integrity", d.record_integrity);
    let mut sinks = BTreeMap::new();
    let tables = s.table("sinks").entries();
    if tables.len() > MAX_SINKS {
        let at = s.at("sinks");
        s.problems
            .push(at, format!("{} sinks: at most {MAX_SINKS}", tables.len()));
    }
    for (name, v) in tables {
        let path = format!("{}.sinks.{name}", s.path());
        let path = path.trim_start_matches('.').to_owned();
        if !valid_name(&name) {
            s.problems.push(
                path.clone(),
                format!("{name:?}: a sink name is 1-32 characters of a-z, 0-9, '-' and '_', starting with a letter"),
            );
        }
        let mut t = Section::new(path, Some(v), s.problems);
        if let Some(sink) = sink(&mut t) {
            sinks.insert(name, sink);
        }
        t.finish();
    }
    AuditConfig {
        sinks,
        signing_key_file,
        signing_key_create,
        checkpoint,
        checkpoint_records,
        record_integrity,
    }
}

/// A path key that must not be empty.
fn path_key(s: &mut Section, key: &'static str) -> Option<PathBuf> {
    let p: Option<PathBuf> = s.get(key);
    if p.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
        let at = s.at(key);
        s.problems.push(at, "must be a path");
        return None;
    }
    p
}

fn endpoint_key(s: &mut Section, key: &'static str, what: &str) -> Option<Endpoint> {
    let v: String = s.required(key, what)?;
    match parse_endpoint(&v) {
        Ok(e) => Some(e),
        Err(m) => {
            let at = s.at(key);
            s.problems.push(at, m);
            None
        }
    }
}

/// One `[audit.sinks.NAME]`; `None` when it cannot be used.
fn sink(s: &mut Section) -> Option<SinkConfig> {
    #[derive(Clone, Copy)]
    enum T {
        Otlp,
        Syslog,
        File,
    }
    let kind: Option<String> = s.required("type", "\"otlp\", \"syslog\" or \"file\"");
    let t = match kind.as_deref() {
        Some("otlp") => Some(T::Otlp),
        Some("syslog") => Some(T::Syslog),
        Some("file") => Some(T::File),
        Some(other) => {
            let at = s.at("type");
            s.problems
                .push(at, format!("{other:?} is not one of \"otlp\", \"syslog\", \"file\""));
            None
        }
        None => None,
    };
    let batch_max = s.count("batch_max", 1..=10_000, 512);
    let batch_max_bytes = s.count("batch_max_bytes", 4096..=64 << 20, 4 << 20);
    let flush = s.millis("flush_ms", 10..=60_000, Duration::from_millis(200));
    let timeout = s.millis("timeout_ms", 100..=300_000, Duration::from_secs(10));
    let retry_max = s.millis("retry_max_ms", 100..=3_600_000, Duration::from_secs(30));
    let Some(t) = t else {
        // An unknown type: its other keys are not reported one by one.
        s.entries();
        return None;
    };
    let kind = match t {
        T::Otlp => {
            let url: Option<String> = s.required("endpoint", "the collector's http[s]://host[:port][/path]");
            let parsed = url.map(|u| parse_url(&u));
            let headers_env: Option<String> = s.get("headers_env");
            if let Some(h) = headers_env.as_deref().filter(|h| !env_name(h)) {
                let at = s.at("headers_env");
                s.problems
                    .push(at, format!("{h:?} is not an environment variable name"));
            }
            let ca_file = path_key(s, "ca_file");
            let service_name: String = s.or("service_name", "loom-egress".to_owned());
            if service_name.is_empty() || service_name.len() > 128 {
                let at = s.at("service_name");
                s.problems.push(at, "must be 1-128 characters");
            }
            let (https, endpoint, path) = match parsed? {
                Ok(p) => p,
                Err(m) => {
                    let at = s.at("endpoint");
                    s.problems.push(at, m);
                    return None;
                }
            };
            if ca_file.is_some() && !https {
                let at = s.at("ca_file");
                s.problems.push(at, "is for an https:// endpoint");
            }
            SinkKind::Otlp(OtlpSink {
                https,
                endpoint,
                path,
                headers_env,
                ca_file,
                service_name,
            })
        }
        T::Syslog => {
            let endpoint = endpoint_key(s, "address", "the syslog server's host:port");
            let tls = s.or("tls", false);
            let ca_file = path_key(s, "ca_file");
            let server_name: Option<String> = s.get("server_name");
            let app_name: String = s.or("app_name", "loom-egress".to_owned());
            // RFC 5424 §6: APP-NAME 1*48, HOSTNAME 1*255 PRINTUSASCII.
            let printable =
                |v: &str, max: usize| !v.is_empty() && v.len() <= max && v.bytes().all(|b| (33..=126).contains(&b));
            if !printable(&app_name, 48) {
                let at = s.at("app_name");
                s.problems.push(
                    at,
                    format!("{app_name:?}: 1-48 printable ASCII characters, no space (RFC 5424)"),
                );
            }
            let hostname: Option<String> = s.get("hostname");
            if let Some(h) = hostname.as_deref().filter(|h| !printable(h, 255)) {
                let at = s.at("hostname");
                s.problems.push(
                    at,
                    format!("{h:?}: 1-255 printable ASCII characters, no space (RFC 5424)"),
                );
            }
            let facility = s.int("facility", 0..=23, 13) as u8;
            if !tls && (ca_file.is_some() || server_name.is_some()) {
                let at = s.at("tls");
                s.problems.push(at, "ca_file and server_name need tls = true");
            }
            SinkKind::Syslog(SyslogSink {
                endpoint: endpoint?,
                tls,
                ca_file,
                server_name,
                app_name,
                hostname,
                facility,
            })
        }
        T::File => {
            let path = s.required::<PathBuf>("path", "the JSONL file the events are appended to");
            let path = match path {
                Some(p) if p.as_os_str().is_empty() || p.file_name().is_none() => {
                    let at = s.at("path");
                    s.problems.push(at, "must be a file path");
                    None
                }
                p => p,
            };
            let max_file_bytes = s.int("max_file_mb", 1..=1 << 20, 64) << 20;
            let max_files = s.count("max_files", 1..=1000, 8);
            SinkKind::File(FileSink {
                path: path?,
                max_file_bytes,
                max_files,
            })
        }
    };
    Some(SinkConfig {
        batch_max,
        batch_max_bytes,
        flush,
        timeout,
        retry_max,
        kind,
    })
}

impl AuditConfig {
    /// Makes relative paths relative to `rel`'s base.
    pub(crate) fn paths_mut(&mut self, rel: &mut dyn FnMut(&mut PathBuf)) {
        self.signing_key_file.iter_mut().for_each(&mut *rel);
        for s in self.sinks.values_mut() {
            match &mut s.kind {
                SinkKind::Otlp(o) => o.ca_file.iter_mut().for_each(&mut *rel),
                SinkKind::Syslog(o) => o.ca_file.iter_mut().for_each(&mut *rel),
                SinkKind::File(f) => rel(&mut f.path),
            }
        }
    }
}

/// Parses `k=v,k2=v2` (the form of `OTEL_EXPORTER_OTLP_HEADERS`): keys are
/// HTTP token characters, values are percent-decoded and may hold no
/// control character. At most 32 headers and 8 KiB in all.
pub fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    if text.len() > 8192 {
        return Err(format!("{} bytes: at most 8192", text.len()));
    }
    let mut out = Vec::new();
    for (i, pair) in text.split(',').enumerate() {
        if pair.trim().is_empty() {
            continue;
        }
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("entry {}: no '=' (want key=value)", i + 1))?;
        let k = k.trim();
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if k.is_empty() || !k.bytes().all(token) {
            return Err(format!("entry {}: {k:?} is not a header name", i + 1));
        }
        let v = percent_decode(v.trim()).ok_or_else(|| format!("entry {} ({k}): a bad %-escape", i + 1))?;
        if v.chars().any(|c| c.is_control()) {
            return Err(format!("entry {} ({k}): a control character in the value", i + 1));
        }
        out.push((k.to_ascii_lowercase(), v));
        if out.len() > 32 {
            return Err("more than 32 headers".into());
        }
    }
    Ok(out)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse_relative_to(text, "f.toml", std::path::Path::new("/etc/loom")).map_err(|e| e.to_string())
    }

    #[test]
    fn no_audit_table_is_no_sink_and_the_chain_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.audit, AuditConfig::default());
        assert_eq!(c.audit.checkpoint, Duration::from_secs(60));
        assert_eq!(c.audit.checkpoint_records, 10_000);
    }

    #[test]
    fn each_sink_type_reads_its_keys_with_defaults() {
        let c = parse(
            r#"
[audit]
signing_key_file = "keys/audit.key"
checkpoint_ms = 5000
checkpoint_records = 100
[audit.sinks.siem]
type = "otlp"
endpoint = "https://collector.internal/otel/"
headers_env = "LOOM_OTLP_HEADERS"
ca_file = "ca.pem"
batch_max = 100
[audit.sinks.rsys]
type = "syslog"
address = "[::1]:6514"
tls = true
app_name = "loom"
[audit.sinks.local]
type = "file"
path = "audit/events.jsonl"
max_file_mb = 2
max_files = 3
"#,
        )
        .unwrap();
        let a = &c.audit;
        assert_eq!(
            a.signing_key_file.as_deref(),
            Some(std::path::Path::new("/etc/loom/keys/audit.key"))
        );
        assert_eq!((a.checkpoint, a.checkpoint_records), (Duration::from_secs(5), 100));
        let SinkKind::Otlp(o) = &a.sinks["siem"].kind else {
            panic!()
        };
        assert!(o.https);
        assert_eq!(
            (o.endpoint.host.as_str(), o.endpoint.port),
            ("collector.internal", 4318)
        );
        assert_eq!(o.path, "/otel/v1/logs");
        assert_eq!(o.service_name, "loom-egress");
        assert_eq!(o.ca_file.as_deref(), Some(std::path::Path::new("/etc/loom/ca.pem")));
        assert_eq!(a.sinks["siem"].batch_max, 100);
        let SinkKind::Syslog(s) = &a.sinks["rsys"].kind else {
            panic!()
        };
        assert_eq!(
            (s.endpoint.host.as_str(), s.endpoint.port, s.tls, s.facility),
            ("::1", 6514, true, 13)
        );
        let SinkKind::File(f) = &a.sinks["local"].kind else {
            panic!()
        };
        assert_eq!(f.path, std::path::Path::new("/etc/loom/audit/events.jsonl"));
        assert_eq!((f.max_file_bytes, f.max_files), (2 << 20, 3));
        assert_eq!(a.sinks["local"].batch_max_bytes, 4 << 20);
    }

    #[test]
    fn bad_sinks_are_named_with_their_key_paths() {
        let e = parse(
            r#"
[audit]
checkpoint_ms = 0
signing_key_file = ""
colour = "red"
[audit.sinks.Bad]
type = "file"
path = "x"
[audit.sinks.kafka]
type = "kafka"
[audit.sinks.o1]
type = "otlp"
endpoint = "ftp://x"
[audit.sinks.o2]
type = "otlp"
endpoint = "http://u@x:4318"
headers_env = "A-B"
[audit.sinks.o3]
type = "otlp"
endpoint = "http://127.0.0.1:4318"
ca_file = "c.pem"
[audit.sinks.s1]
type = "syslog"
address = "host"
app_name = "has space"
facility = 24
[audit.sinks.s2]
type = "syslog"
[audit.sinks.f1]
type = "file"
path = "x"
max_files = 0
rotate = 1
"#,
        )
        .unwrap_err();
        for want in [
            "audit.checkpoint_ms: 0 is out of range",
            "audit.signing_key_file: must be a path",
            "audit.colour: unknown key",
            "audit.sinks.Bad: \"Bad\": a sink name",
            "audit.sinks.kafka.type: \"kafka\" is not one of",
            "audit.sinks.o1.endpoint: \"ftp://x\" is not an http",
            "audit.sinks.o2.endpoint: \"http://u@x:4318\": an endpoint has no user",
            "audit.sinks.o2.headers_env: \"A-B\" is not an environment variable name",
            "audit.sinks.o3.ca_file: is for an https:// endpoint",
            "audit.sinks.s1.address: \"host\" has no :port",
            "audit.sinks.s1.app_name: \"has space\"",
            "audit.sinks.s1.facility: 24 is out of range",
            "audit.sinks.s2.address: is required",
            "audit.sinks.f1.max_files: 0 is out of range",
            "audit.sinks.f1.rotate: unknown key",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn headers_are_read_like_otel_exporter_otlp_headers() {
        assert_eq!(
            parse_headers("api-key=abc%3D%3D, X-Scope=tenant 1,").unwrap(),
            [
                ("api-key".into(), "abc==".into()),
                ("x-scope".into(), "tenant 1".into())
            ]
        );
        assert!(parse_headers("novalue").unwrap_err().contains("no '='"));
        assert!(parse_headers("bad key=1").unwrap_err().contains("not a header name"));
        assert!(parse_headers("k=%zz").unwrap_err().contains("%-escape"));
        assert!(parse_headers("k=a%0Ab").unwrap_err().contains("control character"));
        assert!(parse_headers(&"k=v,".repeat(40)).unwrap_err().contains("32"));
        assert!(parse_headers(&"x".repeat(9000)).unwrap_err().contains("8192"));
    }
}
