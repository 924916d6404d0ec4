//! Crashes and restarts with the real binaries: an executor killed with
//! `kill -9` leaves no live credential behind (the proxy ends its runs when
//! its owner lease expires, or at once when the restarted executor takes the
//! lease back, which also removes the dead instance's scratch directories),
//! and a proxy killed with `kill -9` and restarted is invisible to kernels:
//! the next invocation succeeds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{control_call, TOKEN};
use egress_e2e::process::{bin, free_addr, write_config, ProxyProcess};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOOL_PY: &str = "def run(input, ctx):\n    return {\"echo\": input}\n";

struct Executor(Child);

impl Executor {
    fn start(cfg: &Path, log: &Path) -> Executor {
        let out = std::fs::File::create(log).unwrap();
        let child = Command::new(bin("egress-executor"))
            .args(["serve", "--config"])
            .arg(cfg)
            .env("EGRESS_CONTROL_TOKEN", TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        Executor(child)
    }

    fn kill9(&mut self) {
        let _ = Command::new("kill").args(["-KILL", &self.0.id().to_string()]).status();
        let _ = self.0.wait();
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn runs(control: SocketAddr, query: &str) -> Vec<Value> {
    let r = control_call(control, "GET", &format!("/v1/runs?{query}"), None, Some(TOKEN)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    v["runs"].as_array().cloned().unwrap_or_default()
}

/// Polls until `cond` holds on the runs matching `query`; returns the time it took.
async fn until(control: SocketAddr, query: &str, cap: Duration, cond: impl Fn(&[Value]) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let r = runs(control, query).await;
        if cond(&r) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < cap,
            "runs {query} never reached the expected state: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    cfg: std::path::PathBuf,
    proxy: SocketAddr,
    control: SocketAddr,
    executor: SocketAddr,
    scratch: std::path::PathBuf,
    log: std::path::PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("tool.py"), TOOL_PY).unwrap();
    let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executor/runners/loom_runner.py");
    let (proxy, control, executor) = (free_addr(), free_addr(), free_addr());
    let scratch = dir.path().join("scratch");
    let cfg = write_config(
        dir.path(),
        proxy,
        control,
        &format!(
            "[proxy.dns]\nservers = [\"127.0.0.1:9\"]\n[executor]\nlisten = \"{executor}\"\nscratch_dir = \"scratch\"\nname = \"exec-a\"\nlease_ms = 1000\n[tools.t]\negress = []\n[tools.t.process]\ncommand = [\"python3\", \"{}\", \"tool.py\"]\npool = {{ warm = 2, max = 4 }}\nisolation = \"off\"\n",
            runner.display()
        ),
    );
    let log = dir.path().join("executor.log");
    Setup {
        cfg,
        proxy,
        control,
        executor,
        scratch,
        log,
        _dir: dir,
    }
}

fn live(r: &[Value]) -> usize {
    r.iter().filter(|r| r["state"] != "ended").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_executor_leaves_no_live_credential() {
    let s = setup();
    let _p = ProxyProcess::start(&s.cfg, s.proxy, s.control, TOKEN, &[]);
    let mut e = Executor::start(&s.cfg, &s.log);
    until(s.control, "owner=exec-a&state=created", Duration::from_secs(20), |r| {
        r.len() == 2
    })
    .await;
    let warm: Vec<String> = runs(s.control, "owner=exec-a")
        .await
        .iter()
        .map(|r| r["run_id"].as_str().unwrap().to_owned())
        .collect();
    e.kill9();
    // The lease (1 s) expires and the proxy ends the dead executor's runs.
    let took = until(s.control, "owner=exec-a", Duration::from_secs(5), |r| live(r) == 0).await;
    eprintln!("executor kill -9 → its runs ended after {took:?} (lease_ms = 1000)");
    for id in &warm {
        let r = control_call(s.control, "GET", &format!("/v1/runs/{id}"), None, Some(TOKEN)).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            (v["state"].as_str(), v["end_reason"].as_str()),
            (Some("ended"), Some("lease_expired")),
            "{v}"
        );
    }
    // The dead instance's scratch directories are still there; a new instance removes them.
    let left = std::fs::read_dir(&s.scratch).map(|d| d.count()).unwrap_or(0);
    let mut e2 = Executor::start(&s.cfg, &s.log.with_extension("2.log"));
    until(s.control, "owner=exec-a&state=created", Duration::from_secs(20), |r| {
        r.len() == 2
    })
    .await;
    let now: Vec<String> = std::fs::read_dir(&s.scratch)
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    let pid = e2.0.id().to_string();
    assert!(
        now.iter().all(|n| n.contains(&format!("-{pid}-"))),
        "scratch directories of the dead instance are left ({left} before): {now:?}"
    );
    // Killed and restarted at once (well within the lease): the new instance
    // ends what the old one left before it warms up.
    let old: Vec<String> = runs(s.control, "owner=exec-a&state=created")
        .await
        .iter()
        .map(|r| r["run_id"].as_str().unwrap().to_owned())
        .collect();
    e2.kill9();
    let _e3 = Executor::start(&s.cfg, &s.log.with_extension("3.log"));
    let t0 = Instant::now();
    loop {
        let mut ended = 0;
        for id in &old {
            let r = control_call(s.control, "GET", &format!("/v1/runs/{id}"), None, Some(TOKEN)).await;
            let v: Value = serde_json::from_slice(&r.body).unwrap();
            if v["state"] == "ended" {
                ended += 1;
            }
        }
        if ended == old.len() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the restarted executor did not end its predecessor's runs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_restart_is_invisible_to_the_next_invocation() {
    let s = setup();
    let mut p = ProxyProcess::start(&s.cfg, s.proxy, s.control, TOKEN, &[]);
    let _e = Executor::start(&s.cfg, &s.log);
    until(s.control, "owner=exec-a&state=created", Duration::from_secs(20), |r| {
        r.len() == 2
    })
    .await;
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(5));
    let _p2 = ProxyProcess::start(&s.cfg, s.proxy, s.control, TOKEN, &[]);
    for i in 0..4 {
        let r = control_call(
            s.executor,
            "POST",
            "/v1/invocations",
            Some(json!({"tool": "t", "input": {"i": i}})),
            Some(TOKEN),
        )
        .await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        assert_eq!(
            (r.status, v["ok"].as_bool()),
            (200, Some(true)),
            "invocation {i} after the proxy restart: {v}"
        );
        assert_eq!(v["output"]["echo"]["i"], i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_does_not_kill_the_executor_and_logs_off_a_terminal_are_plain_text() {
    let s = setup();
    let p = ProxyProcess::start(&s.cfg, s.proxy, s.control, TOKEN, &[]);
    let mut e = Executor::start(&s.cfg, &s.log);
    until(s.control, "owner=exec-a&state=created", Duration::from_secs(20), |r| {
        r.len() == 2
    })
    .await;
    let _ = Command::new("kill").args(["-HUP", &e.0.id().to_string()]).status();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(e.0.try_wait().unwrap().is_none(), "SIGHUP killed the executor");
    let r = control_call(s.executor, "GET", "/healthz", None, None).await;
    assert_eq!(r.status, 200);
    // Its runs are still live (nothing was stranded or ended).
    assert_eq!(live(&runs(s.control, "owner=exec-a").await), 2);
    let logs = std::fs::read_to_string(&s.log).unwrap();
    assert!(logs.contains("SIGHUP ignored"), "{logs}");
    for (who, text) in [("executor", logs), ("proxy", p.logs())] {
        assert!(
            !text.contains('\u{1b}'),
            "ANSI escape codes in the {who}'s log file:\n{text}"
        );
    }
}

#[test]
fn run_json_into_a_closed_pipe_is_not_a_panic() {
    let s = setup();
    let _p = ProxyProcess::start(&s.cfg, s.proxy, s.control, TOKEN, &[]);
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            // 300 KB of output: more than a pipe holds, so the writer meets EPIPE.
            "'{}' run --config '{}' --tool t --json -- /bin/sh -c 'yes | head -c 300000' | head -c 1 >/dev/null",
            bin("egress-executor").display(),
            s.cfg.display()
        ))
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}
