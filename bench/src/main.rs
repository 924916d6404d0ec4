//! Side-by-side benchmark: a direct connection, egress-proxy, squid and
//! tinyproxy under the same loads in one run, on loopback only (`127.0.0.0/8`),
//! with a fake DNS server for egress-proxy. Prints a Markdown table of every
//! figure with ratios to direct and to the best peer, and writes the same as
//! JSON. The `dispatch` figure runs the executor's warm-dispatch benchmark
//! (`dispatch.rs`), the `sustained` figure the same program's sustained
//! invocation rate. The `intercept` figure measures the cost of interception instead:
//! HTTPS straight, through a blind tunnel and intercepted (`intercept.rs`); the
//! `leafs` figure, what each leaf certificate an `inspect` tool makes the
//! proxy cache costs in memory (`leafs.rs`); the `scrub` figure, the cost of
//! scrubbing credential hosts' responses (`scrub.rs`); the `bulk` figure
//! also measures what a byte budget costs (`budget.rs`). `bench/run.sh`
//! installs the peers, builds and runs this; see
//! `docs/performance.md` for what each figure means.
//!
//! Usage: `egress-bench [--smoke] [--out FILE] [--pids FILE] [--only FIGURES] [--paths PATHS] [--perf DIR] [--callgrind DIR]`
//! (`FIGURES`: comma-separated among keepalive, tunnels, bulk, idle, denials,
//! intercept, leafs, scrub, dispatch, sustained;
//! `PATHS`: among direct, egress-proxy, squid, tinyproxy; `--perf DIR`:
//! `perf record` egress-proxy during each of its windows; `--callgrind DIR`:
//! run egress-proxy under callgrind and report its user-space instructions
//! per operation, see `callgrind.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark program: fail loudly

mod budget;
mod callgrind;
mod dispatch;
mod intercept;
mod leafs;
mod load;
mod peers;
mod procfs;
mod report;
mod scrub;

use load::{Binder, Path, ProxyTarget, Timing};
use peers::{find_program, Daemon, Launcher};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = egress_e2e::harness::TOKEN;

/// Sizes of one run; `--smoke` shrinks everything.
struct Params {
    timing: Timing,
    conns: usize,
    in_flight: usize,
    bulk_bytes: u64,
    bulk_reps: usize,
    idle: Vec<usize>,
    denial_clients: usize,
    /// Interception cost: keep-alive TLS connections, new TLS connections in flight.
    tls_conns: usize,
    tls_in_flight: usize,
    /// Warm dispatch: invocations per tool and isolation.
    dispatches: usize,
    /// Sustained invocation rate: the window of each row.
    sustained: Duration,
    /// Cached leaves: names an `inspect` tool handshakes for.
    leaf_names: usize,
}

impl Params {
    fn full() -> Params {
        Params {
            timing: Timing {
                warm: Duration::from_secs(1),
                secs: Duration::from_secs(8),
            },
            conns: 50,
            in_flight: 50,
            bulk_bytes: 100 << 20,
            bulk_reps: 5,
            idle: vec![1000, 10_000],
            denial_clients: 32,
            tls_conns: 50,
            tls_in_flight: 50,
            dispatches: 200,
            sustained: Duration::from_secs(20),
            leaf_names: 1000,
        }
    }

    fn smoke() -> Params {
        Params {
            timing: Timing {
                warm: Duration::from_millis(200),
                secs: Duration::from_millis(800),
            },
            conns: 8,
            in_flight: 8,
            bulk_bytes: 4 << 20,
            bulk_reps: 1,
            idle: vec![50, 100],
            denial_clients: 4,
            tls_conns: 4,
            tls_in_flight: 4,
            dispatches: 5,
            sustained: Duration::from_secs(1),
            leaf_names: 20,
        }
    }
}

/// The figures of the plain-HTTP origin and peers (`intercept` has its own).
/// The bare CONNECT relay written for the benchmark (`src/bin/bare-relay.rs`):
/// the floor of the tunnel figures.
const BARE_RELAY: &str = "bare-relay";

const PLAIN: &[&str] = &["keepalive", "tunnels", "bulk", "idle", "denials"];

