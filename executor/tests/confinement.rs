//! The confinement acceptance suite. A deliberately malicious tool — this
//! test binary itself (Rust), and `fixtures/malicious_tool.py` (Python) —
//! tries, in one invocation, every escape we know of: reading secrets,
//! appending to the facts database, connecting around the proxy (canary on
//! the host loopback, the proxy's control port, the executor's API, a UDP
//! "DNS" listener), reaching host-side unix sockets (world-writable ones in
//! /tmp and /run, an abstract one, a datagram one through unbound sockets and
//! re-targeted socketpairs; sockets among its inherited fds), fetching denied
//! targets through the proxy, using another
//! run's credential, writing outside its scratch dir, raw sockets, io_uring,
//! ptrace, a fork bomb, a memory hog, and a grandchild that outlives a
//! timeout. Each attempt's outcome is an emit. Under `strict` every attempt
//! fails and the failures are visible: emits, the proxy's facts, counters on
//! the host-side listeners, and no process left. Under `off` the same tool
//! shows which attempts the confinement is what stops.
//!
//! Started with `LOOM_IPC_FDS` set this binary is the Rust tool; otherwise it
//! runs the tests (hence `harness = false`). Needs root (namespaces, uid
//! switch, cgroups); skips loudly otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::harness::TOKEN;
use egress_e2e::harness::{basic, TestProxy};
use egress_e2e::origin::{canary, http_origin};
use egress_e2e::unix_canary::UnixCanary;
use egress_e2e::FakeDns;
use egress_executor::confine::{plan::Confinement, Layer};
use egress_executor::{Config, ErrorKind, InvocationRequest};
use serde_json::{json, Value};

type TestFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;
type Case = (&'static str, fn() -> TestFuture);

fn main() {
    if std::env::var_os("LOOM_IPC_FDS").is_some() {
        let r = egress_tool::serve(|| Ok(()), |(), inv, emit| attack(&inv.input, emit));
        std::process::exit(i32::from(r.is_err()));
    }
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut passed = 0;
    let tests: &[Case] = &[
        ("rust_tool_is_contained_under_strict", || {
            Box::pin(suite(Fixture::Rust, "strict", Mode::Default))
        }),
        ("python_tool_is_contained_under_strict", || {
            Box::pin(suite(Fixture::Python, "strict", Mode::ProxyKey))
        }),
        (
            "python_tool_forked_by_its_fork_server_is_contained_under_strict",
            || Box::pin(suite(Fixture::PythonForked, "strict", Mode::Default)),
        ),
        ("rust_tool_under_strict_relays_only_with_allow_relay", || {
            Box::pin(suite(Fixture::Rust, "strict", Mode::Relay))
        }),
        ("rust_tool_escapes_under_off", || {
            Box::pin(suite(Fixture::Rust, "off", Mode::Default))
        }),
        ("python_tool_escapes_under_off", || {
            Box::pin(suite(Fixture::Python, "off", Mode::Default))
        }),
        ("network_namespace_alone_stops_direct_connections", || {
            Box::pin(layer_alone(
                &[Layer::Netns],
                &[
                    "connect_canary",
                    "connect_proxy_control",
                    "connect_executor_api",
                    "udp_dns",
                    "unix_abstract",
                ],
                // A network namespace does not cover the filesystem.
                &["read_passwd", "io_uring_setup", "write_outside", "unix_tmp"],
            ))
        }),
        ("landlock_alone_stops_reads_writes_and_connects", || {
            Box::pin(layer_alone(
                &[Layer::Landlock],
                &[
                    "read_passwd",
                    "read_config",
                    "read_token",
                    "append_facts",
                    "write_outside",
                    "connect_canary",
                ],
                // Landlock does not mediate connect(2) to a socket file.
                &["io_uring_setup", "udp_dns", "fork_bomb", "unix_tmp"],
            ))
        }),
        ("seccomp_alone_stops_the_denied_calls", || {
            Box::pin(layer_alone(
                &[Layer::Seccomp],
                &[
                    "io_uring_setup",
                    "ptrace",
                    "unshare_user",
                    "raw_socket",
                    "packet_socket",
                    "unix_tmp",
                    "unix_run",
                    "unix_abstract",
                    "unix_dgram_sendto",
                    "unix_pair_sendto",
                    "unix_pair_connect",
                    "unix_pair_raw_sendto",
                ],
                &["read_passwd", "connect_canary"],
            ))
        }),
        ("identity_alone_drops_root", || {
            Box::pin(layer_alone(
                &[Layer::Identity],
                &["read_token", "append_facts", "raw_socket"],
                // A world-writable socket file admits any uid.
                &["read_passwd", "connect_canary", "unix_tmp"],
            ))
        }),
        ("cgroup_alone_bounds_pids_and_memory", || {
            Box::pin(layer_alone(
                &[Layer::Cgroup],
                &["fork_bomb", "memory_hog"],
                &["read_passwd", "io_uring_setup"],
            ))
        }),
        ("run_command_applies_the_tools_isolation", || Box::pin(run_command())),
        ("cpu_percent_caps_the_childs_cpu", || Box::pin(cpu_cap())),
        (
            "a_failed_hand_off_fails_the_start_loudly",
            || Box::pin(failed_handoff()),
        ),
        ("strict_refuses_to_start_without_the_binding_unless_allow_relay", || {
            Box::pin(refuses_without_binding())
        }),
        ("an_executor_started_before_the_proxy_waits_and_then_binds", || {
            Box::pin(started_before_the_proxy())
        }),
        (
            "handed_off_listeners_are_bound_to_their_run_and_closed_at_its_end",
            || Box::pin(handoff_protocol()),
        ),
        ("a_confined_childs_run_is_created_bound_to_its_listener", || {
            Box::pin(created_bound())
        }),
        (
            "a_strict_childs_credential_copied_out_is_refused_outside_its_sandbox",
            || Box::pin(copied_out()),
        ),
        (
            "a_tool_directory_the_child_cannot_enter_is_a_clear_startup_error",
            || Box::pin(private_tool_dir()),
        ),
        ("unprivileged_executor_enforces_what_user_namespaces_give", || {
            Box::pin(unprivileged())
        }),
        ("runners_fetch_through_the_proxy_under_strict", || {
            Box::pin(runners_fetch())
        }),
        ("runtimes_keep_their_own_pipes_under_strict", || {
            Box::pin(runtime_pipes())
        }),
        (
            "forked_children_have_nothing_of_the_server_or_each_other_and_outlive_it",
            || Box::pin(forked_children()),
        ),
    ];
    for (name, t) in tests {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        eprintln!("test {name} ...");
        rt.block_on(t());
        eprintln!("test {name} ... ok");
        passed += 1;
    }
    println!("confinement: {passed} passed, 0 failed");
}

// ---------------------------------------------------------------- the tool

/// One attempt's outcome.
fn outcome(emit: &mut dyn FnMut(Value) -> std::io::Result<()>, attempt: &str, ok: bool, detail: String) {
    let _ = emit(json!({"attempt": attempt, "ok": ok, "detail": detail}));
}

fn s(v: &Value, k: &str) -> String {
    v[k].as_str().unwrap_or_default().to_string()
}

/// A request through the proxy named by `HTTP_PROXY`, with `cred`
/// (`id:secret`, default: ours). Returns (status, deny reason).
fn via_proxy(url: &str, cred: Option<&str>) -> Result<(u16, String), String> {
    let proxy = std::env::var("HTTP_PROXY").map_err(|e| e.to_string())?;
    let rest = proxy.trim_start_matches("http://");
    let (own, addr) = rest.rsplit_once('@').ok_or("no credential in HTTP_PROXY")?;
    let cred = cred.unwrap_or(own);
    let (id, secret) = cred.split_once(':').ok_or("bad credential")?;
    let addr: SocketAddr = addr.trim_end_matches('/').parse().map_err(|e| format!("{e}"))?;
    let host = url.trim_start_matches("http://").split('/').next().unwrap_or("");
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let req = format!(
        "GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
        basic(id, secret)
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {text:?}"))?;
    let reason = text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-egress-deny-reason")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    Ok((status, reason))
}

fn attack(input: &Value, emit: &mut dyn FnMut(Value) -> std::io::Result<()>) -> Result<Value, String> {
    // Before anything of ours is open: sockets among the inherited fds.
    let socks: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.display().to_string())
        .filter(|l| l.starts_with("socket:"))
        .collect();
    outcome(emit, "inherited_socket", !socks.is_empty(), format!("{socks:?}"));
    for (attempt, key) in [
        ("read_passwd", "passwd"),
        ("read_config", "config"),
        ("read_token", "token"),
    ] {
        let r = std::fs::read(s(input, key));
        outcome(emit, attempt, r.is_ok(), format!("{:?}", r.map(|b| b.len())));
    }
    let r = std::fs::OpenOptions::new().append(true).open(s(input, "facts"));
    outcome(emit, "append_facts", r.is_ok(), format!("{:?}", r.map(|_| ())));

    for (attempt, key) in [
        ("connect_canary", "canary"),
        ("connect_proxy_control", "control"),
        ("connect_executor_api", "executor_api"),
    ] {
        let addr: SocketAddr = s(input, key).parse().unwrap();
        let r = TcpStream::connect_timeout(&addr, Duration::from_secs(2));
        outcome(emit, attempt, r.is_ok(), format!("{:?}", r.map(|_| ())));
    }
    // A DNS query to a host-side listener: out if the send works and no
    // "port unreachable" comes back (the listener stays silent).
    let dns: SocketAddr = s(input, "dns").parse().unwrap();
    let r = UdpSocket::bind("0.0.0.0:0").and_then(|u| {
        u.connect(dns)?;
        u.send(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01")?;
        u.set_read_timeout(Some(Duration::from_millis(300)))?;
        let mut b = [0u8; 512];
        match u.recv(&mut b) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(()),
            Err(e) => Err(e),
        }
    });
    outcome(emit, "udp_dns", r.is_ok(), format!("{r:?}"));
    unix_attack(input, emit);

    for (attempt, key) in [
        ("fetch_unlisted", "unlisted"),
        ("fetch_ip_literal", "ip_literal"),
        ("fetch_private_name", "private_name"),
    ] {
        let r = via_proxy(&s(input, key), None);
        outcome(emit, attempt, matches!(r, Ok((200, _))), format!("{r:?}"));
    }
    let r = via_proxy(&s(input, "allowed"), Some(&s(input, "stolen")));
    outcome(emit, "stolen_credential", matches!(r, Ok((200, _))), format!("{r:?}"));

    let r = std::fs::write(s(input, "outside"), b"escaped");
    outcome(emit, "write_outside", r.is_ok(), format!("{r:?}"));
    let scratch = std::env::var("TMPDIR").unwrap_or_default();
    let r = std::fs::write(Path::new(&scratch).join("mine"), b"fine");
    let _ = emit(json!({"scratch_write": r.is_ok()}));

    // SAFETY (all below): raw system calls on valid arguments; this process
    // is the single-threaded tool and the forked children only make
    // async-signal-safe calls before _exit.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP);
        let e = std::io::Error::last_os_error();
        outcome(emit, "raw_socket", fd >= 0, format!("{fd} {e}"));
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, 0);
        let e = std::io::Error::last_os_error();
        outcome(emit, "packet_socket", fd >= 0, format!("{fd} {e}"));

        let mut params = [0u8; 120];
        let fd = libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr());
        let e = std::io::Error::last_os_error();
        outcome(emit, "io_uring_setup", fd >= 0, format!("{fd} {e}"));
        // ptrace(PTRACE_ATTACH) on a child of ours (TRACEME would stop us
        // at our next signal, traced by the executor).
        let victim = libc::fork();
        if victim == 0 {
            libc::pause();
            libc::_exit(0);
        }
        let r = libc::syscall(libc::SYS_ptrace, libc::PTRACE_ATTACH, victim, 0, 0);
        let e = std::io::Error::last_os_error();
        outcome(emit, "ptrace", r == 0, format!("{r} {e}"));
        libc::kill(victim, libc::SIGKILL);
        libc::waitpid(victim, std::ptr::null_mut(), 0);
        let r = libc::unshare(libc::CLONE_NEWUSER);
        let e = std::io::Error::last_os_error();
        outcome(emit, "unshare_user", r == 0, format!("{r} {e}"));

        // Fork bomb, bounded at `pids` children.
        let want = input["pids"].as_u64().unwrap_or(100) as usize;
        let mut kids = Vec::new();
        let mut err = String::new();
        for _ in 0..want {
            let pid = libc::fork();
            if pid == 0 {
                libc::pause();
                libc::_exit(0);
            }
            if pid < 0 {
                err = std::io::Error::last_os_error().to_string();
                break;
            }
            kids.push(pid);
        }
        let forked = kids.len();
        for pid in kids {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        outcome(
            emit,
            "fork_bomb",
            forked == want,
            format!("{forked} of {want} forks; {err}"),
        );
        let _ = emit(json!({"forked": forked}));

        // Memory hog in a child: touch `memory_mb` MiB, then exit 0.
        let mb = input["memory_mb"].as_u64().unwrap_or(256) as usize;
        let pid = libc::fork();
        if pid == 0 {
            let len = mb << 20;
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                libc::_exit(2);
            }
            let mut i = 0;
            while i < len {
                *(p as *mut u8).add(i) = 1;
                i += 4096;
            }
            libc::_exit(0);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        outcome(emit, "memory_hog", ok, format!("wait status {status:#x}"));

        // A grandchild that sleeps forever; then outlive the timeout.
        if libc::fork() == 0 {
            libc::setsid();
            loop {
                libc::pause();
            }
        }
    }
    let _ = emit(json!({"attempt": "done"}));
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// Every way we know to a host-side unix socket: connect to a path in /tmp
/// and in /run and to an abstract name; a datagram to a host socket from an
/// unbound socket and from socketpairs (a datagram pair can be re-targeted
/// with `sendto` or `connect`; `SOCK_RAW` is a datagram pair for AF_UNIX);
/// `open()` of a socket path.
fn unix_attack(input: &Value, emit: &mut dyn FnMut(Value) -> std::io::Result<()>) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram, UnixStream};
    // Connected is reached (the host side counts it and hangs up at once).
    for attempt in ["unix_tmp", "unix_run"] {
        let r = UnixStream::connect(s(input, attempt)).map(|_| ());
        outcome(emit, attempt, r.is_ok(), format!("{r:?}"));
    }
    let r = UnixAddr::from_abstract_name(s(input, "unix_abstract").as_bytes())
        .and_then(|a| UnixStream::connect_addr(&a))
        .map(|_| ());
    outcome(emit, "unix_abstract", r.is_ok(), format!("{r:?}"));
    let dgram = s(input, "unix_dgram");
    let r = UnixDatagram::unbound().and_then(|d| d.send_to(b"x", &dgram));
    outcome(emit, "unix_dgram_sendto", r.is_ok(), format!("{r:?}"));
    let r = UnixDatagram::pair().and_then(|(a, _b)| a.send_to(b"x", &dgram));
    outcome(emit, "unix_pair_sendto", r.is_ok(), format!("{r:?}"));
    let r = UnixDatagram::pair().and_then(|(a, _b)| {
        a.connect(&dgram)?;
        a.send(b"x")
    });
    outcome(emit, "unix_pair_connect", r.is_ok(), format!("{r:?}"));
    // SAFETY: socketpair into a local array, sendto with a sockaddr_un built
    // here; both fds are closed before returning.
    let r = unsafe {
        let mut fds = [-1; 2];
        if libc::socketpair(libc::AF_UNIX, libc::SOCK_RAW, 0, fds.as_mut_ptr()) != 0 {
            Err(std::io::Error::last_os_error())
        } else {
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (d, b) in addr.sun_path.iter_mut().zip(dgram.as_bytes()) {
                *d = *b as libc::c_char;
            }
            let n = libc::sendto(
                fds[0],
                b"x".as_ptr().cast(),
                1,
                0,
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            );
            let e = std::io::Error::last_os_error();
            libc::close(fds[0]);
            libc::close(fds[1]);
            if n == 1 {
                Ok(())
            } else {
                Err(e)
            }
        }
    };
    outcome(emit, "unix_pair_raw_sendto", r.is_ok(), format!("{r:?}"));
    let r = std::fs::File::open(s(input, "unix_tmp"));
    outcome(emit, "open_unix_socket", r.is_ok(), format!("{:?}", r.map(|_| ())));
    // The pairs strict allows, re-targeted: connect fails (EISCONN or
    // EPROTOTYPE); a seqpacket pair's sendto ignores the address (its peer
    // gets it), which the host-side counts show.
    let mut connected = Vec::new();
    for ty in [libc::SOCK_STREAM, libc::SOCK_SEQPACKET] {
        // SAFETY: socketpair into a local array; connect and sendto with a
        // sockaddr_un built here; both fds closed before the next round.
        unsafe {
            let mut fds = [-1; 2];
            if libc::socketpair(libc::AF_UNIX, ty, 0, fds.as_mut_ptr()) != 0 {
                connected.push(format!("{ty}: socketpair {}", std::io::Error::last_os_error()));
                continue;
            }
            for target in [s(input, "unix_tmp"), dgram.clone()] {
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
                for (d, b) in addr.sun_path.iter_mut().zip(target.as_bytes()) {
                    *d = *b as libc::c_char;
                }
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if libc::connect(fds[0], std::ptr::addr_of!(addr).cast(), len) == 0 {
                    connected.push(format!("{ty} connected to {target}"));
                }
                libc::sendto(fds[0], b"x".as_ptr().cast(), 1, 0, std::ptr::addr_of!(addr).cast(), len);
            }
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }
    outcome(
        emit,
        "unix_pair_stream_retarget",
        !connected.is_empty(),
        format!("{connected:?}"),
    );
}

