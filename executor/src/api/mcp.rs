//! `/v1/mcp/{tool}`: a session tool's MCP server as a Streamable HTTP
//! endpoint (MCP revision 2025-11-25, sessions by `Mcp-Session-Id`). `POST`
//! carries JSON-RPC (an `initialize` opens a session), answered as JSON;
//! `GET` is the server's own stream (SSE); `DELETE` ends the session. Every
//! request of a message is decided by the proxy first (a refusal is a
//! JSON-RPC error carrying the request's `id` and the fact's id, and a batch
//! with one refusal is refused whole), and list answers are filtered to
//! what the rules allow.

use super::caller::Caller;
use egress_config::principals::Action;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use egress_api::mcp::{McpCheck, McpList, McpListKind};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};

use crate::invoke::Executor;
use crate::session::conversation::Conversation;
use crate::session::{OpenError, Session, Sessions, REVISION};
use egress_api::jsonrpc::{self, code, Incoming, Message};

/// The session header (case-insensitive on the wire).
pub const SESSION_HEADER: &str = "mcp-session-id";

fn rpc(status: StatusCode, body: Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn rpc_error(status: StatusCode, code: i64, message: &str) -> Response {
    rpc(status, jsonrpc::error(Value::Null, code, message, None))
}

/// A JSON-RPC error answering no request (`id` null), with its status.
struct Failed(StatusCode, i64, String);

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        rpc_error(self.0, self.1, &self.2)
    }
}

fn failed(status: StatusCode, code: i64, message: &str) -> Failed {
    Failed(status, code, message.to_owned())
}

fn lookup<'a>(exec: &'a Executor, tool: &str) -> Result<&'a Arc<Sessions>, Failed> {
    exec.sessions(tool).ok_or_else(|| {
        failed(
            StatusCode::NOT_FOUND,
            code::INVALID_REQUEST,
            &format!("no session tool `{tool}` (lifecycle = \"session\") in this executor"),
        )
    })
}

/// The session the request names, if it is the caller's (another
/// principal's session is answered as unknown).
fn session_of(sessions: &Sessions, headers: &HeaderMap, caller: &Caller) -> Result<Option<Arc<Session>>, Failed> {
    let Some(v) = headers.get(SESSION_HEADER) else {
        return Ok(None);
    };
    let found = v
        .to_str()
        .ok()
        .and_then(|id| sessions.get(id))
        .filter(|s| caller.sees(s.principal.as_deref()));
    match found {
        Some(s) => Ok(Some(s)),
        None => Err(failed(
            StatusCode::NOT_FOUND,
            code::INVALID_REQUEST,
            "no such session (it ended, or never was): initialize a new one",
        )),
    }
}

/// `POST /v1/mcp/{tool}`.
#[utoipa::path(post, path = "/v1/mcp/{tool}", tag = "mcp",
    security(("control_token" = [])),
    params(("tool" = String, Path, description = "A session tool (`lifecycle = \"session\"`)"),
        ("Mcp-Session-Id" = Option<String>, Header, description = "The session, from the answer to `initialize`")),
    request_body(content = Object, description = "One JSON-RPC message or a batch (MCP 2025-11-25)", content_type = "application/json"),
    responses(
        (status = 200, description = "The JSON-RPC answer (an object, or an array for a batch); the answer to `initialize` carries `Mcp-Session-Id`", body = Object),
        (status = 202, description = "Only notifications or responses: accepted"),
        (status = 400, description = "Not strict JSON (duplicate keys, too deep), not JSON-RPC, or a message other than `initialize` without a session: a JSON-RPC error", body = Object),
        (status = 401, description = "unauthorized", body = egress_api::ErrorBody),
        (status = 403, description = "scope: the caller has no invoke scope for the tool", body = egress_api::ErrorBody),
        (status = 404, description = "No such session tool, or no such session (or another principal's): a JSON-RPC error", body = Object),
        (status = 413, description = "The message is over the tool's max_message_bytes", body = Object),
        (status = 502, description = "The proxy could not decide the calls", body = Object),
        (status = 503, description = "max_sessions open, the server did not start, or the executor is stopping", body = Object),
    ))]
pub async fn post(
    State(exec): State<Arc<Executor>>,
    caller: Caller,
    Path(tool): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let sessions = match sessions_for(&exec, &caller, &tool) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let limit = sessions.tool.process.session.max_message_bytes;
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return rpc_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                code::INVALID_REQUEST,
                &format!("the message is over max_message_bytes = {limit}"),
            )
        }
    };
    let incoming = match parse(&bytes) {
        Ok(i) => i,
        Err(r) => return r.into_response(),
    };
    let session = match session_of(sessions, &headers, &caller) {
        Ok(s) => s,
        Err(r) => return r.into_response(),
    };
    match session {
        None => initialize(sessions, incoming, caller.recorded()).await,
        Some(s) => {
            let _in_use = s.in_use();
            converse(&s, sessions, incoming).await
        }
    }
}

