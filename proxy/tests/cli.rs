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
    // A transparent tool: each entry says whether its connections are
    // checked or relayed raw, and how long first bytes are waited for.
    let transparent = dir.path().join("transparent.toml");
    std::fs::write(
        &transparent,
        "[proxy]\nheader_read_timeout_ms = 2500\n[tools.db]\nnetwork = \"transparent\"\n\
         egress = [\"api.example:443\", { host = \"db.internal\", port = 5432, private = true, protocol = \"tcp\" }]\n\
         [tools.db.process]\ncommand = [\"x\"]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["check", "--config"])
        .arg(&transparent)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for line in [
        "    network transparent: a connection's first bytes are waited for up to 2500 ms",
        "    api.example:443  (transparent: checked (TLS server name or HTTP Host))\n",
        "    db.internal:5432 (private) protocol=tcp  (transparent: relayed raw, nothing checked)\n",
    ] {
        assert!(stdout.contains(line), "{line:?} missing:\n{stdout}");
    }
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

/// `ranges --json` is what fences outside the proxy are built from (the
/// Kubernetes NetworkPolicy's `except` lists are checked against it): every
/// default denied range once, in its family, in the table's order.
#[test]
fn ranges_print_the_default_denied_table_by_family() {
    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .args(["ranges", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = |k: &str| -> Vec<String> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let (v4, v6) = (list("ipv4"), list("ipv6"));
    let all: Vec<&str> = egress_config::ranges::DEFAULT_DENIED.iter().map(|(n, _)| *n).collect();
    assert_eq!(v4.len() + v6.len(), all.len());
    let addr = |n: &String| n.split_once('/').unwrap().0.to_owned();
    assert!(
        v4.iter().all(|n| addr(n).parse::<std::net::Ipv4Addr>().is_ok()),
        "{v4:?}"
    );
    assert!(
        v6.iter().all(|n| addr(n).parse::<std::net::Ipv6Addr>().is_ok()),
        "{v6:?}"
    );
    let joined: Vec<&str> = v4.iter().chain(v6.iter()).map(String::as_str).collect();
    assert_eq!(joined, all);
    assert!(v4.contains(&"169.254.0.0/16".to_owned()) && v6.contains(&"fc00::/7".to_owned()));

    let out = Command::new(env!("CARGO_BIN_EXE_egress-proxy"))
        .arg("ranges")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), all.len());
    assert!(text.contains("link-local (cloud metadata)"), "{text}");
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    // A summary longer than a pipe's buffer, read by `head -1`.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("big.toml");
    let entries: Vec<String> = (0..3000).map(|i| format!("\"h{i}.example:443\"")).collect();
    std::fs::write(&cfg, format!("[tools.a]\negress = [{}]\n", entries.join(","))).unwrap();
    let script = format!(
        "{} check --config {} | head -1 >/dev/null; exit ${{PIPESTATUS[0]}}",
        env!("CARGO_BIN_EXE_egress-proxy"),
        cfg.display()
    );
    let out = Command::new("bash").args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}
