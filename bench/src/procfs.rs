//! What the benchmark reads about a process from `/proc`: CPU time (user +
//! system, all threads, `/proc/<pid>/stat` fields 14 and 15 in clock ticks of
//! 1/100 s), resident memory (`VmRSS` of `/proc/<pid>/status`), open
//! descriptors, and the machine's TCP counters that reveal dropped SYNs.

/// The kernel reports `/proc` CPU times in `USER_HZ` ticks, 100 per second on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// User + system CPU seconds `pid` has used so far, all threads included.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces; fields are counted after its ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// Resident set size of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_field(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// This process's soft limit on open files.
pub fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn status_field(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// Number of open descriptors of `pid`.
pub fn open_fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// The machine-wide count of SYNs retransmitted (each one a client that
/// waited a second or more for a connection) from `/proc/net/netstat`.
pub fn syn_retransmits() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    let i = names.split_whitespace().position(|n| n == "TCPSynRetrans")?;
    values.split_whitespace().nth(i)?.parse().ok()
}
