//! Step 8 for plain HTTP: the request goes out in origin form over the
//! pinned connection (fresh or this run's pooled one), without hop-by-hop
//! headers (RFC 9110 §7.6.1), with `Host` set to the canonical target and
//! the tool's credentials for this host written in (`inject`), and their
//! response scrubbed of them (`scrub`), or refused when what it relays is
//! not what the scrubber reads (`relayed`: an `unscrubbable` fact). The
//! request body streams upstream while the response comes back; the
//! exchange (slot, accounting) lasts until both are finished, and a watchdog
//! bounds both directions by the deadline and the run's end.

use crate::data::carry::body::{self, Exchange, Guarded, ProxyBody, Upload};
use crate::data::carry::inject;
use crate::data::carry::respond;
use crate::data::carry::scrub;
use crate::data::carry::tunnel::{self, Meter};
use crate::data::carry::upstream::{self, Upstream};
use crate::data::carry::websocket;
use crate::data::decide::fetch::Injection;
use crate::data::decide::fetch::{self, Fetch};
use crate::data::decide::target::Target;
use crate::deny::{DenyReason, FetchError, Phase};
use crate::runs::pool::UpBody;
use crate::runs::Run;
use crate::state::Shared;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
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
    /// A WebSocket handshake ([`websocket`]): sent with its upgrade, and
    /// joined to the origin after a `101`.
    pub websocket: bool,
}

