//! One MCP server's conversation on its stdio: requests written to its
//! stdin, one line each, under ids the session chooses (so an answer can
//! only reach the request it answers); its stdout read line by line within
//! the session's bounds, answers routed to their waiting requests and
//! everything else queued for the client's stream. When the server breaks
//! a bound, closes its stdout or the session ends, the conversation is
//! closed: every waiting request gets its error at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt as _;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::pool::protocol::{LineReader, Read};
use egress_api::jsonrpc;

/// Messages of the server for the client's stream that may wait unread;
/// one more closes the session (a server that floods cannot make the
/// executor hold more).
pub const STREAM_QUEUE: usize = 256;

/// What the server answered a request.
pub type Answer = Result<Value, String>;

/// The conversation with one server.
#[derive(Debug)]
pub struct Conversation {
    stdin: tokio::sync::Mutex<pipe::Sender>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    next_id: AtomicU64,
    /// The server's own requests and notifications, for the client's
    /// stream (taken by the stream's one reader, given back when it ends).
    stream: Mutex<Option<mpsc::Receiver<Value>>>,
    closed: CancellationToken,
    why: OnceLock<String>,
}

impl Conversation {
    /// Starts reading `stdout` (lines up to `max_line` bytes, `max_total`
    /// in all) and returns the conversation.
    pub fn start(stdin: pipe::Sender, stdout: pipe::Receiver, max_line: usize, max_total: u64) -> Arc<Conversation> {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let c = Arc::new(Conversation {
            stdin: tokio::sync::Mutex::new(stdin),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stream: Mutex::new(Some(rx)),
            closed: CancellationToken::new(),
            why: OnceLock::new(),
        });
        let max_total = usize::try_from(max_total).unwrap_or(usize::MAX);
        let reader = LineReader::new(stdout, max_line, max_total);
        tokio::spawn(read(Arc::downgrade(&c), c.closed.clone(), reader, tx));
        c
    }

    /// Closes the conversation (the first reason stays): waiting requests
    /// fail with it, the stream ends.
    pub fn close(&self, why: impl Into<String>) {
        let _ = self.why.set(why.into());
        self.closed.cancel();
        let waiting: Vec<_> = self.lock().drain().collect();
        let why = self.why();
        for (_, tx) in waiting {
            let _ = tx.send(Err(why.clone()));
        }
    }

    /// Why it closed (empty while open).
    pub fn why(&self) -> String {
        self.why.get().cloned().unwrap_or_default()
    }

    /// Resolves once the conversation is closed.
    pub async fn closed(&self) {
        self.closed.cancelled().await
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<Answer>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `message` (a request, its `id` replaced by one of the
    /// session's) and waits at most `within` for its answer: the server's
    /// whole response object, its `id` still the session's.
    pub async fn request(&self, message: &jsonrpc::Message, within: Duration) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.lock().insert(id, tx);
        if self.is_closed() {
            self.lock().remove(&id);
            return Err(self.why());
        }
        if let Err(e) = self.write(&message.to_value(Some(Value::from(id)))).await {
            self.lock().remove(&id);
            return Err(e);
        }
        match tokio::time::timeout(within, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(self.why()),
            Err(_) => {
                self.lock().remove(&id);
                Err(format!("the server did not answer within {} ms", within.as_millis()))
            }
        }
    }

    /// Writes one message (a notification, or the client's response) as a
    /// line on the server's stdin.
    pub async fn write(&self, message: &Value) -> Result<(), String> {
        let mut line = serde_json::to_vec(message).map_err(|e| e.to_string())?;
        line.push(b'\n');
        let mut stdin = self.stdin.lock().await;
        tokio::select! {
            r = stdin.write_all(&line) => r.map_err(|e| format!("cannot write to the server: {e}")),
            _ = self.closed.cancelled() => Err(self.why()),
        }
    }

    /// The client's stream of the server's messages, if no one else reads
    /// it; given back when the lease drops.
    pub fn lease_stream(conv: &Arc<Conversation>) -> Option<StreamLease> {
        let rx = conv.stream.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        Some(StreamLease {
            conv: conv.clone(),
            rx: Some(rx),
        })
    }

    fn answer(&self, id: u64, v: Answer) {
        if let Some(tx) = self.lock().remove(&id) {
            let _ = tx.send(v);
        }
    }
}

/// The one reader of a session's stream of server messages.
#[derive(Debug)]
pub struct StreamLease {
    conv: Arc<Conversation>,
    rx: Option<mpsc::Receiver<Value>>,
}

impl StreamLease {
    /// The next message (`None` once the conversation is closed).
    pub async fn next(&mut self) -> Option<Value> {
        let rx = self.rx.as_mut()?;
        tokio::select! {
            m = rx.recv() => m,
            _ = self.conv.closed.cancelled() => None,
        }
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            *self.conv.stream.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
        }
    }
}

/// The reader of the server's stdout, until it ends or breaks a bound.
async fn read(
    conv: std::sync::Weak<Conversation>,
    closed: CancellationToken,
    mut reader: LineReader<pipe::Receiver>,
    stream: mpsc::Sender<Value>,
) {
    loop {
        let line = tokio::select! {
            l = reader.next_with(jsonrpc::parse_strict) => l,
            _ = closed.cancelled() => return,
        };
        let Some(c) = conv.upgrade() else { return };
        let v = match line {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                c.close(format!("the server sent a line that is not JSON: {e}"));
                return;
            }
            Err(Read::Eof) => {
                c.close("the server closed its stdout");
                return;
            }
            Err(Read::Violation(v)) => {
                c.close(format!("the server broke a bound: {v}"));
                return;
            }
            Err(Read::Failed(e)) => {
                c.close(format!("cannot read the server: {e}"));
                return;
            }
            // `next_with` hands lines to the parser: no child-protocol message.
            Err(Read::Msg(m)) => {
                c.close(format!("unexpected `{}`", m.kind()));
                return;
            }
        };
        let is_answer = v.get("method").is_none() && (v.get("result").is_some() || v.get("error").is_some());
        if is_answer {
            // An answer to an id the session did not send is dropped.
            if let Some(id) = v.get("id").and_then(Value::as_u64) {
                c.answer(id, Ok(v));
            }
            continue;
        }
        if stream.try_send(v).is_err() {
            c.close(format!(
                "the server sent more than {STREAM_QUEUE} messages that no client read"
            ));
            return;
        }
    }
}
