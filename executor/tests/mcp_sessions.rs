//! MCP servers run confined as session tools: a real server from PyPI
//! (`mcp-server-time`, installed by `tests/mcp/servers.sh`) under the
//! strongest confinement here, spoken to by the official Python SDK's
//! client through `/v1/mcp/<tool>`, with the real proxy deciding each call
//! against `[tools.<id>.mcp]`: a listed tool answers, a tool the rules
//! leave out is not listed and its call is a JSON-RPC error carrying the
//! fact's id, and the session's end leaves no process and an ended run.
//! Then `mcp-server-git`: its `repo_path` argument matched against a glob
//! before the server sees it, and a repository outside its `read_paths`
//! unreadable even where the rules allow the call (Landlock). And
//! `mcp-server-fetch`: an allowed origin fetched through the run's proxy, an
//! unlisted one failing inside the tool with a `not_allowlisted` fact.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{eventually, marked_processes, python, strongest_isolation, TempDir};
use egress_e2e::harness::{all_facts_at, control_call, TOKEN};
use egress_e2e::mcp::{sdk, serve, server_reads, servers, time_tool};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confined_mcp_server_answers_the_official_client_within_its_rules() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let venv = servers();
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-time");
    let marker = "loom-mcp-time-session";
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &time_tool(&venv, marker, ""));
    exec.warm_up();
    let sessions = exec.sessions("time").unwrap().clone();
    // A warm server is started and initialized before any client comes.
    assert!(
        eventually(Duration::from_secs(60), || sessions.live() == 1
            && marked_processes(marker).len() == 1)
        .await
    );
    let addr = serve(&exec).await;
    let out = sdk(
        addr,
        "time",
        json!([
            ["list"],
            ["call", "get_current_time", {"timezone": "Etc/UTC"}],
            ["call", "convert_time", {"source_timezone": "Etc/UTC", "time": "12:00", "target_timezone": "SECRET-ARG-zone"}]
        ]),
    )
    .await;
    assert_eq!(out["server"], json!("mcp-time"), "{out:#}");
    assert_eq!(out["protocol"], json!("2025-11-25"), "{out:#}");
    let steps = out["steps"].as_array().unwrap();
    // The server has two tools; the rules list one.
    assert_eq!(steps[0]["tools"], json!(["get_current_time"]), "{out:#}");
    assert_eq!(steps[1]["ok"], json!(true), "{out:#}");
    assert!(steps[1]["text"].as_str().unwrap().contains("Etc/UTC"), "{out:#}");
    // The other is refused before the server sees it, with the fact's id.
    assert_eq!(steps[2]["code"], json!(-32003), "{out:#}");
    assert_eq!(steps[2]["data"]["reason"], json!("mcp_tool_not_allowed"), "{out:#}");
    let fact_id = steps[2]["data"]["fact_id"].as_str().unwrap().to_owned();
    let facts = all_facts_at(control).await;
    let fact = facts
        .iter()
        .find(|f| f["id"] == json!(fact_id))
        .expect("the refusal's fact");
    assert_eq!(fact["reason"], json!("mcp_tool_not_allowed"));
    assert_eq!(fact["target"]["kind"], json!("mcp"));
    assert!(
        !fact.to_string().contains("SECRET-ARG"),
        "arguments never reach a fact: {fact}"
    );
    // The project's own Python kernel client, through the same endpoint.
    let kernel = {
        let script = egress_e2e::process::repo_root().join("tests/python/mcp_kernel_client.py");
        let base = format!("http://{addr}");
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("python3")
                .arg(script)
                .args([base.as_str(), TOKEN, "time", "get_current_time", "convert_time"])
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    assert!(kernel.status.success(), "{}", String::from_utf8_lossy(&kernel.stderr));
    let k: Value = serde_json::from_slice(&kernel.stdout).unwrap();
    assert_eq!(k["tools"], json!(["get_current_time"]), "{k}");
    assert!(k["text"].as_str().unwrap().contains("Etc/UTC"), "{k}");
    assert_eq!(
        (&k["refused"]["code"], &k["refused"]["reason"]),
        (&json!(-32003), &json!("mcp_tool_not_allowed")),
        "{k}"
    );
    // And the JavaScript one (Node.js, where there is one).
    if let Some(node) = egress_e2e::executor::node() {
        let script = egress_e2e::process::repo_root().join("tests/js/mcp_kernel_client.mjs");
        let base = format!("http://{addr}");
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new(node)
                .arg(script)
                .args([base.as_str(), TOKEN, "time", "get_current_time", "convert_time"])
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let k: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(k["tools"], json!(["get_current_time"]), "{k}");
        assert!(k["text"].as_str().unwrap().contains("Etc/UTC"), "{k}");
        assert_eq!(
            (&k["refused"]["code"], &k["refused"]["reason"]),
            (&json!(-32003), &json!("mcp_tool_not_allowed")),
            "{k}"
        );
        assert!(k["refused"]["factId"].as_str().is_some_and(|f| !f.is_empty()), "{k}");
    }
    // The clients closed their sessions (DELETE): the servers' trees are
    // gone, their runs ended; the warm one that replaced them waits.
    let run_id = fact["run_id"].as_str().unwrap().to_owned();
    assert!(eventually(Duration::from_secs(20), || sessions.count() == 0).await);
    let r = control_call(control, "GET", &format!("/v1/runs/{run_id}"), None, Some(TOKEN)).await;
    let run: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!((r.status, &run["state"]), (200, &json!("ended")), "{run}");
    assert!(eventually(Duration::from_secs(60), || marked_processes(marker).len() == 1).await);
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    assert!(marked_processes(marker).is_empty(), "nothing of the trees is left");
    drop(proxy);
}

