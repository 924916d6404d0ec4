//! The child protocol's messages: newline-delimited JSON, one object per
//! line, on fds 3 (the child reads) and 4 (the child writes). Both sides use
//! these types: the executor (`egress_executor::pool::protocol`, which adds its
//! bounded reader) and tools (`crate::Channel`). The rules (order, caps, what
//! is a violation) are in `docs/protocol.md`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The environment variable announcing the protocol's fds.
pub const IPC_FDS_VAR: &str = "LOOM_IPC_FDS";
/// Its value: child reads fd 3, writes fd 4.
pub const IPC_FDS_VALUE: &str = "3,4";

/// Child → parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum ChildMsg {
    Booted,
    Ready,
    Emit { fact: Value },
    Result { output: Value },
    Error { message: String },
}

/// Parent → child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum ParentMsg {
    Invoke {
        run_id: String,
        input: Value,
        idempotency_key: Option<String>,
    },
    Abort,
}

impl ChildMsg {
    /// The message's `t`, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            ChildMsg::Booted => "booted",
            ChildMsg::Ready => "ready",
            ChildMsg::Emit { .. } => "emit",
            ChildMsg::Result { .. } => "result",
            ChildMsg::Error { .. } => "error",
        }
    }
}

/// One message encoded as a line (with the trailing newline).
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    v.push(b'\n');
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_invoke() {
        let line = encode(&ParentMsg::Invoke {
            run_id: "r1".into(),
            input: serde_json::json!({"q": 1}),
            idempotency_key: None,
        });
        assert_eq!(
            String::from_utf8(line).unwrap(),
            "{\"t\":\"invoke\",\"run_id\":\"r1\",\"input\":{\"q\":1},\"idempotency_key\":null}\n"
        );
        assert_eq!(encode(&ParentMsg::Abort), b"{\"t\":\"abort\"}\n");
    }

    #[test]
    fn child_messages_round_trip() {
        for m in [
            ChildMsg::Booted,
            ChildMsg::Ready,
            ChildMsg::Emit {
                fact: serde_json::json!({"a": 1}),
            },
            ChildMsg::Result {
                output: serde_json::json!([1]),
            },
            ChildMsg::Error { message: "x".into() },
        ] {
            let line = encode(&m);
            assert!(line.ends_with(b"\n"));
            let back: ChildMsg = serde_json::from_slice(&line).unwrap();
            assert_eq!(back, m);
            assert!(String::from_utf8(line)
                .unwrap()
                .contains(&format!("\"t\":\"{}\"", m.kind())));
        }
    }
}
