//! The executor's side of the child protocol: a bounded reader of the
//! child's newline-delimited JSON on fd 4. The message types and the
//! encoding are shared with tools through `egress_tool::protocol` (one
//! definition); the rules (order, caps, what is a violation) are in
//! `docs/protocol.md`.

use tokio::io::{AsyncRead, AsyncReadExt};

pub use egress_tool::protocol::{encode, ChildMsg, ParentMsg, IPC_FDS_VALUE, IPC_FDS_VAR};

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

/// Bytes asked of the pipe per read (a Linux pipe's default capacity).
const READ_CHUNK: usize = 64 << 10;

/// Reads newline-delimited messages with a cap per line and per run.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf`.
    start: usize,
    /// Unconsumed bytes already searched for a newline (none there): each
    /// byte is looked at once, however many reads a long line takes.
    scanned: usize,
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
            scanned: 0,
            max_line,
            max_total,
            total: 0,
            eof: false,
        }
    }

    /// The next message. Cancel-safe: bytes read stay buffered.
    pub async fn next(&mut self) -> Read {
        self.next_with(parse_line).await.unwrap_or_else(|r| r)
    }

    /// The next line (its `\n` taken off) handed to `f`, or why there is
    /// none: [`Read::Eof`], [`Read::Violation`] (a line over the cap, more
    /// bytes than the total allows, an unterminated last line) or
    /// [`Read::Failed`]. Cancel-safe, as [`LineReader::next`].
    pub async fn next_with<T>(&mut self, f: impl FnOnce(&[u8]) -> T) -> Result<T, Read> {
        loop {
            let from = self.start + self.scanned;
            if let Some(pos) = self.buf[from..].iter().position(|&b| b == b'\n') {
                let pos = self.scanned + pos;
                self.scanned = 0;
                if pos > self.max_line {
                    return Err(Read::Violation(format!(
                        "protocol line longer than {} bytes",
                        self.max_line
                    )));
                }
                let line = &self.buf[self.start..self.start + pos];
                let parsed = f(line);
                self.start += pos + 1;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                return Ok(parsed);
            }
            self.scanned = self.buf.len() - self.start;
            if self.buf.len() - self.start > self.max_line {
                return Err(Read::Violation(format!(
                    "protocol line longer than {} bytes",
                    self.max_line
                )));
            }
            if self.eof {
                return Err(if self.buf.len() == self.start {
                    Read::Eof
                } else {
                    Read::Violation("unterminated last line before EOF".into())
                });
            }
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            // Straight into the buffer, a pipe's worth at a time.
            self.buf.reserve(READ_CHUNK);
            match self.inner.read_buf(&mut self.buf).await {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.total += n;
                    if self.total > self.max_total {
                        return Err(Read::Violation(format!(
                            "more than {} protocol bytes in one run",
                            self.max_total
                        )));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Read::Failed(e)),
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

    /// Yields its bytes `step` at a time, as a pipe filled slowly does.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let n = self.step.min(buf.remaining()).min(self.data.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.data[at..at + n]);
            self.at += n;
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// Lines split across many reads, and several lines in one read: the
    /// search resumes where it stopped, and restarts after each line.
    #[tokio::test]
    async fn lines_across_reads_and_reads_across_lines() {
        let long = format!("{{\"t\":\"result\",\"output\":\"{}\"}}\n", "x".repeat(100_000));
        let input = format!("{{\"t\":\"booted\"}}\n{long}{{\"t\":\"ready\"}}\n{long}");
        for step in [1, 7, 4096, 70_000, 1 << 20] {
            let r = Trickle {
                data: input.clone().into_bytes(),
                at: 0,
                step,
            };
            let mut r = LineReader::new(r, 200_000, 1 << 20);
            let mut kinds = Vec::new();
            loop {
                match r.next().await {
                    Read::Msg(ChildMsg::Result { output }) => {
                        assert_eq!(output.as_str().map(str::len), Some(100_000));
                        kinds.push("result".to_string());
                    }
                    Read::Msg(m) => kinds.push(m.kind().to_string()),
                    Read::Eof => break,
                    other => panic!("step {step}: {other:?}"),
                }
            }
            assert_eq!(kinds, ["booted", "result", "ready", "result"], "step {step}");
        }
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
}
