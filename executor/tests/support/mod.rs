//! Test support for the executor's integration tests: a fake proxy control
//! API on 127.0.0.1:0 that records every call, scratch directories, config
//! files, and `/proc` scans for processes carrying a marker variable.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::Notify;

pub const TOKEN: &str = "test-control-token-0123456789";

/// One recorded control call: (method+path, body).
#[derive(Debug, Clone)]
pub struct Call {
    pub what: String,
    pub body: Value,
}

#[derive(Default)]
pub struct FakeState {
    pub calls: Vec<Call>,
    pub runs: HashMap<String, String>,
    /// Facts returned for every run (run_id filled in).
    pub facts: Vec<Value>,
    pub next: u64,
    /// Tools `GET /v1/policy` lists.
    pub policy_tools: Vec<String>,
}

/// The fake control API.
#[derive(Clone)]
pub struct FakeControl {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<FakeState>>,
    /// Notified on every activation.
    pub activated: Arc<Notify>,
}

type S = (Arc<Mutex<FakeState>>, Arc<Notify>);

fn authorized(h: &HeaderMap) -> bool {
    h.get("authorization").and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

fn unauthorized() -> (StatusCode, Json<Value>) {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({"error": {"code": "unauthorized", "message": "bad token"}})),
    )
}

async fn create(State((st, _)): State<S>, h: HeaderMap, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    if !authorized(&h) {
        return unauthorized();
    }
    let mut s = st.lock().unwrap();
    s.next += 1;
    let run_id = body
        .get("run_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("run-{}", s.next));
    if s.runs.contains_key(&run_id) {
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": {"code": "run_exists", "message": "exists"}})),
        );
    }
    let tool = body.get("tool").and_then(Value::as_str).unwrap_or("").to_string();
    s.runs.insert(run_id.clone(), "created".into());
    s.calls.push(Call {
        what: format!("create {run_id}"),
        body: body.clone(),
    });
    (
        StatusCode::CREATED,
        Json(json!({
            "run_id": run_id, "secret": "s3cret", "state": "created", "tool": tool,
            "proxy_url": format!("http://{run_id}:s3cret@127.0.0.1:9"),
            "expires_at": "2099-01-01T00:00:00Z"
        })),
    )
}

