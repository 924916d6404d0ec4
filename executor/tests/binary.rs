//! The `egress-executor` binary: `serve` (HTTP API, metrics, and the death
//! of the executor killing every child and grandchild) and `run` (scrubbed
//! environment checked with a canary, exit codes, the denials table).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_e2e::harness::TOKEN;
use egress_e2e::process::{rss_bytes, socket_activated, KillOnDrop};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_egress-executor");

fn echo_config(dir: &TempDir, control: SocketAddr, marker: &str) -> std::path::PathBuf {
    dir.write(
        "echo.py",
        "def run(input, ctx):\n    ctx.emit({'seen': input})\n    return {'echo': input}\n",
    );
    let process = format!("env = {{ LOOM_TEST_MARK = \"{marker}\" }}\npool = {{ warm = 1, max = 1, queue = 0 }}\n");
    write_config(dir, control, true, &python_tool("echo", "echo.py", &process))
}

#[tokio::test]
async fn serve_answers_invocations_metrics_and_health() {
    if python().is_none() {
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("serve");
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let cfg = echo_config(&dir, control.addr, &marker);
    let (mut child, addr) = serve(Path::new(BIN), &cfg, &[]);

    let (status, body) = http(addr, "GET", "/healthz", None).await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    let (status, body) = http(
        addr,
        "POST",
        "/v1/invocations",
        Some(json!({"tool": "echo", "input": {"city": "Oslo"}, "idempotency_key": "k1"})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], json!(true));
    assert_eq!(v["output"], json!({"echo": {"city": "Oslo"}}));
    assert_eq!(v["emits"], json!([{"seen": {"city": "Oslo"}}]));
    assert!(v["run_id"].is_string());
    assert_eq!(v["facts"], json!([]));

    let (status, body) = http(addr, "POST", "/v1/invocations", Some(json!({"tool": "nope"}))).await;
    assert_eq!(status, 404, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["kind"], json!("unknown_tool"));

    let (status, body) = http(addr, "POST", "/v1/invocations", Some(json!({"input": 1}))).await;
    assert_eq!(status, 400, "{body}");

    let (status, _) = http(addr, "POST", "/v1/invocations/nothing/abort", None).await;
    assert_eq!(status, 404);

    // Without the control token nobody (a tool on the host's loopback, say) may invoke tools.
    for auth in ["", "Authorization: Bearer wrong-token-wrong-token\r\n"] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let body = r#"{"tool":"echo","input":1}"#;
        let req = format!(
            "POST /v1/invocations HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 401"), "{auth:?}: {out}");
    }

    let (status, body) = http(addr, "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    for name in [
        "executor_pool_ready{tool=\"echo\"}",
        "executor_cold_start_seconds_bucket",
        "executor_invocations_total{tool=\"echo\",outcome=\"ok\"} 1",
        "executor_invocation_duration_seconds_count{tool=\"echo\"} 1",
        "executor_kills_total{tool=\"echo\",reason=\"done\"} 1",
        "executor_children{tool=\"echo\",state=\"busy\"}",
    ] {
        assert!(body.contains(name), "missing {name} in\n{body}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test]
async fn executor_sigkill_kills_every_child_and_grandchild() {
    if python().is_none() || !is_root() {
        eprintln!("skipped: needs python3 and root for PID namespaces");
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("sigkill");
    let marker = uuid::Uuid::new_v4().simple().to_string();
    // Load-time code (before `ready`) leaves a grandchild and a daemon behind.
    dir.write(
        "tree.py",
        r#"
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    time.sleep(300); os._exit(0)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300); os._exit(0)
    os._exit(0)
def run(input, ctx):
    return 1
"#,
    );
    let runner = python_runner();
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        &format!(
            r#"
[tools.tree]
egress = []
[tools.tree.process]
command = ["python3", "{}", "tree.py"]
env = {{ LOOM_TEST_MARK = "{marker}" }}
pool = {{ warm = 2, max = 2 }}
"#,
            runner.display()
        ),
    );
    let (mut child, _addr) = serve(Path::new(BIN), &cfg, &[]);
    let needle = format!("LOOM_TEST_MARK={marker}");
    // Two warm children, each with two descendants.
    assert!(
        eventually(Duration::from_secs(30), || marked_processes(&needle).len() >= 6).await,
        "warm trees never came up: {:?}",
        marked_processes(&needle)
    );
    Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    let _ = child.wait();
    assert!(
        eventually(Duration::from_secs(15), || marked_processes(&needle).is_empty()).await,
        "left behind: {:?}",
        marked_processes(&needle)
    );
}

fn run_cmd(cfg: &std::path::Path, tool: &str, extra: &[&str], cmd: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(["run", "--config"])
        .arg(cfg)
        .args(["--tool", tool])
        .args(extra)
        .arg("--")
        .args(cmd)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .env("LOOM_CANARY_SECRET", "canary-7f3a")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[tokio::test]
async fn run_scrubs_the_environment_and_reports_denials() {
    if python().is_none() {
        return;
    }
    let control = FakeControl::start().await;
    control.set_facts(vec![
        json!({"type": "EGRESS_DENIED", "seq": 4, "reason": "not_allowlisted",
        "target": {"kind": "connect", "host": "evil.example", "port": 443}, "detail": "no rule matches"}),
    ]);
    let dir = TempDir::new("runcli");
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        "[tools.shell]\negress = []\n[tools.shell.process]\ncommand = [\"true\"]\nenv = { GREETING = \"hi\" }\n",
    );
    let cfg2 = cfg.clone();
    let out = tokio::task::spawn_blocking(move || {
        run_cmd(
            &cfg2,
            "shell",
            &["--json"],
            &["python3", "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
        )
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    let env: Value = serde_json::from_str(result["stdout"].as_str().unwrap()).unwrap();
    let text = env.to_string();
    assert!(!text.contains("canary-7f3a"), "the canary leaked: {text}");
    assert!(env.get("LOOM_CANARY_SECRET").is_none());
    assert!(env.get("EGRESS_CONTROL_TOKEN").is_none(), "the control token leaked");
    assert_eq!(env["GREETING"], json!("hi"));
    assert_eq!(env["NO_PROXY"], json!(""));
    // Plain ad-hoc commands do not get the protocol variable.
    assert!(env.get("LOOM_IPC_FDS").is_none());
    assert!(env["HTTPS_PROXY"].as_str().unwrap().starts_with("http://run-"));

    // Human output: the denials table on stderr, the command's exit code.
    let out = tokio::task::spawn_blocking(move || run_cmd(&cfg, "shell", &[], &["sh", "-c", "echo out; exit 3"]))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tool_error: exited with exit code 3"), "{err}");
    assert!(err.contains("1 denial(s):"), "{err}");
    assert!(err.contains("not_allowlisted"), "{err}");
    assert!(err.contains("evil.example:443 connect"), "{err}");
}

#[tokio::test]
async fn run_times_out_with_exit_124() {
    let control = FakeControl::start().await;
    let dir = TempDir::new("runtimeout");
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        "[tools.shell]\negress = []\n[tools.shell.process]\ncommand = [\"true\"]\ntimeout_ms = 1000\n",
    );
    let out = tokio::task::spawn_blocking(move || run_cmd(&cfg, "shell", &[], &["sleep", "300"]))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("timeout"), "{err}");
}

#[tokio::test]
async fn serve_aborts_an_invocation_over_http() {
    if python().is_none() {
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("httpabort");
    dir.write("slow.py", "import time\ndef run(input, ctx):\n    time.sleep(300)\n");
    let runner = python_runner();
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        &format!(
            "[tools.slow]\negress = []\n[tools.slow.process]\ncommand = [\"python3\", \"{}\", \"slow.py\"]\npool = {{ warm = 1, max = 1, queue = 0 }}\n",
            runner.display()
        ),
    );
    let (mut child, addr) = serve(Path::new(BIN), &cfg, &[]);
    let activated = control.activated.clone();
    let notified = activated.notified();
    let call = tokio::spawn(async move {
        http(
            addr,
            "POST",
            "/v1/invocations",
            Some(json!({"tool": "slow", "input": null, "idempotency_key": "stop-me"})),
        )
        .await
    });
    // The run is activated just before `invoke` is written: it is in flight.
    notified.await;
    // A second invocation finds the only child busy and no queue.
    let (status, body) = http(addr, "POST", "/v1/invocations", Some(json!({"tool": "slow"}))).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"kind\":\"busy\""), "{body}");
    let (status, body) = http(addr, "POST", "/v1/invocations/stop-me/abort", None).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = call.await.unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], json!(false));
    assert_eq!(v["error"]["kind"], json!("aborted"), "{body}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test]
async fn doctor_reports_layers_and_reads_the_token_file() {
    let control = FakeControl::start().await;
    let dir = TempDir::new("doctor");
    let cfg = write_config(&dir, control.addr, true, "");
    // No EGRESS_CONTROL_TOKEN: the token comes from beside [proxy] facts.
    dir.write("var/egress-control.token", &format!("{TOKEN}\n"));
    let run = |cfg: std::path::PathBuf| {
        tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(["doctor", "--config"])
                .arg(cfg)
                .env_remove("EGRESS_CONTROL_TOKEN")
                .output()
                .unwrap()
        })
    };
    let out = run(cfg.clone()).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("proxy control API"), "{text}");
    assert!(text.contains("token accepted"), "{text}");
    if is_root() {
        assert!(
            text.lines()
                .any(|l| l.starts_with("PID namespace per child") && l.contains(" ok ")),
            "{text}"
        );
    }
    // A wrong token is reported, and fails the doctor.
    dir.write("var/egress-control.token", "not-the-token-at-all\n");
    let out = run(cfg).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL") && text.contains("401"), "{text}");
}