/// The unix attempts: each reaches a host-side socket unless confinement
/// stops it (`open_unix_socket` fails anyway: a socket cannot be opened).
const UNIX_ATTEMPTS: [&str; 7] = [
    "unix_tmp",
    "unix_run",
    "unix_abstract",
    "unix_dgram_sendto",
    "unix_pair_sendto",
    "unix_pair_connect",
    "unix_pair_raw_sendto",
];

// ---------------------------------------------------------------- the tests

/// How the child's in-namespace listener reaches the proxy.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// No key: the listener is handed to the proxy (`SCM_RIGHTS`) over the
    /// socket both services derive beside the facts store; connections are
    /// bound to the run.
    Default,
    /// The same through `[proxy] handoff`, the one key both services read.
    ProxyKey,
    /// `[executor] allow_relay = true`: the executor accepts and relays.
    Relay,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fixture {
    Rust,
    Python,
    /// The Python tool, its children forked by its fork server.
    PythonForked,
}

/// Why these tests cannot run here, if they cannot.
fn unsupported() -> Option<String> {
    if !is_root() {
        return Some("needs root (namespaces, uid switch, cgroups)".into());
    }
    let host = egress_executor::confine::host(&Config::parse(Path::new("/x.toml"), "").unwrap().executor);
    let missing: Vec<String> = host
        .layers
        .iter()
        .filter_map(|(l, r)| r.as_ref().err().map(|e| format!("{}: {e}", l.name())))
        .collect();
    (!missing.is_empty()).then(|| missing.join("; "))
}

const PIDS: u64 = 16;
const MEMORY_MB: u64 = 64;

async fn suite(fixture: Fixture, isolation: &str, mode: Mode) {
    suite_with(fixture, isolation, mode, None).await
}

