//! Runs a test body inside a network namespace that holds only `lo`, so a
//! policy bug can never put a packet on the real network. The test re-executes
//! its own binary under `unshare -rn` (filtered to that one test) with a
//! marker variable set; inside, it brings `lo` up and runs the body.

use std::process::Command;

const MARKER: &str = "EGRESS_E2E_IN_NETNS";

/// Returns true when the caller is already inside the isolated namespace and
/// should run the test body. Otherwise runs the named test in a fresh
/// namespace, asserts that it passed, and returns false.
pub fn isolated(test_name: &str) -> bool {
    if std::env::var_os(MARKER).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("current test binary");
    let out = Command::new("unshare")
        .args(["-rn", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(exe)
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(MARKER, "1")
        .output()
        .expect("unshare (util-linux) and ip (iproute2) are needed for namespace-isolated tests");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "isolated run of {test_name} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "isolated run of {test_name} ran no test:\n{stdout}\n{stderr}"
    );
    false
}
