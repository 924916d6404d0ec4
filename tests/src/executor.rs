//! Support for the executor's integration tests and benchmarks: scratch
//! directories, an executor config pointing at a control API and the
//! executor made from it, invocations, the parts every child shares, the
//! `serve` binary, `/proc` scans for marked processes, a minimal client of
//! the executor's API, and where the runners and interpreters are. The fake
//! control API is [`crate::fake_control`], the fake hand-off socket
//! [`crate::fake_handoff`], the real proxy beside an executor [`crate::stack`].

use crate::fake_control::FakeControl;
use crate::fake_handoff::FakeHandoff;
use crate::harness::TOKEN;
use egress_executor::pool::child::Shared;
use egress_executor::{Config, Executor, InvocationRequest};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "loom-exec-test-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
    crate::process::repo_root().join("executor/runners")
}

/// The Python reference runner (`executor/runners/loom_runner.py`).
pub fn python_runner() -> PathBuf {
    runners_dir().join("loom_runner.py")
}

/// A `[tools.<id>]` section with no egress whose child runs `script` (a
/// file in the config's directory) through the Python runner, its process
/// section ending with `process` (more keys, each on a line).
pub fn python_tool(id: &str, script: &str, process: &str) -> String {
    format!(
        "\n[tools.{id}]\negress = []\n[tools.{id}.process]\ncommand = [\"python3\", \"{}\", \"{script}\"]\n{process}",
        python_runner().display()
    )
}

/// A config file with `[proxy] control` pointing at `control` and the given
/// tool sections appended; scratch inside `dir`. Like a real proxy beside
/// the facts store, a [`FakeHandoff`] serves the default hand-off socket
/// (`var/egress-handoff.sock`), so confined children are handed off with no
/// key, as they are by default (needs the test's tokio runtime).
pub fn write_config(dir: &TempDir, control: SocketAddr, pid_namespace: bool, tools: &str) -> PathBuf {
    FakeHandoff::start(&dir.0.join("var/egress-handoff.sock"));
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

/// The executor of the config file `cfg`, with the test control token.
pub fn executor(cfg: &Path) -> Arc<Executor> {
    Executor::new(Config::load(cfg).unwrap(), Some(TOKEN.into())).unwrap()
}

/// An executor beside a fresh [`FakeControl`]: `tools` in a config that
/// [`write_config`] writes in `dir`.
pub async fn beside_fake_control(dir: &TempDir, pid_namespace: bool, tools: &str) -> (FakeControl, Arc<Executor>) {
    let control = FakeControl::start().await;
    let cfg = write_config(dir, control.addr, pid_namespace, tools);
    (control, executor(&cfg))
}

/// An invocation of `tool` with `input`, nothing else set.
pub fn invocation(tool: &str, input: Value) -> InvocationRequest {
    InvocationRequest {
        tool: tool.into(),
        input,
        run_id: None,
        idempotency_key: None,
        timeout_ms: None,
        principal: None,
    }
}

/// What every child of `cfg` shares, for a test or benchmark that starts
/// children without pools: the spawner thread, a control client with the
/// test token, fresh metrics.
pub fn shared(cfg: &Config) -> Arc<Shared> {
    Arc::new(Shared::new(
        egress_executor::process::Spawner::start().unwrap(),
        egress_executor::proxy::control::ControlClient::new(cfg.control, &cfg.home, Some(TOKEN.into())),
        egress_executor::metrics::Metrics::new(),
        cfg.executor.clone(),
    ))
}

/// `strict` where the host has every confinement layer (it refuses to start
/// otherwise), else `best_effort`, which keeps what the host has (said on
/// stderr).
pub fn strongest_isolation() -> &'static str {
    let host = egress_executor::confine::host(&Default::default());
    if egress_executor::confine::Layer::ALL.iter().all(|l| host.available(*l)) {
        "strict"
    } else {
        eprintln!("not every confinement layer here: the tools run best_effort");
        "best_effort"
    }
}

/// `egress-executor serve` (the binary at `bin`) on `cfg`, with the test
/// control token and `env`, and the address its API listens on, read from
/// its log.
pub fn serve(bin: &Path, cfg: &Path, env: &[(&str, &str)]) -> (Child, SocketAddr) {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config"])
        .arg(cfg)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .envs(env.iter().copied());
    crate::process::spawn_reporting(&mut cmd, "addr")
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