/// The malicious tool under strict, with only `layers` applied: each layer
/// alone stops its own attempts (so removing a layer's rules fails here).
async fn layer_alone(layers: &'static [Layer], fails: &'static [&'static str], succeeds: &'static [&'static str]) {
    suite_with(Fixture::Rust, "strict", Mode::Default, Some((layers, fails, succeeds))).await
}

/// One invocation on a child confined by `layers` only (no pool).
async fn one_layer_invocation(cfg: &Path, layers: &[Layer], input: Value) -> egress_executor::InvocationResult {
    use egress_executor::pool::child::{Request, ToolSpec, Warm};
    let cfg = Config::load(cfg).unwrap();
    let host = egress_executor::confine::host(&cfg.executor);
    let process = cfg.tools["evil"].clone().unwrap();
    let confinement = Confinement::for_tool("evil", &process, &cfg.executor, &host)
        .unwrap()
        .only(layers);
    let spec = std::sync::Arc::new(ToolSpec::new("evil", process, confinement));
    let shared = shared(&cfg);
    let warm = Warm::start(&shared, &spec, None).await.unwrap();
    let (result, teardown) = warm
        .dispatch(Request {
            principal: None,
            input,
            idempotency_key: None,
            timeout: Duration::from_millis(spec.process.timeout_ms),
            cancel: tokio_util::sync::CancellationToken::new(),
        })
        .await;
    teardown.finish().await;
    result
}

type Only = Option<(&'static [Layer], &'static [&'static str], &'static [&'static str])>;

async fn suite_with(fixture: Fixture, isolation: &str, mode: Mode, only: Only) {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED confinement suite ({fixture:?}, {isolation}): {why}");
        return;
    }
    if fixture != Fixture::Rust && python().is_none() {
        eprintln!("SKIPPED confinement suite (Python, {isolation}): no python3 on the children's PATH");
        return;
    }
    let strict = isolation == "strict";
    let dir = TempDir::new(&format!("confine-{isolation}"));
    let var = dir.path().join("var");
    std::fs::create_dir_all(&var).unwrap();
    let facts = var.join("egress-facts.db");
    let token = var.join("egress-control.token");
    std::fs::write(&token, TOKEN).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let outside = std::env::temp_dir().join(format!("loom-escape-{}", uuid::Uuid::new_v4().simple()));

    let dns = FakeDns::start().await;
    dns.set("denied.test", &["10.0.0.7"]);
    let origin = http_origin("127.0.0.2:0").await;
    let canary = canary("127.0.0.1:0").await;
    let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let udp_addr = udp.local_addr().unwrap();
    let udp_count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let c = udp_count.clone();
        tokio::spawn(async move {
            let mut b = [0u8; 1500];
            while udp.recv_from(&mut b).await.is_ok() {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
    }
    // Host-side unix sockets, world-writable like a permissive service's
    // (D-Bus, X11, docker.sock): in /tmp, in /run, at an abstract name, and
    // an unconnected datagram socket.
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let unix_tmp = UnixCanary::stream_at(&std::env::temp_dir().join(format!("loom-unix-{tag}.sock")));
    let unix_run = UnixCanary::stream_at(&Path::new("/run").join(format!("loom-unix-{tag}.sock")));
    let unix_abstract = UnixCanary::stream_abstract(&format!("loom-unix-{tag}"));
    let unix_dgram = UnixCanary::datagram_at(&std::env::temp_dir().join(format!("loom-unixdg-{tag}.sock")));
    let unix_hits = || unix_tmp.hits() + unix_run.hits() + unix_abstract.hits() + unix_dgram.hits();
    let handoff = match mode {
        Mode::ProxyKey => var.join("run/handoff.sock"),
        _ => var.join("egress-handoff.sock"),
    };
    let handoff_line = match mode {
        Mode::ProxyKey => format!("handoff = \"{}\"", handoff.display()),
        Mode::Default | Mode::Relay => String::new(),
    };
    let proxy_text = format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
facts = "{facts}"
{handoff_line}
allow_ranges = ["127.0.0.2/32"]

[proxy.dns]
servers = ["{dns}"]
timeout_ms = 2000

[tools.evil]
egress = ["denied.test:80", "127.0.0.2:{port}"]
"#,
        facts = facts.display(),
        dns = dns.addr,
        port = origin.addr.port(),
    );
    let proxy = TestProxy::start_config(dns, &proxy_text, None, None).await;
    // The stolen credential: another live run of the same tool.
    let victim = proxy.run("evil").await;

    let marker = format!("LOOM_EVIL_{}", uuid::Uuid::new_v4().simple());
    let me = std::env::current_exe().unwrap();
    let command = match fixture {
        Fixture::Rust => format!("[\"{}\"]", me.display()),
        Fixture::Python | Fixture::PythonForked => format!(
            "[\"python3\", \"{}\", \"{}\"]",
            python_runner().display(),
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/malicious_tool.py")
                .display()
        ),
    };
    let config_text = format!(
        r#"{proxy_text}
[proxy_control_for_the_executor]
[executor]
listen = "127.0.0.1:0"
scratch_dir = "scratch"
{{executor_handoff}}

[tools.evil.process]
command = {command}
env = {{ {marker} = "1" }}
isolation = "{isolation}"
timeout_ms = 8000
cold_start_ms = 10000
memory_mb = {MEMORY_MB}
max_pids = {PIDS}
pool = {{ warm = 0, max = 2 }}
fork_server = {forked}
"#,
        forked = fixture == Fixture::PythonForked,
    )
    .replace("[proxy_control_for_the_executor]\n", "")
    .replace(
        "{executor_handoff}",
        match mode {
            Mode::Relay => "allow_relay = true",
            Mode::Default | Mode::ProxyKey => "",
        },
    )
    .replace("control = \"127.0.0.1:0\"", &format!("control = \"{}\"", proxy.control));
    let cfg = dir.write("egress.toml", &config_text);
    if mode != Mode::Relay {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&handoff).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the hand-off socket must be private to the proxy");
    }
    let exec = executor(&cfg);
    // The executor's own API, as a target.
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_addr = api.local_addr().unwrap();
    {
        let app = egress_executor::api::router(exec.clone());
        tokio::spawn(async move { axum::serve(api, app).await });
    }
    let before = std::fs::metadata(&facts).map(|m| m.len()).unwrap_or(0);

    let input = json!({
        "passwd": "/etc/passwd",
        "config": cfg,
        "token": token,
        "facts": facts,
        "canary": canary.addr.to_string(),
        "control": proxy.control.to_string(),
        "executor_api": api_addr.to_string(),
        "dns": udp_addr.to_string(),
        "unlisted": "http://unlisted.example/",
        "ip_literal": "http://10.9.8.7/",
        "private_name": "http://denied.test/",
        "allowed": format!("http://127.0.0.2:{}/", origin.addr.port()),
        "stolen": format!("{}:{}", victim.id, victim.secret),
        "outside": outside,
        "unix_tmp": unix_tmp.target(),
        "unix_run": unix_run.target(),
        "unix_abstract": unix_abstract.target(),
        "unix_dgram": unix_dgram.target(),
        "pids": if strict { 100 } else { 40 },
        "memory_mb": 3 * MEMORY_MB,
    });
    let res = match only {
        None => exec.invoke(invocation("evil", input)).await,
        Some((layers, _, _)) => one_layer_invocation(&cfg, layers, input).await,
    };
    let e = res
        .error
        .clone()
        .unwrap_or_else(|| panic!("the tool cannot finish: {res:#?}"));
    assert_eq!(e.kind, ErrorKind::Timeout, "{res:#?}");
    if fixture == Fixture::PythonForked {
        // The attempts above were a forked child's, not an exec'd one's.
        let metrics = exec.metrics().encode();
        assert!(
            metrics.contains("executor_forked_children_total{tool=\"evil\"} 1\n"),
            "{metrics}"
        );
    }
    let outcomes: std::collections::BTreeMap<String, (bool, String)> = res
        .emits
        .iter()
        .filter_map(|v| {
            Some((
                v["attempt"].as_str()?.to_string(),
                (
                    v["ok"].as_bool().unwrap_or(false),
                    v["detail"].as_str().unwrap_or("").to_string(),
                ),
            ))
        })
        .collect();
    eprintln!("{fixture:?}/{isolation} outcomes:");
    for (k, (ok, d)) in &outcomes {
        eprintln!("  {k:<24} {} {d}", if *ok { "SUCCEEDED" } else { "failed" });
    }
    assert!(
        outcomes.contains_key("done"),
        "the tool did not get through its list: {res:#?}"
    );
    let ok = |a: &str| {
        outcomes
            .get(a)
            .unwrap_or_else(|| panic!("no outcome for {a}: {res:#?}"))
            .0
    };
    let scratch_ok = res.emits.iter().any(|v| v["scratch_write"] == json!(true));
    assert!(scratch_ok, "the scratch dir must stay writable: {:#?}", res.emits);

    let run_id = res.run_id.clone().unwrap();
    let facts_now = egress_e2e::harness::all_facts_at(proxy.control).await;
    let reasons = |run: &str| -> Vec<String> {
        facts_now
            .iter()
            .filter(|f| f["run_id"] == json!(run) && f["type"] == json!("EGRESS_DENIED"))
            .map(|f| f["reason"].as_str().unwrap_or("").to_string())
            .collect()
    };
    // Through the proxy, confined or not: denied, with a durable fact.
    for a in ["fetch_unlisted", "fetch_ip_literal", "fetch_private_name"] {
        assert!(!ok(a), "{a} must be denied by the proxy");
    }
    let mine = reasons(&run_id);
    for r in ["not_allowlisted", "ip_literal", "private_address"] {
        assert!(mine.contains(&r.to_string()), "no {r} fact for the run: {facts_now:#?}");
    }

    let local = [
        "read_passwd",
        "read_config",
        "read_token",
        "append_facts",
        "connect_canary",
        "connect_proxy_control",
        "connect_executor_api",
        "udp_dns",
        "write_outside",
        "raw_socket",
        "packet_socket",
        "io_uring_setup",
        "ptrace",
        "unshare_user",
        "fork_bomb",
        "memory_hog",
    ]
    .into_iter()
    .chain(UNIX_ATTEMPTS)
    .collect::<Vec<_>>();
    // Never possible, confined or not: a socket cannot be open()ed, a
    // connected pair cannot be re-targeted, and a child inherits no socket
    // (fds 0-4 are pipes or /dev/null).
    for a in ["open_unix_socket", "unix_pair_stream_retarget", "inherited_socket"] {
        assert!(!ok(a), "{a}: {:?}", outcomes[a]);
    }
    if let Some((layers, fails, succeeds)) = only {
        for a in fails {
            assert!(!ok(a), "{a} must fail with only {layers:?}: {:?}", outcomes[*a]);
        }
        for a in succeeds {
            assert!(ok(a), "{a} should succeed with only {layers:?}: {:?}", outcomes[*a]);
        }
        if layers.contains(&Layer::Seccomp) {
            assert_eq!(unix_hits(), 0, "a host-side unix socket was reached");
        }
        let abi =
            egress_executor::confine::host(&Config::parse(Path::new("/x.toml"), "").unwrap().executor).landlock_abi;
        if layers == [Layer::Landlock] && abi >= 6 {
            // Landlock's abstract-socket scope: the extra layer where present.
            assert!(!ok("unix_abstract"), "{:?}", outcomes["unix_abstract"]);
            assert_eq!(unix_abstract.hits(), 0);
        }
        if layers.contains(&Layer::Netns) {
            assert_eq!(canary.connections(), 0, "the canary was reached");
            assert_eq!(udp_count.load(std::sync::atomic::Ordering::SeqCst), 0);
        }
        let _ = std::fs::remove_file(&outside);
    } else if strict {
        for a in &local {
            assert!(!ok(a), "{a} must fail under strict: {:?}", outcomes[*a]);
        }
        assert_eq!(unix_hits(), 0, "a host-side unix socket was reached");
        let forked = res.emits.iter().find_map(|v| v["forked"].as_u64()).unwrap();
        assert!(forked < PIDS, "forked {forked} with max_pids = {PIDS}");
        assert_eq!(canary.connections(), 0, "the canary was reached");
        assert_eq!(
            udp_count.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the host DNS listener got a datagram"
        );
        assert!(!outside.exists(), "a file was written outside the scratch dir");
        // Denied calls fail with EPERM, network attempts fast and clearly.
        for a in [
            "io_uring_setup",
            "ptrace",
            "unshare_user",
            "raw_socket",
            "packet_socket",
        ]
        .into_iter()
        .chain(UNIX_ATTEMPTS)
        {
            assert!(
                outcomes[a].1.contains("Operation not permitted"),
                "{a}: {:?}",
                outcomes[a]
            );
        }
        for a in ["connect_canary", "connect_proxy_control", "connect_executor_api"] {
            let d = &outcomes[a].1;
            assert!(
                d.contains("refused") || d.contains("ermission") || d.contains("unreachable"),
                "{a}: {d}"
            );
        }
    } else {
        // What `off` lets through: exactly what confinement is for.
        for a in [
            "read_passwd",
            "read_config",
            "read_token",
            "append_facts",
            "connect_canary",
            "connect_proxy_control",
            "connect_executor_api",
            "udp_dns",
            "write_outside",
            "raw_socket",
            "ptrace",
            "fork_bomb",
            "memory_hog",
        ]
        .into_iter()
        .chain(UNIX_ATTEMPTS)
        {
            assert!(ok(a), "{a} should succeed under off: {:?}", outcomes[a]);
        }
        assert!(
            eventually(Duration::from_secs(2), || unix_tmp.hits() >= 1
                && unix_run.hits() >= 1
                && unix_abstract.hits() >= 1
                && unix_dgram.hits() >= 4)
            .await,
            "the host-side unix sockets did not see the tool under off"
        );
        assert!(canary.connections() >= 1);
        assert!(
            eventually(Duration::from_secs(2), || udp_count
                .load(std::sync::atomic::Ordering::SeqCst)
                >= 1)
            .await
        );
        let _ = std::fs::remove_file(&outside);
    }
    // Another run's credential. Handed-off listener (by default, with no
    // key): the connection is bound to this run, so the stolen credential is
    // refused (auth_invalid, recorded against the run that presented it). The
    // relay (only with allow_relay) and `off` lose that binding: the
    // credential works, within the victim run's policy.
    let victim_reasons = reasons(&victim.id);
    if only.is_some() {
        // Layer tests are about local attempts.
    } else if strict && mode != Mode::Relay {
        assert!(!ok("stolen_credential"), "{:?}", outcomes["stolen_credential"]);
        assert!(
            outcomes["stolen_credential"].1.contains("407"),
            "{:?}",
            outcomes["stolen_credential"]
        );
        assert!(mine.contains(&"auth_invalid".to_string()), "{facts_now:#?}");
        assert!(victim_reasons.is_empty(), "{victim_reasons:?}");
    } else {
        assert!(ok("stolen_credential"), "{:?}", outcomes["stolen_credential"]);
    }

    // The facts database is intact and still serves.
    assert!(std::fs::metadata(&facts).unwrap().len() >= before);
    assert!(!facts_now.is_empty());
    // Nothing of the tool is alive, and its cgroups are gone (the fork
    // server, which has the tool's environment but runs no tool code, lives
    // as long as the executor).
    let tool_processes = || {
        let mut p = marked_processes(&marker);
        p.retain(|pid| !std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.ends_with(b"--fork-server\0")));
        p
    };
    assert!(
        eventually(Duration::from_secs(5), || tool_processes().is_empty()).await,
        "processes of the tool survived: {:?}",
        tool_processes()
    );
    if strict && only.is_none() {
        // Removed once the tree is dead (after the answer).
        let leftovers = || -> Vec<PathBuf> {
            ["memory", "pids"]
                .iter()
                .flat_map(|c| {
                    std::fs::read_dir(format!("/sys/fs/cgroup/{c}/loom-egress"))
                        .into_iter()
                        .flatten()
                })
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("evil-"))
                })
                .filter(|p| p.to_string_lossy().contains(&format!("-{}-", std::process::id())))
                .collect()
        };
        assert!(
            eventually(Duration::from_secs(5), || leftovers().is_empty()).await,
            "cgroups left: {:?}",
            leftovers()
        );
    }
    exec.shutdown();
    proxy.shutdown().await;
}

