//! `[tools.<id>.credentials.<name>]`: a secret the proxy injects into a
//! tool's requests to the credential's hosts, so that the tool itself only
//! ever holds a placeholder. This module reads and validates the tables
//! (hosts within the tool's egress, header name, value template, secret
//! source, placeholder variable) and loads the secret values, which only
//! the proxy does ([`crate::Config::load_secrets`]): the executor reads the
//! same file and never needs them.

use crate::allowlist::{Allowlist, Match};
use crate::executor::RESERVED_ENV;
use crate::host::{parse_authority, Host};
use crate::reader::{Problems, Section};
use crate::sign::AwsSigV4;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

pub use crate::sources::SecretSource;

/// A secret value. Its `Debug` and `Display` never show it: read it with
/// [`Secret::expose`] where it is written into a request, and nowhere else.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(Arc<str>);

impl Secret {
    pub fn new(value: &str) -> Secret {
        Secret(Arc::from(value))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `value`: literal text around `${secret}` (at least once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// The literal pieces; the secret goes between each two.
    parts: Vec<String>,
}

impl Template {
    /// Parses a template; `${secret}` is the only substitution.
    pub fn parse(s: &str) -> Result<Template, String> {
        if s.chars().any(|c| c.is_control() && c != '\t') {
            return Err("must not contain control characters".into());
        }
        let parts: Vec<String> = s.split("${secret}").map(str::to_owned).collect();
        if parts.len() < 2 {
            return Err("must contain ${secret}".into());
        }
        if parts.iter().any(|p| p.contains("${")) {
            return Err("${secret} is the only substitution".into());
        }
        Ok(Template { parts })
    }

    /// The template with `secret` substituted.
    pub fn render(&self, secret: &str) -> String {
        self.parts.join(secret)
    }

    /// The template as written.
    pub fn as_written(&self) -> String {
        self.parts.join("${secret}")
    }
}

/// `allow_plaintext`: whether the secret may go out in a plain-HTTP request
/// (one no TLS verified for the credential's host protects).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Plaintext {
    /// Only over TLS the proxy verified itself (the default): a plain-HTTP
    /// request to a credential host is `credential_requires_tls`.
    #[default]
    Never,
    /// `true`: plain HTTP too, but only to loopback addresses (checked on
    /// the addresses dialled, after DNS), so the cleartext never leaves
    /// the host. For test origins.
    Loopback,
    /// `"force"`: plain HTTP to any address. Unsafe: whoever holds or
    /// intercepts the pinned address reads the secret.
    Anywhere,
}

/// One credential of a tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// The table's key: names the credential in facts.
    pub name: Arc<str>,
    /// Where the credential may go: exact hosts and ports, each also in the
    /// tool's egress.
    pub hosts: Vec<(Host, u16)>,
    /// The header the rendered value goes in, lower-case.
    pub header: String,
    pub value: Template,
    pub source: SecretSource,
    /// The variable the child finds the placeholder in.
    pub placeholder_env: String,
    pub allow_plaintext: Plaintext,
    /// `rewrite_websocket = true`: after a WebSocket handshake to one of the
    /// credential's hosts, the proxy reads the tool's frames too: the
    /// placeholder in its text messages becomes the secret and a binary
    /// message carrying it is refused. Off: only the handshake carries the
    /// credential and the tool's frames pass untouched. Either way the
    /// origin's messages are read and scrubbed of the secret.
    pub rewrite_websocket: bool,
    /// Empty until [`crate::Config::load_secrets`] loads it (a static
    /// source) or the proxy's refresher reads or mints it (a live one).
    pub secret: Secret,
    /// Until when `secret` may be used (`None`: no limit, a static
    /// source). A live source's refresher sets it: a token's expiry, or a
    /// value's `ttl_ms` + `stale_ms`; past it, and while no value was ever
    /// read, a request needing the credential is `credential_unavailable`.
    pub usable_until: Option<SystemTime>,
    /// Values the live source had before `secret`, still valid where they
    /// were issued: scanned for and scrubbed like `secret`, never sent.
    pub previous: Vec<Secret>,
    /// `sign = { aws_sigv4 = { … } }`: the proxy re-signs the tool's
    /// requests (`secret` is the secret access key); `header` and `value`
    /// are unused.
    pub sign: Option<Arc<AwsSigV4>>,
}

