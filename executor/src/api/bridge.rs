//! `egress-executor mcp --tool T`: a session tool as a stdio MCP server, for
//! agent hosts that only start commands. Each stdin line (newline-delimited
//! JSON-RPC) is POSTed to the executor's `/v1/mcp/<tool>` and its answer
//! written to stdout as one line, beside the session's own stream (`GET`);
//! stdin's end or SIGTERM/SIGINT ends the session (`DELETE`). Logs: stderr.

use std::io::BufRead;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use super::mcp::SESSION_HEADER;
use crate::config::Config;
use crate::proxy::control::{path_segment, ControlClient};

/// The longest stdin line sent on (the default `max_message_bytes`); a
/// longer one is answered with a parse error and skipped, never held whole.
pub const MAX_LINE: usize = 4 << 20;
/// The largest answer (or stream message) read from the executor.
pub const MAX_ANSWER: usize = 16 << 20;
/// Requests of an open session carried at once (a later line waits).
const IN_FLIGHT: usize = 16;
/// Connecting to the executor, and ending the session, each at most this.
const CONNECT: Duration = Duration::from_secs(10);
/// JSON-RPC codes the bridge writes itself.
const PARSE_ERROR: i64 = -32700;
const INTERNAL_ERROR: i64 = -32603;

/// What `egress-executor mcp` was given.
pub struct Options {
    pub config: Option<PathBuf>,
    /// `--executor URL`: the API's base URL, over `[executor] listen`.
    pub executor: Option<String>,
    pub tool: String,
    /// `EGRESS_CONTROL_TOKEN`, if set.
    pub token_env: Option<String>,
}

/// Where the tool's endpoint is, and the bearer token.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `host:port`, what is connected to and sent as `Host`.
    authority: String,
    /// `/v1/mcp/<tool>` (after the base URL's own path, if any).
    path: String,
    token: String,
}

impl Endpoint {
    /// The endpoint of `tool` under `base` (`http://host:port[/prefix]`).
    pub fn new(base: &str, tool: &str, token: String) -> anyhow::Result<Endpoint> {
        let uri: Uri = base
            .parse()
            .with_context(|| format!("--executor {base:?} is not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            _ => {
                anyhow::bail!("--executor {base:?}: only http://host:port is spoken (the executor's API is plain HTTP)")
            }
        }
        let Some(auth) = uri.authority() else {
            anyhow::bail!("--executor {base:?} names no host");
        };
        let authority = format!("{}:{}", auth.host(), auth.port_u16().unwrap_or(80));
        let prefix = uri.path().trim_end_matches('/');
        Ok(Endpoint {
            authority,
            path: format!("{prefix}/v1/mcp/{}", path_segment(tool)),
            token,
        })
    }

    /// Resolves the options: the base URL from `--executor` or the config's
    /// `[executor] listen` (an unspecified address reached on loopback), the
    /// token as every subcommand finds it (`EGRESS_CONTROL_TOKEN`, else the
    /// token file in the proxy's home).
    pub fn from_options(o: &Options) -> anyhow::Result<Endpoint> {
        let config = match &o.config {
            Some(file) => Some(Config::load(file)?),
            None if o.executor.is_some() && o.token_env.as_deref().is_some_and(|t| !t.is_empty()) => None,
            None => anyhow::bail!("--config FILE is needed (or both --executor URL and EGRESS_CONTROL_TOKEN)"),
        };
        if let Some(c) = &config {
            match c.tool(&o.tool) {
                Some(Some(p)) if p.lifecycle == egress_config::Lifecycle::Session => {}
                _ => anyhow::bail!(
                    "{}: `{}` is not a session tool (lifecycle = \"session\", protocol = \"mcp-stdio\")",
                    c.file.display(),
                    o.tool
                ),
            }
        }
        let base = match (&o.executor, &config) {
            (Some(url), _) => url.clone(),
            (None, Some(c)) => {
                let mut listen = c.executor.listen;
                if listen.ip().is_unspecified() {
                    listen.set_ip(if listen.is_ipv4() {
                        std::net::Ipv4Addr::LOCALHOST.into()
                    } else {
                        std::net::Ipv6Addr::LOCALHOST.into()
                    });
                }
                format!("http://{listen}")
            }
            (None, None) => anyhow::bail!("no executor address: give --config FILE or --executor URL"),
        };
        let token = match &config {
            Some(c) => ControlClient::new(c.control, &c.home, o.token_env.clone()).token()?,
            None => o.token_env.clone().unwrap_or_default(),
        };
        Endpoint::new(&base, &o.tool, token)
    }

