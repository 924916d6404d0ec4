//! JSON-RPC 2.0 as MCP carries it, read strictly, the same way wherever a
//! call is decided (the executor's MCP endpoint, the proxy's interception
//! of a remote MCP server): a message is parsed once, within a depth bound,
//! with duplicate object keys refused (two readers could otherwise see two
//! different calls), sorted into requests, notifications and responses,
//! and written again from what was understood (so nothing unread passes).

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;

/// The deepest nesting of arrays and objects a message may have.
pub const MAX_DEPTH: usize = 64;

/// The JSON-RPC error codes the endpoint answers with.
pub mod code {
    /// Not JSON (or duplicate keys, or too deep).
    pub const PARSE_ERROR: i64 = -32700;
    /// JSON, but not a JSON-RPC message.
    pub const INVALID_REQUEST: i64 = -32600;
    /// Refused by the tool's MCP rules (`data.reason`, `data.fact_id`).
    pub const DENIED: i64 = -32003;
    /// The session's server failed, went away or did not answer in time.
    pub const SERVER_ERROR: i64 = -32603;
}

/// `bytes` as JSON, strictly: at most [`MAX_DEPTH`] levels, no object with
/// a key twice. The error says what is wrong (never the bytes).
pub fn parse_strict(bytes: &[u8]) -> Result<Value, String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = Strict { depth: 0 }.deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(v)
}

struct Strict {
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl Strict {
    fn deeper<E: de::Error>(&self) -> Result<Strict, E> {
        if self.depth >= MAX_DEPTH {
            return Err(E::custom(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        Ok(Strict { depth: self.depth + 1 })
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(self.deeper()?)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(self.deeper()?)?;
            if out.insert(k.clone(), v).is_some() {
                return Err(de::Error::custom(format!(
                    "the key {:?} appears twice in one object",
                    k.chars().take(64).collect::<String>()
                )));
            }
        }
        Ok(Value::Object(out))
    }
}

/// One JSON-RPC message from the client.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A call that wants an answer: `id` is a string or an integer.
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    /// A call without an answer.
    Notification { method: String, params: Option<Value> },
    /// The client's answer to a request of the server (`result` or `error`).
    Response { id: Value, outcome: Outcome },
}

/// A response's one outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Result(Value),
    Error(Value),
}

/// What one POST body holds: one message, or a batch of them.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    One(Message),
    Batch(Vec<Message>),
}

/// A parsed body sorted into messages; the error is the JSON-RPC error
/// to answer (`id` null) with its code.
pub fn incoming(v: Value) -> Result<Incoming, (i64, String)> {
    match v {
        Value::Array(items) if items.is_empty() => Err((code::INVALID_REQUEST, "an empty batch".into())),
        Value::Array(items) => items
            .into_iter()
            .map(message)
            .collect::<Result<Vec<_>, _>>()
            .map(Incoming::Batch)
            .map_err(|e| (code::INVALID_REQUEST, e)),
        v => message(v).map(Incoming::One).map_err(|e| (code::INVALID_REQUEST, e)),
    }
}

/// One value as a message: `"jsonrpc": "2.0"`, and either a `method`
/// (with an `id` for a request) or an `id` with one of `result`, `error`.
/// Keys outside the specification are refused.
pub fn message(v: Value) -> Result<Message, String> {
    let Value::Object(mut m) = v else {
        return Err("a JSON-RPC message is an object".into());
    };
    if m.remove("jsonrpc") != Some(Value::String("2.0".into())) {
        return Err("\"jsonrpc\" must be \"2.0\"".into());
    }
    let id = m.remove("id");
    if let Some(id) = &id {
        if !(id.is_string() || id.is_i64() || id.is_u64()) {
            return Err("\"id\" must be a string or an integer".into());
        }
    }
    let method = m.remove("method");
    let params = m.remove("params");
    let result = m.remove("result");
    let error = m.remove("error");
    if let Some(k) = m.keys().next() {
        return Err(format!("unknown member {:?}", k.chars().take(64).collect::<String>()));
    }
    if let Some(p) = &params {
        if !(p.is_object() || p.is_array()) {
            return Err("\"params\" must be an object or an array".into());
        }
    }
    match (method, id, result, error) {
        (Some(Value::String(method)), Some(id), None, None) => Ok(Message::Request { id, method, params }),
        (Some(Value::String(method)), None, None, None) => Ok(Message::Notification { method, params }),
        (Some(_), _, _, _) => Err("\"method\" must be a string, without \"result\" or \"error\"".into()),
        (None, Some(id), Some(r), None) if params.is_none() => Ok(Message::Response {
            id,
            outcome: Outcome::Result(r),
        }),
        (None, Some(id), None, Some(e)) if params.is_none() && e.is_object() => Ok(Message::Response {
            id,
            outcome: Outcome::Error(e),
        }),
        _ => Err("neither a request, a notification nor a response".into()),
    }
}

