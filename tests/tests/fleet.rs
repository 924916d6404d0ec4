//! The fleet's fact export with real processes and a real PostgreSQL 15 on
//! loopback (a first step: the layout on network namespaces and a bridge is
//! not here yet; a partition is a relay that goes silent, see [`Partition`]). Each case checks the exactly-once invariant: per (cell,
//! epoch), `count(*) = max(seq)` = the local store's newest `seq`, ids
//! unique, and every body equal to the local fact. Skipped loudly without
//! root or PostgreSQL (see `egress_e2e::postgres`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

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
        let dir = tempfile::tempdir().unwrap();
        let (proxy, control) = (free_addr(), free_addr());
        let rest = format!(
            "[tools.t]\negress = [\"allowed.example:443\"]\n\
             [cell]\nid = \"{id}\"\nadvertise_control = \"http://{id}.cells.test:3129\"\n\
             [export]\nsink = \"postgres\"\ndsn_env = \"{DSN_ENV}\"\n{export}\n"
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
        let dsn = pg.dsn();
        ProxyProcess::start_with_env(
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

/// A TCP relay in front of PostgreSQL that can be cut like a network
/// partition: while cut, bytes are swallowed both ways and nothing is
/// closed (the exporter sees silence, not a reset). Healing lets bytes
/// through again; a connection that lost bytes stays silent (its protocol
/// stream is broken), so only the exporter's own deadline gets it out.
struct Partition {
    addr: SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl Partition {
    async fn start(port: u16) -> Partition {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = cut.clone();
        tokio::spawn(async move {
            while let Ok((a, _)) = l.accept().await {
                let cut = c.clone();
                tokio::spawn(async move {
                    let Ok(b) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    let (mut ar, mut aw) = a.into_split();
                    let (mut br, mut bw) = b.into_split();
                    let (mut x, mut y) = (vec![0u8; 16384], vec![0u8; 16384]);
                    loop {
                        tokio::select! {
                            r = ar.read(&mut x) => match r {
                                Ok(0) | Err(_) => return,
                                Ok(n) => if !cut.load(Ordering::SeqCst) && bw.write_all(&x[..n]).await.is_err() { return },
                            },
                            r = br.read(&mut y) => match r {
                                Ok(0) | Err(_) => return,
                                Ok(n) => if !cut.load(Ordering::SeqCst) && aw.write_all(&y[..n]).await.is_err() { return },
                            },
                        }
                    }
                });
            }
        });
        Partition { addr, cut }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// A partition between the cell and PostgreSQL (silence, not a refused
/// connection): 403s and local facts go on, the lag grows and `/readyz`
/// answers 503 past `max_lag`; healed, the lag is 0 within 10 s and the
/// invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_from_postgres_grows_the_lag_and_heals_within_seconds() {
    let Some(pg) = Postgres::start() else { return };
    let part = Partition::start(pg.port).await;
    let cell = Cell::new("cell-p", "flush_ms = 50\nmax_lag = 20");
    let dsn = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        part.addr.port()
    );
    let _p = ProxyProcess::start_with_env(
        &bin("egress-proxy"),
        &cell.cfg,
        (cell.proxy, cell.control),
        TOKEN,
        &[],
        &[(DSN_ENV, dsn.as_str())],
    );
    let auth = run(cell.control).await;
    let answered = Arc::new(AtomicU64::new(0));
    flood(cell.proxy, auth.clone(), 0, 10, answered.clone()).await;
    until("exported", Duration::from_secs(10), async || {
        get(cell.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    part.cut();
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
    // Still cut a while later: nothing got through.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(get(cell.control, "/v1/cell").await.1["export_lag"].as_u64().unwrap() >= 60);
    let local = local_facts(cell.control).await;
    part.heal();
    let t0 = Instant::now();
    until("caught up after the partition", Duration::from_secs(10), async || {
        get(cell.control, "/v1/cell").await.1["export_lag"] == 0
    })
    .await;
    eprintln!("healed: lag 0 after {:?}", t0.elapsed());
    assert_eq!(readyz(cell.control).await.0, 200);
    assert_exported_once(&pg, "cell-p", &local);
}
