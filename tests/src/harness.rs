//! Starts a real proxy in-process on `127.0.0.1:0` with a fake DNS server,
//! an in-memory (or given) fact sink and a fixed control token, and talks
//! to its control API. The default config allows `127.0.0.2/32` so origins
//! live there, while the rest of loopback stays denied for negative cases.

use crate::dns::FakeDns;
use crate::raw::{send, RawResponse};
use base64::Engine;
use egress_config::Config;
use egress_proxy::facts::{Fact, FactQuery, FactSink, MemorySink};
use egress_proxy::Handle;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub const TOKEN: &str = "test-control-token-0123456789";

/// One event of a Server-Sent Events stream (a keep-alive comment is none).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub id: String,
    pub event: String,
    pub data: String,
}

pub struct TestProxy {
    pub handle: Option<Handle>,
    pub proxy: SocketAddr,
    pub control: SocketAddr,
    pub dns: FakeDns,
    pub facts: Arc<dyn FactSink>,
}

#[derive(Debug, Clone)]
pub struct TestRun {
    pub id: String,
    pub secret: String,
    pub url: String,
}

impl TestRun {
    /// `Basic base64(id:secret)`.
    pub fn auth(&self) -> String {
        basic(&self.id, &self.secret)
    }
}

pub fn basic(user: &str, pass: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
    )
}

/// The `[proxy]` section used by tests (`extra_proxy` lines are appended to it).
pub fn proxy_section(dns: &FakeDns, extra_proxy: &str) -> String {
    format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\nfacts = \"/nonexistent/facts.db\"\n{}\n[proxy.dns]\nservers = [\"{}\"]\ntimeout_ms = 2000\n",
        if extra_proxy.contains("allow_ranges") { extra_proxy.to_owned() } else { format!("allow_ranges = [\"127.0.0.2/32\"]\n{extra_proxy}") },
        dns.addr
    )
}

impl TestProxy {
    /// Starts a proxy; `tools` is TOML for the `[tools.*]` tables.
    pub async fn start(tools: &str) -> TestProxy {
        Self::start_with("", tools, None).await
    }

    /// Starts a proxy with extra `[proxy]` keys and optionally a given fact sink.
    pub async fn start_with(extra_proxy: &str, tools: &str, facts: Option<Arc<dyn FactSink>>) -> TestProxy {
        let dns = FakeDns::start().await;
        Self::start_full(dns, extra_proxy, tools, facts).await
    }

    /// Starts a proxy with the test `[proxy]` section plus `extra_proxy`, and `tools`;
    /// without a given sink, facts go to an in-memory sink the test can read.
    pub async fn start_full(
        dns: FakeDns,
        extra_proxy: &str,
        tools: &str,
        facts: Option<Arc<dyn FactSink>>,
    ) -> TestProxy {
        let text = format!("{}\n{tools}", proxy_section(&dns, extra_proxy));
        let facts = facts.unwrap_or_else(|| Arc::new(MemorySink::new(10_000)));
        Self::start_config(dns, &text, None, Some(facts)).await
    }

    /// Starts a proxy on a complete config text. `config_path` enables reloads;
    /// `facts: None` uses the fact store the config names.
    pub async fn start_config(
        dns: FakeDns,
        text: &str,
        config_path: Option<PathBuf>,
        facts: Option<Arc<dyn FactSink>>,
    ) -> TestProxy {
        let config = Config::parse(text, "test.toml").unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"));
        let handle = egress_proxy::start(egress_proxy::Options {
            config,
            config_path,
            control_token: Some(TOKEN.into()),
            facts,
            listeners: Default::default(),
        })
        .await
        .unwrap();
        TestProxy {
            proxy: handle.proxy_addr,
            control: handle.control_addr,
            facts: handle.shared.facts.clone(),
            handle: Some(handle),
            dns,
        }
    }