impl Message {
    /// The message written again from what was read, with `id` in place
    /// of a request's own (the session's id for it).
    pub fn to_value(&self, id: Option<Value>) -> Value {
        let mut m = Map::new();
        m.insert("jsonrpc".into(), Value::from("2.0"));
        match self {
            Message::Request {
                id: own,
                method,
                params,
            } => {
                m.insert("id".into(), id.unwrap_or_else(|| own.clone()));
                m.insert("method".into(), Value::from(method.as_str()));
                if let Some(p) = params {
                    m.insert("params".into(), p.clone());
                }
            }
            Message::Notification { method, params } => {
                m.insert("method".into(), Value::from(method.as_str()));
                if let Some(p) = params {
                    m.insert("params".into(), p.clone());
                }
            }
            Message::Response { id: own, outcome } => {
                m.insert("id".into(), id.unwrap_or_else(|| own.clone()));
                match outcome {
                    Outcome::Result(r) => m.insert("result".into(), r.clone()),
                    Outcome::Error(e) => m.insert("error".into(), e.clone()),
                };
            }
        }
        Value::Object(m)
    }

    /// What the decider needs of a request: its method, what it names
    /// (`params.name`, or `params.uri` for resources) and its arguments.
    pub fn call(&self) -> Option<crate::mcp::McpCall> {
        let Message::Request { method, params, .. } = self else {
            return None;
        };
        let field = |k: &str| params.as_ref().and_then(|p| p.get(k));
        let name = match method.as_str() {
            "resources/read" | "resources/subscribe" | "resources/unsubscribe" => field("uri"),
            _ => field("name"),
        };
        Some(crate::mcp::McpCall {
            method: method.clone(),
            name: name.and_then(Value::as_str).map(str::to_owned),
            arguments: field("arguments").cloned(),
        })
    }
}

/// A JSON-RPC error answer.
pub fn error(id: Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut e = Map::new();
    e.insert("code".into(), Value::from(code));
    e.insert("message".into(), Value::from(message));
    if let Some(d) = data {
        e.insert("data".into(), d);
    }
    serde_json::json!({ "jsonrpc": "2.0", "id": id, "error": Value::Object(e) })
}

