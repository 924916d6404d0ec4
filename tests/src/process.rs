//! Runs the real `egress-proxy` binary for tests that need a process: crash
//! durability (`kill -9`), signals (SIGHUP reload, SIGTERM drain), the CLI.
//! The binary is the one cargo built beside the test executable.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository's root (the workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_path_buf()
}

/// Path of a workspace binary built by cargo for this test run.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built; run `cargo build -p egress-proxy` (cargo test --workspace builds it)",
        p.display()
    );
    p
}

/// The release `egress-proxy` beside a release example (`target/release/examples/x`).
pub fn release_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("executable");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join("egress-proxy");
    assert!(
        p.exists(),
        "build it first: cargo build --release -p egress-proxy --bin egress-proxy"
    );
    p
}

/// `[seconds] [clients]` from a benchmark's command line.
pub fn bench_args(default_clients: usize) -> (u64, usize) {
    let args: Vec<String> = std::env::args().collect();
    let secs = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(5);
    let clients = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(default_clients);
    (secs, clients)
}

/// A free loopback socket address (bound, then released).
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A free loopback port (bound, then released), for a process that binds it
/// later. It is taken below the kernel's ephemeral range when there is room
/// (from 10000): a port from `bind(:0)` is an ephemeral one, which any
/// outgoing connection of a concurrent test may take before the process
/// binds it (`Address already in use`); ports below the range are never
/// handed out that way. The start is spread by pid and time so that
/// concurrent test processes do not walk the same sequence.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(0);
    if low > 12000 {
        let span = low - 10000;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let seed = std::process::id().wrapping_mul(7919) ^ nanos;
        for _ in 0..200 {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let port = 10000 + (seed.wrapping_add(n.wrapping_mul(104_729))) % span;
            if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes `egress.toml` in `dir` for a proxy on `proxy`/`control` with its
/// SQLite store `facts.db` beside it, plus `rest` (more `[proxy]` keys and
/// `[tools.*]` tables); returns the file's path.
pub fn write_config(dir: &Path, proxy: SocketAddr, control: SocketAddr, rest: &str) -> PathBuf {
    let cfg = dir.join("egress.toml");
    let text = format!("[proxy]\nlisten = \"{proxy}\"\ncontrol = \"{control}\"\nfacts = \"facts.db\"\n{rest}");
    std::fs::write(&cfg, text).expect("write the test config");
    cfg
}

/// A child process killed and reaped on drop.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program` with `args` as systemd socket activation would: one
/// listening TCP socket on 127.0.0.1 per name in `names`, passed as fds 3,
/// 4, … with `LISTEN_PID` (the program's own pid), `LISTEN_FDS` and
/// `LISTEN_FDNAMES`. A small Python launcher binds the sockets, reports
/// their ports and `exec`s the program in its own process. Returns the
/// child and each name's address.
pub fn socket_activated(
    names: &[&str],
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    log: &Path,
) -> (Child, std::collections::BTreeMap<String, SocketAddr>) {
    const LAUNCHER: &str = r#"
import fcntl, os, socket, sys
names = sys.argv[1].split(":")
socks = []
for n in names:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    socks.append(s)
    print(n, s.getsockname()[1], flush=True)
high = [fcntl.fcntl(s.fileno(), fcntl.F_DUPFD, 100) for s in socks]
for s in socks:
    s.close()
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(names)), LISTEN_FDNAMES=sys.argv[1])
os.execv(sys.argv[2], sys.argv[2:])
"#;
    let out = std::fs::File::create(log).unwrap();
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(LAUNCHER)
        .arg(names.join(":"))
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(out))
        .spawn()
        .expect("python3 starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let mut addrs = std::collections::BTreeMap::new();
    for _ in names {
        let line = lines.next().and_then(Result::ok).expect("the launcher reports a port");
        let (name, port) = line.split_once(' ').expect("name port");
        addrs.insert(
            name.to_owned(),
            SocketAddr::from(([127, 0, 0, 1], port.parse::<u16>().unwrap())),
        );
    }
    // The program's own output is not read; keep the pipe open meanwhile.
    std::thread::spawn(move || for _ in lines {});
    (child, addrs)
}

/// Starts `cmd` (its stderr piped) and waits for the first log line that
/// reports `key` as a socket address, in text (`key=ADDR`) or JSON
/// (`"key":"ADDR"`) logs; other lines go to this test's stderr.
pub fn spawn_reporting(cmd: &mut Command, key: &str) -> (Child, SocketAddr) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the service starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let (text, json) = (format!("{key}="), format!("\"{key}\":\""));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut sent = false;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if sent {
                continue;
            }
            let found = [&text, &json].into_iter().find_map(|k| {
                let rest = line.split(k.as_str()).nth(1)?;
                let addr: String = rest.chars().take_while(|c| !c.is_whitespace() && *c != '"').collect();
                addr.parse::<SocketAddr>().ok()
            });
            match found {
                Some(a) => {
                    let _ = tx.send(a);
                    sent = true;
                }
                None => eprintln!("service: {line}"),
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the service did not report its {key} address"));
    (child, addr)
}

