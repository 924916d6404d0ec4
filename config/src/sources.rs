//! Where a credential's secret comes from (`secret = { … }`, or `mint =
//! { … }` for a token the proxy mints itself), and how long a value is good
//! for. Static sources (an environment variable, a file without `ttl_ms`)
//! are read at start and on reload ([`crate::Config::load_secrets`]). Live
//! sources (a file with `ttl_ms`, a command, an OAuth2 token) are read by
//! the proxy's refreshers, which keep each value fresh and put it into the
//! policy in force; this module only describes them and reads one value
//! of the kinds that need no network ([`read_simple`]).

use crate::credentials::{read_private, Secret};
use crate::host::{parse_authority, Host};
use crate::reader::Section;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where a secret comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// An environment variable of the proxy.
    Env(String),
    /// A file of mode 0600 or stricter (one trailing newline is dropped),
    /// read at start and on reload.
    File(PathBuf),
    /// A value the proxy keeps fresh itself.
    Live(Arc<LiveSource>),
}

impl SecretSource {
    /// What kind of source it is, for the run view, `check` and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            SecretSource::Env(_) => "env",
            SecretSource::File(_) => "file",
            SecretSource::Live(l) => l.kind.name(),
        }
    }

    /// Every file path it names (to resolve against the config's directory).
    pub(crate) fn paths_mut(&mut self, f: &mut dyn FnMut(&mut PathBuf)) {
        match self {
            SecretSource::Env(_) => {}
            SecretSource::File(p) => f(p),
            SecretSource::Live(l) => match &mut Arc::make_mut(l).kind {
                LiveKind::File(p) => f(p),
                LiveKind::Command(c) => {
                    // A program named with a relative path (`bin/token`) is
                    // the config's; a bare name is looked up on PATH.
                    if c.argv[0].contains('/') {
                        let mut p = PathBuf::from(&c.argv[0]);
                        f(&mut p);
                        c.argv[0] = p.to_string_lossy().into_owned();
                    }
                }
                LiveKind::AwsSecretsManager(_) | LiveKind::AwsAssumeRole(_) => {}
                LiveKind::OAuth2(o) => {
                    if let Some(s) = &mut o.client_secret {
                        s.paths_mut(f);
                    }
                    if let Grant::RefreshToken { refresh_token } = &mut o.grant {
                        refresh_token.paths_mut(f);
                    }
                }
            },
        }
    }
}

/// A source the proxy keeps fresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSource {
    pub kind: LiveKind,
    pub refresh: Refresh,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LiveKind {
    /// `secret = { file, ttl_ms }`: the file, re-read every `ttl_ms`.
    File(PathBuf),
    /// `secret = { command = [...] }`: the command's output.
    Command(CommandSource),
    /// `mint = { oauth2_… }`: an access token from a token endpoint.
    OAuth2(OAuth2),
    /// `secret = { aws_secrets_manager = { … } }`: a secret's current value
    /// from AWS Secrets Manager.
    AwsSecretsManager(AwsSecret),
    /// `sign = { aws_sigv4 = { assume_role = { … } } }`: temporary keys from
    /// STS `AssumeRole`; the value is the secret access key, the key id
    /// and session token come with it.
    AwsAssumeRole(AssumeRole),
}

impl LiveKind {
    pub fn name(&self) -> &'static str {
        match self {
            LiveKind::File(_) => "file",
            LiveKind::Command(_) => "command",
            LiveKind::OAuth2(o) => match o.grant {
                Grant::ClientCredentials => "oauth2_client_credentials",
                Grant::RefreshToken { .. } => "oauth2_refresh_token",
            },
            LiveKind::AwsSecretsManager(_) => "aws_secrets_manager",
            LiveKind::AwsAssumeRole(_) => "aws_sts_assume_role",
        }
    }
}

/// When a live value is read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refresh {
    /// `ttl_ms`: a value without its own expiry is read again after this.
    pub ttl: Duration,
    /// `failure_ttl_ms`: after a failed read, the next try comes this much
    /// later (sooner when the value in hand expires before).
    pub failure_ttl: Duration,
    /// `stale_ms`: a value without its own expiry is served this long past
    /// its `ttl_ms` while reads fail; then requests needing it fail closed
    /// (`credential_unavailable`). A value with an expiry is never served
    /// past it.
    pub stale: Duration,
    /// `refresh_before_ms`: a value with an expiry is read again this long
    /// before it (at most half its lifetime before).
    pub refresh_before: Duration,
}