/// What every figure needs.
struct Bench {
    a: Args,
    p: Params,
    launcher: Launcher,
    dns: egress_e2e::FakeDns,
    proxy_bin: std::path::PathBuf,
    b: Arc<Binder>,
    /// The idle tunnel counts, cut to the open-files limit.
    idle: Vec<usize>,
}

struct Args {
    smoke: bool,
    out: Option<String>,
    pids: Option<String>,
    only: Option<Vec<String>>,
    paths: Option<Vec<String>>,
    perf: Option<std::path::PathBuf>,
    callgrind: Option<std::path::PathBuf>,
}

impl Args {
    fn wants(&self, figure: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.iter().any(|f| f == figure))
    }
}

fn args() -> Args {
    let mut a = Args {
        smoke: false,
        out: None,
        pids: None,
        only: None,
        paths: None,
        perf: None,
        callgrind: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--smoke" => a.smoke = true,
            "--out" => a.out = it.next(),
            "--pids" => a.pids = it.next(),
            "--only" => a.only = it.next().map(|s| s.split(',').map(str::to_owned).collect()),
            "--perf" => a.perf = it.next().map(Into::into),
            "--callgrind" => a.callgrind = it.next().map(Into::into),
            "--paths" => a.paths = it.next().map(|s| s.split(',').map(str::to_owned).collect()),
            other => {
                eprintln!("usage: egress-bench [--smoke] [--out FILE] [--pids FILE] [--only FIGURES] [--paths PATHS] [--perf DIR] [--callgrind DIR] (unknown {other:?})");
                std::process::exit(2);
            }
        }
    }
    a
}

/// Records a figure; the table reads these keys (see `report::ROWS`).
fn put(results: &mut Map<String, Value>, path: &str, key: &str, v: Option<f64>) {
    if let Some(v) = v.filter(|v| v.is_finite()) {
        let m = results.entry(path).or_insert_with(|| json!({}));
        m[key] = json!((v * 1000.0).round() / 1000.0);
    }
}

/// Records one measured window of `path`: the rate under `rate`, the
/// errors (reconnects or failures) under `errors`, and the rest under
/// `{prefix}_p50_ms`, `_p99_ms`, `_cpu_us`, `_requests`, `_syn_retransmits`.
fn put_window(results: &mut Map<String, Value>, path: &str, rate: &str, prefix: &str, errors: &str, w: &load::Window) {
    let measured = w.ops > 0;
    put(results, path, rate, Some(w.rate));
    put(results, path, &format!("{prefix}_p50_ms"), measured.then_some(w.p50_ms));
    put(results, path, &format!("{prefix}_p99_ms"), measured.then_some(w.p99_ms));
    put(results, path, &format!("{prefix}_cpu_us"), w.cpu_us_per_op);
    put(results, path, &format!("{prefix}_instructions"), w.instructions_per_op);
    put(results, path, errors, Some(w.errors as f64));
    put(results, path, &format!("{prefix}_requests"), Some(w.ops as f64));
    let syn = w.syn_retransmits.map(|n| n as f64);
    put(results, path, &format!("{prefix}_syn_retransmits"), syn);
}

/// One measured window on the terminal: `unit` of the rate, `each` of the
/// CPU time, `errors` naming what the error count counts.
fn print_window(name: &str, unit: &str, each: &str, errors: &str, w: &load::Window) {
    eprintln!(
        "  {name:<13} {:>9.0} {unit}  p50 {:.2} ms  p99 {:.2} ms  cpu {:?} µs {each}  {errors} {}  SYN retransmits {:?}",
        w.rate,
        w.p50_ms,
        w.p99_ms,
        w.cpu_us_per_op.map(|c| c.round()),
        w.errors,
        w.syn_retransmits
    );
    if let Some(i) = w.instructions_per_op {
        eprintln!("  {name:<13} {i:>9.0} instructions {each} (callgrind, user space)");
    }
}

fn skip(skipped: &mut Vec<String>, what: String) {
    eprintln!("\n*** SKIPPED: {what} ***\n");
    skipped.push(what);
}

/// With `--perf DIR`: `perf record` (DWARF call graphs) of egress-proxy for
/// `dur`, into `DIR/<figure>.data`; other paths are not recorded (the
/// interception figure records its egress-proxy per path, see
/// [`perf_record_pid`]).
fn perf_record(
    dir: &Option<std::path::PathBuf>,
    figure: &str,
    path: &Path,
    dur: Duration,
) -> Option<std::process::Child> {
    if path.name != "egress-proxy" {
        return None;
    }
    perf_record_pid(dir, figure, path.pid?, dur)
}

