//! `[cell]` and `[export]`: what makes one proxy + executor a cell of a
//! fleet. A cell has an id (environment `EGRESS_CELL_ID` wins over the file,
//! the host name is the default) and the URLs other cells and kernels reach
//! it at (`EGRESS_ADVERTISE_PROXY`, `_CONTROL`, `_EXECUTOR` win). `[export]`
//! says where the cell's denial facts are copied to; the DSN comes only from
//! the environment variable it names, never from the file.

use crate::reader::{Problems, Section};
use std::time::Duration;

/// The environment variables that win over `[cell]`'s keys.
pub const ENV_CELL_ID: &str = "EGRESS_CELL_ID";
pub const ENV_ADVERTISE_PROXY: &str = "EGRESS_ADVERTISE_PROXY";
pub const ENV_ADVERTISE_CONTROL: &str = "EGRESS_ADVERTISE_CONTROL";
pub const ENV_ADVERTISE_EXECUTOR: &str = "EGRESS_ADVERTISE_EXECUTOR";

/// The longest advertised URL.
const MAX_URL: usize = 512;

/// `[cell]`, resolved: the file's values with the environment's over them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellConfig {
    /// 1-63 of `a-z 0-9 - .`, starting with a letter or digit: it becomes a
    /// metric label, a PostgreSQL key and an advisory lock's name.
    pub id: String,
    /// The proxy URL a run's `proxy_url` and env carry (`None`: today's,
    /// built from `proxy.listen`).
    pub advertise_proxy: Option<String>,
    /// Where kernels reach this cell's proxy control API.
    pub advertise_control: Option<String>,
    /// Where kernels reach this cell's executor.
    pub advertise_executor: Option<String>,
}

/// Where denial facts are exported to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    None,
    Postgres,
}

/// `[export]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    pub sink: Sink,
    /// The environment variable holding the DSN.
    pub dsn_env: String,
    /// Facts per transaction.
    pub batch_max: usize,
    /// How often the exporter looks for new facts when idle.
    pub flush: Duration,
    /// Unexported facts beyond which `/readyz` answers 503 `export_lag`.
    pub max_lag: u64,
    /// The PostgreSQL schema of `egress_facts`.
    pub schema: String,
    /// How long a stopping proxy keeps exporting after its drain.
    pub flush_timeout: Duration,
}

impl Default for ExportConfig {
    fn default() -> Self {
        ExportConfig {
            sink: Sink::None,
            dsn_env: "EGRESS_EXPORT_DSN".into(),
            batch_max: 500,
            flush: Duration::from_millis(200),
            max_lag: 10_000,
            schema: "public".into(),
            flush_timeout: Duration::from_secs(10),
        }
    }
}

/// Whether `id` is a usable cell id.
pub fn valid_cell_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Why `url` cannot be advertised, if it cannot.
fn url_problem(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
    let Some(rest) = rest else {
        return Some(format!("{url:?} is not an http:// or https:// URL"));
    };
    if url.len() > MAX_URL {
        return Some(format!("is longer than {MAX_URL} bytes"));
    }
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty()
        || authority.contains(['/', '?', '#', '@'])
        || authority.bytes().any(|b| b.is_ascii_control() || b == b' ')
    {
        return Some(format!(
            "{url:?} must be scheme://host:port, with no path, query or user"
        ));
    }
    None
}

/// Reads `[cell]` (when present), with `env` over the file's values; `host`
/// names the machine when no id is given.
pub(crate) fn cell(
    s: Option<Section>,
    env: &dyn Fn(&str) -> Option<String>,
    host: &dyn Fn() -> Option<String>,
) -> Option<CellConfig> {
    let mut s = s?;
    let pick = |s: &mut Section, key: &'static str, var: &str| -> Option<(String, String)> {
        let file: Option<String> = s.get(key);
        match env(var).filter(|v| !v.is_empty()) {
            Some(v) => Some((format!("{var} (environment)"), v)),
            None => file.map(|v| (s.at(key), v)),
        }
    };
    let id = pick(&mut s, "id", ENV_CELL_ID);
    let id = match id {
        Some((at, id)) => {
            if !valid_cell_id(&id) {
                s.problems.push(
                    at,
                    format!("{id:?}: a cell id is 1-63 characters of a-z, 0-9, '-' and '.', starting with a letter or digit"),
                );
            }
            id
        }
        None => {
            match host().map(|h| h.trim().to_ascii_lowercase()) {
                Some(h) if valid_cell_id(&h) => h,
                other => {
                    let at = s.at("id");
                    s.problems.push(
                    at,
                    format!("is not set and the host name {other:?} is not a usable cell id (set cell.id or {ENV_CELL_ID})"),
                );
                    String::new()
                }
            }
        }
    };
    let url = |s: &mut Section, key: &'static str, var: &str| -> Option<String> {
        let (at, v) = pick(s, key, var)?;
        if let Some(problem) = url_problem(&v) {
            s.problems.push(at, problem);
            return None;
        }
        Some(v.trim_end_matches('/').to_owned())
    };
    let advertise_proxy = url(&mut s, "advertise_proxy", ENV_ADVERTISE_PROXY);
    let advertise_control = url(&mut s, "advertise_control", ENV_ADVERTISE_CONTROL);
    let advertise_executor = url(&mut s, "advertise_executor", ENV_ADVERTISE_EXECUTOR);
    s.finish();
    Some(CellConfig {
        id,
        advertise_proxy,
        advertise_control,
        advertise_executor,
    })
}

