//! The `egress-proxy` command line: `check` prints a summary or every error
//! with its key path and exits 1 on error. (Being an integration test of this
//! package also makes `cargo test --workspace` build the binary that the
//! end-to-end tests run.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn check_prints_a_summary_or_every_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[tools.weather]\negress = [\"api.weather.example:443\", \"*.tiles.example:443\"]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("tool weather") && stdout.contains("*.tiles.example:443") && stdout.contains("sha256:"),
        "{stdout}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[proxy]\nlisten = \"nope\"\nbogus = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.toml") && stderr.contains("bogus"), "{stderr}");
    let bad2 = dir.path().join("bad2.toml");
    std::fs::write(
        &bad2,
        "[proxy]\nlisten = \"nope\"\n[tools.a]\negress = [\"*:1\", \"x\"]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["check", "--config"])
        .arg(&bad2)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr.lines().count(), 3, "one line per problem: {stderr}");
    assert!(
        stderr.contains("proxy.listen") && stderr.contains("tools.a.egress[0]") && stderr.contains("tools.a.egress[1]")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["check", "--config", "/nonexistent/x.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}