pub const DEFAULT_FAILURE_TTL: Duration = Duration::from_secs(60);
pub const DEFAULT_STALE: Duration = Duration::from_secs(300);
pub const DEFAULT_REFRESH_BEFORE: Duration = Duration::from_secs(60);
/// `ttl_ms` of a command and of a token answered without `expires_in`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(300);
/// A command's `timeout_ms` and a token request's `timeout_ms`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// A command's `max_bytes`: what it may print.
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024;
/// The longest a value may be (a token, a command's value).
pub const MAX_VALUE_BYTES: usize = 16 * 1024;

/// `secret = { command = ["argv", …] }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandSource {
    pub argv: Vec<String>,
    pub timeout: Duration,
    /// What it may print; more is an error (the command is killed).
    pub max_bytes: usize,
    /// The proxy's environment variables it gets (and no other).
    pub env_pass: Vec<String>,
}

/// `aws_secrets_manager = { secret_id, region, json_key?, endpoint? }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsSecret {
    /// The secret's name or ARN.
    pub secret_id: String,
    pub region: String,
    /// The member of a JSON `SecretString` that is the value (without it:
    /// the whole string).
    pub json_key: Option<String>,
    /// `https://secretsmanager.<region>.amazonaws.com/`, or the operator's
    /// (a VPC endpoint; `http://` only to loopback with `allow_plaintext`).
    pub endpoint: TokenUrl,
    pub timeout: Duration,
}

/// `assume_role = { role_arn, … }`: STS `AssumeRole` with the proxy's own
/// AWS keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssumeRole {
    pub role_arn: String,
    /// `RoleSessionName` (default `loom-egress`).
    pub session_name: String,
    /// `DurationSeconds` (900 – 43200; default 3600).
    pub duration_s: u32,
    pub external_id: Option<String>,
    /// The region of the STS endpoint signed for.
    pub region: String,
    /// `https://sts.<region>.amazonaws.com/`, or the operator's.
    pub endpoint: TokenUrl,
    pub timeout: Duration,
}

/// A token endpoint and how to ask it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OAuth2 {
    pub grant: Grant,
    pub token_url: TokenUrl,
    pub client_id: String,
    /// Sent with HTTP Basic (`client_secret_basic`); without it the client
    /// is public and `client_id` goes in the form.
    pub client_secret: Option<Box<SecretSource>>,
    pub scope: Option<String>,
    pub audience: Option<String>,
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// RFC 6749 §4.4.
    ClientCredentials,
    /// RFC 6749 §6: the refresh token's source. A rotated refresh token is
    /// kept in memory and written back to a `file` source.
    RefreshToken { refresh_token: Box<SecretSource> },
}

/// `token_url`, fixed by the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenUrl {
    /// `false`: `http://`, allowed only to loopback addresses with
    /// `allow_plaintext = true`.
    pub https: bool,
    pub host: Host,
    pub port: u16,
    /// The path and query, `/` at least.
    pub path: String,
    /// As written, for messages.
    pub text: String,
}

/// Checks a value read from anywhere: not empty, within
/// [`MAX_VALUE_BYTES`], and no control character (CR, LF, NUL and the
/// rest: it goes into a header).
pub fn check_value(raw: &str) -> Result<Secret, String> {
    if raw.is_empty() {
        return Err("the secret is empty".into());
    }
    if raw.len() > MAX_VALUE_BYTES {
        return Err(format!("the secret is longer than {MAX_VALUE_BYTES} bytes"));
    }
    if raw.chars().any(|c| c.is_control()) {
        return Err("the secret contains control characters (CR, LF, NUL or another)".into());
    }
    Ok(Secret::new(raw))
}

/// `s` without one trailing newline (LF or CRLF).
pub fn chomp(mut s: String) -> String {
    if s.ends_with('\n') {
        s.pop();
        if s.ends_with('\r') {
            s.pop();
        }
    }
    s
}

