//! A throwaway PostgreSQL 15 for the fleet tests and transparent egress's
//! `psql` client: `initdb` in a temp dir as the `postgres` user, the server on a loopback port of the OS's choice
//! (unix socket in the same dir), queried with `psql`. Needs root (to run
//! as `postgres`) and Debian's `postgresql` package; [`Postgres::start`]
//! says loudly why it skips otherwise. [`Postgres::start_in`] runs it in a
//! network namespace of a [`crate::fleet_net::FleetNet`] instead, where
//! `psql` reaches it from inside that namespace too.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::executor::is_root;
use crate::fleet_net::within;

const BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct Postgres {
    dir: tempfile::TempDir,
    pub port: u16,
    running: bool,
    /// The namespace it runs in (`None`: the test's own).
    netns: Option<String>,
    /// Its address there (the DSN's `host`).
    host: String,
}

impl Postgres {
    /// A fresh cluster, started; `None` (and a loud message) when this
    /// machine cannot run one.
    pub fn start() -> Option<Postgres> {
        Self::start_in(None, "127.0.0.1")
    }

    /// Like [`Postgres::start`], in network namespace `netns` listening on
    /// `host` there (and on its loopback), trusting every client.
    pub fn start_in(netns: Option<&str>, host: &str) -> Option<Postgres> {
        if !is_root() {
            eprintln!("SKIPPED: a throwaway PostgreSQL needs root (to run initdb as `postgres`)");
            return None;
        }
        if !Path::new(BIN).join("initdb").exists() {
            eprintln!("SKIPPED: PostgreSQL 15 is not installed ({BIN}); .ci/run installs `postgresql`");
            return None;
        }
        let dir = tempfile::Builder::new().prefix("loom-pg").tempdir().unwrap();
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(ok.success());
        let data = dir.path().join("data");
        let mut pg = Postgres {
            port: crate::process::free_port(),
            dir,
            running: false,
            netns: netns.map(str::to_owned),
            host: host.to_owned(),
        };
        let out = pg
            .as_postgres("initdb")
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
        if host != "127.0.0.1" {
            let hba = data.join("pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).unwrap();
            text.push_str("host all all 0.0.0.0/0 trust\n");
            std::fs::write(&hba, text).unwrap();
        }
        pg.resume();
        Some(pg)
    }

    /// PostgreSQL's own client.
    pub fn psql_program() -> PathBuf {
        Path::new(BIN).join("psql")
    }

    /// `program` of PostgreSQL's, as `postgres`, in its namespace.
    fn as_postgres(&self, program: &str) -> Command {
        let mut c = within(self.netns.as_deref(), Path::new("runuser"));
        c.args(["-u", "postgres", "--"]).arg(Path::new(BIN).join(program));
        c.current_dir(self.dir.path());
        c
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The DSN the exporter is given.
    pub fn dsn(&self) -> String {
        format!(
            "host={} port={} user=postgres dbname=postgres sslmode=disable",
            self.host, self.port
        )
    }

    /// Starts the server (again, on the same port and data) and waits
    /// until it answers.
    pub fn resume(&mut self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses={} -c fsync=off -c max_connections=50",
            self.port,
            self.dir.path().display(),
            if self.host == "127.0.0.1" {
                "127.0.0.1".to_owned()
            } else {
                format!("'127.0.0.1,{}'", self.host)
            }
        );
        let out = self
            .as_postgres("pg_ctl")
            .args(["start", "-w", "-t", "30", "-D"])
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("server.log"))
            .args(["-o", &opts])
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        self.running = true;
        let t0 = Instant::now();
        while self.try_query("SELECT 1").is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "PostgreSQL does not answer: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (`mode`: `fast` or `immediate`), keeping its data.
    fn halt(&mut self, mode: &str) {
        if !std::mem::replace(&mut self.running, false) {
            return;
        }
        let _ = self
            .as_postgres("pg_ctl")
            .args(["stop", "-w", "-m", mode, "-D"])
            .arg(self.data())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    /// Stops the server at once (fast shutdown), keeping its data.
    pub fn stop(&mut self) {
        self.halt("fast");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// `psql` running `sql`, unaligned, tuples only, stopping at the first error.
    fn psql(&self, sql: &str) -> std::io::Result<std::process::Output> {
        within(self.netns.as_deref(), &Path::new(BIN).join("psql"))
            .args([
                "-X",
                "-A",
                "-t",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &self.dsn(),
                "-c",
                sql,
            ])
            .output()
    }

    fn try_query(&self, sql: &str) -> Option<String> {
        let out = self.psql(sql).ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `sql`'s rows, one a line, columns joined by `|`.
    pub fn query(&self, sql: &str) -> String {
        let out = self.psql(sql).unwrap();
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Runs `sql` in the background (e.g. a transaction that holds a lock
    /// for a while); wait on the child for its end.
    pub fn spawn(&self, sql: &str) -> std::process::Child {
        within(self.netns.as_deref(), &Path::new(BIN).join("psql"))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &self.dsn(), "-c", sql])
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// `sql`'s single number.
    pub fn number(&self, sql: &str) -> i64 {
        let v = self.query(sql);
        v.parse().unwrap_or_else(|_| panic!("{sql}: not a number: {v:?}"))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.halt("immediate");
    }
}