/// Sends `req` to `target` and answers with the origin's response (or the
/// error that stopped it). A head that does not fit what the run has left
/// of its byte budget is not sent: `fetch` answers it
/// ([`Fetch::deny_head`]).
pub(in crate::data) async fn forward(
    fetch: &Fetch<'_>,
    sh: &Arc<Shared>,
    run: &Arc<Run>,
    mut req: Request<Incoming>,
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
        websocket,
    } = x;
    let client_upgrade = websocket.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let method = parts.method.clone();
    let json = crate::data::decide::refusal::accepts_json(&parts.headers);
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    if websocket {
        websocket::handshake_headers(&mut headers, websocket::reads_frames(credentials.as_ref()));
    }
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
    let head = body::head_len(parts.method.as_str().len() + pq.as_str().len() + 10, &headers);
    if !exchange.finish.head(head, true) {
        exchange.finish.severed("budget_exhausted");
        return fetch.deny_head(run, target, "request", head).await.into();
    }
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
            Upstream::Verified(_) => return Err("plain HTTP never takes an intercepted origin's connection".to_owned()),
        };
        sh.tasks.spawn(body::watchdog(
            Arc::downgrade(&exchange),
            over,
            body::Bounds {
                deadline,
                run_end: run.cancel.clone(),
                hard_stop: sh.hard_stop.clone(),
                budget: exchange.finish.budget_cut(),
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
    if let (Some(client), StatusCode::SWITCHING_PROTOCOLS) = (client_upgrade, resp.status()) {
        let ws = WebSocket {
            client,
            target,
            deadline,
            credentials,
            json,
        };
        return switch(fetch, sh, run, resp, conn, exchange, ws).await;
    }
    let (mut parts, mut body) = resp.into_parts();
    fx.set_status(parts.status.as_u16());
    // Scrubbed (or refused) on the head as received: its framing headers
    // say what the body relays.
    let injected = credentials.as_ref().map(|c| &c.tool);
    let scrub = match scrub::response(sh, injected, run, &method, &mut parts, &mut body, Some(deadline)).await {
        Ok(s) => s,
        Err(e) => {
            fx.failed(DenyReason::Unscrubbable.code());
            return fetch::refuse_answer(
                sh,
                run,
                target,
                fx.kind,
                json,
                DenyReason::Unscrubbable,
                format!("{target}: {e}"),
            )
            .await
            .into();
        }
    };
    strip_hop_by_hop(&mut parts.headers);
    let head = body::head_len(
        parts.status.canonical_reason().map_or(3, |r| r.len() + 4) + 9,
        &parts.headers,
    );
    if !fx.head(head, false) {
        fx.severed("budget_exhausted");
        return fetch.deny_head(run, target, "response", head).await.into();
    }
    exchange.attach(conn);
    Response::from_parts(parts, ProxyBody::stream(Guarded::new(body, exchange), scrub))
}

/// A WebSocket handshake's side, for [`switch`].
struct WebSocket<'a> {
    /// The tool's connection, upgraded once the `101` is written.
    client: hyper::upgrade::OnUpgrade,
    target: &'a Target,
    deadline: Instant,
    credentials: Option<Injection>,
    /// The handshake accepts `application/json` (a refusal's answer).
    json: bool,
}

/// The origin switched protocols for a WebSocket handshake: its `101` goes
/// to the tool with its headers as they came (scrubbed of the secret), and
/// a task joins both connections once upgraded, holding the exchange (the
/// slot) and bounded like a tunnel (deadline, idle timeout, run end,
/// shutdown), its bytes counted in the fetch (and held to the run's byte
/// budget, as a tunnel's). A `101` whose frames the proxy could not read
/// (an extension it did not offer, when it reads them) is refused like an
/// unreadable answer.
async fn switch(
    fetch: &Fetch<'_>,
    sh: &Arc<Shared>,
    run: &Arc<Run>,
    mut resp: Response<Incoming>,
    conn: crate::runs::pool::Conn,
    exchange: Arc<Exchange>,
    ws: WebSocket<'_>,
) -> Response<ProxyBody> {
    let fx = &exchange.finish;
    fx.set_status(resp.status().as_u16());
    let origin = hyper::upgrade::on(&mut resp);
    let (mut parts, mut body) = resp.into_parts();
    let rewrite = websocket::reads_frames(ws.credentials.as_ref());
    let injected = ws.credentials.as_ref().map(|c| &c.tool);
    let scrubbed = scrub::response(
        sh,
        injected,
        run,
        &http::Method::GET,
        &mut parts,
        &mut body,
        Some(ws.deadline),
    )
    .await
    .and_then(|_| websocket::check_accepted(rewrite, &parts.headers));
    if let Err(e) = scrubbed {
        fx.failed(DenyReason::Unscrubbable.code());
        let detail = format!("{}: {e}", ws.target);
        return fetch::refuse_answer(sh, run, ws.target, fx.kind, ws.json, DenyReason::Unscrubbable, detail)
            .await
            .into();
    }
    let head = body::head_len(
        parts.status.canonical_reason().map_or(3, |r| r.len() + 4) + 9,
        &parts.headers,
    );
    if !fx.head(head, false) {
        fx.severed("budget_exhausted");
        return fetch.deny_head(run, ws.target, "response", head).await.into();
    }
    exchange.take_over();
    let rewrite = websocket::Rewrite::new(sh, run, ws.target, ws.credentials.as_ref());
    let (sh2, run2, client, deadline) = (sh.clone(), run.clone(), ws.client, ws.deadline);
    sh.tasks.spawn(async move {
        let (sh, run) = (sh2, run2);
        let fx = &exchange.finish;
        // The origin's side first, while its connection is held (dropping
        // it would stop the driver before it hands the connection over).
        let upstream = tokio::select! {
            u = origin => u.ok(),
            _ = tokio::time::sleep_until(deadline) => None,
            _ = run.cancel.cancelled() => None,
        };
        drop(conn);
        let Some(upstream) = upstream else {
            fx.failed("upgrade_failed");
            return;
        };
        let Some(client) = tunnel::upgraded(client, deadline, &run.cancel, fx).await else {
            return;
        };
        let meter = Arc::new(Meter::new(fx));
        let budget_cut = fx.budget_cut();
        let bounds = tunnel::Bounds {
            deadline,
            idle: sh.cfg.tunnel_idle_timeout,
            cancel: &run.cancel,
            shutdown: &sh.hard_stop,
            budget: budget_cut.as_ref(),
        };
        let client = tunnel::Metered::side(TokioIo::new(client), &meter, false);
        let upstream = tunnel::Metered::side(TokioIo::new(upstream), &meter, true);
        bounds
            .watch(websocket::relay(client, upstream, rewrite, fx), &meter, fx)
            .await;
        meter.close(fx);
    });
    Response::from_parts(parts, ProxyBody::empty())
}