/// A private file's value.
pub fn read_file(path: &std::path::Path) -> Result<Secret, String> {
    check_value(&chomp(read_private(path, "a secret file")?))
}

/// Reads one value now from a static source or a file; `None` for a
/// command or a token endpoint (the proxy's refreshers read those).
pub fn read_simple(source: &SecretSource) -> Option<Result<Secret, String>> {
    Some(match source {
        SecretSource::Env(name) => std::env::var(name)
            .map_err(|e| match e {
                std::env::VarError::NotPresent => format!("environment variable {name} is not set"),
                std::env::VarError::NotUnicode(_) => format!("environment variable {name} is not UTF-8"),
            })
            .and_then(|raw| check_value(&raw)),
        SecretSource::File(path) => read_file(path),
        SecretSource::Live(l) => match &l.kind {
            LiveKind::File(path) => read_file(path),
            LiveKind::Command(_)
            | LiveKind::OAuth2(_)
            | LiveKind::AwsSecretsManager(_)
            | LiveKind::AwsAssumeRole(_) => return None,
        },
    })
}

fn valid_env_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

const WHAT: &str =
    "{ env = \"NAME\" }, { file = \"path\" }, { command = [\"program\", …] } or { aws_secrets_manager = { … } }";

/// Reads `secret = { … }` (the table is `t`).
pub(crate) fn secret(t: &mut Section) -> Option<SecretSource> {
    let env: Option<String> = t.get("env");
    let file: Option<PathBuf> = t.get("file");
    let command: Option<Vec<(String, String)>> = t.list("command");
    let at = t.path().to_owned();
    let live = t.has("ttl_ms") || t.has("failure_ttl_ms") || t.has("stale_ms");
    if let Some(mut a) = t.optional_table("aws_secrets_manager") {
        let aws = aws_secret(&mut a);
        a.finish();
        if env.is_some() || file.is_some() || command.is_some() {
            t.problems.push(&at, format!("must be exactly one of {WHAT}"));
            return None;
        }
        let refresh = refresh(t, Some(DEFAULT_TTL));
        return aws.map(|kind| {
            SecretSource::Live(Arc::new(LiveSource {
                kind: LiveKind::AwsSecretsManager(kind),
                refresh,
            }))
        });
    }
    let r = match (env, file, command) {
        (Some(e), None, None) if valid_env_name(&e) => {
            if live {
                t.problems
                    .push(&at, "ttl_ms, failure_ttl_ms and stale_ms are for a file or a command");
            }
            Some(SecretSource::Env(e))
        }
        (Some(e), None, None) => {
            let at = t.at("env");
            t.problems.push(at, format!("{e:?} is not a variable name"));
            None
        }
        (None, Some(f), None) if f.as_os_str().is_empty() => {
            let at = t.at("file");
            t.problems.push(at, "must be a file path");
            None
        }
        (None, Some(f), None) if live => {
            let refresh = refresh(t, None);
            Some(SecretSource::Live(Arc::new(LiveSource {
                kind: LiveKind::File(f),
                refresh,
            })))
        }
        (None, Some(f), None) => Some(SecretSource::File(f)),
        (None, None, Some(argv)) => {
            let argv: Vec<String> = argv.into_iter().map(|(_, a)| a).collect();
            if argv.is_empty() || argv[0].is_empty() {
                let at = t.at("command");
                t.problems.push(
                    at,
                    "must name a program: [\"program\", \"arg\", …] (run without a shell)",
                );
            }
            if argv.iter().any(|a| a.contains('\0')) {
                let at = t.at("command");
                t.problems.push(at, "an argument contains NUL");
            }
            let timeout = t.millis("timeout_ms", 1..=600_000, DEFAULT_TIMEOUT);
            let max_bytes = t.count("max_bytes", 1..=1024 * 1024, DEFAULT_MAX_BYTES);
            let env_pass: Vec<String> = t
                .list::<String>("env_pass")
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(at, n)| {
                    if valid_env_name(&n) {
                        Some(n)
                    } else {
                        t.problems.push(at, format!("{n:?} is not a variable name"));
                        None
                    }
                })
                .collect();
            let refresh = refresh(t, Some(DEFAULT_TTL));
            (!argv.is_empty() && !argv[0].is_empty()).then(|| {
                SecretSource::Live(Arc::new(LiveSource {
                    kind: LiveKind::Command(CommandSource {
                        argv,
                        timeout,
                        max_bytes,
                        env_pass,
                    }),
                    refresh,
                }))
            })
        }
        _ => {
            t.problems.push(&at, format!("must be exactly one of {WHAT}"));
            None
        }
    };
    r
}