/// A repository at `dir` with one commit whose message is `message`.
fn repo(dir: &Path, message: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let git = |args: &[&str]| {
        let s = std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .status()
            .unwrap();
        assert!(s.success(), "git {args:?}");
    };
    git(&["init", "-q"]);
    std::fs::write(dir.join("f.txt"), message).unwrap();
    git(&["add", "f.txt"]);
    git(&["commit", "-q", "-m", message]);
    // Readable by the confined server's own uid.
    std::process::Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(dir)
        .status()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_git_server_is_held_to_its_argument_rules_and_its_read_paths() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let venv = servers();
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-git");
    let (allowed, secret) = (dir.path().join("repos"), dir.path().join("private"));
    repo(&allowed.join("r1"), "allowed-commit-message");
    repo(&secret.join("r2"), "SECRET-commit-message");
    let tools = format!(
        r#"
[tools.git]
egress = []
[tools.git.mcp]
tools = [{{ name = "git_log", args = {{ repo_path = "{allowed}/*" }} }}, "git_show"]
[tools.git.process]
command = ["{py}", "-m", "mcp_server_git"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
read_paths = [{reads}, "{allowed}"]
# The repositories belong to the test's user, not the server's.
env = {{ GIT_CONFIG_COUNT = "1", GIT_CONFIG_KEY_0 = "safe.directory", GIT_CONFIG_VALUE_0 = "*", LOOM_TEST_MARK = "loom-mcp-git" }}
cold_start_ms = 60000
pool = {{ warm = 0, max = 1 }}
"#,
        allowed = allowed.display(),
        py = venv.join("bin/python3").display(),
        iso = strongest_isolation(),
        reads = server_reads(&venv),
    );
    let Stack { proxy, exec, .. } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    let r1 = allowed.join("r1").display().to_string();
    let r2 = secret.join("r2").display().to_string();
    let out = sdk(
        addr,
        "git",
        json!([
            ["list"],
            ["call", "git_log", {"repo_path": r1}],
            ["call", "git_log", {"repo_path": r2}],
            ["call", "git_show", {"repo_path": r1, "revision": "HEAD"}],
            ["call", "git_show", {"repo_path": r2, "revision": "HEAD"}]
        ]),
    )
    .await;
    let steps = out["steps"].as_array().unwrap();
    assert_eq!(steps[0]["tools"], json!(["git_log", "git_show"]), "{out:#}");
    // Inside the glob: answered.
    assert!(
        steps[1]["text"].as_str().unwrap().contains("allowed-commit-message"),
        "{out:#}"
    );
    // Outside it: refused before the server sees it.
    assert_eq!(
        steps[2]["data"]["reason"],
        json!("mcp_arguments_not_allowed"),
        "{out:#}"
    );
    // The rules allow git_show anywhere; the server reads what Landlock lets it.
    assert!(
        steps[3]["text"].as_str().unwrap().contains("allowed-commit-message"),
        "{out:#}"
    );
    assert!(!out.to_string().contains("SECRET-commit-message"), "{out:#}");
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fetch_server_reaches_its_allowlist_through_the_proxy_and_nothing_else() {
    let Some(_) = python() else { return };
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let venv = servers();
    let dns = FakeDns::start().await;
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    dns.set("origin.test", &["127.0.0.2"]);
    dns.set("elsewhere.test", &["127.0.0.2"]);
    let dir = TempDir::new("mcp-fetch");
    let tools = format!(
        r#"
[tools.fetch]
egress = ["origin.test:{port}"]
[tools.fetch.mcp]
tools = ["fetch"]
[tools.fetch.process]
command = ["{py}", "-m", "mcp_server_fetch"]
lifecycle = "session"
protocol = "mcp-stdio"
isolation = "{iso}"
read_paths = [{reads}]
cold_start_ms = 60000
pool = {{ warm = 0, max = 1 }}
"#,
        py = venv.join("bin/python3").display(),
        iso = strongest_isolation(),
        reads = server_reads(&venv),
    );
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    let out = sdk(
        addr,
        "fetch",
        json!([
            ["call", "fetch", {"url": format!("http://origin.test:{port}/"), "raw": true}],
            ["call", "fetch", {"url": format!("http://elsewhere.test:{port}/"), "raw": true}]
        ]),
    )
    .await;
    let steps = out["steps"].as_array().unwrap();
    assert!(
        steps[0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("hello from origin"),
        "{out:#}"
    );
    // The unlisted name fails inside the tool, and is a fact of the session's run.
    assert!(!steps[1].to_string().contains("hello from origin"), "{out:#}");
    assert!(
        steps[1]["ok"] == json!(false) || steps[1].get("code").is_some(),
        "{out:#}"
    );
    let facts = all_facts_at(control).await;
    assert!(
        facts.iter().any(|f| f["reason"] == json!("not_allowlisted")
            && f["target"]["host"] == json!("elsewhere.test")
            && f["tool"] == json!("fetch")),
        "{facts:#?}"
    );
    exec.shutdown();
    exec.drain(Duration::from_secs(20)).await;
    drop(proxy);
}
