//! Minting an OAuth2 access token (RFC 6749): the client credentials grant
//! (§4.4) or a refresh token (§6), at the `token_url` the operator fixed.
//! The endpoint's name is resolved by the proxy's resolver and its
//! addresses vetted by the policy's address ranges, as a fetch's are; its
//! TLS is verified with the roots of intercepted origins; plain HTTP only
//! to loopback, when the config allows it. The client authenticates with
//! HTTP Basic (`client_secret_basic`), or as a public client by
//! `client_id` in the form. The answer must be a Bearer token; anything
//! else is refused. Failures name the HTTP status, never the body.

use super::{read_nested, refresh_token_of, Env, Failure, Fresh, Outcome};
use bytes::Bytes;
use egress_config::sources::{check_value, Grant, OAuth2, Refresh, DEFAULT_TTL};
use egress_config::{Host, RangeVerdict, Secret};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime};

/// The most a token endpoint's answer may hold.
const MAX_ANSWER: usize = 64 * 1024;

/// Asks `o`'s token endpoint for a token (within its timeout).
pub(super) async fn mint(
    o: &OAuth2,
    refresh: &Refresh,
    rotated: Option<Secret>,
    env: &dyn Env,
) -> Result<Fresh, Failure> {
    match tokio::time::timeout(o.timeout, exchange(o, refresh, rotated, env)).await {
        Ok(r) => r,
        Err(_) => Err(Failure {
            outcome: Outcome::Timeout,
            message: format!(
                "token endpoint {} did not answer within {} ms (timeout_ms)",
                o.token_url.text,
                o.timeout.as_millis()
            ),
        }),
    }
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

    let addrs = vetted(o, env).await?;
    let authority = match &url.host {
        Host::Ip(IpAddr::V6(ip)) => format!("[{ip}]:{}", url.port),
        h => format!("{h}:{}", url.port),
    };
    let mut req = http::Request::post(url.path.as_str())
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, "loom-egress");
    if let Some(b) = basic {
        req = req.header(http::header::AUTHORIZATION, b);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| Failure::error(format!("token request: {e}")))?;

    let mut last = String::new();
    let mut tcp = None;
    for ip in &addrs {
        match env.dialer().dial(SocketAddr::new(*ip, url.port)).await {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = format!("{ip}: {e}"),
        }
    }
    let tcp = tcp.ok_or_else(|| Failure::error(format!("token endpoint {} unreachable ({last})", url.text)))?;
    let (status, answer) = if url.https {
        let tls = env
            .authority()
            .connect_h1(&url.host, tcp)
            .await
            .map_err(|e| Failure::error(format!("token endpoint {}: TLS: {e}", url.text)))?;
        send(tls, req, &url.text).await?
    } else {
        send(tcp, req, &url.text).await?
    };
    if status != http::StatusCode::OK {
        return Err(Failure::error(format!("token endpoint {} answered {status}", url.text)));
    }
    token(&answer, refresh, o.grant != Grant::ClientCredentials)
        .map_err(|m| Failure::error(format!("token endpoint {}: {m}", url.text)))
}

/// The endpoint's addresses the policy's ranges allow (only loopback ones
/// for plain HTTP).
async fn vetted(o: &OAuth2, env: &dyn Env) -> Result<Vec<IpAddr>, Failure> {
    let url = &o.token_url;
    let found = match &url.host {
        Host::Ip(ip) => vec![*ip],
        Host::Name(n) => env
            .resolver()
            .resolve(n)
            .await
            .map_err(|e| Failure::error(format!("token endpoint {}: DNS: {e}", url.text)))?,
    };
    let ranges = env.ranges();
    let mut refused = vec![];
    let mut ok = vec![];
    for ip in found {
        match ranges.classify(ip, false) {
            RangeVerdict::Allowed if url.https || ip.to_canonical().is_loopback() => ok.push(ip),
            RangeVerdict::Allowed => refused.push(format!("{ip} (plain HTTP goes only to loopback)")),
            RangeVerdict::DefaultDenied(net) | RangeVerdict::OperatorDenied(net) => {
                refused.push(format!("{ip} (in {net})"))
            }
        }
    }
    if ok.is_empty() {
        return Err(Failure::error(format!(
            "token endpoint {} resolves to no address the policy allows: {}",
            url.text,
            refused.join(", ")
        )));
    }
    Ok(ok)
}

async fn send<IO>(io: IO, req: http::Request<Full<Bytes>>, url: &str) -> Result<(http::StatusCode, Bytes), Failure>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| Failure::error(format!("token endpoint {url}: {e}")))?;
    let conn = tokio::spawn(conn);
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| Failure::error(format!("token endpoint {url}: {e}")))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|_| {
            Failure::error(format!(
                "token endpoint {url}: an answer over {MAX_ANSWER} bytes or cut short"
            ))
        })?
        .to_bytes();
    conn.abort();
    Ok((status, body))
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
        value,
        expires_at: Some(SystemTime::now() + lifetime),
        refresh_token,
    })
}
