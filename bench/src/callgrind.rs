//! With `--callgrind DIR`: egress-proxy runs under `valgrind
//! --tool=callgrind`, and every timed window reads how many instructions the
//! proxy executed in user space (its own code and the libraries it links;
//! not the kernel) per operation. Counts are exact and repeat within a
//! fraction of a percent whatever else the machine is doing, so a change's
//! effect on the proxy's own work shows where CPU time per operation, which
//! moves ±15 % with the machine's load, cannot. Rates under callgrind are
//! 30–50× lower and mean nothing.
//!
//! The counters are zeroed when a window starts (`callgrind_control -z`) and
//! dumped when it ends (`callgrind_control -d`, into `DIR/<name>.<pid>.<n>`);
//! the dump's `totals:` line is the window's instruction count.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Turns callgrind mode on for this run, dumps going to `dir`.
pub fn enable(dir: PathBuf) {
    let _ = std::fs::create_dir_all(&dir);
    let _ = DIR.set(dir);
}

/// The program and arguments that start `program` under callgrind as
/// `name`, or `program` alone when callgrind mode is off.
pub fn wrap(name: &str, program: &Path) -> Command {
    match DIR.get() {
        Some(dir) => {
            let mut c = Command::new("valgrind");
            c.arg("--tool=callgrind")
                .arg(format!("--callgrind-out-file={}/{name}.%p", dir.display()))
                .arg(program);
            c
        }
        None => Command::new(program),
    }
}

fn control(flag: &str, pid: u32) -> bool {
    Command::new("callgrind_control")
        .arg(flag)
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Zeroes `pid`'s counters if it runs under callgrind; whether it does.
pub fn start(pid: Option<u32>) -> bool {
    DIR.get().is_some() && pid.is_some_and(|p| control("-z", p))
}

/// Dumps `pid`'s counters and returns the instructions since [`start`].
pub fn instructions(pid: u32) -> Option<u64> {
    let dir = DIR.get()?;
    if !control("-d", pid) {
        return None;
    }
    // The newest dump of this pid: `<name>.<pid>.<n>`, largest n.
    let suffix = format!(".{pid}.");
    let newest = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: u32 = name.rsplit_once(&suffix).map(|(_, n)| n)?.parse().ok()?;
            Some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)?
        .1;
    let text = std::fs::read_to_string(newest).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("totals:").or_else(|| l.strip_prefix("summary:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}