impl Credential {
    /// Whether `host:port` is one of the credential's hosts.
    pub fn allows(&self, host: &Host, port: u16) -> bool {
        self.hosts.iter().any(|(h, p)| *p == port && h == host)
    }

    /// The header value: the template with the secret.
    pub fn rendered(&self) -> String {
        self.value.render(self.secret.expose())
    }

    /// Whether the secret may not be used now: a live source's value past
    /// [`Credential::usable_until`] (or never read). A static one always may.
    pub fn unavailable(&self) -> bool {
        self.usable_until.is_some_and(|t| SystemTime::now() >= t)
    }
}

/// The default `header`.
pub const DEFAULT_HEADER: &str = "Authorization";

fn valid_name(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// RFC 9110 §5.6.2 token.
fn valid_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn valid_env_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Reads `credentials` of a tool whose egress is `allowlist` and whose
/// process sets `process_env`.
pub(crate) fn credentials(
    s: &mut Section,
    allowlist: &Allowlist,
    process_env: Option<&BTreeMap<String, String>>,
) -> Vec<Credential> {
    let mut out = vec![];
    let mut t = s.table("credentials");
    let mut vars = BTreeSet::new();
    for (name, v) in t.entries() {
        let mut c = Section::new(t.at(&name), Some(v), t.problems);
        if !valid_name(&name) {
            let at = c.path().to_owned();
            c.problems
                .push(at, "credential names are 1-64 characters of a-z, 0-9, '_' and '-'");
        }
        let cred = credential(&name, &mut c, allowlist, process_env, &mut vars);
        c.finish();
        out.extend(cred);
    }
    // A request is signed once: a signing credential's hosts are its own.
    for s in out.iter().filter(|c| c.sign.is_some()) {
        for o in out.iter().filter(|o| o.name != s.name) {
            if let Some((h, p)) = s.hosts.iter().find(|(h, p)| o.allows(h, *p)) {
                let at = t.at(&s.name);
                t.problems.push(
                    at,
                    format!("{h}:{p} is also a host of credential {}: a signing credential's hosts take no other credential", o.name),
                );
            }
        }
    }
    t.finish();
    out
}

fn credential(
    name: &str,
    c: &mut Section,
    allowlist: &Allowlist,
    process_env: Option<&BTreeMap<String, String>>,
    vars: &mut BTreeSet<String>,
) -> Option<Credential> {
    let mut hosts = vec![];
    if !c.has("hosts") {
        let at = c.at("hosts");
        c.problems
            .push(at, "is required (a list of \"host:port\" the credential may go to)");
    }
    let listed: Option<Vec<(String, String)>> = c.list("hosts");
    if listed.as_ref().is_some_and(Vec::is_empty) {
        let at = c.at("hosts");
        c.problems.push(at, "must name at least one \"host:port\"");
    }
    for (at, h) in listed.unwrap_or_default() {
        match parse_authority(&h) {
            Ok((host, port)) => match allowlist.check(&host, port) {
                Match::Allowed { .. } if allowlist.relays_raw(&host, port) => c.problems.push(
                    at,
                    format!(
                        "{h} is relayed raw (an egress entry with protocol = \"tcp\"), and a credential is written \
                         only into requests the proxy sees"
                    ),
                ),
                Match::Allowed { .. } => hosts.push((host, port)),
                _ => c.problems.push(at, format!("{h} is not allowed by the tool's egress")),
            },
            Err(e) => c.problems.push(at, format!("{h:?}: {e}")),
        }
    }
    let signed = c.has("sign");
    if signed {
        for key in ["header", "value", "secret", "mint", "rewrite_websocket"] {
            if c.has(key) {
                let at = c.at(key);
                c.problems.push(
                    at,
                    "is not for a signing credential: the proxy signs each request with the keys of sign.aws_sigv4",
                );
                let _ = c.take(key);
            }
        }
    }
    let header: String = c.or("header", DEFAULT_HEADER.to_owned());
    if !valid_header_name(&header) {
        let at = c.at("header");
        c.problems.push(at, format!("{header:?} is not an HTTP header name"));
    } else if matches!(
        header.to_ascii_lowercase().as_str(),
        "host" | "proxy-authorization" | "connection" | "content-length" | "transfer-encoding"
    ) {
        let at = c.at("header");
        c.problems.push(
            at,
            format!("{header:?} is set by the proxy and cannot carry a credential"),
        );
    }
    let value = match if signed {
        Some("${secret}".to_owned())
    } else {
        c.required::<String>("value", "a template with ${secret}, e.g. \"Bearer ${secret}\"")
    } {
        Some(v) => match Template::parse(&v) {
            Ok(t) => Some(t),
            Err(e) => {
                let at = c.at("value");
                c.problems.push(at, e);
                None
            }
        },
        None => None,
    };
    let (sign, source) = if signed {
        let mut t = c.table("sign");
        let r = crate::sign::sign(&mut t);
        t.finish();
        match r {
            Some((sign, source)) => (Some(Arc::new(sign)), Some(source)),
            None => (None, None),
        }
    } else {
        (None, source(c))
    };
    let allow_plaintext = plaintext(c, &hosts);
    if signed && allow_plaintext != Plaintext::Never {
        let at = c.at("allow_plaintext");
        c.problems.push(
            at,
            "a signing credential goes only over TLS the proxy verified (the request is re-signed inside interception)",
        );
    }
    let rewrite_websocket = match c.get::<toml::Value>("rewrite_websocket") {
        None => false,
        Some(toml::Value::Boolean(b)) => b,
        Some(v) => {
            let at = c.at("rewrite_websocket");
            c.problems.push(at, format!("{v} is not true or false"));
            false
        }
    };
    let placeholder_env: Option<String> =
        c.required("placeholder_env", "the variable the child gets the placeholder in");
    // The child's variables: the placeholder's, and a signing credential's
    // placeholder secret key's.
    let secret_env = sign.as_ref().map(|s| s.secret_env.clone());
    let named = [
        (c.at("placeholder_env"), placeholder_env.clone()),
        (format!("{}.sign.aws_sigv4.secret_env", c.path()), secret_env),
    ];
    for (at, v) in named {
        let Some(v) = v else { continue };
        let problem = if !valid_env_name(&v) {
            format!("{v:?} is not a variable name")
        } else if RESERVED_ENV.contains(&v.as_str()) {
            format!("{v} is set by the executor")
        } else if process_env.is_some_and(|e| e.contains_key(&v)) {
            format!("{v} is also set in the tool's process.env")
        } else if !vars.insert(v.clone()) {
            format!("{v} is the placeholder of another credential of the tool, or its own secret_env")
        } else {
            continue;
        };
        c.problems.push(at, problem);
    }
    Some(Credential {
        name: Arc::from(name),
        hosts,
        header: header.to_ascii_lowercase(),
        value: value?,
        source: source?,
        placeholder_env: placeholder_env?,
        allow_plaintext,
        rewrite_websocket,
        secret: Secret::default(),
        usable_until: None,
        previous: vec![],
        sign,
    })
}

/// `allow_plaintext = false | true | "force"`. `true` is refused for a host
/// that is an address outside loopback: cleartext could only go there.
fn plaintext(c: &mut Section, hosts: &[(Host, u16)]) -> Plaintext {
    let at = c.at("allow_plaintext");
    let p = match c.get::<toml::Value>("allow_plaintext") {
        None | Some(toml::Value::Boolean(false)) => Plaintext::Never,
        Some(toml::Value::Boolean(true)) => Plaintext::Loopback,
        Some(toml::Value::String(s)) if s == "force" => Plaintext::Anywhere,
        Some(v) => {
            c.problems.push(at, format!("{v} is not one of false, true, \"force\""));
            return Plaintext::Never;
        }
    };
    if p == Plaintext::Loopback {
        for (h, port) in hosts {
            if let Host::Ip(ip) = h {
                if !ip.to_canonical().is_loopback() {
                    c.problems.push(
                        &at,
                        format!(
                            "{h}:{port} is not a loopback address, and `true` sends the secret in cleartext only to loopback; \
                             \"force\" sends it anywhere (unsafe)"
                        ),
                    );
                }
            }
        }
    }
    p
}

/// `secret = { … }` (env, file, command) or `mint = { … }` (a token the
/// proxy mints): exactly one.
fn source(c: &mut Section) -> Option<SecretSource> {
    match (c.has("secret"), c.has("mint")) {
        (true, false) => {
            let mut t = c.table("secret");
            let r = crate::sources::secret(&mut t);
            t.finish();
            r
        }
        (false, true) => {
            let mut t = c.table("mint");
            let r = crate::sources::mint(&mut t);
            t.finish();
            r
        }
        (true, true) => {
            let at = c.path().to_owned();
            c.problems.push(
                at,
                "has both secret and mint: a credential's value comes from one of them",
            );
            let _ = c.take("secret");
            let _ = c.take("mint");
            None
        }
        (false, false) => {
            let _ = c.required::<toml::Value>(
                "secret",
                "{ env = \"NAME\" }, { file = \"path\" }, { command = [\"program\"] }, or mint = { … } instead",
            );
            None
        }
    }
}

/// The text of `path`, which must be mode 0600 or stricter (`what` names
/// the file in the message when it is not).
pub fn read_private(path: &std::path::Path, what: &str) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} is mode {mode:04o}: {what} must be 0600 or stricter",
            path.display()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Loads every secret of `tools`, reporting each one that cannot be loaded.
