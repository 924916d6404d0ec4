//! Client of the proxy's control API: create, activate and end runs, read a
//! run's facts. Talks HTTP/1.1 to the `[proxy] control` socket address (never
//! a name) over kept-alive connections, with a bounded deadline per call.
//! Requests and answers are the `egress-api` types the proxy serves, so the
//! compiler checks that the two agree.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use egress_api::{CreateRun, CreatedRun, EndedRun, ErrorBody, Fact, FactsPage, OwnerReleased, PolicyView, RenewOwner};
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::Serialize;
use serde_json::{Map, Value};

/// Largest control API response body the executor reads.
const MAX_BODY: usize = 4 << 20;
/// Idle keep-alive connections kept to the control API.
const MAX_IDLE: usize = 16;

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// A control API failure.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("proxy control API at {addr} unreachable: {message}")]
    Unreachable { addr: SocketAddr, message: String },
    #[error("proxy control API answered {status} to {what}: {code}: {message}")]
    Rejected {
        what: String,
        status: u16,
        code: String,
        message: String,
    },
    #[error("no control token: EGRESS_CONTROL_TOKEN is unset and {path} cannot be read: {message}")]
    NoToken { path: String, message: String },
    #[error("proxy control API sent an unexpected answer to {what}: {message}")]
    BadAnswer { what: String, message: String },
    #[error("proxy control API did not answer {what} within {ms} ms")]
    Timeout { what: String, ms: u64 },
}

/// A run the proxy created for one child.
#[derive(Debug, Clone)]
pub struct RunCreds {
    pub run_id: String,
    pub proxy_url: String,
    /// What the proxy says the child gets for its egress (`CreatedRun::env`):
    /// proxy variables and credential placeholders.
    pub env: std::collections::BTreeMap<String, String>,
}

/// What a run's child executes, as the executor hashed it before the
/// child started (see `process::identity`): the run carries it
/// (`CreateRun::executables`) and labels itself with the program's digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executables {
    /// The program's lowercase hex SHA-256: the run's `exe_sha256` label.
    pub program_sha256: String,
    /// Absolute path → lowercase hex SHA-256, at most 16.
    pub files: std::collections::BTreeMap<String, String>,
}

/// The label a run's program digest goes under.
pub const EXE_LABEL: &str = "exe_sha256";

/// The control API client.
/// The client side of `[control.tls]`.
struct Tls(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tls({:?})", self.1)
    }
}

#[derive(Debug)]
pub struct ControlClient {
    addr: SocketAddr,
    /// `[control.tls]`: the connector and the name the proxy's
    /// certificate is verified for.
    tls: Option<Tls>,
    token_env: Option<String>,
    token_file: PathBuf,
    token: Mutex<Option<String>>,
    timeout: Duration,
    /// Idle keep-alive connections (bounded by `MAX_IDLE`).
    idle: Mutex<Vec<Sender>>,
    /// The owner name runs are created under (with its lease), if any.
    owner: Mutex<Option<String>>,
    /// The proxy instance that answered last (`x-egress-instance`).
    instance: Mutex<Option<String>>,
    /// Bumped each time the proxy instance changes (a proxy restart).
    generation: std::sync::atomic::AtomicU64,
}