/// The answers to a message the rules refused (`verdict.allowed` false):
/// each request's own refusal (`-32003`, its message, `data.reason` and
/// `data.fact_id`), or, for a request that passed, its batch's
/// (`batch_refused`: nothing of the message is sent). One answer for one
/// message, an array for a batch. The same wherever MCP calls are decided.
pub fn refusal(messages: &[Message], batch: bool, verdict: &crate::mcp::McpVerdict) -> Value {
    let mut decisions = verdict.decisions.iter();
    let out: Vec<Value> = messages
        .iter()
        .filter_map(|m| match m {
            Message::Request { id, .. } => Some(id),
            _ => None,
        })
        .map(|id| match decisions.next() {
            Some(d) if !d.allowed => error(
                id.clone(),
                code::DENIED,
                d.message.as_deref().unwrap_or("refused by the tool's MCP rules"),
                Some(serde_json::json!({"reason": d.reason, "fact_id": d.fact_id})),
            ),
            _ => error(
                id.clone(),
                code::DENIED,
                "not sent: another call of its batch was refused",
                Some(serde_json::json!({"reason": "batch_refused"})),
            ),
        })
        .collect();
    match (batch, out.len()) {
        (false, 1) => out.into_iter().next().unwrap_or(Value::Null),
        _ => Value::Array(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        for text in [
            r#"{"a":1,"a":2}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ok","name":"evil"}}"#,
            r#"[{"x":{"y":[{"k":1,"k":1}]}}]"#,
            // The same key written two ways is the same key once read.
            r#"{"name":"a","n\u0061me":"b"}"#,
        ] {
            let e = parse_strict(text.as_bytes()).unwrap_err();
            assert!(e.contains("appears twice"), "{text}: {e}");
        }
        assert!(parse_strict(br#"{"a":1,"b":{"a":2}}"#).is_ok());
    }

    #[test]
    fn a_refused_batch_answers_every_request_and_sends_nothing() {
        use crate::mcp::{McpDecision, McpVerdict};
        let ok = McpDecision {
            allowed: true,
            reason: None,
            fact_id: None,
            message: None,
        };
        let no = McpDecision {
            allowed: false,
            reason: Some("mcp_tool_not_allowed".into()),
            fact_id: Some("f1".into()),
            message: Some("MCP tool \"rm\" is not allowed".into()),
        };
        let verdict = McpVerdict {
            allowed: false,
            decisions: vec![ok, no.clone()],
        };
        let msgs = vec![
            message(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"}})).unwrap(),
            message(json!({"jsonrpc":"2.0","method":"notifications/progress"})).unwrap(),
            message(json!({"jsonrpc":"2.0","id":"x","method":"tools/call","params":{"name":"rm"}})).unwrap(),
        ];
        let v = refusal(&msgs, true, &verdict);
        assert_eq!(v[0]["id"], json!(1));
        assert_eq!(v[0]["error"]["data"]["reason"], json!("batch_refused"));
        assert_eq!((&v[1]["id"], &v[1]["error"]["code"]), (&json!("x"), &json!(-32003)));
        assert_eq!(
            v[1]["error"]["data"],
            json!({"reason": "mcp_tool_not_allowed", "fact_id": "f1"})
        );
        let one = McpVerdict {
            allowed: false,
            decisions: vec![no],
        };
        let v = refusal(&msgs[2..], false, &one);
        assert_eq!(v["id"], json!("x"));
    }

    #[test]
    fn depth_is_bounded() {
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(parse_strict(ok.as_bytes()).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(parse_strict(deep.as_bytes()).unwrap_err().contains("deeper"));
        let very = "[".repeat(100_000);
        assert!(parse_strict(very.as_bytes()).is_err());
    }

    #[test]
    fn trailing_bytes_and_non_json_are_refused() {
        assert!(parse_strict(br#"{"a":1} {"a":2}"#).is_err());
        assert!(parse_strict(b"\xff").is_err());
        assert!(parse_strict(b"").is_err());
    }

    #[test]
    fn messages_are_sorted_and_written_again_from_what_was_read() {
        let req =
            message(json!({"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"f","arguments":{"u":"x"}}}))
                .unwrap();
        let call = req.call().unwrap();
        assert_eq!((call.method.as_str(), call.name.as_deref()), ("tools/call", Some("f")));
        assert_eq!(call.arguments, Some(json!({"u":"x"})));
        assert_eq!(
            req.to_value(Some(json!(99))),
            json!({"jsonrpc":"2.0","id":99,"method":"tools/call","params":{"name":"f","arguments":{"u":"x"}}})
        );
        let read =
            message(json!({"jsonrpc":"2.0","id":"a","method":"resources/read","params":{"uri":"file:///x"}})).unwrap();
        assert_eq!(read.call().unwrap().name.as_deref(), Some("file:///x"));
        assert!(matches!(
            message(json!({"jsonrpc":"2.0","method":"notifications/initialized"})),
            Ok(Message::Notification { .. })
        ));
        assert!(matches!(
            message(json!({"jsonrpc":"2.0","id":1,"result":{}})),
            Ok(Message::Response { .. })
        ));
        for bad in [
            json!({"id":1,"method":"x"}),
            json!({"jsonrpc":"1.0","id":1,"method":"x"}),
            json!({"jsonrpc":"2.0","id":null,"method":"x"}),
            json!({"jsonrpc":"2.0","id":1.5,"method":"x"}),
            json!({"jsonrpc":"2.0","id":{},"method":"x"}),
            json!({"jsonrpc":"2.0","id":1,"method":3}),
            json!({"jsonrpc":"2.0","id":1,"method":"x","params":"s"}),
            json!({"jsonrpc":"2.0","id":1,"method":"x","extra":1}),
            json!({"jsonrpc":"2.0","id":1,"result":{},"error":{}}),
            json!({"jsonrpc":"2.0","id":1}),
            json!("tools/call"),
        ] {
            assert!(message(bad.clone()).is_err(), "{bad}");
        }
        assert!(incoming(json!([])).is_err());
        assert!(matches!(incoming(json!([{"jsonrpc":"2.0","method":"a"}])), Ok(Incoming::Batch(b)) if b.len() == 1));
    }
}
