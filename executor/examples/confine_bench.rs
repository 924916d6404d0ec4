//! Confinement benchmark (not a test; needs root): cold start (spawn→ready)
//! of a trivial Rust tool and the Python runner with no confinement, each
//! layer alone, and strict; warm dispatch round trip under strict and off;
//! a 100 MiB download through the run's proxy with the handed-off listener,
//! the relay fallback, and no confinement. A real proxy runs in-process on
//! loopback. Run through `executor/bench/confine.sh`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_e2e::executor::{invocation, python_runner, shared};
use egress_e2e::harness::TestProxy;
use egress_e2e::origin::http_origin;
use egress_executor::confine::{plan::Confinement, Layer};
use egress_executor::pool::child::{Shared, ToolSpec, Warm};
use egress_executor::{Config, Executor};
use serde_json::json;

const TOKEN: &str = egress_e2e::harness::TOKEN;

fn median_p99(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if v.is_empty() {
        return (0.0, 0.0);
    }
    (
        ms(v[v.len() / 2]),
        ms(v[((v.len() as f64 - 1.0) * 0.99).round() as usize]),
    )
}

async fn cold_starts(sh: &Arc<Shared>, cfg: &Config, tool: &str, c: Confinement, n: usize) -> Vec<Duration> {
    let process = cfg.tools[tool].clone().unwrap_or_else(|| panic!("no {tool}"));
    let spec = Arc::new(ToolSpec::new(tool, process, c));
    let mut v = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let w = Warm::start(sh, &spec, None).await.unwrap_or_else(|e| panic!("{e}"));
        v.push(t0.elapsed());
        w.discard(egress_executor::kill::KillReason::Done).await;
    }
    v
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let echo = PathBuf::from(
        args.next()
            .unwrap_or_else(|| panic!("usage: confine_bench RUST_ECHO [N]")),
    );
    let echo = std::fs::canonicalize(&echo).unwrap_or_else(|e| panic!("{}: {e}", echo.display()));
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(50);
    let runner = python_runner();
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dir = std::env::temp_dir().join(format!("loom-confine-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("var")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(dir.join("noop.py"), "def run(input):\n    return input\n").unwrap_or_else(|e| panic!("{e}"));
    let handoff = dir.join("var/handoff.sock");
    let tools =
        format!("[tools.rs]\negress = []\n[tools.py]\negress = []\n[tools.pyf]\negress = []\n[tools.dl]\negress = [\"127.0.0.2:{port}\"]\n");
    let dns = egress_e2e::FakeDns::start().await;
    let proxy_text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\nfacts = \":memory:\"\nhandoff = \"{}\"\nallow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n{tools}",
        handoff.display(),
        dns.addr
    );
    let proxy = TestProxy::start_config(dns, &proxy_text, None, None).await;
    let url = format!("http://127.0.0.2:{port}/bytes?n={}", 100 << 20);
    let config = |extra_exec: &str, isolation: &str| {
        format!(
            "[proxy]\ncontrol = \"{control}\"\nfacts = \"{facts}\"\n[executor]\nscratch_dir = \"{scratch}\"\n{extra_exec}\n{tools}\n\
             [tools.rs.process]\ncommand = [\"{echo}\"]\nisolation = \"{isolation}\"\npool = {{ warm = 2, max = 4 }}\n\
             [tools.py.process]\ncommand = [\"python3\", \"{runner}\", \"{noop}\"]\nisolation = \"{isolation}\"\npool = {{ warm = 0, max = 4 }}\n\
             [tools.pyf.process]\ncommand = [\"python3\", \"{runner}\", \"{noop}\"]\nisolation = \"{isolation}\"\nfork_server = true\npool = {{ warm = 0, max = 4 }}\n\
             [tools.dl.process]\ncommand = [\"sh\", \"-c\", \"read go; exec curl -sS -o /dev/null -w %{{size_download}} '{url}'\"]\n\
             protocol = \"plain\"\nisolation = \"{isolation}\"\nmemory_mb = 1024\npool = {{ warm = 0, max = 1 }}\n",
            control = proxy.control,
            facts = dir.join("var/f.db").display(),
            scratch = dir.join("scratch").display(),
            echo = echo.display(),
            runner = runner.display(),
            noop = dir.join("noop.py").display(),
        )
    };
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("{e}"));
        Config::load(&p).unwrap_or_else(|e| panic!("{e}"))
    };
    let strict_relay = write("relay.toml", config("allow_relay = true", "strict"));
    let strict_handoff = write(
        "handoff.toml",
        config(&format!("proxy_handoff = \"{}\"", handoff.display()), "strict"),
    );
    let off = write("off.toml", config("", "off"));

    println!(
        "# {} on {} cores, kernel {}, user {}",
        std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%dT%H:%MZ"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        if rustix::process::geteuid().is_root() {
            "root"
        } else {
            "not root"
        },
    );

    // Cold start by layer.
    let host = egress_executor::confine::host(&strict_handoff.executor);
    let sh = shared(&strict_handoff);
    println!("\n| cold start (spawn→ready) | Rust p50 | Rust p99 | Python p50 | Python p99 |\n|---|---|---|---|---|");
    let mut variants: Vec<(String, Confinement)> = vec![("off".into(), Confinement::off())];
    let strict_plan = |tool: &str| {
        let p = strict_handoff.tools[tool]
            .clone()
            .unwrap_or_else(|| panic!("no {tool}"));
        Confinement::for_tool(tool, &p, &strict_handoff.executor, &host).unwrap_or_else(|e| panic!("{e}"))
    };
    for layer in Layer::ALL {
        variants.push((format!("{} alone", layer.name()), strict_plan("rs").only(&[layer])));
    }
    variants.push(("strict (all layers), hand-off".into(), strict_plan("rs")));
    let mut medians = Vec::new();
    for (name, c) in variants {
        let (r50, r99) = median_p99(cold_starts(&sh, &strict_handoff, "rs", c.clone(), n).await);
        let (p50, p99) = median_p99(cold_starts(&sh, &strict_handoff, "py", c, (n / 2).max(10)).await);
        println!("| {name} | {r50:.2} ms | {r99:.2} ms | {p50:.2} ms | {p99:.2} ms |");
        medians.push((name, r50, p50));
    }
    let sh_relay = shared(&strict_relay);
    let p = strict_relay.tools["rs"].clone().unwrap_or_else(|| panic!("no rs"));
    let relay_plan = Confinement::for_tool("rs", &p, &strict_relay.executor, &host).unwrap_or_else(|e| panic!("{e}"));
    let (r50, r99) = median_p99(cold_starts(&sh_relay, &strict_relay, "rs", relay_plan.clone(), n).await);
    let (p50, p99) = median_p99(cold_starts(&sh_relay, &strict_relay, "py", relay_plan, (n / 2).max(10)).await);
    println!("| strict (all layers), relay | {r50:.2} ms | {r99:.2} ms | {p50:.2} ms | {p99:.2} ms |");
    // The Python tool's children forked by its fork server (booted by the
    // first sample's start).
    let (f50, f99) = median_p99(cold_starts(&sh, &strict_handoff, "pyf", strict_plan("pyf"), (n / 2).max(10)).await);
    println!("| strict (all layers), hand-off, Python fork server | | | {f50:.2} ms | {f99:.2} ms |");
    if let (Some(o), Some(s)) = (medians.first(), medians.last()) {
        println!(
            "\nstrict adds {:.2} ms (Rust) and {:.2} ms (Python) to the median cold start.",
            s.1 - o.1,
            s.2 - o.2
        );
    }

    // Warm dispatch round trip.
    println!("\n| warm dispatch round trip, Rust echo | p50 | p99 |\n|---|---|---|");
    for (name, cfg) in [("off", &off), ("strict, hand-off", &strict_handoff)] {
        let exec = Executor::new(cfg.clone(), Some(TOKEN.into())).unwrap_or_else(|e| panic!("{e}"));
        exec.warm_up();
        let pool = exec.pool("rs").unwrap_or_else(|| panic!("no pool")).clone();
        let mut v = Vec::new();
        for i in 0..n {
            let t = Instant::now();
            while pool.counts().0 < 2 && t.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let t0 = Instant::now();
            let r = exec.invoke(invocation("rs", json!(i))).await;
            v.push(t0.elapsed());
            assert!(r.ok, "{r:?}");
        }
        let (a, b) = median_p99(v);
        println!("| {name} | {a:.2} ms | {b:.2} ms |");
        exec.shutdown();
        exec.drain(Duration::from_secs(5)).await;
    }

    // 100 MiB through the proxy (curl, plain protocol), 5 runs each.
    println!("\n| 100 MiB download through the run's proxy (curl) | median MiB/s | best MiB/s |\n|---|---|---|");
    for (name, cfg) in [
        ("no confinement", &off),
        ("strict, relay fallback", &strict_relay),
        ("strict, handed-off listener", &strict_handoff),
    ] {
        let exec = Executor::new(cfg.clone(), Some(TOKEN.into())).unwrap_or_else(|e| panic!("{e}"));
        let mut rates = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            // Plain tools run from spawn; the input line (sent once the run is
            // active) is the go signal.
            let r = exec.invoke(invocation("dl", json!(1))).await;
            let secs = t0.elapsed().as_secs_f64();
            assert!(r.ok, "{r:?}");
            let got = r.output.as_ref().and_then(|o| o["stdout"].as_str()).unwrap_or("");
            assert_eq!(got, (100u64 << 20).to_string(), "{r:?}");
            rates.push(100.0 / secs);
        }
        rates.sort_by(|a, b| a.total_cmp(b));
        println!(
            "| {name} | {:.0} | {:.0} |",
            rates[rates.len() / 2],
            rates[rates.len() - 1]
        );
        exec.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
