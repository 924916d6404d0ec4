//! Executable identity end to end: what each child runs is hashed at its
//! start and sent with its run (`CreateRun.executables`, the `exe_sha256`
//! label), as `sha256sum` computes it; a script changed on disk gives the
//! next children a new digest; pinned by `expect_sha256`, it starts no
//! child (`503 executable_mismatch`, counted) until it is put back; a fork
//! server forks only children that run what it was started from; the
//! proxy's run view shows the label. Against a fake control API, and the
//! real proxy binary for the run view (skipped without it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_e2e::harness::{control_call, sample, TOKEN};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use egress_executor::{ErrorKind, Executor, InvocationResult};
use serde_json::{json, Value};

const V1: &str = "VERSION = 1\ndef run(input, ctx):\n    return {\"version\": VERSION}\n";
const V2: &str = "VERSION = 2\ndef run(input, ctx):\n    return {\"version\": VERSION}\n";

/// `sha256sum FILE`'s digest.
fn sha256sum(file: &Path) -> String {
    let out = std::process::Command::new("sha256sum").arg(file).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", file.display());
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Where the child finds `python3` (the default `path`).
fn python3_path(cwd: &Path) -> PathBuf {
    egress_executor::process::resolve_program("python3", egress_executor::config::DEFAULT_PATH, cwd).unwrap()
}

/// The body of the `POST /v1/runs` that created `run_id`.
fn create_body(control: &FakeControl, run_id: &str) -> Value {
    let s = control.state.lock().unwrap();
    let what = format!("create {run_id}");
    s.calls.iter().find(|c| c.what == what).unwrap().body.clone()
}

fn creates(control: &FakeControl) -> Vec<Value> {
    let s = control.state.lock().unwrap();
    s.calls
        .iter()
        .filter(|c| c.what.starts_with("create "))
        .map(|c| c.body.clone())
        .collect()
}

async fn invoke(exec: &Executor, tool: &str) -> InvocationResult {
    exec.invoke(invocation(tool, json!(null))).await
}

fn mismatches(exec: &Executor, tool: &str) -> f64 {
    sample(
        &exec.metrics().encode(),
        &format!("executor_identity_mismatch_total{{tool=\"{tool}\"}}"),
    )
}

/// A tool on the Python runner whose script is `tool.py` in `dir` (v1),
/// its process section ending with `process`.
async fn setup(tag: &str, process: &str) -> (TempDir, FakeControl, Arc<Executor>) {
    let dir = TempDir::new(tag);
    dir.write("tool.py", V1);
    let tools = python_tool("id", "tool.py", &format!("cold_start_ms = 20000\n{process}"));
    let (control, exec) = beside_fake_control(&dir, true, &tools).await;
    (dir, control, exec)
}

/// Each child's run carries what it runs — the interpreter found on its
/// `path`, the runner, the tool's script — with the digests `sha256sum`
/// computes, and the program's as the `exe_sha256` label. The script
/// changed on disk after the pool started: the children started from then
/// on carry its new digest (and run it).
#[tokio::test]
async fn each_child_carries_the_digests_of_what_it_runs() {
    if python().is_none() || which("sha256sum").is_none() {
        eprintln!("SKIPPED each_child_carries_the_digests_of_what_it_runs: needs python3 and sha256sum");
        return;
    }
    let (dir, control, exec) = setup("identity-digests", "pool = { warm = 1, max = 1 }\n").await;
    let pool = exec.pool("id").unwrap().clone();
    exec.warm_up();
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);

    let first = invoke(&exec, "id").await;
    assert!(first.ok, "{first:#?}");
    assert_eq!(first.output, Some(json!({"version": 1})));
    let body = create_body(&control, first.run_id.as_deref().unwrap());
    let python3 = python3_path(dir.path());
    let script = dir.path().join("tool.py");
    let v1: BTreeMap<String, String> = [
        (python3.clone(), sha256sum(&python3)),
        (python_runner(), sha256sum(&python_runner())),
        (script.clone(), sha256sum(&script)),
    ]
    .into_iter()
    .map(|(p, d)| (p.display().to_string(), d))
    .collect();
    assert_eq!(
        serde_json::from_value::<BTreeMap<String, String>>(body["executables"].clone()).unwrap(),
        v1,
        "{body}"
    );
    assert_eq!(body["labels"]["exe_sha256"], json!(sha256sum(&python3)), "{body}");
    assert_eq!(body["labels"]["source"], json!("executor"));

    // The refill after the first invocation started before the change, and
    // loaded v1: wait for it, then change the script.
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);
    dir.write("tool.py", V2);
    let v2 = sha256sum(&script);
    assert_ne!(v2, v1[&script.display().to_string()]);
    let second = invoke(&exec, "id").await;
    assert_eq!(second.output, Some(json!({"version": 1})), "{second:#?}");
    let body = create_body(&control, second.run_id.as_deref().unwrap());
    assert_eq!(
        body["executables"][script.display().to_string()],
        json!(v1[&script.display().to_string()])
    );
    // The child started after the change runs v2 and says so.
    let third = invoke(&exec, "id").await;
    assert_eq!(third.output, Some(json!({"version": 2})), "{third:#?}");
    let body = create_body(&control, third.run_id.as_deref().unwrap());
    assert_eq!(body["executables"][script.display().to_string()], json!(v2), "{body}");
    assert_eq!(
        body["executables"][python3.display().to_string()],
        json!(sha256sum(&python3))
    );
    assert_eq!(mismatches(&exec, "id"), 0.0);
}

