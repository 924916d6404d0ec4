//! The child protocol: newline-delimited JSON on fds 3 (child reads) and 4
//! (child writes). Message types for both directions and a bounded line
//! reader; the rules (order, caps, what is a violation) are in
//! `docs/protocol.md`.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt};

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

/// What reading the next message produced.
#[derive(Debug)]
pub enum Read {
    Msg(ChildMsg),
    /// The child closed its end (or every holder of it died).
    Eof,
    /// A violation: the text says which.
    Violation(String),
    /// Reading failed at the OS level.
    Failed(std::io::Error),
}

/// Reads newline-delimited messages with a cap per line and per run.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf`.
    start: usize,
    max_line: usize,
    max_total: usize,
    total: usize,
    eof: bool,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R, max_line: usize, max_total: usize) -> Self {
        LineReader {
            inner,
            buf: Vec::with_capacity(4096),
            start: 0,
            max_line,
            max_total,
            total: 0,
            eof: false,
        }
    }

    /// The next message. Cancel-safe: bytes read stay buffered.
    pub async fn next(&mut self) -> Read {
        loop {
            if let Some(pos) = self.buf[self.start..].iter().position(|&b| b == b'\n') {
                if pos > self.max_line {
                    return Read::Violation(format!("protocol line longer than {} bytes", self.max_line));
                }
                let line = &self.buf[self.start..self.start + pos];
                self.start += pos + 1;
                let parsed = parse_line(line);
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                return parsed;
            }
            if self.buf.len() - self.start > self.max_line {
                return Read::Violation(format!("protocol line longer than {} bytes", self.max_line));
            }
            if self.eof {
                return if self.buf.len() == self.start {
                    Read::Eof
                } else {
                    Read::Violation("unterminated last line before EOF".into())
                };
            }
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            let mut chunk = [0u8; 8192];
            match self.inner.read(&mut chunk).await {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.total += n;
                    if self.total > self.max_total {
                        return Read::Violation(format!("more than {} protocol bytes in one run", self.max_total));
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Read::Failed(e),
            }
        }
    }
}

fn parse_line(line: &[u8]) -> Read {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    match serde_json::from_slice::<ChildMsg>(line) {
        Ok(m) => Read::Msg(m),
        Err(e) => {
            let shown: String = String::from_utf8_lossy(&line[..line.len().min(80)]).into();
            Read::Violation(format!("malformed message ({e}): {shown:?}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_all(input: &[u8], max_line: usize, max_total: usize) -> Vec<String> {
        let mut r = LineReader::new(input, max_line, max_total);
        let mut out = Vec::new();
        loop {
            match r.next().await {
                Read::Msg(m) => out.push(m.kind().to_string()),
                Read::Eof => {
                    out.push("EOF".into());
                    break;
                }
                Read::Violation(v) => {
                    out.push(format!("violation: {v}"));
                    break;
                }
                Read::Failed(e) => {
                    out.push(format!("failed: {e}"));
                    break;
                }
            }
        }
        out
    }

    #[tokio::test]
    async fn reads_messages_in_order() {
        let input = b"{\"t\":\"booted\"}\n{\"t\":\"ready\"}\n{\"t\":\"emit\",\"fact\":{\"a\":1}}\n{\"t\":\"result\",\"output\":[1]}\n";
        assert_eq!(
            read_all(input, 1024, 1 << 20).await,
            ["booted", "ready", "emit", "result", "EOF"]
        );
    }

    #[tokio::test]
    async fn violations() {
        let v = read_all(b"hello\n", 1024, 1 << 20).await;
        assert!(v[0].starts_with("violation: malformed"), "{v:?}");
        let v = read_all(b"{\"t\":\"dance\"}\n", 1024, 1 << 20).await;
        assert!(v[0].starts_with("violation: malformed"), "{v:?}");
        let long = format!("{{\"t\":\"error\",\"message\":\"{}\"}}\n", "x".repeat(5000));
        let v = read_all(long.as_bytes(), 1024, 1 << 20).await;
        assert!(v[0].contains("longer than 1024"), "{v:?}");
        let many = "{\"t\":\"emit\",\"fact\":1}\n".repeat(100);
        let v = read_all(many.as_bytes(), 1024, 500).await;
        assert!(v.last().unwrap().contains("protocol bytes"), "{v:?}");
        let v = read_all(b"{\"t\":\"booted\"}\n{\"t\":", 1024, 1 << 20).await;
        assert_eq!(v[0], "booted");
        assert!(v[1].contains("unterminated"), "{v:?}");
    }

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
}
