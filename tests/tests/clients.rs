//! The kernel clients (`clients/python`, `clients/js`) against the real
//! `egress-proxy` and `egress-executor` binaries: runs each language's own
//! test suite as a child process, pointed at the binaries cargo built for
//! this test run, and fails unless it exits 0 having passed every test.
//! Then the examples of the README's worked example and `docs/clients.md`:
//! `examples/egress.toml` (on free ports) with both kernel scripts.
//! Each suite also runs the clients' MCP sessions against the official MCP
//! SDK's Streamable HTTP server (`clients/testing/mcp_server.py`; the `mcp`
//! package of `clients/python/requirements-test.txt` must be installed).
//! Skipped, loudly, when `python3` or `node` is missing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::process::{bin, free_port, repo_root, ProxyProcess};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Tests each suite has at least (a suite that loses tests fails here).
const PYTHON_TESTS: usize = 21;
const NODE_TESTS: usize = 22;

/// The directory holding both service binaries (`target/debug` of this build).
fn bin_dir() -> PathBuf {
    let proxy = bin("egress-proxy");
    let dir = proxy.parent().unwrap().to_path_buf();
    assert!(
        dir.join("egress-executor").exists(),
        "{} not built; run `cargo build -p egress-executor` (cargo test --workspace builds it)",
        dir.join("egress-executor").display()
    );
    dir
}

fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Runs `cmd` in the repository root with a time cap; returns (success, stdout, stderr).
fn run(mut cmd: Command, cap: Duration) -> (bool, String, String) {
    let mut child = cmd
        .current_dir(repo_root())
        .env("EGRESS_BIN_DIR", bin_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > cap {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (t_out.join().unwrap(), t_err.join().unwrap());
    match status {
        Some(st) => (st.success(), stdout, stderr),
        None => panic!("timed out after {cap:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"),
    }
}

/// The number after `prefix` on the first line that starts with it.
fn count_after(text: &str, prefix: &str) -> Option<usize> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[test]
fn python_client_against_the_real_binaries() {
    let Some(python) = find("python3") else {
        eprintln!("SKIPPED: python3 not found on PATH; the Python kernel client is NOT tested");
        return;
    };
    let mut cmd = Command::new(python);
    cmd.args(["-m", "unittest", "discover", "-s", "clients/python", "-v"])
        .env_remove("EGRESS_CONTROL_TOKEN");
    let (ok, stdout, stderr) = run(cmd, Duration::from_secs(300));
    let all = format!("{stdout}\n{stderr}");
    assert!(ok, "python client tests failed:\n{all}");
    let ran = count_after(&all, "Ran ").unwrap_or(0);
    assert!(
        ran >= PYTHON_TESTS,
        "expected at least {PYTHON_TESTS} tests, ran {ran}:\n{all}"
    );
    let verdict = all.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    assert_eq!(verdict.trim(), "OK", "tests skipped or failed:\n{all}");
    eprintln!("python client: {ran} passed");
}

#[test]
fn js_client_against_the_real_binaries() {
    let Some(node) = find("node") else {
        eprintln!("SKIPPED: node not found on PATH; the JavaScript kernel client is NOT tested");
        return;
    };
    let mut cmd = Command::new(node);
    cmd.args(["--test", "--test-reporter=tap", "clients/js/test/"])
        .env_remove("EGRESS_CONTROL_TOKEN");
    let (ok, stdout, stderr) = run(cmd, Duration::from_secs(300));
    let all = format!("{stdout}\n{stderr}");
    assert!(ok, "js client tests failed:\n{all}");
    let pass = count_after(&stdout, "# pass ").unwrap_or(0);
    assert!(
        pass >= NODE_TESTS,
        "expected at least {NODE_TESTS} passed, got {pass}:\n{all}"
    );
    for zero in ["# fail ", "# cancelled ", "# skipped "] {
        assert_eq!(count_after(&stdout, zero), Some(0), "`{zero}` is not 0:\n{all}");
    }
    eprintln!("js client: {pass} passed");
}

/// The example Rust tool as `cargo test` or `cargo build --example` left it.
fn hello_tool() -> Option<PathBuf> {
    let dir = bin_dir().join("examples");
    let plain = dir.join("hello_tool");
    if plain.is_file() {
        return Some(plain);
    }
    std::fs::read_dir(&dir)
        .ok()?
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("hello_tool-") && !n.contains('.')
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

fn wait_healthy(addr: &str, what: &str, child: &mut std::process::Child) {
    use std::io::Write;
    let t0 = Instant::now();
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            if buf.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "{what} exited");
        assert!(t0.elapsed() < Duration::from_secs(30), "{what} did not become healthy");
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn examples_run_as_the_readme_says() {
    let (Some(python), Some(node)) = (find("python3"), find("node")) else {
        eprintln!("SKIPPED: python3 or node not found on PATH; the examples are NOT tested");
        return;
    };
    let Some(hello) = hello_tool() else {
        panic!("the example Rust tool is not built: cargo build -p egress-tool --example hello_tool");
    };
    let root = repo_root();
    let token = "example-test-token-0123456789";
    let (listen, control, executor) = (free_port(), free_port(), free_port());
    // examples/egress.toml with free ports, absolute paths and facts in memory.
    let text = std::fs::read_to_string(root.join("examples/egress.toml")).unwrap();
    let r = root.display().to_string();
    let text = text
        .replace("127.0.0.1:3128", &format!("127.0.0.1:{listen}"))
        .replace("127.0.0.1:3129", &format!("127.0.0.1:{control}"))
        .replace("127.0.0.1:3130", &format!("127.0.0.1:{executor}"))
        .replace("\"../var/examples-facts.db\"", "\":memory:\"")
        .replace(
            "\"../target/debug/examples/hello_tool\"",
            &format!("{:?}", hello.display().to_string()),
        )
        .replace("\"../", &format!("\"{r}/"))
        .replace("\"tools/", &format!("\"{r}/examples/tools/"));
    assert!(
        text.contains(":memory:") && !text.contains("\"../"),
        "examples/egress.toml changed shape:\n{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("egress.toml");
    std::fs::write(&config, &text).unwrap();

    let proxy = ProxyProcess::start(
        &config,
        format!("127.0.0.1:{listen}").parse().unwrap(),
        format!("127.0.0.1:{control}").parse().unwrap(),
        token,
        &[],
    );
    let mut exec = Command::new(bin_dir().join("egress-executor"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("EGRESS_CONTROL_TOKEN", token)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_healthy(&format!("127.0.0.1:{executor}"), "egress-executor", &mut exec);

    let control_url = format!("http://127.0.0.1:{control}");
    let executor_url = format!("http://127.0.0.1:{executor}");
    let mut py = Command::new(python);
    py.arg("examples/kernel.py")
        .args(["--control", &control_url, "--executor", &executor_url])
        .env("EGRESS_CONTROL_TOKEN", token);
    let mut js = Command::new(node);
    js.arg("examples/kernel.mjs")
        .env("EGRESS_CONTROL_URL", &control_url)
        .env("EGRESS_EXECUTOR_URL", &executor_url)
        .env("EGRESS_CONTROL_TOKEN", token);
    let results: Vec<_> = [py, js].into_iter().map(|c| run(c, Duration::from_secs(120))).collect();
    // SIGTERM: the executor ends its warm children's runs and exits.
    let _ = Command::new("kill").args(["-TERM", &exec.id().to_string()]).status();
    let t0 = Instant::now();
    while exec.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = exec.kill();
    let _ = exec.wait();
    drop(proxy);
    for (ok, stdout, stderr) in results {
        assert!(ok, "kernel script failed:\n{stdout}\n{stderr}");
        assert!(stdout.contains("hello, kernel"), "{stdout}");
        assert!(stdout.contains("not_allowlisted evil.example:80"), "{stdout}");
        assert_eq!(stdout.lines().last(), Some("all good"), "{stdout}\n{stderr}");
    }
}
