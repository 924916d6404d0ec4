//! MCP inside an intercepted request, for a tool with `[tools.<id>.mcp]`
//! rules (a remote MCP server reached over HTTPS): a JSON `POST` is read
//! whole within [`BODY_MAX`] and the fetch deadline, and parsed strictly (`egress_api::jsonrpc`);
//! JSON-RPC in it is decided by `decide::mcp_check` (facts first), a
//! refused message is answered here with JSON-RPC errors and never sent on;
//! the answer to a list request (JSON or SSE) is read within the same bound
//! and filtered to what the rules allow.

use crate::data::carry::body::ProxyBody;
use crate::data::decide::mcp::keep_listed;
use crate::data::decide::mcp_check;
use crate::runs::Run;
use crate::state::Shared;
use bytes::Bytes;
use egress_api::jsonrpc::{self, code, Incoming, Message};
use egress_api::mcp::McpListKind;
use egress_config::ToolPolicy;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt as _;
use serde_json::Value;
use tokio::time::Instant;

/// The largest MCP message (a request body, or a list answer) read whole.
pub const BODY_MAX: usize = 4 << 20;

/// Whether a request of a tool with MCP rules carries MCP: a `POST` of
/// `application/json`.
pub fn applies(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::POST
        && headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("application/json"))
}

/// The list requests of a message whose answer is to be filtered: for each
/// request's id, which list (a batch can hold several).
pub struct List {
    lists: Vec<(Value, McpListKind, &'static str, &'static str)>,
}

fn answer(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::text(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, code: i64, message: &str) -> Response<ProxyBody> {
    answer(status, jsonrpc::error(Value::Null, code, message, None))
}

/// The request's body read and decided: the bytes to send on (the same
/// bytes: the strict reading gives them one meaning) and, for a single list
/// request, its answer's filter; or the answer given here (a refusal, or
/// why the body cannot be decided). A body that is JSON but not JSON-RPC
/// is not MCP and goes on as it is.
pub async fn request<B>(
    sh: &Shared,
    run: &Run,
    tool: &ToolPolicy,
    headers: &mut HeaderMap,
    body: B,
    deadline: Instant,
) -> Result<(Bytes, Option<List>), Response<ProxyBody>>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let read = tokio::time::timeout_at(deadline, http_body_util::Limited::new(body, BODY_MAX).collect()).await;
    let bytes = match read {
        Err(_) => {
            return Err(error(
                StatusCode::REQUEST_TIMEOUT,
                code::INVALID_REQUEST,
                "the MCP message did not arrive before the fetch deadline; nothing is sent",
            ))
        }
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            let too_large = e.downcast_ref::<http_body_util::LengthLimitError>().is_some();
            return Err(match too_large {
                true => error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    code::INVALID_REQUEST,
                    &format!("an MCP message over {BODY_MAX} bytes is not decided, and not sent"),
                ),
                false => error(
                    StatusCode::BAD_REQUEST,
                    code::INVALID_REQUEST,
                    "the request body broke off",
                ),
            });
        }
    };
    let v = jsonrpc::parse_strict(&bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            code::PARSE_ERROR,
            &format!("not strict JSON, so not decided and not sent: {e}"),
        )
    })?;
    let is_rpc = |v: &Value| v.get("jsonrpc").is_some();
    let rpc = match &v {
        Value::Array(items) => items.iter().any(is_rpc),
        v => is_rpc(v),
    };
    if !rpc {
        return Ok((bytes, None));
    }
    let incoming = jsonrpc::incoming(v).map_err(|(c, e)| error(StatusCode::BAD_REQUEST, c, &e))?;
    let (messages, batch) = match incoming {
        Incoming::One(m) => (vec![m], false),
        Incoming::Batch(b) => (b, true),
    };
    let calls: Vec<_> = messages.iter().filter_map(Message::call).collect();
    if calls.len() > egress_api::mcp::MCP_CHECK_MAX_CALLS {
        return Err(error(
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            &format!(
                "more than {} requests in one batch",
                egress_api::mcp::MCP_CHECK_MAX_CALLS
            ),
        ));
    }
    if !calls.is_empty() {
        let policy = sh.policy.load_full();
        let verdict = mcp_check::check(sh, run, &policy, tool, &calls).await.map_err(|e| {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                code::SERVER_ERROR,
                &format!("the MCP denial could not be recorded ({e}); nothing is sent"),
            )
        })?;
        if !verdict.allowed {
            return Err(answer(StatusCode::OK, jsonrpc::refusal(&messages, batch, &verdict)));
        }
    }
    let lists: Vec<_> = messages
        .iter()
        .filter_map(|m| match m {
            Message::Request { id, method, .. } => {
                McpListKind::of_method(method).map(|(kind, field, key)| (id.clone(), kind, field, key))
            }
            _ => None,
        })
        .collect();
    let list = (!lists.is_empty()).then_some(List { lists });
    if list.is_some() {
        // Its answer is read to be filtered: in a coding the proxy reads.
        headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    }
    Ok((bytes, list))
}