pub struct ProxyProcess {
    pub child: Child,
    pub proxy: SocketAddr,
    pub control: SocketAddr,
    pub log: PathBuf,
}

impl ProxyProcess {
    /// Starts `egress-proxy serve --config <path>` and waits until `/healthz` answers.
    pub fn start(
        config: &Path,
        proxy: SocketAddr,
        control: SocketAddr,
        token: &str,
        extra_args: &[&str],
    ) -> ProxyProcess {
        Self::start_with_bin(&bin("egress-proxy"), config, proxy, control, token, extra_args)
    }

    /// Like [`ProxyProcess::start`] with a given binary (e.g. the release build).
    pub fn start_with_bin(
        binary: &Path,
        config: &Path,
        proxy: SocketAddr,
        control: SocketAddr,
        token: &str,
        extra_args: &[&str],
    ) -> ProxyProcess {
        Self::start_with_env(binary, config, (proxy, control), token, extra_args, &[])
    }

    /// Like [`ProxyProcess::start_with_bin`], with variables added to the
    /// proxy's environment (never to the test's own).
    pub fn start_with_env(
        binary: &Path,
        config: &Path,
        (proxy, control): (SocketAddr, SocketAddr),
        token: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> ProxyProcess {
        Self::start_within(None, binary, config, (proxy, control), token, extra_args, env)
    }

    /// Like [`ProxyProcess::start_with_env`], inside network namespace
    /// `netns` (see [`crate::fleet_net`]); `None` is the test's own.
    pub fn start_within(
        netns: Option<&str>,
        binary: &Path,
        config: &Path,
        (proxy, control): (SocketAddr, SocketAddr),
        token: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> ProxyProcess {
        let log = config.with_extension("log");
        let out = std::fs::File::create(&log).unwrap();
        let child = crate::fleet_net::within(netns, binary)
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(extra_args)
            .env("EGRESS_CONTROL_TOKEN", token)
            .env(
                "EGRESS_LOG",
                std::env::var("EGRESS_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        let p = ProxyProcess {
            child,
            proxy,
            control,
            log,
        };
        p.wait_healthy();
        p
    }

    pub fn wait_healthy(&self) {
        let t0 = Instant::now();
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(self.control) {
                use std::io::{Read, Write};
                let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: c\r\nConnection: close\r\n\r\n");
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                if buf.starts_with("HTTP/1.1 200") {
                    return;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "proxy did not become healthy: {}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for exit; returns the exit code (None if killed by a signal).
    pub fn wait_exit(&mut self, cap: Duration) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(t0.elapsed() < cap, "proxy did not exit within {cap:?}: {}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// User+system CPU time of process `pid` so far (`/proc/<pid>/stat`, in
/// the kernel's USER_HZ = 100 ticks).
pub fn cpu_time(pid: u32) -> std::time::Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rfind(')').map_or("", |i| &stat[i + 2..]);
    let f: Vec<&str> = rest.split(' ').collect();
    // Fields 14 and 15 of stat(5); `rest` starts at field 3.
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    std::time::Duration::from_millis((field(11) + field(12)) * 10)
}

/// Resident set size of process `pid` in bytes (`VmRSS` in `/proc/<pid>/status`).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// What a client process printed, and how it ended.
pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    /// The JSON lines it printed (others skipped).
    pub fn lines(&self) -> Vec<serde_json::Value> {
        self.stdout
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// Runs a client with a run's `env` map only (plus `PATH`, `HOME`), as the
/// executor would give it to a child.
pub async fn client(env: &std::collections::BTreeMap<String, String>, program: &str, args: &[&str]) -> Ran {
    let mut cmd = Command::new(program);
    cmd.args(args).env_clear().envs(env);
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    if let Ok(home) = std::env::var("HOME") {
        cmd.env("HOME", home);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Whether `python3` imports `modules` (comma-separated); if not, says which
/// test skips and what installs them (`.ci/run` does).
pub fn python_has(modules: &str, install: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP: python3 cannot import {modules} ({install})");
    }
    ok
}

/// `egress-proxy check --config F` on `text` written to a temporary file:
/// whether it exited 0, its stdout and stderr.
pub fn proxy_check(text: &str) -> (bool, String, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cfg = dir.path().join("egress.toml");
    std::fs::write(&cfg, text).expect("write the config");
    let out = Command::new(bin("egress-proxy"))
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .expect("egress-proxy runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Starts `script` (under the repository root) with `python3` and `args`,
/// and reads the JSON line it prints first (its ports); its later output
/// is drained. Panics if it does not start or report.
pub fn python_server(script: &str, args: &[&std::ffi::OsStr]) -> (Child, serde_json::Value) {
    use std::io::BufRead as _;
    let mut child = Command::new("python3")
        .arg(repo_root().join(script))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = std::io::BufReader::new(stdout).lines();
    let line = lines
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("{script} reports its ports"));
    std::thread::spawn(move || for _ in lines {});
    let v = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{script}: {e}: {line}"));
    (child, v)
}