/// A proxy receiving hand-offs where an executor config in `dir` with
/// `facts = "var/…"` finds them by default (`var/egress-handoff.sock`).
async fn proxy_beside(dir: &TempDir, tools: &str) -> TestProxy {
    let sock = dir.path().join("var/egress-handoff.sock");
    TestProxy::start_with(&format!("handoff = \"{}\"", sock.display()), tools, None).await
}

/// Writes `name` in `dir`: a config whose proxy control API is `control`,
/// with its facts and the scratch directory inside `dir`, followed by `rest`
/// (more `[executor]` keys, then `[tools.*]` tables).
fn exec_config(dir: &TempDir, name: &str, control: std::net::SocketAddr, rest: &str) -> PathBuf {
    dir.write(
        name,
        &format!(
            "[proxy]\ncontrol = \"{control}\"\nfacts = \"var/f.db\"\n[executor]\nscratch_dir = \"scratch\"\n{rest}"
        ),
    )
}

/// `egress-executor run --config F --tool T -- CMD` confines CMD as the
/// tool's isolation says.
async fn run_command() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED run_command_applies_the_tools_isolation: {why}");
        return;
    }
    let dir = TempDir::new("confine-run");
    let proxy = proxy_beside(&dir, "[tools.strict]\negress = []\n[tools.open]\negress = []\n").await;
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        "[tools.strict]\negress = []\n[tools.strict.process]\ncommand = [\"true\"]\n\
         [tools.open]\negress = []\n[tools.open.process]\ncommand = [\"true\"]\nisolation = \"off\"\n",
    );
    let cfg = cfg.display().to_string();
    let run = move |tool: &str| {
        executor_bin(
            &[
                "run",
                "--config",
                &cfg,
                "--tool",
                tool,
                "--",
                "sh",
                "-c",
                "id -u; cat /etc/passwd >/dev/null && echo READ",
            ],
            Duration::from_secs(60),
        )
    };
    let (strict, open) = tokio::task::spawn_blocking(move || (run("strict"), run("open")))
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&strict.stdout);
    assert!(
        out.starts_with("65534\n"),
        "{out}\n{}",
        String::from_utf8_lossy(&strict.stderr)
    );
    assert!(!out.contains("READ"), "{out}");
    assert_ne!(strict.status.code(), Some(0));
    let out = String::from_utf8_lossy(&open.stdout);
    assert_eq!(out, "0\nREAD\n", "{}", String::from_utf8_lossy(&open.stderr));
    assert_eq!(open.status.code(), Some(0));
    drop(dir);
    proxy.shutdown().await;
}

/// `cpu_percent = 5`: a child spinning for 1.5 s of wall time runs in a
/// cgroup of its own under the cpu controller and gets at most 5 % of a CPU
/// (about 80 ms of it, well under the 400 ms asserted; uncapped, a spinner
/// gets most of the 1.5 s); a tool without the key gets no cpu cgroup.
async fn cpu_cap() {
    const NAME: &str = "cpu_percent_caps_the_childs_cpu";
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED {NAME}: {why}");
        return;
    }
    let host = egress_executor::confine::host(&Config::parse(Path::new("/x.toml"), "").unwrap().executor);
    if !host.cgroup.as_ref().is_some_and(|c| c.cpu()) {
        eprintln!("SKIPPED {NAME}: no writable cpu controller here");
        return;
    }
    let Some(python) = ["/usr/bin/python3", "/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        eprintln!("SKIPPED {NAME}: no system python3");
        return;
    };
    let dir = TempDir::new("confine-cpu");
    let proxy = proxy_beside(&dir, "[tools.capped]\negress = []\n[tools.free]\negress = []\n").await;
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        "[tools.capped]\negress = []\n[tools.capped.process]\ncommand = [\"true\"]\ncpu_percent = 5\n\
         [tools.free]\negress = []\n[tools.free.process]\ncommand = [\"true\"]\n",
    );
    let spin = "import os, time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n\
                t = os.times()\nprint(round((t.user + t.system) * 1000))\nprint(open('/proc/self/cgroup').read())";
    let cfg = cfg.display().to_string();
    let run = move |tool: &str| {
        let out = executor_bin(
            &["run", "--config", &cfg, "--tool", tool, "--", python, "-S", "-c", spin],
            Duration::from_secs(60),
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let cpu_ms: u64 = stdout.lines().next().unwrap().trim().parse().unwrap();
        // The cgroup of the cpu controller (v1: its own line; v2: the one line).
        let cpu_cgroup = stdout
            .lines()
            .filter_map(|l| l.split_once(':'))
            .filter_map(|(_, rest)| rest.split_once(':'))
            .find(|(controllers, _)| controllers.is_empty() || controllers.split(',').any(|c| c == "cpu"))
            .map(|(_, path)| path.to_owned())
            .unwrap_or_default();
        (cpu_ms, cpu_cgroup, stdout)
    };
    let ((capped_ms, capped, out), (_, free, free_out)) =
        tokio::task::spawn_blocking(move || (run("capped"), run("free")))
            .await
            .unwrap();
    assert!(capped.contains("/capped-"), "{out}");
    assert!(
        capped_ms < 400,
        "{capped_ms} ms of CPU in 1.5 s under cpu_percent = 5\n{out}"
    );
    if matches!(
        host.cgroup,
        Some(egress_executor::confine::cgroup::CgroupHost::V1 { .. })
    ) {
        // v1: no cpu cgroup without the key (v2: one cgroup, without cpu.max).
        assert!(!free.contains("loom-egress"), "{free_out}");
    }
    drop(dir);
    proxy.shutdown().await;
}

const FETCH_PY: &str = r#"
import os, socket, urllib.request, urllib.error

def run(input, ctx):
    out = {}
    r = ctx.fetch(input["allowed"])
    out["ctx_fetch"] = [r["status"], r["body"].decode()]
    r = ctx.fetch("http://unlisted.example/")
    out["ctx_denied"] = [r["status"], r["headers"].get("x-egress-deny-reason")]
    with urllib.request.urlopen(input["allowed"], timeout=10) as resp:
        out["urllib"] = resp.status
    try:
        import requests
        out["requests"] = requests.get(input["allowed"], timeout=10).status_code
    except ImportError:
        out["requests"] = "absent"
    host, port = input["direct"].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out["direct"] = "connected"
    except OSError as e:
        out["direct"] = "%s" % e
    return out