pub(crate) fn load_all<'a>(tools: impl Iterator<Item = (&'a str, &'a mut Vec<Credential>)>, problems: &mut Problems) {
    for (id, creds) in tools {
        for c in creds.iter_mut() {
            if let Some(sign) = &mut c.sign {
                if let Err(e) = Arc::make_mut(sign).load() {
                    problems.push(format!("tools.{id}.credentials.{}.sign.aws_sigv4", c.name), e);
                }
            }
            // A live source's value is its refresher's.
            if matches!(c.source, SecretSource::Live(_)) {
                continue;
            }
            match crate::sources::read_simple(&c.source) {
                Some(Ok(s)) => c.secret = s,
                Some(Err(e)) => problems.push(format!("tools.{id}.credentials.{}.secret", c.name), e),
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "Secret(<redacted>) <redacted>");
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn templates_have_one_substitution() {
        let t = Template::parse("Bearer ${secret}").unwrap();
        assert_eq!(t.render("x"), "Bearer x");
        assert_eq!(t.as_written(), "Bearer ${secret}");
        assert!(Template::parse("Bearer").is_err());
        assert!(Template::parse("${secret} ${other}").is_err());
        assert!(Template::parse("a\r\n${secret}").is_err());
    }

    const TOOL: &str = r#"
[tools.weather]
egress = ["api.weather.example:443", "tiles.example:80"]
[tools.weather.credentials.api]
hosts = ["api.weather.example:443"]
value = "Bearer ${secret}"
secret = { file = "secrets/weather.token" }
placeholder_env = "WEATHER_API_TOKEN"
[tools.weather.credentials.tiles]
hosts = ["tiles.example:80"]
header = "X-Api-Key"
value = "${secret}"
secret = { env = "CARGO_MANIFEST_DIR" }
placeholder_env = "TILES_KEY"
"#;

    #[test]
    fn reads_a_tool_s_credentials() {
        let c = crate::Config::parse_relative_to(TOOL, "c.toml", std::path::Path::new("/etc/loom")).unwrap();
        let t = c.policy.tool("weather").unwrap();
        let api = &t.credentials[0];
        assert_eq!(&*api.name, "api");
        assert_eq!(api.header, "authorization");
        assert_eq!(api.source, SecretSource::File("/etc/loom/secrets/weather.token".into()));
        assert!(api.allows(&Host::Name("api.weather.example".into()), 443));
        assert!(!api.allows(&Host::Name("api.weather.example".into()), 80));
        assert!(api.secret.is_empty(), "parsing loads no secret");
        assert_eq!(t.credentials[1].header, "x-api-key");
        // The digest names the rule, not the secret source's value.
        let other = TOOL.replace("X-Api-Key", "X-Key");
        let d = crate::Config::parse(&other, "c.toml").unwrap().policy.digest.clone();
        assert_ne!(d, c.policy.digest);
    }

    #[test]
    fn every_credential_problem_is_reported_at_once() {
        let e = crate::Config::parse(
            r#"
[tools.t]
egress = ["a.example:443"]
[tools.t.process]
command = ["x"]
env = { TAKEN = "1" }
[tools.t.credentials.one]
hosts = ["b.example:443", "a.example"]
header = "Bad Header"
value = "Bearer"
secret = { env = "A", file = "b" }
placeholder_env = "HTTP_PROXY"
[tools.t.credentials.two]
value = "${secret} ${other}"
placeholder_env = "TAKEN"
extra = 1
[tools.t.credentials.Three]
hosts = ["a.example:443"]
value = "${secret}"
secret = { file = "f" }
placeholder_env = "P"
[tools.t.credentials.four]
hosts = ["a.example:443"]
value = "${secret}"
secret = { env = "B" }
placeholder_env = "P"
"#,
            "bad.toml",
        )
        .unwrap_err()
        .to_string();
        for want in [
            "tools.t.credentials.one.hosts[0]: b.example:443 is not allowed by the tool's egress",
            "tools.t.credentials.one.hosts[1]: \"a.example\": missing port",
            "tools.t.credentials.one.header: \"Bad Header\" is not an HTTP header name",
            "tools.t.credentials.one.value: must contain ${secret}",
            "tools.t.credentials.one.secret: must be exactly one of",
            "tools.t.credentials.one.placeholder_env: HTTP_PROXY is set by the executor",
            "tools.t.credentials.two.hosts: is required",
            "tools.t.credentials.two.value: ${secret} is the only substitution",
            "tools.t.credentials.two.secret: is required",
            "tools.t.credentials.two.placeholder_env: TAKEN is also set in the tool's process.env",
            "tools.t.credentials.two.extra: unknown key",
            "tools.t.credentials.Three: credential names are",
            "tools.t.credentials.four.placeholder_env: P is the placeholder of another credential",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn signing_credentials_are_read_and_every_problem_reported() {
        let c = crate::Config::parse(
            r#"
[tools.t]
egress = ["s3.example:443"]
[tools.t.credentials.aws]
hosts = ["s3.example:443"]
placeholder_env = "AWS_ACCESS_KEY_ID"
sign = { aws_sigv4 = { service = "s3", region = "eu-west-1", access_key_id = { env = "AK" }, secret_access_key = { file = "sk" } } }
"#,
            "t.toml",
        )
        .unwrap();
        let cred = &c.policy.tool("t").unwrap().credentials[0];
        let sign = cred.sign.as_deref().unwrap();
        assert_eq!((sign.service.as_str(), sign.region.as_str()), ("s3", "eu-west-1"));
        assert_eq!(sign.secret_env, crate::sign::DEFAULT_SECRET_ENV);
        assert_eq!(sign.max_body_bytes, crate::sign::DEFAULT_MAX_BODY_BYTES);
        assert_eq!(sign.access_key_id, Some(SecretSource::Env("AK".into())));
        assert!(sign.session_token.is_none());
        assert_eq!(cred.source, SecretSource::File("sk".into()));

        let c = crate::Config::parse(
            r#"
[tools.t]
egress = ["s3.example:443"]
[tools.t.credentials.aws]
hosts = ["s3.example:443"]
placeholder_env = "AWS_ACCESS_KEY_ID"
sign = { aws_sigv4 = { service = "s3", region = "eu-west-1", assume_role = { role_arn = "arn:aws:iam::123456789012:role/r", region = "eu-west-1", external_id = "x-42" } } }
"#,
            "t.toml",
        )
        .unwrap();
        let cred = &c.policy.tool("t").unwrap().credentials[0];
        assert!(cred.sign.as_deref().unwrap().access_key_id.is_none());
        let SecretSource::Live(l) = &cred.source else {
            panic!("{:?}", cred.source)
        };
        let crate::sources::LiveKind::AwsAssumeRole(a) = &l.kind else {
            panic!("{:?}", l.kind)
        };
        assert_eq!(a.endpoint.text, "https://sts.eu-west-1.amazonaws.com/");
        assert_eq!((a.duration_s, a.session_name.as_str()), (3600, "loom-egress"));
        assert_eq!(a.external_id.as_deref(), Some("x-42"));
        assert_eq!(
            l.refresh.refresh_before,
            crate::sources::DEFAULT_ASSUME_ROLE_REFRESH_BEFORE
        );

        let e = crate::Config::parse(
            r#"
[tools.t]
egress = ["s3.example:443", "b.example:443", "c.example:80", "d.example:443", "e.example:443"]
[tools.t.process]
command = ["x"]
env = { TAKEN = "1" }
[tools.t.credentials.one]
hosts = ["s3.example:443"]
placeholder_env = "AK1"
value = "${secret}"
allow_plaintext = true
sign = { aws_sigv4 = { service = "s 3", region = "", access_key_id = { command = ["x"] }, secret_access_key = { env = "S" }, max_body_bytes = 1 } }
[tools.t.credentials.two]
hosts = ["d.example:443"]
value = "${secret}"
secret = { env = "X" }
placeholder_env = "P2"
[tools.t.credentials.three]
hosts = ["b.example:443"]
placeholder_env = "AK3"
sign = { aws_sigv4 = { service = "s3", region = "us-east-1" } }
[tools.t.credentials.six]
hosts = ["e.example:443"]
placeholder_env = "AK6"
sign = { aws_sigv4 = { service = "s3", region = "us-east-1", access_key_id = { env = "A" }, assume_role = { role_arn = "role", duration_s = 60, session_name = "a b", endpoint = "http://10.0.0.1/" } } }
[tools.t.credentials.five]
hosts = ["d.example:443"]
placeholder_env = "AK5"
sign = { aws_sigv4 = { service = "s3", region = "us-east-1", access_key_id = { env = "A" }, secret_access_key = { env = "S" }, secret_env = "TAKEN" } }
[tools.t.credentials.four]
hosts = ["c.example:80"]
placeholder_env = "AK4"
sign = { hmac = {} }
"#,
            "bad.toml",
        )
        .unwrap_err()
        .to_string();
        for want in [
            "tools.t.credentials.one.value: is not for a signing credential",
            "tools.t.credentials.one.allow_plaintext: a signing credential goes only over TLS",
            "tools.t.credentials.one.sign.aws_sigv4.service: \"s 3\" is not 1-64 letters",
            "tools.t.credentials.one.sign.aws_sigv4.region: \"\" is not 1-64 letters",
            "tools.t.credentials.one.sign.aws_sigv4.access_key_id: is read with the secret key",
            "tools.t.credentials.one.sign.aws_sigv4.max_body_bytes: must be between 1024 and",
            "tools.t.credentials.five: d.example:443 is also a host of credential two",
            "tools.t.credentials.three.sign.aws_sigv4.access_key_id: is required",
            "tools.t.credentials.three.sign.aws_sigv4.secret_access_key: is required",
            "tools.t.credentials.five.sign.aws_sigv4.secret_env: TAKEN is also set in the tool's process.env",
            "tools.t.credentials.four.sign: must be { aws_sigv4 = {",
            "tools.t.credentials.six.sign.aws_sigv4.access_key_id: is not for keys from assume_role",
            "tools.t.credentials.six.sign.aws_sigv4.assume_role.role_arn: must be an ARN",
            "tools.t.credentials.six.sign.aws_sigv4.assume_role.region: is required",
            "tools.t.credentials.six.sign.aws_sigv4.assume_role.duration_s: must be between 900 and 43200",
            "tools.t.credentials.six.sign.aws_sigv4.assume_role.session_name: must be 1-64 characters",
            "tools.t.credentials.six.sign.aws_sigv4.assume_role.endpoint: http://10.0.0.1/ is plain HTTP",
        ] {
            assert!(e.contains(want), "missing {want:?} in:\n{e}");
        }
    }

    #[test]
    fn cleartext_is_opted_into_per_credential_and_never_for_an_address_off_loopback() {
        let text = |hosts: &str, plaintext: &str| {
            format!(
                "[tools.t]\negress = [\"a.example:80\", \"127.0.0.2:80\", \"10.0.0.1:80\", \"[::1]:80\"]\n\
                 [tools.t.credentials.c]\nhosts = {hosts}\nvalue = \"${{secret}}\"\nsecret = {{ env = \"X\" }}\n\
                 placeholder_env = \"C\"\n{plaintext}"
            )
        };
        let plaintext = |hosts: &str, line: &str| -> Result<Plaintext, String> {
            crate::Config::parse(&text(hosts, line), "c.toml")
                .map(|c| c.policy.tool("t").unwrap().credentials[0].allow_plaintext)
                .map_err(|e| e.to_string())
        };
        let names = "[\"a.example:80\", \"127.0.0.2:80\", \"[::1]:80\"]";
        assert_eq!(plaintext(names, ""), Ok(Plaintext::Never));
        assert_eq!(plaintext(names, "allow_plaintext = false"), Ok(Plaintext::Never));
        assert_eq!(plaintext(names, "allow_plaintext = true"), Ok(Plaintext::Loopback));
        let e = plaintext("[\"10.0.0.1:80\"]", "allow_plaintext = true").unwrap_err();
        assert!(
            e.contains("c.toml: tools.t.credentials.c.allow_plaintext: 10.0.0.1:80 is not a loopback address"),
            "{e}"
        );
        assert_eq!(
            plaintext("[\"10.0.0.1:80\"]", "allow_plaintext = \"force\""),
            Ok(Plaintext::Anywhere)
        );
        let e = plaintext(names, "allow_plaintext = \"yes\"").unwrap_err();
        assert!(
            e.contains("allow_plaintext: \"yes\" is not one of false, true, \"force\""),
            "{e}"
        );
        // The choice is part of the policy's digest.
        let digest = |line: &str| {
            crate::Config::parse(&text(names, line), "c")
                .unwrap()
                .policy
                .digest
                .clone()
        };
        assert_ne!(digest(""), digest("allow_plaintext = true"));
    }

    #[test]
    fn rewrite_websocket_is_a_boolean_off_by_default_and_policy() {
        let text = |line: &str| {
            format!(
                "[tools.t]\negress = [\"a.example:443\"]\n[tools.t.credentials.c]\nhosts = [\"a.example:443\"]\n\
                 value = \"${{secret}}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"C\"\n{line}"
            )
        };
        let parse = |line: &str| crate::Config::parse(&text(line), "c.toml").map_err(|e| e.to_string());
        let cred = |line: &str| parse(line).unwrap().policy.tool("t").unwrap().credentials[0].rewrite_websocket;
        assert!(!cred(""));
        assert!(!cred("rewrite_websocket = false"));
        assert!(cred("rewrite_websocket = true"));
        let e = parse("rewrite_websocket = \"yes\"").unwrap_err();
        assert!(
            e.contains("c.toml: tools.t.credentials.c.rewrite_websocket: \"yes\" is not true or false"),
            "{e}"
        );
        let digest = |line: &str| parse(line).unwrap().policy.digest.clone();
        assert_eq!(digest(""), digest("rewrite_websocket = false"));
        assert_ne!(digest(""), digest("rewrite_websocket = true"));
    }

    fn secret_file(dir: &std::path::Path, mode: u32, text: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("token");
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn secrets_load_from_a_private_file_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        secret_file(dir.path(), 0o600, "s3cret-value\n");
        let mut c =
            crate::Config::parse_relative_to(&TOOL.replace("secrets/weather.token", "token"), "c.toml", dir.path())
                .unwrap();
        c.load_secrets().unwrap();
        let t = c.policy.tool("weather").unwrap();
        assert_eq!(t.credentials[0].secret.expose(), "s3cret-value");
        assert_eq!(t.credentials[0].rendered(), "Bearer s3cret-value");
        assert_eq!(t.credentials[1].secret.expose(), env!("CARGO_MANIFEST_DIR"));
        assert!(
            !format!("{c:?}").contains("s3cret-value"),
            "Debug of the config shows no secret"
        );
    }

    #[test]
    fn a_readable_secret_file_or_a_missing_variable_is_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        secret_file(dir.path(), 0o644, "s3cret-value");
        let text = TOOL
            .replace("secrets/weather.token", "token")
            .replace("CARGO_MANIFEST_DIR", "LOOM_TEST_UNSET_VARIABLE");
        let mut c = crate::Config::parse_relative_to(&text, "c.toml", dir.path()).unwrap();
        let e = c.load_secrets().unwrap_err().to_string();
        assert!(
            e.contains("c.toml: tools.weather.credentials.api.secret:")
                && e.contains("is mode 0644: a secret file must be 0600 or stricter"),
            "{e}"
        );
        assert!(
            e.contains(
                "tools.weather.credentials.tiles.secret: environment variable LOOM_TEST_UNSET_VARIABLE is not set"
            ),
            "{e}"
        );
        assert!(!e.contains("s3cret-value"));
    }
}
