//! `secret = { aws_secrets_manager = { … } }`: the current value of a
//! secret in AWS Secrets Manager (`GetSecretValue`); and `assume_role = {
//! … }`: temporary keys from STS `AssumeRole`. Both are asked with the
//! proxy's own AWS credentials, signed with SigV4 ([`super::sigv4`]) and
//! sent as [`super::http`] sends every source's request. The proxy's keys
//! come from the standard environment variables (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), else from the shared
//! credentials file (`AWS_SHARED_CREDENTIALS_FILE`, default
//! `~/.aws/credentials`; profile `AWS_PROFILE`, default `default`), read at
//! each request so a rotation of the proxy's own keys is picked up.

use super::http::{authority, post, within};
use super::sigv4::{sign, Keys, Request, Scope};
use super::{Failure, Fresh};
use crate::creds::Env;
use egress_config::sources::{check_value, AssumeRole, AwsSecret, TokenUrl};
use sha2::{Digest as _, Sha256};
use std::time::SystemTime;

/// The proxy's own AWS keys.
pub(super) struct OwnKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

/// The proxy's AWS keys: the environment, else the shared credentials file.
pub(super) fn own_keys() -> Result<OwnKeys, String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
        return Ok(OwnKeys {
            access_key_id: id,
            secret_access_key: secret,
            session_token: var("AWS_SESSION_TOKEN"),
        });
    }
    let path = match var("AWS_SHARED_CREDENTIALS_FILE") {
        Some(p) => std::path::PathBuf::from(p),
        None => match var("HOME") {
            Some(h) => std::path::Path::new(&h).join(".aws/credentials"),
            None => return Err("no AWS credentials: AWS_ACCESS_KEY_ID is not set and HOME is unknown".into()),
        },
    };
    let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "no AWS credentials: AWS_ACCESS_KEY_ID is not set and {} cannot be read ({e})",
            path.display()
        )
    })?;
    profile_keys(&text, &profile).ok_or_else(|| format!("{} has no keys for profile {profile}", path.display()))
}

/// The keys of `[profile]` in a shared credentials file (INI).
pub(super) fn profile_keys(text: &str, profile: &str) -> Option<OwnKeys> {
    let mut inside = false;
    let (mut id, mut secret, mut token) = (None, None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == profile;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let v = v.trim().to_owned();
            match k.trim() {
                "aws_access_key_id" => id = Some(v),
                "aws_secret_access_key" => secret = Some(v),
                "aws_session_token" => token = Some(v),
                _ => {}
            }
        }
    }
    Some(OwnKeys {
        access_key_id: id?,
        secret_access_key: secret?,
        session_token: token,
    })
}

/// Asks Secrets Manager for `a`'s current value.
pub(super) async fn get_secret(a: &AwsSecret, env: &dyn Env) -> Result<Fresh, Failure> {
    let what = format!("secrets manager {}", a.endpoint.text);
    within(a.timeout, &what, ask(a, env)).await
}