"#;

const FETCH_JS: &str = r#"
module.exports.run = async (input, ctx) => {
  const out = {};
  const r = await ctx.fetch(input.allowed);
  out.ctx_fetch = [r.status, r.body];
  const d = await ctx.fetch('http://unlisted.example/');
  out.ctx_denied = [d.status, d.headers['x-egress-deny-reason']];
  try {
    const g = await fetch('http://' + input.direct + '/');
    out.direct = 'status ' + g.status;
  } catch (e) {
    out.direct = String(e.cause ? e.cause.code || e.cause.message : e.message);
  }
  return out;
};
"#;

/// Under strict, the runners' `ctx.fetch` (and Python's ordinary clients)
/// reach an allowlisted origin through the in-namespace listener; a direct
/// connection fails at once with a clear error.
async fn runners_fetch() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED runners_fetch_through_the_proxy_under_strict: {why}");
        return;
    }
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dir = TempDir::new("confine-fetch");
    let proxy = proxy_beside(
        &dir,
        &format!("[tools.py]\negress = [\"127.0.0.2:{port}\"]\n[tools.js]\negress = [\"127.0.0.2:{port}\"]\n"),
    )
    .await;
    dir.write("fetch.py", FETCH_PY);
    dir.write("fetch.js", FETCH_JS);
    let runners = runners_dir();
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "[tools.py]\negress = []\n[tools.py.process]\ncommand = [\"python3\", \"{py}\", \"fetch.py\"]\npool = {{ warm = 0, max = 1 }}\n\
             [tools.js]\negress = []\n[tools.js.process]\ncommand = [\"node\", \"{js}\", \"fetch.js\"]\npool = {{ warm = 0, max = 1 }}\n",
            py = runners.join("loom_runner.py").display(),
            js = runners.join("loom_runner.js").display(),
        ),
    );
    let exec = executor(&cfg);
    let direct = proxy.proxy.to_string();
    let input = json!({"allowed": format!("http://127.0.0.2:{port}/"), "direct": direct});
    let invoke = |tool: &str| invocation(tool, input.clone());
    if python().is_some() {
        let res = exec.invoke(invoke("py")).await;
        let out = res.output.clone().unwrap_or_else(|| panic!("{res:#?}"));
        assert_eq!(out["ctx_fetch"][0], json!(200), "{out}");
        assert_eq!(out["ctx_denied"], json!([403, "not_allowlisted"]), "{out}");
        assert_eq!(out["urllib"], json!(200), "{out}");
        assert!(
            out["requests"] == json!(200) || out["requests"] == json!("absent"),
            "{out}"
        );
        assert!(out["direct"].as_str().unwrap().contains("ermission denied"), "{out}");
    } else {
        eprintln!("SKIPPED the Python half: no python3");
    }
    if node().is_some() {
        let res = exec.invoke(invoke("js")).await;
        let out = res.output.clone().unwrap_or_else(|| panic!("{res:#?}"));
        assert_eq!(out["ctx_fetch"][0], json!(200), "{out}");
        assert_eq!(out["ctx_denied"], json!([403, "not_allowlisted"]), "{out}");
        let d = out["direct"].as_str().unwrap();
        assert!(d.contains("EACCES") || d.contains("ECONNREFUSED"), "{out}");
    } else {
        eprintln!("SKIPPED the Node half: no node");
    }
    exec.shutdown();
    proxy.shutdown().await;
}

const PIPES_PY: &str = r#"
import multiprocessing as mp, os, socket, subprocess

def square(x):
    return x * x

def put(q, v):
    q.put(v)

def answer(conn):
    conn.send(conn.recv() * 2)
    conn.close()

def run(input, ctx):
    out = {}
    with mp.Pool(2) as p:
        out["pool"] = p.map(square, range(5))
    q = mp.Queue()
    pr = mp.Process(target=put, args=(q, 42))
    pr.start()
    out["queue"] = q.get(timeout=10)
    pr.join()
    a, b = mp.Pipe()
    pr = mp.Process(target=answer, args=(b,))
    pr.start()
    a.send(21)
    out["pipe"] = a.recv()
    pr.join()
    out["subprocess"] = subprocess.run(["cat"], input=b"piped", capture_output=True, check=True).stdout.decode()
    x, y = socket.socketpair()
    x.sendall(b"pair")
    out["socketpair"] = y.recv(4).decode()
    with mp.get_context("spawn").Pool(1) as p:
        out["spawn"] = p.map(abs, [-3])
    # forkserver listens on a unix socket: not available under strict.
    try:
        with mp.get_context("forkserver").Pool(1) as p:
            out["forkserver"] = p.map(abs, [-1])
    except OSError as e:
        out["forkserver"] = e.errno
    return out
"#;

const PIPES_JS: &str = r#"
const { fork, spawn, spawnSync } = require('child_process');
if (require.main === module) {
  // The forked child: answer one message over the IPC channel.
  process.on('message', (m) => { process.send({ doubled: m.n * 2 }); process.disconnect(); });
} else {
  module.exports.run = async () => {
    const out = {};
    out.fork = await new Promise((resolve, reject) => {
      const c = fork(__filename, [], { stdio: ['ignore', 'ignore', 'inherit', 'ipc'] });
      c.on('message', resolve);
      c.on('error', reject);
      c.send({ n: 21 });
    });
    out.spawn = await new Promise((resolve, reject) => {
      const c = spawn('cat');
      let d = '';
      c.stdout.on('data', (x) => { d += x; });
      c.on('close', () => resolve(d));
      c.on('error', reject);
      c.stdin.end('piped');
    });
    out.spawnSync = spawnSync('cat', { input: 'sync' }).stdout.toString();
    return out;
  };
}
"#;

/// Runtimes make their own pipes with socketpair(2) and pipe(2), which stay
/// allowed under strict: Python's multiprocessing (a Pool, a Queue and a
/// duplex Pipe between processes; fork and spawn) with semaphores in the
/// child's private /dev/shm, subprocess with pipes, socket.socketpair; Node's
/// child_process (fork with an IPC channel, spawn with pipes). Python's
/// forkserver needs a listening unix socket: it fails with EPERM, by decision.
async fn runtime_pipes() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED runtimes_keep_their_own_pipes_under_strict: {why}");
        return;
    }
    let dir = TempDir::new("confine-pipes");
    let proxy = proxy_beside(&dir, "[tools.py]\negress = []\n[tools.js]\negress = []\n").await;
    dir.write("pipes.py", PIPES_PY);
    dir.write("pipes.js", PIPES_JS);
    let runners = runners_dir();
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "[tools.py]\negress = []\n[tools.py.process]\ncommand = [\"python3\", \"{py}\", \"pipes.py\"]\npool = {{ warm = 0, max = 1 }}\n\
             [tools.js]\negress = []\n[tools.js.process]\ncommand = [\"node\", \"{js}\", \"pipes.js\"]\npool = {{ warm = 0, max = 1 }}\n",
            py = runners.join("loom_runner.py").display(),
            js = runners.join("loom_runner.js").display(),
        ),
    );
    let exec = executor(&cfg);
    let invoke = |tool: &str| invocation(tool, json!(null));
    if python().is_some() {
        let res = exec.invoke(invoke("py")).await;
        let out = res.output.clone().unwrap_or_else(|| panic!("{res:#?}"));
        assert_eq!(
            out,
            json!({"pool": [0, 1, 4, 9, 16], "queue": 42, "pipe": 42, "subprocess": "piped",
                   "socketpair": "pair", "spawn": [3], "forkserver": libc::EPERM}),
            "{res:#?}"
        );
    } else {
        eprintln!("SKIPPED the Python half: no python3");
    }
    if node().is_some() {
        let res = exec.invoke(invoke("js")).await;
        let out = res.output.clone().unwrap_or_else(|| panic!("{res:#?}"));
        assert_eq!(
            out,
            json!({"fork": {"doubled": 42}, "spawn": "piped", "spawnSync": "sync"}),
            "{res:#?}"
        );
    } else {
        eprintln!("SKIPPED the Node half: no node");
    }
    exec.shutdown();
    proxy.shutdown().await;
}