    /// Graceful shutdown, as SIGTERM does it.
    pub async fn shutdown(mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown().await;
        }
    }

    /// The first complete `event: <event>` block (any event with `""`) of
    /// the control API's Server-Sent Events stream at `path`, as raw text;
    /// fails after 5 s.
    pub async fn sse_event(&self, path: &str, event: &str) -> String {
        self.sse_event_as(TOKEN, path, event).await
    }

    /// [`sse_event`](Self::sse_event), read with another principal's `token`.
    pub async fn sse_event_as(&self, token: &str, path: &str, event: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(self.control).await.unwrap();
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let want = format!("event: {event}");
        let mut seen = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            loop {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "the stream closed");
                seen.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&seen);
                if let Some(i) = text.find(&want) {
                    if let Some(end) = text[i..].find("\n\n") {
                        return text[i..i + end].to_owned();
                    }
                }
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .unwrap_or_else(|_| panic!("no {want:?} on {path}"))
    }

    /// The first `n` events of the control API's Server-Sent Events stream
    /// at `path`, read as `token`: each one's `id`, `event` and `data`
    /// (the data lines joined by `\n`); fails after 5 s.
    pub async fn sse_events_as(&self, token: &str, path: &str, n: usize) -> Vec<SseEvent> {
        use http_body_util::BodyExt as _;
        let tcp = tokio::net::TcpStream::connect(self.control).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header("host", "x")
            .header("authorization", format!("Bearer {token}"))
            .header("accept", "text/event-stream")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let read = async {
            let resp = send.send_request(req).await.unwrap();
            assert_eq!(resp.status(), 200, "{path}");
            let mut body = resp.into_body();
            let (mut text, mut events) = (String::new(), vec![]);
            while events.len() < n {
                let frame = body.frame().await.expect("the stream closed").unwrap();
                let Some(chunk) = frame.data_ref() else { continue };
                text.push_str(std::str::from_utf8(chunk).unwrap());
                while let Some(end) = text.find("\n\n") {
                    let block: String = text.drain(..end + 2).collect();
                    let mut e = SseEvent::default();
                    for line in block.lines() {
                        let (field, value) = line.split_once(':').unwrap_or((line, ""));
                        let value = value.strip_prefix(' ').unwrap_or(value).to_owned();
                        match field {
                            "id" => e.id = value,
                            "event" => e.event = value,
                            "data" if e.data.is_empty() => e.data = value,
                            "data" => e.data = format!("{}\n{value}", e.data),
                            _ => {}
                        }
                    }
                    if !e.id.is_empty() {
                        events.push(e);
                    }
                }
            }
            events
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} events on {path}"))
    }

    /// The facts (up to 1000) whose reason is `reason`.
    pub async fn facts_with_reason(&self, reason: &str) -> Vec<Value> {
        let (_, v) = self.control("GET", "/v1/facts?after=0&limit=1000", None).await;
        v["facts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["reason"] == reason)
            .cloned()
            .collect()
    }

    /// A control API call; returns status and JSON body (or `null`).
    pub async fn control(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let r = self.control_raw(method, path, body, Some(TOKEN)).await;
        (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
    }

    /// A control API call, checked against the API's OpenAPI document: the
    /// route and the answer's status must be documented, a request that
    /// succeeds must match the document (parameters and body), a request
    /// refused as malformed must not, and every JSON answer must match the
    /// schema of its status. So every control call of the tests is also a
    /// test of the document.
    pub async fn control_raw(&self, method: &str, path: &str, body: Option<Value>, token: Option<&str>) -> RawResponse {
        let r = control_call(self.control, method, path, body.clone(), token).await;
        check_against_openapi(method, path, body.as_ref(), &r);
        r
    }

    /// Creates an active run for `tool`.
    pub async fn run(&self, tool: &str) -> TestRun {
        self.run_with(json!({ "tool": tool })).await
    }

    pub async fn run_with(&self, body: Value) -> TestRun {
        let (status, v) = self.control("POST", "/v1/runs", Some(body)).await;
        assert_eq!(status, 201, "create run: {v}");
        TestRun {
            id: v["run_id"].as_str().unwrap().to_owned(),
            secret: v["secret"].as_str().unwrap().to_owned(),
            url: v["proxy_url"].as_str().unwrap().to_owned(),
        }
    }

    pub async fn end(&self, run: &TestRun) {
        let (status, v) = self.control("DELETE", &format!("/v1/runs/{}", run.id), None).await;
        assert_eq!(status, 200, "end run: {v}");
    }

    /// Slots in use for a run, from the control API.
    pub async fn slots_in_use(&self, run: &TestRun) -> u64 {
        let (_, v) = self.control("GET", &format!("/v1/runs/{}", run.id), None).await;
        v["slots"]["in_use"].as_u64().unwrap()
    }

    /// Polls until the run's slots in use reach `n`; panics after 5 s.
    pub async fn wait_slots(&self, run: &TestRun, n: u64) {
        let t0 = std::time::Instant::now();
        loop {
            if self.slots_in_use(run).await == n {
                return;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "slots never reached {n}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Waits (at most 5 s) until the run's pool holds `n` idle upstream
    /// connections (`upstream_idle` of `GET /v1/runs/{id}`).
    pub async fn wait_upstream_idle(&self, run_id: &str, n: u64) {
        let t0 = std::time::Instant::now();
        loop {
            let (_, v) = self.control("GET", &format!("/v1/runs/{run_id}"), None).await;
            if v["upstream_idle"].as_u64() == Some(n) {
                return;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "upstream_idle never reached {n}: {v}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// All facts recorded so far.
    pub async fn facts(&self) -> Vec<Fact> {
        self.facts
            .query(FactQuery {
                after: 0,
                limit: 100_000,
                run_id: None,
            })
            .await
            .unwrap()
    }

    /// A plain-HTTP proxy request (absolute-form) with the run's credential.
    pub async fn get(&self, run: &TestRun, url: &str, extra_headers: &str) -> RawResponse {
        let host = url.trim_start_matches("http://").split('/').next().unwrap_or("");
        let req = format!(
            "GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\nConnection: close\r\n{extra_headers}\r\n",
            run.auth()
        );
        send(self.proxy, req.as_bytes()).await
    }

    /// A CONNECT with the run's credential; returns the response and the stream.
    pub async fn connect(&self, run: &TestRun, target: &str) -> (RawResponse, tokio::net::TcpStream) {
        crate::raw::connect(self.proxy, target, Some(&run.auth())).await
    }

    /// Prometheus text from `/metrics`.
    pub async fn metrics(&self) -> String {
        self.control_raw("GET", "/metrics", None, None).await.text()
    }
}

/// The proxy's OpenAPI document, as the code generates it.
pub fn openapi() -> &'static crate::openapi::Spec {
    static SPEC: std::sync::OnceLock<crate::openapi::Spec> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        let doc = serde_json::to_value(egress_proxy::openapi()).expect("the OpenAPI document serializes");
        crate::openapi::Spec::new(doc)
    })
}

/// Panics when a control call disagrees with the OpenAPI document.
pub fn check_against_openapi(method: &str, path: &str, body: Option<&Value>, r: &RawResponse) {
    if path.starts_with("/v1/openapi.json") {
        return;
    }
    let Some(op) = openapi().operation(method, path) else {
        assert_eq!(
            r.status, 404,
            "{method} {path} is not in the OpenAPI document but answered {}",
            r.status
        );
        return;
    };
    assert!(
        op.documents(r.status),
        "{method} {path} answered {} ({}), which the OpenAPI document does not list",
        r.status,
        r.text()
    );
    // The request against the document: its parameters, and its body.
    let mut problems = op.check_params(path);
    match body {
        Some(b) => problems.extend(op.check_request(b)),
        None if op.requires_body() => problems.push("no body, which the document requires".into()),
        None => {}
    }
    if (200..300).contains(&r.status) {
        assert!(
            problems.is_empty(),
            "{method} {path}: the request {body:?} does not match the document: {problems:?}"
        );
    }
    // And the reverse: a request the document allows is not refused as
    // malformed, or the document says less than the server enforces.
    let code = serde_json::from_slice::<Value>(&r.body)
        .ok()
        .map(|v| v["error"]["code"].clone());
    let malformed = code.is_some_and(|c| c == "bad_request" || c == "bad_lease");
    if matches!(r.status, 400 | 422) && malformed {
        assert!(
            !problems.is_empty(),
            "{method} {path} {body:?} was refused ({}) although the document allows it: a rule the document does not state",
            r.text()
        );
    }
    let json = r
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json"));
    if json {
        let v: Value = serde_json::from_slice(&r.body).expect("a JSON answer");
        let problems = op.check_response(r.status, &v);
        assert!(
            problems.is_empty(),
            "{method} {path} → {}: the answer does not match the document: {problems:?}\n{v}",
            r.status
        );
    }
}

/// Creates an active run for `tool` on the control API at `addr`; returns (run id, secret).
pub async fn create_run_at(control: SocketAddr, tool: &str) -> (String, String) {
    let r = control_call(control, "POST", "/v1/runs", Some(json!({ "tool": tool })), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    (
        v["run_id"].as_str().unwrap().into(),
        v["secret"].as_str().unwrap().into(),
    )
}

/// Every fact on the control API at `addr`, paging by cursor.
pub async fn all_facts_at(control: SocketAddr) -> Vec<Value> {
    let mut out = vec![];
    let mut after = 0;
    loop {
        let path = format!("/v1/facts?after={after}&limit=1000");
        let r = control_call(control, "GET", &path, None, Some(TOKEN)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let page = v["facts"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = v["next"].as_u64().unwrap();
        out.extend(page);
    }
}

/// The `p` quantile of `v` (sorted in place), in milliseconds with two decimals.
pub fn percentile_ms(v: &mut [std::time::Duration], p: f64) -> f64 {
    v.sort();
    if v.is_empty() {
        return 0.0;
    }
    (v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e5).round() / 100.0
}

/// The text of one control API request (`Connection: close`).
pub fn control_request(method: &str, path: &str, body: Option<Value>, token: Option<&str>) -> String {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: control\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    req
}

/// One control API call on `addr`.
pub async fn control_call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> RawResponse {
    let req = control_request(method, path, body, token);
    // Control calls are not what is measured: a generous cap.
    crate::raw::send_within(addr, req.as_bytes(), std::time::Duration::from_secs(60)).await
}

/// Reads one sample value from Prometheus text (`name{labels}` exactly as rendered).
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// One keep-alive client of the run whose credential is `auth`, asking for
/// distinct hosts no policy allows (`{tag}-{i}.denied.example`, so that
/// identical denials rarely fold) until `stop` is set or `limit` were
/// answered: how many were answered `403`. Floods of denials are many of
/// these at once.
pub async fn deny_distinct(
    proxy: SocketAddr,
    auth: &str,
    tag: &str,
    stop: &std::sync::atomic::AtomicBool,
    limit: u64,
) -> u64 {
    use tokio::io::AsyncWriteExt as _;
    let Ok(mut s) = tokio::net::TcpStream::connect(proxy).await else {
        return 0;
    };
    let mut done = 0;
    while done < limit && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let host = format!("{tag}-{done}.denied.example");
        let req = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\n\r\n");
        if s.write_all(req.as_bytes()).await.is_err() {
            break;
        }
        match crate::raw::read_response(&mut s, false).await {
            Ok(r) if r.status == 403 => done += 1,
            _ => break,
        }
    }
    done
}
