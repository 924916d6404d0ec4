//! The audit sinks with the real binary: a proxy with a file store, the
//! whole decision log and `[audit.sinks.*]` records denials (distinct
//! targets, so none is folded) and allowed fetches, and every fact and
//! decision record must reach each sink once, as an OCSF event:
//!
//! - `otlp`: a receiver decoding OTLP/HTTP protobuf with the reference
//!   `opentelemetry-proto` package (`tests/audit/otlp_receiver.py`, pinned
//!   in `tests/audit/requirements.txt`); also across a receiver killed
//!   mid-flood and brought back, and a proxy killed with SIGKILL mid-export
//!   and restarted (duplicates allowed, with the same `metadata.uid`); a
//!   receiver that never answers does not hold denials back;
//! - `syslog`: Debian's `rsyslogd`, started by the test in the foreground
//!   with its own config (imtcp on loopback, omfile), plain TCP and TLS
//!   (gtls) when `rsyslog-gnutls` is installed;
//! - `file`: rotated by size and count, every file 0600.
//!
//! Loopback only: origins on 127.0.0.2, fake DNS, receivers on 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{all_facts_at, basic, control_call, create_run_at, sample, TOKEN};
use egress_e2e::origin::http_origin;
use egress_e2e::process::{bin, free_addr, free_port, python_has, KillOnDrop, ProxyProcess};
use egress_e2e::raw::{read_response, send};
use egress_e2e::FakeDns;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A proxy's config and addresses, its store beside the config.
struct Setup {
    dir: tempfile::TempDir,
    cfg: PathBuf,
    proxy: SocketAddr,
    control: SocketAddr,
    port: u16,
    _dns: FakeDns,
    _origin: egress_e2e::origin::HttpOrigin,
}

impl Setup {
    async fn new(audit: &str) -> Setup {
        let origin = http_origin("127.0.0.2:0").await;
        let port = origin.addr.port();
        let dns = FakeDns::start().await;
        dns.set("api.test", &["127.0.0.2"]);
        let dir = tempfile::tempdir().unwrap();
        let (proxy, control) = (free_addr(), free_addr());
        let cfg = dir.path().join("egress.toml");
        let audit = audit.replace("{dir}", &dir.path().display().to_string());
        std::fs::write(
            &cfg,
            format!(
                "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\ndecisions = \"all\"\n\
                 allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\ntimeout_ms = 2000\n\
                 [tools.web]\negress = [\"api.test:{port}\"]\nmax_concurrent_fetches = 64\n\
                 [cell]\nid = \"cell-a\"\n{audit}\n",
                dns.addr
            ),
        )
        .unwrap();
        Setup {
            dir,
            cfg,
            proxy,
            control,
            port,
            _dns: dns,
            _origin: origin,
        }
    }

    fn start(&self, env: &[(&str, &str)]) -> ProxyProcess {
        ProxyProcess::start_with_env(
            &bin("egress-proxy"),
            &self.cfg,
            (self.proxy, self.control),
            TOKEN,
            &[],
            env,
        )
    }

    async fn auth(&self) -> String {
        let (id, secret) = create_run_at(self.control, "web").await;
        basic(&id, &secret)
    }

    async fn activity(&self, auth: &str, n: usize, tag: &'static str) {
        activity(self.proxy, self.port, auth, n, tag).await;
    }

    /// Every record the store holds once the decision log's writer (off
    /// the answer path) has written what it was offered: two reads 300 ms
    /// apart agree.
    async fn records(&self) -> BTreeMap<(String, u64), String> {
        let mut last = self.read_records().await;
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = self.read_records().await;
            if now == last {
                return now;
            }
            last = now;
        }
    }

    /// Every record the store holds: (log, seq) → the fact's id, or "" for a
    /// decision record (its uid is derived).
    async fn read_records(&self) -> BTreeMap<(String, u64), String> {
        let mut out = BTreeMap::new();
        for f in all_facts_at(self.control).await {
            out.insert(
                ("facts".to_owned(), f["seq"].as_u64().unwrap()),
                f["id"].as_str().unwrap().to_owned(),
            );
        }
        let mut after = 0;
        loop {
            let path = format!("/v1/decisions?after={after}&limit=1000");
            let r = control_call(self.control, "GET", &path, None, Some(TOKEN)).await;
            assert_eq!(r.status, 200, "{}", r.text());
            let v: Value = serde_json::from_slice(&r.body).unwrap();
            let page = v["decisions"].as_array().unwrap().clone();
            if page.is_empty() {
                return out;
            }
            for d in page {
                out.insert(("decisions".to_owned(), d["seq"].as_u64().unwrap()), String::new());
            }
            after = v["next"].as_u64().unwrap();
        }
    }

    async fn metrics(&self) -> String {
        let r = control_call(self.control, "GET", "/metrics", None, Some(TOKEN)).await;
        r.text()
    }
}

