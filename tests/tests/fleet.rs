//! A fleet of cells with real processes and a real PostgreSQL 15: most
//! cases on loopback, and the fleet as separate hosts (network namespaces on
//! a service and a data bridge, `egress_e2e::fleet_net`), where a partition
//! is a cut bridge port. Each export case checks the exactly-once invariant:
//! per (cell, epoch), `count(*) = max(seq)` = the local store's newest
//! `seq`, ids unique, and every body equal to the local fact. Skipped loudly
//! without root or PostgreSQL (see `egress_e2e::postgres`); the case of a
//! run's locality (407 elsewhere, revocation, slots) needs neither.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::fleet_net::FleetNet;
use egress_e2e::harness::{basic, control_call, sample, TOKEN};
use egress_e2e::postgres::Postgres;
use egress_e2e::process::{bin, free_addr, write_config, ProxyProcess};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DSN_ENV: &str = "EGRESS_EXPORT_DSN";

struct Cell {
    dir: tempfile::TempDir,
    proxy: SocketAddr,
    control: SocketAddr,
    cfg: std::path::PathBuf,
}

impl Cell {
    /// A config for cell `id` exporting with `export` (more `[export]` keys).
    fn new(id: &str, export: &str) -> Cell {
        Cell::at(id, export, free_addr(), free_addr())
    }

    /// Like [`Cell::new`], listening on `proxy` and `control`.
    fn at(id: &str, export: &str, proxy: SocketAddr, control: SocketAddr) -> Cell {
        let dir = tempfile::tempdir().unwrap();
        // Each cell signs its fact log's checkpoints; the export copies them.
        let keygen = std::process::Command::new(bin("egress-proxy"))
            .args(["audit", "keygen", "--name", id, "--out"])
            .arg(dir.path().join("signing.key"))
            .output()
            .unwrap();
        assert!(keygen.status.success(), "{}", String::from_utf8_lossy(&keygen.stderr));
        let rest = format!(
            "[tools.t]\negress = [\"allowed.example:443\"]\n\
             [cell]\nid = \"{id}\"\nadvertise_control = \"http://{id}.cells.test:3129\"\n\
             [export]\nsink = \"postgres\"\ndsn_env = \"{DSN_ENV}\"\n{export}\n\
             [audit]\nsigning_key_file = \"signing.key\"\ncheckpoint_ms = 1000\n"
        );
        let cfg = write_config(dir.path(), proxy, control, &rest);
        Cell {
            dir,
            proxy,
            control,
            cfg,
        }
    }

    fn start(&self, pg: &Postgres) -> ProxyProcess {
        self.start_within(None, pg)
    }

    /// Starts it in network namespace `netns` (`None`: the test's own).
    fn start_within(&self, netns: Option<&str>, pg: &Postgres) -> ProxyProcess {
        let dsn = pg.dsn();
        ProxyProcess::start_within(
            netns,
            &bin("egress-proxy"),
            &self.cfg,
            (self.proxy, self.control),
            TOKEN,
            &[],
            &[(DSN_ENV, dsn.as_str())],
        )
    }

    fn store(&self) -> std::path::PathBuf {
        self.dir.path().join("facts.db")
    }
}