/// Children of a fork server under strict: fds 0-4 only, exactly the
/// environment an exec'd child of the same tool gets, PID 1 of their own PID
/// namespace, and nothing in memory of an earlier child's run (its proxy
/// credential). Runtimes keep their own pipes there too. When the server
/// dies, children start the old way and the gauge says so.
async fn forked_children() {
    const NAME: &str = "forked_children_have_nothing_of_the_server_or_each_other_and_outlive_it";
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED {NAME}: {why}");
        return;
    }
    if python().is_none() {
        eprintln!("SKIPPED {NAME}: no python3");
        return;
    }
    let dir = TempDir::new("confine-forked");
    let tools = "[tools.forked]\negress = []\n[tools.exec]\negress = []\n[tools.pipes]\negress = []\n";
    let proxy = proxy_beside(&dir, tools).await;
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/forked_probe.py");
    dir.write("pipes.py", PIPES_PY);
    let runner = python_runner();
    let marker = format!("LOOM_FORKED_{}", uuid::Uuid::new_v4().simple());
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "[tools.forked]\negress = []\n[tools.forked.process]\ncommand = [\"python3\", \"{r}\", \"{p}\"]\n\
             fork_server = true\nenv = {{ {marker} = \"1\" }}\npool = {{ warm = 0, max = 1 }}\n\
             [tools.exec]\negress = []\n[tools.exec.process]\ncommand = [\"python3\", \"{r}\", \"{p}\"]\n\
             env = {{ {marker} = \"1\" }}\npool = {{ warm = 0, max = 1 }}\n\
             [tools.pipes]\negress = []\n[tools.pipes.process]\ncommand = [\"python3\", \"{r}\", \"pipes.py\"]\n\
             fork_server = true\npool = {{ warm = 0, max = 1 }}\n",
            r = runner.display(),
            p = probe.display(),
        ),
    );
    let exec = executor(&cfg);
    let invoke = |tool: &str, input: Value| {
        let exec = exec.clone();
        let tool = tool.to_string();
        async move {
            let res = exec
                .invoke(InvocationRequest {
                    principal: None,
                    tool,
                    input,
                    run_id: None,
                    idempotency_key: None,
                    timeout_ms: None,
                })
                .await;
            res.output.clone().unwrap_or_else(|| panic!("{res:#?}"))
        }
    };
    let first = invoke("forked", json!({})).await;
    assert_eq!(first["forked"], true, "{first}");
    assert_eq!(first["pid"], 1, "its own PID namespace: {first}");
    // fds 0-4, and the one listing /proc/self/fd.
    assert_eq!(first["fds"], json!([0, 1, 2, 3, 4, 5]), "{first}");
    let exec_d = invoke("exec", json!({})).await;
    assert_eq!(exec_d["forked"], false, "{exec_d}");
    assert_eq!(first["env"], exec_d["env"], "the same environment as an exec'd child");
    assert!(first["env"].as_array().unwrap().contains(&json!(marker)));

    // The earlier child's proxy credential is nowhere in the next one's
    // memory (the server never held it); its own is (the scan finds).
    let credential = |out: &Value| {
        let url = out["proxy"].as_str().unwrap().trim_start_matches("http://").to_string();
        url.rsplit_once('@').unwrap().0.to_string()
    };
    let xor = |s: &str| s.bytes().map(|b| format!("{:02x}", b ^ 0x55)).collect::<String>();
    let second = invoke("forked", json!({"xor_needle": xor(&credential(&first))})).await;
    assert_eq!(second["forked"], true, "{second}");
    assert_ne!(credential(&first), credential(&second));
    assert_eq!(second["regions_with_needle"], 0, "{second}");
    let own = invoke("forked", json!({"xor_needle": xor(&marker)})).await;
    assert!(
        own["regions_with_needle"].as_u64().unwrap() > 0,
        "the scan finds what is there: {own}"
    );
    let third = invoke("forked", json!({"xor_needle": xor(&credential(&second))})).await;
    assert_eq!(third["regions_with_needle"], 0, "{third}");

    // A runtime's own pipes work in a forked child as in an exec'd one.
    let pipes = invoke("pipes", json!(null)).await;
    assert_eq!(
        pipes,
        json!({"pool": [0, 1, 4, 9, 16], "queue": 42, "pipe": 42, "subprocess": "piped",
               "socketpair": "pair", "spawn": [3], "forkserver": libc::EPERM})
    );

    // doctor boots a server of its own and has it fork a child; a runner
    // that does not serve is a FAIL naming the fallback.
    dir.write("broken/loom_runner.py", "import sys\nsys.exit(3)\n");
    let broken = exec_config(
        &dir,
        "broken.toml",
        proxy.control,
        &format!(
            "[tools.pipes]\negress = []\n[tools.pipes.process]\ncommand = [\"python3\", \"{}\", \"pipes.py\"]\nfork_server = true\n",
            dir.path().join("broken/loom_runner.py").display()
        ),
    );
    let (good, bad) = tokio::task::spawn_blocking(move || {
        let doctor = |cfg: &Path| {
            let out = executor_bin(
                &["doctor", "--config", &cfg.display().to_string()],
                Duration::from_secs(60),
            );
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.lines()
                .filter(|l| l.starts_with("fork server of"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        (doctor(&cfg), doctor(&broken))
    })
    .await
    .unwrap();
    assert!(
        good.contains("fork server of `forked`      ok   booted and forked a child in"),
        "{good}"
    );
    assert!(good.contains("fork server of `pipes`       ok   booted"), "{good}");
    assert!(!good.contains("`exec`"), "{good}");
    assert!(
        bad.starts_with("fork server of `pipes`       FAIL the fork server is gone; its children would start a fresh interpreter each"),
        "{bad}"
    );

    // The server dies: the next children start the old way.
    let servers: Vec<i32> = marked_processes(&marker)
        .into_iter()
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.ends_with(b"--fork-server\0")))
        .collect();
    assert_eq!(servers.len(), 1, "{servers:?}");
    // The server itself runs under its children's filters but for what they
    // need before their own, with no_new_privs, in a network namespace of
    // its own.
    let status = std::fs::read_to_string(format!("/proc/{}/status", servers[0])).unwrap();
    assert!(status.contains("\nSeccomp:\t2\n"), "{status}");
    assert!(status.contains("\nNoNewPrivs:\t1\n"), "{status}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", servers[0])).unwrap();
    let limit = |name: &str| {
        let line = limits.lines().find(|l| l.starts_with(name)).unwrap().to_string();
        line[name.len()..]
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(limit("Max core file size"), "0 0", "{limits}");
    assert_eq!(limit("Max cpu time"), "unlimited unlimited", "{limits}");
    let netns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(netns(&servers[0].to_string()), netns("self"));
    unsafe { libc::kill(servers[0], libc::SIGKILL) };
    let after = invoke("forked", json!({})).await;
    assert_eq!(after["forked"], false, "{after}");
    let again = invoke("forked", json!({})).await;
    assert_eq!(again["forked"], false, "{again}");
    let metrics = exec.metrics().encode();
    assert!(
        metrics.contains("executor_fork_server_up{tool=\"forked\"} 0\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("executor_forked_children_total{tool=\"forked\"} 4\n"),
        "{metrics}"
    );
    exec.shutdown();
    proxy.shutdown().await;
}

const PROBE_PY: &str = r#"
import os, socket, sys
print("uid", os.getuid())
try:
    open("/etc/passwd").read()
    print("passwd READ")
except OSError as e:
    print("passwd", e.errno)
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("canary CONNECTED")
except OSError as e:
    print("canary", e.errno)
"#;

/// Without root: the executor in a user namespace of an unprivileged uid
/// (`setpriv` + `unshare -r`) still gets network and PID namespaces,
/// Landlock, seccomp and rlimits; not the uid switch nor cgroups. `doctor`
/// says exactly that, `strict` refuses naming both, `best_effort` runs.
async fn unprivileged() {
    let have = |b: &str| which(b).is_some();
    if !is_root() || !have("setpriv") || !have("unshare") || python().is_none() {
        eprintln!("SKIPPED unprivileged_executor_enforces_what_user_namespaces_give: needs root (to drop to another uid), setpriv, unshare and python3");
        return;
    }
    let probe = std::process::Command::new("setpriv")
        .args([
            "--reuid=4242",
            "--regid=4242",
            "--clear-groups",
            "--",
            "unshare",
            "-r",
            "true",
        ])
        .status();
    if !probe.map(|s| s.success()).unwrap_or(false) {
        eprintln!("SKIPPED unprivileged_executor_enforces_what_user_namespaces_give: unprivileged user namespaces are disabled here");
        return;
    }
    let proxy = TestProxy::start("[tools.be]\negress = []\n[tools.st]\negress = []\n[tools.fs]\negress = []\n").await;
    let canary = canary("127.0.0.1:0").await;
    let dir = TempDir::new("confine-unpriv");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    dir.write("probe.py", PROBE_PY);
    // The proxy runs as root here, and its hand-off socket takes listeners
    // only from root or its own user: an executor in a user namespace of
    // uid 4242 binds only to a proxy of that uid, so this one relays, as
    // the file says.
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "allow_relay = true\n\
             [tools.be]\negress = []\n[tools.be.process]\ncommand = [\"true\"]\nisolation = \"best_effort\"\n\
             [tools.st]\negress = []\n[tools.st.process]\ncommand = [\"true\"]\n\
             [tools.fs]\negress = []\n[tools.fs.process]\ncommand = [\"python3\", \"{}\", \"probe.py\"]\n\
             isolation = \"best_effort\"\nfork_server = true\n",
            python_runner().display()
        ),
    );
    // `run` builds every tool's plan: the best-effort tool alone in its own file.
    let be_cfg = exec_config(
        &dir,
        "be.toml",
        proxy.control,
        "allow_relay = true\n\
         [tools.be]\negress = []\n[tools.be.process]\ncommand = [\"true\"]\nisolation = \"best_effort\"\n",
    );
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_egress-executor"));
    let probe_path = dir.path().join("probe.py");
    let port = canary.addr.port().to_string();
    let unpriv = move |args: Vec<String>| {
        std::process::Command::new("setpriv")
            .args(["--reuid=4242", "--regid=4242", "--clear-groups", "--", "unshare", "-r"])
            .arg(&bin)
            .args(args)
            .env("EGRESS_CONTROL_TOKEN", TOKEN)
            .output()
            .unwrap()
    };
    let c = cfg.display().to_string();
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let doctor = args(&["doctor", "--config", &c]);
    let be_c = be_cfg.display().to_string();
    let be = args(&[
        "run",
        "--config",
        &be_c,
        "--tool",
        "be",
        "--",
        "python3",
        &probe_path.display().to_string(),
        &port,
    ]);
    let st = args(&["run", "--config", &c, "--tool", "st", "--", "true"]);
    let (doctor, be, st) = tokio::task::spawn_blocking(move || (unpriv(doctor), unpriv(be), unpriv(st)))
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&doctor.stdout);
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row:\n{table}"))
            .to_string()
    };
    for (layer, available) in [
        ("network namespace", true),
        ("landlock", true),
        ("seccomp", true),
        ("rlimits", true),
        ("unprivileged uid/gid", false),
        ("cgroup memory+pids", false),
    ] {
        let r = row(layer);
        let word = r[32..].split_whitespace().next().unwrap_or("");
        assert_eq!(word, if available { "yes" } else { "NO" }, "{r}");
    }
    assert!(row("isolation of `st`").contains("FAIL"), "{table}");
    // A fork server starts in the user namespace too (its own network
    // namespace and seccomp filter) and forks a child into a PID namespace.
    assert!(
        row("fork server of `fs`").contains(" ok   booted and forked a child in")
            && row("fork server of `fs`").ends_with("(its own PID namespace)"),
        "{table}"
    );
    // Seccomp works in a user namespace: unix sockets stay closed there.
    assert!(
        row("unix sockets of `be`").contains(" ok   seccomp denies socket(AF_UNIX)"),
        "{table}"
    );
    assert!(
        row("isolation of `be`").contains("network namespace, landlock, seccomp, rlimits"),
        "{table}"
    );

    let out = String::from_utf8_lossy(&be.stdout);
    let err = String::from_utf8_lossy(&be.stderr);
    assert!(out.contains("uid 0\n"), "{out}\n{err}");
    assert!(out.contains("passwd 13\n"), "{out}\n{err}");
    assert!(!out.contains("CONNECTED"), "{out}\n{err}");
    assert_eq!(canary.connections(), 0);
    assert!(err.contains("layer not enforced: unprivileged uid/gid"), "{err}");
    assert!(err.contains("layer not enforced: cgroup memory+pids"), "{err}");

    let err = String::from_utf8_lossy(&st.stderr);
    assert_eq!(st.status.code(), Some(125), "{err}");
    assert!(
        err.contains("unprivileged uid/gid") && err.contains("cgroup memory+pids"),
        "{err}"
    );
    proxy.shutdown().await;
}