/// `n` denials of distinct targets (tagged `tag`) on one keep-alive
/// connection to `proxy`, and an allowed fetch of the origin on `port` (a
/// decision record) every 10th; returns when each was answered.
async fn activity(proxy: SocketAddr, port: u16, auth: impl AsRef<str>, n: usize, tag: &'static str) {
    let auth = auth.as_ref();
    let mut s = TcpStream::connect(proxy).await.unwrap();
    for i in 0..n {
        let host = format!("{tag}-{i}.denied.test");
        let req = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s, false))
            .await
            .expect("a denial answered within 10 s")
            .unwrap();
        assert_eq!(r.status, 403, "{}", r.text());
        if i % 10 == 0 {
            let req = format!(
                "GET http://api.test:{port}/ HTTP/1.1\r\nHost: api.test:{port}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n"
            );
            assert_eq!(send(proxy, req.as_bytes()).await.status, 200);
        }
    }
}

/// What a receiver got: (log, seq, uid) per record delivered, in order.
type Got = Vec<(String, u64, String)>;

/// Checks that `got` holds every record of `want` and nothing else, each
/// with its fact's id as uid, every duplicate with the same uid; returns
/// how many were duplicates.
fn every_record(want: &BTreeMap<(String, u64), String>, got: &Got) -> usize {
    let mut seen: BTreeMap<(String, u64), String> = BTreeMap::new();
    let mut dups = 0;
    for (log, seq, uid) in got {
        if let Some(before) = seen.insert((log.clone(), *seq), uid.clone()) {
            assert_eq!(&before, uid, "{log} {seq} came twice with two uids");
            dups += 1;
        }
    }
    let missing: Vec<_> = want.keys().filter(|k| !seen.contains_key(*k)).take(10).collect();
    assert!(
        missing.is_empty(),
        "missing (first 10): {missing:?}; got {} of {}",
        seen.len(),
        want.len()
    );
    let extra: Vec<_> = seen.keys().filter(|k| !want.contains_key(*k)).take(10).collect();
    assert!(extra.is_empty(), "records the store does not hold: {extra:?}");
    for ((log, seq), id) in want {
        if log == "facts" {
            assert_eq!(
                &seen[&(log.clone(), *seq)],
                id,
                "fact {seq}: metadata.uid is not its id"
            );
        }
    }
    dups
}