    /// One request on a new connection.
    async fn send(
        &self,
        method: Method,
        session: Option<&str>,
        body: Option<Bytes>,
    ) -> Result<http::Response<Incoming>, String> {
        let stream = tokio::time::timeout(CONNECT, tokio::net::TcpStream::connect(&self.authority))
            .await
            .map_err(|_| format!("the executor at {} did not accept a connection", self.authority))?
            .map_err(|e| format!("cannot reach the executor at {}: {e}", self.authority))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("the executor at {}: {e}", self.authority))?;
        // Ends with the connection (after the answer's body is read).
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(&self.path)
            .header(header::HOST, &self.authority)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(header::ACCEPT, "application/json, text/event-stream");
        if let Some(s) = session {
            req = req.header(SESSION_HEADER, s);
        }
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        sender
            .send_request(req)
            .await
            .map_err(|e| format!("the executor at {} did not answer: {e}", self.authority))
    }
}

/// What came of one stdin line.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// A line for stdout.
    Line(Vec<u8>),
    /// Nothing to write (`202`: notifications or responses only).
    Nothing,
}

/// What the reader thread found on stdin.
#[derive(Debug, PartialEq)]
enum Input {
    Line(Vec<u8>),
    /// A line over the bound, skipped.
    TooLong,
}

/// Runs the bridge until stdin ends or a signal comes: then the session is
/// ended (`DELETE`) and it returns.
pub async fn run(options: Options) -> anyhow::Result<()> {
    let endpoint = Arc::new(Endpoint::from_options(&options)?);
    let (out, out_rx) = mpsc::channel::<Vec<u8>>(64);
    let writer = tokio::task::spawn_blocking(move || write_lines(std::io::stdout().lock(), out_rx));
    // A thread of its own: a blocking read of stdin cannot be cancelled,
    // and must not hold the runtime at exit.
    let (in_tx, mut input) = mpsc::channel::<Input>(4);
    std::thread::Builder::new()
        .name("mcp-stdin".into())
        .spawn(move || read_lines(std::io::stdin().lock(), MAX_LINE, &in_tx))
        .context("cannot start the stdin thread")?;
    let stop = CancellationToken::new();
    tokio::spawn(signalled(stop.clone()));
    let session: Arc<OnceLock<String>> = Arc::new(OnceLock::new());
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    let mut stream = None;
    loop {
        while tasks.try_join_next().is_some() {}
        let next = tokio::select! {
            i = input.recv() => i,
            () = stop.cancelled() => break,
        };
        let line = match next {
            None => break,
            Some(Input::TooLong) => {
                tracing::warn!(bound = MAX_LINE, "a stdin line over the bound was skipped");
                let e = error(
                    Value::Null,
                    PARSE_ERROR,
                    &format!("the message is over {MAX_LINE} bytes: skipped"),
                );
                let _ = out.send(e).await;
                continue;
            }
            Some(Input::Line(l)) => l,
        };
        let message: Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                let _ = out
                    .send(error(Value::Null, PARSE_ERROR, &format!("not JSON: {e}")))
                    .await;
                continue;
            }
        };
        let line = Bytes::from(line);
        match session.get() {
            // Before the session: one line at a time (the first opens it).
            None => {
                let posted = tokio::select! {
                    p = post(&endpoint, None, line, &message) => p,
                    () = stop.cancelled() => break,
                };
                let (outcome, opened) = posted;
                if let Outcome::Line(l) = outcome {
                    let _ = out.send(l).await;
                }
                if let Some(id) = opened {
                    tracing::info!(session = %id, "session opened");
                    let _ = session.set(id.clone());
                    stream = Some(tokio::spawn(copy_stream(endpoint.clone(), id, out.clone())));
                }
            }
            Some(id) => {
                let slot = tokio::select! {
                    s = slots.clone().acquire_owned() => s?,
                    () = stop.cancelled() => break,
                };
                let (endpoint, id, out) = (endpoint.clone(), id.clone(), out.clone());
                tasks.spawn(async move {
                    let (outcome, _) = post(&endpoint, Some(&id), line, &message).await;
                    if let Outcome::Line(l) = outcome {
                        let _ = out.send(l).await;
                    }
                    drop(slot);
                });
            }
        }
    }
    // stdin ended: the answers still coming are written first (a signal
    // does not wait for them).
    tokio::select! {
        () = async { while tasks.join_next().await.is_some() {} } => {}
        () = stop.cancelled() => tasks.abort_all(),
    }
    if let Some(id) = session.get() {
        end(&endpoint, id).await;
    }
    if let Some(s) = stream {
        s.abort();
    }
    drop(out);
    // The stream's task lets go of its sender as it is dropped.
    let _ = tokio::time::timeout(CONNECT, writer).await;
    Ok(())
}