/// Reads `[export]`.
pub(crate) fn export(s: &mut Section) -> ExportConfig {
    let d = ExportConfig::default();
    let sink = s.choice("sink", &[("none", Sink::None), ("postgres", Sink::Postgres)], d.sink);
    let dsn_env: String = s.or("dsn_env", d.dsn_env);
    if dsn_env.is_empty() || !dsn_env.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        let at = s.at("dsn_env");
        s.problems
            .push(at, format!("{dsn_env:?} is not an environment variable name"));
    }
    let schema: String = s.or("schema", d.schema);
    let ident = !schema.is_empty()
        && schema.len() <= 63
        && !schema.as_bytes()[0].is_ascii_digit()
        && schema
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ident {
        let at = s.at("schema");
        s.problems.push(
            at,
            format!("{schema:?}: a schema name is 1-63 characters of a-z, 0-9 and '_', not starting with a digit"),
        );
    }
    ExportConfig {
        sink,
        dsn_env,
        batch_max: s.count("batch_max", 1..=10_000, d.batch_max),
        flush: s.millis("flush_ms", 10..=60_000, d.flush),
        max_lag: s.int("max_lag", 1..=1_000_000_000, d.max_lag),
        schema,
        flush_timeout: s.millis("flush_timeout_ms", 0..=3_600_000, d.flush_timeout),
    }
}

/// The machine's host name (Linux), for a cell without an id.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}

/// Checks `problems` on a fleet config as a whole: exporting needs a cell.
pub(crate) fn check(cell: Option<&CellConfig>, export: &ExportConfig, problems: &mut Problems) {
    if export.sink == Sink::Postgres && cell.is_none() {
        problems.push(
            "export.sink",
            "\"postgres\" needs a [cell] table (facts are exported under the cell's id)",
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    fn parse(text: &str, env: &[(&str, &str)], host: Option<&str>) -> Result<Config, String> {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let get = move |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let host = host.map(str::to_owned);
        Config::parse_with_env(text, "f.toml", std::path::Path::new(""), &get, &move || host.clone())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn no_cell_table_is_no_cell_whatever_the_environment() {
        let c = parse("", &[("EGRESS_CELL_ID", "cell-a")], Some("h")).unwrap();
        assert_eq!(c.cell, None);
        assert_eq!(c.export, super::ExportConfig::default());
    }

    #[test]
    fn the_environment_wins_and_the_host_name_is_the_default() {
        let text = "[cell]\nid = \"cell-f\"\nadvertise_proxy = \"http://cell-f.svc:3128/\"\nadvertise_control = \"http://cell-f.svc:3129\"\n";
        let c = parse(text, &[], Some("host-1")).unwrap().cell.unwrap();
        assert_eq!(c.id, "cell-f");
        assert_eq!(c.advertise_proxy.as_deref(), Some("http://cell-f.svc:3128"));
        assert_eq!(c.advertise_executor, None);
        let c = parse(
            text,
            &[
                ("EGRESS_CELL_ID", "cell-e"),
                ("EGRESS_ADVERTISE_EXECUTOR", "https://e:3130"),
            ],
            Some("host-1"),
        )
        .unwrap()
        .cell
        .unwrap();
        assert_eq!(c.id, "cell-e");
        assert_eq!(c.advertise_executor.as_deref(), Some("https://e:3130"));
        let c = parse("[cell]\n", &[], Some("Host-1\n")).unwrap().cell.unwrap();
        assert_eq!(c.id, "host-1");
    }

    #[test]
    fn bad_ids_urls_and_export_keys_are_named() {
        let e = parse(
            "[cell]\nid = \"Cell A\"\nadvertise_proxy = \"cell-a:3128\"\nadvertise_control = \"http://a:1/x\"\nport = 1\n\
             [export]\nsink = \"kafka\"\nschema = \"Public\"\nbatch_max = 0\ndsn = \"postgres://x\"\n",
            &[("EGRESS_ADVERTISE_EXECUTOR", "ftp://x")],
            None,
        )
        .unwrap_err();
        for want in [
            "f.toml: cell.id: \"Cell A\": a cell id",
            "cell.advertise_proxy: \"cell-a:3128\" is not an http",
            "cell.advertise_control: \"http://a:1/x\" must be scheme://host:port",
            "EGRESS_ADVERTISE_EXECUTOR (environment): \"ftp://x\"",
            "cell.port: unknown key",
            "export.sink: \"kafka\" is not one of \"none\", \"postgres\"",
            "export.schema: \"Public\"",
            "export.batch_max: 0 is out of range",
            "export.dsn: unknown key",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
        let e = parse("[cell]\n", &[], None).unwrap_err();
        assert!(e.contains("cell.id: is not set"), "{e}");
        let e = parse("[export]\nsink = \"postgres\"\n", &[], Some("h")).unwrap_err();
        assert!(e.contains("export.sink: \"postgres\" needs a [cell] table"), "{e}");
        let c = parse(
            "[cell]\nid = \"a\"\n[export]\nsink = \"postgres\"\nmax_lag = 5\nschema = \"fleet_1\"\n",
            &[],
            None,
        )
        .unwrap();
        assert_eq!(c.export.sink, super::Sink::Postgres);
        assert_eq!((c.export.max_lag, c.export.schema.as_str()), (5, "fleet_1"));
    }
}