/// Polls `got` until it covers `want` (or `cap` passes).
async fn until_all(want: &BTreeMap<(String, u64), String>, cap: Duration, got: impl Fn() -> Got) -> Got {
    let t0 = Instant::now();
    loop {
        let g = got();
        let keys: BTreeSet<(String, u64)> = g.iter().map(|(l, s, _)| (l.clone(), *s)).collect();
        if want.keys().all(|k| keys.contains(k)) {
            // A little longer: anything sent twice by mistake shows up.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return got();
        }
        assert!(
            t0.elapsed() < cap,
            "only {} of {} records arrived",
            keys.len(),
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------------ OTLP --

fn otlp_ready() -> bool {
    python_has(
        "opentelemetry.proto.collector.logs.v1.logs_service_pb2",
        "pip install -r tests/audit/requirements.txt",
    )
}

struct Receiver {
    child: Option<KillOnDrop>,
    port: u16,
    out: PathBuf,
}

impl Receiver {
    /// A receiver on `port` (0: any) appending to `out`, waiting `delay_ms`
    /// before each answer.
    fn start(out: &Path, port: u16, delay_ms: u64) -> Receiver {
        let port_arg = std::ffi::OsString::from(port.to_string());
        let delay_arg = std::ffi::OsString::from(delay_ms.to_string());
        let args = [
            "--out".as_ref(),
            out.as_os_str(),
            "--port".as_ref(),
            port_arg.as_os_str(),
            "--delay-ms".as_ref(),
            delay_arg.as_os_str(),
        ];
        let (child, v) = egress_e2e::process::python_server("tests/audit/otlp_receiver.py", &args);
        Receiver {
            child: Some(KillOnDrop(child)),
            port: v["port"].as_u64().unwrap() as u16,
            out: out.to_owned(),
        }
    }

    fn kill(&mut self) {
        self.child = None;
    }

    fn lines(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn got(&self) -> Got {
        self.lines()
            .iter()
            .map(|v| {
                (
                    v["log"].as_str().unwrap().to_owned(),
                    v["seq"].as_u64().unwrap(),
                    v["uid"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }
}

fn otlp_sink(port: u16, extra: &str) -> String {
    format!(
        "[audit.sinks.siem]\ntype = \"otlp\"\nendpoint = \"http://127.0.0.1:{port}\"\nflush_ms = 20\nretry_max_ms = 400\n{extra}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_delivers_every_record_once_with_body_severity_time_and_resource() {
    if !otlp_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let rx = Receiver::start(&tmp.path().join("got.jsonl"), 0, 0);
    let s = Setup::new(&otlp_sink(
        rx.port,
        "headers_env = \"LOOM_TEST_OTLP_HEADERS\"\nbatch_max = 64",
    ))
    .await;
    let p = s.start(&[("LOOM_TEST_OTLP_HEADERS", "Authorization=Bearer%20t0ken,x-scope=cell-a")]);
    let m = s.metrics().await;
    for series in [
        "egress_audit_sink_lag_records{sink=\"siem\",log=\"facts\"}",
        "egress_audit_sink_exported_total{sink=\"siem\",log=\"decisions\"}",
        "egress_audit_sink_dropped_total{sink=\"siem\",log=\"decisions\"}",
        "egress_audit_sink_failures_total{sink=\"siem\",kind=\"http_4xx\"}",
        "egress_audit_sink_last_success_timestamp_seconds{sink=\"siem\"}",
    ] {
        assert!(m.contains(series), "{series} is not present at start:\n{m}");
    }
    let auth = s.auth().await;
    s.activity(&auth, 300, "a").await;
    let want = s.records().await;
    let decisions = want.keys().filter(|k| k.0 == "decisions").count();
    assert_eq!(decisions, 30, "a decision record is missing from the store");
    assert!(want.len() >= 330, "{} records", want.len());
    let got = until_all(&want, Duration::from_secs(60), || rx.got()).await;
    assert_eq!(every_record(&want, &got), 0, "a record was sent twice without a fault");
    let lines = rx.lines();
    let denial = lines.iter().find(|l| l["log"] == "facts").unwrap();
    assert!(
        denial["body"]
            .as_str()
            .unwrap()
            .starts_with("DENIED not_allowlisted http a-"),
        "{denial}"
    );
    assert_eq!(denial["severity_number"], 13, "Low is WARN");
    assert_eq!(
        denial["time_unix_nano"].as_u64().unwrap(),
        denial["event_time"].as_u64().unwrap() * 1_000_000
    );
    assert_eq!(denial["resource"]["service.name"], "loom-egress");
    assert_eq!(denial["resource"]["loom.cell"], "cell-a");
    assert_eq!(denial["auth"], "Bearer t0ken", "headers come from headers_env");
    let allowed = lines.iter().find(|l| l["log"] == "decisions").unwrap();
    assert!(
        allowed["body"]
            .as_str()
            .unwrap()
            .starts_with("ALLOWED GET http api.test"),
        "{allowed}"
    );
    assert_eq!(allowed["severity_number"], 9);
    // The sink's own connection made no fact and no decision record.
    assert!(want.len() == s.records().await.len(), "exporting recorded something");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let m = s.metrics().await;
    let facts = want.keys().filter(|k| k.0 == "facts").count() as f64;
    assert_eq!(
        sample(&m, "egress_audit_sink_exported_total{sink=\"siem\",log=\"facts\"}"),
        facts
    );
    assert_eq!(
        sample(&m, "egress_audit_sink_lag_records{sink=\"siem\",log=\"facts\"}"),
        0.0
    );
    assert!(sample(&m, "egress_audit_sink_last_success_timestamp_seconds{sink=\"siem\"}") > 1.0e9);
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_resumes_with_no_gap_after_the_receiver_dies_mid_flood_and_after_a_proxy_sigkill() {
    if !otlp_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("got.jsonl");
    let mut rx = Receiver::start(&out, free_port(), 0);
    let s = Setup::new(&otlp_sink(rx.port, "batch_max = 25")).await;
    let mut p = s.start(&[]);
    let auth = s.auth().await;

    // The receiver dies mid-flood and comes back on the same port.
    let flood = tokio::spawn(activity(s.proxy, s.port, auth.clone(), 1500, "b"));
    let t0 = Instant::now();
    while rx.lines().len() < 100 {
        assert!(t0.elapsed() < Duration::from_secs(30), "nothing arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rx.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = s.metrics().await;
    assert!(
        sample(&m, "egress_audit_sink_failures_total{sink=\"siem\",kind=\"connect\"}") >= 1.0,
        "no connect failure counted while the receiver was down"
    );
    let mut rx = Receiver::start(&out, rx.port, 0);
    flood.await.unwrap();
    let want = s.records().await;
    let got = until_all(&want, Duration::from_secs(90), || rx.got()).await;
    let dups = every_record(&want, &got);
    eprintln!("receiver outage: {} records, {dups} sent again", want.len());

    // SIGKILL mid-export: a slow collector (100 ms a batch of 25) behind a
    // backlog, and kill -9 while it is being exported.
    rx.kill();
    let rx = Receiver::start(&out, rx.port, 100);
    let before = rx.got().len();
    s.activity(&auth, 1500, "c").await;
    let t0 = Instant::now();
    while rx.got().len() < before + 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the backlog is not being exported"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    p.signal("KILL");
    let _ = p.wait_exit(Duration::from_secs(10));
    let at_kill = rx.got().len();
    let p = s.start(&[]);
    let want = s.records().await;
    assert!(at_kill < want.len(), "the export had finished before the kill");
    let got = until_all(&want, Duration::from_secs(90), || rx.got()).await;
    let dups = every_record(&want, &got);
    eprintln!(
        "proxy SIGKILL: {at_kill} delivered at the kill, {} records in all, {dups} sent again",
        want.len()
    );
    drop(p);
    assert!(want.len() > 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_proxy_delivers_what_is_committed_before_it_exits() {
    if !otlp_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A slow collector: 200 ms a batch of 25.
    let rx = Receiver::start(&tmp.path().join("got.jsonl"), 0, 200);
    let s = Setup::new(&otlp_sink(rx.port, "batch_max = 25")).await;
    let mut p = s.start(&[]);
    let auth = s.auth().await;
    s.activity(&auth, 200, "e").await;
    let want = s.records().await;
    assert!(rx.got().len() < want.len(), "everything was delivered before the stop");
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0), "{}", p.logs());
    assert!(
        p.logs().contains("every record is delivered to the audit sinks"),
        "{}",
        p.logs()
    );
    let got = rx.got();
    assert_eq!(every_record(&want, &got), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_holds_no_denial_back() {
    // Accepts connections and never reads or answers.
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = stalled.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let mut conns = vec![];
        for c in stalled.incoming().take(64) {
            conns.push(c);
        }
    });
    let s = Setup::new(&otlp_sink(port, "timeout_ms = 500")).await;
    let _p = s.start(&[]);
    let auth = s.auth().await;
    // Each denial must be answered within activity's 10 s cap; they are
    // all recorded although nothing is exported.
    s.activity(&auth, 500, "d").await;
    let want = s.records().await;
    assert!(want.keys().filter(|k| k.0 == "facts").count() >= 500);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = s.metrics().await;
    assert!(
        sample(&m, "egress_audit_sink_failures_total{sink=\"siem\",kind=\"timeout\"}") >= 1.0,
        "{m}"
    );
    assert!(sample(&m, "egress_audit_sink_lag_records{sink=\"siem\",log=\"facts\"}") >= 500.0);
    assert_eq!(
        sample(&m, "egress_audit_sink_exported_total{sink=\"siem\",log=\"facts\"}"),
        0.0
    );
    drop(held);
}

// ---------------------------------------------------------------- syslog --

const RSYSLOGD: &str = "/usr/sbin/rsyslogd";

/// `rsyslogd -n` with its own config: imtcp on `port` (TLS with gtls when
/// `tls` holds its cert and key), every message's MSG appended to `out`.
fn rsyslog(dir: &Path, port: u16, out: &Path, tls: Option<(&Path, &Path, &Path)>) -> KillOnDrop {
    let work = dir.join("rsyslog-work");
    std::fs::create_dir_all(&work).unwrap();
    let (global_tls, module) = match tls {
        Some((ca, cert, key)) => (
            format!(
                "global(DefaultNetstreamDriver=\"gtls\" DefaultNetstreamDriverCAFile=\"{}\" DefaultNetstreamDriverCertFile=\"{}\" DefaultNetstreamDriverKeyFile=\"{}\")\n",
                ca.display(),
                cert.display(),
                key.display()
            ),
            "module(load=\"imtcp\" StreamDriver.Name=\"gtls\" StreamDriver.Mode=\"1\" StreamDriver.AuthMode=\"anon\")",
        ),
        None => (String::new(), "module(load=\"imtcp\")"),
    };
    let conf = dir.join("rsyslog.conf");
    std::fs::write(
        &conf,
        format!(
            "global(workDirectory=\"{}\" maxMessageSize=\"64k\")\n{global_tls}{module}\n\
             template(name=\"msg\" type=\"string\" string=\"%msg%\\n\")\n\
             ruleset(name=\"audit\") {{ action(type=\"omfile\" file=\"{}\" template=\"msg\") }}\n\
             input(type=\"imtcp\" address=\"127.0.0.1\" port=\"{port}\" ruleset=\"audit\")\n",
            work.display(),
            out.display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("rsyslogd.log")).unwrap();
    let child = Command::new(RSYSLOGD)
        .args(["-n", "-f"])
        .arg(&conf)
        .arg("-i")
        .arg(dir.join("rsyslogd.pid"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "rsyslogd did not listen: {}",
            std::fs::read_to_string(dir.join("rsyslogd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    KillOnDrop(child)
}

/// The events rsyslog wrote (one OCSF JSON object a line).
fn syslog_got(out: &Path) -> Got {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .map(|v| {
            (
                v["metadata"]["log_name"].as_str().unwrap().to_owned(),
                v["metadata"]["sequence"].as_u64().unwrap(),
                v["metadata"]["uid"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn syslog_case(tls: bool) {
    if !Path::new(RSYSLOGD).exists() {
        eprintln!("SKIP: no {RSYSLOGD} (apt-get install rsyslog rsyslog-gnutls)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("syslog.out");
    let port = free_port();
    let ca = egress_e2e::pki::Ca::new("syslog test CA");
    let ca_file = ca.write(tmp.path(), "ca.pem");
    let leaf = ca.leaf(tmp.path(), "server", "localhost", &["localhost", "127.0.0.1"]);
    let _rsyslog = rsyslog(
        tmp.path(),
        port,
        &out,
        tls.then_some((ca_file.as_path(), leaf.cert.as_path(), leaf.key.as_path())),
    );
    let tls_keys = if tls {
        format!(
            "tls = true\nca_file = \"{}\"\nserver_name = \"localhost\"\n",
            ca_file.display()
        )
    } else {
        String::new()
    };
    let s = Setup::new(&format!(
        "[audit.sinks.rsys]\ntype = \"syslog\"\naddress = \"127.0.0.1:{port}\"\nflush_ms = 20\nretry_max_ms = 400\n{tls_keys}"
    ))
    .await;
    let _p = s.start(&[]);
    let auth = s.auth().await;
    s.activity(&auth, 300, if tls { "t" } else { "s" }).await;
    let want = s.records().await;
    let got = until_all(&want, Duration::from_secs(60), || syslog_got(&out)).await;
    assert_eq!(every_record(&want, &got), 0, "a record was written twice");
    let m = s.metrics().await;
    assert_eq!(
        sample(&m, "egress_audit_sink_failures_total{sink=\"rsys\",kind=\"tls\"}"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsyslog_over_tcp_writes_every_record_once() {
    syslog_case(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsyslog_over_tls_writes_every_record_once() {
    if !Path::new("/usr/lib/x86_64-linux-gnu/rsyslog/lmnsd_gtls.so").exists()
        && !Path::new("/usr/lib/rsyslog/lmnsd_gtls.so").exists()
    {
        eprintln!("SKIP: rsyslog's gtls driver is not installed (apt-get install rsyslog-gnutls)");
        return;
    }
    syslog_case(true).await;
}

// ------------------------------------------------------------------ file --

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_sink_rotates_by_size_and_count_keeps_files_private_and_every_record_once() {
    let s = Setup::new(
        "[audit.sinks.archive]\ntype = \"file\"\npath = \"{dir}/audit/events.jsonl\"\nmax_file_mb = 1\nmax_files = 20\nflush_ms = 20\n",
    )
    .await;
    let _p = s.start(&[]);
    let auth = s.auth().await;
    s.activity(&auth, 1500, "f").await;
    let want = s.records().await;
    let path = s.dir.path().join("audit/events.jsonl");
    let files = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = (1..20)
            .rev()
            .map(|n| PathBuf::from(format!("{}.{n}", path.display())))
            .filter(|p| p.exists())
            .collect();
        v.push(path.clone());
        v
    };
    let got = until_all(&want, Duration::from_secs(60), || {
        files().iter().flat_map(|f| syslog_got(f)).collect()
    })
    .await;
    assert_eq!(every_record(&want, &got), 0);
    let files = files();
    assert!(files.len() >= 3, "no rotation: {files:?}");
    use std::os::unix::fs::PermissionsExt as _;
    for f in &files {
        let meta = std::fs::metadata(f).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{}", f.display());
        assert!(meta.len() <= 1 << 20, "{} holds {} bytes", f.display(), meta.len());
    }
    // Oldest first across files: path.N … path.1, path.
    let seqs: Vec<u64> = got.iter().filter(|g| g.0 == "facts").map(|g| g.1).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "facts out of order across files");
    assert_eq!(
        std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777,
        0o700
    );
}

/// A config naming an unset headers variable does not start.
#[test]
fn a_missing_headers_variable_stops_the_proxy_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = dir.path().join("egress.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n\
             [audit.sinks.siem]\ntype = \"otlp\"\nendpoint = \"http://127.0.0.1:4318\"\nheaders_env = \"LOOM_UNSET_HEADERS_VAR\"\n"
        ),
    )
    .unwrap();
    let out = Command::new(bin("egress-proxy"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .env_remove("LOOM_UNSET_HEADERS_VAR")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("audit.sinks.siem: headers_env: LOOM_UNSET_HEADERS_VAR is not set"),
        "{err}"
    );
}

/// With a signing key, the sinks also carry the signed checkpoints (Event
/// Log Activity events, `metadata.log_name` = `checkpoints`), each once;
/// kept off the box by the sink, their notes verify the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_carries_the_signed_checkpoints_and_they_verify_the_store() {
    let s = Setup::new(
        "[audit]\nsigning_key_file = \"{dir}/audit.key\"\ncheckpoint_ms = 1000\nrecord_integrity = true\n\
         [audit.sinks.archive]\ntype = \"file\"\npath = \"{dir}/audit/events.jsonl\"\nflush_ms = 20\n",
    )
    .await;
    let key = s.dir.path().join("audit.key");
    let made = Command::new(bin("egress-proxy"))
        .args(["audit", "keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let mut p = s.start(&[]);
    let auth = s.auth().await;
    s.activity(&auth, 200, "k").await;
    let events = s.dir.path().join("audit/events.jsonl");
    let lines = || -> Vec<Value> {
        std::fs::read_to_string(&events)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &Value| v["metadata"]["log_name"] == "checkpoints")
            .collect()
    };
    // The one signed at open, then those every second while records came.
    let t0 = Instant::now();
    while lines().len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no checkpoint reached the sink");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0));
    let got = lines();
    let uids: BTreeSet<&str> = got.iter().map(|v| v["metadata"]["uid"].as_str().unwrap()).collect();
    assert_eq!(uids.len(), got.len(), "a checkpoint came twice");
    for v in &got {
        assert_eq!(
            (v["class_uid"].as_u64(), v["activity_name"].as_str()),
            (Some(1008), Some("Checkpoint"))
        );
    }
    // The sink's directory itself holds the checkpoints off the box.
    let held = s.dir.path().join("audit");
    let out = Command::new(bin("egress-proxy"))
        .args(["facts", "verify", "--store"])
        .arg(s.dir.path().join("facts.db"))
        .arg("--key")
        .arg(s.dir.path().join("audit.key.pub"))
        .arg("--checkpoints")
        .arg(&held)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("verified: no findings"), "{text}");
    let verified: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("checkpoints: "))
        .and_then(|l| l.split(' ').next()?.parse().ok())
        .unwrap();
    assert!(
        verified > got.len(),
        "the sink's {} notes were read beside the store's own: {text}",
        got.len()
    );
    // record_integrity: each fact's and decision record's event carries its
    // chain value as the attestation's fingerprint, linked to the previous
    // one's, and a checkpoint's head is the fingerprint at its size.
    let all: Vec<Value> = std::fs::read_to_string(&events)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut fingerprints: BTreeMap<(String, u64), String> = BTreeMap::new();
    for v in all.iter().filter(|v| v["metadata"]["log_name"] != "checkpoints") {
        let log = v["metadata"]["log_name"].as_str().unwrap().to_owned();
        let seq = v["metadata"]["sequence"].as_u64().unwrap();
        let att = &v["attestation"];
        assert_eq!(
            att["uid"].as_str().unwrap(),
            format!("{}/{seq}", att["chain_uid"].as_str().unwrap())
        );
        assert_eq!(att["authority_uid"], "loom-egress");
        assert!(v["metadata"]["profiles"]
            .as_array()
            .unwrap()
            .contains(&Value::from("record_integrity")));
        fingerprints.insert((log, seq), att["fingerprint"]["value"].as_str().unwrap().to_owned());
    }
    let mut linked = 0;
    for v in all.iter().filter(|v| v["metadata"]["log_name"] != "checkpoints") {
        let key = (
            v["metadata"]["log_name"].as_str().unwrap().to_owned(),
            v["metadata"]["sequence"].as_u64().unwrap(),
        );
        if let Some(before) = fingerprints.get(&(key.0.clone(), key.1 - 1)) {
            assert_eq!(
                v["attestation"]["prev_event"]["fingerprint"]["value"].as_str(),
                Some(before.as_str()),
                "{key:?}"
            );
            linked += 1;
        }
    }
    assert!(linked > 150, "only {linked} events linked to the one before");
    use base64::Engine as _;
    let mut anchored = 0;
    for cp in &got {
        let loom = &cp["unmapped"]["loom"];
        let size = loom["size"].as_u64().unwrap();
        let head = base64::engine::general_purpose::STANDARD
            .decode(loom["head"].as_str().unwrap())
            .unwrap();
        let hex: String = head.iter().map(|b| format!("{b:02x}")).collect();
        if let Some(fp) = fingerprints.get(&("facts".to_owned(), size)) {
            assert_eq!(fp, &hex, "checkpoint at facts seq {size}");
            anchored += 1;
        }
    }
    assert!(anchored >= 1, "no checkpoint's head found among the events");
    if python_has(
        "ocsf_json_schema, jsonschema",
        "pip install -r tests/ocsf/requirements.txt",
    ) {
        let check = Command::new("python3")
            .arg(egress_e2e::process::repo_root().join("tests/ocsf/validate.py"))
            .arg(&events)
            .output()
            .unwrap();
        assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    }
    // The export alone verifies record by record (raw_data is what the
    // chain covers); an edited event and a deleted one are named.
    let verify_export = |dir: &Path| {
        let out = Command::new(bin("egress-proxy"))
            .args(["facts", "verify", "--export"])
            .arg(dir)
            .arg("--key")
            .arg(s.dir.path().join("audit.key.pub"))
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, text) = verify_export(&s.dir.path().join("audit"));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("verified: no findings") && text.contains("facts: "),
        "{text}"
    );
    let tampered = s.dir.path().join("tampered");
    std::fs::create_dir(&tampered).unwrap();
    let mut edited = (0, 0);
    let lines: Vec<String> = std::fs::read_to_string(&events)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            if v["metadata"]["log_name"] != "facts" {
                return Some(l.to_owned());
            }
            match v["metadata"]["sequence"].as_u64().unwrap() {
                20 => {
                    let raw = v["raw_data"].as_str().unwrap().replace("enforce", "report");
                    v["raw_data"] = Value::from(raw);
                    edited.0 += 1;
                    Some(v.to_string())
                }
                30 => {
                    edited.1 += 1;
                    None
                }
                _ => Some(l.to_owned()),
            }
        })
        .collect();
    assert_eq!(edited, (1, 1));
    std::fs::write(tampered.join("events.jsonl"), lines.join("\n") + "\n").unwrap();
    let (code, text) = verify_export(&tampered);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("FINDING altered facts seq 20:"), "{text}");
    assert!(text.contains("FINDING missing facts seq 30:"), "{text}");
}
