//! Minting an OAuth2 access token (RFC 6749): the client credentials grant
//! (§4.4) or a refresh token (§6), at the `token_url` the operator fixed.
//! The endpoint is reached as [`super::http`] reaches every source's
//! endpoint. The client authenticates with
//! HTTP Basic (`client_secret_basic`), or as a public client by
//! `client_id` in the form. The answer must be a Bearer token; anything
//! else is refused. Failures name the HTTP status, never the body.

use super::http::{post, within};
use super::{read_nested, refresh_token_of, Env, Failure, Fresh};
use egress_config::sources::{check_value, Grant, OAuth2, Refresh, DEFAULT_TTL};
use egress_config::Secret;
use std::time::{Duration, SystemTime};

/// Asks `o`'s token endpoint for a token (within its timeout).
pub(super) async fn mint(
    o: &OAuth2,
    refresh: &Refresh,
    rotated: Option<Secret>,
    env: &dyn Env,
) -> Result<Fresh, Failure> {
    let what = format!("token endpoint {}", o.token_url.text);
    within(o.timeout, &what, exchange(o, refresh, rotated, env)).await
}

fn form_encode(s: &str) -> String {
    egress_config::secrets::percent_encode(s, b"0123456789ABCDEF", true)
}

async fn exchange(o: &OAuth2, refresh: &Refresh, rotated: Option<Secret>, env: &dyn Env) -> Result<Fresh, Failure> {
    let url = &o.token_url;
    let mut form = vec![];
    match &o.grant {
        Grant::ClientCredentials => {
            form.push(("grant_type", "client_credentials".to_owned()));
            if let Some(a) = &o.audience {
                form.push(("audience", a.clone()));
            }
        }
        Grant::RefreshToken { .. } => {
            form.push(("grant_type", "refresh_token".to_owned()));
            let rt = refresh_token_of(&o.grant, rotated.clone())?;
            form.push(("refresh_token", rt.expose().to_owned()));
        }
    }
    if let Some(s) = &o.scope {
        form.push(("scope", s.clone()));
    }
    let basic = match &o.client_secret {
        Some(source) => {
            let secret = read_nested(source, "client_secret")?;
            use base64::Engine as _;
            let pair = format!("{}:{}", form_encode(&o.client_id), form_encode(secret.expose()));
            Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            ))
        }
        None => {
            form.push(("client_id", o.client_id.clone()));
            None
        }
    };
    let body: Vec<String> = form.iter().map(|(k, v)| format!("{k}={}", form_encode(v))).collect();
    let body = body.join("&");

    let mut headers = vec![
        (
            http::header::CONTENT_TYPE,
            "application/x-www-form-urlencoded".to_owned(),
        ),
        (http::header::ACCEPT, "application/json".to_owned()),
    ];
    if let Some(b) = basic {
        headers.push((http::header::AUTHORIZATION, b));
    }
    let (status, answer) = post(env, url, headers, body.into_bytes()).await?;
    if status != http::StatusCode::OK {
        return Err(Failure::error(format!("token endpoint {} answered {status}", url.text)));
    }
    token(&answer, refresh, o.grant != Grant::ClientCredentials)
        .map_err(|m| Failure::error(format!("token endpoint {}: {m}", url.text)))
}

/// A token answer (RFC 6749 §5.1): a Bearer `access_token`, `expires_in`
/// seconds (without it: `ttl_ms`), and with `refreshing`, a rotated
/// `refresh_token` if any.
pub(super) fn token(answer: &[u8], refresh: &Refresh, refreshing: bool) -> Result<Fresh, String> {
    #[derive(serde::Deserialize)]
    struct Answer {
        access_token: Option<String>,
        token_type: Option<String>,
        expires_in: Option<serde_json::Value>,
        refresh_token: Option<String>,
    }
    let a: Answer = serde_json::from_slice(answer).map_err(|_| "the answer is not a JSON token answer".to_owned())?;
    let access = a.access_token.ok_or("the answer has no access_token")?;
    match a.token_type.as_deref() {
        Some(t) if t.eq_ignore_ascii_case("bearer") => {}
        Some(t) => {
            return Err(format!(
                "the answer's token_type is {:?}, not Bearer: refused (a token of another type would be sent as one)",
                t.chars().take(32).collect::<String>()
            ))
        }
        None => return Err("the answer has no token_type".into()),
    }
    let lifetime = match a.expires_in {
        None => {
            if refresh.ttl.is_zero() {
                DEFAULT_TTL
            } else {
                refresh.ttl
            }
        }
        Some(v) => {
            let secs = match &v {
                serde_json::Value::Number(n) => n.as_u64(),
                serde_json::Value::String(s) => s.parse::<u64>().ok(),
                _ => None,
            };
            match secs {
                Some(s) if s > 0 => Duration::from_secs(s.min(366 * 86_400)),
                _ => return Err("the answer's expires_in is not a positive number of seconds".into()),
            }
        }
    };
    let value = check_value(&access).map_err(|m| format!("access_token: {m}"))?;
    let refresh_token = match (refreshing, a.refresh_token) {
        (true, Some(rt)) => Some(check_value(&rt).map_err(|m| format!("refresh_token: {m}"))?),
        _ => None,
    };
    Ok(Fresh {
        expires_at: Some(SystemTime::now() + lifetime),
        refresh_token,
        ..Fresh::value(value)
    })
}
