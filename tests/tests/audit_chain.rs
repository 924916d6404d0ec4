//! The hash-chained fact log and its signed checkpoints, on the real
//! binary: `audit keygen` makes the key; a proxy signing with it takes a
//! flood of 100k denials, is killed with SIGKILL mid-flood, restarts on the
//! same store, and is stopped; retention then prunes half of the store.
//! `facts verify` passes each time, also against the checkpoint a witness
//! took from `GET /v1/audit/checkpoint`. Then each tampering, done to a
//! copy of the real store with SQL, makes `facts verify` exit 1 naming the
//! right seq; a replaced store is named against the witness's checkpoint;
//! a key file others may read is refused at start.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{basic, control_call, create_run_at, deny_distinct, sample, TOKEN};
use egress_e2e::process::{bin, free_addr, write_config, ProxyProcess};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Runs the binary with `args`: (exit code, stdout, stderr).
fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin("egress-proxy")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `facts verify` of `store` with the public key and held checkpoints.
fn verify(store: &Path, key: &Path, held: &[&Path]) -> (i32, String) {
    let mut args = vec![
        "facts".to_owned(),
        "verify".into(),
        "--store".into(),
        store.display().to_string(),
        "--key".into(),
        key.display().to_string(),
    ];
    for h in held {
        args.push("--checkpoints".into());
        args.push(h.display().to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = cli(&args);
    (code, format!("{out}{err}"))
}

struct Cell {
    dir: tempfile::TempDir,
    cfg: PathBuf,
    addrs: (SocketAddr, SocketAddr),
    public: PathBuf,
}

impl Cell {
    fn new(extra: &str) -> Cell {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("signing.key");
        let (code, out, err) = cli(&[
            "audit",
            "keygen",
            "--name",
            "cell-a-audit",
            "--out",
            key.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the private key is the proxy's alone");
        let public = dir.path().join("signing.key.pub");
        assert_eq!(
            std::fs::read_to_string(&public).unwrap(),
            out,
            "the verifier key is printed and kept"
        );
        assert!(out.starts_with("cell-a-audit+"), "{out}");
        let again = cli(&["audit", "keygen", "--out", key.to_str().unwrap()]);
        assert_eq!(again.0, 2, "an existing key is never overwritten: {}", again.2);
        let addrs = (free_addr(), free_addr());
        let cfg = write_config(
            dir.path(),
            addrs.0,
            addrs.1,
            &format!(
                "{extra}\n[cell]\nid = \"cell-a\"\n[audit]\nsigning_key_file = \"signing.key\"\ncheckpoint_ms = 1000\n[tools.web]\negress = []\nmax_concurrent_fetches = 64\n"
            ),
        );
        Cell {
            dir,
            cfg,
            addrs,
            public,
        }
    }

    fn start(&self) -> ProxyProcess {
        ProxyProcess::start(&self.cfg, self.addrs.0, self.addrs.1, TOKEN, &[])
    }

    fn store(&self) -> PathBuf {
        self.dir.path().join("facts.db")
    }

    /// What a witness keeps: the newest checkpoint, from the API.
    async fn witness(&self, name: &str) -> PathBuf {
        let t0 = std::time::Instant::now();
        let r = loop {
            let r = control_call(self.addrs.1, "GET", "/v1/audit/checkpoint", None, Some(TOKEN)).await;
            if r.status != 404 || t0.elapsed() > Duration::from_secs(5) {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.header("content-type").unwrap().starts_with("text/plain"));
        let path = self.dir.path().join(name);
        std::fs::write(&path, r.body).unwrap();
        path
    }
}

/// `n` denials from `clients` keep-alive clients, each of its own run and
/// targets: how many were answered.
async fn flood(proxy: SocketAddr, control: SocketAddr, n: usize, clients: usize) -> usize {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (id, secret) = create_run_at(control, "web").await;
        let auth = basic(&id, &secret);
        let per = (n / clients) as u64;
        tasks.push(tokio::spawn(async move {
            deny_distinct(proxy, &auth, &format!("c{c}"), &AtomicBool::new(false), per).await
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap() as usize;
    }
    total
}

/// Runs SQL on `store` with the `sqlite3` command-line shell, as someone
/// with the file in hand would: its output.
fn sqlite3(store: &Path, q: &str) -> String {
    let out = Command::new("sqlite3")
        .arg(store)
        .arg(q)
        .output()
        .expect("the sqlite3 shell (apt-get install sqlite3)");
    assert!(out.status.success(), "{q}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sql(store: &Path, q: &str) {
    sqlite3(store, q);
}

fn count(store: &Path, q: &str) -> i64 {
    sqlite3(store, q).trim().parse().unwrap_or_else(|e| panic!("{q}: {e}"))
}

/// A copy of a closed store (its WAL folded in), to tamper with.
fn copy(store: &Path, to: &Path) -> PathBuf {
    let dst = to.join("copy.db");
    sql(store, &format!("VACUUM INTO '{}'", dst.display()));
    dst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_store_verifies_through_a_flood_a_kill_a_restart_and_pruning_and_each_tampering_is_named() {
    let cell = Cell::new("");
    let mut p = cell.start();
    let (proxy, control) = cell.addrs;

    // A flood of 100k denials, killed with SIGKILL before its end.
    let flooding = tokio::spawn(flood(proxy, control, 100_000, 32));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let live = cell.witness("live.note").await;
    let m = control_call(control, "GET", "/metrics", None, Some(TOKEN)).await.text();
    assert!(
        sample(&m, "egress_audit_signed_through_timestamp_seconds") > 1.7e9,
        "signed through now"
    );
    assert!(sample(&m, "egress_audit_checkpoints_total") >= 1.0);
    // Most of the flood first (a debug build answers a few thousand a second).
    let t0 = std::time::Instant::now();
    while count(
        &cell.store(),
        "SELECT COALESCE(SUM(json_extract(body, '$.count')), 0) FROM facts",
    ) < 80_000
    {
        assert!(t0.elapsed() < Duration::from_secs(240), "the flood is too slow");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(10));
    let answered = flooding.await.unwrap();
    assert!(answered >= 80_000, "{answered}");
    let (code, out) = verify(&cell.store(), &cell.public, &[&live]);
    assert_eq!(code, 0, "after SIGKILL: {out}");
    assert!(
        out.contains("chained but not yet signed") || out.contains("verified: no findings"),
        "{out}"
    );

    // Restarted on the same store: the chain goes on; stopped cleanly, a
    // closing checkpoint covers everything.
    let mut p = cell.start();
    assert_eq!(flood(proxy, control, 640, 32).await, 640);
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0));
    let (code, out) = verify(&cell.store(), &cell.public, &[&live]);
    assert_eq!(code, 0, "after restart: {out}");
    assert!(out.contains("verified: no findings"), "{out}");
    let rows = count(&cell.store(), "SELECT count(*) FROM facts");
    assert!(rows > 50_000, "{rows} fact rows");
    let closed = count(
        &cell.store(),
        "SELECT count(*) FROM checkpoints WHERE note LIKE '%' || char(10) || 'closed' || char(10) || '%'",
    );
    assert!(closed >= 1, "the clean stop signed a closing checkpoint");

    // Tampering, each on a copy of the store.
    let mid = rows / 2;
    let newest = count(&cell.store(), "SELECT MAX(seq) FROM facts");
    let cases: Vec<(String, String)> = vec![
        (
            format!("UPDATE facts SET body = replace(body, '\"not_allowlisted\"', '\"ip_literal\"') WHERE seq = {mid}"),
            format!("FINDING altered facts seq {mid}:"),
        ),
        (format!("DELETE FROM facts WHERE seq = {}", mid + 1), format!("FINDING missing facts seq {}:", mid + 1)),
        (
            format!("DELETE FROM facts WHERE seq > {}", newest - 3),
            format!("FINDING truncated facts: a checkpoint signed seq {newest}, the store ends at seq {}", newest - 3),
        ),
        (
            "UPDATE facts SET seq = -1 WHERE seq = 10; UPDATE facts SET seq = 10 WHERE seq = 20; UPDATE facts SET seq = 20 WHERE seq = -1;".to_owned(),
            "FINDING reordered facts seq 10: the record was chained at seq 20".to_owned(),
        ),
        (
            format!("INSERT INTO facts (seq, id, run_id, body) SELECT {0} + 1, 'forged', run_id, body FROM facts WHERE seq = {0}", newest),
            format!("FINDING unchained facts seq {}", newest + 1),
        ),
        (
            "UPDATE checkpoints SET note = substr(note, 1, length(note) - 6) || CASE substr(note, length(note) - 5, 1) WHEN 'A' THEN 'B' ELSE 'A' END || substr(note, length(note) - 4) WHERE seq = (SELECT MAX(seq) FROM checkpoints)".to_owned(),
            "FINDING bad_signature: checkpoint loom-egress/cell-a/".to_owned(),
        ),
    ];
    for (tamper, want) in &cases {
        let dir = tempfile::tempdir().unwrap();
        let copy = copy(&cell.store(), dir.path());
        assert_eq!(verify(&copy, &cell.public, &[]).0, 0);
        sql(&copy, tamper);
        let (code, out) = verify(&copy, &cell.public, &[]);
        assert_eq!(code, 1, "{tamper}: {out}");
        assert!(out.contains(want.as_str()), "{tamper}: want {want:?} in\n{out}");
    }

    // Retention prunes half: the older half is aged, then the proxy starts
    // with a one-hour retention and prunes it at once.
    sql(
        &cell.store(),
        &format!("UPDATE facts SET body = json_set(body, '$.at', '2001-01-01T00:00:00.000Z') WHERE seq <= {mid}"),
    );
    let text = std::fs::read_to_string(&cell.cfg).unwrap();
    std::fs::write(
        &cell.cfg,
        text.replace("[proxy]\n", "[proxy]\nfacts_retention_hours = 1\n"),
    )
    .unwrap();
    let mut p = cell.start();
    let t0 = std::time::Instant::now();
    while count(&cell.store(), "SELECT MIN(seq) FROM facts") <= mid {
        assert!(t0.elapsed() < Duration::from_secs(60), "retention did not prune");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0));
    let (code, out) = verify(&cell.store(), &cell.public, &[&live]);
    assert_eq!(code, 0, "after pruning: {out}");
    assert!(out.contains(&format!("chained after seq {mid} (pruned)")), "{out}");

    // The store replaced while its proxy was killed: the witness's
    // checkpoint of the old epoch was never closed.
    let mut p = cell.start();
    let before = cell.witness("before-replace.note").await;
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(10));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", cell.store().display()));
    }
    let mut p = cell.start();
    assert_eq!(flood(proxy, control, 32, 32).await, 32);
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0));
    let (code, out) = verify(&cell.store(), &cell.public, &[&before]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FINDING replaced: epoch "), "{out}");
    assert_eq!(
        verify(&cell.store(), &cell.public, &[]).0,
        0,
        "alone, the new store is sound"
    );
}

#[tokio::test]
async fn a_signing_key_others_may_read_is_refused_at_start_and_without_a_key_there_is_no_checkpoint() {
    let cell = Cell::new("");
    let key = cell.dir.path().join("signing.key");
    let public = std::fs::read_to_string(&cell.public).unwrap();
    let (code, out, err) = cli(&["check", "--config", cell.cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("verifier key {}", public.trim())), "{out}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (code, _, err) = cli(&["check", "--config", cell.cfg.to_str().unwrap()]);
    assert_eq!(code, 1, "check refuses the key too: {err}");
    assert!(err.contains("chmod 600"), "{err}");
    let out = Command::new(bin("egress-proxy"))
        .args(["serve", "--config"])
        .arg(&cell.cfg)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("mode 0640") && err.contains("chmod 600"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(dir.path(), proxy, control, "[tools.web]\negress = []\n");
    let _p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    let r = control_call(control, "GET", "/v1/audit/checkpoint", None, Some(TOKEN)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let m = control_call(control, "GET", "/metrics", None, Some(TOKEN)).await.text();
    assert_eq!(
        sample(&m, "egress_audit_signed_through_timestamp_seconds"),
        0.0,
        "no key: nothing signed"
    );
    assert!(r.text().contains("\"code\":\"no_checkpoint\""), "{}", r.text());
}

/// `signing_key_create`: the first start makes the key (0600, its verifier
/// beside it), signs with it, and a later start keeps it.
#[tokio::test]
async fn the_first_start_makes_the_key_when_asked_and_later_starts_keep_it() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, control) = (free_addr(), free_addr());
    let cfg = write_config(
        dir.path(),
        proxy,
        control,
        "[cell]\nid = \"cell-b\"\n[audit]\nsigning_key_file = \"keys/audit.key\"\nsigning_key_create = true\n[tools.web]\negress = []\n",
    );
    std::fs::create_dir(dir.path().join("keys")).unwrap();
    let key = dir.path().join("keys/audit.key");
    let mut p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    let public = std::fs::read_to_string(dir.path().join("keys/audit.key.pub")).unwrap();
    assert!(public.starts_with("cell-b+"), "{public}");
    assert!(p.logs().contains(public.trim()), "the verifier key is logged");
    let made = std::fs::read(&key).unwrap();
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(30)), Some(0));
    let _p = ProxyProcess::start(&cfg, proxy, control, TOKEN, &[]);
    assert_eq!(std::fs::read(&key).unwrap(), made, "an existing key is kept");
    let (code, out) = verify(
        &dir.path().join("facts.db"),
        &dir.path().join("keys/audit.key.pub"),
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("no checkpoint of this epoch verified"), "{out}");
}