/// Cancels `stop` on SIGTERM or SIGINT.
async fn signalled(stop: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot catch SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("signalled: ending the session");
    stop.cancel();
}

/// `DELETE`: ends the session (logged if it cannot).
async fn end(endpoint: &Endpoint, id: &str) {
    let r = tokio::time::timeout(CONNECT, endpoint.send(Method::DELETE, Some(id), None)).await;
    match r {
        Ok(Ok(a)) if a.status().is_success() || a.status() == StatusCode::NOT_FOUND => {
            tracing::info!(session = %id, "session ended");
        }
        Ok(Ok(a)) => tracing::warn!(session = %id, status = %a.status(), "the executor refused to end the session"),
        Ok(Err(e)) => tracing::warn!(session = %id, error = %e, "cannot end the session"),
        Err(_) => tracing::warn!(session = %id, "the executor did not answer the session's end"),
    }
}

/// POSTs one message: what to write, and the session the answer opened.
async fn post(endpoint: &Endpoint, session: Option<&str>, line: Bytes, message: &Value) -> (Outcome, Option<String>) {
    let answer = match endpoint.send(Method::POST, session, Some(line)).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "a message was not carried");
            return (failed(message, &e), None);
        }
    };
    let status = answer.status();
    let opened = match session {
        None => answer
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        Some(_) => None,
    };
    let body = match Limited::new(answer.into_body(), MAX_ANSWER).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            let why = format!("the executor's answer could not be read (at most {MAX_ANSWER} bytes): {e}");
            return (failed(message, &why), opened);
        }
    };
    (outcome(status, &body, message), opened)
}

/// The line an answer becomes: a JSON-RPC answer (any status) as it is, on
/// one line; `202` nothing; anything else an error for the message's requests.
fn outcome(status: StatusCode, body: &[u8], message: &Value) -> Outcome {
    if status == StatusCode::ACCEPTED && body.iter().all(u8::is_ascii_whitespace) {
        return Outcome::Nothing;
    }
    if let Some(line) = one_line(body) {
        let v: Value = serde_json::from_slice(&line).unwrap_or_default();
        let is_rpc = |v: &Value| v.get("jsonrpc").is_some();
        let rpc = match &v {
            Value::Array(a) => !a.is_empty() && a.iter().all(is_rpc),
            v => is_rpc(v),
        };
        if rpc {
            return Outcome::Line(line);
        }
        // The API's own error body (401, 503 no_token).
        if let Some(e) = v.get("error").filter(|e| e.is_object()) {
            let code = e.get("code").and_then(Value::as_str).unwrap_or_default();
            let text = e.get("message").and_then(Value::as_str).unwrap_or_default();
            return failed(message, &format!("the executor answered {status}: {code}: {text}"));
        }
    }
    let shown: String = String::from_utf8_lossy(body).chars().take(200).collect();
    failed(
        message,
        &format!("the executor answered {status} with no JSON-RPC answer: {shown:?}"),
    )
}