#[tokio::test]
async fn run_kills_descendants_that_escape_the_process_group() {
    // Process-group mode on purpose: the binary is a child subreaper, so a
    // daemon that left the group is re-parented to it and swept.
    let control = FakeControl::start().await;
    let dir = TempDir::new("escape");
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let cfg = write_config(
        &dir,
        control.addr,
        false,
        &format!("[tools.shell]\negress = []\n[tools.shell.process]\ncommand = [\"true\"]\nenv = {{ LOOM_TEST_MARK = \"{marker}\" }}\n"),
    );
    let out = tokio::task::spawn_blocking(move || {
        run_cmd(
            &cfg,
            "shell",
            &[],
            // A double-forked daemon in its own session, and a setsid'd child.
            &["sh", "-c", "(setsid sleep 300 &) ; setsid sleep 301 & echo started"],
        )
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "started\n");
    let needle = format!("LOOM_TEST_MARK={marker}");
    let gone = eventually(Duration::from_secs(10), || marked_processes(&needle).is_empty()).await;
    let left = marked_processes(&needle);
    for pid in &left {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    assert!(gone, "escaped descendants survived: {left:?}");
}

#[tokio::test]
async fn sigterm_ends_warm_runs_and_leaves_no_child() {
    if python().is_none() {
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("sigterm");
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let cfg = echo_config(&dir, control.addr, &marker);
    let (mut child, _addr) = serve(Path::new(BIN), &cfg, &[]);
    let needle = format!("LOOM_TEST_MARK={marker}");
    assert!(eventually(Duration::from_secs(30), || marked_processes(&needle).len() == 1).await);
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(marked_processes(&needle).is_empty());
    let calls = control.calls();
    let created: Vec<&String> = calls.iter().filter(|c| c.starts_with("create ")).collect();
    assert_eq!(created.len(), 1, "{calls:?}");
    let run = created[0].trim_start_matches("create ");
    assert!(calls.contains(&format!("end {run}")), "warm run not ended: {calls:?}");
}

/// An untrusted tool's output cannot grow the executor without bound: 200
/// invocations of a tool returning 15 MB each, each with its own idempotency
/// key, leave the real binary's RSS within `journal_max_mb` plus a constant.
/// The oldest answers lose their bodies (outcome, sizes and a SHA-256 stay);
/// their idempotency keys answer with `body_dropped` instead of running the
/// tool again, and so does `GET /v1/invocations/{id}`.
#[tokio::test]
async fn large_results_keep_the_executor_within_journal_max_mb() {
    if python().is_none() {
        eprintln!("skipped: needs python3");
        return;
    }
    const MB: u64 = 1 << 20;
    const BUDGET_MB: u64 = 64;
    const RESULT: u64 = 15_000_000;
    let control = FakeControl::start().await;
    let dir = TempDir::new("journal");
    dir.write("big.py", "def run(input, ctx):\n    return 'x' * input['n']\n");
    let cfg = dir.write(
        "egress.toml",
        &format!(
            r#"
[proxy]
control = "{control}"
facts = "var/egress-facts.db"

[executor]
listen = "127.0.0.1:0"
scratch_dir = "scratch"
# A 15 MB result is one protocol line.
max_message_bytes = {line}
max_run_bytes = {run}
journal_max_mb = {BUDGET_MB}

[tools.big]
egress = []
[tools.big.process]
command = ["python3", "{runner}", "big.py"]
isolation = "off"
pool = {{ warm = 2, max = 2, queue = 4 }}
"#,
            control = control.addr,
            line = 16 * MB,
            run = 24 * MB,
            runner = python_runner().display(),
        ),
    );
    let (child, addr) = serve(Path::new(BIN), &cfg, &[]);
    let pid = child.id();
    // Killed even when an assertion fails (it may hold gigabytes then).
    let _child = KillOnDrop(child);
    let invoke = |key: String| async move {
        let (status, body) = http(
            addr,
            "POST",
            "/v1/invocations",
            Some(json!({"tool": "big", "input": {"n": RESULT}, "idempotency_key": key})),
        )
        .await;
        assert_eq!(status, 200, "{}", &body[..body.len().min(400)]);
        body
    };
    let mut first_id = String::new();
    let mut baseline = 0;
    for i in 0..200 {
        let body = invoke(format!("k-{i}")).await;
        // The live answer is whole, whatever is kept.
        assert!(body.len() as u64 > RESULT, "{}", &body[..body.len().min(400)]);
        assert!(body[..200].contains("\"ok\":true"), "{}", &body[..400]);
        if i == 0 {
            first_id = body[..200]
                .split("\"invocation_id\":\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap()
                .to_string();
        }
        if i == 0 {
            baseline = rss_bytes(pid);
        }
        if i % 50 == 49 {
            eprintln!("after {} invocations: RSS {} MiB", i + 1, rss_bytes(pid) / MB);
        }
    }
    let rss = rss_bytes(pid);
    eprintln!(
        "RSS after 200 x 15 MB: {} MiB (after the first: {} MiB; journal_max_mb = {BUDGET_MB})",
        rss / MB,
        baseline / MB
    );
    // The constant is the process after its first answer: the binary at
    // work, and what serving one 15 MB answer takes (the protocol line, the
    // parsed value, the JSON sent and kept).
    assert!(
        rss <= baseline + BUDGET_MB * MB,
        "RSS {} MiB > {} MiB after the first answer + journal_max_mb",
        rss / MB,
        baseline / MB
    );

    // The first key's body was dropped: its answer says so, with the
    // outcome, the sizes and a digest; the tool does not run again.
    let (_, metrics_before) = http(addr, "GET", "/metrics", None).await;
    let repeat: Value = serde_json::from_str(&invoke("k-0".into()).await).unwrap();
    assert_eq!(repeat["ok"], json!(true), "{repeat}");
    assert_eq!(repeat["invocation_id"], json!(first_id), "{repeat}");
    assert!(repeat.get("output").is_none(), "{repeat}");
    let dropped = &repeat["body_dropped"];
    assert_eq!(dropped["reason"], json!("journal_full"), "{repeat}");
    assert!(dropped["output_bytes"].as_u64().unwrap() >= RESULT, "{repeat}");
    assert!(dropped["body_bytes"].as_u64().unwrap() > RESULT, "{repeat}");
    assert_eq!(dropped["sha256"].as_str().unwrap().len(), 64, "{repeat}");
    // The field is in the executor's OpenAPI document.
    let spec = egress_e2e::openapi::Spec::new(serde_json::to_value(egress_executor::api::openapi()).unwrap());
    let op = spec.operation("POST", "/v1/invocations").unwrap();
    let problems = op.check_response(200, &repeat);
    assert!(problems.is_empty(), "{problems:?}\n{repeat}");
    assert!(
        serde_json::to_string(spec.doc()).unwrap().contains("\"body_dropped\""),
        "body_dropped is not documented"
    );
    let (_, metrics_after) = http(addr, "GET", "/metrics", None).await;
    let runs = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("executor_invocations_total{tool=\"big\",outcome=\"ok\"}"))
            .map(str::to_string)
    };
    assert_eq!(runs(&metrics_before), runs(&metrics_after), "the tool ran again");
    let (status, body) = http(addr, "GET", &format!("/v1/invocations/{first_id}"), None).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["result"]["body_dropped"], *dropped, "{v}");
    // The newest answer is still whole.
    let (status, body) = http(addr, "GET", "/v1/invocations/k-199", None).await;
    assert_eq!(status, 200);
    assert!(body.len() as u64 > RESULT && !body.contains("body_dropped"));
}

/// Socket activation: systemd passes the executor its listener (named
/// `executor`), and its API answers there.
#[tokio::test]
async fn serve_answers_on_the_socket_systemd_passes() {
    if python().is_none() {
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("activated");
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let cfg = echo_config(&dir, control.addr, &marker).display().to_string();
    let (child, addrs) = socket_activated(
        &["executor"],
        std::path::Path::new(BIN),
        &["serve", "--config", &cfg],
        &[("EGRESS_CONTROL_TOKEN", TOKEN)],
        &dir.0.join("executor.log"),
    );
    let _child = KillOnDrop(child);
    let addr = addrs["executor"];
    let t0 = std::time::Instant::now();
    loop {
        if let Ok((200, body)) = tokio::time::timeout(Duration::from_secs(2), http(addr, "GET", "/healthz", None)).await
        {
            assert_eq!(body, "ok\n");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "not served on the passed socket: {}",
            std::fs::read_to_string(dir.0.join("executor.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = http(
        addr,
        "POST",
        "/v1/invocations",
        Some(json!({"tool": "echo", "input": 1})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}
