//! Lifecycle of single-use children against a fake control API: the happy
//! path through the Python runner, every typed error, the clocks, pool bounds
//! and refill, and the kill guarantees checked through `/proc`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_executor::{ErrorKind, Executor, Phase};
use serde_json::json;

struct Env {
    control: FakeControl,
    _dir: TempDir,
    exec: Arc<Executor>,
}

/// A fake control API, a temp dir holding `files`, and an executor whose
/// config has the given tool sections.
async fn setup(tag: &str, pid_namespace: bool, tools: &str, files: &[(&str, &str)]) -> Env {
    let dir = TempDir::new(tag);
    for (name, body) in files {
        dir.write(name, body);
    }
    let tools = tools.replace("@RUNNER@", &python_runner().display().to_string());
    let (control, exec) = beside_fake_control(&dir, pid_namespace, &tools).await;
    Env {
        control,
        _dir: dir,
        exec,
    }
}

const ECHO_PY: &str = r#"
import os
LOADED = 0
LOADED += 1
def run(input, ctx):
    ctx.emit({"step": 1})
    ctx.emit({"step": 2})
    print("hello from stdout")
    return {"echo": input, "run_id": ctx.run_id, "key": ctx.idempotency_key,
            "env": sorted(os.environ.keys()), "tmpdir": os.environ["TMPDIR"],
            "tmp_exists": os.path.isdir(os.environ["TMPDIR"]),
            "proxy": os.environ["HTTP_PROXY"], "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
            "loaded": LOADED}
"#;

fn echo_tool(extra: &str) -> String {
    format!(
        r#"
[tools.echo]
egress = []
[tools.echo.process]
command = ["python3", "@RUNNER@", "echo.py"]
env = {{ TOOL_MODE = "test" }}
cold_start_ms = 20000
timeout_ms = 20000
{extra}
"#
    )
}

