//! The run's report: the Markdown table (one row per figure, one column per
//! path, then egress-proxy as a ratio to direct and to the best peer), the
//! interception table (HTTPS straight, through a blind tunnel, intercepted;
//! intercepted as a ratio to the blind tunnel), the
//! machine's description, and the optional fsync count (`perf stat` on the
//! fsync tracepoints, when perf is installed).

use serde_json::{json, Value};
use std::time::Duration;

/// One table row: label, result key, whether higher is better.
const ROWS: &[(&str, &str, bool)] = &[
    ("keep-alive GET 1 KiB: requests/s", "keepalive_rps", true),
    ("keep-alive: p50 ms", "keepalive_p50_ms", false),
    ("keep-alive: p99 ms", "keepalive_p99_ms", false),
    ("keep-alive: proxy CPU µs/request", "keepalive_cpu_us", false),
    (
        "keep-alive: proxy instructions/request (callgrind)",
        "keepalive_instructions",
        false,
    ),
    ("CONNECT bulk download: MiB/s (median)", "bulk_mib_per_s", true),
    ("CONNECT bulk: proxy CPU s/GiB", "bulk_cpu_s_per_gib", false),
    ("new tunnels/s (CONNECT, 200, close)", "new_tunnels_per_s", true),
    ("new tunnel: p50 ms", "new_tunnel_p50_ms", false),
    ("new tunnel: proxy CPU µs each", "new_tunnel_cpu_us", false),
    (
        "new tunnel: proxy instructions each (callgrind)",
        "new_tunnel_instructions",
        false,
    ),
    ("RSS per idle tunnel, KiB (first count)", "idle_rss_kib_0", false),
    ("RSS per idle tunnel, KiB (second count)", "idle_rss_kib_1", false),
    ("descriptors per idle tunnel", "idle_fds_0", false),
    ("durable denials/s", "denials_per_s", true),
    ("denial: p50 ms", "denial_p50_ms", false),
    ("denial: p99 ms", "denial_p99_ms", false),
    ("denial: proxy CPU µs each", "denial_cpu_us", false),
    (
        "denial: proxy instructions each (callgrind)",
        "denial_instructions",
        false,
    ),
    ("fact store fsyncs/s during the denial flood", "fsyncs_per_s", false),
];

const PATHS: &[&str] = &["direct", "bare-relay", "egress-proxy", "squid", "tinyproxy"];

/// The interception table's rows (label, result key), each with the ratio
/// intercepted ÷ blind tunnel.
const TLS_ROWS: &[(&str, &str)] = &[
    ("keep-alive HTTPS GET: requests/s", "tls_keepalive_rps"),
    ("keep-alive: p50 ms", "tls_keepalive_p50_ms"),
    ("keep-alive: p99 ms", "tls_keepalive_p99_ms"),
    ("keep-alive: proxy CPU µs/request", "tls_keepalive_cpu_us"),
    (
        "new HTTPS connections/s (CONNECT, handshake, GET, close)",
        "tls_new_conns_per_s",
    ),
    ("new connection: p50 ms", "tls_new_conn_p50_ms"),
    ("new connection: p99 ms", "tls_new_conn_p99_ms"),
    ("new connection: proxy CPU µs each", "tls_new_conn_cpu_us"),
];

/// The warm dispatch table's rows (label, `tool_isolation` of the result keys).
const DISPATCH_ROWS: &[(&str, &str)] = &[
    ("Rust echo, unconfined", "rs_off"),
    ("Rust echo, strict", "rs_strict"),
    ("Python runner, unconfined", "py_off"),
    ("Python runner, strict", "py_strict"),
    ("Node runner, unconfined", "node_off"),
    ("Node runner, strict", "node_strict"),
    (
        "baseline: bare round trip to the proxy's control API",
        "baseline-proxy_-",
    ),
    ("baseline: bare round trip to the executor's API", "baseline-executor_-"),
];

const TLS_PATHS: &[&str] = &["direct-tls", "blind-tunnel", "intercepted"];