fn parse(bytes: &Bytes) -> Result<Incoming, Failed> {
    let v = jsonrpc::parse_strict(bytes).map_err(|e| {
        failed(
            StatusCode::BAD_REQUEST,
            code::PARSE_ERROR,
            &format!("not strict JSON: {e}"),
        )
    })?;
    jsonrpc::incoming(v).map_err(|(c, e)| failed(StatusCode::BAD_REQUEST, c, &e))
}

/// A message without a session: only `initialize`, which opens one.
async fn initialize(sessions: &Sessions, incoming: Incoming, principal: Option<String>) -> Response {
    let id = match incoming {
        Incoming::One(Message::Request { id, method, .. }) if method == "initialize" => id,
        _ => {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                code::INVALID_REQUEST,
                &format!(
                    "this endpoint speaks MCP {REVISION} with sessions: begin with `initialize` \
                     (one message, no batch), then send its Mcp-Session-Id"
                ),
            )
        }
    };
    match sessions.open(principal).await {
        Ok(s) => {
            let mut r = rpc(StatusCode::OK, json!({"jsonrpc": "2.0", "id": id, "result": s.init}));
            if let Ok(v) = HeaderValue::from_str(&s.id) {
                r.headers_mut().insert(SESSION_HEADER, v);
            }
            r
        }
        Err(e) => {
            let status = match e {
                OpenError::Proxy(_) => StatusCode::BAD_GATEWAY,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            rpc(status, jsonrpc::error(id, code::SERVER_ERROR, &e.to_string(), None))
        }
    }
}

/// The messages of an open session: decided, then carried.
async fn converse(s: &Session, sessions: &Sessions, incoming: Incoming) -> Response {
    let (messages, batch) = match incoming {
        Incoming::One(m) => (vec![m], false),
        Incoming::Batch(b) => (b, true),
    };
    if messages
        .iter()
        .any(|m| matches!(m, Message::Request { method, .. } if method == "initialize"))
    {
        return rpc_error(
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            "the session is initialized already",
        );
    }
    let calls: Vec<_> = messages.iter().filter_map(Message::call).collect();
    if !calls.is_empty() {
        let verdict = match sessions.control().mcp_check(&s.run_id, &McpCheck { calls }).await {
            Ok(v) => v,
            Err(e) => {
                return refuse_all(
                    &messages,
                    batch,
                    StatusCode::BAD_GATEWAY,
                    &format!("the proxy could not decide: {e}"),
                    None,
                )
            }
        };
        if !verdict.allowed {
            return rpc(StatusCode::OK, jsonrpc::refusal(&messages, batch, &verdict));
        }
    }
    // Notifications and the client's responses go on as they are (the
    // server was told `initialized` when it started).
    for m in &messages {
        if matches!(m, Message::Notification { method, .. } if method == "notifications/initialized") {
            continue;
        }
        if !matches!(m, Message::Request { .. }) {
            if let Err(e) = s.conv.write(&m.to_value(None)).await {
                return refuse_all(&messages, batch, StatusCode::OK, &e, None);
            }
        }
    }
    let within = Duration::from_millis(sessions.tool.process.timeout_ms);
    let requests: Vec<&Message> = messages
        .iter()
        .filter(|m| matches!(m, Message::Request { .. }))
        .collect();
    if requests.is_empty() {
        return StatusCode::ACCEPTED.into_response();
    }
    let answers = futures_util::future::join_all(requests.iter().map(|m| answer(s, sessions, m, within))).await;
    if batch {
        rpc(StatusCode::OK, Value::Array(answers))
    } else {
        rpc(StatusCode::OK, answers.into_iter().next().unwrap_or(Value::Null))
    }
}

/// One request carried to the server, its answer given the client's `id`
/// back (and a list answer filtered).
async fn answer(s: &Session, sessions: &Sessions, m: &Message, within: Duration) -> Value {
    let Message::Request { id, method, .. } = m else {
        return Value::Null;
    };
    let mut v = match s.conv.request(m, within).await {
        Ok(v) => v,
        Err(e) => return jsonrpc::error(id.clone(), code::SERVER_ERROR, &e, None),
    };
    if let Some(o) = v.as_object_mut() {
        o.insert("id".into(), id.clone());
    }
    if let Some((kind, field, key)) = McpListKind::of_method(method) {
        if let Err(e) = filter(s, sessions, &mut v, kind, field, key).await {
            return jsonrpc::error(id.clone(), code::SERVER_ERROR, &e, None);
        }
    }
    v
}