/// Runs the executor binary with `args` and the control token; kills it
/// and fails the test if it has not exited within `cap`.
fn executor_bin(args: &[&str], cap: Duration) -> std::process::Output {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_egress-executor"))
        .args(args)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > cap {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "egress-executor {args:?} still runs after {cap:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The doctor's `listener hand-off` line.
fn handoff_line(doctor: &std::process::Output) -> String {
    let out = String::from_utf8_lossy(&doctor.stdout);
    out.lines()
        .find(|l| l.starts_with("listener hand-off"))
        .unwrap_or_else(|| panic!("no hand-off line:\n{out}"))
        .to_string()
}

/// No key is needed to bind confined children, so nothing may silently
/// take the binding away: without a usable hand-off socket (none, one no
/// proxy answers on, one other users may use) `serve` and `run` refuse to
/// start and `doctor` fails, each naming the socket and `allow_relay`;
/// `allow_relay = true` relays, and a proxy receiving at the default socket
/// passes.
async fn refuses_without_binding() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED strict_refuses_to_start_without_the_binding_unless_allow_relay: {why}");
        return;
    }
    // Its own fact sink, no [proxy] handoff: this proxy receives no hand-offs.
    let proxy = TestProxy::start("[tools.t]\negress = []\n").await;
    let dir = TempDir::new("confine-nobinding");
    let tools = "listen = \"127.0.0.1:0\"\n\
                 [tools.t]\negress = []\n[tools.t.process]\ncommand = [\"true\"]\nprotocol = \"plain\"\npool = { warm = 1, max = 1 }\n";
    let cfg = exec_config(&dir, "egress.toml", proxy.control, tools);
    let relay_cfg = exec_config(
        &dir,
        "relay.toml",
        proxy.control,
        &format!("allow_relay = true\n{tools}"),
    );
    let sock = dir.path().join("var/egress-handoff.sock");
    let (c, r) = (cfg.display().to_string(), relay_cfg.display().to_string());
    let run = |c: &str| {
        let c = c.to_string();
        tokio::task::spawn_blocking(move || {
            let cap = Duration::from_secs(60);
            (
                executor_bin(&["doctor", "--config", &c], cap),
                executor_bin(&["run", "--config", &c, "--tool", "t", "--", "true"], cap),
                executor_bin(&["serve", "--config", &c], cap),
            )
        })
    };
    let names_the_way_out = |text: &str, why: &str| {
        for needle in [&sock.display().to_string(), "allow_relay = true", "[proxy] facts", why] {
            assert!(text.contains(needle), "{needle:?} not in:\n{text}");
        }
    };

    // No socket: the proxy answers its control API (the executor waits for
    // that), but nothing receives listeners.
    let (doctor, ad_hoc, serve) = run(&c).await.unwrap();
    assert_eq!(doctor.status.code(), Some(1));
    let line = handoff_line(&doctor);
    assert!(line.contains("FAIL"), "{line}");
    names_the_way_out(&line, "no socket at");
    assert_eq!(ad_hoc.status.code(), Some(125));
    names_the_way_out(&String::from_utf8_lossy(&ad_hoc.stderr), "no socket at");
    assert!(!serve.status.success());
    names_the_way_out(&String::from_utf8_lossy(&serve.stderr), "no socket at");

    // A socket no proxy answers on.
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    chmod(&sock, 0o600);
    let (doctor, ad_hoc, serve) = run(&c).await.unwrap();
    names_the_way_out(&handoff_line(&doctor), "refused");
    assert_eq!((doctor.status.code(), ad_hoc.status.code()), (Some(1), Some(125)));
    assert!(!serve.status.success());
    names_the_way_out(&String::from_utf8_lossy(&serve.stderr), "refused");

    // A socket other users could hand listeners to (or replace): refused
    // before anything is sent.
    std::fs::remove_file(&sock).unwrap();
    let _open = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    chmod(&sock, 0o666);
    let (doctor, ad_hoc, serve) = run(&c).await.unwrap();
    names_the_way_out(&handoff_line(&doctor), "mode 666");
    assert_eq!((doctor.status.code(), ad_hoc.status.code()), (Some(1), Some(125)));
    assert!(!serve.status.success());
    names_the_way_out(&String::from_utf8_lossy(&serve.stderr), "mode 666");
    std::fs::remove_file(&sock).unwrap();

    // allow_relay = true: the operator accepts the relay; doctor says so.
    let doctor =
        tokio::task::spawn_blocking(move || executor_bin(&["doctor", "--config", &r], Duration::from_secs(60)))
            .await
            .unwrap();
    let line = handoff_line(&doctor);
    assert!(
        line.contains(" ok ") && line.contains("relay ([executor] allow_relay = true)"),
        "{line}"
    );
    assert!(doctor.status.success(), "{}", String::from_utf8_lossy(&doctor.stdout));
    let r = relay_cfg.display().to_string();
    let ad_hoc = tokio::task::spawn_blocking(move || {
        executor_bin(
            &["run", "--config", &r, "--tool", "t", "--", "true"],
            Duration::from_secs(60),
        )
    })
    .await
    .unwrap();
    assert!(ad_hoc.status.success(), "{}", String::from_utf8_lossy(&ad_hoc.stderr));

    // A proxy receiving at the default socket: bound, no key anywhere.
    let bound = proxy_beside(&dir, "[tools.t]\negress = []\n").await;
    let cfg = exec_config(&dir, "bound.toml", bound.control, tools);
    let c = cfg.display().to_string();
    let (doctor, ad_hoc) = tokio::task::spawn_blocking(move || {
        let cap = Duration::from_secs(60);
        (
            executor_bin(&["doctor", "--config", &c], cap),
            executor_bin(&["run", "--config", &c, "--tool", "t", "--", "true"], cap),
        )
    })
    .await
    .unwrap();
    let line = handoff_line(&doctor);
    assert!(
        line.contains(" ok ") && line.contains("(the default beside [proxy] facts)"),
        "{line}"
    );
    assert!(doctor.status.success(), "{}", String::from_utf8_lossy(&doctor.stdout));
    assert!(ad_hoc.status.success(), "{}", String::from_utf8_lossy(&ad_hoc.stderr));
    bound.shutdown().await;
    proxy.shutdown().await;
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Reads the stolen credential from stdin and presents it on the child's
/// proxy listener; prints the status line it gets.
const STOLEN_PY: &str = r#"
import base64, json, os, socket, sys
cred = json.load(sys.stdin)["stolen"]
auth = base64.b64encode(cred.encode()).decode()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(("GET http://unlisted.example/ HTTP/1.1\r\nHost: unlisted.example\r\n"
           "Proxy-Authorization: Basic %s\r\nConnection: close\r\n\r\n" % auth).encode())
print(s.recv(4096).split(b"\r\n")[0].decode())
"#;

/// The executor may start before the proxy: it serves, waits for the
/// proxy's control API, then for its hand-off socket, and only then warms
/// its pool. It neither gives up nor relays: a child started afterwards is
/// bound (another run's credential is refused on its listener).
async fn started_before_the_proxy() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED an_executor_started_before_the_proxy_waits_and_then_binds: {why}");
        return;
    }
    if python().is_none() {
        eprintln!("SKIPPED an_executor_started_before_the_proxy_waits_and_then_binds: no python3");
        return;
    }
    let dir = TempDir::new("confine-order");
    dir.write("stolen.py", STOLEN_PY);
    let control = egress_e2e::process::free_addr();
    let cfg = exec_config(
        &dir,
        "egress.toml",
        control,
        "listen = \"127.0.0.1:0\"\n[tools.t]\negress = []\n[tools.t.process]\n\
         command = [\"python3\", \"stolen.py\"]\nprotocol = \"plain\"\npool = { warm = 1, max = 2 }\n",
    );
    let (child, api) = serve(Path::new(env!("CARGO_BIN_EXE_egress-executor")), &cfg, &[]);
    let mut child = egress_e2e::process::KillOnDrop(child);
    let (status, _) = http(api, "GET", "/healthz", None).await;
    assert_eq!(status, 200);

    // The proxy, later, on that control address, its facts store beside the
    // executor's `[proxy] facts`: it receives at the default socket.
    let dns = FakeDns::start().await;
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\ncontrol = \"{control}\"\nfacts = \"{}\"\n[proxy.dns]\nservers = [\"{}\"]\n\
         [tools.t]\negress = []\n",
        dir.path().join("var/f.db").display(),
        dns.addr
    );
    let proxy = TestProxy::start_config(dns, &text, None, None).await;
    let victim = proxy.run("t").await;
    let (status, body) = http(
        api,
        "POST",
        "/v1/invocations",
        Some(json!({"tool": "t", "input": {"stolen": format!("{}:{}", victim.id, victim.secret)}})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], json!(true), "{v:#}");
    assert!(
        v["stdout"].as_str().unwrap().contains("407"),
        "the stolen credential worked: {v:#}"
    );
    let facts = egress_e2e::harness::all_facts_at(proxy.control).await;
    let thief = v["run_id"].as_str().unwrap();
    assert!(
        facts
            .iter()
            .any(|f| f["run_id"] == json!(thief) && f["reason"] == json!("auth_invalid")),
        "{facts:#?}"
    );
    assert!(child.0.try_wait().unwrap().is_none(), "the executor exited");
    drop(child);
    proxy.shutdown().await;
}

/// The executor declares the binding when it creates the run of a child
/// whose listener it hands over (`bound: true` at `POST /v1/runs`), so the
/// credential is refused elsewhere from the first instant, before the
/// hand-off; a child without a namespace (`off`) or a relayed one is not.
async fn created_bound() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED a_confined_childs_run_is_created_bound_to_its_listener: {why}");
        return;
    }
    let control = egress_e2e::FakeControl::start().await;
    let plain = "command = [\"true\"]\nprotocol = \"plain\"\npool = { warm = 0, max = 1 }";
    for (tool, keys, want) in [
        ("strict", "", Some(json!(true))),
        ("off", "isolation = \"off\"\n", None),
        ("relayed", "", None),
    ] {
        let dir = TempDir::new("confine-declared");
        let tools = format!("[tools.{tool}]\negress = []\n[tools.{tool}.process]\n{plain}\n{keys}");
        let cfg = if tool == "relayed" {
            exec_config(
                &dir,
                "egress.toml",
                control.addr,
                &format!("allow_relay = true\n{tools}"),
            )
        } else {
            // With the fake hand-off socket at the default path.
            egress_e2e::executor::write_config(&dir, control.addr, false, &tools)
        };
        let exec = executor(&cfg);
        let before = control.create_bodies().len();
        let res = exec
            .invoke(InvocationRequest {
                principal: None,
                tool: tool.into(),
                input: json!(null),
                run_id: None,
                idempotency_key: None,
                timeout_ms: None,
            })
            .await;
        assert!(res.error.is_none(), "{tool}: {res:#?}");
        let bodies = control.create_bodies();
        assert_eq!(bodies.len(), before + 1, "{tool}");
        assert_eq!(bodies[before].get("bound"), want.as_ref(), "{tool}: {}", bodies[before]);
        exec.shutdown();
    }
}