async fn get(control: SocketAddr, path: &str) -> (u16, Value) {
    let r = control_call(control, "GET", path, None, Some(TOKEN)).await;
    (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
}

async fn readyz(control: SocketAddr) -> (u16, String) {
    let r = control_call(control, "GET", "/readyz", None, None).await;
    (r.status, String::from_utf8_lossy(&r.body).trim().to_owned())
}

async fn metrics(control: SocketAddr) -> String {
    let r = control_call(control, "GET", "/metrics", None, None).await;
    String::from_utf8_lossy(&r.body).into_owned()
}

/// Creates a run of tool `t`; returns its `Proxy-Authorization` value.
async fn run(control: SocketAddr) -> String {
    let r = control_call(control, "POST", "/v1/runs", Some(json!({"tool": "t"})), Some(TOKEN)).await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    basic(v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap())
}

/// One denied fetch (a host no rule allows); the status, or `None` if the
/// proxy is gone.
async fn deny(proxy: SocketAddr, auth: &str, n: u64) -> Option<u16> {
    let host = format!("h{n}.denied.example");
    let req = format!(
        "GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n"
    );
    let io = async {
        let mut s = tokio::net::TcpStream::connect(proxy).await.ok()?;
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let head = String::from_utf8_lossy(&buf);
        head.split(' ').nth(1)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(10), io).await.ok().flatten()
}

/// `count` denials from `workers` concurrent clients, numbered from `from`;
/// returns how many were answered 403.
async fn flood(proxy: SocketAddr, auth: String, from: u64, count: u64, answered: Arc<AtomicU64>) -> u64 {
    let next = Arc::new(AtomicU64::new(from));
    let mut tasks = vec![];
    for _ in 0..8 {
        let (next, answered, auth) = (next.clone(), answered.clone(), auth.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = 0;
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= from + count {
                    return mine;
                }
                match deny(proxy, &auth, n).await {
                    Some(403) => {
                        mine += 1;
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(other) => panic!("denial answered {other}"),
                    None => return mine,
                }
            }
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

/// Every local fact of the cell's store (through its control API).
async fn local_facts(control: SocketAddr) -> Vec<Value> {
    let mut out = vec![];
    let mut after = 0;
    loop {
        let (s, v) = get(control, &format!("/v1/facts?after={after}&limit=1000")).await;
        assert_eq!(s, 200, "{v}");
        let page = v["facts"].as_array().cloned().unwrap_or_default();
        if page.is_empty() {
            return out;
        }
        after = page.last().unwrap()["seq"].as_u64().unwrap();
        out.extend(page);
    }
}

/// The exactly-once invariant for (cell, epoch) against the local facts.
fn assert_exported_once(pg: &Postgres, cell: &str, local: &[Value]) {
    let epoch = local[0]["epoch"].as_str().unwrap();
    let head = local.last().unwrap()["seq"].as_i64().unwrap();
    let w = format!("cell = '{cell}' AND epoch = '{epoch}'");
    let row = pg.query(&format!(
        "SELECT count(*), COALESCE(max(seq), 0), count(DISTINCT id) FROM egress_facts WHERE {w}"
    ));
    assert_eq!(row, format!("{head}|{head}|{head}"), "count | max(seq) | distinct ids");
    assert_eq!(pg.number("SELECT count(*) - count(DISTINCT id) FROM egress_facts"), 0);
    let remote = pg.query(&format!("SELECT body::text FROM egress_facts WHERE {w} ORDER BY seq"));
    let remote: Vec<Value> = remote.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(remote.len(), local.len());
    for (r, l) in remote.iter().zip(local) {
        assert_eq!(r, l, "the exported body differs from the local fact");
    }
}

async fn until(what: &str, cap: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < cap, "{what}: not within {cap:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A denial flood, `kill -9` in its middle, a restart on the same store,
/// more denials, then SIGTERM: PostgreSQL holds each fact exactly once,
/// and the lag is 0 before the process exits (the last denials come while
/// another session holds the table locked against inserts for 3 s, so only
/// the stop's flush exports them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_is_exported_exactly_once_across_kill_9_and_sigterm() {
    let Some(pg) = Postgres::start() else { return };
    let cell = Cell::new("cell-a", "flush_ms = 50\nbatch_max = 64");
    let mut p = cell.start(&pg);
    let auth = run(cell.control).await;
    let answered = Arc::new(AtomicU64::new(0));
    let flooding = tokio::spawn(flood(cell.proxy, auth.clone(), 0, 100_000, answered.clone()));
    until("a flood under way", Duration::from_secs(30), async || {
        answered.load(Ordering::Relaxed) >= 300
    })
    .await;
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &p.child.id().to_string()])
        .status();
    let _ = p.child.wait();
    let before = flooding.await.unwrap();
    drop(p);
    let mut p = cell.start(&pg);
    assert_eq!(
        flood(cell.proxy, auth.clone(), 200_000, 400, answered.clone()).await,
        400
    );
    until("caught up", Duration::from_secs(20), async || {
        get(cell.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    let mut locker = pg.spawn("BEGIN; LOCK TABLE egress_facts IN EXCLUSIVE MODE; SELECT pg_sleep(3); COMMIT;");
    until("the table locked", Duration::from_secs(10), async || {
        pg.number("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation WHERE c.relname = 'egress_facts' AND l.mode = 'ExclusiveLock' AND l.granted") == 1
    })
    .await;
    assert_eq!(flood(cell.proxy, auth.clone(), 300_000, 40, answered.clone()).await, 40);
    let local = local_facts(cell.control).await;
    let denials: u64 = local.iter().map(|f| f["count"].as_u64().unwrap()).sum();
    assert!(
        denials >= before + 440,
        "a denial answered 403 is missing locally: {denials} < {before} + 440"
    );
    let lag = get(cell.control, "/v1/cell").await.1["export_lag"].as_u64().unwrap();
    assert!(lag > 0, "nothing left for the stop to flush");
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0), "{}", p.logs());
    let _ = locker.wait();
    assert_exported_once(&pg, "cell-a", &local);
    assert!(p.logs().contains("every fact is exported"), "{}", p.logs());
    // The signed checkpoints went to the fleet store too: held off the
    // box, they verify the cell's store.
    let notes = pg.query("SELECT note FROM egress_checkpoints WHERE cell = 'cell-a' ORDER BY at");
    assert!(
        notes.contains("loom-egress/cell-a/"),
        "no checkpoint exported: {notes:?}"
    );
    let held = cell.dir.path().join("held.notes");
    std::fs::write(&held, &notes).unwrap();
    let verify = std::process::Command::new(bin("egress-proxy"))
        .args(["facts", "verify", "--store"])
        .arg(cell.store())
        .arg("--key")
        .arg(cell.dir.path().join("signing.key.pub"))
        .arg("--checkpoints")
        .arg(&held)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.status.success(), "{out}");
    let held_count = out
        .lines()
        .find_map(|l| l.strip_prefix("checkpoints: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap();
    assert!(
        held_count > notes.matches("loom-egress/").count(),
        "the exported notes verified with the store's own: {out}"
    );
    // The fleet store itself, record by record: every exported fact with
    // its stored JSON and chain value, against egress_checkpoints.
    let verify_pg = || {
        let out = std::process::Command::new(bin("egress-proxy"))
            .args(["facts", "verify", "--postgres", "--config"])
            .arg(&cell.cfg)
            .arg("--key")
            .arg(cell.dir.path().join("signing.key.pub"))
            .env(DSN_ENV, pg.dsn())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, out) = verify_pg();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("verified: no findings"), "{out}");
    pg.query("UPDATE egress_facts SET stored = replace(stored, 'enforce', 'report') WHERE cell = 'cell-a' AND seq = 5");
    pg.query("DELETE FROM egress_facts WHERE cell = 'cell-a' AND seq = 9");
    let (code, out) = verify_pg();
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FINDING altered facts seq 5:"), "{out}");
    assert!(out.contains("FINDING missing facts seq 9:"), "{out}");
}

/// A second process with a cell id already held exports nothing and is
/// unready (`cell_id_in_use`); the store replaced gives a new epoch, the
/// old rows stay untouched and new facts are exported under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cell_id_held_twice_exports_nothing_and_a_new_store_is_a_new_epoch() {
    let Some(pg) = Postgres::start() else { return };
    let a = Cell::new("cell-a", "flush_ms = 50");
    let pa = a.start(&pg);
    let auth = run(a.control).await;
    let answered = Arc::new(AtomicU64::new(0));
    flood(a.proxy, auth.clone(), 0, 50, answered.clone()).await;
    until("cell-a ready", Duration::from_secs(10), async || {
        readyz(a.control).await.0 == 200
    })
    .await;

    let twin = Cell::new("cell-a", "flush_ms = 50");
    let pt = twin.start(&pg);
    until("the twin unready", Duration::from_secs(10), async || {
        readyz(twin.control).await == (503, "cell_id_in_use".to_owned())
    })
    .await;
    let (_, view) = get(twin.control, "/v1/cell").await;
    assert_eq!(
        (view["id"].as_str(), view["ready"].as_bool(), view["reason"].as_str()),
        (Some("cell-a"), Some(false), Some("cell_id_in_use")),
        "{view}"
    );
    let twin_auth = run(twin.control).await;
    assert_eq!(flood(twin.proxy, twin_auth.clone(), 0, 30, answered.clone()).await, 30);
    let twin_epoch = local_facts(twin.control).await[0]["epoch"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pg.number(&format!(
            "SELECT count(*) FROM egress_facts WHERE epoch = '{twin_epoch}'"
        )),
        0,
        "the twin exported"
    );
    assert!(
        sample(
            &metrics(twin.control).await,
            "egress_export_failures_total{kind=\"lock\"}"
        ) >= 1.0
    );
    drop(pt);

    let old = local_facts(a.control).await;
    until("cell-a exported", Duration::from_secs(10), async || {
        get(a.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    assert_exported_once(&pg, "cell-a", &old);
    let old_rows = pg.query("SELECT seq, id, body::text FROM egress_facts ORDER BY epoch, seq");
    drop(pa);
    for f in ["facts.db", "facts.db-wal", "facts.db-shm"] {
        let _ = std::fs::remove_file(a.dir.path().join(f));
    }
    assert!(!Path::new(&a.store()).exists());
    let pa = a.start(&pg);
    let auth = run(a.control).await;
    flood(a.proxy, auth.clone(), 1000, 40, answered.clone()).await;
    let new = local_facts(a.control).await;
    assert_ne!(new[0]["epoch"], old[0]["epoch"], "a replaced store is a new epoch");
    until("the new epoch exported", Duration::from_secs(10), async || {
        get(a.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    assert_exported_once(&pg, "cell-a", &new);
    assert_eq!(
        pg.query(&format!(
            "SELECT seq, id, body::text FROM egress_facts WHERE epoch <> '{}' ORDER BY epoch, seq",
            new[0]["epoch"].as_str().unwrap()
        )),
        old_rows,
        "the old epoch's rows changed"
    );
    drop(pa);
}

/// PostgreSQL stopped: denials are still answered 403 and kept locally,
/// the lag grows and `/readyz` answers 503 `export_lag` past `max_lag`.
/// PostgreSQL back: the lag returns to 0 and the invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_away_grows_the_lag_and_unreadies_then_the_export_catches_up() {
    let Some(mut pg) = Postgres::start() else { return };
    let cell = Cell::new("cell-b", "flush_ms = 50\nmax_lag = 20");
    let _p = cell.start(&pg);
    let auth = run(cell.control).await;
    let answered = Arc::new(AtomicU64::new(0));
    flood(cell.proxy, auth.clone(), 0, 10, answered.clone()).await;
    until("exported", Duration::from_secs(10), async || {
        get(cell.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    assert_eq!(readyz(cell.control).await.0, 200);

    pg.stop();
    assert_eq!(
        flood(cell.proxy, auth.clone(), 100, 60, answered.clone()).await,
        60,
        "denials go on"
    );
    until("the lag counted", Duration::from_secs(10), async || {
        sample(&metrics(cell.control).await, "egress_export_lag_facts") >= 21.0
    })
    .await;
    assert_eq!(readyz(cell.control).await, (503, "export_lag".to_owned()));
    let local = local_facts(cell.control).await;
    assert!(local.len() >= 61, "local facts kept: {}", local.len());

    pg.resume();
    let t0 = Instant::now();
    until("caught up", Duration::from_secs(10), async || {
        get(cell.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    eprintln!("caught up {} facts in {:?}", local.len(), t0.elapsed());
    assert_eq!(readyz(cell.control).await.0, 200);
    assert_exported_once(&pg, "cell-b", &local);
    let m = metrics(cell.control).await;
    let failures: f64 = ["connect", "read", "write"]
        .iter()
        .map(|k| sample(&m, &format!("egress_export_failures_total{{kind=\"{k}\"}}")))
        .sum();
    assert!(failures >= 1.0, "the outage is not counted:\n{m}");
    assert!(sample(&m, "egress_export_facts_total") >= local.len() as f64);
}

/// Without `[cell]` and `[export]`: every export metric is there at 0, the
/// cell info names no cell, and `/v1/cell` has no id but the store's epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cell_the_export_metrics_are_present_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, "");
    let _p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let m = metrics(control).await;
    for series in [
        "egress_export_lag_facts",
        "egress_export_facts_total",
        "egress_export_failures_total{kind=\"connect\"}",
        "egress_export_failures_total{kind=\"write\"}",
        "egress_export_batch_duration_seconds_count",
        "egress_export_last_success_timestamp_seconds",
    ] {
        assert!(
            m.lines().any(|l| l
                .strip_prefix(series)
                .is_some_and(|v| v.trim() == "0" || v.trim() == "0.0")),
            "{series} is not there at 0 in\n{m}"
        );
    }
    let (s, view) = get(control, "/v1/cell").await;
    assert_eq!(s, 200);
    assert!(view.get("id").is_none(), "{view}");
    let epoch = view["epoch"].as_str().unwrap();
    assert!(
        m.contains(&format!("egress_cell_info{{cell=\"\",epoch=\"{epoch}\",policy=\"")),
        "{m}"
    );
    assert_eq!(view["ready"], true);
    assert_eq!(readyz(control).await.0, 200);
}

/// With `[cell]`: a run's proxy URL and env use `advertise_proxy`, its view
/// names the cell and its `control_url`, facts carry the cell, and
/// `/v1/cell` says who the cell is (the environment's id winning over the
/// file's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_advertises_its_urls_in_runs_and_names_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(
        dir.path(),
        proxy,
        control,
        "[tools.t]\negress = []\n[cell]\nid = \"from-file\"\n\
         advertise_proxy = \"http://cell-c.cells.test:3128\"\nadvertise_control = \"http://cell-c.cells.test:3129\"\n",
    );
    let _p = ProxyProcess::start_with_env(
        &bin("egress-proxy"),
        &cfg,
        (proxy, control),
        TOKEN,
        &[],
        &[("EGRESS_CELL_ID", "cell-c")],
    );
    let r = control_call(control, "POST", "/v1/runs", Some(json!({"tool": "t"})), Some(TOKEN)).await;
    assert_eq!(r.status, 201);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let (id, secret) = (v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap());
    let url = format!("http://{id}:{secret}@cell-c.cells.test:3128");
    assert_eq!(v["proxy_url"], url.as_str());
    assert_eq!(v["env"]["HTTPS_PROXY"], url.as_str());
    assert_eq!(v["cell"], "cell-c");
    assert_eq!(v["control_url"], "http://cell-c.cells.test:3129");
    let (_, view) = get(control, &format!("/v1/runs/{id}")).await;
    assert_eq!(
        (view["cell"].as_str(), view["control_url"].as_str()),
        (Some("cell-c"), Some("http://cell-c.cells.test:3129"))
    );
    assert_eq!(deny(proxy, &basic(id, secret), 1).await, Some(403));
    let facts = local_facts(control).await;
    assert_eq!(facts[0]["cell"], "cell-c");
    let (_, cell) = get(control, "/v1/cell").await;
    assert_eq!(cell["id"], "cell-c");
    assert_eq!(cell["epoch"], facts[0]["epoch"]);
    assert_eq!(cell["live_runs"], 1);
    assert_eq!(cell["advertise_proxy"], "http://cell-c.cells.test:3128");
    assert!(cell.get("export_lag").is_none(), "no [export]: {cell}");
    let m = metrics(control).await;
    assert!(m.contains("egress_cell_info{cell=\"cell-c\","), "{m}");
    // Errors name the cell too.
    let (s, e) = get(control, "/v1/runs/nobody").await;
    assert_eq!(s, 404);
    assert_eq!(
        (e["error"]["cell"].as_str(), e["error"]["control_url"].as_str()),
        (Some("cell-c"), Some("http://cell-c.cells.test:3129")),
        "{e}"
    );
}

/// A cell without `[export]` (case 4 needs no PostgreSQL): tool `t` may
/// reach `origin.test` on `port` (127.0.0.2 through `dns`) with 4 slots.
fn local_cell(id: &str, dns: SocketAddr, port: u16) -> (tempfile::TempDir, SocketAddr, SocketAddr, ProxyProcess) {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let rest = format!(
        "allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{dns}\"]\n\
         [cell]\nid = \"{id}\"\n\
         [tools.t]\negress = [\"origin.test:{port}\"]\nmax_concurrent_fetches = 4\nmax_queued_fetches = 64\n"
    );
    let cfg = write_config(dir.path(), proxy, control, &rest);
    let p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    (dir, proxy, control, p)
}

/// An origin on 127.0.0.2 that answers a plain GET after 100 ms and counts
/// the most requests it ever had in flight, and holds a CONNECTed stream
/// open (the tunnel case) until its peer goes.
async fn slot_origin() -> (u16, Arc<AtomicU64>) {
    let l = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (inflight, most) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let seen = most.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (inflight, most) = (inflight.clone(), most.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if !head.starts_with(b"GET ") {
                    // The tunnel's bytes: hold until the peer goes.
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                    }
                    return;
                }
                let now = inflight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                inflight.fetch_sub(1, Ordering::SeqCst);
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    .await;
            });
        }
    });
    (port, seen)
}

/// One request through `proxy` with `auth`: the status, or `None`.
async fn through(proxy: SocketAddr, auth: &str, target: &str) -> Option<u16> {
    Some(answer(proxy, auth, target).await?.0)
}

/// One request through `proxy` with `auth`: the status and the whole
/// answer, or `None`.
async fn answer(proxy: SocketAddr, auth: &str, target: &str) -> Option<(u16, String)> {
    let req = format!(
        "GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n"
    );
    let io = async {
        let mut s = tokio::net::TcpStream::connect(proxy).await.ok()?;
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        Some((text.split(' ').nth(1)?.parse().ok()?, text))
    };
    tokio::time::timeout(Duration::from_secs(20), io).await.ok().flatten()
}

/// Fleet case 4: a run lives on one cell. Its credential is refused (407)
/// at another cell of the fleet; `DELETE` at its own cell severs its open
/// tunnel at once and the credential fails right after (403 `run_ended`); and 32 concurrent
/// fetches never put more than its `max_concurrent_fetches` (4) in flight at
/// the origin. Runs without root or PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_is_local_to_its_cell_and_its_slots_and_revocation_hold_there() {
    let dns = egress_e2e::dns::FakeDns::start().await;
    dns.set("origin.test", &["127.0.0.2"]);
    let (port, most) = slot_origin().await;
    let (_da, proxy_a, control_a, _pa) = local_cell("cell-a", dns.addr, port);
    let (_db, proxy_b, control_b, _pb) = local_cell("cell-b", dns.addr, port);
    let target = format!("origin.test:{port}");
    let r = control_call(control_a, "POST", "/v1/runs", Some(json!({"tool": "t"})), Some(TOKEN)).await;
    assert_eq!(r.status, 201);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let (id, auth) = (
        v["run_id"].as_str().unwrap().to_owned(),
        basic(v["run_id"].as_str().unwrap(), v["secret"].as_str().unwrap()),
    );
    assert_eq!(v["cell"], "cell-a");
    assert_eq!(through(proxy_a, &auth, &target).await, Some(200), "at its own cell");
    assert_eq!(through(proxy_b, &auth, &target).await, Some(407), "at another cell");
    assert_eq!(
        get(control_b, &format!("/v1/runs/{id}")).await.0,
        404,
        "cell-b knows no such run"
    );

    // 32 concurrent fetches: all answered, at most 4 at the origin at once.
    let mut tasks = vec![];
    for _ in 0..32 {
        let (auth, target) = (auth.clone(), target.clone());
        tasks.push(tokio::spawn(async move { through(proxy_a, &auth, &target).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), Some(200));
    }
    let peak = most.load(Ordering::SeqCst);
    assert!(
        (1..=4).contains(&peak),
        "{peak} fetches in flight at the origin, slots are 4"
    );

    // An open tunnel, then DELETE at cell-a: severed at once.
    let mut s = tokio::net::TcpStream::connect(proxy_a).await.unwrap();
    let connect = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth}\r\n\r\n");
    s.write_all(connect.as_bytes()).await.unwrap();
    let mut head = [0u8; 256];
    let n = s.read(&mut head).await.unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    s.write_all(b"hello\r\n\r\n").await.unwrap();
    let t0 = Instant::now();
    let d = control_call(control_a, "DELETE", &format!("/v1/runs/{id}"), None, Some(TOKEN)).await;
    assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
    let mut rest = [0u8; 64];
    let cut = tokio::time::timeout(Duration::from_secs(5), s.read(&mut rest)).await;
    let severed = t0.elapsed();
    assert!(
        matches!(cut, Ok(Ok(0)) | Ok(Err(_))),
        "the tunnel still open after DELETE: {cut:?}"
    );
    eprintln!("tunnel severed {severed:?} after DELETE was sent");
    assert!(severed < Duration::from_secs(1), "severed only after {severed:?}");
    let (status, text) = answer(proxy_a, &auth, &target).await.unwrap();
    assert_eq!(status, 403, "the credential right after DELETE: {text}");
    assert!(text.contains("run_ended"), "{text}");
}

/// The fleet on a network of hosts (network namespaces on two bridges, see
/// `egress_e2e::fleet_net`): a kernel, cells `cell-a` and `cell-b`, and
/// PostgreSQL. Both cells take a denial flood: PostgreSQL holds each fact
/// once. Then cell-b's port on the data bridge is cut (silence, not a
/// refusal): its 403s and local facts go on, its lag grows and `/readyz`
/// answers 503 past `max_lag`, while cell-a exports on. Healed, cell-b's lag
/// is 0 within 10 s and the invariant holds for both cells.
#[test]
fn a_fleet_of_hosts_exports_once_and_a_cut_cell_catches_up() {
    const NAME: &str = "a_fleet_of_hosts_exports_once_and_a_cut_cell_catches_up";
    let Some(net) = FleetNet::enter(NAME, &["cell-a", "cell-b"]) else {
        return;
    };
    let Some(pg) = Postgres::start_in(Some(&net.ns("db")), net.db_ip()) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cells = vec![];
        for id in ["cell-a", "cell-b"] {
            let ip = net.service_ip(id);
            let at = |port: u16| format!("{ip}:{port}").parse().unwrap();
            let cell = Cell::at(id, "flush_ms = 50\nmax_lag = 20", at(3128), at(3129));
            let process = cell.start_within(Some(&net.ns(id)), &pg);
            cells.push((cell, process));
        }
        let (a, b) = (&cells[0].0, &cells[1].0);
        let (auth_a, auth_b) = (run(a.control).await, run(b.control).await);
        let answered = Arc::new(AtomicU64::new(0));
        let (fa, fb) = tokio::join!(
            flood(a.proxy, auth_a.clone(), 0, 100, answered.clone()),
            flood(b.proxy, auth_b.clone(), 0, 100, answered.clone())
        );
        assert_eq!((fa, fb), (100, 100));
        for cell in [a, b] {
            until("exported", Duration::from_secs(10), async || {
                get(cell.control, "/v1/cell").await.1["export_lag"] == 0
            })
            .await;
        }

        net.cut("cell-b");
        let (fa, fb) = tokio::join!(
            flood(a.proxy, auth_a.clone(), 1000, 40, answered.clone()),
            flood(b.proxy, auth_b.clone(), 1000, 60, answered.clone())
        );
        assert_eq!((fa, fb), (40, 60), "denials go on at both cells");
        until("cell-b's lag counted", Duration::from_secs(10), async || {
            sample(&metrics(b.control).await, "egress_export_lag_facts") >= 21.0
        })
        .await;
        assert_eq!(readyz(b.control).await, (503, "export_lag".to_owned()));
        until("cell-a exports on", Duration::from_secs(10), async || {
            get(a.control, "/v1/cell").await.1["export_lag"] == 0
        })
        .await;
        assert_eq!(readyz(a.control).await.0, 200);
        assert!(get(b.control, "/v1/cell").await.1["export_lag"].as_u64().unwrap() >= 60);

        net.heal("cell-b");
        let t0 = Instant::now();
        until("cell-b caught up after the cut", Duration::from_secs(10), async || {
            get(b.control, "/v1/cell").await.1["export_lag"] == 0
        })
        .await;
        eprintln!("healed: cell-b's lag 0 after {:?}", t0.elapsed());
        assert_eq!(readyz(b.control).await.0, 200);
        for (cell, id) in [(a, "cell-a"), (b, "cell-b")] {
            assert_exported_once(&pg, id, &local_facts(cell.control).await);
        }
    });
}
