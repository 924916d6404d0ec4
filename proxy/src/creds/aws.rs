//! `secret = { aws_secrets_manager = { … } }`: the current value of a
//! secret in AWS Secrets Manager (`GetSecretValue`), asked with the
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
use egress_config::sources::{check_value, AwsSecret};
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

async fn ask(a: &AwsSecret, env: &dyn Env) -> Result<Fresh, Failure> {
    let keys = own_keys().map_err(Failure::error)?;
    let body = serde_json::json!({ "SecretId": a.secret_id }).to_string();
    let host = authority(&a.endpoint);
    let (path, query) = a
        .endpoint
        .path
        .split_once('?')
        .unwrap_or((a.endpoint.path.as_str(), ""));
    const CONTENT_TYPE: &str = "application/x-amz-json-1.1";
    const TARGET: &str = "secretsmanager.GetSecretValue";
    let payload_hash = super::sigv4::hex(&Sha256::digest(body.as_bytes()));
    let signed = sign(
        &Request {
            method: "POST",
            path,
            query,
            headers: &[
                ("host", &host),
                ("content-type", CONTENT_TYPE),
                ("x-amz-target", TARGET),
            ],
            payload_hash: &payload_hash,
            also_sign: &[],
        },
        &Keys {
            access_key_id: &keys.access_key_id,
            secret_access_key: &keys.secret_access_key,
            session_token: keys.session_token.as_deref(),
        },
        &Scope {
            region: &a.region,
            service: "secretsmanager",
        },
        SystemTime::now(),
    );
    let mut headers = vec![
        (http::header::CONTENT_TYPE, CONTENT_TYPE.to_owned()),
        (http::HeaderName::from_static("x-amz-target"), TARGET.to_owned()),
        (http::HeaderName::from_static("x-amz-date"), signed.amz_date),
        (http::header::AUTHORIZATION, signed.authorization),
    ];
    if let Some(t) = signed.security_token {
        headers.push((http::HeaderName::from_static("x-amz-security-token"), t));
    }
    let (status, answer) = post(env, &a.endpoint, headers, body.into_bytes()).await?;
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
    Ok(Fresh {
        value,
        expires_at: None,
        refresh_token: None,
    })
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
