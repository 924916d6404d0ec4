//! The kernel clients (`clients/python`, `clients/js`) against the real
//! `egress-proxy` and `egress-executor` binaries: runs each language's own
//! test suite as a child process, pointed at the binaries cargo built for
//! this test run, and fails unless it exits 0 having passed every test.
//! Skipped, loudly, when `python3` or `node` is missing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::process::bin;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Tests each suite has at least (a suite that loses tests fails here).
const PYTHON_TESTS: usize = 12;
const NODE_TESTS: usize = 12;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

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
        .env_remove("EGRESS_CONTROL_TOKEN")
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
    cmd.args(["-m", "unittest", "discover", "-s", "clients/python", "-v"]);
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
    cmd.args(["--test", "--test-reporter=tap", "clients/js/test/"]);
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
