//! Starts the processes under test, each on loopback with an equivalent
//! policy: an origin (nginx, one process, or the Rust test origin when nginx
//! is missing), egress-proxy (per-run authentication, allowlist of the
//! origin), squid and tinyproxy (allow the origin only, no cache, no access
//! log). Every process is killed when its [`Daemon`] is dropped, and its pid
//! is appended to the `--pids` file so the calling script can clean up after
//! a crash.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A started process, killed on drop.
pub struct Daemon {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of the process's output, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Waits until `addr` accepts connections.
    fn wait_listening(&mut self, addr: SocketAddr) -> io::Result<()> {
        let t0 = Instant::now();
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "{} exited ({st}):\n{}",
                    self.name,
                    self.log_tail()
                )));
            }
            if t0.elapsed() > Duration::from_secs(20) {
                return Err(io::Error::other(format!(
                    "{} does not listen on {addr}:\n{}",
                    self.name,
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where processes are started and recorded.
pub struct Launcher {
    pub dir: PathBuf,
    pub pids: Option<PathBuf>,
}

impl Launcher {
    fn spawn(&self, name: &str, cmd: &mut Command) -> io::Result<Daemon> {
        let log = self.dir.join(format!("{name}.out"));
        let out = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .map_err(|e| io::Error::other(format!("{name}: {e}")))?;
        if let Some(p) = &self.pids {
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(p)?;
            writeln!(f, "{}", child.id())?;
        }
        Ok(Daemon {
            name: name.into(),
            child,
            log,
        })
    }

    /// A directory for one process, writable by the unprivileged users
    /// squid and tinyproxy switch to when started as root.
    pub fn subdir(&self, name: &str) -> io::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let d = self.dir.join(name);
        std::fs::create_dir_all(&d)?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777))?;
        Ok(d)
    }
}

/// An executable on `PATH` or in the system directories.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}

/// First line of a program's version output (some print it on stderr).
pub fn version(program: &Path, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .map(|o| {
            let text = [o.stdout, o.stderr].concat();
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// A free port on `ip` (bound, then released).
pub fn free_port(ip: [u8; 4]) -> io::Result<u16> {
    Ok(TcpListener::bind(SocketAddr::from((ip, 0)))?.local_addr()?.port())
}

/// The origin every path fetches from, at `127.0.0.2`.
pub struct Origin {
    pub addr: SocketAddr,
    pub kind: String,
    /// The 1 KiB response and the bulk response.
    pub small: String,
    pub bulk: String,
    pub _daemon: Option<Daemon>,
}

/// nginx as one process (`master_process off`), static files, keep-alive
/// without limits, no access log. It accepts every pending connection at
/// once from a deep backlog: new tunnels hand it connections that their
/// proxy closes again at once, and a full accept queue drops SYNs (a second
/// of stall for that client, counted as SYN retransmits in the report).
pub fn nginx(l: &Launcher, program: &Path, bulk_bytes: u64) -> io::Result<Origin> {
    let d = l.subdir("nginx")?;
    let www = d.join("www");
    std::fs::create_dir_all(&www)?;
    std::fs::write(www.join("1k"), vec![b'x'; 1024])?;
    // Sparse: bulk bytes cost no disk.
    std::fs::File::create(www.join("bulk"))?.set_len(bulk_bytes)?;
    let port = free_port([127, 0, 0, 2])?;
    let addr = SocketAddr::from(([127, 0, 0, 2], port));
    let dir = d.display();
    let conf = format!(
        "daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 200000;
pid {dir}/nginx.pid;
error_log {dir}/error.log crit;
events {{ worker_connections 50000; multi_accept on; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_timeout 3600s;
  keepalive_requests 1000000000;
  client_header_timeout 3600s;
  client_body_temp_path {dir}/tmp;
  proxy_temp_path {dir}/tmp;
  fastcgi_temp_path {dir}/tmp;
  uwsgi_temp_path {dir}/tmp;
  scgi_temp_path {dir}/tmp;
  default_type application/octet-stream;
  server {{
    listen {addr} backlog=4096;
    root {dir}/www;
  }}
}}
"
    );
    let path = d.join("nginx.conf");
    std::fs::write(&path, conf)?;
    let mut daemon = l.spawn(
        "nginx",
        Command::new(program)
            .arg("-p")
            .arg(&d)
            .arg("-e")
            .arg(d.join("error.log"))
            .arg("-c")
            .arg(&path),
    )?;
    daemon.wait_listening(addr)?;
    Ok(Origin {
        addr,
        kind: version(program, "-v"),
        small: "/1k".into(),
        bulk: "/bulk".into(),
        _daemon: Some(daemon),
    })
}

/// The Rust test origin (hyper) on a thread of its own, when nginx is missing.
pub fn rust_origin(bulk_bytes: u64) -> io::Result<Origin> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Ok(rt) = rt {
            rt.block_on(async move {
                let o = egress_e2e::origin::http_origin("127.0.0.2:0").await;
                let _ = tx.send(o.addr);
                std::future::pending::<()>().await;
            });
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| io::Error::other("the Rust origin did not start"))?;
    Ok(Origin {
        addr,
        kind: "Rust test origin (hyper, one thread)".into(),
        small: "/bytes?n=1024".into(),
        bulk: format!("/bytes?n={bulk_bytes}"),
        _daemon: None,
    })
}

/// A started egress-proxy: data listener, control listener, process.
pub struct Egress {
    pub addr: SocketAddr,
    pub control: SocketAddr,
    pub daemon: Daemon,
}

/// egress-proxy with durable SQLite facts, the tool `bench` allowed to
/// `origin.test:<port>` (resolved by the fake DNS at `dns`) and the tool
/// `web` allowed nothing (for denials). Limits are raised so that 10,000 idle
/// tunnels of one run fit; security stays on: every request authenticates.
/// The byte budget of the `budgeted` tool (the most the config takes,
/// 1 PiB): every carrier asks it, no benchmark reaches it.
pub const BUDGET_NEVER_REACHED: u64 = 1 << 50;

pub fn egress_proxy(
    l: &Launcher,
    program: &Path,
    dns: SocketAddr,
    origin_port: u16,
    token: &str,
) -> io::Result<Egress> {
    let tools = format!(
        "[tools.bench]
egress = [\"origin.test:{origin_port}\"]
fetch_timeout_ms = 3600000
max_concurrent_fetches = 65536
max_queued_fetches = 65536
[tools.budgeted]
egress = [\"origin.test:{origin_port}\"]
fetch_timeout_ms = 3600000
max_concurrent_fetches = 65536
max_queued_fetches = 65536
max_bytes_per_run = {BUDGET_NEVER_REACHED}
[tools.web]
egress = []
"
    );
    egress_proxy_in(l, program, "egress-proxy", dns, "", &tools, token)
}

/// An egress-proxy named `name` (its directory under the launcher's, its
/// log), with durable SQLite facts in that directory, the raised limits of
/// [`egress_proxy`], the fake DNS at `dns`, then `extra` (more `[proxy.*]`
/// tables) and `tools` (the `[tools.*]` tables).
pub fn egress_proxy_in(
    l: &Launcher,
    program: &Path,
    name: &str,
    dns: SocketAddr,
    extra: &str,
    tools: &str,
    token: &str,
) -> io::Result<Egress> {
    let d = l.subdir(name)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port([127, 0, 0, 1])?));
    let control = SocketAddr::from(([127, 0, 0, 1], free_port([127, 0, 0, 1])?));
    let conf = format!(
        "[proxy]
listen = \"{addr}\"
control = \"{control}\"
facts = \"{facts}\"
allow_ranges = [\"127.0.0.2/32\"]
max_connections = 100000
max_pending_connections = 4096
max_connections_per_run = 100000
tunnel_idle_timeout_ms = 3600000
[proxy.dns]
servers = [\"{dns}\"]
{extra}{tools}",
        facts = d.join("facts.db").display()
    );
    let path = d.join("egress.toml");
    std::fs::write(&path, conf)?;
    let mut daemon = l.spawn(
        name,
        crate::callgrind::wrap(name, program)
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .env("EGRESS_CONTROL_TOKEN", token)
            .env("EGRESS_LOG", "warn"),
    )?;
    daemon.wait_listening(control)?;
    daemon.wait_listening(addr)?;
    Ok(Egress { addr, control, daemon })
}

/// squid in the foreground (`-N`, one process): only the origin's address and
/// port allowed, no cache, no access log, names from a hosts file (the client
/// addresses included, so squid never asks a resolver about them).
pub fn squid(l: &Launcher, program: &Path, origin: SocketAddr) -> io::Result<(Daemon, SocketAddr)> {
    let d = l.subdir("squid")?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port([127, 0, 0, 1])?));
    let mut hosts = String::from("127.0.0.1 localhost\n127.0.0.2 origin.test\n");
    for i in 1..=254 {
        hosts.push_str(&format!("127.1.0.{i} client{i}.test\n"));
    }
    std::fs::write(d.join("hosts"), hosts)?;
    let dir = d.display();
    let conf = format!(
        "http_port {addr}
acl clients src 127.0.0.0/8
acl origin dst {oip}/32
acl origin_port port {oport}
http_access allow clients origin origin_port
http_access deny all
cache deny all
cache_mem 0 MB
access_log none
cache_store_log none
cache_log {dir}/cache.log
debug_options ALL,1
logfile_rotate 0
pid_filename {dir}/squid.pid
coredump_dir {dir}
hosts_file {dir}/hosts
dns_nameservers 127.0.0.1
visible_hostname bench.test
pinger_enable off
client_db off
via off
forwarded_for transparent
max_filedescriptors 200000
read_timeout 60 minutes
client_lifetime 1 day
shutdown_lifetime 0 seconds
",
        oip = origin.ip(),
        oport = origin.port()
    );
    let path = d.join("squid.conf");
    std::fs::write(&path, conf)?;
    let mut daemon = l.spawn("squid", Command::new(program).arg("-N").arg("-f").arg(&path))?;
    daemon.wait_listening(addr)?;
    Ok((daemon, addr))
}

/// tinyproxy in the foreground (`-d`): only the origin allowed (a
/// default-deny filter and `ConnectPort`), no access log.
pub fn tinyproxy(l: &Launcher, program: &Path, origin: SocketAddr) -> io::Result<(Daemon, SocketAddr)> {
    let d = l.subdir("tinyproxy")?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port([127, 0, 0, 1])?));
    let filter = d.join("filter");
    std::fs::write(&filter, format!("^{}$\n", origin.ip().to_string().replace('.', "\\.")))?;
    let root = is_root();
    let conf = format!(
        "{user}Port {port}
Listen 127.0.0.1
Timeout 3600
MaxClients 30000
Allow 127.0.0.0/8
LogLevel Critical
ConnectPort {oport}
Filter \"{filter}\"
FilterDefaultDeny Yes
DisableViaHeader Yes
",
        user = if root { "User nobody\nGroup nogroup\n" } else { "" },
        port = addr.port(),
        oport = origin.port(),
        filter = filter.display()
    );
    let path = d.join("tinyproxy.conf");
    std::fs::write(&path, conf)?;
    let mut daemon = l.spawn("tinyproxy", Command::new(program).arg("-d").arg("-c").arg(&path))?;
    daemon.wait_listening(addr)?;
    Ok((daemon, addr))
}

/// The bare relay (`src/bin/bare-relay.rs`), the floor of the tunnel
/// figures; `program` is the binary beside this one.
pub fn bare_relay(l: &Launcher, program: &Path, _origin: SocketAddr) -> io::Result<(Daemon, SocketAddr)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port([127, 0, 0, 1])?));
    let mut daemon = l.spawn("bare-relay", Command::new(program).arg(addr.to_string()))?;
    daemon.wait_listening(addr)?;
    Ok((daemon, addr))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