/// The reported attack on a real strict child: it copies its proxy URL out
/// through its scratch directory while its invocation runs, and the host
/// presents that credential on the proxy's own listener (forward, CONNECT,
/// SOCKS5). Each is `407 credential_elsewhere` (SOCKS5: status 1), nothing
/// reaches the origin, and the run's answer carries the facts (its kernel
/// sees the leak). The tool may reach the origin: before the binding, the
/// copied credential got `200` there.
async fn copied_out() {
    const NAME: &str = "a_strict_childs_credential_copied_out_is_refused_outside_its_sandbox";
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED {NAME}: {why}");
        return;
    }
    if python().is_none() {
        eprintln!("SKIPPED {NAME}: no python3");
        return;
    }
    const LEAK_PY: &str = r#"
import os, time
tmp = os.environ["TMPDIR"]
with open(os.path.join(tmp, "cred.tmp"), "w") as f:
    f.write(os.environ["HTTP_PROXY"])
os.rename(os.path.join(tmp, "cred.tmp"), os.path.join(tmp, "cred"))
for _ in range(400):
    if os.path.exists(os.path.join(tmp, "go")):
        break
    time.sleep(0.05)
print("done")
"#;
    let origin = egress_e2e::origin::http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    let dir = TempDir::new("confine-copied");
    dir.write("leak.py", LEAK_PY);
    let rule = format!("[tools.leak]\negress = [\"allowed.test:{port}\"]\n");
    let proxy = proxy_beside(&dir, &rule).await;
    proxy.dns.set("allowed.test", &["127.0.0.2"]);
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "{rule}[tools.leak.process]\ncommand = [\"python3\", \"leak.py\"]\nprotocol = \"plain\"\n\
             pool = {{ warm = 0, max = 1 }}\ntimeout_ms = 30000\n"
        ),
    );
    let exec = executor(&cfg);
    let invocation = tokio::spawn({
        let exec = exec.clone();
        async move {
            exec.invoke(InvocationRequest {
                principal: None,
                tool: "leak".into(),
                input: json!(null),
                run_id: None,
                idempotency_key: None,
                timeout_ms: None,
            })
            .await
        }
    });
    // What the child left in its scratch directory (observed, not ordered).
    let scratch = dir.path().join("scratch");
    let copied = || {
        std::fs::read_dir(&scratch)
            .ok()?
            .flatten()
            .find_map(|e| Some((e.path(), std::fs::read_to_string(e.path().join("cred")).ok()?)))
    };
    assert!(
        eventually(Duration::from_secs(20), || copied().is_some()).await,
        "the child never wrote its proxy URL"
    );
    let (child_dir, url) = copied().unwrap();
    let (id, secret) = url
        .trim_start_matches("http://")
        .rsplit_once('@')
        .and_then(|(cred, _)| cred.split_once(':'))
        .map(|(i, s)| (i.to_owned(), s.to_owned()))
        .unwrap();
    let auth = basic(&id, &secret);
    let r = egress_e2e::raw::send(
        proxy.proxy,
        format!(
            "GET http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (407, Some("credential_elsewhere")),
        "{}",
        r.text()
    );
    let (r, _) = egress_e2e::raw::connect(proxy.proxy, &format!("allowed.test:{port}"), Some(&auth)).await;
    assert_eq!((r.status, r.deny_reason()), (407, Some("credential_elsewhere")));
    let dest = egress_e2e::socks::Dest::Name("allowed.test".into(), port);
    let socks = egress_e2e::socks::negotiate(proxy.proxy, (&id, &secret), &[2], 1, &dest).await;
    assert!(matches!(socks, egress_e2e::socks::Outcome::Auth(1)), "{socks:?}");
    std::fs::write(child_dir.join("go"), "").unwrap();
    let res = invocation.await.unwrap();
    assert!(res.ok, "{res:#?}");
    assert_eq!(res.run_id.as_deref(), Some(id.as_str()));
    let leaks = res.facts.iter().filter(|f| f.reason == "credential_elsewhere");
    assert_eq!(leaks.map(|f| f.count).sum::<u64>(), 3, "{:#?}", res.facts);
    assert_eq!(origin.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    exec.shutdown();
    proxy.shutdown().await;
}

/// A configured hand-off socket that does not answer: the child is not
/// started behind the proxy's back (no silent relay), the start fails.
async fn failed_handoff() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED a_failed_hand_off_fails_the_start_loudly: {why}");
        return;
    }
    let proxy = TestProxy::start("[tools.t]\negress = []\n").await;
    let dir = TempDir::new("confine-nohandoff");
    let cfg = exec_config(
        &dir,
        "egress.toml",
        proxy.control,
        &format!(
            "proxy_handoff = \"{}\"\n[tools.t]\negress = []\n[tools.t.process]\ncommand = [\"sleep\", \"60\"]\n\
             protocol = \"plain\"\npool = {{ warm = 0, max = 1 }}\n",
            dir.path().join("no-such.sock").display()
        ),
    );
    let exec = executor(&cfg);
    let res = exec.invoke(invocation("t", json!(null))).await;
    let e = res.error.clone().unwrap_or_else(|| panic!("{res:#?}"));
    assert_eq!(e.kind, ErrorKind::Startup, "{e:?}");
    assert!(
        e.message
            .contains("cannot hand the child's proxy listener to the proxy"),
        "{e:?}"
    );
    proxy.shutdown().await;
}

/// The hand-off on its own (no child): the proxy serves a handed-off listener
/// for its run only, refuses another run's credential there, refuses to adopt
/// for an unknown run or a socket that is not listening, and closes the
/// listener when the run ends.
async fn handoff_protocol() {
    use egress_e2e::harness::basic;
    let dns = FakeDns::start().await;
    let origin = http_origin("127.0.0.2:0").await;
    let dir = TempDir::new("handoff");
    let sock = dir.path().join("handoff.sock");
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\nfacts = \":memory:\"\nhandoff = \"{}\"\n\
         allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n[tools.t]\negress = [\"127.0.0.2:{}\"]\n",
        sock.display(),
        dns.addr,
        origin.addr.port()
    );
    let proxy = TestProxy::start_config(dns, &text, None, None).await;
    let run = proxy.run("t").await;
    let other = proxy.run("t").await;

    // Unknown run, and a socket that is not listening: refused.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = egress_executor::proxy::handoff::send(&sock, "no-such-run", &l)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no such run"), "{e}");
    let not_listening = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let fake = std::net::TcpListener::from(std::os::fd::OwnedFd::from(not_listening));
    let e = egress_executor::proxy::handoff::send(&sock, &run.id, &fake)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not a listening socket"), "{e}");

    let addr = l.local_addr().unwrap();
    egress_executor::proxy::handoff::send(&sock, &run.id, &l).await.unwrap();
    drop(l); // the proxy holds the only copy now
    let port = origin.addr.port();
    let get = |id: String, secret: String| async move {
        let req = format!(
            "GET http://127.0.0.2:{port}/ HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nProxy-Authorization: {}\r\nConnection: close\r\n\r\n",
            basic(&id, &secret),
        );
        egress_e2e::raw::send(addr, req.as_bytes()).await
    };
    let ok = get(run.id.clone(), run.secret.clone()).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let stolen = get(other.id.clone(), other.secret.clone()).await;
    assert_eq!(stolen.status, 407, "{}", stolen.text());
    assert_eq!(stolen.header("x-egress-deny-reason"), Some("auth_invalid"));
    let facts = proxy.facts().await;
    let f = facts
        .iter()
        .rev()
        .find(|f| f.reason == "auth_invalid")
        .expect("an auth_invalid fact");
    assert_eq!(
        f.run_id.as_deref(),
        Some(run.id.as_str()),
        "recorded against the bound run"
    );

    // The run ends: the listener is closed.
    proxy.end(&run).await;
    assert!(
        eventually(Duration::from_secs(5), || std::net::TcpStream::connect(addr).is_err()).await,
        "the handed-off listener still accepts after its run ended"
    );
    proxy.shutdown().await;
}

/// A tool whose directory only root can enter: the start fails and says
/// which uid the child runs as and what it may read.
async fn private_tool_dir() {
    if let Some(why) = unsupported() {
        eprintln!("SKIPPED a_tool_directory_the_child_cannot_enter_is_a_clear_startup_error: {why}");
        return;
    }
    let dir = TempDir::new("confine-private");
    let proxy = proxy_beside(&dir, "[tools.t]\negress = []\n[tools.f]\negress = []\n").await;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    dir.write("tool.py", "def run(input):\n    return input\n");
    let scratch = TempDir::new("confine-private-scratch");
    let cfg = dir.write(
        "egress.toml",
        &format!(
            "[proxy]\ncontrol = \"{}\"\nfacts = \"var/f.db\"\n[executor]\nscratch_dir = \"{}\"\n\
             [tools.t]\negress = []\n[tools.t.process]\ncommand = [\"python3\", \"{r}\", \"tool.py\"]\n\
             pool = {{ warm = 0, max = 1 }}\n\
             [tools.f]\negress = []\n[tools.f.process]\ncommand = [\"python3\", \"{r}\", \"tool.py\"]\n\
             pool = {{ warm = 0, max = 1 }}\nfork_server = true\n",
            proxy.control,
            scratch.path().display(),
            r = python_runner().display(),
        ),
    );
    let exec = executor(&cfg);
    // Exec'd, and forked by its fork server (whose child fails the same
    // step, after its uid change, and says so).
    for tool in ["t", "f"] {
        let res = exec.invoke(invocation(tool, json!(1))).await;
        let e = res.error.clone().unwrap_or_else(|| panic!("{res:#?}"));
        assert_eq!(
            (e.kind, e.phase),
            (ErrorKind::Startup, Some(egress_executor::Phase::Spawn)),
            "{e:?}"
        );
        assert!(
            e.message.contains("Permission denied") && e.message.contains("runs as uid 65534"),
            "{e:?}"
        );
        if tool == "f" {
            assert!(
                e.message.contains("changing to the working directory") && e.message.contains("fork server"),
                "{e:?}"
            );
        }
    }
    proxy.shutdown().await;
}