impl ControlClient {
    /// `token_env` is the value of `EGRESS_CONTROL_TOKEN` if set; otherwise the
    /// token is read (once, lazily) from `egress-control.token` in the
    /// proxy's `home` (beside its facts store).
    pub fn new(addr: SocketAddr, home: &std::path::Path, token_env: Option<String>) -> Self {
        let token_file = home.join("egress-control.token");
        ControlClient {
            tls: None,
            addr,
            token_env: token_env.filter(|t| !t.is_empty()),
            token_file,
            token: Mutex::new(None),
            timeout: Duration::from_secs(5),
            idle: Mutex::new(Vec::new()),
            owner: Mutex::new(None),
            instance: Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many times the proxy was seen to restart: children started under
    /// an older generation hold listeners or connections of a proxy process
    /// that is gone, and are recycled.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    fn saw_instance(&self, instance: Option<&str>) {
        let (Some(now), Ok(mut last)) = (instance, self.instance.lock()) else {
            return;
        };
        match last.as_deref() {
            Some(prev) if prev != now => {
                tracing::warn!(previous = prev, now, "the proxy restarted; recycling warm children");
                self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                *last = Some(now.to_owned());
            }
            Some(_) => {}
            None => *last = Some(now.to_owned()),
        }
    }

    /// Creates runs under `owner` from now on (it must hold a lease).
    pub fn set_owner(&self, owner: &str) {
        if let Ok(mut o) = self.owner.lock() {
            *o = Some(owner.to_owned());
        }
    }

    /// `PUT /v1/owners/{owner}`: take or renew the owner's lease.
    pub async fn renew_lease(&self, owner: &str, lease: Duration) -> Result<(), ControlError> {
        let body = RenewOwner {
            lease_ms: lease.as_millis() as u64,
        };
        self.call::<IgnoredAny>(
            "PUT",
            &format!("/v1/owners/{}", path_segment(owner)),
            Some(&body),
            "renew the lease",
        )
        .await
        .map(|_| ())
    }

    /// `DELETE /v1/owners/{owner}`: end every run the owner left; returns how many.
    pub async fn release_owner(&self, owner: &str) -> Result<u64, ControlError> {
        let released: OwnerReleased = self
            .call(
                "DELETE",
                &format!("/v1/owners/{}", path_segment(owner)),
                NO_BODY,
                "release the owner",
            )
            .await?;
        Ok(released.ended as u64)
    }

    /// The control token (also required by the executor's own `/v1` API).
    pub fn token(&self) -> Result<String, ControlError> {
        if let Some(t) = &self.token_env {
            return Ok(t.clone());
        }
        if let Ok(guard) = self.token.lock() {
            if let Some(t) = guard.as_ref() {
                return Ok(t.clone());
            }
        }
        let t = std::fs::read_to_string(&self.token_file)
            .map_err(|e| ControlError::NoToken {
                path: self.token_file.display().to_string(),
                message: e.to_string(),
            })?
            .trim()
            .to_string();
        if let Ok(mut guard) = self.token.lock() {
            *guard = Some(t.clone());
        }
        Ok(t)
    }

    /// `POST /v1/runs` with `activate: false`; `run_id` if the kernel chose
    /// it; `bound` for a child whose listener will be handed over;
    /// `executables`, what its child will run.
    pub async fn create_run(
        &self,
        tool: &str,
        run_id: Option<&str>,
        bound: bool,
        executables: Option<&Executables>,
    ) -> Result<RunCreds, ControlError> {
        let body = create_body(
            tool,
            run_id,
            bound,
            executables,
            self.owner.lock().ok().and_then(|o| o.clone()),
        );
        let created: CreatedRun = self.call("POST", "/v1/runs", Some(&body), "create run").await?;
        Ok(RunCreds {
            run_id: created.run.run_id,
            proxy_url: created.proxy_url,
            env: created.env,
        })
    }

    /// `POST /v1/runs/{id}/activate`, attributing the run to `principal`
    /// (the caller the executor serves; `None`: the control token's).
    pub async fn activate(&self, run_id: &str, principal: Option<&str>) -> Result<(), ControlError> {
        let query = principal.map_or(String::new(), |p| format!("?principal={}", path_segment(p)));
        self.call::<IgnoredAny>(
            "POST",
            &format!("/v1/runs/{}/activate{query}", path_segment(run_id)),
            NO_BODY,
            "activate run",
        )
        .await
        .map(|_| ())
    }

    /// `POST /v1/tools/{tool}/executable_mismatch`: records, at the proxy,
    /// that a child of `tool` was not started because what it would run
    /// does not meet its pins.
    pub async fn report_mismatch(&self, tool: &str, detail: &str) -> Result<(), ControlError> {
        let body = egress_api::ExecutableMismatch {
            detail: detail.chars().take(512).collect(),
        };
        self.call::<IgnoredAny>(
            "POST",
            &format!("/v1/tools/{}/executable_mismatch", path_segment(tool)),
            Some(&body),
            "report an executable mismatch",
        )
        .await
        .map(|_| ())
    }

    /// `DELETE /v1/runs/{id}`: revoke the credential, sever its connections.
    pub async fn end(&self, run_id: &str) -> Result<(), ControlError> {
        self.end_with_facts(run_id).await.map(|_| ())
    }

    /// [`end`](Self::end), and the run's facts from its answer when they are
    /// all there (`None` from a proxy that does not include them, or when
    /// `facts_truncated`: then read them with [`facts`](Self::facts)).
    pub async fn end_with_facts(&self, run_id: &str) -> Result<Option<Vec<Fact>>, ControlError> {
        let ended: EndedRun = self
            .call(
                "DELETE",
                &format!("/v1/runs/{}", path_segment(run_id)),
                NO_BODY,
                "end run",
            )
            .await?;
        Ok((!ended.facts_truncated).then_some(ended.facts))
    }

    /// Check reachability and the token: `GET /v1/runs/{id}` of a run that
    /// does not exist must answer 404 (401/403 mean the token is wrong).
    pub async fn probe(&self) -> Result<(), ControlError> {
        match self
            .call::<IgnoredAny>("GET", "/v1/runs/loom-doctor-probe", NO_BODY, "probe")
            .await
        {
            Ok(_) => Ok(()),
            Err(ControlError::Rejected { status: 404, .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `GET /v1/policy`: the tools the proxy knows.
    pub async fn tools(&self) -> Result<Vec<String>, ControlError> {
        let policy: PolicyView = self.call("GET", "/v1/policy", NO_BODY, "read the policy").await?;
        Ok(policy.tools)
    }

    /// `POST /v1/runs/{id}/mcp`: the proxy's decision on the calls of one
    /// MCP message of the run's session (each refusal a fact before the
    /// answer).
    pub async fn mcp_check(
        &self,
        run_id: &str,
        check: &egress_api::mcp::McpCheck,
    ) -> Result<egress_api::mcp::McpVerdict, ControlError> {
        let path = format!("/v1/runs/{}/mcp", path_segment(run_id));
        self.call("POST", &path, Some(check), "decide MCP calls").await
    }

    /// `POST /v1/runs/{id}/mcp/list`: which entries of a list answer the
    /// run's tool may show.
    pub async fn mcp_list(
        &self,
        run_id: &str,
        list: &egress_api::mcp::McpList,
    ) -> Result<egress_api::mcp::McpListed, ControlError> {
        let path = format!("/v1/runs/{}/mcp/list", path_segment(run_id));
        self.call("POST", &path, Some(list), "filter an MCP list").await
    }

    /// `GET /v1/runs/{id}/facts`.
    pub async fn facts(&self, run_id: &str) -> Result<Vec<Fact>, ControlError> {
        let page: FactsPage = self
            .call(
                "GET",
                &format!("/v1/runs/{}/facts", path_segment(run_id)),
                NO_BODY,
                "read facts",
            )
            .await?;
        Ok(page.facts)
    }

    /// Speaks TLS to the control API (`[control.tls]`): the proxy's
    /// certificate verified against `server_ca` (default `client_ca`) for
    /// the control address.
    pub fn with_tls(mut self, tls: Option<&egress_config::ControlTls>) -> Result<Self, egress_api::tls::TlsError> {
        self.tls = match tls {
            None => None,
            Some(t) => {
                let config = egress_api::tls::client_config(t.server_ca.as_ref().unwrap_or(&t.client_ca), None)?;
                let name = egress_api::tls::server_name(&self.addr.ip().to_string())?;
                Some(Tls(tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)), name))
            }
        };
        Ok(self)
    }

    /// A new connection to the control API.
    async fn connect(&self) -> Result<Sender, ControlError> {
        let unreachable = |m: String| ControlError::Unreachable {
            addr: self.addr,
            message: m,
        };
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        // The connection task ends when the connection closes or its last
        // sender is dropped.
        match &self.tls {
            None => {
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| unreachable(e.to_string()))?;
                tokio::spawn(conn);
                Ok(sender)
            }
            Some(Tls(connector, name)) => {
                let tls = connector
                    .connect(name.clone(), stream)
                    .await
                    .map_err(|e| unreachable(format!("TLS: {e}")))?;
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                    .await
                    .map_err(|e| unreachable(e.to_string()))?;
                tokio::spawn(conn);
                Ok(sender)
            }
        }
    }

    /// A kept-alive connection that is still open and ready, if any.
    async fn idle_sender(&self) -> Option<Sender> {
        loop {
            let mut s = self.idle.lock().ok()?.pop()?;
            if s.is_closed() {
                continue;
            }
            if s.ready().await.is_ok() {
                return Some(s);
            }
        }
    }

    /// One call: `body` as JSON, the answer read as `T` (an error answer as
    /// the API's `ErrorBody`).
    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&impl Serialize>,
        what: &str,
    ) -> Result<T, ControlError> {
        let token = self.token()?;
        let body = body.map(|b| serde_json::to_vec(b).unwrap_or_default());
        let answer = match tokio::time::timeout(self.timeout, self.call_inner(method, path, body, what, &token)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(ControlError::Timeout {
                    what: what.to_string(),
                    ms: self.timeout.as_millis() as u64,
                })
            }
        };
        // No content (`204`) is `null`, for a `T` that takes it.
        let answer: &[u8] = if answer.is_empty() { b"null" } else { &answer };
        serde_json::from_slice(answer).map_err(|e| ControlError::BadAnswer {
            what: what.to_string(),
            message: e.to_string(),
        })
    }