/// The inside of `aws_secrets_manager = { … }`.
fn aws_secret(a: &mut Section) -> Option<AwsSecret> {
    let secret_id: Option<String> = a.required("secret_id", "the secret's name or ARN");
    let region = aws_region(a, "region");
    if secret_id
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.chars().any(char::is_control))
    {
        let at = a.at("secret_id");
        a.problems.push(at, "must be non-empty text without control characters");
    }
    let json_key: Option<String> = a.get("json_key");
    let endpoint = aws_endpoint(a, region.as_deref(), "secretsmanager");
    let timeout = a.millis("timeout_ms", 100..=120_000, DEFAULT_TIMEOUT);
    Some(AwsSecret {
        secret_id: secret_id?,
        region: region?,
        json_key,
        endpoint: endpoint?,
        timeout,
    })
}

/// An AWS service's `endpoint` (with `allow_plaintext`), or its regional
/// default `https://<service>.<region>.amazonaws.com/`.
fn aws_endpoint(a: &mut Section, region: Option<&str>, service: &str) -> Option<TokenUrl> {
    let allow_plaintext: bool = a.or("allow_plaintext", false);
    match a.get::<String>("endpoint") {
        Some(u) => match token_url(&u) {
            Ok(e) if !e.https && !allow_plaintext => {
                let at = a.at("endpoint");
                a.problems.push(
                    at,
                    format!("{u} is plain HTTP: an endpoint must be https:// (allow_plaintext = true allows http:// to a loopback address)"),
                );
                None
            }
            Ok(e) if !e.https && matches!(&e.host, Host::Ip(ip) if !ip.to_canonical().is_loopback()) => {
                let at = a.at("endpoint");
                a.problems.push(
                    at,
                    format!("{u} is not a loopback address: plain HTTP goes only to loopback"),
                );
                None
            }
            Ok(e) => Some(e),
            Err(e) => {
                let at = a.at("endpoint");
                a.problems.push(at, e);
                None
            }
        },
        None => region.and_then(|r| token_url(&format!("https://{service}.{r}.amazonaws.com/")).ok()),
    }
}

/// An AWS region name of `a`'s `key` (required).
fn aws_region(a: &mut Section, key: &'static str) -> Option<String> {
    let region: Option<String> = a.required(key, "the AWS region, e.g. \"eu-west-1\"");
    if let Some(r) = &region {
        if r.is_empty()
            || !r
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            let at = a.at(key);
            a.problems
                .push(at, format!("{r:?} is not a region name (a-z, 0-9, '-')"));
        }
    }
    region
}

