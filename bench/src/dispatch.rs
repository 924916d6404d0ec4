//! The executor's warm dispatch (figure `dispatch`): runs the executor's
//! dispatch benchmark (`executor/examples/dispatch_bench.rs`, built beside
//! this program) on the release proxy and executor binaries: N sequential
//! `POST /v1/invocations`, each answered by a warm child, for a trivial Rust
//! tool, the Python runner and the Node runner, unconfined and strict, plus
//! a bare round trip to each server after the same idle gap. Facts go to
//! SQLite, as by default. With a sustained window (figure `sustained`), the
//! same program measures a sustained invocation rate instead: strict, a
//! Rust and a Python tool, 1, 8 and 32 clients invoking back to back. It
//! needs root (PID namespaces, strict confinement) and its binaries; without
//! them it is skipped, loudly.

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The benchmark's rows (`tool`, `isolation`, `p50_ms`, `p99_ms`; with
/// `sustained`, `tool`, `clients`, `per_s`, `p50_ms`, `p99_ms`,
/// `pool_empty_pct`, `refill_cold_start_ms`), or why it could not run.
pub fn run(bin_dir: &Path, n: usize, sustained: Option<Duration>, work: &Path) -> Result<Vec<Value>, String> {
    if !crate::peers::is_root() {
        return Err("warm dispatch needs root (PID namespaces, strict confinement)".into());
    }
    let needed = [
        bin_dir.join("examples/dispatch_bench"),
        bin_dir.join("egress-proxy"),
        bin_dir.join("egress-executor"),
        bin_dir.join("examples/rust_echo"),
    ];
    if let Some(missing) = needed.iter().find(|p| !p.is_file()) {
        return Err(format!("{} is not built (bench/run.sh builds it)", missing.display()));
    }
    let json = work.join("dispatch.json");
    let mut cmd = Command::new(&needed[0]);
    cmd.args(&needed[1..]).arg(n.to_string()).arg("--json").arg(&json);
    if let Some(window) = sustained {
        cmd.arg("--sustained").arg(window.as_secs_f64().to_string());
    }
    let out = cmd.output().map_err(|e| format!("{}: {e}", needed[0].display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(format!("the dispatch benchmark failed: {}", tail.join(" / ")));
    }
    let doc: Value = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or("the dispatch benchmark wrote no results")?;
    Ok(doc["rows"].as_array().cloned().unwrap_or_default())
}