async fn activate(State((st, n)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> (StatusCode, Json<Value>) {
    if !authorized(&h) {
        return unauthorized();
    }
    {
        let mut s = st.lock().unwrap();
        s.calls.push(Call {
            what: format!("activate {id}"),
            body: Value::Null,
        });
        s.runs.insert(id.clone(), "active".into());
    }
    n.notify_waiters();
    (StatusCode::OK, Json(json!({"run_id": id, "state": "active"})))
}

async fn end(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> (StatusCode, Json<Value>) {
    if !authorized(&h) {
        return unauthorized();
    }
    let mut s = st.lock().unwrap();
    s.calls.push(Call {
        what: format!("end {id}"),
        body: Value::Null,
    });
    s.runs.insert(id.clone(), "ended".into());
    (StatusCode::OK, Json(json!({"run_id": id, "state": "ended"})))
}

async fn show(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> (StatusCode, Json<Value>) {
    if !authorized(&h) {
        return unauthorized();
    }
    match st.lock().unwrap().runs.get(&id) {
        Some(state) => (StatusCode::OK, Json(json!({"run_id": id, "state": state}))),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": "unknown_run", "message": "no such run"}})),
        ),
    }
}

async fn facts(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> (StatusCode, Json<Value>) {
    if !authorized(&h) {
        return unauthorized();
    }
    let s = st.lock().unwrap();
    let facts: Vec<Value> = s
        .facts
        .iter()
        .map(|f| {
            let mut f = f.clone();
            f["run_id"] = json!(id);
            f
        })
        .collect();
    (StatusCode::OK, Json(json!({ "facts": facts })))
}

async fn policy(State((state, _)): State<(Arc<Mutex<FakeState>>, Arc<Notify>)>) -> Json<Value> {
    let st = state.lock().unwrap();
    Json(json!({"policy": "sha256:fake", "tools": st.policy_tools}))
}

async fn lease(
    State((state, _)): State<(Arc<Mutex<FakeState>>, Arc<Notify>)>,
    UrlPath(owner): UrlPath<String>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let mut st = state.lock().unwrap();
    st.calls.push(Call {
        what: format!("lease {owner}"),
        body: body.clone(),
    });
    (
        StatusCode::OK,
        Json(json!({"owner": owner, "lease_ms": body["lease_ms"], "live_runs": 0})),
    )
}

async fn release(
    State((state, _)): State<(Arc<Mutex<FakeState>>, Arc<Notify>)>,
    UrlPath(owner): UrlPath<String>,
) -> (StatusCode, Json<Value>) {
    let mut st = state.lock().unwrap();
    st.calls.push(Call {
        what: format!("release {owner}"),
        body: Value::Null,
    });
    (StatusCode::OK, Json(json!({"owner": owner, "ended": 0})))
}

impl FakeControl {
    pub async fn start() -> FakeControl {
        let state = Arc::new(Mutex::new(FakeState::default()));
        let activated = Arc::new(Notify::new());
        let app = Router::new()
            .route("/v1/runs", post(create))
            .route("/v1/runs/{id}/activate", post(activate))
            .route("/v1/runs/{id}", axum::routing::delete(end).get(show))
            .route("/v1/runs/{id}/facts", get(facts))
            .route("/v1/owners/{owner}", axum::routing::put(lease).delete(release))
            .route("/v1/policy", get(policy))
            .with_state((state.clone(), activated.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeControl { addr, state, activated }
    }

    pub fn calls(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .map(|c| c.what.clone())
            .collect()
    }

    pub fn create_bodies(&self) -> Vec<Value> {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.what.starts_with("create"))
            .map(|c| c.body.clone())
            .collect()
    }

    pub fn run_state(&self, id: &str) -> Option<String> {
        self.state.lock().unwrap().runs.get(id).cloned()
    }

    pub fn set_policy_tools(&self, tools: &[&str]) {
        self.state.lock().unwrap().policy_tools = tools.iter().map(|t| t.to_string()).collect();
    }

    pub fn set_facts(&self, facts: Vec<Value>) {
        self.state.lock().unwrap().facts = facts;
    }
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "loom-exec-test-{tag}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, name: &str, body: &str) -> PathBuf {
        let p = self.0.join(name);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(&p, body).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The directory of the runners (`executor/runners`).
pub fn runners_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("runners")
}

/// A config file with `[proxy] control` pointing at `control` and the given
/// tool sections appended; scratch inside `dir`.
pub fn write_config(dir: &TempDir, control: SocketAddr, pid_namespace: bool, tools: &str) -> PathBuf {
    let body = format!(
        r#"
[proxy]
listen = "127.0.0.1:3128"
control = "{control}"
facts = "var/egress-facts.db"

[executor]
listen = "127.0.0.1:0"
scratch_dir = "scratch"
pid_namespace = {pid_namespace}
stderr_cap_bytes = 4096

{tools}
"#
    );
    dir.write("egress.toml", &body)
}

/// Live (non-zombie) processes whose environment contains `marker`.
pub fn marked_processes(marker: &str) -> Vec<i32> {
    let needle = marker.as_bytes();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if env.windows(needle.len()).any(|w| w == needle) {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat.rsplit(')').next().unwrap_or("").trim_start().chars().next();
            if state != Some('Z') && state != Some('X') {
                out.push(pid);
            }
        }
    }
    out
}

/// Poll `cond` until true or `within` elapses; returns its last value.
/// Used to observe asynchronous OS state (process exit), never to order
/// our own events.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Minimal HTTP/1.1 client for the executor API (loopback only).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let bytes = body.map(|b| serde_json::to_vec(&b).unwrap()).unwrap_or_default();
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(bytes::Bytes::from(bytes)))
        .unwrap();
    let resp = tx.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

pub fn python() -> Option<PathBuf> {
    which("python3")
}

pub fn node() -> Option<PathBuf> {
    which("node")
}

pub fn which(name: &str) -> Option<PathBuf> {
    for dir in ["/usr/local/bin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Some(p);
        }
    }
    None
}

/// Whether this process can create PID namespaces (root / CAP_SYS_ADMIN).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