/// The scrubbing table's rows (label, result key), each with the ratio
/// scrubbed ÷ plain.
const SCRUB_ROWS: &[(&str, &str)] = &[
    ("keep-alive GET 1 KiB: requests/s", "scrub_keepalive_rps"),
    ("keep-alive: p50 ms", "scrub_keepalive_p50_ms"),
    ("keep-alive: proxy CPU µs/request", "scrub_keepalive_cpu_us"),
    (
        "keep-alive: proxy instructions/request (callgrind)",
        "scrub_keepalive_instructions",
    ),
    ("plain-HTTP download: MiB/s (median)", "scrub_bulk_mib_per_s"),
    ("plain-HTTP download: proxy CPU s/GiB", "scrub_bulk_cpu_s_per_gib"),
];
const PEERS: &[&str] = &["squid", "tinyproxy"];

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The Markdown report of a run document (as written to JSON).
pub fn markdown(doc: &Value) -> String {
    let r = &doc["results"];
    let p = &doc["params"];
    let idle: Vec<u64> = p["idle_tunnels"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let mut out = format!(
        "\n## egress-bench {} ({} build{})\n\n",
        doc["date"].as_str().unwrap_or(""),
        doc["build"].as_str().unwrap_or(""),
        if doc["smoke"].as_bool() == Some(true) {
            ", SMOKE: numbers mean nothing"
        } else {
            ""
        }
    );
    let mut rows = String::new();
    for (label, key, higher) in ROWS {
        let (label, key) = if let Some(i) = key.strip_prefix("idle_rss_kib_") {
            let Some(n) = idle.get(i.parse::<usize>().unwrap_or(0)) else {
                continue;
            };
            (
                format!("RSS per idle tunnel, KiB ({n} tunnels)"),
                format!("idle_rss_kib_{n}"),
            )
        } else if key.starts_with("idle_fds_") {
            let Some(n) = idle.first() else { continue };
            (
                format!("descriptors per idle tunnel ({n} tunnels)"),
                format!("idle_fds_{n}"),
            )
        } else {
            (label.to_string(), key.to_string())
        };
        let get = |path: &str| r[path][&key].as_f64();
        if PATHS.iter().all(|p| get(p).is_none()) {
            continue;
        }
        let mut row = format!("| {label} |");
        for path in PATHS {
            row += &format!(" {} |", get(path).map(fmt).unwrap_or_else(|| "—".into()));
        }
        let ours = get("egress-proxy");
        let ratio = |other: Option<f64>| match (ours, other) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "—".into(),
        };
        let best =
            PEERS
                .iter()
                .filter_map(|p| get(p).map(|v| (*p, v)))
                .reduce(|a, b| if (b.1 > a.1) == *higher { b } else { a });
        row += &format!(" {} |", ratio(get("direct")));
        row += &format!(" {} |", ratio(get("bare-relay")));
        row += &match best {
            Some((name, v)) => format!(" {} ({name}) |", ratio(Some(v))),
            None => " — |".into(),
        };
        rows += &row;
        rows += "\n";
    }
    // The plain table, unless none of its figures ran (`--only intercept`).
    if !rows.is_empty() {
        out += &format!(
            "{} keep-alive connections; {} tunnels in flight; bulk {} MiB x {}; idle tunnels {:?}; {} denial clients; {} s windows after {} s warm-up. Machine: {}.\n\n",
            p["keepalive_conns"], p["tunnels_in_flight"], p["bulk_bytes"].as_u64().unwrap_or(0) >> 20, p["bulk_reps"],
            idle, p["denial_clients"], p["window_s"], p["warm_s"], doc["machine"]["summary"].as_str().unwrap_or("")
        );
        out += "| figure | direct | bare relay | egress-proxy | squid | tinyproxy | egress ÷ direct | egress ÷ bare relay | egress ÷ best peer |\n";
        out += "|---|---|---|---|---|---|---|---|---|\n";
        out += &rows;
    }
    out += &intercept_table(doc);
    out += &leafs_table(doc);
    out += &scrub_table(doc);
    out += &budget_table(doc);
    out += &dispatch_table(doc);
    out += &sustained_table(doc);
    out += "\nRates: higher is better; latency, CPU and RSS: lower is better. CPU is the proxy process's user+system time over the window divided by the operations in it.\n";
    if let Some(s) = doc["skipped"].as_array().filter(|s| !s.is_empty()) {
        out += "\nSkipped:\n";
        for x in s {
            out += &format!("- {}\n", x.as_str().unwrap_or(""));
        }
    }
    for (k, v) in doc["versions"].as_object().into_iter().flatten() {
        out += &format!("\n{k}: {}", v.as_str().unwrap_or(""));
    }
    out + "\n"
}

/// The interception table (HTTPS to the TLS origin straight, through a blind
/// tunnel, intercepted), or nothing when that figure did not run.
fn intercept_table(doc: &Value) -> String {
    let (r, p) = (&doc["results"], &doc["params"]);
    let mut rows = String::new();
    for (label, key) in TLS_ROWS {
        let get = |path: &str| r[path][*key].as_f64();
        if TLS_PATHS.iter().all(|p| get(p).is_none()) {
            continue;
        }
        rows += &format!("| {label} |");
        for path in TLS_PATHS {
            rows += &format!(" {} |", get(path).map(fmt).unwrap_or_else(|| "—".into()));
        }
        rows += &match (get("intercepted"), get("blind-tunnel")) {
            (Some(a), Some(b)) if b > 0.0 => format!(" {:.2}× |\n", a / b),
            _ => " — |\n".into(),
        };
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\n### Interception cost (HTTPS to the Rust TLS origin)\n\n{} keep-alive TLS connections; {} new TLS connections in flight, each a full handshake; {} s windows after {} s warm-up. Machine: {}.\n\n| figure | direct-tls | blind-tunnel | intercepted | intercepted ÷ blind-tunnel |\n|---|---|---|---|---|\n{rows}",
        p["tls_keepalive_conns"],
        p["tls_new_conns_in_flight"],
        p["window_s"],
        p["warm_s"],
        doc["machine"]["summary"].as_str().unwrap_or("")
    )
}