/// `body` as one line of JSON (as it is when it is one already), or `None`
/// if it is not JSON.
fn one_line(body: &[u8]) -> Option<Vec<u8>> {
    let body = body.trim_ascii();
    let v: Value = serde_json::from_slice(body).ok()?;
    if body.contains(&b'\n') || body.contains(&b'\r') {
        serde_json::to_vec(&v).ok()
    } else {
        Some(body.to_vec())
    }
}

/// An error answering each request of `message` (a batch's as an array);
/// nothing for notifications and responses (logged when carried).
fn failed(message: &Value, why: &str) -> Outcome {
    let id_of = |m: &Value| m.get("method").and(m.get("id")).cloned();
    match message {
        Value::Array(batch) => {
            let errors: Vec<Value> = batch
                .iter()
                .filter_map(id_of)
                .map(|id| error_value(id, INTERNAL_ERROR, why))
                .collect();
            if errors.is_empty() {
                Outcome::Nothing
            } else {
                Outcome::Line(serde_json::to_vec(&errors).unwrap_or_default())
            }
        }
        m => match id_of(m) {
            Some(id) => Outcome::Line(error(id, INTERNAL_ERROR, why)),
            None => Outcome::Nothing,
        },
    }
}

fn error_value(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

fn error(id: Value, code: i64, message: &str) -> Vec<u8> {
    serde_json::to_vec(&error_value(id, code, message)).unwrap_or_default()
}

/// The session's stream (`GET`): each SSE `data` message to stdout.
async fn copy_stream(endpoint: Arc<Endpoint>, id: String, out: mpsc::Sender<Vec<u8>>) {
    let answer = match endpoint.send(Method::GET, Some(&id), None).await {
        Ok(a) if a.status().is_success() => a,
        Ok(a) => {
            tracing::warn!(status = %a.status(), "the session's stream was refused: the server's notifications are not copied");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "the session's stream could not be opened");
            return;
        }
    };
    let mut body = answer.into_body();
    let mut events = Sse::default();
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(f) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
            Err(e) => {
                tracing::warn!(error = %e, "the session's stream broke");
                return;
            }
        };
        let messages = match events.push(&data) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "the session's stream is dropped");
                return;
            }
        };
        for m in messages {
            match one_line(&m) {
                Some(line) => {
                    if out.send(line).await.is_err() {
                        return;
                    }
                }
                None => tracing::warn!("a stream message that is not JSON was dropped"),
            }
        }
    }
    tracing::info!("the session's stream ended (the session is over)");
}

/// An SSE reader: bytes in, each event's `data` out (its lines joined).
#[derive(Default)]
struct Sse {
    pending: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl Sse {
    fn push(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
            let mut line: Vec<u8> = self.pending.drain(..=i).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.is_empty() {
                if self.has_data {
                    out.push(std::mem::take(&mut self.data));
                    self.has_data = false;
                }
            } else if let Some(rest) = line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(rest);
                self.has_data = true;
            }
            // `event:`, `id:`, `retry:` and comments: nothing to copy.
        }
        if self.pending.len() + self.data.len() > MAX_ANSWER {
            return Err(format!("an event over {MAX_ANSWER} bytes"));
        }
        Ok(out)
    }
}

/// Reads newline-delimited lines, each at most `max` bytes (a longer one is
/// skipped as it streams by and reported `TooLong`); blank lines are
/// skipped. Ends at EOF, a read error, or when the receiver is gone.
fn read_lines(mut r: impl BufRead, max: usize, tx: &mpsc::Sender<Input>) {
    let mut line = Vec::new();
    let mut skipping = false;
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read stdin");
                break;
            }
        };
        if buf.is_empty() {
            let last = if skipping {
                Some(Input::TooLong)
            } else {
                Some(Input::Line(std::mem::take(&mut line)))
            };
            if let Some(i) = last.filter(|i| !blank(i)) {
                let _ = tx.blocking_send(i);
            }
            return;
        }
        let (chunk, used, ends) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        if !skipping {
            if line.len() + chunk.len() > max {
                skipping = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        r.consume(used);
        if ends {
            let item = if skipping {
                Input::TooLong
            } else {
                Input::Line(std::mem::take(&mut line))
            };
            skipping = false;
            if !blank(&item) && tx.blocking_send(item).is_err() {
                return;
            }
        }
    }
}