/// Keeps in a list answer only the entries the rules allow (an entry
/// without its name or URI is dropped).
async fn filter(
    s: &Session,
    sessions: &Sessions,
    v: &mut Value,
    kind: McpListKind,
    field: &str,
    key: &str,
) -> Result<(), String> {
    let Some(items) = v.pointer_mut(&format!("/result/{field}")).and_then(Value::as_array_mut) else {
        return Ok(());
    };
    let names: Vec<String> = items
        .iter()
        .map(|i| i.get(key).and_then(Value::as_str).unwrap_or_default().to_owned())
        .collect();
    let listed = sessions
        .control()
        .mcp_list(&s.run_id, &McpList { kind, names })
        .await
        .map_err(|e| format!("the proxy could not filter the list: {e}"))?;
    if listed.keep.len() != items.len() {
        return Err("the proxy's filter did not answer every entry".into());
    }
    let mut keep = listed.keep.into_iter();
    items.retain(|i| keep.next().unwrap_or(false) && i.get(key).and_then(Value::as_str).is_some());
    Ok(())
}

/// Every request of a message answered with the same error.
fn refuse_all(messages: &[Message], batch: bool, status: StatusCode, message: &str, data: Option<Value>) -> Response {
    let out: Vec<Value> = messages
        .iter()
        .filter_map(|m| match m {
            Message::Request { id, .. } => Some(jsonrpc::error(id.clone(), code::SERVER_ERROR, message, data.clone())),
            _ => None,
        })
        .collect();
    if out.is_empty() {
        return rpc_error(status, code::SERVER_ERROR, message);
    }
    if batch {
        rpc(status, Value::Array(out))
    } else {
        rpc(status, out.into_iter().next().unwrap_or(Value::Null))
    }
}

/// `GET /v1/mcp/{tool}`: the server's own messages (notifications), as SSE.
#[utoipa::path(get, path = "/v1/mcp/{tool}", tag = "mcp",
    security(("control_token" = [])),
    params(("tool" = String, Path, description = "A session tool"),
        ("Mcp-Session-Id" = String, Header, description = "The session")),
    responses(
        (status = 200, description = "An SSE stream of the server's messages, until the session ends", content_type = "text/event-stream"),
        (status = 400, description = "No Mcp-Session-Id", body = Object),
        (status = 401, description = "unauthorized", body = egress_api::ErrorBody),
        (status = 403, description = "scope: the caller has no invoke scope for the tool", body = egress_api::ErrorBody),
        (status = 404, description = "No such session tool or session", body = Object),
        (status = 409, description = "The session's stream is open already", body = Object),
    ))]
pub async fn get(
    State(exec): State<Arc<Executor>>,
    caller: Caller,
    Path(tool): Path<String>,
    headers: HeaderMap,
) -> Response {
    let s = match named_session(&exec, &caller, &tool, &headers) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let Some(lease) = Conversation::lease_stream(&s.conv) else {
        return rpc_error(
            StatusCode::CONFLICT,
            code::INVALID_REQUEST,
            "the session's stream is open already",
        );
    };
    let events = futures_util::stream::unfold(lease, |mut lease| async move {
        let m = lease.next().await?;
        let frame = Bytes::from(format!("event: message\ndata: {m}\n\n"));
        Some((Ok::<_, Infallible>(frame), lease))
    });
    let mut r = Response::new(Body::from_stream(events));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `DELETE /v1/mcp/{tool}`: ends the session (its server's tree killed,
/// its run ended).
#[utoipa::path(delete, path = "/v1/mcp/{tool}", tag = "mcp",
    security(("control_token" = [])),
    params(("tool" = String, Path, description = "A session tool"),
        ("Mcp-Session-Id" = String, Header, description = "The session")),
    responses(
        (status = 204, description = "Ended"),
        (status = 400, description = "No Mcp-Session-Id", body = Object),
        (status = 401, description = "unauthorized", body = egress_api::ErrorBody),
        (status = 403, description = "scope: the caller has no invoke scope for the tool", body = egress_api::ErrorBody),
        (status = 404, description = "No such session tool or session", body = Object),
    ))]
pub async fn delete(
    State(exec): State<Arc<Executor>>,
    caller: Caller,
    Path(tool): Path<String>,
    headers: HeaderMap,
) -> Response {
    match named_session(&exec, &caller, &tool, &headers) {
        Ok(s) => {
            s.end();
            StatusCode::NO_CONTENT.into_response()
        }
        Err(r) => *r,
    }
}

/// The tool's sessions, if the caller may invoke the tool.
fn sessions_for<'a>(exec: &'a Executor, caller: &Caller, tool: &str) -> Result<&'a Arc<Sessions>, Box<Response>> {
    if let Some(r) = caller.refuses(Action::Invoke { tool }) {
        return Err(Box::new(r));
    }
    lookup(exec, tool).map_err(|f| Box::new(f.into_response()))
}

/// The caller's session the request names (`GET`, `DELETE`): `400` without
/// `Mcp-Session-Id`.
fn named_session(
    exec: &Executor,
    caller: &Caller,
    tool: &str,
    headers: &HeaderMap,
) -> Result<Arc<Session>, Box<Response>> {
    let sessions = sessions_for(exec, caller, tool)?;
    match session_of(sessions, headers, caller) {
        Ok(Some(s)) => Ok(s),
        Ok(None) => Err(Box::new(rpc_error(
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            "Mcp-Session-Id required",
        ))),
        Err(r) => Err(Box::new(r.into_response())),
    }
}