/// Reads `assume_role = { … }` (the table is `a`) as a live source.
pub(crate) fn assume_role(a: &mut Section) -> Option<SecretSource> {
    let role_arn: Option<String> = a.required("role_arn", "the role's ARN, arn:aws:iam::<account>:role/<name>");
    if role_arn
        .as_ref()
        .is_some_and(|r| !r.starts_with("arn:") || r.len() > 2048 || r.chars().any(char::is_control))
    {
        let at = a.at("role_arn");
        a.problems.push(at, "must be an ARN (arn:…) without control characters");
    }
    let region = aws_region(a, "region");
    let session_name: String = a.or("session_name", "loom-egress".to_owned());
    if session_name.is_empty()
        || session_name.len() > 64
        || !session_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"=,.@-_".contains(&b))
    {
        let at = a.at("session_name");
        a.problems
            .push(at, "must be 1-64 characters of letters, digits and =,.@-_");
    }
    let duration_s: u32 = a.or("duration_s", 3600);
    if !(900..=43_200).contains(&duration_s) {
        let at = a.at("duration_s");
        a.problems.push(at, "must be between 900 and 43200 seconds");
    }
    let external_id: Option<String> = a.get("external_id");
    if external_id
        .as_ref()
        .is_some_and(|e| e.len() < 2 || e.len() > 1224 || e.chars().any(char::is_control))
    {
        let at = a.at("external_id");
        a.problems
            .push(at, "must be 2-1224 characters without control characters");
    }
    let endpoint = aws_endpoint(a, region.as_deref(), "sts");
    let timeout = a.millis("timeout_ms", 100..=120_000, DEFAULT_TIMEOUT);
    let refresh = Refresh {
        ttl: Duration::from_secs(u64::from(duration_s)),
        failure_ttl: a.millis("failure_ttl_ms", 100..=24 * 3_600_000, DEFAULT_FAILURE_TTL),
        stale: Duration::ZERO,
        refresh_before: a.millis(
            "refresh_before_ms",
            1000..=3_600_000,
            DEFAULT_ASSUME_ROLE_REFRESH_BEFORE,
        ),
    };
    Some(SecretSource::Live(Arc::new(LiveSource {
        kind: LiveKind::AwsAssumeRole(AssumeRole {
            role_arn: role_arn?,
            session_name,
            duration_s,
            external_id,
            region: region?,
            endpoint: endpoint?,
            timeout,
        }),
        refresh,
    })))
}

/// `refresh_before_ms` of temporary AWS keys: ahead of their expiry as the
/// AWS SDKs refresh them.
pub const DEFAULT_ASSUME_ROLE_REFRESH_BEFORE: Duration = Duration::from_secs(300);

/// `ttl_ms`, `failure_ttl_ms`, `stale_ms` (and `refresh_before_ms`).
fn refresh(t: &mut Section, default_ttl: Option<Duration>) -> Refresh {
    const DAY: u64 = 24 * 3_600_000;
    let ttl = match default_ttl {
        Some(d) => t.millis("ttl_ms", 100..=DAY, d),
        None => {
            let ttl = t.required::<u64>("ttl_ms", "how often the file is read again, in ms");
            Duration::from_millis(ttl.unwrap_or(DEFAULT_TTL.as_millis() as u64).clamp(100, DAY))
        }
    };
    Refresh {
        ttl,
        failure_ttl: t.millis("failure_ttl_ms", 100..=DAY, DEFAULT_FAILURE_TTL),
        stale: t.millis("stale_ms", 0..=7 * DAY, DEFAULT_STALE),
        refresh_before: DEFAULT_REFRESH_BEFORE,
    }
}