fn blank(i: &Input) -> bool {
    matches!(i, Input::Line(l) if l.iter().all(u8::is_ascii_whitespace))
}

/// The one writer of stdout: each line whole, then a newline.
fn write_lines(mut w: impl std::io::Write, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(mut l) = lines.blocking_recv() {
        l.push(b'\n');
        if let Err(e) = w.write_all(&l).and_then(|()| w.flush()) {
            tracing::warn!(error = %e, "cannot write stdout");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<Input> {
        let (tx, mut rx) = mpsc::channel(64);
        read_lines(std::io::BufReader::with_capacity(4, input), max, &tx);
        drop(tx);
        let mut out = Vec::new();
        while let Ok(i) = rx.try_recv() {
            out.push(i);
        }
        out
    }

    #[test]
    fn lines_are_bounded_and_a_long_one_skipped() {
        let got = lines(b"{\"a\":1}\r\n\n  \n0123456789abc\n{}\nlast", 10);
        assert_eq!(
            got,
            vec![
                Input::Line(b"{\"a\":1}\r".to_vec()),
                Input::TooLong,
                Input::Line(b"{}".to_vec()),
                Input::Line(b"last".to_vec()),
            ]
        );
        assert_eq!(lines(b"0123456789abc", 10), vec![Input::TooLong]);
    }

    #[test]
    fn sse_events_become_messages() {
        let mut s = Sse::default();
        assert!(s.push(b"event: message\ndata: {\"a\"").unwrap().is_empty());
        let got = s
            .push(b":1}\n\n: comment\n\nevent: message\r\ndata: [1,\r\ndata: 2]\r\n\r\n")
            .unwrap();
        assert_eq!(got, vec![b"{\"a\":1}".to_vec(), b"[1,\n2]".to_vec()]);
        assert_eq!(one_line(b"[1,\n2]").unwrap(), b"[1,2]".to_vec());
    }

    #[test]
    fn answers_pass_and_failures_answer_the_request() {
        let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call"});
        let denied = br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32003,"message":"no"}}"#;
        assert_eq!(outcome(StatusCode::OK, denied, &call), Outcome::Line(denied.to_vec()));
        assert_eq!(
            outcome(StatusCode::NOT_FOUND, denied, &call),
            Outcome::Line(denied.to_vec())
        );
        assert_eq!(outcome(StatusCode::ACCEPTED, b"", &call), Outcome::Nothing);
        let Outcome::Line(l) = outcome(
            StatusCode::UNAUTHORIZED,
            br#"{"error":{"code":"unauthorized","message":"bad token"}}"#,
            &call,
        ) else {
            panic!()
        };
        let v: Value = serde_json::from_slice(&l).unwrap();
        assert_eq!((v["id"].clone(), v["error"]["code"].clone()), (json!(7), json!(-32603)));
        assert!(v["error"]["message"].as_str().unwrap().contains("bad token"), "{v}");
        let Outcome::Line(l) = outcome(
            StatusCode::BAD_GATEWAY,
            b"<html>",
            &json!([call, {"jsonrpc": "2.0", "method": "n"}]),
        ) else {
            panic!()
        };
        let v: Value = serde_json::from_slice(&l).unwrap();
        assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
        assert_eq!(
            failed(&json!({"jsonrpc": "2.0", "method": "notifications/x"}), "x"),
            Outcome::Nothing
        );
    }

    #[test]
    fn endpoints() {
        let e = Endpoint::new("http://127.0.0.1:3130/", "time", "t".into()).unwrap();
        assert_eq!(
            (e.authority.as_str(), e.path.as_str()),
            ("127.0.0.1:3130", "/v1/mcp/time")
        );
        let e = Endpoint::new("http://exec.internal/base/", "a b", "t".into()).unwrap();
        assert_eq!(
            (e.authority.as_str(), e.path.as_str()),
            ("exec.internal:80", "/base/v1/mcp/a%20b")
        );
        assert!(Endpoint::new("https://x:1", "t", "t".into()).is_err());
    }
}