/// The list answer `body` (its head in `headers`) read whole and filtered:
/// a JSON answer, or each event of an SSE answer that is the list's
/// response. An answer that cannot be read (a coding, over the bound, not
/// JSON where the response should be) becomes a JSON-RPC error: nothing
/// unfiltered reaches the tool.
pub async fn filter<B>(
    tool: &ToolPolicy,
    list: &List,
    headers: &mut HeaderMap,
    body: B,
    deadline: Instant,
) -> Result<Bytes, Value>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let id = match list.lists.as_slice() {
        [(id, ..)] => id.clone(),
        _ => Value::Null,
    };
    let fail = |m: &str| jsonrpc::error(id.clone(), code::SERVER_ERROR, m, None);
    if headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"))
    {
        return Err(fail("the server's list answer is in a coding the proxy does not read"));
    }
    let bytes = tokio::time::timeout_at(deadline, http_body_util::Limited::new(body, BODY_MAX).collect())
        .await
        .map_err(|_| fail("the server's list answer did not arrive before the fetch deadline"))?
        .map_err(|_| {
            fail(&format!(
                "the server's list answer is over {BODY_MAX} bytes, or broke off"
            ))
        })?
        .to_bytes();
    headers.remove(header::CONTENT_LENGTH);
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("text/event-stream"));
    if !sse {
        let mut v = jsonrpc::parse_strict(&bytes).map_err(|e| fail(&format!("the server's list answer: {e}")))?;
        keep(tool, list, &mut v);
        return Ok(Bytes::from(v.to_string()));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| fail("the server's list answer is not UTF-8"))?;
    let mut out = String::with_capacity(text.len());
    for event in text.split_inclusive("\n\n") {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:").map(|d| d.strip_prefix(' ').unwrap_or(d)))
            .collect();
        let parsed = (!data.is_empty())
            .then(|| jsonrpc::parse_strict(data.join("\n").as_bytes()).ok())
            .flatten();
        match parsed {
            Some(mut v) if list.lists.iter().any(|l| v.get("id") == Some(&l.0)) || v.is_array() => {
                keep(tool, list, &mut v);
                for l in event.lines().filter(|l| !l.starts_with("data:") && !l.is_empty()) {
                    out.push_str(l);
                    out.push('\n');
                }
                out.push_str(&format!("data: {v}\n\n"));
            }
            _ => out.push_str(event),
        }
    }
    Ok(Bytes::from(out))
}