#[tokio::test]
async fn python_tool_round_trip_with_emits_env_and_run_lifecycle() {
    let Some(_) = python() else { return };
    let env = setup(
        "echo",
        true,
        &echo_tool("pool = { warm = 0, max = 2 }"),
        &[("echo.py", ECHO_PY)],
    )
    .await;
    env.control.set_facts(vec![
        json!({"type": "EGRESS_DENIED", "seq": 1, "reason": "not_allowlisted",
        "target": {"kind": "connect", "host": "evil.example", "port": 443}}),
    ]);
    let mut r = invocation("echo", json!({"q": "weather"}));
    r.idempotency_key = Some("key-1".into());
    let res = env.exec.invoke(r).await;
    assert!(res.ok, "{res:?}");
    let out = res.output.clone().unwrap();
    assert_eq!(out["echo"], json!({"q": "weather"}));
    assert_eq!(out["key"], json!("key-1"));
    let run_id = res.run_id.clone().unwrap();
    assert_eq!(out["run_id"], json!(run_id));
    assert_eq!(out["loaded"], json!(1));
    assert_eq!(res.emits, vec![json!({"step": 1}), json!({"step": 2})]);
    assert!(res.stdout.contains("hello from stdout"), "{}", res.stdout);
    // The environment is exactly the documented set.
    let keys: Vec<&str> = out["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let mut expected = vec![
        "ALL_PROXY",
        "HTTPS_PROXY",
        "HTTP_PROXY",
        "LANG",
        "LOOM_IPC_FDS",
        "LOOM_SOCKS_PROXY",
        "NODE_USE_ENV_PROXY",
        "NO_PROXY",
        "PATH",
        "TMPDIR",
        "TOOL_MODE",
        "all_proxy",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    ];
    // Python itself may add LC_CTYPE when coercing the C locale.
    let keys: Vec<&str> = keys.into_iter().filter(|k| *k != "LC_CTYPE").collect();
    expected.sort();
    assert_eq!(keys, expected);
    // Confined (the default): the run's credential, at the listener inside
    // the child's own network namespace.
    assert_eq!(out["proxy"], json!(format!("http://{run_id}:s3cret@127.0.0.1:3128")));
    assert_eq!(out["tmp_exists"], json!(true));
    // Only fds 0-4 are inherited (the listing itself opens one more).
    let fds: Vec<i64> = out["fds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert!(fds.starts_with(&[0, 1, 2, 3, 4]) && fds.len() <= 6, "{fds:?}");
    // The scratch directory is removed after the run (once the answer is out).
    let tmpdir = std::path::PathBuf::from(out["tmpdir"].as_str().unwrap());
    assert!(
        eventually(Duration::from_secs(10), || !tmpdir.exists()).await,
        "scratch directory {} left behind",
        tmpdir.display()
    );
    // Run lifecycle on the proxy: created inactive, activated, ended. The
    // activation travels beside the invocation and the end follows the
    // result, so a tool this quick may see its end arrive first (the
    // activation is then refused, and the run stays ended).
    let calls = env.control.calls();
    assert_eq!(calls[0], format!("create {run_id}"));
    let mut rest = calls[1..].to_vec();
    rest.sort();
    assert_eq!(rest, vec![format!("activate {run_id}"), format!("end {run_id}")]);
    assert_eq!(env.control.create_bodies()[0]["activate"], json!(false));
    assert_eq!(env.control.run_state(&run_id).as_deref(), Some("ended"));
    // Facts come from the proxy for that run.
    assert_eq!(res.facts.len(), 1);
    assert_eq!(res.facts[0].run_id.as_deref(), Some(run_id.as_str()));
    let m = env.exec.metrics().encode();
    assert!(
        m.contains("executor_invocations_total{tool=\"echo\",outcome=\"ok\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("executor_kills_total{tool=\"echo\",reason=\"done\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("executor_cold_start_seconds_count{tool=\"echo\",phase=\"load\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn warm_children_are_single_use_and_refilled() {
    let Some(_) = python() else { return };
    let env = setup(
        "warm",
        true,
        &echo_tool("pool = { warm = 2, max = 3 }"),
        &[("echo.py", ECHO_PY)],
    )
    .await;
    env.exec.warm_up();
    let pool = env.exec.pool("echo").unwrap().clone();
    assert!(
        eventually(Duration::from_secs(20), || pool.counts().0 == 2).await,
        "pool never warmed"
    );
    let created_before = env.control.create_bodies().len();
    assert_eq!(created_before, 2);
    let a = env.exec.invoke(invocation("echo", json!(1))).await;
    let b = env.exec.invoke(invocation("echo", json!(2))).await;
    assert!(a.ok && b.ok, "{a:?} {b:?}");
    assert_ne!(a.run_id, b.run_id);
    // Each child served exactly one invocation: its module loaded once.
    assert_eq!(a.output.unwrap()["loaded"], json!(1));
    // Both runs were pre-created (warm), and the pool refills behind them.
    assert!(
        eventually(Duration::from_secs(20), || pool.counts().0 == 2).await,
        "pool never refilled"
    );
    assert_eq!(env.control.create_bodies().len(), 4);
    let m = env.exec.metrics().encode();
    assert!(m.contains("executor_pool_ready{tool=\"echo\"} 2"), "{m}");
}

const HOSTILE_PY: &str = r#"
import os, signal, time
def spawn_tree():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:              # grandchild ignoring SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(300); os._exit(0)
    if os.fork() == 0:              # grandchild in its own session
        os.setsid(); time.sleep(300); os._exit(0)
    if os.fork() == 0:              # double fork: a daemon re-parented away
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(300); os._exit(0)
        os._exit(0)
def run(input, ctx):
    spawn_tree()
    time.sleep(300)
"#;

fn hostile_tool(marker: &str, timeout_ms: u64) -> String {
    format!(
        r#"
[tools.hostile]
egress = []
[tools.hostile.process]
command = ["python3", "@RUNNER@", "hostile.py"]
env = {{ LOOM_TEST_MARK = "{marker}" }}
timeout_ms = {timeout_ms}
pool = {{ warm = 0, max = 2 }}
"#
    )
}

/// Run the hostile tool; once its whole tree (leader + 3 descendants) is
/// visible in /proc, optionally abort; return the result.
async fn run_hostile(env: &Env, marker: &str, abort: bool) -> egress_executor::InvocationResult {
    let exec = env.exec.clone();
    let mut r = invocation("hostile", json!(null));
    r.idempotency_key = Some(format!("abort-{marker}"));
    let task = tokio::spawn(async move { exec.invoke(r).await });
    let m = marker.to_string();
    assert!(
        eventually(Duration::from_secs(20), || marked_processes(&format!(
            "LOOM_TEST_MARK={m}"
        ))
        .len()
            >= 4)
        .await,
        "the hostile tree never came up"
    );
    if abort {
        assert!(env.exec.abort(&format!("abort-{marker}")));
    }
    task.await.unwrap()
}

#[tokio::test]
async fn timeout_kills_the_whole_tree_in_a_pid_namespace() {
    if python().is_none() || !is_root() {
        eprintln!("skipped: needs python3 and root for PID namespaces");
        return;
    }
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let env = setup(
        "timeout",
        true,
        &hostile_tool(&marker, 3000),
        &[("hostile.py", HOSTILE_PY)],
    )
    .await;
    let res = run_hostile(&env, &marker, false).await;
    let e = res.error.clone().unwrap();
    assert_eq!(e.kind, ErrorKind::Timeout, "{res:?}");
    // PID namespace: reaping its init means the namespace is empty.
    assert_eq!(marked_processes(&format!("LOOM_TEST_MARK={marker}")), Vec::<i32>::new());
    let m = env.exec.metrics().encode();
    assert!(
        m.contains("executor_kills_total{tool=\"hostile\",reason=\"timeout\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("executor_invocations_total{tool=\"hostile\",outcome=\"timeout\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn abort_kills_the_whole_tree_in_a_pid_namespace() {
    if python().is_none() || !is_root() {
        eprintln!("skipped: needs python3 and root for PID namespaces");
        return;
    }
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let env = setup(
        "abort",
        true,
        &hostile_tool(&marker, 60_000),
        &[("hostile.py", HOSTILE_PY)],
    )
    .await;
    let res = run_hostile(&env, &marker, true).await;
    assert_eq!(res.error.clone().unwrap().kind, ErrorKind::Aborted, "{res:?}");
    assert_eq!(marked_processes(&format!("LOOM_TEST_MARK={marker}")), Vec::<i32>::new());
    assert!(
        !env.exec.abort(&format!("abort-{marker}")),
        "registry entry must be gone"
    );
}

const FORKER_PY: &str = r#"
import os, signal, time
def run(input, ctx):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(2):
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(300); os._exit(0)
    time.sleep(300)
"#;

#[tokio::test]
async fn process_group_mode_kills_same_group_descendants() {
    let Some(_) = python() else { return };
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let tools = format!(
        r#"
[tools.forker]
egress = []
[tools.forker.process]
command = ["python3", "@RUNNER@", "forker.py"]
env = {{ LOOM_TEST_MARK = "{marker}" }}
timeout_ms = 3000
pool = {{ warm = 0, max = 1 }}
"#
    );
    let env = setup("pgroup", false, &tools, &[("forker.py", FORKER_PY)]).await;
    let exec = env.exec.clone();
    let task = tokio::spawn(async move { exec.invoke(invocation("forker", json!(null))).await });
    let needle = format!("LOOM_TEST_MARK={marker}");
    assert!(eventually(Duration::from_secs(20), || marked_processes(&needle).len() >= 3).await);
    let res = task.await.unwrap();
    assert_eq!(res.error.unwrap().kind, ErrorKind::Timeout);
    // Group members die with the group SIGKILL (asynchronously after the leader).
    assert!(eventually(Duration::from_secs(10), || marked_processes(&needle).is_empty()).await);
}

#[tokio::test]
async fn escaped_descendant_holding_stdout_does_not_hang_the_executor() {
    let Some(_) = python() else { return };
    // Process-group mode on purpose: the daemon escapes the group and keeps
    // stdout/stderr and the IPC pipe open after the leader is gone.
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let tool = r#"
import os, time
def run(input, ctx):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
        os._exit(0)
    return "done"
"#;
    let tools = format!(
        r#"
[tools.daemon]
egress = []
[tools.daemon.process]
command = ["python3", "@RUNNER@", "daemon.py"]
env = {{ LOOM_TEST_MARK = "{marker}" }}
timeout_ms = 30000
pool = {{ warm = 0, max = 1 }}
"#
    );
    let env = setup("daemon", false, &tools, &[("daemon.py", tool)]).await;
    let res = env.exec.invoke(invocation("daemon", json!(null))).await;
    assert!(res.ok, "{res:?}");
    assert_eq!(res.output, Some(json!("done")));
    // Documented weakness of process-group mode: the daemon survives. Clean up.
    for pid in marked_processes(&format!("LOOM_TEST_MARK={marker}")) {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
}

fn misbehaving(name: &str, body: &str, timeout_ms: u64) -> (String, String, String) {
    let tools = format!(
        r#"
[tools.{name}]
egress = []
[tools.{name}.process]
command = ["python3", "@RUNNER@", "{name}.py"]
cold_start_ms = 5000
timeout_ms = {timeout_ms}
pool = {{ warm = 0, max = 1, queue = 0 }}
"#
    );
    (tools, format!("{name}.py"), body.to_string())
}

async fn run_misbehaving(name: &str, body: &str, timeout_ms: u64) -> egress_executor::InvocationResult {
    let (tools, file, body) = misbehaving(name, body, timeout_ms);
    let env = setup(name, true, &tools, &[(&file, &body)]).await;
    let res = env.exec.invoke(invocation(name, json!(null))).await;
    // Whatever happened, the run was ended on the proxy.
    if let Some(id) = &res.run_id {
        assert_eq!(env.control.run_state(id).as_deref(), Some("ended"));
    }
    res
}

#[tokio::test]
async fn closing_ipc_fds_is_disconnected_at_once() {
    let Some(_) = python() else { return };
    let body = "import os, time\ndef run(input, ctx):\n    os.close(3); os.close(4)\n    time.sleep(300)\n";
    let res = run_misbehaving("closer", body, 60_000).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Disconnected, "{e:?}");
    assert!(res.duration_ms < 30_000);
}

#[tokio::test]
async fn garbage_on_ipc_is_a_protocol_violation() {
    let Some(_) = python() else { return };
    let body = "import os, time\ndef run(input, ctx):\n    os.write(4, b'this is not json\\n')\n    time.sleep(300)\n";
    let res = run_misbehaving("garbage", body, 60_000).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Protocol, "{e:?}");
    assert!(e.message.contains("malformed"), "{e:?}");
}

#[tokio::test]
async fn out_of_order_message_is_a_protocol_violation() {
    let Some(_) = python() else { return };
    let body = "import os, time\ndef run(input, ctx):\n    os.write(4, b'{\"t\":\"ready\"}\\n')\n    time.sleep(300)\n";
    let res = run_misbehaving("order", body, 60_000).await;
    assert_eq!(res.error.unwrap().kind, ErrorKind::Protocol);
}

#[tokio::test]
async fn oversized_line_is_a_protocol_violation() {
    let Some(_) = python() else { return };
    let body = "import os, time\ndef run(input, ctx):\n    os.write(4, b'{\"t\":\"emit\",\"fact\":\"' + b'x' * (2 << 20))\n    time.sleep(300)\n";
    let res = run_misbehaving("oversized", body, 60_000).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Protocol, "{e:?}");
    assert!(e.message.contains("longer than"), "{e:?}");
}

#[tokio::test]
async fn tool_exception_is_tool_error_with_stderr_tail() {
    let Some(_) = python() else { return };
    let body = "def run(input, ctx):\n    ctx.emit({'before': 1})\n    raise ValueError('no such city')\n";
    let res = run_misbehaving("raiser", body, 20_000).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::ToolError);
    assert!(e.message.contains("ValueError: no such city"), "{e:?}");
    assert!(e.stderr_tail.contains("Traceback"), "{e:?}");
}

#[tokio::test]
async fn silent_tool_is_killed_at_timeout() {
    let Some(_) = python() else { return };
    let body = "import time\ndef run(input, ctx):\n    time.sleep(300)\n";
    let res = run_misbehaving("silent", body, 1500).await;
    assert_eq!(res.error.unwrap().kind, ErrorKind::Timeout);
}

#[tokio::test]
async fn import_failure_is_startup_load() {
    let Some(_) = python() else { return };
    let body = "import sys\nsys.stderr.write('loading config...\\n')\nraise RuntimeError('bad model file')\n";
    let res = run_misbehaving("badload", body, 20_000).await;
    let e = res.error.unwrap();
    assert_eq!((e.kind, e.phase), (ErrorKind::Startup, Some(Phase::Load)), "{e:?}");
    assert!(e.message.contains("bad model file"), "{e:?}");
    assert!(e.stderr_tail.contains("loading config"), "{e:?}");
}

#[tokio::test]
async fn missing_program_is_startup_spawn() {
    let env = setup(
        "noprog",
        true,
        r#"
[tools.ghost]
egress = []
[tools.ghost.process]
command = ["definitely-not-a-program-here"]
pool = { warm = 0, max = 1 }
"#,
        &[],
    )
    .await;
    let res = env.exec.invoke(invocation("ghost", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!((e.kind, e.phase), (ErrorKind::Startup, Some(Phase::Spawn)), "{e:?}");
    assert!(e.message.contains("not found"), "{e:?}");
    // Found missing while what the child would run is hashed, before its
    // run is created: no run is left for it.
    let calls = env.control.calls();
    assert!(!calls.iter().any(|c| c.starts_with("create ")), "{calls:?}");
}

#[tokio::test]
async fn never_booting_is_startup_spawn_at_cold_start() {
    let Some(_) = python() else { return };
    let env = setup(
        "noboot",
        true,
        r#"
[tools.mute]
egress = []
[tools.mute.process]
command = ["python3", "-c", "import time; time.sleep(300)"]
cold_start_ms = 1000
pool = { warm = 0, max = 1 }
"#,
        &[],
    )
    .await;
    let res = env.exec.invoke(invocation("mute", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!((e.kind, e.phase), (ErrorKind::Startup, Some(Phase::Spawn)), "{e:?}");
    assert!(e.message.contains("no `booted`"), "{e:?}");
}

#[tokio::test]
async fn excess_invocations_are_busy() {
    let Some(_) = python() else { return };
    let body = "import time\ndef run(input, ctx):\n    time.sleep(300)\n";
    let (tools, file, body) = misbehaving("slow", body, 60_000);
    let env = setup("busy", true, &tools, &[(&file, &body)]).await;
    let exec = env.exec.clone();
    let mut first = invocation("slow", json!(null));
    first.idempotency_key = Some("first".into());
    let task = tokio::spawn(async move { exec.invoke(first).await });
    // Once the first invocation's run is active, the only slot is taken.
    let activated = env.control.activated.clone();
    let wait = activated.notified();
    let pool = env.exec.pool("slow").unwrap().clone();
    if pool.counts().2 == 0 {
        wait.await;
    }
    let second = env.exec.invoke(invocation("slow", json!(null))).await;
    let e = second.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Busy, "{e:?}");
    assert_eq!(e.kind.http_status(), 503);
    assert!(env.exec.abort("first"));
    assert_eq!(task.await.unwrap().error.unwrap().kind, ErrorKind::Aborted);
    let m = env.exec.metrics().encode();
    assert!(
        m.contains("executor_invocations_total{tool=\"slow\",outcome=\"busy\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn queued_invocation_gets_the_next_child() {
    let Some(_) = python() else { return };
    let env = setup(
        "queue",
        true,
        &echo_tool("pool = { warm = 0, max = 1, queue = 4 }"),
        &[("echo.py", ECHO_PY)],
    )
    .await;
    let mut tasks = Vec::new();
    for i in 0..3 {
        let exec = env.exec.clone();
        tasks.push(tokio::spawn(
            async move { exec.invoke(invocation("echo", json!(i))).await },
        ));
    }
    let mut runs = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert!(r.ok, "{r:?}");
        runs.push(r.run_id.unwrap());
    }
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), 3);
}

#[tokio::test]
async fn kernel_run_id_gets_a_dedicated_child() {
    let Some(_) = python() else { return };
    let env = setup(
        "runid",
        true,
        &echo_tool("pool = { warm = 0, max = 1 }"),
        &[("echo.py", ECHO_PY)],
    )
    .await;
    let mut r = invocation("echo", json!("x"));
    r.run_id = Some("kernel-run-7".into());
    let res = env.exec.invoke(r).await;
    assert!(res.ok, "{res:?}");
    assert_eq!(res.run_id.as_deref(), Some("kernel-run-7"));
    assert_eq!(res.output.unwrap()["run_id"], json!("kernel-run-7"));
    assert_eq!(env.control.create_bodies()[0]["run_id"], json!("kernel-run-7"));
}

#[tokio::test]
async fn plain_protocol_tool_gets_input_on_stdin() {
    let env = setup(
        "plain",
        true,
        r#"
[tools.plain]
egress = []
[tools.plain.process]
command = ["sh", "-c", "read line; echo \"got $line\"; echo oops >&2; exit $EXIT"]
protocol = "plain"
env = { EXIT = "0" }
pool = { warm = 1, max = 1 }
[tools.failing]
egress = []
[tools.failing.process]
command = ["sh", "-c", "echo partial; echo broken >&2; exit 3"]
protocol = "plain"
pool = { warm = 0, max = 1 }
"#,
        &[],
    )
    .await;
    env.exec.warm_up();
    let res = env.exec.invoke(invocation("plain", json!({"a": 1}))).await;
    assert!(res.ok, "{res:?}");
    assert_eq!(res.output.unwrap()["stdout"], json!("got {\"a\":1}\n"));
    assert_eq!(res.exit.as_deref(), Some("exit code 0"));
    let res = env.exec.invoke(invocation("failing", json!(null))).await;
    let e = res.error.clone().unwrap();
    assert_eq!(e.kind, ErrorKind::ToolError, "{res:?}");
    assert_eq!(e.message, "exited with exit code 3");
    assert_eq!(e.stderr_tail, "broken\n");
    assert_eq!(res.stdout, "partial\n");
}

#[tokio::test]
async fn unknown_tool_is_404() {
    let env = setup("unknown", true, "", &[]).await;
    let res = env.exec.invoke(invocation("nope", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::UnknownTool);
    assert_eq!(e.kind.http_status(), 404);
}

#[tokio::test]
async fn proxy_down_is_a_proxy_error() {
    let dir = TempDir::new("proxydown");
    // Bind and drop: nothing listens on this loopback port.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = write_config(
        &dir,
        addr,
        true,
        "[tools.t]\negress = []\n[tools.t.process]\ncommand = [\"true\"]\npool = { warm = 0, max = 1 }\n",
    );
    let exec = executor(&cfg);
    let res = exec.invoke(invocation("t", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Proxy, "{e:?}");
    assert!(e.message.contains("unreachable"), "{e:?}");
}

#[tokio::test]
async fn warm_child_that_dies_is_replaced_and_never_handed_out() {
    let Some(_) = python() else { return };
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let env = setup(
        "warmdeath",
        true,
        &echo_tool(&format!(
            "pool = {{ warm = 1, max = 1 }}\n[tools.echo.process.env]\nLOOM_TEST_MARK = \"{marker}\""
        ))
        .replace("env = { TOOL_MODE = \"test\" }\n", ""),
        &[("echo.py", ECHO_PY)],
    )
    .await;
    env.exec.warm_up();
    let pool = env.exec.pool("echo").unwrap().clone();
    let needle = format!("LOOM_TEST_MARK={marker}");
    assert!(eventually(Duration::from_secs(20), || pool.counts().0 == 1).await);
    let victims = marked_processes(&needle);
    assert_eq!(victims.len(), 1, "{victims:?}");
    std::process::Command::new("kill")
        .args(["-9", &victims[0].to_string()])
        .status()
        .unwrap();
    let exec = env.exec.clone();
    assert!(
        eventually(Duration::from_secs(20), || exec
            .metrics()
            .encode()
            .contains("executor_kills_total{tool=\"echo\",reason=\"warm_death\"} 1"))
        .await
    );
    // The replacement serves the invocation.
    let res = env.exec.invoke(invocation("echo", json!("after"))).await;
    assert!(res.ok, "{res:?}");
    assert!(!marked_processes(&needle).contains(&victims[0]));
}

#[tokio::test]
async fn idle_warm_children_are_recycled_before_their_run_expires() {
    let Some(_) = python() else { return };
    let control = FakeControl::start().await;
    let dir = TempDir::new("recycle");
    dir.write("echo.py", ECHO_PY);
    let runner = python_runner();
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        &echo_tool("pool = { warm = 1, max = 1 }").replace("@RUNNER@", &runner.display().to_string()),
    );
    // A proxy whose runs live 2 s: warm children must not idle past 1 s.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("[proxy]\n", "[proxy]\nmax_run_ms = 2000\n");
    std::fs::write(&cfg, text).unwrap();
    let exec = executor(&cfg);
    exec.warm_up();
    let e2 = exec.clone();
    assert!(
        eventually(Duration::from_secs(30), || e2
            .metrics()
            .encode()
            .contains("executor_kills_total{tool=\"echo\",reason=\"recycled\"}"))
        .await
    );
    let res = exec.invoke(invocation("echo", json!(1))).await;
    assert!(res.ok, "{res:?}");
}

#[tokio::test]
async fn a_caller_that_goes_away_aborts_its_invocation_and_frees_the_slot() {
    let Some(_) = python() else { return };
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let tools = format!(
        r#"
[tools.slow]
egress = []
[tools.slow.process]
command = ["python3", "@RUNNER@", "slow.py"]
env = {{ LOOM_TEST_MARK = "{marker}" }}
timeout_ms = 60000
pool = {{ warm = 0, max = 1, queue = 0 }}
"#
    );
    let body = "import sys, time\ndef run(input, ctx):\n    if input == 'wait':\n        time.sleep(300)\n    return 'quick'\n";
    let env = setup("goaway", true, &tools, &[("slow.py", body)]).await;
    let exec = env.exec.clone();
    let activated = env.control.activated.notified();
    // Like an HTTP client that disconnects: the invocation future is dropped.
    let task = tokio::spawn(async move { exec.invoke(invocation("slow", json!("wait"))).await });
    activated.await;
    task.abort();
    let pool = env.exec.pool("slow").unwrap().clone();
    let needle = format!("LOOM_TEST_MARK={marker}");
    assert!(
        eventually(Duration::from_secs(20), || pool.counts() == (0, 0, 0)
            && marked_processes(&needle).is_empty())
        .await,
        "slot or child leaked: {:?} {:?}",
        pool.counts(),
        marked_processes(&needle)
    );
    let m = env.exec.metrics().encode();
    assert!(
        m.contains("executor_kills_total{tool=\"slow\",reason=\"abort\"} 1"),
        "{m}"
    );
    // The single slot is free again.
    let res = env.exec.invoke(invocation("slow", json!("now"))).await;
    assert_eq!(res.output, Some(json!("quick")), "{res:?}");
}

#[tokio::test]
async fn exit_after_booted_is_startup_load() {
    let Some(_) = python() else { return };
    let marker = uuid::Uuid::new_v4().simple().to_string();
    let env = setup(
        "bootexit",
        false,
        &r#"
[tools.quitter]
egress = []
[tools.quitter.process]
command = ["python3", "-c", "import os, time\nos.write(4, b'{\"t\":\"booted\"}\\n')\nif os.fork() == 0:\n    os.setsid(); time.sleep(30); os._exit(0)\nos._exit(3)"]
cold_start_ms = 20000
env = { LOOM_TEST_MARK = "@MARK@" }
pool = { warm = 0, max = 1 }
"#
        .replace("@MARK@", &marker),
        &[],
    )
    .await;
    // Process-group mode with a daemon that keeps fd 4 open: the exit itself
    // must end the start, not the cold-start clock.
    let res = env.exec.invoke(invocation("quitter", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!((e.kind, e.phase), (ErrorKind::Startup, Some(Phase::Load)), "{e:?}");
    assert!(e.message.contains("exit code 3"), "{e:?}");
    assert!(res.duration_ms < 15_000, "{}", res.duration_ms);
    for pid in marked_processes(&format!("LOOM_TEST_MARK={marker}")) {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
}

/// The activation travels beside the invocation. When the proxy refuses it
/// (the run is ended or unknown there), none of the child's fetches went
/// out: the child is killed and the invocation runs once more on a fresh
/// child. Any other failure leaves the activation's outcome unknown, so the
/// invocation fails without a second run.
#[tokio::test]
async fn a_refused_activation_is_retried_on_a_fresh_child_and_an_unknown_one_is_not() {
    let Some(_) = python() else { return };
    // Slow enough that the activation's answer comes before the result.
    let body = "import time\ndef run(input, ctx):\n    time.sleep(0.5)\n    return input\n";
    let (tools, file, body) = misbehaving("slow", body, 20_000);
    // Room for the fresh child while the refused one is torn down.
    let tools = tools.replace(
        "pool = { warm = 0, max = 1, queue = 0 }",
        "pool = { warm = 0, max = 2, queue = 4 }",
    );
    let env = setup("refused-activation", true, &tools, &[(&file, &body)]).await;
    let activations = |c: &FakeControl| c.calls().iter().filter(|c| c.starts_with("activate")).count();

    env.control.refuse_activations(409, 1);
    let res = env.exec.invoke(invocation("slow", json!("again"))).await;
    assert_eq!(res.output, Some(json!("again")), "{res:?}");
    assert_eq!(activations(&env.control), 2, "{:?}", env.control.calls());
    let m = env.exec.metrics().encode();
    assert!(
        m.contains("executor_kills_total{tool=\"slow\",reason=\"proxy_error\"} 1"),
        "{m}"
    );

    env.control.refuse_activations(503, 1);
    let res = env.exec.invoke(invocation("slow", json!("once"))).await;
    let e = res.error.expect("the invocation fails");
    assert_eq!(e.kind, ErrorKind::Proxy, "{e:?}");
    assert!(e.message.contains("activating the run"), "{e:?}");
    assert_eq!(activations(&env.control), 3, "no second try: {:?}", env.control.calls());
}
