//! Step 8 for plain HTTP: the request goes out in origin form over the
//! pinned connection (fresh or this run's pooled one), without hop-by-hop
//! headers (RFC 9110 §7.6.1), with `Host` set to the canonical target and
//! the tool's credentials for this host written in (`inject`), and their
//! response scrubbed of them (`scrub`). The
//! request body streams upstream while the response comes back; the
//! exchange (slot, accounting) lasts until both are finished, and a watchdog
//! bounds both directions by the deadline and the run's end.

use crate::data::body::{self, Exchange, Guarded, ProxyBody, Upload};
use crate::data::inject::{self, Injection};
use crate::data::respond;
use crate::data::scrub;
use crate::data::target::Target;
use crate::data::upstream::{self, Upstream};
use crate::deny::{FetchError, Phase};
use crate::runs::pool::UpBody;
use crate::runs::Run;
use crate::state::Shared;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Version};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// `Proxy-Connection`, the pre-standard `Connection` some clients send to proxies.
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Headers that never cross the proxy (RFC 9110 §7.6.1), plus the proxy's
/// own. Names, not strings: removing by a string parses it into a name
/// first, which was most of this function's cost per request.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    PROXY_CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // The options `close` and `keep-alive` (and any hop-by-hop name, removed
    // below anyway) name nothing else to remove: no name is made, and the
    // list stays unallocated, for what clients send nearly always.
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .chain(h.get_all(PROXY_CONNECTION).iter())
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|n| !n.eq_ignore_ascii_case("close") && !HOP_BY_HOP.iter().any(|h| n.eq_ignore_ascii_case(h.as_str())))
        .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
}

/// One exchange's connection and bounds.
pub struct Exchanging {
    pub upstream: Upstream,
    pub exchange: Arc<Exchange>,
    /// Fires when the exchange is over (the watchdog's end).
    pub over: oneshot::Receiver<()>,
    pub deadline: Instant,
    /// Closes the client connection (the watchdog's cut).
    pub client_cut: CancellationToken,
    /// The credentials to write into the request (`None`: the fast path).
    pub credentials: Option<Injection>,
}

/// Sends `req` to `target` and answers with the origin's response (or the
/// error that stopped it).
pub async fn forward(
    sh: &Shared,
    run: &Arc<Run>,
    req: Request<Incoming>,
    target: &Target,
    x: Exchanging,
) -> Response<ProxyBody> {
    let Exchanging {
        upstream,
        exchange,
        over,
        deadline,
        client_cut,
        credentials,
    } = x;
    let (parts, body) = req.into_parts();
    let method = parts.method.clone();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    if let Ok(v) = HeaderValue::from_str(&target.host_header()) {
        headers.insert(header::HOST, v);
    }
    let mut pq = target
        .path_and_query
        .clone()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    if let Some(inj) = &credentials {
        inject::write(inj, run, &mut headers, &mut pq);
    }
    exchange.finish.add_up(body::head_len(
        parts.method.as_str().len() + pq.as_str().len() + 10,
        &headers,
    ));
    let upload: UpBody = Upload::new(body, exchange.clone()).boxed_unsync();
    let mut up = Request::new(upload);
    *up.method_mut() = parts.method;
    *up.version_mut() = Version::HTTP_11;
    *up.headers_mut() = headers;
    *up.uri_mut() = http::Uri::from(pq);
    let fx = &exchange.finish;
    let exchange_fut = async {
        let mut conn = match upstream {
            Upstream::Pooled(c) => c,
            Upstream::Stream(s, addr) => upstream::handshake(s, addr, run.cancel.clone(), sh.hard_stop.clone())
                .await
                .map_err(|e| e.to_string())?,
        };
        sh.tasks.spawn(body::watchdog(
            Arc::downgrade(&exchange),
            over,
            body::Bounds {
                deadline,
                run_end: run.cancel.clone(),
                hard_stop: sh.hard_stop.clone(),
            },
            conn.cut_token(),
            client_cut,
        ));
        match conn.sender.try_send_request(up).await {
            Ok(resp) => Ok((resp, conn)),
            Err(mut e) => {
                // A pooled connection that closed before our request went out:
                // dial the same vetted address afresh and send it there.
                let Some(req) = e.take_message().filter(|_| conn.reused) else {
                    return Err(e.into_error().to_string());
                };
                let addr = conn.addr;
                drop(conn);
                let s = sh.dialer.dial(addr).await.map_err(|e| format!("{addr}: {e}"))?;
                let mut fresh = upstream::handshake(s, addr, run.cancel.clone(), sh.hard_stop.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                let resp = fresh.sender.send_request(req).await.map_err(|e| e.to_string())?;
                Ok((resp, fresh))
            }
        }
    };
    let (resp, conn) = tokio::select! {
        r = exchange_fut => match r {
            Ok(x) => x,
            Err(e) => {
                fx.failed(FetchError::UpstreamFailed.code());
                sh.count_error(&run.tool, FetchError::UpstreamFailed);
                return respond::error(FetchError::UpstreamFailed, &format!("{target}: {e}"));
            }
        },
        _ = tokio::time::sleep_until(deadline) => {
            fx.timed_out(Phase::Response);
            sh.count_error(&run.tool, FetchError::Timeout);
            return respond::error(FetchError::Timeout, &format!("{target} did not answer before the fetch deadline"));
        }
        _ = run.cancel.cancelled() => {
            fx.severed("run_ended");
            return respond::error(FetchError::RunEnded, &format!("run {} ended", run.id));
        }
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    fx.add_down(body::head_len(
        parts.status.canonical_reason().map_or(3, |r| r.len() + 4) + 9,
        &parts.headers,
    ));
    let scrub = match scrub::response(sh, credentials.as_ref().map(|c| &c.tool), run, &method, &mut parts) {
        Ok(s) => s,
        Err(e) => {
            fx.failed(FetchError::Unscrubbable.code());
            sh.count_error(&run.tool, FetchError::Unscrubbable);
            return respond::error(FetchError::Unscrubbable, &format!("{target}: {e}"));
        }
    };
    exchange.attach(conn);
    Response::from_parts(parts, ProxyBody::stream(Guarded { inner: body, exchange }, scrub))
}
