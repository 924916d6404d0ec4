//! How the proxy reaches a credential source's endpoint (a token endpoint,
//! AWS Secrets Manager): the name resolved by the proxy's own resolver, the
//! addresses vetted by the policy's address ranges as a fetch's are (none
//! allowed: never dialled), TLS verified with the roots of intercepted
//! origins, plain HTTP only to loopback (the config allows `http://` only
//! with `allow_plaintext`). One POST per connection, the answer read within
//! [`MAX_ANSWER`]. These connections are the proxy's own: they never pass
//! through the data plane and make no fact.

use super::{Env, Failure};
use bytes::Bytes;
use egress_config::sources::TokenUrl;
use egress_config::{Host, RangeVerdict};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, SocketAddr};

/// The most an endpoint's answer may hold.
pub(super) const MAX_ANSWER: usize = 64 * 1024;

/// `work` within `timeout`, or a `timeout` failure naming `what` (the
/// source's endpoint, as the operator wrote it).
pub(super) async fn within<T>(
    timeout: std::time::Duration,
    what: &str,
    work: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(Failure {
            outcome: super::Outcome::Timeout,
            message: format!("{what} did not answer within {} ms (timeout_ms)", timeout.as_millis()),
        }),
    }
}

/// POSTs `body` with `headers` (and `Host`) to `url`; the status and the body.
pub(super) async fn post(
    env: &dyn Env,
    url: &TokenUrl,
    headers: Vec<(http::HeaderName, String)>,
    body: Vec<u8>,
) -> Result<(http::StatusCode, Bytes), Failure> {
    let addrs = vetted(url, env).await?;
    let mut req = http::Request::post(url.path.as_str())
        .header(http::header::HOST, authority(url))
        .header(http::header::USER_AGENT, "loom-egress");
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| Failure::error(format!("request to {}: {e}", url.text)))?;
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
    let tcp = tcp.ok_or_else(|| Failure::error(format!("{} unreachable ({last})", url.text)))?;
    if url.https {
        let tls = env
            .authority()
            .connect_h1(&url.host, tcp)
            .await
            .map_err(|e| Failure::error(format!("{}: TLS: {e}", url.text)))?;
        send(tls, req, &url.text).await
    } else {
        send(tcp, req, &url.text).await
    }
}

/// `host[:port]` as the `Host` header writes it (no port when it is the
/// scheme's default, as clients write it).
pub(super) fn authority(url: &TokenUrl) -> String {
    let host = match &url.host {
        Host::Ip(IpAddr::V6(ip)) => format!("[{ip}]"),
        h => h.to_string(),
    };
    if url.port == if url.https { 443 } else { 80 } {
        host
    } else {
        format!("{host}:{}", url.port)
    }
}

/// The endpoint's addresses the policy's ranges allow (only loopback ones
/// for plain HTTP).
async fn vetted(url: &TokenUrl, env: &dyn Env) -> Result<Vec<IpAddr>, Failure> {
    let found = match &url.host {
        Host::Ip(ip) => vec![*ip],
        Host::Name(n) => env
            .resolver()
            .resolve(n)
            .await
            .map_err(|e| Failure::error(format!("{}: DNS: {e}", url.text)))?,
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
            "{} resolves to no address the policy allows: {}",
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
        .map_err(|e| Failure::error(format!("{url}: {e}")))?;
    let conn = tokio::spawn(conn);
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| Failure::error(format!("{url}: {e}")))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|_| Failure::error(format!("{url}: an answer over {MAX_ANSWER} bytes or cut short")))?
        .to_bytes();
    conn.abort();
    Ok((status, body))
}
