//! Executor benchmark (not a test): cold start of a trivial Python and Rust
//! tool, warm dispatch round trip of an echo tool, and throughput of
//! sequential and 8-way concurrent invocations with pool refill. Uses the
//! test support's in-process stand-in for the proxy's control API
//! (`FakeControl`, on 127.0.0.1:0) so the numbers are the executor's own. Tools run unconfined (`isolation = "off"`):
//! confinement costs are measured by `confine_bench`. Run through
//! `executor/bench/run.sh`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_e2e::executor::{executor, invocation, python_runner, shared, write_config, TempDir};
use egress_e2e::fake_control::FakeControl;
use egress_executor::confine::plan::Confinement;
use egress_executor::pool::child::{ToolSpec, Warm};
use egress_executor::{Config, Executor, InvocationRequest};
use serde_json::json;

fn stats(name: &str, mut v: Vec<Duration>) -> String {
    v.sort();
    let pick = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v[i.min(v.len() - 1)].as_secs_f64() * 1000.0
    };
    let line = format!(
        "| {name} | {} | {:.2} | {:.2} | {:.2} |",
        v.len(),
        pick(0.5),
        pick(0.99),
        v.last().map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
    );
    println!("{line}");
    line
}

async fn wait_ready(exec: &Executor, tool: &str, n: usize) {
    let pool = exec.pool(tool).unwrap_or_else(|| panic!("no pool"));
    while pool.counts().0 < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn req(tool: &str, i: u64) -> InvocationRequest {
    invocation(tool, json!({"i": i}))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rust_tool = PathBuf::from(
        args.get(1)
            .cloned()
            .unwrap_or_else(|| panic!("usage: bench RUST_ECHO_BIN [N]")),
    );
    // The tool runs in the config's directory: a relative path (run.sh's
    // `target/release/...`) must not be resolved there.
    let rust_tool = std::fs::canonicalize(&rust_tool).unwrap_or_else(|e| panic!("{}: {e}", rust_tool.display()));
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    let runner = python_runner();
    const ECHO_PY: &str = "def run(input, ctx):\n    return input\n";
    let dir = TempDir::new("bench");
    dir.write("echo.py", ECHO_PY);
    let control = FakeControl::start().await;
    let tools = format!(
        r#"
[tools.py.process]
command = ["python3", "{runner}", "echo.py"]
pool = {{ warm = 2, max = 8 }}
isolation = "off"
[tools.rs.process]
command = ["{rust}"]
pool = {{ warm = 2, max = 8 }}
isolation = "off"
[tools.py8.process]
command = ["python3", "{runner}", "echo.py"]
pool = {{ warm = 8, max = 8 }}
isolation = "off"
[tools.rs8.process]
command = ["{rust}"]
pool = {{ warm = 8, max = 8 }}
isolation = "off"
"#,
        runner = runner.display(),
        rust = rust_tool.display()
    );
    let cfg_path = write_config(&dir, control.addr, true, &tools);
    let cfg = Config::load(&cfg_path).unwrap_or_else(|e| panic!("{e}"));
    let exec = executor(&cfg_path);
    let mut out = Vec::new();
    out.push("| measurement | n | median ms | p99 ms | max ms |".to_string());
    out.push("|---|---|---|---|---|".to_string());

    // Cold start spawn→ready, one child at a time, no pool involved.
    let shared = shared(&cfg);
    for (name, tool, count) in [
        ("cold start, Python tool (spawn→ready)", "py", n / 4),
        ("cold start, Rust tool (spawn→ready)", "rs", n),
    ] {
        let Some(Some(p)) = cfg.tools.get(tool).cloned() else {
            panic!("no tool")
        };
        let spec = Arc::new(ToolSpec::new(tool, p, Confinement::off()));
        let mut v = Vec::new();
        for _ in 0..count.max(10) {
            let t0 = Instant::now();
            let w = Warm::start(&shared, &spec, None)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            v.push(t0.elapsed());
            w.discard(egress_executor::kill::KillReason::Done).await;
        }
        out.push(stats(name, v));
    }

    exec.warm_up();
    // Warm dispatch round trip: a ready child is waiting each time.
    for (name, tool) in [
        ("warm invocation round trip, Python echo", "py"),
        ("warm invocation round trip, Rust echo", "rs"),
    ] {
        let mut v = Vec::new();
        for i in 0..n as u64 {
            wait_ready(&exec, tool, 2).await;
            let t0 = Instant::now();
            let r = exec.invoke(req(tool, i)).await;
            v.push(t0.elapsed());
            assert!(r.ok, "{r:?}");
        }
        out.push(stats(name, v));
    }
    // Throughput: back to back, the pool refilling behind.
    let mut tput = Vec::new();
    for (label, tool, conc) in [
        ("sequential, Python echo (warm 2, max 8)", "py", 1usize),
        ("sequential, Rust echo (warm 2, max 8)", "rs", 1),
        ("8-way concurrent, Python echo (warm 8, max 8)", "py8", 8),
        ("8-way concurrent, Rust echo (warm 8, max 8)", "rs8", 8),
    ] {
        wait_ready(&exec, tool, if conc == 1 { 2 } else { 8 }).await;
        let t0 = Instant::now();
        let mut handles = Vec::new();
        let per = n / conc;
        for w in 0..conc {
            let exec = exec.clone();
            let tool = tool.to_string();
            handles.push(tokio::spawn(async move {
                let mut v = Vec::new();
                for i in 0..per as u64 {
                    let t = Instant::now();
                    let r = exec.invoke(req(&tool, w as u64 * 1000 + i)).await;
                    assert!(r.ok, "{r:?}");
                    v.push(t.elapsed());
                }
                v
            }));
        }
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.unwrap_or_default());
        }
        let secs = t0.elapsed().as_secs_f64();
        let total = all.len();
        out.push(stats(&format!("latency in: {label}"), all));
        let line = format!(
            "| {label} | {total} invocations | {:.1} invocations/s |",
            total as f64 / secs
        );
        println!("{line}");
        tput.push(line);
    }
    // The same Rust echo without PID namespaces (process-group mode).
    let pg_dir = TempDir::new("bench-pg");
    pg_dir.write("echo.py", ECHO_PY);
    let pg = executor(&write_config(&pg_dir, control.addr, false, &tools));
    pg.warm_up();
    let mut v = Vec::new();
    for i in 0..n as u64 {
        wait_ready(&pg, "rs", 2).await;
        let t0 = Instant::now();
        let r = pg.invoke(req("rs", i)).await;
        v.push(t0.elapsed());
        assert!(r.ok, "{r:?}");
    }
    out.push(stats("warm invocation round trip, Rust echo, process-group mode", v));
    wait_ready(&pg, "rs8", 8).await;
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for w in 0..8u64 {
        let pg = pg.clone();
        handles.push(tokio::spawn(async move {
            for i in 0..(n / 8) as u64 {
                let r = pg.invoke(req("rs8", w * 1000 + i)).await;
                assert!(r.ok, "{r:?}");
            }
        }));
    }
    for h in handles {
        let _ = h.await;
    }
    let line = format!(
        "| 8-way concurrent, Rust echo, process-group mode | {} invocations | {:.1} invocations/s |",
        n / 8 * 8,
        (n / 8 * 8) as f64 / t0.elapsed().as_secs_f64()
    );
    println!("{line}");
    tput.push(line);
    pg.shutdown();

    println!(
        "\n{}\n\n| throughput | count | rate |\n|---|---|---|\n{}",
        out.join("\n"),
        tput.join("\n")
    );
    exec.shutdown();
}