/// `perf record` of process `pid` for `dur` into `DIR/<file>.data`, with `--perf DIR`.
fn perf_record_pid(
    dir: &Option<std::path::PathBuf>,
    file: &str,
    pid: u32,
    dur: Duration,
) -> Option<std::process::Child> {
    let dir = dir.as_ref()?;
    std::fs::create_dir_all(dir).ok()?;
    let r = std::process::Command::new(find_program("perf")?)
        .args(["record", "-q", "-F", "499", "--call-graph", "dwarf,16384", "-p"])
        .arg(pid.to_string())
        .arg("-o")
        .arg(dir.join(format!("{file}.data")))
        .args(["--", "sleep"])
        .arg(format!("{:.3}", dur.as_secs_f64()))
        .stdout(std::process::Stdio::null())
        .spawn();
    r.map_err(|e| eprintln!("perf record: {e}")).ok()
}

fn perf_wait(perf: Option<std::process::Child>) {
    if let Some(mut c) = perf {
        let _ = c.wait();
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    if let Some(dir) = &a.callgrind {
        callgrind::enable(dir.clone());
    }
    let p = if a.smoke { Params::smoke() } else { Params::full() };
    let dir = tempfile::Builder::new().prefix("egress-bench").tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let launcher = Launcher {
        dir: dir.path().to_owned(),
        pids: a.pids.clone().map(Into::into),
    };
    let mut skipped = vec![];
    let mut versions = Map::new();

    // An idle tunnel holds 2 descriptors in each proxy (its two sockets;
    // egress-proxy makes its splice pipes on the first byte to move), and
    // 2 in this process when the Rust origin runs here (the client's socket
    // and the origin's). The limit applies to every process started here;
    // 200 are left for everything else a process holds.
    let limit = procfs::open_files_limit().unwrap_or(1024);
    let fit = (limit.saturating_sub(200) / 2 / 100 * 100) as usize;
    let mut idle = p.idle.clone();
    if a.wants("idle") && idle.iter().any(|n| *n > fit) {
        skip(&mut skipped, format!(
            "idle tunnels above {fit}: at 2 descriptors per tunnel they need more than the open-files limit {limit} (raising it needs CAP_SYS_RESOURCE); measured at {fit} instead"
        ));
        idle = idle.into_iter().map(|n| n.min(fit)).filter(|n| *n > 0).collect();
        idle.dedup();
    }

    let dns = egress_e2e::FakeDns::start().await;
    let exe = std::env::current_exe().unwrap();
    let proxy_bin = exe.parent().unwrap().join("egress-proxy");
    versions.insert("egress-proxy".into(), json!(peers::version(&proxy_bin, "--version")));
    let bench = Bench {
        a,
        p,
        launcher,
        dns,
        proxy_bin,
        b: Arc::new(Binder::new()),
        idle,
    };
    let mut results = Map::new();
    if PLAIN.iter().any(|f| bench.a.wants(f)) {
        plain_figures(&bench, &mut results, &mut skipped, &mut versions).await;
    }
    if bench.a.wants("intercept") {
        intercept_figure(&bench, &mut results, &mut skipped).await;
    }
    if bench.a.wants("leafs") {
        leafs_figure(&bench, &mut results, &mut skipped).await;
    }
    if bench.a.wants("scrub") {
        scrub_figure(&bench, &mut results, &mut skipped).await;
    }
    if bench.a.wants("dispatch") {
        dispatch_figure(&bench, &exe, dir.path(), &mut results, &mut skipped);
    }
    if bench.a.wants("sustained") {
        sustained_figure(&bench, &exe, dir.path(), &mut results, &mut skipped);
    }
    let Bench { a, p, idle, .. } = bench;
    let t = &p.timing;

    let doc = json!({
        "date": report::utc_now(),
        "smoke": a.smoke,
        "build": if exe.components().any(|c| c.as_os_str() == "release") { "release" } else { "debug" },
        "machine": report::machine(),
        "versions": versions,
        "params": {
            "warm_s": t.warm.as_secs_f64(), "window_s": t.secs.as_secs_f64(),
            "keepalive_conns": p.conns, "tunnels_in_flight": p.in_flight,
            "bulk_bytes": p.bulk_bytes, "bulk_reps": p.bulk_reps,
            "idle_tunnels": idle, "denial_clients": p.denial_clients,
            "tls_keepalive_conns": p.tls_conns, "tls_new_conns_in_flight": p.tls_in_flight,
            "dispatches": p.dispatches, "sustained_s": p.sustained.as_secs_f64(), "leaf_names": p.leaf_names,
        },
        "skipped": skipped,
        "results": results,
    });
    println!("{}", report::markdown(&doc));
    let out = a.out.unwrap_or_else(|| match a.smoke {
        true => "target/bench-smoke.json".into(),
        false => format!(
            "bench/results/{}.json",
            doc["date"].as_str().unwrap_or("run").replace(':', "")
        ),
    });
    if let Some(parent) = std::path::Path::new(&out).parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
    eprintln!("JSON written to {out}");
}

/// The plain-HTTP figures (keep-alive, tunnels, bulk, idle, denials): starts
/// the origin, egress-proxy and the installed peers, measures, stops them.
async fn plain_figures(
    bench: &Bench,
    results: &mut Map<String, Value>,
    skipped: &mut Vec<String>,
    versions: &mut Map<String, Value>,
) {
    let Bench {
        a,
        p,
        launcher,
        dns,
        proxy_bin,
        b,
        idle,
    } = bench;
    // The origin.
    let origin = match find_program("nginx") {
        Some(prog) => peers::nginx(launcher, &prog, p.bulk_bytes).unwrap(),
        None => {
            skip(
                skipped,
                "nginx not installed: the origin is the Rust test origin".into(),
            );
            peers::rust_origin(p.bulk_bytes).unwrap()
        }
    };
    versions.insert("origin".into(), json!(origin.kind));
    let origin_pid = origin._daemon.as_ref().map(Daemon::pid);
    dns.set("origin.test", &["127.0.0.2"]);

    // egress-proxy, then the peers that are installed.
    let egress = peers::egress_proxy(launcher, proxy_bin, dns.addr, origin.addr.port(), TOKEN).unwrap();
    let (run_id, secret) = egress_e2e::harness::create_run_at(egress.control, "bench").await;
    let auth = egress_e2e::harness::basic(&run_id, &secret);

    let mut paths = vec![
        Path {
            name: "direct".into(),
            addr: origin.addr,
            proxy: None,
            pid: None,
        },
        Path {
            name: "egress-proxy".into(),
            addr: egress.addr,
            proxy: Some(ProxyTarget {
                authority: format!("origin.test:{}", origin.addr.port()),
                auth: Some(auth),
            }),
            pid: Some(egress.daemon.pid()),
        },
    ];
    let mut daemons = vec![];
    type Starter = fn(&Launcher, &std::path::Path, SocketAddr) -> std::io::Result<(Daemon, SocketAddr)>;
    let peers: [(&str, &str, Starter); 3] = [
        ("squid", "-v", peers::squid),
        ("tinyproxy", "-v", peers::tinyproxy),
        (BARE_RELAY, "", peers::bare_relay),
    ];
    for (name, varg, start) in peers {
        let found = if name == BARE_RELAY {
            Some(proxy_bin.with_file_name(BARE_RELAY)).filter(|p| p.exists())
        } else {
            find_program(name)
        };
        let Some(prog) = found else {
            skip(skipped, format!("{name} not installed"));
            continue;
        };
        match start(launcher, &prog, origin.addr) {
            Ok((d, addr)) => {
                if name != BARE_RELAY {
                    versions.insert(name.into(), json!(peers::version(&prog, varg)));
                }
                paths.push(Path {
                    name: name.into(),
                    addr,
                    proxy: Some(ProxyTarget {
                        authority: origin.addr.to_string(),
                        auth: None,
                    }),
                    pid: Some(d.pid()),
                });
                daemons.push(d);
            }
            Err(e) => skip(skipped, format!("{name} did not start: {e}")),
        }
    }

    let egress_path = paths[1].clone();
    if let Some(only) = &a.paths {
        paths.retain(|p| only.contains(&p.name));
    }
    let t = &p.timing;

    let window = t.warm + t.secs;
    // Idle tunnels first, on processes that have served nothing yet: the
    // heap the other figures grow and free would be reused by the tunnels
    // and hide what each one costs (in one full run, 0.7 KiB per tunnel
    // measured after the other figures against 3-6 KiB on a fresh proxy).
    if !idle.is_empty() && a.wants("idle") {
        eprintln!("idle tunnels {idle:?}");
        for path in paths.iter().filter(|p| p.pid.is_some()) {
            match load::idle_tunnels(b, path, idle, p.in_flight).await {
                Ok(v) => {
                    for (n, kib, fds) in v {
                        eprintln!(
                            "  {:<13} {n:>6} tunnels: {kib:.1} KiB, {fds:.2} descriptors each",
                            path.name
                        );
                        put(results, &path.name, &format!("idle_rss_kib_{n}"), Some(kib));
                        put(results, &path.name, &format!("idle_fds_{n}"), Some(fds));
                    }
                }
                Err(e) => skip(skipped, format!("idle tunnels via {}: {e}", path.name)),
            }
        }
    }

    if a.wants("keepalive") {
        eprintln!("keep-alive small requests, {} connections", p.conns);
        // Tunnels only: the bare relay speaks CONNECT alone.
        for path in paths.iter().filter(|p| p.name != BARE_RELAY) {
            let req = path.get(&format!("origin.test:{}", origin.addr.port()), &origin.small);
            let perf = perf_record(&a.perf, "keepalive", path, window);
            let w = load::keepalive(b, path, req, p.conns, t).await;
            perf_wait(perf);
            print_window(&path.name, "req/s", "per request", "reconnects", &w);
            put_window(
                results,
                &path.name,
                "keepalive_rps",
                "keepalive",
                "keepalive_reconnects",
                &w,
            );
        }
        if let Some(pid) = origin_pid {
            eprintln!("  (origin nginx pid {pid}: cpu per request not attributed to any path)");
        }
    }

    if a.wants("tunnels") {
        eprintln!("new tunnels (CONNECT, 200, close), {} in flight", p.in_flight);
        // No direct row: a client that connects and closes at once outruns
        // the origin's accept loop, fills its backlog and measures only that.
        for path in paths.iter().filter(|p| p.proxy.is_some()) {
            let perf = perf_record(&a.perf, "tunnels", path, window);
            let w = load::new_tunnels(b, path, p.in_flight, t).await;
            perf_wait(perf);
            print_window(&path.name, "/s", "each", "failed", &w);
            put_window(
                results,
                &path.name,
                "new_tunnels_per_s",
                "new_tunnel",
                "new_tunnel_failures",
                &w,
            );
        }
    }

    if a.wants("bulk") {
        eprintln!("bulk through a tunnel, {} MiB x {}", p.bulk_bytes >> 20, p.bulk_reps);
        for path in &paths {
            let req = format!("GET {} HTTP/1.1\r\nHost: origin.test\r\n\r\n", origin.bulk);
            match load::bulk(b, path, req.as_bytes(), p.bulk_bytes, p.bulk_reps).await {
                Ok((mibps, cpu)) => {
                    eprintln!(
                        "  {:<13} {:>7.0} MiB/s  cpu {:?} s/GiB",
                        path.name,
                        mibps,
                        cpu.map(|c| (c * 1000.0).round() / 1000.0)
                    );
                    put(results, &path.name, "bulk_mib_per_s", Some(mibps));
                    put(results, &path.name, "bulk_cpu_s_per_gib", cpu);
                }
                Err(e) => skip(skipped, format!("bulk via {}: {e}", path.name)),
            }
        }
        budget_cost(bench, &egress_path, &egress, &origin, results, skipped).await;
    }

    if a.wants("denials") {
        eprintln!("durable denials, {} clients", p.denial_clients);
        let mut auths = vec![];
        for _ in 0..p.denial_clients {
            let (id, secret) = egress_e2e::harness::create_run_at(egress.control, "web").await;
            auths.push(egress_e2e::harness::basic(&id, &secret));
        }
        let fsyncs = report::count_fsyncs(egress.daemon.pid(), window);
        let perf = perf_record(&a.perf, "denials", &egress_path, window);
        let w = load::denials(b, &egress_path, auths, t).await;
        perf_wait(perf);
        let fsyncs = fsyncs.and_then(|h| h.join().ok().flatten());
        eprintln!(
            "  egress-proxy  {:>9.0} denials/s  p50 {:.2} ms  p99 {:.2} ms  cpu {:?} µs each  fsync/s {:?}",
            w.rate,
            w.p50_ms,
            w.p99_ms,
            w.cpu_us_per_op.map(|c| c.round()),
            fsyncs
        );
        put_window(
            results,
            "egress-proxy",
            "denials_per_s",
            "denial",
            "denial_failures",
            &w,
        );
        put(results, "egress-proxy", "fsyncs_per_s", fsyncs);
    }

    let m = egress_e2e::harness::control_call(egress.control, "GET", "/metrics", None, None)
        .await
        .text();
    put(
        results,
        "egress-proxy",
        "upstream_reused",
        Some(egress_e2e::harness::sample(&m, "egress_upstream_reused_total")),
    );

    drop(daemons);
    drop(egress);
    drop(origin);
}

/// What a byte budget costs on bulk (`budget.rs`): egress-proxy's bulk
/// downloads, through a tunnel and in plain HTTP, for a run without a
/// budget and one with a budget it never reaches, interleaved.
async fn budget_cost(
    bench: &Bench,
    plain: &Path,
    egress: &peers::Egress,
    origin: &peers::Origin,
    results: &mut Map<String, Value>,
    skipped: &mut Vec<String>,
) {
    let (b, p) = (&bench.b, &bench.p);
    let (run_id, secret) = egress_e2e::harness::create_run_at(egress.control, "budgeted").await;
    let authority = format!("origin.test:{}", origin.addr.port());
    let budgeted = Path {
        name: "budget".into(),
        proxy: Some(ProxyTarget {
            authority: authority.clone(),
            auth: Some(egress_e2e::harness::basic(&run_id, &secret)),
        }),
        ..plain.clone()
    };
    eprintln!(
        "byte budget cost: bulk {} MiB x {}, without and with a budget, interleaved",
        p.bulk_bytes >> 20,
        p.bulk_reps
    );
    match budget::cost(b, plain, &budgeted, &authority, &origin.bulk, p.bulk_bytes, p.bulk_reps).await {
        Ok([tunnel, http]) => {
            for (way, figures) in [("tunnel", tunnel), ("http", http)] {
                for (name, f) in ["no-budget", "budget"].iter().zip(figures) {
                    eprintln!(
                        "  {way:<6} {name:<9} {:>7.0} MiB/s  cpu {:?} s/GiB  {:?} instructions/MiB",
                        f.mib_per_s, f.cpu_s_per_gib, f.instructions_per_mib
                    );
                    put(results, name, &format!("budget_{way}_mib_per_s"), Some(f.mib_per_s));
                    put(results, name, &format!("budget_{way}_cpu_s_per_gib"), f.cpu_s_per_gib);
                    put(
                        results,
                        name,
                        &format!("budget_{way}_instructions_per_mib"),
                        f.instructions_per_mib,
                    );
                }
            }
        }
        Err(e) => skip(skipped, format!("byte budget cost: {e}")),
    }
}

/// The cost of scrubbing (`scrub.rs`): keep-alive and bulk through one
/// egress-proxy as a tool without credentials and as one whose credential
/// host is the origin.
async fn scrub_figure(bench: &Bench, results: &mut Map<String, Value>, skipped: &mut Vec<String>) {
    let Bench {
        p,
        launcher,
        dns,
        proxy_bin,
        b,
        ..
    } = bench;
    let origin = match find_program("nginx") {
        Some(prog) => {
            let o = peers::nginx(launcher, &prog, p.bulk_bytes).unwrap();
            scrub::text_bulk(launcher, p.bulk_bytes).unwrap();
            o
        }
        None => peers::rust_origin(p.bulk_bytes).unwrap(),
    };
    dns.set("origin.test", &["127.0.0.2"]);
    let port = origin.addr.port();
    let egress = scrub::egress_proxy(launcher, proxy_bin, dns.addr, port, TOKEN).unwrap();
    let paths = scrub::paths(&egress, port).await;
    eprintln!("scrubbing cost: keep-alive GET 1 KiB, {} connections", p.conns);
    for path in &paths {
        let w = scrub::keepalive(b, path, &origin, p.conns, &p.timing).await;
        print_window(&path.name, "req/s", "per request", "reconnects", &w);
        put_window(
            results,
            &path.name,
            "scrub_keepalive_rps",
            "scrub_keepalive",
            "scrub_keepalive_reconnects",
            &w,
        );
    }
    eprintln!(
        "scrubbing cost: plain-HTTP download, {} MiB x {}",
        p.bulk_bytes >> 20,
        p.bulk_reps
    );
    for path in &paths {
        match scrub::bulk(b, path, &origin, p.bulk_bytes, p.bulk_reps).await {
            Ok((mibps, cpu)) => {
                eprintln!("  {:<13} {mibps:>7.0} MiB/s  cpu {cpu:?} s/GiB", path.name);
                put(results, &path.name, "scrub_bulk_mib_per_s", Some(mibps));
                put(results, &path.name, "scrub_bulk_cpu_s_per_gib", cpu);
            }
            Err(e) => skip(skipped, format!("scrubbing cost, bulk via {}: {e}", path.name)),
        }
    }
    let m = egress_e2e::harness::control_call(egress.control, "GET", "/metrics", None, None)
        .await
        .text();
    let scrubs = egress_e2e::harness::sample(
        &m,
        "egress_credential_scrubs_total{tool=\"scrubbed\",credential=\"api\"}",
    );
    put(results, "scrubbed", "scrub_count", Some(scrubs));
    drop(egress);
    drop(origin);
}

/// The executor's warm dispatch (`dispatch.rs`), with the binaries beside
/// `exe` and its work files in `work`.
fn dispatch_figure(
    bench: &Bench,
    exe: &std::path::Path,
    work: &std::path::Path,
    results: &mut Map<String, Value>,
    skipped: &mut Vec<String>,
) {
    let n = bench.p.dispatches;
    eprintln!("warm dispatch through the executor's API, {n} invocations per row");
    let rows = match dispatch::run(exe.parent().unwrap(), n, None, work) {
        Ok(rows) => rows,
        Err(e) => return skip(skipped, format!("warm dispatch: {e}")),
    };
    for r in rows {
        let key = format!(
            "dispatch_{}_{}",
            r["tool"].as_str().unwrap_or("?"),
            r["isolation"].as_str().unwrap_or("?")
        );
        let (p50, p99) = (r["p50_ms"].as_f64(), r["p99_ms"].as_f64());
        eprintln!(
            "  {key:<28} p50 {:.2} ms  p99 {:.2} ms",
            p50.unwrap_or(0.0),
            p99.unwrap_or(0.0)
        );
        put(results, "executor", &format!("{key}_p50_ms"), p50);
        put(results, "executor", &format!("{key}_p99_ms"), p99);
    }
}

/// A sustained invocation rate through the executor's API (`dispatch.rs`
/// with a window): strict, Rust and Python tools, 1, 8 and 32 clients.
fn sustained_figure(
    bench: &Bench,
    exe: &std::path::Path,
    work: &std::path::Path,
    results: &mut Map<String, Value>,
    skipped: &mut Vec<String>,
) {
    let window = bench.p.sustained;
    eprintln!(
        "sustained invocations through the executor's API, strict, {:.0} s per row",
        window.as_secs_f64()
    );
    let rows = match dispatch::run(exe.parent().unwrap(), 0, Some(window), work) {
        Ok(rows) => rows,
        Err(e) => return skip(skipped, format!("sustained invocations: {e}")),
    };
    for r in rows {
        let key = format!(
            "sustained_{}_{}_clients",
            r["tool"].as_str().unwrap_or("?"),
            r["clients"].as_u64().unwrap_or(0)
        );
        let f = |k: &str| r[k].as_f64();
        eprintln!(
            "  {key:<30} {:.1}/s  p50 {:.2} ms  p99 {:.2} ms  pool empty {:.0} %  refill cold start {:.1} ms",
            f("per_s").unwrap_or(0.0),
            f("p50_ms").unwrap_or(0.0),
            f("p99_ms").unwrap_or(0.0),
            f("pool_empty_pct").unwrap_or(0.0),
            f("refill_cold_start_ms").unwrap_or(0.0),
        );
        for field in ["per_s", "p50_ms", "p99_ms", "pool_empty_pct", "refill_cold_start_ms"] {
            put(results, "executor", &format!("{key}_{field}"), f(field));
        }
    }
}

/// The interception cost: the Rust TLS origin, a second egress-proxy that
/// intercepts for tool `injected` and tunnels blind for tool `blind`, and
/// the three client paths under keep-alive and new-connection loads.
async fn intercept_figure(bench: &Bench, results: &mut Map<String, Value>, skipped: &mut Vec<String>) {
    let Bench {
        a,
        p,
        launcher,
        dns,
        proxy_bin,
        b,
        ..
    } = bench;
    let t = &p.timing;
    let window = t.warm + t.secs;
    let origin = intercept::start_origin(&[intercept::HOST]).unwrap();
    dns.set(intercept::HOST, &["127.0.0.2"]);
    let egress = intercept::egress_proxy(launcher, proxy_bin, dns.addr, &origin, TOKEN).unwrap();
    let paths = intercept::paths(&origin, &egress, TOKEN).await.unwrap();
    let req = intercept::request(&origin);
    if let Err(e) = intercept::check(b, &origin, &paths, &req).await {
        skip(skipped, format!("interception cost: {e}\n{}", egress.daemon.log_tail()));
        return;
    }

    eprintln!("interception cost: keep-alive HTTPS GET, {} connections", p.tls_conns);
    for (name, path) in &paths {
        let perf = path
            .tcp
            .pid
            .and_then(|pid| perf_record_pid(&a.perf, &format!("intercept-keepalive-{name}"), pid, window));
        let w = intercept::keepalive(b, path, &req, p.tls_conns, t).await;
        perf_wait(perf);
        print_window(name, "req/s", "per request", "errors", &w);
        put_window(
            results,
            name,
            "tls_keepalive_rps",
            "tls_keepalive",
            "tls_keepalive_errors",
            &w,
        );
    }

    eprintln!(
        "interception cost: new HTTPS connections (CONNECT, handshake, GET, close), {} in flight",
        p.tls_in_flight
    );
    for (name, path) in &paths {
        let perf = path
            .tcp
            .pid
            .and_then(|pid| perf_record_pid(&a.perf, &format!("intercept-new-{name}"), pid, window));
        let w = intercept::new_conns(b, path, &req, p.tls_in_flight, t).await;
        perf_wait(perf);
        print_window(name, "/s", "each", "failed", &w);
        put_window(
            results,
            name,
            "tls_new_conns_per_s",
            "tls_new_conn",
            "tls_new_conn_failures",
            &w,
        );
    }
    drop(egress);
}

/// The memory per cached leaf (`leafs.rs`): one request to each of
/// `leaf_names` names of an `inspect` tool's `*.` rule, on a fresh
/// egress-proxy, less the same through blind tunnels on another.
async fn leafs_figure(bench: &Bench, results: &mut Map<String, Value>, skipped: &mut Vec<String>) {
    let n = bench.p.leaf_names;
    eprintln!("cached leaves: intercepted HTTPS requests to {n} names of an inspect tool's *. rule");
    match leafs::run(&bench.launcher, &bench.proxy_bin, &bench.dns, &bench.b, n, TOKEN).await {
        Ok(l) => {
            let leaf = l.kib_per_intercepted_name - l.kib_per_blind_name;
            eprintln!(
                "  egress-proxy  {:.2} KiB RSS per cached leaf: {:.2} KiB per name intercepted, {:.2} through blind tunnels ({} names, {:.0} intercepted handshakes/s one at a time)",
                leaf, l.kib_per_intercepted_name, l.kib_per_blind_name, l.names, l.handshakes_per_s
            );
            let r = [
                ("leaf_rss_kib", leaf),
                ("leaf_intercepted_name_rss_kib", l.kib_per_intercepted_name),
                ("leaf_blind_name_rss_kib", l.kib_per_blind_name),
                ("leaf_handshakes_per_s", l.handshakes_per_s),
            ];
            for (key, v) in r {
                put(results, "egress-proxy", key, Some(v));
            }
            if let Some(i) = l.instructions {
                eprintln!("  egress-proxy  {i:>9.0} instructions per intercepted new name (callgrind, user space)");
            }
            put(results, "egress-proxy", "leaf_instructions", l.instructions);
        }
        Err(e) => skip(skipped, format!("cached leaves: {e}")),
    }
}