    /// Sends one request; the body of a `2xx` answer, or `Rejected`.
    async fn call_inner(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
        what: &str,
        token: &str,
    ) -> Result<Bytes, ControlError> {
        let unreachable = |m: String| ControlError::Unreachable {
            addr: self.addr,
            message: m,
        };
        let (mut sender, reused) = match self.idle_sender().await {
            Some(s) => (s, true),
            None => (self.connect().await?, false),
        };
        let has_body = body.is_some();
        let bytes = body.map(Bytes::from).unwrap_or_default();
        let build = || {
            let mut req = Request::builder()
                .method(method)
                .uri(path)
                .header(http::header::HOST, self.addr.to_string())
                .header(http::header::AUTHORIZATION, format!("Bearer {token}"));
            if has_body {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
            }
            req.body(Full::new(bytes.clone()))
                .map_err(|e| unreachable(e.to_string()))
        };
        let resp = match sender.send_request(build()?).await {
            Ok(r) => r,
            // A kept-alive connection the server closed while idle: the
            // request was not processed, so it is safe to send it again.
            Err(e) if reused && (e.is_incomplete_message() || e.is_canceled() || e.is_closed()) => {
                sender = self.connect().await?;
                sender
                    .send_request(build()?)
                    .await
                    .map_err(|e| unreachable(e.to_string()))?
            }
            Err(e) => return Err(unreachable(e.to_string())),
        };
        let status = resp.status().as_u16();
        self.saw_instance(resp.headers().get("x-egress-instance").and_then(|v| v.to_str().ok()));
        let collected = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| unreachable(e.to_string()))?
            .to_bytes();
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE && !sender.is_closed() {
                idle.push(sender);
            }
        }
        if !(200..300).contains(&status) {
            let (code, message) = match serde_json::from_slice::<ErrorBody>(&collected) {
                Ok(b) => (b.error.code, b.error.message),
                Err(_) => (
                    String::new(),
                    String::from_utf8_lossy(&collected).chars().take(200).collect(),
                ),
            };
            return Err(ControlError::Rejected {
                what: what.to_string(),
                status,
                code,
                message,
            });
        }
        Ok(collected)
    }
}