/// Drops from the list responses in `v` (one response, or a batch's
/// array of them) the entries the rules could never allow.
fn keep(tool: &ToolPolicy, list: &List, v: &mut Value) {
    if let Some(all) = v.as_array_mut() {
        for one in all {
            keep(tool, list, one);
        }
        return;
    }
    let Some((_, kind, field, key)) = list.lists.iter().find(|l| v.get("id") == Some(&l.0)) else {
        return;
    };
    let Some(items) = v.pointer_mut(&format!("/result/{field}")).and_then(Value::as_array_mut) else {
        return;
    };
    items.retain(|i| {
        i.get(*key)
            .and_then(Value::as_str)
            .is_some_and(|n| keep_listed(tool.mcp.as_ref(), *kind, n))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use serde_json::json;

    fn tool(rules: &str) -> ToolPolicy {
        let text = format!("[tools.t]\negress = []\n[tools.t.mcp]\n{rules}\n");
        let c = egress_config::Config::parse(&text, "t.toml").unwrap();
        (*c.policy.tools["t"]).clone()
    }

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(10)
    }

    fn list() -> List {
        List {
            lists: vec![(json!(3), McpListKind::Tools, "tools", "name")],
        }
    }

    #[tokio::test]
    async fn a_json_list_answer_keeps_only_what_the_rules_allow() {
        let t = tool("tools = [\"fetch\"]");
        let body = json!({"jsonrpc":"2.0","id":3,"result":{"tools":[{"name":"fetch"},{"name":"rm"},{"x":1}]}});
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let out = filter(&t, &list(), &mut h, Full::new(Bytes::from(body.to_string())), far())
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["result"]["tools"], json!([{"name":"fetch"}]));
    }

    #[tokio::test]
    async fn an_sse_list_answer_is_filtered_event_by_event() {
        let t = tool("deny_tools = [\"rm\"]");
        let other = json!({"jsonrpc":"2.0","method":"notifications/message","params":{"data":"rm"}});
        let resp = json!({"jsonrpc":"2.0","id":3,"result":{"tools":[{"name":"fetch"},{"name":"rm"}]}});
        let text = format!("event: message\ndata: {other}\n\nevent: message\nid: 9\ndata: {resp}\n\n");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        let out = filter(&t, &list(), &mut h, Full::new(Bytes::from(text)), far())
            .await
            .unwrap();
        let out = std::str::from_utf8(&out).unwrap();
        assert!(out.starts_with(&format!("event: message\ndata: {other}\n\n")), "{out}");
        assert!(out.contains("id: 9\n"), "{out}");
        assert!(out.contains("\"fetch\"") && !out.contains("{\"name\":\"rm\"}"), "{out}");
    }

    #[tokio::test]
    async fn a_batch_answer_has_each_of_its_lists_filtered() {
        let t = tool("tools = [\"fetch\"]\nprompts = []");
        let l = List {
            lists: vec![
                (json!(3), McpListKind::Tools, "tools", "name"),
                (json!("p"), McpListKind::Prompts, "prompts", "name"),
            ],
        };
        let body = json!([
            {"jsonrpc":"2.0","id":3,"result":{"tools":[{"name":"fetch"},{"name":"rm"}]}},
            {"jsonrpc":"2.0","id":"p","result":{"prompts":[{"name":"leak"}]}},
            {"jsonrpc":"2.0","id":9,"result":{"tools":[{"name":"rm"}]}}
        ]);
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let out = filter(&t, &l, &mut h, Full::new(Bytes::from(body.to_string())), far())
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v[0]["result"]["tools"], json!([{"name":"fetch"}]));
        assert_eq!(v[1]["result"]["prompts"], json!([]));
        // Not a list request's answer: untouched.
        assert_eq!(v[2]["result"]["tools"], json!([{"name":"rm"}]));
    }

    /// A list answer that never ends is an error at the fetch deadline, not
    /// a hold without end.
    #[tokio::test]
    async fn a_list_answer_is_read_within_the_deadline() {
        let t = tool("tools = [\"fetch\"]");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let never = http_body_util::StreamBody::new(futures_util::stream::pending::<
            Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
        >());
        let soon = Instant::now() + std::time::Duration::from_millis(50);
        let e = filter(&t, &list(), &mut h, never, soon).await.unwrap_err();
        assert!(e["error"]["message"].as_str().unwrap().contains("deadline"), "{e}");
    }

    #[tokio::test]
    async fn an_unreadable_list_answer_is_an_error_not_the_list() {
        let t = tool("tools = [\"fetch\"]");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let e = filter(&t, &list(), &mut h, Full::new(Bytes::from_static(b"xx")), far())
            .await
            .unwrap_err();
        assert_eq!(e["id"], json!(3));
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let e = filter(
            &t,
            &list(),
            &mut h,
            Full::new(Bytes::from_static(b"{\"a\":1,\"a\":2}")),
            far(),
        )
        .await
        .unwrap_err();
        assert!(e["error"]["message"].as_str().unwrap().contains("twice"), "{e}");
    }

    #[test]
    fn only_a_json_post_is_read() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("Application/JSON; charset=utf-8"),
        );
        assert!(applies(&Method::POST, &h));
        assert!(!applies(&Method::GET, &h));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert!(!applies(&Method::POST, &h));
    }
}