/// The scrubbing table (one egress-proxy, a tool without credentials and
/// one whose credential host is the origin), or nothing when that figure
/// did not run.
fn scrub_table(doc: &Value) -> String {
    let (r, p) = (&doc["results"], &doc["params"]);
    let mut rows = String::new();
    for (label, key) in SCRUB_ROWS {
        let get = |path: &str| r[path][*key].as_f64();
        let (plain, scrubbed) = (get("plain"), get("scrubbed"));
        if plain.is_none() && scrubbed.is_none() {
            continue;
        }
        let cell = |v: Option<f64>| v.map(fmt).unwrap_or_else(|| "—".into());
        rows += &format!("| {label} | {} | {} |", cell(plain), cell(scrubbed));
        rows += &match (scrubbed, plain) {
            (Some(a), Some(b)) if b > 0.0 => format!(" {:.2}× |\n", a / b),
            _ => " — |\n".into(),
        };
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\n### Scrubbing cost (plain HTTP, a credential host's responses scanned for its secret)\n\n{} keep-alive connections; download {} MiB x {} of printable text; {} s windows after {} s warm-up.\n\n| figure | plain (no credential) | scrubbed | scrubbed ÷ plain |\n|---|---|---|---|\n{rows}",
        p["keepalive_conns"],
        p["bulk_bytes"].as_u64().unwrap_or(0) >> 20,
        p["bulk_reps"],
        p["window_s"],
        p["warm_s"]
    )
}

/// The byte budget table (`budget.rs`, part of the bulk figure): one
/// egress-proxy, a run without a budget and one with a budget never
/// reached; or nothing when it did not run.
fn budget_table(doc: &Value) -> String {
    let (r, p) = (&doc["results"], &doc["params"]);
    let mut rows = String::new();
    for (label, key) in [
        ("CONNECT bulk download: MiB/s (median)", "budget_tunnel_mib_per_s"),
        ("CONNECT bulk: proxy CPU s/GiB", "budget_tunnel_cpu_s_per_gib"),
        (
            "CONNECT bulk: proxy instructions/MiB (callgrind)",
            "budget_tunnel_instructions_per_mib",
        ),
        ("plain-HTTP download: MiB/s (median)", "budget_http_mib_per_s"),
        ("plain-HTTP download: proxy CPU s/GiB", "budget_http_cpu_s_per_gib"),
        (
            "plain-HTTP download: proxy instructions/MiB (callgrind)",
            "budget_http_instructions_per_mib",
        ),
    ] {
        let (none, with) = (r["no-budget"][key].as_f64(), r["budget"][key].as_f64());
        if none.is_none() && with.is_none() {
            continue;
        }
        let cell = |v: Option<f64>| v.map(fmt).unwrap_or_else(|| "—".into());
        rows += &format!("| {label} | {} | {} |", cell(none), cell(with));
        rows += &match (with, none) {
            (Some(a), Some(b)) if b > 0.0 => format!(" {:.3}× |\n", a / b),
            _ => " — |\n".into(),
        };
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\n### Byte budget cost (one egress-proxy: a run without `max_bytes_per_run`, one with a budget it never reaches)\n\nbulk {} MiB x {}, the two runs' downloads interleaved.\n\n| figure | no budget | budget | budget ÷ no budget |\n|---|---|---|---|\n{rows}",
        p["bulk_bytes"].as_u64().unwrap_or(0) >> 20,
        p["bulk_reps"]
    )
}

/// The cached-leaf figure (`leafs.rs`), or nothing when it did not run.
fn leafs_table(doc: &Value) -> String {
    let r = &doc["results"]["egress-proxy"];
    let rows = [
        (
            "proxy RSS growth per name, intercepted, KiB",
            "leaf_intercepted_name_rss_kib",
        ),
        (
            "proxy RSS growth per name, blind tunnels (DNS answers), KiB",
            "leaf_blind_name_rss_kib",
        ),
        ("per cached leaf (the difference), KiB", "leaf_rss_kib"),
        ("intercepted new names/s, one at a time", "leaf_handshakes_per_s"),
        (
            "intercepted new name: proxy instructions each (callgrind)",
            "leaf_instructions",
        ),
    ];
    let mut out = String::new();
    for (label, key) in rows {
        if let Some(v) = r[key].as_f64() {
            out += &format!("| {label} | {} |\n", fmt(v));
        }
    }
    if out.is_empty() {
        return out;
    }
    format!(
        "\n### Cached leaf certificates (an `inspect` tool, one `*.` rule)\n\n{} names, one HTTPS request each (CONNECT, handshake, GET, close), on two fresh egress-proxies: one intercepting (a new leaf per name), one through blind tunnels.\n\n| figure | egress-proxy |\n|---|---|\n{out}",
        doc["params"]["leaf_names"],
    )
}