/// No request body (the type is only there to name one).
const NO_BODY: Option<&()> = None;

/// The body of `POST /v1/runs` for a child.
fn create_body(
    tool: &str,
    run_id: Option<&str>,
    bound: bool,
    executables: Option<&Executables>,
    owner: Option<String>,
) -> CreateRun {
    let mut labels = Map::new();
    labels.insert("source".into(), Value::from("executor"));
    if let Some(e) = executables {
        labels.insert(EXE_LABEL.into(), Value::from(e.program_sha256.clone()));
    }
    CreateRun {
        tool: tool.to_owned(),
        run_id: run_id.map(str::to_owned),
        labels: Some(labels),
        activate: Some(false),
        owner,
        bound: bound.then_some(true),
        executables: executables.map(|e| e.files.clone()),
    }
}

/// Percent-encode everything but unreserved characters of a path segment.
pub(crate) fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child's run carries what it runs and is labelled with its
    /// program's digest; without them, neither.
    #[test]
    fn a_run_carries_its_executables() {
        let e = Executables {
            program_sha256: "a".repeat(64),
            files: [("/usr/bin/python3".to_string(), "a".repeat(64))].into(),
        };
        let body = serde_json::to_value(create_body("t", None, true, Some(&e), None)).unwrap();
        assert_eq!(body["executables"]["/usr/bin/python3"], Value::from("a".repeat(64)));
        assert_eq!(body["labels"][EXE_LABEL], Value::from("a".repeat(64)));
        assert_eq!(body["labels"]["source"], "executor");
        let bare = serde_json::to_value(create_body("t", None, false, None, None)).unwrap();
        assert!(bare.get("executables").is_none() && bare["labels"].get(EXE_LABEL).is_none());
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(path_segment("run-1_a.b~"), "run-1_a.b~");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn token_file_in_the_proxys_home() {
        let c = ControlClient::new("127.0.0.1:1".parse().unwrap(), std::path::Path::new("/srv/var"), None);
        assert_eq!(c.token_file, PathBuf::from("/srv/var/egress-control.token"));
    }
}