/// Pinned by `expect_sha256` (the script relative to `cwd`, the runner by
/// its absolute path), a script changed on disk starts no child: the refill
/// is refused in the background (no run is created for it), the next
/// invocation answers `503 executable_mismatch` naming the path, the pinned
/// and the actual digest, and each refused start is counted. Put back, the
/// pool starts children again. A pinned file the command does not run
/// starts nothing either.
#[tokio::test]
async fn a_pinned_file_that_changed_starts_no_child() {
    if python().is_none() || which("sha256sum").is_none() {
        eprintln!("SKIPPED a_pinned_file_that_changed_starts_no_child: needs python3 and sha256sum");
        return;
    }
    let dir = TempDir::new("identity-pinned");
    let script = dir.write("tool.py", V1);
    let v1 = sha256sum(&script);
    let runner = python_runner();
    let tools = python_tool(
        "id",
        "tool.py",
        &format!(
            "cold_start_ms = 20000\npool = {{ warm = 1, max = 1 }}\n\
             expect_sha256 = {{ \"./tool.py\" = \"{v1}\", \"{}\" = \"{}\" }}\n",
            runner.display(),
            sha256sum(&runner)
        ),
    ) + &python_tool(
        "unrun",
        "tool.py",
        &format!("pool = {{ warm = 0, max = 1 }}\nexpect_sha256 = {{ \"other.py\" = \"{v1}\" }}\n"),
    );
    let (control, exec) = beside_fake_control(&dir, true, &tools).await;
    let pool = exec.pool("id").unwrap().clone();
    exec.warm_up();
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);
    let ok = invoke(&exec, "id").await;
    assert!(ok.ok, "{ok:#?}");
    assert!(eventually(Duration::from_secs(30), || pool.counts().0 == 1).await);

    dir.write("tool.py", V2);
    let v2 = sha256sum(&script);
    let created = creates(&control).len();
    // The warm child loaded v1 before the change: it serves.
    let warm = invoke(&exec, "id").await;
    assert_eq!(warm.output, Some(json!({"version": 1})), "{warm:#?}");
    // Its refill is refused, in the background, before any run is created.
    assert!(eventually(Duration::from_secs(30), || mismatches(&exec, "id") >= 1.0).await);
    assert_eq!(pool.counts().0, 0);
    let refused = exec.answer(invocation("id", json!(null))).await.result();
    let e = refused.error.clone().unwrap_or_else(|| panic!("{refused:#?}"));
    assert_eq!(e.kind, ErrorKind::ExecutableMismatch, "{refused:#?}");
    assert_eq!(e.kind.http_status(), 503);
    assert_eq!(refused.outcome(), "executable_mismatch");
    for part in [script.display().to_string(), v1.clone(), v2.clone()] {
        assert!(e.message.contains(&part), "{part} in {}", e.message);
    }
    assert!(refused.run_id.is_none(), "{refused:#?}");
    let after = creates(&control);
    assert_eq!(after.len(), created, "no run for a refused child: {after:#?}");
    assert!(after
        .iter()
        .all(|b| b["executables"][script.display().to_string()] == json!(v1)));
    // The refused invocation's own try is counted too (its counter may land
    // just after the answer on a loaded machine).
    assert!(eventually(Duration::from_secs(30), || mismatches(&exec, "id") >= 2.0).await);
    // Recorded at the proxy before the first refusal was answered, once
    // for this finding however often the pool tried again.
    let reports: Vec<String> = control
        .calls()
        .into_iter()
        .filter(|c| c.starts_with("mismatch id"))
        .collect();
    assert_eq!(reports.len(), 1, "{reports:?}");

    // Put back (another inode, the same bytes): children start again.
    dir.write("tool.py.new", V1);
    std::fs::rename(dir.path().join("tool.py.new"), &script).unwrap();
    let back = invoke(&exec, "id").await;
    assert_eq!(back.output, Some(json!({"version": 1})), "{back:#?}");

    let unrun = invoke(&exec, "unrun").await;
    let e = unrun.error.unwrap();
    assert_eq!(e.kind, ErrorKind::ExecutableMismatch);
    assert!(
        e.message
            .contains("other.py` is pinned in expect_sha256 but the command does not run it"),
        "{}",
        e.message
    );
    assert_eq!(mismatches(&exec, "unrun"), 1.0);
}