/// POSTs `body` to an AWS service's `endpoint`, signed with the proxy's
/// own keys for `service` in `region`, with `headers` (name, value) besides
/// the signature's: the answer's status and body.
async fn call(
    env: &dyn Env,
    endpoint: &TokenUrl,
    service: &str,
    region: &str,
    headers: &[(&'static str, &str)],
    body: Vec<u8>,
) -> Result<(http::StatusCode, bytes::Bytes), Failure> {
    let keys = own_keys().map_err(Failure::error)?;
    let host = authority(endpoint);
    let (path, query) = endpoint.path.split_once('?').unwrap_or((endpoint.path.as_str(), ""));
    let payload_hash = super::sigv4::hex(&Sha256::digest(&body));
    let mut signed_headers = vec![("host", host.as_str())];
    signed_headers.extend(headers.iter().copied());
    let signed = sign(
        &Request {
            method: "POST",
            path,
            query,
            headers: &signed_headers,
            payload_hash: &payload_hash,
            also_sign: &[],
        },
        &Keys {
            access_key_id: &keys.access_key_id,
            secret_access_key: &keys.secret_access_key,
            session_token: keys.session_token.as_deref(),
        },
        &Scope { region, service },
        SystemTime::now(),
    );
    let mut out: Vec<(http::HeaderName, String)> = headers
        .iter()
        .map(|(k, v)| (http::HeaderName::from_static(k), (*v).to_owned()))
        .collect();
    out.push((http::HeaderName::from_static("x-amz-date"), signed.amz_date));
    out.push((http::header::AUTHORIZATION, signed.authorization));
    if let Some(t) = signed.security_token {
        out.push((http::HeaderName::from_static("x-amz-security-token"), t));
    }
    post(env, endpoint, out, body).await
}

async fn ask(a: &AwsSecret, env: &dyn Env) -> Result<Fresh, Failure> {
    let body = serde_json::json!({ "SecretId": a.secret_id }).to_string();
    let headers = [
        ("content-type", "application/x-amz-json-1.1"),
        ("x-amz-target", "secretsmanager.GetSecretValue"),
    ];
    let (status, answer) = call(
        env,
        &a.endpoint,
        "secretsmanager",
        &a.region,
        &headers,
        body.into_bytes(),
    )
    .await?;
    let v: Option<serde_json::Value> = serde_json::from_slice(&answer).ok();
    if status != http::StatusCode::OK {
        // The error's type names the cause (ResourceNotFoundException,
        // AccessDeniedException); its message could quote anything, so not it.
        let kind = v
            .as_ref()
            .and_then(|v| v["__type"].as_str())
            .map(|t| t.rsplit('#').next().unwrap_or(t))
            .filter(|t| t.len() <= 64 && t.bytes().all(|b| b.is_ascii_alphanumeric()))
            .map(|t| format!(" ({t})"))
            .unwrap_or_default();
        return Err(Failure::error(format!(
            "secrets manager {} answered {status}{kind} for {}",
            a.endpoint.text, a.secret_id
        )));
    }
    let value = secret_value(v.as_ref(), a.json_key.as_deref())
        .map_err(|m| Failure::error(format!("secret {}: {m}", a.secret_id)))?;
    Ok(Fresh::value(value))
}

/// The value in a `GetSecretValue` answer: its `SecretString`, or the
/// string member `json_key` of it.
pub(super) fn secret_value(
    answer: Option<&serde_json::Value>,
    json_key: Option<&str>,
) -> Result<egress_config::Secret, String> {
    let Some(answer) = answer else {
        return Err("the answer is not JSON".into());
    };
    let Some(text) = answer["SecretString"].as_str() else {
        return Err(if answer.get("SecretBinary").is_some() {
            "the secret is binary (SecretBinary); only SecretString is read".into()
        } else {
            "the answer has no SecretString".into()
        });
    };
    match json_key {
        None => check_value(text),
        Some(k) => {
            let inner: serde_json::Value =
                serde_json::from_str(text).map_err(|_| format!("json_key {k}: the SecretString is not JSON"))?;
            match &inner[k] {
                serde_json::Value::String(s) => check_value(s),
                serde_json::Value::Null => Err(format!("json_key {k}: no such member")),
                _ => Err(format!("json_key {k}: not a string")),
            }
        }
    }
}

/// Asks STS for temporary keys of `a`'s role (`AssumeRole`).
pub(super) async fn assume_role(a: &AssumeRole, env: &dyn Env) -> Result<Fresh, Failure> {
    let what = format!("sts {}", a.endpoint.text);
    within(a.timeout, &what, assume(a, env)).await
}

async fn assume(a: &AssumeRole, env: &dyn Env) -> Result<Fresh, Failure> {
    let enc = |s: &str| egress_config::secrets::percent_encode(s, b"0123456789ABCDEF", false);
    let mut body = format!(
        "Action=AssumeRole&Version=2011-06-15&RoleArn={}&RoleSessionName={}&DurationSeconds={}",
        enc(&a.role_arn),
        enc(&a.session_name),
        a.duration_s
    );
    if let Some(x) = &a.external_id {
        body.push_str(&format!("&ExternalId={}", enc(x)));
    }
    let headers = [("content-type", "application/x-www-form-urlencoded; charset=utf-8")];
    let (status, answer) = call(env, &a.endpoint, "sts", &a.region, &headers, body.into_bytes()).await?;
    let text = String::from_utf8_lossy(&answer);
    if status != http::StatusCode::OK {
        // The error's code names the cause (AccessDenied, ...); its message
        // could quote anything, so not it.
        let code = xml_text(&text, "Code")
            .filter(|c| c.len() <= 64 && c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.'))
            .map(|c| format!(" ({c})"))
            .unwrap_or_default();
        return Err(Failure::error(format!(
            "sts {} answered {status}{code} for AssumeRole of {}",
            a.endpoint.text, a.role_arn
        )));
    }
    assumed_keys(&text).map_err(|m| Failure::error(format!("AssumeRole of {}: {m}", a.role_arn)))
}

/// The keys in an `AssumeRoleResponse`: its `Credentials`.
pub(super) fn assumed_keys(xml: &str) -> Result<Fresh, String> {
    let creds = xml_text(xml, "Credentials").ok_or("the answer has no Credentials")?;
    let field = |name: &str| -> Result<egress_config::Secret, String> {
        let v = xml_text(creds, name).ok_or_else(|| format!("the answer has no {name}"))?;
        check_value(v).map_err(|m| format!("{name}: {m}"))
    };
    let expiration = xml_text(creds, "Expiration").ok_or("the answer has no Expiration")?;
    let expires = time::OffsetDateTime::parse(expiration, &time::format_description::well_known::Rfc3339)
        .map_err(|_| "its Expiration is not an RFC 3339 time".to_owned())?;
    let expires_at = SystemTime::UNIX_EPOCH
        + std::time::Duration::from_secs(
            u64::try_from(expires.unix_timestamp()).map_err(|_| "its Expiration is before 1970")?,
        );
    Ok(Fresh {
        value: field("SecretAccessKey")?,
        expires_at: Some(expires_at),
        refresh_token: None,
        aws: Some(super::AwsIds {
            key_id: field("AccessKeyId")?,
            session_token: field("SessionToken")?,
        }),
    })
}

/// The text inside the first `<name>…</name>` of `xml` (no attributes, no
/// nesting of the same name: what AWS's query APIs answer), trimmed.
fn xml_text<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = xml.find(&open)? + open.len();
    let end = start + xml[start..].find(&close)?;
    Some(xml[start..end].trim())
}
