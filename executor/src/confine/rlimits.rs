//! The rlimits of a confined child: no core dumps, a bound on open files,
//! CPU time from `cpu_ms`, and the process count where no cgroup bounds it;
//! a fork server gets the first two only (it lives for many children).

/// `RLIMIT_NOFILE` of a confined child.
pub const MAX_OPEN_FILES: u64 = 1024;

/// What the rlimits layer gives (always available: setrlimit needs nothing).
pub fn support() -> Result<String, String> {
    Ok(format!("core 0, nofile {MAX_OPEN_FILES}, nproc, cpu from cpu_ms"))
}

/// A child's `(resource, soft, hard)` limits: `cpu_ms` rounded up to whole
/// seconds (at least one), and `nproc` when only `RLIMIT_NPROC` is left to
/// bound its processes.
pub fn child(cpu_ms: u64, nproc: Option<u64>) -> Vec<(u32, u64, u64)> {
    let cpu_s = cpu_ms.div_ceil(1000).max(1);
    let mut limits = vec![
        (libc::RLIMIT_CORE, 0, 0),
        (libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
        (libc::RLIMIT_CPU, cpu_s, cpu_s + 1),
    ];
    if let Some(n) = nproc {
        limits.push((libc::RLIMIT_NPROC, n, n));
    }
    limits
}

/// A fork server's: the children's own, but for their CPU time (the server
/// lives for many children) and the uid-wide process count.
pub fn fork_server() -> Vec<(u32, u64, u64)> {
    vec![
        (libc::RLIMIT_CORE, 0, 0),
        (libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
    ]
}