/// A fork server forks a child only if the child would run what the server
/// was started from: its runner changed on disk, children start a fresh
/// interpreter (which loads the new runner, as their runs say), not a fork
/// of the old one.
#[tokio::test]
async fn a_fork_server_forks_only_children_that_run_what_it_runs() {
    if python().is_none() || !is_root() {
        eprintln!(
            "SKIPPED a_fork_server_forks_only_children_that_run_what_it_runs: needs python3 and root (the fork server's children)"
        );
        return;
    }
    let dir = TempDir::new("identity-fork");
    dir.write("tool.py", V1);
    let runner = dir.write("r/loom_runner.py", &std::fs::read_to_string(python_runner()).unwrap());
    let tools = "[tools.forked]\negress = []\n[tools.forked.process]\n\
                 command = [\"python3\", \"r/loom_runner.py\", \"tool.py\"]\n\
                 fork_server = true\ncold_start_ms = 20000\npool = { warm = 0, max = 1 }\n";
    let (control, exec) = beside_fake_control(&dir, true, tools).await;
    let forked = |exec: &Executor| {
        sample(
            &exec.metrics().encode(),
            "executor_forked_children_total{tool=\"forked\"}",
        )
    };
    let first = invoke(&exec, "forked").await;
    assert!(first.ok, "{first:#?}");
    assert_eq!(forked(&exec), 1.0, "forked by its server");

    let mut text = std::fs::read_to_string(&runner).unwrap();
    text.push_str("\n# changed after the fork server started\n");
    std::fs::write(&runner, text).unwrap();
    let second = invoke(&exec, "forked").await;
    assert!(second.ok, "{second:#?}");
    assert_eq!(forked(&exec), 1.0, "a fresh interpreter, not a fork of the old runner");
    let body = create_body(&control, second.run_id.as_deref().unwrap());
    assert_eq!(
        body["executables"][runner.display().to_string()],
        json!(sha256sum(&runner)),
        "{body}"
    );
}

/// The real proxy takes the run's executables and shows the program's
/// digest in the run's labels (`GET /v1/runs/{id}`).
#[tokio::test]
async fn the_proxys_run_view_shows_the_program_digest() {
    let Some(bin) = proxy_bin() else {
        eprintln!("SKIPPED the_proxys_run_view_shows_the_program_digest: egress-proxy binary not built (run `cargo build -p egress-proxy` first, or set EGRESS_PROXY_BIN)");
        return;
    };
    if python().is_none() || which("sha256sum").is_none() {
        eprintln!("SKIPPED the_proxys_run_view_shows_the_program_digest: needs python3 and sha256sum");
        return;
    }
    let dir = TempDir::new("identity-proxy");
    dir.write("tool.py", V1);
    let dns = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let tools = python_tool("id", "tool.py", "cold_start_ms = 20000\npool = { warm = 0, max = 1 }\n");
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.local_addr().unwrap(), &tools);
    let res = invoke(&exec, "id").await;
    assert!(res.ok, "{res:#?}");
    let run_id = res.run_id.unwrap();
    let r = control_call(control, "GET", &format!("/v1/runs/{run_id}"), None, Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    let view: Value = serde_json::from_slice(&r.body).unwrap();
    let python3 = python3_path(dir.path());
    assert_eq!(view["labels"]["exe_sha256"], json!(sha256sum(&python3)), "{view}");
    drop(proxy);
}

/// `doctor` prints, per tool, every file its children run with its digest,
/// one `sha256sum` line each (the values to pin), and fails a tool whose
/// pins do not match.
#[tokio::test]
async fn doctor_prints_what_each_tool_runs() {
    if python().is_none() || which("sha256sum").is_none() {
        eprintln!("SKIPPED doctor_prints_what_each_tool_runs: needs python3 and sha256sum");
        return;
    }
    let control = FakeControl::start().await;
    let dir = TempDir::new("identity-doctor");
    let script = dir.write("tool.py", V1);
    let tools = python_tool("id", "tool.py", "")
        + &python_tool(
            "pinned",
            "tool.py",
            &format!("expect_sha256 = {{ \"tool.py\" = \"{}\" }}\n", "0".repeat(64)),
        );
    let cfg = write_config(&dir, control.addr, true, &tools);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_egress-executor"))
            .args(["doctor", "--config"])
            .arg(cfg)
            .env("EGRESS_CONTROL_TOKEN", TOKEN)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let python3 = python3_path(dir.path());
    for file in [&python3, &python_runner(), &script] {
        let want = format!("  {}  {}", sha256sum(file), file.display());
        assert!(text.lines().any(|l| l == want), "{want:?} in\n{text}");
    }
    let verdict = |tool: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("executables of `{tool}`")))
            .unwrap_or_else(|| panic!("no line for {tool} in\n{text}"))
            .to_string()
    };
    assert!(
        verdict("id").contains(" ok ") && verdict("id").contains("no pins"),
        "{text}"
    );
    let pinned = verdict("pinned");
    assert!(
        pinned.contains("FAIL") && pinned.contains(&sha256sum(&script)),
        "{text}"
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
}