/// The warm dispatch table, or nothing when that figure did not run.
fn dispatch_table(doc: &Value) -> String {
    let r = &doc["results"]["executor"];
    let mut rows = String::new();
    for (label, key) in DISPATCH_ROWS {
        let (Some(p50), Some(p99)) = (
            r[format!("dispatch_{key}_p50_ms")].as_f64(),
            r[format!("dispatch_{key}_p99_ms")].as_f64(),
        ) else {
            continue;
        };
        rows += &format!("| {label} | {} | {} |\n", fmt(p50), fmt(p99));
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\n### Warm dispatch through the executor's API\n\n{} sequential invocations per row, each answered by a warm child; facts in SQLite.\n\n| figure | p50 ms | p99 ms |\n|---|---|---|\n{rows}",
        doc["params"]["dispatches"]
    )
}

/// The sustained invocation rate table, or nothing when that figure did
/// not run.
fn sustained_table(doc: &Value) -> String {
    let r = &doc["results"]["executor"];
    let mut rows = String::new();
    for (label, tool) in [
        ("Rust echo", "rs"),
        ("Python runner", "py"),
        ("Python runner, fork server", "pyf"),
    ] {
        for clients in [1, 8, 32] {
            let key = |field: &str| r[format!("sustained_{tool}_{clients}_clients_{field}")].as_f64();
            let Some(rate) = key("per_s") else { continue };
            let cell = |field: &str| key(field).map_or("—".to_owned(), fmt);
            rows += &format!(
                "| {label} | {clients} | {} | {} | {} | {} % | {} |\n",
                fmt(rate),
                cell("p50_ms"),
                cell("p99_ms"),
                cell("pool_empty_pct"),
                cell("refill_cold_start_ms"),
            );
        }
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\n### Sustained invocations through the executor's API\n\nStrict; pools of `warm = 2, max = 8`; each client invokes back to back for {} s.\n\n| tool | clients | invocations/s | p50 ms | p99 ms | pool empty | refill cold start ms |\n|---|---|---|---|---|---|---|\n{rows}",
        doc["params"]["sustained_s"]
    )
}

/// CPUs, kernel and load average when the run started.
pub fn machine() -> Value {
    let cpus = std::fs::read_to_string("/proc/cpuinfo")
        .map(|s| s.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load1 = load.split_whitespace().next().unwrap_or("?").to_owned();
    // `bench/run.sh` runs this in a network namespace of its own when it can
    // (no conntrack table, no host firewall rules on loopback): one whose
    // only interface is `lo`.
    let devs = std::fs::read_to_string("/proc/net/dev").unwrap_or_default();
    let mut ifaces = devs.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim);
    let network = if ifaces.all(|i| i == "lo") {
        "network namespace of its own (lo only)"
    } else {
        "host's network namespace"
    };
    json!({
        "cpus": cpus,
        "kernel": kernel.trim(),
        "loadavg_1m_at_start": load1,
        "network": network,
        "summary": format!("{cpus} CPUs, Linux {}, load {load1} at start, {network}", kernel.trim()),
    })
}

/// Counts `fsync`/`fdatasync` calls of `pid` for `dur` with `perf stat`, in
/// the background; per second, or `None` without perf or tracepoint access.
pub fn count_fsyncs(pid: u32, dur: Duration) -> Option<std::thread::JoinHandle<Option<f64>>> {
    let perf = crate::peers::find_program("perf")?;
    Some(std::thread::spawn(move || {
        let out = std::process::Command::new(perf)
            .args([
                "stat",
                "-x",
                ",",
                "-e",
                "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync",
                "-p",
            ])
            .arg(pid.to_string())
            .arg("--")
            .arg("sleep")
            .arg(format!("{:.3}", dur.as_secs_f64()))
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stderr);
        let mut total = 0.0;
        let mut seen = false;
        for l in text.lines() {
            let mut f = l.split(',');
            if let (Some(n), Some(_), Some(ev)) = (f.next(), f.next(), f.next()) {
                if ev.starts_with("syscalls:sys_enter_f") {
                    total += n.parse::<f64>().ok()?;
                    seen = true;
                }
            }
        }
        seen.then(|| total / dur.as_secs_f64())
    }))
}

/// Now, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