/// Reads `mint = { oauth2_client_credentials = { … } }` or `{
/// oauth2_refresh_token = { … } }` (the table is `m`).
pub(crate) fn mint(m: &mut Section) -> Option<SecretSource> {
    let at = m.path().to_owned();
    let kinds = ["oauth2_client_credentials", "oauth2_refresh_token"];
    let present: Vec<&str> = kinds.iter().copied().filter(|k| m.has(k)).collect();
    if present.len() != 1 {
        m.problems.push(
            &at,
            "must be exactly one of { oauth2_client_credentials = { … } } or { oauth2_refresh_token = { … } }",
        );
        let _ = m.take("oauth2_client_credentials");
        let _ = m.take("oauth2_refresh_token");
        return None;
    }
    let client_credentials = present[0] == "oauth2_client_credentials";
    let mut o = m.table(if client_credentials { kinds[0] } else { kinds[1] });
    let token_url = o
        .required::<String>("token_url", "the token endpoint, https://…")
        .and_then(|u| match token_url(&u) {
            Ok(t) => Some(t),
            Err(e) => {
                let at = o.at("token_url");
                o.problems.push(at, e);
                None
            }
        });
    let client_id: Option<String> = o.required("client_id", "the client's id at the token endpoint");
    if client_id
        .as_ref()
        .is_some_and(|c| c.is_empty() || c.chars().any(char::is_control))
    {
        let at = o.at("client_id");
        o.problems.push(at, "must be non-empty text without control characters");
    }
    let nested = |o: &mut Section, key: &'static str| -> Option<Box<SecretSource>> {
        let mut t = o.optional_table(key)?;
        let s = secret(&mut t);
        t.finish();
        s.map(Box::new)
    };
    if client_credentials && !o.has("client_secret") {
        let at = o.at("client_secret");
        o.problems.push(
            at,
            "is required (a source, e.g. { file = \"path\" }) for client credentials",
        );
    }
    let client_secret = nested(&mut o, "client_secret");
    let grant = if client_credentials {
        Some(Grant::ClientCredentials)
    } else {
        if !o.has("refresh_token") {
            let at = o.at("refresh_token");
            o.problems.push(
                at,
                "is required (a source, e.g. { file = \"path\" }; a rotated token is written back to it)",
            );
        }
        nested(&mut o, "refresh_token").map(|refresh_token| Grant::RefreshToken { refresh_token })
    };
    let text = |o: &mut Section, key: &'static str| -> Option<String> {
        let v: Option<String> = o.get(key);
        if v.as_ref()
            .is_some_and(|s| s.is_empty() || s.chars().any(char::is_control))
        {
            let at = o.at(key);
            o.problems.push(at, "must be non-empty text without control characters");
        }
        v
    };
    let (scope, audience) = if client_credentials {
        (text(&mut o, "scope"), text(&mut o, "audience"))
    } else {
        (text(&mut o, "scope"), None)
    };
    let allow_plaintext: bool = o.or("allow_plaintext", false);
    if let Some(u) = &token_url {
        if !u.https && !allow_plaintext {
            let at = o.at("token_url");
            o.problems.push(
                at,
                format!(
                    "{} is plain HTTP: a token endpoint must be https:// (allow_plaintext = true allows http:// to a loopback address)",
                    u.text
                ),
            );
        }
        if !u.https && allow_plaintext {
            if let Host::Ip(ip) = &u.host {
                if !ip.to_canonical().is_loopback() {
                    let at = o.at("token_url");
                    o.problems.push(
                        at,
                        format!("{} is not a loopback address: plain HTTP goes only to loopback", u.text),
                    );
                }
            }
        }
    }
    let timeout = o.millis("timeout_ms", 100..=120_000, DEFAULT_TIMEOUT);
    let failure_ttl = o.millis("failure_ttl_ms", 100..=3_600_000, DEFAULT_FAILURE_TTL);
    let refresh_before = o.millis("refresh_before_ms", 0..=24 * 3_600_000, DEFAULT_REFRESH_BEFORE);
    let ttl = o.millis("ttl_ms", 1000..=24 * 3_600_000, DEFAULT_TTL);
    o.finish();
    Some(SecretSource::Live(Arc::new(LiveSource {
        kind: LiveKind::OAuth2(OAuth2 {
            grant: grant?,
            token_url: token_url?,
            client_id: client_id?,
            client_secret,
            scope,
            audience,
            timeout,
        }),
        refresh: Refresh {
            ttl,
            failure_ttl,
            stale: Duration::ZERO,
            refresh_before,
        },
    })))
}

/// `https://host[:port]/path` (or `http://`).
pub fn token_url(u: &str) -> Result<TokenUrl, String> {
    let (https, rest) = if let Some(r) = u.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = u.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!("{u:?} is not an https:// URL"));
    };
    if u.chars().any(|c| c.is_control() || c == ' ') || rest.contains('#') {
        return Err(format!(
            "{u:?} is not a plain URL (no spaces, control characters or fragment)"
        ));
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err(format!(
            "{u:?} carries user information: put the client's secret in client_secret"
        ));
    }
    let default = if https { 443 } else { 80 };
    let has_port = match authority.rfind(']') {
        Some(end) => authority[end..].contains(':'),
        None => authority.contains(':'),
    };
    let with_port = if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:{default}")
    };
    let (host, port) = parse_authority(&with_port).map_err(|e| format!("{u:?}: {e}"))?;
    Ok(TokenUrl {
        https,
        host,
        port,
        path: path.to_owned(),
        text: u.to_owned(),
    })
}

#[cfg(test)]
#[path = "sources_tests.rs"]
mod tests;
